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
        let dirs = self.session.dirs();
        let now = control::limit_writes(dirs, &self.limits);
        let writes = control::limit_writes(dirs, limits)
            .into_iter()
            .filter(|w| !now.iter().any(|n| n.file == w.file && n.content == w.content))
            .collect();
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

/// Best-effort `rmdir` of every directory of `dirs` (a busy one is left to the sweep at the next start).
fn remove_dirs(dirs: &Dirs) {
    for dir in dirs.unique() {
        let _ = std::fs::remove_dir(dir);
    }
}
