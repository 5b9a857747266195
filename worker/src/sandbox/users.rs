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

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::io::{self, Write};
use std::os::fd::OwnedFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use rustix::fs::{FlockOperation, Gid, Mode, OFlags, Uid};
use rustix::io::Errno;

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

/// Per-user identities and directories.
#[derive(Debug)]
pub(crate) struct Users {
    state_dir: PathBuf,
    range: Option<UidRange>,
    sharing: WorkspaceSharing,
    /// Cache of `uids.json` (entries never change once assigned); the lock also serialises allocation.
    table: Mutex<BTreeMap<String, u32>>,
}

impl Users {
    /// Validates `run_as` (per-user needs root and a sane range) and prepares `state_dir`.
    pub(crate) fn new(
        state_dir: &Path,
        run_as: &RunAs,
        sharing: WorkspaceSharing,
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
        Ok(Users {
            state_dir: state_dir.to_path_buf(),
            range,
            sharing,
            table: Mutex::new(BTreeMap::new()),
        })
    }

    /// See [`Sandbox::user_space`](super::Sandbox::user_space).
    pub(crate) fn user_space(&self, user: &str, tool_id: &str) -> Result<UserSpace, SandboxError> {
        let user_key = names::user_key(user);
        let tool_key = names::unique_name(tool_id);
        let uid = match self.range {
            Some(range) => Some(self.uid_for(&format!("{user_key}/{tool_key}"), range)?),
            None => None,
        };
        let me = (
            rustix::process::geteuid().as_raw(),
            rustix::process::getegid().as_raw(),
        );
        let owner = uid.map_or(me, |uid| (uid, uid));

        let state = rustix::fs::open(
            &self.state_dir,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| SandboxError::UserDir {
            path: self.state_dir.clone(),
            action: "open",
            source: e.into(),
        })?;
        let users_path = self.state_dir.join("users");
        let users = ensure_dir(&state, &users_path, me, 0o711)?;
        let user_path = users_path.join(&user_key);
        let user_dir = ensure_dir(&users, &user_path, me, 0o711)?;
        let (workspace, groups) = match self.sharing {
            WorkspaceSharing::PerTool => {
                let all_path = user_path.join("workspaces");
                let all = ensure_dir(&user_dir, &all_path, me, 0o711)?;
                let workspace = all_path.join(&tool_key);
                ensure_dir(&all, &workspace, owner, 0o700)?;
                (workspace, Vec::new())
            }
            WorkspaceSharing::PerUser => {
                let group = match self.range {
                    Some(range) => Some(self.uid_for(&user_key, range)?),
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
        let tmpdir = tmp_path.join(&tool_key);
        ensure_dir(&tmp, &tmpdir, owner, 0o700)?;
        Ok(UserSpace {
            uid,
            gid: uid,
            groups,
            workspace,
            tmpdir,
            user_key,
        })
    }

    /// The id of `key` (`<user_key>/<tool_key>` for a tool's uid, `<user_key>` for a user's group), allocating
    /// (and persisting) the next free one on first sight.
    fn uid_for(&self, user_key: &str, range: UidRange) -> Result<u32, SandboxError> {
        let mut cache = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(&uid) = cache.get(user_key) {
            return Ok(uid);
        }
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
        let uid = match table.get(user_key) {
            Some(&uid) => uid,
            None => {
                let uid = next_free_uid(&table, range).ok_or(SandboxError::UidRangeExhausted {
                    first: range.first,
                    count: range.count,
                })?;
                table.insert(user_key.to_owned(), uid);
                save_table(&self.state_dir, &table_path, &table)?;
                uid
            }
        };
        *cache = table;
        Ok(uid)
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
