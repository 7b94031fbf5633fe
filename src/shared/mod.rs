//! What the roles and the operator's tools share, above the edges: the runtime
//! a role runs on (context, publishing with confirms, consuming, retries,
//! health), the policy that plans what follows a failure, qualification,
//! looking up an unknown's evidence, settlements handed on through the broker
//! and the dead-letter queues.
pub mod dlq;
pub(crate) mod evidence;
pub(crate) mod handed_on;
pub(crate) mod planner;
pub(crate) mod qualify;
pub mod runtime;
