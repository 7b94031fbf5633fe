//! The operator console in a real browser: Debian's headless Chromium, driven
//! over WebDriver by its ChromeDriver (test-support/src/browser.rs), against a
//! console on the real PostgreSQL and RabbitMQ. An operator signs in, resolves
//! an unknown and sees the next attempt, replays a dead letter, qualifies a
//! provider and watches a hedge; a tenant's token does not sign in; a form
//! without its CSRF token, or posted from another site, does nothing. The last
//! test takes the book's screenshots (docs/src/images/console/).

use onejob_test_support as common;

use std::sync::Arc;
use std::time::Duration;

use common::browser::Browser;
use common::console::{Served, dead_letter_intent, serve, two_providers, unknown_job};
use common::{TestEnv, config, mock, submit, wait_for, wait_for_status};
use onejob::domain::{AttemptStatus, JobId, JobStatus};
use onejob::edges::store::Store;
use onejob::mock::MockOptions;
use onejob::settings::config::Config;
use onejob::settings::token::Token;
use serde_json::json;

/// Signs `name` in through the sign-in form, with a new operator token.
async fn sign_in(browser: &Browser, served: &Served, store: &Store, name: &str) {
    let token = Token::generate_operator();
    store
        .tokens()
        .create_operator_token(name, &token, &onejob::edges::store::Actor::cli(None))
        .await
        .unwrap();
    browser.goto(&format!("{}/login", served.base)).await;
    browser
        .type_into(&browser.find("#token").await, token.reveal())
        .await;
    browser.click(&browser.find("#sign-in").await).await;
    browser.wait_for_text(&format!("signed in as {name}")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_resolves_an_unknown_and_sees_the_next_attempt() {
    let (config, _file) = config(&two_providers());
    let env = TestEnv::new(&config).await;
    let ctx = env.context(config.clone()).await;
    let served = serve(&env, config, false).await;
    let (job_id, s) = unknown_job(&env.store, "browser-resolve").await;
    let browser = Browser::start().await;
    sign_in(&browser, &served, &env.store, "ada").await;

    // The session cookie is the browser's, and scripts cannot read it.
    let cookies = browser.cookies().await;
    let cookie = cookies
        .iter()
        .find(|c| c["name"] == onejob::operator::console::COOKIE)
        .unwrap_or_else(|| panic!("no session cookie in {cookies:?}"));
    assert_eq!(cookie["httpOnly"], true, "{cookie}");
    assert_eq!(cookie["sameSite"], "Strict", "{cookie}");
    let seen = browser.execute("return document.cookie;", json!([])).await;
    assert_eq!(seen, "", "document.cookie shows nothing");

    // The overview says an unknown is waiting; the unknowns page names it.
    browser
        .click(&browser.find("a[href='/unknowns']").await)
        .await;
    let page = browser.wait_for_text("req_console_1").await;
    assert!(page.contains(&s.attempt_id.to_string()), "{page}");

    // "as failed…" leads to a confirmation that says what follows.
    browser.click(&browser.find("a.resolve-failed").await).await;
    let page = browser.wait_for_text("attempt #2 on primary").await;
    assert!(page.contains("Reason"), "{page}");
    browser
        .type_into(
            &browser.find("#reason").await,
            "the provider's log shows the call never ran",
        )
        .await;
    browser.click(&browser.find("#confirm").await).await;

    // The job's page: attempt #1 failed, #2 queued on the primary, the
    // operator's reason in the audit.
    browser.wait_for_text("#2 primary · queued").await;
    assert!(browser.url().await.ends_with(&format!("/jobs/{job_id}")));
    assert_eq!(browser.text("#status").await, "running");
    let audit = browser.text("#audit").await;
    assert!(
        audit.contains("operator:ada")
            && audit.contains("the provider's log shows the call never ran"),
        "{audit}"
    );
    let events = browser.text("#events").await;
    assert!(events.contains("#1 ended failed"), "{events}");
    assert!(events.contains("#2 queued for primary"), "{events}");

    let job = env.store.jobs().job(job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Running);
    assert_eq!(
        job.attempts.iter().map(|a| a.status).collect::<Vec<_>>(),
        [AttemptStatus::Failed, AttemptStatus::Queued]
    );
    // Attempt #2 takes its turn: the primary's workers hand it out (here,
    // the test does, as no attempt consumer runs).
    assert_eq!(env.hand_out(&ctx, "primary").await, 1);
    let amqp = env.amqp().await;
    let ch = amqp.create_channel().await.unwrap();
    common::wait_for_depth(
        "attempt #2's message",
        Duration::from_secs(20),
        &ch,
        &onejob::broker::attempts_queue("primary"),
        1,
    )
    .await;
    browser.quit().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_replays_a_dead_letter() {
    let (config, _file) = config(&two_providers());
    let env = TestEnv::new(&config).await;
    let fleet = env
        .fleet(config.clone(), vec![onejob::fleet::Role::Intake])
        .await;
    let served = serve(&env, config, false).await;
    dead_letter_intent(&env, "dead-1", "acct_b", "replay-me").await;
    let browser = Browser::start().await;
    sign_in(&browser, &served, &env.store, "grace").await;

    // The overview counts it.
    let dlq = onejob::broker::dead_letter_queue(onejob::broker::INTENTS_QUEUE);
    let depths = browser.text("#dead-letter-depths").await;
    assert!(depths.contains(&format!("1\n{dlq}")), "{depths}");

    browser
        .click(&browser.find("a[href='/dead-letters']").await)
        .await;
    let page = browser.wait_for_text("dead-1").await;
    assert!(page.contains("invalid: a test put it here"), "{page}");
    browser.click(&browser.find("a.replay-one").await).await;
    browser
        .wait_for_text("Republish the dead letter dead-1")
        .await;
    browser
        .type_into(&browser.find("#reason").await, "the intake bug is fixed")
        .await;
    browser.click(&browser.find("#confirm").await).await;
    browser
        .wait_for_text("1 dead letter(s) replayed, 0 skipped")
        .await;

    // Gone from the queue, admitted as a job, and audited.
    let amqp = env.amqp().await;
    let ch = amqp.create_channel().await.unwrap();
    common::wait_for_depth(
        "the emptied dead letters",
        Duration::from_secs(10),
        &ch,
        &dlq,
        0,
    )
    .await;
    wait_for(
        "the replayed intent's job",
        Duration::from_secs(20),
        || async {
            env.store
                .jobs()
                .find("acct_b", "replay-me")
                .await
                .unwrap()
                .map(|_| ())
        },
    )
    .await;
    let audit = env.store.audit().recent(10).await.unwrap();
    assert!(
        audit.iter().any(|a| a.action == "dlq.replay"
            && a.actor == "operator:grace"
            && a.reason == "the intake bug is fixed"),
        "{audit:?}"
    );
    browser.quit().await;
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_token_does_not_sign_in() {
    let (config, _file) = config(&two_providers());
    let env = TestEnv::new(&config).await;
    let served = serve(&env, config, false).await;
    let tenant = Token::generate();
    env.store
        .tokens()
        .create_token("acct_t", &tenant, &onejob::edges::store::Actor::cli(None))
        .await
        .unwrap();
    let browser = Browser::start().await;

    browser.goto(&format!("{}/login", served.base)).await;
    browser
        .type_into(&browser.find("#token").await, tenant.reveal())
        .await;
    browser.click(&browser.find("#sign-in").await).await;
    let page = browser
        .wait_for_text("the console takes only operator tokens")
        .await;
    assert!(page.contains("That is a tenant's gateway token"), "{page}");
    let cookies = browser.cookies().await;
    assert!(
        cookies
            .iter()
            .all(|c| c["name"] != onejob::operator::console::COOKIE),
        "no session cookie: {cookies:?}"
    );

    // Every page still sends it back to sign in.
    browser.goto(&format!("{}/unknowns", served.base)).await;
    browser
        .wait_for_text("Sign in with an operator token")
        .await;
    assert!(browser.url().await.ends_with("/login"));
    browser.quit().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_action_without_its_csrf_token_does_nothing() {
    let (config, _file) = config(&two_providers());
    let env = TestEnv::new(&config).await;
    let served = serve(&env, config, false).await;
    let (job_id, s) = unknown_job(&env.store, "browser-csrf").await;
    let browser = Browser::start().await;
    sign_in(&browser, &served, &env.store, "ada").await;
    let still_unknown = || async {
        let job = env.store.jobs().job(job_id).await.unwrap().unwrap();
        assert_eq!(job.status, JobStatus::Unknown);
        assert_eq!(job.attempts.len(), 1);
        assert!(env.store.audit().of_job(job_id).await.unwrap().is_empty());
    };

    // The confirmation's form, with its token taken out, then with another
    // token in its place: refused, and nothing is done.
    let confirm = format!(
        "{}/attempts/{}/resolve?as=cancelled",
        served.base, s.attempt_id
    );
    for tamper in [
        "document.querySelector(\"form.confirm input[name=csrf]\").remove();",
        "document.querySelector(\"form.confirm input[name=csrf]\").value = 'f'.repeat(64);",
    ] {
        browser.goto(&confirm).await;
        browser.wait_for_text("becomes cancelled").await;
        browser.execute(tamper, json!([])).await;
        browser
            .type_into(&browser.find("#reason").await, "forged")
            .await;
        browser.click(&browser.find("#confirm").await).await;
        let page = browser.wait_for_text("CSRF token is missing").await;
        assert!(page.contains("nothing was done"), "{page}");
        assert_eq!(browser.title().await, "Forbidden · onejob console");
        still_unknown().await;
    }

    // A page of another site that posts the same form: the browser does not
    // send the SameSite=Strict cookie along, so the console asks to sign in.
    let forged = format!(
        "<form method=post action='{}/attempts/{}/resolve'>\
         <input name=as value=cancelled><input name=reason value=forged></form>\
         <script>document.forms[0].submit()</script>",
        served.base, s.attempt_id
    );
    browser
        .goto(&format!("data:text/html,{}", urlencode(&forged)))
        .await;
    browser
        .wait_for_text("Sign in with an operator token")
        .await;
    still_unknown().await;

    // The untouched form still works: the refusals were the token's doing.
    browser.goto(&confirm).await;
    browser
        .type_into(
            &browser.find("#reason").await,
            "duplicate of a job done by hand",
        )
        .await;
    browser.click(&browser.find("#confirm").await).await;
    browser.wait_for_text("did attempt.resolve_cancelled").await;
    wait_for("the job cancelled", Duration::from_secs(10), || async {
        let job = env.store.jobs().job(job_id).await.unwrap().unwrap();
        (job.status == JobStatus::Cancelled).then_some(())
    })
    .await;
    browser.quit().await;
}

/// Percent-encodes `text` for a `data:` address.
fn urlencode(text: &str) -> String {
    url::form_urlencoded::byte_serialize(text.as_bytes())
        .collect::<String>()
        .replace('+', "%20")
}

/// A provider is qualified from its page, a job is then hedged onto it, and
/// the job's page draws the hedge on its own lane with the job's events. The
/// main pages are saved as PNGs along the way (`target/console-screenshots/`,
/// or `$ONEJOB_SCREENSHOTS`): the book shows them, from docs/src/images/console/.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn qualify_now_then_a_hedge_on_its_own_lane_and_the_main_pages() {
    let slow = mock(MockOptions {
        delay: Duration::from_secs(2),
        tag: Some("primary".into()),
        ..MockOptions::default()
    })
    .await;
    let quick = mock(MockOptions {
        tag: Some("fallback".into()),
        ..MockOptions::default()
    })
    .await;
    let (p, f) = (slow.base_url(), quick.base_url());
    let (config, _file) = config(&common::hedged_config(&p, &f));
    let env = TestEnv::new(&config).await;
    let served = serve(&env, config.clone(), false).await;
    let shots = Shots::new();
    let browser = Browser::start().await;
    sign_in(&browser, &served, &env.store, "ada").await;

    qualify_the_fallback(&browser, &env.store).await;
    shots.take(&browser, "providers").await;

    let hedged = a_hedged_job_and_some_more(&env, &config).await;

    the_hedge_has_a_lane_of_its_own(&browser, &served, hedged).await;
    shots.take(&browser, "job").await;

    for (path, name, shows) in [
        ("/", "overview", "Jobs by status"),
        ("/jobs", "jobs", "acct_a"),
        ("/unknowns", "unknowns", "req_console_1"),
        ("/dead-letters", "dead-letters", "dead-1"),
    ] {
        browser.goto(&format!("{}{path}", served.base)).await;
        browser.wait_for_text(shows).await;
        shots.take(&browser, name).await;
    }
    browser.goto(&format!("{}/login", served.base)).await;
    shots.take(&browser, "sign-in").await;
    browser.quit().await;
}

/// The fallback has never qualified: it takes no failover and no hedge.
/// It qualifies from its page, and the run is audited.
async fn qualify_the_fallback(browser: &Browser, store: &Store) {
    browser
        .click(&browser.find("a[href='/providers']").await)
        .await;
    let page = browser.wait_for_text("never qualified").await;
    assert!(page.contains("fallback"), "{page}");
    let links = browser.find_all("a.qualify").await;
    assert_eq!(links.len(), 2, "one per provider and operation");
    browser
        .click(&browser.find("a.qualify[href*='provider=fallback']").await)
        .await;
    browser.wait_for_text("Send the 1 golden case(s)").await;
    browser
        .type_into(&browser.find("#reason").await, "new fallback for summarize")
        .await;
    browser.click(&browser.find("#confirm").await).await;
    let page = browser
        .wait_for_text("fallback for summarize: qualified (1 of 1 case(s) passed)")
        .await;
    assert!(page.contains("1 of 1 passed"), "{page}");
    let audit = store.audit().recent(5).await.unwrap();
    assert!(
        audit.iter().any(|a| a.action == "provider.qualify"
            && a.target.as_deref() == Some("fallback/summarize")
            && a.detail["qualified"] == true),
        "{audit:?}"
    );
}

/// A job on the slow primary is hedged onto the fallback, which wins.
/// Some more jobs follow for the overview and the list, one of them unknown,
/// and a dead letter; the hedged job.
async fn a_hedged_job_and_some_more(env: &TestEnv, config: &Arc<Config>) -> JobId {
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = onejob_producer::Producer::connect(&env.amqp_url)
        .await
        .unwrap();
    let hedged = submit(&producer, "acct_h", "hedged", "hedge me").await;
    wait_for_status(env, hedged, JobStatus::Succeeded).await;
    wait_for(
        "the primary's late result",
        Duration::from_secs(20),
        || async {
            let j = env.store.jobs().job(hedged).await.unwrap().unwrap();
            j.attempts
                .iter()
                .any(|a| a.status == AttemptStatus::Discarded)
                .then_some(())
        },
    )
    .await;
    // Some more jobs for the overview and the list; one of them unknown, and
    // a dead letter.
    for i in 0..6 {
        submit(&producer, "acct_a", &format!("k{i}"), "a short text").await;
    }
    unknown_job(&env.store, "blocked").await;
    dead_letter_intent(env, "dead-1", "acct_b", "replay-me").await;
    wait_for("the jobs to end", Duration::from_secs(30), || async {
        let o = env.store.jobs().overview().await.unwrap();
        let open: i64 = o
            .jobs
            .iter()
            .filter(|(s, _)| s == "queued" || s == "running")
            .map(|(_, n)| n)
            .sum();
        (open == 0).then_some(())
    })
    .await;
    fleet.stop().await;
    hedged
}

/// The hedged job's page draws the hedge on a lane of its own, beside the
/// job's events.
async fn the_hedge_has_a_lane_of_its_own(browser: &Browser, served: &Served, hedged: JobId) {
    browser
        .goto(&format!("{}/jobs/{hedged}", served.base))
        .await;
    browser
        .wait_for_text("#2 fallback · succeeded · hedge · winner")
        .await;
    let lanes = browser.find_all("#timeline .lane").await;
    assert_eq!(lanes.len(), 2, "the hedge runs on a lane of its own");
    assert!(
        browser
            .text_of(&lanes[0])
            .await
            .contains("#1 primary · discarded")
    );
    let events = browser.text("#events").await;
    assert!(events.contains("#2 queued for fallback"), "{events}");
    let event = events
        .lines()
        .find(|l| l.contains("event job.succeeded"))
        .unwrap_or_else(|| panic!("no job.succeeded event in:\n{events}"));
    assert!(event.contains("published at"), "{event}");
}

/// Where the screenshots go.
struct Shots(std::path::PathBuf);

impl Shots {
    fn new() -> Shots {
        let dir = std::env::var_os("ONEJOB_SCREENSHOTS")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| {
                std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/console-screenshots")
            });
        std::fs::create_dir_all(&dir).unwrap();
        Shots(dir)
    }

    /// Saves the whole page as `NAME.png`; it must be a PNG the width of the
    /// window.
    async fn take(&self, browser: &Browser, name: &str) {
        let png = browser.full_screenshot().await;
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "{name}: not a PNG");
        let width = u32::from_be_bytes(png[16..20].try_into().unwrap());
        assert_eq!(width, 1280, "{name}: the window's width");
        std::fs::write(self.0.join(format!("{name}.png")), png).unwrap();
    }
}
