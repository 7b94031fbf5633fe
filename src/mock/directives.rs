//! The `mock:` directives a request's text may carry, when the mock obeys
//! them: each clamped.

use super::{MAX_DELAY_MS, MAX_PAD, MAX_RETRY_AFTER_S};

/// Directives found in a request's text.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Directives {
    pub(super) delay: Option<u64>,
    pub(super) status: Option<u16>,
    pub(super) retry_after: Option<u64>,
    pub(super) prose: bool,
    pub(super) extra_key: bool,
    pub(super) wrong_type: bool,
    pub(super) drop: bool,
    pub(super) nul: bool,
    pub(super) pad: Option<usize>,
    pub(super) no_id: bool,
    /// A batch's window runs out at this line (`mock:expire`).
    pub(super) expire: bool,
    /// A batch writes this line's result twice (`mock:duplicate`).
    pub(super) duplicate: bool,
    /// Every read of a batch's status waits this long, in milliseconds
    /// (`mock:slow_status=MS`).
    pub(super) slow_status: Option<u64>,
    /// Not a directive: the request's own `max_tokens`, the most completion
    /// tokens the answer may report.
    pub(super) max_tokens: Option<u64>,
}

pub(super) fn directives(text: &str) -> Directives {
    let mut d = Directives::default();
    for word in text.split(|c: char| c.is_whitespace() || c == '"' || c == ',') {
        let Some(rest) = word.strip_prefix("mock:") else {
            continue;
        };
        let (name, value) = rest.split_once('=').unwrap_or((rest, ""));
        match name {
            "delay" => d.delay = value.parse::<u64>().ok().map(|ms| ms.min(MAX_DELAY_MS)),
            "status" => d.status = value.parse().ok().filter(|c| (100..=599).contains(c)),
            "retry_after" => {
                d.retry_after = value.parse::<u64>().ok().map(|s| s.min(MAX_RETRY_AFTER_S));
            }
            "prose" => d.prose = true,
            "extra_key" => d.extra_key = true,
            "wrong_type" => d.wrong_type = true,
            "drop" => d.drop = true,
            "nul" => d.nul = true,
            "no_id" => d.no_id = true,
            "expire" => d.expire = true,
            "duplicate" => d.duplicate = true,
            "slow_status" => {
                d.slow_status = value.parse::<u64>().ok().map(|ms| ms.min(MAX_DELAY_MS));
            }
            "pad" => {
                d.pad = value
                    .parse::<u64>()
                    .ok()
                    .map(|p| p.min(MAX_PAD as u64) as usize)
            }
            _ => {}
        }
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directives_are_found_in_text() {
        let d = directives(
            "Summarize: hello mock:delay=250 mock:status=503, \"mock:drop\" mock:unknown",
        );
        assert_eq!(
            d,
            Directives {
                delay: Some(250),
                status: Some(503),
                drop: true,
                ..Directives::default()
            }
        );
        assert_eq!(directives("nothing here"), Directives::default());
        let batch = directives("mock:expire mock:duplicate mock:slow_status=999999999");
        assert_eq!(
            batch,
            Directives {
                expire: true,
                duplicate: true,
                slow_status: Some(MAX_DELAY_MS),
                ..Directives::default()
            },
            "a batch's directives, the slow status clamped to a minute"
        );
    }
}
