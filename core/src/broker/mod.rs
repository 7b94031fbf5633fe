//! RabbitMQ: the topology of contract section 2, connections, and publishing that
//! waits for the broker's confirm.
//!
//! Declarations are idempotent and every program makes them at start, on a channel
//! of their own: a 406 on a mismatched redeclaration closes that channel only.
//!
//! | file | holds |
//! |---|---|
//! | `topology` | the names of exchanges and queues, and the work queues' arguments |
//! | `declare` | declaring the topology, and looking at a queue |
//! | `upgrade` | `onejob queues upgrade`: work queues brought to this version's arguments |
//! | `nodes` | the node list an `AMQP_URL` names, and which node is tried first |
//! | `connect` | connecting to the first node that answers, and recovery |
//! | `channel` | opening a channel within a time |
//! | `publish` | publishing with confirms |
//! | `headers` | reading headers, and escaping text from outside |
//! | `redact` | URLs for logs and errors, their passwords masked |

use std::time::Duration;

mod channel;
mod connect;
mod declare;
mod headers;
mod nodes;
mod publish;
mod redact;
mod topology;
mod upgrade;

pub use channel::{OPEN_TIMEOUT, open_channel, open_channel_within};
pub use connect::{Recovery, connect};
pub use declare::{declare_topology, depth};
pub use headers::{escape_controls, header_count, header_str};
pub(crate) use nodes::Nodes;
pub use publish::{Publisher, json_properties};
pub use redact::{CUT_SHORT, login_cut_short, redact_url};
pub use topology::{attempts_queue, attempts_routing_key, dead_letter_queue, short};
pub use upgrade::{QueueUpgrade, upgrade_queues};

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
/// The queue of settlements handed on: answers a stopping worker could
/// neither settle nor keep (Postgres unreachable), for any worker to settle.
pub const SETTLEMENTS_QUEUE: &str = "onejob.settlements";
/// The routing key settlements are handed on with.
pub const SETTLEMENTS_KEY: &str = "settlements";
/// The header naming why a message was dead-lettered by onejob.
pub const ERROR_HEADER: &str = "x-onejob-error";
/// When onejob dead-lettered a message itself (the broker's own dead letters
/// carry the time in `x-death`).
pub const DEAD_LETTERED_AT_HEADER: &str = "x-onejob-dead-lettered-at";
/// How long a publish waits for the broker's confirm, by default.
pub const CONFIRM_TIMEOUT: Duration = Duration::from_secs(30);

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
    /// The broker did not open a channel in time ([`OPEN_TIMEOUT`]).
    #[error("RabbitMQ did not open a channel within {0:?}")]
    ChannelOpenTimeout(Duration),
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
