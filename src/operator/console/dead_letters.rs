//! Dead letters: browse each queue, confirm, then replay or purge, each
//! action audited before the broker is touched.

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use minijinja::context;
use serde::Deserialize;
use uuid::Uuid;

use super::Console;
use super::action::{Acting, ActionForm, done_banner, finish_action};
use super::failure::{Failure, Refused};
use super::overview::broker_connection;
use super::page::{age, given};
use super::session::Operator;
use crate::broker;
use crate::edges::store::Action;
use crate::shared::dlq;

/// A broker connection for one page or action, or the page that says why
/// there is none.
pub(super) async fn broker_for(
    app: &Console,
    who: &Operator,
) -> Result<lapin::Connection, Refused> {
    broker_connection(app).await.map_err(|e| {
        Refused::from(app.message(Some(who), Failure(StatusCode::SERVICE_UNAVAILABLE, e)))
    })
}

#[derive(Deserialize, Default)]
pub(super) struct DoneQuery {
    done: Option<Uuid>,
}

pub(super) async fn page(
    State(app): State<Console>,
    who: Operator,
    Query(done): Query<DoneQuery>,
) -> Response {
    let conn = match broker_for(&app, &who).await {
        Ok(c) => c,
        Err(page) => return page.into_response(),
    };
    let mut queues = Vec::new();
    for q in dlq::queues(&app.0.config) {
        let letters = match dlq::browse(&conn, &q, dlq::DEFAULT_LIMIT).await {
            Ok(l) => l,
            Err(e) => {
                let _ = conn.close(200, "done".into()).await;
                let text = format!("browsing {q} failed: {e}");
                return app.message(Some(&who), Failure(StatusCode::SERVICE_UNAVAILABLE, text));
            }
        };
        let rows: Vec<_> = letters
            .iter()
            .map(|d| {
                let deaths: Vec<String> = d
                    .deaths
                    .iter()
                    .map(|x| format!("{} ×{} in {}", x.reason, x.count, x.queue))
                    .collect();
                let origin = format!(
                    "{}/{}",
                    d.original_exchange.as_deref().unwrap_or("?"),
                    d.original_routing_key.as_deref().unwrap_or("?")
                );
                let replay = d
                    .message_id
                    .as_deref()
                    .map(|id| confirm_link(&[("action", "replay"), ("queue", &q), ("id", id)]));
                context! {
                    position => d.position,
                    id => d.message_id.clone(),
                    replay,
                    reason => d.reason.clone(),
                    deaths,
                    origin,
                    age => d.age_seconds.map(|a| age(a as f64)),
                    preview => d.body_preview.clone(),
                    bytes => d.body_bytes,
                }
            })
            .collect();
        queues.push(context! {
            replay_all => confirm_link(&[("action", "replay"), ("queue", &q)]),
            purge => confirm_link(&[("action", "purge"), ("queue", &q)]),
            name => q,
            full => rows.len() >= dlq::DEFAULT_LIMIT,
            letters => rows,
        });
    }
    let _ = conn.close(200, "done".into()).await;
    let done = done_banner(&app, done.done).await;
    app.render(
        "dead_letters.html",
        context! { title => "Dead letters", operator => who.name, csrf => who.csrf, queues, done },
    )
}

#[derive(Deserialize)]
pub(super) struct DeadLetterQuery {
    action: Option<String>,
    queue: Option<String>,
    id: Option<String>,
}

/// The dead-letter queue an operator named, if it is one of this
/// configuration's.
pub(super) fn dead_letter_queue(app: &Console, queue: Option<&str>) -> Result<String, Failure> {
    let named = queue
        .map(str::trim)
        .filter(|q| !q.is_empty())
        .ok_or_else(|| {
            Failure(
                StatusCode::BAD_REQUEST,
                "Say which dead-letter queue.".into(),
            )
        })?;
    match dlq::select_queues(&app.0.config, Some(named)) {
        Ok(mut q) if q.len() == 1 => Ok(q.remove(0)),
        Ok(_) => Err(Failure(
            StatusCode::BAD_REQUEST,
            format!("{named:?}: name one queue"),
        )),
        Err(e) => Err(Failure(StatusCode::BAD_REQUEST, e.to_string())),
    }
}

pub(super) async fn confirm(
    State(app): State<Console>,
    who: Operator,
    Query(q): Query<DeadLetterQuery>,
) -> Response {
    let queue = match dead_letter_queue(&app, q.queue.as_deref()) {
        Ok(queue) => queue,
        Err(f) => return app.message(Some(&who), f),
    };
    let conn = match broker_for(&app, &who).await {
        Ok(c) => c,
        Err(page) => return page.into_response(),
    };
    let depth = broker::depth(&conn, &queue).await;
    let _ = conn.close(200, "done".into()).await;
    let depth = match depth {
        Ok(d) => d,
        Err(e) => {
            let text = format!("counting {queue} failed: {e}");
            return app.message(Some(&who), Failure(StatusCode::SERVICE_UNAVAILABLE, text));
        }
    };
    let id = given(&q.id);
    let (action, what) = match (q.action.as_deref(), &id) {
        (Some("replay"), Some(id)) => (
            "replay",
            format!(
                "Republish the dead letter {id} of {queue} to the work queue {queue} belongs to \
                 (with a confirm), then remove it from {queue}."
            ),
        ),
        (Some("replay"), None) => (
            "replay",
            format!(
                "Republish each of the {depth} dead letter(s) in {queue} to the work queue \
                 {queue} belongs to (each with a confirm), then remove it. A letter whose headers \
                 name another destination, or none, is left in place."
            ),
        ),
        (Some("purge"), _) => (
            "purge",
            format!("Delete the {depth} dead letter(s) in {queue}. They cannot be recovered."),
        ),
        _ => {
            let text =
                "Say what to do: action=replay (with an id, or all) or action=purge.".to_owned();
            return app.message(Some(&who), Failure(StatusCode::BAD_REQUEST, text));
        }
    };
    app.render(
        "confirm_dead_letters.html",
        context! {
            title => "Confirm", operator => who.name, csrf => who.csrf,
            action, queue, id, what,
        },
    )
}

#[derive(Deserialize)]
pub(super) struct DeadLetterForm {
    csrf: Option<String>,
    queue: Option<String>,
    id: Option<String>,
    #[serde(default)]
    reason: String,
}

impl ActionForm for DeadLetterForm {
    fn csrf(&self) -> Option<&str> {
        self.csrf.as_deref()
    }
    fn reason(&self) -> &str {
        &self.reason
    }
}

/// A dead-letter action, checked (CSRF token, reason, queue), with a broker
/// connection, and recorded before anything is done.
pub(super) struct DeadLetterAction {
    queue: String,
    conn: lapin::Connection,
    audit: Uuid,
}

impl DeadLetterAction {
    async fn begin(
        app: &Console,
        acting: &Acting<DeadLetterForm>,
        action: &'static str,
        detail: serde_json::Value,
    ) -> Result<DeadLetterAction, Refused> {
        let (who, form) = (&acting.who, &acting.form);
        let queue = dead_letter_queue(app, form.queue.as_deref())
            .map_err(|f| Refused::from(app.message(Some(who), f)))?;
        let conn = broker_for(app, who).await?;
        let record = Action {
            action,
            target: Some(queue.clone()),
            detail,
            ..Action::default()
        };
        match acting.audit_first(app, &record).await {
            Ok(audit) => Ok(DeadLetterAction { queue, conn, audit }),
            Err(page) => {
                let _ = conn.close(200, "done".into()).await;
                Err(page)
            }
        }
    }
}

pub(super) async fn replay(State(app): State<Console>, acting: Acting<DeadLetterForm>) -> Response {
    let id = given(&acting.form.id);
    let detail = serde_json::json!({ "message_id": id });
    let DeadLetterAction { queue, conn, audit } =
        match DeadLetterAction::begin(&app, &acting, "dlq.replay", detail).await {
            Ok(begun) => begun,
            Err(page) => return page.into_response(),
        };
    let who = &acting.who;
    let selection = id.clone().map_or(dlq::Selection::All, dlq::Selection::Id);
    let (mut replayed, mut skipped) = (0u32, 0u32);
    let result = dlq::replay(&conn, &queue, &selection, |r| match r.outcome {
        dlq::ReplayOutcome::Replayed => replayed += 1,
        dlq::ReplayOutcome::Skipped { .. } => skipped += 1,
    })
    .await;
    let _ = conn.close(200, "done".into()).await;
    // A replay that failed part-way is recorded as such: a letter may have
    // been republished before the failure.
    finish_action(
        &app.0.store,
        audit,
        result.is_err(),
        serde_json::json!({
            "replayed": replayed,
            "skipped": skipped,
            "error": result.as_ref().err().map(ToString::to_string),
        }),
    )
    .await;
    if let Err(e) = result {
        let text = format!("replaying from {queue} failed after {replayed} replayed: {e}");
        return app.message(Some(who), Failure(StatusCode::SERVICE_UNAVAILABLE, text));
    }
    if let (Some(id), 0) = (&id, replayed + skipped) {
        let text =
            format!("There is no dead letter {id:?} in {queue} (any more). Nothing was done.");
        return app.message(Some(who), Failure(StatusCode::NOT_FOUND, text));
    }
    done(audit)
}

pub(super) async fn purge(State(app): State<Console>, acting: Acting<DeadLetterForm>) -> Response {
    let who = &acting.who;
    let DeadLetterAction { queue, conn, audit } =
        match DeadLetterAction::begin(&app, &acting, "dlq.purge", serde_json::Value::Null).await {
            Ok(begun) => begun,
            Err(page) => return page.into_response(),
        };
    let purged = dlq::purge(&conn, &queue).await;
    let _ = conn.close(200, "done".into()).await;
    finish_action(
        &app.0.store,
        audit,
        purged.is_err(),
        match &purged {
            Ok(n) => serde_json::json!({ "purged": n }),
            Err(e) => serde_json::json!({ "error": e.to_string() }),
        },
    )
    .await;
    match purged {
        Ok(_) => done(audit),
        Err(e) => {
            let text = format!("purging {queue} failed: {e}");
            app.message(Some(who), Failure(StatusCode::SERVICE_UNAVAILABLE, text))
        }
    }
}

/// The confirmation page of a dead-letter action, as a link.
pub(super) fn confirm_link(pairs: &[(&str, &str)]) -> String {
    let mut link = url::form_urlencoded::Serializer::new(String::new());
    link.extend_pairs(pairs);
    format!("/dead-letters/confirm?{}", link.finish())
}

/// Back to the dead letters, saying what was done (from its audit row; a
/// reload does not do it again).
pub(super) fn done(audit: Uuid) -> Response {
    Redirect::to(&format!("/dead-letters?done={audit}")).into_response()
}
