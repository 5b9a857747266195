//! Host → plugin methods, the v2 `initialize` handshake and `health` (spec §3.3, §3.6).

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Host → plugin method names (spec §3).
pub mod methods {
    /// v2 handshake.
    pub const INITIALIZE: &str = "initialize";
    /// Manifest fetch.
    pub const DESCRIBE: &str = "describe";
    /// Tool call.
    pub const INVOKE: &str = "invoke";
    /// Optional health probe.
    pub const HEALTH: &str = "health";
    /// Reserved graceful shutdown (never relied upon, spec §3.7 HR-SD-02).
    pub const SHUTDOWN: &str = "shutdown";
}

/// The protocol version a v2 host offers and a v2 plugin echoes.
pub const PROTOCOL_V2: &str = "2.0";
/// The v1 protocol version (spec §16 A-52: anything other than "2.0" is v1).
pub const PROTOCOL_V1: &str = "1.1";

/// Negotiated protocol of a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProtocolVersion {
    /// v1.1: forward calls only, no reverse RPC.
    V1,
    /// v2: `initialize` negotiated, reverse RPC available.
    V2,
}

/// `clientInfo` / `serverInfo`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerInfo {
    /// Name.
    #[serde(default)]
    pub name: String,
    /// Version.
    #[serde(default)]
    pub version: String,
}

/// The host's sampling offer in `initialize` (spec §3.3).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SamplingOffer {
    /// Supported modalities.
    pub modalities: Vec<String>,
    /// Largest `maxTokens` per call.
    pub max_tokens_per_call: u32,
    /// Calls per invoke.
    pub max_calls_per_invoke: u32,
    /// Structured-output formats supported.
    pub response_format: Vec<String>,
}

/// `initialize` params as the host sends them: the documented `capabilities` object plus the R-style
/// `host_capabilities` map (spec §3.3 HR-LC-11, §16 A-7).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InitializeParams {
    /// Always "2.0".
    pub protocol_version: String,
    /// Who the host is.
    pub client_info: PeerInfo,
    /// What the host can do for the plugin (`sampling {...}`, `fileTransport`, ...).
    pub capabilities: Map<String, Value>,
    /// The same offer keyed by manifest capability string (`{"llm.sample": true}`).
    #[serde(rename = "host_capabilities", default, skip_serializing_if = "Map::is_empty")]
    pub host_capabilities: Map<String, Value>,
}

/// The plugin's `initialize` answer, accepting every dialect seen in the wild (spec §3.3 HR-LC-12):
/// `server_info` or `serverInfo`, capabilities under `capabilities` and/or `client_capabilities`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct InitializeResult {
    /// The echoed version; anything but "2.0" means v1 (spec §16 A-52).
    #[serde(rename = "protocolVersion", default)]
    pub protocol_version: Option<String>,
    /// `server_info` (documented) or `serverInfo` (every example).
    #[serde(default, alias = "serverInfo")]
    pub server_info: Option<PeerInfo>,
    /// Capabilities the plugin intends to use.
    #[serde(default)]
    pub capabilities: Map<String, Value>,
    /// The same, in the examples' dialect.
    #[serde(default)]
    pub client_capabilities: Map<String, Value>,
    /// Anything else, kept.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl InitializeResult {
    /// The negotiated protocol: v2 only when the plugin echoed "2.0".
    pub fn protocol(&self) -> ProtocolVersion {
        match self.protocol_version.as_deref() {
            Some(PROTOCOL_V2) => ProtocolVersion::V2,
            _ => ProtocolVersion::V1,
        }
    }

    /// The plugin's negotiated capability keys: the union of `capabilities` and `client_capabilities`
    /// (spec §3.3 HR-LC-13), each under its canonical name (`embeddings` is `embed`:
    /// [`keys::ALIASES`](super::capabilities::keys::ALIASES)). A key counts when its value is not `false` or `null`.
    pub fn negotiated(&self) -> BTreeSet<String> {
        self.capabilities
            .iter()
            .chain(self.client_capabilities.iter())
            .filter(|(_, v)| !matches!(v, Value::Bool(false) | Value::Null))
            .map(|(k, _)| super::capabilities::keys::canonical(k).to_owned())
            .collect()
    }
}

/// A `health` answer in any of its shapes (spec §3.6, §16 A-8).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HealthResult {
    /// `ready | error | initializing` (S0), `healthy` (R), `ok` (examples).
    #[serde(default)]
    pub status: Option<String>,
    /// Free text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Anything else.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A session's health as the host sees it (spec §3.6 HR-HE-02).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Health {
    /// `ready`, `healthy`, `ok`, or `health` not implemented (-32601, HR-HE-01).
    Healthy,
    /// `initializing`.
    Starting,
    /// `error`, anything else, or no answer in time.
    Unhealthy,
}

impl HealthResult {
    /// Classifies the status string (spec §3.6 HR-HE-02).
    pub fn classify(&self) -> Health {
        match self.status.as_deref() {
            Some("ready" | "healthy" | "ok") => Health::Healthy,
            Some("initializing") => Health::Starting,
            _ => Health::Unhealthy,
        }
    }
}
