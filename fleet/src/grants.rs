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
                .edit_with(
                    &a.user,
                    &a.tool_id,
                    &a.allow,
                    &a.revoke,
                    fleet_services::grants::GrantSettings {
                        image: a.image,
                        web_grant: a.web_grant.as_ref(),
                        granted_tools: a.granted_tools.as_deref(),
                    },
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
    /// Images the user may get in any rolling 24 h, all plugins together (spec §8.6 `max_images_per_day`;
    /// default 50).
    #[arg(long, value_name = "N")]
    pub image_max_per_day: Option<u32>,
    /// Images one `image/generate` or `image/edit` call may ask for, 1–8 (spec §8.6 `max_per_call`; default 4
    /// for generate, 1 for edit).
    #[arg(long, value_name = "N")]
    pub image_max_per_call: Option<u32>,
    /// Images one invoke may get, all its `image/*` calls together (spec §7.4 `image_token.max_images`;
    /// default 4).
    #[arg(long, value_name = "N")]
    pub image_max_per_invoke: Option<u32>,
    /// The spec's `web_grant` as JSON (`{"enabled":true,"allowSearch":true,"allowFetch":true,"allowAdvanced":false,
    /// "allowImageSearch":false,"allowImageFetch":false,"maxResultsPerCall":10}`): sets every `web.*` capability
    /// and the web settings; `{"enabled":false}` revokes web.
    #[arg(long, value_parser = parse_web_grant)]
    pub web_grant: Option<grants::WebGrantShape>,
    /// The tools the plugin's agent sessions may call as the user, comma-separated (`*`, a tool id, or
    /// `tool_id.tool`; an empty value: none); replaces the list (never set: none).
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
    let image = (args.image_max_per_day.is_some()
        || args.image_max_per_call.is_some()
        || args.image_max_per_invoke.is_some())
    .then_some(grants::ImageGrant {
        max_images_per_day: args.image_max_per_day,
        max_per_call: args.image_max_per_call,
        max_per_invoke: args.image_max_per_invoke,
    });
    let unchanged = args.allow.is_empty()
        && args.revoke.is_empty()
        && image.is_none()
        && args.web_grant.is_none()
        && args.granted_tools.is_none();
    let grant = if unchanged {
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
            image,
            web_grant: args.web_grant.clone(),
            granted_tools: args
                .granted_tools
                .clone()
                .map(|t| t.into_iter().filter(|s| !s.is_empty()).collect()),
        };
        client.grants_set(&set, wait).await?
    };
    printable(grant)
}

/// Parses `--web-grant` (the message names the shape, never echoes the text).
fn parse_web_grant(text: &str) -> Result<grants::WebGrantShape, String> {
    serde_json::from_str(text).map_err(|e| {
        format!(
            "not a web_grant object ({e}); expected {{\"enabled\":bool, \"allowSearch\"?, \"allowFetch\"?, \
             \"allowAdvanced\"?, \"allowImageSearch\"?, \"allowImageFetch\"?, \"maxResultsPerCall\"?}}"
        )
    })
}
