//! Steps 5 and 6: entrypoint resolution (spec §14.4, the five-level superset of §16 A-42) and permissions.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::InstallError;
use super::extract::member_path;

/// The entry (relative, `/`-separated) and a warning when it was picked among several candidates.
pub(crate) fn resolve(
    root: &Path,
    asset_entry: Option<&str>,
    manifest: Option<&Map<String, Value>>,
    names: &[String],
    platform: &str,
) -> Result<(String, Option<String>), InstallError> {
    // 1. The asset's entrypoint (binary_urls override).
    if let Some(path) = asset_entry {
        return check(root, path, "binary_urls entrypoint").map(|p| (p, None));
    }
    // 2. manifest.json runtime.binary.entrypoint: a string, or a map full key → OS segment → default.
    let declared = manifest
        .and_then(|m| m.get("runtime"))
        .and_then(|r| r.get("binary"))
        .and_then(|b| b.get("entrypoint"));
    match declared {
        None | Some(Value::Null) => {}
        Some(Value::String(path)) => return check(root, path, "manifest.json").map(|p| (p, None)),
        Some(Value::Object(map)) => {
            let os = platform.split('-').next().unwrap_or_default();
            let found = [platform, os, "default"].iter().find_map(|k| {
                map.iter()
                    .find(|(mk, _)| mk.to_ascii_lowercase() == *k)
                    .map(|(_, v)| v)
            });
            match found {
                Some(Value::String(path)) => return check(root, path, "manifest.json").map(|p| (p, None)),
                Some(_) => {
                    return Err(InstallError::BadManifest {
                        file: "manifest.json",
                        reason: "runtime.binary.entrypoint values must be strings".into(),
                    });
                }
                None => {}
            }
        }
        Some(_) => {
            return Err(InstallError::BadManifest {
                file: "manifest.json",
                reason: "runtime.binary.entrypoint must be a string or a map of platform keys".into(),
            });
        }
    }
    // 3. bin/{name}, bin/{name}.exe, {name}, {name}.exe.
    let mut tried = Vec::new();
    for name in names {
        for candidate in [
            format!("bin/{name}"),
            format!("bin/{name}.exe"),
            name.clone(),
            format!("{name}.exe"),
        ] {
            if is_plain_file(&root.join(&candidate)) {
                return Ok((candidate, None));
            }
            tried.push(candidate);
        }
    }
    // 4–5. The only executable under bin/ or at the root; with several, the first in byte order.
    let mut executables = Vec::new();
    for dir in ["bin", ""] {
        let d = if dir.is_empty() {
            root.to_path_buf()
        } else {
            root.join(dir)
        };
        let Ok(entries) = fs::read_dir(&d) else { continue };
        for entry in entries.flatten() {
            let path = entry.path();
            if let Ok(m) = fs::symlink_metadata(&path)
                && m.is_file()
                && m.permissions().mode() & 0o111 != 0
            {
                let name = entry.file_name().to_string_lossy().into_owned();
                executables.push(if dir.is_empty() {
                    name
                } else {
                    format!("{dir}/{name}")
                });
            }
        }
    }
    executables.sort();
    match executables.len() {
        0 => Err(InstallError::NoEntrypoint(format!(
            "the package declares none, has none of {}, and has no executable file under bin/ or at its root",
            tried.join(", ")
        ))),
        1 => Ok((executables.remove(0), None)),
        _ => {
            let picked = executables[0].clone();
            let warning = format!(
                "several executables and no declared entrypoint: picked {picked:?} (first in byte order) among {}",
                executables.join(", ")
            );
            tracing::warn!(entrypoint = %picked, candidates = ?executables, "entrypoint picked among several executables");
            Ok((picked, Some(warning)))
        }
    }
}

fn is_plain_file(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok_and(|m| m.is_file())
}

/// A declared path: relative, inside `root`, a regular file (a link is followed only when it stays inside).
fn check(root: &Path, declared: &str, from: &'static str) -> Result<String, InstallError> {
    let bad = |reason: String| InstallError::BadEntrypoint {
        path: declared.to_string(),
        from,
        reason,
    };
    let rel = match member_path(declared.as_bytes()) {
        Ok(Some(rel)) => rel,
        Ok(None) => return Err(bad("names the install root".into())),
        Err(reason) => return Err(bad(reason.to_string())),
    };
    let path = root.join(&rel);
    let canonical_root = fs::canonicalize(root).map_err(InstallError::io(root))?;
    match fs::canonicalize(&path) {
        Ok(real) if !real.starts_with(&canonical_root) => Err(bad("resolves outside the install".into())),
        Ok(real) if !real.is_file() => Err(bad("is not a regular file".into())),
        Ok(_) => Ok(rel_string(&rel)),
        Err(_) => Err(bad("does not exist in the package".into())),
    }
}

fn rel_string(rel: &Path) -> String {
    rel.components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join("/")
}

/// Step 6: the entry and `runtime.binary.executables` get 0755; `runtime.binary.permissions` (`{path: "0o755"}`)
/// is applied (masked to 0777, and never below owner-read); symbolic links are never chmod-ed through.
pub(crate) fn apply_permissions(
    root: &Path,
    entry: Option<&str>,
    manifest: Option<&Map<String, Value>>,
) -> Result<(), InstallError> {
    let binary = manifest
        .and_then(|m| m.get("runtime"))
        .and_then(|r| r.get("binary"))
        .and_then(Value::as_object);
    let mut modes: Vec<(String, u32)> = Vec::new();
    if let Some(entry) = entry {
        modes.push((entry.to_string(), 0o755));
    }
    if let Some(list) = binary
        .and_then(|b| b.get("executables"))
        .and_then(Value::as_array)
    {
        for v in list {
            let Some(p) = v.as_str() else {
                return Err(InstallError::BadManifest {
                    file: "manifest.json",
                    reason: "runtime.binary.executables must list paths".into(),
                });
            };
            modes.push((p.to_string(), 0o755));
        }
    }
    if let Some(map) = binary
        .and_then(|b| b.get("permissions"))
        .and_then(Value::as_object)
    {
        for (p, v) in map {
            let mode = parse_mode(v).ok_or_else(|| InstallError::BadManifest {
                file: "manifest.json",
                reason: format!("runtime.binary.permissions[{p:?}]: expected an octal mode like \"0o755\""),
            })?;
            modes.push((p.clone(), mode));
        }
    }
    for (declared, mode) in modes {
        let rel: PathBuf = match member_path(declared.as_bytes()) {
            Ok(Some(rel)) => rel,
            _ => {
                return Err(InstallError::BadManifest {
                    file: "manifest.json",
                    reason: format!("permission path {declared:?} is not inside the package"),
                });
            }
        };
        let path = root.join(rel);
        match fs::symlink_metadata(&path) {
            Ok(m) if m.is_file() || m.is_dir() => {
                fs::set_permissions(&path, fs::Permissions::from_mode((mode & 0o777) | 0o400))
                    .map_err(InstallError::io(&path))?;
            }
            // Absent or a link: nothing to do (links are never followed here).
            _ => {}
        }
    }
    Ok(())
}

fn parse_mode(v: &Value) -> Option<u32> {
    match v {
        Value::Number(n) => n.as_u64().and_then(|n| u32::try_from(n).ok()),
        Value::String(s) => {
            let s = s.trim();
            let digits = s.strip_prefix("0o").unwrap_or(s);
            u32::from_str_radix(digits, 8).ok()
        }
        _ => None,
    }
    .filter(|m| *m <= 0o7777)
}
