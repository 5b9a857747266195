//! Step 4: extraction into the staging directory, refusing every zip-slip form.
//!
//! Nothing is unpacked by the archive libraries themselves: every member's path is checked
//! ([`member_path`]), parents are created one component at a time refusing any that is a symbolic link, files are
//! created with `O_EXCL` (never through a link), symbolic links must resolve lexically inside the root, hard links
//! must name a regular file already extracted, and devices, FIFOs and sockets are refused. After extraction every
//! symbolic link that resolves is checked once more against the canonical root.

use std::ffi::OsStr;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use super::{Format, InstallError, MAX_ARCHIVE_ENTRIES, MAX_EXTRACT_BYTES, UnsafeReason};

/// Extracts `archive` into `root` (an empty directory). `raw_name` names the file of a raw package
/// (`bin/{raw_name}`).
pub(crate) fn extract(
    archive: &Path,
    format: Format,
    root: &Path,
    raw_name: Option<&str>,
) -> Result<(), InstallError> {
    let mut budget = Budget::default();
    match format {
        Format::Raw => {
            let name = raw_name.ok_or(InstallError::MissingToolId)?;
            let mut src = File::open(archive).map_err(InstallError::io(archive))?;
            let rel = PathBuf::from("bin").join(name);
            write_member(root, &rel, &mut src, 0o755, &mut budget, name)?;
        }
        Format::TarGz => extract_tar(archive, root, &mut budget)?,
        Format::Zip => extract_zip(archive, root, &mut budget)?,
    }
    check_links(root, root)
}

#[derive(Default)]
struct Budget {
    bytes: u64,
    entries: usize,
}

impl Budget {
    fn entry(&mut self) -> Result<(), InstallError> {
        self.entries += 1;
        if self.entries > MAX_ARCHIVE_ENTRIES {
            return Err(InstallError::TooLarge {
                what: "members",
                limit: MAX_ARCHIVE_ENTRIES as u64,
            });
        }
        Ok(())
    }
}

fn unsafe_member(name: &str, reason: UnsafeReason) -> InstallError {
    InstallError::UnsafeMember {
        member: name.to_string(),
        reason,
    }
}

/// The relative path a member name stands for; `None` for the root itself (`./`).
pub(crate) fn member_path(raw: &[u8]) -> Result<Option<PathBuf>, UnsafeReason> {
    if raw.first() == Some(&b'/') {
        return Err(UnsafeReason::Absolute);
    }
    let mut out = PathBuf::new();
    for c in Path::new(OsStr::from_bytes(raw)).components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir => {}
            Component::ParentDir => return Err(UnsafeReason::ParentDir),
            Component::RootDir | Component::Prefix(_) => return Err(UnsafeReason::Absolute),
        }
    }
    Ok((!out.as_os_str().is_empty()).then_some(out))
}

/// Creates the parents of `rel` under `root` (0755), refusing any existing component that is not a directory.
fn make_parents(root: &Path, rel: &Path, name: &str) -> Result<(), InstallError> {
    let mut dir = root.to_path_buf();
    let Some(parent) = rel.parent() else { return Ok(()) };
    for c in parent.components() {
        dir.push(c);
        ensure_dir(&dir, name)?;
    }
    Ok(())
}

fn ensure_dir(dir: &Path, name: &str) -> Result<(), InstallError> {
    match fs::symlink_metadata(dir) {
        Ok(m) if m.file_type().is_symlink() => Err(unsafe_member(name, UnsafeReason::ThroughLink)),
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(InstallError::Archive {
            format: Format::TarGz,
            reason: format!("{name:?}: a parent path is a file"),
        }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            fs::create_dir(dir).map_err(InstallError::io(dir))?;
            fs::set_permissions(dir, fs::Permissions::from_mode(0o755)).map_err(InstallError::io(dir))
        }
        Err(e) => Err(InstallError::io(dir)(e)),
    }
}

/// Removes a non-directory already at `path` (a later member replaces an earlier one, as `tar` does).
fn clear(path: &Path, name: &str) -> Result<(), InstallError> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => Err(InstallError::Archive {
            format: Format::TarGz,
            reason: format!("{name:?}: a directory is in the way"),
        }),
        Ok(_) => fs::remove_file(path).map_err(InstallError::io(path)),
        Err(_) => Ok(()),
    }
}

/// Writes a regular file member (mode 0755 when any execute bit is set, else 0644).
fn write_member(
    root: &Path,
    rel: &Path,
    src: &mut dyn Read,
    mode: u32,
    budget: &mut Budget,
    name: &str,
) -> Result<(), InstallError> {
    make_parents(root, rel, name)?;
    let path = root.join(rel);
    clear(&path, name)?;
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(InstallError::io(&path))?;
    let remaining = MAX_EXTRACT_BYTES - budget.bytes;
    let copied = io::copy(&mut src.take(remaining + 1), &mut file).map_err(|e| InstallError::Archive {
        format: Format::TarGz,
        reason: format!("{name:?}: {e}"),
    })?;
    if copied > remaining {
        return Err(InstallError::TooLarge {
            what: "bytes",
            limit: MAX_EXTRACT_BYTES,
        });
    }
    budget.bytes += copied;
    file.flush().map_err(InstallError::io(&path))?;
    let mode = if mode & 0o111 != 0 { 0o755 } else { 0o644 };
    file.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(InstallError::io(&path))
}

/// Whether `target`, written in the directory of `rel`, stays inside the root lexically.
fn link_stays_inside(rel: &Path, target: &[u8]) -> bool {
    if target.is_empty() || target.first() == Some(&b'/') {
        return false;
    }
    let mut depth: Vec<&OsStr> = rel
        .parent()
        .map(|p| p.components().map(Component::as_os_str).collect())
        .unwrap_or_default();
    for c in Path::new(OsStr::from_bytes(target)).components() {
        match c {
            Component::Normal(n) => depth.push(n),
            Component::CurDir => {}
            Component::ParentDir => {
                if depth.pop().is_none() {
                    return false;
                }
            }
            Component::RootDir | Component::Prefix(_) => return false,
        }
    }
    true
}

fn write_symlink(root: &Path, rel: &Path, target: &[u8], name: &str) -> Result<(), InstallError> {
    if !link_stays_inside(rel, target) {
        return Err(unsafe_member(
            name,
            UnsafeReason::LinkEscapes(String::from_utf8_lossy(target).into_owned()),
        ));
    }
    make_parents(root, rel, name)?;
    let path = root.join(rel);
    clear(&path, name)?;
    std::os::unix::fs::symlink(OsStr::from_bytes(target), &path).map_err(InstallError::io(&path))
}

fn write_hardlink(root: &Path, rel: &Path, target: &[u8], name: &str) -> Result<(), InstallError> {
    let escapes = || {
        unsafe_member(
            name,
            UnsafeReason::HardLinkEscapes(String::from_utf8_lossy(target).into_owned()),
        )
    };
    let Ok(Some(target_rel)) = member_path(target) else {
        return Err(escapes());
    };
    let source = root.join(&target_rel);
    // The source must be a regular file reached without links.
    let mut probe = root.to_path_buf();
    for c in target_rel.components() {
        probe.push(c);
        match fs::symlink_metadata(&probe) {
            Ok(m) if m.file_type().is_symlink() => return Err(escapes()),
            Ok(_) => {}
            Err(_) => return Err(escapes()),
        }
    }
    if !fs::symlink_metadata(&source).is_ok_and(|m| m.is_file()) {
        return Err(escapes());
    }
    make_parents(root, rel, name)?;
    let path = root.join(rel);
    clear(&path, name)?;
    fs::hard_link(&source, &path).map_err(InstallError::io(&path))
}

fn extract_tar(archive: &Path, root: &Path, budget: &mut Budget) -> Result<(), InstallError> {
    let file = File::open(archive).map_err(InstallError::io(archive))?;
    let corrupt = |e: &dyn std::fmt::Display| InstallError::Archive {
        format: Format::TarGz,
        reason: e.to_string(),
    };
    let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(io::BufReader::new(file)));
    for entry in tar.entries().map_err(|e| corrupt(&e))? {
        let mut entry = entry.map_err(|e| corrupt(&e))?;
        budget.entry()?;
        let raw = entry.path_bytes().into_owned();
        let name = String::from_utf8_lossy(&raw).into_owned();
        let kind = entry.header().entry_type();
        use tar::EntryType as T;
        if matches!(
            kind,
            T::XGlobalHeader | T::XHeader | T::GNULongName | T::GNULongLink
        ) {
            continue;
        }
        if matches!(kind, T::Char | T::Block | T::Fifo) {
            return Err(unsafe_member(&name, UnsafeReason::DeviceFile));
        }
        let rel = match member_path(&raw) {
            Ok(Some(rel)) => rel,
            Ok(None) => continue,
            Err(reason) => return Err(unsafe_member(&name, reason)),
        };
        match kind {
            T::Directory => {
                make_parents(root, &rel, &name)?;
                ensure_dir(&root.join(&rel), &name)?;
            }
            T::Regular | T::Continuous | T::GNUSparse => {
                let mode = entry.header().mode().unwrap_or(0o644);
                write_member(root, &rel, &mut entry, mode, budget, &name)?;
            }
            T::Symlink => {
                let target = entry
                    .link_name_bytes()
                    .map(|t| t.into_owned())
                    .unwrap_or_default();
                write_symlink(root, &rel, &target, &name)?;
            }
            T::Link => {
                let target = entry
                    .link_name_bytes()
                    .map(|t| t.into_owned())
                    .unwrap_or_default();
                write_hardlink(root, &rel, &target, &name)?;
            }
            other => {
                return Err(unsafe_member(
                    &name,
                    UnsafeReason::Unsupported(format!("{other:?}")),
                ));
            }
        }
    }
    Ok(())
}

/// `st_mode` file types.
const S_IFMT: u32 = 0o170_000;
const S_IFREG: u32 = 0o100_000;
const S_IFDIR: u32 = 0o040_000;
const S_IFLNK: u32 = 0o120_000;

fn extract_zip(archive: &Path, root: &Path, budget: &mut Budget) -> Result<(), InstallError> {
    let file = File::open(archive).map_err(InstallError::io(archive))?;
    let corrupt = |e: &dyn std::fmt::Display| InstallError::Archive {
        format: Format::Zip,
        reason: e.to_string(),
    };
    let mut zip = zip::ZipArchive::new(io::BufReader::new(file)).map_err(|e| corrupt(&e))?;
    for i in 0..zip.len() {
        budget.entry()?;
        let mut member = zip.by_index(i).map_err(|e| corrupt(&e))?;
        let raw = member.name_raw().to_vec();
        let name = String::from_utf8_lossy(&raw).into_owned();
        let mode = member.unix_mode();
        let ftype = mode.map(|m| m & S_IFMT).filter(|t| *t != 0);
        if let Some(t) = ftype
            && !matches!(t, S_IFREG | S_IFDIR | S_IFLNK)
        {
            return Err(unsafe_member(&name, UnsafeReason::DeviceFile));
        }
        let rel = match member_path(&raw) {
            Ok(Some(rel)) => rel,
            Ok(None) => continue,
            Err(reason) => return Err(unsafe_member(&name, reason)),
        };
        if member.is_dir() || ftype == Some(S_IFDIR) {
            make_parents(root, &rel, &name)?;
            ensure_dir(&root.join(&rel), &name)?;
        } else if ftype == Some(S_IFLNK) {
            let mut target = Vec::new();
            (&mut member)
                .take(4096)
                .read_to_end(&mut target)
                .map_err(|e| corrupt(&e))?;
            write_symlink(root, &rel, &target, &name)?;
        } else {
            write_member(root, &rel, &mut member, mode.unwrap_or(0o644), budget, &name)?;
        }
    }
    Ok(())
}

/// Every symbolic link under `dir` that resolves must resolve inside `root`.
fn check_links(root: &Path, dir: &Path) -> Result<(), InstallError> {
    let canonical_root = fs::canonicalize(root).map_err(InstallError::io(root))?;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in fs::read_dir(&d).map_err(InstallError::io(&d))? {
            let entry = entry.map_err(InstallError::io(&d))?;
            let path = entry.path();
            let ft = entry.file_type().map_err(InstallError::io(&path))?;
            if ft.is_dir() {
                stack.push(path);
            } else if ft.is_symlink()
                && let Ok(resolved) = fs::canonicalize(&path)
                && !resolved.starts_with(&canonical_root)
            {
                let rel = path.strip_prefix(root).unwrap_or(&path).display().to_string();
                let target = fs::read_link(&path)
                    .map(|t| t.display().to_string())
                    .unwrap_or_default();
                return Err(unsafe_member(&rel, UnsafeReason::LinkEscapes(target)));
            }
        }
    }
    Ok(())
}
