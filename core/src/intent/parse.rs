//! Reading an intent's fields, from an AMQP message or a gateway request, and
//! checking each against the contract.

use std::collections::BTreeMap;

use serde_json::Value;

use super::body::members;
use super::{
    Intent, MAX_IDEMPOTENCY_KEY_CHARS, MAX_OPERATION_CHARS, MAX_OWNER_ID_CHARS, MAX_PROVIDER_CHARS,
    RejectReason,
};

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
