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

use fleet_e2e_client::workspace_root;
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

/// The worker container's whole securityContext in the `capabilities` (default) and `delegatedCgroupRW` modes.
fn least_privilege_worker() -> Value {
    serde_json::json!({
        "privileged": false,
        "allowPrivilegeEscalation": false,
        "runAsUser": 0,
        "runAsNonRoot": false,
        "readOnlyRootFilesystem": true,
        "capabilities": {
            "drop": ["ALL"],
            "add": ["CHOWN", "DAC_OVERRIDE", "FOWNER", "KILL", "NET_ADMIN", "SETGID", "SETUID", "SYS_ADMIN"],
        },
        "seccompProfile": {"type": "RuntimeDefault"},
        "appArmorProfile": {"type": "Unconfined"},
    })
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
    // The per-user storage cap renders as the integer the flag parses (a YAML number is a float to the templates:
    // 2.68435456e+08 would stop the front at its start).
    assert_eq!(env(c, "FLEET_MAX_JOB_BYTES_PER_USER"), Some("268435456"));
    assert_eq!(env(c, "FLEET_JOB_STORE_MAX_BYTES"), Some("0"));
    assert_eq!(
        env(c, "FLEET_PACKAGE_SOURCE_ALLOW"),
        None,
        "public package hosts only"
    );
    assert!(args(c).contains(&"--jwt-max-lifetime-secs=86400"), "{c}");
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

    // The worker (default: the least-privilege `capabilities` mode), its args, and a grace period covering the
    // ladder.
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
    // Not privileged: root with exactly the eight capabilities the sandbox uses, the runtime's seccomp profile,
    // AppArmor unconfined (the worker mounts), and nothing else — the whole securityContext, field for field.
    assert_eq!(c["securityContext"]["privileged"], false);
    assert_eq!(c["securityContext"]["runAsUser"], 0);
    assert_eq!(c["securityContext"], least_privilege_worker());
    let pod = &worker["spec"]["template"]["spec"];
    assert_eq!(pod["securityContext"]["seccompProfile"]["type"], "RuntimeDefault");
    for key in ["hostNetwork", "hostPID", "hostIPC"] {
        assert!(pod.get(key).is_none(), "{key}: {}", pod[key]);
    }
    assert!(
        worker["spec"]["template"]["metadata"]["annotations"]
            .get("io.kubernetes.cri-o.cgroup2-mount-hierarchy-rw")
            .is_none(),
        "the CRI-O annotation only in delegatedCgroupRW"
    );
    // Where the worker mounts its own cgroup2 (read-only /sys/fs/cgroup): a writable emptyDir of its own.
    assert_eq!(mount(c, "cgroup")["mountPath"], "/run/cloud-agents/cgroup");
    assert_eq!(volume(worker, "cgroup")["emptyDir"]["sizeLimit"], "1Mi");
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
    // The worker reads it as a WorkerConfig: preparations reach PyPI only and see none of the mounted secrets.
    let parsed: fleet_worker::config::WorkerConfig =
        toml::from_str(toml).expect("worker.toml is a WorkerConfig");
    assert_eq!(
        parsed.preparation.index_hosts,
        fleet_worker::config::DEFAULT_INDEX_HOSTS
    );
    assert_eq!(
        parsed.preparation.hidden_paths,
        [
            std::path::PathBuf::from("/var/run/cloud-agents"),
            std::path::PathBuf::from("/etc/cloud-agents")
        ]
    );
    assert_eq!(
        parsed.preparation,
        fleet_worker::config::Preparation {
            hidden_paths: parsed.preparation.hidden_paths.clone(),
            ..fleet_worker::config::Preparation::default()
        }
    );
    assert_eq!(
        find(&objs, "PodDisruptionBudget", "-worker")["spec"]["maxUnavailable"],
        1
    );
    assert_eq!(
        find(&objs, "PodDisruptionBudget", "-front")["spec"]["minAvailable"],
        1
    );

    // CRI-O variant: not privileged, exactly the capabilities of the default mode (namespaces and mounts need
    // SYS_ADMIN and NET_ADMIN whoever mounts the cgroup hierarchy), the rw-cgroup annotation, KEDA.
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
        serde_json::json!([
            "CHOWN",
            "DAC_OVERRIDE",
            "FOWNER",
            "KILL",
            "NET_ADMIN",
            "SETGID",
            "SETUID",
            "SYS_ADMIN"
        ])
    );
    assert_eq!(*sc, least_privilege_worker());
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
        env(c, "FLEET_PACKAGE_SOURCE_ALLOW"),
        Some("10.20.0.0/16,fd00:20::/64")
    );
    // The cluster's own ranges reach the front's fetches and the worker's proxy and preparations alike.
    let worker = container(find(&objs, "Deployment", "-worker"));
    for c in [c, worker] {
        assert_eq!(
            env(c, "FLEET_CLUSTER_CIDRS"),
            Some("10.0.0.0/8,2600:1f18:4000::/40")
        );
    }
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
    // Metrics are scraped on a port of their own, never through the public front Service.
    for monitor in objs.iter().filter(|o| o["kind"] == "ServiceMonitor") {
        assert_eq!(monitor["spec"]["endpoints"][0]["port"], "metrics", "{monitor}");
    }
    let front_c = container(find(&objs, "Deployment", "-front"));
    assert!(
        args(front_c).contains(&"--metrics-http=0.0.0.0:9091"),
        "{front_c}"
    );
    let public = find(&objs, "Service", "-front");
    assert!(
        public["spec"]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p["name"] != "metrics"),
        "{public}"
    );
    let scraped = find(&objs, "Service", "-front-metrics");
    assert_eq!(scraped["spec"]["clusterIP"], "None");
    assert_eq!(scraped["spec"]["ports"][0]["targetPort"], "metrics");
    assert_eq!(scraped["spec"]["ports"][0]["port"], 9091);

    // Dev variant: no privileges at all.
    let objs = objects(out, "dev-no-isolation");
    let c = container(find(&objs, "Deployment", "-worker"));
    assert!(args(c).contains(&"--isolation=none"));
    assert_eq!(c["securityContext"]["runAsNonRoot"], true);
    assert!(c["securityContext"]["capabilities"].get("add").is_none());
    assert!(c["securityContext"].get("appArmorProfile").is_none());

    // Privileged variant (cgroup v1 nodes): privileged for cgroup delegation, root, read-only root filesystem;
    // no cgroup volume (the runtime's hierarchy is writable) and no AppArmor override (privileged has none).
    let objs = objects(out, "privileged");
    let worker = find(&objs, "Deployment", "-worker");
    let c = container(worker);
    assert_eq!(c["securityContext"]["privileged"], true);
    assert_eq!(c["securityContext"]["runAsUser"], 0);
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    assert!(c["securityContext"].get("appArmorProfile").is_none());
    assert!(
        !c["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["name"] == "cgroup")
    );
    assert!(args(c).contains(&"--isolation=cgroup"));

    // No value set reaches into the node: no hostPath volume, no host namespace, no host port.
    for variant in variants.keys() {
        for o in objects(out, variant) {
            let Some(pod) = o["spec"]["template"]["spec"].as_object() else {
                continue;
            };
            for v in pod.get("volumes").and_then(Value::as_array).into_iter().flatten() {
                assert!(v.get("hostPath").is_none(), "{variant}: hostPath {v}");
            }
            for key in ["hostNetwork", "hostPID", "hostIPC"] {
                assert!(pod.get(key).is_none(), "{variant}: {key}");
            }
        }
    }

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
    assert!(
        m.contains("'capabilities', 'privileged', 'delegatedCgroupRW', 'none'"),
        "{m}"
    );
    assert!(message("unknown key (typo)").contains("'replica' not allowed"));
    assert!(message("public URL without a scheme").contains("/services/publicUrl"));
    assert!(message("files URL without a scheme").contains("/services/filesPublicUrl"));
    assert!(message("grace shorter than the shutdown ladder").contains("shutdown ladder"));
}

/// Front and worker share one link-signing key (download and upload links are signed by workers and served by
/// fronts): a generated, kept Secret by default, the operator's Secret when named; the services TOML and the LLM
/// key are mounted only when configured.
#[test]
fn front_and_worker_share_the_link_signing_key_the_credentials_keyring_and_the_services_config() {
    use base64::Engine as _;
    let (out, _) = validate();
    let objs = objects(out.path(), "default");
    let secret = find(&objs, "Secret", "-links");
    assert_eq!(
        secret["metadata"]["annotations"]["helm.sh/resource-policy"],
        "keep"
    );
    // The credentials keyring: generated once with one key `<kid> <64 hex digits>`, kept on uninstall.
    let keyring = find(&objs, "Secret", "-credentials-keyring");
    assert_eq!(
        keyring["metadata"]["annotations"]["helm.sh/resource-policy"],
        "keep"
    );
    let text = base64::engine::general_purpose::STANDARD
        .decode(keyring["data"]["keyring"].as_str().unwrap())
        .unwrap();
    let text = String::from_utf8(text).unwrap();
    let fields: Vec<&str> = text.split_whitespace().collect();
    assert_eq!(fields.len(), 2, "one key line");
    assert!(
        fields[1].len() == 64 && fields[1].chars().all(|c| c.is_ascii_hexdigit()),
        "a 256-bit key in hex"
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
        assert!(
            args(c).contains(&"--credentials-key-file=/var/run/cloud-agents/credentials/credentials.keys"),
            "{deployment}"
        );
        let volumes = d["spec"]["template"]["spec"]["volumes"].as_array().unwrap();
        let link = volumes.iter().find(|v| v["name"] == "link-key").unwrap();
        assert_eq!(link["secret"]["secretName"], secret["metadata"]["name"]);
        assert_eq!(
            volume(d, "credentials-keyring")["secret"]["secretName"],
            keyring["metadata"]["name"]
        );
        assert_eq!(
            mount(c, "credentials-keyring")["mountPath"],
            "/var/run/cloud-agents/credentials"
        );
    }
    let objs = objects(out.path(), "production-hpa");
    for deployment in ["-front", "-worker"] {
        let d = find(&objs, "Deployment", deployment);
        let c = container(d);
        assert!(args(c).contains(&"--public-url=https://fleet.example.com"));
        // User content on an origin of its own: front (serves the links) and worker (signs them) alike.
        assert!(args(c).contains(&"--files-public-url=https://files.fleet-usercontent.example"));
        assert!(args(c).contains(&"--services-config=/var/run/cloud-agents/services/services.toml"));
        let volumes = d["spec"]["template"]["spec"]["volumes"].as_array().unwrap();
        let link = volumes.iter().find(|v| v["name"] == "link-key").unwrap();
        assert_eq!(
            link["secret"]["secretName"], "cloud-agents-links",
            "the operator's Secret"
        );
        assert!(volumes.iter().any(|v| v["name"] == "llm-api-key"));
        assert_eq!(
            volume(d, "image-api-key")["secret"]["secretName"],
            "cloud-agents-image"
        );
        assert_eq!(
            mount(c, "image-api-key")["mountPath"],
            "/var/run/cloud-agents/image"
        );
        // The OAuth providers' client secrets: the whole Secret, one file per provider.
        assert_eq!(
            volume(d, "oauth-client-secrets")["secret"]["secretName"],
            "cloud-agents-oauth"
        );
        assert_eq!(
            mount(c, "oauth-client-secrets")["mountPath"],
            "/var/run/cloud-agents/oauth"
        );
        assert_eq!(
            volume(d, "credentials-keyring")["secret"]["secretName"],
            "cloud-agents-credentials-keyring",
            "the operator's Secret"
        );
    }
    let config = find(&objs, "ConfigMap", "-services");
    assert!(
        config["data"]["services.toml"]
            .as_str()
            .unwrap()
            .contains("[llm]")
    );
}

fn volume<'a>(deployment: &'a Value, name: &str) -> &'a Value {
    deployment["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == name)
        .unwrap_or_else(|| panic!("no volume {name}"))
}

fn mount<'a>(c: &'a Value, name: &str) -> &'a Value {
    c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == name)
        .unwrap_or_else(|| panic!("no volumeMount {name}"))
}

/// The keys a Secret volume projects.
fn items(v: &Value) -> Vec<&str> {
    v["secret"]["items"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}: no items (the whole Secret)"))
        .iter()
        .map(|i| i["key"].as_str().unwrap())
        .collect()
}

/// Every volume of a Deployment that reads the Secret `name` (directly or projected).
fn volumes_of_secret<'a>(deployment: &'a Value, name: &str) -> Vec<&'a Value> {
    deployment["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| {
            v["secret"]["secretName"] == name
                || v["projected"]["sources"]
                    .as_array()
                    .is_some_and(|s| s.iter().any(|s| s["secret"]["name"] == name))
        })
        .collect()
}

/// The bus is closed (issue 13): fronts get the issuer material and front.creds, workers worker.creds and nothing
/// else of the NATS auth Secret; TLS flags when a TLS Secret is named; a NetworkPolicy on the bundled NATS servers
/// and, opted in, on worker egress; no NATS auth Secret means no rendering (the open bus is an explicit opt-out).
#[test]
fn nats_credentials_tls_and_network_policies() {
    let (out, summary) = validate();
    let out = out.path();
    const SECRET: &str = "ca-nats-auth";

    // Default values (+ natsAuth.existingSecret): fronts.
    let objs = objects(out, "default");
    let front = find(&objs, "Deployment", "-front");
    let c = container(front);
    let a = args(c);
    assert!(
        a.contains(&"--nats-creds=/var/run/cloud-agents/nats-auth/front.creds")
            && a.contains(&"--nats-auth-dir=/var/run/cloud-agents/nats-auth"),
        "{a:?}"
    );
    let m = mount(c, "nats-auth");
    assert_eq!(m["mountPath"], "/var/run/cloud-agents/nats-auth");
    assert_eq!(m["readOnly"], true);
    let v = volume(front, "nats-auth");
    assert_eq!(v["secret"]["secretName"], SECRET);
    assert_eq!(
        v["secret"]["defaultMode"], 0o440,
        "read-only for the front's group"
    );
    let mut keys = items(v);
    keys.sort_unstable();
    assert_eq!(
        keys,
        ["exec.seed", "front.creds", "jwts.json", "seeds.json", "sys.creds"]
    );
    assert_eq!(volumes_of_secret(front, SECRET).len(), 1);

    // Workers: worker.creds and the exec seal's public key, nothing else of the Secret, root-only (plugins run
    // as other uids). Both live in one directory: the worker finds exec.pub beside --nats-creds.
    let worker = find(&objs, "Deployment", "-worker");
    let c = container(worker);
    let a = args(c);
    let creds: Vec<_> = a.iter().filter(|x| x.starts_with("--nats-creds")).collect();
    assert_eq!(creds, [&"--nats-creds=/var/run/cloud-agents/nats/worker.creds"]);
    assert!(!a.iter().any(|x| x.starts_with("--nats-auth-dir")), "{a:?}");
    let m = mount(c, "nats-creds");
    assert_eq!(m["mountPath"], "/var/run/cloud-agents/nats");
    assert_eq!(m["readOnly"], true);
    let secret_volumes = volumes_of_secret(worker, SECRET);
    assert_eq!(secret_volumes.len(), 1, "{secret_volumes:?}");
    assert_eq!(secret_volumes[0]["name"], "nats-creds");
    assert_eq!(items(secret_volumes[0]), ["worker.creds", "exec.pub"]);
    assert_eq!(secret_volumes[0]["secret"]["items"][0]["path"], "worker.creds");
    assert_eq!(secret_volumes[0]["secret"]["items"][1]["path"], "exec.pub");
    assert!(
        !a.iter().any(|x| x.starts_with("--exec-")),
        "defaults beside the credentials: {a:?}"
    );
    assert_eq!(secret_volumes[0]["secret"]["defaultMode"], 0o400);
    assert!(
        c.get("envFrom").is_none()
            && !c["env"]
                .as_array()
                .unwrap()
                .iter()
                .any(|e| e["valueFrom"]["secretKeyRef"]["name"] == SECRET),
        "no NATS auth material in the worker's environment"
    );
    // No TLS flags without a TLS Secret; no NetworkPolicy for an external NATS; worker egress is opt-in.
    for d in [front, worker] {
        assert!(!args(container(d)).iter().any(|x| x.starts_with("--nats-tls")));
    }
    assert!(!objs.iter().any(|o| o["kind"] == "NetworkPolicy"));

    // Mutual TLS (production-hpa): the three flags and the Secret's three keys on both components.
    let objs = objects(out, "production-hpa");
    for suffix in ["-front", "-worker"] {
        let d = find(&objs, "Deployment", suffix);
        let a = args(container(d));
        for want in [
            "--nats-tls-ca=/var/run/cloud-agents/nats-tls/ca.crt",
            "--nats-tls-cert=/var/run/cloud-agents/nats-tls/tls.crt",
            "--nats-tls-key=/var/run/cloud-agents/nats-tls/tls.key",
        ] {
            assert!(a.contains(&want), "{suffix}: {want} not in {a:?}");
        }
        let v = volume(d, "nats-tls");
        assert_eq!(v["secret"]["secretName"], "cloud-agents-nats-client-tls");
        assert_eq!(items(v), ["ca.crt", "tls.crt", "tls.key"]);
        assert_eq!(mount(container(d), "nats-tls")["readOnly"], true);
        let creds = volumes_of_secret(d, "cloud-agents-nats-auth");
        assert_eq!(creds.len(), 1, "{suffix}");
    }
    // Worker egress opted in, external NATS: DNS, the NATS port towards the NATS namespace, the OTLP port, the
    // allow-list; nothing else.
    let egress = find(&objs, "NetworkPolicy", "-worker-egress");
    assert_eq!(egress["spec"]["policyTypes"], serde_json::json!(["Egress"]));
    assert_eq!(
        egress["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"],
        "worker"
    );
    let rules = egress["spec"]["egress"].as_array().unwrap();
    assert_eq!(rules.len(), 4, "{rules:?}");
    assert_eq!(rules[0]["ports"][0]["port"], 53);
    assert_eq!(rules[1]["ports"][0]["port"], 4222);
    assert_eq!(
        rules[1]["to"][0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"],
        "nats"
    );
    assert_eq!(rules[2]["ports"][0]["port"], 4317, "otlp.endpoint's port");
    assert_eq!(rules[3]["ports"][0]["port"], 443);

    // Server TLS only (keda-crio): the CA flag, no client certificate.
    let objs = objects(out, "keda-crio");
    for suffix in ["-front", "-worker"] {
        let a = args(container(find(&objs, "Deployment", suffix)));
        let tls: Vec<_> = a.iter().filter(|x| x.starts_with("--nats-tls")).collect();
        assert_eq!(
            tls,
            [&"--nats-tls-ca=/var/run/cloud-agents/nats-tls/ca.crt"],
            "{suffix}"
        );
    }

    // The bundled NATS chart: the client Service's URL, and a NetworkPolicy that admits only fronts, workers and
    // labelled namespaces to 4222 and only the servers to each other on 6222.
    let objs = objects(out, "bundled-nats");
    let front = find(&objs, "Deployment", "-front");
    assert_eq!(
        env(container(front), "FLEET_NATS_URL"),
        Some("nats://ca-nats.cloud-agents.svc:4222")
    );
    assert_eq!(
        volume(front, "nats-auth")["secret"]["secretName"],
        "fleet-nats-auth"
    );
    let policy = find(&objs, "NetworkPolicy", "-nats");
    let nats_pods = serde_json::json!({
        "app.kubernetes.io/name": "nats",
        "app.kubernetes.io/instance": "ca",
        "app.kubernetes.io/component": "nats",
    });
    assert_eq!(policy["spec"]["podSelector"]["matchLabels"], nats_pods);
    assert_eq!(policy["spec"]["policyTypes"], serde_json::json!(["Ingress"]));
    let ingress = policy["spec"]["ingress"].as_array().unwrap();
    assert_eq!(
        ingress[0]["ports"],
        serde_json::json!([{"port": 4222, "protocol": "TCP"}])
    );
    let from = ingress[0]["from"].as_array().unwrap();
    let selector = |component: &str| {
        serde_json::json!({"podSelector": {"matchLabels": {
            "app.kubernetes.io/name": "cloud-agents",
            "app.kubernetes.io/instance": "ca",
            "app.kubernetes.io/component": component,
        }}})
    };
    assert_eq!(
        from,
        &[
            selector("front"),
            selector("worker"),
            serde_json::json!({"namespaceSelector": {"matchLabels": {"cloud-agents.io/nats-client": "true"}}}),
        ],
        "only fronts, workers and labelled namespaces"
    );
    assert_eq!(ingress[1]["ports"][0]["port"], 6222);
    assert_eq!(
        ingress[1]["from"],
        serde_json::json!([{"podSelector": {"matchLabels": nats_pods}}])
    );
    assert_eq!(ingress[2]["ports"][0]["port"], 8222);
    assert_eq!(ingress.len(), 3, "{ingress:?}");
    // Worker egress with the bundled servers: their pods on 4222, not any destination.
    let egress = find(&objs, "NetworkPolicy", "-worker-egress");
    let rules = egress["spec"]["egress"].as_array().unwrap();
    assert_eq!(rules[1]["ports"][0]["port"], 4222);
    assert_eq!(
        rules[1]["to"],
        serde_json::json!([{"podSelector": {"matchLabels": nats_pods}}])
    );

    // The development opt-out: no credential flag, no NATS auth volume, still renders.
    let objs = objects(out, "insecure-open-bus");
    for suffix in ["-front", "-worker"] {
        let d = find(&objs, "Deployment", suffix);
        let a = args(container(d));
        assert!(
            !a.iter()
                .any(|x| x.starts_with("--nats-creds") || x.starts_with("--nats-auth-dir")),
            "{suffix}: {a:?}"
        );
        let volumes = d["spec"]["template"]["spec"]["volumes"].as_array().unwrap();
        assert!(
            !volumes
                .iter()
                .any(|v| v["name"] == "nats-auth" || v["name"] == "nats-creds")
        );
        // Even on an open bus the exec seal holds: fronts get the seed, workers its public key only.
        let (flag, item) = if suffix == "-front" {
            (
                "--exec-signing-key=/var/run/cloud-agents/exec-seal/exec.seed",
                "exec.seed",
            )
        } else {
            (
                "--exec-verify-key=/var/run/cloud-agents/exec-seal/exec.pub",
                "exec.pub",
            )
        };
        assert!(a.contains(&flag), "{suffix}: {a:?}");
        let v = volume(d, "exec-seal");
        assert_eq!(v["secret"]["secretName"], "ca-exec-seal");
        assert_eq!(items(v), [item]);
        assert_eq!(mount(container(d), "exec-seal")["readOnly"], true);
    }

    // Refusals: no Secret (the chart's defaults), both or neither of Secret and opt-out, the bundled servers
    // without the accounts.
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
    let m = message("chart defaults: no NATS auth Secret");
    assert!(
        m.contains("natsAuth.existingSecret is required")
            && m.contains("fleet nats-auth init --dir ./nats-auth")
            && m.contains("natsAuth.insecureOpenBus=true"),
        "{m}"
    );
    assert!(message("NATS auth Secret and open bus").contains("not both"));
    assert!(message("open bus with the bundled NATS").contains("cannot be combined with nats.enabled=true"));
    assert!(
        message("open bus without the exec seal Secret")
            .contains("natsAuth.execSealSecret is required with natsAuth.insecureOpenBus=true")
    );
    assert!(message("exec seal Secret with credentials").contains("only for natsAuth.insecureOpenBus=true"));
    assert!(
        message("bundled NATS without the auth Secret mounted")
            .contains("must mount server-auth.conf from natsAuth.existingSecret")
    );
    assert!(
        message("bundled NATS without server-auth.conf included").contains("must include server-auth.conf")
    );
    assert!(message("NATS auth Secret name not a DNS name").contains("/natsAuth/existingSecret"));
    assert!(message("NATS client cert without key").contains("go together"));
    assert!(
        message("keda jetstream in the global account under operator mode")
            .contains("set its public key (`fleet nats-auth init` prints it as accounts.FLEET)")
    );
}

/// Every `image` of every rendered object (containers, init containers, any depth).
fn images<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
    match v {
        Value::Object(map) => {
            for (k, val) in map {
                if k == "image" {
                    if let Some(s) = val.as_str() {
                        out.push(s);
                    }
                } else {
                    images(val, out);
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|i| images(i, out)),
        _ => {}
    }
}

#[test]
fn every_image_reference_resolves_to_the_published_image() {
    // The release workflow publishes `$IMAGE:<version>` (.github/workflows/release.yml); the chart's appVersion is
    // that version. Every value set that keeps the default repository must reference exactly that image; the one
    // that sets a private registry keeps the published name's path and tag.
    let root = workspace_root();
    let workflow = std::fs::read_to_string(root.join(".github/workflows/release.yml")).unwrap();
    let published = workflow
        .lines()
        .find_map(|l| l.trim().strip_prefix("IMAGE: "))
        .expect("release.yml sets env IMAGE")
        .trim()
        .to_string();
    let chart = std::fs::read_to_string(root.join("deploy/helm/cloud-agents/Chart.yaml")).unwrap();
    let app_version = chart
        .lines()
        .find_map(|l| l.strip_prefix("appVersion: "))
        .unwrap()
        .trim_matches('"')
        .to_string();
    assert_eq!(
        app_version,
        env!("CARGO_PKG_VERSION"),
        "appVersion is the workspace version"
    );
    let expected = format!("{published}:{app_version}");

    let (out, summary) = validate();
    let mut checked = 0;
    for variant in summary["variants"].as_object().unwrap().keys() {
        let objs = objects(out.path(), variant);
        let mut found = Vec::new();
        for o in &objs {
            images(o, &mut found);
        }
        assert!(!found.is_empty(), "{variant}: no image rendered");
        for image in found {
            if variant == "production-hpa" {
                assert_eq!(
                    image, "registry.example.com/cloud-agents/fleet:0.1.0",
                    "{variant}"
                );
            } else {
                assert_eq!(image, expected, "{variant}");
            }
            checked += 1;
        }
    }
    assert!(checked >= 10, "only {checked} image references");
}
