//! `onejob jobs list`: jobs by status, owner, provider and age, newest first,
//! a page at a time with a cursor that walks every job once; bad filters are
//! bad usage (exit 2), and outside text is escaped in plain output.

use onejob_test_support as common;

use onejob::policy::next::NextStep;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use common::{TestEnv, config, config_text, new_job, settle_with};
use onejob::domain::{AttemptId, JobId};
use onejob::edges::store::{Actor, Admission, Started, Store, Verdict};
use serde_json::{Value, json};

/// The jobs a test made, by the name it gave each, as the CLI prints ids.
type Made = BTreeMap<&'static str, String>;

/// Admits a job of `owner` whose first attempt goes to `provider`.
async fn admit(store: &Store, owner: &str, key: &str, provider: &str) -> (JobId, AttemptId) {
    let mut new = new_job(owner, key, key);
    new.provider = provider.into();
    let ids = (new.job_id, new.attempt_id);
    let admitted = store.admission().admit(&[new]).await.unwrap().remove(0);
    assert!(
        matches!(admitted, Admission::Created { .. }),
        "{admitted:?}"
    );
    ids
}

/// Admits a job for the primary and starts its attempt: `running`.
async fn running(store: &Store, owner: &str, key: &str) -> Started {
    let (_, attempt) = admit(store, owner, key, "primary").await;
    let mut started = store
        .settle()
        .start("primary", &[attempt], Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(started.len(), 1, "{key} starts");
    started.remove(0)
}

/// Settles a started attempt with `verdict`, the job's next step by `plan`.
async fn settle(
    store: &Store,
    s: &Started,
    verdict: Verdict,
    plan: &(dyn Fn(&onejob::policy::next::FailedJob) -> NextStep + Sync),
) {
    settle_with(store, &[common::database::finished(s, verdict)], plan).await;
}

/// Two owners' jobs, one or more in every status; `b-retried` failed on the
/// primary and waits on the fallback (two attempts, the job `running`); `a-queued` and `b-unknown`
/// were created two hours ago, the rest now.
async fn made(store: &Store) -> Made {
    let unknown = || Verdict::Unknown {
        error: "outcome_unknown: timed out".into(),
    };
    let failed = |retryable| Verdict::Failed {
        error: "HTTP 500".into(),
        retryable,
        retry_after: None,
    };
    let mut made = Made::new();
    let mut put = |name, id: JobId| made.insert(name, id.to_string());
    put(
        "a-queued",
        admit(store, "acct_a", "a-queued", "primary").await.0,
    );
    let s = running(store, "acct_a", "a-running").await;
    put("a-running", s.job_id);
    let s = running(store, "acct_a", "a-unknown").await;
    settle(store, &s, unknown(), &common::give_up).await;
    put("a-unknown", s.job_id);
    let s = running(store, "acct_a", "a-succeeded").await;
    let answer = Verdict::Succeeded(json!({ "summary": "done" }));
    settle(store, &s, answer, &common::give_up).await;
    put("a-succeeded", s.job_id);
    let s = running(store, "acct_b", "b-unknown").await;
    settle(store, &s, unknown(), &common::give_up).await;
    put("b-unknown", s.job_id);
    let s = running(store, "acct_b", "b-failed").await;
    settle(store, &s, failed(false), &common::give_up).await;
    put("b-failed", s.job_id);
    let s = running(store, "acct_b", "b-retried").await;
    let to_fallback = |_: &onejob::policy::next::FailedJob| NextStep::Retry {
        provider: "fallback".into(),
        delay: Duration::ZERO,
    };
    settle(store, &s, failed(true), &to_fallback).await;
    put("b-retried", s.job_id);
    let (job, _) = admit(store, "acct_b", "b-cancelled", "primary").await;
    store
        .jobs()
        .cancel(job, &Actor::cli(None))
        .await
        .unwrap()
        .unwrap();
    put("b-cancelled", job);
    let old: Vec<uuid::Uuid> = ["a-queued", "b-unknown"]
        .iter()
        .map(|n| made[n].parse().unwrap())
        .collect();
    sqlx::query("UPDATE jobs SET created_at = now() - interval '2 hours' WHERE id = ANY($1)")
        .bind(&old)
        .execute(store.pool())
        .await
        .unwrap();
    made
}

/// The ids of the jobs named.
fn ids(made: &Made, names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|n| made[n].clone()).collect()
}

/// `--json jobs list ARGS`: its jobs, and its `next_after`.
fn listed(env: &TestEnv, file: &Path, args: &[&str]) -> (Vec<Value>, Value) {
    let mut all = vec!["--json", "jobs", "list"];
    all.extend_from_slice(args);
    let out = env.cli_ok(file, &all);
    let page: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {:?}", out.stdout));
    let jobs = page["jobs"].as_array().expect("a jobs array").clone();
    (jobs, page["next_after"].clone())
}

/// The ids `jobs list ARGS` lists (one page), checked newest first.
fn listed_ids(env: &TestEnv, file: &Path, args: &[&str]) -> BTreeSet<String> {
    let (jobs, next) = listed(env, file, args);
    assert_eq!(next, Value::Null, "{args:?}: one page holds them");
    let ids: Vec<String> = jobs
        .iter()
        .map(|j| j["id"].as_str().unwrap().to_owned())
        .collect();
    let mut newest_first = ids.clone();
    newest_first.sort_by(|a, b| b.cmp(a));
    assert_eq!(ids, newest_first, "{args:?}: newest first");
    ids.into_iter().collect()
}

/// A primary and a fallback (neither ever called), and the file the CLI reads.
fn two_providers() -> (
    std::sync::Arc<onejob::settings::config::Config>,
    common::tempfile_path::TempConfig,
) {
    config(&config_text(
        "http://127.0.0.1:9/v1",
        Some("http://127.0.0.1:9/v1"),
        "",
    ))
}

#[tokio::test]
async fn jobs_are_listed_by_status_owner_provider_and_age() {
    let (config, file) = two_providers();
    let env = TestEnv::new(&config).await;
    let made = made(&env.store).await;
    let file = file.path.as_path();
    let list = |args: &[&str]| listed_ids(&env, file, args);

    assert_eq!(list(&[]), made.values().cloned().collect());
    let open = ids(&made, &["a-running", "a-unknown", "b-unknown", "b-retried"]);
    assert_eq!(list(&["--status", "unknown,running"]), open);
    assert_eq!(list(&["--status", "unknown", "--status", "running"]), open);
    assert_eq!(list(&["--status", "queued"]), ids(&made, &["a-queued"]));
    assert_eq!(
        list(&["--owner", "acct_b"]),
        ids(
            &made,
            &["b-unknown", "b-failed", "b-retried", "b-cancelled"]
        )
    );
    assert_eq!(
        list(&["--owner", "acct_a", "--status", "unknown"]),
        ids(&made, &["a-unknown"])
    );
    assert_eq!(list(&["--owner", "acct_c"]), BTreeSet::new());
    assert_eq!(
        list(&["--provider", "fallback"]),
        ids(&made, &["b-retried"])
    );
    assert_eq!(
        list(&["--provider", "primary", "--status", "running"]),
        ids(&made, &["a-running", "b-retried"]),
        "a job with an attempt on the provider, whichever attempt"
    );
    let old = ids(&made, &["a-queued", "b-unknown"]);
    assert_eq!(list(&["--older-than", "1h"]), old);
    assert_eq!(list(&["--older-than", "1h", "--newer-than", "3h"]), old);
    assert_eq!(list(&["--older-than", "3h"]), BTreeSet::new());
    let new: BTreeSet<String> = made.values().cloned().collect();
    assert_eq!(
        list(&["--newer-than", "1h"]),
        new.difference(&old).cloned().collect()
    );
}

#[tokio::test]
async fn json_lines_carry_the_public_fields() {
    let (config, file) = two_providers();
    let env = TestEnv::new(&config).await;
    let made = made(&env.store).await;
    let (jobs, next) = listed(&env, &file.path, &["--provider", "fallback"]);
    assert_eq!((jobs.len(), next), (1, Value::Null));
    let job = &jobs[0];
    assert_eq!(job["id"], made["b-retried"].as_str());
    assert_eq!(job["owner_id"], "acct_b");
    assert_eq!(job["idempotency_key"], "b-retried");
    assert_eq!(job["operation"], "summarize");
    assert_eq!(job["status"], "running", "its retry waits on the fallback");
    assert_eq!(job["attempt_count"], 2);
    assert!(job["created_at"].is_string() && job["updated_at"].is_string());
    assert!(job.get("input").is_none() && job.get("result").is_none());

    let (jobs, _) = listed(&env, &file.path, &["--status", "succeeded"]);
    let shown = env.cli_ok(
        &file.path,
        &["--json", "jobs", "show", &made["a-succeeded"]],
    );
    let shown: Value = serde_json::from_slice(&shown.stdout).unwrap();
    for field in [
        "id",
        "owner_id",
        "idempotency_key",
        "request_fingerprint",
        "operation",
    ] {
        assert_eq!(
            jobs[0][field], shown[field],
            "{field} as `jobs show` has it"
        );
    }
    for field in ["status", "version", "completed_by", "error", "created_at"] {
        assert_eq!(
            jobs[0][field], shown[field],
            "{field} as `jobs show` has it"
        );
    }
}

/// Walks `jobs list --limit 2` (plain, or `--json`) by its cursor: the ids of
/// each page, in order.
fn walk(env: &TestEnv, file: &Path, json: bool) -> Vec<Vec<String>> {
    let mut pages = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let mut args = vec!["jobs", "list", "--limit", "2"];
        if let Some(id) = &after {
            args.extend(["--after", id.as_str()]);
        }
        if json {
            let (jobs, next) = listed(env, file, &args[2..]);
            pages.push(
                jobs.iter()
                    .map(|j| j["id"].as_str().unwrap().to_owned())
                    .collect(),
            );
            after = next.as_str().map(str::to_owned);
        } else {
            let out = env.cli_ok(file, &args);
            let text = String::from_utf8(out.stdout).unwrap();
            let mut lines: Vec<&str> = text.lines().collect();
            after = match lines.last().and_then(|l| l.strip_prefix("more: --after ")) {
                Some(id) => {
                    lines.pop();
                    Some(id.to_owned())
                }
                None => None,
            };
            let ids = lines
                .iter()
                .map(|l| l.split_whitespace().next().unwrap().to_owned());
            pages.push(ids.collect());
        }
        if after.is_none() {
            return pages;
        }
        assert!(pages.len() < 10, "the walk ends: {pages:?}");
    }
}

#[tokio::test]
async fn paging_by_the_cursor_walks_every_job_once() {
    let (config, file) = two_providers();
    let env = TestEnv::new(&config).await;
    let made = made(&env.store).await;
    let mut everything: Vec<String> = made.values().cloned().collect();
    everything.sort_by(|a, b| b.cmp(a));
    for json in [false, true] {
        let pages = walk(&env, &file.path, json);
        assert_eq!(pages.len(), 4, "eight jobs, two a page: {pages:?}");
        assert!(pages.iter().all(|p| p.len() == 2), "{pages:?}");
        let walked: Vec<String> = pages.concat();
        assert_eq!(walked, everything, "json: {json}: each once, newest first");
    }

    // A line says what the job is; the last page says no more.
    let out = env.cli_ok(
        &file.path,
        &["jobs", "list", "--owner", "acct_b", "--status", "running"],
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let line = text.lines().next().unwrap();
    for part in [
        made["b-retried"].as_str(),
        "running",
        "owner acct_b",
        "key b-retried",
        "summarize",
        "attempts 2",
        "created 20",
        "updated 20",
    ] {
        assert!(line.contains(part), "{part:?} in {line}");
    }
    assert_eq!(
        text.lines().count(),
        1,
        "no cursor on the last page: {text}"
    );
    let out = env.cli_ok(&file.path, &["jobs", "list", "--owner", "nobody"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "no jobs");
}

#[test]
fn bad_filters_are_bad_usage_naming_the_flag() {
    for (args, flag, value) in [
        (&["--status", "bogus"][..], "--status", "bogus"),
        (&["--status", "unknown,bogus"], "--status", "bogus"),
        (&["--status", "started"], "--status", "started"),
        (&["--limit", "0"], "--limit", "0"),
        (&["--limit", "1001"], "--limit", "1001"),
        (&["--limit=-3"], "--limit", "-3"),
        (&["--after", "not-a-job-id"], "--after", "not-a-job-id"),
        (&["--after", "0192"], "--after", "0192"),
        (&["--older-than", "soon"], "--older-than", "soon"),
        (&["--newer-than=-1h"], "--newer-than", "-1h"),
    ] {
        // Refused before anything is connected to: no database is needed.
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_onejob"))
            .args(["jobs", "list"])
            .args(args)
            .env("DATABASE_URL", "postgres://postgres@127.0.0.1:9/none")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(flag), "{args:?} names {flag}: {stderr}");
        assert!(stderr.contains(value), "{args:?} names {value}: {stderr}");
    }
}

#[tokio::test]
async fn an_owners_control_characters_are_escaped_in_plain_output() {
    let (config, file) = two_providers();
    let env = TestEnv::new(&config).await;
    let owner = "acct_\u{1b}]0;pwned\u{7}\u{1b}[2J\nonejob: all clear";
    let key = "key\r\u{9b}31m";
    admit(&env.store, owner, key, "primary").await;

    let out = env.cli_ok(&file.path, &["jobs", "list"]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.lines().count(), 1, "one job, one line: {text:?}");
    assert!(
        text.contains("owner acct_\\u{1b}]0;pwned\\u{7}\\u{1b}[2J\\u{a}onejob: all clear"),
        "{text:?}"
    );
    assert!(text.contains("key key\\u{d}\\u{9b}31m"), "{text:?}");
    assert!(
        !text.chars().any(|c| c.is_control() && c != '\n'),
        "raw control characters in {text:?}"
    );

    let out = env.cli_ok(&file.path, &["jobs", "list", "--owner", owner, "--json"]);
    let page: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(page["jobs"][0]["owner_id"], owner, "JSON stays exact");
    assert_eq!(page["jobs"][0]["idempotency_key"], key);
}
