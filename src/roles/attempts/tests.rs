//! Judging answers and labelling settlements.

use crate::edges::provider::answer::verdict as judge;
use crate::edges::provider::answer::{Answer, CallError};
use crate::edges::store::{Finished, Verdict};
use crate::settings::config::{Config, Operation};

fn summarize() -> Operation {
    let config = Config::parse(
        crate::settings::config::EMBEDDED_DEFAULT,
        "embedded defaults",
    )
    .unwrap();
    config.operations["summarize"].clone()
}

fn answer(content: &str) -> Answer {
    Answer {
        content: content.into(),
        request_id: Some("chatcmpl-1".into()),
        usage: Some(serde_json::json!({"total_tokens": 9})),
    }
}

#[test]
fn only_an_answer_that_meets_the_contract_succeeds_and_usage_is_kept_either_way() {
    let op = summarize();
    let mut f = Finished::blank();
    let verdict = judge(&op, Ok(answer(r#"{"summary":"ok"}"#)), &mut f);
    assert_eq!(
        verdict,
        Verdict::Succeeded(serde_json::json!({"summary": "ok"}))
    );
    assert_eq!(f.provider_request_id.as_deref(), Some("chatcmpl-1"));
    let mut f = Finished::blank();
    let verdict = judge(&op, Ok(answer("Sure! Here is a summary.")), &mut f);
    assert!(
        matches!(&verdict, Verdict::Failed { retryable: true, retry_after: None, error } if error.starts_with("contract_violation")),
        "{verdict:?}"
    );
    assert_eq!(f.usage, Some(serde_json::json!({"total_tokens": 9})));
}

#[test]
fn errors_are_definite_failures_and_timeouts_are_unknown() {
    let op = summarize();
    let mut f = Finished::blank();
    let rejected = CallError::Rejected {
        message: "HTTP 429".into(),
        retry_after: Some(std::time::Duration::from_secs(7)),
        usage: Some(serde_json::json!({"total_tokens": 1})),
    };
    assert_eq!(
        judge(&op, Err(rejected), &mut f),
        Verdict::Failed {
            error: "provider_error: HTTP 429".into(),
            retryable: true,
            retry_after: Some(std::time::Duration::from_secs(7)),
        }
    );
    assert_eq!(f.usage, Some(serde_json::json!({"total_tokens": 1})));
    let refused = judge(
        &op,
        Err(CallError::Refused("connect".into())),
        &mut Finished::blank(),
    );
    assert!(matches!(
        refused,
        Verdict::Failed {
            retry_after: None,
            retryable: true,
            ..
        }
    ));
    assert_eq!(
        judge(
            &op,
            Err(CallError::Unknown("timed out".into())),
            &mut Finished::blank()
        ),
        Verdict::Unknown {
            error: "outcome_unknown: timed out".into()
        }
    );
}
