//! What every operator action shares: the CSRF token and a reason checked
//! first, an audit row written before anything is done, its outcome written
//! after, and the banner that says what was done (read from that row).

use axum::http::StatusCode;
use uuid::Uuid;

use super::failure::{Failure, Refused};
use super::session::Operator;
use super::{Console, MAX_REASON};
use crate::edges::store::{Action, Actor, Store};

/// What every action's form must pass before anything is looked at: the
/// session's CSRF token, then a reason. The reason, or the refusal's page.
pub(super) fn authorised<'a>(
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
pub(super) fn reason_of<'a>(
    app: &Console,
    who: &Operator,
    reason: &'a str,
) -> Result<&'a str, Refused> {
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
pub(super) async fn begin_action(
    app: &Console,
    who: &Operator,
    reason: &str,
    action: &Action<'_>,
) -> Result<Uuid, Refused> {
    app.0
        .store
        .audit_begin(&Actor::operator(&who.name, reason), action)
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
    if let Err(e) = store.audit_outcome(audit, failed, &detail).await {
        tracing::warn!(error = %e, %audit, "console: the outcome of an action was not recorded; its audit row stays pending");
    }
}

/// What an action did, in words, from its audit row (never from the link that
/// leads back to the page, which anyone could write).
pub(super) async fn done_banner(app: &Console, done: Option<Uuid>) -> Option<String> {
    let entry = app.0.store.audit_entry(done?).await.ok()??;
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
