//! A TCP path to a real service that a test can cut, stall and restore.

use std::sync::Arc;
use std::time::Duration;

/// A TCP path to a real service (Postgres, RabbitMQ) that a test can cut and
/// restore: cut, it drops every open connection and refuses new ones, as an
/// outage or a network partition would; stalled, it keeps the connections open
/// but carries no byte, as a hung peer would. The service itself is untouched,
/// so other tests running beside this one see no outage.
pub struct Cuttable {
    pub addr: std::net::SocketAddr,
    cut: Arc<std::sync::atomic::AtomicBool>,
    stalled: Arc<std::sync::atomic::AtomicBool>,
    held: Arc<std::sync::atomic::AtomicUsize>,
    refused: Arc<std::sync::atomic::AtomicUsize>,
    links: Arc<std::sync::Mutex<Vec<tokio::task::AbortHandle>>>,
    accept: tokio::task::JoinHandle<()>,
}

/// Copies `from` to `to` until either closes, holding each chunk while
/// `stalled` (and counting it in `held` once).
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    stalled: Arc<std::sync::atomic::AtomicBool>,
    held: Arc<std::sync::atomic::AtomicUsize>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if stalled.load(std::sync::atomic::Ordering::SeqCst) {
            held.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        while stalled.load(std::sync::atomic::Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

impl Cuttable {
    /// Starts forwarding a free local port to `target` (`host:port`).
    pub async fn to(target: &str) -> Cuttable {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let cut = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stalled = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let held = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let refused = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let links: Arc<std::sync::Mutex<Vec<tokio::task::AbortHandle>>> = Arc::default();
        let target = target.to_owned();
        let accept = {
            let (cut, stalled, links) = (cut.clone(), stalled.clone(), links.clone());
            let held = held.clone();
            let refused = refused.clone();
            tokio::spawn(async move {
                while let Ok((inbound, _)) = listener.accept().await {
                    if cut.load(std::sync::atomic::Ordering::SeqCst) {
                        drop(inbound);
                        refused.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        continue;
                    }
                    let Ok(outbound) = tokio::net::TcpStream::connect(&target).await else {
                        continue;
                    };
                    let (in_read, in_write) = inbound.into_split();
                    let (out_read, out_write) = outbound.into_split();
                    let mut open = links.lock().unwrap();
                    open.push(
                        tokio::spawn(pump(in_read, out_write, stalled.clone(), held.clone()))
                            .abort_handle(),
                    );
                    open.push(
                        tokio::spawn(pump(out_read, in_write, stalled.clone(), held.clone()))
                            .abort_handle(),
                    );
                }
            })
        };
        Cuttable {
            addr,
            cut,
            stalled,
            held,
            refused,
            links,
            accept,
        }
    }

    /// How many connections it has refused while cut so far: each one a
    /// client's try to reach the service.
    pub fn refused(&self) -> usize {
        self.refused.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// How many chunks of bytes it has held while stalled so far, either way:
    /// each one something a peer sent that the other has not had.
    pub fn held(&self) -> usize {
        self.held.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Drops every connection through it and refuses new ones.
    pub fn cut(&self) {
        self.cut.store(true, std::sync::atomic::Ordering::SeqCst);
        for link in self.links.lock().unwrap().drain(..) {
            link.abort();
        }
    }

    /// Keeps the connections open but carries nothing, until restored.
    pub fn stall(&self) {
        self.stalled
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Lets connections through again.
    pub fn restore(&self) {
        self.stalled
            .store(false, std::sync::atomic::Ordering::SeqCst);
        self.cut.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for Cuttable {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}
