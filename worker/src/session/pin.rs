//! A plugin gets what its recorded manifest declares, nothing more.
//!
//! The manifest a session runs with is the plugin's own `describe` answer, given at run time, per (user, tool)
//! process: a plugin could describe itself cleanly to the fleet's internal describe and ask real users' sessions
//! for `GMAIL_ACCESS_TOKEN`. So for every session of a real user the runtime manifest is narrowed to the one the
//! fleet recorded when the version was published or catalogued ([`Recorded`]): credential names, host
//! capabilities and tools it does not list are dropped before anything is minted, looked up or routed. Without a
//! record (none yet, or none readable in time) the plugin gets no credential and no host capability. A session
//! that declared more is counted (`cloud_agents_manifest_drift_total{tool_id}`) and logged with the counts only.

use fleet_proto::executa::manifest::Manifest;

use crate::services::Recorded;

/// What a runtime manifest declared beyond its record, by kind (counts only: the names are the plugin's).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Drift {
    pub(crate) credentials: usize,
    pub(crate) host_capabilities: usize,
    pub(crate) tools: usize,
}

impl Drift {
    /// Whether anything was dropped.
    pub(crate) fn any(self) -> bool {
        self.credentials + self.host_capabilities + self.tools > 0
    }
}

/// `runtime` narrowed to `recorded`, and what was dropped.
pub(crate) fn restrict(mut runtime: Manifest, recorded: &Recorded) -> (Manifest, Drift) {
    let mut drift = Drift::default();
    match recorded {
        Recorded::Unrestricted => {}
        Recorded::Missing => {
            drift.credentials = std::mem::take(&mut runtime.credentials).len();
            drift.host_capabilities = std::mem::take(&mut runtime.host_capabilities).len();
        }
        Recorded::Manifest(record) => {
            let before = runtime.credentials.len();
            runtime
                .credentials
                .retain(|c| record.credentials.iter().any(|r| r.name == c.name));
            drift.credentials = before - runtime.credentials.len();
            let before = runtime.host_capabilities.len();
            runtime
                .host_capabilities
                .retain(|c| record.host_capabilities.contains(c));
            drift.host_capabilities = before - runtime.host_capabilities.len();
            let before = runtime.tools.len();
            runtime
                .tools
                .retain(|t| record.tools.iter().any(|r| r.name == t.name));
            drift.tools = before - runtime.tools.len();
        }
    }
    (runtime, drift)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn declaring(credentials: &[&str], capabilities: &[&str], tools: &[&str]) -> Manifest {
        let v = json!({
            "name": "weather",
            "version": "1.0.0",
            "tools": tools.iter().map(|t| json!({"name": t, "description": "d", "parameters": []})).collect::<Vec<_>>(),
            "credentials": credentials.iter().map(|c| json!({"name": c})).collect::<Vec<_>>(),
            "host_capabilities": capabilities,
        });
        Manifest::from_value(&v).expect("manifest").manifest
    }

    #[test]
    fn what_the_record_does_not_list_is_dropped_and_counted() {
        let record = Recorded::Manifest(Box::new(declaring(&["API_KEY"], &["llm.sample"], &["forecast"])));
        let runtime = declaring(
            &["API_KEY", "GMAIL_ACCESS_TOKEN", "GITHUB_TOKEN"],
            &["llm.sample", "aps.files"],
            &["forecast", "exfiltrate"],
        );
        let (kept, drift) = restrict(runtime, &record);
        let names: Vec<&str> = kept.credentials.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["API_KEY"]);
        assert_eq!(kept.host_capabilities, ["llm.sample"]);
        let tools: Vec<&str> = kept.tools.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(tools, ["forecast"]);
        assert_eq!(
            drift,
            Drift {
                credentials: 2,
                host_capabilities: 1,
                tools: 1
            }
        );
        assert!(drift.any());
    }

    #[test]
    fn a_runtime_manifest_within_its_record_is_kept_whole() {
        let both = declaring(&["API_KEY"], &["llm.sample"], &["forecast"]);
        let record = Recorded::Manifest(Box::new(declaring(
            &["API_KEY", "OTHER"],
            &["llm.sample"],
            &["forecast", "x"],
        )));
        let (kept, drift) = restrict(both.clone(), &record);
        assert_eq!(kept, both);
        assert!(!drift.any());
        let (kept, drift) = restrict(both.clone(), &Recorded::Unrestricted);
        assert_eq!(kept, both);
        assert!(!drift.any());
    }

    #[test]
    fn without_a_record_no_credential_and_no_capability_is_given() {
        let runtime = declaring(&["API_KEY"], &["llm.sample"], &["forecast"]);
        let (kept, drift) = restrict(runtime, &Recorded::Missing);
        assert!(kept.credentials.is_empty() && kept.host_capabilities.is_empty());
        assert_eq!(
            kept.tools.len(),
            1,
            "tools stay: they carry nothing of the user's"
        );
        assert_eq!(
            drift,
            Drift {
                credentials: 1,
                host_capabilities: 1,
                tools: 0
            }
        );
    }
}
