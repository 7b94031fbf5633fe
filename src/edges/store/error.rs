//! What goes wrong: a storage failure, told apart by what helps (running again,
//! waiting for the database, nothing), and an operator action refused.

use crate::domain::JobStatus;

/// A storage failure.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database refused or failed a statement.
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
    /// A migration failed.
    #[error("migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A row holds something the code does not understand.
    #[error("corrupt row: {0}")]
    Corrupt(String),
    /// The URL's login was cut short ([`crate::broker::login_cut_short`]):
    /// refused before the driver reads it.
    #[error("the database URL has {}", crate::broker::CUT_SHORT)]
    CutShort,
}

/// Result alias for the store.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

impl StoreError {
    /// A table is missing: the database was never migrated.
    pub fn is_undefined_table(&self) -> bool {
        matches!(self, StoreError::Db(sqlx::Error::Database(db)) if db.code().as_deref() == Some("42P01"))
    }

    /// Data the database refuses (SQLSTATE class 22: a string it cannot store, a
    /// number out of range): running the statement again cannot help.
    pub fn is_data_error(&self) -> bool {
        matches!(self, StoreError::Db(sqlx::Error::Database(db)) if db.code().is_some_and(|c| c.starts_with("22")))
    }

    /// One line saying what went wrong, naming the URL (its password masked):
    /// unreachable, a refused login and a missing database are told apart, since
    /// each has its own remedy.
    pub fn describe(&self, url: &str) -> String {
        let at = crate::broker::redact_url(url);
        match self {
            StoreError::Db(sqlx::Error::Database(db)) => match db.code().as_deref() {
                Some("28P01" | "28000") => {
                    format!("Postgres at {at} refused the login: {}", db.message())
                }
                Some("3D000") => format!(
                    "Postgres at {at} has no such database ({}); `onejob migrate` creates it",
                    db.message()
                ),
                _ => format!("Postgres at {at}: {}", db.message()),
            },
            StoreError::Db(sqlx::Error::Io(io)) => format!("cannot reach Postgres at {at}: {io}"),
            StoreError::Db(sqlx::Error::PoolTimedOut) => {
                format!("cannot reach Postgres at {at}: no connection within the timeout")
            }
            other => format!("Postgres at {at}: {other}"),
        }
    }

    /// Postgres cannot be reached (or is starting, stopping, out of connections):
    /// the failure is the dependency's, not the data's. Work waiting on it is held,
    /// never handed back against its delivery limit.
    pub fn is_unavailable(&self) -> bool {
        match self {
            StoreError::Db(
                sqlx::Error::Io(_)
                | sqlx::Error::PoolTimedOut
                | sqlx::Error::PoolClosed
                | sqlx::Error::Tls(_),
            ) => true,
            StoreError::Db(sqlx::Error::Database(db)) => db
                .code()
                .is_some_and(|c| c.starts_with("08") || c.starts_with("57P") || c == "53300"),
            _ => false,
        }
    }

    /// The SQLSTATE of a retried failure, or `io`, for the retry counter.
    pub(super) fn retry_code(&self) -> String {
        match self {
            StoreError::Db(sqlx::Error::Database(db)) => {
                db.code().map_or("other".to_owned(), |c| c.into_owned())
            }
            StoreError::Db(sqlx::Error::Io(_)) => "io".to_owned(),
            _ => "other".to_owned(),
        }
    }

    /// Contention over rows, not a fault of the data nor of the server: a lock
    /// that could not be had in time (55P03, under a `lock_timeout`), a statement
    /// cancelled by `statement_timeout` (57014), a deadlock (40P01) or a
    /// serialization failure (40001). It costs the statement that met it a later
    /// try, never the work batched beside it.
    pub fn is_contention(&self) -> bool {
        matches!(self, StoreError::Db(sqlx::Error::Database(db))
            if matches!(db.code().as_deref(), Some("55P03" | "57014" | "40P01" | "40001")))
    }

    /// The connection broke or none could be had: the statement may or may not
    /// have taken effect, so only a statement that is safe to run twice is run
    /// again on it.
    pub(super) fn is_connection_lost(&self) -> bool {
        matches!(
            self,
            StoreError::Db(sqlx::Error::PoolTimedOut | sqlx::Error::Io(_))
                | StoreError::Migrate(sqlx::migrate::MigrateError::Execute(
                    sqlx::Error::PoolTimedOut | sqlx::Error::Io(_)
                ))
        )
    }

    /// Deadlocks and serialization failures: the transaction can simply run again.
    pub(super) fn is_transient(&self) -> bool {
        match self {
            StoreError::Db(sqlx::Error::Database(db)) => {
                matches!(db.code().as_deref(), Some("40001" | "40P01"))
            }
            StoreError::Db(sqlx::Error::PoolTimedOut | sqlx::Error::Io(_)) => true,
            _ => false,
        }
    }
}

/// A row the code does not understand.
pub(super) fn corrupt(e: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(e.to_string())
}

/// Why an operator action was refused.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// No such row.
    #[error("{0} not found")]
    NotFound(String),
    /// The row is terminal.
    #[error("{0}")]
    Terminal(String),
}

impl Refusal {
    pub(super) fn terminal_job(job: impl std::fmt::Display, status: JobStatus) -> Refusal {
        Refusal::Terminal(format!(
            "job {job} is already {status}: a terminal job never changes"
        ))
    }
}
