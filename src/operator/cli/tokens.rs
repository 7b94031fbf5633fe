//! `onejob tokens …`: make, list and revoke the gateway's tenant tokens and
//! the console's operator tokens. Every grant and revocation is audited.

use std::io::Write;

use clap::Subcommand;
use serde_json::json;

use super::printed::token::{GatewayToken, OperatorToken};
use uuid::Uuid;

use super::{Connections, Failure, Outcome, shown, store};
use crate::edges::store::{Actor, Store};
use crate::settings::token::Token;

#[derive(Subcommand, Debug)]
pub(super) enum TokensCommand {
    /// Make a bearer token and print it once (on stdout alone, so
    /// `TOKEN=$(onejob tokens create --owner O)` works): a tenant's for the
    /// gateway (`--owner`, `ojt_…`) or an operator's for the console
    /// (`--operator`, `ojo_…`); neither is taken where the other is. Only its
    /// SHA-256 is stored: a lost token cannot be shown again; revoke it and make
    /// another.
    #[command(group(clap::ArgGroup::new("who").required(true)))]
    Create {
        /// The owner whose jobs the token may create and read (a gateway token).
        #[arg(long, group = "who")]
        owner: Option<String>,
        /// The operator the token signs in to the console (an operator token).
        #[arg(long, group = "who")]
        operator: Option<String>,
        /// Why, for the audit table (the grant and its row commit together).
        #[arg(long)]
        reason: Option<String>,
    },
    /// List gateway tokens (or, with --operators, operator tokens): id, owner,
    /// when made and when revoked. Never the tokens.
    List {
        /// Only this owner's.
        #[arg(long, conflicts_with = "operators")]
        owner: Option<String>,
        /// Operator tokens instead.
        #[arg(long)]
        operators: bool,
    },
    /// Revoke a token (either kind): the gateway or the console refuses it from
    /// its next request on.
    Revoke {
        /// The token's id, as `tokens list` shows it.
        token_id: Uuid,
        /// Why, for the audit table (the revocation and its row commit together).
        #[arg(long)]
        reason: Option<String>,
    },
}

/// `onejob tokens …`: a store error that says the tables are missing tells
/// the operator to migrate first.
pub(super) async fn run(
    c: &Connections,
    command: TokensCommand,
    json: bool,
    out: &mut impl Write,
) -> Outcome {
    let config = c.load_config()?;
    let store = store(c, &config).await?;
    let done = match command {
        TokensCommand::Create {
            operator: Some(operator),
            reason,
            ..
        } => create_operator(&store, &operator, reason.as_deref(), json, out).await,
        TokensCommand::Create { owner, reason, .. } => {
            create_owner(
                &store,
                &owner.unwrap_or_default(),
                reason.as_deref(),
                json,
                out,
            )
            .await
        }
        TokensCommand::List {
            operators: true, ..
        } => list_operators(&store, json, out).await,
        TokensCommand::List { owner, .. } => list_owners(&store, owner.as_deref(), json, out).await,
        TokensCommand::Revoke { token_id, reason } => {
            revoke(&store, token_id, reason.as_deref(), json, out).await
        }
    };
    done.map_err(|e| match e {
        TokenFailure::Store(e) if e.is_undefined_table() => Failure(
            "the database has no onejob tables yet: run `onejob migrate` (or start a worker) first"
                .into(),
        ),
        TokenFailure::Store(e) => Failure(e.to_string()),
        TokenFailure::Refused(f) => f,
    })
}

enum TokenFailure {
    Store(crate::edges::store::StoreError),
    Refused(Failure),
}

impl From<crate::edges::store::StoreError> for TokenFailure {
    fn from(e: crate::edges::store::StoreError) -> Self {
        TokenFailure::Store(e)
    }
}

impl From<std::io::Error> for TokenFailure {
    fn from(e: std::io::Error) -> Self {
        TokenFailure::Refused(e.into())
    }
}

type TokenOutcome = Result<(), TokenFailure>;

/// `tokens create --operator`.
async fn create_operator(
    store: &Store,
    operator: &str,
    reason: Option<&str>,
    as_json: bool,
    out: &mut impl Write,
) -> TokenOutcome {
    crate::intent::Intent::check_owner_id(operator)
        .map_err(|e| TokenFailure::Refused(Failure(format!("--operator: {e}"))))?;
    let token = Token::generate_operator();
    let id = store
        .tokens()
        .create_operator_token(operator, &token, &Actor::cli(reason))
        .await?;
    if as_json {
        writeln!(
            out,
            "{}",
            json!({ "operator": operator, "token": token.reveal() })
        )?;
    } else {
        writeln!(out, "{}", token.reveal())?;
        eprintln!(
            "operator token {id} for {operator}: shown this once, only its SHA-256 is stored"
        );
    }
    Ok(())
}

/// `tokens create --owner`.
async fn create_owner(
    store: &Store,
    owner: &str,
    reason: Option<&str>,
    as_json: bool,
    out: &mut impl Write,
) -> TokenOutcome {
    crate::intent::Intent::check_owner_id(owner)
        .map_err(|e| TokenFailure::Refused(Failure(format!("--owner: {e}"))))?;
    let token = Token::generate();
    let id = store
        .tokens()
        .create_token(owner, &token, &Actor::cli(reason))
        .await?;
    if as_json {
        writeln!(
            out,
            "{}",
            json!({ "owner_id": owner, "token": token.reveal() })
        )?;
    } else {
        writeln!(out, "{}", token.reveal())?;
        eprintln!("token {id} for owner {owner}: shown this once, only its SHA-256 is stored");
    }
    Ok(())
}

/// `tokens list --operators`.
async fn list_operators(store: &Store, as_json: bool, out: &mut impl Write) -> TokenOutcome {
    let tokens = store.tokens().operator_tokens().await?;
    if as_json {
        let printed: Vec<OperatorToken> = tokens.iter().map(OperatorToken::from).collect();
        writeln!(
            out,
            "{}",
            serde_json::to_value(&printed).unwrap_or_default()
        )?;
    } else if tokens.is_empty() {
        writeln!(out, "no operator tokens")?;
    } else {
        for t in &tokens {
            writeln!(
                out,
                "{}  operator {}  created {}  {}",
                t.id,
                shown(&t.operator),
                t.created_at.format("%Y-%m-%d %H:%M:%S UTC"),
                token_state(t.revoked_at)
            )?;
        }
    }
    Ok(())
}

/// `tokens list`, with or without `--owner`.
async fn list_owners(
    store: &Store,
    owner: Option<&str>,
    as_json: bool,
    out: &mut impl Write,
) -> TokenOutcome {
    let tokens = store.tokens().list(owner).await?;
    if as_json {
        let printed: Vec<GatewayToken> = tokens.iter().map(GatewayToken::from).collect();
        writeln!(
            out,
            "{}",
            serde_json::to_value(&printed).unwrap_or_default()
        )?;
    } else if tokens.is_empty() {
        writeln!(out, "no tokens")?;
    } else {
        for t in &tokens {
            writeln!(
                out,
                "{}  owner {}  created {}  {}",
                t.id,
                shown(&t.owner_id),
                t.created_at.format("%Y-%m-%d %H:%M:%S UTC"),
                token_state(t.revoked_at)
            )?;
        }
    }
    Ok(())
}

/// `tokens revoke`: a gateway token, else an operator token, by id.
async fn revoke(
    store: &Store,
    token_id: Uuid,
    reason: Option<&str>,
    as_json: bool,
    out: &mut impl Write,
) -> TokenOutcome {
    let actor = Actor::cli(reason);
    let (value, whose, revoked_at, already) = match store.tokens().revoke(token_id, &actor).await? {
        Some((t, already)) => (
            serde_json::to_value(GatewayToken::from(&t)).unwrap_or_default(),
            format!("of owner {}", t.owner_id),
            t.revoked_at,
            already,
        ),
        None => match store
            .tokens()
            .revoke_operator_token(token_id, &actor)
            .await?
        {
            Some((t, already)) => (
                serde_json::to_value(OperatorToken::from(&t)).unwrap_or_default(),
                format!("of operator {}", t.operator),
                t.revoked_at,
                already,
            ),
            None => {
                return Err(TokenFailure::Refused(Failure(format!(
                    "token {token_id} not found"
                ))));
            }
        },
    };
    if as_json {
        writeln!(out, "{value}")?;
    } else if already {
        let at = revoked_at
            .map(|at| format!(" on {}", at.format("%Y-%m-%d %H:%M:%S UTC")))
            .unwrap_or_default();
        writeln!(out, "token {token_id} {whose} was already revoked{at}")?;
    } else {
        writeln!(out, "token {token_id} {whose} revoked")?;
    }
    Ok(())
}

/// A token's state as `tokens list` prints it.
fn token_state(revoked_at: Option<chrono::DateTime<chrono::Utc>>) -> String {
    match revoked_at {
        Some(at) => format!("revoked {}", at.format("%Y-%m-%d %H:%M:%S UTC")),
        None => "active".into(),
    }
}
