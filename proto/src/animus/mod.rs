//! The Animus plugin protocol (seed 004; `../shared/spec/animus.md` §1): the second stdio dialect the fleet hosts.
//!
//! Same framing as Executa (line-delimited JSON-RPC 2.0, the [`codec`](crate::codec) of this crate), a different
//! lifecycle and vocabulary:
//!
//! ```text
//! spawn ──▶ initialize ──▶ initialized (notification) ──▶ domain calls (+ notifications)
//!       ──▶ shutdown ──▶ exit (notification) ──▶ process exit
//! ```
//!
//! Only what the host needs is typed: the lifecycle, `--manifest`, the shared methods (`$/ping`,
//! `health/check`, `$/cancelRequest`, `$/progress`), the provider kind (`agent/*`), and the error codes. Every
//! struct keeps unknown fields (`extra`) so nothing a newer plugin sends is lost, and every optional field is
//! omitted when absent. Error codes mean different things in the two dialects: see [`codes`] and
//! [`classify_run_error`].

use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The protocol version the host offers in `initialize` (spec §8.1: 1.1.0 is additive over 1.0.0).
pub const PROTOCOL_VERSION: &str = "1.1.0";

/// The only major version hosted (spec §15: "host_major == plugin_major → compatible").
pub const PROTOCOL_MAJOR: u64 = 1;

/// The host's name in `initialize.host_info`.
pub const HOST_NAME: &str = "cloud-agents";

/// The argument that asks a plugin for its `PluginManifest` (spec §3.1; `-m` is the short form).
pub const MANIFEST_FLAG: &str = "--manifest";

/// The `init_extensions` key carrying the W3C trace context of the session (our extension; plugins ignore
/// unknown extensions, spec §3.2).
pub const TRACEPARENT_EXTENSION: &str = "traceparent";

/// Method names.
pub mod methods {
    /// Lifecycle: the host's first request.
    pub const INITIALIZE: &str = "initialize";
    /// Lifecycle: notification after the `initialize` answer; domain calls only after it.
    pub const INITIALIZED: &str = "initialized";
    /// Lifecycle: the plugin finishes in-flight work and answers `{}`.
    pub const SHUTDOWN: &str = "shutdown";
    /// Lifecycle: notification; the plugin must terminate.
    pub const EXIT: &str = "exit";
    /// Liveness: answered `{}` as fast as possible (host timeout ≤ 1 s).
    pub const PING: &str = "$/ping";
    /// Health: `{status: healthy | degraded | unhealthy, ...}`.
    pub const HEALTH_CHECK: &str = "health/check";
    /// Notification: cancel the in-flight request `params.id` (answered with -32002).
    pub const CANCEL_REQUEST: &str = "$/cancelRequest";
    /// Notification: progress of request `params.id`, arbitrary `params.value`.
    pub const PROGRESS: &str = "$/progress";
    /// Provider: run an agent.
    pub const AGENT_RUN: &str = "agent/run";
    /// Provider: continue a session.
    pub const AGENT_RESUME: &str = "agent/resume";
    /// Provider: cancel a session's run.
    pub const AGENT_CANCEL: &str = "agent/cancel";
    /// Provider notification: output text.
    pub const AGENT_OUTPUT: &str = "agent/output";
    /// Provider notification: thinking text.
    pub const AGENT_THINKING: &str = "agent/thinking";
    /// Provider notification: a tool call.
    pub const AGENT_TOOL_CALL: &str = "agent/toolCall";
    /// Provider notification: a tool result.
    pub const AGENT_TOOL_RESULT: &str = "agent/toolResult";
    /// Provider notification: an error, `recoverable` or not.
    pub const AGENT_ERROR: &str = "agent/error";
    /// Structured log line on stdout (code, not spec): routed to logs, never progress.
    pub const LOG_ENTRY: &str = "log/entry";
    /// The de-facto MCP tool call of `custom` plugins (`{name, arguments}`), used only when advertised.
    pub const MCP_TOOL_CALL: &str = "mcp/tool_call";

    /// Methods every plugin has that are not domain methods (never exposed as tools).
    pub const LIFECYCLE: &[&str] = &[INITIALIZE, INITIALIZED, SHUTDOWN, EXIT, PING, HEALTH_CHECK];
}

/// Error codes, **host → plugin direction** (spec §4). In the Executa dialect the same numbers
/// (-32000..-32099) are plugin-defined data; never interpret them outside Animus.
pub mod codes {
    /// A domain method arrived before `initialize` completed.
    pub const PLUGIN_NOT_INITIALIZED: i64 = -32000;
    /// Recognised but not implemented: the host should fall back.
    pub const METHOD_NOT_SUPPORTED: i64 = -32001;
    /// The host cancelled the request (`$/cancelRequest`, `agent/cancel`).
    pub const REQUEST_CANCELLED: i64 = -32002;
    /// The request did not complete within the host-imposed timeout.
    pub const TIMEOUT: i64 = -32003;
}

/// Why a version string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VersionError {
    /// Not `MAJOR.MINOR.PATCH` (pre-release / build suffixes allowed).
    #[error("protocol_version {0:?} is not a semantic version")]
    NotSemver(String),
    /// Another major version.
    #[error("protocol_version {found:?} has major {major}; this host speaks major {PROTOCOL_MAJOR}")]
    Major {
        /// The version sent.
        found: String,
        /// Its major.
        major: u64,
    },
}

/// The major of a semver string.
pub fn major(version: &str) -> Result<u64, VersionError> {
    let core = version.split(['-', '+']).next().unwrap_or("");
    let parts: Vec<&str> = core.split('.').collect();
    if parts.len() != 3
        || parts
            .iter()
            .any(|p| p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()))
    {
        return Err(VersionError::NotSemver(version.to_string()));
    }
    parts[0]
        .parse()
        .map_err(|_| VersionError::NotSemver(version.to_string()))
}

/// Checks that `version` is hosted (same major).
pub fn check_compatible(version: &str) -> Result<(), VersionError> {
    let m = major(version)?;
    if m == PROTOCOL_MAJOR {
        Ok(())
    } else {
        Err(VersionError::Major {
            found: version.to_string(),
            major: m,
        })
    }
}

/// A plugin kind (spec §5). Unknown kinds round-trip as [`PluginKind::Other`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub enum PluginKind {
    /// Runs agents: `agent/run`, `agent/resume`, `agent/cancel`.
    Provider,
    /// Opaque domain methods (`capabilities.methods`, `mcp_tools`).
    Custom,
    /// Any other kind (subject_backend, trigger_backend, …): not hosted as tools.
    Other(String),
}

impl PluginKind {
    /// The wire name.
    pub fn as_str(&self) -> &str {
        match self {
            PluginKind::Provider => "provider",
            PluginKind::Custom => "custom",
            PluginKind::Other(s) => s,
        }
    }

    /// Whether the fleet hosts this kind as tools (spec §3.3).
    pub fn is_hosted(&self) -> bool {
        matches!(self, PluginKind::Provider | PluginKind::Custom)
    }
}

impl From<String> for PluginKind {
    fn from(s: String) -> Self {
        match s.as_str() {
            "provider" => PluginKind::Provider,
            "custom" => PluginKind::Custom,
            _ => PluginKind::Other(s),
        }
    }
}

impl From<PluginKind> for String {
    fn from(k: PluginKind) -> Self {
        k.as_str().to_string()
    }
}

impl fmt::Display for PluginKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What `plugin --manifest` prints (spec §3.1, §8.2).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PluginManifest {
    /// Package name.
    pub name: String,
    /// Plugin version.
    #[serde(default)]
    pub version: String,
    /// The kind.
    pub plugin_kind: PluginKind,
    /// What it does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Semver of the protocol.
    pub protocol_version: String,
    /// Methods it implements.
    #[serde(default)]
    pub capabilities: Vec<String>,
    /// Anything else (env_required, plugin_kinds, …), kept.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `initialize` params, as this host sends them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InitializeParams {
    /// [`PROTOCOL_VERSION`].
    pub protocol_version: String,
    /// Who the host is.
    pub host_info: HostInfo,
    /// What the host accepts.
    pub capabilities: HostCapabilities,
    /// v1.1.0 extensions (we send `traceparent` when traced).
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub init_extensions: Map<String, Value>,
}

/// `initialize.host_info`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostInfo {
    /// Host name.
    pub name: String,
    /// Host version.
    pub version: String,
}

/// `initialize.capabilities` (the host's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostCapabilities {
    /// The host accepts streaming notifications.
    pub streaming: bool,
    /// The host accepts `$/progress`.
    pub progress: bool,
    /// The host may send `$/cancelRequest`.
    pub cancellation: bool,
}

/// The `initialize` answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InitializeResult {
    /// The plugin's protocol version (major must match).
    pub protocol_version: String,
    /// Who the plugin is.
    pub plugin_info: PluginInfo,
    /// What it offers.
    #[serde(default)]
    pub capabilities: PluginCapabilities,
    /// Anything else (kind_capabilities, …), kept.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `initialize.result.plugin_info` (spec §8.7).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PluginInfo {
    /// Name.
    pub name: String,
    /// Version.
    #[serde(default)]
    pub version: String,
    /// Kind.
    pub plugin_kind: PluginKind,
    /// Description.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
}

/// `initialize.result.capabilities` (spec §8.6).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PluginCapabilities {
    /// Methods (and `$harness/…` feature flags, which are not methods).
    #[serde(default)]
    pub methods: Vec<String>,
    /// Streams notifications.
    #[serde(default)]
    pub streaming: bool,
    /// Sends `$/progress`.
    #[serde(default)]
    pub progress: bool,
    /// Honours `$/cancelRequest`.
    #[serde(default)]
    pub cancellation: bool,
    /// Tools of a `custom` plugin.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mcp_tools: Vec<McpTool>,
    /// Anything else, kept.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl PluginCapabilities {
    /// Whether `method` is advertised.
    pub fn has(&self, method: &str) -> bool {
        self.methods.iter().any(|m| m == method)
    }

    /// The advertised domain methods: not lifecycle methods, not `$/…`, not feature flags (`$harness/…`,
    /// `$host/…`, `$vendor/…`).
    pub fn domain_methods(&self) -> impl Iterator<Item = &str> {
        self.methods
            .iter()
            .map(String::as_str)
            .filter(|m| !m.starts_with('$') && !methods::LIFECYCLE.contains(m))
    }
}

/// One tool of a `custom` plugin.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct McpTool {
    /// Tool name.
    pub name: String,
    /// Description.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// JSON Schema of the arguments.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_schema: Option<Value>,
}

/// `health/check` status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HealthStatus {
    /// Serving.
    Healthy,
    /// Serving, impaired.
    Degraded,
    /// Not serving.
    Unhealthy,
}

/// The `health/check` answer (every field but `status` optional).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HealthCheckResult {
    /// The status.
    pub status: HealthStatus,
    /// Uptime.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uptime_ms: Option<u64>,
    /// Memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_usage_bytes: Option<u64>,
    /// The last error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

/// `$/cancelRequest` params.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CancelRequestParams {
    /// The id of the request to cancel.
    pub id: Value,
}

/// `$/progress` params.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProgressParams {
    /// The request it belongs to.
    pub id: Value,
    /// Anything.
    #[serde(default)]
    pub value: Value,
}

/// `agent/run` / `agent/resume` params (A-PROV `AgentRunRequest`: only `prompt` and `cwd` are required).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AgentRunRequest {
    /// Set for `agent/resume`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    /// The prompt.
    pub prompt: String,
    /// Model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// System prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_prompt: Option<String>,
    /// Working directory (host-owned).
    pub cwd: String,
    /// Project root (host-owned).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project_root: Option<String>,
    /// Permission mode (host-owned).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permission_mode: Option<String>,
    /// The run's time budget (host-owned: the job's remaining deadline).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<u64>,
    /// Environment (host-owned).
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub env: Map<String, Value>,
    /// Extra keys, flattened (`control_session_id`, `traceparent`, …).
    #[serde(flatten)]
    pub extras: Map<String, Value>,
}

/// Token usage, when a provider reports it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokensUsed {
    /// Input tokens.
    #[serde(default)]
    pub input: u64,
    /// Output tokens.
    #[serde(default)]
    pub output: u64,
    /// Anything else (cached, cache_writes).
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// The final answer of `agent/run` (spec §10).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AgentRunResponse {
    /// The provider's session.
    #[serde(default)]
    pub session_id: Option<String>,
    /// Not truthful in every runtime (spec §1.5.1 #4): success also needs no non-recoverable `agent/error`.
    #[serde(default)]
    pub exit_code: Option<i64>,
    /// Output text.
    #[serde(default)]
    pub output: Option<String>,
    /// Metadata entries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub metadata: Vec<Value>,
    /// Tool calls.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<Value>,
    /// Tool results.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_results: Vec<Value>,
    /// Thinking.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub thinking: Vec<Value>,
    /// Errors.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<Value>,
    /// Duration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    /// Backend.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// Usage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_used: Option<TokensUsed>,
    /// Anything else, kept.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl AgentRunResponse {
    /// The run's success as spec §3.4 judges it: `exit_code == 0` (absent counts as 0) **and** no
    /// non-recoverable `agent/error` was streamed.
    pub fn succeeded(&self, fatal_error_seen: bool) -> bool {
        self.exit_code.unwrap_or(0) == 0 && !fatal_error_seen
    }
}

/// `agent/cancel` params.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentCancelParams {
    /// The session to cancel.
    pub session_id: String,
}

/// `agent/error` params.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentErrorParams {
    /// The session.
    #[serde(default)]
    pub session_id: Option<String>,
    /// What happened.
    #[serde(default)]
    pub message: String,
    /// Whether the run continues.
    #[serde(default)]
    pub recoverable: bool,
}

/// Just the `session_id` of any `agent/*` notification.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct SessionRef {
    /// The session.
    #[serde(default)]
    pub session_id: Option<String>,
}

/// How an `agent/*` or `$/progress` notification becomes a job progress event (spec §3.4 "progress events").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunEvent {
    /// `agent/output` (`final` absent = false).
    OutputDelta,
    /// `agent/output` with `final: true`.
    OutputFinal,
    /// `agent/thinking`.
    Thinking,
    /// `agent/toolCall`.
    ToolCall,
    /// `agent/toolResult`.
    ToolResult,
    /// `agent/error` with `recoverable: true`.
    Warning,
    /// `agent/error` without `recoverable: true`: the run is failing.
    Error,
    /// `$/progress`.
    Progress,
}

impl RunEvent {
    /// The event name carried in the progress event's data (`event`).
    pub fn as_str(self) -> &'static str {
        match self {
            RunEvent::OutputDelta => "output.delta",
            RunEvent::OutputFinal => "output.final",
            RunEvent::Thinking => "thinking",
            RunEvent::ToolCall => "tool.call",
            RunEvent::ToolResult => "tool.result",
            RunEvent::Warning => "warning",
            RunEvent::Error => "error",
            RunEvent::Progress => "progress",
        }
    }

    /// Classifies a notification; `None` for anything that is not run progress (`log/entry`, unknown).
    pub fn classify(method: &str, params: &Value) -> Option<RunEvent> {
        Some(match method {
            methods::AGENT_OUTPUT => {
                if params.get("final").and_then(Value::as_bool) == Some(true) {
                    RunEvent::OutputFinal
                } else {
                    RunEvent::OutputDelta
                }
            }
            methods::AGENT_THINKING => RunEvent::Thinking,
            methods::AGENT_TOOL_CALL => RunEvent::ToolCall,
            methods::AGENT_TOOL_RESULT => RunEvent::ToolResult,
            methods::AGENT_ERROR => {
                if params.get("recoverable").and_then(Value::as_bool) == Some(true) {
                    RunEvent::Warning
                } else {
                    RunEvent::Error
                }
            }
            methods::PROGRESS => RunEvent::Progress,
            _ => return None,
        })
    }

    /// Whether this event is a tool event (job progress type `tool_update`) rather than plain `progress`.
    pub fn is_tool_update(self) -> bool {
        matches!(self, RunEvent::ToolCall | RunEvent::ToolResult)
    }
}

/// What a JSON-RPC error answered by an Animus plugin to a host request means (spec §3.4, host → plugin
/// direction). A structured error is never a dead process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RunErrorClass {
    /// -32002: the request was cancelled.
    Cancelled,
    /// -32003: the plugin's own timeout.
    TimedOut,
    /// -32602 with `data.category: "model_not_supported"` (or any -32602): the caller's arguments.
    InvalidArguments,
    /// -32603 with `data.category: "unavailable"`: an upstream outage, retriable.
    Unavailable,
    /// -32601 / -32001: the plugin does not offer this; not retriable.
    Unsupported,
    /// -32000: the plugin was not initialised (a host or plugin lifecycle bug).
    NotInitialized,
    /// Anything else: the run failed.
    Failed,
}

impl RunErrorClass {
    /// A short stable name.
    pub fn as_str(self) -> &'static str {
        match self {
            RunErrorClass::Cancelled => "cancelled",
            RunErrorClass::TimedOut => "timed_out",
            RunErrorClass::InvalidArguments => "invalid_arguments",
            RunErrorClass::Unavailable => "unavailable",
            RunErrorClass::Unsupported => "unsupported",
            RunErrorClass::NotInitialized => "not_initialized",
            RunErrorClass::Failed => "failed",
        }
    }
}

/// Classifies an error an Animus plugin answered to a host request (never use this for Executa frames: there
/// -32000..-32099 are plugin data).
pub fn classify_run_error(code: i64, data: Option<&Value>) -> RunErrorClass {
    let category = data.and_then(|d| d.get("category")).and_then(Value::as_str);
    match code {
        codes::REQUEST_CANCELLED => RunErrorClass::Cancelled,
        codes::TIMEOUT => RunErrorClass::TimedOut,
        codes::PLUGIN_NOT_INITIALIZED => RunErrorClass::NotInitialized,
        codes::METHOD_NOT_SUPPORTED | crate::jsonrpc::codes::METHOD_NOT_FOUND => RunErrorClass::Unsupported,
        crate::jsonrpc::codes::INVALID_PARAMS => RunErrorClass::InvalidArguments,
        crate::jsonrpc::codes::INTERNAL_ERROR if category == Some("unavailable") => {
            RunErrorClass::Unavailable
        }
        _ => RunErrorClass::Failed,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use serde_json::json;

    use super::*;

    #[test]
    fn versions() {
        assert_eq!(major("1.0.0"), Ok(1));
        assert_eq!(major("1.1.0-rc.1+b"), Ok(1));
        assert!(check_compatible("1.9.3").is_ok());
        assert_eq!(
            check_compatible("2.0.0"),
            Err(VersionError::Major {
                found: "2.0.0".into(),
                major: 2
            })
        );
        for bad in ["", "1", "1.0", "v1.0.0", "1.x.0", "1..0"] {
            assert!(matches!(major(bad), Err(VersionError::NotSemver(_))), "{bad}");
        }
    }

    #[test]
    fn kinds_round_trip() {
        for k in ["provider", "custom", "subject_backend"] {
            let kind: PluginKind = serde_json::from_value(json!(k)).unwrap();
            assert_eq!(serde_json::to_value(&kind).unwrap(), json!(k));
        }
        assert!(PluginKind::Provider.is_hosted());
        assert!(!PluginKind::from("subject_backend".to_string()).is_hosted());
    }

    #[test]
    fn manifest_and_initialize_shapes() {
        let m: PluginManifest =
            serde_json::from_value(json!({"name":"animus-provider-mock","version":"0.1.0",
            "plugin_kind":"provider","description":"d","protocol_version":"1.0.0",
            "capabilities":["agent/run","agent/cancel","agent/resume","health/check"]}))
            .unwrap();
        assert_eq!(m.plugin_kind, PluginKind::Provider);
        let r: InitializeResult = serde_json::from_value(json!({"protocol_version":"1.0.0",
            "plugin_info":{"name":"x","version":"0.1.0","plugin_kind":"custom"},
            "capabilities":{"methods":["x/a","health/check","$/ping","$harness/flag","x/b"],"cancellation":true}}))
        .unwrap();
        assert_eq!(
            r.capabilities.domain_methods().collect::<Vec<_>>(),
            ["x/a", "x/b"]
        );
        assert!(r.capabilities.cancellation);
        let p = InitializeParams {
            protocol_version: PROTOCOL_VERSION.into(),
            host_info: HostInfo {
                name: HOST_NAME.into(),
                version: "0".into(),
            },
            capabilities: HostCapabilities {
                streaming: true,
                progress: true,
                cancellation: true,
            },
            init_extensions: Map::new(),
        };
        assert_eq!(
            serde_json::to_value(&p).unwrap(),
            json!({"protocol_version":"1.1.0","host_info":{"name":"cloud-agents","version":"0"},
                "capabilities":{"streaming":true,"progress":true,"cancellation":true}})
        );
    }

    #[test]
    fn run_request_omits_absent_fields_and_keeps_extras() {
        let mut r = AgentRunRequest {
            prompt: "hi".into(),
            cwd: "/w".into(),
            ..AgentRunRequest::default()
        };
        r.extras.insert("control_session_id".into(), json!("tjob_1"));
        assert_eq!(
            serde_json::to_value(&r).unwrap(),
            json!({"prompt":"hi","cwd":"/w","control_session_id":"tjob_1"})
        );
    }

    #[test]
    fn success_is_not_exit_code_alone() {
        let ok: AgentRunResponse = serde_json::from_value(json!({"exit_code":0,"output":"x"})).unwrap();
        assert!(ok.succeeded(false));
        assert!(!ok.succeeded(true), "a non-recoverable agent/error fails the run");
        let bad: AgentRunResponse = serde_json::from_value(json!({"exit_code":2})).unwrap();
        assert!(!bad.succeeded(false));
    }

    #[test]
    fn events() {
        assert_eq!(
            RunEvent::classify("agent/output", &json!({"text":"a"})),
            Some(RunEvent::OutputDelta)
        );
        assert_eq!(
            RunEvent::classify("agent/output", &json!({"text":"a","final":true})),
            Some(RunEvent::OutputFinal)
        );
        assert_eq!(
            RunEvent::classify("agent/error", &json!({"recoverable":true})),
            Some(RunEvent::Warning)
        );
        assert_eq!(
            RunEvent::classify("agent/error", &json!({})),
            Some(RunEvent::Error)
        );
        assert_eq!(RunEvent::classify("log/entry", &json!({})), None);
    }

    #[test]
    fn error_table() {
        assert_eq!(classify_run_error(-32002, None), RunErrorClass::Cancelled);
        assert_eq!(classify_run_error(-32003, None), RunErrorClass::TimedOut);
        assert_eq!(
            classify_run_error(-32602, Some(&json!({"category":"model_not_supported"}))),
            RunErrorClass::InvalidArguments
        );
        assert_eq!(
            classify_run_error(-32603, Some(&json!({"category":"unavailable"}))),
            RunErrorClass::Unavailable
        );
        assert_eq!(classify_run_error(-32603, None), RunErrorClass::Failed);
        assert_eq!(classify_run_error(-32601, None), RunErrorClass::Unsupported);
        assert_eq!(classify_run_error(-32001, None), RunErrorClass::Unsupported);
        assert_eq!(classify_run_error(-32000, None), RunErrorClass::NotInitialized);
        assert_eq!(classify_run_error(-1002, None), RunErrorClass::Failed);
    }
}
