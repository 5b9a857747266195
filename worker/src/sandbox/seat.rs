//! Seats: where a waiting sandbox stub sits — a spare user ceiling cgroup with one session cgroup in it, made
//! ahead of need by the stub pool's refill task (`stub_pool.rs`), the stub moved into the session cgroup.
//!
//! A session of a user with no live ceiling (the user's first session, or the first after all of theirs ended)
//! **adopts** a seated stub: the spare ceiling becomes the user's ceiling, the spare session cgroup the session's
//! cgroup (its limits adapted by the few writes that differ from the spare's), and the stub `exec`s the plugin
//! where it already is. Neither cgroup is made and the plugin's process is not migrated on the cold path — and
//! the first `cgroup.procs` write after a quiet spell, which waits for the kernel (about 0.3 ms for the five v1
//! hierarchies here, against 0.06 ms warm), leaves it too.
//!
//! A session of a user whose ceiling is live takes a stub the usual way: the stub joins the session's cgroup on
//! its claim and leaves its seat empty; the refill task removes the empty seat (plain `rmdir`s, retried until the
//! stub has left — never a kill, the stub is the new plugin by then).
//!
//! Seats keep their own names (`user-seat<n>/seat`): cgroup v2 cannot rename a cgroup, and nothing finds a
//! cgroup by its name (the worker keeps their directories; the sweep at start removes every `user-*`).

use std::ffi::OsStr;
use std::io;
use std::os::unix::ffi::OsStrExt as _;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use super::control::{self, Dirs, SessionCgroup};
use super::{SandboxError, USER_CGROUP_PREFIX};
use crate::config::{ResourceLimits, UserLimits};

/// The session cgroup's name inside a seat.
const SEAT_SESSION: &str = "seat";

/// Makes seat names unique within the process.
static SEAT_SEQ: AtomicU64 = AtomicU64::new(0);

/// How seats are made: where, and with which limits until adopted.
#[derive(Debug, Clone)]
pub(crate) struct SeatPlan {
    /// The worker's subtree.
    pub(crate) root: Dirs,
    /// Every user's ceiling.
    pub(crate) user_limits: UserLimits,
    /// The session cgroup's limits while it waits (a session's own are written on adoption where they differ).
    pub(crate) session_limits: ResourceLimits,
}

/// A spare user ceiling with its session cgroup.
#[derive(Debug)]
pub(crate) struct Seat {
    pub(crate) user: Dirs,
    pub(crate) session: SessionCgroup,
    limits: ResourceLimits,
}

impl SeatPlan {
    /// Makes a seat (blocking: a few `mkdir`s and writes); nothing is left behind on failure.
    pub(crate) fn make(&self) -> Result<Seat, SandboxError> {
        let n = SEAT_SEQ.fetch_add(1, Ordering::Relaxed);
        let user = self.root.join(&format!("{USER_CGROUP_PREFIX}seat{n}"));
        if let Err(e) = control::ensure_user_cgroup(&user, &self.user_limits) {
            remove_dirs(&user);
            return Err(e);
        }
        match SessionCgroup::create(
            SEAT_SESSION.to_owned(),
            user.join(SEAT_SESSION),
            &self.session_limits,
        ) {
            Ok(session) => Ok(Seat {
                user,
                session,
                limits: self.session_limits,
            }),
            Err(e) => {
                remove_dirs(&user);
                Err(e)
            }
        }
    }
}

impl Seat {
    /// Moves the process `pid` (a stub that is ready) into the seat's session cgroup (blocking).
    pub(crate) fn seat(&self, pid: u32) -> io::Result<()> {
        let pid = pid.to_string();
        for file in self.session.procs_files() {
            control::write_file(Path::new(OsStr::from_bytes(file.as_bytes())), &pid)?;
        }
        Ok(())
    }

    /// Gives the session cgroup `limits`: only the control files whose content differs from the seat's are
    /// written.
    pub(crate) fn adapt(&self, limits: &ResourceLimits) -> Result<(), SandboxError> {
        let writes = adapt_writes(self.session.dirs(), &self.limits, limits);
        control::apply_writes(writes).map_err(|(file, source)| SandboxError::CreateSession {
            name: SEAT_SESSION.to_owned(),
            action: "write",
            path: file,
            source,
        })
    }

    /// Removes the seat if nothing is in it any more (blocking; never kills); gives it back while a process
    /// still is (a stub that has not left yet).
    pub(crate) fn remove_if_empty(self) -> Option<Seat> {
        if self.session.pids().map_or(true, |p| !p.is_empty()) {
            return Some(self);
        }
        for dir in self.session.dirs().unique() {
            let _ = control::rmdir_cgroup(dir);
        }
        remove_dirs(&self.user);
        None
    }
}

/// The writes that take the cgroup `dirs` from limits `from` to `to`: only the files whose content changes, in
/// [`control::limit_writes`]'s order — except that a raised v1 memory limit writes `memory.memsw.limit_in_bytes`
/// first (the kernel refuses a memory limit above the memory+swap one, which a seat set equal to its memory).
fn adapt_writes(dirs: &Dirs, from: &ResourceLimits, to: &ResourceLimits) -> Vec<control::LimitWrite> {
    let now = control::limit_writes(dirs, from);
    let mut writes: Vec<control::LimitWrite> = control::limit_writes(dirs, to)
        .into_iter()
        .filter(|w| !now.iter().any(|n| n.file == w.file && n.content == w.content))
        .collect();
    if to.memory_bytes > from.memory_bytes {
        // Stable: everything else keeps its order.
        writes.sort_by_key(|w| !w.file.ends_with(MEMSW_LIMIT));
    }
    writes
}

/// v1's memory+swap limit file.
const MEMSW_LIMIT: &str = "memory.memsw.limit_in_bytes";

/// Best-effort `rmdir` of every directory of `dirs` (a busy one is left to the sweep at the next start).
fn remove_dirs(dirs: &Dirs) {
    for dir in dirs.unique() {
        let _ = std::fs::remove_dir(dir);
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::sandbox::control::V1Dirs;

    fn v1() -> Dirs {
        let at = |h: &str| PathBuf::from(format!("/sys/fs/cgroup/{h}/w/user-seat0/seat"));
        Dirs::V1(V1Dirs {
            memory: at("memory"),
            pids: at("pids"),
            cpu: at("cpu"),
            cpuacct: at("cpuacct"),
            freezer: at("freezer"),
        })
    }

    fn limits(memory_bytes: u64, pids_max: u64, cpu_millis: u64) -> ResourceLimits {
        ResourceLimits {
            memory_bytes,
            pids_max,
            cpu_millis,
        }
    }

    fn files(writes: &[control::LimitWrite]) -> Vec<String> {
        writes
            .iter()
            .map(|w| format!("{}={}", w.file.file_name().unwrap().to_string_lossy(), w.content))
            .collect()
    }

    #[test]
    fn equal_limits_write_nothing() {
        let l = limits(512 << 20, 64, 1000);
        assert!(adapt_writes(&v1(), &l, &l).is_empty());
    }

    #[test]
    fn only_what_differs_is_written() {
        let from = limits(512 << 20, 64, 1000);
        let to = limits(512 << 20, 32, 500);
        assert_eq!(
            files(&adapt_writes(&v1(), &from, &to)),
            ["pids.max=32", "cpu.cfs_quota_us=50000"]
        );
    }

    #[test]
    fn a_raised_memory_limit_writes_memsw_first_a_lowered_one_after() {
        let from = limits(256 << 20, 64, 1000);
        let to = limits(1 << 30, 64, 1000);
        assert_eq!(
            files(&adapt_writes(&v1(), &from, &to)),
            [
                "memory.memsw.limit_in_bytes=1073741824",
                "memory.limit_in_bytes=1073741824"
            ]
        );
        assert_eq!(
            files(&adapt_writes(&v1(), &to, &from)),
            [
                "memory.limit_in_bytes=268435456",
                "memory.memsw.limit_in_bytes=268435456"
            ]
        );
    }
}
