//! The tables fair sharing and budgets write for every job, at their edges:
//! the spend ledger counts each attempt's usage once whatever statement
//! records it whatever its provider's kind names its tokens, and `turns`, which every job churns, is vacuumed once its dead
//! rows are due whether or not the server runs autovacuum.

use std::time::Duration;

use sqlx::Connection;

use super::config_with_owners;
use crate::common::{TestEnv, config, wait_for};

/// `n` jobs of `owner`, one `started` attempt each with no usage yet.
async fn started_jobs(env: &TestEnv, owner: &str, n: i64) {
    sqlx::query(
        "WITH made AS (
             INSERT INTO jobs (id, owner_id, idempotency_key, request_fingerprint, operation,
                               input, status)
             SELECT gen_random_uuid(), $1, $1 || '-' || i, 'fp', 'summarize', '{}', 'running'
             FROM generate_series(1, $2::bigint) i
             RETURNING id)
         INSERT INTO attempts (id, job_id, number, provider, status, started_at)
         SELECT gen_random_uuid(), id, 1, 'primary', 'started', now() FROM made",
    )
    .bind(owner)
    .bind(n)
    .execute(env.store.pool())
    .await
    .unwrap();
}

/// Each owner's spend in the ledger, by name.
async fn ledger(env: &TestEnv) -> Vec<(String, i64)> {
    sqlx::query_as(
        "SELECT owner_id, sum(tokens)::int8 FROM owner_spend GROUP BY owner_id ORDER BY owner_id",
    )
    .fetch_all(env.store.pool())
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_statement_recording_many_usages_adds_each_owners_sum_once() {
    let (cfg, _file) = config(&config_with_owners("http://127.0.0.1:9/v1", ""));
    let env = TestEnv::new(&cfg).await;
    started_jobs(&env, "acct_s1", 6).await;
    started_jobs(&env, "acct_s2", 4).await;
    let pool = env.store.pool();
    let run = |sql: &'static str| async move { sqlx::query(sql).execute(pool).await.unwrap() };

    // An update that records no usage adds nothing.
    run("UPDATE attempts SET evidence = 'none'").await;
    assert_eq!(ledger(&env).await, []);
    // One statement records ten usages (one report counts nothing: not a
    // number), in two parts of one statement for acct_s2.
    run("WITH first AS (
             UPDATE attempts a SET usage = '{\"total_tokens\": 7}'
             FROM jobs j WHERE j.id = a.job_id AND j.owner_id = 'acct_s2'
               AND j.idempotency_key IN ('acct_s2-1', 'acct_s2-2'))
         UPDATE attempts a
         SET usage = CASE WHEN j.idempotency_key = 'acct_s1-6' THEN '{\"total_tokens\": \"lots\"}'::jsonb
                          ELSE '{\"prompt_tokens\": 30, \"completion_tokens\": 12}'::jsonb END
         FROM jobs j
         WHERE j.id = a.job_id
           AND j.idempotency_key NOT IN ('acct_s2-1', 'acct_s2-2')")
    .await;
    assert_eq!(
        ledger(&env).await,
        [
            ("acct_s1".to_owned(), 5 * 42),
            ("acct_s2".to_owned(), 2 * 7 + 2 * 42)
        ]
    );
    // Usage recorded again (a late answer, a kept one) counts no more.
    run("UPDATE attempts SET usage = '{\"total_tokens\": 1000}'").await;
    assert_eq!(
        ledger(&env).await,
        [("acct_s1".to_owned(), 210), ("acct_s2".to_owned(), 98)]
    );
}

/// Dead rows in `turns`, as the statistics count them.
async fn dead_turns(env: &TestEnv) -> i64 {
    sqlx::query_scalar(
        "SELECT n_dead_tup FROM pg_stat_user_tables
         WHERE relname = 'turns' AND schemaname = current_schema()",
    )
    .fetch_one(env.store.pool())
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn turns_are_vacuumed_once_their_dead_rows_are_due() {
    let (cfg, _file) = config(&config_with_owners("http://127.0.0.1:9/v1", ""));
    let env = TestEnv::new(&cfg).await;
    let store = &env.store;
    // Nothing dead: nothing to do.
    assert!(!store.turns().vacuum_if_due().await.unwrap());

    // A churn of 3,000 turns (an ended job's attempts, each with a turn that
    // is then deleted), reported to the statistics at once.
    let mut db = sqlx::PgConnection::connect(&env.database_url)
        .await
        .unwrap();
    for sql in [
        "INSERT INTO jobs (id, owner_id, idempotency_key, request_fingerprint, operation, input,
                           status)
         VALUES ('00000000-0000-0000-0000-00000000c0de', 'acct_v', 'v', 'fp', 'summarize', '{}',
                 'failed')",
        "INSERT INTO attempts (id, job_id, number, provider, status)
         SELECT gen_random_uuid(), '00000000-0000-0000-0000-00000000c0de', i, 'primary', 'failed'
         FROM generate_series(1, 3000) i",
        "INSERT INTO turns (attempt_id, owner_id, provider, outbox_id, due_at)
         SELECT id, 'acct_v', 'primary', 0, now() FROM attempts",
        "DELETE FROM turns",
        "SELECT pg_stat_force_next_flush()",
        "SELECT 1",
    ] {
        sqlx::query(sql).execute(&mut db).await.unwrap();
    }
    wait_for(
        "the churned turns to be reported dead",
        Duration::from_secs(30),
        || async { (dead_turns(&env).await >= 3000).then_some(()) },
    )
    .await;
    assert!(
        store.turns().vacuum_if_due().await.unwrap(),
        "3,000 dead turns are due"
    );
    wait_for(
        "the vacuum to be reported",
        Duration::from_secs(30),
        || async { (dead_turns(&env).await == 0).then_some(()) },
    )
    .await;
    assert!(!store.turns().vacuum_if_due().await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_usage_report_counts_whatever_its_kind_names_its_tokens() {
    let (cfg, _file) = config(&config_with_owners("http://127.0.0.1:9/v1", ""));
    let env = TestEnv::new(&cfg).await;
    let cases = [
        // OpenAI's: the total, else its parts.
        (
            r#"{"total_tokens": 21, "prompt_tokens": 9, "completion_tokens": 12}"#,
            21,
        ),
        (r#"{"prompt_tokens": 9, "completion_tokens": 12}"#, 21),
        // Anthropic's: input and output, and the prompt cache's input.
        (r#"{"input_tokens": 9, "output_tokens": 12}"#, 21),
        (
            r#"{"input_tokens": 3, "output_tokens": 12, "cache_creation_input_tokens": 4,
                "cache_read_input_tokens": 2}"#,
            21,
        ),
        // Outside text: what is not a number counts nothing, and the sum is held.
        (
            r#"{"input_tokens": "9", "output_tokens": 12, "note": 5}"#,
            12,
        ),
        (r#"{"input_tokens": 1e30}"#, 1_000_000_000_000_000),
        (r#"{"output_tokens": -40}"#, 0),
        (r#"[1, 2]"#, 0),
    ];
    for (usage, want) in cases {
        let got: i64 = sqlx::query_scalar("SELECT usage_tokens($1::jsonb)")
            .bind(usage)
            .fetch_one(env.store.pool())
            .await
            .unwrap();
        assert_eq!(got, want, "{usage}");
    }
}
