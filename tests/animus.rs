//! Animus plugins (seed 004) hosted beside Executa ones: detection, the lifecycle, the catalogue mapping, provider
//! runs as jobs (progress, result, error table), each cancellation path with the time it took, ping-miss
//! recycling, quarantine, and both dialects side by side through the fleet API (`tools.invokeAsync`, `getJob`,
//! `cancelJob`) on a real nats-server.
//!
//! Real processes in real cgroups (run as root); fixtures are `tests/plugins/animus/animus_plugin.py` (one
//! behaviour per `--mode`) and the native echo plugin. No sleep synchronises: every wait polls an observable under
//! a failure guard; times are printed, never asserted.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fleet_e2e::cluster::Cluster;
use fleet_e2e::worker::{eventually, req, test_config};
use fleet_e2e::{echo_plugin_bin, workspace_root};
use fleet_proto::animus::RunErrorClass;
use fleet_proto::api::{ApiErrorCode, JobState, methods, subjects};
use fleet_proto::codec::io::WRITE_QUEUE;
use fleet_proto::executa::invoke::ProgressType;
use fleet_worker::animus::{CancelPath, CancelReason, DetectError, HealthState};
use fleet_worker::catalogue::{Catalogue, Dialect, LoadOptions};
use fleet_worker::metrics::WorkerMetrics;
use fleet_worker::pool::{Pool, PoolError};
use fleet_worker::sandbox::Sandbox;
use fleet_worker::services::{NoServices, NoTokens};
use fleet_worker::session::progress::ProgressUpdate;
use fleet_worker::session::{InvokeError, InvokeOutput, InvokeRequest, WorkerContext};
use serde_json::{Value, json};

/// Failure guard of every wait.
const GUARD: Duration = Duration::from_secs(60);
const USER: &str = "alice";

fn fixture() -> PathBuf {
    workspace_root().join("tests/plugins/animus/animus_plugin.py")
}

/// An `executa.json` running the Animus fixture in `mode`.
fn animus(tool_id: &str, mode: &str, protocol: Option<&str>, extra: Value) -> (String, Value) {
    let mut e = json!({
        "tool_id": tool_id,
        "type": "binary",
        "command": ["/usr/bin/python3", fixture().display().to_string(), "--mode", mode],
    });
    if let Some(p) = protocol {
        e["protocol"] = json!(p);
    }
    if let Value::Object(m) = extra {
        for (k, v) in m {
            e[k] = v;
        }
    }
    (tool_id.to_string(), e)
}

fn echo(tool_id: &str, protocol: Option<&str>) -> (String, Value) {
    let mut e =
        json!({ "tool_id": tool_id, "type": "binary", "command": [echo_plugin_bin().display().to_string()] });
    if let Some(p) = protocol {
        e["protocol"] = json!(p);
    }
    (tool_id.to_string(), e)
}

fn write_catalogue(root: &Path, entries: &[(String, Value)]) -> PathBuf {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = root.join("catalogue");
    std::fs::create_dir_all(&dir).unwrap();
    for (id, e) in entries {
        let d = dir.join(id);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("executa.json"), serde_json::to_vec_pretty(e).unwrap()).unwrap();
        std::fs::write(d.join(".fleet-described"), b"").unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    for p in [root, dir.as_path()] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    dir
}

struct W {
    pool: Pool,
    metrics: Arc<WorkerMetrics>,
    sandbox: Sandbox,
    _root: tempfile::TempDir,
}

impl Drop for W {
    fn drop(&mut self) {
        let _ = self.sandbox.remove_subtree();
    }
}

fn worker(name: &str, entries: &[(String, Value)]) -> W {
    let root = tempfile::tempdir().unwrap();
    let mut config = test_config(&format!("an-{name}"));
    config.catalogue_dir = write_catalogue(root.path(), entries);
    config.state_dir = root.path().join("state");
    let (catalogue, problems) = Catalogue::load(&config.catalogue_dir, &LoadOptions::from_env()).unwrap();
    assert!(problems.is_empty(), "{problems:?}");
    let sandbox = Sandbox::new(&config).expect("sandbox (cgroups, as root)");
    let metrics = Arc::new(WorkerMetrics::default());
    let ctx = WorkerContext {
        config: Arc::new(config),
        sandbox: sandbox.clone(),
        services: Arc::new(NoServices),
        tokens: Arc::new(NoTokens),
        metrics: metrics.clone(),
    };
    W {
        pool: Pool::new(ctx, Arc::new(catalogue)),
        metrics,
        sandbox,
        _root: root,
    }
}

type Events = Arc<Mutex<Vec<ProgressUpdate>>>;

fn with_progress(mut r: InvokeRequest) -> (InvokeRequest, Events) {
    let events: Events = Arc::default();
    let e = events.clone();
    r.progress = Some(Arc::new(move |u| e.lock().unwrap().push(u)));
    (r, events)
}

fn event_names(events: &Events) -> Vec<String> {
    events
        .lock()
        .unwrap()
        .iter()
        .map(|u| {
            let v: Value = serde_json::from_str(u.data.get()).unwrap();
            v["event"].as_str().unwrap().to_string()
        })
        .collect()
}

async fn invoke(w: &W, tool_id: &str, r: InvokeRequest) -> Result<InvokeOutput, PoolError> {
    tokio::time::timeout(GUARD, w.pool.invoke(USER, tool_id, r))
        .await
        .expect("failure guard")
}

async fn run(w: &W, tool_id: &str, prompt: &str) -> Result<InvokeOutput, PoolError> {
    invoke(w, tool_id, req("agent.run", json!({ "prompt": prompt }))).await
}

fn animus_class(r: Result<InvokeOutput, PoolError>) -> RunErrorClass {
    match r {
        Err(PoolError::Invoke(InvokeError::Animus { class, .. })) => class,
        other => panic!("expected an Animus error, got {other:?}"),
    }
}

// -------------------------------------------------------------------------------------------------------------
// Detection
// -------------------------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detection_declared_and_probed_for_both_dialects() {
    let w = worker(
        "detect",
        &[
            echo("ex-probed", None),
            echo("ex-declared", Some("executa")),
            animus("an-probed", "provider", None, json!({})),
            animus("an-declared", "provider", Some("animus"), json!({})),
            animus(
                "an-nomanifest",
                "provider",
                Some("animus"),
                json!({"command": [
                "/usr/bin/python3", fixture().display().to_string(), "--mode", "provider", "--no-manifest"]}),
            ),
            animus("an-claims-executa", "provider", Some("executa"), json!({})),
        ],
    );
    let cases = [
        ("ex-probed", Dialect::Executa, "probed"),
        ("ex-declared", Dialect::Executa, "declared"),
        ("an-probed", Dialect::Animus, "probed"),
        ("an-declared", Dialect::Animus, "declared"),
        ("an-nomanifest", Dialect::Animus, "declared"),
    ];
    for (id, dialect, how) in cases {
        assert_eq!(w.pool.dialect(id).await.unwrap(), dialect, "{id}");
        let install = w.pool.install(id).unwrap();
        let d = w.pool.animus().registry().known(&install).unwrap().unwrap();
        assert_eq!(d.how, how, "{id}");
        println!("detect {id}: {dialect} ({how}) probe {:?}", d.probe_time);
    }
    // A declared Executa plugin that answers --manifest with an Animus manifest is refused, not guessed.
    let e = w.pool.dialect("an-claims-executa").await.unwrap_err();
    assert!(
        matches!(e, PoolError::Refused(DetectError::Mismatch { .. })),
        "{e}"
    );
    // Detection ran once per install, whatever happened after.
    let probes = WorkerMetrics::get(&w.metrics.animus.probes);
    assert_eq!(probes, 6);
    w.pool.dialect("an-probed").await.unwrap();
    assert_eq!(WorkerMetrics::get(&w.metrics.animus.probes), probes);
    // Both dialects answer through the same Pool::invoke, each with its own handshake.
    let out = invoke(&w, "ex-probed", req("echo", json!({"x": 1})))
        .await
        .unwrap();
    assert!(out.success());
    for id in ["an-probed", "an-nomanifest"] {
        let out = run(&w, id, "hi").await.unwrap();
        assert!(out.success(), "{id}: {:?}", out.error_message());
    }
    // Executa `health` and Animus `health/check` on one scale.
    w.pool.poll_executa_health().await;
    let health = w.pool.health_states();
    assert!(
        health.contains(&("ex-probed".into(), Dialect::Executa, HealthState::Healthy)),
        "{health:?}"
    );
    assert!(
        health.contains(&("an-probed".into(), Dialect::Animus, HealthState::Healthy)),
        "{health:?}"
    );
    // An Animus install never gets an Executa session (whose initialize would be the wrong dialect's).
    assert!(matches!(
        w.pool.session(USER, "an-probed"),
        Err(PoolError::NotExecuta(_))
    ));
    assert!(matches!(
        w.pool.prewarm(USER, "an-probed", GUARD).await,
        Err(PoolError::NotExecuta(_))
    ));
    w.pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_kinds_and_versions_and_a_changed_binary_is_quarantined() {
    let root = tempfile::tempdir().unwrap();
    // A private copy of the fixture, so the test can change "the binary".
    let script = root.path().join("private_plugin.py");
    std::fs::copy(fixture(), &script).unwrap();
    let copy = |id: &str| {
        (
            id.to_string(),
            json!({"tool_id": id, "type": "binary",
                "command": ["/usr/bin/python3", script.display().to_string(), "--mode", "provider"]}),
        )
    };
    let w = worker(
        "refuse",
        &[
            animus("subject", "subject", None, json!({})),
            animus("major", "wrong-major", None, json!({})),
            animus(
                "major-hs",
                "wrong-major",
                Some("animus"),
                json!({"command": [
                "/usr/bin/python3", fixture().display().to_string(), "--mode", "wrong-major", "--no-manifest"]}),
            ),
            copy("changing"),
        ],
    );
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    // Kind refused at detection, with a clear message.
    let e = run(&w, "subject", "hi").await.unwrap_err();
    assert!(
        matches!(e, PoolError::Refused(DetectError::KindNotHosted { .. })),
        "{e}"
    );
    assert!(e.to_string().contains("subject_backend"), "{e}");
    // Major 2: refused at detection (its --manifest), or at the handshake when it has none.
    let e = run(&w, "major", "hi").await.unwrap_err();
    assert!(matches!(e, PoolError::Refused(DetectError::Version(_))), "{e}");
    let e = run(&w, "major-hs", "hi").await.unwrap_err();
    assert!(e.to_string().contains("major 2"), "{e}");
    // …and it stays refused without another spawn.
    let spawns = WorkerMetrics::get(&w.metrics.animus.spawns);
    let e = run(&w, "major-hs", "hi").await.unwrap_err();
    assert!(e.to_string().contains("quarantined"), "{e}");
    assert_eq!(WorkerMetrics::get(&w.metrics.animus.spawns), spawns);

    // A binary changed after detection: quarantined at the next call.
    assert!(run(&w, "changing", "hi").await.unwrap().success());
    let mut text = std::fs::read_to_string(&script).unwrap();
    text.push_str("\n# changed\n");
    std::fs::write(&script, text).unwrap();
    let e = run(&w, "changing", "hi").await.unwrap_err();
    assert!(
        matches!(e, PoolError::Refused(DetectError::Quarantined(_))),
        "{e}"
    );
    assert!(WorkerMetrics::get(&w.metrics.animus.quarantines) >= 1);
    w.pool.shutdown().await;
    drop(root);
}

// -------------------------------------------------------------------------------------------------------------
// Lifecycle, mapping, runs
// -------------------------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provider_run_streams_progress_and_returns_the_response() {
    let w = worker("run", &[animus("prov", "provider", None, json!({}))]);
    let mut r = req("agent.run", json!({"prompt": "hi", "model": "m-1"}));
    r.credentials.insert("FIXTURE_KEY".into(), json!("k"));
    r.credentials.insert("NOT_REQUIRED".into(), json!("no"));
    r.timeout = Some(Duration::from_secs(120));
    let tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    r.extra_context.insert("traceparent".into(), json!(tp));
    let invoke_id = r.invoke_id.clone();
    let (r, events) = with_progress(r);
    let out = invoke(&w, "prov", r).await.unwrap();
    assert!(out.success(), "{:?}", out.error_message());
    let data = out.data().unwrap();
    assert_eq!(data["output"], "RESULT: hi");
    assert!(data["session_id"].as_str().unwrap().starts_with("sess-"));
    // Host-owned fields filled by the host.
    let meta = &data["metadata"][0];
    let (workspace, _) = {
        let s = w.pool.animus().clone();
        drop(s);
        (meta["cwd"].as_str().unwrap().to_string(), ())
    };
    // The tool's own workspace (one per (user, tool_id)): `workspaces/<tool key>` in the user's directory (its
    // disk, `disks/<worker>/<n>`, with isolation; `users/<user key>` without).
    let tool_dir = std::path::Path::new(&workspace);
    assert!(
        (workspace.contains("/disks/") || workspace.contains("/users/"))
            && tool_dir.parent().and_then(|p| p.file_name()) == Some("workspaces".as_ref())
            && tool_dir
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("prov")),
        "{workspace}"
    );
    assert_eq!(meta["project_root"], meta["cwd"]);
    assert_eq!(meta["timeout_secs"], 120);
    assert_eq!(meta["control_session_id"], invoke_id.as_str());
    assert_eq!(meta["env"], json!(["FIXTURE_KEY"]), "only env_required names");
    assert_eq!(meta["model"], "m-1");
    // Traces: the session's context in init_extensions, the call's in the run's extras.
    assert_eq!(meta["init_traceparent"], tp);
    assert_eq!(meta["traceparent"], tp);
    // agent/* notifications → progress events, in order, typed.
    assert_eq!(
        event_names(&events),
        [
            "thinking",
            "tool.call",
            "tool.result",
            "warning",
            "output.delta",
            "output.final"
        ]
    );
    let kinds: Vec<ProgressType> = events.lock().unwrap().iter().map(|u| u.kind).collect();
    assert_eq!(kinds[1], ProgressType::ToolUpdate);
    assert_eq!(kinds[2], ProgressType::ToolUpdate);
    assert_eq!(kinds[0], ProgressType::Progress);

    // The same (now idle) process serves the next run; agent.resume continues the session.
    let pids = w.pool.animus().idle_pids(USER, "prov");
    assert_eq!(pids.len(), 1);
    let sid = data["session_id"].as_str().unwrap().to_string();
    let out = invoke(
        &w,
        "prov",
        req("agent.resume", json!({"prompt": "more", "session_id": sid})),
    )
    .await
    .unwrap();
    assert_eq!(out.data().unwrap()["metadata"][0]["resumed"], sid.as_str());
    assert_eq!(
        w.pool.animus().idle_pids(USER, "prov"),
        pids,
        "warm process reused"
    );
    assert_eq!(
        w.pool.animus().health().get("prov"),
        Some(&HealthState::Healthy),
        "health/check after the start"
    );
    w.pool.shutdown().await;
    assert!(eventually(GUARD, || w.pool.animus().live() == 0).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mapping_rows_host_owned_fields_success_and_error_table() {
    let w = worker(
        "map",
        &[
            animus("prov", "provider", None, json!({})),
            animus(
                "notes",
                "custom",
                None,
                json!({"allow_methods": ["notes/add", "notes/count", "notes.search"]}),
            ),
            animus("notes-closed", "custom", None, json!({})),
        ],
    );
    // Provider → agent.run + agent.resume (advertised), with the spec's arguments only.
    let m = w.pool.describe(USER, "prov", GUARD).await.unwrap();
    let names: Vec<&str> = m.tools.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["agent.run", "agent.resume"]);
    assert_eq!(m.extra["dialect"], "animus");
    assert_eq!(m.extra["plugin_kind"], "provider");
    let params: Vec<&str> = m.tools[0].parameters.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(params, ["prompt", "model", "system_prompt"]);
    // Custom → the allow-listed advertised methods; notes/secret is advertised but not allowed.
    let m = w.pool.describe(USER, "notes", GUARD).await.unwrap();
    let names: Vec<&str> = m.tools.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["notes.search", "notes/add", "notes/count"]);
    assert_eq!(
        m.tools[0].extra["input_schema"]["properties"]["q"]["type"],
        "string"
    );
    let out = invoke(&w, "notes", req("notes/add", json!({"text": "a"})))
        .await
        .unwrap();
    assert_eq!(out.data().unwrap(), json!({"count": 1}));
    // An MCP tool goes through mcp/tool_call {name, arguments}.
    let out = invoke(&w, "notes", req("notes.search", json!({"q": "a"})))
        .await
        .unwrap();
    assert_eq!(
        out.data().unwrap(),
        json!({"tool": "notes.search", "hits": ["a"]})
    );
    let out = invoke(&w, "notes", req("notes/count", json!({}))).await.unwrap();
    assert_eq!(out.data().unwrap()["count"], 1, "one process served both calls");
    for tool in [
        "notes/secret",
        "$harness/flag",
        "health/check",
        "agent.run",
        "mcp/tool_call",
    ] {
        let e = invoke(&w, "notes", req(tool, json!({}))).await.unwrap_err();
        assert!(
            matches!(e, PoolError::Invoke(InvokeError::UnknownTool { .. })),
            "{tool}: {e}"
        );
    }
    // No allow-list, no tools.
    assert!(
        w.pool
            .describe(USER, "notes-closed", GUARD)
            .await
            .unwrap()
            .tools
            .is_empty()
    );

    // Host-owned fields are refused, so are unknown arguments and a resume without a session.
    for args in [
        json!({"prompt": "x", "cwd": "/etc"}),
        json!({"prompt": "x", "env": {"A": "b"}}),
        json!({"prompt": "x", "timeout_secs": 1}),
        json!({"prompt": "x", "bogus": 1}),
        json!({"prompt": 3}),
        json!({}),
    ] {
        let r = invoke(&w, "prov", req("agent.run", args.clone())).await;
        assert_eq!(animus_class(r), RunErrorClass::InvalidArguments, "{args}");
    }
    let r = invoke(&w, "prov", req("agent.resume", json!({"prompt": "x"}))).await;
    assert_eq!(animus_class(r), RunErrorClass::InvalidArguments);

    // Success is exit_code == 0 AND no non-recoverable agent/error (spec §3.4).
    let out = run(&w, "prov", "fail").await.unwrap();
    assert!(!out.success());
    assert!(out.error_message().unwrap().contains("upstream refused"));
    let out = run(&w, "prov", "exit2").await.unwrap();
    assert!(!out.success());
    assert!(out.error_message().unwrap().contains("exit_code 2"));

    // JSON-RPC errors by the Animus table, host → plugin direction.
    let table = [
        (
            "error:-32602:model_not_supported",
            Some(RunErrorClass::InvalidArguments),
        ),
        ("error:-32603:unavailable", Some(RunErrorClass::Unavailable)),
        ("error:-32603", Some(RunErrorClass::Failed)),
        ("error:-32001", Some(RunErrorClass::Unsupported)),
        ("error:-32601", Some(RunErrorClass::Unsupported)),
        ("error:-32050", Some(RunErrorClass::Failed)),
        ("error:-32002", None),
        ("error:-32003", None),
    ];
    let spawns = WorkerMetrics::get(&w.metrics.animus.spawns);
    for (prompt, class) in table {
        let r = run(&w, "prov", prompt).await;
        match (class, prompt) {
            (Some(c), _) => assert_eq!(animus_class(r), c, "{prompt}"),
            (None, "error:-32002") => assert!(
                matches!(r, Err(PoolError::Invoke(InvokeError::Cancelled))),
                "{r:?}"
            ),
            (None, _) => assert!(
                matches!(r, Err(PoolError::Invoke(InvokeError::Timeout(_)))),
                "{r:?}"
            ),
        }
    }
    // A plugin-returned code is never a dead process: the same process answered every row.
    assert_eq!(WorkerMetrics::get(&w.metrics.animus.spawns), spawns);
    assert_eq!(WorkerMetrics::get(&w.metrics.crashes), 0);
    w.pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_rules_and_a_plugin_that_answers_before_initialize() {
    let w = worker(
        "gate",
        &[
            animus("prov", "provider", None, json!({})),
            animus("eager", "eager", None, json!({})),
        ],
    );
    let (r, events) = with_progress(req("agent.run", json!({"prompt": "flood"})));
    let flood = Instant::now();
    assert!(invoke(&w, "prov", r).await.unwrap().success());
    let elapsed = flood.elapsed();
    let delivered = events.lock().unwrap().len();
    let limited = w
        .metrics
        .progress_dropped(fleet_worker::metrics::ProgressDrop::RateLimited);
    println!("flood: 304 notifications, {delivered} delivered, {limited} rate-limited in {elapsed:?}");
    // The per-invoke limiter is a bucket of PROGRESS_EVENTS_PER_SECOND refilled at that rate: over the run it
    // lets through at most the burst plus what refilled while the flood lasted (bounded by the whole invoke).
    let rate = u64::from(fleet_proto::limits::PROGRESS_EVENTS_PER_SECOND);
    let ms = u64::try_from(elapsed.as_millis()).unwrap();
    let bound = usize::try_from(rate + (ms * rate).div_ceil(1000)).unwrap();
    assert!(
        limited > 0 && delivered <= bound,
        "{delivered} delivered, at most {bound} in {elapsed:?}"
    );
    let (r, events) = with_progress(req("agent.run", json!({"prompt": "big"})));
    assert!(invoke(&w, "prov", r).await.unwrap().success());
    assert!(
        w.metrics
            .progress_dropped(fleet_worker::metrics::ProgressDrop::TooLarge)
            >= 1
    );
    assert!(!event_names(&events).is_empty());

    // Frames before initialize (a response nobody asked for, a stray notification) change nothing.
    let before = WorkerMetrics::get(&w.metrics.unmatched_responses);
    let out = run(&w, "eager", "hi").await.unwrap();
    assert!(out.success());
    assert_eq!(out.data().unwrap()["output"], "RESULT: hi");
    assert!(WorkerMetrics::get(&w.metrics.unmatched_responses) >= before + 2);
    w.pool.shutdown().await;
}

// -------------------------------------------------------------------------------------------------------------
// Cancellation and deadlines
// -------------------------------------------------------------------------------------------------------------

/// Starts a slow run, waits until it streams, cancels it; returns (time until the caller had its answer, the
/// ladder's record).
async fn cancel_slow(w: &W, tool_id: &str) -> (Duration, fleet_worker::animus::CancelRecord) {
    let (r, events) = with_progress(req("agent.run", json!({"prompt": "slow"})));
    let id = r.invoke_id.clone();
    let pool = w.pool.clone();
    let tool = tool_id.to_string();
    let task = tokio::spawn(async move { pool.invoke(USER, &tool, r).await });
    assert!(
        eventually(GUARD, || events.lock().unwrap().len() >= 5).await,
        "the run streams"
    );
    let t0 = Instant::now();
    assert!(w.pool.cancel(&id));
    let result = tokio::time::timeout(GUARD, task).await.unwrap().unwrap();
    let released = t0.elapsed();
    assert!(
        matches!(result, Err(PoolError::Invoke(InvokeError::Cancelled))),
        "{result:?}"
    );
    let streamed = events.lock().unwrap().len();
    let animus = w.pool.animus().clone();
    assert!(
        eventually(GUARD, || animus
            .cancel_records()
            .iter()
            .any(|c| c.invoke_id == id))
        .await,
        "the ladder ended"
    );
    let record = animus
        .cancel_records()
        .into_iter()
        .find(|c| c.invoke_id == id)
        .unwrap();
    // Late frames of the cancelled run are discarded: nothing reached the job after the caller was released.
    assert_eq!(events.lock().unwrap().len(), streamed);
    (released, record)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_cancellation_path_and_its_time() {
    let w = worker(
        "cancel",
        &[
            animus("by-request", "cancel-request", None, json!({})),
            animus("by-agent-cancel", "agent-cancel", None, json!({})),
            animus("ignores", "ignore-cancel", None, json!({})),
        ],
    );
    let mut report = Vec::new();
    for (id, path) in [
        ("by-request", CancelPath::CancelRequest),
        ("by-agent-cancel", CancelPath::AgentCancel),
        ("ignores", CancelPath::Kill),
    ] {
        let (released, record) = cancel_slow(&w, id).await;
        assert_eq!(record.path, path, "{id}");
        assert_eq!(record.reason, CancelReason::Cancelled);
        report.push(format!(
            "{id}: caller released after {released:?}; plugin side ended by {} after {:?}",
            path.as_str(),
            record.elapsed
        ));
    }
    // A plugin that honoured its cancel stays warm; the one that ignored it is gone (shutdown, exit, kill).
    assert_eq!(w.pool.animus().idle_pids(USER, "by-request").len(), 1);
    assert_eq!(w.pool.animus().idle_pids(USER, "by-agent-cancel").len(), 1);
    assert!(w.pool.animus().idle_pids(USER, "ignores").is_empty());
    assert!(eventually(GUARD, || w.pool.animus().live() == 2).await);
    for i in 0..3 {
        assert_eq!(WorkerMetrics::get(&w.metrics.animus.cancel_paths[i]), 1);
    }
    for line in report {
        println!("cancel {line}");
    }
    // The honouring processes serve the next run normally.
    assert!(run(&w, "by-request", "hi").await.unwrap().success());
    w.pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadline_takes_the_cancel_path_and_reports_a_timeout() {
    let w = worker("deadline", &[animus("prov", "provider", None, json!({}))]);
    let mut r = req("agent.run", json!({"prompt": "slow"}));
    r.timeout = Some(Duration::from_secs(1));
    let id = r.invoke_id.clone();
    let t0 = Instant::now();
    let e = invoke(&w, "prov", r).await.unwrap_err();
    let released = t0.elapsed();
    assert!(matches!(e, PoolError::Invoke(InvokeError::Timeout(_))), "{e}");
    let animus = w.pool.animus().clone();
    assert!(
        eventually(GUARD, || animus
            .cancel_records()
            .iter()
            .any(|c| c.invoke_id == id))
        .await
    );
    let record = animus
        .cancel_records()
        .into_iter()
        .find(|c| c.invoke_id == id)
        .unwrap();
    assert_eq!(record.reason, CancelReason::Deadline);
    assert_eq!(record.path, CancelPath::AgentCancel);
    println!(
        "deadline 1 s: caller answered after {released:?}; agent/cancel ended the run {:?} later",
        record.elapsed
    );
    w.pool.shutdown().await;
}

// -------------------------------------------------------------------------------------------------------------
// Liveness
// -------------------------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_missing_pings_is_recycled() {
    let w = worker(
        "ping",
        &[
            animus("deaf", "no-ping", None, json!({"ping_interval_secs": 0.2})),
            animus("fine", "provider", None, json!({"ping_interval_secs": 0.2})),
        ],
    );
    assert!(run(&w, "deaf", "hi").await.unwrap().success());
    assert!(run(&w, "fine", "hi").await.unwrap().success());
    let deaf = w.pool.animus().idle_pids(USER, "deaf");
    let fine = w.pool.animus().idle_pids(USER, "fine");
    assert_eq!(deaf.len(), 1);
    let t0 = Instant::now();
    let metrics = w.metrics.clone();
    assert!(eventually(GUARD, || WorkerMetrics::get(&metrics.animus.recycles) >= 1).await);
    let animus = w.pool.animus().clone();
    assert!(eventually(GUARD, || animus.idle_pids(USER, "deaf").is_empty()).await);
    assert!(eventually(GUARD, || !fleet_e2e::worker::alive(deaf[0])).await);
    println!(
        "ping: 3 misses (1 s timeout, 0.2 s period) recycled the deaf plugin {:?} after its first call; {} misses counted",
        t0.elapsed(),
        WorkerMetrics::get(&w.metrics.animus.ping_misses)
    );
    assert_eq!(
        w.pool.animus().health().get("deaf"),
        Some(&HealthState::Unhealthy)
    );
    // The answering plugin is untouched; the recycled one comes back fresh on the next call.
    assert_eq!(w.pool.animus().idle_pids(USER, "fine"), fine);
    assert!(run(&w, "deaf", "again").await.unwrap().success());
    assert_ne!(w.pool.animus().idle_pids(USER, "deaf"), deaf);
    w.pool.shutdown().await;
}

// -------------------------------------------------------------------------------------------------------------
// Both dialects through the fleet API
// -------------------------------------------------------------------------------------------------------------

async fn job(c: &Cluster, id: &str) -> Value {
    c.ok(USER, "tools.getJob", json!({ "jobId": id })).await
}

async fn wait_state(c: &Cluster, id: &str, done: impl Fn(&str) -> bool) -> Value {
    let deadline = Instant::now() + GUARD;
    loop {
        let j = job(c, id).await;
        if done(j["state"].as_str().unwrap_or("")) {
            return j;
        }
        assert!(Instant::now() < deadline, "job {id}: {j}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_dialects_side_by_side_through_the_fleet_api() {
    let mut c = Cluster::start("animus-fleet", 1, 0, &[]).await;
    let catalogue = write_catalogue(
        c.root.path(),
        &[
            echo("echo", None),
            animus("prov", "provider", None, json!({})),
            animus("stub", "ignore-cancel", None, json!({})),
        ],
    );
    c.add_worker_with("mixed", move |cfg| cfg.catalogue_dir = catalogue)
        .await;
    // Wait for the API and for both manifests in tools.list.
    let deadline = Instant::now() + GUARD;
    loop {
        let request = async_nats::Request::new()
            .payload("{}".into())
            .timeout(Some(GUARD));
        if c.app
            .send_request(subjects::api(methods::ALL[0]), request)
            .await
            .is_ok()
        {
            let list = c.ok(USER, "tools.list", json!({})).await;
            let ids: Vec<String> = list["tools"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| {
                    format!(
                        "{}.{}",
                        t["plugin_name"].as_str().unwrap(),
                        t["tool_name"].as_str().unwrap()
                    )
                })
                .collect();
            if [
                "echo.echo",
                "prov.agent.run",
                "prov.agent.resume",
                "stub.agent.run",
            ]
            .iter()
            .all(|t| ids.iter().any(|i| i == t))
            {
                break;
            }
        }
        assert!(Instant::now() < deadline, "tools.list never listed both dialects");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Executa and Animus jobs through the same invokeAsync / getJob.
    let ex = c
        .ok(
            USER,
            "tools.invokeAsync",
            json!({"tool_id": "echo", "method": "echo", "args": {"a": 1}}),
        )
        .await;
    let an = c
        .ok(
            USER,
            "tools.invokeAsync",
            json!({"tool_id": "prov", "method": "agent.run", "args": {"prompt": "hi"}}),
        )
        .await;
    let ex = wait_state(&c, ex["jobId"].as_str().unwrap(), |s| s == "succeeded").await;
    assert!(ex["result"].is_object());
    let an = wait_state(&c, an["jobId"].as_str().unwrap(), |s| {
        s != "queued" && s != "running"
    })
    .await;
    assert_eq!(an["state"], "succeeded", "{an}");
    assert_eq!(an["result"]["output"], "RESULT: hi");
    let events: Vec<&str> = an["progress"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["data"]["event"].as_str().unwrap())
        .collect();
    assert_eq!(
        events,
        [
            "thinking",
            "tool.call",
            "tool.result",
            "warning",
            "output.delta",
            "output.final"
        ]
    );
    assert_eq!(an["progress"][1]["type"], "tool_update");

    // A failed run and a refused argument map onto the API's codes.
    let failed = c
        .ok(
            USER,
            "tools.invokeAsync",
            json!({"tool_id": "prov", "method": "agent.run", "args": {"prompt": "fail"}}),
        )
        .await;
    let failed = wait_state(&c, failed["jobId"].as_str().unwrap(), |s| s == "failed").await;
    assert_eq!(failed["error"]["code"], ApiErrorCode::ToolFailed.as_str());
    let bad = c
        .ok(
            USER,
            "tools.invokeAsync",
            json!({"tool_id": "prov", "method": "agent.run", "args": {"prompt": "x", "cwd": "/"}}),
        )
        .await;
    let bad = wait_state(&c, bad["jobId"].as_str().unwrap(), |s| s == "failed").await;
    assert_eq!(bad["error"]["code"], ApiErrorCode::InvalidArg.as_str());
    assert_eq!(bad["error"]["details"]["dialect"], "animus");

    // cancelJob on a plugin that ignores every cancel: cancelled at once for the caller, killed behind.
    let slow = c
        .ok(
            USER,
            "tools.invokeAsync",
            json!({"tool_id": "stub", "method": "agent.run", "args": {"prompt": "slow"}}),
        )
        .await;
    let slow_id = slow["jobId"].as_str().unwrap().to_string();
    wait_state(&c, &slow_id, |s| s == "running").await;
    let deadline = Instant::now() + GUARD;
    while job(&c, &slow_id).await["progress"].as_array().unwrap().len() < 5 {
        assert!(Instant::now() < deadline, "the slow run never streamed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let t0 = Instant::now();
    let r = c.ok(USER, "tools.cancelJob", json!({"jobId": slow_id})).await;
    assert_eq!(r["state"], "cancelled");
    let seen_cancelled = t0.elapsed();
    let j = wait_state(&c, &slow_id, |s| s == "cancelled").await;
    let seq_at_cancel = j["lastSeq"].as_u64().unwrap_or(0);
    let pool = c.workers[0].node.as_ref().unwrap().pool().clone();
    assert!(
        eventually(GUARD, || pool
            .animus()
            .cancel_records()
            .iter()
            .any(|r| r.invoke_id == slow_id && r.path == CancelPath::Kill))
        .await
    );
    let record = pool
        .animus()
        .cancel_records()
        .into_iter()
        .find(|r| r.invoke_id == slow_id)
        .unwrap();
    println!(
        "fleet cancelJob: state cancelled for the caller after {seen_cancelled:?}; plugin killed {:?} after the worker's cancel",
        record.elapsed
    );
    // Terminal is final: no progress recorded after the cancel.
    let j = job(&c, &slow_id).await;
    assert_eq!(j["state"], "cancelled");
    assert_eq!(j["lastSeq"].as_u64().unwrap_or(0), seq_at_cancel);
    let _ = JobState::Cancelled;

    // Metrics labelled by dialect, and both dialects' health, as Prometheus and the operator page see them.
    let text = c.metrics.encode();
    for line in [
        "plugin_cancel_paths_total{dialect=\"animus\",path=\"kill\"} 1",
        "plugin_health{tool_id=\"prov\",dialect=\"animus\",state=\"healthy\"} 1",
    ] {
        assert!(text.contains(line), "missing {line} in\n{text}");
    }
    assert!(text.contains("plugin_spawns_by_dialect_total{dialect=\"animus\"}"));
    let health = c.metrics.plugin_health();
    assert!(
        health
            .iter()
            .any(|h| h["tool_id"] == "stub" && h["dialect"] == "animus"),
        "{health:?}"
    );
    c.shutdown().await;
}

// -------------------------------------------------------------------------------------------------------------
// `fleet up`, the real binary
// -------------------------------------------------------------------------------------------------------------

/// Kills `fleet up` (and what it started) if the test fails before its SIGINT.
struct UpGuard(Option<std::process::Child>);

impl Drop for UpGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn cli(bin: &Path, data: &Path, args: &[&str]) -> (bool, Value) {
    let out = std::process::Command::new(bin)
        .args(args)
        .arg("--data-dir")
        .arg(data)
        .stdin(std::process::Stdio::null())
        .env_remove("FLEET_NATS_URL")
        .env_remove("FLEET_DATA_DIR")
        .env_remove("FLEET_TOKEN")
        .output()
        .unwrap();
    let v = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (out.status.success(), v)
}

fn cli_wait(bin: &Path, data: &Path, job: &str, done: impl Fn(&str) -> bool) -> Value {
    let deadline = Instant::now() + GUARD;
    loop {
        let (ok, v) = cli(bin, data, &["job", "get", job, "--user", USER]);
        if ok && done(v["state"].as_str().unwrap_or("")) {
            return v;
        }
        assert!(Instant::now() < deadline, "job {job}: {v}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn both_dialects_in_one_fleet_up_through_the_cli() {
    use std::io::BufRead as _;
    // The binary must be the one of this checkout.
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let built = std::process::Command::new(cargo)
        .current_dir(workspace_root())
        .args(["build", "-p", "fleet"])
        .status()
        .unwrap();
    assert!(built.success());
    let bin = fleet_e2e::fleet_bin();
    let tmp = tempfile::tempdir().unwrap();
    let tag = format!("fleet-up-animus-{}", std::process::id());
    let catalogue = write_catalogue(
        tmp.path(),
        &[
            echo("echo", None),
            animus("prov", "provider", None, json!({})),
            animus(
                "stub",
                "ignore-cancel",
                Some("animus"),
                json!({"command": [
                "/usr/bin/python3", fixture().display().to_string(), "--mode", "ignore-cancel", "--tag", &tag]}),
            ),
        ],
    );
    let data = tmp.path().join("data");
    let http = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let mut child = std::process::Command::new(&bin)
        .args(["up", "--workers", "1", "--nats-port", "0", "--http", &http])
        .arg("--data-dir")
        .arg(&data)
        .arg("--plugins-dir")
        .arg(&catalogue)
        .env_remove("FLEET_NATS_URL")
        .env_remove("FLEET_PLUGINS_DIR")
        .env_remove("FLEET_DATA_DIR")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    let lines = Arc::new(Mutex::new(Vec::<String>::new()));
    let l = lines.clone();
    let out = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            l.lock().unwrap().push(line);
        }
    });
    let mut guard = UpGuard(Some(child));
    let deadline = Instant::now() + GUARD;
    while !lines.lock().unwrap().iter().any(|l| l.starts_with("try ")) {
        assert!(
            Instant::now() < deadline,
            "fleet up not ready: {:?}",
            lines.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(25));
    }

    // The same invoke-async / job get for both dialects.
    let (ok, ex) = cli(
        &bin,
        &data,
        &[
            "invoke-async",
            "--user",
            USER,
            "--tool-id",
            "echo",
            "--tool",
            "echo",
            "--args",
            r#"{"a":1}"#,
        ],
    );
    assert!(ok, "{ex}");
    let (ok, an) = cli(
        &bin,
        &data,
        &[
            "invoke-async",
            "--user",
            USER,
            "--tool-id",
            "prov",
            "--tool",
            "agent.run",
            "--args",
            r#"{"prompt":"hi"}"#,
        ],
    );
    assert!(ok, "{an}");
    let ex = cli_wait(&bin, &data, ex["jobId"].as_str().unwrap(), |s| s == "succeeded");
    assert!(ex["result"].is_object());
    let an = cli_wait(&bin, &data, an["jobId"].as_str().unwrap(), |s| {
        !matches!(s, "queued" | "running")
    });
    assert_eq!(an["state"], "succeeded", "{an}");
    assert_eq!(an["result"]["output"], "RESULT: hi");
    assert_eq!(an["progress"].as_array().unwrap().len(), 6);

    // job cancel: cancelled at once for the caller; the plugin that ignores it is killed behind.
    let (ok, slow) = cli(
        &bin,
        &data,
        &[
            "invoke-async",
            "--user",
            USER,
            "--tool-id",
            "stub",
            "--tool",
            "agent.run",
            "--args",
            r#"{"prompt":"slow"}"#,
        ],
    );
    assert!(ok, "{slow}");
    let slow_id = slow["jobId"].as_str().unwrap().to_string();
    cli_wait(&bin, &data, &slow_id, |s| s == "running");
    let t0 = Instant::now();
    let (ok, c) = cli(&bin, &data, &["job", "cancel", &slow_id, "--user", USER]);
    assert!(ok, "{c}");
    assert_eq!(c["state"], "cancelled");
    println!(
        "fleet up: `fleet job cancel` answered cancelled after {:?} (CLI process included)",
        t0.elapsed()
    );

    // SIGINT stops everything, Animus processes included (through their ladder).
    let status = std::process::Command::new("kill")
        .args(["-INT", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let mut child = guard.0.take().unwrap();
    let deadline = Instant::now() + GUARD;
    let exit = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "fleet up did not stop");
        std::thread::sleep(Duration::from_millis(25));
    };
    assert!(exit.success(), "{exit}");
    let left: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .filter(|c| c.contains(&tag))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_cancels_runs_and_tolerates_a_plugin_exiting_before_it_answers() {
    let w = worker(
        "shutdown",
        &[
            animus("prov", "provider", None, json!({})),
            animus("rude", "rude-exit", None, json!({})),
        ],
    );
    assert!(run(&w, "rude", "hi").await.unwrap().success());
    let (r, events) = with_progress(req("agent.run", json!({"prompt": "slow"})));
    let pool = w.pool.clone();
    let task = tokio::spawn(async move { pool.invoke(USER, "prov", r).await });
    assert!(eventually(GUARD, || events.lock().unwrap().len() >= 3).await);
    assert_eq!(w.pool.animus().live(), 2);
    let t0 = Instant::now();
    tokio::time::timeout(GUARD, w.pool.shutdown())
        .await
        .expect("shutdown returns");
    let took = t0.elapsed();
    let result = task.await.unwrap();
    assert!(
        matches!(result, Err(PoolError::Invoke(InvokeError::Cancelled))),
        "{result:?}"
    );
    let animus = w.pool.animus().clone();
    assert!(eventually(GUARD, || animus.live() == 0).await, "no process left");
    println!("shutdown with a run in flight and a plugin exiting on `shutdown`: {took:?}");
    let e = run(&w, "prov", "hi").await.unwrap_err();
    assert!(
        matches!(e, PoolError::Closed | PoolError::Invoke(InvokeError::Closed)),
        "{e}"
    );
}

/// An idle Animus process that stopped reading its stdin after flooding requests the host must answer: each
/// answer is larger than the pipe, so the writer holds one and its queue ([`WRITE_QUEUE`]) fills. The shutdown
/// still ends the process — its `shutdown` call times out instead of waiting for queue room forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_plugin_that_stopped_reading_cannot_hold_up_shutdown() {
    /// More than Linux's default pipe capacity (64 KiB): one answer fills the pipe.
    const ID_BYTES: usize = 80 * 1024;
    let w = worker(
        "deaf",
        &[animus(
            "deaf",
            "custom",
            None,
            json!({"allow_methods": ["fixture/deaf"]}),
        )],
    );
    let read = || WorkerMetrics::get(&w.metrics.frames_read);
    let before = read();
    let requests = 4 * WRITE_QUEUE;
    let out = invoke(
        &w,
        "deaf",
        req(
            "fixture/deaf",
            json!({"requests": requests, "id_bytes": ID_BYTES}),
        ),
    )
    .await
    .unwrap();
    assert_eq!(out.data().unwrap()["deaf"], true);
    // The call's answer, then one flood request per answer queued: the one being written, WRITE_QUEUE queued,
    // and the request whose answer waits for room — read only once the queue is full.
    let full = (1 + 1 + WRITE_QUEUE + 1) as u64;
    assert!(
        eventually(GUARD, || read() - before >= full).await,
        "the host read {} frames",
        read() - before
    );
    assert_eq!(w.pool.animus().live(), 1);
    tokio::time::timeout(GUARD, w.pool.shutdown())
        .await
        .expect("failure guard: the shutdown waited on a plugin that does not read");
    let animus = w.pool.animus().clone();
    assert!(eventually(GUARD, || animus.live() == 0).await, "no process left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgraded_install_is_detected_again_and_gets_fresh_processes() {
    let w = worker("upgrade", &[]);
    let versions = tempfile::tempdir().unwrap();
    let load = |v: &str| {
        let root = versions.path().join(v);
        std::fs::create_dir_all(&root).unwrap();
        let dir = write_catalogue(&root, &[animus("agent", "provider", None, json!({}))]);
        let (c, problems) = Catalogue::load(&dir, &LoadOptions::from_env()).unwrap();
        assert!(problems.is_empty());
        c.get("agent").unwrap().clone()
    };
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(versions.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    drop(w.pool.set_install(load("v1")));
    assert!(run(&w, "agent", "hi").await.unwrap().success());
    let v1 = w.pool.animus().idle_pids(USER, "agent");
    let probes = WorkerMetrics::get(&w.metrics.animus.probes);
    drop(w.pool.set_install(load("v2")));
    assert!(run(&w, "agent", "hi").await.unwrap().success());
    assert_eq!(
        WorkerMetrics::get(&w.metrics.animus.probes),
        probes + 1,
        "v2 detected once"
    );
    let v2 = w.pool.animus().idle_pids(USER, "agent");
    assert_eq!(v2.len(), 1);
    assert!(!v1.contains(&v2[0]), "the v1 process is not reused for v2");
    assert!(
        eventually(GUARD, || !fleet_e2e::worker::alive(v1[0])).await,
        "the v1 process ends"
    );
    w.pool.shutdown().await;
}

/// A call cancelled while its plugin process is still starting (the handshake not answered yet): the process it
/// made ends — no call holds it and it is in no idle list — and gives its user's slot back (before, it lived on
/// and kept the slot: `max_sessions_per_user` such cancels and the user could run nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_cancelled_during_its_cold_start_ends_the_process_it_started() {
    let command = json!([
        "/usr/bin/python3",
        fixture().display().to_string(),
        "--mode",
        "provider",
        "--init-delay-ms",
        "30000"
    ]);
    let w = worker(
        "coldcancel",
        &[animus(
            "slowstart",
            "provider",
            None,
            json!({ "command": command }),
        )],
    );
    let r = req("agent.run", json!({"prompt": "hello"}));
    let id = r.invoke_id.clone();
    let pool = w.pool.clone();
    let task = tokio::spawn(async move { pool.invoke(USER, "slowstart", r).await });
    let animus = w.pool.animus().clone();
    assert!(
        eventually(GUARD, || animus.live() == 1 && animus.has_invoke(&id)).await,
        "the cold start spawned its process"
    );
    assert!(w.pool.cancel(&id));
    let result = tokio::time::timeout(GUARD, task).await.unwrap().unwrap();
    assert!(
        matches!(result, Err(PoolError::Invoke(InvokeError::Cancelled))),
        "{result:?}"
    );
    assert!(
        eventually(GUARD, || animus.live() == 0).await,
        "the half-started process ended and its slot is free"
    );
    w.pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_run_in_flight_per_provider_process() {
    let w = worker("one", &[animus("prov", "agent-cancel", None, json!({}))]);
    let mut ids = Vec::new();
    let mut tasks = Vec::new();
    let mut streams = Vec::new();
    for _ in 0..2 {
        let (r, events) = with_progress(req("agent.run", json!({"prompt": "slow"})));
        ids.push(r.invoke_id.clone());
        streams.push(events);
        let pool = w.pool.clone();
        tasks.push(tokio::spawn(async move { pool.invoke(USER, "prov", r).await }));
    }
    assert!(eventually(GUARD, || streams.iter().all(|e| e.lock().unwrap().len() >= 3)).await);
    // Two runs of one user on one provider: two processes, each run's events only in its own job.
    assert_eq!(w.pool.animus().live(), 2);
    let sessions: Vec<std::collections::BTreeSet<String>> = streams
        .iter()
        .map(|e| {
            e.lock()
                .unwrap()
                .iter()
                .filter_map(|u| {
                    let v: Value = serde_json::from_str(u.data.get()).unwrap();
                    v["params"]["session_id"].as_str().map(String::from)
                })
                .collect()
        })
        .collect();
    assert_eq!(sessions[0].len(), 1);
    assert_eq!(sessions[1].len(), 1);
    assert_ne!(sessions[0], sessions[1]);
    for id in &ids {
        assert!(w.pool.cancel(id));
    }
    for t in tasks {
        let r = t.await.unwrap();
        assert!(
            matches!(r, Err(PoolError::Invoke(InvokeError::Cancelled))),
            "{r:?}"
        );
    }
    w.pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_check_states_and_an_unhealthy_idle_process_is_recycled() {
    let cmd = |health: &str| {
        json!({"ping_interval_secs": 0.1, "command": [
            "/usr/bin/python3", fixture().display().to_string(), "--mode", "provider", "--health", health]})
    };
    let w = worker(
        "health",
        &[
            animus("sick", "provider", None, cmd("unhealthy")),
            animus("tired", "provider", None, cmd("degraded")),
        ],
    );
    assert!(run(&w, "sick", "hi").await.unwrap().success());
    assert!(run(&w, "tired", "hi").await.unwrap().success());
    let health = w.pool.animus().health();
    assert_eq!(health.get("sick"), Some(&HealthState::Unhealthy));
    assert_eq!(health.get("tired"), Some(&HealthState::Degraded));
    let sick = w.pool.animus().idle_pids(USER, "sick");
    let tired = w.pool.animus().idle_pids(USER, "tired");
    let metrics = w.metrics.clone();
    assert!(eventually(GUARD, || WorkerMetrics::get(&metrics.animus.recycles) >= 1).await);
    assert!(
        eventually(GUARD, || !fleet_e2e::worker::alive(sick[0])).await,
        "unhealthy: recycled"
    );
    // Degraded keeps serving (the same process), and the unhealthy plugin is started afresh on demand.
    assert_eq!(w.pool.animus().idle_pids(USER, "tired"), tired);
    assert!(run(&w, "tired", "again").await.unwrap().success());
    assert!(run(&w, "sick", "again").await.unwrap().success());
    w.pool.shutdown().await;
}
