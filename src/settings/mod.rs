//! What a deployment sets and what it issues, read by every layer above: the
//! configuration (`config`, one file per table, with its checks) and the
//! bearer tokens an operator hands out (`token`).
pub mod config;
pub mod token;
