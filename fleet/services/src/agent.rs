//! Agent sessions run by the fleet itself: `agent/complete` and `agent/session.*` (spec §8.2) over the `[llm]`
//! upstream's chat completions, with tool calling whose tools are the user's own fleet tools.
//!
//! * **`agent/complete`** is one sampling call (`messages` non-empty, `maxTokens` optional: default
//!   [`limits::AGENT_COMPLETE_DEFAULT_MAX_TOKENS`]); content may be a string or `{type: "text", text}`; the answer
//!   is MCP-shaped. It needs `llm.sample` only; no session is kept (the spec's throw-away session has nothing to
//!   keep here).
//! * **Sessions** (`agent/session.create` / `.run` / `.cancel` / `.history` / `.delete` / `.list` / `.refresh`)
//!   need `llm.agent.auto` declared and granted (else `-32041`). A session lives in JetStream KV ([`store`]), so
//!   any worker serves it and a worker restart forgets nothing, keyed by (user, plugin, uuid) — another user's or
//!   plugin's uuid is `-32042` like an unknown one (HR-AG-02) — for `ttl_seconds` after its last use (default
//!   600, at most 7 200) and never more than 24 h after its creation; a user keeps at most
//!   [`AgentConfig::max_sessions`], least recently used evicted first.
//! * **A run** is an agent loop: each step is one chat completion (counted on the invoke's sampling budget,
//!   spec §7.4: 8 calls, 32 000 tokens per invoke; exhausted → `-32045`), at most `recursion_limit` steps
//!   (default 8, 1..=32). The upstream is offered the user's fleet tools as OpenAI `tools`; each `tool_calls`
//!   entry is a real `tools.invoke` as that user, through the front with the invoke's delegation
//!   (`fleet::delegation`): its own invoke, its own budget, never past the parent's deadline. The events are
//!   buffered into `frames[]` — `delta` (assistant text), `tool_call`, `tool_result`, `final`, and `run_meta`
//!   for warnings (`NO_TOOLS_AVAILABLE`) — each with `seq` (0, 1, …) and `stream_id`; more than 4 096 frames
//!   abort the run with `-32045` (`data.errorCode: "AGENT_RUN_TOO_LARGE"`, spec §16 A-17).
//! * **Tools offered**: the session's `granted_tools` (`quota_caps.allowed_tools`, default `["*"]`), narrowed by
//!   the run's `allowed_tools` (`[]`: none; a name outside the session's set is `-32048`). Names match a tool id
//!   (`echo-py`), a tool (`echo-py.echo`) or `*`. The plugin's own tools are never offered (the front refuses a
//!   plugin calling itself) and a tool call made from inside a delegated invoke is one level deeper (capped).
//! * Server-side limits surface as `-32046` with `data.status: 422` (HR-AG-03: `ttl_seconds`, `recursion_limit`,
//!   `label`, `system_prompt`, more than 128 `quota_caps.allowed_tools`); malformed params are `-32043`; a second
//!   run on a session while one is running — on any worker: the run holds a lease in KV — is `-32047`; upstream
//!   429 `-32047`, 402 / quota `-32045`, other failures and timeouts `-32046`; the session store failing `-32046`.
//! * **Cancel** (`agent/session.cancel`, from any worker) sets the run lease's cancel flag; the running worker
//!   reads its lease before every step, so the run stops at its next step (`stopReason: "cancelled"`).
//!
//! Prompts, tool arguments and results, upstream bodies and the delegation are never logged.

pub mod store;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use fleet_proto::api::delegation::{self, DelegatedCall, DelegationToken};
use fleet_proto::api::{ApiResponse, methods as api_methods};
use fleet_proto::executa::reverse::{RpcCode, agent as codes, method_not_found, sampling as sampling_codes};
use fleet_proto::jsonrpc::ErrorObject;
use fleet_proto::limits;
use fleet_proto::util::now_ms;
use serde_json::{Map, Value, json};

use self::store::{Owner, RunLease, SessionError, SessionRecord, SessionStore};
use crate::CallContext;
use crate::llm::{LlmService, StepError, UpstreamError};

/// The capability that unlocks sessions (spec §8.2 L2).
pub const LLM_AGENT_AUTO: &str = "llm.agent.auto";

/// Prefix of session uuids (spec §8.2: "must start `aps_`").
pub const SESSION_PREFIX: &str = "aps_";

/// Configuration (`[agent]` of the services configuration).
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    /// Sessions kept per user, all plugins together (least recently used evicted first; 1 to
    /// [`limits::AGENT_SESSION_CACHE_MAX`], the default).
    #[serde(default = "default_max_sessions")]
    pub max_sessions: usize,
}

fn default_max_sessions() -> usize {
    limits::AGENT_SESSION_CACHE_MAX
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            max_sessions: default_max_sessions(),
        }
    }
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The agent family's service (one per worker process; the sessions are in [`SessionStore`]).
#[derive(Debug)]
pub struct AgentService {
    store: SessionStore,
    /// Where delegated tool calls go; `None`: sessions run without tools.
    client: Option<async_nats::Client>,
}

/// How a session call failed: the plugin's error, or the store's.
enum Failed {
    Plugin(ErrorObject),
    Session(SessionError),
}

impl From<ErrorObject> for Failed {
    fn from(e: ErrorObject) -> Self {
        Failed::Plugin(e)
    }
}

impl From<SessionError> for Failed {
    fn from(e: SessionError) -> Self {
        Failed::Session(e)
    }
}

/// The plugin's error for a session store failure (never the plugin's bytes).
fn session_error(ctx: &CallContext, e: SessionError) -> ErrorObject {
    match e {
        SessionError::NotFound => not_found(),
        SessionError::Busy => codes::AGENT_RATE_LIMITED.error("a run of this session is already in progress"),
        SessionError::Refused(e) => *e,
        SessionError::Store(e) => {
            tracing::warn!(invoke_id = %ctx.invoke_id, error = %e, "agent session store failed");
            codes::AGENT_PROVIDER_ERROR.error("the agent session store is unavailable")
        }
    }
}

fn invalid(message: impl Into<String>) -> ErrorObject {
    codes::AGENT_INVALID_REQUEST.error(message)
}

/// A server-side validation failure: `-32046` with `data.status: 422` (spec §8.2 HR-AG-03).
fn unprocessable(message: impl Into<String>) -> ErrorObject {
    codes::AGENT_PROVIDER_ERROR.error_with(message, Map::from_iter([("status".to_owned(), json!(422))]))
}

fn not_found() -> ErrorObject {
    codes::AGENT_SESSION_NOT_FOUND
        .error("no such session for this user and plugin (unknown, expired or deleted)")
}

fn step_error(e: &StepError) -> ErrorObject {
    match e {
        StepError::Budget(b) => codes::AGENT_QUOTA_EXCEEDED.error(b.to_string()),
        StepError::Upstream(u) => upstream_error(u),
        StepError::Daily(d) => d.error(codes::AGENT_QUOTA_EXCEEDED, codes::AGENT_PROVIDER_ERROR),
    }
}

fn upstream_error(u: &UpstreamError) -> ErrorObject {
    let code = if u.is_throttled() {
        codes::AGENT_RATE_LIMITED
    } else if u.is_quota() {
        codes::AGENT_QUOTA_EXCEEDED
    } else {
        codes::AGENT_PROVIDER_ERROR
    };
    code.error_with(format!("the LLM provider failed: {u}"), u.data())
}

/// The agent code of a sampling error (`agent/complete` reuses sampling's validation and upstream call).
fn from_sampling(e: ErrorObject) -> ErrorObject {
    let name = e.error_code().unwrap_or_default().to_owned();
    let code: RpcCode = match name.as_str() {
        n if n == sampling_codes::SAMPLING_INVALID_REQUEST.name
            || n == sampling_codes::SAMPLING_UNSUPPORTED_RESPONSE_FORMAT.name =>
        {
            codes::AGENT_INVALID_REQUEST
        }
        n if n == sampling_codes::SAMPLING_MAX_CALLS_EXCEEDED.name
            || n == sampling_codes::SAMPLING_MAX_TOKENS_EXCEEDED.name
            || n == sampling_codes::SAMPLING_QUOTA_EXCEEDED.name =>
        {
            codes::AGENT_QUOTA_EXCEEDED
        }
        _ => codes::AGENT_PROVIDER_ERROR,
    };
    let mut data = match e.data {
        Some(Value::Object(m)) => m,
        _ => Map::new(),
    };
    data.remove("errorCode");
    data.insert("samplingErrorCode".into(), Value::from(name));
    code.error_with(e.message, data)
}

fn str_param<'a>(p: &'a Value, key: &str) -> Result<Option<&'a str>, ErrorObject> {
    match p.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(invalid(format!("{key} must be a string"))),
    }
}

fn uuid_param(p: &Value) -> Result<&str, ErrorObject> {
    match str_param(p, "app_session_uuid")? {
        // No session has such a uuid (and it could not name a key).
        Some(u) if u.starts_with(SESSION_PREFIX) && !store::valid_uuid(u) => Err(not_found()),
        Some(u) if u.starts_with(SESSION_PREFIX) && u.len() > SESSION_PREFIX.len() => Ok(u),
        _ => Err(invalid("app_session_uuid must be a session id (aps_…)")),
    }
}

/// `ttl_seconds`: default 600, `0 < ttl ≤ 7200` (out of range: HR-AG-03).
fn ttl_param(p: &Value) -> Result<Duration, ErrorObject> {
    match p.get("ttl_seconds") {
        None | Some(Value::Null) => Ok(limits::AGENT_SESSION_DEFAULT_TTL),
        Some(v) => {
            let n = v
                .as_f64()
                .filter(|n| n.is_finite())
                .ok_or_else(|| invalid("ttl_seconds must be a number"))?;
            let max = limits::AGENT_SESSION_MAX_TTL.as_secs_f64();
            if n <= 0.0 || n > max {
                return Err(unprocessable(format!(
                    "ttl_seconds must be in (0, {}]",
                    limits::AGENT_SESSION_MAX_TTL.as_secs()
                )));
            }
            Ok(Duration::from_secs_f64(n))
        }
    }
}

fn limit_param(p: &Value, default: u64) -> Result<usize, ErrorObject> {
    match p.get("limit") {
        None | Some(Value::Null) => Ok(usize::try_from(default).unwrap_or(usize::MAX)),
        Some(v) => match v.as_u64() {
            Some(n) if (1..=limits::AGENT_HISTORY_MAX_LIMIT).contains(&n) => {
                Ok(usize::try_from(n).unwrap_or(usize::MAX))
            }
            _ => Err(invalid(format!(
                "limit must be an integer in 1..={}",
                limits::AGENT_HISTORY_MAX_LIMIT
            ))),
        },
    }
}

fn string_list(v: &Value, key: &str) -> Result<Vec<String>, ErrorObject> {
    v.as_array()
        .ok_or_else(|| invalid(format!("{key} must be an array of strings")))?
        .iter()
        .map(|t| match t.as_str() {
            Some(s) if !s.trim().is_empty() => Ok(s.to_owned()),
            _ => Err(invalid(format!("{key} must be an array of non-empty strings"))),
        })
        .collect()
}

fn random_hex(bytes: usize) -> String {
    let mut b = vec![0_u8; bytes];
    rand::RngCore::fill_bytes(&mut rand::rng(), &mut b);
    hex::encode(b)
}

use fleet_proto::admin::grants::tool_pattern_covers as covers;

/// Whether every tool `narrow` covers is covered by `wide`: `*` only under `*`, a tool id under `*` or itself,
/// a tool under `*`, its tool id or itself.
fn within(narrow: &str, wide: &[String]) -> bool {
    wide.iter()
        .any(|w| w == "*" || w == narrow || narrow.split_once('.').is_some_and(|(id, _)| id == w))
}

/// The OpenAI function name of a fleet tool: `^[a-zA-Z0-9_-]{1,64}$`.
fn function_name(tool_id: &str, tool: &str) -> String {
    let raw = format!("{tool_id}__{tool}");
    raw.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .take(limits::AGENT_TOOL_NAME_MAX_CHARS)
        .collect()
}

/// One tool offered to the upstream.
#[derive(Debug, Clone)]
struct Offered {
    tool_id: String,
    tool: String,
}

/// The frames of one run, capped at [`limits::AGENT_MAX_FRAMES`].
struct Frames {
    stream_id: String,
    frames: Vec<Value>,
}

impl Frames {
    fn push(&mut self, mut frame: Map<String, Value>) -> Result<(), ErrorObject> {
        if self.frames.len() >= limits::AGENT_MAX_FRAMES {
            return Err(codes::AGENT_QUOTA_EXCEEDED.error_with(
                format!("the run produced more than {} frames", limits::AGENT_MAX_FRAMES),
                Map::from_iter([
                    ("errorCode".to_owned(), json!("AGENT_RUN_TOO_LARGE")),
                    ("maxFrames".to_owned(), json!(limits::AGENT_MAX_FRAMES)),
                ]),
            ));
        }
        frame.insert("seq".into(), json!(self.frames.len()));
        frame.insert("stream_id".into(), json!(self.stream_id));
        self.frames.push(Value::Object(frame));
        Ok(())
    }

    fn event(&mut self, event: &str, fields: Value) -> Result<(), ErrorObject> {
        let mut m = match fields {
            Value::Object(m) => m,
            _ => Map::new(),
        };
        m.insert("event".into(), json!(event));
        self.push(m)
    }
}

/// What a run needs that is not the session.
struct RunPlan {
    run_id: String,
    content: Value,
    recursion_limit: u32,
    hints: Vec<String>,
    system: Option<String>,
    /// `None`: the session's tools.
    allowed: Option<Vec<String>>,
}

/// A run's lease: renewed in the background while the run goes on, given back when it ends, however it ends.
struct Leased {
    store: SessionStore,
    owner: Owner,
    uuid: String,
    holder: String,
    renewal: tokio::task::JoinHandle<()>,
    released: bool,
}

impl Leased {
    /// Gives the lease back now.
    async fn release(mut self) {
        self.renewal.abort();
        self.store.release(&self.owner, &self.uuid, &self.holder).await;
        self.released = true;
    }
}

impl Drop for Leased {
    fn drop(&mut self) {
        self.renewal.abort();
        if self.released {
            return;
        }
        let (store, owner, uuid, holder) = (
            self.store.clone(),
            self.owner.clone(),
            std::mem::take(&mut self.uuid),
            std::mem::take(&mut self.holder),
        );
        // Dropped inside the runtime (the run's future); the lease lapses by itself otherwise.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move { store.release(&owner, &uuid, &holder).await });
        }
    }
}

impl AgentService {
    /// The service over `store`; `client` reaches the fronts for delegated tool calls (`None`: sessions have no
    /// tools).
    pub fn new(store: SessionStore, client: Option<async_nats::Client>) -> AgentService {
        AgentService { store, client }
    }

    /// The sessions' store.
    pub fn store(&self) -> &SessionStore {
        &self.store
    }

    /// Live sessions `user` keeps now, every plugin.
    pub async fn sessions_of(&self, user: &str) -> Result<usize, SessionError> {
        self.store.count(user).await
    }

    /// Serves one `agent/*` call. `delegation` is the invoke's (sync invokes dispatched by a front).
    pub async fn call(
        &self,
        ctx: &CallContext,
        llm: &LlmService,
        method: &str,
        params: &Value,
        delegation: Option<&DelegationToken>,
    ) -> Result<Value, ErrorObject> {
        let Some(sub) = method.strip_prefix("agent/") else {
            return Err(method_not_found(method));
        };
        if sub == "complete" {
            return self.complete(ctx, llm, params).await;
        }
        if !sub.starts_with("session.") {
            return Err(method_not_found(method));
        }
        if !ctx.granted(LLM_AGENT_AUTO) {
            return Err(codes::AGENT_NOT_GRANTED.error(
                "agent sessions need llm.agent.auto declared in the manifest and granted to the user",
            ));
        }
        if !params.is_object() && !params.is_null() {
            return Err(invalid("params must be an object"));
        }
        let result = match sub {
            "session.create" => self.create(ctx, params).await,
            "session.run" => self.run(ctx, llm, params, delegation).await,
            "session.cancel" => self.cancel(ctx, params).await,
            "session.history" => self.history(ctx, params).await,
            "session.delete" => self.delete(ctx, params).await,
            "session.list" => self.list(ctx, params).await,
            "session.refresh" => self.refresh(ctx, params).await,
            _ => return Err(method_not_found(method)),
        };
        result.map_err(|e| match e {
            Failed::Plugin(e) => e,
            Failed::Session(e) => session_error(ctx, e),
        })
    }

    async fn complete(
        &self,
        ctx: &CallContext,
        llm: &LlmService,
        params: &Value,
    ) -> Result<Value, ErrorObject> {
        let Some(p) = params.as_object() else {
            return Err(invalid("params must be an object"));
        };
        let mut p = p.clone();
        // String content becomes `{type: "text", text}`; the rest is sampling's validation.
        if let Some(Value::Array(messages)) = p.get_mut("messages") {
            for m in messages.iter_mut() {
                if let Some(c @ Value::String(_)) = m.get_mut("content") {
                    *c = json!({"type": "text", "text": c.as_str().unwrap_or_default()});
                }
            }
        }
        p.entry("maxTokens")
            .or_insert_with(|| json!(limits::AGENT_COMPLETE_DEFAULT_MAX_TOKENS));
        let mut result = llm.sample(ctx, &Value::Object(p)).await.map_err(from_sampling)?;
        if let Some(m) = result.as_object_mut() {
            m.remove("_meta");
        }
        Ok(result)
    }

    fn owner(ctx: &CallContext) -> Owner {
        Owner::new(&ctx.user, &ctx.tool_id)
    }

    async fn create(&self, ctx: &CallContext, p: &Value) -> Result<Value, Failed> {
        let session = Self::new_session(ctx, p)?;
        self.store.create(&Self::owner(ctx), &session).await?;
        Ok(session.describe(session.created_ms))
    }

    /// The session `agent/session.create` asks for, validated.
    fn new_session(ctx: &CallContext, p: &Value) -> Result<SessionRecord, ErrorObject> {
        let kind = str_param(p, "kind")?;
        let submode = str_param(p, "agent_submode")?;
        if let Some(k) = kind
            && k != "agent"
            && k != "fixed"
        {
            return Err(invalid("kind must be \"agent\" or \"fixed\""));
        }
        if let Some(s) = submode
            && s != "auto"
            && s != "fixed"
        {
            return Err(invalid("agent_submode must be \"auto\" or \"fixed\""));
        }
        if kind == Some("fixed") && submode == Some("auto") {
            return Err(codes::AGENT_SUBMODE_MISMATCH.error("kind \"fixed\" with agent_submode \"auto\""));
        }
        if kind == Some("fixed") || submode == Some("fixed") {
            return match str_param(p, "fixed_client_id")? {
                Some(id) if !id.trim().is_empty() => Err(codes::AGENT_NOT_GRANTED
                    .error("no fixed clients are allowed on this host (llm_grant.agent.allowed_fixed_client_ids is empty)")),
                _ => Err(invalid("a fixed session needs fixed_client_id")),
            };
        }
        let label = match str_param(p, "label")? {
            Some(l) if l.chars().count() > limits::AGENT_LABEL_MAX_CHARS => {
                return Err(unprocessable(format!(
                    "label must be at most {} characters",
                    limits::AGENT_LABEL_MAX_CHARS
                )));
            }
            Some(l) => l.to_owned(),
            None => ctx.tool_id.clone(),
        };
        let system_prompt = match str_param(p, "system_prompt")? {
            Some(s) if s.chars().count() > limits::AGENT_SYSTEM_PROMPT_MAX_CHARS => {
                return Err(unprocessable(format!(
                    "system_prompt must be at most {} characters",
                    limits::AGENT_SYSTEM_PROMPT_MAX_CHARS
                )));
            }
            other => other.map(str::to_owned),
        };
        let ttl = ttl_param(p)?;
        let (inherit_host_tools, granted_tools) = match p.get("quota_caps") {
            None | Some(Value::Null) => (true, vec!["*".to_owned()]),
            Some(Value::Object(caps)) => {
                let inherit = match caps.get("inherit_host_tools") {
                    None | Some(Value::Null) => true,
                    Some(Value::Bool(b)) => *b,
                    Some(_) => return Err(invalid("quota_caps.inherit_host_tools must be a boolean")),
                };
                let listed = caps
                    .get("allowed_tools")
                    .or_else(|| caps.get("granted_tools"))
                    .filter(|v| !v.is_null())
                    .map(|v| string_list(v, "quota_caps.allowed_tools"))
                    .transpose()?;
                match (inherit, listed) {
                    (_, Some(list)) => (inherit, list),
                    (true, None) => (true, vec!["*".to_owned()]),
                    (false, None) => (false, Vec::new()),
                }
            }
            Some(_) => return Err(invalid("quota_caps must be an object")),
        };
        if granted_tools.len() > limits::AGENT_MAX_TOOLS
            || granted_tools
                .iter()
                .any(|t| t.len() > limits::AGENT_TOOL_PATTERN_MAX_BYTES)
        {
            return Err(unprocessable(format!(
                "quota_caps.allowed_tools must list at most {} tools of at most {} bytes",
                limits::AGENT_MAX_TOOLS,
                limits::AGENT_TOOL_PATTERN_MAX_BYTES
            )));
        }
        let now = now_ms();
        let uuid = format!("{SESSION_PREFIX}{}", random_hex(16));
        let session = SessionRecord {
            uuid,
            thread_id: format!("thread_{}", random_hex(8)),
            label,
            system_prompt,
            inherit_host_tools,
            granted_tools,
            ttl_ms: ms(ttl),
            created_ms: now,
            last_active_ms: now,
            messages: Vec::new(),
        };
        Ok(session)
    }

    fn parse_run(p: &Value) -> Result<RunPlan, ErrorObject> {
        let content = match p.get("content") {
            Some(Value::String(s)) if !s.trim().is_empty() => s.clone(),
            _ => return Err(invalid("content must be a non-empty string")),
        };
        let attachments = match p.get("attachments") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) if a.len() <= limits::AGENT_MAX_ATTACHMENTS => a.clone(),
            Some(Value::Array(_)) => {
                return Err(invalid(format!(
                    "at most {} attachments",
                    limits::AGENT_MAX_ATTACHMENTS
                )));
            }
            Some(_) => return Err(invalid("attachments must be an array")),
        };
        for (i, a) in attachments.iter().enumerate() {
            let bytes = attachment_bytes(a);
            if bytes > limits::AGENT_MAX_ATTACHMENT_BYTES {
                return Err(invalid(format!(
                    "attachments[{i}] is {bytes} bytes: at most {} per attachment",
                    limits::AGENT_MAX_ATTACHMENT_BYTES
                )));
            }
        }
        let recursion_limit = match p.get("recursion_limit") {
            None | Some(Value::Null) => limits::AGENT_DEFAULT_RECURSION_LIMIT,
            Some(v) => {
                let n = v
                    .as_i64()
                    .ok_or_else(|| invalid("recursion_limit must be an integer"))?;
                match u32::try_from(n) {
                    Ok(n) if (1..=limits::AGENT_MAX_RECURSION_LIMIT).contains(&n) => n,
                    _ => {
                        return Err(unprocessable(format!(
                            "recursion_limit must be in 1..={}",
                            limits::AGENT_MAX_RECURSION_LIMIT
                        )));
                    }
                }
            }
        };
        let run_id = match str_param(p, "run_id")? {
            Some(r) if !r.trim().is_empty() => r.to_owned(),
            Some(_) => return Err(invalid("run_id must not be empty")),
            None => format!("run_{}", random_hex(8)),
        };
        let allowed = match p.get("allowed_tools") {
            None | Some(Value::Null) => None,
            Some(v) => Some(string_list(v, "allowed_tools")?),
        };
        let prefs = p.get("modelPreferences").or_else(|| p.get("model_preferences"));
        let hints = prefs
            .and_then(|m| m.get("hints"))
            .and_then(Value::as_array)
            .map(|h| {
                h.iter()
                    .filter_map(|h| h.get("name").and_then(Value::as_str).map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        let system = match (str_param(p, "systemPrompt")?, str_param(p, "system")?) {
            (Some(s), _) | (None, Some(s)) => Some(s.to_owned()),
            (None, None) => None,
        };
        // Image attachments with a URL become image parts; others are dropped (nothing to show the model).
        let images: Vec<Value> = attachments
            .iter()
            .filter_map(|a| a.get("url").and_then(Value::as_str))
            .map(|u| json!({"type": "image_url", "image_url": {"url": u}}))
            .collect();
        let content = if images.is_empty() {
            Value::String(content)
        } else {
            let mut parts = vec![json!({"type": "text", "text": content})];
            parts.extend(images);
            Value::Array(parts)
        };
        Ok(RunPlan {
            run_id,
            content,
            recursion_limit,
            hints,
            system,
            allowed,
        })
    }

    async fn run(
        &self,
        ctx: &CallContext,
        llm: &LlmService,
        p: &Value,
        delegation: Option<&DelegationToken>,
    ) -> Result<Value, Failed> {
        let uuid = uuid_param(p)?.to_owned();
        let plan = Self::parse_run(p)?;
        let owner = Self::owner(ctx);
        let (history, system, granted, allowed) = self
            .store
            .edit(&owner, &uuid, true, |s| {
                let allowed = plan.allowed.clone().unwrap_or_else(|| s.granted_tools.clone());
                if let Some(bad) = allowed.iter().find(|t| !within(t, &s.granted_tools)) {
                    return Err(SessionError::Refused(Box::new(
                        codes::AGENT_TOOL_NOT_GRANTED.error_with(
                            "allowed_tools names a tool the session was not granted",
                            Map::from_iter([("tool".to_owned(), json!(bad))]),
                        ),
                    )));
                }
                Ok((
                    s.messages.clone(),
                    plan.system.clone().or_else(|| s.system_prompt.clone()),
                    s.granted_tools.clone(),
                    allowed,
                ))
            })
            .await?;
        // One run of a session at a time, whichever worker runs it.
        let holder = random_hex(16);
        let lease = RunLease {
            run_id: plan.run_id.clone(),
            holder: holder.clone(),
            until_ms: now_ms().saturating_add(ms(store::RUN_LEASE_TTL)),
            cancel: false,
        };
        self.store.acquire(&owner, &uuid, &lease).await?;
        let cancelled = Arc::new(AtomicBool::new(false));
        let renewal = tokio::spawn({
            let (store, owner, uuid, holder) =
                (self.store.clone(), owner.clone(), uuid.clone(), holder.clone());
            let cancelled = cancelled.clone();
            async move {
                let mut every = tokio::time::interval(store::RUN_LEASE_RENEW);
                every.tick().await;
                loop {
                    every.tick().await;
                    match store.renew(&owner, &uuid, &holder).await {
                        Ok(Some(cancel)) => {
                            if cancel {
                                cancelled.store(true, Ordering::SeqCst);
                            }
                        }
                        Ok(None) => return,
                        Err(e) => tracing::warn!(error = %e, "cannot renew an agent run lease"),
                    }
                }
            }
        });
        let leased = Leased {
            store: self.store.clone(),
            owner: owner.clone(),
            uuid: uuid.clone(),
            holder: holder.clone(),
            renewal,
            released: false,
        };
        let outcome: Result<Value, Failed> = async move {
        let mut frames = Frames {
            stream_id: format!("stream_{}", random_hex(8)),
            frames: Vec::new(),
        };
        // The tools: the session's grant ∩ the run's allowed set, from the user's fleet tools.
        let want_tools = !allowed.is_empty() && !granted.is_empty();
        let (offered, tools_json) = if want_tools {
            match self.list_tools(ctx, delegation, &granted, &allowed).await {
                Ok(t) => t,
                Err(why) => {
                    frames.event(
                        "run_meta",
                        json!({"warnings": [{"code": "NO_TOOLS_AVAILABLE", "message": why}]}),
                    )?;
                    (HashMap::new(), Vec::new())
                }
            }
        } else {
            (HashMap::new(), Vec::new())
        };
        let mut messages: Vec<Value> = Vec::with_capacity(history.len() + 2);
        if let Some(s) = &system {
            messages.push(json!({"role": "system", "content": s}));
        }
        messages.extend(history);
        let user_message = json!({"role": "user", "content": plan.content});
        messages.push(user_message.clone());
        let mut added = vec![user_message];
        let mut usage = (0_u64, 0_u64, 0_u64);
        let mut final_text = String::new();
        let mut stop_reason = "recursion_limit";
        let mut model = String::new();
        for _ in 0..plan.recursion_limit {
            // A cancel from this worker or any other: the lease's flag, read before every step.
            if cancelled.load(Ordering::SeqCst)
                || self
                    .store
                    .cancel_asked(&owner, &uuid, &holder)
                    .await
                    .unwrap_or_else(|e| {
                        tracing::warn!(error = %e, "cannot read an agent run lease");
                        false
                    })
            {
                stop_reason = "cancelled";
                break;
            }
            let mut body = Map::new();
            body.insert("messages".into(), Value::Array(messages.clone()));
            body.insert("temperature".into(), json!(limits::SAMPLING_DEFAULT_TEMPERATURE));
            if !tools_json.is_empty() {
                body.insert("tools".into(), Value::Array(tools_json.clone()));
            }
            let (reply, m) = llm
                .agent_step(ctx, &plan.hints, body, limits::AGENT_STEP_MAX_TOKENS)
                .await
                .map_err(|e| {
                    tracing::warn!(invoke_id = %ctx.invoke_id, error = %e, "agent step failed");
                    step_error(&e)
                })?;
            model = reply
                .get("model")
                .and_then(Value::as_str)
                .map_or(m, str::to_owned);
            if let Some(u) = reply.get("usage") {
                let f = |k: &str| u.get(k).and_then(Value::as_u64).unwrap_or(0);
                usage.0 += f("prompt_tokens");
                usage.1 += f("completion_tokens");
                usage.2 += u
                    .get("total_tokens")
                    .and_then(Value::as_u64)
                    .unwrap_or_else(|| f("prompt_tokens") + f("completion_tokens"));
            }
            let message = reply
                .get("choices")
                .and_then(Value::as_array)
                .and_then(|c| c.first())
                .and_then(|c| c.get("message"))
                .cloned()
                .ok_or_else(|| {
                    codes::AGENT_PROVIDER_ERROR.error("the LLM provider returned no completion")
                })?;
            let text = message
                .get("content")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            let calls = message
                .get("tool_calls")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            if !text.is_empty() {
                frames.event("delta", json!({"text": text}))?;
            }
            if calls.is_empty() {
                final_text = text;
                stop_reason = "endTurn";
                let assistant = json!({"role": "assistant", "content": final_text});
                added.push(assistant);
                break;
            }
            let assistant = json!({"role": "assistant", "content": if text.is_empty() { Value::Null } else { json!(text) },
                "tool_calls": calls});
            messages.push(assistant.clone());
            added.push(assistant);
            for call in &calls {
                let result = self
                    .tool_call(ctx, delegation, &offered, call, &mut frames)
                    .await?;
                messages.push(result.clone());
                added.push(result);
            }
        }
        let usage = json!({"inputTokens": usage.0, "outputTokens": usage.1, "totalTokens": usage.2});
        frames.event(
            "final",
            json!({"text": final_text, "usage": usage, "stopReason": stop_reason}),
        )?;
        // The conversation goes on from here (bounded: the oldest turns are dropped). A session deleted, expired
        // or evicted meanwhile keeps nothing.
        let kept = self
            .store
            .edit(&owner, &uuid, true, |s| {
                s.messages.extend(added.iter().cloned());
                store::bound_history(
                    &mut s.messages,
                    limits::AGENT_SESSION_MAX_MESSAGES,
                    store::HISTORY_MAX_BYTES,
                );
                Ok(())
            })
            .await;
        if let Err(e @ SessionError::Store(_)) = kept {
            tracing::warn!(invoke_id = %ctx.invoke_id, error = %e, "cannot keep an agent run's turn");
        }
        Ok(json!({
            "run_id": plan.run_id,
            "stream_id": frames.stream_id,
            "frames": frames.frames,
            "final": {"text": final_text, "usage": usage, "stopReason": stop_reason, "model": model},
        }))
        }
        .await;
        // Given back before the answer: the session is free for the plugin's next call, on any worker.
        leased.release().await;
        outcome
    }

    /// The user's fleet tools the run may call, as OpenAI `tools`, by function name.
    async fn list_tools(
        &self,
        ctx: &CallContext,
        delegation: Option<&DelegationToken>,
        granted: &[String],
        allowed: &[String],
    ) -> Result<(HashMap<String, Offered>, Vec<Value>), String> {
        let listed = self
            .delegated(ctx, delegation, api_methods::TOOLS_LIST, json!({}))
            .await?;
        let mut offered = HashMap::new();
        let mut tools = Vec::new();
        for t in listed
            .get("tools")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default()
        {
            let (Some(tool_id), Some(tool)) = (
                t.get("tool_id").and_then(Value::as_str),
                t.get("tool_name").and_then(Value::as_str),
            ) else {
                continue;
            };
            let ok = |set: &[String]| set.iter().any(|p| covers(p, tool_id, tool));
            if !ok(granted) || !ok(allowed) || tools.len() >= limits::AGENT_MAX_TOOLS {
                continue;
            }
            let name = function_name(tool_id, tool);
            if offered.contains_key(&name) {
                continue;
            }
            let parameters = t
                .get("input_schema")
                .filter(|s| s.is_object())
                .cloned()
                .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
            let mut function = Map::new();
            function.insert("name".into(), json!(name));
            if let Some(d) = t.get("description").and_then(Value::as_str) {
                function.insert("description".into(), json!(d));
            }
            function.insert("parameters".into(), parameters);
            tools.push(json!({"type": "function", "function": function}));
            offered.insert(
                name,
                Offered {
                    tool_id: tool_id.to_owned(),
                    tool: tool.to_owned(),
                },
            );
        }
        if tools.is_empty() {
            return Err("none of the user's tools is allowed in this run".into());
        }
        Ok((offered, tools))
    }

    /// One `tool_calls` entry: its `tool_call` and `tool_result` frames, and the `tool` message for the model.
    async fn tool_call(
        &self,
        ctx: &CallContext,
        delegation: Option<&DelegationToken>,
        offered: &HashMap<String, Offered>,
        call: &Value,
        frames: &mut Frames,
    ) -> Result<Value, ErrorObject> {
        let call_id = call
            .get("id")
            .and_then(Value::as_str)
            .map_or_else(|| format!("call_{}", random_hex(6)), str::to_owned);
        let function = call.get("function");
        let name = function
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let raw_args = function
            .and_then(|f| f.get("arguments"))
            .cloned()
            .unwrap_or(Value::Null);
        let args = match &raw_args {
            Value::String(s) if s.trim().is_empty() => Some(Map::new()),
            Value::String(s) => serde_json::from_str::<Map<String, Value>>(s).ok(),
            Value::Object(m) => Some(m.clone()),
            Value::Null => Some(Map::new()),
            _ => None,
        };
        frames.event(
            "tool_call",
            json!({"name": name, "args": args.clone().map_or(raw_args, Value::Object), "call_id": call_id}),
        )?;
        let outcome: Result<Value, Value> = match (offered.get(&name), args) {
            (None, _) => Err(
                json!({"code": "tool_not_available", "message": "the model called a tool that was not offered"}),
            ),
            (Some(_), None) => Err(
                json!({"code": "invalid_arguments", "message": "the tool arguments are not a JSON object"}),
            ),
            (Some(t), Some(args)) => {
                let remaining = ms(ctx.remaining());
                let invoke = json!({"tool_id": t.tool_id, "method": t.tool, "args": args,
                    "timeoutMs": remaining.clamp(1, limits::AGENT_TOOL_CALL_MAX_MS)});
                self.delegated(ctx, delegation, api_methods::TOOLS_INVOKE, invoke)
                    .await
                    .map_err(|m| json!({"code": "tool_failed", "message": m}))
            }
        };
        let (ok, payload) = match outcome {
            Ok(data) => (true, data),
            Err(e) => (false, e),
        };
        let mut fields = json!({"call_id": call_id, "ok": ok});
        fields[if ok { "data" } else { "error" }] = payload.clone();
        frames.event("tool_result", fields)?;
        let mut text = payload.to_string();
        if text.len() > limits::AGENT_TOOL_RESULT_MAX_BYTES {
            let mut cut = limits::AGENT_TOOL_RESULT_MAX_BYTES;
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            text.truncate(cut);
        }
        Ok(json!({"role": "tool", "tool_call_id": call_id, "content": text}))
    }

    /// A delegated `tools.list` / `tools.invoke` through the front that dispatched the invoke. The error is a
    /// message for the frames (never the delegation).
    async fn delegated(
        &self,
        ctx: &CallContext,
        delegation: Option<&DelegationToken>,
        method: &str,
        args: Value,
    ) -> Result<Value, String> {
        let (Some(client), Some(token)) = (&self.client, delegation) else {
            return Err("this invoke has no delegation for tool calls".into());
        };
        let Some(front) = token.front_id() else {
            return Err("this invoke's delegation is malformed".into());
        };
        let payload = serde_json::to_vec(&DelegatedCall {
            delegation: token.clone(),
            args,
        })
        .map_err(|e| e.to_string())?;
        let subject = delegation::subject(front, method);
        let wait = ctx.remaining();
        let reply = match tokio::time::timeout(wait, client.request(subject, payload.into())).await {
            Ok(Ok(m)) => m,
            Ok(Err(e)) => return Err(format!("the front did not answer: {}", e.kind())),
            Err(_) => return Err("the invoke's deadline passed".into()),
        };
        match serde_json::from_slice::<ApiResponse<Value>>(&reply.payload) {
            Ok(ApiResponse::Ok(v)) => Ok(v),
            Ok(ApiResponse::Err(e)) => Err(format!("{}: {}", e.code.as_str(), e.message)),
            Err(_) => Err("unreadable answer from the front".into()),
        }
    }

    async fn cancel(&self, ctx: &CallContext, p: &Value) -> Result<Value, Failed> {
        let uuid = uuid_param(p)?;
        let run_id = match str_param(p, "run_id")? {
            Some(r) if !r.is_empty() => r.to_owned(),
            _ => return Err(invalid("run_id is required").into()),
        };
        let owner = Self::owner(ctx);
        self.store.get(&owner, uuid).await?;
        let cancelled = self.store.cancel(&owner, uuid, &run_id).await?;
        Ok(json!({"cancelled": cancelled, "run_id": run_id}))
    }

    async fn history(&self, ctx: &CallContext, p: &Value) -> Result<Value, Failed> {
        let uuid = uuid_param(p)?;
        let limit = limit_param(p, limits::AGENT_LIST_DEFAULT_LIMIT)?;
        let start = match str_param(p, "cursor")? {
            None => 0,
            Some(c) => c
                .parse::<usize>()
                .map_err(|_| invalid("cursor is not one this host returned"))?,
        };
        let s = self.store.get(&Self::owner(ctx), uuid).await?;
        let page: Vec<Value> = s.messages.iter().skip(start).take(limit).cloned().collect();
        let next = start + page.len();
        Ok(json!({
            "messages": page,
            "next_cursor": if next < s.messages.len() { json!(next.to_string()) } else { Value::Null },
        }))
    }

    async fn delete(&self, ctx: &CallContext, p: &Value) -> Result<Value, Failed> {
        let uuid = uuid_param(p)?;
        let deleted = self.store.delete(&Self::owner(ctx), uuid).await?;
        Ok(json!({"deleted": deleted, "app_session_uuid": uuid}))
    }

    async fn list(&self, ctx: &CallContext, p: &Value) -> Result<Value, Failed> {
        let limit = limit_param(p, limits::AGENT_LIST_DEFAULT_LIMIT)?;
        match p.get("include_expired") {
            None | Some(Value::Null | Value::Bool(_)) => {}
            Some(_) => return Err(invalid("include_expired must be a boolean").into()),
        }
        let now = now_ms();
        let sessions: Vec<Value> = self
            .store
            .list(&Self::owner(ctx), limit)
            .await?
            .iter()
            .map(|s| s.describe(now))
            .collect();
        Ok(json!({"sessions": sessions}))
    }

    async fn refresh(&self, ctx: &CallContext, p: &Value) -> Result<Value, Failed> {
        let uuid = uuid_param(p)?;
        let ttl = ttl_param(p)?;
        let refreshed = self
            .store
            .edit(&Self::owner(ctx), uuid, true, |s| {
                s.ttl_ms = ms(ttl);
                Ok(s.clone())
            })
            .await?;
        Ok(refreshed.describe(refreshed.last_active_ms))
    }
}

/// The size of an attachment (spec §8.2's "≤ 20 MB each"): the larger of what it states (`size_bytes`, or `size`)
/// and what its inline `data:` URL carries (base64 decoded by length, else the raw payload). 0 when neither.
fn attachment_bytes(a: &Value) -> u64 {
    let stated = ["size_bytes", "size"]
        .iter()
        .find_map(|k| a.get(*k).and_then(Value::as_u64))
        .unwrap_or(0);
    let inline = a
        .get("url")
        .and_then(Value::as_str)
        .and_then(|u| u.strip_prefix("data:"))
        .and_then(|rest| rest.split_once(','))
        .map_or(0, |(meta, payload)| {
            let len = u64::try_from(payload.len()).unwrap_or(u64::MAX);
            if meta.ends_with(";base64") {
                let padding =
                    u64::try_from(payload.bytes().rev().take_while(|b| *b == b'=').count()).unwrap_or(0);
                (len / 4 * 3).saturating_sub(padding)
            } else {
                len
            }
        });
    stated.max(inline)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Spec §8.2: at most 6 attachments, each at most 20 MB, at their boundaries: by count, by stated size and by
    /// the bytes an inline `data:` URL carries.
    #[test]
    fn attachments_are_limited_in_count_and_size_at_the_boundary() {
        let run = |attachments: Value| {
            AgentService::parse_run(&json!({"content": "x", "attachments": attachments}))
                .map(|_| ())
                .map_err(|e| e.code)
        };
        let invalid = codes::AGENT_INVALID_REQUEST.code;
        let image = json!({"type": "image", "url": "https://example.com/a.png"});
        let six: Vec<Value> = (0..limits::AGENT_MAX_ATTACHMENTS)
            .map(|_| image.clone())
            .collect();
        assert_eq!(run(json!(six)), Ok(()));
        let mut seven = six.clone();
        seven.push(image.clone());
        assert_eq!(run(json!(seven)), Err(invalid));

        let max = limits::AGENT_MAX_ATTACHMENT_BYTES;
        for key in ["size_bytes", "size"] {
            assert_eq!(
                run(json!([{"url": "https://e.x/a.png", key: max}])),
                Ok(()),
                "{key}"
            );
            assert_eq!(
                run(json!([image, {"url": "https://e.x/b.png", key: max + 1}])),
                Err(invalid),
                "{key}"
            );
        }
        // 4 base64 characters carry 3 bytes; `=` padding carries none.
        let exactly = |n: u64| {
            let full = n / 3;
            let tail = match n % 3 {
                0 => "",
                1 => "AA==",
                _ => "AAA=",
            };
            format!(
                "data:image/png;base64,{}{tail}",
                "AAAA".repeat(usize::try_from(full).unwrap())
            )
        };
        assert_eq!(attachment_bytes(&json!({"url": exactly(max)})), max);
        assert_eq!(run(json!([{"url": exactly(max)}])), Ok(()));
        assert_eq!(run(json!([{"url": exactly(max + 1)}])), Err(invalid));
        assert_eq!(attachment_bytes(&json!({"url": "data:text/plain,abc"})), 3);
        assert_eq!(attachment_bytes(&json!({"type": "image"})), 0);
    }

    #[test]
    fn grant_patterns_cover_tool_ids_and_tools() {
        assert!(covers("*", "echo-py", "echo"));
        assert!(covers("echo-py", "echo-py", "echo"));
        assert!(covers("echo-py.echo", "echo-py", "echo"));
        assert!(!covers("echo-py.progress", "echo-py", "echo"));
        assert!(!covers("notes-py", "echo-py", "echo"));
        let wide = vec!["echo-py".to_owned()];
        assert!(within("echo-py.echo", &wide));
        assert!(within("echo-py", &wide));
        assert!(!within("*", &wide));
        assert!(!within("notes-py", &wide));
        assert!(within("anything", &["*".to_owned()]));
    }

    #[test]
    fn function_names_are_openai_safe() {
        assert_eq!(function_name("echo-py", "echo"), "echo-py__echo");
        assert_eq!(function_name("a.b", "c d"), "a_b__c_d");
        assert_eq!(
            function_name(&"x".repeat(100), "t").len(),
            limits::AGENT_TOOL_NAME_MAX_CHARS
        );
    }

    #[test]
    fn the_frame_cap_is_exact() {
        let mut f = Frames {
            stream_id: "s".into(),
            frames: Vec::new(),
        };
        for _ in 0..limits::AGENT_MAX_FRAMES {
            f.event("delta", json!({"text": "x"})).expect("under the cap");
        }
        assert_eq!(f.frames.last().and_then(|l| l.get("seq")), Some(&json!(4095)));
        let e = f.event("final", json!({})).expect_err("over the cap");
        assert_eq!(e.code, codes::AGENT_QUOTA_EXCEEDED.code);
        assert_eq!(
            e.data.as_ref().and_then(|d| d.get("errorCode")),
            Some(&json!("AGENT_RUN_TOO_LARGE"))
        );
    }
}
