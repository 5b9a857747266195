//! Async concurrency of the fleet (the job-path issue's goals), measured end to end on a real fleet as the e2e
//! tests build it (`fleet_e2e::cluster`: a nats-server with JetStream and authorization, one front, worker nodes
//! over the echo fixture in cgroups, real JWTs):
//!
//! - **burst** — U users (`FLEET_BENCH_USERS`, default 100), each with a warm session, submit one `echo.sleep` job
//!   of D = 2 s at once to one worker with its default capacity. Reported: the time from the first submission
//!   until the last job succeeded, and until the last job started, from the job records' own timestamps; the
//!   floor is D (every job started at once). Goal: 100 users within 3 s.
//! - **start after a slot frees** — a worker with capacity K = 10 gets 2K jobs of D2 = 500 ms from 2K users at
//!   once: K start, K wait in the job queue. The i-th start of the waiting wave is matched with the i-th end of the
//!   first wave (both sorted); the delay between them is how long a freed slot stayed idle. Three rounds. Goal:
//!   p99 ≤ 50 ms; shown beside the sweeper period (1 s) that used to start queued jobs.
//!
//! `cargo bench --bench job_concurrency`. Timestamps are the records' (ms), so every figure is ±1 ms.
#![allow(
    clippy::unwrap_used,
    clippy::print_stdout,
    clippy::cast_possible_truncation,
    clippy::cast_precision_loss
)]

use std::time::Duration;

use fleet_e2e::cluster::Cluster;
use fleet_e2e::worker::Plugin;
use fleet_proto::api::{JobId, JobState, methods};
use fleet_proto::util::now_ms;
use fleet_store::JobRecord;
use futures::StreamExt as _;
use serde_json::json;

/// The `fleet` binary's allocator: the fleet's parts run in this process.
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// The burst's job length.
const BURST_JOB_MS: u64 = 2_000;
/// The burst goal: every job done within this.
const BURST_GOAL_MS: u64 = 3_000;
/// The second phase's worker capacity, job length and rounds.
const CAPACITY: usize = 10;
const WAVE_JOB_MS: u64 = 500;
const ROUNDS: usize = 3;
/// The start-delay goal (p99).
const START_GOAL_MS: u64 = 50;
/// Calls in flight while warming sessions.
const WARM_PARALLEL: usize = 16;

fn plugin() -> Plugin {
    // The fixture serves each invoke on a thread of its own.
    Plugin::echo("echo", &[]).limits(json!({ "pids_max": 256 }))
}

async fn warm(c: &Cluster, users: &[String]) {
    futures::stream::iter(users)
        .map(|u| {
            c.ok(
                u,
                methods::TOOLS_INVOKE,
                json!({"tool_id": "echo.echo", "args": {}}),
            )
        })
        .buffer_unordered(WARM_PARALLEL)
        .collect::<Vec<_>>()
        .await;
}

/// Submits one `echo.sleep` job of `ms` per user, all at once.
async fn submit(c: &Cluster, users: &[String], ms: u64) -> Vec<(String, JobId)> {
    let calls = users.iter().map(|u| async move {
        let res = c
            .ok(
                u,
                methods::TOOLS_INVOKE_ASYNC,
                json!({"tool_id": "echo.sleep", "args": {"ms": ms}}),
            )
            .await;
        let id: JobId = res["jobId"].as_str().unwrap().parse().unwrap();
        (u.clone(), id)
    });
    futures::future::join_all(calls).await
}

/// Waits until every job is terminal; their records.
async fn finished(c: &Cluster, jobs: &[(String, JobId)]) -> Vec<JobRecord> {
    loop {
        let mut records = Vec::with_capacity(jobs.len());
        for (u, id) in jobs {
            records.push(c.store.get_job(u, id).await.unwrap().unwrap().value);
        }
        if records.iter().all(|r| r.state.is_terminal()) {
            for r in &records {
                assert_eq!(r.state, JobState::Succeeded, "{r:?}");
            }
            return records;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

async fn burst(users: usize) {
    let mut c = Cluster::start("bench-burst", 1, 0, &[plugin()]).await;
    c.wait_for_api(Duration::from_secs(30)).await;
    c.add_worker().await;
    let names: Vec<String> = (0..users).map(|i| format!("burst-{i}")).collect();
    warm(&c, &names).await;
    let t0 = now_ms();
    let jobs = submit(&c, &names, BURST_JOB_MS).await;
    let submitted = now_ms() - t0;
    let records = finished(&c, &jobs).await;
    let last_start = records.iter().filter_map(|r| r.started_at_ms).max().unwrap() - t0;
    let last_end = records.iter().filter_map(|r| r.finished_at_ms).max().unwrap() - t0;
    println!(
        "burst: {users} users × one {BURST_JOB_MS} ms job on one worker: all submitted in {submitted} ms, last \
         started at {last_start} ms, all succeeded at {last_end} ms = {:.2}× the job itself (goal: ≤ {BURST_GOAL_MS} ms: {})",
        last_end as f64 / BURST_JOB_MS as f64,
        if last_end <= BURST_GOAL_MS {
            "met"
        } else {
            "NOT met"
        }
    );
    c.shutdown().await;
}

async fn start_after_free() {
    let mut c = Cluster::start("bench-free", 1, 0, &[plugin()]).await;
    c.wait_for_api(Duration::from_secs(30)).await;
    c.add_worker_with("bench-free-w0", |w| w.job_capacity = CAPACITY)
        .await;
    let mut delays = Vec::new();
    for round in 0..ROUNDS {
        let names: Vec<String> = (0..2 * CAPACITY).map(|i| format!("free-{round}-{i}")).collect();
        warm(&c, &names).await;
        let jobs = submit(&c, &names, WAVE_JOB_MS).await;
        let records = finished(&c, &jobs).await;
        let mut starts: Vec<u64> = records.iter().filter_map(|r| r.started_at_ms).collect();
        starts.sort_unstable();
        // The first K starts are the first wave; their ends free the slots the last K starts take.
        let mut first_wave: Vec<&JobRecord> = records
            .iter()
            .filter(|r| r.started_at_ms.is_some_and(|s| s <= starts[CAPACITY - 1]))
            .collect();
        first_wave.sort_by_key(|r| r.finished_at_ms);
        let ends: Vec<u64> = first_wave
            .iter()
            .take(CAPACITY)
            .filter_map(|r| r.finished_at_ms)
            .collect();
        for (start, end) in starts[CAPACITY..].iter().zip(&ends) {
            delays.push(start.saturating_sub(*end));
        }
    }
    delays.sort_unstable();
    let p99 = percentile(&delays, 0.99);
    println!(
        "start after a slot frees: capacity {CAPACITY}, {} waiting jobs over {ROUNDS} rounds: delay p50 {} ms, p99 {p99} ms, \
         max {} ms (goal p99 ≤ {START_GOAL_MS} ms: {}); the sweeper period that used to start them: {} ms",
        delays.len(),
        percentile(&delays, 0.5),
        delays.last().unwrap(),
        if p99 <= START_GOAL_MS { "met" } else { "NOT met" },
        fleet::sweeper::SWEEP_EVERY.as_millis()
    );
    c.shutdown().await;
}

fn main() {
    let users: usize = std::env::var("FLEET_BENCH_USERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        Box::pin(burst(users)).await;
        Box::pin(start_after_free()).await;
    });
}
