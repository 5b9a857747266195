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

mod control;
mod detect;
mod error;
mod names;
mod spawn;
mod users;

use std::collections::BTreeSet;
use std::fs;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use rustix::process::{Pid, Signal};

use control::{Dirs, rmdir_cgroup};
pub use control::{SessionCgroup, Usage};
pub use error::SandboxError;
pub use spawn::{SpawnPlan, apply, die_with_parent};
pub use users::UserSpace;
use users::Users;

use crate::config::{IsolationMode, ResourceLimits, WorkerConfig};

/// The cgroup version in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CgroupVersion {
    /// Legacy hierarchies, one per controller (or co-mounted group).
    V1,
    /// The unified hierarchy.
    V2,
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
    pub fn new(config: &WorkerConfig) -> Result<Sandbox, SandboxError> {
        let users = Users::new(&config.state_dir, &config.run_as)?;
        let subtree = match config.isolation {
            IsolationMode::None => {
                tracing::warn!(
                    worker_id = %config.worker_id,
                    "isolation is off: plugins run without cgroups, limits or reliable process-tree kill"
                );
                None
            }
            IsolationMode::Cgroup => Some(prepare_cgroups(&config.worker_id)?),
        };
        Ok(Sandbox {
            inner: Arc::new(Inner { subtree, users }),
        })
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
        let mut names = BTreeSet::new();
        for dir in root.unique() {
            let sweep_err = |source| SandboxError::Sweep {
                path: dir.to_path_buf(),
                source,
            };
            let entries = match fs::read_dir(dir) {
                Ok(entries) => entries,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(sweep_err(e)),
            };
            for entry in entries {
                let entry = entry.map_err(sweep_err)?;
                if !entry.file_type().map_err(sweep_err)?.is_dir() {
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
        let mut first_error = None;
        for name in names {
            let dirs = root.join(&name);
            let session = SessionCgroup::from_dirs(name, dirs).map_err(|source| SandboxError::Sweep {
                path: root.unique().first().map(|p| p.to_path_buf()).unwrap_or_default(),
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
    pub fn create_session(
        &self,
        name: &str,
        limits: ResourceLimits,
    ) -> Result<Option<SessionCgroup>, SandboxError> {
        let Some(root) = &self.inner.subtree else {
            return Ok(None);
        };
        let name = names::unique_name(name);
        let dirs = root.join(&name);
        SessionCgroup::create(name, dirs, &limits).map(Some)
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
}

/// Detects the cgroup version, creates the worker's subtree and proves it usable with a probe session.
fn prepare_cgroups(worker_id: &str) -> Result<Dirs, SandboxError> {
    let unavailable = |reason: String| SandboxError::Unavailable { reason };
    let read = |path: &str| fs::read_to_string(path).map_err(|e| unavailable(format!("reading {path}: {e}")));
    let own = detect::detect(&read("/proc/self/mountinfo")?, &read("/proc/self/cgroup")?, |p| {
        fs::read_to_string(p)
    })
    .map_err(unavailable)?;
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
    Ok(subtree)
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
