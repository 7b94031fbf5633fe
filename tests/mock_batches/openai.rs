//! OpenAI's Files and Batches, as the mock serves them.

use serde_json::{Value, json};

use super::{lines, lines_begun, listed_ids, mock, until_ended};

/// A batch input line asking to summarize `text`.
fn line(custom_id: &str, text: &str) -> String {
    json!({
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": text}]},
    })
    .to_string()
}

/// Uploads `jsonl` as a batch file; the file's id.
async fn upload(
    http: &reqwest::Client,
    base: &str,
    jsonl: String,
    purpose: &str,
) -> reqwest::Response {
    let form = reqwest::multipart::Form::new()
        .text("purpose", purpose.to_owned())
        .part(
            "file",
            reqwest::multipart::Part::bytes(jsonl.into_bytes()).file_name("in.jsonl"),
        );
    http.post(format!("{base}/files"))
        .multipart(form)
        .send()
        .await
        .expect("upload")
}

/// Uploads `rows` and creates a batch of them; the batch as created.
async fn batch(http: &reqwest::Client, base: &str, rows: &[String]) -> Value {
    let file: Value = upload(http, base, rows.join("\n"), "batch")
        .await
        .json()
        .await
        .expect("a file");
    assert_eq!(file["purpose"], "batch");
    http.post(format!("{base}/batches"))
        .json(&json!({
            "input_file_id": file["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            "metadata": {"onejob_batch": "b-1"},
        }))
        .send()
        .await
        .expect("create")
        .json()
        .await
        .expect("a batch")
}

/// Waits for batch `id` to end.
async fn ended(http: &reqwest::Client, base: &str, id: &Value) -> Value {
    let url = format!("{base}/batches/{}", id.as_str().expect("an id"));
    until_ended(
        || http.get(&url),
        |b| {
            ["completed", "expired", "cancelled", "failed"]
                .contains(&b["status"].as_str().unwrap_or(""))
        },
    )
    .await
}

/// The lines of file `id` (none when there is no such file).
async fn file_lines(http: &reqwest::Client, base: &str, id: &Value) -> Vec<Value> {
    let Some(id) = id.as_str() else {
        return Vec::new();
    };
    let text = http
        .get(format!("{base}/files/{id}/content"))
        .send()
        .await
        .expect("read a file")
        .text()
        .await
        .expect("its text");
    lines(&text)
}

#[tokio::test]
async fn a_batch_runs_each_line_once_and_writes_answers_and_errors_apart() {
    let provider = mock().await;
    let (http, base) = (reqwest::Client::new(), provider.base_url());
    let created = batch(
        &http,
        &base,
        &[
            line("a-1", "one"),
            line("a-2", "two mock:status=400"),
            line("a-3", "three"),
        ],
    )
    .await;
    assert_eq!(created["status"], "in_progress");
    assert_eq!(created["metadata"]["onejob_batch"], "b-1");
    let done = ended(&http, &base, &created["id"]).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(
        done["request_counts"],
        json!({"total": 3, "completed": 2, "failed": 1})
    );
    let output = file_lines(&http, &base, &done["output_file_id"]).await;
    let ids: Vec<&str> = output
        .iter()
        .filter_map(|l| l["custom_id"].as_str())
        .collect();
    assert_eq!(ids, ["a-1", "a-3"]);
    for l in &output {
        assert_eq!(l["response"]["status_code"], 200);
        let answer = &l["response"]["body"];
        assert!(
            answer["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .contains("mock answer")
        );
        assert!(answer["usage"]["total_tokens"].as_u64().unwrap() > 0);
        assert!(
            answer["id"]
                .as_str()
                .unwrap()
                .starts_with("chatcmpl-mock-batch-")
        );
    }
    let errors = file_lines(&http, &base, &done["error_file_id"]).await;
    assert_eq!(errors.len(), 1);
    assert_eq!(errors[0]["custom_id"], "a-2");
    assert_eq!(errors[0]["response"]["status_code"], 400);
    assert_eq!(provider.stats.batch_work(), 3);
    assert_eq!(provider.stats.batch_custom_ids(), ["a-1", "a-2", "a-3"]);
    // A batch is no live request.
    assert_eq!(provider.stats.requests(), 0);
}

#[tokio::test]
async fn an_expired_batch_keeps_what_ran_and_names_what_did_not() {
    let provider = mock().await;
    let (http, base) = (reqwest::Client::new(), provider.base_url());
    let rows = [
        line("e-1", "one"),
        line("e-2", "two mock:expire"),
        line("e-3", "three"),
    ];
    let created = batch(&http, &base, &rows).await;
    let done = ended(&http, &base, &created["id"]).await;
    assert_eq!(done["status"], "expired");
    assert!(done["expired_at"].is_number());
    let output = file_lines(&http, &base, &done["output_file_id"]).await;
    assert_eq!(output.len(), 1);
    assert_eq!(output[0]["custom_id"], "e-1");
    let errors = file_lines(&http, &base, &done["error_file_id"]).await;
    let expired: Vec<(&str, &str)> = errors
        .iter()
        .map(|l| {
            (
                l["custom_id"].as_str().unwrap(),
                l["error"]["code"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        expired,
        [("e-2", "batch_expired"), ("e-3", "batch_expired")]
    );
    assert_eq!(
        provider.stats.batch_work(),
        1,
        "only the line before the expiry ran"
    );
}

#[tokio::test]
async fn a_duplicated_result_is_written_twice_and_counted_once() {
    let provider = mock().await;
    let (http, base) = (reqwest::Client::new(), provider.base_url());
    let created = batch(
        &http,
        &base,
        &[line("d-1", "one mock:duplicate"), line("d-2", "two")],
    )
    .await;
    let done = ended(&http, &base, &created["id"]).await;
    assert_eq!(done["request_counts"]["completed"], 2);
    let output = file_lines(&http, &base, &done["output_file_id"]).await;
    let ids: Vec<&str> = output
        .iter()
        .filter_map(|l| l["custom_id"].as_str())
        .collect();
    assert_eq!(ids, ["d-1", "d-1", "d-2"]);
    assert_eq!(provider.stats.batch_work(), 2);
}

#[tokio::test]
async fn a_cancelled_batch_ends_the_lines_it_had_not_run() {
    let provider = mock().await;
    let (http, base) = (reqwest::Client::new(), provider.base_url());
    let rows = [
        line("c-1", "one mock:delay=300"),
        line("c-2", "two"),
        line("c-3", "three"),
    ];
    let created = batch(&http, &base, &rows).await;
    let id = created["id"].as_str().unwrap();
    lines_begun(&provider, 1).await;
    let cancelling: Value = http
        .post(format!("{base}/batches/{id}/cancel"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(cancelling["status"], "cancelling");
    let done = ended(&http, &base, &created["id"]).await;
    assert_eq!(done["status"], "cancelled");
    let errors = file_lines(&http, &base, &done["error_file_id"]).await;
    let codes: Vec<&str> = errors
        .iter()
        .filter_map(|l| l["error"]["code"].as_str())
        .collect();
    assert_eq!(codes, ["batch_cancelled", "batch_cancelled"]);
    // The line in hand when the cancel came ran to its end and is kept.
    let output = file_lines(&http, &base, &done["output_file_id"]).await;
    assert_eq!(output.len(), 1);
    assert_eq!(output[0]["custom_id"], "c-1");
    // An ended batch cannot be cancelled again.
    let again = http
        .post(format!("{base}/batches/{id}/cancel"))
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 409);
}

#[tokio::test]
async fn a_slow_status_read_outlasts_a_short_timeout_and_the_batch_is_found_by_listing() {
    let provider = mock().await;
    let (http, base) = (reqwest::Client::new(), provider.base_url());
    let created = batch(&http, &base, &[line("s-1", "one mock:slow_status=2000")]).await;
    let id = created["id"].as_str().unwrap();
    let read = http
        .get(format!("{base}/batches/{id}"))
        .timeout(std::time::Duration::from_millis(200))
        .send()
        .await;
    assert!(
        read.is_err_and(|e| e.is_timeout()),
        "the status read was not slow"
    );
    // Its id, had it been lost, is found again by its metadata.
    let listed: Value = http
        .get(format!("{base}/batches?limit=100"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let found: Vec<&Value> = listed["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["metadata"]["onejob_batch"] == "b-1")
        .collect();
    assert_eq!(found.len(), 1);
    assert_eq!(found[0]["id"], created["id"]);
}

#[tokio::test]
async fn listing_pages_newest_first() {
    let provider = mock().await;
    let (http, base) = (reqwest::Client::new(), provider.base_url());
    let mut made = Vec::new();
    for n in 0..5 {
        made.push(batch(&http, &base, &[line(&format!("p-{n}"), "x")]).await["id"].clone());
    }
    let seen = listed_ids(|after| {
        let url = match after {
            Some(a) => format!("{base}/batches?limit=2&after={a}"),
            None => format!("{base}/batches?limit=2"),
        };
        http.get(url)
    })
    .await;
    made.reverse();
    assert_eq!(seen, made);
}

#[tokio::test]
async fn bad_files_and_bad_batches_are_refused_with_their_reason() {
    let provider = mock().await;
    let (http, base) = (reqwest::Client::new(), provider.base_url());
    let wrong_purpose = upload(&http, &base, line("x", "y"), "fine-tune").await;
    assert_eq!(wrong_purpose.status(), 400);
    let create = |body: Value| http.post(format!("{base}/batches")).json(&body).send();
    let unknown = create(json!({"input_file_id": "file-nope", "endpoint": "/v1/chat/completions", "completion_window": "24h"}))
        .await
        .unwrap();
    assert_eq!(unknown.status(), 404);
    let file: Value = upload(&http, &base, line("x", "y"), "batch")
        .await
        .json()
        .await
        .unwrap();
    let wrong_window = create(json!({"input_file_id": file["id"], "endpoint": "/v1/chat/completions", "completion_window": "1h"}))
        .await
        .unwrap();
    assert_eq!(wrong_window.status(), 400);
    let wrong_endpoint = create(json!({"input_file_id": file["id"], "endpoint": "/v1/embeddings", "completion_window": "24h"}))
        .await
        .unwrap();
    assert_eq!(wrong_endpoint.status(), 400);
    let long_metadata = create(
        json!({"input_file_id": file["id"], "endpoint": "/v1/chat/completions",
        "completion_window": "24h", "metadata": {"k": "v".repeat(513)}}),
    )
    .await
    .unwrap();
    assert_eq!(long_metadata.status(), 400);
    // Lines that cannot be taken make a batch that failed at validation,
    // each named, and nothing ran.
    let failed = batch(
        &http,
        &base,
        &[
            line("f-1", "one"),
            "not json".into(),
            line("f-1", "again"),
            json!({"custom_id": "f-2"}).to_string(),
        ],
    )
    .await;
    assert_eq!(failed["status"], "failed");
    let codes: Vec<&str> = failed["errors"]["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["code"].as_str())
        .collect();
    assert_eq!(
        codes,
        [
            "invalid_json_line",
            "duplicate_custom_id",
            "invalid_request"
        ]
    );
    assert_eq!(provider.stats.batch_work(), 0);
    assert!(provider.stats.batch_custom_ids().is_empty());
}
