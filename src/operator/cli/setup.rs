//! The commands that set a deployment up and check it: `migrate`, `queues
//! upgrade`, `config check`.

use std::io::Write;

use clap::Subcommand;
use serde_json::json;

use super::{Connections, Failure, Outcome, store};
use crate::broker;
use crate::edges::store::Store;

#[derive(Subcommand, Debug)]
pub(super) enum QueuesCommand {
    /// Redeclare work queues declared by an older version (or with another
    /// delivery limit) with this version's arguments. Run it with the fleet
    /// stopped. A queue is deleted and declared again only when it is empty and
    /// has no consumer (the broker checks both); one that holds messages is left
    /// as it is and named, with exit 1: drain it with the old version first.
    Upgrade,
}

#[derive(Subcommand, Debug)]
pub(super) enum ConfigCommand {
    /// Load and validate the configuration; print a summary.
    Check,
}

/// `onejob migrate`.
pub(super) async fn migrate(c: &Connections, json: bool, out: &mut impl Write) -> Outcome {
    let config = c.load_config()?;
    Store::ensure_database(&c.database_url)
        .await
        .map_err(|e| Failure(e.describe(&c.database_url)))?;
    let store = store(c, &config).await?;
    store.migrate().await?;
    let applied = crate::edges::store::MIGRATOR.iter().count();
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

/// `onejob queues upgrade`.
pub(super) async fn queues_upgrade(c: &Connections, json: bool, out: &mut impl Write) -> Outcome {
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
pub(super) async fn config_check(c: &Connections, json: bool, out: &mut impl Write) -> Outcome {
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
                "shutdown_grace_seconds": config.worker.shutdown_grace.as_secs_f64(),
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
        writeln!(
            out,
            "shutdown grace: {} (how long a stopping worker lets its work in flight finish)",
            humantime::format_duration(config.worker.shutdown_grace)
        )?;
        for w in &config.warnings {
            writeln!(out, "warning: {w}")?;
        }
    }
    Ok(())
}
