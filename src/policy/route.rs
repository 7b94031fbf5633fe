//! The contract's route rule (section 7): which provider takes the attempt
//! after a definite failure, or why none will. Pure.

use std::fmt;

/// Why no further attempt will be made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum GiveUp {
    /// `max_attempts` attempts have been made.
    AttemptsSpent {
        /// How many were made.
        made: u32,
    },
    /// No provider in the route may take the next attempt.
    NoEligibleProvider,
}

impl fmt::Display for GiveUp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GiveUp::AttemptsSpent { made } => write!(f, "attempts_exhausted: {made} attempts made"),
            GiveUp::NoEligibleProvider => f.write_str(
                "no_qualified_provider: no provider in the route may take the next attempt",
            ),
        }
    }
}

/// The contract's route rule (section 7): after a definite failure on `failed`, the
/// next attempt goes to the next provider in `route` after it, skipping providers that
/// are not `eligible`; past the end of the route it starts again at the first. At
/// most `max_attempts` attempts are made in all.
pub(crate) fn next_provider<'r>(
    route: &'r [String],
    eligible: impl Fn(&str) -> bool,
    failed: &str,
    attempts_made: u32,
    max_attempts: u32,
) -> Result<&'r str, GiveUp> {
    if attempts_made >= max_attempts {
        return Err(GiveUp::AttemptsSpent {
            made: attempts_made,
        });
    }
    let start = route.iter().position(|p| p == failed).map_or(0, |i| i + 1);
    (0..route.len())
        .map(|offset| route[(start + offset) % route.len()].as_str())
        .find(|p| eligible(p))
        .ok_or(GiveUp::NoEligibleProvider)
}

#[cfg(test)]
mod tests {
    use super::{GiveUp, next_provider};

    fn route(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn next_provider_follows_route_then_wraps() {
        let r = route(&["a", "b", "c"]);
        let all = |_: &str| true;
        assert_eq!(next_provider(&r, all, "a", 1, 5), Ok("b"));
        assert_eq!(next_provider(&r, all, "b", 2, 5), Ok("c"));
        assert_eq!(next_provider(&r, all, "c", 3, 5), Ok("a"));
    }

    #[test]
    fn next_provider_skips_ineligible() {
        let r = route(&["a", "b", "c"]);
        let only_a_c = |p: &str| p != "b";
        assert_eq!(next_provider(&r, only_a_c, "a", 1, 5), Ok("c"));
        let only_a = |p: &str| p == "a";
        assert_eq!(next_provider(&r, only_a, "a", 1, 5), Ok("a"));
        assert_eq!(next_provider(&r, only_a, "b", 1, 5), Ok("a"));
        let none = |_: &str| false;
        assert_eq!(
            next_provider(&r, none, "a", 1, 5),
            Err(GiveUp::NoEligibleProvider)
        );
    }

    #[test]
    fn next_provider_respects_max_attempts() {
        let r = route(&["a", "b"]);
        assert_eq!(
            next_provider(&r, |_| true, "a", 3, 3),
            Err(GiveUp::AttemptsSpent { made: 3 })
        );
        assert_eq!(next_provider(&r, |_| true, "a", 2, 3), Ok("b"));
    }

    #[test]
    fn next_provider_after_provider_outside_route_starts_at_first() {
        let r = route(&["a", "b"]);
        assert_eq!(next_provider(&r, |_| true, "gone", 1, 3), Ok("a"));
    }
}
