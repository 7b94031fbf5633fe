//! `onejob.toml`: providers, operations and worker settings (contract section 7).
//!
//! Everything is checked when the file is loaded: unknown settings, bad durations,
//! routes naming missing providers, templates that do not compile, schemas that are
//! not valid JSON Schema. A program with bad configuration stops at start with one
//! line naming the setting; it never runs half-configured. Compiled templates and
//! schemas are kept here so the hot path never parses them again.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

use crate::domain::JobStatus;
use crate::intent::{DEFAULT_MAX_BODY_BYTES, Intent, RejectReason};

/// The default database URL.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/onejob";
/// The default AMQP URL.
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// The configuration used when no `onejob.toml` exists and none was asked for:
/// one provider, the bundled mock on 127.0.0.1:8081, and a `summarize` operation.
pub const EMBEDDED_DEFAULT: &str = include_str!("default.toml");

/// The default path of the configuration file.
pub const DEFAULT_PATH: &str = "./onejob.toml";

/// A configuration problem, naming the setting at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("config {path}: cannot read: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The TOML does not parse or does not match the expected shape.
    #[error("config {origin}: {message}")]
    Parse {
        /// Where the text came from.
        origin: String,
        /// The parser's message, which names the key.
        message: String,
    },
    /// A setting has a value that cannot work.
    #[error("config {origin}: {setting}: {message}")]
    Invalid {
        /// Where the text came from.
        origin: String,
        /// The dotted path of the setting.
        setting: String,
        /// What is wrong with it.
        message: String,
    },
}

/// Result alias for configuration.
pub type Result<T, E = ConfigError> = std::result::Result<T, E>;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    worker: RawWorker,
    #[serde(default)]
    providers: BTreeMap<String, RawProvider>,
    #[serde(default)]
    operations: BTreeMap<String, RawOperation>,
    #[serde(default)]
    retention: RawRetention,
}

/// `[retention]`, or an operation's `retention` table: how long a job is kept
/// once it ended, by how it ended.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRetention {
    succeeded: Option<String>,
    failed: Option<String>,
    cancelled: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawWorker {
    delivery_limit: Option<u32>,
    max_message_bytes: Option<usize>,
    intake_prefetch: Option<u32>,
    attempt_prefetch: Option<u32>,
    batch_size: Option<usize>,
    flush_interval: Option<String>,
    pool_size: Option<u32>,
    retry_backoff: Option<String>,
    retry_backoff_max: Option<String>,
    relay_interval: Option<String>,
    outbox_lease: Option<String>,
    vanished_grace: Option<String>,
    shutdown_grace: Option<String>,
    stuck_after: Option<String>,
    max_republish: Option<u32>,
    dead_letter_scan: Option<String>,
    outbox_retention: Option<String>,
    reply_queues: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProvider {
    kind: String,
    base_url: String,
    model: String,
    api_key_env: Option<String>,
    timeout: Option<String>,
    concurrency: Option<u32>,
    context_window: Option<u32>,
    max_retry_after: Option<String>,
    unknown_statuses: Option<Vec<u16>>,
    max_response_bytes: Option<usize>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawOperation {
    system: String,
    prompt: String,
    output_schema: toml::Value,
    route: Vec<String>,
    max_attempts: Option<u32>,
    temperature: Option<f64>,
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

/// Worker-wide settings (`[worker]`), each with a production default.
#[derive(Clone, Debug)]
pub struct WorkerSettings {
    /// `x-delivery-limit` of every work queue.
    pub delivery_limit: u32,
    /// The largest intent body accepted.
    pub max_message_bytes: usize,
    /// Unacked intents one intake consumer holds at most.
    pub intake_prefetch: u16,
    /// Unacked attempt messages one attempt consumer holds at most: those being
    /// called, those waiting for their settlement to commit, and the next ones.
    pub attempt_prefetch: u16,
    /// The most intents admitted, attempts claimed (never more than the
    /// provider's `concurrency`) or attempts settled by one statement.
    pub batch_size: usize,
    /// How long a finished attempt waits for others to share its commit.
    pub flush_interval: Duration,
    /// Postgres connections per worker process.
    pub pool_size: u32,
    /// Backoff before the attempt that follows a definite failure; it doubles per
    /// attempt, with jitter, up to `retry_backoff_max`.
    pub retry_backoff: Duration,
    /// The cap on that backoff.
    pub retry_backoff_max: Duration,
    /// How often the relay looks for due outbox rows.
    pub relay_interval: Duration,
    /// How long a publisher owns an outbox row before the relay may take it over.
    pub outbox_lease: Duration,
    /// How long past its deadline a `started` attempt may stay silent before the
    /// reconciler declares its worker vanished and the attempt `unknown`.
    pub vanished_grace: Duration,
    /// How long a stopping worker waits for in-flight work.
    pub shutdown_grace: Duration,
    /// How long a published attempt may stay `queued` before the reconciler
    /// decides its message is gone and republishes it.
    pub stuck_after: Duration,
    /// Republishes of one attempt before it is failed (`attempt_lost`).
    pub max_republish: u32,
    /// How often the reconciler reads the attempts' dead-letter queues to mark
    /// the attempts whose messages died there.
    pub dead_letter_scan: Duration,
    /// How long a published outbox row is kept (a redelivered intent finds the
    /// first attempt's row within it) before the reconciler deletes it.
    pub outbox_retention: Duration,
    /// Named queues an intent's `reply_to` may name for its receipt, besides
    /// direct reply-to (`amq.rabbitmq.reply-to`), which is always allowed.
    pub reply_queues: Vec<String>,
}

impl Default for WorkerSettings {
    fn default() -> Self {
        Self {
            delivery_limit: 5,
            max_message_bytes: DEFAULT_MAX_BODY_BYTES,
            intake_prefetch: 256,
            attempt_prefetch: 512,
            batch_size: 128,
            flush_interval: Duration::from_millis(5),
            pool_size: 8,
            retry_backoff: Duration::from_secs(1),
            retry_backoff_max: Duration::from_secs(60),
            relay_interval: Duration::from_millis(500),
            outbox_lease: Duration::from_secs(30),
            vanished_grace: Duration::from_secs(30),
            shutdown_grace: Duration::from_secs(30),
            stuck_after: Duration::from_secs(600),
            max_republish: 3,
            dead_letter_scan: Duration::from_secs(30),
            outbox_retention: Duration::from_secs(3600),
            reply_queues: Vec::new(),
        }
    }
}

/// The kind of API a provider speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProviderKind {
    /// Any OpenAI-compatible `/chat/completions` endpoint.
    OpenAi,
}

/// One configured provider.
#[derive(Clone, Debug)]
pub struct Provider {
    /// Its name, the key under `[providers]`.
    pub name: String,
    /// Its API.
    pub kind: ProviderKind,
    /// Base URL, e.g. `http://127.0.0.1:8081/v1`.
    pub base_url: reqwest::Url,
    /// The model to ask for.
    pub model: String,
    /// The environment variable holding the API key, if any. The key itself is read
    /// at call time and never stored here, so it cannot reach logs or output.
    pub api_key_env: Option<String>,
    /// Past this the attempt is `unknown`, not `failed`.
    pub timeout: Duration,
    /// Calls in flight at most, per worker.
    pub concurrency: u32,
    /// The model's context window in tokens, if known.
    pub context_window: Option<u32>,
    /// The longest `Retry-After` honoured; a longer one is capped to this.
    pub max_retry_after: Duration,
    /// HTTP statuses by which a proxy says it forwarded the request and stopped
    /// waiting: the call may have run, so the attempt is `unknown`.
    pub unknown_statuses: Vec<u16>,
    /// The largest answer read from the provider; a larger one fails the attempt.
    pub max_response_bytes: usize,
}

/// The largest `worker.batch_size`: one statement's arrays stay small.
pub const MAX_BATCH_SIZE: usize = 1000;
/// The longest `worker.flush_interval`.
pub const MAX_FLUSH_INTERVAL: Duration = Duration::from_secs(1);
/// The default `max_retry_after` of a provider.
pub const DEFAULT_MAX_RETRY_AFTER: Duration = Duration::from_secs(600);
/// The default `unknown_statuses` of a provider: gateway timeout, and
/// Cloudflare's "a timeout occurred".
pub const DEFAULT_UNKNOWN_STATUSES: [u16; 2] = [504, 524];
/// The default `max_response_bytes` of a provider.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 4 * 1024 * 1024;
/// The longest duration any setting accepts. Every time onejob computes from a
/// setting (deadlines, not-before times, tick intervals) then stays far from the
/// limits of the clock types, so no arithmetic on it can overflow.
pub const MAX_DURATION: Duration = Duration::from_secs(366 * 24 * 3600);
/// How much longer than the longest provider timeout the default shutdown grace
/// is, so that a call in flight at SIGTERM can still be settled.
const SHUTDOWN_MARGIN: Duration = Duration::from_secs(5);

/// How long a job is kept once it ended, by how it ended (`[retention]`, and
/// an operation's own `retention` table over it). While it is kept, a re-send of
/// its identity is a `duplicate` (or a `conflict`); once it is pruned, the same
/// identity makes a new job. `unknown`, `queued` and `running` jobs are never
/// pruned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Retention {
    /// Kept this long after it succeeded.
    pub succeeded: Duration,
    /// Kept this long after it failed.
    pub failed: Duration,
    /// Kept this long after it was cancelled.
    pub cancelled: Duration,
}

impl Default for Retention {
    fn default() -> Self {
        const DAY: u64 = 24 * 3600;
        Self {
            succeeded: Duration::from_secs(7 * DAY),
            failed: Duration::from_secs(30 * DAY),
            cancelled: Duration::from_secs(7 * DAY),
        }
    }
}

impl Retention {
    /// Each ended status with how long it is kept.
    pub fn by_status(&self) -> [(JobStatus, Duration); 3] {
        [
            (JobStatus::Succeeded, self.succeeded),
            (JobStatus::Failed, self.failed),
            (JobStatus::Cancelled, self.cancelled),
        ]
    }
}

/// The longest retention accepted: ten years.
pub const MAX_RETENTION: Duration = Duration::from_secs(3650 * 24 * 3600);

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
pub struct TemplateError(String);

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

/// The whole configuration.
#[derive(Clone)]
pub struct Config {
    /// Where it came from: a path, or "embedded defaults".
    pub origin: String,
    /// `[worker]`.
    pub worker: WorkerSettings,
    /// `[providers.*]`, by name.
    pub providers: BTreeMap<String, Provider>,
    /// `[operations.*]`, by name.
    pub operations: BTreeMap<String, Operation>,
    /// `[retention]`: how long jobs of operations no longer configured are kept
    /// (each operation's own is in [`Operation::retention`]).
    pub retention: Retention,
    /// Settings that work but are probably not what was meant, one line each;
    /// the worker logs them at start.
    pub warnings: Vec<String>,
    templates: Arc<minijinja::Environment<'static>>,
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("origin", &self.origin)
            .field("providers", &self.providers)
            .field("operations", &self.operations)
            .finish_non_exhaustive()
    }
}

/// A provider's base URL: http or https, no credentials, ending in `/` so
/// that paths join beneath it.
fn base_url(origin: &str, at: &str, text: &str) -> Result<reqwest::Url> {
    let mut base_url =
        reqwest::Url::parse(text).map_err(|e| invalid(origin, at, format!("not a URL: {e}")))?;
    if !matches!(base_url.scheme(), "http" | "https") {
        return Err(invalid(origin, at, "must be an http or https URL"));
    }
    if !base_url.username().is_empty() || base_url.password().is_some() {
        return Err(invalid(
            origin,
            at,
            "must not carry credentials; use api_key_env",
        ));
    }
    if !base_url.path().ends_with('/') {
        let path = format!("{}/", base_url.path());
        base_url.set_path(&path);
    }
    Ok(base_url)
}

/// A count that must be at least `min`; `default` when unset.
fn at_least<T: PartialOrd + Copy + std::fmt::Display>(
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
fn prefetch(origin: &str, setting: &str, value: Option<u32>, default: u16) -> Result<u16> {
    let n = at_least(origin, setting, value, 1, u32::from(default))?;
    u16::try_from(n).map_err(|_| invalid(origin, setting, "must be at most 65535"))
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

/// `worker.reply_queues`: queue names a publisher's own service reads, never
/// one of onejob's (`onejob.…`) nor the broker's (`amq.…`): a receipt there
/// would be a message forged into another consumer's queue.
fn reply_queues(origin: &str, names: &[String]) -> Result<Vec<String>> {
    for name in names {
        if name.is_empty() || name.len() > 255 {
            return Err(invalid(
                origin,
                "worker.reply_queues",
                format!("{name:?}: a queue name is 1 to 255 bytes"),
            ));
        }
        if name.starts_with("onejob") || name.starts_with("amq.") {
            return Err(invalid(
                origin,
                "worker.reply_queues",
                format!(
                    "{name:?} is onejob's or the broker's own queue; receipts may not go there"
                ),
            ));
        }
    }
    Ok(names.to_vec())
}

impl WorkerSettings {
    /// Whether a receipt may be published to `reply_to`: direct reply-to, or
    /// a queue `reply_queues` names.
    pub fn reply_allowed(&self, reply_to: &str) -> bool {
        reply_to == "amq.rabbitmq.reply-to"
            || reply_to.starts_with("amq.rabbitmq.reply-to.")
            || self.reply_queues.iter().any(|q| q == reply_to)
    }
}

fn invalid(origin: &str, setting: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        origin: origin.to_owned(),
        setting: setting.into(),
        message: message.into(),
    }
}

fn duration(
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

/// A retention table over `defaults`. Each kept time is at least
/// `outbox_retention`, so that a job's published outbox rows are gone before
/// (or with) the job, and at most [`MAX_RETENTION`].
fn parse_retention(
    origin: &str,
    table: &str,
    raw: &RawRetention,
    defaults: Retention,
    outbox_retention: Duration,
) -> Result<Retention> {
    let one = |key: &str, text: &Option<String>, default: Duration| -> Result<Duration> {
        let setting = format!("{table}.{key}");
        let Some(t) = text else {
            return Ok(default);
        };
        let d = humantime::parse_duration(t).map_err(|e| {
            invalid(
                origin,
                &setting,
                format!("{t:?} is not a duration like \"7d\" ({e})"),
            )
        })?;
        if d > MAX_RETENTION {
            return Err(invalid(origin, &setting, "must be at most 3650 days"));
        }
        if d < outbox_retention {
            return Err(invalid(
                origin,
                &setting,
                format!(
                    "must be at least worker.outbox_retention ({}): a job's published outbox rows go before the job does",
                    humantime::format_duration(outbox_retention)
                ),
            ));
        }
        Ok(d)
    };
    Ok(Retention {
        succeeded: one("succeeded", &raw.succeeded, defaults.succeeded)?,
        failed: one("failed", &raw.failed, defaults.failed)?,
        cancelled: one("cancelled", &raw.cancelled, defaults.cancelled)?,
    })
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

impl Config {
    /// Loads the configuration: from `path` if given (it must exist), else from
    /// `./onejob.toml` if it exists, else the embedded defaults.
    pub fn load(path: Option<&Path>) -> Result<Config> {
        match path {
            Some(p) => Self::from_file(p),
            None if Path::new(DEFAULT_PATH).exists() => Self::from_file(Path::new(DEFAULT_PATH)),
            None => Self::parse(EMBEDDED_DEFAULT, "embedded defaults"),
        }
    }

    /// Loads a configuration file.
    pub fn from_file(path: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// `[worker]`: each setting checked, defaults for the rest.
    fn parse_worker(origin: &str, w: &RawWorker) -> Result<WorkerSettings> {
        let defaults = WorkerSettings::default();
        let d = |key: &str, text: &Option<String>, default: Duration| {
            duration(origin, &format!("worker.{key}"), text, default)
        };
        let worker = WorkerSettings {
            delivery_limit: at_least(
                origin,
                "worker.delivery_limit",
                w.delivery_limit,
                1,
                defaults.delivery_limit,
            )?,
            max_message_bytes: at_least(
                origin,
                "worker.max_message_bytes",
                w.max_message_bytes,
                256,
                defaults.max_message_bytes,
            )?,
            intake_prefetch: prefetch(
                origin,
                "worker.intake_prefetch",
                w.intake_prefetch,
                defaults.intake_prefetch,
            )?,
            attempt_prefetch: prefetch(
                origin,
                "worker.attempt_prefetch",
                w.attempt_prefetch,
                defaults.attempt_prefetch,
            )?,
            batch_size: at_least(
                origin,
                "worker.batch_size",
                w.batch_size,
                1,
                defaults.batch_size,
            )?,
            flush_interval: d("flush_interval", &w.flush_interval, defaults.flush_interval)?,
            pool_size: at_least(
                origin,
                "worker.pool_size",
                w.pool_size,
                2,
                defaults.pool_size,
            )?,
            retry_backoff: d("retry_backoff", &w.retry_backoff, defaults.retry_backoff)?,
            retry_backoff_max: d(
                "retry_backoff_max",
                &w.retry_backoff_max,
                defaults.retry_backoff_max,
            )?,
            relay_interval: d("relay_interval", &w.relay_interval, defaults.relay_interval)?,
            outbox_lease: d("outbox_lease", &w.outbox_lease, defaults.outbox_lease)?,
            vanished_grace: d("vanished_grace", &w.vanished_grace, defaults.vanished_grace)?,
            shutdown_grace: d("shutdown_grace", &w.shutdown_grace, defaults.shutdown_grace)?,
            stuck_after: d("stuck_after", &w.stuck_after, defaults.stuck_after)?,
            max_republish: w.max_republish.unwrap_or(defaults.max_republish),
            dead_letter_scan: d(
                "dead_letter_scan",
                &w.dead_letter_scan,
                defaults.dead_letter_scan,
            )?,
            outbox_retention: d(
                "outbox_retention",
                &w.outbox_retention,
                defaults.outbox_retention,
            )?,
            reply_queues: reply_queues(origin, w.reply_queues.as_deref().unwrap_or_default())?,
        };
        if worker.batch_size > MAX_BATCH_SIZE {
            return Err(invalid(
                origin,
                "worker.batch_size",
                format!("must be at most {MAX_BATCH_SIZE}"),
            ));
        }
        if worker.flush_interval > MAX_FLUSH_INTERVAL {
            return Err(invalid(
                origin,
                "worker.flush_interval",
                "must be at most 1s: every finished attempt waits up to this long",
            ));
        }
        if worker.retry_backoff_max < worker.retry_backoff {
            return Err(invalid(
                origin,
                "worker.retry_backoff_max",
                "must not be shorter than worker.retry_backoff",
            ));
        }
        Ok(worker)
    }

    /// One `[providers.NAME]` table.
    fn parse_provider(origin: &str, name: String, p: RawProvider) -> Result<Provider> {
        let at = |field: &str| format!("providers.{name}.{field}");
        check_name(origin, &format!("providers.{name}"), &name)?;
        let kind = match p.kind.as_str() {
            "openai" => ProviderKind::OpenAi,
            other => {
                return Err(invalid(
                    origin,
                    at("kind"),
                    format!("{other:?} is not a known kind (expected \"openai\")"),
                ));
            }
        };
        let base_url = base_url(origin, &at("base_url"), &p.base_url)?;
        if p.model.is_empty() {
            return Err(invalid(origin, at("model"), "must not be empty"));
        }
        let timeout = duration(origin, &at("timeout"), &p.timeout, Duration::from_secs(30))?;
        let concurrency = at_least(origin, &at("concurrency"), p.concurrency, 1, 16)?;
        let max_retry_after = duration(
            origin,
            &at("max_retry_after"),
            &p.max_retry_after,
            DEFAULT_MAX_RETRY_AFTER,
        )?;
        let unknown_statuses = p
            .unknown_statuses
            .unwrap_or_else(|| DEFAULT_UNKNOWN_STATUSES.to_vec());
        if let Some(bad) = unknown_statuses.iter().find(|s| !(100..=599).contains(*s)) {
            return Err(invalid(
                origin,
                at("unknown_statuses"),
                format!("{bad} is not an HTTP status"),
            ));
        }
        let max_response_bytes = at_least(
            origin,
            &at("max_response_bytes"),
            p.max_response_bytes,
            1024,
            DEFAULT_MAX_RESPONSE_BYTES,
        )?;
        if let Some(env) = &p.api_key_env
            && env.is_empty()
        {
            return Err(invalid(
                origin,
                at("api_key_env"),
                "must name an environment variable",
            ));
        }
        Ok(Provider {
            name,
            kind,
            base_url,
            model: p.model,
            api_key_env: p.api_key_env,
            timeout,
            concurrency,
            context_window: p.context_window,
            max_retry_after,
            unknown_statuses,
            max_response_bytes,
        })
    }

    /// One `[operations.NAME]` table; its templates are added to `env`.
    fn parse_operation(
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
        let output_schema = toml_to_json(o.output_schema);
        if !output_schema.is_object() {
            return Err(invalid(
                origin,
                at("output_schema"),
                "must be a table (a JSON Schema object)",
            ));
        }
        let validator = jsonschema::validator_for(&output_schema).map_err(|e| {
            invalid(
                origin,
                at("output_schema"),
                format!("not a valid JSON Schema: {e}"),
            )
        })?;
        check_route(origin, &at("route"), &o.route, providers)?;
        let max_attempts = at_least(origin, &at("max_attempts"), o.max_attempts, 1, 3)?;
        let temperature = o.temperature.unwrap_or(0.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(invalid(
                origin,
                at("temperature"),
                "must be between 0.0 and 2.0",
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
        let cases = o
            .cases
            .into_iter()
            .enumerate()
            .map(|(i, c)| match toml_to_json(c.input) {
                Value::Object(m) => Ok(m),
                _ => Err(invalid(
                    origin,
                    format!("{}[{i}].input", at("cases")),
                    "must be a table",
                )),
            })
            .collect::<Result<Vec<_>>>()?;
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
            hedge_after,
            retention,
            cases,
            validator: Arc::new(validator),
        })
    }

    /// Parses and validates configuration text.
    pub fn parse(text: &str, origin: &str) -> Result<Config> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
            origin: origin.to_owned(),
            message: e.message().to_owned()
                + &e.span()
                    .map(|s| format!(" (at line {})", line_of(text, s.start)))
                    .unwrap_or_default(),
        })?;
        let w = &raw.worker;
        let worker = Self::parse_worker(origin, w)?;
        let retention = parse_retention(
            origin,
            "retention",
            &raw.retention,
            Retention::default(),
            worker.outbox_retention,
        )?;
        if raw.providers.is_empty() {
            return Err(invalid(
                origin,
                "providers",
                "at least one provider must be configured",
            ));
        }
        let mut providers = BTreeMap::new();
        for (name, p) in raw.providers {
            providers.insert(name.clone(), Self::parse_provider(origin, name, p)?);
        }

        let mut env = minijinja::Environment::new();
        env.set_undefined_behavior(minijinja::UndefinedBehavior::Strict);
        let mut operations = BTreeMap::new();
        for (name, o) in raw.operations {
            let operation = Self::parse_operation(
                origin,
                name.clone(),
                o,
                &providers,
                (retention, worker.outbox_retention),
                &mut env,
            )?;
            operations.insert(name, operation);
        }
        if operations.is_empty() {
            return Err(invalid(
                origin,
                "operations",
                "at least one operation must be configured",
            ));
        }
        let mut worker = worker;
        let mut warnings = Vec::new();
        if let Some((slowest, timeout)) = providers
            .values()
            .map(|p| (p.name.as_str(), p.timeout))
            .max_by_key(|(_, t)| *t)
        {
            // A deploy must not turn every slow call into an unknown: by default the
            // grace outlasts the longest call, and a shorter one set by hand is named.
            if w.shutdown_grace.is_none() {
                worker.shutdown_grace = worker.shutdown_grace.max(timeout + SHUTDOWN_MARGIN);
            } else if worker.shutdown_grace < timeout {
                warnings.push(format!(
                    "config {origin}: worker.shutdown_grace ({}) is shorter than providers.{slowest}.timeout ({}): \
                     a call still in flight when the worker stops becomes `unknown` and blocks its job",
                    humantime::format_duration(worker.shutdown_grace),
                    humantime::format_duration(timeout),
                ));
            }
        }
        Ok(Config {
            origin: origin.to_owned(),
            worker,
            providers,
            operations,
            retention,
            warnings,
            templates: Arc::new(env),
        })
    }

    /// Checks an intent's operation, pinned provider and input against
    /// configuration, and returns the operation and the first attempt's provider.
    /// The input must render the operation's prompt (every variable it uses is
    /// there): an intent no provider could be asked about is rejected at once, as
    /// `bad_input`, rather than becoming a job that fails.
    pub fn admit(&self, intent: &Intent) -> Result<(&Operation, String), RejectReason> {
        let op = self
            .operations
            .get(&intent.operation)
            .ok_or_else(|| RejectReason::UnknownOperation(intent.operation.clone()))?;
        let provider = match &intent.provider {
            None => op.route[0].clone(),
            Some(p) if op.route.contains(p) => p.clone(),
            Some(p) => {
                return Err(RejectReason::ProviderNotInRoute {
                    provider: p.clone(),
                    operation: op.name.clone(),
                });
            }
        };
        if let Err(TemplateError(detail)) = self.render(op, &intent.input) {
            return Err(RejectReason::BadInput {
                operation: op.name.clone(),
                detail,
            });
        }
        Ok((op, provider))
    }

    /// Renders an operation's messages over an input. Undefined variables are errors.
    pub fn render(
        &self,
        operation: &Operation,
        input: &serde_json::Map<String, Value>,
    ) -> Result<Rendered, TemplateError> {
        let ctx = minijinja::Value::from(minijinja::value::Serde(input));
        let render = |part: &str| -> Result<String, TemplateError> {
            self.templates
                .get_template(&format!("{}.{part}", operation.name))
                .and_then(|t| t.render(&ctx))
                .map_err(|e| TemplateError(format!("{part}: {e}")))
        };
        Ok(Rendered {
            system: render("system")?,
            user: render("prompt")?,
        })
    }

    /// The provider names, sorted.
    pub fn provider_names(&self) -> Vec<String> {
        self.providers.keys().cloned().collect()
    }
}

/// The 1-based line that byte `offset` of `text` is on.
fn line_of(text: &str, offset: usize) -> usize {
    let offset = offset.min(text.len());
    text.as_bytes()[..offset]
        .iter()
        .filter(|b| **b == b'\n')
        .count()
        + 1
}

/// Provider and operation names become queue names and routing keys: keep them to
/// a safe alphabet.
fn check_name(origin: &str, setting: &str, name: &str) -> Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_defaults_load() {
        let c = Config::parse(EMBEDDED_DEFAULT, "embedded defaults").unwrap();
        assert!(c.operations.contains_key("summarize"));
        assert_eq!(c.operations["summarize"].route[0], "primary");
        assert_eq!(c.worker.delivery_limit, 5);
    }

    fn with(extra: &str) -> String {
        format!("{EMBEDDED_DEFAULT}\n{extra}")
    }

    #[test]
    fn bad_settings_are_named() {
        let cases = [
            (with("[worker]\nbogus = 1"), "bogus"),
            (
                with("[worker]\nretry_backoff = \"soon\""),
                "worker.retry_backoff",
            ),
            (
                with("[worker]\ndelivery_limit = 0"),
                "worker.delivery_limit",
            ),
            (
                EMBEDDED_DEFAULT.replace("route = [\"primary\"]", "route = [\"nope\"]"),
                "operations.summarize.route[0]",
            ),
            (
                EMBEDDED_DEFAULT.replace("kind = \"openai\"", "kind = \"grpc\""),
                "providers.primary.kind",
            ),
            (
                EMBEDDED_DEFAULT.replace("http://127.0.0.1:8081/v1", "not a url"),
                "providers.primary.base_url",
            ),
            (
                EMBEDDED_DEFAULT.replace(
                    "http://127.0.0.1:8081/v1",
                    "http://u:secret@127.0.0.1:8081/v1",
                ),
                "providers.primary.base_url",
            ),
            (
                EMBEDDED_DEFAULT.replace("Summarize: {{ text }}", "Summarize: {{ text "),
                "operations.summarize.prompt",
            ),
            (
                EMBEDDED_DEFAULT.replace("type = \"object\"", "type = \"objekt\""),
                "operations.summarize.output_schema",
            ),
            (
                EMBEDDED_DEFAULT.replace("timeout = \"30s\"", "timeout = \"0s\""),
                "providers.primary.timeout",
            ),
        ];
        for (text, setting) in cases {
            let err = Config::parse(&text, "t").expect_err(setting).to_string();
            assert!(err.contains(setting), "{setting}: {err}");
            assert!(!err.contains("secret"), "{err}");
            assert_eq!(err.lines().count(), 1, "{err}");
        }
    }

    /// Issue 9: a parse error names the line it is on, first, middle or last.
    #[test]
    fn parse_errors_name_their_own_line() {
        let lines: Vec<&str> = EMBEDDED_DEFAULT.lines().collect();
        let tail = format!("{EMBEDDED_DEFAULT}\nbogus =");
        let last = tail.lines().count();
        for (at, text) in [
            (1, format!("bogus = \n{EMBEDDED_DEFAULT}")),
            (5, {
                let mut l = lines.clone();
                l[4] = "[providers.primary";
                l.join("\n")
            }),
            (last, tail.clone()),
        ] {
            let err = Config::parse(&text, "t").unwrap_err().to_string();
            assert!(
                err.ends_with(&format!("(at line {at})")),
                "line {at}: {err}"
            );
        }
        assert_eq!(line_of("a\nb\nc", 0), 1);
        assert_eq!(line_of("a\nb\nc", 2), 2);
        assert_eq!(line_of("a\nb\nc", 99), 3);
    }

    #[test]
    fn provider_limits_have_defaults_and_bounds() {
        let c = Config::parse(EMBEDDED_DEFAULT, "t").unwrap();
        let p = &c.providers["primary"];
        assert_eq!(p.max_retry_after, Duration::from_secs(600));
        assert_eq!(p.unknown_statuses, vec![504, 524]);
        assert_eq!(p.max_response_bytes, DEFAULT_MAX_RESPONSE_BYTES);
        let text = EMBEDDED_DEFAULT.replace(
            "model = \"mock-model\"",
            "model = \"mock-model\"\nmax_retry_after = \"1m\"\nunknown_statuses = []",
        );
        let c = Config::parse(&text, "t").unwrap();
        assert_eq!(
            c.providers["primary"].max_retry_after,
            Duration::from_secs(60)
        );
        assert!(c.providers["primary"].unknown_statuses.is_empty());
        for (extra, setting) in [
            (
                "unknown_statuses = [5040]",
                "providers.primary.unknown_statuses",
            ),
            (
                "max_response_bytes = 10",
                "providers.primary.max_response_bytes",
            ),
            (
                "max_retry_after = \"0s\"",
                "providers.primary.max_retry_after",
            ),
        ] {
            let text = EMBEDDED_DEFAULT.replace(
                "model = \"mock-model\"",
                &format!("model = \"mock-model\"\n{extra}"),
            );
            let err = Config::parse(&text, "t").unwrap_err().to_string();
            assert!(err.contains(setting), "{err}");
        }
    }

    /// The tuning settings have defaults that suit a small machine, and bounds
    /// that name the setting.
    #[test]
    fn retention_has_defaults_overrides_and_bounds() {
        const DAY: u64 = 24 * 3600;
        let c = Config::parse(EMBEDDED_DEFAULT, "t").unwrap();
        let defaults = Retention {
            succeeded: Duration::from_secs(7 * DAY),
            failed: Duration::from_secs(30 * DAY),
            cancelled: Duration::from_secs(7 * DAY),
        };
        assert_eq!(c.retention, defaults);
        assert_eq!(c.operations["summarize"].retention, defaults);

        // [retention] over the defaults, and an operation's own table over that.
        let text = EMBEDDED_DEFAULT.replace(
            "[operations.summarize]",
            "[operations.summarize]\nretention = { failed = \"2d\" }",
        ) + "\n[retention]\nsucceeded = \"24h\"\n";
        let c = Config::parse(&text, "t").unwrap();
        assert_eq!(c.retention.succeeded, Duration::from_secs(DAY));
        assert_eq!(c.retention.failed, Duration::from_secs(30 * DAY));
        let op = c.operations["summarize"].retention;
        assert_eq!(
            (op.succeeded, op.failed, op.cancelled),
            (
                Duration::from_secs(DAY),
                Duration::from_secs(2 * DAY),
                Duration::from_secs(7 * DAY)
            )
        );

        for (bad, message) in [
            (
                "[retention]\nsucceeded = \"soon\"",
                "retention.succeeded: \"soon\" is not a duration",
            ),
            (
                "[retention]\nfailed = \"30m\"",
                "retention.failed: must be at least worker.outbox_retention (1h)",
            ),
            (
                "[retention]\ncancelled = \"3651days\"",
                "retention.cancelled: must be at most 3650 days",
            ),
            ("[retention]\nkept = \"1d\"", "unknown field `kept`"),
        ] {
            let e = Config::parse(&format!("{EMBEDDED_DEFAULT}\n{bad}\n"), "t")
                .unwrap_err()
                .to_string();
            assert!(e.contains(message), "{bad}: {e}");
        }
        let text = EMBEDDED_DEFAULT.replace(
            "[operations.summarize]",
            "[operations.summarize]\nretention = { succeeded = \"10m\" }",
        );
        let e = Config::parse(&text, "t").unwrap_err().to_string();
        assert!(
            e.contains("operations.summarize.retention.succeeded: must be at least"),
            "{e}"
        );
    }

    #[test]
    fn tuning_has_defaults_and_bounds() {
        let c = Config::parse(EMBEDDED_DEFAULT, "t").unwrap();
        assert_eq!(c.worker.intake_prefetch, 256);
        assert_eq!(
            (
                c.worker.attempt_prefetch,
                c.worker.batch_size,
                c.worker.flush_interval,
                c.worker.pool_size
            ),
            (512, 128, Duration::from_millis(5), 8)
        );
        let with = |worker: &str| format!("[worker]\n{worker}\n{EMBEDDED_DEFAULT}");
        let c = Config::parse(
            &with(
                "batch_size = 1000\nflush_interval = \"1s\"\npool_size = 2\nattempt_prefetch = 1",
            ),
            "t",
        )
        .unwrap();
        assert_eq!(
            (
                c.worker.batch_size,
                c.worker.flush_interval,
                c.worker.pool_size
            ),
            (1000, Duration::from_secs(1), 2)
        );
        for (bad, message) in [
            ("batch_size = 0", "worker.batch_size: must be at least 1"),
            (
                "batch_size = 1001",
                "worker.batch_size: must be at most 1000",
            ),
            (
                "flush_interval = \"0ms\"",
                "worker.flush_interval: must be greater than zero",
            ),
            (
                "flush_interval = \"2s\"",
                "worker.flush_interval: must be at most 1s",
            ),
            ("pool_size = 1", "worker.pool_size: must be at least 2"),
            (
                "attempt_prefetch = 0",
                "worker.attempt_prefetch: must be at least 1",
            ),
            (
                "attempt_prefetch = 70000",
                "worker.attempt_prefetch: must be at most 65535",
            ),
            (
                "intake_prefetch = 70000",
                "worker.intake_prefetch: must be at most 65535",
            ),
            (
                "reply_queues = [\"onejob.attempts.primary\"]",
                "worker.reply_queues: \"onejob.attempts.primary\" is onejob's or the broker's own queue",
            ),
            (
                "reply_queues = [\"\"]",
                "worker.reply_queues: \"\": a queue name is 1 to 255 bytes",
            ),
        ] {
            let err = Config::parse(&with(bad), "t").unwrap_err().to_string();
            assert!(err.contains(message), "{bad}: {err}");
        }
    }

    /// No duration from configuration can make later time arithmetic overflow.
    #[test]
    fn durations_are_bounded() {
        for setting in [
            "retry_backoff_max",
            "relay_interval",
            "shutdown_grace",
            "stuck_after",
        ] {
            let err = Config::parse(&with(&format!("[worker]\n{setting} = \"9999y\"")), "t")
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(&format!("worker.{setting}")) && err.contains("at most"),
                "{err}"
            );
        }
        let text = EMBEDDED_DEFAULT.replace("timeout = \"30s\"", "timeout = \"400days\"");
        let err = Config::parse(&text, "t").unwrap_err().to_string();
        assert!(err.contains("providers.primary.timeout"), "{err}");
    }

    /// Item 13 of issue 8: by default a stopping worker waits out the longest
    /// provider call, so a deploy creates no unknowns; a shorter grace set by hand
    /// is warned about.
    #[test]
    fn the_default_shutdown_grace_outlasts_the_longest_call() {
        let slow = EMBEDDED_DEFAULT.replace("timeout = \"30s\"", "timeout = \"2m\"");
        let c = Config::parse(&slow, "t").unwrap();
        assert!(
            c.worker.shutdown_grace > Duration::from_secs(120),
            "{:?}",
            c.worker.shutdown_grace
        );
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
        let c = Config::parse(
            &EMBEDDED_DEFAULT.replace("timeout = \"30s\"", "timeout = \"5s\""),
            "t",
        )
        .unwrap();
        assert_eq!(
            c.worker.shutdown_grace,
            Duration::from_secs(30),
            "never below 30s"
        );
        let short = format!("{slow}\n[worker]\nshutdown_grace = \"10s\"");
        let c = Config::parse(&short, "t").unwrap();
        assert_eq!(c.worker.shutdown_grace, Duration::from_secs(10));
        assert_eq!(c.warnings.len(), 1);
        assert!(
            c.warnings[0].contains("worker.shutdown_grace")
                && c.warnings[0].contains("providers.primary.timeout"),
            "{}",
            c.warnings[0]
        );
    }

    #[test]
    fn admit_checks_operation_and_provider() {
        let c = Config::parse(EMBEDDED_DEFAULT, "t").unwrap();
        let mut i = Intent {
            owner_id: "o".into(),
            idempotency_key: "k".into(),
            operation: "summarize".into(),
            input: serde_json::from_str(r#"{"text":"fox"}"#).unwrap(),
            provider: None,
        };
        assert_eq!(c.admit(&i).unwrap().1, "primary");
        // An input the prompt cannot render from is refused at once.
        let bad = Intent {
            input: serde_json::from_str(r#"{"txt":"fox"}"#).unwrap(),
            ..i.clone()
        };
        let refused = c.admit(&bad).unwrap_err().to_string();
        assert!(
            refused.starts_with("bad_input: the input does not fit operation \"summarize\"")
                && refused.contains("text"),
            "{refused}"
        );
        i.provider = Some("elsewhere".into());
        assert!(matches!(
            c.admit(&i),
            Err(RejectReason::ProviderNotInRoute { .. })
        ));
        i.operation = "translate".into();
        assert!(matches!(
            c.admit(&i),
            Err(RejectReason::UnknownOperation(_))
        ));
    }

    #[test]
    fn render_is_strict_and_output_is_checked() {
        let c = Config::parse(EMBEDDED_DEFAULT, "t").unwrap();
        let op = &c.operations["summarize"];
        let input: serde_json::Map<String, Value> =
            serde_json::from_str(r#"{"text":"fox"}"#).unwrap();
        assert_eq!(c.render(op, &input).unwrap().user, "Summarize: fox");
        let err = c.render(op, &Default::default()).unwrap_err();
        assert!(err.to_string().starts_with("template_error"), "{err}");

        op.check_output(r#"{"summary":"s"}"#).unwrap();
        let e = op.check_output("Sure! Here it is").unwrap_err().to_string();
        assert!(
            e.starts_with("contract_violation: content is not JSON"),
            "{e}"
        );
        let e = op
            .check_output(r#"{"summary":"s","extra":1}"#)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("contract_violation") && e.contains("extra"),
            "{e}"
        );
        let e = op.check_output(r#"{"summary":7}"#).unwrap_err().to_string();
        assert!(e.contains("/summary"), "{e}");
    }

    #[test]
    fn a_contract_violation_names_the_offending_value_in_a_bounded_excerpt() {
        let c = Config::parse(EMBEDDED_DEFAULT, "t").unwrap();
        let op = &c.operations["summarize"];
        let huge = format!(r#"{{"summary":[{}1]}}"#, "1,".repeat(500_000));
        let e = op.check_output(&huge).unwrap_err().to_string();
        assert!(
            e.starts_with("contract_violation: at /summary"),
            "{}",
            &e[..100]
        );
        assert!(e.len() <= 600, "{} bytes", e.len());
        assert!(e.ends_with('…'), "cut, and says so");
        let extra = format!(r#"{{"summary":"s","{}":1}}"#, "k".repeat(100_000));
        let e = op.check_output(&extra).unwrap_err().to_string();
        assert!(e.len() <= 600, "{} bytes", e.len());
    }
}
