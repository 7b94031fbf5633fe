//! What follows a definite failure, decided in this one place and without
//! I/O: the contract's route rule (`route`), one failure's next step with this
//! configuration and backoff (`next`), and a batch of failures planned once
//! per job, with blocks lifted (`batch`). The store writes what `batch`
//! decides; `crate::shared::planner` loads who is eligible.
pub(crate) mod batch;
pub mod next;
pub(crate) mod route;
