//! Cold start of a plugin session, against bare process spawns of the same binaries measured in the same run.
//!
//! Variants (all from this process, on a multi-threaded tokio runtime, spawn + wait through tokio):
//! - `native_noop_posix_spawn` — `fleet-echo-plugin --noop`, no `pre_exec` hook: std's fast `posix_spawn` path
//!   (`clone(CLONE_VM | CLONE_VFORK)`). The physical floor for starting that binary;
//! - `native_noop_fork_setsid` — the same with `sandbox::apply` of an empty [`SpawnPlan`] (`setsid` only): the
//!   hook alone forces `fork` + `exec`;
//! - `native_noop_fork_plan` — the same with the plan of a real session: `setsid`, join a session cgroup (every
//!   hierarchy), new namespaces with a private `/proc` and `/tmp`, drop to the tool's uid/gid, seccomp. What
//!   placing and confining the process costs;
//! - `native_ready_in_cgroup` — the product's cold start: `Session::new` (session cgroup with limits, user
//!   directories) then `prewarm` (spawn into the cgroup as the user → `initialize` → `describe`) until Ready.
//!   The session is then shut down (stdin EOF, cgroup removed) outside the timed section. The bench's user has
//!   no other session, so this is a user's first session: it adopts a seated stub, whose seat becomes the
//!   user's ceiling and the session's cgroup (`sandbox/seat.rs`) — no cgroup is made, nothing migrated;
//! - `native_ready_live_user` — the same for a user who keeps another session open (a Python one, for the whole
//!   bench): the session's cgroup is made in the user's live ceiling and the stub joins it on its claim (the
//!   path every stub took before seats);
//! - `python_pass` — `python3 -c pass` (posix_spawn path): the interpreter's floor;
//! - `python_ready_in_cgroup` — the same cold start for `tests/plugins/python/echo_plugin.py`.
//!
//! Every variant that moves a process into a cgroup is measured twice ([`Prelude`]): right after another
//! migration (`…`, the best case) and after 100 ms without one (`…_after_idle`, a session starting on a quiet
//! worker), because the first `cgroup.procs` write after a quiet spell waits for an RCU grace period. The two
//! baselines are also measured after the same quiet spell (`native_noop_posix_spawn_after_idle`,
//! `python_pass_after_idle`): an idle machine wakes every process more slowly, and the `after_idle` rows are
//! reported against both baselines.
//!
//! The worker is built as the e2e tests build it (`fleet_e2e::worker`): cgroup isolation, `RunAs::PerUser`
//! (default range), full confinement (namespaces, private `/proc` and `/tmp`, seccomp), a catalogue in a
//! temporary directory under `/var/tmp` (mode 0755; outside `/tmp` like a production worker's state, so no
//! session path needs mounting back into the private `/tmp`) whose installs already carry the
//! `.fleet-described` marker (no 60 s first-launch describe). The session variants run twice: `*_ready_in_cgroup`
//! from a waiting sandbox stub (`confinement.stub_pool`, the worker's default; the pool is full before each run,
//! untimed), `*_ready_direct` on a second worker with `stub_pool = 0` (spawned by the worker itself into a pooled
//! network namespace: the path before stubs). The native fixture is the release build of
//! `fleet-echo-plugin` (`cargo build --release -p fleet-echo-plugin` runs first: a no-op when fresh).
//! The interpreter is `/usr/bin/python3` when it exists (a pyenv shim is a shell script that re-executes, and
//! under `/root` a per-user uid could not run it), else the first `python3` on `PATH`; both Python variants use
//! the same one.
//!
//! After criterion's runs, an interleaved pass (every variant in turn, iteration by iteration, 15 rounds;
//! median of the per-round means) prints the table and the ratios, so slow and fast phases of a noisy machine
//! hit every variant alike. The worker's subtree is removed at the end (also on panic).
#![allow(
    clippy::unwrap_used,
    clippy::print_stdout,
    clippy::print_stderr,
    clippy::cast_possible_truncation
)]

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, SamplingMode, criterion_group, criterion_main};
use fleet_worker::catalogue::{Catalogue, Install, LoadOptions};
use fleet_worker::config::{IsolationMode, ResourceLimits, WorkerConfig};
use fleet_worker::metrics::WorkerMetrics;
use fleet_worker::sandbox::{Sandbox, SessionCgroup, SpawnPlan, apply};
use fleet_worker::services::{NoServices, NoTokens};
use fleet_worker::session::{Session, SessionState, WorkerContext};
use serde_json::json;
use tokio::process::Command;

/// Guard for a session to become ready (a failure guard, never reached in a healthy run).
const READY_WAIT: Duration = Duration::from_secs(30);
/// Rounds of the interleaved pass.
const ROUNDS: usize = 15;
/// The user every session runs for.
const USER: &str = "bench-user";

/// The user of the `native_noop_fork_plan` spawns' cgroup.
const NOOP_USER: &str = "bench-noop-user";

/// The user of the `*_live_user` variants, who keeps a Python session open for the whole bench.
const LIVE_USER: &str = "bench-live-user";

/// The workspace root (the parent of this crate's directory).
fn workspace_root() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    dir.parent().map_or_else(|| dir.to_path_buf(), Path::to_path_buf)
}

/// `<target>/<profile>` of this bench executable (which lives in `<target>/<profile>/deps`).
fn profile_dir() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| {
            exe.ancestors()
                .skip(1)
                .find(|d| d.file_name().is_some_and(|n| n == "deps"))
                .and_then(Path::parent)
                .map(Path::to_path_buf)
        })
        .unwrap_or_else(|| workspace_root().join("target/release"))
}

/// `<profile>/<name>`, the release build of `cargo build --release <args>` (a no-op when it is up to date).
fn release_bin(name: &str, args: &[&str]) -> PathBuf {
    let profile = profile_dir();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = std::process::Command::new(cargo);
    cmd.current_dir(workspace_root())
        .args(["build", "--release", "--quiet"])
        .args(args);
    if let Some(target) = profile.parent() {
        cmd.env("CARGO_TARGET_DIR", target);
    }
    let status = cmd.status().expect("cannot run cargo build");
    assert!(
        status.success(),
        "cargo build --release {args:?} failed: {status}"
    );
    let bin = profile.join(name);
    assert!(bin.is_file(), "{} is missing after cargo build", bin.display());
    bin
}

/// The release build of the native fixture.
fn echo_plugin_bin() -> PathBuf {
    release_bin("fleet-echo-plugin", &["-p", "fleet-echo-plugin"])
}

/// The release build of the worker's sandbox stub program.
fn stub_bin() -> PathBuf {
    release_bin(
        "fleet-sandbox-stub",
        &["-p", "fleet-worker", "--bin", "fleet-sandbox-stub"],
    )
}

/// The interpreter both Python variants run (see the module documentation).
fn python3() -> PathBuf {
    let system = PathBuf::from("/usr/bin/python3");
    if system.is_file() {
        return system;
    }
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("python3"))
        .find(|p| p.is_file())
        .expect("python3 not found")
}

/// Writes `<root>/catalogue/<tool_id>/executa.json` for each `(tool_id, argv)`, marked as already described.
fn write_catalogue(root: &Path, installs: &[(&str, Vec<String>)]) -> PathBuf {
    let dir = root.join("catalogue");
    std::fs::create_dir_all(&dir).unwrap();
    for (tool_id, argv) in installs {
        let d = dir.join(tool_id);
        std::fs::create_dir_all(&d).unwrap();
        let entry = json!({ "tool_id": tool_id, "type": "binary", "command": argv });
        std::fs::write(d.join("executa.json"), serde_json::to_vec_pretty(&entry).unwrap()).unwrap();
        std::fs::write(d.join(".fleet-described"), b"").unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    for d in [root, dir.as_path()] {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    dir
}

/// What a variant runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    NativeNoopPosixSpawn,
    NativeNoopForkSetsid,
    NativeNoopForkPlan,
    /// From a waiting sandbox stub (the worker's default), for a user with no session yet: the stub's seat
    /// becomes the user's ceiling and the session's cgroup (`sandbox/seat.rs`).
    NativeReady,
    /// From a waiting sandbox stub for a user who already has a session (of another tool): the stub joins the
    /// new session's cgroup on its claim.
    NativeReadyLiveUser,
    /// Spawned directly by the worker (`confinement.stub_pool = 0`, the pooled network namespaces instead).
    NativeReadyDirect,
    PythonPass,
    PythonReady,
    PythonReadyDirect,
}

/// What happens, untimed, just before a run that migrates a process into a cgroup.
///
/// The first write to a `cgroup.procs` after a quiet spell waits for an RCU grace period (the kernel's global
/// `cgroup_threadgroup_rwsem` is a per-CPU rwsem again by default since Linux 6.0: a writer must first switch its
/// readers to the slow path), and writes following it within a few milliseconds do not. So the same spawn costs
/// differently depending on what happened just before; both states are measured. (Only the first hierarchy's
/// write pays: measured by hand, ~7.7 ms for it, ~0.03–0.07 ms for each of the other four. The kernel's
/// `favordynmods` option avoids the grace period at some cost to every fork and exit; on v2,
/// `clone3(CLONE_INTO_CGROUP)` does not take the write lock at all.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Prelude {
    /// Nothing (no cgroup involved).
    None,
    /// One throwaway `--noop` spawn with the plan right before: the best case (a burst of session starts).
    Warm,
    /// [`IDLE_GAP`] without any cgroup migration first: a session starting on a quiet worker.
    Idle,
}

/// The quiet spell of [`Prelude::Idle`] (the attach cost reaches its plateau after about 50 ms here).
const IDLE_GAP: Duration = Duration::from_millis(100);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Variant {
    name: &'static str,
    kind: Kind,
    prelude: Prelude,
}

impl Variant {
    const ALL: [Variant; 17] = [
        Variant::new(
            "native_noop_posix_spawn",
            Kind::NativeNoopPosixSpawn,
            Prelude::None,
        ),
        Variant::new(
            "native_noop_posix_spawn_after_idle",
            Kind::NativeNoopPosixSpawn,
            Prelude::Idle,
        ),
        Variant::new(
            "native_noop_fork_setsid",
            Kind::NativeNoopForkSetsid,
            Prelude::None,
        ),
        Variant::new("native_noop_fork_plan", Kind::NativeNoopForkPlan, Prelude::Warm),
        Variant::new(
            "native_noop_fork_plan_after_idle",
            Kind::NativeNoopForkPlan,
            Prelude::Idle,
        ),
        Variant::new("native_ready_in_cgroup", Kind::NativeReady, Prelude::Warm),
        Variant::new(
            "native_ready_in_cgroup_after_idle",
            Kind::NativeReady,
            Prelude::Idle,
        ),
        Variant::new("native_ready_live_user", Kind::NativeReadyLiveUser, Prelude::Warm),
        Variant::new(
            "native_ready_live_user_after_idle",
            Kind::NativeReadyLiveUser,
            Prelude::Idle,
        ),
        Variant::new("native_ready_direct", Kind::NativeReadyDirect, Prelude::Warm),
        Variant::new(
            "native_ready_direct_after_idle",
            Kind::NativeReadyDirect,
            Prelude::Idle,
        ),
        Variant::new("python_pass", Kind::PythonPass, Prelude::None),
        Variant::new("python_pass_after_idle", Kind::PythonPass, Prelude::Idle),
        Variant::new("python_ready_in_cgroup", Kind::PythonReady, Prelude::Warm),
        Variant::new(
            "python_ready_in_cgroup_after_idle",
            Kind::PythonReady,
            Prelude::Idle,
        ),
        Variant::new("python_ready_direct", Kind::PythonReadyDirect, Prelude::Warm),
        Variant::new(
            "python_ready_direct_after_idle",
            Kind::PythonReadyDirect,
            Prelude::Idle,
        ),
    ];

    const fn new(name: &'static str, kind: Kind, prelude: Prelude) -> Variant {
        Variant { name, kind, prelude }
    }

    /// Runs per round of the interleaved pass (the 1 ms spawns more often, to steady their per-round mean).
    /// Each divides [`STEPS`].
    fn per_round(self) -> u32 {
        match (self.kind, self.prelude) {
            (
                Kind::NativeNoopPosixSpawn | Kind::NativeNoopForkSetsid | Kind::NativeNoopForkPlan,
                Prelude::None,
            )
            | (Kind::NativeNoopForkPlan, Prelude::Warm) => 12,
            _ => 4,
        }
    }
}

/// Steps of one round of the interleaved pass.
const STEPS: u32 = 12;

/// What one cold start took, split at the spawn.
#[derive(Debug, Clone, Copy, Default)]
struct ColdStart {
    /// `Session::new`: the session cgroup (mkdir + limits) and the user's directories.
    setup: Duration,
    /// `prewarm`: spawn into the cgroup → `initialize` → `describe` → Ready.
    spawn_to_ready: Duration,
    /// `shutdown`: stdin EOF → exit → cgroup removed (not part of the cold start; reported for scale).
    shutdown: Duration,
}

impl ColdStart {
    fn total(&self) -> Duration {
        self.setup + self.spawn_to_ready
    }
}

/// The worker under measurement and everything the baselines need.
struct Bench {
    rt: tokio::runtime::Runtime,
    /// The worker with sandbox stubs (its default).
    ctx: WorkerContext,
    /// The same worker without stubs (direct spawns into pooled network namespaces).
    direct: WorkerContext,
    echo_bin: PathBuf,
    python: PathBuf,
    native: Arc<Install>,
    py: Arc<Install>,
    /// The cgroup the `native_noop_fork_plan` spawns join (the processes exit; the cgroup stays until the end).
    noop_cgroup: Option<SessionCgroup>,
    noop_plan: SpawnPlan,
    /// [`LIVE_USER`]'s Python session, open for the whole bench (shut down at the end).
    live: Option<Session>,
    _root: tempfile::TempDir,
}

impl Bench {
    fn new() -> Bench {
        let echo_bin = echo_plugin_bin();
        let python = python3();
        let script = workspace_root().join("tests/plugins/python/echo_plugin.py");
        assert!(script.is_file(), "{} is missing", script.display());

        // The production layout: state and catalogue outside /tmp (a worker's live under /var/lib), so a private
        // /tmp has nothing of the session's to mount back in (a layout under /tmp adds three mounts per spawn).
        let root = tempfile::tempdir_in("/var/tmp").unwrap();
        let mut config = WorkerConfig {
            worker_id: format!("bench-cold-start-{}", std::process::id()),
            isolation: IsolationMode::Cgroup,
            sandbox_stub: Some(stub_bin()),
            ..WorkerConfig::default()
        };
        config.catalogue_dir = write_catalogue(
            root.path(),
            &[
                ("echo", vec![echo_bin.display().to_string()]),
                (
                    "py",
                    vec![python.display().to_string(), script.display().to_string()],
                ),
            ],
        );
        config.state_dir = root.path().join("state");
        let (catalogue, problems) = Catalogue::load(&config.catalogue_dir, &LoadOptions::from_env()).unwrap();
        assert!(problems.is_empty(), "catalogue problems: {problems:?}");
        let native = Arc::new(catalogue.get("echo").unwrap().clone());
        let py = Arc::new(catalogue.get("py").unwrap().clone());
        assert!(
            !native.first_launch && !py.first_launch,
            "the .fleet-described markers are missing"
        );

        let sandbox = Sandbox::new(&config).expect("sandbox (cgroups, as root)");
        // A user of its own: its cgroup keeps that user's ceiling live for the whole bench, and `USER` must have
        // none between its cold starts (each is then a user's first session, which adopts a seat).
        let space = sandbox.user_space(NOOP_USER, "noop").unwrap();
        let noop_cgroup = sandbox
            .create_session(&space.user_key, "bench-noop", ResourceLimits::default())
            .unwrap();
        let noop_plan = sandbox
            .plan(
                noop_cgroup.as_ref(),
                &space,
                &fleet_worker::sandbox::command_paths(&native.dir, &native.argv),
            )
            .unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let mut direct_config = config.clone();
        direct_config.worker_id = format!("bench-cold-start-direct-{}", std::process::id());
        direct_config.confinement.stub_pool = 0;
        let direct_sandbox = Sandbox::new(&direct_config).expect("sandbox (cgroups, as root)");
        let ctx = WorkerContext {
            config: Arc::new(config),
            sandbox,
            services: Arc::new(NoServices),
            tokens: Arc::new(NoTokens),
            metrics: Arc::new(WorkerMetrics::default()),
        };
        let direct = WorkerContext {
            config: Arc::new(direct_config),
            sandbox: direct_sandbox,
            services: Arc::new(NoServices),
            tokens: Arc::new(NoTokens),
            metrics: Arc::new(WorkerMetrics::default()),
        };
        rt.block_on(async { ctx.sandbox.start_stubs() });
        let live = rt.block_on(async {
            let live = Session::new(LIVE_USER, &py, &ctx).unwrap();
            live.prewarm(READY_WAIT).await.unwrap();
            live
        });
        println!(
            "cold_start: isolation {}, uid {:?}, echo plugin {}, python {}",
            ctx.sandbox.mode(),
            space.uid,
            echo_bin.display(),
            python.display()
        );
        Bench {
            rt,
            ctx,
            direct,
            echo_bin,
            python,
            native,
            py,
            noop_cgroup,
            noop_plan,
            live: Some(live),
            _root: root,
        }
    }

    /// Spawns `cmd` (stdio to /dev/null) and waits for it; the time of both.
    async fn spawn_wait(mut cmd: Command) -> Duration {
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let t = Instant::now();
        let status = cmd.status().await.unwrap();
        let took = t.elapsed();
        assert!(status.success(), "{cmd:?}: {status}");
        took
    }

    fn native_noop(&self, plan: Option<&SpawnPlan>) -> Command {
        let mut cmd = Command::new(&self.echo_bin);
        cmd.arg("--noop");
        if let Some(plan) = plan {
            apply(&mut cmd, plan);
        }
        cmd
    }

    /// One cold start of `install` as the product does it (in `ctx`); the session is always shut down. With
    /// stubs, the pool is full first (untimed): a session start on a worker that is not starting sessions
    /// faster than it makes stubs.
    async fn cold_start(&self, user: &str, install: &Arc<Install>, ctx: &WorkerContext) -> ColdStart {
        if ctx.sandbox.stubs_enabled() {
            let target = ctx.config.confinement.stub_pool;
            let deadline = Instant::now() + READY_WAIT;
            while ctx.sandbox.stubs_ready() < target {
                assert!(Instant::now() < deadline, "the stub pool does not fill up");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        let t = Instant::now();
        let session = Session::new(user, install, ctx).unwrap();
        let setup = t.elapsed();
        let t = Instant::now();
        let ready = session.prewarm(READY_WAIT).await;
        let spawn_to_ready = t.elapsed();
        // What the variant claims to measure: a user's first session on the worker with stubs adopts a seat.
        let cgroup = session.with_cgroup(|c| c.map(|c| c.name().to_owned()));
        let first_session = user == USER && ctx.sandbox.stubs_enabled();
        assert_eq!(
            cgroup.as_deref() == Some("seat"),
            first_session,
            "{user}: cgroup {cgroup:?}"
        );
        let state = session.state();
        let t = Instant::now();
        session.shutdown().await;
        let shutdown = t.elapsed();
        if let Err(e) = ready {
            panic!(
                "{}: not ready: {e}; stderr: {:?}",
                install.tool_id,
                session.stderr_lines()
            );
        }
        assert_eq!(state, SessionState::Ready);
        ColdStart {
            setup,
            spawn_to_ready,
            shutdown,
        }
    }

    /// One run of `v` after its prelude: the timed part, and the cold-start split for the session variants.
    async fn once(&self, v: Variant) -> (Duration, Option<ColdStart>) {
        match v.prelude {
            Prelude::None => {}
            Prelude::Warm => {
                Self::spawn_wait(self.native_noop(Some(&self.noop_plan))).await;
            }
            Prelude::Idle => tokio::time::sleep(IDLE_GAP).await,
        }
        match v.kind {
            Kind::NativeNoopPosixSpawn => (Self::spawn_wait(self.native_noop(None)).await, None),
            Kind::NativeNoopForkSetsid => (
                Self::spawn_wait(self.native_noop(Some(&SpawnPlan::default()))).await,
                None,
            ),
            Kind::NativeNoopForkPlan => (
                Self::spawn_wait(self.native_noop(Some(&self.noop_plan))).await,
                None,
            ),
            Kind::PythonPass => {
                let mut cmd = Command::new(&self.python);
                cmd.args(["-c", "pass"]);
                (Self::spawn_wait(cmd).await, None)
            }
            Kind::NativeReady => {
                let c = self.cold_start(USER, &self.native, &self.ctx).await;
                (c.total(), Some(c))
            }
            Kind::NativeReadyLiveUser => {
                let c = self.cold_start(LIVE_USER, &self.native, &self.ctx).await;
                (c.total(), Some(c))
            }
            Kind::NativeReadyDirect => {
                let c = self.cold_start(USER, &self.native, &self.direct).await;
                (c.total(), Some(c))
            }
            Kind::PythonReady => {
                let c = self.cold_start(USER, &self.py, &self.ctx).await;
                (c.total(), Some(c))
            }
            Kind::PythonReadyDirect => {
                let c = self.cold_start(USER, &self.py, &self.direct).await;
                (c.total(), Some(c))
            }
        }
    }

    /// `iters` runs of `v`, for criterion's `iter_custom`: the sum of the timed parts.
    fn repeat(&self, v: Variant, iters: u64) -> Duration {
        self.rt.block_on(async {
            let mut sum = Duration::ZERO;
            for _ in 0..iters {
                sum += self.once(v).await.0;
            }
            sum
        })
    }

    /// Removes the noop cgroup and the worker's subtree (every session is already shut down).
    fn cleanup(&mut self) {
        if let Some(live) = self.live.take() {
            self.rt.block_on(live.shutdown());
        }
        // The waiting stubs and their seats first: what the sweep below still finds was left behind.
        self.rt.block_on(self.ctx.sandbox.shutdown_stubs());
        if let Some(cg) = self.noop_cgroup.take()
            && let Err(e) = cg.remove()
        {
            eprintln!("cold_start: removing the noop cgroup failed: {e}");
        }
        for ctx in [&self.ctx, &self.direct] {
            match ctx.sandbox.remove_subtree() {
                Ok(r) if r.cgroups_removed > 0 => {
                    eprintln!("cold_start: {} cgroup(s) were left and swept", r.cgroups_removed)
                }
                Ok(_) => {}
                Err(e) => eprintln!("cold_start: removing the worker's cgroup subtree failed: {e}"),
            }
        }
    }
}

impl Drop for Bench {
    fn drop(&mut self) {
        self.cleanup();
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn ratio(a: Duration, b: Duration) -> f64 {
    a.as_secs_f64() / b.as_secs_f64()
}

/// The interleaved pass: every variant in turn, iteration by iteration; per round the mean of each; then the
/// median over the rounds.
fn print_ratios(b: &Bench) {
    let n = Variant::ALL.len();
    let mut per_round: Vec<Vec<Duration>> = vec![Vec::new(); n];
    let mut splits: Vec<Vec<ColdStart>> = vec![Vec::new(); n];
    b.rt.block_on(async {
        for _ in 0..ROUNDS {
            let mut sums = vec![Duration::ZERO; n];
            for step in 0..STEPS {
                for (i, v) in Variant::ALL.into_iter().enumerate() {
                    // Spread the rarer variants evenly over the round.
                    if step % (STEPS / v.per_round()) != 0 {
                        continue;
                    }
                    let (d, split) = b.once(v).await;
                    sums[i] += d;
                    splits[i].extend(split);
                }
            }
            for (i, v) in Variant::ALL.into_iter().enumerate() {
                per_round[i].push(sums[i] / v.per_round());
            }
        }
    });
    let medians: Vec<Duration> = per_round.into_iter().map(median).collect();
    let at = |name: &str| {
        Variant::ALL
            .iter()
            .position(|v| v.name == name)
            .expect("a variant of Variant::ALL")
    };
    let of = |name: &str| medians[at(name)];

    println!();
    println!(
        "cold_start (interleaved, {ROUNDS} rounds; per round the mean of 12 runs of each plain/warm noop spawn and \
         4 of each other variant; median of the rounds; {}; after_idle = {} ms without a cgroup migration first)",
        b.ctx.sandbox.mode(),
        IDLE_GAP.as_millis()
    );
    println!(
        "{:<34} {:>10} {:>10} {:>10} {:>10}",
        "variant", "median ms", "setup", "spawn->rdy", "shutdown*"
    );
    for (i, v) in Variant::ALL.into_iter().enumerate() {
        let s = &splits[i];
        if s.is_empty() {
            println!("{:<34} {:>10.3}", v.name, ms(medians[i]));
        } else {
            let col = |f: fn(&ColdStart) -> Duration| ms(median(s.iter().map(f).collect()));
            println!(
                "{:<34} {:>10.3} {:>10.3} {:>10.3} {:>10.3}",
                v.name,
                ms(medians[i]),
                col(|c| c.setup),
                col(|c| c.spawn_to_ready),
                col(|c| c.shutdown),
            );
        }
    }
    println!(
        "(ready = setup [Session::new: cgroup + limits + user dirs] + spawn->ready [prewarm: spawn, initialize, \
         describe]; *shutdown is not part of the time)"
    );
    println!();
    let posix = "native_noop_posix_spawn";
    let posix_idle = "native_noop_posix_spawn_after_idle";
    let rows = [
        ("native_ready_in_cgroup", posix),
        ("native_ready_in_cgroup_after_idle", posix),
        ("native_ready_in_cgroup_after_idle", posix_idle),
        ("native_ready_live_user", posix),
        ("native_ready_live_user_after_idle", posix),
        ("native_ready_live_user_after_idle", posix_idle),
        ("native_ready_direct", posix),
        ("native_ready_direct_after_idle", posix),
        ("native_ready_direct_after_idle", posix_idle),
        ("native_noop_fork_plan", posix),
        ("native_noop_fork_plan_after_idle", posix),
        ("native_noop_fork_setsid", posix),
        ("python_ready_in_cgroup", "python_pass"),
        ("python_ready_in_cgroup_after_idle", "python_pass"),
        ("python_ready_in_cgroup_after_idle", "python_pass_after_idle"),
        ("python_ready_direct", "python_pass"),
        ("python_ready_direct_after_idle", "python_pass"),
        ("python_ready_direct_after_idle", "python_pass_after_idle"),
    ];
    for (a, base) in rows {
        let (a_d, base_d) = (of(a), of(base));
        println!(
            "{:<60} {:>6.2}x  (+{:.3} ms)",
            format!("{a} / {base}"),
            ratio(a_d, base_d),
            ms(a_d.saturating_sub(base_d))
        );
    }
}

fn bench(c: &mut Criterion) {
    let b = Bench::new();
    {
        let mut g = c.benchmark_group("cold_start");
        g.sampling_mode(SamplingMode::Flat)
            .sample_size(10)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2));
        for v in Variant::ALL.into_iter().filter(|v| v.prelude != Prelude::Idle) {
            g.bench_function(v.name, |bn| bn.iter_custom(|iters| b.repeat(v, iters)));
        }
        g.finish();
    }
    {
        // Each iteration first sleeps IDLE_GAP (untimed, but criterion's estimate counts it): a budget of two
        // iterations per sample keeps these to a few seconds each.
        let mut g = c.benchmark_group("cold_start");
        g.sampling_mode(SamplingMode::Flat)
            .sample_size(10)
            .warm_up_time(Duration::from_millis(50))
            .measurement_time(Duration::from_millis(1500));
        for v in Variant::ALL.into_iter().filter(|v| v.prelude == Prelude::Idle) {
            g.bench_function(v.name, |bn| bn.iter_custom(|iters| b.repeat(v, iters)));
        }
        g.finish();
    }
    print_ratios(&b);
    // Dropping `b` removes the noop cgroup and the worker's subtree.
}

criterion_group!(benches, bench);
criterion_main!(benches);
