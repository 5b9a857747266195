//! Every `*.rs` file at the top of `tests/` is a test target of this package: `tests/` is not cargo's own
//! `tests/` directory (the files sit at the package root beside `Cargo.toml`), so cargo does not discover them
//! and a file missing from `[[test]]` would silently never run. This test lists both and fails on a difference.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;

#[test]
fn every_test_file_is_a_test_target() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let files: BTreeSet<String> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.ends_with(".rs"))
        .collect();
    let manifest: toml::Table = std::fs::read_to_string(dir.join("Cargo.toml"))
        .unwrap()
        .parse()
        .unwrap();
    let targets: BTreeSet<String> = manifest["test"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["path"].as_str().unwrap().to_owned())
        .collect();
    let missing: Vec<&String> = files.difference(&targets).collect();
    let stale: Vec<&String> = targets.difference(&files).collect();
    assert!(
        missing.is_empty() && stale.is_empty(),
        "tests/Cargo.toml must list every test file as a [[test]] target: not listed {missing:?}, listed but absent {stale:?}"
    );
}
