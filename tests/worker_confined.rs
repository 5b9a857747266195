//! Plugins as hostile code, on real namespaces, seccomp and cgroups (as root): a hostile fixture per attack, in
//! both dialects (the Executa Python fixture's `confine_probe` tool and the Animus fixture's `confine/probe`
//! method run the same `tests/plugins/python/confine_probe.py`), and one tenant's memory bomb against another
//! tenant's session on the same worker.
#![allow(clippy::unwrap_used, clippy::cast_possible_truncation, clippy::print_stderr)]

use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use fleet::nats_server::NatsServer;
use fleet_e2e::worker::{Plugin, TestWorker, alive, call, eventually, req, test_config};
use fleet_e2e::workspace_root;
use fleet_worker::catalogue::{Catalogue, LoadOptions};
use fleet_worker::config::{ResourceLimits, UserLimits, WorkerConfig};
use fleet_worker::metrics::WorkerMetrics;
use fleet_worker::pool::Pool;
use fleet_worker::sandbox::Sandbox;
use fleet_worker::services::{NoServices, NoTokens};
use fleet_worker::session::{InvokeError, WorkerContext};
use serde_json::{Value, json};

const GUARD: Duration = Duration::from_secs(60);
const PYTHON: &str = "/usr/bin/python3";

fn python_dir() -> PathBuf {
    workspace_root().join("tests/plugins/python")
}

/// A worker over a catalogue of the hostile fixtures: `exec-probe` (Executa), `animus-probe` (Animus), and a
/// benign Executa sibling `sibling` of the same fixture.
struct Hostile {
    pool: Pool,
    sandbox: Sandbox,
    _root: tempfile::TempDir,
}

impl Drop for Hostile {
    fn drop(&mut self) {
        let _ = self.sandbox.remove_subtree();
    }
}

/// Where a test's state and catalogue live: under `/tmp` (development and tests: the private `/tmp` must
/// mount the session's own paths back) or outside it (a production layout).
#[derive(Clone, Copy, PartialEq)]
enum Layout {
    UnderTmp,
    OutsideTmp,
}

fn hostile_worker(name: &str, layout: Layout) -> Hostile {
    let root = match layout {
        Layout::UnderTmp => tempfile::tempdir_in("/tmp").unwrap(),
        Layout::OutsideTmp => tempfile::tempdir_in("/var/tmp").unwrap(),
    };
    let catalogue = root.path().join("catalogue");
    let script = python_dir().join("echo_plugin.py").display().to_string();
    let animus = workspace_root()
        .join("tests/plugins/animus/animus_plugin.py")
        .display()
        .to_string();
    let probe_lib = python_dir().display().to_string();
    let entries = [
        ("exec-probe", json!([PYTHON, script, "--hostile"]), json!({})),
        ("sibling", json!([PYTHON, script, "--hostile"]), json!({})),
        (
            "animus-probe",
            json!([PYTHON, animus, "--mode", "custom", "--probe-lib", probe_lib]),
            json!({"allow_methods": ["confine/probe"]}),
        ),
    ];
    for (id, command, extra) in entries {
        let d = catalogue.join(id);
        std::fs::create_dir_all(&d).unwrap();
        let mut e = json!({ "tool_id": id, "type": "binary", "command": command });
        if let Value::Object(m) = extra {
            for (k, v) in m {
                e[k] = v;
            }
        }
        std::fs::write(d.join("executa.json"), serde_json::to_vec(&e).unwrap()).unwrap();
        std::fs::write(d.join(".fleet-described"), b"").unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    for p in [root.path(), catalogue.as_path()] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let mut config = test_config(&format!("cf-{name}"));
    config.catalogue_dir = catalogue;
    config.state_dir = root.path().join("state");
    let (catalogue, problems) = Catalogue::load(&config.catalogue_dir, &LoadOptions::from_env()).unwrap();
    assert!(problems.is_empty(), "{problems:?}");
    let sandbox = Sandbox::new(&config).expect("sandbox (cgroups, namespaces, as root)");
    assert_eq!(sandbox.confinement(), (true, true));
    let ctx = WorkerContext {
        config: Arc::new(config),
        sandbox: sandbox.clone(),
        services: Arc::new(NoServices),
        tokens: Arc::new(NoTokens),
        metrics: Arc::new(WorkerMetrics::default()),
    };
    Hostile {
        pool: Pool::new(ctx, Arc::new(catalogue)),
        sandbox,
        _root: root,
    }
}

/// Runs the probe as `user` in the Executa (`exec-probe`) or Animus (`animus-probe`) fixture.
async fn probe(w: &Hostile, user: &str, tool_id: &str, request: Value) -> Value {
    let tool = if tool_id == "animus-probe" {
        "confine/probe"
    } else {
        "confine_probe"
    };
    let out = tokio::time::timeout(GUARD, w.pool.invoke(user, tool_id, req(tool, request)))
        .await
        .expect("failure guard")
        .unwrap_or_else(|e| panic!("{tool_id}: {e}"));
    assert!(out.success(), "{tool_id}: {:?}", out.error_message());
    out.data().unwrap().clone()
}

/// This machine's first global IPv4 address, if it has one.
fn host_address() -> Option<String> {
    let out = std::process::Command::new("ip")
        .args(["-4", "-o", "addr", "show", "scope", "global"])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.split_whitespace()
        .skip_while(|w| *w != "inet")
        .nth(1)
        .and_then(|cidr| cidr.split('/').next())
        .map(str::to_owned)
}

/// The attacks both dialects must lose.
async fn both_dialects_lose(tool_id: &str, layout: Layout) {
    let w = hostile_worker(&tool_id[..4], layout);
    let nats_dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start(nats_dir.path()).expect("nats-server (run scripts/test.sh once)");
    let nats_target = format!("127.0.0.1:{}", nats.port());
    let listener = TcpListener::bind("0.0.0.0:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let mut targets = vec![nats_target.clone(), "169.254.169.254:80".to_owned()];
    let host = host_address().map(|a| format!("{a}:{port}"));
    // From outside the sandbox both servers answer: what the plugin is refused is really there.
    std::net::TcpStream::connect(&nats_target).expect("nats-server answers on loopback");
    if let Some(host) = &host {
        std::net::TcpStream::connect(host).expect("the host-address listener answers");
        targets.push(host.clone());
    } else {
        eprintln!("this machine has no global IPv4 address: the host-address attack is not tried");
    }

    // A sibling tool of the same user, and another user's session of the same tool.
    let sibling = w.pool.prewarm("alice", "sibling", GUARD).await.unwrap();
    let other_user = w.pool.prewarm("bob", "sibling", GUARD).await.unwrap();
    let (sibling_pid, bob_pid) = (sibling.pid().unwrap(), other_user.pid().unwrap());
    let (_, sibling_tmp) = sibling.dirs();
    std::fs::write(sibling_tmp.join("secret"), "sibling's").unwrap();
    let marker = PathBuf::from(format!("/tmp/fleet-confine-marker-{}", std::process::id()));
    std::fs::write(&marker, "host /tmp").unwrap();

    let report = probe(
        &w,
        "alice",
        tool_id,
        json!({
            "connect": targets,
            "pids": [sibling_pid, bob_pid, std::process::id(), 1],
            "read": [sibling_tmp.join("secret"), sibling_tmp, format!("/proc/{sibling_pid}/fd/0")],
            "write": [format!("/proc/{sibling_pid}/fd/1"), format!("/proc/{bob_pid}/fd/1")],
        }),
    )
    .await;
    let _ = std::fs::remove_file(&marker);

    // Network: only its own loopback. NATS's port there is nobody's; everything else has no route.
    assert_eq!(report["connect"][&nats_target], "ECONNREFUSED", "{report}");
    assert_eq!(report["connect"]["169.254.169.254:80"], "ENETUNREACH", "{report}");
    if let Some(host) = &host {
        assert_eq!(report["connect"][host], "ENETUNREACH", "{report}");
    }
    // Processes: its own tree only — no sibling, no other user, not the worker, not init.
    assert_eq!(report["proc_foreign"], 0, "{report}");
    for pid in [sibling_pid, bob_pid, std::process::id(), 1] {
        assert_eq!(report["pids"][pid.to_string()], "absent", "{report}");
    }
    // The sibling's TMPDIR and its stdio: unreachable. Outside /tmp the sibling's directory is there but
    // another uid's 0700; under /tmp it is not even in this session's private /tmp.
    let hidden = if layout == Layout::UnderTmp {
        "ENOENT"
    } else {
        "EACCES"
    };
    assert_eq!(
        report["read"][sibling_tmp.join("secret").display().to_string()],
        hidden,
        "{report}"
    );
    assert_eq!(
        report["read"][sibling_tmp.display().to_string()],
        hidden,
        "{report}"
    );
    assert_eq!(
        report["read"][format!("/proc/{sibling_pid}/fd/0")],
        "ENOENT",
        "{report}"
    );
    assert_eq!(
        report["write"][format!("/proc/{sibling_pid}/fd/1")],
        "ENOENT",
        "{report}"
    );
    assert_eq!(
        report["write"][format!("/proc/{bob_pid}/fd/1")],
        "ENOENT",
        "{report}"
    );
    // A private /tmp: the host's marker is not there.
    let tmp: Vec<&str> = report["tmp"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        !tmp.contains(&marker.file_name().unwrap().to_str().unwrap()),
        "{report}"
    );
    // seccomp: no user namespace, no mount, no ptrace, no chroot.
    for call in ["unshare_newuser", "mount", "ptrace", "chroot"] {
        assert_eq!(report[call], "EPERM", "{call}: {report}");
    }
    assert!(alive(sibling_pid) && alive(bob_pid));
    w.pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executa_plugin_reaches_nothing_outside_its_sandbox() {
    both_dialects_lose("exec-probe", Layout::OutsideTmp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_animus_plugin_reaches_nothing_outside_its_sandbox() {
    both_dialects_lose("animus-probe", Layout::OutsideTmp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executa_plugin_installed_under_tmp_reaches_nothing_outside_its_sandbox() {
    both_dialects_lose("exec-probe", Layout::UnderTmp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_animus_plugin_installed_under_tmp_reaches_nothing_outside_its_sandbox() {
    both_dialects_lose("animus-probe", Layout::UnderTmp).await;
}

/// The worker's own secrets next to the state: root-owned, unreadable by a plugin uid even where its view of
/// the file system includes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workers_keys_stay_unreadable_to_plugins() {
    let w = hostile_worker("keys", Layout::OutsideTmp);
    let state = w.sandbox.user_space("carol", "exec-probe").unwrap();
    let uids = state
        .workspace
        .ancestors()
        .find(|p| p.join("uids.json").exists())
        .map(|p| p.join("uids.json"))
        .expect("uids.json above the workspace");
    let key: &Path = Path::new("/etc/shadow");
    let report = probe(&w, "carol", "exec-probe", json!({ "read": [uids, key] })).await;
    assert_eq!(report["read"][uids.display().to_string()], "EACCES", "{report}");
    assert_eq!(report["read"]["/etc/shadow"], "EACCES", "{report}");
    w.pool.shutdown().await;
}

/// User A's memory bomb over three sessions — each within its own limit — is stopped by A's ceiling; user
/// B's session on the same worker lives on and serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_users_memory_bomb_across_sessions_leaves_another_user_alive() {
    const SESSION_MIB: u64 = 64;
    const HOLD_MIB: u64 = 40;
    let mut config: WorkerConfig = test_config("ceiling");
    config.limits = ResourceLimits {
        memory_bytes: SESSION_MIB << 20,
        ..ResourceLimits::default()
    };
    // Two held allocations fit under the ceiling; a third does not (3 × 40 > 100 > 2 × 40 + start-up).
    config.user_limits = UserLimits {
        memory_bytes: 100 << 20,
        pids_max: 1024,
    };
    let plugins = [
        Plugin::echo("a1", &[]),
        Plugin::echo("a2", &[]),
        Plugin::echo("a3", &[]),
    ];
    let w = Arc::new(TestWorker::start(config, &plugins));
    let b = w.pool.prewarm("bob", "a1", GUARD).await.unwrap();
    let b_pid = b.pid().unwrap();

    let mut held = Vec::new();
    for tool in ["a1", "a2"] {
        let s = w.pool.prewarm("alice", tool, GUARD).await.unwrap();
        let worker = w.clone();
        held.push(tokio::spawn(async move {
            call(
                &worker,
                "alice",
                tool,
                req("alloc", json!({"mib": HOLD_MIB, "hold_ms": 120_000})),
            )
            .await
        }));
        let charged = eventually(GUARD, || {
            s.with_cgroup(|cg| cg.unwrap().usage().unwrap().memory_bytes) >= HOLD_MIB << 20
        })
        .await;
        assert!(charged, "{tool} holds its {HOLD_MIB} MiB");
    }
    // The third session's allocation is within its own 64 MiB, but not within alice's ceiling: the kernel's
    // OOM killer, confined to alice's ceiling cgroup, kills her biggest process — one of the two holders (the
    // allocating one is still smaller) — and the third allocation then fits.
    let third = call(
        &w,
        "alice",
        "a3",
        req("alloc", json!({"mib": HOLD_MIB, "hold_ms": 0})),
    )
    .await;
    assert!(third.is_ok(), "{third:?}");
    let (mut h1, mut h2) = (held.remove(0), held.remove(0));
    let (first, rest) = tokio::time::timeout(GUARD, async {
        tokio::select! {
            r = &mut h1 => (r.unwrap(), h2),
            r = &mut h2 => (r.unwrap(), h1),
        }
    })
    .await
    .expect("one holder was killed");
    rest.abort();
    assert!(
        matches!(&first, Err(InvokeError::ProcessExited { exit, .. }) if exit.oom),
        "one of alice's sessions was OOM-killed: {first:?}"
    );
    assert!(WorkerMetrics::get(&w.metrics.oom_kills) >= 1);
    // Bob never noticed.
    assert!(alive(b_pid), "bob's plugin lives");
    let out = call(&w, "bob", "a1", req("alloc", json!({"mib": HOLD_MIB})))
        .await
        .unwrap();
    assert!(out.success(), "{:?}", out.error_message());
    assert_eq!(b.pid(), Some(b_pid), "in the same process");
    w.pool.shutdown().await;
}
