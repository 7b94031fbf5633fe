//! Per-process counters for `/metrics`, beside the gauges the store reads from
//! the tables ([`crate::edges::store::Jobs::gauges`]).
//!
//! The gauges say where the system stands (jobs by status, the oldest unknown);
//! these counters say what this process did since it started, so `rate()` over
//! them across pods shows the flow: intents by outcome, attempts by how they
//! settled, provider call durations, publishes, dead letters and gateway answers.
//! A process installs the recorder once; until then (and in a process that never
//! does) recording is a no-op.

use std::sync::OnceLock;
use std::time::Duration;

use ::metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::intent::Outcome;

/// Provider call durations, in seconds, by provider and result.
pub const PROVIDER_CALL_SECONDS: &str = "onejob_provider_call_seconds";

/// Deliveries per intake batch.
pub const INTAKE_BATCH_SIZE: &str = "onejob_intake_batch_size";

/// Attempts per claiming statement and per settling transaction, by provider
/// and stage (`claim`, `settle`).
pub const ATTEMPT_BATCH_SIZE: &str = "onejob_attempt_batch_size";

/// Time spent in each stage of an intent's way through this process, in
/// seconds, by stage: `intake_admit` (the admission statement),
/// `intake_publish` (first attempts published and confirmed), `intake_answer`
/// (receipts and acks); `attempt_slot_wait` (a delivery waiting for a call
/// slot), `claim_wait` and `claim` (waiting for a claim flush, and the flush),
/// `attempt_call` (rendering, the provider call and judging), `settle_wait` and
/// `settle` (likewise for settlements), `attempt_ack`, and `settle_publish`
/// (what a settlement wrote, published and confirmed).
pub const STAGE_SECONDS: &str = "onejob_stage_seconds";

/// Seconds from an attempt becoming `unknown` (its call's deadline) to its
/// resolution by evidence, by how (`stored`, `replayed`, `no_evidence`).
pub const UNKNOWN_RESOLUTION_SECONDS: &str = "onejob_unknown_resolution_seconds";

/// How long one run of a reconciler pass took, in seconds, by pass.
pub const RECONCILER_RUN_SECONDS: &str = "onejob_reconciler_run_seconds";

/// Bucket bounds for resolving unknowns: from the evidence delay (seconds) to
/// the evidence deadline (minutes, an hour).
const RESOLUTION_BUCKETS: [f64; 11] = [
    1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
];

/// Bucket bounds for stages: from a fraction of a millisecond (a commit on a
/// quiet database) to seconds (an outage waited out).
const STAGE_BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Bucket bounds for batch sizes, up to the largest `batch_size`.
const BATCH_BUCKETS: [f64; 11] = [
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1000.0,
];

/// Bucket bounds for provider calls: inference takes from tens of milliseconds
/// to the configured timeout.
const CALL_BUCKETS: [f64; 11] = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Installs the process-wide recorder (once; later calls return the same
/// handle). `None` when another recorder was installed first.
pub fn install() -> Option<&'static PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Full(PROVIDER_CALL_SECONDS.into()), &CALL_BUCKETS)
                .ok()?
                .set_buckets_for_metric(Matcher::Full(INTAKE_BATCH_SIZE.into()), &BATCH_BUCKETS)
                .ok()?
                .set_buckets_for_metric(Matcher::Full(ATTEMPT_BATCH_SIZE.into()), &BATCH_BUCKETS)
                .ok()?
                .set_buckets_for_metric(Matcher::Full(STAGE_SECONDS.into()), &STAGE_BUCKETS)
                .ok()?
                .set_buckets_for_metric(
                    Matcher::Full(RECONCILER_RUN_SECONDS.into()),
                    &STAGE_BUCKETS,
                )
                .ok()?
                .set_buckets_for_metric(
                    Matcher::Full(UNKNOWN_RESOLUTION_SECONDS.into()),
                    &RESOLUTION_BUCKETS,
                )
                .ok()?;
            match builder.install_recorder() {
                Ok(handle) => Some(handle),
                Err(e) => {
                    tracing::warn!(error = %e, "per-process counters are off");
                    None
                }
            }
        })
        .as_ref()
}

/// The counters in Prometheus text format; empty when no recorder is installed.
pub fn render() -> String {
    install()
        .map(|handle| {
            handle.run_upkeep();
            handle.render()
        })
        .unwrap_or_default()
}

/// Intake answered an intent.
pub fn intent(outcome: Outcome) {
    counter!("onejob_intents_total", "outcome" => outcome.as_str()).increment(1);
}

/// Intake took a batch of `size` deliveries.
pub fn intake_batch(size: usize) {
    histogram!(INTAKE_BATCH_SIZE).record(size as f64);
}

/// An attempt consumer claimed (`stage` = `claim`) or settled (`settle`)
/// `size` attempts with one statement or transaction.
pub fn attempt_batch(provider: &str, stage: &'static str, size: usize) {
    histogram!(ATTEMPT_BATCH_SIZE, "provider" => provider.to_owned(), "stage" => stage)
        .record(size as f64);
}

/// Intake refused an owner's new intent for a limit: `reason` is
/// `budget_exceeded`.
pub fn owner_refused(owner: &str, reason: &'static str) {
    counter!(
        "onejob_owner_refusals_total",
        "owner" => owner.to_owned(),
        "reason" => reason
    )
    .increment(1);
}

/// Held turns handed out to a provider's queue.
pub fn turns_handed_out(provider: &str, n: usize) {
    counter!("onejob_turns_handed_out_total", "provider" => provider.to_owned())
        .increment(n as u64);
}

/// An attempt this worker admitted was claimed by its own consumer at once,
/// before its message came back from the broker.
pub fn attempt_claimed_on_admission(provider: &str) {
    counter!("onejob_attempts_claimed_on_admission_total", "provider" => provider.to_owned())
        .increment(1);
}

/// A valid intent at its delivery limit was handed on as a fresh copy.
pub fn intent_handed_on() {
    counter!("onejob_intents_handed_on_total").increment(1);
}

/// A settlement found its attempt `queued`: the database lost the claim
/// the worker saw committed.
pub fn claim_lost(provider: &str) {
    counter!("onejob_claims_lost_total", "provider" => provider.to_owned()).increment(1);
}

/// An attempt's outcome was settled: `won`, `discarded`, `failed`, `unknown`,
/// `unchanged` when it had been resolved elsewhere meanwhile, `refused` when
/// Postgres refused its data, or `busy` when its rows were held (it is
/// settled again later).
pub fn attempt_settled(provider: &str, settled: &'static str) {
    counter!(
        "onejob_attempts_settled_total",
        "provider" => provider.to_owned(),
        "settled" => settled
    )
    .increment(1);
}

/// Claims of `provider`'s attempts met their job rows held under someone
/// else's lock (`held` of them): each is claimed again shortly.
pub fn attempt_claims_held(provider: &str, held: usize) {
    if held > 0 {
        counter!("onejob_attempt_claims_held_total", "provider" => provider.to_owned())
            .increment(held as u64);
    }
}

/// A provider call ended: `answered` (whatever the answer), `refused` (never
/// left), `rejected` (an error status) or `unknown` (timed out or cut off).
pub fn provider_call(provider: &str, result: &'static str, elapsed: Duration) {
    histogram!(
        PROVIDER_CALL_SECONDS,
        "provider" => provider.to_owned(),
        "result" => result
    )
    .record(elapsed.as_secs_f64());
}

/// A look at an unknown's evidence came to `outcome`: `stored`, `replayed`,
/// `no_evidence` (each resolves it), `nothing_yet`, `in_progress` (a `409`:
/// the first request is still being processed), `unreachable` (the provider
/// could not be asked or did not answer), `kept` (found, and kept on its
/// attempt while its job's rows are held), `held` (found while its attempt's
/// row was held: looked at again), `not_asked` (its call asked for no such
/// evidence), `waits_for_operator`, or `cost_found` (what an attempt
/// discarded while unknown cost).
pub fn evidence_look(provider: &str, outcome: &'static str) {
    counter!(
        "onejob_evidence_looks_total",
        "provider" => provider.to_owned(),
        "outcome" => outcome
    )
    .increment(1);
}

/// A settlement handed on through the broker ([`crate::shared::handed_on`]): by the
/// worker that could not settle it (`published`, `lost`), or by the worker
/// that took it (`kept`, `settled_already`, `refused`).
pub fn settlement_handed_on(outcome: &'static str) {
    counter!("onejob_settlements_handed_on_total", "outcome" => outcome).increment(1);
}

/// An unknown was resolved by evidence (`how`), `unknown_for` after its
/// call's deadline.
pub fn unknown_resolved(how: &'static str, unknown_for: Duration) {
    counter!("onejob_unknowns_resolved_total", "how" => how).increment(1);
    histogram!(UNKNOWN_RESOLUTION_SECONDS, "how" => how).record(unknown_for.as_secs_f64());
}

/// A stage of the way took `elapsed` (see [`STAGE_SECONDS`]).
pub fn stage(stage: &'static str, elapsed: Duration) {
    histogram!(STAGE_SECONDS, "stage" => stage).record(elapsed.as_secs_f64());
}

/// Times `work` as `stage` (see [`STAGE_SECONDS`]).
pub async fn timed<T>(stage: &'static str, work: impl std::future::Future<Output = T>) -> T {
    let began = std::time::Instant::now();
    let out = work.await;
    self::stage(stage, began.elapsed());
    out
}

/// A pruning batch deleted ended jobs past their retention, with their
/// attempts.
pub fn pruned(jobs: u64, attempts: u64) {
    counter!("onejob_pruned_total", "table" => "jobs").increment(jobs);
    counter!("onejob_pruned_total", "table" => "attempts").increment(attempts);
}

/// onejob vacuumed one of its tables: a busy one because the server runs no
/// autovacuum, or `turns`, whose dead rows it vacuums whatever the server does.
pub fn vacuumed(table: &str) {
    counter!("onejob_vacuums_total", "table" => table.to_owned()).increment(1);
}

/// How long ago the oldest ended job past its retention ended, as a pruning pass
/// found it (0: none was).
pub fn oldest_prunable(oldest: Option<Duration>) {
    gauge!("onejob_oldest_prunable_job_seconds").set(oldest.map_or(0.0, |d| d.as_secs_f64()));
}

/// One run of a reconciler pass ended, well or not, after `elapsed`.
pub fn reconciler_run(pass: &'static str, ok: bool, elapsed: Duration) {
    let outcome = if ok { "ok" } else { "failed" };
    counter!("onejob_reconciler_runs_total", "pass" => pass, "outcome" => outcome).increment(1);
    histogram!(RECONCILER_RUN_SECONDS, "pass" => pass).record(elapsed.as_secs_f64());
}

/// A transaction ran again after a transient error, by its SQLSTATE (`40P01` a
/// deadlock, `40001` a serialization failure) or `io`.
pub fn db_retry(code: &str) {
    counter!("onejob_db_retries_total", "code" => code.to_owned()).increment(1);
}

/// Outbox rows published and confirmed.
pub fn published(rows: usize) {
    counter!("onejob_outbox_published_total").increment(rows as u64);
}

/// A message was dead-lettered by onejob itself (not by the delivery limit).
pub fn dead_lettered(queue: &str) {
    counter!("onejob_dead_letters_total", "queue" => queue.to_owned()).increment(1);
}

/// The gateway answered a request.
pub fn gateway_answer(route: &str, status: u16) {
    counter!(
        "onejob_gateway_requests_total",
        "route" => route.to_owned(),
        "status" => status.to_string()
    )
    .increment(1);
}

/// The gateway refused an owner's request for what the owner already held:
/// `reason` is `requests_in_flight` or `bytes_in_flight`.
pub fn gateway_refused(owner: &str, reason: &'static str) {
    counter!(
        "onejob_gateway_refused_total",
        "owner" => owner.to_owned(),
        "reason" => reason
    )
    .increment(1);
}

/// Requests the gateway is serving for their owners (each holds a place of
/// its owner's share), up or down by one.
pub fn gateway_in_flight(change: f64) {
    gauge!("onejob_gateway_in_flight").increment(change);
}
