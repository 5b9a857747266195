//! The sandbox against real cgroups and real processes. Needs root and a machine with cgroups (v1 on the
//! development VM; the same tests exercise v2 where it is mounted).
//!
//! Every test has its own worker id (test name + pid) and state directory, so tests run in parallel; a
//! [`Fixture`] removes the worker's whole cgroup subtree — killing whatever is left in it — when it is dropped,
//! also when a test fails. Waiting on the kernel is always polling an observable with a deadline.

use std::collections::{BTreeMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use fleet_worker::config::{IsolationMode, ResourceLimits, RunAs, WorkerConfig};
use fleet_worker::sandbox::{self, Sandbox, SessionCgroup, SpawnPlan, UserSpace};
use rustix::process::Signal;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// Upper bound of every wait on the kernel (a failure guard, not a timing assertion).
const DEADLINE: Duration = Duration::from_secs(20);

const FIRST_UID: u32 = 310_000;

struct Fixture {
    config: WorkerConfig,
    sandbox: Sandbox,
    _state: tempfile::TempDir,
}

impl Fixture {
    fn new(test: &str) -> Fixture {
        let state = tempfile::tempdir().expect("tempdir");
        let config = WorkerConfig {
            worker_id: format!("sbx-{test}-{}", std::process::id()),
            state_dir: state.path().to_path_buf(),
            isolation: IsolationMode::Cgroup,
            run_as: RunAs::PerUser {
                first: FIRST_UID,
                count: 1000,
            },
            ..WorkerConfig::default()
        };
        let sandbox = Sandbox::new(&config).expect("cgroup sandbox (run as root on a machine with cgroups)");
        Fixture {
            config,
            sandbox,
            _state: state,
        }
    }

    fn session(&self, name: &str, limits: ResourceLimits) -> SessionCgroup {
        self.sandbox
            .create_session("fixture-user", name, limits)
            .expect("create_session")
            .expect("isolating sandbox")
    }

    fn subtree_name(&self) -> String {
        format!("cloud-agents-{}", self.config.worker_id)
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        if let Err(e) = self.sandbox.remove_subtree() {
            println!("cleanup of {} failed: {e}", self.config.worker_id);
        }
    }
}

fn limits(memory_bytes: u64, pids_max: u64, cpu_millis: u64) -> ResourceLimits {
    ResourceLimits {
        memory_bytes,
        pids_max,
        cpu_millis,
    }
}

/// Spawns `program args` with `plan`, stdout and stderr piped, killed if the test drops it.
fn spawn(plan: &SpawnPlan, program: &str, args: &[&str]) -> Child {
    spawn_in(plan, program, args, None)
}

fn spawn_in(plan: &SpawnPlan, program: &str, args: &[&str], cwd: Option<&Path>) -> Child {
    let mut cmd = Command::new(program);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    if let Some(cwd) = cwd {
        cmd.current_dir(cwd);
    }
    sandbox::apply(&mut cmd, plan);
    cmd.spawn().expect("spawn")
}

async fn output(child: Child) -> Output {
    tokio::time::timeout(DEADLINE, child.wait_with_output())
        .await
        .expect("process did not exit")
        .expect("wait")
}

/// Polls `done` every few milliseconds until it holds; panics after [`DEADLINE`].
async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn proc_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// `(pgrp, session)` of a process, from `/proc/<pid>/stat` (fields after the parenthesised command).
fn pgrp_and_session(pid: u32) -> (u32, u32) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    let after = &stat[stat.rfind(')').expect("comm") + 1..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    (
        fields[2].parse().expect("pgrp"),
        fields[3].parse().expect("session"),
    )
}

/// The value columns of a `/proc/<pid>/status` line (`Uid:`, `Gid:`, `Groups:`, `NoNewPrivs:`).
fn status_field(pid: u32, key: &str) -> Vec<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let line = status
        .lines()
        .find(|l| l.starts_with(&format!("{key}:")))
        .expect("status line");
    line.split_whitespace().skip(1).map(str::to_owned).collect()
}

/// Every directory named `name` under `/sys/fs/cgroup` (depth-limited walk of all hierarchies).
fn find_cgroup_dirs(name: &str) -> Vec<PathBuf> {
    fn walk(dir: &Path, name: &str, depth: usize, found: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                let path = entry.path();
                if entry.file_name() == name {
                    found.push(path.clone());
                }
                if depth > 0 {
                    walk(&path, name, depth - 1, found);
                }
            }
        }
    }
    let mut found = Vec::new();
    walk(Path::new("/sys/fs/cgroup"), name, 6, &mut found);
    found
}

/// A keyed value (`max 3`) from the first of the session's directories that has `file`.
fn keyed_file(cg: &SessionCgroup, file: &str, key: &str) -> Option<u64> {
    cg.paths().iter().find_map(|dir| {
        let text = std::fs::read_to_string(dir.join(file)).ok()?;
        text.lines()
            .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
    })
}

fn machine_is_v2() -> bool {
    std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers").is_ok_and(|c| c.contains("memory"))
}

#[test]
fn handles_are_send_and_sync() {
    fn send_sync<T: Send + Sync + 'static>() {}
    send_sync::<Sandbox>();
    send_sync::<SessionCgroup>();
    send_sync::<SpawnPlan>();
    send_sync::<sandbox::SandboxError>();
}

#[tokio::test]
async fn detection_reports_the_cgroup_version_and_creates_the_subtree() {
    let f = Fixture::new("detect");
    let expected = if machine_is_v2() { "cgroup_v2" } else { "cgroup_v1" };
    assert_eq!(f.sandbox.mode(), expected);
    let subtree = f.sandbox.subtree_paths();
    assert!(!subtree.is_empty());
    for dir in &subtree {
        assert!(dir.is_dir(), "{}", dir.display());
        assert_eq!(
            dir.file_name().and_then(|n| n.to_str()),
            Some(f.subtree_name().as_str())
        );
    }
    if expected == "cgroup_v1" {
        // memory, pids, cpu, cpuacct, freezer: separate hierarchies here (fewer if co-mounted).
        assert!(subtree.len() >= 3, "{subtree:?}");
        assert_eq!(find_cgroup_dirs(&f.subtree_name()).len(), subtree.len());
    }
    // Nothing but the subtree itself is left by detection's probe.
    assert_eq!(f.sandbox.sweep_stale().expect("sweep"), Default::default());
}

#[tokio::test]
async fn isolation_none_creates_no_cgroups() {
    let state = tempfile::tempdir().expect("tempdir");
    let worker_id = format!("sbx-none-{}", std::process::id());
    let config = WorkerConfig {
        worker_id: worker_id.clone(),
        state_dir: state.path().to_path_buf(),
        isolation: IsolationMode::None,
        run_as: RunAs::Inherit,
        ..WorkerConfig::default()
    };
    let sb = Sandbox::new(&config).expect("sandbox");
    assert_eq!(sb.mode(), "none");
    assert_eq!(sb.version(), None);
    assert!(sb.subtree_paths().is_empty());
    assert!(
        sb.create_session("u", "s", ResourceLimits::default())
            .expect("create")
            .is_none()
    );
    assert_eq!(sb.sweep_stale().expect("sweep"), Default::default());
    assert!(find_cgroup_dirs(&format!("cloud-agents-{worker_id}")).is_empty());

    // Inherit: no uid, directories owned by the worker.
    let us = sb.user_space("u", "t").expect("user_space");
    assert_eq!((us.uid, us.gid), (None, None));
    let meta = std::fs::metadata(&us.workspace).expect("workspace");
    assert_eq!(
        (meta.uid(), meta.mode() & 0o7777),
        (rustix::process::geteuid().as_raw(), 0o700)
    );

    // The fallback kill: the plan still makes the plugin a group leader, and its group is reachable.
    let mut child = spawn(
        &SpawnPlan::new(None, None, None),
        "sh",
        &["-c", "sleep 60 & exec sleep 60"],
    );
    let pid = child.id().expect("pid");
    wait_for("the child to lead its group", || {
        proc_alive(pid) && pgrp_and_session(pid) == (pid, pid)
    })
    .await;
    assert!(sandbox::signal_process_group(pid, Signal::KILL).expect("killpg"));
    let status = tokio::time::timeout(DEADLINE, child.wait())
        .await
        .expect("exit")
        .expect("wait");
    assert_eq!(status.signal(), Some(9));
    // Refused: groups that would hit the worker or every process.
    assert!(sandbox::signal_process_group(0, Signal::TERM).is_err());
    assert!(sandbox::signal_process_group(1, Signal::TERM).is_err());
    assert!(sandbox::signal_process_group(u32::MAX, Signal::TERM).is_err());
    let own_group = rustix::process::getpgrp().as_raw_nonzero().get().unsigned_abs();
    assert!(sandbox::signal_process_group(own_group, Signal::TERM).is_err());
}

#[tokio::test]
async fn spawned_process_is_in_its_cgroup_before_its_first_instruction() {
    let f = Fixture::new("attach");
    let user = f.sandbox.user_space("alice", "tool").expect("user_space");
    let cg = f.session("attach", ResourceLimits::default());
    let plan = SpawnPlan::for_user(Some(&cg), &user);
    let mut child = spawn_in(
        &plan,
        "sh",
        &["-c", "cat /proc/self/cgroup; exec sleep 60"],
        Some(&user.workspace),
    );
    let pid = child.id().expect("pid");

    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut cgroup_lines = Vec::new();
    while let Some(line) = tokio::time::timeout(DEADLINE, lines.next_line())
        .await
        .expect("output")
        .expect("read")
    {
        let last = line.starts_with("0::");
        cgroup_lines.push(line);
        if last {
            break;
        }
    }
    // Inside the user's ceiling cgroup (`user-<user key>`), inside the worker's subtree.
    let suffix = format!("/{}/user-fixture-user/{}", f.subtree_name(), cg.name());
    let controllers: &[&str] = if machine_is_v2() {
        &[""]
    } else {
        &["memory", "pids"]
    };
    for controller in controllers {
        let line = cgroup_lines
            .iter()
            .find(|l| {
                l.split(':')
                    .nth(1)
                    .is_some_and(|c| c.split(',').any(|c| c == *controller))
            })
            .unwrap_or_else(|| panic!("no {controller} line in {cgroup_lines:?}"));
        assert!(line.ends_with(&suffix), "{line} should end with {suffix}");
    }
    assert!(cg.pids().expect("pids").contains(&pid));

    // setsid: own session and process group.
    assert_eq!(pgrp_and_session(pid), (pid, pid));
    // The allocated uid/gid (real, effective, saved, fs), no supplementary groups, no new privileges.
    let uid = user.uid.expect("per-user uid").to_string();
    let gid = user.gid.expect("per-user gid").to_string();
    assert_eq!(status_field(pid, "Uid"), [uid.as_str(); 4]);
    assert_eq!(status_field(pid, "Gid"), [gid.as_str(); 4]);
    assert!(status_field(pid, "Groups").is_empty());
    assert_eq!(status_field(pid, "NoNewPrivs"), ["1"]);

    cg.remove().expect("remove");
    let status = tokio::time::timeout(DEADLINE, child.wait())
        .await
        .expect("exit")
        .expect("wait");
    assert_eq!(status.signal(), Some(9));
}

#[tokio::test]
async fn memory_limit_oom_kills() {
    let f = Fixture::new("oom");
    let cg = f.session("oom", limits(64 << 20, 64, 1000));
    assert_eq!(cg.oom_kills(), 0);
    if !machine_is_v2() {
        // Swap cannot bypass the limit where the kernel accounts it.
        let memsw = cg.paths()[0].join("memory.memsw.limit_in_bytes");
        if memsw.exists() {
            assert_eq!(
                std::fs::read_to_string(memsw).expect("memsw").trim(),
                (64u64 << 20).to_string()
            );
        }
    }
    let child = spawn(
        &SpawnPlan::new(Some(&cg), None, None),
        "/usr/bin/python3",
        &["-c", "b = bytearray(200 << 20)"],
    );
    let out = output(child).await;
    assert_eq!(out.status.signal(), Some(9), "{out:?}");
    assert!(cg.oom_kills() >= 1);
    cg.remove().expect("remove");
}

#[tokio::test]
async fn pids_limit_stops_forks() {
    let f = Fixture::new("pids");
    let max = 8;
    let cg = f.session("pids", limits(256 << 20, max, 1000));
    let script = "for i in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do sleep 60 & done; wait";
    let mut child = spawn(&SpawnPlan::new(Some(&cg), None, None), "sh", &["-c", script]);
    let mut peak = 0;
    let start = Instant::now();
    let status = loop {
        peak = peak.max(cg.usage().expect("usage").pids_current);
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "the shell neither forked 20 times nor failed"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    peak = peak.max(cg.usage().expect("usage").pids_current);
    assert!(peak <= max, "pids_current reached {peak} > {max}");
    // Where the kernel keeps the high-water mark (pids.peak, Linux >= 6.1), it proves "never" exactly.
    let kernel_peak = cg
        .paths()
        .iter()
        .find_map(|d| std::fs::read_to_string(d.join("pids.peak")).ok());
    if let Some(kernel_peak) = kernel_peak {
        let kernel_peak: u64 = kernel_peak.trim().parse().expect("pids.peak");
        assert!(kernel_peak <= max, "pids.peak {kernel_peak} > {max}");
    }
    assert!(
        keyed_file(&cg, "pids.events", "max").is_some_and(|n| n >= 1),
        "pids.events max"
    );
    // The sleeps it did start hold its stderr open: kill them before reading it to the end.
    cg.kill_all().expect("kill_all");
    let mut stderr = String::new();
    tokio::io::AsyncReadExt::read_to_string(&mut child.stderr.take().expect("stderr"), &mut stderr)
        .await
        .expect("stderr");
    assert!(!status.success(), "{status:?} {stderr}");
    assert!(stderr.to_lowercase().contains("fork"), "{stderr}");
    cg.remove().expect("remove");
}

#[tokio::test]
async fn cpu_quota_throttles() {
    let f = Fixture::new("cpu");
    let cg = f.session("cpu", limits(256 << 20, 16, 200));
    let _child = spawn(
        &SpawnPlan::new(Some(&cg), None, None),
        "sh",
        &["-c", "while :; do :; done"],
    );
    wait_for("the spinner to be throttled", || {
        cg.usage().is_ok_and(|u| u.nr_throttled > 0)
    })
    .await;
    let usage = cg.usage().expect("usage");
    assert!(
        usage.cpu_usec > 0 && usage.pids_current == 1 && usage.memory_bytes > 0,
        "{usage:?}"
    );
    cg.remove().expect("remove");
}

#[tokio::test]
async fn kill_all_kills_the_whole_tree_even_ignoring_sigterm() {
    let f = Fixture::new("killall");
    let cg = f.session("killall", ResourceLimits::default());
    // 1 shell + 2 sleeps + 1 inner shell + 2 sleeps, all ignoring SIGTERM (SIG_IGN survives exec).
    let script = r#"trap "" TERM; sleep 60 & sleep 60 & sh -c 'sleep 60 & sleep 60 & wait' & wait"#;
    let mut child = spawn(&SpawnPlan::new(Some(&cg), None, None), "sh", &["-c", script]);
    wait_for("6 processes", || cg.pids().is_ok_and(|p| p.len() == 6)).await;
    let pids = cg.pids().expect("pids");
    assert_eq!(cg.signal_all(Signal::TERM).expect("signal_all"), 6);

    let killed = cg.kill_all().expect("kill_all");
    assert!(killed >= 6, "killed {killed}");
    assert!(cg.pids().expect("pids").is_empty());
    let status = tokio::time::timeout(DEADLINE, child.wait())
        .await
        .expect("exit")
        .expect("wait");
    assert_eq!(status.signal(), Some(9));
    wait_for("every process to be gone and reaped", || {
        pids.iter().all(|p| !proc_alive(*p))
    })
    .await;
    cg.remove().expect("remove");
}

#[tokio::test]
async fn signal_all_reaches_every_process() {
    let f = Fixture::new("signal");
    let cg = f.session("signal", ResourceLimits::default());
    let mut child = spawn(
        &SpawnPlan::new(Some(&cg), None, None),
        "sh",
        &["-c", "sleep 60 & sleep 60 & sleep 60 & wait"],
    );
    wait_for("4 processes", || cg.pids().is_ok_and(|p| p.len() == 4)).await;
    assert_eq!(cg.signal_all(Signal::TERM).expect("signal_all"), 4);
    // Each one dies of that SIGTERM (default action): the cgroup empties without any SIGKILL.
    wait_for("the cgroup to empty", || cg.pids().is_ok_and(|p| p.is_empty())).await;
    let status = tokio::time::timeout(DEADLINE, child.wait())
        .await
        .expect("exit")
        .expect("wait");
    assert_eq!(status.signal(), Some(15));
    cg.remove().expect("remove");
}

#[tokio::test]
async fn sweep_stale_kills_and_removes_what_a_dead_worker_left() {
    let f = Fixture::new("sweep");
    let cg = f.session("left-behind", ResourceLimits::default());
    let paths: Vec<PathBuf> = cg.paths().iter().map(|p| p.to_path_buf()).collect();
    let mut child = spawn(
        &SpawnPlan::new(Some(&cg), None, None),
        "sh",
        &["-c", "sleep 60 & exec sleep 60"],
    );
    wait_for("2 processes", || cg.pids().is_ok_and(|p| p.len() == 2)).await;
    let pids = cg.pids().expect("pids");
    std::mem::forget(cg);

    // A new worker with the same id (a restart after kill -9).
    let successor = Sandbox::new(&f.config).expect("sandbox");
    let report = successor.sweep_stale().expect("sweep");
    assert_eq!(report.cgroups_removed, 1, "{report:?}");
    assert_eq!(report.processes_killed, 2, "{report:?}");
    let status = tokio::time::timeout(DEADLINE, child.wait())
        .await
        .expect("exit")
        .expect("wait");
    assert_eq!(status.signal(), Some(9));
    wait_for("the processes to be gone", || {
        pids.iter().all(|p| !proc_alive(*p))
    })
    .await;
    for path in &paths {
        assert!(!path.exists(), "{} still exists", path.display());
    }
    assert_eq!(successor.sweep_stale().expect("second sweep"), Default::default());
}

#[tokio::test]
async fn user_spaces_are_separate_stable_and_safe() {
    let f = Fixture::new("users");
    let alice = f.sandbox.user_space("alice", "tool-a").expect("alice");
    let bob = f.sandbox.user_space("bob", "tool-a").expect("bob");
    let (Some(a_uid), Some(b_uid)) = (alice.uid, bob.uid) else {
        panic!("per-user uids")
    };
    assert_ne!(a_uid, b_uid);
    assert_eq!((alice.gid, bob.gid), (alice.uid, bob.uid));
    for (space, uid) in [(&alice, a_uid), (&bob, b_uid)] {
        for dir in [&space.workspace, &space.tmpdir] {
            let meta = std::fs::symlink_metadata(dir).expect("dir");
            assert!(meta.is_dir());
            assert_eq!(
                (meta.uid(), meta.gid(), meta.mode() & 0o7777),
                (uid, uid, 0o700),
                "{}",
                dir.display()
            );
        }
    }
    assert_eq!(
        f.sandbox.user_space("alice", "tool-a").expect("again"),
        alice,
        "idempotent"
    );

    // Bob's secret, world-readable itself: only his 0700 workspace protects it.
    let secret = bob.workspace.join("secret");
    std::fs::write(&secret, "bob's").expect("write secret");
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o644)).expect("chmod");
    let as_alice = SpawnPlan::for_user(None, &alice);
    let out = output(spawn_in(
        &as_alice,
        "cat",
        &[secret.to_str().expect("utf-8")],
        Some(&alice.workspace),
    ))
    .await;
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Permission denied"),
        "{out:?}"
    );
    // ...but Alice can use her own workspace and TMPDIR.
    let script = "echo hello > f && cat f && echo x > \"$1\"/g && cat \"$1\"/g";
    let tmp = alice.tmpdir.to_str().expect("utf-8");
    let out = output(spawn_in(
        &as_alice,
        "sh",
        &["-c", script, "sh", tmp],
        Some(&alice.workspace),
    ))
    .await;
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello\nx\n");

    // A second tool of the same user is another identity: it cannot read the first one's TMPDIR or
    // workspace (a uid per (user, tool_id)).
    let alice_other = f.sandbox.user_space("alice", "other").expect("alice other");
    assert_ne!(alice_other.uid, alice.uid);
    assert_ne!(alice_other.workspace, alice.workspace);
    std::fs::write(alice.tmpdir.join("mine"), "tool-a's").expect("write");
    let out = output(spawn_in(
        &SpawnPlan::for_user(None, &alice_other),
        "sh",
        &[
            "-c",
            "cat \"$1\"/mine; ls \"$2\"",
            "sh",
            alice.tmpdir.to_str().expect("utf-8"),
            alice.workspace.to_str().expect("utf-8"),
        ],
        Some(&alice_other.workspace),
    ))
    .await;
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.matches("Permission denied").count(), 2, "{out:?}");

    // Stable across a restart on the same state_dir (the table a predecessor left); a newcomer gets a fresh uid.
    let mut config = f.config.clone();
    // Room for every user below held at once (each costs its memory ceiling and its disk cap).
    config.user_budget_bytes = 16 * (config.user_limits.memory_bytes + config.user_limits.disk_bytes);
    let restarted = Sandbox::new(&config).expect("sandbox");
    let bob_again = restarted.user_space("bob", "tool-a").expect("bob");
    assert_eq!(bob_again.uid, bob.uid);
    let alice_again = restarted.user_space("alice", "other").expect("alice");
    assert_eq!(alice_again.uid, alice_other.uid);
    let carol_space = restarted.user_space("carol", "t").expect("carol");
    let carol = carol_space.uid.expect("uid");
    assert!(carol != a_uid && carol != b_uid && (FIRST_UID..FIRST_UID + 1000).contains(&carol));
    let table: BTreeMap<String, u32> = serde_json::from_str(
        &std::fs::read_to_string(f.config.state_dir.join("uids.json")).expect("uids.json"),
    )
    .expect("json");
    let tool_key = |space: &UserSpace| {
        space
            .tmpdir
            .file_name()
            .and_then(|n| n.to_str())
            .expect("key")
            .to_owned()
    };
    assert_eq!(
        table.get(&format!("{}/{}", alice.user_key, tool_key(&alice))),
        alice.uid.as_ref()
    );
    assert_eq!(table.len(), 4, "{table:?}");

    // Hostile user and tool ids map to distinct, safe keys and directories inside state_dir (a user's directory
    // is its disk, `disks/<worker>/<n>`, with isolation).
    let hostile = [
        "../../etc",
        "a/b",
        "with space",
        "ユーザー",
        "",
        ".",
        "..",
        "nul\0byte",
        "alice",
    ];
    let mut keys = HashSet::new();
    let mut uids = HashSet::new();
    let mut user_dirs = HashSet::new();
    let mut held = Vec::new();
    for user in hostile {
        let space = restarted.user_space(user, "../../tool/../x").expect("user_space");
        let user_dir = space
            .tmpdir
            .parent()
            .and_then(Path::parent)
            .expect("user dir")
            .to_path_buf();
        assert!(
            user_dir.starts_with(&f.config.state_dir),
            "{}",
            user_dir.display()
        );
        assert!(user_dirs.insert(user_dir.clone()), "a directory per user");
        assert_eq!(space.user_key.len(), 32);
        assert!(space.user_key.bytes().all(|b| b.is_ascii_hexdigit()));
        let tool_key = space
            .tmpdir
            .file_name()
            .and_then(|n| n.to_str())
            .expect("tool key");
        assert_eq!(space.workspace, user_dir.join("workspaces").join(tool_key));
        assert_eq!(space.tmpdir.parent(), Some(user_dir.join("tmp").as_path()));
        let tool_key = space
            .tmpdir
            .file_name()
            .and_then(|n| n.to_str())
            .expect("tool key");
        assert!(
            !tool_key.starts_with('.') && !tool_key.contains('/'),
            "{tool_key}"
        );
        assert!(space.tmpdir.is_dir() && space.workspace.is_dir());
        keys.insert(space.user_key.clone());
        uids.insert(space.uid);
        held.push(space);
    }
    assert_eq!(keys.len(), hostile.len());
    assert_eq!(uids.len(), hostile.len());
}

#[tokio::test]
async fn remove_leaves_no_directory_in_any_hierarchy() {
    let f = Fixture::new("remove");
    let cg = f.session("to be removed / with spaces", ResourceLimits::default());
    let name = cg.name().to_owned();
    assert!(
        name.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b)),
        "{name}"
    );
    let paths: Vec<PathBuf> = cg.paths().iter().map(|p| p.to_path_buf()).collect();
    assert_eq!(find_cgroup_dirs(&name).len(), paths.len());
    let _child = spawn(&SpawnPlan::new(Some(&cg), None, None), "sleep", &["60"]);
    wait_for("the sleeper", || cg.pids().is_ok_and(|p| p.len() == 1)).await;
    cg.remove().expect("remove");
    for path in &paths {
        assert!(!path.exists(), "{}", path.display());
    }
    assert!(find_cgroup_dirs(&name).is_empty());
}

#[tokio::test]
#[ignore = "measurement, run by hand: cargo test -p fleet-worker --release --test sandbox spawn_cost -- --ignored --nocapture"]
async fn spawn_cost() {
    const N: u32 = 200;
    let f = Fixture::new("spawn-cost");
    let cg = f.session("spawn-cost", ResourceLimits::default());
    let user = f.sandbox.user_space("bench", "t").expect("user_space");
    async fn spawn_once(plan: Option<&SpawnPlan>) -> Duration {
        let start = Instant::now();
        let mut cmd = Command::new("/bin/true");
        if let Some(plan) = plan {
            sandbox::apply(&mut cmd, plan);
        }
        let status = cmd.status().await.expect("spawn");
        assert!(status.success());
        start.elapsed()
    }
    let setsid_only = SpawnPlan::new(None, None, None);
    let in_cgroup = SpawnPlan::new(Some(&cg), None, None);
    let with_uid = SpawnPlan::for_user(Some(&cg), &user);
    let variants: [(&str, Option<&SpawnPlan>); 4] = [
        ("plain tokio Command", None),
        ("plan: setsid only (no cgroup)", Some(&setsid_only)),
        ("plan: setsid + cgroup", Some(&in_cgroup)),
        ("plan: setsid + cgroup + uid", Some(&with_uid)),
    ];
    for (_, plan) in variants {
        for _ in 0..20 {
            spawn_once(plan).await; // warm-up
        }
    }
    // Interleaved, so drift on the shared VM hits every variant alike.
    let mut total = [Duration::ZERO; 4];
    for _ in 0..N {
        for (sum, (_, plan)) in total.iter_mut().zip(variants) {
            *sum += spawn_once(plan).await;
        }
    }
    let plain = total[0] / N;
    println!(
        "spawn + wait of /bin/true, mean of {N} each ({}):",
        f.sandbox.mode()
    );
    for (sum, (label, _)) in total.iter().zip(variants) {
        let mean = *sum / N;
        println!(
            "  {label:<32} {mean:>10.1?}  ({:.2}x)",
            mean.as_secs_f64() / plain.as_secs_f64()
        );
    }
    cg.remove().expect("remove");
}

fn users_only_config(state: &Path, count: u32) -> WorkerConfig {
    WorkerConfig {
        worker_id: format!("sbx-users-only-{}", std::process::id()),
        state_dir: state.to_path_buf(),
        isolation: IsolationMode::None,
        run_as: RunAs::PerUser {
            first: FIRST_UID,
            count,
        },
        ..WorkerConfig::default()
    }
}

/// Exhaustion only when every uid of the range is held by a live identity; known identities are still served.
#[tokio::test]
async fn uid_range_exhaustion_is_an_error_only_while_every_uid_is_held() {
    let state = tempfile::tempdir().expect("tempdir");
    let sb = Sandbox::new(&users_only_config(state.path(), 2)).expect("sandbox");
    let a = sb.user_space("a", "t").expect("a");
    let b = sb.user_space("b", "t").expect("b");
    assert_eq!(
        (a.uid, b.uid),
        (Some(FIRST_UID), Some(FIRST_UID + 1)),
        "sequential"
    );
    let err = sb.user_space("c", "t").expect_err("range of 2 is full");
    assert!(
        matches!(err, sandbox::SandboxError::UidRangeExhausted { count: 2, .. }),
        "{err}"
    );
    assert_eq!(
        sb.user_space("a", "t").expect("known user").uid,
        a.uid,
        "known users still served"
    );
    // Once an identity is idle (no hold left), its uid goes to the next new one.
    drop(a);
    let c = sb.user_space("c", "t").expect("a's uid was reclaimed");
    assert_eq!(c.uid, Some(FIRST_UID));
    drop((b, c));
}

/// More distinct users than the uid range over time: every idle identity's uid is reused and its directories
/// wiped, so a stream of fresh users never exhausts the range.
#[tokio::test]
async fn a_stream_of_fresh_users_never_exhausts_the_uid_range() {
    const RANGE: u32 = 3;
    let state = tempfile::tempdir().expect("tempdir");
    let sb = Sandbox::new(&users_only_config(state.path(), RANGE)).expect("sandbox");
    // One user stays live throughout: its uid is never handed to anyone else.
    let resident = sb.user_space("resident", "t").expect("resident");
    let mut seen = HashSet::new();
    for i in 0..(RANGE * 10) {
        let user = format!("churn-{i}");
        let a = sb.user_space(&user, "t1").expect("never exhausted");
        let b = sb.user_space(&user, "t2").expect("never exhausted");
        assert_ne!(a.uid, resident.uid, "a live identity's uid is never reused");
        assert_ne!(b.uid, resident.uid);
        assert_ne!(a.uid, b.uid, "two live identities never share a uid");
        std::fs::write(a.tmpdir.join("secret"), user.as_bytes()).expect("write");
        std::fs::write(b.workspace.join("secret"), user.as_bytes()).expect("write");
        seen.extend([a.uid, b.uid]);
        let dirs = [a.tmpdir.clone(), a.workspace.clone(), b.tmpdir.clone()];
        drop((a, b));
        for d in dirs {
            assert!(
                !d.exists(),
                "an idle identity's directory is wiped: {}",
                d.display()
            );
        }
        let user_dir = state.path().join("users").join(names_user_key(&user));
        assert!(!user_dir.exists(), "an idle user's directory is wiped");
    }
    assert_eq!(seen.len(), 2, "the two free uids were reused: {seen:?}");
    let table: BTreeMap<String, u32> =
        serde_json::from_slice(&std::fs::read(state.path().join("uids.json")).expect("uids.json"))
            .expect("json");
    assert_eq!(
        table.values().copied().collect::<Vec<_>>(),
        vec![resident.uid.unwrap()],
        "only the live identity keeps an entry"
    );
}

/// The user key (`UserSpace::user_key`) of `user`, through the sandbox's own function.
fn names_user_key(user: &str) -> String {
    fleet_proto::api::user_key(user)
}

/// Entries a previous worker left in `uids.json` (its users not live here) are reclaimed when the range is full.
#[tokio::test]
async fn a_predecessors_idle_uids_are_reclaimed_when_the_range_is_full() {
    let state = tempfile::tempdir().expect("tempdir");
    {
        let before = Sandbox::new(&users_only_config(state.path(), 2)).expect("sandbox");
        let a = sb_keep(&before, "old-a");
        let b = sb_keep(&before, "old-b");
        // A killed worker runs no reclaim: its entries stay.
        std::mem::forget((a, b));
    }
    let sb = Sandbox::new(&users_only_config(state.path(), 2)).expect("restarted");
    let c = sb
        .user_space("new-c", "t")
        .expect("the predecessor's idle uids are reclaimed");
    let d = sb.user_space("new-d", "t").expect("and the second one");
    assert_ne!(c.uid, d.uid);
    assert!(
        !state.path().join("users").join(names_user_key("old-a")).exists(),
        "its directories wiped first"
    );
    let err = sb.user_space("new-e", "t").expect_err("both held now");
    assert!(
        matches!(err, sandbox::SandboxError::UidRangeExhausted { .. }),
        "{err}"
    );
}

fn sb_keep(sb: &Sandbox, user: &str) -> UserSpace {
    let space = sb.user_space(user, "t").expect("user_space");
    std::fs::write(space.tmpdir.join("f"), b"x").expect("write");
    space
}

/// A worker admits users while their memory ceilings and disk caps fit its budget: the last one that fits is
/// admitted, the next is refused with a typed, retriable error, and admitted once another user went idle.
#[tokio::test]
async fn admission_stops_at_the_budget_boundary() {
    const USERS: usize = 3;
    let state = tempfile::tempdir().expect("tempdir");
    let mut config = users_only_config(state.path(), 100);
    // Without isolation no disk is capped: each user costs its memory ceiling. One byte short of a fourth.
    config.user_budget_bytes = 4 * config.user_limits.memory_bytes - 1;
    let sb = Sandbox::new(&config).expect("sandbox");
    assert_eq!(sb.admitted_users(), (0, USERS));
    let mut held: Vec<UserSpace> = (0..USERS)
        .map(|i| sb.user_space(&format!("u{i}"), "t").expect("within the budget"))
        .collect();
    assert_eq!(sb.admitted_users(), (USERS, USERS));
    // An admitted user's other tools cost nothing more.
    let second_tool = sb
        .user_space("u0", "other")
        .expect("an admitted user's second tool");
    let err = sb.user_space("next", "t").expect_err("past the budget");
    match err {
        sandbox::SandboxError::UserBudget {
            admitted,
            per_user,
            budget,
        } => {
            assert_eq!(admitted, USERS);
            assert_eq!(per_user, config.user_limits.memory_bytes);
            assert_eq!(budget, config.user_budget_bytes);
        }
        other => panic!("{other}"),
    }
    // The preparations' internal user is not a tenant: never refused by the budget.
    let build = sb
        .user_space(sandbox::BUILD_USER, "tool-1")
        .expect("builds are not admitted users");
    drop(build);
    // u0 still holds an identity: still admitted.
    drop(held.remove(0));
    assert!(
        sb.user_space("next", "t").is_err(),
        "u0 is still held by its second tool"
    );
    drop(second_tool);
    let next = sb
        .user_space("next", "t")
        .expect("admitted once a user went idle");
    assert_eq!(sb.admitted_users(), (USERS, USERS));
    drop((next, held));
}

/// A budget that holds not even one user is refused at start, naming the setting.
#[tokio::test]
async fn a_budget_below_one_user_is_refused_at_start() {
    let state = tempfile::tempdir().expect("tempdir");
    let mut config = users_only_config(state.path(), 10);
    config.user_budget_bytes = config.user_limits.memory_bytes - 1;
    let err = Sandbox::new(&config).expect_err("no user fits");
    assert!(err.to_string().contains("user_budget_bytes"), "{err}");
    config.user_budget_bytes = config.user_limits.memory_bytes;
    let sb = Sandbox::new(&config).expect("exactly one fits");
    assert_eq!(sb.admitted_users(), (0, 1));
}

#[tokio::test]
async fn user_space_never_follows_a_planted_symlink() {
    let state = tempfile::tempdir().expect("tempdir");
    let sb = Sandbox::new(&users_only_config(state.path(), 10)).expect("sandbox");
    let space = sb.user_space("mallory", "t").expect("user_space");
    let target = tempfile::tempdir().expect("target");
    let before = std::fs::metadata(target.path()).expect("target");
    std::fs::remove_dir(&space.tmpdir).expect("rmdir");
    std::os::unix::fs::symlink(target.path(), &space.tmpdir).expect("symlink");
    let err = sb
        .user_space("mallory", "t")
        .expect_err("a symlink is not a directory");
    assert!(matches!(err, sandbox::SandboxError::UserDir { .. }), "{err}");
    let after = std::fs::metadata(target.path()).expect("target");
    assert_eq!(
        (after.uid(), after.mode()),
        (before.uid(), before.mode()),
        "the link's target was not touched"
    );
}

#[tokio::test]
async fn kill_all_outruns_a_fork_bomb() {
    let f = Fixture::new("forkbomb");
    let cg = f.session("forkbomb", limits(256 << 20, 100, 1000));
    let mut child = spawn(
        &SpawnPlan::new(Some(&cg), None, None),
        "sh",
        // The root shell then spins without forking, so the bomb cannot die out by itself before the kill
        // (its subshells do, once forks fail at pids.max): there is always something left to kill.
        &["-c", "b() { b | b & }; b; while :; do :; done"],
    );
    wait_for("the bomb to hit pids.max", || {
        keyed_file(&cg, "pids.events", "max").is_some_and(|n| n > 0)
    })
    .await;
    let killed = cg.kill_all().expect("kill_all");
    assert!(killed > 0);
    assert!(cg.pids().expect("pids").is_empty());
    // Killed processes stay charged to pids.current as zombies until their parent reaps them: our direct
    // child by us, the orphans by init (slowly, on this VM).
    // (The root shell may have died of "Cannot fork" before the kill: its status is not the point.)
    tokio::time::timeout(DEADLINE, child.wait())
        .await
        .expect("exit")
        .expect("wait");
    wait_for("every zombie to be reaped", || {
        cg.usage().is_ok_and(|u| u.pids_current == 0)
    })
    .await;
    cg.remove().expect("remove");
}

#[tokio::test]
async fn a_failing_plan_fails_the_spawn_and_nothing_runs_unconfined() {
    let f = Fixture::new("planfail");
    let cg = f.session("gone", ResourceLimits::default());
    let plan = SpawnPlan::new(Some(&cg), None, None);
    cg.remove().expect("remove");
    let mut cmd = Command::new("/bin/true");
    sandbox::apply(&mut cmd, &plan);
    let err = cmd.spawn().expect_err("the cgroup is gone");
    assert_eq!(err.kind(), std::io::ErrorKind::NotFound, "{err}");
    // (uid_t)-1 would mean "keep root": refused.
    let mut cmd = Command::new("/bin/true");
    sandbox::apply(&mut cmd, &SpawnPlan::new(None, Some(u32::MAX), None));
    assert_eq!(
        cmd.spawn().expect_err("uid -1").kind(),
        std::io::ErrorKind::InvalidInput
    );
}

/// A data directory under a 0700 parent (any `mktemp -d`) is refused at start, naming the parent and the exact
/// `chmod` (the hint `fleet up` used to give — run as root, or pass `--isolation none` — fits no root user).
#[tokio::test]
async fn a_state_dir_under_a_closed_parent_names_the_chmod_that_fixes_it() {
    use std::os::unix::fs::PermissionsExt as _;
    let closed = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(closed.path(), std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let state = closed.path().join("data/state");
    let err = Sandbox::new(&users_only_config(&state, 2)).expect_err("unreachable state dir");
    let parent = std::fs::canonicalize(closed.path()).expect("canonical");
    let data = parent.join("data");
    assert!(matches!(err, sandbox::SandboxError::Config { .. }), "{err}");
    assert_eq!(
        err.to_string(),
        format!(
            "invalid sandbox configuration: the plugins' per-user uids cannot reach their directories under the \
             state (data) directory {}: {} (mode 700) is not searchable by other users; fix: `chmod o+x {}`; or \
             choose a data directory other users can traverse",
            state.display(),
            parent.display(),
            parent.display()
        )
    );
    // Following the fix works (`data/` was made with the usual umask, `state` is opened by the worker itself).
    std::fs::set_permissions(closed.path(), std::fs::Permissions::from_mode(0o711)).expect("chmod");
    assert!(data.is_dir());
    Sandbox::new(&users_only_config(&state, 2)).expect("sandbox after the fix");
}
