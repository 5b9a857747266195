//! The sandbox's errors: one variant per operation, each naming the file or directory involved.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// What went wrong in a [`Sandbox`](super::Sandbox) or [`SessionCgroup`](super::SessionCgroup) operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SandboxError {
    /// [`Sandbox::new`](super::Sandbox::new): cgroup isolation was asked for but cannot be used here. The worker
    /// refuses to start rather than run plugins unconfined.
    #[error("cgroup isolation is unavailable: {reason}")]
    Unavailable {
        /// Why, with what was tried (mounts, controllers, paths, errors).
        reason: String,
    },
    /// [`Sandbox::new`](super::Sandbox::new): the cgroup hierarchy is read-only and the worker could not mount a
    /// writable one of its own (cgroup isolation is unavailable; the worker refuses to start).
    #[error("cgroup isolation is unavailable: {0}")]
    CgroupMount(#[from] super::CgroupMountError),
    /// [`Sandbox::new`](super::Sandbox::new): the configuration cannot be honoured (e.g. `run_as: per_user`
    /// without root, or a uid range that includes root or overflows).
    #[error("invalid sandbox configuration: {reason}")]
    Config {
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// [`Sandbox::create_session`](super::Sandbox::create_session) failed; nothing of the session is left behind.
    #[error("creating session cgroup {name}: {action} {path}: {source}")]
    CreateSession {
        /// The session cgroup's (sanitized) name.
        name: String,
        /// The step that failed (`mkdir`, `write`).
        action: &'static str,
        /// The directory or file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Reading a cgroup's state ([`pids`](super::SessionCgroup::pids), [`usage`](super::SessionCgroup::usage))
    /// failed.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error (`InvalidData` for content that does not parse).
        #[source]
        source: io::Error,
    },
    /// [`kill_all`](super::SessionCgroup::kill_all) / [`signal_all`](super::SessionCgroup::signal_all) could not
    /// operate the cgroup (freezer, `cgroup.kill`).
    #[error("signalling the processes of cgroup {name}: {action} {path}: {source}")]
    Kill {
        /// The session cgroup's name.
        name: String,
        /// The step that failed.
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// [`kill_all`](super::SessionCgroup::kill_all) signalled everything it saw but the cgroup did not become
    /// empty in time (e.g. a process stuck in uninterruptible sleep).
    #[error("cgroup {name} still holds {remaining} process(es) after {waited:?} of kill attempts")]
    KillTimeout {
        /// The session cgroup's name.
        name: String,
        /// Processes still listed.
        remaining: usize,
        /// How long it tried.
        waited: Duration,
    },
    /// [`remove`](super::SessionCgroup::remove) / [`sweep_stale`](super::Sandbox::sweep_stale) could not remove
    /// a cgroup directory (after retries on `EBUSY`).
    #[error("removing cgroup directory {path}: {source}")]
    Remove {
        /// The directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// [`sweep_stale`](super::Sandbox::sweep_stale) could not list the worker's subtree.
    #[error("listing stale cgroups in {path}: {source}")]
    Sweep {
        /// The subtree directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// [`signal_process_group`](super::signal_process_group) refused the group id or the signal failed.
    #[error("signalling process group {pgid}: {source}")]
    SignalGroup {
        /// The process group id.
        pgid: u32,
        /// The OS error, or `InvalidInput` for a refused id.
        #[source]
        source: io::Error,
    },
    /// [`user_space`](super::Sandbox::user_space): every uid of the `run_as` range is held by a live identity
    /// (idle identities are reclaimed first).
    #[error("the per-user uid range [{first}, {first}+{count}) is exhausted")]
    UidRangeExhausted {
        /// First uid of the range.
        first: u32,
        /// Size of the range.
        count: u32,
    },
    /// [`user_space`](super::Sandbox::user_space): a new user would take the admitted users' memory ceilings and
    /// disk caps past the worker's budget (`user_budget_bytes`). Retriable: users are admitted again as others go
    /// idle, and another worker may have room.
    #[error(
        "this worker admits no more users: {admitted} admitted, each {per_user} bytes of the budget {budget}"
    )]
    UserBudget {
        /// Users admitted now (the most the budget holds).
        admitted: usize,
        /// What each costs: its memory ceiling plus its disk cap.
        per_user: u64,
        /// The budget, in bytes.
        budget: u64,
    },
    /// [`Sandbox::new`](super::Sandbox::new): a user's disk (a size-capped tmpfs) could not be mounted or
    /// wiped.
    #[error("user disk {path}: {action}: {source}")]
    UserDisk {
        /// The mount point.
        path: PathBuf,
        /// What failed (`mount`, `unmount`, `wipe`).
        action: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// [`user_space`](super::Sandbox::user_space): the persisted uid table could not be read, parsed or written.
    #[error("uid table {path}: {source}")]
    UidTable {
        /// `<state_dir>/uids.json` (or its lock / temp file).
        path: PathBuf,
        /// The OS error (`InvalidData` for a corrupt table).
        #[source]
        source: io::Error,
    },
    /// [`user_space`](super::Sandbox::user_space): a per-user directory could not be created or secured.
    #[error("user directory {path}: {action}: {source}")]
    UserDir {
        /// The directory.
        path: PathBuf,
        /// The step that failed (`mkdir`, `open`, `chown`, `chmod`).
        action: &'static str,
        /// The OS error (`ELOOP` / `ENOTDIR` if something other than a directory sits there).
        #[source]
        source: io::Error,
    },
}
