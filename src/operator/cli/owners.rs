//! `onejob owners …`: each owner's limits (its own over `[owners]`) and what
//! it spent. Every change is audited.

use std::io::Write;

use clap::Subcommand;

use super::printed::owner::Owner;
use super::{Connections, Failure, Outcome, shown, store};
use crate::edges::store::{Actor, OwnerChange, OwnerView, StoreError};
use crate::settings::config::{
    MAX_COUNT, MAX_DAILY_TOKENS, MAX_RATE, OwnerLimits, OwnerOverrides, parse_limit,
};

#[derive(Subcommand, Debug)]
pub(super) enum OwnersCommand {
    /// List the owners with settings of their own or spend over the last 24
    /// hours: their limits (`*` marks an owner's own setting; 0 is no limit),
    /// their spend and their attempts waiting (first attempts, retries and
    /// hedges not yet sent to the provider's queue: held past the owner's
    /// share or under its `max_in_flight`, or not yet due under its rate or a
    /// retry's backoff).
    List,
    /// Show one owner's limits, spend and waiting jobs. An owner onejob has not
    /// seen has `[owners]`'s limits.
    Show {
        /// The owner.
        owner: String,
    },
    /// Give an owner limits of its own, over `[owners]`'s. Each takes a number
    /// (0: no limit for this owner) or `default` (`[owners]`'s again). The change
    /// and its audit row commit together; the fleet applies it from its next
    /// admission (rate, budget) or dispatch (in flight).
    Set {
        /// The owner.
        owner: String,
        /// Calls that may still run at once for this owner, across the fleet
        /// (attempts started or unknown until settled, hedges, queued retries).
        #[arg(long, value_name = "N", value_parser = count, allow_negative_numbers = true)]
        max_in_flight: Option<Setting<i64>>,
        /// Intents admitted per second (a token bucket); more wait their turn.
        #[arg(long, value_name = "R", value_parser = rate, allow_negative_numbers = true)]
        rate: Option<Setting<f64>>,
        /// What the bucket holds at most (0: one second's worth).
        #[arg(long, value_name = "B", value_parser = count, allow_negative_numbers = true)]
        burst: Option<Setting<i64>>,
        /// Provider-reported tokens over a rolling 24 hours, discarded attempts'
        /// included; past it new intents are rejected (`budget_exceeded`).
        #[arg(long, value_name = "T", value_parser = daily_tokens, allow_negative_numbers = true)]
        daily_tokens: Option<Setting<i64>>,
        /// Why, for the audit table (required).
        #[arg(long)]
        reason: String,
    },
}

/// A setting's new value: a number, or `None` for `[owners]`'s.
#[derive(Clone, Copy, Debug)]
pub(super) struct Setting<T>(Option<T>);

fn count(text: &str) -> Result<Setting<i64>, String> {
    parse_limit(text, MAX_COUNT).map(Setting)
}

fn daily_tokens(text: &str) -> Result<Setting<i64>, String> {
    parse_limit(text, MAX_DAILY_TOKENS).map(Setting)
}

fn rate(text: &str) -> Result<Setting<f64>, String> {
    parse_limit(text, MAX_RATE).map(Setting)
}

/// `onejob owners …`.
pub(super) async fn run(
    c: &Connections,
    command: OwnersCommand,
    json: bool,
    out: &mut impl Write,
) -> Outcome {
    let config = c.load_config()?;
    let store = store(c, &config).await?;
    let migrate_first = |e: StoreError| {
        if e.is_undefined_table() {
            Failure("the database has no owners table yet: run `onejob migrate` (or start a worker) first".into())
        } else {
            Failure(e.to_string())
        }
    };
    match command {
        OwnersCommand::List => {
            let owners = store.owners().list_owners().await.map_err(migrate_first)?;
            if json {
                let printed: Vec<Owner> = owners.iter().map(Owner::from).collect();
                writeln!(out, "{}", serde_json::to_value(&printed)?)?;
            } else if owners.is_empty() {
                writeln!(
                    out,
                    "no owner has settings of its own or spend over the last 24 hours; [owners]: {}",
                    settings_line(&config.owners, &OwnerOverrides::default())
                )?;
            } else {
                for o in &owners {
                    writeln!(out, "{}  {}", shown(&o.owner_id), limits_line(o))?;
                }
            }
        }
        OwnersCommand::Show { owner } => {
            let view = store.owners().owner(&owner).await.map_err(migrate_first)?;
            print_one(&view, json, out)?;
        }
        OwnersCommand::Set {
            owner,
            max_in_flight,
            rate,
            burst,
            daily_tokens,
            reason,
        } => {
            crate::intent::Intent::check_owner_id(&owner)
                .map_err(|e| Failure(format!("OWNER: {e}")))?;
            let change = OwnerChange {
                max_in_flight: max_in_flight.map(|s| s.0),
                rate: rate.map(|s| s.0),
                burst: burst.map(|s| s.0),
                daily_tokens: daily_tokens.map(|s| s.0),
            };
            if change == OwnerChange::default() {
                return Err(Failure(
                    "nothing to set: give --max-in-flight, --rate, --burst or --daily-tokens"
                        .into(),
                ));
            }
            if reason.trim().is_empty() {
                return Err(Failure("--reason must say why, for the audit table".into()));
            }
            let (view, _) = store
                .owners()
                .set(&owner, &change, &Actor::cli(Some(&reason)))
                .await
                .map_err(migrate_first)?;
            print_one(&view, json, out)?;
        }
    }
    Ok(())
}

fn print_one(view: &OwnerView, json: bool, out: &mut impl Write) -> std::io::Result<()> {
    if json {
        return writeln!(
            out,
            "{}",
            serde_json::to_value(Owner::from(view)).unwrap_or_default()
        );
    }
    writeln!(out, "owner {}", shown(&view.owner_id))?;
    writeln!(out, "  {}", limits_line(view))?;
    if let Some(left) = view.left {
        writeln!(
            out,
            "  budget {}: spent {} + reserved {}, {left} left",
            view.limits.daily_tokens, view.spent_24h, view.reserved
        )?;
        if left == 0 {
            writeln!(
                out,
                "  its budget is taken: new intents are rejected (budget_exceeded) until reservations end or spend leaves the window"
            )?;
        }
    }
    match view.updated_at {
        Some(at) => writeln!(
            out,
            "  own settings last changed {} (`*`); the rest are [owners]'s",
            at.format("%Y-%m-%d %H:%M:%S UTC")
        ),
        None => writeln!(out, "  no settings of its own: [owners]'s limits"),
    }
}

/// An owner's limits, spend, reservations, what its budget leaves (`-` for
/// no budget) and waiting jobs on one line; `*` marks its own
/// settings, and 0 is "no limit".
pub(super) fn limits_line(v: &OwnerView) -> String {
    format!(
        "{}  spent_24h {}  reserved {}  left {}  waiting {}",
        settings_line(&v.limits, &v.own),
        v.spent_24h,
        v.reserved,
        v.left.map_or_else(|| "-".to_owned(), |n| n.to_string()),
        v.waiting
    )
}

/// Limits on one line; `*` marks the settings in `own`.
fn settings_line(limits: &OwnerLimits, own: &OwnerOverrides) -> String {
    let mark = |own: bool| if own { "*" } else { "" };
    let limit = |n: i64| {
        if n == 0 {
            "none".to_owned()
        } else {
            n.to_string()
        }
    };
    let rate = match limits.bucket() {
        Some((r, b)) => format!("{r}/s burst {b}"),
        None => "none".into(),
    };
    format!(
        "max_in_flight {}{}  rate {}{}{}  daily_tokens {}{}",
        limit(limits.max_in_flight),
        mark(own.max_in_flight.is_some()),
        rate,
        mark(own.rate.is_some()),
        mark(own.burst.is_some()),
        limit(limits.daily_tokens),
        mark(own.daily_tokens.is_some()),
    )
}
