//! The worker's Executa lifecycle against real plugin processes (the fixture plugin) in real cgroups:
//! handshake and v1 fallback, describe, timeouts, concurrency, crashes and restarts, shutdown, reverse-RPC
//! routing, progress, cancel, file transport, credentials and tokens.
#![allow(clippy::unwrap_used, clippy::cast_possible_truncation)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fleet_e2e::worker::{Plugin, TestWorker, alive, call, data, eventually, req, test_config};
use fleet_proto::codec::io::WRITE_QUEUE;
use fleet_proto::executa::invoke::ProgressType;
use fleet_proto::executa::lifecycle::ProtocolVersion;
use fleet_worker::metrics::{ProgressDrop, WorkerMetrics};
use fleet_worker::services::{
    HostServices, InvokeTokens, ReverseCall, ServiceFuture, TokenFuture, TokenRequest, TokenSource,
};
use fleet_worker::session::progress::{ProgressSink, ProgressUpdate};
use fleet_worker::session::{InvokeError, InvokeRequest, SessionState};
use serde_json::{Value, json};

/// Failure guard only.
const GUARD: Duration = Duration::from_secs(60);

async fn pid_of(w: &TestWorker, user: &str, tool_id: &str) -> u32 {
    data(w, user, tool_id, "inspect", json!({})).await["pid"]
        .as_u64()
        .unwrap() as u32
}

// ---------------------------------------------------------------------------------------------------------------
// Handshake
// ---------------------------------------------------------------------------------------------------------------

#[tokio::test]
async fn v2_handshake_and_the_manifest_is_cached_for_the_process_life() {
    let w = TestWorker::start(test_config("v2"), &[Plugin::echo("echo", &[])]);
    let s = w.pool.prewarm("alice", "echo", GUARD).await.unwrap();
    assert_eq!(s.state(), SessionState::Ready);
    assert_eq!(s.protocol(), Some(ProtocolVersion::V2));
    assert_eq!(
        s.negotiated().unwrap().into_iter().collect::<Vec<_>>(),
        ["sampling", "storage"]
    );
    assert!(s.manifest().unwrap().tool("echo").is_some());
    for _ in 0..3 {
        data(&w, "alice", "echo", "echo", json!({"x": 1})).await;
    }
    let info = data(&w, "alice", "echo", "inspect", json!({})).await;
    assert_eq!(
        (info["initialize_calls"].as_u64(), info["describe_calls"].as_u64()),
        (Some(1), Some(1))
    );
    assert!(info["context"]["invoke_id"].as_str().unwrap().starts_with("inv-"));
    assert!(info["context"]["deadline_ms"].as_u64().unwrap() > 1_700_000_000_000);
    w.pool.shutdown().await;
}

/// `describe` is written right behind `initialize` (one round trip): a plugin that answers `initialize` only once
/// `describe` has arrived still negotiates v2. A host that waited for the answer first would time `initialize`
/// out after 5 s and fall back to v1.
#[tokio::test]
async fn describe_is_written_behind_initialize_without_waiting_for_its_answer() {
    let w = TestWorker::start(
        test_config("pipelined"),
        &[Plugin::echo("echo", &["--initialize", "after-describe"])],
    );
    let s = w.pool.prewarm("alice", "echo", GUARD).await.unwrap();
    assert_eq!(s.protocol(), Some(ProtocolVersion::V2));
    assert_eq!(WorkerMetrics::get(&w.metrics.v1_fallbacks), 0);
    let info = data(&w, "alice", "echo", "inspect", json!({})).await;
    assert_eq!(
        (info["initialize_calls"].as_u64(), info["describe_calls"].as_u64()),
        (Some(1), Some(1))
    );
    w.pool.shutdown().await;
}

async fn assert_v1(flags: &[&str], name: &str) {
    let w = TestWorker::start(test_config(name), &[Plugin::echo("echo", flags)]);
    let s = w.pool.prewarm("alice", "echo", GUARD).await.unwrap();
    assert_eq!(s.protocol(), Some(ProtocolVersion::V1), "{flags:?}");
    assert!(s.negotiated().unwrap().is_empty());
    assert_eq!(
        data(&w, "alice", "echo", "echo", json!({"v": 1})).await["arguments"]["v"],
        1
    );
    assert_eq!(WorkerMetrics::get(&w.metrics.v1_fallbacks), 1);
    w.pool.shutdown().await;
}

#[tokio::test]
async fn v1_fallback_when_initialize_is_method_not_found() {
    assert_v1(&["--initialize", "method-not-found"], "v1mnf").await;
}

#[tokio::test]
async fn v1_fallback_when_initialize_answers_another_error() {
    assert_v1(&["--initialize", "error"], "v1err").await;
}

#[tokio::test]
async fn v1_fallback_when_initialize_times_out() {
    // The plugin never answers initialize: the worker waits the spec's 5 s, then downgrades.
    assert_v1(&["--initialize", "hang"], "v1hang").await;
}

#[tokio::test]
async fn v1_when_the_plugin_echoes_another_version() {
    assert_v1(&["--initialize", "v1-version"], "v1ver").await;
}

#[tokio::test]
async fn describe_timeout_is_5s_for_a_known_install_and_60s_on_first_launch() {
    let mut config = test_config("describe");
    config.max_restarts = 0;
    let w = TestWorker::start(
        config,
        &[
            Plugin::echo("known", &["--describe-delay-ms", "6000"]),
            Plugin::echo("fresh", &["--describe-delay-ms", "6000"]).first_launch(),
        ],
    );
    match call(&w, "alice", "known", req("echo", json!({}))).await {
        Err(InvokeError::Stopped(msg)) => assert!(msg.contains("describe timed out after 5s"), "{msg}"),
        other => panic!("expected Stopped by the describe timeout, got {other:?}"),
    }
    // First launch of a new install: 60 s, so the 6 s describe succeeds, and the install is marked described.
    data(&w, "alice", "fresh", "echo", json!({})).await;
    assert!(w.config.catalogue_dir.join("fresh/.fleet-described").exists());
    w.pool.shutdown().await;
}

#[tokio::test]
async fn an_invalid_manifest_stops_the_session_with_its_path() {
    let w = TestWorker::start(
        test_config("badmanifest"),
        &[Plugin::echo("echo", &["--describe-mode", "wrapped"])],
    );
    match call(&w, "alice", "echo", req("echo", json!({}))).await {
        Err(InvokeError::Stopped(msg)) => assert!(msg.contains("$.manifest"), "{msg}"),
        other => panic!("expected Stopped, got {other:?}"),
    }
    w.pool.shutdown().await;
}

// ---------------------------------------------------------------------------------------------------------------
// Invokes
// ---------------------------------------------------------------------------------------------------------------

#[tokio::test]
async fn results_failures_and_errors() {
    let w = TestWorker::start(test_config("results"), &[Plugin::echo("echo", &[])]);
    let out = call(&w, "u", "echo", req("fail", json!({"message": "city not found"})))
        .await
        .unwrap();
    assert!(!out.success());
    assert_eq!(out.error_message(), Some("city not found"));
    match call(
        &w,
        "u",
        "echo",
        req("rpc_error", json!({"code": -32000, "message": "boom"})),
    )
    .await
    {
        Err(InvokeError::Plugin(e)) => assert_eq!((e.code, e.message.as_str()), (-32000, "boom")),
        other => panic!("expected a plugin error, got {other:?}"),
    }
    match call(&w, "u", "echo", req("nope", json!({}))).await {
        Err(InvokeError::UnknownTool { tool, available }) => {
            assert_eq!(tool, "nope");
            assert!(available.contains(&"echo".to_string()));
        }
        other => panic!("expected UnknownTool, got {other:?}"),
    }
    w.pool.shutdown().await;
}

#[tokio::test]
async fn per_tool_timeout_from_the_manifest() {
    let w = TestWorker::start(
        test_config("tooltimeout"),
        &[Plugin::echo("echo", &["--tool-timeout-s", "1"])],
    );
    let pid = pid_of(&w, "u", "echo").await;
    match call(&w, "u", "echo", req("timed_sleep", json!({"ms": 30_000}))).await {
        Err(InvokeError::Timeout(d)) => assert_eq!(d, Duration::from_secs(1)),
        other => panic!("expected the declared 1 s timeout, got {other:?}"),
    }
    // Still busy 500 ms later: the process tree is killed; the next call gets a fresh process.
    assert!(eventually(GUARD, || !alive(pid)).await);
    assert_ne!(pid_of(&w, "u", "echo").await, pid);
    assert_eq!(WorkerMetrics::get(&w.metrics.invokes_timed_out), 1);
    w.pool.shutdown().await;
}

#[tokio::test]
async fn a_hundred_concurrent_invokes_without_head_of_line_blocking() {
    let mut config = test_config("hundred");
    config.max_in_flight_per_session = 128;
    // The fixture serves each invoke on its own thread: give it room for 100 (the default pids.max is 64).
    let plugin = Plugin::echo("echo", &[]).limits(json!({"pids_max": 256}));
    let w = Arc::new(TestWorker::start(config, &[plugin]));
    w.pool.prewarm("u", "echo", GUARD).await.unwrap();
    let order = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for i in 0..100u64 {
        let (w, order) = (w.clone(), order.clone());
        // Invoke 0 is the slow one (3 s), sent first; the others take 0–49 ms.
        let ms = if i == 0 { 3000 } else { i % 50 };
        tasks.push(tokio::spawn(async move {
            let out = call(&w, "u", "echo", req("sleep", json!({"ms": ms})))
                .await
                .unwrap();
            assert!(out.success());
            (i, order.fetch_add(1, Ordering::SeqCst))
        }));
    }
    let mut finished = Vec::new();
    for t in tasks {
        finished.push(t.await.unwrap());
    }
    let slow_rank = finished.iter().find(|(i, _)| *i == 0).unwrap().1;
    assert_eq!(
        slow_rank, 99,
        "the 3 s invoke finishes last; no short one waited for it"
    );
    w.pool.shutdown().await;
}

#[tokio::test]
async fn in_flight_bound_per_session() {
    let mut config = test_config("inflight");
    config.max_in_flight_per_session = 2;
    let w = Arc::new(TestWorker::start(config, &[Plugin::echo("echo", &[])]));
    let s = w.pool.prewarm("u", "echo", GUARD).await.unwrap();
    let (a, b) = (
        req("sleep", json!({"ms": 60_000})),
        req("sleep", json!({"ms": 60_000})),
    );
    let (ida, idb) = (a.invoke_id.clone(), b.invoke_id.clone());
    let wa = w.clone();
    let ta = tokio::spawn(async move { call(&wa, "u", "echo", a).await });
    let wb = w.clone();
    let tb = tokio::spawn(async move { call(&wb, "u", "echo", b).await });
    assert!(eventually(GUARD, || s.has_invoke(&ida) && s.has_invoke(&idb)).await);
    match call(&w, "u", "echo", req("echo", json!({}))).await {
        Err(InvokeError::TooManyInFlight { limit }) => assert_eq!(limit, 2),
        other => panic!("expected TooManyInFlight, got {other:?}"),
    }
    assert!(w.pool.cancel(&ida) && w.pool.cancel(&idb));
    assert!(matches!(ta.await.unwrap(), Err(InvokeError::Cancelled)));
    assert!(matches!(tb.await.unwrap(), Err(InvokeError::Cancelled)));
    w.pool.shutdown().await;
}

/// A call resolves its plugin once (`Pool::target`) and runs on what it resolved (`Pool::run`). A session closed
/// between the two (evicted, or shut down) hands the request back untouched, and it runs on a fresh session: the
/// caller never needed a copy of its arguments.
#[tokio::test]
async fn a_session_closed_between_lookup_and_use_hands_the_request_to_a_fresh_one() {
    let w = TestWorker::start(test_config("reclaim"), &[Plugin::echo("echo", &[])]);
    let first = pid_of(&w, "u", "echo").await;
    let target = w.pool.target("u", "echo").await.unwrap();
    let fleet_worker::pool::Target::Executa(session) = &target else {
        panic!("the echo fixture speaks Executa");
    };
    session.shutdown().await;
    assert_eq!(session.state(), SessionState::Closed);
    assert!(eventually(GUARD, || !alive(first)).await);
    let args = json!({"text": "ünïcode", "n": [1, 2, 3], "nested": {"deep": true}});
    let out = tokio::time::timeout(GUARD, w.pool.run("u", "echo", target, req("echo", args.clone())))
        .await
        .expect("failure guard")
        .unwrap();
    assert!(out.success());
    assert_eq!(out.data().unwrap()["arguments"], args);
    // It ran on a new session of the pool (a new process), which later calls use.
    let second = pid_of(&w, "u", "echo").await;
    assert_ne!(second, first);
    assert_eq!(w.pool.session("u", "echo").unwrap().state(), SessionState::Ready);
    w.pool.shutdown().await;
}

// ---------------------------------------------------------------------------------------------------------------
// Crashes and restarts
// ---------------------------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_crash_fails_the_invoke_at_once_and_the_next_call_restarts_the_process() {
    let w = Arc::new(TestWorker::start(
        test_config("crash"),
        &[Plugin::echo("echo", &[])],
    ));
    let s = w.pool.prewarm("u", "echo", GUARD).await.unwrap();
    let pid = s.pid().unwrap();
    let long = req("sleep", json!({"ms": 600_000}));
    let long_id = long.invoke_id.clone();
    let wl = w.clone();
    let pending = tokio::spawn(async move { call(&wl, "u", "echo", long).await });
    assert!(eventually(GUARD, || s.has_invoke(&long_id)).await);
    let crash = call(&w, "u", "echo", req("crash", json!({"exit_code": 3}))).await;
    // Both invokes in flight on the dead process fail now, with the exit, not at their timeouts.
    for r in [crash, pending.await.unwrap()] {
        match r {
            Err(InvokeError::ProcessExited { exit, .. }) => {
                assert_eq!(exit.status, "exit status: 3");
                assert!(!exit.oom && !exit.host_initiated);
            }
            other => panic!("expected ProcessExited, got {other:?}"),
        }
    }
    let new_pid = pid_of(&w, "u", "echo").await;
    assert_ne!(new_pid, pid);
    assert_eq!(WorkerMetrics::get(&w.metrics.restarts), 1);
    w.pool.shutdown().await;
}

#[tokio::test]
async fn the_fourth_crash_in_a_row_leaves_the_session_stopped() {
    let w = TestWorker::start(test_config("crashloop"), &[Plugin::echo("echo", &[])]);
    for n in 1..=4 {
        match call(&w, "u", "echo", req("crash", json!({"exit_code": 42}))).await {
            Err(InvokeError::ProcessExited { .. }) => {}
            other => panic!("crash {n}: expected ProcessExited, got {other:?}"),
        }
    }
    match call(&w, "u", "echo", req("echo", json!({}))).await {
        Err(InvokeError::Stopped(msg)) => {
            assert!(msg.contains("stopped after 4 failures in a row"), "{msg}");
            assert!(msg.contains("exit status: 42"), "{msg}");
        }
        other => panic!("expected Stopped, got {other:?}"),
    }
    assert!(matches!(
        w.pool.session("u", "echo").unwrap().state(),
        SessionState::Stopped(_)
    ));
    assert_eq!(WorkerMetrics::get(&w.metrics.restarts), 3);
    assert_eq!(WorkerMetrics::get(&w.metrics.stopped), 1);
    // An operator reset brings it back.
    w.pool.session("u", "echo").unwrap().reset();
    data(&w, "u", "echo", "echo", json!({})).await;
    w.pool.shutdown().await;
}

#[tokio::test]
async fn a_plugin_ignoring_eof_and_sigterm_is_killed_on_schedule() {
    let mut config = test_config("ladder");
    config.shutdown_grace = Duration::from_millis(500);
    let w = TestWorker::start(
        config,
        &[Plugin::echo("echo", &["--ignore-eof", "--ignore-sigterm"])],
    );
    let s = w.pool.prewarm("u", "echo", GUARD).await.unwrap();
    let pid = s.pid().unwrap();
    w.pool.shutdown().await;
    assert!(!alive(pid));
    let log = s.stderr_lines().join("\n");
    let eof = log.find("stdin EOF ignored").expect("stdin was closed first");
    let term = log.find("SIGTERM ignored").expect("then SIGTERM was sent");
    assert!(eof < term, "{log}");
    assert_eq!(s.state(), SessionState::Closed);
    assert!(
        WorkerMetrics::get(&w.metrics.tree_kills) >= 1,
        "SIGKILL was the last step"
    );
}

/// The flood in flight of a plugin that stopped reading its stdin.
type Flood = tokio::task::JoinHandle<Result<fleet_worker::session::InvokeOutput, InvokeError>>;

/// A worker whose session of `echo` (user `u`) stopped reading its stdin after flooding reverse-RPC requests the
/// host must answer: returned once the answers filled the pipe and then the writer's queue ([`WRITE_QUEUE`]
/// frames); the flood's call is still in flight.
async fn deaf_plugin(name: &str) -> (Arc<TestWorker>, fleet_worker::session::Session, Flood) {
    /// Linux's default pipe capacity.
    const PIPE_BYTES: usize = 64 * 1024;
    /// Each answer echoes a request id this long, so the pipe holds fewer than `PIPE_BYTES / ID_BYTES` of them.
    const ID_BYTES: usize = 2048;
    let mut config = test_config(name);
    config.shutdown_grace = Duration::from_millis(500);
    let w = Arc::new(TestWorker::start(config, &[Plugin::echo("echo", &[])]));
    let s = w.pool.prewarm("u", "echo", GUARD).await.unwrap();
    let before = WorkerMetrics::get(&w.metrics.reverse_refused);
    // More answers than the pipe, the one frame being written and the queue can hold.
    let full = (PIPE_BYTES / ID_BYTES + 1 + WRITE_QUEUE) as u64;
    let args = json!({"requests": 4 * full, "id_bytes": ID_BYTES, "stop_reading": true});
    let flooding = w.clone();
    let flood = tokio::spawn(async move { call(&flooding, "u", "echo", req("flood", args)).await });
    assert!(
        eventually(GUARD, || WorkerMetrics::get(&w.metrics.reverse_refused) - before
            > full)
        .await,
        "the host answered more requests than its pipe and queue can hold"
    );
    (w, s, flood)
}

/// Shuts the pool of a [`deaf_plugin`] down and waits for its flood's call to end (each within [`GUARD`]): the
/// call's outcome depends on whether its answer was read before the host's reader blocked; it ends either way.
async fn stop_deaf(w: &TestWorker, flood: Flood) {
    tokio::time::timeout(GUARD, w.pool.shutdown())
        .await
        .expect("failure guard: the shutdown waited on a plugin that does not read");
    let _outcome = tokio::time::timeout(GUARD, flood)
        .await
        .expect("failure guard: the flood's call outlived the shutdown")
        .unwrap();
}

/// A plugin that stops reading its stdin and floods reverse-RPC requests the host must answer: the answers fill
/// the pipe and then the writer's queue ([`WRITE_QUEUE`] frames), and the shutdown ladder still ends the plugin
/// (closing stdin never waits for queue space; before, it waited forever).
#[tokio::test]
async fn a_plugin_that_stops_reading_its_stdin_cannot_hold_up_shutdown() {
    let (w, s, flood) = deaf_plugin("deaf").await;
    let pid = s.pid().unwrap();
    stop_deaf(&w, flood).await;
    assert!(!alive(pid));
    assert!(
        s.stderr_lines()
            .iter()
            .any(|l| l.contains("stopped reading stdin"))
    );
}

/// A plugin that stopped reading its stdin (the pipe and the writer's queue full, as above) cannot hold an invoke
/// past its timeout or its cancel: its request cannot even be queued, and the invoke ends `Timeout` at its time
/// and `Cancelled` on its cancel (before, both waited for queue space for good, and so did a drain).
#[tokio::test]
async fn an_invoke_to_a_plugin_that_stopped_reading_ends_on_its_timeout_and_its_cancel() {
    let (w, s, flood) = deaf_plugin("deaf-invoke").await;

    let mut timed = req("echo", json!({}));
    timed.timeout = Some(Duration::from_millis(300));
    match call(&w, "u", "echo", timed).await {
        Err(InvokeError::Timeout(d)) => assert_eq!(d, Duration::from_millis(300)),
        other => panic!("expected the invoke's timeout, got {other:?}"),
    }

    let cancelled = req("echo", json!({}));
    let id = cancelled.invoke_id.clone();
    let calling = w.clone();
    let call_task = tokio::spawn(async move { call(&calling, "u", "echo", cancelled).await });
    assert!(
        eventually(GUARD, || s.has_invoke(&id)).await,
        "the invoke is registered"
    );
    assert!(w.pool.cancel(&id));
    assert!(matches!(
        tokio::time::timeout(GUARD, call_task)
            .await
            .expect("failure guard: the cancelled invoke still waits")
            .unwrap(),
        Err(InvokeError::Cancelled)
    ));

    stop_deaf(&w, flood).await;
}

/// A shutdown while the plugin is still starting (its `describe` not answered yet; a first launch may take
/// `DESCRIBE_TIMEOUT_FIRST_LAUNCH`, 60 s) does not wait for the start: the process, which never served, is
/// killed (it ignores stdin EOF and SIGTERM, so nothing else would end it). The shutdown's failure guard is half
/// the describe timeout the start would otherwise have been given.
#[tokio::test]
async fn a_shutdown_during_the_start_kills_the_starting_plugin_at_once() {
    let w = Arc::new(TestWorker::start(
        test_config("startstop"),
        &[Plugin::echo(
            "echo",
            &[
                "--stderr-banner",
                "starting",
                "--describe-delay-ms",
                "120000",
                "--ignore-eof",
                "--ignore-sigterm",
            ],
        )
        .first_launch()],
    ));
    const STOP_GUARD: Duration = Duration::from_secs(30);
    assert!(STOP_GUARD < fleet_proto::limits::DESCRIBE_TIMEOUT_FIRST_LAUNCH);
    let warming = w.clone();
    let prewarm =
        tokio::spawn(async move { warming.pool.prewarm("u", "echo", STOP_GUARD).await.map(|_| ()) });
    assert!(
        eventually(GUARD, || w
            .pool
            .session("u", "echo")
            .is_ok_and(|s| s.stderr_lines().iter().any(|l| l.contains("starting"))))
        .await,
        "the plugin runs and waits in its describe"
    );
    let s = w.pool.session("u", "echo").unwrap();
    let kills = WorkerMetrics::get(&w.metrics.tree_kills);
    tokio::time::timeout(STOP_GUARD, w.pool.shutdown())
        .await
        .expect("failure guard: the shutdown waited for the plugin's start");
    assert_eq!(s.state(), SessionState::Closed);
    assert!(
        WorkerMetrics::get(&w.metrics.tree_kills) > kills,
        "the starting plugin was killed"
    );
    assert!(
        prewarm.await.unwrap().is_err(),
        "the prewarm saw the session close"
    );
}

/// A session taken out of the pool (evicted for room: the least recently used idle one) and still in its
/// shutdown ladder when the pool shuts down is waited for like the ones in the pool (before, the pool's shutdown
/// returned with it still running: it was in no list the shutdown looked at). The plugin ignores stdin EOF and
/// SIGTERM, so its ladder runs to SIGKILL.
#[tokio::test]
async fn a_pool_shutdown_waits_for_the_sessions_it_evicted() {
    let mut config = test_config("evicting");
    config.max_sessions = 1;
    config.shutdown_grace = Duration::from_millis(300);
    let w = TestWorker::start(
        config,
        &[Plugin::echo("echo", &["--ignore-eof", "--ignore-sigterm"])],
    );
    let s = w.pool.prewarm("u", "echo", GUARD).await.unwrap();
    let pid = s.pid().unwrap();
    // Another user's session takes the only room: `u`'s idle one leaves the pool, its ladder runs behind.
    let evictions = WorkerMetrics::get(&w.metrics.evictions);
    let v = w.pool.session("v", "echo").unwrap();
    assert_eq!(WorkerMetrics::get(&w.metrics.evictions), evictions + 1);
    assert!(w.pool.sessions().iter().all(|x| x.user() == "v"));
    tokio::time::timeout(GUARD, w.pool.shutdown())
        .await
        .expect("failure guard: the pool's shutdown");
    assert!(
        s.finished(),
        "the evicted session had ended when the pool's shutdown returned"
    );
    assert!(!alive(pid));
    assert!(v.finished());
}

#[tokio::test]
async fn a_well_behaved_plugin_exits_on_stdin_eof() {
    let w = TestWorker::start(test_config("cleanexit"), &[Plugin::echo("echo", &[])]);
    let s = w.pool.prewarm("u", "echo", GUARD).await.unwrap();
    let pid = s.pid().unwrap();
    w.pool.shutdown().await;
    assert!(!alive(pid));
    assert_eq!(
        WorkerMetrics::get(&w.metrics.tree_kills),
        0,
        "no signal was needed"
    );
}

// ---------------------------------------------------------------------------------------------------------------
// Hostile output
// ---------------------------------------------------------------------------------------------------------------

#[tokio::test]
async fn junk_on_stdout_is_tolerated_and_counted() {
    let w = TestWorker::start(
        test_config("junk"),
        &[Plugin::echo("echo", &["--stdout-banner", "Starting..."])],
    );
    assert_eq!(
        data(&w, "u", "echo", "junk", json!({"lines": 10})).await["junk_lines"],
        10
    );
    for kind in ["invalid_json", "not_an_object", "not_json_rpc", "invalid_utf8"] {
        assert!(w.metrics.frame_errors(kind) >= 1, "{kind}");
    }
    data(&w, "u", "echo", "echo", json!({})).await;
    w.pool.shutdown().await;
}

#[tokio::test]
async fn stdout_and_stderr_floods_do_not_stop_the_plugin() {
    let mut config = test_config("flood");
    config.stderr_ring_bytes = 16 * 1024;
    let w = TestWorker::start(config, &[Plugin::echo("echo", &[])]);
    let d = data(
        &w,
        "u",
        "echo",
        "flood",
        json!({"stdout_bytes": 32 << 20, "stderr_bytes": 8 << 20}),
    )
    .await;
    assert!(d.is_object());
    data(&w, "u", "echo", "echo", json!({})).await;
    let s = w.pool.session("u", "echo").unwrap();
    let kept: usize = s.stderr_lines().iter().map(String::len).sum();
    assert!(kept <= 16 * 1024, "the stderr ring stays bounded: {kept}");
    w.pool.shutdown().await;
}

#[tokio::test]
async fn an_oversized_answer_fails_its_invoke_at_once_and_the_session_goes_on() {
    let w = TestWorker::start(test_config("toolarge"), &[Plugin::echo("echo", &[])]);
    match call(&w, "u", "echo", req("big_result", json!({"bytes": 17 << 20}))).await {
        Err(InvokeError::FrameTooLarge {
            frame_bytes,
            max_frame_bytes,
        }) => {
            assert!(frame_bytes > 16 << 20);
            assert_eq!(max_frame_bytes, 16 << 20);
        }
        other => panic!("expected FrameTooLarge, got {other:?}"),
    }
    data(&w, "u", "echo", "echo", json!({})).await;
    w.pool.shutdown().await;
}

// ---------------------------------------------------------------------------------------------------------------
// File transport
// ---------------------------------------------------------------------------------------------------------------

#[tokio::test]
async fn file_transport_inside_tmpdir_is_read_and_deleted() {
    let w = TestWorker::start(test_config("ftin"), &[Plugin::echo("echo", &[])]);
    let d = data(
        &w,
        "u",
        "echo",
        "big_result",
        json!({"bytes": 1 << 20, "via_file": true}),
    )
    .await;
    assert_eq!(d["blob"].as_str().unwrap().len(), 1 << 20);
    let (_, tmpdir) = w.pool.session("u", "echo").unwrap().dirs();
    assert_eq!(
        std::fs::read_dir(&tmpdir).unwrap().count(),
        0,
        "the transport file was deleted"
    );
    assert_eq!(WorkerMetrics::get(&w.metrics.file_transports), 1);
    w.pool.shutdown().await;
}

#[tokio::test]
async fn file_transport_outside_tmpdir_is_refused_and_the_file_left_alone() {
    let w = TestWorker::start(test_config("ftout"), &[Plugin::echo("echo", &[])]);
    // A path the plugin can write (its own workspace) but that is not its TMPDIR.
    let (workspace, _) = w.pool.session("u", "echo").unwrap().dirs();
    let outside = workspace.join("answer.json");
    let r = call(
        &w,
        "u",
        "echo",
        req(
            "big_result",
            json!({"bytes": 10, "via_file": true, "file_path": outside}),
        ),
    )
    .await;
    match r {
        Err(InvokeError::FileTransport(reason)) => assert!(reason.contains("outside"), "{reason}"),
        other => panic!("expected FileTransport, got {other:?}"),
    }
    assert!(outside.exists(), "never deletes outside TMPDIR");
    assert_eq!(WorkerMetrics::get(&w.metrics.file_transport_refused), 1);
    w.pool.shutdown().await;
}

/// Hostile pointers: whatever sits in the TMPDIR (a link to a secret, a parent directory swapped for a link, a
/// FIFO, a device, an oversized file, a file that is not a frame), the call ends at once with a file-transport error that carries neither the
/// path nor a byte of any file, nothing outside the TMPDIR is touched, and the session serves the next call.
#[tokio::test]
async fn hostile_file_transport_pointers_are_refused_at_once_and_the_session_goes_on() {
    let w = TestWorker::start(test_config("fthostile"), &[Plugin::echo("echo", &[])]);
    let (workspace, tmpdir) = w.pool.session("u", "echo").unwrap().dirs();
    let secrets = workspace.join("secrets");
    std::fs::create_dir_all(&secrets).unwrap();
    std::fs::write(secrets.join("key"), b"SECRET-BYTES").unwrap();
    std::os::unix::fs::symlink(secrets.join("key"), tmpdir.join("link.json")).unwrap();
    std::os::unix::fs::symlink(&secrets, tmpdir.join("parent")).unwrap();
    let fifo = tmpdir.join("fifo");
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &fifo,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    let junk = tmpdir.join("junk.json");
    std::fs::write(&junk, b"SECRET-JUNK, not a frame").unwrap();
    let big = tmpdir.join("big.json");
    std::fs::write(
        &big,
        vec![b'{'; fleet_proto::limits::MAX_FILE_TRANSPORT_BYTES + 1],
    )
    .unwrap();
    // (pointer, what the error says, whether the pointer's own entry is removed: a parent is never touched).
    let mut cases = vec![
        (tmpdir.join("link.json"), "symbolic link", true),
        (tmpdir.join("parent/key"), "symbolic link", false),
        (fifo, "not a regular file", true),
        (big, "over", true),
        (junk, "not a JSON-RPC frame (invalid_json)", true),
        (tmpdir.join("missing.json"), "does not exist", true),
    ];
    // A character device (the null device's numbers): only root may make one, as the suite runs.
    let device = tmpdir.join("device");
    if rustix::fs::mknodat(
        rustix::fs::CWD,
        &device,
        rustix::fs::FileType::CharacterDevice,
        rustix::fs::Mode::from_raw_mode(0o600),
        rustix::fs::makedev(1, 3),
    )
    .is_ok()
    {
        cases.push((device, "not a regular file", true));
    }
    for (path, want, removed) in &cases {
        let r = call(
            &w,
            "u",
            "echo",
            req(
                "big_result",
                json!({"bytes": 1, "via_file": true, "pointer_only": true, "file_path": path}),
            ),
        )
        .await;
        match r {
            Err(InvokeError::FileTransport(reason)) => {
                assert!(reason.contains(want), "{}: {reason}", path.display());
                assert!(
                    !reason.contains("SECRET") && !reason.contains(tmpdir.to_str().unwrap()),
                    "neither bytes nor the path: {reason}"
                );
            }
            other => panic!("{}: expected FileTransport, got {other:?}", path.display()),
        }
        if *removed {
            assert!(
                std::fs::symlink_metadata(path).is_err(),
                "{}: the pointer's entry is removed",
                path.display()
            );
        }
    }
    assert_eq!(std::fs::read(secrets.join("key")).unwrap(), b"SECRET-BYTES");
    assert_eq!(
        WorkerMetrics::get(&w.metrics.file_transport_refused),
        cases.len() as u64
    );
    let d = data(&w, "u", "echo", "echo", json!({"after": true})).await;
    assert_eq!(d["arguments"]["after"], true, "the session still serves");
    w.pool.shutdown().await;
}

// ---------------------------------------------------------------------------------------------------------------
// Reverse RPC
// ---------------------------------------------------------------------------------------------------------------

/// Answers every call with what it received (minus tokens' values).
#[derive(Debug, Default)]
struct Recorder {
    calls: Mutex<Vec<ReverseCall>>,
}

impl HostServices for Recorder {
    fn call(&self, call: ReverseCall) -> ServiceFuture {
        let answer = json!({
            "invoke_id": call.invoke_id, "method": call.method, "params": call.params,
            "client_timeout_s": call.client_timeout_s, "has_storage_token": call.tokens.storage.is_some(),
        });
        self.calls.lock().unwrap().push(call);
        Box::pin(async move { Ok(answer) })
    }
}

/// Mints every token.
#[derive(Debug)]
struct AllTokens;

impl TokenSource for AllTokens {
    fn tokens(&self, r: TokenRequest) -> TokenFuture {
        let t = |aud: &str| Some(format!("tok-{aud}-{}", r.invoke_id));
        let tokens = InvokeTokens {
            sampling: t("sampling"),
            storage: t("storage"),
            upload: t("upload"),
            image: t("image"),
            credentials: None,
            web: None,
            renew_at_ms: None,
        };
        Box::pin(async move { tokens })
    }
}

fn storage_worker(name: &str) -> (TestWorker, Arc<Recorder>) {
    let recorder = Arc::new(Recorder::default());
    let w = TestWorker::with_services(
        test_config(name),
        &[
            Plugin::echo(
                "kv",
                &["--capabilities", "storage", "--host-capabilities", "aps.kv"],
            ),
            Plugin::echo("nocap", &["--capabilities", "sampling"]),
        ],
        recorder.clone(),
        Arc::new(AllTokens),
    );
    (w, recorder)
}

async fn reverse(w: &TestWorker, tool_id: &str, r: InvokeRequest) -> Value {
    data(w, "u", tool_id, "reverse_rpc", Value::Object(r.arguments.clone()))
        .await
        .get("response")
        .cloned()
        .unwrap_or(Value::Null)
}

fn rpc(args: Value) -> InvokeRequest {
    req("reverse_rpc", args)
}

#[tokio::test]
async fn reverse_rpc_routing_by_invoke_id() {
    let (w, recorder) = storage_worker("rrpc");
    // 1. context.invoke_id names the active invoke → routed to it (context and _clientTimeoutS stripped).
    let r = req(
        "reverse_rpc",
        json!({"method": "storage/get", "params": {"key": "k", "_clientTimeoutS": 9.5}}),
    );
    let own = r.invoke_id.clone();
    let out = call(&w, "u", "kv", r).await.unwrap();
    let resp = &out.data().unwrap()["response"];
    assert_eq!(resp["result"]["invoke_id"], own.as_str());
    assert_eq!(resp["result"]["params"], json!({"key": "k"}));
    assert_eq!(resp["result"]["client_timeout_s"], 9.5);
    assert_eq!(resp["result"]["has_storage_token"], true);
    assert!(
        resp["id"].as_str().unwrap().starts_with("rpc-"),
        "the plugin's string id is echoed verbatim"
    );

    // 2. An unknown invoke id → -32602 UNKNOWN_INVOKE_CONTEXT.
    let resp = reverse(
        &w,
        "kv",
        rpc(json!({"method": "storage/get", "params": {}, "invoke_id": "tjob_nope"})),
    )
    .await;
    assert_eq!(resp["error"]["code"], -32602);
    assert_eq!(resp["error"]["data"]["errorCode"], "UNKNOWN_INVOKE_CONTEXT");

    // 3. Omitted with exactly one active invoke → that one.
    let r = rpc(json!({"method": "storage/get", "params": {}, "omit_invoke_id": true}));
    let own = r.invoke_id.clone();
    let out = call(&w, "u", "kv", r).await.unwrap();
    assert_eq!(
        out.data().unwrap()["response"]["result"]["invoke_id"],
        own.as_str()
    );

    // 4. Omitted with several active → -32602 MISSING_INVOKE_CONTEXT (the host never guesses).
    let s = w.pool.session("u", "kv").unwrap();
    let sleeper = req("sleep", json!({"ms": 60_000}));
    let sleeper_id = sleeper.invoke_id.clone();
    let w = Arc::new(w);
    let ws = w.clone();
    let t = tokio::spawn(async move { call(&ws, "u", "kv", sleeper).await });
    assert!(eventually(GUARD, || s.has_invoke(&sleeper_id)).await);
    let resp = reverse(
        &w,
        "kv",
        rpc(json!({"method": "storage/get", "params": {}, "omit_invoke_id": true})),
    )
    .await;
    assert_eq!(resp["error"]["code"], -32602);
    assert_eq!(resp["error"]["data"]["errorCode"], "MISSING_INVOKE_CONTEXT");
    assert!(w.pool.cancel(&sleeper_id));
    assert!(matches!(t.await.unwrap(), Err(InvokeError::Cancelled)));
    assert_eq!(
        recorder.calls.lock().unwrap().len(),
        2,
        "only the routed calls reached the service"
    );
    w.pool.shutdown().await;
}

#[tokio::test]
async fn reverse_rpc_gates_and_unknown_methods() {
    let (w, recorder) = storage_worker("rgate");
    // Not negotiated in initialize (plugin claims only sampling) → the family's code.
    let resp = reverse(&w, "nocap", rpc(json!({"method": "storage/get", "params": {}}))).await;
    assert_eq!(
        (
            resp["error"]["code"].clone(),
            resp["error"]["data"]["errorCode"].clone()
        ),
        (json!(-32021), json!("STORAGE_NOT_GRANTED"))
    );
    // Negotiated but not declared in the manifest → -32008 for sampling.
    let resp = reverse(
        &w,
        "nocap",
        rpc(json!({"method": "sampling/createMessage", "params": {}})),
    )
    .await;
    assert_eq!(resp["error"]["code"], -32008);
    assert_eq!(resp["error"]["data"]["errorCode"], "SAMPLING_NOT_NEGOTIATED");
    // Not a method of the protocol → -32601.
    let resp = reverse(&w, "kv", rpc(json!({"method": "video/generate", "params": {}}))).await;
    assert_eq!(resp["error"]["code"], -32601);
    assert!(recorder.calls.lock().unwrap().is_empty());
    w.pool.shutdown().await;
}

/// Answers every call with the storage token it was given (test tokens only).
#[derive(Debug, Default)]
struct TokenEcho;

impl HostServices for TokenEcho {
    fn call(&self, call: ReverseCall) -> ServiceFuture {
        let token = call.tokens.storage.clone();
        Box::pin(async move { Ok(json!({ "storage_token": token })) })
    }
}

/// Mints `tok-<n>`; the first mint is due for renewal at once, later ones never.
#[derive(Debug, Default)]
struct RenewOnce {
    mints: std::sync::atomic::AtomicU64,
}

impl TokenSource for RenewOnce {
    fn tokens(&self, _: TokenRequest) -> TokenFuture {
        let n = self.mints.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        let tokens = InvokeTokens {
            storage: Some(format!("tok-{n}")),
            renew_at_ms: (n == 1).then_some(0),
            ..InvokeTokens::default()
        };
        Box::pin(async move { tokens })
    }
}

/// Spec §11 HR-JW-02: the tokens of an invoke that outlives them are minted again when due, and reverse calls
/// from then on carry the new ones (the plugin's context copy is never presented: the host holds the tokens).
#[tokio::test]
async fn tokens_due_for_renewal_are_minted_again_for_the_running_invoke() {
    let source = Arc::new(RenewOnce::default());
    let w = TestWorker::with_services(
        test_config("renew"),
        &[Plugin::echo(
            "kv",
            &["--capabilities", "storage", "--host-capabilities", "aps.kv"],
        )],
        Arc::new(TokenEcho),
        source.clone(),
    );
    let first = reverse(
        &w,
        "kv",
        rpc(json!({"method": "storage/get", "params": {"key": "a"}})),
    )
    .await;
    assert_eq!(
        first["result"]["storage_token"], "tok-2",
        "renewed before the call: {first}"
    );
    let second = reverse(
        &w,
        "kv",
        rpc(json!({"method": "storage/get", "params": {"key": "b"}})),
    )
    .await;
    // A new invoke mints its own (tok-3, not due); nothing else was minted.
    assert_eq!(second["result"]["storage_token"], "tok-3", "{second}");
    assert_eq!(source.mints.load(std::sync::atomic::Ordering::SeqCst), 3);
    w.pool.shutdown().await;
}

#[tokio::test]
async fn tokens_are_withheld_unless_negotiated_and_credentials_filtered_to_the_manifest() {
    let (w, _) = storage_worker("tokens");
    let mut r = req("inspect", json!({}));
    r.credentials =
        serde_json::from_value(json!({"ECHO_API_KEY": "sk-secret-123", "OTHER": "nope"})).unwrap();
    let out = call(&w, "u", "kv", r).await.unwrap();
    let info = out.data().unwrap();
    let ctx = &info["context"];
    assert!(
        ctx["storage_token"].as_str().unwrap().starts_with("tok-storage-"),
        "negotiated: storage"
    );
    for absent in ["sampling_token", "upload_token", "image_token"] {
        assert!(
            ctx.get(absent).is_none(),
            "{absent} must be withheld: not negotiated"
        );
    }
    assert_eq!(ctx["credentials"], json!({"ECHO_API_KEY": "sk-secret-123"}));
    // Credentials are never in the environment.
    let pid = info["pid"].as_u64().unwrap();
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    assert!(!String::from_utf8_lossy(&environ).contains("sk-secret-123"));
    assert!(info["env"].get("ECHO_API_KEY").is_none());
    w.pool.shutdown().await;
}

/// Spec §6 HR-SE-05: a careless plugin writing a credential it was given to stderr — the kept lines (and every
/// error built from them) carry `<redacted-credential>` instead of the value.
#[tokio::test]
async fn a_credential_a_plugin_writes_to_stderr_is_redacted() {
    let (w, _) = storage_worker("stderr-cred");
    let mut r = req("stderr", json!({"text": "calling with key=sk-secret-123 now"}));
    r.credentials = serde_json::from_value(json!({"ECHO_API_KEY": "sk-secret-123"})).unwrap();
    call(&w, "u", "kv", r).await.unwrap();
    let s = w.pool.session("u", "kv").unwrap();
    assert!(
        eventually(GUARD, || s
            .stderr_lines()
            .iter()
            .any(|l| l.starts_with("calling with key=")))
        .await,
        "failure guard: the line never reached the ring"
    );
    let lines = s.stderr_lines();
    assert!(
        lines
            .iter()
            .any(|l| l == "calling with key=<redacted-credential> now"),
        "{lines:?}"
    );
    assert!(!lines.join("\n").contains("sk-secret-123"), "{lines:?}");
    w.pool.shutdown().await;
}

#[tokio::test]
async fn the_environment_is_scrubbed_and_carries_the_runtime_variables() {
    let w = TestWorker::start(test_config("env"), &[Plugin::echo("echo", &[])]);
    let s = w.pool.session("u", "echo").unwrap();
    let (workspace, tmpdir) = s.dirs();
    let info = data(&w, "u", "echo", "inspect", json!({})).await;
    let env = info["env"].as_object().unwrap();
    assert_eq!(env["ANNA_WORKSPACE_DIR"], workspace.display().to_string());
    assert_eq!(env["TMPDIR"], tmpdir.display().to_string());
    assert_eq!(
        env["EXECUTA_HOME"],
        w.config
            .catalogue_dir
            .join("echo")
            .canonicalize()
            .unwrap()
            .display()
            .to_string()
    );
    assert_eq!(info["cwd"], env["EXECUTA_HOME"]);
    let unexpected: Vec<&String> = env
        .keys()
        .filter(|k| {
            ![
                "PATH",
                "LANG",
                "LC_ALL",
                "TZ",
                "HOME",
                "ANNA_WORKSPACE_DIR",
                "TMPDIR",
                "EXECUTA_HOME",
            ]
            .contains(&k.as_str())
        })
        .collect();
    assert!(unexpected.is_empty(), "scrubbed environment leaks {unexpected:?}");
    w.pool.shutdown().await;
}

// ---------------------------------------------------------------------------------------------------------------
// Progress
// ---------------------------------------------------------------------------------------------------------------

fn collector() -> (ProgressSink, Arc<Mutex<Vec<ProgressUpdate>>>) {
    let events = Arc::new(Mutex::new(Vec::new()));
    let e = events.clone();
    (
        Arc::new(move |u: ProgressUpdate| e.lock().unwrap().push(u)),
        events,
    )
}

async fn progress_run(w: &TestWorker, args: Value, with_sink: bool) -> Vec<ProgressUpdate> {
    let (sink, events) = collector();
    let mut r = req("progress", args);
    if with_sink {
        r.progress = Some(sink);
    }
    assert!(call(w, "u", "echo", r).await.unwrap().success());
    // Notifications precede the response on the same stream: all are delivered by now.
    events.lock().unwrap().clone()
}

#[tokio::test]
async fn progress_is_delivered_with_types_coerced() {
    let w = TestWorker::start(test_config("progress"), &[Plugin::echo("echo", &[])]);
    let ev = progress_run(&w, json!({"count": 10}), true).await;
    assert_eq!(ev.len(), 10);
    assert_eq!(ev[3].data.get(), r#"{"i":3,"pad":""}"#);
    let ev = progress_run(&w, json!({"count": 1, "type": "tool_update"}), true).await;
    assert_eq!(ev[0].kind, ProgressType::ToolUpdate);
    for faked in ["completed", "failed", "weird"] {
        let ev = progress_run(&w, json!({"count": 1, "type": faked}), true).await;
        assert_eq!(ev[0].kind, ProgressType::Progress, "{faked} is coerced");
    }
    w.pool.shutdown().await;
}

#[tokio::test]
async fn progress_8_kib_boundary() {
    let w = TestWorker::start(test_config("progress8k"), &[Plugin::echo("echo", &[])]);
    // data = {"i":0,"pad":"<pad>"} = 16 + pad bytes.
    let ev = progress_run(&w, json!({"count": 1, "pad_bytes": 8192 - 16}), true).await;
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].data.get().len(), 8192);
    let ev = progress_run(&w, json!({"count": 1, "pad_bytes": 8192 - 15}), true).await;
    assert!(ev.is_empty());
    assert_eq!(w.metrics.progress_dropped(ProgressDrop::TooLarge), 1);
    w.pool.shutdown().await;
}

#[tokio::test]
async fn progress_is_rate_limited_per_invoke() {
    let w = TestWorker::start(test_config("progressrate"), &[Plugin::echo("echo", &[])]);
    // 300 events as fast as the plugin can write them: the burst of 50 passes, the rest only at 50/s.
    let ev = progress_run(&w, json!({"count": 300}), true).await;
    let dropped = w.metrics.progress_dropped(ProgressDrop::RateLimited);
    assert!(ev.len() >= 50, "the first 50 always pass");
    assert_eq!(
        ev.len() as u64 + dropped,
        300,
        "every event is delivered or counted as dropped"
    );
    assert!(dropped > 0);
    // Another invoke has its own budget.
    assert_eq!(progress_run(&w, json!({"count": 50}), true).await.len(), 50);
    w.pool.shutdown().await;
}

#[tokio::test]
async fn progress_drops_are_counted_by_reason() {
    let w = TestWorker::start(test_config("progressdrop"), &[Plugin::echo("echo", &[])]);
    assert!(progress_run(&w, json!({"count": 3}), false).await.is_empty());
    assert_eq!(
        w.metrics.progress_dropped(ProgressDrop::NoChannel),
        3,
        "sync invokes have no channel"
    );
    assert!(
        progress_run(&w, json!({"count": 2, "omit_invoke_id": true}), true)
            .await
            .is_empty()
    );
    assert_eq!(w.metrics.progress_dropped(ProgressDrop::Uncorrelated), 2);
    assert!(
        progress_run(&w, json!({"count": 2, "invoke_id": "tjob_other"}), true)
            .await
            .is_empty()
    );
    assert_eq!(w.metrics.progress_dropped(ProgressDrop::UnknownInvoke), 2);
    w.pool.shutdown().await;
}

// ---------------------------------------------------------------------------------------------------------------
// Cancel
// ---------------------------------------------------------------------------------------------------------------

#[tokio::test]
async fn cooperative_cancel_leaves_the_process_alone_when_it_answers_in_time() {
    let mut config = test_config("cancelcoop");
    config.cancel_kill_after = Duration::from_secs(30);
    let w = Arc::new(TestWorker::start(config, &[Plugin::echo("echo", &[])]));
    let s = w.pool.prewarm("u", "echo", GUARD).await.unwrap();
    let pid = s.pid().unwrap();
    let r = req("sleep", json!({"ms": 300}));
    let id = r.invoke_id.clone();
    let wt = w.clone();
    let t = tokio::spawn(async move { call(&wt, "u", "echo", r).await });
    assert!(eventually(GUARD, || s.has_invoke(&id)).await);
    assert!(w.pool.cancel(&id));
    assert!(!w.pool.cancel(&id), "cancelling twice is harmless");
    assert!(matches!(t.await.unwrap(), Err(InvokeError::Cancelled)));
    // The plugin's late answer arrives and is discarded; the process was never killed.
    assert!(eventually(GUARD, || WorkerMetrics::get(&w.metrics.unmatched_responses) == 1).await);
    assert_eq!(pid_of(&w, "u", "echo").await, pid);
    assert_eq!(WorkerMetrics::get(&w.metrics.tree_kills), 0);
    w.pool.shutdown().await;
}

#[tokio::test]
async fn forced_cancel_kills_the_tree_after_the_fallback_delay() {
    let w = Arc::new(TestWorker::start(
        test_config("cancelforce"),
        &[Plugin::echo("echo", &[])],
    ));
    let s = w.pool.prewarm("u", "echo", GUARD).await.unwrap();
    let pid = s.pid().unwrap();
    let grandchild = data(&w, "u", "echo", "spawn_grandchild", json!({})).await["pid"]
        .as_u64()
        .unwrap() as u32;
    let r = req("sleep", json!({"ms": 600_000}));
    let id = r.invoke_id.clone();
    let wt = w.clone();
    let t = tokio::spawn(async move { call(&wt, "u", "echo", r).await });
    assert!(eventually(GUARD, || s.has_invoke(&id)).await);
    assert!(w.pool.cancel(&id));
    assert!(matches!(t.await.unwrap(), Err(InvokeError::Cancelled)));
    assert!(
        eventually(GUARD, || !alive(pid) && !alive(grandchild)).await,
        "the whole tree is killed"
    );
    assert_eq!(WorkerMetrics::get(&w.metrics.tree_kills), 1);
    assert_eq!(
        WorkerMetrics::get(&w.metrics.crashes),
        0,
        "a host kill is not a crash"
    );
    assert_ne!(
        pid_of(&w, "u", "echo").await,
        pid,
        "the session restarts for the next call"
    );
    w.pool.shutdown().await;
}
