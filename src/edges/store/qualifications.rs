//! Provider qualification runs.

use crate::edges::store::handles::Qualifications;
use std::collections::HashMap;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::edges::store::error::Result;

/// The latest qualification run of one provider for one operation.
#[derive(Clone, Debug, PartialEq)]
pub struct QualificationRun {
    /// The run.
    pub run_id: Uuid,
    /// When it ran.
    pub at: DateTime<Utc>,
    /// The contract it ran against.
    pub contract_hash: String,
    /// Its cases.
    pub cases: i64,
    /// How many of them passed.
    pub passed: i64,
}

impl Qualifications<'_> {
    /// Records a qualification run, one row per case.
    pub async fn record(self, q: &crate::domain::Qualification) -> Result<Uuid> {
        let run = Uuid::now_v7();
        // A run with no case still records that it failed.
        let cases: Vec<crate::domain::CaseResult> = if q.cases.is_empty() {
            vec![crate::domain::CaseResult {
                index: 0,
                passed: false,
                detail: "no_cases: the operation has no golden cases to qualify with".into(),
                prompt_tokens: None,
                tokens_estimated: false,
                latency_ms: None,
            }]
        } else {
            q.cases.clone()
        };
        let indexes: Vec<i32> = cases
            .iter()
            .map(|c| i32::try_from(c.index).unwrap_or(i32::MAX))
            .collect();
        let passed: Vec<bool> = cases.iter().map(|c| c.passed).collect();
        let details: Vec<String> = cases.iter().map(|c| c.detail.clone()).collect();
        let prompt_tokens: Vec<Option<i32>> = cases
            .iter()
            .map(|c| {
                c.prompt_tokens
                    .map(|t| i32::try_from(t).unwrap_or(i32::MAX))
            })
            .collect();
        let estimated: Vec<bool> = cases.iter().map(|c| c.tokens_estimated).collect();
        let latencies: Vec<Option<i64>> = cases
            .iter()
            .map(|c| c.latency_ms.map(|l| i64::try_from(l).unwrap_or(i64::MAX)))
            .collect();
        sqlx::query!(
            "INSERT INTO provider_qualifications
                 (run_id, provider, operation, contract_hash, case_index, passed, detail,
                  prompt_tokens, tokens_estimated, latency_ms)
             SELECT $1, $2, $3, $4, c.case_index, c.passed, c.detail, c.prompt_tokens, c.estimated, c.latency_ms
             FROM unnest($5::int[], $6::bool[], $7::text[], $8::int[], $9::bool[], $10::bigint[])
                  AS c(case_index, passed, detail, prompt_tokens, estimated, latency_ms)",
            run,
            &q.provider,
            &q.operation,
            &q.contract_hash,
            &indexes,
            &passed,
            &details,
            &prompt_tokens as &[Option<i32>],
            &estimated,
            &latencies as &[Option<i64>],
        )
        .execute(&self.0.pool)
        .await?;
        Ok(run)
    }

    /// Each `(provider, operation)` pair's latest qualification run, whatever
    /// contract it ran against (the caller compares its hash with the current
    /// contract's).
    pub async fn latest_runs(
        self,
        pairs: &[(String, String)],
    ) -> Result<HashMap<(String, String), QualificationRun>> {
        if pairs.is_empty() {
            return Ok(HashMap::new());
        }
        let providers: Vec<String> = pairs.iter().map(|p| p.0.clone()).collect();
        let operations: Vec<String> = pairs.iter().map(|p| p.1.clone()).collect();
        let rows = sqlx::query!(
            r#"WITH latest AS (
                   SELECT DISTINCT ON (q.provider, q.operation) q.provider, q.operation, q.run_id
                   FROM provider_qualifications q
                   JOIN unnest($1::text[], $2::text[]) AS k(provider, operation)
                     ON q.provider = k.provider AND q.operation = k.operation
                   ORDER BY q.provider, q.operation, q.created_at DESC, q.id DESC)
               SELECT l.provider AS "provider!", l.operation AS "operation!", l.run_id AS "run_id!",
                      max(q.created_at) AS "at!", max(q.contract_hash) AS "contract_hash!",
                      count(*) AS "cases!", count(*) FILTER (WHERE q.passed) AS "passed!"
               FROM latest l JOIN provider_qualifications q ON q.run_id = l.run_id
               GROUP BY l.provider, l.operation, l.run_id"#,
            &providers,
            &operations
        )
        .fetch_all(&self.0.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|r| {
                (
                    (r.provider, r.operation),
                    QualificationRun {
                        run_id: r.run_id,
                        at: r.at,
                        contract_hash: r.contract_hash,
                        cases: r.cases,
                        passed: r.passed,
                    },
                )
            })
            .collect())
    }
}
