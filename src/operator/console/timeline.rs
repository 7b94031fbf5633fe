//! A job's attempts on a timeline: each attempt's bar from its creation to
//! its end (or now), on a scale from the job's creation to its last change,
//! with a lane per attempt that ran beside another (a hedge).

use minijinja::context;

use super::page::half_percents;
use crate::edges::store::JobView;

/// The attempts as the job page shows them: in order, and by lane.
pub(super) struct Timeline {
    pub(super) attempts: Vec<minijinja::Value>,
    pub(super) lanes: Vec<Vec<minijinja::Value>>,
}

impl Timeline {
    pub(super) fn of(job: &JobView) -> Timeline {
        // The timeline: each attempt's bar from its creation to its end (or now),
        // on a scale from the job's creation to its last change.
        let start = job.created_at;
        let end = job
            .attempts
            .iter()
            .filter_map(|a| a.finished_at)
            .chain([job.updated_at])
            .max()
            .unwrap_or(job.updated_at)
            .max(if job.status.is_terminal() {
                job.updated_at
            } else {
                chrono::Utc::now()
            });
        let span = (end - start).num_milliseconds().max(1) as f64;
        let at = |t: chrono::DateTime<chrono::Utc>| {
            ((t - start).num_milliseconds() as f64 / span * 100.0).clamp(0.0, 100.0)
        };
        // Lanes: an attempt goes on the first lane whose last attempt had ended
        // when it was made. A retry follows its predecessor on the same lane; a
        // hedge, made while another attempt was still open, opens a lane of its own.
        let mut lane_ends: Vec<Option<chrono::DateTime<chrono::Utc>>> = Vec::new();
        let mut lanes: Vec<Vec<minijinja::Value>> = Vec::new();
        let mut attempts = Vec::new();
        for a in &job.attempts {
            let hedge = job
                .attempts
                .iter()
                .any(|b| b.number < a.number && b.finished_at.is_none_or(|f| a.created_at < f));
            let lane = lane_ends
                .iter()
                .position(|end| end.is_some_and(|e| e <= a.created_at))
                .unwrap_or_else(|| {
                    lane_ends.push(None);
                    lanes.push(Vec::new());
                    lane_ends.len() - 1
                });
            lane_ends[lane] = Some(
                a.finished_at
                    .unwrap_or(chrono::DateTime::<chrono::Utc>::MAX_UTC),
            );
            let from = at(a.started_at.unwrap_or(a.created_at));
            let to = at(a.finished_at.unwrap_or(end));
            let view = context! {
                id => a.id.to_string(),
                number => a.number,
                provider => a.provider.clone(),
                status => a.status.as_str(),
                winner => job.completed_by == Some(a.id),
                hedge,
                lane => lane + 1,
                error => a.error.clone(),
                usage => a.usage.as_ref().map(|u| u.to_string()),
                request_id => a.provider_request_id.clone(),
                created => a.created_at.to_rfc3339(),
                started => a.started_at.map(|t| t.to_rfc3339()),
                finished => a.finished_at.map(|t| t.to_rfc3339()),
                left => half_percents(from),
                width => half_percents(to - from).max(1),
                // A bar too narrow for its label has it beside it instead.
                label => match ((to - from) < 15.0, from > 60.0) {
                    (false, _) => "inside",
                    (true, false) => "after",
                    (true, true) => "before",
                },
                open => !a.status.is_terminal(),
            };
            lanes[lane].push(view.clone());
            attempts.push(view);
        }
        Timeline { attempts, lanes }
    }
}
