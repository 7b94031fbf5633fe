//! A per-client allowance of attempts (the console's sign-in): each client
//! may make `per_minute` attempts in a burst, and earns one back every
//! `60 / per_minute` seconds. An attempt past the allowance is refused before
//! any work is done for it.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The most clients remembered at once; past it, those whose allowance is
/// whole again are forgotten first.
const CLIENTS: usize = 10_000;

/// Attempts allowed per client.
pub(crate) struct Throttle {
    per_minute: f64,
    clients: Mutex<HashMap<IpAddr, (f64, Instant)>>,
}

impl Throttle {
    /// `per_minute` attempts a minute per client (at least one).
    pub(crate) fn new(per_minute: u32) -> Throttle {
        Throttle {
            per_minute: f64::from(per_minute.max(1)),
            clients: Mutex::new(HashMap::new()),
        }
    }

    /// Takes one attempt of `client`'s allowance, or says how long until it
    /// has one.
    pub(crate) fn take(&self, client: IpAddr) -> Result<(), Duration> {
        let now = Instant::now();
        let mut clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        if clients.len() >= CLIENTS && !clients.contains_key(&client) {
            let per_minute = self.per_minute;
            clients.retain(|_, (left, at)| {
                (*left + at.elapsed().as_secs_f64() * per_minute / 60.0) < per_minute
            });
            if clients.len() >= CLIENTS {
                // Every remembered client is mid-burst: refuse newcomers
                // rather than forget one.
                return Err(Duration::from_secs(60));
            }
        }
        let (left, at) = clients.entry(client).or_insert((self.per_minute, now));
        let earned = now.duration_since(*at).as_secs_f64() * self.per_minute / 60.0;
        *left = (*left + earned).min(self.per_minute);
        *at = now;
        if *left >= 1.0 {
            *left -= 1.0;
            Ok(())
        } else {
            let wait = (1.0 - *left) * 60.0 / self.per_minute;
            Err(Duration::from_secs_f64(wait))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_then_refusals_per_client() {
        let t = Throttle::new(3);
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        for _ in 0..3 {
            assert!(t.take(a).is_ok());
        }
        let wait = t.take(a).unwrap_err();
        assert!(
            wait <= Duration::from_secs(20) && wait > Duration::ZERO,
            "{wait:?}"
        );
        assert!(t.take(b).is_ok(), "another client has its own allowance");
    }
}
