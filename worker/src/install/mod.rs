//! Plugin installs from archives (spec §14.2–§14.4): the filesystem half of plugin distribution.
//!
//! The pipeline of [`install`] (the spec's nine steps; the download itself is the caller's, which hands over a
//! local file — the fleet downloads with `reqwest` or reads the JetStream object store):
//!
//! 1. the asset is resolved by the caller ([`resolve_asset`] implements the `binary_urls` order);
//! 2. the file is a local temporary file (`/tmp/executa-{tool_id}-{rand}` when downloaded);
//! 3. its `size` and `sha256` are verified when declared ([`verify_file`]); a mismatch aborts before anything is
//!    extracted;
//! 4. it is extracted into `<home>/tools/.staging-{rand}/` refusing `..`, absolute paths, symbolic links that
//!    escape the root, hard links to anything but a file already extracted, device files, FIFOs, writes through
//!    links, more than [`MAX_EXTRACT_BYTES`] or [`MAX_ARCHIVE_ENTRIES`];
//! 5. the entrypoint is resolved (binary installs): asset `entrypoint` → in-archive `manifest.json`
//!    `runtime.binary.entrypoint` (string, or map: full platform key → OS segment → `default`) → `bin/{name}`,
//!    `bin/{name}.exe`, `{name}`, `{name}.exe` → the only executable under `bin/` or at the root → with several,
//!    the first in byte order, with a warning (spec §16 A-42: the five-level superset);
//! 6. permissions: the entry and `runtime.binary.executables` get 0755, `runtime.binary.permissions` is applied;
//!    every file is readable by others (plugins run under per-user uids), directories are 0755;
//! 7. `executa.json` and `INSTALL.json` are written into the staging directory, which is then renamed to
//!    `<home>/tools/{tool_id}/v{version}/` (an existing directory of the same version with other content is moved
//!    aside first; with the same `sha256` it is reused);
//! 8. the `current` symbolic link is swapped atomically (a new link renamed over it) and the `<home>/bin/{tool_id}`
//!    shim points at `../tools/{tool_id}/current/<entry>`;
//! 9. versions other than `current` beyond [`InstallOptions::keep_versions`] (default [`DEFAULT_KEEP_VERSIONS`])
//!    are removed, newest kept, except [`InstallOptions::protected`] ones (still in use).
//!
//! Installs of one tool id are serialised by a file lock (`tools/{tool_id}/.lock`), so several workers sharing a
//! home (as `fleet up`'s do) never interleave commits. A launched plugin runs from its canonical version directory,
//! never through `current`, so an upgrade never changes the files under a running session.
#![forbid(unsafe_code)]

mod entry;
mod extract;
mod layout;

use std::fmt;
use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

pub use layout::{activate, current_version, installed_versions, remove, version_record};

/// Old versions kept besides `current` (spec §14.3 step 9, `EXECUTA_KEEP_VERSIONS`; the default is 1).
pub const DEFAULT_KEEP_VERSIONS: usize = 1;

/// Largest total of extracted file bytes (spec §14.3 "5GB extract limit").
pub const MAX_EXTRACT_BYTES: u64 = 5 * 1024 * 1024 * 1024;

/// Most members an archive may have (ours: bounds the work an archive can ask for).
pub const MAX_ARCHIVE_ENTRIES: usize = 100_000;

/// Longest sanitised tool id or version, in characters.
pub const MAX_NAME_CHARS: usize = 128;

/// The install metadata file of a version directory (spec §14.3 step 9).
pub const INSTALL_JSON: &str = crate::catalogue::PACKAGE_RECORD_FILE;

/// The in-archive manifest (spec §14.4).
pub const ARCHIVE_MANIFEST: &str = "manifest.json";

/// The `current` pointer of a tool directory (spec §14.3 step 8).
pub const CURRENT: &str = "current";

/// The version used when none is declared (spec §14.3: "empty version → `unknown`").
pub const UNKNOWN_VERSION: &str = "unknown";

/// The wildcard keys of `binary_urls` (spec §14.2 HR-DI-01 step 3, plus `default`).
pub const WILDCARD_KEYS: [&str; 4] = ["*", "any", "universal", "default"];

/// Why an install failed. Nothing is committed when any of these is returned.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InstallError {
    /// A file operation failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The package's size is not the declared one.
    #[error("size mismatch: expected {expected} bytes, got {actual}")]
    SizeMismatch {
        /// Declared.
        expected: u64,
        /// Found.
        actual: u64,
    },
    /// The package's SHA-256 is not the declared one.
    #[error("sha256 mismatch: expected {expected}, got {actual}")]
    Sha256Mismatch {
        /// Declared (lower hex).
        expected: String,
        /// Found (lower hex).
        actual: String,
    },
    /// A declared SHA-256 is not 64 hex digits.
    #[error("invalid sha256 {0:?}: expected 64 hex digits")]
    InvalidSha256(String),
    /// `binary_urls` has nothing for this platform (the spec's message).
    #[error("No binary available for platform '{key}'. Available: {}", available.join(", "))]
    NoPlatformAsset {
        /// The platform key.
        key: String,
        /// The keys that exist.
        available: Vec<String>,
    },
    /// A `binary_urls` entry is malformed.
    #[error("binary_urls[{key:?}]: {reason}")]
    InvalidAsset {
        /// Its key.
        key: String,
        /// Why.
        reason: String,
    },
    /// `format` is not `tar.gz`, `tgz`, `zip` or `raw`.
    #[error("unknown format {0:?} (expected tar.gz, tgz, zip or raw)")]
    UnknownFormat(String),
    /// The archive cannot be read (corrupt, truncated, encrypted…).
    #[error("unreadable {format} archive: {reason}")]
    Archive {
        /// The format tried.
        format: Format,
        /// Why.
        reason: String,
    },
    /// A member would land outside the install or is not a plain file, directory or safe link (zip-slip).
    #[error("unsafe archive member {member:?}: {reason}")]
    UnsafeMember {
        /// The member's name as stored.
        member: String,
        /// Why it is refused.
        reason: UnsafeReason,
    },
    /// The archive expands beyond [`MAX_EXTRACT_BYTES`] or has more than [`MAX_ARCHIVE_ENTRIES`] members.
    #[error("archive too large: more than {limit} {what}")]
    TooLarge {
        /// `bytes` or `members`.
        what: &'static str,
        /// The limit.
        limit: u64,
    },
    /// No entrypoint could be resolved.
    #[error("no entrypoint: {0}")]
    NoEntrypoint(String),
    /// A declared entrypoint is unusable.
    #[error("entrypoint {path:?} (from {from}): {reason}")]
    BadEntrypoint {
        /// The path as declared.
        path: String,
        /// `binary_urls entrypoint`, `manifest.json`…
        from: &'static str,
        /// Why.
        reason: String,
    },
    /// An in-archive `manifest.json` / `executa.json` is unusable.
    #[error("{file}: {reason}")]
    BadManifest {
        /// The file.
        file: &'static str,
        /// Why.
        reason: String,
    },
    /// A tool id (or version) is unusable even after sanitising.
    #[error("invalid {what} {value:?}: {reason}")]
    InvalidName {
        /// `tool_id` or `version`.
        what: &'static str,
        /// The value given.
        value: String,
        /// Why.
        reason: String,
    },
    /// No tool id was given and the package names none.
    #[error(
        "no tool_id: pass one, or name it in the package's manifest.json (`name`) or executa.json (`tool_id`)"
    )]
    MissingToolId,
    /// Nothing installed under that tool id (or version).
    #[error("{tool_id}{}: not installed", version.as_deref().map(|v| format!(" v{v}")).unwrap_or_default())]
    NotInstalled {
        /// The tool id.
        tool_id: String,
        /// The version, if one was asked.
        version: Option<String>,
    },
    /// The version asked to be removed is the current one while others remain.
    #[error("{tool_id} v{version} is the current version: remove the tool, or install another version first")]
    RemoveCurrent {
        /// The tool id.
        tool_id: String,
        /// The version.
        version: String,
    },
}

impl InstallError {
    pub(crate) fn io(path: &Path) -> impl FnOnce(io::Error) -> InstallError + '_ {
        move |source| InstallError::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    fn name(what: &'static str, value: &str, reason: impl Into<String>) -> InstallError {
        InstallError::InvalidName {
            what,
            value: value.to_string(),
            reason: reason.into(),
        }
    }
}

/// Why an archive member is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum UnsafeReason {
    /// A `..` component.
    ParentDir,
    /// An absolute path.
    Absolute,
    /// A symbolic link whose target resolves outside the install.
    LinkEscapes(String),
    /// A hard link to something that is not a file already extracted in the install.
    HardLinkEscapes(String),
    /// A character or block device, a FIFO or a socket.
    DeviceFile,
    /// The member would be written through a symbolic link.
    ThroughLink,
    /// A member type the installer does not extract (sparse files, …).
    Unsupported(String),
}

impl fmt::Display for UnsafeReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UnsafeReason::ParentDir => f.write_str("`..` path component"),
            UnsafeReason::Absolute => f.write_str("absolute path"),
            UnsafeReason::LinkEscapes(t) => write!(f, "symbolic link to {t:?} escapes the install root"),
            UnsafeReason::HardLinkEscapes(t) => {
                write!(f, "hard link to {t:?}, which is not a file inside the install")
            }
            UnsafeReason::DeviceFile => f.write_str("device file, FIFO or socket"),
            UnsafeReason::ThroughLink => f.write_str("would be written through a symbolic link"),
            UnsafeReason::Unsupported(kind) => write!(f, "unsupported member type {kind}"),
        }
    }
}

/// A package's container format (spec §14.2 `format`): a wire type of the operator API, in
/// `fleet_proto::admin::plugins`.
pub use fleet_proto::admin::plugins::Format;

impl From<fleet_proto::admin::plugins::UnknownFormat> for InstallError {
    fn from(e: fleet_proto::admin::plugins::UnknownFormat) -> InstallError {
        InstallError::UnknownFormat(e.0)
    }
}

/// A tool id made a flat `[A-Za-z0-9._-]+` file name segment (spec §14.3 `sanitize_tool_id`): every other
/// character becomes `_` (`@scope/pkg` → `_scope_pkg`).
///
/// # Errors
/// Empty, longer than [`MAX_NAME_CHARS`], `.`/`..`-only, or starting with `.` or `-` once sanitised.
pub fn sanitize_tool_id(raw: &str) -> Result<String, InstallError> {
    let s = slug(raw);
    if s.is_empty() {
        return Err(InstallError::name("tool_id", raw, "must not be empty"));
    }
    if s.chars().count() > MAX_NAME_CHARS {
        return Err(InstallError::name(
            "tool_id",
            raw,
            format!("longer than {MAX_NAME_CHARS} characters"),
        ));
    }
    if s.starts_with(['.', '-']) {
        return Err(InstallError::name(
            "tool_id",
            raw,
            "must not start with `.` or `-` (it names a directory and a command argument)",
        ));
    }
    Ok(s)
}

/// A version made a flat `[A-Za-z0-9._-]+` segment (spec §14.3 `sanitize_version`); empty → `unknown`, a leading
/// `v` is dropped (the directory is `v{version}`).
///
/// # Errors
/// Longer than [`MAX_NAME_CHARS`], or only dots.
pub fn sanitize_version(raw: &str) -> Result<String, InstallError> {
    let trimmed = raw.trim();
    let trimmed = trimmed
        .strip_prefix('v')
        .filter(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))
        .unwrap_or(trimmed);
    let s = slug(trimmed);
    if s.is_empty() {
        return Ok(UNKNOWN_VERSION.to_string());
    }
    if s.chars().count() > MAX_NAME_CHARS {
        return Err(InstallError::name(
            "version",
            raw,
            format!("longer than {MAX_NAME_CHARS} characters"),
        ));
    }
    if s.chars().all(|c| c == '.') {
        return Err(InstallError::name("version", raw, "must not be only dots"));
    }
    Ok(s)
}

fn slug(raw: &str) -> String {
    raw.trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The canonical platform key of this host, `{system}-{machine}` (spec §14.2): `linux-x86_64`, `darwin-arm64`…
pub fn platform_key() -> String {
    let os = match std::env::consts::OS {
        "macos" => "darwin",
        other => other,
    };
    let arch = match (os, std::env::consts::ARCH) {
        ("darwin", "aarch64") | ("windows", "aarch64") => "arm64",
        (_, "arm") => "armv7l",
        (_, other) => other,
    };
    normalize_platform_key(&format!("{os}-{arch}"))
}

/// Lowercase, with `amd64`/`x64` → `x86_64` (spec §14.2).
pub fn normalize_platform_key(key: &str) -> String {
    let key = key.trim().to_ascii_lowercase();
    match key.split_once('-') {
        Some((os, "amd64" | "x64")) => format!("{os}-x86_64"),
        _ => key,
    }
}

/// One resolved `binary_urls` entry (spec §14.2).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Asset {
    /// The `binary_urls` key it came from.
    pub key: String,
    /// Where to fetch it.
    pub url: String,
    /// Declared lower-hex SHA-256.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// Declared size in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    /// Entrypoint override (path inside the archive).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entrypoint: Option<String>,
    /// The container format (declared, else inferred from the URL).
    pub format: Format,
}

/// Picks the `binary_urls` entry for `platform` (spec §14.2 HR-DI-01): exact key → the OS segment alone
/// (`linux`) → a wildcard key ([`WILDCARD_KEYS`]) → the only entry. Keys are compared normalised.
///
/// # Errors
/// [`InstallError::NoPlatformAsset`] (the spec's message) or [`InstallError::InvalidAsset`].
pub fn resolve_asset(binary_urls: &Map<String, Value>, platform: &str) -> Result<Asset, InstallError> {
    let platform = normalize_platform_key(platform);
    let os = platform.split('-').next().unwrap_or_default().to_string();
    let entries: Vec<(String, &String, &Value)> = binary_urls
        .iter()
        .map(|(k, v)| (normalize_platform_key(k), k, v))
        .collect();
    let pick = entries
        .iter()
        .find(|(k, _, _)| *k == platform)
        .or_else(|| entries.iter().find(|(k, _, _)| *k == os))
        .or_else(|| {
            entries
                .iter()
                .find(|(k, _, _)| WILDCARD_KEYS.contains(&k.as_str()))
        })
        .or_else(|| (entries.len() == 1).then(|| &entries[0]));
    let Some((_, key, value)) = pick else {
        let mut available: Vec<String> = binary_urls.keys().cloned().collect();
        available.sort();
        return Err(InstallError::NoPlatformAsset {
            key: platform,
            available,
        });
    };
    parse_asset(key, value)
}

/// One `binary_urls` value: a URL string or `{url, sha256?, size?, entrypoint?, format?}`.
pub fn parse_asset(key: &str, value: &Value) -> Result<Asset, InstallError> {
    let bad = |reason: &str| InstallError::InvalidAsset {
        key: key.to_string(),
        reason: reason.to_string(),
    };
    let (url, obj) = match value {
        Value::String(u) => (u.clone(), None),
        Value::Object(o) => match o.get("url") {
            Some(Value::String(u)) => (u.clone(), Some(o)),
            _ => return Err(bad("`url` must be a string")),
        },
        _ => return Err(bad("expected a URL string or an object with `url`")),
    };
    if url.trim().is_empty() {
        return Err(bad("`url` must not be empty"));
    }
    let field = |name: &str| obj.and_then(|o| o.get(name)).filter(|v| !v.is_null());
    let sha256 = match field("sha256") {
        None => None,
        Some(Value::String(s)) => Some(normalize_sha256(s)?),
        Some(_) => return Err(bad("`sha256` must be a string")),
    };
    let size = match field("size") {
        None => None,
        Some(v) => Some(
            v.as_u64()
                .ok_or_else(|| bad("`size` must be a non-negative integer"))?,
        ),
    };
    let entrypoint = match field("entrypoint") {
        None => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(bad("`entrypoint` must be a string")),
    };
    let format = match field("format") {
        None => Format::infer(&url),
        Some(Value::String(s)) => Format::parse(s)?,
        Some(_) => return Err(bad("`format` must be a string")),
    };
    Ok(Asset {
        key: key.to_string(),
        url,
        sha256,
        size,
        entrypoint,
        format,
    })
}

/// A declared SHA-256 in lower hex.
///
/// # Errors
/// [`InstallError::InvalidSha256`] unless 64 hex digits.
pub fn normalize_sha256(s: &str) -> Result<String, InstallError> {
    let s = s.trim();
    let s = s.strip_prefix("sha256:").unwrap_or(s);
    if s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(s.to_ascii_lowercase())
    } else {
        Err(InstallError::InvalidSha256(s.to_string()))
    }
}

/// Size and lower-hex SHA-256 of a file, checked against the declared values (spec §14.2 HR-DI-02).
///
/// # Errors
/// [`InstallError::SizeMismatch`], [`InstallError::Sha256Mismatch`], or I/O.
pub fn verify_file(
    path: &Path,
    size: Option<u64>,
    sha256: Option<&str>,
) -> Result<(u64, String), InstallError> {
    let expected_sha = sha256.map(normalize_sha256).transpose()?;
    let mut file = fs::File::open(path).map_err(InstallError::io(path))?;
    let meta = file.metadata().map_err(InstallError::io(path))?;
    if let Some(expected) = size
        && expected != meta.len()
    {
        return Err(InstallError::SizeMismatch {
            expected,
            actual: meta.len(),
        });
    }
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 256 * 1024];
    let mut total = 0u64;
    loop {
        let n = file.read(&mut buf).map_err(InstallError::io(path))?;
        if n == 0 {
            break;
        }
        total += n as u64;
        hasher.update(&buf[..n]);
    }
    if let Some(expected) = size
        && expected != total
    {
        return Err(InstallError::SizeMismatch {
            expected,
            actual: total,
        });
    }
    let actual = hex::encode(hasher.finalize());
    if let Some(expected) = expected_sha
        && expected != actual
    {
        return Err(InstallError::Sha256Mismatch { expected, actual });
    }
    Ok((total, actual))
}

/// Where and how installs land.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstallOptions {
    /// The executa home (`ANNA_EXECUTA_HOME`): holds `tools/` and `bin/`.
    pub home: PathBuf,
    /// Old versions kept besides `current`.
    pub keep_versions: usize,
    /// The platform key entrypoint maps are resolved for.
    pub platform_key: String,
    /// Versions the garbage collection must keep whatever their age (e.g. still run by draining sessions).
    pub protected: Vec<String>,
}

impl InstallOptions {
    /// Options for `home` with the defaults: keep [`DEFAULT_KEEP_VERSIONS`], this host's [`platform_key`].
    pub fn new(home: impl Into<PathBuf>) -> InstallOptions {
        InstallOptions {
            home: home.into(),
            keep_versions: DEFAULT_KEEP_VERSIONS,
            platform_key: platform_key(),
            protected: Vec::new(),
        }
    }

    /// `<home>/tools`.
    pub fn tools_dir(&self) -> PathBuf {
        self.home.join("tools")
    }

    /// `<home>/tools/{tool_id}`.
    pub fn tool_dir(&self, tool_id: &str) -> PathBuf {
        self.tools_dir().join(tool_id)
    }

    /// `<home>/tools/{tool_id}/v{version}`.
    pub fn version_dir(&self, tool_id: &str, version: &str) -> PathBuf {
        self.tool_dir(tool_id).join(format!("v{version}"))
    }
}

/// What to install.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct InstallRequest {
    /// The local package file (already downloaded).
    pub package: PathBuf,
    /// Its format.
    pub format: Option<Format>,
    /// The tool id (sanitised); `None`: the package's `manifest.json` `name` or `executa.json` `tool_id`.
    pub tool_id: Option<String>,
    /// The version (sanitised); `None`: the package's `manifest.json` / `executa.json` `version`, else `unknown`.
    pub version: Option<String>,
    /// Declared size, verified.
    pub expected_size: Option<u64>,
    /// Declared SHA-256, verified.
    pub expected_sha256: Option<String>,
    /// Entrypoint override (the asset's `entrypoint`).
    pub entrypoint: Option<String>,
    /// Recorded verbatim in `INSTALL.json` `source` (`url`, `binary_urls`, `object`…).
    pub source: Value,
}

/// `INSTALL.json`: what was installed, from where (spec §14.3 step 9).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstallRecord {
    /// The (sanitised) tool id.
    pub tool_id: String,
    /// The (sanitised) version.
    pub version: String,
    /// The launcher type (`binary`, `python`, `node`, `go`).
    #[serde(rename = "type")]
    pub kind: String,
    /// The package format.
    pub format: Format,
    /// The package's SHA-256 (lower hex).
    pub sha256: String,
    /// The package's size in bytes.
    pub size: u64,
    /// The entrypoint, relative to the version directory (binary installs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entrypoint: Option<String>,
    /// When it was committed (ms since the epoch).
    pub installed_at_ms: u64,
    /// The platform key it was resolved for.
    pub platform_key: String,
    /// Where it came from (`url`, `binary_urls`, `object`…).
    #[serde(default)]
    pub source: Value,
    /// Things an operator should know (e.g. the entrypoint was picked among several executables).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

/// A committed install.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Installed {
    /// `INSTALL.json`.
    pub record: InstallRecord,
    /// The version directory (canonical).
    pub dir: PathBuf,
    /// The in-archive `manifest.json`, if any.
    pub manifest: Option<Value>,
    /// `true` when the same version with the same bytes was already there and was kept.
    pub reused: bool,
    /// Version directories removed by the garbage collection.
    pub collected: Vec<String>,
}

/// Runs the pipeline (see the module docs). Blocking: call it from `spawn_blocking`.
///
/// # Errors
/// Any [`InstallError`]; nothing is committed then, and the staging directory is removed.
pub fn install(opts: &InstallOptions, req: &InstallRequest) -> Result<Installed, InstallError> {
    // 3. Verify before anything is written.
    let (size, sha256) = verify_file(&req.package, req.expected_size, req.expected_sha256.as_deref())?;
    let format = req
        .format
        .unwrap_or_else(|| Format::infer(&req.package.file_name().unwrap_or_default().to_string_lossy()));
    let tools = opts.tools_dir();
    layout::mkdir_0755(&opts.home)?;
    layout::mkdir_0755(&tools)?;
    let staging = layout::Staging::create(&tools)?;

    // 4. Extract.
    let given_id = req.tool_id.as_deref().map(sanitize_tool_id).transpose()?;
    extract::extract(&req.package, format, staging.path(), given_id.as_deref())?;

    // Identity and version.
    let manifest = read_json_object(staging.path(), ARCHIVE_MANIFEST)?;
    let executa = read_json_object(staging.path(), crate::catalogue::MANIFEST_FILE)?;
    let tool_id = match given_id {
        Some(id) => id,
        None => {
            let named =
                str_field(manifest.as_ref(), "name").or_else(|| str_field(executa.as_ref(), "tool_id"));
            sanitize_tool_id(named.ok_or(InstallError::MissingToolId)?)?
        }
    };
    let version = match &req.version {
        Some(v) => sanitize_version(v)?,
        None => sanitize_version(
            str_field(manifest.as_ref(), "version")
                .or_else(|| str_field(executa.as_ref(), "version"))
                .unwrap_or_default(),
        )?,
    };

    // The launcher type: executa.json `type` → manifest.json `runtime.type` (a hint) → binary.
    let kind = match executa.as_ref().and_then(|e| e.get("type")) {
        None | Some(Value::Null) => manifest
            .as_ref()
            .and_then(|m| m.get("runtime"))
            .and_then(|r| r.get("type"))
            .and_then(Value::as_str)
            .and_then(crate::catalogue::InstallType::parse)
            .unwrap_or(crate::catalogue::InstallType::Binary),
        Some(Value::String(s)) => {
            crate::catalogue::InstallType::parse(s).ok_or_else(|| InstallError::BadManifest {
                file: "executa.json",
                reason: format!("unknown type {s:?} (expected python, node, go or binary)"),
            })?
        }
        Some(_) => {
            return Err(InstallError::BadManifest {
                file: "executa.json",
                reason: "`type` must be a string".into(),
            });
        }
    };
    let has_command = executa
        .as_ref()
        .and_then(|e| e.get("command"))
        .is_some_and(|c| !c.is_null());

    // 5–6. Entrypoint and permissions.
    let mut warnings = Vec::new();
    let entrypoint = if kind == crate::catalogue::InstallType::Binary && !has_command {
        let name = str_field(manifest.as_ref(), "name").map(slug);
        let (entry, warning) = entry::resolve(
            staging.path(),
            req.entrypoint.as_deref(),
            manifest.as_ref(),
            &[Some(tool_id.clone()), name]
                .into_iter()
                .flatten()
                .collect::<Vec<_>>(),
            &opts.platform_key,
        )?;
        warnings.extend(warning);
        Some(entry)
    } else {
        None
    };
    entry::apply_permissions(staging.path(), entrypoint.as_deref(), manifest.as_ref())?;

    // 7. executa.json and INSTALL.json, then the commit. The package's own executa.json may not pass worker
    // environment variables (only operator configuration can) nor raise limits (they are capped at spawn).
    let mut executa = executa.unwrap_or_default();
    if let Some(env) = executa.remove("env") {
        let n = env.as_array().map_or(1, Vec::len);
        warnings.push(format!(
            "dropped `env` ({n} variable name(s)): a package cannot pass worker environment variables through; \
             only the operator can (the worker's env allow-list)"
        ));
    }
    if executa
        .get("limits")
        .is_some_and(|l| l.as_object().is_some_and(|o| !o.is_empty()))
    {
        warnings.push(
            "`limits` of a package only lower the worker's limits: any value above them is capped when the plugin \
             starts"
                .to_owned(),
        );
    }
    executa.insert("tool_id".into(), Value::String(tool_id.clone()));
    executa.insert("type".into(), Value::String(kind.as_str().into()));
    executa.insert("version".into(), Value::String(version.clone()));
    if let Some(entry) = &entrypoint {
        executa.insert(
            "command".into(),
            Value::Array(vec![Value::String(format!("./{entry}"))]),
        );
    }
    layout::write_file(
        &staging.path().join(crate::catalogue::MANIFEST_FILE),
        &serde_json::to_vec_pretty(&Value::Object(executa)).unwrap_or_default(),
    )?;
    let record = InstallRecord {
        tool_id: tool_id.clone(),
        version: version.clone(),
        kind: kind.as_str().into(),
        format,
        sha256,
        size,
        entrypoint,
        installed_at_ms: now_ms(),
        platform_key: opts.platform_key.clone(),
        source: req.source.clone(),
        warnings,
    };
    layout::write_file(
        &staging.path().join(INSTALL_JSON),
        &serde_json::to_vec_pretty(&record).unwrap_or_default(),
    )?;
    let committed = layout::commit(opts, staging, &record)?;
    Ok(Installed {
        manifest: manifest.map(Value::Object),
        ..committed
    })
}

fn str_field<'a>(obj: Option<&'a Map<String, Value>>, field: &str) -> Option<&'a str> {
    obj.and_then(|o| o.get(field))
        .and_then(Value::as_str)
        .filter(|s| !s.trim().is_empty())
}

/// Reads `<dir>/<name>` as a JSON object when it is a regular file (≤ 1 MiB).
fn read_json_object(dir: &Path, name: &'static str) -> Result<Option<Map<String, Value>>, InstallError> {
    let path = dir.join(name);
    match fs::symlink_metadata(&path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(InstallError::io(&path)(e)),
        Ok(m) if !m.is_file() => {
            return Err(InstallError::BadManifest {
                file: name,
                reason: "not a regular file".into(),
            });
        }
        Ok(m) if m.len() > crate::catalogue::MAX_MANIFEST_BYTES => {
            return Err(InstallError::BadManifest {
                file: name,
                reason: format!("larger than {} bytes", crate::catalogue::MAX_MANIFEST_BYTES),
            });
        }
        Ok(_) => {}
    }
    let bytes = fs::read(&path).map_err(InstallError::io(&path))?;
    match serde_json::from_slice(&bytes) {
        Ok(Value::Object(o)) => Ok(Some(o)),
        Ok(_) => Err(InstallError::BadManifest {
            file: name,
            reason: "expected a JSON object".into(),
        }),
        Err(e) => Err(InstallError::BadManifest {
            file: name,
            reason: format!("invalid JSON: {e}"),
        }),
    }
}

pub(crate) use fleet_proto::util::now_ms;

/// A random 64-bit token for temporary names (std's per-process random hasher keys, plus a counter).
pub(crate) fn rand_token() -> String {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(N.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    h.write_u64(now_ms());
    format!("{:016x}", h.finish())
}

#[cfg(test)]
mod tests;
