//! Finding the cgroup hierarchies and the worker's own cgroup in them, and preparing the worker's subtree.
//!
//! Inputs are `/proc/self/mountinfo` (which cgroup filesystems are mounted where, and which part of the hierarchy
//! each mount shows) and `/proc/self/cgroup` (where this process sits in each hierarchy). The parsing is pure and
//! unit-tested; only [`detect`] (through a reader callback) and [`prepare_subtree`] touch the filesystem.

use std::io;
use std::path::{Component, Path, PathBuf};

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
        let (Some(root), Some(mount_point)) = (fields.get(3), fields.get(4)) else {
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
/// cgroup, else v1 if every needed controller has a hierarchy, else `Err(reason)`.
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
    for mount in mounts.iter().filter(|m| m.v2) {
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
    fn detects_v1_with_comounted_cpu_cpuacct() {
        let mountinfo = "\
1 0 0:1 / /cg/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct
2 0 0:2 / /cg/memory rw - cgroup cgroup rw,memory
3 0 0:3 / /cg/pids rw - cgroup cgroup rw,pids
4 0 0:4 / /cg/freezer rw - cgroup cgroup rw,freezer
";
        let proc = "4:cpu,cpuacct:/a\n3:memory:/a\n2:pids:/a\n1:freezer:/a\n";
        let dirs = detect(mountinfo, proc, |_| Err(io::ErrorKind::NotFound.into()));
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
}
