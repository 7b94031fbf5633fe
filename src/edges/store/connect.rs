//! The connection: the pool, its session settings, the database created if
//! missing, and the migrations.

use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgConnection, PgPool};

use crate::edges::store::drafts::Routes;
use crate::edges::store::error::{Result, StoreError};
use crate::edges::store::{MIGRATOR, Store};

/// What every onejob session sets at its start: no transaction idles for
/// more than a minute, and a silent peer is probed after 30 s (then every
/// 10 s, three times) so that the server ends a half-open session and frees
/// its locks.
const SESSION_SETTINGS: [(&str, &str); 4] = [
    ("idle_in_transaction_session_timeout", "60s"),
    ("tcp_keepalives_idle", "30"),
    ("tcp_keepalives_interval", "10"),
    ("tcp_keepalives_count", "3"),
];

/// What the sessions of the statements every job runs set besides: plan each
/// statement once per session. Under Postgres's default (`auto`) a statement
/// whose parameters are arrays, as every batched statement's are, is planned
/// again at every execution (a plan for one element looks cheaper than the
/// generic one, which assumes ten), and a lone job's statements are the
/// costliest to plan: at 100 jobs/s planning was two fifths of Postgres's CPU.
/// Their generic plans are the custom ones (lookups by primary key or by
/// identity), so nothing is lost. Other statements (sweeps, pruning, the
/// console's filters) compare times and ranges, where a custom plan can be
/// much better, and keep the default.
const PER_JOB_SETTINGS: [(&str, &str); 1] = [("plan_cache_mode", "force_generic_plan")];

impl Store {
    /// Connects two small pools of up to `max_connections` each: one for the
    /// statements every job runs (admission, claims, settlements, outbox
    /// marks), planned once per session ([`PER_JOB_SETTINGS`]), and one for
    /// everything else. While the database is unreachable it retries with
    /// backoff for up to `patience` (zero: one try), so a worker started before
    /// Postgres waits for it and a CLI fails at once with the reason.
    pub async fn connect(
        url: &str,
        max_connections: u32,
        routes: Routes,
        patience: Duration,
    ) -> Result<Store> {
        // A session that stops talking must not hold rows forever: the
        // server ends a transaction left idle (a client that froze or lost its
        // way mid-transaction) and probes a silent client's socket, so that a
        // half-open connection's locks are released within a minute or two.
        // A setting the URL's own `options` names is left as the URL says.
        if crate::broker::login_cut_short(url) {
            return Err(StoreError::CutShort);
        }
        let options: PgConnectOptions = url.parse()?;
        let named = options.get_options().unwrap_or_default().to_owned();
        let options = options.options(
            SESSION_SETTINGS
                .into_iter()
                .filter(|(name, _)| !named.contains(&format!("{name}="))),
        );
        let deadline = std::time::Instant::now() + patience;
        // One plain connection first: it fails fast, where a pool would keep
        // retrying until its acquire timeout.
        let probe = || async { <PgConnection as sqlx::Connection>::connect_with(&options).await };
        let conn = probe
            .retry(
                ExponentialBuilder::default()
                    .with_min_delay(Duration::from_millis(100))
                    .with_max_delay(Duration::from_secs(2))
                    .without_max_times(),
            )
            .when(|e| matches!(e, sqlx::Error::Io(_)) && std::time::Instant::now() < deadline)
            .notify(|e, d| tracing::warn!(error = %e, retry_in = ?d, "database not reachable yet"))
            .await?;
        let _ = sqlx::Connection::close(conn).await;
        // No ping before each acquire: that would be a round trip per statement.
        // A connection that broke meanwhile fails its statement, the pool drops
        // it, and the callers' retries take a fresh one.
        let pool_options = || {
            PgPoolOptions::new()
                .max_connections(max_connections)
                .test_before_acquire(false)
                .acquire_timeout(Duration::from_secs(10))
        };
        // Its connections open when a job's statement first asks for one, so a
        // CLI or a console that runs none opens none.
        let per_job = pool_options().connect_lazy_with(
            options.clone().options(
                PER_JOB_SETTINGS
                    .into_iter()
                    .filter(|(name, _)| !named.contains(&format!("{name}="))),
            ),
        );
        let pool = pool_options().connect_with(options).await?;
        Ok(Store {
            pool,
            per_job,
            routes,
        })
    }

    /// Closes every connection of the store.
    pub async fn close(&self) {
        self.per_job.close().await;
        self.pool.close().await;
    }

    /// Creates the database `url` names if it does not exist yet, so a fresh
    /// machine needs no manual `CREATE DATABASE`. Two pods racing here is harmless:
    /// the loser's "already exists" is ignored.
    pub async fn ensure_database(url: &str) -> Result<()> {
        use sqlx::migrate::MigrateDatabase;
        if crate::broker::login_cut_short(url) {
            return Err(StoreError::CutShort);
        }
        if !sqlx::Postgres::database_exists(url).await? {
            match sqlx::Postgres::create_database(url).await {
                Ok(()) => tracing::info!("created the database"),
                // Another program created it first: only the one that did says so.
                Err(_) if sqlx::Postgres::database_exists(url).await.unwrap_or(false) => {
                    tracing::debug!("the database was created meanwhile by another program");
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Whether Postgres answers.
    pub async fn ping(&self) -> bool {
        sqlx::query!("SELECT 1 AS one")
            .fetch_one(&self.pool)
            .await
            .is_ok()
    }

    /// The pool of everything but the per-job statements, for health checks.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Applies pending migrations. sqlx holds an advisory lock meanwhile, so
    /// concurrent pods starting together are safe. A connection lost on the
    /// way (even after a migration committed unseen) runs it again: applied
    /// migrations are recorded, the lock dies with its session, and what is
    /// left is applied by the next try.
    pub async fn migrate(&self) -> Result<()> {
        self.retrying_when(
            || async { Ok(MIGRATOR.run(&self.pool).await?) },
            StoreError::is_connection_lost,
        )
        .await
    }
}
