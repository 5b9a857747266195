//! Every `*.rs` file at the top of `tests/` is a test target of exactly one of the two test packages:
//! `fleet-e2e` (`tests/Cargo.toml`: tests that run fleet internals in-process) or `fleet-e2e-client`
//! (`tests/client/Cargo.toml`: tests that drive a fleet from outside and never link the `fleet` crate). `tests/` is
//! not cargo's own `tests/` directory (the files sit at the package root beside `Cargo.toml`), so cargo does not
//! discover them and a file missing from `[[test]]` would silently never run. This test lists the files and both
//! manifests' targets and fails on a difference.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::path::Path;

/// The `[[test]]` paths of the manifest in `dir`, relative to `tests/`.
fn targets(dir: &Path, prefix: &str) -> Vec<String> {
    let manifest: toml::Table = std::fs::read_to_string(dir.join("Cargo.toml"))
        .unwrap()
        .parse()
        .unwrap();
    manifest["test"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            let path = t["path"].as_str().unwrap();
            path.strip_prefix(prefix).unwrap_or(path).to_owned()
        })
        .collect()
}

#[test]
fn every_test_file_is_a_test_target() {
    let client = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = client.parent().unwrap();
    let files: BTreeSet<String> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.ends_with(".rs"))
        .collect();
    let listed: Vec<String> = targets(dir, "")
        .into_iter()
        .chain(targets(client, "../"))
        .collect();
    let targets: BTreeSet<String> = listed.iter().cloned().collect();
    let missing: Vec<&String> = files.difference(&targets).collect();
    let stale: Vec<&String> = targets.difference(&files).collect();
    assert!(
        missing.is_empty() && stale.is_empty(),
        "tests/Cargo.toml or tests/client/Cargo.toml must list every test file as a [[test]] target: not listed \
         {missing:?}, listed but absent {stale:?}"
    );
    assert_eq!(
        listed.len(),
        targets.len(),
        "a test file is a target of both packages: {listed:?}"
    );
}
