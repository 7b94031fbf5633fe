//! The evidence a real provider may keep, each switched on per mock:
//!
//! - **stored completions** ([`MockOptions::store`]): a request with
//!   `"store": true` is kept once its work completes, even if the client hung
//!   up, with its `metadata`; `GET /v1/chat/completions?metadata[k]=v` lists
//!   the kept ones whose metadata match, newest first, in pages (`limit`,
//!   `after`, `has_more`), and
//!   `GET /v1/chat/completions/{id}` reads one.
//! - **idempotency keys** ([`MockOptions::replay`]): a request whose
//!   `Idempotency-Key` was seen before runs no new work. It is answered
//!   `409` while the first request is still running (the IETF
//!   Idempotency-Key draft's "still being processed"), then with the first
//!   request's outcome: its answer, or its error.
//!
//! [`MockOptions::store`]: super::MockOptions::store
//! [`MockOptions::replay`]: super::MockOptions::replay

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use axum::Json;
use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::watch;

use super::AppState;
use super::answer::Outcome;

/// The most completions one list answers with.
const MAX_LIST: usize = 100;

/// Completions kept, and idempotency keys seen, newest last; each bounded.
#[derive(Debug, Default)]
pub(super) struct Evidence {
    stored: Mutex<VecDeque<Value>>,
    keys: Mutex<Keys>,
}

#[derive(Debug, Default)]
struct Keys {
    order: VecDeque<String>,
    outcomes: HashMap<String, watch::Receiver<Option<Outcome>>>,
}

/// What a request with an idempotency key meets.
pub(super) enum Seen {
    /// The key is new: run the work, and say what came of it.
    First(watch::Sender<Option<Outcome>>),
    /// The key was seen: the first request's outcome, once it has one.
    Again(watch::Receiver<Option<Outcome>>),
}

impl Evidence {
    /// Keeps a completed answer with its metadata (the latest `limit`).
    pub(super) fn store(&self, mut completion: Value, metadata: Value, limit: usize) {
        completion["metadata"] = metadata;
        completion["created"] = json!(chrono::Utc::now().timestamp());
        if let Ok(mut stored) = self.stored.lock() {
            stored.push_back(completion);
            while stored.len() > limit {
                stored.pop_front();
            }
        }
    }

    /// Meets an idempotency key (keeping the latest `limit` keys).
    pub(super) fn key(&self, key: &str, limit: usize) -> Seen {
        let Ok(mut keys) = self.keys.lock() else {
            return Seen::First(watch::channel(None).0);
        };
        if let Some(outcome) = keys.outcomes.get(key) {
            return Seen::Again(outcome.clone());
        }
        let (tell, told) = watch::channel(None);
        keys.outcomes.insert(key.to_owned(), told);
        keys.order.push_back(key.to_owned());
        while keys.order.len() > limit {
            if let Some(old) = keys.order.pop_front() {
                keys.outcomes.remove(&old);
            }
        }
        Seen::First(tell)
    }

    fn matching(&self, wanted: &[(String, String)]) -> Vec<Value> {
        let stored = self.stored.lock().map(|s| s.clone()).unwrap_or_default();
        stored
            .into_iter()
            .rev()
            .filter(|c| {
                wanted
                    .iter()
                    .all(|(k, v)| c["metadata"][k].as_str() == Some(v.as_str()))
            })
            .collect()
    }

    fn by_id(&self, id: &str) -> Option<Value> {
        let stored = self.stored.lock().ok()?;
        stored.iter().find(|c| c["id"] == id).cloned()
    }
}

/// The answer to a repeated key, as the IETF Idempotency-Key draft has it:
/// `409` while the first request is still being processed; once it has
/// ended, its outcome again (its answer, or its error). A first request
/// whose answer was lost mid-body (`mock:drop`) is answered as failed.
pub(super) fn replayed(first: &watch::Receiver<Option<Outcome>>) -> Outcome {
    let outcome = first.borrow().clone();
    let failure = |status: u16, message: &str, kind: &str| Outcome::Failure {
        status,
        body: json!({"error": {"message": message, "type": kind}})
            .to_string()
            .into_bytes(),
        json: true,
        retry_after: None,
    };
    match outcome {
        None => failure(
            409,
            "a request with this Idempotency-Key is still being processed",
            "idempotency_error",
        ),
        Some(Outcome::Dropped) => failure(
            500,
            "the first request with this Idempotency-Key failed: its answer was lost",
            "server_error",
        ),
        Some(outcome) => outcome,
    }
}

/// `GET /v1/chat/completions?metadata[k]=v&limit=N&after=ID`: the stored
/// completions whose metadata match every pair given, newest first, a page
/// of at most `limit` (and at most [`MockOptions::list_page`]) after the
/// completion `after`, with `has_more` and `last_id` to page on.
///
/// [`MockOptions::list_page`]: super::MockOptions::list_page
pub(super) async fn list(State(state): State<AppState>, RawQuery(query): RawQuery) -> Response {
    if !state.options.read().map(|o| o.store).unwrap_or(false) {
        return not_stored();
    }
    let page_most = state
        .options
        .read()
        .map(|o| o.list_page)
        .unwrap_or(MAX_LIST)
        .clamp(1, MAX_LIST);
    let mut wanted = Vec::new();
    let mut limit = 20;
    let mut after = None;
    for (k, v) in url::form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        if let Some(key) = k
            .strip_prefix("metadata[")
            .and_then(|k| k.strip_suffix(']'))
        {
            wanted.push((key.to_owned(), v.into_owned()));
        } else if k == "limit" {
            limit = v.parse().unwrap_or(limit).clamp(1, MAX_LIST);
        } else if k == "after" {
            after = Some(v.into_owned());
        }
    }
    let limit = limit.min(page_most);
    let mut data = state.evidence.matching(&wanted);
    if let Some(after) = after {
        // The page after the completion `after`: none if it is not listed.
        let at = data.iter().position(|c| c["id"] == after.as_str());
        data = at.map(|i| data.split_off(i + 1)).unwrap_or_default();
    }
    let has_more = data.len() > limit;
    data.truncate(limit);
    Json(json!({
        "object": "list",
        "first_id": data.first().map(|c| c["id"].clone()),
        "last_id": data.last().map(|c| c["id"].clone()),
        "has_more": has_more,
        "data": data,
    }))
    .into_response()
}

/// `GET /v1/chat/completions/{id}`: one stored completion.
pub(super) async fn read(State(state): State<AppState>, Path(id): Path<String>) -> Response {
    if !state.options.read().map(|o| o.store).unwrap_or(false) {
        return not_stored();
    }
    match state.evidence.by_id(&id) {
        Some(c) => Json(c).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({"error": {
                "message": format!("No chat completion found with id {id:?}."),
                "type": "invalid_request_error",
            }})),
        )
            .into_response(),
    }
}

fn not_stored() -> Response {
    (
        StatusCode::NOT_FOUND,
        Json(json!({"error": {
            "message": "this mock stores no completions (start it with --store)",
            "type": "invalid_request_error",
        }})),
    )
        .into_response()
}
