//! `invoke`: params with the per-invoke context, the plugin's `InvokeResult`, and `executa/progress`
//! (spec §4, §8.10).

use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The progress notification method (plugin → host, spec §8.10).
pub const PROGRESS_METHOD: &str = "executa/progress";

/// `invoke` params (spec §3.5, §4.1): `tool`, not `name`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InvokeParams {
    /// The tool to run: a `tools[].name` of the manifest.
    pub tool: String,
    /// The tool's arguments.
    #[serde(default)]
    pub arguments: Map<String, Value>,
    /// The per-invoke context (v2; v1 plugins ignore it).
    #[serde(default)]
    pub context: InvokeContext,
    /// The clamped app-facing timeout in ms, forwarded as `params.timeout` (spec §10.3 HR-SI-02).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<u64>,
    /// `invoke_id` mirrored at the top level for R-style readers (spec §4.1 HR-IV-03, §16 A-12).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub invoke_id: Option<String>,
}

/// `params.context` (spec §4.1). Unknown keys are preserved. Its `Debug` output redacts tokens and
/// credential values, so it can never leak them into logs (spec §4.2 HR-CR-03).
#[derive(Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct InvokeContext {
    /// Correlation id; for async jobs equal to the job id (spec §4.1 HR-IV-02).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub invoke_id: Option<String>,
    /// Absolute deadline, Unix epoch ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_ms: Option<u64>,
    /// `{NAME: value}` for the credentials the manifest declares and the user configured (spec §4.2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials: Option<Map<String, Value>>,
    /// JWT, aud `executa-sampling`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampling_token: Option<String>,
    /// JWT, aud `aps-storage`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_token: Option<String>,
    /// JWT, aud `executa-upload`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upload_token: Option<String>,
    /// JWT, aud `executa-image`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_token: Option<String>,
    /// JWT, aud `executa-credentials`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_token: Option<String>,
    /// The plugin's display name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plugin_name: Option<String>,
    /// Other keys (e.g. W3C `traceparent`), preserved.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl fmt::Debug for InvokeContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let redact = |o: &Option<String>| o.as_ref().map(|_| "<redacted>");
        f.debug_struct("InvokeContext")
            .field("invoke_id", &self.invoke_id)
            .field("deadline_ms", &self.deadline_ms)
            .field(
                "credentials",
                &self.credentials.as_ref().map(|m| m.keys().collect::<Vec<_>>()),
            )
            .field("sampling_token", &redact(&self.sampling_token))
            .field("storage_token", &redact(&self.storage_token))
            .field("upload_token", &redact(&self.upload_token))
            .field("image_token", &redact(&self.image_token))
            .field("credentials_token", &redact(&self.credentials_token))
            .field("plugin_name", &self.plugin_name)
            .field("extra", &self.extra.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// The plugin's `invoke` result `{success, data, error, duration_ms}` (spec §4.4). A missing `success` is
/// `false` (HR-RD-02). `D` is the type of `data` (e.g. `Box<RawValue>` to forward it unparsed).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(bound(deserialize = "D: Deserialize<'de>", serialize = "D: Serialize"))]
pub struct InvokeResult<D = Value> {
    /// Must be `true` explicitly for success.
    #[serde(default)]
    pub success: bool,
    /// The payload the caller sees.
    #[serde(default = "Option::default", skip_serializing_if = "Option::is_none")]
    pub data: Option<D>,
    /// The failure, usually a string.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<Value>,
    /// Plugin-measured duration (the host measures its own too).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<serde_json::Number>,
    /// Echo of the tool name (R).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
}

impl<D> InvokeResult<D> {
    /// A short message for a failed result: the `error` string, or its JSON.
    pub fn error_message(&self) -> String {
        match &self.error {
            Some(Value::String(s)) => s.clone(),
            Some(v) => v.to_string(),
            None if self.success => String::new(),
            None => "the plugin returned success: false without an error".into(),
        }
    }
}

/// `executa/progress` event types (spec §8.10 HR-PG-03).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProgressType {
    /// Plain progress.
    Progress,
    /// A tool update.
    ToolUpdate,
}

impl ProgressType {
    /// Any type other than `tool_update` is coerced to `progress`, so terminal states can't be faked.
    pub fn coerce(s: Option<&str>) -> ProgressType {
        match s {
            Some("tool_update") => ProgressType::ToolUpdate,
            _ => ProgressType::Progress,
        }
    }

    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            ProgressType::Progress => "progress",
            ProgressType::ToolUpdate => "tool_update",
        }
    }
}

/// `executa/progress` params as the plugin sends them (spec §8.10). `type` is kept raw so the host can coerce it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProgressParams {
    /// `progress` | `tool_update` | anything (coerced).
    #[serde(rename = "type", default)]
    pub kind: Option<Value>,
    /// The event payload.
    #[serde(default)]
    pub data: Value,
    /// Correlation: `context.invoke_id`.
    #[serde(default)]
    pub context: Option<ReverseContext>,
}

impl ProgressParams {
    /// The coerced event type.
    pub fn progress_type(&self) -> ProgressType {
        ProgressType::coerce(self.kind.as_ref().and_then(Value::as_str))
    }
}

/// The `context` a plugin echoes in reverse RPCs and progress (spec §7.2). Other keys are ignored.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReverseContext {
    /// The parent invoke's `invoke_id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub invoke_id: Option<String>,
}
