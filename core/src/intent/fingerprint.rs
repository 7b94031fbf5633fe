//! An intent's fingerprint: what tells a retry of one request from another
//! request under the same identity.

use std::fmt;

use super::Intent;

impl Intent {
    /// The intent's fingerprint: SHA-256 over the RFC 8785 canonical JSON of
    /// `{operation, input, provider}`, so key order and whitespace never change it.
    pub fn fingerprint(&self) -> Fingerprint {
        let canonical_input = serde_json::json!({
            "operation": self.operation,
            "input": self.input,
            "provider": self.provider,
        });
        Fingerprint(crate::domain::canonical_sha256(&canonical_input))
    }
}

/// The hex SHA-256 of an intent's canonical form, stored on the job.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub String);

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
