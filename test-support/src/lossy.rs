//! A TCP path to the real Postgres that loses replies: every `every`-th reply
//! to a statement that took effect (the server committed it and is idle
//! again) is withheld and the connection reset, as when a network path or a
//! proxy drops a connection just after the server ran a statement. The client
//! never hears; the database holds the change. Postgres itself is untouched,
//! so tests running beside this one see nothing.
//!
//! Server messages are framed (a type byte and a length). The proxy buffers a
//! reply until its `ReadyForQuery`: when that says idle (`I`) and the reply
//! carries a `CommandComplete`, the statement committed, and this reply may be
//! the one lost. Connect with `sslmode=disable` so that the stream is framed
//! from the first byte.
//!
//! It reads the client's messages too (`Query`, and `Parse` and `Bind` of
//! prepared statements), so that it can say what each lost reply was to: the
//! statements run since the connection was last idle, the whole transaction
//! for a lost `COMMIT` ([`LossyPostgres::lost_statements`]).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub struct LossyPostgres {
    pub addr: SocketAddr,
    /// Whether the path is down: when it goes down every connection through
    /// it is cut, and new ones are closed at once, until it is up again.
    down: tokio::sync::watch::Sender<bool>,
    lost: Arc<AtomicU64>,
    losing: Arc<AtomicBool>,
    next_commit: Arc<AtomicBool>,
    lost_statements: Arc<Mutex<Vec<Vec<String>>>>,
    accept: tokio::task::JoinHandle<()>,
}

/// What the proxy shares between its connections.
struct Rule {
    every: u64,
    max: u64,
    committed: AtomicU64,
    lost: Arc<AtomicU64>,
    losing: Arc<AtomicBool>,
    next_commit: Arc<AtomicBool>,
    /// The statements each lost reply answered.
    lost_statements: Arc<Mutex<Vec<Vec<String>>>>,
}

impl Rule {
    /// Whether this committed reply is the one to lose; `commit` when it
    /// ends an explicit transaction (`COMMIT`).
    fn lose(&self, commit: bool) -> bool {
        if commit && self.next_commit.swap(false, Ordering::SeqCst) {
            self.lost.fetch_add(1, Ordering::SeqCst);
            return true;
        }
        if !self.losing.load(Ordering::SeqCst) {
            return false;
        }
        let n = self.committed.fetch_add(1, Ordering::SeqCst) + 1;
        if !n.is_multiple_of(self.every) {
            return false;
        }
        let lost = self.lost.fetch_add(1, Ordering::SeqCst);
        if lost >= self.max {
            self.lost.fetch_sub(1, Ordering::SeqCst);
            return false;
        }
        true
    }
}

impl LossyPostgres {
    /// Forwards a free local port to `target` (`host:port`), losing one in
    /// `every` committed replies, `max` in all, once [`LossyPostgres::start_losing`].
    pub async fn to(target: &str, every: u64, max: u64) -> LossyPostgres {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let lost = Arc::new(AtomicU64::new(0));
        let losing = Arc::new(AtomicBool::new(false));
        let next_commit = Arc::new(AtomicBool::new(false));
        let lost_statements = Arc::new(Mutex::new(Vec::new()));
        let rule = Arc::new(Rule {
            every: every.max(1),
            max,
            committed: AtomicU64::new(0),
            lost: lost.clone(),
            losing: losing.clone(),
            next_commit: next_commit.clone(),
            lost_statements: lost_statements.clone(),
        });
        let target = target.to_owned();
        let (down, watch) = tokio::sync::watch::channel(false);
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if *watch.borrow() {
                    drop(client);
                    continue;
                }
                let Ok(server) = TcpStream::connect(&target).await else {
                    continue;
                };
                let (rule, mut watch) = (rule.clone(), watch.clone());
                tokio::spawn(async move {
                    tokio::select! {
                        () = link(client, server, rule) => {}
                        _ = watch.wait_for(|down| *down) => {}
                    }
                });
            }
        });
        LossyPostgres {
            addr,
            down,
            lost,
            losing,
            next_commit,
            lost_statements,
            accept,
        }
    }

    /// What each lost reply answered: the statements run on its connection
    /// since it was last idle (for a lost `COMMIT`, its whole transaction).
    pub fn lost_statements(&self) -> Vec<Vec<String>> {
        self.lost_statements.lock().unwrap().clone()
    }

    /// A URL to database `db` through this proxy.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@{}/{db}?sslmode=disable", self.addr)
    }

    /// How many replies it has lost.
    pub fn lost(&self) -> u64 {
        self.lost.load(Ordering::SeqCst)
    }

    /// Loses replies from now on.
    pub fn start_losing(&self) {
        self.losing.store(true, Ordering::SeqCst);
    }

    /// Loses the reply to the next `COMMIT` (once).
    pub fn lose_next_commit(&self) {
        self.next_commit.store(true, Ordering::SeqCst);
    }

    /// Loses nothing from now on.
    pub fn stop_losing(&self) {
        self.losing.store(false, Ordering::SeqCst);
    }

    /// Postgres is unreachable through this path from now on, as in an
    /// outage: every connection is cut and new ones are closed at once.
    pub fn go_down(&self) {
        self.down.send_replace(true);
    }

    /// Postgres is reachable again.
    pub fn come_up(&self) {
        self.down.send_replace(false);
    }
}

impl Drop for LossyPostgres {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// One client connection: requests pass as they are; replies pass a whole
/// reply at a time, or the connection is reset instead.
async fn link(client: TcpStream, server: TcpStream, rule: Arc<Rule>) {
    let (client_read, mut client_write) = client.into_split();
    let (mut server_read, server_write) = server.into_split();
    let since_idle = Arc::new(Mutex::new(Vec::new()));
    let requests = tokio::spawn(requests(client_read, server_write, since_idle.clone()));
    let mut pending: Vec<u8> = Vec::new();
    let mut reply: Vec<u8> = Vec::new();
    let mut completed = false;
    let mut commit = false;
    let mut buf = vec![0u8; 64 * 1024];
    'read: loop {
        let n = match server_read.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        pending.extend_from_slice(&buf[..n]);
        // Whole messages only: a type byte, then a length that counts itself.
        while pending.len() >= 5 {
            let len = u32::from_be_bytes([pending[1], pending[2], pending[3], pending[4]]) as usize;
            if pending.len() < 1 + len {
                break;
            }
            let message: Vec<u8> = pending.drain(..1 + len).collect();
            match message[0] {
                b'C' => {
                    completed = true;
                    commit |= message[5..].starts_with(b"COMMIT");
                }
                b'Z' => {
                    let idle = message.get(5) == Some(&b'I');
                    reply.extend_from_slice(&message);
                    // Taken before the reply goes: the client's next
                    // statement follows it.
                    let answered = if idle {
                        std::mem::take(&mut *since_idle.lock().unwrap())
                    } else {
                        Vec::new()
                    };
                    if idle && completed && rule.lose(commit) {
                        rule.lost_statements.lock().unwrap().push(answered);
                        break 'read;
                    }
                    if client_write.write_all(&reply).await.is_err() {
                        break 'read;
                    }
                    reply.clear();
                    completed = false;
                    commit = false;
                    continue;
                }
                _ => {}
            }
            reply.extend_from_slice(&message);
        }
    }
    requests.abort();
    let _ = client_write.shutdown().await;
}

/// Passes the client's bytes on as they come, and notes the text of each
/// statement it runs (`Query`; `Bind` of a statement its `Parse` named) in
/// `since_idle`. The first message is the startup message, which has no
/// type byte.
async fn requests(
    mut client: tokio::net::tcp::OwnedReadHalf,
    mut server: tokio::net::tcp::OwnedWriteHalf,
    since_idle: Arc<Mutex<Vec<String>>>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut pending: Vec<u8> = Vec::new();
    let mut started = false;
    let mut prepared: HashMap<String, String> = HashMap::new();
    loop {
        let n = match client.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if server.write_all(&buf[..n]).await.is_err() {
            return;
        }
        pending.extend_from_slice(&buf[..n]);
        loop {
            let (at, len) = if started { (1, 1) } else { (0, 0) };
            if pending.len() < at + 4 {
                break;
            }
            let size = u32::from_be_bytes([
                pending[at],
                pending[at + 1],
                pending[at + 2],
                pending[at + 3],
            ]) as usize;
            if pending.len() < len + size {
                break;
            }
            let message: Vec<u8> = pending.drain(..len + size).collect();
            if !started {
                started = true;
                continue;
            }
            let body = &message[5..];
            match message[0] {
                b'Q' => since_idle.lock().unwrap().push(text_at(body, 0).0),
                b'P' => {
                    let (name, next) = text_at(body, 0);
                    prepared.insert(name, text_at(body, next).0);
                }
                b'B' => {
                    let (_portal, next) = text_at(body, 0);
                    if let Some(query) = prepared.get(&text_at(body, next).0) {
                        since_idle.lock().unwrap().push(query.clone());
                    }
                }
                _ => {}
            }
        }
    }
}

/// The NUL-terminated string at `at` in `body`, and where the next begins.
fn text_at(body: &[u8], at: usize) -> (String, usize) {
    let rest = body.get(at..).unwrap_or_default();
    let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
    (
        String::from_utf8_lossy(&rest[..end]).into_owned(),
        at + end + 1,
    )
}
