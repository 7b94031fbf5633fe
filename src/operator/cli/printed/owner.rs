//! An owner as `owners list|show|set --json` print it, and as `jobs show
//! --json` gives a job's `owner_limits`.

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::edges::store::OwnerView;
use crate::settings::config::{OwnerLimits, OwnerOverrides};

/// One owner: its own settings, the limits that apply, and what it spends
/// and holds.
#[derive(Debug, Serialize)]
pub(in crate::operator::cli) struct Owner {
    owner_id: String,
    own: Own,
    limits: Limits,
    spent_24h: i64,
    reserved: i64,
    left: Option<i64>,
    waiting: i64,
    updated_at: Option<DateTime<Utc>>,
}

/// Its own settings; `null` takes `[owners]`'s.
#[derive(Debug, Serialize)]
struct Own {
    max_in_flight: Option<i64>,
    rate: Option<f64>,
    burst: Option<i64>,
    daily_tokens: Option<i64>,
}

/// The limits that apply to it; 0 is no limit.
#[derive(Debug, Serialize)]
struct Limits {
    max_in_flight: i64,
    rate: f64,
    burst: i64,
    daily_tokens: i64,
}

impl From<&OwnerOverrides> for Own {
    fn from(o: &OwnerOverrides) -> Own {
        Own {
            max_in_flight: o.max_in_flight,
            rate: o.rate,
            burst: o.burst,
            daily_tokens: o.daily_tokens,
        }
    }
}

impl From<&OwnerLimits> for Limits {
    fn from(l: &OwnerLimits) -> Limits {
        Limits {
            max_in_flight: l.max_in_flight,
            rate: l.rate,
            burst: l.burst,
            daily_tokens: l.daily_tokens,
        }
    }
}

impl From<&OwnerView> for Owner {
    fn from(v: &OwnerView) -> Owner {
        Owner {
            owner_id: v.owner_id.clone(),
            own: (&v.own).into(),
            limits: (&v.limits).into(),
            spent_24h: v.spent_24h,
            reserved: v.reserved,
            left: v.left,
            waiting: v.waiting,
            updated_at: v.updated_at,
        }
    }
}
