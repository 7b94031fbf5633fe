//! A port that refuses every connection, for as long as the test holds it.

/// A TCP port on 127.0.0.1 bound by this test but never listened on: a
/// connection to it is refused at once. Binding a port and dropping it at once
/// does not do this: another test's listener, or a client's ephemeral port, can
/// take the freed port, and the "refusing" provider then answers or hangs.
/// Holding the bound socket keeps the port out of everyone else's reach.
pub struct RefusingPort {
    socket: tokio::net::TcpSocket,
    pub port: u16,
}

impl RefusingPort {
    pub fn new() -> Self {
        let socket = tokio::net::TcpSocket::new_v4().expect("a TCP socket");
        socket
            .bind("127.0.0.1:0".parse().unwrap())
            .expect("bind a port on 127.0.0.1");
        let port = socket.local_addr().expect("its address").port();
        Self { socket, port }
    }

    /// A provider base URL on this port.
    pub fn provider_url(&self) -> String {
        format!("http://127.0.0.1:{}/v1", self.port)
    }
}

impl Default for RefusingPort {
    fn default() -> Self {
        Self::new()
    }
}
