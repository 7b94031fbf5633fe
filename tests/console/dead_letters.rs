//! Dead letters from the console: browsed, replayed and purged, audited; an
//! action that cannot be recorded is not done.

use std::time::Duration;

use crate::common::console::{Served, Session, field, serve, two_providers, unescape};
use crate::common::{self, TestEnv, config};
use onejob::edges::store::Store;
use reqwest::StatusCode;
use reqwest::header::LOCATION;

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

    replay_from_its_link(&served, &session, &page).await;
    common::wait_for(
        "the replayed intent's job",
        Duration::from_secs(20),
        || async { env.store.jobs().find("acct_d", "good").await.unwrap() },
    )
    .await;
    common::wait_for_depth("the orphan alone", Duration::from_secs(20), &ch, &dlq, 1).await;

    purge_needs_the_csrf_token(&served, &session, &ch, &dlq).await;

    both_actions_are_audited(&env.store, &dlq).await;
    fleet.stop().await;
}

/// Replay the good one: its link leads to a confirmation that says what
/// happens, and the form replays it.
async fn replay_from_its_link(served: &Served, session: &Session, page: &str) {
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
}

/// Purging without the session's CSRF token does nothing; with it, the
/// queue is empty.
async fn purge_needs_the_csrf_token(
    served: &Served,
    session: &Session,
    ch: &lapin::Channel,
    dlq: &str,
) {
    let answer = served
        .post(
            &session.cookie,
            "/dead-letters/purge",
            &[("queue", dlq), ("reason", "junk")],
        )
        .await;
    assert_eq!(answer.status(), StatusCode::FORBIDDEN);
    assert_eq!(common::depth(ch, dlq).await, 1);
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
            &[("queue", dlq), ("reason", "junk"), ("csrf", &session.csrf)],
        )
        .await;
    assert_eq!(answer.status(), StatusCode::SEE_OTHER);
    assert_eq!(common::depth(ch, dlq).await, 0);
}

/// Both actions are audited, with who and why.
async fn both_actions_are_audited(store: &Store, dlq: &str) {
    let mut audit = store.audit().recent(10).await.unwrap();
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
    assert_eq!(audit[0].target.as_deref(), Some(dlq));
    assert_eq!(audit[0].detail["outcome"], "done");
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
    common::database::refuse_audit(&env).await;
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
