//! Anthropic's Message Batches: the lines sent inline (`POST
//! /messages/batches`, each `{"custom_id", "params"}`), the batch's status
//! read (`GET /messages/batches/{id}`: `in_progress`, `canceling`,
//! `ended`), and its results read once it has ended, from the address the
//! provider's configuration gives (`/messages/batches/{id}/results`), never
//! from the `results_url` it names. A result is `succeeded` (its `message`,
//! judged as a live answer), `errored` (its error, judged as a live error
//! answer with the status its type stands for), `expired` or `canceled`.

use serde_json::{Value, json};

use super::{BatchClient, LineResult, Outcome, State, jsonl, unreadable};
use crate::edges::provider::answer::CallError;

/// Sends `lines` as one batch.
pub(super) async fn submit(
    client: &BatchClient,
    lines: &[super::Line],
) -> Result<String, CallError> {
    let requests: Vec<Value> = lines
        .iter()
        .map(|l| json!({"custom_id": l.attempt.to_string(), "params": l.body}))
        .collect();
    let made = client
        .json(
            client
                .post("messages/batches")?
                .json(&json!({ "requests": requests })),
        )
        .await?;
    made["id"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| CallError::Rejected {
            message: "the batch came back without an id".into(),
            retry_after: None,
            usage: None,
        })
}

/// Where batch `id` stands.
pub(super) async fn state(client: &BatchClient, id: &str) -> Result<State, CallError> {
    let batch = client
        .json(client.get(&format!("messages/batches/{id}"))?)
        .await?;
    Ok(match batch["processing_status"].as_str() {
        Some("ended") => State::Ended,
        _ => State::Running,
    })
}

/// The results of ended batch `id`.
pub(super) async fn results(client: &BatchClient, id: &str) -> Result<Vec<LineResult>, CallError> {
    let bytes = client
        .send(client.get(&format!("messages/batches/{id}/results"))?)
        .await?;
    Ok(jsonl(&bytes)
        .into_iter()
        .map(|line| match line {
            Ok(line) => result(client, &line),
            Err(why) => unreadable(why),
        })
        .collect())
}

/// One result line.
fn result(client: &BatchClient, line: &Value) -> LineResult {
    let custom_id = line["custom_id"].as_str().unwrap_or_default().to_owned();
    let result = &line["result"];
    let outcome = match result["type"].as_str() {
        Some("succeeded") => Outcome::Ran(client.judged(200, &result["message"])),
        Some("errored") => {
            let error = &result["error"];
            let status = status_of(error["error"]["type"].as_str().unwrap_or_default());
            Outcome::Ran(client.judged(status, error))
        }
        Some("expired") => Outcome::Expired,
        Some("canceled") => Outcome::Cancelled,
        _ => Outcome::Ran(Err(CallError::Rejected {
            message: format!(
                "a result of no known type: {}",
                crate::edges::provider::answer::excerpt(result.to_string().as_bytes())
            ),
            retry_after: None,
            usage: None,
        })),
    };
    LineResult { custom_id, outcome }
}

/// The HTTP status an error type stands for in the Messages API.
fn status_of(kind: &str) -> u16 {
    match kind {
        "invalid_request_error" => 400,
        "authentication_error" => 401,
        "permission_error" => 403,
        "not_found_error" => 404,
        "request_too_large" => 413,
        "rate_limit_error" => 429,
        "overloaded_error" => 529,
        _ => 500,
    }
}
