//! Owners: the limits `onejob owners set` gives one owner (over `[owners]`),
//! what each owner spent over the last 24 hours, and which owners are over
//! their budget.

use crate::edges::store::handles::Owners;
use std::collections::HashMap;

use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use super::audit::record;
use crate::edges::store::audit::{Action, Actor};
use crate::edges::store::error::Result;
use crate::settings::config::{OwnerLimits, OwnerOverrides};

/// The window a daily budget counts, and how long a minute's spend counts:
/// the minute is counted while any part of it is within the last 24 hours.
pub(super) const WINDOW_SECS: f64 = 24.0 * 3600.0 + 60.0;

/// One owner as operators see it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OwnerView {
    /// The owner.
    pub owner_id: String,
    /// Its own settings (unset ones take `[owners]`'s).
    pub own: OwnerOverrides,
    /// The limits that apply to it: its own over `[owners]`'s.
    pub limits: OwnerLimits,
    /// Tokens its attempts spent over the last 24 hours, discarded ones included.
    pub spent_24h: i64,
    /// Tokens its open attempts hold reserved (contract section 7: replaced
    /// by their usage when they settle).
    pub reserved: i64,
    /// What its budget leaves for new reservations, or `None` with no budget.
    pub left: Option<i64>,
    /// Its attempts (first ones, retries, hedges) waiting for their turn:
    /// held (past its share or under its `max_in_flight`) or not yet due
    /// under its `rate` or a retry's backoff.
    pub waiting: i64,
    /// When its own settings last changed, if it has any.
    pub updated_at: Option<DateTime<Utc>>,
}

/// A change to one owner's settings: for each, `None` leaves it as it is,
/// `Some(None)` gives it back `[owners]`'s, `Some(Some(n))` sets its own.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OwnerChange {
    /// `max_in_flight`.
    pub max_in_flight: Option<Option<i64>>,
    /// `rate`.
    pub rate: Option<Option<f64>>,
    /// `burst`.
    pub burst: Option<Option<i64>>,
    /// `daily_tokens`.
    pub daily_tokens: Option<Option<i64>>,
}

impl OwnerChange {
    /// These settings after the change.
    pub fn applied_to(&self, own: &OwnerOverrides) -> OwnerOverrides {
        OwnerOverrides {
            max_in_flight: self.max_in_flight.unwrap_or(own.max_in_flight),
            rate: self.rate.unwrap_or(own.rate),
            burst: self.burst.unwrap_or(own.burst),
            daily_tokens: self.daily_tokens.unwrap_or(own.daily_tokens),
        }
    }
}

impl Owners<'_> {
    async fn own_settings(
        self,
        owners: &[String],
    ) -> Result<HashMap<String, (OwnerOverrides, DateTime<Utc>)>> {
        Ok(sqlx::query!(
            "SELECT owner_id, max_in_flight, rate, burst, daily_tokens, updated_at
             FROM owners WHERE owner_id = ANY($1)",
            owners,
        )
        .fetch_all(&self.0.per_job)
        .await?
        .into_iter()
        .map(|r| {
            let own = OwnerOverrides {
                max_in_flight: r.max_in_flight,
                rate: r.rate,
                burst: r.burst,
                daily_tokens: r.daily_tokens,
            };
            (r.owner_id, (own, r.updated_at))
        })
        .collect())
    }

    /// The limits that apply to each of these owners (its own settings over
    /// `[owners]`'s), in one statement.
    pub(super) async fn admission_owners(
        self,
        owners: &[String],
    ) -> Result<Vec<(String, OwnerLimits)>> {
        let defaults = self.0.routes.owners;
        let rows = sqlx::query!(
            r#"SELECT i.owner_id AS "owner_id!", o.max_in_flight, o.rate, o.burst, o.daily_tokens
               FROM unnest($1::text[]) AS i(owner_id) LEFT JOIN owners o USING (owner_id)"#,
            owners,
        )
        .fetch_all(&self.0.per_job)
        .await?;
        Ok(rows
            .into_iter()
            .map(|r| {
                let own = OwnerOverrides {
                    max_in_flight: r.max_in_flight,
                    rate: r.rate,
                    burst: r.burst,
                    daily_tokens: r.daily_tokens,
                };
                (r.owner_id, defaults.with(&own))
            })
            .collect())
    }

    /// One owner: its settings, its limits and its spend. An owner onejob has
    /// never heard of has `[owners]`'s limits and has spent nothing.
    pub async fn owner(self, owner_id: &str) -> Result<OwnerView> {
        let mut views = self.owner_views(&[owner_id.to_owned()]).await?;
        Ok(views.pop().unwrap_or_else(|| OwnerView {
            owner_id: owner_id.to_owned(),
            own: OwnerOverrides::default(),
            limits: self.0.routes.owners,
            spent_24h: 0,
            reserved: 0,
            left: budget_left(self.0.routes.owners.daily_tokens, 0, 0),
            waiting: 0,
            updated_at: None,
        }))
    }

    /// The owners with settings of their own or spend over the last 24 hours,
    /// by name.
    pub async fn list_owners(self) -> Result<Vec<OwnerView>> {
        let names: Vec<String> = sqlx::query_scalar!(
            r#"SELECT owner_id AS "owner_id!" FROM owners
               UNION
               SELECT DISTINCT owner_id FROM owner_spend
               WHERE minute > now() - make_interval(secs => $1)
               ORDER BY 1
               LIMIT 10000"#,
            WINDOW_SECS,
        )
        .fetch_all(&self.0.pool)
        .await?;
        self.owner_views(&names).await
    }

    async fn owner_views(self, owners: &[String]) -> Result<Vec<OwnerView>> {
        let own = self.own_settings(owners).await?;
        let figures: HashMap<String, (i64, i64, i64)> = sqlx::query!(
            r#"SELECT o.owner_id AS "owner_id!",
                      (SELECT COALESCE(sum(s.tokens), 0)::int8 FROM owner_spend s
                       WHERE s.owner_id = o.owner_id
                         AND s.minute > now() - make_interval(secs => $2)) AS "spent!",
                      (SELECT COALESCE(sum(r.tokens), 0)::int8 FROM reservations r
                       WHERE r.owner_id = o.owner_id) AS "reserved!",
                      (SELECT count(*) FROM turns t
                       WHERE t.owner_id = o.owner_id
                         AND (t.handed_out_at IS NULL OR t.due_at > now())) AS "waiting!"
               FROM unnest($1::text[]) AS o(owner_id)"#,
            owners,
            WINDOW_SECS,
        )
        .fetch_all(&self.0.pool)
        .await?
        .into_iter()
        .map(|r| (r.owner_id, (r.spent, r.reserved, r.waiting)))
        .collect();
        Ok(owners
            .iter()
            .map(|o| {
                let (mine, updated_at) = own
                    .get(o)
                    .map_or((OwnerOverrides::default(), None), |(s, at)| (*s, Some(*at)));
                let (spent_24h, reserved, waiting) = figures.get(o).copied().unwrap_or_default();
                let limits = self.0.routes.owners.with(&mine);
                OwnerView {
                    owner_id: o.clone(),
                    own: mine,
                    limits,
                    spent_24h,
                    reserved,
                    left: budget_left(limits.daily_tokens, spent_24h, reserved),
                    waiting,
                    updated_at,
                }
            })
            .collect())
    }

    /// Changes one owner's settings; the change and its audit row (what the
    /// settings were and became) commit together. Returns the owner as it is
    /// now, and the audit row's id.
    pub async fn set(
        self,
        owner_id: &str,
        change: &OwnerChange,
        actor: &Actor,
    ) -> Result<(OwnerView, Uuid)> {
        let mut tx = self.0.pool.begin().await?;
        let before = sqlx::query!(
            "SELECT max_in_flight, rate, burst, daily_tokens FROM owners
             WHERE owner_id = $1 FOR UPDATE",
            owner_id,
        )
        .fetch_optional(&mut *tx)
        .await?
        .map(|r| OwnerOverrides {
            max_in_flight: r.max_in_flight,
            rate: r.rate,
            burst: r.burst,
            daily_tokens: r.daily_tokens,
        })
        .unwrap_or_default();
        let after = change.applied_to(&before);
        let detail = serde_json::json!({ "before": before, "after": after });
        let audit = record(
            &mut tx,
            actor,
            &Action {
                action: "owner.set",
                target: Some(owner_id.to_owned()),
                detail,
                ..Default::default()
            },
        )
        .await?;
        sqlx::query!(
            "INSERT INTO owners (owner_id, max_in_flight, rate, burst, daily_tokens)
             VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (owner_id) DO UPDATE
             SET max_in_flight = EXCLUDED.max_in_flight, rate = EXCLUDED.rate,
                 burst = EXCLUDED.burst, daily_tokens = EXCLUDED.daily_tokens,
                 updated_at = now()",
            owner_id,
            after.max_in_flight,
            after.rate,
            after.burst,
            after.daily_tokens,
        )
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok((self.owner(owner_id).await?, audit))
    }

    /// Deletes up to `limit` spend rows that left every budget's window;
    /// returns how many.
    pub async fn prune_spend(self, limit: i64) -> Result<u64> {
        let done = sqlx::query!(
            "DELETE FROM owner_spend WHERE ctid IN (
                 SELECT ctid FROM owner_spend
                 WHERE minute < now() - make_interval(secs => $1)
                 LIMIT $2)",
            WINDOW_SECS,
            limit,
        )
        .execute(&self.0.pool)
        .await?;
        Ok(done.rows_affected())
    }
}

/// What a budget leaves for new reservations (never below 0), or `None` for
/// no budget.
fn budget_left(budget: i64, spent: i64, reserved: i64) -> Option<i64> {
    (budget > 0).then(|| (budget - spent - reserved).max(0))
}
