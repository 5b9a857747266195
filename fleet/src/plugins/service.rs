//! The operator API over NATS: `fleet.v1.admin.plugins.<method>` (queue group `fleet-api-plugins`: any front
//! answers), request/reply with the `Authorization: Bearer <JWT>` header; the token needs the operator claim.
//! Answers are the API envelope (`{"ok": …}` / `{"error": {code, message, details}}`).
//!
//! | Subject | Arguments | Result |
//! |---|---|---|
//! | `fleet.v1.admin.plugins.install` | [`InstallArgs`] | [`Published`](fleet_proto::admin::plugins::Published) |
//! | `fleet.v1.admin.plugins.list` | `{}` | [`Listed`] |
//! | `fleet.v1.admin.plugins.remove` | [`RemoveArgs`] | [`Removed`] |
//! | `fleet.v1.admin.plugins.describe` | [`DescribeArgs`] | [`Described`] |

use std::path::PathBuf;
use std::sync::Arc;

use fleet_proto::api::{ApiError, ApiErrorCode};
use serde_json::Value;

use super::download::SourcePolicy;
use super::publish;
use super::store::PluginStore;
use crate::operator;
use fleet_client::auth::OperatorVerifier;
use fleet_proto::admin::parse_args as parse;
use fleet_proto::admin::plugins::{
    AREA, DESCRIBE, DescribeArgs, Described, INSTALL, InstallArgs, LIST, Listed, QUEUE_GROUP, REMOVE,
    RemoveArgs, Removed,
};
use fleet_store::Store;

struct Ctx {
    plugins: PluginStore,
    store: Store,
    scratch: PathBuf,
    sources: SourcePolicy,
}

/// Serves the operator API until the client closes. Each request is handled on its own task. Package downloads
/// connect only where `sources` allows.
pub async fn serve(
    client: async_nats::Client,
    plugins: PluginStore,
    store: Store,
    verifier: OperatorVerifier,
    scratch: PathBuf,
    sources: SourcePolicy,
) -> Result<tokio::task::JoinHandle<()>, async_nats::Error> {
    let ctx = Arc::new(Ctx {
        plugins,
        store,
        scratch,
        sources,
    });
    operator::serve(
        client,
        AREA,
        QUEUE_GROUP.to_owned(),
        verifier,
        "plugin distribution is an operator action",
        move |method, payload| {
            let ctx = ctx.clone();
            async move { call(&ctx, &method, &payload).await }
        },
    )
    .await
}

async fn call(ctx: &Ctx, method: &str, payload: &[u8]) -> Result<Value, ApiError> {
    match method {
        INSTALL => {
            let args: InstallArgs = parse(payload)?;
            let published = publish::install(&ctx.plugins, &ctx.scratch, &ctx.sources, args)
                .await
                .map_err(|e| e.to_api_error())?;
            Ok(serde_json::to_value(&published).unwrap_or(Value::Null))
        }
        LIST => {
            let _: Value = parse(payload)?;
            let plugins = publish::list(&ctx.plugins).await.map_err(|e| e.to_api_error())?;
            Ok(serde_json::to_value(&Listed { plugins }).unwrap_or(Value::Null))
        }
        REMOVE => {
            let args: RemoveArgs = parse(payload)?;
            let removed = publish::remove(&ctx.plugins, &args.tool_id, args.version.as_deref())
                .await
                .map_err(|e| e.to_api_error())?;
            // The whole plugin is gone: `tools.list` stops listing it.
            if matches!(ctx.plugins.get(&args.tool_id).await, Ok(None))
                && let Err(e) = ctx.store.delete_manifest(&args.tool_id).await
            {
                tracing::warn!(tool_id = %args.tool_id, error = %e, "cannot forget the removed plugin's manifest");
            }
            let removed = Removed {
                tool_id: args.tool_id,
                removed,
            };
            Ok(serde_json::to_value(&removed).unwrap_or(Value::Null))
        }
        DESCRIBE => {
            let args: DescribeArgs = parse(payload)?;
            let plugin = publish::describe(&ctx.plugins, &args.tool_id)
                .await
                .map_err(|e| e.to_api_error())?;
            let manifest = ctx.store.manifest(&args.tool_id).await.ok().flatten();
            Ok(serde_json::to_value(&Described { plugin, manifest }).unwrap_or(Value::Null))
        }
        other => Err(ApiError::new(
            ApiErrorCode::InvalidArg,
            format!("unknown plugins method {other:?} (install, list, remove, describe)"),
        )),
    }
}
