//! Failover that can be trusted: qualification, the failover gate, hedging,
//! cancellation, vanished workers, and Retry-After; end to end through the real
//! RabbitMQ and Postgres, with mock providers over HTTP.

use onejob_test_support as common;

use std::path::Path;
use std::time::Duration;

use common::{
    P, TestEnv, config, config_for, intent, mock, submit, wait_for, wait_for_messages,
    wait_for_status,
};
use onejob::domain::{AttemptId, AttemptStatus, JobId, JobStatus};
use onejob::edges::store::{JobView, NewJob};
use onejob::fleet::Role;
use onejob::mock::{Misbehaviour, MockHandle, MockOptions};
use onejob_producer::Producer;

fn stdout_json(out: &std::process::Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {}\nstderr: {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

fn states(list: &serde_json::Value) -> std::collections::BTreeMap<String, (String, bool)> {
    list.as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let op = &p["operations"][0];
            (
                p["provider"].as_str().unwrap().to_owned(),
                (
                    op["qualification"].as_str().unwrap().to_owned(),
                    op["eligible"] == true,
                ),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn qualification_passes_fails_and_goes_stale() {
    let good = mock(MockOptions::default()).await;
    let extra = misbehaving(Misbehaviour::ExtraKey).await;
    let prose = misbehaving(Misbehaviour::Prose).await;
    let wrong = misbehaving(Misbehaviour::WrongType).await;
    let (good_url, extra_url, prose_url, wrong_url) = (
        good.base_url(),
        extra.base_url(),
        prose.base_url(),
        wrong.base_url(),
    );
    let providers = [
        P("primary", &good_url, ""),
        P("good", &good_url, ""),
        P("extra", &extra_url, ""),
        P("prose", &prose_url, ""),
        P("wrong", &wrong_url, ""),
        P("tiny", &good_url, "context_window = 10"),
    ];
    let (config, file) = config(&config_for(&providers, ""));
    let env = TestEnv::new(&config).await;

    good_qualifies(&env, &file.path);
    the_misbehaving_do_not_qualify(&env, &file.path);

    let listed = states(&stdout_json(
        &env.cli(&file.path, &["providers", "list", "--json"]),
    ));
    assert_eq!(listed["good"], ("qualified".into(), true));
    assert_eq!(listed["extra"], ("failed".into(), false));
    assert_eq!(listed["tiny"], ("failed".into(), false));
    assert_eq!(
        listed["primary"],
        ("never_qualified".into(), true),
        "the route's first needs none"
    );

    // A config change that alters the contract makes the qualification stale.
    let changed = config_for(&providers, "")
        .replace("Summarize: {{ text }}", "Summarise briefly: {{ text }}");
    let changed_file = common::tempfile_path::TempConfig::new(&changed);
    let listed = states(&stdout_json(
        &env.cli(&changed_file.path, &["providers", "list", "--json"]),
    ));
    assert_eq!(listed["good"], ("stale".into(), false));
    // So does a new model for that provider, and qualifying again restores it.
    let out = env.cli(&changed_file.path, &["providers", "qualify", "good"]);
    assert!(out.status.success());
    let listed = states(&stdout_json(
        &env.cli(&changed_file.path, &["providers", "list", "--json"]),
    ));
    assert_eq!(listed["good"], ("qualified".into(), true));
    let listed = states(&stdout_json(
        &env.cli(&file.path, &["providers", "list", "--json"]),
    ));
    assert_eq!(
        listed["good"],
        ("stale".into(), false),
        "the old contract's qualification is not current any more"
    );
}

/// A mock provider that misbehaves as `how`.
async fn misbehaving(how: Misbehaviour) -> MockHandle {
    mock(MockOptions {
        misbehave: Some(how),
        ..MockOptions::default()
    })
    .await
}

/// `providers qualify good` passes, in JSON and in words, with its prompt
/// tokens estimated.
fn good_qualifies(env: &TestEnv, config: &Path) {
    let out = env.cli_ok(
        config,
        &[
            "providers",
            "qualify",
            "good",
            "--operation",
            "summarize",
            "--json",
        ],
    );
    let report = stdout_json(&out);
    assert_eq!(report[0]["passed"], true);
    assert_eq!(report[0]["cases"][0]["passed"], true);
    assert!(report[0]["cases"][0]["prompt_tokens"].as_u64().unwrap() > 10);
    assert_eq!(
        report[0]["cases"][0]["tokens_estimated"], true,
        "mock-model has no known encoding"
    );
    let human = env.cli(config, &["providers", "qualify", "good"]);
    let text = String::from_utf8_lossy(&human.stdout);
    assert!(
        text.contains("QUALIFIED") && text.contains("(estimate)"),
        "{text}"
    );
}

/// A provider that breaks the contract, or whose prompt does not fit, does
/// not qualify, and says why; nor does a provider or an operation nobody
/// configured.
fn the_misbehaving_do_not_qualify(env: &TestEnv, config: &Path) {
    for (provider, expect) in [
        ("extra", "contract_violation"),
        ("prose", "contract_violation: content is not JSON"),
        ("wrong", "contract_violation: at /summary"),
        ("tiny", "prompt_too_long"),
    ] {
        let out = env.cli(config, &["providers", "qualify", provider, "--json"]);
        assert_eq!(out.status.code(), Some(1), "{provider} must not qualify");
        let report = stdout_json(&out);
        assert_eq!(report[0]["passed"], false);
        let detail = report[0]["cases"][0]["detail"].as_str().unwrap_or("");
        assert!(detail.starts_with(expect), "{provider}: {detail}");
    }
    assert_eq!(
        env.cli(config, &["providers", "qualify", "nobody"])
            .status
            .code(),
        Some(1)
    );
    assert_eq!(
        env.cli(
            config,
            &["providers", "qualify", "good", "--operation", "nothing"]
        )
        .status
        .code(),
        Some(1)
    );
}

/// The refusing provider of the tests below stays refusing: no other test can
/// listen on its port while it is held, and a connection to it is refused.
/// (A port bound and dropped at once was taken by another listener once in CI,
/// and the "refused" attempt then failed some other way.)
#[test]
fn a_refusing_port_stays_refusing() {
    let refusing = common::refusing::RefusingPort::new();
    let taken = std::net::TcpListener::bind(("127.0.0.1", refusing.port));
    assert!(taken.is_err(), "another listener took the refusing port");
    let refused = std::net::TcpStream::connect(("127.0.0.1", refusing.port))
        .expect_err("a connection to the refusing port was accepted");
    assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);
}

/// The primary refuses connections: a definite failure that fails over at once,
/// past an unqualified provider, to the qualified one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failover_reaches_a_qualified_provider_and_never_an_unqualified_one() {
    let unqualified = mock(MockOptions {
        tag: Some("unqualified".into()),
        ..MockOptions::default()
    })
    .await;
    let qualified = mock(MockOptions {
        tag: Some("qualified".into()),
        ..MockOptions::default()
    })
    .await;
    let refusing = common::refusing::RefusingPort::new();
    let (refused, u, q) = (
        refusing.provider_url(),
        unqualified.base_url(),
        qualified.base_url(),
    );
    let (config, file) = config(&config_for(
        &[
            P("primary", &refused, ""),
            P("unqualified", &u, ""),
            P("qualified", &q, ""),
        ],
        "",
    ));
    let env = TestEnv::new(&config).await;
    assert!(
        env.cli(&file.path, &["providers", "qualify", "qualified"])
            .status
            .success()
    );
    let requests_after_qualifying = qualified.stats.requests();
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();

    let job_id = submit(&producer, "acct_f", "k", "fail over").await;
    let job = wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    assert_eq!(job.attempts.len(), 2);
    let (first, second) = (&job.attempts[0], &job.attempts[1]);
    assert_eq!(
        (first.provider.as_str(), first.status),
        ("primary", AttemptStatus::Failed)
    );
    assert!(
        first
            .error
            .as_deref()
            .unwrap_or("")
            .starts_with("provider_unreachable"),
        "the refused attempt failed with {:?}",
        first.error
    );
    assert_eq!(
        (second.provider.as_str(), second.status),
        ("qualified", AttemptStatus::Succeeded)
    );
    assert!(
        job.result.unwrap()["summary"]
            .as_str()
            .unwrap()
            .contains("from qualified")
    );
    // At once: no backoff before failing over to another provider.
    let gap = second.not_before - first.finished_at.unwrap();
    assert!(
        gap < chrono::Duration::milliseconds(100),
        "failover waited {gap}"
    );
    assert_eq!(
        unqualified.stats.requests(),
        0,
        "an unqualified provider never takes a failover"
    );
    assert_eq!(qualified.stats.requests(), requests_after_qualifying + 1);

    producer.close().await;
    fleet.stop().await;
}

/// Hedged reverse order: the primary starts first and answers last; the hedge on
/// the fallback answers first and wins. The primary's late result is discarded,
/// its spend recorded, and the job's result and version never change after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hedge_that_answers_first_wins_and_the_late_primary_is_discarded() {
    let primary = mock(MockOptions {
        delay: Duration::from_secs(2),
        tag: Some("primary".into()),
        ..MockOptions::default()
    })
    .await;
    let fallback = mock(MockOptions {
        tag: Some("fallback".into()),
        ..MockOptions::default()
    })
    .await;
    let (p, f) = (primary.base_url(), fallback.base_url());
    let (config, file) = config(&common::hedged_config(&p, &f));
    let env = TestEnv::new(&config).await;
    assert!(
        env.cli(&file.path, &["providers", "qualify", "fallback"])
            .status
            .success()
    );
    let fleet = env.fleet(config.clone(), vec![]).await;
    let amqp = env.amqp().await;
    let (events, events_queue) = env.watch_events(&amqp).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();

    let job_id = submit(&producer, "acct_h", "k", "hedge me").await;
    let won = wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    assert!(
        won.result.as_ref().unwrap()["summary"]
            .as_str()
            .unwrap()
            .contains("from fallback"),
        "{:?}",
        won.result
    );
    assert_eq!(won.version, 1);

    let job = common::wait_for_attempt(&env, job_id, AttemptStatus::Discarded).await;
    the_hedge_won_and_the_primary_was_discarded(&job, &won);

    // The late primary settled; the outbox all published and the relay run
    // twice more: one job.succeeded event, no second.
    let got = common::events_once_settled(&env, &fleet.ctx, &events, &events_queue).await;
    assert_eq!(got.len(), 1, "one job.succeeded event, no second");
    assert_eq!(got[0].routing_key.as_str(), "job.succeeded");

    let shown = env.cli(&file.path, &["jobs", "show", &job_id.to_string()]);
    let text = String::from_utf8_lossy(&shown.stdout);
    assert!(
        text.contains("discarded") && text.contains("duplicate or wasted spend"),
        "{text}"
    );

    producer.close().await;
    fleet.stop().await;
}

/// The hedge on the fallback won; the primary, started first and answered
/// last, was discarded with its spend recorded; the job is as it was when it
/// was `won`.
fn the_hedge_won_and_the_primary_was_discarded(job: &JobView, won: &JobView) {
    assert_eq!(job.attempts.len(), 2, "exactly one hedge");
    let (main, hedge) = (&job.attempts[0], &job.attempts[1]);
    assert_eq!(
        (main.provider.as_str(), main.status),
        ("primary", AttemptStatus::Discarded)
    );
    assert_eq!(
        (hedge.provider.as_str(), hedge.status),
        ("fallback", AttemptStatus::Succeeded)
    );
    assert!(
        main.started_at < hedge.started_at,
        "the primary started first"
    );
    assert!(main.finished_at > hedge.finished_at, "and answered last");
    assert!(
        main.usage.is_some(),
        "the discarded answer's spend is recorded"
    );
    assert_eq!(job.completed_by, Some(hedge.id));
    assert_eq!(
        (job.version, &job.result, job.updated_at),
        (won.version, &won.result, won.updated_at)
    );
}

/// Cancelling a job while its attempt is in flight: the late result is discarded
/// and the job stays cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cancelled_job_discards_the_late_result() {
    let primary = mock(MockOptions {
        delay: Duration::from_secs(1),
        ..MockOptions::default()
    })
    .await;
    let p = primary.base_url();
    let (config, file) = config(&config_for(&[P("primary", &p, "timeout = \"10s\"")], ""));
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let amqp = env.amqp().await;
    let (events, events_queue) = env.watch_events(&amqp).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();

    let job_id = submit(&producer, "acct_c", "k", "cancel me").await;
    wait_for_status(&env, job_id, JobStatus::Running).await;
    env.cli_ok(&file.path, &["jobs", "cancel", &job_id.to_string()]);
    let cancelled = env.store.jobs().job(job_id).await.unwrap().unwrap();
    assert_eq!(
        (cancelled.status, cancelled.version),
        (JobStatus::Cancelled, 1)
    );

    let job = wait_for("the late result", Duration::from_secs(20), || async {
        let j = env.store.jobs().job(job_id).await.unwrap().unwrap();
        (j.attempts[0].status == AttemptStatus::Discarded).then_some(j)
    })
    .await;
    assert_eq!(job.status, JobStatus::Cancelled);
    assert_eq!((job.version, job.result, job.completed_by), (1, None, None));
    assert!(job.attempts[0].usage.is_some());

    // The late result discarded, the outbox all published and the relay run
    // twice more: one job.cancelled event, no second.
    let got = common::events_once_settled(&env, &fleet.ctx, &events, &events_queue).await;
    assert_eq!(got.len(), 1, "one job.cancelled event, no second");
    assert_eq!(got[0].routing_key.as_str(), "job.cancelled");

    let again = env.cli(&file.path, &["jobs", "cancel", &job_id.to_string()]);
    assert_eq!(again.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&again.stderr).contains("already cancelled"));
    assert_eq!(
        env.cli(
            &file.path,
            &["jobs", "cancel", &uuid::Uuid::now_v7().to_string()]
        )
        .status
        .code(),
        Some(1)
    );

    producer.close().await;
    fleet.stop().await;
}

/// A worker took an attempt and died mid-call: the reconciler turns the attempt
/// and the job `unknown`, and nothing new starts after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_reconciler_turns_a_vanished_workers_attempt_unknown() {
    let primary = mock(MockOptions::default()).await;
    let fallback = mock(MockOptions::default()).await;
    let (p, f) = (primary.base_url(), fallback.base_url());
    let (config, file) = config(&config_for(
        &[P("primary", &p, ""), P("fallback", &f, "")],
        "",
    ));
    let env = TestEnv::new(&config).await;
    // The fallback is qualified, so only the unknown blocks a failover to it.
    assert!(
        env.cli(&file.path, &["providers", "qualify", "fallback"])
            .status
            .success()
    );
    let fallback_calls = fallback.stats.requests();

    // The doomed worker admitted the job and started its attempt, then vanished.
    let intent = intent("acct_z", "vanish", "x");
    let new = NewJob {
        job_id: JobId::new(),
        attempt_id: AttemptId::new(),
        fingerprint: intent.fingerprint(),
        intent,
        provider: "primary".into(),
        trace: None,
        reserve: 0,
    };
    let job_id = new.job_id;
    env.store.admission().admit(&[new]).await.unwrap();
    let job = env.store.jobs().job(job_id).await.unwrap().unwrap();
    let attempt = job.attempts[0].id;
    let timeout = config.providers["primary"].timeout;
    let settle = env.store.settle();
    settle.start("primary", &[attempt], timeout).await.unwrap();

    let fleet = env
        .fleet(
            config.clone(),
            vec![Role::Reconciler, Role::Attempts("primary".into())],
        )
        .await;
    let job = wait_for_status(&env, job_id, JobStatus::Unknown).await;
    assert_eq!(job.attempts[0].status, AttemptStatus::Unknown);
    assert!(
        job.attempts[0]
            .error
            .as_deref()
            .unwrap_or("")
            .starts_with("worker_vanished")
    );

    // Three full backoff periods (at their cap), and three whole runs of each
    // reconciler sweep after the one that found the worker vanished (each a chance to
    // retry, republish or hedge): nothing new starts.
    common::through_sweeps(
        &fleet.ctx,
        3,
        config.worker.retry_backoff_max * 3,
        "the unknown job's window",
        || async {
            let job = env.store.jobs().job(job_id).await.unwrap().unwrap();
            assert_eq!(
                job.attempts.len(),
                1,
                "no retry or failover beside an unknown attempt"
            );
            assert_eq!(job.status, JobStatus::Unknown);
        },
    )
    .await;
    assert_eq!(primary.stats.requests(), 0);
    assert_eq!(fallback.stats.requests(), fallback_calls);
    fleet.stop().await;
}

/// A 429 is a definite failure, and its Retry-After holds the next attempt on the
/// same provider back at least that long.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retry_after_is_honoured() {
    let primary = mock(MockOptions::default()).await;
    let p = primary.base_url();
    let (config, _file) = config(
        &config_for(&[P("primary", &p, "")], "").replace("max_attempts = 3", "max_attempts = 2"),
    );
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let job_id = submit(
        &producer,
        "acct_429",
        "k",
        "mock:status=429 mock:retry_after=2",
    )
    .await;
    let job = wait_for_status(&env, job_id, JobStatus::Failed).await;
    assert_eq!(job.attempts.len(), 2);
    assert!(
        job.error
            .as_deref()
            .unwrap_or("")
            .starts_with("provider_error: HTTP 429")
    );
    let wait = job.attempts[1].not_before - job.attempts[0].finished_at.unwrap();
    assert!(wait >= chrono::Duration::seconds(2), "waited only {wait}");
    assert!(
        job.attempts[1].started_at.unwrap() >= job.attempts[1].not_before,
        "not started before its time"
    );
    producer.close().await;
    fleet.stop().await;
}

/// A queued attempt whose message is gone (dead-lettered, purged) is republished
/// by the reconciler, then failed with a reason after `max_republish` tries.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_attempt_message_is_republished_then_failed_with_a_reason() {
    let text = config_for(&[P("primary", "http://127.0.0.1:9/v1", "")], "")
        .replace(
            "[worker]\n",
            "[worker]\nstuck_after = \"300ms\"\nmax_republish = 1\n",
        )
        .replace("max_attempts = 3", "max_attempts = 1");
    let (config, _file) = config(&text);
    let env = TestEnv::new(&config).await;
    let ctx = env.context(config.clone()).await;
    let (job_id, publish) = env.admit(&ctx, "acct_l", "k", "lost").await;
    // Marked published, but the message never reached the queue.
    env.store
        .outbox()
        .mark_published(&[publish.id])
        .await
        .unwrap();

    let fleet = env.fleet(config.clone(), vec![Role::Reconciler]).await;
    let ch = ctx.connection.create_channel().await.unwrap();
    let queue = onejob::broker::attempts_queue("primary");
    let republished = wait_for_messages(&env, &ch, &queue).await;
    assert_eq!(republished.len(), 1);
    let body: serde_json::Value = serde_json::from_slice(&republished[0].data).unwrap();
    assert_eq!(body["job_id"], job_id.to_string());

    let job = wait_for_status(&env, job_id, JobStatus::Failed).await;
    assert_eq!(job.attempts.len(), 1);
    assert_eq!(job.attempts[0].status, AttemptStatus::Failed);
    assert!(
        job.error
            .as_deref()
            .unwrap_or("")
            .starts_with("attempt_lost"),
        "{:?}",
        job.error
    );
    fleet.stop().await;
    let _ = ctx.connection.close(200, "done".into()).await;
}
