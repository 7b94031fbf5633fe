//! The HTTP gateway's bearer tokens (only their digests).

use crate::edges::store::handles::Tokens;
use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use crate::edges::store::audit;
use crate::edges::store::audit::{Action, Actor};
use crate::edges::store::error::Result;
use crate::edges::store::views::TokenView;
use crate::settings::token::Token;

impl Tokens<'_> {
    /// Records a new gateway token for `owner_id` (only its digest) and returns
    /// the token's id. The grant is audited (`token.create`) in the same
    /// transaction: no token exists without its row.
    pub async fn create_token(self, owner_id: &str, token: &Token, actor: &Actor) -> Result<Uuid> {
        let id = Uuid::now_v7();
        let mut tx = self.0.pool.begin().await?;
        audit::record(
            &mut tx,
            actor,
            &token_action("token.create", "owner", owner_id, id, None),
        )
        .await?;
        sqlx::query!(
            "INSERT INTO gateway_tokens (id, owner_id, token_sha256) VALUES ($1, $2, $3)",
            id,
            owner_id,
            token.digest()
        )
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(id)
    }

    /// The owner a presented token belongs to, unless it is unknown or revoked.
    pub async fn token_owner(self, token: &Token) -> Result<Option<String>> {
        Ok(sqlx::query_scalar!(
            "SELECT owner_id FROM gateway_tokens WHERE token_sha256 = $1 AND revoked_at IS NULL",
            token.digest()
        )
        .fetch_optional(&self.0.pool)
        .await?)
    }

    /// Gateway tokens, oldest first, optionally of one owner. Never the tokens
    /// themselves: the database does not have them.
    pub async fn list(self, owner_id: Option<&str>) -> Result<Vec<TokenView>> {
        Ok(sqlx::query_as!(
            TokenView,
            "SELECT id, owner_id, created_at, revoked_at FROM gateway_tokens
             WHERE $1::text IS NULL OR owner_id = $1
             ORDER BY created_at, id",
            owner_id
        )
        .fetch_all(&self.0.pool)
        .await?)
    }

    /// Revokes a token at once: the gateway refuses it from its next request on.
    /// Returns the token and whether it had already been revoked (revoking twice
    /// keeps the first time); `Ok(None)` when there is no such token.
    /// The revocation is audited (`token.revoke`) in the same transaction.
    pub async fn revoke(self, id: Uuid, actor: &Actor) -> Result<Option<(TokenView, bool)>> {
        let mut tx = self.0.pool.begin().await?;
        let row = sqlx::query!(
            r#"UPDATE gateway_tokens t SET revoked_at = coalesce(b.revoked_at, now())
               FROM (SELECT id, revoked_at FROM gateway_tokens WHERE id = $1 FOR UPDATE) b
               WHERE t.id = b.id
               RETURNING t.id, t.owner_id, t.created_at, t.revoked_at,
                         b.revoked_at IS NOT NULL AS "already!""#,
            id
        )
        .fetch_optional(&mut *tx)
        .await?;
        if let Some(r) = &row {
            let action = token_action("token.revoke", "owner", &r.owner_id, id, Some(r.already));
            audit::record(&mut tx, actor, &action).await?;
            tx.commit().await?;
        }
        Ok(row.map(|r| {
            let view = TokenView {
                id: r.id,
                owner_id: r.owner_id,
                created_at: r.created_at,
                revoked_at: r.revoked_at,
            };
            (view, r.already)
        }))
    }
}

/// An operator token as listed: never the token itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct OperatorTokenView {
    /// The token's id.
    pub id: Uuid,
    /// The operator it signs in.
    pub operator: String,
    /// When it was made.
    pub created_at: DateTime<Utc>,
    /// When it was revoked, if it was.
    pub revoked_at: Option<DateTime<Utc>>,
}

impl Tokens<'_> {
    /// Records a new operator token (only its digest) and returns its id,
    /// audited (`token.create`) in the same transaction.
    pub async fn create_operator_token(
        self,
        operator: &str,
        token: &Token,
        actor: &Actor,
    ) -> Result<Uuid> {
        let id = Uuid::now_v7();
        let mut tx = self.0.pool.begin().await?;
        let action = token_action("token.create", "operator", operator, id, None);
        audit::record(&mut tx, actor, &action).await?;
        sqlx::query!(
            "INSERT INTO operator_tokens (id, operator, token_sha256) VALUES ($1, $2, $3)",
            id,
            operator,
            token.digest()
        )
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(id)
    }

    /// The operator a presented operator token signs in, unless it is unknown
    /// or revoked. Tenant tokens are not in this table.
    pub async fn token_operator(self, token: &Token) -> Result<Option<String>> {
        Ok(sqlx::query_scalar!(
            "SELECT operator FROM operator_tokens WHERE token_sha256 = $1 AND revoked_at IS NULL",
            token.digest()
        )
        .fetch_optional(&self.0.pool)
        .await?)
    }

    /// Operator tokens, oldest first.
    pub async fn operator_tokens(self) -> Result<Vec<OperatorTokenView>> {
        Ok(sqlx::query_as!(
            OperatorTokenView,
            "SELECT id, operator, created_at, revoked_at FROM operator_tokens ORDER BY created_at, id"
        )
        .fetch_all(&self.0.pool)
        .await?)
    }

    /// Revokes an operator token at once (signed-in sessions end with it).
    /// Whether it had already been revoked; `Ok(None)` when there is no such
    /// token. Audited (`token.revoke`) in the same transaction.
    pub async fn revoke_operator_token(
        self,
        id: Uuid,
        actor: &Actor,
    ) -> Result<Option<(OperatorTokenView, bool)>> {
        let mut tx = self.0.pool.begin().await?;
        let row = sqlx::query!(
            r#"UPDATE operator_tokens t SET revoked_at = coalesce(b.revoked_at, now())
               FROM (SELECT id, revoked_at FROM operator_tokens WHERE id = $1 FOR UPDATE) b
               WHERE t.id = b.id
               RETURNING t.id, t.operator, t.created_at, t.revoked_at,
                         b.revoked_at IS NOT NULL AS "already!""#,
            id
        )
        .fetch_optional(&mut *tx)
        .await?;
        if let Some(r) = &row {
            let action = token_action("token.revoke", "operator", &r.operator, id, Some(r.already));
            audit::record(&mut tx, actor, &action).await?;
            tx.commit().await?;
        }
        Ok(row.map(|r| {
            let view = OperatorTokenView {
                id: r.id,
                operator: r.operator,
                created_at: r.created_at,
                revoked_at: r.revoked_at,
            };
            (view, r.already)
        }))
    }
}

/// The audit action of granting or revoking a token: whose (`owner:O` or
/// `operator:NAME`) and which token, never the token itself.
fn token_action(
    action: &'static str,
    kind: &str,
    whose: &str,
    id: Uuid,
    already: Option<bool>,
) -> Action<'static> {
    let mut detail = serde_json::json!({ "token_id": id });
    if let Some(already) = already {
        detail["already_revoked"] = already.into();
    }
    Action {
        action,
        target: Some(format!("{kind}:{whose}")),
        detail,
        ..Action::default()
    }
}
