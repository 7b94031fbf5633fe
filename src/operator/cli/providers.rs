//! `onejob providers …`: list providers with their qualification state, and
//! qualify one against an operation's golden cases (audited before the first
//! paid call).

use std::io::Write;

use clap::Subcommand;
use serde_json::json;

use super::{Connections, Failure, Outcome, shown, store};
use crate::domain::Qualification;
use crate::edges::store::Actor;

#[derive(Subcommand, Debug)]
pub(super) enum ProvidersCommand {
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

/// `onejob providers …`.
pub(super) async fn run(
    c: &Connections,
    command: ProvidersCommand,
    json: bool,
    out: &mut impl Write,
) -> Outcome {
    match command {
        ProvidersCommand::List => list(c, json, out).await,
        ProvidersCommand::Qualify {
            provider,
            operation,
            reason,
        } => {
            let actor = Actor::cli(reason.as_deref());
            qualify(c, provider, operation, &actor, json, out).await
        }
    }
}

/// `onejob providers list`.
async fn list(c: &Connections, json: bool, out: &mut impl Write) -> Outcome {
    let config = c.load_config()?;
    let store = store(c, &config).await?;
    let states = crate::shared::qualify::states(&config, &store).await?;
    let claims = store.evidence().latest_claims().await?;
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
                            .unwrap_or(crate::shared::qualify::State::NeverQualified);
                        json!({
                            "operation": o.name,
                            "position": i,
                            "role": if i == 0 { "primary" } else { "failover" },
                            "qualification": state,
                            "eligible": i == 0 || state == crate::shared::qualify::State::Qualified,
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
                "evidence": crate::shared::evidence::standing(p, claims.get(&p.name)),
            })
        })
        .collect();
    if json {
        writeln!(out, "{}", serde_json::Value::Array(rows))?;
    } else {
        write_list(out, &rows)?;
    }
    Ok(())
}

/// `onejob providers qualify`.
async fn qualify(
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
            .audit()
            .begin(actor, &crate::shared::qualify::action(p, op))
            .await
            .map_err(|e| {
                Failure(format!(
                    "{e}: nothing was done, the run could not be recorded first"
                ))
            })?;
        let (report, recorded) =
            crate::shared::qualify::run_audited(&store, &config, p, op, audit).await;
        recorded?;
        reports.push(report);
    }
    let all_passed = reports.iter().all(|r| r.passed);
    if json {
        writeln!(out, "{}", serde_json::to_value(&reports)?)?;
    } else {
        for r in &reports {
            write_report(out, r)?;
        }
        if p.evidence.kind != crate::settings::config::EvidenceKind::None {
            let claims = store.evidence().latest_claims().await?;
            let standing = crate::shared::evidence::standing(p, claims.get(&p.name));
            let why = standing["why"].as_str().unwrap_or_default();
            writeln!(
                out,
                "evidence {}: {}",
                standing["kind"].as_str().unwrap_or_default(),
                shown(why)
            )?;
        }
    }
    if !all_passed {
        return Err(Failure(format!(
            "{provider} did not qualify for every operation"
        )));
    }
    Ok(())
}

/// One qualification run as plain output shows it: the verdict, then a line
/// per golden case.
fn write_report(out: &mut impl Write, r: &Qualification) -> std::io::Result<()> {
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
    Ok(())
}

/// `providers list` as plain output: a provider per line, then its
/// operations and its evidence.
fn write_list(out: &mut impl Write, rows: &[serde_json::Value]) -> std::io::Result<()> {
    for r in rows {
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
        let e = &r["evidence"];
        writeln!(
            out,
            "  evidence {}: {}",
            s(&e["kind"]),
            shown(&s(&e["why"]))
        )?;
    }
    Ok(())
}
