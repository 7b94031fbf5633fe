//! Providers and their qualification state, and qualifying one against an
//! operation's golden cases (audited before the first paid call).

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use minijinja::context;
use serde::Deserialize;
use uuid::Uuid;

use super::Console;
use super::action::{Acting, ActionForm, done_banner};
use super::failure::Failure;
use super::page::age;
use super::session::Operator;

#[derive(Deserialize, Default)]
pub(super) struct ProvidersQuery {
    provider: Option<String>,
    operation: Option<String>,
    done: Option<Uuid>,
}

pub(super) async fn page(
    State(app): State<Console>,
    who: Operator,
    Query(q): Query<ProvidersQuery>,
) -> Response {
    let config = &app.0.config;
    let standing = match crate::shared::qualify::standing_of_routes(config, &app.0.store).await {
        Ok(s) => s,
        Err(e) => return app.message(Some(&who), e.into()),
    };
    let claims = match app.0.store.evidence().latest_claims().await {
        Ok(c) => c,
        Err(e) => return app.message(Some(&who), e.into()),
    };
    let rows: Vec<_> = config
        .providers
        .values()
        .map(|p| {
            let operations: Vec<_> = config
                .operations
                .values()
                .filter_map(|o| {
                    let position = o.route.iter().position(|r| *r == p.name)?;
                    let (state, run) = standing
                        .get(&(p.name.clone(), o.name.clone()))
                        .map_or((crate::shared::qualify::State::NeverQualified, None), |(s, r)| {
                            (*s, r.as_ref())
                        });
                    let mut link = url::form_urlencoded::Serializer::new(String::new());
                    link.append_pair("provider", &p.name);
                    link.append_pair("operation", &o.name);
                    Some(context! {
                        operation => o.name.clone(),
                        role => if position == 0 { "primary" } else { "failover" },
                        position => position + 1,
                        state => serde_json::to_value(state).ok()
                            .and_then(|v| v.as_str().map(|s| s.replace('_', " "))),
                        eligible => position == 0 || state == crate::shared::qualify::State::Qualified,
                        cases => o.cases.len(),
                        last_run => run.map(|r| context! {
                            at => r.at.to_rfc3339(),
                            ago => age((chrono::Utc::now() - r.at).num_milliseconds() as f64 / 1000.0),
                            passed => r.passed,
                            cases => r.cases,
                            contract => r.contract_hash.chars().take(12).collect::<String>(),
                        }),
                        qualify => format!("/providers/qualify?{}", link.finish()),
                    })
                })
                .collect();
            context! {
                name => p.name.clone(),
                base_url => crate::broker::redact_url(p.base_url.as_str()),
                model => p.model.clone(),
                timeout => humantime::format_duration(p.timeout).to_string(),
                concurrency => p.concurrency,
                operations,
                evidence => minijinja::Value::from(minijinja::value::Serde(
                    crate::shared::evidence::standing(p, claims.get(&p.name))
                )),
            }
        })
        .collect();
    let held = match held_turns(&app).await {
        Ok(h) => h,
        Err(e) => return app.message(Some(&who), e.into()),
    };
    let done = done_banner(&app, q.done).await;
    app.render(
        "providers.html",
        context! {
            title => "Providers", operator => who.name, csrf => who.csrf,
            providers => rows, held, done,
            stuck_after => humantime::format_duration(config.worker.stuck_after).to_string(),
        },
    )
}

/// The turns held for each provider, the longest-waiting first, each marked
/// when its provider is no longer configured (those move on along their
/// routes once `stuck_after` has passed).
async fn held_turns(app: &Console) -> crate::edges::store::Result<Vec<minijinja::Value>> {
    let config = &app.0.config;
    Ok(app
        .0
        .store
        .turns()
        .held_turns()
        .await?
        .into_iter()
        .map(|h| {
            context! {
                configured => config.providers.contains_key(&h.provider),
                provider => h.provider,
                held => h.held,
                oldest => age(h.oldest_seconds),
            }
        })
        .collect())
}

/// The provider and operation a qualify request names, if both are
/// configured and the operation routes to the provider.
pub(super) fn qualify_pair<'a>(
    app: &'a Console,
    provider: Option<&str>,
    operation: Option<&str>,
) -> Result<
    (
        &'a crate::settings::config::Provider,
        &'a crate::settings::config::Operation,
    ),
    Failure,
> {
    let bad = |text: String| Failure(StatusCode::BAD_REQUEST, text);
    let config = &app.0.config;
    let provider = provider.map(str::trim).unwrap_or_default();
    let operation = operation.map(str::trim).unwrap_or_default();
    let p = config
        .providers
        .get(provider)
        .ok_or_else(|| bad(format!("{provider:?} is not a configured provider.")))?;
    let o = config
        .operations
        .get(operation)
        .ok_or_else(|| bad(format!("{operation:?} is not a configured operation.")))?;
    if !o.route.contains(&p.name) {
        return Err(bad(format!(
            "{operation} does not route to {provider}: there is nothing to qualify it for."
        )));
    }
    Ok((p, o))
}

pub(super) async fn confirm_qualify(
    State(app): State<Console>,
    who: Operator,
    Query(q): Query<ProvidersQuery>,
) -> Response {
    let (p, o) = match qualify_pair(&app, q.provider.as_deref(), q.operation.as_deref()) {
        Ok(pair) => pair,
        Err(f) => return app.message(Some(&who), f),
    };
    let what = if o.cases.is_empty() {
        format!(
            "{} has no golden cases: the run records that {} did not qualify for it. Add \
             [[operations.{}.cases]] to the configuration first.",
            o.name, p.name, o.name
        )
    } else {
        format!(
            "Send the {} golden case(s) of {} to {} (model {}, {}) now, one after another, and \
             check each answer against the operation's output schema. The run is recorded \
             against contract {}: if every case passes, {} may take failovers and hedges of {}; \
             if one fails, it may not until a later run passes. The provider bills these calls.",
            o.cases.len(),
            o.name,
            p.name,
            p.model,
            crate::broker::redact_url(p.base_url.as_str()),
            &crate::shared::qualify::contract_hash(o, p)[..12],
            p.name,
            o.name
        )
    };
    app.render(
        "confirm_qualify.html",
        context! {
            title => "Qualify a provider", operator => who.name, csrf => who.csrf,
            provider => p.name.clone(), operation => o.name.clone(), what,
        },
    )
}

#[derive(Deserialize)]
pub(super) struct QualifyForm {
    csrf: Option<String>,
    provider: Option<String>,
    operation: Option<String>,
    #[serde(default)]
    reason: String,
}

impl ActionForm for QualifyForm {
    fn csrf(&self) -> Option<&str> {
        self.csrf.as_deref()
    }
    fn reason(&self) -> &str {
        &self.reason
    }
}

pub(super) async fn qualify(State(app): State<Console>, acting: Acting<QualifyForm>) -> Response {
    let (who, form) = (&acting.who, &acting.form);
    let (p, o) = match qualify_pair(&app, form.provider.as_deref(), form.operation.as_deref()) {
        Ok(pair) => pair,
        Err(f) => return app.message(Some(who), f),
    };
    // Recorded first: the provider bills these calls, so none goes unrecorded.
    let audit = match acting
        .audit_first(&app, &crate::shared::qualify::action(p, o))
        .await
    {
        Ok(a) => a,
        Err(page) => return page.into_response(),
    };
    // The calls run in a task of their own: a browser that goes away does not
    // cut a paid run short of its record.
    let store = app.0.store.clone();
    let (config, provider, operation) = (app.0.config.clone(), p.name.clone(), o.name.clone());
    let run = tokio::spawn(async move {
        let (p, o) = (&config.providers[&provider], &config.operations[&operation]);
        let (report, recorded) =
            crate::shared::qualify::run_audited(&store, &config, p, o, audit).await;
        tracing::info!(%provider, %operation, qualified = report.passed, "console: qualified a provider");
        recorded.map(|_| ())
    });
    match run.await {
        Ok(Ok(())) => Redirect::to(&format!("/providers?done={audit}")).into_response(),
        Ok(Err(e)) => app.message(Some(who), e.into()),
        Err(e) => {
            let text = format!("the qualification run failed: {e}");
            app.message(Some(who), Failure(StatusCode::INTERNAL_SERVER_ERROR, text))
        }
    }
}
