//! What a page or an action answers when it cannot go on: a [`Failure`]
//! (its status and what to say, rendered as the message page), and a
//! [`Refused`], a page error that is already its response (a refusal's page,
//! a failure's rendered page), which a handler returns as it is.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use crate::edges::store::StoreError;

/// A failure as a page: its status and what to say.
pub(super) struct Failure(pub(super) StatusCode, pub(super) String);

impl From<StoreError> for Failure {
    fn from(e: StoreError) -> Self {
        tracing::warn!(error = %e, "console: the store failed");
        Failure(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the database failed: {e}"),
        )
    }
}

/// A page error that is a response: the page that says why a page or an
/// action stopped, returned by the handler as it is. Boxed, so that a
/// `Result` that carries it stays small.
pub(super) struct Refused(Box<Response>);

impl From<Response> for Refused {
    fn from(page: Response) -> Self {
        Refused(Box::new(page))
    }
}

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        *self.0
    }
}
