//! The Executa dialect of a plugin process (the core is [`crate::child`]): the frames other than answers
//! (reverse-RPC requests routed by `context.invoke_id`, `executa/progress`, file transport), the table of active
//! invokes (for reverse-RPC routing, progress and cancel), and the handshake's result.
//!
//! Invariants: no lock is held across an `.await`; a dead process ends every active invoke's reverse calls.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, OnceLock};

use fleet_proto::codec::{Frame, FrameError, FrameKind};
use fleet_proto::executa::invoke::{PROGRESS_METHOD, ProgressType};
use fleet_proto::executa::lifecycle::ProtocolVersion;
use fleet_proto::executa::manifest::Manifest;
use fleet_proto::executa::reverse::{Family, correlation, family_of, method_not_found, upload};
use fleet_proto::jsonrpc::{ErrorObject, Id, Response, codes};
use fleet_proto::limits::MAX_REVERSE_BYTES_IN_FLIGHT;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use tokio::sync::{Notify, watch};

use super::SessionShared;
use super::transport::read_transport_file;
use crate::child::{ChildProcess, Dialect, ExitInfo, Failure, Reply, Spawn, SpawnError, lock};
use crate::metrics::{ProgressDrop, WorkerMetrics};
use crate::progress::{ProgressGate, ProgressSink, ProgressUpdate};
use crate::services::{InvokeTokens, ReverseCall, TokenRequest};

/// One invoke in flight on the process (for reverse-RPC routing, progress and cancel).
pub(crate) struct ActiveInvoke {
    pub(crate) invoke_id: String,
    /// The tool (method) invoked.
    pub(crate) tool: String,
    pub(crate) sink: Option<ProgressSink>,
    pub(crate) gate: ProgressGate,
    /// The invoke's current tokens (replaced when they are due for renewal).
    pub(crate) tokens: Mutex<InvokeTokens>,
    /// What they were minted from (to mint them again).
    pub(crate) token_request: TokenRequest,
    pub(crate) deadline_ms: u64,
    /// Set when the invoke ends (any way): pending reverse calls are abandoned. Set with `send_replace` (`send`
    /// stores nothing while no reverse call is subscribed, and one that subscribes later would wait for good).
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

/// A running Executa plugin process.
pub(crate) struct Process {
    /// The process core: pid, writer, pending requests, exit, tree.
    pub(crate) child: ChildProcess,
    pub(crate) shared: Arc<SessionShared>,
    pub(crate) invokes: Mutex<HashMap<String, Arc<ActiveInvoke>>>,
    pub(crate) handshake: OnceLock<Handshake>,
    /// The TMPDIR as the plugin got it and canonical: where file-transport pointers may point.
    tmpdirs: Vec<PathBuf>,
    /// Whether any invoke got an answer (a process that answers is not crash-looping).
    pub(crate) answered: AtomicBool,
    /// Reverse-RPC calls being served: bounded, so a plugin flooding requests cannot spawn unbounded work.
    reverse_slots: Arc<tokio::sync::Semaphore>,
    /// Bytes of the reverse-RPC request frames being served, one permit per byte
    /// ([`MAX_REVERSE_BYTES_IN_FLIGHT`]): bounded, so a plugin cannot make the worker hold more of its params.
    reverse_bytes: Arc<tokio::sync::Semaphore>,
}

/// Reverse-RPC calls served at once per process; more are refused with -32603 until one finishes.
pub(crate) const MAX_CONCURRENT_REVERSE_CALLS: usize = 256;

/// Why a reverse-RPC request was refused before it was parsed (answered with -32603; the plugin may retry once
/// one of its calls in flight has been answered).
#[derive(Debug, thiserror::Error)]
enum ReverseRefusal {
    #[error("more than {MAX_CONCURRENT_REVERSE_CALLS} reverse-RPC calls in flight")]
    Calls,
    #[error(
        "more than {MAX_REVERSE_BYTES_IN_FLIGHT} bytes of reverse-RPC requests in flight (this one is {0} bytes)"
    )]
    Bytes(usize),
}

/// What a reverse-RPC request holds while it is served: one call of the count cap and its frame's bytes of the
/// byte budget; both are given back when it is dropped (its answer written, or the call abandoned).
struct ReverseSlot {
    _call: tokio::sync::OwnedSemaphorePermit,
    _bytes: tokio::sync::OwnedSemaphorePermit,
}

impl std::fmt::Debug for Process {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Process")
            .field("pid", &self.child.pid)
            .finish_non_exhaustive()
    }
}

impl Process {
    /// Spawns the plugin into the session's sandbox and starts the reader, stderr and exit tasks.
    pub(crate) async fn spawn(shared: &Arc<SessionShared>) -> Result<Arc<Process>, SpawnError> {
        let install = &shared.install;
        let (child, tasks) = ChildProcess::spawn(
            &install.argv,
            &install.dir,
            shared.environment(),
            Spawn {
                tool_id: shared.tool_id.clone(),
                sandbox: shared.sandbox.clone(),
                stderr: shared.stderr.clone(),
                metrics: shared.metrics.clone(),
                first_id: |_| 0,
                eof_grace: shared.config.shutdown_grace,
            },
        )
        .await?;
        let process = Arc::new(Process {
            child,
            shared: shared.clone(),
            invokes: Mutex::new(HashMap::new()),
            handshake: OnceLock::new(),
            tmpdirs: super::transport::tmpdir_forms(&shared.sandbox.space().tmpdir),
            answered: AtomicBool::new(false),
            reverse_slots: Arc::new(tokio::sync::Semaphore::new(MAX_CONCURRENT_REVERSE_CALLS)),
            reverse_bytes: Arc::new(tokio::sync::Semaphore::new(MAX_REVERSE_BYTES_IN_FLIGHT)),
        });
        tasks.start(&process);
        Ok(process)
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
            invoke.done.send_replace(true);
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
    // Frames other than answers
    // ---------------------------------------------------------------------------------------------------------

    async fn dispatch(self: &Arc<Self>, frame: Frame, depth: u8) {
        match frame.kind() {
            // An answer inside a file-transport pointer.
            FrameKind::Response | FrameKind::ErrorResponse => self.child.answer(frame),
            FrameKind::Request => match self.admit_reverse(&frame) {
                Ok(slot) => {
                    // Held while served: only its own bytes, as counted (not the read buffer it was cut from).
                    tokio::spawn(self.clone().on_request(frame.detached(), slot));
                }
                Err(refusal) => {
                    if let Some(id) = frame.id().cloned() {
                        let error = ErrorObject::new(codes::INTERNAL_ERROR, refusal.to_string());
                        WorkerMetrics::inc(&self.shared.metrics.reverse_refused);
                        let _ = self.child.writer().send(&Response::<Value>::err(id, error)).await;
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
                // The file is the plugin's: its bytes reach neither the log nor the error (the kind of fault only).
                let parsed = resolved.and_then(|bytes| {
                    Frame::parse(bytes).map_err(|e| {
                        format!("the file-transport file is not a JSON-RPC frame ({})", e.kind())
                    })
                });
                match parsed {
                    Ok(inner) => {
                        WorkerMetrics::inc(&self.shared.metrics.file_transports);
                        Box::pin(self.dispatch(inner, depth + 1)).await;
                    }
                    Err(reason) => {
                        WorkerMetrics::inc(&self.shared.metrics.file_transport_refused);
                        tracing::warn!(tool_id = %self.shared.tool_id, %reason, "file transport refused");
                        if let Some(id) = pointer_id {
                            self.child.complete(id, Err(Failure::FileTransport(reason)));
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

    /// Takes a call of the count cap and the frame's length of the byte budget, before anything of the frame is
    /// parsed; refuses (never waits: the reader must go on reading answers) when either is used up.
    fn admit_reverse(&self, frame: &Frame) -> Result<ReverseSlot, ReverseRefusal> {
        let len = frame.as_bytes().len();
        let call = self
            .reverse_slots
            .clone()
            .try_acquire_owned()
            .map_err(|_| ReverseRefusal::Calls)?;
        let bytes = u32::try_from(len)
            .ok()
            .and_then(|n| self.reverse_bytes.clone().try_acquire_many_owned(n).ok())
            .ok_or(ReverseRefusal::Bytes(len))?;
        Ok(ReverseSlot {
            _call: call,
            _bytes: bytes,
        })
    }

    async fn on_request(self: Arc<Self>, frame: Frame, _slot: ReverseSlot) {
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
        if let Err(e) = self.child.writer().send(&response).await {
            // Too large to send: answer with an error instead (the plugin must not wait forever).
            let error = ErrorObject::new(
                codes::INTERNAL_ERROR,
                format!("the host's answer could not be sent: {e}"),
            );
            let _ = self.child.writer().send(&Response::<Value>::err(id, error)).await;
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
            tool: invoke.tool.clone(),
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
    if let Some(cap) = family.method_capability(method)
        && !handshake.manifest.declares(cap)
    {
        return Err(family.not_negotiated().error(format!(
            "{method}: the manifest does not declare host_capabilities [{cap:?}]"
        )));
    }
    Ok(())
}

impl Dialect for Process {
    fn child(&self) -> &ChildProcess {
        &self.child
    }

    async fn on_frame(self: Arc<Self>, frame: Frame) {
        self.dispatch(frame, 0).await;
    }

    fn too_large(&self, _id: u64, error: &FrameError) -> Reply {
        let (frame_bytes, max_frame_bytes) = match error {
            FrameError::TooLarge {
                frame_bytes,
                max_frame_bytes,
                ..
            } => (*frame_bytes, *max_frame_bytes),
            _ => (0, 0),
        };
        Err(Failure::FrameTooLarge {
            frame_bytes,
            max_frame_bytes,
        })
    }

    async fn on_exit(&self, _info: &ExitInfo) {
        let invokes: Vec<_> = lock(&self.invokes).drain().collect();
        for (_, invoke) in invokes {
            invoke.done.send_replace(true);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use serde_json::json;

    use crate::child::testing::{GUARD, eventually, worker};
    use crate::metrics::WorkerMetrics;
    use crate::session::{Session, SessionState};

    /// Executa plugins are read by the same core: frames, bytes and bad frames counted, here for a plugin that
    /// writes before its handshake and exits (so the session stops at once with `max_restarts = 0`).
    #[tokio::test]
    async fn frames_bytes_and_bad_frames_read_are_counted() {
        const FRAME: &str = r#"{"jsonrpc":"2.0","method":"executa/other","params":{}}"#;
        let w = worker("ex-bytes", |c| c.max_restarts = 0);
        let script = format!("printf '%s\\n' '{FRAME}' 'not json'; exit 3");
        let install = Arc::new(w.install("ex-bytes", &["/bin/sh", "-c", &script], json!({})));
        let s = Session::new("alice", &install, &w.ctx).unwrap();
        assert!(s.prewarm(GUARD).await.is_err());
        assert!(matches!(s.state(), SessionState::Stopped(_)), "{:?}", s.state());
        let m = &w.metrics;
        assert!(
            eventually(|| WorkerMetrics::get(&m.frames_read) == 1 && m.frame_errors("invalid_json") == 1)
                .await
        );
        let written = FRAME.len() + 1 + "not json\n".len();
        assert_eq!(WorkerMetrics::get(&m.bytes_read), written as u64);
        assert_eq!(WorkerMetrics::get(&m.ignored_notifications), 1);
        s.shutdown().await;
    }

    /// A session shut down before its supervisor ever ran (a worker stopping right after a session was made —
    /// its catalogue's describe at start-up): the supervisor sees the request when it first runs and ends. On
    /// this current-thread runtime the spawned supervisor cannot run before `shutdown` has sent its request.
    #[tokio::test]
    async fn a_shutdown_before_the_supervisor_first_runs_is_not_lost() {
        let w = worker("early-stop", |_| {});
        let install = Arc::new(w.install("early-stop", &["/bin/cat"], json!({})));
        let s = Session::new("alice", &install, &w.ctx).unwrap();
        tokio::time::timeout(GUARD, s.shutdown())
            .await
            .expect("the shutdown ends");
        assert!(matches!(s.state(), SessionState::Closed), "{:?}", s.state());
    }
}
