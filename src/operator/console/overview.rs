//! The overview page: counts, the last hour's arrivals, the oldest unknown,
//! the outbox, the answers kept on open attempts and why they wait, and each
//! dead-letter queue's depth (within a short broker wait).

use std::time::Duration;

use axum::extract::State;
use axum::response::Response;
use minijinja::context;

use super::Console;
use super::page::age;
use super::session::Operator;
use crate::broker;
use crate::shared::dlq;
use crate::shared::runtime;

pub(super) async fn page(State(app): State<Console>, who: Operator) -> Response {
    let o = match app.0.store.jobs().overview().await {
        Ok(o) => o,
        Err(e) => return app.message(Some(&who), e.into()),
    };
    let peak = o
        .created_per_minute
        .iter()
        .copied()
        .max()
        .unwrap_or(0)
        .max(1);
    let kept = match app.0.store.kept().waiting().await {
        Ok(k) => k,
        Err(e) => return app.message(Some(&who), e.into()),
    };
    let dead_letters = dead_letter_depths(&app).await;
    let bars: Vec<_> = o
        .created_per_minute
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let h = (*n as f64 / peak as f64 * 60.0).round();
            context! { x => i * 5, y => 60.0 - h, h => h, n => n, ago => 60 - i }
        })
        .collect();
    app.render(
        "overview.html",
        context! {
            title => "Overview",
            operator => who.name,
            csrf => who.csrf,
            jobs => o.jobs,
            attempts => o.attempts_last_hour,
            bars => bars,
            peak => peak,
            created_last_hour => o.created_per_minute.iter().sum::<i64>(),
            oldest_unknown => o.oldest_unknown_seconds.map(age),
            outbox_pending => o.outbox_pending,
            outbox_lag => o.outbox_lag_seconds.map(age),
            kept => context! { due => kept.due, held => kept.held, unreadable => kept.unreadable },
            dead_letters,
        },
    )
}

/// How long a page waits for the broker before it shows without it.
pub(super) const BROKER_WAIT: Duration = Duration::from_secs(3);

/// A broker connection for a page, or why there is none, within
/// [`BROKER_WAIT`]: a broker that accepts and never answers costs a page a
/// short wait, not the page.
pub(super) async fn broker_connection(app: &Console) -> Result<lapin::Connection, String> {
    match tokio::time::timeout(
        BROKER_WAIT,
        runtime::operator_connection(&app.0.options.amqp_url, &app.0.config),
    )
    .await
    {
        Ok(connected) => connected,
        Err(_) => Err(format!(
            "the broker did not answer within {} s",
            BROKER_WAIT.as_secs()
        )),
    }
}

/// Each dead-letter queue's depth, or, when the broker cannot be asked, why
/// not (the rest of the overview comes from Postgres and still shows).
pub(super) async fn dead_letter_depths(app: &Console) -> minijinja::Value {
    let conn = match broker_connection(app).await {
        Ok(c) => c,
        Err(e) => return context! { error => format!("the broker cannot be asked: {e}") },
    };
    let mut queues = Vec::new();
    for q in dlq::queues(&app.0.config) {
        let depth = tokio::time::timeout(BROKER_WAIT, broker::depth(&conn, &q)).await;
        queues.push(match depth {
            Ok(Ok(n)) => context! { name => q, depth => n },
            Ok(Err(e)) => context! { name => q, error => e.to_string() },
            Err(_) => context! { name => q, error => "the broker did not answer in time" },
        });
    }
    let _ = conn.close(200, "done".into()).await;
    context! { queues }
}
