//! `onejob attempts resolve`: settle an open attempt out of band, and publish
//! what the resolution caused.

use std::io::Write;
use std::sync::Arc;

use clap::{Subcommand, ValueEnum};
use serde_json::json;
use uuid::Uuid;

use super::{Connections, Failure, Outcome, publish_now, store};
use crate::domain::AttemptId;
use crate::policy::Planner;
use crate::store::{Actor, Refusal, Resolution, Settled};

#[derive(Subcommand, Debug)]
pub(super) enum AttemptsCommand {
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
pub(super) enum ResolveAs {
    Failed,
    Cancelled,
}

/// `onejob attempts …`.
pub(super) async fn run(
    c: &Connections,
    command: AttemptsCommand,
    json: bool,
    out: &mut impl Write,
) -> Outcome {
    match command {
        AttemptsCommand::Resolve {
            attempt_id,
            resolution,
            reason,
        } => {
            let actor = Actor::cli(reason.as_deref());
            resolve(c, attempt_id, resolution, &actor, json, out).await
        }
    }
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
