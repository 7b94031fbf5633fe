//! The intent message (contract section 3) and its receipt (section 4).
//!
//! Parsing is strict on purpose: an intent either matches the contract exactly or is
//! rejected with a reason that names the fault, because a silently "fixed" intent
//! would give a job a different identity than its publisher meant. Nothing here
//! knows about operations or providers; the worker's `Config::admit` checks those.
//!
//! | file | holds |
//! |---|---|
//! | `body` | the checks every body passes first: size, UTF-8, strict JSON |
//! | `parse` | the intent's fields, checked against the contract |
//! | `reject` | why an intent was rejected |
//! | `fingerprint` | the fingerprint of an intent's canonical form |
//! | `receipt` | what intake made of an intent, as its receipt says |
//!
//! This file holds the intent itself, its limits, and the tests of its
//! parsing and fingerprint.

use serde::{Deserialize, Serialize};
use serde_json::Value;

mod body;
mod fingerprint;
mod parse;
mod receipt;
mod reject;

pub use body::MAX_SAFE_INTEGER;
pub use fingerprint::Fingerprint;
pub use parse::has_nul;
pub use receipt::{Outcome, Receipt};
pub use reject::RejectReason;

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
