//! onejob turns each user intention into exactly one durable job, however often it
//! is retried, redelivered or failed over.
//!
//! # Layout
//!
//! The workspace's crates: `onejob-core` (`core/`: what a producer needs too:
//! [`domain`], [`intent`], [`broker`], [`trace`]), this one (the worker's
//! library, the `onejob` operator CLI and the mock provider),
//! `onejob-worker` (`worker/`, thin over [`fleet`]) and `onejob-producer`
//! (`producer/`: the client library, its CLI and the HTTP gateway), and
//! `onejob-test-support` (`test-support/`: the tests' and benchmarks'
//! harness, a dev-dependency). This
//! library holds everything the binaries share; binaries stay thin so tests
//! reach all of it in-process.
//!
//! `ARCHITECTURE.md` is the one map of the code: what each folder and file
//! owns and must not touch (`tests/layering.rs` holds it to the folders).
//! Each folder is one layer, top to bottom: [`operator`] (the CLI and the
//! console), [`fleet`] (composition: the one module that names the roles),
//! [`roles`], [`shared`] (what the roles and the tools share), [`edges`]
//! (where the process meets the outside: Postgres through `edges::store`, all
//! its SQL; the providers, metrics, telemetry, serving HTTP, signals) and
//! [`policy`] (what follows a failure, decided once and pure) and
//! [`settings`] (configuration and tokens); [`mock`] stands apart.
//! Nothing of this crate's is re-exported under a flatter name: an import
//! path says where a module lives (`crate::shared::runtime` is
//! `src/shared/runtime/`), and so which layer. Imports go one way, down the
//! folders in the order `tests/layering.rs` reads them, which fails the build
//! on an upward import, a cycle, a folder with no place in that order, or a
//! module other than the fleet that names a role. The core crate's modules ([`broker`], [`domain`], [`intent`],
//! [`trace`]) are re-exported whole, under the names they have there: they
//! are another crate's, which a producer uses without this one.
//!
//! # Public surface
//!
//! Modules are private unless a binary or a black-box test needs them: `attempts`,
//! `reconciler`, `planner`, `qualify`, `evidence`, `handed_on`, `provider`, `gauges`,
//! `terminal` and `throttle` are internal. [`fleet::run`]
//! starts the roles; [`edges::store::Store`] is the one seam to Postgres; [`operator::cli::main`] is
//! the operator CLI; [`roles::intake::validate`] and [`roles::intake::admit_rows`] are public so
//! that tests drive admission without a broker; [`shared::dlq::describe`] reads a dead
//! letter as the CLI lists it.

pub use onejob_core::{broker, domain, intent, trace};

pub mod edges;
pub mod fleet;
pub mod mock;
pub mod operator;
pub mod policy;
pub mod roles;
pub mod settings;
pub mod shared;
