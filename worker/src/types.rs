//! What the worker's dialects and its callers share: the worker context, invokes (request, output, error) and
//! health states. Both dialects (`session` for Executa, `animus`) depend on this module; it depends on neither.

use std::sync::Arc;
use std::time::Duration;

use fleet_proto::animus::HealthStatus;
use fleet_proto::codec::{Frame, FrameKind};
use fleet_proto::jsonrpc::{ErrorObject, codes};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::child::ExitInfo;
use crate::config::WorkerConfig;
use crate::metrics::WorkerMetrics;
use crate::progress::ProgressSink;
use crate::sandbox::Sandbox;
use crate::services::{HostServices, TokenSource};

/// What every session of a worker shares.
#[derive(Debug, Clone)]
pub struct WorkerContext {
    /// Configuration.
    pub config: Arc<WorkerConfig>,
    /// Cgroups, uids, per-user directories.
    pub sandbox: Sandbox,
    /// Reverse-RPC services.
    pub services: Arc<dyn HostServices>,
    /// Token minting.
    pub tokens: Arc<dyn TokenSource>,
    /// Counters.
    pub metrics: Arc<WorkerMetrics>,
}

/// Why an invoke failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InvokeError {
    /// The manifest has no such tool.
    #[error("unknown tool {tool:?}; the plugin offers {available:?}")]
    UnknownTool {
        /// The tool asked for.
        tool: String,
        /// What the manifest lists.
        available: Vec<String>,
    },
    /// An invoke with this id is already active on the session.
    #[error("invoke {0} is already active")]
    DuplicateInvokeId(String),
    /// The session's in-flight bound is reached.
    #[error("too many invokes in flight on this plugin session (limit {limit})")]
    TooManyInFlight {
        /// The bound.
        limit: usize,
    },
    /// The session is Stopped.
    #[error("the plugin session is stopped: {0}")]
    Stopped(String),
    /// The session is shut down.
    #[error("the plugin session is shut down")]
    Closed,
    /// The process was not ready within the invoke's time.
    #[error("the plugin was not ready within {0:?}")]
    NotReady(Duration),
    /// The process died while the invoke was in flight.
    #[error("the plugin process exited during the invoke ({exit}); stderr: {stderr_tail}")]
    ProcessExited {
        /// How it ended.
        exit: ExitInfo,
        /// The last stderr lines.
        stderr_tail: String,
    },
    /// No answer within the timeout.
    #[error("the invoke timed out after {0:?}")]
    Timeout(Duration),
    /// Cancelled by the caller.
    #[error("the invoke was cancelled")]
    Cancelled,
    /// The plugin answered with a JSON-RPC error (a programmer error, spec §4.4).
    #[error("the plugin answered {0}")]
    Plugin(ErrorObject),
    /// The answer was over the frame limit.
    #[error("the plugin's answer was {frame_bytes} bytes, over the {max_frame_bytes}-byte frame limit")]
    FrameTooLarge {
        /// Its size.
        frame_bytes: u64,
        /// The limit.
        max_frame_bytes: u64,
    },
    /// The answer came by file transport and was refused.
    #[error("file transport refused: {0}")]
    FileTransport(String),
    /// The answer was not an `InvokeResult`.
    #[error("the plugin's result is unreadable: {0}")]
    Unreadable(String),
    /// The manifest declares `required` credentials that have no value for this user and no default (spec
    /// §4.2: "the plugin won't be enabled until required keys are set"); the invoke was not sent.
    #[error("the plugin requires credentials the user has not set: {}", missing.join(", "))]
    CredentialsRequired {
        /// The names without a value.
        missing: Vec<String>,
    },
    /// The user's stored credentials could not be read; the invoke was not sent.
    #[error("the user's credentials cannot be read: {0}")]
    CredentialsUnavailable(String),
    /// An Animus plugin answered a JSON-RPC error, classified by the Animus table (host → plugin direction,
    /// `fleet_proto::animus::classify_run_error`); never a sign of a dead process.
    #[error("the Animus plugin answered {error} ({})", class.as_str())]
    Animus {
        /// What the error means.
        class: fleet_proto::animus::RunErrorClass,
        /// The error as answered.
        error: ErrorObject,
    },
}

impl InvokeError {
    /// A short, stable name of the failure (the `error.type` of traces).
    pub fn kind(&self) -> &'static str {
        match self {
            InvokeError::UnknownTool { .. } => "unknown_tool",
            InvokeError::DuplicateInvokeId(_) => "duplicate_invoke_id",
            InvokeError::TooManyInFlight { .. } => "too_many_in_flight",
            InvokeError::Stopped(_) => "stopped",
            InvokeError::Closed => "closed",
            InvokeError::NotReady(_) => "not_ready",
            InvokeError::ProcessExited { .. } => "process_exited",
            InvokeError::Timeout(_) => "timeout",
            InvokeError::Cancelled => "cancelled",
            InvokeError::Plugin(_) => "plugin_error",
            InvokeError::FrameTooLarge { .. } => "frame_too_large",
            InvokeError::FileTransport(_) => "file_transport",
            InvokeError::Unreadable(_) => "unreadable",
            InvokeError::Animus { .. } => "animus_error",
            InvokeError::CredentialsRequired { .. } => "credentials_required",
            InvokeError::CredentialsUnavailable(_) => "credentials_unavailable",
        }
    }
}

/// One invoke.
#[derive(Clone, Default)]
pub struct InvokeRequest {
    /// The tool (a `tools[].name` of the manifest).
    pub tool: String,
    /// Its arguments (declared defaults are filled in for omitted ones).
    pub arguments: Map<String, Value>,
    /// The invoke id (the job id for async jobs).
    pub invoke_id: String,
    /// Overrides the manifest's per-tool timeout.
    pub timeout: Option<Duration>,
    /// Absolute deadline (Unix epoch ms) for `context.deadline_ms`; defaults to now + timeout.
    pub deadline_ms: Option<u64>,
    /// The app-facing clamped timeout forwarded as `params.timeout` (spec §10.3 HR-SI-02).
    pub app_timeout_ms: Option<u64>,
    /// Credentials the user configured, by name; only those the manifest declares are passed.
    pub credentials: Map<String, Value>,
    /// Where progress goes (async jobs); `None` drops it (sync invokes).
    pub progress: Option<ProgressSink>,
    /// More `context` keys (e.g. W3C `traceparent`).
    pub extra_context: Map<String, Value>,
    /// The front's delegation for this invoke's agent-session tool calls: handed to the token source
    /// ([`crate::services::TokenSource::delegate`]), never to the plugin.
    pub delegation: Option<fleet_proto::api::delegation::DelegationToken>,
}

impl std::fmt::Debug for InvokeRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InvokeRequest")
            .field("tool", &self.tool)
            .field("invoke_id", &self.invoke_id)
            .field("timeout", &self.timeout)
            .field("credentials", &self.credentials.keys().collect::<Vec<_>>())
            .field("progress", &self.progress.is_some())
            .field("delegation", &self.delegation.is_some())
            .finish_non_exhaustive()
    }
}

/// A completed invoke: the plugin's `InvokeResult`, kept as the frame it came in (no copy of `data`).
#[derive(Debug, Clone)]
pub struct InvokeOutput {
    frame: Frame,
    success: bool,
    error: Option<String>,
    /// Host-measured duration (from sending the invoke to its answer).
    pub duration: Duration,
    /// Whether the call found the process already running.
    pub warm: bool,
}

impl InvokeOutput {
    /// `result.success` (a missing `success` is false, spec §4.4 HR-RD-02).
    pub fn success(&self) -> bool {
        self.success
    }

    /// The failure message of a `success: false` result.
    pub fn error_message(&self) -> Option<&str> {
        self.error.as_deref()
    }

    /// The whole `InvokeResult` as raw JSON.
    pub fn result_json(&self) -> &str {
        self.frame.result_json().unwrap_or("null")
    }

    /// `result.data` as raw JSON, if present.
    pub fn data_json(&self) -> Option<&str> {
        #[derive(Deserialize)]
        struct Data<'a> {
            #[serde(borrow, default)]
            data: Option<&'a RawValue>,
        }
        serde_json::from_str::<Data<'_>>(self.result_json())
            .ok()?
            .data
            .map(RawValue::get)
    }

    /// `result.data` parsed.
    pub fn data(&self) -> Option<Value> {
        serde_json::from_str(self.data_json()?).ok()
    }

    /// An output the host composed from another dialect's answer (an Animus run): `result` has the
    /// `InvokeResult` shape (`{success, data, error?}`).
    pub(crate) fn composed(
        result: &Value,
        duration: Duration,
        warm: bool,
    ) -> Result<InvokeOutput, InvokeError> {
        let body = serde_json::json!({ "jsonrpc": "2.0", "id": 0, "result": result });
        let bytes = serde_json::to_vec(&body).map_err(|e| InvokeError::Unreadable(e.to_string()))?;
        let frame = Frame::parse(bytes.into()).map_err(|e| InvokeError::Unreadable(e.to_string()))?;
        output(frame, duration, warm)
    }

    /// Size of the `InvokeResult` in bytes.
    pub fn result_bytes(&self) -> usize {
        self.result_json().len()
    }
}

/// The `InvokeOutput` of an answer frame (an error response is [`InvokeError::Plugin`]).
pub(crate) fn output(frame: Frame, duration: Duration, warm: bool) -> Result<InvokeOutput, InvokeError> {
    #[derive(Deserialize)]
    struct Head {
        #[serde(default)]
        success: bool,
        #[serde(default)]
        error: Option<Value>,
    }
    match frame.kind() {
        FrameKind::ErrorResponse => {
            let e = frame
                .error()
                .and_then(Result::ok)
                .unwrap_or_else(|| ErrorObject::new(codes::INTERNAL_ERROR, "unreadable error"));
            Err(InvokeError::Plugin(e))
        }
        _ => {
            let head: Head = serde_json::from_str(frame.result_json().unwrap_or("null"))
                .map_err(|e| InvokeError::Unreadable(e.to_string()))?;
            let error = if head.success {
                None
            } else {
                Some(match head.error {
                    Some(Value::String(s)) => s,
                    Some(v) => v.to_string(),
                    None => "the plugin returned success: false without an error".into(),
                })
            };
            Ok(InvokeOutput {
                frame,
                success: head.success,
                error,
                duration,
                warm,
            })
        }
    }
}

/// The health of a plugin as the host sees it, both dialects (spec §3.7 "structured health").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum HealthState {
    /// Answering and healthy (Animus `healthy`; Executa `ready`/`healthy`, or no `health` method).
    Healthy,
    /// Serving, impaired (Animus `degraded`).
    Degraded,
    /// Starting (Executa `initializing`, or no process yet).
    Starting,
    /// Not serving (Animus `unhealthy`, Executa `error`, no answer).
    Unhealthy,
}

impl HealthState {
    /// Every state, in a fixed order.
    pub const ALL: [HealthState; 4] = [
        HealthState::Healthy,
        HealthState::Degraded,
        HealthState::Starting,
        HealthState::Unhealthy,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            HealthState::Healthy => "healthy",
            HealthState::Degraded => "degraded",
            HealthState::Starting => "starting",
            HealthState::Unhealthy => "unhealthy",
        }
    }

    /// An Executa `health` answer mapped onto the shared states.
    pub fn from_executa(h: fleet_proto::executa::lifecycle::Health) -> HealthState {
        use fleet_proto::executa::lifecycle::Health;
        match h {
            Health::Healthy => HealthState::Healthy,
            Health::Starting => HealthState::Starting,
            _ => HealthState::Unhealthy,
        }
    }

    pub(crate) fn from_animus(s: HealthStatus) -> HealthState {
        match s {
            HealthStatus::Healthy => HealthState::Healthy,
            HealthStatus::Degraded => HealthState::Degraded,
            HealthStatus::Unhealthy => HealthState::Unhealthy,
        }
    }
}
