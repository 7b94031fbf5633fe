//! Connection supervision (a connection that does not recover in time stops
//! the worker, to be restarted) and the health endpoints.

use std::time::Duration;

use super::{Context, Result, WorkerError};
use crate::edges::shutdown::Shutdown;

/// How long a worker's RabbitMQ connection may stay down, recovering, before the
/// worker gives up and exits (non-zero) to be restarted.
const RECONNECT_WATCHDOG: Duration = Duration::from_secs(120);

/// Watches the AMQP connection and the publishing channel. Automatic recovery
/// handles short outages; once it gives up (the connection is closed or errored
/// for good), this returns an error, [`crate::fleet::run`] stops every role, and the worker
/// exits non-zero so that its orchestrator restarts it. A publishing channel the
/// broker closed is replaced with a fresh one.
pub async fn supervise_connection(ctx: Context, shutdown: Shutdown) -> Result<()> {
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    let mut down_since: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            () = shutdown.wait() => return Ok(()),
            _ = tick.tick() => {}
        }
        let status = ctx.connection.status();
        if status.errored() || status.closed() {
            return Err(WorkerError::RoleStopped(
                "amqp connection".into(),
                "RabbitMQ connection lost and automatic recovery gave up".into(),
            ));
        }
        // Recovery retries refused connections for about a minute, but a node
        // that takes the TCP connection and never answers the AMQP handshake (a
        // frozen node, a half-open path) would hold it forever: past the
        // watchdog, the worker exits for its orchestrator to restart it.
        if status.connected() {
            down_since = None;
        } else {
            let since = *down_since.get_or_insert_with(tokio::time::Instant::now);
            if since.elapsed() > RECONNECT_WATCHDOG {
                return Err(WorkerError::RoleStopped(
                    "amqp connection".into(),
                    format!(
                        "RabbitMQ connection not back after {RECONNECT_WATCHDOG:?} of recovery"
                    ),
                ));
            }
        }
        match ctx.publisher.heal(&ctx.connection).await {
            Ok(true) => {
                tracing::warn!("the broker had closed the publishing channel; opened a new one")
            }
            Ok(false) => {}
            Err(e) => tracing::warn!(error = %e, "cannot reopen the publishing channel yet"),
        }
    }
}

/// The `/readyz` answer of a process that needs both services: `200` when both
/// are up, else `503`, with one line per service.
pub fn readiness(postgres: bool, rabbitmq: bool) -> (axum::http::StatusCode, String) {
    let state = |up: bool| if up { "ok" } else { "down" };
    let body = format!(
        "postgres: {}\nrabbitmq: {}\n",
        state(postgres),
        state(rabbitmq)
    );
    if postgres && rabbitmq {
        (axum::http::StatusCode::OK, body)
    } else {
        (axum::http::StatusCode::SERVICE_UNAVAILABLE, body)
    }
}

/// `/healthz` (the process is up), `/readyz` (Postgres answers and the AMQP
/// connection is connected) and `/metrics` (Prometheus text).
pub fn health_router(ctx: Context) -> axum::Router {
    use axum::http::StatusCode;
    use axum::routing::get;

    async fn ready(
        axum::extract::State(ctx): axum::extract::State<Context>,
    ) -> (StatusCode, String) {
        readiness(
            ctx.store.ping().await,
            ctx.connection.status().connected() && ctx.publisher.is_open(),
        )
    }

    // Read by a timer, never by a scrape.
    let gauges = crate::edges::gauges::Gauges::refreshed(ctx.store.clone());
    let metrics = move || {
        let gauges = gauges.clone();
        async move {
            let g = gauges.text().unwrap_or_else(|| {
                "# the gauges have not been read from the database yet\n".to_owned()
            });
            (StatusCode::OK, g + &crate::edges::metrics::render())
        }
    };

    axum::Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .with_state(ctx)
}
