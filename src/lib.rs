//! onejob turns each user intention into exactly one durable job, however often it
//! is retried, redelivered or failed over.
//!
//! The library holds everything the binaries share: the pure [`domain`] rules and
//! [`intent`] parsing, [`config`], the [`store`] (all SQL), the [`broker`] (AMQP
//! topology and publishing with confirms), the [`provider`] adapters, the worker
//! roles ([`intake`], [`attempts`], [`reconciler`]), the bundled [`mock`] provider
//! and the operator [`cli`]. Binaries stay thin so tests reach all of it in-process.

pub mod attempts;
pub mod broker;
pub mod cli;
pub mod config;
pub mod dlq;
pub mod domain;
pub mod intake;
pub mod intent;
pub mod metrics;
pub mod mock;
pub mod provider;
pub mod qualify;
pub mod reconciler;
pub mod shutdown;
pub mod store;
pub mod telemetry;
pub mod token;
pub mod worker;
