//! The names of contract section 2 (exchanges, queues, routing keys) and the
//! arguments every work queue is declared with.

use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

use super::{
    BrokerError, DLX, INTENTS_KEY, INTENTS_QUEUE, Result, SETTLEMENTS_KEY, SETTLEMENTS_QUEUE,
};

/// AMQP 0-9-1 caps short strings (routing keys, reply-to) at 255 bytes.
const SHORT_STRING_MAX: usize = 255;

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

/// The arguments of every work queue. Dead-lettering is at-least-once: with
/// `x-dead-letter-strategy=at-least-once` (which needs `x-overflow=reject-publish`)
/// the broker keeps a message until its dead-letter queue has confirmed the copy,
/// where the default strategy may drop it on the way (contract section 2).
pub(super) fn work_queue_args(queue: &str, delivery_limit: u32) -> FieldTable {
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
pub(super) fn describe_work_args(delivery_limit: u32) -> String {
    format!(
        "quorum, x-dead-letter-exchange={DLX}, x-delivery-limit={delivery_limit}, \
         x-dead-letter-strategy=at-least-once, x-overflow=reject-publish"
    )
}

/// The work queues of a configuration and their routing keys.
pub(super) fn work_queues(providers: &[String]) -> Vec<(String, String)> {
    let mut work = vec![
        (INTENTS_QUEUE.to_owned(), INTENTS_KEY.to_owned()),
        (SETTLEMENTS_QUEUE.to_owned(), SETTLEMENTS_KEY.to_owned()),
    ];
    for p in providers {
        work.push((attempts_queue(p), attempts_routing_key(p)));
    }
    work
}

/// The arguments of a dead-letter queue.
pub(super) fn quorum_args() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from("quorum")),
    );
    args
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_contract() {
        assert_eq!(attempts_queue("primary"), "onejob.attempts.primary");
        assert_eq!(attempts_routing_key("primary"), "attempts.primary");
        assert_eq!(dead_letter_queue(INTENTS_QUEUE), "onejob.intents.dlq");
        assert_eq!(
            dead_letter_queue(SETTLEMENTS_QUEUE),
            "onejob.settlements.dlq"
        );
    }
}
