//! Who is asking: the owner a request's bearer token belongs to.

use axum::http::{HeaderMap, StatusCode, header};
use axum::response::Response;
use onejob::settings::token::Token;

use super::Gateway;
use super::answers::{unauthorized, unavailable};

/// The owner the request's bearer token belongs to, or the response refusing it.
pub(super) async fn owner(gateway: &Gateway, headers: &HeaderMap) -> Result<String, Response> {
    // The scheme is case-insensitive (RFC 9110 section 11.1).
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token)
        .ok_or_else(|| unauthorized("send `Authorization: Bearer <token>`"))?;
    let token = Token::parse(presented.trim())
        .ok_or_else(|| unauthorized("the token is unknown or revoked"))?;
    match gateway.store.tokens().token_owner(&token).await {
        Ok(Some(owner)) => Ok(owner),
        Ok(None) => Err(unauthorized("the token is unknown or revoked")),
        Err(e) => {
            tracing::warn!(error = %e, "cannot check a token");
            Err(unavailable(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable: the database cannot be reached; retry".into(),
            ))
        }
    }
}
