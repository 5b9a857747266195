//! The private-file plumbing of the auth directory: a 0700 directory, and files created 0600 from the first byte
//! and replaced atomically (temporary file in the same directory, `fsync`, `rename`, `fsync` of the directory).
//! The `.creds` format itself is the client's (`fleet_client::creds`).

use std::fs::{self, DirBuilder};
use std::io;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::Path;

use fleet_client::private_file;

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

/// Replaces `path` with `data` atomically; the file is 0600 from its creation ([`private_file::write_atomic`]).
pub(crate) fn write_private_atomic(path: &Path, data: &[u8]) -> Result<(), NatsAuthError> {
    private_file::write_atomic(path, data).map_err(|e| io_error(path, e))
}

/// Creates `path` with `data` (0600, atomically) only if it does not exist: `Ok(false)` when another writer got
/// there first ([`private_file::create_exclusive`]).
pub(crate) fn create_private_exclusive(path: &Path, data: &[u8]) -> Result<bool, NatsAuthError> {
    private_file::create_exclusive(path, data).map_err(|e| io_error(path, e))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// The auth directory is 0700 and a loosened file is tightened (writing itself: `fleet_client::private_file`).
    #[test]
    fn the_auth_dir_is_0700_and_a_loosened_file_is_tightened() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("auth");
        ensure_private_dir(&sub).unwrap();
        assert_eq!(fs::metadata(&sub).unwrap().permissions().mode() & 0o7777, 0o700);
        let f = sub.join("x");
        assert!(create_private_exclusive(&f, b"one").unwrap());
        fs::set_permissions(&f, fs::Permissions::from_mode(0o644)).unwrap();
        ensure_private_file(&f).unwrap();
        assert_eq!(fs::metadata(&f).unwrap().permissions().mode() & 0o7777, 0o600);
    }
}
