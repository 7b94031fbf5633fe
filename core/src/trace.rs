//! W3C trace context (`traceparent`, `tracestate`) as onejob carries it across
//! its hops: in the AMQP headers of intents, attempt messages and events, and
//! in the HTTP call to a provider.
//!
//! A context that came from outside is parsed strictly, as the W3C
//! recommendation asks: a malformed `traceparent` is dropped whole (onejob then
//! starts a trace of its own), and a `tracestate` too long or with characters
//! the recommendation does not allow is dropped alone.

use lapin::types::{AMQPValue, FieldTable, LongString};

/// The header (AMQP and HTTP) that names the trace and the parent span.
pub const TRACEPARENT: &str = "traceparent";
/// The header with vendors' trace state, passed on unchanged.
pub const TRACESTATE: &str = "tracestate";
/// The one trace flag onejob knows and passes on: the trace is sampled.
const SAMPLED: u8 = 0x01;
/// The longest `tracestate` passed on; the recommendation asks for at least 512.
const MAX_TRACESTATE: usize = 512;

/// One span's place in a trace: the trace id, the span id, the flags, and the
/// vendors' state that travels with them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceContext {
    /// The trace's 16-byte id, never all zeros.
    pub trace_id: [u8; 16],
    /// The span's 8-byte id, never all zeros.
    pub span_id: [u8; 8],
    /// The trace flags; bit 0 is "sampled".
    pub flags: u8,
    /// The `tracestate` header, when there was a valid one.
    pub state: Option<String>,
}

impl TraceContext {
    /// Parses a `traceparent` (and its `tracestate`). `None` when the
    /// `traceparent` is malformed: wrong length or separators, upper-case or
    /// non-hex digits, version `ff`, or an all-zero id. A later version is read
    /// by its first four fields, as the recommendation asks.
    pub fn parse(traceparent: &str, tracestate: Option<&str>) -> Option<TraceContext> {
        let b = traceparent.as_bytes();
        let version = hex_byte(b.get(0..2)?)?;
        let well_formed = match version {
            0xff => false,
            0 => b.len() == 55,
            _ => b.len() == 55 || (b.len() > 55 && b[55] == b'-'),
        };
        if !well_formed || b[2] != b'-' || b[35] != b'-' || b[52] != b'-' {
            return None;
        }
        let trace_id: [u8; 16] = hex_bytes(&b[3..35])?;
        let span_id: [u8; 8] = hex_bytes(&b[36..52])?;
        let flags = hex_byte(&b[53..55])?;
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(TraceContext {
            trace_id,
            span_id,
            // Only the flag defined here (sampled) passes on: the others are
            // set to zero, as the recommendation asks of a flag one does not know.
            flags: flags & SAMPLED,
            state: tracestate.and_then(valid_state).map(str::to_owned),
        })
    }

    /// The context an AMQP message carries, if it carries a valid one.
    pub fn from_headers(headers: Option<&FieldTable>) -> Option<TraceContext> {
        let headers = headers?;
        let parent = crate::broker::header_str(headers, TRACEPARENT)?;
        let state = crate::broker::header_str(headers, TRACESTATE);
        TraceContext::parse(&parent, state.as_deref())
    }

    /// A new trace, sampled, with no state: where nothing upstream began one.
    pub fn root() -> TraceContext {
        let trace_id = *uuid::Uuid::new_v4().as_bytes();
        TraceContext {
            trace_id,
            span_id: new_span_id(),
            flags: SAMPLED,
            state: None,
        }
    }

    /// A new span in the same trace, with the same flags and state.
    pub fn child(&self) -> TraceContext {
        TraceContext {
            span_id: new_span_id(),
            ..self.clone()
        }
    }

    /// The child of `parent` when there is one, else a new trace.
    pub fn child_or_root(parent: Option<&TraceContext>) -> TraceContext {
        parent.map_or_else(TraceContext::root, TraceContext::child)
    }

    /// The `traceparent` header: version 00.
    pub fn traceparent(&self) -> String {
        format!(
            "00-{}-{}-{:02x}",
            hex(&self.trace_id),
            hex(&self.span_id),
            self.flags
        )
    }

    /// The trace id as 32 lower-case hex digits.
    pub fn trace_id_hex(&self) -> String {
        hex(&self.trace_id)
    }

    /// Adds `traceparent` (and `tracestate`, when there is one) to AMQP headers.
    pub fn insert_into(&self, headers: &mut FieldTable) {
        headers.insert(
            TRACEPARENT.into(),
            AMQPValue::LongString(LongString::from(self.traceparent())),
        );
        if let Some(state) = &self.state {
            headers.insert(
                TRACESTATE.into(),
                AMQPValue::LongString(LongString::from(state.as_str())),
            );
        }
    }
}

/// A `tracestate` worth passing on: not empty, not too long, and only the
/// printable ASCII the recommendation allows (no control characters).
fn valid_state(state: &str) -> Option<&str> {
    let state = state.trim_matches([' ', '\t']);
    let printable = state.bytes().all(|c| (0x20..=0x7e).contains(&c));
    (!state.is_empty() && state.len() <= MAX_TRACESTATE && printable).then_some(state)
}

fn new_span_id() -> [u8; 8] {
    loop {
        let bytes = uuid::Uuid::new_v4().into_bytes();
        let mut id = [0; 8];
        id.copy_from_slice(&bytes[..8]);
        if id != [0; 8] {
            return id;
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Two lower-case hex digits; upper case is malformed in a `traceparent`.
fn hex_byte(digits: &[u8]) -> Option<u8> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    match digits {
        [hi, lo] => Some(digit(*hi)? << 4 | digit(*lo)?),
        _ => None,
    }
}

fn hex_bytes<const N: usize>(digits: &[u8]) -> Option<[u8; N]> {
    let mut out = [0; N];
    for (i, pair) in digits.chunks(2).enumerate() {
        *out.get_mut(i)? = hex_byte(pair)?;
    }
    (digits.len() == 2 * N).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_good_traceparent_round_trips() {
        let ctx = TraceContext::parse(GOOD, Some("congo=t61rcWkgMzE")).unwrap();
        assert_eq!(ctx.traceparent(), GOOD);
        assert_eq!(ctx.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(ctx.flags, 1);
        assert_eq!(ctx.state.as_deref(), Some("congo=t61rcWkgMzE"));
    }

    #[test]
    fn malformed_traceparents_are_dropped() {
        for bad in [
            "",
            "00",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
            "0g-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0\u{1b}",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-é",
        ] {
            assert_eq!(TraceContext::parse(bad, None), None, "{bad:?}");
        }
    }

    #[test]
    fn flags_other_than_sampled_are_not_passed_on() {
        let odd = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-ff";
        let ctx = TraceContext::parse(odd, None).unwrap();
        assert_eq!(ctx.flags, 1);
        assert!(ctx.child().traceparent().ends_with("-01"));
        let unsampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-fe";
        assert_eq!(TraceContext::parse(unsampled, None).unwrap().flags, 0);
    }

    #[test]
    fn a_later_version_is_read_by_its_first_fields() {
        let later = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-03-whatever";
        let ctx = TraceContext::parse(later, None).unwrap();
        assert_eq!(ctx.flags, 1, "only the flags version 00 knows");
        assert_eq!(
            ctx.traceparent(),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        );
    }

    #[test]
    fn a_bad_tracestate_is_dropped_alone() {
        let long = "a=".to_owned() + &"b".repeat(MAX_TRACESTATE);
        for bad in ["", "  ", "a=b\u{1b}[2J", "a=b\nc=d", long.as_str()] {
            let ctx = TraceContext::parse(GOOD, Some(bad)).unwrap();
            assert_eq!(ctx.state, None, "{bad:?}");
        }
    }

    #[test]
    fn a_child_keeps_the_trace_and_a_root_starts_one() {
        let parent = TraceContext::parse(GOOD, Some("k=v")).unwrap();
        let child = TraceContext::child_or_root(Some(&parent));
        assert_eq!(child.trace_id, parent.trace_id);
        assert_ne!(child.span_id, parent.span_id);
        assert_eq!((child.flags, child.state.as_deref()), (1, Some("k=v")));
        let root = TraceContext::child_or_root(None);
        assert_ne!(root.trace_id, parent.trace_id);
        assert_eq!(TraceContext::parse(&root.traceparent(), None), Some(root));
    }

    #[test]
    fn headers_carry_it_both_ways() {
        let ctx = TraceContext::parse(GOOD, Some("k=v")).unwrap();
        let mut headers = FieldTable::default();
        ctx.insert_into(&mut headers);
        assert_eq!(TraceContext::from_headers(Some(&headers)), Some(ctx));
        assert_eq!(TraceContext::from_headers(None), None);
        let mut forged = FieldTable::default();
        forged.insert(TRACEPARENT.into(), AMQPValue::LongLongInt(7));
        assert_eq!(TraceContext::from_headers(Some(&forged)), None);
    }
}
