//! Tests of the fixture plugins themselves (`fleet-echo-plugin` and `plugins/python/echo_plugin.py`): every flag
//! and tool that the host's tests rely on, driven over real pipes with plain `serde_json` line I/O.
//!
//! No test sleeps to synchronise or asserts on elapsed time: every wait is for an observable event (a line on
//! stdout or stderr, an exit status), and timeouts are only failure guards. "Still running after EOF/SIGTERM"
//! is checked once the plugin has logged to stderr that it handled the event.

// Test code: the helpers outside `#[test]` fns panic on purpose when the fixture misbehaves.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::VecDeque;
use std::future::Future;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use fleet_e2e_client::{echo_plugin_bin, python_plugin_path};
use serde_json::{Value, json};
use tokio::io::Lines;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStderr, ChildStdin, ChildStdout, Command};

/// Failure guard of every single wait.
const GUARD: Duration = Duration::from_secs(20);

/// What the Rust fixture logs to stderr when it parks after stdin EOF (`--ignore-eof` / `ignore_shutdown`).
const EOF_IGNORED: &str = "fleet-echo-plugin: stdin EOF ignored, parking";
/// What the Rust fixture logs to stderr each time it ignores a SIGTERM (`--ignore-sigterm` / `ignore_shutdown`).
const SIGTERM_IGNORED: &str = "fleet-echo-plugin: SIGTERM ignored";

/// All the tools the Rust fixture's manifest must list.
const RUST_TOOLS: &[&str] = &[
    "echo",
    "inspect",
    "sleep",
    "timed_sleep",
    "progress",
    "big_result",
    "fail",
    "rpc_error",
    "crash",
    "junk",
    "flood",
    "stderr",
    "ignore_shutdown",
    "spawn_grandchild",
    "alloc",
    "fork",
    "spin",
    "reverse_rpc",
    "write_file",
    "read_file",
    "exit_after",
    "fill",
];

async fn guard<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(GUARD, fut).await {
        Ok(v) => v,
        Err(_) => panic!("timed out after {GUARD:?} waiting for {what}"),
    }
}

/// The piped stderr of a plugin, read line by line.
struct StderrLog(Lines<BufReader<ChildStderr>>);

impl StderrLog {
    /// Reads stderr lines until one equals `marker` (lines before it are skipped, and echoed when
    /// `FLEET_E2E_PLUGIN_STDERR` is set). Panics if stderr closes first or after [`GUARD`].
    async fn wait_for(&mut self, marker: &str) {
        let echo = std::env::var_os("FLEET_E2E_PLUGIN_STDERR").is_some();
        let scan = async {
            loop {
                let line = self.0.next_line().await.unwrap();
                let Some(line) = line else {
                    panic!("plugin stderr closed before {marker:?}");
                };
                if echo {
                    // Shows what the plugin logged, as FLEET_E2E_PLUGIN_STDERR asks.
                    #[allow(clippy::print_stderr)]
                    {
                        eprintln!("{line}");
                    }
                }
                if line == marker {
                    return;
                }
            }
        };
        guard(&format!("{marker:?} on the plugin's stderr"), scan).await;
    }
}

/// A running fixture plugin with piped stdin/stdout, killed on drop.
struct Plugin {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    /// Messages read while waiting for something else, in arrival order.
    stash: VecDeque<Value>,
    /// Lines read that were not JSON.
    junk: Vec<Vec<u8>>,
    next_id: i64,
}

impl Plugin {
    fn command(args: &[&str]) -> Command {
        let mut cmd = Command::new(echo_plugin_bin());
        cmd.args(args);
        cmd
    }

    fn python_command() -> Command {
        let mut cmd = Command::new("python3");
        cmd.arg(python_plugin_path());
        cmd
    }

    fn start(args: &[&str]) -> Self {
        Self::spawn(Self::command(args))
    }

    /// Spawns with stderr discarded (set `FLEET_E2E_PLUGIN_STDERR=1` to see it).
    fn spawn(cmd: Command) -> Self {
        let stderr = if std::env::var_os("FLEET_E2E_PLUGIN_STDERR").is_some() {
            Stdio::inherit()
        } else {
            Stdio::null()
        };
        Self::spawn_with_stderr(cmd, stderr)
    }

    fn spawn_with_stderr(mut cmd: Command, stderr: Stdio) -> Self {
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true);
        let mut child = cmd.spawn().expect("spawn the fixture plugin");
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Self {
            child,
            stdin,
            stdout,
            stash: VecDeque::new(),
            junk: Vec::new(),
            next_id: 100,
        }
    }

    /// Starts the Rust fixture with stderr piped; returns the plugin and its stderr.
    fn start_with_stderr_log(args: &[&str]) -> (Self, StderrLog) {
        let mut p = Self::spawn_with_stderr(Self::command(args), Stdio::piped());
        let stderr = p.child.stderr.take().unwrap();
        (p, StderrLog(BufReader::new(stderr).lines()))
    }

    fn pid(&self) -> u32 {
        self.child.id().expect("plugin still running")
    }

    async fn send_raw(&mut self, bytes: &[u8]) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        stdin.write_all(bytes).await.unwrap();
        stdin.write_all(b"\n").await.unwrap();
        stdin.flush().await.unwrap();
    }

    async fn send(&mut self, msg: &Value) {
        self.send_raw(&serde_json::to_vec(msg).unwrap()).await;
    }

    /// Sends a request with a fresh integer id; returns the id.
    async fn request(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = json!(self.next_id);
        self.send(&json!({ "jsonrpc": "2.0", "id": id, "method": method, "params": params }))
            .await;
        id
    }

    /// The next raw stdout line without its `\n`, or None at EOF.
    async fn read_raw_line(&mut self) -> Option<Vec<u8>> {
        let mut buf = Vec::new();
        let n = guard("a stdout line", self.stdout.read_until(b'\n', &mut buf))
            .await
            .unwrap();
        if n == 0 {
            return None;
        }
        assert_eq!(buf.pop(), Some(b'\n'), "every frame ends with a newline");
        Some(buf)
    }

    /// The next JSON message on the wire (non-JSON lines go to `junk`).
    async fn next_message(&mut self) -> Value {
        loop {
            let line = self.read_raw_line().await.expect("plugin stdout closed");
            match serde_json::from_slice(&line) {
                Ok(v) => return v,
                Err(_) => self.junk.push(line),
            }
        }
    }

    /// The response (a message with no `method`) whose id is `id`; other messages are stashed.
    async fn response(&mut self, id: &Value) -> Value {
        let is_it = |m: &Value| m.get("method").is_none() && m.get("id") == Some(id);
        if let Some(pos) = self.stash.iter().position(is_it) {
            return self.stash.remove(pos).unwrap();
        }
        loop {
            let m = self.next_message().await;
            if is_it(&m) {
                return m;
            }
            self.stash.push_back(m);
        }
    }

    async fn call(&mut self, method: &str, params: Value) -> Value {
        let id = self.request(method, params).await;
        self.response(&id).await
    }

    /// `invoke` with an `invoke_id` in the context; returns the whole response.
    async fn invoke(&mut self, tool: &str, arguments: Value) -> Value {
        let invoke_id = format!("inv-{}", self.next_id + 1);
        self.call(
            "invoke",
            json!({ "tool": tool, "arguments": arguments, "context": { "invoke_id": invoke_id } }),
        )
        .await
    }

    /// `invoke` that must succeed; returns `result.data`.
    async fn invoke_ok(&mut self, tool: &str, arguments: Value) -> Value {
        let resp = self.invoke(tool, arguments).await;
        assert_eq!(resp["result"]["success"], true, "{tool} failed: {resp}");
        assert!(resp["result"]["duration_ms"].is_u64(), "{resp}");
        resp["result"]["data"].clone()
    }

    async fn initialize(&mut self) -> Value {
        self.call(
            "initialize",
            json!({
                "protocolVersion": "2.0",
                "clientInfo": { "name": "fleet-e2e", "version": "0" },
                "capabilities": { "sampling": {}, "fileTransport": true },
            }),
        )
        .await
    }

    fn close_stdin(&mut self) {
        self.stdin.take();
    }

    async fn wait(&mut self) -> ExitStatus {
        guard("the plugin to exit", self.child.wait()).await.unwrap()
    }

    /// Asserts that the process has not exited (yet).
    fn assert_running(&mut self, when: &str) {
        let status = self.child.try_wait().unwrap();
        assert!(status.is_none(), "exited {when}: {status:?}");
    }
}

fn signal(pid: u32, sig: &str) {
    let status = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill {sig} {pid}");
}

/// Kills a process that is not our child (a grandchild) when dropped.
struct KillOnDrop(u32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-KILL", &self.0.to_string()])
            .stderr(Stdio::null())
            .status();
    }
}

/// State letter of a process from /proc, None if it is gone.
fn proc_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.split_whitespace().next()?.chars().next()
}

fn tool_names(manifest: &Value) -> Vec<String> {
    manifest["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap().to_owned())
        .collect()
}

// ---------------------------------------------------------------------------------------------------------
// Handshake and describe

#[tokio::test]
async fn v2_handshake_and_describe_camel() {
    let mut p = Plugin::start(&[]);
    let init = p.initialize().await;
    let r = &init["result"];
    assert_eq!(init["jsonrpc"], "2.0");
    assert_eq!(r["protocolVersion"], "2.0");
    assert_eq!(
        r["serverInfo"],
        json!({ "name": "fleet-echo-plugin", "version": "0.1.0" })
    );
    assert!(r.get("server_info").is_none());
    assert_eq!(r["capabilities"], json!({}));
    assert_eq!(r["client_capabilities"], json!({ "sampling": {}, "storage": {} }));

    let d = p.call("describe", Value::Null).await;
    let m = &d["result"];
    assert_eq!(m["name"], "echo");
    assert_eq!(m["display_name"], "Echo fixture");
    assert_eq!(m["version"], "0.1.0");
    assert!(m["description"].is_string());
    assert_eq!(m["host_capabilities"], json!([]));
    assert_eq!(
        m["credentials"],
        json!([{ "name": "ECHO_API_KEY", "required": false, "sensitive": true }])
    );
    assert_eq!(tool_names(m), RUST_TOOLS);
    let types = ["string", "integer", "number", "boolean", "array", "object"];
    for t in m["tools"].as_array().unwrap() {
        assert!(t["description"].is_string(), "{t}");
        for param in t["parameters"].as_array().unwrap() {
            assert!(param["name"].is_string(), "{param}");
            assert!(types.contains(&param["type"].as_str().unwrap()), "{param}");
            assert!(param["required"].is_boolean(), "{param}");
            assert!(param["description"].is_string(), "{param}");
        }
    }
    let timed = m["tools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "timed_sleep")
        .unwrap();
    assert_eq!(timed["timeout"], 1);
    let params = |tool: &str| -> Vec<(String, String, bool)> {
        let t = m["tools"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == tool)
            .unwrap();
        t["parameters"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                let s = |k: &str| p[k].as_str().unwrap().to_owned();
                (s("name"), s("type"), p["required"].as_bool().unwrap())
            })
            .collect()
    };
    let owned = |v: &[(&str, &str, bool)]| -> Vec<(String, String, bool)> {
        v.iter()
            .map(|(n, t, r)| ((*n).to_owned(), (*t).to_owned(), *r))
            .collect()
    };
    assert_eq!(
        params("write_file"),
        owned(&[("path", "string", true), ("content", "string", true)])
    );
    assert_eq!(params("read_file"), owned(&[("path", "string", true)]));
    assert_eq!(
        params("exit_after"),
        owned(&[("ms", "integer", true), ("code", "integer", false)])
    );
    assert_eq!(
        params("fill"),
        owned(&[
            ("name", "string", true),
            ("mib", "integer", true),
            ("workspace", "boolean", false)
        ])
    );

    assert_eq!(
        p.call("health", Value::Null).await["result"],
        json!({ "status": "ready" })
    );
    assert_eq!(
        p.call("shutdown", Value::Null).await["result"],
        json!({ "ok": true })
    );
    // shutdown is only advisory: the plugin keeps serving until EOF.
    assert_eq!(
        p.invoke_ok("echo", json!({ "a": 1 })).await["arguments"],
        json!({ "a": 1 })
    );
    let unknown = p.call("frobnicate", json!({})).await;
    assert_eq!(unknown["error"]["code"], -32601);
    p.close_stdin();
    assert_eq!(p.wait().await.code(), Some(0));
}

#[tokio::test]
async fn v2_handshake_snake_and_custom_capabilities() {
    let mut p = Plugin::start(&[
        "--server-info-style",
        "snake",
        "--capabilities",
        "image,upload,embed",
        "--host-capabilities",
        "llm.sample,aps.kv",
        "--tool-timeout-s",
        "7",
    ]);
    let r = p.initialize().await["result"].clone();
    assert_eq!(
        r["server_info"],
        json!({ "name": "fleet-echo-plugin", "version": "0.1.0" })
    );
    assert!(r.get("serverInfo").is_none());
    assert_eq!(
        r["client_capabilities"],
        json!({ "image": {}, "upload": {}, "embed": {} })
    );
    let m = p.call("describe", Value::Null).await["result"].clone();
    assert_eq!(m["host_capabilities"], json!(["llm.sample", "aps.kv"]));
    let timed = m["tools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "timed_sleep")
        .unwrap();
    assert_eq!(timed["timeout"], 7);
}

#[tokio::test]
async fn initialize_error_modes() {
    let mut p = Plugin::start(&["--initialize", "method-not-found"]);
    assert_eq!(p.initialize().await["error"]["code"], -32601);
    // Everything else still works (v1 fallback path).
    assert_eq!(
        tool_names(&p.call("describe", Value::Null).await["result"]),
        RUST_TOOLS
    );
    p.invoke_ok("echo", json!({})).await;

    let mut p = Plugin::start(&["--initialize", "error"]);
    let e = p.initialize().await["error"].clone();
    assert_eq!(e["code"], -32603);
    assert_eq!(e["message"], "boom");

    let mut p = Plugin::start(&["--initialize", "v1-version"]);
    let r = p.initialize().await["result"].clone();
    assert_eq!(r["protocolVersion"], "1.1");
    assert!(r["serverInfo"].is_object());

    let mut p = Plugin::start(&["--initialize", "v2"]);
    assert_eq!(p.initialize().await["result"]["protocolVersion"], "2.0");
}

#[tokio::test]
async fn initialize_hang_serves_everything_else() {
    let mut p = Plugin::start(&["--initialize", "hang"]);
    let init_id = p.request("initialize", json!({ "protocolVersion": "2.0" })).await;
    let health_id = p.request("health", Value::Null).await;
    // The next response on the wire is health's: initialize was skipped.
    let first = p.next_message().await;
    assert_eq!(first["id"], health_id);
    assert_eq!(p.call("describe", Value::Null).await["result"]["name"], "echo");
    p.invoke_ok("echo", json!({})).await;
    assert!(p.stash.is_empty(), "unexpected messages: {:?}", p.stash);
    // Closing stdin ends the plugin; initialize was never answered.
    p.close_stdin();
    while let Some(line) = p.read_raw_line().await {
        let v: Value = serde_json::from_slice(&line).unwrap();
        assert_ne!(v["id"], init_id, "initialize must never be answered");
    }
    assert_eq!(p.wait().await.code(), Some(0));
}

#[tokio::test]
async fn protocol_v1_refuses_initialize_and_reverse_features() {
    let mut p = Plugin::start(&["--protocol", "v1"]);
    assert_eq!(p.initialize().await["error"]["code"], -32601);
    let r = p.invoke("reverse_rpc", json!({ "method": "storage/get" })).await;
    assert_eq!(r["result"], json!({ "success": false, "error": "v1" }));
    let r = p.invoke("progress", json!({ "count": 3 })).await;
    assert_eq!(r["result"], json!({ "success": false, "error": "v1" }));
    assert!(p.stash.is_empty(), "v1 emits no progress: {:?}", p.stash);
    p.invoke_ok("echo", json!({})).await;
}

#[tokio::test]
async fn describe_modes_and_delay() {
    let mut p = Plugin::start(&["--describe-mode", "wrapped"]);
    let r = p.call("describe", Value::Null).await["result"].clone();
    assert!(r.get("name").is_none());
    assert_eq!(r["manifest"]["name"], "echo");

    let mut p = Plugin::start(&["--describe-mode", "omit-name"]);
    let r = p.call("describe", Value::Null).await["result"].clone();
    assert!(r.get("name").is_none());
    assert_eq!(tool_names(&r), RUST_TOOLS);

    let mut p = Plugin::start(&["--describe-mode", "invalid"]);
    let r = p.call("describe", Value::Null).await["result"].clone();
    assert_eq!(r["name"], "echo");
    assert!(r["tools"].is_string());

    // A slow describe does not hold up other requests.
    let mut p = Plugin::start(&["--describe-delay-ms", "1500"]);
    let describe_id = p.request("describe", Value::Null).await;
    let health_id = p.request("health", Value::Null).await;
    assert_eq!(p.next_message().await["id"], health_id);
    let d = p.response(&describe_id).await;
    assert_eq!(d["result"]["name"], "echo");
}

#[tokio::test]
async fn banners_and_startup_delay() {
    let cmd = Plugin::command(&[
        "--stdout-banner",
        "hello, not json",
        "--stderr-banner",
        "stderr banner here",
        "--startup-delay-ms",
        "100",
    ]);
    let mut p = Plugin::spawn_with_stderr(cmd, Stdio::piped());
    let mut stderr = BufReader::new(p.child.stderr.take().unwrap());
    assert_eq!(p.read_raw_line().await.unwrap(), b"hello, not json");
    let mut line = String::new();
    guard("stderr banner", stderr.read_line(&mut line)).await.unwrap();
    assert_eq!(line, "stderr banner here\n");
    assert_eq!(p.initialize().await["result"]["protocolVersion"], "2.0");
    // The stderr tool writes lines to stderr and answers.
    let d = p
        .invoke_ok("stderr", json!({ "text": "log line", "repeat": 3 }))
        .await;
    assert_eq!(d["lines"], 3);
    for _ in 0..3 {
        line.clear();
        guard("stderr line", stderr.read_line(&mut line)).await.unwrap();
        assert_eq!(line, "log line\n");
    }
}

#[tokio::test]
async fn noop_exits_at_once() {
    let mut p = Plugin::start(&["--noop"]);
    assert_eq!(p.wait().await.code(), Some(0));
    assert_eq!(p.read_raw_line().await, None);
    // --sleep-ms (the children of `fork`) exits 0 after the sleep.
    let mut p = Plugin::start(&["--sleep-ms", "10"]);
    assert_eq!(p.wait().await.code(), Some(0));
    // An unknown flag is a usage error.
    let mut p = Plugin::start(&["--no-such-flag"]);
    assert_eq!(p.wait().await.code(), Some(2));
}

#[tokio::test]
async fn bad_input_gets_json_rpc_errors() {
    let mut p = Plugin::start(&[]);
    p.send_raw(b"this is not json").await;
    let e = p.next_message().await;
    assert_eq!(e["error"]["code"], -32700);
    assert_eq!(e["id"], Value::Null);
    p.send_raw(b"\xff\xfe\xfd").await;
    assert_eq!(p.next_message().await["error"]["code"], -32700);
    p.send_raw(b"[1,2]").await;
    assert_eq!(p.next_message().await["error"]["code"], -32600);
    p.send_raw(b"").await; // empty lines are ignored
    p.send_raw(b"   ").await;
    p.send(&json!({ "jsonrpc": "2.0", "id": 5, "method": 7 })).await;
    let e = p.next_message().await;
    assert_eq!(
        (e["id"].clone(), e["error"]["code"].clone()),
        (json!(5), json!(-32600))
    );
    p.send(&json!({ "jsonrpc": "2.0", "id": [1], "method": "health" }))
        .await;
    assert_eq!(p.next_message().await["error"]["code"], -32600);
    p.send(&json!({ "jsonrpc": "1.0", "id": 6, "method": "health" }))
        .await;
    assert_eq!(p.next_message().await["error"]["code"], -32600);
    // Invoke argument errors.
    let r = p.call("invoke", json!({ "arguments": {} })).await;
    assert_eq!(r["error"]["code"], -32602);
    let r = p
        .call("invoke", json!({ "tool": "echo", "arguments": [1] }))
        .await;
    assert_eq!(r["error"]["code"], -32602);
    let r = p.invoke("sleep", json!({ "ms": "soon" })).await;
    assert_eq!(r["error"]["code"], -32602);
    let r = p.invoke("sleep", json!({})).await;
    assert_eq!(r["error"]["code"], -32602);
    let r = p.invoke("no_such_tool", json!({})).await;
    assert_eq!(r["error"]["code"], -32601);
    // A notification gets no answer; a string id is echoed verbatim.
    p.send(&json!({ "jsonrpc": "2.0", "method": "health" })).await;
    p.send(&json!({ "jsonrpc": "2.0", "id": "str-id", "method": "health" }))
        .await;
    let r = p.next_message().await;
    assert_eq!(r["id"], "str-id");
    assert_eq!(r["result"]["status"], "ready");
    // A response nobody waits for is dropped silently.
    p.send(&json!({ "jsonrpc": "2.0", "id": "rpc-99", "result": {} }))
        .await;
    p.invoke_ok("echo", json!({})).await;
    assert!(p.stash.is_empty(), "{:?}", p.stash);
}

// ---------------------------------------------------------------------------------------------------------
// Tools

#[tokio::test]
async fn echo_and_inspect() {
    let mut cmd = Plugin::command(&[]);
    cmd.env("FLEET_E2E_MARKER", "marker-value");
    let mut p = Plugin::spawn(cmd);
    let args = json!({ "message": "hi", "nested": { "a": [1, 2, { "b": null }] }, "n": 1.5 });
    assert_eq!(
        p.invoke_ok("echo", args.clone()).await,
        json!({ "arguments": args })
    );

    let context = json!({
        "invoke_id": "inv-inspect",
        "deadline_ms": 123_456,
        "credentials": { "ECHO_API_KEY": "k-1" },
        "sampling_token": "tok",
    });
    let r = p
        .call(
            "invoke",
            json!({ "tool": "inspect", "arguments": {}, "context": context }),
        )
        .await;
    let d = &r["result"]["data"];
    assert_eq!(d["context"], context);
    assert_eq!(d["env"]["FLEET_E2E_MARKER"], "marker-value");
    assert_eq!(d["pid"], p.pid());
    assert_eq!(d["ppid"], std::process::id());
    assert!(
        d["pgid"].is_i64() && d["sid"].is_i64() && d["uid"].is_u64(),
        "{d}"
    );
    assert_eq!(d["cwd"], std::env::current_dir().unwrap().to_str().unwrap());
    // The plugin inherits our credentials.
    assert_eq!(d["gid"], json!(own_status_fields("Gid")[0]), "{d}");
    assert_eq!(d["groups"], json!(own_status_fields("Groups")), "{d}");
    // No handshake on this process.
    assert_eq!(
        (&d["initialize_calls"], &d["describe_calls"]),
        (&json!(0), &json!(0))
    );
}

/// The numbers after `<key>:` in our own `/proc/self/status`.
fn own_status_fields(key: &str) -> Vec<u64> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let prefix = format!("{key}:");
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .unwrap();
    line.split_whitespace().map(|f| f.parse().unwrap()).collect()
}

#[tokio::test]
async fn inspect_counts_handshake_requests() {
    let mut p = Plugin::start(&[]);
    p.initialize().await;
    p.call("describe", Value::Null).await;
    let counters = |d: &Value| (d["initialize_calls"].clone(), d["describe_calls"].clone());
    let d = p.invoke_ok("inspect", json!({})).await;
    assert_eq!(counters(&d), (json!(1), json!(1)), "{d}");
    p.invoke_ok("echo", json!({})).await;
    let d = p.invoke_ok("inspect", json!({})).await;
    assert_eq!(counters(&d), (json!(1), json!(1)), "invokes are not counted: {d}");
    // A second handshake is counted, even one that is not answered normally.
    let mut p = Plugin::start(&["--initialize", "error"]);
    p.initialize().await;
    p.initialize().await;
    p.call("describe", Value::Null).await;
    let d = p.invoke_ok("inspect", json!({})).await;
    assert_eq!(counters(&d), (json!(2), json!(1)), "{d}");
}

#[tokio::test]
async fn write_file_and_read_file() {
    let dir = std::env::temp_dir().join(format!("fleet-e2e-files-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut cmd = Plugin::command(&[]);
    cmd.current_dir(&dir);
    let mut p = Plugin::spawn(cmd);

    // Absolute path, written then read back (multi-byte UTF-8: `written` counts bytes).
    let abs = dir.join("abs.txt");
    let content = "héllo\nworld";
    let d = p
        .invoke_ok(
            "write_file",
            json!({ "path": abs.to_str().unwrap(), "content": content }),
        )
        .await;
    assert_eq!(d, json!({ "written": content.len() }));
    assert_eq!(std::fs::read_to_string(&abs).unwrap(), content);
    let d = p
        .invoke_ok("read_file", json!({ "path": abs.to_str().unwrap() }))
        .await;
    assert_eq!(d, json!({ "content": content }));

    // A relative path is relative to the plugin's cwd; overwriting truncates.
    let d = p
        .invoke_ok("write_file", json!({ "path": "rel.txt", "content": "xyz" }))
        .await;
    assert_eq!(d["written"], 3);
    assert_eq!(std::fs::read_to_string(dir.join("rel.txt")).unwrap(), "xyz");
    p.invoke_ok("write_file", json!({ "path": "rel.txt", "content": "" }))
        .await;
    assert_eq!(
        p.invoke_ok("read_file", json!({ "path": "rel.txt" })).await["content"],
        ""
    );

    // Invalid UTF-8 is read lossily.
    std::fs::write(dir.join("bin"), b"a\xffb").unwrap();
    assert_eq!(
        p.invoke_ok("read_file", json!({ "path": "bin" })).await["content"],
        "a\u{fffd}b"
    );

    // I/O errors are tool failures carrying the OS error text, never JSON-RPC errors.
    let fails = |r: &Value, text: &str| {
        assert!(r.get("error").is_none(), "{r}");
        assert_eq!(r["result"]["success"], false, "{r}");
        let error = r["result"]["error"].as_str().unwrap();
        assert!(error.contains(text), "{text:?} not in {r}");
    };
    let r = p.invoke("read_file", json!({ "path": "no-such-file" })).await;
    fails(&r, "No such file");
    let r = p
        .invoke("write_file", json!({ "path": "no-such-dir/f", "content": "x" }))
        .await;
    fails(&r, "No such file");
    let r = p
        .invoke("write_file", json!({ "path": ".", "content": "x" }))
        .await;
    fails(&r, "Is a directory");
    let r = p.invoke("read_file", json!({ "path": "." })).await;
    fails(&r, "Is a directory");
    // Missing or mistyped arguments are still -32602.
    assert_eq!(
        p.invoke("write_file", json!({ "path": "f" })).await["error"]["code"],
        -32602
    );
    assert_eq!(
        p.invoke("read_file", json!({ "path": 1 })).await["error"]["code"],
        -32602
    );

    p.invoke_ok("echo", json!({})).await;
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn exit_after_exits_with_the_code() {
    let mut p = Plugin::start(&[]);
    p.initialize().await;
    assert_eq!(
        p.invoke_ok("exit_after", json!({ "ms": 50, "code": 7 })).await,
        json!({ "scheduled": true })
    );
    // The plugin exits on its own, idle with stdin still open.
    assert!(p.stdin.is_some());
    assert_eq!(p.wait().await.code(), Some(7));
    assert_eq!(p.read_raw_line().await, None);

    // Default code 0; ms 0 still answers first.
    let mut p = Plugin::start(&[]);
    assert_eq!(
        p.invoke_ok("exit_after", json!({ "ms": 0 })).await,
        json!({ "scheduled": true })
    );
    assert_eq!(p.wait().await.code(), Some(0));

    let mut p = Plugin::start(&[]);
    assert_eq!(p.invoke("exit_after", json!({})).await["error"]["code"], -32602);
    let r = p.invoke("exit_after", json!({ "ms": 0, "code": i64::MAX })).await;
    assert_eq!(r["error"]["code"], -32602);
    p.invoke_ok("echo", json!({})).await;
}

#[tokio::test]
async fn concurrent_sleeps_complete_out_of_order() {
    let mut p = Plugin::start(&[]);
    // Sent in this order; the 2 s one first, the 10 ms one second.
    let durations: Vec<u64> = vec![
        2000, 10, 900, 50, 700, 300, 1200, 20, 600, 150, 800, 40, 1000, 250, 500, 5, 1500, 100, 350, 1,
    ];
    assert_eq!(durations.len(), 20);
    let mut ids = Vec::new();
    for (i, ms) in durations.iter().enumerate() {
        let tool = if i % 2 == 0 { "sleep" } else { "timed_sleep" };
        let id = p
            .request("invoke", json!({ "tool": tool, "arguments": { "ms": ms } }))
            .await;
        ids.push(id);
    }
    let mut order = Vec::new();
    for _ in 0..durations.len() {
        let m = p.next_message().await;
        let idx = ids
            .iter()
            .position(|id| *id == m["id"])
            .expect("a response to one of ours");
        assert_eq!(m["result"]["data"]["slept_ms"], durations[idx]);
        order.push(idx);
    }
    let pos = |idx: usize| order.iter().position(|&o| o == idx).unwrap();
    assert!(
        pos(1) < pos(0),
        "the 10 ms sleep must not wait for the 2 s one: {order:?}"
    );
    // Served one at a time, the 2 s sleep (sent first) would be answered first; concurrently, every shorter
    // sleep sent after it is answered before it.
    assert_eq!(
        *order.last().unwrap(),
        0,
        "the 2 s sleep finishes last: {order:?}"
    );
    assert_ne!(order, (0..durations.len()).collect::<Vec<_>>());
}

#[tokio::test]
async fn progress_notifications_carry_invoke_id() {
    let mut p = Plugin::start(&[]);
    let r = p
        .call(
            "invoke",
            json!({ "tool": "progress", "arguments": { "count": 5, "pad_bytes": 10 },
                    "context": { "invoke_id": "inv-progress" } }),
        )
        .await;
    assert_eq!(r["result"]["data"], json!({ "emitted": 5 }));
    let notes: Vec<Value> = p.stash.drain(..).collect();
    assert_eq!(notes.len(), 5, "{notes:?}");
    for (i, n) in notes.iter().enumerate() {
        assert!(n.get("id").is_none());
        assert_eq!(n["method"], "executa/progress");
        assert_eq!(n["params"]["type"], "progress");
        assert_eq!(n["params"]["context"]["invoke_id"], "inv-progress");
        assert_eq!(n["params"]["data"], json!({ "i": i, "pad": "x".repeat(10) }));
    }

    // Type, override and omission of the invoke id; interval between notifications.
    let r = p
        .call(
            "invoke",
            json!({ "tool": "progress",
                    "arguments": { "count": 2, "type": "log", "invoke_id": "other", "interval_ms": 5 },
                    "context": { "invoke_id": "inv-2" } }),
        )
        .await;
    assert_eq!(r["result"]["data"]["emitted"], 2);
    for n in p.stash.drain(..) {
        assert_eq!(n["params"]["type"], "log");
        assert_eq!(n["params"]["context"]["invoke_id"], "other");
    }
    p.invoke_ok("progress", json!({ "count": 3, "omit_invoke_id": true }))
        .await;
    let notes: Vec<Value> = p.stash.drain(..).collect();
    assert_eq!(notes.len(), 3);
    for n in notes {
        assert!(n["params"]["context"].get("invoke_id").is_none(), "{n}");
    }
}

#[tokio::test]
async fn big_result_inline_and_via_file() {
    let mut p = Plugin::start(&[]);
    let d = p.invoke_ok("big_result", json!({ "bytes": 3_000_000 })).await;
    assert_eq!(d["blob"].as_str().unwrap().len(), 3_000_000);
    assert!(d["blob"].as_str().unwrap().bytes().all(|b| b == b'x'));

    for override_path in [false, true] {
        let wanted: Option<PathBuf> = override_path.then(|| {
            std::env::temp_dir().join(format!("fleet-e2e-ft-{}-{}.json", std::process::id(), p.next_id))
        });
        let mut args = json!({ "bytes": 100_000, "via_file": true });
        if let Some(w) = &wanted {
            args["file_path"] = json!(w.to_str().unwrap());
        }
        let id = p
            .request("invoke", json!({ "tool": "big_result", "arguments": args }))
            .await;
        let ptr = p.response(&id).await;
        assert_eq!(ptr["jsonrpc"], "2.0");
        assert!(ptr.get("result").is_none() && ptr.get("error").is_none(), "{ptr}");
        let path = PathBuf::from(ptr["__file_transport"].as_str().unwrap());
        assert!(path.is_absolute());
        if let Some(w) = &wanted {
            assert_eq!(&path, w);
        }
        let full: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(full["jsonrpc"], "2.0");
        assert_eq!(full["id"], id);
        assert_eq!(full["result"]["success"], true);
        assert_eq!(full["result"]["data"]["blob"].as_str().unwrap().len(), 100_000);
    }
}

#[tokio::test]
async fn fail_and_rpc_error() {
    let mut p = Plugin::start(&[]);
    let r = p.invoke("fail", json!({ "message": "it broke" })).await;
    assert_eq!(r["result"], json!({ "success": false, "error": "it broke" }));
    let r = p.invoke("rpc_error", json!({})).await;
    assert_eq!(r["error"], json!({ "code": -32000, "message": "fixture error" }));
    assert!(r.get("result").is_none());
    let r = p
        .invoke(
            "rpc_error",
            json!({ "code": -32042, "message": "custom", "data": { "k": 1 } }),
        )
        .await;
    assert_eq!(
        r["error"],
        json!({ "code": -32042, "message": "custom", "data": { "k": 1 } })
    );
}

#[tokio::test]
async fn crash_exits_with_the_code() {
    let mut p = Plugin::start(&[]);
    let id = p
        .request(
            "invoke",
            json!({ "tool": "crash", "arguments": { "exit_code": 42 } }),
        )
        .await;
    assert_eq!(p.wait().await.code(), Some(42));
    assert_eq!(p.read_raw_line().await, None, "no answer to {id}");

    let mut p = Plugin::start(&[]);
    p.request("invoke", json!({ "tool": "crash", "arguments": {} }))
        .await;
    assert_eq!(p.wait().await.code(), Some(101));

    let mut p = Plugin::start(&[]);
    p.request(
        "invoke",
        json!({ "tool": "crash", "arguments": { "abort": true } }),
    )
    .await;
    let status = p.wait().await;
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(6), "SIGABRT: {status:?}");
}

#[tokio::test]
async fn junk_then_a_valid_response() {
    let mut p = Plugin::start(&[]);
    let id = p
        .request("invoke", json!({ "tool": "junk", "arguments": { "lines": 7 } }))
        .await;
    let expected: [&[u8]; 7] = [
        b"this is not json {",
        b"[1,2,3]",
        b"{\"hello\":\"an object without jsonrpc\"}",
        b"",
        b"\xff\xfe invalid \xc3\x28 utf-8",
        b"this is not json {",
        b"[1,2,3]",
    ];
    for want in expected {
        assert_eq!(p.read_raw_line().await.unwrap(), want);
    }
    let r: Value = serde_json::from_slice(&p.read_raw_line().await.unwrap()).unwrap();
    assert_eq!(r["id"], id);
    assert_eq!(r["result"]["data"], json!({ "junk_lines": 7 }));
    // Default: 3 junk lines.
    let id = p
        .request("invoke", json!({ "tool": "junk", "arguments": {} }))
        .await;
    let r = p.response(&id).await;
    assert_eq!(r["result"]["data"]["junk_lines"], 3);
    assert_eq!(p.junk.len(), 1, "non-JSON among the first 3 kinds: the text");
    assert_eq!(p.stash.len(), 2, "JSON but not for us: the array and the object");
}

#[tokio::test]
async fn flood_stdout_and_stderr() {
    let mut p = Plugin::start(&[]);
    let id = p
        .request(
            "invoke",
            json!({ "tool": "flood",
                    "arguments": { "stdout_bytes": 1_000_000, "stderr_bytes": 1_000_000, "line_bytes": 4096 } }),
        )
        .await;
    let mut junk_bytes = 0;
    loop {
        let line = p.read_raw_line().await.unwrap();
        if let Ok(v) = serde_json::from_slice::<Value>(&line) {
            assert_eq!(v["id"], id);
            assert_eq!(v["result"]["data"]["stdout_bytes"], 1_000_000);
            break;
        }
        assert!(line.len() < 4096);
        junk_bytes += line.len() + 1;
    }
    assert_eq!(junk_bytes, 1_000_000);
}

#[tokio::test]
async fn reverse_rpc_round_trip() {
    let mut p = Plugin::start(&[]);
    p.initialize().await;
    let invoke_id = p
        .request(
            "invoke",
            json!({ "tool": "reverse_rpc",
                    "arguments": { "method": "storage/get", "params": { "key": "k1", "scope": "user" } },
                    "context": { "invoke_id": "inv-rr" } }),
        )
        .await;
    let req = p.next_message().await;
    assert_eq!(req["jsonrpc"], "2.0");
    assert_eq!(req["method"], "storage/get");
    let rpc_id = req["id"].clone();
    assert!(rpc_id.as_str().unwrap().starts_with("rpc-"), "{req}");
    assert_eq!(req["params"]["key"], "k1");
    assert_eq!(req["params"]["scope"], "user");
    assert_eq!(req["params"]["context"]["invoke_id"], "inv-rr");
    let answer = json!({ "jsonrpc": "2.0", "id": rpc_id, "result": { "value": "v1" } });
    p.send(&answer).await;
    let r = p.response(&invoke_id).await;
    assert_eq!(r["result"]["success"], true);
    assert_eq!(r["result"]["data"]["response"], answer);

    // Two at once, answered in reverse order, one with an error: each gets its own answer.
    let a = p
        .request(
            "invoke",
            json!({ "tool": "reverse_rpc", "arguments": { "method": "sampling/createMessage" },
                    "context": { "invoke_id": "inv-a" } }),
        )
        .await;
    let ra = p.next_message().await;
    let b = p
        .request(
            "invoke",
            json!({ "tool": "reverse_rpc",
                    "arguments": { "method": "files/read", "invoke_id": "forged", "params": { "context": { "x": 1 } } },
                    "context": { "invoke_id": "inv-b" } }),
        )
        .await;
    let rb = p.next_message().await;
    assert_eq!(ra["params"]["context"]["invoke_id"], "inv-a");
    assert_eq!(rb["params"]["context"], json!({ "x": 1, "invoke_id": "forged" }));
    assert_ne!(ra["id"], rb["id"]);
    let answer_b =
        json!({ "jsonrpc": "2.0", "id": rb["id"], "error": { "code": -32021, "message": "not_granted" } });
    p.send(&answer_b).await;
    assert_eq!(p.response(&b).await["result"]["data"]["response"], answer_b);
    let answer_a = json!({ "jsonrpc": "2.0", "id": ra["id"], "result": { "content": "hi" } });
    p.send(&answer_a).await;
    assert_eq!(p.response(&a).await["result"]["data"]["response"], answer_a);

    // Omitted invoke id; and a timeout when the host never answers.
    let c = p
        .request(
            "invoke",
            json!({ "tool": "reverse_rpc", "arguments": { "method": "storage/set", "omit_invoke_id": true, "timeout_ms": 50 },
                    "context": { "invoke_id": "inv-c" } }),
        )
        .await;
    let rc = p.next_message().await;
    assert_eq!(rc["params"], json!({}));
    let r = p.response(&c).await;
    assert_eq!(r["result"]["success"], false);
    assert!(
        r["result"]["error"].as_str().unwrap().contains("timed out"),
        "{r}"
    );
}

#[tokio::test]
async fn eof_exits_zero_after_in_flight_work() {
    let mut p = Plugin::start(&[]);
    p.initialize().await;
    let id = p
        .request("invoke", json!({ "tool": "sleep", "arguments": { "ms": 200 } }))
        .await;
    p.close_stdin();
    // The in-flight invoke still answers, then the plugin exits 0.
    assert_eq!(p.response(&id).await["result"]["data"]["slept_ms"], 200);
    assert_eq!(p.wait().await.code(), Some(0));
}

#[tokio::test]
async fn exit_after_first_response() {
    let mut p = Plugin::start(&["--exit-after-first-response"]);
    p.initialize().await;
    p.invoke_ok("echo", json!({})).await;
    assert_eq!(p.wait().await.code(), Some(0));
}

#[tokio::test]
async fn ignore_shutdown_survives_eof_and_sigterm() {
    use std::os::unix::process::ExitStatusExt;

    // `ignore_shutdown` answers once the SIGTERM handler is in place; the plugin logs each event it ignores.
    let (mut p, mut log) = Plugin::start_with_stderr_log(&[]);
    assert_eq!(
        p.invoke_ok("ignore_shutdown", json!({})).await,
        json!({ "ok": true })
    );
    p.close_stdin();
    log.wait_for(EOF_IGNORED).await;
    p.assert_running("after stdin EOF");
    let pid = p.pid();
    signal(pid, "-TERM");
    log.wait_for(SIGTERM_IGNORED).await;
    p.assert_running("after EOF + SIGTERM");
    assert_eq!(proc_state(pid).map(|s| s != 'Z'), Some(true));
    p.child.start_kill().unwrap();
    assert_eq!(
        p.wait().await.signal(),
        Some(9),
        "it was still running when killed"
    );

    // The flags do the same from the start (the handler is in place before stdin is read, so before the EOF
    // line), and every SIGTERM is ignored, not just the first.
    let (mut p, mut log) = Plugin::start_with_stderr_log(&["--ignore-eof", "--ignore-sigterm"]);
    p.close_stdin();
    log.wait_for(EOF_IGNORED).await;
    for _ in 0..2 {
        signal(p.pid(), "-TERM");
        log.wait_for(SIGTERM_IGNORED).await;
        p.assert_running("after EOF + SIGTERM");
    }
    p.child.start_kill().unwrap();
    assert_eq!(p.wait().await.signal(), Some(9));

    // SIGTERM alone (without ignoring it) still kills.
    let (mut p, mut log) = Plugin::start_with_stderr_log(&[]);
    p.invoke_ok("ignore_shutdown", json!({ "eof": true, "sigterm": false }))
        .await;
    p.close_stdin();
    log.wait_for(EOF_IGNORED).await;
    p.assert_running("after stdin EOF");
    signal(p.pid(), "-TERM");
    assert_eq!(p.wait().await.signal(), Some(15));
}

#[tokio::test]
async fn spawn_grandchild_returns_a_live_pid() {
    let mut p = Plugin::start(&[]);
    let d = p.invoke_ok("spawn_grandchild", json!({})).await;
    let gpid = u32::try_from(d["pid"].as_u64().unwrap()).unwrap();
    let _kill = KillOnDrop(gpid);
    assert_ne!(gpid, p.pid());
    let state = proc_state(gpid).expect("grandchild alive");
    assert_ne!(state, 'Z');
    let stat = std::fs::read_to_string(format!("/proc/{gpid}/stat")).unwrap();
    let ppid: u32 = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(ppid, p.pid(), "the plugin is its parent");
    signal(gpid, "-KILL");
}

#[tokio::test]
async fn resource_tools() {
    let mut p = Plugin::start(&[]);
    assert_eq!(
        p.invoke_ok("alloc", json!({ "mib": 32, "hold_ms": 10 })).await,
        json!({ "allocated_mib": 32 })
    );
    let d = p.invoke_ok("fork", json!({ "count": 3, "hold_ms": 50 })).await;
    assert_eq!(d, json!({ "spawned": 3, "errors": 0, "first_error": null }));
    let d = p.invoke_ok("spin", json!({ "ms": 100, "threads": 2 })).await;
    assert_eq!(d, json!({ "spun_ms": 100, "threads": 2 }));
    let r = p.invoke("alloc", json!({ "mib": u64::MAX })).await;
    assert_eq!(r["error"]["code"], -32602, "{r}");
}

// ---------------------------------------------------------------------------------------------------------
// Python fixture

#[tokio::test]
async fn python_plugin_handshake_echo_and_concurrency() {
    let mut p = Plugin::spawn(Plugin::python_command());
    let r = p.initialize().await["result"].clone();
    assert_eq!(r["protocolVersion"], "2.0");
    assert!(r["serverInfo"]["name"].is_string());
    let m = p.call("describe", Value::Null).await["result"].clone();
    assert_eq!(
        tool_names(&m),
        ["echo", "sleep", "progress", "fail", "big_result"]
    );
    assert_eq!(p.call("health", Value::Null).await["result"]["status"], "ready");
    let args = json!({ "message": "hé", "list": [1, 2] });
    assert_eq!(
        p.invoke_ok("echo", args.clone()).await,
        json!({ "arguments": args })
    );

    let long = p
        .request("invoke", json!({ "tool": "sleep", "arguments": { "ms": 1500 } }))
        .await;
    let short = p
        .request("invoke", json!({ "tool": "sleep", "arguments": { "ms": 10 } }))
        .await;
    assert_eq!(p.next_message().await["id"], short);
    assert_eq!(p.next_message().await["id"], long);

    let r = p
        .call(
            "invoke",
            json!({ "tool": "progress", "arguments": { "count": 3 }, "context": { "invoke_id": "py-1" } }),
        )
        .await;
    assert_eq!(r["result"]["data"]["emitted"], 3);
    let notes: Vec<Value> = p.stash.drain(..).collect();
    assert_eq!(notes.len(), 3);
    assert!(
        notes
            .iter()
            .all(|n| n["params"]["context"]["invoke_id"] == "py-1")
    );
    let r = p.invoke("fail", json!({ "message": "nope" })).await;
    assert_eq!(r["result"], json!({ "success": false, "error": "nope" }));
    let d = p.invoke_ok("big_result", json!({ "bytes": 500_000 })).await;
    assert_eq!(d["blob"].as_str().unwrap().len(), 500_000);
    assert_eq!(p.invoke("nope", json!({})).await["error"]["code"], -32601);
    p.send_raw(b"not json").await;
    assert_eq!(p.next_message().await["error"]["code"], -32700);
    p.close_stdin();
    assert_eq!(p.wait().await.code(), Some(0));

    let mut cmd = Plugin::python_command();
    cmd.arg("--noop");
    let mut p = Plugin::spawn(cmd);
    assert_eq!(p.wait().await.code(), Some(0));
}
