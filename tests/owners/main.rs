//! Per-owner limits and budgets (contract section 7, Owners), on the real
//! Postgres and RabbitMQ: the daily token budget refuses new identities once
//! an owner's spend, discarded attempts' included, reaches it (`budget`); the
//! rate paces first attempts past the burst, across admissions that race
//! (`rate`); `max_in_flight` bounds an owner's attempts started at once,
//! hedges included (`in_flight`); an owner's backlog waits in the database,
//! holding another owner's job behind its share only (`turns`); the limits
//! hold across two worker processes (`fleet`); `onejob owners` sets,
//! shows and audits each owner's own settings (`settings`); and the spend
//! ledger and `turns`, which every job writes, hold at their edges
//! (`ledgers`).

use onejob_test_support as common;

mod budget;
mod fleet;
mod in_flight;
mod ledgers;
mod next_turns;
mod rate;
mod reservations;
mod retries;
mod settings;
mod turns;
mod unserved;

use std::time::Duration;

use onejob::domain::JobId;
use onejob::edges::store::{Admission, Finished, NewJob, Store, Verdict};
use serde_json::json;

/// `[owners]` appended to the usual one-provider configuration.
fn config_with_owners(primary: &str, owners: &str) -> String {
    common::config_text(primary, None, "") + "\n[owners]\n" + owners + "\n"
}

/// Admits `news` and asserts each was created; their jobs, in order.
async fn created(store: &Store, news: &[NewJob]) -> Vec<Admission> {
    let admitted = store.admission().admit(news).await.expect("admit");
    for a in &admitted {
        assert!(matches!(a, Admission::Created { .. }), "{a:?}");
    }
    admitted
}

/// Admits one job for `owner`, starts its attempt and settles it as a success
/// that the provider says cost `tokens`.
async fn spend(store: &Store, owner: &str, key: &str, tokens: i64) -> JobId {
    let new = common::new_job(owner, key, key);
    let (job_id, attempt) = (new.job_id, new.attempt_id);
    created(store, &[new]).await;
    let started = store
        .settle()
        .start("primary", &[attempt], Duration::from_secs(30))
        .await
        .expect("start")
        .remove(0);
    let finished = Finished {
        attempt_id: started.attempt_id,
        job_id: started.job_id,
        version: started.version,
        provider_request_id: None,
        usage: Some(
            json!({ "prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens }),
        ),
        verdict: Verdict::Succeeded(json!({ "summary": key })),
        asked: None,
    };
    common::settle_with(store, &[finished], &common::give_up).await;
    job_id
}
