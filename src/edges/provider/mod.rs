//! Calling AI-inference providers: the transport every kind shares, under
//! each kind's wire format ([`wire`]).
//!
//! What matters most here is the dispatch phase. A call refused before the request
//! left (connection refused, DNS failure) is a definite failure: the provider never
//! saw it. A call that timed out or lost its connection after the request was sent
//! is `unknown`: the provider may still be working, and may still charge for it.
//!
//! The rooms: [`answer`] judges what came back (the same for every kind),
//! [`stored`] looks an unknown call up in a provider's stored calls,
//! [`wire`] holds one file per kind, and [`batch`] calls each kind's batch
//! API on the same transport. `conformance` runs the same cases against
//! every kind.

pub(crate) mod answer;
pub(crate) mod batch;
#[cfg(test)]
mod conformance;
pub(crate) mod stored;
pub(crate) mod wire;

use std::time::Duration;

use answer::{Answer, CallError, judge, shown};
use stored::evidence_metadata;
use wire::Wire;

use crate::domain::{AttemptId, JobId};
use crate::settings::config::{EvidenceKind, Operation, Provider, Rendered};
use crate::trace::TraceContext;

/// An HTTP client for one provider.
#[derive(Clone)]
pub(crate) struct Client {
    http: reqwest::Client,
    provider: Provider,
    wire: &'static dyn Wire,
}

impl Client {
    /// A client for `provider`, with its timeout as the whole call's limit. Fails
    /// (rather than fall back to a client without that timeout) when the HTTP
    /// stack cannot be set up.
    pub(crate) fn new(provider: Provider) -> Result<Client, CallError> {
        let http = reqwest::Client::builder()
            // A redirect would re-send the prompt (tenant data) wherever the
            // provider's answer points, across schemes too: none is followed,
            // and a 3xx answer is a definite failure like any other error.
            .redirect(reqwest::redirect::Policy::none())
            .timeout(provider.timeout)
            .connect_timeout(provider.timeout.min(Duration::from_secs(10)))
            .pool_max_idle_per_host(provider.concurrency as usize)
            .build()
            .map_err(|e| {
                CallError::Refused(format!(
                    "cannot set up the HTTP client of provider {}: {}",
                    provider.name,
                    without_url(&e)
                ))
            })?;
        Ok(Client {
            wire: wire::of(provider.kind),
            http,
            provider,
        })
    }

    /// The provider.
    pub(crate) fn provider(&self) -> &Provider {
        &self.provider
    }

    /// Calls the provider with the rendered messages in its kind's wire
    /// format ([`wire`]), sending the attempt id in the provider's
    /// `idempotency_header` so a provider that honours it never does the same
    /// attempt twice. A provider whose evidence is `stored` is asked to store
    /// the call, with the attempt (and its job, when it has one) as metadata,
    /// so that an unknown call can be found. A call made for a job carries
    /// the job's trace context (`traceparent`, `tracestate`), naming the
    /// attempt's span as the parent.
    pub(crate) async fn complete(
        &self,
        attempt: AttemptId,
        job: Option<JobId>,
        trace: Option<&TraceContext>,
        operation: &Operation,
        rendered: &Rendered,
    ) -> Result<Answer, CallError> {
        let url = self
            .provider
            .base_url
            .join(self.wire.path())
            .map_err(|e| CallError::Refused(format!("bad url: {e}")))?;
        let stored = (self.provider.evidence.kind == EvidenceKind::Stored)
            .then(|| evidence_metadata(attempt, job));
        let body = self.wire.body(&self.provider, operation, rendered, stored);
        let mut request = self
            .http
            .post(url)
            .header(
                self.provider.idempotency_header.clone(),
                attempt.to_string(),
            )
            .json(&body);
        if let Some(trace) = trace {
            request = request.header(crate::trace::TRACEPARENT, trace.traceparent());
            if let Some(state) = &trace.state {
                request = request.header(crate::trace::TRACESTATE, state);
            }
        }
        let mut response = self.authorized(request)?.send().await.map_err(classify)?;
        let status = response.status();
        let retry_after = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(|secs| Duration::from_secs(secs).min(self.provider.max_retry_after));
        // Read at most `max_response_bytes`: a provider cannot make a worker hold
        // more. Losing the connection while reading the body is after sending:
        // unknown.
        let limit = self.provider.max_response_bytes;
        let mut bytes = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(classify)? {
            if bytes.len() + chunk.len() > limit {
                // A proxy's timeout page can be large: it is still `unknown`, judged
                // on what was read.
                if self.provider.unknown_statuses.contains(&status.as_u16()) {
                    break;
                }
                return Err(CallError::Rejected {
                    message: format!(
                        "answer_too_large: HTTP {} with a body over max_response_bytes ({limit} bytes)",
                        status.as_u16()
                    ),
                    retry_after: None,
                    usage: None,
                });
            }
            bytes.extend_from_slice(&chunk);
        }
        judge(
            &self.provider,
            self.wire,
            status.as_u16(),
            retry_after,
            &bytes,
        )
    }

    /// The request with the provider's API key, if it has one, as its kind
    /// sends it.
    pub(super) fn authorized(
        &self,
        request: reqwest::RequestBuilder,
    ) -> Result<reqwest::RequestBuilder, CallError> {
        let Some(env) = &self.provider.api_key_env else {
            return Ok(self.wire.authorize(request, None));
        };
        match std::env::var(env) {
            Ok(key) => Ok(self.wire.authorize(request, Some(&key))),
            Err(_) => Err(CallError::Refused(format!(
                "environment variable {env} (api_key_env of provider {}) is not set",
                self.provider.name
            ))),
        }
    }
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("provider", &self.provider.name)
            .field("kind", &self.provider.kind)
            .finish_non_exhaustive()
    }
}

/// The dispatch phase decides: a connect error never reached the provider.
fn classify(e: reqwest::Error) -> CallError {
    if e.is_connect() {
        CallError::Refused(without_url(&e))
    } else if e.is_timeout() {
        CallError::Unknown(format!(
            "timed out after the request was sent: {}",
            without_url(&e)
        ))
    } else if e.is_builder() {
        CallError::Refused(without_url(&e))
    } else {
        CallError::Unknown(format!(
            "connection lost after the request was sent: {}",
            without_url(&e)
        ))
    }
}

/// reqwest errors name the URL; providers' URLs may carry tokens in query strings.
pub(super) fn without_url(e: &reqwest::Error) -> String {
    let mut text = e.to_string();
    if let Some(url) = e.url() {
        text = text.replace(url.as_str(), "<provider url>");
    }
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    shown(&text)
}
