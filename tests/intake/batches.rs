//! Admission in batches: each identity settled once within a batch and across
//! racing batches, a refused intent failing alone, and a backlog admitted in
//! a handful of batches with every receipt right.

use std::time::Duration;

use onejob::broker;
use onejob::edges::store::{Admission, Store};
use onejob::fleet::Role;
use onejob::mock::MockOptions;
use onejob_producer::Producer;

use super::SETTLE;
use crate::common::{self, TestEnv, config, config_text, intent, mock, new_job, wait_for};

/// What an admission says, with the job it names.
fn said(a: &Admission) -> (&'static str, Option<onejob::domain::JobId>) {
    match a {
        Admission::Created { job_id, .. } => ("created", Some(*job_id)),
        Admission::Duplicate { job_id } => ("duplicate", Some(*job_id)),
        Admission::Conflict => ("conflict", None),
        Admission::Refused(_) => ("refused", None),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_batch_settles_each_identity_once_even_when_batches_race() {
    let primary = mock(MockOptions::default()).await;
    let (config, _file) = config(&config_text(&primary.base_url(), None, ""));
    let env = TestEnv::new(&config).await;

    onejob::edges::metrics::install();
    within_one_batch(&env.store).await;
    // Batches that overlap, racing on separate connections, round after round.
    for round in 0..20 {
        overlapping_batches_race(&env.store, round).await;
    }
    let (jobs, identities): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT (owner_id, idempotency_key)) FROM jobs")
            .fetch_one(env.store.pool())
            .await
            .unwrap();
    assert_eq!((jobs, identities), (2 + 20 * 10, 2 + 20 * 10));
    // Overlapping batches insert in one order, so none deadlocked (a deadlock
    // would have been retried, and counted).
    let metrics = onejob::edges::metrics::render();
    assert!(
        !metrics.contains(r#"onejob_db_retries_total{code="40P01"}"#),
        "{metrics}"
    );
}

/// Within one statement: the same identity three times, another twice, out
/// of order (the store sorts by identity; answers come back in this order);
/// then the same call again, and another intent with one of the identities.
async fn within_one_batch(store: &Store) {
    let batch = [
        new_job("acct_b", "b", "two"),
        new_job("acct_b", "a", "one"),
        new_job("acct_b", "a", "other"),
        new_job("acct_b", "a", "one"),
        new_job("acct_b", "b", "two"),
    ];
    let admitted = store.admission().admit(&batch).await.unwrap();
    let got: Vec<_> = admitted.iter().map(said).collect();
    let (a, b) = (batch[1].job_id, batch[0].job_id);
    assert_eq!(
        got,
        [
            ("created", Some(b)),
            ("created", Some(a)),
            ("conflict", None),
            ("duplicate", Some(a)),
            ("duplicate", Some(b)),
        ]
    );

    // The same call run again after its commit went through unseen (the
    // connection dropped at COMMIT): still `created`, with the outbox row that
    // the first run wrote, not a `duplicate` of itself.
    let again = store.admission().admit(&batch[..2]).await.unwrap();
    match &again[..] {
        [
            Admission::Created {
                job_id: jb,
                publish: Some(pb),
            },
            Admission::Created {
                job_id: ja,
                publish: Some(pa),
            },
        ] => {
            assert_eq!((*jb, *ja), (b, a));
            assert_eq!(pb.message_id, batch[0].attempt_id.to_string());
            assert_eq!(pa.message_id, batch[1].attempt_id.to_string());
        }
        other => panic!("{other:?}"),
    }
    // Anyone else with the same intent is told `duplicate`.
    let other = store
        .admission()
        .admit(&[new_job("acct_b", "a", "one")])
        .await
        .unwrap();
    assert_eq!(said(&other[0]), ("duplicate", Some(a)));
}

/// Round `round` of overlapping batches: three racers admit the same ten keys,
/// each in its own order, behind a barrier; each key is created once and all
/// answers name one job.
async fn overlapping_batches_race(store: &Store, round: usize) {
    let keys: Vec<String> = (0..10).map(|k| format!("r{round}-{k}")).collect();
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(3));
    let racers = (0..3).map(|racer| {
        let store = store.clone();
        let barrier = barrier.clone();
        // Each racer sends the same keys in its own order.
        let mut mine: Vec<_> = keys.iter().map(|k| new_job("acct_r", k, "same")).collect();
        mine.rotate_left(racer * 3);
        tokio::spawn(async move {
            barrier.wait().await;
            let admitted = store.admission().admit(&mine).await.unwrap();
            mine.iter()
                .zip(admitted)
                .map(|(n, a)| (n.intent.idempotency_key.clone(), said(&a)))
                .collect::<Vec<_>>()
        })
    });
    let mut by_key: std::collections::HashMap<String, Vec<(&str, Option<_>)>> =
        std::collections::HashMap::new();
    for racer in futures_util::future::join_all(racers).await {
        for (key, answer) in racer.unwrap() {
            by_key.entry(key).or_default().push(answer);
        }
    }
    for (key, answers) in by_key {
        let created = answers.iter().filter(|a| a.0 == "created").count();
        let jobs: std::collections::BTreeSet<_> = answers.iter().map(|a| a.1).collect();
        assert_eq!(created, 1, "round {round}, {key}: {answers:?}");
        assert_eq!(jobs.len(), 1, "round {round}, {key}: one job named by all");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_the_database_refuses_fails_only_the_refused_intent() {
    let primary = mock(MockOptions::default()).await;
    let (config, _file) = config(&config_text(&primary.base_url(), None, ""));
    let env = TestEnv::new(&config).await;
    let ctx = env.context(config.clone()).await;
    // Validation refuses NUL, which Postgres cannot store; this intent skips
    // validation to stand for any data the database refuses.
    let mut refused = new_job("acct_n", "bad", "x");
    refused.intent.input.insert(
        "text".into(),
        serde_json::Value::String("nul \u{0} here".into()),
    );
    let batch = [
        new_job("acct_n", "good-1", "x"),
        refused,
        new_job("acct_n", "good-2", "x"),
    ];
    let rows =
        onejob::roles::intake::admit_rows(&ctx, &onejob::edges::shutdown::Shutdown::new(), &batch)
            .await;
    let got: Vec<&str> = rows
        .iter()
        .map(|r| match r {
            Some(Ok(a)) => said(a).0,
            Some(Err(reason)) if reason.to_string().starts_with("unstorable") => "unstorable",
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(got, ["created", "unstorable", "created"]);
    let (jobs,): (i64,) = sqlx::query_as("SELECT count(*) FROM jobs")
        .fetch_one(env.store.pool())
        .await
        .unwrap();
    assert_eq!(jobs, 2);
    let _ = ctx.connection.close(200, "done".into()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backlog_is_admitted_in_batches_with_every_receipt_right() {
    let primary = mock(MockOptions::default()).await;
    let (config, _file) = config(&config_text(&primary.base_url(), None, ""));
    let env = TestEnv::new(&config).await;
    let ctx = env.context(config.clone()).await;
    // The receipts wait while the backlog builds up and the fleet starts.
    let options = onejob_producer::ProducerOptions {
        receipt_timeout: Duration::from_secs(120),
        ..Default::default()
    };
    let producer = std::sync::Arc::new(
        Producer::connect_with(&env.amqp_url, options)
            .await
            .unwrap(),
    );

    // 300 intents wait in the queue before intake starts.
    let sends = backlog();
    let waiting: Vec<_> = sends
        .into_iter()
        .map(|(key, body)| {
            let producer = producer.clone();
            tokio::spawn(async move { (key, producer.submit_raw(&body).await.unwrap()) })
        })
        .collect();
    let ch = ctx.connection.create_channel().await.unwrap();
    wait_for("the backlog to be queued", SETTLE, || async {
        (common::depth(&ch, broker::INTENTS_QUEUE).await == 300).then_some(())
    })
    .await;

    let fleet = env.fleet(config.clone(), vec![Role::Intake]).await;
    let mut outcomes: std::collections::HashMap<&str, usize> = Default::default();
    let mut job_of: std::collections::HashMap<String, onejob::domain::JobId> = Default::default();
    for task in waiting {
        let (key, receipt) = task.await.unwrap();
        *outcomes.entry(receipt.outcome.as_str()).or_default() += 1;
        if let Some(job) = receipt.job_id {
            let first = *job_of.entry(key.clone()).or_insert(job);
            assert_eq!(first, job, "{key}: every receipt names the same job");
            let stored = env.store.jobs().find("acct_q", &key).await.unwrap();
            assert_eq!(stored.map(|j| j.id), Some(job), "{key}: its own job");
        }
    }
    assert_eq!(outcomes.get("created"), Some(&200));
    assert_eq!(outcomes.get("duplicate"), Some(&70));
    assert_eq!(outcomes.get("conflict"), Some(&20));
    assert_eq!(outcomes.get("rejected"), Some(&10));
    let (jobs,): (i64,) = sqlx::query_as("SELECT count(*) FROM jobs")
        .fetch_one(env.store.pool())
        .await
        .unwrap();
    assert_eq!(jobs, 200);

    counted_in_batches();

    std::sync::Arc::try_unwrap(producer).unwrap().close().await;
    fleet.stop().await;
    let _ = ctx.connection.close(200, "done".into()).await;
}

/// 300 intents, as (key, body): 200 keys, 70 of them sent again (the same
/// intent) and 20 with a different one, plus 10 invalid.
fn backlog() -> Vec<(String, Vec<u8>)> {
    let mut sends: Vec<(String, Vec<u8>)> = (0..200)
        .map(|k| (format!("k{k}"), format!("text {k}")))
        .chain((0..70).map(|k| (format!("k{k}"), format!("text {k}"))))
        .chain((100..120).map(|k| (format!("k{k}"), "changed".to_owned())))
        .map(|(key, text)| {
            let body = serde_json::to_vec(&intent("acct_q", &key, &text)).unwrap();
            (key, body)
        })
        .collect();
    sends.extend((0..10).map(|i| (format!("bad{i}"), format!("{{\"bad\":{i}}}").into_bytes())));
    sends
}

/// Fewer statements than intents: the counters show the batches.
fn counted_in_batches() {
    let text = onejob::edges::metrics::render();
    let value = |series: &str| {
        text.lines()
            .find_map(|l| {
                l.strip_prefix(series)?
                    .strip_prefix(' ')?
                    .parse::<f64>()
                    .ok()
            })
            .unwrap_or(0.0)
    };
    let (batches, delivered) = (
        value("onejob_intake_batch_size_count"),
        value("onejob_intake_batch_size_sum"),
    );
    assert!(delivered >= 300.0, "{text}");
    assert!(
        batches <= 150.0,
        "{batches} batches for {delivered} deliveries"
    );
    println!("intake: {delivered} deliveries in {batches} batches");
}
