//! Private files: the fleet's secrets on disk (NATS seeds and `.creds`, the exec-seal keys, the credentials
//! keyring, the dev signing key and link secret). One writer for all of them: a temporary file beside the target,
//! mode 0600 from its creation, synced, then renamed over the target (or put in place only if the target does not
//! exist), and the directory synced so the new name survives a power loss.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write as _};
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

/// Replaces `path` with `data` atomically; the file is 0600 from its creation and durable when this returns.
///
/// # Errors
/// The temporary file, the rename or a sync failed (nothing is left behind but the old file).
pub fn write_atomic(path: &Path, data: &[u8]) -> io::Result<()> {
    let tmp = write_temp(path, data)?;
    fs::rename(&tmp.0, path)?;
    sync_parent(path)
}

/// Creates `path` with `data` (0600, atomically) only if it does not exist: `Ok(false)` when another writer got
/// there first (the existing file is left alone). Two processes creating the same file agree on one winner.
///
/// # Errors
/// The temporary file, the link or a sync failed.
pub fn create_exclusive(path: &Path, data: &[u8]) -> io::Result<bool> {
    let tmp = write_temp(path, data)?;
    // `link(2)` never replaces an existing file.
    match fs::hard_link(&tmp.0, path) {
        Ok(()) => sync_parent(path).map(|()| true),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(e),
    }
}

/// A temporary file, removed on drop (after a rename it no longer exists, and the error is ignored).
struct Temp(PathBuf);

impl Drop for Temp {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

/// Writes `data` to a new 0600 temporary file beside `path` and syncs it.
fn write_temp(path: &Path, data: &[u8]) -> io::Result<Temp> {
    let name = path.file_name().map(|n| n.to_string_lossy()).unwrap_or_default();
    let tmp = Temp(path.with_file_name(format!(
        ".{name}.{}.{:016x}.tmp",
        std::process::id(),
        rand::random::<u64>()
    )));
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp.0)?;
    // The umask can only remove bits; make sure of 0600 anyway before any byte is written.
    file.set_permissions(fs::Permissions::from_mode(0o600))?;
    file.write_all(data)?;
    file.sync_all()?;
    Ok(tmp)
}

fn sync_parent(path: &Path) -> io::Result<()> {
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    File::open(parent)?.sync_all()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn private_files_are_0600_replaced_atomically_and_created_once() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("secret");
        assert!(create_exclusive(&f, b"one").unwrap());
        assert!(!create_exclusive(&f, b"two").unwrap());
        assert_eq!(fs::read(&f).unwrap(), b"one");
        write_atomic(&f, b"three").unwrap();
        assert_eq!(fs::read(&f).unwrap(), b"three");
        assert_eq!(fs::metadata(&f).unwrap().permissions().mode() & 0o777, 0o600);
        // Nothing temporary is left beside it.
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("secret")]);
        // A missing directory is an error, not a panic.
        assert!(write_atomic(&dir.path().join("no/such/dir/f"), b"x").is_err());
    }
}
