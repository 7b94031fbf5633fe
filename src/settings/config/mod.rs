//! `onejob.toml`: providers, operations and worker settings (contract section 7).
//!
//! Everything is checked when the file is loaded: unknown settings, bad durations,
//! routes naming missing providers, templates that do not compile, schemas that are
//! not valid JSON Schema. A program with bad configuration stops at start with one
//! line naming the setting; it never runs half-configured. Compiled templates and
//! schemas are kept here so the hot path never parses them again.
//!
//! Each table has its own room, its raw shape, its settings type and its
//! checks side by side: `worker`, `providers`, `operations`,
//! `retention`, `owners`; `checks` holds the checks they share (durations, counts,
//! names). This file reads the whole text and checks what spans tables.

mod checks;
mod operations;
mod owners;
mod providers;
mod retention;
#[cfg(test)]
mod tests;
mod worker;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use checks::{invalid, line_of};
use operations::RawOperation;
use owners::{RawOwners, parse_owners};
use providers::RawProvider;
use retention::{RawRetention, parse_retention};
use serde::Deserialize;
use serde_json::Value;
use worker::RawWorker;

use crate::intent::{Intent, RejectReason};

pub use checks::MAX_DURATION;
pub use operations::{ContractViolation, Operation, Rendered, TemplateError};
pub use owners::{MAX_COUNT, MAX_DAILY_TOKENS, MAX_RATE, OwnerLimits, OwnerOverrides, parse_limit};
pub use providers::{
    DEFAULT_EVIDENCE_DEADLINE, DEFAULT_EVIDENCE_DELAY, DEFAULT_IDEMPOTENCY_HEADER,
    DEFAULT_MAX_RESPONSE_BYTES, DEFAULT_MAX_RETRY_AFTER, DEFAULT_UNKNOWN_STATUSES, Evidence,
    EvidenceKind, Provider, ProviderKind,
};
pub use retention::{MAX_RETENTION, Retention};
pub use worker::{MAX_BATCH_SIZE, MAX_FLUSH_INTERVAL, WorkerSettings};

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
    #[serde(default)]
    owners: RawOwners,
}

/// How much longer than the longest provider timeout the default shutdown grace
/// is, so that a call in flight at SIGTERM can still be settled.
const SHUTDOWN_MARGIN: std::time::Duration = std::time::Duration::from_secs(5);

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
    /// `[owners]`: every owner's limits unless `onejob owners set` gave it its own.
    pub owners: OwnerLimits,
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
        let worker = WorkerSettings::parse(origin, w)?;
        let retention = parse_retention(
            origin,
            "retention",
            &raw.retention,
            Retention::default(),
            worker.outbox_retention,
        )?;
        let owners = parse_owners(origin, &raw.owners)?;
        if raw.providers.is_empty() {
            return Err(invalid(
                origin,
                "providers",
                "at least one provider must be configured",
            ));
        }
        let mut providers = BTreeMap::new();
        for (name, p) in raw.providers {
            providers.insert(name.clone(), Provider::parse(origin, name, p)?);
        }

        let mut env = minijinja::Environment::new();
        env.set_undefined_behavior(minijinja::UndefinedBehavior::Strict);
        let mut operations = BTreeMap::new();
        for (name, o) in raw.operations {
            let operation = Operation::parse(
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
        let warnings = fit_shutdown_grace(origin, &mut worker, w, &providers);
        Ok(Config {
            origin: origin.to_owned(),
            worker,
            providers,
            operations,
            retention,
            owners,
            warnings,
            templates: Arc::new(env),
        })
    }

    /// Checks an intent's operation, pinned provider and input against
    /// configuration, and returns the operation, the first attempt's provider
    /// and the messages rendered. The input must render the operation's prompt
    /// (every variable it uses is there): an intent no provider could be asked
    /// about is rejected at once, as `bad_input`, rather than becoming a job
    /// that fails.
    pub fn admit(&self, intent: &Intent) -> Result<(&Operation, String, Rendered), RejectReason> {
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
        match self.render(op, &intent.input) {
            Ok(rendered) => Ok((op, provider, rendered)),
            Err(TemplateError(detail)) => Err(RejectReason::BadInput {
                operation: op.name.clone(),
                detail,
            }),
        }
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

/// A deploy must not turn every slow call into an unknown: by default the
/// shutdown grace outlasts the longest provider timeout, and a shorter one set
/// by hand is named in the warnings returned.
fn fit_shutdown_grace(
    origin: &str,
    worker: &mut WorkerSettings,
    w: &RawWorker,
    providers: &BTreeMap<String, Provider>,
) -> Vec<String> {
    let mut warnings = Vec::new();
    if let Some((slowest, timeout)) = providers
        .values()
        .map(|p| (p.name.as_str(), p.timeout))
        .max_by_key(|(_, t)| *t)
    {
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
    warnings
}
