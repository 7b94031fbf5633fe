//! Prometheus gauges read from the tables.

use super::*;

impl Store {
    /// Prometheus gauges read from the tables: jobs and attempts by status, the
    /// oldest `unknown` attempt's age (alert on it: only a person or late evidence
    /// resolves an unknown), the unknowns resolved in the last hour by how
    /// (evidence of each kind, or an operator), and the outbox backlog.
    pub async fn gauges(&self) -> Result<String> {
        let jobs: HashMap<JobStatus, i64> = sqlx::query!(
            r#"SELECT status AS "status: JobStatus", count(*) AS "n!" FROM jobs GROUP BY status"#
        )
        .fetch_all(&self.pool)
        .await?
        .into_iter()
        .map(|r| (r.status, r.n))
        .collect();
        let attempts: HashMap<AttemptStatus, i64> = sqlx::query!(
            r#"SELECT status AS "status: AttemptStatus", count(*) AS "n!"
               FROM attempts GROUP BY status"#
        )
        .fetch_all(&self.pool)
        .await?
        .into_iter()
        .map(|r| (r.status, r.n))
        .collect();
        let row = sqlx::query!(
            r#"SELECT (SELECT extract(epoch FROM now() - min(COALESCE(started_at, created_at)))::float8
                       FROM attempts WHERE status = 'unknown') AS oldest_unknown,
                      (SELECT count(*) FROM outbox WHERE published_at IS NULL) AS "backlog!""#
        )
        .fetch_one(&self.pool)
        .await?;
        let (oldest_unknown, backlog) = (row.oldest_unknown, row.backlog);
        // Unknowns resolved in the last hour, by how: from the audit rows, so
        // that an operator's resolution counts whichever process made it.
        let resolved: HashMap<String, i64> = sqlx::query!(
            r#"SELECT CASE WHEN action = 'attempt.evidence' THEN COALESCE(detail->>'evidence', '')
                           ELSE 'operator' END AS "how!",
                      count(*) AS "n!"
               FROM audit
               WHERE at > now() - interval '1 hour'
                 AND action IN ('attempt.evidence', 'attempt.resolve_failed', 'attempt.resolve_cancelled')
               GROUP BY 1"#
        )
        .fetch_all(&self.pool)
        .await?
        .into_iter()
        .map(|r| (r.how, r.n))
        .collect();
        let mut out = String::new();
        out.push_str("# TYPE onejob_jobs gauge\n");
        for s in JobStatus::ALL {
            let n = jobs.get(s).copied().unwrap_or(0);
            out.push_str(&format!("onejob_jobs{{status=\"{s}\"}} {n}\n"));
        }
        out.push_str("# TYPE onejob_attempts gauge\n");
        for s in AttemptStatus::ALL {
            let n = attempts.get(s).copied().unwrap_or(0);
            out.push_str(&format!("onejob_attempts{{status=\"{s}\"}} {n}\n"));
        }
        out.push_str("# TYPE onejob_oldest_unknown_attempt_seconds gauge\n");
        out.push_str(&format!(
            "onejob_oldest_unknown_attempt_seconds {}\n",
            oldest_unknown.unwrap_or(0.0)
        ));
        out.push_str("# TYPE onejob_unknowns_resolved_last_hour gauge\n");
        for (how, said) in [
            ("stored", "found"),
            ("replayed", "replayed"),
            ("no_evidence", "not found"),
            ("not_completed", "not completed"),
            ("operator", "operator"),
        ] {
            let n = resolved.get(said).copied().unwrap_or(0);
            out.push_str(&format!(
                "onejob_unknowns_resolved_last_hour{{how=\"{how}\"}} {n}\n"
            ));
        }
        out.push_str("# TYPE onejob_outbox_unpublished gauge\n");
        out.push_str(&format!("onejob_outbox_unpublished {backlog}\n"));
        Ok(out)
    }
}
