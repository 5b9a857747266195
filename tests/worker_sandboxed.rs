//! The worker's sandbox guarantees on real cgroups and real processes: memory, pids and cpu limits, process
//! trees dying with their plugin, per-user workspaces, the warm pool's eviction, and zero orphans after a
//! shutdown or a `kill -9` of the worker.
#![allow(clippy::unwrap_used, clippy::cast_possible_truncation)]

use std::io::{BufRead as _, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use fleet_e2e::worker::{
    Plugin, TestWorker, alive, call, data, eventually, output, req, test_config, write_catalogue,
};
use fleet_e2e::workspace_root;
use fleet_worker::metrics::WorkerMetrics;
use fleet_worker::pool::PoolError;
use fleet_worker::session::InvokeError;
use serde_json::{Value, json};

const GUARD: Duration = Duration::from_secs(60);

fn pid_field(v: &Value) -> u32 {
    v["pid"].as_u64().unwrap() as u32
}

#[tokio::test]
async fn a_memory_bomb_is_oom_killed_and_reported_as_such() {
    let plugin = Plugin::echo("echo", &[]).limits(json!({"memory_bytes": 64 << 20}));
    let w = TestWorker::start(test_config("oom"), &[plugin]);
    match call(&w, "u", "echo", req("alloc", json!({"mib": 256}))).await {
        Err(InvokeError::ProcessExited { exit, .. }) => {
            assert!(exit.oom, "{exit}");
            assert!(exit.status.contains("SIGKILL"), "{exit}");
            assert!(exit.to_string().contains("OOM"), "{exit}");
        }
        other => panic!("expected an OOM kill, got {other:?}"),
    }
    assert_eq!(WorkerMetrics::get(&w.metrics.oom_kills), 1);
    // Within the limit it works, in a fresh process.
    assert_eq!(
        data(&w, "u", "echo", "alloc", json!({"mib": 16})).await["allocated_mib"],
        16
    );
    w.pool.shutdown().await;
}

#[tokio::test]
async fn a_fork_bomb_is_stopped_by_the_pids_limit() {
    let plugin = Plugin::echo("echo", &[]).limits(json!({"pids_max": 16}));
    let w = TestWorker::start(test_config("forkbomb"), &[plugin]);
    let s = w.pool.prewarm("u", "echo", GUARD).await.unwrap();
    let pid = s.pid().unwrap();
    let d = data(&w, "u", "echo", "fork", json!({"count": 64, "hold_ms": 60_000})).await;
    let spawned = d["spawned"].as_u64().unwrap();
    assert!(spawned < 64 && d["errors"].as_u64().unwrap() > 0, "{d}");
    let usage = s.with_cgroup(|cg| cg.unwrap().usage().unwrap());
    assert!(usage.pids_current <= 16, "{usage:?}");
    assert!(alive(pid), "the plugin itself survives its failed forks");
    w.pool.shutdown().await;
}

#[tokio::test]
async fn a_cpu_spinner_is_throttled() {
    let plugin = Plugin::echo("echo", &[]).limits(json!({"cpu_millis": 100}));
    let w = TestWorker::start(test_config("cpu"), &[plugin]);
    let s = w.pool.prewarm("u", "echo", GUARD).await.unwrap();
    data(&w, "u", "echo", "spin", json!({"ms": 1500, "threads": 2})).await;
    let usage = s.with_cgroup(|cg| cg.unwrap().usage().unwrap());
    assert!(
        usage.nr_throttled > 0,
        "the CFS quota throttled the spinner: {usage:?}"
    );
    w.pool.shutdown().await;
}

#[tokio::test]
async fn grandchildren_die_with_their_plugin() {
    let w = TestWorker::start(test_config("grandchild"), &[Plugin::echo("echo", &[])]);
    let s = w.pool.prewarm("u", "echo", GUARD).await.unwrap();
    let pid = s.pid().unwrap();
    let grandchild = pid_field(&data(&w, "u", "echo", "spawn_grandchild", json!({})).await);
    assert!(alive(grandchild));
    assert!(matches!(
        call(&w, "u", "echo", req("crash", json!({}))).await,
        Err(InvokeError::ProcessExited { .. })
    ));
    assert!(eventually(GUARD, || !alive(pid) && !alive(grandchild)).await);
    w.pool.shutdown().await;
}

#[tokio::test]
async fn two_users_cannot_read_each_others_workspace() {
    let w = TestWorker::start(test_config("tenants"), &[Plugin::echo("echo", &[])]);
    let alice = data(&w, "alice", "echo", "inspect", json!({})).await;
    let bob = data(&w, "bob", "echo", "inspect", json!({})).await;
    assert_ne!(alice["uid"], bob["uid"], "each user runs as its own uid");
    assert_ne!(alice["uid"], 0);
    assert_eq!(alice["groups"], json!([]), "no supplementary groups");
    let alice_ws = alice["env"]["ANNA_WORKSPACE_DIR"].as_str().unwrap().to_string();
    let bob_ws = bob["env"]["ANNA_WORKSPACE_DIR"].as_str().unwrap().to_string();
    assert_ne!(alice_ws, bob_ws);
    let secret = format!("{alice_ws}/secret.txt");
    data(
        &w,
        "alice",
        "echo",
        "write_file",
        json!({"path": secret, "content": "alice's"}),
    )
    .await;
    assert_eq!(
        data(&w, "alice", "echo", "read_file", json!({"path": secret})).await["content"],
        "alice's"
    );
    let denied = output(&w, "bob", "echo", "read_file", json!({"path": secret})).await;
    assert!(!denied.success());
    // Under /tmp (this test's state dir) bob's private /tmp does not even hold alice's workspace; in a
    // production layout it is there, another uid's 0700.
    let tmp = std::fs::canonicalize("/tmp").unwrap();
    let why = if std::fs::canonicalize(&alice_ws).unwrap().starts_with(&tmp) {
        "No such file or directory"
    } else {
        "Permission denied"
    };
    assert!(
        denied.error_message().unwrap().contains(why),
        "{why}: {:?}",
        denied.error_message()
    );
    let denied = output(
        &w,
        "bob",
        "echo",
        "write_file",
        json!({"path": format!("{alice_ws}/planted"), "content": "x"}),
    )
    .await;
    assert!(!denied.success());
    // Nor TMPDIRs.
    let alice_tmp = alice["env"]["TMPDIR"].as_str().unwrap();
    let denied = output(
        &w,
        "bob",
        "echo",
        "write_file",
        json!({"path": format!("{alice_tmp}/x"), "content": "x"}),
    )
    .await;
    assert!(!denied.success());
    w.pool.shutdown().await;
}

#[tokio::test]
async fn idle_sessions_are_evicted_with_the_shutdown_ladder() {
    let mut config = test_config("idle");
    config.idle_timeout = Duration::from_millis(300);
    let w = TestWorker::start(config, &[Plugin::echo("echo", &[])]);
    let s = w.pool.prewarm("u", "echo", GUARD).await.unwrap();
    let pid = s.pid().unwrap();
    assert!(eventually(GUARD, || w.pool.is_empty() && !alive(pid)).await);
    assert_eq!(WorkerMetrics::get(&w.metrics.evictions), 1);
    assert_eq!(
        WorkerMetrics::get(&w.metrics.tree_kills),
        0,
        "it left on stdin EOF"
    );
    // A new call starts it again.
    data(&w, "u", "echo", "echo", json!({})).await;
    w.pool.shutdown().await;
}

/// A session still starting is not idle, however long its start takes: a prewarm of a plugin whose `describe`
/// takes longer than the idle timeout gets its session (before, the reaper evicted it while it started, and the
/// prewarm failed `Closed`).
#[tokio::test]
async fn a_session_still_starting_is_not_evicted_as_idle() {
    let mut config = test_config("idle-start");
    config.idle_timeout = Duration::from_millis(300);
    let w = TestWorker::start(config, &[Plugin::echo("echo", &["--describe-delay-ms", "1500"])]);
    let s = w.pool.prewarm("u", "echo", GUARD).await.unwrap();
    let pid = s.pid().unwrap();
    // Idle from then on: evicted as before.
    assert!(eventually(GUARD, || w.pool.is_empty() && !alive(pid)).await);
    w.pool.shutdown().await;
}

#[tokio::test]
async fn session_caps_evict_the_least_recently_used_idle_session() {
    let mut config = test_config("lru");
    config.max_sessions = 2;
    let plugins = [
        Plugin::echo("a", &[]),
        Plugin::echo("b", &[]),
        Plugin::echo("c", &[]),
    ];
    let w = Arc::new(TestWorker::start(config, &plugins));
    let a = w.pool.prewarm("u", "a", GUARD).await.unwrap();
    let a_pid = a.pid().unwrap();
    w.pool.prewarm("u", "b", GUARD).await.unwrap();
    w.pool.prewarm("u", "c", GUARD).await.unwrap();
    assert_eq!(w.pool.len(), 2);
    assert!(
        eventually(GUARD, || !alive(a_pid)).await,
        "a was the least recently used"
    );
    // When every session is busy, a new one is refused rather than evicting work.
    let (rb, rc) = (
        req("sleep", json!({"ms": 60_000})),
        req("sleep", json!({"ms": 60_000})),
    );
    let (idb, idc) = (rb.invoke_id.clone(), rc.invoke_id.clone());
    let (wb, wc) = (w.clone(), w.clone());
    let tb = tokio::spawn(async move { call(&wb, "u", "b", rb).await });
    let tc = tokio::spawn(async move { call(&wc, "u", "c", rc).await });
    let (sb, sc) = (
        w.pool.session("u", "b").unwrap(),
        w.pool.session("u", "c").unwrap(),
    );
    assert!(eventually(GUARD, || sb.has_invoke(&idb) && sc.has_invoke(&idc)).await);
    match w.pool.session("u", "a") {
        Err(PoolError::Capacity { scope, limit }) => assert_eq!((scope, limit), ("worker", 2)),
        other => panic!("expected Capacity, got {other:?}"),
    }
    assert!(w.pool.cancel(&idb) && w.pool.cancel(&idc));
    let _ = (tb.await, tc.await);
    w.pool.shutdown().await;
}

#[tokio::test]
async fn worker_shutdown_leaves_no_process_and_no_cgroup() {
    let plugins = [Plugin::echo("a", &[]), Plugin::echo("b", &["--ignore-eof"])];
    let w = TestWorker::start(test_config("shutdown"), &plugins);
    let mut pids = Vec::new();
    for (user, tool) in [("u1", "a"), ("u2", "a"), ("u1", "b")] {
        let s = w.pool.prewarm(user, tool, GUARD).await.unwrap();
        pids.push(s.pid().unwrap());
        pids.push(pid_field(
            &data(&w, user, tool, "spawn_grandchild", json!({})).await,
        ));
    }
    w.pool.shutdown().await;
    for pid in &pids {
        assert!(!alive(*pid), "pid {pid} survived the shutdown");
    }
    for dir in w.sandbox.subtree_paths() {
        let left: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .filter(|e| e.path().is_dir())
            .collect();
        assert!(
            left.is_empty(),
            "session cgroups left in {}: {left:?}",
            dir.display()
        );
    }
    w.sandbox.remove_subtree().unwrap();
}

/// Starts `fleet worker` and returns it with its first two JSON lines (`swept`, `ready`).
fn start_fleet_worker(
    root: &std::path::Path,
    worker_id: &str,
    prewarm: &[&str],
) -> (std::process::Child, Value, Value) {
    let fleet = fleet_bin();
    let mut cmd = Command::new(fleet);
    let config = root.join("worker.toml");
    std::fs::write(&config, "shutdown_grace = 0.5\n").unwrap();
    cmd.arg("worker")
        .arg("--config")
        .arg(&config)
        .args(["--worker-id", worker_id])
        .arg("--catalogue")
        .arg(root.join("catalogue"))
        .arg("--state-dir")
        .arg(root.join("state"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    for p in prewarm {
        cmd.args(["--prewarm", p]);
    }
    let mut child = cmd.spawn().unwrap();
    let lines = BufReader::new(child.stdout.take().unwrap()).lines();
    // Read on a thread (which keeps reading to the end, so the worker never blocks on its stdout), each of the
    // first two lines awaited at most GUARD.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut next = || match rx.recv_timeout(GUARD) {
        Ok(line) => serde_json::from_str::<Value>(&line).unwrap(),
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            panic!("failure guard: no line from `fleet worker` within {GUARD:?} ({e})");
        }
    };
    let swept = next();
    let ready = next();
    (child, swept, ready)
}

/// Waits for `child`'s exit at most GUARD (killed and failed past it).
async fn exit_of(child: &mut std::process::Child) -> std::process::ExitStatus {
    let mut status = None;
    let exited = eventually(GUARD, || {
        status = child.try_wait().unwrap();
        status.is_some()
    })
    .await;
    if !exited {
        let _ = child.kill();
        let _ = child.wait();
        panic!("failure guard: `fleet worker` did not exit within {GUARD:?}");
    }
    status.unwrap()
}

/// The `fleet` binary, built on first use.
fn fleet_bin() -> std::path::PathBuf {
    let bin = fleet_e2e::profile_dir().join("fleet");
    if !bin.is_file() {
        let status = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
            .current_dir(workspace_root())
            .args(["build", "-p", "fleet"])
            .status()
            .unwrap();
        assert!(status.success());
    }
    bin
}

#[tokio::test]
async fn sigterm_stops_the_worker_with_no_orphans_and_kill_9_leftovers_are_swept_at_the_next_start() {
    let root = tempfile::tempdir().unwrap();
    // A plugin that outlives its host's death (ignores stdin EOF) and SIGTERM.
    write_catalogue(
        root.path(),
        &[Plugin::echo("echo", &["--ignore-eof", "--ignore-sigterm"])],
    );
    let worker_id = format!("t-kill9-{}", std::process::id());

    // A worker killed with -9 leaves its plugin running in its cgroup...
    let (mut first, swept, ready) = start_fleet_worker(root.path(), &worker_id, &["alice:echo", "bob:echo"]);
    assert_eq!(swept["swept"]["cgroups_removed"], 0);
    let orphans: Vec<u32> = ready["ready"].as_array().unwrap().iter().map(pid_field).collect();
    assert_eq!(orphans.len(), 2);
    first.kill().unwrap();
    exit_of(&mut first).await;
    assert!(orphans.iter().all(|p| alive(*p)), "kill -9 cannot clean up");
    // Besides the two sessions, the seats its waiting sandbox stubs sat in (`sandbox/seat.rs`; how many depends
    // on how far the stub pool had refilled). Nothing makes or removes cgroups between this count and the sweep.
    let left = session_cgroups_beside(orphans[0]);
    assert!(left >= 2, "{left}");

    // ...which the next worker with the same id finds and removes before serving.
    let (mut second, swept, ready) = start_fleet_worker(root.path(), &worker_id, &["alice:echo"]);
    assert_eq!(swept["swept"]["cgroups_removed"], left);
    assert!(swept["swept"]["processes_killed"].as_u64().unwrap() >= 2);
    assert!(eventually(GUARD, || orphans.iter().all(|p| !alive(*p))).await);

    // SIGTERM: every plugin process is gone when the worker has exited (this one ignores stdin EOF and SIGTERM:
    // the ladder escalates to SIGKILL).
    let pid = pid_field(&ready["ready"][0]);
    let status = Command::new("kill")
        .args(["-TERM", &second.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exit = exit_of(&mut second).await;
    assert!(exit.success(), "{exit}");
    assert!(!alive(pid));
}

/// How many session-level cgroups the worker subtree holding `pid` has: each `user-*` ceiling's children, and
/// any other cgroup directly in the subtree (read in the memory hierarchy, or the unified one).
fn session_cgroups_beside(pid: u32) -> usize {
    // `<subtree>/user-<key>/<session>`
    let session = fleet_e2e_client::cgroup_dir(pid);
    let subtree = session.parent().and_then(std::path::Path::parent).unwrap();
    let dirs = |p: &std::path::Path| -> Vec<std::path::PathBuf> {
        std::fs::read_dir(p)
            .unwrap()
            .filter_map(Result::ok)
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| e.path())
            .collect()
    };
    dirs(subtree)
        .iter()
        .map(|d| {
            let user = d
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("user-"));
            if user { dirs(d).len() } else { 1 }
        })
        .sum()
}

#[tokio::test]
async fn without_isolation_the_process_group_still_takes_the_tree_down() {
    let mut config = test_config("noiso");
    config.isolation = fleet_worker::config::IsolationMode::None;
    let w = TestWorker::start(config, &[Plugin::echo("echo", &[])]);
    assert_eq!(w.sandbox.mode(), "none");
    let s = w.pool.prewarm("u", "echo", GUARD).await.unwrap();
    assert!(s.with_cgroup(|cg| cg.is_none()));
    let pid = s.pid().unwrap();
    let info = data(&w, "u", "echo", "inspect", json!({})).await;
    assert_eq!(
        info["sid"], pid,
        "the plugin leads its own session and process group"
    );
    let grandchild = pid_field(&data(&w, "u", "echo", "spawn_grandchild", json!({})).await);
    assert!(matches!(
        call(&w, "u", "echo", req("crash", json!({}))).await,
        Err(InvokeError::ProcessExited { .. })
    ));
    assert!(eventually(GUARD, || !alive(pid) && !alive(grandchild)).await);
    w.pool.shutdown().await;
}

/// A worker admits users while their memory ceilings and disk caps fit its budget: with room for two, the
/// second user is admitted, the third refused with the typed, retriable capacity error (its call never starts a
/// process), and admitted once a user's sessions have gone idle and been reclaimed.
#[tokio::test]
async fn a_new_user_past_the_budget_is_refused_with_a_retriable_capacity_error() {
    let mut config = test_config("budget");
    let per_user = config.user_limits.memory_bytes + config.user_limits.disk_bytes;
    // One byte short of a third user.
    config.user_budget_bytes = 3 * per_user - 1;
    config.idle_timeout = Duration::from_millis(400);
    let w = Arc::new(TestWorker::start(config, &[Plugin::echo("a", &[])]));
    assert_eq!(w.sandbox.admitted_users(), (0, 2));
    // Two users busy (a busy session is never idle, so neither can be reclaimed while they run).
    let mut running = Vec::new();
    for user in ["u0", "u1"] {
        let r = req("sleep", json!({"ms": 60_000}));
        let id = r.invoke_id.clone();
        let wc = w.clone();
        running.push((
            id.clone(),
            tokio::spawn(async move { call(&wc, user, "a", r).await }),
        ));
        assert!(
            eventually(GUARD, || w
                .pool
                .session(user, "a")
                .is_ok_and(|s| s.has_invoke(&id)))
            .await
        );
    }
    assert_eq!(
        w.sandbox.admitted_users(),
        (2, 2),
        "the last user that fits is admitted"
    );
    match w.pool.session("u2", "a") {
        Err(PoolError::Capacity { scope, limit }) => assert_eq!((scope, limit), ("user_budget", 2)),
        other => panic!("expected Capacity, got {other:?}"),
    }
    let refused = w.pool.invoke("u2", "a", req("echo", json!({}))).await;
    assert!(
        matches!(
            refused,
            Err(PoolError::Capacity {
                scope: "user_budget",
                ..
            })
        ),
        "{refused:?}"
    );
    // u0's call ends: its session goes idle, is evicted, its identity reclaimed, and u2 fits.
    let (id0, t0) = running.remove(0);
    assert!(w.pool.cancel(&id0));
    let _ = t0.await;
    assert!(
        eventually(GUARD, || w.sandbox.admitted_users().0 == 1).await,
        "u0 left the admission once idle"
    );
    let out = call(&w, "u2", "a", req("echo", json!({"x": 1}))).await.unwrap();
    assert!(out.success(), "{:?}", out.error_message());
    let (id1, t1) = running.remove(0);
    assert!(w.pool.cancel(&id1));
    let _ = t1.await;
    w.pool.shutdown().await;
}
