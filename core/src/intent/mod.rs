//! The intent message (contract section 3) and its receipt (section 4).
//!
//! Parsing is strict on purpose: an intent either matches the contract exactly or is
//! rejected with a reason that names the fault, because a silently "fixed" intent
//! would give a job a different identity than its publisher meant. Nothing here
//! knows about operations or providers; the worker's `Config::admit` checks those.
//!
//! | file | holds |
//! |---|---|
//! | `body` | the checks every body passes first: size, UTF-8, strict JSON |
//! | `parse` | the intent's fields, checked against the contract |
//! | `reject` | why an intent was rejected |
//! | `fingerprint` | the fingerprint of an intent's canonical form |
//! | `receipt` | what intake made of an intent, as its receipt says |

use serde::{Deserialize, Serialize};
use serde_json::Value;

mod body;
mod fingerprint;
mod parse;
mod receipt;
mod reject;
#[cfg(test)]
mod tests;

pub use body::MAX_SAFE_INTEGER;
pub use fingerprint::Fingerprint;
pub use parse::has_nul;
pub use receipt::{Outcome, Receipt};
pub use reject::RejectReason;

/// The largest intent body accepted unless configured otherwise (1 MiB).
pub const DEFAULT_MAX_BODY_BYTES: usize = 1024 * 1024;
/// `owner_id` length limit, in characters.
pub const MAX_OWNER_ID_CHARS: usize = 128;
/// `idempotency_key` length limit, in characters.
pub const MAX_IDEMPOTENCY_KEY_CHARS: usize = 255;
/// `operation` length limit: operations are config keys, never long.
pub const MAX_OPERATION_CHARS: usize = 128;
/// `provider` length limit.
pub const MAX_PROVIDER_CHARS: usize = 128;

/// One job intent, as upstream services publish it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Intent {
    /// Who the job belongs to.
    pub owner_id: String,
    /// The publisher's key for this intention; with `owner_id`, the job's identity.
    pub idempotency_key: String,
    /// A configured operation.
    pub operation: String,
    /// The operation's input: always a JSON object.
    pub input: serde_json::Map<String, Value>,
    /// Pins the first attempt's provider.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
}
