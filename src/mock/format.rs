//! The two wire formats the mock speaks: what a request asks, read from its
//! format, and an outcome (`answer::Outcome`, kept in OpenAI's shape, so
//! that one outcome can be stored, replayed and told whatever the format)
//! sent back in the request's format.
//!
//! Anthropic's shape, as its Messages API has it: the answer is
//! `{"type": "message", "content": [{"type": "text", "text"}], "usage":
//! {"input_tokens", "output_tokens"}, "stop_reason"}`; an error is
//! `{"type": "error", "error": {"type", "message"}}`, its type named by its
//! status (`overloaded_error` for 529, `rate_limit_error` for 429, …). A
//! request must name `anthropic-version` and `max_tokens`, as the API's.

use axum::Json;
use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use super::Asked;
use super::answer::Outcome;

/// A request's wire format.
#[derive(Clone, Copy, Debug)]
pub(super) enum Format {
    /// OpenAI's Chat Completions.
    OpenAi,
    /// Anthropic's Messages API.
    Anthropic,
}

impl Format {
    /// The answer to a request that could not be read: 400, with why.
    pub(super) fn refuse(self, why: &str) -> Response {
        let message = format!("bad request: {why}");
        let body = match self {
            Format::OpenAi => json!({"error": {"message": message}}),
            Format::Anthropic => error_body(400, &message),
        };
        (StatusCode::BAD_REQUEST, Json(body)).into_response()
    }

    /// The HTTP answer of `outcome` in this format.
    pub(super) fn respond(self, outcome: &Outcome) -> Response {
        match self {
            Format::OpenAi => outcome.respond(),
            Format::Anthropic => anthropic(outcome).respond(),
        }
    }
}

/// OpenAI's Chat Completions request.
pub(super) struct OpenAi;

#[derive(Deserialize)]
struct ChatRequest {
    #[serde(default)]
    messages: Vec<ChatMessage>,
    #[serde(default)]
    store: bool,
    #[serde(default)]
    metadata: Option<Value>,
    #[serde(default)]
    max_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct ChatMessage {
    #[serde(default)]
    content: String,
}

impl OpenAi {
    pub(super) fn asked(body: &Bytes) -> Result<Asked, String> {
        let request: ChatRequest = serde_json::from_slice(body).map_err(|e| e.to_string())?;
        let texts: Vec<&str> = request
            .messages
            .iter()
            .map(|m| m.content.as_str())
            .collect();
        Ok(Asked {
            text: texts.join("\n"),
            user: texts.last().map(|t| (*t).to_owned()).unwrap_or_default(),
            max_tokens: request.max_tokens,
            stored: request.store.then(|| request.metadata.unwrap_or(json!({}))),
        })
    }
}

/// Anthropic's Messages API request.
pub(super) struct Anthropic;

#[derive(Deserialize)]
struct MessagesRequest {
    #[serde(default)]
    system: Value,
    #[serde(default)]
    messages: Vec<MessageIn>,
    max_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct MessageIn {
    #[serde(default)]
    content: Value,
}

impl Anthropic {
    pub(super) fn asked(headers: &HeaderMap, body: &Bytes) -> Result<Asked, String> {
        if !headers.contains_key("anthropic-version") {
            return Err("anthropic-version: header is required".into());
        }
        Self::asked_params(body)
    }

    /// A Messages API request's body: a live request's, or a batch
    /// request's `params`.
    pub(super) fn asked_params(body: &Bytes) -> Result<Asked, String> {
        let request: MessagesRequest = serde_json::from_slice(body).map_err(|e| e.to_string())?;
        let max_tokens = request.max_tokens.ok_or("max_tokens: Field required")?;
        let texts: Vec<String> = request.messages.iter().map(|m| text(&m.content)).collect();
        let mut all = vec![text(&request.system)];
        all.extend(texts.iter().cloned());
        Ok(Asked {
            text: all.join("\n"),
            user: texts.last().cloned().unwrap_or_default(),
            max_tokens: Some(max_tokens),
            stored: None,
        })
    }
}

/// A content's text: a string, or its text blocks joined.
fn text(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(blocks) => blocks
            .iter()
            .filter(|b| b["type"] == "text")
            .filter_map(|b| b["text"].as_str())
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// An outcome in Anthropic's shape.
pub(super) fn anthropic(outcome: &Outcome) -> Outcome {
    match outcome {
        Outcome::Answer(c) => Outcome::Answer(message(c)),
        Outcome::Failure {
            status,
            body,
            json: true,
            retry_after,
        } => {
            let said: Value = serde_json::from_slice(body).unwrap_or_default();
            let message = said["error"]["message"].as_str().unwrap_or_default();
            Outcome::Failure {
                status: *status,
                body: error_body(*status, message).to_string().into_bytes(),
                json: true,
                retry_after: *retry_after,
            }
        }
        other => other.clone(),
    }
}

/// A chat completion as a Messages API message.
fn message(c: &Value) -> Value {
    let id = c["id"]
        .as_str()
        .map(|id| id.replacen("chatcmpl-", "msg_", 1));
    let stop_reason = match c["choices"][0]["finish_reason"].as_str() {
        Some("length") => "max_tokens",
        _ => "end_turn",
    };
    let mut usage = json!({
        "input_tokens": c["usage"]["prompt_tokens"],
        "output_tokens": c["usage"]["completion_tokens"],
    });
    if let Some(note) = c["usage"].get("note") {
        usage["note"] = note.clone();
    }
    let mut message = json!({
        "type": "message",
        "role": "assistant",
        "model": c["model"],
        "content": [{"type": "text", "text": c["choices"][0]["message"]["content"]}],
        "stop_reason": stop_reason,
        "stop_sequence": null,
        "usage": usage,
    });
    if let Some(id) = id {
        message["id"] = json!(id);
    }
    message
}

/// An error body in Anthropic's shape, its type named by its status.
pub(super) fn error_body(status: u16, message: &str) -> Value {
    let kind = match status {
        400 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        529 => "overloaded_error",
        _ => "api_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": message}})
}
