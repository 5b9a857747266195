//! The worker's `health` probe (spec §3.6) against the fixture plugin's `--health MODE`: `ready|ok|healthy` →
//! Healthy, `initializing` → Starting, `error` → Unhealthy, -32601 → Healthy, no answer within the 3 s
//! `HEALTH_TIMEOUT` → Unhealthy; and a session whose process never started reports Starting.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use fleet_e2e::worker::{Plugin, TestWorker, test_config};
use fleet_proto::executa::lifecycle::Health;
use fleet_proto::limits::HEALTH_TIMEOUT;
use fleet_worker::session::{InvokeRequest, SessionState};
use serde_json::{Map, json};

/// Failure guard only.
const GUARD: Duration = Duration::from_secs(60);

/// Starts a worker whose only plugin answers `health` as `mode` says, prewarms it and probes it once.
async fn probe(name: &str, mode: &str) -> (Health, Duration) {
    let w = TestWorker::start(test_config(name), &[Plugin::echo("echo", &["--health", mode])]);
    let s = w.pool.prewarm("alice", "echo", GUARD).await.unwrap();
    assert_eq!(s.state(), SessionState::Ready);
    let t = Instant::now();
    let health = tokio::time::timeout(GUARD, s.health())
        .await
        .expect("failure guard");
    let took = t.elapsed();
    // The session survives a probe, whatever the answer: health never restarts or stops it.
    assert_eq!(s.state(), SessionState::Ready, "mode {mode}");
    w.pool.shutdown().await;
    (health, took)
}

#[tokio::test]
async fn ready_is_healthy() {
    assert_eq!(probe("h-ready", "ready").await.0, Health::Healthy);
}

#[tokio::test]
async fn ok_is_healthy() {
    assert_eq!(probe("h-ok", "ok").await.0, Health::Healthy);
}

#[tokio::test]
async fn healthy_is_healthy() {
    assert_eq!(probe("h-healthy", "healthy").await.0, Health::Healthy);
}

#[tokio::test]
async fn initializing_is_starting() {
    assert_eq!(probe("h-init", "initializing").await.0, Health::Starting);
}

#[tokio::test]
async fn error_is_unhealthy() {
    assert_eq!(probe("h-error", "error").await.0, Health::Unhealthy);
}

#[tokio::test]
async fn method_not_found_counts_as_healthy() {
    assert_eq!(probe("h-mnf", "method-not-found").await.0, Health::Healthy);
}

#[tokio::test]
async fn no_answer_is_unhealthy_after_the_health_timeout() {
    let (health, took) = probe("h-hang", "hang").await;
    assert_eq!(health, Health::Unhealthy);
    assert!(took >= HEALTH_TIMEOUT, "gave up after {took:?}");
    assert!(took < HEALTH_TIMEOUT + Duration::from_secs(2), "took {took:?}");
}

#[tokio::test]
async fn an_unanswered_probe_leaves_the_session_serving() {
    // The abandoned health request must not wedge the multiplexer: the next calls are answered.
    let w = TestWorker::start(
        test_config("h-hang-then"),
        &[Plugin::echo("echo", &["--health", "hang"])],
    );
    let s = w.pool.prewarm("alice", "echo", GUARD).await.unwrap();
    assert_eq!(s.health().await, Health::Unhealthy);
    let pid = s.pid();
    assert!(pid.is_some());
    assert_eq!(s.health().await, Health::Unhealthy);
    assert_eq!(s.pid(), pid, "a failed probe does not restart the plugin");
    let mut arguments = Map::new();
    arguments.insert("n".into(), json!(1));
    let req = InvokeRequest {
        tool: "echo".into(),
        arguments,
        invoke_id: format!("health-{}", std::process::id()),
        ..InvokeRequest::default()
    };
    let out = tokio::time::timeout(GUARD, s.invoke(req))
        .await
        .expect("failure guard")
        .unwrap();
    assert!(out.warm);
    assert_eq!(out.data().unwrap()["arguments"], json!({ "n": 1 }));
    w.pool.shutdown().await;
}

#[tokio::test]
async fn a_session_never_started_reports_starting_without_starting_it() {
    let w = TestWorker::start(test_config("h-idle"), &[Plugin::echo("echo", &[])]);
    let s = w.pool.session("alice", "echo").unwrap();
    assert_eq!(s.state(), SessionState::Idle);
    // Idle (like Starting and Backoff) is reported as Starting: no process to ask yet.
    assert_eq!(s.health().await, Health::Starting);
    // The probe does not create demand: the session is still Idle, no process was spawned.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(s.state(), SessionState::Idle);
    assert_eq!(s.pid(), None);
    w.pool.shutdown().await;
    // Closed is no longer "on its way": Unhealthy.
    assert_eq!(s.state(), SessionState::Closed);
    assert_eq!(s.health().await, Health::Unhealthy);
}
