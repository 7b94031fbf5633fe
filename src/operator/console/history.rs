//! A job's history as the job page lists it, oldest first.

use minijinja::context;

/// An entry: when, its order among entries of the same instant, its kind,
/// and what happened.
type Event = (chrono::DateTime<chrono::Utc>, u8, String, String);

/// A job's history, oldest first: its creation, each attempt's queueing,
/// start and end, every operator action, and each message the outbox still
/// keeps for it (an attempt's message or a job event) with whether it went out.
pub(super) fn events(
    job: &crate::edges::store::JobView,
    audit: &[crate::edges::store::AuditEntry],
    messages: &[crate::edges::store::JobMessage],
) -> Vec<minijinja::Value> {
    let mut events: Vec<Event> = vec![(
        job.created_at,
        0,
        "job".into(),
        format!("created for {} ({})", job.owner_id, job.operation),
    )];
    for a in &job.attempts {
        attempt_events(a, &mut events);
    }
    for e in audit {
        let why = if e.reason.is_empty() {
            String::new()
        } else {
            format!(" ({})", e.reason)
        };
        events.push((
            e.at,
            4,
            "operator".into(),
            format!("{} did {}{why}", e.actor, e.action),
        ));
    }
    for m in messages {
        let what = if m.exchange.ends_with(".events") || m.routing_key.starts_with("job.") {
            format!("event {} ({})", m.routing_key, m.message_id)
        } else {
            format!("message to {} for attempt {}", m.routing_key, m.message_id)
        };
        let state = match (m.published_at, m.not_before) {
            (Some(t), _) => format!("published at {}", t.format("%H:%M:%S%.3f")),
            (None, None) => "held until its turn is handed out".into(),
            (None, Some(_)) => "waiting in the outbox".into(),
        };
        events.push((
            m.created_at,
            5,
            "message".into(),
            format!("{what} written, {state}"),
        ));
    }
    events.sort_by_key(|e| (e.0, e.1));
    events
        .into_iter()
        .map(|(at, _, kind, what)| context! { at => at.to_rfc3339(), kind, what })
        .collect()
}

/// An attempt's queueing, start and end.
fn attempt_events(a: &crate::edges::store::AttemptView, events: &mut Vec<Event>) {
    let delay = if a.held {
        ", held: waits its turn".to_owned()
    } else if a.not_before > a.created_at {
        format!(", not before {}", a.not_before.format("%H:%M:%S%.3f"))
    } else {
        String::new()
    };
    events.push((
        a.created_at,
        1,
        "attempt".into(),
        format!("#{} queued for {}{delay}", a.number, a.provider),
    ));
    if let Some(t) = a.started_at {
        events.push((
            t,
            2,
            "attempt".into(),
            format!("#{} started on {}", a.number, a.provider),
        ));
    }
    if let Some(t) = a.finished_at {
        let why = a
            .error
            .as_deref()
            .map(|e| format!(": {e}"))
            .unwrap_or_default();
        events.push((
            t,
            3,
            "attempt".into(),
            format!("#{} ended {}{why}", a.number, a.status),
        ));
    }
}
