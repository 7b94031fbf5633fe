//! Dead-letter queues: browse, replay, purge.
//!
//! Every work queue `Q` dead-letters into `Q.dlq`, where messages stay until an
//! operator acts. Browsing takes messages without acking them and then closes its
//! channel, so the broker puts every one back: the same listing twice gives the
//! same result and the depth is unchanged. Replaying publishes a copy to the
//! work queue its dead-letter queue belongs to (`Q.dlq` → `Q`, through the
//! `onejob` exchange), never to a destination the letter's own headers name,
//! and waits for the confirm before it acks the dead letter: a crash in
//! between leaves a duplicate (which the guarded transitions drop), never a
//! loss.

use chrono::{DateTime, Utc};
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicGetOptions, QueuePurgeOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection};
use serde::Serialize;

use crate::broker::{self, BrokerError, Publisher, short};
use crate::settings::config::Config;

/// How many dead letters one browse takes at most by default.
pub const DEFAULT_LIMIT: usize = 100;

/// How much of a letter's body a listing shows, in characters.
pub const PREVIEW_CHARS: usize = 120;

/// How much of any one header a listing shows, in characters: a publisher
/// chooses their length.
pub const HEADER_CHARS: usize = 240;

/// How many `x-death` records a listing shows (the broker keeps one per queue
/// and reason; a publisher can forge any number).
pub const DEATHS_SHOWN: usize = 8;

/// The first `n` characters of `text`, with `…` when there was more.
fn clip(text: &str, n: usize) -> String {
    let mut chars = text.chars();
    let mut out: String = chars.by_ref().take(n).collect();
    if chars.next().is_some() {
        out.push('…');
    }
    out
}

/// One `x-death` entry: the broker's record of one dead-lettering.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Death {
    /// The queue the message died in.
    pub queue: String,
    /// Why: `rejected`, `expired`, `maxlen` or `delivery_limit`.
    pub reason: String,
    /// How often it died there for that reason.
    pub count: i64,
    /// The exchange it had been published to.
    pub exchange: String,
    /// Its routing keys.
    pub routing_keys: Vec<String>,
    /// When it first died there.
    pub time: Option<DateTime<Utc>>,
}

/// A dead letter as operators see it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DeadLetter {
    /// The dead-letter queue holding it.
    pub queue: String,
    /// Its position in the listing (0 = the head of the queue).
    pub position: usize,
    /// The publisher's `message_id`, if any: what `replay --id` selects on.
    pub message_id: Option<String>,
    /// Why it is here: onejob's `x-onejob-error`, else the broker's `x-death` reason.
    pub reason: String,
    /// The broker's `x-death` records, most recent first.
    pub deaths: Vec<Death>,
    /// Where it was first published: exchange…
    pub original_exchange: Option<String>,
    /// …and routing key.
    pub original_routing_key: Option<String>,
    /// Seconds since it was dead-lettered, when that is known.
    pub age_seconds: Option<i64>,
    /// The first [`PREVIEW_CHARS`] characters of its body.
    pub body_preview: String,
    /// Its body size.
    pub body_bytes: usize,
}

/// A dead-letter failure.
#[derive(Debug, thiserror::Error)]
pub enum DlqError {
    /// The broker.
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// The AMQP client.
    #[error("amqp: {0}")]
    Amqp(#[from] lapin::Error),
    /// The queue is not one of onejob's dead-letter queues.
    #[error("{0:?} is not a dead-letter queue of this configuration (see `onejob dlq list`)")]
    UnknownQueue(String),
}

/// Result alias for dead letters.
pub type Result<T, E = DlqError> = std::result::Result<T, E>;

/// Every dead-letter queue of the configuration: the intents', the handed-on
/// settlements' and each provider's attempts'.
pub fn queues(config: &Config) -> Vec<String> {
    let mut out = vec![
        broker::dead_letter_queue(broker::INTENTS_QUEUE),
        broker::dead_letter_queue(broker::SETTLEMENTS_QUEUE),
    ];
    out.extend(
        config
            .providers
            .keys()
            .map(|p| broker::dead_letter_queue(&broker::attempts_queue(p))),
    );
    out
}

/// The queues an operator named, or all of them. Accepts a work queue's name for
/// its dead-letter queue too.
pub fn select_queues(config: &Config, queue: Option<&str>) -> Result<Vec<String>> {
    let all = queues(config);
    match queue {
        None => Ok(all),
        Some(q) => {
            let dlq = if q.ends_with(".dlq") {
                q.to_owned()
            } else {
                broker::dead_letter_queue(q)
            };
            if all.contains(&dlq) {
                Ok(vec![dlq])
            } else {
                Err(DlqError::UnknownQueue(q.to_owned()))
            }
        }
    }
}

/// A header's text as a listing shows it: its first [`HEADER_CHARS`].
fn text(v: &AMQPValue) -> Option<String> {
    match v {
        AMQPValue::LongString(s) => {
            Some(clip(&String::from_utf8_lossy(s.as_bytes()), HEADER_CHARS))
        }
        AMQPValue::ShortString(s) => Some(clip(s.as_str(), HEADER_CHARS)),
        _ => None,
    }
}

/// The text of the header `name`, as a listing shows it.
fn header_text(headers: &FieldTable, name: &str) -> Option<String> {
    headers.inner().get(name).and_then(text)
}

fn deaths(headers: &FieldTable) -> Vec<Death> {
    let Some(AMQPValue::FieldArray(entries)) = headers.inner().get("x-death") else {
        return Vec::new();
    };
    entries
        .as_slice()
        .iter()
        .filter_map(|e| match e {
            AMQPValue::FieldTable(t) => Some(t),
            _ => None,
        })
        .take(DEATHS_SHOWN)
        .map(|t| {
            let get = |k: &str| t.inner().get(k).and_then(text).unwrap_or_default();
            let count = i64::try_from(broker::header_count(t, "count")).unwrap_or(i64::MAX);
            let routing_keys = match t.inner().get("routing-keys") {
                Some(AMQPValue::FieldArray(keys)) => keys
                    .as_slice()
                    .iter()
                    .take(DEATHS_SHOWN)
                    .filter_map(text)
                    .collect(),
                _ => Vec::new(),
            };
            let time = match t.inner().get("time") {
                Some(AMQPValue::Timestamp(ts)) => i64::try_from(*ts)
                    .ok()
                    .and_then(|s| DateTime::from_timestamp(s, 0)),
                _ => None,
            };
            Death {
                queue: get("queue"),
                reason: get("reason"),
                count,
                exchange: get("exchange"),
                routing_keys,
                time,
            }
        })
        .collect()
}

/// A dead letter as operators see it, from a message taken off `queue`.
pub fn describe(
    queue: &str,
    position: usize,
    properties: &BasicProperties,
    body: &[u8],
) -> DeadLetter {
    let headers = properties.headers().clone().unwrap_or_default();
    let deaths = deaths(&headers);
    let first = deaths.first();
    let onejob_error = header_text(&headers, broker::ERROR_HEADER);
    let reason = onejob_error
        .or_else(|| first.map(|d| d.reason.clone()))
        .unwrap_or_else(|| "unknown".into());
    let original_exchange = header_text(&headers, "x-onejob-original-exchange")
        .or_else(|| first.map(|d| d.exchange.clone()));
    let original_routing_key = header_text(&headers, "x-onejob-original-routing-key")
        .or_else(|| first.and_then(|d| d.routing_keys.first().cloned()));
    // The latest death: the broker's (x-death) or onejob's own, whichever came
    // last (a replayed letter may have died both ways).
    let onejob_death = match headers.inner().get(broker::DEAD_LETTERED_AT_HEADER) {
        Some(AMQPValue::Timestamp(t)) => i64::try_from(*t)
            .ok()
            .and_then(|s| DateTime::from_timestamp(s, 0)),
        _ => None,
    };
    let died_at = first.and_then(|d| d.time).max(onejob_death);
    // At most four bytes a character, and a byte more to tell there is more.
    let head = &body[..body.len().min(PREVIEW_CHARS * 4 + 1)];
    let preview = clip(&String::from_utf8_lossy(head), PREVIEW_CHARS);
    DeadLetter {
        queue: queue.to_owned(),
        position,
        message_id: properties.message_id().as_ref().map(|m| m.to_string()),
        reason,
        deaths,
        original_exchange,
        original_routing_key,
        age_seconds: died_at.map(|t| (Utc::now() - t).num_seconds()),
        body_preview: preview,
        body_bytes: body.len(),
    }
}

/// After a channel holding unacked messages closes, the broker returns them
/// asynchronously: wait (briefly) until the queue holds `expected` again, so the
/// next look at it sees every message.
async fn settle(conn: &Connection, queue: &str, expected: u32) -> Result<()> {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
    while broker::depth(conn, queue).await? < expected && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Lists up to `limit` dead letters of `queue` without consuming them. Only
/// what a listing shows of each is kept ([`PREVIEW_CHARS`] of its body,
/// [`HEADER_CHARS`] of each header): memory holds one letter's body at a time
/// however many there are.
///
/// Another reader (the reconciler's scan) may hold some letters for a moment,
/// and AMQP counts only the letters not held: a listing that saw fewer
/// letters than the queue was seen to hold is taken again, after a
/// pause of random length so as not to keep meeting a scan that runs on a
/// timer; the longest of [`BROWSE_LEAST`] listings at least and
/// [`BROWSE_TRIES`] at most is returned.
pub async fn browse(conn: &Connection, queue: &str, limit: usize) -> Result<Vec<DeadLetter>> {
    let depth = || async {
        let depth = broker::depth(conn, queue).await?;
        Ok::<_, DlqError>(usize::try_from(depth).unwrap_or(usize::MAX))
    };
    // The longest listing taken, and the most letters the queue was seen to
    // hold: a count taken while a scan holds some is short too, so a listing
    // is confirmed by [`BROWSE_LEAST`] listings and their counts at least,
    // each a chance to see what a scan held during the others.
    let mut longest: Vec<DeadLetter> = Vec::new();
    let mut most = 0;
    for tries in 1..=BROWSE_TRIES {
        let mut out = Vec::new();
        most = most.max(depth().await?);
        visit(conn, queue, limit, |letter, _| out.push(letter)).await?;
        most = most.max(depth().await?).max(out.len());
        if out.len() > longest.len() {
            longest = out;
        }
        if tries >= BROWSE_LEAST && longest.len() >= most.min(limit) {
            break;
        }
        let pause = rand::random_range(5..30);
        tokio::time::sleep(std::time::Duration::from_millis(pause)).await;
    }
    Ok(longest)
}

/// Listings a listing is confirmed by, at least.
const BROWSE_LEAST: usize = 3;

/// How often a listing is taken at most while scans hold letters of its queue.
const BROWSE_TRIES: usize = 50;

/// Hands `each` up to `limit` dead letters of `queue`, one at a time, with
/// its body, without consuming them: the body is dropped when `each` returns.
pub async fn visit(
    conn: &Connection,
    queue: &str,
    limit: usize,
    mut each: impl FnMut(DeadLetter, &Delivery),
) -> Result<()> {
    let before = broker::depth(conn, queue).await?;
    let ch = broker::open_channel(conn).await?;
    for position in 0..limit {
        let Some(got) = ch
            .basic_get(short(queue)?, BasicGetOptions { no_ack: false })
            .await?
        else {
            break;
        };
        let d = got.delivery;
        each(describe(queue, position, &d.properties, &d.data), &d);
    }
    // Closing the channel returns every unacked message to the queue.
    ch.close(200, "browsed".into()).await?;
    settle(conn, queue, before).await
}

/// Which dead letters a replay takes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Selection {
    /// Every dead letter.
    All,
    /// Those with this `message_id`.
    Id(String),
}

/// What became of one dead letter a replay looked at.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum ReplayOutcome {
    /// Republished (confirmed) and removed from the dead-letter queue.
    Replayed,
    /// Left where it was, for this reason.
    Skipped {
        /// Why it could not be replayed.
        reason: String,
    },
}

/// One dead letter a replay looked at: what it was (without its body) and what
/// became of it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReplayReport {
    /// The dead letter, its body left out.
    #[serde(flatten)]
    pub letter: DeadLetter,
    /// Replayed or skipped.
    #[serde(flatten)]
    pub outcome: ReplayOutcome,
}

/// Replays the dead letters of `queue` that match `selection` to the work queue
/// `queue` belongs to (`Q.dlq` → `Q`; a letter whose headers name another
/// destination is skipped and left in place), each with a confirm before its
/// dead letter is acked, and
/// hands `report` what became of each as it goes: nothing is kept in memory but
/// the letter in hand.
///
/// Only the letters present when it starts are looked at, so a letter that dies
/// again on replay (and comes back to the tail of the queue) is not replayed a
/// second time. A letter that cannot be replayed (no origin, a refused publish)
/// is skipped with its reason and left in the queue; the rest go on.
pub async fn replay(
    conn: &Connection,
    queue: &str,
    selection: &Selection,
    mut report: impl FnMut(ReplayReport),
) -> Result<()> {
    let before = broker::depth(conn, queue).await?;
    let mut publisher = Publisher::open(conn).await?;
    let ch = broker::open_channel(conn).await?;
    let mut replayed = 0u32;
    let result = async {
        for position in 0..usize::try_from(before).unwrap_or(usize::MAX) {
            let Some(got) = ch
                .basic_get(short(queue)?, BasicGetOptions { no_ack: false })
                .await?
            else {
                break;
            };
            let d = got.delivery;
            let letter = describe(queue, position, &d.properties, &d.data);
            let wanted = match selection {
                Selection::All => true,
                Selection::Id(id) => letter.message_id.as_deref() == Some(id.as_str()),
            };
            if !wanted {
                continue;
            }
            let outcome = match home_route(queue, &letter) {
                Ok((exchange, key)) => {
                    if !publisher.channel().status().connected() {
                        publisher = Publisher::open(conn).await?;
                    }
                    let props = d.properties.clone().with_headers(clean_headers(&d.properties)).with_delivery_mode(2);
                    match publisher.publish(exchange, &key, &d.data, props, true).await {
                        Ok(()) => {
                            if !d.acker.ack(BasicAckOptions::default()).await? {
                                tracing::warn!(
                                    "dead letter republished but its ack was not sent: it stays, as a duplicate"
                                );
                            }
                            replayed += 1;
                            ReplayOutcome::Replayed
                        }
                        Err(e) => ReplayOutcome::Skipped {
                            reason: format!("republishing failed: {e}"),
                        },
                    }
                }
                Err(reason) => ReplayOutcome::Skipped { reason },
            };
            let done = matches!(selection, Selection::Id(_));
            report(ReplayReport { letter, outcome });
            if done {
                break;
            }
        }
        Ok(())
    }
    .await;
    // Everything taken but not replayed goes back to the queue.
    let _ = ch.close(200, "replayed".into()).await;
    let _ = publisher.channel().close(200, "replayed".into()).await;
    settle(conn, queue, before.saturating_sub(replayed)).await?;
    result
}

/// Where a letter of dead-letter queue `queue` is replayed: only to the work
/// queue that `queue` belongs to (`Q.dlq` → `Q`), through the `onejob`
/// exchange with `Q`'s own routing key, whatever the letter's headers say. A
/// letter whose headers name another destination is refused with the reason
/// (anyone who can publish to a work queue could plant one naming
/// `onejob.events`); one that names none goes home all the same.
fn home_route(
    queue: &str,
    letter: &DeadLetter,
) -> std::result::Result<(&'static str, String), String> {
    let Some(key) = queue
        .strip_suffix(".dlq")
        .and_then(|work| work.strip_prefix("onejob."))
        .filter(|key| !key.is_empty())
    else {
        return Err(format!(
            "{queue} is not a onejob dead-letter queue: no work queue to replay to"
        ));
    };
    let work = format!("onejob.{key}");
    let named = (
        letter.original_exchange.as_deref(),
        letter.original_routing_key.as_deref(),
    );
    let home = match named {
        (None, None) => true,
        (Some(exchange), Some(routing_key)) => {
            (exchange == broker::EXCHANGE && routing_key == key)
                || (exchange.is_empty() && routing_key == work)
        }
        _ => false,
    };
    if !home {
        return Err(format!(
            "its headers name {} / {}, not {work}: a replay goes only to the work queue its dead-letter queue belongs to",
            broker::escape_controls(named.0.unwrap_or("(none)")),
            broker::escape_controls(named.1.unwrap_or("(none)")),
        ));
    }
    Ok((broker::EXCHANGE, key.to_owned()))
}

/// A replayed copy goes out clean: without the death records and onejob's notes.
fn clean_headers(properties: &BasicProperties) -> FieldTable {
    let mut kept = FieldTable::default();
    if let Some(headers) = properties.headers() {
        for (k, v) in headers.inner() {
            let k_str = k.as_str();
            if !k_str.starts_with("x-death")
                && !k_str.starts_with("x-first-death")
                && !k_str.starts_with("x-last-death")
                && !k_str.starts_with("x-onejob-")
                && k_str != "x-delivery-count"
            {
                kept.insert(k.clone(), v.clone());
            }
        }
    }
    kept
}

/// Removes every message of a dead-letter queue; returns how many.
pub async fn purge(conn: &Connection, queue: &str) -> Result<u32> {
    let ch = broker::open_channel(conn).await?;
    let n = ch
        .queue_purge(short(queue)?, QueuePurgeOptions::default())
        .await?;
    let _ = ch.close(200, "purged".into()).await;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn props(headers: FieldTable) -> BasicProperties {
        broker::json_properties().with_headers(headers)
    }

    #[test]
    fn the_age_is_that_of_the_latest_death() {
        let ago = |s: i64| (Utc::now().timestamp() - s).unsigned_abs();
        let mut headers = FieldTable::default();
        headers.insert(
            broker::DEAD_LETTERED_AT_HEADER.into(),
            AMQPValue::Timestamp(ago(30)),
        );
        let age = describe("q.dlq", 0, &props(headers), b"{}").age_seconds;
        assert!(age.is_some_and(|a| (30..40).contains(&a)), "{age:?}");
        // A publisher's timestamp says when it was sent, not when it died.
        let sent = props(FieldTable::default()).with_timestamp(ago(100));
        assert_eq!(describe("q.dlq", 0, &sent, b"{}").age_seconds, None);
    }
}
