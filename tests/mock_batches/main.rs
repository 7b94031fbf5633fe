//! The mock's batch APIs over real HTTP: OpenAI's Files and Batches
//! (`openai`) and Anthropic's Message Batches (`anthropic`). Each case
//! starts a mock of its own, with directives on, and reads what a client of
//! the real API would: the batch's status, its counts, and each line's
//! result by its `custom_id`.

mod anthropic;
mod openai;

use std::time::Duration;

use onejob::mock::{MockHandle, MockOptions};
use serde_json::Value;

/// A mock with directives on, on a free port.
async fn mock() -> MockHandle {
    onejob::mock::start(
        "127.0.0.1:0".parse().expect("an address"),
        MockOptions {
            directives: true,
            ..MockOptions::default()
        },
    )
    .await
    .expect("start the mock")
}

/// Reads `url` until `ended` says the batch it returns has ended, or fails
/// after 10 s; the last batch read.
async fn until_ended(
    read: impl Fn() -> reqwest::RequestBuilder,
    ended: impl Fn(&Value) -> bool,
) -> Value {
    let began = std::time::Instant::now();
    loop {
        let batch: Value = read()
            .send()
            .await
            .expect("read the batch")
            .json()
            .await
            .expect("a batch");
        if ended(&batch) {
            return batch;
        }
        assert!(
            began.elapsed() < Duration::from_secs(10),
            "the batch did not end: {batch}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// JSONL, a value a line.
fn lines(text: &str) -> Vec<Value> {
    text.lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

/// Waits until `n` batch lines have begun their work (10 s at most).
async fn lines_begun(provider: &MockHandle, n: u64) {
    let began = std::time::Instant::now();
    while provider.stats.batch_work() < n {
        assert!(
            began.elapsed() < Duration::from_secs(10),
            "{n} lines did not begin"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Every batch id a listing gives, newest first, page after page:
/// `page(None)` asks for the first page, `page(Some(last_id))` for the one
/// after.
async fn listed_ids(page: impl Fn(Option<&str>) -> reqwest::RequestBuilder) -> Vec<Value> {
    let (mut seen, mut after) = (Vec::new(), None::<String>);
    loop {
        let listed: Value = page(after.as_deref())
            .send()
            .await
            .expect("list")
            .json()
            .await
            .expect("a page");
        let data = listed["data"].as_array().expect("a page's data");
        seen.extend(data.iter().map(|b| b["id"].clone()));
        if listed["has_more"] != true {
            return seen;
        }
        after = listed["last_id"].as_str().map(str::to_owned);
    }
}
