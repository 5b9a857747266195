//! The confined preparation of a Python install (`uv sync` under a build uid, in its own cgroup, namespaces and
//! seccomp, behind the egress proxy: `worker/src/prepare.rs`) against the unconfined `uv sync` the worker ran
//! before (as root, in the worker's own environment and network), in the same run.
//!
//! Two real projects: `tests/plugins/sdk-python` (laid out like the SDK's examples: a hatchling back-end fetched
//! from the package index) and `tests/plugins/hostile-build` (an in-tree back-end and a vendored sdist
//! dependency: no network). Each round, each project is copied afresh (so nothing is prepared yet) and prepared
//! both ways, the two alternated; both start with an empty `uv` cache (the confined build's cache is its TMPDIR,
//! wiped after every build, so the unconfined baseline gets a fresh cache too). Printed: the median of each, the
//! ratio, and the size of the environment made (what shipping it inside a published version would add).
//!
//! Needs root (cgroups, namespaces, a build uid) and `./.tools/uv/bin/uv` (`scripts/test.sh` installs it). Run:
//! `cargo bench -p fleet-benches --bench prepare`.
#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::expect_used)]

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fleet_worker::catalogue::{Catalogue, LoadOptions, Runner, UV_VENV_DIR};
use fleet_worker::prepare::Preparations;

/// Rounds per project (each prepares the project once each way).
const ROUNDS: usize = 5;

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap().flatten() {
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// The project `name` as an install of a catalogue: the SDK example as it is, the hostile package with its
/// targets (nothing to try) and its vendored sdist.
fn project(name: &str, catalogue: &Path) {
    let fixture = fleet_e2e::workspace_root().join("tests/plugins").join(name);
    let dir = catalogue.join(name);
    copy_dir(&fixture, &dir);
    if name == "hostile-build" {
        let targets = br#"{"read": [], "list": [], "write": [], "connect": []}"#;
        std::fs::write(dir.join("targets.json"), targets).unwrap();
        let dep = dir.join("dep");
        std::fs::copy(dir.join("hostile_common.py"), dep.join("hostile_common.py")).unwrap();
        std::fs::write(dep.join("targets.json"), targets).unwrap();
        std::fs::write(
            dep.join("PKG-INFO"),
            "Metadata-Version: 2.1\nName: hostile-dep\nVersion: 1.0.0\n",
        )
        .unwrap();
        std::fs::create_dir(dir.join("vendor")).unwrap();
        let tar = std::process::Command::new("tar")
            .arg("-czf")
            .arg(dir.join("vendor/hostile_dep-1.0.0.tar.gz"))
            .arg("--transform=s,^dep,hostile_dep-1.0.0,")
            .arg("-C")
            .arg(&dir)
            .arg("dep")
            .status()
            .unwrap();
        assert!(tar.success());
        std::fs::remove_dir_all(&dep).unwrap();
    }
}

/// `uv sync` as the worker ran it before: as this process, in its environment, with a fresh cache.
fn unconfined(uv: &Path, dir: &Path, cache: &Path) -> Duration {
    let started = Instant::now();
    let out = std::process::Command::new(uv)
        .args(["sync", "--project"])
        .arg(dir)
        .args(["--no-dev", "--python", "/usr/bin/python3"])
        .current_dir(dir)
        .env("UV_PROJECT_ENVIRONMENT", dir.join(UV_VENV_DIR))
        .env("UV_LINK_MODE", "copy")
        .env("UV_CACHE_DIR", cache)
        .output()
        .unwrap();
    let took = started.elapsed();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    took
}

fn bytes_under(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let meta = entry.metadata().unwrap();
            if meta.is_dir() {
                stack.push(entry.path());
            } else {
                total += meta.len();
            }
        }
    }
    total
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let uv_dir = fleet_e2e::workspace_root().join(".tools/uv/bin");
    let uv = uv_dir.join("uv");
    assert!(
        uv.is_file(),
        "scripts/test.sh installs uv into {}",
        uv_dir.display()
    );
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let _inside = runtime.enter();
    let mut config = fleet_e2e::worker::test_config("bench-prepare");
    config.preparation.allow_cidrs = fleet_e2e::worker::index_host_ranges();
    let w = fleet_e2e::worker::TestWorker::start(config, &[]);
    let base = tempfile::Builder::new()
        .prefix("fleet-bench-prepare-")
        .tempdir_in("/var/tmp")
        .unwrap();
    std::fs::set_permissions(base.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let opts = LoadOptions::with_search_path([uv_dir.as_path(), Path::new("/usr/bin")])
        .with_runner(Runner::of(&w.config));
    let preparations = std::sync::Arc::new(Preparations::default());
    println!(
        "project          unconfined (p50)   confined (p50)   confined/unconfined   environment (files)"
    );
    for name in ["sdk-python", "hostile-build"] {
        let (mut plain, mut confined, mut size) = (Vec::new(), Vec::new(), 0);
        for round in 0..ROUNDS {
            let plain_dir: PathBuf = base.path().join(format!("plain-{name}-{round}"));
            project(name, &plain_dir);
            let cache = base.path().join(format!("cache-{name}-{round}"));
            plain.push(unconfined(&uv, &plain_dir.join(name), &cache));

            let catalogue = base.path().join(format!("confined-{name}-{round}"));
            project(name, &catalogue);
            let (loaded, problems) = Catalogue::load(&catalogue, &opts).unwrap();
            assert!(problems.is_empty(), "{problems:?}");
            let install = loaded.iter().next().unwrap().clone();
            let started = Instant::now();
            runtime
                .block_on(preparations.ensure(w.pool.context(), &install))
                .unwrap();
            confined.push(started.elapsed());
            size = bytes_under(&install.dir.join(UV_VENV_DIR));
        }
        let (p, c) = (median(plain), median(confined));
        println!(
            "{name:<16} {:>12.0} ms {:>14.0} ms {:>18.2}× {:>14.0} KiB",
            p.as_secs_f64() * 1e3,
            c.as_secs_f64() * 1e3,
            c.as_secs_f64() / p.as_secs_f64(),
            size as f64 / 1024.0
        );
    }
}
