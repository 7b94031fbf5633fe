//! One job: its attempts on a timeline (a lane per concurrent attempt), its
//! history oldest first, and its audit rows.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use minijinja::context;
use uuid::Uuid;

use super::Console;
use super::failure::Failure;
use super::session::Operator;
use super::timeline::Timeline;
use crate::domain::JobId;

pub(super) async fn page(
    State(app): State<Console>,
    who: Operator,
    Path(id): Path<String>,
) -> Response {
    let Ok(id) = id.parse::<Uuid>() else {
        let text = format!("{id:?} is not a job id");
        return app.message(Some(&who), Failure(StatusCode::BAD_REQUEST, text));
    };
    let store = &app.0.store;
    let (job, audit) =
        match tokio::try_join!(store.jobs().job(JobId(id)), store.audit().of_job(JobId(id))) {
            Ok((Some(job), audit)) => (job, audit),
            Ok((None, _)) => {
                let text =
                    format!("There is no job {id} (it may have been pruned after its retention).");
                return app.message(Some(&who), Failure(StatusCode::NOT_FOUND, text));
            }
            Err(e) => return app.message(Some(&who), e.into()),
        };
    let messages = match store.jobs().job_messages(&job).await {
        Ok(m) => m,
        Err(e) => return app.message(Some(&who), e.into()),
    };
    let Timeline { attempts, lanes } = Timeline::of(&job);
    let events = super::history::events(&job, &audit, &messages);
    let pretty = |v: &serde_json::Value| serde_json::to_string_pretty(v).unwrap_or_default();
    app.render(
        "job.html",
        context! {
            title => format!("Job {id}"),
            operator => who.name,
            csrf => who.csrf,
            job => context! {
                id => job.id.to_string(),
                owner_id => job.owner_id.clone(),
                key => job.idempotency_key.clone(),
                operation => job.operation.clone(),
                status => job.status.as_str(),
                version => job.version,
                created => job.created_at.to_rfc3339(),
                updated => job.updated_at.to_rfc3339(),
                input => pretty(&job.input),
                result => job.result.as_ref().map(pretty),
                error => job.error.clone(),
            },
            attempts,
            lanes,
            events,
            audit => minijinja::Value::from(minijinja::value::Serde(&audit)),
        },
    )
}
