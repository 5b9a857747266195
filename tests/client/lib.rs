//! Support library of the `fleet-e2e-client` test crate — the end-to-end tests that drive a fleet from outside
//! (the `fleet` binary, NATS requests through `fleet-client`) and so never link the `fleet` crate: an edit in
//! `fleet/src/` does not rebuild them. Where the workspace, the fixture plugins and their binaries are (building
//! them on first use when missing or stale), a fake LLM upstream, process liveness. `fleet-e2e`'s support library
//! re-exports all of it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::SystemTime;

/// The workspace root (this crate is `tests/client/`).
pub fn workspace_root() -> PathBuf {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest_dir
        .ancestors()
        .nth(2)
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
        built_bin(
            "fleet-echo-plugin",
            &["-p", "fleet-echo-plugin"],
            &["tests/plugins/echo-rs"],
        )
    })
    .clone()
}

/// Path of the worker's `fleet-sandbox-stub` binary (the sandbox stubs of a worker embedded in a test), built
/// like [`echo_plugin_bin`] when missing or older than a file of the worker or proto crates.
///
/// # Panics
/// If the binary is missing and cannot be built.
pub fn sandbox_stub_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        built_bin(
            "fleet-sandbox-stub",
            &["-p", "fleet-worker", "--bin", "fleet-sandbox-stub"],
            &["worker/src", "proto/src"],
        )
    })
    .clone()
}

/// `<profile>/<name>`, (re)built with `cargo build <args>` in the tests' target dir and profile when missing or
/// older than a file under one of `sources` (relative to the workspace root).
fn built_bin(name: &str, args: &[&str], sources: &[&str]) -> PathBuf {
    let profile = profile_dir();
    let bin = profile.join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    if bin.is_file() && !is_stale(&bin, sources) {
        return bin;
    }
    cargo_build(args);
    assert!(
        bin.is_file(),
        "{} is still missing after cargo build",
        bin.display()
    );
    bin
}

/// Runs `cargo build <args>` into the tests' own target dir and profile.
///
/// # Panics
/// If cargo cannot run or the build fails.
pub fn cargo_build(args: &[&str]) {
    let profile = profile_dir();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(workspace_root()).arg("build").args(args);
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
    assert!(status.success(), "cargo build {args:?} failed: {status}");
}

/// True if a file under one of `sources` (relative to the workspace root) is newer than `bin`.
fn is_stale(bin: &Path, sources: &[&str]) -> bool {
    /// The newest modification time of `dir`'s files (of `dir` itself when it is a file).
    fn newest(dir: &Path) -> Option<SystemTime> {
        let meta = std::fs::metadata(dir).ok()?;
        if !meta.is_dir() {
            return meta.modified().ok();
        }
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
    sources
        .iter()
        .filter_map(|s| newest(&workspace_root().join(s)))
        .any(|src| src > built)
}

/// Path of the stdlib-only Python fixture plugin (`python3 <path>` runs it).
pub fn python_plugin_path() -> PathBuf {
    workspace_root().join("tests/plugins/python/echo_plugin.py")
}

/// The `fleet` binary, (re)built like [`echo_plugin_bin`] when missing or older than a file of a crate it is
/// made of (a stale binary would test yesterday's product).
pub fn fleet_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        built_bin(
            "fleet",
            &["-p", "fleet", "--bin", "fleet"],
            &["fleet", "worker/src", "proto/src", "third_party", "Cargo.lock"],
        )
    })
    .clone()
}

/// The `loadtest` binary (package `fleet-loadtest`), (re)built like [`fleet_bin`].
pub fn loadtest_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        built_bin(
            "loadtest",
            &["-p", "fleet-loadtest", "--bin", "loadtest"],
            &["loadtest", "fleet/client", "proto/src", "Cargo.lock"],
        )
    })
    .clone()
}

pub mod chromium;
pub mod fake_images;
pub mod fake_llm;
pub mod fake_oauth;
pub mod fake_web;
pub mod hang_report;

/// The directory of `pid`'s cgroup: in the memory hierarchy (v1), or the unified one (v2).
pub fn cgroup_dir(pid: u32) -> std::path::PathBuf {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("/proc/<pid>/cgroup");
    text.lines()
        .find_map(|l| {
            let mut f = l.splitn(3, ':');
            let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
            match controllers {
                "" => Some(format!("/sys/fs/cgroup{path}")),
                c if c.split(',').any(|c| c == "memory") => Some(format!("/sys/fs/cgroup/memory{path}")),
                _ => None,
            }
        })
        .expect("a memory or unified cgroup line")
        .into()
}

/// Whether a process exists (and is not a zombie).
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}
