#!/usr/bin/env python3
"""Validates the Helm chart deploy/helm/cloud-agents without a cluster (and without a `helm` binary).

1. files/alerts.yml and files/grafana-dashboard.json are byte-identical to deploy/prometheus/alerts.yml and
   deploy/grafana/cloud-agents.json (the chart can only read files inside itself, so it carries copies);
2. `helm lint --strict` (PyPI helm-python-sdk: the Helm v4 Go SDK over ctypes) with the default values and with
   every ci/*-values.yaml; the only finding tolerated is the missing, not vendored `nats` dependency. "default" is
   the chart's defaults plus the one value without a default, natsAuth.existingSecret (BASE_VALUES); the
   defaults alone must be refused (an open bus is never the default). One more value set, "insecure-open-bus",
   checks the development opt-out;
3. `helm template` of the same value sets, split into one file per manifest under OUT/<variant>/, also written
   as OUT/<variant>.json (a list of objects) for tests/helm_chart.rs;
4. every rendered manifest through `kubernetes-validate --strict -k <version>` (one process for all of them); the
   CRD kinds it has no schema for (ServiceMonitor, PrometheusRule, ScaledObject) get structural checks here;
5. security invariants on every container (and the NATS credentials: workers mount worker.creds and nothing else
   of the NATS auth Secret), and values the schema (or the templates) must reject, each with the message
   expected (rendered over BASE_VALUES, so that each case fails for its own reason);
6. deploy/nats/: networkpolicy.yaml goes through step 4 with the rest, and nats-chart-values.yaml must configure
   the official chart exactly as values.yaml configures the bundled one (but for the Secret's name).

Usage: validate.py [--out DIR] [--kube-version 1.30.0]. Exit status 0 when everything passed; OUT/summary.json
records what ran.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "cloud-agents"
RELEASE, NAMESPACE = "ca", "cloud-agents"

# Lint findings that are expected offline: the official nats chart is declared but not vendored.
TOLERATED_LINT = [re.compile(r"chart directory is missing these dependencies: nats"), re.compile(r"icon is recommended")]

# The values every rendering starts from: the chart's defaults need only the NATS auth Secret.
NATS_AUTH_SECRET = "ca-nats-auth"
BASE_VALUES = {"natsAuth": {"existingSecret": NATS_AUTH_SECRET}}
# Value sets rendered and validated besides the ci/ ones (which must name the Secret themselves).
EXEC_SEAL_SECRET = "ca-exec-seal"
EXTRA_VARIANTS = [("insecure-open-bus", {"natsAuth": {"insecureOpenBus": True, "execSealSecret": EXEC_SEAL_SECRET}})]
# What each component may mount of the NATS auth Secret (`fleet nats-auth init`: seeds.json, jwts.json,
# server-auth.conf, exec.seed, exec.pub and front, worker, operator, app, sys .creds).
NATS_AUTH_ALLOWED = {"front": {"seeds.json", "jwts.json", "sys.creds", "front.creds", "exec.seed"},
                     "worker": {"worker.creds", "exec.pub"}}

# Exactly the capabilities an isolating, unprivileged worker adds (deploy/helm/README.md "Worker privileges").
WORKER_CAPABILITIES = {"CHOWN", "DAC_OVERRIDE", "FOWNER", "KILL", "NET_ADMIN", "SETGID", "SETUID", "SYS_ADMIN"}

# Values that must be refused, and a piece of the message that must say why. Rendered over BASE_VALUES; a case
# whose values are RAW is rendered alone (the chart's defaults).
RAW = "raw"
BAD_VALUES = [
    ("chart defaults: no NATS auth Secret", RAW, "natsAuth.existingSecret is required"),
    ("empty NATS auth Secret name", {"natsAuth": {"existingSecret": ""}}, "natsAuth.existingSecret is required"),
    ("NATS auth Secret and open bus", {"natsAuth": {"insecureOpenBus": True}},
     "set either natsAuth.existingSecret (credentials) or natsAuth.insecureOpenBus=true"),
    ("open bus with the bundled NATS", {"natsAuth": {"existingSecret": "", "insecureOpenBus": True},
                                        "nats": {"enabled": True}}, "cannot be combined with nats.enabled=true"),
    ("open bus without the exec seal Secret", {"natsAuth": {"existingSecret": "", "insecureOpenBus": True}},
     "natsAuth.execSealSecret is required with natsAuth.insecureOpenBus=true"),
    ("exec seal Secret with credentials", {"natsAuth": {"execSealSecret": "seal"}},
     "natsAuth.execSealSecret is only for natsAuth.insecureOpenBus=true"),
    ("bundled NATS without the auth Secret mounted", {"nats": {"enabled": True}},
     "the bundled NATS servers must mount server-auth.conf from natsAuth.existingSecret (ca-nats-auth)"),
    ("bundled NATS without server-auth.conf included",
     {"natsAuth": {"existingSecret": "cloud-agents-nats-auth"},
      "nats": {"enabled": True, "config": {"merge": {"zzz$include": None}}}},
     "nats.config.merge must include server-auth.conf"),
    ("NATS auth Secret name not a DNS name", {"natsAuth": {"existingSecret": "Nats_Auth"}},
     "/natsAuth/existingSecret"),
    ("NATS client cert without key", {"natsTls": {"secretName": "tls", "key": ""}},
     "natsTls.cert and natsTls.key go together"),
    ("NATS TLS without a CA key", {"natsTls": {"secretName": "tls", "ca": ""}}, "natsTls.ca is required"),
    ("network policy typo", {"networkPolicy": {"enable": False}}, "additional properties 'enable' not allowed"),
    ("sandbox mode typo", {"worker": {"sandbox": {"mode": "root"}}},
     "value must be one of 'capabilities', 'privileged', 'delegatedCgroupRW', 'none'"),
    ("zero front replicas", {"front": {"replicas": 0}}, "/front/replicas"),
    ("no NATS at all", {"externalNatsUrl": ""}, "/externalNatsUrl"),
    ("NATS URL without a scheme", {"externalNatsUrl": "nats.svc:4222"}, "/externalNatsUrl"),
    ("unknown key (typo)", {"worker": {"replica": 3}}, "additional properties 'replica' not allowed"),
    ("replicas as a string", {"worker": {"replicas": "three"}}, "/worker/replicas"),
    ("JetStream replicas 2", {"jetstream": {"replicas": 2}}, "/jetstream/replicas"),
    ("bad autoscaling mode", {"worker": {"autoscaling": {"mode": "vpa"}}}, "value must be one of 'none', 'hpa', 'keda'"),
    ("keda jetstream in the global account under operator mode",
     {"worker": {"autoscaling": {"mode": "keda", "keda": {"trigger": "nats-jetstream",
                                                           "natsJetstream": {"stream": "KV_fleet_jobs", "consumer": "c"}}}}},
     "in operator mode (natsAuth) the fleet's streams live in the FLEET account, not $G"),
    # The stream and consumer default to the job queue's (fleet_job_queue / workers): an emptied one is refused.
    ("keda jetstream without stream", {"worker": {"autoscaling": {"mode": "keda", "keda": {
        "trigger": "nats-jetstream", "natsJetstream": {"stream": ""}}}}},
     "/worker/autoscaling/keda/natsJetstream/stream"),
    ("secret ref without key", {"auth": {"hs256Secrets": [{"secretName": "jwt"}]}}, "missing property 'key'"),
    ("grace shorter than the shutdown ladder", {"worker": {"terminationGracePeriodSeconds": 15}},
     "must be at least worker.drainGraceSeconds + 2 × worker.config.shutdownGraceSeconds + 10"),
    ("no API key at all", {"auth": {"generateHs256Secret": False}}, "list at least one key"),
    ("public URL without a scheme", {"services": {"publicUrl": "fleet.example.com"}}, "/services/publicUrl"),
    ("files URL without a scheme", {"services": {"filesPublicUrl": "files.example.com"}}, "/services/filesPublicUrl"),
]


def fail(errors: list[str], msg: str) -> None:
    errors.append(msg)
    print(f"FAIL {msg}", file=sys.stderr)


def merged(base: dict, over: dict) -> dict:
    """Helm's value merge: maps merge key by key, anything else (lists too) replaces."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_variants() -> list[tuple[str, dict]]:
    variants = [("default", BASE_VALUES)]
    for f in sorted((CHART / "ci").glob("*-values.yaml")):
        variants.append((f.name.removesuffix("-values.yaml"), yaml.safe_load(f.read_text()) or {}))
    return variants + EXTRA_VARIANTS


def split_docs(rendered: dict[str, str]) -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(rendered):
        if not path.endswith((".yaml", ".yml")):
            continue
        for doc in yaml.safe_load_all(rendered[path]):
            if doc:
                docs.append((path, doc))
    return docs


def containers(doc: dict) -> list[dict]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("containers", []) + spec.get("initContainers", [])


def check_security(variant: str, docs: list[dict], errors: list[str]) -> None:
    for doc in docs:
        if doc.get("kind") != "Deployment":
            continue
        pod = doc["spec"]["template"]["spec"]
        component = doc["metadata"]["labels"].get("app.kubernetes.io/component")
        for c in containers(doc):
            sc = c.get("securityContext", {})
            where = f"{variant}: {doc['metadata']['name']}/{c['name']}"
            if sc.get("readOnlyRootFilesystem") is not True:
                fail(errors, f"{where}: readOnlyRootFilesystem must be true")
            for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
                if c.get(probe, {}).get("httpGet", {}).get("path") != path:
                    fail(errors, f"{where}: {probe} must GET {path}")
            if sc.get("privileged"):
                if component != "worker":
                    fail(errors, f"{where}: only workers may be privileged")
                continue
            seccomp = sc.get("seccompProfile") or pod.get("securityContext", {}).get("seccompProfile") or {}
            if seccomp.get("type") != "RuntimeDefault":
                fail(errors, f"{where}: seccompProfile RuntimeDefault missing")
            if sc.get("capabilities", {}).get("drop") != ["ALL"]:
                fail(errors, f"{where}: capabilities must drop ALL")
            if sc.get("allowPrivilegeEscalation") is not False:
                fail(errors, f"{where}: allowPrivilegeEscalation must be false")
            added = set(sc.get("capabilities", {}).get("add", []))
            if component != "worker" and (added or sc.get("runAsNonRoot") is not True):
                fail(errors, f"{where}: the front runs as non-root with no capability")
            isolated = "--isolation=cgroup" in c.get("args", [])
            if component == "worker" and isolated and added != WORKER_CAPABILITIES:
                fail(errors, f"{where}: capabilities {sorted(added)}, wants exactly {sorted(WORKER_CAPABILITIES)}")
            if component == "worker" and not isolated and (added or sc.get("runAsNonRoot") is not True):
                fail(errors, f"{where}: a worker without isolation runs as non-root with no capability")
            apparmor = sc.get("appArmorProfile") or pod.get("securityContext", {}).get("appArmorProfile")
            if apparmor and not (component == "worker" and isolated and sc.get("appArmorProfile") == {"type": "Unconfined"}):
                fail(errors, f"{where}: AppArmor profile {apparmor}: only an isolating worker container is Unconfined")
            if component == "worker" and isolated and apparmor != {"type": "Unconfined"}:
                fail(errors, f"{where}: an unprivileged isolating worker must mount: appArmorProfile Unconfined missing")


def check_host_access(variant: str, docs: list[dict], errors: list[str]) -> None:
    """No pod reaches into the node: no hostPath volume, no host namespace, no host port."""
    for doc in docs:
        pod = doc.get("spec", {}).get("template", {}).get("spec")
        if pod is None:
            continue
        where = f"{variant}: {doc['kind']}/{doc['metadata']['name']}"
        for v in pod.get("volumes", []):
            if "hostPath" in v:
                fail(errors, f"{where}: hostPath volume {v['name']}")
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            if pod.get(key):
                fail(errors, f"{where}: {key}: {pod[key]}")
        for c in containers(doc):
            for p in c.get("ports", []):
                if "hostPort" in p:
                    fail(errors, f"{where}/{c['name']}: hostPort {p['hostPort']}")


def check_nats_credentials(variant: str, docs: list[dict], values: dict, errors: list[str]) -> None:
    """Each component mounts only its share of the NATS auth Secret, always item by item (never the whole Secret),
    and passes the matching flags; with the open-bus opt-out nothing of it is mounted or passed."""
    secret = values.get("natsAuth", {}).get("existingSecret", "")
    for doc in docs:
        if doc.get("kind") != "Deployment":
            continue
        pod = doc["spec"]["template"]["spec"]
        component = doc["metadata"]["labels"].get("app.kubernetes.io/component")
        where = f"{variant}: {doc['metadata']['name']}"
        mounted: set[str] = set()
        for v in pod.get("volumes", []):
            sources = [v["secret"] | {"name": v["secret"]["secretName"]}] if "secret" in v else [
                s["secret"] for s in v.get("projected", {}).get("sources", []) if "secret" in s]
            for src in sources:
                if src["name"] != secret or not secret:
                    continue
                items = src.get("items")
                if not items:
                    fail(errors, f"{where}: volume {v['name']} mounts the whole NATS auth Secret {secret}")
                    continue
                mounted |= {i["key"] for i in items}
        allowed = NATS_AUTH_ALLOWED.get(component, set())
        if mounted - allowed:
            fail(errors, f"{where}: mounts {sorted(mounted - allowed)} of the NATS auth Secret (allowed: {sorted(allowed)})")
        for c in containers(doc):
            refs = [e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env", [])
                    if "secretKeyRef" in e.get("valueFrom", {})]
            refs += [e["secretRef"]["name"] for e in c.get("envFrom", []) if "secretRef" in e]
            if secret and secret in refs:
                fail(errors, f"{where}/{c['name']}: the NATS auth Secret in the environment")
        args = [a for c in containers(doc) for a in c.get("args", [])]
        creds = [a for a in args if a.startswith("--nats-creds=")]
        if secret:
            if mounted != allowed:
                fail(errors, f"{where}: mounts {sorted(mounted)} of the NATS auth Secret, wants {sorted(allowed)}")
            if creds != [f"--nats-creds=/var/run/cloud-agents/{'nats-auth' if component == 'front' else 'nats'}/{component}.creds"]:
                fail(errors, f"{where}: --nats-creds must name {component}.creds: {creds}")
        elif creds or any(a.startswith("--nats-auth-dir") for a in args):
            fail(errors, f"{where}: NATS credential flags without natsAuth.existingSecret: {args}")


def check_nats_chart_values(errors: list[str]) -> None:
    bundled = yaml.safe_load((CHART / "values.yaml").read_text())["nats"]
    alone = yaml.safe_load((ROOT / "deploy/nats/nats-chart-values.yaml").read_text())
    where = "deploy/nats/nats-chart-values.yaml"
    for path in (("config", "resolver"), ("config", "merge"), ("config", "jetstream"), ("config", "cluster"),
                 ("container",), ("natsBox",)):
        a, b = bundled, alone
        for k in path:
            a, b = a.get(k), b.get(k)
        if a != b:
            fail(errors, f"{where}: {'.'.join(path)} differs from values.yaml nats.{'.'.join(path)}: {b} != {a}")
    def without_secret_name(patch: list) -> list:
        out = json.loads(json.dumps(patch))
        for op in out:
            op.get("value", {}).get("secret", {}).pop("secretName", None)
        return out
    if without_secret_name(bundled["podTemplate"]["patch"]) != without_secret_name(alone["podTemplate"]["patch"]):
        fail(errors, f"{where}: podTemplate.patch differs from values.yaml nats.podTemplate.patch (beyond secretName)")
    if bundled["config"]["merge"].get("max_payload") != 8 * 1024 * 1024:
        fail(errors, "values.yaml: nats.config.merge.max_payload must stay 8 MiB")


def check_crds(variant: str, docs: list[dict], errors: list[str]) -> None:
    """kubernetes-validate has no schema for these kinds: check what a typo would break."""
    for doc in docs:
        kind, name = doc.get("kind"), doc.get("metadata", {}).get("name")
        where = f"{variant}: {kind}/{name}"
        if kind == "ServiceMonitor":
            spec = doc["spec"]
            if doc["apiVersion"] != "monitoring.coreos.com/v1" or not spec["selector"]["matchLabels"]:
                fail(errors, f"{where}: apiVersion or selector")
            for ep in spec["endpoints"]:
                if ep.get("port") not in ("http", "metrics") or ep.get("path") != "/metrics":
                    fail(errors, f"{where}: endpoint {ep}")
        elif kind == "PrometheusRule":
            groups = doc["spec"]["groups"]
            source = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())["groups"]
            if groups != source:
                fail(errors, f"{where}: groups differ from deploy/prometheus/alerts.yml")
            for g in groups:
                for r in g["rules"]:
                    if not (r.get("alert") and r.get("expr")):
                        fail(errors, f"{where}: rule without alert/expr: {r}")
        elif kind == "ScaledObject":
            spec = doc["spec"]
            if doc["apiVersion"] != "keda.sh/v1alpha1" or spec["scaleTargetRef"]["kind"] != "Deployment":
                fail(errors, f"{where}: apiVersion or scaleTargetRef")
            if not spec["scaleTargetRef"]["name"].endswith("-worker"):
                fail(errors, f"{where}: must scale the worker Deployment")
            for t in spec["triggers"]:
                if t["type"] not in ("cpu", "prometheus", "nats-jetstream") or not all(
                        isinstance(v, str) for v in t["metadata"].values()):
                    fail(errors, f"{where}: trigger {t} (KEDA metadata values are strings)")
        elif kind == "ConfigMap" and name.endswith("-dashboard"):
            dash = json.loads(doc["data"]["cloud-agents.json"])
            if dash != json.loads((ROOT / "deploy/grafana/cloud-agents.json").read_text()):
                fail(errors, f"{where}: dashboard differs from deploy/grafana/cloud-agents.json")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="where rendered manifests go (default: a temporary directory)")
    ap.add_argument("--kube-version", default="1.30.0")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="helm-validate-"))
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    errors: list[str] = []
    summary: dict = {"chart": str(CHART), "kube_version": args.kube_version, "variants": {}, "rejected": []}

    try:
        import helm_python as helm
    except ImportError:
        print("helm_python missing: pip install -r scripts/requirements-test.txt (helm-python-sdk)", file=sys.stderr)
        return 2
    summary["helm_sdk"] = helm.helm_sdk_version()

    # 1. Copies of the repo's alert rules and dashboard.
    for copy, source in (("files/alerts.yml", "deploy/prometheus/alerts.yml"),
                         ("files/grafana-dashboard.json", "deploy/grafana/cloud-agents.json")):
        if (CHART / copy).read_bytes() != (ROOT / source).read_bytes():
            fail(errors, f"{CHART / copy} differs from {source}: cp {source} {CHART / copy}")

    manifest_files: list[str] = []
    with helm.Chart.load(str(CHART)) as chart:
        for variant, values in load_variants():
            # 2. Lint.
            lint = helm.lint(str(CHART), values, strict=True, namespace=NAMESPACE, kube_version=args.kube_version)
            findings = [m["error"] for m in lint.get("messages", [])] + list(lint.get("errors", []))
            for f in findings:
                if not any(p.search(f) for p in TOLERATED_LINT):
                    fail(errors, f"{variant}: lint: {f}")
            # 3. Render.
            try:
                rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
            except helm.HelmError as e:
                fail(errors, f"{variant}: render: {e}")
                continue
            docs = split_docs(rendered)
            vdir = out / variant
            vdir.mkdir(exist_ok=True)
            for old in vdir.glob("*.yaml"):
                old.unlink()
            for i, (_, doc) in enumerate(docs):
                f = vdir / f"{i:02d}-{doc['kind'].lower()}-{doc['metadata']['name']}.yaml"
                f.write_text(yaml.safe_dump(doc, sort_keys=False))
                manifest_files.append(str(f))
            objs = [d for _, d in docs]
            (out / f"{variant}.json").write_text(json.dumps(objs, indent=1))
            check_security(variant, objs, errors)
            check_host_access(variant, objs, errors)
            check_nats_credentials(variant, objs, values, errors)
            check_crds(variant, objs, errors)
            summary["variants"][variant] = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in objs)

        # 5. Values that must be refused.
        for label, values, expected in BAD_VALUES:
            values = {} if values == RAW else merged(BASE_VALUES, values)
            try:
                chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
            except helm.HelmError as e:
                if expected not in str(e):
                    fail(errors, f"bad values {label!r}: rejected, but the message lacks {expected!r}: {e}")
                else:
                    summary["rejected"].append({"case": label, "values": values, "message": str(e).strip()})
            else:
                fail(errors, f"bad values {label!r} were accepted: {values}")

    # 6. deploy/nats/: the NetworkPolicy for an external NATS in Kubernetes is validated with the rest, and the
    # official chart's values there configure the same operator mode as the bundled sub-chart's (values.yaml).
    manifest_files.append(str(ROOT / "deploy/nats/networkpolicy.yaml"))
    check_nats_chart_values(errors)

    # 4. Every manifest against the Kubernetes OpenAPI schemas, strictly (unknown fields are errors).
    kv = Path(sys.executable).parent / "kubernetes-validate"
    cmd = [str(kv) if kv.exists() else "kubernetes-validate", "--strict", "-k", args.kube_version, *manifest_files]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = (proc.stdout + proc.stderr).splitlines()
    for line in lines:
        if line.startswith(("ERROR", "FAIL")) or "rror" in line.split(" ", 1)[0]:
            fail(errors, f"kubernetes-validate: {line}")
    unchecked = sorted({m.group(1) for m in (re.search(r"schema for kind (\w+)", l) for l in lines) if m})
    if proc.returncode != 0:
        fail(errors, f"kubernetes-validate exited {proc.returncode}")
    summary.update(manifests_validated=len(manifest_files), kinds_without_k8s_schema=unchecked,
                   errors=errors, seconds=round(time.monotonic() - started, 2))
    (out / "summary.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False))
    print(f"helm chart: {len(summary['variants'])} value sets linted and rendered, {len(manifest_files)} manifests "
          f"validated by kubernetes-validate --strict -k {args.kube_version} (CRDs checked here: "
          f"{', '.join(unchecked) or 'none'}), {len(summary['rejected'])} bad value sets rejected, "
          f"{len(errors)} error(s), {summary['seconds']} s; output in {out}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
