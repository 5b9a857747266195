//! One Animus plugin process: spawned into its own cgroup under the user's uid, one writer task, one reader task
//! that classifies every frame, the table of host requests awaiting answers, the notification sink of the run in
//! flight (at most one), an exit watcher that kills the rest of the cgroup, and the liveness loop (`$/ping`,
//! `health/check`).
//!
//! Invariants: no lock is held across an `.await`; a dead process fails every pending request at once; a
//! response whose id matches no pending request (late, after a cancel, or sent before `initialize`) is counted
//! and dropped; a plugin → host request is answered -32601 (Animus defines none); a structured JSON-RPC error is
//! an answer, never a sign of a dead process.

use std::collections::{HashMap, VecDeque};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use fleet_proto::animus::{
    self, HealthCheckResult, HealthStatus, HostCapabilities, HostInfo, InitializeParams, InitializeResult,
    methods,
};
use fleet_proto::codec::io::{FrameReader, FrameWriter, ReadError};
use fleet_proto::codec::{Frame, FrameError, FrameKind};
use fleet_proto::jsonrpc::{ErrorObject, Id, Notification, Request, Response, codes};
use fleet_proto::limits;
use serde::Serialize;
use serde_json::{Map, Value};
use tokio::io::AsyncBufReadExt as _;
use tokio::process::{Child, Command};
use tokio::sync::{oneshot, watch};

use crate::catalogue::Install;
use crate::config::WorkerConfig;
use crate::metrics::WorkerMetrics;
use crate::sandbox::{SessionCgroup, UserSpace};
use crate::session::{ExitInfo, WorkerContext};

/// Lines of stderr kept per process (never parsed: spec §1.1).
const STDERR_LINES: usize = 50;
/// Longest stderr line kept, in bytes.
const STDERR_LINE_BYTES: usize = 1024;

/// A request's outcome: the answer frame, or the process ended first.
pub(crate) type Reply = Result<Frame, ExitInfo>;

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

    fn from_animus(s: HealthStatus) -> HealthState {
        match s {
            HealthStatus::Healthy => HealthState::Healthy,
            HealthStatus::Degraded => HealthState::Degraded,
            HealthStatus::Unhealthy => HealthState::Unhealthy,
        }
    }
}

/// Where the notifications of the run in flight go (called on the reader task, must not block).
pub(crate) type NotificationSink = Arc<dyn Fn(&str, Frame) + Send + Sync>;

/// A running Animus plugin process.
pub(crate) struct AnimusProcess {
    /// The plan it was spawned with, kept for the process's life: it holds an egress-granted plugin's network
    /// namespace and proxy.
    _plan: crate::sandbox::SpawnPlan,
    pub(crate) pid: u32,
    pub(crate) user: String,
    pub(crate) tool_id: String,
    writer: FrameWriter,
    next_id: AtomicU64,
    pending: Mutex<HashMap<u64, oneshot::Sender<Reply>>>,
    sink: Mutex<Option<NotificationSink>>,
    exit: watch::Receiver<Option<ExitInfo>>,
    host_kill: AtomicBool,
    cgroup: Arc<Mutex<Option<SessionCgroup>>>,
    isolated: bool,
    stderr: Arc<Mutex<VecDeque<String>>>,
    metrics: Arc<WorkerMetrics>,
    /// What `initialize` answered.
    pub(crate) info: OnceLock<InitializeResult>,
    /// Consecutive `$/ping` misses.
    pub(crate) ping_misses: AtomicU32,
    /// The last `health/check` answer.
    pub(crate) health: Mutex<HealthState>,
    /// A run is in flight on it.
    pub(crate) busy: AtomicBool,
    /// The user's workspace (the run's `cwd` and `project_root`).
    pub(crate) workspace: std::path::PathBuf,
    /// The install (version) directory it was started from.
    pub(crate) install_dir: std::path::PathBuf,
    last_used: Mutex<Instant>,
}

impl std::fmt::Debug for AnimusProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AnimusProcess")
            .field("pid", &self.pid)
            .field("tool_id", &self.tool_id)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The plugin's environment: the worker's allow-list and the install's `env` names, the user's directories;
/// nothing else (credentials never enter the environment).
pub(crate) fn environment(
    config: &WorkerConfig,
    install: &Install,
    space: &UserSpace,
) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = Vec::new();
    for name in config.env_allowlist.iter().chain(install.env.iter()) {
        if let Ok(v) = std::env::var(name)
            && !env.iter().any(|(k, _)| k == name)
        {
            env.push((name.clone(), v));
        }
    }
    for (k, v) in [
        ("HOME", &space.workspace),
        ("ANNA_WORKSPACE_DIR", &space.workspace),
        ("TMPDIR", &space.tmpdir),
    ] {
        env.retain(|(name, _)| name != k);
        env.push((k.to_string(), v.display().to_string()));
    }
    env
}

/// Why a process could not be started and handshaken.
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum StartError {
    /// Retrying cannot help: the plugin is refused (version, kind, bad answer, spawn refused).
    #[error("{0}")]
    Refused(String),
    /// May work next time (exited or timed out during the handshake).
    #[error("{0}")]
    Transient(String),
}

impl AnimusProcess {
    /// Spawns the plugin for `user` into a new cgroup and starts its tasks.
    pub(crate) fn spawn(
        ctx: &WorkerContext,
        user: &str,
        install: &Install,
    ) -> Result<Arc<AnimusProcess>, StartError> {
        let refused = |e: &dyn std::fmt::Display| StartError::Refused(e.to_string());
        let crate::sandbox::Prepared { space, cgroup, plan } = ctx
            .sandbox
            .prepare(
                user,
                &install.tool_id,
                "a",
                install.effective_limits(ctx.config.limits),
                &install.dir,
                &install.argv,
            )
            .map_err(|e| refused(&e))?;
        let program = install.argv.first().cloned().unwrap_or_default();
        let mut cmd = Command::new(&program);
        cmd.args(install.argv.iter().skip(1))
            .current_dir(&install.dir)
            .env_clear()
            .envs(environment(&ctx.config, install, &space))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        crate::sandbox::apply(&mut cmd, &plan);
        let remove_cgroup = |cg: Option<SessionCgroup>| {
            if let Some(cg) = cg {
                let _ = cg.remove();
            }
        };
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                remove_cgroup(cgroup);
                return Err(StartError::Refused(format!("cannot start {program:?}: {e}")));
            }
        };
        WorkerMetrics::inc(&ctx.metrics.spawns);
        WorkerMetrics::inc(&ctx.metrics.animus.spawns);
        let pid = child.id().unwrap_or(0);
        let (Some(stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            return Err(StartError::Refused(
                "the plugin's stdio could not be captured".into(),
            ));
        };
        let (writer, _task) = FrameWriter::spawn(stdin);
        let (exit_tx, exit_rx) = watch::channel(None);
        // Ids start at a per-process offset: a frame a plugin writes before reading anything cannot match one.
        let first_id = 1 + (u64::from(std::process::id()) ^ u64::from(pid)).wrapping_mul(7919) % 1_000_000;
        let process = Arc::new(AnimusProcess {
            _plan: plan,
            pid,
            user: user.to_string(),
            tool_id: install.tool_id.clone(),
            writer,
            next_id: AtomicU64::new(first_id),
            pending: Mutex::new(HashMap::new()),
            sink: Mutex::new(None),
            exit: exit_rx,
            host_kill: AtomicBool::new(false),
            isolated: cgroup.is_some(),
            cgroup: Arc::new(Mutex::new(cgroup)),
            stderr: Arc::new(Mutex::new(VecDeque::new())),
            metrics: ctx.metrics.clone(),
            info: OnceLock::new(),
            ping_misses: AtomicU32::new(0),
            health: Mutex::new(HealthState::Starting),
            busy: AtomicBool::new(false),
            workspace: space.workspace.clone(),
            install_dir: install.dir.clone(),
            last_used: Mutex::new(Instant::now()),
        });
        tokio::spawn(drain_stderr(process.stderr.clone(), stderr));
        tokio::spawn(process.clone().read_loop(FrameReader::new(stdout)));
        tokio::spawn(process.clone().wait_loop(child, exit_tx));
        Ok(process)
    }

    /// `initialize` → major-version check → `initialized`. Domain calls are sent only after this returns.
    pub(crate) async fn handshake(
        &self,
        traceparent: Option<String>,
    ) -> Result<&InitializeResult, StartError> {
        let mut init_extensions = Map::new();
        if let Some(tp) = traceparent {
            init_extensions.insert(animus::TRACEPARENT_EXTENSION.into(), Value::String(tp));
        }
        let params = InitializeParams {
            protocol_version: animus::PROTOCOL_VERSION.into(),
            host_info: HostInfo {
                name: animus::HOST_NAME.into(),
                version: env!("CARGO_PKG_VERSION").into(),
            },
            capabilities: HostCapabilities {
                streaming: true,
                progress: true,
                cancellation: true,
            },
            init_extensions,
        };
        let frame = match self
            .call(
                methods::INITIALIZE,
                Some(params),
                limits::ANIMUS_INITIALIZE_TIMEOUT,
            )
            .await
        {
            Ok(f) => f,
            Err(CallError::Exited(info)) => {
                return Err(StartError::Transient(format!(
                    "the plugin exited during initialize ({info}); stderr: {}",
                    self.stderr_tail(5)
                )));
            }
            Err(CallError::Timeout) => {
                return Err(StartError::Transient(format!(
                    "initialize unanswered after {:?}",
                    limits::ANIMUS_INITIALIZE_TIMEOUT
                )));
            }
            Err(CallError::Write(e)) => return Err(StartError::Transient(e)),
        };
        if frame.kind() == FrameKind::ErrorResponse {
            let e = frame
                .error()
                .and_then(Result::ok)
                .map_or_else(|| "an error".into(), |e| e.to_string());
            return Err(StartError::Refused(format!("initialize answered {e}")));
        }
        let result: InitializeResult = match frame.parse_payload() {
            Ok(Some(r)) => r,
            Ok(None) => return Err(StartError::Refused("initialize answered no result".into())),
            Err(e) => return Err(StartError::Refused(format!("initialize answer unreadable: {e}"))),
        };
        animus::check_compatible(&result.protocol_version).map_err(|e| StartError::Refused(e.to_string()))?;
        if !result.plugin_info.plugin_kind.is_hosted() {
            return Err(StartError::Refused(format!(
                "Animus plugin kind `{}` is not hosted (only provider and custom)",
                result.plugin_info.plugin_kind
            )));
        }
        self.notify::<Value>(methods::INITIALIZED, None).await;
        let _ = self.info.set(result);
        self.info
            .get()
            .ok_or_else(|| StartError::Refused("initialize result lost".into()))
    }

    /// The `initialize` answer (set once the handshake completed).
    pub(crate) fn capabilities(&self) -> Option<&InitializeResult> {
        self.info.get()
    }

    /// Sends a request; returns its id and where the answer will arrive.
    pub(crate) async fn request<P: Serialize>(
        &self,
        method: &str,
        params: Option<P>,
    ) -> Result<(u64, oneshot::Receiver<Reply>), CallError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        lock(&self.pending).insert(id, tx);
        if let Some(info) = self.exit_info() {
            lock(&self.pending).remove(&id);
            return Err(CallError::Exited(info));
        }
        let request = Request {
            jsonrpc: fleet_proto::jsonrpc::V2,
            id: Id::number(id),
            method: method.into(),
            params,
        };
        if let Err(e) = self.writer.send(&request).await {
            lock(&self.pending).remove(&id);
            return Err(match self.exit_info() {
                Some(info) => CallError::Exited(info),
                None => CallError::Write(format!("cannot write to the plugin: {e}")),
            });
        }
        WorkerMetrics::inc(&self.metrics.frames_written);
        Ok((id, rx))
    }

    /// A request with a timeout; a late answer is dropped.
    pub(crate) async fn call<P: Serialize>(
        &self,
        method: &str,
        params: Option<P>,
        timeout: Duration,
    ) -> Result<Frame, CallError> {
        let (id, rx) = self.request(method, params).await?;
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(Ok(frame))) => Ok(frame),
            Ok(Ok(Err(info))) => Err(CallError::Exited(info)),
            Ok(Err(_)) => Err(CallError::Exited(self.exit_info().unwrap_or_else(unknown_exit))),
            Err(_) => {
                self.forget(id);
                Err(CallError::Timeout)
            }
        }
    }

    /// Sends a notification (best effort: a dead plugin needs none).
    pub(crate) async fn notify<P: Serialize>(&self, method: &str, params: Option<P>) {
        let n = Notification {
            jsonrpc: fleet_proto::jsonrpc::V2,
            method: method.into(),
            params,
        };
        if self.writer.send(&n).await.is_ok() {
            WorkerMetrics::inc(&self.metrics.frames_written);
        }
    }

    /// Stops waiting for `id`: its answer, if it comes, is dropped.
    pub(crate) fn forget(&self, id: u64) {
        lock(&self.pending).remove(&id);
    }

    /// Routes notifications to `sink` (the run in flight), or drops them (`None`).
    pub(crate) fn set_sink(&self, sink: Option<NotificationSink>) {
        *lock(&self.sink) = sink;
    }

    /// When a call last ended on it (or it started).
    pub(crate) fn last_used(&self) -> Instant {
        *lock(&self.last_used)
    }

    /// Records the end of a call.
    pub(crate) fn touch(&self) {
        *lock(&self.last_used) = Instant::now();
    }

    /// Whether new work may use this process.
    pub(crate) fn usable(&self) -> bool {
        !self.host_kill.load(Ordering::SeqCst) && self.exit_info().is_none()
    }

    /// How the process ended, if it has.
    pub(crate) fn exit_info(&self) -> Option<ExitInfo> {
        self.exit.borrow().clone()
    }

    /// Waits until the process has ended.
    pub(crate) async fn exited(&self) -> ExitInfo {
        let mut rx = self.exit.clone();
        match rx.wait_for(Option::is_some).await {
            Ok(info) => info.clone().unwrap_or_else(unknown_exit),
            Err(_) => unknown_exit(),
        }
    }

    /// The last `n` stderr lines.
    pub(crate) fn stderr_tail(&self, n: usize) -> String {
        let lines = lock(&self.stderr);
        let skip = lines.len().saturating_sub(n);
        lines.iter().skip(skip).cloned().collect::<Vec<_>>().join("\n")
    }

    /// Kills the whole process tree now, as a host decision.
    pub(crate) async fn kill_tree(&self) {
        self.host_kill.store(true, Ordering::SeqCst);
        WorkerMetrics::inc(&self.metrics.tree_kills);
        self.kill_cgroup().await;
    }

    async fn kill_cgroup(&self) {
        let cgroup = self.cgroup.clone();
        let (pid, isolated) = (self.pid, self.isolated);
        // Killing waits for the kernel: off the async threads.
        let _ = tokio::task::spawn_blocking(move || {
            let guard = lock(&cgroup);
            match guard.as_ref() {
                Some(cg) => {
                    let _ = cg.kill_all();
                }
                None if !isolated => {
                    if let Some(pid) = i32::try_from(pid).ok().and_then(rustix::process::Pid::from_raw) {
                        let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
                    }
                }
                None => {}
            }
        })
        .await;
    }

    /// The Animus shutdown ladder: `shutdown` (answered within 2 s, or not) → `exit` → close stdin → `grace`
    /// for the process to end → SIGKILL of the whole tree. Returns once the process has exited.
    pub(crate) async fn shutdown(&self, grace: Duration) {
        if self.exit_info().is_some() {
            return;
        }
        self.host_kill.store(true, Ordering::SeqCst);
        let _ = self
            .call::<Value>(methods::SHUTDOWN, None, limits::ANIMUS_SHUTDOWN_TIMEOUT)
            .await;
        self.notify::<Value>(methods::EXIT, None).await;
        self.writer.close().await;
        if tokio::time::timeout(grace, self.exited()).await.is_ok() {
            return;
        }
        self.kill_tree().await;
        let _ = tokio::time::timeout(grace, self.exited()).await;
    }

    /// One `$/ping` (≤ 1 s). Any answer — an error included — proves the read loop is alive.
    pub(crate) async fn ping(&self) -> bool {
        let ok = self
            .call::<Value>(methods::PING, None, limits::ANIMUS_PING_TIMEOUT)
            .await
            .is_ok();
        if ok {
            self.ping_misses.store(0, Ordering::Relaxed);
        } else {
            self.ping_misses.fetch_add(1, Ordering::Relaxed);
            WorkerMetrics::inc(&self.metrics.animus.ping_misses);
        }
        ok
    }

    /// One `health/check`; the answer is recorded.
    pub(crate) async fn health_check(&self) -> HealthState {
        let state = match self
            .call::<Value>(methods::HEALTH_CHECK, None, limits::ANIMUS_HEALTH_TIMEOUT)
            .await
        {
            Ok(frame) if frame.kind() == FrameKind::Response => frame
                .parse_payload::<HealthCheckResult>()
                .ok()
                .flatten()
                .map_or(HealthState::Unhealthy, |h| HealthState::from_animus(h.status)),
            // -32601 / -32001: a plugin without health/check is judged by its pings.
            Ok(frame) => match frame.error().and_then(Result::ok) {
                Some(e)
                    if e.code == codes::METHOD_NOT_FOUND || e.code == animus::codes::METHOD_NOT_SUPPORTED =>
                {
                    HealthState::Healthy
                }
                _ => HealthState::Unhealthy,
            },
            Err(_) => HealthState::Unhealthy,
        };
        *lock(&self.health) = state;
        state
    }

    // ---------------------------------------------------------------------------------------------------------
    // Tasks
    // ---------------------------------------------------------------------------------------------------------

    async fn wait_loop(self: Arc<Self>, mut child: Child, exit_tx: watch::Sender<Option<ExitInfo>>) {
        let status = child.wait().await;
        // The plugin is gone: its descendants go with it.
        self.kill_cgroup().await;
        let (status, clean) = match status {
            Ok(s) => (s.to_string(), s.success()),
            Err(e) => (format!("wait failed: {e}"), false),
        };
        let info = ExitInfo {
            status,
            clean,
            oom: false,
            host_initiated: self.host_kill.load(Ordering::SeqCst),
        };
        let _ = exit_tx.send(Some(info.clone()));
        let pending: Vec<_> = lock(&self.pending).drain().collect();
        for (_, tx) in pending {
            let _ = tx.send(Err(info.clone()));
        }
        self.set_sink(None);
        let cgroup = lock(&self.cgroup).take();
        if let Some(cg) = cgroup {
            let removed = tokio::task::spawn_blocking(move || cg.remove()).await;
            if let Ok(Err(e)) = removed {
                tracing::warn!(tool_id = %self.tool_id, error = %e, "removing an Animus process cgroup failed");
            }
        }
    }

    async fn read_loop(self: Arc<Self>, mut reader: FrameReader<tokio::process::ChildStdout>) {
        while let Some(item) = reader.next().await {
            match item {
                Ok(frame) => {
                    WorkerMetrics::inc(&self.metrics.frames_read);
                    self.dispatch(frame).await;
                }
                Err(ReadError::Frame(e)) => self.on_bad_frame(&e),
                Err(ReadError::Io(_)) => break,
            }
        }
        // stdout closed: a process that cannot answer is useless; it gets a short grace to exit on its own.
        if tokio::time::timeout(limits::ANIMUS_SHUTDOWN_TIMEOUT, self.exited())
            .await
            .is_err()
        {
            self.kill_tree().await;
        }
    }

    fn on_bad_frame(&self, e: &FrameError) {
        self.metrics.frame_error(e.kind());
        tracing::debug!(tool_id = %self.tool_id, error = %e, "bad frame from an Animus plugin");
        if let FrameError::TooLarge {
            id_hint: Some(id), ..
        } = e
            && let Some(id) = id.as_u64()
        {
            // The answer was too large to use: the caller gets an internal error instead of waiting.
            let tx = lock(&self.pending).remove(&id);
            if let Some(tx) = tx {
                let err = Response::<Value>::err(
                    Id::number(id),
                    ErrorObject::new(
                        codes::INTERNAL_ERROR,
                        format!("the plugin's answer was refused: {e}"),
                    ),
                );
                if let Ok(bytes) = serde_json::to_vec(&err)
                    && let Ok(frame) = Frame::parse(bytes.into())
                {
                    let _ = tx.send(Ok(frame));
                }
            }
        }
    }

    async fn dispatch(&self, frame: Frame) {
        match frame.kind() {
            FrameKind::Response | FrameKind::ErrorResponse => {
                let tx = frame
                    .id()
                    .and_then(Id::as_u64)
                    .and_then(|id| lock(&self.pending).remove(&id));
                match tx {
                    Some(tx) => {
                        let _ = tx.send(Ok(frame));
                    }
                    None => WorkerMetrics::inc(&self.metrics.unmatched_responses),
                }
            }
            FrameKind::Request => {
                // Animus defines no plugin → host request.
                if let Some(id) = frame.id().cloned() {
                    let method = frame.method().unwrap_or("").to_string();
                    let reply = Response::<Value>::err(
                        id,
                        ErrorObject::new(
                            codes::METHOD_NOT_FOUND,
                            format!("the host offers no method {method:?} to Animus plugins"),
                        ),
                    );
                    let _ = self.writer.send(&reply).await;
                }
            }
            // File transport is an Executa mechanism: an Animus plugin has no business sending it.
            FrameKind::FileTransport => WorkerMetrics::inc(&self.metrics.unmatched_responses),
            FrameKind::Notification => {
                let method = frame.method().unwrap_or("").to_string();
                if method == methods::LOG_ENTRY {
                    tracing::debug!(tool_id = %self.tool_id, entry = frame.params_json().unwrap_or(""), "plugin log entry");
                    return;
                }
                let sink = lock(&self.sink).clone();
                match sink {
                    Some(sink) => sink(&method, frame),
                    None => WorkerMetrics::inc(&self.metrics.ignored_notifications),
                }
            }
        }
    }
}

/// Why a request got no answer.
#[derive(Debug, Clone)]
pub(crate) enum CallError {
    /// The process ended.
    Exited(ExitInfo),
    /// No answer in time.
    Timeout,
    /// The frame could not be written.
    Write(String),
}

fn unknown_exit() -> ExitInfo {
    ExitInfo {
        status: "unknown".into(),
        clean: false,
        oom: false,
        host_initiated: false,
    }
}

async fn drain_stderr(ring: Arc<Mutex<VecDeque<String>>>, stderr: tokio::process::ChildStderr) {
    let mut lines = tokio::io::BufReader::new(stderr).split(b'\n');
    while let Ok(Some(line)) = lines.next_segment().await {
        let mut text = String::from_utf8_lossy(&line[..line.len().min(STDERR_LINE_BYTES)]).into_owned();
        text.retain(|c| c != '\r');
        let mut ring = lock(&ring);
        if ring.len() == STDERR_LINES {
            ring.pop_front();
        }
        ring.push_back(text);
    }
}
