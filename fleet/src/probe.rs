//! `fleet probe`: spawn one plugin, run `initialize` → `describe` → (optionally) one `invoke` through the frame
//! codec, report what happened, and shut the plugin down (close stdin → grace → kill).
//!
//! This is a diagnostic for plugin authors and operators, not the worker: no cgroup, no restart policy.

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

/// What to probe.
#[derive(Debug, Clone)]
pub struct ProbeOptions {
    /// argv of the plugin.
    pub command: Vec<String>,
    /// A tool to invoke after `describe`.
    pub invoke: Option<(String, Map<String, Value>)>,
    /// `invoke` timeout.
    pub invoke_timeout: Duration,
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
}

/// Why a probe failed.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// No command given.
    #[error("no plugin command given")]
    NoCommand,
    /// Spawning failed.
    #[error("cannot start {command:?}: {source}")]
    Spawn {
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
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| ProbeError::Spawn {
            command: program.clone(),
            source,
        })?;
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
    let exit = shutdown(&mut child).await;
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
