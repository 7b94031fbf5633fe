//! Running statements again when their failure is worth another try.

use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};

use crate::edges::store::Store;
use crate::edges::store::error::{Result, StoreError};

impl Store {
    /// Runs `f` again when it fails with a deadlock or serialization failure,
    /// or its connection broke: for statements that are safe to run twice.
    pub(super) async fn retrying<T, F, Fut>(&self, f: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        self.retrying_when(f, StoreError::is_transient).await
    }

    /// Runs `f` again when `when` says its failure is worth another try.
    pub(super) async fn retrying_when<T, F, Fut>(
        &self,
        f: F,
        when: fn(&StoreError) -> bool,
    ) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        f.retry(
            ExponentialBuilder::default()
                .with_min_delay(Duration::from_millis(5))
                .with_max_delay(Duration::from_millis(500))
                .with_max_times(10)
                .with_jitter(),
        )
        .when(when)
        .notify(|e, d| {
            crate::edges::metrics::db_retry(&e.retry_code());
            tracing::debug!(error = %e, retry_in = ?d, "transient database error; retrying")
        })
        .await
    }
}
