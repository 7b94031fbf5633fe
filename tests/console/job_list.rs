//! The job list and the overview: keyset pages with their filters, the
//! provider filter, and job ids that are not UUIDv7.

use crate::common::console::{serve, two_providers, unescape};
use crate::common::{self, TestEnv, config};
use onejob::domain::JobStatus;
use reqwest::StatusCode;
use sqlx::Connection;

#[tokio::test]
async fn the_job_list_pages_by_keyset_with_its_filters() {
    let (config, _file) = config(&two_providers());
    let env = TestEnv::new(&config).await;
    let served = serve(&env, config, false).await;
    let session = served.sign_in(&env.store, "ada").await;
    let mut db = sqlx::PgConnection::connect(&env.database_url)
        .await
        .unwrap();
    // 120 ended jobs (every 20th cancelled, 3 in 20 failed), newest first by id.
    common::fill_jobs(&mut db, "page-", 120, "mix", 60.0, 60.0, "summarize").await;
    let ids = |page: &str| -> Vec<String> {
        page.match_indices("href=\"/jobs/")
            .map(|(i, _)| page[i + 12..i + 48].to_owned())
            .collect()
    };
    let mut seen = Vec::new();
    let mut path = "/jobs".to_owned();
    let mut pages = 0;
    loop {
        let (status, page) = served.get(&session.cookie, &path).await;
        assert_eq!(status, StatusCode::OK, "{page}");
        seen.extend(ids(&page));
        pages += 1;
        match page.find("id=\"next\" href=\"") {
            Some(i) => {
                let rest = &page[i + 16..];
                path = unescape(&rest[..rest.find('"').unwrap()]);
            }
            None => break,
        }
    }
    assert_eq!(pages, 3, "50 + 50 + 20");
    let mut expected: Vec<String> =
        sqlx::query_scalar("SELECT id::text FROM jobs ORDER BY id DESC")
            .fetch_all(&mut db)
            .await
            .unwrap();
    assert_eq!(seen, expected, "every job once, newest first");
    // A filter keeps to its jobs, and across pages.
    let (_, page) = served.get(&session.cookie, "/jobs?status=cancelled").await;
    expected =
        sqlx::query_scalar("SELECT id::text FROM jobs WHERE status = 'cancelled' ORDER BY id DESC")
            .fetch_all(&mut db)
            .await
            .unwrap();
    assert_eq!(ids(&page), expected);
    // Bad filters get their own errors.
    let (status, page) = served.get(&session.cookie, "/jobs?status=lost").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(page.contains("not a job status"));
    let (status, _) = served.get(&session.cookie, "/jobs?since=yesterday").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, _) = served.get(&session.cookie, "/jobs/not-a-uuid").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

/// The overview's chart reads the creation minute out of UUIDv7 job ids. A
/// row whose id is not one (another program wrote it) must neither count nor
/// fail the page: its "minute" overflowed, and the overview answered 503.
#[tokio::test]
async fn the_overview_stands_jobs_whose_ids_are_not_uuidv7() {
    let (config, _file) = config(&two_providers());
    let env = TestEnv::new(&config).await;
    let served = serve(&env, config, false).await;
    let mut db = sqlx::PgConnection::connect(&env.database_url)
        .await
        .unwrap();
    // md5-made ids: random bits where a UUIDv7 keeps its time.
    common::fill_jobs(&mut db, "not-v7-", 20, "mix", 60.0, 60.0, "summarize").await;
    let session = served.sign_in(&env.store, "ada").await;
    let (status, page) = served.get(&session.cookie, "/").await;
    assert_eq!(status, StatusCode::OK, "{page}");
    let overview = env.store.jobs().overview().await.unwrap();
    assert_eq!(overview.created_per_minute.iter().sum::<i64>(), 0);
    assert_eq!(overview.jobs.iter().map(|(_, n)| n).sum::<i64>(), 20);
}

/// The provider filter pages from the provider's attempts: every job that has
/// one on it, once (however many attempts it made there), newest first, with
/// the other filters applied, and nothing else.
#[tokio::test]
async fn the_provider_filter_pages_every_matching_job_once() {
    use onejob::edges::store::JobFilter;

    let (config, _file) = config(&two_providers());
    let env = TestEnv::new(&config).await;
    let mut db = sqlx::PgConnection::connect(&env.database_url)
        .await
        .unwrap();
    common::fill_jobs(&mut db, "pf-", 400, "mix", 60.0, 600.0, "summarize").await;
    // One attempt in seven moves to the fallback, and some jobs get a second
    // attempt there too.
    sqlx::raw_sql(
        "UPDATE attempts SET provider = 'fallback' WHERE abs(hashtext(id::text)) % 7 = 0;
         INSERT INTO attempts (id, job_id, number, provider, status, created_at, not_before)
         SELECT gen_random_uuid(), job_id, number + 100, 'fallback', 'failed', now(), now()
         FROM attempts WHERE provider = 'fallback' AND abs(hashtext(id::text)) % 2 = 0;",
    )
    .execute(&mut db)
    .await
    .unwrap();
    for status in [None, Some(JobStatus::Failed)] {
        let truth: Vec<uuid::Uuid> = sqlx::query_scalar(
            "SELECT j.id FROM jobs j WHERE EXISTS (SELECT 1 FROM attempts a
                 WHERE a.job_id = j.id AND a.provider = 'fallback')
               AND ($1::text IS NULL OR j.status = $1) ORDER BY j.id DESC",
        )
        .bind(status.map(|s| s.as_str()))
        .fetch_all(&mut db)
        .await
        .unwrap();
        assert!(truth.len() > 20, "{} jobs", truth.len());
        let filter = JobFilter {
            provider: Some("fallback".into()),
            status,
            ..JobFilter::default()
        };
        let mut seen = Vec::new();
        let mut after = None;
        loop {
            let page = env.store.jobs().page(&filter, after, 7).await.unwrap();
            seen.extend(page.iter().map(|l| l.id));
            match page.last() {
                Some(last) if page.len() == 7 => after = Some(last.id),
                _ => break,
            }
        }
        assert_eq!(seen, truth, "{status:?}");
    }
}
