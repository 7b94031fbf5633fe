//! The operator CLI, `onejob` (contract section 6).
//!
//! Exit status: 0 on success, 1 on a refused action or a failure (with the reason
//! on stderr), 2 on bad usage. `--json` gives machine-readable output on stdout.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Args, Parser, Subcommand, ValueEnum};
use serde_json::json;
use uuid::Uuid;

use crate::broker;
use crate::config::Config;
use crate::dlq;
use crate::domain::{AttemptId, AttemptStatus, JobId};
use crate::policy::Planner;
use crate::runtime;
use crate::store::{Action, Actor, AuditEntry, JobView, Refusal, Resolution, Settled, Store};

pub use crate::config::{DEFAULT_AMQP_URL, DEFAULT_DATABASE_URL};

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
    pub fn load_config(&self) -> Result<Config, crate::config::ConfigError> {
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
    Jobs(JobsCommand),
    /// Resolve attempts out-of-band.
    #[command(subcommand)]
    Attempts(AttemptsCommand),
    /// Inspect providers.
    #[command(subcommand)]
    Providers(ProvidersCommand),
    /// Inspect and act on dead-letter queues.
    #[command(subcommand)]
    Dlq(DlqCommand),
    /// Manage the HTTP gateway's bearer tokens.
    #[command(subcommand)]
    Tokens(TokensCommand),
    /// Bring the AMQP queues to this version's arguments.
    #[command(subcommand)]
    Queues(QueuesCommand),
    /// Check the configuration.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Serve the operator console: jobs, unknowns, overview, in a browser.
    /// Operators sign in with an operator token (`tokens create --operator`);
    /// every action asks for a reason and is written to the audit table.
    Console(ConsoleArgs),
}

#[derive(Args, Debug)]
struct ConsoleArgs {
    /// The address to listen on. Put it behind TLS (and --secure-cookies) when
    /// it is reachable beyond this machine.
    #[arg(long, default_value = crate::console::DEFAULT_LISTEN)]
    listen: std::net::SocketAddr,
    /// Mark the session cookie Secure (the console is served over TLS). A
    /// request with `X-Forwarded-Proto: https` gets it anyway.
    #[arg(long)]
    secure_cookies: bool,
    /// How long a sign-in lasts.
    #[arg(long, default_value = "8h", value_parser = humantime::parse_duration)]
    session_ttl: std::time::Duration,
    /// Sign-in attempts one client address may make a minute; past it, 429.
    /// Behind a proxy every client shares its address: raise it there.
    #[arg(long, default_value_t = 10)]
    sign_ins_per_minute: u32,
}

#[derive(Subcommand, Debug)]
enum QueuesCommand {
    /// Redeclare work queues declared by an older version (or with another
    /// delivery limit) with this version's arguments. Run it with the fleet
    /// stopped. A queue is deleted and declared again only when it is empty and
    /// has no consumer (the broker checks both); one that holds messages is left
    /// as it is and named, with exit 1: drain it with the old version first.
    Upgrade,
}

#[derive(Subcommand, Debug)]
enum TokensCommand {
    /// Make a bearer token and print it once (on stdout alone, so
    /// `TOKEN=$(onejob tokens create --owner O)` works): a tenant's for the
    /// gateway (`--owner`, `ojt_…`) or an operator's for the console
    /// (`--operator`, `ojo_…`); neither is taken where the other is. Only its
    /// SHA-256 is stored: a lost token cannot be shown again; revoke it and make
    /// another.
    #[command(group(clap::ArgGroup::new("who").required(true)))]
    Create {
        /// The owner whose jobs the token may create and read (a gateway token).
        #[arg(long, group = "who")]
        owner: Option<String>,
        /// The operator the token signs in to the console (an operator token).
        #[arg(long, group = "who")]
        operator: Option<String>,
        /// Why, for the audit table (the grant and its row commit together).
        #[arg(long)]
        reason: Option<String>,
    },
    /// List gateway tokens (or, with --operators, operator tokens): id, owner,
    /// when made and when revoked. Never the tokens.
    List {
        /// Only this owner's.
        #[arg(long, conflicts_with = "operators")]
        owner: Option<String>,
        /// Operator tokens instead.
        #[arg(long)]
        operators: bool,
    },
    /// Revoke a token (either kind): the gateway or the console refuses it from
    /// its next request on.
    Revoke {
        /// The token's id, as `tokens list` shows it.
        token_id: Uuid,
        /// Why, for the audit table (the revocation and its row commit together).
        #[arg(long)]
        reason: Option<String>,
    },
}

#[derive(Subcommand, Debug)]
enum DlqCommand {
    /// Browse dead letters without consuming them: reason, x-death, original
    /// routing, age and a body preview. Without QUEUE, every dead-letter queue.
    List {
        /// A dead-letter queue (or its work queue), e.g. onejob.intents.dlq.
        queue: Option<String>,
        /// Show at most this many per queue (at most 10000: a listing keeps
        /// about a kilobyte of each, and one letter's body at a time).
        #[arg(long, default_value_t = crate::dlq::DEFAULT_LIMIT,
              value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=10_000))]
        limit: usize,
    },
    /// Republish dead letters to their original exchange and routing key (with a
    /// confirm), then remove them. Say which: --id MESSAGE-ID or --all.
    #[command(group(clap::ArgGroup::new("which").required(true)))]
    Replay {
        /// A dead-letter queue (or its work queue). Without it, every one.
        queue: Option<String>,
        /// Replay the dead letter with this message id.
        #[arg(long, group = "which")]
        id: Option<String>,
        /// Replay every dead letter.
        #[arg(long, group = "which")]
        all: bool,
        /// Why, for the audit table (written before anything is replayed).
        #[arg(long)]
        reason: Option<String>,
    },
    /// Delete the dead letters of a queue (of every dead-letter queue without
    /// QUEUE). Needs --yes.
    Purge {
        /// A dead-letter queue (or its work queue). Without it, every one.
        queue: Option<String>,
        /// Confirm the deletion.
        #[arg(long)]
        yes: bool,
        /// Why, for the audit table (written before anything is deleted).
        #[arg(long)]
        reason: Option<String>,
    },
}

#[derive(Subcommand, Debug)]
enum JobsCommand {
    /// Show a job and its attempts.
    Show {
        /// The job id.
        job_id: Uuid,
    },
    /// Cancel a job: its version is bumped, queued and unknown attempts are
    /// cancelled, and any later result is discarded. Refused on a terminal job.
    /// Recorded in the audit table, with who and why.
    Cancel {
        /// The job id.
        job_id: Uuid,
        /// Why, for the audit table (`jobs show` prints it).
        #[arg(long)]
        reason: Option<String>,
    },
    /// Find the job of an identity.
    Find {
        /// The owner.
        #[arg(long)]
        owner: String,
        /// The idempotency key.
        #[arg(long)]
        key: String,
    },
    /// Delete ended jobs past their retention, with their attempts, as the
    /// reconciler does every 10 s. `unknown`, `queued` and `running` jobs are never
    /// pruned, nor a job whose event is not yet published. Once a job is pruned, a
    /// re-send of its identity makes a new job.
    Prune {
        /// Prune every ended job that ended longer ago than this (e.g. "2d"),
        /// instead of the configured `[retention]`.
        #[arg(long, value_parser = humantime::parse_duration)]
        older_than: Option<std::time::Duration>,
        /// Count what would be pruned; delete nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

#[derive(Subcommand, Debug)]
enum AttemptsCommand {
    /// Resolve an open (usually `unknown`) attempt. `failed` lets the route rule
    /// start the next attempt; `cancelled` ends the attempt and its job.
    Resolve {
        /// The attempt id.
        attempt_id: Uuid,
        /// How it ended.
        #[arg(long = "as", value_enum)]
        resolution: ResolveAs,
        /// Why, for the audit table (`jobs show` prints it).
        #[arg(long)]
        reason: Option<String>,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum ResolveAs {
    Failed,
    Cancelled,
}

#[derive(Subcommand, Debug)]
enum ProvidersCommand {
    /// List providers, the operations that route to them, and their qualification
    /// state: qualified, stale (the contract changed since), failed, or never
    /// qualified.
    List,
    /// Run an operation's golden cases through a provider and record the result.
    /// Only a provider that passed for an operation's current contract may take
    /// its failovers and hedges. Exit 1 if any case fails.
    Qualify {
        /// The provider.
        provider: String,
        /// Only this operation [default: every operation whose route names the
        /// provider].
        #[arg(long)]
        operation: Option<String>,
        /// Why, for the audit table (written before the first paid call).
        #[arg(long)]
        reason: Option<String>,
    },
}

#[derive(Subcommand, Debug)]
enum ConfigCommand {
    /// Load and validate the configuration; print a summary.
    Check,
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
        plain = crate::terminal::Terminal::new(&mut stdout);
        &mut plain
    };
    let outcome = run(cli, &mut out).await;
    let _ = out.flush();
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure(message)) => {
            eprintln!("onejob: {}", crate::terminal::escape(&message));
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
        Command::Migrate => migrate(c, json, out).await,
        Command::Jobs(command) => jobs(c, command, json, out).await,
        Command::Attempts(AttemptsCommand::Resolve {
            attempt_id,
            resolution,
            reason,
        }) => {
            let actor = Actor::cli(reason.as_deref());
            resolve(c, attempt_id, resolution, &actor, json, out).await
        }
        Command::Providers(ProvidersCommand::List) => providers_list(c, json, out).await,
        Command::Providers(ProvidersCommand::Qualify {
            provider,
            operation,
            reason,
        }) => {
            let actor = Actor::cli(reason.as_deref());
            providers_qualify(c, provider, operation, &actor, json, out).await
        }
        Command::Dlq(command) => {
            let config = c.load_config()?;
            // A replay or a purge is recorded in the audit table before it is
            // done: it needs the database as well as the broker.
            let audit = match &command {
                DlqCommand::List { .. } => None,
                DlqCommand::Purge {
                    queue, yes: false, ..
                } => {
                    let queues = dlq::select_queues(&config, queue.as_deref())?;
                    return Err(Failure(format!(
                        "refusing to delete the dead letters of {} without --yes",
                        queues.join(", ")
                    )));
                }
                DlqCommand::Replay { .. } | DlqCommand::Purge { .. } => {
                    Some(store(c, &config).await?)
                }
            };
            let conn = broker_connection(c, &config).await.map_err(Failure)?;
            let result = dlq_command(&config, &conn, audit.as_ref(), command, json, out).await;
            let _ = conn.close(200, "done".into()).await;
            result?;
            Ok(())
        }
        Command::Tokens(command) => {
            let config = c.load_config()?;
            let store = store(c, &config).await?;
            tokens_command(&store, command, json, out)
                .await
                .map_err(|e| match e {
                    TokenFailure::Store(e) if e.is_undefined_table() => Failure(
                        "the database has no onejob tables yet: run `onejob migrate` (or start a worker) first"
                            .into(),
                    ),
                    TokenFailure::Store(e) => Failure(e.to_string()),
                    TokenFailure::Refused(f) => f,
                })?;
            Ok(())
        }
        Command::Queues(QueuesCommand::Upgrade) => queues_upgrade(c, json, out).await,
        Command::Config(ConfigCommand::Check) => config_check(c, json, out).await,
        Command::Console(args) => console(c, args).await,
    }
}

/// `onejob console`: serves until interrupted (Ctrl-C or SIGTERM).
async fn console(c: &Connections, args: ConsoleArgs) -> Outcome {
    let config = Arc::new(c.load_config()?);
    let store = store(c, &config).await?;
    let listener = crate::console::bind(args.listen).await.map_err(Failure)?;
    let options = crate::console::Options {
        amqp_url: c.amqp_url.clone(),
        secure_cookies: args.secure_cookies,
        session_ttl: args.session_ttl,
        sign_ins_per_minute: args.sign_ins_per_minute,
        ..crate::console::Options::default()
    };
    let addr = listener.local_addr().unwrap_or(args.listen);
    eprintln!("onejob console listening on http://{addr}/ (sign in with an operator token)");
    let console = crate::console::Console::new(store, config, options);
    crate::console::serve(listener, console, crate::shutdown::wait_for_signal())
        .await
        .map_err(|e| Failure(format!("the console stopped: {e}")))?;
    Ok(())
}

/// `onejob migrate`.
async fn migrate(c: &Connections, json: bool, out: &mut impl Write) -> Outcome {
    let config = c.load_config()?;
    Store::ensure_database(&c.database_url)
        .await
        .map_err(|e| Failure(e.describe(&c.database_url)))?;
    let store = store(c, &config).await?;
    store.migrate().await?;
    let applied = crate::store::MIGRATOR.iter().count();
    if json {
        writeln!(
            out,
            "{}",
            json!({ "migrations": applied, "status": "up to date" })
        )?;
    } else {
        writeln!(out, "migrations up to date ({applied} known)")?;
    }
    Ok(())
}

/// `onejob attempts resolve`.
async fn resolve(
    c: &Connections,
    attempt_id: Uuid,
    resolution: ResolveAs,
    actor: &Actor,
    json: bool,
    out: &mut impl Write,
) -> Outcome {
    let config = Arc::new(c.load_config()?);
    let store = store(c, &config).await?;
    let resolution = match resolution {
        ResolveAs::Failed => Resolution::Failed,
        ResolveAs::Cancelled => Resolution::Cancelled,
    };
    let operation = match store.attempt_job(AttemptId(attempt_id)).await? {
        Some(job) => store
            .job(job)
            .await?
            .map(|j| j.operation)
            .unwrap_or_default(),
        None => return Err(Failure(format!("attempt {attempt_id} not found"))),
    };
    let planner = Planner::load(&config, &store, [operation.as_str()]).await?;
    let plan = |f: &crate::store::FailedJob| planner.plan(f);
    let (settled, publish) = match store
        .resolve(AttemptId(attempt_id), resolution, &plan, actor)
        .await?
    {
        Ok(r) => r,
        Err(refusal @ (Refusal::NotFound(_) | Refusal::Terminal(_))) => {
            return Err(Failure(refusal.to_string()));
        }
    };
    // Publish what the resolution caused now; if the broker is down, the
    // reconciler's relay publishes it once the lease is over.
    let published = match publish_now(c, &config, &store, &publish).await {
        Ok(()) => true,
        Err(e) => {
            eprintln!("onejob: warning: {e}; the reconciler will publish it");
            false
        }
    };
    let next = match settled {
        Settled::Failed { next, .. } => next,
        _ => None,
    };
    let job = store
        .job(match store.attempt_job(AttemptId(attempt_id)).await? {
            Some(j) => j,
            None => return Err(Failure(format!("attempt {attempt_id} not found"))),
        })
        .await?;
    if json {
        writeln!(
            out,
            "{}",
            json!({
                "attempt_id": attempt_id,
                "resolved_as": match resolution { Resolution::Failed => "failed", Resolution::Cancelled => "cancelled" },
                "next_attempt": next,
                "published": published,
                "job": job,
            })
        )?;
    } else {
        let verb = match resolution {
            Resolution::Failed => "failed",
            Resolution::Cancelled => "cancelled",
        };
        writeln!(out, "attempt {attempt_id} resolved as {verb}")?;
        if let Some(n) = next {
            writeln!(out, "next attempt {n} queued")?;
        }
        if let Some(job) = job {
            writeln!(out, "job {} is now {}", job.id, job.status)?;
        }
    }
    Ok(())
}

/// `onejob providers list`.
async fn providers_list(c: &Connections, json: bool, out: &mut impl Write) -> Outcome {
    let config = c.load_config()?;
    let store = store(c, &config).await?;
    let states = crate::qualify::states(&config, &store).await?;
    let rows: Vec<_> = config
        .providers
        .values()
        .map(|p| {
            let routes: Vec<_> = config
                .operations
                .values()
                .filter_map(|o| {
                    o.route.iter().position(|r| *r == p.name).map(|i| {
                        let state = states
                            .get(&(p.name.clone(), o.name.clone()))
                            .copied()
                            .unwrap_or(crate::qualify::State::NeverQualified);
                        json!({
                            "operation": o.name,
                            "position": i,
                            "role": if i == 0 { "primary" } else { "failover" },
                            "qualification": state,
                            "eligible": i == 0 || state == crate::qualify::State::Qualified,
                        })
                    })
                })
                .collect();
            json!({
                "provider": p.name,
                "kind": "openai",
                "base_url": crate::broker::redact_url(p.base_url.as_str()),
                "model": p.model,
                "timeout": humantime::format_duration(p.timeout).to_string(),
                "concurrency": p.concurrency,
                "operations": routes,
            })
        })
        .collect();
    if json {
        writeln!(out, "{}", serde_json::Value::Array(rows))?;
    } else {
        for r in &rows {
            let s = |v: &serde_json::Value| v.as_str().unwrap_or("").to_owned();
            writeln!(
                out,
                "{}  {}  model {}  timeout {}",
                s(&r["provider"]),
                s(&r["base_url"]),
                s(&r["model"]),
                s(&r["timeout"])
            )?;
            for o in r["operations"].as_array().into_iter().flatten() {
                let state = o["qualification"].as_str().unwrap_or("").replace('_', " ");
                let eligible = if o["eligible"] == true {
                    "eligible"
                } else {
                    "not eligible"
                };
                writeln!(
                    out,
                    "  {:<20} {:<9} {:<16} {}",
                    s(&o["operation"]),
                    s(&o["role"]),
                    state,
                    eligible
                )?;
            }
        }
    }
    Ok(())
}

/// `onejob providers qualify`.
async fn providers_qualify(
    c: &Connections,
    provider: String,
    operation: Option<String>,
    actor: &Actor,
    json: bool,
    out: &mut impl Write,
) -> Outcome {
    let config = c.load_config()?;
    let p = config
        .providers
        .get(&provider)
        .ok_or_else(|| Failure(format!("{provider:?} is not a configured provider")))?;
    let operations: Vec<_> = match &operation {
        Some(name) => vec![
            config
                .operations
                .get(name)
                .ok_or_else(|| Failure(format!("{name:?} is not a configured operation")))?,
        ],
        None => config
            .operations
            .values()
            .filter(|o| o.route.contains(&provider))
            .collect(),
    };
    if operations.is_empty() {
        return Err(Failure(format!(
            "no operation routes to {provider:?}; name one with --operation"
        )));
    }
    let store = store(c, &config).await?;
    let mut reports = Vec::new();
    for op in operations {
        // Recorded first: the provider bills the calls, so none goes unrecorded.
        let audit = store
            .audit_begin(actor, &crate::qualify::action(p, op))
            .await
            .map_err(|e| {
                Failure(format!(
                    "{e}: nothing was done, the run could not be recorded first"
                ))
            })?;
        let (report, recorded) = crate::qualify::run_audited(&store, &config, p, op, audit).await;
        recorded?;
        reports.push(report);
    }
    let all_passed = reports.iter().all(|r| r.passed);
    if json {
        writeln!(out, "{}", serde_json::to_value(&reports)?)?;
    } else {
        for r in &reports {
            let verdict = if r.passed {
                "QUALIFIED"
            } else {
                "NOT QUALIFIED"
            };
            writeln!(
                out,
                "{} for {}: {verdict} (contract {})",
                r.provider,
                r.operation,
                &r.contract_hash[..12]
            )?;
            if r.cases.is_empty() {
                writeln!(
                    out,
                    "  no golden cases: add [[operations.{}.cases]] to qualify",
                    r.operation
                )?;
            }
            for case in &r.cases {
                let mark = if case.passed { "pass" } else { "FAIL" };
                let tokens = match (case.prompt_tokens, case.tokens_estimated) {
                    (Some(n), true) => format!("~{n} tokens (estimate)"),
                    (Some(n), false) => format!("{n} tokens"),
                    (None, _) => "-".into(),
                };
                writeln!(
                    out,
                    "  case {} {mark}  {tokens}  {}",
                    case.index,
                    shown(&case.detail)
                )?;
            }
        }
    }
    if !all_passed {
        return Err(Failure(format!(
            "{provider} did not qualify for every operation"
        )));
    }
    Ok(())
}

/// `onejob queues upgrade`.
async fn queues_upgrade(c: &Connections, json: bool, out: &mut impl Write) -> Outcome {
    let config = c.load_config()?;
    let conn = broker::connect(&c.amqp_url, broker::Recovery::None)
        .await
        .map_err(|e| {
            Failure(format!(
                "cannot reach RabbitMQ at {}: {e}",
                broker::redact_url(&c.amqp_url)
            ))
        })?;
    let upgrades = broker::upgrade_queues(
        &conn,
        &config.provider_names(),
        config.worker.delivery_limit,
    )
    .await;
    let _ = conn.close(200, "upgraded".into()).await;
    let upgrades = upgrades.map_err(|e| Failure(e.to_string()))?;
    let refused = upgrades
        .iter()
        .filter(|(_, u)| matches!(u, broker::QueueUpgrade::Refused { .. }))
        .count();
    if json {
        let queues: serde_json::Map<String, serde_json::Value> = upgrades
            .iter()
            .map(|(q, u)| Ok((q.clone(), serde_json::to_value(u)?)))
            .collect::<Result<_, serde_json::Error>>()?;
        writeln!(out, "{}", json!({ "queues": queues, "refused": refused }))?;
    } else {
        for (queue, upgrade) in &upgrades {
            match upgrade {
                broker::QueueUpgrade::Current => writeln!(out, "{queue}: up to date")?,
                broker::QueueUpgrade::Redeclared => {
                    writeln!(out, "{queue}: redeclared with this version's arguments")?
                }
                broker::QueueUpgrade::Refused {
                    messages,
                    consumers,
                } => writeln!(
                    out,
                    "{queue}: left as it is: it holds {messages} message(s) and has {consumers} consumer(s)"
                )?,
            }
        }
    }
    if refused > 0 {
        return Err(Failure(format!(
            "{refused} queue(s) not upgraded: stop every consumer and let the previous version drain them, then run this again"
        )));
    }
    Ok(())
}

/// `onejob config check`.
async fn config_check(c: &Connections, json: bool, out: &mut impl Write) -> Outcome {
    let config = c.load_config()?;
    if json {
        writeln!(
            out,
            "{}",
            json!({
                "ok": true,
                "origin": config.origin,
                "providers": config.provider_names(),
                "operations": config.operations.keys().collect::<Vec<_>>(),
                "warnings": config.warnings,
            })
        )?;
    } else {
        writeln!(out, "configuration OK ({})", config.origin)?;
        writeln!(out, "providers: {}", config.provider_names().join(", "))?;
        for o in config.operations.values() {
            writeln!(
                out,
                "operation {}: route {} · max_attempts {}",
                o.name,
                o.route.join(" → "),
                o.max_attempts
            )?;
        }
        for w in &config.warnings {
            writeln!(out, "warning: {w}")?;
        }
    }
    Ok(())
}

/// `onejob jobs …`.
async fn jobs(c: &Connections, command: JobsCommand, json: bool, out: &mut impl Write) -> Outcome {
    match command {
        JobsCommand::Show { job_id } => {
            let config = c.load_config()?;
            let store = store(c, &config).await?;
            let job = store.job(JobId(job_id)).await?;
            let job = job.ok_or_else(|| Failure(format!("job {job_id} not found")))?;
            let audit = store.audit_of_job(job.id).await?;
            print_job(out, &job, &audit, json)?;
        }
        JobsCommand::Cancel { job_id, reason } => {
            let config = c.load_config()?;
            let store = store(c, &config).await?;
            let actor = Actor::cli(reason.as_deref());
            let publish = match store.cancel_job(JobId(job_id), &actor).await? {
                Ok(p) => p,
                Err(refusal) => return Err(Failure(refusal.to_string())),
            };
            let published = match publish_now(c, &config, &store, &publish).await {
                Ok(()) => true,
                Err(e) => {
                    eprintln!("onejob: warning: {e}; the reconciler will publish the event");
                    false
                }
            };
            let job = store.job(JobId(job_id)).await?;
            if json {
                writeln!(
                    out,
                    "{}",
                    json!({ "cancelled": true, "event_published": published, "job": job })
                )?;
            } else {
                writeln!(
                    out,
                    "job {job_id} cancelled; a result still in flight will be discarded"
                )?;
            }
        }
        JobsCommand::Find { owner, key } => {
            let config = c.load_config()?;
            let store = store(c, &config).await?;
            let job = store.find_job(&owner, &key).await?;
            let job =
                job.ok_or_else(|| Failure(format!("no job for owner {owner:?} and key {key:?}")))?;
            let audit = store.audit_of_job(job.id).await?;
            print_job(out, &job, &audit, json)?;
        }
        JobsCommand::Prune {
            older_than,
            dry_run,
        } => {
            let config = c.load_config()?;
            let policy = match older_than {
                Some(age) if age.is_zero() => {
                    return Err(Failure(
                        "--older-than: must be greater than zero".to_owned(),
                    ));
                }
                Some(age) => crate::store::Policy::older_than(age),
                None => crate::store::Policy::of(&config),
            };
            let store = store(c, &config).await?;
            let pass = if dry_run {
                store.prune_jobs(&policy, i64::MAX, true).await?
            } else {
                store
                    .prune_batches(&policy, 1000, usize::MAX, std::time::Duration::ZERO, || {
                        false
                    })
                    .await?
            };
            let oldest = pass.oldest.map(|d| d.as_secs());
            if json {
                writeln!(
                    out,
                    "{}",
                    json!({
                        "dry_run": dry_run,
                        "jobs": pass.pruned.jobs,
                        "attempts": pass.pruned.attempts,
                        "oldest_ended_seconds_ago": oldest,
                    })
                )?;
            } else {
                let verb = if dry_run { "would prune" } else { "pruned" };
                let since = oldest.map_or(String::new(), |s| {
                    format!(
                        " (the oldest had ended {} ago)",
                        humantime::format_duration(std::time::Duration::from_secs(s))
                    )
                });
                writeln!(
                    out,
                    "{verb} {} ended jobs and {} attempts{since}",
                    pass.pruned.jobs, pass.pruned.attempts
                )?;
            }
        }
    }
    Ok(())
}

enum TokenFailure {
    Store(crate::store::StoreError),
    Refused(Failure),
}

impl From<crate::store::StoreError> for TokenFailure {
    fn from(e: crate::store::StoreError) -> Self {
        TokenFailure::Store(e)
    }
}

impl From<std::io::Error> for TokenFailure {
    fn from(e: std::io::Error) -> Self {
        TokenFailure::Refused(e.into())
    }
}

async fn tokens_command(
    store: &Store,
    command: TokensCommand,
    as_json: bool,
    out: &mut impl Write,
) -> Result<(), TokenFailure> {
    use crate::token::Token;
    match command {
        TokensCommand::Create {
            operator: Some(operator),
            reason,
            ..
        } => {
            crate::intent::Intent::check_owner_id(&operator)
                .map_err(|e| TokenFailure::Refused(Failure(format!("--operator: {e}"))))?;
            let token = Token::generate_operator();
            let id = store
                .create_operator_token(&operator, &token, &Actor::cli(reason.as_deref()))
                .await?;
            if as_json {
                writeln!(
                    out,
                    "{}",
                    json!({ "operator": operator, "token": token.reveal() })
                )?;
            } else {
                writeln!(out, "{}", token.reveal())?;
                eprintln!(
                    "operator token {id} for {operator}: shown this once, only its SHA-256 is stored"
                );
            }
        }
        TokensCommand::Create { owner, reason, .. } => {
            let owner = owner.unwrap_or_default();
            crate::intent::Intent::check_owner_id(&owner)
                .map_err(|e| TokenFailure::Refused(Failure(format!("--owner: {e}"))))?;
            let token = Token::generate();
            let id = store
                .create_token(&owner, &token, &Actor::cli(reason.as_deref()))
                .await?;
            if as_json {
                writeln!(
                    out,
                    "{}",
                    json!({ "owner_id": owner, "token": token.reveal() })
                )?;
            } else {
                writeln!(out, "{}", token.reveal())?;
                eprintln!(
                    "token {id} for owner {owner}: shown this once, only its SHA-256 is stored"
                );
            }
        }
        TokensCommand::List {
            operators: true, ..
        } => {
            let tokens = store.operator_tokens().await?;
            if as_json {
                writeln!(out, "{}", serde_json::to_value(&tokens).unwrap_or_default())?;
            } else if tokens.is_empty() {
                writeln!(out, "no operator tokens")?;
            } else {
                for t in &tokens {
                    writeln!(
                        out,
                        "{}  operator {}  created {}  {}",
                        t.id,
                        shown(&t.operator),
                        t.created_at.format("%Y-%m-%d %H:%M:%S UTC"),
                        token_state(t.revoked_at)
                    )?;
                }
            }
        }
        TokensCommand::List { owner, .. } => {
            let tokens = store.tokens(owner.as_deref()).await?;
            if as_json {
                writeln!(out, "{}", serde_json::to_value(&tokens).unwrap_or_default())?;
            } else if tokens.is_empty() {
                writeln!(out, "no tokens")?;
            } else {
                for t in &tokens {
                    writeln!(
                        out,
                        "{}  owner {}  created {}  {}",
                        t.id,
                        shown(&t.owner_id),
                        t.created_at.format("%Y-%m-%d %H:%M:%S UTC"),
                        token_state(t.revoked_at)
                    )?;
                }
            }
        }
        TokensCommand::Revoke { token_id, reason } => {
            let actor = Actor::cli(reason.as_deref());
            let (value, whose, revoked_at, already) =
                match store.revoke_token(token_id, &actor).await? {
                    Some((t, already)) => (
                        serde_json::to_value(&t).unwrap_or_default(),
                        format!("of owner {}", t.owner_id),
                        t.revoked_at,
                        already,
                    ),
                    None => match store.revoke_operator_token(token_id, &actor).await? {
                        Some((t, already)) => (
                            serde_json::to_value(&t).unwrap_or_default(),
                            format!("of operator {}", t.operator),
                            t.revoked_at,
                            already,
                        ),
                        None => {
                            return Err(TokenFailure::Refused(Failure(format!(
                                "token {token_id} not found"
                            ))));
                        }
                    },
                };
            if as_json {
                writeln!(out, "{value}")?;
            } else if already {
                let at = revoked_at
                    .map(|at| format!(" on {}", at.format("%Y-%m-%d %H:%M:%S UTC")))
                    .unwrap_or_default();
                writeln!(out, "token {token_id} {whose} was already revoked{at}")?;
            } else {
                writeln!(out, "token {token_id} {whose} revoked")?;
            }
        }
    }
    Ok(())
}

/// A token's state as `tokens list` prints it.
fn token_state(revoked_at: Option<chrono::DateTime<chrono::Utc>>) -> String {
    match revoked_at {
        Some(at) => format!("revoked {}", at.format("%Y-%m-%d %H:%M:%S UTC")),
        None => "active".into(),
    }
}

async fn dlq_command(
    config: &Config,
    conn: &lapin::Connection,
    store: Option<&Store>,
    command: DlqCommand,
    as_json: bool,
    out: &mut impl Write,
) -> Outcome {
    match (command, store) {
        (DlqCommand::List { queue, limit }, _) => {
            dlq_list(config, conn, queue.as_deref(), limit, as_json, out).await
        }
        (
            DlqCommand::Replay {
                queue, id, reason, ..
            },
            Some(store),
        ) => {
            let queues = dlq::select_queues(config, queue.as_deref())?;
            let action = Action {
                action: "dlq.replay",
                target: Some(queues.join(",")),
                detail: json!({ "message_id": id }),
                ..Action::default()
            };
            let audit = store
                .audit_begin(&Actor::cli(reason.as_deref()), &action)
                .await?;
            let mut counts = Counts::default();
            let result = dlq_replay(conn, &queues, id, &mut counts, as_json, out).await;
            let detail = json!({ "replayed": counts.replayed, "skipped": counts.skipped,
                "error": counts.broker_error });
            finish_audit(store, audit, counts.broker_error.is_some(), &detail).await;
            result
        }
        // (Without --yes it was refused before the database was asked.)
        (DlqCommand::Purge { queue, reason, .. }, Some(store)) => {
            let queues = dlq::select_queues(config, queue.as_deref())?;
            let action = Action {
                action: "dlq.purge",
                target: Some(queues.join(",")),
                ..Action::default()
            };
            let audit = store
                .audit_begin(&Actor::cli(reason.as_deref()), &action)
                .await?;
            let mut purged = serde_json::Map::new();
            let mut broker_error = None;
            let result =
                dlq_purge(conn, queues, &mut purged, &mut broker_error, as_json, out).await;
            let detail = json!({ "purged": purged, "error": broker_error });
            finish_audit(store, audit, broker_error.is_some(), &detail).await;
            result
        }
        (DlqCommand::Replay { .. } | DlqCommand::Purge { .. }, None) => Err(Failure(
            "a replay or a purge is recorded in the audit table first: the database is needed"
                .into(),
        )),
    }
}

/// What a replay did, for its audit row: the broker's error is what makes it
/// `failed` (a letter not found, one skipped, or a closed stdout does not).
#[derive(Default)]
struct Counts {
    replayed: usize,
    skipped: usize,
    broker_error: Option<String>,
}

/// Writes what came of an action begun with [`Store::audit_begin`]; if that
/// fails, says so (the row stays `pending`) but the action stands.
async fn finish_audit(store: &Store, audit: Uuid, failed: bool, detail: &serde_json::Value) {
    if let Err(e) = store.audit_outcome(audit, failed, detail).await {
        eprintln!(
            "warning: the outcome was not written to audit row {audit} (it stays pending): {e}"
        );
    }
}

/// `onejob dlq list`: browses without consuming.
async fn dlq_list(
    config: &Config,
    conn: &lapin::Connection,
    queue: Option<&str>,
    limit: usize,
    as_json: bool,
    out: &mut impl Write,
) -> Outcome {
    let mut all = Vec::new();
    for q in dlq::select_queues(config, queue)? {
        let letters = dlq::browse(conn, &q, limit).await?;
        if !as_json {
            let full = if letters.len() == limit {
                " (limit reached)"
            } else {
                ""
            };
            writeln!(out, "{q}: {} dead letter(s){full}", letters.len())?;
            for d in &letters {
                write_letter(out, d)?;
            }
        }
        all.extend(letters);
    }
    if as_json {
        writeln!(out, "{}", serde_json::to_value(&all)?)?;
    }
    Ok(())
}

/// One dead letter as `dlq list` shows it.
fn write_letter(out: &mut impl Write, d: &dlq::DeadLetter) -> std::io::Result<()> {
    let id = shown(d.message_id.as_deref().unwrap_or("-"));
    let age = d.age_seconds.map_or("-".to_owned(), |a| format!("{a}s"));
    writeln!(
        out,
        "  #{} id {id}  age {age}  from {}",
        d.position,
        origin(d)
    )?;
    writeln!(out, "     reason  {}", shown(&d.reason))?;
    for death in &d.deaths {
        writeln!(
            out,
            "     x-death {} ×{} in {}",
            shown(&death.reason),
            death.count,
            shown(&death.queue)
        )?;
    }
    writeln!(
        out,
        "     body    {} ({} bytes)",
        shown(&d.body_preview),
        d.body_bytes
    )
}

/// Where a dead letter says it was first published, as plain output shows it.
fn origin(d: &dlq::DeadLetter) -> String {
    shown(&format!(
        "{}/{}",
        d.original_exchange.as_deref().unwrap_or("?"),
        d.original_routing_key.as_deref().unwrap_or("?")
    ))
}

/// `onejob dlq replay`: one letter by id, or every letter present at the start.
async fn dlq_replay(
    conn: &lapin::Connection,
    queues: &[String],
    id: Option<String>,
    counts: &mut Counts,
    as_json: bool,
    out: &mut impl Write,
) -> Outcome {
    // clap requires exactly one of --id and --all.
    let selection = match id {
        Some(id) => dlq::Selection::Id(id),
        None => dlq::Selection::All,
    };
    let mut reports = Vec::new();
    let (replayed, skipped) = (&mut counts.replayed, &mut counts.skipped);
    for q in queues {
        let mut written = Ok(());
        let replay = dlq::replay(conn, q, &selection, |r| {
            match &r.outcome {
                dlq::ReplayOutcome::Replayed => *replayed += 1,
                dlq::ReplayOutcome::Skipped { .. } => *skipped += 1,
            }
            if as_json {
                reports.push(r);
            } else if written.is_ok() {
                written = report_replay(out, &r);
            }
        })
        .await;
        if let Err(e) = replay {
            counts.broker_error = Some(e.to_string());
            return Err(e.into());
        }
        written?;
        if matches!(selection, dlq::Selection::Id(_)) && *replayed + *skipped > 0 {
            break;
        }
    }
    let (replayed, skipped) = (*replayed, *skipped);
    if let dlq::Selection::Id(id) = &selection
        && replayed + skipped == 0
    {
        return Err(Failure(format!("no dead letter with message id {id:?}")));
    }
    if as_json {
        writeln!(
            out,
            "{}",
            json!({ "replayed": replayed, "skipped": skipped, "dead_letters": reports })
        )?;
    } else {
        writeln!(out, "{replayed} dead letter(s) replayed, {skipped} skipped")?;
    }
    if skipped > 0 {
        return Err(Failure(format!(
            "{skipped} dead letter(s) could not be replayed and were left in place (see above)"
        )));
    }
    Ok(())
}

/// `onejob dlq purge`: deletes (the caller has checked `--yes`), counting
/// into `purged` as it goes.
async fn dlq_purge(
    conn: &lapin::Connection,
    queues: Vec<String>,
    purged: &mut serde_json::Map<String, serde_json::Value>,
    broker_error: &mut Option<String>,
    as_json: bool,
    out: &mut impl Write,
) -> Outcome {
    for q in queues {
        let n = match dlq::purge(conn, &q).await {
            Ok(n) => n,
            Err(e) => {
                *broker_error = Some(e.to_string());
                return Err(e.into());
            }
        };
        purged.insert(q.clone(), json!(n));
        if !as_json {
            writeln!(out, "{q}: {n} dead letter(s) deleted")?;
        }
    }
    if as_json {
        writeln!(out, "{}", json!({ "purged": purged }))?;
    }
    Ok(())
}

/// A connection for one command, with the topology declared (as every program
/// does at start); fails at once, with the reason, if the broker is unreachable.
/// One line per dead letter a replay looked at, as it happens.
fn report_replay(out: &mut impl Write, r: &crate::dlq::ReplayReport) -> std::io::Result<()> {
    let d = &r.letter;
    let id = shown(d.message_id.as_deref().unwrap_or("-"));
    match &r.outcome {
        crate::dlq::ReplayOutcome::Replayed => writeln!(out, "replayed {id} to {}", origin(d)),
        crate::dlq::ReplayOutcome::Skipped { reason } => {
            writeln!(
                out,
                "skipped  {id} (#{} in {}): {}",
                d.position,
                d.queue,
                shown(reason)
            )
        }
    }
}

async fn broker_connection(c: &Connections, config: &Config) -> Result<lapin::Connection, String> {
    runtime::operator_connection(&c.amqp_url, config).await
}

async fn publish_now(
    c: &Connections,
    config: &Config,
    store: &Store,
    messages: &[crate::store::OutboxMessage],
) -> Result<(), String> {
    runtime::publish_now(&c.amqp_url, config, store, messages).await
}

fn print_job(
    out: &mut impl Write,
    job: &JobView,
    audit: &[AuditEntry],
    as_json: bool,
) -> std::io::Result<()> {
    if as_json {
        let mut value = serde_json::to_value(job).unwrap_or_default();
        if let Some(fields) = value.as_object_mut() {
            fields.insert(
                "audit".into(),
                serde_json::to_value(audit).unwrap_or_default(),
            );
        }
        return writeln!(out, "{value}");
    }
    writeln!(
        out,
        "job {}  {}  version {}",
        job.id, job.status, job.version
    )?;
    writeln!(out, "  owner        {}", shown(&job.owner_id))?;
    writeln!(out, "  key          {}", shown(&job.idempotency_key))?;
    writeln!(out, "  operation    {}", shown(&job.operation))?;
    writeln!(out, "  fingerprint  {}", job.request_fingerprint)?;
    writeln!(out, "  created      {}", job.created_at.to_rfc3339())?;
    writeln!(out, "  updated      {}", job.updated_at.to_rfc3339())?;
    if let Some(by) = job.completed_by {
        writeln!(out, "  completed by {by}")?;
    }
    if let Some(result) = &job.result {
        writeln!(out, "  result       {result}")?;
    }
    if let Some(error) = &job.error {
        writeln!(out, "  error        {}", shown(error))?;
    }
    writeln!(out, "  attempts     {}", job.attempts.len())?;
    for a in &job.attempts {
        writeln!(
            out,
            "    #{} {}  {:<9} {}",
            a.number,
            a.id,
            a.status,
            shown(&a.provider)
        )?;
        if let Some(e) = &a.error {
            writeln!(out, "       error    {}", shown(e))?;
        }
        if let Some(u) = &a.usage {
            writeln!(out, "       usage    {u}")?;
        }
        if let Some(r) = &a.provider_request_id {
            writeln!(out, "       request  {}", shown(r))?;
        }
    }
    let spent_elsewhere = job
        .attempts
        .iter()
        .filter(|a| a.usage.is_some() && a.status != AttemptStatus::Succeeded)
        .count();
    if spent_elsewhere > 0 {
        writeln!(
            out,
            "  note         {spent_elsewhere} attempt(s) besides the winner reported usage: duplicate or wasted spend"
        )?;
    }
    if !audit.is_empty() {
        writeln!(out, "  audit        {}", audit.len())?;
        for a in audit {
            let touched = a.attempt_id.map(|id| format!(" {id}")).unwrap_or_default();
            let why = if a.reason.is_empty() {
                "(no reason given)".to_owned()
            } else {
                format!("{:?}", a.reason)
            };
            writeln!(
                out,
                "    {}  {}  {}{touched}  {}",
                a.at.format("%Y-%m-%d %H:%M:%S UTC"),
                shown(&a.actor),
                shown(&a.action),
                shown(&why)
            )?;
        }
    }
    Ok(())
}
