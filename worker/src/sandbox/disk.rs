//! The users' disks: one size-capped tmpfs per admitted user, so the bytes a user's plugins write to their
//! TMPDIRs and workspaces are capped by the kernel (`ENOSPC` past `user_limits.disk_bytes`), and nothing else on
//! the worker notices.
//!
//! # Slots mounted ahead of need
//!
//! A session's mount namespace is a copy of the worker's made when it is unshared, with no propagation: a sandbox
//! stub unshares long before it knows its user, so a tmpfs mounted for a user afterwards would not be in its view
//! (its bind of the TMPDIR would reach the directory beneath, uncapped). So [`Disks::mount`] mounts every slot
//! — `<state_dir>/disks/<worker>/<n>`, one per user the worker's budget admits (`users.rs`) — once, before the
//! first stub, and a user's directories are made in the slot it is given on admission; every stub's view has
//! them all. A slot is never unmounted while the worker runs (a stub's copy of the mount would then be another
//! file system than the worker's): a user's reclaim empties it ([`Disks::wipe`]) and gives it to the next user.
//!
//! # Cost
//!
//! An empty tmpfs costs a superblock; the mounts are made at the worker's start, none on a session's cold start.
//! Its pages are memory: charged to the memory cgroup of the session that writes them (so a plugin's writes count
//! against its session's limit as they happen) and kept until deleted, which is why the admission counts each
//! user's disk cap on top of its memory ceiling. Its inodes are capped too (one per [`BYTES_PER_INODE`] of the
//! cap, at least [`MIN_INODES`]): empty files cost kernel memory the size option does not count.
//!
//! The worker's start unmounts what a predecessor in the same mount namespace left at the same paths.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use rustix::mount::{MountFlags, UnmountFlags};

use super::{SandboxError, names};

/// One inode of a user's tmpfs per this many bytes of its cap.
pub(crate) const BYTES_PER_INODE: u64 = 16 * 1024;

/// The fewest inodes a user's tmpfs has, whatever its cap.
pub(crate) const MIN_INODES: u64 = 1024;

/// The mounted slots of one worker.
#[derive(Debug)]
pub(crate) struct Disks {
    /// `<state_dir>/disks/<worker>`: slot `n` is its directory `n`.
    root: PathBuf,
    /// How many.
    count: usize,
}

impl Disks {
    /// Mounts `count` tmpfs slots of `bytes` each under `<state_dir>/disks/<worker_id>` (root-owned, 0711; the
    /// tmpfs `nosuid`. Not `nodev`: a plugin's uid cannot make a device node anyway, and the worker's file
    /// transport tells a device in a TMPDIR apart by its type, which `nodev` would hide behind `EACCES`).
    pub(crate) fn mount(
        state_dir: &Path,
        worker_id: &str,
        bytes: u64,
        count: usize,
    ) -> Result<Disks, SandboxError> {
        let root = state_dir.join("disks").join(names::readable_name(worker_id));
        let err = |path: &Path, action, source| SandboxError::UserDisk {
            path: path.to_path_buf(),
            action,
            source,
        };
        fs::create_dir_all(&root).map_err(|e| err(&root, "mkdir", e))?;
        let options = std::ffi::CString::new(format!(
            "size={bytes},nr_inodes={},mode=0711,uid=0,gid=0",
            (bytes / BYTES_PER_INODE).max(MIN_INODES)
        ))
        .map_err(|e| err(&root, "mount", io::Error::new(io::ErrorKind::InvalidInput, e)))?;
        let mut disks = Disks { root, count: 0 };
        for n in 0..count {
            let slot = disks.slot(n);
            match fs::create_dir(&slot) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => unmount_all(&disks.root, &slot)?,
                Err(e) => return Err(err(&slot, "mkdir", e)),
            }
            rustix::mount::mount(
                "cloud-agents-user",
                &slot,
                "tmpfs",
                MountFlags::NOSUID,
                options.as_c_str(),
            )
            .map_err(|e| err(&slot, "mount", e.into()))?;
            disks.count = n + 1;
        }
        Ok(disks)
    }

    /// The mount point of slot `n`.
    pub(crate) fn slot(&self, n: usize) -> PathBuf {
        self.root.join(n.to_string())
    }

    /// Empties slot `n` (symbolic links removed, never followed).
    pub(crate) fn wipe(&self, n: usize) -> io::Result<()> {
        empty_dir(&self.slot(n))
    }
}

impl Drop for Disks {
    fn drop(&mut self) {
        for n in 0..self.count {
            let slot = self.slot(n);
            // Detached: a stub or session that still has it in its view keeps its copy until it ends.
            let _ = rustix::mount::unmount(&slot, UnmountFlags::DETACH);
            let _ = fs::remove_dir(&slot);
        }
    }
}

/// Removes everything in `dir`, not `dir` itself; a missing `dir` is empty.
pub(crate) fn empty_dir(dir: &Path) -> io::Result<()> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            fs::remove_dir_all(entry.path())?;
        } else {
            fs::remove_file(entry.path())?;
        }
    }
    Ok(())
}

/// Unmounts whatever is mounted on `slot` (a predecessor's tmpfs), detached.
fn unmount_all(root: &Path, slot: &Path) -> Result<(), SandboxError> {
    use std::os::unix::fs::MetadataExt as _;
    let err = |action, source| SandboxError::UserDisk {
        path: slot.to_path_buf(),
        action,
        source,
    };
    let dev = fs::metadata(root).map_err(|e| err("stat", e))?.dev();
    while fs::metadata(slot).map_err(|e| err("stat", e))?.dev() != dev {
        rustix::mount::unmount(slot, UnmountFlags::DETACH).map_err(|e| err("unmount", e.into()))?;
    }
    Ok(())
}
