//! `[owners]`: the limits every owner has unless `onejob owners set` gave it
//! its own, and how an owner's own settings lie over them.

use serde::Deserialize;
use serde::Serialize;

use super::Result;
use super::checks::invalid;

/// `[owners]` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawOwners {
    max_in_flight: Option<i64>,
    rate: Option<f64>,
    burst: Option<i64>,
    daily_tokens: Option<i64>,
}

/// The largest `max_in_flight` and `burst` accepted.
pub const MAX_COUNT: i64 = 1_000_000;
/// The largest `rate` accepted, intents a second.
pub const MAX_RATE: f64 = 1_000_000.0;
/// The largest `daily_tokens` accepted (a thousand times a trillion).
pub const MAX_DAILY_TOKENS: i64 = 1_000_000_000_000_000;

/// One owner's limits; 0 means "no limit" for each.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct OwnerLimits {
    /// Calls that may still run at once for the owner, across the fleet:
    /// attempts started or unknown until settled, queued retries, turns handed out.
    pub max_in_flight: i64,
    /// Intents admitted per second, a token bucket.
    pub rate: f64,
    /// What the bucket holds at most (0: one second's worth).
    pub burst: i64,
    /// Provider-reported tokens over a rolling 24 hours, discarded attempts'
    /// usage included.
    pub daily_tokens: i64,
}

/// An owner's own settings: each one set lies over `[owners]`'s, and one
/// unset (`None`) takes `[owners]`'s.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct OwnerOverrides {
    /// Its own `max_in_flight`.
    pub max_in_flight: Option<i64>,
    /// Its own `rate`.
    pub rate: Option<f64>,
    /// Its own `burst`.
    pub burst: Option<i64>,
    /// Its own `daily_tokens`.
    pub daily_tokens: Option<i64>,
}

impl OwnerLimits {
    /// These limits with an owner's own settings over them.
    pub fn with(self, own: &OwnerOverrides) -> OwnerLimits {
        OwnerLimits {
            max_in_flight: own.max_in_flight.unwrap_or(self.max_in_flight),
            rate: own.rate.unwrap_or(self.rate),
            burst: own.burst.unwrap_or(self.burst),
            daily_tokens: own.daily_tokens.unwrap_or(self.daily_tokens),
        }
    }

    /// How many intents the bucket lets through at once: `burst`, or one
    /// second's worth (at least one) when it is 0. `None` without a rate.
    pub fn bucket(&self) -> Option<(f64, i64)> {
        (self.rate > 0.0).then(|| {
            let burst = if self.burst > 0 {
                self.burst
            } else {
                // A rate is at most MAX_RATE, so this fits.
                (self.rate.ceil() as i64).max(1)
            };
            (self.rate, burst)
        })
    }
}

impl OwnerOverrides {
    /// Checks each setting given, naming it (`what` prefixes the name: a
    /// table or a flag's dashes).
    pub fn check(&self, origin: &str, what: &str) -> Result<()> {
        let count = |name: &str, v: Option<i64>, max: i64| match v {
            Some(n) if !(0..=max).contains(&n) => Err(invalid(
                origin,
                format!("{what}{name}"),
                format!("must be from 0 (no limit) to {max}, got {n}"),
            )),
            _ => Ok(()),
        };
        count("max_in_flight", self.max_in_flight, MAX_COUNT)?;
        count("burst", self.burst, MAX_COUNT)?;
        count("daily_tokens", self.daily_tokens, MAX_DAILY_TOKENS)?;
        match self.rate {
            Some(r) if !(r.is_finite() && (0.0..=MAX_RATE).contains(&r)) => Err(invalid(
                origin,
                format!("{what}rate"),
                format!("must be from 0 (no limit) to {MAX_RATE} intents a second, got {r}"),
            )),
            _ => Ok(()),
        }
    }
}

/// A limit as an operator types it (`onejob owners set`, the console): a
/// number from 0 (no limit) to `max`, or `default` (`None`: `[owners]`'s).
/// `NaN` and infinities are refused: no comparison lets them through.
pub fn parse_limit<T>(text: &str, max: T) -> Result<Option<T>, String>
where
    T: std::str::FromStr + PartialOrd + std::fmt::Display + Copy + Default,
{
    let text = text.trim();
    if text == "default" {
        return Ok(None);
    }
    match text.parse::<T>() {
        Ok(n) if n >= T::default() && n <= max => Ok(Some(n)),
        _ => Err(format!(
            "must be a number from 0 (no limit) to {max}, or `default`"
        )),
    }
}

/// `[owners]`, checked: every limit is off unless set.
pub(super) fn parse_owners(origin: &str, raw: &RawOwners) -> Result<OwnerLimits> {
    let own = OwnerOverrides {
        max_in_flight: raw.max_in_flight,
        rate: raw.rate,
        burst: raw.burst,
        daily_tokens: raw.daily_tokens,
    };
    own.check(origin, "owners.")?;
    Ok(OwnerLimits::default().with(&own))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_owners_own_settings_lie_over_the_defaults_one_by_one() {
        let defaults = OwnerLimits {
            max_in_flight: 4,
            rate: 2.0,
            burst: 0,
            daily_tokens: 1000,
        };
        let own = OwnerOverrides {
            rate: Some(0.0),
            daily_tokens: Some(50),
            ..Default::default()
        };
        let limits = defaults.with(&own);
        assert_eq!(limits.max_in_flight, 4);
        assert_eq!(limits.rate, 0.0);
        assert_eq!(limits.daily_tokens, 50);
        assert_eq!(limits.bucket(), None);
    }

    #[test]
    fn a_burst_of_zero_holds_one_seconds_worth_and_at_least_one() {
        let at = |rate, burst| OwnerLimits {
            rate,
            burst,
            ..Default::default()
        };
        assert_eq!(at(2.5, 0).bucket(), Some((2.5, 3)));
        assert_eq!(at(0.1, 0).bucket(), Some((0.1, 1)));
        assert_eq!(at(5.0, 20).bucket(), Some((5.0, 20)));
    }

    #[test]
    fn out_of_range_settings_are_named() {
        let bad = |own: OwnerOverrides| own.check("t", "owners.").unwrap_err().to_string();
        let e = bad(OwnerOverrides {
            rate: Some(f64::NAN),
            ..Default::default()
        });
        assert!(e.contains("owners.rate"), "{e}");
        let e = bad(OwnerOverrides {
            max_in_flight: Some(-1),
            ..Default::default()
        });
        assert!(
            e.contains("owners.max_in_flight") && e.contains("from 0"),
            "{e}"
        );
        let e = bad(OwnerOverrides {
            daily_tokens: Some(MAX_DAILY_TOKENS + 1),
            ..Default::default()
        });
        assert!(e.contains("owners.daily_tokens"), "{e}");
    }
}
