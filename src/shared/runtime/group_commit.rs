//! Group commit: items submitted from many tasks share one statement, so a
//! burst costs one round trip, and a lone item never waits long.

use std::time::Duration;

/// A group commit: work handed in one item at a time is done by `flush` in
/// batches. A flush starts at once when no other is running; while one is,
/// items gather, and the next flush starts when the first of them has waited
/// `interval`, when `size` of them are waiting, or when the running flush is
/// done (at most [`GroupCommit::IN_FLIGHT`] run at once). So a lone item never
/// waits for company, and under load each flush carries every item that arrived
/// during the one before.
pub(crate) struct GroupCommit<T, R> {
    items: tokio::sync::mpsc::UnboundedSender<Submitted<T, R>>,
}

/// An item handed in: when, and where its answer goes.
type Submitted<T, R> = (T, std::time::Instant, tokio::sync::oneshot::Sender<R>);

/// The stages a [`GroupCommit`] times (see [`crate::edges::metrics::STAGE_SECONDS`]):
/// an item's wait for its flush, and the flush.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Stages {
    pub wait: &'static str,
    pub flush: &'static str,
}

/// What becomes of an answer whose submitter stopped waiting while its flush
/// ran (its handler cut off at the end of a stop): the flush did its work,
/// and this undoes what must not be left behind (a claim is handed back).
/// The group commit waits for it before it ends.
pub(crate) type Unheard<R> = std::sync::Arc<
    dyn Fn(R) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> + Send + Sync,
>;

/// What a [`GroupCommit`] does with an item whose submitter stopped waiting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Abandoned {
    /// Leave it out of the flush.
    Skip,
    /// Flush it all the same.
    Flush,
}

impl<T, R> Clone for GroupCommit<T, R> {
    fn clone(&self) -> Self {
        Self {
            items: self.items.clone(),
        }
    }
}

impl<T: Send + 'static, R: Send + 'static> GroupCommit<T, R> {
    /// Flushes running at once.
    pub(crate) const IN_FLIGHT: usize = 4;

    /// Starts the task that flushes. `flush` answers each item of its batch, in
    /// order; an answer nobody waits for any more goes to `unheard`, if
    /// given. The task ends once every handle is dropped and what they handed
    /// in is flushed.
    pub(crate) fn start<F, Fut>(
        stages: Stages,
        size: usize,
        interval: Duration,
        (abandoned, unheard): (Abandoned, Option<Unheard<R>>),
        flush: F,
    ) -> (tokio::task::JoinHandle<()>, Self)
    where
        F: Fn(Vec<T>) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Vec<R>> + Send + 'static,
    {
        let (items, pending) = tokio::sync::mpsc::unbounded_channel();
        let task = tokio::spawn(group_commit(
            stages,
            size.max(1),
            interval,
            (abandoned, unheard),
            pending,
            flush,
        ));
        (task, Self { items })
    }

    /// Hands in `item` and waits for its answer; `None` when the flush that took
    /// it did not finish (the task stopped).
    pub(crate) async fn submit(&self, item: T) -> Option<R> {
        let (answer, answered) = tokio::sync::oneshot::channel();
        self.items
            .send((item, std::time::Instant::now(), answer))
            .ok()?;
        answered.await.ok()
    }
}

async fn group_commit<T, R, F, Fut>(
    stages: Stages,
    size: usize,
    interval: Duration,
    (abandoned, unheard): (Abandoned, Option<Unheard<R>>),
    mut pending: tokio::sync::mpsc::UnboundedReceiver<Submitted<T, R>>,
    flush: F,
) where
    T: Send + 'static,
    R: Send + 'static,
    F: Fn(Vec<T>) -> Fut,
    Fut: std::future::Future<Output = Vec<R>> + Send + 'static,
{
    use tokio::time::Instant;
    let in_flight_max = GroupCommit::<T, R>::IN_FLIGHT;
    let mut flushes = tokio::task::JoinSet::new();
    let mut batch = Vec::new();
    let mut due: Option<Instant> = None;
    let mut open = true;
    loop {
        let overdue = due.is_some_and(|d| d <= Instant::now());
        if !batch.is_empty()
            && flushes.len() < in_flight_max
            && (flushes.is_empty() || batch.len() >= size || overdue)
        {
            let mut take: Vec<Submitted<T, R>> = std::mem::take(&mut batch);
            if abandoned == Abandoned::Skip {
                take.retain(|(_, _, answer)| !answer.is_closed());
                if take.is_empty() {
                    due = None;
                    continue;
                }
            }
            let mut items = Vec::with_capacity(take.len());
            let mut answers = Vec::with_capacity(take.len());
            for (item, submitted, answer) in take {
                crate::edges::metrics::stage(stages.wait, submitted.elapsed());
                items.push(item);
                answers.push(answer);
            }
            let done = crate::edges::metrics::timed(stages.flush, flush(items));
            let unheard = unheard.clone();
            flushes.spawn(async move {
                for (answer, result) in answers.into_iter().zip(done.await) {
                    if let (Err(result), Some(unheard)) = (answer.send(result), &unheard) {
                        unheard(result).await;
                    }
                }
            });
            due = None;
            continue;
        }
        if !open && batch.is_empty() {
            break;
        }
        tokio::select! {
            next = pending.recv(), if open && batch.len() < size => match next {
                Some(first) => {
                    due.get_or_insert_with(|| Instant::now() + interval);
                    batch.push(first);
                    while batch.len() < size {
                        match pending.try_recv() {
                            Ok(next) => batch.push(next),
                            Err(_) => break,
                        }
                    }
                }
                None => open = false,
            },
            Some(_) = flushes.join_next(), if !flushes.is_empty() => {}
            () = tokio::time::sleep_until(due.unwrap_or_else(Instant::now)),
                if due.is_some() && !overdue && flushes.len() < in_flight_max => {}
        }
    }
    while flushes.join_next().await.is_some() {}
}
