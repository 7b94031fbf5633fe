//! Held turns by provider: how many wait and for how long (for the gauges
//! and the console), and the turns of providers no worker serves any more,
//! which would otherwise wait for ever: only a consumer of a turn's provider
//! hands it out.

use crate::edges::store::handles::Turns;
use std::time::Duration;

use serde::Serialize;

use crate::domain::AttemptId;
use crate::edges::store::error::Result;

/// The turns held for one provider.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HeldTurns {
    /// The provider (one no longer configured included).
    pub provider: String,
    /// Turns held: not handed out to its queue.
    pub held: i64,
    /// How long the oldest of them has waited, in seconds.
    pub oldest_seconds: f64,
}

impl Turns<'_> {
    /// The turns held for each provider that has any, the longest-waiting
    /// first.
    pub async fn held_turns(self) -> Result<Vec<HeldTurns>> {
        Ok(sqlx::query_as!(
            HeldTurns,
            r#"SELECT t.provider AS "provider!", count(*) AS "held!",
                      COALESCE(extract(epoch FROM now() - min(a.created_at)), 0)::float8
                          AS "oldest_seconds!"
               FROM turns t JOIN attempts a ON a.id = t.attempt_id
               WHERE t.handed_out_at IS NULL
               GROUP BY t.provider
               ORDER BY 3 DESC, 1"#
        )
        .fetch_all(&self.0.pool)
        .await?)
    }

    /// Held turns of providers not in `served` (the providers configured
    /// here) whose attempts were made more than `held_past` ago, oldest
    /// first, at most `limit`: no worker with this configuration hands them
    /// out, so they move on along their routes ([`Settle::fail_queued`](crate::edges::store::Settle::fail_queued)).
    pub async fn unserved_turns(
        self,
        served: &[String],
        held_past: Duration,
        limit: i64,
    ) -> Result<Vec<(AttemptId, String)>> {
        Ok(sqlx::query!(
            r#"SELECT t.attempt_id AS "attempt_id: AttemptId", t.provider
               FROM turns t JOIN attempts a ON a.id = t.attempt_id
               WHERE t.handed_out_at IS NULL AND t.provider <> ALL($1)
                 AND a.status = 'queued'
                 AND a.created_at < now() - make_interval(secs => $2)
               ORDER BY a.created_at
               LIMIT $3"#,
            served,
            held_past.as_secs_f64(),
            limit,
        )
        .fetch_all(&self.0.pool)
        .await?
        .into_iter()
        .map(|r| (r.attempt_id, r.provider))
        .collect())
    }
}
