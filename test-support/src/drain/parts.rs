//! The parts of a job's latency, each measured alone: one broker hop, one
//! commit, one call to the mock provider; and the broker's own ceiling.

use std::time::Instant;

use futures_util::StreamExt;
use lapin::options::{BasicConsumeOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use sqlx::{Connection, Executor, PgConnection};

use super::Percentiles;
use crate::TestEnv;

/// One broker hop: a persistent publish to a quorum queue, from the publish until
/// both its confirm and its delivery to a consumer have arrived.
pub(super) async fn hop_latency(env: &TestEnv, samples: usize) -> Percentiles {
    let queue = "onejob.bench.hop";
    let (conn, publisher, ch) = quorum_queue(env, queue).await;
    let mut consumer = no_ack_consumer(&ch, queue).await;
    let mut times = Vec::with_capacity(samples);
    for i in 0..samples {
        let began = Instant::now();
        let body = format!("{i}");
        let (published, delivered) = tokio::join!(
            publisher.publish(
                "",
                queue,
                body.as_bytes(),
                onejob::broker::json_properties(),
                true
            ),
            consumer.next()
        );
        published.expect("hop publish confirmed");
        let delivery = delivered.expect("hop delivery").expect("hop delivery");
        assert_eq!(delivery.data, body.as_bytes());
        times.push(began.elapsed());
    }
    let _ = ch
        .queue_delete(queue.into(), QueueDeleteOptions::default())
        .await;
    let _ = conn.close(200, "hop measured".into()).await;
    Percentiles::of(times)
}

/// A consumer of `queue` whose deliveries need no ack.
pub(super) async fn no_ack_consumer(ch: &lapin::Channel, queue: &str) -> lapin::Consumer {
    ch.basic_consume(
        queue.into(),
        "".into(),
        BasicConsumeOptions {
            no_ack: true,
            ..BasicConsumeOptions::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap_or_else(|e| panic!("consume {queue}: {e}"))
}

/// One commit: a one-row INSERT, autocommitted, on the run's database.
pub(super) async fn commit_latency(env: &TestEnv, samples: usize) -> Percentiles {
    let mut conn = PgConnection::connect(&super::database::plaintext(&env.database_url))
        .await
        .expect("connect for the commit probe");
    conn.execute("CREATE TABLE bench_commit_probe (id bigserial PRIMARY KEY, at timestamptz NOT NULL DEFAULT now())")
        .await
        .expect("create the commit probe table");
    let mut times = Vec::with_capacity(samples);
    for _ in 0..samples {
        let began = Instant::now();
        sqlx::query("INSERT INTO bench_commit_probe DEFAULT VALUES")
            .execute(&mut conn)
            .await
            .expect("commit probe");
        times.push(began.elapsed());
    }
    conn.execute("DROP TABLE bench_commit_probe")
        .await
        .expect("drop the commit probe table");
    conn.close().await.ok();
    Percentiles::of(times)
}

/// One provider call: the chat completion the worker sends, to the mock.
pub(super) async fn call_latency(base_url: &str, samples: usize) -> Percentiles {
    let client = reqwest::Client::new();
    let body = serde_json::json!({
        "model": "mock-model",
        "temperature": 0.0,
        "messages": [
            {"role": "system", "content": "Answer with one JSON object only."},
            {"role": "user", "content": "Summarize: x"}
        ]
    });
    let mut times = Vec::with_capacity(samples);
    for _ in 0..samples {
        let began = Instant::now();
        let answer = client
            .post(format!("{base_url}/chat/completions"))
            .json(&body)
            .send()
            .await
            .expect("mock call");
        assert!(answer.status().is_success(), "mock answered {answer:?}");
        answer.bytes().await.expect("mock answer");
        times.push(began.elapsed());
    }
    Percentiles::of(times)
}

/// The broker's own ceiling on this machine, in messages per second: `count`
/// persistent messages published to a quorum queue with confirms (256 awaited
/// at a time) while a consumer with a prefetch of 256 takes and acks each,
/// from the first publish to the last delivery. The drain's messages take the
/// same path, three hops a job.
pub(super) async fn broker_ceiling(env: &TestEnv, count: usize) -> f64 {
    use lapin::options::{BasicAckOptions, BasicQosOptions};
    let queue = "onejob.bench.ceiling";
    let (conn, publisher, ch) = quorum_queue(env, queue).await;
    ch.basic_qos(256, BasicQosOptions::default())
        .await
        .expect("prefetch");
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("consume the ceiling queue");
    let began = Instant::now();
    let body = br#"{"attempt_id":"0193a0a0-0000-7000-8000-000000000000","job_id":"0193a0a0-0000-7000-8000-000000000001"}"#;
    let publishing = futures_util::stream::iter(0..count)
        .map(|_| publisher.publish("", queue, body, onejob::broker::json_properties(), true))
        .buffer_unordered(256)
        .for_each(|published| async move { published.expect("ceiling publish confirmed") });
    let consuming = async {
        for _ in 0..count {
            let delivery = consumer
                .next()
                .await
                .expect("ceiling delivery")
                .expect("ceiling delivery");
            delivery
                .ack(BasicAckOptions::default())
                .await
                .expect("ceiling ack");
        }
    };
    tokio::join!(publishing, consuming);
    let seconds = began.elapsed().as_secs_f64();
    let _ = ch
        .queue_delete(queue.into(), QueueDeleteOptions::default())
        .await;
    let _ = conn.close(200, "ceiling measured".into()).await;
    count as f64 / seconds
}

/// A connection, a confirming publisher and a channel, with `queue` declared
/// on it: a durable quorum queue, as onejob's work queues are.
async fn quorum_queue(
    env: &TestEnv,
    queue: &str,
) -> (lapin::Connection, onejob::broker::Publisher, lapin::Channel) {
    let conn = env.amqp().await;
    let publisher = onejob::broker::Publisher::open(&conn)
        .await
        .expect("publisher");
    let ch = conn.create_channel().await.expect("channel");
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        },
        args,
    )
    .await
    .unwrap_or_else(|e| panic!("declare {queue}: {e}"));
    (conn, publisher, ch)
}
