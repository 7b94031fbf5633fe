//! Anthropic's Messages API (`POST {base_url}/messages`): the key in
//! `x-api-key`, the API's version in `anthropic-version`, `max_tokens`
//! required, the system prompt beside the messages rather than among them,
//! the answer in `content` blocks (its text blocks, joined), and
//! `usage.input_tokens`/`output_tokens` (plus the cache's input tokens, when
//! a prompt cache is used). Its errors are `{"type": "error", "error":
//! {"type", "message"}}`, 529 `overloaded_error` among them: a definite
//! failure, retried as any.
//!
//! Its evidence: the API keeps no listing of past messages onejob could
//! search, and documents no idempotency key, so `none` (configuration
//! refuses `stored`); `idempotency_key` only where a gateway in front of it
//! honours the key.

use serde::Deserialize;
use serde_json::{Value, json};

use super::{Read, Wire};
use crate::settings::config::{Operation, Provider, Rendered};

/// The Anthropic wire format.
pub(crate) struct Anthropic;

/// The API version every call names (`anthropic-version`).
pub(crate) const VERSION: &str = "2023-06-01";

#[derive(Deserialize)]
struct Message {
    id: Option<String>,
    #[serde(default)]
    content: Vec<Block>,
    usage: Option<Value>,
}

#[derive(Deserialize)]
struct Block {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

impl Wire for Anthropic {
    fn path(&self) -> &'static str {
        "messages"
    }

    fn body(
        &self,
        provider: &Provider,
        operation: &Operation,
        rendered: &Rendered,
        _stored: Option<Value>,
    ) -> Value {
        let mut body = json!({
            "model": provider.model,
            "max_tokens": operation.max_tokens,
            "temperature": operation.temperature,
            "messages": [{ "role": "user", "content": rendered.user }],
        });
        // The API refuses an empty system text; none is the same prompt.
        if !rendered.system.is_empty() {
            body["system"] = json!(rendered.system);
        }
        body
    }

    fn authorize(
        &self,
        request: reqwest::RequestBuilder,
        key: Option<&str>,
    ) -> reqwest::RequestBuilder {
        let request = request.header("anthropic-version", VERSION);
        let Some(key) = key else {
            return request;
        };
        // Marked sensitive, as a bearer key is: kept out of debug output. A
        // key that is no header value fails the request before it is sent.
        match reqwest::header::HeaderValue::from_str(key) {
            Ok(mut value) => {
                value.set_sensitive(true);
                request.header("x-api-key", value)
            }
            Err(_) => request.header("x-api-key", key),
        }
    }

    fn read(&self, body: &[u8]) -> Result<Read, String> {
        let message: Message =
            serde_json::from_slice(body).map_err(|e| format!("malformed message ({e})"))?;
        let texts: Vec<String> = message
            .content
            .into_iter()
            .filter(|b| b.kind == "text")
            .filter_map(|b| b.text)
            .collect();
        Ok(Read {
            content: (!texts.is_empty()).then(|| texts.concat()),
            id: message.id,
            usage: message.usage,
        })
    }

    fn error_usage(&self, body: &[u8]) -> Option<Value> {
        serde_json::from_slice::<Message>(body).ok()?.usage
    }
}
