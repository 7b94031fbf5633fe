//! `onejob-worker`: the worker pod. With no `--role` it runs every role: intake, one
//! attempt consumer per configured provider, and the reconciler.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, ValueEnum};
use onejob::edges::shutdown::Shutdown;
use onejob::fleet::{self, Role};
use onejob::operator::cli::Connections;
use onejob::shared::runtime::{self, Context};

/// The onejob worker pod. Runs intake, attempt consumers and the reconciler; with
/// no --role, all of them. Applies pending migrations and declares the AMQP
/// topology at start, so start order does not matter.
#[derive(Parser, Debug)]
#[command(name = "onejob-worker", version, about)]
struct Args {
    #[command(flatten)]
    connections: Connections,
    /// Run only these roles (repeatable): intake, attempts (with --provider),
    /// reconciler.
    #[arg(long = "role", value_enum)]
    roles: Vec<RoleArg>,
    /// With --role attempts: the provider(s) to consume for (repeatable).
    #[arg(long = "provider")]
    providers: Vec<String>,
    /// Serve /healthz, /readyz and /metrics on this address.
    #[arg(long)]
    http: Option<SocketAddr>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum RoleArg {
    Intake,
    Attempts,
    Reconciler,
}

fn roles(args: &Args) -> Result<Vec<Role>, String> {
    let wants_attempts = args.roles.contains(&RoleArg::Attempts);
    if wants_attempts && args.providers.is_empty() {
        return Err("--role attempts needs at least one --provider NAME".into());
    }
    if !wants_attempts && !args.providers.is_empty() {
        return Err("--provider is only meaningful with --role attempts".into());
    }
    let mut out = Vec::new();
    for r in &args.roles {
        match r {
            RoleArg::Intake if !out.contains(&Role::Intake) => out.push(Role::Intake),
            RoleArg::Reconciler if !out.contains(&Role::Reconciler) => out.push(Role::Reconciler),
            RoleArg::Attempts => {
                for p in &args.providers {
                    let role = Role::Attempts(p.clone());
                    if !out.contains(&role) {
                        out.push(role);
                    }
                }
            }
            _ => {}
        }
    }
    Ok(out)
}

#[tokio::main]
async fn main() -> ExitCode {
    let _telemetry = onejob::edges::telemetry::init();
    let args = Args::parse();
    let roles = match roles(&args) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("onejob-worker: {e}");
            return ExitCode::from(2);
        }
    };
    let config = match args.connections.load_config() {
        Ok(c) => Arc::new(c),
        Err(e) => {
            eprintln!("onejob-worker: {e}");
            return ExitCode::from(1);
        }
    };
    tracing::info!(config = %config.origin, "configuration loaded");
    for warning in &config.warnings {
        tracing::warn!("{warning}");
    }
    let ctx = match Context::connect(
        config,
        &args.connections.database_url,
        &args.connections.amqp_url,
    )
    .await
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("onejob-worker: cannot start: {e}");
            return ExitCode::from(1);
        }
    };
    let shutdown = Shutdown::new();
    if let Some(addr) = args.http {
        let listener = match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("onejob-worker: --http {addr}: {e}");
                return ExitCode::from(1);
            }
        };
        let app = runtime::health_router(ctx.clone());
        let stop = shutdown.clone();
        tokio::spawn(async move {
            // Slow or many clients of the probes are bounded as the
            // gateway's are.
            let limits = onejob::edges::http::ClientLimits::default();
            let _ =
                onejob::edges::http::serve(listener, app, limits, async move { stop.wait().await })
                    .await;
        });
        tracing::info!(%addr, "serving /healthz, /readyz and /metrics");
    }
    let signals = shutdown.clone();
    tokio::spawn(async move {
        onejob::edges::shutdown::wait_for_signal().await;
        // Stop first, then say so: a log sink that fails must not keep a
        // program from stopping.
        signals.trigger();
        tracing::info!("signal received: stopping intake of new work, finishing what is in flight");
    });
    let result = fleet::run(ctx.clone(), roles, shutdown.clone()).await;
    shutdown.trigger();
    let _ = ctx.connection.close(200, "worker stopped".into()).await;
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("onejob-worker: {e}");
            ExitCode::from(1)
        }
    }
}
