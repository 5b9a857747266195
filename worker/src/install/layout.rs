//! Steps 7–9: the on-disk layout — staging, the atomic version commit, the `current` pointer, the `bin/` shim,
//! garbage collection — and the read side (which versions are installed, which is current), and removal.
//!
//! ```text
//! <home>/
//!   bin/{tool_id}                 → ../tools/{tool_id}/current/<entry>   (binary installs)
//!   tools/.staging-{rand}/        an install in progress (removed on failure; stale ones swept after an hour)
//!   tools/{tool_id}/.lock         serialises installs of one tool id (flock)
//!   tools/{tool_id}/v{version}/   executa.json, INSTALL.json, manifest.json, the package's files
//!   tools/{tool_id}/current       → v{version}
//! ```

use std::fs::{self, File};
use std::io::{self, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{CURRENT, INSTALL_JSON, InstallError, InstallOptions, InstallRecord, Installed, rand_token};

/// Staging directories older than this are leftovers of a killed install and are swept.
const STALE_STAGING: Duration = Duration::from_secs(3600);

pub(crate) fn mkdir_0755(dir: &Path) -> Result<(), InstallError> {
    match fs::create_dir(dir) {
        Ok(()) => fs::set_permissions(dir, fs::Permissions::from_mode(0o755)).map_err(InstallError::io(dir)),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists && dir.is_dir() => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            if let Some(parent) = dir.parent() {
                mkdir_0755(parent)?;
            }
            mkdir_0755(dir)
        }
        Err(e) => Err(InstallError::io(dir)(e)),
    }
}

/// Writes a new file (0644), durable before it is renamed anywhere.
pub(crate) fn write_file(path: &Path, bytes: &[u8]) -> Result<(), InstallError> {
    let _ = fs::remove_file(path);
    let mut f = File::create_new(path).map_err(InstallError::io(path))?;
    f.write_all(bytes).map_err(InstallError::io(path))?;
    f.set_permissions(fs::Permissions::from_mode(0o644))
        .map_err(InstallError::io(path))?;
    f.sync_all().map_err(InstallError::io(path))
}

/// A staging directory, removed on drop unless committed.
#[derive(Debug)]
pub(crate) struct Staging {
    path: Option<PathBuf>,
}

impl Staging {
    pub(crate) fn create(tools: &Path) -> Result<Staging, InstallError> {
        sweep_stale(tools);
        let path = tools.join(format!(".staging-{}", rand_token()));
        fs::create_dir(&path).map_err(InstallError::io(&path))?;
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).map_err(InstallError::io(&path))?;
        Ok(Staging { path: Some(path) })
    }

    pub(crate) fn path(&self) -> &Path {
        self.path.as_deref().unwrap_or(Path::new(""))
    }

    fn keep(mut self) -> PathBuf {
        self.path.take().unwrap_or_default()
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if let Some(p) = self.path.take() {
            let _ = fs::remove_dir_all(p);
        }
    }
}

fn sweep_stale(tools: &Path) {
    let Ok(entries) = fs::read_dir(tools) else { return };
    for e in entries.flatten() {
        let name = e.file_name();
        if name.as_encoded_bytes().starts_with(b".staging-")
            && e.metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| t.elapsed().is_ok_and(|age| age > STALE_STAGING))
        {
            let _ = fs::remove_dir_all(e.path());
        }
    }
}

/// The exclusive install lock of one tool id (released on drop).
struct ToolLock(#[allow(dead_code)] File);

fn lock(tool_dir: &Path) -> Result<ToolLock, InstallError> {
    mkdir_0755(tool_dir)?;
    let path = tool_dir.join(".lock");
    let f = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(InstallError::io(&path))?;
    f.lock().map_err(InstallError::io(&path))?;
    Ok(ToolLock(f))
}

/// Reads a version directory's `INSTALL.json`.
fn read_record(dir: &Path) -> Option<InstallRecord> {
    let bytes = fs::read(dir.join(INSTALL_JSON)).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// Step 7–9 under the tool's lock.
pub(crate) fn commit(
    opts: &InstallOptions,
    staging: Staging,
    record: &InstallRecord,
) -> Result<Installed, InstallError> {
    let tool_dir = opts.tool_dir(&record.tool_id);
    let _lock = lock(&tool_dir)?;
    let target = opts.version_dir(&record.tool_id, &record.version);
    let mut reused = false;
    match read_record(&target) {
        Some(existing) if existing.sha256 == record.sha256 => {
            // The same bytes are installed already (e.g. by another worker sharing this home): keep them.
            reused = true;
            drop(staging);
        }
        _ => {
            if fs::symlink_metadata(&target).is_ok() {
                let aside = tool_dir.join(format!(".old-{}", rand_token()));
                fs::rename(&target, &aside).map_err(InstallError::io(&target))?;
                let _ = fs::remove_dir_all(&aside);
            }
            let staged = staging.keep();
            if let Err(e) = fs::rename(&staged, &target) {
                let _ = fs::remove_dir_all(&staged);
                return Err(InstallError::io(&target)(e));
            }
        }
    }
    // 8. The current pointer: a new link renamed over the old one (atomic).
    let version_name = format!("v{}", record.version);
    swap_link(&tool_dir.join(CURRENT), Path::new(&version_name))?;
    let record = read_record(&target).unwrap_or_else(|| record.clone());
    if let Some(entry) = &record.entrypoint {
        let bin = opts.home.join("bin");
        mkdir_0755(&bin)?;
        let shim = Path::new("..")
            .join("tools")
            .join(&record.tool_id)
            .join(CURRENT)
            .join(entry);
        swap_link(&bin.join(&record.tool_id), &shim)?;
    }
    // 9. Garbage collection.
    let collected = gc(&tool_dir, &version_name, opts);
    let dir = fs::canonicalize(&target).map_err(InstallError::io(&target))?;
    Ok(Installed {
        record,
        dir,
        manifest: None,
        reused,
        collected,
    })
}

/// Makes an installed version current again without its package (a cached install verified by the caller
/// against its `INSTALL.json`): swaps `current` and the shim, then collects old versions, under the tool's lock.
///
/// # Errors
/// [`InstallError::NotInstalled`] when the version directory has no `INSTALL.json`, or I/O.
pub fn activate(opts: &InstallOptions, tool_id: &str, version: &str) -> Result<Installed, InstallError> {
    let tool_dir = opts.tool_dir(tool_id);
    let target = opts.version_dir(tool_id, version);
    let not_installed = || InstallError::NotInstalled {
        tool_id: tool_id.to_string(),
        version: Some(version.to_string()),
    };
    if !tool_dir.is_dir() {
        return Err(not_installed());
    }
    let _lock = lock(&tool_dir)?;
    let record = read_record(&target).ok_or_else(not_installed)?;
    let version_name = format!("v{version}");
    swap_link(&tool_dir.join(CURRENT), Path::new(&version_name))?;
    if let Some(entry) = &record.entrypoint {
        let bin = opts.home.join("bin");
        mkdir_0755(&bin)?;
        let shim = Path::new("..")
            .join("tools")
            .join(tool_id)
            .join(CURRENT)
            .join(entry);
        swap_link(&bin.join(tool_id), &shim)?;
    }
    let collected = gc(&tool_dir, &version_name, opts);
    let dir = fs::canonicalize(&target).map_err(InstallError::io(&target))?;
    Ok(Installed {
        record,
        dir,
        manifest: None,
        reused: true,
        collected,
    })
}

/// The `INSTALL.json` of one installed version, if it is there.
pub fn version_record(opts: &InstallOptions, tool_id: &str, version: &str) -> Option<InstallRecord> {
    read_record(&opts.version_dir(tool_id, version))
}

fn swap_link(link: &Path, target: &Path) -> Result<(), InstallError> {
    let parent = link.parent().unwrap_or(Path::new("."));
    let tmp = parent.join(format!(".link-{}", rand_token()));
    std::os::unix::fs::symlink(target, &tmp).map_err(InstallError::io(&tmp))?;
    fs::rename(&tmp, link).map_err(|e| {
        let _ = fs::remove_file(&tmp);
        InstallError::io(link)(e)
    })
}

/// Removes versions other than `current` beyond the newest `keep`, and leftovers moved aside. Returns the
/// removed version directory names.
fn gc(tool_dir: &Path, current: &str, opts: &InstallOptions) -> Vec<String> {
    let mut versions: Vec<(u64, String)> = Vec::new();
    let Ok(entries) = fs::read_dir(tool_dir) else {
        return Vec::new();
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(".old-") {
            let _ = fs::remove_dir_all(e.path());
            continue;
        }
        if !name.starts_with('v')
            || name == current
            || opts.protected.iter().any(|v| name[1..] == **v)
            || !e.file_type().is_ok_and(|t| t.is_dir())
        {
            continue;
        }
        let at = read_record(&e.path()).map_or(0, |r| r.installed_at_ms);
        versions.push((at, name));
    }
    versions.sort_by(|a, b| b.cmp(a));
    let mut removed = Vec::new();
    for (_, name) in versions.into_iter().skip(opts.keep_versions) {
        if fs::remove_dir_all(tool_dir.join(&name)).is_ok() {
            removed.push(name);
        }
    }
    removed
}

/// The current install of `tool_id` under `opts.home`, with its canonical directory.
pub fn current_version(opts: &InstallOptions, tool_id: &str) -> Option<(InstallRecord, PathBuf)> {
    let link = opts.tool_dir(tool_id).join(CURRENT);
    let dir = fs::canonicalize(link).ok()?;
    read_record(&dir).map(|r| (r, dir))
}

/// Every installed version of `tool_id` (newest first).
pub fn installed_versions(opts: &InstallOptions, tool_id: &str) -> Vec<InstallRecord> {
    let Ok(entries) = fs::read_dir(opts.tool_dir(tool_id)) else {
        return Vec::new();
    };
    let mut out: Vec<InstallRecord> = entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with('v'))
        .filter_map(|e| read_record(&e.path()))
        .collect();
    out.sort_by_key(|r| std::cmp::Reverse(r.installed_at_ms));
    out
}

/// Removes one version (not the current one while others remain), or the whole tool with its `bin/` shim.
/// Returns the removed version names.
///
/// # Errors
/// [`InstallError::NotInstalled`], [`InstallError::RemoveCurrent`], or I/O.
pub fn remove(
    opts: &InstallOptions,
    tool_id: &str,
    version: Option<&str>,
) -> Result<Vec<String>, InstallError> {
    let tool_id = super::sanitize_tool_id(tool_id)?;
    let tool_dir = opts.tool_dir(&tool_id);
    if !tool_dir.is_dir() {
        return Err(InstallError::NotInstalled {
            tool_id,
            version: version.map(str::to_string),
        });
    }
    let _lock = lock(&tool_dir)?;
    match version {
        Some(v) => {
            let v = super::sanitize_version(v)?;
            let dir = opts.version_dir(&tool_id, &v);
            if !dir.is_dir() {
                return Err(InstallError::NotInstalled {
                    tool_id,
                    version: Some(v),
                });
            }
            let is_current = current_version(opts, &tool_id).is_some_and(|(r, _)| r.version == v);
            if is_current {
                return Err(InstallError::RemoveCurrent { tool_id, version: v });
            }
            fs::remove_dir_all(&dir).map_err(InstallError::io(&dir))?;
            Ok(vec![format!("v{v}")])
        }
        None => {
            let versions = installed_versions(opts, &tool_id)
                .into_iter()
                .map(|r| format!("v{}", r.version))
                .collect();
            let _ = fs::remove_file(opts.home.join("bin").join(&tool_id));
            fs::remove_dir_all(&tool_dir).map_err(InstallError::io(&tool_dir))?;
            Ok(versions)
        }
    }
}
