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
//! reach all of it in-process. Its folders read like the design's picture:
//!
//! ```text
//! src/fleet.rs     composition: starts, supervises and stops the roles (the one place that names them)
//! src/roles/       what a pod runs: intake, attempts, reconciler
//! src/operator/    the operator's tools: cli, console (and their terminal escaping, throttle)
//! src/shared/      what roles and tools share: runtime, policy, qualify, evidence, handed_on, dlq, provider,
//!                  metrics, gauges, config, token, http, shutdown, telemetry
//! src/store/       all SQL, one file per aggregate: the one seam to Postgres
//! src/mock/        the bundled mock provider, in both kinds' wire formats (not part of a pod)
//! ```
//!
//! Each module is re-exported here under its own name (`crate::runtime` is
//! `src/shared/runtime/`). Imports go one way, down these layers;
//! `tests/layering.rs` holds the same table and fails the build on an upward
//! import, a cycle, a module with no layer, or a module other than the fleet
//! that names a role:
//!
//! | layer | modules |
//! |---|---|
//! | operator CLI | [`cli`] (the `onejob` command, the console's among them) |
//! | composition | [`fleet`] (the one module that names the roles: start, supervise, stop) · [`console`] (the operator console: HTML over the store) |
//! | roles | [`intake`] · `attempts` · `reconciler` (one maintenance pass per function, each a bounded batch) |
//! | shared by the roles | [`runtime`] (context, consume, ack, retries, health) · `policy` (what follows a failure: planned once) · `qualify` · `evidence` (one look at an unknown's evidence) · `handed_on` (settlements handed on through the broker) · [`dlq`] |
//! | edges | [`store`] (all SQL, one file per aggregate) · `provider` (HTTP to providers: one transport, a wire format per kind) · [`metrics`] · `gauges` (the table gauges, read by a timer) · [`telemetry`] (logs, and spans over OTLP) |
//! | core | [`broker`] (AMQP topology, confirms, dead letters) · [`config`] · [`token`] · [`intent`] (parsing, fingerprint, receipts) · [`trace`] (W3C trace context) · [`domain`] (ids, states, transitions, the route rule: pure) |
//! | apart | [`mock`] (the bundled provider) · [`shutdown`] · [`http`] (serving untrusted clients) · `terminal` (plain output, escaped) · `throttle` (a per-client allowance) |
//!
//! # Public surface
//!
//! Modules are private unless a binary or a black-box test needs them: `attempts`,
//! `reconciler`, `policy`, `qualify`, `evidence`, `handed_on`, `provider`, `gauges`,
//! `terminal` and `throttle` are internal. [`fleet::run`]
//! starts the roles; [`store::Store`] is the one seam to Postgres; [`cli::main`] is
//! the operator CLI; [`intake::validate`] and [`intake::admit_rows`] are public so
//! that tests drive admission without a broker; [`dlq::describe`] reads a dead
//! letter as the CLI lists it.

pub use onejob_core::{broker, domain, intent, trace};

pub mod fleet;
pub mod mock;
mod operator;
mod roles;
mod shared;
pub mod store;

pub use operator::{cli, console};
pub(crate) use operator::{terminal, throttle};
pub use roles::intake;
pub(crate) use roles::{attempts, reconciler};
pub use shared::{config, dlq, http, metrics, runtime, shutdown, telemetry, token};
pub(crate) use shared::{evidence, gauges, handed_on, policy, provider, qualify};
