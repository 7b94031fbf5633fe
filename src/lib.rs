//! onejob turns each user intention into exactly one durable job, however often it
//! is retried, redelivered or failed over.
//!
//! The library holds everything the binaries share; binaries stay thin so tests
//! reach all of it in-process. Imports go one way, down these layers (a test,
//! `tests/layering.rs`, fails the build on a cycle or on roles that import one
//! another):
//!
//! | layer | modules |
//! |---|---|
//! | composition | [`fleet`] (the one module that names the roles: start, supervise, stop) · [`cli`] (the operator CLI) |
//! | roles | [`intake`] · [`attempts`] · [`reconciler`] |
//! | shared by the roles | [`runtime`] (context, consume, ack, retries, health) · [`policy`] (what follows a failure) · [`qualify`] · [`dlq`] |
//! | edges | [`store`] (all SQL) · [`broker`] (AMQP topology, confirms, dead letters) · [`provider`] (HTTP to providers) · [`metrics`] |
//! | pure | [`domain`] (ids, states, transitions, the route rule, message and qualification types) · [`intent`] (parsing, fingerprint, receipts) · [`config`] · [`token`] |
//! | apart | [`mock`] (the bundled provider) · [`shutdown`] · [`telemetry`] |

pub mod attempts;
pub mod broker;
pub mod cli;
pub mod config;
pub mod dlq;
pub mod domain;
pub mod fleet;
pub mod intake;
pub mod intent;
pub mod metrics;
pub mod mock;
pub mod policy;
pub mod provider;
pub mod qualify;
pub mod reconciler;
pub mod runtime;
pub mod shutdown;
pub mod store;
pub mod telemetry;
pub mod token;
