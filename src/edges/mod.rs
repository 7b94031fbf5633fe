//! Where the process meets the outside: Postgres (`store`, all the SQL, one
//! file per aggregate), the providers it calls (`provider`), the metrics it is scraped for and the gauges read from
//! the database for them, its logs and spans (`telemetry`), the untrusted HTTP
//! clients it serves (`http`) and the signals that stop it (`shutdown`).
pub(crate) mod gauges;
pub mod http;
pub mod metrics;
pub(crate) mod provider;
pub mod shutdown;
pub mod store;
pub mod telemetry;
