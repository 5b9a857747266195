//! `fleet probe`: spawn one plugin, run `initialize` → `describe` → (optionally) one `invoke` through the frame
//! codec, report what happened, and shut the plugin down (close stdin → grace → kill).
//!
//! This is a diagnostic for plugin authors and operators, not the worker (no restart policy), but the plugin
//! runs confined as the worker would run it ([`ProbeSandbox`]): its own cgroup, network (loopback only), mount,
//! IPC and UTS namespaces with a private `/proc` and `/tmp`, the seccomp profile and an unprivileged uid of its
//! own — so what passes here passes in production. That needs root; otherwise (or with `--no-confine`) it
//! runs as a plain child and the report says `"confined": false`.

use std::process::Stdio;
use std::time::{Duration, Instant};

use fleet_proto::codec::io::{FrameReader, FrameWriter, ReadError};
use fleet_proto::codec::{Frame, FrameKind};
use fleet_proto::executa::invoke::{InvokeContext, InvokeParams, InvokeResult};
use fleet_proto::executa::lifecycle::{InitializeParams, InitializeResult, PROTOCOL_V2, PeerInfo, methods};
use fleet_proto::executa::manifest::Manifest;
use fleet_proto::jsonrpc::{ErrorObject, Id, Request};
use fleet_proto::limits;
use serde::Serialize;
use serde_json::{Map, Value, json};
use tokio::process::{Child, ChildStdout, Command};

/// The sandbox `fleet probe` runs a plugin in: the worker's (default configuration: cgroups, namespaces,
/// seccomp, a uid per user and tool), over a state directory of its own that is removed with it.
#[derive(Debug)]
pub struct ProbeSandbox {
    sandbox: fleet_worker::sandbox::Sandbox,
    state: std::path::PathBuf,
}

/// Why the probe sandbox could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ProbeSandboxError {
    /// Creating its state directory failed.
    #[error("cannot create the probe's state directory {path}: {source}")]
    State {
        /// The directory.
        path: std::path::PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The worker's sandbox refused (not root, no cgroups, no namespaces…).
    #[error("{0}; run as root, or pass --no-confine to probe the plugin unconfined")]
    Sandbox(#[from] fleet_worker::sandbox::SandboxError),
}

impl ProbeSandbox {
    /// The worker's sandbox with a fresh state directory under `/var/tmp` (so the plugin's own directories are
    /// never inside a private `/tmp`).
    pub fn new() -> Result<ProbeSandbox, ProbeSandboxError> {
        let state = std::path::PathBuf::from(format!(
            "/var/tmp/fleet-probe-{}-{}",
            std::process::id(),
            fleet_proto::util::now_ms()
        ));
        std::fs::create_dir_all(&state).map_err(|source| ProbeSandboxError::State {
            path: state.clone(),
            source,
        })?;
        let config = fleet_worker::config::WorkerConfig {
            worker_id: format!("probe-{}", std::process::id()),
            state_dir: state.clone(),
            ..fleet_worker::config::WorkerConfig::default()
        };
        match fleet_worker::sandbox::Sandbox::new(&config) {
            Ok(sandbox) => Ok(ProbeSandbox { sandbox, state }),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&state);
                Err(e.into())
            }
        }
    }
}

impl Drop for ProbeSandbox {
    fn drop(&mut self) {
        let _ = self.sandbox.remove_subtree();
        let _ = std::fs::remove_dir_all(&self.state);
    }
}

/// What to probe.
#[derive(Debug, Clone)]
pub struct ProbeOptions {
    /// argv of the plugin.
    pub command: Vec<String>,
    /// A tool to invoke after `describe`.
    pub invoke: Option<(String, Map<String, Value>)>,
    /// `invoke` timeout.
    pub invoke_timeout: Duration,
    /// Confine the plugin in this sandbox (`None`: a plain child).
    pub sandbox: Option<std::sync::Arc<ProbeSandbox>>,
}

/// What the probe found.
#[derive(Debug, Clone, Serialize)]
pub struct ProbeReport {
    /// `v2` or `v1`.
    pub protocol: String,
    /// Why the session is v1, if it is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub v1_reason: Option<String>,
    /// The negotiated capability keys.
    pub capabilities: Vec<String>,
    /// Tool names of the manifest.
    pub tools: Vec<String>,
    /// Manifest warnings.
    pub manifest_warnings: Vec<String>,
    /// The invoke's result, if one was asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub invoke: Option<Value>,
    /// Frames the plugin wrote that were not the answers awaited (notifications, junk), by kind.
    pub other_frames: Vec<String>,
    /// Milliseconds from spawn to a described plugin.
    pub ready_ms: u64,
    /// How the process ended.
    pub exit: String,
    /// Whether the plugin ran confined as the worker runs it.
    pub confined: bool,
}

/// Why a probe failed.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// No command given.
    #[error("no plugin command given")]
    NoCommand,
    /// The sandbox could not prepare the plugin's cgroup or identity.
    #[error("cannot prepare the plugin's sandbox: {0}")]
    Sandbox(#[from] fleet_worker::sandbox::SandboxError),
    /// Spawning failed.
    #[error("cannot start {command:?}: {source}{}", spawn_hint(source, *.confined))]
    Spawn {
        /// Whether it was spawned confined (under a uid of its own).
        confined: bool,
        /// The program.
        command: String,
        /// Why.
        source: std::io::Error,
    },
    /// The plugin's stdout ended or failed.
    #[error("the plugin closed stdout while the probe waited for {waiting_for}")]
    Closed {
        /// The method awaited.
        waiting_for: &'static str,
    },
    /// No answer in time.
    #[error("{method} timed out after {after:?}")]
    Timeout {
        /// The method.
        method: &'static str,
        /// The limit.
        after: Duration,
    },
    /// describe failed.
    #[error("describe failed: {0}")]
    Describe(String),
    /// Writing to the plugin failed.
    #[error("cannot write to the plugin: {0}")]
    Write(#[from] fleet_proto::codec::io::WriteError),
}

/// What to do about a confined spawn the plugin's uid could not make.
fn spawn_hint(e: &std::io::Error, confined: bool) -> &'static str {
    if confined && e.kind() == std::io::ErrorKind::PermissionDenied {
        " (the plugin runs under an unprivileged uid of its own: every directory above the program and its \
         files must be traversable by others (o+x), and the interpreter must not be a shim under a 0700 home \
         such as root's pyenv — name it by an absolute path like /usr/bin/python3)"
    } else {
        ""
    }
}

struct Conn {
    reader: FrameReader<ChildStdout>,
    writer: FrameWriter,
    other: Vec<String>,
}

impl Conn {
    /// Waits for the response to `id`, noting every other frame.
    async fn answer(
        &mut self,
        id: u64,
        method: &'static str,
        timeout: Duration,
    ) -> Result<Result<Frame, ErrorObject>, ProbeError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let next = tokio::time::timeout_at(deadline, self.reader.next())
                .await
                .map_err(|_| ProbeError::Timeout {
                    method,
                    after: timeout,
                })?;
            match next {
                None | Some(Err(ReadError::Io(_))) => return Err(ProbeError::Closed { waiting_for: method }),
                Some(Err(ReadError::Frame(e))) => self.other.push(format!("bad frame: {}", e.kind())),
                Some(Ok(frame)) => {
                    let ours = frame.id().and_then(Id::as_u64) == Some(id);
                    match frame.kind() {
                        FrameKind::Response if ours => return Ok(Ok(frame)),
                        FrameKind::ErrorResponse if ours => {
                            let err = frame.error().and_then(Result::ok).unwrap_or_else(|| {
                                ErrorObject::new(
                                    fleet_proto::jsonrpc::codes::INTERNAL_ERROR,
                                    "unreadable error",
                                )
                            });
                            return Ok(Err(err));
                        }
                        kind => self
                            .other
                            .push(format!("{kind:?} {}", frame.method().unwrap_or(""))),
                    }
                }
            }
        }
    }
}

/// Runs the probe.
pub async fn run(opts: &ProbeOptions) -> Result<ProbeReport, ProbeError> {
    let (program, args) = opts.command.split_first().ok_or(ProbeError::NoCommand)?;
    let started = Instant::now();
    let mut cmd = Command::new(program);
    // The plugin gets none of the caller's variables (tokens, credential paths): only the worker's default
    // allow-list, as a worker would pass it.
    let allowed = fleet_worker::config::WorkerConfig::default().env_allowlist;
    cmd.args(args)
        .env_clear()
        .envs(std::env::vars_os().filter(|(k, _)| allowed.iter().any(|a| k == a.as_str())))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    // The cgroup lives as long as this call; the plan (and anything it holds) until the process is gone.
    let prepared = match &opts.sandbox {
        None => None,
        Some(sb) => {
            let cwd = std::env::current_dir().unwrap_or_else(|_| "/".into());
            let prepared = sb.sandbox.prepare(
                "fleet-probe",
                "probe",
                "p",
                fleet_worker::config::ResourceLimits::default(),
                &cwd,
                &opts.command,
                fleet_worker::sandbox::Start::Caller,
            )?;
            if let Some(home) = prepared.space.workspace.to_str() {
                cmd.env("HOME", home).env("ANNA_WORKSPACE_DIR", home);
            }
            cmd.env("TMPDIR", &prepared.space.tmpdir);
            fleet_worker::sandbox::apply(&mut cmd, &prepared.plan);
            Some(prepared)
        }
    };
    let confined = prepared.is_some();
    let spawned = cmd.spawn().map_err(|source| ProbeError::Spawn {
        confined,
        command: program.clone(),
        source,
    });
    let mut child = match spawned {
        Ok(child) => child,
        Err(e) => {
            remove(prepared).await;
            return Err(e);
        }
    };
    let result = converse(opts, &mut child, started, confined).await;
    if result.is_err() {
        let _ = child.kill().await;
    }
    remove(prepared).await;
    result
}

/// Kills what is left in the probe's cgroup and removes it.
async fn remove(prepared: Option<fleet_worker::sandbox::Prepared>) {
    if let Some(cg) = prepared.and_then(|p| p.cgroup) {
        let _ = tokio::task::spawn_blocking(move || {
            let _ = cg.kill_all();
            cg.remove()
        })
        .await;
    }
}

/// The handshake, the optional invoke and the shutdown of a spawned plugin.
async fn converse(
    opts: &ProbeOptions,
    child: &mut Child,
    started: Instant,
    confined: bool,
) -> Result<ProbeReport, ProbeError> {
    let (stdin, stdout) = match (child.stdin.take(), child.stdout.take()) {
        (Some(i), Some(o)) => (i, o),
        _ => return Err(ProbeError::Closed { waiting_for: "stdio" }),
    };
    let (writer, writer_task) = FrameWriter::spawn(stdin);
    let mut conn = Conn {
        reader: FrameReader::new(stdout),
        writer,
        other: Vec::new(),
    };

    let init = InitializeParams {
        protocol_version: PROTOCOL_V2.into(),
        client_info: PeerInfo {
            name: "fleet-probe".into(),
            version: env!("CARGO_PKG_VERSION").into(),
        },
        capabilities: serde_json::from_value(json!({ "fileTransport": true })).unwrap_or_default(),
        host_capabilities: Map::new(),
    };
    conn.writer
        .send(&Request::new(0u64, methods::INITIALIZE, init))
        .await?;
    let (protocol, v1_reason, capabilities) = match conn
        .answer(0, methods::INITIALIZE, limits::INITIALIZE_TIMEOUT)
        .await
    {
        Ok(Ok(frame)) => match frame.parse_payload::<InitializeResult>() {
            Ok(Some(r)) if r.protocol() == fleet_proto::executa::lifecycle::ProtocolVersion::V2 => {
                ("v2", None, r.negotiated().into_iter().collect())
            }
            Ok(r) => (
                "v1",
                Some(format!(
                    "plugin answered protocolVersion {:?}",
                    r.and_then(|r| r.protocol_version).unwrap_or_default()
                )),
                Vec::new(),
            ),
            Err(e) => (
                "v1",
                Some(format!("unreadable initialize result: {e}")),
                Vec::new(),
            ),
        },
        Ok(Err(e)) => ("v1", Some(format!("initialize answered {e}")), Vec::new()),
        Err(ProbeError::Timeout { .. }) => ("v1", Some("initialize timed out".into()), Vec::new()),
        Err(e) => return Err(e),
    };

    conn.writer.send(&Request::bare(1u64, methods::DESCRIBE)).await?;
    let manifest = match conn
        .answer(1, methods::DESCRIBE, limits::DESCRIBE_TIMEOUT_FIRST_LAUNCH)
        .await?
    {
        Ok(frame) => {
            let value: Value = frame
                .parse_payload()
                .map_err(|e| ProbeError::Describe(e.to_string()))?
                .unwrap_or_default();
            Manifest::from_value(&value).map_err(|e| ProbeError::Describe(e.to_string()))?
        }
        Err(e) => return Err(ProbeError::Describe(e.to_string())),
    };
    let ready_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);

    let invoke = match &opts.invoke {
        None => None,
        Some((tool, arguments)) => {
            let params = InvokeParams {
                tool: tool.clone(),
                arguments: arguments.clone(),
                context: InvokeContext {
                    invoke_id: Some("probe-1".into()),
                    ..InvokeContext::default()
                },
                timeout: None,
                invoke_id: None,
            };
            conn.writer
                .send(&Request::new(2u64, methods::INVOKE, params))
                .await?;
            Some(
                match conn.answer(2, methods::INVOKE, opts.invoke_timeout).await? {
                    Ok(frame) => match frame.parse_payload::<InvokeResult>() {
                        Ok(Some(r)) => serde_json::to_value(r).unwrap_or_default(),
                        Ok(None) => json!({ "error": "empty result" }),
                        Err(e) => json!({ "error": format!("unreadable InvokeResult: {e}") }),
                    },
                    Err(e) => json!({ "jsonrpc_error": e }),
                },
            )
        }
    };

    let Conn { writer, other, .. } = conn;
    drop(writer);
    let _ = writer_task.await;
    let exit = shutdown(child).await;
    Ok(ProbeReport {
        protocol: protocol.into(),
        v1_reason,
        capabilities,
        tools: manifest.manifest.tools.iter().map(|t| t.name.clone()).collect(),
        manifest_warnings: manifest.warnings.iter().map(ToString::to_string).collect(),
        invoke,
        other_frames: other,
        ready_ms,
        exit,
        confined,
    })
}

/// stdin is already closed: wait the grace period, then kill.
async fn shutdown(child: &mut Child) -> String {
    match tokio::time::timeout(limits::SHUTDOWN_GRACE, child.wait()).await {
        Ok(Ok(status)) => status.to_string(),
        Ok(Err(e)) => format!("wait failed: {e}"),
        Err(_) => {
            let _ = child.kill().await;
            "killed after the shutdown grace period".into()
        }
    }
}
