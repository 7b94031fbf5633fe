//! Unknown attempts, and resolving one: a confirmation that says what the
//! route rule will do next, then the store's guarded resolve.

use crate::policy::next::{FailedJob, NextStep};
use std::collections::HashMap;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use minijinja::context;
use serde::Deserialize;
use uuid::Uuid;

use super::Console;
use super::action::{Acting, ActionForm};
use super::failure::Failure;
use super::page::age;
use super::session::Operator;
use crate::domain::{AttemptId, AttemptStatus};
use crate::edges::store::{EvidenceClaim, Refusal, Resolution};
use crate::shared::planner;
use crate::shared::runtime;

pub(super) async fn page(State(app): State<Console>, who: Operator) -> Response {
    let list = match app.0.store.jobs().unknowns().await {
        Ok(l) => l,
        Err(e) => return app.message(Some(&who), e.into()),
    };
    let claims = match app.0.store.evidence().latest_claims().await {
        Ok(c) => c,
        Err(e) => return app.message(Some(&who), e.into()),
    };
    let rows: Vec<_> = list
        .iter()
        .map(|u| {
            context! {
                attempt_id => u.attempt_id.to_string(),
                job_id => u.job_id.to_string(),
                number => u.number,
                provider => u.provider.clone(),
                request_id => u.provider_request_id.clone(),
                owner_id => u.owner_id.clone(),
                operation => u.operation.clone(),
                since => u.since.to_rfc3339(),
                age => age(u.age_seconds),
                error => u.error.clone(),
                evidence => evidence_state(&app, &claims, u),
            }
        })
        .collect();
    app.render(
        "unknowns.html",
        context! { title => "Unknowns", operator => who.name, csrf => who.csrf, unknowns => rows },
    )
}

/// An unknown's evidence as the page shows it: what its provider keeps and
/// whether it is used (off while a qualification found the claim false), the
/// looks taken, when the last ended and what it found, and the next look.
fn evidence_state(
    app: &Console,
    claims: &HashMap<String, EvidenceClaim>,
    u: &crate::edges::store::Unknown,
) -> minijinja::Value {
    let standing = app
        .0
        .config
        .providers
        .get(&u.provider)
        .map(|p| crate::shared::evidence::standing(p, claims.get(&p.name)));
    let kind = match &standing {
        Some(s) => format!(
            "{}: {}",
            s["kind"].as_str().unwrap_or_default(),
            s["why"].as_str().unwrap_or_default()
        ),
        None => "the provider is no longer configured: an operator resolves it".into(),
    };
    let next = u
        .evidence_next_at
        .filter(|_| u.evidence_looks > 0)
        .map(|t| t.to_rfc3339());
    context! {
        kind,
        looks => u.evidence_looks,
        last => u.evidence_last_at.map(|t| t.to_rfc3339()),
        found => u.evidence_note.clone(),
        next,
    }
}

#[derive(Deserialize)]
pub(super) struct ResolveQuery {
    #[serde(rename = "as")]
    resolution: Option<String>,
}

pub(super) fn resolution(text: Option<&str>) -> Option<Resolution> {
    match text {
        Some("failed") => Some(Resolution::Failed),
        Some("cancelled") => Some(Resolution::Cancelled),
        _ => None,
    }
}

/// The job of `attempt`, if the attempt is one an operator may resolve here:
/// it exists and is `unknown`. The refusal otherwise.
pub(super) async fn unknown_attempt(
    app: &Console,
    attempt: Uuid,
) -> Result<(crate::edges::store::JobView, usize), Failure> {
    let store = &app.0.store;
    let not_open = || {
        Failure(
            StatusCode::CONFLICT,
            format!("Attempt {attempt} is not open any more: there is nothing to resolve."),
        )
    };
    let job_id = store
        .jobs()
        .attempt_job(AttemptId(attempt))
        .await?
        .ok_or_else(|| {
            Failure(
                StatusCode::NOT_FOUND,
                format!("There is no attempt {attempt}."),
            )
        })?;
    let job = store.jobs().job(job_id).await?.ok_or_else(not_open)?;
    let index = job
        .attempts
        .iter()
        .position(|a| a.id.0 == attempt)
        .ok_or_else(not_open)?;
    let a = &job.attempts[index];
    // Only an unknown attempt: resolving one in flight would fail a call that
    // may yet answer and start another beside it. (An unknown attempt only
    // ever moves to a terminal state, so this cannot go stale but to refuse.)
    if a.status != AttemptStatus::Unknown || job.status.is_terminal() {
        return Err(Failure(
            StatusCode::CONFLICT,
            format!(
                "Attempt {attempt} is {}, not unknown: only an unknown attempt is resolved here.",
                a.status
            ),
        ));
    }
    Ok((job, index))
}

/// What resolving `attempt` as `resolution` will do, in words: which provider
/// the route rule picks next, or that the job ends.
pub(super) async fn consequence(
    app: &Console,
    attempt: Uuid,
    resolution: Resolution,
) -> Result<(crate::edges::store::JobView, String), Failure> {
    let store = &app.0.store;
    let (job, index) = unknown_attempt(app, attempt).await?;
    let a = &job.attempts[index];
    let text = match resolution {
        Resolution::Cancelled => format!(
            "Attempt #{} on {} becomes cancelled, and so does job {}: no attempt follows, \
             and a result that still arrives is discarded.",
            a.number, a.provider, job.id
        ),
        Resolution::Failed => {
            let config = &app.0.config;
            let planner = planner::load(config, store, [job.operation.as_str()]).await?;
            let failed = FailedJob {
                job_id: job.id,
                operation: job.operation.clone(),
                failed_provider: a.provider.clone(),
                attempts_made: u32::try_from(job.attempts.len()).unwrap_or(u32::MAX),
                error: "resolved_failed: an operator resolved this attempt as failed".into(),
                retryable: true,
                retry_after: None,
            };
            let what = format!("Attempt #{} on {} becomes failed.", a.number, a.provider);
            match planner.plan(&failed) {
                NextStep::Retry { provider, delay } if delay.is_zero() => {
                    format!(
                        "{what} The route rule then starts attempt #{} on {provider}, at once.",
                        job.attempts.len() + 1
                    )
                }
                NextStep::Retry { provider, delay } => format!(
                    "{what} The route rule then starts attempt #{} on {provider}, after a backoff of {}.",
                    job.attempts.len() + 1,
                    humantime::format_duration(Duration::from_secs(delay.as_secs().max(1)))
                ),
                NextStep::GiveUp { error } => {
                    format!(
                        "{what} No attempt follows: job {} fails with “{error}”.",
                        job.id
                    )
                }
            }
        }
    };
    Ok((job, text))
}

pub(super) async fn confirm_resolve(
    State(app): State<Console>,
    who: Operator,
    Path(id): Path<String>,
    Query(q): Query<ResolveQuery>,
) -> Response {
    let (Ok(attempt), Some(how)) = (id.parse::<Uuid>(), resolution(q.resolution.as_deref())) else {
        let text = "Say which attempt (its id) and how: ?as=failed or ?as=cancelled.".to_owned();
        return app.message(Some(&who), Failure(StatusCode::BAD_REQUEST, text));
    };
    match consequence(&app, attempt, how).await {
        Ok((job, text)) => app.render(
            "confirm.html",
            context! {
                title => "Resolve an unknown attempt",
                operator => who.name,
                csrf => who.csrf,
                attempt => attempt.to_string(),
                job_id => job.id.to_string(),
                how => q.resolution,
                consequence => text,
                error => None::<String>,
            },
        ),
        Err(f) => app.message(Some(&who), f),
    }
}

#[derive(Deserialize)]
pub(super) struct ResolveForm {
    csrf: Option<String>,
    #[serde(rename = "as")]
    resolution: Option<String>,
    #[serde(default)]
    reason: String,
}

impl ActionForm for ResolveForm {
    fn csrf(&self) -> Option<&str> {
        self.csrf.as_deref()
    }
    fn reason(&self) -> &str {
        &self.reason
    }
}

pub(super) async fn resolve(
    State(app): State<Console>,
    Path(id): Path<String>,
    acting: Acting<ResolveForm>,
) -> Response {
    let (who, form) = (&acting.who, &acting.form);
    let (Ok(attempt), Some(how)) = (id.parse::<Uuid>(), resolution(form.resolution.as_deref()))
    else {
        let text = "Say which attempt (its id) and how: failed or cancelled.".to_owned();
        return app.message(Some(who), Failure(StatusCode::BAD_REQUEST, text));
    };
    let store = &app.0.store;
    let config = &app.0.config;
    let (job_id, operation) = match unknown_attempt(&app, attempt).await {
        Ok((job, _)) => (job.id, job.operation),
        Err(f) => return app.message(Some(who), f),
    };
    let planner = match planner::load(config, store, [operation.as_str()]).await {
        Ok(p) => p,
        Err(e) => return app.message(Some(who), e.into()),
    };
    let plan = |f: &FailedJob| planner.plan(f);
    let publish = match store
        .settle()
        .resolve(AttemptId(attempt), how, &plan, &acting.actor())
        .await
    {
        Ok(Ok((_, publish))) => publish,
        Ok(Err(refusal @ (Refusal::NotFound(_) | Refusal::Terminal(_)))) => {
            let text = format!("{refusal}. Nothing was done.");
            return app.message(Some(who), Failure(StatusCode::CONFLICT, text));
        }
        Err(e) => return app.message(Some(who), e.into()),
    };
    // What the resolution wrote goes out now; if the broker is down, the
    // reconciler's relay sends it once the outbox lease ends.
    if let Err(e) = runtime::publish_now(&app.0.options.amqp_url, config, store, &publish).await {
        tracing::warn!(error = %e, "console: publishing a resolution failed; the relay will");
    }
    tracing::info!(operator = %who.name, %attempt, "console: resolved an attempt");
    Redirect::to(&format!("/jobs/{job_id}")).into_response()
}
