//! `fleet plugins install SOURCE [--tool-id T] [--sha256 H]`, `fleet plugins list`,
//! `fleet plugins remove T [--version V]`, `fleet plugins describe T` — thin clients of the operator API
//! ([`super::service`]; wire types in `proto::admin::plugins`).
//!
//! `SOURCE` is an `http(s)` URL (the front downloads it), a local `.json` distribution descriptor
//! (`{"tool_id"?, "version"?, "binary_urls": {…}}`: the front resolves the asset for its platform), a local
//! archive (`.tar.gz`, `.tgz`, `.zip`, or any other file: a raw binary), or a local directory (packed as a
//! tar.gz). Local files are uploaded to the packages object store under their SHA-256 first, then installed by
//! reference.

use std::path::Path;
use std::time::Duration;

use fleet_proto::admin::plugins::{DESCRIBE, INSTALL, LIST, REMOVE, subject};
use fleet_proto::api::{ApiError, ApiErrorCode};
use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};

use super::object_name;
use super::store::PluginStore;
use crate::client_cmd::OperatorConn;
use fleet_store::StoreSettings;

/// How long the CLI waits for an install (downloads and validation happen on the front).
pub const INSTALL_WAIT: Duration = Duration::from_secs(600);

/// Connection flags shared by every `fleet plugins` command (see [`OperatorConn`]).
pub type Conn = OperatorConn;

/// `fleet plugins …`.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum PluginsCmd {
    /// Publish a plugin package to the fleet (URL, archive, directory or binary_urls descriptor); it becomes the
    /// current version.
    Install {
        /// An http(s) URL, a local archive / binary, a directory, or a .json descriptor with `binary_urls`.
        source: String,
        /// The tool id (default: from the package).
        #[arg(long)]
        tool_id: Option<String>,
        /// The package's expected SHA-256 (lower hex).
        #[arg(long)]
        sha256: Option<String>,
        #[command(flatten)]
        conn: Conn,
    },
    /// List the published plugins and their versions.
    List {
        #[command(flatten)]
        conn: Conn,
    },
    /// Remove a plugin, or one of its versions.
    Remove {
        /// The tool id.
        tool_id: String,
        /// Only this version (not the current one).
        #[arg(long)]
        version: Option<String>,
        #[command(flatten)]
        conn: Conn,
    },
    /// The plugin's record: versions, packages, the cached in-archive manifest, and the manifest a worker described.
    Describe {
        /// The tool id.
        tool_id: String,
        #[command(flatten)]
        conn: Conn,
    },
}

fn invalid(msg: impl Into<String>) -> ApiError {
    ApiError::new(ApiErrorCode::InvalidArg, msg)
}

/// Sends one operator call.
pub async fn request(
    client: &async_nats::Client,
    token: &str,
    method: &str,
    body: &Value,
    wait: Duration,
) -> Result<Value, ApiError> {
    fleet_client::api::request(client, token, subject(method), body, wait).await
}

/// Runs a `fleet plugins` command and returns what to print.
pub async fn run(cmd: &PluginsCmd) -> Result<Value, ApiError> {
    match cmd {
        PluginsCmd::Install {
            source,
            tool_id,
            sha256,
            conn,
        } => {
            let token = conn.token()?;
            let client = conn.connect().await?;
            let body = install_body(&client, source, tool_id.as_deref(), sha256.as_deref()).await?;
            request(&client, &token, INSTALL, &body, INSTALL_WAIT).await
        }
        PluginsCmd::List { conn } => {
            let token = conn.token()?;
            request(
                &conn.connect().await?,
                &token,
                LIST,
                &json!({}),
                Duration::from_secs(30),
            )
            .await
        }
        PluginsCmd::Remove {
            tool_id,
            version,
            conn,
        } => {
            let token = conn.token()?;
            let mut body = json!({ "tool_id": tool_id });
            if let Some(v) = version {
                body["version"] = json!(v);
            }
            request(
                &conn.connect().await?,
                &token,
                REMOVE,
                &body,
                Duration::from_secs(60),
            )
            .await
        }
        PluginsCmd::Describe { tool_id, conn } => {
            let token = conn.token()?;
            request(
                &conn.connect().await?,
                &token,
                DESCRIBE,
                &json!({ "tool_id": tool_id }),
                Duration::from_secs(30),
            )
            .await
        }
    }
}

/// The `plugins.install` body for `source`, uploading local packages first.
pub async fn install_body(
    client: &async_nats::Client,
    source: &str,
    tool_id: Option<&str>,
    sha256: Option<&str>,
) -> Result<Value, ApiError> {
    let mut body = json!({});
    if let Some(t) = tool_id {
        body["tool_id"] = json!(t);
    }
    if let Some(h) = sha256 {
        body["sha256"] = json!(h);
    }
    if source.starts_with("http://") || source.starts_with("https://") {
        body["source"] = json!(source);
        return Ok(body);
    }
    let path = Path::new(source);
    let meta = std::fs::metadata(path).map_err(|e| invalid(format!("{source}: {e}")))?;
    if meta.is_file() && source.to_ascii_lowercase().ends_with(".json") {
        let text = std::fs::read(path).map_err(|e| invalid(format!("{source}: {e}")))?;
        let descriptor: Value =
            serde_json::from_slice(&text).map_err(|e| invalid(format!("{source}: invalid JSON: {e}")))?;
        let Some(obj) = descriptor.as_object() else {
            return Err(invalid(format!(
                "{source}: expected a JSON object with `binary_urls`"
            )));
        };
        for key in ["binary_urls", "tool_id", "version", "entrypoint"] {
            if let Some(v) = obj.get(key)
                && body.get(key).is_none()
            {
                body[key] = v.clone();
            }
        }
        if body.get("binary_urls").is_none() {
            return Err(invalid(format!("{source}: a descriptor needs `binary_urls`")));
        }
        return Ok(body);
    }
    let (bytes, file_name) = if meta.is_dir() {
        let packed = tokio::task::spawn_blocking({
            let dir = path.to_path_buf();
            move || pack_dir(&dir)
        })
        .await
        .map_err(|e| invalid(e.to_string()))?
        .map_err(|e| invalid(format!("{source}: cannot pack the directory: {e}")))?;
        let name = path
            .file_name()
            .map(|n| format!("{}.tar.gz", n.to_string_lossy()))
            .unwrap_or_else(|| "package.tar.gz".into());
        (packed, name)
    } else {
        let bytes = std::fs::read(path).map_err(|e| invalid(format!("{source}: {e}")))?;
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        (bytes, name)
    };
    let hex = hex::encode(Sha256::digest(&bytes));
    // Operator tooling attaches to the store a front created (its NATS user may only upload packages).
    let plugins = PluginStore::open(
        &async_nats::jetstream::new(client.clone()),
        &StoreSettings {
            provision: fleet_store::Provision::Attach,
            ..StoreSettings::default()
        },
    )
    .await
    .map_err(|e| e.to_api_error())?;
    let tmp = std::env::temp_dir().join(format!("fleet-upload-{:016x}", rand::random::<u64>()));
    std::fs::write(&tmp, &bytes).map_err(|e| invalid(format!("{}: {e}", tmp.display())))?;
    let put = plugins
        .put_object(&object_name(&hex), &tmp, bytes.len() as u64)
        .await;
    let _ = std::fs::remove_file(&tmp);
    put.map_err(|e| e.to_api_error())?;
    body["object"] = json!(hex);
    body["file_name"] = json!(file_name);
    body["size"] = json!(bytes.len());
    Ok(body)
}

/// A directory as a tar.gz (symbolic links kept as links; the installer checks them).
pub fn pack_dir(dir: &Path) -> std::io::Result<Vec<u8>> {
    let enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    let mut tar = tar::Builder::new(enc);
    tar.follow_symlinks(false);
    tar.sparse(false);
    tar.append_dir_all(".", dir)?;
    tar.into_inner()?.finish()
}
