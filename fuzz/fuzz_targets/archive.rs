//! A plugin package through the worker's whole install pipeline (`fleet_worker::install::install`: zip-slip-safe
//! extraction, `manifest.json` / `executa.json`, entrypoint, commit) into a fresh home in a temporary directory.
//! The first byte picks the format: a tar the harness gzips (so mutations reach the tar parser), raw `.tar.gz`
//! bytes, a zip, a raw executable.
//!
//! Checked: nothing panics, and nothing is written outside the home: the home sits twelve directories deep in
//! the temporary directory, which must hold nothing else afterwards; no member with an absolute name appears
//! where it names; every symbolic link under the home that resolves stays inside it.
#![no_main]

use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::io::{Read, Write as _};
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use fleet_proto::admin::plugins::Format;
use fleet_worker::install::{InstallOptions, InstallRequest, install};
use libfuzzer_sys::fuzz_target;

const DEPTH: usize = 12;

struct Scene {
    /// Holds only `pkg` and the chain of directories down to the home.
    _base: tempfile::TempDir,
    base: PathBuf,
    package: PathBuf,
    home: PathBuf,
    /// Every path allowed besides what is under the home.
    allowed: BTreeSet<PathBuf>,
}

fn scene() -> &'static Scene {
    static SCENE: OnceLock<Scene> = OnceLock::new();
    SCENE.get_or_init(|| {
        let dir = tempfile::Builder::new()
            .prefix("fleet-fuzz-archive-")
            .tempdir()
            .expect("temporary directory");
        let base = dir.path().canonicalize().expect("canonical base");
        let mut allowed = BTreeSet::new();
        let mut home = base.clone();
        for i in 0..DEPTH {
            home.push(format!("d{i}"));
            allowed.insert(home.clone());
        }
        std::fs::create_dir_all(&home).expect("home's parents");
        home.push("home");
        let package = base.join("pkg");
        allowed.insert(package.clone());
        Scene {
            _base: dir,
            base,
            package,
            home,
            allowed,
        }
    })
}

/// The member names of the archive that are absolute paths.
fn absolute_members(format: Format, package: &[u8]) -> Vec<PathBuf> {
    let mut names = Vec::new();
    match format {
        Format::TarGz => {
            let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(package));
            if let Ok(entries) = tar.entries() {
                for entry in entries.take(10_000) {
                    let Ok(entry) = entry else { break };
                    names.push(PathBuf::from(OsStr::from_bytes(&entry.path_bytes())));
                }
            }
        }
        Format::Zip => {
            if let Ok(zip) = zip::ZipArchive::new(std::io::Cursor::new(package)) {
                names.extend(zip.file_names().map(PathBuf::from));
            }
        }
        Format::Raw => {}
    }
    names.retain(|n| n.is_absolute());
    names
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        out.push(path.clone());
        if is_dir {
            walk(&path, out);
        }
    }
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(bytes).expect("gzip in memory");
    gz.finish().expect("gzip in memory")
}

fuzz_target!(|data: &[u8]| {
    let Some((which, bytes)) = data.split_first() else {
        return;
    };
    let (format, package) = match which % 4 {
        0 => (Format::TarGz, gzip(bytes)),
        1 => (Format::TarGz, bytes.to_vec()),
        2 => (Format::Zip, bytes.to_vec()),
        _ => (Format::Raw, bytes.to_vec()),
    };
    let s = scene();
    let absolute: Vec<(PathBuf, bool)> = absolute_members(format, &package)
        .into_iter()
        .map(|p| {
            let e = p.symlink_metadata().is_ok();
            (p, e)
        })
        .collect();
    std::fs::write(&s.package, &package).expect("write the package");
    let opts = InstallOptions::new(&s.home);
    let req = InstallRequest {
        package: s.package.clone(),
        format: Some(format),
        tool_id: (format == Format::Raw).then(|| "fuzzed".to_owned()),
        ..InstallRequest::default()
    };
    let result = install(&opts, &req);

    let mut seen = Vec::new();
    walk(&s.base, &mut seen);
    for path in &seen {
        assert!(
            s.allowed.contains(path) || path.starts_with(&s.home),
            "written outside the home: {} ({result:?})",
            path.display()
        );
    }
    for (path, existed) in &absolute {
        assert!(
            *existed || path.symlink_metadata().is_err(),
            "an absolute member was written: {}",
            path.display()
        );
    }
    let home = s.home.canonicalize().ok();
    for path in seen.iter().filter(|p| p.starts_with(&s.home)) {
        if path.symlink_metadata().is_ok_and(|m| m.file_type().is_symlink())
            && let (Ok(target), Some(home)) = (path.canonicalize(), &home)
        {
            assert!(
                target.starts_with(home),
                "a link leads out of the home: {} -> {}",
                path.display(),
                target.display()
            );
        }
    }
    if let Ok(installed) = &result {
        let mut record = String::new();
        let _ = std::fs::File::open(installed.dir.join("INSTALL.json"))
            .and_then(|mut f| f.read_to_string(&mut record));
        assert!(!record.is_empty(), "a committed install has its INSTALL.json");
    }
    std::fs::remove_dir_all(&s.home).ok();
});
