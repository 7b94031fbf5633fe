//! onejob turns each user intention into exactly one durable job, however often it
//! is retried, redelivered or failed over.
//!
//! # Layout
//!
//! The workspace has four crates:
//!
//! | crate | holds |
//! |---|---|
//! | `onejob-core` (`core/`) | what a producer needs too: [`domain`], [`intent`], [`broker`]; no database, no HTTP server |
//! | `onejob` (this one) | the worker's library, the `onejob` operator CLI and the mock provider |
//! | `onejob-worker` (`worker/`) | the worker pod's binary, thin over [`fleet`] |
//! | `onejob-producer` (`producer/`) | the client library services embed (lapin, serde, uuid: no sqlx, no axum without its `gateway` feature), its CLI and the HTTP gateway |
//!
//! This library holds everything the binaries share; binaries stay thin so tests
//! reach all of it in-process. Imports go one way, down these layers;
//! `tests/layering.rs` holds the same table and fails the build on an upward
//! import, a cycle, or a module with no layer:
//!
//! | layer | modules |
//! |---|---|
//! | operator CLI | [`cli`] (the `onejob` command, the console's among them) |
//! | composition | [`fleet`] (the one module that names the roles: start, supervise, stop) · [`console`] (the operator console: HTML over the store) |
//! | roles | [`intake`] · `attempts` · `reconciler` (one maintenance pass per function, each a bounded batch) |
//! | shared by the roles | [`runtime`] (context, consume, ack, retries, health) · `policy` (what follows a failure: planned once) · `qualify` · [`dlq`] |
//! | edges | [`store`] (all SQL, one file per aggregate) · `provider` (HTTP to providers) · [`metrics`] · `gauges` (the table gauges, read by a timer) |
//! | core | [`broker`] (AMQP topology, confirms, dead letters) · [`config`] · [`token`] · [`intent`] (parsing, fingerprint, receipts) · [`domain`] (ids, states, transitions, the route rule: pure) |
//! | apart | [`mock`] (the bundled provider) · [`shutdown`] · [`telemetry`] · [`http`] (serving untrusted clients) · `terminal` (plain output, escaped) · `throttle` (a per-client allowance) |
//!
//! # Public surface
//!
//! Modules are private unless a binary or a black-box test needs them: `attempts`,
//! `reconciler`, `policy`, `qualify` and `provider` are internal. [`fleet::run`]
//! starts the roles; [`store::Store`] is the one seam to Postgres; [`cli::run`] is
//! the operator CLI; [`intake::validate`] and [`intake::admit_rows`] are public so
//! that tests drive admission without a broker; [`dlq::describe`] reads a dead
//! letter as the CLI lists it.

pub use onejob_core::{broker, domain, intent};

mod attempts;
pub mod cli;
pub mod config;
pub mod console;
pub mod dlq;
pub mod fleet;
mod gauges;
pub mod http;
pub mod intake;
pub mod metrics;
pub mod mock;
mod policy;
mod provider;
mod qualify;
mod reconciler;
pub mod runtime;
pub mod shutdown;
pub mod store;
pub mod telemetry;
mod terminal;
mod throttle;
pub mod token;
