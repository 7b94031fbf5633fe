//! The operator console's sessions: signed in with an operator token, found
//! by their id's digest, signed out, expired.

use crate::edges::store::handles::Sessions;
use std::time::Duration;

use crate::edges::store::error::Result;
use crate::settings::token::Token;

/// A signed-in console session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Session {
    /// The operator it signs in.
    pub operator: String,
    /// The session's form token (CSRF): every action must carry it.
    pub csrf: String,
}

impl Sessions<'_> {
    /// Deletes the sessions past their expiry (a timer of the console's
    /// calls it); how many.
    pub async fn expire(self) -> Result<u64> {
        Ok(
            sqlx::query!("DELETE FROM operator_sessions WHERE expires_at < now()")
                .execute(&self.0.pool)
                .await?
                .rows_affected(),
        )
    }

    /// Signs in with an operator token: a new session of `ttl`, whose id's
    /// digest is `session_digest`. The operator, or `None` when the token is
    /// unknown or revoked.
    pub async fn sign_in(
        self,
        token: &Token,
        session_digest: &str,
        csrf: &str,
        ttl: Duration,
    ) -> Result<Option<String>> {
        Ok(sqlx::query_scalar!(
            r#"WITH t AS (
                   SELECT id, operator FROM operator_tokens
                   WHERE token_sha256 = $1 AND revoked_at IS NULL
               ),
               made AS (
                   INSERT INTO operator_sessions (id_sha256, token_id, csrf, expires_at)
                   SELECT $2, t.id, $3, now() + make_interval(secs => $4) FROM t
                   RETURNING token_id
               )
               SELECT t.operator AS "operator!" FROM t JOIN made ON made.token_id = t.id"#,
            token.digest(),
            session_digest,
            csrf,
            ttl.as_secs_f64()
        )
        .fetch_optional(&self.0.pool)
        .await?)
    }

    /// The live session whose id has this digest: not expired, not signed out,
    /// its token not revoked.
    pub async fn session(self, session_digest: &str) -> Result<Option<Session>> {
        Ok(sqlx::query_as!(
            Session,
            "SELECT t.operator, s.csrf FROM operator_sessions s
             JOIN operator_tokens t ON t.id = s.token_id
             WHERE s.id_sha256 = $1 AND s.expires_at > now() AND t.revoked_at IS NULL",
            session_digest
        )
        .fetch_optional(&self.0.pool)
        .await?)
    }

    /// Ends a session.
    pub async fn sign_out(self, session_digest: &str) -> Result<()> {
        sqlx::query!(
            "DELETE FROM operator_sessions WHERE id_sha256 = $1",
            session_digest
        )
        .execute(&self.0.pool)
        .await?;
        Ok(())
    }
}
