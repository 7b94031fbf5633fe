//! The intent message (contract section 3) and its receipt (section 4).
//!
//! Parsing is strict on purpose: an intent either matches the contract exactly or is
//! rejected with a reason that names the fault, because a silently "fixed" intent
//! would give a job a different identity than its publisher meant. Nothing here
//! knows about operations or providers; the worker's `Config::admit` checks those.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::domain::JobId;

/// The largest intent body accepted unless configured otherwise (1 MiB).
pub const DEFAULT_MAX_BODY_BYTES: usize = 1024 * 1024;
/// `owner_id` length limit, in characters.
pub const MAX_OWNER_ID_CHARS: usize = 128;
/// `idempotency_key` length limit, in characters.
pub const MAX_IDEMPOTENCY_KEY_CHARS: usize = 255;
/// `operation` length limit: operations are config keys, never long.
pub const MAX_OPERATION_CHARS: usize = 128;
/// `provider` length limit.
pub const MAX_PROVIDER_CHARS: usize = 128;

/// One job intent, as upstream services publish it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Intent {
    /// Who the job belongs to.
    pub owner_id: String,
    /// The publisher's key for this intention; with `owner_id`, the job's identity.
    pub idempotency_key: String,
    /// A configured operation.
    pub operation: String,
    /// The operation's input: always a JSON object.
    pub input: serde_json::Map<String, Value>,
    /// Pins the first attempt's provider.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
}

/// Why an intent was rejected. The `Display` form is what the `rejected` receipt's
/// `error` and the dead letter's `x-onejob-error` header carry: a stable code, a
/// colon, and the detail.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RejectReason {
    /// The body exceeds the size limit.
    #[error("too_large: body is {size} bytes, at most {limit} allowed")]
    TooLarge {
        /// Body size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// The body is not UTF-8.
    #[error("not_utf8: body is not valid UTF-8")]
    NotUtf8,
    /// The body is not JSON.
    #[error("invalid_json: {0}")]
    InvalidJson(String),
    /// The body is JSON, but not an object.
    #[error("not_an_object: the intent must be a JSON object")]
    NotAnObject,
    /// A field the contract does not define.
    #[error("unknown_field: {0:?} is not an intent field")]
    UnknownField(String),
    /// A gateway request's body names a field the gateway sets itself.
    #[error("unknown_field: {field:?} is not a body field over HTTP: {how}", field = .0, how = set_by(.0))]
    SetByGateway(&'static str),
    /// A field given twice, or a key given twice in one object of `input`.
    #[error("duplicate_field: {0:?} appears more than once")]
    DuplicateField(String),
    /// A number past ±(2^53 − 1) in size: canonical JSON would round it, and
    /// two different requests would have one fingerprint.
    #[error(
        "bad_number: {0} is beyond ±9007199254740991, which JSON numbers hold exactly; send it as a string"
    )]
    UnsafeNumber(String),
    /// A required field is absent.
    #[error("missing_field: {0:?} is required")]
    MissingField(&'static str),
    /// A field has the wrong JSON type.
    #[error("wrong_type: {field:?} must be {expected}")]
    WrongType {
        /// The field.
        field: &'static str,
        /// What it must be.
        expected: &'static str,
    },
    /// A field is empty or too long.
    #[error("bad_length: {field:?} must be {min} to {max} characters, got {got}")]
    BadLength {
        /// The field.
        field: &'static str,
        /// Smallest length.
        min: usize,
        /// Largest length.
        max: usize,
        /// Length found.
        got: usize,
    },
    /// A field has a character outside its allowed set.
    #[error("bad_characters: {field:?} may only contain {allowed}")]
    BadCharacters {
        /// The field.
        field: &'static str,
        /// The allowed set.
        allowed: &'static str,
    },
    /// Postgres refused to store the intent (a data error such as a value out of
    /// range): no retry can succeed.
    #[error("unstorable: the database refused the intent: {0}")]
    Unstorable(String),
    /// `operation` is not configured.
    #[error("unknown_operation: {0:?} is not a configured operation")]
    UnknownOperation(String),
    /// The input does not fit the operation's prompt (a variable it uses is
    /// missing): no provider could be asked.
    #[error("bad_input: the input does not fit operation {operation:?}: {detail}")]
    BadInput {
        /// The operation.
        operation: String,
        /// What is missing, as the template engine says it.
        detail: String,
    },
    /// `provider` is not in the operation's route.
    #[error("provider_not_in_route: {provider:?} is not in the route of operation {operation:?}")]
    ProviderNotInRoute {
        /// The pinned provider.
        provider: String,
        /// The operation.
        operation: String,
    },
    /// The `reply_to` property names a queue receipts may not go to: only
    /// direct reply-to and the queues the configuration allows.
    #[error(
        "reply_to_refused: {0:?} is neither direct reply-to (amq.rabbitmq.reply-to) nor a queue in worker.reply_queues"
    )]
    ReplyToRefused(String),
}

/// Where the gateway takes a field from instead of the body.
fn set_by(field: &str) -> &'static str {
    match field {
        "owner_id" => "the owner is the bearer token's",
        _ => "the key is the Idempotency-Key header",
    }
}

const FIELDS: [&str; 5] = [
    "owner_id",
    "idempotency_key",
    "operation",
    "input",
    "provider",
];

/// The fields a gateway request's body may carry: the owner comes from the
/// token and the key from the `Idempotency-Key` header.
const REQUEST_FIELDS: [&str; 3] = ["operation", "input", "provider"];

/// The size, encoding and shape checks every intent body passes first: a JSON
/// object, its members in source order, duplicates kept so they can be refused.
fn members(body: &[u8], max_body_bytes: usize) -> Result<Vec<(String, Value)>, RejectReason> {
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

impl Intent {
    /// Parses and validates an intent body against contract section 3. The
    /// operation and provider are checked against configuration separately.
    pub fn parse(body: &[u8], max_body_bytes: usize) -> Result<Intent, RejectReason> {
        Self::from_members(members(body, max_body_bytes)?, &FIELDS, [])
    }

    /// Parses the body of an HTTP gateway request (`operation`, `input` and
    /// `provider`) into the intent of `owner_id`, whose token the gateway checked,
    /// under the `Idempotency-Key` the request carried. The owner and key come only
    /// from there: a body naming either is refused as an unknown field. The rules
    /// are otherwise those of [`Intent::parse`], to the letter.
    pub fn from_request(
        body: &[u8],
        owner_id: &str,
        idempotency_key: &str,
        max_body_bytes: usize,
    ) -> Result<Intent, RejectReason> {
        Self::from_members(
            members(body, max_body_bytes)?,
            &REQUEST_FIELDS,
            [
                ("owner_id", Value::String(owner_id.into())),
                ("idempotency_key", Value::String(idempotency_key.into())),
            ],
        )
    }

    /// Validates an owner id alone, as `onejob tokens create` must before it gives
    /// an owner a token.
    pub fn check_owner_id(owner_id: &str) -> Result<(), RejectReason> {
        check_length("owner_id", owner_id, 1, MAX_OWNER_ID_CHARS)?;
        if !owner_id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "._:@-".contains(c))
        {
            return Err(RejectReason::BadCharacters {
                field: "owner_id",
                allowed: "A-Z a-z 0-9 . _ : @ -",
            });
        }
        Ok(())
    }

    /// Checks what a publisher sent against the contract: only `allowed` fields,
    /// each once, then the `given` ones the caller vouches for.
    fn from_members<const N: usize>(
        sent: Vec<(String, Value)>,
        allowed: &[&'static str],
        given: [(&'static str, Value); N],
    ) -> Result<Intent, RejectReason> {
        let mut fields: BTreeMap<&'static str, Value> = BTreeMap::new();
        for (key, value) in sent {
            let Some(&name) = allowed.iter().find(|f| **f == key) else {
                if let Some((field, _)) = given.iter().find(|(f, _)| *f == key) {
                    return Err(RejectReason::SetByGateway(field));
                }
                return Err(RejectReason::UnknownField(key));
            };
            if fields.insert(name, value).is_some() {
                return Err(RejectReason::DuplicateField(key));
            }
        }
        fields.extend(given);
        let owner_id = take_string(&mut fields, "owner_id")?;
        Self::check_owner_id(&owner_id)?;
        let idempotency_key = take_string(&mut fields, "idempotency_key")?;
        check_length(
            "idempotency_key",
            &idempotency_key,
            1,
            MAX_IDEMPOTENCY_KEY_CHARS,
        )?;
        if !idempotency_key
            .chars()
            .all(|c| c.is_ascii_graphic() || c == ' ')
        {
            return Err(RejectReason::BadCharacters {
                field: "idempotency_key",
                allowed: "printable ASCII",
            });
        }
        let operation = take_string(&mut fields, "operation")?;
        check_length("operation", &operation, 1, MAX_OPERATION_CHARS)?;
        let input = match fields.remove("input") {
            None => return Err(RejectReason::MissingField("input")),
            Some(Value::Object(map)) if map.iter().any(|(k, v)| k.contains('\0') || has_nul(v)) => {
                return Err(RejectReason::BadCharacters {
                    field: "input",
                    allowed: "any text but NUL (\\u0000), which Postgres cannot store",
                });
            }
            Some(Value::Object(map)) => map,
            Some(_) => {
                return Err(RejectReason::WrongType {
                    field: "input",
                    expected: "a JSON object",
                });
            }
        };
        let provider = match fields.remove("provider") {
            None => None,
            Some(Value::String(p)) => {
                check_length("provider", &p, 1, MAX_PROVIDER_CHARS)?;
                Some(p)
            }
            Some(_) => {
                return Err(RejectReason::WrongType {
                    field: "provider",
                    expected: "a string",
                });
            }
        };
        Ok(Intent {
            owner_id,
            idempotency_key,
            operation,
            input,
            provider,
        })
    }

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

/// Whether a string anywhere in `value` (a key or a value) holds NUL. serde_json
/// limits nesting to 128 levels, so the recursion is bounded.
pub fn has_nul(value: &Value) -> bool {
    match value {
        Value::String(s) => s.contains('\0'),
        Value::Array(items) => items.iter().any(has_nul),
        Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || has_nul(v)),
        _ => false,
    }
}

fn take_string(
    fields: &mut BTreeMap<&'static str, Value>,
    name: &'static str,
) -> Result<String, RejectReason> {
    match fields.remove(name) {
        None => Err(RejectReason::MissingField(name)),
        Some(Value::String(s)) => Ok(s),
        Some(_) => Err(RejectReason::WrongType {
            field: name,
            expected: "a string",
        }),
    }
}

fn check_length(
    field: &'static str,
    value: &str,
    min: usize,
    max: usize,
) -> Result<(), RejectReason> {
    let got = value.chars().count();
    if got < min || got > max {
        return Err(RejectReason::BadLength {
            field,
            min,
            max,
            got,
        });
    }
    Ok(())
}

/// The hex SHA-256 of an intent's canonical form, stored on the job.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub String);

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What intake made of an intent (contract section 4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The first intent with this identity: a new job.
    Created,
    /// Same identity, same fingerprint: the existing job.
    Duplicate,
    /// Same identity, different fingerprint: nothing handed out, nothing changed.
    Conflict,
    /// Not a valid intent.
    Rejected,
}

impl Outcome {
    /// The outcome as the receipt spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Created => "created",
            Outcome::Duplicate => "duplicate",
            Outcome::Conflict => "conflict",
            Outcome::Rejected => "rejected",
        }
    }
}

/// The receipt published to an intent's `reply_to`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Receipt {
    /// What intake made of the intent.
    pub outcome: Outcome,
    /// The job, for `created` and `duplicate`; `null` otherwise.
    pub job_id: Option<JobId>,
    /// Why, for `rejected`; `null` otherwise.
    pub error: Option<String>,
}

impl Receipt {
    /// A receipt naming a job.
    pub fn for_job(outcome: Outcome, job_id: JobId) -> Self {
        Self {
            outcome,
            job_id: Some(job_id),
            error: None,
        }
    }

    /// A `conflict` receipt: the existing job is not handed out.
    pub fn conflict() -> Self {
        Self {
            outcome: Outcome::Conflict,
            job_id: None,
            error: None,
        }
    }

    /// A `rejected` receipt with its reason.
    pub fn rejected(reason: &RejectReason) -> Self {
        Self {
            outcome: Outcome::Rejected,
            job_id: None,
            error: Some(reason.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse(s: &str) -> Result<Intent, RejectReason> {
        Intent::parse(s.as_bytes(), DEFAULT_MAX_BODY_BYTES)
    }

    const GOOD: &str = r#"{"owner_id":"acct_42","idempotency_key":"k-1","operation":"summarize","input":{"text":"hi"}}"#;

    #[test]
    fn accepts_a_good_intent() {
        let i = parse(GOOD).unwrap();
        assert_eq!(i.owner_id, "acct_42");
        assert_eq!(i.provider, None);
        let i = parse(r#"{"owner_id":"a.b:c@d-e_f","idempotency_key":"x y","operation":"o","input":{},"provider":"p"}"#).unwrap();
        assert_eq!(i.provider.as_deref(), Some("p"));
    }

    /// Two inputs that canonical JSON would make one (a key given twice, of
    /// which only the last would be kept; integers past what a double holds,
    /// rounded together) are refused, at any depth, over AMQP and HTTP alike.
    #[test]
    fn inputs_that_canonical_json_would_merge_are_refused() {
        let with_input = |input: &str| {
            format!(r#"{{"owner_id":"a","idempotency_key":"k","operation":"o","input":{input}}}"#)
        };
        let body = |input: &str| format!(r#"{{"operation":"o","input":{input}}}"#);
        for (input, code) in [
            (r#"{"a":1,"a":2}"#, "duplicate_field"),
            (
                r#"{"x":{"deep":[{"b":true,"b":false}]}}"#,
                "duplicate_field",
            ),
            (r#"{"n":9007199254740993}"#, "bad_number"),
            (r#"{"n":-9007199254740993}"#, "bad_number"),
            (r#"{"n":[1,{"m":18446744073709551615}]}"#, "bad_number"),
            (r#"{"n":123456789012345678901234567890}"#, "bad_number"),
            (r#"{"n":1e300}"#, "bad_number"),
        ] {
            let e = parse(&with_input(input)).unwrap_err().to_string();
            assert!(e.starts_with(code), "{input}: {e}");
            let e = Intent::from_request(body(input).as_bytes(), "a", "k", DEFAULT_MAX_BODY_BYTES)
                .unwrap_err()
                .to_string();
            assert!(e.starts_with(code), "{input} over HTTP: {e}");
        }
        for input in [
            r#"{"n":9007199254740991,"m":-9007199254740991,"f":0.5,"a":{"a":{"a":1}}}"#,
            r#"{"same":{"k":1},"other":{"k":1}}"#,
        ] {
            parse(&with_input(input)).unwrap_or_else(|e| panic!("{input}: {e}"));
        }
    }

    #[test]
    fn every_reject_reason_is_specific() {
        let cases: Vec<(String, &str)> = vec![
            ("not json".into(), "invalid_json"),
            ("[1,2]".into(), "not_an_object"),
            ("\"s\"".into(), "not_an_object"),
            (GOOD.replace("}}", "},\"extra\":1}"), "unknown_field"),
            (
                r#"{"owner_id":"a","owner_id":"b","idempotency_key":"k","operation":"o","input":{}}"#.into(),
                "duplicate_field",
            ),
            (r#"{"idempotency_key":"k","operation":"o","input":{}}"#.into(), "missing_field"),
            (r#"{"owner_id":"a","operation":"o","input":{}}"#.into(), "missing_field"),
            (r#"{"owner_id":"a","idempotency_key":"k","input":{}}"#.into(), "missing_field"),
            (r#"{"owner_id":"a","idempotency_key":"k","operation":"o"}"#.into(), "missing_field"),
            (r#"{"owner_id":7,"idempotency_key":"k","operation":"o","input":{}}"#.into(), "wrong_type"),
            (r#"{"owner_id":"a","idempotency_key":"k","operation":"o","input":"text"}"#.into(), "wrong_type"),
            (r#"{"owner_id":"a","idempotency_key":"k","operation":"o","input":{},"provider":1}"#.into(), "wrong_type"),
            (r#"{"owner_id":"","idempotency_key":"k","operation":"o","input":{}}"#.into(), "bad_length"),
            (
                format!(r#"{{"owner_id":"{}","idempotency_key":"k","operation":"o","input":{{}}}}"#, "a".repeat(129)),
                "bad_length",
            ),
            (
                format!(r#"{{"owner_id":"a","idempotency_key":"{}","operation":"o","input":{{}}}}"#, "k".repeat(256)),
                "bad_length",
            ),
            (r#"{"owner_id":"a b","idempotency_key":"k","operation":"o","input":{}}"#.into(), "bad_characters"),
            (r#"{"owner_id":"a","idempotency_key":"k\u00e9","operation":"o","input":{}}"#.into(), "bad_characters"),
            (r#"{"owner_id":"a","idempotency_key":"k\n","operation":"o","input":{}}"#.into(), "bad_characters"),
        ];
        for (body, code) in cases {
            let err = parse(&body).expect_err(&body);
            assert!(err.to_string().starts_with(code), "{body}: {err}");
        }
        assert_eq!(
            Intent::parse(GOOD.as_bytes(), 10),
            Err(RejectReason::TooLarge {
                size: GOOD.len(),
                limit: 10
            })
        );
        assert_eq!(
            Intent::parse(&[0xff, 0xfe], 100),
            Err(RejectReason::NotUtf8)
        );
    }

    #[test]
    fn exactly_at_the_limits_is_accepted() {
        let body = format!(
            r#"{{"owner_id":"{}","idempotency_key":"{}","operation":"o","input":{{}}}}"#,
            "a".repeat(128),
            "k".repeat(255)
        );
        parse(&body).unwrap();
        assert!(Intent::parse(body.as_bytes(), body.len()).is_ok());
    }

    #[test]
    fn fingerprint_ignores_order_and_whitespace() {
        let a = parse(r#"{"owner_id":"a","idempotency_key":"k","operation":"o","input":{"x":1,"y":{"b":2,"a":[1,2]}}}"#).unwrap();
        let b = parse("{ \"input\" : { \"y\": {\"a\": [1, 2], \"b\": 2}, \"x\": 1 },\n \"operation\":\"o\", \"idempotency_key\":\"k\",\"owner_id\":\"a\" }").unwrap();
        assert_eq!(a.fingerprint(), b.fingerprint());
        let c = parse(r#"{"owner_id":"a","idempotency_key":"k","operation":"o","input":{"x":2,"y":{"b":2,"a":[1,2]}}}"#).unwrap();
        assert_ne!(a.fingerprint(), c.fingerprint());
        let d = parse(r#"{"owner_id":"a","idempotency_key":"k","operation":"o","input":{"x":1,"y":{"b":2,"a":[2,1]}}}"#).unwrap();
        assert_ne!(a.fingerprint(), d.fingerprint());
        let mut e = a.clone();
        e.provider = Some("p".into());
        assert_ne!(a.fingerprint(), e.fingerprint());
        // Identity is not part of the fingerprint.
        let mut f = a.clone();
        f.owner_id = "other".into();
        assert_eq!(a.fingerprint(), f.fingerprint());
    }

    #[test]
    fn receipts_serialise_as_the_contract_shows() {
        let r = Receipt::conflict();
        assert_eq!(
            serde_json::to_value(&r).unwrap(),
            serde_json::json!({"outcome": "conflict", "job_id": null, "error": null})
        );
    }

    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            // Integers an intent may carry: canonical JSON keeps them apart.
            (-(MAX_SAFE_INTEGER as i64)..=MAX_SAFE_INTEGER as i64).prop_map(Value::from),
            "[ -~]{0,12}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 24, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map("[a-z]{1,4}", inner, 0..5)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    fn request(body: &str, owner: &str, key: &str) -> Result<Intent, RejectReason> {
        Intent::from_request(body.as_bytes(), owner, key, DEFAULT_MAX_BODY_BYTES)
    }

    #[test]
    fn a_gateway_request_is_the_same_intent_as_the_message() {
        let via_http = request(
            r#"{"input":{"text":"hi"},"operation":"summarize"}"#,
            "acct_42",
            "k-1",
        )
        .unwrap();
        assert_eq!(via_http, parse(GOOD).unwrap());
        assert_eq!(via_http.fingerprint(), parse(GOOD).unwrap().fingerprint());
    }

    #[test]
    fn a_gateway_request_cannot_name_its_owner_or_key() {
        for (body, field) in [
            (
                r#"{"owner_id":"someone_else","operation":"o","input":{}}"#,
                "owner_id",
            ),
            (
                r#"{"idempotency_key":"other","operation":"o","input":{}}"#,
                "idempotency_key",
            ),
        ] {
            let refused = request(body, "acct_42", "k");
            assert!(
                matches!(refused, Err(RejectReason::SetByGateway(f)) if f == field),
                "{refused:?}"
            );
            let text = refused.unwrap_err().to_string();
            assert!(
                text.starts_with("unknown_field")
                    && (text.contains("bearer token") || text.contains("Idempotency-Key header")),
                "{text}"
            );
        }
    }

    #[test]
    fn a_gateway_request_keeps_every_rule() {
        let cases = [
            (r#"{"operation":"o"}"#, "k", "missing_field"),
            (r#"{"operation":"o","input":[]}"#, "k", "wrong_type"),
            (
                r#"{"operation":"o","input":{},"x":1}"#,
                "k",
                "unknown_field",
            ),
            (
                r#"{"operation":"o","operation":"p","input":{}}"#,
                "k",
                "duplicate_field",
            ),
            (r#"{"operation":"o","input":{}}"#, "", "bad_length"),
            (
                r#"{"operation":"o","input":{}}"#,
                "tab\there",
                "bad_characters",
            ),
            (
                r#"{"operation":"o","input":{}}"#,
                "caf\u{e9}",
                "bad_characters",
            ),
            ("[]", "k", "not_an_object"),
            ("{", "k", "invalid_json"),
        ];
        for (body, key, code) in cases {
            let err = request(body, "acct_42", key).unwrap_err();
            assert!(err.to_string().starts_with(code), "{body} {key:?}: {err}");
        }
        let big = format!(
            r#"{{"operation":"o","input":{{"t":"{}"}}}}"#,
            "x".repeat(300)
        );
        assert!(matches!(
            Intent::from_request(big.as_bytes(), "a", "k", 256),
            Err(RejectReason::TooLarge { limit: 256, .. })
        ));
    }

    #[test]
    fn nul_anywhere_in_the_input_is_refused() {
        for input in [
            r#"{"t":"a\u0000b"}"#,
            r#"{"a\u0000":1}"#,
            r#"{"deep":[{"x":["ok","\u0000"]}]}"#,
        ] {
            let body = format!(
                r#"{{"owner_id":"o","idempotency_key":"k","operation":"op","input":{input}}}"#
            );
            let err = parse(&body).unwrap_err();
            assert!(
                err.to_string().starts_with("bad_characters: \"input\""),
                "{input}: {err}"
            );
        }
        assert!(
            parse(
                r#"{"owner_id":"o","idempotency_key":"k","operation":"op","input":{"t":"\u0001"}}"#
            )
            .is_ok()
        );
    }

    #[test]
    fn owner_ids_are_checked_alone() {
        assert!(Intent::check_owner_id("acct_42").is_ok());
        assert!(Intent::check_owner_id("").is_err());
        assert!(Intent::check_owner_id("a b").is_err());
        assert!(Intent::check_owner_id(&"a".repeat(MAX_OWNER_ID_CHARS + 1)).is_err());
    }

    proptest! {
        /// Arbitrary bytes never panic the parser.
        #[test]
        fn parse_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            let _ = Intent::parse(&bytes, 256);
        }

        /// Arbitrary bodies, owners and keys never panic the gateway's parser.
        #[test]
        fn from_request_never_panics(
            bytes in prop::collection::vec(any::<u8>(), 0..512),
            owner in ".{0,8}",
            key in ".{0,8}",
        ) {
            let _ = Intent::from_request(&bytes, &owner, &key, 256);
        }

        /// Re-serialising an input with keys in reverse order and extra whitespace
        /// keeps its fingerprint; changing any leaf changes it.
        #[test]
        fn fingerprint_is_canonical(input in prop::collection::btree_map("[a-z]{1,4}", json_value(), 0..5)) {
            let intent = Intent {
                owner_id: "o".into(),
                idempotency_key: "k".into(),
                operation: "op".into(),
                input: input.clone().into_iter().collect(),
                provider: None,
            };
            let reversed: Vec<String> = input
                .iter()
                .rev()
                .map(|(k, v)| format!("  {} :\n {}", serde_json::to_string(k).unwrap(), serde_json::to_string_pretty(v).unwrap()))
                .collect();
            let body = format!(
                "{{ \"input\": {{ {} }} ,\"operation\":\"op\",\"idempotency_key\":\"k\",\"owner_id\":\"o\"}}",
                reversed.join(",")
            );
            let reparsed = Intent::parse(body.as_bytes(), DEFAULT_MAX_BODY_BYTES).unwrap();
            prop_assert_eq!(reparsed.fingerprint(), intent.fingerprint());

            let mut changed = intent.clone();
            changed.input.insert("zzzzz".into(), Value::Bool(true));
            prop_assert_ne!(changed.fingerprint(), intent.fingerprint());
        }
    }
}
