//! A [`Planner`] loaded: which providers may take each operation's attempts
//! (the route's first, and those qualified for its current contract), read
//! from the store once, for the pure plan in `crate::policy::next`. Every
//! caller (the attempt role, the reconciler, the operator's tools) plans with
//! one of these.

use std::collections::HashMap;

use crate::edges::store::{Store, StoreError};
use crate::policy::next::Planner;
use crate::settings::config::Config;

/// A planner for each of `operations` (their qualifications read from the
/// store).
pub(crate) async fn load<'a>(
    config: &'a Config,
    store: &Store,
    operations: impl IntoIterator<Item = &str>,
) -> Result<Planner<'a>, StoreError> {
    let mut eligible = HashMap::new();
    for op in operations {
        eligible.insert(
            op.to_owned(),
            crate::shared::qualify::eligible(config, store, op).await?,
        );
    }
    Ok(Planner::new(config, eligible))
}

/// A planner for every configured operation.
pub(crate) async fn load_all<'a>(
    config: &'a Config,
    store: &Store,
) -> Result<Planner<'a>, StoreError> {
    let operations: Vec<String> = config.operations.keys().cloned().collect();
    load(config, store, operations.iter().map(String::as_str)).await
}
