//! Reading a message's headers, and escaping text that came from outside
//! before it is shown or logged.

use lapin::types::{AMQPValue, FieldTable};

/// A header's value as text, if it is a string.
pub fn header_str(headers: &FieldTable, name: &str) -> Option<String> {
    match headers.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.to_string()),
        _ => None,
    }
}

/// A whole-number header (a delivery count, say) as the broker or a publisher
/// set it; 0 when it is absent, negative or not a number.
pub fn header_count(headers: &FieldTable, name: &str) -> u64 {
    match headers.inner().get(name) {
        Some(AMQPValue::LongLongInt(n)) => u64::try_from(*n).unwrap_or(0),
        Some(AMQPValue::LongInt(n)) => u64::try_from(*n).unwrap_or(0),
        Some(AMQPValue::LongUInt(n)) => u64::from(*n),
        Some(AMQPValue::ShortInt(n)) => u64::try_from(*n).unwrap_or(0),
        _ => 0,
    }
}

/// Text that came from outside (a publisher's header, a provider's error)
/// with every control character escaped (`\u{1b}`), so that it can clear no
/// screen, write no clipboard and forge no log line wherever it is shown.
pub fn escape_controls(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    out
}
