//! `POST /v1/jobs`: a request read within its limits, checked as intake would
//! check it, published with a confirm, and answered with the fleet's receipt.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::Response;
use onejob::intent::{Intent, Receipt, RejectReason};
use onejob::trace::TraceContext;
use tracing::Instrument;

use super::Gateway;
use super::answers::{answer, overloaded, problem, refused, rejected, unavailable};
use super::bearer::owner;
use crate::ProducerError;

/// An over-long body is read (and dropped) up to this multiple of the limit before
/// the `413`, so the client reads the answer instead of a reset connection.
const DRAIN_FACTOR: usize = 4;

/// The body size a request declares (`Content-Length`), if it does.
fn declared_length(headers: &HeaderMap) -> Option<usize> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

/// Reads a request body of at most `limit` bytes, within `timeout`.
async fn read_body(body: Body, limit: usize, timeout: Duration) -> Result<Vec<u8>, Response> {
    use futures_util::StreamExt;
    let mut stream = body.into_data_stream();
    let mut kept = Vec::new();
    let mut size = 0usize;
    let read = async {
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|_| {
                problem(
                    StatusCode::BAD_REQUEST,
                    "bad_body: the request body could not be read".into(),
                )
            })?;
            size = size.saturating_add(chunk.len());
            if size <= limit {
                kept.extend_from_slice(&chunk);
            } else if size > limit.saturating_mul(DRAIN_FACTOR) {
                break;
            }
        }
        Ok(())
    };
    match tokio::time::timeout(timeout, read).await {
        Err(_) => Err(problem(
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "request_timeout: the body did not arrive within {}",
                humantime::format_duration(timeout)
            ),
        )),
        Ok(Err(response)) => Err(response),
        Ok(Ok(())) if size > limit => Err(rejected(&RejectReason::TooLarge { size, limit })),
        Ok(Ok(())) => Ok(kept),
    }
}

/// The request's `Idempotency-Key`, or the answer to a request without a
/// usable one.
fn idempotency_key(headers: &HeaderMap) -> Result<&str, Box<Response>> {
    let Some(key) = headers.get("idempotency-key") else {
        return Err(Box::new(problem(
            StatusCode::BAD_REQUEST,
            "missing_idempotency_key: send an `Idempotency-Key` header, the same on every retry of one intention".into(),
        )));
    };
    key.to_str().map_err(|_| {
        Box::new(rejected(&RejectReason::BadCharacters {
            field: "idempotency_key",
            allowed: "printable ASCII",
        }))
    })
}

pub(super) async fn create_job(State(gateway): State<Arc<Gateway>>, request: Request) -> Response {
    let Ok(_permit) = gateway.in_flight.try_acquire() else {
        return overloaded();
    };
    let (parts, body) = request.into_parts();
    let owner = match owner(&gateway, &parts.headers).await {
        Ok(o) => o,
        Err(response) => return response,
    };
    let key = match idempotency_key(&parts.headers) {
        Ok(key) => key,
        Err(response) => return *response,
    };
    let limit = gateway.config.worker.max_message_bytes;
    // What this owner holds is bounded, so that it cannot hold the gateway's
    // places from every other owner.
    let declared = declared_length(&parts.headers).unwrap_or(limit);
    let _held = match gateway
        .owners
        .take(&owner, declared.min(limit.saturating_add(1)))
    {
        Ok(held) => held,
        Err(refusal) => return refused(&owner, refusal, &gateway.options),
    };
    let body = match read_body(body, limit, gateway.options.body_timeout).await {
        Ok(b) => b,
        Err(response) => return response,
    };
    let intent = match Intent::from_request(&body, &owner, key, limit) {
        Ok(i) => i,
        Err(reason) => return rejected(&reason),
    };
    let (operation, provider, rendered) = match gateway.config.admit(&intent) {
        Ok(admitted) => admitted,
        Err(reason) => return rejected(&reason),
    };
    if let Some(refused) = over_budget(&gateway, &intent, (operation, &provider, &rendered)).await {
        return refused;
    }
    // The message carries the owner and key as well: it must fit the limit that
    // intake applies, or it would only be rejected there.
    let message = serde_json::to_vec(&intent).unwrap_or_default();
    if message.len() > limit {
        return rejected(&RejectReason::TooLarge {
            size: message.len(),
            limit,
        });
    }
    let (span, trace) = gateway_span(&parts.headers, &intent);
    let submitted = gateway
        .producer
        .submit_raw_in_trace(&message, Some(&trace))
        .instrument(span);
    match submitted.await {
        Ok(receipt) => {
            tracing::debug!(owner = %intent.owner_id, outcome = ?receipt.outcome, "intent answered");
            answer(receipt, &intent.idempotency_key)
        }
        Err(e @ ProducerError::ReceiptTimeout(_)) => {
            unavailable(StatusCode::GATEWAY_TIMEOUT, format!("receipt_timeout: {e}"))
        }
        Err(e @ ProducerError::ReplyChannelClosed) => {
            unavailable(StatusCode::SERVICE_UNAVAILABLE, format!("unavailable: {e}"))
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot publish an intent");
            unavailable(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("unavailable: the intent was not published ({e}); retry with the same key"),
            )
        }
    }
}

/// The answer for a new identity whose reservation would not fit in its
/// owner's budget, given before anything is published (admission would
/// refuse it, and dead-letter the whole body); `None` to publish. Admission
/// still decides what fits; a budget that cannot be read is left to it.
async fn over_budget(
    gateway: &Gateway,
    intent: &Intent,
    (operation, provider, rendered): (
        &onejob::settings::config::Operation,
        &str,
        &onejob::settings::config::Rendered,
    ),
) -> Option<Response> {
    let need = onejob::shared::runtime::reservation(&gateway.config, operation, provider, rendered);
    match gateway
        .store
        .owners()
        .budget_refusal(&intent.owner_id, &intent.idempotency_key, need)
        .await
    {
        Ok(None) => None,
        Ok(Some(reason)) => {
            onejob::edges::metrics::owner_refused(&intent.owner_id, "budget_exceeded");
            Some(answer(Receipt::rejected(&reason), &intent.idempotency_key))
        }
        Err(e) => {
            tracing::warn!(error = %e, "the owner's budget could not be read; publishing, and admission decides");
            None
        }
    }
}

/// The gateway's span for a request, and the trace context its intent carries:
/// the caller's `traceparent` continues, and without a valid one a trace
/// starts here. The span is kept only when spans are exported.
fn gateway_span(headers: &HeaderMap, intent: &Intent) -> (tracing::Span, TraceContext) {
    // Several `tracestate` lines are one list, joined as HTTP joins them.
    let state: Option<Vec<&str>> = headers
        .get_all(onejob::trace::TRACESTATE)
        .iter()
        .map(|v| v.to_str().ok())
        .collect();
    let state = state.map(|lines| lines.join(","));
    let parent = headers
        .get(onejob::trace::TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .and_then(|p| TraceContext::parse(p, state.as_deref()));
    onejob::edges::telemetry::hop(parent.as_ref(), || {
        tracing::info_span!(
            "create job",
            otel.kind = "server",
            owner_id = %intent.owner_id,
            operation = %intent.operation,
        )
    })
}
