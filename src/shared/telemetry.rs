//! Logging setup shared by the binaries: human-readable by default, JSON lines with
//! `ONEJOB_LOG_FORMAT=json`, filtered by `RUST_LOG` (default `info`, with sqlx's
//! notices at `warn`), coloured only on a terminal.

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber for a long-running program, writing to stderr.
/// Safe to call twice.
pub fn init() {
    // sqlx logs Postgres notices (such as "relation already exists, skipping"
    // at every migration check) at info: keep them out of the default.
    init_with("info,sqlx=warn");
}

/// For a one-shot command, which prints its own one-line error: only warnings
/// by default, and nothing from lapin, whose recovery logs would wrap that line
/// in noise. `RUST_LOG` still overrides it.
pub fn init_quiet() {
    init_with("warn,lapin=off,sqlx=warn");
}

fn init_with(default: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let json = std::env::var("ONEJOB_LOG_FORMAT").is_ok_and(|f| f == "json");
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        // A line that cannot be written (stderr a pipe whose reader has gone)
        // is dropped. By default the subscriber reports it with `eprintln!`,
        // which panics on that same broken stderr: a panic in whatever task
        // logged, such as the one that stops the program on SIGTERM.
        .log_internal_errors(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}
