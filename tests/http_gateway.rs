//! The HTTP gateway (`fleet::http`) end to end: a real nats-server, a front, a worker running the echo fixture,
//! and the axum router on a real socket. Requests are plain HTTP/1.0 over a `TcpStream` (the response body ends
//! when the connection closes, so an SSE stream is read as it arrives, without chunked decoding).
//!
//! Covered: envelope shape errors, every token failure (missing, expired, wrong audience, `wid` mismatch, bad
//! signature, `alg: none`, missing window claims), the `tools` allow-list, the per-window in-flight cap, SSE
//! delivery, user isolation and `Last-Event-ID` resume, health/readiness/metrics, and the operator page in
//! headless Chromium (DOM dump shows a job submitted through the API; a screenshot is taken).

// Test code: helpers panic on purpose when the system under test misbehaves.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fleet::http::window::{WINDOW_AUDIENCE, WindowToken};
use fleet::http::{HttpConfig, HttpState};
use fleet_client::auth::{DEFAULT_AUDIENCE, DEFAULT_ISSUER};
use fleet_e2e::cluster::{Cluster, SECRET};
use fleet_e2e::worker::{Plugin, eventually};
use fleet_proto::api::methods;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// Failure guard of every wait.
const GUARD: Duration = Duration::from_secs(30);

// -------------------------------------------------------------------------------------------------------------
// Harness
// -------------------------------------------------------------------------------------------------------------

struct Gateway {
    cluster: Cluster,
    addr: SocketAddr,
    state: HttpState,
    _task: AbortOnDrop,
}

struct AbortOnDrop(tokio::task::JoinHandle<std::io::Result<()>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Gateway {
    /// Boxed: the cluster is a large value to move into a future.
    fn stop(self) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()>>> {
        Box::pin(async move {
            let Gateway { cluster, _task, .. } = self;
            drop(_task);
            cluster.shutdown().await;
        })
    }
}

async fn start_with(name: &str, workers: usize, config: HttpConfig) -> Gateway {
    let cluster = Cluster::start(name, 1, workers, &[Plugin::echo("echo", &[])]).await;
    // Front::serve returns before the server has seen every endpoint: wait until the API answers.
    cluster.wait_for_api(GUARD).await;
    let state = cluster.http_state(config).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let task = tokio::spawn(fleet::http::serve(listener, state.clone()));
    Gateway {
        cluster,
        addr,
        state,
        _task: AbortOnDrop(task),
    }
}

async fn start(name: &str) -> Gateway {
    start_with(name, 1, HttpConfig::default()).await
}

/// A window token for `user` on window `wid`.
fn window_token(g: &Gateway, user: &str, wid: &str, tools: Option<&[String]>) -> String {
    WindowToken {
        user,
        window: wid,
        app: "app-1",
        version: "v1",
        tools,
        ttl: Duration::from_secs(120),
    }
    .mint(&g.cluster.key, None)
    .expect("mint window token")
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs()
}

/// A token with exactly these claims, HS256 with `secret`.
fn raw_token(claims: &Value, secret: &[u8]) -> String {
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        claims,
        &jsonwebtoken::EncodingKey::from_secret(secret).expect("key"),
    )
    .expect("encode")
}

fn window_claims(user: &str, wid: &str) -> Value {
    json!({
        "sub": user, "iss": DEFAULT_ISSUER, "aud": WINDOW_AUDIENCE, "iat": now(), "exp": now() + 120,
        "wid": wid, "app": "app-1", "ver": "v1",
    })
}

fn b64url(bytes: &[u8]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().fold(0u32, |acc, b| (acc << 8) | u32::from(*b)) << (8 * (3 - chunk.len()));
        for i in 0..=chunk.len() {
            out.push(ABC[((n >> (18 - 6 * i)) & 63) as usize] as char);
        }
    }
    out
}

/// A raw HTTP/1.0 response.
#[derive(Debug)]
struct Reply {
    status: u16,
    head: String,
    body: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {self:?}"))
    }
}

async fn send_head(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let mut req = format!(
        "{method} {path} HTTP/1.0\r\nHost: {addr}\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    stream.write_all(req.as_bytes()).await.expect("write");
    stream.write_all(body).await.expect("write body");
    stream
}

fn split_reply(raw: &[u8]) -> Reply {
    let text = String::from_utf8_lossy(raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {text:?}"));
    Reply {
        status,
        head: head.to_owned(),
        body: body.to_owned(),
    }
}

async fn http(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
    let mut stream = send_head(addr, method, path, headers, body).await;
    let mut raw = Vec::new();
    tokio::time::timeout(GUARD, stream.read_to_end(&mut raw))
        .await
        .expect("response in time")
        .expect("read");
    split_reply(&raw)
}

/// `POST /v1/rpc` with a token.
async fn rpc(g: &Gateway, token: Option<&str>, envelope: &Value) -> Reply {
    let bearer = token.map(|t| format!("Bearer {t}"));
    let headers: Vec<(&str, &str)> = bearer.iter().map(|b| ("authorization", b.as_str())).collect();
    http(
        g.addr,
        "POST",
        "/v1/rpc",
        &headers,
        envelope.to_string().as_bytes(),
    )
    .await
}

fn env(id: &str, wid: &str, method: &str, args: Value) -> Value {
    let mut envelope = json!({"id": id, "window_uuid": wid, "ns": "tools", "method": method});
    envelope["args"] = args;
    envelope
}

/// `{id, ok: true, result}` expected.
/// `POST /v1/rpc` of `envelope` with `token`, on a task of its own.
fn spawn_rpc(g: &Gateway, token: &str, envelope: &Value) -> tokio::task::JoinHandle<Reply> {
    let (addr, bearer, body) = (g.addr, format!("Bearer {token}"), envelope.to_string());
    tokio::spawn(async move {
        http(
            addr,
            "POST",
            "/v1/rpc",
            &[("authorization", &bearer)],
            body.as_bytes(),
        )
        .await
    })
}

async fn rpc_ok(g: &Gateway, token: &str, envelope: &Value) -> Value {
    let r = rpc(g, Some(token), envelope).await;
    let v = r.json();
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(v["ok"], json!(true), "{v}");
    assert_eq!(v["id"], envelope["id"], "{v}");
    v["result"].clone()
}

/// `{id, ok: false, error}` expected with this code and HTTP status.
async fn rpc_err(g: &Gateway, token: Option<&str>, envelope: &Value, status: u16, code: &str) -> Value {
    let r = rpc(g, token, envelope).await;
    let v = r.json();
    assert_eq!(v["ok"], json!(false), "{v}");
    assert_eq!(v["error"]["code"], json!(code), "{v}");
    assert_eq!(r.status, status, "{r:?}");
    assert!(v["error"]["message"].is_string(), "{v}");
    v
}

/// One SSE event.
#[derive(Debug, Clone, PartialEq)]
struct SseEvent {
    event: String,
    id: Option<u64>,
    data: Value,
}

/// An open SSE stream.
struct Sse {
    stream: TcpStream,
    buf: String,
    head: Option<Reply>,
}

impl Sse {
    async fn open(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Sse {
        let stream = send_head(addr, "GET", path, headers, b"").await;
        let mut sse = Sse {
            stream,
            buf: String::new(),
            head: None,
        };
        // Read the response head.
        let deadline = Instant::now() + GUARD;
        while !sse.buf.contains("\r\n\r\n") {
            assert!(Instant::now() < deadline, "no response head");
            if sse.read_some().await == 0 {
                break;
            }
        }
        let (head, rest) = sse.buf.split_once("\r\n\r\n").unwrap_or((&sse.buf, ""));
        let reply = split_reply(format!("{head}\r\n\r\n").as_bytes());
        sse.buf = rest.to_owned();
        sse.head = Some(reply);
        sse
    }

    fn status(&self) -> u16 {
        self.head.as_ref().map_or(0, |h| h.status)
    }

    async fn read_some(&mut self) -> usize {
        let mut chunk = [0u8; 4096];
        let n = tokio::time::timeout(GUARD, self.stream.read(&mut chunk))
            .await
            .expect("SSE data in time")
            .expect("read");
        self.buf.push_str(&String::from_utf8_lossy(&chunk[..n]));
        n
    }

    /// The next event (comments skipped), or None if the stream ended.
    async fn next(&mut self) -> Option<SseEvent> {
        loop {
            while let Some(end) = self.buf.find("\n\n") {
                let block: String = self.buf.drain(..end + 2).collect();
                let mut event = SseEvent {
                    event: "message".into(),
                    id: None,
                    data: Value::Null,
                };
                let mut data = String::new();
                for line in block.lines() {
                    if let Some(v) = line.strip_prefix("event:") {
                        event.event = v.trim().to_owned();
                    } else if let Some(v) = line.strip_prefix("id:") {
                        event.id = v.trim().parse().ok();
                    } else if let Some(v) = line.strip_prefix("data:") {
                        data.push_str(v.strip_prefix(' ').unwrap_or(v));
                    }
                }
                if data.is_empty() {
                    continue; // a comment (heartbeat)
                }
                event.data = serde_json::from_str(&data).unwrap_or(Value::String(data));
                return Some(event);
            }
            if self.read_some().await == 0 {
                return None;
            }
        }
    }

    /// The next `tool_job` events until one is terminal for `job_id` (all within [`GUARD`]: heartbeats and
    /// overviews keep each read short, so the whole wait has its own bound).
    async fn until_terminal(&mut self, job_id: &str) -> Vec<SseEvent> {
        let mut out = Vec::new();
        tokio::time::timeout(GUARD, async {
            loop {
                let e = self.next().await.expect("stream ended before the terminal event");
                if e.event != "tool_job" {
                    continue;
                }
                let done = e.data["job_id"] == json!(job_id) && e.data["terminal"] == json!(true);
                out.push(e);
                if done {
                    return;
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("failure guard: no terminal event for {job_id} within {GUARD:?}"));
        out
    }
}

// -------------------------------------------------------------------------------------------------------------
// Envelope and auth
// -------------------------------------------------------------------------------------------------------------

#[tokio::test]
async fn envelope_shape_errors() {
    let g = start("gw-envelope").await;
    let token = window_token(&g, "alice", "w-1", None);
    let post = |body: &'static [u8]| {
        let bearer = format!("Bearer {token}");
        async move { http(g.addr, "POST", "/v1/rpc", &[("authorization", &bearer)], body).await }
    };
    // Not JSON, not an object: id null.
    for body in [&b"not json"[..], b"[1,2]", b"\"x\""] {
        let r = post(body).await;
        assert_eq!(r.status, 400, "{r:?}");
        let v = r.json();
        assert_eq!(v["id"], Value::Null);
        assert_eq!(v["ok"], json!(false));
        assert_eq!(v["error"]["code"], json!("invalid_arg"), "{v}");
    }
    // Each field's shape, reported by name; the id is echoed once it could be read.
    let cases = [
        (
            json!({"window_uuid": "w-1", "ns": "tools", "method": "list"}),
            "id",
            Value::Null,
        ),
        (
            json!({"id": {}, "window_uuid": "w-1", "ns": "tools", "method": "list"}),
            "id",
            Value::Null,
        ),
        (
            json!({"id": "a", "ns": "tools", "method": "list"}),
            "window_uuid",
            json!("a"),
        ),
        (
            json!({"id": "a", "window_uuid": "", "ns": "tools", "method": "list"}),
            "window_uuid",
            json!("a"),
        ),
        (
            json!({"id": 7, "window_uuid": "w-1", "method": "list"}),
            "ns",
            json!(7),
        ),
        (
            json!({"id": "a", "window_uuid": "w-1", "ns": 3, "method": "list"}),
            "ns",
            json!("a"),
        ),
        (
            json!({"id": "a", "window_uuid": "w-1", "ns": "tools"}),
            "method",
            json!("a"),
        ),
        (
            json!({"id": "a", "window_uuid": "w-1", "ns": "tools", "method": "list", "args": [1]}),
            "args",
            json!("a"),
        ),
        (
            json!({"id": "a", "window_uuid": "w-1", "ns": "tools", "method": "list", "args": "x"}),
            "args",
            json!("a"),
        ),
    ];
    for (body, field, id) in cases {
        let v = rpc_err(&g, Some(&token), &body, 400, "invalid_arg").await;
        assert_eq!(v["error"]["details"]["field"], json!(field), "{body}: {v}");
        assert_eq!(v["id"], id, "{body}: {v}");
    }
    // Well-formed but not served: another namespace, an unknown method.
    let mut other_ns = env("b", "w-1", "list", json!({}));
    other_ns["ns"] = json!("storage");
    rpc_err(&g, Some(&token), &other_ns, 200, "not_implemented").await;
    rpc_err(
        &g,
        Some(&token),
        &env("c", "w-1", "explode", json!({})),
        200,
        "not_implemented",
    )
    .await;
    // Arguments the method refuses are the handler's invalid_arg, inside a well-formed answer.
    let v = rpc_err(
        &g,
        Some(&token),
        &env("d", "w-1", "getJob", json!({"jobId": "nope"})),
        200,
        "invalid_arg",
    )
    .await;
    assert_eq!(v["id"], json!("d"));
    // `args` may be absent; a numeric id is echoed as a number. (The worker records the manifests once it has
    // described its catalogue at start-up: poll until it has.)
    let deadline = Instant::now() + GUARD;
    loop {
        let r = rpc_ok(
            &g,
            &token,
            &json!({"id": 42, "window_uuid": "w-1", "ns": "tools", "method": "list"}),
        )
        .await;
        if r["tools"].as_array().is_some_and(|t| !t.is_empty()) {
            break;
        }
        assert!(Instant::now() < deadline, "no manifest recorded: {r}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Only POST.
    assert_eq!(http(g.addr, "GET", "/v1/rpc", &[], b"").await.status, 405);
    g.stop().await;
}

#[tokio::test]
async fn every_token_failure_is_invalid_token() {
    let g = start("gw-tokens").await;
    let list = env("1", "w-1", "list", json!({}));
    let reason = |v: &Value| v["error"]["details"]["reason"].as_str().unwrap_or("").to_owned();

    // No header.
    let v = rpc_err(&g, None, &list, 401, "invalid_token").await;
    assert_eq!(reason(&v), "missing");
    // Expired (beyond the 5 s leeway).
    let mut claims = window_claims("alice", "w-1");
    claims["exp"] = json!(now() - 60);
    let v = rpc_err(&g, Some(&raw_token(&claims, SECRET)), &list, 401, "invalid_token").await;
    assert_eq!(reason(&v), "expired", "{v}");
    // Wrong audience: an API token (aud cloud-agents) is not a window token.
    let v = rpc_err(&g, Some(&g.cluster.token("alice")), &list, 401, "invalid_token").await;
    assert_eq!(reason(&v), "wrong_audience", "{v}");
    let mut claims = window_claims("alice", "w-1");
    claims["aud"] = json!("someone-else");
    let v = rpc_err(&g, Some(&raw_token(&claims, SECRET)), &list, 401, "invalid_token").await;
    assert_eq!(reason(&v), "wrong_audience", "{v}");
    // wid mismatch: a valid token for another window.
    let other = window_token(&g, "alice", "w-2", None);
    let v = rpc_err(&g, Some(&other), &list, 401, "invalid_token").await;
    assert_eq!(reason(&v), "wid_mismatch", "{v}");
    // Bad signature: another secret.
    let forged = raw_token(
        &window_claims("alice", "w-1"),
        b"another-secret-that-is-32-bytes-long!!",
    );
    let v = rpc_err(&g, Some(&forged), &list, 401, "invalid_token").await;
    assert_eq!(reason(&v), "bad_signature", "{v}");
    // A tampered payload under a valid signature.
    let good = window_token(&g, "alice", "w-1", None);
    let parts: Vec<&str> = good.split('.').collect();
    let tampered = format!(
        "{}.{}.{}",
        parts[0],
        b64url(window_claims("mallory", "w-1").to_string().as_bytes()),
        parts[2]
    );
    let v = rpc_err(&g, Some(&tampered), &list, 401, "invalid_token").await;
    assert_eq!(reason(&v), "bad_signature", "{v}");
    // alg: none (unsigned).
    let none = format!(
        "{}.{}.",
        b64url(br#"{"alg":"none","typ":"JWT"}"#),
        b64url(window_claims("alice", "w-1").to_string().as_bytes())
    );
    let v = rpc_err(&g, Some(&none), &list, 401, "invalid_token").await;
    assert_eq!(reason(&v), "algorithm_not_allowed", "{v}");
    // Garbage.
    let v = rpc_err(&g, Some("not.a.jwt"), &list, 401, "invalid_token").await;
    assert_eq!(reason(&v), "malformed", "{v}");
    // A signed token without the window claims.
    for claim in ["wid", "app", "ver"] {
        let mut claims = window_claims("alice", "w-1");
        claims.as_object_mut().unwrap().remove(claim);
        let v = rpc_err(&g, Some(&raw_token(&claims, SECRET)), &list, 401, "invalid_token").await;
        assert_eq!(v["error"]["details"]["claim"], json!(claim), "{v}");
    }
    // The id is echoed on every refusal; and the good token works.
    assert_eq!(v["id"], json!("1"));
    rpc_ok(&g, &good, &list).await;
    g.stop().await;
}

// -------------------------------------------------------------------------------------------------------------
// The tools namespace, the allow-list and the cap
// -------------------------------------------------------------------------------------------------------------

#[tokio::test]
async fn tools_methods_and_the_allow_list() {
    let g = start("gw-acl").await;
    // The listings below narrow what `tools.list` shows: first it must show the plugin.
    g.cluster.wait_listed(&["echo"], GUARD).await;
    let all = window_token(&g, "alice", "w-1", None);
    // invoke: the plugin's payload.
    let r = rpc_ok(
        &g,
        &all,
        &env(
            "1",
            "w-1",
            "invoke",
            json!({"tool_id": "echo.echo", "args": {"x": 1}}),
        ),
    )
    .await;
    assert_eq!(r["arguments"], json!({"x": 1}), "{r}");
    // invokeAsync → getJob → listJobs → cancelJob.
    let job = rpc_ok(
        &g,
        &all,
        &env(
            "2",
            "w-1",
            "invokeAsync",
            json!({"tool_id": "echo.sleep", "args": {"ms": 60000}, "clientTag": "gw"}),
        ),
    )
    .await;
    let job_id = job["jobId"].as_str().expect("jobId").to_owned();
    let snap = rpc_ok(&g, &all, &env("3", "w-1", "getJob", json!({"jobId": job_id}))).await;
    assert_eq!(snap["jobId"], json!(job_id));
    let list = rpc_ok(&g, &all, &env("4", "w-1", "listJobs", json!({"clientTag": "gw"}))).await;
    assert_eq!(list["jobs"][0]["jobId"], json!(job_id), "{list}");
    let cancel = rpc_ok(&g, &all, &env("5", "w-1", "cancelJob", json!({"jobId": job_id}))).await;
    assert_eq!(cancel["state"], json!("cancelled"), "{cancel}");
    // Another user's window never sees the job.
    let bob = window_token(&g, "bob", "w-b", None);
    rpc_err(
        &g,
        Some(&bob),
        &env("6", "w-b", "getJob", json!({"jobId": job_id})),
        200,
        "job_not_found",
    )
    .await;

    // An allow-list that does not name the plugin: invoke and invokeAsync refused, list narrowed.
    let narrow = window_token(&g, "alice", "w-2", Some(&["other-plugin".to_owned()]));
    for method in ["invoke", "invokeAsync"] {
        let v = rpc_err(
            &g,
            Some(&narrow),
            &env("7", "w-2", method, json!({"tool_id": "echo.echo", "args": {}})),
            403,
            "permission_denied",
        )
        .await;
        assert_eq!(v["error"]["details"]["tool_id"], json!("echo"), "{v}");
    }
    let listed = rpc_ok(&g, &narrow, &env("8", "w-2", "list", json!({}))).await;
    assert_eq!(listed["tools"], json!([]), "{listed}");
    // Patterns that admit it: the bare id, `<prefix>:<id>`, `required:*`, `*`.
    for pattern in ["echo", "required:echo", "required:*", "*"] {
        let t = window_token(
            &g,
            "alice",
            "w-3",
            Some(&["other-plugin".to_owned(), pattern.to_owned()]),
        );
        rpc_ok(
            &g,
            &t,
            &env("9", "w-3", "invoke", json!({"tool_id": "echo.echo", "args": {}})),
        )
        .await;
        let listed = rpc_ok(&g, &t, &env("10", "w-3", "list", json!({}))).await;
        assert!(
            listed["tools"]
                .as_array()
                .unwrap()
                .iter()
                .all(|t| t["tool_id"] == json!("echo")),
            "{listed}"
        );
        assert!(
            !listed["tools"].as_array().unwrap().is_empty(),
            "{pattern}: {listed}"
        );
    }
    // An empty allow-list narrows nothing (spec §10.1: "omitted (or empty)").
    let empty = window_token(&g, "alice", "w-4", Some(&[]));
    rpc_ok(
        &g,
        &empty,
        &env("11", "w-4", "invoke", json!({"tool_id": "echo.echo", "args": {}})),
    )
    .await;
    g.stop().await;
}

#[tokio::test]
async fn in_flight_cap_per_window() {
    let config = HttpConfig {
        max_in_flight_per_window: 2,
        ..HttpConfig::default()
    };
    let g = start_with("gw-cap", 1, config).await;
    let t1 = window_token(&g, "alice", "w-1", None);
    let t2 = window_token(&g, "alice", "w-2", None);
    // Two slow invokes fill window w-1.
    let slow = env(
        "s",
        "w-1",
        "invoke",
        json!({"tool_id": "echo.sleep", "args": {"ms": 4000}}),
    );
    let spawn_slow = || spawn_rpc(&g, &t1, &slow);
    // Three at once on a window with two slots: exactly one is refused, at once, while the others run.
    let calls = [spawn_slow(), spawn_slow(), spawn_slow()];
    let (refused, running): (Vec<_>, Vec<_>) = {
        let deadline = Instant::now() + GUARD;
        while calls.iter().all(|h| !h.is_finished()) {
            assert!(Instant::now() < deadline, "no call finished");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        calls.into_iter().partition(|h| h.is_finished())
    };
    assert_eq!((refused.len(), running.len()), (1, 2));
    let refused = refused.into_iter().next().unwrap().await.unwrap();
    assert_eq!(refused.status, 429, "{refused:?}");
    let refused = refused.json();
    assert_eq!(refused["error"]["code"], json!("rate_limited"), "{refused}");
    assert_eq!(
        refused["error"]["details"]["max_in_flight"],
        json!(2),
        "{refused}"
    );
    assert_eq!(refused["id"], json!("s"));
    // While they run: the window is still full, and another window of the same user is not limited.
    let again = rpc(&g, Some(&t1), &env("q", "w-1", "list", json!({}))).await;
    assert!(
        running.iter().all(|h| !h.is_finished()),
        "the slow calls ended too early for this test"
    );
    assert_eq!(again.status, 429, "{again:?}");
    rpc_ok(&g, &t2, &env("o", "w-2", "list", json!({}))).await;
    // Both slow calls succeed, and the window has its slots back.
    for h in running {
        let r = h.await.unwrap();
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(r.json()["result"], json!({"slept_ms": 4000}), "{r:?}");
    }
    rpc_ok(&g, &t1, &env("after", "w-1", "list", json!({}))).await;
    g.stop().await;
}

/// A draining gateway (a front's SIGTERM) answers the call it is running, ends its SSE streams, accepts no new
/// connection, and then its server returns.
#[tokio::test]
async fn draining_answers_the_calls_in_flight_and_accepts_no_new_connection() {
    let mut g = start("gw-drain").await;
    let token = window_token(&g, "alice", "w-1", None);
    let slow = env(
        "s",
        "w-1",
        "invoke",
        json!({"tool_id": "echo.sleep", "args": {"ms": 1500}}),
    );
    let call = spawn_rpc(&g, &token, &slow);
    // An SSE stream open at the same time (its response head read: the gateway serves it).
    let mut events = Sse::open(g.addr, &format!("/v1/windows/w-1/events?token={token}"), &[]).await;
    // The call is in flight once the plugin runs it.
    let running = eventually(GUARD, || {
        let node = g.cluster.workers[0].node.as_ref().unwrap();
        node.pool().sessions().iter().any(|s| s.in_flight() > 0)
    })
    .await;
    assert!(running, "the slow call reached the plugin");
    g.state.start_draining();
    // The SSE stream ends (the server closes it) while the call still runs.
    let mut rest = Vec::new();
    tokio::time::timeout(GUARD, events.stream.read_to_end(&mut rest))
        .await
        .expect("the SSE stream ended")
        .unwrap();
    assert!(!call.is_finished(), "the slow call ended too early for this test");
    // The call in flight is answered in full.
    let reply = tokio::time::timeout(GUARD, call).await.unwrap().unwrap();
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.json()["result"], json!({"slept_ms": 1500}), "{reply:?}");
    // Then the server has returned and nothing listens any more.
    let served = tokio::time::timeout(GUARD, &mut g._task.0)
        .await
        .expect("the server returned");
    assert!(served.unwrap().is_ok());
    assert!(
        TcpStream::connect(g.addr).await.is_err(),
        "a new connection is refused"
    );
    g.stop().await;
}

// -------------------------------------------------------------------------------------------------------------
// SSE
// -------------------------------------------------------------------------------------------------------------

/// A user holds at most `max_streams_per_user` open event streams on a gateway (each holds a task and a place in
/// the fan-out): one more is refused at once (429 `rate_limited`, `details.max_streams`), whatever window it is
/// for; another user is not held back; a stream the client closed gives its place back.
#[tokio::test]
async fn a_user_holds_at_most_max_streams_per_user_event_streams() {
    let config = HttpConfig {
        max_streams_per_user: 2,
        // The gateway notices a closed client at its next write: a heartbeat soon.
        heartbeat: Duration::from_millis(100),
        ..HttpConfig::default()
    };
    let g = start_with("gw-streams", 1, config).await;
    let open = |user: &str, wid: &str| {
        let token = window_token(&g, user, wid, None);
        let path = format!("/v1/windows/{wid}/events?token={token}");
        async move { Sse::open(g.addr, &path, &[]).await }
    };
    let first = open("alice", "w-1").await;
    let second = open("alice", "w-2").await;
    assert_eq!((first.status(), second.status()), (200, 200));
    let mut refused = open("alice", "w-3").await;
    assert_eq!(refused.status(), 429);
    let body = loop {
        match serde_json::from_str::<Value>(refused.buf.trim()) {
            Ok(v) => break v,
            Err(_) => assert!(
                refused.read_some().await > 0,
                "the refusal's body: {:?}",
                refused.buf
            ),
        }
    };
    assert_eq!(body["error"]["code"], "rate_limited", "{body}");
    assert_eq!(body["error"]["details"]["max_streams"], 2, "{body}");
    assert_eq!(
        open("bob", "w-b").await.status(),
        200,
        "another user is not held back"
    );
    // Alice closes one: its place comes back once the gateway has noticed.
    drop(first);
    let deadline = Instant::now() + GUARD;
    loop {
        if open("alice", "w-3").await.status() == 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "failure guard: the closed stream's place never came back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(second);
}

#[tokio::test]
async fn sse_delivers_the_users_events_and_resumes() {
    let g = start("gw-sse").await;
    let alice = window_token(&g, "alice", "w-a", None);
    let bob = window_token(&g, "bob", "w-b", None);

    // Auth: none, wid mismatch (path vs token), and a bad token are refused before streaming.
    let s = Sse::open(g.addr, "/v1/windows/w-a/events", &[]).await;
    assert_eq!(s.status(), 401);
    let s = Sse::open(g.addr, &format!("/v1/windows/w-x/events?token={alice}"), &[]).await;
    assert_eq!(s.status(), 401);
    let s = Sse::open(
        g.addr,
        &format!("/v1/windows/w-a/events?token={}", g.cluster.token("alice")),
        &[],
    )
    .await;
    assert_eq!(s.status(), 401);

    // Alice listens with ?token=, bob with the header.
    let mut sa = Sse::open(g.addr, &format!("/v1/windows/w-a/events?token={alice}"), &[]).await;
    assert_eq!(sa.status(), 200);
    assert!(
        sa.head
            .as_ref()
            .unwrap()
            .head
            .to_ascii_lowercase()
            .contains("text/event-stream"),
        "{:?}",
        sa.head
    );
    let bearer = format!("Bearer {bob}");
    let mut sb = Sse::open(g.addr, "/v1/windows/w-b/events", &[("authorization", &bearer)]).await;
    assert_eq!(sb.status(), 200);

    let job_b = rpc_ok(
        &g,
        &bob,
        &env(
            "b",
            "w-b",
            "invokeAsync",
            json!({"tool_id": "echo.echo", "args": {}}),
        ),
    )
    .await;
    let job_a = rpc_ok(
        &g,
        &alice,
        &env(
            "a",
            "w-a",
            "invokeAsync",
            json!({"tool_id": "echo.progress", "args": {"count": 3}}),
        ),
    )
    .await;
    let job_a = job_a["jobId"].as_str().unwrap().to_owned();
    let job_b = job_b["jobId"].as_str().unwrap().to_owned();

    let events = sa.until_terminal(&job_a).await;
    // Only alice's job; ids strictly increasing; queued … running … progress … succeeded, never a result.
    assert!(
        events.iter().all(|e| e.data["job_id"] == json!(job_a)),
        "{events:?}"
    );
    let ids: Vec<u64> = events
        .iter()
        .map(|e| e.id.expect("every event has an id"))
        .collect();
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");
    assert_eq!(events[0].data["state"], json!("queued"), "{events:?}");
    let last = events.last().unwrap();
    assert_eq!(last.data["state"], json!("succeeded"), "{events:?}");
    assert!(events.iter().all(|e| e.data.get("result").is_none()));
    let progress = events.iter().filter(|e| !e.data["event"].is_null()).count();
    assert_eq!(progress, 3, "{events:?}");
    for key in ["job_id", "tool_id", "state", "seq", "terminal"] {
        assert!(
            events[0].data.get(key).is_some(),
            "{key} missing: {:?}",
            events[0]
        );
    }
    // Bob got his own job only.
    let bob_events = sb.until_terminal(&job_b).await;
    assert!(
        bob_events.iter().all(|e| e.data["job_id"] == json!(job_b)),
        "{bob_events:?}"
    );
    drop(sa);

    // Resume: Last-Event-ID = the first event's id replays exactly the rest, in order.
    let first = ids[0].to_string();
    let mut resumed = Sse::open(
        g.addr,
        &format!("/v1/windows/w-a/events?token={alice}"),
        &[("last-event-id", &first)],
    )
    .await;
    assert_eq!(resumed.status(), 200);
    let replay = resumed.until_terminal(&job_a).await;
    assert_eq!(replay, events[1..].to_vec());
    // A resumed stream goes on live.
    let job2 = rpc_ok(
        &g,
        &alice,
        &env(
            "c",
            "w-a",
            "invokeAsync",
            json!({"tool_id": "echo.echo", "args": {}}),
        ),
    )
    .await;
    let job2 = job2["jobId"].as_str().unwrap().to_owned();
    let live = resumed.until_terminal(&job2).await;
    assert!(
        live.iter().all(|e| e.id.unwrap() > *ids.last().unwrap()),
        "{live:?}"
    );
    // An id this gateway never issued resumes from now (no replay).
    let mut fresh = Sse::open(
        g.addr,
        &format!("/v1/windows/w-a/events?token={alice}"),
        &[("last-event-id", "99999999999999999")],
    )
    .await;
    let job3 = rpc_ok(
        &g,
        &alice,
        &env(
            "d",
            "w-a",
            "invokeAsync",
            json!({"tool_id": "echo.echo", "args": {}}),
        ),
    )
    .await;
    let job3 = job3["jobId"].as_str().unwrap().to_owned();
    let got = fresh.until_terminal(&job3).await;
    assert_eq!(got[0].data["job_id"], json!(job3), "{got:?}");
    g.stop().await;
}

// -------------------------------------------------------------------------------------------------------------
// Health, readiness, metrics
// -------------------------------------------------------------------------------------------------------------

#[tokio::test]
async fn health_readiness_and_metrics() {
    let g = start("gw-health").await;
    let r = http(g.addr, "GET", "/healthz", &[], b"").await;
    assert_eq!((r.status, r.body.as_str()), (200, "ok\n"));
    let r = http(g.addr, "GET", "/readyz", &[], b"").await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.body, "ready\n", "{r:?}");
    let r = http(g.addr, "GET", "/metrics", &[], b"").await;
    assert_eq!(r.status, 200, "{r:?}");
    assert!(
        r.head
            .to_ascii_lowercase()
            .contains(&format!("content-type: {}", fleet::metrics::CONTENT_TYPE).to_ascii_lowercase()),
        "{r:?}"
    );
    assert!(r.body.contains("cloud_agents_api_requests_total"), "{r:?}");
    assert_eq!(http(g.addr, "GET", "/nope", &[], b"").await.status, 404);
    g.stop().await;

    // No worker: not ready, with the reason.
    let g = start_with("gw-noworker", 0, HttpConfig::default()).await;
    let r = http(g.addr, "GET", "/readyz", &[], b"").await;
    assert_eq!(r.status, 503, "{r:?}");
    assert!(r.body.contains("no live worker"), "{r:?}");
    assert_eq!(http(g.addr, "GET", "/healthz", &[], b"").await.status, 200);
    g.stop().await;
}

/// With a metrics listener of its own (`fleet up --metrics-http`), `/metrics` is served there and not on the
/// public port; health and readiness on both.
#[tokio::test]
async fn metrics_on_their_own_listener_are_not_public() {
    let g = start_with(
        "gw-metrics",
        1,
        HttpConfig {
            public_metrics: false,
            ..HttpConfig::default()
        },
    )
    .await;
    assert_eq!(http(g.addr, "GET", "/metrics", &[], b"").await.status, 404);
    assert_eq!(http(g.addr, "GET", "/readyz", &[], b"").await.status, 200);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let ops = listener.local_addr().expect("addr");
    let _task = AbortOnDrop(tokio::spawn(fleet::http::serve_ops(listener, g.state.clone())));
    let r = http(ops, "GET", "/metrics", &[], b"").await;
    assert_eq!(r.status, 200, "{r:?}");
    assert!(r.body.contains("cloud_agents_api_requests_total"), "{r:?}");
    assert_eq!(http(ops, "GET", "/readyz", &[], b"").await.body, "ready\n");
    assert_eq!(http(ops, "GET", "/healthz", &[], b"").await.status, 200);
    // Nothing of the API there.
    assert_eq!(http(ops, "GET", "/", &[], b"").await.status, 404);
    assert_eq!(http(ops, "POST", "/v1/rpc", &[], b"{}").await.status, 404);
    // A draining gateway is not ready on either port.
    g.state.start_draining();
    let r = http(ops, "GET", "/readyz", &[], b"").await;
    assert_eq!(r.status, 503, "{r:?}");
    g.stop().await;
}

// -------------------------------------------------------------------------------------------------------------
// The operator page
// -------------------------------------------------------------------------------------------------------------

#[tokio::test]
async fn operator_data_needs_an_operator_token() {
    let g = start("gw-ops").await;
    let r = http(g.addr, "GET", "/", &[], b"").await;
    assert_eq!(r.status, 200);
    assert!(
        r.body.contains("<!doctype html>") && r.body.contains("EventSource"),
        "{r:?}"
    );
    // Opened with `?token=`: the token is never sent on as a referrer.
    assert!(
        r.head
            .to_ascii_lowercase()
            .contains("referrer-policy: no-referrer"),
        "{}",
        r.head
    );
    assert!(
        !r.body.contains("http://") && !r.body.contains("https://"),
        "no external resource"
    );
    assert_eq!(
        http(g.addr, "GET", "/v1/ops/overview", &[], b"").await.status,
        401
    );
    let user = g.cluster.token("alice");
    let r = http(g.addr, "GET", &format!("/v1/ops/overview?token={user}"), &[], b"").await;
    assert_eq!(r.status, 403, "{r:?}");
    // A user token claiming operator rights, signed by the user-token key, is a user token.
    let forged = g
        .cluster
        .key
        .mint(
            "mallory",
            DEFAULT_ISSUER,
            DEFAULT_AUDIENCE,
            Duration::from_secs(600),
            true,
        )
        .expect("mint");
    for path in ["/v1/ops/overview", "/v1/ops/events"] {
        let r = http(g.addr, "GET", &format!("{path}?token={forged}"), &[], b"").await;
        assert_eq!(r.status, 403, "{path}: {r:?}");
    }
    let ops = operator_token(&g);
    let r = http(g.addr, "GET", &format!("/v1/ops/overview?token={ops}"), &[], b"").await;
    assert_eq!(r.status, 200, "{r:?}");
    let v = r.json();
    assert_eq!(v["workers"].as_array().map(Vec::len), Some(1), "{v}");
    // The operator stream: an overview at once, then every user's job events.
    let mut s = Sse::open(g.addr, &format!("/v1/ops/events?token={ops}"), &[]).await;
    assert_eq!(s.status(), 200);
    assert_eq!(s.next().await.unwrap().event, "overview");
    let job = g
        .cluster
        .ok(
            "carol",
            methods::TOOLS_INVOKE_ASYNC,
            json!({"tool_id": "echo.echo", "args": {}}),
        )
        .await;
    let job = job["jobId"].as_str().unwrap().to_owned();
    let events = s.until_terminal(&job).await;
    assert!(events.iter().any(|e| e.data["job_id"] == json!(job)));
    g.stop().await;
}

fn operator_token(g: &Gateway) -> String {
    g.cluster.operator_token()
}

/// Headless Chromium on `url` with `extra` flags, on virtual time (the page's polling runs out, then the DOM or
/// the screenshot is taken).
async fn run_chromium(url: &str, profile: &std::path::Path, extra: &[&str]) -> String {
    let mut flags = vec!["--virtual-time-budget=5000"];
    flags.extend_from_slice(extra);
    fleet_e2e::chromium::run(url, profile, &flags).await
}

#[tokio::test]
async fn operator_page_in_headless_chromium() {
    let bin = fleet_e2e::chromium::binary(); // fail first, clearly, if it is missing
    let g = start("gw-browser").await;
    // A script submits a job through the API (over NATS, as any app dispatcher).
    let job = g
        .cluster
        .ok(
            "dave",
            methods::TOOLS_INVOKE_ASYNC,
            json!({"tool_id": "echo.progress", "args": {"count": 2}, "clientTag": "browser"}),
        )
        .await;
    let job = job["jobId"].as_str().expect("jobId").to_owned();
    // And a sync invoke through the gateway, for the latency table.
    let t = window_token(&g, "dave", "w-d", None);
    rpc_ok(
        &g,
        &t,
        &env("1", "w-d", "invoke", json!({"tool_id": "echo.echo", "args": {}})),
    )
    .await;

    // stream_ms: the page's event stream ends after 1 s and the page polls instead, so that headless Chromium's
    // virtual time (paused while a fetch is pending) can run out and the DOM / screenshot be taken.
    let url = format!("http://{}/?token={}&stream_ms=1000", g.addr, operator_token(&g));
    let tmp = tempfile::tempdir().expect("tmp");
    let dom = run_chromium(&url, &tmp.path().join("profile-dom"), &["--dump-dom"]).await;
    assert!(dom.contains("Cloud Agents"), "not the operator page: {dom:.2000}");
    assert!(
        dom.contains(&job),
        "the job {job} is not on the page ({bin}): {dom:.4000}"
    );
    assert!(dom.contains("echo"), "{dom:.4000}");
    assert!(dom.contains("data-job="), "{dom:.4000}");

    let png = tmp.path().join("ops.png");
    run_chromium(
        &url,
        &tmp.path().join("profile-shot"),
        &[
            &format!("--screenshot={}", png.display()),
            "--window-size=1280,800",
        ],
    )
    .await;
    let size = std::fs::metadata(&png).map(|m| m.len()).unwrap_or(0);
    assert!(size > 10 * 1024, "screenshot {} is {size} bytes", png.display());
    // Keep a copy for humans when asked to.
    if let Ok(dir) = std::env::var("FLEET_TEST_ARTIFACTS") {
        let _ = std::fs::create_dir_all(&dir);
        let _ = std::fs::copy(&png, std::path::Path::new(&dir).join("ops.png"));
    }
    g.stop().await;
}

/// The gateway survives slow and many clients (`HttpConfig::listener`, set short here: a configured limit at its
/// boundary). With a cap of 2 connections, two clients that never finish their request heads hold both slots: a
/// third client's complete request is served only once the header timeout has closed them (never before it), and
/// each of the two reads the end of its connection no earlier than the timeout. A body that never completes fails
/// at the body timeout: the request is not served and its connection ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_are_closed_at_the_timeouts_and_the_connection_cap_holds() {
    let limits = fleet::http::listener::ListenerLimits {
        header_read_timeout: Duration::from_secs(1),
        body_read_timeout: Duration::from_secs(1),
        max_connections: 2,
    };
    let g = start_with(
        "http-slow",
        1,
        HttpConfig {
            listener: limits,
            ..HttpConfig::default()
        },
    )
    .await;
    let started = Instant::now();
    let mut slow = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(g.addr).await.unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        slow.push(s);
    }
    let mut third = TcpStream::connect(g.addr).await.unwrap();
    third.write_all(b"GET /healthz HTTP/1.0\r\n\r\n").await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(GUARD, third.read_to_end(&mut answer))
        .await
        .expect("failure guard: the third client was never served")
        .unwrap();
    let served_after = started.elapsed();
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.starts_with("HTTP/1.0 200") && answer.ends_with("ok\n"),
        "{answer}"
    );
    assert!(
        served_after >= limits.header_read_timeout,
        "served after {served_after:?}: the cap of 2 let a third connection in while two were held"
    );
    for mut s in slow {
        let mut rest = Vec::new();
        tokio::time::timeout(GUARD, s.read_to_end(&mut rest))
            .await
            .expect("failure guard: a slow client's connection was never closed")
            .unwrap();
        assert!(rest.is_empty() || !rest.starts_with(b"HTTP/1.1 200"), "{rest:?}");
    }
    assert!(started.elapsed() >= limits.header_read_timeout);

    // A body promised but never sent: the request fails at the body timeout, the connection ends.
    let token = window_token(&g, "slow", "w-slow", None);
    let mut s = TcpStream::connect(g.addr).await.unwrap();
    let sent = Instant::now();
    s.write_all(
        format!(
            "POST /v1/rpc HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\n\
             Content-Length: 100\r\n\r\n{{\"id\":"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(GUARD, s.read_to_end(&mut rest))
        .await
        .expect("failure guard: a stalled body was never given up")
        .unwrap();
    assert!(sent.elapsed() >= limits.body_read_timeout);
    let rest = String::from_utf8_lossy(&rest);
    assert!(
        !rest.starts_with("HTTP/1.1 200"),
        "a request whose body never came was served: {rest}"
    );
    g.stop().await;
}
