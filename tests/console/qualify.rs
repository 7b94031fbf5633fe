//! Qualify now from the console: its form is checked, and a failed run is
//! recorded and audited.

use crate::common::console::{Served, serve};
use crate::common::{self, TestEnv, config};
use onejob::edges::store::Store;
use reqwest::StatusCode;
use reqwest::header::LOCATION;

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
    post_each_without_one_field(&served, &session.cookie, &good).await;
    assert_eq!(runs().await, 0, "nothing ran");
    let audit = env.store.audit().recent(10).await.unwrap();
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
    forged_links_show_no_banner(&served, &session.cookie).await;
    assert_eq!(runs().await, 1);
    the_failed_run_is_audited(&env.store).await;
}

/// Posts `good` with one field emptied or changed at a time: no CSRF token,
/// no reason, a provider that is not configured, an operation that does not
/// route to it. Each is refused.
async fn post_each_without_one_field(served: &Served, cookie: &str, good: &[(&str, &str)]) {
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
        let answer = served.post(cookie, "/providers/qualify", &form).await;
        assert_eq!(answer.status(), expected, "{form:?}");
    }
}

/// The banner comes from the audit row the link names, never from the
/// link's own words.
async fn forged_links_show_no_banner(served: &Served, cookie: &str) {
    for forged in [
        format!("/providers?done={}", uuid::Uuid::now_v7()),
        "/providers?provider=fallback&operation=summarize&passed=1&cases=1".to_owned(),
        "/dead-letters?queue=onejob.intents.dlq&replayed=9".to_owned(),
    ] {
        let (status, page) = served.get(cookie, &forged).await;
        assert_eq!(status, StatusCode::OK, "{forged}");
        assert!(!page.contains("id=\"done\""), "{forged}: {page}");
    }
}

/// The qualify run is audited, beside the sign-in's token, with its failure.
async fn the_failed_run_is_audited(store: &Store) {
    let mut audit = store.audit().recent(10).await.unwrap();
    audit.retain(|a| a.action != "token.create");
    assert_eq!(audit.len(), 1);
    assert_eq!(audit[0].action, "provider.qualify");
    assert_eq!(audit[0].actor, "operator:ada");
    assert_eq!(audit[0].target.as_deref(), Some("fallback/summarize"));
    assert_eq!(audit[0].detail["qualified"], false);
    assert_eq!(audit[0].detail["failures"].as_array().unwrap().len(), 1);
}
