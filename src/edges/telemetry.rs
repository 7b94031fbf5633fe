//! Logs and spans for the binaries.
//!
//! Logs: human-readable by default, JSON lines with `ONEJOB_LOG_FORMAT=json`,
//! filtered by `RUST_LOG` (default `info`, with sqlx's notices at `warn`),
//! coloured only on a terminal.
//!
//! Spans: exported over OTLP/HTTP when an OTLP endpoint is configured, by the
//! standard variables (`OTEL_EXPORTER_OTLP_ENDPOINT` or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, with `OTEL_EXPORTER_OTLP_PROTOCOL`,
//! `_HEADERS`, `_TIMEOUT` and `OTEL_SERVICE_NAME` as usual). Without one,
//! nothing is exported and no span is kept: each hop still passes W3C trace
//! context on ([`hop`]), at the cost of a random span id.

use std::sync::OnceLock;

use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState, TracerProvider as _,
};
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::trace::TraceContext;

/// Set once spans are exported by this process.
static EXPORTING: OnceLock<()> = OnceLock::new();

/// Spans are exported while this lives; dropping it sends what is left.
#[must_use = "spans stop being exported when the guard is dropped"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take()
            && let Err(e) = provider.shutdown()
        {
            tracing::warn!(error = %e, "spans not all exported at exit");
        }
    }
}

/// Installs the global subscriber for a long-running program, writing to
/// stderr, and the OTLP export when it is configured. Safe to call twice.
pub fn init() -> Telemetry {
    // sqlx logs Postgres notices (such as "relation already exists, skipping"
    // at every migration check) at info: keep them out of the default.
    init_with("info,sqlx=warn", true)
}

/// For a one-shot command, which prints its own one-line error: only warnings
/// by default, and nothing from lapin, whose recovery logs would wrap that line
/// in noise. `RUST_LOG` still overrides it. Exports no spans.
pub fn init_quiet() {
    drop(init_with("warn,lapin=off,sqlx=warn", false));
}

fn init_with(default: &str, export: bool) -> Telemetry {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let json = std::env::var("ONEJOB_LOG_FORMAT").is_ok_and(|f| f == "json");
    let logs = tracing_subscriber::fmt::layer()
        // A line that cannot be written (stderr a pipe whose reader has gone)
        // is dropped. By default the subscriber reports it with `eprintln!`,
        // which panics on that same broken stderr: a panic in whatever task
        // logged, such as the one that stops the program on SIGTERM.
        .log_internal_errors(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    // `RUST_LOG` filters the logs only: it never turns the span export off.
    let logs = if json {
        logs.json().with_filter(filter).boxed()
    } else {
        logs.with_filter(filter).boxed()
    };
    let (provider, problem) = match export.then(exporter).flatten() {
        Some(Ok(provider)) => (Some(provider), None),
        Some(Err(e)) => (None, Some(e)),
        None => (None, None),
    };
    // Only onejob's own spans (and the log lines inside them) are exported,
    // never a library's.
    let spans = provider.as_ref().map(|p| {
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("onejob"))
            .with_filter(
                tracing_subscriber::filter::Targets::new()
                    .with_target("onejob", tracing::Level::INFO),
            )
    });
    let installed = tracing_subscriber::registry()
        .with(logs)
        .with(spans)
        .try_init()
        .is_ok();
    if let Some(e) = problem {
        tracing::error!(error = %e, "OTLP export is configured but cannot start; no spans are exported");
    }
    let provider = provider.filter(|_| installed);
    if provider.is_some() {
        let _ = EXPORTING.set(());
        tracing::info!("exporting spans over OTLP");
    }
    Telemetry { provider }
}

/// The tracer provider, when the standard variables configure an OTLP
/// endpoint and do not switch the SDK or the trace exporter off.
fn exporter() -> Option<Result<SdkTracerProvider, String>> {
    let value = |name: &str| {
        std::env::var(name)
            .ok()
            .map(|v| v.trim().to_ascii_lowercase())
            .filter(|v| !v.is_empty())
    };
    let configured = value("OTEL_EXPORTER_OTLP_ENDPOINT").is_some()
        || value("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some();
    if !configured || value("OTEL_SDK_DISABLED").as_deref() == Some("true") {
        return None;
    }
    match value("OTEL_TRACES_EXPORTER").as_deref() {
        None | Some("otlp") => {}
        Some("none") => return None,
        Some(other) => {
            return Some(Err(format!(
                "OTEL_TRACES_EXPORTER={other}: onejob exports spans over OTLP only (otlp, or none)"
            )));
        }
    }
    // The signal's own variable first, as the exporter reads them.
    let protocol = value("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        .or_else(|| value("OTEL_EXPORTER_OTLP_PROTOCOL"));
    if let Some(protocol) = protocol.filter(|p| p != "http/protobuf" && p != "http/json") {
        return Some(Err(format!(
            "OTLP protocol {protocol:?}: onejob exports over OTLP/HTTP only (http/protobuf or http/json, port 4318)"
        )));
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .build()
        .map_err(|e| e.to_string());
    Some(exporter.map(|exporter| {
        let mut resource = opentelemetry_sdk::Resource::builder();
        let named = value("OTEL_SERVICE_NAME").is_some()
            || value("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|a| a.contains("service.name="));
        if !named {
            resource = resource.with_service_name(program_name());
        }
        SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource.build())
            .build()
    }))
}

/// The running program's file name: the service name spans are exported under.
fn program_name() -> String {
    std::env::args_os()
        .next()
        .and_then(|p| {
            std::path::Path::new(&p)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
        })
        .unwrap_or_else(|| "onejob".into())
}

/// Whether this process exports spans: a hop makes its span only then, so
/// that without an OTLP endpoint a span costs nothing.
fn exporting() -> bool {
    EXPORTING.get().is_some()
}

/// A hop's span and the trace context it passes on. When spans are
/// exported, `span` makes the hop's span: a child of `parent` (or the root of
/// a new trace), and the context names it. Otherwise no span is made
/// (`Span::none()`, which costs nothing) and the context names a fresh span id
/// in `parent`'s trace, or starts a trace. Either way the state of `parent`
/// travels on unchanged.
pub fn hop(
    parent: Option<&TraceContext>,
    span: impl FnOnce() -> tracing::Span,
) -> (tracing::Span, TraceContext) {
    if !exporting() {
        return (tracing::Span::none(), TraceContext::child_or_root(parent));
    }
    let span = span();
    if let Some(parent) = parent {
        let _ = span.set_parent(remote(parent));
    }
    let own = span.context().span().span_context().clone();
    let trace = if own.is_valid() {
        TraceContext {
            trace_id: own.trace_id().to_bytes(),
            span_id: own.span_id().to_bytes(),
            flags: own.trace_flags().to_u8(),
            state: parent.and_then(|p| p.state.clone()),
        }
    } else {
        TraceContext::child_or_root(parent)
    };
    (span, trace)
}

/// A context from another process, as OpenTelemetry's parent.
fn remote(parent: &TraceContext) -> opentelemetry::Context {
    opentelemetry::Context::new().with_remote_span_context(SpanContext::new(
        TraceId::from_bytes(parent.trace_id),
        SpanId::from_bytes(parent.span_id),
        TraceFlags::new(parent.flags),
        true,
        TraceState::NONE,
    ))
}
