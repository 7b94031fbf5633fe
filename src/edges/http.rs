//! Serving HTTP to clients that are not trusted to be quick or few: the
//! gateway's and the console's listeners. A client has `header_timeout` to
//! send a request's line and headers (and, on a kept-alive connection, to
//! start its next request), and at most `max_connections` connections are
//! held at once; the rest wait in the listen backlog until one closes. Bodies
//! are timed by the handlers that read them. Each request carries its peer's
//! address as [`ConnectInfo<SocketAddr>`](ConnectInfo), as `axum::serve`
//! gives it.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::ConnectInfo;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tower_service::Service;

/// What one listener allows its clients.
#[derive(Clone, Copy, Debug)]
pub struct ClientLimits {
    /// How long a client may take to send a request's line and headers.
    pub header_timeout: Duration,
    /// Connections held open at once.
    pub max_connections: usize,
}

impl Default for ClientLimits {
    fn default() -> Self {
        ClientLimits {
            header_timeout: Duration::from_secs(10),
            max_connections: 1024,
        }
    }
}

/// Serves `app` on `listener` within `limits` until `shutdown` completes;
/// then takes no new connection, lets the requests in flight finish and
/// closes idle connections.
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    limits: ClientLimits,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let places = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let place = tokio::select! {
            place = places.clone().acquire_owned() => match place {
                Ok(p) => p,
                Err(_) => break,
            },
            () = &mut shutdown => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors, or a connection reset before it was
                    // taken: wait a little rather than spin, and go on.
                    tracing::warn!(error = %e, "cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let app = app.clone();
        let service = hyper::service::service_fn(
            move |mut request: hyper::Request<hyper::body::Incoming>| {
                request.extensions_mut().insert(ConnectInfo(peer));
                app.clone().call(request)
            },
        );
        let connection = graceful.watch(builder.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            // A client that goes away, or is too slow, ends only its own
            // connection.
            let _ = connection.await;
            drop(place);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}
