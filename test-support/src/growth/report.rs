//! The growth benchmark's report: the tables' sizes through the run, the
//! intake's latency while pruning, the targets and whether this run met them,
//! as markdown and JSON.

use std::path::Path;

use serde::Serialize;

use crate::drain::Percentiles;

/// One table's size, in bytes.
#[derive(Clone, Debug, Serialize)]
pub struct Size {
    pub table: String,
    pub heap: i64,
    pub indexes: i64,
    /// `pg_total_relation_size`: heap, indexes and TOAST.
    pub total: i64,
}

/// The three tables' sizes at a point of the run.
#[derive(Clone, Debug, Serialize)]
pub struct Sizes {
    pub at: String,
    pub tables: Vec<Size>,
}

impl Sizes {
    /// jobs + attempts + outbox, everything counted.
    pub fn total(&self) -> i64 {
        self.tables.iter().map(|t| t.total).sum()
    }
}

/// The intake's latency in one window of the pruning phase.
#[derive(Clone, Debug, Serialize)]
pub struct Window {
    /// Seconds since the pruning worker was ready, at the window's end.
    pub end_s: f64,
    pub latency: Percentiles,
    /// Jobs pruned so far.
    pub pruned: u64,
}

/// Everything one run measured.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub machine: String,
    /// The server's `autovacuum` setting.
    pub autovacuum: bool,
    pub n: usize,
    /// The first fill's jobs and their attempts, read back from the tables.
    pub jobs_per_fill: i64,
    pub attempts_per_fill: i64,
    /// The fills made (the first and the refills).
    pub fills: usize,
    /// `onejob_pruned_total` of the pruning worker at the end, by table.
    pub pruned_jobs: u64,
    pub pruned_attempts: u64,
    pub kept: i64,
    pub rate: f64,
    pub fill_seconds: f64,
    /// Each refill's statement.
    pub refill_seconds: Vec<f64>,
    pub baseline: Percentiles,
    pub pruning: Percentiles,
    pub windows: Vec<Window>,
    /// From the pruning worker's readiness to its count reaching N.
    pub prune_seconds: f64,
    /// From each refill to its last job pruned.
    pub refill_prune_seconds: Vec<f64>,
    /// From the last job pruned to no table past autovacuum's threshold.
    pub vacuum_wait_seconds: f64,
    /// `onejob_vacuums_total` of the pruning worker, by table.
    pub worker_vacuums: Vec<(String, f64)>,
    pub vacuum_full_seconds: f64,
    pub sizes: Vec<Sizes>,
    /// Rows of the fills left behind (must be 0).
    pub fill_left: i64,
    /// The kept rows and the intake's jobs before the pruning, with their
    /// attempts, equal to the same rows after both prunes.
    pub kept_unchanged: bool,
    /// Intake jobs published during the pruning phase, and those found after.
    pub intake_published: usize,
    pub intake_found: i64,
}
impl Report {
    fn size(&self, at: &str) -> i64 {
        total_at(&self.sizes, at)
    }

    /// p99 while pruning over the baseline's p99.
    pub fn p99_ratio(&self) -> f64 {
        self.pruning.p99_ms / self.baseline.p99_ms
    }

    /// What refill `k` (from 1) added to the tables, as a share of what the
    /// first fill added to the floor ([`growth_of_refill`]).
    pub fn refill_growth(&self, k: usize) -> f64 {
        growth_of_refill(&self.sizes, k)
    }

    /// The last refill's growth: what a fill costs once pruning has run a
    /// while.
    pub fn steady_growth(&self) -> f64 {
        self.refill_growth(self.refill_seconds.len())
    }

    /// The tables compacted with only the floor's rows left, over the floor.
    pub fn back_to_floor(&self) -> f64 {
        self.size(BACK) as f64 / self.size(FLOOR) as f64
    }

    /// The report as markdown.
    pub fn markdown(&self) -> String {
        let mut md = self.targets_table();
        md.push_str(&self.figures_table());
        md.push_str(&self.sizes_table());
        md.push_str(&self.windows_table());
        md
    }

    /// The run, and each target with whether it was met.
    fn targets_table(&self) -> String {
        format!(
            "growth benchmark on {}\n\n\
             {} ended jobs ({} attempts) filled {} times beside {} kept rows; intake {:.0} intents/s; \
             autovacuum {}\n\n\
             | measure | value | target | met |\n|---|---|---|---|\n\
             | intake p99 while pruning / baseline p99, same run | {:.2} ({:.1} / {:.1} ms) | ≤ 2 | {} |\n\
             | growth of the last refill / the first fill's growth (each refill: {}) | {:.3} | ≤ 0.10 | {} |\n\
             | compacted with the floor's rows alone / floor | {:.3} | ≤ 1.10 | {} |\n\
             | kept rows and intake jobs unchanged | {} | yes | {} |\n\
             | rows of the fills left | {} | 0 | {} |\n\
             | intake jobs found / published while pruning | {} / {} | all | {} |\n",
            self.machine,
            self.n,
            self.attempts_per_fill,
            self.refill_seconds.len() + 1,
            self.kept,
            self.rate,
            if self.autovacuum {
                "on"
            } else {
                "off (onejob's pruner vacuums)"
            },
            self.p99_ratio(),
            self.pruning.p99_ms,
            self.baseline.p99_ms,
            yes(self.p99_ratio() <= 2.0),
            (1..=self.refill_seconds.len())
                .map(|k| format!("{:.3}", self.refill_growth(k)))
                .collect::<Vec<_>>()
                .join(", "),
            self.steady_growth(),
            yes(self.steady_growth() <= 0.10),
            self.back_to_floor(),
            yes(self.back_to_floor() <= 1.10),
            self.kept_unchanged,
            yes(self.kept_unchanged),
            self.fill_left,
            yes(self.fill_left == 0),
            self.intake_found,
            self.intake_published,
            yes(self.intake_found == self.intake_published as i64),
        )
    }

    /// The figures measured.
    fn figures_table(&self) -> String {
        format!(
            "\n| figure | value |\n|---|---|\n\
             | fill: {} jobs, one statement | {:.1} s |\n\
             | each refill | {} s |\n\
             | prune {} jobs while intake runs (worker ready → all gone) | {:.1} s ({:.0} jobs/s) |\n\
             | prune each refill, no intake | {} s |\n\
             | last prune → no table past autovacuum's threshold | {:.1} s |\n\
             | vacuums by the pruning worker | {} |\n\
             | VACUUM FULL jobs, attempts, outbox (worker stopped) | {:.1} s |\n\
             | intake latency p50 / p99 / p99.9, baseline | {} ms ({} jobs) |\n\
             | intake latency p50 / p99 / p99.9, while pruning | {} ms ({} jobs) |\n",
            self.n,
            self.fill_seconds,
            seconds(&self.refill_seconds),
            self.n,
            self.prune_seconds,
            self.n as f64 / self.prune_seconds,
            seconds(&self.refill_prune_seconds),
            self.vacuum_wait_seconds,
            self.worker_vacuums
                .iter()
                .map(|(t, n)| format!("{t} {n}"))
                .collect::<Vec<_>>()
                .join(", "),
            self.vacuum_full_seconds,
            ms(&self.baseline),
            self.baseline.samples,
            ms(&self.pruning),
            self.pruning.samples,
        )
    }

    /// The tables' sizes at each point of the run.
    fn sizes_table(&self) -> String {
        let mut md = String::from(
            "\n| tables (MiB) | jobs heap / indexes / total | attempts heap / indexes / total | outbox total | all |\n|---|---|---|---|---|\n",
        );
        for s in &self.sizes {
            let t = |name: &str| s.tables.iter().find(|t| t.table == name);
            let three = |name: &str| {
                t(name).map_or(String::new(), |t| {
                    format!("{} / {} / {}", mib(t.heap), mib(t.indexes), mib(t.total))
                })
            };
            md.push_str(&format!(
                "| {} | {} | {} | {} | {} |\n",
                s.at,
                three("jobs"),
                three("attempts"),
                t("outbox").map_or(String::new(), |t| mib(t.total)),
                mib(s.total())
            ));
        }
        md
    }

    /// The intake's latency in each window of the pruning phase.
    fn windows_table(&self) -> String {
        let mut md = String::from(
            "\n| pruning window ends (s) | intake p50 / p99 / p99.9 (ms) | jobs pruned so far |\n|---|---|---|\n",
        );
        for w in &self.windows {
            md.push_str(&format!(
                "| {:.0} | {} | {} |\n",
                w.end_s,
                ms(&w.latency),
                w.pruned
            ));
        }
        md
    }

    /// Writes `growth.json` and `growth.md` into `dir`.
    pub fn write(&self, dir: &Path) {
        std::fs::create_dir_all(dir).expect("create the report folder");
        let json = serde_json::to_string_pretty(self).expect("report json");
        std::fs::write(dir.join("growth.json"), json + "\n").expect("write growth.json");
        std::fs::write(dir.join("growth.md"), self.markdown()).expect("write growth.md");
    }
}

pub(super) const FLOOR: &str = "floor";
pub(super) const FILLED: &str = "filled";
pub(super) const PRUNED: &str = "pruned, vacuumed";
pub(super) const FULL: &str = "after VACUUM FULL";
pub(super) const BACK: &str = "the intake's jobs deleted, VACUUM FULL";

pub(super) fn refilled(k: usize) -> String {
    format!("refill {k}")
}

pub(super) fn repruned(k: usize) -> String {
    format!("refill {k} pruned, vacuumed")
}

/// What refill `k` (from 1) added to the tables past the largest they had been
/// since the first fill (the pruned and vacuumed tables before it, unless a
/// vacuum truncated their emptied pages and so gave that space back), as a
/// share of what the first fill added to the floor: 0 when it fit wholly in
/// the space the fill before it left, 1 when it took as much again.
fn growth_of_refill(sizes: &[Sizes], k: usize) -> f64 {
    let since_filled = sizes.iter().skip_while(|s| s.at != FILLED);
    let before = since_filled
        .take_while(|s| s.at != refilled(k))
        .map(Sizes::total)
        .max()
        .unwrap_or(0);
    (total_at(sizes, &refilled(k)) - before) as f64
        / (total_at(sizes, FILLED) - total_at(sizes, FLOOR)) as f64
}

/// The tables' total at `at`, 0 where the run has no such point.
fn total_at(sizes: &[Sizes], at: &str) -> i64 {
    sizes.iter().find(|s| s.at == at).map_or(0, Sizes::total)
}

/// Figures in seconds, one decimal, comma-separated.
fn seconds(figures: &[f64]) -> String {
    figures
        .iter()
        .map(|s| format!("{s:.1}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Bytes, in MiB with one decimal.
fn mib(b: i64) -> String {
    format!("{:.1}", b as f64 / (1024.0 * 1024.0))
}

/// p50 / p99 / p99.9, in ms with one decimal.
fn ms(p: &Percentiles) -> String {
    format!("{:.1} / {:.1} / {:.1}", p.p50_ms, p.p99_ms, p.p999_ms)
}

/// A target met, or not (in bold).
fn yes(b: bool) -> &'static str {
    if b { "yes" } else { "**no**" }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sizes in tenths of a MiB (a unit of 100,000 bytes here), as the run
    /// names them.
    fn sizes(at: &[(&str, i64)]) -> Vec<Sizes> {
        at.iter()
            .map(|(at, tenths)| Sizes {
                at: (*at).to_owned(),
                tables: vec![Size {
                    table: "jobs".into(),
                    heap: 0,
                    indexes: 0,
                    total: tenths * 100_000,
                }],
            })
            .collect()
    }

    /// A vacuum that truncated the emptied pages gave their space back: the
    /// refill that takes it again did not grow the tables past what they were
    /// (one CI run's figures, where each prune truncated the heap).
    #[test]
    fn a_refill_into_space_a_vacuum_gave_back_is_not_growth() {
        let run = sizes(&[
            (FLOOR, 45),
            (FILLED, 81),
            (PRUNED, 68),
            (&refilled(1), 84),
            (&repruned(1), 69),
            (&refilled(2), 85),
            (&repruned(2), 70),
        ]);
        assert!((growth_of_refill(&run, 1) - 3.0 / 36.0).abs() < 1e-9);
        assert!((growth_of_refill(&run, 2) - 1.0 / 36.0).abs() < 1e-9);
    }

    /// Where nothing was truncated, a refill's growth is what it added to
    /// the pruned tables before it; a refill that took as much again is 1.
    #[test]
    fn a_refill_beside_the_space_a_prune_left_is_growth() {
        let kept = sizes(&[
            (FLOOR, 45),
            (FILLED, 81),
            (PRUNED, 83),
            (&refilled(1), 85),
            (&repruned(1), 85),
        ]);
        assert!((growth_of_refill(&kept, 1) - 2.0 / 36.0).abs() < 1e-9);
        let unvacuumed = sizes(&[(FLOOR, 45), (FILLED, 81), (PRUNED, 81), (&refilled(1), 117)]);
        assert!((growth_of_refill(&unvacuumed, 1) - 1.0).abs() < 1e-9);
    }
}
