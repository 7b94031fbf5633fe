//! `onejob-producer`: publish a job intent from the command line.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use std::sync::Arc;

use onejob::edges::shutdown::Shutdown;
use onejob_producer::gateway::{Gateway, GatewayOptions};
use onejob_producer::{Intent, Outcome, Producer, ProducerOptions};

/// Publish job intents to onejob.
#[derive(Parser, Debug)]
#[command(name = "onejob-producer", version, about)]
struct Args {
    /// RabbitMQ URL, or the comma-separated URLs of a cluster's nodes (the first that answers is used).
    #[arg(long, env = "AMQP_URL", default_value = onejob::operator::cli::DEFAULT_AMQP_URL, hide_env_values = true, global = true)]
    amqp_url: String,
    /// The fleet's configuration, for the queue arguments the producer declares
    /// (`worker.delivery_limit`) [default: ./onejob.toml if it exists, else the
    /// embedded defaults].
    #[arg(long, env = "ONEJOB_CONFIG", hide_env_values = true, global = true)]
    config: Option<std::path::PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Publish one intent (waits for the broker's confirm). With --wait, also wait
    /// for the receipt and print it as JSON; exit 1 if it is `conflict` or `rejected`.
    Publish {
        /// The owner.
        #[arg(long)]
        owner: String,
        /// The idempotency key: reuse it on every retry of the same intention.
        #[arg(long)]
        key: String,
        /// The operation.
        #[arg(long)]
        operation: String,
        /// The input, a JSON object.
        #[arg(long)]
        input: String,
        /// Pin the first attempt's provider.
        #[arg(long)]
        provider: Option<String>,
        /// Wait for the receipt and print it.
        #[arg(long)]
        wait: bool,
        /// How long to wait for the receipt.
        #[arg(long, value_parser = humantime::parse_duration, default_value = "30s")]
        timeout: Duration,
    },
    /// Serve the HTTP gateway: `POST /v1/jobs` (bearer token from `onejob tokens
    /// create`, `Idempotency-Key` header, body `{"operation", "input", "provider"?}`),
    /// `GET /v1/jobs/{id}`, `/openapi.json`, `/healthz`, `/readyz`. Stops on
    /// SIGTERM after finishing the requests in flight; exits 1 if RabbitMQ is lost.
    Serve {
        /// Where to listen.
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: std::net::SocketAddr,
        /// Also serve /healthz, /readyz and /metrics here (metrics are not on the
        /// public listener).
        #[arg(long)]
        http: Option<std::net::SocketAddr>,
        /// Postgres URL (tokens and jobs).
        #[arg(long, env = "DATABASE_URL", default_value = onejob::operator::cli::DEFAULT_DATABASE_URL, hide_env_values = true)]
        database_url: String,
        /// How long a request waits for the fleet's receipt before answering 504
        /// (retrying with the same key is then safe).
        #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
        receipt_timeout: Duration,
        /// Requests served at once; more are answered 503 with Retry-After.
        #[arg(long, default_value_t = 256)]
        max_in_flight: usize,
        /// Requests one owner may have in flight at once; more are answered
        /// 429 (so that one owner cannot hold every place).
        #[arg(long, default_value_t = 32)]
        max_in_flight_per_owner: usize,
        /// Request bytes one owner may have in flight at once, as each
        /// request's Content-Length declares; a request that would pass it is
        /// answered 429.
        #[arg(long, default_value_t = 32 << 20)]
        max_bytes_in_flight_per_owner: usize,
        /// How long a client may take to send a request's line and headers,
        /// and, on a kept-alive connection, to start its next request. Behind
        /// a load balancer that keeps connections open, set it above the
        /// balancer's idle timeout.
        #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
        header_timeout: Duration,
        /// How long a client may take to send a request body (408 past it).
        #[arg(long, value_parser = humantime::parse_duration, default_value = "30s")]
        body_timeout: Duration,
        /// Connections held open at once; more wait to be accepted.
        #[arg(long, default_value_t = 1024)]
        max_connections: usize,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    // Spans are exported (when configured) until the end of main.
    let _telemetry = match args.command {
        Command::Serve { .. } => Some(onejob::edges::telemetry::init()),
        _ => {
            onejob::edges::telemetry::init_quiet();
            None
        }
    };
    // The fleet's configuration: the producer's queue declarations must carry the
    // same delivery limit, and the gateway checks operations and sizes with it.
    let config = match onejob::settings::config::Config::load(args.config.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("onejob-producer: {e}");
            return ExitCode::from(1);
        }
    };
    match args.command {
        Command::Publish {
            owner,
            key,
            operation,
            input,
            provider,
            wait,
            timeout,
        } => {
            let input = match input_object(&input) {
                Ok(map) => map,
                Err(code) => return code,
            };
            let intent = Intent {
                owner_id: owner,
                idempotency_key: key,
                operation,
                input,
                provider,
            };
            let options = ProducerOptions {
                receipt_timeout: timeout,
                delivery_limit: config.worker.delivery_limit,
            };
            publish(&args.amqp_url, options, &intent, wait).await
        }
        Command::Serve {
            listen,
            http,
            database_url,
            receipt_timeout,
            max_in_flight,
            max_in_flight_per_owner,
            max_bytes_in_flight_per_owner,
            header_timeout,
            body_timeout,
            max_connections,
        } => {
            let options = GatewayOptions {
                receipt_timeout,
                max_in_flight,
                max_in_flight_per_owner,
                max_bytes_in_flight_per_owner,
                header_timeout,
                body_timeout,
                max_connections,
            };
            serve(
                config,
                &database_url,
                &args.amqp_url,
                (listen, http),
                options,
            )
            .await
        }
    }
}

/// `--input` as the JSON object an intent carries, or the exit code that
/// refuses it (said on stderr).
fn input_object(input: &str) -> Result<serde_json::Map<String, serde_json::Value>, ExitCode> {
    match serde_json::from_str::<serde_json::Value>(input) {
        Ok(serde_json::Value::Object(map)) => Ok(map),
        Ok(_) => {
            eprintln!("onejob-producer: --input must be a JSON object");
            Err(ExitCode::from(2))
        }
        Err(e) => {
            eprintln!("onejob-producer: --input is not JSON: {e}");
            Err(ExitCode::from(2))
        }
    }
}

async fn publish(
    amqp_url: &str,
    options: ProducerOptions,
    intent: &Intent,
    wait: bool,
) -> ExitCode {
    let producer = match Producer::connect_with(amqp_url, options).await {
        Ok(p) => p,
        Err(e) => {
            eprintln!(
                "onejob-producer: cannot connect to {}: {e}",
                onejob::broker::redact_url(amqp_url)
            );
            return ExitCode::from(1);
        }
    };
    let code = if wait {
        match producer.submit(intent).await {
            Ok(receipt) => {
                println!("{}", serde_json::to_string(&receipt).unwrap_or_default());
                match receipt.outcome {
                    Outcome::Created | Outcome::Duplicate => ExitCode::SUCCESS,
                    Outcome::Conflict => {
                        eprintln!("{}", conflict_explained(intent));
                        ExitCode::from(1)
                    }
                    Outcome::Rejected => {
                        eprintln!(
                            "onejob-producer: rejected: {}; nothing was made, and the intent is in onejob.intents.dlq with the reason",
                            onejob::broker::escape_controls(
                                receipt.error.as_deref().unwrap_or("no reason given")
                            )
                        );
                        ExitCode::from(1)
                    }
                }
            }
            Err(e) => {
                eprintln!("onejob-producer: {e}");
                ExitCode::from(1)
            }
        }
    } else {
        match producer.publish_only(intent).await {
            Ok(()) => {
                eprintln!("published; the broker confirmed it");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("onejob-producer: {e}");
                ExitCode::from(1)
            }
        }
    };
    producer.close().await;
    code
}

async fn serve(
    config: onejob::settings::config::Config,
    database_url: &str,
    amqp_url: &str,
    (listen, http): (std::net::SocketAddr, Option<std::net::SocketAddr>),
    options: GatewayOptions,
) -> ExitCode {
    let listener = match tokio::net::TcpListener::bind(listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("onejob-producer: --listen {listen}: {e}");
            return ExitCode::from(1);
        }
    };
    let probes = match http {
        None => None,
        Some(addr) => match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => Some(l),
            Err(e) => {
                eprintln!("onejob-producer: --http {addr}: {e}");
                return ExitCode::from(1);
            }
        },
    };
    let gateway = match Gateway::connect(Arc::new(config), database_url, amqp_url, options).await {
        Ok(g) => Arc::new(g),
        Err(e) => {
            eprintln!(
                "onejob-producer: cannot start the gateway (Postgres {}, RabbitMQ {}): {e}",
                onejob::broker::redact_url(database_url),
                onejob::broker::redact_url(amqp_url)
            );
            return ExitCode::from(1);
        }
    };
    let shutdown = Shutdown::new();
    let signals = shutdown.clone();
    tokio::spawn(async move {
        onejob::edges::shutdown::wait_for_signal().await;
        // Stop first, then say so: a log sink that fails must not keep a
        // program from stopping.
        signals.trigger();
        tracing::info!("signal received: finishing the requests in flight");
    });
    tracing::info!(%listen, "serving the HTTP gateway");
    let result = gateway.clone().serve(listener, probes, shutdown).await;
    if let Ok(gateway) = Arc::try_unwrap(gateway) {
        gateway.close().await;
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("onejob-producer: {e}");
            ExitCode::from(1)
        }
    }
}

/// What a `conflict` receipt means, and what to do: the receipt itself
/// carries no error (contract section 4), so the CLI says it on stderr.
fn conflict_explained(intent: &Intent) -> String {
    format!(
        "onejob-producer: conflict: owner {:?} already sent key {:?} with another intent (a different operation, input or provider); the job it made was neither changed nor handed out. Send a new intent under a new key, or send the first intent again to get its job (`onejob jobs find --owner {:?} --key {:?}` shows it).",
        intent.owner_id, intent.idempotency_key, intent.owner_id, intent.idempotency_key
    )
}
