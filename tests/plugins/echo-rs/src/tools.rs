//! The fixture's tools: one function per tool, run on the invoke's own thread.

use std::io::Write;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::{Arc, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};

use crate::{Shared, code, error_response, spawn_named};

/// What a tool produced.
enum Outcome {
    /// `{"success":true,"data":..}`.
    Data(Value),
    /// `{"success":false,"error":..}`.
    Fail(String),
    /// `{"success":true,"data":..}` delivered through `__file_transport`.
    /// `write: false`: only the pointer is sent, to whatever `path` is (the host's file-transport checks).
    ViaFile {
        data: Value,
        path: Option<String>,
        write: bool,
    },
    /// `{"success":true,"data":..}`, then, once it is written, exit the process with `code` after `ms` ms.
    ThenExit { data: Value, ms: u64, code: i32 },
}

/// A JSON-RPC error response instead of a result.
struct RpcErr {
    code: i64,
    message: String,
    data: Option<Value>,
}

fn bad_args(message: impl Into<String>) -> RpcErr {
    RpcErr {
        code: code::INVALID_PARAMS,
        message: message.into(),
        data: None,
    }
}

type ToolResult = Result<Outcome, RpcErr>;

/// Typed access to the invoke's `arguments`; `null` counts as absent.
struct Args<'a>(&'a Map<String, Value>);

impl Args<'_> {
    fn get(&self, k: &str) -> Option<&Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }

    fn u64_opt(&self, k: &str) -> Result<Option<u64>, RpcErr> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| bad_args(format!("{k} must be a non-negative integer"))),
        }
    }

    fn u64_or(&self, k: &str, default: u64) -> Result<u64, RpcErr> {
        Ok(self.u64_opt(k)?.unwrap_or(default))
    }

    fn u64_req(&self, k: &str) -> Result<u64, RpcErr> {
        self.u64_opt(k)?
            .ok_or_else(|| bad_args(format!("missing required argument {k}")))
    }

    fn usize_req(&self, k: &str) -> Result<usize, RpcErr> {
        usize::try_from(self.u64_req(k)?).map_err(|_| bad_args(format!("{k} is too large")))
    }

    fn usize_or(&self, k: &str, default: usize) -> Result<usize, RpcErr> {
        match self.u64_opt(k)? {
            None => Ok(default),
            Some(n) => usize::try_from(n).map_err(|_| bad_args(format!("{k} is too large"))),
        }
    }

    fn i64_or(&self, k: &str, default: i64) -> Result<i64, RpcErr> {
        match self.get(k) {
            None => Ok(default),
            Some(v) => v
                .as_i64()
                .ok_or_else(|| bad_args(format!("{k} must be an integer"))),
        }
    }

    fn bool_or(&self, k: &str, default: bool) -> Result<bool, RpcErr> {
        match self.get(k) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| bad_args(format!("{k} must be a boolean"))),
        }
    }

    fn str_opt(&self, k: &str) -> Result<Option<&str>, RpcErr> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| bad_args(format!("{k} must be a string"))),
        }
    }

    fn str_or<'s>(&'s self, k: &str, default: &'s str) -> Result<&'s str, RpcErr> {
        Ok(self.str_opt(k)?.unwrap_or(default))
    }

    fn str_req(&self, k: &str) -> Result<&str, RpcErr> {
        self.str_opt(k)?
            .ok_or_else(|| bad_args(format!("missing required argument {k}")))
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn success(data: &Value, started: Instant) -> Value {
    json!({ "success": true, "data": data, "duration_ms": millis(started.elapsed()) })
}

/// Serves one `invoke` request and writes its response (unless the tool exits the process).
pub(crate) fn invoke(shared: &Arc<Shared>, id: &Value, params: Value) {
    let started = Instant::now();
    let mut exit_later = None;
    let response = match parse_invoke(params) {
        Err(e) => error_response(id, e.code, &e.message, e.data),
        Ok((tool, args, context)) => {
            let ran = catch_unwind(AssertUnwindSafe(|| {
                run_tool(shared, &tool, &Args(&args), &context)
            }));
            match ran {
                Err(_) => error_response(id, code::INTERNAL_ERROR, &format!("tool {tool} panicked"), None),
                Ok(Err(e)) => error_response(id, e.code, &e.message, e.data),
                Ok(Ok(Outcome::Data(data))) => {
                    json!({ "jsonrpc": "2.0", "id": id, "result": success(&data, started) })
                }
                Ok(Ok(Outcome::ThenExit { data, ms, code })) => {
                    exit_later = Some((ms, code));
                    json!({ "jsonrpc": "2.0", "id": id, "result": success(&data, started) })
                }
                Ok(Ok(Outcome::Fail(error))) => {
                    json!({ "jsonrpc": "2.0", "id": id, "result": { "success": false, "error": error } })
                }
                Ok(Ok(Outcome::ViaFile {
                    path: Some(path),
                    write: false,
                    ..
                })) => {
                    json!({ "jsonrpc": "2.0", "id": id, "__file_transport": path })
                }
                Ok(Ok(Outcome::ViaFile { data, path, .. })) => {
                    let full = json!({ "jsonrpc": "2.0", "id": id, "result": success(&data, started) });
                    match write_response_file(shared, &full, path) {
                        Ok(path) => json!({ "jsonrpc": "2.0", "id": id, "__file_transport": path }),
                        Err(e) => error_response(id, code::INTERNAL_ERROR, &e, None),
                    }
                }
            }
        }
    };
    shared.send(&response);
    if let Some((ms, code)) = exit_later {
        let spawned = spawn_named("exit_after".to_owned(), move || {
            thread::sleep(Duration::from_millis(ms));
            std::process::exit(code);
        });
        if !spawned {
            // No thread for the delay: exit now rather than never.
            std::process::exit(code);
        }
    }
    if shared.cfg.exit_after_first_response {
        std::process::exit(0);
    }
}

/// Whether the invoke of `params` is of a tool that never waits (no sleep, no reverse RPC, no file, no exit):
/// `echo`.
pub(crate) fn answers_at_once(params: &Value) -> bool {
    params.get("tool").and_then(Value::as_str) == Some("echo")
}

fn parse_invoke(params: Value) -> Result<(String, Map<String, Value>, Value), RpcErr> {
    let Value::Object(mut p) = params else {
        return Err(bad_args("invoke params must be an object"));
    };
    let tool = match p.remove("tool") {
        Some(Value::String(t)) => t,
        _ => return Err(bad_args("params.tool must be a string")),
    };
    let args = match p.remove("arguments") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(a)) => a,
        Some(_) => return Err(bad_args("params.arguments must be an object")),
    };
    let context = match p.remove("context") {
        None | Some(Value::Null) => json!({}),
        Some(c) => c,
    };
    Ok((tool, args, context))
}

fn write_response_file(shared: &Shared, full: &Value, path: Option<String>) -> Result<String, String> {
    let path = path.map(PathBuf::from).unwrap_or_else(|| {
        std::env::temp_dir().join(format!(
            "executa-resp-{}-{}.json",
            std::process::id(),
            shared.next_file_no()
        ))
    });
    let bytes = serde_json::to_vec(full).map_err(|e| format!("cannot serialise the response: {e}"))?;
    std::fs::write(&path, bytes).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(path.to_string_lossy().into_owned())
}

fn run_tool(shared: &Arc<Shared>, tool: &str, args: &Args<'_>, context: &Value) -> ToolResult {
    match tool {
        "echo" => Ok(Outcome::Data(json!({ "arguments": args.0 }))),
        "inspect" => Ok(Outcome::Data(inspect(shared, context))),
        "sleep" | "timed_sleep" => {
            let ms = args.u64_req("ms")?;
            thread::sleep(Duration::from_millis(ms));
            Ok(Outcome::Data(json!({ "slept_ms": ms })))
        }
        "progress" => progress(shared, args, context),
        "big_result" => {
            let bytes = args.usize_req("bytes")?;
            let via_file = args.bool_or("via_file", false)?;
            let path = args.str_opt("file_path")?.map(str::to_owned);
            let write = !args.bool_or("pointer_only", false)?;
            let data = json!({ "blob": "x".repeat(bytes) });
            Ok(if via_file {
                Outcome::ViaFile { data, path, write }
            } else {
                Outcome::Data(data)
            })
        }
        "fail" => Ok(Outcome::Fail(
            args.str_or("message", "fixture failure")?.to_owned(),
        )),
        "rpc_error" => Err(RpcErr {
            code: args.i64_or("code", -32000)?,
            message: args.str_or("message", "fixture error")?.to_owned(),
            data: args.get("data").cloned(),
        }),
        "crash" => {
            let exit_code = args.i64_or("exit_code", 101)?;
            let exit_code = i32::try_from(exit_code).map_err(|_| bad_args("exit_code out of range"))?;
            if args.bool_or("abort", false)? {
                std::process::abort();
            }
            std::process::exit(exit_code);
        }
        "junk" => {
            let lines = args.usize_or("lines", 3)?;
            const JUNK: [&[u8]; 5] = [
                b"this is not json {",
                b"[1,2,3]",
                b"{\"hello\":\"an object without jsonrpc\"}",
                b"",
                b"\xff\xfe invalid \xc3\x28 utf-8",
            ];
            for junk in JUNK.iter().cycle().take(lines) {
                shared.write_line(junk);
            }
            Ok(Outcome::Data(json!({ "junk_lines": lines })))
        }
        "flood" => flood(shared, args),
        "stderr" => {
            let text = args.str_req("text")?;
            let repeat = args.u64_or("repeat", 1)?;
            let mut err = std::io::stderr().lock();
            for _ in 0..repeat {
                let _ = writeln!(err, "{text}");
            }
            let _ = err.flush();
            Ok(Outcome::Data(json!({ "lines": repeat })))
        }
        "ignore_shutdown" => {
            if args.bool_or("eof", true)? {
                shared.set_ignore_eof();
            }
            if args.bool_or("sigterm", true)? {
                shared.ignore_sigterm().map_err(|message| RpcErr {
                    code: code::INTERNAL_ERROR,
                    message,
                    data: None,
                })?;
            }
            Ok(Outcome::Data(json!({ "ok": true })))
        }
        "spawn_grandchild" => Ok(spawn_grandchild()),
        "alloc" => alloc(args),
        "fill" => fill(args),
        "fork" => fork(args),
        "spin" => spin(args),
        "reverse_rpc" => reverse_rpc(shared, args, context),
        "write_file" => {
            let path = args.str_req("path")?;
            let content = args.str_req("content")?;
            Ok(match std::fs::write(path, content) {
                Ok(()) => Outcome::Data(json!({ "written": content.len() })),
                Err(e) => Outcome::Fail(e.to_string()),
            })
        }
        "read_file" => {
            let path = args.str_req("path")?;
            Ok(match std::fs::read(path) {
                Ok(bytes) => Outcome::Data(json!({ "content": String::from_utf8_lossy(&bytes) })),
                Err(e) => Outcome::Fail(e.to_string()),
            })
        }
        "exit_after" => {
            let ms = args.u64_req("ms")?;
            let code = i32::try_from(args.i64_or("code", 0)?).map_err(|_| bad_args("code out of range"))?;
            Ok(Outcome::ThenExit {
                data: json!({ "scheduled": true }),
                ms,
                code,
            })
        }
        other => Err(RpcErr {
            code: code::METHOD_NOT_FOUND,
            message: format!("unknown tool: {other}"),
            data: None,
        }),
    }
}

/// Fields 4.. of `/proc/self/stat` (after the command name): state, ppid, pgrp, session, ...
fn proc_stat_field(n: usize) -> Option<i64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(n - 3)?.parse().ok()
}

/// The fields after `<key>:` on that line of `/proc/self/status`, None if the file or line is missing.
fn proc_status_fields(status: Option<&str>, key: &str) -> Option<Vec<u64>> {
    let line = status?
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))?;
    line.split_whitespace().map(|f| f.parse().ok()).collect()
}

fn inspect(shared: &Shared, context: &Value) -> Value {
    let status = std::fs::read_to_string("/proc/self/status").ok();
    let status = status.as_deref();
    let first = |key: &str| proc_status_fields(status, key).and_then(|f| f.first().copied());
    let env: Map<String, Value> = std::env::vars_os()
        .map(|(k, v)| {
            (
                k.to_string_lossy().into_owned(),
                Value::String(v.to_string_lossy().into_owned()),
            )
        })
        .collect();
    let cwd = std::env::current_dir()
        .map(|p| p.to_string_lossy().into_owned())
        .ok();
    json!({
        "pid": std::process::id(),
        "ppid": proc_stat_field(4).unwrap_or_else(|| i64::from(std::os::unix::process::parent_id())),
        "pgid": proc_stat_field(5),
        "sid": proc_stat_field(6),
        "uid": first("Uid"),
        "gid": first("Gid"),
        "groups": proc_status_fields(status, "Groups"),
        "initialize_calls": shared.initialize_calls.load(Ordering::SeqCst),
        "describe_calls": shared.describe_calls.load(Ordering::SeqCst),
        "cwd": cwd,
        "env": env,
        "context": context,
    })
}

/// The invoke id to put in `context.invoke_id` of plugin → host frames.
fn invoke_id_for(args: &Args<'_>, context: &Value) -> Result<Option<Value>, RpcErr> {
    if args.bool_or("omit_invoke_id", false)? {
        return Ok(None);
    }
    if let Some(v) = args.get("invoke_id") {
        return Ok(Some(v.clone()));
    }
    Ok(context.get("invoke_id").cloned())
}

fn progress(shared: &Shared, args: &Args<'_>, context: &Value) -> ToolResult {
    if shared.cfg.protocol_v1 {
        return Ok(Outcome::Fail("v1".to_owned()));
    }
    let count = args.u64_req("count")?;
    let interval = args.u64_or("interval_ms", 0)?;
    let ty = args.str_or("type", "progress")?;
    let pad = "x".repeat(args.usize_or("pad_bytes", 0)?);
    let mut ctx = Map::new();
    if let Some(iid) = invoke_id_for(args, context)? {
        ctx.insert("invoke_id".to_owned(), iid);
    }
    for i in 0..count {
        if i > 0 && interval > 0 {
            thread::sleep(Duration::from_millis(interval));
        }
        shared.send(&json!({
            "jsonrpc": "2.0",
            "method": "executa/progress",
            "params": { "type": ty, "data": { "i": i, "pad": pad }, "context": ctx },
        }));
    }
    Ok(Outcome::Data(json!({ "emitted": count })))
}

/// The method of `flood`'s reverse-RPC requests: one no host serves.
const FLOOD_METHOD: &str = "fixture/flood";

fn flood(shared: &Shared, args: &Args<'_>) -> ToolResult {
    let stdout_bytes = args.usize_or("stdout_bytes", 0)?;
    let stderr_bytes = args.usize_or("stderr_bytes", 0)?;
    let line_bytes = args.usize_or("line_bytes", 4096)?.max(1);
    let requests = args.usize_or("requests", 0)?;
    let pad = "p".repeat(args.usize_or("id_bytes", 0)?);
    if args.bool_or("stop_reading", false)? {
        shared.stop_reading();
    }
    for i in 0..requests {
        let request = json!({"jsonrpc": "2.0", "id": format!("flood-{i}-{pad}"), "method": FLOOD_METHOD});
        shared.write_line(request.to_string().as_bytes());
    }
    // Each line is `line_bytes` bytes including its newline (the last one may be shorter).
    let body = vec![b'z'; line_bytes - 1];
    let mut left = stdout_bytes;
    while left > 0 {
        let n = left.min(line_bytes);
        shared.write_line(&body[..n - 1]);
        left -= n;
    }
    let mut err = std::io::stderr().lock();
    let mut left = stderr_bytes;
    while left > 0 {
        let n = left.min(line_bytes);
        if err
            .write_all(&body[..n - 1])
            .and_then(|()| err.write_all(b"\n"))
            .is_err()
        {
            break;
        }
        left -= n;
    }
    let _ = err.flush();
    Ok(Outcome::Data(
        json!({ "stdout_bytes": stdout_bytes, "stderr_bytes": stderr_bytes, "requests": requests }),
    ))
}

/// Starts `<self> <args>` (or `fallback`) with null stdio.
fn spawn_self(args: &[String], fallback: &[&str]) -> std::io::Result<Child> {
    let quiet = |c: &mut Command| {
        c.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
    };
    let first = std::env::current_exe().and_then(|exe| {
        let mut c = Command::new(exe);
        c.args(args);
        quiet(&mut c);
        c.spawn()
    });
    match (first, fallback.split_first()) {
        (Ok(child), _) => Ok(child),
        (Err(_), Some((prog, rest))) => {
            let mut c = Command::new(prog);
            c.args(rest);
            quiet(&mut c);
            c.spawn()
        }
        (Err(e), None) => Err(e),
    }
}

/// Waits for the children on a background thread so that they leave no zombies.
fn reap(children: Vec<Child>) {
    if children.is_empty() {
        return;
    }
    let _ = spawn_named("reaper".to_owned(), move || {
        for mut c in children {
            let _ = c.wait();
        }
    });
}

fn spawn_grandchild() -> Outcome {
    match spawn_self(&["--sleep-forever".to_owned()], &["sleep", "3600"]) {
        Ok(child) => {
            let pid = child.id();
            reap(vec![child]);
            Outcome::Data(json!({ "pid": pid }))
        }
        Err(e) => Outcome::Fail(format!("cannot spawn the grandchild: {e}")),
    }
}

fn alloc(args: &Args<'_>) -> ToolResult {
    let mib = args.u64_req("mib")?;
    let hold = args.u64_or("hold_ms", 0)?;
    let bytes = usize::try_from(mib)
        .ok()
        .and_then(|m| m.checked_mul(1 << 20))
        .ok_or_else(|| bad_args("mib is too large"))?;
    let mut v: Vec<u8> = Vec::new();
    if let Err(e) = v.try_reserve_exact(bytes) {
        return Ok(Outcome::Fail(format!("allocation of {mib} MiB failed: {e}")));
    }
    v.resize(bytes, 0);
    // Touch every page with a non-zero write so that all of them are really backed.
    for i in (0..bytes).step_by(4096) {
        v[i] = 1;
    }
    std::hint::black_box(&mut v);
    thread::sleep(Duration::from_millis(hold));
    drop(v);
    Ok(Outcome::Data(json!({ "allocated_mib": mib })))
}

fn fill(args: &Args<'_>) -> ToolResult {
    use std::io::Write as _;
    let name = args.str_req("name")?;
    let mib = args.u64_req("mib")?;
    let var = if args.bool_or("workspace", false)? {
        "ANNA_WORKSPACE_DIR"
    } else {
        "TMPDIR"
    };
    let dir = std::path::PathBuf::from(std::env::var_os(var).ok_or_else(|| bad_args("no such directory"))?);
    let chunk = vec![0u8; 1 << 20];
    let mut written = 0u64;
    let errno = match std::fs::File::create(dir.join(name)) {
        Ok(mut file) => (0..mib)
            .try_for_each(|_| {
                let n = file.write(&chunk)?;
                written += n as u64;
                if n < chunk.len() {
                    file.write_all(&chunk[n..])?;
                    written += (chunk.len() - n) as u64;
                }
                Ok::<(), std::io::Error>(())
            })
            .err()
            .map(|e| e.raw_os_error()),
        Err(e) => Some(e.raw_os_error()),
    };
    Ok(Outcome::Data(
        json!({ "written": written, "errno": errno.flatten() }),
    ))
}

fn fork(args: &Args<'_>) -> ToolResult {
    let count = args.u64_req("count")?;
    let hold = args.u64_or("hold_ms", 60_000)?;
    let child_args = ["--sleep-ms".to_owned(), hold.to_string()];
    let hold_s = hold.div_ceil(1000).to_string();
    let mut children = Vec::new();
    let mut errors = 0u64;
    let mut first_error: Option<String> = None;
    for _ in 0..count {
        match spawn_self(&child_args, &["sleep", &hold_s]) {
            Ok(c) => children.push(c),
            Err(e) => {
                errors += 1;
                first_error.get_or_insert_with(|| e.to_string());
            }
        }
    }
    let spawned = children.len();
    reap(children);
    Ok(Outcome::Data(
        json!({ "spawned": spawned, "errors": errors, "first_error": first_error }),
    ))
}

fn spin(args: &Args<'_>) -> ToolResult {
    let ms = args.u64_req("ms")?;
    let threads = args.u64_or("threads", 1)?;
    let end = Instant::now() + Duration::from_millis(ms);
    let mut handles = Vec::new();
    for i in 0..threads {
        let spawned = thread::Builder::new().name(format!("spin-{i}")).spawn(move || {
            while Instant::now() < end {
                std::hint::spin_loop();
            }
        });
        if let Ok(h) = spawned {
            handles.push(h);
        }
    }
    let started = handles.len();
    for h in handles {
        let _ = h.join();
    }
    Ok(Outcome::Data(json!({ "spun_ms": ms, "threads": started })))
}

fn reverse_rpc(shared: &Shared, args: &Args<'_>, context: &Value) -> ToolResult {
    if shared.cfg.protocol_v1 {
        return Ok(Outcome::Fail("v1".to_owned()));
    }
    let method = args.str_req("method")?;
    let timeout = args.u64_or("timeout_ms", 10_000)?;
    let mut params = match args.get("params") {
        None => Map::new(),
        Some(Value::Object(p)) => p.clone(),
        Some(_) => return Err(bad_args("params must be an object")),
    };
    if let Some(iid) = invoke_id_for(args, context)? {
        let ctx = params.entry("context").or_insert_with(|| json!({}));
        if !ctx.is_object() {
            *ctx = json!({});
        }
        if let Some(ctx) = ctx.as_object_mut() {
            ctx.insert("invoke_id".to_owned(), iid);
        }
    }
    let count = args.usize_or("count", 1)?;
    let frame_bytes = args.usize_or("frame_bytes", 0)?;
    if count > 1 || frame_bytes > 0 {
        return reverse_burst(shared, method, &params, count, frame_bytes, timeout);
    }
    let id = Value::String(shared.next_rpc_id());
    let rx = shared.expect_response(&id);
    shared.send(&json!({ "jsonrpc": "2.0", "id": id, "method": method, "params": params }));
    match rx.recv_timeout(Duration::from_millis(timeout)) {
        Ok(response) => Ok(Outcome::Data(json!({ "response": response }))),
        Err(mpsc::RecvTimeoutError::Timeout) => {
            shared.forget_response(&id);
            Ok(Outcome::Fail(format!(
                "reverse rpc {id} timed out after {timeout} ms"
            )))
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => Ok(Outcome::Fail(format!(
            "reverse rpc {id}: stdin closed before the answer"
        ))),
    }
}

/// `reverse_rpc` with `count` and/or `frame_bytes`: writes `count` requests at once, each padded
/// (`params.pad`) to exactly `frame_bytes` bytes of line when that is more than the unpadded line, then waits
/// for every answer (`timeout_ms` in all) and returns them in order (`responses`).
fn reverse_burst(
    shared: &Shared,
    method: &str,
    params: &Map<String, Value>,
    count: usize,
    frame_bytes: usize,
    timeout: u64,
) -> ToolResult {
    let mut waiting = Vec::with_capacity(count);
    for _ in 0..count {
        let id = Value::String(shared.next_rpc_id());
        let mut params = params.clone();
        params.insert("pad".to_owned(), Value::String(String::new()));
        let bare = json!({ "jsonrpc": "2.0", "id": id, "method": method, "params": params });
        let bare_len = bare.to_string().len();
        params.insert(
            "pad".to_owned(),
            Value::String("x".repeat(frame_bytes.saturating_sub(bare_len))),
        );
        let rx = shared.expect_response(&id);
        shared.send(&json!({ "jsonrpc": "2.0", "id": id, "method": method, "params": params }));
        waiting.push((id, rx));
    }
    let deadline = std::time::Instant::now() + Duration::from_millis(timeout);
    let mut responses = Vec::with_capacity(count);
    for (id, rx) in waiting {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(response) => responses.push(response),
            Err(_) => {
                shared.forget_response(&id);
                return Ok(Outcome::Fail(format!(
                    "reverse rpc {id} got no answer within {timeout} ms"
                )));
            }
        }
    }
    Ok(Outcome::Data(json!({ "responses": responses })))
}
