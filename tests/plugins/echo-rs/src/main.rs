//! `fleet-echo-plugin`: the fixture Executa plugin that every Cloud Agents test of the host runs.
//!
//! It speaks line-delimited JSON-RPC 2.0 over stdio (the Executa protocol, v2 by default) and serves many
//! `invoke`s at once: the main thread reads stdin, each `invoke` runs on its own thread (except `echo`, which
//! never waits and is answered on the main thread), every stdout frame is written whole and flushed under one
//! lock, and responses to the plugin's reverse-RPC requests are routed back to the waiting invoke by id. Flags
//! (see `cli.rs`) and tool arguments (see `tools.rs`) choose the behaviour, including the misbehaviour a host
//! must survive (junk output, crashes, hangs, floods, ignored shutdown).
//!
//! stdin EOF means shutdown: reverse RPCs still waiting fail at once, the requests in flight finish and write
//! their responses, then the process exits 0 (or parks forever after `--ignore-eof` / `ignore_shutdown`).

// A test fixture: its logs go to stderr on purpose.
#![allow(clippy::print_stderr)]

mod cli;
mod manifest;
mod tools;

use std::collections::HashMap;
use std::io::{self, BufRead, Stdout, Write};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError, mpsc};
use std::thread;
use std::time::Duration;

use serde_json::{Map, Value, json};
use signal_hook::consts::SIGTERM;
use signal_hook::iterator::Signals;

use crate::cli::{Config, HealthMode, InitMode, Mode};

/// JSON-RPC error codes used by the fixture.
pub(crate) mod code {
    pub(crate) const PARSE_ERROR: i64 = -32700;
    pub(crate) const INVALID_REQUEST: i64 = -32600;
    pub(crate) const METHOD_NOT_FOUND: i64 = -32601;
    pub(crate) const INVALID_PARAMS: i64 = -32602;
    pub(crate) const INTERNAL_ERROR: i64 = -32603;
}

/// Logged to stderr when the plugin parks after stdin EOF (`--ignore-eof` / `ignore_shutdown`).
const EOF_IGNORED: &str = "fleet-echo-plugin: stdin EOF ignored, parking";
/// Logged to stderr when the reader stops reading stdin for good (`flood` `stop_reading`).
const STOPPED_READING: &str = "fleet-echo-plugin: stopped reading stdin, parking";
/// Logged to stderr each time an ignored SIGTERM arrives (`--ignore-sigterm` / `ignore_shutdown`).
const SIGTERM_IGNORED: &str = "fleet-echo-plugin: SIGTERM ignored";

/// Writes one line to stderr; unlike `eprintln!`, never panics (the host may have closed the pipe).
fn log(line: &str) {
    let mut err = io::stderr().lock();
    let _ = writeln!(err, "{line}").and_then(|()| err.flush());
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// State shared by the reader thread and every invoke thread.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) cfg: Config,
    /// Every stdout write goes through this lock: one whole line, then flush.
    out: Mutex<Stdout>,
    /// Reverse-RPC requests in flight: JSON-serialised id → the waiting invoke thread. `None` once stdin is
    /// closed: no answer can come any more.
    pending: Mutex<Option<HashMap<String, mpsc::Sender<Value>>>>,
    next_rpc: AtomicU64,
    next_file: AtomicU64,
    /// How many `initialize` requests this process has received (answered or not).
    pub(crate) initialize_calls: AtomicU64,
    /// How many `describe` requests this process has received.
    pub(crate) describe_calls: AtomicU64,
    /// The id of an `initialize` held until `describe` arrives (`--initialize after-describe`).
    held_initialize: Mutex<Option<Value>>,
    /// Keep running after stdin EOF.
    ignore_eof: AtomicBool,
    /// Stop reading stdin (`flood` `stop_reading`): the reader parks after the next line.
    stop_reading: AtomicBool,
    /// Requests being served on their own threads (invoke, describe); stdin EOF waits for them.
    in_flight: Mutex<usize>,
    idle: Condvar,
    /// Result of starting to ignore SIGTERM (done at most once).
    sigterm: OnceLock<Result<(), String>>,
}

impl Shared {
    fn new(cfg: Config) -> Self {
        Self {
            ignore_eof: AtomicBool::new(cfg.ignore_eof),
            stop_reading: AtomicBool::new(false),
            in_flight: Mutex::new(0),
            idle: Condvar::new(),
            cfg,
            out: Mutex::new(io::stdout()),
            pending: Mutex::new(Some(HashMap::new())),
            next_rpc: AtomicU64::new(0),
            next_file: AtomicU64::new(0),
            initialize_calls: AtomicU64::new(0),
            describe_calls: AtomicU64::new(0),
            held_initialize: Mutex::new(None),
            sigterm: OnceLock::new(),
        }
    }

    /// Writes `bytes` plus `\n` to stdout as one frame and flushes. Errors (a host gone away) are logged.
    pub(crate) fn write_line(&self, bytes: &[u8]) {
        let mut out = lock(&self.out);
        let res = out
            .write_all(bytes)
            .and_then(|()| out.write_all(b"\n"))
            .and_then(|()| out.flush());
        drop(out);
        if let Err(e) = res {
            eprintln!("fleet-echo-plugin: stdout write failed: {e}");
        }
    }

    /// Writes one JSON message as one line.
    pub(crate) fn send(&self, msg: &Value) {
        match serde_json::to_vec(msg) {
            Ok(bytes) => self.write_line(&bytes),
            Err(e) => eprintln!("fleet-echo-plugin: cannot serialise a frame: {e}"),
        }
    }

    pub(crate) fn respond_ok(&self, id: &Value, result: &Value) {
        self.send(&json!({ "jsonrpc": "2.0", "id": id, "result": result }));
    }

    pub(crate) fn respond_err(&self, id: &Value, code: i64, message: &str, data: Option<Value>) {
        self.send(&error_response(id, code, message, data));
    }

    /// Makes the reader stop reading stdin after the line it is waiting for.
    pub(crate) fn stop_reading(&self) {
        self.stop_reading.store(true, Ordering::SeqCst);
    }

    pub(crate) fn set_ignore_eof(&self) {
        self.ignore_eof.store(true, Ordering::SeqCst);
    }

    /// Makes SIGTERM be ignored from now on: a handler replaces the default (terminating) action before this
    /// returns, and a thread logs [`SIGTERM_IGNORED`] to stderr each time one arrives.
    pub(crate) fn ignore_sigterm(&self) -> Result<(), String> {
        self.sigterm
            .get_or_init(|| {
                let mut signals =
                    Signals::new([SIGTERM]).map_err(|e| format!("cannot register a SIGTERM handler: {e}"))?;
                let spawned = spawn_named("sigterm".to_owned(), move || {
                    for _ in signals.forever() {
                        log(SIGTERM_IGNORED);
                    }
                });
                if spawned {
                    Ok(())
                } else {
                    Err("cannot spawn the SIGTERM thread".to_owned())
                }
            })
            .clone()
    }

    /// A fresh reverse-RPC id `"rpc-<n>"`.
    pub(crate) fn next_rpc_id(&self) -> String {
        format!("rpc-{}", self.next_rpc.fetch_add(1, Ordering::Relaxed) + 1)
    }

    /// A fresh number for response files of `big_result`.
    pub(crate) fn next_file_no(&self) -> u64 {
        self.next_file.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Registers a waiter for the response whose id is `id`. After stdin EOF the receiver is disconnected.
    pub(crate) fn expect_response(&self, id: &Value) -> mpsc::Receiver<Value> {
        let (tx, rx) = mpsc::channel();
        if let Some(pending) = lock(&self.pending).as_mut() {
            pending.insert(id.to_string(), tx);
        }
        rx
    }

    pub(crate) fn forget_response(&self, id: &Value) {
        if let Some(pending) = lock(&self.pending).as_mut() {
            pending.remove(&id.to_string());
        }
    }

    /// Counts one request as in flight until the returned guard drops.
    fn begin_request(self: &Arc<Self>) -> InFlight {
        *lock(&self.in_flight) += 1;
        InFlight(Arc::clone(self))
    }

    /// After stdin EOF: fails every reverse RPC still waiting (no answer can come now), then waits until
    /// every in-flight request has written its response.
    fn drain(&self) {
        lock(&self.pending).take();
        let mut n = lock(&self.in_flight);
        while *n > 0 {
            n = self.idle.wait(n).unwrap_or_else(PoisonError::into_inner);
        }
    }

    fn route_response(&self, id: &Value, msg: Value) {
        let waiter = lock(&self.pending)
            .as_mut()
            .and_then(|p| p.remove(&id.to_string()));
        match waiter {
            Some(tx) => {
                if tx.send(msg).is_err() {
                    eprintln!("fleet-echo-plugin: response {id} arrived after its invoke gave up");
                }
            }
            None => eprintln!("fleet-echo-plugin: response with unknown id {id} dropped"),
        }
    }
}

/// One request in flight; dropping it (also on panic) marks the request done.
#[derive(Debug)]
struct InFlight(Arc<Shared>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut n = lock(&self.0.in_flight);
        *n = n.saturating_sub(1);
        if *n == 0 {
            self.0.idle.notify_all();
        }
    }
}

/// A JSON-RPC error response object.
pub(crate) fn error_response(id: &Value, code: i64, message: &str, data: Option<Value>) -> Value {
    let mut error = json!({ "code": code, "message": message });
    if let (Some(d), Some(obj)) = (data, error.as_object_mut()) {
        obj.insert("data".to_owned(), d);
    }
    json!({ "jsonrpc": "2.0", "id": id, "error": error })
}

/// Runs `f` on a new named thread; returns false if the thread could not be created.
pub(crate) fn spawn_named(name: String, f: impl FnOnce() + Send + 'static) -> bool {
    match thread::Builder::new().name(name).spawn(f) {
        Ok(_) => true,
        Err(e) => {
            eprintln!("fleet-echo-plugin: cannot spawn a thread: {e}");
            false
        }
    }
}

fn main() -> ExitCode {
    match cli::parse(std::env::args().skip(1)) {
        Err(e) => {
            eprintln!("fleet-echo-plugin: {e}");
            ExitCode::from(2)
        }
        Ok(Mode::Noop) => ExitCode::SUCCESS,
        Ok(Mode::SleepForever) => loop {
            thread::sleep(Duration::from_secs(3600));
        },
        Ok(Mode::SleepMs(ms)) => {
            thread::sleep(Duration::from_millis(ms));
            ExitCode::SUCCESS
        }
        Ok(Mode::Serve(cfg)) => serve(*cfg),
    }
}

fn serve(cfg: Config) -> ExitCode {
    let shared = Arc::new(Shared::new(cfg));
    if let Some(banner) = &shared.cfg.stdout_banner {
        shared.write_line(banner.as_bytes());
    }
    if let Some(banner) = &shared.cfg.stderr_banner {
        eprintln!("{banner}");
    }
    if shared.cfg.ignore_sigterm
        && let Err(e) = shared.ignore_sigterm()
    {
        eprintln!("fleet-echo-plugin: {e}");
    }
    if shared.cfg.startup_delay_ms > 0 {
        thread::sleep(Duration::from_millis(shared.cfg.startup_delay_ms));
    }

    let stdin = io::stdin();
    let mut input = stdin.lock();
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match input.read_until(b'\n', &mut buf) {
            Ok(0) => break,
            Ok(_) if shared.stop_reading.load(Ordering::SeqCst) => {
                log(STOPPED_READING);
                loop {
                    thread::park();
                }
            }
            Ok(_) => handle_line(&shared, buf.trim_ascii()),
            Err(e) => {
                eprintln!("fleet-echo-plugin: stdin read failed: {e}");
                break;
            }
        }
    }
    shared.drain();
    if shared.ignore_eof.load(Ordering::SeqCst) {
        log(EOF_IGNORED);
        loop {
            thread::park();
        }
    }
    ExitCode::SUCCESS
}

/// Classifies one stdin line: a request, a notification, a response to a reverse RPC, or garbage.
fn handle_line(shared: &Arc<Shared>, line: &[u8]) {
    if line.is_empty() {
        return;
    }
    let msg: Value = match serde_json::from_slice(line) {
        Ok(v) => v,
        Err(e) => {
            shared.respond_err(
                &Value::Null,
                code::PARSE_ERROR,
                &format!("parse error: {e}"),
                None,
            );
            return;
        }
    };
    let Value::Object(obj) = msg else {
        shared.respond_err(
            &Value::Null,
            code::INVALID_REQUEST,
            "a message must be a JSON object",
            None,
        );
        return;
    };
    let id = obj.get("id").cloned();
    let id_ok = matches!(id, None | Some(Value::String(_) | Value::Number(_) | Value::Null));
    let reply_id = if id_ok {
        id.clone().unwrap_or(Value::Null)
    } else {
        Value::Null
    };
    if !id_ok {
        shared.respond_err(
            &reply_id,
            code::INVALID_REQUEST,
            "id must be a string, a number or null",
            None,
        );
        return;
    }
    if obj.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        if id.is_some() || obj.contains_key("method") {
            shared.respond_err(&reply_id, code::INVALID_REQUEST, "jsonrpc must be \"2.0\"", None);
        }
        return;
    }
    match obj.get("method") {
        Some(Value::String(method)) => {
            let Some(id) = id else {
                eprintln!("fleet-echo-plugin: notification {method} ignored");
                return;
            };
            let params = obj.get("params").cloned().unwrap_or(Value::Null);
            dispatch(shared, &id, method, params);
        }
        Some(_) => shared.respond_err(&reply_id, code::INVALID_REQUEST, "method must be a string", None),
        None => match id {
            Some(id) if obj.contains_key("result") || obj.contains_key("error") => {
                shared.route_response(&id, Value::Object(obj));
            }
            _ => shared.respond_err(
                &reply_id,
                code::INVALID_REQUEST,
                "neither a request nor a response",
                None,
            ),
        },
    }
}

fn dispatch(shared: &Arc<Shared>, id: &Value, method: &str, params: Value) {
    match method {
        "initialize" => {
            shared.initialize_calls.fetch_add(1, Ordering::SeqCst);
            initialize(shared, id);
        }
        "describe" => {
            shared.describe_calls.fetch_add(1, Ordering::SeqCst);
            let held = lock(&shared.held_initialize).take();
            if let Some(init_id) = held {
                answer_initialize(shared, &init_id, "2.0");
            }
            let s = Arc::clone(shared);
            let id2 = id.clone();
            let guard = shared.begin_request();
            let spawned = spawn_named("describe".to_owned(), move || {
                let _guard = guard;
                if s.cfg.describe_delay_ms > 0 {
                    thread::sleep(Duration::from_millis(s.cfg.describe_delay_ms));
                }
                s.respond_ok(&id2, &manifest::describe_result(&s.cfg));
            });
            if !spawned {
                shared.respond_err(id, code::INTERNAL_ERROR, "cannot spawn a thread", None);
            }
        }
        "invoke" if tools::answers_at_once(&params) => {
            // A tool that never waits is answered on this thread: a thread per call would cost more than the
            // call (and the host's round-trip benchmark would measure it).
            let _guard = shared.begin_request();
            tools::invoke(shared, id, params);
        }
        "invoke" => {
            let s = Arc::clone(shared);
            let id2 = id.clone();
            let guard = shared.begin_request();
            let spawned = spawn_named(format!("invoke {id}"), move || {
                let _guard = guard;
                tools::invoke(&s, &id2, params);
            });
            if !spawned {
                shared.respond_err(id, code::INTERNAL_ERROR, "cannot spawn a thread", None);
            }
        }
        "health" => health(shared, id),
        "shutdown" => shared.respond_ok(id, &json!({ "ok": true })),
        other => {
            shared.respond_err(
                id,
                code::METHOD_NOT_FOUND,
                &format!("method not found: {other}"),
                None,
            );
        }
    }
}

/// Answers `health` as `--health` says (`ready` by default).
fn health(shared: &Shared, id: &Value) {
    let status = match shared.cfg.health {
        HealthMode::Ready => "ready",
        HealthMode::Ok => "ok",
        HealthMode::Healthy => "healthy",
        HealthMode::Initializing => "initializing",
        HealthMode::Error => {
            shared.respond_ok(
                id,
                &json!({ "status": "error", "message": "unhealthy on purpose (--health error)" }),
            );
            return;
        }
        HealthMode::MethodNotFound => {
            shared.respond_err(id, code::METHOD_NOT_FOUND, "method not found: health", None);
            return;
        }
        HealthMode::Hang => {
            eprintln!("fleet-echo-plugin: health left unanswered (--health hang)");
            return;
        }
    };
    shared.respond_ok(id, &json!({ "status": status }));
}

fn initialize(shared: &Shared, id: &Value) {
    let cfg = &shared.cfg;
    if cfg.protocol_v1 {
        shared.respond_err(id, code::METHOD_NOT_FOUND, "method not found: initialize", None);
        return;
    }
    let version = match cfg.initialize {
        InitMode::MethodNotFound => {
            shared.respond_err(id, code::METHOD_NOT_FOUND, "method not found: initialize", None);
            return;
        }
        InitMode::Error => {
            shared.respond_err(id, code::INTERNAL_ERROR, "boom", None);
            return;
        }
        InitMode::Hang => {
            eprintln!("fleet-echo-plugin: initialize left unanswered (--initialize hang)");
            return;
        }
        InitMode::AfterDescribe => {
            *lock(&shared.held_initialize) = Some(id.clone());
            return;
        }
        InitMode::V2 => "2.0",
        InitMode::V1Version => "1.1",
    };
    answer_initialize(shared, id, version);
}

/// The v2-shaped `initialize` reply with `protocolVersion` = `version`.
fn answer_initialize(shared: &Shared, id: &Value, version: &str) {
    let cfg = &shared.cfg;
    let client_caps: Map<String, Value> = cfg.capabilities.iter().map(|c| (c.clone(), json!({}))).collect();
    let info_key = if cfg.server_info_snake {
        "server_info"
    } else {
        "serverInfo"
    };
    let mut result = json!({
        "protocolVersion": version,
        "capabilities": {},
        "client_capabilities": client_caps,
    });
    if let Some(obj) = result.as_object_mut() {
        obj.insert(
            info_key.to_owned(),
            json!({ "name": "fleet-echo-plugin", "version": "0.1.0" }),
        );
    }
    shared.respond_ok(id, &result);
}
