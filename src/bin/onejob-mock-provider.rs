//! `onejob-mock-provider`: the bundled mock provider, in OpenAI's and
//! Anthropic's wire formats. Requests
//! steer it with `mock:` directives in their text (see the `onejob::mock` docs).

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;

/// A mock provider for tests, the quick start and compose: OpenAI's
/// /v1/chat/completions and Anthropic's /v1/messages.
/// With --directives, requests steer it with directives in their text:
/// mock:delay=MS, mock:status=CODE, mock:retry_after=S, mock:prose,
/// mock:extra_key, mock:wrong_type, mock:drop, mock:nul, mock:pad=BYTES.
#[derive(Parser, Debug)]
#[command(name = "onejob-mock-provider", version, about)]
struct Args {
    /// Address to listen on.
    #[arg(long, env = "MOCK_LISTEN", default_value = "127.0.0.1:8081")]
    listen: SocketAddr,
    /// The answer object's field.
    #[arg(long, default_value = "summary")]
    field: String,
    /// Delay before every answer, e.g. "200ms".
    #[arg(long, value_parser = humantime::parse_duration, default_value = "0s")]
    delay: Duration,
    /// Extra random latency, up to this much, e.g. "300ms".
    #[arg(long, value_parser = humantime::parse_duration, default_value = "0s")]
    jitter: Duration,
    /// Share of requests answered with HTTP 503, from 0.0 to 1.0.
    #[arg(long, default_value_t = 0.0)]
    error_rate: f64,
    /// Break the output contract on every answer.
    #[arg(long, value_enum)]
    misbehave: Option<onejob::mock::Misbehaviour>,
    /// Name this mock in its answers ("mock answer: from TAG: ...").
    #[arg(long)]
    tag: Option<String>,
    /// Obey `mock:` directives in a request's text (clamped: a delay of at
    /// most a minute, a pad of at most 1 MiB). Off by default: the text is a
    /// tenant's prompt, and tenants do not steer a provider.
    #[arg(long)]
    directives: bool,
    /// Keep every completion asked with "store": true, with its metadata,
    /// and list them: GET /v1/chat/completions?metadata[KEY]=VALUE (OpenAI's
    /// stored completions, the evidence of `evidence = "stored"`).
    #[arg(long)]
    store: bool,
    /// Answer a repeated Idempotency-Key with the first request's outcome,
    /// running no new work (409 while the first is still running: the
    /// evidence of `evidence = "idempotency_key"`).
    #[arg(long)]
    replay: bool,
}

#[tokio::main]
async fn main() -> ExitCode {
    let _telemetry = onejob::edges::telemetry::init();
    let args = Args::parse();
    if !(0.0..=1.0).contains(&args.error_rate) {
        eprintln!("onejob-mock-provider: --error-rate must be between 0.0 and 1.0");
        return ExitCode::from(2);
    }
    let options = onejob::mock::MockOptions {
        field: args.field,
        delay: args.delay,
        jitter: args.jitter,
        error_rate: args.error_rate,
        misbehave: args.misbehave,
        tag: args.tag,
        directives: args.directives,
        store: args.store,
        replay: args.replay,
        ..onejob::mock::MockOptions::default()
    };
    let handle = match onejob::mock::start(args.listen, options).await {
        Ok(h) => h,
        Err(e) => {
            let hint = if e.kind() == std::io::ErrorKind::AddrInUse {
                " (is a fleet already running? scripts/fleet starts one on this port)"
            } else {
                ""
            };
            eprintln!(
                "onejob-mock-provider: cannot listen on {}: {e}{hint}",
                args.listen
            );
            return ExitCode::from(1);
        }
    };
    tracing::info!(addr = %handle.addr, "mock provider listening; POST {}/chat/completions", handle.base_url());
    let _ = tokio::signal::ctrl_c().await;
    ExitCode::SUCCESS
}
