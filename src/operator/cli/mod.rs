//! The operator CLI, `onejob` (contract section 6).
//!
//! Exit status: 0 on success, 1 on a refused action or a failure (with the reason
//! on stderr), 2 on bad usage. `--json` gives machine-readable output on stdout.

//!
//! One file per command group, each holding its arguments beside its body
//! (as mini-redis keeps a command's parsing with the command): `jobs`,
//! `attempts`, `providers`, `dlq`, `owners`, `tokens`, `setup` (migrate,
//! queues, config) and `console`; `printed/` holds the shapes `--json`
//! prints, the CLI's own, built from the store's rows. This file holds what they share: the
//! connection settings, the dispatcher, and how a failure is reported.

mod attempts;
mod console;
mod dlq;
mod jobs;
mod owners;
mod printed;
mod providers;
mod setup;
mod tokens;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use crate::edges::store::Store;
use crate::settings::config::Config;
use crate::shared::runtime;

pub use crate::settings::config::{DEFAULT_AMQP_URL, DEFAULT_DATABASE_URL};

/// Connection and configuration settings every program shares.
#[derive(Args, Clone, Debug)]
pub struct Connections {
    /// Postgres URL.
    #[arg(long, env = "DATABASE_URL", default_value = DEFAULT_DATABASE_URL, hide_env_values = true, global = true)]
    pub database_url: String,
    /// RabbitMQ URL, or the comma-separated URLs of a cluster's nodes (the first that answers is used).
    #[arg(long, env = "AMQP_URL", default_value = DEFAULT_AMQP_URL, hide_env_values = true, global = true)]
    pub amqp_url: String,
    /// Configuration file [default: ./onejob.toml if it exists, else the embedded
    /// defaults].
    #[arg(long, env = "ONEJOB_CONFIG", hide_env_values = true, global = true)]
    pub config: Option<PathBuf>,
}

impl Connections {
    /// Loads the configuration these settings name.
    pub fn load_config(&self) -> Result<Config, crate::settings::config::ConfigError> {
        Config::load(self.config.as_deref())
    }
}

/// onejob: operate the job system — inspect jobs, resolve unknown attempts, check
/// configuration.
#[derive(Parser, Debug)]
#[command(name = "onejob", version, about, long_about = None)]
pub struct Cli {
    #[command(flatten)]
    connections: Connections,
    /// Machine-readable JSON output.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Create the database if it is missing, and apply pending migrations.
    Migrate,
    /// Inspect jobs.
    #[command(subcommand)]
    Jobs(jobs::JobsCommand),
    /// Resolve attempts out-of-band.
    #[command(subcommand)]
    Attempts(attempts::AttemptsCommand),
    /// Inspect providers.
    #[command(subcommand)]
    Providers(providers::ProvidersCommand),
    /// Inspect and act on dead-letter queues.
    #[command(subcommand)]
    Dlq(dlq::DlqCommand),
    /// Each owner's limits (in flight, rate, daily token budget) and spend.
    #[command(subcommand)]
    Owners(owners::OwnersCommand),
    /// Manage the HTTP gateway's bearer tokens.
    #[command(subcommand)]
    Tokens(tokens::TokensCommand),
    /// Bring the AMQP queues to this version's arguments.
    #[command(subcommand)]
    Queues(setup::QueuesCommand),
    /// Check the configuration.
    #[command(subcommand)]
    Config(setup::ConfigCommand),
    /// Serve the operator console: jobs, unknowns, overview, in a browser.
    /// Operators sign in with an operator token (`tokens create --operator`);
    /// every action asks for a reason and is written to the audit table.
    Console(console::ConsoleArgs),
}

/// A failure to report: a message on stderr and exit status 1.
struct Failure(String);

impl<E: std::fmt::Display> From<E> for Failure {
    fn from(e: E) -> Self {
        Failure(e.to_string())
    }
}

type Outcome = Result<(), Failure>;

/// Runs the CLI and returns its exit status.
pub async fn main(cli: Cli) -> ExitCode {
    let mut stdout = std::io::stdout().lock();
    // Plain output is for a terminal: its control characters are escaped.
    // `--json` is for programs, and stays exact.
    let mut plain;
    let mut out: &mut dyn Write = if cli.json {
        &mut stdout
    } else {
        plain = crate::operator::terminal::Terminal::new(&mut stdout);
        &mut plain
    };
    let outcome = run(cli, &mut out).await;
    let _ = out.flush();
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure(message)) => {
            eprintln!("onejob: {}", crate::operator::terminal::escape(&message));
            ExitCode::from(1)
        }
    }
}

/// Outside text (a publisher's, a provider's, a tenant's, or a row another
/// program wrote) as a line of plain output shows it: every control character
/// escaped, line feeds too, so that it can neither drive the terminal nor
/// forge a line.
fn shown(text: &str) -> String {
    crate::broker::escape_controls(text)
}

async fn store(c: &Connections, config: &Config) -> Result<Store, Failure> {
    Store::connect(
        &c.database_url,
        2,
        runtime::routes(config),
        std::time::Duration::ZERO,
    )
    .await
    .map_err(|e| Failure(e.describe(&c.database_url)))
}

async fn run(cli: Cli, out: &mut impl Write) -> Outcome {
    let c = &cli.connections;
    let json = cli.json;
    match cli.command {
        Command::Migrate => setup::migrate(c, json, out).await,
        Command::Jobs(command) => jobs::run(c, command, json, out).await,
        Command::Attempts(command) => attempts::run(c, command, json, out).await,
        Command::Providers(command) => providers::run(c, command, json, out).await,
        Command::Dlq(command) => dlq::run(c, command, json, out).await,
        Command::Owners(command) => owners::run(c, command, json, out).await,
        Command::Tokens(command) => tokens::run(c, command, json, out).await,
        Command::Queues(setup::QueuesCommand::Upgrade) => setup::queues_upgrade(c, json, out).await,
        Command::Config(setup::ConfigCommand::Check) => setup::config_check(c, json, out).await,
        Command::Console(args) => console::run(c, args).await,
    }
}

/// A connection for one command, with the topology declared (as every program
/// does at start); fails at once, with the reason, if the broker is unreachable.
async fn broker_connection(c: &Connections, config: &Config) -> Result<lapin::Connection, String> {
    runtime::operator_connection(&c.amqp_url, config).await
}

async fn publish_now(
    c: &Connections,
    config: &Config,
    store: &Store,
    messages: &[crate::edges::store::OutboxMessage],
) -> Result<(), String> {
    runtime::publish_now(&c.amqp_url, config, store, messages).await
}
