//! Retries: an outage is waited out until shutdown; other failures are
//! retried a bounded number of times.

use super::*;
use crate::edges::shutdown::Shutdown;

fn unreachable() -> Result<()> {
    Err(WorkerError::Store(StoreError::Db(
        sqlx::Error::PoolTimedOut,
    )))
}

/// Item 4 of issue 8: an outage longer than any retry window (here ten
/// minutes, on tokio's paused clock) never makes `with_retries` give the work
/// back; shutdown does, at once.
#[tokio::test(start_paused = true)]
async fn an_outage_is_waited_out_until_shutdown() {
    let shutdown = Shutdown::new();
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let task = {
        let (shutdown, calls) = (shutdown.clone(), calls.clone());
        tokio::spawn(async move {
            with_retries(&shutdown, "test", || {
                calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                async { unreachable() }
            })
            .await
        })
    };
    tokio::time::sleep(Duration::from_secs(600)).await;
    assert!(!task.is_finished(), "gave up during the outage");
    assert!(
        calls.load(std::sync::atomic::Ordering::SeqCst) > 60,
        "kept trying"
    );
    shutdown.trigger();
    let result = tokio::time::timeout(Duration::from_millis(10), task)
        .await
        .expect("returns at once on shutdown")
        .unwrap();
    assert!(result.is_err());
}

/// Other failures are still bounded: a poison message does not spin forever.
#[tokio::test(start_paused = true)]
async fn other_failures_are_retried_a_bounded_number_of_times() {
    let calls = std::sync::atomic::AtomicU32::new(0);
    let result: Result<()> = with_retries(&Shutdown::new(), "test", || {
        calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        async { Err(WorkerError::RoleStopped("x".into(), "y".into())) }
    })
    .await;
    assert!(result.is_err());
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 16);
}

/// An answer whose submitter stopped waiting while its flush ran (a handler
/// cut off at the end of a stop) is not dropped: it goes to the group
/// commit's `unheard`, which the group commit waits for before it ends (the
/// claims hand such a claim back). Answers still waited for are not.
#[tokio::test(start_paused = true)]
async fn an_answer_nobody_waits_for_goes_to_unheard() {
    let heard = Arc::new(std::sync::Mutex::new(Vec::new()));
    let kept = heard.clone();
    let unheard: Unheard<u32> = Arc::new(move |answer| {
        let kept = kept.clone();
        Box::pin(async move {
            kept.lock().unwrap().push(answer);
        })
    });
    let (task, commit) = GroupCommit::start(
        Stages {
            wait: "test_wait",
            flush: "test",
        },
        10,
        Duration::from_millis(1),
        (Abandoned::Skip, Some(unheard)),
        |items: Vec<u32>| async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            items.into_iter().map(|i| i * 10).collect()
        },
    );
    let (waited, cut_off) = tokio::join!(
        commit.submit(1),
        tokio::time::timeout(Duration::from_millis(50), commit.submit(2)),
    );
    assert_eq!(waited, Some(10));
    assert!(cut_off.is_err(), "cut off mid-flush");
    drop(commit);
    task.await.unwrap();
    assert_eq!(*heard.lock().unwrap(), vec![20]);
}
