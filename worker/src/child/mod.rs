//! The process core of both dialects: one plugin process spawned into its sandbox, speaking line-delimited
//! JSON-RPC over stdio.
//!
//! ```text
//! spawn: Sandboxed::command (argv, cwd, a clean environment, the sandbox's plan) → piped stdio
//! caller tasks ──▶ FrameWriter (one writer task) ──▶ plugin stdin
//! plugin stdout ──▶ one reader task: frames, bytes and bad frames counted
//!      response     → pending[id] → the waiting caller (late or unknown ids counted and dropped)
//!      anything else → the dialect's `Dialect::on_frame` (requests, notifications, file-transport pointers)
//! stderr ──▶ StderrRing (bounded, long lines cut, JWTs redacted)
//! exit ──▶ the rest of the tree killed, OOM attributed, every pending call failed, then `Dialect::on_exit`
//! ```
//!
//! Invariants: no lock is held across an `.await`; a dead process fails every pending request at once; every
//! process the plugin started dies with it (its cgroup, or its process group without isolation).
//!
//! The dialects (`session::process` for Executa, `animus::process` for Animus) keep only what is theirs: the
//! handshake, the frames other than answers, and what to do once the process has ended.

mod exit;
mod sandboxed;
mod stderr;
#[cfg(test)]
pub(crate) mod testing;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fleet_proto::codec::io::{FrameReader, FrameWriter, ReadError};
use fleet_proto::codec::{Frame, FrameError, FrameKind};
use fleet_proto::jsonrpc::{Id, Notification, Request};
use serde::Serialize;
use tokio::process::{ChildStderr, ChildStdout};
use tokio::sync::{oneshot, watch};

pub use exit::ExitInfo;
pub(crate) use sandboxed::Sandboxed;
pub(crate) use stderr::{StderrRing, for_log, redact};

use crate::metrics::WorkerMetrics;

/// Why a host request got no normal answer.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(crate) enum Failure {
    /// The process ended.
    #[error("the plugin exited ({0})")]
    Exited(ExitInfo),
    /// The answer was over the frame limit and was discarded.
    #[error("the plugin's answer was {frame_bytes} bytes, over the {max_frame_bytes}-byte frame limit")]
    FrameTooLarge { frame_bytes: u64, max_frame_bytes: u64 },
    /// The answer came by file transport and could not be used.
    #[error("file transport refused: {0}")]
    FileTransport(String),
    /// The request could not be written (the process is still running).
    #[error("{0}")]
    Write(String),
}

/// A request's outcome: the answer frame, or why there is none.
pub(crate) type Reply = Result<Frame, Failure>;

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
    /// A sandbox stub could not become the plugin.
    #[error("cannot start {program:?}: {source}")]
    Stub {
        /// argv[0].
        program: String,
        /// Which step failed, and why.
        source: crate::sandbox::StubError,
    },
    /// stdio was not captured.
    #[error("the plugin's stdio could not be captured")]
    Stdio,
}

/// What a dialect adds to the core: everything about a frame that is not an answer to a host request, the
/// answer to a request whose answer was too large, and what happens once the process has ended.
pub(crate) trait Dialect: Send + Sync + 'static {
    /// The process core.
    fn child(&self) -> &ChildProcess;

    /// A frame that is not an answer: a plugin → host request, a notification, a file-transport pointer.
    /// Called on the reader task, in the order the frames came; must not wait for other frames.
    fn on_frame(self: Arc<Self>, frame: Frame) -> impl Future<Output = ()> + Send;

    /// What the caller of request `id` gets when its answer was over the frame limit (`error` is
    /// `FrameError::TooLarge`).
    fn too_large(&self, id: u64, error: &FrameError) -> Reply;

    /// Called once the process has ended, its tree is killed and every pending request has failed.
    fn on_exit(&self, info: &ExitInfo) -> impl Future<Output = ()> + Send;
}

/// How to start one process.
#[derive(Debug)]
pub(crate) struct Spawn {
    /// The plugin (logs only).
    pub(crate) tool_id: String,
    /// The sandbox it runs in (kept alive as long as the process).
    pub(crate) sandbox: Arc<Sandboxed>,
    /// Where its stderr goes.
    pub(crate) stderr: StderrRing,
    /// Counters.
    pub(crate) metrics: Arc<WorkerMetrics>,
    /// The id of its first request, from its pid.
    pub(crate) first_id: fn(u32) -> u64,
    /// After its stdout closed, how long it gets to exit on its own before its tree is killed.
    pub(crate) eof_grace: Duration,
}

/// A running plugin process: the writer, the pending requests, the exit, the tree.
pub(crate) struct ChildProcess {
    pub(crate) pid: u32,
    tool_id: String,
    writer: FrameWriter,
    next_id: AtomicU64,
    pending: Mutex<HashMap<u64, oneshot::Sender<Reply>>>,
    /// Ids whose caller gave up (timeout, cancel): a late answer is discarded, and the cancel fallback kills
    /// the process if the plugin is still busy with one.
    abandoned: Mutex<HashSet<u64>>,
    exit: watch::Receiver<Option<ExitInfo>>,
    host_kill: AtomicBool,
    /// A stub-started process's `exec` outcome, not read yet (none: spawned directly, or already read).
    exec: tokio::sync::Mutex<Option<crate::sandbox::ExecStatus>>,
    sandbox: Arc<Sandboxed>,
    stderr: StderrRing,
    pub(crate) metrics: Arc<WorkerMetrics>,
}

impl std::fmt::Debug for ChildProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChildProcess")
            .field("pid", &self.pid)
            .field("tool_id", &self.tool_id)
            .finish_non_exhaustive()
    }
}

/// The tasks of a spawned process, started once its dialect exists ([`Tasks::start`]).
#[derive(Debug)]
pub(crate) struct Tasks {
    child: tokio::process::Child,
    stdout: ChildStdout,
    stderr: ChildStderr,
    exit_tx: watch::Sender<Option<ExitInfo>>,
    oom_before: u64,
    eof_grace: Duration,
}

pub(crate) use fleet_proto::util::lock;

impl ChildProcess {
    /// Starts `argv` in `dir` with exactly `env` in `spawn`'s sandbox ([`Sandboxed::launch`]). Its tasks start
    /// with [`Tasks::start`].
    pub(crate) async fn spawn(
        argv: &[String],
        dir: &std::path::Path,
        env: Vec<(String, String)>,
        spawn: Spawn,
    ) -> Result<(ChildProcess, Tasks), SpawnError> {
        let oom_before = spawn.sandbox.oom_kills();
        let (mut child, exec) = spawn.sandbox.launch(argv, dir, env).await?;
        WorkerMetrics::inc(&spawn.metrics.spawns);
        let pid = child.id().unwrap_or(0);
        let (Some(stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            return Err(SpawnError::Stdio);
        };
        let (writer, _writer_task) = FrameWriter::spawn(stdin);
        let (exit_tx, exit_rx) = watch::channel(None);
        let process = ChildProcess {
            pid,
            tool_id: spawn.tool_id,
            writer,
            next_id: AtomicU64::new((spawn.first_id)(pid)),
            pending: Mutex::new(HashMap::new()),
            abandoned: Mutex::new(HashSet::new()),
            exit: exit_rx,
            host_kill: AtomicBool::new(false),
            exec: tokio::sync::Mutex::new(exec),
            sandbox: spawn.sandbox,
            stderr: spawn.stderr,
            metrics: spawn.metrics,
        };
        let tasks = Tasks {
            child,
            stdout,
            stderr,
            exit_tx,
            oom_before,
            eof_grace: spawn.eof_grace,
        };
        Ok((process, tasks))
    }

    /// Whether the process failed to start: the `exec` of a sandbox stub that reported a failed step (what a
    /// direct spawn returns at once). `None` when it started (or was spawned directly). Ask when the process
    /// ended before it answered anything; read once.
    pub(crate) async fn start_error(&self) -> Option<SpawnError> {
        let exec = self.exec.lock().await.take()?;
        exec.outcome()
            .await
            .err()
            .map(|(program, source)| SpawnError::Stub { program, source })
    }

    /// The sandbox it runs in.
    pub(crate) fn sandbox(&self) -> &Arc<Sandboxed> {
        &self.sandbox
    }

    /// Sends a request; returns its id and where the answer will arrive. Waits while the writer's queue is full
    /// (a plugin that does not read its stdin): the caller bounds that wait, and a request given up before it was
    /// queued leaves nothing behind.
    pub(crate) async fn request<P: Serialize>(
        &self,
        method: &str,
        params: Option<P>,
    ) -> Result<(u64, oneshot::Receiver<Reply>), Failure> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        lock(&self.pending).insert(id, tx);
        // Until the frame is queued: failed or given up (this future dropped), the route goes.
        let mut route = PendingRoute {
            pending: &self.pending,
            id: Some(id),
        };
        if let Some(info) = self.exit_info() {
            return Err(Failure::Exited(info));
        }
        let request = Request {
            jsonrpc: fleet_proto::jsonrpc::V2,
            id: Id::number(id),
            method: method.into(),
            params,
        };
        if let Err(e) = self.writer.send(&request).await {
            return Err(match self.exit_info() {
                Some(info) => Failure::Exited(info),
                None => Failure::Write(format!("cannot write to the plugin: {e}")),
            });
        }
        route.id = None;
        WorkerMetrics::inc(&self.metrics.frames_written);
        Ok((id, rx))
    }

    /// Sends a notification, best effort: a dead plugin needs none, and one that has left
    /// [`fleet_proto::codec::io::WRITE_QUEUE`] frames unread gets none (it is not waited for: a cancel or a
    /// shutdown that follows must not hang behind a plugin that stopped reading).
    pub(crate) fn notify<P: Serialize>(&self, method: &str, params: Option<P>) {
        let n = Notification {
            jsonrpc: fleet_proto::jsonrpc::V2,
            method: method.into(),
            params,
        };
        if self.writer.try_send(&n).is_ok() {
            WorkerMetrics::inc(&self.metrics.frames_written);
        }
    }

    /// The writer (answers to plugin → host requests).
    pub(crate) fn writer(&self) -> &FrameWriter {
        &self.writer
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

    /// Records that the host is ending the process (its exit is not a crash).
    pub(crate) fn host_ends(&self) {
        self.host_kill.store(true, Ordering::SeqCst);
    }

    /// How the process ended, if it has.
    pub(crate) fn exit_info(&self) -> Option<ExitInfo> {
        self.exit.borrow().clone()
    }

    /// Waits until the process has ended.
    pub(crate) async fn exited(&self) -> ExitInfo {
        let mut rx = self.exit.clone();
        match rx.wait_for(Option::is_some).await {
            Ok(info) => info.clone().unwrap_or_else(ExitInfo::unknown),
            Err(_) => ExitInfo::unknown(),
        }
    }

    /// Closes the plugin's stdin after what is queued for it; never waits (a plugin that stopped reading its
    /// stdin cannot hold a shutdown ladder at this step).
    pub(crate) fn close_stdin(&self) {
        self.writer.close();
    }

    /// The last `n` stderr lines (redacted).
    pub(crate) fn stderr_tail(&self, n: usize) -> String {
        self.stderr.tail(n)
    }

    /// Kills the whole process tree now, as a host decision (not counted as a crash).
    pub(crate) async fn kill_tree(&self) {
        self.host_ends();
        WorkerMetrics::inc(&self.metrics.tree_kills);
        self.kill_rest().await;
    }

    /// Signals every process of the tree (a shutdown ladder's SIGTERM), as a host decision.
    pub(crate) fn terminate_tree(&self) {
        self.host_ends();
        self.sandbox.signal_tree(self.pid, rustix::process::Signal::TERM);
    }

    /// Kills the tree (no process of the session starts meanwhile: [`Sandboxed::kill_tree_now`]).
    async fn kill_rest(&self) {
        self.sandbox.kill_tree_now(self.pid, &self.tool_id).await;
    }

    /// Hands an answer to its caller; an answer nobody waits for is counted and dropped.
    pub(crate) fn answer(&self, frame: Frame) {
        match frame.id().and_then(Id::as_u64) {
            Some(id) => self.complete(id, Ok(frame)),
            None => WorkerMetrics::inc(&self.metrics.unmatched_responses),
        }
    }

    /// Hands `reply` to the caller of `id`; counted and dropped if nobody waits for it.
    pub(crate) fn complete(&self, id: u64, reply: Reply) {
        let tx = lock(&self.pending).remove(&id);
        match tx {
            Some(tx) => {
                let _ = tx.send(reply);
            }
            None => {
                if !lock(&self.abandoned).remove(&id) {
                    tracing::debug!(tool_id = %self.tool_id, id, "unmatched response id");
                }
                WorkerMetrics::inc(&self.metrics.unmatched_responses);
            }
        }
    }

    fn on_bad_frame<D: Dialect>(&self, dialect: &D, e: &FrameError) {
        self.metrics.frame_error(e.kind());
        // Its kind only: the excerpt the error carries is the plugin's bytes.
        tracing::debug!(tool_id = %self.tool_id, kind = e.kind(), "bad frame from plugin");
        if let FrameError::TooLarge {
            id_hint: Some(id), ..
        } = e
            && let Some(id) = id.as_u64()
        {
            self.complete(id, dialect.too_large(id, e));
        }
    }

    /// Adds what `reader` read since `counted` to the byte counter; returns the new total.
    fn count_bytes<R>(&self, reader: &FrameReader<R>, counted: u64) -> u64
    where
        R: tokio::io::AsyncRead + Unpin,
    {
        let total = reader.bytes_read();
        self.metrics
            .bytes_read
            .fetch_add(total.saturating_sub(counted), Ordering::Relaxed);
        total
    }
}

impl Tasks {
    /// Starts the stderr drain, the reader and the exit watcher of `dialect`'s process.
    pub(crate) fn start<D: Dialect>(self, dialect: &Arc<D>) {
        let Tasks {
            child,
            stdout,
            stderr,
            exit_tx,
            oom_before,
            eof_grace,
        } = self;
        tokio::spawn(dialect.child().stderr.clone().drain(stderr));
        tokio::spawn(read_loop(dialect.clone(), FrameReader::new(stdout), eof_grace));
        tokio::spawn(wait_loop(dialect.clone(), child, exit_tx, oom_before));
    }
}

/// Removes a request's route from `pending` when dropped armed (the request was not queued).
struct PendingRoute<'a> {
    pending: &'a Mutex<HashMap<u64, oneshot::Sender<Reply>>>,
    id: Option<u64>,
}

impl Drop for PendingRoute<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            lock(self.pending).remove(&id);
        }
    }
}

async fn read_loop<D: Dialect>(dialect: Arc<D>, mut reader: FrameReader<ChildStdout>, eof_grace: Duration) {
    let process = dialect.child();
    let mut counted = 0;
    while let Some(item) = reader.next().await {
        counted = process.count_bytes(&reader, counted);
        match item {
            Ok(frame) => {
                WorkerMetrics::inc(&process.metrics.frames_read);
                match frame.kind() {
                    FrameKind::Response | FrameKind::ErrorResponse => process.answer(frame),
                    _ => dialect.clone().on_frame(frame).await,
                }
            }
            Err(ReadError::Frame(e)) => process.on_bad_frame(&*dialect, &e),
            Err(ReadError::Io(e)) => {
                tracing::debug!(tool_id = %process.tool_id, error = %e, "plugin stdout failed");
                break;
            }
        }
    }
    process.count_bytes(&reader, counted);
    // stdout is closed: a process that cannot answer is useless. It gets a grace to exit on its own (the normal
    // end after stdin EOF), then it is ended.
    if tokio::time::timeout(eof_grace, process.exited()).await.is_err() {
        process.kill_tree().await;
    }
}

async fn wait_loop<D: Dialect>(
    dialect: Arc<D>,
    mut child: tokio::process::Child,
    exit_tx: watch::Sender<Option<ExitInfo>>,
    oom_before: u64,
) {
    let process = dialect.child();
    let status = child.wait().await;
    // The plugin is gone: its descendants go with it.
    process.kill_rest().await;
    let oom = process.sandbox.oom_kills() > oom_before;
    let info = ExitInfo::from_wait(&status, oom, process.host_kill.load(Ordering::SeqCst));
    if oom {
        WorkerMetrics::inc(&process.metrics.oom_kills);
    }
    let _ = exit_tx.send(Some(info.clone()));
    let pending: Vec<_> = lock(&process.pending).drain().collect();
    for (_, tx) in pending {
        let _ = tx.send(Err(Failure::Exited(info.clone())));
    }
    dialect.on_exit(&info).await;
}
