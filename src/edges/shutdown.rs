//! A small shutdown signal: one trigger, many listeners, and a way for listeners
//! that start late to see it was already given.

use std::sync::Arc;

use tokio::sync::watch;

/// Cloneable shutdown signal.
#[derive(Clone, Debug)]
pub struct Shutdown {
    tx: Arc<watch::Sender<bool>>,
    rx: watch::Receiver<bool>,
}

impl Default for Shutdown {
    fn default() -> Self {
        Self::new()
    }
}

impl Shutdown {
    /// A signal not yet given.
    pub fn new() -> Shutdown {
        let (tx, rx) = watch::channel(false);
        Shutdown {
            tx: Arc::new(tx),
            rx,
        }
    }

    /// Gives the signal to every clone.
    pub fn trigger(&self) {
        self.tx.send_replace(true);
    }

    /// Whether the signal was given.
    pub fn is_triggered(&self) -> bool {
        *self.rx.borrow()
    }

    /// Resolves once the signal is given (at once if it already was).
    pub async fn wait(&self) {
        let mut rx = self.rx.clone();
        // An error means every sender is gone, which only happens at teardown.
        let _ = rx.wait_for(|given| *given).await;
    }
}

/// Resolves on SIGTERM (what an orchestrator sends) or Ctrl-C.
pub async fn wait_for_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
