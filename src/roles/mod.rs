//! The roles a worker pod runs, each a consumer or a timer over the shared
//! machinery and the store: [`intake`] turns intents into jobs, `attempts`
//! calls a provider and settles what it said, `reconciler` sweeps what a crash
//! or a silence left behind. A role never imports another role, nor the
//! operator's tools; [`crate::fleet`] is the one place that names them.

pub(crate) mod attempts;
pub mod intake;
pub mod reconciler;
