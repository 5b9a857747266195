//! The fields of an app manifest (`manifest.json`) that decide its host-API ACL (spec §10.1): the declared
//! Executas (`required_executas`, `optional_executas`: entries `{"tool_id": …}` or bare strings) and
//! `ui.host_api` (namespace → allowed methods; for `tools`, `tool_id` patterns). Every other field is ignored.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value;

/// The ACL part of an app manifest.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AppManifestAcl {
    /// `required_executas[].tool_id`.
    pub required: Vec<String>,
    /// `optional_executas[].tool_id`.
    pub optional: Vec<String>,
    /// `ui.host_api`: namespace → entries.
    pub host_api: BTreeMap<String, Vec<String>>,
}

/// Why a manifest's ACL fields cannot be read.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("app manifest: {0}")]
pub struct AppManifestError(String);

#[derive(Deserialize)]
#[serde(untagged)]
enum ExecutaRef {
    Id(String),
    Entry { tool_id: String },
}

#[derive(Deserialize, Default)]
struct Ui {
    #[serde(default)]
    host_api: BTreeMap<String, Vec<String>>,
}

#[derive(Deserialize)]
struct Raw {
    #[serde(default)]
    required_executas: Vec<ExecutaRef>,
    #[serde(default)]
    optional_executas: Vec<ExecutaRef>,
    #[serde(default)]
    ui: Option<Ui>,
}

impl AppManifestAcl {
    /// Reads the ACL fields of a manifest.
    pub fn from_json(manifest: &Value) -> Result<AppManifestAcl, AppManifestError> {
        let raw = Raw::deserialize(manifest).map_err(|e| AppManifestError(e.to_string()))?;
        let ids = |refs: Vec<ExecutaRef>| {
            refs.into_iter()
                .map(|r| match r {
                    ExecutaRef::Id(id) | ExecutaRef::Entry { tool_id: id } => id,
                })
                .collect()
        };
        Ok(AppManifestAcl {
            required: ids(raw.required_executas),
            optional: ids(raw.optional_executas),
            host_api: raw.ui.unwrap_or_default().host_api,
        })
    }
}

/// Whether one `ui.host_api.tools` entry, as a window token carries it, admits the plugin `tool_id` (spec §10.1):
/// `*`; `<prefix>:*` (the host that minted the token resolved `required:*` / `optional:*`); the bare `tool_id`; or
/// `<prefix>:<tool_id>` with a one-segment prefix — `required:bundled:x` admits `bundled:x` and never `x`.
pub fn entry_admits(entry: &str, tool_id: &str) -> bool {
    if tool_id.is_empty() {
        return false;
    }
    if entry == "*" || entry == tool_id {
        return true;
    }
    entry
        .split_once(':')
        .is_some_and(|(prefix, rest)| !prefix.is_empty() && (rest == "*" || rest == tool_id))
}

/// Whether the allow-list `tools` (a window token's, or a delegation's made under one) admits `tool_id`: absent or
/// empty admits every tool (the spec's optional narrowing, §16 A-61).
pub fn list_admits(tools: Option<&[String]>, tool_id: &str) -> bool {
    match tools {
        None | Some([]) => true,
        Some(list) => list.iter().any(|e| entry_admits(e, tool_id)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn allow_list_entries_admit_only_what_they_name() {
        assert!(entry_admits("*", "echo"));
        assert!(entry_admits("required:*", "echo"));
        assert!(entry_admits("optional:*", "bundled:x"));
        assert!(entry_admits("echo", "echo"));
        assert!(entry_admits("required:echo", "echo"));
        assert!(entry_admits(
            "required:bundled:long-task-engine",
            "bundled:long-task-engine"
        ));
        // The suffix form no longer admits the last segment alone.
        assert!(!entry_admits(
            "required:bundled:long-task-engine",
            "long-task-engine"
        ));
        assert!(!entry_admits("required:bundled:x", "x"));
        assert!(!entry_admits("echo", "echo2"));
        assert!(!entry_admits("required:echo", "xecho"));
        assert!(!entry_admits("required:echo", "other"));
        assert!(!entry_admits("a:b:*", "echo"));
        assert!(!entry_admits(":echo", "echo"));
        assert!(!entry_admits(":*", "echo"));
        assert!(!entry_admits("*", ""));
        assert!(list_admits(None, "x"));
        assert!(list_admits(Some(&[]), "x"));
        assert!(!list_admits(Some(&["y".to_owned()]), "x"));
    }

    #[test]
    fn reads_the_documented_shapes() {
        let m = AppManifestAcl::from_json(&json!({
            "schema": 2,
            "required_executas": [{"tool_id": "tool-a"}],
            "optional_executas": ["tool-b"],
            "ui": {"bundle": {}, "host_api": {"tools": ["required:*"], "storage": ["get"]}}
        }));
        assert_eq!(
            m,
            Ok(AppManifestAcl {
                required: vec!["tool-a".into()],
                optional: vec!["tool-b".into()],
                host_api: BTreeMap::from([
                    ("storage".into(), vec!["get".into()]),
                    ("tools".into(), vec!["required:*".into()]),
                ]),
            })
        );
        assert!(AppManifestAcl::from_json(&json!({"required_executas": [1]})).is_err());
        assert_eq!(
            AppManifestAcl::from_json(&json!({})),
            Ok(AppManifestAcl::default())
        );
    }
}
