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
//! Nothing of this crate's is re-exported under a flatter name: an import
//! path says where a module lives (`crate::shared::runtime` is
//! `src/shared/runtime/`). Imports go one way, down these layers;
//! `tests/layering.rs` holds the same table and fails the build on an upward
//! import, a cycle, a module with no layer, or a module other than the fleet
//! that names a role:
//!
//! | layer | modules |
//! |---|---|
//! | operator CLI | [`operator::cli`] (the `onejob` command, the console's among them) |
//! | composition | [`fleet`] (the one module that names the roles: start, supervise, stop) · [`operator::console`] (the operator console: HTML over the store) |
//! | roles | [`roles::intake`] · `roles::attempts` · `roles::reconciler` (one maintenance pass per function, each a bounded batch) |
//! | shared by the roles | [`shared::runtime`] (context, consume, ack, retries, health) · `shared::policy` (what follows a failure: planned once) · `shared::qualify` · `shared::evidence` (one look at an unknown's evidence) · `shared::handed_on` (settlements handed on through the broker) · [`shared::dlq`] |
//! | edges | [`store`] (all SQL, one file per aggregate) · `shared::provider` (HTTP to providers: one transport, a wire format per kind) · [`shared::metrics`] · `shared::gauges` (the table gauges, read by a timer) · [`shared::telemetry`] (logs, and spans over OTLP) |
//! | core | [`broker`] (AMQP topology, confirms, dead letters) · [`shared::config`] · [`shared::token`] · [`intent`] (parsing, fingerprint, receipts) · [`trace`] (W3C trace context) · [`domain`] (ids, states, transitions, the route rule: pure) |
//! | apart | [`mock`] (the bundled provider) · [`shared::shutdown`] · [`shared::http`] (serving untrusted clients) · `operator::terminal` (plain output, escaped) · `operator::throttle` (a per-client allowance) |
//!
//! The core crate's modules ([`broker`], [`domain`], [`intent`], [`trace`])
//! are re-exported whole, under the names they have there: they are another
//! crate's, which a producer uses without this one.
//!
//! # Public surface
//!
//! Modules are private unless a binary or a black-box test needs them: `attempts`,
//! `reconciler`, `policy`, `qualify`, `evidence`, `handed_on`, `provider`, `gauges`,
//! `terminal` and `throttle` are internal. [`fleet::run`]
//! starts the roles; [`store::Store`] is the one seam to Postgres; [`operator::cli::main`] is
//! the operator CLI; [`roles::intake::validate`] and [`roles::intake::admit_rows`] are public so
//! that tests drive admission without a broker; [`shared::dlq::describe`] reads a dead
//! letter as the CLI lists it.

pub use onejob_core::{broker, domain, intent, trace};

pub mod fleet;
pub mod mock;
pub mod operator;
pub mod roles;
pub mod shared;
pub mod store;
