//! One run of the failover benchmark (`cargo bench --bench failover`): what a
//! highly available PostgreSQL costs onejob, and what a failover does to it.
//!
//! In one run, on this machine's RabbitMQ and a mock provider that answers at
//! once, each through one `onejob-worker` process with every role:
//!
//! 1. **Three sites** (`site`): this machine's PostgreSQL alone, and two
//!    clusters of `scripts/pg-ha` (two nodes under Patroni, HAProxy in
//!    front), one with synchronous replication and one with asynchronous.
//!    On each: the drain of a preloaded backlog, and the latency at 100
//!    intents/s on an open loop (from each intent's due time to its event).
//! 2. **A failover** (`failover`), on the synchronous cluster: 100 intents/s
//!    on the open loop while the primary's machine crashes (`scripts/pg-ha
//!    crash`): the time from the crash to the first write through HAProxy
//!    and to the first job onejob admitted on the new primary, the intents
//!    delayed past a second, and the latency before, during and after.
//! 3. **What asynchronous replication loses** (`loss`), on the asynchronous
//!    cluster: a stream of intents as fast as the broker takes them, the
//!    primary crashed in the middle of it; then the confirmed intents with
//!    no job, the calls made twice, and the attempts left unknown.
//!
//! It asserts nothing; it prints a report and writes `failover.json` and
//! `failover.md`.

mod failure;
mod loss;
mod report;
mod site;

use std::path::PathBuf;

use crate::drain::{machine, say};
pub use report::Report;
use site::{Kind, Site};

/// What to run.
#[derive(Clone, Debug)]
pub struct Options {
    /// Distinct intents in each drain's backlog.
    pub n: usize,
    /// Each site's latency phase at 100 intents/s.
    pub latency_seconds: u64,
    /// The failover phase's open loop; the crash comes a quarter in.
    pub failover_seconds: u64,
    /// Intents streamed through the asynchronous cluster's crash.
    pub loss_n: usize,
    /// Where the report goes.
    pub out: PathBuf,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            n: 10_000,
            latency_seconds: 15,
            failover_seconds: 40,
            loss_n: 20_000,
            out: PathBuf::from("target/bench"),
        }
    }
}

impl Options {
    /// A run of a couple of minutes: everything measured, nothing worth quoting.
    pub fn smoke() -> Self {
        Self {
            n: 300,
            latency_seconds: 2,
            failover_seconds: 20,
            loss_n: 2_000,
            ..Self::default()
        }
    }
}

/// Runs the whole benchmark.
pub async fn run(options: &Options) -> Report {
    std::fs::create_dir_all(&options.out).expect("create the report folder");
    let mut sites = Vec::new();
    let mut machine_named = String::new();
    for kind in [Kind::OneServer, Kind::Synchronous, Kind::Asynchronous] {
        let mut site = Site::start(kind, options).await;
        if machine_named.is_empty() {
            machine_named = machine(&site.env).await;
            say(&format!("on {machine_named}"));
        }
        let figures = site.measure(options).await;
        let (failover, loss) = match kind {
            Kind::OneServer => (None, None),
            Kind::Synchronous => (Some(failure::failover(&mut site, options).await), None),
            Kind::Asynchronous => (None, Some(loss::loss(&mut site, options).await)),
        };
        sites.push((figures, failover, loss));
        site.stop().await;
    }
    Report::of(machine_named, options, sites)
}
