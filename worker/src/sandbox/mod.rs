//! Isolation of plugin processes: one cgroup per session (v1 or v2), spawning into it before the plugin's first
//! instruction, process-tree kill, OOM detection, per-user uids and directories, and the sweep of stale cgroups.
//!
//! # Where the cgroups live
//!
//! [`Sandbox::new`] finds the worker's own cgroup in each needed hierarchy (`/proc/self/cgroup` resolved through
//! `/proc/self/mountinfo`, so bind-mounted and namespaced hierarchies work) and creates under it the subtree
//! `cloud-agents-<worker_id>` (the id kept verbatim when it is already a safe name, else sanitized and hashed).
//! Each session is a child `<sanitized name>-<hash>` of that subtree. Nesting under the worker's own cgroup keeps
//! everything inside whatever the worker was delegated (a systemd `Delegate=yes` unit, a container's cgroup), so
//! plugins count against the worker's own limits and nothing is created elsewhere on the node. The subtree name
//! is stable, so a restarted worker finds what a `kill -9`-ed predecessor left and [`Sandbox::sweep_stale`]
//! removes it.
//!
//! - **v1** (this development VM): the hierarchies memory, pids, cpu, cpuacct and freezer (co-mounted ones are
//!   one directory). Here that is `memory:/process_api/<id>/cloud-agents-…` and `/cloud-agents-…` in the others.
//! - **v2** (production nodes): one directory. The kernel delegates controllers to children only from a cgroup
//!   without processes of its own, so if enabling `memory pids cpu` in the worker's cgroup fails, the worker moves
//!   itself into the leaf `<own>/cloud-agents.worker` and retries (what systemd documents for delegated units);
//!   the subtree is then `<own>/cloud-agents-…`. A second `Sandbox` in the same process recognises the leaf.
//!   Sessions get `memory.max`, `memory.swap.max = 0`, `memory.oom.group = 1` (an OOM kills the whole
//!   session), `pids.max`, `cpu.max`; [`SessionCgroup::kill_all`] uses `cgroup.kill`.
//!
//! # Raw files, not cgroups-rs
//!
//! The cgroup files are written with `std::fs` (`sandbox/control.rs` has the table of files per version). The
//! whole job is about twenty small files; doing it directly is shorter and clearer than driving cgroups-rs
//! 0.5.1, and it lets every error name the exact file. cgroups-rs would not remove any work: its v1 builder
//! computes paths itself (relative paths only via `/proc/self/cgroup` again), `Cgroup::kill` is v2-only (the v1
//! freeze–kill–thaw loop must be written anyway), its memory stats read ~10 files where one is needed, the
//! hierarchy handle is a non-`Clone` `Box<dyn Hierarchy>`, and the `pre_exec` attach needs the raw `cgroup.procs`
//! paths regardless. (It remains a dependency of the crate's manifest; this module does not use it.)
//!
//! # No isolation
//!
//! With `IsolationMode::None`, [`Sandbox::create_session`] returns `Ok(None)`: there is no cgroup to kill, limit
//! or measure, and the type makes callers handle that. Such a plugin's tree is reached through its process group
//! instead ([`SpawnPlan`] always makes the plugin a session and group leader, so its pgid is its pid):
//! [`signal_process_group`]. A `SIGKILL` to the group does not reach descendants that left it with `setsid`,
//! which is one reason this mode is for development only.
//!
//! # Blocking
//!
//! Every operation is synchronous file I/O of microseconds, except [`SessionCgroup::kill_all`] and
//! [`SessionCgroup::remove`], which wait for the kernel (usually a few milliseconds, bounded at about 2 s + 1 s):
//! call those through `tokio::task::spawn_blocking`.

mod confine;
mod control;
mod detect;
mod disk;
mod error;
mod names;
mod netns;
pub mod reach;
mod seat;
pub mod seccomp;
mod spawn;
mod stub;
mod stub_msg;
mod stub_pool;
mod users;

use std::collections::{BTreeSet, HashMap};
use std::fs;
use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};

use rustix::process::{Pid, Signal};

use confine::{CgroupMounts, Confinement};
pub use confine::{ConfineError, command_paths};
use control::{Dirs, rmdir_cgroup};
pub use control::{SessionCgroup, Usage};
pub use detect::CgroupMountError;
pub use error::SandboxError;
use seccomp::SeccompProfile;
pub use spawn::{SpawnPlan, apply, die_with_parent};
pub use stub::run_if_stub;
pub use stub_msg::STUB_ARG;
pub use stub_msg::Step as StubStep;
pub use stub_pool::{ExecStatus, StubError};
pub(crate) use stub_pool::{Stub, StubPool};
use users::{Admission, Users};
pub use users::{Hold, UserSpace};

use crate::config::{EGRESS_PROXY_PORT, IsolationMode, ResourceLimits, UserLimits, WorkerConfig};
use crate::egress::{EgressCounters, Policy};
use netns::{NetNs, NetnsPool};

/// The prefix of a user's ceiling cgroup in the worker's subtree (`user-<user_key>`; session names start with
/// hex digits or `.probe`, so never with this).
const USER_CGROUP_PREFIX: &str = "user-";

/// The cgroup version in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CgroupVersion {
    /// Legacy hierarchies, one per controller (or co-mounted group).
    V1,
    /// The unified hierarchy.
    V2,
}

/// Who starts the process [`Sandbox::prepare`] prepares for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// The worker (a session's or an Animus process's launch: from a sandbox stub where it can).
    Worker,
    /// The caller, with [`apply`] on a command of its own (detection probes, `fleet probe`).
    Caller,
}

/// What [`Sandbox::prepare`] made for one plugin process.
#[derive(Debug)]
pub struct Prepared {
    /// Its identity and directories.
    pub space: UserSpace,
    /// Its cgroup (`None` without isolation).
    pub cgroup: Option<SessionCgroup>,
    /// How to spawn it.
    pub plan: SpawnPlan,
    /// Where a waiting sandbox stub can be taken for it (none: spawned directly).
    pub(crate) stubs: Option<StubPool>,
    /// The stub already in its cgroup: the first session of a user adopts a seated stub (`seat.rs`).
    pub(crate) seated: Option<Stub>,
}

/// What [`Sandbox::sweep_stale`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Session cgroups removed.
    pub cgroups_removed: usize,
    /// Processes killed in them.
    pub processes_killed: usize,
}

/// The worker's sandbox: its cgroup subtree (if isolating) and the per-user identities. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Sandbox {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// The worker's subtree; `None` without isolation.
    subtree: Option<Dirs>,
    users: Users,
    /// Namespaces and seccomp as configured (none without isolation).
    confine: Option<ConfineBase>,
    /// The ceiling of each user's sessions together.
    user_limits: UserLimits,
    /// The live user ceiling cgroups, by user key; the lock also orders creating a session in one against
    /// removing it.
    user_cgroups: Registry,
    /// The egress policy (with namespaces only: without them plugins share the worker's network anyway).
    egress: Option<Arc<Policy>>,
    /// What the egress proxies did.
    egress_counters: Arc<EgressCounters>,
    /// How preparations are confined.
    build: BuildBase,
}

/// What every preparation's confinement starts from ([`Sandbox::prepare_build`]).
#[derive(Debug)]
struct BuildBase {
    /// Directories that do not exist in a preparation's view: the state directory and the configured ones.
    hidden: Vec<PathBuf>,
    /// The policy of the proxy a preparation reaches its package indexes through (none: no network).
    egress: Option<Arc<Policy>>,
    limits: ResourceLimits,
}

/// Where a planned process's network namespace comes from.
#[derive(Debug, Clone, Copy)]
enum Net<'a> {
    /// One holding a proxy that enforces this policy.
    Proxy(&'a Arc<Policy>),
    /// An empty one from the pool when one waits, else its own (made at spawn).
    Pooled,
    /// Its own, made at spawn.
    Own,
}

/// The internal user whose identities run preparations, one per tool and version ([`Sandbox::prepare_build`]);
/// a token cannot name it (`fleet:` is reserved).
pub const BUILD_USER: &str = "fleet:build";

/// What every session's [`Confinement`] starts from.
#[derive(Debug)]
struct ConfineBase {
    namespaces: bool,
    tmp_bytes: u64,
    seccomp: Option<Arc<SeccompProfile>>,
    /// Empty network namespaces made ahead of need (with namespaces on and no stubs).
    netns_pool: Option<NetnsPool>,
    /// Sandbox stubs made ahead of need (with namespaces on and a stub program).
    stub_pool: Option<StubPool>,
    /// What every session sees under `/sys/fs/cgroup`.
    cgroups: Arc<CgroupMounts>,
}

/// A user's ceiling cgroup, alive while one of the user's session cgroups holds it; removed (if empty) when
/// the last one goes.
#[derive(Debug)]
pub(crate) struct UserCgroup {
    key: String,
    dirs: Dirs,
    /// Whether `dirs` is the user's own `user-<key>` (made for them), not an adopted seat's (`seat.rs`): two
    /// handles of one user share their directories only when both are.
    own: bool,
    registry: Registry,
}

/// The live user ceilings by user key.
type Registry = Arc<Mutex<HashMap<String, Registered>>>;

/// A registered user ceiling. Nothing upgrades `handle` under the registry's lock unless it keeps the result: a
/// temporary `Arc` that turned out to be the last one would run [`UserCgroup`]'s drop, which takes that lock.
#[derive(Debug)]
struct Registered {
    handle: Weak<UserCgroup>,
    /// [`UserCgroup::own`].
    own: bool,
}

impl Drop for UserCgroup {
    fn drop(&mut self) {
        let mut live = self.registry.lock().unwrap_or_else(PoisonError::into_inner);
        match live.get(&self.key) {
            Some(r) if std::ptr::eq(r.handle.as_ptr(), self) => {
                live.remove(&self.key);
            }
            // A newer handle for the same user was registered while this one's count reached zero. If it owns
            // the same directory (both the user's own), only it may remove it; an adopted seat has others.
            Some(r) if self.own && r.own && r.handle.strong_count() > 0 => return,
            _ => {}
        }
        for dir in self.dirs.unique() {
            // Busy (a session cgroup left in place by a drop without remove): the sweep at start takes it.
            let _ = fs::remove_dir(dir);
        }
    }
}

/// Makes probe cgroup names unique within the process.
static PROBE_SEQ: AtomicU64 = AtomicU64::new(0);

impl Sandbox {
    /// Prepares isolation as `config.isolation` says.
    ///
    /// `IsolationMode::Cgroup`: detects v2 (a unified hierarchy offering memory, pids and cpu to the worker's
    /// cgroup) or else v1 (memory, pids, cpu, cpuacct and freezer hierarchies), creates the worker's subtree under
    /// its own cgroup, and proves it usable by creating, limiting and removing a probe session cgroup. Any
    /// failure is [`SandboxError::Unavailable`]: the worker must refuse to start rather than run plugins
    /// unconfined. `IsolationMode::None`: creates nothing and logs a warning.
    ///
    /// `RunAs::PerUser` requires root and a range without uid 0 ([`SandboxError::Config`]); it also makes sure
    /// other users can traverse `state_dir` (adding `o+x` to it if needed).
    ///
    /// With isolation, `config.confinement` is compiled (the seccomp profile) and proven usable by confining a
    /// forked probe that executes nothing; a worker that cannot confine as configured refuses to start
    /// ([`SandboxError::Unavailable`] naming the setting to turn off).
    pub fn new(config: &WorkerConfig) -> Result<Sandbox, SandboxError> {
        // The users' disks are mounted before the first stub unshares its mount namespace (`disk.rs`).
        // No budget (none set, and no memory limit on the worker's cgroup: a development machine): no admission
        // and no per-user disks, as each disk is a tmpfs mounted at start for an admitted user.
        let budget = match config.user_budget_bytes {
            0 => users::worker_memory_limit(),
            set => Some(set),
        };
        let disk = (config.isolation == IsolationMode::Cgroup
            && rustix::process::geteuid().is_root()
            && budget.is_some())
        .then_some(config.user_limits.disk_bytes);
        if disk.is_none() {
            tracing::warn!(
                "the users' TMPDIRs and workspaces are not capped (that needs isolation, root and a user budget)"
            );
        }
        let per_user = config.user_limits.memory_bytes.saturating_add(disk.unwrap_or(0));
        let admission = match budget {
            Some(budget) => Admission::new(budget, per_user)?,
            None => {
                tracing::warn!(
                    "no user budget: users are admitted without limit (set user_budget_bytes, or run the worker \
                     in a memory-limited cgroup)"
                );
                Admission::unbounded(per_user)
            }
        };
        let users = Users::new(
            &config.state_dir,
            &config.run_as,
            config.workspace,
            admission,
            disk.map(|bytes| (bytes, config.worker_id.as_str())),
        )?;
        let (subtree, confine) = match config.isolation {
            IsolationMode::None => {
                tracing::warn!(
                    worker_id = %config.worker_id,
                    "isolation is off: plugins run without cgroups, limits, namespaces, seccomp or reliable \
                     process-tree kill"
                );
                (None, None)
            }
            IsolationMode::Cgroup => {
                let (subtree, view) = prepare_cgroups(&config.worker_id)?;
                let seats = seat::SeatPlan {
                    root: subtree.clone(),
                    user_limits: config.user_limits,
                    session_limits: config.limits,
                };
                (Some(subtree), Some(prepare_confinement(config, seats, &view)?))
            }
        };
        let egress = match &confine {
            Some(base) if base.namespaces && !config.egress.tools.is_empty() => {
                Some(Arc::new(Policy::new(&config.egress).map_err(|e| {
                    SandboxError::Config {
                        reason: e.to_string(),
                    }
                })?))
            }
            _ => None,
        };
        let build = build_base(config, confine.as_ref().is_some_and(|c| c.namespaces))?;
        Ok(Sandbox {
            inner: Arc::new(Inner {
                subtree,
                users,
                confine,
                user_limits: config.user_limits,
                user_cgroups: Arc::default(),
                egress,
                egress_counters: Arc::default(),
                build,
            }),
        })
    }

    /// Everything a preparation of an install (`uv sync` in `dir`, `argv` the programs it runs) needs before
    /// it is spawned, confined like a plugin under an identity of its own: the [`BUILD_USER`]'s for `build_id`
    /// (one per tool and version: never root, never a user's plugin uid), a new cgroup with
    /// `preparation.limits`, and a plan whose only writable paths are `dir` and the identity's TMPDIR, whose
    /// view hides the state directory and `preparation.hidden_paths`, and whose network is the egress proxy to
    /// `preparation.index_hosts` (none when that list is empty). Never from a stub. Nothing is left behind on
    /// failure.
    pub fn prepare_build(
        &self,
        build_id: &str,
        dir: &std::path::Path,
        argv: &[String],
    ) -> Result<Prepared, SandboxError> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let space = self.user_space(BUILD_USER, build_id)?;
        let name = format!("build-{build_id}-{}", SEQ.fetch_add(1, Ordering::Relaxed));
        let cgroup = self.create_session(&space.user_key, &name, self.inner.build.limits)?;
        let net = self.inner.build.egress.as_ref().map_or(Net::Own, Net::Proxy);
        let writable = [space.tmpdir.clone(), dir.to_path_buf()];
        let planned = self.confined_plan(
            cgroup.as_ref(),
            &space,
            &command_paths(dir, argv),
            &writable,
            &self.inner.build.hidden,
            net,
        );
        Self::planned(space, cgroup, planned, None, None)
    }

    /// Whether a preparation reaches the network (through the egress proxy to the package indexes).
    pub fn build_has_network(&self) -> bool {
        self.inner.build.egress.is_some()
    }

    /// The spawn plan of a session: join `cgroup`, take `space`'s ids, and — with isolation — the configured
    /// namespaces and seccomp, with `paths` (from [`command_paths`]) plus `space`'s TMPDIR and workspace kept
    /// visible in the private `/tmp`.
    pub fn plan(
        &self,
        cgroup: Option<&SessionCgroup>,
        space: &UserSpace,
        paths: &[PathBuf],
    ) -> Result<SpawnPlan, SandboxError> {
        self.plan_with(cgroup, space, paths, false)
    }

    /// [`plan`](Self::plan), with a network namespace served by the egress proxy when `egress` (and the
    /// sandbox has namespaces and an egress policy).
    fn plan_with(
        &self,
        cgroup: Option<&SessionCgroup>,
        space: &UserSpace,
        paths: &[PathBuf],
        egress: bool,
    ) -> Result<SpawnPlan, SandboxError> {
        let net = match (egress, &self.inner.egress) {
            (true, Some(policy)) => Net::Proxy(policy),
            _ => Net::Pooled,
        };
        let writable = [space.tmpdir.clone(), space.workspace.clone()];
        self.confined_plan(cgroup, space, paths, &writable, &[], net)
    }

    /// The spawn plan of a process of `space` in `cgroup`: with isolation, the configured seccomp and — with
    /// namespaces — `paths` kept visible, `writable` bound back writable, `hidden` covered, and its network as
    /// `net` says.
    fn confined_plan(
        &self,
        cgroup: Option<&SessionCgroup>,
        space: &UserSpace,
        paths: &[PathBuf],
        writable: &[PathBuf],
        hidden: &[PathBuf],
        net: Net<'_>,
    ) -> Result<SpawnPlan, SandboxError> {
        let plan = SpawnPlan::for_user(cgroup, space);
        let Some(base) = &self.inner.confine else {
            return Ok(plan);
        };
        let mut env = Vec::new();
        let namespaces = if base.namespaces {
            let mut ns = confine::namespaces_hiding(paths, writable, base.tmp_bytes, hidden, &base.cgroups)
                .map_err(|e| SandboxError::Config {
                reason: e.to_string(),
            })?;
            match net {
                Net::Proxy(policy) => {
                    ns.join_net = Some(self.egress_net(policy)?);
                    env = crate::egress::proxy_env();
                }
                Net::Pooled => {
                    ns.join_net = base.netns_pool.as_ref().and_then(NetnsPool::take).map(Arc::new);
                }
                Net::Own => {}
            }
            Some(ns)
        } else {
            None
        };
        Ok(plan
            .confined(Some(Arc::new(Confinement {
                namespaces,
                seccomp: base.seccomp.clone(),
            })))
            .with_env(env))
    }

    /// What a prepared process needs, once its cgroup is made: `planned`'s plan, or — when planning failed — the
    /// cgroup removed and the error.
    fn planned(
        space: UserSpace,
        cgroup: Option<SessionCgroup>,
        planned: Result<SpawnPlan, SandboxError>,
        stubs: Option<StubPool>,
        seated: Option<Stub>,
    ) -> Result<Prepared, SandboxError> {
        match planned {
            Ok(plan) => Ok(Prepared {
                space,
                cgroup,
                plan,
                stubs,
                seated,
            }),
            Err(e) => {
                if let Some(cg) = cgroup {
                    let _ = cg.remove();
                }
                Err(e)
            }
        }
    }

    /// A network namespace whose loopback holds a proxy enforcing `policy` (counted in this sandbox's counters).
    fn egress_net(&self, policy: &Arc<Policy>) -> Result<Arc<NetNs>, SandboxError> {
        let (policy, counters) = (policy.clone(), self.inner.egress_counters.clone());
        let net = NetNs::egress(EGRESS_PROXY_PORT, move |listener| {
            crate::egress::serve(listener, policy, counters)
        })
        .map_err(|e| SandboxError::Unavailable {
            reason: format!("cannot prepare the egress network namespace: {e}"),
        })?;
        Ok(Arc::new(net))
    }

    /// Whether the operator granted `tool_id` egress (and this sandbox can give it: namespaces on).
    pub fn grants_egress(&self, tool_id: &str) -> bool {
        self.inner.egress.as_ref().is_some_and(|p| p.grants(tool_id))
    }

    /// How many pre-made network namespaces are waiting (0 without namespaces or with `netns_pool = 0`).
    pub fn netns_pool_ready(&self) -> usize {
        self.inner
            .confine
            .as_ref()
            .and_then(|c| c.netns_pool.as_ref())
            .map_or(0, NetnsPool::ready)
    }

    /// How many sandbox stubs are waiting (0 without stubs).
    pub fn stubs_ready(&self) -> usize {
        self.stub_pool().map_or(0, StubPool::ready)
    }

    /// How many plugin processes were started from a sandbox stub so far.
    pub fn stub_claims(&self) -> u64 {
        self.stub_pool().map_or(0, StubPool::claims)
    }

    /// Whether this sandbox has sandbox stubs and they work (false once the pool gave up).
    pub fn stubs_enabled(&self) -> bool {
        self.stub_pool().is_some_and(|p| !p.failed())
    }

    /// Starts making sandbox stubs now (on the current tokio runtime), so the first sessions find them waiting;
    /// otherwise they start with the first session.
    pub fn start_stubs(&self) {
        if let Some(pool) = self.stub_pool() {
            pool.start();
        }
    }

    /// Kills and reaps every sandbox stub and makes no more (the worker is stopping).
    pub async fn shutdown_stubs(&self) {
        if let Some(pool) = self.stub_pool() {
            pool.shutdown().await;
        }
    }

    fn stub_pool(&self) -> Option<&StubPool> {
        self.inner.confine.as_ref().and_then(|c| c.stub_pool.as_ref())
    }

    /// What the egress proxies of this sandbox did.
    pub fn egress_counters(&self) -> Arc<EgressCounters> {
        self.inner.egress_counters.clone()
    }

    /// Everything a plugin process of `user` for `tool_id` needs before it is spawned: its [`UserSpace`], a
    /// new session cgroup (`<user key prefix>-<tool_id>-<kind><n>`, unique in the process) with `limits`
    /// inside the user's ceiling, and the [`plan`](Self::plan) for `argv` run from `dir`. Nothing is left
    /// behind on failure.
    ///
    /// `start` says who starts the process: [`Start::Worker`] (the worker's launch, from a sandbox stub where it
    /// can) lets the first session of a user with no live ceiling adopt a seated stub (`seat.rs`), whose cgroups
    /// become the user's ceiling and the session's cgroup, so neither is made on the cold path and the plugin is
    /// not migrated; [`Start::Caller`] (a command of the caller's, spawned with [`apply`]) never takes a stub.
    #[allow(clippy::too_many_arguments)] // each names a different fact of the process; none has a default
    pub fn prepare(
        &self,
        user: &str,
        tool_id: &str,
        kind: &str,
        limits: ResourceLimits,
        dir: &std::path::Path,
        argv: &[String],
        start: Start,
    ) -> Result<Prepared, SandboxError> {
        // A sequence number keeps a new session's cgroup apart from an evicted one's still being removed.
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let space = self.user_space(user, tool_id)?;
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let name = format!(
            "{}-{tool_id}-{kind}{seq}",
            &space.user_key[..8.min(space.user_key.len())]
        );
        let egress = self.grants_egress(tool_id);
        // An egress-granted plugin joins another network namespace: no stub can carry it.
        let adopted = if start == Start::Worker && !egress {
            self.adopt_seat(&space.user_key, &limits)
        } else {
            None
        };
        let (cgroup, seated) = match adopted {
            Some((cgroup, stub)) => (Some(cgroup), Some(stub)),
            None => (self.create_session(&space.user_key, &name, limits)?, None),
        };
        let planned = self.plan_with(cgroup.as_ref(), &space, &command_paths(dir, argv), egress);
        Self::planned(space, cgroup, planned, self.stub_pool().cloned(), seated)
    }

    /// For a user with no live ceiling, a seated stub whose seat becomes the user's ceiling and the session's
    /// cgroup, with `limits` (`seat.rs`). `None`: the user's ceiling is live, no seated stub waits, or the seat
    /// cannot take `limits` (that stub is then discarded, and the session made as usual).
    fn adopt_seat(&self, user_key: &str, limits: &ResourceLimits) -> Option<(SessionCgroup, Stub)> {
        let pool = self.stub_pool()?;
        let mut live = self
            .inner
            .user_cgroups
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if live.get(user_key).is_some_and(|r| r.handle.strong_count() > 0) {
            return None;
        }
        let mut stub = pool.take_seated()?;
        let seat = stub.take_seat()?;
        if let Err(e) = seat.adapt(limits) {
            tracing::warn!(error = %e, "cannot give a seat the session's limits: the session's cgroup is made anew");
            pool.discard(stub, seat);
            return None;
        }
        let user = Arc::new(UserCgroup {
            key: user_key.to_owned(),
            dirs: seat.user,
            own: false,
            registry: self.inner.user_cgroups.clone(),
        });
        let handle = Arc::downgrade(&user);
        live.insert(user_key.to_owned(), Registered { handle, own: false });
        Some((seat.session.in_user(user), stub))
    }

    /// Whether plugins get namespaces (and private `/proc`, `/tmp`) and seccomp: `(namespaces, seccomp)`.
    pub fn confinement(&self) -> (bool, bool) {
        self.inner
            .confine
            .as_ref()
            .map_or((false, false), |c| (c.namespaces, c.seccomp.is_some()))
    }

    /// `"cgroup_v1"`, `"cgroup_v2"` or `"none"` (the `isolation` metric label).
    pub fn mode(&self) -> &'static str {
        match self.version() {
            Some(CgroupVersion::V1) => "cgroup_v1",
            Some(CgroupVersion::V2) => "cgroup_v2",
            None => "none",
        }
    }

    /// The cgroup version, `None` without isolation.
    pub fn version(&self) -> Option<CgroupVersion> {
        self.inner.subtree.as_ref().map(Dirs::version)
    }

    /// The directories of the worker's subtree (one per distinct v1 hierarchy; empty without isolation).
    pub fn subtree_paths(&self) -> Vec<&std::path::Path> {
        self.inner.subtree.as_ref().map(Dirs::unique).unwrap_or_default()
    }

    /// Kills every process in, and removes, every session cgroup under this worker's subtree — what a
    /// predecessor killed with `-9` left. Call it at startup, before creating sessions. Tries every cgroup and
    /// returns the first error, if any.
    pub fn sweep_stale(&self) -> Result<SweepReport, SandboxError> {
        let mut report = SweepReport::default();
        let Some(root) = &self.inner.subtree else {
            return Ok(report);
        };
        let mut first_error = None;
        sweep_level(root, true, &mut report, &mut first_error);
        if report.cgroups_removed > 0 {
            tracing::info!(
                cgroups_removed = report.cgroups_removed,
                processes_killed = report.processes_killed,
                "swept stale session cgroups"
            );
        }
        first_error.map_or(Ok(report), Err)
    }

    /// [`sweep_stale`](Self::sweep_stale), then removes the worker's subtree itself: for a graceful shutdown, and
    /// for tests. The sandbox cannot create sessions afterwards.
    pub fn remove_subtree(&self) -> Result<SweepReport, SandboxError> {
        let report = self.sweep_stale()?;
        for dir in self.subtree_paths() {
            rmdir_cgroup(dir)?;
        }
        Ok(report)
    }

    /// Creates the cgroup of one session, with `limits`: memory (v1 `memory.limit_in_bytes` and, if the kernel
    /// accounts swap, `memory.memsw.limit_in_bytes`; v2 `memory.max`, `memory.swap.max = 0`,
    /// `memory.oom.group = 1`), `pids.max`, and a CFS quota of `cpu_millis` per 1000 of a 100 ms period (at
    /// least 1 ms). `name` may be anything; the cgroup is named `<sanitized name>-<hash>`
    /// ([`SessionCgroup::name`]). It is an error if that cgroup already exists.
    ///
    /// Returns `Ok(None)` without isolation (see the module documentation for the fallback).
    ///
    /// The cgroup is created inside the ceiling cgroup of `user_key` (`user-<user_key>`, with
    /// `config.user_limits`), made on the user's first session and removed with the last.
    pub fn create_session(
        &self,
        user_key: &str,
        name: &str,
        limits: ResourceLimits,
    ) -> Result<Option<SessionCgroup>, SandboxError> {
        let Some(root) = &self.inner.subtree else {
            return Ok(None);
        };
        let name = names::unique_name(name);
        let mut live = self
            .inner
            .user_cgroups
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let user = match live.get(user_key).and_then(|r| r.handle.upgrade()) {
            Some(user) => user,
            None => {
                let dirs = root.join(&format!("{USER_CGROUP_PREFIX}{}", names::readable_name(user_key)));
                control::ensure_user_cgroup(&dirs, &self.inner.user_limits)?;
                let user = Arc::new(UserCgroup {
                    key: user_key.to_owned(),
                    dirs,
                    own: true,
                    registry: self.inner.user_cgroups.clone(),
                });
                let handle = Arc::downgrade(&user);
                live.insert(user_key.to_owned(), Registered { handle, own: true });
                user
            }
        };
        let dirs = user.dirs.join(&name);
        let created = SessionCgroup::create(name, dirs, &limits);
        drop(live);
        created.map(|c| Some(c.in_user(user)))
    }

    /// The identity and directories of `user` (any string) for `tool_id` (any string): the uid/gid to run as
    /// (`None` for `RunAs::Inherit`), and — created idempotently, mode 0700, owned by that uid —
    /// `<state_dir>/users/<user_key>/workspace` and `<state_dir>/users/<user_key>/tmp/<tool_key>`, where
    /// `user_key` is the first 32 hex digits of sha256(`user`) and `tool_key` the sanitized `tool_id` plus a
    /// short hash.
    ///
    /// With `RunAs::PerUser`, a user's uid is allocated on first sight — the lowest free one of the range — and
    /// persisted in `<state_dir>/uids.json` (atomically, under a mutex and a file lock), so two users never share
    /// a uid and a restarted worker gives everyone the same uid again. [`SandboxError::UidRangeExhausted`] when
    /// the range is full.
    pub fn user_space(&self, user: &str, tool_id: &str) -> Result<UserSpace, SandboxError> {
        self.inner.users.user_space(user, tool_id)
    }

    /// How many users hold an identity on this worker now, and the most its budget admits at once
    /// (`user_budget_bytes` over each user's memory ceiling plus disk cap).
    pub fn admitted_users(&self) -> (usize, usize) {
        self.inner.users.admitted()
    }
}

/// Kills and removes every session cgroup under `parent` (and, at the top, under every user ceiling, which is
/// then removed too). Errors go to `first_error`; every cgroup is tried.
fn sweep_level(parent: &Dirs, top: bool, report: &mut SweepReport, first_error: &mut Option<SandboxError>) {
    let mut names = BTreeSet::new();
    for dir in parent.unique() {
        let sweep_err = |source| SandboxError::Sweep {
            path: dir.to_path_buf(),
            source,
        };
        let entries = match fs::read_dir(dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => {
                first_error.get_or_insert(sweep_err(e));
                continue;
            }
        };
        for entry in entries {
            let entry = match entry {
                Ok(entry) => entry,
                Err(e) => {
                    first_error.get_or_insert(sweep_err(e));
                    continue;
                }
            };
            if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            match entry.file_name().into_string() {
                Ok(name) => {
                    names.insert(name);
                }
                Err(name) => {
                    tracing::warn!(dir = %dir.display(), ?name, "skipping a cgroup this worker cannot have created")
                }
            }
        }
    }
    for name in names {
        let dirs = parent.join(&name);
        if top && name.starts_with(USER_CGROUP_PREFIX) {
            sweep_level(&dirs, false, report, first_error);
            for dir in dirs.unique() {
                if let Err(e) = rmdir_cgroup(dir) {
                    first_error.get_or_insert(e);
                }
            }
            continue;
        }
        let session = SessionCgroup::from_dirs(name, dirs).map_err(|source| SandboxError::Sweep {
            path: parent
                .unique()
                .first()
                .map(|p| p.to_path_buf())
                .unwrap_or_default(),
            source,
        });
        let result = session.and_then(|s| {
            let killed = s.kill_all()?;
            s.remove()?;
            Ok(killed)
        });
        match result {
            Ok(killed) => {
                report.cgroups_removed += 1;
                report.processes_killed += killed;
            }
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
}

/// How preparations are confined: the hidden directories and, with namespaces and index hosts, the policy of
/// their proxy.
fn build_base(config: &WorkerConfig, namespaces: bool) -> Result<BuildBase, SandboxError> {
    let p = &config.preparation;
    let egress = if namespaces && !p.index_hosts.is_empty() {
        let ranges = crate::config::Egress {
            tools: Vec::new(),
            allow_cidrs: p.allow_cidrs.clone(),
            deny_cidrs: config.egress.deny_cidrs.clone(),
            ports: Vec::new(),
            max_connections: config.egress.max_connections,
        };
        let policy = Policy::for_hosts(&ranges, &p.index_hosts).map_err(|e| SandboxError::Config {
            reason: e.to_string(),
        })?;
        Some(Arc::new(policy))
    } else {
        None
    };
    let mut hidden = vec![config.state_dir.clone()];
    hidden.extend(p.hidden_paths.iter().cloned());
    Ok(BuildBase {
        hidden,
        egress,
        limits: p.limits,
    })
}

/// Compiles the seccomp profile and proves the configured confinement works in a forked probe; `view` is what
/// the plugins are to see of the worker's cgroup hierarchies.
fn prepare_confinement(
    config: &WorkerConfig,
    seats: seat::SeatPlan,
    view: &confine::CgroupView,
) -> Result<ConfineBase, SandboxError> {
    let c = &config.confinement;
    let unavailable = |reason: String| SandboxError::Unavailable { reason };
    let seccomp = if c.seccomp {
        Some(Arc::new(SeccompProfile::compile(&c.seccomp_deny).map_err(
            |e| SandboxError::Config {
                reason: format!("confinement.seccomp_deny: {e}"),
            },
        )?))
    } else {
        tracing::warn!(
            "seccomp is off (confinement.seccomp = false): plugins reach the whole kernel interface"
        );
        None
    };
    if !c.namespaces {
        tracing::warn!(
            "namespaces are off (confinement.namespaces = false): plugins share the worker's network, /proc and /tmp"
        );
    }
    let cgroups = Arc::new(CgroupMounts::new(view).map_err(|e| unavailable(e.to_string()))?);
    // The session-independent namespace plan: the confinement probe's, and what every stub sets up.
    let base_ns = if c.namespaces {
        Some(confine::namespaces(&[], &[], c.tmp_bytes, &cgroups).map_err(|e| unavailable(e.to_string()))?)
    } else {
        None
    };
    let stub_pool = match (&config.sandbox_stub, &base_ns) {
        (Some(program), Some(ns)) if c.stub_pool > 0 => {
            let text = |s: &std::ffi::CStr| s.to_string_lossy().into_owned();
            let setup = stub_msg::Setup {
                protocol: stub_msg::STUB_PROTOCOL,
                tmp_root: text(&ns.tmp_root),
                tmp_options: text(&ns.tmp_options),
                proc_options: text(&ns.proc_options),
                cgroups: view.clone(),
                seccomp: seccomp
                    .as_ref()
                    .map(|p| {
                        p.programs
                            .iter()
                            .map(|prog| prog.iter().map(|i| (i.code, i.jt, i.jf, i.k)).collect())
                            .collect()
                    })
                    .unwrap_or_default(),
            };
            Some(
                StubPool::new(program.clone(), c.stub_pool, &setup, Some(seats))
                    .map_err(|e| unavailable(format!("cannot prepare the sandbox stubs: {e}")))?,
            )
        }
        _ => None,
    };
    let netns_pool = if c.namespaces && c.netns_pool > 0 && stub_pool.is_none() {
        Some(
            NetnsPool::new(c.netns_pool)
                .map_err(|e| unavailable(format!("cannot start the network namespace pool: {e}")))?,
        )
    } else {
        None
    };
    let base = ConfineBase {
        namespaces: c.namespaces,
        tmp_bytes: c.tmp_bytes,
        seccomp,
        netns_pool,
        stub_pool,
        cgroups,
    };
    let probe = Confinement {
        namespaces: base_ns,
        seccomp: base.seccomp.clone(),
    };
    // In the probe's private /tmp (a tmpfs of its own), gone with it.
    let favor = match (&probe.namespaces, config.favor_dynmods) {
        (Some(ns), true) => Some(
            std::ffi::CString::new([ns.tmp_root.as_bytes(), b"/.cgroup2"].concat()).map_err(|_| {
                SandboxError::Config {
                    reason: "the tmp root contains a NUL byte".into(),
                }
            })?,
        ),
        _ => None,
    };
    let favored = spawn::probe(&probe, favor.as_deref()).map_err(|e| {
        unavailable(format!(
            "cannot confine plugins ({e}); the worker needs root (CAP_SYS_ADMIN) for namespaces and a kernel \
             with seccomp filters; set confinement.namespaces = false or confinement.seccomp = false to run \
             without them"
        ))
    })?;
    if favor.is_some() && !favored {
        tracing::warn!(
            "the kernel did not take cgroup favordynmods (Linux >= 6.1 in the host's cgroup namespace): a \
             plugin's cold start after a quiet spell waits for an RCU grace period when it joins its cgroup"
        );
    }
    tracing::info!(
        namespaces = base.namespaces,
        seccomp = base.seccomp.is_some(),
        favor_dynmods = favor.is_some() && favored,
        "plugin confinement ready"
    );
    Ok(base)
}

/// Detects the cgroup version, creates the worker's subtree and proves it usable with a probe session; also
/// what a confined plugin is to see of those hierarchies (`detect::plugin_view`).
fn prepare_cgroups(worker_id: &str) -> Result<(Dirs, confine::CgroupView), SandboxError> {
    let unavailable = |reason: String| SandboxError::Unavailable { reason };
    let read = |path: &str| fs::read_to_string(path).map_err(|e| unavailable(format!("reading {path}: {e}")));
    // A read-only unified hierarchy (an unprivileged container): the worker mounts its own (detect.rs).
    detect::ensure_writable_v2()?;
    let mountinfo = read("/proc/self/mountinfo")?;
    let own = detect::detect(&mountinfo, &read("/proc/self/cgroup")?, |p| fs::read_to_string(p))
        .map_err(unavailable)?;
    let view = detect::plugin_view(&mountinfo, &own);
    let subtree_name = format!("cloud-agents-{}", names::readable_name(worker_id));
    let subtree = detect::prepare_subtree(&own, &subtree_name).map_err(unavailable)?;

    // Session names never start with '.', so the probe cannot collide with a session.
    let probe_name = format!(
        ".probe-{}-{}",
        rustix::process::getpid().as_raw_nonzero(),
        PROBE_SEQ.fetch_add(1, Ordering::Relaxed)
    );
    let probe = SessionCgroup::create(
        probe_name.clone(),
        subtree.join(&probe_name),
        &ResourceLimits::default(),
    )
    .map_err(|e| {
        unavailable(format!(
            "cannot create a session cgroup in the worker's subtree: {e}"
        ))
    })?;
    probe
        .remove()
        .map_err(|e| unavailable(format!("cannot remove a probe session cgroup: {e}")))?;

    let dirs: Vec<String> = subtree.unique().iter().map(|d| d.display().to_string()).collect();
    tracing::info!(version = ?subtree.version(), subtree = ?dirs, "cgroup isolation ready");
    Ok((subtree, view))
}

/// Sends `signal` to the process group `pgid` — the fallback for reaching a plugin's tree without a cgroup (a
/// plugin spawned with a [`SpawnPlan`] leads its own group: its pgid is its pid). `Ok(false)` if the group no
/// longer exists. Refuses group ids that would signal the worker itself or every process (`0`, `1`, the
/// worker's own group).
pub fn signal_process_group(pgid: u32, signal: Signal) -> Result<bool, SandboxError> {
    let invalid = |why: &str| SandboxError::SignalGroup {
        pgid,
        source: io::Error::new(io::ErrorKind::InvalidInput, why.to_owned()),
    };
    let raw = i32::try_from(pgid).map_err(|_| invalid("not a process group id"))?;
    let pid = Pid::from_raw(raw)
        .filter(|_| raw > 1)
        .ok_or_else(|| invalid("refusing to signal group 0 or 1"))?;
    if rustix::process::getpgrp() == pid {
        return Err(invalid("refusing to signal the worker's own process group"));
    }
    match rustix::process::kill_process_group(pid, signal) {
        Ok(()) => Ok(true),
        Err(rustix::io::Errno::SRCH) => Ok(false),
        Err(e) => Err(SandboxError::SignalGroup {
            pgid,
            source: e.into(),
        }),
    }
}
