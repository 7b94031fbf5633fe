//! The failover benchmark's report: a table per phase, as markdown and JSON.

use std::path::Path;

use super::Options;
use super::failure::Failover;
use super::loss::Loss;
use super::site::SiteFigures;
use crate::drain::Percentiles;

/// Everything one run measured.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Report {
    pub machine: String,
    pub n: usize,
    pub sites: Vec<SiteFigures>,
    pub failover: Option<Failover>,
    pub loss: Option<Loss>,
}

impl Report {
    pub(super) fn of(
        machine: String,
        options: &Options,
        measured: Vec<(SiteFigures, Option<Failover>, Option<Loss>)>,
    ) -> Report {
        let mut report = Report {
            machine,
            n: options.n,
            sites: Vec::new(),
            failover: None,
            loss: None,
        };
        for (site, failover, loss) in measured {
            report.sites.push(site);
            report.failover = report.failover.take().or(failover);
            report.loss = report.loss.take().or(loss);
        }
        report
    }

    pub fn markdown(&self) -> String {
        let mut md = format!(
            "## Failover benchmark\n\nOn {}; one `onejob-worker`, a mock provider that answers at once.\n\n",
            self.machine
        );
        md.push_str(&self.sites_table());
        if let Some(f) = &self.failover {
            md.push_str(&failover_table(f));
        }
        if let Some(l) = &self.loss {
            md.push_str(&loss_table(l));
        }
        md
    }

    fn sites_table(&self) -> String {
        let base = self.sites.first().map_or(f64::NAN, |s| s.drain_jobs_per_s);
        let mut md = format!(
            "### What replication costs\n\nDrain of {} jobs, and due → event at 100 intents/s.\n\n\
             | PostgreSQL | drain, jobs/s | / one server | p50 | p99 |\n|---|---|---|---|---|\n",
            self.n
        );
        for s in &self.sites {
            md.push_str(&format!(
                "| {} | {:.0} | {:.2} | {:.1} ms | {:.1} ms |\n",
                s.kind.name(),
                s.drain_jobs_per_s,
                s.drain_jobs_per_s / base,
                s.latency.p50_ms,
                s.latency.p99_ms
            ));
        }
        md
    }

    pub fn write(&self, dir: &Path) {
        std::fs::create_dir_all(dir).expect("create the report folder");
        let json = serde_json::to_string_pretty(self).expect("report json");
        std::fs::write(dir.join("failover.json"), json + "\n").expect("write failover.json");
        std::fs::write(dir.join("failover.md"), self.markdown()).expect("write failover.md");
    }
}

fn window(name: &str, p: &Percentiles) -> String {
    format!(
        "| {name} | {} | {:.1} ms | {:.1} ms |\n",
        p.samples, p.p50_ms, p.p99_ms
    )
}

fn failover_table(f: &Failover) -> String {
    let mut md = format!(
        "\n### A failover, synchronous replication\n\n{:.0} intents/s; the primary's machine crashed (Patroni and PostgreSQL SIGKILLed).\n\n\
         - crash → first write through HAProxy: {:.1} s\n\
         - crash → first job admitted on the new primary: {:.1} s\n\
         - intents delayed past 1 s: {} of {}; the longest due → event: {:.0} ms\n\n\
         | intents due | intents | p50 | p99 |\n|---|---|---|---|\n",
        f.rate_per_s,
        f.crash_to_first_write_s,
        f.crash_to_first_admission_s,
        f.delayed_past_1s,
        f.intents,
        f.max_ms
    );
    md.push_str(&window("before the crash", &f.before));
    md.push_str(&window("from the crash to the first write", &f.during));
    md.push_str(&window("after", &f.after));
    md
}

fn loss_table(l: &Loss) -> String {
    format!(
        "\n### What asynchronous replication lost\n\n{} intents streamed as fast as the broker confirmed them; the primary's machine crashed once {} had succeeded; a primary took writes {:.1} s later.\n\n\
         | | count |\n|---|---|\n\
         | confirmed intents with no job on the new primary | {} |\n\
         | of them, with their `job.succeeded` event published | {} |\n\
         | provider calls | {} |\n\
         | attempts called more than once | {} |\n\
         | settlements that found their claim lost (`onejob_claims_lost_total`) | {} |\n\
         | jobs left open (queued, running, unknown) | {} |\n\
         | of them unknown | {} |\n",
        l.intents,
        l.succeeded_before_crash,
        l.crash_to_first_write_s,
        l.intents_without_job,
        l.events_of_lost_jobs,
        l.calls,
        l.calls_twice,
        l.claims_lost,
        l.jobs_open,
        l.jobs_unknown
    )
}
