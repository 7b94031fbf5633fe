//! Raw HTTP connections, for servers' limits on slow clients: a connection
//! that sends part of a request and stops, and what the server says on it
//! until it closes the connection.

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A raw connection to the server at `base` (`http://host:port`, or
/// `host:port`) that sends `head` and then nothing.
pub async fn stalled(base: &str, head: &str) -> TcpStream {
    let mut c = TcpStream::connect(base.trim_start_matches("http://"))
        .await
        .unwrap();
    c.write_all(head.as_bytes()).await.unwrap();
    c
}

/// Reads what the server says on `c` until it closes the connection (or the
/// connection fails).
pub async fn until_closed(c: &mut TcpStream) -> String {
    let mut all = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match c.read(&mut buf).await {
            Ok(0) | Err(_) => return String::from_utf8_lossy(&all).into_owned(),
            Ok(n) => all.extend_from_slice(&buf[..n]),
        }
    }
}
