//! What an app manifest's ACL (spec §10.1) would do to a recorded call: `window.*` is always allowed; a
//! `tools.invoke` / `tools.invokeAsync` needs its `tool_id` declared in `required_executas` or
//! `optional_executas` and, when `ui.host_api.tools` is not empty, admitted by one of its entries
//! (`required:*`, `optional:*`, `required:<id>`, `optional:<id>`, the bare id; the empty list is the optional
//! narrowing's "any declared tool", spec §16 A-61); any other namespace needs its method listed in
//! `ui.host_api.<ns>` (or `*`).

use fleet_proto::api::methods;
use fleet_proto::app_manifest::AppManifestAcl;

/// Why `acl` rejects a call of `ns.method` on `tool_id`, or `None` when it allows it (or says nothing about it:
/// a call without a namespace).
pub fn rejection(acl: &AppManifestAcl, ns: &str, method: &str, tool_id: Option<&str>) -> Option<String> {
    match ns {
        "" | "window" => None,
        "tools" => {
            let name = format!("tools.{method}");
            if name != methods::TOOLS_INVOKE && name != methods::TOOLS_INVOKE_ASYNC {
                return None;
            }
            let Some(tool_id) = tool_id else {
                return Some("the call names no tool_id".to_owned());
            };
            let required = acl.required.iter().any(|t| t == tool_id);
            let optional = acl.optional.iter().any(|t| t == tool_id);
            if !required && !optional {
                return Some(format!(
                    "tool_id {tool_id} is not declared in required_executas or optional_executas"
                ));
            }
            let entries = acl.host_api.get("tools").map(Vec::as_slice).unwrap_or_default();
            let admits = |entry: &String| match entry.split_once(':') {
                _ if entry == "*" || entry == tool_id => true,
                Some(("required", "*")) => required,
                Some(("optional", "*")) => optional,
                Some(("required", id)) => required && id == tool_id,
                Some(("optional", id)) => optional && id == tool_id,
                _ => false,
            };
            if entries.is_empty() || entries.iter().any(admits) {
                None
            } else {
                Some(format!("no ui.host_api.tools entry admits tool_id {tool_id}"))
            }
        }
        ns => {
            let listed = acl
                .host_api
                .get(ns)
                .is_some_and(|m| m.iter().any(|m| m == method || m == "*"));
            (!listed).then(|| format!("ui.host_api.{ns} does not list {method}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn acl(tools: &[&str]) -> AppManifestAcl {
        AppManifestAcl {
            required: vec!["tool-a".into(), "bundled:engine".into()],
            optional: vec!["tool-b".into()],
            host_api: BTreeMap::from([
                ("tools".into(), tools.iter().map(|s| (*s).to_owned()).collect()),
                ("storage".into(), vec!["get".into()]),
            ]),
        }
    }

    #[test]
    fn tools_need_a_declaration_and_an_admitting_entry() {
        let invoke = |a: &AppManifestAcl, id: &str| rejection(a, "tools", "invoke", Some(id));
        // Empty host_api.tools: any declared tool.
        assert_eq!(invoke(&acl(&[]), "tool-a"), None);
        assert_eq!(invoke(&acl(&[]), "tool-b"), None);
        assert!(invoke(&acl(&[]), "tool-c").is_some_and(|r| r.contains("not declared")));
        assert_eq!(invoke(&acl(&["required:*"]), "tool-a"), None);
        assert!(invoke(&acl(&["required:*"]), "tool-b").is_some_and(|r| r.contains("no ui.host_api.tools")));
        assert_eq!(invoke(&acl(&["optional:*"]), "tool-b"), None);
        assert_eq!(invoke(&acl(&["required:bundled:engine"]), "bundled:engine"), None);
        assert!(invoke(&acl(&["optional:tool-a"]), "tool-a").is_some());
        assert_eq!(invoke(&acl(&["tool-b"]), "tool-b"), None);
        assert!(rejection(&acl(&["tool-b"]), "tools", "invokeAsync", Some("tool-a")).is_some());
        // Job calls name no tool: the manifest does not gate them by tool.
        assert_eq!(rejection(&acl(&["tool-b"]), "tools", "getJob", None), None);
        assert!(rejection(&acl(&[]), "tools", "invoke", None).is_some());
    }

    #[test]
    fn other_namespaces_need_their_method_listed_and_window_is_always_allowed() {
        assert_eq!(rejection(&acl(&[]), "window", "hello", None), None);
        assert_eq!(rejection(&acl(&[]), "storage", "get", None), None);
        assert!(rejection(&acl(&[]), "storage", "set", None).is_some());
        assert!(rejection(&acl(&[]), "llm", "complete", None).is_some());
        assert_eq!(rejection(&acl(&[]), "", "POST /api/v1/x", None), None);
    }
}
