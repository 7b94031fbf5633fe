//! `onejob-producer`: publish a job intent from the command line.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use onejob_producer::{Intent, Outcome, Producer, ProducerOptions};

/// Publish job intents to onejob.
#[derive(Parser, Debug)]
#[command(name = "onejob-producer", version, about)]
struct Args {
    /// RabbitMQ URL.
    #[arg(long, env = "AMQP_URL", default_value = onejob::cli::DEFAULT_AMQP_URL, hide_env_values = true, global = true)]
    amqp_url: String,
    /// The fleet's configuration, for the queue arguments the producer declares
    /// (`worker.delivery_limit`) [default: ./onejob.toml if it exists, else the
    /// embedded defaults].
    #[arg(long, env = "ONEJOB_CONFIG", global = true)]
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
}

#[tokio::main]
async fn main() -> ExitCode {
    onejob::telemetry::init();
    let args = Args::parse();
    let Command::Publish {
        owner,
        key,
        operation,
        input,
        provider,
        wait,
        timeout,
    } = args.command;
    let input = match serde_json::from_str::<serde_json::Value>(&input) {
        Ok(serde_json::Value::Object(map)) => map,
        Ok(_) => {
            eprintln!("onejob-producer: --input must be a JSON object");
            return ExitCode::from(2);
        }
        Err(e) => {
            eprintln!("onejob-producer: --input is not JSON: {e}");
            return ExitCode::from(2);
        }
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
        ..ProducerOptions::default()
    };
    let producer = match Producer::connect_with(&args.amqp_url, options).await {
        Ok(p) => p,
        Err(e) => {
            eprintln!(
                "onejob-producer: cannot connect to {}: {e}",
                onejob::broker::redact_url(&args.amqp_url)
            );
            return ExitCode::from(1);
        }
    };
    let code = if wait {
        match producer.submit(&intent).await {
            Ok(receipt) => {
                println!("{}", serde_json::to_string(&receipt).unwrap_or_default());
                match receipt.outcome {
                    Outcome::Created | Outcome::Duplicate => ExitCode::SUCCESS,
                    Outcome::Conflict | Outcome::Rejected => ExitCode::from(1),
                }
            }
            Err(e) => {
                eprintln!("onejob-producer: {e}");
                ExitCode::from(1)
            }
        }
    } else {
        match producer.publish_only(&intent).await {
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
