//! The history check at the end of every chaos run: the provider's own log
//! (the mock's record of each call, by its `Idempotency-Key`, the attempt id)
//! read against what the database holds. Every call the provider ran is
//! settled exactly once with its usage counted, no attempt is left `started`
//! or `unknown` without a call, and every kept answer was cleared.

use std::collections::HashSet;

use onejob::edges::store::Store;

/// What the check found.
#[derive(Debug)]
pub struct History {
    /// Calls the provider logged, and the distinct attempts they name.
    pub calls: usize,
    pub attempts_called: usize,
    /// Attempts the provider ran that are not settled (still `queued`,
    /// `started` or `unknown`): at most the bound the run allows.
    pub unsettled_called: i64,
    /// Attempts the provider logged that the database does not hold.
    pub unheard_of: i64,
    /// Attempts `started` or `unknown` that the provider never saw.
    pub open_without_call: i64,
    /// Succeeded attempts with no usage kept.
    pub won_without_usage: i64,
    /// The owners' spend ledger, and the tokens the attempts' usage counts:
    /// each usage counted once.
    pub spend_ledger: i64,
    pub spend_usage: i64,
    /// Answers still kept on attempts.
    pub kept: i64,
}

impl History {
    /// Reads the database against `calls`, the provider's log of keys.
    pub async fn check(store: &Store, calls: &[String]) -> History {
        let called: Vec<uuid::Uuid> = calls
            .iter()
            .filter_map(|k| k.parse().ok())
            .collect::<HashSet<_>>()
            .into_iter()
            .collect();
        let row: (i64, i64, i64, i64, i64, i64, i64) = sqlx::query_as(
            "SELECT
               (SELECT count(*) FROM attempts
                WHERE id = ANY($1) AND status IN ('queued', 'started', 'unknown')),
               $2::int8 - (SELECT count(*) FROM attempts WHERE id = ANY($1)),
               (SELECT count(*) FROM attempts
                WHERE status IN ('started', 'unknown') AND NOT id = ANY($1)),
               (SELECT count(*) FROM attempts WHERE status = 'succeeded' AND usage IS NULL),
               (SELECT COALESCE(sum(tokens), 0)::int8 FROM owner_spend),
               (SELECT COALESCE(sum(usage_tokens(usage)), 0)::int8 FROM attempts
                WHERE usage IS NOT NULL),
               (SELECT count(*) FROM attempts WHERE answer IS NOT NULL)",
        )
        .bind(&called)
        .bind(called.len() as i64)
        .fetch_one(store.pool())
        .await
        .unwrap();
        History {
            calls: calls.len(),
            attempts_called: called.len(),
            unsettled_called: row.0,
            unheard_of: row.1,
            open_without_call: row.2,
            won_without_usage: row.3,
            spend_ledger: row.4,
            spend_usage: row.5,
            kept: row.6,
        }
    }

    /// Prints the figures (`what` names the run) and asserts the history;
    /// `unsettled_bound` is how many attempts may stay `unknown` (the calls
    /// in flight when workers were killed; a worker killed between its
    /// claim's commit and its request leaves one without a call).
    pub fn assert_held(&self, what: &str, unsettled_bound: usize) {
        println!(
            "{what}: history: {} provider calls for {} attempts; {} of them unsettled (bound {unsettled_bound}), \
             {} unheard of; {} attempts started or unknown without a call; {} won without usage; \
             spend ledger {} tokens against usage {}; {} answers still kept",
            self.calls,
            self.attempts_called,
            self.unsettled_called,
            self.unheard_of,
            self.open_without_call,
            self.won_without_usage,
            self.spend_ledger,
            self.spend_usage,
            self.kept
        );
        assert!(
            self.unsettled_called as usize <= unsettled_bound,
            "every call the provider ran is settled"
        );
        assert_eq!(
            self.unheard_of, 0,
            "every call names an attempt onejob holds"
        );
        assert!(
            self.open_without_call as usize <= unsettled_bound,
            "no attempt open without a call (beyond the kills' bound)"
        );
        assert_eq!(self.won_without_usage, 0, "every winner's usage kept");
        assert_eq!(
            self.spend_ledger, self.spend_usage,
            "every usage counted in the spend ledger, once"
        );
        assert_eq!(self.kept, 0, "every kept answer cleared");
    }
}
