//! The job API against the number of active jobs in the fleet: `tools.getJob`, `tools.listJobs` and
//! `tools.invokeAsync` on a fleet holding 10 000 active jobs of 2 000 users (each at its 5-job quota) against the
//! same calls on a fleet holding 100 (20 users), interleaved call by call in one run.
//!
//! One process runs two fleets as the e2e tests do (`fleet_e2e::cluster`): each a real nats-server with JetStream
//! and authorization, one front replica (its per-user rate limit raised out of reach: a bench setting), no worker
//! (so every job stays `queued` and active: no worker runs it, none finishes). The jobs are written through the
//! store as the front writes them (`create_job`: the user's active-set slot, the record, the index), eight at a
//! time; setting up is not timed. Measured, from the `app` user's connection, on each fleet in turn:
//! - G `tools.getJob` of one of the active jobs (a different user's each call);
//! - L `tools.listJobs {}` of one of the users (5 jobs each);
//! - C `tools.invokeAsync` by a user with no job yet (a new one each call: the quota admission, the record, the
//!   index, the hand-off attempt that finds no worker and queues the job).
//!
//! Printed: p50/p99 of each measure on each fleet and the ratio of the large fleet to the small one (goal of the
//! job-path issue: no more than 1.5× at p99).
#![allow(
    clippy::unwrap_used,
    clippy::print_stdout,
    clippy::cast_possible_truncation,
    clippy::cast_precision_loss
)]

use fleet_benches::{pct, us};
use std::time::{Duration, Instant};

use async_nats::{HeaderMap, Request};
use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use fleet::front::FrontConfig;
use fleet_e2e::cluster::Cluster;
use fleet_proto::api::{JobId, methods, subjects};
use fleet_proto::limits::MAX_ACTIVE_JOBS_PER_USER;
use fleet_proto::util::now_ms;
use fleet_store::{JobRecord, Store};
use futures::StreamExt as _;
use serde_json::{Value, json};

/// The `fleet` binary's allocator: the fleet's parts run in this process.
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Users of the large fleet (each with `MAX_ACTIVE_JOBS_PER_USER` active jobs: 10 000 in all).
const MANY_USERS: usize = 2_000;
/// Users of the small fleet (100 active jobs).
const FEW_USERS: usize = 20;
/// Jobs written at once while setting up.
const SETUP_IN_FLIGHT: usize = 8;
/// Samples of each measure on each fleet in the full run.
const ROUNDS: usize = 300;

/// One queued job of `user` as `tools.invokeAsync` records it.
fn record(user: &str, created_at_ms: u64) -> JobRecord {
    let mut r = JobRecord::queued(
        fleet::node::new_invoke_id(),
        user,
        "echo.echo",
        "echo",
        "echo",
        created_at_ms,
        3_600_000,
    );
    r.args.insert("message".into(), json!("job_scale bench"));
    r.client_tag = Some("bench".into());
    r
}

/// Fills every one of `users` users' quota with queued jobs; (user, job) of each.
async fn populate(store: &Store, prefix: &str, users: usize) -> Vec<(String, JobId)> {
    let start = now_ms();
    let jobs = users * MAX_ACTIVE_JOBS_PER_USER;
    futures::stream::iter(0..jobs)
        .map(|i| {
            let store = store.clone();
            let user = format!("{prefix}-{}", i % users);
            async move {
                let r = record(&user, start + i as u64);
                let id = r.job_id.clone();
                store.create_job(r, MAX_ACTIVE_JOBS_PER_USER).await.unwrap();
                (user, id)
            }
        })
        .buffer_unordered(SETUP_IN_FLIGHT)
        .collect()
        .await
}

/// One fleet and its jobs.
struct Fleet {
    cluster: Cluster,
    jobs: Vec<(String, JobId)>,
    users: usize,
    /// `invokeAsync` callers so far (each a new user).
    fresh: usize,
}

impl Fleet {
    async fn new(name: &str, users: usize) -> Fleet {
        let mut cluster = Cluster::start(name, 0, 0, &[]).await;
        cluster
            .add_front_with(FrontConfig {
                rate_per_user: 1_000_000_000,
                burst_per_user: 1_000_000_000,
                ..FrontConfig::default()
            })
            .await;
        cluster.wait_for_api(Duration::from_secs(30)).await;
        let t = Instant::now();
        let jobs = populate(&cluster.store, "scale", users).await;
        println!(
            "{name}: {} active jobs of {users} users written in {:.1} s",
            jobs.len(),
            t.elapsed().as_secs_f64()
        );
        Fleet {
            cluster,
            jobs,
            users,
            fresh: 0,
        }
    }

    fn headers(&self, user: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            subjects::AUTH_HEADER,
            format!("Bearer {}", self.cluster.token(user)).as_str(),
        );
        h
    }

    /// One API call as `user`; the time and the result.
    async fn call(&self, user: &str, method: &str, args: &Value) -> (Duration, Value) {
        let request = Request::new()
            .headers(self.headers(user))
            .payload(Bytes::from(serde_json::to_vec(args).unwrap()));
        let t = Instant::now();
        let reply = self
            .cluster
            .app
            .send_request(subjects::api(method), request)
            .await
            .unwrap();
        let d = t.elapsed();
        let value: Value = serde_json::from_slice(&reply.payload).unwrap();
        assert_eq!(value["ok"], true, "{method} {value}");
        (d, value["result"].clone())
    }

    /// G: `getJob` of the `n`-th job (spread over the users).
    async fn get_job(&self, n: usize) -> Duration {
        let (user, job) = &self.jobs[(n * 7_919) % self.jobs.len()];
        let (d, r) = self
            .call(user, methods::TOOLS_GET_JOB, &json!({ "jobId": job }))
            .await;
        assert_eq!(r["state"], "queued", "{r}");
        d
    }

    /// L: `listJobs {}` of the `n`-th user.
    async fn list_jobs(&self, n: usize) -> Duration {
        let user = format!("scale-{}", (n * 7_919) % self.users);
        let (d, r) = self.call(&user, methods::TOOLS_LIST_JOBS, &json!({})).await;
        assert_eq!(
            r["jobs"].as_array().map(Vec::len),
            Some(MAX_ACTIVE_JOBS_PER_USER),
            "{r}"
        );
        d
    }

    /// C: `invokeAsync` by a new user.
    async fn invoke_async(&mut self) -> Duration {
        self.fresh += 1;
        let user = format!("fresh-{}", self.fresh);
        let (d, r) = self
            .call(
                &user,
                methods::TOOLS_INVOKE_ASYNC,
                &json!({ "tool_id": "echo.echo", "args": {} }),
            )
            .await;
        assert_eq!(r["state"], "queued", "{r}");
        d
    }
}

fn bench(_c: &mut Criterion) {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--test") || !args.iter().any(|a| a == "--bench");
    let (few, many, rounds) = if quick {
        (2, 20, 3)
    } else {
        (FEW_USERS, MANY_USERS, ROUNDS)
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut fleets = rt.block_on(async {
        let small = Box::pin(Fleet::new("bench-scale-small", few)).await;
        let large = Box::pin(Fleet::new("bench-scale-large", many)).await;
        [small, large]
    });
    // [fleet][measure: G, L, C]
    let mut samples: Vec<Vec<Vec<Duration>>> = vec![vec![Vec::new(); 3]; 2];
    rt.block_on(async {
        for n in 0..rounds {
            for (f, fleet) in fleets.iter_mut().enumerate() {
                samples[f][0].push(fleet.get_job(n).await);
                samples[f][1].push(fleet.list_jobs(n).await);
                samples[f][2].push(fleet.invoke_async().await);
            }
        }
    });
    let stats = |v: &mut Vec<Duration>| {
        v.sort();
        (pct(v, 50.0), pct(v, 99.0))
    };
    println!();
    println!(
        "job_scale ({}, {rounds} rounds; 1 front, no worker; {} vs {} active jobs)",
        if quick {
            "smoke run, not a measurement"
        } else {
            "interleaved"
        },
        few * MAX_ACTIVE_JOBS_PER_USER,
        many * MAX_ACTIVE_JOBS_PER_USER,
    );
    println!(
        "{:<28} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9}",
        "measure", "small p50", "small p99", "large p50", "large p99", "p50 ×", "p99 ×"
    );
    for (m, name) in ["G tools.getJob", "L tools.listJobs {}", "C tools.invokeAsync"]
        .iter()
        .enumerate()
    {
        let (s50, s99) = stats(&mut samples[0][m]);
        let (l50, l99) = stats(&mut samples[1][m]);
        println!(
            "{name:<28} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>8.2}x {:>8.2}x",
            us(s50),
            us(s99),
            us(l50),
            us(l99),
            l50.as_secs_f64() / s50.as_secs_f64(),
            l99.as_secs_f64() / s99.as_secs_f64()
        );
    }
    rt.block_on(async {
        for fleet in fleets {
            fleet.cluster.shutdown().await;
        }
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
