//! Anthropic's Message Batches, as the mock serves them.

use serde_json::{Value, json};

use super::{lines, lines_begun, listed_ids, mock, until_ended};

/// A batch request asking to summarize `text`.
fn request(custom_id: &str, text: &str) -> Value {
    json!({
        "custom_id": custom_id,
        "params": {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": text}]},
    })
}

fn post(http: &reqwest::Client, url: String) -> reqwest::RequestBuilder {
    http.post(url).header("anthropic-version", "2023-06-01")
}

fn get(http: &reqwest::Client, url: String) -> reqwest::RequestBuilder {
    http.get(url).header("anthropic-version", "2023-06-01")
}

/// Creates a batch of `requests`; the answer.
async fn create(http: &reqwest::Client, base: &str, requests: Vec<Value>) -> reqwest::Response {
    post(http, format!("{base}/messages/batches"))
        .json(&json!({ "requests": requests }))
        .send()
        .await
        .expect("create")
}

/// Creates a batch, waits for it to end; the ended batch and its results.
async fn run(http: &reqwest::Client, base: &str, requests: Vec<Value>) -> (Value, Vec<Value>) {
    let created: Value = create(http, base, requests)
        .await
        .json()
        .await
        .expect("a batch");
    assert_eq!(created["type"], "message_batch");
    let id = created["id"].as_str().expect("an id").to_owned();
    let url = format!("{base}/messages/batches/{id}");
    let done = until_ended(
        || get(http, url.clone()),
        |b| b["processing_status"] == "ended",
    )
    .await;
    let results = get(http, format!("{url}/results"))
        .send()
        .await
        .expect("results")
        .text()
        .await
        .expect("their text");
    (done, lines(&results))
}

/// Each result's `custom_id` and type.
fn kinds(results: &[Value]) -> Vec<(String, String)> {
    results
        .iter()
        .map(|r| {
            let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
            (text(&r["custom_id"]), text(&r["result"]["type"]))
        })
        .collect()
}

#[tokio::test]
async fn a_batch_ends_each_request_once_in_the_messages_shape() {
    let provider = mock().await;
    let (http, base) = (reqwest::Client::new(), provider.base_url());
    let no_cap = json!({"custom_id": "m-4", "params": {"model": "m", "messages": [{"role": "user", "content": "x"}]}});
    let (done, results) = run(
        &http,
        &base,
        vec![
            request("m-1", "one"),
            request("m-2", "two mock:status=529"),
            request("m-3", "three"),
            no_cap,
        ],
    )
    .await;
    assert_eq!(
        done["request_counts"],
        json!({"processing": 0, "succeeded": 2, "errored": 2, "canceled": 0, "expired": 0})
    );
    assert!(done["results_url"].as_str().unwrap().ends_with("/results"));
    assert_eq!(
        kinds(&results),
        [
            ("m-1", "succeeded"),
            ("m-2", "errored"),
            ("m-3", "succeeded"),
            ("m-4", "errored")
        ]
        .map(|(a, b)| (a.to_owned(), b.to_owned()))
    );
    let message = &results[0]["result"]["message"];
    assert_eq!(message["type"], "message");
    assert!(message["usage"]["output_tokens"].as_u64().unwrap() > 0);
    assert_eq!(
        results[1]["result"]["error"]["error"]["type"],
        "overloaded_error"
    );
    assert_eq!(
        results[3]["result"]["error"]["error"]["type"],
        "invalid_request_error"
    );
    // The request that could not be read ran nothing.
    assert_eq!(provider.stats.batch_work(), 3);
}

#[tokio::test]
async fn expiry_cancel_and_duplicates_are_told_by_their_results() {
    let provider = mock().await;
    let (http, base) = (reqwest::Client::new(), provider.base_url());
    let (done, results) = run(
        &http,
        &base,
        vec![
            request("x-1", "one mock:duplicate"),
            request("x-2", "mock:expire"),
            request("x-3", "three"),
        ],
    )
    .await;
    assert_eq!(done["request_counts"]["expired"], 2);
    assert_eq!(
        kinds(&results),
        [
            ("x-1", "succeeded"),
            ("x-1", "succeeded"),
            ("x-2", "expired"),
            ("x-3", "expired")
        ]
        .map(|(a, b)| (a.to_owned(), b.to_owned()))
    );

    let created: Value = create(
        &http,
        &base,
        vec![request("c-1", "mock:delay=300"), request("c-2", "two")],
    )
    .await
    .json()
    .await
    .unwrap();
    let id = created["id"].as_str().unwrap();
    lines_begun(&provider, 2).await;
    let early = get(&http, format!("{base}/messages/batches/{id}/results"))
        .send()
        .await
        .unwrap();
    assert_eq!(early.status(), 409, "results before the batch ended");
    let canceling: Value = post(&http, format!("{base}/messages/batches/{id}/cancel"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(canceling["processing_status"], "canceling");
    assert!(canceling["cancel_initiated_at"].is_string());
    let url = format!("{base}/messages/batches/{id}");
    until_ended(
        || get(&http, url.clone()),
        |b| b["processing_status"] == "ended",
    )
    .await;
    let results = get(&http, format!("{url}/results"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(
        kinds(&lines(&results)),
        [("c-1", "succeeded"), ("c-2", "canceled")].map(|(a, b)| (a.to_owned(), b.to_owned()))
    );
}

#[tokio::test]
async fn bad_batches_are_refused_whole() {
    let provider = mock().await;
    let (http, base) = (reqwest::Client::new(), provider.base_url());
    let unversioned = http
        .post(format!("{base}/messages/batches"))
        .json(&json!({"requests": [request("a", "b")]}))
        .send()
        .await
        .unwrap();
    assert_eq!(unversioned.status(), 400);
    for requests in [
        vec![],
        vec![request("same", "a"), request("same", "b")],
        vec![request("has space", "a")],
        vec![request(&"x".repeat(65), "a")],
    ] {
        let refused = create(&http, &base, requests.clone()).await;
        assert_eq!(refused.status(), 400, "{requests:?}");
        let body: Value = refused.json().await.unwrap();
        assert_eq!(body["error"]["type"], "invalid_request_error");
    }
    let missing = get(&http, format!("{base}/messages/batches/msgbatch_nope"))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
    assert_eq!(provider.stats.batch_work(), 0);
}

#[tokio::test]
async fn a_slow_status_read_outlasts_a_short_timeout_and_listing_pages_newest_first() {
    let provider = mock().await;
    let (http, base) = (reqwest::Client::new(), provider.base_url());
    let mut made = Vec::new();
    for n in 0..3 {
        let text = if n == 0 { "mock:slow_status=2000" } else { "x" };
        let b: Value = create(&http, &base, vec![request(&format!("l-{n}"), text)])
            .await
            .json()
            .await
            .unwrap();
        made.push(b["id"].clone());
    }
    let slow = get(
        &http,
        format!("{base}/messages/batches/{}", made[0].as_str().unwrap()),
    )
    .timeout(std::time::Duration::from_millis(200))
    .send()
    .await;
    assert!(
        slow.is_err_and(|e| e.is_timeout()),
        "the status read was not slow"
    );
    let seen = listed_ids(|after| {
        let url = match after {
            Some(a) => format!("{base}/messages/batches?limit=2&after_id={a}"),
            None => format!("{base}/messages/batches?limit=2"),
        };
        get(&http, url)
    })
    .await;
    made.reverse();
    assert_eq!(seen, made);
}
