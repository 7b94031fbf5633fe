//! `[providers.NAME]`: where a provider is, what it is asked for, and how
//! long and how much of it onejob waits for.

use std::time::Duration;

use serde::Deserialize;

use super::Result;
use super::checks::{at_least, check_name, duration, invalid};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawProvider {
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
    evidence: Option<String>,
    evidence_delay: Option<String>,
    evidence_deadline: Option<String>,
    idempotency_header: Option<String>,
}

/// The kind of API a provider speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProviderKind {
    /// Any OpenAI-compatible `/chat/completions` endpoint (`kind = "openai"`).
    OpenAi,
    /// Anthropic's Messages API, `/messages` (`kind = "anthropic"`).
    Anthropic,
}

impl ProviderKind {
    /// The kind as configuration spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            ProviderKind::OpenAi => "openai",
            ProviderKind::Anthropic => "anthropic",
        }
    }

    /// `kind`.
    fn parse(origin: &str, at: &str, text: &str) -> Result<ProviderKind> {
        match text {
            "openai" => Ok(ProviderKind::OpenAi),
            "anthropic" => Ok(ProviderKind::Anthropic),
            other => Err(invalid(
                origin,
                at,
                format!("{other:?} is not a known kind (expected \"openai\" or \"anthropic\")"),
            )),
        }
    }

    /// Refuses evidence this kind's API cannot give.
    fn check_evidence(self, origin: &str, at: &str, evidence: EvidenceKind) -> Result<()> {
        if self.evidence().contains(&evidence) {
            return Ok(());
        }
        Err(invalid(
            origin,
            at,
            format!(
                "a provider of kind {:?} cannot have evidence {:?}: its API keeps no listing of the calls it completed (use \"none\", or \"idempotency_key\" behind a gateway that honours the key)",
                self.as_str(),
                evidence.as_str()
            ),
        ))
    }

    /// The evidence a provider of this kind can be configured with: stored
    /// calls only where the API lists them (OpenAI's stored completions).
    pub fn evidence(self) -> &'static [EvidenceKind] {
        match self {
            ProviderKind::OpenAi => &[
                EvidenceKind::None,
                EvidenceKind::Stored,
                EvidenceKind::IdempotencyKey,
            ],
            ProviderKind::Anthropic => &[EvidenceKind::None, EvidenceKind::IdempotencyKey],
        }
    }
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
    /// How onejob can learn, after the fact, what a call whose outcome is
    /// unknown did (`evidence`, `evidence_delay`, `evidence_deadline`).
    pub evidence: Evidence,
    /// The header every call carries the attempt id in (`idempotency_header`).
    pub idempotency_header: reqwest::header::HeaderName,
}

/// What a provider keeps of the calls it completes (contract section 7,
/// Evidence).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EvidenceKind {
    /// Nothing onejob can read: an unknown waits for an operator.
    None,
    /// Stored completions: every call carries `store: true` and the attempt's
    /// metadata, and a completed call can be listed by that metadata.
    Stored,
    /// The same request with the same idempotency key is answered with the
    /// first one's outcome, and runs no new work.
    IdempotencyKey,
}

impl EvidenceKind {
    /// The kind as configuration spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            EvidenceKind::Stored => "stored",
            EvidenceKind::IdempotencyKey => "idempotency_key",
            EvidenceKind::None => "none",
        }
    }
}

/// How, and for how long, an unknown call of a provider is settled from its
/// evidence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Evidence {
    /// What the provider keeps.
    pub kind: EvidenceKind,
    /// How long after a call ended its stored answer may take to be visible:
    /// no look comes sooner.
    pub delay: Duration,
    /// From the call's start: past it, a call with no evidence is `failed`
    /// (`no_evidence`), or waits for an operator (`idempotency_key`).
    pub deadline: Duration,
}

/// The default `max_retry_after` of a provider.
pub const DEFAULT_MAX_RETRY_AFTER: Duration = Duration::from_secs(600);
/// The default `unknown_statuses` of a provider: gateway timeout, and
/// Cloudflare's "a timeout occurred".
pub const DEFAULT_UNKNOWN_STATUSES: [u16; 2] = [504, 524];
/// The default `evidence_delay` of a provider.
pub const DEFAULT_EVIDENCE_DELAY: Duration = Duration::from_secs(5);
/// The default `evidence_deadline` of a provider, unless its `timeout` and
/// `evidence_delay` need longer.
pub const DEFAULT_EVIDENCE_DEADLINE: Duration = Duration::from_secs(600);
/// The default `idempotency_header` of a provider.
pub const DEFAULT_IDEMPOTENCY_HEADER: &str = "Idempotency-Key";
/// The default `max_response_bytes` of a provider.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 4 * 1024 * 1024;

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

impl Provider {
    /// How many of one owner's attempts (first ones, retries, hedges) may wait in this provider's
    /// queue (handed out, not yet started), at least: half a worker's call
    /// slots, at least one. (A worker's hand-outs raise it on a fast
    /// provider, to 100 ms of its recent starts.) Another owner's job waits behind at most this many of a
    /// backlogged owner's, about half a call's time on one worker, while the
    /// owner alone still has enough queued to keep every slot busy between
    /// two hand-outs.
    pub fn share(&self) -> i64 {
        i64::from(self.concurrency.div_ceil(2).max(1))
    }

    /// One `[providers.NAME]` table.
    pub(super) fn parse(origin: &str, name: String, p: RawProvider) -> Result<Provider> {
        let at = |field: &str| format!("providers.{name}.{field}");
        check_name(origin, &format!("providers.{name}"), &name)?;
        let kind = ProviderKind::parse(origin, &at("kind"), &p.kind)?;
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
        let evidence = Evidence::parse(origin, &name, &p, timeout)?;
        kind.check_evidence(origin, &at("evidence"), evidence.kind)?;
        let idempotency_header = idempotency_header(origin, &at("idempotency_header"), &p)?;
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
            evidence,
            idempotency_header,
        })
    }
}

impl Evidence {
    /// `evidence`, `evidence_delay` and `evidence_deadline`: the deadline must
    /// leave room for a call to time out and its answer to become visible.
    fn parse(origin: &str, name: &str, p: &RawProvider, timeout: Duration) -> Result<Evidence> {
        let at = |field: &str| format!("providers.{name}.{field}");
        let kind = match p.evidence.as_deref() {
            None | Some("none") => EvidenceKind::None,
            Some("stored") => EvidenceKind::Stored,
            Some("idempotency_key") => EvidenceKind::IdempotencyKey,
            Some(other) => {
                return Err(invalid(
                    origin,
                    at("evidence"),
                    format!(
                        "{other:?} is not a kind of evidence (expected \"stored\", \"idempotency_key\" or \"none\")"
                    ),
                ));
            }
        };
        let delay = duration(
            origin,
            &at("evidence_delay"),
            &p.evidence_delay,
            DEFAULT_EVIDENCE_DELAY,
        )?;
        let least = timeout + delay;
        let deadline = duration(
            origin,
            &at("evidence_deadline"),
            &p.evidence_deadline,
            DEFAULT_EVIDENCE_DEADLINE.max(least),
        )?;
        if deadline < least {
            return Err(invalid(
                origin,
                at("evidence_deadline"),
                format!(
                    "must be at least timeout + evidence_delay ({}): a call must be able to time out and its answer become visible before the deadline",
                    humantime::format_duration(least)
                ),
            ));
        }
        Ok(Evidence {
            kind,
            delay,
            deadline,
        })
    }
}

/// `idempotency_header`: a header name, and not one HTTP or the call itself
/// needs for something else.
fn idempotency_header(
    origin: &str,
    at: &str,
    p: &RawProvider,
) -> Result<reqwest::header::HeaderName> {
    let text = p
        .idempotency_header
        .as_deref()
        .unwrap_or(DEFAULT_IDEMPOTENCY_HEADER);
    let name = reqwest::header::HeaderName::from_bytes(text.as_bytes())
        .map_err(|_| invalid(origin, at, format!("{text:?} is not a header name")))?;
    let taken = [
        "authorization",
        "content-type",
        "content-length",
        "host",
        "transfer-encoding",
        "connection",
        "x-api-key",
        "anthropic-version",
    ];
    if taken.contains(&name.as_str()) {
        return Err(invalid(
            origin,
            at,
            format!("{text:?} is a header the call needs for something else"),
        ));
    }
    Ok(name)
}
