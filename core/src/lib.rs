//! What every onejob program shares, and all a producer needs: no database and no
//! HTTP server in it, so that a service embedding `onejob-producer` compiles
//! neither sqlx nor axum.
//!
//! | module | holds |
//! |---|---|
//! | [`domain`] | pure: ids, job and attempt states with their transition tables, the route rule, message and qualification types |
//! | [`intent`] | pure: the intent message (contract section 3), its parsing, fingerprint and receipt (section 4) |
//! | [`broker`] | the AMQP edge: topology, publishing with confirms, headers, dead letters, URL redaction |
//! | [`trace`] | W3C trace context, as intents, attempt messages, events and provider calls carry it |
//!
//! The `onejob` crate re-exports them all under the same names, so inside the
//! worker they read as `crate::domain`, `crate::intent` and `crate::broker`.

pub mod broker;
pub mod domain;
pub mod intent;
pub mod trace;
