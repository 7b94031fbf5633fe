//! Anthropic's Message Batches API, as the mock serves it: `POST
//! /v1/messages/batches` (`{"requests": [{"custom_id", "params"}]}`, the
//! requests inline), `GET /v1/messages/batches/{id}`, `GET
//! /v1/messages/batches` (newest first, `after_id`, `limit`), `POST
//! /v1/messages/batches/{id}/cancel` and `GET
//! /v1/messages/batches/{id}/results` (JSONL, once the batch has `ended`).
//!
//! Every request must name `anthropic-version`. A `custom_id` outside
//! `^[a-zA-Z0-9_-]{1,64}$`, or one given twice, refuses the batch whole
//! (400); a request whose `params` cannot be read ends `errored`, as the
//! API's does. A result is `succeeded` (its `message`), `errored` (its
//! error, in the Messages API's shape), `expired` or `canceled`. The API
//! keeps no metadata on a batch.

use std::collections::HashSet;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::{Value, json};

use super::{Batch, Ended, Kind, Line, MAX_LINES, Status, Store, run};
use crate::mock::answer::Outcome;
use crate::mock::format;
use crate::mock::{AppState, options_of};

/// An error answer in Anthropic's shape.
fn error(status: StatusCode, message: &str) -> Response {
    (status, Json(format::error_body(status.as_u16(), message))).into_response()
}

/// The refusal of a request without `anthropic-version`, as the API
/// refuses it; None for a request with one.
fn unversioned(headers: &HeaderMap) -> Option<Response> {
    (!headers.contains_key("anthropic-version")).then(|| {
        error(
            StatusCode::BAD_REQUEST,
            "anthropic-version: header is required",
        )
    })
}

#[derive(Deserialize)]
pub(in crate::mock) struct Create {
    requests: Vec<Request>,
}

#[derive(Deserialize)]
struct Request {
    custom_id: String,
    params: Value,
}

/// `POST /v1/messages/batches`.
pub(in crate::mock) async fn create(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(refused) = unversioned(&headers) {
        return refused;
    }
    let create: Create = match serde_json::from_slice(&body) {
        Ok(c) => c,
        Err(e) => return error(StatusCode::BAD_REQUEST, &format!("bad request: {e}")),
    };
    if create.requests.is_empty() || create.requests.len() > MAX_LINES {
        return error(
            StatusCode::BAD_REQUEST,
            &format!("requests: 1 to {MAX_LINES} are required"),
        );
    }
    let mut seen = HashSet::new();
    for r in &create.requests {
        let fits = (1..=64).contains(&r.custom_id.len())
            && r.custom_id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if !fits {
            return error(
                StatusCode::BAD_REQUEST,
                "custom_id: must match ^[a-zA-Z0-9_-]{1,64}$",
            );
        }
        if !seen.insert(r.custom_id.as_str()) {
            return error(
                StatusCode::BAD_REQUEST,
                "custom_id: each must be unique within the batch",
            );
        }
    }
    let lines: Vec<Line> = create
        .requests
        .into_iter()
        .map(|r| Line {
            asked: format::Anthropic::asked_params(&Bytes::from(r.params.to_string())),
            custom_id: r.custom_id,
        })
        .collect();
    let options = options_of(&state);
    let mut store = state.batches.lock();
    let id = store.id("msgbatch_mock");
    let batch = Batch::new(id.clone(), Kind::Anthropic, &lines, &options);
    let object = batch_object(&batch, &headers);
    store.batches.push(batch);
    drop(store);
    state.stats.batch_lines_seen(&lines, options.record_limit);
    let (batches, stats) = (state.batches.clone(), state.stats.clone());
    tokio::spawn(run(batches, stats, options, id, lines, keep_results));
    Json(object).into_response()
}

/// The API keeps its results behind the batch's `results_url`: nothing to
/// write.
fn keep_results(_: &mut Store, _: &str) {}

/// RFC 3339, as the API writes its times.
fn time(secs: i64) -> Value {
    DateTime::<Utc>::from_timestamp(secs, 0).map_or(Value::Null, |t| json!(t.to_rfc3339()))
}

/// A batch in Anthropic's shape.
fn batch_object(b: &Batch, headers: &HeaderMap) -> Value {
    let status = match b.status {
        Status::InProgress => "in_progress",
        Status::Cancelling => "canceling",
        _ => "ended",
    };
    let counts = b.counts();
    // The results' address, on the host the client asked (the mock's own).
    let host = headers
        .get("host")
        .and_then(|h| h.to_str().ok())
        .unwrap_or("localhost");
    json!({
        "id": b.id,
        "type": "message_batch",
        "processing_status": status,
        "request_counts": {
            "processing": counts.processing(),
            "succeeded": counts.succeeded,
            "errored": counts.errored,
            "canceled": counts.cancelled,
            "expired": counts.expired,
        },
        "ended_at": b.ended_at.map_or(Value::Null, time),
        "created_at": time(b.created_at),
        "expires_at": time(b.created_at + 24 * 3600),
        "archived_at": null,
        "cancel_initiated_at": b.cancelling_at.map_or(Value::Null, time),
        "results_url": b.status.ended().then(|| format!("http://{host}/v1/messages/batches/{}/results", b.id)),
    })
}

/// `GET /v1/messages/batches/{id}`: after the batch's slow status, if it has
/// one.
pub(in crate::mock) async fn read(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    if let Some(refused) = unversioned(&headers) {
        return refused;
    }
    state.batches.slow_status(&id).await;
    match state
        .batches
        .lock()
        .batch(&id)
        .filter(|b| b.kind == Kind::Anthropic)
    {
        Some(b) => Json(batch_object(b, &headers)).into_response(),
        None => error(StatusCode::NOT_FOUND, "No such message batch"),
    }
}

#[derive(Deserialize)]
pub(in crate::mock) struct Page {
    after_id: Option<String>,
    limit: Option<usize>,
}

/// `GET /v1/messages/batches`: newest first, `limit` (1 to 1,000, 20 by
/// default) after the batch `after_id`.
pub(in crate::mock) async fn list(
    State(state): State<AppState>,
    headers: HeaderMap,
    Query(page): Query<Page>,
) -> Response {
    if let Some(refused) = unversioned(&headers) {
        return refused;
    }
    let limit = page.limit.unwrap_or(20).clamp(1, 1000);
    let store = state.batches.lock();
    let (page, has_more) = store.page(Kind::Anthropic, page.after_id.as_deref(), limit);
    let data: Vec<Value> = page
        .into_iter()
        .map(|b| batch_object(b, &headers))
        .collect();
    Json(json!({
        "data": data,
        "has_more": has_more,
        "first_id": data.first().map(|b| b["id"].clone()),
        "last_id": data.last().map(|b| b["id"].clone()),
    }))
    .into_response()
}

/// `POST /v1/messages/batches/{id}/cancel`.
pub(in crate::mock) async fn cancel(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    if let Some(refused) = unversioned(&headers) {
        return refused;
    }
    match state.batches.cancel(&id, Kind::Anthropic) {
        None => error(StatusCode::NOT_FOUND, "No such message batch"),
        Some(false) => error(
            StatusCode::CONFLICT,
            "the batch has ended and cannot be canceled",
        ),
        Some(true) => match state.batches.lock().batch(&id) {
            Some(b) => Json(batch_object(b, &headers)).into_response(),
            None => error(StatusCode::NOT_FOUND, "No such message batch"),
        },
    }
}

/// `GET /v1/messages/batches/{id}/results`: a line per result, once the
/// batch has ended.
pub(in crate::mock) async fn results(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    if let Some(refused) = unversioned(&headers) {
        return refused;
    }
    let mut store = state.batches.lock();
    let Some(batch) = store.batch(&id).filter(|b| b.kind == Kind::Anthropic) else {
        return error(StatusCode::NOT_FOUND, "No such message batch");
    };
    if !batch.status.ended() {
        return error(
            StatusCode::CONFLICT,
            "the batch is still processing: no results yet",
        );
    }
    let mut text = String::new();
    for (custom_id, ended) in &batch.results {
        text.push_str(&json!({"custom_id": custom_id, "result": result(ended)}).to_string());
        text.push('\n');
    }
    ([("content-type", "application/x-jsonl")], text).into_response()
}

/// One request's result.
fn result(ended: &Ended) -> Value {
    match ended {
        Ended::Ran(outcome) => match format::anthropic(outcome) {
            Outcome::Answer(message) => json!({"type": "succeeded", "message": message}),
            Outcome::Failure { status, body, .. } => {
                let said: Value = serde_json::from_slice(&body).unwrap_or_else(|_| {
                    format::error_body(status, &String::from_utf8_lossy(&body))
                });
                json!({"type": "errored", "error": said})
            }
            Outcome::Dropped => json!({"type": "errored",
                "error": format::error_body(500, "mock: the request broke off")}),
        },
        Ended::Invalid(why) => json!({"type": "errored",
            "error": format::error_body(400, &format!("bad request: {why}"))}),
        Ended::Expired => json!({"type": "expired"}),
        Ended::Cancelled => json!({"type": "canceled"}),
    }
}
