//! What the roles and the tools share: the runtime a role runs on (context,
//! publishing with confirms, consuming, retries, health), the policy that
//! plans what follows a failure, qualification, looking up an unknown's evidence, settlements handed on
//! through the broker, the dead-letter queues, the
//! provider client, metrics and their gauges, configuration, tokens, serving
//! untrusted HTTP clients, shutdown and telemetry.

pub mod config;
pub mod dlq;
pub(crate) mod evidence;
pub(crate) mod gauges;
pub(crate) mod handed_on;
pub mod http;
pub mod metrics;
pub(crate) mod policy;
pub(crate) mod provider;
pub(crate) mod qualify;
pub mod runtime;
pub mod shutdown;
pub mod telemetry;
pub mod token;
