//! Bearer tokens of the HTTP gateway: one owner each.
//!
//! A token is `ojt_` and 64 hex digits of randomness (256 bits). The database keeps
//! only its SHA-256, so a leaked database (or a backup) hands out no tokens and a
//! token can be shown only once, when `onejob tokens create` makes it. Lookups go
//! by that digest, so no comparison ever runs over the secret itself.

use std::fmt;

use rand::RngCore;
use sha2::{Digest, Sha256};

use crate::domain::hex;

/// Every token starts with this, so a token found in a log or a paste is
/// recognisable (and secret scanners can match it).
pub const PREFIX: &str = "ojt_";

const RANDOM_BYTES: usize = 32;

/// A bearer token. Its `Debug` form never shows the secret.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(String);

impl Token {
    /// A new random token.
    pub fn generate() -> Token {
        let mut bytes = [0u8; RANDOM_BYTES];
        rand::rng().fill_bytes(&mut bytes);
        Token(format!("{PREFIX}{}", hex(&bytes)))
    }

    /// Reads a token as a client presented it; `None` when it cannot be one of
    /// ours (wrong prefix, length or alphabet), so such a value never reaches the
    /// database.
    pub fn parse(text: &str) -> Option<Token> {
        let digits = text.strip_prefix(PREFIX)?;
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
        hex(&Sha256::digest(self.0.as_bytes()))
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(ojt_…)")
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
    fn debug_hides_the_secret() {
        let t = Token::generate();
        assert!(!format!("{t:?}").contains(&t.reveal()[PREFIX.len()..]));
    }
}
