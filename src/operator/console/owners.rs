//! Owners: each owner's limits (its own over `[owners]`), spend and waiting
//! jobs, and setting an owner's limits (audited in the change's transaction).

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use minijinja::context;
use serde::Deserialize;
use uuid::Uuid;

use super::Console;
use super::action::{Acting, ActionForm, done_banner};
use super::failure::Failure;
use super::session::Operator;
use crate::edges::store::{OwnerChange, OwnerView};
use crate::settings::config::{MAX_COUNT, MAX_DAILY_TOKENS, MAX_RATE, parse_limit};

#[derive(Deserialize, Default)]
pub(super) struct OwnersQuery {
    done: Option<Uuid>,
}

pub(super) async fn page(
    State(app): State<Console>,
    who: Operator,
    Query(q): Query<OwnersQuery>,
) -> Response {
    let owners = match app.0.store.owners().list_owners().await {
        Ok(o) => o,
        Err(e) => return app.message(Some(&who), e.into()),
    };
    let rows: Vec<_> = owners.iter().map(row).collect();
    let defaults = app.0.config.owners;
    let done = done_banner(&app, q.done).await;
    app.render(
        "owners.html",
        context! {
            title => "Owners", operator => who.name, csrf => who.csrf,
            owners => rows, done,
            defaults => context! {
                max_in_flight => limit(defaults.max_in_flight),
                rate => rate(&defaults),
                daily_tokens => limit(defaults.daily_tokens),
            },
        },
    )
}

/// One owner as the page shows it: each limit, and whether it is its own.
fn row(o: &OwnerView) -> minijinja::Value {
    context! {
        owner => o.owner_id.clone(),
        max_in_flight => limit(o.limits.max_in_flight),
        max_in_flight_own => o.own.max_in_flight.is_some(),
        rate => rate(&o.limits),
        rate_own => o.own.rate.is_some() || o.own.burst.is_some(),
        daily_tokens => limit(o.limits.daily_tokens),
        daily_tokens_own => o.own.daily_tokens.is_some(),
        spent => o.spent_24h,
        reserved => o.reserved,
        left => o.left.map_or_else(|| "-".to_owned(), |n| n.to_string()),
        over => o.left == Some(0),
        waiting => o.waiting,
    }
}

fn limit(n: i64) -> String {
    if n == 0 { "none".into() } else { n.to_string() }
}

fn rate(l: &crate::settings::config::OwnerLimits) -> String {
    match l.bucket() {
        Some((r, b)) => format!("{r}/s, burst {b}"),
        None => "none".into(),
    }
}

#[derive(Deserialize)]
pub(super) struct SetForm {
    csrf: Option<String>,
    #[serde(default)]
    owner: String,
    #[serde(default)]
    max_in_flight: String,
    #[serde(default)]
    rate: String,
    #[serde(default)]
    burst: String,
    #[serde(default)]
    daily_tokens: String,
    #[serde(default)]
    reason: String,
}

/// A form field: empty leaves the setting as it is.
fn field<T>(name: &str, text: &str, max: T) -> Result<Option<Option<T>>, String>
where
    T: std::str::FromStr + PartialOrd + std::fmt::Display + Copy + Default,
{
    if text.trim().is_empty() {
        return Ok(None);
    }
    parse_limit(text, max)
        .map(Some)
        .map_err(|e| format!("{name} {e}."))
}

fn change_of(form: &SetForm) -> Result<OwnerChange, String> {
    Ok(OwnerChange {
        max_in_flight: field("max_in_flight", &form.max_in_flight, MAX_COUNT)?,
        rate: field("rate", &form.rate, MAX_RATE)?,
        burst: field("burst", &form.burst, MAX_COUNT)?,
        daily_tokens: field("daily_tokens", &form.daily_tokens, MAX_DAILY_TOKENS)?,
    })
}

impl ActionForm for SetForm {
    fn csrf(&self) -> Option<&str> {
        self.csrf.as_deref()
    }
    fn reason(&self) -> &str {
        &self.reason
    }
}

pub(super) async fn set(State(app): State<Console>, acting: Acting<SetForm>) -> Response {
    let (who, form) = (&acting.who, &acting.form);
    let bad = |text: String| {
        let text = format!("{text} Nothing was changed.");
        app.message(Some(who), Failure(StatusCode::BAD_REQUEST, text))
    };
    let owner = form.owner.trim();
    if let Err(e) = crate::intent::Intent::check_owner_id(owner) {
        return bad(format!("The owner: {e}."));
    }
    let change = match change_of(form) {
        Ok(c) if c == OwnerChange::default() => {
            return bad("Give at least one limit to set.".into());
        }
        Ok(c) => c,
        Err(e) => return bad(e),
    };
    match app
        .0
        .store
        .owners()
        .set(owner, &change, &acting.actor())
        .await
    {
        Ok((_, audit)) => {
            tracing::info!(operator = %who.name, owner, "console: set an owner's limits");
            Redirect::to(&format!("/owners?done={audit}")).into_response()
        }
        Err(e) => app.message(Some(who), e.into()),
    }
}
