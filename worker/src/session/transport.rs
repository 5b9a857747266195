//! Executa file transport (spec §5 HR-FT-03): a plugin too big for one stdout line writes the message to a file in
//! its TMPDIR and sends `{"__file_transport": "<path>"}`; the host reads the file and deletes it.
//!
//! The path is the plugin's, and the worker reads as root: nothing here follows it blindly.
//! * Resolved **beneath a directory fd of the TMPDIR**, never by path: `openat2(RESOLVE_BENEATH |
//!   RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)` (Linux ≥ 5.6), else a walk of `O_PATH | O_NOFOLLOW`
//!   directory fds. A symbolic link anywhere (the last component or a parent swapped in after a check), `..`, or
//!   an absolute path outside the TMPDIR is refused; there is no check-then-reopen window.
//! * Opened `O_NONBLOCK | O_NOFOLLOW | O_NOCTTY`, then `fstat`: only a regular file is read (a FIFO cannot block a
//!   worker thread, a device is never read), at most [`MAX_FILE_TRANSPORT_BYTES`].
//! * Deleted with `unlinkat` on the same parent fd, whatever happened (a link is removed itself, never its target).
//! * Errors ([`TransportError`]) carry neither the path nor a byte of the file: both are the plugin's.

use std::io::Read as _;
use std::os::fd::OwnedFd;
use std::path::{Component, Path, PathBuf};

use bytes::Bytes;
use fleet_proto::limits::MAX_FILE_TRANSPORT_BYTES;
use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

/// Why a file-transport pointer was refused. No variant carries the path or the file's content.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum TransportError {
    /// The path is relative.
    #[error("the file-transport path is not absolute")]
    NotAbsolute,
    /// The path does not start with the session's TMPDIR, or names the TMPDIR itself.
    #[error("the file-transport path is outside the session's TMPDIR")]
    Outside,
    /// A component is a symbolic link, `..`, or otherwise leaves the TMPDIR.
    #[error("the file-transport path goes through a symbolic link or out of the session's TMPDIR")]
    Unsafe,
    /// Nothing is there.
    #[error("the file-transport file does not exist")]
    Missing,
    /// A FIFO, a socket, a device or a directory.
    #[error("the file-transport file is not a regular file")]
    NotRegular,
    /// Over the limit.
    #[error("the file-transport file is over {MAX_FILE_TRANSPORT_BYTES} bytes")]
    TooLarge,
    /// Another I/O failure (its kind only).
    #[error("the file-transport file cannot be read ({0})")]
    Io(String),
}

fn io_error(e: Errno) -> TransportError {
    match e {
        Errno::NOENT => TransportError::Missing,
        Errno::LOOP | Errno::XDEV | Errno::NOTDIR => TransportError::Unsafe,
        e => TransportError::Io(std::io::Error::from(e).kind().to_string()),
    }
}

/// The path of `path` below one of `tmpdirs` (the TMPDIR as given to the plugin, and canonical), checked to be
/// plain names only.
fn beneath<'a>(path: &'a Path, tmpdirs: &[&Path]) -> Result<&'a Path, TransportError> {
    if !path.is_absolute() {
        return Err(TransportError::NotAbsolute);
    }
    let rel = tmpdirs
        .iter()
        .find_map(|t| path.strip_prefix(t).ok())
        .ok_or(TransportError::Outside)?;
    if rel.as_os_str().is_empty() {
        return Err(TransportError::Outside);
    }
    if !rel.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err(TransportError::Unsafe);
    }
    Ok(rel)
}

/// Opens `rel` (plain names) beneath `dir` without following any link.
fn open_beneath(dir: &OwnedFd, rel: &Path, flags: OFlags) -> Result<OwnedFd, TransportError> {
    let resolve = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
    match rustix::fs::openat2(dir, rel, flags | OFlags::CLOEXEC, Mode::empty(), resolve) {
        Err(Errno::NOSYS) => walk(dir, rel, flags),
        r => r.map_err(io_error),
    }
}

/// [`open_beneath`] on kernels without `openat2`: one `O_PATH | O_NOFOLLOW` directory fd per component.
fn walk(dir: &OwnedFd, rel: &Path, flags: OFlags) -> Result<OwnedFd, TransportError> {
    let mut names: Vec<&std::ffi::OsStr> = rel.iter().collect();
    let last = names.pop().ok_or(TransportError::Outside)?;
    let step = OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let mut cur = rustix::fs::openat(dir, ".", step, Mode::empty()).map_err(io_error)?;
    for name in names {
        cur = rustix::fs::openat(&cur, name, step, Mode::empty()).map_err(io_error)?;
    }
    rustix::fs::openat(
        &cur,
        last,
        flags | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(io_error)
}

/// Reads and deletes the file a `__file_transport` pointer names; `tmpdirs` are the session's TMPDIR as the
/// plugin was given it and, last, canonical ([`tmpdir_forms`]). Trailing whitespace is dropped.
pub(crate) fn read_transport_file(path: &Path, tmpdirs: &[&Path]) -> Result<Bytes, TransportError> {
    let rel = beneath(path, tmpdirs)?;
    // The TMPDIR itself, from `/` without following a link: the plugin cannot swap it (or a parent) for one.
    let canonical = tmpdirs.last().copied().ok_or(TransportError::Outside)?;
    let slash = rustix::fs::open(
        "/",
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(io_error)?;
    let below_slash = canonical.strip_prefix("/").map_err(|_| TransportError::Outside)?;
    let root = open_beneath(&slash, below_slash, OFlags::PATH | OFlags::DIRECTORY)?;
    let name = rel.file_name().ok_or(TransportError::Outside)?;
    let parent = match rel.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(p) => open_beneath(&root, p, OFlags::PATH | OFlags::DIRECTORY)?,
        None => root,
    };
    let result = read_regular(&parent, Path::new(name));
    // Whatever happened, the pointer's file goes (a link itself, never what it points to; never a directory).
    let _ = rustix::fs::unlinkat(&parent, name, AtFlags::empty());
    result
}

fn read_regular(parent: &OwnedFd, name: &Path) -> Result<Bytes, TransportError> {
    let fd = open_beneath(
        parent,
        name,
        OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::NOFOLLOW,
    )?;
    let stat = rustix::fs::fstat(&fd).map_err(io_error)?;
    if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
        return Err(TransportError::NotRegular);
    }
    if u64::try_from(stat.st_size).unwrap_or(u64::MAX) > MAX_FILE_TRANSPORT_BYTES as u64 {
        return Err(TransportError::TooLarge);
    }
    let mut bytes = Vec::new();
    std::fs::File::from(fd)
        .take(MAX_FILE_TRANSPORT_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| TransportError::Io(e.kind().to_string()))?;
    if bytes.len() > MAX_FILE_TRANSPORT_BYTES {
        return Err(TransportError::TooLarge);
    }
    while bytes.last().is_some_and(u8::is_ascii_whitespace) {
        bytes.pop();
    }
    Ok(Bytes::from(bytes))
}

/// The TMPDIR forms a session accepts pointers under: as given to the plugin, and canonical.
pub(crate) fn tmpdir_forms(given: &Path) -> Vec<PathBuf> {
    let mut forms = vec![given.to_path_buf()];
    if let Ok(real) = std::fs::canonicalize(given)
        && real != given
    {
        forms.push(real);
    }
    forms
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn setup() -> (tempfile::TempDir, PathBuf) {
        let root = tempfile::tempdir().unwrap();
        let tmp = std::fs::canonicalize(root.path()).unwrap().join("tmp");
        std::fs::create_dir(&tmp).unwrap();
        (root, tmp)
    }

    const FRAME: &[u8] = b"{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":1}";

    #[test]
    fn a_regular_file_inside_is_read_and_deleted() {
        let (_root, tmp) = setup();
        let inside = tmp.join("r.json");
        std::fs::write(&inside, [FRAME, b"\n"].concat()).unwrap();
        assert_eq!(read_transport_file(&inside, &[&tmp]).unwrap().as_ref(), FRAME);
        assert!(!inside.exists(), "deleted after reading");
        // In a subdirectory too.
        std::fs::create_dir(tmp.join("d")).unwrap();
        std::fs::write(tmp.join("d/r.json"), FRAME).unwrap();
        assert_eq!(
            read_transport_file(&tmp.join("d/r.json"), &[&tmp])
                .unwrap()
                .as_ref(),
            FRAME
        );
    }

    #[test]
    fn outside_relative_dotdot_and_the_tmpdir_itself_are_refused_and_nothing_outside_is_deleted() {
        let (root, tmp) = setup();
        let outside = root.path().join("secret.json");
        std::fs::write(&outside, b"SECRET").unwrap();
        let outside = std::fs::canonicalize(outside).unwrap();
        assert_eq!(
            read_transport_file(&outside, &[&tmp]),
            Err(TransportError::Outside)
        );
        assert_eq!(
            read_transport_file(&tmp.join("../secret.json"), &[&tmp]),
            Err(TransportError::Unsafe)
        );
        assert_eq!(read_transport_file(&tmp, &[&tmp]), Err(TransportError::Outside));
        assert_eq!(
            read_transport_file(Path::new("rel.json"), &[&tmp]),
            Err(TransportError::NotAbsolute)
        );
        assert!(outside.exists(), "never deletes outside TMPDIR");
    }

    #[test]
    fn symlinks_as_last_or_parent_component_are_refused_and_their_targets_kept() {
        let (root, tmp) = setup();
        let secret_dir = root.path().join("keys");
        std::fs::create_dir(&secret_dir).unwrap();
        std::fs::write(secret_dir.join("key"), b"SECRET").unwrap();
        std::os::unix::fs::symlink(secret_dir.join("key"), tmp.join("link.json")).unwrap();
        assert_eq!(
            read_transport_file(&tmp.join("link.json"), &[&tmp]),
            Err(TransportError::Unsafe)
        );
        assert!(!tmp.join("link.json").exists(), "the link itself is removed");
        std::os::unix::fs::symlink(&secret_dir, tmp.join("dir")).unwrap();
        let e = read_transport_file(&tmp.join("dir/key"), &[&tmp]).unwrap_err();
        assert_eq!(e, TransportError::Unsafe);
        assert!(secret_dir.join("key").exists(), "the target is never deleted");
        assert!(!e.to_string().contains("SECRET") && !e.to_string().contains("keys"));
        // The walk (kernels without openat2) refuses the same.
        let root_fd = rustix::fs::open(&tmp, OFlags::PATH | OFlags::DIRECTORY, Mode::empty()).unwrap();
        assert!(matches!(
            walk(&root_fd, Path::new("dir/key"), OFlags::RDONLY),
            Err(TransportError::Unsafe)
        ));
        std::fs::write(tmp.join("plain"), FRAME).unwrap();
        assert!(walk(&root_fd, Path::new("plain"), OFlags::RDONLY).is_ok());
    }

    #[test]
    fn a_fifo_a_directory_and_an_oversized_file_are_refused_without_blocking() {
        let (_root, tmp) = setup();
        let fifo = tmp.join("fifo");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            FileType::Fifo,
            Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        assert_eq!(
            read_transport_file(&fifo, &[&tmp]),
            Err(TransportError::NotRegular)
        );
        assert!(!fifo.exists());
        std::fs::create_dir(tmp.join("d")).unwrap();
        assert_eq!(
            read_transport_file(&tmp.join("d"), &[&tmp]),
            Err(TransportError::NotRegular)
        );
        let big = tmp.join("big");
        std::fs::write(&big, vec![b' '; MAX_FILE_TRANSPORT_BYTES + 1]).unwrap();
        assert_eq!(read_transport_file(&big, &[&tmp]), Err(TransportError::TooLarge));
        assert!(!big.exists());
        let exact = tmp.join("exact");
        std::fs::write(&exact, vec![b'x'; MAX_FILE_TRANSPORT_BYTES]).unwrap();
        assert_eq!(
            read_transport_file(&exact, &[&tmp]).unwrap().len(),
            MAX_FILE_TRANSPORT_BYTES
        );
        assert_eq!(
            read_transport_file(&tmp.join("gone"), &[&tmp]),
            Err(TransportError::Missing)
        );
    }

    #[test]
    fn a_tmpdir_swapped_for_a_link_is_refused() {
        let (root, tmp) = setup();
        let elsewhere = root.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        std::fs::write(elsewhere.join("r.json"), b"SECRET").unwrap();
        std::fs::rename(&tmp, root.path().join("moved")).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &tmp).unwrap();
        assert_eq!(
            read_transport_file(&tmp.join("r.json"), &[&tmp]),
            Err(TransportError::Unsafe)
        );
        assert!(elsewhere.join("r.json").exists());
    }

    #[test]
    fn the_tmpdir_as_given_and_canonical_are_both_accepted() {
        let (root, tmp) = setup();
        let alias = root.path().join("alias");
        std::os::unix::fs::symlink(&tmp, &alias).unwrap();
        let forms = tmpdir_forms(&alias);
        let forms: Vec<&Path> = forms.iter().map(PathBuf::as_path).collect();
        std::fs::write(tmp.join("a"), FRAME).unwrap();
        assert_eq!(
            read_transport_file(&alias.join("a"), &forms).unwrap().as_ref(),
            FRAME
        );
        std::fs::write(tmp.join("b"), FRAME).unwrap();
        assert_eq!(
            read_transport_file(&tmp.join("b"), &forms).unwrap().as_ref(),
            FRAME
        );
    }
}
