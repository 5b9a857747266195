//! One plugin process: spawn, the single reader task that classifies every frame, the single writer, the
//! table of host requests awaiting an answer, the table of active invokes (for reverse-RPC routing and
//! progress), file transport, and the exit watcher.
//!
//! Invariants: no lock is held across an `.await`; a dead process fails every pending request at once; every
//! process the plugin started dies with it (the session's cgroup, or its process group without isolation).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use fleet_proto::codec::io::{FrameReader, FrameWriter, ReadError};
use fleet_proto::codec::{Frame, FrameError, FrameKind};
use fleet_proto::executa::invoke::{PROGRESS_METHOD, ProgressType};
use fleet_proto::executa::lifecycle::ProtocolVersion;
use fleet_proto::executa::manifest::Manifest;
use fleet_proto::executa::reverse::{Family, correlation, family_of, method_not_found, upload};
use fleet_proto::jsonrpc::{ErrorObject, Id, Request, Response, codes};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use tokio::process::{Child, Command};
use tokio::sync::{Notify, oneshot, watch};

use super::SessionShared;
use super::progress::{ProgressGate, ProgressSink, ProgressUpdate};
use super::transport::read_transport_file;
use crate::metrics::{ProgressDrop, WorkerMetrics};
use crate::services::{InvokeTokens, ReverseCall, TokenRequest};

/// How a process ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExitInfo {
    /// `exit status: 0`, `signal: 9 (SIGKILL)`, ...
    pub status: String,
    /// Whether it exited with status 0.
    pub clean: bool,
    /// Whether the cgroup's OOM counter rose while it ran.
    pub oom: bool,
    /// Whether the host ended it (shutdown, eviction, cancel fallback) rather than the plugin crashing.
    pub host_initiated: bool,
}

impl std::fmt::Display for ExitInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.status)?;
        if self.oom {
            write!(f, " (killed by the OOM killer: memory limit reached)")?;
        }
        Ok(())
    }
}

/// Why a host request got no normal answer.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Failure {
    /// The process ended.
    Exited(ExitInfo),
    /// The answer was over the frame limit and was discarded.
    FrameTooLarge { frame_bytes: u64, max_frame_bytes: u64 },
    /// The answer came by file transport and could not be used.
    FileTransport(String),
}

pub(crate) type Reply = Result<Frame, Failure>;

/// One invoke in flight on the process (for reverse-RPC routing, progress and cancel).
pub(crate) struct ActiveInvoke {
    pub(crate) invoke_id: String,
    pub(crate) sink: Option<ProgressSink>,
    pub(crate) gate: ProgressGate,
    /// The invoke's current tokens (replaced when they are due for renewal).
    pub(crate) tokens: Mutex<InvokeTokens>,
    /// What they were minted from (to mint them again).
    pub(crate) token_request: TokenRequest,
    pub(crate) deadline_ms: u64,
    /// Set when the invoke ends (any way): pending reverse calls are abandoned.
    pub(crate) done: watch::Sender<bool>,
    /// Notified by `cancel`.
    pub(crate) cancel: Notify,
    pub(crate) cancelled: AtomicBool,
    /// The invoke's `plugin.invoke` span (the parent of its reverse calls' spans).
    pub(crate) span: tracing::Span,
}

impl std::fmt::Debug for ActiveInvoke {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActiveInvoke")
            .field("invoke_id", &self.invoke_id)
            .finish_non_exhaustive()
    }
}

/// What the handshake learned.
#[derive(Debug, Clone)]
pub(crate) struct Handshake {
    pub(crate) protocol: ProtocolVersion,
    pub(crate) negotiated: BTreeSet<String>,
    pub(crate) manifest: Arc<Manifest>,
}

/// A running plugin process.
pub(crate) struct Process {
    pub(crate) pid: u32,
    pub(crate) shared: Arc<SessionShared>,
    writer: FrameWriter,
    next_id: AtomicU64,
    pending: Mutex<HashMap<u64, oneshot::Sender<Reply>>>,
    /// Host ids whose caller gave up (timeout, cancel): a late answer is discarded, and the cancel fallback
    /// kills the process if the plugin is still busy with one.
    abandoned: Mutex<HashSet<u64>>,
    pub(crate) invokes: Mutex<HashMap<String, Arc<ActiveInvoke>>>,
    pub(crate) handshake: OnceLock<Handshake>,
    exit: watch::Receiver<Option<ExitInfo>>,
    host_kill: Arc<AtomicBool>,
    /// The TMPDIR as the plugin got it and canonical: where file-transport pointers may point.
    tmpdirs: Vec<PathBuf>,
    /// Whether any invoke got an answer (a process that answers is not crash-looping).
    pub(crate) answered: AtomicBool,
    /// Reverse-RPC calls being served: bounded, so a plugin flooding requests cannot spawn unbounded work.
    reverse_slots: Arc<tokio::sync::Semaphore>,
}

/// Reverse-RPC calls served at once per process; more are refused with -32603 until one finishes.
pub(crate) const MAX_CONCURRENT_REVERSE_CALLS: usize = 256;

impl std::fmt::Debug for Process {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Process")
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

/// Why a process could not be started.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    /// The OS refused.
    #[error("cannot start {program:?}: {source}")]
    Os {
        /// argv[0].
        program: String,
        /// Why.
        source: std::io::Error,
    },
    /// stdio was not captured.
    #[error("the plugin's stdio could not be captured")]
    Stdio,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Process {
    /// Spawns the plugin into the session's sandbox and starts the reader, stderr and exit tasks.
    pub(crate) fn spawn(shared: &Arc<SessionShared>) -> Result<Arc<Process>, SpawnError> {
        let install = &shared.install;
        let program = install.argv.first().cloned().unwrap_or_default();
        let mut cmd = Command::new(&program);
        cmd.args(install.argv.iter().skip(1))
            .current_dir(&install.dir)
            .env_clear()
            .envs(shared.environment())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        crate::sandbox::apply(&mut cmd, &shared.spawn_plan);
        let oom_before = shared.oom_kills();
        let mut child = cmd.spawn().map_err(|source| SpawnError::Os {
            program: program.clone(),
            source,
        })?;
        WorkerMetrics::inc(&shared.metrics.spawns);
        let pid = child.id().unwrap_or(0);
        let (Some(stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            return Err(SpawnError::Stdio);
        };
        let (writer, _writer_task) = FrameWriter::spawn(stdin);
        let (exit_tx, exit_rx) = watch::channel(None);
        let process = Arc::new(Process {
            pid,
            shared: shared.clone(),
            writer,
            next_id: AtomicU64::new(0),
            pending: Mutex::new(HashMap::new()),
            abandoned: Mutex::new(HashSet::new()),
            invokes: Mutex::new(HashMap::new()),
            handshake: OnceLock::new(),
            exit: exit_rx,
            host_kill: Arc::new(AtomicBool::new(false)),
            tmpdirs: super::transport::tmpdir_forms(&shared.space.tmpdir),
            answered: AtomicBool::new(false),
            reverse_slots: Arc::new(tokio::sync::Semaphore::new(MAX_CONCURRENT_REVERSE_CALLS)),
        });
        tokio::spawn(shared.stderr.clone().drain(stderr));
        tokio::spawn(process.clone().read_loop(FrameReader::new(stdout)));
        tokio::spawn(process.clone().wait_loop(child, exit_tx, oom_before));
        Ok(process)
    }

    /// Sends a request; returns its host id and where the answer will arrive.
    pub(crate) async fn request<P: Serialize>(
        &self,
        method: &str,
        params: Option<P>,
    ) -> Result<(u64, oneshot::Receiver<Reply>), Failure> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        lock(&self.pending).insert(id, tx);
        if let Some(info) = self.exit_info() {
            lock(&self.pending).remove(&id);
            return Err(Failure::Exited(info));
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
                Some(info) => Failure::Exited(info),
                None => Failure::FileTransport(format!("cannot write to the plugin: {e}")),
            });
        }
        WorkerMetrics::inc(&self.shared.metrics.frames_written);
        Ok((id, rx))
    }

    /// The caller of `id` stopped waiting: a late answer will be discarded.
    pub(crate) fn abandon(&self, id: u64) {
        if lock(&self.pending).remove(&id).is_some() {
            lock(&self.abandoned).insert(id);
        }
    }

    /// Whether the plugin still owes the answer to an abandoned request.
    pub(crate) fn still_busy_with(&self, id: u64) -> bool {
        lock(&self.abandoned).contains(&id) && self.exit_info().is_none()
    }

    /// Whether new calls may use this process: it is running and the host has not decided to end it.
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

    /// Closes the plugin's stdin (the Executa shutdown signal).
    pub(crate) async fn close_stdin(&self) {
        self.writer.close().await;
    }

    /// Kills the whole process tree now, as a host decision (not counted as a crash).
    pub(crate) async fn kill_tree(&self) {
        self.host_kill.store(true, Ordering::SeqCst);
        WorkerMetrics::inc(&self.shared.metrics.tree_kills);
        kill_tree_blocking(&self.shared, self.pid).await;
    }

    /// Signals every process of the tree (the shutdown ladder's SIGTERM), as a host decision.
    pub(crate) fn terminate_tree(&self) {
        self.host_kill.store(true, Ordering::SeqCst);
        self.shared.signal_tree(self.pid, rustix::process::Signal::TERM);
    }

    /// Registers an active invoke; `None` if one with the same id is already active.
    pub(crate) fn register(&self, invoke: Arc<ActiveInvoke>) -> Option<()> {
        let mut invokes = lock(&self.invokes);
        if invokes.contains_key(&invoke.invoke_id) {
            return None;
        }
        invokes.insert(invoke.invoke_id.clone(), invoke);
        Some(())
    }

    /// Ends an active invoke: abandons its reverse calls.
    pub(crate) fn unregister(&self, invoke_id: &str) {
        if let Some(invoke) = lock(&self.invokes).remove(invoke_id) {
            let _ = invoke.done.send(true);
            self.shared.services.invoke_finished(invoke_id);
        }
    }

    pub(crate) fn active_invokes(&self) -> usize {
        lock(&self.invokes).len()
    }

    pub(crate) fn find_invoke(&self, invoke_id: &str) -> Option<Arc<ActiveInvoke>> {
        lock(&self.invokes).get(invoke_id).cloned()
    }

    // ---------------------------------------------------------------------------------------------------------
    // Tasks
    // ---------------------------------------------------------------------------------------------------------

    async fn wait_loop(
        self: Arc<Self>,
        mut child: Child,
        exit_tx: watch::Sender<Option<ExitInfo>>,
        oom_before: u64,
    ) {
        let status = child.wait().await;
        // The plugin is gone: its descendants go with it.
        kill_tree_blocking(&self.shared, self.pid).await;
        let oom = self.shared.oom_kills() > oom_before;
        let (status, clean) = match status {
            Ok(s) => (describe_status(s), s.success()),
            Err(e) => (format!("wait failed: {e}"), false),
        };
        let info = ExitInfo {
            status,
            clean,
            oom,
            host_initiated: self.host_kill.load(Ordering::SeqCst),
        };
        if oom {
            WorkerMetrics::inc(&self.shared.metrics.oom_kills);
        }
        let _ = exit_tx.send(Some(info.clone()));
        let pending: Vec<_> = lock(&self.pending).drain().collect();
        for (_, tx) in pending {
            let _ = tx.send(Err(Failure::Exited(info.clone())));
        }
        let invokes: Vec<_> = lock(&self.invokes).drain().collect();
        for (_, invoke) in invokes {
            let _ = invoke.done.send(true);
        }
    }

    async fn read_loop(self: Arc<Self>, mut reader: FrameReader<tokio::process::ChildStdout>) {
        while let Some(item) = reader.next().await {
            match item {
                Ok(frame) => {
                    WorkerMetrics::inc(&self.shared.metrics.frames_read);
                    self.dispatch(frame, 0).await;
                }
                Err(ReadError::Frame(e)) => self.on_bad_frame(&e),
                Err(ReadError::Io(e)) => {
                    tracing::debug!(tool_id = %self.shared.tool_id, error = %e, "plugin stdout failed");
                    break;
                }
            }
        }
        self.shared
            .metrics
            .bytes_read
            .fetch_add(reader.bytes_read(), Ordering::Relaxed);
        // stdout is closed: a process that cannot answer is useless. Give it the grace period to exit on its own
        // (the normal end after stdin EOF), then end it.
        if tokio::time::timeout(self.shared.config.shutdown_grace, self.exited())
            .await
            .is_err()
        {
            self.kill_tree().await;
        }
    }

    fn on_bad_frame(&self, e: &FrameError) {
        self.shared.metrics.frame_error(e.kind());
        tracing::debug!(tool_id = %self.shared.tool_id, error = %e, "bad frame from plugin");
        if let FrameError::TooLarge {
            frame_bytes,
            max_frame_bytes,
            id_hint: Some(id),
        } = e
            && let Some(id) = id.as_u64()
        {
            self.complete(
                id,
                Err(Failure::FrameTooLarge {
                    frame_bytes: *frame_bytes,
                    max_frame_bytes: *max_frame_bytes,
                }),
            );
        }
    }

    fn complete(&self, id: u64, reply: Reply) {
        let tx = lock(&self.pending).remove(&id);
        match tx {
            Some(tx) => {
                let _ = tx.send(reply);
            }
            None => {
                if !lock(&self.abandoned).remove(&id) {
                    tracing::debug!(tool_id = %self.shared.tool_id, id, "unmatched response id");
                }
                WorkerMetrics::inc(&self.shared.metrics.unmatched_responses);
            }
        }
    }

    async fn dispatch(self: &Arc<Self>, frame: Frame, depth: u8) {
        match frame.kind() {
            FrameKind::Response | FrameKind::ErrorResponse => match frame.id().and_then(Id::as_u64) {
                Some(id) => self.complete(id, Ok(frame)),
                None => WorkerMetrics::inc(&self.shared.metrics.unmatched_responses),
            },
            FrameKind::Request => match self.reverse_slots.clone().try_acquire_owned() {
                Ok(slot) => {
                    tokio::spawn(self.clone().on_request(frame, slot));
                }
                Err(_) => {
                    if let Some(id) = frame.id().cloned() {
                        let error = ErrorObject::new(
                            codes::INTERNAL_ERROR,
                            format!("more than {MAX_CONCURRENT_REVERSE_CALLS} reverse-RPC calls in flight"),
                        );
                        WorkerMetrics::inc(&self.shared.metrics.reverse_refused);
                        let _ = self.writer.send(&Response::<Value>::err(id, error)).await;
                    }
                }
            },
            FrameKind::Notification => {
                if frame.method() == Some(PROGRESS_METHOD) {
                    self.on_progress(&frame);
                } else {
                    WorkerMetrics::inc(&self.shared.metrics.ignored_notifications);
                }
            }
            FrameKind::FileTransport => {
                let pointer_id = frame.id().and_then(Id::as_u64);
                let resolved = if depth > 0 {
                    Err("a file-transported message is itself a pointer".to_string())
                } else {
                    let path = frame.file_transport_path().unwrap_or_default().to_string();
                    let tmpdirs = self.tmpdirs.clone();
                    tokio::task::spawn_blocking(move || {
                        let forms: Vec<&Path> = tmpdirs.iter().map(PathBuf::as_path).collect();
                        read_transport_file(Path::new(&path), &forms).map_err(|e| e.to_string())
                    })
                    .await
                    .unwrap_or_else(|e| Err(format!("file transport task failed: {e}")))
                };
                match resolved.and_then(|bytes| Frame::parse(bytes).map_err(|e| e.to_string())) {
                    Ok(inner) => {
                        WorkerMetrics::inc(&self.shared.metrics.file_transports);
                        Box::pin(self.dispatch(inner, depth + 1)).await;
                    }
                    Err(reason) => {
                        WorkerMetrics::inc(&self.shared.metrics.file_transport_refused);
                        tracing::warn!(tool_id = %self.shared.tool_id, %reason, "file transport refused");
                        if let Some(id) = pointer_id {
                            self.complete(id, Err(Failure::FileTransport(reason)));
                        }
                    }
                }
            }
        }
    }

    // ---------------------------------------------------------------------------------------------------------
    // Progress (spec §8.10)
    // ---------------------------------------------------------------------------------------------------------

    fn on_progress(&self, frame: &Frame) {
        #[derive(Deserialize)]
        struct Params<'a> {
            #[serde(rename = "type", default)]
            kind: Option<Value>,
            #[serde(borrow, default)]
            data: Option<&'a RawValue>,
            #[serde(default)]
            context: Option<Value>,
        }
        let metrics = &self.shared.metrics;
        let params: Params<'_> = match frame.params_json().map(serde_json::from_str).transpose() {
            Ok(Some(p)) => p,
            Ok(None) => return metrics.progress_drop(ProgressDrop::Uncorrelated),
            Err(_) => return metrics.progress_drop(ProgressDrop::Malformed),
        };
        let Some(invoke_id) = params
            .context
            .as_ref()
            .and_then(|c| c.get("invoke_id"))
            .and_then(Value::as_str)
        else {
            return metrics.progress_drop(ProgressDrop::Uncorrelated);
        };
        let Some(invoke) = self.find_invoke(invoke_id) else {
            return metrics.progress_drop(ProgressDrop::UnknownInvoke);
        };
        let Some(sink) = invoke.sink.as_ref() else {
            return metrics.progress_drop(ProgressDrop::NoChannel);
        };
        let data = params.data.map_or("null", RawValue::get);
        if let Err(reason) = invoke.gate.admit(data.len()) {
            return metrics.progress_drop(reason);
        }
        let Ok(data) = RawValue::from_string(data.to_string()) else {
            return metrics.progress_drop(ProgressDrop::Malformed);
        };
        WorkerMetrics::inc(&metrics.progress_accepted);
        sink(ProgressUpdate {
            kind: ProgressType::coerce(params.kind.as_ref().and_then(Value::as_str)),
            data,
        });
    }

    // ---------------------------------------------------------------------------------------------------------
    // Reverse RPC (spec §7)
    // ---------------------------------------------------------------------------------------------------------

    async fn on_request(self: Arc<Self>, frame: Frame, _slot: tokio::sync::OwnedSemaphorePermit) {
        use tracing::Instrument as _;
        let Some(id) = frame.id().cloned() else { return };
        let method = frame.method().unwrap_or_default();
        let family = family_of(method).map(Family::as_str);
        let parent = self.parent_span(&frame);
        let span = tracing::info_span!(
            parent: parent.as_ref().and_then(tracing::Span::id),
            "plugin.reverse_rpc",
            otel.kind = "server",
            rpc.system = "jsonrpc",
            rpc.method = %method,
            mcp.method.name = %method,
            executa.reverse.family = family.unwrap_or("unknown"),
            executa.tool_id = %self.shared.tool_id,
            executa.outcome = tracing::field::Empty,
            rpc.jsonrpc.error_code = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
        );
        let outcome = self.serve_reverse(&frame).instrument(span.clone()).await;
        match &outcome {
            Ok(_) => {
                span.record("executa.outcome", "ok");
            }
            Err(e) => {
                span.record("executa.outcome", "error");
                span.record("rpc.jsonrpc.error_code", e.code);
                span.record("otel.status_code", "ERROR");
            }
        }
        drop(span);
        WorkerMetrics::inc(&self.shared.metrics.reverse_calls);
        self.shared.metrics.reverse_call(
            frame.method().and_then(family_of).map(Family::as_str),
            outcome.as_ref().err().map(|e| e.code),
        );
        let response = match outcome {
            Ok(value) => Response::ok(id.clone(), value),
            Err(error) => {
                WorkerMetrics::inc(&self.shared.metrics.reverse_refused);
                Response::err(id.clone(), error)
            }
        };
        if let Err(e) = self.writer.send(&response).await {
            // Too large to send: answer with an error instead (the plugin must not wait forever).
            let error = ErrorObject::new(
                codes::INTERNAL_ERROR,
                format!("the host's answer could not be sent: {e}"),
            );
            let _ = self.writer.send(&Response::<Value>::err(id, error)).await;
        }
    }

    async fn serve_reverse(&self, frame: &Frame) -> Result<Value, ErrorObject> {
        let method = frame.method().unwrap_or_default().to_string();
        let family = family_of(&method).ok_or_else(|| method_not_found(&method))?;
        let Some(handshake) = self.handshake.get() else {
            return Err(family
                .not_negotiated()
                .error("the session is not initialised yet"));
        };
        if handshake.protocol == ProtocolVersion::V1 {
            return Err(family
                .not_negotiated()
                .error("v2 was not negotiated: reverse RPC is unavailable (v1 session)"));
        }
        let mut params = match frame.parse_payload::<Value>() {
            Ok(None) => Map::new(),
            Ok(Some(Value::Object(m))) => m,
            Ok(Some(_)) | Err(_) => {
                return Err(ErrorObject::new(
                    codes::INVALID_PARAMS,
                    "params must be an object",
                ));
            }
        };
        let named = params
            .get("context")
            .and_then(|c| c.get("invoke_id"))
            .and_then(Value::as_str)
            .map(String::from);
        let invoke = self.route(named.as_deref(), family)?;
        gate(family, handshake, &method)?;
        params.remove("context");
        let client_timeout_s = params.remove("_clientTimeoutS").and_then(|v| v.as_f64());
        let call = ReverseCall {
            user: self.shared.user.clone(),
            tool_id: self.shared.tool_id.clone(),
            invoke_id: invoke.invoke_id.clone(),
            method,
            family,
            params: Value::Object(params),
            client_timeout_s,
            deadline_ms: invoke.deadline_ms,
            tokens: self.current_tokens(&invoke, handshake).await,
        };
        let mut done = invoke.done.subscribe();
        let service = self.shared.services.call(call);
        tokio::select! {
            result = service => result,
            _ = done.wait_for(|d| *d) => Err(correlation::UNKNOWN_INVOKE_CONTEXT.error("the parent invoke has finished")),
        }
    }

    /// The invoke's tokens, minted again first when they are due for renewal (long jobs, spec §11 HR-JW-02).
    async fn current_tokens(&self, invoke: &ActiveInvoke, handshake: &Handshake) -> InvokeTokens {
        let current = lock(&invoke.tokens).clone();
        match current.renew_at_ms {
            Some(at) if crate::session::now_ms() >= at => {
                let fresh = self.shared.tokens.tokens(invoke.token_request.clone()).await;
                let fresh = crate::session::withhold(fresh, handshake);
                *lock(&invoke.tokens) = fresh.clone();
                fresh
            }
            _ => current,
        }
    }

    /// The span of the invoke a reverse call belongs to (named in `params.context.invoke_id`, else the only
    /// active one), for tracing only: routing and its errors are [`Self::route`]'s.
    fn parent_span(&self, frame: &Frame) -> Option<tracing::Span> {
        #[derive(Deserialize)]
        struct Ctx {
            invoke_id: Option<String>,
        }
        #[derive(Deserialize)]
        struct Params {
            context: Option<Ctx>,
        }
        let named = frame
            .parse_payload::<Params>()
            .ok()
            .flatten()
            .and_then(|p| p.context)
            .and_then(|c| c.invoke_id);
        let invokes = lock(&self.invokes);
        match named {
            Some(id) => invokes.get(&id).map(|i| i.span.clone()),
            None if invokes.len() == 1 => invokes.values().next().map(|i| i.span.clone()),
            None => None,
        }
    }

    /// The routing rules of spec §7.2 (HR-RC-01…04).
    fn route(&self, named: Option<&str>, family: Family) -> Result<Arc<ActiveInvoke>, ErrorObject> {
        let invokes = lock(&self.invokes);
        match named {
            Some(id) => invokes.get(id).cloned().ok_or_else(|| {
                correlation::UNKNOWN_INVOKE_CONTEXT.error(format!("no active invoke {id:?} on this process"))
            }),
            None => match invokes.len() {
                1 => Ok(invokes
                    .values()
                    .next()
                    .cloned()
                    .ok_or_else(|| method_not_found(""))?),
                0 if family == Family::Upload => {
                    Err(upload::UPLOAD_NOT_NEGOTIATED.error("reverse RPC outside any invoke context"))
                }
                0 => Err(correlation::MISSING_INVOKE_CONTEXT.error("no invoke is active and none was named")),
                n => Err(correlation::MISSING_INVOKE_CONTEXT.error(format!(
                    "{n} invokes are active: params.context.invoke_id is required"
                ))),
            },
        }
    }
}

/// Negotiation and manifest gates (spec §3.3 HR-LC-15); the user's grant is the service's to check.
fn gate(family: Family, handshake: &Handshake, method: &str) -> Result<(), ErrorObject> {
    let keys = family.negotiation_keys();
    if !keys.is_empty() && !keys.iter().any(|k| handshake.negotiated.contains(*k)) {
        return Err(family.not_negotiated().error(format!(
            "{method}: the plugin did not negotiate {} in initialize",
            keys.join(" or ")
        )));
    }
    if let Some(cap) = family.manifest_capability()
        && !handshake.manifest.declares(cap)
    {
        return Err(family.not_negotiated().error(format!(
            "{method}: the manifest does not declare host_capabilities [{cap:?}]"
        )));
    }
    Ok(())
}

/// Killing a cgroup waits for the kernel: off the async threads.
async fn kill_tree_blocking(shared: &Arc<SessionShared>, pid: u32) {
    let shared = shared.clone();
    let _ = tokio::task::spawn_blocking(move || shared.kill_tree(pid)).await;
}

fn unknown_exit() -> ExitInfo {
    ExitInfo {
        status: "unknown".into(),
        clean: false,
        oom: false,
        host_initiated: false,
    }
}

fn describe_status(s: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt as _;
    match (s.code(), s.signal()) {
        (Some(code), _) => format!("exit status: {code}"),
        (None, Some(sig)) => {
            let name = match sig {
                6 => " (SIGABRT)",
                9 => " (SIGKILL)",
                11 => " (SIGSEGV)",
                15 => " (SIGTERM)",
                _ => "",
            };
            format!("killed by signal {sig}{name}")
        }
        (None, None) => "unknown exit".into(),
    }
}
