//! `onejob dlq …`: browse dead letters without consuming them, replay them to
//! their own work queue, or purge them; a replay or a purge is audited first.

use std::io::Write;

use clap::Subcommand;
use serde_json::json;
use uuid::Uuid;

use super::{Connections, Failure, Outcome, broker_connection, shown, store};
use crate::edges::store::{Action, Actor, Store};
use crate::settings::config::Config;
use crate::shared::dlq;

#[derive(Subcommand, Debug)]
pub(super) enum DlqCommand {
    /// Browse dead letters without consuming them: reason, x-death, original
    /// routing, age and a body preview. Without QUEUE, every dead-letter queue.
    List {
        /// A dead-letter queue (or its work queue), e.g. onejob.intents.dlq.
        queue: Option<String>,
        /// Show at most this many per queue (at most 10000: a listing keeps
        /// about a kilobyte of each, and one letter's body at a time).
        #[arg(long, default_value_t = crate::shared::dlq::DEFAULT_LIMIT,
              value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=10_000))]
        limit: usize,
    },
    /// Republish dead letters to the work queue their dead-letter queue belongs
    /// to (Q.dlq → Q, with a confirm), then remove them. Say which: --id
    /// MESSAGE-ID or --all.
    ///
    /// A letter goes only to that work queue, through the onejob exchange, never
    /// to a destination its own headers name: a letter whose headers name another
    /// is skipped, with its reason, and left in place (exit 1).
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

/// `onejob dlq …`. A replay or a purge is recorded in the audit table before
/// it is done: it needs the database as well as the broker.
pub(super) async fn run(
    c: &Connections,
    command: DlqCommand,
    json: bool,
    out: &mut impl Write,
) -> Outcome {
    let config = c.load_config()?;
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
        DlqCommand::Replay { .. } | DlqCommand::Purge { .. } => Some(store(c, &config).await?),
    };
    let conn = broker_connection(c, &config).await.map_err(Failure)?;
    let result = dlq_command(&config, &conn, audit.as_ref(), command, json, out).await;
    let _ = conn.close(200, "done".into()).await;
    result
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
                .audit()
                .begin(&Actor::cli(reason.as_deref()), &action)
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
                .audit()
                .begin(&Actor::cli(reason.as_deref()), &action)
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

/// Writes what came of an action begun with [`Audit::begin`](crate::edges::store::Audit::begin); if that
/// fails, says so (the row stays `pending`) but the action stands.
async fn finish_audit(store: &Store, audit: Uuid, failed: bool, detail: &serde_json::Value) {
    if let Err(e) = store.audit().outcome(audit, failed, detail).await {
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

/// One line per dead letter a replay looked at, as it happens.
fn report_replay(
    out: &mut impl Write,
    r: &crate::shared::dlq::ReplayReport,
) -> std::io::Result<()> {
    let d = &r.letter;
    let id = shown(d.message_id.as_deref().unwrap_or("-"));
    match &r.outcome {
        crate::shared::dlq::ReplayOutcome::Replayed => {
            writeln!(out, "replayed {id} to {}", origin(d))
        }
        crate::shared::dlq::ReplayOutcome::Skipped { reason } => {
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
