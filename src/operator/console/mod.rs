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
//!
//! The router lists the pages; each page group is a file of its own:
//! `overview`, `jobs` (the list), `job` (one job's timeline and
//! history), `unknowns` (resolving them), `dead_letters`, `providers`
//! (qualifying them), `owners` (their limits, spend, and setting them). `session` signs operators in and out and checks each
//! form's CSRF token; `action` holds what every action shares (a reason, an
//! audit row written first); `page` renders templates and failures.

mod action;
mod dead_letters;
mod failure;
mod history;
mod job;
mod jobs;
mod overview;
mod owners;
mod page;
mod providers;
mod session;
mod timeline;
mod unknowns;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::http::HeaderValue;
use axum::response::Response;
use axum::routing::{get, post};
use minijinja::Environment;

use crate::edges::store::Store;
use crate::settings::config::Config;

pub use session::LOGIN_COOKIE;

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
            amqp_url: crate::settings::config::DEFAULT_AMQP_URL.to_owned(),
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
    sign_ins: crate::operator::throttle::Throttle,
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
            sign_ins: crate::operator::throttle::Throttle::new(options.sign_ins_per_minute),
            options,
            pages: page::templates(),
        }))
    }

    /// The console's routes.
    pub fn router(self) -> Router {
        Router::new()
            .route("/login", get(session::login_page).post(session::login))
            .route("/logout", post(session::logout))
            .route("/", get(overview::page))
            .route("/jobs", get(jobs::page))
            .route("/jobs/{id}", get(job::page))
            .route("/unknowns", get(unknowns::page))
            .route(
                "/attempts/{id}/resolve",
                get(unknowns::confirm_resolve).post(unknowns::resolve),
            )
            .route("/dead-letters", get(dead_letters::page))
            .route("/dead-letters/confirm", get(dead_letters::confirm))
            .route("/dead-letters/replay", post(dead_letters::replay))
            .route("/dead-letters/purge", post(dead_letters::purge))
            .route("/providers", get(providers::page))
            .route(
                "/providers/qualify",
                get(providers::confirm_qualify).post(providers::qualify),
            )
            .route("/owners", get(owners::page))
            .route("/owners/set", post(owners::set))
            .route("/static/console.css", get(page::stylesheet))
            .fallback(page::not_found)
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
    let served = crate::edges::http::serve(
        listener,
        console.router(),
        crate::edges::http::ClientLimits::default(),
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
        if let Err(e) = store.sessions().expire().await {
            tracing::warn!(error = %e, "console: cannot delete expired sessions; trying again later");
        }
    }
}

/// The address the console listens on when `--listen` is not given.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8090";

/// Binds `listen`, or says why it cannot.
pub async fn bind(listen: SocketAddr) -> Result<tokio::net::TcpListener, String> {
    tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| format!("cannot listen on {listen}: {e}"))
}
