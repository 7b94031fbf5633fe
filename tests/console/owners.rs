//! The owners page: each owner's limits, spend and waiting jobs, and setting
//! an owner's limits with a reason (refused without its CSRF token, a reason
//! or valid values; audited with the operator's name when done).

use crate::common::console::serve;
use crate::common::{self, TestEnv, config};
use reqwest::StatusCode;
use reqwest::header::LOCATION;

#[tokio::test]
async fn an_operator_sets_an_owners_limits_with_a_reason() {
    let text = common::config_text("http://127.0.0.1:9/v1", None, "")
        + "\n[owners]\ndaily_tokens = 5000\n";
    let (config, _file) = config(&text);
    let env = TestEnv::new(&config).await;
    let served = serve(&env, config, false).await;
    let session = served.sign_in(&env.store, "ada").await;

    let (status, page) = served.get(&session.cookie, "/owners").await;
    assert_eq!(status, StatusCode::OK, "{page}");
    assert!(page.contains("daily tokens 5000"), "{page}");
    assert!(page.contains("No owner has limits of its own"), "{page}");

    let good = [
        ("csrf", session.csrf.as_str()),
        ("owner", "acct_1"),
        ("rate", "2.5"),
        ("daily_tokens", "default"),
        ("reason", "a noisy tenant"),
    ];
    for (field, value, says) in [
        ("csrf", "", ""),
        ("reason", " ", "Give a reason"),
        ("rate", "fast", "rate must be a number from 0"),
        ("owner", "<b>x</b>", "The owner"),
    ] {
        let form: Vec<(&str, &str)> = good
            .iter()
            .map(|&(k, v)| if k == field { (k, value) } else { (k, v) })
            .collect();
        let answer = served.post(&session.cookie, "/owners/set", &form).await;
        let status = answer.status();
        let body = answer.text().await.unwrap();
        assert!(status.is_client_error(), "{field}: {status} {body}");
        assert!(body.contains(says), "{field}: {body}");
        assert!(
            !body.contains("<b>x</b>"),
            "outside text is escaped: {body}"
        );
    }
    let empty = [
        ("csrf", session.csrf.as_str()),
        ("owner", "acct_1"),
        ("reason", "nothing"),
    ];
    let answer = served.post(&session.cookie, "/owners/set", &empty).await;
    assert_eq!(answer.status(), StatusCode::BAD_REQUEST);
    assert!(
        env.store.owners().list_owners().await.unwrap().is_empty(),
        "nothing was set"
    );

    let answer = served.post(&session.cookie, "/owners/set", &good).await;
    assert_eq!(answer.status(), StatusCode::SEE_OTHER);
    let back = answer.headers()[LOCATION].to_str().unwrap().to_owned();
    assert!(back.starts_with("/owners?done="), "{back}");
    let (_, page) = served.get(&session.cookie, &back).await;
    assert!(
        page.contains("acct_1: limits set (rate 2.5; the rest [owners]&#x27;s)"),
        "{page}"
    );
    assert!(page.contains("2.5&#x2f;s, burst 3 *"), "{page}");

    let audit = env.store.audit().recent(10).await.unwrap();
    let set = audit.iter().find(|a| a.action == "owner.set").unwrap();
    assert_eq!(set.actor, "operator:ada");
    assert_eq!(set.reason, "a noisy tenant");
    assert_eq!(set.target.as_deref(), Some("acct_1"));
    assert_eq!(set.detail["after"]["rate"], 2.5);
    let owner = env.store.owners().owner("acct_1").await.unwrap();
    assert_eq!((owner.limits.rate, owner.limits.daily_tokens), (2.5, 5000));
}

/// A held job's page: its attempt's outbox row is not due ('infinity'
/// in Postgres, which chrono cannot hold), and reading it panicked the
/// page's handler (seen failing: the connection closed with no answer). The
/// page says the attempt waits its turn, and its message waits, held.
#[tokio::test]
async fn a_held_jobs_page_says_it_waits_its_turn() {
    let text =
        common::config_text("http://127.0.0.1:9/v1", None, "") + "\n[owners]\nmax_in_flight = 1\n";
    let (config, _file) = config(&text);
    let env = TestEnv::new(&config).await;
    let served = serve(&env, config, false).await;
    let session = served.sign_in(&env.store, "ada").await;
    let new = common::new_job("acct_h", "held-1", "x");
    let job = new.job_id;
    env.store.admission().admit(&[new]).await.unwrap();

    let (status, page) = served.get(&session.cookie, &format!("/jobs/{job}")).await;
    assert_eq!(status, StatusCode::OK, "{page}");
    assert!(page.contains("held: waits its turn"), "{page}");
    assert!(page.contains("held until its turn is handed out"), "{page}");
}
