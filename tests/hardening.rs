//! Faults found in review (issue 8), each pinned by a test that failed before its
//! fix: providers that send hostile headers or bytes, attempts that time out after
//! their job ended, a start racing a timeout, dead-letter copies the broker would
//! refuse or expire.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{
    P, TestEnv, config, config_for, config_text, mock, submit, wait_for, wait_for_messages,
    wait_for_status,
};
use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable, LongString};
use onejob::domain::{AttemptStatus, JobId, JobStatus};
use onejob::mock::MockOptions;
use onejob::store::{Admission, FailedJob, Finished, NextStep, Settled, Started, Store, Verdict};
use onejob_producer::Producer;
use serde_json::json;

/// Admits a job for the primary and starts its first attempt.
async fn started(store: &Store, key: &str) -> (JobId, Started) {
    let new = common::new_job("acct_h", key, key);
    let (job_id, first) = (new.job_id, new.attempt_id);
    let admitted = store.admit(&[new]).await.unwrap();
    assert!(matches!(admitted[0], Admission::Created { .. }));
    let s = store
        .start("primary", &[first], Duration::from_secs(30))
        .await
        .unwrap()
        .remove(0);
    (job_id, s)
}

fn finished(s: &Started, verdict: Verdict) -> Finished {
    Finished {
        attempt_id: s.attempt_id,
        job_id: s.job_id,
        version: s.version,
        provider_request_id: None,
        usage: None,
        verdict,
    }
}

fn timed_out(s: &Started) -> Finished {
    finished(
        s,
        Verdict::Unknown {
            error: "outcome_unknown: timed out after the request was sent".into(),
        },
    )
}

/// A fleet with every role behind one mock provider (`provider_extra` adds
/// settings to it), at most `max_attempts` attempts a job, and a producer.
struct Running {
    primary: onejob::mock::MockHandle,
    env: TestEnv,
    fleet: common::Fleet,
    producer: Producer,
    _file: common::tempfile_path::TempConfig,
}

impl Running {
    async fn start(provider_extra: &str, max_attempts: u32) -> Running {
        let primary = mock(MockOptions::default()).await;
        let (config, file) = config(
            &config_for(&[P("primary", &primary.base_url(), provider_extra)], "").replace(
                "max_attempts = 3",
                &format!("max_attempts = {max_attempts}"),
            ),
        );
        let env = TestEnv::new(&config).await;
        let fleet = env.fleet(config.clone(), vec![]).await;
        let producer = Producer::connect(&env.amqp_url).await.unwrap();
        Running {
            primary,
            env,
            fleet,
            producer,
            _file: file,
        }
    }
}

/// Waits until the job has `n` attempts, and returns it.
async fn with_attempts(env: &TestEnv, job_id: JobId, n: usize) -> onejob::store::JobView {
    wait_for(
        &format!("job {job_id} to have {n} attempts"),
        Duration::from_secs(20),
        || async {
            env.store
                .job(job_id)
                .await
                .unwrap()
                .filter(|j| j.attempts.len() == n)
        },
    )
    .await
}

/// Item 1: a `Retry-After` far in the future (chrono panicked on it, stopping the
/// attempts role) is capped at the provider's `max_retry_after`, default 10m.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_huge_retry_after_is_capped_and_never_crashes_the_worker() {
    let Running {
        primary: _primary,
        env,
        fleet,
        producer,
        _file,
    } = Running::start("", 2).await;
    let job_id = submit(
        &producer,
        "acct_ra",
        "k",
        "mock:status=429 mock:retry_after=99999999999999",
    )
    .await;
    let job = with_attempts(&env, job_id, 2).await;
    let wait = job.attempts[1].not_before - job.attempts[0].finished_at.unwrap();
    let cap = chrono::Duration::minutes(10);
    assert!(
        wait >= cap - chrono::Duration::seconds(1) && wait <= cap + chrono::Duration::seconds(1),
        "the wait is capped at max_retry_after (10m): waited {wait}"
    );
    // The same header from a second job: the role is still there to take it.
    let second = submit(
        &producer,
        "acct_ra",
        "k2",
        "mock:status=429 mock:retry_after=99999999999999",
    )
    .await;
    with_attempts(&env, second, 2).await;
    producer.close().await;
    fleet.stop().await;
}

/// Item 10: a proxy's 504 or 524 says it forwarded the request and stopped
/// waiting: the provider may have run it, so the attempt is `unknown`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn proxy_timeouts_are_unknown() {
    let Running {
        primary,
        env,
        fleet,
        producer,
        _file,
    } = Running::start("", 3).await;
    for status in [504, 524] {
        let job_id = submit(
            &producer,
            "acct_504",
            &status.to_string(),
            &format!("mock:status={status}"),
        )
        .await;
        let job = wait_for_status(&env, job_id, JobStatus::Unknown).await;
        assert_eq!(job.attempts.len(), 1);
        assert_eq!(job.attempts[0].status, AttemptStatus::Unknown);
        let error = job.attempts[0].error.clone().unwrap_or_default();
        assert!(
            error.starts_with("outcome_unknown") && error.contains(&status.to_string()),
            "{error}"
        );
    }
    assert_eq!(primary.stats.requests(), 2, "no retry beside an unknown");
    // A proxy's timeout page larger than max_response_bytes is still unknown.
    let run = Running::start("max_response_bytes = 1024", 3).await;
    let job_id = submit(
        &run.producer,
        "acct_504",
        "big",
        "mock:status=504 mock:pad=5000",
    )
    .await;
    let job = wait_for_status(&run.env, job_id, JobStatus::Unknown).await;
    assert_eq!(job.attempts[0].status, AttemptStatus::Unknown, "{job:?}");
    run.producer.close().await;
    run.fleet.stop().await;
    producer.close().await;
    fleet.stop().await;
}

/// Item 8: an attempt that times out after another attempt won is `discarded`
/// with the reason, never `unknown` on an ended job.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_timeout_after_the_job_ended_is_discarded() {
    let env = common::store_env().await;
    let store = &env.store;

    // The hedge wins, then the primary times out.
    let (job_id, primary) = started(store, "hedge-won").await;
    let (hedge, _) = store.hedge(job_id, "fallback").await.unwrap().unwrap();
    let hedge = store
        .start("fallback", &[hedge], Duration::from_secs(30))
        .await
        .unwrap()
        .remove(0);
    let (settled, _) = store
        .finalize(
            &[finished(
                &hedge,
                Verdict::Succeeded(json!({"summary": "s"})),
            )],
            &common::give_up,
        )
        .await
        .unwrap();
    assert_eq!(settled, vec![Settled::Won]);
    let (settled, publish) = store
        .finalize(&[timed_out(&primary)], &common::give_up)
        .await
        .unwrap();
    assert_eq!(
        settled,
        vec![Settled::Discarded {
            winner: Some(hedge.attempt_id)
        }]
    );
    assert!(publish.is_empty());
    let job = store.job(job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Succeeded);
    let late = job
        .attempts
        .iter()
        .find(|a| a.id == primary.attempt_id)
        .unwrap();
    assert_eq!(late.status, AttemptStatus::Discarded);
    let error = late.error.clone().unwrap_or_default();
    assert!(error.contains("timed out"), "the reason is kept: {error}");

    // A job cancelled with a call in flight, whose call then times out.
    let (job_id, in_flight) = started(store, "cancelled").await;
    store
        .cancel_job(job_id, &onejob::store::Actor::cli(None))
        .await
        .unwrap()
        .unwrap();
    let (settled, _) = store
        .finalize(&[timed_out(&in_flight)], &common::give_up)
        .await
        .unwrap();
    assert_eq!(settled, vec![Settled::Discarded { winner: None }]);
    let job = store.job(job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Cancelled);
    assert_eq!(job.attempts[0].status, AttemptStatus::Discarded);

    // A worker that vanished mid-call on a job that has since ended.
    let (job_id, vanished) = started(store, "vanished").await;
    store
        .cancel_job(job_id, &onejob::store::Actor::cli(None))
        .await
        .unwrap()
        .unwrap();
    sqlx::query("UPDATE attempts SET deadline_at = now() - interval '1 hour' WHERE id = $1")
        .bind(vanished.attempt_id.0)
        .execute(store.pool())
        .await
        .unwrap();
    assert!(
        store
            .expire_vanished(Duration::ZERO)
            .await
            .unwrap()
            .is_empty()
    );
    let job = store.job(job_id).await.unwrap().unwrap();
    assert_eq!(job.attempts[0].status, AttemptStatus::Discarded);

    // Nothing is left unknown: the gauge an operator alerts on stays clear.
    let gauges = store.gauges().await.unwrap();
    assert!(
        gauges.contains("onejob_oldest_unknown_attempt_seconds 0\n"),
        "{gauges}"
    );
    assert!(gauges.contains("onejob_attempts{status=\"unknown\"} 0\n"));
}

/// Item 7: `start` used to write `running` over a job that a concurrent timeout
/// had just made `unknown`, so a hedge could call its provider while the job was
/// blocked. Many jobs race a hedge's start against the primary's timeout behind
/// a barrier; afterwards a job with an unknown attempt is always `unknown`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_start_never_overwrites_unknown() {
    let env = common::store_env().await;
    let store = Arc::new(env.store.clone());
    let mut overwritten = 0;
    let mut hedges_started = 0;
    for round in 0..15 {
        let mut pairs = Vec::new();
        for i in 0..16 {
            let (job_id, primary) = started(&store, &format!("race-{round}-{i}")).await;
            let (hedge, _) = store.hedge(job_id, "fallback").await.unwrap().unwrap();
            pairs.push((job_id, primary, hedge));
        }
        let barrier = Arc::new(tokio::sync::Barrier::new(pairs.len() * 2));
        let mut tasks = Vec::new();
        for (_, primary, hedge) in &pairs {
            let (s, b, h) = (store.clone(), barrier.clone(), *hedge);
            tasks.push(tokio::spawn(async move {
                b.wait().await;
                s.start("fallback", &[h], Duration::from_secs(30))
                    .await
                    .unwrap()
                    .len()
            }));
            let (s, b, p) = (store.clone(), barrier.clone(), timed_out(primary));
            tasks.push(tokio::spawn(async move {
                b.wait().await;
                common::settle_with(&s, &[p], &common::give_up).await;
                0
            }));
        }
        for t in tasks {
            hedges_started += t.await.unwrap();
        }
        for (job_id, primary, _) in &pairs {
            let job = store.job(*job_id).await.unwrap().unwrap();
            let primary = job
                .attempts
                .iter()
                .find(|a| a.id == primary.attempt_id)
                .unwrap();
            assert_eq!(primary.status, AttemptStatus::Unknown);
            if job.status != JobStatus::Unknown {
                overwritten += 1;
            }
        }
    }
    assert_eq!(
        overwritten, 0,
        "jobs left `running` beside an unknown attempt ({hedges_started} hedges started first)"
    );
}

/// Item 9: NUL in what a provider sends cannot be stored by Postgres. An answer
/// holding one is a definite `contract_violation`, never `unknown`; an error body
/// holding one is kept readable.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nul_from_a_provider_is_a_definite_outcome() {
    let Running {
        primary: _primary,
        env,
        fleet,
        producer,
        _file,
    } = Running::start("", 1).await;

    let answer = submit(&producer, "acct_nul", "answer", "mock:nul").await;
    let job = wait_for_status(&env, answer, JobStatus::Failed).await;
    let error = job.attempts[0].error.clone().unwrap_or_default();
    assert_eq!(job.attempts[0].status, AttemptStatus::Failed);
    assert!(
        error.starts_with("contract_violation") && error.contains("NUL"),
        "{error}"
    );
    // The usage and request id it reported are kept, made storable.
    assert!(job.attempts[0].usage.is_some());
    assert!(job.attempts[0].provider_request_id.is_some());

    let refused = submit(&producer, "acct_nul", "error", "mock:nul mock:status=500").await;
    let job = wait_for_status(&env, refused, JobStatus::Failed).await;
    let error = job.attempts[0].error.clone().unwrap_or_default();
    assert!(
        error.starts_with("provider_error: HTTP 500") && !error.contains('\0'),
        "{error:?}"
    );
    producer.close().await;
    fleet.stop().await;
}

/// Item 3: onejob's own dead letters keep what the contract lists and drop what
/// would make the broker refuse (`user_id`) or expire (`expiration`) the copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_letter_copy_keeps_the_listed_properties_only() {
    let primary = mock(MockOptions::default()).await;
    let (config, _file) = config(&config_for(&[P("primary", &primary.base_url(), "")], ""));
    let env = TestEnv::new(&config).await;
    let fleet = env
        .fleet(config.clone(), vec![onejob::fleet::Role::Intake])
        .await;
    let conn = env.amqp().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    let mut headers = FieldTable::default();
    headers.insert(
        "x-trace".into(),
        AMQPValue::LongString(LongString::from("t-1")),
    );
    let props = onejob::broker::json_properties()
        .with_message_id("m-1".into())
        .with_correlation_id("c-1".into())
        .with_reply_to("nowhere".into())
        .with_timestamp(1_700_000_000)
        .with_expiration("600000".into())
        .with_user_id("guest".into())
        .with_headers(headers);
    ch.basic_publish(
        onejob::broker::EXCHANGE.into(),
        onejob::broker::INTENTS_KEY.into(),
        BasicPublishOptions::default(),
        b"not json",
        props,
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let dlq = onejob::broker::dead_letter_queue(onejob::broker::INTENTS_QUEUE);
    let copy = wait_for_messages(&env, &ch, &dlq).await.remove(0);
    let p = &copy.properties;
    assert_eq!(copy.data, b"not json");
    assert_eq!(p.expiration(), &None, "a copy must not expire");
    assert_eq!(
        p.user_id(),
        &None,
        "a copy must not claim the publisher's user"
    );
    assert_eq!(p.message_id().as_ref().map(|m| m.as_str()), Some("m-1"));
    assert_eq!(p.correlation_id().as_ref().map(|m| m.as_str()), Some("c-1"));
    assert_eq!(p.reply_to().as_ref().map(|m| m.as_str()), Some("nowhere"));
    assert_eq!(p.timestamp(), &Some(1_700_000_000));
    assert_eq!(p.delivery_mode(), &Some(2));
    let h = p.headers().clone().unwrap_or_default();
    assert_eq!(
        onejob::broker::header_str(&h, "x-trace").as_deref(),
        Some("t-1")
    );
    assert!(onejob::broker::header_str(&h, onejob::broker::ERROR_HEADER).is_some());
    let _ = conn.close(200, "done".into()).await;
    fleet.stop().await;
}

/// Messages in `queue`, ready or delivered but not yet acked (rabbitmqctl sees
/// both; a passive declare sees only the ready ones).
fn queue_total(vhost: &str, queue: &str) -> Option<u64> {
    let out = std::process::Command::new("rabbitmqctl")
        .args(["list_queues", "-q", "-p", vhost, "name", "messages"])
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout).lines().find_map(|l| {
        let mut cols = l.split_whitespace();
        (cols.next() == Some(queue)).then(|| cols.next()?.parse().ok())?
    })
}

/// Item 6: a hedge queued behind a primary that went `unknown` used to have its
/// delivery acked as a "duplicate", and once the operator resolved the primary the
/// job stayed blocked with nothing left to resolve. Now the settlement that lifts
/// the block publishes the hedge again, and the job proceeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hedge_turned_away_by_an_unknown_runs_once_the_unknown_is_resolved() {
    let fallback = mock(MockOptions {
        tag: Some("fallback".into()),
        ..MockOptions::default()
    })
    .await;
    let (config, file) = config(&config_text(
        "http://127.0.0.1:9/v1",
        Some(&fallback.base_url()),
        "",
    ));
    let env = TestEnv::new(&config).await;
    let ctx = env.context(config.clone()).await;
    let (job_id, _) = env.admit(&ctx, "acct_z", "zombie", "zombie").await;
    let first = env.store.job(job_id).await.unwrap().unwrap().attempts[0].id;
    let primary = env
        .store
        .start("primary", &[first], Duration::from_secs(30))
        .await
        .unwrap()
        .remove(0);
    let (hedge, publish) = env.store.hedge(job_id, "fallback").await.unwrap().unwrap();
    ctx.publish_outbox(&publish).await.unwrap();
    let (settled, _) = env
        .store
        .finalize(&[timed_out(&primary)], &common::give_up)
        .await
        .unwrap();
    assert_eq!(settled, vec![Settled::Unknown]);

    // The hedge's delivery arrives while the job is blocked, and is settled.
    let fleet = env
        .fleet(
            config.clone(),
            vec![onejob::fleet::Role::Attempts("fallback".into())],
        )
        .await;
    let queue = onejob::broker::attempts_queue("fallback");
    wait_for(
        "the hedge's delivery to be settled",
        Duration::from_secs(20),
        || async { (queue_total(&env.name, &queue) == Some(0)).then_some(()) },
    )
    .await;
    assert_eq!(
        fallback.stats.requests(),
        0,
        "nothing runs beside an unknown"
    );
    let job = env.store.job(job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Unknown);

    // The operator resolves the primary as failed: the hedge runs and wins.
    env.cli_ok(
        &file.path,
        &[
            "attempts",
            "resolve",
            &primary.attempt_id.to_string(),
            "--as",
            "failed",
        ],
    );
    let job = wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    assert_eq!(job.completed_by, Some(hedge));
    assert_eq!(fallback.stats.requests(), 1);
    fleet.stop().await;
    let _ = ctx.connection.close(200, "done".into()).await;
}

/// Item 15: `cancel` used to update the attempts before it locked the job, so a
/// retry planned at the same moment could leave a `queued` attempt on a cancelled
/// job. Many cancellations race a failure whose retry is due at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cancel_never_leaves_a_queued_attempt_behind() {
    let env = common::store_env().await;
    let store = Arc::new(env.store.clone());
    let retry = |_: &FailedJob| NextStep::Retry {
        provider: "primary".into(),
        delay: Duration::ZERO,
    };
    let mut stranded = 0;
    for round in 0..15 {
        let mut jobs = Vec::new();
        for i in 0..16 {
            jobs.push(started(&store, &format!("cancel-{round}-{i}")).await);
        }
        let barrier = Arc::new(tokio::sync::Barrier::new(jobs.len() * 2));
        let mut tasks = Vec::new();
        for (job_id, s) in &jobs {
            let (st, b, job_id) = (store.clone(), barrier.clone(), *job_id);
            tasks.push(tokio::spawn(async move {
                b.wait().await;
                let _ = st
                    .cancel_job(job_id, &onejob::store::Actor::cli(None))
                    .await
                    .unwrap();
            }));
            let (st, b) = (store.clone(), barrier.clone());
            let failed = finished(
                s,
                Verdict::Failed {
                    error: "provider_error: HTTP 500".into(),
                    retryable: true,
                    retry_after: None,
                },
            );
            tasks.push(tokio::spawn(async move {
                b.wait().await;
                common::settle_with(&st, &[failed], &retry).await;
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        for (job_id, _) in &jobs {
            let job = store.job(*job_id).await.unwrap().unwrap();
            assert_eq!(job.status, JobStatus::Cancelled);
            if job
                .attempts
                .iter()
                .any(|a| a.status == AttemptStatus::Queued)
            {
                stranded += 1;
            }
        }
    }
    assert_eq!(stranded, 0, "cancelled jobs left with a queued attempt");
}

/// Runs the operator CLI against `env`, killed if it runs past a minute (a
/// replay that never ends must fail the test, not hang it).
fn cli_bounded(
    env: &TestEnv,
    config_path: &std::path::Path,
    args: &[&str],
) -> std::process::Output {
    std::process::Command::new("timeout")
        .arg("60")
        .arg(env!("CARGO_BIN_EXE_onejob"))
        .args(args)
        .env("DATABASE_URL", &env.database_url)
        .env("AMQP_URL", &env.amqp_url)
        .env("ONEJOB_CONFIG", config_path)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run the onejob CLI")
}

/// Item 11: `dlq replay --all` looks only at the letters present when it starts
/// (a letter that dies again is not replayed again and again), reports each one,
/// and skips a letter it cannot replay instead of stopping there.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dlq_replay_all_is_bounded_and_reports_each_letter() {
    let primary = mock(MockOptions::default()).await;
    let (config, file) = config(&config_for(&[P("primary", &primary.base_url(), "")], ""));
    let env = TestEnv::new(&config).await;
    let fleet = env
        .fleet(config.clone(), vec![onejob::fleet::Role::Intake])
        .await;
    let conn = env.amqp().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    let dlq = onejob::broker::dead_letter_queue(onejob::broker::INTENTS_QUEUE);
    let publish = |exchange: &'static str,
                   key: &'static str,
                   id: &'static str,
                   body: Vec<u8>,
                   headers: FieldTable| {
        let ch = ch.clone();
        async move {
            ch.basic_publish(
                exchange.into(),
                key.into(),
                BasicPublishOptions::default(),
                &body,
                onejob::broker::json_properties()
                    .with_message_id(id.into())
                    .with_headers(headers),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        }
    };
    // A bad intent, dead-lettered by intake: replaying it makes it die again.
    publish(
        onejob::broker::EXCHANGE,
        onejob::broker::INTENTS_KEY,
        "bad-1",
        b"not json".to_vec(),
        FieldTable::default(),
    )
    .await;
    common::wait_for_depth(
        "the bad intent's dead letter",
        Duration::from_secs(20),
        &ch,
        &dlq,
        1,
    )
    .await;
    // A good intent with its origin.
    let mut origin = FieldTable::default();
    for (k, v) in [
        ("x-onejob-original-exchange", onejob::broker::EXCHANGE),
        ("x-onejob-original-routing-key", onejob::broker::INTENTS_KEY),
    ] {
        origin.insert(k.into(), AMQPValue::LongString(LongString::from(v)));
    }
    let good = serde_json::to_vec(&common::intent("acct_r", "good", "replayed")).unwrap();
    publish(
        onejob::broker::DLX,
        onejob::broker::INTENTS_QUEUE,
        "good-1",
        good,
        origin,
    )
    .await;
    // A letter whose headers name somewhere else than its own work queue: a
    // replay never goes there (it goes only home), so it is skipped.
    let mut elsewhere = FieldTable::default();
    for (k, v) in [
        ("x-onejob-original-exchange", onejob::broker::EVENTS),
        ("x-onejob-original-routing-key", "job.succeeded"),
    ] {
        elsewhere.insert(k.into(), AMQPValue::LongString(LongString::from(v)));
    }
    publish(
        onejob::broker::DLX,
        onejob::broker::INTENTS_QUEUE,
        "orphan-1",
        b"{}".to_vec(),
        elsewhere,
    )
    .await;
    assert_eq!(common::depth(&ch, &dlq).await, 3);

    let out = cli_bounded(
        &env,
        &file.path,
        &["dlq", "replay", &dlq, "--all", "--json"],
    );
    assert_ne!(out.status.code(), Some(124), "replay did not end");
    assert_eq!(
        out.status.code(),
        Some(1),
        "a skipped letter is reported: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
    assert_eq!(report["replayed"], 2, "{report}");
    assert_eq!(report["skipped"], 1, "{report}");
    let letters = report["dead_letters"].as_array().unwrap();
    assert_eq!(letters.len(), 3);
    let orphan = letters
        .iter()
        .find(|l| l["message_id"] == "orphan-1")
        .unwrap();
    assert_eq!(orphan["outcome"], "skipped");
    assert!(
        orphan["reason"]
            .as_str()
            .unwrap()
            .contains("a replay goes only to the work queue its dead-letter queue belongs to"),
        "{orphan}"
    );
    assert!(letters.iter().all(|l| l.get("body").is_none()));

    // The good intent became a job; the bad one died once more, and it and the
    // orphan are what the queue holds.
    let job = wait_for(
        "the replayed intent's job",
        Duration::from_secs(20),
        || async { env.store.find_job("acct_r", "good").await.unwrap() },
    )
    .await;
    assert_eq!(job.idempotency_key, "good");
    common::wait_for_depth(
        "the bad intent to die again",
        Duration::from_secs(20),
        &ch,
        &dlq,
        2,
    )
    .await;
    let _ = conn.close(200, "done".into()).await;
    fleet.stop().await;
}

/// Item 12: a provider answer is read up to the provider's `max_response_bytes`
/// and no further; a larger one fails the attempt definitely, so a provider
/// cannot make a worker hold more than that per call.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_answer_over_max_response_bytes_fails_the_attempt() {
    let Running {
        primary: _primary,
        env,
        fleet,
        producer,
        _file,
    } = Running::start("max_response_bytes = 65536", 1).await;

    let large = submit(&producer, "acct_big", "large", "mock:pad=200000").await;
    let job = wait_for_status(&env, large, JobStatus::Failed).await;
    let error = job.attempts[0].error.clone().unwrap_or_default();
    assert!(
        error.starts_with("provider_error: answer_too_large") && error.contains("65536"),
        "{error}"
    );
    // Within the limit, a large answer is a result like any other.
    let fits = submit(&producer, "acct_big", "fits", "mock:pad=40000").await;
    let job = wait_for_status(&env, fits, JobStatus::Succeeded).await;
    assert!(job.result.unwrap()["summary"].as_str().unwrap().len() > 40_000);
    producer.close().await;
    fleet.stop().await;
}

/// Item 15: published outbox rows are pruned after `outbox_retention`; rows not
/// yet published, and recent ones, stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn published_outbox_rows_are_pruned() {
    let text = config_text("http://127.0.0.1:9/v1", None, "")
        .replace("[worker]\n", "[worker]\noutbox_retention = \"1m\"\n");
    let (config, _file) = config(&text);
    let env = TestEnv::new(&config).await;
    let pool = env.store.pool();
    let ids: Vec<(i64,)> = sqlx::query_as(
        "INSERT INTO outbox (exchange, routing_key, message_id, body, published_at, not_before)
         VALUES ('onejob.events', 'job.succeeded', 'old', '{}', now() - interval '2 hours', now() + interval '1 day'),
                ('onejob.events', 'job.succeeded', 'recent', '{}', now() - interval '10 seconds', now() + interval '1 day'),
                ('onejob.events', 'job.succeeded', 'pending', '{}', NULL, now() + interval '1 day')
         RETURNING id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(ids.len(), 3);
    let fleet = env
        .fleet(config.clone(), vec![onejob::fleet::Role::Reconciler])
        .await;
    let left: Vec<String> = wait_for(
        "the old row to be pruned",
        Duration::from_secs(20),
        || async {
            let left: Vec<(String,)> = sqlx::query_as("SELECT message_id FROM outbox ORDER BY id")
                .fetch_all(pool)
                .await
                .unwrap();
            let left: Vec<String> = left.into_iter().map(|(m,)| m).collect();
            (!left.contains(&"old".to_owned())).then_some(left)
        },
    )
    .await;
    assert_eq!(left, vec!["recent".to_owned(), "pending".to_owned()]);
    fleet.stop().await;
}

/// Item 15: an attempt that has not started because its message waits behind a
/// backlog is not republished, nor failed as lost, while its queue holds messages.
/// Beside it, a control attempt on another provider whose message was lost
/// (its queue is empty) is stuck for as long: the sweep that republishes the
/// control, and the one after that fails it, each had the backlogged attempt
/// in the same statement, and left it alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_stuck_sweep_leaves_attempts_waiting_in_a_backlog() {
    // One attempt per job, so that the failed control leaves nothing behind it.
    let text = config_text("http://127.0.0.1:9/v1", Some("http://127.0.0.1:9/v1"), "")
        .replace(
            "[worker]\n",
            "[worker]\nstuck_after = \"200ms\"\nmax_republish = 1\n",
        )
        .replace("max_attempts = 3", "max_attempts = 1");
    let (config, _file) = config(&text);
    let env = TestEnv::new(&config).await;
    let ctx = env.context(config.clone()).await;
    let (job_id, publish) = env.admit(&ctx, "acct_b", "backlog", "backlog").await;
    // The control, admitted after it (so stuck no sooner), pinned to the fallback.
    let mut pinned = common::intent("acct_b", "lost", "lost");
    pinned.provider = Some("fallback".into());
    let body = serde_json::to_vec(&pinned).unwrap();
    let new = onejob::intake::validate(&ctx, &body).expect("valid intent");
    let control = new.job_id;
    let control_publish = match env.store.admit(&[new]).await.unwrap().remove(0) {
        onejob::store::Admission::Created { publish, .. } => publish,
        other => panic!("expected created, got {other:?}"),
    };
    // Its message is in the queue, behind nothing, with no consumer: a backlog.
    // The control's message is published, then lost (taken off its queue).
    ctx.publish_outbox(&[publish, control_publish])
        .await
        .unwrap();
    let ch = ctx.connection.create_channel().await.unwrap();
    let queue = onejob::broker::attempts_queue("primary");
    let fallback_queue = onejob::broker::attempts_queue("fallback");
    assert_eq!(env.drain(&ch, &fallback_queue).await.len(), 1);
    let republished = |job: onejob::domain::JobId| {
        let pool = env.store.pool().clone();
        async move {
            let (n,): (i32,) = sqlx::query_as("SELECT republished FROM attempts WHERE job_id = $1")
                .bind(job.0)
                .fetch_one(&pool)
                .await
                .unwrap();
            n
        }
    };
    let left_alone = || async {
        let job = env.store.job(job_id).await.unwrap().unwrap();
        assert_eq!(job.attempts.len(), 1, "{job:?}");
        assert_eq!(job.attempts[0].status, AttemptStatus::Queued, "{job:?}");
        assert_eq!(republished(job_id).await, 0, "republished from the backlog");
        assert_eq!(
            common::depth(&ch, &queue).await,
            1,
            "republished into the backlog"
        );
    };

    let fleet = env
        .fleet(config.clone(), vec![onejob::fleet::Role::Reconciler])
        .await;
    // The first sweep to find the control stuck republishes it...
    wait_for(
        "the control to be republished",
        Duration::from_secs(20),
        || async {
            left_alone().await;
            (republished(control).await == 1).then_some(())
        },
    )
    .await;
    left_alone().await;
    // ...and, its message lost again, a later one fails it as lost.
    common::wait_for_messages(&env, &ch, &fallback_queue).await;
    let failed = wait_for(
        "the control to be failed as lost",
        Duration::from_secs(20),
        || async {
            left_alone().await;
            let job = env.store.job(control).await.unwrap().unwrap();
            (job.attempts[0].status == AttemptStatus::Failed).then_some(job)
        },
    )
    .await;
    assert!(
        failed.attempts[0]
            .error
            .as_deref()
            .unwrap_or("")
            .starts_with("attempt_lost"),
        "{failed:?}"
    );
    left_alone().await;
    fleet.stop().await;
    let _ = ctx.connection.close(200, "done".into()).await;
}

/// Item 5: work queues are declared for at-least-once dead-lettering. A fleet
/// that meets a queue declared the old way says so in one line naming the queue
/// and the way out; `onejob queues upgrade` redeclares it only once it is empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn old_queues_are_named_and_upgraded_only_when_empty() {
    let (config, file) = config(&config_text("http://127.0.0.1:9/v1", None, ""));
    let env = TestEnv::new(&config).await;
    let conn = env.amqp().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    // onejob.intents as the previous version declared it, with a message in it.
    let mut args = FieldTable::default();
    let text = |v: &str| AMQPValue::LongString(LongString::from(v));
    args.insert("x-queue-type".into(), text("quorum"));
    args.insert("x-dead-letter-exchange".into(), text("onejob.dlx"));
    args.insert("x-dead-letter-routing-key".into(), text("onejob.intents"));
    args.insert("x-delivery-limit".into(), AMQPValue::LongLongInt(5));
    ch.queue_declare(
        "onejob.intents".into(),
        lapin::options::QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .unwrap();
    ch.basic_publish(
        "".into(),
        "onejob.intents".into(),
        BasicPublishOptions::default(),
        b"{}",
        onejob::broker::json_properties(),
    )
    .await
    .unwrap()
    .await
    .unwrap();

    // onejob.attempts.primary declared the old way too, but empty.
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), text("quorum"));
    args.insert("x-dead-letter-exchange".into(), text("onejob.dlx"));
    args.insert(
        "x-dead-letter-routing-key".into(),
        text("onejob.attempts.primary"),
    );
    args.insert("x-delivery-limit".into(), AMQPValue::LongLongInt(5));
    ch.queue_declare(
        "onejob.attempts.primary".into(),
        lapin::options::QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .unwrap();

    let refused =
        onejob::runtime::Context::connect(config.clone(), &env.database_url, &env.amqp_url)
            .await
            .expect_err("a fleet must not start on an outdated queue")
            .to_string();
    assert!(
        refused.contains("\"onejob.intents\"") && refused.contains("onejob queues upgrade"),
        "{refused}"
    );
    assert_eq!(refused.lines().count(), 1, "{refused}");

    let out = env.cli(&file.path, &["queues", "upgrade", "--json"]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        report["queues"]["onejob.intents"]["outcome"], "refused",
        "{report}"
    );
    assert_eq!(report["queues"]["onejob.intents"]["messages"], 1);
    assert_eq!(
        common::depth(&ch, "onejob.intents").await,
        1,
        "never deleted with a message in it"
    );
    // The empty one was redeclared, and bound again although the other was refused.
    assert_eq!(
        report["queues"]["onejob.attempts.primary"]["outcome"], "redeclared",
        "{report}"
    );
    let publisher = onejob::broker::Publisher::open(&conn).await.unwrap();
    publisher
        .publish(
            onejob::broker::EXCHANGE,
            &onejob::broker::attempts_routing_key("primary"),
            b"{}",
            onejob::broker::json_properties(),
            true,
        )
        .await
        .expect("routable again at once");
    assert_eq!(env.drain(&ch, "onejob.attempts.primary").await.len(), 1);

    // Drained, it is redeclared, and the fleet starts.
    assert_eq!(env.drain(&ch, "onejob.intents").await.len(), 1);
    let out = env.cli_ok(&file.path, &["queues", "upgrade", "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        report["queues"]["onejob.intents"]["outcome"], "redeclared",
        "{report}"
    );
    assert_eq!(
        report["queues"]["onejob.attempts.primary"]["outcome"], "current",
        "{report}"
    );
    let listed = std::process::Command::new("rabbitmqctl")
        .args(["list_queues", "-q", "-p", &env.name, "name", "arguments"])
        .output()
        .unwrap();
    let listed = String::from_utf8_lossy(&listed.stdout).into_owned();
    let work: Vec<&str> = listed
        .lines()
        .filter(|l| l.starts_with("onejob.") && !l.contains(".dlq"))
        .collect();
    assert_eq!(work.len(), 2, "{listed}");
    for line in work {
        assert!(
            line.contains("at-least-once") && line.contains("reject-publish"),
            "{line}"
        );
    }
    let ctx = env.context(config.clone()).await;
    let _ = ctx.connection.close(200, "done".into()).await;
    let _ = conn.close(200, "done".into()).await;
}

/// Item 2: when the broker closes the publishing channel (here: a publish to an
/// exchange that does not exist), a new one is opened, readiness says so while it
/// is down, and receipts and attempts flow again. Before, every later publish
/// failed while `/readyz` said ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_closed_publishing_channel_is_reopened() {
    let Running {
        primary: _primary,
        env,
        fleet,
        producer,
        _file,
    } = Running::start("", 3).await;
    let ctx = fleet.ctx.clone();
    for round in 0..3 {
        let before = ctx.publisher.channel();
        let refused = ctx
            .publisher
            .publish(
                "no-such-exchange",
                "k",
                b"{}",
                onejob::broker::json_properties(),
                false,
            )
            .await;
        assert!(refused.is_err(), "the broker refuses an unknown exchange");
        wait_for(
            "the channel to be replaced",
            Duration::from_secs(10),
            || async {
                (ctx.publisher.is_open() && ctx.publisher.channel().id() != before.id())
                    .then_some(())
            },
        )
        .await;
        let job_id = submit(
            &producer,
            "acct_ch",
            &format!("k{round}"),
            "after a closed channel",
        )
        .await;
        wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    }
    producer.close().await;
    fleet.stop().await;
}

/// Item 2: when the AMQP connection is gone for good, every role stops (the
/// reconciler too, which has no consumer to notice) and the worker reports it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn losing_the_broker_for_good_stops_every_role() {
    let (config, _file) = config(&config_text("http://127.0.0.1:9/v1", None, ""));
    let env = TestEnv::new(&config).await;
    let ctx = env.context(config.clone()).await;
    let shutdown = onejob::shutdown::Shutdown::new();
    let run = tokio::spawn(onejob::fleet::run(
        ctx.clone(),
        vec![onejob::fleet::Role::Reconciler],
        shutdown.clone(),
    ));
    ctx.connection
        .close(320, "gone for good".into())
        .await
        .unwrap();
    let result = tokio::time::timeout(Duration::from_secs(20), run)
        .await
        .expect("the worker stops by itself")
        .unwrap();
    let error = result.expect_err("and says why").to_string();
    assert!(error.contains("RabbitMQ connection lost"), "{error}");
}

/// Item 4: a Postgres outage longer than the delivery limit would allow if
/// deliveries were handed back. With a delivery limit of 1, intents published
/// during the outage are held, unacked, while the worker reports itself unready;
/// once Postgres is back every one becomes a job and nothing is dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_database_outage_costs_no_delivery_and_loses_nothing() {
    let primary = mock(MockOptions::default()).await;
    let text = config_for(&[P("primary", &primary.base_url(), "")], "")
        .replace("[worker]\n", "[worker]\ndelivery_limit = 1\n");
    let (config, _file) = config(&text);
    let env = TestEnv::new(&config).await;
    let (path, ctx) = behind_a_cuttable_postgres(&env, &config).await;
    let shutdown = onejob::shutdown::Shutdown::new();
    let run = tokio::spawn(onejob::fleet::run(ctx.clone(), vec![], shutdown.clone()));
    let producer = Producer::connect_with(
        &env.amqp_url,
        onejob_producer::ProducerOptions {
            delivery_limit: 1,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let warm = submit(&producer, "acct_o", "warm", "before").await;
    wait_for_status(&env, warm, JobStatus::Succeeded).await;

    path.cut();
    let keys: Vec<String> = (0..20).map(|i| format!("during-{i}")).collect();
    for key in &keys {
        producer
            .publish_only(&common::intent("acct_o", key, "during the outage"))
            .await
            .unwrap();
    }
    assert!(
        !ctx.store.ping().await,
        "the worker sees the outage (/readyz: postgres down)"
    );
    let ch = env.amqp().await.create_channel().await.unwrap();
    let dlq = onejob::broker::dead_letter_queue(onejob::broker::INTENTS_QUEUE);
    let intents = onejob::broker::INTENTS_QUEUE;
    // Every intent was delivered to the worker, which holds it unacked.
    wait_for(
        "the worker to hold every intent of the outage",
        Duration::from_secs(20),
        || async { (common::queue_counts(&env.name, intents) == Some((0, 20))).then_some(()) },
    )
    .await;
    // Held through the outage: for at least 8 s, and until the worker has tried
    // Postgres again and again (each try a chance to give up and hand the
    // deliveries back, which with a delivery limit of 1 dead-letters them on
    // the second return), the deliveries stay with it and nothing is
    // dead-lettered.
    let tries_before = path.refused();
    let held_since = std::time::Instant::now();
    wait_for(
        "the worker to keep trying Postgres through the outage",
        Duration::from_secs(60),
        || async {
            assert_eq!(
                common::queue_counts(&env.name, intents),
                Some((0, 20)),
                "every intent stays delivered and unacked"
            );
            assert_eq!(
                common::depth(&ch, &dlq).await,
                0,
                "nothing dead-lettered during the outage"
            );
            (held_since.elapsed() >= Duration::from_secs(8) && path.refused() >= tries_before + 10)
                .then_some(())
        },
    )
    .await;
    path.restore();

    for key in &keys {
        let job = wait_for(
            &format!("a job for {key}"),
            Duration::from_secs(60),
            || async { env.store.find_job("acct_o", key).await.unwrap() },
        )
        .await;
        wait_for_status(&env, job.id, JobStatus::Succeeded).await;
    }
    assert_eq!(common::depth(&ch, &dlq).await, 0, "nothing dead-lettered");
    producer.close().await;
    shutdown.trigger();
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

/// Item 15: a confirm that never comes (a hung broker: the connection stays
/// open, nothing moves) is reported as what it is, not as a refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_missing_confirm_is_a_timeout_not_a_nack() {
    let (config, _file) = config(&config_text("http://127.0.0.1:9/v1", None, ""));
    let env = TestEnv::new(&config).await;
    let path = common::Cuttable::to("127.0.0.1:5672").await;
    let url = env
        .amqp_url
        .replace("127.0.0.1:5672", &path.addr.to_string());
    let conn = onejob::broker::connect(&url, onejob::broker::Recovery::None)
        .await
        .unwrap();
    let publisher = onejob::broker::Publisher::open(&conn)
        .await
        .unwrap()
        .with_confirm_timeout(Duration::from_millis(500));
    path.stall();
    let error = publisher
        .publish(
            "",
            "nowhere",
            b"{}",
            onejob::broker::json_properties(),
            false,
        )
        .await
        .expect_err("no confirm can come")
        .to_string();
    assert!(
        error.starts_with("no publisher confirm") && !error.contains("nacked"),
        "{error}"
    );
    path.restore();
}

/// Review of item 8: a hedge's win racing its primary's timeout. Whichever
/// commits first, no attempt is left `unknown` on the ended job (the win's
/// clean-up must see a timeout that committed while it waited for the job).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_win_racing_a_timeout_leaves_no_unknown_behind() {
    let env = common::store_env().await;
    let store = Arc::new(env.store.clone());
    let mut stranded = 0;
    for round in 0..15 {
        let mut pairs = Vec::new();
        for i in 0..16 {
            let (job_id, primary) = started(&store, &format!("win-{round}-{i}")).await;
            let (hedge, _) = store.hedge(job_id, "fallback").await.unwrap().unwrap();
            let hedge = store
                .start("fallback", &[hedge], Duration::from_secs(30))
                .await
                .unwrap()
                .remove(0);
            pairs.push((job_id, primary, hedge));
        }
        let barrier = Arc::new(tokio::sync::Barrier::new(pairs.len() * 2));
        let mut tasks = Vec::new();
        for (_, primary, hedge) in &pairs {
            let (s, b, f) = (store.clone(), barrier.clone(), timed_out(primary));
            tasks.push(tokio::spawn(async move {
                b.wait().await;
                common::settle_with(&s, &[f], &common::give_up).await;
            }));
            let (s, b) = (store.clone(), barrier.clone());
            let f = finished(hedge, Verdict::Succeeded(json!({"summary": "s"})));
            tasks.push(tokio::spawn(async move {
                b.wait().await;
                common::settle_with(&s, &[f], &common::give_up).await;
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        for (job_id, _, _) in &pairs {
            let job = store.job(*job_id).await.unwrap().unwrap();
            assert_eq!(job.status, JobStatus::Succeeded);
            if job
                .attempts
                .iter()
                .any(|a| a.status == AttemptStatus::Unknown)
            {
                stranded += 1;
            }
        }
    }
    assert_eq!(stranded, 0, "succeeded jobs left with an unknown attempt");
}

/// Review of item 8: the vanished-worker sweep racing a cancellation. The sweep
/// must judge the job under its lock: no attempt is left `unknown` on the
/// cancelled job.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_vanished_sweep_racing_a_cancel_leaves_no_unknown_behind() {
    let env = common::store_env().await;
    let store = Arc::new(env.store.clone());
    let mut stranded = 0;
    for round in 0..15 {
        let mut jobs = Vec::new();
        for i in 0..16 {
            let (job_id, s) = started(&store, &format!("vanish-{round}-{i}")).await;
            sqlx::query(
                "UPDATE attempts SET deadline_at = now() - interval '1 hour' WHERE id = $1",
            )
            .bind(s.attempt_id.0)
            .execute(store.pool())
            .await
            .unwrap();
            jobs.push(job_id);
        }
        let barrier = Arc::new(tokio::sync::Barrier::new(jobs.len() + 1));
        let mut tasks = Vec::new();
        for job_id in &jobs {
            let (s, b, job_id) = (store.clone(), barrier.clone(), *job_id);
            tasks.push(tokio::spawn(async move {
                b.wait().await;
                let _ = s
                    .cancel_job(job_id, &onejob::store::Actor::cli(None))
                    .await
                    .unwrap();
            }));
        }
        let (s, b) = (store.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            b.wait().await;
            // A deadlock with a cancellation is possible and harmless: the sweep
            // runs again on the reconciler's next pass, as here.
            while s.expire_vanished(Duration::ZERO).await.is_err() {}
        }));
        for t in tasks {
            t.await.unwrap();
        }
        for job_id in &jobs {
            let job = store.job(*job_id).await.unwrap().unwrap();
            assert_eq!(job.status, JobStatus::Cancelled);
            if job
                .attempts
                .iter()
                .any(|a| a.status == AttemptStatus::Unknown)
            {
                stranded += 1;
            }
        }
    }
    assert_eq!(stranded, 0, "cancelled jobs left with an unknown attempt");
}

/// Issue 11: a fresh database that takes a backlog is analyzed as soon as its
/// busy tables have a thousand changed rows, not a minute later on
/// autovacuum's round; once current, the statistics are left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn statistics_follow_a_fresh_database_that_fills_up() {
    let env = common::store_env().await;
    let store = &env.store;
    for chunk in 0..12 {
        let batch: Vec<_> = (0..100)
            .map(|i| common::new_job("acct_stats", &format!("k-{chunk}-{i}"), "x"))
            .collect();
        store.admit(&batch).await.unwrap();
    }
    // The activity counters reach pg_stat_user_tables within seconds.
    let analyzed = wait_for(
        "jobs and attempts to be analyzed",
        Duration::from_secs(30),
        || async {
            let tables = store.refresh_statistics().await.unwrap();
            (tables.contains(&"jobs".to_owned()) && tables.contains(&"attempts".to_owned()))
                .then_some(tables)
        },
    )
    .await;
    assert!(
        analyzed
            .iter()
            .all(|t| ["jobs", "attempts", "outbox"].contains(&t.as_str()))
    );
    let (reltuples,): (f32,) =
        sqlx::query_as("SELECT reltuples FROM pg_class WHERE relname = 'jobs'")
            .fetch_one(store.pool())
            .await
            .unwrap();
    assert_eq!(
        reltuples, 1200.0,
        "the planner knows how many jobs there are"
    );
    let again = store.refresh_statistics().await.unwrap();
    assert!(
        !again.contains(&"jobs".to_owned()),
        "current statistics are left alone: {again:?}"
    );
}

/// Issue 11 review: a delivery whose work did not commit goes back to its
/// queue, never acked. Here the claim cannot commit (Postgres unreachable) when
/// the worker stops: the attempt message must be in its queue again, ready for
/// the next worker, and the attempt still `queued`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_attempt_not_claimed_when_the_worker_stops_goes_back_to_its_queue() {
    let primary = mock(MockOptions::default()).await;
    let (config, _file) = config(&config_text(&primary.base_url(), None, ""));
    let env = TestEnv::new(&config).await;
    let (path, ctx) = behind_a_cuttable_postgres(&env, &config).await;
    let shutdown = onejob::shutdown::Shutdown::new();
    let run = tokio::spawn(onejob::fleet::run(
        ctx.clone(),
        vec![onejob::fleet::Role::Attempts("primary".into())],
        shutdown.clone(),
    ));
    let (job_id, message) = env.admit(&ctx, "acct_r", "requeue", "x").await;

    path.cut();
    onejob::runtime::publish_outbox(&ctx.publisher, &env.store, &[message])
        .await
        .unwrap();
    let queue = onejob::broker::attempts_queue("primary");
    let ch = env.amqp().await.create_channel().await.unwrap();
    // Taken by the worker, which cannot claim it while Postgres is away.
    common::wait_for_depth(
        "the worker to take the message",
        Duration::from_secs(10),
        &ch,
        &queue,
        0,
    )
    .await;
    shutdown.trigger();
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .unwrap()
        .unwrap()
        .unwrap();

    // The broker takes the returned message back on its own time.
    common::wait_for_depth(
        "the unclaimed attempt's message to be back in its queue",
        Duration::from_secs(15),
        &ch,
        &queue,
        1,
    )
    .await;
    path.restore();
    let job = env.store.job(job_id).await.unwrap().unwrap();
    assert_eq!(job.attempts[0].status, AttemptStatus::Queued);
}

/// Issue 11 review: a stopping worker starts nothing new. With one call slot,
/// a slow call in flight and a second attempt waiting for the slot, shutdown
/// lets the call finish and settle, and hands the waiting one back to its queue
/// unstarted, without calling the provider for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stopping_worker_starts_nothing_new() {
    let primary = mock(MockOptions {
        delay: Duration::from_millis(1500),
        ..MockOptions::default()
    })
    .await;
    let text = config_for(
        &[P("primary", &primary.base_url(), "timeout = \"10s\"")],
        "",
    )
    .replace("concurrency = 8", "concurrency = 1");
    let (config, _file) = config(&text);
    let env = TestEnv::new(&config).await;
    let fleet = env
        .fleet(
            config.clone(),
            vec![onejob::fleet::Role::Attempts("primary".into())],
        )
        .await;
    let (first, m1) = env.admit(&fleet.ctx, "acct_s", "first", "x").await;
    let (second, m2) = env.admit(&fleet.ctx, "acct_s", "second", "x").await;
    fleet.ctx.publish_outbox(&[m1, m2]).await.unwrap();
    wait_for("one call in flight", Duration::from_secs(10), || async {
        (primary.stats.requests() == 1).then_some(())
    })
    .await;
    fleet.stop().await;

    assert_eq!(primary.stats.requests(), 1, "nothing called after shutdown");
    let done = env.store.job(first).await.unwrap().unwrap();
    let waiting = env.store.job(second).await.unwrap().unwrap();
    // Which of the two got the slot first is the broker's order.
    let (done, waiting) = if done.status == JobStatus::Succeeded {
        (done, waiting)
    } else {
        (waiting, done)
    };
    assert_eq!(
        done.status,
        JobStatus::Succeeded,
        "the call in flight settled"
    );
    assert_eq!(waiting.attempts[0].status, AttemptStatus::Queued);
    let ch = env.amqp().await.create_channel().await.unwrap();
    let queue = onejob::broker::attempts_queue("primary");
    common::wait_for_depth(
        "the waiting attempt's message to be back in its queue",
        Duration::from_secs(15),
        &ch,
        &queue,
        1,
    )
    .await;
}

/// A worker context whose Postgres connections go through a TCP path the test
/// can cut and restore.
async fn behind_a_cuttable_postgres(
    env: &TestEnv,
    config: &std::sync::Arc<onejob::config::Config>,
) -> (common::Cuttable, onejob::runtime::Context) {
    let path = common::Cuttable::to("127.0.0.1:5432").await;
    let proxied = env
        .database_url
        .replace("127.0.0.1:5432", &path.addr.to_string());
    let ctx = onejob::runtime::Context::connect(config.clone(), &proxied, &env.amqp_url)
        .await
        .unwrap();
    (path, ctx)
}
