//! What every operator action shares: [`Acting`], the one way a handler gets
//! to act (signed in, the CSRF token and a reason checked first, and the
//! actor or an audit row written before anything is done), its outcome
//! written after, and the banner that says what was done (read from that
//! row).

use axum::extract::{Form, FromRequest, FromRequestParts, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use uuid::Uuid;

use super::failure::{Failure, Refused};
use super::session::Operator;
use super::{Console, MAX_REASON};
use crate::edges::store::{Action, Actor, Store};

/// An action's form: what [`Acting`] checks in it before the handler runs.
pub(super) trait ActionForm: DeserializeOwned + Send {
    /// The session's CSRF token, as the form carried it.
    fn csrf(&self) -> Option<&str>;
    /// Why, for the audit table.
    fn reason(&self) -> &str;
}

/// An operator acting: signed in (else the sign-in page), the form's CSRF
/// token the session's and its reason given (else the page that says so,
/// and nothing is done). The only way a handler names the actor of a store
/// call that audits in its own transaction ([`Acting::actor`]), or writes
/// the audit row of an action outside the database first
/// ([`Acting::audit_first`]).
pub(super) struct Acting<F> {
    pub(super) who: Operator,
    pub(super) form: F,
    reason: String,
}

impl<F: ActionForm> FromRequest<Console> for Acting<F> {
    type Rejection = Response;

    async fn from_request(req: Request, app: &Console) -> Result<Self, Response> {
        let (mut parts, body) = req.into_parts();
        let who = Operator::from_request_parts(&mut parts, app).await?;
        let Form(form) = Form::<F>::from_request(Request::from_parts(parts, body), app)
            .await
            .map_err(IntoResponse::into_response)?;
        let reason = authorised(app, &who, form.csrf(), form.reason())
            .map_err(IntoResponse::into_response)?
            .to_owned();
        Ok(Acting { who, form, reason })
    }
}

impl<F> Acting<F> {
    /// Who acts, and why, for a store call that audits in its transaction.
    pub(super) fn actor(&self) -> Actor {
        Actor::operator(&self.who.name, &self.reason)
    }

    /// Records `action` before it is done; if the row cannot be written, the
    /// page that says nothing was done.
    pub(super) async fn audit_first(
        &self,
        app: &Console,
        action: &Action<'_>,
    ) -> Result<Uuid, Refused> {
        begin_action(app, &self.who, &self.reason, action).await
    }
}

/// What every action's form must pass before anything is looked at: the
/// session's CSRF token, then a reason. The reason, or the refusal's page.
fn authorised<'a>(
    app: &Console,
    who: &Operator,
    csrf: Option<&str>,
    reason: &'a str,
) -> Result<&'a str, Refused> {
    if let Some(refused) = who.refuses(app, csrf) {
        return Err(refused.into());
    }
    reason_of(app, who, reason)
}

/// The reason an action's form gave, or the page that says it is missing.
fn reason_of<'a>(app: &Console, who: &Operator, reason: &'a str) -> Result<&'a str, Refused> {
    let reason = reason.trim();
    if reason.is_empty() || reason.chars().count() > MAX_REASON || reason.contains('\0') {
        let text = format!(
            "Give a reason (1 to {MAX_REASON} characters): it goes in the audit table. Nothing was done."
        );
        return Err(app
            .message(Some(who), Failure(StatusCode::BAD_REQUEST, text))
            .into());
    }
    Ok(reason)
}

/// Records an action before it is done, so that none goes unrecorded; if the
/// row cannot be written, the page that says nothing was done.
async fn begin_action(
    app: &Console,
    who: &Operator,
    reason: &str,
    action: &Action<'_>,
) -> Result<Uuid, Refused> {
    app.0
        .store
        .audit()
        .begin(&Actor::operator(&who.name, reason), action)
        .await
        .map_err(|e| {
            let Failure(status, text) = e.into();
            Refused::from(app.message(
                Some(who),
                Failure(
                    status,
                    format!("{text}. Nothing was done: the action could not be recorded first."),
                ),
            ))
        })
}

/// Writes what came of an action [`begin_action`] recorded. If that fails,
/// the row stays `pending` (and the log says so): the action itself stands.
pub(super) async fn finish_action(
    store: &Store,
    audit: Uuid,
    failed: bool,
    detail: serde_json::Value,
) {
    if let Err(e) = store.audit().outcome(audit, failed, &detail).await {
        tracing::warn!(error = %e, %audit, "console: the outcome of an action was not recorded; its audit row stays pending");
    }
}

/// What an action did, in words, from its audit row (never from the link that
/// leads back to the page, which anyone could write).
pub(super) async fn done_banner(app: &Console, done: Option<Uuid>) -> Option<String> {
    let entry = app.0.store.audit().entry(done?).await.ok()??;
    let d = &entry.detail;
    let target = entry.target.clone().unwrap_or_default();
    let n = |k: &str| d[k].as_u64().unwrap_or(0);
    match (entry.action.as_str(), d["outcome"].as_str()) {
        ("provider.qualify", Some("done")) => Some(format!(
            "{}: {} ({} of {} case(s) passed).",
            target.replace('/', " for "),
            if d["qualified"] == true {
                "qualified"
            } else {
                "not qualified"
            },
            n("passed"),
            n("cases")
        )),
        ("dlq.replay", Some("done")) => Some(format!(
            "{target}: {} dead letter(s) replayed, {} skipped.",
            n("replayed"),
            n("skipped")
        )),
        ("owner.set", _) => Some(format!(
            "{target}: limits set ({}).",
            own_settings(&d["after"])
        )),
        ("dlq.purge", Some("done")) => {
            Some(format!("{target}: {} dead letter(s) purged.", n("purged")))
        }
        _ => None,
    }
}

/// An owner's own settings as an `owner.set` row's `detail` holds them, in
/// words: those unset take `[owners]`'s.
fn own_settings(after: &serde_json::Value) -> String {
    let set: Vec<String> = ["max_in_flight", "rate", "burst", "daily_tokens"]
        .into_iter()
        .filter(|k| !after[*k].is_null())
        .map(|k| format!("{k} {}", after[k]))
        .collect();
    match set.is_empty() {
        true => "all of [owners]'s".into(),
        false => set.join(", ") + "; the rest [owners]'s",
    }
}
