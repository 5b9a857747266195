//! Plugin distribution across the fleet (spec §14): an operator publishes a package once; every worker installs
//! it lazily on first use.
//!
//! - [`store`]: packages, content-addressed (`sha256-<hex>`), in the JetStream object store
//!   `<prefix>_plugin_packages`; one [`PluginRecord`] per tool id (its versions and the `current` one) in the KV
//!   bucket `<prefix>_plugins`.
//! - [`download`]: `http(s)` downloads to `/tmp/executa-{tool_id}-{rand}` with progress, a size cap, and early
//!   refusal of a `Content-Length` that contradicts the declared size.
//! - [`publish`]: the operator side: resolve the source (URL, `binary_urls` for this platform, or an uploaded
//!   object), download, run the whole install pipeline in a scratch home (so a bad package is refused before any
//!   worker sees it: size, sha256, zip-slip, entrypoint), store the package, and make it current by
//!   compare-and-set.
//! - [`service`]: the NATS operator API `fleet.v1.admin.plugins.{install,list,remove,describe}` (operator claim).
//! - [`cli`]: `fleet plugins install|list|remove|describe`.
//! - [`installer`]: the worker side: on an exec for a tool id the local catalogue does not have, read its record,
//!   and unless the current version is already active, take it from the local cache (verified by the recorded
//!   sha256) or fetch it from the object store (verified again by hash), commit it with the pipeline, and hand it to
//!   the pool — new sessions use it, running ones finish their invokes on the old version, then drain.
#![forbid(unsafe_code)]

pub mod cli;
pub mod download;
pub mod installer;
pub mod publish;
pub mod service;
pub mod store;

use fleet_proto::api::{ApiError, ApiErrorCode};
use fleet_worker::install::InstallError;
use serde_json::json;

pub use installer::Installer;
pub use store::PluginStore;

/// Largest package accepted for download or upload (ours; the extracted size is capped separately by
/// [`fleet_worker::install::MAX_EXTRACT_BYTES`]).
pub const MAX_PACKAGE_BYTES: u64 = 1024 * 1024 * 1024;

/// Environment variable overriding a worker's install home (spec §14.3 `ANNA_EXECUTA_HOME`).
pub const EXECUTA_HOME_ENV: &str = "ANNA_EXECUTA_HOME";

/// Environment variable setting how many old versions a worker keeps (spec §14.3 `EXECUTA_KEEP_VERSIONS`).
pub const KEEP_VERSIONS_ENV: &str = "EXECUTA_KEEP_VERSIONS";

pub use fleet_proto::admin::plugins::{PackageVersion, PluginRecord};

/// Why a plugin operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PluginError {
    /// The install pipeline refused the package.
    #[error(transparent)]
    Install(#[from] InstallError),
    /// The download failed (nothing was committed; retrying is safe).
    #[error("download of {url} failed: {reason}")]
    Download {
        /// The URL.
        url: String,
        /// Why.
        reason: String,
    },
    /// The request is malformed.
    #[error("{0}")]
    BadRequest(String),
    /// No such plugin (or version).
    #[error("plugin {tool_id}{}: not found", version.as_deref().map(|v| format!(" v{v}")).unwrap_or_default())]
    NotFound {
        /// The tool id.
        tool_id: String,
        /// The version, if one was asked.
        version: Option<String>,
    },
    /// The installed plugin cannot be launched on this worker (missing runtime, entry…).
    #[error("plugin {tool_id} cannot be launched: {reason}")]
    Launch {
        /// The tool id.
        tool_id: String,
        /// What is missing.
        reason: String,
    },
    /// JetStream (KV or object store) failed.
    #[error("plugin store: {op}: {reason}")]
    Store {
        /// The operation.
        op: &'static str,
        /// Why.
        reason: String,
    },
    /// A local file operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl From<fleet_store::StoreError> for PluginError {
    fn from(e: fleet_store::StoreError) -> PluginError {
        match e {
            fleet_store::StoreError::TooLarge { size, max, .. } => PluginError::BadRequest(format!(
                "the plugin record would be {size} bytes, over its {max}: remove old versions"
            )),
            e => PluginError::Store {
                op: "edit a plugin record",
                reason: e.to_string(),
            },
        }
    }
}

impl PluginError {
    pub(crate) fn store(op: &'static str) -> impl FnOnce(&dyn std::fmt::Display) -> PluginError {
        move |e| PluginError::Store {
            op,
            reason: e.to_string(),
        }
    }

    pub(crate) fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> PluginError {
        let context = context.into();
        move |source| PluginError::Io { context, source }
    }

    /// The API error for this failure.
    pub fn to_api_error(&self) -> ApiError {
        let message = self.to_string();
        match self {
            PluginError::Install(_) | PluginError::BadRequest(_) => {
                ApiError::new(ApiErrorCode::InvalidArg, message)
            }
            PluginError::Download { .. } => {
                ApiError::with_details(ApiErrorCode::InvalidArg, message, json!({ "retriable": true }))
            }
            PluginError::NotFound { .. } => ApiError::new(ApiErrorCode::NotFound, message),
            PluginError::Launch { .. } => ApiError::new(ApiErrorCode::ExecutaUnavailable, message),
            PluginError::Store { .. } | PluginError::Io { .. } => ApiError::with_details(
                ApiErrorCode::AgentUnavailable,
                message,
                json!({ "retriable": true }),
            ),
        }
    }
}

/// The object name of a package: content-addressed, so a package is stored once however often it is published.
pub fn object_name(sha256: &str) -> String {
    format!("sha256-{sha256}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_api_codes() {
        let refused = PluginError::Install(InstallError::SizeMismatch {
            expected: 1,
            actual: 2,
        });
        assert_eq!(refused.to_api_error().code, ApiErrorCode::InvalidArg);
        let download = PluginError::Download {
            url: "http://x/p.tgz".into(),
            reason: "interrupted".into(),
        }
        .to_api_error();
        assert_eq!(download.code, ApiErrorCode::InvalidArg);
        assert_eq!(download.details, Some(json!({ "retriable": true })));
        let missing = PluginError::NotFound {
            tool_id: "t".into(),
            version: Some("1".into()),
        };
        assert_eq!(missing.to_string(), "plugin t v1: not found");
        assert_eq!(missing.to_api_error().code, ApiErrorCode::NotFound);
        let launch = PluginError::Launch {
            tool_id: "t".into(),
            reason: "type go needs `go` on PATH (or set `command`)".into(),
        };
        assert_eq!(launch.to_api_error().code, ApiErrorCode::ExecutaUnavailable);
        assert_eq!(object_name("ab"), "sha256-ab");
    }

    #[test]
    fn install_arguments_are_strict() {
        let ok: fleet_proto::admin::plugins::InstallArgs =
            serde_json::from_value(json!({ "source": "https://h/p.zip", "sha256": "00" })).expect("valid");
        assert_eq!(ok.source.as_deref(), Some("https://h/p.zip"));
        assert!(
            serde_json::from_value::<fleet_proto::admin::plugins::InstallArgs>(json!({ "sorce": "x" }))
                .is_err()
        );
    }
}
