//! What the worker asks of its host (the fleet): the services behind reverse RPC, and the per-invoke tokens.
//!
//! The real implementations (sampling, storage, files, uploads, token minting and budgets) belong to the fleet;
//! the worker only routes, gates and forwards. [`NoServices`] and [`NoTokens`] are the defaults: every known
//! reverse-RPC family answers its spec "not granted" error, and no token is ever minted.

use std::collections::BTreeSet;
use std::fmt;
use std::future::Future;
use std::pin::Pin;

use fleet_proto::executa::capabilities::keys;
use fleet_proto::executa::reverse::{Family, family_of, method_not_found};
use fleet_proto::jsonrpc::ErrorObject;
use fleet_proto::limits;
use serde_json::{Map, Value};

/// The per-invoke tokens the plugin receives in `params.context` (spec §4.1, §11). `Debug` never prints them.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct InvokeTokens {
    /// aud `executa-sampling`.
    pub sampling: Option<String>,
    /// aud `aps-storage`.
    pub storage: Option<String>,
    /// aud `executa-upload`.
    pub upload: Option<String>,
    /// aud `executa-image`.
    pub image: Option<String>,
    /// aud `executa-credentials`.
    pub credentials: Option<String>,
    /// aud `executa-web` (`web/*`; spec §8.9 names no token, so this one stays with the host: it is never put in
    /// the plugin's `params.context`).
    pub web: Option<String>,
    /// When the invoke is still running at this time (Unix ms), the worker asks the token source again and
    /// replaces these tokens (spec §11 HR-JW-02: tokens of long jobs are renewed automatically). `None`: they
    /// outlive the invoke's deadline.
    pub renew_at_ms: Option<u64>,
}

impl fmt::Debug for InvokeTokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let has = |o: &Option<String>| o.is_some();
        f.debug_struct("InvokeTokens")
            .field("sampling", &has(&self.sampling))
            .field("storage", &has(&self.storage))
            .field("upload", &has(&self.upload))
            .field("image", &has(&self.image))
            .field("credentials", &has(&self.credentials))
            .field("web", &has(&self.web))
            .field("renew_at_ms", &self.renew_at_ms)
            .finish()
    }
}

/// Everything a token source needs to decide which tokens an invoke gets (spec §3.3 HR-LC-15: negotiated in
/// `initialize` AND declared in the manifest AND granted to the user).
#[derive(Debug, Clone)]
pub struct TokenRequest {
    /// The user.
    pub user: String,
    /// The plugin.
    pub tool_id: String,
    /// The invoke (= job id for async jobs).
    pub invoke_id: String,
    /// Capability keys the plugin negotiated in `initialize` (empty for v1).
    pub negotiated: BTreeSet<String>,
    /// The manifest's `host_capabilities` (known strings only).
    pub declared: Vec<String>,
    /// The manifest's `credentials[].name`s (spec §8.8: a name an OAuth provider maps makes the host mint a
    /// `credentials_token`).
    pub credentials: Vec<String>,
    /// Absolute deadline of the invoke, Unix epoch ms.
    pub deadline_ms: u64,
}

/// The boxed future a token source returns.
pub type TokenFuture = Pin<Box<dyn Future<Output = InvokeTokens> + Send>>;

/// The user's stored credentials could not be read (the store, the keyring): the invoke does not run. The
/// message names no value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CredentialsUnavailable(pub String);

/// The values a credential source found, by name. Secrets: `Debug` prints the names only.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct CredentialValues(pub Map<String, Value>);

impl fmt::Debug for CredentialValues {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.0.keys()).finish()
    }
}

/// The boxed future a credential lookup returns.
pub type CredentialFuture =
    Pin<Box<dyn Future<Output = Result<CredentialValues, CredentialsUnavailable>> + Send>>;

/// Mints the per-invoke tokens and looks up the user's credentials. Implemented by the fleet (it looks the
/// user's grant and credentials up, which is I/O); the worker withholds, in any case, every token whose
/// capability the plugin did not negotiate, and passes only the credentials the manifest declares.
pub trait TokenSource: Send + Sync + fmt::Debug {
    /// The tokens for one invoke.
    fn tokens(&self, request: TokenRequest) -> TokenFuture;

    /// The stored values of `names` (the manifest's `credentials[].name`) for an invoke of `tool_id` by `user`
    /// (spec §4.2): a name with no stored value is absent (the worker applies the manifest's default and
    /// `required`). Called only for plugins that declare credentials. A store that does not answer for a while (a
    /// NATS node lost) is waited for until `deadline_ms`, the invoke's deadline (ms since the epoch), not past
    /// it. The default stores nothing.
    fn credentials(&self, user: &str, tool_id: &str, names: &[String], deadline_ms: u64) -> CredentialFuture {
        let _ = (user, tool_id, names, deadline_ms);
        Box::pin(async { Ok(CredentialValues::default()) })
    }

    /// The front's delegation for the agent-session tool calls of `invoke_id` (sync invokes whose exec request
    /// carried one), given before its tokens are minted; forgotten at
    /// [`HostServices::invoke_finished`]. The plugin never sees it. The default ignores it.
    fn delegate(&self, invoke_id: &str, delegation: fleet_proto::api::delegation::DelegationToken) {
        let _ = (invoke_id, delegation);
    }

    /// The manifest recorded for `tool_id` ([`Recorded`]). The default keeps no record.
    fn recorded_manifest(&self, tool_id: &str) -> RecordedFuture {
        let _ = tool_id;
        Box::pin(async { Recorded::Unrestricted })
    }
}

/// What the fleet recorded of a plugin's manifest when its version was published or catalogued (the manifest
/// `tools.list` and `fleet plugins describe` show): what a session of a real user may use, whatever the plugin
/// declares at run time (`session/pin.rs`).
#[derive(Debug, Clone, PartialEq)]
pub enum Recorded {
    /// No record is kept (a worker outside a fleet): the runtime manifest stands.
    Unrestricted,
    /// The recorded manifest.
    Manifest(Box<fleet_proto::executa::manifest::Manifest>),
    /// A fleet that keeps records has none for the tool (not described yet) or could not read it in time: the
    /// plugin gets no credential and no host capability.
    Missing,
}

/// The boxed future a recorded-manifest lookup returns.
pub type RecordedFuture = Pin<Box<dyn Future<Output = Recorded> + Send>>;

/// No tokens, ever.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoTokens;

impl TokenSource for NoTokens {
    fn tokens(&self, _: TokenRequest) -> TokenFuture {
        Box::pin(async { InvokeTokens::default() })
    }
}

/// One reverse-RPC call, routed to its parent invoke and gated (negotiated + declared) by the worker.
#[derive(Debug, Clone)]
pub struct ReverseCall {
    /// The user the parent invoke runs for.
    pub user: String,
    /// The plugin.
    pub tool_id: String,
    /// The parent invoke.
    pub invoke_id: String,
    /// The tool (method) of the parent invoke.
    pub tool: String,
    /// The method, e.g. `storage/get`.
    pub method: String,
    /// Its family.
    pub family: Family,
    /// The params with `context` and `_clientTimeoutS` stripped (spec §7 HR-RC-08).
    pub params: Value,
    /// `_clientTimeoutS` as sent by the SDK, if any (spec §7.3).
    pub client_timeout_s: Option<f64>,
    /// The parent invoke's absolute deadline, Unix epoch ms.
    pub deadline_ms: u64,
    /// The parent invoke's tokens (for the service to verify and present upstream). Never logged.
    pub tokens: InvokeTokens,
}

/// The boxed future a service returns.
pub type ServiceFuture = Pin<Box<dyn Future<Output = Result<Value, ErrorObject>> + Send>>;

/// The host services behind reverse RPC (sampling, storage, files, uploads, ...), implemented by the fleet.
/// The worker has already applied the routing rules of spec §7.2 and the negotiation and manifest gates; a
/// service still checks its token and the user's grant, and answers with the family's codes.
pub trait HostServices: Send + Sync + fmt::Debug {
    /// Serves one call. The future is dropped if the parent invoke ends first (spec §7.3 HR-DL-03).
    fn call(&self, call: ReverseCall) -> ServiceFuture;

    /// The `capabilities` the host offers in `initialize` (spec §3.3): only what it can serve. The default is
    /// sampling (with its caps) and file transport.
    fn offer(&self) -> Map<String, Value> {
        default_offer()
    }

    /// The parent invoke has ended (success, failure, timeout, cancel): drop its tokens' state and budgets
    /// (spec §11 HR-JW-01). Called once per invoke, after its last reverse call was abandoned.
    fn invoke_finished(&self, _invoke_id: &str) {}
}

/// The `initialize` capabilities offered by [`NoServices`] and by default: sampling and file transport.
pub fn default_offer() -> Map<String, Value> {
    let mut offer = Map::new();
    offer.insert(keys::SAMPLING.into(), sampling_offer());
    offer.insert(keys::FILE_TRANSPORT.into(), Value::Bool(true));
    offer
}

/// The `sampling` capability object with the host's caps (spec §3.3, §8.1).
pub fn sampling_offer() -> Value {
    serde_json::json!({
        "modalities": ["text"],
        "maxTokensPerCall": limits::SAMPLING_MAX_TOKENS_PER_CALL,
        "maxCallsPerInvoke": limits::SAMPLING_MAX_CALLS_PER_INVOKE,
        "responseFormat": ["json_object", "json_schema"],
    })
}

/// No services: every known family answers its "not granted" error, anything else -32601.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoServices;

impl HostServices for NoServices {
    fn call(&self, call: ReverseCall) -> ServiceFuture {
        let error = match family_of(&call.method) {
            Some(family) => family
                .not_granted()
                .error(format!("{} is not available on this host", call.method)),
            None => method_not_found(&call.method),
        };
        Box::pin(async move { Err(error) })
    }
}
