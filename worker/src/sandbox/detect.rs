//! Finding the cgroup hierarchies and the worker's own cgroup in them, and preparing the worker's subtree.
//!
//! Inputs are `/proc/self/mountinfo` (which cgroup filesystems are mounted where, and which part of the hierarchy
//! each mount shows) and `/proc/self/cgroup` (where this process sits in each hierarchy). The parsing is pure and
//! unit-tested; only [`detect`] (through a reader callback), [`ensure_writable_v2`] and [`prepare_subtree`] touch
//! the filesystem.
//!
//! # A read-only unified hierarchy
//!
//! Container runtimes mount `/sys/fs/cgroup` read-only in a container that is not privileged. On a cgroup v2 node
//! such a container normally runs in a cgroup namespace of its own (the default of containerd and CRI-O on v2),
//! whose root is the container's cgroup. There [`ensure_writable_v2`] mounts a fresh `cgroup2` at
//! `<PRIVATE_CGROUP_DIR>/unified` (the directory made mode 0700, so plugins cannot reach it): a cgroup2 mount made
//! inside a cgroup namespace shows that namespace's root, i.e. only the container's own cgroup, writable. That
//! needs `CAP_SYS_ADMIN` and a security profile allowing `mount` (Helm `worker.sandbox.mode: capabilities`). In the
//! host's (initial) cgroup namespace the same mount would show the node's whole hierarchy, so the worker refuses
//! instead ([`CgroupMountError::InitialNamespace`]).

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, PermissionsExt as _};
use std::path::{Component, Path, PathBuf};

use rustix::mount::MountFlags;

use super::confine::{CGROUP_ROOT, CgroupView, ViewHierarchy};
use super::control::{Dirs, V1Dirs, mkdir_ok_if_exists, read_file, write_file};

/// Controllers a v2 session needs enabled.
pub(crate) const V2_CONTROLLERS: [&str; 3] = ["memory", "pids", "cpu"];

/// Name of the v2 leaf cgroup the worker moves itself into when its own cgroup must delegate controllers (the
/// v2 "no internal processes" rule). It starts with `cloud-agents.` — a subtree is `cloud-agents-…` — so the two
/// can never collide.
pub(crate) const V2_SELF_LEAF: &str = "cloud-agents.worker";

/// A mounted cgroup filesystem (one line of `/proc/self/mountinfo`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CgroupMount {
    /// The cgroup path this mount shows at its mount point (`/` unless a sub-tree is bind-mounted).
    pub(crate) root: String,
    /// Where it is mounted.
    pub(crate) mount_point: PathBuf,
    /// `cgroup2` (else v1 `cgroup`).
    pub(crate) v2: bool,
    /// v1 super options (controller names, `name=…`, `rw`, …); empty for v2.
    pub(crate) options: Vec<String>,
    /// Mounted read-only (`ro` in the mount's own options or in the super options).
    pub(crate) read_only: bool,
}

/// One line of `/proc/self/cgroup`: `hierarchy-id:controllers:path`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ProcCgroup {
    /// Comma-separated controllers (empty for the v2 line `0::…`).
    pub(crate) controllers: Vec<String>,
    /// The process's cgroup path in that hierarchy.
    pub(crate) path: String,
}

/// Undoes mountinfo's octal escapes (`\040` = space, `\011`, `\012`, `\134`).
fn unescape_mount_field(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        if b == b'\\'
            && let Some(oct) = bytes.get(i + 1..i + 4)
            && oct.iter().all(|d| (b'0'..=b'7').contains(d))
        {
            let value = oct.iter().fold(0u32, |acc, d| acc * 8 + u32::from(d - b'0'));
            if let Ok(byte) = u8::try_from(value) {
                out.push(byte);
                i += 4;
                continue;
            }
        }
        out.push(b);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The cgroup mounts listed in `mountinfo` text.
pub(crate) fn parse_mountinfo(text: &str) -> Vec<CgroupMount> {
    let mut mounts = Vec::new();
    for line in text.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        let Some(sep) = fields.iter().position(|f| *f == "-") else {
            continue;
        };
        let (Some(root), Some(mount_point), Some(mount_opts)) = (fields.get(3), fields.get(4), fields.get(5))
        else {
            continue;
        };
        let (Some(fstype), Some(super_opts)) = (fields.get(sep + 1), fields.get(sep + 3)) else {
            continue;
        };
        let v2 = match *fstype {
            "cgroup2" => true,
            "cgroup" => false,
            _ => continue,
        };
        let read_only = mount_opts
            .split(',')
            .chain(super_opts.split(','))
            .any(|o| o == "ro");
        let options = if v2 {
            Vec::new()
        } else {
            super_opts.split(',').map(str::to_owned).collect()
        };
        mounts.push(CgroupMount {
            root: unescape_mount_field(root),
            mount_point: PathBuf::from(unescape_mount_field(mount_point)),
            v2,
            options,
            read_only,
        });
    }
    mounts
}

/// The lines of `/proc/self/cgroup` text.
pub(crate) fn parse_proc_cgroup(text: &str) -> Vec<ProcCgroup> {
    text.lines()
        .filter_map(|line| {
            let mut parts = line.splitn(3, ':');
            let _id = parts.next()?;
            let controllers = parts.next()?;
            let path = parts.next()?;
            Some(ProcCgroup {
                controllers: controllers
                    .split(',')
                    .filter(|c| !c.is_empty())
                    .map(str::to_owned)
                    .collect(),
                path: path.to_owned(),
            })
        })
        .collect()
}

/// The directory of cgroup `cg_path` under `mount`, or `None` if the mount does not show that cgroup (e.g. the
/// path is outside the mount's root, or contains `..` as it does for a process outside a cgroup namespace).
pub(crate) fn cgroup_dir(mount: &CgroupMount, cg_path: &str) -> Option<PathBuf> {
    let root = mount.root.trim_end_matches('/');
    let rel = if root.is_empty() {
        cg_path
    } else if cg_path == root {
        ""
    } else {
        cg_path.strip_prefix(root)?.strip_prefix('/')?
    };
    let rel = Path::new(rel.trim_start_matches('/'));
    if !rel.components().all(|c| matches!(c, Component::Normal(_))) {
        return None;
    }
    Some(mount.mount_point.join(rel))
}

/// Finds the worker's own cgroup directories: v2 if a cgroup2 mount offers all of [`V2_CONTROLLERS`] to our
/// cgroup (writable mounts first: the worker's own mount beside a runtime's read-only one), else v1 if every
/// needed controller has a hierarchy, else `Err(reason)`.
///
/// `read_controllers` reads a v2 directory's `cgroup.controllers` (injected so this is testable).
pub(crate) fn detect(
    mountinfo: &str,
    proc_cgroup: &str,
    read_controllers: impl Fn(&Path) -> io::Result<String>,
) -> Result<Dirs, String> {
    let mounts = parse_mountinfo(mountinfo);
    let lines = parse_proc_cgroup(proc_cgroup);
    let mut why_not_v2 = Vec::new();

    let v2_line = lines.iter().find(|l| l.controllers.is_empty());
    let v2_mounts = mounts.iter().filter(|m| m.v2);
    let v2_mounts = v2_mounts
        .clone()
        .filter(|m| !m.read_only)
        .chain(v2_mounts.filter(|m| m.read_only));
    for mount in v2_mounts {
        let Some(line) = v2_line else {
            why_not_v2.push("no `0::` line in /proc/self/cgroup".to_owned());
            break;
        };
        let Some(dir) = cgroup_dir(mount, &line.path) else {
            why_not_v2.push(format!(
                "{} does not show our cgroup {}",
                mount.mount_point.display(),
                line.path
            ));
            continue;
        };
        match read_controllers(&dir.join("cgroup.controllers")) {
            Ok(text) => {
                let have: Vec<&str> = text.split_whitespace().collect();
                let missing: Vec<&str> = V2_CONTROLLERS.into_iter().filter(|c| !have.contains(c)).collect();
                if missing.is_empty() {
                    return Ok(Dirs::V2 { dir });
                }
                why_not_v2.push(format!(
                    "{} lacks controllers {}",
                    dir.display(),
                    missing.join(",")
                ));
            }
            Err(e) => why_not_v2.push(format!("{}/cgroup.controllers: {e}", dir.display())),
        }
    }
    if why_not_v2.is_empty() {
        why_not_v2.push("no cgroup2 mount".to_owned());
    }

    let v1_dir = |controller: &str| -> Result<PathBuf, String> {
        let line = lines
            .iter()
            .find(|l| l.controllers.iter().any(|c| c == controller))
            .ok_or_else(|| format!("{controller}: not in /proc/self/cgroup"))?;
        let mount = mounts
            .iter()
            .find(|m| !m.v2 && m.options.iter().any(|o| o == controller))
            .ok_or_else(|| format!("{controller}: no v1 hierarchy mounted"))?;
        cgroup_dir(mount, &line.path).ok_or_else(|| {
            format!(
                "{controller}: {} does not show our cgroup {}",
                mount.mount_point.display(),
                line.path
            )
        })
    };
    let v1 = (|| {
        Ok::<_, String>(V1Dirs {
            memory: v1_dir("memory")?,
            pids: v1_dir("pids")?,
            cpu: v1_dir("cpu")?,
            cpuacct: v1_dir("cpuacct")?,
            freezer: v1_dir("freezer")?,
        })
    })();
    match v1 {
        Ok(dirs) => Ok(Dirs::V1(dirs)),
        Err(why_not_v1) => Err(format!(
            "not cgroup v2 ({}); not cgroup v1 ({why_not_v1})",
            why_not_v2.join("; ")
        )),
    }
}

/// The controllers of a v1 worker: one hierarchy each, or co-mounted ([`V1Dirs`]).
const V1_CONTROLLERS: [&str; 5] = ["memory", "pids", "cpu", "cpuacct", "freezer"];

/// What a confined plugin is shown of the hierarchies holding the worker's cgroup `own` ([`detect`]'s, from the
/// same `mountinfo`): the unified hierarchy, or each v1 hierarchy of [`V1_CONTROLLERS`] once, named as the host
/// names it under `/sys/fs/cgroup` (else after its controllers), with the host mount's options and links from
/// each controller name that differs (pure). A mount point outside `/sys/fs/cgroup` (and outside
/// [`PRIVATE_CGROUP_DIR`], mode 0700) is to be covered.
pub(crate) fn plugin_view(mountinfo: &str, own: &Dirs) -> CgroupView {
    let mounts = parse_mountinfo(mountinfo);
    let root = Path::new(CGROUP_ROOT);
    // The mount a directory of the worker's lies in: the deepest one of the right kind holding it.
    let holding = |dir: &Path, v2: bool, controller: Option<&str>| {
        mounts
            .iter()
            .filter(|m| m.v2 == v2 && dir.starts_with(&m.mount_point))
            .filter(|m| controller.is_none_or(|c| m.options.iter().any(|o| o == c)))
            .max_by_key(|m| m.mount_point.components().count())
    };
    let elsewhere =
        |m: &CgroupMount| !m.mount_point.starts_with(root) && !m.mount_point.starts_with(PRIVATE_CGROUP_DIR);
    let mut view = CgroupView::default();
    match own {
        Dirs::V2 { dir } => {
            view.unified = true;
            if let Some(m) = holding(dir, true, None).filter(|m| elsewhere(m)) {
                view.covered.push(m.mount_point.display().to_string());
            }
        }
        Dirs::V1(v1) => {
            let dirs = [&v1.memory, &v1.pids, &v1.cpu, &v1.cpuacct, &v1.freezer];
            let mut used: Vec<&CgroupMount> = Vec::new();
            for (controller, dir) in V1_CONTROLLERS.into_iter().zip(dirs) {
                if let Some(m) = holding(dir, false, Some(controller))
                    && !used.iter().any(|u| u.mount_point == m.mount_point)
                {
                    used.push(m);
                }
            }
            for m in &used {
                let controllers: Vec<&str> = m
                    .options
                    .iter()
                    .map(String::as_str)
                    .filter(|o| V1_CONTROLLERS.contains(o))
                    .collect();
                let name = match (m.mount_point.parent(), m.mount_point.file_name()) {
                    (Some(parent), Some(name)) if parent == root => name.to_string_lossy().into_owned(),
                    _ => controllers.join(","),
                };
                view.hierarchies.push(ViewHierarchy {
                    options: m
                        .options
                        .iter()
                        .filter(|o| *o != "rw" && *o != "ro")
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(","),
                    links: controllers
                        .iter()
                        .filter(|c| **c != name)
                        .map(|c| (*c).to_owned())
                        .collect(),
                    name,
                });
                if elsewhere(m) {
                    view.covered.push(m.mount_point.display().to_string());
                }
            }
            // A link never shadows a hierarchy's own directory.
            let names: Vec<String> = view.hierarchies.iter().map(|h| h.name.clone()).collect();
            for h in &mut view.hierarchies {
                h.links.retain(|l| !names.contains(l));
            }
        }
    }
    view
}

/// The private directory (made mode 0700, owned by the worker) holding the worker's own cgroup2 mount, at
/// `<PRIVATE_CGROUP_DIR>/unified`, when the runtime's is read-only. With a read-only root filesystem it must be a
/// writable volume (the Helm chart mounts an emptyDir there).
pub(crate) const PRIVATE_CGROUP_DIR: &str = "/run/cloud-agents/cgroup";

/// The mount point's name inside [`PRIVATE_CGROUP_DIR`].
const PRIVATE_CGROUP_MOUNT: &str = "unified";

/// What `/proc/self/ns/cgroup` reads in the initial (host) cgroup namespace: its inode number is fixed
/// (`PROC_CGROUP_INIT_INO` = 0xEFFFFFFB, include/linux/proc_ns.h).
pub(crate) const INIT_CGROUP_NS: &str = "cgroup:[4026531835]";

/// Why the worker cannot get a writable cgroup hierarchy of its own ([`ensure_writable_v2`]). The worker refuses
/// to start; each message names the fix.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CgroupMountError {
    /// The unified hierarchy is read-only and the worker shares the host's cgroup namespace, where a cgroup2
    /// mount of its own would show (and let it write) the node's whole hierarchy.
    #[error(
        "the unified cgroup hierarchy at {mount_point} is read-only and the worker is not in a cgroup namespace of \
         its own ({namespace}); run it in a private cgroup namespace (the default for containers on cgroup v2 \
         nodes with containerd and CRI-O; Docker: --cgroupns=private) or give it a writable hierarchy (Helm \
         worker.sandbox.mode privileged or delegatedCgroupRW)"
    )]
    InitialNamespace {
        /// The read-only mount (or `-` when none shows the worker's cgroup).
        mount_point: PathBuf,
        /// What `/proc/self/ns/cgroup` reads (or why it could not be read).
        namespace: String,
    },
    /// cgroup v1 (or hybrid) with the worker's memory hierarchy mounted read-only: the worker cannot mount a v1
    /// hierarchy of its own that shows only its cgroup.
    #[error(
        "cgroup v1 hierarchy {mount_point} is read-only; on cgroup v1 nodes the worker needs a writable \
         hierarchy (Helm worker.sandbox.mode privileged), or move the workers to cgroup v2 nodes"
    )]
    V1ReadOnly {
        /// The read-only mount.
        mount_point: PathBuf,
    },
    /// `/proc/self/mountinfo` or `/proc/self/cgroup` could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The private directory could not be created or secured.
    #[error(
        "preparing {path} for the worker's own cgroup2 mount: {action}: {source}; {PRIVATE_CGROUP_DIR} must be a \
         writable directory of the worker (with a read-only root filesystem: mount a volume there, e.g. an \
         emptyDir, as the Helm chart does)"
    )]
    Dir {
        /// The directory.
        path: PathBuf,
        /// The step that failed (`mkdir`, `lstat`, `chmod`, `check`).
        action: &'static str,
        /// The OS error (`InvalidData` when something other than a root-owned directory sits there).
        #[source]
        source: io::Error,
    },
    /// `mount -t cgroup2` failed.
    #[error(
        "mounting cgroup2 at {path}: {source}; the worker needs CAP_SYS_ADMIN and a security profile that allows \
         mount (containerd's and CRI-O's default AppArmor profiles deny it: the Helm chart's capabilities mode \
         runs the worker with appArmorProfile Unconfined and seccomp RuntimeDefault)"
    )]
    Mount {
        /// The mount point.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

/// What [`writable_v2_plan`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum WritableV2 {
    /// Nothing to mount: a writable hierarchy shows the worker's cgroup, or the node is cgroup v1/hybrid with a
    /// writable (or no) memory hierarchy — [`detect`] reports what is missing.
    AsIs,
    /// Every unified hierarchy showing the worker's cgroup is read-only (or none does), and the worker is in a
    /// cgroup namespace of its own: mount a cgroup2 at this path.
    MountPrivate(PathBuf),
}

/// Decides, from `/proc/self/mountinfo`, `/proc/self/cgroup` and the `/proc/self/ns/cgroup` link (`Err`: why it
/// could not be read), whether the worker must mount its own cgroup2 at `private_dir/unified` (pure).
///
/// Pure cgroup v2 means `/proc/self/cgroup` has only the `0::` line. There, a writable cgroup2 mount showing the
/// worker's cgroup is used as it is; otherwise, in a non-initial cgroup namespace, a private mount; in the
/// initial one, [`CgroupMountError::InitialNamespace`]. On v1/hybrid nodes, a read-only memory hierarchy is
/// [`CgroupMountError::V1ReadOnly`] (a private mount cannot help there).
pub(crate) fn writable_v2_plan(
    mountinfo: &str,
    proc_cgroup: &str,
    cgroup_ns: Result<&str, &str>,
    private_dir: &Path,
) -> Result<WritableV2, CgroupMountError> {
    let mounts = parse_mountinfo(mountinfo);
    let lines = parse_proc_cgroup(proc_cgroup);
    let Some(v2_line) = lines.iter().find(|l| l.controllers.is_empty()) else {
        return v1_plan(&mounts, &lines);
    };
    if lines.iter().any(|l| !l.controllers.is_empty()) {
        return v1_plan(&mounts, &lines);
    }
    let showing: Vec<&CgroupMount> = mounts
        .iter()
        .filter(|m| m.v2 && cgroup_dir(m, &v2_line.path).is_some())
        .collect();
    if showing.iter().any(|m| !m.read_only) {
        return Ok(WritableV2::AsIs);
    }
    let mount_point = showing
        .first()
        .map_or_else(|| PathBuf::from("-"), |m| m.mount_point.clone());
    match cgroup_ns {
        Ok(ns) if ns.starts_with("cgroup:[") && ns != INIT_CGROUP_NS => {
            Ok(WritableV2::MountPrivate(private_dir.join(PRIVATE_CGROUP_MOUNT)))
        }
        Ok(ns) => Err(CgroupMountError::InitialNamespace {
            mount_point,
            namespace: ns.to_owned(),
        }),
        Err(why) => Err(CgroupMountError::InitialNamespace {
            mount_point,
            namespace: format!("/proc/self/ns/cgroup: {why}"),
        }),
    }
}

/// [`writable_v2_plan`] on a v1/hybrid node: refuses a read-only memory hierarchy showing the worker's cgroup
/// when no writable one does.
fn v1_plan(mounts: &[CgroupMount], lines: &[ProcCgroup]) -> Result<WritableV2, CgroupMountError> {
    let Some(line) = lines.iter().find(|l| l.controllers.iter().any(|c| c == "memory")) else {
        return Ok(WritableV2::AsIs);
    };
    let showing: Vec<&CgroupMount> = mounts
        .iter()
        .filter(|m| !m.v2 && m.options.iter().any(|o| o == "memory") && cgroup_dir(m, &line.path).is_some())
        .collect();
    match showing.iter().find(|m| m.read_only) {
        Some(ro) if showing.iter().all(|m| m.read_only) => Err(CgroupMountError::V1ReadOnly {
            mount_point: ro.mount_point.clone(),
        }),
        _ => Ok(WritableV2::AsIs),
    }
}

/// Makes sure a writable cgroup hierarchy shows the worker's cgroup before [`detect`] runs: when
/// [`writable_v2_plan`] says so, creates [`PRIVATE_CGROUP_DIR`] (mode 0700; an existing one must be a directory
/// of the worker's uid, not a symlink, and is re-moded 0700) and its `unified` mount point, and mounts a fresh
/// `cgroup2` there (`nosuid,nodev,noexec`). Returns that mount point, or `None` when nothing was needed.
pub(crate) fn ensure_writable_v2() -> Result<Option<PathBuf>, CgroupMountError> {
    let read = |path: &str| {
        fs::read_to_string(path).map_err(|source| CgroupMountError::Read {
            path: PathBuf::from(path),
            source,
        })
    };
    let ns = fs::read_link("/proc/self/ns/cgroup")
        .map(|l| l.display().to_string())
        .map_err(|e| e.to_string());
    let plan = writable_v2_plan(
        &read("/proc/self/mountinfo")?,
        &read("/proc/self/cgroup")?,
        ns.as_deref().map_err(String::as_str),
        Path::new(PRIVATE_CGROUP_DIR),
    )?;
    let WritableV2::MountPrivate(target) = plan else {
        return Ok(None);
    };
    let dir = Path::new(PRIVATE_CGROUP_DIR);
    private_dir(dir)?;
    private_dir(&target)?;
    rustix::mount::mount(
        "cgroup2",
        &target,
        "cgroup2",
        MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
        None,
    )
    .map_err(|e| CgroupMountError::Mount {
        path: target.clone(),
        source: e.into(),
    })?;
    tracing::info!(
        mount_point = %target.display(),
        "the unified cgroup hierarchy is read-only: mounted the worker's own cgroup2 (its cgroup namespace's root)"
    );
    Ok(Some(target))
}

/// Creates `dir` mode 0700, or checks that the existing one is a real directory of this uid and makes it 0700.
fn private_dir(dir: &Path) -> Result<(), CgroupMountError> {
    let err = |action: &'static str| {
        move |source: io::Error| CgroupMountError::Dir {
            path: dir.to_path_buf(),
            action,
            source,
        }
    };
    match fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => return Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(err("mkdir")(e)),
    }
    let meta = fs::symlink_metadata(dir).map_err(err("lstat"))?;
    let uid = rustix::process::geteuid().as_raw();
    if !meta.file_type().is_dir() || meta.uid() != uid {
        return Err(err("check")(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("not a directory owned by uid {uid} (a symlink or someone else's file?)"),
        )));
    }
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(err("chmod"))
}

/// The v2 cgroup under which the worker's subtree goes: its own cgroup, or that cgroup's parent if the worker
/// already moved itself into [`V2_SELF_LEAF`] (a second `Sandbox` in the same process, or a re-exec).
pub(crate) fn v2_base(own: &Path) -> &Path {
    match (own.file_name(), own.parent()) {
        (Some(name), Some(parent)) if name == V2_SELF_LEAF => parent,
        _ => own,
    }
}

/// The `cgroup.subtree_control` line enabling those of [`V2_CONTROLLERS`] missing from `current` (the file's
/// content), or `None` if all are enabled.
pub(crate) fn v2_enable_line(current: &str) -> Option<String> {
    let have: Vec<&str> = current.split_whitespace().collect();
    let missing: Vec<String> = V2_CONTROLLERS
        .into_iter()
        .filter(|c| !have.contains(c))
        .map(|c| format!("+{c}"))
        .collect();
    if missing.is_empty() {
        None
    } else {
        Some(missing.join(" "))
    }
}

/// Enables [`V2_CONTROLLERS`] for the children of `dir` (no-op if already enabled).
fn v2_enable(dir: &Path) -> io::Result<()> {
    let file = dir.join("cgroup.subtree_control");
    match v2_enable_line(&read_file(&file)?) {
        Some(line) => write_file(&file, &line),
        None => Ok(()),
    }
}

/// Creates the worker's subtree `<own cgroup>/<subtree_name>` in every hierarchy and returns its directories.
///
/// On v2 the subtree's parent must delegate the controllers, which the kernel refuses while that cgroup holds
/// processes (the worker itself). In that case the worker moves *itself* (its whole process: v2 migrates all
/// threads) into the leaf `<own>/cloud-agents.worker` and retries — what systemd's `Delegate=yes` documentation
/// prescribes. If other processes remain there, that fails and the reason says so.
pub(crate) fn prepare_subtree(own: &Dirs, subtree_name: &str) -> Result<Dirs, String> {
    match own {
        Dirs::V1(v1) => {
            let root = Dirs::V1(v1.clone()).join(subtree_name);
            for dir in root.unique() {
                mkdir_ok_if_exists(dir).map_err(|e| format!("mkdir {}: {e}", dir.display()))?;
            }
            Ok(root)
        }
        Dirs::V2 { dir } => {
            let base = v2_base(dir).to_path_buf();
            if let Err(first) = v2_enable(&base) {
                let leaf = base.join(V2_SELF_LEAF);
                let moved = mkdir_ok_if_exists(&leaf).and_then(|()| {
                    write_file(
                        &leaf.join("cgroup.procs"),
                        &rustix::process::getpid().as_raw_nonzero().to_string(),
                    )
                });
                if let Err(e) = moved.and_then(|()| v2_enable(&base)) {
                    return Err(format!(
                        "cannot enable {} in {}/cgroup.subtree_control ({first}; after moving the worker into {}: \
                         {e}); the worker's cgroup must be delegated to it and hold no other processes",
                        V2_CONTROLLERS.join(","),
                        base.display(),
                        leaf.display(),
                    ));
                }
            }
            let root = base.join(subtree_name);
            mkdir_ok_if_exists(&root).map_err(|e| format!("mkdir {}: {e}", root.display()))?;
            v2_enable(&root).map_err(|e| format!("enabling controllers in {}: {e}", root.display()))?;
            Ok(Dirs::V2 { dir: root })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO_V1: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";
    const PROC_V1: &str = "\
9:name=systemd:/
8:pids:/
6:freezer:/
4:memory:/process_api/abc
2:cpuacct:/
1:cpu:/
0::/
";

    #[test]
    fn detects_v1_when_the_v2_mount_lacks_controllers() {
        let dirs = detect(MOUNTINFO_V1, PROC_V1, |_| Ok("hugetlb\n".to_owned()));
        let Ok(Dirs::V1(v1)) = dirs else {
            panic!("{dirs:?}")
        };
        assert_eq!(v1.memory, Path::new("/sys/fs/cgroup/memory/process_api/abc"));
        assert_eq!(v1.pids, Path::new("/sys/fs/cgroup/pids"));
        assert_eq!(v1.cpu, Path::new("/sys/fs/cgroup/cpu"));
        assert_eq!(v1.cpuacct, Path::new("/sys/fs/cgroup/cpuacct"));
        assert_eq!(v1.freezer, Path::new("/sys/fs/cgroup/freezer"));
    }

    #[test]
    fn a_plugin_sees_each_v1_hierarchy_of_the_worker_once_under_its_host_name() {
        let own = detect(MOUNTINFO_V1, PROC_V1, |_| Ok("hugetlb\n".to_owned())).unwrap();
        let view = plugin_view(MOUNTINFO_V1, &own);
        assert!(!view.unified);
        let names: Vec<(&str, &str)> = view
            .hierarchies
            .iter()
            .map(|h| (h.name.as_str(), h.options.as_str()))
            .collect();
        assert_eq!(
            names,
            [
                ("memory", "memory"),
                ("pids", "pids"),
                ("cpu", "cpu"),
                ("cpuacct", "cpuacct"),
                ("freezer", "freezer")
            ]
        );
        assert!(view.hierarchies.iter().all(|h| h.links.is_empty()));
        assert!(view.covered.is_empty());

        // systemd's layout: cpu and cpuacct co-mounted, with flags, linked by both names.
        let mountinfo = "\
25 24 0:22 / /sys/fs/cgroup ro,nosuid,nodev,noexec - tmpfs tmpfs ro,mode=755
30 25 0:27 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct
31 25 0:28 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory
32 25 0:29 / /sys/fs/cgroup/pids rw,nosuid - cgroup cgroup rw,pids
33 25 0:30 / /sys/fs/cgroup/freezer rw,nosuid - cgroup cgroup rw,freezer,xattr
";
        let proc = "5:cpu,cpuacct:/w\n4:memory:/w\n3:pids:/w\n2:freezer:/w\n";
        let own = detect(mountinfo, proc, |_| Err(io::ErrorKind::NotFound.into())).unwrap();
        let view = plugin_view(mountinfo, &own);
        let cpu = view.hierarchies.iter().find(|h| h.name == "cpu,cpuacct").unwrap();
        assert_eq!(cpu.options, "cpu,cpuacct");
        assert_eq!(cpu.links, ["cpu", "cpuacct"]);
        let freezer = view.hierarchies.iter().find(|h| h.name == "freezer").unwrap();
        assert_eq!(freezer.options, "freezer,xattr");
        assert_eq!(view.hierarchies.len(), 4);

        // Mounted elsewhere: named after the controllers, and the host's mount points covered.
        let own = detect(MOUNTINFO_ELSEWHERE, PROC_ELSEWHERE, |_| {
            Err(io::ErrorKind::NotFound.into())
        })
        .unwrap();
        let view = plugin_view(MOUNTINFO_ELSEWHERE, &own);
        let names: Vec<&str> = view.hierarchies.iter().map(|h| h.name.as_str()).collect();
        assert_eq!(names, ["memory", "pids", "cpu,cpuacct", "freezer"]);
        assert_eq!(
            view.covered,
            ["/cg/memory", "/cg/pids", "/cg/cpu,cpuacct", "/cg/freezer"]
        );
    }

    #[test]
    fn a_plugin_sees_the_unified_hierarchy_and_the_workers_private_mount_stays_uncovered() {
        let mountinfo = "29 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n";
        let own = Dirs::V2 {
            dir: PathBuf::from("/sys/fs/cgroup/kubepods/pod1/ctr/cloud-agents-w"),
        };
        let view = plugin_view(mountinfo, &own);
        assert!(view.unified);
        assert!(view.hierarchies.is_empty() && view.covered.is_empty());
        // The runtime's read-only mount and the worker's own, in its 0700 directory.
        let mountinfo = "\
29 23 0:26 / /sys/fs/cgroup ro,nosuid - cgroup2 cgroup2 rw
40 23 0:26 / /run/cloud-agents/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw
";
        let own = Dirs::V2 {
            dir: PathBuf::from("/run/cloud-agents/cgroup/unified/cloud-agents-w"),
        };
        assert!(plugin_view(mountinfo, &own).covered.is_empty());
        // A unified hierarchy mounted elsewhere is covered.
        let mountinfo = "29 23 0:26 / /cgroup2 rw - cgroup2 cgroup2 rw\n";
        let own = Dirs::V2 {
            dir: PathBuf::from("/cgroup2/cloud-agents-w"),
        };
        assert_eq!(plugin_view(mountinfo, &own).covered, ["/cgroup2"]);
    }

    /// v1 hierarchies outside `/sys/fs/cgroup`, `cpu` and `cpuacct` co-mounted.
    const MOUNTINFO_ELSEWHERE: &str = "\
1 0 0:1 / /cg/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct
2 0 0:2 / /cg/memory rw - cgroup cgroup rw,memory
3 0 0:3 / /cg/pids rw - cgroup cgroup rw,pids
4 0 0:4 / /cg/freezer rw - cgroup cgroup rw,freezer
";
    const PROC_ELSEWHERE: &str = "4:cpu,cpuacct:/a\n3:memory:/a\n2:pids:/a\n1:freezer:/a\n";

    #[test]
    fn detects_v1_with_comounted_cpu_cpuacct() {
        let dirs = detect(MOUNTINFO_ELSEWHERE, PROC_ELSEWHERE, |_| {
            Err(io::ErrorKind::NotFound.into())
        });
        let Ok(Dirs::V1(v1)) = dirs else {
            panic!("{dirs:?}")
        };
        assert_eq!(v1.cpu, v1.cpuacct);
        assert_eq!(Dirs::V1(v1).unique().len(), 4);
    }

    #[test]
    fn detects_v2_unified() {
        let mountinfo = "29 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n";
        let proc = "0::/kubepods/pod1/ctr\n";
        let dirs = detect(mountinfo, proc, |p| {
            assert_eq!(
                p,
                Path::new("/sys/fs/cgroup/kubepods/pod1/ctr/cgroup.controllers")
            );
            Ok("cpuset cpu io memory hugetlb pids rdma misc\n".to_owned())
        });
        assert_eq!(
            dirs,
            Ok(Dirs::V2 {
                dir: PathBuf::from("/sys/fs/cgroup/kubepods/pod1/ctr")
            })
        );
    }

    #[test]
    fn reports_why_nothing_fits() {
        let mountinfo = "41 31 0:38 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        let Err(reason) = detect(mountinfo, "0::/x\n", |_| Ok("cpu io\n".to_owned())) else {
            panic!()
        };
        assert!(reason.contains("lacks controllers memory,pids"), "{reason}");
        assert!(reason.contains("memory: not in /proc/self/cgroup"), "{reason}");
        assert!(detect("", "", |_| Ok(String::new())).is_err());
        assert!(detect("garbage\n- - -\n\n", "::::\n:\n", |_| Ok(String::new())).is_err());
    }

    #[test]
    fn cgroup_dir_strips_bind_mount_roots_and_rejects_escapes() {
        let mount = CgroupMount {
            root: "/docker/abc".to_owned(),
            mount_point: PathBuf::from("/sys/fs/cgroup/memory"),
            v2: false,
            options: vec!["memory".to_owned()],
            read_only: false,
        };
        assert_eq!(
            cgroup_dir(&mount, "/docker/abc"),
            Some(PathBuf::from("/sys/fs/cgroup/memory"))
        );
        assert_eq!(
            cgroup_dir(&mount, "/docker/abc/x"),
            Some(PathBuf::from("/sys/fs/cgroup/memory/x"))
        );
        assert_eq!(cgroup_dir(&mount, "/docker/abcd"), None);
        assert_eq!(cgroup_dir(&mount, "/other"), None);
        let ns = CgroupMount {
            root: "/".to_owned(),
            ..mount
        };
        assert_eq!(cgroup_dir(&ns, "/../.."), None);
        assert_eq!(cgroup_dir(&ns, "/"), Some(PathBuf::from("/sys/fs/cgroup/memory")));
    }

    #[test]
    fn mountinfo_escapes_and_optional_fields() {
        let text = "36 35 98:0 / /mnt/with\\040space rw shared:1 master:2 - cgroup cg rw,memory\n";
        let mounts = parse_mountinfo(text);
        assert_eq!(mounts.len(), 1);
        assert_eq!(mounts[0].mount_point, Path::new("/mnt/with space"));
        assert_eq!(mounts[0].options, ["rw", "memory"]);
        assert_eq!(unescape_mount_field("a\\134b\\9"), "a\\b\\9");
        assert_eq!(unescape_mount_field("\\777\\"), "\\777\\");
    }

    #[test]
    fn v2_self_leaf_and_enable_line() {
        assert_eq!(
            v2_base(Path::new("/sys/fs/cgroup/a/cloud-agents.worker")),
            Path::new("/sys/fs/cgroup/a")
        );
        assert_eq!(
            v2_base(Path::new("/sys/fs/cgroup/a")),
            Path::new("/sys/fs/cgroup/a")
        );
        assert_eq!(v2_enable_line("cpu io\n").as_deref(), Some("+memory +pids"));
        assert_eq!(v2_enable_line("memory pids cpu"), None);
        assert_eq!(v2_enable_line("").as_deref(), Some("+memory +pids +cpu"));
    }

    /// `/proc/self/mountinfo` of a non-privileged container on a cgroup v2 node (containerd, private cgroup
    /// namespace): the runtime's cgroup2 at /sys/fs/cgroup, read-only per mount.
    const MOUNTINFO_V2_RO: &str = "\
1012 1003 0:26 / /sys/fs/cgroup ro,nosuid,nodev,noexec,relatime - cgroup2 cgroup rw,nsdelegate,memory_recursiveprot
";
    const CONTAINER_NS: &str = "cgroup:[4026532611]";

    fn plan(mountinfo: &str, proc: &str, ns: Result<&str, &str>) -> Result<WritableV2, CgroupMountError> {
        writable_v2_plan(mountinfo, proc, ns, Path::new("/run/ca/cgroup"))
    }

    #[test]
    fn mountinfo_read_only_from_mount_or_super_options() {
        let mounts = parse_mountinfo(&format!(
            "{MOUNTINFO_V2_RO}2 1 0:27 / /a rw,nosuid - cgroup2 cgroup2 rw\n3 1 0:28 / /b rw - cgroup cgroup ro,memory\n"
        ));
        let ro: Vec<bool> = mounts.iter().map(|m| m.read_only).collect();
        assert_eq!(ro, [true, false, true]);
        assert_eq!(mounts[2].options, ["ro", "memory"]);
    }

    #[test]
    fn read_only_v2_in_a_private_cgroup_namespace_gets_a_private_mount() {
        for proc in ["0::/\n", "0::/cloud-agents.worker\n"] {
            assert_eq!(
                plan(MOUNTINFO_V2_RO, proc, Ok(CONTAINER_NS)).unwrap(),
                WritableV2::MountPrivate(PathBuf::from("/run/ca/cgroup/unified")),
                "{proc}"
            );
        }
        // No cgroup2 mount at all (the runtime mounted none): the same.
        assert_eq!(
            plan("", "0::/\n", Ok(CONTAINER_NS)).unwrap(),
            WritableV2::MountPrivate(PathBuf::from("/run/ca/cgroup/unified"))
        );
        // A read-only mount that does not show our cgroup (another subtree bind-mounted) does not count.
        let other = "5 1 0:26 /elsewhere /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        assert_eq!(
            plan(other, "0::/mine\n", Ok(CONTAINER_NS)).unwrap(),
            WritableV2::MountPrivate(PathBuf::from("/run/ca/cgroup/unified"))
        );
    }

    #[test]
    fn read_only_v2_in_the_host_cgroup_namespace_is_refused_naming_the_fix() {
        let Err(e) = plan(MOUNTINFO_V2_RO, "0::/kubepods/pod1/ctr\n", Ok(INIT_CGROUP_NS)) else {
            panic!("a mount in the initial cgroup namespace would expose the node's hierarchy")
        };
        assert!(
            matches!(&e, CgroupMountError::InitialNamespace { mount_point, .. } if mount_point == Path::new("/sys/fs/cgroup"))
        );
        let Err(e) = plan("", "0::/\n", Ok(INIT_CGROUP_NS)) else {
            panic!()
        };
        assert!(
            matches!(&e, CgroupMountError::InitialNamespace { mount_point, .. } if mount_point == Path::new("-"))
        );
        let Err(e) = plan(MOUNTINFO_V2_RO, "0::/\n", Ok(INIT_CGROUP_NS)) else {
            panic!()
        };
        let msg = e.to_string();
        assert!(
            msg.contains("/sys/fs/cgroup is read-only")
                && msg.contains("private cgroup namespace")
                && msg.contains("worker.sandbox.mode"),
            "{msg}"
        );
        // Unknown namespace (no cgroup namespaces in the kernel, /proc unreadable): refused too.
        let Err(e) = plan(MOUNTINFO_V2_RO, "0::/\n", Err("No such file or directory")) else {
            panic!()
        };
        assert!(
            e.to_string().contains("/proc/self/ns/cgroup: No such file"),
            "{e}"
        );
        assert!(plan(MOUNTINFO_V2_RO, "0::/\n", Ok("garbage")).is_err());
    }

    #[test]
    fn writable_v2_is_used_as_it_is() {
        // Privileged, or CRI-O's cgroup2-mount-hierarchy-rw annotation: the runtime's mount is writable.
        let rw = "29 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n";
        for ns in [Ok(CONTAINER_NS), Ok(INIT_CGROUP_NS), Err("unreadable")] {
            assert_eq!(plan(rw, "0::/\n", ns).unwrap(), WritableV2::AsIs);
        }
        // The worker's own mount from an earlier Sandbox of this process, beside the runtime's read-only one:
        // nothing more to mount, and detect picks the writable one although it is listed second.
        let both = format!(
            "{MOUNTINFO_V2_RO}1100 1099 0:26 / /run/ca/cgroup/unified rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw\n"
        );
        assert_eq!(
            plan(&both, "0::/cloud-agents.worker\n", Ok(CONTAINER_NS)).unwrap(),
            WritableV2::AsIs
        );
        let dirs = detect(&both, "0::/cloud-agents.worker\n", |_| {
            Ok("cpu memory pids\n".to_owned())
        });
        assert_eq!(
            dirs,
            Ok(Dirs::V2 {
                dir: PathBuf::from("/run/ca/cgroup/unified/cloud-agents.worker")
            })
        );
    }

    #[test]
    fn v1_and_hybrid_nodes_never_get_a_private_v2_mount() {
        // This development VM: v1 hierarchies (plus an empty unified one), writable.
        assert_eq!(
            plan(MOUNTINFO_V1, PROC_V1, Ok(INIT_CGROUP_NS)).unwrap(),
            WritableV2::AsIs
        );
        assert_eq!(
            plan(MOUNTINFO_V1, PROC_V1, Ok(CONTAINER_NS)).unwrap(),
            WritableV2::AsIs
        );
        // A read-only unified mount on a hybrid node does not matter: the controllers are in v1.
        let hybrid = MOUNTINFO_V1.replace("/sys/fs/cgroup/unified rw", "/sys/fs/cgroup/unified ro");
        assert_eq!(
            plan(&hybrid, PROC_V1, Ok(CONTAINER_NS)).unwrap(),
            WritableV2::AsIs
        );
        // A read-only v1 memory hierarchy (an unprivileged container on a v1 node) is refused, naming the fix.
        let ro = MOUNTINFO_V1.replace("/sys/fs/cgroup/memory rw", "/sys/fs/cgroup/memory ro");
        let Err(e) = plan(&ro, PROC_V1, Ok(CONTAINER_NS)) else {
            panic!("read-only v1 memory hierarchy accepted")
        };
        assert!(
            matches!(&e, CgroupMountError::V1ReadOnly { mount_point } if mount_point == Path::new("/sys/fs/cgroup/memory"))
        );
        assert!(e.to_string().contains("worker.sandbox.mode privileged"), "{e}");
        // No memory hierarchy at all: detect reports it.
        assert_eq!(
            plan("", "1:pids:/\n", Ok(CONTAINER_NS)).unwrap(),
            WritableV2::AsIs
        );
    }

    #[test]
    fn the_private_directory_is_0700_of_our_uid_and_never_a_symlink() {
        let tmp = tempfile::tempdir().unwrap();
        let mode = |p: &Path| fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777;
        let fresh = tmp.path().join("fresh");
        private_dir(&fresh).unwrap();
        assert_eq!(mode(&fresh), 0o700);
        // An existing directory (an emptyDir is 0777) is re-moded.
        let existing = tmp.path().join("existing");
        fs::create_dir(&existing).unwrap();
        fs::set_permissions(&existing, fs::Permissions::from_mode(0o777)).unwrap();
        private_dir(&existing).unwrap();
        assert_eq!(mode(&existing), 0o700);
        // A symlink (someone prepared it to redirect the mount) or a file is refused.
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&existing, &link).unwrap();
        let file = tmp.path().join("file");
        fs::write(&file, "").unwrap();
        for bad in [&link, &file] {
            let Err(e) = private_dir(bad) else {
                panic!("{} accepted", bad.display())
            };
            assert!(matches!(e, CgroupMountError::Dir { action: "check", .. }), "{e}");
        }
        // A parent that cannot be written (a read-only root filesystem without a volume) names the fix.
        let Err(e) = private_dir(Path::new("/proc/cloud-agents-no-such-dir")) else {
            panic!()
        };
        assert!(e.to_string().contains("mount a volume there"), "{e}");
    }
}
