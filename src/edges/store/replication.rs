//! What the primary's replication promises a commit: the gauges that say
//! whether a commit onejob makes (and so an intent it acknowledges) is on a
//! standby before it returns, and how many standbys stream from it.

use crate::edges::store::Store;
use crate::edges::store::error::Result;

/// `onejob_database_commits_wait_for_standby` (1 when every commit returns
/// only once a synchronous standby has it: `synchronous_standby_names` names
/// one and `synchronous_commit` is `on`, `remote_write` or `remote_apply`;
/// 0 otherwise) and `onejob_database_standbys` (the standbys streaming from
/// the server onejob writes to). Standbys with commits that do not wait is
/// asynchronous replication: a failover can lose the last commits, intents
/// acknowledged for them included. Both read settings and a view every role
/// may read.
pub(super) async fn gauges(store: &Store) -> Result<String> {
    let row = sqlx::query!(
        r#"SELECT current_setting('synchronous_standby_names') <> ''
                  AND current_setting('synchronous_commit') IN ('on', 'remote_write', 'remote_apply')
                  AS "waits!",
                  (SELECT count(*) FROM pg_stat_replication) AS "standbys!""#
    )
    .fetch_one(&store.pool)
    .await?;
    Ok(format!(
        "# TYPE onejob_database_commits_wait_for_standby gauge\n\
         onejob_database_commits_wait_for_standby {}\n\
         # TYPE onejob_database_standbys gauge\n\
         onejob_database_standbys {}\n",
        u8::from(row.waits),
        row.standbys
    ))
}
