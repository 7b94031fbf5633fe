//! The HTTP answers: a receipt as its status and headers, and the refusals and
//! errors that are not receipts (`{"error": "code: detail"}`).

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use onejob::intent::{Outcome, Receipt, RejectReason};
use serde_json::json;

use super::GatewayOptions;
use crate::owners::Refusal;

/// A JSON error that is not a receipt: `{"error": "code: detail"}`.
pub(super) fn problem(status: StatusCode, error: String) -> Response {
    (status, axum::Json(json!({ "error": error }))).into_response()
}

pub(super) fn unauthorized(detail: &str) -> Response {
    let mut response = problem(StatusCode::UNAUTHORIZED, format!("unauthorized: {detail}"));
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"onejob\""),
    );
    response
}

pub(super) fn unavailable(status: StatusCode, error: String) -> Response {
    let mut response = problem(status, error);
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response
}

fn receipt_response(status: StatusCode, receipt: &Receipt) -> Response {
    let mut response = (status, axum::Json(receipt)).into_response();
    if let Some(id) = receipt.job_id
        && let Ok(location) = HeaderValue::from_str(&format!("/v1/jobs/{id}"))
    {
        response.headers_mut().insert(header::LOCATION, location);
    }
    response
}

pub(super) fn rejected(reason: &RejectReason) -> Response {
    let status = match reason {
        RejectReason::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
        _ => StatusCode::BAD_REQUEST,
    };
    receipt_response(status, &Receipt::rejected(reason))
}

pub(super) fn overloaded() -> Response {
    unavailable(
        StatusCode::SERVICE_UNAVAILABLE,
        "overloaded: too many requests in flight; retry".into(),
    )
}

/// An owner holds as much as it may already: `429`, with why.
pub(super) fn refused(owner: &str, refusal: Refusal, options: &GatewayOptions) -> Response {
    onejob::edges::metrics::gateway_refused(owner, refusal.label());
    let why = match refusal {
        Refusal::Requests => format!(
            "too_many_requests: this owner has {} requests in flight already; retry when one is answered",
            options.max_in_flight_per_owner
        ),
        Refusal::Bytes => format!(
            "too_many_requests: this request would pass this owner's {} bytes in flight; retry when one is answered",
            options.max_bytes_in_flight_per_owner
        ),
    };
    unavailable(StatusCode::TOO_MANY_REQUESTS, why)
}

/// The HTTP answer for a receipt: 201 created, 200 for a duplicate (marked
/// replayed), 422 for a conflict, 413 or 400 for a rejection, and 429 with
/// `Retry-After` for an owner over its daily budget.
pub(super) fn answer(receipt: Receipt, idempotency_key: &str) -> Response {
    match receipt.outcome {
        Outcome::Created => receipt_response(StatusCode::CREATED, &receipt),
        Outcome::Duplicate => {
            let mut response = receipt_response(StatusCode::OK, &receipt);
            response
                .headers_mut()
                .insert("idempotent-replayed", HeaderValue::from_static("true"));
            response
        }
        Outcome::Conflict => {
            // The receipt carries no error; over HTTP, say what happened.
            let explained = Receipt {
                error: Some(format!(
                    "conflict: Idempotency-Key {idempotency_key:?} was already used for a different request; that job is neither shown nor changed"
                )),
                ..receipt
            };
            receipt_response(StatusCode::UNPROCESSABLE_ENTITY, &explained)
        }
        // The fleet's configuration may differ from this gateway's.
        Outcome::Rejected
            if receipt
                .error
                .as_deref()
                .is_some_and(|e| e.starts_with("too_large")) =>
        {
            receipt_response(StatusCode::PAYLOAD_TOO_LARGE, &receipt)
        }
        // The owner is over its daily token budget: not the request's fault,
        // and it can be sent again once enough of the spend is older.
        Outcome::Rejected => match receipt
            .error
            .as_deref()
            .and_then(RejectReason::budget_retry_after)
        {
            Some(seconds) => {
                let mut response = receipt_response(StatusCode::TOO_MANY_REQUESTS, &receipt);
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
                response
            }
            None => receipt_response(StatusCode::BAD_REQUEST, &receipt),
        },
    }
}
