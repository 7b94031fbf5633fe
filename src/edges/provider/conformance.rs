//! The conformance suite every kind of provider passes: the same cases, run
//! against the bundled mock over real HTTP in each kind's wire format, with
//! the same expected outcome. The transport keeps the guarantees; this suite
//! shows that no kind's wire format loses one. A new kind is done when
//! `conformance!` runs for it and passes.

use std::time::Duration;

use serde_json::Value;

use super::Client;
use super::answer::{Answer, CallError, verdict};
use crate::domain::{AttemptId, JobId};
use crate::edges::store::{Finished, Verdict};
use crate::mock::{MockHandle, MockOptions};
use crate::settings::config::{Config, Operation, ProviderKind, Rendered};

/// A mock obeying directives, and a client of `kind` for it, with `extra`
/// settings.
async fn provider(kind: ProviderKind, extra: &str) -> (MockHandle, Client, Operation) {
    let mock = crate::mock::start(
        "127.0.0.1:0".parse().unwrap(),
        MockOptions {
            directives: true,
            ..MockOptions::default()
        },
    )
    .await
    .unwrap();
    let (client, operation) = client_for(kind, &mock.base_url(), extra);
    (mock, client, operation)
}

/// A client of `kind` for `base_url`, and the operation it is asked for.
pub(super) fn client_for(kind: ProviderKind, base_url: &str, extra: &str) -> (Client, Operation) {
    let text = format!(
        r#"
[providers.p]
kind = "{}"
base_url = "{base_url}"
model = "mock-model"
timeout = "2s"
max_response_bytes = 4096
{extra}

[operations.summarize]
system = "Answer with one JSON object only."
prompt = "Summarize: {{{{ text }}}}"
output_schema = {{ type = "object", required = ["summary"], additionalProperties = false, properties = {{ summary = {{ type = "string" }} }} }}
route = ["p"]
max_tokens = 64
"#,
        kind.as_str()
    );
    let config = Config::parse(&text, "conformance").unwrap();
    let client = Client::new(config.providers["p"].clone()).unwrap();
    (client, config.operations["summarize"].clone())
}

/// Asks `client` to summarize `text`.
async fn call(client: &Client, operation: &Operation, text: &str) -> Result<Answer, CallError> {
    let rendered = Rendered {
        system: "Answer with one JSON object only.".into(),
        user: format!("Summarize: {text}"),
    };
    client
        .complete(
            AttemptId::new(),
            Some(JobId::new()),
            None,
            operation,
            &rendered,
        )
        .await
}

/// The tokens a usage report counts, as the spend ledger reads it (the
/// database's `usage_tokens`).
fn tokens(usage: &Value) -> u64 {
    usage["total_tokens"].as_u64().unwrap_or_else(|| {
        [
            "prompt_tokens",
            "completion_tokens",
            "input_tokens",
            "output_tokens",
            "cache_creation_input_tokens",
            "cache_read_input_tokens",
        ]
        .iter()
        .filter_map(|f| usage[f].as_u64())
        .sum()
    })
}

pub(super) async fn an_answer_is_judged_with_its_usage_and_id(kind: ProviderKind) {
    let (mock, client, operation) = provider(kind, "").await;
    let answer = call(&client, &operation, "one two three").await.unwrap();
    let value: Value = serde_json::from_str(&answer.content).unwrap();
    assert!(
        value["summary"].as_str().unwrap().contains("one two three"),
        "{answer:?}"
    );
    // The mock answered on the kind's own route (its ids say which).
    let prefix = match kind {
        ProviderKind::OpenAi => "chatcmpl-",
        ProviderKind::Anthropic => "msg_",
    };
    let id = answer.request_id.as_deref().unwrap_or_default();
    assert!(id.starts_with(prefix), "{answer:?}");
    // The mock counts the prompt's words and 12 answer tokens.
    let usage = answer.usage.clone().unwrap();
    assert_eq!(tokens(&usage), 6 + 4 + 12, "{usage}");
    let mut finished = Finished::blank();
    let v = verdict(&operation, Ok(answer), &mut finished);
    assert!(matches!(v, Verdict::Succeeded(_)), "{v:?}");
    assert_eq!(finished.usage, Some(usage));
    assert_eq!(mock.stats.uncapped(), 0, "max_tokens is always sent");
    assert_eq!(mock.stats.idempotency_keys().len(), 1, "the attempt's key");
}

pub(super) async fn the_api_key_is_sent_as_the_kind_sends_it(kind: ProviderKind) {
    // A variable every process has stands for the key: the suite sets none
    // (the environment is the whole process's).
    let key = std::env::var("PATH").unwrap();
    let (mock, client, operation) = provider(kind, "api_key_env = \"PATH\"").await;
    call(&client, &operation, "keyed").await.unwrap();
    let want = match kind {
        ProviderKind::OpenAi => format!("Bearer {key}"),
        ProviderKind::Anthropic => key,
    };
    assert_eq!(mock.stats.authorizations(), [want]);
    let unset = "ONEJOB_CONFORMANCE_NEVER_SET";
    let (client, operation) = client_for(
        kind,
        &mock.base_url(),
        &format!("api_key_env = \"{unset}\""),
    );
    let missing = call(&client, &operation, "keyed").await.unwrap_err();
    assert!(
        matches!(&missing, CallError::Refused(m) if m.contains(unset)),
        "{missing}"
    );
    assert_eq!(mock.stats.requests(), 1, "no call without its key");
}

pub(super) async fn each_error_class_is_definite_and_a_proxys_timeout_unknown(kind: ProviderKind) {
    let (_mock, client, operation) = provider(kind, "").await;
    for status in [400, 401, 403, 404, 409, 413, 422, 500, 502, 503, 529] {
        let e = call(&client, &operation, &format!("mock:status={status}"))
            .await
            .unwrap_err();
        match &e {
            CallError::Rejected { message, .. } => {
                assert!(message.starts_with(&format!("HTTP {status}: ")), "{e}")
            }
            other => panic!("{status}: {other}"),
        }
    }
    for status in [504, 524] {
        let e = call(&client, &operation, &format!("mock:status={status}"))
            .await
            .unwrap_err();
        assert!(matches!(e, CallError::Unknown(_)), "{status}: {e}");
    }
}

pub(super) async fn a_429_keeps_its_retry_after_capped(kind: ProviderKind) {
    let (_mock, client, operation) = provider(kind, "max_retry_after = \"30s\"").await;
    for (asked, kept) in [(7, 7), (3600, 30)] {
        let e = call(
            &client,
            &operation,
            &format!("mock:status=429 mock:retry_after={asked}"),
        )
        .await
        .unwrap_err();
        let CallError::Rejected { retry_after, .. } = e else {
            panic!("{e}");
        };
        assert_eq!(retry_after, Some(Duration::from_secs(kept)));
    }
}

pub(super) async fn refused_before_sending_is_definite_and_lost_after_is_unknown(
    kind: ProviderKind,
) {
    // Nothing listens: the request never left.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let (client, operation) = client_for(kind, &format!("http://127.0.0.1:{port}/v1"), "");
    let e = call(&client, &operation, "anyone").await.unwrap_err();
    assert!(matches!(e, CallError::Refused(_)), "{e}");
    // Sent, then no answer within the timeout; sent, then the body broke off.
    let (_mock, client, operation) = provider(kind, "").await;
    for text in ["mock:delay=4000", "mock:drop"] {
        let e = call(&client, &operation, text).await.unwrap_err();
        assert!(matches!(e, CallError::Unknown(_)), "{text}: {e}");
    }
}

pub(super) async fn a_redirect_is_not_followed(kind: ProviderKind) {
    let (mock, _, _) = provider(kind, "").await;
    let target = format!("{}/chat/completions", mock.base_url());
    let app = axum::Router::new().fallback(move || {
        let target = target.clone();
        async move { axum::response::Redirect::temporary(&target) }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let (client, operation) = client_for(kind, &format!("http://{addr}/v1"), "");
    let e = call(&client, &operation, "redirected").await.unwrap_err();
    assert!(
        matches!(&e, CallError::Rejected { message, .. } if message.starts_with("HTTP 307")),
        "{e}"
    );
    assert_eq!(mock.stats.requests(), 0, "the prompt went nowhere else");
    server.abort();
}

pub(super) async fn a_huge_answer_is_refused_unless_a_proxy_timed_out(kind: ProviderKind) {
    let (_mock, client, operation) = provider(kind, "").await;
    let e = call(&client, &operation, "mock:pad=100000")
        .await
        .unwrap_err();
    assert!(
        matches!(&e, CallError::Rejected { message, .. } if message.starts_with("answer_too_large")),
        "{e}"
    );
    let e = call(&client, &operation, "mock:status=504 mock:pad=100000")
        .await
        .unwrap_err();
    assert!(matches!(e, CallError::Unknown(_)), "{e}");
}

pub(super) async fn provider_text_is_made_storable_and_escaped(kind: ProviderKind) {
    let (_mock, client, operation) = provider(kind, "").await;
    // NUL in the answer, its id and its usage.
    let answer = call(&client, &operation, "mock:nul").await.unwrap();
    let id = answer.request_id.clone().unwrap();
    assert!(!id.contains('\0') && id.contains('\u{FFFD}'), "{id:?}");
    let usage = answer.usage.clone().unwrap().to_string();
    assert!(!usage.contains("\\u0000"), "{usage}");
    // The answer's own NUL breaks the output contract: failed, not stored raw.
    let v = verdict(&operation, Ok(answer), &mut Finished::blank());
    assert!(matches!(v, Verdict::Failed { .. }), "{v:?}");
    // An error body with a raw NUL byte and control characters.
    let e = call(&client, &operation, "mock:status=500 mock:nul")
        .await
        .unwrap_err()
        .to_string();
    assert!(!e.chars().any(char::is_control), "{e:?}");
    assert!(e.contains('\u{FFFD}'), "{e}");
}

pub(super) async fn an_answer_that_breaks_the_contract_fails(kind: ProviderKind) {
    let (_mock, client, operation) = provider(kind, "").await;
    for text in ["mock:prose", "mock:extra_key", "mock:wrong_type"] {
        let answer = call(&client, &operation, text).await.unwrap();
        assert!(answer.usage.is_some(), "{text}: usage kept");
        let v = verdict(&operation, Ok(answer), &mut Finished::blank());
        assert!(
            matches!(&v, Verdict::Failed { error, .. } if error.starts_with("contract_violation")),
            "{text}: {v:?}"
        );
    }
}

/// Runs every case of the suite for one kind, each as a test of its own.
macro_rules! conformance {
    ($name:ident, $kind:expr) => {
        mod $name {
            use crate::settings::config::ProviderKind;

            const KIND: ProviderKind = $kind;

            #[tokio::test]
            async fn an_answer_is_judged_with_its_usage_and_id() {
                super::an_answer_is_judged_with_its_usage_and_id(KIND).await
            }
            #[tokio::test]
            async fn the_api_key_is_sent_as_the_kind_sends_it() {
                super::the_api_key_is_sent_as_the_kind_sends_it(KIND).await
            }
            #[tokio::test]
            async fn each_error_class_is_definite_and_a_proxys_timeout_unknown() {
                super::each_error_class_is_definite_and_a_proxys_timeout_unknown(KIND).await
            }
            #[tokio::test]
            async fn a_429_keeps_its_retry_after_capped() {
                super::a_429_keeps_its_retry_after_capped(KIND).await
            }
            #[tokio::test]
            async fn refused_before_sending_is_definite_and_lost_after_is_unknown() {
                super::refused_before_sending_is_definite_and_lost_after_is_unknown(KIND).await
            }
            #[tokio::test]
            async fn a_redirect_is_not_followed() {
                super::a_redirect_is_not_followed(KIND).await
            }
            #[tokio::test]
            async fn a_huge_answer_is_refused_unless_a_proxy_timed_out() {
                super::a_huge_answer_is_refused_unless_a_proxy_timed_out(KIND).await
            }
            #[tokio::test]
            async fn provider_text_is_made_storable_and_escaped() {
                super::provider_text_is_made_storable_and_escaped(KIND).await
            }
            #[tokio::test]
            async fn an_answer_that_breaks_the_contract_fails() {
                super::an_answer_that_breaks_the_contract_fails(KIND).await
            }
        }
    };
}

conformance!(openai, ProviderKind::OpenAi);
conformance!(anthropic, ProviderKind::Anthropic);
