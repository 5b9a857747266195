//! Session cgroups: their directories in each hierarchy, the control files of each cgroup version, and the
//! operations on a live session (limits, pids, usage, OOM count, signalling, freezing, killing, removal).
//!
//! | what              | v1 (one directory per hierarchy)                        | v2 (one directory)                  |
//! |-------------------|---------------------------------------------------------|-------------------------------------|
//! | membership        | `cgroup.procs` of memory, pids, cpu, cpuacct, freezer   | `cgroup.procs`                      |
//! | memory limit      | `memory.limit_in_bytes` (+ `memory.memsw.limit_in_bytes`) | `memory.max`, `memory.swap.max`=0, `memory.oom.group`=1 |
//! | processes         | `pids.max`, `pids.current`                              | same                                |
//! | cpu               | `cpu.cfs_period_us`, `cpu.cfs_quota_us`, `cpu.stat`     | `cpu.max`, `cpu.stat`               |
//! | cpu time          | `cpuacct.usage` (ns)                                    | `cpu.stat` `usage_usec`             |
//! | memory now / OOM  | `memory.usage_in_bytes`, `memory.oom_control` `oom_kill`| `memory.current`, `memory.events` `oom_kill` |
//! | freeze            | `freezer.state` `FROZEN`/`THAWED`                       | `cgroup.freeze`, `cgroup.events` `frozen` |
//! | kill              | freeze, SIGKILL each pid, thaw, repeat                  | `cgroup.kill`                       |
//!
//! Everything that decides file *content* (limits, parsing) is a pure function with unit tests, so the v2 paths
//! that cannot run on a v1 machine are still checked.

use std::collections::HashSet;
use std::ffi::CString;
use std::fs;
use std::io::{self, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal};

use super::{CgroupVersion, SandboxError};
use crate::config::{ResourceLimits, UserLimits};

/// The CFS period every session uses (100 ms).
pub(crate) const CPU_PERIOD_US: u64 = 100_000;

/// The kernel refuses CFS quotas below 1 ms.
const CPU_QUOTA_MIN_US: u64 = 1_000;

/// How long [`SessionCgroup::kill_all`] keeps trying.
const KILL_DEADLINE: Duration = Duration::from_secs(2);

/// How long one kill round waits for the freezer to report `FROZEN` before signalling anyway.
const FREEZE_WAIT: Duration = Duration::from_millis(100);

/// How long one kill round waits for the cgroup to empty before the next round.
const ROUND_WAIT: Duration = Duration::from_millis(50);

/// How long `rmdir` is retried on `EBUSY` (the kernel releases a cgroup shortly after its last task exits).
const RMDIR_DEADLINE: Duration = Duration::from_secs(1);

/// A v1 cgroup: one directory per needed hierarchy (equal paths when controllers are co-mounted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct V1Dirs {
    pub(crate) memory: PathBuf,
    pub(crate) pids: PathBuf,
    pub(crate) cpu: PathBuf,
    pub(crate) cpuacct: PathBuf,
    pub(crate) freezer: PathBuf,
}

/// The directories of one cgroup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Dirs {
    V1(V1Dirs),
    V2 { dir: PathBuf },
}

impl Dirs {
    pub(crate) fn version(&self) -> CgroupVersion {
        match self {
            Dirs::V1(_) => CgroupVersion::V1,
            Dirs::V2 { .. } => CgroupVersion::V2,
        }
    }

    /// The child cgroup `name` of this one.
    pub(crate) fn join(&self, name: &str) -> Dirs {
        match self {
            Dirs::V1(d) => Dirs::V1(V1Dirs {
                memory: d.memory.join(name),
                pids: d.pids.join(name),
                cpu: d.cpu.join(name),
                cpuacct: d.cpuacct.join(name),
                freezer: d.freezer.join(name),
            }),
            Dirs::V2 { dir } => Dirs::V2 { dir: dir.join(name) },
        }
    }

    /// Every distinct directory, memory first.
    pub(crate) fn unique(&self) -> Vec<&Path> {
        match self {
            Dirs::V1(d) => {
                let mut out: Vec<&Path> = Vec::with_capacity(5);
                for p in [&d.memory, &d.pids, &d.cpu, &d.cpuacct, &d.freezer] {
                    if !out.contains(&p.as_path()) {
                        out.push(p);
                    }
                }
                out
            }
            Dirs::V2 { dir } => vec![dir],
        }
    }

    fn memory(&self) -> &Path {
        match self {
            Dirs::V1(d) => &d.memory,
            Dirs::V2 { dir } => dir,
        }
    }

    fn pids(&self) -> &Path {
        match self {
            Dirs::V1(d) => &d.pids,
            Dirs::V2 { dir } => dir,
        }
    }

    fn cpu(&self) -> &Path {
        match self {
            Dirs::V1(d) => &d.cpu,
            Dirs::V2 { dir } => dir,
        }
    }
}

/// One control-file write of a session's limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LimitWrite {
    pub(crate) file: PathBuf,
    pub(crate) content: String,
    /// Skipped when the file is absent, logged (not fatal) when the write fails: swap limits, which exist only
    /// with swap accounting.
    pub(crate) best_effort: bool,
}

/// The CFS quota for `cpu_millis` over a [`CPU_PERIOD_US`] period (1000 millicores = one full period), at least
/// the kernel's 1 ms minimum.
pub(crate) fn cpu_quota_us(cpu_millis: u64) -> u64 {
    cpu_millis
        .saturating_mul(CPU_PERIOD_US / 1000)
        .max(CPU_QUOTA_MIN_US)
}

fn write_of(dir: &Path, file: &str, content: String, best_effort: bool) -> LimitWrite {
    LimitWrite {
        file: dir.join(file),
        content,
        best_effort,
    }
}

/// The memory limit of `dirs` (and no swap beyond it: v1 `memsw` equal to it, v2 `swap.max` 0, both best
/// effort), then its `pids.max`. v1: memsw may not be below memory, hence memory first (a fresh cgroup's memsw
/// is unlimited).
fn memory_and_pids(
    dirs: &Dirs,
    memory_bytes: u64,
    pids_max: u64,
    v2_between: Option<LimitWrite>,
) -> Vec<LimitWrite> {
    let memory = memory_bytes.to_string();
    let mut out = match dirs {
        Dirs::V1(d) => vec![
            write_of(&d.memory, "memory.limit_in_bytes", memory.clone(), false),
            write_of(&d.memory, "memory.memsw.limit_in_bytes", memory, true),
        ],
        Dirs::V2 { dir } => vec![
            write_of(dir, "memory.max", memory, false),
            write_of(dir, "memory.swap.max", "0".to_owned(), true),
        ],
    };
    out.extend(v2_between);
    out.push(write_of(dirs.pids(), "pids.max", pids_max.to_string(), false));
    out
}

/// The control-file writes that apply `limits` to the cgroup `dirs`, in the order they must happen.
pub(crate) fn limit_writes(dirs: &Dirs, limits: &ResourceLimits) -> Vec<LimitWrite> {
    let quota = cpu_quota_us(limits.cpu_millis);
    match dirs {
        Dirs::V1(d) => {
            let mut out = memory_and_pids(dirs, limits.memory_bytes, limits.pids_max, None);
            out.push(write_of(
                &d.cpu,
                "cpu.cfs_period_us",
                CPU_PERIOD_US.to_string(),
                false,
            ));
            out.push(write_of(&d.cpu, "cpu.cfs_quota_us", quota.to_string(), false));
            out
        }
        Dirs::V2 { dir } => {
            let oom_group = write_of(dir, "memory.oom.group", "1".to_owned(), false);
            let mut out = memory_and_pids(dirs, limits.memory_bytes, limits.pids_max, Some(oom_group));
            out.push(write_of(
                dir,
                "cpu.max",
                format!("{quota} {CPU_PERIOD_US}"),
                false,
            ));
            out
        }
    }
}

/// The control-file writes that make the cgroup `dirs` a user's ceiling: memory (and swap) and pids, no cpu
/// quota (each session has its own). On v2 the user cgroup also hands the controllers down to its sessions.
pub(crate) fn user_limit_writes(dirs: &Dirs, limits: &UserLimits) -> Vec<LimitWrite> {
    let mut out = memory_and_pids(dirs, limits.memory_bytes, limits.pids_max, None);
    if let Dirs::V2 { dir } = dirs {
        out.push(write_of(
            dir,
            "cgroup.subtree_control",
            "+memory +pids +cpu".to_owned(),
            false,
        ));
    }
    out
}

/// Creates (if missing) the user cgroup `dirs` and (re)writes its ceiling.
pub(crate) fn ensure_user_cgroup(dirs: &Dirs, limits: &UserLimits) -> Result<(), SandboxError> {
    let err = |action: &'static str, path: &Path, source: io::Error| SandboxError::CreateSession {
        name: "user ceiling".to_owned(),
        action,
        path: path.to_path_buf(),
        source,
    };
    for dir in dirs.unique() {
        mkdir_ok_if_exists(dir).map_err(|e| err("mkdir", dir, e))?;
    }
    apply_writes(user_limit_writes(dirs, limits)).map_err(|(file, e)| err("write", &file, e))
}

/// Performs `writes` in order. A best-effort write (swap) is skipped when its file is absent and logged when
/// it fails; any other failure stops and names the file.
pub(crate) fn apply_writes(writes: Vec<LimitWrite>) -> Result<(), (PathBuf, io::Error)> {
    for write in writes {
        match write_file(&write.file, &write.content) {
            Ok(()) => {}
            Err(e) if write.best_effort && e.kind() == io::ErrorKind::NotFound => {}
            Err(e) if write.best_effort => tracing::warn!(
                file = %write.file.display(), error = %e,
                "cannot set a swap limit: swap may let processes exceed their memory limit"
            ),
            Err(e) => return Err((write.file, e)),
        }
    }
    Ok(())
}

/// The value of `key` in a flat-keyed file (`key value` per line: `memory.oom_control`, `memory.events`,
/// `cpu.stat`, `cgroup.events`).
pub(crate) fn parse_keyed(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let mut it = line.split_whitespace();
        if it.next()? == key {
            it.next()?.parse().ok()
        } else {
            None
        }
    })
}

/// The pids of a `cgroup.procs` file (lines that are not pids are ignored).
pub(crate) fn parse_pids(text: &str) -> Vec<u32> {
    text.lines().filter_map(|l| l.trim().parse().ok()).collect()
}

/// A single-number file (`memory.current`, `pids.current`, `cpuacct.usage`, …).
fn parse_u64(path: &Path, text: &str) -> Result<u64, SandboxError> {
    text.trim().parse().map_err(|e| SandboxError::Read {
        path: path.to_path_buf(),
        source: io::Error::new(
            io::ErrorKind::InvalidData,
            format!("not a number ({e}): {:?}", text.trim()),
        ),
    })
}

pub(crate) fn read_file(path: &Path) -> io::Result<String> {
    fs::read_to_string(path)
}

/// Writes `content` with one `write(2)`, as control files expect. Never creates the file.
pub(crate) fn write_file(path: &Path, content: &str) -> io::Result<()> {
    fs::OpenOptions::new()
        .write(true)
        .open(path)?
        .write_all(content.as_bytes())
}

pub(crate) fn mkdir_ok_if_exists(path: &Path) -> io::Result<()> {
    match fs::create_dir(path) {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        other => other,
    }
}

/// Polls `done` with a growing pause (50 µs … 5 ms) until it is true or `limit` has passed; returns the last
/// answer. Bounded waits on the kernel, never used as synchronisation by itself.
pub(super) fn poll_until(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    let mut pause = Duration::from_micros(50);
    loop {
        if done() {
            return true;
        }
        if start.elapsed() >= limit {
            return false;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(5));
    }
}

/// `rmdir`, retried while the kernel still reports the cgroup busy; a missing directory counts as removed.
pub(crate) fn rmdir_cgroup(path: &Path) -> Result<(), SandboxError> {
    let mut last = Ok(());
    poll_until(RMDIR_DEADLINE, || {
        last = match fs::remove_dir(path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            other => other,
        };
        !matches!(&last, Err(e) if e.raw_os_error() == Some(rustix::io::Errno::BUSY.raw_os_error()))
    });
    last.map_err(|source| SandboxError::Remove {
        path: path.to_path_buf(),
        source,
    })
}

/// Sends `signal` to `pid` unless it is this process; `true` if it was delivered.
fn send(pid: u32, signal: Signal) -> bool {
    let own = rustix::process::getpid().as_raw_nonzero().get();
    match i32::try_from(pid)
        .ok()
        .filter(|p| *p != own)
        .and_then(Pid::from_raw)
    {
        Some(pid) => rustix::process::kill_process(pid, signal).is_ok(),
        None => false,
    }
}

/// Resource usage of a session cgroup.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Memory charged now, bytes (v1 `memory.usage_in_bytes`, v2 `memory.current`).
    pub memory_bytes: u64,
    /// CPU time consumed so far, µs (v1 `cpuacct.usage` / 1000, v2 `cpu.stat` `usage_usec`).
    pub cpu_usec: u64,
    /// Processes and threads now (`pids.current`).
    pub pids_current: u64,
    /// CFS periods in which the cgroup was throttled (`cpu.stat` `nr_throttled`).
    pub nr_throttled: u64,
}

/// The cgroup of one plugin session (a directory in every hierarchy, or one on v2).
///
/// Dropping it leaves the cgroup (and its processes) in place: removal is explicit ([`remove`](Self::remove)),
/// and whatever a crashed worker leaves is found by [`Sandbox::sweep_stale`](super::Sandbox::sweep_stale).
/// All operations are blocking file I/O of a few microseconds each, except [`kill_all`](Self::kill_all) and
/// [`remove`](Self::remove), which wait for the kernel (typically well under 10 ms, at most about 2 s); call
/// those from `tokio::task::spawn_blocking` in async code.
#[derive(Debug)]
pub struct SessionCgroup {
    name: String,
    dirs: Dirs,
    procs_files: Vec<CString>,
    /// The user's ceiling this cgroup lives in (kept alive, and removed after the last session, by this).
    /// Declared last: dropped after the session's own fields.
    user: Option<std::sync::Arc<super::UserCgroup>>,
}

impl SessionCgroup {
    /// A handle on the (existing or about to be created) cgroup `dirs`.
    pub(crate) fn from_dirs(name: String, dirs: Dirs) -> Result<SessionCgroup, io::Error> {
        let procs_files = SessionCgroup::procs_files_of(&dirs)?;
        Ok(SessionCgroup {
            name,
            dirs,
            procs_files,
            user: None,
        })
    }

    /// This cgroup, holding the user ceiling it was created in.
    pub(crate) fn in_user(mut self, user: std::sync::Arc<super::UserCgroup>) -> SessionCgroup {
        self.user = Some(user);
        self
    }

    /// The `cgroup.procs` paths as C strings (fails only for a path containing NUL, which Linux paths cannot).
    fn procs_files_of(dirs: &Dirs) -> Result<Vec<CString>, io::Error> {
        dirs.unique()
            .into_iter()
            .map(|d| CString::new(d.join("cgroup.procs").as_os_str().as_bytes()).map_err(io::Error::from))
            .collect()
    }

    /// Creates the cgroup directories and writes the limits; on failure removes what it created.
    pub(crate) fn create(
        name: String,
        dirs: Dirs,
        limits: &ResourceLimits,
    ) -> Result<SessionCgroup, SandboxError> {
        let err = |action: &'static str, path: &Path, source: io::Error| SandboxError::CreateSession {
            name: name.clone(),
            action,
            path: path.to_path_buf(),
            source,
        };
        let procs_files = match SessionCgroup::procs_files_of(&dirs) {
            Ok(files) => files,
            Err(e) => return Err(err("path", dirs.memory(), e)),
        };
        let mut created: Vec<&Path> = Vec::new();
        let result = (|| {
            for dir in dirs.unique() {
                fs::create_dir(dir).map_err(|e| err("mkdir", dir, e))?;
                created.push(dir);
            }
            apply_writes(limit_writes(&dirs, limits)).map_err(|(file, e)| err("write", &file, e))
        })();
        if let Err(e) = result {
            for dir in created.iter().rev() {
                if let Err(cleanup) = fs::remove_dir(dir) {
                    tracing::warn!(dir = %dir.display(), error = %cleanup, "cannot remove a half-created cgroup");
                }
            }
            return Err(e);
        }
        drop(created);
        Ok(SessionCgroup {
            name,
            dirs,
            procs_files,
            user: None,
        })
    }

    /// Its directories.
    pub(crate) fn dirs(&self) -> &Dirs {
        &self.dirs
    }

    /// The cgroup's directory name (sanitized, with a hash suffix).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Which cgroup version it is.
    pub fn version(&self) -> CgroupVersion {
        self.dirs.version()
    }

    /// Its directories (one per distinct v1 hierarchy, memory first; one on v2).
    pub fn paths(&self) -> Vec<&Path> {
        self.dirs.unique()
    }

    /// The `cgroup.procs` files a child writes itself into (see [`SpawnPlan`](super::SpawnPlan)).
    pub(crate) fn procs_files(&self) -> &[CString] {
        &self.procs_files
    }

    /// The pids currently in the cgroup: the union over every hierarchy (a child being attached is briefly in
    /// some hierarchies only). A hierarchy whose directory is gone contributes nothing.
    pub fn pids(&self) -> Result<Vec<u32>, SandboxError> {
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        for dir in self.dirs.unique() {
            let file = dir.join("cgroup.procs");
            let text = match read_file(&file) {
                Ok(text) => text,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(source) => return Err(SandboxError::Read { path: file, source }),
            };
            out.extend(parse_pids(&text).into_iter().filter(|p| seen.insert(*p)));
        }
        Ok(out)
    }

    /// Sends `signal` to every process in the cgroup (no freezing: for SIGTERM in the shutdown ladder).
    /// Returns how many processes it reached.
    pub fn signal_all(&self, signal: Signal) -> Result<usize, SandboxError> {
        Ok(self.pids()?.into_iter().filter(|pid| send(*pid, signal)).count())
    }

    /// Kills every process in the cgroup and waits (up to about 2 s) until it is empty. Returns how many
    /// distinct processes were signalled.
    ///
    /// v2 with `cgroup.kill` (Linux ≥ 5.14): the kernel kills the whole cgroup atomically. Otherwise (v1, old
    /// v2): freeze, SIGKILL every listed pid, thaw, repeat until `cgroup.procs` is empty — frozen processes
    /// cannot fork, so a fork bomb cannot outrun it. Processes are frozen with the SIGKILL pending and die on
    /// thaw.
    pub fn kill_all(&self) -> Result<usize, SandboxError> {
        let start = Instant::now();
        if let Dirs::V2 { dir } = &self.dirs {
            let kill = dir.join("cgroup.kill");
            if kill.exists() {
                let before = self.pids()?;
                if before.is_empty() {
                    return Ok(0);
                }
                match write_file(&kill, "1") {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
                    Err(source) => return Err(self.kill_error("write", &kill, source)),
                }
                self.wait_empty(start)?;
                return Ok(before.len());
            }
        }
        let mut signalled = HashSet::new();
        loop {
            let remaining = self.pids()?.len();
            if remaining == 0 {
                return Ok(signalled.len());
            }
            if start.elapsed() >= KILL_DEADLINE {
                return Err(SandboxError::KillTimeout {
                    name: self.name.clone(),
                    remaining,
                    waited: start.elapsed(),
                });
            }
            let frozen = self.freeze();
            for pid in self.pids()? {
                if send(pid, Signal::KILL) {
                    signalled.insert(pid);
                }
            }
            if frozen {
                self.thaw()?;
            }
            self.wait_empty_within(start, ROUND_WAIT)?;
        }
    }

    /// Freezes the cgroup and waits (briefly) until the kernel reports it frozen. Best effort: `false` if the
    /// freezer could not be used (the kill loop then signals without it).
    fn freeze(&self) -> bool {
        let (file, content) = self.freeze_file(true);
        if let Err(e) = write_file(&file, content) {
            tracing::warn!(cgroup = %self.name, file = %file.display(), error = %e, "cannot freeze; killing unfrozen");
            return false;
        }
        let frozen = poll_until(FREEZE_WAIT, || match &self.dirs {
            Dirs::V1(d) => read_file(&d.freezer.join("freezer.state")).is_ok_and(|s| s.trim() == "FROZEN"),
            Dirs::V2 { dir } => {
                read_file(&dir.join("cgroup.events")).is_ok_and(|s| parse_keyed(&s, "frozen") == Some(1))
            }
        });
        if !frozen {
            tracing::debug!(cgroup = %self.name, "freezer still freezing; signalling anyway");
        }
        true
    }

    fn thaw(&self) -> Result<(), SandboxError> {
        let (file, content) = self.freeze_file(false);
        match write_file(&file, content) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(self.kill_error("thaw", &file, e)),
            _ => Ok(()),
        }
    }

    fn freeze_file(&self, frozen: bool) -> (PathBuf, &'static str) {
        match &self.dirs {
            Dirs::V1(d) => (
                d.freezer.join("freezer.state"),
                if frozen { "FROZEN" } else { "THAWED" },
            ),
            Dirs::V2 { dir } => (dir.join("cgroup.freeze"), if frozen { "1" } else { "0" }),
        }
    }

    /// Waits until the cgroup is empty or [`KILL_DEADLINE`] (from `start`) has passed.
    fn wait_empty(&self, start: Instant) -> Result<(), SandboxError> {
        let remaining = self.wait_empty_within(start, KILL_DEADLINE)?;
        if remaining == 0 {
            Ok(())
        } else {
            Err(SandboxError::KillTimeout {
                name: self.name.clone(),
                remaining,
                waited: start.elapsed(),
            })
        }
    }

    /// Waits up to `slice` (but not past `start` + [`KILL_DEADLINE`]) for the cgroup to empty; returns how
    /// many processes remain.
    fn wait_empty_within(&self, start: Instant, slice: Duration) -> Result<usize, SandboxError> {
        let limit = slice.min(KILL_DEADLINE.saturating_sub(start.elapsed()));
        let mut remaining = Ok(0);
        poll_until(limit, || {
            remaining = self.pids().map(|p| p.len());
            !matches!(remaining, Ok(n) if n > 0)
        });
        remaining
    }

    fn kill_error(&self, action: &'static str, path: &Path, source: io::Error) -> SandboxError {
        SandboxError::Kill {
            name: self.name.clone(),
            action,
            path: path.to_path_buf(),
            source,
        }
    }

    /// OOM kills in this cgroup so far (v1 `memory.oom_control` `oom_kill`, v2 `memory.events` `oom_kill`);
    /// 0 if the file cannot be read.
    pub fn oom_kills(&self) -> u64 {
        let file = match &self.dirs {
            Dirs::V1(d) => d.memory.join("memory.oom_control"),
            Dirs::V2 { dir } => dir.join("memory.events"),
        };
        match read_file(&file) {
            Ok(text) => parse_keyed(&text, "oom_kill").unwrap_or(0),
            Err(e) => {
                tracing::debug!(file = %file.display(), error = %e, "cannot read the OOM count");
                0
            }
        }
    }

    /// Current resource usage.
    pub fn usage(&self) -> Result<Usage, SandboxError> {
        let read = |path: PathBuf| {
            read_file(&path)
                .map(|t| (path.clone(), t))
                .map_err(|source| SandboxError::Read { path, source })
        };
        let number = |path: PathBuf| read(path).and_then(|(p, t)| parse_u64(&p, &t));
        let keyed = |path: PathBuf, key: &str| {
            read(path).and_then(|(p, t)| {
                parse_keyed(&t, key).ok_or_else(|| SandboxError::Read {
                    path: p,
                    source: io::Error::new(io::ErrorKind::InvalidData, format!("no `{key}` line")),
                })
            })
        };
        let pids_current = number(self.dirs.pids().join("pids.current"))?;
        let nr_throttled = keyed(self.dirs.cpu().join("cpu.stat"), "nr_throttled")?;
        Ok(match &self.dirs {
            Dirs::V1(d) => Usage {
                memory_bytes: number(d.memory.join("memory.usage_in_bytes"))?,
                cpu_usec: number(d.cpuacct.join("cpuacct.usage"))? / 1000,
                pids_current,
                nr_throttled,
            },
            Dirs::V2 { dir } => Usage {
                memory_bytes: number(dir.join("memory.current"))?,
                cpu_usec: keyed(dir.join("cpu.stat"), "usage_usec")?,
                pids_current,
                nr_throttled,
            },
        })
    }

    /// Kills everything in the cgroup, then removes its directory in every hierarchy (retrying while the
    /// kernel reports it busy). A directory already gone counts as removed.
    pub fn remove(self) -> Result<(), SandboxError> {
        self.kill_all()?;
        let mut first_error = None;
        for dir in self.dirs.unique() {
            if let Err(e) = rmdir_cgroup(dir) {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> ResourceLimits {
        ResourceLimits {
            memory_bytes: 64 << 20,
            pids_max: 16,
            cpu_millis: 250,
        }
    }

    #[test]
    fn v2_limit_files() {
        let dirs = Dirs::V2 {
            dir: PathBuf::from("/cg/s"),
        };
        let writes: Vec<(String, String, bool)> = limit_writes(&dirs, &limits())
            .into_iter()
            .map(|w| (w.file.display().to_string(), w.content, w.best_effort))
            .collect();
        let expect = [
            ("/cg/s/memory.max", "67108864", false),
            ("/cg/s/memory.swap.max", "0", true),
            ("/cg/s/memory.oom.group", "1", false),
            ("/cg/s/pids.max", "16", false),
            ("/cg/s/cpu.max", "25000 100000", false),
        ]
        .map(|(f, c, b)| (f.to_owned(), c.to_owned(), b));
        assert_eq!(writes, expect);
    }

    #[test]
    fn v1_limit_files_memory_before_memsw() {
        let dirs = Dirs::V1(V1Dirs {
            memory: "/m/s".into(),
            pids: "/p/s".into(),
            cpu: "/c/s".into(),
            cpuacct: "/c/s".into(),
            freezer: "/f/s".into(),
        });
        let files: Vec<String> = limit_writes(&dirs, &limits())
            .into_iter()
            .map(|w| format!("{}={}", w.file.display(), w.content))
            .collect();
        assert_eq!(
            files,
            [
                "/m/s/memory.limit_in_bytes=67108864",
                "/m/s/memory.memsw.limit_in_bytes=67108864",
                "/p/s/pids.max=16",
                "/c/s/cpu.cfs_period_us=100000",
                "/c/s/cpu.cfs_quota_us=25000",
            ]
        );
        assert_eq!(dirs.unique().len(), 4, "co-mounted cpu,cpuacct is one directory");
    }

    #[test]
    fn user_ceiling_files_v1_and_v2() {
        let limits = UserLimits {
            memory_bytes: 1 << 30,
            pids_max: 500,
            ..UserLimits::default()
        };
        let v2 = user_limit_writes(
            &Dirs::V2 {
                dir: PathBuf::from("/cg/u"),
            },
            &limits,
        );
        let files: Vec<(String, &str)> = v2
            .iter()
            .map(|w| (w.file.display().to_string(), w.content.as_str()))
            .collect();
        assert_eq!(
            files,
            [
                ("/cg/u/memory.max".to_owned(), "1073741824"),
                ("/cg/u/memory.swap.max".to_owned(), "0"),
                ("/cg/u/pids.max".to_owned(), "500"),
                ("/cg/u/cgroup.subtree_control".to_owned(), "+memory +pids +cpu"),
            ]
        );
        let v1 = user_limit_writes(
            &Dirs::V1(V1Dirs {
                memory: PathBuf::from("/m/u"),
                pids: PathBuf::from("/p/u"),
                cpu: PathBuf::from("/c/u"),
                cpuacct: PathBuf::from("/c/u"),
                freezer: PathBuf::from("/f/u"),
            }),
            &limits,
        );
        let files: Vec<String> = v1.iter().map(|w| w.file.display().to_string()).collect();
        assert_eq!(
            files,
            [
                "/m/u/memory.limit_in_bytes",
                "/m/u/memory.memsw.limit_in_bytes",
                "/p/u/pids.max"
            ]
        );
        assert!(v1[1].best_effort && !v1[0].best_effort);
    }

    #[test]
    fn cpu_quota_is_clamped() {
        assert_eq!(cpu_quota_us(1000), 100_000);
        assert_eq!(cpu_quota_us(2500), 250_000);
        assert_eq!(cpu_quota_us(0), 1_000);
        assert_eq!(cpu_quota_us(u64::MAX), u64::MAX);
    }

    #[test]
    fn keyed_files() {
        let oom_control = "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n";
        assert_eq!(parse_keyed(oom_control, "oom_kill"), Some(3));
        let events = "low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\noom_group_kill 1\n";
        assert_eq!(parse_keyed(events, "oom_kill"), Some(1));
        let cpu_stat = "usage_usec 123456\nuser_usec 1\nsystem_usec 2\nnr_periods 40\nnr_throttled 7\n";
        assert_eq!(parse_keyed(cpu_stat, "usage_usec"), Some(123_456));
        assert_eq!(parse_keyed(cpu_stat, "nr_throttled"), Some(7));
        assert_eq!(parse_keyed("populated 1\nfrozen 1\n", "frozen"), Some(1));
        assert_eq!(parse_keyed("", "oom_kill"), None);
        assert_eq!(parse_keyed("oom_kill\noom_kill x\n", "oom_kill"), None);
    }

    #[test]
    fn procs_parsing_ignores_garbage() {
        assert_eq!(parse_pids("12\n 13 \n\nx\n-1\n99999999999\n14"), [12, 13, 14]);
        assert!(parse_u64(Path::new("f"), "12\n").is_ok_and(|n| n == 12));
        assert!(parse_u64(Path::new("f"), "max\n").is_err());
    }
}
