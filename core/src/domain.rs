//! The pure heart of onejob: job and attempt states and the transitions between
//! them (the route rule that picks the next provider is the worker's, in its
//! `policy` folder, with all else that follows a failure). No I/O lives here, so every
//! rule can be tested exhaustively; the store turns each allowed transition into one
//! guarded SQL statement.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Lowercase hex of `bytes`, as digests are stored and shown.
pub fn hex(bytes: &[u8]) -> String {
    use fmt::Write;
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(out, "{b:02x}");
    }
    out
}

/// The SHA-256, in hex, of `value`'s RFC 8785 canonical JSON: key order and
/// whitespace never change it, any change of a value does. Intent fingerprints
/// and provider contract hashes are both this.
pub fn canonical_sha256(value: &serde_json::Value) -> String {
    use sha2::{Digest, Sha256};
    // Serialising a `serde_json::Value` cannot fail: its keys are strings and its
    // numbers are finite.
    let canonical = serde_jcs::to_vec(value).unwrap_or_default();
    hex(&Sha256::digest(&canonical))
}

/// The identity of a job: one per `(owner_id, idempotency_key)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
#[cfg_attr(feature = "sqlx", derive(sqlx::Type), sqlx(transparent))]
pub struct JobId(pub Uuid);

/// The identity of one attempt at a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
#[cfg_attr(feature = "sqlx", derive(sqlx::Type), sqlx(transparent))]
pub struct AttemptId(pub Uuid);

impl JobId {
    /// A fresh, time-ordered id (UUID v7).
    pub fn new() -> Self {
        Self(Uuid::now_v7())
    }
}

impl AttemptId {
    /// A fresh, time-ordered id (UUID v7).
    pub fn new() -> Self {
        Self(Uuid::now_v7())
    }
}

impl Default for JobId {
    fn default() -> Self {
        Self::new()
    }
}

impl Default for AttemptId {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Display for AttemptId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// An unrecognised status string read from storage or typed by an operator.
#[derive(Debug, thiserror::Error)]
#[error("unknown {kind} status {value:?}")]
pub struct UnknownStatus {
    kind: &'static str,
    value: String,
}

macro_rules! status_enum {
    ($(#[$doc:meta])* $name:ident, $kind:literal, { $($(#[$vdoc:meta])* $variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[serde(rename_all = "snake_case")]
        pub enum $name {
            $($(#[$vdoc])* $variant),+
        }

        impl $name {
            /// Every status, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The status as the contract spells it.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = UnknownStatus;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s {
                    $($text => Ok($name::$variant),)+
                    other => Err(UnknownStatus { kind: $kind, value: other.to_owned() }),
                }
            }
        }

        // Stored as the contract's text, so the SQL keeps its literals and the
        // CHECK constraints, while Rust reads and writes the enum.
        #[cfg(feature = "sqlx")]
        impl sqlx::Type<sqlx::Postgres> for $name {
            fn type_info() -> sqlx::postgres::PgTypeInfo {
                <str as sqlx::Type<sqlx::Postgres>>::type_info()
            }

            fn compatible(ty: &sqlx::postgres::PgTypeInfo) -> bool {
                <str as sqlx::Type<sqlx::Postgres>>::compatible(ty)
            }
        }

        #[cfg(feature = "sqlx")]
        impl sqlx::postgres::PgHasArrayType for $name {
            fn array_type_info() -> sqlx::postgres::PgTypeInfo {
                <&str as sqlx::postgres::PgHasArrayType>::array_type_info()
            }
        }

        #[cfg(feature = "sqlx")]
        impl<'r> sqlx::Decode<'r, sqlx::Postgres> for $name {
            fn decode(value: sqlx::postgres::PgValueRef<'r>) -> Result<Self, sqlx::error::BoxDynError> {
                Ok(<&str as sqlx::Decode<sqlx::Postgres>>::decode(value)?.parse()?)
            }
        }

        #[cfg(feature = "sqlx")]
        impl sqlx::Encode<'_, sqlx::Postgres> for $name {
            fn encode_by_ref(
                &self,
                buf: &mut sqlx::postgres::PgArgumentBuffer,
            ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
                <&str as sqlx::Encode<sqlx::Postgres>>::encode(self.as_str(), buf)
            }
        }
    };
}

status_enum!(
    /// Where a job stands (contract section 5).
    JobStatus, "job", {
        /// Accepted; no attempt has started.
        Queued => "queued",
        /// An attempt is in flight.
        Running => "running",
        /// An attempt's outcome is not known; nothing new starts until it is resolved.
        Unknown => "unknown",
        /// Terminal: `result` holds the winning attempt's answer.
        Succeeded => "succeeded",
        /// Terminal: `error` holds the last error.
        Failed => "failed",
        /// Terminal: ended by an operator.
        Cancelled => "cancelled",
    }
);

status_enum!(
    /// Where one attempt stands (contract section 5).
    AttemptStatus, "attempt", {
        /// Created and handed to its provider's queue.
        Queued => "queued",
        /// A worker is calling the provider.
        Started => "started",
        /// Timed out or its worker vanished mid-call.
        Unknown => "unknown",
        /// Its result won the compare-and-swap.
        Succeeded => "succeeded",
        /// A definite failure.
        Failed => "failed",
        /// It finished, but another attempt had already won.
        Discarded => "discarded",
        /// Ended out-of-band.
        Cancelled => "cancelled",
    }
);

impl JobStatus {
    /// Terminal jobs never change again (invariant 5).
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::Cancelled)
    }

    /// The job state machine: `queued → running → succeeded | failed | cancelled`,
    /// with `running ⇄ unknown`. An operator may cancel any job that is not terminal,
    /// and a job whose only attempts failed before starting can fail from `queued`.
    pub fn can_become(self, to: JobStatus) -> bool {
        use JobStatus::*;
        matches!(
            (self, to),
            (Queued, Running)
                | (Queued, Failed)
                | (Queued, Cancelled)
                | (Running, Unknown)
                | (Unknown, Running)
                | (Running, Succeeded)
                | (Running, Failed)
                | (Running, Cancelled)
                | (Unknown, Succeeded)
                | (Unknown, Failed)
                | (Unknown, Cancelled)
        )
    }
}

impl AttemptStatus {
    /// Terminal attempts never change status again.
    pub fn is_terminal(self) -> bool {
        !self.is_open()
    }

    /// Open attempts block new ones (invariants 2 and 3).
    pub fn is_open(self) -> bool {
        matches!(self, Self::Queued | Self::Started | Self::Unknown)
    }

    /// The attempt state machine: `queued → started → succeeded | failed | unknown |
    /// discarded | cancelled`; `unknown → succeeded | discarded | failed | cancelled`
    /// (a late answer, or out-of-band resolution); a queued attempt may be cancelled
    /// or failed before it starts.
    pub fn can_become(self, to: AttemptStatus) -> bool {
        use AttemptStatus::*;
        matches!(
            (self, to),
            (Queued, Started)
                | (Queued, Cancelled)
                | (Queued, Failed)
                | (Started, Succeeded)
                | (Started, Failed)
                | (Started, Unknown)
                | (Started, Discarded)
                | (Started, Cancelled)
                | (Unknown, Succeeded)
                | (Unknown, Discarded)
                | (Unknown, Failed)
                | (Unknown, Cancelled)
        )
    }
}

/// One golden case's outcome.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CaseResult {
    /// Its position in `cases`.
    pub index: usize,
    /// Whether every check passed.
    pub passed: bool,
    /// What passed, or what failed.
    pub detail: String,
    /// The rendered prompt's token count (system and user messages with framing).
    pub prompt_tokens: Option<usize>,
    /// Whether that count is an estimate (the model's own encoding is not known).
    pub tokens_estimated: bool,
    /// The round trip, if the provider answered.
    pub latency_ms: Option<u64>,
}

/// A qualification run of one provider for one operation.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Qualification {
    /// The provider.
    pub provider: String,
    /// The operation.
    pub operation: String,
    /// The contract the run was made against.
    pub contract_hash: String,
    /// Whether every case passed (and there was at least one).
    pub passed: bool,
    /// The cases.
    pub cases: Vec<CaseResult>,
}

/// The body of a message on `onejob.attempts.<provider>`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttemptMessage {
    /// The attempt to run.
    pub attempt_id: AttemptId,
    /// Its job.
    pub job_id: JobId,
}

/// Why a job failed or was cancelled, as its owner and its events' readers
/// see it: a stable code and a message written by onejob. A stored error starts
/// with its code (`provider_error: HTTP 401: …`); the rest, the provider's own
/// text (status lines, body excerpts), is for operators only (`onejob jobs
/// show`). An unknown code is shown as `failed`.
pub fn public_error(stored: &str) -> (&'static str, &'static str) {
    let code = stored.split(':').next().unwrap_or_default().trim();
    let (code, message) = match code {
        "provider_error" => ("provider_error", "the provider refused the request"),
        "provider_unreachable" => ("provider_unreachable", "the provider could not be reached"),
        "contract_violation" => (
            "contract_violation",
            "the provider's answer did not match the operation's output schema",
        ),
        "outcome_unknown" => (
            "outcome_unknown",
            "a provider call ended without a known outcome",
        ),
        "template_error" => (
            "template_error",
            "the input does not fit the operation's prompt",
        ),
        "no_qualified_provider" => (
            "no_qualified_provider",
            "no provider qualified for this operation was left to try",
        ),
        "attempt_lost" | "dead_lettered" => (
            "attempt_lost",
            "an attempt could not be delivered to its provider",
        ),
        "unknown_operation" => ("unknown_operation", "the operation is no longer configured"),
        "resolved_failed" => (
            "resolved_failed",
            "an operator ended the job's last attempt as failed",
        ),
        "cancelled" => ("cancelled", "the job was cancelled"),
        _ => ("failed", "the job failed"),
    };
    (code, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_strings_round_trip() {
        for s in JobStatus::ALL {
            assert_eq!(s.as_str().parse::<JobStatus>().unwrap(), *s);
        }
        for s in AttemptStatus::ALL {
            assert_eq!(s.as_str().parse::<AttemptStatus>().unwrap(), *s);
        }
        assert!("done".parse::<JobStatus>().is_err());
        assert!("Started".parse::<AttemptStatus>().is_err());
    }

    /// The whole job transition table, every pair, spelled out so a change to the
    /// state machine must change this test too.
    #[test]
    fn job_transition_table_is_exact() {
        use JobStatus::*;
        let allowed = [
            (Queued, Running),
            (Queued, Failed),
            (Queued, Cancelled),
            (Running, Unknown),
            (Unknown, Running),
            (Running, Succeeded),
            (Running, Failed),
            (Running, Cancelled),
            (Unknown, Succeeded),
            (Unknown, Failed),
            (Unknown, Cancelled),
        ];
        for &from in JobStatus::ALL {
            for &to in JobStatus::ALL {
                assert_eq!(
                    from.can_become(to),
                    allowed.contains(&(from, to)),
                    "{from} -> {to}"
                );
            }
        }
    }

    #[test]
    fn terminal_jobs_never_change() {
        for &from in JobStatus::ALL.iter().filter(|s| s.is_terminal()) {
            for &to in JobStatus::ALL {
                assert!(!from.can_become(to), "{from} -> {to}");
            }
        }
        // Only a job that has an outcome is terminal.
        let terminal: Vec<_> = JobStatus::ALL.iter().filter(|s| s.is_terminal()).collect();
        assert_eq!(
            terminal,
            [
                &JobStatus::Succeeded,
                &JobStatus::Failed,
                &JobStatus::Cancelled
            ]
        );
    }

    #[test]
    fn attempt_transition_table_is_exact() {
        use AttemptStatus::*;
        let allowed = [
            (Queued, Started),
            (Queued, Cancelled),
            (Queued, Failed),
            (Started, Succeeded),
            (Started, Failed),
            (Started, Unknown),
            (Started, Discarded),
            (Started, Cancelled),
            (Unknown, Succeeded),
            (Unknown, Discarded),
            (Unknown, Failed),
            (Unknown, Cancelled),
        ];
        for &from in AttemptStatus::ALL {
            for &to in AttemptStatus::ALL {
                assert_eq!(
                    from.can_become(to),
                    allowed.contains(&(from, to)),
                    "{from} -> {to}"
                );
            }
        }
        for &from in AttemptStatus::ALL.iter().filter(|s| s.is_terminal()) {
            for &to in AttemptStatus::ALL {
                assert!(!from.can_become(to), "{from} -> {to}");
            }
        }
        // Nothing goes back to queued, and unknown is never left for queued or started.
        for &from in AttemptStatus::ALL {
            assert!(!from.can_become(Queued));
        }
        assert!(!Unknown.can_become(Started));
    }
}
