//! Provider qualification: a fallback is trusted only after it has proven, on the
//! operation's golden cases, that it honours the same output contract.
//!
//! An operation's contract, as seen through one provider, is the SHA-256 of the
//! canonical JSON of `{system, prompt, output_schema, model, temperature}`. A
//! qualification is recorded against that hash, so any change to the prompt, the
//! schema, the model or the temperature makes it stale at once: the provider must
//! qualify again before it may take a failover or a hedge.

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::domain::AttemptId;
pub(crate) use crate::domain::{CaseResult, Qualification};
use crate::edges::provider::Client;
use crate::edges::store::{Action, QualificationRun, Store, StoreError};
use crate::settings::config::{Config, EvidenceKind, Operation, Provider, ProviderKind, Rendered};

/// Where a provider stands for one operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum State {
    /// Its latest run passed every case against the current contract.
    Qualified,
    /// Its latest run was against another contract: the config changed since.
    Stale,
    /// Its latest run, against the current contract, failed a case.
    Failed,
    /// It never ran.
    NeverQualified,
}

/// The contract hash of `operation` through `provider`.
pub(crate) fn contract_hash(operation: &Operation, provider: &Provider) -> String {
    let mut contract = serde_json::json!({
        "system": operation.system,
        "prompt": operation.prompt,
        "output_schema": operation.output_schema,
        "model": provider.model,
        "temperature": operation.temperature,
    });
    // The wire format is part of what was qualified: a provider whose kind
    // changes is qualified again. OpenAI's, the first kind, adds nothing, so
    // qualifications recorded before there were kinds stay current.
    if provider.kind != ProviderKind::OpenAi {
        contract["kind"] = serde_json::json!(provider.kind.as_str());
    }
    crate::domain::canonical_sha256(&contract)
}

/// The audit action of qualifying `provider` for `operation`. It is written
/// before the first case is sent ([`Audit::begin`](crate::edges::store::Audit::begin)): the provider bills
/// the calls, so none goes unrecorded.
pub(crate) fn action(provider: &Provider, operation: &Operation) -> Action<'static> {
    Action {
        action: "provider.qualify",
        target: Some(format!("{}/{}", provider.name, operation.name)),
        detail: serde_json::json!({ "contract_hash": contract_hash(operation, provider) }),
        ..Action::default()
    }
}

/// Runs a qualification whose audit row `audit` was written first, records the
/// run, and fills in the row with what came of it (if that last write fails
/// the row stays `pending`, and the log says so). A provider that claims
/// evidence has the claim tested too, and what was found recorded
/// ([`check_claim`]). Returns the report and the recorded
/// run's id.
pub(crate) async fn run_audited(
    store: &Store,
    config: &Config,
    provider: &Provider,
    operation: &Operation,
    audit: uuid::Uuid,
) -> (Qualification, Result<uuid::Uuid, StoreError>) {
    let report = qualify(config, provider, operation).await;
    let recorded = store.qualifications().record(&report).await;
    let claim = check_claim(config, provider, operation).await;
    if let Some((held, seen)) = &claim {
        let kind = provider.evidence.kind.as_str();
        if let Err(e) = store
            .evidence()
            .record_claim(&provider.name, kind, *held, seen)
            .await
        {
            tracing::warn!(error = %e, provider = %provider.name, "the evidence claim's check was not recorded");
        }
    }
    let passed = report.cases.iter().filter(|c| c.passed).count();
    let detail = serde_json::json!({
        "run_id": recorded.as_ref().ok(),
        "evidence_claim": claim.as_ref().map(|(held, seen)| serde_json::json!({ "held": held, "seen": seen })),
        "qualified": report.passed,
        "cases": report.cases.len(),
        "passed": passed,
        "failures": report.cases.iter().filter(|c| !c.passed)
            .map(|c| serde_json::json!({ "case": c.index, "detail": c.detail }))
            .collect::<Vec<_>>(),
        "error": recorded.as_ref().err().map(ToString::to_string),
    });
    if let Err(e) = store
        .audit()
        .outcome(audit, recorded.is_err(), &detail)
        .await
    {
        tracing::warn!(error = %e, %audit, "the outcome of a qualification was not recorded; its audit row stays pending");
    }
    (report, recorded)
}

/// Counts a rendered prompt's tokens: exactly with the model's encoding when
/// tiktoken knows the model, else with `cl100k_base` as an estimate. Chat framing
/// adds 3 tokens per message and 3 to prime the reply.
pub(crate) fn count_tokens(model: &str, rendered: &Rendered) -> (usize, bool) {
    let (bpe, estimated) = match tiktoken_rs::bpe_for_model(model) {
        Ok(bpe) => (bpe, false),
        Err(_) => (tiktoken_rs::cl100k_base_singleton(), true),
    };
    let n = bpe.encode_with_special_tokens(&rendered.system).len()
        + bpe.encode_with_special_tokens(&rendered.user).len()
        + 3 * 2
        + 3;
    (n, estimated)
}

/// Runs the operation's golden cases through the real adapter and judges each:
/// the prompt renders with no undefined variables, fits the context window, the
/// answer is JSON that satisfies the schema, and the round trip ends in time.
pub(crate) async fn qualify(
    config: &Config,
    provider: &Provider,
    operation: &Operation,
) -> Qualification {
    let mut cases = Vec::new();
    let client = match Client::new(provider.clone()) {
        Ok(c) => c,
        Err(e) => {
            cases.push(CaseResult {
                index: 0,
                passed: false,
                detail: e.to_string(),
                prompt_tokens: None,
                tokens_estimated: false,
                latency_ms: None,
            });
            return Qualification {
                provider: provider.name.clone(),
                operation: operation.name.clone(),
                contract_hash: contract_hash(operation, provider),
                passed: false,
                cases,
            };
        }
    };
    for (index, input) in operation.cases.iter().enumerate() {
        cases.push(run_case(config, &client, provider, operation, index, input).await);
    }
    let passed = !cases.is_empty() && cases.iter().all(|c| c.passed);
    Qualification {
        provider: provider.name.clone(),
        operation: operation.name.clone(),
        contract_hash: contract_hash(operation, provider),
        passed,
        cases,
    }
}

async fn run_case(
    config: &Config,
    client: &Client,
    provider: &Provider,
    operation: &Operation,
    index: usize,
    input: &serde_json::Map<String, serde_json::Value>,
) -> CaseResult {
    let mut result = CaseResult {
        index,
        passed: false,
        detail: String::new(),
        prompt_tokens: None,
        tokens_estimated: false,
        latency_ms: None,
    };
    let rendered = match config.render(operation, input) {
        Ok(r) => r,
        Err(e) => {
            result.detail = e.to_string();
            return result;
        }
    };
    let (tokens, estimated) = count_tokens(&provider.model, &rendered);
    result.prompt_tokens = Some(tokens);
    result.tokens_estimated = estimated;
    let approx = if estimated { "about " } else { "" };
    if let Some(window) = provider.context_window
        && tokens > window as usize
    {
        result.detail = format!(
            "prompt_too_long: the prompt is {approx}{tokens} tokens, over the context window of {window}"
        );
        return result;
    }
    let started = Instant::now();
    let answer = client
        .complete(AttemptId::new(), None, None, operation, &rendered)
        .await;
    let elapsed = started.elapsed();
    result.latency_ms = Some(u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX));
    let answer = match answer {
        Ok(a) => a,
        Err(e) => {
            result.detail = e.to_string();
            return result;
        }
    };
    if let Err(violation) = operation.check_output(&answer.content) {
        result.detail = violation.to_string();
        return result;
    }
    if elapsed > provider.timeout {
        result.detail = format!(
            "too_slow: {elapsed:?} is over the timeout of {:?}",
            provider.timeout
        );
        return result;
    }
    result.passed = true;
    result.detail = format!(
        "ok: {approx}{tokens} prompt tokens, answered in {} ms",
        elapsed.as_millis()
    );
    result
}

/// Where a provider stands given its latest run and the current contract.
fn state_of(run: Option<&QualificationRun>, contract: &str) -> State {
    match run {
        None => State::NeverQualified,
        Some(r) if r.contract_hash != contract => State::Stale,
        Some(r) if r.cases > 0 && r.passed == r.cases => State::Qualified,
        Some(_) => State::Failed,
    }
}

/// The latest runs of `(provider, operation)` pairs, each with where it leaves
/// the provider: one query for all of them.
async fn standings(
    store: &Store,
    pairs: Vec<(&Provider, &Operation)>,
) -> Result<BTreeMap<(String, String), (State, Option<QualificationRun>)>, StoreError> {
    let keys: Vec<(String, String)> = pairs
        .iter()
        .map(|(p, o)| (p.name.clone(), o.name.clone()))
        .collect();
    let mut runs = store.qualifications().latest_runs(&keys).await?;
    Ok(pairs
        .into_iter()
        .zip(keys)
        .map(|((p, o), key)| {
            let run = runs.remove(&key);
            let state = state_of(run.as_ref(), &contract_hash(o, p));
            (key, (state, run))
        })
        .collect())
}

/// Each `(provider, operation)` pair of the configuration's routes with its
/// state and its latest run.
pub(crate) async fn standing_of_routes(
    config: &Config,
    store: &Store,
) -> Result<BTreeMap<(String, String), (State, Option<QualificationRun>)>, StoreError> {
    let pairs = config
        .operations
        .values()
        .flat_map(|op| {
            op.route
                .iter()
                .filter_map(|p| config.providers.get(p))
                .map(move |p| (p, op))
        })
        .collect();
    standings(store, pairs).await
}

/// Each `(provider, operation)` pair of the configuration's routes with its state.
pub(crate) async fn states(
    config: &Config,
    store: &Store,
) -> Result<BTreeMap<(String, String), State>, StoreError> {
    Ok(standing_of_routes(config, store)
        .await?
        .into_iter()
        .map(|(key, (state, _))| (key, state))
        .collect())
}

/// The providers that may take an attempt of `operation` besides its first one:
/// the route's first provider, and every provider qualified for the current contract.
pub(crate) async fn eligible(
    config: &Config,
    store: &Store,
    operation: &str,
) -> Result<HashSet<String>, StoreError> {
    let Some(op) = config.operations.get(operation) else {
        return Ok(HashSet::new());
    };
    let pairs = op.route[1..]
        .iter()
        .filter_map(|p| config.providers.get(p))
        .map(|p| (p, op))
        .collect();
    let mut out: HashSet<String> = standings(store, pairs)
        .await?
        .into_iter()
        .filter(|(_, (state, _))| *state == State::Qualified)
        .map(|((p, _), _)| p)
        .collect();
    out.insert(op.route[0].clone());
    Ok(out)
}

/// Logs, once, every failover provider whose qualification went stale because the
/// configuration changed since it qualified.
pub(crate) async fn warn_stale(config: &Config, store: &Store) -> Result<(), StoreError> {
    for ((provider, operation), state) in states(config, store).await? {
        if state == State::Stale {
            tracing::warn!(
                %provider,
                %operation,
                "qualification is stale: the operation's contract changed since the provider qualified; it takes no failover or hedge until `onejob providers qualify {provider} --operation {operation}` passes again"
            );
        }
    }
    Ok(())
}

/// Tests a provider's evidence claim with the operation's first golden case
/// (configuring `evidence` is the operator's statement; qualification checks
/// it): a stored call must be found by its metadata after `evidence_delay`; a
/// call sent twice with one key must come back with the first answer (the
/// same response id), no new work. `None` for a provider that claims none;
/// else whether the claim held, and what was seen.
async fn check_claim(
    config: &Config,
    provider: &Provider,
    operation: &Operation,
) -> Option<(bool, String)> {
    let kind = provider.evidence.kind;
    if kind == EvidenceKind::None {
        return None;
    }
    let Some(input) = operation.cases.first() else {
        return Some((false, "no golden case to test the claim with".into()));
    };
    let rendered = match config.render(operation, input) {
        Ok(r) => r,
        Err(e) => return Some((false, format!("the first golden case does not render: {e}"))),
    };
    let client = match Client::new(provider.clone()) {
        Ok(c) => c,
        Err(e) => return Some((false, e.to_string())),
    };
    let attempt = AttemptId::new();
    let first = match client
        .complete(attempt, None, None, operation, &rendered)
        .await
    {
        Ok(a) => a,
        Err(e) => return Some((false, format!("the test call failed: {e}"))),
    };
    // The check compares response ids: two missing ids are not the same
    // answer, and a provider whose answers carry none cannot show that it
    // kept or replayed one (one that ignores the key would pass).
    let Some(first_id) = first.request_id.clone() else {
        return Some((
            false,
            "the test call's answer carries no response id, so the claim cannot be checked".into(),
        ));
    };
    Some(match kind {
        EvidenceKind::Stored => check_stored(&client, attempt, &first_id).await,
        EvidenceKind::IdempotencyKey => {
            let again = client
                .complete(attempt, None, None, operation, &rendered)
                .await;
            check_replayed(again, &first_id, &first.content)
        }
        EvidenceKind::None => return None,
    })
}

/// Whether the test call `attempt` (its answer's id `first_id`) was stored
/// and is found by its metadata after `evidence_delay`.
async fn check_stored(client: &Client, attempt: AttemptId, first_id: &str) -> (bool, String) {
    let provider = client.provider();
    tokio::time::sleep(provider.evidence.delay.min(Duration::from_secs(30))).await;
    match client.stored(attempt, None).await {
        Ok(Some(Ok(found))) if found.request_id.as_deref() == Some(first_id) => (
            true,
            "the test call was stored and found by its metadata".into(),
        ),
        Ok(Some(_)) => (
            false,
            "a completion was found by the test call's metadata, but not the test call's".into(),
        ),
        Ok(None) => (
            false,
            format!(
                "the test call was not found by its metadata {} after it ended",
                humantime::format_duration(provider.evidence.delay)
            ),
        ),
        Err(e) => (
            false,
            format!("stored completions could not be listed: {e}"),
        ),
    }
}

/// Whether the test call sent again with its key came back as the first
/// answer (id `first_id`, text `first_content`), with no new work.
fn check_replayed(
    again: Result<
        crate::edges::provider::answer::Answer,
        crate::edges::provider::answer::CallError,
    >,
    first_id: &str,
    first_content: &str,
) -> (bool, String) {
    match again {
        Ok(again)
            if again.request_id.as_deref() == Some(first_id) && again.content == first_content =>
        {
            (
                true,
                "the same key was answered with the first answer".into(),
            )
        }
        Ok(again) if again.request_id.is_none() => (
            false,
            "the test call sent again came back with no response id, so the claim cannot be checked".into(),
        ),
        Ok(_) => (
            false,
            "the same key ran new work: another answer came back".into(),
        ),
        Err(e) => (false, format!("the test call sent again failed: {e}")),
    }
}
