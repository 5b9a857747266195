//! Per-(user, tool) identity and directories.
//!
//! Every (user, tool_id) pair runs under its own uid (= gid), so two plugins of one user cannot reach each
//! other's processes (`/proc/<pid>/fd`, signals) or TMPDIRs. Layout under `state_dir` (owner, mode):
//!
//! ```text
//! state_dir/                       operator's; `o+x` is added for per-user uids to reach their directories
//!   uids.json                      root 0600  {"<user_key>/<tool_key>": uid, "<user_key>": gid}, replaced atomically
//!   uids.json.lock                 root 0600  flock(2) guarding read-modify-write of uids.json across processes
//!   users/                         root 0711  (traversable, not listable)
//!     <user_key>/                  root 0711
//!       workspaces/                root 0711
//!         <tool_key>/              uid  0700  the tool's workspace (`workspace = "per_tool"`, the default)
//!       workspace/                 root:gid 2770  shared by the user's tools (`workspace = "per_user"`)
//!       tmp/                       root 0711
//!         <tool_key>/              uid  0700  the tool's TMPDIR
//! ```
//!
//! With `workspace = "per_user"` the operator chooses to let a user's tools share files: the shared directory
//! belongs to a per-user group (allocated from the same range, keyed by the user alone), set-gid so new files
//! keep that group, and each tool's process gets it as its one supplementary group. TMPDIRs stay per tool.
//!
//! Only the leaves belong to the plugin's uid, so a plugin cannot rename or replace any directory the worker
//! later walks through. Directories are still walked with `openat(O_NOFOLLOW | O_DIRECTORY)` and fixed with
//! `fchown`/`fchmod` on the opened descriptor, so even a symlink planted where a directory should be makes the
//! call fail (`ELOOP`/`ENOTDIR`) instead of making the root worker chown or chmod the link's target.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::io::{self, Write};
use std::os::fd::OwnedFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use rustix::fs::{FlockOperation, Gid, Mode, OFlags, Uid};
use rustix::io::Errno;

use super::disk::Disks;
use super::{SandboxError, names};
use crate::config::{RunAs, WorkspaceSharing};

/// A user's identity and directories for one tool, from [`Sandbox::user_space`](super::Sandbox::user_space).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserSpace {
    /// The uid to run the plugin as (`None` for `RunAs::Inherit`: the worker's own): one per (user, tool_id).
    pub uid: Option<u32>,
    /// The gid to run the plugin as (= `uid`).
    pub gid: Option<u32>,
    /// Supplementary groups: the user's shared-workspace group with `workspace = "per_user"`, else none.
    pub groups: Vec<u32>,
    /// The workspace: `<state_dir>/users/<user_key>/workspaces/<tool_key>` (0700, owned by `uid`), or the
    /// user's shared `<state_dir>/users/<user_key>/workspace` (2770, group-owned).
    pub workspace: PathBuf,
    /// `<state_dir>/users/<user_key>/tmp/<tool_key>`, 0700, owned by `uid` (the plugin's `TMPDIR`).
    pub tmpdir: PathBuf,
    /// The first 32 hex digits of sha256(user id).
    pub user_key: String,
    /// Keeps this identity (its uid and directories) and its user's admission while any clone of this lives.
    pub hold: Hold,
}

/// The `run_as: per_user` uid range, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct UidRange {
    first: u32,
    count: u32,
}

impl UidRange {
    /// `[first, first + count)`: non-empty, never uid 0, never reaching `u32::MAX` (`(uid_t)-1`).
    pub(crate) fn new(first: u32, count: u32) -> Result<UidRange, String> {
        if first == 0 {
            return Err("run_as.first must not be 0: plugins would run as root".to_owned());
        }
        if count == 0 {
            return Err("run_as.count must be at least 1".to_owned());
        }
        if first.checked_add(count).is_none() {
            return Err(format!(
                "run_as range [{first}, {first}+{count}) overflows the uid space"
            ));
        }
        Ok(UidRange { first, count })
    }

    fn contains(self, uid: u32) -> bool {
        uid >= self.first && uid - self.first < self.count
    }
}

/// The lowest uid of `range` no entry of `table` uses.
pub(crate) fn next_free_uid(table: &BTreeMap<String, u32>, range: UidRange) -> Option<u32> {
    let used: HashSet<u32> = table.values().copied().collect();
    (0..range.count)
        .filter_map(|i| range.first.checked_add(i))
        .find(|uid| !used.contains(uid))
}

/// Parses `uids.json`. Entries outside `range` (the range was changed) are dropped, so those users get a fresh
/// uid and their directories are re-owned; two users on one uid is a corrupt table and an error.
pub(crate) fn parse_table(text: &str, range: UidRange) -> Result<BTreeMap<String, u32>, String> {
    let mut table: BTreeMap<String, u32> = serde_json::from_str(text).map_err(|e| e.to_string())?;
    table.retain(|key, uid| {
        let keep = range.contains(*uid);
        if !keep {
            tracing::warn!(user_key = %key, uid = *uid, "uid outside the configured range; reallocating");
        }
        keep
    });
    let mut seen = HashSet::new();
    if let Some((key, uid)) = table.iter().find(|(_, uid)| !seen.insert(**uid)) {
        return Err(format!("uid {uid} is assigned twice (again to {key})"));
    }
    Ok(table)
}

/// Per-user identities, directories, disks and admission.
#[derive(Debug)]
pub(crate) struct Users {
    shared: Arc<Shared>,
}

/// What [`Users`] and the holds of its identities share.
#[derive(Debug)]
struct Shared {
    state_dir: PathBuf,
    range: Option<UidRange>,
    sharing: WorkspaceSharing,
    /// Cache of `uids.json`; the lock also serialises allocation. Taken after `live`'s, never before.
    table: Mutex<BTreeMap<String, u32>>,
    /// The identities and users held in this process.
    live: Mutex<Live>,
    /// The users' disks (none without isolation: their directories are then on the state volume, uncapped).
    disks: Option<Disks>,
    admission: Admission,
}

/// How many users the worker's budget admits at once (see [`Sandbox::new`](super::Sandbox::new)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Admission {
    /// The budget, in bytes.
    pub(crate) budget: u64,
    /// What one user costs: its memory ceiling, plus its disk cap when disks are capped.
    pub(crate) per_user: u64,
    /// `budget / per_user`, at most [`MAX_ADMITTED_USERS`].
    pub(crate) max_users: usize,
}

/// The most users a worker admits at once, whatever its budget (each has a tmpfs mounted at start).
pub(crate) const MAX_ADMITTED_USERS: usize = 1024;

impl Admission {
    /// The admission of `budget` for users costing `per_user` each; an error when not even one fits.
    pub(crate) fn new(budget: u64, per_user: u64) -> Result<Admission, SandboxError> {
        let max_users = usize::try_from(budget / per_user.max(1))
            .unwrap_or(usize::MAX)
            .min(MAX_ADMITTED_USERS);
        if max_users == 0 {
            return Err(SandboxError::Config {
                reason: format!(
                    "user_budget_bytes ({budget}) is smaller than one user's memory ceiling and disk cap                      ({per_user}): no user could be admitted"
                ),
            });
        }
        Ok(Admission {
            budget,
            per_user,
            max_users,
        })
    }

    /// No budget: every user is admitted (and no user has a disk of its own).
    pub(crate) fn unbounded(per_user: u64) -> Admission {
        Admission {
            budget: u64::MAX,
            per_user,
            max_users: usize::MAX,
        }
    }
}

/// What this process holds.
#[derive(Debug, Default)]
struct Live {
    /// Holds per identity (`<user_key>/<tool_key>`).
    identities: HashMap<String, usize>,
    /// Per user key.
    users: HashMap<String, LiveUser>,
    /// Slots of [`Disks`] no user has.
    free_slots: Vec<usize>,
}

#[derive(Debug)]
struct LiveUser {
    /// Its identities held.
    identities: usize,
    /// Its disk.
    slot: Option<usize>,
    /// Counted by the admission (every user but the worker's internal ones, `fleet:…`).
    admitted: bool,
}

/// Keeps an identity (a (user, tool) uid and its directories) and its user's admission and disk: while any
/// [`UserSpace`] holding it lives. When the last hold of an identity goes, its TMPDIR and workspace are wiped
/// and its uid is free again; when the last identity of a user goes, the user's directories (its disk) are
/// wiped and it leaves the admission. Holds compare equal: a hold is not part of what an identity is.
#[derive(Clone, Default)]
pub struct Hold(Option<Arc<Held>>);

impl PartialEq for Hold {
    fn eq(&self, _: &Hold) -> bool {
        true
    }
}

impl Eq for Hold {}

impl std::fmt::Debug for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "Hold" } else { "Hold(none)" })
    }
}

struct Held {
    shared: Arc<Shared>,
    identity: String,
    user_key: String,
    /// The identity's own directories (its TMPDIR; its workspace unless shared by the user's tools).
    dirs: Vec<PathBuf>,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.shared.release(self);
    }
}

impl Users {
    /// Validates `run_as` (per-user needs root and a sane range) and prepares `state_dir`; with `disk` (the cap
    /// in bytes), mounts a disk per user `admission` admits (`disk.rs`) under `worker_id`'s directory.
    pub(crate) fn new(
        state_dir: &Path,
        run_as: &RunAs,
        sharing: WorkspaceSharing,
        admission: Admission,
        disk: Option<(u64, &str)>,
    ) -> Result<Users, SandboxError> {
        let range = match run_as {
            RunAs::Inherit => None,
            RunAs::PerUser { first, count } => {
                let euid = rustix::process::geteuid();
                if !euid.is_root() {
                    return Err(SandboxError::Config {
                        reason: format!(
                            "run_as per_user needs the worker to run as root to switch plugins to per-user uids, \
                             but it runs as uid {}; run it as root, or set run_as to inherit (development only)",
                            euid.as_raw()
                        ),
                    });
                }
                Some(UidRange::new(*first, *count).map_err(|reason| SandboxError::Config { reason })?)
            }
        };
        let dir_err = |path: &Path, action, source| SandboxError::UserDir {
            path: path.to_path_buf(),
            action,
            source,
        };
        fs::create_dir_all(state_dir).map_err(|e| dir_err(state_dir, "mkdir", e))?;
        if range.is_some() {
            // Per-user uids must traverse state_dir and every ancestor to reach their directories.
            let meta = fs::metadata(state_dir).map_err(|e| dir_err(state_dir, "stat", e))?;
            let mode = meta.permissions().mode();
            if mode & 0o001 == 0 {
                fs::set_permissions(state_dir, fs::Permissions::from_mode((mode | 0o001) & 0o7777))
                    .map_err(|e| dir_err(state_dir, "chmod", e))?;
            }
            let blocked = super::reach::blockers(state_dir, super::reach::Access::Search)
                .map_err(|e| dir_err(state_dir, "stat", e))?;
            if !blocked.is_empty() {
                return Err(SandboxError::Config {
                    reason: format!(
                        "the plugins' per-user uids cannot reach their directories under the state (data) \
                         directory {}: {}; or choose a data directory other users can traverse",
                        state_dir.display(),
                        super::reach::describe(&blocked)
                    ),
                });
            }
        }
        let disks = match disk {
            Some((bytes, worker_id)) => Some(Disks::mount(state_dir, worker_id, bytes, admission.max_users)?),
            None => None,
        };
        let live = Live {
            free_slots: disks
                .as_ref()
                .map(|_| (0..admission.max_users).rev().collect())
                .unwrap_or_default(),
            ..Live::default()
        };
        Ok(Users {
            shared: Arc::new(Shared {
                state_dir: state_dir.to_path_buf(),
                range,
                sharing,
                table: Mutex::new(BTreeMap::new()),
                live: Mutex::new(live),
                disks,
                admission,
            }),
        })
    }

    /// How many users are admitted now, and the most the budget admits.
    pub(crate) fn admitted(&self) -> (usize, usize) {
        let live = self.shared.live.lock().unwrap_or_else(PoisonError::into_inner);
        (
            live.users.values().filter(|u| u.admitted).count(),
            self.shared.admission.max_users,
        )
    }

    /// See [`Sandbox::user_space`](super::Sandbox::user_space).
    pub(crate) fn user_space(&self, user: &str, tool_id: &str) -> Result<UserSpace, SandboxError> {
        let shared = &self.shared;
        let user_key = names::user_key(user);
        let tool_key = names::unique_name(tool_id);
        let identity = format!("{user_key}/{tool_key}");
        let mut live = shared.live.lock().unwrap_or_else(PoisonError::into_inner);
        let known = live.users.get(&user_key).map(|u| u.slot);
        // The worker's internal users (a preparation's, a detection probe's: `fleet:`, which no token can name)
        // are not tenants: not admitted, no disk of their own.
        let admitted = !user.starts_with(fleet_proto::api::RESERVED_USER_PREFIX);
        let slot = match known {
            Some(slot) => slot,
            None => shared.admit(&mut live, admitted)?,
        };
        let made = shared.make(&mut live, &user_key, &tool_key, slot);
        let space = match made {
            Ok(space) => space,
            Err(e) => {
                if let (None, Some(n)) = (known, slot) {
                    shared.give_back(&mut live, n);
                }
                return Err(e);
            }
        };
        let holds = live.identities.entry(identity.clone()).or_insert(0);
        *holds += 1;
        let first_hold = *holds == 1;
        let entry = live.users.entry(user_key.clone()).or_insert(LiveUser {
            identities: 0,
            slot,
            admitted,
        });
        if first_hold {
            entry.identities += 1;
        }
        drop(live);
        let mut dirs = vec![space.tmpdir.clone()];
        if shared.sharing == WorkspaceSharing::PerTool {
            dirs.push(space.workspace.clone());
        }
        Ok(UserSpace {
            hold: Hold(Some(Arc::new(Held {
                shared: shared.clone(),
                identity,
                user_key,
                dirs,
            }))),
            ..space
        })
    }
}

impl Shared {
    /// Admits a new user if it fits the budget (`admitted`: counted by it), with its disk's slot.
    fn admit(&self, live: &mut Live, admitted: bool) -> Result<Option<usize>, SandboxError> {
        if !admitted {
            return Ok(None);
        }
        if live.users.values().filter(|u| u.admitted).count() >= self.admission.max_users {
            return Err(self.full(live));
        }
        match &self.disks {
            Some(_) => live.free_slots.pop().map(Some).ok_or_else(|| self.full(live)),
            None => Ok(None),
        }
    }

    fn full(&self, live: &Live) -> SandboxError {
        SandboxError::UserBudget {
            admitted: live.users.values().filter(|u| u.admitted).count(),
            per_user: self.admission.per_user,
            budget: self.admission.budget,
        }
    }

    /// The directory of `user_key`'s files: its disk's slot, else `<state_dir>/users/<user_key>`.
    fn user_dir(&self, user_key: &str, slot: Option<usize>) -> PathBuf {
        match (&self.disks, slot) {
            (Some(disks), Some(n)) => disks.slot(n),
            _ => self.state_dir.join("users").join(user_key),
        }
    }

    /// Empties slot `n` and gives it to the next user; a slot that cannot be emptied is never given again.
    fn give_back(&self, live: &mut Live, n: usize) {
        let Some(disks) = &self.disks else { return };
        match disks.wipe(n) {
            Ok(()) => live.free_slots.push(n),
            Err(e) => {
                tracing::warn!(slot = %disks.slot(n).display(), error = %e, "cannot empty a user's disk; it is not used again")
            }
        }
    }

    /// The identity `<user_key>/<tool_key>`'s uid (allocated if new) and directories, made.
    fn make(
        &self,
        live: &mut Live,
        user_key: &str,
        tool_key: &str,
        slot: Option<usize>,
    ) -> Result<UserSpace, SandboxError> {
        let uid = match self.range {
            Some(range) => Some(self.uid_for(live, &format!("{user_key}/{tool_key}"), range)?),
            None => None,
        };
        let me = (
            rustix::process::geteuid().as_raw(),
            rustix::process::getegid().as_raw(),
        );
        let owner = uid.map_or(me, |uid| (uid, uid));
        let open_dir = |path: &Path| {
            rustix::fs::open(
                path,
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(|e| SandboxError::UserDir {
                path: path.to_path_buf(),
                action: "open",
                source: e.into(),
            })
        };
        let user_path = self.user_dir(user_key, slot);
        let user_dir = if slot.is_some() && self.disks.is_some() {
            open_dir(&user_path)?
        } else {
            let state = open_dir(&self.state_dir)?;
            let users_path = self.state_dir.join("users");
            let users = ensure_dir(&state, &users_path, me, 0o711)?;
            ensure_dir(&users, &user_path, me, 0o711)?
        };
        let (workspace, groups) = match self.sharing {
            WorkspaceSharing::PerTool => {
                let all_path = user_path.join("workspaces");
                let all = ensure_dir(&user_dir, &all_path, me, 0o711)?;
                let workspace = all_path.join(tool_key);
                ensure_dir(&all, &workspace, owner, 0o700)?;
                (workspace, Vec::new())
            }
            WorkspaceSharing::PerUser => {
                let group = match self.range {
                    Some(range) => Some(self.uid_for(live, user_key, range)?),
                    None => None,
                };
                let workspace = user_path.join("workspace");
                match group {
                    Some(gid) => {
                        ensure_dir(&user_dir, &workspace, (me.0, gid), 0o2770)?;
                    }
                    None => {
                        ensure_dir(&user_dir, &workspace, owner, 0o700)?;
                    }
                }
                (workspace, group.into_iter().collect())
            }
        };
        let tmp_path = user_path.join("tmp");
        let tmp = ensure_dir(&user_dir, &tmp_path, me, 0o711)?;
        let tmpdir = tmp_path.join(tool_key);
        ensure_dir(&tmp, &tmpdir, owner, 0o700)?;
        Ok(UserSpace {
            uid,
            gid: uid,
            groups,
            workspace,
            tmpdir,
            user_key: user_key.to_owned(),
            hold: Hold::default(),
        })
    }

    /// The last hold of `held`'s identity went: its directories are wiped and its uid freed (kept, and its
    /// directories with it, when they cannot be wiped: a uid is never given to another identity while files of
    /// the previous one remain where that uid can reach them); the user's too when it was the user's last.
    fn release(&self, held: &Held) {
        let mut live = self.live.lock().unwrap_or_else(PoisonError::into_inner);
        match live.identities.get_mut(&held.identity) {
            Some(holds) if *holds > 1 => {
                *holds -= 1;
                return;
            }
            Some(_) => {
                live.identities.remove(&held.identity);
            }
            None => return,
        }
        let mut forget = Vec::new();
        let wiped = held.dirs.iter().try_for_each(|d| remove_tree(d));
        match wiped {
            Ok(()) => forget.push(held.identity.clone()),
            Err(e) => {
                tracing::warn!(identity = %held.identity, error = %e, "cannot wipe an idle identity's directories; its uid stays taken")
            }
        }
        let last = match live.users.get_mut(&held.user_key) {
            Some(user) => {
                user.identities = user.identities.saturating_sub(1);
                user.identities == 0
            }
            None => false,
        };
        if last && let Some(user) = live.users.remove(&held.user_key) {
            let wiped = match (&self.disks, user.slot) {
                (Some(disks), Some(n)) => disks.wipe(n),
                _ => remove_tree(&self.user_dir(&held.user_key, None)),
            };
            match wiped {
                Ok(()) => {
                    if let Some(n) = user.slot {
                        live.free_slots.push(n);
                    }
                    forget.push(held.user_key.clone());
                }
                Err(e) => {
                    tracing::warn!(user_key = %held.user_key, error = %e, "cannot wipe an idle user's directories; its uids stay taken")
                }
            }
        }
        if let Some(range) = self.range
            && !forget.is_empty()
            && let Err(e) = self.forget(&forget, range)
        {
            tracing::warn!(error = %e, "cannot free the uids of idle identities");
        }
    }

    /// Removes from the uid table each of `keys`: an identity's key, or a user key (its group and every one of
    /// its identities).
    fn forget(&self, keys: &[String], range: UidRange) -> Result<(), SandboxError> {
        self.edit_table(range, |table| {
            table.retain(|k, _| {
                !keys
                    .iter()
                    .any(|key| k == key || (!key.contains('/') && k.split('/').next() == Some(key.as_str())))
            });
            Ok(true)
        })
    }

    /// The id of `key` (`<user_key>/<tool_key>` for a tool's uid, `<user_key>` for a user's group), allocating
    /// (and persisting) the lowest free one on first sight. When the range is full, the entries of users this
    /// process does not hold (a predecessor's, or whose reclaim failed) are wiped and forgotten first.
    fn uid_for(&self, live: &Live, key: &str, range: UidRange) -> Result<u32, SandboxError> {
        if let Some(&uid) = self.table.lock().unwrap_or_else(PoisonError::into_inner).get(key) {
            return Ok(uid);
        }
        let mut found = None;
        self.edit_table(range, |table| {
            if let Some(&uid) = table.get(key) {
                found = Some(uid);
                return Ok(false);
            }
            if next_free_uid(table, range).is_none() {
                let idle: HashSet<String> = table
                    .keys()
                    .filter_map(|k| k.split('/').next())
                    .filter(|u| !live.users.contains_key(*u))
                    .map(str::to_owned)
                    .collect();
                for user_key in idle {
                    match remove_tree(&self.user_dir(&user_key, None)) {
                        Ok(()) => table.retain(|k, _| k.split('/').next() != Some(user_key.as_str())),
                        Err(e) => tracing::warn!(user_key = %user_key, error = %e, "cannot wipe an idle user's directories"),
                    }
                }
            }
            let uid = next_free_uid(table, range).ok_or(SandboxError::UidRangeExhausted {
                first: range.first,
                count: range.count,
            })?;
            table.insert(key.to_owned(), uid);
            found = Some(uid);
            Ok(true)
        })?;
        found.ok_or(SandboxError::UidRangeExhausted {
            first: range.first,
            count: range.count,
        })
    }

    /// Reads `uids.json` under its file lock, lets `edit` change it (`Ok(true)`: changed, written back), and
    /// keeps the result as the cache.
    fn edit_table(
        &self,
        range: UidRange,
        edit: impl FnOnce(&mut BTreeMap<String, u32>) -> Result<bool, SandboxError>,
    ) -> Result<(), SandboxError> {
        let mut cache = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        let table_path = self.state_dir.join("uids.json");
        let lock_path = self.state_dir.join("uids.json.lock");
        let table_err = |path: &Path, source| SandboxError::UidTable {
            path: path.to_path_buf(),
            source,
        };
        let lock = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&lock_path)
            .map_err(|e| table_err(&lock_path, e))?;
        // Held until `lock` is dropped at the end of this function.
        rustix::fs::flock(&lock, FlockOperation::LockExclusive)
            .map_err(|e| table_err(&lock_path, e.into()))?;
        let mut table = match fs::read_to_string(&table_path) {
            Ok(text) => parse_table(&text, range)
                .map_err(|e| table_err(&table_path, io::Error::new(io::ErrorKind::InvalidData, e)))?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => return Err(table_err(&table_path, e)),
        };
        let changed = edit(&mut table)?;
        if changed {
            save_table(&self.state_dir, &table_path, &table)?;
        }
        *cache = table;
        Ok(())
    }
}

/// The worker's own memory limit: its memory cgroup's (`memory.max` on v2, `memory.limit_in_bytes` on v1, read
/// where `/proc/self/cgroup` places it under `/sys/fs/cgroup`) when it has one below the machine's memory (a pod's
/// or a container's limit); `None` without one (a development machine: no budget).
pub(crate) fn worker_memory_limit() -> Option<u64> {
    let total = fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| super::control::parse_keyed(&t.replace(':', ""), "MemTotal"))
        .map_or(u64::MAX, |kib| kib.saturating_mul(1024));
    let cgroup = fs::read_to_string("/proc/self/cgroup").ok().and_then(|text| {
        text.lines().find_map(|line| {
            let mut parts = line.splitn(3, ':');
            let (id, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            let (dir, file) = if id == "0" && controllers.is_empty() {
                (PathBuf::from("/sys/fs/cgroup"), "memory.max")
            } else if controllers.split(',').any(|c| c == "memory") {
                (PathBuf::from("/sys/fs/cgroup/memory"), "memory.limit_in_bytes")
            } else {
                return None;
            };
            let path = dir.join(path.trim_start_matches('/')).join(file);
            fs::read_to_string(path).ok()?.trim().parse::<u64>().ok()
        })
    });
    cgroup.filter(|limit| *limit < total)
}

/// Removes `dir` and everything beneath it (symbolic links removed, never followed); a missing `dir` is fine.
fn remove_tree(dir: &Path) -> io::Result<()> {
    match fs::remove_dir_all(dir) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Writes `table` to a temp file, syncs it, and renames it over `path` (then syncs the directory).
fn save_table(state_dir: &Path, path: &Path, table: &BTreeMap<String, u32>) -> Result<(), SandboxError> {
    let tmp = state_dir.join("uids.json.tmp");
    let err = |path: &Path, source| SandboxError::UidTable {
        path: path.to_path_buf(),
        source,
    };
    let json = serde_json::to_vec_pretty(table).map_err(|e| err(path, io::Error::other(e)))?;
    let mut file = fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| err(&tmp, e))?;
    file.write_all(&json)
        .and_then(|()| file.sync_all())
        .map_err(|e| err(&tmp, e))?;
    fs::rename(&tmp, path).map_err(|e| err(path, e))?;
    if let Err(e) = fs::File::open(state_dir).and_then(|d| d.sync_all()) {
        tracing::debug!(dir = %state_dir.display(), error = %e, "cannot sync the state directory");
    }
    Ok(())
}

/// Creates (if missing) the directory `path` — whose last component is created relative to `parent` — and makes
/// it owned by `owner` with `mode`, without following symlinks. Returns it opened.
fn ensure_dir(parent: &OwnedFd, path: &Path, owner: (u32, u32), mode: u32) -> Result<OwnedFd, SandboxError> {
    let err = |action: &'static str, e: Errno| SandboxError::UserDir {
        path: path.to_path_buf(),
        action,
        source: e.into(),
    };
    let name = path.file_name().ok_or_else(|| err("name", Errno::INVAL))?;
    match rustix::fs::mkdirat(parent, name, Mode::from_raw_mode(mode)) {
        Ok(()) | Err(Errno::EXIST) => {}
        Err(e) => return Err(err("mkdir", e)),
    }
    let dir = rustix::fs::openat(
        parent,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| err("open", e))?;
    let stat = rustix::fs::fstat(&dir).map_err(|e| err("stat", e))?;
    if (stat.st_uid, stat.st_gid) != owner {
        rustix::fs::fchown(&dir, Some(Uid::from_raw(owner.0)), Some(Gid::from_raw(owner.1)))
            .map_err(|e| err("chown", e))?;
    }
    if stat.st_mode & 0o7777 != mode {
        rustix::fs::fchmod(&dir, Mode::from_raw_mode(mode)).map_err(|e| err("chmod", e))?;
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(first: u32, count: u32) -> UidRange {
        UidRange::new(first, count).unwrap()
    }

    #[test]
    fn range_validation() {
        assert!(UidRange::new(0, 10).is_err());
        assert!(UidRange::new(1000, 0).is_err());
        assert!(UidRange::new(u32::MAX - 5, 10).is_err());
        assert!(UidRange::new(u32::MAX - 10, 10).is_ok());
        let r = range(100, 3);
        assert!(!r.contains(99) && r.contains(100) && r.contains(102) && !r.contains(103));
    }

    #[test]
    fn allocation_is_sequential_fills_gaps_and_exhausts() {
        let r = range(100, 3);
        let mut t = BTreeMap::new();
        assert_eq!(next_free_uid(&t, r), Some(100));
        t.insert("a".to_owned(), 100);
        t.insert("c".to_owned(), 102);
        assert_eq!(next_free_uid(&t, r), Some(101));
        t.insert("b".to_owned(), 101);
        assert_eq!(next_free_uid(&t, r), None);
    }

    #[test]
    fn table_parsing() {
        let r = range(100, 10);
        let t = parse_table(r#"{"a": 100, "b": 105, "old": 7}"#, r).unwrap();
        assert_eq!(t.len(), 2, "out-of-range entry dropped");
        assert!(
            parse_table(r#"{"a": 100, "b": 100}"#, r)
                .unwrap_err()
                .contains("twice")
        );
        assert!(parse_table("not json", r).is_err());
        assert!(parse_table(r#"{"a": -1}"#, r).is_err());
        assert!(parse_table("{}", r).unwrap().is_empty());
    }
}
