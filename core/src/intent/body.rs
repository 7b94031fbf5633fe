//! The checks every intent body passes before its fields are read: its size,
//! UTF-8, and JSON read strictly, so that no two different bodies could come
//! to one canonical form (a key given twice, a number past what a double holds).

use std::fmt;

use serde::Deserialize;
use serde_json::Value;

use super::RejectReason;

/// The size, encoding and shape checks every intent body passes first: a JSON
/// object, its members in source order, duplicates kept so they can be refused.
pub(super) fn members(
    body: &[u8],
    max_body_bytes: usize,
) -> Result<Vec<(String, Value)>, RejectReason> {
    if body.len() > max_body_bytes {
        return Err(RejectReason::TooLarge {
            size: body.len(),
            limit: max_body_bytes,
        });
    }
    let text = std::str::from_utf8(body).map_err(|_| RejectReason::NotUtf8)?;
    match serde_json::from_str::<Members>(text) {
        Ok(m) => Ok(m.0),
        Err(e) => {
            let e = e.to_string();
            if e.starts_with(NOT_AN_OBJECT) {
                Err(RejectReason::NotAnObject)
            } else if let Some(key) = strict_detail(&e, DUPLICATE_KEY) {
                Err(RejectReason::DuplicateField(key.to_owned()))
            } else if let Some(number) = strict_detail(&e, UNSAFE_NUMBER) {
                Err(RejectReason::UnsafeNumber(number.to_owned()))
            } else {
                Err(RejectReason::InvalidJson(e))
            }
        }
    }
}

/// A JSON object's members in source order, keeping duplicates so they can be refused.
struct Members(Vec<(String, Value)>);

impl<'de> Deserialize<'de> for Members {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Option<Vec<(String, Value)>>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some((k, Strict(v))) = map.next_entry::<String, Strict>()? {
                    out.push((k, v));
                }
                Ok(Some(out))
            }
            // Any other JSON value parses, and is then refused as not an object.
            fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Self::Value, A::Error> {
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(None)
            }
        }
        match d.deserialize_any(V)? {
            Some(members) => Ok(Members(members)),
            None => Err(serde::de::Error::custom(NOT_AN_OBJECT)),
        }
    }
}

const NOT_AN_OBJECT: &str = "\u{0}not-an-object";
const DUPLICATE_KEY: &str = "\u{0}duplicate-key:";
const UNSAFE_NUMBER: &str = "\u{0}unsafe-number:";

/// The largest integer a double holds exactly with its neighbours apart
/// (`Number.MAX_SAFE_INTEGER`): canonical JSON writes numbers as doubles, so
/// past it two different integers would be one fingerprint.
pub const MAX_SAFE_INTEGER: u64 = (1 << 53) - 1;

/// A JSON value that canonical JSON keeps apart from every other: no object
/// with a key twice (serde_json would keep only the last), no number past
/// [`MAX_SAFE_INTEGER`] in size (canonical JSON would round it).
struct Strict(Value);

impl<'de> Deserialize<'de> for Strict {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Value;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_bool<E>(self, b: bool) -> Result<Value, E> {
                Ok(Value::Bool(b))
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<Value, E> {
                if n.unsigned_abs() > MAX_SAFE_INTEGER {
                    return Err(E::custom(format!("{UNSAFE_NUMBER}{n}")));
                }
                Ok(Value::from(n))
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<Value, E> {
                if n > MAX_SAFE_INTEGER {
                    return Err(E::custom(format!("{UNSAFE_NUMBER}{n}")));
                }
                Ok(Value::from(n))
            }
            fn visit_f64<E: serde::de::Error>(self, x: f64) -> Result<Value, E> {
                // Past 2^53 a double is a whole number that stands for many
                // decimal ones: 1e300 and 1e300 + 1 would be one request.
                if x.abs() > MAX_SAFE_INTEGER as f64 {
                    return Err(E::custom(format!("{UNSAFE_NUMBER}{x:e}")));
                }
                Ok(serde_json::Number::from_f64(x).map_or(Value::Null, Value::Number))
            }
            fn visit_str<E>(self, text: &str) -> Result<Value, E> {
                Ok(Value::String(text.to_owned()))
            }
            fn visit_string<E>(self, text: String) -> Result<Value, E> {
                Ok(Value::String(text))
            }
            fn visit_unit<E>(self) -> Result<Value, E> {
                Ok(Value::Null)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Value, A::Error> {
                let mut items = Vec::new();
                while let Some(Strict(v)) = seq.next_element::<Strict>()? {
                    items.push(v);
                }
                Ok(Value::Array(items))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Value, A::Error> {
                let mut members = serde_json::Map::new();
                while let Some((k, Strict(v))) = map.next_entry::<String, Strict>()? {
                    if members.contains_key(&k) {
                        return Err(serde::de::Error::custom(format!("{DUPLICATE_KEY}{k}")));
                    }
                    members.insert(k, v);
                }
                Ok(Value::Object(members))
            }
        }
        d.deserialize_any(V).map(Strict)
    }
}

/// The sentinel'd detail of a serde_json error raised by [`Strict`], without
/// the position serde_json appends.
fn strict_detail<'a>(error: &'a str, sentinel: &str) -> Option<&'a str> {
    let rest = error.strip_prefix(sentinel)?;
    Some(
        rest.rsplit_once(" at line ")
            .map_or(rest, |(detail, _)| detail),
    )
}
