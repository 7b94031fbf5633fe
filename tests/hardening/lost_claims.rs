//! A claim the database lost: the commit a worker saw for `queued →
//! started` is gone when its answer comes (a failover under asynchronous
//! replication loses the last commits; so does a restore). Simulated here by
//! putting the attempt and its job back as they were before the claim while
//! the call is at the provider (its record of the evidence the call asked for
//! too). (A real loss brings back its turn row too;
//! here the attempt has none, as a claim handed back at a stop leaves it: the
//! lost-message pass finds both.)

use std::time::{Duration, Instant};

use onejob::domain::{AttemptStatus, JobId, JobStatus};
use onejob::mock::MockOptions;
use onejob_producer::Producer;
use uuid::Uuid;

use crate::common::{
    Fleet, P, TestEnv, config, config_for, mock, submit, wait_for, wait_for_status,
};

/// The settlement finds its attempt `queued`: onejob says the database lost
/// the claim (an error, and `onejob_claims_lost_total`) and keeps the answer
/// it paid for: the attempt wins with it, its usage recorded, and the
/// lost-message pass, which would call a queued attempt again once
/// `stuck_after` has passed, finds nothing to call. One call, one answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_settlement_that_finds_its_claim_lost_says_so_and_keeps_the_paid_answer() {
    let site = Site::start("timeout = \"5s\"", MockOptions::default()).await;
    let lost = site.lose_a_claim("lc-1", "slow mock:delay=1500").await;

    let job = wait_for_status(&site.env, lost.job_id, JobStatus::Succeeded).await;
    assert_eq!(job.attempts.len(), 1, "{job:?}");
    assert_eq!(job.completed_by.map(|a| a.0), Some(lost.attempt));
    let (status, usage, started) = site.attempt(lost.attempt).await;
    assert_eq!(status, AttemptStatus::Succeeded, "the paid answer won");
    assert!(usage.is_some(), "its usage is on the attempt");
    assert!(started, "an attempt that was called says when it started");
    site.called_once_past_stuck_after(&lost).await;
    site.stop().await;
}

/// A call under a lost claim that times out may have run at the provider:
/// its attempt is `unknown` and blocks its job, as any timeout's does,
/// rather than being called a second time once `stuck_after` has passed.
/// Said and counted as the answer's case is.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_timeout_under_a_lost_claim_is_unknown_and_not_called_again() {
    let site = Site::start("timeout = \"2s\"", MockOptions::default()).await;
    let lost = site.lose_a_claim("lc-2", "slow mock:delay=4000").await;

    wait_for_status(&site.env, lost.job_id, JobStatus::Unknown).await;
    let (status, _, _) = site.attempt(lost.attempt).await;
    assert_eq!(status, AttemptStatus::Unknown, "its outcome is not known");
    site.called_once_past_stuck_after(&lost).await;
    let job = site
        .env
        .store
        .jobs()
        .job(lost.job_id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (job.status, job.attempts.len()),
        (JobStatus::Unknown, 1),
        "blocked, no new attempt: {job:?}"
    );
    site.stop().await;
}

/// A timeout under a lost claim whose provider keeps its completions: the
/// claim's record of the evidence its call asked for was lost with the claim,
/// and the timeout records it again, so the evidence pass settles the unknown
/// from the completion the provider kept: no operator, no second call.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_timeout_under_a_lost_claim_is_settled_from_the_providers_evidence() {
    let stores = MockOptions {
        store: true,
        ..MockOptions::default()
    };
    let provider = "timeout = \"2s\"\nevidence = \"stored\"\nevidence_delay = \"1s\"";
    let site = Site::start(provider, stores).await;
    let lost = site.lose_a_claim("lc-4", "slow mock:delay=4000").await;

    let job = wait_for_status(&site.env, lost.job_id, JobStatus::Succeeded).await;
    assert_eq!(job.attempts.len(), 1, "no second attempt: {job:?}");
    let (status, usage, _) = site.attempt(lost.attempt).await;
    assert_eq!(
        status,
        AttemptStatus::Succeeded,
        "settled from the evidence"
    );
    assert!(usage.is_some(), "its usage is on the attempt");
    let asked: Option<String> = sqlx::query_scalar("SELECT evidence FROM attempts WHERE id = $1")
        .bind(lost.attempt)
        .fetch_one(site.env.store.pool())
        .await
        .unwrap();
    assert_eq!(asked.as_deref(), Some("stored"));
    site.called_once_past_stuck_after(&lost).await;
    assert_eq!(site.provider.stats.work(), 1, "the provider ran it once");
    site.stop().await;
}

/// A definite failure under a lost claim is the call's outcome too: the
/// attempt fails and the job goes on to its retries, each a new attempt,
/// rather than the attempt being called a second time once `stuck_after`
/// has passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failure_under_a_lost_claim_is_settled_and_not_called_again() {
    let site = Site::start("timeout = \"5s\"", MockOptions::default()).await;
    let lost = site
        .lose_a_claim("lc-3", "slow mock:delay=1500 mock:status=401")
        .await;

    let job = wait_for_status(&site.env, lost.job_id, JobStatus::Failed).await;
    assert_eq!(job.attempts[0].id.0, lost.attempt, "{job:?}");
    assert!(
        job.attempts
            .iter()
            .all(|a| a.status == AttemptStatus::Failed),
        "{job:?}"
    );
    let (status, _, _) = site.attempt(lost.attempt).await;
    assert_eq!(status, AttemptStatus::Failed);
    site.called_once_past_stuck_after(&lost).await;
    site.stop().await;
}

/// A fleet with a short `stuck_after`, its mock, and a producer.
struct Site {
    provider: onejob::mock::MockHandle,
    env: TestEnv,
    fleet: Fleet,
    producer: Producer,
}

/// An attempt whose claim was lost while its call was at the provider.
struct Lost {
    job_id: JobId,
    attempt: Uuid,
    at: Instant,
}

impl Site {
    /// `settings`: the provider's lines in the configuration.
    async fn start(settings: &str, options: MockOptions) -> Site {
        let provider = mock(options).await;
        let text = config_for(&[P("primary", &provider.base_url(), settings)], "")
            .replace("[worker]\n", "[worker]\nstuck_after = \"3s\"\n");
        let (cfg, _file) = config(&text);
        let env = TestEnv::new(&cfg).await;
        let fleet = env.fleet(cfg.clone(), vec![]).await;
        let producer = Producer::connect(&env.amqp_url).await.unwrap();
        Site {
            provider,
            env,
            fleet,
            producer,
        }
    }

    /// Submits `text`, and once its attempt has started, loses the claim:
    /// the attempt and its job as they were; waits for the call's outcome
    /// to say so.
    async fn lose_a_claim(&self, key: &str, text: &str) -> Lost {
        let lost_before = lost_claims();
        let job_id = submit(&self.producer, "acct_lc", key, text).await;
        let attempt: Uuid = wait_for("the attempt to start", Duration::from_secs(20), || async {
            sqlx::query_scalar("SELECT id FROM attempts WHERE job_id = $1 AND status = 'started'")
                .bind(job_id.0)
                .fetch_optional(self.env.store.pool())
                .await
                .unwrap()
        })
        .await;
        sqlx::query(
            "WITH a AS (UPDATE attempts SET status = 'queued', claim = NULL, started_at = NULL,
                        deadline_at = NULL, evidence = NULL WHERE id = $1 RETURNING job_id)
             UPDATE jobs SET status = 'queued' FROM a WHERE jobs.id = a.job_id",
        )
        .bind(attempt)
        .execute(self.env.store.pool())
        .await
        .unwrap();
        let at = Instant::now();
        wait_for(
            "the lost claim to be counted",
            Duration::from_secs(20),
            || async { (lost_claims() > lost_before).then_some(()) },
        )
        .await;
        Lost {
            job_id,
            attempt,
            at,
        }
    }

    /// The attempt's status, usage, and whether it says when it started.
    async fn attempt(&self, id: Uuid) -> (AttemptStatus, Option<serde_json::Value>, bool) {
        sqlx::query_as("SELECT status, usage, started_at IS NOT NULL FROM attempts WHERE id = $1")
            .bind(id)
            .fetch_one(self.env.store.pool())
            .await
            .unwrap()
    }

    /// The lost-message pass looks twice more, after `stuck_after` has
    /// passed since the claim was lost: the attempt it would have called
    /// again is settled, so the provider was called for it once.
    async fn called_once_past_stuck_after(&self, lost: &Lost) {
        let looks = lost_passes();
        wait_for(
            "the lost-message pass to look past stuck_after",
            Duration::from_secs(30),
            || async {
                (lost.at.elapsed() > Duration::from_secs(3) && lost_passes() >= looks + 2.0)
                    .then_some(())
            },
        )
        .await;
        let keys = self.provider.stats.idempotency_keys();
        assert_eq!(
            keys.iter()
                .filter(|k| **k == lost.attempt.to_string())
                .count(),
            1,
            "called once: {keys:?}"
        );
    }

    async fn stop(self) {
        self.producer.close().await;
        self.fleet.stop().await;
    }
}

/// `onejob_claims_lost_total` across this binary's fleets.
fn lost_claims() -> f64 {
    metric_sum("onejob_claims_lost_total{", "")
}

/// Runs of the lost-message pass across this binary's fleets.
fn lost_passes() -> f64 {
    metric_sum("onejob_reconciler_runs_total{", "pass=\"lost\"")
}

fn metric_sum(prefix: &str, label: &str) -> f64 {
    onejob::edges::metrics::render()
        .lines()
        .filter(|l| l.starts_with(prefix) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
