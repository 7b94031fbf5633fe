//! Calls that leave evidence (contract section 7, Evidence): a provider whose
//! evidence is `stored` is asked to keep each call with its attempt and job as
//! metadata, and keeps it even when onejob stopped waiting; the bundled mock
//! keeps both kinds of evidence, stored completions and answers replayed by
//! idempotency key, and counts the work it ran apart from the requests.

use onejob_test_support as common;

mod calls;
mod claims;
mod measured;
mod operators;
mod replay;
mod stored;
mod stranding;

use common::{P, TestEnv, config_for};
use onejob::mock::MockHandle;
use serde_json::Value;

/// The stored completions the mock lists for `metadata[key]=value`.
pub(crate) async fn stored(mock: &MockHandle, key: &str, value: &str) -> Vec<Value> {
    let query = url::form_urlencoded::Serializer::new(String::new())
        .append_pair(&format!("metadata[{key}]"), value)
        .finish();
    let list: Value = reqwest::Client::new()
        .get(format!("{}/chat/completions?{query}", mock.base_url()))
        .send()
        .await
        .expect("the mock answers")
        .json()
        .await
        .expect("a list");
    list["data"].as_array().cloned().unwrap_or_default()
}

/// The configuration of one provider `primary` at `base` that stores its
/// calls, with a short timeout and `extra` lines.
pub(crate) fn stored_config(base: &str, extra: &str) -> String {
    config_for(
        &[P(
            "primary",
            base,
            &format!(
                "timeout = \"500ms\"\nevidence = \"stored\"\nevidence_delay = \"1s\"\n{extra}"
            ),
        )],
        "",
    )
}

/// The evidence audit rows of a job.
pub(crate) async fn evidence_rows(
    env: &TestEnv,
    job: onejob::domain::JobId,
) -> Vec<onejob::edges::store::AuditEntry> {
    env.store
        .audit()
        .of_job(job)
        .await
        .unwrap()
        .into_iter()
        .filter(|a| a.actor == "evidence")
        .collect()
}

/// The configuration of one provider `primary` at `base` that replays a
/// repeated idempotency key.
pub(crate) fn replay_config(base: &str) -> String {
    config_for(
        &[P(
            "primary",
            base,
            "timeout = \"500ms\"\nevidence = \"idempotency_key\"\nevidence_delay = \"1s\"",
        )],
        "",
    )
}
