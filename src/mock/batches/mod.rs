//! Batch APIs in the mock: OpenAI's Files and Batches (`openai`) and
//! Anthropic's Message Batches (`anthropic`), over one store of batches.
//!
//! A batch is run here line after line, each line by the same work as a
//! live request (`answer::work`, its directives obeyed when the mock obeys
//! them), and its results kept until it is read. Directives a line may carry
//! for the batch as a whole:
//!
//! | directive | effect |
//! |---|---|
//! | `mock:expire` | the window runs out when this line's turn comes: it and every line after it end `expired`, the lines before keep their results |
//! | `mock:duplicate` | this line's result is written twice (a provider that repeats a `custom_id`) |
//! | `mock:slow_status=MS` | every read of the batch's status waits MS milliseconds first (at most a minute) |
//!
//! A line's own `mock:status=CODE` makes it an error line, and `mock:delay`
//! slows the batch down, so that its status is read while it runs.

pub(super) mod anthropic;
pub(super) mod openai;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde_json::Value;

use super::answer::{self, Outcome};
use super::directives::{self, Directives};
use super::{Asked, MockOptions, Stats};

/// The most lines one batch may hold (OpenAI's limit is 50,000 requests,
/// Anthropic's 100,000).
pub(super) const MAX_LINES: usize = 100_000;

/// Which API a batch was made through, and so the shape it is read in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    OpenAi,
    Anthropic,
}

/// One request of a batch: its `custom_id`, and what it asks (or why it
/// cannot be read: an invalid line ends as an error line, as the APIs do).
pub(super) struct Line {
    pub(super) custom_id: String,
    pub(super) asked: Result<Asked, String>,
}

/// How one line ended.
#[derive(Clone, Debug)]
pub(super) enum Ended {
    /// It ran: an answer, or an error answer.
    Ran(Outcome),
    /// It could not be read; it never ran.
    Invalid(String),
    /// The window ran out before it ran.
    Expired,
    /// The batch was cancelled before it ran.
    Cancelled,
}

/// Where a batch stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Status {
    InProgress,
    Cancelling,
    Completed,
    Expired,
    Cancelled,
    /// Refused whole at validation (OpenAI's `failed`): no line ran.
    Failed,
}

impl Status {
    pub(super) fn ended(self) -> bool {
        !matches!(self, Status::InProgress | Status::Cancelling)
    }
}

/// A batch and everything about it the APIs show.
pub(super) struct Batch {
    pub(super) id: String,
    pub(super) kind: Kind,
    pub(super) created_at: i64,
    pub(super) metadata: Option<Value>,
    pub(super) input_file_id: Option<String>,
    /// Every line's `custom_id`, in the order given.
    pub(super) custom_ids: Vec<String>,
    pub(super) status: Status,
    /// Why a batch `Failed` at validation.
    pub(super) errors: Vec<Value>,
    /// Each line's end, in the order they ended (a duplicated result twice).
    pub(super) results: Vec<(String, Ended)>,
    pub(super) slow_status: Option<Duration>,
    pub(super) cancelling_at: Option<i64>,
    pub(super) ended_at: Option<i64>,
    /// OpenAI's files of the results, written once the batch ends.
    pub(super) output_file_id: Option<String>,
    pub(super) error_file_id: Option<String>,
}

impl Batch {
    /// A batch of `lines` just taken, running.
    pub(super) fn new(id: String, kind: Kind, lines: &[Line], options: &MockOptions) -> Batch {
        Batch {
            id,
            kind,
            created_at: now(),
            metadata: None,
            input_file_id: None,
            custom_ids: lines.iter().map(|l| l.custom_id.clone()).collect(),
            status: Status::InProgress,
            errors: Vec::new(),
            results: Vec::new(),
            slow_status: status_delay(lines, options),
            cancelling_at: None,
            ended_at: None,
            output_file_id: None,
            error_file_id: None,
        }
    }

    /// How many of its lines ended each way (a duplicated result once).
    pub(super) fn counts(&self) -> Counts {
        let mut seen = std::collections::HashSet::new();
        let mut c = Counts {
            total: self.custom_ids.len(),
            ..Counts::default()
        };
        for (id, ended) in &self.results {
            if !seen.insert(id.as_str()) {
                continue;
            }
            match ended {
                Ended::Ran(Outcome::Answer(_)) => c.succeeded += 1,
                Ended::Ran(_) | Ended::Invalid(_) => c.errored += 1,
                Ended::Expired => c.expired += 1,
                Ended::Cancelled => c.cancelled += 1,
            }
        }
        c
    }
}

/// A batch's lines by how they ended.
#[derive(Debug, Default)]
pub(super) struct Counts {
    pub(super) total: usize,
    pub(super) succeeded: usize,
    pub(super) errored: usize,
    pub(super) expired: usize,
    pub(super) cancelled: usize,
}

impl Counts {
    pub(super) fn processing(&self) -> usize {
        self.total - self.succeeded - self.errored - self.expired - self.cancelled
    }
}

/// A file uploaded for a batch, or written with its results.
pub(super) struct File {
    pub(super) id: String,
    pub(super) filename: String,
    pub(super) purpose: String,
    pub(super) created_at: i64,
    pub(super) bytes: Vec<u8>,
}

/// The files and batches the mock holds.
#[derive(Default)]
pub(super) struct Batches {
    store: Mutex<Store>,
}

#[derive(Default)]
pub(super) struct Store {
    pub(super) files: HashMap<String, File>,
    /// Oldest first.
    pub(super) batches: Vec<Batch>,
    /// Numbers the ids handed out.
    next: u64,
}

impl Store {
    /// A new id: `prefix` and a number no other id of this mock has.
    pub(super) fn id(&mut self, prefix: &str) -> String {
        self.next += 1;
        format!("{prefix}{:012}", self.next)
    }

    pub(super) fn batch(&mut self, id: &str) -> Option<&mut Batch> {
        self.batches.iter_mut().find(|b| b.id == id)
    }

    /// `kind`'s batches, newest first: `limit` of them after the batch
    /// `after` (from the newest without it), and whether more follow.
    pub(super) fn page(
        &self,
        kind: Kind,
        after: Option<&str>,
        limit: usize,
    ) -> (Vec<&Batch>, bool) {
        let newest_first = self.batches.iter().rev().filter(|b| b.kind == kind);
        let mut rest = newest_first.skip_while(|b| after.is_some_and(|a| a != b.id));
        if after.is_some() {
            rest.next();
        }
        let mut page: Vec<&Batch> = rest.take(limit + 1).collect();
        let more = page.len() > limit;
        page.truncate(limit);
        (page, more)
    }
}

impl Batches {
    pub(super) fn lock(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits the slow status of batch `id`, if it has one
    /// (`mock:slow_status`), before its status is read.
    pub(super) async fn slow_status(&self, id: &str) {
        let slow = self.lock().batch(id).and_then(|b| b.slow_status);
        if let Some(wait) = slow {
            tokio::time::sleep(wait).await;
        }
    }

    /// Moves a running batch of `kind`'s API to `Cancelling`; its runner
    /// ends it `Cancelled` after the line in hand. None when there is no such
    /// batch; whether it was running (or already cancelling).
    pub(super) fn cancel(&self, id: &str, kind: Kind) -> Option<bool> {
        let mut store = self.lock();
        let batch = store.batch(id).filter(|b| b.kind == kind)?;
        if batch.status != Status::InProgress {
            return Some(batch.status == Status::Cancelling);
        }
        batch.status = Status::Cancelling;
        batch.cancelling_at = Some(now());
        Some(true)
    }
}

/// Seconds since the epoch.
pub(super) fn now() -> i64 {
    chrono::Utc::now().timestamp()
}

/// The directives of every line's text, for the batch as a whole: the
/// slowest status read any line asks for. None when directives are off.
fn status_delay(lines: &[Line], options: &MockOptions) -> Option<Duration> {
    if !options.directives {
        return None;
    }
    lines
        .iter()
        .filter_map(|l| l.asked.as_ref().ok())
        .filter_map(|a| directives::directives(&a.text).slow_status)
        .max()
        .map(Duration::from_millis)
}

/// Runs batch `id`'s lines one after another, then ends it (and, with
/// `on_end`, writes what the batch's API keeps of its results).
pub(super) async fn run(
    batches: Arc<Batches>,
    stats: Arc<Stats>,
    options: MockOptions,
    id: String,
    lines: Vec<Line>,
    on_end: fn(&mut Store, &str),
) {
    let mut lines = lines.into_iter();
    let mut status = Status::Completed;
    while let Some(line) = lines.next() {
        if batches.lock().batch(&id).map(|b| b.status) != Some(Status::InProgress) {
            status = Status::Cancelled;
            end_rest(&batches, &id, line, lines, Ended::Cancelled);
            break;
        }
        let asked = match line.asked {
            Ok(asked) => asked,
            Err(why) => {
                record(&batches, &id, line.custom_id, Ended::Invalid(why), false);
                continue;
            }
        };
        let mut d = if options.directives {
            directives::directives(&asked.text)
        } else {
            Directives::default()
        };
        if d.expire {
            status = Status::Expired;
            let line = Line {
                custom_id: line.custom_id,
                asked: Ok(asked),
            };
            end_rest(&batches, &id, line, lines, Ended::Expired);
            break;
        }
        d.max_tokens = asked.max_tokens;
        let duplicate = d.duplicate;
        let n = stats.batch_work.fetch_add(1, Ordering::SeqCst) + 1;
        let mut outcome = answer::work(n, &options, d, &asked.text, &asked.user).await;
        if let Outcome::Answer(c) = &mut outcome {
            c["id"] = Value::String(format!("chatcmpl-mock-batch-{n}"));
        }
        record(
            &batches,
            &id,
            line.custom_id,
            Ended::Ran(outcome),
            duplicate,
        );
    }
    let mut store = batches.lock();
    if let Some(batch) = store.batch(&id) {
        batch.status = status;
        batch.ended_at = Some(now());
    }
    on_end(&mut store, &id);
}

/// Keeps how one line ended (twice, when it is to be duplicated).
fn record(batches: &Batches, id: &str, custom_id: String, ended: Ended, twice: bool) {
    if let Some(batch) = batches.lock().batch(id) {
        if twice {
            batch.results.push((custom_id.clone(), ended.clone()));
        }
        batch.results.push((custom_id, ended));
    }
}

/// Ends `line` and every line after it the same way, none of them run.
fn end_rest(
    batches: &Batches,
    id: &str,
    line: Line,
    rest: impl Iterator<Item = Line>,
    ended: Ended,
) {
    if let Some(batch) = batches.lock().batch(id) {
        for line in std::iter::once(line).chain(rest) {
            batch.results.push((line.custom_id, ended.clone()));
        }
    }
}
