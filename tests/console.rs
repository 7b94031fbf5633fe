//! The operator console over real HTTP, on the real PostgreSQL and RabbitMQ:
//! sign-in takes operator tokens and nothing else, the session cookie's flags,
//! CSRF on actions, resolving an unknown with a reason (audited, the next
//! attempt planned and published), and the job list paged by keyset.

mod common;

use std::time::Duration;

use common::console::{
    FORM, encode, field, serve, session_set, two_providers, unescape, unknown_job,
};
use common::{TestEnv, config};
use onejob::domain::{AttemptStatus, JobStatus};
use onejob::token::Token;
use reqwest::StatusCode;
use reqwest::header::{CONTENT_TYPE, LOCATION, SET_COOKIE};
use sqlx::Connection;

#[tokio::test]
async fn only_a_live_operator_token_signs_in() {
    let (config, _file) = config(&two_providers());
    let env = TestEnv::new(&config).await;
    let served = serve(&env, config, false).await;

    // A tenant's gateway token is refused, and says why.
    let tenant = Token::generate();
    env.store
        .create_token("acct_c", &tenant, &onejob::store::Actor::cli(None))
        .await
        .unwrap();
    let answer = served.login(tenant.reveal()).await;
    assert_eq!(answer.status(), StatusCode::UNAUTHORIZED);
    assert!(session_set(&answer).is_none());
    assert!(answer.text().await.unwrap().contains("tenant"));

    // So are an operator token nobody made, and garbage.
    for bad in [
        Token::generate_operator().reveal().to_owned(),
        "ojo_123".into(),
        String::new(),
    ] {
        let answer = served.login(&bad).await;
        assert_eq!(answer.status(), StatusCode::UNAUTHORIZED, "{bad:?}");
        assert!(session_set(&answer).is_none());
    }

    // Without a session every page sends the browser to sign in.
    for path in ["/", "/jobs", "/unknowns"] {
        let answer = served
            .http
            .get(format!("{}{path}", served.base))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::SEE_OTHER, "{path}");
        assert_eq!(answer.headers()[LOCATION], "/login");
    }
    let forged = served.get("onejob_console=00ff", "/").await;
    assert_eq!(forged.0, StatusCode::SEE_OTHER);

    // An operator token signs in; the cookie is HttpOnly and SameSite=Strict,
    // and not Secure over plain HTTP.
    let token = Token::generate_operator();
    let id = env
        .store
        .create_operator_token("ada", &token, &onejob::store::Actor::cli(None))
        .await
        .unwrap();
    let answer = served.login(token.reveal()).await;
    assert_eq!(answer.status(), StatusCode::SEE_OTHER);
    let set = session_set(&answer).unwrap();
    assert!(
        set.contains("HttpOnly") && set.contains("SameSite=Strict"),
        "{set}"
    );
    assert!(!set.contains("Secure"), "{set}");
    let cookie = set.split(';').next().unwrap().to_owned();
    let (status, page) = served.get(&cookie, "/").await;
    assert_eq!(status, StatusCode::OK);
    assert!(page.contains("ada"), "the overview names the operator");

    // Behind TLS the cookie is Secure.
    let answer = served
        .login_with(token.reveal(), &[("x-forwarded-proto", "https")])
        .await;
    assert_eq!(answer.status(), StatusCode::SEE_OTHER);
    assert!(session_set(&answer).unwrap().contains("Secure"));

    // Revoking the token ends its sessions at once.
    env.store
        .revoke_operator_token(id, &onejob::store::Actor::cli(None))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(served.get(&cookie, "/").await.0, StatusCode::SEE_OTHER);
    assert_eq!(
        served.login(token.reveal()).await.status(),
        StatusCode::UNAUTHORIZED
    );
}

#[tokio::test]
async fn an_action_without_its_csrf_token_is_refused_and_does_nothing() {
    let (config, _file) = config(&two_providers());
    let env = TestEnv::new(&config).await;
    let served = serve(&env, config, false).await;
    let (job_id, s) = unknown_job(&env.store, "csrf-1").await;
    let session = served.sign_in(&env.store, "ada").await;
    let other = served.sign_in(&env.store, "bob").await;
    let path = format!("/attempts/{}/resolve", s.attempt_id);
    for csrf in [None, Some(""), Some("0123"), Some(other.csrf.as_str())] {
        let mut form = vec![
            ("as", "failed"),
            ("reason", "the provider says it never ran"),
        ];
        if let Some(c) = csrf {
            form.push(("csrf", c));
        }
        let answer = served.post(&session.cookie, &path, &form).await;
        assert_eq!(answer.status(), StatusCode::FORBIDDEN, "{csrf:?}");
        assert!(answer.text().await.unwrap().contains("CSRF"));
    }
    // The right token, in a form the browser says another site's page sent
    // (a page cannot set Sec-Fetch-Site): refused too.
    for site in ["cross-site", "same-site"] {
        let answer = served
            .http
            .post(format!("{}{path}", served.base))
            .header(reqwest::header::COOKIE, &session.cookie)
            .header("sec-fetch-site", site)
            .header(CONTENT_TYPE, FORM)
            .body(encode(&[
                ("as", "failed"),
                ("reason", "from a sibling host"),
                ("csrf", &session.csrf),
            ]))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::FORBIDDEN, "{site}");
    }
    // Signing out needs it too.
    let answer = served.post(&session.cookie, "/logout", &[]).await;
    assert_eq!(answer.status(), StatusCode::FORBIDDEN);
    let job = env.store.job(job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Unknown, "nothing was resolved");
    assert_eq!(job.attempts.len(), 1);
    assert!(env.store.audit_of_job(job_id).await.unwrap().is_empty());
    // A reason is required as well.
    let answer = served
        .post(
            &session.cookie,
            &path,
            &[("as", "failed"), ("reason", " "), ("csrf", &session.csrf)],
        )
        .await;
    assert_eq!(answer.status(), StatusCode::BAD_REQUEST);
    assert_eq!(
        env.store.job(job_id).await.unwrap().unwrap().status,
        JobStatus::Unknown
    );
    // With its own token, signing out works and ends the session.
    let answer = served
        .post(&session.cookie, "/logout", &[("csrf", &session.csrf)])
        .await;
    assert_eq!(answer.status(), StatusCode::SEE_OTHER);
    assert_eq!(
        served.get(&session.cookie, "/").await.0,
        StatusCode::SEE_OTHER
    );
}

#[tokio::test]
async fn an_operator_resolves_an_unknown_with_a_reason_and_the_next_attempt_appears() {
    let (config, _file) = config(&two_providers());
    let env = TestEnv::new(&config).await;
    let served = serve(&env, config, false).await;
    let (job_id, s) = unknown_job(&env.store, "resolve-1").await;
    let session = served.sign_in(&env.store, "ada").await;

    // The unknowns page lists it, with its age and the provider's request id.
    let (status, page) = served.get(&session.cookie, "/unknowns").await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        page.contains(&s.attempt_id.to_string()) && page.contains("req_console_1"),
        "{page}"
    );

    // The confirmation says what follows: the fallback is not qualified, so
    // the route rule tries the primary again after its backoff.
    let path = format!("/attempts/{}/resolve", s.attempt_id);
    let (status, page) = served
        .get(&session.cookie, &format!("{path}?as=failed"))
        .await;
    assert_eq!(status, StatusCode::OK);
    assert!(page.contains("attempt #2 on primary"), "{page}");
    let csrf = field(&page, "csrf");
    assert_eq!(csrf, session.csrf);

    let answer = served
        .post(
            &session.cookie,
            &path,
            &[
                ("as", "failed"),
                ("reason", "provider confirms it never ran"),
                ("csrf", &csrf),
            ],
        )
        .await;
    assert_eq!(answer.status(), StatusCode::SEE_OTHER);
    assert_eq!(
        answer.headers()[LOCATION],
        format!("/jobs/{job_id}").as_str()
    );

    // The job runs again: attempt #2 is queued, and its message is on the
    // primary's queue.
    let job = env.store.job(job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Running, "no longer blocked");
    assert_eq!(job.attempts.len(), 2);
    assert_eq!(job.attempts[0].status, AttemptStatus::Failed);
    assert_eq!(job.attempts[1].status, AttemptStatus::Queued);
    assert_eq!(job.attempts[1].provider, "primary");
    let conn = env.amqp().await;
    let ch = conn.create_channel().await.unwrap();
    common::wait_for_depth(
        "the next attempt's message",
        Duration::from_secs(20),
        &ch,
        &onejob::broker::attempts_queue("primary"),
        1,
    )
    .await;

    // The job's page shows both attempts and the audit row.
    let (status, page) = served
        .get(&session.cookie, &format!("/jobs/{job_id}"))
        .await;
    assert_eq!(status, StatusCode::OK);
    assert!(page.contains(&job.attempts[1].id.to_string()), "{page}");
    assert!(page.contains("provider confirms it never ran") && page.contains("operator:ada"));
    let audit = env.store.audit_of_job(job_id).await.unwrap();
    assert_eq!(audit.len(), 1);
    assert_eq!(audit[0].actor, "operator:ada");
    assert_eq!(audit[0].action, "attempt.resolve_failed");
    assert_eq!(audit[0].attempt_id, Some(s.attempt_id.0));
    assert_eq!(
        audit[0].detail["next_attempt"],
        serde_json::json!(job.attempts[1].id)
    );

    // Resolving it again is refused: it is not unknown any more.
    let answer = served
        .post(
            &session.cookie,
            &path,
            &[("as", "cancelled"), ("reason", "twice"), ("csrf", &csrf)],
        )
        .await;
    assert_eq!(answer.status(), StatusCode::CONFLICT);
    assert_eq!(env.store.audit_of_job(job_id).await.unwrap().len(), 1);
}

#[tokio::test]
async fn the_job_list_pages_by_keyset_with_its_filters() {
    let (config, _file) = config(&two_providers());
    let env = TestEnv::new(&config).await;
    let served = serve(&env, config, false).await;
    let session = served.sign_in(&env.store, "ada").await;
    let mut db = sqlx::PgConnection::connect(&env.database_url)
        .await
        .unwrap();
    // 120 ended jobs (every 20th cancelled, 3 in 20 failed), newest first by id.
    common::fill_jobs(&mut db, "page-", 120, "mix", 60.0, 60.0, "summarize").await;
    let ids = |page: &str| -> Vec<String> {
        page.match_indices("href=\"/jobs/")
            .map(|(i, _)| page[i + 12..i + 48].to_owned())
            .collect()
    };
    let mut seen = Vec::new();
    let mut path = "/jobs".to_owned();
    let mut pages = 0;
    loop {
        let (status, page) = served.get(&session.cookie, &path).await;
        assert_eq!(status, StatusCode::OK, "{page}");
        seen.extend(ids(&page));
        pages += 1;
        match page.find("id=\"next\" href=\"") {
            Some(i) => {
                let rest = &page[i + 16..];
                path = unescape(&rest[..rest.find('"').unwrap()]);
            }
            None => break,
        }
    }
    assert_eq!(pages, 3, "50 + 50 + 20");
    let mut expected: Vec<String> =
        sqlx::query_scalar("SELECT id::text FROM jobs ORDER BY id DESC")
            .fetch_all(&mut db)
            .await
            .unwrap();
    assert_eq!(seen, expected, "every job once, newest first");
    // A filter keeps to its jobs, and across pages.
    let (_, page) = served.get(&session.cookie, "/jobs?status=cancelled").await;
    expected =
        sqlx::query_scalar("SELECT id::text FROM jobs WHERE status = 'cancelled' ORDER BY id DESC")
            .fetch_all(&mut db)
            .await
            .unwrap();
    assert_eq!(ids(&page), expected);
    // Bad filters get their own errors.
    let (status, page) = served.get(&session.cookie, "/jobs?status=lost").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(page.contains("not a job status"));
    let (status, _) = served.get(&session.cookie, "/jobs?since=yesterday").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, _) = served.get(&session.cookie, "/jobs/not-a-uuid").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn the_cli_makes_operator_tokens_and_audits_its_resolve_and_cancel() {
    let (config, file) = config(&two_providers());
    let env = TestEnv::new(&config).await;

    // An operator token: printed once, ojo_, listed apart, revocable.
    let out = env.cli_ok(&file.path, &["tokens", "create", "--operator", "ada"]);
    let token = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    assert!(Token::parse_operator(&token).is_some(), "{token}");
    let out = env.cli_ok(&file.path, &["--json", "tokens", "list", "--operators"]);
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(listed[0]["operator"], "ada");
    let out = env.cli_ok(&file.path, &["--json", "tokens", "list"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "[]",
        "tenant tokens are apart"
    );
    let id = listed[0]["id"].as_str().unwrap().to_owned();
    let out = env.cli_ok(&file.path, &["tokens", "revoke", &id]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("of operator ada revoked"));
    // Either kind must be said.
    let out = env.cli(&file.path, &["tokens", "create"]);
    assert_eq!(out.status.code(), Some(2));

    // Resolve and cancel with a reason: each leaves an audit row that `jobs
    // show` prints.
    let (job_id, s) = unknown_job(&env.store, "cli-1").await;
    let attempt = s.attempt_id.to_string();
    env.cli_ok(
        &file.path,
        &[
            "attempts",
            "resolve",
            &attempt,
            "--as",
            "failed",
            "--reason",
            "ticket OPS-42",
        ],
    );
    let job = job_id.to_string();
    env.cli_ok(
        &file.path,
        &["jobs", "cancel", &job, "--reason", "customer withdrew"],
    );
    let out = env.cli_ok(&file.path, &["--json", "jobs", "show", &job]);
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let audit = shown["audit"].as_array().unwrap();
    assert_eq!(audit.len(), 2, "{shown}");
    assert_eq!(audit[0]["action"], "attempt.resolve_failed");
    assert_eq!(audit[0]["reason"], "ticket OPS-42");
    assert_eq!(audit[0]["attempt_id"], attempt.as_str());
    assert_eq!(audit[1]["action"], "job.cancel");
    assert_eq!(audit[1]["reason"], "customer withdrew");
    assert!(audit[1]["actor"].as_str().unwrap().starts_with("cli:"));
    let out = env.cli_ok(&file.path, &["jobs", "show", &job]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("job.cancel") && text.contains("\"customer withdrew\""),
        "{text}"
    );
    // A refused action writes nothing.
    let out = env.cli(&file.path, &["jobs", "cancel", &job, "--reason", "again"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(env.store.audit_of_job(job_id).await.unwrap().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_operator_browses_replays_and_purges_dead_letters() {
    let (config, _file) = config(&two_providers());
    let env = TestEnv::new(&config).await;
    let fleet = env
        .fleet(config.clone(), vec![onejob::fleet::Role::Intake])
        .await;
    let served = serve(&env, config, false).await;
    let conn = env.amqp().await;
    let ch = conn.create_channel().await.unwrap();
    let dlq = onejob::broker::dead_letter_queue(onejob::broker::INTENTS_QUEUE);
    // A good intent with its origin, dead-lettered, and a letter without one.
    common::console::dead_letter_intent(&env, "good-1", "acct_d", "good").await;
    common::console::dead_letter(&env, "orphan-1", b"{}", false).await;
    assert_eq!(common::depth(&ch, &dlq).await, 2);
    let session = served.sign_in(&env.store, "ada").await;

    // Browsing shows both, with the reason, and consumes nothing.
    let (status, page) = served.get(&session.cookie, "/dead-letters").await;
    assert_eq!(status, StatusCode::OK, "{page}");
    assert!(
        page.contains("good-1") && page.contains("orphan-1"),
        "{page}"
    );
    assert!(page.contains("invalid: a test put it here"), "{page}");
    assert_eq!(common::depth(&ch, &dlq).await, 2);

    // Replay the good one: its link leads to a confirmation that says what
    // happens, and the form replays it.
    let start = page.find("class=\"replay-one\" href=\"").unwrap() + 25;
    let link = unescape(&page[start..start + page[start..].find('"').unwrap()]);
    assert!(link.contains("good-1"), "{link}");
    let (status, confirm) = served.get(&session.cookie, &link).await;
    assert_eq!(status, StatusCode::OK, "{confirm}");
    assert!(
        confirm.contains("Republish the dead letter good-1"),
        "{confirm}"
    );
    let form = [
        ("csrf", field(&confirm, "csrf")),
        ("queue", unescape(&field(&confirm, "queue"))),
        ("id", unescape(&field(&confirm, "id"))),
        ("reason", "the intake bug is fixed".to_owned()),
    ];
    let form: Vec<(&str, &str)> = form.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let answer = served
        .post(&session.cookie, "/dead-letters/replay", &form)
        .await;
    assert_eq!(answer.status(), StatusCode::SEE_OTHER);
    let back = answer.headers()[LOCATION].to_str().unwrap().to_owned();
    let (_, page) = served.get(&session.cookie, &back).await;
    assert!(
        page.contains("1 dead letter(s) replayed, 0 skipped"),
        "{back}: {page}"
    );
    common::wait_for(
        "the replayed intent's job",
        Duration::from_secs(20),
        || async { env.store.find_job("acct_d", "good").await.unwrap() },
    )
    .await;
    common::wait_for_depth("the orphan alone", Duration::from_secs(20), &ch, &dlq, 1).await;

    // Purging without the session's CSRF token does nothing; with it, the
    // queue is empty.
    let answer = served
        .post(
            &session.cookie,
            "/dead-letters/purge",
            &[("queue", &dlq), ("reason", "junk")],
        )
        .await;
    assert_eq!(answer.status(), StatusCode::FORBIDDEN);
    assert_eq!(common::depth(&ch, &dlq).await, 1);
    let (_, confirm) = served
        .get(
            &session.cookie,
            &format!("/dead-letters/confirm?action=purge&queue={dlq}"),
        )
        .await;
    assert!(confirm.contains("Delete the 1 dead letter(s)"), "{confirm}");
    let answer = served
        .post(
            &session.cookie,
            "/dead-letters/purge",
            &[("queue", &dlq), ("reason", "junk"), ("csrf", &session.csrf)],
        )
        .await;
    assert_eq!(answer.status(), StatusCode::SEE_OTHER);
    assert_eq!(common::depth(&ch, &dlq).await, 0);

    // Both actions are audited, with who and why.
    let mut audit = env.store.audit_recent(10).await.unwrap();
    audit.retain(|a| a.action.starts_with("dlq."));
    let actions: Vec<(&str, &str, &str)> = audit
        .iter()
        .map(|a| (a.action.as_str(), a.actor.as_str(), a.reason.as_str()))
        .collect();
    assert_eq!(
        actions,
        vec![
            ("dlq.purge", "operator:ada", "junk"),
            ("dlq.replay", "operator:ada", "the intake bug is fixed"),
        ]
    );
    assert_eq!(audit[1].detail["message_id"], "good-1");
    assert_eq!(audit[1].detail["outcome"], "done");
    assert_eq!(audit[1].detail["replayed"], 1);
    assert_eq!(audit[0].target.as_deref(), Some(dlq.as_str()));
    assert_eq!(audit[0].detail["outcome"], "done");
    fleet.stop().await;
}

#[tokio::test]
async fn only_an_unknown_attempt_can_be_resolved_from_the_console() {
    let (config, _file) = config(&two_providers());
    let env = TestEnv::new(&config).await;
    let served = serve(&env, config, false).await;
    let session = served.sign_in(&env.store, "ada").await;
    // An attempt in flight: resolving it would start a second provider call.
    let new = common::new_job("acct_c", "running-1", "running");
    let (job_id, first) = (new.job_id, new.attempt_id);
    env.store.admit(&[new]).await.unwrap();
    env.store
        .start("primary", &[first], Duration::from_secs(30))
        .await
        .unwrap();
    let path = format!("/attempts/{first}/resolve");
    let (status, _) = served
        .get(&session.cookie, &format!("{path}?as=failed"))
        .await;
    assert_eq!(status, StatusCode::CONFLICT);
    let answer = served
        .post(
            &session.cookie,
            &path,
            &[
                ("as", "failed"),
                ("reason", "hand-made"),
                ("csrf", &session.csrf),
            ],
        )
        .await;
    assert_eq!(answer.status(), StatusCode::CONFLICT);
    let job = env.store.job(job_id).await.unwrap().unwrap();
    assert_eq!(job.attempts.len(), 1);
    assert_eq!(job.attempts[0].status, AttemptStatus::Started);
    assert!(env.store.audit_of_job(job_id).await.unwrap().is_empty());
}

#[tokio::test]
async fn qualify_now_checks_its_form_and_records_a_failed_run() {
    use onejob::mock::{Misbehaviour, MockOptions};

    let prose = common::mock(MockOptions {
        misbehave: Some(Misbehaviour::Prose),
        ..MockOptions::default()
    })
    .await;
    let url = prose.base_url();
    let (config, _file) = config(&common::config_for(
        &[
            common::P("primary", &url, ""),
            common::P("fallback", &url, ""),
        ],
        "",
    ));
    let env = TestEnv::new(&config).await;
    let served = serve(&env, config, false).await;
    let session = served.sign_in(&env.store, "ada").await;
    let runs = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(DISTINCT run_id) FROM provider_qualifications")
            .fetch_one(env.store.pool())
            .await
            .unwrap()
    };

    // The confirmation names the contract and the cost.
    let (status, page) = served
        .get(
            &session.cookie,
            "/providers/qualify?provider=fallback&operation=summarize",
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{page}");
    assert!(page.contains("The provider bills these calls"), "{page}");

    // Refused, with nothing run: no CSRF token, no reason, a provider that is
    // not configured, an operation that does not route to it.
    let good = [
        ("csrf", session.csrf.as_str()),
        ("provider", "fallback"),
        ("operation", "summarize"),
        ("reason", "a new fallback"),
    ];
    let without = |key: &str, value: &'static str| -> Vec<(&str, &str)> {
        good.iter()
            .map(|(k, v)| (*k, if *k == key { value } else { *v }))
            .collect()
    };
    for (form, expected) in [
        (without("csrf", ""), StatusCode::FORBIDDEN),
        (without("reason", " "), StatusCode::BAD_REQUEST),
        (without("provider", "nobody"), StatusCode::BAD_REQUEST),
        (without("operation", "translate"), StatusCode::BAD_REQUEST),
    ] {
        let answer = served
            .post(&session.cookie, "/providers/qualify", &form)
            .await;
        assert_eq!(answer.status(), expected, "{form:?}");
    }
    assert_eq!(runs().await, 0, "nothing ran");
    let audit = env.store.audit_recent(10).await.unwrap();
    assert!(
        audit.iter().all(|a| a.action == "token.create"),
        "only the sign-in's token: {audit:?}"
    );

    // A provider that answers in prose fails its golden case: the run is
    // recorded, audited with the failure, and the page says so.
    let answer = served
        .post(&session.cookie, "/providers/qualify", &good)
        .await;
    assert_eq!(answer.status(), StatusCode::SEE_OTHER);
    let back = answer.headers()[LOCATION].to_str().unwrap().to_owned();
    let (_, page) = served.get(&session.cookie, &back).await;
    assert!(
        page.contains("fallback for summarize: not qualified (0 of 1 case(s) passed)"),
        "{page}"
    );
    assert!(page.contains("q-failed"), "{page}");
    assert!(back.starts_with("/providers?done="), "{back}");
    // The banner comes from the audit row the link names, never from the
    // link's own words.
    for forged in [
        format!("/providers?done={}", uuid::Uuid::now_v7()),
        "/providers?provider=fallback&operation=summarize&passed=1&cases=1".to_owned(),
        "/dead-letters?queue=onejob.intents.dlq&replayed=9".to_owned(),
    ] {
        let (status, page) = served.get(&session.cookie, &forged).await;
        assert_eq!(status, StatusCode::OK, "{forged}");
        assert!(!page.contains("id=\"done\""), "{forged}: {page}");
    }
    assert_eq!(runs().await, 1);
    let mut audit = env.store.audit_recent(10).await.unwrap();
    audit.retain(|a| a.action != "token.create");
    assert_eq!(audit.len(), 1);
    assert_eq!(audit[0].action, "provider.qualify");
    assert_eq!(audit[0].actor, "operator:ada");
    assert_eq!(audit[0].target.as_deref(), Some("fallback/summarize"));
    assert_eq!(audit[0].detail["qualified"], false);
    assert_eq!(audit[0].detail["failures"].as_array().unwrap().len(), 1);
}

/// Login CSRF: a page of another site could post the sign-in form with the
/// attacker's own operator token and sign the victim's browser in as the
/// attacker (whose actions the victim would then take). The form carries a
/// token that matches a cookie only the console's own sign-in page sets.
#[tokio::test]
async fn a_sign_in_not_from_the_consoles_own_form_is_refused() {
    let (config, _file) = config(&two_providers());
    let env = TestEnv::new(&config).await;
    let served = serve(&env, config, false).await;
    let token = Token::generate_operator();
    env.store
        .create_operator_token("mallory", &token, &onejob::store::Actor::cli(None))
        .await
        .unwrap();
    let sessions = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM operator_sessions")
            .fetch_one(env.store.pool())
            .await
            .unwrap()
    };

    // The sign-in page's own form: a field, and a cookie for /login alone.
    let page = served
        .http
        .get(format!("{}/login", served.base))
        .send()
        .await
        .unwrap();
    let set = page.headers()[SET_COOKIE].to_str().unwrap().to_owned();
    assert!(set.starts_with("onejob_login="), "{set}");
    for flag in ["HttpOnly", "SameSite=Strict", "Path=/login"] {
        assert!(set.contains(flag), "{flag} in {set}");
    }
    let cookie = set.split(';').next().unwrap().to_owned();
    let field_value = field(&page.text().await.unwrap(), "login_csrf");

    // Posted without the cookie (as from another site), with another form's
    // token, or with none: refused, and no session begins.
    for (cookie, form_token) in [
        (None, Some(field_value.as_str())),
        (Some(cookie.as_str()), Some(&"0".repeat(64)[..])),
        (Some(cookie.as_str()), None),
    ] {
        let mut form = vec![("token", token.reveal())];
        if let Some(t) = form_token {
            form.push(("login_csrf", t));
        }
        let mut request = served
            .http
            .post(format!("{}/login", served.base))
            .header(CONTENT_TYPE, FORM)
            .body(encode(&form));
        if let Some(c) = cookie {
            request = request.header(reqwest::header::COOKIE, c);
        }
        let answer = request.send().await.unwrap();
        assert_eq!(
            answer.status(),
            StatusCode::FORBIDDEN,
            "{cookie:?} {form_token:?}"
        );
        assert!(session_set(&answer).is_none(), "no session cookie");
        assert!(
            answer
                .text()
                .await
                .unwrap()
                .contains("reload the sign-in page")
        );
    }
    assert_eq!(sessions().await, 0);

    // The right pair, but the browser says another site's page posted it (a
    // sibling host can plant a cookie; it cannot make the browser say
    // same-origin): refused.
    let answer = served
        .http
        .post(format!("{}/login", served.base))
        .header(CONTENT_TYPE, FORM)
        .header(reqwest::header::COOKIE, &cookie)
        .header("sec-fetch-site", "same-site")
        .body(encode(&[
            ("token", token.reveal()),
            ("login_csrf", &field_value),
        ]))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), StatusCode::FORBIDDEN);
    assert_eq!(sessions().await, 0);

    // The console's own form signs in.
    let answer = served.login(token.reveal()).await;
    assert_eq!(answer.status(), StatusCode::SEE_OTHER);
    assert_eq!(sessions().await, 1);
}

/// A replay or a purge touches the broker, not the database, so its audit row
/// cannot commit with it: it is written first, and if it cannot be, nothing is
/// done (an action without its record would be worse than none).
#[tokio::test]
async fn a_dead_letter_action_that_cannot_be_recorded_is_not_done() {
    let (config, _file) = config(&two_providers());
    let env = TestEnv::new(&config).await;
    let served = serve(&env, config, false).await;
    let session = served.sign_in(&env.store, "ada").await;
    common::console::dead_letter_intent(&env, "kept-1", "acct_k", "kept").await;
    let dlq = onejob::broker::dead_letter_queue(onejob::broker::INTENTS_QUEUE);
    // The audit table refuses every row from now on.
    sqlx::raw_sql(
        "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN RAISE EXCEPTION 'the audit table refuses rows'; END $$;
         CREATE TRIGGER refuse BEFORE INSERT ON audit FOR EACH ROW EXECUTE FUNCTION refuse();",
    )
    .execute(env.store.pool())
    .await
    .unwrap();
    let conn = env.amqp().await;
    let ch = conn.create_channel().await.unwrap();
    for (path, extra) in [
        ("/dead-letters/replay", Some("kept-1")),
        ("/dead-letters/replay", None),
        ("/dead-letters/purge", None),
    ] {
        let mut form = vec![
            ("csrf", session.csrf.as_str()),
            ("queue", dlq.as_str()),
            ("reason", "tried while the audit is down"),
        ];
        if let Some(id) = extra {
            form.push(("id", id));
        }
        let answer = served.post(&session.cookie, path, &form).await;
        assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE, "{path}");
        assert!(
            answer.text().await.unwrap().contains("Nothing was done"),
            "{path}"
        );
        assert_eq!(
            common::depth(&ch, &dlq).await,
            1,
            "{path}: the letter stays"
        );
    }
}

/// The overview's chart reads the creation minute out of UUIDv7 job ids. A
/// row whose id is not one (another program wrote it) must neither count nor
/// fail the page: its "minute" overflowed, and the overview answered 503.
#[tokio::test]
async fn the_overview_stands_jobs_whose_ids_are_not_uuidv7() {
    let (config, _file) = config(&two_providers());
    let env = TestEnv::new(&config).await;
    let served = serve(&env, config, false).await;
    let mut db = sqlx::PgConnection::connect(&env.database_url)
        .await
        .unwrap();
    // md5-made ids: random bits where a UUIDv7 keeps its time.
    common::fill_jobs(&mut db, "not-v7-", 20, "mix", 60.0, 60.0, "summarize").await;
    let session = served.sign_in(&env.store, "ada").await;
    let (status, page) = served.get(&session.cookie, "/").await;
    assert_eq!(status, StatusCode::OK, "{page}");
    let overview = env.store.overview().await.unwrap();
    assert_eq!(overview.created_per_minute.iter().sum::<i64>(), 0);
    assert_eq!(overview.jobs.iter().map(|(_, n)| n).sum::<i64>(), 20);
}

/// The provider filter pages from the provider's attempts: every job that has
/// one on it, once (however many attempts it made there), newest first, with
/// the other filters applied, and nothing else.
#[tokio::test]
async fn the_provider_filter_pages_every_matching_job_once() {
    use onejob::store::JobFilter;

    let (config, _file) = config(&two_providers());
    let env = TestEnv::new(&config).await;
    let mut db = sqlx::PgConnection::connect(&env.database_url)
        .await
        .unwrap();
    common::fill_jobs(&mut db, "pf-", 400, "mix", 60.0, 600.0, "summarize").await;
    // One attempt in seven moves to the fallback, and some jobs get a second
    // attempt there too.
    sqlx::raw_sql(
        "UPDATE attempts SET provider = 'fallback' WHERE abs(hashtext(id::text)) % 7 = 0;
         INSERT INTO attempts (id, job_id, number, provider, status, created_at, not_before)
         SELECT gen_random_uuid(), job_id, number + 100, 'fallback', 'failed', now(), now()
         FROM attempts WHERE provider = 'fallback' AND abs(hashtext(id::text)) % 2 = 0;",
    )
    .execute(&mut db)
    .await
    .unwrap();
    for status in [None, Some(JobStatus::Failed)] {
        let truth: Vec<uuid::Uuid> = sqlx::query_scalar(
            "SELECT j.id FROM jobs j WHERE EXISTS (SELECT 1 FROM attempts a
                 WHERE a.job_id = j.id AND a.provider = 'fallback')
               AND ($1::text IS NULL OR j.status = $1) ORDER BY j.id DESC",
        )
        .bind(status.map(|s| s.as_str()))
        .fetch_all(&mut db)
        .await
        .unwrap();
        assert!(truth.len() > 20, "{} jobs", truth.len());
        let filter = JobFilter {
            provider: Some("fallback".into()),
            status,
            ..JobFilter::default()
        };
        let mut seen = Vec::new();
        let mut after = None;
        loop {
            let page = env.store.jobs_page(&filter, after, 7).await.unwrap();
            seen.extend(page.iter().map(|l| l.id));
            match page.last() {
                Some(last) if page.len() == 7 => after = Some(last.id),
                _ => break,
            }
        }
        assert_eq!(seen, truth, "{status:?}");
    }
}
