//! Bearer tokens: the HTTP gateway's, one tenant (owner) each, and the
//! operator console's, one operator each.
//!
//! A tenant token is `ojt_` and an operator token `ojo_`, then 64 hex digits of randomness (256 bits). The database keeps
//! only its SHA-256, so a leaked database (or a backup) hands out no tokens and a
//! token can be shown only once, when `onejob tokens create` makes it. Lookups go
//! by that digest, so no comparison ever runs over the secret itself.

use std::fmt;

use rand::RngCore;
use sha2::{Digest, Sha256};

use crate::domain::hex;

/// Every tenant token starts with this, so a token found in a log or a paste is
/// recognisable (and secret scanners can match it).
pub const PREFIX: &str = "ojt_";

/// Every operator token starts with this instead: the gateway does not take
/// one (it is not `ojt_`), and the console takes nothing else.
pub const OPERATOR_PREFIX: &str = "ojo_";

const RANDOM_BYTES: usize = 32;

/// A bearer token. Its `Debug` form never shows the secret.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(String);

impl Token {
    /// A new random tenant token.
    pub fn generate() -> Token {
        Self::generate_with(PREFIX)
    }

    /// A new random operator token.
    pub fn generate_operator() -> Token {
        Self::generate_with(OPERATOR_PREFIX)
    }

    fn generate_with(prefix: &str) -> Token {
        Token(format!("{prefix}{}", random_hex(RANDOM_BYTES)))
    }

    /// Reads a tenant token as a client presented it; `None` when it cannot be
    /// one (wrong prefix, length or alphabet), so such a value never reaches the
    /// database.
    pub fn parse(text: &str) -> Option<Token> {
        Self::parse_with(text, PREFIX)
    }

    /// Reads an operator token as an operator presented it; `None` when it
    /// cannot be one (a tenant token among them).
    pub fn parse_operator(text: &str) -> Option<Token> {
        Self::parse_with(text, OPERATOR_PREFIX)
    }

    fn parse_with(text: &str, prefix: &str) -> Option<Token> {
        let digits = text.strip_prefix(prefix)?;
        (digits.len() == RANDOM_BYTES * 2
            && digits
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
        .then(|| Token(text.to_owned()))
    }

    /// The token itself, to hand to its owner once.
    pub fn reveal(&self) -> &str {
        &self.0
    }

    /// The digest the database keeps.
    pub fn digest(&self) -> String {
        sha256_hex(&self.0)
    }
}

/// `bytes` random bytes as lowercase hex: a session id, a form token.
pub fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    rand::rng().fill_bytes(&mut buf);
    hex(&buf)
}

/// The SHA-256 of `text`, as lowercase hex: what the database keeps of a secret.
pub fn sha256_hex(text: &str) -> String {
    hex(&Sha256::digest(text.as_bytes()))
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Token({}…)", &self.0[..PREFIX.len()])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_tokens_parse_and_differ() {
        let a = Token::generate();
        let b = Token::generate();
        assert_ne!(a, b);
        assert_eq!(Token::parse(a.reveal()), Some(a.clone()));
        assert_eq!(a.reveal().len(), PREFIX.len() + 64);
        assert_ne!(a.digest(), b.digest());
        assert_eq!(a.digest().len(), 64);
    }

    #[test]
    fn foreign_values_are_not_tokens() {
        let good = Token::generate();
        let digits = &good.reveal()[PREFIX.len()..];
        for bad in [
            String::new(),
            "ojt_".into(),
            digits.to_owned(),
            format!("xyz_{digits}"),
            format!("{PREFIX}{}", &digits[1..]),
            format!("{PREFIX}{digits}0"),
            format!("{PREFIX}{}", digits.to_uppercase()),
            format!("{PREFIX}{}g", &digits[1..]),
        ] {
            assert_eq!(Token::parse(&bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_two_kinds_never_parse_as_each_other() {
        let tenant = Token::generate();
        let operator = Token::generate_operator();
        assert!(operator.reveal().starts_with(OPERATOR_PREFIX));
        assert_eq!(
            Token::parse_operator(operator.reveal()),
            Some(operator.clone())
        );
        assert_eq!(Token::parse(operator.reveal()), None);
        assert_eq!(Token::parse_operator(tenant.reveal()), None);
        assert_eq!(format!("{operator:?}"), "Token(ojo_…)");
    }

    #[test]
    fn debug_hides_the_secret() {
        let t = Token::generate();
        assert!(!format!("{t:?}").contains(&t.reveal()[PREFIX.len()..]));
    }
}
