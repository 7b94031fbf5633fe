//! What a call came to: an answer, or why there is none, judged the same
//! for every kind (the kind only reads its body), and the verdict on it.

use std::time::Duration;

use serde_json::Value;

use super::wire::Wire;
use crate::edges::store::{Finished, Verdict};
use crate::settings::config::{Operation, Provider};

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

/// Judges an HTTP answer. Everything taken from it is made storable first:
/// Postgres refuses NUL in text and in `jsonb`, and a refused write would leave
/// the attempt's outcome unknown. Text kept for people (error excerpts, request
/// ids, usage) has NUL replaced; a result holding NUL breaks the output contract.
pub(super) fn judge(
    provider: &Provider,
    wire: &dyn Wire,
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
        return Err(CallError::Rejected {
            message: format!("HTTP {status}: {}", excerpt(bytes)),
            retry_after,
            usage: wire.error_usage(bytes).map(storable_json),
        });
    }
    let read = wire.read(bytes).map_err(|e| CallError::Rejected {
        message: format!("{e}: {}", excerpt(bytes)),
        retry_after: None,
        usage: None,
    })?;
    let usage = read.usage.map(storable_json);
    let content = read.content.ok_or_else(|| CallError::Rejected {
        message: "the answer has no message content".into(),
        retry_after: None,
        usage: usage.clone(),
    })?;
    Ok(Answer {
        content,
        request_id: read.id.map(|id| request_id(&id)),
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

/// At most 200 characters of an answer's body, shown.
pub(super) fn excerpt(bytes: &[u8]) -> String {
    let text = shown(&String::from_utf8_lossy(bytes));
    let mut out: String = text.chars().take(200).collect();
    if text.chars().count() > 200 {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::edges::provider::wire::openai::OpenAi;
    use crate::intent::has_nul;

    const OPENAI: OpenAi = OpenAi;

    fn provider() -> Provider {
        crate::settings::config::Config::parse(crate::settings::config::EMBEDDED_DEFAULT, "t")
            .unwrap()
            .providers["primary"]
            .clone()
    }

    #[test]
    fn proxy_timeouts_are_unknown_and_settable() {
        let mut p = provider();
        for status in [504, 524] {
            let e = judge(&p, &OPENAI, status, None, b"gateway timeout").unwrap_err();
            assert!(matches!(e, CallError::Unknown(_)), "{status}: {e}");
        }
        assert!(matches!(
            judge(&p, &OPENAI, 502, None, b"bad gateway"),
            Err(CallError::Rejected { .. })
        ));
        p.unknown_statuses = vec![502];
        assert!(matches!(
            judge(&p, &OPENAI, 502, None, b""),
            Err(CallError::Unknown(_))
        ));
        assert!(matches!(
            judge(&p, &OPENAI, 504, None, b""),
            Err(CallError::Rejected { .. })
        ));
    }

    #[test]
    fn nothing_unstorable_leaves_the_judge() {
        let p = provider();
        let e = judge(&p, &OPENAI, 500, None, b"bad\0byte")
            .unwrap_err()
            .to_string();
        assert!(!e.contains('\0') && e.contains("bad\u{FFFD}byte"), "{e}");
        let body = json!({
            "id": "req\u{0}1",
            "choices": [{"message": {"content": "{}"}}],
            "usage": {"k\u{0}": ["v\u{0}"]},
        });
        let answer = judge(&p, &OPENAI, 200, None, body.to_string().as_bytes()).unwrap();
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
        let e = judge(&p, &OPENAI, 500, None, hostile.as_bytes())
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
        let answer = judge(&p, &OPENAI, 200, None, body.to_string().as_bytes()).unwrap();
        let id = answer.request_id.unwrap();
        assert!(!id.chars().any(char::is_control), "{id:?}");
        assert_eq!(id.chars().count(), 255);
    }
}
