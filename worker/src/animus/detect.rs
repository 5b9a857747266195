//! Dialect detection, once per install, and the quarantine of installs that changed under the worker
//! (`../shared/spec/animus.md` §3.2).
//!
//! 1. An explicit `protocol` in `executa.json` is the expected answer; it is verified, not trusted blindly.
//! 2. Probe A: `<argv> --manifest` in the sandbox (its own cgroup, the plugin's uid), stdin `/dev/null`, a 3 s
//!    timeout, 1 MiB of stdout kept. One JSON object that parses as a `PluginManifest` means Animus. Anything
//!    else (no output, a non-zero exit, non-JSON, a timeout) means "not Animus" — an Executa plugin ignores the
//!    flag, reads EOF and exits.
//! 3. Otherwise Executa: the Executa session's own handshake (`initialize` / `describe`) verifies it. An
//!    Animus `initialize` is never sent to a plugin detected as Executa, nor the reverse.
//!
//! The record holds the dialect, the probed manifest (kind, protocol version) and a **fingerprint** of the
//! launch: the SHA-256 of every file the argv names (`argv[0]` and any argument that is a file of the install)
//! and of the install's code the argv does not name (a `[project.scripts]` module). Every later spawn recomputes it (cached by path, size, mtime and inode, so an unchanged file is hashed once)
//! and a mismatch quarantines the install: it is refused until the worker reloads its catalogue. The Animus
//! handshake also cross-checks its `plugin_kind` and major version against the record.

use std::collections::HashMap;
use std::io::Read as _;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fleet_proto::animus::{MANIFEST_FLAG, PluginManifest};
use fleet_proto::limits;
use sha2::{Digest as _, Sha256};
use tokio::io::AsyncReadExt as _;
use tokio::sync::OnceCell;

use crate::catalogue::{Dialect, Install};
use crate::child::Sandboxed;
use crate::types::WorkerContext;

/// The user the detection probe runs as (its own uid and directories, like any user's).
pub const PROBE_USER: &str = "fleet:detect";

/// What detection learned about an install.
#[derive(Debug, Clone, PartialEq)]
pub struct Detected {
    /// The dialect.
    pub dialect: Dialect,
    /// How it was decided: `declared` (explicit `protocol`, probe consistent) or `probed`.
    pub how: &'static str,
    /// The `--manifest` answer, for Animus plugins that implement it.
    pub manifest: Option<PluginManifest>,
    /// SHA-256 (hex) of the launch's files at detection.
    pub fingerprint: String,
    /// How long the probe took.
    pub probe_time: Duration,
}

/// Why an install cannot be served.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DetectError {
    /// Declared one dialect, answered the other's probe.
    #[error("declared protocol `{declared}` but the plugin answered `--manifest` with an Animus manifest")]
    Mismatch {
        /// The declared dialect.
        declared: Dialect,
    },
    /// An Animus plugin of a kind the fleet does not host.
    #[error(
        "Animus plugin kind `{kind}` is not hosted: only `provider` (as agent.run / agent.resume) and `custom` \
         (allow-listed methods) become tools"
    )]
    KindNotHosted {
        /// The kind.
        kind: String,
    },
    /// An Animus plugin on another major version.
    #[error("Animus plugin refused: {0}")]
    Version(String),
    /// The launch's files could not be read.
    #[error("cannot fingerprint the plugin's files: {0}")]
    Fingerprint(String),
    /// The probe could not run at all (sandbox).
    #[error("cannot run the detection probe: {0}")]
    Probe(String),
    /// The install could not be prepared for its first spawn ([`crate::prepare`]: `uv sync`…); the next use
    /// tries again.
    #[error("cannot prepare the install: {0}")]
    Prepare(String),
    /// The plugin's program could not be started (a launch failure, whatever the dialect: `argv[0]` missing or
    /// not executable by the plugin's uid).
    #[error("cannot start {program:?}: {reason}")]
    Launch {
        /// `argv[0]`.
        program: String,
        /// The OS's answer.
        reason: String,
    },
    /// The install changed since detection (binary, kind or major version): refused until the catalogue is
    /// reloaded.
    #[error("plugin quarantined: {0}")]
    Quarantined(String),
}

/// Which step refused an install ([`DetectError::stage`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RefusalStage {
    /// The one-time preparation (`uv sync`) failed.
    Prepare,
    /// The program did not start.
    Launch,
    /// The probe's sandbox could not be prepared.
    Sandbox,
    /// The launch's files could not be read.
    Files,
    /// The plugin's answer: a mismatch with the declared protocol, an Animus kind or version not hosted.
    Dialect,
    /// The install changed since detection.
    Quarantine,
}

impl RefusalStage {
    /// The stage's name (`launch`, `sandbox`, `files`, `dialect`, `quarantine`), as error details carry it.
    pub fn as_str(self) -> &'static str {
        match self {
            RefusalStage::Prepare => "prepare",
            RefusalStage::Launch => "launch",
            RefusalStage::Sandbox => "sandbox",
            RefusalStage::Files => "files",
            RefusalStage::Dialect => "dialect",
            RefusalStage::Quarantine => "quarantine",
        }
    }
}

impl DetectError {
    /// Which step refused the install: only [`RefusalStage::Dialect`] is about what the plugin speaks.
    /// (`launch`/`prepare`/`sandbox`/`files`/`dialect`/`quarantine`.)
    pub fn stage(&self) -> RefusalStage {
        match self {
            DetectError::Prepare(_) => RefusalStage::Prepare,
            DetectError::Launch { .. } => RefusalStage::Launch,
            DetectError::Probe(_) => RefusalStage::Sandbox,
            DetectError::Fingerprint(_) => RefusalStage::Files,
            DetectError::Mismatch { .. } | DetectError::KindNotHosted { .. } | DetectError::Version(_) => {
                RefusalStage::Dialect
            }
            DetectError::Quarantined(_) => RefusalStage::Quarantine,
        }
    }
}

type DetectCell = OnceCell<Result<Detected, DetectError>>;

/// The per-worker record of detections and quarantines. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct Registry {
    inner: Arc<RegistryInner>,
}

#[derive(Debug, Default)]
struct RegistryInner {
    cells: Mutex<HashMap<String, Arc<DetectCell>>>,
    quarantined: Mutex<HashMap<String, String>>,
    hashes: Mutex<HashMap<PathBuf, (FileStamp, String)>>,
    preparations: Arc<crate::prepare::Preparations>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    size: u64,
    mtime_ns: i128,
    ino: u64,
    dev: u64,
}

use fleet_proto::util::lock;

impl Registry {
    /// The detection of `install`, running it once (concurrent callers wait for the same probe). A program that
    /// did not start ([`DetectError::Launch`]) is not remembered: the next call probes again.
    pub async fn detect(&self, ctx: &WorkerContext, install: &Install) -> Result<Detected, DetectError> {
        if let Some(reason) = self.quarantine_reason(install) {
            return Err(DetectError::Quarantined(reason));
        }
        // Prepared first (once; a failure is not cached, unlike the detection below): neither the probe nor the
        // first `initialize` waits on a dependency download.
        self.inner
            .preparations
            .ensure(ctx, install)
            .await
            .map_err(|e| DetectError::Prepare(e.to_string()))?;
        let cell = lock(&self.inner.cells).entry(key(install)).or_default().clone();
        let detected = cell
            .get_or_init(|| async {
                let d = detect(ctx, install, self).await;
                match &d {
                    Ok(d) => tracing::info!(tool_id = %install.tool_id, dialect = %d.dialect, how = d.how,
                        probe_ms = u64::try_from(d.probe_time.as_millis()).unwrap_or(u64::MAX), "plugin dialect detected"),
                    Err(e) => tracing::warn!(tool_id = %install.tool_id, error = %e, "plugin refused at detection"),
                }
                d
            })
            .await
            .clone();
        if let Err(DetectError::Launch { .. }) = &detected {
            // Not remembered: the operator may fix what stopped the program (a permission, a missing file), and
            // the next use probes again.
            let mut cells = lock(&self.inner.cells);
            if cells.get(&key(install)).is_some_and(|c| Arc::ptr_eq(c, &cell)) {
                cells.remove(&key(install));
            }
        }
        detected
    }

    /// The recorded detection of `install`, if it already ran.
    pub fn known(&self, install: &Install) -> Option<Result<Detected, DetectError>> {
        let cell = lock(&self.inner.cells).get(&key(install)).cloned()?;
        cell.get().cloned()
    }

    /// Quarantines `install` with `reason` (kept until the worker restarts or installs another version).
    pub fn quarantine(&self, install: &Install, reason: String) {
        tracing::warn!(tool_id = %install.tool_id, %reason, "plugin quarantined");
        lock(&self.inner.quarantined)
            .entry(key(install))
            .or_insert(reason);
    }

    /// Why `install` is quarantined, if it is.
    pub fn quarantine_reason(&self, install: &Install) -> Option<String> {
        lock(&self.inner.quarantined).get(&key(install)).cloned()
    }

    /// The launch fingerprint of `install` now (files re-hashed only when their size, mtime or inode changed).
    pub fn fingerprint(&self, install: &Install) -> Result<String, DetectError> {
        let mut all = Sha256::new();
        for path in launch_files(install) {
            let meta = std::fs::metadata(&path)
                .map_err(|e| DetectError::Fingerprint(format!("{}: {e}", path.display())))?;
            let stamp = FileStamp {
                size: meta.len(),
                mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
                ino: meta.ino(),
                dev: meta.dev(),
            };
            let cached = lock(&self.inner.hashes)
                .get(&path)
                .filter(|(s, _)| *s == stamp)
                .map(|(_, h)| h.clone());
            let hash = match cached {
                Some(h) => h,
                None => {
                    let h = hash_file(&path)
                        .map_err(|e| DetectError::Fingerprint(format!("{}: {e}", path.display())))?;
                    lock(&self.inner.hashes).insert(path.clone(), (stamp, h.clone()));
                    h
                }
            };
            all.update(path.as_os_str().as_encoded_bytes());
            all.update([0]);
            all.update(hash.as_bytes());
        }
        Ok(hex(&all.finalize()))
    }

    /// Cross-checks the launch's files against the detection record; quarantines on a change.
    pub fn check_unchanged(&self, install: &Install, detected: &Detected) -> Result<(), DetectError> {
        let now = self.fingerprint(install)?;
        if now == detected.fingerprint {
            return Ok(());
        }
        let reason = format!(
            "the plugin's files changed since detection (fingerprint {} → {}); reload the catalogue to accept it",
            &detected.fingerprint[..12],
            &now[..12]
        );
        self.quarantine(install, reason.clone());
        Err(DetectError::Quarantined(reason))
    }
}

/// Detections are per install version: a tool id in its directory.
fn key(install: &Install) -> String {
    format!("{}\0{}", install.tool_id, install.dir.display())
}

/// The files a launch runs: `argv[0]`, every argument naming a regular file (relative to the install dir), and
/// the install's [`code`](Install::code) its argv does not name.
fn launch_files(install: &Install) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for (i, arg) in install.argv.iter().enumerate() {
        let p = Path::new(arg);
        let p = if p.is_absolute() {
            p.to_path_buf()
        } else {
            install.dir.join(p)
        };
        if i == 0 || p.is_file() {
            files.push(p);
        }
    }
    files.extend(install.code.iter().cloned());
    files
}

fn hash_file(path: &Path) -> std::io::Result<String> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

async fn detect(
    ctx: &WorkerContext,
    install: &Install,
    registry: &Registry,
) -> Result<Detected, DetectError> {
    let fingerprint = registry.fingerprint(install)?;
    let started = Instant::now();
    let probed = probe_manifest(ctx, install).await?;
    let probe_time = started.elapsed();
    crate::metrics::WorkerMetrics::inc(&ctx.metrics.animus.probes);
    let (dialect, how) = match (install.protocol, &probed) {
        (Some(Dialect::Executa), Some(_)) => {
            return Err(DetectError::Mismatch {
                declared: Dialect::Executa,
            });
        }
        (Some(d), _) => (d, "declared"),
        (None, Some(_)) => (Dialect::Animus, "probed"),
        (None, None) => (Dialect::Executa, "probed"),
    };
    if let Some(m) = &probed {
        if !m.plugin_kind.is_hosted() {
            return Err(DetectError::KindNotHosted {
                kind: m.plugin_kind.to_string(),
            });
        }
        fleet_proto::animus::check_compatible(&m.protocol_version)
            .map_err(|e| DetectError::Version(e.to_string()))?;
    }
    Ok(Detected {
        dialect,
        how,
        manifest: probed,
        fingerprint,
        probe_time,
    })
}

/// Probe A: `--manifest` in the sandbox. `Ok(None)`: not an Animus manifest.
async fn probe_manifest(
    ctx: &WorkerContext,
    install: &Install,
) -> Result<Option<PluginManifest>, DetectError> {
    let Some(program) = install.argv.first() else {
        return Ok(None);
    };
    let prepared = ctx
        .sandbox
        .prepare(
            PROBE_USER,
            &install.tool_id,
            "p",
            install.effective_limits(ctx.config.limits),
            &install.dir,
            &install.argv,
            crate::sandbox::Start::Caller,
        )
        .map_err(|e| DetectError::Probe(e.to_string()))?;
    let sandbox = Sandboxed::new(prepared);
    let env = super::process::environment(&ctx.config, install, sandbox.space());
    let mut cmd = sandbox.command(&install.argv, &install.dir, env);
    cmd.arg(MANIFEST_FLAG)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let result = match cmd.spawn() {
        Err(e) => Err(DetectError::Launch {
            program: program.clone(),
            reason: e.to_string(),
        }),
        Ok(mut child) => {
            let mut out = Vec::new();
            let read = async {
                if let Some(stdout) = child.stdout.take() {
                    let cap = u64::try_from(limits::ANIMUS_MANIFEST_PROBE_MAX_BYTES + 1).unwrap_or(u64::MAX);
                    let _ = stdout.take(cap).read_to_end(&mut out).await;
                }
                child.wait().await
            };
            let status = tokio::time::timeout(limits::ANIMUS_MANIFEST_PROBE_TIMEOUT, read).await;
            let _ = child.start_kill();
            Ok(match status {
                Ok(Ok(s)) if s.success() && out.len() <= limits::ANIMUS_MANIFEST_PROBE_MAX_BYTES => {
                    parse_manifest(&out)
                }
                _ => None,
            })
        }
    };
    // Whatever the probe left behind dies with its cgroup.
    let _ = tokio::task::spawn_blocking(move || sandbox.release()).await;
    result
}

/// One JSON object that is a `PluginManifest` (string kind and version, array capabilities). Public only for the
/// fuzz targets (fuzz/).
#[doc(hidden)]
pub fn parse_manifest(out: &[u8]) -> Option<PluginManifest> {
    let text = std::str::from_utf8(out).ok()?.trim();
    let value: serde_json::Value = serde_json::from_str(text).ok()?;
    if !value.get("capabilities").is_some_and(serde_json::Value::is_array) {
        return None;
    }
    serde_json::from_value(value).ok()
}

#[cfg(test)]
mod tests {
    use super::parse_manifest;

    #[test]
    fn the_probe_user_is_one_no_token_can_name() {
        assert!(super::PROBE_USER.starts_with(fleet_proto::api::RESERVED_USER_PREFIX));
    }

    #[test]
    fn only_a_manifest_object_is_animus() {
        let m = br#"{"name":"p","version":"0.1.0","plugin_kind":"provider","protocol_version":"1.0.0","capabilities":["agent/run"]}"#;
        assert!(parse_manifest(m).is_some());
        assert!(parse_manifest(b"").is_none());
        assert!(parse_manifest(b"usage: plugin [--noop]\n").is_none());
        assert!(parse_manifest(br#"{"jsonrpc":"2.0","id":1,"result":{}}"#).is_none());
        assert!(
            parse_manifest(br#"{"name":"p","plugin_kind":"provider","protocol_version":"1.0.0"}"#).is_none()
        );
        assert!(parse_manifest(&[0xff, 0xfe]).is_none());
    }
}
