//! What confining a plugin means, prepared in the worker before any fork (the spawn hook only replays it):
//! the namespaces, the private `/proc` and `/tmp`, the paths kept visible in that `/tmp`, what the plugin sees
//! of the cgroup hierarchies, the seccomp profile.
//!
//! # The view a confined plugin has
//!
//! - **Network**: a new network namespace with only its own loopback, up. No route anywhere: NATS, the node's
//!   and the pod's addresses, `169.254.169.254` and the internet are unreachable (`ENETUNREACH`), and a port on
//!   `127.0.0.1` is the plugin's own loopback, not the worker's. A plugin the operator grants egress
//!   (`egress.tools`) joins a namespace the worker made for it instead ([`NetNs`]), where the egress proxy
//!   listens on that loopback (`crate::egress`): still no route, only the proxy's checked connections.
//! - **Processes**: a new procfs mounted with `hidepid=2` ("invisible") in the session's own mount namespace:
//!   every process of another uid is absent from `/proc`. Plugins run under a uid per (user, tool_id), and one
//!   session per (user, tool_id) runs on a worker, so what a plugin sees is its own tree. This is the
//!   "equivalent" of a PID namespace the issue allows, chosen because a PID namespace makes the plugin pid 1
//!   (it must reap orphans, and ignores `SIGTERM` it has no handler for) or needs an init process per session;
//!   the cgroup already gives the tree kill a PID namespace would add.
//! - **Files**: the mount namespace is private (nothing propagates back to the node), and every host mount in it
//!   is read-only (`mount_setattr(2)`, recursively from `/`): a plugin writes only to its own TMPDIR and
//!   workspace (bound back writable), a new tmpfs on `/tmp` and another on `/dev/shm` (`confinement.tmp_bytes`
//!   each, charged to the session's memory cgroup) and its private `/proc`. So no world-writable directory of
//!   the host (`/var/tmp`, the host's `/dev/shm`, `/run/lock`, one an operator left open) is shared between
//!   plugins of different uids, none can fill a host disk or leave a file behind outside its own directories.
//!   Paths the session needs that happen to live under `/tmp` (its install, the directories of its command's
//!   absolute paths, its TMPDIR and workspace — common in tests and development, never in a production layout)
//!   are mounted back at the same paths, read-only unless they hold the TMPDIR or workspace. Permissions apply on
//!   top: the worker's state, keys and credentials are root-owned and unreadable to plugin uids (tested).
//! - **Devices**: a minimal `/dev` of its own (a new tmpfs, mode 0755, `nosuid,nodev,noexec`, read-only but
//!   `/dev/shm`): the host's `null`, `zero`, `full`, `random`, `urandom` and `tty` bound in (a bind mount of
//!   the host's node: making nodes needs `mknod`, which a runtime may refuse), a new `devpts` instance on
//!   `/dev/pts` (`ptmxmode=0666`, `/dev/ptmx` a link to its `ptmx`: the plugin's terminals are its own, the
//!   host's and other plugins' are not in it — binding the host's `/dev/pts` would list them all), the private
//!   `/dev/shm` and the links `fd`, `stdin`, `stdout`, `stderr`. No other device of the host (`/dev/kmsg`,
//!   `/dev/kvm`, disks, consoles) exists for it, whatever its mode or the worker's privileges.
//! - **Cgroups**: a cgroup namespace rooted at the session's own cgroup (its `/proc/self/cgroup` reads `/`),
//!   and under `/sys/fs/cgroup` new read-only mounts, made in that namespace, of the hierarchies the worker uses
//!   ([`CgroupView`]: the unified one, or each v1 hierarchy under the host's name, over an empty tmpfs). Each
//!   shows the session's cgroup as its root: the plugin reads its own limits and usage — what runtimes size
//!   their heaps and thread pools from (Node, Go, the JVM), as they did before — and nothing of the worker's
//!   subtree, its users' keys or other sessions' names, limits and usage. An empty mount would hide as much but
//!   leave those runtimes without their limits; a cgroup namespace alone hides nothing (the host's mounts,
//!   already in the view, still show the whole tree). Made at the claim of a stub or in the direct spawn's
//!   hook, after the session's cgroup is joined (`cgroup.procs` is beneath `/sys/fs/cgroup`); the worker sees,
//!   moves, limits and kills the plugin at its full path as before.
//! - **Hidden directories** (a preparation's view, `crate::prepare`): each directory of a session's `hidden`
//!   list (the worker's state directory, its data directory, the credentials' and keys' directories) is covered
//!   by an empty, read-only tmpfs, and only the session's own paths beneath it (its install, its TMPDIR) are
//!   mounted back: the rest does not exist for it, whatever its permissions.
//! - **IPC and host name**: new IPC and UTS namespaces (no System V objects or message queues shared).
//! - **System calls**: the [`seccomp`](super::seccomp) profile.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::netns::NetNs;
use super::seccomp::SeccompProfile;

/// At most this many paths are mounted back into a private `/tmp` (install, command directories, TMPDIR,
/// workspace): the child keeps their detached mounts in a fixed array (it may not allocate).
pub(crate) const MAX_KEPT: usize = 8;

/// The mount options of a plugin's `/proc`: processes of other uids are invisible.
const PROC_OPTIONS: &str = "hidepid=2";

/// Everything the spawn hook does to confine one plugin.
#[derive(Debug)]
pub(crate) struct Confinement {
    /// Namespaces and private mounts (none: the plugin shares the worker's).
    pub(crate) namespaces: Option<Namespaces>,
    /// The filters (none: no seccomp).
    pub(crate) seccomp: Option<Arc<SeccompProfile>>,
}

/// What a confined plugin is shown under `/sys/fs/cgroup` (one per worker: `detect::plugin_view`): its own
/// session's cgroup as the root of each hierarchy the worker uses — new mounts of them, made in a cgroup
/// namespace rooted at that cgroup — and nothing else. Sent to the stubs as it is ([`stub_msg::Setup`]).
///
/// [`stub_msg::Setup`]: super::stub_msg::Setup
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct CgroupView {
    /// The unified hierarchy (v2): one `cgroup2` mount on `/sys/fs/cgroup`. Else the v1 `hierarchies`, each a
    /// directory of a tmpfs there.
    pub(crate) unified: bool,
    /// v1: the hierarchies holding the worker's controllers.
    pub(crate) hierarchies: Vec<ViewHierarchy>,
    /// Absolute mount points of the worker's hierarchies outside `/sys/fs/cgroup` (a host mounting them
    /// elsewhere), each covered by an empty read-only tmpfs. Never the worker's private `cgroup2` mount: its
    /// directory is mode 0700 (`detect.rs`).
    pub(crate) covered: Vec<String>,
}

/// One v1 hierarchy of a [`CgroupView`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ViewHierarchy {
    /// Its directory's name under `/sys/fs/cgroup` (the host's: `memory`, `cpu,cpuacct`).
    pub(crate) name: String,
    /// Its mount options: the host mount's super options but `rw`/`ro` (its controllers and flags, so the
    /// kernel finds the same hierarchy and has no option to complain about).
    pub(crate) options: String,
    /// Names linking to it (`cpu` and `cpuacct` → `cpu,cpuacct`, as the host has them).
    pub(crate) links: Vec<String>,
}

/// Where a plugin's view shows the cgroup hierarchies.
pub(crate) const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// A [`CgroupView`] as C strings for the child ([`super::spawn`]'s `mount_own_cgroups`).
#[derive(Debug, Default)]
pub(crate) struct CgroupMounts {
    pub(crate) unified: bool,
    pub(crate) hierarchies: Vec<HierarchyMount>,
    pub(crate) covered: Vec<CString>,
}

/// One v1 hierarchy of [`CgroupMounts`].
#[derive(Debug)]
pub(crate) struct HierarchyMount {
    /// `/sys/fs/cgroup/<name>`.
    pub(crate) dir: CString,
    pub(crate) options: CString,
    /// (target: the hierarchy's name, link: `/sys/fs/cgroup/<controller>`).
    pub(crate) links: Vec<(CString, CString)>,
}

impl CgroupMounts {
    /// The C strings of `view`; a name with `/` (or `.`/`..`) or a NUL byte is refused.
    pub(crate) fn new(view: &CgroupView) -> Result<CgroupMounts, ConfineError> {
        let c = |s: &str| CString::new(s).map_err(|_| ConfineError::Nul);
        let in_root = |name: &str| {
            if name.is_empty() || name == "." || name == ".." || name.contains('/') {
                return Err(ConfineError::CgroupName {
                    name: name.to_owned(),
                });
            }
            c(&format!("{CGROUP_ROOT}/{name}"))
        };
        Ok(CgroupMounts {
            unified: view.unified,
            hierarchies: view
                .hierarchies
                .iter()
                .map(|h| {
                    Ok(HierarchyMount {
                        dir: in_root(&h.name)?,
                        options: c(&h.options)?,
                        links: h
                            .links
                            .iter()
                            .map(|l| Ok((c(&h.name)?, in_root(l)?)))
                            .collect::<Result<_, ConfineError>>()?,
                    })
                })
                .collect::<Result<_, ConfineError>>()?,
            covered: view.covered.iter().map(|p| c(p)).collect::<Result<_, _>>()?,
        })
    }
}

/// The namespace part of a [`Confinement`], as C strings for the child.
#[derive(Debug)]
pub(crate) struct Namespaces {
    pub(crate) proc_options: CString,
    /// `/tmp` as the worker resolves it.
    pub(crate) tmp_root: CString,
    pub(crate) tmp_options: CString,
    pub(crate) kept: Vec<Kept>,
    /// The session's writable directories outside `/tmp` (its TMPDIR and workspace in a production layout):
    /// bound back writable over the read-only host view. Canonical, each once.
    pub(crate) writable: Vec<CString>,
    /// The network namespace to join (an egress-granted session's, or an empty one from the pool); `None`: the
    /// spawn hook unshares a new one.
    pub(crate) join_net: Option<Arc<NetNs>>,
    /// Directories hidden from the session, outermost first (none for a plugin's session).
    pub(crate) masks: Vec<Mask>,
    /// What the session sees under `/sys/fs/cgroup` (the worker's, shared by every session).
    pub(crate) cgroups: Arc<CgroupMounts>,
}

/// A directory hidden from a session: an empty read-only tmpfs covers it, and the session's own paths beneath
/// it are mounted back.
#[derive(Debug)]
pub(crate) struct Mask {
    /// Absolute, canonical.
    pub(crate) root: CString,
    /// The session's paths beneath it, as [`Kept`] paths of that root.
    pub(crate) kept: Vec<Kept>,
}

/// A path under `/tmp` mounted back into the private `/tmp`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Kept {
    /// Absolute, canonical.
    pub(crate) path: CString,
    /// Its ancestors strictly between `/tmp` and it, outermost first (created in the tmpfs).
    pub(crate) parents: Vec<CString>,
    /// A directory (else a file: the mount point is an empty file).
    pub(crate) is_dir: bool,
    /// Mounted writable (it is or holds a writable directory of the session), else read-only.
    pub(crate) writable: bool,
}

/// Why a plugin cannot be confined as configured.
#[derive(Debug, thiserror::Error)]
pub enum ConfineError {
    /// More paths under `/tmp` than a private `/tmp` can keep.
    #[error(
        "{count} paths of this session live under {tmp}; at most {MAX_KEPT} can be kept in its private /tmp"
    )]
    TooManyKept {
        /// The tmp root.
        tmp: String,
        /// How many.
        count: usize,
    },
    /// A path has a NUL byte (never a Linux path).
    #[error("a path of this session contains a NUL byte")]
    Nul,
    /// A hierarchy's name under `/sys/fs/cgroup` is not a plain name.
    #[error("the cgroup hierarchy name {name:?} is not a plain directory name")]
    CgroupName {
        /// The name.
        name: String,
    },
    /// A directory to hide is one the session needs, or an ancestor of the filesystem's root.
    #[error("{path} is to be hidden from this session, but the session needs it")]
    HidesNeeded {
        /// The directory.
        path: String,
    },
}

/// The namespace plan for a session whose paths are `paths` (install dir, command paths; missing ones are
/// skipped) and whose writable directories are `writable` (TMPDIR, workspace: kept too), with a private `/tmp`
/// and `/dev/shm` of `tmp_bytes` each, showing `cgroups` under `/sys/fs/cgroup`.
pub(crate) fn namespaces(
    paths: &[PathBuf],
    writable: &[PathBuf],
    tmp_bytes: u64,
    cgroups: &Arc<CgroupMounts>,
) -> Result<Namespaces, ConfineError> {
    namespaces_hiding(paths, writable, tmp_bytes, &[], cgroups)
}

/// [`namespaces`], with the directories `hidden` (missing ones skipped) covered ([`Mask`]).
pub(crate) fn namespaces_hiding(
    paths: &[PathBuf],
    writable: &[PathBuf],
    tmp_bytes: u64,
    hidden: &[PathBuf],
    cgroups: &Arc<CgroupMounts>,
) -> Result<Namespaces, ConfineError> {
    let tmp_root = std::fs::canonicalize("/tmp").unwrap_or_else(|_| PathBuf::from("/tmp"));
    let existing = |p: &PathBuf| {
        let canonical = std::fs::canonicalize(p).ok()?;
        let is_dir = std::fs::metadata(&canonical).ok()?.is_dir();
        Some((canonical, is_dir))
    };
    // Each path canonicalised once (a spawn's path: these are system calls).
    let writable_dirs: Vec<(PathBuf, bool)> = writable.iter().filter_map(existing).collect();
    let writable: Vec<PathBuf> = writable_dirs.iter().map(|(p, _)| p.clone()).collect();
    let candidates: Vec<(PathBuf, bool)> = paths.iter().filter_map(existing).chain(writable_dirs).collect();
    let kept = kept_paths(&tmp_root, &candidates, &writable)?;
    let masks = masks(hidden, &candidates, &writable)?;
    let c = |s: &[u8]| CString::new(s).map_err(|_| ConfineError::Nul);
    let mut outside: Vec<&PathBuf> = writable.iter().filter(|p| !p.starts_with(&tmp_root)).collect();
    outside.sort();
    outside.dedup();
    Ok(Namespaces {
        proc_options: c(PROC_OPTIONS.as_bytes())?,
        tmp_root: c(tmp_root.as_os_str().as_bytes())?,
        tmp_options: c(format!("size={tmp_bytes},mode=1777").as_bytes())?,
        kept,
        writable: outside
            .into_iter()
            .map(|p| c(p.as_os_str().as_bytes()))
            .collect::<Result<_, _>>()?,
        join_net: None,
        masks,
        cgroups: cgroups.clone(),
    })
}

/// The masks of the directories `hidden` (canonical, existing, outermost only), each keeping the
/// `candidates` beneath it. Hiding `/` or one of the candidates' own paths is an error (a hidden directory
/// strictly beneath a candidate is covered inside what the session keeps).
fn masks(
    hidden: &[PathBuf],
    candidates: &[(PathBuf, bool)],
    writable: &[PathBuf],
) -> Result<Vec<Mask>, ConfineError> {
    let mut roots: Vec<PathBuf> = hidden
        .iter()
        .filter_map(|p| std::fs::canonicalize(p).ok())
        .collect();
    roots.sort();
    roots.dedup();
    let mut outermost: Vec<PathBuf> = Vec::new();
    for root in roots {
        if !outermost.iter().any(|o| root.starts_with(o)) {
            outermost.push(root);
        }
    }
    let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).map_err(|_| ConfineError::Nul);
    outermost
        .into_iter()
        .map(|root| {
            let needed = root.parent().is_none() || candidates.iter().any(|(p, _)| *p == root);
            if needed {
                return Err(ConfineError::HidesNeeded {
                    path: root.display().to_string(),
                });
            }
            Ok(Mask {
                root: c(&root)?,
                kept: kept_paths(&root, candidates, writable)?,
            })
        })
        .collect()
}

/// The paths of `candidates` (canonical, with "is a directory") strictly beneath `tmp_root`, without those
/// beneath another kept one, each with the ancestors to create; writable when one of `writable` (canonical) is
/// it or lies beneath it.
pub(crate) fn kept_paths(
    tmp_root: &Path,
    candidates: &[(PathBuf, bool)],
    writable: &[PathBuf],
) -> Result<Vec<Kept>, ConfineError> {
    let mut under: Vec<&(PathBuf, bool)> = candidates
        .iter()
        .filter(|(p, _)| p.starts_with(tmp_root) && p.as_path() != tmp_root)
        .collect();
    under.sort_by(|a, b| a.0.cmp(&b.0));
    under.dedup_by(|a, b| a.0 == b.0);
    let mut outermost: Vec<&(PathBuf, bool)> = Vec::new();
    for candidate in under {
        if !outermost.iter().any(|(kept, _)| candidate.0.starts_with(kept)) {
            outermost.push(candidate);
        }
    }
    if outermost.len() > MAX_KEPT {
        return Err(ConfineError::TooManyKept {
            tmp: tmp_root.display().to_string(),
            count: outermost.len(),
        });
    }
    let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).map_err(|_| ConfineError::Nul);
    outermost
        .into_iter()
        .map(|(path, is_dir)| {
            let mut parents: Vec<&Path> = path
                .ancestors()
                .skip(1)
                .take_while(|a| *a != tmp_root && a.starts_with(tmp_root))
                .collect();
            parents.reverse();
            Ok(Kept {
                path: c(path)?,
                parents: parents.into_iter().map(c).collect::<Result<_, _>>()?,
                is_dir: *is_dir,
                writable: writable.iter().any(|w| w.starts_with(path)),
            })
        })
        .collect()
}

/// The paths of a plugin's command worth keeping: its install directory, and for every argument that names an
/// existing path — absolute, or relative to the install directory (which is the plugin's working directory:
/// `../shared/plugin.py`, or a bare `plugin.py`) — the directory holding it (an interpreter's script and its
/// siblings, a binary's directory), both where the path names it and, when it is a symlink, where it leads. The
/// demo catalogue needs both under a private `/tmp`: `notes-py` runs `../echo-py/echo_plugin.py`, which is a
/// symlink to `tests/plugins/python/`. Files reached only through other symlinks are not kept. Every path is
/// canonical, each once.
pub fn command_paths(install_dir: &Path, argv: &[String]) -> Vec<PathBuf> {
    let mut out = vec![install_dir.to_path_buf()];
    for arg in argv {
        let path = Path::new(arg);
        let path = if path.is_absolute() {
            path.to_path_buf()
        } else {
            install_dir.join(path)
        };
        let Ok(canonical) = std::fs::canonicalize(&path) else {
            continue;
        };
        let mut keep = |p: PathBuf| {
            if !out.contains(&p) {
                out.push(p);
            }
        };
        match std::fs::metadata(&canonical) {
            Ok(m) if m.is_dir() => keep(canonical),
            Ok(_) => {
                // Where the command names it (the directory the kernel walks through)…
                if let Some(named) = path.parent().and_then(|p| std::fs::canonicalize(p).ok()) {
                    keep(named);
                }
                // …and where it leads.
                if let Some(target) = canonical.parent() {
                    keep(target.to_path_buf());
                }
            }
            Err(_) => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(c: &CString) -> &str {
        c.to_str().unwrap()
    }

    #[test]
    fn only_paths_beneath_tmp_are_kept_outermost_first_with_their_parents() {
        let tmp = Path::new("/tmp");
        let kept = kept_paths(
            tmp,
            &[
                (PathBuf::from("/var/lib/plugins/echo"), true),
                (PathBuf::from("/tmp"), true),
                (PathBuf::from("/tmp/t1/data/state/users/k/tmp/echo"), true),
                (PathBuf::from("/tmp/t1/data/state"), true),
                (PathBuf::from("/tmp/t1/plugins/echo"), true),
                (PathBuf::from("/tmp/t1/plugins/echo"), true),
                (PathBuf::from("/tmp/tmpfile"), false),
                (PathBuf::from("/tmpx/other"), true),
            ],
            &[PathBuf::from("/tmp/t1/data/state/users/k/tmp/echo")],
        )
        .unwrap();
        let paths: Vec<&str> = kept.iter().map(|k| s(&k.path)).collect();
        assert_eq!(
            paths,
            ["/tmp/t1/data/state", "/tmp/t1/plugins/echo", "/tmp/tmpfile"]
        );
        let parents: Vec<&str> = kept[0].parents.iter().map(s).collect();
        assert_eq!(parents, ["/tmp/t1", "/tmp/t1/data"]);
        assert!(kept[2].parents.is_empty());
        assert!(!kept[2].is_dir);
        // Only the one holding a writable directory is mounted writable.
        let writable: Vec<bool> = kept.iter().map(|k| k.writable).collect();
        assert_eq!(writable, [true, false, false]);
    }

    #[test]
    fn more_kept_paths_than_the_child_can_hold_is_an_error() {
        let many: Vec<(PathBuf, bool)> = (0..=MAX_KEPT)
            .map(|i| (PathBuf::from(format!("/tmp/d{i}")), true))
            .collect();
        assert!(matches!(
            kept_paths(Path::new("/tmp"), &many, &[]),
            Err(ConfineError::TooManyKept { count, .. }) if count == MAX_KEPT + 1
        ));
        assert!(kept_paths(Path::new("/tmp"), &many[..MAX_KEPT], &[]).is_ok());
    }

    #[test]
    fn command_paths_are_the_install_and_the_resolved_directories_of_existing_arguments() {
        let dir = tempfile::tempdir().unwrap();
        let root = std::fs::canonicalize(dir.path()).unwrap();
        let script = root.join("run.py");
        std::fs::write(&script, "").unwrap();
        let argv = [
            "python3".to_owned(),
            script.display().to_string(),
            "/no/such/file".to_owned(),
            "--flag".to_owned(),
        ];
        let paths = command_paths(Path::new("/opt/plugin"), &argv);
        assert_eq!(paths, [PathBuf::from("/opt/plugin"), root.clone()]);
        // Relative to the install directory (the working directory): `../shared/run.py`, resolved.
        let install = root.join("tool");
        let shared = root.join("shared");
        std::fs::create_dir_all(&install).unwrap();
        std::fs::create_dir_all(&shared).unwrap();
        std::fs::write(shared.join("run.py"), "").unwrap();
        let argv = [
            "python3".to_owned(),
            "../shared/run.py".to_owned(),
            "../missing/x.py".to_owned(),
        ];
        let paths = command_paths(&install, &argv);
        assert_eq!(paths, [install.clone(), shared.clone()]);
        // A bare name in the install that is a symlink out of it: its target's directory.
        std::os::unix::fs::symlink("../shared/run.py", install.join("run.py")).unwrap();
        let argv = ["python3".to_owned(), "run.py".to_owned(), "--services".to_owned()];
        let paths = command_paths(&install, &argv);
        assert_eq!(paths, [install.clone(), shared.clone()]);
        // A relative path through a sibling install to such a symlink (`notes-py` → `../echo-py/echo_plugin.py`):
        // the sibling, where the kernel walks, and the symlink's target.
        let sibling = root.join("sibling");
        std::fs::create_dir_all(&sibling).unwrap();
        let argv = ["python3".to_owned(), "../tool/run.py".to_owned()];
        let paths = command_paths(&sibling, &argv);
        assert_eq!(paths, [sibling.clone(), install.clone(), shared.clone()]);
        // A bare name that is a plain file of the install: the install itself (once).
        std::fs::write(install.join("main.py"), "").unwrap();
        let argv = ["python3".to_owned(), "main.py".to_owned()];
        assert_eq!(command_paths(&install, &argv), [install]);
    }
}
