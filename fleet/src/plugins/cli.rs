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

use fleet_proto::admin::plugins::{DescribeArgs, InstallArgs, RemoveArgs, subject};
use fleet_proto::api::{ApiError, ApiErrorCode};
use serde_json::Value;
use sha2::{Digest as _, Sha256};

use super::object_name;
use super::store::PluginStore;
use crate::client_cmd::{OperatorConn, printable};
use fleet_store::StoreSettings;

/// How long the CLI waits for an install (downloads and validation happen on the front).
pub const INSTALL_WAIT: Duration = Duration::from_secs(600);
/// How long it waits for a list or a description.
const LIST_WAIT: Duration = Duration::from_secs(30);
/// How long it waits for a removal (packages deleted from the object store).
const REMOVE_WAIT: Duration = Duration::from_secs(60);

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
            let client = conn.client().await?;
            let args = install_args(client.nats(), source, tool_id.as_deref(), sha256.as_deref()).await?;
            printable(client.plugins_install(&args, INSTALL_WAIT).await?)
        }
        PluginsCmd::List { conn } => {
            let client = conn.client().await?;
            printable(client.plugins_list(LIST_WAIT).await?)
        }
        PluginsCmd::Remove {
            tool_id,
            version,
            conn,
        } => {
            let args = RemoveArgs {
                tool_id: tool_id.clone(),
                version: version.clone(),
            };
            let client = conn.client().await?;
            printable(client.plugins_remove(&args, REMOVE_WAIT).await?)
        }
        PluginsCmd::Describe { tool_id, conn } => {
            let args = DescribeArgs {
                tool_id: tool_id.clone(),
            };
            let client = conn.client().await?;
            printable(client.plugins_describe(&args, LIST_WAIT).await?)
        }
    }
}

/// The `plugins.install` arguments for `source`, uploading local packages first.
pub async fn install_args(
    client: &async_nats::Client,
    source: &str,
    tool_id: Option<&str>,
    sha256: Option<&str>,
) -> Result<InstallArgs, ApiError> {
    let mut args = InstallArgs {
        tool_id: tool_id.map(str::to_owned),
        sha256: sha256.map(str::to_owned),
        ..InstallArgs::default()
    };
    if source.starts_with("http://") || source.starts_with("https://") {
        args.source = Some(source.to_owned());
        return Ok(args);
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
        let text_of = |key: &str| -> Result<Option<String>, ApiError> {
            match obj.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(_) => Err(invalid(format!("{source}: `{key}` must be a string"))),
            }
        };
        args.tool_id = args.tool_id.or(text_of("tool_id")?);
        args.version = text_of("version")?;
        args.entrypoint = text_of("entrypoint")?;
        match obj.get("binary_urls") {
            Some(Value::Object(urls)) => args.binary_urls = Some(urls.clone()),
            Some(_) => return Err(invalid(format!("{source}: `binary_urls` must be an object"))),
            None => return Err(invalid(format!("{source}: a descriptor needs `binary_urls`"))),
        }
        return Ok(args);
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
    args.object = Some(hex);
    args.file_name = Some(file_name);
    args.size = Some(bytes.len() as u64);
    Ok(args)
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
