//! A queue as the broker sees it: how many messages it holds, ready and
//! unacked, and waiting for them.

use std::process::Command;
use std::time::Duration;

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;

use super::{TestEnv, wait_for};

/// How many messages `queue` holds now (a passive declare: nothing taken).
pub async fn depth(ch: &lapin::Channel, queue: &str) -> u32 {
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("passive declare")
    .message_count()
}

/// Waits until `queue` holds exactly `messages` (the broker counts on its own
/// time), or panics naming `what` after `limit`.
pub async fn wait_for_depth(
    what: &str,
    limit: Duration,
    ch: &lapin::Channel,
    queue: &str,
    messages: u32,
) {
    wait_for(what, limit, || async {
        (depth(ch, queue).await == messages).then_some(())
    })
    .await;
}

/// A queue's messages ready for delivery and delivered but not yet acked, as
/// `rabbitmqctl` sees them (a passive declare sees only the ready ones); `None`
/// when the queue is not listed.
pub fn queue_counts(vhost: &str, queue: &str) -> Option<(u64, u64)> {
    let out = Command::new("rabbitmqctl")
        .args([
            "list_queues",
            "-q",
            "-p",
            vhost,
            "name",
            "messages_ready",
            "messages_unacknowledged",
        ])
        .output()
        .expect("rabbitmqctl list_queues");
    String::from_utf8_lossy(&out.stdout).lines().find_map(|l| {
        let mut cols = l.split_whitespace();
        if cols.next() != Some(queue) {
            return None;
        }
        Some((cols.next()?.parse().ok()?, cols.next()?.parse().ok()?))
    })
}

/// Waits until `queue` holds at least one message, and takes them all.
pub async fn wait_for_messages(
    env: &TestEnv,
    ch: &lapin::Channel,
    queue: &str,
) -> Vec<lapin::message::Delivery> {
    wait_for(
        &format!("messages in {queue}"),
        Duration::from_secs(20),
        || async {
            let got = env.drain(ch, queue).await;
            (!got.is_empty()).then_some(got)
        },
    )
    .await
}
