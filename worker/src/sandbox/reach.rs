//! What the plugins' unprivileged uids can reach.
//!
//! With `run_as: per_user` (a root worker) a plugin runs under a uid that owns none of the operator's files and
//! belongs to none of their groups: only the "other" permission bits apply to it. A program it must execute, its
//! working directory, the files it reads — each is reachable only if every directory on the way is searchable by
//! others (`o+x`) and the last component grants the access needed. A `mktemp -d` directory (0700) or root's home
//! (0700, where pyenv puts its shims) blocks everything below it.
//!
//! [`blockers`] names every component in the way, and [`fix`] the `chmod` that removes them, so the catalogue
//! load (`crate::catalogue`) and the sandbox's start-up checks report a usable fix instead of a first-call
//! `Permission denied`.

use std::collections::BTreeSet;
use std::fmt;
use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

/// The access a path must grant to other users.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Access {
    /// A directory to pass through or work in (`o+x`).
    Search,
    /// A program to execute (`o+x`).
    Execute,
    /// A file to read or a directory to list (`o+r`).
    Read,
}

impl Access {
    /// The "other" permission bit.
    pub fn bit(self) -> u32 {
        match self {
            Access::Search | Access::Execute => 0o001,
            Access::Read => 0o004,
        }
    }

    /// The `chmod` letter (`x`, `r`).
    pub fn letter(self) -> char {
        match self {
            Access::Search | Access::Execute => 'x',
            Access::Read => 'r',
        }
    }

    fn adjective(self) -> &'static str {
        match self {
            Access::Search => "searchable",
            Access::Execute => "executable",
            Access::Read => "readable",
        }
    }
}

/// One directory or file that stops other users from reaching a path.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Blocker {
    /// The directory or file.
    pub path: PathBuf,
    /// Its permission bits (`0o7777` part).
    pub mode: u32,
    /// What it fails to grant to other users.
    pub access: Access,
}

impl fmt::Display for Blocker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (mode {:o}) is not {} by other users",
            self.path.display(),
            self.mode,
            self.access.adjective()
        )
    }
}

/// Every component that stops other users from reaching `path` with `access`, outermost first: the directories
/// leading to it, as written and after resolving symbolic links, must be searchable by others, and `path` itself
/// (resolved) must grant `access`. Empty: reachable.
///
/// # Errors
/// `path` or one of its directories cannot be inspected (does not exist…).
pub fn blockers(path: &Path, access: Access) -> io::Result<Vec<Blocker>> {
    let resolved = fs::canonicalize(path)?;
    let mut found = BTreeSet::new();
    let mut ordered = Vec::new();
    let written: &[&Path] = if path.is_absolute() && path != resolved {
        &[path, &resolved]
    } else {
        &[&resolved]
    };
    for p in written {
        let mut dirs: Vec<&Path> = p
            .ancestors()
            .skip(1)
            .filter(|d| !d.as_os_str().is_empty())
            .collect();
        dirs.reverse();
        for dir in dirs {
            let mode = fs::metadata(dir)?.permissions().mode() & 0o7777;
            if mode & Access::Search.bit() == 0 {
                let b = Blocker {
                    path: dir.to_path_buf(),
                    mode,
                    access: Access::Search,
                };
                if found.insert(b.clone()) {
                    ordered.push(b);
                }
            }
        }
    }
    let mode = fs::metadata(&resolved)?.permissions().mode() & 0o7777;
    if mode & access.bit() == 0 {
        let b = Blocker {
            path: resolved,
            mode,
            access,
        };
        if found.insert(b.clone()) {
            ordered.push(b);
        }
    }
    Ok(ordered)
}

/// Where plugins get a private tmpfs when their sandbox has namespaces (`confine`).
pub const PRIVATE_TMP: &str = "/tmp";

/// `blockers` without those a private `/tmp` does away with: a path under `/tmp` that the sandbox needs is
/// mounted back into the plugin's private `/tmp` as `kept` (an install directory, a program's directory, a
/// TMPDIR), and the directories strictly between `/tmp` and `kept` are created afresh there — only `kept` and
/// what is beneath it keep their modes.
pub fn beyond_private_tmp(mut blockers: Vec<Blocker>, kept: &Path) -> Vec<Blocker> {
    let tmp = fs::canonicalize(PRIVATE_TMP).unwrap_or_else(|_| PathBuf::from(PRIVATE_TMP));
    let kept = fs::canonicalize(kept).unwrap_or_else(|_| kept.to_path_buf());
    blockers.retain(|b| {
        let recreated =
            b.path.starts_with(&tmp) && b.path != tmp && kept.starts_with(&b.path) && b.path != kept;
        !recreated
    });
    blockers
}

/// The shell command that lets other users through `blockers`: `chmod o+x A B` (then `&& chmod o+r C` when a
/// file must also be readable). Paths are quoted for a POSIX shell when they need it.
pub fn fix(blockers: &[Blocker]) -> String {
    let mut parts = Vec::new();
    for letter in ['x', 'r'] {
        let paths: Vec<String> = blockers
            .iter()
            .filter(|b| b.access.letter() == letter)
            .map(|b| shell_quote(&b.path))
            .collect();
        if !paths.is_empty() {
            parts.push(format!("chmod o+{letter} {}", paths.join(" ")));
        }
    }
    parts.join(" && ")
}

/// `blockers` as one sentence: each blocker, then the fix (`a (mode 700) is not searchable by other users;
/// fix: `chmod o+x a``).
pub fn describe(blockers: &[Blocker]) -> String {
    let what: Vec<String> = blockers.iter().map(ToString::to_string).collect();
    format!("{}; fix: `{}`", what.join(", "), fix(blockers))
}

/// `path` quoted for a POSIX shell if it holds anything but `[A-Za-z0-9/._+-]`.
fn shell_quote(path: &Path) -> String {
    let s = path.to_string_lossy();
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '/' | '.' | '_' | '-' | '+'))
    {
        s.into_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn chmod(path: &Path, mode: u32) {
        fs::set_permissions(path, fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn a_closed_parent_is_named_with_its_chmod() {
        let root = tempfile::tempdir().unwrap();
        chmod(root.path(), 0o700);
        let inner = root.path().join("cat");
        fs::create_dir(&inner).unwrap();
        chmod(&inner, 0o750);
        let file = inner.join("python3");
        fs::write(&file, "").unwrap();
        chmod(&file, 0o755);

        let b = blockers(&file, Access::Execute).unwrap();
        let root_c = fs::canonicalize(root.path()).unwrap();
        assert_eq!(
            b.iter().map(|b| b.path.clone()).collect::<Vec<_>>(),
            vec![root_c.clone(), root_c.join("cat")]
        );
        assert_eq!(b[0].mode, 0o700);
        assert_eq!(
            fix(&b),
            format!("chmod o+x {} {}", root_c.display(), root_c.join("cat").display())
        );
        assert!(
            describe(&b).starts_with(&format!(
                "{} (mode 700) is not searchable by other users, ",
                root_c.display()
            )),
            "{}",
            describe(&b)
        );

        chmod(root.path(), 0o711);
        chmod(&inner, 0o755);
        assert!(blockers(&file, Access::Execute).unwrap().is_empty());
        chmod(&file, 0o750);
        let b = blockers(&file, Access::Execute).unwrap();
        assert_eq!(b.len(), 1);
        assert_eq!(b[0].access, Access::Execute);
        chmod(&file, 0o640);
        assert_eq!(
            fix(&blockers(&file, Access::Read).unwrap()),
            format!("chmod o+r {}", fs::canonicalize(&file).unwrap().display())
        );
    }

    #[test]
    fn a_symlink_is_checked_as_written_and_resolved() {
        let root = tempfile::tempdir().unwrap();
        chmod(root.path(), 0o755);
        let hidden = root.path().join("home");
        fs::create_dir(&hidden).unwrap();
        chmod(&hidden, 0o700);
        let target = hidden.join("tool");
        fs::write(&target, "").unwrap();
        chmod(&target, 0o755);
        let link = root.path().join("tool");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let b = blockers(&link, Access::Execute).unwrap();
        assert_eq!(b.len(), 1, "{b:?}");
        assert_eq!(b[0].path, fs::canonicalize(&hidden).unwrap());
    }

    #[test]
    fn odd_paths_are_quoted() {
        assert_eq!(shell_quote(Path::new("/a b/it's")), r"'/a b/it'\''s'");
        assert_eq!(shell_quote(Path::new("/usr/bin")), "/usr/bin");
    }
}
