//! OpenAI's Files and Batches APIs, as the mock serves them:
//! `POST /v1/files` (multipart, `purpose` `batch`, a JSONL `file` of
//! `{"custom_id", "method": "POST", "url": "/v1/chat/completions", "body"}`
//! lines), `GET /v1/files/{id}` and `/content`, `POST /v1/batches`
//! (`input_file_id`, `endpoint`, `completion_window` `24h`, `metadata`),
//! `GET /v1/batches/{id}`, `GET /v1/batches` (newest first, `after`,
//! `limit`) and `POST /v1/batches/{id}/cancel`.
//!
//! A file whose lines cannot all be read, or that repeats a `custom_id`,
//! makes a batch that `failed` at validation, its `errors` naming each line,
//! as OpenAI's does. Once a batch ends, its output file holds a line per
//! answer (`response.status_code` 200), its error file a line per error
//! answer (`response` with its status and body) and per line that never ran
//! (`error.code` `batch_expired` or `batch_cancelled`).

use std::collections::HashSet;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Multipart, Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use super::{Batch, Ended, Kind, Line, MAX_LINES, Status, Store, now, run};
use crate::mock::answer::Outcome;
use crate::mock::format;
use crate::mock::{AppState, options_of};

/// The largest file the mock takes (OpenAI's limit).
pub(in crate::mock) const MAX_FILE_BYTES: usize = 200 << 20;

/// The endpoint every line and the batch must name.
const ENDPOINT: &str = "/v1/chat/completions";

/// An error answer in OpenAI's shape.
fn error(status: StatusCode, message: &str) -> Response {
    let body = json!({"error": {"message": message, "type": "invalid_request_error"}});
    (status, Json(body)).into_response()
}

fn file_object(f: &super::File) -> Value {
    json!({
        "id": f.id,
        "object": "file",
        "bytes": f.bytes.len(),
        "created_at": f.created_at,
        "filename": f.filename,
        "purpose": f.purpose,
    })
}

/// `POST /v1/files`.
pub(in crate::mock) async fn upload(
    State(state): State<AppState>,
    mut form: Multipart,
) -> Response {
    let (mut purpose, mut file) = (None, None);
    loop {
        let field = match form.next_field().await {
            Ok(Some(field)) => field,
            Ok(None) => break,
            Err(e) => return error(StatusCode::BAD_REQUEST, &format!("unreadable form: {e}")),
        };
        let name = field.name().unwrap_or_default().to_owned();
        let filename = field.file_name().map(str::to_owned);
        let Ok(bytes) = field.bytes().await else {
            return error(StatusCode::BAD_REQUEST, "unreadable form field");
        };
        match name.as_str() {
            "purpose" => purpose = Some(String::from_utf8_lossy(&bytes).into_owned()),
            "file" => file = Some((filename.unwrap_or_else(|| "upload.jsonl".into()), bytes)),
            _ => {}
        }
    }
    let Some((filename, bytes)) = file else {
        return error(StatusCode::BAD_REQUEST, "file: a file is required");
    };
    if purpose.as_deref() != Some("batch") {
        return error(
            StatusCode::BAD_REQUEST,
            "purpose: this mock takes 'batch' files only",
        );
    }
    let mut store = state.batches.lock();
    let id = store.id("file-mock");
    let f = super::File {
        id: id.clone(),
        filename,
        purpose: "batch".into(),
        created_at: now(),
        bytes: bytes.to_vec(),
    };
    let object = file_object(&f);
    store.files.insert(id, f);
    Json(object).into_response()
}

/// `GET /v1/files/{id}`.
pub(in crate::mock) async fn file(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Response {
    match state.batches.lock().files.get(&id) {
        Some(f) => Json(file_object(f)).into_response(),
        None => error(StatusCode::NOT_FOUND, "No such File object"),
    }
}

/// `GET /v1/files/{id}/content`.
pub(in crate::mock) async fn content(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Response {
    match state.batches.lock().files.get(&id) {
        Some(f) => ([("content-type", "application/jsonl")], f.bytes.clone()).into_response(),
        None => error(StatusCode::NOT_FOUND, "No such File object"),
    }
}

#[derive(Deserialize)]
pub(in crate::mock) struct Create {
    input_file_id: String,
    endpoint: String,
    completion_window: String,
    #[serde(default)]
    metadata: Option<Value>,
}

/// `POST /v1/batches`.
pub(in crate::mock) async fn create(State(state): State<AppState>, body: Bytes) -> Response {
    let create: Create = match serde_json::from_slice(&body) {
        Ok(c) => c,
        Err(e) => return error(StatusCode::BAD_REQUEST, &format!("bad request: {e}")),
    };
    if create.endpoint != ENDPOINT {
        return error(
            StatusCode::BAD_REQUEST,
            "endpoint: this mock batches /v1/chat/completions only",
        );
    }
    if create.completion_window != "24h" {
        return error(StatusCode::BAD_REQUEST, "completion_window: must be 24h");
    }
    if let Some(why) = create.metadata.as_ref().and_then(bad_metadata) {
        return error(StatusCode::BAD_REQUEST, &format!("metadata: {why}"));
    }
    let options = options_of(&state);
    let mut store = state.batches.lock();
    let Some(file) = store.files.get(&create.input_file_id) else {
        return error(StatusCode::NOT_FOUND, "input_file_id: no such file");
    };
    let (lines, errors) = read_lines(&file.bytes);
    let id = store.id("batch_mock");
    let failed = !errors.is_empty();
    let mut batch = Batch::new(id.clone(), Kind::OpenAi, &lines, &options);
    batch.metadata = create.metadata;
    batch.input_file_id = Some(create.input_file_id);
    if failed {
        batch.status = Status::Failed;
        batch.errors = errors;
        batch.ended_at = Some(now());
    }
    let object = batch_object(&batch);
    store.batches.push(batch);
    drop(store);
    if !failed {
        state.stats.batch_lines_seen(&lines, options.record_limit);
        let (batches, stats) = (state.batches.clone(), state.stats.clone());
        tokio::spawn(run(batches, stats, options, id, lines, write_files));
    }
    Json(object).into_response()
}

/// Why `metadata` is not what OpenAI takes (at most 16 string pairs, keys
/// up to 64 characters, values up to 512), if it is not.
fn bad_metadata(metadata: &Value) -> Option<&'static str> {
    let Some(pairs) = metadata.as_object() else {
        return Some("must be an object");
    };
    if pairs.len() > 16 {
        return Some("at most 16 pairs");
    }
    let fits = |(k, v): (&String, &Value)| {
        k.chars().count() <= 64 && v.as_str().is_some_and(|v| v.chars().count() <= 512)
    };
    (!pairs.iter().all(fits)).then_some("keys up to 64 characters, string values up to 512")
}

/// The file's lines, and an error for each one that cannot be taken.
fn read_lines(bytes: &[u8]) -> (Vec<Line>, Vec<Value>) {
    let (mut lines, mut errors) = (Vec::new(), Vec::new());
    let mut seen = HashSet::new();
    let text = String::from_utf8_lossy(bytes);
    for (n, raw) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let mut fail = |code: &str, message: String| {
            errors.push(json!({"code": code, "message": message, "param": null, "line": n + 1}));
        };
        let line: Value = match serde_json::from_str(raw) {
            Ok(v) => v,
            Err(e) => {
                fail("invalid_json_line", format!("line {}: {e}", n + 1));
                continue;
            }
        };
        let Some(custom_id) = line["custom_id"].as_str().filter(|c| !c.is_empty()) else {
            fail("missing_required_parameter", "custom_id: required".into());
            continue;
        };
        if line["method"] != "POST" || line["url"] != ENDPOINT || !line["body"].is_object() {
            fail(
                "invalid_request",
                "method POST, url /v1/chat/completions and a body object are required".into(),
            );
            continue;
        }
        if !seen.insert(custom_id.to_owned()) {
            fail(
                "duplicate_custom_id",
                format!("custom_id {custom_id} is used more than once"),
            );
            continue;
        }
        let body = Bytes::from(line["body"].to_string());
        lines.push(Line {
            custom_id: custom_id.to_owned(),
            asked: format::OpenAi::asked(&body),
        });
    }
    if lines.len() > MAX_LINES {
        errors.push(json!({"code": "too_many_requests", "message": format!("at most {MAX_LINES} requests"), "param": null, "line": null}));
    }
    if lines.is_empty() && errors.is_empty() {
        errors.push(json!({"code": "empty_file", "message": "the file holds no requests", "param": null, "line": null}));
    }
    (lines, errors)
}

/// Writes an ended batch's output and error files.
fn write_files(store: &mut Store, id: &str) {
    let Some(batch) = store.batch(id) else {
        return;
    };
    let (mut output, mut errors) = (String::new(), String::new());
    for (n, (custom_id, ended)) in batch.results.iter().enumerate() {
        let line_id = format!("batch_req_{}_{n}", batch.id);
        let (line, ok) = result_line(&line_id, custom_id, ended);
        let file = if ok { &mut output } else { &mut errors };
        file.push_str(&line.to_string());
        file.push('\n');
    }
    let batch_id = batch.id.clone();
    let file = |store: &mut Store, text: String, what: &str| {
        (!text.is_empty()).then(|| {
            let id = store.id("file-mock");
            let f = super::File {
                id: id.clone(),
                filename: format!("{batch_id}_{what}.jsonl"),
                purpose: "batch_output".into(),
                created_at: now(),
                bytes: text.into_bytes(),
            };
            store.files.insert(id.clone(), f);
            id
        })
    };
    let output = file(store, output, "output");
    let errors = file(store, errors, "error");
    if let Some(batch) = store.batch(id) {
        batch.output_file_id = output;
        batch.error_file_id = errors;
    }
}

/// One line of the output file (true) or of the error file (false).
fn result_line(line_id: &str, custom_id: &str, ended: &Ended) -> (Value, bool) {
    let response = |status: u16, body: Value| {
        json!({"id": line_id, "custom_id": custom_id, "error": null,
               "response": {"status_code": status, "request_id": format!("req_{line_id}"), "body": body}})
    };
    let never_ran = |code: &str, message: &str| {
        json!({"id": line_id, "custom_id": custom_id, "response": null,
               "error": {"code": code, "message": message}})
    };
    match ended {
        Ended::Ran(Outcome::Answer(c)) => (response(200, c.clone()), true),
        Ended::Ran(Outcome::Failure { status, body, .. }) => {
            let body = serde_json::from_slice(body)
                .unwrap_or_else(|_| json!({"error": {"message": String::from_utf8_lossy(body)}}));
            (response(*status, body), false)
        }
        Ended::Ran(Outcome::Dropped) => (
            response(
                500,
                json!({"error": {"message": "mock: the request broke off"}}),
            ),
            false,
        ),
        Ended::Invalid(why) => (
            response(
                400,
                json!({"error": {"message": format!("bad request: {why}")}}),
            ),
            false,
        ),
        Ended::Expired => (
            never_ran(
                "batch_expired",
                "This request could not be executed before the completion window expired.",
            ),
            false,
        ),
        Ended::Cancelled => (
            never_ran(
                "batch_cancelled",
                "This request was not executed because the batch was cancelled.",
            ),
            false,
        ),
    }
}

/// A batch in OpenAI's shape.
fn batch_object(b: &Batch) -> Value {
    let status = match b.status {
        Status::InProgress => "in_progress",
        Status::Cancelling => "cancelling",
        Status::Completed => "completed",
        Status::Expired => "expired",
        Status::Cancelled => "cancelled",
        Status::Failed => "failed",
    };
    let at = |s: Status| (b.status == s).then_some(b.ended_at).flatten();
    let counts = b.counts();
    json!({
        "id": b.id,
        "object": "batch",
        "endpoint": ENDPOINT,
        "errors": (!b.errors.is_empty()).then(|| json!({"object": "list", "data": b.errors})),
        "input_file_id": b.input_file_id,
        "completion_window": "24h",
        "status": status,
        "output_file_id": b.output_file_id,
        "error_file_id": b.error_file_id,
        "created_at": b.created_at,
        "in_progress_at": (b.status != Status::Failed).then_some(b.created_at),
        "expires_at": b.created_at + 24 * 3600,
        "finalizing_at": b.ended_at.filter(|_| b.status != Status::Failed),
        "completed_at": at(Status::Completed),
        "failed_at": at(Status::Failed),
        "expired_at": at(Status::Expired),
        "cancelling_at": b.cancelling_at,
        "cancelled_at": at(Status::Cancelled),
        "request_counts": {
            "total": counts.total,
            "completed": counts.succeeded,
            "failed": counts.errored + counts.expired + counts.cancelled,
        },
        "metadata": b.metadata,
    })
}

/// `GET /v1/batches/{id}`: after the batch's slow status, if it has one.
pub(in crate::mock) async fn read(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Response {
    state.batches.slow_status(&id).await;
    match state
        .batches
        .lock()
        .batch(&id)
        .filter(|b| b.kind == Kind::OpenAi)
    {
        Some(b) => Json(batch_object(b)).into_response(),
        None => error(StatusCode::NOT_FOUND, "No such Batch object"),
    }
}

#[derive(Deserialize)]
pub(in crate::mock) struct Page {
    after: Option<String>,
    limit: Option<usize>,
}

/// `GET /v1/batches`: newest first, `limit` (1 to 100, 20 by default) after
/// the batch `after`.
pub(in crate::mock) async fn list(
    State(state): State<AppState>,
    Query(page): Query<Page>,
) -> Response {
    let limit = page.limit.unwrap_or(20).clamp(1, 100);
    let store = state.batches.lock();
    let (page, has_more) = store.page(Kind::OpenAi, page.after.as_deref(), limit);
    let data: Vec<Value> = page.into_iter().map(batch_object).collect();
    Json(json!({
        "object": "list",
        "first_id": data.first().map(|b| b["id"].clone()),
        "last_id": data.last().map(|b| b["id"].clone()),
        "has_more": has_more,
        "data": data,
    }))
    .into_response()
}

/// `POST /v1/batches/{id}/cancel`.
pub(in crate::mock) async fn cancel(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Response {
    match state.batches.cancel(&id, Kind::OpenAi) {
        None => error(StatusCode::NOT_FOUND, "No such Batch object"),
        Some(false) => error(
            StatusCode::CONFLICT,
            "the batch has ended and cannot be cancelled",
        ),
        Some(true) => match state.batches.lock().batch(&id) {
            Some(b) => Json(batch_object(b)).into_response(),
            None => error(StatusCode::NOT_FOUND, "No such Batch object"),
        },
    }
}
