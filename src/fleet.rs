//! The worker pod's composition: the one module that names the roles. It starts
//! the requested roles (all of them by default) beside the connection
//! supervisor, stops them all when one fails or shutdown is asked for, and
//! reports the first failure.

use crate::edges::shutdown::Shutdown;
use crate::shared::runtime::{Context, Result, WorkerError, supervise_connection};

/// A role the worker can run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    /// Consume intents and turn them into jobs.
    Intake,
    /// Consume one provider's attempts and call it.
    Attempts(String),
    /// Relay the outbox and declare vanished workers' attempts unknown.
    Reconciler,
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Role::Intake => f.write_str("intake"),
            Role::Attempts(p) => write!(f, "attempts({p})"),
            Role::Reconciler => f.write_str("reconciler"),
        }
    }
}

/// Runs the roles until `shutdown` is triggered or one of them fails. With no
/// roles, runs all of them.
pub async fn run(ctx: Context, roles: Vec<Role>, shutdown: Shutdown) -> Result<()> {
    let roles = if roles.is_empty() {
        let mut all = vec![Role::Intake];
        all.extend(
            ctx.config
                .providers
                .keys()
                .map(|p| Role::Attempts(p.clone())),
        );
        all.push(Role::Reconciler);
        all
    } else {
        roles
    };
    if let Err(e) = crate::shared::qualify::warn_stale(&ctx.config, &ctx.store).await {
        tracing::warn!(error = %e, "could not read provider qualifications");
    }
    for role in &roles {
        if let Role::Attempts(p) = role
            && !ctx.config.providers.contains_key(p)
        {
            return Err(WorkerError::UnknownProvider(p.clone()));
        }
    }
    let mut tasks = tokio::task::JoinSet::new();
    {
        let (ctx, shutdown) = (ctx.clone(), shutdown.clone());
        tasks.spawn(async move {
            let result = supervise_connection(ctx, shutdown).await;
            ("amqp supervisor".to_owned(), result)
        });
    }
    for role in roles {
        let ctx = ctx.clone();
        let shutdown = shutdown.clone();
        tracing::info!(%role, "starting role");
        tasks.spawn(async move {
            let name = role.to_string();
            let result = match role {
                Role::Intake => crate::roles::intake::run(ctx, shutdown).await,
                Role::Attempts(p) => crate::roles::attempts::run(ctx, p, shutdown).await,
                Role::Reconciler => crate::roles::reconciler::run(ctx, shutdown).await,
            };
            (name, result)
        });
    }
    let mut failure = None;
    while let Some(joined) = tasks.join_next().await {
        let (name, result) = match joined {
            Ok(r) => r,
            Err(e) => (
                "unknown".to_owned(),
                Err(WorkerError::RoleStopped("task".into(), e.to_string())),
            ),
        };
        match result {
            Ok(()) if shutdown.is_triggered() => tracing::info!(role = %name, "role stopped"),
            Ok(()) => {
                failure.get_or_insert(WorkerError::RoleStopped(name, "its consumer ended".into()));
                shutdown.trigger();
            }
            Err(e) => {
                let e = as_seen(&ctx, &name, e);
                tracing::error!(role = %name, error = %e, "role failed; stopping the worker");
                failure.get_or_insert(e);
                shutdown.trigger();
            }
        }
    }
    // What was published is marked before the worker goes, so that the relay
    // of the next one does not publish it again.
    ctx.marks.flush().await;
    match failure {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// A role's failure as the worker reports it: one that met the lost
/// connection first (closing, closed, errored or recovering) says what was
/// lost.
fn as_seen(ctx: &Context, role: &str, e: WorkerError) -> WorkerError {
    if !ctx.connection.status().connected() {
        WorkerError::RoleStopped(role.to_owned(), format!("RabbitMQ connection lost: {e}"))
    } else {
        e
    }
}
