//! What `--json` prints: the CLI's own public shapes, one file per thing
//! shown, each built from what the store read. A column added to a store row
//! does not reach the output until it is added here, so the JSON that other
//! programs read changes only on purpose (as the gateway's `PublicJob` does
//! for owners).
pub(super) mod audit;
pub(super) mod job;
pub(super) mod owner;
pub(super) mod token;
