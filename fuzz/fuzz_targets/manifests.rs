//! A plugin's manifests, in both dialects; the first byte picks which:
//! - `executa.json` of an install directory, as the worker's catalogue loads it
//!   (`fleet_worker::catalogue::load_dir`, from a temporary directory);
//! - the Executa `describe` manifest (`fleet_proto::executa::manifest::Manifest::from_value`);
//! - the Animus `--manifest` output (`fleet_worker::animus::detect::parse_manifest`).
//!
//! Checked: nothing panics; a valid manifest's tools are found by name; an accepted `executa.json` names a
//! tool id.
#![no_main]

use std::sync::OnceLock;

use fleet_proto::executa::manifest::Manifest;
use fleet_worker::catalogue::{LoadOptions, load_dir};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fn install_dir() -> &'static tempfile::TempDir {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("temporary directory"))
}

fuzz_target!(|data: &[u8]| {
    let Some((which, bytes)) = data.split_first() else {
        return;
    };
    match which % 3 {
        0 => {
            let dir = install_dir().path();
            std::fs::write(dir.join(fleet_worker::catalogue::MANIFEST_FILE), bytes)
                .expect("write executa.json");
            let opts = LoadOptions::with_search_path(["/usr/local/bin", "/usr/bin", "/bin"]);
            if let Ok(install) = load_dir(dir, &opts) {
                assert!(!install.tool_id.is_empty(), "an install has a tool id");
            }
        }
        1 => {
            if let Ok(value) = serde_json::from_slice::<Value>(bytes)
                && let Ok(valid) = Manifest::from_value(&value)
            {
                for tool in &valid.manifest.tools {
                    assert!(
                        valid.manifest.tool(&tool.name).is_some(),
                        "a declared tool is found"
                    );
                    let _ = (tool.input_schema(), tool.timeout());
                    let mut args = serde_json::Map::new();
                    tool.apply_defaults(&mut args);
                }
            }
        }
        _ => {
            let _ = fleet_worker::animus::detect::parse_manifest(bytes);
        }
    }
});
