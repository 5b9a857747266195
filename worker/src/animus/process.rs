//! The Animus dialect of a plugin process (the core is [`crate::child`]): spawned into its own sandbox (a cgroup
//! per process) under the user's uid, the handshake, the notification sink of the run in flight (at most one),
//! and the liveness calls (`$/ping`, `health/check`).
//!
//! Invariants: no lock is held across an `.await`; a dead process fails every pending request at once (the
//! core) and its sandbox is released; a response whose id matches no pending request (late, after a cancel, or
//! sent before `initialize`) is counted and dropped (the core); a plugin → host request is answered -32601
//! (Animus defines none); a structured JSON-RPC error is an answer, never a sign of a dead process.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use fleet_proto::animus::{
    self, HealthCheckResult, HostCapabilities, HostInfo, InitializeParams, InitializeResult, methods,
};
use fleet_proto::codec::{Frame, FrameError, FrameKind};
use fleet_proto::jsonrpc::{ErrorObject, Id, Response, codes};
use fleet_proto::limits;
use serde::Serialize;
use serde_json::{Map, Value};
use tokio::sync::oneshot;

use crate::catalogue::Install;
use crate::child::{ChildProcess, Dialect, ExitInfo, Failure, Sandboxed, Spawn, StderrRing, for_log, lock};
use crate::config::WorkerConfig;
use crate::metrics::WorkerMetrics;
use crate::sandbox::UserSpace;
use crate::types::{HealthState, WorkerContext};

/// A request's outcome: the answer frame (an answer over the frame limit is an internal-error answer), or why
/// there is none.
pub(crate) type Reply = crate::child::Reply;

/// Where the notifications of the run in flight go (called on the reader task, must not block).
pub(crate) type NotificationSink = Arc<dyn Fn(&str, Frame) + Send + Sync>;

/// A running Animus plugin process.
pub(crate) struct AnimusProcess {
    /// The process core: pid, writer, pending requests, exit, tree, stderr.
    pub(crate) child: ChildProcess,
    pub(crate) user: String,
    pub(crate) tool_id: String,
    sink: Mutex<Option<NotificationSink>>,
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
            .field("pid", &self.child.pid)
            .field("tool_id", &self.tool_id)
            .finish_non_exhaustive()
    }
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
    /// Spawns the plugin for `user` into a new sandbox and starts its tasks.
    pub(crate) async fn spawn(
        ctx: &WorkerContext,
        user: &str,
        install: &Install,
    ) -> Result<Arc<AnimusProcess>, StartError> {
        let refused = |e: &dyn std::fmt::Display| StartError::Refused(e.to_string());
        let prepared = ctx
            .sandbox
            .prepare(
                user,
                &install.tool_id,
                "a",
                install.effective_limits(ctx.config.limits),
                &install.dir,
                &install.argv,
                crate::sandbox::Start::Worker,
            )
            .map_err(|e| refused(&e))?;
        let sandbox = Arc::new(Sandboxed::new(prepared));
        let env = environment(&ctx.config, install, sandbox.space());
        let spawned = ChildProcess::spawn(
            &install.argv,
            &install.dir,
            env,
            Spawn {
                tool_id: install.tool_id.clone(),
                sandbox: sandbox.clone(),
                stderr: StderrRing::new(ctx.config.stderr_ring_bytes),
                metrics: ctx.metrics.clone(),
                // Ids start at a per-process offset: a frame a plugin writes before reading anything cannot
                // match one.
                first_id: |pid| {
                    1 + (u64::from(std::process::id()) ^ u64::from(pid)).wrapping_mul(7919) % 1_000_000
                },
                eof_grace: limits::ANIMUS_SHUTDOWN_TIMEOUT,
            },
        )
        .await;
        let (child, tasks) = match spawned {
            Ok(spawned) => spawned,
            Err(e) => {
                let _ = sandbox.release();
                return Err(refused(&e));
            }
        };
        // From a stub: wait for its `exec` (an Animus plugin is spawned once per call, so the round trip this
        // saves an Executa session does not apply), so a failed start is refused like a direct spawn's.
        if let Some(e) = child.start_error().await {
            drop((child, tasks));
            let _ = sandbox.release();
            return Err(refused(&e));
        }
        WorkerMetrics::inc(&ctx.metrics.animus.spawns);
        let process = Arc::new(AnimusProcess {
            child,
            user: user.to_string(),
            tool_id: install.tool_id.clone(),
            sink: Mutex::new(None),
            info: OnceLock::new(),
            ping_misses: AtomicU32::new(0),
            health: Mutex::new(HealthState::Starting),
            busy: AtomicBool::new(false),
            workspace: sandbox.space().workspace.clone(),
            install_dir: install.dir.clone(),
            last_used: Mutex::new(Instant::now()),
        });
        tasks.start(&process);
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
                    self.child.stderr_tail(5)
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
        self.notify::<Value>(methods::INITIALIZED, None);
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
        self.child.request(method, params).await.map_err(CallError::from)
    }

    /// A request with a timeout; a late answer is dropped.
    pub(crate) async fn call<P: Serialize>(
        &self,
        method: &str,
        params: Option<P>,
        timeout: Duration,
    ) -> Result<Frame, CallError> {
        let deadline = tokio::time::Instant::now() + timeout;
        // The send is inside the time too: a plugin that stopped reading its stdin fills the writer's queue, and a
        // send would wait for room forever (a shutdown's `shutdown` call, a health check's `$/ping`).
        let (id, rx) = match tokio::time::timeout_at(deadline, self.request(method, params)).await {
            Ok(sent) => sent?,
            Err(_) => return Err(CallError::Timeout),
        };
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(Ok(frame))) => Ok(frame),
            Ok(Ok(Err(failure))) => Err(failure.into()),
            Ok(Err(_)) => Err(CallError::Exited(
                self.child.exit_info().unwrap_or_else(ExitInfo::unknown),
            )),
            Err(_) => {
                self.forget(id);
                Err(CallError::Timeout)
            }
        }
    }

    /// Sends a notification, best effort (the process core's `notify`: never waits).
    pub(crate) fn notify<P: Serialize>(&self, method: &str, params: Option<P>) {
        self.child.notify(method, params);
    }

    /// Stops waiting for `id`: its answer, if it comes, is dropped.
    pub(crate) fn forget(&self, id: u64) {
        self.child.abandon(id);
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

    /// The Animus shutdown ladder: `shutdown` (answered within 2 s, or not) → `exit` → close stdin → `grace`
    /// for the process to end → SIGKILL of the whole tree. Returns once the process has exited.
    pub(crate) async fn shutdown(&self, grace: Duration) {
        if self.child.exit_info().is_some() {
            return;
        }
        self.child.host_ends();
        let _ = self
            .call::<Value>(methods::SHUTDOWN, None, limits::ANIMUS_SHUTDOWN_TIMEOUT)
            .await;
        self.notify::<Value>(methods::EXIT, None);
        self.child.close_stdin();
        if tokio::time::timeout(grace, self.child.exited()).await.is_ok() {
            return;
        }
        self.child.kill_tree().await;
        let _ = tokio::time::timeout(grace, self.child.exited()).await;
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
            WorkerMetrics::inc(&self.child.metrics.animus.ping_misses);
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
    // Frames other than answers
    // ---------------------------------------------------------------------------------------------------------

    async fn dispatch(&self, frame: Frame) {
        match frame.kind() {
            // Answers never reach here: the core hands them to their callers.
            FrameKind::Response | FrameKind::ErrorResponse => self.child.answer(frame),
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
                    let _ = self.child.writer().send(&reply).await;
                }
            }
            // File transport is an Executa mechanism: an Animus plugin has no business sending it.
            FrameKind::FileTransport => WorkerMetrics::inc(&self.child.metrics.unmatched_responses),
            FrameKind::Notification => {
                let method = frame.method().unwrap_or("").to_string();
                if method == methods::LOG_ENTRY {
                    let entry = for_log(frame.params_json().unwrap_or(""));
                    tracing::debug!(tool_id = %self.tool_id, %entry, "plugin log entry");
                    return;
                }
                let sink = lock(&self.sink).clone();
                match sink {
                    Some(sink) => sink(&method, frame),
                    None => WorkerMetrics::inc(&self.child.metrics.ignored_notifications),
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

impl From<Failure> for CallError {
    fn from(f: Failure) -> CallError {
        match f {
            Failure::Exited(info) => CallError::Exited(info),
            other => CallError::Write(other.to_string()),
        }
    }
}

impl Dialect for AnimusProcess {
    fn child(&self) -> &ChildProcess {
        &self.child
    }

    async fn on_frame(self: Arc<Self>, frame: Frame) {
        self.dispatch(frame).await;
    }

    /// The answer was too large to use: the caller gets an internal error instead of waiting.
    fn too_large(&self, id: u64, error: &FrameError) -> crate::child::Reply {
        let err = Response::<Value>::err(
            Id::number(id),
            ErrorObject::new(
                codes::INTERNAL_ERROR,
                format!("the plugin's answer was refused: {error}"),
            ),
        );
        let frame = serde_json::to_vec(&err)
            .map_err(|e| Failure::Write(e.to_string()))
            .and_then(|bytes| Frame::parse(bytes.into()).map_err(|e| Failure::Write(e.to_string())))?;
        Ok(frame)
    }

    async fn on_exit(&self, _info: &ExitInfo) {
        self.set_sink(None);
        // The process's own sandbox goes with it (removal waits for the kernel: off the async threads).
        let sandbox = self.child.sandbox().clone();
        let removed = tokio::task::spawn_blocking(move || sandbox.release()).await;
        if let Ok(Err(e)) = removed {
            tracing::warn!(tool_id = %self.tool_id, error = %e, "removing an Animus process cgroup failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::AnimusProcess;
    use crate::child::testing::{
        GUARD, alive, assert_noisy_stderr_kept_safely, eventually, noisy_stderr, worker,
    };
    use crate::child::{ExitInfo, Failure};
    use crate::metrics::WorkerMetrics;

    /// When the plugin exits, the request it owed an answer fails at once with how it ended, and what it left
    /// running in its tree is killed.
    #[tokio::test]
    async fn an_exit_fails_pending_requests_and_kills_the_rest_of_the_tree() {
        let w = worker("an-exit", |_| {});
        let script = "sleep 600 & echo $! >&2; read -r line; exit 7";
        let install = w.install("an-exit", &["/bin/sh", "-c", script], json!({}));
        let p = AnimusProcess::spawn(&w.ctx, "alice", &install).await.unwrap();
        assert!(eventually(|| !p.child.stderr_tail(1).is_empty()).await);
        let grandchild: u32 = p.child.stderr_tail(1).parse().unwrap();
        assert!(alive(grandchild));
        let (_, answer) = p.child.request::<Value>("notes/count", None).await.unwrap();
        let reply = tokio::time::timeout(GUARD, answer)
            .await
            .expect("answered")
            .unwrap();
        match reply {
            Err(Failure::Exited(ExitInfo {
                status,
                clean: false,
                oom: false,
                host_initiated: false,
            })) => assert_eq!(status, "exit status: 7"),
            other => panic!("expected the exit, got {other:?}"),
        }
        assert!(eventually(|| !alive(grandchild)).await);
    }

    /// An Animus process's stderr goes through the shared ring: JWTs redacted, long lines cut at 4 KB and marked
    /// (it used to keep raw 1 KB prefixes).
    #[tokio::test]
    async fn stderr_is_redacted_and_bounded_per_line() {
        let w = worker("an-stderr", |_| {});
        let script = format!("{}; exec cat >/dev/null", noisy_stderr());
        let install = w.install("an-stderr", &["/bin/sh", "-c", &script], json!({}));
        let p = AnimusProcess::spawn(&w.ctx, "alice", &install).await.unwrap();
        assert!(eventually(|| p.child.stderr_tail(1) == "end").await);
        assert_noisy_stderr_kept_safely(&p.child.stderr_tail(3));
        p.child.kill_tree().await;
        tokio::time::timeout(GUARD, p.child.exited())
            .await
            .expect("exits");
    }

    /// The exit watcher attributes an OOM kill of an Animus process and counts it (it used to report none).
    #[tokio::test]
    async fn an_oom_kill_is_attributed_and_counted() {
        let w = worker("an-oom", |_| {});
        let install = w.install(
            "an-oom",
            &["/usr/bin/python3", "-c", "b = bytearray(256 << 20)"],
            json!({ "limits": { "memory_bytes": 64 << 20 } }),
        );
        let p = AnimusProcess::spawn(&w.ctx, "alice", &install).await.unwrap();
        let exit = tokio::time::timeout(GUARD, p.child.exited())
            .await
            .expect("exits");
        assert!(exit.oom, "{exit}");
        assert!(exit.status.contains("SIGKILL"), "{exit}");
        assert!(!exit.host_initiated, "{exit}");
        assert_eq!(WorkerMetrics::get(&w.metrics.oom_kills), 1);
    }

    /// Frames, bytes and bad frames an Animus plugin writes are counted as they are read (bytes used to be
    /// counted for Executa only).
    #[tokio::test]
    async fn frames_bytes_and_bad_frames_read_are_counted() {
        const FRAME: &str = r#"{"jsonrpc":"2.0","method":"agent/output","params":{}}"#;
        let w = worker("an-bytes", |_| {});
        let script = format!("printf '%s\\n' '{FRAME}' 'not json'; exec cat >/dev/null");
        let install = w.install("an-bytes", &["/bin/sh", "-c", &script], json!({}));
        let p = AnimusProcess::spawn(&w.ctx, "alice", &install).await.unwrap();
        let m = &w.metrics;
        assert!(
            eventually(|| WorkerMetrics::get(&m.frames_read) == 1 && m.frame_errors("invalid_json") == 1)
                .await
        );
        // While the plugin still runs.
        assert!(p.child.exit_info().is_none());
        let written = FRAME.len() + 1 + "not json\n".len();
        assert_eq!(WorkerMetrics::get(&m.bytes_read), written as u64);
        // No run in flight: the notification had nowhere to go.
        assert_eq!(WorkerMetrics::get(&m.ignored_notifications), 1);
        p.child.kill_tree().await;
        tokio::time::timeout(GUARD, p.child.exited())
            .await
            .expect("exits");
    }
}
