//! The job list: filters by status, owner, operation, provider and time,
//! paged by keyset.

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use minijinja::context;
use serde::Deserialize;
use uuid::Uuid;

use super::failure::Failure;
use super::page::given;
use super::session::Operator;
use super::{Console, PAGE};
use crate::domain::JobStatus;
use crate::edges::store::JobFilter;

#[derive(Deserialize, Default)]
pub(super) struct JobsQuery {
    status: Option<String>,
    owner: Option<String>,
    operation: Option<String>,
    provider: Option<String>,
    since: Option<String>,
    until: Option<String>,
    after: Option<String>,
}

pub(super) fn time(
    name: &str,
    v: &Option<String>,
) -> Result<Option<chrono::DateTime<chrono::Utc>>, String> {
    let Some(v) = given(v) else { return Ok(None) };
    chrono::DateTime::parse_from_rfc3339(&v)
        .map(|t| Some(t.with_timezone(&chrono::Utc)))
        .or_else(|_| {
            chrono::NaiveDateTime::parse_from_str(&v, "%Y-%m-%dT%H:%M").map(|t| Some(t.and_utc()))
        })
        .map_err(|_| format!("{name}: {v:?} is not a time (2026-12-04T10:00, UTC, or RFC 3339)"))
}

/// The filter and the keyset a query asks for, or what is wrong with it.
fn filter(q: &JobsQuery) -> Result<(JobFilter, Option<Uuid>), String> {
    let status = match given(&q.status) {
        None => None,
        Some(s) => match s.parse::<JobStatus>().ok() {
            Some(s) => Some(s),
            None => {
                return Err(format!("status: {s:?} is not a job status"));
            }
        },
    };
    let (since, until) = match (time("since", &q.since), time("until", &q.until)) {
        (Ok(s), Ok(u)) => (s, u),
        (Err(e), _) | (_, Err(e)) => return Err(e),
    };
    let after = match given(&q.after).map(|a| a.parse::<Uuid>()) {
        None => None,
        Some(Ok(a)) => Some(a),
        Some(Err(_)) => return Err("after: not a job id".to_owned()),
    };
    let filter = JobFilter {
        status,
        owner: given(&q.owner),
        operation: given(&q.operation),
        provider: given(&q.provider),
        since,
        until,
    };
    Ok((filter, after))
}

pub(super) async fn page(
    State(app): State<Console>,
    who: Operator,
    Query(q): Query<JobsQuery>,
) -> Response {
    let (filter, after) = match filter(&q) {
        Ok(f) => f,
        Err(text) => return app.message(Some(&who), Failure(StatusCode::BAD_REQUEST, text)),
    };
    let started = std::time::Instant::now();
    let lines = match app.0.store.jobs().page(&filter, after, PAGE + 1).await {
        Ok(l) => l,
        Err(e) => return app.message(Some(&who), e.into()),
    };
    let took_ms = started.elapsed().as_secs_f64() * 1000.0;
    let more = lines.len() as i64 > PAGE;
    let lines: Vec<_> = lines.into_iter().take(PAGE as usize).collect();
    // The pages' links keep the filters; the next moves the keyset past the
    // last row shown.
    let link = |after: Option<Uuid>| {
        let mut link = url::form_urlencoded::Serializer::new(String::new());
        for (k, v) in [
            ("status", given(&q.status)),
            ("owner", filter.owner.clone()),
            ("operation", filter.operation.clone()),
            ("provider", filter.provider.clone()),
            ("since", given(&q.since)),
            ("until", given(&q.until)),
            ("after", after.map(|a| a.to_string())),
        ] {
            if let Some(v) = v {
                link.append_pair(k, &v);
            }
        }
        format!("/jobs?{}", link.finish())
    };
    let next = more.then(|| link(lines.last().map(|l| l.id)));
    let first = link(None);
    app.render(
        "jobs.html",
        context! {
            title => "Jobs",
            operator => who.name,
            csrf => who.csrf,
            jobs => minijinja::Value::from(minijinja::value::Serde(&lines)),
            next => next,
            first => first,
            took_ms => format!("{took_ms:.1}"),
            statuses => ["queued", "running", "unknown", "succeeded", "failed", "cancelled"],
            operations => app.0.config.operations.keys().cloned().collect::<Vec<_>>(),
            providers => app.0.config.provider_names(),
            q => context! {
                status => given(&q.status).unwrap_or_default(),
                owner => given(&q.owner).unwrap_or_default(),
                operation => given(&q.operation).unwrap_or_default(),
                provider => given(&q.provider).unwrap_or_default(),
                since => given(&q.since).unwrap_or_default(),
                until => given(&q.until).unwrap_or_default(),
                paged => after.is_some(),
            },
        },
    )
}
