//! The test-support crate (`onejob-test-support`), the harness the black-box
//! tests and the benchmarks share, as a dependency rather than files each
//! includes by path. For the tests: each test gets a fresh Postgres database
//! and a fresh RabbitMQ vhost on the real services, removed again when it ends
//! (even when it panics), so tests run in parallel and leave nothing behind.
//! Only the AI provider is simulated, by the bundled mock over real HTTP.

#![allow(dead_code, unreachable_pub, missing_docs)]

pub mod binaries;
pub mod browser;
pub mod chaos;
pub mod console;
pub mod database;
pub mod drain;
pub mod failover;
pub mod growth;
pub mod history;
pub mod lossy;
pub mod pg_ha;
pub mod raw_http;
pub mod refusing;

// The harness every test binary uses, one file a topic; re-exported so that
// `common::TestEnv`, `common::wait_for` and the rest keep their short paths.
pub mod configuration;
pub mod cuttable;
pub mod jobs;
pub mod queues;
pub mod tempfile_path;
pub mod test_env;
pub mod throwaway;
pub mod waiting;

// Not every test binary uses every topic.
#[allow(unused_imports)]
pub use self::{configuration::*, cuttable::*, jobs::*, queues::*, test_env::*, waiting::*};
