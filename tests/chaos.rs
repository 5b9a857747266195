//! Chaos on real processes (the deploy-and-prove issue): the nats-server stopped and restarted under load, the
//! front (`fleet up --workers 0 --nats-url …`, a separate process) killed with `-9` under load, and hostile plugins
//! (memory bomb, fork bomb, CPU spin, stdout flood, a plugin ignoring EOF and SIGTERM, grandchildren) next to a
//! quiet tenant.
//!
//! Every wait is a poll of an observable under a failure guard; no assertion is about elapsed time. Requests that
//! fail during an outage are counted (they must fail cleanly or time out), never asserted on; what is asserted is
//! that every job whose `invokeAsync` was answered `ok` reaches a terminal state.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fleet::nats_server::NatsServer;
use fleet_client::api::api_request;
use fleet_e2e::cluster::{Cluster, Role, SECRET, connect};
use fleet_e2e::fleet_bin;
use fleet_e2e::worker::{Plugin, alive, eventually};
use fleet_proto::api::{ApiError, ApiResponse, methods, subjects};
use serde_json::{Value, json};

/// Failure guard only: every wait returns as soon as its observable holds.
const GUARD: Duration = Duration::from_secs(60);

/// The outcome of one API request.
#[derive(Debug)]
enum Outcome {
    Ok(Value),
    /// The API's error envelope.
    Api(ApiError),
    /// NATS: nobody serves the subject (no front up).
    NoResponders,
    /// No answer in time, or the connection is down.
    Failed(String),
}

async fn request(
    client: &async_nats::Client,
    auth: &str,
    method: &str,
    args: &Value,
    timeout: Duration,
) -> Outcome {
    let req = api_request(auth, args, timeout);
    match client.send_request(subjects::api(method), req).await {
        Ok(msg) => match serde_json::from_slice::<ApiResponse<Value>>(&msg.payload) {
            Ok(ApiResponse::Ok(v)) => Outcome::Ok(v),
            Ok(ApiResponse::Err(e)) => Outcome::Api(e),
            Err(e) => panic!("unreadable API answer: {e}"),
        },
        Err(e) if e.kind() == async_nats::client::RequestErrorKind::NoResponders => Outcome::NoResponders,
        Err(e) => Outcome::Failed(format!("{:?}: {e}", e.kind())),
    }
}

fn bearer(c: &Cluster, user: &str) -> String {
    format!("Bearer {}", c.token(user))
}

fn is_terminal(job: &Value) -> bool {
    matches!(
        job["state"].as_str(),
        Some("succeeded" | "failed" | "cancelled" | "expired")
    )
}

/// Polls `tools.list` until the API answers `ok`.
async fn wait_api(client: &async_nats::Client, auth: &str, guard: Duration) -> bool {
    let until = Instant::now() + guard;
    loop {
        if let Outcome::Ok(_) = request(
            client,
            auth,
            methods::TOOLS_LIST,
            &json!({}),
            Duration::from_secs(2),
        )
        .await
        {
            return true;
        }
        if Instant::now() >= until {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Polls `tools.getJob` (retrying transport failures) until the job is terminal; fails the test after [`GUARD`].
async fn wait_terminal(client: &async_nats::Client, auth: &str, id: &str) -> Value {
    let until = Instant::now() + GUARD;
    let mut last;
    loop {
        match request(
            client,
            auth,
            methods::TOOLS_GET_JOB,
            &json!({ "jobId": id }),
            Duration::from_secs(5),
        )
        .await
        {
            Outcome::Ok(job) if is_terminal(&job) => return job,
            other => last = format!("{other:?}"),
        }
        assert!(
            Instant::now() < until,
            "failure guard: accepted job {id} did not reach a terminal state within {GUARD:?}; last: {last}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// What a load loop saw.
#[derive(Debug, Default)]
struct Load {
    /// (user, jobId) of every `ok` invokeAsync reply.
    accepted: Vec<(String, String)>,
    /// Failures by kind (API code, `no_responders`, `transport`).
    failures: BTreeMap<String, usize>,
    /// The last transport failure.
    last_transport: Option<String>,
}

/// Submits echo jobs round-robin over `users` (each stays under its rate limit and its 5 active jobs mostly),
/// until `stop`; each request is retried up to `retries` times on `no responders` / transport failures.
fn spawn_load(
    client: async_nats::Client,
    auths: Vec<(String, String)>,
    stop: Arc<AtomicBool>,
    load: Arc<Mutex<Load>>,
    retries: usize,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut pace = tokio::time::interval(Duration::from_millis(20));
        let mut n = 0usize;
        while !stop.load(Ordering::SeqCst) {
            pace.tick().await;
            let (user, auth) = &auths[n % auths.len()];
            // Half quick echoes, half short sleeps: at any moment some jobs are queued or running.
            let args = if n.is_multiple_of(2) {
                json!({ "tool_id": "echo", "method": "echo", "args": { "n": n } })
            } else {
                json!({ "tool_id": "echo", "method": "sleep", "args": { "ms": 300 } })
            };
            n += 1;
            for _attempt in 0..=retries {
                let outcome = request(
                    &client,
                    auth,
                    methods::TOOLS_INVOKE_ASYNC,
                    &args,
                    Duration::from_secs(3),
                )
                .await;
                let kind = match outcome {
                    Outcome::Ok(v) => {
                        assert_eq!(v["state"], "queued", "{v}");
                        let id = v["jobId"].as_str().unwrap().to_string();
                        load.lock().unwrap().accepted.push((user.clone(), id));
                        break;
                    }
                    Outcome::Api(e) => {
                        // A clean refusal (quota, rate limit, or a store error while NATS is down): not retried.
                        *load
                            .lock()
                            .unwrap()
                            .failures
                            .entry(e.code.to_string())
                            .or_default() += 1;
                        break;
                    }
                    Outcome::NoResponders => "no_responders",
                    Outcome::Failed(e) => {
                        load.lock().unwrap().last_transport = Some(e);
                        "transport"
                    }
                };
                *load.lock().unwrap().failures.entry(kind.into()).or_default() += 1;
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    })
}

fn accepted(load: &Mutex<Load>) -> usize {
    load.lock().unwrap().accepted.len()
}

/// Polls until the load loop has had `n` more jobs accepted than `from`.
async fn wait_accepted(load: &Mutex<Load>, from: usize, n: usize, what: &str) {
    assert!(
        eventually(GUARD, || accepted(load) >= from + n).await,
        "failure guard: {what}: {n} more accepted jobs did not come within {GUARD:?} (load: {:?})",
        load.lock().unwrap()
    );
}

/// Asserts every accepted job reaches a terminal state; returns the count per state.
async fn assert_all_terminal(
    c: &Cluster,
    client: &async_nats::Client,
    load: &Mutex<Load>,
) -> BTreeMap<String, usize> {
    let jobs = load.lock().unwrap().accepted.clone();
    let mut states = BTreeMap::new();
    for (user, id) in &jobs {
        let job = wait_terminal(client, &bearer(c, user), id).await;
        *states
            .entry(job["state"].as_str().unwrap().to_string())
            .or_default() += 1;
    }
    states
}

fn users(c: &Cluster, prefix: &str, n: usize) -> Vec<(String, String)> {
    (0..n)
        .map(|i| {
            let u = format!("{prefix}-{i}");
            let a = bearer(c, &u);
            (u, a)
        })
        .collect()
}

/// A background task aborted when dropped.
struct Bg(tokio::task::JoinHandle<()>);

impl Drop for Bg {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// 1. The nats-server is stopped for ~2 s under a load of invokeAsync and restarted on the same port and store
///    dir: the fleet's connections reconnect by themselves, the API answers again within 10 s of NATS being back,
///    and every job accepted before or after the outage reaches a terminal state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_server_restart_under_load_loses_no_accepted_job() {
    let mut c = Cluster::start("chaos-nats", 1, 1, &[Plugin::echo("echo", &[])]).await;
    let _sweeper = Bg(tokio::spawn(fleet::sweeper::run(c.fronts[0].0.clone())));
    let client = connect(&c.nats, Role::App).await;
    assert!(
        wait_api(&client, &bearer(&c, "probe"), GUARD).await,
        "the API answers"
    );

    let stop = Arc::new(AtomicBool::new(false));
    let load = Arc::new(Mutex::new(Load::default()));
    let task = spawn_load(
        client.clone(),
        users(&c, "nats-load", 8),
        stop.clone(),
        load.clone(),
        0,
    );
    wait_accepted(&load, 0, 20, "before the outage").await;
    let in_flight = c.store.active_jobs().await.unwrap().len();

    // The outage: stop the server (SIGTERM), keep it down ~2 s (the fault's length, not a synchronisation).
    let (port, store_dir) = (c.nats.port(), c.nats.store_dir().to_path_buf());
    tokio::task::block_in_place(|| c.nats.stop());
    let before = accepted(&load);
    tokio::time::sleep(Duration::from_secs(2)).await;
    c.nats =
        tokio::task::block_in_place(|| NatsServer::start_on(&store_dir, port)).expect("nats-server restarts");

    assert!(
        wait_api(&client, &bearer(&c, "probe"), Duration::from_secs(10)).await,
        "the API answers again within 10 s of NATS being back"
    );
    let after = accepted(&load);
    wait_accepted(&load, after, 10, "after the restart").await;
    stop.store(true, Ordering::SeqCst);
    task.await.unwrap();

    let states = assert_all_terminal(&c, &client, &load).await;
    println!(
        "nats restart: {before} accepted before the stop ({in_flight} active at the stop), {} in total; failures {:?}; \
         terminal states {states:?}",
        accepted(&load),
        load.lock().unwrap().failures
    );
    c.shutdown().await;
}

/// A `fleet up --workers 0 --nats-url …` front process; dropping it kills it (`-9`).
struct FrontProc(Option<Child>);

impl FrontProc {
    fn spawn(url: &str, creds: &Path, dir: &Path) -> FrontProc {
        std::fs::create_dir_all(dir).unwrap();
        let secret = dir.join("jwt-secret");
        std::fs::write(&secret, SECRET).unwrap();
        let http = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .to_string();
        let mut cmd = Command::new(fleet_bin());
        for var in [
            "FLEET_NATS_URL",
            "FLEET_DATA_DIR",
            "FLEET_PLUGINS_DIR",
            "FLEET_TOKEN",
            "FLEET_ISOLATION",
            "FLEET_JWT_HS256_SECRET_FILE",
            "FLEET_JWT_ED25519_PUBLIC_KEY",
            "FLEET_OTLP_ENDPOINT",
        ] {
            cmd.env_remove(var);
        }
        let child = cmd
            .args(["up", "--nats-url", url, "--workers", "0", "--http", &http])
            .arg("--nats-creds")
            .arg(creds)
            .arg("--data-dir")
            .arg(dir.join("data"))
            .arg("--jwt-hs256-secret-file")
            .arg(&secret)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("fleet up");
        FrontProc(Some(child))
    }

    fn kill9(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for FrontProc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// 2. The only front (a separate `fleet up --workers 0` process) is killed with `-9` under a load of invokeAsync
///    (retried on `no responders` / timeouts) and a new one started: the client succeeds again, and every job
///    accepted before or after the kill reaches a terminal state (the new front's sweeper dispatches what the dead
///    one left queued).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn front_killed_9_under_load_loses_no_accepted_job() {
    let c = Cluster::start("chaos-front", 0, 1, &[Plugin::echo("echo", &[])]).await;
    let url = c.nats.url();
    let mut front = FrontProc::spawn(&url, &c.nats.creds(Role::Front), &c.root.path().join("front-1"));
    let client = connect(&c.nats, Role::App).await;
    assert!(
        wait_api(&client, &bearer(&c, "probe"), GUARD).await,
        "the child front answers"
    );

    let stop = Arc::new(AtomicBool::new(false));
    let load = Arc::new(Mutex::new(Load::default()));
    let task = spawn_load(
        client.clone(),
        users(&c, "front-load", 8),
        stop.clone(),
        load.clone(),
        40,
    );
    wait_accepted(&load, 0, 20, "before the kill").await;
    let in_flight = c.store.active_jobs().await.unwrap().len();

    front.kill9();
    let before = accepted(&load);
    let mut front = FrontProc::spawn(&url, &c.nats.creds(Role::Front), &c.root.path().join("front-2"));
    wait_accepted(&load, before, 10, "after the new front started").await;
    stop.store(true, Ordering::SeqCst);
    task.await.unwrap();

    let states = assert_all_terminal(&c, &client, &load).await;
    println!(
        "front kill -9: {before} accepted before the kill ({in_flight} active at the kill), {} in total; failures \
         {:?}; terminal states {states:?}",
        accepted(&load),
        load.lock().unwrap().failures
    );
    front.kill9();
    c.shutdown().await;
}

/// 3. Hostile plugins (each its own user, on a tightly limited install) next to a quiet tenant doing 30 sync echo
///    invokes on another install: each hostile call ends the way its limit dictates, and every quiet call succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_plugins_do_not_disturb_a_quiet_tenant() {
    let hostile = Plugin::echo("hostile", &[]).limits(json!({
        "memory_bytes": 67_108_864, "pids_max": 32, "cpu_millis": 200
    }));
    let c = Arc::new(Cluster::start("chaos-hostile", 1, 1, &[hostile, Plugin::echo("quiet", &[])]).await);
    assert!(
        wait_api(&c.app, &bearer(&c, "probe"), GUARD).await,
        "the API answers"
    );

    let invoke = |user: &'static str, tool: &'static str, args: Value| {
        let c = c.clone();
        async move {
            c.call(
                user,
                methods::TOOLS_INVOKE,
                json!({ "tool_id": "hostile", "method": tool, "args": args }),
            )
            .await
        }
    };

    // The quiet tenant, concurrently with everything hostile.
    let quiet = {
        let c = c.clone();
        tokio::spawn(async move {
            let mut failures = Vec::new();
            for i in 0..30 {
                let r = c
                    .call(
                        "quiet-user",
                        methods::TOOLS_INVOKE,
                        json!({ "tool_id": "quiet", "method": "echo", "args": { "i": i } }),
                    )
                    .await;
                match r {
                    ApiResponse::Ok(v) => assert_eq!(v, json!({ "arguments": { "i": i } })),
                    ApiResponse::Err(e) => failures.push(format!("#{i}: {e}")),
                }
            }
            failures
        })
    };

    let memory = tokio::spawn(invoke("h-memory", "alloc", json!({ "mib": 256 })));
    let fork = tokio::spawn(invoke("h-fork", "fork", json!({ "count": 200, "hold_ms": 5000 })));
    let spin = tokio::spawn(invoke("h-spin", "spin", json!({ "ms": 3000, "threads": 2 })));
    let flood = tokio::spawn(invoke("h-flood", "flood", json!({ "stdout_bytes": 33_554_432 })));

    // Grandchildren: spawned, then the plugin crashes; the whole tree goes.
    let grandchildren = {
        let c = c.clone();
        tokio::spawn(async move {
            let g = c
                .ok(
                    "h-grand",
                    methods::TOOLS_INVOKE,
                    json!({ "tool_id": "hostile", "method": "spawn_grandchild" }),
                )
                .await;
            let pid = u32::try_from(g["pid"].as_u64().unwrap()).unwrap();
            assert!(alive(pid));
            let crash = c
                .err(
                    "h-grand",
                    methods::TOOLS_INVOKE,
                    json!({ "tool_id": "hostile", "method": "crash" }),
                )
                .await;
            (pid, crash)
        })
    };

    // Ignores EOF and SIGTERM, then its running job is cancelled: the job ends cancelled, the process is killed.
    let stubborn = {
        let c = c.clone();
        tokio::spawn(async move {
            let user = "h-stubborn";
            let pid = c
                .ok(
                    user,
                    methods::TOOLS_INVOKE,
                    json!({ "tool_id": "hostile", "method": "inspect" }),
                )
                .await["pid"]
                .as_u64()
                .unwrap();
            c.ok(
                user,
                methods::TOOLS_INVOKE,
                json!({ "tool_id": "hostile", "method": "ignore_shutdown" }),
            )
            .await;
            let job = c
                .ok(
                    user,
                    methods::TOOLS_INVOKE_ASYNC,
                    json!({ "tool_id": "hostile", "method": "sleep", "args": { "ms": 600_000 } }),
                )
                .await;
            let id = job["jobId"].as_str().unwrap().to_string();
            let until = Instant::now() + GUARD;
            while c.ok(user, methods::TOOLS_GET_JOB, json!({ "jobId": id })).await["state"] != "running" {
                assert!(Instant::now() < until, "failure guard: job {id} running");
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            c.ok(user, methods::TOOLS_CANCEL_JOB, json!({ "jobId": id }))
                .await;
            let auth = bearer(&c, user);
            let done = wait_terminal(&c.app, &auth, &id).await;
            (u32::try_from(pid).unwrap(), done)
        })
    };

    match memory.await.unwrap() {
        ApiResponse::Err(e) => {
            assert_eq!(e.code.to_string(), "executa_unavailable", "{e}");
            assert!(e.message.contains("OOM killer"), "{e}");
        }
        ApiResponse::Ok(v) => panic!("the memory bomb succeeded: {v}"),
    }
    match fork.await.unwrap() {
        ApiResponse::Ok(v) => {
            assert!(v["errors"].as_u64().unwrap() > 0, "{v}");
            assert!(v["spawned"].as_u64().unwrap() < 200, "{v}");
        }
        ApiResponse::Err(e) => panic!("the fork bomb's plugin did not survive: {e}"),
    }
    match spin.await.unwrap() {
        ApiResponse::Ok(_) => {}
        ApiResponse::Err(e) => panic!("the throttled spinner failed: {e}"),
    }
    match flood.await.unwrap() {
        ApiResponse::Ok(_) => {}
        ApiResponse::Err(e) => panic!("the stdout flood failed: {e}"),
    }
    let (grandchild, crash) = grandchildren.await.unwrap();
    assert_eq!(crash.code.to_string(), "executa_unavailable", "{crash}");
    assert!(
        eventually(GUARD, || !alive(grandchild)).await,
        "the grandchild {grandchild} died with its crashed plugin"
    );
    let (stubborn_pid, done) = stubborn.await.unwrap();
    assert_eq!(done["state"], "cancelled", "{done}");
    assert!(
        eventually(GUARD, || !alive(stubborn_pid)).await,
        "the plugin {stubborn_pid} ignoring EOF and SIGTERM was killed after the cancel"
    );

    let failures = quiet.await.unwrap();
    assert!(failures.is_empty(), "quiet invokes failed: {failures:?}");

    Arc::try_unwrap(c).unwrap().shutdown().await;
}
