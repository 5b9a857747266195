//! The operator API's wire types: `fleet.v1.admin.<area>.<method>`, request/reply with
//! `Authorization: Bearer <operator JWT>` (audience `cloud-agents-operator`), answers in the API envelope
//! ([`ApiResponse`](crate::api::ApiResponse): `{"ok": …}` / `{"error": {code, message, details}}`).
//!
//! | Subject | Arguments | Result | Errors |
//! |---|---|---|---|
//! | `fleet.v1.admin.grants.set` | [`grants::SetArgs`] | [`grants::Grant`] | `invalid_arg` (unknown capability, bad user or tool id), `internal_error` (the bucket) |
//! | `fleet.v1.admin.grants.get` | [`grants::GetArgs`] | [`grants::Grant`] (empty when never set) | as `set` |
//! | `fleet.v1.admin.plugins.install` | [`plugins::InstallArgs`] | `Published` (`fleet::plugins::publish`) | `invalid_arg` (refused package; a failed download has `details.retriable`), `agent_unavailable` (store, retriable) |
//! | `fleet.v1.admin.plugins.list` | `{}` | `{plugins: [`[`plugins::PluginRecord`]`]}` | `agent_unavailable` |
//! | `fleet.v1.admin.plugins.remove` | [`plugins::RemoveArgs`] | [`plugins::Removed`] | `not_found`, `invalid_arg`, `agent_unavailable` |
//! | `fleet.v1.admin.plugins.describe` | [`plugins::DescribeArgs`] | `{plugin: `[`plugins::PluginRecord`]`, manifest: <described manifest or null>}` | `not_found`, `agent_unavailable` |
//! | `fleet.v1.admin.credentials.set` | [`credentials::SetArgs`] | [`credentials::Listed`] (the names now stored in that scope; never values) | `invalid_arg` (bad user, tool id, name or value, a record over its cap), `internal_error` (the bucket, the keyring) |
//! | `fleet.v1.admin.credentials.list` | [`credentials::ListArgs`] | [`credentials::Listed`] | as `set` |
//! | `fleet.v1.admin.credentials.delete` | [`credentials::DeleteArgs`] | [`credentials::Deleted`] | as `set` |
//! | `fleet.v1.admin.credentials.rewrap` | `{}` | [`credentials::Rewrapped`] | `internal_error` (a record no key of the keyring opens, the bucket) |
//! | `fleet.v1.admin.creds.issue` | [`creds::NameArgs`] | [`creds::Issued`] | `invalid_arg` (bad name, an active credential of that name), `internal_error` |
//! | `fleet.v1.admin.creds.list` | `{}` | [`creds::Listed`] | `internal_error` |
//! | `fleet.v1.admin.creds.revoke` | [`creds::NameArgs`] | [`creds::Revoked`] | `not_found`, `internal_error` |
//!
//! Every area also answers `invalid_token` (no, malformed or expired token) and `permission_denied` (a current
//! token that is not an operator's), and refuses arguments that do not parse with `invalid_arg`
//! ([`parse_args`]). The plugin records ([`plugins::PluginRecord`], [`plugins::PackageVersion`]) and the package
//! [`plugins::Format`] live here too; the worker's install pipeline and `fleet::plugins` re-export them.

use serde::de::DeserializeOwned;

use crate::api::{ApiError, ApiErrorCode};

/// Subject prefix of the operator API.
pub const ADMIN_PREFIX: &str = "fleet.v1.admin";

/// The queue group of the grants, credentials and creds areas (any front answers).
pub const ADMIN_QUEUE_GROUP: &str = "fleet-api-admin";

/// The subject of `area`'s `method`, e.g. `fleet.v1.admin.grants.set`.
pub fn subject(area: &str, method: &str) -> String {
    format!("{ADMIN_PREFIX}.{area}.{method}")
}

/// An operator call's arguments (an empty or all-white-space payload is `{}`); `invalid_arg` when they do not
/// parse.
pub fn parse_args<T: DeserializeOwned>(payload: &[u8]) -> Result<T, ApiError> {
    let payload = if payload.iter().all(u8::is_ascii_whitespace) {
        b"{}".as_slice()
    } else {
        payload
    };
    serde_json::from_slice(payload)
        .map_err(|e| ApiError::new(ApiErrorCode::InvalidArg, format!("bad arguments: {e}")))
}

/// `fleet.v1.admin.grants.*`: which host capabilities a user allows one plugin to use.
pub mod grants {
    use std::collections::BTreeSet;

    use serde::{Deserialize, Serialize};

    /// The area (`fleet.v1.admin.grants.*`).
    pub const AREA: &str = "grants";
    /// `set`: [`SetArgs`] → the grant.
    pub const SET: &str = "set";
    /// `get`: [`GetArgs`] → the grant.
    pub const GET: &str = "get";
    /// In [`SetArgs::revoke`]: every capability.
    pub const REVOKE_ALL: &str = "*";

    /// `grants.set`: add `allow`, remove `revoke` (`*` = everything), atomically.
    #[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
    pub struct SetArgs {
        /// The user.
        pub user: String,
        /// The plugin.
        pub tool_id: String,
        /// Capabilities to allow.
        #[serde(default)]
        pub allow: Vec<String>,
        /// Capabilities to revoke ([`REVOKE_ALL`]: all).
        #[serde(default)]
        pub revoke: Vec<String>,
        /// Image limits to set (each field given replaces the grant's; absent fields are kept).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub image: Option<ImageGrant>,
        /// The spec's `web_grant`: sets every `web.*` capability and the web settings (applied after
        /// `revoke` and `allow`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub web_grant: Option<WebGrantShape>,
        /// When present, replaces [`Grant::granted_tools`].
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub granted_tools: Option<Vec<String>>,
    }

    /// `grants.get`.
    #[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
    pub struct GetArgs {
        /// The user.
        pub user: String,
        /// The plugin.
        pub tool_id: String,
    }

    /// Upload caps a grant may narrow (spec §8.7; both spellings, §16 A-29).
    #[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
    pub struct UploadGrant {
        /// Files per invoke.
        #[serde(default, alias = "maxFiles", skip_serializing_if = "Option::is_none")]
        pub max_files: Option<u32>,
        /// Largest file.
        #[serde(default, alias = "maxFileBytes", skip_serializing_if = "Option::is_none")]
        pub max_file_bytes: Option<u64>,
        /// Bytes per invoke.
        #[serde(default, alias = "maxTotalBytes", skip_serializing_if = "Option::is_none")]
        pub max_total_bytes: Option<u64>,
        /// Purposes.
        #[serde(default, alias = "allowedPurposes", skip_serializing_if = "Option::is_none")]
        pub allowed_purposes: Option<Vec<String>>,
    }

    /// Image limits of a grant (spec §8.6 `image_grant {max_images_per_day, max_per_call}`, and §7.4's per-invoke
    /// `max_images`); unset fields are the defaults of `limits` (`IMAGE_DEFAULT_MAX_PER_DAY`,
    /// `IMAGE_DEFAULT_MAX_PER_CALL_GENERATE` / `_EDIT`, `IMAGE_DEFAULT_MAX_PER_INVOKE`).
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
    pub struct ImageGrant {
        /// Images the user may have generated or edited in any rolling 24 h (all plugins together).
        #[serde(default, alias = "maxImagesPerDay", skip_serializing_if = "Option::is_none")]
        pub max_images_per_day: Option<u32>,
        /// Images one `image/generate` or `image/edit` call may ask for (never above the host's cap of 8).
        #[serde(default, alias = "maxPerCall", skip_serializing_if = "Option::is_none")]
        pub max_per_call: Option<u32>,
        /// Images one invoke may get, all its `image/*` calls together (spec §7.4 `image_token.max_images`;
        /// default `IMAGE_DEFAULT_MAX_PER_INVOKE`, 4).
        #[serde(default, alias = "maxPerInvoke", skip_serializing_if = "Option::is_none")]
        pub max_per_invoke: Option<u32>,
    }

    impl ImageGrant {
        /// `self` with every field `other` sets replaced.
        pub fn merged(self, other: ImageGrant) -> ImageGrant {
            ImageGrant {
                max_images_per_day: other.max_images_per_day.or(self.max_images_per_day),
                max_per_call: other.max_per_call.or(self.max_per_call),
                max_per_invoke: other.max_per_invoke.or(self.max_per_invoke),
            }
        }
    }

    /// The spec's `web_grant` (§8.9: `{enabled, allowSearch, allowFetch, allowAdvanced, allowImageSearch,
    /// allowImageFetch, maxResultsPerCall}`, default disabled), as `grants.set` accepts it: it becomes the
    /// capabilities `web.search`, `web.fetch`, `web.image_search`, `web.image_fetch` of the grant's `allow` set
    /// ([`WebGrantShape::capabilities`]) and its [`WebGrant`] (the two settings that are not capabilities).
    #[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub struct WebGrantShape {
        /// Web at all; `false` revokes every `web.*` capability.
        #[serde(default)]
        pub enabled: bool,
        /// `web/search` (default true once enabled).
        #[serde(default, alias = "allow_search", skip_serializing_if = "Option::is_none")]
        pub allow_search: Option<bool>,
        /// `web/fetch` (default true once enabled).
        #[serde(default, alias = "allow_fetch", skip_serializing_if = "Option::is_none")]
        pub allow_fetch: Option<bool>,
        /// `search_depth: "advanced"` (default false).
        #[serde(default, alias = "allow_advanced", skip_serializing_if = "Option::is_none")]
        pub allow_advanced: Option<bool>,
        /// `web/image_search` (default false).
        #[serde(
            default,
            alias = "allow_image_search",
            skip_serializing_if = "Option::is_none"
        )]
        pub allow_image_search: Option<bool>,
        /// `web/image_fetch` (default false).
        #[serde(default, alias = "allow_image_fetch", skip_serializing_if = "Option::is_none")]
        pub allow_image_fetch: Option<bool>,
        /// Results per search call (default and cap 10).
        #[serde(
            default,
            alias = "max_results_per_call",
            skip_serializing_if = "Option::is_none"
        )]
        pub max_results_per_call: Option<u32>,
    }

    /// The `web.*` capabilities, in the order of [`WebGrantShape`]'s flags.
    pub const WEB_CAPABILITIES: [&str; 4] = [
        crate::executa::capabilities::WEB_SEARCH,
        crate::executa::capabilities::WEB_FETCH,
        crate::executa::capabilities::WEB_IMAGE_SEARCH,
        crate::executa::capabilities::WEB_IMAGE_FETCH,
    ];

    impl WebGrantShape {
        /// The capabilities it allows and those it revokes (every `web.*` capability is in one of the two).
        pub fn capabilities(&self) -> (Vec<String>, Vec<String>) {
            let on = [
                self.allow_search.unwrap_or(true),
                self.allow_fetch.unwrap_or(true),
                self.allow_image_search.unwrap_or(false),
                self.allow_image_fetch.unwrap_or(false),
            ];
            let (mut allow, mut revoke) = (Vec::new(), Vec::new());
            for (cap, on) in WEB_CAPABILITIES.iter().zip(on) {
                if self.enabled && on {
                    allow.push((*cap).to_owned());
                } else {
                    revoke.push((*cap).to_owned());
                }
            }
            (allow, revoke)
        }

        /// The settings that are not capabilities.
        pub fn settings(&self) -> WebGrant {
            WebGrant {
                enabled: self.enabled,
                allow_advanced: self.enabled && self.allow_advanced.unwrap_or(false),
                max_results_per_call: self.max_results_per_call,
            }
        }
    }

    /// The web settings of a grant that are not capabilities (spec §8.9 `web_grant`).
    #[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
    pub struct WebGrant {
        /// `false`: the user turned web off for this plugin (its calls are `-32527 USER_DENIED`, not
        /// `-32521 NOT_GRANTED`).
        #[serde(default)]
        pub enabled: bool,
        /// `search_depth: "advanced"` allowed.
        #[serde(default, alias = "allowAdvanced")]
        pub allow_advanced: bool,
        /// Results per search call, below the host's cap of 10.
        #[serde(default, alias = "maxResultsPerCall", skip_serializing_if = "Option::is_none")]
        pub max_results_per_call: Option<u32>,
    }

    /// One user's grant to one plugin: the result of `set` and `get`, and the record kept in the grants bucket.
    #[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
    pub struct Grant {
        /// The user.
        pub user: String,
        /// The plugin.
        pub tool_id: String,
        /// Host capabilities allowed (`aps.kv`, `aps.files`, `llm.sample`, `llm.embed`, `host.upload`, …).
        #[serde(default)]
        pub allow: BTreeSet<String>,
        /// Upload caps narrower than the spec's defaults.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub upload: Option<UploadGrant>,
        /// Image limits other than the defaults.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub image: Option<ImageGrant>,
        /// Web settings beyond the `web.*` capabilities.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub web: Option<WebGrant>,
        /// The user's tools this plugin's agent sessions may call (spec §8.2 `granted_tools`): patterns of
        /// [`tool_pattern_covers`]; absent or empty: none (a user grants tools explicitly; `["*"]`: every tool).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub granted_tools: Option<BTreeSet<String>>,
        /// Last change, Unix ms (0: never set).
        #[serde(default)]
        pub updated_at_ms: u64,
    }

    impl Grant {
        /// Whether `capability` is allowed.
        pub fn allows(&self, capability: &str) -> bool {
            self.allow.contains(capability)
        }

        /// Whether the platform credential `name` (a name an OAuth provider maps) is granted: `credential:<name>`
        /// in [`Grant::allow`]. Consulted only where the operator makes platform credentials need a grant.
        pub fn allows_credential(&self, name: &str) -> bool {
            credential_capability(name).is_some_and(|c| self.allow.contains(&c))
        }

        /// Whether this plugin's agent sessions may call `tool` of `tool_id` ([`Grant::granted_tools`]).
        pub fn allows_agent_tool(&self, tool_id: &str, tool: &str) -> bool {
            self.granted_tools
                .as_ref()
                .is_some_and(|set| set.iter().any(|p| tool_pattern_covers(p, tool_id, tool)))
        }
    }

    /// The prefix of a grant entry that allows one platform credential (`credential:GMAIL_ACCESS_TOKEN`).
    pub const CREDENTIAL_PREFIX: &str = "credential:";

    /// The grant entry allowing the platform credential `name`; `None` for an empty name.
    pub fn credential_capability(name: &str) -> Option<String> {
        (!name.is_empty()).then(|| format!("{CREDENTIAL_PREFIX}{name}"))
    }

    /// Whether the tool pattern `pattern` — `*`, a tool id, or `tool_id.tool` — covers `tool` of `tool_id`.
    pub fn tool_pattern_covers(pattern: &str, tool_id: &str, tool: &str) -> bool {
        pattern == "*"
            || pattern == tool_id
            || pattern
                .split_once('.')
                .is_some_and(|(id, t)| id == tool_id && t == tool)
    }
}

/// `fleet.v1.admin.plugins.*`: plugin distribution.
pub mod plugins {
    use serde::{Deserialize, Serialize};
    use serde_json::{Map, Value};

    /// The area (`fleet.v1.admin.plugins.*`).
    pub const AREA: &str = "plugins";
    /// Its queue group.
    pub const QUEUE_GROUP: &str = "fleet-api-plugins";
    /// `install`: [`InstallArgs`] → [`Published`].
    pub const INSTALL: &str = "install";
    /// `list`: `{}` → [`Listed`].
    pub const LIST: &str = "list";
    /// `remove`: [`RemoveArgs`] → [`Removed`].
    pub const REMOVE: &str = "remove";
    /// `describe`: [`DescribeArgs`] → [`Described`].
    pub const DESCRIBE: &str = "describe";

    /// The subject of a method.
    pub fn subject(method: &str) -> String {
        super::subject(AREA, method)
    }

    /// A package's container format (spec §14.2 `format`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
    pub enum Format {
        /// gzip-compressed tar (`.tar.gz`, `.tgz`).
        #[serde(rename = "tar.gz")]
        TarGz,
        /// zip.
        #[serde(rename = "zip")]
        Zip,
        /// A single executable, installed as `bin/{tool_id}` with mode 0755.
        #[serde(rename = "raw")]
        Raw,
    }

    /// A declared `format` that is none of `tar.gz`, `tgz`, `zip`, `raw` (the text as given).
    #[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
    #[error("unknown format {0:?} (expected tar.gz, tgz, zip or raw)")]
    pub struct UnknownFormat(pub String);

    impl Format {
        /// Parses a declared `format`.
        ///
        /// # Errors
        /// [`UnknownFormat`] for anything but `tar.gz`, `tgz`, `zip` or `raw` (any case).
        pub fn parse(s: &str) -> Result<Format, UnknownFormat> {
            match s.to_ascii_lowercase().as_str() {
                "tar.gz" | "tgz" => Ok(Format::TarGz),
                "zip" => Ok(Format::Zip),
                "raw" => Ok(Format::Raw),
                _ => Err(UnknownFormat(s.to_string())),
            }
        }

        /// Inferred from a URL or file name (query and fragment ignored): `.tar.gz`/`.tgz` → tar+gzip, `.zip` →
        /// zip, anything else → raw (spec §14.2).
        pub fn infer(url_or_name: &str) -> Format {
            let path = url_or_name
                .split(['?', '#'])
                .next()
                .unwrap_or_default()
                .to_ascii_lowercase();
            if path.ends_with(".tar.gz") || path.ends_with(".tgz") {
                Format::TarGz
            } else if path.ends_with(".zip") {
                Format::Zip
            } else {
                Format::Raw
            }
        }

        /// The spelling used in records.
        pub fn as_str(self) -> &'static str {
            match self {
                Format::TarGz => "tar.gz",
                Format::Zip => "zip",
                Format::Raw => "raw",
            }
        }
    }

    impl std::fmt::Display for Format {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.as_str())
        }
    }

    /// One published version of a plugin.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    pub struct PackageVersion {
        /// The (sanitised) version.
        pub version: String,
        /// The package's SHA-256 (lower hex): workers verify every copy against it.
        pub sha256: String,
        /// The package's size in bytes.
        pub size: u64,
        /// Its object in the packages bucket.
        pub object: String,
        /// Its container format.
        pub format: Format,
        /// The launcher type.
        #[serde(rename = "type")]
        pub kind: String,
        /// The resolved entrypoint (binary packages).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub entrypoint: Option<String>,
        /// Where it came from (`url`, `binary_urls`, `platform_key`, `upload`).
        #[serde(default)]
        pub source: Value,
        /// The in-archive `manifest.json`, cached.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub manifest: Option<Value>,
        /// Warnings of the validation install (e.g. an entrypoint picked among several).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub warnings: Vec<String>,
        /// When it was published (ms since the epoch).
        pub published_at_ms: u64,
    }

    /// Everything the fleet knows about one plugin (`list`, `describe`).
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    pub struct PluginRecord {
        /// The (sanitised) tool id.
        pub tool_id: String,
        /// The version new sessions use.
        pub current: String,
        /// Every published version, by version.
        pub versions: std::collections::BTreeMap<String, PackageVersion>,
        /// Last change (ms since the epoch).
        pub updated_at_ms: u64,
    }

    impl PluginRecord {
        /// The current version's package.
        pub fn current_package(&self) -> Option<&PackageVersion> {
            self.versions.get(&self.current)
        }
    }

    /// `plugins.install` arguments: exactly one of `source` (an `http(s)` URL), `binary_urls` (per-platform
    /// assets, resolved for the front's platform key) or `object` (the SHA-256 of a package uploaded to the
    /// packages bucket as `sha256-<hex>`, e.g. by `fleet plugins install ./dir`).
    #[derive(Debug, Clone, Default, Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct InstallArgs {
        /// An `http(s)` URL of a `.tar.gz` / `.tgz` / `.zip` / raw binary.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub source: Option<String>,
        /// `{platform_key: url | {url, sha256?, size?, entrypoint?, format?}}` (spec §14.2).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub binary_urls: Option<Map<String, Value>>,
        /// An uploaded package: its SHA-256.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub object: Option<String>,
        /// The uploaded package's file name (for the format and a raw package's tool id).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub file_name: Option<String>,
        /// The tool id (default: the package's `manifest.json` `name` / `executa.json` `tool_id`; for a raw
        /// binary, the file name).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub tool_id: Option<String>,
        /// The version (default: the package's `manifest.json` / `executa.json` `version`, else `unknown`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub version: Option<String>,
        /// Expected SHA-256 of the package.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub sha256: Option<String>,
        /// Expected size in bytes.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub size: Option<u64>,
        /// Entrypoint override.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub entrypoint: Option<String>,
        /// Format override (`tar.gz`, `tgz`, `zip`, `raw`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub format: Option<String>,
    }

    /// What `plugins.install` answers.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    pub struct Published {
        /// The tool id.
        pub tool_id: String,
        /// The version now current.
        pub version: String,
        /// The version that was current before, if any.
        pub previous: Option<String>,
        /// The package.
        pub package: PackageVersion,
        /// Download statistics (URL sources).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub download: Option<Value>,
    }

    /// What `plugins.list` answers.
    #[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
    pub struct Listed {
        /// Every plugin published.
        pub plugins: Vec<PluginRecord>,
    }

    /// What `plugins.describe` answers.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    pub struct Described {
        /// The plugin's record.
        pub plugin: PluginRecord,
        /// The manifest a worker described (`tools.list`'s entry), once one has.
        pub manifest: Option<crate::executa::manifest::Manifest>,
    }

    /// `plugins.remove`: one version, or (no `version`) the whole plugin.
    #[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct RemoveArgs {
        /// The plugin.
        pub tool_id: String,
        /// The version to remove (none: every version).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub version: Option<String>,
    }

    /// What `plugins.remove` answers.
    #[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
    pub struct Removed {
        /// The plugin.
        pub tool_id: String,
        /// The versions removed.
        pub removed: Vec<String>,
    }

    /// `plugins.describe`.
    #[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct DescribeArgs {
        /// The plugin.
        pub tool_id: String,
    }
}

/// `fleet.v1.admin.credentials.*`: per-user plugin credentials (spec §4.2), which the fleet injects into
/// `params.context.credentials`. Values go in (`set`) and never come back out: every answer names credentials
/// and their scope only.
pub mod credentials {
    use std::collections::BTreeMap;
    use std::fmt;

    use serde::{Deserialize, Serialize};

    /// The area (`fleet.v1.admin.credentials.*`).
    pub const AREA: &str = "credentials";
    /// `set`: [`SetArgs`] → [`Listed`].
    pub const SET: &str = "set";
    /// `list`: [`ListArgs`] → [`Listed`].
    pub const LIST: &str = "list";
    /// `delete`: [`DeleteArgs`] → [`Deleted`].
    pub const DELETE: &str = "delete";
    /// `rewrap`: `{}` → [`Rewrapped`].
    pub const REWRAP: &str = "rewrap";

    /// Longest credential name (`[A-Za-z_][A-Za-z0-9_]*`; the spec asks for `UPPER_SNAKE_CASE`).
    pub const NAME_MAX_CHARS: usize = 128;
    /// Largest credential value, in bytes (UTF-8).
    pub const VALUE_MAX_BYTES: usize = 16 * 1024;
    /// Most names in one `set` or `delete`.
    pub const NAMES_PER_CALL_MAX: usize = 64;

    /// The scope of a credential: user-wide (every plugin of the user that declares the name) or one plugin's.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
    #[serde(rename_all = "snake_case")]
    pub enum Scope {
        /// Every plugin of the user.
        User,
        /// One plugin (`tool_id`): wins over a user-wide value of the same name.
        Tool,
    }

    /// `credentials.set`: stores `values` for `user`, for one plugin when `tool_id` is given, else user-wide.
    /// `Debug` never prints the values.
    #[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
    pub struct SetArgs {
        /// The user.
        pub user: String,
        /// The plugin (absent: user-wide).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub tool_id: Option<String>,
        /// Name → value. Secrets.
        pub values: BTreeMap<String, String>,
    }

    impl fmt::Debug for SetArgs {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.debug_struct("SetArgs")
                .field("user", &self.user)
                .field("tool_id", &self.tool_id)
                .field("values", &self.values.keys().collect::<Vec<_>>())
                .finish()
        }
    }

    /// `credentials.list`: the user's credentials; with `tool_id`, those an invoke of that plugin could receive
    /// (its own and the user-wide ones).
    #[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
    pub struct ListArgs {
        /// The user.
        pub user: String,
        /// The plugin (absent: every scope).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub tool_id: Option<String>,
    }

    /// `credentials.delete`: removes `names` from one scope (the plugin's when `tool_id` is given, else the
    /// user-wide one). A name not stored is not an error: [`Deleted::deleted`] lists those that were.
    #[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
    pub struct DeleteArgs {
        /// The user.
        pub user: String,
        /// The plugin (absent: user-wide).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub tool_id: Option<String>,
        /// The names.
        pub names: Vec<String>,
    }

    /// One stored credential, as listed: never its value.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct Entry {
        /// The name.
        pub name: String,
        /// User-wide or one plugin's.
        pub scope: Scope,
        /// The plugin, for [`Scope::Tool`].
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub tool_id: Option<String>,
        /// Last set, Unix ms.
        pub updated_at_ms: u64,
    }

    /// What `set` and `list` answer.
    #[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
    pub struct Listed {
        /// The user.
        pub user: String,
        /// The credentials, by scope (user-wide first), tool id and name.
        pub credentials: Vec<Entry>,
    }

    /// What `delete` answers.
    #[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
    pub struct Deleted {
        /// The user.
        pub user: String,
        /// The names that were stored in that scope and are gone.
        pub deleted: Vec<String>,
    }

    /// What `rewrap` answers.
    #[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
    pub struct Rewrapped {
        /// The key id every record is now wrapped with (the keyring's first key).
        pub key_id: String,
        /// Users' records seen.
        pub records: u64,
        /// Records whose data key was wrapped again (they were under an older key).
        pub rewrapped: u64,
    }
}

/// `fleet.v1.admin.creds.*`: app NATS credentials, issued and revoked while the fleet runs.
pub mod creds {
    use std::collections::BTreeMap;
    use std::fmt;

    use serde::{Deserialize, Serialize};

    /// The area (`fleet.v1.admin.creds.*`).
    pub const AREA: &str = "creds";
    /// `issue`: [`NameArgs`] → [`Issued`].
    pub const ISSUE: &str = "issue";
    /// `list`: `{}` → [`Listed`].
    pub const LIST: &str = "list";
    /// `revoke`: [`NameArgs`] → [`Revoked`].
    pub const REVOKE: &str = "revoke";

    /// `creds.issue` and `creds.revoke`.
    #[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
    pub struct NameArgs {
        /// The credential's name: 1–64 of `[A-Za-z0-9_-]` (the client's inbox prefix is `_INBOX.<name>`).
        pub name: String,
    }

    /// One issued app credential, as stored and listed (no secret).
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct CredRecord {
        /// The name (also the user's inbox prefix `_INBOX.<name>`).
        pub name: String,
        /// The current user key (`U…`).
        pub public_key: String,
        /// When it was issued (unix seconds).
        pub issued_at: u64,
        /// When it was revoked (unix seconds), if it was.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub revoked_at: Option<u64>,
        /// Earlier keys of this name and when each was revoked.
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        pub revoked_keys: BTreeMap<String, u64>,
    }

    /// What `creds.issue` answers. `creds` holds the user's seed: `Debug` redacts it.
    #[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct Issued {
        /// The record.
        pub credential: CredRecord,
        /// The inbox prefix the client must use (`_INBOX.<name>`).
        pub inbox_prefix: String,
        /// The `.creds` text (a user JWT and its nkey seed). A secret.
        pub creds: String,
    }

    impl fmt::Debug for Issued {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.debug_struct("Issued")
                .field("credential", &self.credential)
                .field("inbox_prefix", &self.inbox_prefix)
                .field("creds", &"<redacted>")
                .finish()
        }
    }

    /// What `creds.list` answers.
    #[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
    pub struct Listed {
        /// Every credential issued, revoked ones included.
        pub credentials: Vec<CredRecord>,
    }

    /// What `creds.revoke` answers.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct Revoked {
        /// The record, with `revoked_at` set.
        pub credential: CredRecord,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn subjects_and_queue_groups() {
        assert_eq!(subject(grants::AREA, grants::SET), "fleet.v1.admin.grants.set");
        assert_eq!(
            plugins::subject(plugins::INSTALL),
            "fleet.v1.admin.plugins.install"
        );
        assert_eq!(subject(creds::AREA, creds::REVOKE), "fleet.v1.admin.creds.revoke");
        assert_eq!(
            ADMIN_QUEUE_GROUP,
            format!("{}-admin", crate::api::subjects::API_QUEUE_GROUP)
        );
    }

    #[test]
    fn arguments_parse_as_the_areas_always_did() {
        let empty: serde_json::Value = parse_args(b"  \n").expect("blank is {}");
        assert_eq!(empty, json!({}));
        let bad = parse_args::<grants::GetArgs>(b"{").expect_err("not JSON");
        assert_eq!(bad.code, ApiErrorCode::InvalidArg);
        // Plugins' arguments refuse unknown fields; grants' and creds' ignore them.
        assert!(parse_args::<plugins::RemoveArgs>(br#"{"tool_id":"t","versoin":"1"}"#).is_err());
        let set: grants::SetArgs = parse_args(br#"{"user":"u","tool_id":"t","extra":1}"#).expect("set");
        assert!(set.allow.is_empty() && set.revoke.is_empty());
        let name: creds::NameArgs = parse_args(br#"{"name":"billing","x":true}"#).expect("name");
        assert_eq!(name.name, "billing");
    }

    #[test]
    fn credentials_set_debug_redacts_the_values() {
        let set = credentials::SetArgs {
            user: "u".into(),
            tool_id: None,
            values: [("API_KEY".to_owned(), "sk-SECRET".to_owned())].into(),
        };
        let shown = format!("{set:?}");
        assert!(
            shown.contains("API_KEY") && !shown.contains("sk-SECRET"),
            "{shown}"
        );
        assert_eq!(
            subject(credentials::AREA, credentials::REWRAP),
            "fleet.v1.admin.credentials.rewrap"
        );
    }

    #[test]
    fn issued_debug_redacts_the_creds() {
        let issued = creds::Issued {
            credential: creds::CredRecord {
                name: "n".into(),
                public_key: "UABC".into(),
                issued_at: 1,
                revoked_at: None,
                revoked_keys: Default::default(),
            },
            inbox_prefix: "_INBOX.n".into(),
            creds: "-----BEGIN USER NKEY SEED-----\nSUSECRET".into(),
        };
        assert!(!format!("{issued:?}").contains("SUSECRET"));
    }
}
