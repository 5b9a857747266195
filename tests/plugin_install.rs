//! Plugin distribution end to end (spec §14): a real nats-server, the operator API over NATS, real workers
//! running the installed plugin under per-user uids, and a real HTTP server on 127.0.0.1 serving the packages
//! (good ones, a size mismatch, a sha256 mismatch, every zip-slip form, an interrupted download…).

use std::collections::HashMap;
use std::io::Write as _;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use fleet::plugins::{PluginStore, cli, service};
use fleet_e2e::cluster::Cluster;
use fleet_e2e::worker::alive;
use fleet_proto::admin;
use fleet_proto::api::{ApiError, ApiErrorCode, methods};
use fleet_store::StoreSettings;
use serde_json::{Value, json};
use sha2::Digest as _;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// Failure guard of the polling helpers (never a synchronisation: they return as soon as the observable holds).
const GUARD: Duration = Duration::from_secs(90);

// ---------------------------------------------------------------------------------------------------------------
// A tiny HTTP/1.1 server: GET <path> → the registered bytes; a route may cut its first response half-way.

#[derive(Clone)]
struct Route {
    body: Arc<Vec<u8>>,
    /// Close the connection after this many body bytes, once (Content-Length still announces the whole body).
    cut_once_at: Option<usize>,
}

#[derive(Clone, Default)]
struct Http {
    routes: Arc<Mutex<HashMap<String, Route>>>,
    base: String,
}

impl Http {
    async fn start() -> Http {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let http = Http {
            routes: Arc::default(),
            base: format!("http://{addr}"),
        };
        let routes = http.routes.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(handle(stream, routes.clone()));
            }
        });
        http
    }

    fn serve(&self, path: &str, body: Vec<u8>) -> String {
        self.route(path, body, None)
    }

    fn route(&self, path: &str, body: Vec<u8>, cut_once_at: Option<usize>) -> String {
        self.routes.lock().expect("routes").insert(
            path.to_string(),
            Route {
                body: Arc::new(body),
                cut_once_at,
            },
        );
        format!("{}{path}", self.base)
    }
}

async fn handle(mut stream: tokio::net::TcpStream, routes: Arc<Mutex<HashMap<String, Route>>>) {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let line = String::from_utf8_lossy(&head);
    let path = line.split_whitespace().nth(1).unwrap_or("/").to_string();
    let route = {
        let mut routes = routes.lock().expect("routes");
        let r = routes.get(&path).cloned();
        if let Some(stored) = routes.get_mut(&path) {
            stored.cut_once_at = None;
        }
        r
    };
    let Some(route) = route else {
        let _ = stream
            .write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            .await;
        return;
    };
    let header = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        route.body.len()
    );
    let _ = stream.write_all(header.as_bytes()).await;
    let end = route.cut_once_at.unwrap_or(route.body.len());
    let _ = stream.write_all(&route.body[..end]).await;
    let _ = stream.flush().await;
    let _ = stream.shutdown().await;
}

// ---------------------------------------------------------------------------------------------------------------
// Packages.

type Tar = tar::Builder<flate2::write::GzEncoder<Vec<u8>>>;

fn tar_gz(files: &[(&str, u32, &[u8])], extra: impl FnOnce(&mut Tar)) -> Vec<u8> {
    let mut b = tar::Builder::new(flate2::write::GzEncoder::new(
        Vec::new(),
        flate2::Compression::fast(),
    ));
    for (path, mode, content) in files {
        let mut h = tar::Header::new_gnu();
        raw_name(&mut h, path);
        h.set_size(content.len() as u64);
        h.set_mode(*mode);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_cksum();
        b.append(&h, *content).expect("append");
    }
    extra(&mut b);
    b.into_inner().expect("tar").finish().expect("gzip")
}

/// Writes a member name verbatim (the tar crate's `set_path` refuses `..`, which is what these tests need).
fn raw_name(h: &mut tar::Header, name: &str) {
    let gnu = h.as_gnu_mut().expect("gnu header");
    gnu.name = [0; 100];
    gnu.name[..name.len()].copy_from_slice(name.as_bytes());
}

fn special(b: &mut Tar, kind: tar::EntryType, name: &str, target: &str) {
    let mut h = tar::Header::new_gnu();
    raw_name(&mut h, name);
    h.set_entry_type(kind);
    h.set_size(0);
    h.set_mode(0o777);
    h.as_gnu_mut().expect("gnu").linkname[..target.len()].copy_from_slice(target.as_bytes());
    h.set_cksum();
    b.append(&h, std::io::empty()).expect("append");
}

fn zip_of(files: &[(&str, u32, &[u8])]) -> Vec<u8> {
    let mut w = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    for (name, mode, bytes) in files {
        let o = zip::write::SimpleFileOptions::default().unix_permissions(*mode);
        w.start_file(*name, o).expect("zip entry");
        w.write_all(bytes).expect("zip write");
    }
    w.finish().expect("zip").into_inner()
}

fn sha256(bytes: &[u8]) -> String {
    hex::encode(sha2::Sha256::digest(bytes))
}

/// The native echo plugin's bytes (a real Executa plugin: `inspect` reports its pid and working directory).
fn echo_bytes() -> &'static [u8] {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES.get_or_init(|| std::fs::read(fleet_e2e::echo_plugin_bin()).expect("echo plugin binary"))
}

/// A binary package of the echo plugin: `manifest.json` names it and its version, `bin/<name>` is the plugin.
fn echo_pkg(name: &str, version: &str) -> Vec<u8> {
    let manifest = serde_json::to_vec(&json!({ "name": name, "version": version })).expect("json");
    tar_gz(
        &[
            ("manifest.json", 0o644, &manifest),
            (&format!("bin/{name}"), 0o755, echo_bytes()),
            ("data/readme.txt", 0o600, b"bundled data"),
        ],
        |_| {},
    )
}

const SCRIPT: &[u8] = b"#!/bin/sh\nexit 0\n";

// ---------------------------------------------------------------------------------------------------------------
// The fleet under test.

struct Env {
    cluster: Cluster,
    http: Http,
    operator: String,
}

async fn env(name: &str, workers: usize) -> Env {
    let cluster = Cluster::start(name, 1, workers, &[]).await;
    let plugins = PluginStore::open(
        &async_nats::jetstream::new(cluster.client.clone()),
        &StoreSettings::default(),
    )
    .await
    .expect("plugin store");
    let verifier = cluster.operator_verifier();
    service::serve(
        cluster.client.clone(),
        plugins,
        cluster.store.clone(),
        verifier,
        cluster.root.path().join("plugin-scratch"),
        // The tests' package server listens on this host.
        fleet::plugins::download::SourcePolicy::allowing(vec!["127.0.0.1/32".parse().expect("cidr")]),
    )
    .await
    .expect("plugins API");
    let operator = cluster.operator_token();
    Env {
        cluster,
        http: Http::start().await,
        operator,
    }
}

impl Env {
    async fn plugins(&self, method: &str, body: Value) -> Result<Value, ApiError> {
        cli::request(
            &self.cluster.operator,
            &self.operator,
            method,
            &body,
            Duration::from_secs(120),
        )
        .await
    }

    async fn install(&self, body: Value) -> Value {
        match self.plugins(admin::plugins::INSTALL, body.clone()).await {
            Ok(v) => v,
            Err(e) => panic!("install {body} failed: {e}"),
        }
    }

    async fn install_err(&self, body: Value) -> ApiError {
        match self.plugins(admin::plugins::INSTALL, body.clone()).await {
            Ok(v) => panic!("install {body} unexpectedly succeeded: {v}"),
            Err(e) => e,
        }
    }

    async fn tool_ids(&self) -> Vec<String> {
        let list = self.plugins(admin::plugins::LIST, json!({})).await.expect("list");
        list["plugins"]
            .as_array()
            .expect("plugins")
            .iter()
            .map(|p| p["tool_id"].as_str().expect("tool_id").to_string())
            .collect()
    }

    async fn inspect(&self, user: &str, tool_id: &str) -> Value {
        self.cluster
            .ok(
                user,
                methods::TOOLS_INVOKE,
                json!({ "tool_id": tool_id, "method": "inspect", "args": {} }),
            )
            .await
    }

    async fn job(&self, user: &str, id: &str) -> Value {
        self.cluster
            .ok(user, methods::TOOLS_GET_JOB, json!({ "jobId": id }))
            .await
    }
}

async fn until<T>(mut probe: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + GUARD;
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "condition not reached within the failure guard"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn assert_unsafe(e: &ApiError, reason: &str) {
    assert_eq!(e.code, ApiErrorCode::InvalidArg, "{e}");
    assert!(
        e.message.contains("unsafe archive member") && e.message.contains(reason),
        "expected an unsafe member ({reason}), got: {}",
        e.message
    );
}

// ---------------------------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_package_is_verified_and_validated_before_it_is_published() {
    let e = env("pkg-validate", 0).await;

    // A good tar.gz and a good zip, from URLs.
    let good = echo_pkg("pkg-good", "1.0.0");
    let url = e.http.serve("/good.tar.gz", good.clone());
    let published = e.install(json!({ "source": url, "sha256": sha256(&good) })).await;
    assert_eq!(published["tool_id"], "pkg-good");
    assert_eq!(published["version"], "1.0.0");
    assert_eq!(published["package"]["entrypoint"], "bin/pkg-good");
    assert_eq!(published["package"]["format"], "tar.gz");
    assert_eq!(
        published["package"]["object"],
        format!("sha256-{}", sha256(&good))
    );
    assert_eq!(published["package"]["manifest"]["version"], "1.0.0");
    assert_eq!(published["download"]["bytes"], good.len());
    let zipped = zip_of(&[("bin/tool", 0o755, SCRIPT), ("lib/x.so", 0o644, b"x")]);
    let url = e.http.serve("/good.zip", zipped);
    let published = e.install(json!({ "source": url, "tool_id": "pkg-zip" })).await;
    assert_eq!(
        (
            published["package"]["format"].as_str(),
            published["package"]["entrypoint"].as_str()
        ),
        (Some("zip"), Some("bin/tool"))
    );
    assert_eq!(published["version"], "unknown");

    // A declared size that is not the package's: refused before the body is read; nothing committed.
    let url = e.http.serve("/size.tar.gz", good.clone());
    let err = e
        .install_err(json!({ "binary_urls": { "linux": { "url": url, "size": good.len() + 1 } }, "tool_id": "pkg-size" }))
        .await;
    assert_eq!(err.code, ApiErrorCode::InvalidArg);
    assert!(err.message.contains("size mismatch"), "{err}");
    // A sha256 that is not the package's.
    let err = e
        .install_err(json!({ "source": url, "tool_id": "pkg-sha", "sha256": "0".repeat(64) }))
        .await;
    assert!(err.message.contains("sha256 mismatch"), "{err}");

    // Every zip-slip form.
    let forms: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "dotdot",
            tar_gz(&[("../../evil", 0o755, SCRIPT)], |_| {}),
            "`..` path component",
        ),
        (
            "absolute",
            tar_gz(&[("/tmp/evil", 0o755, SCRIPT)], |_| {}),
            "absolute path",
        ),
        (
            "symlink",
            tar_gz(&[("bin/tool", 0o755, SCRIPT)], |b| {
                special(b, tar::EntryType::Symlink, "bin/passwd", "../../../../etc/passwd");
            }),
            "escapes the install root",
        ),
        (
            "hardlink",
            tar_gz(&[("bin/tool", 0o755, SCRIPT)], |b| {
                special(b, tar::EntryType::Link, "bin/shadow", "/etc/shadow");
            }),
            "hard link",
        ),
        (
            "device",
            tar_gz(&[("bin/tool", 0o755, SCRIPT)], |b| {
                special(b, tar::EntryType::Char, "dev/null", "");
            }),
            "device file",
        ),
    ];
    for (name, bytes, reason) in forms {
        let url = e.http.serve(&format!("/{name}.tar.gz"), bytes);
        let err = e
            .install_err(json!({ "source": url, "tool_id": format!("evil-{name}") }))
            .await;
        assert_unsafe(&err, reason);
    }
    // The same in a zip: `../` and an absolute path.
    let url = e.http.serve("/evil.zip", zip_of(&[("../evil", 0o755, SCRIPT)]));
    assert_unsafe(
        &e.install_err(json!({ "source": url, "tool_id": "evil-zip" }))
            .await,
        "`..`",
    );
    let url = e
        .http
        .serve("/evil-abs.zip", zip_of(&[("/etc/evil", 0o755, SCRIPT)]));
    assert_unsafe(
        &e.install_err(json!({ "source": url, "tool_id": "evil-zip" }))
            .await,
        "absolute",
    );

    // No executable at all.
    let url = e
        .http
        .serve("/none.tar.gz", tar_gz(&[("README", 0o644, b"read me")], |_| {}));
    let err = e
        .install_err(json!({ "source": url, "tool_id": "pkg-none" }))
        .await;
    assert!(err.message.contains("no entrypoint"), "{err}");
    // Two candidates: the spec's tie rule (§16 A-42) picks the first in byte order, with a warning.
    let url = e.http.serve(
        "/two.tar.gz",
        tar_gz(
            &[("bin/zeta", 0o755, SCRIPT), ("bin/alpha", 0o755, SCRIPT)],
            |_| {},
        ),
    );
    let two = e.install(json!({ "source": url, "tool_id": "pkg-two" })).await;
    assert_eq!(two["package"]["entrypoint"], "bin/alpha");
    assert!(
        two["package"]["warnings"][0]
            .as_str()
            .is_some_and(|w| w.contains("bin/zeta")),
        "{two}"
    );
    // The per-platform entrypoint map of manifest.json: full key → OS segment → default.
    let manifest = serde_json::to_vec(
        &json!({ "name": "pkg-map", "version": "2.0.0", "runtime": { "binary": {
        "entrypoint": { "darwin-arm64": "mac/run", "linux": "linux/run", "default": "bin/pkg-map" } } } }),
    )
    .expect("json");
    let url = e.http.serve(
        "/map.tar.gz",
        tar_gz(
            &[
                ("manifest.json", 0o644, &manifest),
                ("bin/pkg-map", 0o755, SCRIPT),
                ("linux/run", 0o644, SCRIPT),
            ],
            |_| {},
        ),
    );
    let map = e.install(json!({ "source": url })).await;
    assert_eq!(
        (map["tool_id"].as_str(), map["package"]["entrypoint"].as_str()),
        (Some("pkg-map"), Some("linux/run"))
    );

    // binary_urls: no exact key for this host, so the OS entry wins over the wildcard; nothing matching is the
    // spec's error.
    let good_url = e.http.serve("/linux.tar.gz", echo_pkg("pkg-platform", "1.0.0"));
    let platform = e
        .install(json!({ "binary_urls": {
            "darwin-arm64": format!("{}/missing", e.http.base),
            "linux": { "url": good_url, "sha256": sha256(&echo_pkg("pkg-platform", "1.0.0")) },
            "*": format!("{}/missing", e.http.base),
        } }))
        .await;
    assert_eq!(platform["package"]["source"]["asset_key"], "linux");
    let err = e
        .install_err(json!({ "binary_urls": { "darwin-arm64": good_url, "windows-x86_64": good_url } }))
        .await;
    assert!(
        err.message
            .starts_with("No binary available for platform 'linux-")
            && err.message.ends_with("Available: darwin-arm64, windows-x86_64"),
        "{err}"
    );

    // A download cut half-way: refused, nothing committed; the retry installs.
    let pkg = echo_pkg("pkg-cut", "1.0.0");
    let half = pkg.len() / 2;
    let url = e.http.route("/cut.tar.gz", pkg, Some(half));
    let err = e.install_err(json!({ "source": url })).await;
    assert!(
        err.message.contains("download") && err.message.contains("failed"),
        "{err}"
    );
    assert_eq!(
        err.details.as_ref().and_then(|d| d.get("retriable")),
        Some(&json!(true))
    );
    assert!(!e.tool_ids().await.contains(&"pkg-cut".to_string()));
    let retried = e.install(json!({ "source": url })).await;
    assert_eq!(retried["tool_id"], "pkg-cut");

    // Only the good packages exist; nothing of the refused ones.
    assert_eq!(
        e.tool_ids().await,
        [
            "pkg-cut",
            "pkg-good",
            "pkg-map",
            "pkg-platform",
            "pkg-two",
            "pkg-zip"
        ]
    );
    // Operator actions need the operator claim.
    let user = e.cluster.token("alice");
    let err = cli::request(
        &e.cluster.operator,
        &user,
        admin::plugins::LIST,
        &json!({}),
        Duration::from_secs(10),
    )
    .await
    .expect_err("a user token is refused");
    assert_eq!(err.code, ApiErrorCode::PermissionDenied);
    // The scratch directory holds nothing once the calls are answered.
    let scratch: Vec<_> = std::fs::read_dir(e.cluster.root.path().join("plugin-scratch"))
        .expect("scratch")
        .flatten()
        .map(|d| d.file_name())
        .collect();
    assert!(scratch.is_empty(), "{scratch:?}");
    e.cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn upgrades_drain_old_sessions_gc_old_versions_and_new_workers_install_lazily() {
    let mut e = env("pkg-upgrade", 1).await;
    let tool = "pkg-echo";
    let v1 = e.http.serve("/v1.tar.gz", echo_pkg(tool, "1.0.0"));
    let v2 = e.http.serve("/v2.tar.gz", echo_pkg(tool, "2.0.0"));
    let v3 = e.http.serve("/v3.tar.gz", echo_pkg(tool, "3.0.0"));

    // Not published yet: unknown.
    let err = e
        .cluster
        .err(
            "alice",
            methods::TOOLS_INVOKE,
            json!({ "tool_id": tool, "method": "inspect", "args": {} }),
        )
        .await;
    assert_eq!(err.code, ApiErrorCode::PermissionDenied);

    // v1: the worker installs it on first use and runs it from its version directory, under alice's uid.
    e.install(json!({ "source": v1 })).await;
    let first = e.inspect("alice", tool).await;
    let cwd = first["cwd"].as_str().expect("cwd").to_string();
    assert!(cwd.ends_with(&format!("/executa/tools/{tool}/v1.0.0")), "{cwd}");
    assert_ne!(first["uid"], json!("0"), "plugins never run as root");
    let pid1 = first["pid"].as_u64().expect("pid");
    let tool_dir = std::path::Path::new(&cwd)
        .parent()
        .expect("tool dir")
        .to_path_buf();
    let install: Value =
        serde_json::from_slice(&std::fs::read(tool_dir.join("v1.0.0/INSTALL.json")).expect("INSTALL.json"))
            .expect("json");
    assert_eq!(install["sha256"], sha256(&echo_pkg(tool, "1.0.0")));
    assert_eq!(
        std::fs::read_link(tool_dir.join("current")).expect("current"),
        std::path::Path::new("v1.0.0")
    );

    // A long job on v1 (20 s of plugin work between its two progress events: far longer than publishing v2 and
    // one call take, so the upgrade happens while it runs): wait until the plugin is running it (its first
    // progress event is stored).
    let job = e
        .cluster
        .ok(
            "alice",
            methods::TOOLS_INVOKE_ASYNC,
            json!({ "tool_id": tool, "method": "progress", "args": { "count": 2, "interval_ms": 20000 } }),
        )
        .await;
    let job_id = job["jobId"].as_str().expect("jobId").to_string();
    until(async || {
        let j = e.job("alice", &job_id).await;
        (!j["progress"].as_array().is_none_or(Vec::is_empty)).then_some(())
    })
    .await;

    // v2 is published while it runs: the next call runs on v2 in a new process…
    e.install(json!({ "source": v2 })).await;
    let second = e.inspect("alice", tool).await;
    assert!(
        second["cwd"].as_str().is_some_and(|c| c.ends_with("/v2.0.0")),
        "{second}"
    );
    let pid2 = second["pid"].as_u64().expect("pid");
    assert_ne!(pid1, pid2);
    // …while the job still runs on v1 and finishes there.
    assert_eq!(e.job("alice", &job_id).await["state"], "running");
    assert!(alive(u32::try_from(pid1).expect("pid")));
    let done = until(async || {
        let j = e.job("alice", &job_id).await;
        (j["state"] != "running" && j["state"] != "queued").then_some(j)
    })
    .await;
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(done["result"], json!({ "emitted": 2 }));
    // Then the v1 process drains away.
    until(async || (!alive(u32::try_from(pid1).expect("pid"))).then_some(())).await;

    // v3: one old version is kept (v2), older ones are collected.
    e.install(json!({ "source": v3 })).await;
    let third = e.inspect("alice", tool).await;
    assert!(
        third["cwd"].as_str().is_some_and(|c| c.ends_with("/v3.0.0")),
        "{third}"
    );
    let mut versions: Vec<String> = std::fs::read_dir(&tool_dir)
        .expect("tool dir")
        .flatten()
        .map(|d| d.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('v'))
        .collect();
    versions.sort();
    assert_eq!(versions, ["v2.0.0", "v3.0.0"]);

    // The record, the cached in-archive manifest, and (once a worker described it) the described manifest.
    let described = until(async || {
        let d = e
            .plugins(admin::plugins::DESCRIBE, json!({ "tool_id": tool }))
            .await
            .expect("describe");
        (!d["manifest"].is_null()).then_some(d)
    })
    .await;
    assert_eq!(described["plugin"]["current"], "3.0.0");
    assert_eq!(
        described["plugin"]["versions"].as_object().map(|v| v.len()),
        Some(3)
    );
    assert_eq!(
        described["plugin"]["versions"]["3.0.0"]["manifest"]["version"],
        "3.0.0"
    );
    assert!(described["manifest"]["tools"].is_array(), "{described}");

    // A new worker needs no manual step: with the first one gone, it installs v3 from the object store.
    e.cluster.add_worker().await;
    if let Some(node) = e.cluster.workers[0].node.take() {
        node.shutdown().await;
    }
    let fourth = e.inspect("bob", tool).await;
    let cwd4 = fourth["cwd"].as_str().expect("cwd");
    assert!(
        cwd4.ends_with("/v3.0.0") && !cwd4.starts_with(tool_dir.to_str().expect("utf-8")),
        "{cwd4}"
    );

    // Removal: an old version; never the current one while others remain; then the plugin.
    let removed = e
        .plugins(
            admin::plugins::REMOVE,
            json!({ "tool_id": tool, "version": "1.0.0" }),
        )
        .await
        .expect("remove");
    assert_eq!(removed["removed"], json!(["1.0.0"]));
    let err = e
        .plugins(
            admin::plugins::REMOVE,
            json!({ "tool_id": tool, "version": "3.0.0" }),
        )
        .await
        .expect_err("the current version stays");
    assert_eq!(err.code, ApiErrorCode::InvalidArg);
    e.plugins(admin::plugins::REMOVE, json!({ "tool_id": tool }))
        .await
        .expect("remove all");
    let err = e
        .cluster
        .err(
            "bob",
            methods::TOOLS_INVOKE,
            json!({ "tool_id": tool, "method": "inspect", "args": {} }),
        )
        .await;
    assert_eq!(err.code, ApiErrorCode::PermissionDenied);
    // The worker that ran it drops its local copies once its sessions have stopped.
    let tool_dir4 = std::path::Path::new(cwd4)
        .parent()
        .expect("tool dir")
        .to_path_buf();
    until(async || (!tool_dir4.exists()).then_some(())).await;
    let err = e
        .plugins(admin::plugins::DESCRIBE, json!({ "tool_id": tool }))
        .await
        .expect_err("gone");
    assert_eq!(err.code, ApiErrorCode::NotFound);
    e.cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_cli_installs_a_directory_lists_describes_and_removes() {
    let e = env("pkg-cli", 1).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let pkg = dir.path().join("cli-echo");
    std::fs::create_dir_all(pkg.join("bin")).expect("mkdir");
    std::fs::write(pkg.join("bin/cli-echo"), echo_bytes()).expect("binary");
    std::fs::set_permissions(
        pkg.join("bin/cli-echo"),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .expect("chmod");
    std::fs::write(
        pkg.join("manifest.json"),
        br#"{"name": "cli-echo", "version": "0.3.0"}"#,
    )
    .expect("manifest");
    let url = e.cluster.nats.url();
    let creds = e.cluster.nats.creds(fleet_client::creds::Role::Operator);
    let fleet = |args: &[&str]| {
        let out = std::process::Command::new(fleet_e2e::fleet_bin())
            .args(args)
            .args(["--nats-url", &url, "--token", &e.operator])
            .arg("--nats-creds")
            .arg(&creds)
            .output()
            .expect("fleet");
        let stdout: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        (
            out.status.success(),
            stdout,
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, out, err) = fleet(&["plugins", "install", pkg.to_str().expect("utf-8")]);
    assert!(ok, "{out} {err}");
    assert_eq!(
        (out["tool_id"].as_str(), out["version"].as_str()),
        (Some("cli-echo"), Some("0.3.0"))
    );
    // Listed by tools.list before anyone called it: the worker ranked first prepares (installs and describes) a
    // newly published version at once.
    let listed = |want: bool| {
        let cluster = &e.cluster;
        async move {
            let deadline = Instant::now() + GUARD;
            loop {
                let list = cluster.ok("carol", "tools.list", json!({})).await;
                let has = list["tools"]
                    .as_array()
                    .is_some_and(|t| t.iter().any(|t| t["tool_id"] == "cli-echo"));
                if has == want {
                    return;
                }
                assert!(Instant::now() < deadline, "tools.list: {list}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    listed(true).await;
    // A wrong --sha256 aborts.
    let (ok, out, err) = fleet(&[
        "plugins",
        "install",
        pkg.to_str().expect("utf-8"),
        "--tool-id",
        "other",
        "--sha256",
        &"a".repeat(64),
    ]);
    assert!(!ok && err.contains("sha256 mismatch"), "{out} {err}");
    // A raw binary (installed as bin/<tool_id>, mode 0755) and a binary_urls descriptor.
    let raw = fleet_e2e::echo_plugin_bin();
    let (ok, out, err) = fleet(&[
        "plugins",
        "install",
        raw.to_str().expect("utf-8"),
        "--tool-id",
        "raw-echo",
    ]);
    assert!(ok, "{out} {err}");
    assert_eq!(
        (
            out["package"]["format"].as_str(),
            out["package"]["entrypoint"].as_str()
        ),
        (Some("raw"), Some("bin/raw-echo"))
    );
    let pkg_bytes = echo_pkg("desc-echo", "4.0.0");
    let desc_url = e.http.serve("/desc.tar.gz", pkg_bytes.clone());
    let descriptor = dir.path().join("desc-echo.json");
    std::fs::write(
        &descriptor,
        serde_json::to_vec(
            &json!({ "binary_urls": { "*": { "url": desc_url, "sha256": sha256(&pkg_bytes) } } }),
        )
        .expect("json"),
    )
    .expect("descriptor");
    let (ok, out, err) = fleet(&["plugins", "install", descriptor.to_str().expect("utf-8")]);
    assert!(ok, "{out} {err}");
    assert_eq!(
        (out["tool_id"].as_str(), out["version"].as_str()),
        (Some("desc-echo"), Some("4.0.0"))
    );
    for tool in ["raw-echo", "desc-echo"] {
        let res = e.inspect("carol", tool).await;
        assert!(res["pid"].is_u64(), "{tool}: {res}");
    }
    let (ok, out, _) = fleet(&["plugins", "list"]);
    assert!(ok);
    assert_eq!(out["plugins"].as_array().map(Vec::len), Some(3), "{out}");
    let res = e.inspect("carol", "cli-echo").await;
    assert!(
        res["cwd"]
            .as_str()
            .is_some_and(|c| c.ends_with("/cli-echo/v0.3.0")),
        "{res}"
    );
    let (ok, out, _) = fleet(&["plugins", "describe", "cli-echo"]);
    assert!(ok);
    assert_eq!(out["plugin"]["current"], "0.3.0");
    let (ok, out, err) = fleet(&["plugins", "remove", "cli-echo", "--version", "0.3.0"]);
    assert!(ok, "the only version may go: {out} {err}");
    let (ok, _, err) = fleet(&["plugins", "describe", "cli-echo"]);
    assert!(!ok && err.contains("not_found"), "{err}");
    // Removed: no longer in tools.list either.
    listed(false).await;
    // Without the operator claim: refused.
    let user = e.cluster.token("carol");
    let out = std::process::Command::new(fleet_e2e::fleet_bin())
        .args(["plugins", "list", "--nats-url", &url, "--token", &user])
        .arg("--nats-creds")
        .arg(&creds)
        .output()
        .expect("fleet");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("permission_denied"),
        "{stderr}"
    );
    e.cluster.shutdown().await;
}

/// A minimal Executa plugin in JavaScript (stdlib only): `whoami` reports the runtime and working directory.
const NODE_PLUGIN: &str = r#"
const readline = require('readline');
const send = (m) => process.stdout.write(JSON.stringify(m) + '\n');
readline.createInterface({ input: process.stdin }).on('line', (line) => {
  let m;
  try { m = JSON.parse(line); } catch (e) { return; }
  if (m.id === undefined || typeof m.method !== 'string') return;
  const ok = (result) => send({ jsonrpc: '2.0', id: m.id, result });
  switch (m.method) {
    case 'initialize':
      return ok({ protocolVersion: '2.0', serverInfo: { name: 'node-echo', version: '1.0.0' }, capabilities: {}, client_capabilities: {} });
    case 'describe':
      return ok({ name: 'node-echo', version: '1.0.0', description: 'Node fixture', tools: [{ name: 'whoami', description: 'runtime and cwd', parameters: [] }] });
    case 'invoke':
      return ok({ success: true, data: { runtime: 'node', cwd: process.cwd(), arguments: m.params.arguments } });
    case 'health':
      return ok({ status: 'ready' });
    case 'shutdown':
      ok({ ok: true });
      return process.exit(0);
    default:
      return send({ jsonrpc: '2.0', id: m.id, error: { code: -32601, message: 'method not found' } });
  }
}).on('close', () => process.exit(0));
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn launchers_run_installed_python_node_and_binary_packages_and_name_what_is_missing() {
    use fleet_e2e::worker::{TestWorker, data, test_config};
    use fleet_worker::catalogue::{CatalogueError, InstallType, LoadOptions, load_dir};
    use fleet_worker::install::{InstallOptions, InstallRequest, install};

    let w = TestWorker::start(test_config("pkg-launch"), &[]);
    let opts = InstallOptions::new(w.root.path().join("executa"));
    // The system's runtimes only (no pyenv shim under /root: plugins run under per-user uids).
    let runtimes = LoadOptions::with_search_path(["/usr/bin", "/bin"]);
    let empty = tempfile::tempdir().expect("tempdir");
    let no_runtimes = LoadOptions::with_search_path([empty.path()]);
    let has_node = std::path::Path::new("/usr/bin/node").is_file();
    let put = |name: &str, bytes: Vec<u8>| {
        let path = w.root.path().join(name);
        std::fs::write(&path, bytes).expect("package");
        path
    };
    let exe = |kind: &str| serde_json::to_vec(&json!({ "type": kind })).expect("json");
    let python = std::fs::read(fleet_e2e::python_plugin_path()).expect("python fixture");

    // python without uv: the documented fallback runs `python3 main.py`.
    let py = put(
        "py.tar.gz",
        tar_gz(
            &[
                ("executa.json", 0o644, &exe("python")),
                ("main.py", 0o644, &python),
            ],
            |_| {},
        ),
    );
    // node: the entry is package.json `main`.
    let pkg_json = br#"{"name": "node-echo", "version": "1.0.0", "main": "index.js"}"#;
    let node = put(
        "node.zip",
        zip_of(&[
            ("executa.json", 0o644, &exe("node")),
            ("package.json", 0o644, pkg_json),
            ("index.js", 0o644, NODE_PLUGIN.as_bytes()),
        ]),
    );
    // binary: the resolved entrypoint.
    let bin = put("bin.tar.gz", echo_pkg("bin-echo", "1.0.0"));
    // go: a source package needs `go`, which this host does not have (production ships a prebuilt binary).
    let go = put(
        "go.tar.gz",
        tar_gz(
            &[
                ("executa.json", 0o644, &exe("go")),
                ("go.mod", 0o644, b"module x\n"),
            ],
            |_| {},
        ),
    );

    let mut loaded = Vec::new();
    for (tool_id, package) in [
        ("py-echo", &py),
        ("node-echo", &node),
        ("bin-echo", &bin),
        ("go-echo", &go),
    ] {
        let req = InstallRequest {
            package: package.clone(),
            tool_id: Some(tool_id.into()),
            version: Some("1.0.0".into()),
            ..InstallRequest::default()
        };
        let installed = install(&opts, &req).expect("install");
        // go: a search path without `go`, whatever this host has.
        let search = if tool_id == "go-echo" {
            &no_runtimes
        } else {
            &runtimes
        };
        loaded.push((tool_id, load_dir(&installed.dir, search)));
    }
    let mut installs = HashMap::new();
    for (tool_id, result) in loaded {
        installs.insert(tool_id, result);
    }
    let py_install = installs.remove("py-echo").expect("py").expect("python loads");
    assert_eq!(py_install.kind, InstallType::Python);
    assert_eq!(py_install.argv[0], "/usr/bin/python3");
    assert!(
        py_install.argv[1].ends_with("/py-echo/v1.0.0/main.py"),
        "{:?}",
        py_install.argv
    );
    // node: run when the host has it; otherwise its absence is the named error.
    let node_install = match installs.remove("node-echo").expect("node") {
        Ok(i) => {
            assert_eq!(i.argv[0], "/usr/bin/node");
            Some(i)
        }
        Err(e) => {
            assert!(!has_node, "{e}");
            assert!(
                matches!(
                    e,
                    CatalogueError::MissingRuntime {
                        kind: InstallType::Node,
                        program: "node"
                    }
                ),
                "{e}"
            );
            None
        }
    };
    let go_err = installs
        .remove("go-echo")
        .expect("go")
        .expect_err("no go on the search path");
    assert!(
        matches!(
            go_err,
            CatalogueError::MissingRuntime {
                kind: InstallType::Go,
                program: "go"
            }
        ),
        "{go_err}"
    );
    assert_eq!(
        go_err.to_string(),
        "type go needs `go` on PATH (or set `command`)"
    );
    let bin_install = installs.remove("bin-echo").expect("bin").expect("binary loads");

    for install in [Some(py_install), node_install, Some(bin_install)]
        .into_iter()
        .flatten()
    {
        drop(w.pool.set_install(install));
    }
    let py = data(&w, "dave", "py-echo", "echo", json!({ "via": "python3" })).await;
    assert_eq!(py, json!({ "arguments": { "via": "python3" } }));
    if has_node {
        let node = data(&w, "dave", "node-echo", "whoami", json!({ "x": 1 })).await;
        assert_eq!(node["runtime"], "node");
        assert!(
            node["cwd"]
                .as_str()
                .is_some_and(|c| c.ends_with("/node-echo/v1.0.0")),
            "{node}"
        );
    }
    let bin = data(&w, "dave", "bin-echo", "inspect", json!({})).await;
    assert!(
        bin["cwd"]
            .as_str()
            .is_some_and(|c| c.ends_with("/bin-echo/v1.0.0")),
        "{bin}"
    );
    w.pool.shutdown().await;
}

// ---------------------------------------------------------------------------------------------------------------
// Plugins laid out exactly as the public SDK's examples ship them (`tests/plugins/sdk-*`), run under per-user uids.

/// The SDK-layout fixture directory `name` (`sdk-python`, `sdk-node`).
fn sdk_fixture(name: &str) -> std::path::PathBuf {
    fleet_e2e::workspace_root().join("tests/plugins").join(name)
}

/// The regular files of `dir`, with their modes and contents.
fn fixture_files(dir: &std::path::Path) -> Vec<(String, u32, Vec<u8>)> {
    use std::os::unix::fs::PermissionsExt as _;
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).expect("fixture dir") {
        let entry = entry.expect("entry");
        let meta = entry.metadata().expect("metadata");
        if meta.is_file() {
            let name = entry.file_name().into_string().expect("utf-8 name");
            let bytes = std::fs::read(entry.path()).expect("fixture file");
            files.push((name, meta.permissions().mode() & 0o777, bytes));
        }
    }
    files.sort();
    files
}

/// The worker's own search path without any directory holding `uv` (the launch without `uv`), for the plugins
/// of a worker with `config`.
fn search_without_uv(config: &fleet_worker::config::WorkerConfig) -> fleet_worker::catalogue::LoadOptions {
    let mut opts = fleet_worker::catalogue::LoadOptions::for_worker(config);
    opts.search_path.retain(|dir| !dir.join("uv").exists());
    opts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sdk_layout_plugins_start_from_the_catalogue_and_from_an_install_without_uv() {
    use fleet_e2e::worker::{TestWorker, data, test_config};
    use fleet_worker::catalogue::{Catalogue, Install, load_dir};
    use fleet_worker::install::{InstallOptions, InstallRequest, install};
    use fleet_worker::sandbox::reach::{self, Access};

    const PY_ID: &str = "tool-dev-example-text-tool";
    const NODE_ID: &str = "tool-dev-example-node-tool";
    let w = TestWorker::start(test_config("sdk-layout"), &[]);
    let opts = search_without_uv(&w.config);
    let has_node = opts.lookup("node").is_some();
    if !has_node {
        println!("skipping the Node half: no `node` on PATH that the plugins' uids can execute");
    }

    // From the catalogue: the directories copied as they are.
    for name in ["sdk-python", "sdk-node"] {
        let dir = w.config.catalogue_dir.join(name);
        std::fs::create_dir(&dir).expect("install dir");
        for (file, mode, bytes) in fixture_files(&sdk_fixture(name)) {
            let path = dir.join(file);
            std::fs::write(&path, bytes).expect("copy");
            std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(mode))
                .expect("chmod");
        }
    }
    let (catalogue, problems) = Catalogue::load(&w.config.catalogue_dir, &opts).expect("catalogue");
    let problems: Vec<String> = problems.iter().map(ToString::to_string).collect();
    if has_node {
        assert!(problems.is_empty(), "{problems:?}");
    } else {
        assert_eq!(problems.len(), 1, "{problems:?}");
    }
    let py = catalogue
        .get(PY_ID)
        .expect("the SDK Python example loads")
        .clone();
    // Without uv: python3 imports the script's module:function; an interpreter the plugins' uid can execute
    // (on a machine with pyenv, the first `python3` on PATH is a shim under root's 0700 home: skipped).
    assert_eq!(py.argv[1], "-c", "{:?}", py.argv);
    assert_eq!(py.argv[4..], ["example_plugin", "main", "example-text-tool"]);
    let blocked = reach::blockers(std::path::Path::new(&py.argv[0]), Access::Execute).expect("stat");
    assert!(blocked.is_empty(), "{} is out of reach: {blocked:?}", py.argv[0]);

    // From an install: the same files as a package.
    let files = fixture_files(&sdk_fixture("sdk-python"));
    let members: Vec<(&str, u32, &[u8])> = files
        .iter()
        .map(|(n, m, b)| (n.as_str(), *m, b.as_slice()))
        .collect();
    let package = w.root.path().join("sdk-python.tar.gz");
    std::fs::write(&package, tar_gz(&members, |_| {})).expect("package");
    let installed = install(
        &InstallOptions::new(w.root.path().join("executa")),
        &InstallRequest {
            package,
            tool_id: Some("tool-dev-installed-text-tool".into()),
            version: Some("1.0.0".into()),
            ..InstallRequest::default()
        },
    )
    .expect("install");
    let from_package: Install = load_dir(&installed.dir, &opts).expect("the installed example loads");
    assert_eq!(
        from_package.argv[4..],
        ["example_plugin", "main", "example-text-tool"]
    );

    let mut runs = vec![(PY_ID, py), ("tool-dev-installed-text-tool", from_package)];
    if has_node {
        runs.push((
            NODE_ID,
            catalogue
                .get(NODE_ID)
                .expect("the SDK Node example loads")
                .clone(),
        ));
    }
    for (tool_id, install) in runs {
        drop(w.pool.set_install(install));
        let manifest = w
            .pool
            .describe("erin", tool_id, GUARD)
            .await
            .unwrap_or_else(|e| panic!("{tool_id}: describe: {e}"));
        assert!(
            manifest.tools.iter().any(|t| t.name == "word_count"),
            "{tool_id}: {manifest:?}"
        );
        let out = data(
            &w,
            "erin",
            tool_id,
            "word_count",
            json!({ "text": "one two three" }),
        )
        .await;
        assert_eq!(out["words"], 3, "{tool_id}: {out}");
        if tool_id != NODE_ID {
            // The launcher names the process after the script, as its console-script wrapper would.
            assert_eq!(out["argv0"], "example-text-tool", "{out}");
        }
    }
    // The script's module is part of the launch's fingerprint: changed under the worker, it is quarantined.
    let module = w.config.catalogue_dir.join("sdk-python/example_plugin.py");
    let mut code = std::fs::read_to_string(&module).expect("module");
    code.push_str("\n# changed\n");
    std::fs::write(&module, code).expect("change the module");
    let err = tokio::time::timeout(
        GUARD,
        w.pool.invoke(
            "erin",
            PY_ID,
            fleet_e2e::worker::req("word_count", json!({ "text": "x" })),
        ),
    )
    .await
    .expect("ends")
    .expect_err("quarantined");
    assert!(
        matches!(
            &err,
            fleet_worker::pool::PoolError::Refused(fleet_worker::animus::DetectError::Quarantined(_))
        ),
        "{err}"
    );
    w.pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_interpreter_the_plugins_cannot_execute_is_reported_at_load_and_its_spawn_failure_is_a_launch_failure()
 {
    use fleet_e2e::worker::{TestWorker, req, test_config};
    use fleet_worker::animus::{DetectError, RefusalStage};
    use fleet_worker::catalogue::{Catalogue, CatalogueError, LoadOptions, Runner};
    use fleet_worker::config::RunAs;
    use fleet_worker::pool::PoolError;
    use std::os::unix::fs::PermissionsExt as _;

    let w = TestWorker::start(test_config("pyenv-trap"), &[]);
    if w.config.run_as == RunAs::Inherit {
        println!("skipping: the plugins run as the worker's own uid (per-user uids need root)");
        return;
    }
    // A pyenv-style home: 0700, a `python3` shim inside that runs the system's interpreter. Not under /tmp:
    // the sandbox's private /tmp re-creates the directories leading to what it mounts back, as root's home
    // never is — and not under the checkout either, which may itself be under /tmp (a `mktemp -d` clone).
    let homes = tempfile::tempdir_in("/var/tmp").expect("tempdir outside /tmp");
    std::fs::set_permissions(homes.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let home = homes.path().join("home");
    let shims = home.join(".pyenv/shims");
    std::fs::create_dir_all(&shims).expect("shims");
    let shim = shims.join("python3");
    let python = LoadOptions::with_search_path(["/usr/bin", "/bin"])
        .lookup("python3")
        .expect("a system python3");
    std::fs::write(&shim, format!("#!/bin/sh\nexec {} \"$@\"\n", python.display())).expect("shim");
    std::fs::set_permissions(&shim, std::fs::Permissions::from_mode(0o755)).expect("chmod shim");
    std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o700)).expect("chmod home");
    copy_into_catalogue(&w.config.catalogue_dir, "sdk-python");

    // Loaded for the plugins' uids: reported now, with the fix.
    let for_plugins = LoadOptions::with_search_path([&shims]).with_runner(Runner::of(&w.config));
    let (catalogue, problems) = Catalogue::load(&w.config.catalogue_dir, &for_plugins).expect("catalogue");
    assert!(catalogue.is_empty());
    assert_eq!(problems.len(), 1);
    assert!(
        matches!(&problems[0].error, CatalogueError::RuntimeUnreachable { program, .. } if program == "python3"),
        "{}",
        problems[0]
    );
    let shown = problems[0].to_string();
    let home_c = std::fs::canonicalize(&home).expect("home");
    assert!(
        shown.contains("install `python3` system-wide")
            && shown.contains(&format!("`chmod o+x {}`", home_c.display())),
        "{shown}"
    );

    // Loaded as the worker sees its own PATH (what happened before): the first call fails to start the program,
    // and that is a launch failure, not a refusal of the plugin's dialect.
    let (catalogue, problems) =
        Catalogue::load(&w.config.catalogue_dir, &LoadOptions::with_search_path([&shims]))
            .expect("catalogue");
    assert!(problems.is_empty(), "{problems:?}");
    let install = catalogue
        .get("tool-dev-example-text-tool")
        .expect("install")
        .clone();
    assert_eq!(install.argv[0], shim.display().to_string());
    drop(w.pool.set_install(install));
    let err = tokio::time::timeout(
        GUARD,
        w.pool.invoke(
            "frank",
            "tool-dev-example-text-tool",
            req("word_count", json!({ "text": "a" })),
        ),
    )
    .await
    .expect("the invoke ends")
    .expect_err("the sandbox uid cannot execute the shim");
    let PoolError::Refused(refusal) = &err else {
        panic!("expected a refusal at launch, got {err}");
    };
    assert!(matches!(refusal, DetectError::Launch { .. }), "{refusal}");
    assert_eq!(refusal.stage(), RefusalStage::Launch);
    assert!(err.to_string().contains("Permission denied"), "{err}");

    // Not remembered: once the operator follows the fix, the next call starts the plugin.
    std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o711)).expect("chmod o+x home");
    let out = fleet_e2e::worker::data(
        &w,
        "frank",
        "tool-dev-example-text-tool",
        "word_count",
        json!({ "text": "a b" }),
    )
    .await;
    assert_eq!(out["words"], 2, "{out}");
    w.pool.shutdown().await;
}

/// Stands in for `uv sync` (the real one has a test of its own): appends its arguments to `count`, fails while
/// `fail` exists, waits for a line on the FIFO `<count>.gate` when there is one, and otherwise makes the
/// environment with the system's `python3` (the SDK example is stdlib-only, so an environment without packages is
/// what `uv sync` would make of it). It runs confined like any preparation, so its switches live in the install's
/// own directory, the only one it may write (and the only one of the test's it sees).
fn fake_uv(
    path: &std::path::Path,
    count: &std::path::Path,
    fail: &std::path::Path,
    python: &std::path::Path,
) {
    use std::os::unix::fs::PermissionsExt as _;
    let gate = count.with_extension("gate");
    let script = format!(
        "#!/bin/sh\necho \"$*\" >> '{count}'\n\
         if [ -e '{fail}' ]; then echo 'error: no solution found (test)' >&2; exit 1; fi\n\
         if [ -p '{gate}' ]; then read line < '{gate}'; fi\n\
         exec '{python}' -m venv --without-pip \"$UV_PROJECT_ENVIRONMENT\"\n",
        count = count.display(),
        fail = fail.display(),
        gate = gate.display(),
        python = python.display()
    );
    std::fs::write(path, script).expect("fake uv");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
}

/// Copies the SDK-layout fixture `name` into `catalogue` as `<catalogue>/<name>/` (modes as the umask makes them).
fn copy_into_catalogue(catalogue: &std::path::Path, name: &str) {
    let dir = catalogue.join(name);
    std::fs::create_dir(&dir).expect("install dir");
    for (file, _, bytes) in fixture_files(&sdk_fixture(name)) {
        std::fs::write(dir.join(file), bytes).expect("copy");
    }
}

/// A worker, a [`fake_uv`] in a directory of its own (its runs counted in `count`, failing while `fail`
/// exists), and the SDK Python example in the catalogue, loaded with that `uv` on the search path.
struct UvSetup {
    w: fleet_e2e::worker::TestWorker,
    python: std::path::PathBuf,
    tools: std::path::PathBuf,
    count: std::path::PathBuf,
    fail: std::path::PathBuf,
    install: fleet_worker::catalogue::Install,
}

impl UvSetup {
    const ID: &str = "tool-dev-example-text-tool";

    /// `before_load` runs once the fake `uv` is in place (to set its switches).
    fn start(name: &str, before_load: impl FnOnce(&UvPaths<'_>)) -> UvSetup {
        Self::start_with(fleet_e2e::worker::test_config(name), before_load)
    }

    /// [`UvSetup::start`] with a worker of `config`.
    fn start_with(
        config: fleet_worker::config::WorkerConfig,
        before_load: impl FnOnce(&UvPaths<'_>),
    ) -> UvSetup {
        use fleet_worker::catalogue::{Catalogue, LoadOptions, Runner};
        let w = fleet_e2e::worker::TestWorker::start(config, &[]);
        let python = LoadOptions::with_search_path(["/usr/bin", "/bin"])
            .lookup("python3")
            .expect("a system python3");
        let tools = w.root.path().join("uv-bin");
        std::fs::create_dir(&tools).expect("uv dir");
        copy_into_catalogue(&w.config.catalogue_dir, "sdk-python");
        let dir = w.config.catalogue_dir.join("sdk-python");
        let (count, fail) = (dir.join(".uv-runs"), dir.join(".uv-fail"));
        fake_uv(&tools.join("uv"), &count, &fail, &python);
        before_load(&UvPaths {
            count: &count,
            fail: &fail,
        });
        let opts = LoadOptions::with_search_path([tools.as_path(), python.parent().expect("bin dir")])
            .with_runner(Runner::of(&w.config));
        let (catalogue, problems) = Catalogue::load(&w.config.catalogue_dir, &opts).expect("catalogue");
        assert!(problems.is_empty(), "{problems:?}");
        let install = catalogue.get(Self::ID).expect("install").clone();
        drop(w.pool.set_install(install.clone()));
        UvSetup {
            w,
            python,
            tools,
            count,
            fail,
            install,
        }
    }

    /// How many times `uv` ran.
    fn runs(&self) -> usize {
        std::fs::read_to_string(&self.count)
            .map(|s| s.lines().count())
            .unwrap_or(0)
    }
}

/// The switches of a [`fake_uv`].
struct UvPaths<'a> {
    count: &'a std::path::Path,
    fail: &'a std::path::Path,
}

impl UvPaths<'_> {
    /// Makes the FIFO `uv` waits on for a line before it prepares anything: its path.
    fn gate(&self) -> std::path::PathBuf {
        let gate = self.count.with_extension("gate");
        let made = std::process::Command::new("mkfifo")
            .arg(&gate)
            .status()
            .expect("mkfifo");
        assert!(made.success());
        gate
    }
}

/// The real `uv` (PyPI `uv`, which `scripts/test.sh` installs into `./.tools/uv`, off PATH): the SDK Python example
/// as shipped (a `[project.scripts]` entry, a hatchling build backend, no dependencies) is prepared at its first use
/// by `uv sync` into its `.fleet-venv` — the project installed there with its console script — and runs from that
/// environment's interpreter under the worker's confinement, as a plugin uid; the next call does not prepare again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_real_uv_prepares_the_sdk_example_and_it_runs_from_its_environment() {
    use fleet_e2e::worker::{TestWorker, data, test_config};
    use fleet_worker::catalogue::{Catalogue, LoadOptions, Prepare, Runner, UV_VENV_DIR};
    use fleet_worker::prepare::PREPARED_MARKER;
    const ID: &str = UvSetup::ID;
    let tools = fleet_e2e::workspace_root().join(".tools/uv/bin");
    assert!(
        tools.join("uv").is_file(),
        "the real uv is missing from {}: `python3 -m pip install --prefix .tools/uv uv` (scripts/test.sh does)",
        tools.display()
    );
    // The preparation reaches PyPI (the build back-end, hatchling) through its egress proxy, to the index hosts
    // only; this machine's mirror lives on a range the proxy opens only when told.
    let mut config = test_config("uv-real");
    config.preparation.allow_cidrs = fleet_e2e::worker::index_host_ranges();
    let w = TestWorker::start(config, &[]);
    let python = LoadOptions::with_search_path(["/usr/bin", "/bin"])
        .lookup("python3")
        .expect("a system python3");
    copy_into_catalogue(&w.config.catalogue_dir, "sdk-python");
    let opts = LoadOptions::with_search_path([tools.as_path(), python.parent().expect("bin dir")])
        .with_runner(Runner::of(&w.config));
    let (catalogue, problems) = Catalogue::load(&w.config.catalogue_dir, &opts).expect("catalogue");
    assert!(problems.is_empty(), "{problems:?}");
    let install = catalogue.get(ID).expect("install").clone();
    let venv = install.dir.join(UV_VENV_DIR);
    assert_eq!(
        install.prepare,
        Some(Prepare::UvSync {
            uv: tools.join("uv"),
            python: Some(python.clone()),
            venv: venv.clone(),
        })
    );
    drop(w.pool.set_install(install.clone()));
    assert!(!venv.exists(), "nothing is prepared at load");
    let out = data(&w, "uma", ID, "word_count", json!({ "text": "one two three" })).await;
    assert_eq!(out["words"], 3, "{out}");
    // uv installed the project, with the console script the SDK names after the plugin.
    assert!(
        venv.join("bin/example-text-tool").is_file(),
        "no console script in {}",
        venv.display()
    );
    let marker = venv.join(PREPARED_MARKER);
    let prepared = std::fs::metadata(&marker)
        .expect("the preparation is remembered")
        .modified()
        .unwrap();
    let out = data(&w, "uma", ID, "word_count", json!({ "text": "four" })).await;
    assert_eq!(out["words"], 1, "{out}");
    assert_eq!(
        std::fs::metadata(&marker).unwrap().modified().unwrap(),
        prepared,
        "prepared once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_uv_the_install_is_prepared_once_before_its_first_spawn_and_a_failed_preparation_is_retried() {
    use fleet_e2e::worker::{TestWorker, data, req, test_config};
    use fleet_worker::animus::{DetectError, RefusalStage};
    use fleet_worker::catalogue::{Prepare, UV_VENV_DIR};
    use fleet_worker::pool::PoolError;
    use fleet_worker::prepare::PREPARED_MARKER;

    const ID: &str = UvSetup::ID;
    let setup = UvSetup::start("uv-prepare", |uv| {
        std::fs::write(uv.fail, b"").expect("fail switch");
    });
    let (w, python, install) = (&setup.w, &setup.python, setup.install.clone());
    let venv = install.dir.join(UV_VENV_DIR);
    assert_eq!(
        install.prepare,
        Some(Prepare::UvSync {
            uv: setup.tools.join("uv"),
            python: Some(python.clone()),
            venv: venv.clone(),
        })
    );
    assert_eq!(install.argv[0], venv.join("bin/python").display().to_string());
    assert_eq!(setup.runs(), 0, "nothing runs at load");

    // The first use prepares; the failure is reported as such, with uv's own words, and is not remembered.
    let call = |text: &'static str| {
        tokio::time::timeout(
            GUARD,
            w.pool
                .invoke("gina", ID, req("word_count", json!({ "text": text }))),
        )
    };
    let err = call("a b").await.expect("ends").expect_err("uv sync fails");
    let PoolError::Refused(refusal) = &err else {
        panic!("expected a refused preparation, got {err}");
    };
    assert!(matches!(refusal, DetectError::Prepare(_)), "{refusal}");
    assert_eq!(refusal.stage(), RefusalStage::Prepare);
    assert!(err.to_string().contains("no solution found (test)"), "{err}");
    assert_eq!(setup.runs(), 1);

    std::fs::remove_file(&setup.fail).expect("fail switch off");
    let out = data(w, "gina", ID, "word_count", json!({ "text": "one two three" })).await;
    assert_eq!(out["words"], 3, "{out}");
    assert_eq!(setup.runs(), 2, "prepared on the retry");
    let args = std::fs::read_to_string(&setup.count).expect("runs");
    assert_eq!(
        args.lines().last(),
        Some(
            format!(
                "sync --project {} --no-dev --python {}",
                install.dir.display(),
                python.display()
            )
            .as_str()
        )
    );
    assert!(venv.join(PREPARED_MARKER).is_file());
    // Another user's session of the same install: prepared already.
    let out = data(w, "hank", ID, "word_count", json!({ "text": "x" })).await;
    assert_eq!(out["words"], 1, "{out}");
    assert_eq!(setup.runs(), 2);
    w.pool.shutdown().await;

    // A restarted worker finds the environment made from the same project files: no second sync.
    let w2 = TestWorker::start(test_config("uv-prepare-2"), &[]);
    drop(w2.pool.set_install(install));
    let out = data(&w2, "gina", ID, "word_count", json!({ "text": "a b c d" })).await;
    assert_eq!(out["words"], 4, "{out}");
    assert_eq!(setup.runs(), 2, "the marker matched");
    w2.pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_caller_that_gives_up_does_not_stop_the_preparation() {
    use fleet_e2e::worker::{data, eventually, req};

    const ID: &str = UvSetup::ID;
    let mut gate = std::path::PathBuf::new();
    let setup = UvSetup::start("uv-prepare-abandoned", |uv| gate = uv.gate());
    let w = &setup.w;
    let runs = || setup.runs();

    // The first caller starts the preparation, which waits at the gate; then the caller gives up.
    let pool = w.pool.clone();
    let first = tokio::spawn(async move {
        pool.invoke("ivan", ID, req("word_count", json!({ "text": "a" })))
            .await
    });
    assert!(eventually(GUARD, || runs() == 1).await, "the preparation started");
    first.abort();
    assert!(first.await.expect_err("aborted").is_cancelled());

    // The preparation goes on: once the gate opens, the next caller gets the environment it made.
    tokio::task::spawn_blocking(move || std::fs::write(gate, b"go\n").expect("open the gate"))
        .await
        .expect("gate");
    let out = data(w, "ivan", ID, "word_count", json!({ "text": "one two" })).await;
    assert_eq!(out["words"], 2, "{out}");
    assert_eq!(runs(), 1, "one `uv sync`, not restarted by the second caller");
    w.pool.shutdown().await;
}

/// A preparation that does not finish within `preparation.timeout` (a `uv` that waits for ever on its gate) is
/// killed whole and says so in one line; nothing of it is left: no process in the worker's cgroups, no partial
/// environment, nothing in the build's TMPDIR. The install's tree is the worker's again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_preparation_past_its_wall_clock_cap_is_killed_and_leaves_nothing_behind() {
    use fleet_worker::pool::PoolError;
    use fleet_worker::sandbox::BUILD_USER;
    use std::os::unix::fs::MetadataExt as _;

    const ID: &str = UvSetup::ID;
    let mut config = fleet_e2e::worker::test_config("uv-timeout");
    config.preparation.timeout = Duration::from_secs(1);
    let setup = UvSetup::start_with(config, |uv| {
        uv.gate();
    });
    let w = &setup.w;
    let err = tokio::time::timeout(
        GUARD,
        w.pool.invoke(
            "jill",
            ID,
            fleet_e2e::worker::req("word_count", json!({ "text": "a" })),
        ),
    )
    .await
    .expect("ends")
    .expect_err("the preparation times out");
    let PoolError::Refused(refusal) = &err else {
        panic!("expected a refused preparation, got {err}");
    };
    let message = refusal.to_string();
    assert!(message.contains("did not finish within 1s"), "{message}");
    assert!(!message.contains('\n'), "one line: {message}");
    assert_eq!(setup.runs(), 1, "it started");
    // Its whole tree was killed with its cgroup, which is gone (the waiting sandbox stubs have cgroups of their
    // own, `seat`s).
    for dir in w.sandbox.subtree_paths() {
        let procs = files_named(dir, "cgroup.procs");
        assert!(
            !procs.iter().any(|f| f.to_string_lossy().contains("build-")),
            "a build cgroup is left: {procs:?}"
        );
        for file in procs.iter().filter(|f| !f.to_string_lossy().contains("seat")) {
            let pids = std::fs::read_to_string(file).unwrap_or_default();
            assert!(pids.trim().is_empty(), "{} holds {pids}", file.display());
        }
    }
    let venv = setup.install.dir.join(fleet_worker::catalogue::UV_VENV_DIR);
    assert!(!venv.exists(), "no partial environment");
    let build = w.sandbox.user_space(BUILD_USER, "unused").expect("build space");
    let users = build.tmpdir.parent().expect("tmp root");
    for dir in std::fs::read_dir(users).expect("build tmp dirs").flatten() {
        let left: Vec<_> = std::fs::read_dir(dir.path()).expect("dir").flatten().collect();
        assert!(left.is_empty(), "{} holds {left:?}", dir.path().display());
    }
    for entry in walk(&setup.install.dir) {
        let meta = std::fs::symlink_metadata(&entry).expect("meta");
        assert_eq!(meta.uid(), 0, "{}", entry.display());
        assert_eq!(meta.mode() & 0o7022, 0, "{}", entry.display());
    }
}

/// Every path under `dir` (itself included), without following links.
fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = vec![dir.to_path_buf()];
    let mut i = 0;
    while i < out.len() {
        if std::fs::symlink_metadata(&out[i]).is_ok_and(|m| m.is_dir()) {
            let children: Vec<_> = std::fs::read_dir(&out[i])
                .expect("dir")
                .flatten()
                .map(|e| e.path())
                .collect();
            out.extend(children);
        }
        i += 1;
    }
    out
}

/// The files called `name` under `dir`.
fn files_named(dir: &std::path::Path, name: &str) -> Vec<std::path::PathBuf> {
    walk(dir)
        .into_iter()
        .filter(|p| p.file_name().is_some_and(|n| n == name))
        .collect()
}
