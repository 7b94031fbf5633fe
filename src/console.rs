//! The operator console, `onejob console --listen ADDR`: server-rendered HTML
//! over the same store the CLI uses. Every page reads without JavaScript; every
//! action is a form that carries the session's CSRF token, goes through the
//! store's guarded transitions (the same calls as the CLI's), and is written to
//! the audit table with the operator's name and reason.
//!
//! Sign-in takes an operator token (`onejob tokens create --operator NAME`,
//! `ojo_…`); a tenant's gateway token (`ojt_…`) is refused. The session cookie is
//! `HttpOnly`, `SameSite=Strict`, and `Secure` behind TLS (`--secure-cookies`, or
//! a request that says `X-Forwarded-Proto: https`). Only the session id's
//! SHA-256 is stored; revoking the operator's token ends its sessions.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{ConnectInfo, FromRequestParts, Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header, request::Parts};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use minijinja::{Environment, context};
use serde::Deserialize;
use uuid::Uuid;

use crate::broker;
use crate::config::Config;
use crate::dlq;
use crate::domain::{AttemptId, AttemptStatus, JobId, JobStatus};
use crate::policy::Planner;
use crate::runtime;
use crate::store::{
    Action, Actor, FailedJob, JobFilter, NextStep, Refusal, Resolution, Store, StoreError,
};
use crate::token::{Token, random_hex, sha256_hex};

/// The session cookie's name.
pub const COOKIE: &str = "onejob_console";
/// Jobs on one page of the job list.
pub const PAGE: i64 = 50;
/// The longest reason an action takes.
pub const MAX_REASON: usize = 2000;

/// How the console runs.
#[derive(Clone, Debug)]
pub struct Options {
    /// The broker, for publishing what an action wrote.
    pub amqp_url: String,
    /// Mark the session cookie `Secure` always (the console is behind TLS).
    pub secure_cookies: bool,
    /// How long a sign-in lasts.
    pub session_ttl: Duration,
    /// Sign-in attempts one client address may make a minute (in a burst,
    /// then one every `60 / n` seconds); past it, 429 before the database is
    /// asked.
    pub sign_ins_per_minute: u32,
    /// How often sessions past their expiry are deleted.
    pub session_sweep: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            amqp_url: crate::config::DEFAULT_AMQP_URL.to_owned(),
            secure_cookies: false,
            session_ttl: Duration::from_secs(8 * 3600),
            sign_ins_per_minute: 10,
            session_sweep: Duration::from_secs(60),
        }
    }
}

struct Inner {
    store: Store,
    config: Arc<Config>,
    options: Options,
    pages: Environment<'static>,
    sign_ins: crate::throttle::Throttle,
}

/// The console's state, shared by its handlers.
#[derive(Clone)]
pub struct Console(Arc<Inner>);

impl Console {
    /// A console over `store` and `config`.
    pub fn new(store: Store, config: Arc<Config>, options: Options) -> Console {
        Console(Arc::new(Inner {
            store,
            config,
            sign_ins: crate::throttle::Throttle::new(options.sign_ins_per_minute),
            options,
            pages: pages(),
        }))
    }

    /// The console's routes.
    pub fn router(self) -> Router {
        Router::new()
            .route("/login", get(login_page).post(login))
            .route("/logout", post(logout))
            .route("/", get(overview))
            .route("/jobs", get(jobs))
            .route("/jobs/{id}", get(job))
            .route("/unknowns", get(unknowns))
            .route("/attempts/{id}/resolve", get(confirm_resolve).post(resolve))
            .route("/dead-letters", get(dead_letters))
            .route("/dead-letters/confirm", get(confirm_dead_letters))
            .route("/dead-letters/replay", post(replay_dead_letters))
            .route("/dead-letters/purge", post(purge_dead_letters))
            .route("/providers", get(providers))
            .route("/providers/qualify", get(confirm_qualify).post(qualify))
            .route("/static/console.css", get(stylesheet))
            .fallback(not_found)
            .layer(axum::middleware::map_response(guarded))
            .with_state(self)
    }
}

/// What every answer of the console says to the browser: no framing by any
/// site, no script and no inline style at all (styles come from the console's
/// own stylesheet), forms post only back to the console, nothing kept in a
/// cache and no referrer sent to a link's target.
const GUARDS: [(&str, &str); 5] = [
    (
        "content-security-policy",
        "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; \
         frame-ancestors 'none'; base-uri 'none'",
    ),
    ("x-frame-options", "DENY"),
    ("cache-control", "no-store"),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "no-referrer"),
];

async fn guarded(mut answer: Response) -> Response {
    let headers = answer.headers_mut();
    for (name, value) in GUARDS {
        headers.insert(name, HeaderValue::from_static(value));
    }
    answer
}

/// Serves the console on `listener` until `shutdown` completes.
pub async fn serve(
    listener: tokio::net::TcpListener,
    console: Console,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let sweeper = tokio::spawn(sweep_sessions(
        console.0.store.clone(),
        console.0.options.session_sweep,
    ));
    let served = crate::http::serve(
        listener,
        console.router(),
        crate::http::ClientLimits::default(),
        shutdown,
    )
    .await;
    sweeper.abort();
    served
}

/// Deletes sessions past their expiry every `every`, for as long as the
/// console serves.
async fn sweep_sessions(store: Store, every: Duration) {
    let mut tick = tokio::time::interval(every.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if let Err(e) = store.expire_sessions().await {
            tracing::warn!(error = %e, "console: cannot delete expired sessions; trying again later");
        }
    }
}

/// The templates, compiled in. Names ending in `.html` are autoescaped.
fn pages() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_undefined_behavior(minijinja::UndefinedBehavior::Strict);
    for (name, text) in [
        ("base.html", include_str!("console/base.html")),
        ("login.html", include_str!("console/login.html")),
        ("overview.html", include_str!("console/overview.html")),
        ("jobs.html", include_str!("console/jobs.html")),
        ("job.html", include_str!("console/job.html")),
        ("unknowns.html", include_str!("console/unknowns.html")),
        ("confirm.html", include_str!("console/confirm.html")),
        (
            "dead_letters.html",
            include_str!("console/dead_letters.html"),
        ),
        (
            "confirm_dead_letters.html",
            include_str!("console/confirm_dead_letters.html"),
        ),
        ("message.html", include_str!("console/message.html")),
        ("providers.html", include_str!("console/providers.html")),
        (
            "confirm_qualify.html",
            include_str!("console/confirm_qualify.html"),
        ),
    ] {
        env.add_template(name, text)
            .unwrap_or_else(|e| panic!("console template {name}: {e}"));
    }
    env
}

/// A failure as a page: its status and what to say.
struct Failure(StatusCode, String);

impl From<StoreError> for Failure {
    fn from(e: StoreError) -> Self {
        tracing::warn!(error = %e, "console: the store failed");
        Failure(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the database failed: {e}"),
        )
    }
}

impl Console {
    fn render(&self, name: &str, ctx: minijinja::Value) -> Response {
        match self.0.pages.get_template(name).and_then(|t| t.render(ctx)) {
            Ok(html) => {
                ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], html).into_response()
            }
            Err(e) => {
                tracing::error!(error = %e, page = name, "console: a page failed to render");
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the page failed to render",
                )
                    .into_response()
            }
        }
    }

    fn message(&self, who: Option<&Operator>, failure: Failure) -> Response {
        let Failure(status, text) = failure;
        let mut page = self.render(
            "message.html",
            context! {
                title => status.canonical_reason().unwrap_or("Error"),
                operator => who.map(|o| o.name.clone()),
                csrf => who.map(|o| o.csrf.clone()),
                text,
            },
        );
        *page.status_mut() = status;
        page
    }
}

/// The signed-in operator of a request.
struct Operator {
    name: String,
    csrf: String,
    session: String,
    /// The browser says the request came from a page of another origin.
    cross_site: bool,
}

/// Whether the browser says a request came from a page of another origin
/// (`Sec-Fetch-Site`, which pages cannot set). Clients that send no such
/// header are judged by the form token alone.
fn cross_site(headers: &HeaderMap) -> bool {
    headers
        .get("sec-fetch-site")
        .is_some_and(|v| v.as_bytes() != b"same-origin")
}

/// The request has no live session: back to the sign-in page.
struct SignIn;

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
        match app.0.store.session(&digest).await {
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
    fn refuses(&self, app: &Console, presented: Option<&str>) -> Option<Response> {
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
fn cookie(headers: &HeaderMap, name: &str) -> Option<String> {
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
fn secure(app: &Console, headers: &HeaderMap) -> bool {
    app.0.options.secure_cookies
        || headers
            .get("x-forwarded-proto")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.eq_ignore_ascii_case("https"))
}

fn session_cookie(value: &str, max_age: Duration, secure: bool) -> HeaderValue {
    let secure = if secure { "; Secure" } else { "" };
    HeaderValue::from_str(&format!(
        "{COOKIE}={value}; Path=/; HttpOnly; SameSite=Strict; Max-Age={}{secure}",
        max_age.as_secs()
    ))
    .unwrap_or_else(|_| HeaderValue::from_static("onejob_console=; Max-Age=0"))
}

/// A place on the timeline (0 to 100 percent) in the half percents of its
/// `x` and `w` classes.
fn half_percents(percent: f64) -> u32 {
    (percent.clamp(0.0, 100.0) * 2.0).round() as u32
}

/// The console's stylesheet, with the timeline's place and length classes.
static STYLESHEET: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let mut css = include_str!("console/console.css").to_owned();
    for n in 0..=200u32 {
        let percent = f64::from(n) / 2.0;
        css.push_str(&format!(
            ".x{n} {{ left: {percent}%; }} .w{n} {{ width: {percent}%; }}\n"
        ));
    }
    css
});

async fn stylesheet() -> Response {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        STYLESHEET.as_str(),
    )
        .into_response()
}

async fn not_found(State(app): State<Console>) -> Response {
    app.message(
        None,
        Failure(StatusCode::NOT_FOUND, "There is no such page.".into()),
    )
}

/// The sign-in form's cookie: set by the sign-in page alone, for `/login`
/// alone, and matched against the form's `login_csrf` field. A sign-in posted
/// from another site has no such cookie (`SameSite=Strict`), so an attacker
/// cannot sign a victim's browser in as themselves (login CSRF).
pub const LOGIN_COOKIE: &str = "onejob_login";
/// How long a sign-in form stays good.
const LOGIN_FORM_TTL: Duration = Duration::from_secs(3600);

/// The sign-in page, with a fresh form token in its field and its cookie.
fn sign_in_page(app: &Console, headers: &HeaderMap, error: Option<&str>) -> Response {
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

async fn login_page(State(app): State<Console>, headers: HeaderMap) -> Response {
    sign_in_page(&app, &headers, None)
}

#[derive(Deserialize)]
struct LoginForm {
    #[serde(default)]
    token: String,
    login_csrf: Option<String>,
}

async fn login(
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
struct CsrfForm {
    csrf: Option<String>,
}

async fn logout(
    State(app): State<Console>,
    who: Operator,
    headers: HeaderMap,
    Form(form): Form<CsrfForm>,
) -> Response {
    if let Some(refused) = who.refuses(&app, form.csrf.as_deref()) {
        return refused;
    }
    if let Err(e) = app.0.store.sign_out(&who.session).await {
        return app.message(Some(&who), e.into());
    }
    let mut response = Redirect::to("/login").into_response();
    response.headers_mut().insert(
        header::SET_COOKIE,
        session_cookie("", Duration::ZERO, secure(&app, &headers)),
    );
    response
}

async fn overview(State(app): State<Console>, who: Operator) -> Response {
    let o = match app.0.store.overview().await {
        Ok(o) => o,
        Err(e) => return app.message(Some(&who), e.into()),
    };
    let peak = o
        .created_per_minute
        .iter()
        .copied()
        .max()
        .unwrap_or(0)
        .max(1);
    let dead_letters = dead_letter_depths(&app).await;
    let bars: Vec<_> = o
        .created_per_minute
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let h = (*n as f64 / peak as f64 * 60.0).round();
            context! { x => i * 5, y => 60.0 - h, h => h, n => n, ago => 60 - i }
        })
        .collect();
    app.render(
        "overview.html",
        context! {
            title => "Overview",
            operator => who.name,
            csrf => who.csrf,
            jobs => o.jobs,
            attempts => o.attempts_last_hour,
            bars => bars,
            peak => peak,
            created_last_hour => o.created_per_minute.iter().sum::<i64>(),
            oldest_unknown => o.oldest_unknown_seconds.map(age),
            outbox_pending => o.outbox_pending,
            outbox_lag => o.outbox_lag_seconds.map(age),
            dead_letters,
        },
    )
}

/// How long a page waits for the broker before it shows without it.
const BROKER_WAIT: Duration = Duration::from_secs(3);

/// A broker connection for a page, or why there is none, within
/// [`BROKER_WAIT`]: a broker that accepts and never answers costs a page a
/// short wait, not the page.
async fn broker_connection(app: &Console) -> Result<lapin::Connection, String> {
    match tokio::time::timeout(
        BROKER_WAIT,
        runtime::operator_connection(&app.0.options.amqp_url, &app.0.config),
    )
    .await
    {
        Ok(connected) => connected,
        Err(_) => Err(format!(
            "the broker did not answer within {} s",
            BROKER_WAIT.as_secs()
        )),
    }
}

/// Each dead-letter queue's depth, or, when the broker cannot be asked, why
/// not (the rest of the overview comes from Postgres and still shows).
async fn dead_letter_depths(app: &Console) -> minijinja::Value {
    let conn = match broker_connection(app).await {
        Ok(c) => c,
        Err(e) => return context! { error => format!("the broker cannot be asked: {e}") },
    };
    let mut queues = Vec::new();
    for q in dlq::queues(&app.0.config) {
        let depth = tokio::time::timeout(BROKER_WAIT, broker::depth(&conn, &q)).await;
        queues.push(match depth {
            Ok(Ok(n)) => context! { name => q, depth => n },
            Ok(Err(e)) => context! { name => q, error => e.to_string() },
            Err(_) => context! { name => q, error => "the broker did not answer in time" },
        });
    }
    let _ = conn.close(200, "done".into()).await;
    context! { queues }
}

/// A duration in seconds as people read it: `42s`, `3m 5s`, `2h 1m`, `4d 3h`.
fn age(seconds: f64) -> String {
    let s = seconds.max(0.0) as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {}s", s / 60, s % 60),
        3600..86400 => format!("{}h {}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d {}h", s / 86400, s % 86400 / 3600),
    }
}

#[derive(Deserialize, Default)]
struct JobsQuery {
    status: Option<String>,
    owner: Option<String>,
    operation: Option<String>,
    provider: Option<String>,
    since: Option<String>,
    until: Option<String>,
    after: Option<String>,
}

/// An empty form field is no filter.
fn given(v: &Option<String>) -> Option<String> {
    v.as_deref()
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(str::to_owned)
}

fn time(name: &str, v: &Option<String>) -> Result<Option<chrono::DateTime<chrono::Utc>>, String> {
    let Some(v) = given(v) else { return Ok(None) };
    chrono::DateTime::parse_from_rfc3339(&v)
        .map(|t| Some(t.with_timezone(&chrono::Utc)))
        .or_else(|_| {
            chrono::NaiveDateTime::parse_from_str(&v, "%Y-%m-%dT%H:%M").map(|t| Some(t.and_utc()))
        })
        .map_err(|_| format!("{name}: {v:?} is not a time (2026-12-04T10:00, UTC, or RFC 3339)"))
}

async fn jobs(State(app): State<Console>, who: Operator, Query(q): Query<JobsQuery>) -> Response {
    let status = match given(&q.status) {
        None => None,
        Some(s) => match s.parse::<JobStatus>().ok() {
            Some(s) => Some(s),
            None => {
                let text = format!("status: {s:?} is not a job status");
                return app.message(Some(&who), Failure(StatusCode::BAD_REQUEST, text));
            }
        },
    };
    let (since, until) = match (time("since", &q.since), time("until", &q.until)) {
        (Ok(s), Ok(u)) => (s, u),
        (Err(e), _) | (_, Err(e)) => {
            return app.message(Some(&who), Failure(StatusCode::BAD_REQUEST, e));
        }
    };
    let after = match given(&q.after).map(|a| a.parse::<Uuid>()) {
        None => None,
        Some(Ok(a)) => Some(a),
        Some(Err(_)) => {
            let text = "after: not a job id".to_owned();
            return app.message(Some(&who), Failure(StatusCode::BAD_REQUEST, text));
        }
    };
    let filter = JobFilter {
        status,
        owner: given(&q.owner),
        operation: given(&q.operation),
        provider: given(&q.provider),
        since,
        until,
    };
    let started = std::time::Instant::now();
    let lines = match app.0.store.jobs_page(&filter, after, PAGE + 1).await {
        Ok(l) => l,
        Err(e) => return app.message(Some(&who), e.into()),
    };
    let took_ms = started.elapsed().as_secs_f64() * 1000.0;
    let more = lines.len() as i64 > PAGE;
    let lines: Vec<_> = lines.into_iter().take(PAGE as usize).collect();
    // The pages' links keep the filters; the next moves the keyset past the
    // last row shown.
    let link = |after: Option<Uuid>| {
        let mut link = url::form_urlencoded::Serializer::new(String::new());
        for (k, v) in [
            ("status", given(&q.status)),
            ("owner", filter.owner.clone()),
            ("operation", filter.operation.clone()),
            ("provider", filter.provider.clone()),
            ("since", given(&q.since)),
            ("until", given(&q.until)),
            ("after", after.map(|a| a.to_string())),
        ] {
            if let Some(v) = v {
                link.append_pair(k, &v);
            }
        }
        format!("/jobs?{}", link.finish())
    };
    let next = more.then(|| link(lines.last().map(|l| l.id)));
    let first = link(None);
    app.render(
        "jobs.html",
        context! {
            title => "Jobs",
            operator => who.name,
            csrf => who.csrf,
            jobs => minijinja::Value::from(minijinja::value::Serde(&lines)),
            next => next,
            first => first,
            took_ms => format!("{took_ms:.1}"),
            statuses => ["queued", "running", "unknown", "succeeded", "failed", "cancelled"],
            operations => app.0.config.operations.keys().cloned().collect::<Vec<_>>(),
            providers => app.0.config.provider_names(),
            q => context! {
                status => given(&q.status).unwrap_or_default(),
                owner => given(&q.owner).unwrap_or_default(),
                operation => given(&q.operation).unwrap_or_default(),
                provider => given(&q.provider).unwrap_or_default(),
                since => given(&q.since).unwrap_or_default(),
                until => given(&q.until).unwrap_or_default(),
                paged => after.is_some(),
            },
        },
    )
}

async fn job(State(app): State<Console>, who: Operator, Path(id): Path<String>) -> Response {
    let Ok(id) = id.parse::<Uuid>() else {
        let text = format!("{id:?} is not a job id");
        return app.message(Some(&who), Failure(StatusCode::BAD_REQUEST, text));
    };
    let store = &app.0.store;
    let (job, audit) = match tokio::try_join!(store.job(JobId(id)), store.audit_of_job(JobId(id))) {
        Ok((Some(job), audit)) => (job, audit),
        Ok((None, _)) => {
            let text =
                format!("There is no job {id} (it may have been pruned after its retention).");
            return app.message(Some(&who), Failure(StatusCode::NOT_FOUND, text));
        }
        Err(e) => return app.message(Some(&who), e.into()),
    };
    let messages = match store.job_messages(&job).await {
        Ok(m) => m,
        Err(e) => return app.message(Some(&who), e.into()),
    };
    // The timeline: each attempt's bar from its creation to its end (or now),
    // on a scale from the job's creation to its last change.
    let start = job.created_at;
    let end = job
        .attempts
        .iter()
        .filter_map(|a| a.finished_at)
        .chain([job.updated_at])
        .max()
        .unwrap_or(job.updated_at)
        .max(if job.status.is_terminal() {
            job.updated_at
        } else {
            chrono::Utc::now()
        });
    let span = (end - start).num_milliseconds().max(1) as f64;
    let at = |t: chrono::DateTime<chrono::Utc>| {
        ((t - start).num_milliseconds() as f64 / span * 100.0).clamp(0.0, 100.0)
    };
    // Lanes: an attempt goes on the first lane whose last attempt had ended
    // when it was made. A retry follows its predecessor on the same lane; a
    // hedge, made while another attempt was still open, opens a lane of its own.
    let mut lane_ends: Vec<Option<chrono::DateTime<chrono::Utc>>> = Vec::new();
    let mut lanes: Vec<Vec<minijinja::Value>> = Vec::new();
    let mut attempts = Vec::new();
    for a in &job.attempts {
        let hedge = job
            .attempts
            .iter()
            .any(|b| b.number < a.number && b.finished_at.is_none_or(|f| a.created_at < f));
        let lane = lane_ends
            .iter()
            .position(|end| end.is_some_and(|e| e <= a.created_at))
            .unwrap_or_else(|| {
                lane_ends.push(None);
                lanes.push(Vec::new());
                lane_ends.len() - 1
            });
        lane_ends[lane] = Some(
            a.finished_at
                .unwrap_or(chrono::DateTime::<chrono::Utc>::MAX_UTC),
        );
        let from = at(a.started_at.unwrap_or(a.created_at));
        let to = at(a.finished_at.unwrap_or(end));
        let view = context! {
            id => a.id.to_string(),
            number => a.number,
            provider => a.provider.clone(),
            status => a.status.as_str(),
            winner => job.completed_by == Some(a.id),
            hedge,
            lane => lane + 1,
            error => a.error.clone(),
            usage => a.usage.as_ref().map(|u| u.to_string()),
            request_id => a.provider_request_id.clone(),
            created => a.created_at.to_rfc3339(),
            started => a.started_at.map(|t| t.to_rfc3339()),
            finished => a.finished_at.map(|t| t.to_rfc3339()),
            left => half_percents(from),
            width => half_percents(to - from).max(1),
            // A bar too narrow for its label has it beside it instead.
            label => match ((to - from) < 15.0, from > 60.0) {
                (false, _) => "inside",
                (true, false) => "after",
                (true, true) => "before",
            },
            open => !a.status.is_terminal(),
        };
        lanes[lane].push(view.clone());
        attempts.push(view);
    }
    let events = job_events(&job, &audit, &messages);
    let pretty = |v: &serde_json::Value| serde_json::to_string_pretty(v).unwrap_or_default();
    app.render(
        "job.html",
        context! {
            title => format!("Job {id}"),
            operator => who.name,
            csrf => who.csrf,
            job => context! {
                id => job.id.to_string(),
                owner_id => job.owner_id.clone(),
                key => job.idempotency_key.clone(),
                operation => job.operation.clone(),
                status => job.status.as_str(),
                version => job.version,
                created => job.created_at.to_rfc3339(),
                updated => job.updated_at.to_rfc3339(),
                input => pretty(&job.input),
                result => job.result.as_ref().map(pretty),
                error => job.error.clone(),
            },
            attempts,
            lanes,
            events,
            audit => minijinja::Value::from(minijinja::value::Serde(&audit)),
        },
    )
}

/// A job's history, oldest first: its creation, each attempt's queueing,
/// start and end, every operator action, and each message the outbox still
/// keeps for it (an attempt's message or a job event) with whether it went out.
fn job_events(
    job: &crate::store::JobView,
    audit: &[crate::store::AuditEntry],
    messages: &[crate::store::JobMessage],
) -> Vec<minijinja::Value> {
    type At = chrono::DateTime<chrono::Utc>;
    let mut events: Vec<(At, u8, String, String)> = vec![(
        job.created_at,
        0,
        "job".into(),
        format!("created for {} ({})", job.owner_id, job.operation),
    )];
    for a in &job.attempts {
        let delay = if a.not_before > a.created_at {
            format!(", not before {}", a.not_before.format("%H:%M:%S%.3f"))
        } else {
            String::new()
        };
        events.push((
            a.created_at,
            1,
            "attempt".into(),
            format!("#{} queued for {}{delay}", a.number, a.provider),
        ));
        if let Some(t) = a.started_at {
            events.push((
                t,
                2,
                "attempt".into(),
                format!("#{} started on {}", a.number, a.provider),
            ));
        }
        if let Some(t) = a.finished_at {
            let why = a
                .error
                .as_deref()
                .map(|e| format!(": {e}"))
                .unwrap_or_default();
            events.push((
                t,
                3,
                "attempt".into(),
                format!("#{} ended {}{why}", a.number, a.status),
            ));
        }
    }
    for e in audit {
        let why = if e.reason.is_empty() {
            String::new()
        } else {
            format!(" ({})", e.reason)
        };
        events.push((
            e.at,
            4,
            "operator".into(),
            format!("{} did {}{why}", e.actor, e.action),
        ));
    }
    for m in messages {
        let what = if m.exchange.ends_with(".events") || m.routing_key.starts_with("job.") {
            format!("event {} ({})", m.routing_key, m.message_id)
        } else {
            format!("message to {} for attempt {}", m.routing_key, m.message_id)
        };
        let state = match m.published_at {
            Some(t) => format!("published at {}", t.format("%H:%M:%S%.3f")),
            None => "waiting in the outbox".into(),
        };
        events.push((
            m.created_at,
            5,
            "message".into(),
            format!("{what} written, {state}"),
        ));
    }
    events.sort_by_key(|e| (e.0, e.1));
    events
        .into_iter()
        .map(|(at, _, kind, what)| context! { at => at.to_rfc3339(), kind, what })
        .collect()
}

async fn unknowns(State(app): State<Console>, who: Operator) -> Response {
    let list = match app.0.store.unknowns().await {
        Ok(l) => l,
        Err(e) => return app.message(Some(&who), e.into()),
    };
    let rows: Vec<_> = list
        .iter()
        .map(|u| {
            context! {
                attempt_id => u.attempt_id.to_string(),
                job_id => u.job_id.to_string(),
                number => u.number,
                provider => u.provider.clone(),
                request_id => u.provider_request_id.clone(),
                owner_id => u.owner_id.clone(),
                operation => u.operation.clone(),
                since => u.since.to_rfc3339(),
                age => age(u.age_seconds),
                error => u.error.clone(),
            }
        })
        .collect();
    app.render(
        "unknowns.html",
        context! { title => "Unknowns", operator => who.name, csrf => who.csrf, unknowns => rows },
    )
}

#[derive(Deserialize)]
struct ResolveQuery {
    #[serde(rename = "as")]
    resolution: Option<String>,
}

fn resolution(text: Option<&str>) -> Option<Resolution> {
    match text {
        Some("failed") => Some(Resolution::Failed),
        Some("cancelled") => Some(Resolution::Cancelled),
        _ => None,
    }
}

/// The job of `attempt`, if the attempt is one an operator may resolve here:
/// it exists and is `unknown`. The refusal otherwise.
async fn unknown_attempt(
    app: &Console,
    attempt: Uuid,
) -> Result<(crate::store::JobView, usize), Failure> {
    let store = &app.0.store;
    let not_open = || {
        Failure(
            StatusCode::CONFLICT,
            format!("Attempt {attempt} is not open any more: there is nothing to resolve."),
        )
    };
    let job_id = store
        .attempt_job(AttemptId(attempt))
        .await?
        .ok_or_else(|| {
            Failure(
                StatusCode::NOT_FOUND,
                format!("There is no attempt {attempt}."),
            )
        })?;
    let job = store.job(job_id).await?.ok_or_else(not_open)?;
    let index = job
        .attempts
        .iter()
        .position(|a| a.id.0 == attempt)
        .ok_or_else(not_open)?;
    let a = &job.attempts[index];
    // Only an unknown attempt: resolving one in flight would fail a call that
    // may yet answer and start another beside it. (An unknown attempt only
    // ever moves to a terminal state, so this cannot go stale but to refuse.)
    if a.status != AttemptStatus::Unknown || job.status.is_terminal() {
        return Err(Failure(
            StatusCode::CONFLICT,
            format!(
                "Attempt {attempt} is {}, not unknown: only an unknown attempt is resolved here.",
                a.status
            ),
        ));
    }
    Ok((job, index))
}

/// What resolving `attempt` as `resolution` will do, in words: which provider
/// the route rule picks next, or that the job ends.
async fn consequence(
    app: &Console,
    attempt: Uuid,
    resolution: Resolution,
) -> Result<(crate::store::JobView, String), Failure> {
    let store = &app.0.store;
    let (job, index) = unknown_attempt(app, attempt).await?;
    let a = &job.attempts[index];
    let text = match resolution {
        Resolution::Cancelled => format!(
            "Attempt #{} on {} becomes cancelled, and so does job {}: no attempt follows, \
             and a result that still arrives is discarded.",
            a.number, a.provider, job.id
        ),
        Resolution::Failed => {
            let config = &app.0.config;
            let planner = Planner::load(config, store, [job.operation.as_str()]).await?;
            let failed = FailedJob {
                job_id: job.id,
                operation: job.operation.clone(),
                failed_provider: a.provider.clone(),
                attempts_made: u32::try_from(job.attempts.len()).unwrap_or(u32::MAX),
                error: "resolved_failed: an operator resolved this attempt as failed".into(),
                retryable: true,
                retry_after: None,
            };
            let what = format!("Attempt #{} on {} becomes failed.", a.number, a.provider);
            match planner.plan(&failed) {
                NextStep::Retry { provider, delay } if delay.is_zero() => {
                    format!(
                        "{what} The route rule then starts attempt #{} on {provider}, at once.",
                        job.attempts.len() + 1
                    )
                }
                NextStep::Retry { provider, delay } => format!(
                    "{what} The route rule then starts attempt #{} on {provider}, after a backoff of {}.",
                    job.attempts.len() + 1,
                    humantime::format_duration(Duration::from_secs(delay.as_secs().max(1)))
                ),
                NextStep::GiveUp { error } => {
                    format!(
                        "{what} No attempt follows: job {} fails with “{error}”.",
                        job.id
                    )
                }
            }
        }
    };
    Ok((job, text))
}

async fn confirm_resolve(
    State(app): State<Console>,
    who: Operator,
    Path(id): Path<String>,
    Query(q): Query<ResolveQuery>,
) -> Response {
    let (Ok(attempt), Some(how)) = (id.parse::<Uuid>(), resolution(q.resolution.as_deref())) else {
        let text = "Say which attempt (its id) and how: ?as=failed or ?as=cancelled.".to_owned();
        return app.message(Some(&who), Failure(StatusCode::BAD_REQUEST, text));
    };
    match consequence(&app, attempt, how).await {
        Ok((job, text)) => app.render(
            "confirm.html",
            context! {
                title => "Resolve an unknown attempt",
                operator => who.name,
                csrf => who.csrf,
                attempt => attempt.to_string(),
                job_id => job.id.to_string(),
                how => q.resolution,
                consequence => text,
                error => None::<String>,
            },
        ),
        Err(f) => app.message(Some(&who), f),
    }
}

#[derive(Deserialize)]
struct ResolveForm {
    csrf: Option<String>,
    #[serde(rename = "as")]
    resolution: Option<String>,
    #[serde(default)]
    reason: String,
}

async fn resolve(
    State(app): State<Console>,
    who: Operator,
    Path(id): Path<String>,
    Form(form): Form<ResolveForm>,
) -> Response {
    let reason = match authorised(&app, &who, form.csrf.as_deref(), &form.reason) {
        Ok(r) => r,
        Err(page) => return *page,
    };
    let (Ok(attempt), Some(how)) = (id.parse::<Uuid>(), resolution(form.resolution.as_deref()))
    else {
        let text = "Say which attempt (its id) and how: failed or cancelled.".to_owned();
        return app.message(Some(&who), Failure(StatusCode::BAD_REQUEST, text));
    };
    let store = &app.0.store;
    let config = &app.0.config;
    let (job_id, operation) = match unknown_attempt(&app, attempt).await {
        Ok((job, _)) => (job.id, job.operation),
        Err(f) => return app.message(Some(&who), f),
    };
    let planner = match Planner::load(config, store, [operation.as_str()]).await {
        Ok(p) => p,
        Err(e) => return app.message(Some(&who), e.into()),
    };
    let plan = |f: &FailedJob| planner.plan(f);
    let actor = Actor::operator(&who.name, reason);
    let publish = match store.resolve(AttemptId(attempt), how, &plan, &actor).await {
        Ok(Ok((_, publish))) => publish,
        Ok(Err(refusal @ (Refusal::NotFound(_) | Refusal::Terminal(_)))) => {
            let text = format!("{refusal}. Nothing was done.");
            return app.message(Some(&who), Failure(StatusCode::CONFLICT, text));
        }
        Err(e) => return app.message(Some(&who), e.into()),
    };
    // What the resolution wrote goes out now; if the broker is down, the
    // reconciler's relay sends it once the outbox lease ends.
    if let Err(e) = runtime::publish_now(&app.0.options.amqp_url, config, store, &publish).await {
        tracing::warn!(error = %e, "console: publishing a resolution failed; the relay will");
    }
    tracing::info!(operator = %who.name, %attempt, "console: resolved an attempt");
    Redirect::to(&format!("/jobs/{job_id}")).into_response()
}

/// A broker connection for one page or action, or the page that says why
/// there is none.
async fn broker_for(app: &Console, who: &Operator) -> Result<lapin::Connection, Box<Response>> {
    broker_connection(app)
        .await
        .map_err(|e| Box::new(app.message(Some(who), Failure(StatusCode::SERVICE_UNAVAILABLE, e))))
}

#[derive(Deserialize, Default)]
struct DoneQuery {
    done: Option<Uuid>,
}

async fn dead_letters(
    State(app): State<Console>,
    who: Operator,
    Query(done): Query<DoneQuery>,
) -> Response {
    let conn = match broker_for(&app, &who).await {
        Ok(c) => c,
        Err(page) => return *page,
    };
    let mut queues = Vec::new();
    for q in dlq::queues(&app.0.config) {
        let letters = match dlq::browse(&conn, &q, dlq::DEFAULT_LIMIT).await {
            Ok(l) => l,
            Err(e) => {
                let _ = conn.close(200, "done".into()).await;
                let text = format!("browsing {q} failed: {e}");
                return app.message(Some(&who), Failure(StatusCode::SERVICE_UNAVAILABLE, text));
            }
        };
        let rows: Vec<_> = letters
            .iter()
            .map(|d| {
                let deaths: Vec<String> = d
                    .deaths
                    .iter()
                    .map(|x| format!("{} ×{} in {}", x.reason, x.count, x.queue))
                    .collect();
                let origin = format!(
                    "{}/{}",
                    d.original_exchange.as_deref().unwrap_or("?"),
                    d.original_routing_key.as_deref().unwrap_or("?")
                );
                let replay = d
                    .message_id
                    .as_deref()
                    .map(|id| confirm_link(&[("action", "replay"), ("queue", &q), ("id", id)]));
                context! {
                    position => d.position,
                    id => d.message_id.clone(),
                    replay,
                    reason => d.reason.clone(),
                    deaths,
                    origin,
                    age => d.age_seconds.map(|a| age(a as f64)),
                    preview => d.body_preview.clone(),
                    bytes => d.body_bytes,
                }
            })
            .collect();
        queues.push(context! {
            replay_all => confirm_link(&[("action", "replay"), ("queue", &q)]),
            purge => confirm_link(&[("action", "purge"), ("queue", &q)]),
            name => q,
            full => rows.len() >= dlq::DEFAULT_LIMIT,
            letters => rows,
        });
    }
    let _ = conn.close(200, "done".into()).await;
    let done = done_banner(&app, done.done).await;
    app.render(
        "dead_letters.html",
        context! { title => "Dead letters", operator => who.name, csrf => who.csrf, queues, done },
    )
}

#[derive(Deserialize)]
struct DeadLetterQuery {
    action: Option<String>,
    queue: Option<String>,
    id: Option<String>,
}

/// The dead-letter queue an operator named, if it is one of this
/// configuration's.
fn dead_letter_queue(app: &Console, queue: Option<&str>) -> Result<String, Failure> {
    let named = queue
        .map(str::trim)
        .filter(|q| !q.is_empty())
        .ok_or_else(|| {
            Failure(
                StatusCode::BAD_REQUEST,
                "Say which dead-letter queue.".into(),
            )
        })?;
    match dlq::select_queues(&app.0.config, Some(named)) {
        Ok(mut q) if q.len() == 1 => Ok(q.remove(0)),
        Ok(_) => Err(Failure(
            StatusCode::BAD_REQUEST,
            format!("{named:?}: name one queue"),
        )),
        Err(e) => Err(Failure(StatusCode::BAD_REQUEST, e.to_string())),
    }
}

async fn confirm_dead_letters(
    State(app): State<Console>,
    who: Operator,
    Query(q): Query<DeadLetterQuery>,
) -> Response {
    let queue = match dead_letter_queue(&app, q.queue.as_deref()) {
        Ok(queue) => queue,
        Err(f) => return app.message(Some(&who), f),
    };
    let conn = match broker_for(&app, &who).await {
        Ok(c) => c,
        Err(page) => return *page,
    };
    let depth = broker::depth(&conn, &queue).await;
    let _ = conn.close(200, "done".into()).await;
    let depth = match depth {
        Ok(d) => d,
        Err(e) => {
            let text = format!("counting {queue} failed: {e}");
            return app.message(Some(&who), Failure(StatusCode::SERVICE_UNAVAILABLE, text));
        }
    };
    let id = given(&q.id);
    let (action, what) = match (q.action.as_deref(), &id) {
        (Some("replay"), Some(id)) => (
            "replay",
            format!(
                "Republish the dead letter {id} of {queue} to the exchange and routing key it was \
                 first published to (with a confirm), then remove it from {queue}."
            ),
        ),
        (Some("replay"), None) => (
            "replay",
            format!(
                "Republish each of the {depth} dead letter(s) in {queue} to where it was first \
                 published (each with a confirm), then remove it. A letter without an origin is \
                 left in place."
            ),
        ),
        (Some("purge"), _) => (
            "purge",
            format!("Delete the {depth} dead letter(s) in {queue}. They cannot be recovered."),
        ),
        _ => {
            let text =
                "Say what to do: action=replay (with an id, or all) or action=purge.".to_owned();
            return app.message(Some(&who), Failure(StatusCode::BAD_REQUEST, text));
        }
    };
    app.render(
        "confirm_dead_letters.html",
        context! {
            title => "Confirm", operator => who.name, csrf => who.csrf,
            action, queue, id, what,
        },
    )
}

#[derive(Deserialize)]
struct DeadLetterForm {
    csrf: Option<String>,
    queue: Option<String>,
    id: Option<String>,
    #[serde(default)]
    reason: String,
}

/// What every action's form must pass before anything is looked at: the
/// session's CSRF token, then a reason. The reason, or the refusal's page.
fn authorised<'a>(
    app: &Console,
    who: &Operator,
    csrf: Option<&str>,
    reason: &'a str,
) -> Result<&'a str, Box<Response>> {
    if let Some(refused) = who.refuses(app, csrf) {
        return Err(Box::new(refused));
    }
    reason_of(app, who, reason)
}

/// The reason an action's form gave, or the page that says it is missing.
fn reason_of<'a>(app: &Console, who: &Operator, reason: &'a str) -> Result<&'a str, Box<Response>> {
    let reason = reason.trim();
    if reason.is_empty() || reason.chars().count() > MAX_REASON || reason.contains('\0') {
        let text = format!(
            "Give a reason (1 to {MAX_REASON} characters): it goes in the audit table. Nothing was done."
        );
        return Err(Box::new(
            app.message(Some(who), Failure(StatusCode::BAD_REQUEST, text)),
        ));
    }
    Ok(reason)
}

/// Records an action before it is done, so that none goes unrecorded; if the
/// row cannot be written, the page that says nothing was done.
async fn begin_action(
    app: &Console,
    who: &Operator,
    reason: &str,
    action: &Action<'_>,
) -> Result<Uuid, Box<Response>> {
    app.0
        .store
        .audit_begin(&Actor::operator(&who.name, reason), action)
        .await
        .map_err(|e| {
            let Failure(status, text) = e.into();
            Box::new(app.message(
                Some(who),
                Failure(
                    status,
                    format!("{text}. Nothing was done: the action could not be recorded first."),
                ),
            ))
        })
}

/// Writes what came of an action [`begin_action`] recorded. If that fails,
/// the row stays `pending` (and the log says so): the action itself stands.
async fn finish_action(store: &Store, audit: Uuid, failed: bool, detail: serde_json::Value) {
    if let Err(e) = store.audit_outcome(audit, failed, &detail).await {
        tracing::warn!(error = %e, %audit, "console: the outcome of an action was not recorded; its audit row stays pending");
    }
}

/// A dead-letter action, checked (CSRF token, reason, queue), with a broker
/// connection, and recorded before anything is done.
struct DeadLetterAction {
    queue: String,
    conn: lapin::Connection,
    audit: Uuid,
}

impl DeadLetterAction {
    async fn begin(
        app: &Console,
        who: &Operator,
        form: &DeadLetterForm,
        action: &'static str,
        detail: serde_json::Value,
    ) -> Result<DeadLetterAction, Box<Response>> {
        let reason = authorised(app, who, form.csrf.as_deref(), &form.reason)?;
        let queue = dead_letter_queue(app, form.queue.as_deref())
            .map_err(|f| Box::new(app.message(Some(who), f)))?;
        let conn = broker_for(app, who).await?;
        let record = Action {
            action,
            target: Some(queue.clone()),
            detail,
            ..Action::default()
        };
        match begin_action(app, who, reason, &record).await {
            Ok(audit) => Ok(DeadLetterAction { queue, conn, audit }),
            Err(page) => {
                let _ = conn.close(200, "done".into()).await;
                Err(page)
            }
        }
    }
}

async fn replay_dead_letters(
    State(app): State<Console>,
    who: Operator,
    Form(form): Form<DeadLetterForm>,
) -> Response {
    let id = given(&form.id);
    let detail = serde_json::json!({ "message_id": id });
    let DeadLetterAction { queue, conn, audit } =
        match DeadLetterAction::begin(&app, &who, &form, "dlq.replay", detail).await {
            Ok(begun) => begun,
            Err(page) => return *page,
        };
    let selection = id.clone().map_or(dlq::Selection::All, dlq::Selection::Id);
    let (mut replayed, mut skipped) = (0u32, 0u32);
    let result = dlq::replay(&conn, &queue, &selection, |r| match r.outcome {
        dlq::ReplayOutcome::Replayed => replayed += 1,
        dlq::ReplayOutcome::Skipped { .. } => skipped += 1,
    })
    .await;
    let _ = conn.close(200, "done".into()).await;
    // A replay that failed part-way is recorded as such: a letter may have
    // been republished before the failure.
    finish_action(
        &app.0.store,
        audit,
        result.is_err(),
        serde_json::json!({
            "replayed": replayed,
            "skipped": skipped,
            "error": result.as_ref().err().map(ToString::to_string),
        }),
    )
    .await;
    if let Err(e) = result {
        let text = format!("replaying from {queue} failed after {replayed} replayed: {e}");
        return app.message(Some(&who), Failure(StatusCode::SERVICE_UNAVAILABLE, text));
    }
    if let (Some(id), 0) = (&id, replayed + skipped) {
        let text =
            format!("There is no dead letter {id:?} in {queue} (any more). Nothing was done.");
        return app.message(Some(&who), Failure(StatusCode::NOT_FOUND, text));
    }
    done(audit)
}

async fn purge_dead_letters(
    State(app): State<Console>,
    who: Operator,
    Form(form): Form<DeadLetterForm>,
) -> Response {
    let DeadLetterAction { queue, conn, audit } = match DeadLetterAction::begin(
        &app,
        &who,
        &form,
        "dlq.purge",
        serde_json::Value::Null,
    )
    .await
    {
        Ok(begun) => begun,
        Err(page) => return *page,
    };
    let purged = dlq::purge(&conn, &queue).await;
    let _ = conn.close(200, "done".into()).await;
    finish_action(
        &app.0.store,
        audit,
        purged.is_err(),
        match &purged {
            Ok(n) => serde_json::json!({ "purged": n }),
            Err(e) => serde_json::json!({ "error": e.to_string() }),
        },
    )
    .await;
    match purged {
        Ok(_) => done(audit),
        Err(e) => {
            let text = format!("purging {queue} failed: {e}");
            app.message(Some(&who), Failure(StatusCode::SERVICE_UNAVAILABLE, text))
        }
    }
}

#[derive(Deserialize, Default)]
struct ProvidersQuery {
    provider: Option<String>,
    operation: Option<String>,
    done: Option<Uuid>,
}

/// What an action did, in words, from its audit row (never from the link that
/// leads back to the page, which anyone could write).
async fn done_banner(app: &Console, done: Option<Uuid>) -> Option<String> {
    let entry = app.0.store.audit_entry(done?).await.ok()??;
    let d = &entry.detail;
    let target = entry.target.clone().unwrap_or_default();
    let n = |k: &str| d[k].as_u64().unwrap_or(0);
    match (entry.action.as_str(), d["outcome"].as_str()) {
        ("provider.qualify", Some("done")) => Some(format!(
            "{}: {} ({} of {} case(s) passed).",
            target.replace('/', " for "),
            if d["qualified"] == true {
                "qualified"
            } else {
                "not qualified"
            },
            n("passed"),
            n("cases")
        )),
        ("dlq.replay", Some("done")) => Some(format!(
            "{target}: {} dead letter(s) replayed, {} skipped.",
            n("replayed"),
            n("skipped")
        )),
        ("dlq.purge", Some("done")) => {
            Some(format!("{target}: {} dead letter(s) purged.", n("purged")))
        }
        _ => None,
    }
}

async fn providers(
    State(app): State<Console>,
    who: Operator,
    Query(q): Query<ProvidersQuery>,
) -> Response {
    let config = &app.0.config;
    let standing = match crate::qualify::standing_of_routes(config, &app.0.store).await {
        Ok(s) => s,
        Err(e) => return app.message(Some(&who), e.into()),
    };
    let rows: Vec<_> = config
        .providers
        .values()
        .map(|p| {
            let operations: Vec<_> = config
                .operations
                .values()
                .filter_map(|o| {
                    let position = o.route.iter().position(|r| *r == p.name)?;
                    let (state, run) = standing
                        .get(&(p.name.clone(), o.name.clone()))
                        .map_or((crate::qualify::State::NeverQualified, None), |(s, r)| {
                            (*s, r.as_ref())
                        });
                    let mut link = url::form_urlencoded::Serializer::new(String::new());
                    link.append_pair("provider", &p.name);
                    link.append_pair("operation", &o.name);
                    Some(context! {
                        operation => o.name.clone(),
                        role => if position == 0 { "primary" } else { "failover" },
                        position => position + 1,
                        state => serde_json::to_value(state).ok()
                            .and_then(|v| v.as_str().map(|s| s.replace('_', " "))),
                        eligible => position == 0 || state == crate::qualify::State::Qualified,
                        cases => o.cases.len(),
                        last_run => run.map(|r| context! {
                            at => r.at.to_rfc3339(),
                            ago => age((chrono::Utc::now() - r.at).num_milliseconds() as f64 / 1000.0),
                            passed => r.passed,
                            cases => r.cases,
                            contract => r.contract_hash.chars().take(12).collect::<String>(),
                        }),
                        qualify => format!("/providers/qualify?{}", link.finish()),
                    })
                })
                .collect();
            context! {
                name => p.name.clone(),
                base_url => crate::broker::redact_url(p.base_url.as_str()),
                model => p.model.clone(),
                timeout => humantime::format_duration(p.timeout).to_string(),
                concurrency => p.concurrency,
                operations,
            }
        })
        .collect();
    let done = done_banner(&app, q.done).await;
    app.render(
        "providers.html",
        context! {
            title => "Providers", operator => who.name, csrf => who.csrf,
            providers => rows, done,
        },
    )
}

/// The provider and operation a qualify request names, if both are
/// configured and the operation routes to the provider.
fn qualify_pair<'a>(
    app: &'a Console,
    provider: Option<&str>,
    operation: Option<&str>,
) -> Result<(&'a crate::config::Provider, &'a crate::config::Operation), Failure> {
    let bad = |text: String| Failure(StatusCode::BAD_REQUEST, text);
    let config = &app.0.config;
    let provider = provider.map(str::trim).unwrap_or_default();
    let operation = operation.map(str::trim).unwrap_or_default();
    let p = config
        .providers
        .get(provider)
        .ok_or_else(|| bad(format!("{provider:?} is not a configured provider.")))?;
    let o = config
        .operations
        .get(operation)
        .ok_or_else(|| bad(format!("{operation:?} is not a configured operation.")))?;
    if !o.route.contains(&p.name) {
        return Err(bad(format!(
            "{operation} does not route to {provider}: there is nothing to qualify it for."
        )));
    }
    Ok((p, o))
}

async fn confirm_qualify(
    State(app): State<Console>,
    who: Operator,
    Query(q): Query<ProvidersQuery>,
) -> Response {
    let (p, o) = match qualify_pair(&app, q.provider.as_deref(), q.operation.as_deref()) {
        Ok(pair) => pair,
        Err(f) => return app.message(Some(&who), f),
    };
    let what = if o.cases.is_empty() {
        format!(
            "{} has no golden cases: the run records that {} did not qualify for it. Add \
             [[operations.{}.cases]] to the configuration first.",
            o.name, p.name, o.name
        )
    } else {
        format!(
            "Send the {} golden case(s) of {} to {} (model {}, {}) now, one after another, and \
             check each answer against the operation's output schema. The run is recorded \
             against contract {}: if every case passes, {} may take failovers and hedges of {}; \
             if one fails, it may not until a later run passes. The provider bills these calls.",
            o.cases.len(),
            o.name,
            p.name,
            p.model,
            crate::broker::redact_url(p.base_url.as_str()),
            &crate::qualify::contract_hash(o, p)[..12],
            p.name,
            o.name
        )
    };
    app.render(
        "confirm_qualify.html",
        context! {
            title => "Qualify a provider", operator => who.name, csrf => who.csrf,
            provider => p.name.clone(), operation => o.name.clone(), what,
        },
    )
}

#[derive(Deserialize)]
struct QualifyForm {
    csrf: Option<String>,
    provider: Option<String>,
    operation: Option<String>,
    #[serde(default)]
    reason: String,
}

async fn qualify(
    State(app): State<Console>,
    who: Operator,
    Form(form): Form<QualifyForm>,
) -> Response {
    let reason = match authorised(&app, &who, form.csrf.as_deref(), &form.reason) {
        Ok(r) => r,
        Err(page) => return *page,
    };
    let (p, o) = match qualify_pair(&app, form.provider.as_deref(), form.operation.as_deref()) {
        Ok(pair) => pair,
        Err(f) => return app.message(Some(&who), f),
    };
    // Recorded first: the provider bills these calls, so none goes unrecorded.
    let audit = match begin_action(&app, &who, reason, &crate::qualify::action(p, o)).await {
        Ok(a) => a,
        Err(page) => return *page,
    };
    // The calls run in a task of their own: a browser that goes away does not
    // cut a paid run short of its record.
    let store = app.0.store.clone();
    let (config, provider, operation) = (app.0.config.clone(), p.name.clone(), o.name.clone());
    let run = tokio::spawn(async move {
        let (p, o) = (&config.providers[&provider], &config.operations[&operation]);
        let (report, recorded) = crate::qualify::run_audited(&store, &config, p, o, audit).await;
        tracing::info!(%provider, %operation, qualified = report.passed, "console: qualified a provider");
        recorded.map(|_| ())
    });
    match run.await {
        Ok(Ok(())) => Redirect::to(&format!("/providers?done={audit}")).into_response(),
        Ok(Err(e)) => app.message(Some(&who), e.into()),
        Err(e) => {
            let text = format!("the qualification run failed: {e}");
            app.message(Some(&who), Failure(StatusCode::INTERNAL_SERVER_ERROR, text))
        }
    }
}

/// The confirmation page of a dead-letter action, as a link.
fn confirm_link(pairs: &[(&str, &str)]) -> String {
    let mut link = url::form_urlencoded::Serializer::new(String::new());
    link.extend_pairs(pairs);
    format!("/dead-letters/confirm?{}", link.finish())
}

/// Back to the dead letters, saying what was done (from its audit row; a
/// reload does not do it again).
fn done(audit: Uuid) -> Response {
    Redirect::to(&format!("/dead-letters?done={audit}")).into_response()
}

/// The address the console listens on when `--listen` is not given.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8090";

/// Binds `listen`, or says why it cannot.
pub async fn bind(listen: SocketAddr) -> Result<tokio::net::TcpListener, String> {
    tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| format!("cannot listen on {listen}: {e}"))
}
