//! The reconciler's passes, one suite each, as River tests its maintenance
//! services: each pass run once against a real Postgres and RabbitMQ, what
//! it did and what it left, a second run that finds nothing, and its edges
//! (a row held, a backlog, a shutdown). `timers` runs the role whole: every
//! pass on its own timer, so that one held by a lock holds up no other.

use onejob_test_support as common;

mod dead_attempts;
mod dead_intents;
mod evidence;
mod hedge;
mod kept;
mod lost;
mod prune_jobs;
mod prune_outbox;
mod prune_spend;
mod relay;
mod statistics;
mod timers;
mod unserved;
mod vacuum;
mod vacuum_turns;
mod vanished;

use std::sync::Arc;

use common::tempfile_path::TempConfig;
use common::{TestEnv, config, config_text};
use onejob::edges::shutdown::Shutdown;
use onejob::roles::reconciler::pass::Pass;
use onejob::settings::config::Config;
use onejob::shared::runtime::Context;

/// One test's database and vhost, and a worker context on them, for a
/// configuration that calls no provider.
struct Bench {
    env: TestEnv,
    ctx: Context,
    config: Arc<Config>,
    file: TempConfig,
}

impl Bench {
    /// The usual test configuration, with `worker` settings added.
    async fn new(settings: &str) -> Bench {
        let text = config_text("http://127.0.0.1:9/v1", Some("http://127.0.0.1:9/v1"), "");
        Bench::with(&worker(&text, settings)).await
    }

    /// A configuration of the test's own.
    async fn with(text: &str) -> Bench {
        let (config, file) = config(text);
        let env = TestEnv::new(&config).await;
        let ctx = env.context(config.clone()).await;
        Bench {
            env,
            ctx,
            config,
            file,
        }
    }

    /// One run of `pass`, which must not fail.
    async fn run(&self, pass: &impl Pass) -> u64 {
        pass.once(&self.ctx, &Shutdown::new())
            .await
            .unwrap_or_else(|e| panic!("a run of {} failed: {e}", pass.name()))
    }

    /// Runs `pass` until a run acts on something; what that run did.
    async fn run_until_done(&self, pass: &impl Pass, what: &str) -> u64 {
        common::wait_for(what, std::time::Duration::from_secs(20), || async {
            let done = self.run(pass).await;
            (done > 0).then_some(done)
        })
        .await
    }

    /// Waits until the server reports `table`'s dead rows as `due` says.
    async fn dead_rows(&self, table: &str, what: &str, due: impl Fn(i64) -> bool) {
        let sql = format!("SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = '{table}'");
        common::wait_for(what, std::time::Duration::from_secs(30), || async {
            due(self.count(&sql).await).then_some(())
        })
        .await;
    }

    /// The one number `sql` selects.
    async fn count(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
            .fetch_one(self.env.store.pool())
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }
}

/// `text` with the `[worker]` settings of `settings` (lines `key = value`),
/// each in place of the one `text` has, or added.
fn worker(text: &str, settings: &str) -> String {
    let mut out = text.to_owned();
    for line in settings.lines().filter(|l| !l.trim().is_empty()) {
        let key = line.split('=').next().unwrap_or_default().trim();
        let had = out.lines().find(|l| l.starts_with(&format!("{key} =")));
        out = match had.map(str::to_owned) {
            Some(old) => out.replacen(&old, line, 1),
            None => out.replacen("[worker]\n", &format!("[worker]\n{line}\n"), 1),
        };
    }
    out
}

/// Puts `body` in the dead-letter queue `queue` with onejob's own reason
/// header, as a dead-lettering would have, confirmed.
async fn dead_letter(ctx: &Context, queue: &str, body: &[u8], reason: &str) {
    use lapin::types::{AMQPValue, FieldTable, ShortString};
    let ch = ctx.connection.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    let mut headers = FieldTable::default();
    headers.insert(
        ShortString::from(onejob::broker::ERROR_HEADER),
        AMQPValue::LongString(reason.into()),
    );
    let properties = onejob::broker::json_properties().with_headers(headers);
    ch.basic_publish(
        "".into(),
        queue.into(),
        lapin::options::BasicPublishOptions::default(),
        body,
        properties,
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let _ = ch.close(200, "done".into()).await;
}
