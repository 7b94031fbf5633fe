//! Opening a channel within a time. A `channel.open` whose reply never comes
//! (its connection lost while it was in flight, and a recovery that never ends
//! the wait) would hold its caller for good: a role stuck there neither works
//! nor stops, so nothing restarts its worker.

use std::time::Duration;

use lapin::{Channel, Connection};

use super::{BrokerError, Result};

/// How long a channel may take to open.
pub const OPEN_TIMEOUT: Duration = Duration::from_secs(30);

/// Opens a channel on `conn`, waiting at most [`OPEN_TIMEOUT`].
pub async fn open_channel(conn: &Connection) -> Result<Channel> {
    open_channel_within(conn, OPEN_TIMEOUT).await
}

/// Opens a channel on `conn`, waiting at most `limit`; then
/// [`BrokerError::ChannelOpenTimeout`].
pub async fn open_channel_within(conn: &Connection, limit: Duration) -> Result<Channel> {
    match tokio::time::timeout(limit, conn.create_channel()).await {
        Ok(opened) => Ok(opened?),
        Err(_) => Err(BrokerError::ChannelOpenTimeout(limit)),
    }
}
