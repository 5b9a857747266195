//! Host memory per idle warm session (the job-path issue's scale figures): the resident memory of a worker process
//! — this process, hosting a `fleet_worker::Pool` as the e2e tests build it, with the production confinement of
//! `test_config` — with no session, then with N idle warm sessions of the Rust echo fixture (one per user; the
//! plugin processes themselves are other processes and not counted). Goal: ≤ 64 KiB per session.
//!
//! `cargo bench --bench session_memory` (env `FLEET_BENCH_SESSIONS`, default 1000). Memory is `VmRSS` of
//! `/proc/self/status`, read after the pool settled (every session idle, one invoke served each).
#![allow(
    clippy::unwrap_used,
    clippy::print_stdout,
    clippy::cast_possible_truncation,
    clippy::cast_precision_loss
)]

use fleet_e2e::worker::{Plugin, TestWorker, data, test_config};
use futures::StreamExt as _;
use serde_json::json;

/// The `fleet` binary's allocator: the fleet's parts run in this process.
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// The goal per session.
const GOAL_BYTES: u64 = 64 * 1024;
/// Sessions started at once.
const PARALLEL: usize = 16;

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    kib * 1024
}

fn main() {
    let sessions: usize = std::env::var("FLEET_BENCH_SESSIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut config = test_config("bench-mem");
        config.max_sessions = sessions + 16;
        let w = TestWorker::start(config, &[Plugin::echo("echo", &[])]);
        // One session first, so whatever is allocated once (the runtime's threads, the stub pool, the sandbox's
        // caches) is in the baseline.
        data(&w, "mem-base", "echo", "echo", json!({})).await;
        let before = rss_bytes();
        futures::stream::iter(0..sessions)
            .map(|i| {
                let w = &w;
                async move {
                    data(w, &format!("mem-{i}"), "echo", "echo", json!({"i": i})).await;
                }
            })
            .buffer_unordered(PARALLEL)
            .collect::<Vec<_>>()
            .await;
        assert_eq!(w.pool.len(), sessions + 1, "every session is still warm");
        let after = rss_bytes();
        let per = after.saturating_sub(before) / sessions as u64;
        println!(
            "session memory: worker RSS {:.1} MiB with 1 session, {:.1} MiB with {} idle warm sessions: {:.1} KiB per \
             session (goal ≤ {} KiB: {})",
            before as f64 / 1_048_576.0,
            after as f64 / 1_048_576.0,
            sessions + 1,
            per as f64 / 1024.0,
            GOAL_BYTES / 1024,
            if per <= GOAL_BYTES { "met" } else { "NOT met" }
        );
        w.pool.shutdown().await;
    });
}
