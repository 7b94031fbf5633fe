//! Calling AI-inference providers.
//!
//! What matters most here is the dispatch phase. A call refused before the request
//! left (connection refused, DNS failure) is a definite failure: the provider never
//! saw it. A call that timed out or lost its connection after the request was sent
//! is `unknown`: the provider may still be working, and may still charge for it.

use std::time::Duration;

use serde::Deserialize;
use serde_json::{Value, json};

use crate::config::{EvidenceKind, Operation, Provider, Rendered};
use crate::domain::{AttemptId, JobId};
use crate::store::{Finished, Verdict};
use crate::trace::TraceContext;

/// An answer from the provider.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Answer {
    /// The assistant message's content.
    pub(crate) content: String,
    /// The provider's response id.
    pub(crate) request_id: Option<String>,
    /// What the provider reported it spent.
    pub(crate) usage: Option<Value>,
}

/// Why a call gave no answer.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub(crate) enum CallError {
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
pub(crate) struct Client {
    http: reqwest::Client,
    provider: Provider,
}

impl Client {
    /// A client for `provider`, with its timeout as the whole call's limit. Fails
    /// (rather than fall back to a client without that timeout) when the HTTP
    /// stack cannot be set up.
    pub(crate) fn new(provider: Provider) -> Result<Client, CallError> {
        let http = reqwest::Client::builder()
            // A redirect would re-send the prompt (tenant data) wherever the
            // provider's answer points, across schemes too: none is followed,
            // and a 3xx answer is a definite failure like any other error.
            .redirect(reqwest::redirect::Policy::none())
            .timeout(provider.timeout)
            .connect_timeout(provider.timeout.min(Duration::from_secs(10)))
            .pool_max_idle_per_host(provider.concurrency as usize)
            .build()
            .map_err(|e| {
                CallError::Refused(format!(
                    "cannot set up the HTTP client of provider {}: {}",
                    provider.name,
                    without_url(&e)
                ))
            })?;
        Ok(Client { http, provider })
    }

    /// The provider.
    pub(crate) fn provider(&self) -> &Provider {
        &self.provider
    }

    /// Calls `POST {base_url}/chat/completions` with the rendered messages, sending
    /// the attempt id in the provider's `idempotency_header` so a provider that
    /// honours it never does the same attempt twice. A provider whose evidence
    /// is `stored` is asked to store the call, with the attempt (and its job,
    /// when it has one) as metadata, so that an unknown call can be found.
    /// A call made for a job carries the job's trace context (`traceparent`,
    /// `tracestate`), naming the attempt's span as the parent.
    pub(crate) async fn complete(
        &self,
        attempt: AttemptId,
        job: Option<JobId>,
        trace: Option<&TraceContext>,
        operation: &Operation,
        rendered: &Rendered,
    ) -> Result<Answer, CallError> {
        let url = self
            .provider
            .base_url
            .join("chat/completions")
            .map_err(|e| CallError::Refused(format!("bad url: {e}")))?;
        let mut body = json!({
            "model": self.provider.model,
            "temperature": operation.temperature,
            "max_tokens": operation.max_tokens,
            "messages": [
                { "role": "system", "content": rendered.system },
                { "role": "user", "content": rendered.user },
            ],
        });
        if self.provider.evidence.kind == EvidenceKind::Stored {
            body["store"] = json!(true);
            body["metadata"] = evidence_metadata(attempt, job);
        }
        let mut request = self
            .http
            .post(url)
            .header(
                self.provider.idempotency_header.clone(),
                attempt.to_string(),
            )
            .json(&body);
        if let Some(trace) = trace {
            request = request.header(crate::trace::TRACEPARENT, trace.traceparent());
            if let Some(state) = &trace.state {
                request = request.header(crate::trace::TRACESTATE, state);
            }
        }
        let mut response = self.authorized(request)?.send().await.map_err(classify)?;
        let status = response.status();
        let retry_after = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(|secs| Duration::from_secs(secs).min(self.provider.max_retry_after));
        // Read at most `max_response_bytes`: a provider cannot make a worker hold
        // more. Losing the connection while reading the body is after sending:
        // unknown.
        let limit = self.provider.max_response_bytes;
        let mut bytes = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(classify)? {
            if bytes.len() + chunk.len() > limit {
                // A proxy's timeout page can be large: it is still `unknown`, judged
                // on what was read.
                if self.provider.unknown_statuses.contains(&status.as_u16()) {
                    break;
                }
                return Err(CallError::Rejected {
                    message: format!(
                        "answer_too_large: HTTP {} with a body over max_response_bytes ({limit} bytes)",
                        status.as_u16()
                    ),
                    retry_after: None,
                    usage: None,
                });
            }
            bytes.extend_from_slice(&chunk);
        }
        judge(&self.provider, status.as_u16(), retry_after, &bytes)
    }

    /// The request with the provider's API key, if it has one.
    fn authorized(
        &self,
        request: reqwest::RequestBuilder,
    ) -> Result<reqwest::RequestBuilder, CallError> {
        let Some(env) = &self.provider.api_key_env else {
            return Ok(request);
        };
        match std::env::var(env) {
            Ok(key) => Ok(request.bearer_auth(key)),
            Err(_) => Err(CallError::Refused(format!(
                "environment variable {env} (api_key_env of provider {}) is not set",
                self.provider.name
            ))),
        }
    }

    /// What the provider stored of `attempt`'s call (`evidence = "stored"`):
    /// its completions listed by the attempt's metadata, page after page
    /// (`limit`, `after`, until `has_more` is false), and one taken only if
    /// its metadata names this attempt of this job (of no job: a
    /// qualification's call). `Ok(None)` only when the whole listing was read
    /// and none is stored; `Some` holds the completion judged as a live
    /// answer is; `Err` when the provider could not be asked, or the listing
    /// could not be read to its end (look again later).
    pub(crate) async fn stored(
        &self,
        attempt: AttemptId,
        job: Option<JobId>,
    ) -> Result<Option<Result<Answer, CallError>>, String> {
        let want = evidence_metadata(attempt, job);
        let mut after: Option<String> = None;
        for _ in 0..MAX_LIST_PAGES {
            let page = self.stored_page(attempt, after.as_deref()).await?;
            let found = page["data"].as_array().into_iter().flatten().find(|c| {
                c["metadata"]["onejob_attempt"] == want["onejob_attempt"]
                    && c["metadata"]["onejob_job"] == want["onejob_job"]
            });
            if let Some(c) = found {
                let body = serde_json::to_vec(c).unwrap_or_default();
                return Ok(Some(judge(&self.provider, 200, None, &body)));
            }
            match page["has_more"] {
                Value::Bool(false) => return Ok(None),
                Value::Bool(true) => {}
                _ => {
                    return Err(
                        "the list of stored completions says no has_more: whether it was read to its end is not known"
                            .into(),
                    );
                }
            }
            let next = page["last_id"]
                .as_str()
                .or_else(|| page["data"].as_array()?.last()?["id"].as_str())
                .filter(|id| after.as_deref() != Some(*id))
                .ok_or(
                    "the list of stored completions has more, but names no last_id to go on after",
                )?;
            after = Some(next.to_owned());
        }
        Err(format!(
            "the list of stored completions runs past {MAX_LIST_PAGES} pages; not read to its end"
        ))
    }

    /// One page of `attempt`'s stored completions, after the completion
    /// `after` (the first page without).
    async fn stored_page(&self, attempt: AttemptId, after: Option<&str>) -> Result<Value, String> {
        let mut url = self
            .provider
            .base_url
            .join("chat/completions")
            .map_err(|e| format!("bad url: {e}"))?;
        {
            let mut query = url.query_pairs_mut();
            query
                .append_pair("metadata[onejob_attempt]", &attempt.to_string())
                .append_pair("limit", &LIST_PAGE.to_string());
            if let Some(after) = after {
                query.append_pair("after", after);
            }
        }
        let request = self
            .authorized(self.http.get(url))
            .map_err(|e| e.to_string())?;
        let mut response = request.send().await.map_err(|e| without_url(&e))?;
        let status = response.status();
        if !status.is_success() {
            return Err(format!(
                "listing stored completions answered HTTP {}",
                status.as_u16()
            ));
        }
        let mut bytes = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(|e| without_url(&e))? {
            if bytes.len() + chunk.len() > self.provider.max_response_bytes {
                return Err("the list of stored completions is over max_response_bytes".into());
            }
            bytes.extend_from_slice(&chunk);
        }
        serde_json::from_slice(&bytes)
            .map_err(|e| format!("the list of stored completions is not JSON: {e}"))
    }
}

/// Stored completions asked for in one page of a listing (OpenAI's most).
const LIST_PAGE: usize = 100;
/// Pages of one listing read at most: past them the listing is not read to
/// its end, and nothing is concluded from it.
const MAX_LIST_PAGES: usize = 20;

/// The verdict on a provider's answer: a success only when the output meets
/// the operation's contract; the provider's usage and request id are kept
/// whatever the verdict.
pub(crate) fn verdict(
    operation: &Operation,
    answer: std::result::Result<Answer, CallError>,
    finished: &mut Finished,
) -> Verdict {
    match answer {
        Ok(answer) => {
            finished.provider_request_id = answer.request_id;
            finished.usage = answer.usage;
            match operation.check_output(&answer.content) {
                Ok(value) => Verdict::Succeeded(value),
                Err(violation) => Verdict::Failed {
                    error: violation.to_string(),
                    retryable: true,
                    retry_after: None,
                },
            }
        }
        Err(CallError::Unknown(e)) => Verdict::Unknown {
            error: format!("outcome_unknown: {e}"),
        },
        Err(e @ CallError::Refused(_)) => Verdict::Failed {
            error: e.to_string(),
            retryable: true,
            retry_after: None,
        },
        Err(e @ CallError::Rejected { .. }) => {
            let mut wait = None;
            if let CallError::Rejected {
                usage, retry_after, ..
            } = &e
            {
                finished.usage = usage.clone();
                wait = *retry_after;
            }
            Verdict::Failed {
                error: e.to_string(),
                retryable: true,
                retry_after: wait,
            }
        }
    }
}

/// The metadata a stored call carries (contract section 7, Evidence): the
/// attempt, and its job when it has one (a qualification run's calls have
/// none).
pub(crate) fn evidence_metadata(attempt: AttemptId, job: Option<JobId>) -> Value {
    let mut metadata = json!({ "onejob_attempt": attempt.to_string() });
    if let Some(job) = job {
        metadata["onejob_job"] = json!(job.to_string());
    }
    metadata
}

/// Judges an HTTP answer. Everything taken from it is made storable first:
/// Postgres refuses NUL in text and in `jsonb`, and a refused write would leave
/// the attempt's outcome unknown. Text kept for people (error excerpts, request
/// ids, usage) has NUL replaced; a result holding NUL breaks the output contract.
fn judge(
    provider: &Provider,
    status: u16,
    retry_after: Option<Duration>,
    bytes: &[u8],
) -> Result<Answer, CallError> {
    if provider.unknown_statuses.contains(&status) {
        return Err(CallError::Unknown(format!(
            "HTTP {status}: a proxy forwarded the request and stopped waiting for it: {}",
            excerpt(bytes)
        )));
    }
    if !(200..300).contains(&status) {
        let usage = serde_json::from_slice::<Completion>(bytes)
            .ok()
            .and_then(|c| c.usage)
            .map(storable_json);
        return Err(CallError::Rejected {
            message: format!("HTTP {status}: {}", excerpt(bytes)),
            retry_after,
            usage,
        });
    }
    let completion: Completion =
        serde_json::from_slice(bytes).map_err(|e| CallError::Rejected {
            message: format!("malformed completion ({e}): {}", excerpt(bytes)),
            retry_after: None,
            usage: None,
        })?;
    let usage = completion.usage.map(storable_json);
    let content = completion
        .choices
        .into_iter()
        .next()
        .and_then(|c| c.message.content)
        .ok_or_else(|| CallError::Rejected {
            message: "completion has no message content".into(),
            retry_after: None,
            usage: usage.clone(),
        })?;
    Ok(Answer {
        content,
        request_id: completion.id.map(|id| request_id(&id)),
        usage,
    })
}

/// Text as Postgres can store it: NUL, which `text` and `jsonb` refuse, becomes
/// U+FFFD.
pub(crate) fn storable(text: &str) -> String {
    text.replace('\0', "\u{FFFD}")
}

/// A provider's diagnostic text (an error excerpt) as onejob keeps it:
/// storable, and with every other control character escaped (`\u{1b}`), so
/// that no provider can clear an operator's screen, write their clipboard
/// (OSC 52) or forge a log line wherever the text is shown or logged.
pub(crate) fn shown(text: &str) -> String {
    crate::broker::escape_controls(&storable(text))
}

/// The longest provider request id kept, in characters.
const REQUEST_ID_CHARS: usize = 255;

/// A provider's response id as onejob keeps it: [`shown`], and at most
/// [`REQUEST_ID_CHARS`] characters.
fn request_id(id: &str) -> String {
    shown(id).chars().take(REQUEST_ID_CHARS).collect()
}

/// A JSON value as Postgres can store it in `jsonb`: NUL in any string or key
/// becomes U+FFFD.
pub(crate) fn storable_json(value: Value) -> Value {
    match value {
        Value::String(s) if s.contains('\0') => Value::String(storable(&s)),
        Value::Array(items) => Value::Array(items.into_iter().map(storable_json).collect()),
        Value::Object(map) => Value::Object(
            map.into_iter()
                .map(|(k, v)| (storable(&k), storable_json(v)))
                .collect(),
        ),
        other => other,
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
    shown(&text)
}

fn excerpt(bytes: &[u8]) -> String {
    let text = shown(&String::from_utf8_lossy(bytes));
    let mut out: String = text.chars().take(200).collect();
    if text.chars().count() > 200 {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::intent::has_nul;

    fn provider() -> Provider {
        crate::config::Config::parse(crate::config::EMBEDDED_DEFAULT, "t")
            .unwrap()
            .providers["primary"]
            .clone()
    }

    #[test]
    fn proxy_timeouts_are_unknown_and_settable() {
        let mut p = provider();
        for status in [504, 524] {
            let e = judge(&p, status, None, b"gateway timeout").unwrap_err();
            assert!(matches!(e, CallError::Unknown(_)), "{status}: {e}");
        }
        assert!(matches!(
            judge(&p, 502, None, b"bad gateway"),
            Err(CallError::Rejected { .. })
        ));
        p.unknown_statuses = vec![502];
        assert!(matches!(
            judge(&p, 502, None, b""),
            Err(CallError::Unknown(_))
        ));
        assert!(matches!(
            judge(&p, 504, None, b""),
            Err(CallError::Rejected { .. })
        ));
    }

    #[test]
    fn nothing_unstorable_leaves_the_judge() {
        let p = provider();
        let e = judge(&p, 500, None, b"bad\0byte").unwrap_err().to_string();
        assert!(!e.contains('\0') && e.contains("bad\u{FFFD}byte"), "{e}");
        let body = json!({
            "id": "req\u{0}1",
            "choices": [{"message": {"content": "{}"}}],
            "usage": {"k\u{0}": ["v\u{0}"]},
        });
        let answer = judge(&p, 200, None, body.to_string().as_bytes()).unwrap();
        assert_eq!(answer.request_id.as_deref(), Some("req\u{FFFD}1"));
        let usage = answer.usage.unwrap();
        assert!(!has_nul(&usage), "{usage}");
        assert_eq!(usage, json!({"k\u{FFFD}": ["v\u{FFFD}"]}));
        assert!(has_nul(&json!({"a": [1, {"b\u{0}": 2}]})));
        assert!(!has_nul(&json!({"a": "\\u0000 spelled out"})));
    }

    #[test]
    fn provider_text_reaches_no_terminal_or_log_raw_and_its_request_id_is_bounded() {
        let p = provider();
        let hostile = "x\u{1b}]52;c;aGk=\u{7}\u{1b}[2J\r\nINFO forged line";
        let e = judge(&p, 500, None, hostile.as_bytes())
            .unwrap_err()
            .to_string();
        assert!(!e.chars().any(char::is_control), "{e:?}");
        assert!(
            e.contains("\\u{1b}]52") && e.contains("\\u{a}INFO forged line"),
            "{e}"
        );
        let body = json!({
            "id": format!("{hostile}{}", "i".repeat(10_000)),
            "choices": [{"message": {"content": "{}"}}],
        });
        let answer = judge(&p, 200, None, body.to_string().as_bytes()).unwrap();
        let id = answer.request_id.unwrap();
        assert!(!id.chars().any(char::is_control), "{id:?}");
        assert_eq!(id.chars().count(), 255);
    }
}
