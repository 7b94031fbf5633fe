//! Tokens as `tokens list --json` and `tokens revoke --json` print them: never
//! the secret, which only `tokens create` shows, once.

use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use crate::edges::store::{OperatorTokenView, TokenView};

/// A gateway token: whose jobs it reaches, and when it was made and revoked.
#[derive(Debug, Serialize)]
pub(in crate::operator::cli) struct GatewayToken {
    id: Uuid,
    owner_id: String,
    created_at: DateTime<Utc>,
    revoked_at: Option<DateTime<Utc>>,
}

impl From<&TokenView> for GatewayToken {
    fn from(t: &TokenView) -> GatewayToken {
        GatewayToken {
            id: t.id,
            owner_id: t.owner_id.clone(),
            created_at: t.created_at,
            revoked_at: t.revoked_at,
        }
    }
}

/// An operator token: the operator it signs in to the console.
#[derive(Debug, Serialize)]
pub(in crate::operator::cli) struct OperatorToken {
    id: Uuid,
    operator: String,
    created_at: DateTime<Utc>,
    revoked_at: Option<DateTime<Utc>>,
}

impl From<&OperatorTokenView> for OperatorToken {
    fn from(t: &OperatorTokenView) -> OperatorToken {
        OperatorToken {
            id: t.id,
            operator: t.operator.clone(),
            created_at: t.created_at,
            revoked_at: t.revoked_at,
        }
    }
}
