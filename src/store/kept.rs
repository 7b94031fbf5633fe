//! Kept answers: a provider's answer that could not be settled yet, because
//! its job row was held under someone else's lock, is written onto its attempt
//! before anything could hand its delivery back. A worker that stops meanwhile
//! then loses nothing: the reconciler settles kept answers, and the
//! vanished-worker sweep never makes an attempt with one `unknown`.

use super::*;

/// An answer as kept on its attempt (`attempts.answer`).
#[derive(Debug, Serialize, serde::Deserialize)]
struct KeptAnswer {
    /// The job's version when the attempt started: the compare-and-swap's guard.
    version: i64,
    verdict: Verdict,
    usage: Option<Value>,
    request_id: Option<String>,
}

impl Store {
    /// Keeps `finished` on its attempt while the attempt is still open. Takes
    /// the attempt row with `SKIP LOCKED`, so it never waits: false when the
    /// row was held (or the attempt is no longer open) and nothing was kept.
    pub async fn keep_answer(&self, finished: &Finished) -> Result<bool> {
        let kept = serde_json::to_value(KeptAnswer {
            version: finished.version,
            verdict: finished.verdict.clone(),
            usage: finished.usage.clone(),
            request_id: finished.provider_request_id.clone(),
        })
        .map_err(corrupt)?;
        self.retrying(|| async {
            let done = sqlx::query!(
                "UPDATE attempts SET answer = $2
                 WHERE id IN (SELECT id FROM attempts
                              WHERE id = $1 AND status IN ('started', 'unknown')
                              FOR UPDATE SKIP LOCKED)",
                finished.attempt_id.0,
                &kept,
            )
            .execute(&self.pool)
            .await?;
            Ok(done.rows_affected() == 1)
        })
        .await
    }

    /// Open attempts with a kept answer, oldest first, at most `limit`, as
    /// finished attempts to settle. A kept answer this version cannot read is
    /// left where it is, with an error in the log: an operator resolves it.
    pub async fn kept_answers(&self, limit: i64) -> Result<Vec<Finished>> {
        let rows = sqlx::query!(
            r#"SELECT id AS "attempt_id: AttemptId", job_id AS "job_id: JobId",
                      answer AS "answer!"
               FROM attempts
               WHERE answer IS NOT NULL AND status IN ('started', 'unknown')
               ORDER BY id
               LIMIT $1"#,
            limit
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .filter_map(|r| {
                match serde_json::from_value::<KeptAnswer>(r.answer) {
                    Ok(kept) => Some(Finished {
                        attempt_id: r.attempt_id,
                        job_id: r.job_id,
                        version: kept.version,
                        provider_request_id: kept.request_id,
                        usage: kept.usage,
                        verdict: kept.verdict,
                    }),
                    Err(e) => {
                        tracing::error!(attempt_id = %r.attempt_id, error = %e, "a kept answer cannot be read; the attempt waits for an operator");
                        None
                    }
                }
            })
            .collect())
    }
}
