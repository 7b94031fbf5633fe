//! The store's handles, one per aggregate: `store.jobs().job(id)`,
//! `store.settle().finalize(..)`, `store.outbox().claim(..)`. Each borrows the
//! store (its pools) and holds the statements of one aggregate, written in
//! that aggregate's file; `Store` itself keeps only connecting and what
//! every aggregate shares (retries, holding turns).

use crate::edges::store::Store;

/// Admission: intents become jobs, attempts and turns in one statement a table.
#[derive(Clone, Copy, Debug)]
pub struct Admissions<'s>(pub(super) &'s Store);

/// The audit table: every operator action recorded before it is done, and its outcome.
#[derive(Clone, Copy, Debug)]
pub struct Audit<'s>(pub(super) &'s Store);

/// Evidence: looks at an unknown's provider-side record, and the claims found.
#[derive(Clone, Copy, Debug)]
pub struct Evidence<'s>(pub(super) &'s Store);

/// Jobs and their attempts as read: one, a page, a list, the unknowns, the counts; cancelling one.
#[derive(Clone, Copy, Debug)]
pub struct Jobs<'s>(pub(super) &'s Store);

/// Kept answers: settlements handed on or held at a stop, settled once free.
#[derive(Clone, Copy, Debug)]
pub struct Kept<'s>(pub(super) &'s Store);

/// The outbox: messages a transaction means to send, claimed, marked published, pruned.
#[derive(Clone, Copy, Debug)]
pub struct Outbox<'s>(pub(super) &'s Store);

/// Owners: their limits, their spend, their budgets' reservations.
#[derive(Clone, Copy, Debug)]
pub struct Owners<'s>(pub(super) &'s Store);

/// Qualification runs: who passed which contract.
#[derive(Clone, Copy, Debug)]
pub struct Qualifications<'s>(pub(super) &'s Store);

/// Retention: ended jobs pruned past their window, and the vacuum after.
#[derive(Clone, Copy, Debug)]
pub struct Pruning<'s>(pub(super) &'s Store);

/// The console's sessions.
#[derive(Clone, Copy, Debug)]
pub struct Sessions<'s>(pub(super) &'s Store);

/// Settlements: claims (queued to started), finalizing, resolving, failing queued attempts.
#[derive(Clone, Copy, Debug)]
pub struct Settle<'s>(pub(super) &'s Store);

/// Sweeps: stuck attempts, vanished ones, hedges' candidates, the tables' statistics.
#[derive(Clone, Copy, Debug)]
pub struct Sweeps<'s>(pub(super) &'s Store);

/// Bearer tokens: the gateway's and the console's, only their digests kept.
#[derive(Clone, Copy, Debug)]
pub struct Tokens<'s>(pub(super) &'s Store);

/// Turns: first attempts held past their owner's share, handed out as places free.
#[derive(Clone, Copy, Debug)]
pub struct Turns<'s>(pub(super) &'s Store);

impl Store {
    /// Admission: intents become jobs, attempts and turns in one statement a table.
    pub fn admission(&self) -> Admissions<'_> {
        Admissions(self)
    }

    /// The audit table: every operator action recorded before it is done, and its outcome.
    pub fn audit(&self) -> Audit<'_> {
        Audit(self)
    }

    /// Evidence: looks at an unknown's provider-side record, and the claims found.
    pub fn evidence(&self) -> Evidence<'_> {
        Evidence(self)
    }

    /// Jobs and their attempts as read: one, a page, a list, the unknowns, the counts; cancelling one.
    pub fn jobs(&self) -> Jobs<'_> {
        Jobs(self)
    }

    /// Kept answers: settlements handed on or held at a stop, settled once free.
    pub fn kept(&self) -> Kept<'_> {
        Kept(self)
    }

    /// The outbox: messages a transaction means to send, claimed, marked published, pruned.
    pub fn outbox(&self) -> Outbox<'_> {
        Outbox(self)
    }

    /// Owners: their limits, their spend, their budgets' reservations.
    pub fn owners(&self) -> Owners<'_> {
        Owners(self)
    }

    /// Qualification runs: who passed which contract.
    pub fn qualifications(&self) -> Qualifications<'_> {
        Qualifications(self)
    }

    /// Retention: ended jobs pruned past their window, and the vacuum after.
    pub fn retention(&self) -> Pruning<'_> {
        Pruning(self)
    }

    /// The console's sessions.
    pub fn sessions(&self) -> Sessions<'_> {
        Sessions(self)
    }

    /// Settlements: claims (queued to started), finalizing, resolving, failing queued attempts.
    pub fn settle(&self) -> Settle<'_> {
        Settle(self)
    }

    /// Sweeps: stuck attempts, vanished ones, hedges' candidates, the tables' statistics.
    pub fn sweeps(&self) -> Sweeps<'_> {
        Sweeps(self)
    }

    /// Bearer tokens: the gateway's and the console's, only their digests kept.
    pub fn tokens(&self) -> Tokens<'_> {
        Tokens(self)
    }

    /// Turns: first attempts held past their owner's share, handed out as places free.
    pub fn turns(&self) -> Turns<'_> {
        Turns(self)
    }
}
