//! Logging setup shared by the binaries: human-readable by default, JSON lines with
//! `ONEJOB_LOG_FORMAT=json`, filtered by `RUST_LOG` (default `info`, with sqlx's
//! notices at `warn`), coloured only on a terminal.

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber, writing to stderr. Safe to call twice.
pub fn init() {
    // sqlx logs Postgres notices (such as "relation already exists, skipping"
    // at every migration check) at info: keep them out of the default.
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn"));
    let json = std::env::var("ONEJOB_LOG_FORMAT").is_ok_and(|f| f == "json");
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}
