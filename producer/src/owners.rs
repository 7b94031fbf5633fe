//! What each owner holds at the gateway: its requests in flight and the bytes
//! they declare. One owner's slow or many requests fill its own share, never
//! the gateway's, so that every other owner is still served.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The shares of every owner seen, each made on first use.
#[derive(Debug)]
pub(crate) struct Owners {
    requests: usize,
    bytes: usize,
    shares: Mutex<HashMap<String, Arc<Share>>>,
}

#[derive(Debug)]
struct Share {
    requests: Arc<Semaphore>,
    bytes: Arc<Semaphore>,
}

/// What one request holds of its owner's share, given back when it is dropped.
#[derive(Debug)]
pub(crate) struct Held {
    _request: OwnedSemaphorePermit,
    _bytes: OwnedSemaphorePermit,
}

/// Why a request was refused: its owner holds too much already.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// As many requests as an owner may have in flight.
    Requests,
    /// As many bytes as an owner may have in flight.
    Bytes,
}

impl Refusal {
    /// The metric's label.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Refusal::Requests => "requests_in_flight",
            Refusal::Bytes => "bytes_in_flight",
        }
    }
}

impl Owners {
    /// Shares of `requests` requests and `bytes` bytes per owner.
    pub(crate) fn new(requests: usize, bytes: usize) -> Owners {
        Owners {
            requests: requests.max(1),
            bytes: bytes.clamp(1, u32::MAX as usize),
            shares: Mutex::new(HashMap::new()),
        }
    }

    /// Takes a place for one request of `owner` that declares `bytes`, or
    /// says why not. Never waits.
    pub(crate) fn take(&self, owner: &str, bytes: usize) -> Result<Held, Refusal> {
        let share = {
            let mut shares = self.shares.lock().unwrap_or_else(|e| e.into_inner());
            shares
                .entry(owner.to_owned())
                .or_insert_with(|| {
                    Arc::new(Share {
                        requests: Arc::new(Semaphore::new(self.requests)),
                        bytes: Arc::new(Semaphore::new(self.bytes)),
                    })
                })
                .clone()
        };
        let request = share
            .requests
            .clone()
            .try_acquire_owned()
            .map_err(|_| Refusal::Requests)?;
        if bytes > self.bytes {
            return Err(Refusal::Bytes);
        }
        let bytes = u32::try_from(bytes.max(1)).unwrap_or(u32::MAX);
        let bytes = share
            .bytes
            .clone()
            .try_acquire_many_owned(bytes)
            .map_err(|_| Refusal::Bytes)?;
        onejob::edges::metrics::gateway_in_flight(1.0);
        Ok(Held {
            _request: request,
            _bytes: bytes,
        })
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        onejob::edges::metrics::gateway_in_flight(-1.0);
    }
}
