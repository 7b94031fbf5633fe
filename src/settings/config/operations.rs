//! `[operations.NAME]`: what to ask, the route of providers that may answer,
//! the contract each answer must honour, and the golden cases that qualify a
//! provider for it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

use super::checks::{at_least, check_name, duration, invalid};
use super::retention::{RawRetention, Retention, parse_retention};
use super::{Provider, ProviderKind, Result};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawOperation {
    system: String,
    prompt: String,
    output_schema: toml::Value,
    route: Vec<String>,
    max_attempts: Option<u32>,
    temperature: Option<f64>,
    max_tokens: Option<u32>,
    hedge_after: Option<String>,
    retention: Option<RawRetention>,
    #[serde(default)]
    cases: Vec<RawCase>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCase {
    input: toml::Value,
}

/// One configured operation: what to ask and what shape the answer must have.
#[derive(Clone)]
pub struct Operation {
    /// Its name, the key under `[operations]`.
    pub name: String,
    /// The system message template.
    pub system: String,
    /// The user message template, over the intent's `input`.
    pub prompt: String,
    /// The JSON Schema every answer must satisfy.
    pub output_schema: Value,
    /// Providers in failover order; the first is the primary.
    pub route: Vec<String>,
    /// Attempts in all, at most.
    pub max_attempts: u32,
    /// Sampling temperature sent to the provider.
    pub temperature: f64,
    /// The output cap sent to the provider on every call, and what a budget
    /// reserves for each attempt beyond its prompt's tokens.
    pub max_tokens: u32,
    /// After this much silence, start one parallel attempt (hedging).
    pub hedge_after: Option<Duration>,
    /// How long its jobs are kept once they ended: `[retention]`, with the
    /// operation's own `retention` table over it.
    pub retention: Retention,
    /// Golden inputs for qualification.
    pub cases: Vec<serde_json::Map<String, Value>>,
    validator: Arc<jsonschema::Validator>,
}

impl std::fmt::Debug for Operation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Operation")
            .field("name", &self.name)
            .field("route", &self.route)
            .field("max_attempts", &self.max_attempts)
            .finish_non_exhaustive()
    }
}

/// `max_tokens` when an operation does not set it.
const DEFAULT_MAX_TOKENS: u32 = 1024;

/// The largest `max_tokens`: past any model's output window, and small enough
/// that a reservation of many of them stays far from overflowing.
const MAX_MAX_TOKENS: u32 = 1_000_000;

/// The longest contract-violation text kept, in characters: the schema's
/// message quotes the offending value, which can be megabytes, and the text is
/// stored on the attempt and logged.
const VIOLATION_CHARS: usize = 500;

/// `text` cut to [`VIOLATION_CHARS`], with `…` where it was cut.
fn bounded(text: &str) -> String {
    let mut out: String = text.chars().take(VIOLATION_CHARS).collect();
    if text.chars().nth(VIOLATION_CHARS).is_some() {
        out.push('…');
    }
    out
}

/// Why an answer does not honour the operation's output contract.
#[derive(Debug, thiserror::Error)]
pub enum ContractViolation {
    /// The content is not JSON.
    #[error("contract_violation: content is not JSON: {0}")]
    NotJson(String),
    /// The JSON does not satisfy `output_schema`.
    #[error("contract_violation: {0}")]
    Schema(String),
    /// The JSON holds NUL, which Postgres cannot store: the answer can never
    /// become a result.
    #[error(
        "contract_violation: the answer holds a NUL character (\\u0000), which cannot be stored"
    )]
    Nul,
}

/// A prompt that could not be rendered from an input.
#[derive(Debug, thiserror::Error)]
#[error("template_error: {0}")]
pub struct TemplateError(pub(super) String);

/// The messages rendered for one call.
#[derive(Clone, Debug, PartialEq)]
pub struct Rendered {
    /// The system message.
    pub system: String,
    /// The user message.
    pub user: String,
}

impl Operation {
    /// Checks an answer's content against `output_schema` and returns it parsed.
    pub fn check_output(&self, content: &str) -> Result<Value, ContractViolation> {
        let value: Value = serde_json::from_str(content.trim())
            .map_err(|e| ContractViolation::NotJson(bounded(&e.to_string())))?;
        if crate::intent::has_nul(&value) {
            return Err(ContractViolation::Nul);
        }
        if let Some(error) = self.validator.iter_errors(&value).next() {
            let path = error.instance_path().to_string();
            let at = if path.is_empty() { "/" } else { &path };
            return Err(ContractViolation::Schema(bounded(&format!(
                "at {at}: {error}"
            ))));
        }
        Ok(value)
    }
}

/// An operation's route: at least one provider, each configured, none twice.
fn check_route(
    origin: &str,
    at: &str,
    route: &[String],
    providers: &BTreeMap<String, Provider>,
) -> Result<()> {
    if route.is_empty() {
        return Err(invalid(origin, at, "must name at least one provider"));
    }
    for (i, p) in route.iter().enumerate() {
        if !providers.contains_key(p) {
            return Err(invalid(
                origin,
                format!("{at}[{i}]"),
                format!("{p:?} is not a configured provider"),
            ));
        }
        if route[..i].contains(p) {
            return Err(invalid(
                origin,
                format!("{at}[{i}]"),
                format!("{p:?} appears twice"),
            ));
        }
    }
    Ok(())
}

/// `temperature`: 0.0 to 2.0, and at most the highest every kind on the
/// route takes (Anthropic's Messages API takes 0.0 to 1.0: a higher one
/// would fail every call to it).
fn check_temperature(
    origin: &str,
    at: &dyn Fn(&str) -> String,
    temperature: Option<f64>,
    route: &[String],
    providers: &BTreeMap<String, Provider>,
) -> Result<f64> {
    let temperature = temperature.unwrap_or(0.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(invalid(
            origin,
            at("temperature"),
            "must be between 0.0 and 2.0",
        ));
    }
    let anthropic = route
        .iter()
        .filter_map(|p| providers.get(p))
        .find(|p| p.kind == ProviderKind::Anthropic);
    if let Some(p) = anthropic
        && temperature > 1.0
    {
        return Err(invalid(
            origin,
            at("temperature"),
            format!(
                "must be at most 1.0: the route's provider {:?} is of kind \"anthropic\", whose API takes 0.0 to 1.0",
                p.name
            ),
        ));
    }
    Ok(temperature)
}

fn toml_to_json(v: toml::Value) -> Value {
    match v {
        toml::Value::String(s) => Value::String(s),
        toml::Value::Integer(i) => Value::from(i),
        toml::Value::Float(f) => serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number),
        toml::Value::Boolean(b) => Value::Bool(b),
        toml::Value::Datetime(d) => Value::String(d.to_string()),
        toml::Value::Array(a) => Value::Array(a.into_iter().map(toml_to_json).collect()),
        toml::Value::Table(t) => {
            Value::Object(t.into_iter().map(|(k, v)| (k, toml_to_json(v))).collect())
        }
    }
}

impl Operation {
    /// One `[operations.NAME]` table; its templates are added to `env`.
    pub(super) fn parse(
        origin: &str,
        name: String,
        o: RawOperation,
        providers: &BTreeMap<String, Provider>,
        (retention, outbox_retention): (Retention, Duration),
        env: &mut minijinja::Environment<'static>,
    ) -> Result<Operation> {
        let at = |field: &str| format!("operations.{name}.{field}");
        check_name(origin, &format!("operations.{name}"), &name)?;
        for (part, text) in [("system", &o.system), ("prompt", &o.prompt)] {
            env.add_template_owned(format!("{name}.{part}"), text.clone())
                .map_err(|e| {
                    invalid(origin, at(part), format!("template does not compile: {e}"))
                })?;
        }
        let (output_schema, validator) = contract(origin, &at("output_schema"), o.output_schema)?;
        check_route(origin, &at("route"), &o.route, providers)?;
        let max_attempts = at_least(origin, &at("max_attempts"), o.max_attempts, 1, 3)?;
        let temperature = check_temperature(origin, &at, o.temperature, &o.route, providers)?;
        let max_tokens = at_least(
            origin,
            &at("max_tokens"),
            o.max_tokens,
            1,
            DEFAULT_MAX_TOKENS,
        )?;
        if max_tokens > MAX_MAX_TOKENS {
            return Err(invalid(
                origin,
                at("max_tokens"),
                format!("must be at most {MAX_MAX_TOKENS}"),
            ));
        }
        let hedge_after = match &o.hedge_after {
            None => None,
            Some(_) => Some(duration(
                origin,
                &at("hedge_after"),
                &o.hedge_after,
                Duration::ZERO,
            )?),
        };
        let cases = golden_cases(origin, &at("cases"), o.cases)?;
        let retention = match &o.retention {
            None => retention,
            Some(own) => {
                parse_retention(origin, &at("retention"), own, retention, outbox_retention)?
            }
        };
        Ok(Operation {
            name,
            system: o.system,
            prompt: o.prompt,
            output_schema,
            route: o.route,
            max_attempts,
            temperature,
            max_tokens,
            hedge_after,
            retention,
            cases,
            validator: Arc::new(validator),
        })
    }
}

/// `output_schema`: a table that is a valid JSON Schema, with its validator.
fn contract(origin: &str, at: &str, schema: toml::Value) -> Result<(Value, jsonschema::Validator)> {
    let output_schema = toml_to_json(schema);
    if !output_schema.is_object() {
        return Err(invalid(
            origin,
            at,
            "must be a table (a JSON Schema object)",
        ));
    }
    let validator = jsonschema::validator_for(&output_schema)
        .map_err(|e| invalid(origin, at, format!("not a valid JSON Schema: {e}")))?;
    Ok((output_schema, validator))
}

/// `cases`: each golden case's input, a table.
fn golden_cases(
    origin: &str,
    at: &str,
    cases: Vec<RawCase>,
) -> Result<Vec<serde_json::Map<String, Value>>> {
    cases
        .into_iter()
        .enumerate()
        .map(|(i, c)| match toml_to_json(c.input) {
            Value::Object(m) => Ok(m),
            _ => Err(invalid(
                origin,
                format!("{at}[{i}].input"),
                "must be a table",
            )),
        })
        .collect()
}
