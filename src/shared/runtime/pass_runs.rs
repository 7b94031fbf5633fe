//! How many runs of each of this process's reconciler passes have ended, so
//! that whoever must know a pass has had its chance (a test waiting out a
//! window in which nothing may happen) waits for the runs, never for time.

use std::collections::BTreeMap;
use std::sync::Arc;

use tokio::sync::watch;

/// The runs ended so far, by pass name. Clones share one record.
#[derive(Clone, Debug)]
pub struct PassRuns {
    ended: Arc<watch::Sender<BTreeMap<&'static str, u64>>>,
}

impl Default for PassRuns {
    fn default() -> PassRuns {
        PassRuns {
            ended: Arc::new(watch::Sender::new(BTreeMap::new())),
        }
    }
}

impl PassRuns {
    /// A run of `pass` ended, well or not.
    pub fn ended(&self, pass: &'static str) {
        self.ended
            .send_modify(|ended| *ended.entry(pass).or_default() += 1);
    }

    /// How many runs of `pass` have ended.
    pub fn count(&self, pass: &str) -> u64 {
        self.ended.borrow().get(pass).copied().unwrap_or(0)
    }

    /// Waits until `runs` runs of each of `passes` have ended since `since`
    /// (what [`PassRuns::counts`] said then). A run in progress at `since`
    /// is not counted: with `runs` of 1, the run waited for began after it.
    pub async fn wait(&self, since: &BTreeMap<String, u64>, passes: &[&str], runs: u64) {
        let due = |ended: &BTreeMap<&'static str, u64>| {
            passes.iter().all(|pass| {
                let before = since.get(*pass).copied().unwrap_or(0);
                ended.get(pass).copied().unwrap_or(0) > before + runs
            })
        };
        let mut seen = self.ended.subscribe();
        // The sender lives as long as this record, so the wait ends only when due.
        let _ = seen.wait_for(due).await;
    }

    /// Every pass's count now.
    pub fn counts(&self) -> BTreeMap<String, u64> {
        let ended = self.ended.borrow();
        ended.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect()
    }
}
