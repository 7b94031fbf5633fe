//! Shared harness for the black-box tests: each test gets a fresh Postgres database
//! and a fresh RabbitMQ vhost on the real services, removed again when it ends
//! (even when it panics), so tests run in parallel and leave nothing behind.
//! Only the AI provider is simulated, by the bundled mock over real HTTP.

#![allow(dead_code, unreachable_pub, missing_docs)]

pub mod browser;
pub mod chaos;
pub mod console;
pub mod database;
pub mod lossy;
pub mod raw_http;

use std::future::Future;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lapin::options::{BasicGetOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use onejob::config::Config;
use onejob::fleet::{self, Role};
use onejob::mock::{MockHandle, MockOptions};
use onejob::runtime::{self, Context};
use onejob::shutdown::Shutdown;
use onejob::store::Store;
use sqlx::{Connection, Executor, PgConnection};

/// The Postgres server, without a database name.
pub fn pg_base() -> String {
    std::env::var("ONEJOB_TEST_PG").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into())
}

/// The RabbitMQ server, without a vhost.
pub fn amqp_base() -> String {
    std::env::var("ONEJOB_TEST_AMQP").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672".into())
}

fn rabbitmqctl(args: &[&str]) {
    let out = Command::new("rabbitmqctl")
        .args(args)
        .output()
        .expect("rabbitmqctl must be on PATH to create test vhosts");
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// One test's private database and vhost.
pub struct TestEnv {
    pub name: String,
    pub database_url: String,
    pub amqp_url: String,
    pub store: Store,
}

impl TestEnv {
    /// Creates the database (migrated) and the vhost.
    pub async fn new(config: &Config) -> TestEnv {
        let name = format!("onejob_t_{}", uuid::Uuid::now_v7().simple());
        let mut admin = PgConnection::connect(&format!("{}/postgres", pg_base()))
            .await
            .expect("Postgres must be reachable for tests");
        admin
            .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .await
            .expect("create test database");
        admin.close().await.ok();
        rabbitmqctl(&["add_vhost", &name]);
        rabbitmqctl(&["set_permissions", "-p", &name, "guest", ".*", ".*", ".*"]);
        let database_url = format!("{}/{name}", pg_base());
        let amqp_url = format!("{}/{name}", amqp_base());
        let store = Store::connect(
            &database_url,
            16,
            runtime::routes(config),
            Duration::from_secs(10),
        )
        .await
        .expect("connect test database");
        store.migrate().await.expect("migrate test database");
        TestEnv {
            name,
            database_url,
            amqp_url,
            store,
        }
    }

    /// Connects a worker context (migrations, topology, publisher) to this env.
    pub async fn context(&self, config: Arc<Config>) -> Context {
        Context::connect(config, &self.database_url, &self.amqp_url)
            .await
            .expect("worker context")
    }

    /// Starts the roles in-process.
    pub async fn fleet(&self, config: Arc<Config>, roles: Vec<Role>) -> Fleet {
        let ctx = self.context(config).await;
        let shutdown = Shutdown::new();
        let task = tokio::spawn(fleet::run(ctx.clone(), roles, shutdown.clone()));
        Fleet {
            ctx,
            shutdown,
            task,
        }
    }

    /// Runs the operator CLI binary against this env.
    pub fn cli(&self, config_path: &std::path::Path, args: &[&str]) -> std::process::Output {
        Command::new(env!("CARGO_BIN_EXE_onejob"))
            .args(args)
            .env("DATABASE_URL", &self.database_url)
            .env("AMQP_URL", &self.amqp_url)
            .env("ONEJOB_CONFIG", config_path)
            .env("RUST_LOG", "warn")
            .output()
            .expect("run the onejob CLI")
    }

    /// Runs the CLI and asserts it succeeded.
    pub fn cli_ok(&self, config_path: &std::path::Path, args: &[&str]) -> std::process::Output {
        let out = self.cli(config_path, args);
        assert!(
            out.status.success(),
            "onejob {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    /// Admits a `summarize` intent as intake would, without publishing its first
    /// attempt: returns the job and the attempt's outbox message.
    pub async fn admit(
        &self,
        ctx: &Context,
        owner: &str,
        key: &str,
        text: &str,
    ) -> (onejob::domain::JobId, onejob::store::OutboxMessage) {
        let body = serde_json::to_vec(&intent(owner, key, text)).expect("intent json");
        let new = onejob::intake::validate(ctx, &body).expect("valid intent");
        let job_id = new.job_id;
        match self.store.admit(&[new]).await.expect("admit").remove(0) {
            onejob::store::Admission::Created { publish, .. } => (job_id, publish),
            other => panic!("expected created, got {other:?}"),
        }
    }

    /// A fresh AMQP connection to this env's vhost.
    pub async fn amqp(&self) -> lapin::Connection {
        // Through onejob's own connect, so that a list of nodes works too.
        onejob::broker::connect(&self.amqp_url, onejob::broker::Recovery::None)
            .await
            .expect("amqp connect")
    }

    /// Binds a new exclusive queue to the events exchange, to watch events.
    pub async fn watch_events(&self, conn: &lapin::Connection) -> (lapin::Channel, String) {
        let ch = conn.create_channel().await.expect("channel");
        let q = ch
            .queue_declare(
                "".into(),
                QueueDeclareOptions {
                    exclusive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("declare event watcher");
        let name = q.name().to_string();
        ch.queue_bind(
            name.as_str().into(),
            onejob::broker::EVENTS.into(),
            "job.#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind event watcher");
        (ch, name)
    }

    /// Every message now in `queue`, taken off it.
    pub async fn drain(&self, ch: &lapin::Channel, queue: &str) -> Vec<lapin::message::Delivery> {
        let mut out = Vec::new();
        while let Some(m) = ch
            .basic_get(queue.into(), BasicGetOptions { no_ack: true })
            .await
            .expect("basic_get")
        {
            out.push(m.delivery);
        }
        out
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        let _ = Command::new("psql")
            .args([
                &format!("{}/postgres", pg_base()),
                "-q",
                "-c",
                &format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name),
            ])
            .output();
        let _ = Command::new("rabbitmqctl")
            .args(["delete_vhost", &self.name])
            .output();
    }
}

/// Roles running in-process.
pub struct Fleet {
    pub ctx: Context,
    pub shutdown: Shutdown,
    task: tokio::task::JoinHandle<runtime::Result<()>>,
}

impl Fleet {
    /// Stops the roles and waits for them; panics if one had failed.
    pub async fn stop(self) {
        self.shutdown.trigger();
        let task = self.task;
        let result = tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect("fleet stops within 30s")
            .expect("fleet task");
        result.expect("fleet ran without errors");
        let _ = self.ctx.connection.close(200, "test over".into()).await;
    }
}

/// A mock provider on a free port. Tests steer it: its `mock:` directives are
/// on.
pub async fn mock(options: MockOptions) -> MockHandle {
    let options = MockOptions {
        directives: true,
        ..options
    };
    onejob::mock::start("127.0.0.1:0".parse().expect("addr"), options)
        .await
        .expect("start mock provider")
}

/// One provider of a test configuration: its name, base URL, and extra TOML lines.
pub struct P<'a>(pub &'a str, pub &'a str, pub &'a str);

/// A configuration for tests: short timeouts and backoff so conditions settle
/// fast, the providers in route order, one `summarize` operation with one golden
/// case, and `op_extra` lines added to the operation.
pub fn config_for(providers: &[P<'_>], op_extra: &str) -> String {
    let mut text = String::from(
        r#"
[worker]
retry_backoff = "200ms"
retry_backoff_max = "1s"
relay_interval = "100ms"
outbox_lease = "2s"
vanished_grace = "1s"
shutdown_grace = "5s"
"#,
    );
    for P(name, url, extra) in providers {
        let timeout = if extra.contains("timeout") {
            ""
        } else {
            "timeout = \"1s\"\n"
        };
        text.push_str(&format!(
            "\n[providers.{name}]\nkind = \"openai\"\nbase_url = \"{url}\"\nmodel = \"mock-model\"\n{timeout}concurrency = 8\n{extra}\n"
        ));
    }
    let route: Vec<String> = providers.iter().map(|p| format!("{:?}", p.0)).collect();
    text.push_str(&format!(
        r#"
[operations.summarize]
system = "Answer with one JSON object only."
prompt = "Summarize: {{{{ text }}}}"
output_schema = {{ type = "object", required = ["summary"], additionalProperties = false, properties = {{ summary = {{ type = "string" }} }} }}
route = [{}]
max_attempts = 3
temperature = 0.0
{op_extra}

[[operations.summarize.cases]]
input = {{ text = "The quick brown fox jumps over the lazy dog." }}
"#,
        route.join(", ")
    ));
    text
}

/// The usual test configuration: a primary and, if given, a fallback.
pub fn config_text(primary: &str, fallback: Option<&str>, extra: &str) -> String {
    match fallback {
        Some(url) => config_for(&[P("primary", primary, ""), P("fallback", url, "")], extra),
        None => config_for(&[P("primary", primary, "")], extra),
    }
}

/// Parses a test configuration, and writes it to a file for the CLI.
pub fn config(text: &str) -> (Arc<Config>, tempfile_path::TempConfig) {
    let config = Config::parse(text, "test").expect("test config parses");
    (Arc::new(config), tempfile_path::TempConfig::new(text))
}

pub mod tempfile_path {
    /// A config file removed on drop.
    pub struct TempConfig {
        pub path: std::path::PathBuf,
    }

    impl TempConfig {
        pub fn new(text: &str) -> Self {
            let path = std::env::temp_dir().join(format!(
                "onejob-test-{}.toml",
                uuid::Uuid::now_v7().simple()
            ));
            std::fs::write(&path, text).expect("write test config");
            TempConfig { path }
        }
    }

    impl Drop for TempConfig {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

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

/// Polls `check` until it returns `Some`, or panics naming `what` after `limit`.
pub async fn wait_for<T, F, Fut>(what: &str, limit: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Inserts an outbox row published a century ago: the reconciler's next outbox
/// pruning deletes it whatever the retention. Its id.
async fn sweep_marker(store: &Store) -> i64 {
    sqlx::query_scalar(
        "INSERT INTO outbox (exchange, routing_key, message_id, body, not_before, published_at)
         VALUES ('onejob.events', 'test.sweep-marker', 'sweep-marker', '{}',
                 now() - interval '100 years', now() - interval '100 years')
         RETURNING id",
    )
    .fetch_one(store.pool())
    .await
    .expect("insert a sweep marker")
}

async fn marker_pruned(store: &Store, id: i64) -> bool {
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE id = $1")
        .bind(id)
        .fetch_one(store.pool())
        .await
        .expect("look for the sweep marker");
    left == 0
}

/// Runs `check` over and over (every 50 ms, and once more at the end) until at
/// least `at_least` has passed and the reconciler has made `passes` whole
/// sweeps that began after this call: a window shown to have covered the
/// sweeps' chances to act (vanished workers, lost messages, hedging, the
/// relay). A sweep is seen through a later step of the same pass: the outbox
/// pruning that follows it deletes a marker row published a century ago. Marker
/// `k + 1` is inserted once marker `k` is gone, so the pass that prunes it began
/// its sweep after marker `k` was gone; the first marker's pass may have begun
/// before the call, and is not counted. Panics naming `what` if the sweeps do
/// not come (no reconciler runs).
pub async fn through_sweeps<F, Fut>(
    store: &Store,
    passes: usize,
    at_least: Duration,
    what: &str,
    mut check: F,
) where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    let start = Instant::now();
    let limit = at_least + Duration::from_secs(30) + Duration::from_secs(5) * passes as u32;
    let mut marker = sweep_marker(store).await;
    let mut pruned = 0;
    loop {
        check().await;
        if pruned <= passes && marker_pruned(store, marker).await {
            pruned += 1;
            if pruned <= passes {
                marker = sweep_marker(store).await;
            }
        }
        if pruned > passes && start.elapsed() >= at_least {
            check().await;
            return;
        }
        assert!(
            start.elapsed() < limit,
            "{what}: timed out after {limit:?} with {} of {passes} reconciler sweeps seen",
            pruned.saturating_sub(1)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the reconciler has made `passes` whole sweeps that began after
/// this call (see [`through_sweeps`]).
pub async fn sweeps_ran(store: &Store, passes: usize, what: &str) {
    through_sweeps(store, passes, Duration::ZERO, what, || async {}).await;
}

/// Every message `queue` (bound to the events exchange) holds once there is
/// nothing left to publish: every outbox row is published (each publish was
/// confirmed, so its copy is in the queue) and the reconciler has made two
/// more whole passes, each relaying the outbox before its sweep. A second copy
/// of an event, published again by the relay or by a redelivered settlement,
/// would be in the queue by then.
pub async fn events_once_settled(
    env: &TestEnv,
    ch: &lapin::Channel,
    queue: &str,
) -> Vec<lapin::message::Delivery> {
    let mut got = env.drain(ch, queue).await;
    wait_for(
        "every outbox row to be published",
        Duration::from_secs(20),
        || async {
            let unpublished: i64 =
                sqlx::query_scalar("SELECT count(*) FROM outbox WHERE published_at IS NULL")
                    .fetch_one(env.store.pool())
                    .await
                    .expect("count unpublished outbox rows");
            (unpublished == 0).then_some(())
        },
    )
    .await;
    sweeps_ran(&env.store, 2, "the relay after the outbox was published").await;
    got.extend(env.drain(ch, queue).await);
    got
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

/// Waits until the job reaches `status`, and returns it.
pub async fn wait_for_status(
    env: &TestEnv,
    job_id: onejob::domain::JobId,
    status: onejob::domain::JobStatus,
) -> onejob::store::JobView {
    wait_for(
        &format!("job {job_id} to be {status}"),
        Duration::from_secs(20),
        || async {
            env.store
                .job(job_id)
                .await
                .expect("read job")
                .filter(|j| j.status == status)
        },
    )
    .await
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

/// Submits a `summarize` intent and returns the job its receipt names.
pub async fn submit(
    producer: &onejob_producer::Producer,
    owner: &str,
    key: &str,
    text: &str,
) -> onejob::domain::JobId {
    let receipt = producer
        .submit(&intent(owner, key, text))
        .await
        .expect("submit");
    receipt
        .job_id
        .unwrap_or_else(|| panic!("no job in receipt {receipt:?}"))
}

/// A validated `summarize` intent for the primary provider, ready to admit.
pub fn new_job(owner: &str, key: &str, text: &str) -> onejob::store::NewJob {
    let intent = intent(owner, key, text);
    onejob::store::NewJob {
        job_id: onejob::domain::JobId::new(),
        attempt_id: onejob::domain::AttemptId::new(),
        fingerprint: intent.fingerprint(),
        intent,
        provider: "primary".into(),
    }
}

/// An intent for the `summarize` operation.
pub fn intent(owner: &str, key: &str, text: &str) -> onejob::intent::Intent {
    onejob::intent::Intent {
        owner_id: owner.into(),
        idempotency_key: key.into(),
        operation: "summarize".into(),
        input: serde_json::json!({ "text": text })
            .as_object()
            .cloned()
            .unwrap_or_default(),
        provider: None,
    }
}

/// A TCP path to a real service (Postgres, RabbitMQ) that a test can cut and
/// restore: cut, it drops every open connection and refuses new ones, as an
/// outage or a network partition would; stalled, it keeps the connections open
/// but carries no byte, as a hung peer would. The service itself is untouched,
/// so other tests running beside this one see no outage.
pub struct Cuttable {
    pub addr: std::net::SocketAddr,
    cut: Arc<std::sync::atomic::AtomicBool>,
    stalled: Arc<std::sync::atomic::AtomicBool>,
    refused: Arc<std::sync::atomic::AtomicUsize>,
    links: Arc<std::sync::Mutex<Vec<tokio::task::AbortHandle>>>,
    accept: tokio::task::JoinHandle<()>,
}

/// Copies `from` to `to` until either closes, holding each chunk while `stalled`.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    stalled: Arc<std::sync::atomic::AtomicBool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        while stalled.load(std::sync::atomic::Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

impl Cuttable {
    /// Starts forwarding a free local port to `target` (`host:port`).
    pub async fn to(target: &str) -> Cuttable {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let cut = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stalled = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let refused = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let links: Arc<std::sync::Mutex<Vec<tokio::task::AbortHandle>>> = Arc::default();
        let target = target.to_owned();
        let accept = {
            let (cut, stalled, links) = (cut.clone(), stalled.clone(), links.clone());
            let refused = refused.clone();
            tokio::spawn(async move {
                while let Ok((inbound, _)) = listener.accept().await {
                    if cut.load(std::sync::atomic::Ordering::SeqCst) {
                        drop(inbound);
                        refused.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        continue;
                    }
                    let Ok(outbound) = tokio::net::TcpStream::connect(&target).await else {
                        continue;
                    };
                    let (in_read, in_write) = inbound.into_split();
                    let (out_read, out_write) = outbound.into_split();
                    let mut held = links.lock().unwrap();
                    held.push(
                        tokio::spawn(pump(in_read, out_write, stalled.clone())).abort_handle(),
                    );
                    held.push(
                        tokio::spawn(pump(out_read, in_write, stalled.clone())).abort_handle(),
                    );
                }
            })
        };
        Cuttable {
            addr,
            cut,
            stalled,
            refused,
            links,
            accept,
        }
    }

    /// How many connections it has refused while cut so far: each one a
    /// client's try to reach the service.
    pub fn refused(&self) -> usize {
        self.refused.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Drops every connection through it and refuses new ones.
    pub fn cut(&self) {
        self.cut.store(true, std::sync::atomic::Ordering::SeqCst);
        for link in self.links.lock().unwrap().drain(..) {
            link.abort();
        }
    }

    /// Keeps the connections open but carries nothing, until restored.
    pub fn stall(&self) {
        self.stalled
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Lets connections through again.
    pub fn restore(&self) {
        self.stalled
            .store(false, std::sync::atomic::Ordering::SeqCst);
        self.cut.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for Cuttable {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}

/// A database (and vhost) for store-level tests; no provider is ever called.
pub async fn store_env() -> TestEnv {
    let (config, _file) = config(&config_text(
        "http://127.0.0.1:9/v1",
        Some("http://127.0.0.1:9/v1"),
        "",
    ));
    TestEnv::new(&config).await
}

/// Settles `batch` as the attempt path does: a settlement that comes back
/// `Busy` (its rows were held by another transaction, and nothing of it was
/// written) is settled again, alone, until it is not. What each came to, in
/// input order.
pub async fn settle_with(
    store: &Store,
    batch: &[onejob::store::Finished],
    plan: &(dyn Fn(&onejob::store::FailedJob) -> onejob::store::NextStep + Sync),
) -> Vec<onejob::store::Settled> {
    use onejob::store::Settled;
    let mut settled = store.finalize(batch, plan).await.unwrap().0;
    loop {
        let busy: Vec<usize> = (0..settled.len())
            .filter(|&i| settled[i] == Settled::Busy)
            .collect();
        if busy.is_empty() {
            return settled;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
        let again: Vec<_> = busy.iter().map(|&i| batch[i].clone()).collect();
        let outcomes = store.finalize(&again, plan).await.unwrap().0;
        for (i, outcome) in busy.into_iter().zip(outcomes) {
            settled[i] = outcome;
        }
    }
}

/// A plan that never retries: the job fails with the attempt's error.
pub fn give_up(f: &onejob::store::FailedJob) -> onejob::store::NextStep {
    onejob::store::NextStep::GiveUp {
        error: f.error.clone(),
    }
}

/// Inserts `n` jobs straight into the tables (as a bulk load would, past
/// intake), keyed `prefix{i}` in one statement, each with the rows
/// settling it would have left: `status` (or the mix), ended `age` to `age +
/// spread` seconds ago, one attempt each (three for a failed job), a succeeded
/// job's winner and result. Jobs and attempts made.
pub async fn fill_jobs(
    db: &mut PgConnection,
    prefix: &str,
    n: i64,
    status: &str,
    age: f64,
    spread: f64,
    operation: &str,
) -> (i64, i64) {
    sqlx::query_as(
        r#"WITH made AS (
               INSERT INTO jobs (id, owner_id, idempotency_key, request_fingerprint, operation, input,
                                 status, version, completed_by, result, error, created_at, updated_at)
               SELECT md5($1::text || i)::uuid, 'tenant-' || (i % 1000), $1::text || i, md5('fp' || $1::text || i), $6::text,
                      jsonb_build_object('text', 'Summarize: ' || repeat(md5(i::text), 6)),
                      s.status, 3,
                      CASE WHEN s.status = 'succeeded' THEN md5(md5($1::text || i)::uuid::text || '-1')::uuid END,
                      CASE WHEN s.status = 'succeeded'
                           THEN jsonb_build_object('summary', repeat(md5((-i)::text), 4)) END,
                      CASE WHEN s.status = 'failed' THEN 'the provider failed three times' END,
                      t.at - interval '4 seconds', t.at
               FROM generate_series(1, $2::bigint) i
               CROSS JOIN LATERAL (SELECT CASE WHEN $3::text <> 'mix' THEN $3::text
                                               WHEN i % 20 = 0 THEN 'cancelled'
                                               WHEN i % 20 < 4 THEN 'failed'
                                               ELSE 'succeeded' END AS status) s
               CROSS JOIN LATERAL (SELECT now() - make_interval(secs => $4 + i * $5 / $2) AS at) t
               RETURNING id, status, updated_at
           ),
           tries AS (
               INSERT INTO attempts (id, job_id, number, provider, status, error, created_at, not_before,
                                     started_at, deadline_at, finished_at, provider_request_id, usage)
               SELECT md5(m.id::text || '-' || k)::uuid, m.id, k, 'primary',
                      CASE m.status WHEN 'failed' THEN 'failed' WHEN 'cancelled' THEN 'cancelled'
                                    WHEN 'unknown' THEN 'unknown' ELSE 'succeeded' END,
                      CASE WHEN m.status = 'failed' THEN 'HTTP 500' END,
                      m.updated_at - interval '4 seconds', m.updated_at - interval '4 seconds',
                      m.updated_at - interval '3 seconds', m.updated_at + interval '57 seconds',
                      CASE WHEN m.status <> 'unknown' THEN m.updated_at END,
                      'req_' || md5(m.id::text || k),
                      jsonb_build_object('prompt_tokens', 412, 'completion_tokens', 96)
               FROM made m
               CROSS JOIN generate_series(1, CASE WHEN m.status = 'failed' THEN 3 ELSE 1 END) k
               RETURNING 1
           )
           SELECT (SELECT count(*) FROM made), (SELECT count(*) FROM tries)"#,
    )
    .bind(prefix)
    .bind(n)
    .bind(status)
    .bind(age)
    .bind(spread)
    .bind(operation)
    .fetch_one(db)
    .await
    .expect("fill")
}
