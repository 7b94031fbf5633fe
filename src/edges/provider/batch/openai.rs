//! OpenAI's Files and Batches: the lines uploaded as a JSONL file (`POST
//! /files`, purpose `batch`), a batch made of it (`POST /batches`, window
//! `24h`, onejob's batch named in its metadata), its status read (`GET
//! /batches/{id}`), and its output and error files read once it has ended.
//! A line of the output or error file that ran has `response.status_code`
//! and `response.body`, judged as a live answer; one that never ran has
//! `error.code` `batch_expired` or `batch_cancelled`.

use serde_json::{Value, json};

use super::{BATCH_METADATA, BatchClient, LineResult, Outcome, State, jsonl, unreadable};
use crate::edges::provider::answer::CallError;

/// The endpoint every line and the batch name.
const ENDPOINT: &str = "/v1/chat/completions";

/// Uploads `lines` and makes a batch of them, named `batch`.
pub(super) async fn submit(
    client: &BatchClient,
    batch: &str,
    lines: &[super::Line],
) -> Result<String, CallError> {
    let mut file = String::new();
    for line in lines {
        let row = json!({
            "custom_id": line.attempt.to_string(),
            "method": "POST",
            "url": ENDPOINT,
            "body": line.body,
        });
        file.push_str(&row.to_string());
        file.push('\n');
    }
    let form = reqwest::multipart::Form::new()
        .text("purpose", "batch")
        .part(
            "file",
            reqwest::multipart::Part::bytes(file.into_bytes()).file_name(format!("{batch}.jsonl")),
        );
    let uploaded = client.json(client.post("files")?.multipart(form)).await?;
    let Some(file_id) = uploaded["id"].as_str() else {
        return Err(no_id("the uploaded file"));
    };
    let create = json!({
        "input_file_id": file_id,
        "endpoint": ENDPOINT,
        "completion_window": "24h",
        "metadata": { BATCH_METADATA: batch },
    });
    let made = client.json(client.post("batches")?.json(&create)).await?;
    made["id"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| no_id("the batch"))
}

fn no_id(what: &str) -> CallError {
    CallError::Rejected {
        message: format!("{what} came back without an id"),
        retry_after: None,
        usage: None,
    }
}

/// Where batch `id` stands.
pub(super) async fn state(client: &BatchClient, id: &str) -> Result<State, CallError> {
    let batch = client.json(client.get(&format!("batches/{id}"))?).await?;
    Ok(state_of(&batch))
}

fn state_of(batch: &Value) -> State {
    match batch["status"].as_str().unwrap_or_default() {
        "completed" | "expired" | "cancelled" => State::Ended,
        "failed" => State::Refused(format!(
            "the batch failed validation: {}",
            crate::edges::provider::answer::excerpt(batch["errors"].to_string().as_bytes())
        )),
        _ => State::Running,
    }
}

/// The results of ended batch `id`: its output file's lines, then its error
/// file's.
pub(super) async fn results(client: &BatchClient, id: &str) -> Result<Vec<LineResult>, CallError> {
    let batch = client.json(client.get(&format!("batches/{id}"))?).await?;
    let mut results = Vec::new();
    for file in ["output_file_id", "error_file_id"] {
        let Some(file) = batch[file].as_str() else {
            continue;
        };
        let bytes = client
            .send(client.get(&format!("files/{file}/content"))?)
            .await?;
        results.extend(jsonl(&bytes).into_iter().map(|line| match line {
            Ok(line) => result(client, &line),
            Err(why) => unreadable(why),
        }));
    }
    Ok(results)
}

/// One line of an output or error file.
fn result(client: &BatchClient, line: &Value) -> LineResult {
    let custom_id = line["custom_id"].as_str().unwrap_or_default().to_owned();
    let outcome = match (&line["response"], line["error"]["code"].as_str()) {
        (Value::Object(response), _) => {
            let status = response
                .get("status_code")
                .and_then(Value::as_u64)
                .and_then(|s| u16::try_from(s).ok())
                .unwrap_or(0);
            Outcome::Ran(client.judged(status, response.get("body").unwrap_or(&Value::Null)))
        }
        (_, Some("batch_expired")) => Outcome::Expired,
        (_, Some("batch_cancelled")) => Outcome::Cancelled,
        _ => Outcome::Ran(Err(CallError::Rejected {
            message: format!(
                "batch line error: {}",
                crate::edges::provider::answer::excerpt(line["error"].to_string().as_bytes())
            ),
            retry_after: None,
            usage: None,
        })),
    };
    LineResult { custom_id, outcome }
}

/// The batch whose metadata names `batch`, newest first, page by page.
pub(super) async fn find(client: &BatchClient, batch: &str) -> Result<Option<String>, CallError> {
    let mut after: Option<String> = None;
    loop {
        let path = match &after {
            Some(a) => format!("batches?limit=100&after={a}"),
            None => "batches?limit=100".to_owned(),
        };
        let page = client.json(client.get(&path)?).await?;
        let data = page["data"].as_array().cloned().unwrap_or_default();
        if let Some(found) = data.iter().find(|b| b["metadata"][BATCH_METADATA] == batch) {
            return Ok(found["id"].as_str().map(str::to_owned));
        }
        let last = page["last_id"].as_str().map(str::to_owned);
        if page["has_more"] != true || last.is_none() || last == after {
            return Ok(None);
        }
        after = last;
    }
}
