//! The Helm chart `deploy/helm/cloud-agents`, validated without a cluster: `tests/helm/validate.py` lints and
//! renders it (PyPI `helm-python-sdk`, the Helm v4 SDK) for the default values and every `ci/*-values.yaml`, runs
//! every manifest through `kubernetes-validate --strict`, and checks that bad values are refused. This test runs
//! it, then reads the rendered objects (the script writes each value set as JSON) and asserts the fields that
//! matter: image, args, probes, security contexts, grace period, and the schema's messages.
//!
//! The Python packages come from `scripts/requirements-test.txt` (`scripts/test.sh` installs them into `./.venv`).
//! When they are missing the test fails saying so: it never passes without having run.

// Test code: helpers panic on purpose when the system under test misbehaves.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use fleet_e2e::workspace_root;
use serde_json::Value;

fn python(root: &Path) -> PathBuf {
    let venv = root.join(".venv/bin/python");
    if venv.is_file() {
        venv
    } else {
        PathBuf::from("python3")
    }
}

/// Runs the validator once into a fresh directory and returns it.
fn validate() -> (tempfile::TempDir, Value) {
    let root = workspace_root();
    let out = tempfile::tempdir().expect("tempdir");
    let output = Command::new(python(&root))
        .arg(root.join("tests/helm/validate.py"))
        .arg("--out")
        .arg(out.path())
        .current_dir(&root)
        .output()
        .expect("run tests/helm/validate.py");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "tests/helm/validate.py failed ({}); install its packages with \
         `.venv/bin/pip install -r scripts/requirements-test.txt`\nstdout:\n{stdout}\nstderr:\n{stderr}",
        output.status
    );
    let summary = std::fs::read(out.path().join("summary.json")).expect("summary.json");
    (out, serde_json::from_slice(&summary).expect("summary JSON"))
}

fn objects(out: &Path, variant: &str) -> Vec<Value> {
    let text = std::fs::read(out.join(format!("{variant}.json"))).expect("rendered variant");
    serde_json::from_slice::<Value>(&text)
        .expect("JSON")
        .as_array()
        .expect("list")
        .clone()
}

fn find<'a>(objs: &'a [Value], kind: &str, name_suffix: &str) -> &'a Value {
    objs.iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"].as_str().unwrap().ends_with(name_suffix))
        .unwrap_or_else(|| panic!("no {kind} named …{name_suffix}"))
}

fn container(deployment: &Value) -> &Value {
    &deployment["spec"]["template"]["spec"]["containers"][0]
}

fn args(c: &Value) -> Vec<&str> {
    c["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect()
}

fn env<'a>(c: &'a Value, name: &str) -> Option<&'a str> {
    c["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == name)
        .and_then(|e| e["value"].as_str())
}

#[test]
fn chart_lints_renders_validates_and_has_the_key_fields() {
    let (out, summary) = validate();
    let out = out.path();

    // What the validator covered: the default values and at least three ci variants, every manifest strictly.
    let variants = summary["variants"].as_object().unwrap();
    assert!(
        variants.contains_key("default") && variants.len() >= 4,
        "{variants:?}"
    );
    assert!(
        summary["manifests_validated"].as_u64().unwrap() >= 30,
        "{summary}"
    );
    assert_eq!(summary["errors"].as_array().unwrap().len(), 0, "{summary}");

    // Default values.
    let objs = objects(out, "default");
    let front = find(&objs, "Deployment", "-front");
    let worker = find(&objs, "Deployment", "-worker");
    for (d, port_name, replicas) in [(front, "http", 2), (worker, "metrics", 2)] {
        let c = container(d);
        assert_eq!(
            c["image"], "ghcr.io/cloud-agents/fleet:0.1.0",
            "image defaults to appVersion"
        );
        assert_eq!(d["spec"]["replicas"], replicas);
        assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
        assert_eq!(c["livenessProbe"]["httpGet"]["port"], port_name);
        assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
        assert_eq!(c["readinessProbe"]["httpGet"]["port"], port_name);
        assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
        assert_eq!(env(c, "FLEET_NATS_URL"), Some("nats://nats:4222"));
        assert_eq!(env(c, "FLEET_LOG"), Some("info"));
    }

    // The front: non-root, nothing added, seccomp, the generated HS256 key from a Secret.
    let c = container(front);
    let sc = &c["securityContext"];
    assert_eq!(sc["runAsNonRoot"], true);
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["capabilities"]["drop"], serde_json::json!(["ALL"]));
    assert!(sc["capabilities"].get("add").is_none());
    assert_eq!(sc["seccompProfile"]["type"], "RuntimeDefault");
    let a = args(c);
    assert_eq!(&a[..2], ["up", "--nats-url=$(FLEET_NATS_URL)"]);
    assert!(
        a.contains(&"--http=0.0.0.0:8080") && a.contains(&"--isolation=none"),
        "{a:?}"
    );
    assert!(
        a.contains(&"--jwt-hs256-secret-file=/etc/cloud-agents/keys/generated-hs256"),
        "{a:?}"
    );
    let secret = find(&objs, "Secret", "-jwt");
    assert_eq!(
        secret["data"]["hs256"].as_str().unwrap().len(),
        64,
        "48 random bytes, base64"
    );
    // Operator tokens: a generated secret of their own, never the API key.
    assert!(
        a.contains(&"--operator-jwt-hs256-secret-file=/etc/cloud-agents/keys/generated-operator-hs256"),
        "{a:?}"
    );
    let operator_secret = find(&objs, "Secret", "-operator-jwt");
    assert_eq!(
        operator_secret["data"]["operator-hs256"].as_str().unwrap().len(),
        64,
        "48 random bytes, base64"
    );

    // The worker (default: privileged for cgroup v2 delegation), its args, and a grace period covering the ladder.
    let c = container(worker);
    let a = args(c);
    assert_eq!(a[0], "worker");
    for want in [
        "--nats-url=$(FLEET_NATS_URL)",
        "--worker-id=$(POD_NAME)",
        "--isolation=cgroup",
        "--http=0.0.0.0:9090",
        "--config=/etc/cloud-agents/worker.toml",
    ] {
        assert!(a.contains(&want), "{want} not in {a:?}");
    }
    assert_eq!(c["securityContext"]["privileged"], true);
    assert_eq!(c["securityContext"]["runAsUser"], 0);
    assert!(
        worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            .as_u64()
            .unwrap()
            >= 20
    );
    let toml = find(&objs, "ConfigMap", "-worker")["data"]["worker.toml"]
        .as_str()
        .unwrap();
    assert!(
        toml.contains("shutdown_grace = 5") && toml.contains("mode = \"per_user\""),
        "{toml}"
    );
    assert!(toml.contains("memory_bytes = 536870912"), "{toml}");
    assert_eq!(
        find(&objs, "PodDisruptionBudget", "-worker")["spec"]["maxUnavailable"],
        1
    );
    assert_eq!(
        find(&objs, "PodDisruptionBudget", "-front")["spec"]["minAvailable"],
        1
    );

    // CRI-O variant: not privileged, exactly the six capabilities, the rw-cgroup annotation, KEDA.
    let objs = objects(out, "keda-crio");
    let worker = find(&objs, "Deployment", "-worker");
    let sc = &container(worker)["securityContext"];
    assert_eq!(sc["privileged"], false);
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(sc["seccompProfile"]["type"], "RuntimeDefault");
    assert_eq!(sc["capabilities"]["drop"], serde_json::json!(["ALL"]));
    assert_eq!(
        sc["capabilities"]["add"],
        serde_json::json!(["CHOWN", "DAC_OVERRIDE", "FOWNER", "KILL", "SETGID", "SETUID"])
    );
    assert_eq!(
        worker["spec"]["template"]["metadata"]["annotations"]["io.kubernetes.cri-o.cgroup2-mount-hierarchy-rw"],
        "true"
    );
    assert!(
        worker["spec"].get("replicas").is_none(),
        "the autoscaler owns replicas"
    );
    assert_eq!(
        find(&objs, "ScaledObject", "-worker")["spec"]["triggers"][1]["type"],
        "prometheus"
    );

    // Production variant: explicit keys, HPA with the queued-jobs external metric, monitoring objects.
    let objs = objects(out, "production-hpa");
    let c = container(find(&objs, "Deployment", "-front"));
    assert_eq!(c["image"], "registry.example.com/cloud-agents/fleet:0.1.0");
    let a = args(c);
    assert!(
        a.contains(&"--jwt-hs256-secret-file=/etc/cloud-agents/keys/hs256-1"),
        "{a:?}"
    );
    assert!(
        a.contains(&"--jwt-ed25519-public-key=/etc/cloud-agents/keys/ed25519-0.pem"),
        "{a:?}"
    );
    assert!(
        a.contains(&"--operator-jwt-ed25519-public-key=/etc/cloud-agents/keys/operator-ed25519-0.pem")
            && !a
                .iter()
                .any(|x| x.starts_with("--operator-jwt-hs256-secret-file")),
        "operator keys of their own: {a:?}"
    );
    assert!(
        !objs.iter().any(|o| o["kind"] == "Secret"),
        "no generated key when keys are given"
    );
    assert_eq!(
        env(c, "OTEL_EXPORTER_OTLP_ENDPOINT"),
        Some("http://otel-collector.observability.svc:4317")
    );
    assert_eq!(env(c, "FLEET_JETSTREAM_REPLICAS"), Some("3"));
    let hpa = find(&objs, "HorizontalPodAutoscaler", "-worker");
    assert_eq!(hpa["spec"]["metrics"][0]["resource"]["name"], "cpu");
    assert_eq!(
        hpa["spec"]["metrics"][1]["external"]["metric"]["name"],
        "cloud_agents_jobs_queued"
    );
    let rule = find(&objs, "PrometheusRule", "cloud-agents");
    assert!(rule["spec"]["groups"][0]["rules"].as_array().unwrap().len() >= 7);
    let dash = find(&objs, "ConfigMap", "-dashboard");
    assert_eq!(dash["metadata"]["labels"]["grafana_dashboard"], "1");
    assert_eq!(objs.iter().filter(|o| o["kind"] == "ServiceMonitor").count(), 2);

    // Dev variant: no privileges at all.
    let objs = objects(out, "dev-no-isolation");
    let c = container(find(&objs, "Deployment", "-worker"));
    assert!(args(c).contains(&"--isolation=none"));
    assert_eq!(c["securityContext"]["runAsNonRoot"], true);
    assert!(c["securityContext"]["capabilities"].get("add").is_none());

    // The schema refuses bad values, saying where and why.
    let rejected = summary["rejected"].as_array().unwrap();
    let message = |case: &str| {
        rejected
            .iter()
            .find(|r| r["case"] == case)
            .unwrap_or_else(|| panic!("{case} not rejected"))["message"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let m = message("sandbox mode typo");
    assert!(
        m.contains("/worker/sandbox/mode") && m.contains("'privileged', 'delegatedCgroupRW', 'none'"),
        "{m}"
    );
    assert!(message("unknown key (typo)").contains("'replica' not allowed"));
    assert!(message("public URL without a scheme").contains("/services/publicUrl"));
    assert!(message("grace shorter than the shutdown ladder").contains("shutdown ladder"));
}

/// Front and worker share one link-signing key (download and upload links are signed by workers and served by
/// fronts): a generated, kept Secret by default, the operator's Secret when named; the services TOML and the LLM
/// key are mounted only when configured.
#[test]
fn front_and_worker_share_the_link_signing_key_and_the_services_config() {
    let (out, _) = validate();
    let objs = objects(out.path(), "default");
    let secret = find(&objs, "Secret", "-links");
    assert_eq!(
        secret["metadata"]["annotations"]["helm.sh/resource-policy"],
        "keep"
    );
    for deployment in ["-front", "-worker"] {
        let d = find(&objs, "Deployment", deployment);
        let c = container(d);
        assert!(
            args(c).contains(&"--link-signing-key-file=/var/run/cloud-agents/links/link-signing-key"),
            "{deployment}"
        );
        assert!(
            !args(c).iter().any(|a| a.starts_with("--services-config")),
            "{deployment}"
        );
        let volumes = d["spec"]["template"]["spec"]["volumes"].as_array().unwrap();
        let link = volumes.iter().find(|v| v["name"] == "link-key").unwrap();
        assert_eq!(link["secret"]["secretName"], secret["metadata"]["name"]);
    }
    let objs = objects(out.path(), "production-hpa");
    for deployment in ["-front", "-worker"] {
        let d = find(&objs, "Deployment", deployment);
        let c = container(d);
        assert!(args(c).contains(&"--public-url=https://fleet.example.com"));
        assert!(args(c).contains(&"--services-config=/var/run/cloud-agents/services/services.toml"));
        let volumes = d["spec"]["template"]["spec"]["volumes"].as_array().unwrap();
        let link = volumes.iter().find(|v| v["name"] == "link-key").unwrap();
        assert_eq!(
            link["secret"]["secretName"], "cloud-agents-links",
            "the operator's Secret"
        );
        assert!(volumes.iter().any(|v| v["name"] == "llm-api-key"));
    }
    let config = find(&objs, "ConfigMap", "-services");
    assert!(
        config["data"]["services.toml"]
            .as_str()
            .unwrap()
            .contains("[llm]")
    );
}
