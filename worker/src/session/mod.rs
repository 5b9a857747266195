//! One long-lived plugin process per (user, tool_id): the Executa lifecycle exactly as the spec states it.
//!
//! ```text
//! caller tasks ──▶ FrameWriter (one writer task) ──▶ plugin stdin
//! plugin stdout ──▶ one reader task: classify
//!      response     → pending[id] → the waiting caller
//!      request      → reverse-RPC routing (by context.invoke_id) → gates → HostServices → response
//!      notification → executa/progress → the invoke's sink (8 KB, 50/s) ; others counted and dropped
//!      pointer      → __file_transport, read from TMPDIR only, then classified
//! stderr ──▶ bounded ring          exit ──▶ fail every pending call now; the supervisor decides the rest
//! ```
//!
//! A supervisor task per session owns the process lifecycle: start (spawn into the cgroup → `initialize`, 5 s,
//! falling back to v1 on timeout / -32601 / any error / a version other than "2.0" → `describe`, 5 s or 60 s on
//! a new install's first launch, cached for the process's life), restart after an unexpected exit with
//! exponential backoff (1 s, 2 s, 4 s: at most 3 attempts, then Stopped with the exit and stderr), lazy restart
//! after a host-initiated kill (cancel fallback), and the shutdown ladder (close stdin → grace → SIGTERM →
//! grace → SIGKILL of the whole tree).

mod pin;
mod process;
mod transport;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fleet_proto::codec::FrameKind;
use fleet_proto::executa::capabilities::keys;
use fleet_proto::executa::invoke::{InvokeContext, InvokeParams};
use fleet_proto::executa::lifecycle::{
    Health, HealthResult, InitializeParams, InitializeResult, PROTOCOL_V2, PeerInfo, ProtocolVersion, methods,
};
use fleet_proto::executa::manifest::Manifest;
use fleet_proto::jsonrpc::codes;
use fleet_proto::limits;
use serde_json::{Map, Value, json};
use tokio::sync::{Notify, Semaphore, watch};

use process::{ActiveInvoke, Handshake, Process};

use crate::catalogue::Install;
pub use crate::child::{ExitInfo, SpawnError};
use crate::child::{Failure, Sandboxed, StderrRing};
use crate::config::WorkerConfig;
use crate::metrics::WorkerMetrics;
pub use crate::progress;
use crate::progress::ProgressGate;
use crate::sandbox::{SandboxError, SessionCgroup};
use crate::services::{CredentialValues, HostServices, InvokeTokens, TokenRequest, TokenSource};
use crate::types::output;
pub use crate::types::{InvokeError, InvokeOutput, InvokeRequest, WorkerContext};

/// A session's state as callers see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionState {
    /// No process; one is started on the next call.
    Idle,
    /// Spawning and handshaking.
    Starting,
    /// Serving.
    Ready,
    /// Waiting before a restart after a crash.
    Backoff,
    /// Gave up after repeated crashes or a fatal start error; the message says why.
    Stopped(String),
    /// Shut down.
    Closed,
}

#[derive(Debug, Clone)]
enum Phase {
    Idle,
    Starting,
    Ready(Arc<Process>),
    Backoff,
    Stopped(Arc<str>),
    Closed,
}

/// Why a session could not be created.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// The sandbox refused.
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    /// The install is disabled.
    #[error("plugin {0} is disabled")]
    Disabled(String),
}

/// Immutable per-session facts shared by the session and its processes.
pub(crate) struct SessionShared {
    pub(crate) user: String,
    pub(crate) tool_id: String,
    pub(crate) install: Arc<Install>,
    pub(crate) config: Arc<WorkerConfig>,
    /// The session's sandbox, shared by its successive processes.
    pub(crate) sandbox: Arc<Sandboxed>,
    pub(crate) services: Arc<dyn HostServices>,
    pub(crate) tokens: Arc<dyn TokenSource>,
    pub(crate) metrics: Arc<WorkerMetrics>,
    pub(crate) stderr: StderrRing,
}

impl std::fmt::Debug for SessionShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionShared")
            .field("tool_id", &self.tool_id)
            .finish_non_exhaustive()
    }
}

impl SessionShared {
    /// The plugin's environment: the allow-list, the runtime variables, nothing else (no credentials, ever).
    pub(crate) fn environment(&self) -> Vec<(String, String)> {
        let dir = &self.install.dir;
        let mut env: Vec<(String, String)> = Vec::new();
        for name in self.config.env_allowlist.iter().chain(self.install.env.iter()) {
            if let Ok(v) = std::env::var(name)
                && !env.iter().any(|(k, _)| k == name)
            {
                env.push((name.clone(), v));
            }
        }
        let mut set = |k: &str, v: String| {
            env.retain(|(name, _)| name != k);
            env.push((k.to_string(), v));
        };
        set("EXECUTA_HOME", dir.display().to_string());
        let data = dir.join("data");
        if data.is_dir() {
            set("EXECUTA_DATA", data.display().to_string());
        }
        let libs: Vec<String> = ["lib", "lib64"]
            .iter()
            .map(|l| dir.join(l))
            .filter(|p| p.is_dir())
            .map(|p| p.display().to_string())
            .collect();
        if !libs.is_empty() {
            let prev = std::env::var("LD_LIBRARY_PATH")
                .ok()
                .filter(|_| self.allowlisted("LD_LIBRARY_PATH"));
            set(
                "LD_LIBRARY_PATH",
                libs.into_iter().chain(prev).collect::<Vec<_>>().join(":"),
            );
        }
        let share_bin = dir.join("share").join("bin");
        if share_bin.is_dir() {
            let prev = std::env::var("PATH").ok().filter(|_| self.allowlisted("PATH"));
            set(
                "PATH",
                std::iter::once(share_bin.display().to_string())
                    .chain(prev)
                    .collect::<Vec<_>>()
                    .join(":"),
            );
        }
        let space = self.sandbox.space();
        set("ANNA_WORKSPACE_DIR", space.workspace.display().to_string());
        set("HOME", space.workspace.display().to_string());
        set("TMPDIR", space.tmpdir.display().to_string());
        env
    }

    fn allowlisted(&self, name: &str) -> bool {
        self.config
            .env_allowlist
            .iter()
            .chain(self.install.env.iter())
            .any(|n| n == name)
    }
}

struct Inner {
    shared: Arc<SessionShared>,
    phase: watch::Sender<Phase>,
    demand: Notify,
    /// Set once by [`Session::shutdown`] (with `send_replace`: it must hold before the supervisor subscribes).
    shutdown: watch::Sender<bool>,
    /// Set (with `send_replace`) when the supervisor has ended, however it ends (its last step is the cgroup's
    /// removal): what every [`Session::shutdown`] waits for.
    finished: watch::Sender<bool>,
    first_launch: AtomicBool,
    in_flight: Arc<Semaphore>,
    last_used: Mutex<Instant>,
    early_cancels: EarlyCancels,
    /// The span of the call that asked for a process (the parent of `plugin.session.spawn`).
    spawn_parent: Mutex<Option<tracing::Span>>,
}

/// Cancels that arrived before their invoke was active, kept for a while so the invoke is cancelled the moment it
/// registers.
#[derive(Debug, Default)]
pub(crate) struct EarlyCancels {
    ids: Mutex<std::collections::HashMap<String, Instant>>,
}

impl EarlyCancels {
    /// How long an early cancel is remembered.
    const KEEP: Duration = Duration::from_secs(300);

    pub(crate) fn note(&self, invoke_id: &str) {
        let mut ids = self.ids.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        ids.retain(|_, at| at.elapsed() < Self::KEEP);
        ids.insert(invoke_id.to_string(), Instant::now());
    }

    pub(crate) fn take(&self, invoke_id: &str) -> bool {
        let mut ids = self.ids.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        ids.remove(invoke_id).is_some_and(|at| at.elapsed() < Self::KEEP)
    }
}

/// One attempt at an invoke on a session ([`Session::attempt`]).
#[derive(Debug)]
pub enum Attempt {
    /// The invoke ran on this session: its output, or why it failed.
    Ran(Result<InvokeOutput, InvokeError>),
    /// The session was closed before the request reached its process: the request, untouched.
    Closed(InvokeRequest),
}

/// A plugin session. Cheap to clone.
#[derive(Clone)]
pub struct Session {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("user", &self.inner.shared.user)
            .field("tool_id", &self.inner.shared.tool_id)
            .field("state", &self.state())
            .finish()
    }
}

pub(crate) use fleet_proto::util::now_ms;

enum StartError {
    /// Retrying cannot help (spawn refused, invalid manifest).
    Fatal(String),
    /// May work next time (exited during the handshake, describe timed out).
    Transient(String),
}

impl Session {
    /// Creates the session (cgroup, user space) in state Idle; the process starts on the first call or
    /// [`prewarm`](Self::prewarm).
    pub fn new(user: &str, install: &Arc<Install>, ctx: &WorkerContext) -> Result<Session, SessionError> {
        if !install.enabled {
            return Err(SessionError::Disabled(install.tool_id.clone()));
        }
        let prepared = ctx.sandbox.prepare(
            user,
            &install.tool_id,
            "e",
            install.effective_limits(ctx.config.limits),
            &install.dir,
            &install.argv,
            crate::sandbox::Start::Worker,
        )?;
        let shared = Arc::new(SessionShared {
            user: user.to_string(),
            tool_id: install.tool_id.clone(),
            config: ctx.config.clone(),
            sandbox: Arc::new(Sandboxed::new(prepared)),
            services: ctx.services.clone(),
            tokens: ctx.tokens.clone(),
            metrics: ctx.metrics.clone(),
            stderr: StderrRing::new(ctx.config.stderr_ring_bytes),
            install: install.clone(),
        });
        let (phase, _) = watch::channel(Phase::Idle);
        let (shutdown, _) = watch::channel(false);
        let inner = Arc::new(Inner {
            shared,
            phase,
            demand: Notify::new(),
            shutdown,
            finished: watch::Sender::new(false),
            first_launch: AtomicBool::new(install.first_launch),
            in_flight: Arc::new(Semaphore::new(ctx.config.max_in_flight_per_session)),
            last_used: Mutex::new(Instant::now()),
            early_cancels: EarlyCancels::default(),
            spawn_parent: Mutex::new(None),
        });
        tokio::spawn(supervise(inner.clone()));
        Ok(Session { inner })
    }

    /// The user.
    pub fn user(&self) -> &str {
        &self.inner.shared.user
    }

    /// The plugin.
    pub fn tool_id(&self) -> &str {
        &self.inner.shared.tool_id
    }

    /// The current state.
    pub fn state(&self) -> SessionState {
        match &*self.inner.phase.borrow() {
            Phase::Idle => SessionState::Idle,
            Phase::Starting => SessionState::Starting,
            Phase::Ready(p) if p.child.usable() => SessionState::Ready,
            Phase::Ready(_) | Phase::Backoff => SessionState::Backoff,
            Phase::Stopped(e) => SessionState::Stopped(e.to_string()),
            Phase::Closed => SessionState::Closed,
        }
    }

    fn ready(&self) -> Option<Arc<Process>> {
        match &*self.inner.phase.borrow() {
            Phase::Ready(p) if p.child.usable() => Some(p.clone()),
            _ => None,
        }
    }

    /// The pid of the running process.
    pub fn pid(&self) -> Option<u32> {
        self.ready().map(|p| p.child.pid)
    }

    /// The cached manifest of the running process.
    pub fn manifest(&self) -> Option<Arc<Manifest>> {
        self.ready()?.handshake.get().map(|h| h.manifest.clone())
    }

    /// The negotiated protocol of the running process.
    pub fn protocol(&self) -> Option<ProtocolVersion> {
        self.ready()?.handshake.get().map(|h| h.protocol)
    }

    /// The capability keys the running process negotiated.
    pub fn negotiated(&self) -> Option<BTreeSet<String>> {
        self.ready()?.handshake.get().map(|h| h.negotiated.clone())
    }

    /// The stderr lines kept (redacted).
    pub fn stderr_lines(&self) -> Vec<String> {
        self.inner.shared.stderr.lines()
    }

    /// The per-user workspace (`ANNA_WORKSPACE_DIR`) and TMPDIR of this session.
    pub fn dirs(&self) -> (PathBuf, PathBuf) {
        (
            self.inner.shared.sandbox.space().workspace.clone(),
            self.inner.shared.sandbox.space().tmpdir.clone(),
        )
    }

    /// Invokes in flight.
    pub fn in_flight(&self) -> usize {
        self.inner.shared.config.max_in_flight_per_session - self.inner.in_flight.available_permits()
    }

    /// When the session last served a call (or was created).
    pub fn last_used(&self) -> Instant {
        *self
            .inner
            .last_used
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The session's cgroup, if isolated.
    pub fn with_cgroup<T>(&self, f: impl FnOnce(Option<&SessionCgroup>) -> T) -> T {
        self.inner.shared.sandbox.with_cgroup(f)
    }

    fn touch(&self) {
        *self
            .inner
            .last_used
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Instant::now();
    }

    /// Waits until a process is ready (starting one if needed).
    async fn process(&self, wait: Duration) -> Result<(Arc<Process>, bool), InvokeError> {
        let mut rx = self.inner.phase.subscribe();
        let deadline = tokio::time::Instant::now() + wait;
        let mut first = true;
        loop {
            let phase = rx.borrow_and_update().clone();
            match phase {
                Phase::Ready(p) if p.child.usable() => return Ok((p, first)),
                Phase::Idle => {
                    *self
                        .inner
                        .spawn_parent
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(tracing::Span::current());
                    self.inner.demand.notify_one();
                }
                Phase::Ready(_) | Phase::Starting | Phase::Backoff => {}
                Phase::Stopped(e) => return Err(InvokeError::Stopped(e.to_string())),
                Phase::Closed => return Err(InvokeError::Closed),
            }
            first = false;
            if tokio::time::timeout_at(deadline, rx.changed())
                .await
                .map_or(true, |r| r.is_err())
            {
                return Err(match &*rx.borrow() {
                    Phase::Stopped(e) => InvokeError::Stopped(e.to_string()),
                    Phase::Closed => InvokeError::Closed,
                    _ => InvokeError::NotReady(wait),
                });
            }
        }
    }

    /// Starts the process now (if not running) and waits until it is ready or `wait` has passed.
    pub async fn prewarm(&self, wait: Duration) -> Result<(), InvokeError> {
        self.touch();
        self.process(wait).await.map(|_| ())
    }

    /// Runs one invoke. Many may run at once on one process; none delays another. Traced as the span
    /// `plugin.invoke` (gen-ai / MCP attribute names; never the user id, arguments or tokens).
    pub async fn invoke(&self, req: InvokeRequest) -> Result<InvokeOutput, InvokeError> {
        match self.attempt(req).await {
            Attempt::Ran(result) => result,
            Attempt::Closed(_) => Err(InvokeError::Closed),
        }
    }

    /// [`Session::invoke`], handing the request back untouched when this session was closed before it reached
    /// the process (evicted between a lookup and this call): the caller can send it to a fresh session without
    /// having kept a copy.
    pub async fn attempt(&self, req: InvokeRequest) -> Attempt {
        use tracing::Instrument as _;
        let span = tracing::info_span!(
            "plugin.invoke",
            otel.kind = "client",
            otel.status_code = tracing::field::Empty,
            gen_ai.operation.name = "execute_tool",
            gen_ai.tool.name = %req.tool,
            gen_ai.tool.call.id = %req.invoke_id,
            mcp.method.name = "invoke",
            rpc.system = "jsonrpc",
            executa.invoke_id = %req.invoke_id,
            executa.tool_id = %self.inner.shared.tool_id,
            executa.warm = tracing::field::Empty,
            executa.outcome = tracing::field::Empty,
            error.type = tracing::field::Empty,
        );
        let attempt = self.invoke_traced(req).instrument(span.clone()).await;
        match &attempt {
            Attempt::Ran(Ok(out)) => {
                span.record("executa.warm", out.warm);
                span.record(
                    "executa.outcome",
                    if out.success() { "success" } else { "tool_failed" },
                );
            }
            Attempt::Ran(Err(e)) => {
                span.record("executa.outcome", "error");
                span.record("otel.status_code", "ERROR");
                span.record("error.type", e.kind());
            }
            Attempt::Closed(_) => {
                span.record("executa.outcome", "error");
                span.record("otel.status_code", "ERROR");
                span.record("error.type", InvokeError::Closed.kind());
            }
        }
        attempt
    }

    async fn invoke_traced(&self, req: InvokeRequest) -> Attempt {
        self.touch();
        let limit = self.inner.shared.config.max_in_flight_per_session;
        let Ok(_permit) = self.inner.in_flight.clone().try_acquire_owned() else {
            return Attempt::Ran(Err(InvokeError::TooManyInFlight { limit }));
        };
        // The process must be ready within the invoke's own time (a first launch may need the 60 s describe).
        let wait = req
            .timeout
            .unwrap_or(limits::DEFAULT_INVOKE_TIMEOUT)
            .max(limits::DESCRIBE_TIMEOUT_FIRST_LAUNCH);
        let waited = Instant::now();
        let (process, warm) = match self.process(wait).await {
            Ok(p) => p,
            Err(InvokeError::Closed) => return Attempt::Closed(req),
            Err(e) => return Attempt::Ran(Err(e)),
        };
        let metrics = &self.inner.shared.metrics;
        if !warm {
            metrics.observe_cold_start(waited.elapsed());
        }
        WorkerMetrics::inc(if warm {
            &metrics.warm_hits
        } else {
            &metrics.cold_starts
        });
        let result = self.invoke_on(&process, req, warm).await;
        self.touch();
        Attempt::Ran(result)
    }

    async fn invoke_on(
        &self,
        process: &Arc<Process>,
        req: InvokeRequest,
        warm: bool,
    ) -> Result<InvokeOutput, InvokeError> {
        let shared = &self.inner.shared;
        let Some(hs) = process.handshake.get() else {
            return Err(InvokeError::NotReady(Duration::ZERO));
        };
        let Some(tool) = hs.manifest.tool(&req.tool) else {
            return Err(InvokeError::UnknownTool {
                tool: req.tool.clone(),
                available: hs.manifest.tools.iter().map(|t| t.name.clone()).collect(),
            });
        };
        let timeout = req.timeout.unwrap_or_else(|| tool.timeout());
        let deadline_ms = req.deadline_ms.unwrap_or_else(|| {
            now_ms().saturating_add(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX))
        });
        // Tokens and the user's stored credentials in one round trip (no lookup when none is declared).
        let names: Vec<String> = hs.manifest.credentials.iter().map(|c| c.name.clone()).collect();
        let token_request = TokenRequest {
            user: shared.user.clone(),
            tool_id: shared.tool_id.clone(),
            invoke_id: req.invoke_id.clone(),
            negotiated: hs.negotiated.clone(),
            declared: hs.manifest.host_capabilities.clone(),
            credentials: names.clone(),
            deadline_ms,
        };
        if let Some(d) = &req.delegation {
            shared.tokens.delegate(&req.invoke_id, d.clone());
        }
        let lookup = async {
            if names.is_empty() {
                Ok(CredentialValues::default())
            } else {
                shared
                    .tokens
                    .credentials(&shared.user, &shared.tool_id, &names, deadline_ms)
                    .await
            }
        };
        // Both ride out a store that does not answer for a while (a NATS node lost), never past the invoke's
        // own deadline: the plugin is not asked once its time is up.
        let until = tokio::time::Instant::now() + Duration::from_millis(deadline_ms.saturating_sub(now_ms()));
        let (minted, stored) = tokio::time::timeout_at(until, async {
            tokio::join!(shared.tokens.tokens(token_request.clone()), lookup)
        })
        .await
        .map_err(|_| InvokeError::Timeout(timeout))?;
        let stored = stored.map_err(|e| InvokeError::CredentialsUnavailable(e.0))?;
        let credentials = declared_credentials(&hs.manifest, &req.credentials, stored.0)?;
        // A careless plugin logging what it was given keeps it out of its stderr ring (and every error built from it).
        if let Some(given) = &credentials {
            shared
                .stderr
                .remember_secrets(given.values().filter_map(Value::as_str));
        }
        let tokens = withhold(minted, hs);
        let mut arguments = req.arguments;
        tool.apply_defaults(&mut arguments);
        let context = InvokeContext {
            invoke_id: Some(req.invoke_id.clone()),
            deadline_ms: Some(deadline_ms),
            credentials,
            sampling_token: tokens.sampling.clone(),
            storage_token: tokens.storage.clone(),
            upload_token: tokens.upload.clone(),
            image_token: tokens.image.clone(),
            credentials_token: tokens.credentials.clone(),
            plugin_name: hs
                .manifest
                .display_name
                .clone()
                .or_else(|| hs.manifest.name.clone()),
            extra: req.extra_context,
        };
        let params = InvokeParams {
            tool: req.tool,
            arguments,
            context,
            timeout: req.app_timeout_ms,
            invoke_id: Some(req.invoke_id.clone()),
        };
        let (done, _) = watch::channel(false);
        let active = Arc::new(ActiveInvoke {
            invoke_id: req.invoke_id.clone(),
            tool: params.tool.clone(),
            sink: req.progress,
            gate: ProgressGate::new(),
            tokens: std::sync::Mutex::new(tokens),
            token_request,
            deadline_ms,
            done,
            cancel: Notify::new(),
            cancelled: AtomicBool::new(false),
            span: tracing::Span::current(),
        });
        if process.register(active.clone()).is_none() {
            return Err(InvokeError::DuplicateInvokeId(req.invoke_id));
        }
        let _registered = Unregister {
            process: process.clone(),
            invoke_id: req.invoke_id.clone(),
        };
        // A cancel that arrived while the process was starting applies now.
        if self.inner.early_cancels.take(&req.invoke_id) {
            WorkerMetrics::inc(&shared.metrics.invokes_cancelled);
            return Err(InvokeError::Cancelled);
        }
        let started = Instant::now();
        let metrics = &shared.metrics;
        // The invoke's time and its cancel hold from here: a plugin that stopped reading its stdin (the writer's
        // queue full) cannot keep the request waiting past either, and it was never sent then.
        let expires = tokio::time::Instant::now() + timeout;
        let (id, rx) = tokio::select! {
            sent = process.child.request(methods::INVOKE, Some(params)) => sent.map_err(|f| self.failure(f))?,
            () = tokio::time::sleep_until(expires) => {
                WorkerMetrics::inc(&metrics.invokes_timed_out);
                tracing::warn!(tool_id = %shared.tool_id, pid = process.child.pid, "the plugin read none of its stdin for the invoke's whole timeout");
                return Err(InvokeError::Timeout(timeout));
            }
            () = active.cancel.notified() => {
                WorkerMetrics::inc(&metrics.invokes_cancelled);
                return Err(InvokeError::Cancelled);
            }
        };
        tokio::select! {
            reply = rx => {
                let reply = reply.unwrap_or_else(|_| Err(Failure::Exited(ExitInfo::unknown())));
                match reply {
                    Ok(frame) => {
                        process.answered.store(true, Ordering::Relaxed);
                        WorkerMetrics::inc(&metrics.invokes_completed);
                        output(frame, started.elapsed(), warm)
                    }
                    Err(f) => Err(self.failure(f)),
                }
            }
            () = tokio::time::sleep_until(expires) => {
                process.child.abandon(id);
                WorkerMetrics::inc(&metrics.invokes_timed_out);
                self.cancel_fallback(process.clone(), id);
                Err(InvokeError::Timeout(timeout))
            }
            () = active.cancel.notified() => {
                process.child.abandon(id);
                WorkerMetrics::inc(&metrics.invokes_cancelled);
                self.cancel_fallback(process.clone(), id);
                Err(InvokeError::Cancelled)
            }
        }
    }

    fn failure(&self, f: Failure) -> InvokeError {
        match f {
            Failure::Exited(exit) => {
                WorkerMetrics::inc(&self.inner.shared.metrics.invokes_lost);
                InvokeError::ProcessExited {
                    exit,
                    stderr_tail: self.inner.shared.stderr.tail(5),
                }
            }
            Failure::FrameTooLarge {
                frame_bytes,
                max_frame_bytes,
            } => InvokeError::FrameTooLarge {
                frame_bytes,
                max_frame_bytes,
            },
            // A request that could not be written is reported as before this core existed.
            Failure::FileTransport(reason) | Failure::Write(reason) => InvokeError::FileTransport(reason),
        }
    }

    /// The cancel fallback (spec §10.6 HR-CJ-03): if the plugin still owes the answer after the delay, kill the
    /// session's process tree — at once with [`CancelKill::Always`](crate::config::CancelKill), or once no other
    /// invoke runs on the process with `WhenIdle` (the default). The session restarts for the next call.
    fn cancel_fallback(&self, process: Arc<Process>, id: u64) {
        let after = self.inner.shared.config.cancel_kill_after;
        let policy = self.inner.shared.config.cancel_kill;
        tokio::spawn(async move {
            tokio::select! {
                () = tokio::time::sleep(after) => {}
                _ = process.child.exited() => return,
            }
            loop {
                if !process.child.still_busy_with(id) {
                    return;
                }
                if policy == crate::config::CancelKill::Always || process.active_invokes() == 0 {
                    tracing::info!(tool_id = %process.shared.tool_id, pid = process.child.pid, "plugin still busy with a cancelled invoke: killing its process tree");
                    process.child.kill_tree().await;
                    return;
                }
                // Other invokes are running: look again shortly (ends when they finish, the answer comes, or the
                // process exits).
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_millis(50)) => {}
                    _ = process.child.exited() => return,
                }
            }
        });
    }

    /// Cancels an invoke: its caller gets [`InvokeError::Cancelled`] at once. An invoke that is not active yet
    /// (its process still starting) is cancelled as soon as it registers. Returns whether it was active.
    /// Cancelling twice (or an unknown id) is harmless.
    pub fn cancel(&self, invoke_id: &str) -> bool {
        let active = self.ready().and_then(|p| p.find_invoke(invoke_id));
        let Some(invoke) = active else {
            self.inner.early_cancels.note(invoke_id);
            return false;
        };
        if invoke.cancelled.swap(true, Ordering::SeqCst) {
            return false;
        }
        invoke.cancel.notify_one();
        true
    }

    /// Whether an invoke with this id is active on the session.
    pub fn has_invoke(&self, invoke_id: &str) -> bool {
        self.ready().is_some_and(|p| p.find_invoke(invoke_id).is_some())
    }

    /// Health (spec §3.6): `health` with a 3 s timeout; -32601 counts as healthy.
    pub async fn health(&self) -> Health {
        let Some(process) = self.ready() else {
            return match self.state() {
                SessionState::Starting | SessionState::Backoff | SessionState::Idle => Health::Starting,
                _ => Health::Unhealthy,
            };
        };
        // One deadline for the write and the answer: a plugin that stopped reading its stdin is unhealthy, and
        // cannot hold the health poller.
        let expires = tokio::time::Instant::now() + limits::HEALTH_TIMEOUT;
        let Ok(Ok((id, rx))) =
            tokio::time::timeout_at(expires, process.child.request::<Value>(methods::HEALTH, None)).await
        else {
            return Health::Unhealthy;
        };
        match tokio::time::timeout_at(expires, rx).await {
            Ok(Ok(Ok(frame))) => match frame.kind() {
                FrameKind::ErrorResponse => match frame.error() {
                    Some(Ok(e)) if e.code == codes::METHOD_NOT_FOUND => Health::Healthy,
                    _ => Health::Unhealthy,
                },
                _ => frame
                    .parse_payload::<HealthResult>()
                    .ok()
                    .flatten()
                    .map_or(Health::Unhealthy, |h| h.classify()),
            },
            Ok(_) => Health::Unhealthy,
            Err(_) => {
                process.child.abandon(id);
                Health::Unhealthy
            }
        }
    }

    /// Shuts the session down (close stdin → grace → SIGTERM → grace → SIGKILL of the tree), removes its cgroup.
    pub async fn shutdown(&self) {
        self.request_shutdown();
        let mut finished = self.inner.finished.subscribe();
        // The sender lives in `self.inner`: the channel cannot close while this waits.
        let _ = finished.wait_for(|f| *f).await;
    }

    /// Asks the supervisor to shut the session down and returns at once ([`shutdown`](Self::shutdown) also waits
    /// for the end). For whoever takes a session out of the pool: the request holds even if the task meant to
    /// wait for it never runs.
    pub fn request_shutdown(&self) {
        // `send_replace`, not `send`: `send` stores nothing while no receiver exists, which is the case until the
        // supervisor first runs — a shutdown right after `new` was then lost and this waited for good.
        self.inner.shutdown.send_replace(true);
    }

    /// Whether the supervisor has ended (the process gone, the cgroup removed).
    pub fn finished(&self) -> bool {
        *self.inner.finished.borrow()
    }

    /// Clears a Stopped state so the next call starts the plugin afresh (an operator action).
    pub fn reset(&self) {
        self.inner.phase.send_if_modified(|p| {
            if matches!(p, Phase::Stopped(_)) {
                *p = Phase::Idle;
                true
            } else {
                false
            }
        });
        self.inner.demand.notify_one();
    }
}

struct Unregister {
    process: Arc<Process>,
    invoke_id: String,
}

impl Drop for Unregister {
    fn drop(&mut self) {
        self.process.unregister(&self.invoke_id);
    }
}

/// Only the credentials the manifest declares (spec §4.2), each from the first that has it: the request's own
/// `credentials`, the user's stored values (`stored`: the plugin's, else the user-wide one), the manifest's
/// `default`; a name with none of them is absent, and refused when `required`.
fn declared_credentials(
    manifest: &Manifest,
    configured: &Map<String, Value>,
    mut stored: Map<String, Value>,
) -> Result<Option<Map<String, Value>>, InvokeError> {
    let mut out = Map::new();
    let mut missing = Vec::new();
    for c in &manifest.credentials {
        if let Some(v) = configured.get(&c.name) {
            out.insert(c.name.clone(), v.clone());
        } else if let Some(v) = stored.remove(&c.name) {
            out.insert(c.name.clone(), v);
        } else if let Some(d) = &c.default {
            out.insert(c.name.clone(), Value::String(d.clone()));
        } else if c.required {
            missing.push(c.name.clone());
        }
    }
    if !missing.is_empty() {
        return Err(InvokeError::CredentialsRequired { missing });
    }
    Ok((!out.is_empty()).then_some(out))
}

/// Withholds every token whose capability the plugin did not negotiate (v1: all of them).
pub(crate) fn withhold(tokens: InvokeTokens, hs: &Handshake) -> InvokeTokens {
    if hs.protocol == ProtocolVersion::V1 {
        return InvokeTokens::default();
    }
    let has = |k: &str| hs.negotiated.contains(k);
    InvokeTokens {
        sampling: tokens
            .sampling
            .filter(|_| has(keys::SAMPLING) || has(keys::EMBED) || has(keys::AGENT)),
        storage: tokens.storage.filter(|_| has(keys::STORAGE)),
        upload: tokens.upload.filter(|_| has(keys::UPLOAD)),
        image: tokens.image.filter(|_| has(keys::IMAGE) || has(keys::IMAGE_EDIT)),
        credentials: tokens.credentials,
        // Web needs no capability key (spec §3.3 HR-LC-15: "(v2)").
        web: tokens.web,
        renew_at_ms: tokens.renew_at_ms,
    }
}

// -------------------------------------------------------------------------------------------------------------
// The supervisor
// -------------------------------------------------------------------------------------------------------------

async fn supervise(inner: Arc<Inner>) {
    // Told however the task ends (its end, a panic, an abort): no `shutdown` waits for good.
    let _finished = Finished(inner.clone());
    let shared = inner.shared.clone();
    let mut shutdown = inner.shutdown.subscribe();
    let mut crashes: u32 = 0;
    'life: loop {
        let shutting_down = *shutdown.borrow();
        if shutting_down {
            break;
        }
        let waiting = matches!(&*inner.phase.borrow(), Phase::Idle | Phase::Stopped(_));
        if waiting {
            tokio::select! {
                () = inner.demand.notified() => {}
                () = requested(&mut shutdown) => break 'life,
            }
            let stopped = matches!(&*inner.phase.borrow(), Phase::Stopped(_));
            if stopped {
                continue;
            }
        }
        inner.phase.send_replace(Phase::Starting);
        let parent = inner
            .spawn_parent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        let span = tracing::info_span!(
            parent: parent.as_ref().and_then(tracing::Span::id),
            "plugin.session.spawn",
            executa.tool_id = %shared.tool_id,
            executa.protocol = tracing::field::Empty,
            executa.outcome = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
        );
        // The caller's span must not outlive the spawn (this loop iteration lasts the process's whole life).
        drop(parent);
        // A shutdown does not wait for the start (spawn, `initialize`, `describe`: up to a minute on a first
        // launch): the process it spawned, if any, is killed — it never served.
        let spawned = Mutex::new(None);
        let started = {
            use tracing::Instrument as _;
            tokio::select! {
                started = start(&inner, &spawned).instrument(span.clone()) => started,
                () = requested(&mut shutdown) => {
                    let process = spawned.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
                    if let Some(process) = process {
                        process.child.kill_tree().await;
                    }
                    break 'life;
                }
            }
        };
        match &started {
            Ok(p) => {
                span.record("executa.outcome", "ready");
                if let Some(hs) = p.handshake.get() {
                    span.record(
                        "executa.protocol",
                        if hs.protocol == ProtocolVersion::V2 {
                            "v2"
                        } else {
                            "v1"
                        },
                    );
                }
            }
            Err(_) => {
                span.record("executa.outcome", "failed");
                span.record("otel.status_code", "ERROR");
            }
        }
        drop(span);
        let last_error = match started {
            Ok(process) => {
                inner.phase.send_replace(Phase::Ready(process.clone()));
                tokio::select! {
                    exit = process.child.exited() => {
                        if exit.host_initiated {
                            inner.phase.send_replace(Phase::Idle);
                            crashes = 0;
                            continue 'life;
                        }
                        WorkerMetrics::inc(&shared.metrics.crashes);
                        crashes = if process.answered.load(Ordering::Relaxed) { 1 } else { crashes + 1 };
                        tracing::warn!(tool_id = %shared.tool_id, user_key = %fleet_proto::api::user_key(&shared.user), %exit, crashes, "plugin exited unexpectedly");
                        format!("the plugin exited unexpectedly ({exit}); stderr: {}", shared.stderr.tail(5))
                    }
                    () = requested(&mut shutdown) => {
                        shutdown_ladder(&process, shared.config.shutdown_grace).await;
                        break 'life;
                    }
                }
            }
            Err(StartError::Fatal(msg)) => {
                WorkerMetrics::inc(&shared.metrics.stopped);
                tracing::warn!(tool_id = %shared.tool_id, user_key = %fleet_proto::api::user_key(&shared.user), error = %msg, "plugin session stopped");
                inner.phase.send_replace(Phase::Stopped(msg.into()));
                continue 'life;
            }
            Err(StartError::Transient(msg)) => {
                crashes += 1;
                msg
            }
        };
        if crashes > shared.config.max_restarts {
            WorkerMetrics::inc(&shared.metrics.stopped);
            let msg = format!("stopped after {crashes} failures in a row; last: {last_error}");
            tracing::warn!(tool_id = %shared.tool_id, user_key = %fleet_proto::api::user_key(&shared.user), error = %msg, "plugin session stopped");
            inner.phase.send_replace(Phase::Stopped(msg.into()));
            crashes = 0;
            continue 'life;
        }
        inner.phase.send_replace(Phase::Backoff);
        let delay = shared
            .config
            .restart_backoff
            .saturating_mul(1 << (crashes - 1).min(16));
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = requested(&mut shutdown) => break 'life,
        }
        WorkerMetrics::inc(&shared.metrics.restarts);
    }
    inner.phase.send_replace(Phase::Closed);
    // Removal waits for the kernel (kill, rmdir retries): off the async threads.
    let sandbox = shared.sandbox.clone();
    let removed = tokio::task::spawn_blocking(move || sandbox.release()).await;
    if let Ok(Err(e)) = removed {
        tracing::warn!(tool_id = %shared.tool_id, error = %e, "removing the session cgroup failed");
    }
}

/// Sets `finished` when dropped (the end of the supervisor's task, however it ends).
struct Finished(Arc<Inner>);

impl Drop for Finished {
    fn drop(&mut self) {
        self.0.finished.send_replace(true);
    }
}

/// Resolves once shutdown is requested (the watch guard is not held across the caller's awaits).
async fn requested(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

/// close stdin → grace → SIGTERM → grace → SIGKILL of the whole tree (spec §3.7 HR-SD-01).
async fn shutdown_ladder(process: &Arc<Process>, grace: Duration) {
    process.child.close_stdin();
    if tokio::time::timeout(grace, process.child.exited()).await.is_ok() {
        return;
    }
    process.child.terminate_tree();
    if tokio::time::timeout(grace, process.child.exited()).await.is_ok() {
        return;
    }
    process.child.kill_tree().await;
    let _ = tokio::time::timeout(grace, process.child.exited()).await;
}

/// Spawn → `initialize` (v1 fallback) → `describe`. The process is put in `spawned` as soon as it runs (for
/// the supervisor to kill if it gives the start up).
async fn start(
    inner: &Arc<Inner>,
    spawned: &Mutex<Option<Arc<Process>>>,
) -> Result<Arc<Process>, StartError> {
    let shared = &inner.shared;
    let process = Process::spawn(shared)
        .await
        .map_err(|e| StartError::Fatal(e.to_string()))?;
    *spawned.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(process.clone());
    // A plugin that ended during the handshake may never have started (a stub's `exec` failed): that is a
    // spawn error, as fatal as a direct spawn's.
    let exited = async |what: &str, info: ExitInfo| match process.child.start_error().await {
        Some(e) => StartError::Fatal(e.to_string()),
        None => StartError::Transient(format!(
            "the plugin exited during {what} ({info}); stderr: {}",
            shared.stderr.tail(5)
        )),
    };

    let offer = InitializeParams {
        protocol_version: PROTOCOL_V2.into(),
        client_info: PeerInfo {
            name: "cloud-agents".into(),
            version: env!("CARGO_PKG_VERSION").into(),
        },
        capabilities: shared.services.offer(),
        host_capabilities: object(json!({ "llm.sample": true })),
    };
    // `describe` is written right behind `initialize`, without waiting for its answer: a plugin reads its
    // stdin in order, so it still sees `initialize` first and `describe` second (§3.1, §16 A-6), and the
    // handshake costs one round trip instead of two. A v1 plugin answers `initialize` with "method not
    // found" and then `describe` as before. `describe`'s timeout runs from `initialize`'s outcome, as if it
    // had been sent then.
    let (init_id, init_rx) = match process.child.request(methods::INITIALIZE, Some(offer)).await {
        Ok(sent) => sent,
        Err(Failure::Exited(info)) => return Err(exited("initialize", info).await),
        Err(other) => return Err(StartError::Transient(format!("{other:?}"))),
    };
    let (describe_id, describe_rx) = match process.child.request::<Value>(methods::DESCRIBE, None).await {
        Ok(sent) => sent,
        Err(Failure::Exited(info)) => return Err(exited("describe", info).await),
        Err(other) => return Err(StartError::Transient(format!("{other:?}"))),
    };
    let (protocol, negotiated) = match tokio::time::timeout(limits::INITIALIZE_TIMEOUT, init_rx).await {
        Ok(Ok(Ok(frame))) if frame.kind() == FrameKind::Response => {
            match frame.parse_payload::<InitializeResult>() {
                Ok(Some(r)) if r.protocol() == ProtocolVersion::V2 => (ProtocolVersion::V2, r.negotiated()),
                _ => (ProtocolVersion::V1, BTreeSet::new()),
            }
        }
        Ok(Ok(Ok(_error_response))) => (ProtocolVersion::V1, BTreeSet::new()),
        Ok(Ok(Err(Failure::Exited(info)))) => return Err(exited("initialize", info).await),
        Ok(Ok(Err(_))) | Ok(Err(_)) => (ProtocolVersion::V1, BTreeSet::new()),
        Err(_) => {
            process.child.abandon(init_id);
            (ProtocolVersion::V1, BTreeSet::new())
        }
    };
    if protocol == ProtocolVersion::V1 {
        WorkerMetrics::inc(&shared.metrics.v1_fallbacks);
    }

    let first = inner.first_launch.load(Ordering::Relaxed);
    let describe_timeout = if first {
        limits::DESCRIBE_TIMEOUT_FIRST_LAUNCH
    } else {
        limits::DESCRIBE_TIMEOUT
    };
    let frame = match tokio::time::timeout(describe_timeout, describe_rx).await {
        Ok(Ok(Ok(frame))) => frame,
        Ok(Ok(Err(Failure::Exited(info)))) => return Err(exited("describe", info).await),
        Ok(Ok(Err(other))) => {
            process.child.kill_tree().await;
            return Err(StartError::Transient(format!("describe failed: {other:?}")));
        }
        Ok(Err(_)) => return Err(StartError::Transient("describe: the process went away".into())),
        Err(_) => {
            process.child.abandon(describe_id);
            process.child.kill_tree().await;
            return Err(StartError::Transient(format!(
                "describe timed out after {describe_timeout:?}"
            )));
        }
    };
    let manifest = match frame.kind() {
        FrameKind::ErrorResponse => {
            process.child.kill_tree().await;
            let e = frame
                .error()
                .and_then(Result::ok)
                .map_or_else(|| "an error".to_string(), |e| e.to_string());
            return Err(StartError::Fatal(format!("describe answered {e}")));
        }
        _ => {
            let value: Value = frame.parse_payload().ok().flatten().unwrap_or(Value::Null);
            match Manifest::from_value(&value) {
                Ok(v) => {
                    for w in &v.warnings {
                        tracing::info!(tool_id = %shared.tool_id, warning = %w, "manifest warning");
                    }
                    Arc::new(v.manifest)
                }
                Err(e) => {
                    process.child.kill_tree().await;
                    return Err(StartError::Fatal(e.to_string()));
                }
            }
        }
    };
    let manifest = match pinned(shared, manifest, describe_timeout).await {
        Ok(m) => m,
        Err(e) => {
            process.child.kill_tree().await;
            return Err(e);
        }
    };
    if first {
        inner.first_launch.store(false, Ordering::Relaxed);
        if let Err(e) = shared.install.mark_described() {
            tracing::debug!(tool_id = %shared.tool_id, error = %e, "cannot record the first describe");
        }
    }
    let _ = process.handshake.set(Handshake {
        protocol,
        negotiated,
        manifest,
    });
    Ok(process)
}

/// For a real user's session, the runtime manifest narrowed to the one the fleet recorded (`pin.rs`), waiting
/// for the record at most `wait`; the fleet's own describe (a reserved user) is what gets recorded, so it stands.
/// A plugin that declares credentials or host capabilities while no record can be read (not recorded yet, the
/// store away) does not start ([`StartError::Transient`]: the next call tries again), rather than run for its
/// whole life without them.
async fn pinned(
    shared: &SessionShared,
    manifest: Arc<Manifest>,
    wait: Duration,
) -> Result<Arc<Manifest>, StartError> {
    use crate::services::Recorded;
    if shared.user.starts_with(fleet_proto::api::RESERVED_USER_PREFIX) {
        return Ok(manifest);
    }
    let recorded = tokio::time::timeout(wait, shared.tokens.recorded_manifest(&shared.tool_id))
        .await
        .unwrap_or(Recorded::Missing);
    let (kept, drift) = pin::restrict(Arc::unwrap_or_clone(manifest), &recorded);
    if recorded == Recorded::Missing && drift.any() {
        return Err(StartError::Transient(
            "the plugin's manifest is not recorded yet; it gets no credential or host capability until it is"
                .into(),
        ));
    }
    if drift.any() {
        shared.metrics.manifest_drift(&shared.tool_id);
        tracing::warn!(
            tool_id = %shared.tool_id,
            extra_credentials = drift.credentials,
            extra_host_capabilities = drift.host_capabilities,
            extra_tools = drift.tools,
            "the plugin declares more than its recorded manifest; the extra is withheld"
        );
    }
    Ok(Arc::new(kept))
}

fn object(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => Map::new(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use serde_json::json;

    use super::*;

    fn manifest() -> Manifest {
        let m = json!({
            "name": "m", "version": "1.0.0", "description": "d",
            "tools": [{"name": "t", "description": "d", "parameters": []}],
            "credentials": [
                {"name": "API_KEY"},
                {"name": "REGION", "required": false, "default": "eu-west"},
                {"name": "OPTIONAL_TOKEN", "required": false},
            ],
        });
        Manifest::from_value(&m).unwrap().manifest
    }

    fn map(v: Value) -> Map<String, Value> {
        serde_json::from_value(v).unwrap()
    }

    /// Spec §4.2: only declared names; the request's value, then the stored one, then the default; a required
    /// name with none refuses the invoke and names only the missing names.
    #[test]
    fn declared_credentials_resolve_in_order_and_enforce_required() {
        let m = manifest();
        let stored = map(json!({"API_KEY": "stored", "REGION": "stored-region", "UNDECLARED": "x"}));
        let out = declared_credentials(&m, &Map::new(), stored.clone())
            .unwrap()
            .unwrap();
        assert_eq!(
            Value::Object(out),
            json!({"API_KEY": "stored", "REGION": "stored-region"})
        );

        let given = map(json!({"API_KEY": "given"}));
        let out = declared_credentials(&m, &given, stored).unwrap().unwrap();
        assert_eq!(out["API_KEY"], "given");

        let out = declared_credentials(&m, &Map::new(), map(json!({"API_KEY": "k"})))
            .unwrap()
            .unwrap();
        assert_eq!(Value::Object(out), json!({"API_KEY": "k", "REGION": "eu-west"}));

        let err = declared_credentials(&m, &Map::new(), map(json!({"REGION": "secret-r"}))).unwrap_err();
        assert_eq!(
            err,
            InvokeError::CredentialsRequired {
                missing: vec!["API_KEY".into()]
            }
        );
        assert!(!err.to_string().contains("secret-r"));
    }
}
