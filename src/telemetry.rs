//! Logging setup shared by the binaries: human-readable by default, JSON lines with
//! `ONEJOB_LOG_FORMAT=json`, filtered by `RUST_LOG` (default `info`).

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber, writing to stderr. Safe to call twice.
pub fn init() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let json = std::env::var("ONEJOB_LOG_FORMAT").is_ok_and(|f| f == "json");
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}
