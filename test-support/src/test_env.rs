//! One test's private database and vhost on the real services, removed again
//! when it ends, and the roles it runs in process.

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use lapin::options::{BasicGetOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use onejob::edges::shutdown::Shutdown;
use onejob::edges::store::Store;
use onejob::fleet::{self, Role};
use onejob::settings::config::Config;
use onejob::shared::runtime::{self, Context};
use sqlx::{Connection, Executor, PgConnection};

use super::throwaway::{Nodes, OwnPostgres, OwnRabbit};
use super::{config, config_text, intent};

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

/// Where a test's database and vhost are made: on the machine's services (most
/// tests), or on servers of the test's own (the tests that restart them).
#[derive(Clone, Debug)]
pub struct Servers {
    /// A Postgres server's URL, without a database name.
    pub postgres: String,
    /// RabbitMQ nodes of the test's own; `None` for the machine's RabbitMQ.
    pub rabbit: Option<Nodes>,
}

impl Servers {
    /// The services this machine runs.
    pub fn machine() -> Servers {
        Servers {
            postgres: pg_base(),
            rabbit: None,
        }
    }

    /// The machine's Postgres and RabbitMQ nodes of the test's own.
    pub fn with_rabbit(rabbit: &OwnRabbit) -> Servers {
        Servers {
            rabbit: Some(Nodes::clone(rabbit)),
            ..Servers::machine()
        }
    }

    /// A test's own Postgres and RabbitMQ.
    pub fn own(postgres: &OwnPostgres, rabbit: &OwnRabbit) -> Servers {
        Servers {
            postgres: postgres.base_url(),
            rabbit: Some(Nodes::clone(rabbit)),
        }
    }

    fn add_vhost(&self, name: &str) -> String {
        match &self.rabbit {
            None => {
                rabbitmqctl(&["add_vhost", name]);
                rabbitmqctl(&["set_permissions", "-p", name, "guest", ".*", ".*", ".*"]);
                format!("{}/{name}", amqp_base())
            }
            Some(nodes) => {
                nodes.script(&["add-vhost", name]);
                nodes.url(0, name)
            }
        }
    }

    fn delete_vhost(&self, name: &str) {
        let mut command = match &self.rabbit {
            None => Command::new("rabbitmqctl"),
            Some(nodes) => nodes.command_for(&["ctl", "1"]),
        };
        let _ = command.args(["delete_vhost", name]).output();
    }
}

/// One test's private database and vhost.
pub struct TestEnv {
    pub name: String,
    pub database_url: String,
    pub amqp_url: String,
    pub store: Store,
    pub servers: Servers,
}

impl TestEnv {
    /// Creates the database (migrated) and the vhost on the machine's services.
    pub async fn new(config: &Config) -> TestEnv {
        TestEnv::on(config, Servers::machine()).await
    }

    /// Creates the database (migrated) and the vhost on `servers`.
    pub async fn on(config: &Config, servers: Servers) -> TestEnv {
        let name = format!("onejob_t_{}", uuid::Uuid::now_v7().simple());
        let mut admin = PgConnection::connect(&format!("{}/postgres", servers.postgres))
            .await
            .expect("Postgres must be reachable for tests");
        admin
            .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .await
            .expect("create test database");
        admin.close().await.ok();
        let amqp_url = servers.add_vhost(&name);
        let database_url = format!("{}/{name}", servers.postgres);
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
            servers,
        }
    }

    /// Connects a worker context (migrations, topology, publisher) to this env.
    pub async fn context(&self, config: Arc<Config>) -> Context {
        Context::connect(config, &self.database_url, &self.amqp_url)
            .await
            .expect("worker context")
    }

    /// Hands out the turns held on `provider` that have room, and publishes
    /// their messages, as the provider's workers do (for tests that run no
    /// attempt consumer): returns how many went.
    pub async fn hand_out(&self, ctx: &Context, provider: &str) -> usize {
        let handed = self
            .store
            .turns()
            .hand_out_turns(provider, 1, "")
            .await
            .expect("hand out turns");
        ctx.publish_outbox(&handed.publish)
            .await
            .expect("publish what was handed out");
        handed.publish.len()
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
        Command::new(crate::binaries::binary("onejob"))
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
    ) -> (onejob::domain::JobId, onejob::edges::store::OutboxMessage) {
        let body = serde_json::to_vec(&intent(owner, key, text)).expect("intent json");
        let new = onejob::roles::intake::validate(ctx, &body).expect("valid intent");
        let job_id = new.job_id;
        match self
            .store
            .admission()
            .admit(&[new])
            .await
            .expect("admit")
            .remove(0)
        {
            onejob::edges::store::Admission::Created {
                publish: Some(publish),
                ..
            } => (job_id, publish),
            other => panic!(
                "expected created and handed out (not held: an owner past its share \
                 of the provider's queue has its turns held), got {other:?}"
            ),
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
                &format!("{}/postgres", self.servers.postgres),
                "-q",
                "-c",
                &format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name),
            ])
            .output();
        self.servers.delete_vhost(&self.name);
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

/// A database (and vhost) for store-level tests; no provider is ever called.
pub async fn store_env() -> TestEnv {
    let (config, _file) = config(&config_text(
        "http://127.0.0.1:9/v1",
        Some("http://127.0.0.1:9/v1"),
        "",
    ));
    TestEnv::new(&config).await
}
