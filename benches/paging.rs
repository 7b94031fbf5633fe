//! The console's job list on a million jobs: how long a page takes through
//! the console (HTTP, the session check, the query, the template), against the
//! bare keyset query measured in the same run on the same database.
//!
//! It fills the jobs table with `ONEJOB_PAGING_N` ended jobs (default
//! 1,000,000; 80% succeeded, 15% failed, 5% cancelled, over 1,000 owners) and a
//! thousand `unknown` ones among them, serves the console in-process on this
//! machine's PostgreSQL, signs in, and asks for each kind of page 50 times:
//! the first page, a page from the middle (keyset `after`), twenty pages in a
//! row by their `next` links, a rare status, a common status from the middle,
//! one owner's, a provider's, and a provider's that only 1 job in 10,000
//! used. The target is under 100 ms a page (p99).
//!
//! `cargo bench --bench paging`. It prints; it asserts nothing.

use onejob_test_support as common;

use std::time::Instant;

use common::{TestEnv, config, config_text, fill_jobs};
use onejob::edges::store::JobFilter;
use sqlx::Connection;

const ROUNDS: usize = 50;

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// p50, p99 and max of `samples`, in ms.
fn summary(mut samples: Vec<f64>) -> (f64, f64, f64) {
    samples.sort_by(f64::total_cmp);
    (
        percentile(&samples, 0.5),
        percentile(&samples, 0.99),
        *samples.last().unwrap_or(&f64::NAN),
    )
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n: i64 = std::env::var("ONEJOB_PAGING_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let (config, _file) = config(&config_text(
        "http://127.0.0.1:9",
        Some("http://127.0.0.1:9"),
        "",
    ));
    let env = TestEnv::new(&config).await;
    let mut db = sqlx::PgConnection::connect(&env.database_url)
        .await
        .expect("connect");
    let middle = fill(&mut db, n).await;

    let served = common::console::serve(&env, config.clone(), false).await;
    let cookie = served.sign_in(&env.store, "bench").await.cookie;
    let (http, base) = (served.http.clone(), served.base.clone());
    let get = |path: String| {
        let http = http.clone();
        let cookie = cookie.clone();
        let base = base.clone();
        async move {
            let t = Instant::now();
            let page = http
                .get(format!("{base}{path}"))
                .header("cookie", cookie)
                .send()
                .await
                .expect("get");
            assert_eq!(page.status(), 200, "{path}");
            let body = page.text().await.expect("body");
            (t.elapsed().as_secs_f64() * 1000.0, body)
        }
    };

    let baseline = bare_query(&env).await;
    let (b50, b99, bmax) = summary(baseline);
    println!("\n| page | p50 ms | p99 ms | max ms | p50 / bare query | under 100 ms (p99) |");
    println!("|---|---|---|---|---|---|");
    println!(
        "| bare keyset query, first page (baseline) | {b50:.1} | {b99:.1} | {bmax:.1} | 1.00 | |"
    );
    for (what, path) in kinds(&middle) {
        let mut samples = Vec::new();
        for _ in 0..ROUNDS {
            samples.push(get(path.clone()).await.0);
        }
        let (p50, p99, max) = summary(samples);
        println!(
            "| {what} | {p50:.1} | {p99:.1} | {max:.1} | {:.2} | {} |",
            p50 / b50,
            if p99 < 100.0 { "yes" } else { "**no**" }
        );
    }
    // Twenty pages in a row, each by the previous page's `next` link.
    let mut samples = Vec::new();
    let mut path = "/jobs".to_owned();
    for _ in 0..20 {
        let (ms, body) = get(path.clone()).await;
        samples.push(ms);
        let start = body.find("id=\"next\" href=\"").expect("a next link") + 16;
        path = body[start..start + body[start..].find('"').expect("end of link")]
            .replace("&#x2f;", "/")
            .replace("&#x3d;", "=")
            .replace("&amp;", "&");
    }
    let (p50, p99, max) = summary(samples);
    println!(
        "| twenty pages by their next links | {p50:.1} | {p99:.1} | {max:.1} | {:.2} | {} |",
        p50 / b50,
        if p99 < 100.0 { "yes" } else { "**no**" }
    );
    db.close().await.ok();
}

/// Fills the jobs table with `n` ended jobs and a thousand `unknown` ones,
/// sends one attempt in 10,000 to the fallback, and analyzes the tables. A
/// job id from the middle.
async fn fill(db: &mut sqlx::PgConnection, n: i64) -> String {
    let began = Instant::now();
    fill_jobs(db, "p-", n, "mix", 60.0, 86400.0, "summarize").await;
    fill_jobs(db, "u-", 1000, "unknown", 60.0, 86400.0, "summarize").await;
    // One attempt in 10,000 went to the fallback: a provider filter that
    // matches few jobs, spread over the whole table.
    let rare: u64 = sqlx::query(
        "UPDATE attempts SET provider = 'fallback' WHERE abs(hashtext(id::text)) % 10000 = 0",
    )
    .execute(&mut *db)
    .await
    .expect("rare provider")
    .rows_affected();
    println!("paging: {rare} attempts on the fallback");
    sqlx::raw_sql("VACUUM ANALYZE jobs, attempts")
        .execute(&mut *db)
        .await
        .expect("analyze");
    println!(
        "paging: filled {} jobs in {:.1} s",
        n + 1000,
        began.elapsed().as_secs_f64()
    );
    sqlx::query_scalar("SELECT id::text FROM jobs ORDER BY id OFFSET $1 LIMIT 1")
        .bind(n / 2)
        .fetch_one(&mut *db)
        .await
        .expect("a middle id")
}

/// The baseline: the bare keyset query for a first page, on the same pool.
/// Its times, in ms.
async fn bare_query(env: &TestEnv) -> Vec<f64> {
    let mut baseline = Vec::new();
    for _ in 0..ROUNDS {
        let t = Instant::now();
        env.store
            .jobs()
            .page(&JobFilter::default(), None, 51)
            .await
            .expect("page");
        baseline.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    baseline
}

/// Each kind of page: what it is, and its path.
fn kinds(middle: &str) -> Vec<(&'static str, String)> {
    vec![
        ("first page", "/jobs".into()),
        ("a page from the middle", format!("/jobs?after={middle}")),
        ("status=unknown (0.1%)", "/jobs?status=unknown".into()),
        (
            "status=failed, from the middle",
            format!("/jobs?status=failed&after={middle}"),
        ),
        ("one owner's (1 in 1,000)", "/jobs?owner=tenant-7".into()),
        ("provider=primary", "/jobs?provider=primary".into()),
        (
            "provider=fallback (1 job in 10,000)",
            "/jobs?provider=fallback".into(),
        ),
        (
            "provider=fallback, from the middle",
            format!("/jobs?provider=fallback&after={middle}"),
        ),
        (
            "provider=fallback, status=cancelled (about 1 in 200,000)",
            "/jobs?provider=fallback&status=cancelled".into(),
        ),
        (
            "created in one hour a day ago",
            format!(
                "/jobs?since={}&until={}",
                (chrono::Utc::now() - chrono::Duration::hours(12)).format("%Y-%m-%dT%H:%M"),
                (chrono::Utc::now() - chrono::Duration::hours(11)).format("%Y-%m-%dT%H:%M")
            ),
        ),
    ]
}
