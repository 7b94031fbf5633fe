//! Budgets as reservations (contract section 7, Owners): the room an owner's
//! `daily_tokens` leaves (its spend over the last 24 hours and its
//! reservations taken off), read under the owner's budget lock; which of a
//! batch's new jobs fit in it (their reservations are written by the
//! statement that admits them, in the same transaction); and the
//! reservations of attempts that start without one (retries, hedges). They
//! end by the trigger of migration 0018.

use crate::edges::store::handles::Owners;
use std::collections::{BTreeSet, HashMap};

use sqlx::PgConnection;
use uuid::Uuid;

use super::owners::WINDOW_SECS;
use crate::domain::AttemptId;
use crate::edges::store::NewJob;
use crate::edges::store::error::Result;
use crate::intent::RejectReason;

/// What one owner's budget leaves, read under its budget lock.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Room {
    /// Its `daily_tokens`.
    pub(super) budget: i64,
    /// Tokens its attempts spent over the last 24 hours.
    pub(super) spent: i64,
    /// Tokens its open attempts hold reserved.
    pub(super) reserved: i64,
    /// Seconds until its oldest spend in the window leaves it.
    pub(super) spend_leaves_in: u64,
}

impl Room {
    /// The tokens a new reservation may still take.
    fn left(&self) -> i64 {
        self.budget - self.spent - self.reserved
    }

    /// Why a reservation of `need` tokens does not fit, with how long to wait:
    /// a second while only reservations stand in the way (they end with their
    /// calls), until spend leaves the window when spend does, and a whole
    /// window when the job needs more than the budget itself.
    fn refusal(&self, owner: &str, need: i64) -> RejectReason {
        let retry_after = if need > self.budget {
            WINDOW_SECS as u64
        } else if self.spent + need <= self.budget {
            1
        } else {
            self.spend_leaves_in
        };
        RejectReason::BudgetExceeded {
            owner: owner.to_owned(),
            spent: self.spent,
            reserved: self.reserved,
            need,
            budget: self.budget,
            retry_after,
        }
    }
}

/// Takes the budget locks of `owners` (in name order, so that two admissions
/// never wait on each other in a cycle) and reads what each budget leaves.
/// The read is a statement of its own after the locks: its snapshot sees every
/// reservation committed before them.
pub(super) async fn rooms(
    tx: &mut PgConnection,
    owners: &[(String, i64)],
) -> Result<HashMap<String, Room>> {
    let mut sorted: Vec<&(String, i64)> = owners.iter().collect();
    sorted.sort();
    let (names, budgets): (Vec<String>, Vec<i64>) =
        sorted.into_iter().map(|(o, b)| (o.clone(), *b)).unzip();
    sqlx::query!(
        "SELECT owner_budget_lock(o) FROM unnest($1::text[]) AS o",
        &names,
    )
    .execute(&mut *tx)
    .await?;
    read_rooms(&mut *tx, &names, &budgets).await
}

/// What each owner's budget (`names` with their `budgets`) leaves, read
/// with no lock: under the budget locks ([`rooms`]) it decides; without them
/// it only tells.
async fn read_rooms(
    executor: impl sqlx::PgExecutor<'_>,
    names: &[String],
    budgets: &[i64],
) -> Result<HashMap<String, Room>> {
    let rows = sqlx::query!(
        r#"SELECT o.owner_id AS "owner_id!", o.budget AS "budget!",
                  COALESCE(s.spent, 0)::int8 AS "spent!",
                  COALESCE((SELECT sum(r.tokens) FROM reservations r
                            WHERE r.owner_id = o.owner_id), 0)::int8 AS "reserved!",
                  GREATEST(1, ceil(extract(epoch FROM
                      s.oldest + make_interval(secs => $3) - now())))::int8 AS leaves_in
           FROM unnest($1::text[], $2::int8[]) AS o(owner_id, budget)
           LEFT JOIN LATERAL (
               SELECT sum(tokens) AS spent, min(minute) AS oldest FROM owner_spend
               WHERE owner_id = o.owner_id AND minute > now() - make_interval(secs => $3)
           ) s ON true"#,
        names,
        budgets,
        WINDOW_SECS,
    )
    .fetch_all(executor)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| {
            let room = Room {
                budget: r.budget,
                spent: r.spent,
                reserved: r.reserved,
                spend_leaves_in: r.leaves_in.and_then(|s| u64::try_from(s).ok()).unwrap_or(1),
            };
            (r.owner_id, room)
        })
        .collect())
}

/// Which of the batch's jobs reserve what, in `sorted`'s order: each new
/// identity of an owner with a budget reserves its `reserve` while it fits
/// in the owner's room, and is refused once it does not. Identities that
/// already have a job (`existing`) and the batch's repeats of one reserve
/// nothing: they make no job. Returns each job's reservation (0 for none)
/// and the refusals by job.
pub(super) fn fit(
    sorted: &[&NewJob],
    rooms: &HashMap<String, Room>,
    existing: &HashMap<(String, String), (Uuid, String)>,
) -> (Vec<i64>, HashMap<Uuid, RejectReason>) {
    let mut left: HashMap<&str, i64> = rooms.iter().map(|(o, r)| (o.as_str(), r.left())).collect();
    // The first intent of each identity in the batch, and its refusal if it
    // had one: a repeat of a refused identity is refused with it (left in,
    // it would make the job without a reservation).
    let mut first: HashMap<(&str, &str), Option<RejectReason>> = HashMap::new();
    let mut reserves = Vec::with_capacity(sorted.len());
    let mut refused = HashMap::new();
    for n in sorted {
        reserves.push(0);
        let owner = n.intent.owner_id.as_str();
        let identity = (owner, n.intent.idempotency_key.as_str());
        if let Some(earlier) = first.get(&identity) {
            if let Some(reason) = earlier {
                refused.insert(n.job_id.0, reason.clone());
            }
            continue;
        }
        let (Some(room), Some(left)) = (rooms.get(owner), left.get_mut(owner)) else {
            first.insert(identity, None);
            continue;
        };
        let reason = if existing.contains_key(&(owner.to_owned(), identity.1.to_owned())) {
            None
        } else if n.reserve <= *left {
            *left -= n.reserve;
            *reserves.last_mut().expect("pushed above") = n.reserve;
            None
        } else {
            Some(room.refusal(owner, n.reserve))
        };
        if let Some(reason) = &reason {
            refused.insert(n.job_id.0, reason.clone());
        }
        first.insert(identity, reason);
    }
    (reserves, refused)
}

/// One attempt's reservation to take before it starts.
#[derive(Clone, Debug)]
pub struct Reservation {
    /// The attempt, still `queued`.
    pub attempt_id: AttemptId,
    /// Its job's owner.
    pub owner_id: String,
    /// What it reserves: its prompt's tokens plus its operation's `max_tokens`.
    pub tokens: i64,
}

impl Owners<'_> {
    /// Whether a new identity of `owner` (`key`) reserving `need` tokens would
    /// be refused for its budget now, and why: what the gateway asks before
    /// it publishes, so that an intent admission would refuse is answered
    /// `429` at once instead of being published and dead-lettered. Nothing is
    /// reserved and no lock is taken: admission decides. An identity that
    /// has a job already is never refused (its answer is `duplicate` or
    /// `conflict`).
    pub async fn budget_refusal(
        self,
        owner: &str,
        key: &str,
        need: i64,
    ) -> Result<Option<RejectReason>> {
        let owners = [owner.to_owned()];
        let Some((_, limits)) = self.admission_owners(&owners).await?.pop() else {
            return Ok(None);
        };
        if limits.daily_tokens <= 0 {
            return Ok(None);
        }
        let known = sqlx::query_scalar!(
            r#"SELECT EXISTS (SELECT 1 FROM jobs WHERE owner_id = $1 AND idempotency_key = $2) AS "known!""#,
            owner,
            key,
        )
        .fetch_one(&self.0.per_job)
        .await?;
        if known {
            return Ok(None);
        }
        let rooms = read_rooms(&self.0.per_job, &owners, &[limits.daily_tokens]).await?;
        Ok(rooms
            .get(owner)
            .filter(|room| room.left() < need)
            .map(|room| room.refusal(owner, need)))
    }

    /// Reserves for queued attempts that hold no reservation (a retry, a
    /// hedge, a job admitted before its owner had a budget), in `wanted`'s
    /// order, under their owners' budget locks: each that fits in what its
    /// owner's budget leaves takes its reservation; each that does not is
    /// returned with its refusal, to be failed before its call. An attempt
    /// whose owner has no budget any more reserves nothing, and one that left
    /// `queued` meanwhile takes none (its row is read under a share lock, so
    /// it cannot end until the reservation has committed, and its ending then
    /// releases it).
    pub async fn reserve(self, wanted: &[Reservation]) -> Result<HashMap<AttemptId, RejectReason>> {
        let owners: Vec<String> = wanted
            .iter()
            .map(|w| w.owner_id.clone())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let budgeted: Vec<(String, i64)> = self
            .admission_owners(&owners)
            .await?
            .into_iter()
            .filter(|(_, limits)| limits.daily_tokens > 0)
            .map(|(owner, limits)| (owner, limits.daily_tokens))
            .collect();
        if budgeted.is_empty() {
            return Ok(HashMap::new());
        }
        self.0
            .retrying(|| async {
                let mut tx = self.0.per_job.begin().await?;
                let rooms = rooms(&mut tx, &budgeted).await?;
                // An attempt that holds its reservation already (a try whose
                // commit went through unseen, a second delivery) is not weighed
                // again: the room counts it.
                let asked: Vec<Uuid> = wanted.iter().map(|w| w.attempt_id.0).collect();
                let holding: BTreeSet<Uuid> = sqlx::query_scalar!(
                    "SELECT attempt_id FROM reservations WHERE attempt_id = ANY($1)",
                    &asked,
                )
                .fetch_all(&mut *tx)
                .await?
                .into_iter()
                .collect();
                let mut left: HashMap<&str, i64> =
                    rooms.iter().map(|(o, r)| (o.as_str(), r.left())).collect();
                let (mut ids, mut owners, mut tokens) = (Vec::new(), Vec::new(), Vec::new());
                let mut refused = HashMap::new();
                for w in wanted.iter().filter(|w| !holding.contains(&w.attempt_id.0)) {
                    let (Some(room), Some(left)) =
                        (rooms.get(&w.owner_id), left.get_mut(w.owner_id.as_str()))
                    else {
                        continue;
                    };
                    if w.tokens <= *left {
                        *left -= w.tokens;
                        ids.push(w.attempt_id.0);
                        owners.push(w.owner_id.clone());
                        tokens.push(w.tokens);
                    } else {
                        refused.insert(w.attempt_id, room.refusal(&w.owner_id, w.tokens));
                    }
                }
                sqlx::query!(
                    "WITH queued AS (
                     SELECT id FROM attempts WHERE id = ANY($1) AND status = 'queued'
                     ORDER BY id FOR SHARE
                 )
                 INSERT INTO reservations (attempt_id, owner_id, tokens)
                 SELECT t.attempt_id, t.owner_id, t.tokens
                 FROM unnest($1::uuid[], $2::text[], $3::int8[]) AS t(attempt_id, owner_id, tokens)
                 JOIN queued q ON q.id = t.attempt_id
                 ON CONFLICT (attempt_id) DO NOTHING",
                    &ids,
                    &owners,
                    &tokens,
                )
                .execute(&mut *tx)
                .await?;
                tx.commit().await?;
                Ok(refused)
            })
            .await
    }
}
