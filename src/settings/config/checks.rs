//! The checks every table shares: durations, counts, prefetches and names,
//! each failing with the setting it names.

use std::time::Duration;

use super::{ConfigError, Result};

/// The longest duration any setting accepts. Every time onejob computes from a
/// setting (deadlines, not-before times, tick intervals) then stays far from the
/// limits of the clock types, so no arithmetic on it can overflow.
pub const MAX_DURATION: Duration = Duration::from_secs(366 * 24 * 3600);

/// A count that must be at least `min`; `default` when unset.
pub(super) fn at_least<T: PartialOrd + Copy + std::fmt::Display>(
    origin: &str,
    setting: &str,
    value: Option<T>,
    min: T,
    default: T,
) -> Result<T> {
    match value {
        Some(n) if n < min => Err(invalid(origin, setting, format!("must be at least {min}"))),
        Some(n) => Ok(n),
        None => Ok(default),
    }
}

/// A consumer prefetch: from 1 to 65535, AMQP's limit.
pub(super) fn prefetch(
    origin: &str,
    setting: &str,
    value: Option<u32>,
    default: u16,
) -> Result<u16> {
    let n = at_least(origin, setting, value, 1, u32::from(default))?;
    u16::try_from(n).map_err(|_| invalid(origin, setting, "must be at most 65535"))
}

pub(super) fn invalid(
    origin: &str,
    setting: impl Into<String>,
    message: impl Into<String>,
) -> ConfigError {
    ConfigError::Invalid {
        origin: origin.to_owned(),
        setting: setting.into(),
        message: message.into(),
    }
}

pub(super) fn duration(
    origin: &str,
    setting: &str,
    text: &Option<String>,
    default: Duration,
) -> Result<Duration> {
    match text {
        None => Ok(default),
        Some(t) => {
            let d = humantime::parse_duration(t).map_err(|e| {
                invalid(
                    origin,
                    setting,
                    format!("{t:?} is not a duration like \"30s\" ({e})"),
                )
            })?;
            if d.is_zero() {
                return Err(invalid(origin, setting, "must be greater than zero"));
            }
            if d > MAX_DURATION {
                return Err(invalid(origin, setting, "must be at most 366 days"));
            }
            Ok(d)
        }
    }
}

/// The 1-based line that byte `offset` of `text` is on.
pub(super) fn line_of(text: &str, offset: usize) -> usize {
    let offset = offset.min(text.len());
    text.as_bytes()[..offset]
        .iter()
        .filter(|b| **b == b'\n')
        .count()
        + 1
}

/// Provider and operation names become queue names and routing keys: keep them to
/// a safe alphabet.
pub(super) fn check_name(origin: &str, setting: &str, name: &str) -> Result<()> {
    if name.is_empty()
        || name.len() > 64
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        return Err(invalid(
            origin,
            setting,
            "names must be 1-64 characters of A-Z a-z 0-9 _ -",
        ));
    }
    Ok(())
}
