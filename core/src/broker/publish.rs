//! Publishing: persistent JSON messages on a channel in confirm mode, each
//! publish waiting for the broker's confirm.

use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Channel, Connection};

use super::{BrokerError, CONFIRM_TIMEOUT, Result, short};

/// Persistent JSON message properties, as the contract requires of every publish.
pub fn json_properties() -> BasicProperties {
    BasicProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
}

/// A channel in confirm mode. Every publish returns only once the broker has
/// confirmed it (or refused it: then it is an error, never silently dropped).
///
/// The broker closes a channel on some errors (a publish to an exchange that was
/// deleted, say), and every later publish on it would fail. [`Publisher::heal`]
/// opens a fresh confirm channel in its place; the worker's supervisor calls it,
/// and readiness follows [`Publisher::is_open`].
#[derive(Clone, Debug)]
pub struct Publisher {
    channel: std::sync::Arc<std::sync::Mutex<Channel>>,
    confirm_timeout: Duration,
}

async fn confirm_channel(conn: &Connection) -> Result<Channel> {
    let channel = super::open_channel(conn).await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(channel)
}

impl Publisher {
    /// Opens a confirm-mode channel on `conn`.
    pub async fn open(conn: &Connection) -> Result<Publisher> {
        Ok(Self::from_channel(confirm_channel(conn).await?))
    }

    /// Wraps a channel already in confirm mode.
    pub fn from_channel(channel: Channel) -> Publisher {
        Publisher {
            channel: std::sync::Arc::new(std::sync::Mutex::new(channel)),
            confirm_timeout: CONFIRM_TIMEOUT,
        }
    }

    /// The same publisher, waiting at most `timeout` for each confirm.
    pub fn with_confirm_timeout(mut self, timeout: Duration) -> Publisher {
        self.confirm_timeout = timeout;
        self
    }

    /// The channel publishes go to now.
    pub fn channel(&self) -> Channel {
        self.channel
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Whether the channel is open (or being recovered with its connection).
    pub fn is_open(&self) -> bool {
        let channel = self.channel();
        channel.status().connected() || channel.status().reconnecting()
    }

    /// Opens a new confirm channel on `conn` in place of one the broker closed.
    /// Returns whether it did; a channel that is open, or that recovers with its
    /// connection, is left alone. One caller at a time (the supervisor).
    pub async fn heal(&self, conn: &Connection) -> Result<bool> {
        if self.is_open() || !conn.status().connected() {
            return Ok(false);
        }
        let fresh = confirm_channel(conn).await?;
        *self
            .channel
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = fresh;
        Ok(true)
    }

    /// Publishes and waits for the confirm. With `mandatory`, a message no queue
    /// takes is an error too.
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
        mandatory: bool,
    ) -> Result<()> {
        let confirm = self
            .channel()
            .basic_publish(
                short(exchange)?,
                short(routing_key)?,
                BasicPublishOptions {
                    mandatory,
                    ..BasicPublishOptions::default()
                },
                body,
                properties,
            )
            .await?;
        let confirmation = tokio::time::timeout(self.confirm_timeout, confirm)
            .await
            .map_err(|_| BrokerError::ConfirmTimeout {
                exchange: exchange.to_owned(),
                routing_key: routing_key.to_owned(),
                timeout: self.confirm_timeout,
            })??;
        let nacked = confirmation.is_nack();
        if let Some(returned) = confirmation.take_message() {
            return Err(BrokerError::Unroutable {
                exchange: exchange.to_owned(),
                routing_key: routing_key.to_owned(),
                reply: returned.reply_text.to_string(),
            });
        }
        if nacked {
            return Err(BrokerError::Nacked {
                exchange: exchange.to_owned(),
                routing_key: routing_key.to_owned(),
            });
        }
        Ok(())
    }
}
