//! Where a run of the failover benchmark sends onejob: this machine's
//! PostgreSQL alone, or a cluster of `scripts/pg-ha` through HAProxy; with
//! its own database, vhost, mock provider and one `onejob-worker` process.

use std::sync::Arc;
use std::time::{Duration, Instant};

use onejob::mock::{MockHandle, MockOptions};
use onejob_producer::Producer;

use super::Options;
use crate::drain::{Events, Percentiles, Worker, bar, free_port, open_loop, preload, say};
use crate::pg_ha::OwnHa;
use crate::tempfile_path::TempConfig;
use crate::{Servers, TestEnv, config, mock};

/// Which PostgreSQL.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Kind {
    /// This machine's PostgreSQL, one server.
    OneServer,
    /// Two nodes under Patroni, `synchronous_mode` on: a commit returns once
    /// the standby has it.
    Synchronous,
    /// Two nodes under Patroni, replication asynchronous.
    Asynchronous,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::OneServer => "one server (this machine's PostgreSQL)",
            Kind::Synchronous => "two nodes, synchronous replication",
            Kind::Asynchronous => "two nodes, asynchronous replication",
        }
    }
}

/// What every site measured.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SiteFigures {
    pub kind: Kind,
    pub drain_jobs_per_s: f64,
    /// Due → event at 100 intents/s.
    pub latency: Percentiles,
}

/// A site, running.
pub struct Site {
    pub kind: Kind,
    pub ha: Option<OwnHa>,
    pub env: TestEnv,
    pub provider: MockHandle,
    pub producer: Arc<Producer>,
    pub events: Events,
    pub worker: Worker,
    _config: TempConfig,
}

impl Site {
    /// Starts the servers of `kind` (a cluster for the two HA kinds), the
    /// run's database, a mock provider and a worker; the backlog of
    /// `options.n` intents is published before the worker starts.
    pub async fn start(kind: Kind, options: &Options) -> Site {
        say(&format!("{}: starting", kind.name()));
        let ha = (kind != Kind::OneServer).then(|| OwnHa::start(kind == Kind::Synchronous));
        let provider = mock(MockOptions::default()).await;
        // The embedded defaults, pointed at this run's mock, with the sweep
        // that finds a lost claim (`stuck_after`, 10 minutes by default)
        // quick enough to watch.
        let text = onejob::settings::config::EMBEDDED_DEFAULT
            .replace("http://127.0.0.1:8081/v1", &provider.base_url())
            + "\n[worker]\nstuck_after = \"20s\"\n";
        let (config, file) = config(&text);
        let env = match &ha {
            None => TestEnv::new(&config).await,
            Some(ha) => {
                let servers = Servers {
                    postgres: ha.base_url(),
                    rabbit: None,
                };
                TestEnv::on(&config, servers).await
            }
        };
        let producer = Arc::new(
            Producer::connect(&env.amqp_url)
                .await
                .expect("producer connects"),
        );
        let events = Events::watch(&env).await;
        preload(&producer, options.n, options.n / 4).await;
        let log = options.out.join(format!("worker-failover-{kind:?}.log"));
        let worker = Worker::start(&env, &file.path, &log, Some(free_port()));
        Site {
            kind,
            ha,
            env,
            provider,
            producer,
            events,
            worker,
            _config: file,
        }
    }

    /// The drain of the backlog (from the worker's start to the last
    /// event), then the latency at 100 intents/s.
    pub async fn measure(&mut self, options: &Options) -> SiteFigures {
        let started = Instant::now();
        let progress = bar(options.n as u64, "draining");
        let limit = Duration::from_secs(120 + options.n as u64 / 20);
        while self.events.succeeded() < options.n {
            assert_eq!(
                self.events.other(),
                0,
                "a job ended otherwise than succeeded"
            );
            assert!(self.worker.running(), "the worker exited during the drain");
            assert!(
                started.elapsed() < limit,
                "the drain did not finish within {limit:?}"
            );
            progress.set_position(self.events.succeeded() as u64);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        progress.finish_and_clear();
        let drain_jobs_per_s = options.n as f64 / started.elapsed().as_secs_f64();
        say(&format!(
            "{}: drained {drain_jobs_per_s:.0} jobs/s",
            self.kind.name()
        ));
        let measured = open_loop(
            self.producer.clone(),
            &mut self.events,
            100.0,
            options.latency_seconds,
            "c-",
        )
        .await;
        SiteFigures {
            kind: self.kind,
            drain_jobs_per_s,
            latency: measured.latency,
        }
    }

    /// Stops the worker, then the cluster (if any).
    pub async fn stop(self) {
        self.worker.stop().await;
        if let Ok(producer) = Arc::try_unwrap(self.producer) {
            producer.close().await;
        }
        drop(self.env);
        drop(self.ha);
    }
}
