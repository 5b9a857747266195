//! Smoke runs of every `loadtest` scenario (2 s at 5 arrivals/s): one with `--spawn` (the loadtest
//! starts and stops its own `fleet up`), the rest against one `fleet up` child shared by this file, pointed at with
//! `--nats-url` / `--data-dir`. Each run must exit 0 (SLOs held) or 1 with only latency checks failing (a busy CI
//! machine may be slow; the smoke proves the scenario works, not the machine's speed), write a `report.json` with
//! the documented keys and no lost job, a `report.md` and a `latency.svg`.
//!
//! Both fleets use a nats-server this test starts on a free port, so nothing collides with another test's (or a
//! developer's) fleet on 4222.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use fleet::nats_server::NatsServer;
use fleet_e2e::{cargo_build, echo_plugin_bin, fleet_bin, profile_dir, workspace_root};
use serde_json::Value;

/// Failure guard only.
const GUARD: Duration = Duration::from_secs(90);

const SCRUBBED_ENV: &[&str] = &[
    "FLEET_NATS_URL",
    "FLEET_NATS_CREDS",
    "FLEET_NATS_AUTH_DIR",
    "FLEET_DATA_DIR",
    "FLEET_PLUGINS_DIR",
    "FLEET_TOKEN",
    "LOADTEST_SLO_FILE",
];

/// The `loadtest` binary (and the `fleet` next to it, which `--spawn` uses), built for this profile.
fn loadtest_bin() -> PathBuf {
    cargo_build(&["-p", "fleet-loadtest", "-p", "fleet"]);
    profile_dir().join(format!("loadtest{}", std::env::consts::EXE_SUFFIX))
}

fn loadtest(bin: &Path, args: &[&str]) -> std::process::Output {
    loadtest_with(bin, args, None)
}

/// Runs `loadtest` with a scrubbed environment; `plugins` (the shared fleet's catalogue) becomes
/// `FLEET_PLUGINS_DIR`, which `chaos-worker-kill`'s extra workers load.
fn loadtest_with(bin: &Path, args: &[&str], plugins: Option<&Path>) -> std::process::Output {
    let mut cmd = Command::new(bin);
    cmd.args(args).current_dir(workspace_root());
    for v in SCRUBBED_ENV {
        cmd.env_remove(v);
    }
    if let Some(p) = plugins {
        cmd.env("FLEET_PLUGINS_DIR", p);
    }
    cmd.output().unwrap()
}

/// The demo catalogue with the native `echo` pointing at the fixture plugin of this profile (the repo's
/// `plugins/echo` needs `target/release`), so `hostile-neighbour` always has it.
fn catalogue(root: &Path) -> PathBuf {
    let dir = root.join("plugins");
    let py = dir.join("echo-py");
    std::fs::create_dir_all(&py).unwrap();
    for f in ["executa.json", "echo_plugin.py"] {
        std::fs::copy(workspace_root().join("plugins/echo-py").join(f), py.join(f)).unwrap();
    }
    // `notes-py` runs `../echo-py/echo_plugin.py --services`.
    std::fs::create_dir_all(dir.join("notes-py")).unwrap();
    std::fs::copy(
        workspace_root().join("plugins/notes-py/executa.json"),
        dir.join("notes-py/executa.json"),
    )
    .unwrap();
    std::fs::create_dir_all(dir.join("echo")).unwrap();
    let manifest = serde_json::json!({
        "tool_id": "echo",
        "type": "binary",
        "command": [echo_plugin_bin()],
    });
    std::fs::write(dir.join("echo/executa.json"), manifest.to_string()).unwrap();
    dir
}

/// Runs one scenario and checks its exit code and report.
fn smoke(bin: &Path, scenario: &str, fleet_args: &[&str], report_dir: &Path, plugins: Option<&Path>) {
    let report = report_dir.join(scenario);
    let report_s = report.to_str().unwrap();
    let mut args = vec![
        "run",
        scenario,
        "--duration",
        "2s",
        "--rate",
        "5",
        "--report",
        report_s,
    ];
    args.extend_from_slice(fleet_args);
    let started = Instant::now();
    let out = loadtest_with(bin, &args, plugins);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let code = out.status.code();
    let ctx = format!(
        "{scenario}: exit {code:?} after {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        started.elapsed()
    );
    assert!(matches!(code, Some(0 | 1)), "{ctx}");
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(report.join("report.json")).unwrap()).unwrap();
    for key in [
        "scenario",
        "parameters",
        "operations",
        "errors",
        "jobs",
        "warm_hit_ratio",
        "counters",
        "slo",
    ] {
        assert!(json.get(key).is_some(), "{ctx}\nreport.json has no {key}");
    }
    assert_eq!(json["scenario"], scenario, "{ctx}");
    let ops = json["operations"].as_object().unwrap();
    assert!(!ops.is_empty(), "{ctx}");
    for (name, op) in ops {
        for k in [
            "count",
            "throughput_per_s",
            "p50_ms",
            "p90_ms",
            "p99_ms",
            "max_ms",
        ] {
            assert!(op[k].is_number(), "{ctx}\noperation {name} has no {k}");
        }
    }
    let jobs = &json["jobs"];
    assert_eq!(jobs["lost"], 0, "{ctx}\njobs lost: {jobs}");
    assert_eq!(
        jobs["accepted"].as_u64().unwrap(),
        jobs["terminal"].as_u64().unwrap(),
        "{ctx}"
    );
    let slo = &json["slo"];
    assert_eq!(slo["defined"], true, "{ctx}");
    assert_eq!(
        slo["passed"] == true,
        code == Some(0),
        "{ctx}\nexit code and slo.passed disagree"
    );
    for check in slo["checks"].as_array().unwrap() {
        if check["passed"] != true {
            let name = check["check"].as_str().unwrap();
            assert!(
                name.starts_with("p99_ms.")
                    || name.starts_with("p50_ms.")
                    || name.starts_with("max_p99_ratio."),
                "{ctx}\nSLO check failed: {check}"
            );
        }
    }
    let md = std::fs::read_to_string(report.join("report.md")).unwrap();
    assert!(md.contains("| operation | count |"), "{ctx}");
    let svg = std::fs::read_to_string(report.join("latency.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("<polyline"), "{ctx}");
}

/// `fleet up` as a child of the test, stopped with SIGINT on drop.
struct Fleet(Child);

impl Fleet {
    fn start(data_dir: &Path, nats_url: &str, auth_dir: &Path, plugins: &Path) -> Fleet {
        let http = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let mut cmd = Command::new(fleet_bin());
        cmd.args([
            "up",
            "--nats-url",
            nats_url,
            "--http",
            &http.to_string(),
            "--data-dir",
        ])
        .arg(data_dir)
        .arg("--nats-auth-dir")
        .arg(auth_dir)
        .arg("--plugins-dir")
        .arg(plugins)
        .current_dir(workspace_root())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
        for v in SCRUBBED_ENV {
            cmd.env_remove(v);
        }
        let mut child = cmd.spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let fleet = Fleet(child);
        let deadline = Instant::now() + GUARD;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "failure guard: fleet up not ready within {GUARD:?}"
            );
            match rx.recv_timeout(left) {
                Ok(line) if line.starts_with("try") => return fleet,
                Ok(_) => {}
                Err(e) => panic!("fleet up never printed its try line: {e}"),
            }
        }
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-INT", &self.0.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn every_scenario_smoke_runs() {
    let bin = loadtest_bin();
    let tmp = tempfile::tempdir().unwrap();
    let reports = tmp.path().join("reports");

    // `--spawn`: the loadtest starts and stops its own `fleet up` (on its own nats-server, so the shared fleet
    // below never sees the stopped fleet's worker in the registry).
    {
        let nats = NatsServer::start(&tmp.path().join("nats-spawn")).unwrap();
        let spawn_dir = tmp.path().join("spawned");
        let spawn_dir_s = spawn_dir.to_str().unwrap();
        let auth = nats.store_dir().to_str().unwrap().to_owned();
        smoke(
            &bin,
            "steady-async",
            &[
                "--spawn",
                "--nats-url",
                &nats.url(),
                "--nats-auth-dir",
                &auth,
                "--data-dir",
                spawn_dir_s,
            ],
            &reports.join("spawn"),
            None,
        );
        // nats-node-kill builds its own 3-node cluster (`fleet up --nats-cluster 3`), kills and restarts a node.
        let cluster_dir = tmp.path().join("spawned-cluster");
        smoke(
            &bin,
            "nats-node-kill",
            &["--spawn", "--data-dir", cluster_dir.to_str().unwrap()],
            &reports.join("spawn"),
            None,
        );
        let json: Value = serde_json::from_str(
            &std::fs::read_to_string(reports.join("spawn/nats-node-kill/report.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(json["counters"]["nats_nodes_killed"], 1, "{json}");
        assert_eq!(json["jobs"]["lost"], 0, "{json}");
        // With --spawn the loadtest scrapes the child's /metrics for the warm-hit ratio.
        let json: Value = serde_json::from_str(
            &std::fs::read_to_string(reports.join("spawn/steady-async/report.json")).unwrap(),
        )
        .unwrap();
        let ratio = json["warm_hit_ratio"].as_f64();
        assert!(
            ratio.is_some_and(|r| (0.0..=1.0).contains(&r)),
            "warm_hit_ratio {}: {}",
            json["warm_hit_ratio"],
            json["warm_hit_ratio_note"]
        );
    }

    let nats = NatsServer::start(&tmp.path().join("nats")).unwrap();
    let url = nats.url();

    // Every other scenario against one shared fleet.
    let data_dir = tmp.path().join("fleet");
    let plugins = catalogue(tmp.path());
    let fleet = Fleet::start(&data_dir, &url, nats.store_dir(), &plugins);
    let data_dir_s = data_dir.to_str().unwrap();
    let auth = nats.store_dir().to_str().unwrap().to_owned();
    // An SLO that cannot hold: exit 1, and the report says which check failed.
    let slo = tmp.path().join("slo.toml");
    std::fs::write(&slo, "[sync-burst]\np99_ms.invoke = 0.001\n").unwrap();
    let report = reports.join("slo-fail");
    let out = Command::new(&bin)
        .args([
            "run",
            "sync-burst",
            "--duration",
            "1s",
            "--rate",
            "3",
            "--nats-url",
            &url,
        ])
        .args(["--nats-auth-dir", &auth])
        .args(["--data-dir", data_dir_s, "--report", report.to_str().unwrap()])
        .env("LOADTEST_SLO_FILE", &slo)
        .env_remove("FLEET_NATS_URL")
        .env_remove("FLEET_DATA_DIR")
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(report.join("report.json")).unwrap()).unwrap();
    assert_eq!(json["slo"]["passed"], false);
    assert_eq!(json["slo"]["checks"][0]["check"], "p99_ms.invoke");
    assert_eq!(json["slo"]["checks"][0]["passed"], false);

    for scenario in [
        "steady-async",
        "steady-sync",
        "sync-burst",
        "cold-start-storm",
        "quota-flood",
        "cancel-storm",
        "progress-flood",
        "big-frames",
        "fairness",
        "hostile-neighbour",
        "host-storage",
        "mixed",
        "rolling-workers",
        "rolling-fronts",
        // Last: the killed worker stays in the registry for up to 10 s.
        "chaos-worker-kill",
    ] {
        smoke(
            &bin,
            scenario,
            &[
                "--nats-url",
                &url,
                "--nats-auth-dir",
                &auth,
                "--data-dir",
                data_dir_s,
            ],
            &reports,
            Some(&plugins),
        );
    }

    drop(fleet);
    drop(nats);
}

#[test]
fn list_names_every_scenario_and_bad_runs_exit_2() {
    let bin = loadtest_bin();
    let out = loadtest(&bin, &["list"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for name in [
        "steady-async",
        "steady-sync",
        "sync-burst",
        "cold-start-storm",
        "quota-flood",
        "cancel-storm",
        "progress-flood",
        "big-frames",
        "fairness",
        "chaos-worker-kill",
        "hostile-neighbour",
        "host-storage",
        "mixed",
        "nats-node-kill",
        "rolling-workers",
        "rolling-fronts",
    ] {
        let line = text.lines().find(|l| l.starts_with(name));
        assert!(
            line.is_some_and(|l| l.len() > name.len() + 10),
            "list lacks {name} or its description:\n{text}"
        );
    }
    let out = loadtest(&bin, &["run", "no-such-scenario"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown scenario"));
    let out = loadtest(&bin, &["run", "steady-async", "--duration", "soon"]);
    assert_eq!(out.status.code(), Some(2), "a bad --duration is a usage error");
    // No fleet behind the data dir: a clear error, exit 2.
    let tmp = tempfile::tempdir().unwrap();
    let out = loadtest(
        &bin,
        &["run", "steady-async", "--data-dir", tmp.path().to_str().unwrap()],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("dev signing key"));
}
