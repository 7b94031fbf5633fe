//! RabbitMQ: the topology of contract section 2, connections, and publishing that
//! waits for the broker's confirm.
//!
//! Declarations are idempotent and every program makes them at start, on a channel
//! of their own: a 406 on a mismatched redeclaration closes that channel only.

use std::time::Duration;

use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::uri::AMQPUri;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};

/// The work exchange: intents and attempt messages.
pub const EXCHANGE: &str = "onejob";
/// The dead-letter exchange.
pub const DLX: &str = "onejob.dlx";
/// The events exchange (topic).
pub const EVENTS: &str = "onejob.events";
/// The intents queue.
pub const INTENTS_QUEUE: &str = "onejob.intents";
/// The routing key producers publish intents with.
pub const INTENTS_KEY: &str = "intents";
/// The header naming why a message was dead-lettered by onejob.
pub const ERROR_HEADER: &str = "x-onejob-error";
/// When onejob dead-lettered a message itself (the broker's own dead letters
/// carry the time in `x-death`).
pub const DEAD_LETTERED_AT_HEADER: &str = "x-onejob-dead-lettered-at";
/// How long a publish waits for the broker's confirm, by default.
pub const CONFIRM_TIMEOUT: Duration = Duration::from_secs(30);
/// AMQP 0-9-1 caps short strings (routing keys, reply-to) at 255 bytes.
const SHORT_STRING_MAX: usize = 255;

/// A broker failure.
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    /// The AMQP client failed.
    #[error("amqp: {0}")]
    Amqp(#[from] lapin::Error),
    /// The URL's login was cut short ([`login_cut_short`]): refused unread.
    #[error("the AMQP URL has {CUT_SHORT}")]
    CutShort,
    /// The broker refused the message.
    #[error("broker nacked the publish to {exchange:?} with key {routing_key:?}")]
    Nacked {
        /// The exchange.
        exchange: String,
        /// The routing key.
        routing_key: String,
    },
    /// The broker did not confirm (nor refuse) a publish in time: whether it took
    /// the message is not known.
    #[error(
        "no publisher confirm from the broker within {timeout:?} for the publish to {exchange:?} with key {routing_key:?}"
    )]
    ConfirmTimeout {
        /// The exchange.
        exchange: String,
        /// The routing key.
        routing_key: String,
        /// How long it waited.
        timeout: Duration,
    },
    /// A mandatory message had no queue to go to.
    #[error("unroutable: no queue is bound to {exchange:?} with key {routing_key:?} ({reply})")]
    Unroutable {
        /// The exchange.
        exchange: String,
        /// The routing key.
        routing_key: String,
        /// The broker's reply text.
        reply: String,
    },
    /// A work queue exists with other arguments than this version declares (one
    /// declared before at-least-once dead-lettering, or with another delivery
    /// limit): the broker refuses the declaration.
    #[error(
        "queue {queue:?} exists with other arguments than this version declares ({expected}); \
         stop the fleet and run `onejob queues upgrade`, which redeclares empty queues and never deletes one that holds messages"
    )]
    OutdatedQueue {
        /// The queue.
        queue: String,
        /// The arguments this version declares.
        expected: String,
    },
    /// `AMQP_URL` (or `--amqp-url`) is not one AMQP URL or a list of them.
    #[error("AMQP_URL: {0}")]
    BadUrl(String),
    /// No node of the list could be connected to in time.
    #[error("RabbitMQ: {0}")]
    NoConnection(String),
    /// A name is too long for AMQP.
    #[error("{0:?} is longer than AMQP's 255-byte limit")]
    NameTooLong(String),
}

/// Result alias for the broker.
pub type Result<T, E = BrokerError> = std::result::Result<T, E>;

/// The queue that holds attempts for `provider`.
pub fn attempts_queue(provider: &str) -> String {
    format!("onejob.attempts.{provider}")
}

/// The routing key of attempt messages for `provider`.
pub fn attempts_routing_key(provider: &str) -> String {
    format!("attempts.{provider}")
}

/// The dead-letter queue of `queue`.
pub fn dead_letter_queue(queue: &str) -> String {
    format!("{queue}.dlq")
}

/// Builds a short string, refusing (not truncating) one that is too long.
pub fn short(s: &str) -> Result<ShortString> {
    if s.len() > SHORT_STRING_MAX {
        return Err(BrokerError::NameTooLong(s.to_owned()));
    }
    Ok(ShortString::from(s))
}

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

/// The nodes an `AMQP_URL` names: one URL, or the URLs of a cluster's nodes
/// separated by commas. They share one login and one virtual host (a cluster's
/// users and vhosts are the cluster's, not a node's), so that a connection can
/// move from one node to another.
#[derive(Clone, Debug)]
pub(crate) struct Nodes {
    uris: Vec<AMQPUri>,
}

impl Nodes {
    /// Parses a list, naming (with every password masked) what is wrong with it.
    pub(crate) fn parse(list: &str) -> Result<Nodes> {
        let texts: Vec<&str> = list.split(',').map(str::trim).collect();
        let count = texts.len();
        let mut uris: Vec<AMQPUri> = Vec::with_capacity(count);
        for (i, text) in texts.iter().enumerate() {
            let at = || {
                if count == 1 {
                    String::new()
                } else {
                    format!("node {} of {count}: ", i + 1)
                }
            };
            if text.is_empty() {
                return Err(BrokerError::BadUrl(format!(
                    "{}an empty URL (in {:?}); separate the nodes' URLs with single commas",
                    at(),
                    redact_url(list)
                )));
            }
            // The parser's own message may quote the text, password and all: it
            // is not passed on.
            let uri: AMQPUri = text.parse().map_err(|_: String| {
                BrokerError::BadUrl(format!(
                    "{}{} is not an AMQP URL like amqp://user:password@host:5672/%2f \
                     (nodes are separated by commas; a comma inside a password is written %2C)",
                    at(),
                    redact_url(text)
                ))
            })?;
            if let Some(first) = uris.first()
                && (first.authority.userinfo != uri.authority.userinfo || first.vhost != uri.vhost)
            {
                return Err(BrokerError::BadUrl(format!(
                    "{}{} names another user, password or virtual host than node 1 ({}); \
                     the nodes of one cluster share them, and a connection moves between nodes with one login",
                    at(),
                    redact_url(text),
                    redact_url(texts[0])
                )));
            }
            uris.push(uri);
        }
        Ok(Nodes { uris })
    }

    /// How many nodes the list names (at least one, once parsed).
    fn len(&self) -> usize {
        self.uris.len()
    }
}

/// Which node a connection tries first: the first of the list at the start, and
/// after a loss the one after the node it lost, so that a dead node is tried
/// last.
struct Rotation {
    nodes: Nodes,
    next: std::sync::atomic::AtomicUsize,
}

impl Rotation {
    /// The nodes to try, in order: from the current one round the list.
    fn order(&self) -> impl Iterator<Item = (usize, &AMQPUri)> {
        let count = self.nodes.len();
        let start = self.next.load(std::sync::atomic::Ordering::SeqCst);
        (0..count).map(move |i| {
            let k = (start + i) % count;
            (k, &self.nodes.uris[k])
        })
    }

    /// Node `k` took the connection: when it is lost, the next try starts at the
    /// node after it.
    fn connected(&self, k: usize) {
        let next = (k + 1) % self.nodes.len();
        self.next.store(next, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A node's address for logs: scheme, host and port, no login.
fn describe_uri(uri: &AMQPUri) -> String {
    format!(
        "{:?}://{}:{}",
        uri.scheme, uri.authority.host, uri.authority.port
    )
    .to_lowercase()
}

/// Connects to RabbitMQ: to the first node of `url` (one URL, or a
/// comma-separated list of a cluster's nodes) that answers. When the connection
/// is lost, recovery (with [`Recovery::Auto`]) moves on to the next node that
/// answers.
pub async fn connect(url: &str, recovery: Recovery) -> Result<Connection> {
    if login_cut_short(url) {
        return Err(BrokerError::CutShort);
    }
    let nodes = Nodes::parse(url)?;
    let props = ConnectionProperties::default().with_connection_name("onejob".into());
    let props = match recovery {
        Recovery::None => props,
        Recovery::Auto => props
            .configure_backoff(|b| {
                b.with_min_delay(Duration::from_millis(200))
                    .with_max_delay(Duration::from_secs(5))
                    .with_max_times(16)
            })
            .enable_auto_recover(),
    };
    let runtime = lapin::runtime::default_runtime()?;
    // A first connection gives up on a node that took the TCP connection but
    // never answered the handshake (a frozen node) after this long.
    let give_up = match recovery {
        Recovery::None => NODE_CONNECT_TIMEOUT * u32::try_from(nodes.len()).unwrap_or(u32::MAX),
        Recovery::Auto => AUTO_RETRIES,
    } + HANDSHAKE_TIMEOUT;
    // Each node in turn starts the rotation: the TCP connect already moves past
    // nodes that refuse, and this moves past one that takes the connection but
    // never completes the handshake.
    let mut last = None;
    for first in 0..nodes.len() {
        let rotation = std::sync::Arc::new(Rotation {
            nodes: nodes.clone(),
            next: std::sync::atomic::AtomicUsize::new(first),
        });
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
            Err(_) => {
                tracing::warn!(
                    "no RabbitMQ connection within {give_up:?}, starting at node {} of {}",
                    first + 1,
                    nodes.len()
                );
                last = Some(BrokerError::NoConnection(format!(
                    "no connection within {give_up:?} (a node took the TCP connection \
                     and never completed the AMQP handshake?) at {}",
                    redact_url(url)
                )));
            }
        }
    }
    Err(last.unwrap_or_else(|| BrokerError::NoConnection("no node to connect to".into())))
}

/// The arguments of every work queue. Dead-lettering is at-least-once: with
/// `x-dead-letter-strategy=at-least-once` (which needs `x-overflow=reject-publish`)
/// the broker keeps a message until its dead-letter queue has confirmed the copy,
/// where the default strategy may drop it on the way (contract section 2).
fn work_queue_args(queue: &str, delivery_limit: u32) -> FieldTable {
    let mut args = FieldTable::default();
    let text = |v: &str| AMQPValue::LongString(LongString::from(v));
    args.insert("x-queue-type".into(), text("quorum"));
    args.insert("x-dead-letter-exchange".into(), text(DLX));
    args.insert("x-dead-letter-routing-key".into(), text(queue));
    args.insert(
        "x-delivery-limit".into(),
        AMQPValue::LongLongInt(i64::from(delivery_limit)),
    );
    args.insert("x-dead-letter-strategy".into(), text("at-least-once"));
    args.insert("x-overflow".into(), text("reject-publish"));
    args
}

/// The work queue arguments, as one line for people.
fn describe_work_args(delivery_limit: u32) -> String {
    format!(
        "quorum, x-dead-letter-exchange={DLX}, x-delivery-limit={delivery_limit}, \
         x-dead-letter-strategy=at-least-once, x-overflow=reject-publish"
    )
}

/// Whether an AMQP error is the broker's 406 PRECONDITION_FAILED (a queue
/// redeclared with other arguments, a delete refused because the queue is not
/// empty or in use).
fn precondition_failed(e: &lapin::Error) -> bool {
    matches!(e.kind(), lapin::ErrorKind::ProtocolError(p) if p.get_id() == 406)
}

/// The work queues of a configuration and their routing keys.
fn work_queues(providers: &[String]) -> Vec<(String, String)> {
    let mut work = vec![(INTENTS_QUEUE.to_owned(), INTENTS_KEY.to_owned())];
    for p in providers {
        work.push((attempts_queue(p), attempts_routing_key(p)));
    }
    work
}

fn quorum_args() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from("quorum")),
    );
    args
}

/// Declares the whole topology: exchanges, the intents queue, one attempts queue per
/// provider, and a dead-letter queue for each work queue.
pub async fn declare_topology(
    conn: &Connection,
    providers: &[String],
    delivery_limit: u32,
) -> Result<()> {
    let ch = conn.create_channel().await?;
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    for (name, kind) in [
        (EXCHANGE, ExchangeKind::Direct),
        (DLX, ExchangeKind::Direct),
        (EVENTS, ExchangeKind::Topic),
    ] {
        ch.exchange_declare(name.into(), kind, durable, FieldTable::default())
            .await?;
    }
    let work = work_queues(providers);
    let queue_opts = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    for (queue, key) in &work {
        if let Err(e) = ch
            .queue_declare(
                short(queue)?,
                queue_opts,
                work_queue_args(queue, delivery_limit),
            )
            .await
        {
            return Err(if precondition_failed(&e) {
                BrokerError::OutdatedQueue {
                    queue: queue.clone(),
                    expected: describe_work_args(delivery_limit),
                }
            } else {
                e.into()
            });
        }
        bind_work_queue(&ch, queue, key).await?;
        let dlq = dead_letter_queue(queue);
        ch.queue_declare(short(&dlq)?, queue_opts, quorum_args())
            .await?;
        ch.queue_bind(
            short(&dlq)?,
            DLX.into(),
            short(queue)?,
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    }
    ch.close(200, "topology declared".into()).await?;
    Ok(())
}

/// A queue as the broker sees it now (a passive declare: nothing is created or
/// taken; a missing queue closes `ch`).
async fn inspect(ch: &Channel, queue: &str) -> Result<lapin::Queue> {
    let options = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    Ok(ch
        .queue_declare(short(queue)?, options, FieldTable::default())
        .await?)
}

/// The number of ready messages in `queue`, looked at on a channel of its own.
pub async fn depth(conn: &Connection, queue: &str) -> Result<u32> {
    let ch = conn.create_channel().await?;
    let q = inspect(&ch, queue).await?;
    let _ = ch.close(200, "counted".into()).await;
    Ok(q.message_count())
}

/// What `onejob queues upgrade` did with one work queue.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum QueueUpgrade {
    /// It already had this version's arguments (or did not exist, and now does).
    Current,
    /// It was empty and unused: deleted and declared again with this version's
    /// arguments.
    Redeclared,
    /// It holds messages or has consumers: left as it is.
    Refused {
        /// Ready messages in it.
        messages: u32,
        /// Consumers on it.
        consumers: u32,
    },
}

/// Brings every work queue to this version's arguments, then declares the rest of
/// the topology. A queue declared otherwise is deleted and declared again only if
/// it is empty and has no consumer, checked once more after it has been unbound
/// from the work exchange, so a queue that holds messages is never deleted.
pub async fn upgrade_queues(
    conn: &Connection,
    providers: &[String],
    delivery_limit: u32,
) -> Result<Vec<(String, QueueUpgrade)>> {
    let mut out = Vec::new();
    for (queue, key) in work_queues(providers) {
        let upgrade = upgrade_queue(conn, &queue, &key, delivery_limit).await?;
        out.push((queue, upgrade));
    }
    if out
        .iter()
        .all(|(_, u)| !matches!(u, QueueUpgrade::Refused { .. }))
    {
        declare_topology(conn, providers, delivery_limit).await?;
    }
    Ok(out)
}

/// One work queue of [`upgrade_queues`].
async fn upgrade_queue(
    conn: &Connection,
    queue: &str,
    key: &str,
    delivery_limit: u32,
) -> Result<QueueUpgrade> {
    use lapin::options::QueueDeleteOptions;
    let queue_opts = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    let args = || work_queue_args(queue, delivery_limit);
    let refused = |q: &lapin::Queue| QueueUpgrade::Refused {
        messages: q.message_count(),
        consumers: q.consumer_count(),
    };
    // Each step on a channel of its own: a 406 closes the channel it hit.
    let ch = conn.create_channel().await?;
    match ch.queue_declare(short(queue)?, queue_opts, args()).await {
        Ok(_) => {
            let _ = ch.close(200, "checked".into()).await;
            return Ok(QueueUpgrade::Current);
        }
        Err(e) if precondition_failed(&e) => {}
        Err(e) => return Err(e.into()),
    }
    let ch = conn.create_channel().await?;
    let existing = inspect(&ch, queue).await?;
    if existing.message_count() > 0 || existing.consumer_count() > 0 {
        let _ = ch.close(200, "checked".into()).await;
        return Ok(refused(&existing));
    }
    // Unbind it first, so that nothing new is routed to it, then look again:
    // quorum queues do not support the `if-empty` delete, so emptiness is
    // checked here, after the last way in is closed. A mandatory publish meanwhile
    // comes back unroutable to its publisher, which retries; nothing is lost.
    ch.queue_unbind(
        short(queue)?,
        EXCHANGE.into(),
        short(key)?,
        FieldTable::default(),
    )
    .await?;
    let again = inspect(&ch, queue).await?;
    if again.message_count() > 0 || again.consumer_count() > 0 {
        bind_work_queue(&ch, queue, key).await?;
        let _ = ch.close(200, "checked".into()).await;
        return Ok(refused(&again));
    }
    ch.queue_delete(short(queue)?, QueueDeleteOptions::default())
        .await?;
    ch.queue_declare(short(queue)?, queue_opts, args()).await?;
    // Bound again at once: other queues refused must not leave this one
    // unroutable until the next declaration.
    bind_work_queue(&ch, queue, key).await?;
    let _ = ch.close(200, "redeclared".into()).await;
    Ok(QueueUpgrade::Redeclared)
}

/// Binds a work queue to the work exchange with its routing key.
async fn bind_work_queue(ch: &Channel, queue: &str, key: &str) -> Result<()> {
    ch.queue_bind(
        short(queue)?,
        EXCHANGE.into(),
        short(key)?,
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    Ok(())
}

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
    let channel = conn.create_channel().await?;
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

/// A header's value as text, if it is a string.
pub fn header_str(headers: &FieldTable, name: &str) -> Option<String> {
    match headers.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.to_string()),
        _ => None,
    }
}

/// A whole-number header (a delivery count, say) as the broker or a publisher
/// set it; 0 when it is absent, negative or not a number.
pub fn header_count(headers: &FieldTable, name: &str) -> u64 {
    match headers.inner().get(name) {
        Some(AMQPValue::LongLongInt(n)) => u64::try_from(*n).unwrap_or(0),
        Some(AMQPValue::LongInt(n)) => u64::try_from(*n).unwrap_or(0),
        Some(AMQPValue::LongUInt(n)) => u64::from(*n),
        Some(AMQPValue::ShortInt(n)) => u64::try_from(*n).unwrap_or(0),
        _ => 0,
    }
}

/// Text that came from outside (a publisher's header, a provider's error)
/// with every control character escaped (`\u{1b}`), so that it can clear no
/// screen, write no clipboard and forge no log line wherever it is shown.
pub fn escape_controls(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    out
}

/// What to say of a URL whose login was cut short ([`login_cut_short`]).
pub const CUT_SHORT: &str = "'@' after the host: a password with an unencoded '#', '/' or '?' \
     ends the login there; percent-encode them (%23, %2F, %3F)";

/// Whether a URL (or any node of a comma-separated list) has an '@' past its
/// host: its authority was cut short, since a password pasted with an
/// unencoded '#', '/' or '?' ends it there, and the rest of the password sits
/// in the path, the query or the fragment, where a driver may log it as it
/// parses. Such a URL is refused before any driver sees it.
pub fn login_cut_short(url: &str) -> bool {
    url.split(',').any(|piece| {
        url::Url::parse(piece.trim()).is_ok_and(|parsed| {
            parsed.has_host()
                && [Some(parsed.path()), parsed.query(), parsed.fragment()]
                    .into_iter()
                    .flatten()
                    .any(|part| part.contains('@'))
        })
    })
}

/// Replaces the password in a URL with `***`, for logs and errors.
pub fn redact_url(url: &str) -> String {
    // One URL: shown only when it parses with an authority, its password masked.
    // Anything else could be a password split off at a comma, and is not shown.
    let one = |u: &str| match url::Url::parse(u) {
        Ok(parsed) if login_cut_short(u) => {
            format!("{}://<hidden: {CUT_SHORT}>", parsed.scheme())
        }
        Ok(mut parsed) if parsed.has_host() => {
            if parsed.password().is_some() {
                let _ = parsed.set_password(Some("***"));
            }
            // A query may carry a secret (`password=`, an API key): its values
            // are masked, its keys kept; a fragment is never shown.
            if parsed.query().is_some() {
                let keys: Vec<String> = parsed.query_pairs().map(|(k, _)| k.into_owned()).collect();
                let masked = keys
                    .iter()
                    .map(|k| format!("{k}=***"))
                    .collect::<Vec<_>>()
                    .join("&");
                parsed.set_query(Some(&masked));
            }
            parsed.set_fragment(None);
            parsed.to_string()
        }
        _ => "<unparseable url>".to_owned(),
    };
    // A list of nodes: each piece on its own. A piece that is not a URL (a
    // password cut at an unencoded comma, say) is not shown, and the whole text
    // is never parsed as one URL: its path would carry the other pieces, their
    // passwords in clear.
    if url.contains(',') {
        return url
            .split(',')
            .map(|piece| match piece.trim() {
                "" => String::new(),
                piece => one(piece),
            })
            .collect::<Vec<_>>()
            .join(",");
    }
    one(url)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_contract() {
        assert_eq!(attempts_queue("primary"), "onejob.attempts.primary");
        assert_eq!(attempts_routing_key("primary"), "attempts.primary");
        assert_eq!(dead_letter_queue(INTENTS_QUEUE), "onejob.intents.dlq");
    }

    #[test]
    fn redaction_hides_passwords() {
        let r = redact_url("amqp://guest:hunter2@127.0.0.1:5672/%2f");
        assert!(!r.contains("hunter2"), "{r}");
        assert!(r.contains("***"));
        assert!(!redact_url("postgres://u:pw@h/db").contains("pw@"));
        assert_eq!(redact_url("::"), "<unparseable url>");
        // A comma inside a password is not a list; a piece that is not a URL
        // with an authority is never shown.
        let r = redact_url("postgres://u:pa,ss:word@h/db");
        assert!(!r.contains("pa,") && !r.contains("word"), "{r}");
        assert_eq!(redact_url("amqp:u:secret@h/%2f"), "<unparseable url>");
    }

    #[test]
    fn a_password_with_characters_that_end_the_authority_is_never_shown() {
        // Pasted unencoded: the URL parser ends the authority at '#', '/' or
        // '?', so the rest of the password lands in the fragment, the path or
        // the query.
        for url in [
            "amqp://svc:2024#Winter@host/",
            "amqp://svc:2024/Winter@host/%2f",
            "amqp://svc:2024?Winter@host/",
            "postgres://svc:pa#Winter@db:5432/onejob",
            "postgres://svc:12/Winter@db/onejob",
            "postgres://u@h/db?password=Winter&sslmode=disable",
            "http://127.0.0.1:8081/v1?api-key=Winter",
        ] {
            let shown = redact_url(url);
            assert!(!shown.contains("Winter"), "{url} -> {shown}");
        }
        assert_eq!(
            redact_url("postgres://u@h/db?password=Winter&sslmode=disable"),
            "postgres://u@h/db?password=***&sslmode=***"
        );
    }

    #[test]
    fn every_node_of_a_list_is_masked() {
        let list = "amqp://guest:pw1@127.0.0.1:5673/%2f, amqp://guest:pw2@127.0.0.1:5674/%2f,amqp://guest:pw3@h3:5675/%2f";
        let r = redact_url(list);
        for secret in ["pw1", "pw2", "pw3"] {
            assert!(!r.contains(secret), "{r}");
        }
        assert_eq!(r.matches("***").count(), 3, "{r}");
        assert!(r.contains("127.0.0.1:5674") && r.contains("h3:5675"), "{r}");
    }

    #[test]
    fn a_list_names_nodes_that_share_a_login_and_a_vhost() {
        let nodes = Nodes::parse(
            "amqp://guest:guest@127.0.0.1:5673/%2f,amqp://guest:guest@127.0.0.1:5674/%2f, amqp://guest:guest@127.0.0.1:5675/%2f",
        )
        .unwrap();
        assert_eq!(nodes.len(), 3);
        assert_eq!(nodes.uris[1].authority.port, 5674);
        assert_eq!(nodes.uris[2].vhost, "/");
        assert_eq!(Nodes::parse("amqp://127.0.0.1:5672/%2f").unwrap().len(), 1);

        let error = |list: &str| match Nodes::parse(list) {
            Err(BrokerError::BadUrl(e)) => e,
            other => panic!("{list}: {other:?}"),
        };
        let e = error("amqp://u:secret@h1/%2f,,amqp://u:secret@h2/%2f");
        assert!(e.contains("node 2 of 3") && e.contains("empty"), "{e}");
        assert!(!e.contains("secret"), "{e}");
        let e = error("amqp://u:secret@h1/%2f,http://u:secret@h2/%2f");
        assert!(
            e.contains("node 2 of 2") && e.contains("not an AMQP URL"),
            "{e}"
        );
        assert!(!e.contains("secret"), "{e}");
        // An unencoded comma in a password splits it: refused, nothing shown.
        let e = error("amqp://u:pa,ss@h1/%2f");
        assert!(e.contains("%2C") && !e.contains("ss@"), "{e}");
        let e = error("amqp:u:secret@h/%2f");
        assert!(!e.contains("secret"), "{e}");
        let e = error("amqp://u:secret@h1/%2f,amqp://u:other@h2/%2f");
        assert!(e.contains("another user, password or virtual host"), "{e}");
        assert!(!e.contains("secret") && !e.contains("other@"), "{e}");
        let e = error("amqp://u:p@h1/one,amqp://u:p@h2/two");
        assert!(e.contains("node 2 of 2"), "{e}");
        let e = error("");
        assert!(e.contains("empty") && !e.contains("node 1"), "{e}");
    }
}
