//! Support library of the `fleet-e2e` test crate: where the workspace, the fixture plugins and their binaries
//! are, building the Rust fixture plugin on first use if it is missing.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::SystemTime;

/// The workspace root (the parent of this crate's `tests/` directory).
pub fn workspace_root() -> PathBuf {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest_dir
        .parent()
        .map_or_else(|| manifest_dir.to_path_buf(), Path::to_path_buf)
}

/// The directory of the running test binary's profile, e.g. `target/debug`.
///
/// Test executables live in `<target>/<profile>/deps`; binaries of the workspace land in `<target>/<profile>`.
/// Falls back to `$CARGO_TARGET_DIR/debug` or `<workspace>/target/debug`.
pub fn profile_dir() -> PathBuf {
    if let Ok(exe) = std::env::current_exe() {
        for dir in exe.ancestors().skip(1) {
            if dir.file_name().is_some_and(|n| n == "deps")
                && let Some(profile) = dir.parent()
            {
                return profile.to_path_buf();
            }
        }
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|t| {
            if t.is_relative() {
                workspace_root().join(t)
            } else {
                t
            }
        })
        .unwrap_or_else(|| workspace_root().join("target"));
    target.join("debug")
}

/// Path of the `fleet-echo-plugin` binary, built (once per test process) with `cargo build -p fleet-echo-plugin`
/// if it is not there yet or is older than a file of its crate (`cargo test -p fleet-e2e` does not build it).
///
/// # Panics
/// If the binary is missing and cannot be built: the tests cannot run without it.
pub fn echo_plugin_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let profile = profile_dir();
        let bin = profile.join(format!("fleet-echo-plugin{}", std::env::consts::EXE_SUFFIX));
        if bin.is_file() && !is_stale(&bin) {
            return bin;
        }
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.current_dir(workspace_root())
            .args(["build", "-p", "fleet-echo-plugin"]);
        // Build into the same target dir and profile as the running tests.
        if let Some(target) = profile.parent() {
            cmd.env("CARGO_TARGET_DIR", target);
        }
        match profile.file_name().and_then(|n| n.to_str()) {
            Some("debug") | None => {}
            Some("release") => {
                cmd.arg("--release");
            }
            Some(other) => {
                cmd.args(["--profile", other]);
            }
        }
        let status = cmd
            .status()
            .unwrap_or_else(|e| panic!("cannot run cargo build: {e}"));
        assert!(
            status.success(),
            "cargo build -p fleet-echo-plugin failed: {status}"
        );
        assert!(
            bin.is_file(),
            "{} is still missing after cargo build",
            bin.display()
        );
        bin
    })
    .clone()
}

/// True if a file of the `fleet-echo-plugin` crate is newer than `bin`.
fn is_stale(bin: &Path) -> bool {
    /// The newest modification time of the files under `dir`.
    fn newest(dir: &Path) -> Option<SystemTime> {
        let mut latest = None;
        for entry in std::fs::read_dir(dir).ok()?.flatten() {
            let path = entry.path();
            let t = if path.is_dir() {
                newest(&path)
            } else {
                entry.metadata().and_then(|m| m.modified()).ok()
            };
            latest = latest.max(t);
        }
        latest
    }
    let Ok(built) = std::fs::metadata(bin).and_then(|m| m.modified()) else {
        return true;
    };
    newest(&workspace_root().join("tests/plugins/echo-rs")).is_some_and(|src| src > built)
}

/// Path of the stdlib-only Python fixture plugin (`python3 <path>` runs it).
pub fn python_plugin_path() -> PathBuf {
    workspace_root().join("tests/plugins/python/echo_plugin.py")
}
