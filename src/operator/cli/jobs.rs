//! `onejob jobs …`: list, show, find, cancel and prune jobs.

use std::io::Write;

use clap::{Args, Subcommand};
use serde_json::json;

use super::printed::job::{Job as PrintedJob, Listed, Shown};
use uuid::Uuid;

use super::{Connections, Failure, Outcome, publish_now, shown, store};
use crate::domain::{AttemptStatus, JobId, JobStatus};
use crate::edges::store::{Actor, AuditEntry, JobQuery, JobSummary, JobView, OwnerView, Store};
use crate::settings::config::Config;

#[derive(Subcommand, Debug)]
pub(super) enum JobsCommand {
    /// List jobs, newest first, a page at a time: by status, owner, provider
    /// or age.
    ///
    /// Every job, or those the filters pick (each given must hold). One line a
    /// job: id, status, owner, key, operation, attempts, created, updated.
    /// When more jobs follow, the last line says where the next page starts
    /// (`more: --after <id>`; with `--json`, `{"jobs": [...], "next_after"}`):
    /// run the same command with it.
    List(ListArgs),
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

/// `onejob jobs list`'s filters and page.
#[derive(Args, Debug)]
pub(super) struct ListArgs {
    /// Only jobs in this status: queued, running, unknown, succeeded, failed or
    /// cancelled (repeatable, or comma-separated: `--status unknown,running`).
    #[arg(long, value_name = "S", value_delimiter = ',', value_parser = job_status)]
    status: Vec<JobStatus>,
    /// Only this owner's jobs.
    #[arg(long, value_name = "O")]
    owner: Option<String>,
    /// Only jobs with an attempt on this provider.
    #[arg(long, value_name = "P")]
    provider: Option<String>,
    /// Only jobs created longer ago than this (e.g. "1h").
    #[arg(long, value_name = "D", value_parser = humantime::parse_duration)]
    older_than: Option<std::time::Duration>,
    /// Only jobs created at most this long ago (e.g. "15m").
    #[arg(long, value_name = "D", value_parser = humantime::parse_duration)]
    newer_than: Option<std::time::Duration>,
    /// At most this many jobs on the page, 1 to 1000.
    #[arg(long, value_name = "N", default_value_t = 50,
          value_parser = clap::value_parser!(i64).range(1..=MAX_PAGE))]
    limit: i64,
    /// Start after this job: the id the page before ended with (`more:
    /// --after <id>`), so the page holds the jobs created before it.
    #[arg(long, value_name = "JOB_ID")]
    after: Option<Uuid>,
}

/// The most jobs one page of `jobs list` holds.
const MAX_PAGE: i64 = 1000;

/// A job status as the contract spells it, or why not.
fn job_status(text: &str) -> Result<JobStatus, String> {
    text.parse().map_err(|_| {
        let all: Vec<&str> = JobStatus::ALL.iter().map(|s| s.as_str()).collect();
        format!("not a job status; one of {}", all.join(", "))
    })
}

/// `onejob jobs …`.
pub(super) async fn run(
    c: &Connections,
    command: JobsCommand,
    json: bool,
    out: &mut impl Write,
) -> Outcome {
    let config = c.load_config()?;
    match command {
        JobsCommand::List(args) => {
            let store = store(c, &config).await?;
            list(&store, args, json, out).await?;
        }
        JobsCommand::Show { job_id } => {
            let store = store(c, &config).await?;
            let job = store.jobs().job(JobId(job_id)).await?;
            let job = job.ok_or_else(|| Failure(format!("job {job_id} not found")))?;
            let audit = store.audit().of_job(job.id).await?;
            let owner = store.owners().owner(&job.owner_id).await?;
            print_job(out, &job, &owner, &audit, json)?;
        }
        JobsCommand::Cancel { job_id, reason } => {
            let store = store(c, &config).await?;
            cancel(c, &config, &store, job_id, reason.as_deref(), json, out).await?;
        }
        JobsCommand::Find { owner, key } => {
            let store = store(c, &config).await?;
            let job = store.jobs().find(&owner, &key).await?;
            let job =
                job.ok_or_else(|| Failure(format!("no job for owner {owner:?} and key {key:?}")))?;
            let audit = store.audit().of_job(job.id).await?;
            let owner = store.owners().owner(&job.owner_id).await?;
            print_job(out, &job, &owner, &audit, json)?;
        }
        JobsCommand::Prune {
            older_than,
            dry_run,
        } => prune(c, &config, older_than, dry_run, json, out).await?,
    }
    Ok(())
}

/// `onejob jobs list`: one page, newest first, and where the next starts.
async fn list(store: &Store, args: ListArgs, json: bool, out: &mut impl Write) -> Outcome {
    let query = JobQuery {
        statuses: args.status,
        owner: args.owner,
        provider: args.provider,
        older_than: args.older_than,
        newer_than: args.newer_than,
        after: args.after.map(JobId),
    };
    // One job more than the page holds says whether another page follows.
    let mut jobs = store.jobs().list(&query, args.limit + 1).await?;
    let page = usize::try_from(args.limit).unwrap_or(usize::MAX);
    let more = jobs.len() > page;
    jobs.truncate(page);
    let next_after = more.then(|| jobs.last().map(|j| j.id)).flatten();
    if json {
        let listed: Vec<Listed> = jobs.iter().map(Listed::from).collect();
        writeln!(
            out,
            "{}",
            json!({ "jobs": listed, "next_after": next_after })
        )?;
        return Ok(());
    }
    if jobs.is_empty() {
        writeln!(out, "no jobs")?;
    }
    for job in &jobs {
        write_line(out, job)?;
    }
    if let Some(after) = next_after {
        writeln!(out, "more: --after {after}")?;
    }
    Ok(())
}

/// One job as `jobs list` prints it, its outside text escaped.
fn write_line(out: &mut impl Write, job: &JobSummary) -> std::io::Result<()> {
    let at =
        |t: &chrono::DateTime<chrono::Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    writeln!(
        out,
        "{}  {:<9}  owner {}  key {}  {}  attempts {}  created {}  updated {}",
        job.id,
        job.status.as_str(),
        shown(&job.owner_id),
        shown(&job.idempotency_key),
        shown(&job.operation),
        job.attempt_count,
        at(&job.created_at),
        at(&job.updated_at)
    )
}

/// `onejob jobs cancel`: cancels, then publishes the job's event now (or
/// leaves it to the reconciler's relay if the broker is down).
async fn cancel(
    c: &Connections,
    config: &Config,
    store: &Store,
    job_id: Uuid,
    reason: Option<&str>,
    json: bool,
    out: &mut impl Write,
) -> Outcome {
    let actor = Actor::cli(reason);
    let publish = match store.jobs().cancel(JobId(job_id), &actor).await? {
        Ok(p) => p,
        Err(refusal) => return Err(Failure(refusal.to_string())),
    };
    let published = match publish_now(c, config, store, &publish).await {
        Ok(()) => true,
        Err(e) => {
            eprintln!("onejob: warning: {e}; the reconciler will publish the event");
            false
        }
    };
    let job = store.jobs().job(JobId(job_id)).await?;
    if json {
        writeln!(
            out,
            "{}",
            json!({ "cancelled": true, "event_published": published, "job": job.as_ref().map(PrintedJob::from) })
        )?;
    } else {
        writeln!(
            out,
            "job {job_id} cancelled; a result still in flight will be discarded"
        )?;
    }
    Ok(())
}

/// `onejob jobs prune`: past `--older-than`, or the configured retention.
async fn prune(
    c: &Connections,
    config: &Config,
    older_than: Option<std::time::Duration>,
    dry_run: bool,
    json: bool,
    out: &mut impl Write,
) -> Outcome {
    let policy = match older_than {
        Some(age) if age.is_zero() => {
            return Err(Failure(
                "--older-than: must be greater than zero".to_owned(),
            ));
        }
        Some(age) => crate::edges::store::Policy::older_than(age),
        None => crate::edges::store::Policy::of(config),
    };
    let store = store(c, config).await?;
    let pass = if dry_run {
        store
            .retention()
            .prune_jobs(&policy, i64::MAX, true)
            .await?
    } else {
        store
            .retention()
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
    Ok(())
}

/// A job, its attempts, its owner's limits and its audit rows.
fn print_job(
    out: &mut impl Write,
    job: &JobView,
    owner: &OwnerView,
    audit: &[AuditEntry],
    as_json: bool,
) -> std::io::Result<()> {
    if as_json {
        let value = serde_json::to_value(Shown::of(job, owner, audit)).unwrap_or_default();
        return writeln!(out, "{value}");
    }
    writeln!(
        out,
        "job {}  {}  version {}",
        job.id, job.status, job.version
    )?;
    writeln!(out, "  owner        {}", shown(&job.owner_id))?;
    writeln!(out, "  its limits   {}", super::owners::limits_line(owner))?;
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
    write_attempts(out, job)?;
    write_audit(out, audit)
}

/// A job's attempts, and a note when any besides the winner reported usage.
fn write_attempts(out: &mut impl Write, job: &JobView) -> std::io::Result<()> {
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
        if a.status == AttemptStatus::Queued && a.held {
            writeln!(
                out,
                "       waits    its turn: the owner has its share of the provider's queue, or its max_in_flight, out"
            )?;
        }
        if a.status == AttemptStatus::Queued && a.not_before > chrono::Utc::now() {
            let why = match a.number {
                1 => "its turn under the owner's rate",
                _ => "the backoff after the attempt before it",
            };
            writeln!(
                out,
                "       waits    until {} for {why}",
                a.not_before.format("%Y-%m-%d %H:%M:%S%.3f UTC")
            )?;
        }
        if let Some(u) = &a.usage {
            writeln!(out, "       usage    {u}")?;
        }
        if let Some(r) = &a.provider_request_id {
            writeln!(out, "       request  {}", shown(r))?;
        }
        if a.evidence_looks > 0 {
            let next = match a.evidence_next_at {
                Some(t) if a.status == AttemptStatus::Unknown => {
                    format!(", next look {}", t.format("%Y-%m-%d %H:%M:%S UTC"))
                }
                _ => String::new(),
            };
            let last = a
                .evidence_last_at
                .map(|t| format!(" (the last at {})", t.format("%Y-%m-%d %H:%M:%S UTC")))
                .unwrap_or_default();
            writeln!(
                out,
                "       evidence {} look(s){last}: {}{next}",
                a.evidence_looks,
                shown(a.evidence_note.as_deref().unwrap_or("-"))
            )?;
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
    Ok(())
}

/// The audit rows that touched a job: when, who, what, and why.
fn write_audit(out: &mut impl Write, audit: &[AuditEntry]) -> std::io::Result<()> {
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
