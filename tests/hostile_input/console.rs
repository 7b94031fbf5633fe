//! The console's answers: no framing, caching or inline code; sign-ins
//! throttled; expired sessions swept; a silent broker costs a short wait.

use crate::common::{self, TestEnv, config};

/// Every answer of the console, signed in or not, page or error or redirect
/// or stylesheet, forbids framing and caching and allows no inline script or
/// style: what a page shows cannot be framed by another site, left in a
/// shared cache, or turned into script by text that slipped through.
#[tokio::test]
async fn every_console_answer_forbids_framing_caching_and_inline_code() {
    use common::console::{serve, two_providers, unknown_job};
    use reqwest::header::COOKIE;

    let (config, _file) = config(&two_providers());
    let env = TestEnv::new(&config).await;
    let served = serve(&env, config, false).await;
    let session = served.sign_in(&env.store, "ada").await;
    let (job, started) = unknown_job(&env.store, "k-frames").await;
    let attempt = started.attempt_id;

    let signed_in = [
        "/".to_owned(),
        "/jobs".to_owned(),
        format!("/jobs/{job}"),
        "/unknowns".to_owned(),
        format!("/attempts/{attempt}/resolve?as=failed"),
        "/dead-letters".to_owned(),
        "/dead-letters/confirm?action=replay&queue=onejob.intents.dlq".to_owned(),
        "/providers".to_owned(),
        "/providers/qualify?provider=primary".to_owned(),
        "/no-such-page".to_owned(),
        "/static/console.css".to_owned(),
    ];
    let mut answers = Vec::new();
    for path in &signed_in {
        let answer = served
            .http
            .get(format!("{}{path}", served.base))
            .header(COOKIE, &session.cookie)
            .send()
            .await
            .unwrap();
        answers.push((format!("GET {path} (signed in)"), answer));
    }
    for path in ["/login", "/", "/jobs"] {
        let answer = served
            .http
            .get(format!("{}{path}", served.base))
            .send()
            .await
            .unwrap();
        answers.push((format!("GET {path} (signed out)"), answer));
    }
    let refused = served
        .post(&session.cookie, "/logout", &[("csrf", "forged")])
        .await;
    answers.push(("POST /logout (forged)".to_owned(), refused));

    for (what, answer) in answers {
        let h = answer.headers().clone();
        let get = |name: &str| {
            h.get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned()
        };
        assert_eq!(get("x-frame-options"), "DENY", "{what}");
        let csp = get("content-security-policy");
        for directive in [
            "default-src 'none'",
            "frame-ancestors 'none'",
            "form-action 'self'",
            "base-uri 'none'",
            "style-src 'self'",
        ] {
            assert!(csp.contains(directive), "{what}: {directive} in {csp:?}");
        }
        assert!(!csp.contains("unsafe-inline"), "{what}: {csp}");
        assert!(get("cache-control").contains("no-store"), "{what}");
        assert_eq!(get("x-content-type-options"), "nosniff", "{what}");
        assert_eq!(get("referrer-policy"), "no-referrer", "{what}");
        let body = answer.text().await.unwrap().to_ascii_lowercase();
        assert!(!body.contains("<script"), "{what}: inline script");
        assert!(!body.contains(" style="), "{what}: inline style");
        assert!(!body.contains("<style"), "{what}: inline style");
    }
}

/// Sign-in is throttled per client: past the allowance, an attempt is
/// refused at once (429, with when to retry) before the database is asked,
/// even with a good token.
#[tokio::test]
async fn sign_in_is_throttled_per_client() {
    use common::console::{serve_with, two_providers};
    use onejob::settings::token::Token;

    let (config, _file) = config(&two_providers());
    let env = TestEnv::new(&config).await;
    let served = serve_with(&env, config, |o| o.sign_ins_per_minute = 5).await;
    let good = Token::generate_operator();
    env.store
        .tokens()
        .create_operator_token("ada", &good, &onejob::edges::store::Actor::cli(None))
        .await
        .unwrap();
    let wrong = Token::generate_operator();
    for _ in 0..5 {
        let answer = served.login(wrong.reveal()).await;
        assert_eq!(answer.status(), reqwest::StatusCode::UNAUTHORIZED);
    }
    let answer = served.login(good.reveal()).await;
    assert_eq!(answer.status(), reqwest::StatusCode::TOO_MANY_REQUESTS);
    assert!(answer.headers().contains_key("retry-after"));
    assert!(
        common::console::session_set(&answer).is_none(),
        "not signed in"
    );
    let text = answer.text().await.unwrap();
    assert!(text.contains("Too many sign-in attempts"), "{text}");
}

/// Sessions past their expiry are deleted by a timer, not only when someone
/// next signs in.
#[tokio::test]
async fn expired_sessions_are_swept_on_a_timer() {
    use common::console::{serve_with, two_providers};

    let (config, _file) = config(&two_providers());
    let env = TestEnv::new(&config).await;
    let served = serve_with(&env, config, |o| {
        o.session_ttl = std::time::Duration::from_secs(1);
        o.session_sweep = std::time::Duration::from_millis(200);
    })
    .await;
    served.sign_in(&env.store, "ada").await;
    common::wait_for(
        "the expired session to be deleted",
        std::time::Duration::from_secs(20),
        || async {
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM operator_sessions")
                .fetch_one(env.store.pool())
                .await
                .unwrap();
            (n == 0).then_some(())
        },
    )
    .await;
}

/// A broker that accepts connections and never answers (a network partition,
/// a wedged node) costs the console's overview a short wait, not the page:
/// it shows with the reason, and the dead-letter page says so too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_overview_does_not_wait_out_a_silent_broker() {
    use common::console::{serve_with, two_providers};

    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_url = format!("amqp://guest:guest@{}/%2f", silent.local_addr().unwrap());
    let held = tokio::spawn(async move {
        let mut kept = Vec::new();
        while let Ok((c, _)) = silent.accept().await {
            kept.push(c);
        }
    });
    let (config, _file) = config(&two_providers());
    let env = TestEnv::new(&config).await;
    let served = serve_with(&env, config, |o| o.amqp_url = silent_url).await;
    let session = served.sign_in(&env.store, "ada").await;
    for path in ["/", "/dead-letters"] {
        let (status, page) = tokio::time::timeout(
            std::time::Duration::from_secs(15),
            served.get(&session.cookie, path),
        )
        .await
        .unwrap_or_else(|_| panic!("{path} waited on the broker"));
        assert!(page.contains("did not answer"), "{path}: {status} {page}");
    }
    held.abort();
}
