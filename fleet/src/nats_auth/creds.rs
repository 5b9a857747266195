//! The private-file plumbing of the auth directory: a 0700 directory, and files created 0600 from the first byte
//! and replaced atomically (temporary file in the same directory, `fsync`, `rename`, `fsync` of the directory).
//! The `.creds` format itself is the client's (`fleet_client::creds`).

use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::NatsAuthError;

fn io_error(path: &Path, source: io::Error) -> NatsAuthError {
    NatsAuthError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Creates `dir` (its parents normally, itself with mode 0700) if missing; tightens an existing one to 0700.
pub(crate) fn ensure_private_dir(dir: &Path) -> Result<(), NatsAuthError> {
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::create_dir_all(parent).map_err(|e| io_error(parent, e))?;
    }
    match DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io_error(dir, e)),
    }
    let meta = fs::metadata(dir).map_err(|e| io_error(dir, e))?;
    if !meta.is_dir() {
        return Err(io_error(
            dir,
            io::Error::new(io::ErrorKind::AlreadyExists, "exists and is not a directory"),
        ));
    }
    if meta.permissions().mode() & 0o7777 != 0o700 {
        tracing::warn!(dir = %dir.display(), mode = format!("{:o}", meta.permissions().mode() & 0o7777), "tightening the NATS auth directory to 0700");
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(|e| io_error(dir, e))?;
    }
    Ok(())
}

/// Tightens an existing private file to 0600 if group or others have any access.
pub(crate) fn ensure_private_file(path: &Path) -> Result<(), NatsAuthError> {
    let mode = fs::metadata(path)
        .map_err(|e| io_error(path, e))?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        tracing::warn!(file = %path.display(), mode = format!("{:o}", mode & 0o7777), "tightening a NATS auth file to 0600");
        fs::set_permissions(path, fs::Permissions::from_mode(0o600)).map_err(|e| io_error(path, e))?;
    }
    Ok(())
}

/// A fresh temporary path next to `path`.
fn temp_path(path: &Path) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let name = path.file_name().map(|n| n.to_string_lossy()).unwrap_or_default();
    path.with_file_name(format!(".{name}.{}.{n}.tmp", std::process::id()))
}

/// Writes `data` to a new 0600 temporary file next to `path` and syncs it; returns the temporary path.
fn write_temp(path: &Path, data: &[u8]) -> Result<PathBuf, NatsAuthError> {
    let tmp = temp_path(path);
    let result = (|| {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        // The umask can only remove bits; make sure of 0600 anyway before any byte is written.
        file.set_permissions(fs::Permissions::from_mode(0o600))?;
        file.write_all(data)?;
        file.sync_all()
    })();
    match result {
        Ok(()) => Ok(tmp),
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            Err(io_error(&tmp, e))
        }
    }
}

fn sync_parent(path: &Path) -> Result<(), NatsAuthError> {
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    File::open(parent)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_error(parent, e))
}

/// Replaces `path` with `data` atomically; the file is 0600 from its creation.
pub(crate) fn write_private_atomic(path: &Path, data: &[u8]) -> Result<(), NatsAuthError> {
    let tmp = write_temp(path, data)?;
    if let Err(e) = fs::rename(&tmp, path) {
        let _ = fs::remove_file(&tmp);
        return Err(io_error(path, e));
    }
    sync_parent(path)
}

/// Creates `path` with `data` (0600, atomically) only if it does not exist: `Ok(false)` when another writer got
/// there first (the existing file is left alone).
pub(crate) fn create_private_exclusive(path: &Path, data: &[u8]) -> Result<bool, NatsAuthError> {
    let tmp = write_temp(path, data)?;
    // `link` never replaces an existing file, so two processes creating the same dir agree on one winner.
    let linked = fs::hard_link(&tmp, path);
    let _ = fs::remove_file(&tmp);
    match linked {
        Ok(()) => sync_parent(path).map(|()| true),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(io_error(path, e)),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn private_files_are_0600_and_replaced_atomically() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("auth");
        ensure_private_dir(&sub).unwrap();
        assert_eq!(fs::metadata(&sub).unwrap().permissions().mode() & 0o7777, 0o700);
        let f = sub.join("x");
        assert!(create_private_exclusive(&f, b"one").unwrap());
        assert!(!create_private_exclusive(&f, b"two").unwrap());
        assert_eq!(fs::read(&f).unwrap(), b"one");
        write_private_atomic(&f, b"three").unwrap();
        assert_eq!(fs::read(&f).unwrap(), b"three");
        assert_eq!(fs::metadata(&f).unwrap().permissions().mode() & 0o7777, 0o600);
        assert_eq!(fs::read_dir(&sub).unwrap().count(), 1, "no temporary file left");
        fs::set_permissions(&f, fs::Permissions::from_mode(0o644)).unwrap();
        ensure_private_file(&f).unwrap();
        assert_eq!(fs::metadata(&f).unwrap().permissions().mode() & 0o7777, 0o600);
    }
}
