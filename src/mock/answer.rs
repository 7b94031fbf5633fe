//! What a completion request comes to: an answer, a failure, or a dropped
//! connection. Kept as data until it is sent, so that it can be stored (a
//! stored completion) or replayed (a repeated idempotency key).

use std::time::Duration;

use axum::Json;
use axum::body::{Body, Bytes};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use rand::Rng;
use serde_json::{Value, json};

use super::directives::Directives;
use super::{Misbehaviour, MockOptions};

/// A completion request's outcome, before it is sent.
#[derive(Clone, Debug)]
pub(super) enum Outcome {
    /// A chat completion.
    Answer(Value),
    /// An error answer: its status, its body, whether the body is JSON, and
    /// its `Retry-After`.
    Failure {
        status: u16,
        body: Vec<u8>,
        json: bool,
        retry_after: Option<u64>,
    },
    /// The headers, then the connection dropped mid-body.
    Dropped,
}

impl Outcome {
    /// The HTTP answer.
    pub(super) fn respond(&self) -> Response {
        match self {
            Outcome::Answer(v) => Json(v.clone()).into_response(),
            Outcome::Failure {
                status,
                body,
                json,
                retry_after,
            } => {
                let code =
                    StatusCode::from_u16(*status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
                let mut response = (code, body.clone()).into_response();
                if *json {
                    response.headers_mut().insert(
                        "content-type",
                        "application/json".parse().expect("a header value"),
                    );
                }
                if let Some(secs) = retry_after
                    && let Ok(v) = secs.to_string().parse()
                {
                    response.headers_mut().insert("retry-after", v);
                }
                response
            }
            Outcome::Dropped => dropped(),
        }
    }
}

/// Runs a request's work: waits the asked or configured delay, then answers,
/// fails or drops as the directives and the server's options say. `n` is the
/// request's number, `text` all its messages, `user` the last one.
pub(super) async fn work(
    n: u64,
    options: &MockOptions,
    d: Directives,
    text: &str,
    user: &str,
) -> Outcome {
    let fail = wait(options, &d).await;
    if let Some(code) = d.status.or(if fail { Some(503) } else { None }) {
        return failure(code, &d);
    }
    if d.drop {
        return Outcome::Dropped;
    }
    Outcome::Answer(answer(n, options, d, text, user))
}

/// Waits the asked or configured delay plus jitter; returns whether the
/// server-wide error rate picked this request to fail.
async fn wait(options: &MockOptions, d: &Directives) -> bool {
    let (jitter_ms, fail) = {
        let mut rng = rand::rng();
        let jitter_ms = match options.jitter.as_millis() {
            0 => 0,
            max => rng.random_range(0..=max as u64),
        };
        (
            jitter_ms,
            options.error_rate > 0.0 && rng.random_bool(options.error_rate.min(1.0)),
        )
    };
    let delay = d.delay.map(Duration::from_millis).unwrap_or(options.delay)
        + Duration::from_millis(jitter_ms);
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    fail
}

/// An error answer with status `code` (`mock:status`, or the error rate).
fn failure(code: u16, d: &Directives) -> Outcome {
    let (body, json) = if d.nul {
        (b"mock: a raw \0 byte in an error body".to_vec(), false)
    } else {
        let message = format!(
            "mock: asked to fail with {code}{}",
            "x".repeat(d.pad.unwrap_or(0))
        );
        let body = json!({"error": {"message": message, "type": "mock_error"}});
        (body.to_string().into_bytes(), true)
    };
    Outcome::Failure {
        status: code,
        body,
        json,
        retry_after: d.retry_after,
    }
}

/// A 200 whose body breaks off: the connection drops mid-answer (`mock:drop`).
fn dropped() -> Response {
    let stream = futures_util::stream::once(async {
        Err::<Bytes, std::io::Error>(std::io::Error::other("mock: dropping the connection"))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// The chat completion: a JSON answer about the last message, or one that
/// misbehaves as the directives or the server's options ask.
fn answer(n: u64, options: &MockOptions, d: Directives, text: &str, user: &str) -> Value {
    // An answer is 12 tokens long, or cut at the request's `max_tokens`.
    let completion = d.max_tokens.map_or(12, |cap| cap.min(12));
    let prompt = text.split_whitespace().count() as u64;
    let usage = json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    });
    let finish_reason = if completion < 12 { "length" } else { "stop" };
    let mut gist: String = user.chars().take(80).collect();
    if d.nul {
        gist.push('\0');
    }
    if let Some(pad) = d.pad {
        gist.push_str(&"x".repeat(pad));
    }
    let gist = match &options.tag {
        Some(tag) => format!("from {tag}: {gist}"),
        None => gist,
    };
    let d = Directives {
        prose: d.prose || options.misbehave == Some(Misbehaviour::Prose),
        extra_key: d.extra_key || options.misbehave == Some(Misbehaviour::ExtraKey),
        wrong_type: d.wrong_type || options.misbehave == Some(Misbehaviour::WrongType),
        ..d
    };
    let content = content(options, &d, &gist);
    let (id, usage) = if d.nul {
        let mut usage = usage;
        usage["note"] = json!("spent\0");
        (format!("chatcmpl-mock-{n}\0"), usage)
    } else {
        (format!("chatcmpl-mock-{n}"), usage)
    };
    let mut answer = json!({
        "id": id,
        "object": "chat.completion",
        "model": "mock-model",
        "choices": [{
            "index": 0,
            "message": { "role": "assistant", "content": content },
            "finish_reason": finish_reason,
        }],
        "usage": usage,
    });
    if d.no_id {
        answer.as_object_mut().map(|c| c.remove("id"));
    }
    answer
}

/// The answer's text: the JSON object the operation asks for, or prose, an
/// extra key or a wrong type where asked.
fn content(options: &MockOptions, d: &Directives, gist: &str) -> String {
    if d.prose {
        return format!("Sure! Here is a summary: {gist}");
    }
    let mut answer = serde_json::Map::new();
    let value = if d.wrong_type {
        json!(42)
    } else {
        json!(format!("mock answer: {gist}"))
    };
    answer.insert(options.field.clone(), value);
    if d.extra_key {
        answer.insert("confidence".into(), json!(0.9));
    }
    Value::Object(answer).to_string()
}
