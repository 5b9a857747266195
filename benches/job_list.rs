//! `tools.listJobs` against the number of jobs a user keeps: the same calls for a user with 100 jobs and for one
//! with 10 000 (`limits::MAX_RETAINED_JOBS_PER_USER`), interleaved in one run, with a single JetStream KV read as
//! the physical floor.
//!
//! One process runs a fleet as the e2e tests do (`fleet_e2e::cluster`): a real nats-server with JetStream and
//! authorization, one front replica (its per-user rate limit raised out of reach: a bench setting, see
//! `Bench::new`), no worker. The jobs are written through the store as the front writes them (`create_job`, then
//! a transition to `cancelled`, which gives the quota slot back), four at a time, created "now" so the 7-day
//! lookback keeps them all. Measured, from the `app` user's connection:
//! - L20 `tools.listJobs {}` (the default page of 20, newest first) and L100 `{limit: 100}`, for each user;
//! - Lf `tools.listJobs {state: "expired"}`: a filter no job matches, so a call reads as far as it may;
//! - F one JetStream KV `entry` read of a job record (the `front` user).
//!
//! The interleaved pass runs every measure in turn, round after round, and prints p50/p99 and the ratios of the
//! 10 000-job user to the 100-job user. Setting up the 10 000 jobs takes a few seconds and is not timed.
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
use fleet_proto::api::{JobId, JobState, ListJobsResult, methods, subjects, user_key};
use fleet_proto::util::now_ms;
use fleet_store::{JobRecord, Store, Transition};
use futures::StreamExt as _;
use serde_json::{Value, json};

/// The `fleet` binary's allocator: the fleet's parts run in this process.
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// The small user's jobs.
const FEW: usize = 100;
/// The large user's jobs: the most one user may keep.
const MANY: usize = fleet_proto::limits::MAX_RETAINED_JOBS_PER_USER;
/// Jobs written at once while setting up.
const SETUP_IN_FLIGHT: usize = 4;
/// Every measure's samples in the full run.
const ROUNDS: usize = 300;

/// One job of `user` as `tools.invokeAsync` records it.
fn record(user: &str, created_at_ms: u64) -> JobRecord {
    let mut r = JobRecord::queued(
        fleet::node::new_invoke_id(),
        user,
        "echo.echo",
        "echo",
        "echo",
        created_at_ms,
        1_800_000,
    );
    r.args.insert("message".into(), json!("job_list bench"));
    r.client_tag = Some("bench".into());
    r
}

/// Writes `count` cancelled jobs of `user`; their ids.
async fn populate(store: &Store, user: &str, count: usize) -> Vec<JobId> {
    let start = now_ms();
    futures::stream::iter(0..count)
        .map(|i| {
            let store = store.clone();
            async move {
                let r = record(user, start + i as u64);
                let id = r.job_id.clone();
                store.create_job(r, 2 * SETUP_IN_FLIGHT).await.unwrap();
                let t = store
                    .transition(user, &id, JobState::Cancelled, |_| {})
                    .await
                    .unwrap();
                assert!(matches!(t, Transition::Done(_)), "{t:?}");
                id
            }
        })
        .buffer_unordered(SETUP_IN_FLIGHT)
        .collect()
        .await
}

struct Bench {
    cluster: Option<Cluster>,
    few: String,
    many: String,
    /// `Authorization` headers of the two users.
    headers: [(String, HeaderMap); 2],
    jobs_kv: async_nats::jetstream::kv::Store,
    /// A record's key for F.
    some_key: String,
}

impl Bench {
    async fn new(few: usize, many: usize) -> Bench {
        let mut cluster = Cluster::start("bench-list", 0, 0, &[]).await;
        // A bench setting: the per-user rate limit (50/s, burst 100 by default) out of reach, since each user
        // makes its `tools.listJobs` calls back to back here, far above 50 a second (at the default, the calls
        // beyond the burst answer `rate_limited`); the limiter is still consulted on every call.
        cluster
            .add_front_with(FrontConfig {
                rate_per_user: 1_000_000_000,
                burst_per_user: 1_000_000_000,
                ..FrontConfig::default()
            })
            .await;
        cluster.wait_for_api(Duration::from_secs(30)).await;
        let (u_few, u_many) = (format!("list-{few}"), format!("list-{many}"));
        let t = Instant::now();
        let ids = populate(&cluster.store, &u_few, few).await;
        populate(&cluster.store, &u_many, many).await;
        println!(
            "setup: {} jobs written in {:.1} s",
            few + many,
            t.elapsed().as_secs_f64()
        );
        let header = |user: &str| {
            let mut h = HeaderMap::new();
            h.insert(
                subjects::AUTH_HEADER,
                format!("Bearer {}", cluster.token(user)).as_str(),
            );
            (user.to_owned(), h)
        };
        let headers = [header(&u_few), header(&u_many)];
        let jobs_kv = async_nats::jetstream::new(cluster.client.clone())
            .get_key_value(cluster.store.settings().jobs_bucket())
            .await
            .unwrap();
        let some_key = format!("{}.{}", user_key(&u_few), ids[0]);
        Bench {
            cluster: Some(cluster),
            few: u_few,
            many: u_many,
            headers,
            jobs_kv,
            some_key,
        }
    }

    fn cluster(&self) -> &Cluster {
        self.cluster.as_ref().unwrap()
    }

    /// One `tools.listJobs` of `user` with `args`; the time and the jobs listed.
    async fn list(&self, user: &str, args: &Value, expect: usize) -> Duration {
        let headers = &self.headers.iter().find(|(u, _)| u == user).unwrap().1;
        let body = Bytes::from(serde_json::to_vec(args).unwrap());
        let t = Instant::now();
        let reply = self
            .cluster()
            .app
            .send_request(
                subjects::api(methods::TOOLS_LIST_JOBS),
                Request::new().headers(headers.clone()).payload(body),
            )
            .await
            .unwrap();
        let d = t.elapsed();
        let value: Value = serde_json::from_slice(&reply.payload).unwrap();
        assert_eq!(value["ok"], true, "{value}");
        let result: ListJobsResult = serde_json::from_value(value["result"].clone()).unwrap();
        assert_eq!(result.jobs.len(), expect, "{user} {args}");
        d
    }

    /// F: one KV read of a job record.
    async fn kv_get(&self) -> Duration {
        let t = Instant::now();
        let entry = self.jobs_kv.entry(self.some_key.as_str()).await.unwrap();
        let d = t.elapsed();
        assert!(entry.is_some());
        d
    }
}

fn bench(c: &mut Criterion) {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--test") || !args.iter().any(|a| a == "--bench");
    let (few, many, rounds) = if quick { (5, 50, 3) } else { (FEW, MANY, ROUNDS) };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let b = rt.block_on(Box::pin(Bench::new(few, many)));
    let (u_few, u_many) = (b.few.clone(), b.many.clone());
    let default = json!({});
    let hundred = json!({"limit": 100});
    let none = json!({"state": "expired"});
    {
        let mut g = c.benchmark_group("job_list");
        g.sample_size(10)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2));
        for (name, user, jobs) in [("L20_few", &u_few, few), ("L20_many", &u_many, many)] {
            g.bench_function(name, |bn| {
                bn.iter_custom(|iters| {
                    rt.block_on(async {
                        let mut sum = Duration::ZERO;
                        for _ in 0..iters {
                            sum += b.list(user, &default, 20.min(jobs)).await;
                        }
                        sum
                    })
                });
            });
        }
        g.finish();
    }
    // (name, user, args, jobs expected)
    let measures: Vec<(&str, &String, &Value, usize)> = vec![
        ("L20 few", &u_few, &default, 20.min(few)),
        ("L20 many", &u_many, &default, 20.min(many)),
        ("L100 few", &u_few, &hundred, 100.min(few)),
        ("L100 many", &u_many, &hundred, 100.min(many)),
        ("Lf few (filter matching none)", &u_few, &none, 0),
        ("Lf many (filter matching none)", &u_many, &none, 0),
    ];
    let mut samples: Vec<Vec<Duration>> = vec![Vec::new(); measures.len() + 1];
    rt.block_on(async {
        for _ in 0..rounds {
            for (i, (_, user, args, expect)) in measures.iter().enumerate() {
                samples[i].push(b.list(user, args, *expect).await);
            }
            let f = b.kv_get().await;
            samples[measures.len()].push(f);
        }
    });
    let stats: Vec<(Duration, Duration)> = samples
        .iter_mut()
        .map(|v| {
            v.sort();
            (pct(v, 50.0), pct(v, 99.0))
        })
        .collect();
    println!();
    println!(
        "job_list ({}, {rounds} rounds; 1 front, users with {few} and {many} jobs)",
        if quick {
            "smoke run, not a measurement"
        } else {
            "interleaved"
        }
    );
    println!(
        "{:<36} {:>10} {:>10} {:>8}",
        "measure", "p50 µs", "p99 µs", "p50/F"
    );
    let floor = stats[measures.len()].0;
    for (i, (name, ..)) in measures.iter().enumerate() {
        let (p50, p99) = stats[i];
        println!(
            "{name:<36} {:>10.1} {:>10.1} {:>7.2}x",
            us(p50),
            us(p99),
            p50.as_secs_f64() / floor.as_secs_f64()
        );
    }
    let (f50, f99) = stats[measures.len()];
    println!(
        "{:<36} {:>10.1} {:>10.1}",
        "F JetStream KV get (a job record)",
        us(f50),
        us(f99)
    );
    println!();
    for (label, a, z) in [("L20", 0, 1), ("L100", 2, 3), ("Lf", 4, 5)] {
        println!(
            "{label:<5} {many} jobs / {few} jobs: p50 {:>6.2}x  p99 {:>6.2}x",
            stats[z].0.as_secs_f64() / stats[a].0.as_secs_f64(),
            stats[z].1.as_secs_f64() / stats[a].1.as_secs_f64()
        );
    }
    let mut b = b;
    if let Some(cluster) = b.cluster.take() {
        rt.block_on(cluster.shutdown());
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
