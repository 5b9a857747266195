//! Grants' operator side: the operator API `fleet.v1.admin.grants.{set,get}` (operator tokens only; wire types
//! in `proto::admin::grants`) over the grants bucket of `fleet_services::grants`, and `fleet grant`.

use std::time::Duration;

use fleet_client::auth::OperatorVerifier;
use fleet_proto::admin::{self, ADMIN_QUEUE_GROUP, grants};
use fleet_proto::api::{ApiError, ApiErrorCode};
use fleet_services::grants::GrantStore;
use serde_json::Value;

use crate::client_cmd::{OperatorConn, printable};
use crate::operator;

/// Serves `fleet.v1.admin.grants.*` (queue group: any front answers) until the client closes. Every call needs
/// an operator token.
pub async fn serve_admin(
    client: async_nats::Client,
    grants: GrantStore,
    verifier: OperatorVerifier,
) -> Result<tokio::task::JoinHandle<()>, async_nats::Error> {
    operator::serve(
        client,
        grants::AREA,
        ADMIN_QUEUE_GROUP.to_owned(),
        verifier,
        "grants are operator actions",
        move |method, payload| {
            let grants = grants.clone();
            async move { admin_call(&grants, &method, &payload).await }
        },
    )
    .await
}

async fn admin_call(store: &GrantStore, method: &str, payload: &[u8]) -> Result<Value, ApiError> {
    let grant = match method {
        grants::SET => {
            let a: grants::SetArgs = admin::parse_args(payload)?;
            store
                .edit_with_tools(
                    &a.user,
                    &a.tool_id,
                    &a.allow,
                    &a.revoke,
                    a.granted_tools.as_deref(),
                )
                .await
        }
        grants::GET => {
            let a: grants::GetArgs = admin::parse_args(payload)?;
            store.get(&a.user, &a.tool_id).await
        }
        other => {
            return Err(ApiError::new(
                ApiErrorCode::InvalidArg,
                format!("unknown admin method grants.{other}"),
            ));
        }
    };
    grant
        .map(|g| serde_json::to_value(g).unwrap_or(Value::Null))
        .map_err(|e| e.to_api_error())
}

/// `fleet grant` (this exact interface: `--user U --tool-id T --allow a,b` / `--revoke a,b`).
#[derive(Debug, Clone, clap::Args)]
pub struct GrantArgs {
    /// The user the grant is for.
    #[arg(long)]
    pub user: String,
    /// The plugin.
    #[arg(long)]
    pub tool_id: String,
    /// Capabilities to allow, comma-separated (aps.kv, aps.files, llm.sample, llm.embed, host.upload, …).
    #[arg(long, value_delimiter = ',')]
    pub allow: Vec<String>,
    /// Capabilities to revoke, comma-separated (`*`: all).
    #[arg(long, value_delimiter = ',')]
    pub revoke: Vec<String>,
    /// The tools the plugin's agent sessions may call as the user, comma-separated (`*`, a tool id, or
    /// `tool_id.tool`; an empty value: none); replaces the list (unset: every tool).
    #[arg(long, value_delimiter = ',')]
    pub granted_tools: Option<Vec<String>>,
    /// `--nats-url`, `--data-dir`, `--token`.
    #[command(flatten)]
    pub conn: OperatorConn,
}

/// Runs `fleet grant`: prints the grant as it is now.
pub async fn run_grant(args: &GrantArgs) -> Result<Value, ApiError> {
    let client = args.conn.client().await?;
    let wait = Duration::from_secs(10);
    let grant = if args.allow.is_empty() && args.revoke.is_empty() && args.granted_tools.is_none() {
        let get = grants::GetArgs {
            user: args.user.clone(),
            tool_id: args.tool_id.clone(),
        };
        client.grants_get(&get, wait).await?
    } else {
        let set = grants::SetArgs {
            user: args.user.clone(),
            tool_id: args.tool_id.clone(),
            allow: args.allow.clone(),
            revoke: args.revoke.clone(),
            granted_tools: args
                .granted_tools
                .clone()
                .map(|t| t.into_iter().filter(|s| !s.is_empty()).collect()),
        };
        client.grants_set(&set, wait).await?
    };
    printable(grant)
}
