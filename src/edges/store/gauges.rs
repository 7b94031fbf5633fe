//! Prometheus gauges read from the tables.

use crate::edges::store::handles::Jobs;
use std::collections::HashMap;

use crate::domain::{AttemptStatus, JobStatus};
use crate::edges::store::error::Result;

/// How many owners the per-owner gauges name at most, by each figure.
const OWNER_GAUGES: i64 = 50;

impl Jobs<'_> {
    /// Prometheus gauges read from the tables: jobs and attempts by status, the
    /// oldest `unknown` attempt's age (alert on it: only a person or late evidence
    /// resolves an unknown), the unknowns resolved in the last hour by how
    /// (evidence of each kind, or an operator), the answers kept on open
    /// attempts by why they wait, the outbox backlog, and what the primary's
    /// replication promises a commit.
    pub async fn gauges(self) -> Result<String> {
        let jobs: HashMap<JobStatus, i64> = sqlx::query!(
            r#"SELECT status AS "status: JobStatus", count(*) AS "n!" FROM jobs GROUP BY status"#
        )
        .fetch_all(&self.0.pool)
        .await?
        .into_iter()
        .map(|r| (r.status, r.n))
        .collect();
        let attempts: HashMap<AttemptStatus, i64> = sqlx::query!(
            r#"SELECT status AS "status: AttemptStatus", count(*) AS "n!"
               FROM attempts GROUP BY status"#
        )
        .fetch_all(&self.0.pool)
        .await?
        .into_iter()
        .map(|r| (r.status, r.n))
        .collect();
        let row = sqlx::query!(
            r#"SELECT (SELECT extract(epoch FROM now() - min(COALESCE(started_at, created_at)))::float8
                       FROM attempts WHERE status = 'unknown') AS oldest_unknown,
                      (SELECT count(*) FROM outbox WHERE published_at IS NULL) AS "backlog!""#
        )
        .fetch_one(&self.0.pool)
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
        .fetch_all(&self.0.pool)
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
        out.push_str(&self.kept_gauge().await?);
        out.push_str("# TYPE onejob_outbox_unpublished gauge\n");
        out.push_str(&format!("onejob_outbox_unpublished {backlog}\n"));
        out.push_str(&self.owner_gauges().await?);
        out.push_str(&self.reservation_gauges().await?);
        out.push_str(&self.waiting_gauge().await?);
        out.push_str(&crate::edges::store::replication::gauges(self.0).await?);
        Ok(out)
    }

    /// The work waiting for each provider: its attempts `queued`, whether
    /// held in the database (a turn not handed out, a first attempt paced by
    /// its owner's rate), in its queue, or a retry waiting out its backoff.
    /// What an autoscaler scales its workers on: the queue's length misses
    /// the backlog held in the database. Every configured provider has a
    /// line, 0 when nothing waits. (A provider's name holds no character a
    /// label value must escape.)
    async fn waiting_gauge(self) -> Result<String> {
        let rows = sqlx::query!(
            r#"SELECT provider AS "provider!", count(*) AS "n!" FROM attempts
               WHERE status = 'queued' GROUP BY provider"#
        )
        .fetch_all(&self.0.pool)
        .await?;
        let mut waiting: std::collections::BTreeMap<String, i64> = self
            .0
            .routes
            .shares
            .iter()
            .map(|(p, _)| (p.clone(), 0))
            .collect();
        waiting.extend(rows.into_iter().map(|r| (r.provider, r.n)));
        let mut out = String::from("# TYPE onejob_provider_work_waiting gauge\n");
        for (provider, n) in waiting {
            out.push_str(&format!(
                "onejob_provider_work_waiting{{provider=\"{provider}\"}} {n}\n"
            ));
        }
        out.push_str(&self.held_gauge().await?);
        Ok(out)
    }

    /// The turns held for each provider, and how long the oldest has
    /// waited: every configured provider has a line (0 when none waits), and
    /// so does a provider no longer configured whose turns are still held
    /// (they move on along their routes once `stuck_after` has passed).
    async fn held_gauge(self) -> Result<String> {
        let mut held: std::collections::BTreeMap<String, (i64, f64)> = self
            .0
            .routes
            .shares
            .iter()
            .map(|(p, _)| (p.clone(), (0, 0.0)))
            .collect();
        for h in self.0.turns().held_turns().await? {
            held.insert(h.provider, (h.held, h.oldest_seconds));
        }
        let mut out = String::from("# TYPE onejob_turns_held gauge\n");
        for (provider, (n, _)) in &held {
            out.push_str(&format!(
                "onejob_turns_held{{provider=\"{provider}\"}} {n}\n"
            ));
        }
        out.push_str("# TYPE onejob_oldest_held_turn_seconds gauge\n");
        for (provider, (_, oldest)) in &held {
            out.push_str(&format!(
                "onejob_oldest_held_turn_seconds{{provider=\"{provider}\"}} {oldest}\n"
            ));
        }
        Ok(out)
    }

    /// Budget reservations (contract section 7, Owners): the tokens held by
    /// the [`OWNER_GAUGES`] owners that hold most, and, fleet-wide since the
    /// database was made, the reservations released without a settlement by
    /// why (`no_call`: the attempt ended before its call; `no_usage`: a call
    /// was made and no usage was reported for it, so its cost is not in the
    /// budget). Every worker reports the same fleet-wide count.
    async fn reservation_gauges(self) -> Result<String> {
        let held = sqlx::query!(
            r#"SELECT owner_id AS "owner_id!", sum(tokens)::int8 AS "tokens!"
               FROM reservations GROUP BY owner_id ORDER BY 2 DESC, 1 LIMIT $1"#,
            OWNER_GAUGES,
        )
        .fetch_all(&self.0.pool)
        .await?;
        let released: HashMap<String, i64> = sqlx::query!(
            r#"SELECT why AS "why!", sum(released)::int8 AS "n!"
               FROM reservations_released GROUP BY why"#
        )
        .fetch_all(&self.0.pool)
        .await?
        .into_iter()
        .map(|r| (r.why, r.n))
        .collect();
        let mut out = String::from("# TYPE onejob_owner_reserved_tokens gauge\n");
        for r in &held {
            out.push_str(&format!(
                "onejob_owner_reserved_tokens{{owner=\"{}\"}} {}\n",
                r.owner_id, r.tokens
            ));
        }
        out.push_str("# TYPE onejob_reservations_released_unsettled_total counter\n");
        for why in ["no_call", "no_usage"] {
            let n = released.get(why).copied().unwrap_or(0);
            out.push_str(&format!(
                "onejob_reservations_released_unsettled_total{{why=\"{why}\"}} {n}\n"
            ));
        }
        Ok(out)
    }

    /// The answers kept on open attempts, by why they wait
    /// ([`Kept::waiting`](crate::edges::store::Kept::waiting)).
    async fn kept_gauge(self) -> Result<String> {
        let kept = self.0.kept().waiting().await?;
        let mut out = String::from("# TYPE onejob_kept_answers gauge\n");
        for (why, n) in [
            ("due", kept.due),
            ("held", kept.held),
            ("unreadable", kept.unreadable),
        ] {
            out.push_str(&format!("onejob_kept_answers{{why=\"{why}\"}} {n}\n"));
        }
        Ok(out)
    }

    /// Per owner, for the [`OWNER_GAUGES`] owners that spent most over the
    /// last 24 hours and those with most jobs waiting their turn (held, or
    /// held back by their rate): the
    /// spend and the waiting jobs. (An owner id holds no character a label
    /// value must escape.)
    async fn owner_gauges(self) -> Result<String> {
        let rows = sqlx::query!(
            r#"WITH spent AS (
                   SELECT owner_id, sum(tokens)::int8 AS tokens FROM owner_spend
                   WHERE minute > now() - interval '24 hours 1 minute'
                   GROUP BY owner_id ORDER BY 2 DESC LIMIT $1
               ), waiting AS (
                   SELECT owner_id, count(*) AS jobs FROM turns
                   WHERE handed_out_at IS NULL OR due_at > now()
                   GROUP BY owner_id ORDER BY 2 DESC LIMIT $1
               )
               SELECT COALESCE(s.owner_id, w.owner_id) AS "owner_id!",
                      COALESCE(s.tokens, 0) AS "tokens!", COALESCE(w.jobs, 0) AS "waiting!"
               FROM spent s FULL JOIN waiting w ON w.owner_id = s.owner_id
               ORDER BY 1"#,
            OWNER_GAUGES,
        )
        .fetch_all(&self.0.pool)
        .await?;
        let mut out = String::from("# TYPE onejob_owner_spent_tokens_24h gauge\n");
        for r in &rows {
            out.push_str(&format!(
                "onejob_owner_spent_tokens_24h{{owner=\"{}\"}} {}\n",
                r.owner_id, r.tokens
            ));
        }
        out.push_str("# TYPE onejob_owner_waiting_jobs gauge\n");
        for r in &rows {
            out.push_str(&format!(
                "onejob_owner_waiting_jobs{{owner=\"{}\"}} {}\n",
                r.owner_id, r.waiting
            ));
        }
        Ok(out)
    }
}
