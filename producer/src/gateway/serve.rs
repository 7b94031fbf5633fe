//! Serving: the public routes and the probes, each answer counted, until
//! shutdown or the loss of the RabbitMQ connection.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::response::Response;
use axum::routing::{get, post};
use onejob::edges::shutdown::Shutdown;

use super::create::create_job;
use super::show::show_job;
use super::{Gateway, GatewayError, OPENAPI, Result};

impl Gateway {
    /// The public routes: `/v1/jobs`, `/v1/jobs/{id}`, `/openapi.json`,
    /// `/healthz` and `/readyz`. Every answer is counted by route and status.
    pub fn router(self: Arc<Self>) -> axum::Router {
        axum::Router::new()
            .route("/v1/jobs", post(create_job))
            .route("/v1/jobs/{id}", get(show_job))
            .route(
                "/openapi.json",
                get(|| async { ([(header::CONTENT_TYPE, "application/json")], OPENAPI) }),
            )
            .merge(probes())
            .route_layer(axum::middleware::from_fn(count_answers))
            .with_state(self)
    }

    /// The probes listener's routes: `/healthz`, `/readyz` and `/metrics`.
    pub fn probes_router(self: Arc<Self>) -> axum::Router {
        probes()
            .route(
                "/metrics",
                get(|| async { onejob::edges::metrics::render() }),
            )
            .with_state(self)
    }

    /// Serves until `shutdown` (finishing the requests in flight), or until the
    /// RabbitMQ connection is lost, which is an error: the process should exit
    /// non-zero and be restarted.
    /// With `probes`, `/healthz`, `/readyz` and `/metrics` are served there too.
    pub async fn serve(
        self: Arc<Self>,
        listener: tokio::net::TcpListener,
        probes: Option<tokio::net::TcpListener>,
        shutdown: Shutdown,
    ) -> Result<()> {
        let watched = self.clone();
        let stop = shutdown.clone();
        let supervisor = async move {
            let mut tick = tokio::time::interval(Duration::from_millis(500));
            loop {
                tokio::select! {
                    () = stop.wait() => return Ok(()),
                    _ = tick.tick() => {}
                }
                if !watched.producer.is_connected() {
                    stop.trigger();
                    return Err(GatewayError::ConnectionLost);
                }
            }
        };
        let limits = onejob::edges::http::ClientLimits {
            header_timeout: self.options.header_timeout,
            max_connections: self.options.max_connections,
        };
        let stop = shutdown.clone();
        let server =
            onejob::edges::http::serve(listener, self.clone().router(), limits, async move {
                stop.wait().await
            });
        let stop = shutdown.clone();
        let probes_router = self.clone().probes_router();
        let probes = async move {
            match probes {
                Some(l) => {
                    onejob::edges::http::serve(l, probes_router, limits, async move {
                        stop.wait().await
                    })
                    .await
                }
                None => Ok(()),
            }
        };
        let (served, probed, supervised) = tokio::join!(server, probes, supervisor);
        served?;
        probed?;
        supervised
    }
}

/// Counts every answer by route and status, for `/metrics`.
async fn count_answers(
    route: axum::extract::MatchedPath,
    request: Request,
    next: axum::middleware::Next,
) -> Response {
    let route = route.as_str().to_owned();
    let response = next.run(request).await;
    onejob::edges::metrics::gateway_answer(&route, response.status().as_u16());
    response
}

/// `/healthz` (the process is up) and `/readyz` (Postgres answers and the
/// RabbitMQ connection is up).
fn probes() -> axum::Router<Arc<Gateway>> {
    axum::Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
}

async fn ready(State(gateway): State<Arc<Gateway>>) -> (StatusCode, String) {
    onejob::shared::runtime::readiness(gateway.store.ping().await, gateway.producer.is_connected())
}
