//! The broker connection's recovery: what is in flight when the connection is
//! lost does not keep it from coming back.

use std::sync::Arc;
use std::time::Duration;

use crate::common::{TestEnv, config, config_text, wait_for};

/// How many times the connection is lost with a channel being opened.
const ROUNDS: usize = 20;

/// A channel being opened when the connection is lost: recovery opens it
/// again, and the connection goes on working. lapin 4.12.3 deadlocked its I/O
/// loop here for good (finalizing the channel's recovery dropped the opening's
/// handle while it held the channel's status lock, and the handle's drop took
/// that lock again): the worker froze holding its deliveries, and its runtime
/// could not even shut down. The patched copy in `vendor/lapin` lets the lock
/// go first. The rounds run on a runtime of their own, so that a deadlock fails
/// this test instead of hanging it.
#[test]
fn a_channel_opening_when_the_connection_is_lost_does_not_freeze_it() {
    let (done, outcome) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a runtime");
        runtime.block_on(async move {
            lose_the_connection_while_opening().await;
            let _ = done.send(());
        });
    });
    match outcome.recv_timeout(Duration::from_secs(150)) {
        Ok(()) => {}
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!(
            "the connection froze: a channel opening when it was lost kept it from coming back"
        ),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            panic!("the rounds failed (their panic is above)")
        }
    }
}

/// [`ROUNDS`] times, each on a connection of its own: a channel's opening is
/// held on its way to the broker, the connection is cut under it, and a
/// channel must open once it is back.
async fn lose_the_connection_while_opening() {
    onejob::edges::telemetry::init_quiet();
    let (config, _file) = config(&config_text("http://127.0.0.1:9/v1", None, ""));
    let env = TestEnv::new(&config).await;
    let (path, url) = super::broker_faults::broker_path(&env).await;
    for round in 0..ROUNDS {
        let conn = Arc::new(
            onejob::broker::connect(&url, onejob::broker::Recovery::Auto)
                .await
                .expect("connect"),
        );
        path.stall();
        let held = path.held();
        let opening = tokio::spawn({
            let conn = conn.clone();
            async move { conn.create_channel().await.map(|_| ()) }
        });
        wait_for(
            "the channel's opening to be on its way",
            Duration::from_secs(10),
            || async { (path.held() > held).then_some(()) },
        )
        .await;
        path.cut();
        path.restore();
        // However the opening ends (an error, or the channel once recovered),
        // it ends,
        let _ = tokio::time::timeout(Duration::from_secs(30), opening)
            .await
            .unwrap_or_else(|_| panic!("round {round}: the opening never ended"));
        // and the connection is back: a new channel opens.
        wait_for(
            &format!("round {round}: a channel to open once the connection is back"),
            Duration::from_secs(60),
            || async {
                let opened = tokio::time::timeout(Duration::from_secs(5), conn.create_channel());
                opened.await.ok()?.ok().map(|_| ())
            },
        )
        .await;
        let _ = conn.close(200, "round over".into()).await;
    }
}
