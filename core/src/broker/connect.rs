//! Connecting to RabbitMQ: to the first node of the list that answers, and,
//! with [`Recovery::Auto`], to the next one that answers after a loss.

use std::time::Duration;

use lapin::{Connection, ConnectionProperties};

use super::nodes::{Rotation, describe_uri};
use super::{BrokerError, Nodes, Result, login_cut_short, redact_url};

/// How a connection reacts to losing the broker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recovery {
    /// Fail at once: for short-lived tools (the CLI, the producer), which report
    /// the error and let their caller retry.
    None,
    /// Reconnect and replay the topology, retrying for about a minute; when that
    /// gives up the connection's status says so and the worker exits non-zero, so
    /// that its orchestrator restarts it.
    Auto,
}

/// How long one node may take to accept a TCP connection before the next is
/// tried.
const NODE_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the AMQP handshake may take once a node took the TCP connection.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long lapin's retries of a first connection may take with
/// [`Recovery::Auto`] (16 tries, 0.2 s doubling to 5 s between them), with room.
const AUTO_RETRIES: Duration = Duration::from_secs(80);

/// Connects to RabbitMQ: to the first node of `url` (one URL, or a
/// comma-separated list of a cluster's nodes) that answers. When the connection
/// is lost, recovery (with [`Recovery::Auto`]) moves on to the next node that
/// answers.
pub async fn connect(url: &str, recovery: Recovery) -> Result<Connection> {
    if login_cut_short(url) {
        return Err(BrokerError::CutShort);
    }
    let nodes = Nodes::parse(url)?;
    let props = connection_properties(recovery);
    let runtime = lapin::runtime::default_runtime()?;
    let give_up = first_connection_patience(recovery, &nodes);
    // Each node in turn starts the rotation: the TCP connect already moves past
    // nodes that refuse, and this moves past one that takes the connection but
    // never completes the handshake.
    let mut last = None;
    for first in 0..nodes.len() {
        let rotation = std::sync::Arc::new(Rotation::starting_at(nodes.clone(), first));
        let uri = nodes.uris[first].clone();
        // lapin calls this for the first connection and for every reconnection:
        // a TCP connection to the first node, from the rotation's current one
        // on, that accepts it.
        let open = async move |_uri, runtime| {
            use lapin::tcp::AMQPUriTcpExt;
            let count = rotation.nodes.len();
            let mut last = None;
            for (k, uri) in rotation.order() {
                let node = describe_uri(uri);
                let n = k + 1;
                match tokio::time::timeout(NODE_CONNECT_TIMEOUT, uri.connect_async(&runtime)).await
                {
                    Ok(Ok(stream)) => {
                        rotation.connected(k);
                        tracing::info!(%node, "RabbitMQ node {n} of {count} accepted the connection");
                        return Ok(stream);
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(%node, error = %e, "RabbitMQ node {n} of {count} refused the connection");
                        last = Some(e);
                    }
                    Err(_) => {
                        tracing::warn!(%node, "RabbitMQ node {n} of {count} did not answer within {NODE_CONNECT_TIMEOUT:?}");
                        last = Some(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            format!("{node} did not answer within {NODE_CONNECT_TIMEOUT:?}"),
                        ));
                    }
                }
            }
            Err(last
                .unwrap_or_else(|| std::io::Error::other("no RabbitMQ node to connect to"))
                .into())
        };
        let connecting = Connection::connector(uri, runtime.clone(), open, props.clone());
        match tokio::time::timeout(give_up, connecting).await {
            Ok(Ok(connection)) => return Ok(connection),
            Ok(Err(e)) => last = Some(BrokerError::from(e)),
            Err(_) => last = Some(no_handshake(url, give_up, first, nodes.len())),
        }
    }
    Err(last.unwrap_or_else(|| BrokerError::NoConnection("no node to connect to".into())))
}

/// The connection's properties: its name, and with [`Recovery::Auto`] lapin's
/// reconnection with backoff.
fn connection_properties(recovery: Recovery) -> ConnectionProperties {
    let props = ConnectionProperties::default().with_connection_name("onejob".into());
    match recovery {
        Recovery::None => props,
        Recovery::Auto => props
            .configure_backoff(|b| {
                b.with_min_delay(Duration::from_millis(200))
                    .with_max_delay(Duration::from_secs(5))
                    .with_max_times(16)
            })
            .enable_auto_recover(),
    }
}

/// How long a first connection waits before it gives up on a node that took
/// the TCP connection but never answered the handshake (a frozen node).
fn first_connection_patience(recovery: Recovery, nodes: &Nodes) -> Duration {
    let connecting = match recovery {
        Recovery::None => NODE_CONNECT_TIMEOUT * u32::try_from(nodes.len()).unwrap_or(u32::MAX),
        Recovery::Auto => AUTO_RETRIES,
    };
    connecting + HANDSHAKE_TIMEOUT
}

/// No connection within `give_up` from node `first` on: logged, and the error
/// to return if no other starting node does better.
fn no_handshake(url: &str, give_up: Duration, first: usize, count: usize) -> BrokerError {
    tracing::warn!(
        "no RabbitMQ connection within {give_up:?}, starting at node {} of {}",
        first + 1,
        count
    );
    BrokerError::NoConnection(format!(
        "no connection within {give_up:?} (a node took the TCP connection \
         and never completed the AMQP handshake?) at {}",
        redact_url(url)
    ))
}
