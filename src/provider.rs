//! Calling AI-inference providers.
//!
//! What matters most here is the dispatch phase. A call refused before the request
//! left (connection refused, DNS failure) is a definite failure: the provider never
//! saw it. A call that timed out or lost its connection after the request was sent
//! is `unknown`: the provider may still be working, and may still charge for it.

use std::time::Duration;

use serde::Deserialize;
use serde_json::{Value, json};

use crate::config::{Operation, Provider, Rendered};
use crate::domain::AttemptId;

/// An answer from the provider.
#[derive(Clone, Debug, PartialEq)]
pub struct Answer {
    /// The assistant message's content.
    pub content: String,
    /// The provider's response id.
    pub request_id: Option<String>,
    /// What the provider reported it spent.
    pub usage: Option<Value>,
}

/// Why a call gave no answer.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum CallError {
    /// The request never left: a definite failure.
    #[error("provider_unreachable: {0}")]
    Refused(String),
    /// The provider answered with an error: a definite failure.
    #[error("provider_error: {message}")]
    Rejected {
        /// Status and body excerpt.
        message: String,
        /// A 429's `Retry-After`, if given.
        retry_after: Option<Duration>,
        /// What the provider reported it spent, if anything.
        usage: Option<Value>,
    },
    /// The outcome is not known: timeout, or the connection was lost after sending.
    #[error("outcome_unknown: {0}")]
    Unknown(String),
}

#[derive(Deserialize)]
struct Completion {
    id: Option<String>,
    #[serde(default)]
    choices: Vec<Choice>,
    usage: Option<Value>,
}

#[derive(Deserialize)]
struct Choice {
    message: Message,
}

#[derive(Deserialize)]
struct Message {
    content: Option<String>,
}

/// An HTTP client for one provider.
#[derive(Clone, Debug)]
pub struct Client {
    http: reqwest::Client,
    provider: Provider,
}

impl Client {
    /// A client for `provider`, with its timeout as the whole call's limit.
    pub fn new(provider: Provider) -> Client {
        let http = reqwest::Client::builder()
            .timeout(provider.timeout)
            .connect_timeout(provider.timeout.min(Duration::from_secs(10)))
            .pool_max_idle_per_host(provider.concurrency as usize)
            .build()
            .unwrap_or_default();
        Client { http, provider }
    }

    /// The provider.
    pub fn provider(&self) -> &Provider {
        &self.provider
    }

    /// Calls `POST {base_url}/chat/completions` with the rendered messages, sending
    /// the attempt id as `Idempotency-Key` so a provider that honours it never does
    /// the same attempt twice.
    pub async fn complete(
        &self,
        attempt: AttemptId,
        operation: &Operation,
        rendered: &Rendered,
    ) -> Result<Answer, CallError> {
        let url = self
            .provider
            .base_url
            .join("chat/completions")
            .map_err(|e| CallError::Refused(format!("bad url: {e}")))?;
        let body = json!({
            "model": self.provider.model,
            "temperature": operation.temperature,
            "messages": [
                { "role": "system", "content": rendered.system },
                { "role": "user", "content": rendered.user },
            ],
        });
        let mut request = self
            .http
            .post(url)
            .header("Idempotency-Key", attempt.to_string())
            .json(&body);
        if let Some(env) = &self.provider.api_key_env {
            match std::env::var(env) {
                Ok(key) => request = request.bearer_auth(key),
                Err(_) => {
                    return Err(CallError::Refused(format!(
                        "environment variable {env} (api_key_env of provider {}) is not set",
                        self.provider.name
                    )));
                }
            }
        }
        let response = request.send().await.map_err(classify)?;
        let status = response.status();
        let retry_after = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        // Losing the connection while reading the body is after sending: unknown.
        let bytes = response.bytes().await.map_err(classify)?;
        if !status.is_success() {
            let usage = serde_json::from_slice::<Completion>(&bytes)
                .ok()
                .and_then(|c| c.usage);
            return Err(CallError::Rejected {
                message: format!("HTTP {}: {}", status.as_u16(), excerpt(&bytes)),
                retry_after,
                usage,
            });
        }
        let completion: Completion =
            serde_json::from_slice(&bytes).map_err(|e| CallError::Rejected {
                message: format!("malformed completion ({e}): {}", excerpt(&bytes)),
                retry_after: None,
                usage: None,
            })?;
        let content = completion
            .choices
            .into_iter()
            .next()
            .and_then(|c| c.message.content)
            .ok_or_else(|| CallError::Rejected {
                message: "completion has no message content".into(),
                retry_after: None,
                usage: completion.usage.clone(),
            })?;
        Ok(Answer {
            content,
            request_id: completion.id,
            usage: completion.usage,
        })
    }
}

/// The dispatch phase decides: a connect error never reached the provider.
fn classify(e: reqwest::Error) -> CallError {
    if e.is_connect() {
        CallError::Refused(without_url(&e))
    } else if e.is_timeout() {
        CallError::Unknown(format!(
            "timed out after the request was sent: {}",
            without_url(&e)
        ))
    } else if e.is_builder() {
        CallError::Refused(without_url(&e))
    } else {
        CallError::Unknown(format!(
            "connection lost after the request was sent: {}",
            without_url(&e)
        ))
    }
}

/// reqwest errors name the URL; providers' URLs may carry tokens in query strings.
fn without_url(e: &reqwest::Error) -> String {
    let mut text = e.to_string();
    if let Some(url) = e.url() {
        text = text.replace(url.as_str(), "<provider url>");
    }
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

fn excerpt(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let mut out: String = text.chars().take(200).collect();
    if text.chars().count() > 200 {
        out.push('…');
    }
    out
}
