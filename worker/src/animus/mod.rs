//! The Animus session driver: the second plugin dialect (seed 004; `../shared/spec/animus.md` §3), behind the
//! same [`Pool::invoke`](crate::pool::Pool::invoke) as Executa plugins, so jobs, progress, cancel and results
//! need nothing dialect-specific above the worker.
//!
//! ```text
//! Pool::invoke ─▶ detect (once per install: declared `protocol` verified, else `--manifest` probe)
//!              ├─ Executa ─▶ session::Session (unchanged)
//!              └─ Animus  ─▶ AnimusHost::invoke
//!                    take an idle process of (user, tool_id), or spawn one: own cgroup, user's uid,
//!                    initialize (major 1) → cross-check kind/major with detection → initialized
//!                    one call in flight per process (provider notifications carry only session_id)
//!                    agent/* and $/progress → job progress (8 KB, 50/s); AgentRunResponse → InvokeOutput
//!                    cancel/deadline: caller released at once; $/cancelRequest → agent/cancel → 5 s grace
//!                                     → shutdown (2 s) → exit → cgroup kill
//! every live process: $/ping every `ping_interval_secs` (1 s timeout; 3 misses → recycled when idle),
//!                     health/check every 6th ping (unhealthy → recycled when idle)
//! ```
//!
//! Catalogue mapping (spec §3.3): a `provider` becomes the tools `agent.run` (and `agent.resume` when
//! advertised) whose arguments are `prompt`, `model`, `system_prompt` (and `session_id` for resume); the host
//! fills `cwd` = `project_root` = the user's workspace, `timeout_secs` = the remaining deadline,
//! `env` = the caller's credentials named in the manifest's `env_required`, and `control_session_id` = the
//! invoke id; callers setting a host-owned field are refused. A `custom` plugin's advertised methods and
//! `mcp_tools` become tools only when listed in the install's `allow_methods`. Other kinds are refused.

pub mod detect;
mod process;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fleet_proto::animus::{
    self, AgentCancelParams, AgentRunRequest, AgentRunResponse, CancelRequestParams, InitializeResult,
    PluginKind, RunErrorClass, RunEvent, methods,
};
use fleet_proto::codec::{Frame, FrameKind};
use fleet_proto::executa::invoke::ProgressType;
use fleet_proto::executa::manifest::{Manifest, ToolDefinition};
use fleet_proto::jsonrpc::{ErrorObject, codes};
use fleet_proto::limits;
use serde_json::{Map, Value, json};
use tokio::sync::{Notify, oneshot};

pub use detect::{DetectError, Detected, RefusalStage, Registry};

pub use crate::metrics::AnimusMetrics;
pub use crate::types::HealthState;
use process::{AnimusProcess, CallError, NotificationSink, Reply, StartError};

use crate::catalogue::{Dialect, Install};
use crate::child::ExitInfo;
use crate::metrics::WorkerMetrics;
use crate::progress::{ProgressGate, ProgressSink, ProgressUpdate};
use crate::types::{InvokeError, InvokeOutput, InvokeRequest, WorkerContext};

/// A `health/check` every this many pings.
const HEALTH_EVERY_PINGS: u64 = 6;
/// Cancel records kept for inspection.
const CANCEL_RECORDS: usize = 256;
/// Idle processes kept warm per (user, tool_id); more are shut down when their call ends.
const IDLE_PER_KEY: usize = 2;
/// After the cancel ladder's `shutdown`/`exit`, how long the process gets before the tree is killed.
const CANCEL_EXIT_GRACE: Duration = Duration::from_secs(1);

/// Tool names of a provider.
pub mod tools {
    /// `agent/run`.
    pub const AGENT_RUN: &str = "agent.run";
    /// `agent/resume`.
    pub const AGENT_RESUME: &str = "agent.resume";
}

/// `agent/run` fields the host owns: a caller may not set them.
pub const HOST_OWNED_FIELDS: &[&str] = &[
    "cwd",
    "project_root",
    "env",
    "timeout_secs",
    "permission_mode",
    "mcp_servers",
    "tools",
    "runtime_contract",
    "control_session_id",
];

/// How a cancelled (or expired) run ended on the plugin's side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CancelPath {
    /// The run answered after `$/cancelRequest`.
    CancelRequest,
    /// The run answered after `agent/cancel`.
    AgentCancel,
    /// The grace passed: `shutdown`, `exit`, then the tree was killed.
    Kill,
    /// The process exited on its own during the grace.
    Exited,
}

impl CancelPath {
    /// Every path, in a fixed order.
    pub const ALL: [CancelPath; 4] = [
        CancelPath::CancelRequest,
        CancelPath::AgentCancel,
        CancelPath::Kill,
        CancelPath::Exited,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            CancelPath::CancelRequest => "cancel_request",
            CancelPath::AgentCancel => "agent_cancel",
            CancelPath::Kill => "kill",
            CancelPath::Exited => "exited",
        }
    }
}

/// Why the ladder ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelReason {
    /// The caller cancelled.
    Cancelled,
    /// The deadline passed.
    Deadline,
}

/// One run of the cancellation ladder, as measured.
#[derive(Debug, Clone)]
pub struct CancelRecord {
    /// The invoke (job) id.
    pub invoke_id: String,
    /// Why.
    pub reason: CancelReason,
    /// How it ended.
    pub path: CancelPath,
    /// From the cancel to the plugin's answer (or its process's end).
    pub elapsed: Duration,
}

/// How a tool reaches the plugin.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Route {
    /// `agent/run` or `agent/resume`.
    Run { resume: bool },
    /// A custom method, params passed through.
    Method(String),
    /// `mcp/tool_call {name, arguments}`.
    McpTool(String),
}

/// The tools an Animus plugin is exposed as.
#[derive(Debug, Clone)]
struct Mapping {
    tools: Vec<(ToolDefinition, Route)>,
}

fn tool_def(v: Value) -> Option<ToolDefinition> {
    serde_json::from_value(v).ok()
}

fn map_tools(install: &Install, info: &InitializeResult) -> Mapping {
    let caps = &info.capabilities;
    let mut tools = Vec::new();
    match &info.plugin_info.plugin_kind {
        PluginKind::Provider => {
            let mut params = vec![
                json!({"name": "prompt", "type": "string", "description": "What the agent should do.", "required": true}),
                json!({"name": "model", "type": "string", "description": "The model, if the provider offers several.", "required": false}),
                json!({"name": "system_prompt", "type": "string", "description": "A system prompt.", "required": false}),
            ];
            if caps.has(methods::AGENT_RUN) {
                let def = json!({"name": tools::AGENT_RUN, "description": format!(
                    "Run the {} agent (Animus provider). Streams output, thinking and tool events as job progress.",
                    info.plugin_info.name), "parameters": params.clone()});
                tools.extend(tool_def(def).map(|d| (d, Route::Run { resume: false })));
            }
            if caps.has(methods::AGENT_RESUME) {
                params.push(json!({"name": "session_id", "type": "string", "description": "The session to continue (from a previous run's result).", "required": true}));
                let def = json!({"name": tools::AGENT_RESUME, "description": format!(
                    "Continue a session of the {} agent.", info.plugin_info.name), "parameters": params});
                tools.extend(tool_def(def).map(|d| (d, Route::Run { resume: true })));
            }
        }
        PluginKind::Custom => {
            let allowed = install.allow_methods.clone().unwrap_or_default();
            let mcp_call = caps.has(methods::MCP_TOOL_CALL);
            for t in &caps.mcp_tools {
                if !allowed.contains(&t.name) {
                    continue;
                }
                let route = if mcp_call {
                    Route::McpTool(t.name.clone())
                } else if caps.has(&t.name) {
                    Route::Method(t.name.clone())
                } else {
                    continue;
                };
                let mut def =
                    json!({"name": t.name, "description": t.description.clone().unwrap_or_default()});
                if let Some(schema) = &t.input_schema {
                    def["input_schema"] = schema.clone();
                }
                tools.extend(tool_def(def).map(|d| (d, route)));
            }
            for m in caps.domain_methods() {
                if m == methods::MCP_TOOL_CALL
                    || !allowed.iter().any(|a| a == m)
                    || tools.iter().any(|(d, _)| d.name == m)
                {
                    continue;
                }
                let def = json!({"name": m, "description": format!("The `{m}` method of {} (arguments are its params).", info.plugin_info.name)});
                tools.extend(tool_def(def).map(|d| (d, Route::Method(m.to_string()))));
            }
            if tools.is_empty() {
                tracing::warn!(tool_id = %install.tool_id, "custom Animus plugin exposes no tool: list its methods in `allow_methods`");
            }
        }
        PluginKind::Other(_) => {}
    }
    Mapping { tools }
}

/// The manifest recorded for `tools.list`: the mapped tools, marked with the dialect and kind.
fn manifest_of(info: &InitializeResult, mapping: &Mapping) -> Option<Manifest> {
    let tools: Vec<Value> = mapping
        .tools
        .iter()
        .filter_map(|(d, _)| serde_json::to_value(d).ok())
        .collect();
    serde_json::from_value(json!({
        "name": info.plugin_info.name,
        "version": info.plugin_info.version,
        "description": info.plugin_info.description,
        "tools": tools,
        "dialect": Dialect::Animus.as_str(),
        "plugin_kind": info.plugin_info.plugin_kind.as_str(),
        "protocol_version": info.protocol_version,
    }))
    .ok()
}

struct RunControl {
    cancel: Notify,
    cancelled: AtomicBool,
}

type Key = (String, String);

struct HostInner {
    ctx: WorkerContext,
    registry: Registry,
    idle: Mutex<HashMap<Key, Vec<Arc<AnimusProcess>>>>,
    live: Mutex<HashMap<String, usize>>,
    runs: Mutex<HashMap<String, Arc<RunControl>>>,
    records: Mutex<VecDeque<CancelRecord>>,
    health: Mutex<HashMap<String, HealthState>>,
    ladders: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    closed: AtomicBool,
}

/// The Animus side of a worker's pool. Cheap to clone.
#[derive(Clone)]
pub struct AnimusHost {
    inner: Arc<HostInner>,
}

impl std::fmt::Debug for AnimusHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AnimusHost").finish_non_exhaustive()
    }
}

use fleet_proto::util::lock;

/// What one call streams and learns.
struct RunState {
    session_id: Mutex<Option<String>>,
    fatal: Mutex<Option<String>>,
    gate: ProgressGate,
    sink: Option<ProgressSink>,
    metrics: Arc<WorkerMetrics>,
}

impl RunState {
    fn on_notification(&self, method: &str, frame: &Frame) {
        let params: Value = frame
            .params_json()
            .and_then(|p| serde_json::from_str(p).ok())
            .unwrap_or(Value::Null);
        let Some(event) = RunEvent::classify(method, &params) else {
            WorkerMetrics::inc(&self.metrics.ignored_notifications);
            return;
        };
        if let Some(sid) = params.get("session_id").and_then(Value::as_str) {
            let mut s = lock(&self.session_id);
            if s.is_none() {
                *s = Some(sid.to_string());
            }
        }
        if event == RunEvent::Error {
            let message = params
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("agent/error")
                .to_string();
            lock(&self.fatal).get_or_insert(message);
        }
        let Some(sink) = &self.sink else {
            self.metrics
                .progress_drop(crate::metrics::ProgressDrop::NoChannel);
            return;
        };
        let data = json!({ "event": event.as_str(), "method": method, "params": params });
        let Ok(raw) = serde_json::value::to_raw_value(&data) else {
            self.metrics
                .progress_drop(crate::metrics::ProgressDrop::Malformed);
            return;
        };
        match self.gate.admit(raw.get().len()) {
            Ok(()) => {
                WorkerMetrics::inc(&self.metrics.progress_accepted);
                sink(ProgressUpdate {
                    kind: if event.is_tool_update() {
                        ProgressType::ToolUpdate
                    } else {
                        ProgressType::Progress
                    },
                    data: raw,
                });
            }
            Err(reason) => self.metrics.progress_drop(reason),
        }
    }
}

impl AnimusHost {
    /// A host over the worker's context.
    pub fn new(ctx: WorkerContext) -> AnimusHost {
        AnimusHost {
            inner: Arc::new(HostInner {
                ctx,
                registry: Registry::default(),
                idle: Mutex::new(HashMap::new()),
                live: Mutex::new(HashMap::new()),
                runs: Mutex::new(HashMap::new()),
                records: Mutex::new(VecDeque::new()),
                health: Mutex::new(HashMap::new()),
                ladders: Mutex::new(Vec::new()),
                closed: AtomicBool::new(false),
            }),
        }
    }

    /// Detection and quarantine records.
    pub fn registry(&self) -> &Registry {
        &self.inner.registry
    }

    /// The dialect of `install` (detected once), cross-checked against its files now.
    pub async fn resolve(&self, install: &Install) -> Result<Detected, DetectError> {
        let detected = self.inner.registry.detect(&self.inner.ctx, install).await?;
        self.inner
            .registry
            .check_unchanged(install, &detected)
            .inspect_err(|_| {
                WorkerMetrics::inc(&self.inner.ctx.metrics.animus.quarantines);
            })?;
        Ok(detected)
    }

    /// The cancellation ladders run so far (newest last, at most 256).
    pub fn cancel_records(&self) -> Vec<CancelRecord> {
        lock(&self.inner.records).iter().cloned().collect()
    }

    /// The last health seen per Animus `tool_id`.
    pub fn health(&self) -> HashMap<String, HealthState> {
        lock(&self.inner.health).clone()
    }

    /// Pids of the live processes of (user, tool_id) that are idle.
    pub fn idle_pids(&self, user: &str, tool_id: &str) -> Vec<u32> {
        lock(&self.inner.idle)
            .get(&(user.to_string(), tool_id.to_string()))
            .map(|v| {
                v.iter()
                    .filter(|p| p.child.usable())
                    .map(|p| p.child.pid)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Live Animus processes.
    pub fn live(&self) -> usize {
        lock(&self.inner.live).values().sum()
    }

    /// Whether a call with this id is in flight.
    pub fn has_invoke(&self, invoke_id: &str) -> bool {
        lock(&self.inner.runs).contains_key(invoke_id)
    }

    /// Cancels a call in flight: its caller gets [`InvokeError::Cancelled`] at once and the ladder runs in the
    /// background. Returns whether it was in flight.
    pub fn cancel(&self, invoke_id: &str) -> bool {
        let control = lock(&self.inner.runs).get(invoke_id).cloned();
        match control {
            Some(c) if !c.cancelled.swap(true, Ordering::SeqCst) => {
                c.cancel.notify_one();
                true
            }
            _ => false,
        }
    }

    /// The manifest of `install` for `tools.list`: spawns a process as `user`, maps its tools, shuts it down.
    pub async fn describe(&self, user: &str, install: &Arc<Install>) -> Result<Manifest, InvokeError> {
        let detected = self
            .resolve(install)
            .await
            .map_err(|e| InvokeError::Stopped(e.to_string()))?;
        let (process, _) = self.acquire(user, install, &detected, None).await?;
        let info = process.capabilities().cloned();
        // Described under an internal user: the process is not kept warm for it.
        process.set_sink(None);
        let grace = self.inner.ctx.config.shutdown_grace;
        let p = process.clone();
        self.background(async move { p.shutdown(grace).await });
        let info = info.ok_or(InvokeError::NotReady(Duration::ZERO))?;
        manifest_of(&info, &map_tools(install, &info))
            .ok_or_else(|| InvokeError::Unreadable("the mapped manifest is invalid".into()))
    }

    /// Runs one call (`agent.run`, `agent.resume`, or an allow-listed custom method) on a process of
    /// (user, install) that has nothing else in flight.
    pub async fn invoke(
        &self,
        user: &str,
        install: &Arc<Install>,
        detected: &Detected,
        req: InvokeRequest,
    ) -> Result<InvokeOutput, InvokeError> {
        use tracing::Instrument as _;
        // The same span as Executa invokes (`plugin.invoke`), marked with the dialect.
        let span = tracing::info_span!(
            "plugin.invoke",
            otel.kind = "client",
            otel.status_code = tracing::field::Empty,
            gen_ai.operation.name = "execute_tool",
            gen_ai.tool.name = %req.tool,
            gen_ai.tool.call.id = %req.invoke_id,
            rpc.system = "jsonrpc",
            plugin.dialect = "animus",
            executa.invoke_id = %req.invoke_id,
            executa.tool_id = %install.tool_id,
            executa.outcome = tracing::field::Empty,
            error.type = tracing::field::Empty,
        );
        let result = self
            .invoke_traced(user, install, detected, req)
            .instrument(span.clone())
            .await;
        match &result {
            Ok(out) => {
                span.record(
                    "executa.outcome",
                    if out.success() { "success" } else { "tool_failed" },
                );
            }
            Err(e) => {
                span.record("executa.outcome", "error");
                span.record("otel.status_code", "ERROR");
                span.record("error.type", e.kind());
            }
        }
        result
    }

    async fn invoke_traced(
        &self,
        user: &str,
        install: &Arc<Install>,
        detected: &Detected,
        req: InvokeRequest,
    ) -> Result<InvokeOutput, InvokeError> {
        if self.inner.closed.load(Ordering::SeqCst) {
            return Err(InvokeError::Closed);
        }
        let control = Arc::new(RunControl {
            cancel: Notify::new(),
            cancelled: AtomicBool::new(false),
        });
        {
            let mut runs = lock(&self.inner.runs);
            // Under the runs' lock, as `shutdown` sets it: a call either sees the host closed or is among the
            // runs the shutdown cancels.
            if self.inner.closed.load(Ordering::SeqCst) {
                return Err(InvokeError::Closed);
            }
            if runs.contains_key(&req.invoke_id) {
                return Err(InvokeError::DuplicateInvokeId(req.invoke_id));
            }
            runs.insert(req.invoke_id.clone(), control.clone());
        }
        let _registered = Deregister {
            host: self.clone(),
            invoke_id: req.invoke_id.clone(),
        };
        let metrics = &self.inner.ctx.metrics;
        let traceparent = req
            .extra_context
            .get(animus::TRACEPARENT_EXTENSION)
            .and_then(Value::as_str)
            .map(String::from);
        let acquired = tokio::select! {
            a = self.acquire(user, install, detected, traceparent) => a,
            () = control.cancel.notified() => {
                WorkerMetrics::inc(&metrics.invokes_cancelled);
                return Err(InvokeError::Cancelled);
            }
        };
        let (process, warm) = acquired?;
        if control.cancelled.load(Ordering::SeqCst) {
            self.release(&process);
            WorkerMetrics::inc(&metrics.invokes_cancelled);
            return Err(InvokeError::Cancelled);
        }
        WorkerMetrics::inc(if warm {
            &metrics.warm_hits
        } else {
            &metrics.cold_starts
        });
        WorkerMetrics::inc(&metrics.animus.calls);
        let result = self
            .call_on(&process, install, detected, req, &control, warm)
            .await;
        match &result {
            Ok(out) if out.success() => WorkerMetrics::inc(&metrics.animus.calls_succeeded),
            Err(InvokeError::Cancelled | InvokeError::Timeout(_)) => {}
            _ => WorkerMetrics::inc(&metrics.animus.calls_failed),
        }
        result
    }

    /// Takes an idle usable process of (user, tool_id), or starts one.
    async fn acquire(
        &self,
        user: &str,
        install: &Arc<Install>,
        detected: &Detected,
        traceparent: Option<String>,
    ) -> Result<(Arc<AnimusProcess>, bool), InvokeError> {
        let key = (user.to_string(), install.tool_id.clone());
        loop {
            let p = lock(&self.inner.idle).get_mut(&key).and_then(Vec::pop);
            match p {
                Some(p) if p.child.usable() && p.install_dir == install.dir => {
                    p.busy.store(true, Ordering::SeqCst);
                    return Ok((p, true));
                }
                // A process of a replaced install version: it ends, the call gets one of the current version.
                Some(p) if p.child.usable() => {
                    let grace = self.inner.ctx.config.shutdown_grace;
                    self.background(async move { p.shutdown(grace).await });
                }
                Some(_) => {}
                None => break,
            }
        }
        let limit = self.inner.ctx.config.max_sessions_per_user;
        {
            let mut live = lock(&self.inner.live);
            let n = live.entry(user.to_string()).or_default();
            if *n >= limit {
                return Err(InvokeError::TooManyInFlight { limit });
            }
            *n += 1;
        }
        let started = Instant::now();
        let process = match AnimusProcess::spawn(&self.inner.ctx, user, install).await {
            Ok(p) => p,
            Err(e) => {
                self.dec_live(user);
                return Err(self.start_failed(install, e));
            }
        };
        process.busy.store(true, Ordering::SeqCst);
        self.watch(process.clone(), install.clone());
        // A start given up half-way (the call cancelled: this future dropped) ends the process it made: no call
        // holds it and it is in no idle list, so nothing else would, and it would keep the user's slot.
        let mut abandoned = ColdStart {
            host: self,
            process: Some(process.clone()),
        };
        let handshake = process.handshake(traceparent).await.cloned();
        let info = match handshake {
            Ok(info) => info,
            Err(e) => {
                // This path kills it itself (a second kill could reach a reused process group without cgroups).
                abandoned.process = None;
                process.child.kill_tree().await;
                return Err(self.start_failed(install, e));
            }
        };
        if let Some(m) = &detected.manifest {
            let same_major =
                animus::major(&m.protocol_version).ok() == animus::major(&info.protocol_version).ok();
            if m.plugin_kind != info.plugin_info.plugin_kind || !same_major {
                let reason = format!(
                    "the handshake says kind `{}` protocol {} but detection recorded kind `{}` protocol {}",
                    info.plugin_info.plugin_kind, info.protocol_version, m.plugin_kind, m.protocol_version
                );
                abandoned.process = None;
                process.child.kill_tree().await;
                self.inner.registry.quarantine(install, reason.clone());
                WorkerMetrics::inc(&self.inner.ctx.metrics.animus.quarantines);
                return Err(InvokeError::Stopped(format!("plugin quarantined: {reason}")));
            }
        }
        self.inner.ctx.metrics.observe_cold_start(started.elapsed());
        // Health right after the start (not per call).
        let state = process.health_check().await;
        lock(&self.inner.health).insert(install.tool_id.clone(), state);
        abandoned.process = None;
        Ok((process, false))
    }

    fn start_failed(&self, install: &Install, e: StartError) -> InvokeError {
        match e {
            StartError::Refused(reason) => {
                WorkerMetrics::inc(&self.inner.ctx.metrics.animus.refused);
                WorkerMetrics::inc(&self.inner.ctx.metrics.animus.quarantines);
                self.inner.registry.quarantine(install, reason.clone());
                InvokeError::Stopped(format!("plugin refused: {reason}"))
            }
            StartError::Transient(reason) => InvokeError::Stopped(reason),
        }
    }

    fn dec_live(&self, user: &str) {
        let mut live = lock(&self.inner.live);
        if let Some(n) = live.get_mut(user) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                live.remove(user);
            }
        }
    }

    /// A call ended: the process goes back to the idle list (or is shut down when enough are idle).
    fn release(&self, process: &Arc<AnimusProcess>) {
        process.set_sink(None);
        process.touch();
        process.busy.store(false, Ordering::SeqCst);
        if !process.child.usable() {
            return;
        }
        let key = (process.user.clone(), process.tool_id.clone());
        let keep = !self.inner.closed.load(Ordering::SeqCst) && {
            let mut idle = lock(&self.inner.idle);
            let list = idle.entry(key).or_default();
            list.retain(|p| p.child.usable());
            if list.len() < IDLE_PER_KEY {
                list.push(process.clone());
                true
            } else {
                false
            }
        };
        if !keep {
            let p = process.clone();
            let grace = self.inner.ctx.config.shutdown_grace;
            self.background(async move { p.shutdown(grace).await });
        }
    }

    fn background(&self, fut: impl std::future::Future<Output = ()> + Send + 'static) {
        let mut ladders = lock(&self.inner.ladders);
        ladders.retain(|h| !h.is_finished());
        ladders.push(tokio::spawn(fut));
    }

    /// The liveness loop of one process, and its accounting when it ends.
    fn watch(&self, process: Arc<AnimusProcess>, install: Arc<Install>) {
        let host = self.clone();
        tokio::spawn(async move {
            let every = install.ping_interval.unwrap_or(limits::ANIMUS_PING_INTERVAL);
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut pings: u64 = 0;
            loop {
                tokio::select! {
                    _ = process.child.exited() => break,
                    _ = tick.tick() => {}
                }
                if !process.child.usable() || process.capabilities().is_none() {
                    continue;
                }
                let answered = process.ping().await;
                pings += 1;
                let busy = process.busy.load(Ordering::SeqCst);
                if !answered && process.ping_misses.load(Ordering::Relaxed) >= limits::ANIMUS_PING_MAX_MISSES
                {
                    if busy {
                        // Let the call's deadline decide (spec §3.7): never kill a run on liveness alone.
                        tracing::warn!(tool_id = %process.tool_id, pid = process.child.pid, "busy Animus plugin misses pings");
                        continue;
                    }
                    tracing::warn!(tool_id = %process.tool_id, pid = process.child.pid, "Animus plugin missed {} pings: recycling it", limits::ANIMUS_PING_MAX_MISSES);
                    lock(&host.inner.health).insert(process.tool_id.clone(), HealthState::Unhealthy);
                    WorkerMetrics::inc(&host.inner.ctx.metrics.animus.recycles);
                    host.forget_idle(&process);
                    process.child.kill_tree().await;
                    continue;
                }
                if answered && pings.is_multiple_of(HEALTH_EVERY_PINGS) && !busy {
                    let state = process.health_check().await;
                    lock(&host.inner.health).insert(process.tool_id.clone(), state);
                    if state == HealthState::Unhealthy && !process.busy.load(Ordering::SeqCst) {
                        WorkerMetrics::inc(&host.inner.ctx.metrics.animus.recycles);
                        host.forget_idle(&process);
                        process.shutdown(host.inner.ctx.config.shutdown_grace).await;
                    }
                }
            }
            host.forget_idle(&process);
            host.dec_live(&process.user);
        });
    }

    fn forget_idle(&self, process: &Arc<AnimusProcess>) {
        let key = (process.user.clone(), process.tool_id.clone());
        if let Some(list) = lock(&self.inner.idle).get_mut(&key) {
            list.retain(|p| !Arc::ptr_eq(p, process));
        }
    }

    async fn call_on(
        &self,
        process: &Arc<AnimusProcess>,
        install: &Arc<Install>,
        detected: &Detected,
        req: InvokeRequest,
        control: &Arc<RunControl>,
        warm: bool,
    ) -> Result<InvokeOutput, InvokeError> {
        let Some(info) = process.capabilities().cloned() else {
            self.release(process);
            return Err(InvokeError::NotReady(Duration::ZERO));
        };
        let mapping = map_tools(install, &info);
        let Some((_, route)) = mapping.tools.iter().find(|(d, _)| d.name == req.tool).cloned() else {
            self.release(process);
            return Err(InvokeError::UnknownTool {
                tool: req.tool.clone(),
                available: mapping.tools.iter().map(|(d, _)| d.name.clone()).collect(),
            });
        };
        // The user's stored credentials fill the names of `env_required` the caller did not give (spec §4.2).
        let mut req = req;
        let names = env_required(detected);
        let timeout = req.timeout.unwrap_or(limits::DEFAULT_INVOKE_TIMEOUT);
        if !names.is_empty() {
            // The lookup rides out a store that does not answer for a while, never past the invoke's own time.
            let deadline_ms = req.deadline_ms.unwrap_or_else(|| {
                fleet_proto::util::now_ms()
                    .saturating_add(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX))
            });
            let lookup =
                self.inner
                    .ctx
                    .tokens
                    .credentials(&process.user, &process.tool_id, &names, deadline_ms);
            let Ok(found) = tokio::time::timeout(timeout, lookup).await else {
                self.release(process);
                return Err(InvokeError::Timeout(timeout));
            };
            match found {
                Ok(found) => {
                    for (name, value) in found.0 {
                        req.credentials.entry(name).or_insert(value);
                    }
                }
                Err(e) => {
                    self.release(process);
                    return Err(InvokeError::CredentialsUnavailable(e.0));
                }
            }
        }
        let (method, params) = match self.params(process, detected, &route, &req, timeout) {
            Ok(x) => x,
            Err(e) => {
                self.release(process);
                return Err(e);
            }
        };
        let state = Arc::new(RunState {
            session_id: Mutex::new(None),
            fatal: Mutex::new(None),
            gate: ProgressGate::new(),
            sink: req.progress.clone(),
            metrics: self.inner.ctx.metrics.clone(),
        });
        let s = state.clone();
        let sink: NotificationSink =
            Arc::new(move |method: &str, frame: Frame| s.on_notification(method, &frame));
        process.set_sink(Some(sink));
        let started = Instant::now();
        let (id, mut rx) = match process.request(&method, Some(params)).await {
            Ok(x) => x,
            Err(e) => {
                self.release(process);
                return Err(self.call_error(process, e));
            }
        };
        let reason = tokio::select! {
            reply = &mut rx => {
                let out = self.finish(process, &info, &state, reply, started, warm);
                self.release(process);
                return out;
            }
            () = tokio::time::sleep(timeout) => CancelReason::Deadline,
            () = control.cancel.notified() => CancelReason::Cancelled,
        };
        // The caller is released now; late frames of this call are discarded from here on.
        process.set_sink(None);
        let metrics = &self.inner.ctx.metrics;
        WorkerMetrics::inc(match reason {
            CancelReason::Cancelled => &metrics.invokes_cancelled,
            CancelReason::Deadline => &metrics.invokes_timed_out,
        });
        let session = lock(&state.session_id).clone();
        let host = self.clone();
        let p = process.clone();
        let invoke_id = req.invoke_id.clone();
        self.background(async move {
            host.ladder(p, &info, id, rx, session, invoke_id, reason).await;
        });
        Err(match reason {
            CancelReason::Cancelled => InvokeError::Cancelled,
            CancelReason::Deadline => InvokeError::Timeout(timeout),
        })
    }

    /// The wire method and params of a call.
    fn params(
        &self,
        process: &AnimusProcess,
        detected: &Detected,
        route: &Route,
        req: &InvokeRequest,
        timeout: Duration,
    ) -> Result<(String, Value), InvokeError> {
        let invalid = |msg: String| InvokeError::Animus {
            class: RunErrorClass::InvalidArguments,
            error: ErrorObject::new(codes::INVALID_PARAMS, msg),
        };
        match route {
            Route::Run { resume } => {
                for k in req.arguments.keys() {
                    if HOST_OWNED_FIELDS.contains(&k.as_str()) {
                        return Err(invalid(format!("`{k}` is set by the host, not by callers")));
                    }
                    if !matches!(k.as_str(), "prompt" | "model" | "system_prompt" | "session_id") {
                        return Err(invalid(format!("unknown argument `{k}`")));
                    }
                }
                let text = |k: &str| -> Result<Option<String>, InvokeError> {
                    match req.arguments.get(k) {
                        None | Some(Value::Null) => Ok(None),
                        Some(Value::String(s)) => Ok(Some(s.clone())),
                        Some(_) => Err(invalid(format!("`{k}` must be a string"))),
                    }
                };
                let prompt = text("prompt")?.ok_or_else(|| invalid("`prompt` is required".into()))?;
                let session_id = text("session_id")?;
                if *resume && session_id.is_none() {
                    return Err(invalid("`session_id` is required to resume".into()));
                }
                if !*resume && session_id.is_some() {
                    return Err(invalid("`session_id` is for agent.resume".into()));
                }
                let workspace = process.workspace.display().to_string();
                let env_required = env_required(detected);
                let env: Map<String, Value> = req
                    .credentials
                    .iter()
                    .filter(|(k, v)| env_required.contains(k) && v.is_string())
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                let mut extras = Map::new();
                extras.insert("control_session_id".into(), Value::String(req.invoke_id.clone()));
                if let Some(tp) = req.extra_context.get(animus::TRACEPARENT_EXTENSION) {
                    extras.insert(animus::TRACEPARENT_EXTENSION.into(), tp.clone());
                }
                let run = AgentRunRequest {
                    session_id,
                    prompt,
                    model: text("model")?,
                    system_prompt: text("system_prompt")?,
                    cwd: workspace.clone(),
                    project_root: Some(workspace),
                    permission_mode: None,
                    timeout_secs: Some(timeout.as_secs().max(1)),
                    env,
                    extras,
                };
                let method = if *resume {
                    methods::AGENT_RESUME
                } else {
                    methods::AGENT_RUN
                };
                let params = serde_json::to_value(run).map_err(|e| invalid(e.to_string()))?;
                Ok((method.to_string(), params))
            }
            Route::Method(m) => Ok((m.clone(), Value::Object(req.arguments.clone()))),
            Route::McpTool(name) => Ok((
                methods::MCP_TOOL_CALL.to_string(),
                json!({ "name": name, "arguments": req.arguments }),
            )),
        }
    }

    fn call_error(&self, process: &AnimusProcess, e: CallError) -> InvokeError {
        match e {
            CallError::Exited(exit) => {
                WorkerMetrics::inc(&self.inner.ctx.metrics.invokes_lost);
                InvokeError::ProcessExited {
                    exit,
                    stderr_tail: process.child.stderr_tail(5),
                }
            }
            CallError::Timeout => InvokeError::Timeout(Duration::ZERO),
            CallError::Write(e) => InvokeError::Unreadable(e),
        }
    }

    /// The answer of a call → the invoke's outcome (spec §3.4).
    fn finish(
        &self,
        process: &AnimusProcess,
        info: &InitializeResult,
        state: &RunState,
        reply: Result<Reply, oneshot::error::RecvError>,
        started: Instant,
        warm: bool,
    ) -> Result<InvokeOutput, InvokeError> {
        let frame = match reply {
            Ok(Ok(frame)) => frame,
            Ok(Err(failure)) => return Err(self.call_error(process, failure.into())),
            Err(_) => {
                let exit = process.child.exit_info().unwrap_or_else(ExitInfo::unknown);
                return Err(self.call_error(process, CallError::Exited(exit)));
            }
        };
        WorkerMetrics::inc(&self.inner.ctx.metrics.invokes_completed);
        if frame.kind() == FrameKind::ErrorResponse {
            let error = frame
                .error()
                .and_then(Result::ok)
                .unwrap_or_else(|| ErrorObject::new(codes::INTERNAL_ERROR, "unreadable error"));
            return Err(
                match animus::classify_run_error(error.code, error.data.as_ref()) {
                    RunErrorClass::Cancelled => InvokeError::Cancelled,
                    RunErrorClass::TimedOut => InvokeError::Timeout(started.elapsed()),
                    class => InvokeError::Animus { class, error },
                },
            );
        }
        let duration = started.elapsed();
        let result: Value = frame.parse_payload().ok().flatten().unwrap_or(Value::Null);
        if info.plugin_info.plugin_kind != PluginKind::Provider {
            return InvokeOutput::composed(&json!({ "success": true, "data": result }), duration, warm);
        }
        let resp: AgentRunResponse = serde_json::from_value(result)
            .map_err(|e| InvokeError::Unreadable(format!("the AgentRunResponse is unreadable: {e}")))?;
        let fatal = lock(&state.fatal).clone();
        let success = resp.succeeded(fatal.is_some());
        let session_id = resp
            .session_id
            .clone()
            .or_else(|| lock(&state.session_id).clone());
        let data = json!({
            "output": resp.output,
            "session_id": session_id,
            "exit_code": resp.exit_code,
            "tool_calls": resp.tool_calls,
            "tool_results": resp.tool_results,
            "metadata": resp.metadata,
            "errors": resp.errors,
            "duration_ms": resp.duration_ms,
            "backend": resp.backend,
            "usage": resp.tokens_used,
        });
        let mut body = json!({ "success": success, "data": data });
        if !success {
            body["error"] = Value::String(match (fatal, resp.exit_code) {
                (Some(m), _) => format!("the agent reported a non-recoverable error: {m}"),
                (None, code) => format!("the agent run ended with exit_code {}", code.unwrap_or(0)),
            });
        }
        InvokeOutput::composed(&body, duration, warm)
    }

    /// The cancellation ladder (spec §3.4): `$/cancelRequest` (when the plugin advertised cancellation), then
    /// `agent/cancel {session_id}` (providers advertising it; the session from the run's notifications, else
    /// the `control_session_id` we sent), a grace for the run to answer; then `shutdown`, `exit` and the kill.
    #[allow(clippy::too_many_arguments)]
    async fn ladder(
        &self,
        process: Arc<AnimusProcess>,
        info: &InitializeResult,
        id: u64,
        mut rx: oneshot::Receiver<Reply>,
        session: Option<String>,
        invoke_id: String,
        reason: CancelReason,
    ) {
        let t0 = Instant::now();
        let caps = &info.capabilities;
        let sent_cancel_request = caps.cancellation;
        if sent_cancel_request {
            process.notify(
                methods::CANCEL_REQUEST,
                Some(CancelRequestParams { id: json!(id) }),
            );
        }
        let agent_cancel =
            info.plugin_info.plugin_kind == PluginKind::Provider && caps.has(methods::AGENT_CANCEL);
        let session_id = session.unwrap_or_else(|| invoke_id.clone());
        let p = process.clone();
        let cancel_call = async move {
            if agent_cancel {
                p.call(
                    methods::AGENT_CANCEL,
                    Some(AgentCancelParams { session_id }),
                    limits::ANIMUS_AGENT_CANCEL_TIMEOUT,
                )
                .await
                .ok()
            } else {
                std::future::pending().await
            }
        };
        tokio::pin!(cancel_call);
        let grace = tokio::time::sleep(limits::ANIMUS_CANCEL_GRACE);
        tokio::pin!(grace);
        let mut agent_cancel_answered = false;
        let path = loop {
            tokio::select! {
                reply = &mut rx => {
                    break match reply {
                        Ok(Ok(_)) if agent_cancel_answered || (agent_cancel && !sent_cancel_request) => CancelPath::AgentCancel,
                        Ok(Ok(_)) => CancelPath::CancelRequest,
                        _ => CancelPath::Exited,
                    };
                }
                answer = &mut cancel_call, if !agent_cancel_answered => {
                    agent_cancel_answered = answer.is_some_and(|f| f.kind() == FrameKind::Response);
                }
                () = &mut grace => break CancelPath::Kill,
            }
        };
        let elapsed = match path {
            CancelPath::Kill => {
                process.forget(id);
                process.shutdown(CANCEL_EXIT_GRACE).await;
                t0.elapsed()
            }
            _ => t0.elapsed(),
        };
        tracing::info!(tool_id = %process.tool_id, %invoke_id, path = path.as_str(), elapsed_ms = u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX),
            reason = ?reason, "Animus cancellation ladder ended");
        if let Some(i) = CancelPath::ALL.iter().position(|p| *p == path) {
            WorkerMetrics::inc(&self.inner.ctx.metrics.animus.cancel_paths[i]);
        }
        {
            let mut records = lock(&self.inner.records);
            if records.len() == CANCEL_RECORDS {
                records.pop_front();
            }
            records.push_back(CancelRecord {
                invoke_id,
                reason,
                path,
                elapsed,
            });
        }
        // A plugin that honoured the cancel is reusable; one that did not is gone.
        self.release(&process);
    }

    /// Shuts down idle processes unused for the install's idle timeout (else the worker's).
    pub async fn evict_idle(&self, idle_for: impl Fn(&str) -> Duration) -> usize {
        let victims: Vec<Arc<AnimusProcess>> = {
            let mut idle = lock(&self.inner.idle);
            let mut out = Vec::new();
            for list in idle.values_mut() {
                list.retain(|p| {
                    let old = p.last_used().elapsed() >= idle_for(&p.tool_id);
                    if old {
                        out.push(p.clone());
                    }
                    !old
                });
            }
            out
        };
        let n = victims.len();
        let grace = self.inner.ctx.config.shutdown_grace;
        for p in victims {
            WorkerMetrics::inc(&self.inner.ctx.metrics.evictions);
            self.background(async move { p.shutdown(grace).await });
        }
        n
    }

    /// Refuses new calls, cancels the calls in flight and shuts every process down (each with its ladder).
    pub async fn shutdown(&self) {
        let ids: Vec<String> = {
            let runs = lock(&self.inner.runs);
            self.inner.closed.store(true, Ordering::SeqCst);
            runs.keys().cloned().collect()
        };
        for id in ids {
            self.cancel(&id);
        }
        // The cancelled calls start their ladders as they unwind: wait for them to do so (bounded).
        let unwind = Instant::now() + limits::ANIMUS_SHUTDOWN_TIMEOUT;
        while !lock(&self.inner.runs).is_empty() && Instant::now() < unwind {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let idle: Vec<Arc<AnimusProcess>> = lock(&self.inner.idle).drain().flat_map(|(_, v)| v).collect();
        let grace = self.inner.ctx.config.shutdown_grace;
        for p in idle {
            self.background(async move { p.shutdown(grace).await });
        }
        loop {
            let pending: Vec<_> = std::mem::take(&mut *lock(&self.inner.ladders));
            if pending.is_empty() {
                break;
            }
            for h in pending {
                let _ = h.await;
            }
        }
    }
}

/// Kills the process of a cold start that did not complete (see [`AnimusHost::acquire`]) when dropped armed.
/// Its error paths disarm it and kill the process themselves.
struct ColdStart<'a> {
    host: &'a AnimusHost,
    process: Option<Arc<AnimusProcess>>,
}

impl Drop for ColdStart<'_> {
    fn drop(&mut self) {
        let Some(process) = self.process.take() else {
            return;
        };
        // Dropped outside a runtime (it is going away): the child's own drop kills it.
        if tokio::runtime::Handle::try_current().is_ok() {
            self.host
                .background(async move { process.child.kill_tree().await });
        }
    }
}

struct Deregister {
    host: AnimusHost,
    invoke_id: String,
}

impl Drop for Deregister {
    fn drop(&mut self) {
        lock(&self.host.inner.runs).remove(&self.invoke_id);
    }
}

/// The names of the Animus manifest's `env_required` (the credentials a provider receives in `env`).
fn env_required(detected: &Detected) -> Vec<String> {
    detected
        .manifest
        .as_ref()
        .and_then(|m| m.extra.get("env_required"))
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|e| e.get("name").and_then(Value::as_str).map(String::from))
                .collect()
        })
        .unwrap_or_default()
}
