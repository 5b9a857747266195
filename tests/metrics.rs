//! Metrics end to end: a scripted workload through a real cluster, then the exact counts it implies in the
//! exposition, `promtool check metrics` on it, a real Prometheus scraping it over HTTP, and `promtool check
//! rules` on the shipped alert rules.
//!
//! `promtool` and `prometheus` come with Debian's `prometheus` package (scripts/test.sh installs it as root).
//! When they are missing the tests fail with that message: they never pass without having run.

// Test code: helpers panic on purpose when the system under test misbehaves.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fleet_e2e::cluster::Cluster;
use fleet_e2e::worker::{Plugin, eventually};
use fleet_e2e::workspace_root;
use fleet_proto::api::{ApiErrorCode, JobId, JobState, methods, subjects};
use fleet_proto::limits::MAX_LONG_JOBS_PER_AGENT;
use fleet_store::JobRecord;
use serde_json::{Value, json};

const GUARD: Duration = Duration::from_secs(30);

/// The path of a required tool, or a panic saying how to get it.
fn require(bin: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join(bin))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "`{bin}` is not installed: run scripts/test.sh as root (it installs Debian's `prometheus` package, \
                 which ships prometheus and promtool), or `apt-get install -y --no-install-recommends prometheus`"
            )
        })
}

/// The value of one sample (`name{labels}` exactly as exposed), or 0 when absent.
fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            (name == series).then(|| value.parse::<f64>().expect("a number"))
        })
        .unwrap_or(0.0)
}

async fn wait_state(c: &Cluster, user: &str, id: &JobId, state: JobState) -> JobRecord {
    let deadline = Instant::now() + GUARD;
    loop {
        if let Ok(Some(r)) = c.store.get_job(user, id).await
            && r.value.state == state
        {
            return r.value;
        }
        assert!(Instant::now() < deadline, "job {id} never became {state}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn create(c: &Cluster, user: &str, args: Value) -> JobId {
    let res = c.ok(user, methods::TOOLS_INVOKE_ASYNC, args).await;
    res["jobId"].as_str().expect("jobId").parse().expect("job id")
}

/// The workload; returns the cluster with its metrics filled in.
async fn workload(name: &str) -> Cluster {
    let c = Cluster::start(name, 1, 2, &[Plugin::echo("echo", &[])]).await;
    // Wait for the API (Front::serve confirms its subscriptions; this is a guard). Unauthenticated: counted
    // under tools.list / invalid_token, which no assertion looks at.
    let deadline = Instant::now() + GUARD;
    while c
        .app
        .request(subjects::api(methods::TOOLS_LIST), "{}".into())
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "the API never answered");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // 3 sync invokes, 1 failing one.
    for i in 0..3 {
        c.ok(
            "m",
            methods::TOOLS_INVOKE,
            json!({"tool_id": "echo.echo", "args": {"i": i}}),
        )
        .await;
    }
    let e = c
        .err(
            "m",
            methods::TOOLS_INVOKE,
            json!({"tool_id": "echo.fail", "args": {}}),
        )
        .await;
    assert_eq!(e.code, ApiErrorCode::ToolFailed, "{e:?}");
    // 2 async jobs, one with 3 progress events.
    let a = create(&c, "m", json!({"tool_id": "echo.echo"})).await;
    let b = create(&c, "m", json!({"tool_id": "echo.progress", "args": {"count": 3}})).await;
    wait_state(&c, "m", &a, JobState::Succeeded).await;
    wait_state(&c, "m", &b, JobState::Succeeded).await;
    // 5 long jobs of one user: the agent's 3 slots run (spec §12.2 HR-NT-06), 2 wait queued; the 6th is refused
    // by the quota; a cancel of a running one starts the 4th.
    let sleep = json!({"tool_id": "echo.sleep", "args": {"ms": 120_000}});
    let mut long = Vec::new();
    for _ in 0..5 {
        long.push(create(&c, "q", sleep.clone()).await);
    }
    for id in &long[..MAX_LONG_JOBS_PER_AGENT] {
        wait_state(&c, "q", id, JobState::Running).await;
    }
    let e = c.err("q", methods::TOOLS_INVOKE_ASYNC, sleep.clone()).await;
    assert_eq!(e.code, ApiErrorCode::JobQuotaExceeded, "{e:?}");
    let res = c
        .ok("q", methods::TOOLS_CANCEL_JOB, json!({"jobId": long[0]}))
        .await;
    assert_eq!(res["cancelled"], json!(true), "{res}");
    wait_state(&c, "q", &long[MAX_LONG_JOBS_PER_AGENT], JobState::Running).await;
    // One sweep records the active-job distribution (4 active jobs of one user: 3 running, 1 queued).
    fleet::sweeper::sweep(&c.fronts[0].0).await;
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workload_counts_and_promtool_check_metrics() {
    let promtool = require("promtool");
    let c = Box::pin(workload("metrics-counts")).await;
    // The worker-side counters settle once the jobs' invokes reached their sessions: 4 sync invokes, 2 jobs, and
    // the long jobs that ran (the agent's slots, plus the one the cancel started; the last still waits).
    let m = c.metrics.clone();
    let invoked = 4.0 + 2.0 + f64::from(u32::try_from(MAX_LONG_JOBS_PER_AGENT).unwrap()) + 1.0;
    assert!(
        eventually(GUARD, || {
            let t = m.encode();
            sample(&t, "cloud_agents_plugin_cold_starts_total")
                + sample(&t, "cloud_agents_plugin_warm_hits_total")
                >= invoked
        })
        .await,
        "invokes never all reached their sessions:\n{}",
        m.encode()
    );
    let text = c.metrics.encode();
    let expect = [
        (
            r#"cloud_agents_api_requests_total{method="tools.invoke",code="ok"}"#,
            3.0,
        ),
        (
            r#"cloud_agents_api_requests_total{method="tools.invoke",code="tool_failed"}"#,
            1.0,
        ),
        (
            r#"cloud_agents_api_requests_total{method="tools.invokeAsync",code="ok"}"#,
            7.0,
        ),
        (
            r#"cloud_agents_api_requests_total{method="tools.invokeAsync",code="job_quota_exceeded"}"#,
            1.0,
        ),
        (
            r#"cloud_agents_api_requests_total{method="tools.cancelJob",code="ok"}"#,
            1.0,
        ),
        (
            r#"cloud_agents_api_request_duration_seconds_count{method="tools.invoke"}"#,
            4.0,
        ),
        (r#"cloud_agents_rejections_total{kind="job_quota"}"#, 1.0),
        (
            r#"cloud_agents_job_transitions_total{from="new",to="queued"}"#,
            7.0,
        ),
        (
            r#"cloud_agents_job_transitions_total{from="queued",to="running"}"#,
            6.0,
        ),
        (
            r#"cloud_agents_job_transitions_total{from="running",to="succeeded"}"#,
            2.0,
        ),
        (
            r#"cloud_agents_job_transitions_total{from="running",to="cancelled"}"#,
            1.0,
        ),
        (
            r#"cloud_agents_job_queue_wait_seconds_count{tool_id="echo"}"#,
            6.0,
        ),
        (r#"cloud_agents_job_run_seconds_count{tool_id="echo"}"#, 2.0),
        (r#"cloud_agents_users_by_active_jobs{active="4"}"#, 1.0),
        (r#"cloud_agents_users_by_active_jobs{active="5"}"#, 0.0),
        (r#"cloud_agents_jobs_active{state="running"}"#, 3.0),
        (r#"cloud_agents_jobs_active{state="queued"}"#, 1.0),
        (r#"cloud_agents_progress_events_accepted_total"#, 3.0),
        (
            r#"cloud_agents_plugin_frame_errors_total{kind="invalid_json"}"#,
            0.0,
        ),
        (r#"cloud_agents_plugin_crashes_total"#, 0.0),
        (r#"cloud_agents_plugin_oom_kills_total"#, 0.0),
    ];
    let mut wrong = Vec::new();
    for (series, want) in expect {
        let got = sample(&text, series);
        if (got - want).abs() > f64::EPSILON {
            wrong.push(format!("{series}: {got}, expected {want}"));
        }
    }
    assert!(wrong.is_empty(), "{}\n\n{text}", wrong.join("\n"));
    // Invokes that completed: 4 sync + 2 jobs.
    assert_eq!(
        sample(&text, r#"cloud_agents_plugin_invokes_total{outcome="completed"}"#),
        6.0,
        "{text}"
    );
    // Every cold start has a duration; every invoke was a cold start or a warm hit.
    let cold = sample(&text, "cloud_agents_plugin_cold_starts_total");
    assert!(cold >= 1.0, "{text}");
    assert_eq!(
        sample(&text, "cloud_agents_plugin_cold_start_duration_seconds_count"),
        cold
    );
    // Plugins started from a sandbox stub are among those spawned; the pool's size is exported.
    assert!(
        sample(&text, "cloud_agents_plugin_stub_starts_total")
            <= sample(&text, "cloud_agents_plugin_spawns_total"),
        "{text}"
    );
    assert!(text.contains("\ncloud_agents_plugin_stubs_ready "), "{text}");
    // Live sessions: the catalogue describe session is shut down; m and q have one each somewhere.
    assert!(
        sample(&text, r#"cloud_agents_plugin_sessions{state="ready"}"#) >= 2.0,
        "{text}"
    );
    assert!(
        !text.contains("user=\""),
        "no series is labelled by user:\n{text}"
    );

    // promtool's linter accepts the exposition.
    let mut child = Command::new(&promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write");
    let out = child.wait_with_output().expect("promtool");
    assert!(
        out.status.success(),
        "promtool check metrics failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    c.shutdown().await;
}

/// A blocking HTTP/1.0 GET; the body.
fn http_get(addr: &str, path: &str) -> std::io::Result<String> {
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut buf = String::new();
    s.read_to_string(&mut buf)?;
    Ok(buf
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_string()))
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// Kills the Prometheus child on drop (by its pid), whatever the test did.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_prometheus_scrapes_the_fleet() {
    let prometheus = require("prometheus");
    let c = Box::pin(workload("metrics-scrape")).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let target = listener.local_addr().expect("addr").to_string();
    let server = tokio::spawn(fleet::metrics::serve(
        listener,
        c.metrics.clone(),
        Some(c.client.clone()),
    ));

    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: fleet\n    \
             static_configs:\n      - targets: ['{target}']\n"
        ),
    )
    .expect("config");
    let web = format!("127.0.0.1:{}", free_port());
    let _prom = Child(
        Command::new(prometheus)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={web}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("prometheus"),
    );
    // Targets appear ~5 s after start; poll until the fleet target is up and the series is there.
    let query = "/api/v1/query?query=cloud_agents_api_requests_total%7Bmethod%3D%22tools.invoke%22%2Ccode%3D%22ok%22%7D";
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = String::new();
    let value = loop {
        assert!(
            Instant::now() < deadline,
            "Prometheus never returned the series; last answer: {last}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
        let web2 = web.clone();
        let targets = tokio::task::spawn_blocking(move || http_get(&web2, "/api/v1/targets"))
            .await
            .expect("join");
        let Ok(targets) = targets else { continue };
        if !targets.contains(r#""health":"up""#) {
            last = targets;
            continue;
        }
        let web2 = web.clone();
        let Ok(Ok(body)) = tokio::task::spawn_blocking(move || http_get(&web2, query)).await else {
            continue;
        };
        let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
        if let Some(s) = v["data"]["result"][0]["value"][1].as_str() {
            break s.to_string();
        }
        last = body;
    };
    assert_eq!(value, "3", "tools.invoke ok as scraped by Prometheus");
    // A worker-side series made it too.
    let web2 = web.clone();
    let body = tokio::task::spawn_blocking(move || {
        http_get(
            &web2,
            "/api/v1/query?query=cloud_agents_job_transitions_total%7Bfrom%3D%22new%22%7D",
        )
    })
    .await
    .expect("join")
    .expect("query");
    let v: Value = serde_json::from_str(&body).expect("json");
    assert_eq!(v["data"]["result"][0]["value"][1], json!("7"), "{body}");
    server.abort();
    c.shutdown().await;
}

#[test]
fn promtool_check_rules_accepts_the_alerts() {
    let promtool = require("promtool");
    let rules: &Path = &workspace_root().join("deploy/prometheus/alerts.yml");
    let out = Command::new(promtool)
        .args(["check", "rules"])
        .arg(rules)
        .output()
        .expect("promtool");
    assert!(
        out.status.success(),
        "promtool check rules failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn grafana_dashboard_is_json_with_a_panel_per_group() {
    let path = workspace_root().join("deploy/grafana/cloud-agents.json");
    let d: Value = serde_json::from_slice(&std::fs::read(&path).expect("dashboard")).expect("JSON");
    let exprs: Vec<String> = d["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .filter_map(|t| t["expr"].as_str().map(str::to_string))
        .collect();
    for needle in [
        "cloud_agents_api_requests_total",
        "cloud_agents_api_request_duration_seconds_bucket",
        "cloud_agents_job_transitions_total",
        "cloud_agents_job_queue_wait_seconds_bucket",
        "cloud_agents_job_run_seconds_bucket",
        "cloud_agents_users_by_active_jobs",
        "cloud_agents_rejections_total",
        "cloud_agents_plugin_sessions",
        "cloud_agents_plugin_cold_starts_total",
        "cloud_agents_plugin_cold_start_duration_seconds_bucket",
        "cloud_agents_plugin_oom_kills_total",
        "cloud_agents_plugin_cgroup_memory_bytes",
        "cloud_agents_plugin_frames_read_total",
        "cloud_agents_plugin_frame_errors_total",
        "cloud_agents_progress_events_dropped_total",
        "cloud_agents_reverse_rpc_calls_total",
        "cloud_agents_nats_reconnects_total",
        "cloud_agents_jetstream_errors_total",
    ] {
        assert!(
            exprs.iter().any(|e| e.contains(needle)),
            "no panel queries {needle}"
        );
    }
}
