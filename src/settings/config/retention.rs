//! `[retention]`, and an operation's own `retention` table over it: how long
//! a job is kept once it ended, by how it ended.

use std::time::Duration;

use serde::Deserialize;

use super::Result;
use super::checks::invalid;
use crate::domain::JobStatus;

/// `[retention]`, or an operation's `retention` table: how long a job is kept
/// once it ended, by how it ended.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRetention {
    succeeded: Option<String>,
    failed: Option<String>,
    cancelled: Option<String>,
}

/// How long a job is kept once it ended, by how it ended (`[retention]`, and
/// an operation's own `retention` table over it). While it is kept, a re-send of
/// its identity is a `duplicate` (or a `conflict`); once it is pruned, the same
/// identity makes a new job. `unknown`, `queued` and `running` jobs are never
/// pruned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Retention {
    /// Kept this long after it succeeded.
    pub succeeded: Duration,
    /// Kept this long after it failed.
    pub failed: Duration,
    /// Kept this long after it was cancelled.
    pub cancelled: Duration,
}

impl Default for Retention {
    fn default() -> Self {
        const DAY: u64 = 24 * 3600;
        Self {
            succeeded: Duration::from_secs(7 * DAY),
            failed: Duration::from_secs(30 * DAY),
            cancelled: Duration::from_secs(7 * DAY),
        }
    }
}

impl Retention {
    /// Each ended status with how long it is kept.
    pub fn by_status(&self) -> [(JobStatus, Duration); 3] {
        [
            (JobStatus::Succeeded, self.succeeded),
            (JobStatus::Failed, self.failed),
            (JobStatus::Cancelled, self.cancelled),
        ]
    }
}

/// The longest retention accepted: ten years.
pub const MAX_RETENTION: Duration = Duration::from_secs(3650 * 24 * 3600);

/// A retention table over `defaults`. Each kept time is at least
/// `outbox_retention`, so that a job's published outbox rows are gone before
/// (or with) the job, and at most [`MAX_RETENTION`].
pub(super) fn parse_retention(
    origin: &str,
    table: &str,
    raw: &RawRetention,
    defaults: Retention,
    outbox_retention: Duration,
) -> Result<Retention> {
    let one = |key: &str, text: &Option<String>, default: Duration| -> Result<Duration> {
        let setting = format!("{table}.{key}");
        let Some(t) = text else {
            return Ok(default);
        };
        let d = humantime::parse_duration(t).map_err(|e| {
            invalid(
                origin,
                &setting,
                format!("{t:?} is not a duration like \"7d\" ({e})"),
            )
        })?;
        if d > MAX_RETENTION {
            return Err(invalid(origin, &setting, "must be at most 3650 days"));
        }
        if d < outbox_retention {
            return Err(invalid(
                origin,
                &setting,
                format!(
                    "must be at least worker.outbox_retention ({}): a job's published outbox rows go before the job does",
                    humantime::format_duration(outbox_retention)
                ),
            ));
        }
        Ok(d)
    };
    Ok(Retention {
        succeeded: one("succeeded", &raw.succeeded, defaults.succeeded)?,
        failed: one("failed", &raw.failed, defaults.failed)?,
        cancelled: one("cancelled", &raw.cancelled, defaults.cancelled)?,
    })
}
