//! Plugins as hostile code, on real namespaces, seccomp and cgroups (as root): a hostile fixture per attack, in
//! both dialects (the Executa Python fixture's `confine_probe` tool and the Animus fixture's `confine/probe`
//! method run the same `tests/plugins/python/confine_probe.py`: the network, other processes, the host's files,
//! the seccomp profile and its side doors, descriptors, what `/sys/fs/cgroup` and `/dev` show), and one tenant's
//! memory bomb against another tenant's session on the same worker.
#![allow(clippy::unwrap_used, clippy::cast_possible_truncation, clippy::print_stderr)]

use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use fleet::nats_server::NatsServer;
use fleet_e2e::worker::{Plugin, TestWorker, alive, call, eventually, req, test_config};
use fleet_e2e::{echo_plugin_bin, workspace_root};
use fleet_e2e_client::cgroup_dir;
use fleet_worker::catalogue::{Catalogue, LoadOptions};
use fleet_worker::config::{ResourceLimits, UserLimits, WorkerConfig};
use fleet_worker::metrics::WorkerMetrics;
use fleet_worker::pool::{Pool, PoolError};
use fleet_worker::sandbox::{CgroupVersion, Sandbox};
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
    /// The worker's id (its cgroups and its stubs' seats are named after it).
    worker_id: String,
    _root: tempfile::TempDir,
}

impl Drop for Hostile {
    fn drop(&mut self) {
        let _ = self.sandbox.remove_subtree();
    }
}

/// Where a test's state and catalogue live: under `/tmp` (development and tests: the private `/tmp` must
/// mount the session's own paths back) or outside it (a production layout).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Layout {
    UnderTmp,
    OutsideTmp,
}

fn hostile_worker(name: &str, layout: Layout) -> Hostile {
    hostile_worker_with(name, layout, |_| {})
}

fn hostile_worker_with(name: &str, layout: Layout, configure: impl FnOnce(&mut WorkerConfig)) -> Hostile {
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
    // A plugin whose command names its script relative to its install directory, outside it (what the demo
    // catalogue's `notes-py` does): kept visible in a private /tmp too.
    let shared = catalogue.join("shared");
    std::fs::create_dir_all(&shared).unwrap();
    for f in ["echo_plugin.py", "confine_probe.py"] {
        std::fs::copy(python_dir().join(f), shared.join(f)).unwrap();
    }
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o755)).unwrap();
    // A native plugin behind a script whose interpreter (a copy of /bin/sh, not part of the install's
    // fingerprint) a test removes once the install is detected: the kernel then cannot execute it.
    let vanish = catalogue.join("noexec");
    std::fs::create_dir_all(&vanish).unwrap();
    std::fs::copy("/bin/sh", vanish.join("interp")).unwrap();
    // The native plugin is copied into the install, so the sandbox sees it wherever the checkout lives (a
    // checkout under /tmp is hidden by the private /tmp).
    std::fs::copy(echo_plugin_bin(), vanish.join("echo")).unwrap();
    let script = format!(
        "#!{}\nexec {} \"$@\"\n",
        vanish.join("interp").display(),
        vanish.join("echo").display()
    );
    std::fs::write(vanish.join("plugin"), script).unwrap();
    for f in ["interp", "plugin", "echo"] {
        std::fs::set_permissions(vanish.join(f), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let entries = entries.into_iter().chain([
        (
            "rel-probe",
            json!([PYTHON, "../shared/echo_plugin.py", "--hostile"]),
            json!({}),
        ),
        (
            "noexec",
            json!([vanish.join("plugin").display().to_string()]),
            json!({}),
        ),
        // The shipped `echo-py`'s shape: a bare script name in the install that is a symlink out of it.
        (
            "link-probe",
            json!([PYTHON, "echo_plugin.py", "--hostile"]),
            json!({}),
        ),
        // More memory than the worker's default limits give (an operator's catalogue may raise them).
        (
            "big-probe",
            json!([
                PYTHON,
                python_dir().join("echo_plugin.py").display().to_string(),
                "--hostile"
            ]),
            json!({"limits": {"memory_bytes": BIG_MEMORY}}),
        ),
        // The shipped `notes-py`'s: that symlink, named through the sibling install.
        (
            "rel-link-probe",
            json!([PYTHON, "../link-probe/echo_plugin.py", "--hostile"]),
            json!({}),
        ),
    ]);
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
    std::os::unix::fs::symlink(
        "../shared/echo_plugin.py",
        catalogue.join("link-probe/echo_plugin.py"),
    )
    .unwrap();
    for p in [root.path(), catalogue.as_path()] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    // Unique within this process too: under `cargo test` every test's worker lives in it, and a worker removes
    // its cgroup subtree (named after its id) when it is dropped.
    static WORKERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = WORKERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut config = test_config(&format!("cf-{name}{n}"));
    config.catalogue_dir = catalogue;
    config.state_dir = root.path().join("state");
    configure(&mut config);
    let (catalogue, problems) = Catalogue::load(&config.catalogue_dir, &LoadOptions::from_env()).unwrap();
    assert!(problems.is_empty(), "{problems:?}");
    let sandbox = Sandbox::new(&config).expect("sandbox (cgroups, namespaces, as root)");
    assert_eq!(sandbox.confinement(), (true, true));
    let worker_id = config.worker_id.clone();
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
        worker_id,
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

/// How the attacking plugin's process is started.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Start {
    /// From a waiting sandbox stub (the worker's fast path: `confinement.stub_pool`).
    Stub,
    /// Spawned directly by the worker (`confinement.stub_pool = 0`, or no stub waiting).
    Direct,
}

/// `confine_probe.py`'s `syscalls()` from this test's own, unconfined process: what the kernel answers without
/// the worker's filters.
fn unconfined_syscalls() -> Value {
    let out = std::process::Command::new(PYTHON)
        .arg(python_dir().join("confine_probe.py"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The strings of a report's array.
fn strings(array: &Value) -> Vec<&str> {
    array
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect()
}

/// The attacks both dialects must lose, whichever way the plugin was started.
async fn both_dialects_lose(tool_id: &str, layout: Layout, start: Start) {
    // A descriptor of the worker's process without close-on-exec (what `loopback_up`'s socket was, on a thread
    // racing the fork of a plugin), open before the worker starts its stubs: neither a stub nor a direct spawn
    // hands it on.
    let leaked =
        rustix::io::dup(std::fs::File::open(python_dir().join("confine_probe.py")).unwrap()).unwrap();
    assert!(
        !rustix::io::fcntl_getfd(&leaked)
            .unwrap()
            .contains(rustix::io::FdFlags::CLOEXEC)
    );
    let w = hostile_worker_with(&tool_id[..4], layout, |c| {
        if start == Start::Direct {
            c.confinement.stub_pool = 0;
        }
    });
    assert_eq!(w.sandbox.stubs_enabled(), start == Start::Stub);
    w.sandbox.start_stubs();
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
    // Every world-writable directory of the host — the usual ones, and one an operator left open outside /tmp
    // — and the host's /dev/shm, holding a marker.
    let left_open = tempfile::tempdir_in("/var/tmp").unwrap();
    std::fs::set_permissions(left_open.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
    let mut shared: Vec<PathBuf> = ["/var/tmp", "/run/lock", "/var/lock"]
        .iter()
        .filter_map(|d| std::fs::canonicalize(d).ok())
        .filter(|d| std::fs::metadata(d).is_ok_and(|m| m.is_dir() && m.permissions().mode() & 0o002 != 0))
        .collect();
    shared.push(left_open.path().to_path_buf());
    shared.sort();
    shared.dedup();
    // Tests of this file run at once: a name of this one's own.
    let name = format!(
        "fleet-confine-{}-{tool_id}-{layout:?}-{start:?}",
        std::process::id()
    );
    let shm_marker = PathBuf::from(format!("/dev/shm/{name}-host"));
    let host_shm = Path::new("/dev/shm").is_dir();
    if host_shm {
        std::fs::write(&shm_marker, "host shm").unwrap();
    }
    let space = w.sandbox.user_space("alice", tool_id).unwrap();
    let own = [
        space.tmpdir.join(&name),
        space.workspace.join(&name),
        Path::new("/tmp").join(&name),
        Path::new("/dev/shm").join(&name),
    ];
    let creates: Vec<PathBuf> = shared
        .iter()
        .map(|d| d.join(&name))
        .chain(own.iter().cloned())
        .collect();
    if start == Start::Stub {
        assert!(
            eventually(GUARD, || w.sandbox.stubs_ready() > 0).await,
            "no sandbox stub became ready"
        );
    }
    let claims = w.sandbox.stub_claims();
    // Another tenant's usage, where the worker (and, unconfined, anyone) reads it.
    let bob_cgroup = cgroup_dir(bob_pid);
    let bob_usage = ["memory.current", "memory.usage_in_bytes"]
        .iter()
        .map(|f| bob_cgroup.join(f))
        .find(|p| p.is_file())
        .expect("bob's session's memory usage file");
    // Host devices outside the minimal /dev, there for the worker (which of them this machine has; the listing
    // of /dev below catches any other).
    let host_devices: Vec<PathBuf> = [
        "/dev/kmsg",
        "/dev/kvm",
        "/dev/fuse",
        "/dev/loop-control",
        "/dev/vda",
        "/dev/console",
    ]
    .iter()
    .map(PathBuf::from)
    .filter(|p| p.exists())
    .collect();
    assert!(!host_devices.is_empty(), "the host has none of these devices");

    let reads: Vec<PathBuf> = [
        sibling_tmp.join("secret"),
        sibling_tmp.clone(),
        PathBuf::from(format!("/proc/{sibling_pid}/fd/0")),
        bob_usage.clone(),
        PathBuf::from("/dev/urandom"),
        PathBuf::from("/dev/zero"),
    ]
    .into_iter()
    .chain(host_devices.iter().cloned())
    .collect();

    let report = probe(
        &w,
        "alice",
        tool_id,
        json!({
            "connect": targets,
            "pids": [sibling_pid, bob_pid, std::process::id(), 1],
            "read": reads,
            "write": [
                format!("/proc/{sibling_pid}/fd/1"),
                format!("/proc/{bob_pid}/fd/1"),
                "/dev/null".to_owned(),
                "/dev/full".to_owned(),
            ],
            "create": creates,
        }),
    )
    .await;
    let _ = std::fs::remove_file(&marker);
    let _ = std::fs::remove_file(&shm_marker);
    // The attacker was started the way the test says.
    let expected = claims + u64::from(start == Start::Stub);
    assert_eq!(w.sandbox.stub_claims(), expected, "{start:?}");

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
    let tmp = strings(&report["tmp"]);
    assert!(
        !tmp.contains(&marker.file_name().unwrap().to_str().unwrap()),
        "{report}"
    );
    // Files: the host is read-only, every world-writable directory of it included; the plugin writes only to
    // its own TMPDIR and workspace and its private /tmp and /dev/shm, where the host's marker is not.
    for dir in &shared {
        assert_eq!(
            report["create"][dir.join(&name).display().to_string()],
            "EROFS",
            "{report}"
        );
    }
    for path in &own {
        assert_eq!(report["create"][path.display().to_string()], "ok", "{report}");
    }
    assert!(
        !report["shm"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f.as_str() == shm_marker.file_name().and_then(|n| n.to_str())),
        "{report}"
    );
    // seccomp: no user namespace, no mount, no ptrace, no chroot.
    for call in ["unshare_newuser", "mount", "ptrace", "chroot"] {
        assert_eq!(report[call], "EPERM", "{call}: {report}");
    }
    // ... and no side door around the filter. Without it this kernel answers an x32 number with ENOSYS (x32
    // off) or runs it (x32 on); confined, the guard refuses it with EPERM. An i386 call (`int 0x80`) runs
    // unconfined where the kernel emulates i386; confined, it kills the caller.
    let unconfined = unconfined_syscalls();
    assert!(
        ["ENOSYS", "ok"].contains(&unconfined["x32_getpid"].as_str().unwrap()),
        "{unconfined}"
    );
    assert_eq!(report["x32_getpid"], "EPERM", "{report}");
    if unconfined["i386_getpid"] == "ok" {
        assert_eq!(report["i386_getpid"], "SIGSYS", "{report}");
    } else {
        eprintln!(
            "this kernel runs no i386 call ({unconfined}): the foreign-architecture attack is not tried"
        );
    }
    // What the view shows of the host: under /sys/fs/cgroup only its own session's cgroup, as the root of each
    // of the worker's hierarchies (a cgroup namespace rooted there, and new mounts), so no other tenant and its
    // own limit; and a minimal /dev whose devices work. Collected, so one run without the confinement shows
    // every difference.
    let own_cgroup = cgroup_dir(u32::try_from(report["pid"].as_u64().unwrap()).unwrap());
    let own_limit = ["memory.max", "memory.limit_in_bytes"]
        .iter()
        .find_map(|f| std::fs::read_to_string(own_cgroup.join(f)).ok())
        .expect("the session's memory limit");
    let mut view = Vec::new();
    // v2: one hierarchy, no directory in the session's cgroup; v1: one directory per hierarchy of the worker's
    // controllers (co-mounted ones named by the host: `cpu,cpuacct`), and none within.
    let controllers = ["memory", "pids", "cpu", "cpuacct", "freezer"];
    let tree = strings(&report["cgroup_tree"]);
    let only_hierarchies = tree
        .iter()
        .all(|d| d.split(',').all(|c| controllers.contains(&c)));
    let v2 = w.sandbox.version() == Some(CgroupVersion::V2);
    if !only_hierarchies || tree.is_empty() != v2 {
        view.push(format!("/sys/fs/cgroup holds {tree:?}"));
    }
    let mut expect = |what: &str, got: &Value, want: Value| {
        if *got != want {
            view.push(format!("{what}: {got} (expected {want})"));
        }
    };
    expect("cgroup names", &report["cgroup_names"], json!([]));
    expect(
        "its own memory limit",
        &report["cgroup_memory_limit"],
        json!(own_limit.trim()),
    );
    expect(
        "another session's usage",
        &report["read"][bob_usage.display().to_string()],
        json!("ENOENT"),
    );
    expect("/proc/self/cgroup", &report["proc_cgroup"], json!(["/"]));
    expect(
        "/dev",
        &report["dev"],
        json!([
            "fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin", "stdout", "tty",
            "urandom", "zero"
        ]),
    );
    for device in &host_devices {
        expect(
            &device.display().to_string(),
            &report["read"][device.display().to_string()],
            json!("ENOENT"),
        );
    }
    for device in ["/dev/urandom", "/dev/zero"] {
        expect(device, &report["read"][device], json!("ok"));
    }
    for device in ["/dev/null", "/dev/full"] {
        expect(device, &report["write"][device], json!("ok"));
    }
    expect("a pseudo-terminal", &report["pty"], json!("ok"));
    assert!(view.is_empty(), "{view:#?}\n{report}");
    // Descriptors: its stdio and nothing else — not the worker's leaked one, not a stub's status pipe.
    let fds: Vec<&str> = report["fds"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(fds, ["0", "1", "2"], "{report}");
    drop(leaked);
    assert!(alive(sibling_pid) && alive(bob_pid));
    w.pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executa_plugin_reaches_nothing_outside_its_sandbox() {
    both_dialects_lose("exec-probe", Layout::OutsideTmp, Start::Stub).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_animus_plugin_reaches_nothing_outside_its_sandbox() {
    both_dialects_lose("animus-probe", Layout::OutsideTmp, Start::Stub).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executa_plugin_installed_under_tmp_reaches_nothing_outside_its_sandbox() {
    both_dialects_lose("exec-probe", Layout::UnderTmp, Start::Stub).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_animus_plugin_installed_under_tmp_reaches_nothing_outside_its_sandbox() {
    both_dialects_lose("animus-probe", Layout::UnderTmp, Start::Stub).await;
}

/// The same attacks against plugins the worker spawned itself (no stub): the direct path confines exactly as
/// the stubs do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directly_spawned_executa_plugin_reaches_nothing_outside_its_sandbox() {
    both_dialects_lose("exec-probe", Layout::OutsideTmp, Start::Direct).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directly_spawned_animus_plugin_installed_under_tmp_reaches_nothing_outside_its_sandbox() {
    both_dialects_lose("animus-probe", Layout::UnderTmp, Start::Direct).await;
}

/// A command naming its script relative to the install directory starts in its sandbox wherever the
/// catalogue lives (under /tmp, the private /tmp keeps the script's directory).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_relative_to_its_install_starts_confined() {
    for layout in [Layout::UnderTmp, Layout::OutsideTmp] {
        let w = hostile_worker("rel", layout);
        for tool_id in ["rel-probe", "link-probe", "rel-link-probe"] {
            let report = probe(&w, "dave", tool_id, json!({})).await;
            assert_eq!(report["proc_foreign"], 0, "{tool_id}: {report}");
        }
        w.pool.shutdown().await;
    }
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
        ..UserLimits::default()
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

/// The project's own test host: a network namespace joined to this one by a veth pair (`host_end` here,
/// `test_host` there, a /30 of 198.18.0.0/16 of its own) with a small HTTP server on `test_host:TEST_PORT`.
/// No traffic leaves the machine.
struct TestHost {
    netns: String,
    /// The /30 both ends are in.
    cidr: String,
    host_end: String,
    test_host: String,
}

const TEST_PORT: u16 = 8080;
const TEST_BODY: &str = "hello from the test host";

fn ip(args: &[&str]) {
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .expect("ip (iproute2)");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl TestHost {
    fn start() -> TestHost {
        static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        // A namespace left by a killed run of this test holds addresses it no longer needs.
        let listed = std::process::Command::new("ip")
            .args(["netns", "list"])
            .output()
            .unwrap();
        for name in String::from_utf8_lossy(&listed.stdout).split_whitespace() {
            let owner = name
                .strip_prefix("ca-egress-")
                .and_then(|rest| rest.split('-').next())
                .and_then(|pid| pid.parse::<u32>().ok());
            if owner.is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists()) {
                let _ = std::process::Command::new("ip")
                    .args(["netns", "del", name])
                    .status();
            }
        }
        let (id, seq) = (
            std::process::id(),
            SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        );
        // One /30 per (process, test host): concurrent test processes never share addresses.
        let block = (id.wrapping_mul(4).wrapping_add(seq) % 16_384) * 4;
        let (a, b) = (block / 256, block % 256);
        let host = TestHost {
            netns: format!("ca-egress-{id}-{seq}"),
            cidr: format!("198.18.{a}.{b}/30"),
            host_end: format!("198.18.{a}.{}", b + 1),
            test_host: format!("198.18.{a}.{}", b + 2),
        };
        let (here, there) = (format!("cae{id}x{seq}h"), format!("cae{id}x{seq}n"));
        ip(&["netns", "add", &host.netns]);
        ip(&["link", "add", &here, "type", "veth", "peer", "name", &there]);
        ip(&["link", "set", &there, "netns", &host.netns]);
        ip(&["addr", "add", &format!("{}/30", host.host_end), "dev", &here]);
        ip(&["link", "set", &here, "up"]);
        let inside = format!("{}/30", host.test_host);
        for args in [
            vec!["addr", "add", inside.as_str(), "dev", there.as_str()],
            vec!["link", "set", there.as_str(), "up"],
            vec!["link", "set", "lo", "up"],
        ] {
            let mut full = vec!["-n", host.netns.as_str()];
            full.extend(args);
            ip(&full);
        }
        let ns_path = format!("/run/netns/{}", host.netns);
        let bind = host.test_host.clone();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let ns = std::fs::File::open(&ns_path).unwrap();
            rustix::thread::move_into_link_name_space(
                std::os::fd::AsFd::as_fd(&ns),
                Some(rustix::thread::LinkNameSpaceType::Network),
            )
            .unwrap();
            let listener = TcpListener::bind((bind.as_str(), TEST_PORT)).unwrap();
            ready_tx.send(()).unwrap();
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                use std::io::{Read as _, Write as _};
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).is_ok_and(|n| n == 1) {
                    head.push(byte[0]);
                }
                let _ = write!(
                    stream,
                    "HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n{TEST_BODY}",
                    TEST_BODY.len()
                );
            }
        });
        ready_rx.recv_timeout(GUARD).expect("the test host listens");
        host
    }
}

impl Drop for TestHost {
    fn drop(&mut self) {
        // Deleting the namespace deletes the veth pair with it.
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.netns])
            .status();
    }
}

/// An egress-granted plugin reaches a test host through the worker's proxy — and still not NATS, the metadata
/// address, the worker's own addresses or anything directly; a tool of the same user without the grant has no
/// way out at all.
async fn egress_is_granted_by_the_operator_only(tool_id: &str) {
    let host = TestHost::start();
    let cidr = host.cidr.clone();
    let w = hostile_worker_with(&format!("eg{}", &tool_id[..2]), Layout::OutsideTmp, |c| {
        c.egress.tools = vec!["exec-probe".into(), "animus-probe".into()];
        c.egress.allow_cidrs = vec![cidr.parse().unwrap()];
    });
    let nats_dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start(nats_dir.path()).expect("nats-server (run scripts/test.sh once)");
    let nats_target = format!("127.0.0.1:{}", nats.port());
    let test_host = format!("{}:{TEST_PORT}", host.test_host);
    let own = format!("{}:{TEST_PORT}", host.host_end);
    // From the worker's side the test host answers: what the ungranted plugin is refused is really there.
    std::net::TcpStream::connect(&test_host).expect("the test host answers from the worker's namespace");
    let url = format!("http://{test_host}/");
    let mut tunnels = vec![
        test_host.clone(),
        nats_target.clone(),
        "169.254.169.254:80".to_owned(),
        own.clone(),
        "203.0.113.9:80".to_owned(),
    ];
    let machine = host_address().map(|a| format!("{a}:{}", nats.port()));
    tunnels.extend(machine.clone());
    let request = json!({
        "connect": [test_host, nats_target],
        "tunnel": tunnels,
        "fetch": [url],
    });
    let report = probe(&w, "alice", tool_id, request.clone()).await;

    assert_eq!(
        report["proxy_env"],
        format!("http://127.0.0.1:{}", fleet_worker::egress::EGRESS_PROXY_PORT)
    );
    // Through the proxy: the test host, by CONNECT and by a proxied plain-HTTP request.
    assert_eq!(report["tunnel"][&test_host]["status"], "200", "{report}");
    assert_eq!(report["tunnel"][&test_host]["body"], TEST_BODY, "{report}");
    assert_eq!(report["fetch"][&url]["status"], 200, "{report}");
    assert_eq!(report["fetch"][&url]["body"], TEST_BODY, "{report}");
    // Refused by the proxy: NATS on loopback, the metadata address, the worker's own address (inside the
    // allowed range), a private range not opened, the machine's own address.
    for refused in tunnels.iter().skip(1) {
        assert_eq!(report["tunnel"][refused]["status"], "403", "{refused}: {report}");
    }
    // Directly: still no route out, and the plugin's loopback is its own.
    assert_eq!(report["connect"][&test_host], "ENETUNREACH", "{report}");
    assert_eq!(report["connect"][&nats_target], "ECONNREFUSED", "{report}");

    let counters = w.sandbox.egress_counters();
    assert_eq!(counters.connected.load(std::sync::atomic::Ordering::Relaxed), 2);
    let refusals: std::collections::HashMap<_, _> = counters.refusals().into_iter().collect();
    assert_eq!(refusals["loopback"], 1);
    assert_eq!(refusals["link_local"], 1);
    assert_eq!(refusals["private"], 1);
    assert_eq!(refusals["worker_address"], 1 + u64::from(machine.is_some()));

    // The same fixture as a tool without the grant: no proxy, no route.
    let ungranted = probe(&w, "alice", "sibling", request).await;
    assert_eq!(ungranted["proxy_env"], Value::Null, "{ungranted}");
    assert_eq!(ungranted["tunnel"][&test_host], "no proxy", "{ungranted}");
    assert_eq!(ungranted["connect"][&test_host], "ENETUNREACH", "{ungranted}");
    assert!(ungranted["fetch"][&url]["error"].is_string(), "{ungranted}");
    w.pool.shutdown().await;
    drop(host);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_egress_granted_executa_plugin_reaches_a_test_host_but_not_nats() {
    egress_is_granted_by_the_operator_only("exec-probe").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_egress_granted_animus_plugin_reaches_a_test_host_but_not_nats() {
    egress_is_granted_by_the_operator_only("animus-probe").await;
}

/// `fleet probe` runs a plugin confined as the worker does: a uid of its own, no network, its own tree in
/// `/proc`, the seccomp profile — and says so in its report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_probe_runs_the_plugin_confined() {
    let sandbox = fleet::probe::ProbeSandbox::new().expect("the probe's sandbox (as root)");
    let script = python_dir().join("echo_plugin.py").display().to_string();
    let args = json!({"connect": ["169.254.169.254:80"], "pids": [std::process::id(), 1]});
    let opts = fleet::probe::ProbeOptions {
        command: vec![PYTHON.into(), script, "--hostile".into()],
        invoke: Some(("confine_probe".into(), serde_json::from_value(args).unwrap())),
        invoke_timeout: GUARD,
        sandbox: Some(Arc::new(sandbox)),
    };
    let report = tokio::time::timeout(GUARD, fleet::probe::run(&opts))
        .await
        .expect("failure guard")
        .unwrap();
    assert!(report.confined);
    let invoke = report.invoke.unwrap();
    assert_eq!(invoke["success"], true, "{invoke}");
    let data = &invoke["data"];
    assert_ne!(data["uid"], 0, "{data}");
    assert_eq!(data["connect"]["169.254.169.254:80"], "ENETUNREACH", "{data}");
    assert_eq!(data["proc_foreign"], 0, "{data}");
    assert_eq!(data["pids"][std::process::id().to_string()], "absent", "{data}");
    assert_eq!(data["unshare_newuser"], "EPERM", "{data}");
    assert_eq!(data["cgroup_names"], json!([]), "{data}");
    assert_eq!(data["proc_cgroup"], json!(["/"]), "{data}");
    assert!(
        !data["dev"].as_array().unwrap().contains(&json!("kmsg")),
        "{data}"
    );
    // None of the caller's variables (cargo's CARGO_* among them) but the worker's own allow-list.
    let allowed = [
        "PATH",
        "LANG",
        "LC_ALL",
        "TZ",
        "HOME",
        "TMPDIR",
        "ANNA_WORKSPACE_DIR",
    ];
    assert!(
        std::env::vars().any(|(k, _)| k.starts_with("CARGO")),
        "the test runs under cargo"
    );
    for key in data["env_keys"].as_array().unwrap() {
        let key = key.as_str().unwrap();
        assert!(allowed.contains(&key), "the probed plugin got {key}: {data}");
    }
}

/// Network namespaces made ahead of need go to one session each: no two plugins — of one user or of two, made
/// ahead (a pooled namespace, `confinement.netns_pool`, or a sandbox stub's, `confinement.stub_pool`) or at
/// spawn once none waits — ever share a loopback.
async fn every_session_has_a_network_namespace_of_its_own(start: Start) {
    let mut config: WorkerConfig = test_config(&format!("netns-{start:?}"));
    match start {
        Start::Direct => {
            config.confinement.stub_pool = 0;
            config.confinement.netns_pool = 2;
        }
        Start::Stub => config.confinement.stub_pool = 2,
    }
    let plugins = [
        Plugin::echo("n1", &[]),
        Plugin::echo("n2", &[]),
        Plugin::echo("n3", &[]),
    ];
    let w = TestWorker::start(config, &plugins);
    let ns_of = |pid: u32| std::fs::read_link(format!("/proc/{pid}/ns/net")).unwrap();
    let worker_ns = ns_of(std::process::id());
    w.sandbox.start_stubs();
    let ready = || match start {
        Start::Direct => w.sandbox.netns_pool_ready() == 2,
        Start::Stub => w.sandbox.stubs_ready() == 2,
    };
    assert!(eventually(GUARD, ready).await, "the pool fills up");
    // More sessions than the pool holds, so some namespaces come from it and some are made at spawn.
    let mut seen = std::collections::HashSet::new();
    for user in ["alice", "bob"] {
        for tool in ["n1", "n2", "n3"] {
            let s = w.pool.prewarm(user, tool, GUARD).await.unwrap();
            let ns = ns_of(s.pid().unwrap());
            assert_ne!(ns, worker_ns, "{user}/{tool} is in the worker's namespace");
            assert!(seen.insert(ns.clone()), "{user}/{tool} shares {ns:?}");
        }
    }
    assert_eq!(seen.len(), 6);
    if start == Start::Stub {
        assert!(w.sandbox.stub_claims() >= 2, "the waiting stubs were used");
    }
    // A restarted process of a session never joins another session's namespace: with a pooled namespace it
    // joins its session's own again; a stub's namespace is the stub's, so a restart gets a new one.
    let s = w.pool.prewarm("alice", "n1", GUARD).await.unwrap();
    let before = ns_of(s.pid().unwrap());
    let pid = s.pid().unwrap();
    assert!(matches!(
        call(&w, "alice", "n1", req("crash", json!({}))).await,
        Err(InvokeError::ProcessExited { .. })
    ));
    let again = w.pool.prewarm("alice", "n1", GUARD).await.unwrap();
    assert!(eventually(GUARD, || again.pid().is_some_and(|p| p != pid)).await);
    let after = ns_of(again.pid().unwrap());
    match start {
        Start::Direct => assert_eq!(after, before),
        Start::Stub => {
            assert_ne!(after, worker_ns);
            assert!(seen.insert(after.clone()), "the restart shares {after:?}");
        }
    }
    w.pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_session_has_a_network_namespace_of_its_own_from_the_netns_pool() {
    every_session_has_a_network_namespace_of_its_own(Start::Direct).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_session_has_a_network_namespace_of_its_own_from_sandbox_stubs() {
    every_session_has_a_network_namespace_of_its_own(Start::Stub).await;
}

/// A plugin the kernel can no longer execute (its script's interpreter went away after the install was
/// detected): the next session's start fails at once with the `exec`'s own error, as a stopped session (no
/// restarts), whether a stub or the worker ran the `exec`.
async fn an_unexecutable_program_fails_the_start(start: Start) {
    let w = hostile_worker_with("noexec", Layout::OutsideTmp, |c| {
        if start == Start::Direct {
            c.confinement.stub_pool = 0;
        }
    });
    w.sandbox.start_stubs();
    w.pool.prewarm("erin", "noexec", GUARD).await.unwrap();
    std::fs::remove_file(w._root.path().join("catalogue/noexec/interp")).unwrap();
    if start == Start::Stub {
        assert!(eventually(GUARD, || w.sandbox.stubs_ready() > 0).await);
    }
    let claims = w.sandbox.stub_claims();
    match w.pool.prewarm("frank", "noexec", GUARD).await {
        Err(PoolError::Invoke(InvokeError::Stopped(msg))) => {
            assert!(msg.contains("No such file or directory"), "{msg}");
            assert!(msg.contains("noexec/plugin"), "{msg}");
        }
        other => panic!("expected a stopped session, got {other:?}"),
    }
    assert_eq!(w.sandbox.stub_claims(), claims + u64::from(start == Start::Stub));
    // The next session of another plugin still starts.
    let s = w.pool.prewarm("erin", "sibling", GUARD).await.unwrap();
    assert!(s.pid().is_some());
    w.pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unexecutable_program_fails_the_start_from_a_stub() {
    an_unexecutable_program_fails_the_start(Start::Stub).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unexecutable_program_fails_the_start_of_a_direct_spawn() {
    an_unexecutable_program_fails_the_start(Start::Direct).await;
}

/// A stub program that is not one (it exits before it is ready): the worker gives the stubs up, logs it, and
/// spawns every plugin itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_stub_program_falls_back_to_direct_spawns() {
    let w = hostile_worker_with("badstub", Layout::OutsideTmp, |c| {
        c.sandbox_stub = Some(PathBuf::from("/bin/true"));
    });
    w.sandbox.start_stubs();
    assert!(eventually(GUARD, || !w.sandbox.stubs_enabled()).await);
    let report = probe(&w, "frank", "exec-probe", json!({})).await;
    assert_eq!(report["proc_foreign"], 0, "{report}");
    assert_eq!(w.sandbox.stub_claims(), 0);
    w.pool.shutdown().await;
}

/// The pids of `w`'s waiting sandbox stubs: children of this test process started with the stub argument, in
/// cgroups named after `w`'s worker.
fn waiting_stubs(w: &Hostile) -> Vec<u32> {
    let me = std::process::id();
    // This worker's only: under `cargo test` the other tests' workers live in this process too.
    let ours = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/cgroup")).is_ok_and(|c| c.contains(&w.worker_id))
    };
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let is_stub = cmdline
            .split(|b| *b == 0)
            .any(|arg| arg == fleet_worker::sandbox::STUB_ARG.as_bytes());
        if ppid == Some(me) && is_stub && alive(pid) && ours(pid) {
            pids.push(pid);
        }
    }
    pids
}

/// The `big-probe` install's memory limit: above the test worker's default.
const BIG_MEMORY: u64 = 1 << 30;

/// A user's first session adopts a seated stub (`sandbox/seat.rs`): its plugin runs in the seat's session cgroup,
/// inside the seat's ceiling, which is now that user's — nothing was migrated. The same user's next session
/// makes its cgroup in that ceiling and the stub it takes joins it; the seat that stub left is removed, and
/// another user gets a seat of their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_users_first_session_adopts_a_seat_and_the_next_joins_its_ceiling() {
    let w = hostile_worker_with("seats", Layout::OutsideTmp, |c| {
        c.confinement.stub_pool = 2;
    });
    w.sandbox.start_stubs();
    assert!(eventually(GUARD, || w.sandbox.stubs_ready() == 2).await);
    let seat_of = |dir: &Path| {
        dir.parent()
            .unwrap()
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned()
    };

    let first = w.pool.prewarm("ivy", "sibling", GUARD).await.unwrap();
    let first_cg = cgroup_dir(first.pid().unwrap());
    assert_eq!(first_cg.file_name().unwrap(), "seat", "{}", first_cg.display());
    let ceiling = seat_of(&first_cg);
    assert!(ceiling.starts_with("user-seat"), "{ceiling}");
    let subtree = first_cg.parent().unwrap().parent().unwrap().to_path_buf();

    let second = w.pool.prewarm("ivy", "exec-probe", GUARD).await.unwrap();
    let second_cg = cgroup_dir(second.pid().unwrap());
    assert_ne!(second_cg, first_cg);
    assert_eq!(
        seat_of(&second_cg),
        ceiling,
        "the second session is in ivy's ceiling"
    );
    assert_eq!(w.sandbox.stub_claims(), 2, "both started from stubs");

    // No seat is left empty: the one the second stub left is removed (seats being made are filled at once).
    let empty_seats = || {
        std::fs::read_dir(&subtree)
            .unwrap()
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().starts_with("user-seat"))
            .filter(|e| {
                std::fs::read_to_string(e.path().join("seat/cgroup.procs")).is_ok_and(|p| p.trim().is_empty())
            })
            .count()
    };
    assert!(
        eventually(GUARD, || empty_seats() == 0).await,
        "an emptied seat was left"
    );

    // Another user gets a seat of their own, adapted to a tool that may use more memory than the seat's
    // default (v1: the memory+swap limit is raised first).
    let other = w.pool.prewarm("jay", "big-probe", GUARD).await.unwrap();
    let other_cg = cgroup_dir(other.pid().unwrap());
    assert_eq!(other_cg.file_name().unwrap(), "seat", "{}", other_cg.display());
    assert_ne!(seat_of(&other_cg), ceiling, "jay has a ceiling of their own");
    let limit = ["memory.limit_in_bytes", "memory.max"]
        .iter()
        .find_map(|f| std::fs::read_to_string(other_cg.join(f)).ok())
        .unwrap();
    assert_eq!(limit.trim(), BIG_MEMORY.to_string());
    let pids = [first.pid(), second.pid(), other.pid()].map(Option::unwrap);
    w.pool.shutdown().await;
    assert!(pids.iter().all(|p| !alive(*p)));
}

/// Stubs killed while they wait (an operator's `kill`, the OOM killer) cost nothing but speed: the next
/// session is spawned directly and serves, and the pool makes new stubs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_waiting_stubs_fall_back_to_a_direct_spawn() {
    let w = hostile_worker_with("killstub", Layout::OutsideTmp, |c| {
        c.confinement.stub_pool = 2;
    });
    w.sandbox.start_stubs();
    assert!(eventually(GUARD, || w.sandbox.stubs_ready() == 2).await);
    let stubs = waiting_stubs(&w);
    assert_eq!(stubs.len(), 2, "{stubs:?}");
    for pid in &stubs {
        rustix::process::kill_process(
            rustix::process::Pid::from_raw(i32::try_from(*pid).unwrap()).unwrap(),
            rustix::process::Signal::KILL,
        )
        .unwrap();
    }
    assert!(eventually(GUARD, || stubs.iter().all(|p| !alive(*p))).await);
    let report = probe(&w, "gina", "exec-probe", json!({})).await;
    assert_eq!(report["proc_foreign"], 0, "{report}");
    assert_eq!(w.sandbox.stub_claims(), 0, "a dead stub was counted as a start");
    // The pool refills with live stubs, and the next session starts from one.
    assert!(
        eventually(GUARD, || w.sandbox.stubs_ready() > 0
            && !waiting_stubs(&w).is_empty())
        .await
    );
    let s = w.pool.prewarm("gina", "sibling", GUARD).await.unwrap();
    assert!(s.pid().is_some());
    assert_eq!(w.sandbox.stub_claims(), 1);
    w.pool.shutdown().await;
}

/// A worker that stops leaves no sandbox stub behind: `Pool::shutdown` kills and reaps every waiting stub (and
/// the one the pool is making to replace a stub just taken) before it returns — so `fleet up` that printed
/// "stopped" has none left — and makes no more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_stops_leaves_no_stub_behind() {
    let w = hostile_worker_with("stopstub", Layout::OutsideTmp, |c| {
        c.confinement.stub_pool = 2;
    });
    w.sandbox.start_stubs();
    assert!(eventually(GUARD, || w.sandbox.stubs_ready() == 2).await);
    let mut stubs = waiting_stubs(&w);
    assert_eq!(stubs.len(), 2, "{stubs:?}");
    // A session takes one: the pool starts its replacement while it stops.
    let s = w.pool.prewarm("hana", "sibling", GUARD).await.unwrap();
    let plugin = s.pid().unwrap();
    stubs.retain(|p| *p != plugin);
    w.pool.shutdown().await;
    // Reaped, not only signalled: no child of this process left from them, not even a zombie.
    let me = std::process::id();
    let children_left: Vec<u32> = stubs
        .iter()
        .copied()
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
                stat.rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                    .is_some_and(|ppid| ppid == me.to_string())
            })
        })
        .collect();
    assert!(
        children_left.is_empty(),
        "stubs left after the shutdown: {children_left:?}"
    );
    assert!(waiting_stubs(&w).is_empty(), "{:?}", waiting_stubs(&w));
    assert_eq!(w.sandbox.stubs_ready(), 0);
}

/// The bytes of a user's TMPDIRs and workspaces together are capped by the kernel: a plugin writing past its
/// user's cap gets `ENOSPC` at exactly the cap (its other tool's workspace counts), while another user's plugin
/// on the same worker writes its own whole cap at the same moment, and both sessions live on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_writing_past_its_users_disk_gets_enospc_and_another_user_writes_on() {
    const DISK_MIB: u64 = 16;
    const ENOSPC: i64 = 28;
    let mut config: WorkerConfig = test_config("disk");
    config.user_limits.disk_bytes = DISK_MIB << 20;
    // Disks come with a user budget (none is derived on a machine whose worker has no memory limit).
    config.user_budget_bytes = 4 * (config.user_limits.memory_bytes + config.user_limits.disk_bytes);
    let plugins = [Plugin::echo("d1", &[]), Plugin::echo("d2", &[])];
    let w = Arc::new(TestWorker::start(config, &plugins));
    let fill = |user: &'static str, tool: &'static str, name: &'static str, mib: u64, workspace: bool| {
        let w = w.clone();
        async move {
            let out = call(
                &w,
                user,
                tool,
                req("fill", json!({"name": name, "mib": mib, "workspace": workspace})),
            )
            .await
            .unwrap_or_else(|e| panic!("{user}/{tool}: {e}"));
            assert!(out.success(), "{:?}", out.error_message());
            out.data().unwrap()
        }
    };
    // Half of alice's cap in one tool's workspace.
    let half = fill("alice", "d1", "half", DISK_MIB / 2, true).await;
    assert_eq!(half, json!({"written": (DISK_MIB / 2) << 20, "errno": null}));
    let alice_pid = w.pool.session("alice", "d2").unwrap();
    let bob = w.pool.session("bob", "d1").unwrap();
    // At the same moment: alice's other tool tries her whole cap in its TMPDIR, bob writes exactly his.
    let (over, within) = tokio::join!(
        fill("alice", "d2", "over", DISK_MIB, false),
        fill("bob", "d1", "all", DISK_MIB, false),
    );
    assert_eq!(
        over,
        json!({"written": (DISK_MIB / 2) << 20, "errno": ENOSPC}),
        "stopped at the user's cap, both tools and both directories counted"
    );
    assert_eq!(within, json!({"written": DISK_MIB << 20, "errno": null}));
    // Nothing else noticed: both sessions serve on, alice's in the same process.
    let pid = alice_pid.pid();
    let echo = call(&w, "alice", "d2", req("echo", json!({"x": 1})))
        .await
        .unwrap();
    assert!(echo.success());
    assert_eq!(alice_pid.pid(), pid);
    assert!(
        call(&w, "bob", "d1", req("echo", json!({"x": 1})))
            .await
            .unwrap()
            .success()
    );
    assert!(bob.pid().is_some());
    w.pool.shutdown().await;
}
