//! The batch conformance suite: the same cases for every kind's batch API,
//! run against the bundled mock over real HTTP, with the same expected
//! outcome. A kind's batches are done when `batch_conformance!` runs for it
//! and passes.

use std::time::{Duration, Instant};

use super::{BatchClient, LineResult, Outcome, State};
use crate::domain::AttemptId;
use crate::edges::provider::answer::{CallError, verdict};
use crate::edges::provider::conformance::client_for;
use crate::edges::store::{Finished, Verdict};
use crate::mock::{MockHandle, MockOptions};
use crate::settings::config::{Operation, ProviderKind, Rendered};

/// A mock obeying directives, and a batch client of `kind` for it.
async fn provider(kind: ProviderKind) -> (MockHandle, BatchClient, Operation) {
    let mock = crate::mock::start(
        "127.0.0.1:0".parse().unwrap(),
        MockOptions {
            directives: true,
            ..MockOptions::default()
        },
    )
    .await
    .unwrap();
    let (client, operation) = client_for(kind, &mock.base_url(), "");
    let batches = BatchClient::new(client.provider().clone()).unwrap();
    (mock, batches, operation)
}

/// Sends a batch of one line per text, named `name`; the attempts in order
/// and the provider's batch id.
async fn submit(
    client: &BatchClient,
    operation: &Operation,
    name: &str,
    texts: &[&str],
) -> (Vec<AttemptId>, String) {
    let attempts: Vec<AttemptId> = texts.iter().map(|_| AttemptId::new()).collect();
    let lines: Vec<super::Line> = attempts
        .iter()
        .zip(texts)
        .map(|(a, text)| {
            let rendered = Rendered {
                system: "Answer with one JSON object only.".into(),
                user: format!("Summarize: {text}"),
            };
            client.line(*a, operation, &rendered)
        })
        .collect();
    let id = client.submit(name, &lines).await.unwrap();
    (attempts, id)
}

/// Reads batch `id`'s state until it has ended (10 s at most); its results.
async fn ended(client: &BatchClient, id: &str) -> Vec<LineResult> {
    let began = Instant::now();
    while client.state(id).await.unwrap() != State::Ended {
        assert!(
            began.elapsed() < Duration::from_secs(10),
            "batch {id} did not end"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    client.results(id).await.unwrap()
}

/// Each result's attempt (by its position in `attempts`) and what it came
/// to: `answer`, `rejected`, `expired` or `cancelled`.
fn told(attempts: &[AttemptId], results: &[LineResult]) -> Vec<(usize, &'static str)> {
    results
        .iter()
        .map(|r| {
            let at = attempts
                .iter()
                .position(|a| a.to_string() == r.custom_id)
                .unwrap_or(usize::MAX);
            let what = match &r.outcome {
                Outcome::Ran(Ok(_)) => "answer",
                Outcome::Ran(Err(CallError::Rejected { .. })) => "rejected",
                Outcome::Ran(Err(_)) => "other",
                Outcome::Expired => "expired",
                Outcome::Cancelled => "cancelled",
            };
            (at, what)
        })
        .collect()
}

pub(super) async fn each_line_is_judged_as_a_live_answer(kind: ProviderKind) {
    let (mock, client, operation) = provider(kind).await;
    let (attempts, id) = submit(
        &client,
        &operation,
        "b-judged",
        &["one two", "mock:status=400", "mock:prose", "mock:pad=5000"],
    )
    .await;
    let mut results = ended(&client, &id).await;
    results.sort_by_key(|r| attempts.iter().position(|a| a.to_string() == r.custom_id));
    assert_eq!(
        told(&attempts, &results),
        [
            (0, "answer"),
            (1, "rejected"),
            (2, "answer"),
            (3, "rejected")
        ]
    );
    // An answer keeps its usage and id, and meets the output contract.
    let Outcome::Ran(answer) = results[0].outcome.clone() else {
        unreachable!()
    };
    let answer_id = answer.as_ref().unwrap().request_id.clone().unwrap();
    let mut finished = Finished::blank();
    let v = verdict(&operation, answer, &mut finished);
    assert!(matches!(v, Verdict::Succeeded(_)), "{v:?}");
    assert!(finished.usage.is_some());
    assert_eq!(finished.provider_request_id, Some(answer_id));
    // Prose breaks the output contract, as a live prose answer does.
    let Outcome::Ran(prose) = results[2].outcome.clone() else {
        unreachable!()
    };
    let v = verdict(&operation, prose, &mut Finished::blank());
    assert!(
        matches!(
            v,
            Verdict::Failed {
                retryable: true,
                ..
            }
        ),
        "{v:?}"
    );
    // An error line says its status; an answer over max_response_bytes is
    // refused as a live one is.
    let rejected = |r: &LineResult| match &r.outcome {
        Outcome::Ran(Err(CallError::Rejected { message, .. })) => message.clone(),
        other => panic!("{other:?}"),
    };
    assert!(rejected(&results[1]).starts_with("HTTP 400"), "{results:?}");
    assert!(
        rejected(&results[3]).starts_with("answer_too_large"),
        "{results:?}"
    );
    assert_eq!(mock.stats.batch_work(), 4);
}

pub(super) async fn an_expired_batch_tells_what_ran_and_what_did_not(kind: ProviderKind) {
    let (mock, client, operation) = provider(kind).await;
    let texts = ["one", "mock:expire", "three"];
    let (attempts, id) = submit(&client, &operation, "b-expired", &texts).await;
    let results = ended(&client, &id).await;
    assert_eq!(
        told(&attempts, &results),
        [(0, "answer"), (1, "expired"), (2, "expired")]
    );
    assert_eq!(mock.stats.batch_work(), 1);
}

pub(super) async fn a_cancelled_batch_ends_what_it_had_not_run(kind: ProviderKind) {
    let (mock, client, operation) = provider(kind).await;
    let texts = ["mock:delay=300", "two", "three"];
    let (attempts, id) = submit(&client, &operation, "b-cancelled", &texts).await;
    let began = Instant::now();
    while mock.stats.batch_work() < 1 {
        assert!(began.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    client.cancel(&id).await.unwrap();
    let results = ended(&client, &id).await;
    assert_eq!(
        told(&attempts, &results),
        [(0, "answer"), (1, "cancelled"), (2, "cancelled")]
    );
    // Cancelling an ended batch asks nothing more of it.
    client.cancel(&id).await.unwrap();
}

pub(super) async fn a_result_given_twice_is_returned_twice(kind: ProviderKind) {
    let (_mock, client, operation) = provider(kind).await;
    let texts = ["mock:duplicate", "two"];
    let (attempts, id) = submit(&client, &operation, "b-twice", &texts).await;
    let results = ended(&client, &id).await;
    assert_eq!(
        told(&attempts, &results),
        [(0, "answer"), (0, "answer"), (1, "answer")]
    );
}

pub(super) async fn a_status_read_past_the_timeout_is_unknown(kind: ProviderKind) {
    let (_mock, client, operation) = provider(kind).await;
    let (_, id) = submit(&client, &operation, "b-slow", &["mock:slow_status=3000"]).await;
    // The provider's timeout is 2 s.
    let read = client.state(&id).await;
    assert!(matches!(read, Err(CallError::Unknown(_))), "{read:?}");
}

pub(super) async fn an_unreachable_provider_is_refused_before_sending(kind: ProviderKind) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let (client, operation) = client_for(kind, &format!("http://127.0.0.1:{port}/v1"), "");
    let client = BatchClient::new(client.provider().clone()).unwrap();
    let rendered = Rendered {
        system: String::new(),
        user: "one".into(),
    };
    let line = client.line(AttemptId::new(), &operation, &rendered);
    let sent = client.submit("b-refused", &[line]).await;
    assert!(matches!(sent, Err(CallError::Refused(_))), "{sent:?}");
}

pub(super) async fn a_lost_creation_is_found_by_its_name_or_not_guessed(kind: ProviderKind) {
    let (_mock, client, operation) = provider(kind).await;
    let (_, id) = submit(&client, &operation, "b-lost", &["one"]).await;
    for other in ["b-other-1", "b-other-2"] {
        submit(&client, &operation, other, &["x"]).await;
    }
    match kind {
        ProviderKind::OpenAi => {
            assert_eq!(client.find("b-lost").await.unwrap(), Some(id));
            assert_eq!(client.find("b-never-sent").await.unwrap(), None);
        }
        ProviderKind::Anthropic => {
            let found = client.find("b-lost").await;
            assert!(matches!(found, Err(CallError::Refused(_))), "{found:?}");
        }
    }
}

macro_rules! batch_conformance {
    ($name:ident, $kind:expr) => {
        mod $name {
            use crate::settings::config::ProviderKind;

            const KIND: ProviderKind = $kind;

            #[tokio::test]
            async fn each_line_is_judged_as_a_live_answer() {
                super::each_line_is_judged_as_a_live_answer(KIND).await
            }
            #[tokio::test]
            async fn an_expired_batch_tells_what_ran_and_what_did_not() {
                super::an_expired_batch_tells_what_ran_and_what_did_not(KIND).await
            }
            #[tokio::test]
            async fn a_cancelled_batch_ends_what_it_had_not_run() {
                super::a_cancelled_batch_ends_what_it_had_not_run(KIND).await
            }
            #[tokio::test]
            async fn a_result_given_twice_is_returned_twice() {
                super::a_result_given_twice_is_returned_twice(KIND).await
            }
            #[tokio::test]
            async fn a_status_read_past_the_timeout_is_unknown() {
                super::a_status_read_past_the_timeout_is_unknown(KIND).await
            }
            #[tokio::test]
            async fn an_unreachable_provider_is_refused_before_sending() {
                super::an_unreachable_provider_is_refused_before_sending(KIND).await
            }
            #[tokio::test]
            async fn a_lost_creation_is_found_by_its_name_or_not_guessed() {
                super::a_lost_creation_is_found_by_its_name_or_not_guessed(KIND).await
            }
        }
    };
}

batch_conformance!(openai, ProviderKind::OpenAi);
batch_conformance!(anthropic, ProviderKind::Anthropic);
