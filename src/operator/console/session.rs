//! Signing in and out, and who a request is: the sign-in form (with its own
//! login-CSRF cookie and a per-address throttle), the session cookie, and each
//! form's CSRF check.

use std::net::SocketAddr;
use std::time::Duration;

use axum::Form;
use axum::extract::{ConnectInfo, FromRequestParts, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header, request::Parts};
use axum::response::{IntoResponse, Redirect, Response};
use minijinja::context;
use serde::Deserialize;

use super::failure::Failure;
use super::{COOKIE, Console};
use crate::settings::token::{Token, random_hex, sha256_hex};

/// The signed-in operator of a request.
pub(super) struct Operator {
    pub(super) name: String,
    pub(super) csrf: String,
    pub(super) session: String,
    /// The browser says the request came from a page of another origin.
    cross_site: bool,
}

/// Whether the browser says a request came from a page of another origin
/// (`Sec-Fetch-Site`, which pages cannot set). Clients that send no such
/// header are judged by the form token alone.
pub(super) fn cross_site(headers: &HeaderMap) -> bool {
    headers
        .get("sec-fetch-site")
        .is_some_and(|v| v.as_bytes() != b"same-origin")
}

/// The request has no live session: back to the sign-in page.
pub(super) struct SignIn;

impl IntoResponse for SignIn {
    fn into_response(self) -> Response {
        Redirect::to("/login").into_response()
    }
}

impl FromRequestParts<Console> for Operator {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, app: &Console) -> Result<Self, Response> {
        let Some(secret) = cookie(&parts.headers, COOKIE) else {
            return Err(SignIn.into_response());
        };
        let digest = sha256_hex(&secret);
        match app.0.store.sessions().session(&digest).await {
            Ok(Some(s)) => Ok(Operator {
                name: s.operator,
                csrf: s.csrf,
                session: digest,
                cross_site: cross_site(&parts.headers),
            }),
            Ok(None) => Err(SignIn.into_response()),
            Err(e) => Err(app.message(None, e.into())),
        }
    }
}

impl Operator {
    /// The refusal of a form whose CSRF token is missing or is not this
    /// session's; `None` when it is.
    pub(super) fn refuses(&self, app: &Console, presented: Option<&str>) -> Option<Response> {
        // Compared by digest: no early exit on the secret's own bytes.
        match presented {
            Some(p) if !self.cross_site && sha256_hex(p) == sha256_hex(&self.csrf) => None,
            _ => Some(
                app.message(
                    Some(self),
                    Failure(
                        StatusCode::FORBIDDEN,
                        "This form's CSRF token is missing or is not this session's: nothing was \
                     done. Reload the page and try again."
                            .into(),
                    ),
                ),
            ),
        }
    }
}

/// The value of the cookie `name`, if the request has it.
pub(super) fn cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_owned())
        .filter(|v| !v.is_empty())
}

/// Whether the session cookie must be `Secure`.
pub(super) fn secure(app: &Console, headers: &HeaderMap) -> bool {
    app.0.options.secure_cookies
        || headers
            .get("x-forwarded-proto")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.eq_ignore_ascii_case("https"))
}

pub(super) fn session_cookie(value: &str, max_age: Duration, secure: bool) -> HeaderValue {
    let secure = if secure { "; Secure" } else { "" };
    HeaderValue::from_str(&format!(
        "{COOKIE}={value}; Path=/; HttpOnly; SameSite=Strict; Max-Age={}{secure}",
        max_age.as_secs()
    ))
    .unwrap_or_else(|_| HeaderValue::from_static("onejob_console=; Max-Age=0"))
}

/// The sign-in form's cookie: set by the sign-in page alone, for `/login`
/// alone, and matched against the form's `login_csrf` field. A sign-in posted
/// from another site has no such cookie (`SameSite=Strict`), so an attacker
/// cannot sign a victim's browser in as themselves (login CSRF).
pub const LOGIN_COOKIE: &str = "onejob_login";

/// How long a sign-in form stays good.
pub(super) const LOGIN_FORM_TTL: Duration = Duration::from_secs(3600);

/// The sign-in page, with a fresh form token in its field and its cookie.
pub(super) fn sign_in_page(app: &Console, headers: &HeaderMap, error: Option<&str>) -> Response {
    let form = random_hex(32);
    let mut page = app.render(
        "login.html",
        context! { title => "Sign in", operator => None::<String>, error, login_csrf => form.clone() },
    );
    let secure = if secure(app, headers) { "; Secure" } else { "" };
    if let Ok(v) = HeaderValue::from_str(&format!(
        "{LOGIN_COOKIE}={form}; Path=/login; HttpOnly; SameSite=Strict; Max-Age={}{secure}",
        LOGIN_FORM_TTL.as_secs()
    )) {
        page.headers_mut().append(header::SET_COOKIE, v);
    }
    page
}

pub(super) async fn login_page(State(app): State<Console>, headers: HeaderMap) -> Response {
    sign_in_page(&app, &headers, None)
}

#[derive(Deserialize)]
pub(super) struct LoginForm {
    #[serde(default)]
    token: String,
    login_csrf: Option<String>,
}

pub(super) async fn login(
    State(app): State<Console>,
    ConnectInfo(client): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    Form(form): Form<LoginForm>,
) -> Response {
    let presented = form.token.trim();
    let refuse_with = |status: StatusCode, text: &str| {
        let mut page = sign_in_page(&app, &headers, Some(text));
        *page.status_mut() = status;
        page
    };
    // Counted per client before anything else is done for it.
    if let Err(wait) = app.0.sign_ins.take(client.ip()) {
        let secs = wait.as_secs().max(1);
        tracing::warn!(client = %client.ip(), "console: sign-in attempts throttled");
        let mut page = refuse_with(
            StatusCode::TOO_MANY_REQUESTS,
            &format!("Too many sign-in attempts from this address: try again in {secs} s."),
        );
        if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
            page.headers_mut().insert(header::RETRY_AFTER, v);
        }
        return page;
    }
    let refuse = |text: &str| refuse_with(StatusCode::UNAUTHORIZED, text);
    // The form must be the one this browser got from the sign-in page.
    // (A cookie planted by a sibling host could match a field of the
    // attacker's; the browser's own word on where the form came from cannot
    // be planted.)
    let from_our_form = match (cookie(&headers, LOGIN_COOKIE), form.login_csrf.as_deref()) {
        (Some(c), Some(f)) => !cross_site(&headers) && sha256_hex(&c) == sha256_hex(f),
        _ => false,
    };
    if !from_our_form {
        return refuse_with(
            StatusCode::FORBIDDEN,
            "This sign-in did not come from this console's own sign-in form (or the form is \
             over an hour old): nothing was done. Please reload the sign-in page and sign in again.",
        );
    }
    let Some(token) = Token::parse_operator(presented) else {
        return if Token::parse(presented).is_some() {
            refuse(
                "That is a tenant's gateway token (ojt_…): the console takes only operator tokens (ojo_…), made by `onejob tokens create --operator NAME`.",
            )
        } else {
            refuse("That is not an operator token: it starts with ojo_ and 64 hex digits follow.")
        };
    };
    let secret = random_hex(32);
    let csrf = random_hex(32);
    let ttl = app.0.options.session_ttl;
    match app
        .0
        .store
        .sessions()
        .sign_in(&token, &sha256_hex(&secret), &csrf, ttl)
        .await
    {
        Ok(Some(operator)) => {
            tracing::info!(%operator, "console: signed in");
            let mut response = Redirect::to("/").into_response();
            response.headers_mut().insert(
                header::SET_COOKIE,
                session_cookie(&secret, ttl, secure(&app, &headers)),
            );
            // The form's token is spent.
            response.headers_mut().append(
                header::SET_COOKIE,
                HeaderValue::from_static("onejob_login=; Path=/login; Max-Age=0"),
            );
            response
        }
        Ok(None) => refuse("This operator token is unknown or revoked."),
        Err(e) => app.message(None, e.into()),
    }
}

#[derive(Deserialize)]
pub(super) struct CsrfForm {
    csrf: Option<String>,
}

pub(super) async fn logout(
    State(app): State<Console>,
    who: Operator,
    headers: HeaderMap,
    Form(form): Form<CsrfForm>,
) -> Response {
    if let Some(refused) = who.refuses(&app, form.csrf.as_deref()) {
        return refused;
    }
    if let Err(e) = app.0.store.sessions().sign_out(&who.session).await {
        return app.message(Some(&who), e.into());
    }
    let mut response = Redirect::to("/login").into_response();
    response.headers_mut().insert(
        header::SET_COOKIE,
        session_cookie("", Duration::ZERO, secure(&app, &headers)),
    );
    response
}
