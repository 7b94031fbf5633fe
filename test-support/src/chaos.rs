//! What the chaos tests share: worker processes that an orchestrator would
//! restart, producers that publish every intent until the broker confirms it,
//! and the invariant checker of contract section 5.

use std::collections::{BTreeMap, HashSet};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use onejob_producer::Producer;
use rand::Rng;

use super::TestEnv;

/// Removes the workers' logs: once the invariants held (a failing test keeps
/// them, and names where).
pub fn remove_logs(log_dir: &std::path::Path) {
    let _ = std::fs::remove_dir_all(log_dir);
}

pub fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

pub fn worker_bin() -> std::path::PathBuf {
    super::binaries::binary("onejob-worker")
}

/// Three worker processes (or as many as asked), each with its own log; worker
/// `i` connects to `amqp_url(i)`.
pub struct Workers {
    children: Vec<Child>,
    spawn: Box<dyn Fn(usize) -> Child + Send>,
    pub deaths: usize,
    pub log_dir: std::path::PathBuf,
}

impl Workers {
    pub fn start(
        count: usize,
        env: &TestEnv,
        config: &std::path::Path,
        amqp_url: impl Fn(usize) -> String + Send + 'static,
    ) -> Workers {
        Self::start_logging(
            count,
            env,
            config,
            amqp_url,
            "warn,onejob_core::broker=info,onejob::roles::intake=info",
        )
    }

    /// As [`Workers::start`], with the workers' `RUST_LOG`.
    pub fn start_logging(
        count: usize,
        env: &TestEnv,
        config: &std::path::Path,
        amqp_url: impl Fn(usize) -> String + Send + 'static,
        log_filter: &str,
    ) -> Workers {
        let bin = worker_bin();
        let log_filter = log_filter.to_owned();
        let (db, cfg) = (env.database_url.clone(), config.to_owned());
        let log_dir = std::env::temp_dir().join(format!("onejob-chaos-{}", env.name));
        std::fs::create_dir_all(&log_dir).unwrap();
        let spawn_dir = log_dir.clone();
        let spawn = move |i: usize| {
            let log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(spawn_dir.join(format!("worker-{i}.log")))
                .unwrap();
            Command::new(&bin)
                .env("DATABASE_URL", &db)
                .env("AMQP_URL", amqp_url(i))
                .env("ONEJOB_CONFIG", &cfg)
                .env("RUST_LOG", &log_filter)
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("spawn worker")
        };
        Workers {
            children: (0..count).map(&spawn).collect(),
            spawn: Box::new(spawn),
            deaths: 0,
            log_dir,
        }
    }

    /// Restarts any worker that exited (a crash, or a lost broker): what an
    /// orchestrator does. Counts each as a death.
    pub fn supervise(&mut self) {
        for i in 0..self.children.len() {
            if let Ok(Some(_)) = self.children[i].try_wait() {
                self.deaths += 1;
                self.children[i] = (self.spawn)(i);
            }
        }
    }

    pub fn kill_one(&mut self, i: usize) {
        let _ = self.children[i].kill(); // SIGKILL
        let _ = self.children[i].wait();
        self.deaths += 1;
        self.children[i] = (self.spawn)(i);
    }

    /// Stops every worker; their logs stay until [`Workers::remove_logs`].
    pub fn stop(mut self) -> std::path::PathBuf {
        self.stop_all();
        self.log_dir.clone()
    }

    /// How many connections to a RabbitMQ node worker `i` opened so far (its
    /// log's lines that say a node accepted one).
    pub fn connections(&self, i: usize) -> usize {
        std::fs::read_to_string(self.log_dir.join(format!("worker-{i}.log")))
            .map(|log| log.matches("accepted the connection").count())
            .unwrap_or(0)
    }

    fn stop_all(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.stop_all();
    }
}

/// What the producers sent: every key the broker confirmed, and how many
/// publishes were confirmed (duplicates included).
#[derive(Clone, Default)]
pub struct Sent {
    pub confirmed: Arc<Mutex<HashSet<String>>>,
    pub count: Arc<AtomicUsize>,
}

impl Sent {
    pub fn keys(&self) -> Vec<String> {
        self.confirmed.lock().unwrap().iter().cloned().collect()
    }
}

/// Starts `producers` producers sharing `intents` publishes over about 60% of
/// `seconds`; 30% of them re-send an earlier key. Producer `p` connects to
/// `amqp_url(p)`. Every intent is published until the broker confirms it: a
/// publish that fails (its node or the broker went away) is reported as failed,
/// and the producer connects again and publishes it again.
pub fn start_producers(
    producers: usize,
    intents: usize,
    seconds: u64,
    amqp_url: impl Fn(usize) -> String,
    sent: &Sent,
) -> Vec<tokio::task::JoinHandle<()>> {
    let unique = intents * 7 / 10;
    let share = intents / producers;
    (0..producers)
        .map(|p| {
            let (amqp, sent) = (amqp_url(p), sent.clone());
            tokio::spawn(async move {
                let pace = Duration::from_secs_f64(seconds as f64 * 0.6 / share as f64);
                let mut producer: Option<Producer> = None;
                for n in 0..share {
                    let key = {
                        let i = p * share + n;
                        if i < unique {
                            i
                        } else {
                            rand::rng().random_range(0..unique)
                        }
                    };
                    let key = format!("chaos-{key}");
                    let intent = super::intent("acct_chaos", &key, &format!("input of {key}"));
                    publish_until_confirmed(&mut producer, &amqp, p, &key, &intent).await;
                    sent.confirmed.lock().unwrap().insert(key);
                    sent.count.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(pace).await;
                }
                if let Some(p) = producer {
                    p.close().await;
                }
            })
        })
        .collect()
}

/// Publishes `intent` (keyed `key`) as producer `p` until the broker confirms
/// it, connecting `producer` to `amqp` again after a failed publish. However
/// the broker fails, a publish is confirmed or fails, and the producer gets
/// through again within a minute.
async fn publish_until_confirmed(
    producer: &mut Option<Producer>,
    amqp: &str,
    p: usize,
    key: &str,
    intent: &onejob::intent::Intent,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut last_error = String::new();
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        assert!(
            !left.is_zero(),
            "producer {p}: {key} not confirmed within a minute; last error: {last_error}"
        );
        if producer.is_none() {
            let options = onejob_producer::ProducerOptions {
                delivery_limit: 1,
                ..Default::default()
            };
            // A call that hangs counts against the minute too.
            *producer =
                match tokio::time::timeout(left, Producer::connect_with(amqp, options)).await {
                    Ok(Ok(p)) => Some(p),
                    Ok(Err(e)) => {
                        last_error = e.to_string();
                        None
                    }
                    Err(_) => {
                        last_error = "connect hung".into();
                        None
                    }
                };
        }
        match producer.as_ref() {
            Some(pr) => match tokio::time::timeout(left, pr.publish_only(intent)).await {
                Ok(Ok(())) => break,
                Ok(Err(e)) => {
                    last_error = e.to_string();
                    *producer = None;
                }
                Err(_) => {
                    last_error = "publish hung".into();
                    *producer = None;
                }
            },
            None => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
}

/// A small pool on `env`'s database for the checks.
pub async fn store(
    env: &TestEnv,
    config: &onejob::settings::config::Config,
) -> onejob::edges::store::Store {
    onejob::edges::store::Store::connect(
        &env.database_url,
        4,
        onejob::shared::runtime::routes(config),
        Duration::from_secs(30),
    )
    .await
    .unwrap()
}

/// Waits until no job is queued or running, every confirmed key has a job and
/// no outbox row is left unpublished (or two minutes pass), restarting workers
/// that exit meanwhile; how long it took. (A row whose publisher was killed is
/// the relay's once its lease is over: the workers must still be running for
/// it.)
pub async fn settle(
    store: &onejob::edges::store::Store,
    workers: &mut Workers,
    confirmed: usize,
) -> Duration {
    let recovery = std::time::Instant::now();
    loop {
        workers.supervise();
        let (open, jobs, unpublished): (i64, i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE status IN ('queued', 'running')), count(*),
                    (SELECT count(*) FROM outbox WHERE published_at IS NULL)
             FROM jobs",
        )
        .fetch_one(store.pool())
        .await
        .unwrap_or((1, 0, 1));
        if open == 0 && jobs as usize >= confirmed && unpublished == 0 {
            return recovery.elapsed();
        }
        assert!(
            recovery.elapsed() < Duration::from_secs(120),
            "not settled after 2 minutes: {open} jobs queued or running, {jobs} jobs for {confirmed} confirmed keys, \
             {unpublished} outbox rows unpublished (logs in {})",
            workers.log_dir.display()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The invariant checker's counts.
#[derive(Debug)]
pub struct Invariants {
    pub by_status: BTreeMap<String, i64>,
    pub attempts: i64,
    pub discarded: i64,
    pub dead_reasons: BTreeMap<String, usize>,
    pub dead: usize,
    /// Dead letters that carry a valid intent (every intent these tests send
    /// is valid): each must have ended as a job all the same.
    pub dead_valid: usize,
    /// Of those, the ones whose identity has a job all the same (made by
    /// another send of the same key).
    pub dead_valid_with_job: usize,
    pub duplicated_identities: i64,
    pub after_unknown: i64,
    pub two_open: i64,
    pub bad_winners: i64,
    pub rewritten: i64,
    pub event_mismatch: i64,
    pub unpublished: i64,
    pub lost: Vec<String>,
    pub unknown: i64,
}

impl Invariants {
    /// Checks contract section 5 on `env`'s tables and dead-letter queue against
    /// the keys the broker confirmed.
    pub async fn check(
        env: &TestEnv,
        store: &onejob::edges::store::Store,
        confirmed: &[String],
    ) -> Self {
        let q = |sql: &'static str| count(store, sql);
        let by_status: BTreeMap<String, i64> =
            sqlx::query_as("SELECT status, count(*) FROM jobs GROUP BY status")
                .fetch_all(store.pool())
                .await
                .unwrap()
                .into_iter()
                .collect();
        let attempts = q("SELECT count(*) FROM attempts").await;
        let discarded = q("SELECT count(*) FROM attempts WHERE status = 'discarded'").await;
        // 1. One job per identity.
        let duplicated_identities =
            q("SELECT count(*) FROM (SELECT 1 FROM jobs GROUP BY owner_id, idempotency_key HAVING count(*) > 1) d").await;
        // 2. No attempt was created after one of the same job became unknown (none
        //    is resolved in these runs, so a later attempt would have started
        //    beside it).
        let after_unknown = q("SELECT count(*) FROM attempts u JOIN attempts a ON a.job_id = u.job_id AND a.number > u.number
                               WHERE u.status = 'unknown'")
        .await;
        // 3. Without hedging, at most one open attempt per job.
        let two_open = q("SELECT count(*) FROM (SELECT job_id FROM attempts WHERE status IN ('queued', 'started', 'unknown')
                          GROUP BY job_id HAVING count(*) > 1) d")
        .await;
        // 4. A succeeded job has exactly one succeeded attempt, and it is
        //    completed_by.
        let bad_winners = q("SELECT count(*) FROM jobs j WHERE j.status = 'succeeded' AND (
                               (SELECT count(*) FROM attempts a WHERE a.job_id = j.id AND a.status = 'succeeded') <> 1
                               OR NOT EXISTS (SELECT 1 FROM attempts a WHERE a.id = j.completed_by AND a.status = 'succeeded'))")
        .await;
        // 5. Terminal jobs never changed: one outcome write each (version 1), and
        //    one event per terminal job in the outbox.
        let rewritten = q("SELECT count(*) FROM jobs WHERE status IN ('succeeded', 'failed', 'cancelled') AND version <> 1").await;
        let event_mismatch = q("SELECT count(*) FROM jobs j WHERE j.status IN ('succeeded', 'failed', 'cancelled')
                                AND (SELECT count(DISTINCT o.message_id) FROM outbox o
                                     WHERE o.exchange = 'onejob.events' AND o.message_id = j.id::text || ':' || j.version) <> 1")
        .await;
        let unpublished = q("SELECT count(*) FROM outbox WHERE published_at IS NULL").await;
        // 6. Every confirmed intent is a job: all were valid and consistent, so
        //    a dead letter is no excuse. Dead-lettered valid intents are counted
        //    on their own.
        let jobs_for_keys = job_keys(store).await;
        let (dead, dead_reasons, dead_valid) = dead_letters(env).await;
        let dead_valid_with_job = dead_valid
            .iter()
            .filter(|k| jobs_for_keys.contains(*k))
            .count();
        let lost: Vec<String> = confirmed
            .iter()
            .filter(|k| !jobs_for_keys.contains(*k))
            .cloned()
            .collect();
        let unknown = by_status.get("unknown").copied().unwrap_or(0);
        Invariants {
            by_status,
            attempts,
            discarded,
            dead_reasons,
            dead,
            dead_valid: dead_valid.len(),
            dead_valid_with_job,
            duplicated_identities,
            after_unknown,
            two_open,
            bad_winners,
            rewritten,
            event_mismatch,
            unpublished,
            lost,
            unknown,
        }
    }

    /// Prints the counts (`what` names the test) and asserts every invariant;
    /// `unknown_bound` is the number of provider calls in flight at the faults.
    pub fn assert_held(&self, what: &str, provider_calls: u64, unknown_bound: usize) {
        println!(
            "{what}: jobs by status {:?}; {} attempts ({} discarded); {provider_calls} provider calls; \
             {} intents dead-lettered {:?}, {} of them valid ({} of identities that have a job)",
            self.by_status,
            self.attempts,
            self.discarded,
            self.dead,
            self.dead_reasons,
            self.dead_valid,
            self.dead_valid_with_job
        );
        println!(
            "{what}: invariants: duplicated identities {}, attempts after an unknown {}, \
             jobs with two open attempts {}, bad winners {}, terminal jobs rewritten {}, \
             event mismatches {}, unpublished outbox rows {}, lost intents {}, unknown jobs {} \
             (bound {unknown_bound})",
            self.duplicated_identities,
            self.after_unknown,
            self.two_open,
            self.bad_winners,
            self.rewritten,
            self.event_mismatch,
            self.unpublished,
            self.lost.len(),
            self.unknown
        );
        assert_eq!(self.duplicated_identities, 0, "invariant 1");
        assert_eq!(self.after_unknown, 0, "invariant 2");
        assert_eq!(self.two_open, 0, "invariant 3");
        assert_eq!(self.bad_winners, 0, "invariant 4");
        assert_eq!(self.rewritten, 0, "invariant 5");
        assert_eq!(self.event_mismatch, 0, "one event per terminal job");
        assert_eq!(self.unpublished, 0, "the outbox drained");
        assert!(
            self.lost.is_empty(),
            "invariant 6: confirmed intents with no job: {:?}",
            self.lost
        );
        // A valid intent the broker dead-lettered anyway (its deliveries held
        // by killed workers past the delivery limit) must have become a job:
        // the reconciler admits it from the dead-letter queue, where the letter
        // stays for an operator (contract section 2).
        assert_eq!(
            self.dead_valid, self.dead_valid_with_job,
            "valid intents dead-lettered ({} of identities that have a job): each should have ended as a job; reasons {:?}",
            self.dead_valid_with_job, self.dead_reasons
        );
        assert_eq!(
            self.by_status.get("queued").copied().unwrap_or(0)
                + self.by_status.get("running").copied().unwrap_or(0),
            0,
            "stuck jobs"
        );
        assert!(
            self.unknown as usize <= unknown_bound,
            "{} unknown jobs, more than the calls in flight at the faults ({unknown_bound})",
            self.unknown
        );
    }
}

/// One count from `sql` on `store`.
async fn count(store: &onejob::edges::store::Store, sql: &'static str) -> i64 {
    sqlx::query_as::<_, (i64,)>(sql)
        .fetch_one(store.pool())
        .await
        .unwrap()
        .0
}

/// Every job's idempotency key.
async fn job_keys(store: &onejob::edges::store::Store) -> HashSet<String> {
    sqlx::query_as::<_, (String,)>("SELECT idempotency_key FROM jobs")
        .fetch_all(store.pool())
        .await
        .unwrap()
        .into_iter()
        .map(|(k,)| k)
        .collect()
}

/// The intents' dead letters, taken off their queue: how many, why each died
/// (onejob's own reason, else the broker's x-death), and the keys of the
/// valid intents among them.
async fn dead_letters(env: &TestEnv) -> (usize, BTreeMap<String, usize>, Vec<String>) {
    let amqp = env.amqp().await;
    let ch = amqp.create_channel().await.unwrap();
    let letters = env.drain(&ch, "onejob.intents.dlq").await;
    let _ = amqp.close(200, "checked".into()).await;
    let mut dead_reasons: BTreeMap<String, usize> = BTreeMap::new();
    for d in &letters {
        let letter = onejob::shared::dlq::describe("onejob.intents.dlq", 0, &d.properties, &d.data);
        *dead_reasons.entry(letter.reason).or_default() += 1;
    }
    let dead_valid: Vec<String> = letters
        .iter()
        .filter_map(|d| {
            onejob::intent::Intent::parse(&d.data, onejob::intent::DEFAULT_MAX_BODY_BYTES).ok()
        })
        .map(|intent| intent.idempotency_key)
        .collect();
    (letters.len(), dead_reasons, dead_valid)
}
