#![allow(clippy::unwrap_used)]

use std::io::Write as _;
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;

use serde_json::json;

use super::*;

/// A tar.gz of `(path, mode, content)` files, written with raw header names (so `..` and absolute names can be
/// built), plus extra raw entries from `extra`.
fn tar_gz(
    files: &[(&str, u32, &[u8])],
    extra: impl FnOnce(&mut tar::Builder<flate2::write::GzEncoder<Vec<u8>>>),
) -> Vec<u8> {
    let enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    let mut b = tar::Builder::new(enc);
    for (path, mode, content) in files {
        let mut h = tar::Header::new_gnu();
        raw_name(&mut h, path);
        h.set_size(content.len() as u64);
        h.set_mode(*mode);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_cksum();
        b.append(&h, *content).unwrap();
    }
    extra(&mut b);
    b.into_inner().unwrap().finish().unwrap()
}

fn raw_name(h: &mut tar::Header, name: &str) {
    let gnu = h.as_gnu_mut().unwrap();
    gnu.name = [0; 100];
    gnu.name[..name.len()].copy_from_slice(name.as_bytes());
}

fn link(
    b: &mut tar::Builder<flate2::write::GzEncoder<Vec<u8>>>,
    kind: tar::EntryType,
    name: &str,
    target: &str,
) {
    let mut h = tar::Header::new_gnu();
    raw_name(&mut h, name);
    h.set_entry_type(kind);
    h.set_size(0);
    h.set_mode(0o777);
    h.as_gnu_mut().unwrap().linkname[..target.len()].copy_from_slice(target.as_bytes());
    h.set_cksum();
    b.append(&h, std::io::empty()).unwrap();
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::File::create(&p).unwrap().write_all(bytes).unwrap();
    p
}

fn opts(dir: &Path) -> InstallOptions {
    InstallOptions {
        home: dir.join("home"),
        keep_versions: 1,
        platform_key: "linux-x86_64".into(),
        protected: Vec::new(),
    }
}

fn req(pkg: &Path, tool_id: &str, version: &str) -> InstallRequest {
    InstallRequest {
        package: pkg.to_path_buf(),
        tool_id: Some(tool_id.into()),
        version: Some(version.into()),
        ..InstallRequest::default()
    }
}

const SCRIPT: &[u8] = b"#!/bin/sh\necho hi\n";

#[test]
fn sanitising_follows_the_spec() {
    assert_eq!(sanitize_tool_id("@scope/pkg").unwrap(), "_scope_pkg");
    assert_eq!(sanitize_tool_id("tool-a.b_c").unwrap(), "tool-a.b_c");
    assert!(sanitize_tool_id("").is_err());
    assert!(sanitize_tool_id("../x").is_err());
    assert!(sanitize_tool_id("-rf").is_err());
    assert_eq!(sanitize_version("").unwrap(), "unknown");
    assert_eq!(sanitize_version("v1.2.3").unwrap(), "1.2.3");
    assert_eq!(sanitize_version("1.0/../x").unwrap(), "1.0_.._x");
    assert!(sanitize_version("..").is_err());
}

#[test]
fn platform_assets_resolve_in_the_spec_order() {
    let map = |v: serde_json::Value| v.as_object().unwrap().clone();
    let urls = map(json!({
        "linux-x86_64": "https://e/x.tar.gz",
        "linux": "https://e/linux.zip",
        "*": {"url": "https://e/any", "format": "raw"},
    }));
    assert_eq!(resolve_asset(&urls, "linux-amd64").unwrap().key, "linux-x86_64");
    assert_eq!(resolve_asset(&urls, "linux-aarch64").unwrap().format, Format::Zip);
    assert_eq!(resolve_asset(&urls, "darwin-arm64").unwrap().url, "https://e/any");
    let single =
        map(json!({"darwin-arm64": {"url": "https://e/a.tgz", "sha256": "AB".repeat(32), "size": 3}}));
    let a = resolve_asset(&single, "linux-x86_64").unwrap();
    assert_eq!(
        (a.format, a.size, a.sha256.unwrap()),
        (Format::TarGz, Some(3), "ab".repeat(32))
    );
    let two = map(json!({"darwin-arm64": "a", "windows-x86_64": "b"}));
    let e = resolve_asset(&two, "linux-x86_64").unwrap_err().to_string();
    assert_eq!(
        e,
        "No binary available for platform 'linux-x86_64'. Available: darwin-arm64, windows-x86_64"
    );
    assert!(matches!(
        resolve_asset(
            &map(json!({"linux": {"url": "u", "sha256": "xyz"}})),
            "linux-x86_64"
        ),
        Err(InstallError::InvalidSha256(_))
    ));
    assert_eq!(Format::infer("https://h/p.TGZ?sig=1"), Format::TarGz);
    assert_eq!(Format::infer("https://h/tool"), Format::Raw);
}

#[test]
fn a_tar_gz_installs_commits_and_collects_old_versions() {
    let tmp = tempfile::tempdir().unwrap();
    let o = opts(tmp.path());
    let pkg = write(
        tmp.path(),
        "p.tar.gz",
        &tar_gz(&[("bin/tool", 0o700, SCRIPT), ("data/x", 0o600, b"x")], |_| {}),
    );
    let v1 = install(&o, &req(&pkg, "tool", "1.0.0")).unwrap();
    assert_eq!(v1.record.entrypoint.as_deref(), Some("bin/tool"));
    assert!(v1.dir.ends_with("tools/tool/v1.0.0"));
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&v1.dir.join("bin/tool")), 0o755);
    assert_eq!(mode(&v1.dir.join("data/x")), 0o644);
    assert_eq!(mode(&v1.dir), 0o755);
    assert_eq!(current_version(&o, "tool").unwrap().0.version, "1.0.0");
    let exe: serde_json::Value =
        serde_json::from_slice(&std::fs::read(v1.dir.join("executa.json")).unwrap()).unwrap();
    assert_eq!(exe["command"], json!(["./bin/tool"]));
    assert_eq!(
        std::fs::read_link(o.home.join("bin/tool")).unwrap(),
        Path::new("../tools/tool/current/bin/tool")
    );
    // Same bytes again: reused.
    assert!(install(&o, &req(&pkg, "tool", "1.0.0")).unwrap().reused);
    install(&o, &req(&pkg, "tool", "2.0.0")).unwrap();
    let v3 = install(&o, &req(&pkg, "tool", "3.0.0")).unwrap();
    assert_eq!(v3.collected, vec!["v1.0.0".to_string()]);
    // A protected version (still run by draining sessions) survives the collection.
    let mut keep_v2 = o.clone();
    keep_v2.keep_versions = 0;
    keep_v2.protected = vec!["2.0.0".into()];
    assert!(
        install(&keep_v2, &req(&pkg, "tool", "3.0.0"))
            .unwrap()
            .collected
            .is_empty()
    );
    let versions: Vec<String> = installed_versions(&o, "tool")
        .into_iter()
        .map(|r| r.version)
        .collect();
    assert_eq!(versions, ["3.0.0", "2.0.0"]);
    assert!(matches!(
        remove(&o, "tool", Some("3.0.0")),
        Err(InstallError::RemoveCurrent { .. })
    ));
    assert_eq!(remove(&o, "tool", Some("2.0.0")).unwrap(), ["v2.0.0"]);
    remove(&o, "tool", None).unwrap();
    assert!(current_version(&o, "tool").is_none());
}

#[test]
fn verification_failures_commit_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let o = opts(tmp.path());
    let pkg = write(
        tmp.path(),
        "p.tar.gz",
        &tar_gz(&[("bin/tool", 0o755, SCRIPT)], |_| {}),
    );
    let mut r = req(&pkg, "tool", "1");
    r.expected_size = Some(1);
    assert!(matches!(
        install(&o, &r),
        Err(InstallError::SizeMismatch { expected: 1, .. })
    ));
    r.expected_size = None;
    r.expected_sha256 = Some("0".repeat(64));
    assert!(matches!(
        install(&o, &r),
        Err(InstallError::Sha256Mismatch { .. })
    ));
    assert!(!o.tool_dir("tool").exists());
}

fn unsafe_reason(o: &InstallOptions, pkg: &Path) -> UnsafeReason {
    match install(o, &req(pkg, "evil", "1")) {
        Err(InstallError::UnsafeMember { reason, .. }) => reason,
        other => panic!("expected an unsafe member, got {other:?}"),
    }
}

#[test]
fn every_zip_slip_form_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let o = opts(tmp.path());
    let cases: Vec<(Vec<u8>, UnsafeReason)> = vec![
        (
            tar_gz(&[("../evil", 0o755, SCRIPT)], |_| {}),
            UnsafeReason::ParentDir,
        ),
        (
            tar_gz(&[("/tmp/evil", 0o755, SCRIPT)], |_| {}),
            UnsafeReason::Absolute,
        ),
        (
            tar_gz(&[], |b| {
                link(b, tar::EntryType::Symlink, "bin/evil", "../../../etc/passwd")
            }),
            UnsafeReason::LinkEscapes("../../../etc/passwd".into()),
        ),
        (
            tar_gz(&[], |b| link(b, tar::EntryType::Link, "bin/evil", "/etc/passwd")),
            UnsafeReason::HardLinkEscapes("/etc/passwd".into()),
        ),
        (
            tar_gz(&[], |b| link(b, tar::EntryType::Char, "dev/null", "")),
            UnsafeReason::DeviceFile,
        ),
        (
            tar_gz(&[("bin/tool", 0o755, SCRIPT)], |b| {
                link(b, tar::EntryType::Symlink, "up", ".");
                link(b, tar::EntryType::Symlink, "esc", "up/..");
            }),
            UnsafeReason::ParentDir,
        ),
    ];
    for (i, (bytes, want)) in cases.into_iter().enumerate() {
        let pkg = write(tmp.path(), &format!("evil{i}.tar.gz"), &bytes);
        let got = unsafe_reason(&o, &pkg);
        // The lexical check catches `up/..` as a link escaping through `..` only after resolution: either
        // refusal is right; the others must be exact.
        if i == 5 {
            assert!(
                matches!(got, UnsafeReason::LinkEscapes(_) | UnsafeReason::ParentDir),
                "{got:?}"
            );
        } else {
            assert_eq!(got, want, "case {i}");
        }
    }
    // A write through a link inside the archive.
    let pkg = write(
        tmp.path(),
        "through.tar.gz",
        &tar_gz(&[("d/x", 0o644, b"x")], |b| {
            link(b, tar::EntryType::Symlink, "l", "d");
            let mut h = tar::Header::new_gnu();
            raw_name(&mut h, "l/y");
            h.set_size(1);
            h.set_mode(0o644);
            h.set_cksum();
            b.append(&h, &b"y"[..]).unwrap();
        }),
    );
    assert_eq!(unsafe_reason(&o, &pkg), UnsafeReason::ThroughLink);
    assert!(!o.tool_dir("evil").exists());
    let leftovers: Vec<_> = std::fs::read_dir(o.tools_dir()).unwrap().flatten().collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn entrypoint_rules() {
    let tmp = tempfile::tempdir().unwrap();
    let o = opts(tmp.path());
    // No executable at all.
    let pkg = write(
        tmp.path(),
        "none.tar.gz",
        &tar_gz(&[("README", 0o644, b"r")], |_| {}),
    );
    assert!(matches!(
        install(&o, &req(&pkg, "t", "1")),
        Err(InstallError::NoEntrypoint(_))
    ));
    // Two candidates: the first in byte order, with a warning.
    let pkg = write(
        tmp.path(),
        "two.tar.gz",
        &tar_gz(
            &[("bin/zeta", 0o755, SCRIPT), ("bin/alpha", 0o755, SCRIPT)],
            |_| {},
        ),
    );
    let two = install(&o, &req(&pkg, "t", "1")).unwrap();
    assert_eq!(two.record.entrypoint.as_deref(), Some("bin/alpha"));
    assert_eq!(two.record.warnings.len(), 1);
    // The per-platform map of manifest.json beats bin/{name}.
    let manifest = serde_json::to_vec(&json!({"name": "t", "version": "2.1",
        "runtime": {"binary": {"entrypoint": {"default": "bin/t", "linux": "linux/run", "darwin-arm64": "mac/run"}}}}))
    .unwrap();
    let pkg = write(
        tmp.path(),
        "map.zip",
        &zip_of(&[
            ("manifest.json", 0o644, &manifest),
            ("bin/t", 0o755, SCRIPT),
            ("linux/run", 0o644, SCRIPT),
        ]),
    );
    let mut r = req(&pkg, "t", "x");
    r.version = None;
    let m = install(&o, &r).unwrap();
    assert_eq!(
        (m.record.entrypoint.as_deref(), m.record.version.as_str()),
        (Some("linux/run"), "2.1")
    );
    assert_eq!(
        std::fs::metadata(m.dir.join("linux/run"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o755
    );
    // The asset's entrypoint beats everything; a missing one is a clear error.
    r.entrypoint = Some("bin/t".into());
    r.version = Some("2.2".into());
    assert_eq!(
        install(&o, &r).unwrap().record.entrypoint.as_deref(),
        Some("bin/t")
    );
    r.entrypoint = Some("bin/missing".into());
    r.version = Some("2.3".into());
    assert!(matches!(install(&o, &r), Err(InstallError::BadEntrypoint { .. })));
    // A raw binary lands as bin/{tool_id}.
    let raw = write(tmp.path(), "tool", SCRIPT);
    let mut r = req(&raw, "rawtool", "1");
    r.format = Some(Format::Raw);
    assert_eq!(
        install(&o, &r).unwrap().record.entrypoint.as_deref(),
        Some("bin/rawtool")
    );
}

fn zip_of(files: &[(&str, u32, &[u8])]) -> Vec<u8> {
    let mut w = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    for (name, mode, bytes) in files {
        let o = zip::write::SimpleFileOptions::default().unix_permissions(*mode);
        w.start_file(*name, o).unwrap();
        w.write_all(bytes).unwrap();
    }
    w.finish().unwrap().into_inner()
}

#[test]
fn sparse_members_are_extracted_expanded() {
    let tmp = tempfile::tempdir().unwrap();
    let o = opts(tmp.path());
    // A file with a hole, archived by the tar crate's builder (which writes GNU sparse entries by default).
    let src = tmp.path().join("src");
    std::fs::create_dir_all(src.join("bin")).unwrap();
    let exe = src.join("bin/sparse");
    {
        let mut f = std::fs::File::create(&exe).unwrap();
        f.write_all(SCRIPT).unwrap();
        f.set_len(4 * 1024 * 1024).unwrap();
        std::io::Seek::seek(&mut f, std::io::SeekFrom::End(0)).unwrap();
        f.write_all(b"end").unwrap();
    }
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut b = tar::Builder::new(flate2::write::GzEncoder::new(
        Vec::new(),
        flate2::Compression::fast(),
    ));
    b.append_dir_all(".", &src).unwrap();
    let pkg = write(
        tmp.path(),
        "sparse.tar.gz",
        &b.into_inner().unwrap().finish().unwrap(),
    );
    let installed = install(&o, &req(&pkg, "sparse", "1")).unwrap();
    let bytes = std::fs::read(installed.dir.join("bin/sparse")).unwrap();
    assert_eq!(bytes.len(), 4 * 1024 * 1024 + 3);
    assert!(bytes.starts_with(SCRIPT) && bytes.ends_with(b"end"));
}

/// A package's own executa.json names worker variables and raises every limit: the installed executa.json has
/// no `env`, the install says what it dropped, and the loaded install passes nothing through and only lowers.
#[test]
fn a_package_can_neither_pass_worker_env_nor_raise_its_limits() {
    let tmp = tempfile::tempdir().unwrap();
    let o = opts(tmp.path());
    let executa = json!({
        "tool_id": "greedy",
        "type": "binary",
        "env": ["FLEET_LLM_API_KEY", "AWS_SECRET_ACCESS_KEY"],
        "limits": {"memory_bytes": 1_u64 << 40, "pids_max": 1_000_000, "cpu_millis": 2},
        "idle_timeout_secs": 86_400,
    });
    let executa = serde_json::to_vec(&executa).unwrap();
    let pkg = write(
        tmp.path(),
        "p.tar.gz",
        &tar_gz(
            &[("bin/greedy", 0o700, SCRIPT), ("executa.json", 0o600, &executa)],
            |_| {},
        ),
    );
    let installed = install(&o, &req(&pkg, "greedy", "1.0.0")).unwrap();
    let warnings = installed.record.warnings.join("\n");
    assert!(
        warnings.contains("dropped `env` (2 variable name(s))"),
        "{warnings}"
    );
    assert!(warnings.contains("only lower the worker's limits"), "{warnings}");
    assert!(
        !warnings.contains("FLEET_LLM_API_KEY"),
        "names are the package's: {warnings}"
    );
    let written: serde_json::Value =
        serde_json::from_slice(&std::fs::read(installed.dir.join("executa.json")).unwrap()).unwrap();
    assert!(written.get("env").is_none(), "{written}");

    let loaded =
        crate::catalogue::load_dir(&installed.dir, &crate::catalogue::LoadOptions::from_env()).unwrap();
    assert!(loaded.packaged);
    assert!(loaded.env.is_empty());
    let base = crate::config::ResourceLimits::default();
    let effective = loaded.effective_limits(base);
    assert_eq!(effective.memory_bytes, base.memory_bytes, "not raised");
    assert_eq!(effective.pids_max, base.pids_max, "not raised");
    assert_eq!(effective.cpu_millis, 2, "lowered");
    // Its sessions' idle timeout likewise: never longer than the worker's, shorter when it asks.
    let day = std::time::Duration::from_secs(86_400);
    let half_hour = std::time::Duration::from_secs(1_800);
    assert_eq!(
        loaded.effective_idle_timeout(half_hour),
        half_hour,
        "not lengthened"
    );
    assert_eq!(loaded.effective_idle_timeout(2 * day), day, "shortened");

    // An older install whose executa.json still names variables: ignored at load as well.
    let mut legacy = written.clone();
    legacy["env"] = json!(["FLEET_LLM_API_KEY"]);
    std::fs::write(
        installed.dir.join("executa.json"),
        serde_json::to_vec(&legacy).unwrap(),
    )
    .unwrap();
    let loaded =
        crate::catalogue::load_dir(&installed.dir, &crate::catalogue::LoadOptions::from_env()).unwrap();
    assert!(loaded.env.is_empty());

    // The operator's own catalogue entry (no INSTALL.json) may raise and pass variables.
    std::fs::remove_file(installed.dir.join(INSTALL_JSON)).unwrap();
    let operator =
        crate::catalogue::load_dir(&installed.dir, &crate::catalogue::LoadOptions::from_env()).unwrap();
    assert!(!operator.packaged);
    assert_eq!(operator.env, ["FLEET_LLM_API_KEY"]);
    assert_eq!(operator.effective_limits(base).pids_max, 1_000_000);
    assert_eq!(operator.effective_idle_timeout(half_hour), day);
}
