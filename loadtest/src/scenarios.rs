//! The scenario catalogue. Every scenario drives the demo plugins `fleet up` serves: `echo-py` (tools `echo`,
//! `sleep {ms}`, `progress {count}`, `fail`, `big_result {bytes}`), `notes-py` (the same script with
//! `--services`: `reverse {method, params}`) and, when `tools.list` shows it, the native `echo`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fleet_proto::admin::grants;
use fleet_proto::api::{CancelJobArgs, InvokeArgs, JobState, ListJobsArgs};
use serde_json::{Value, json};

use crate::engine::{Arrivals, CallError, Ctx, open_loop, to_u64};
use crate::replicas::Replicas;

/// One entry of the catalogue.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scenario {
    /// `loadtest run NAME`.
    pub(crate) name: &'static str,
    /// One line, for `loadtest list` and the report.
    pub(crate) description: &'static str,
    /// Whether it can run yet.
    pub(crate) implemented: bool,
    /// Default `--rate` (arrivals per second).
    pub(crate) default_rate: f64,
    /// NATS servers `--spawn` starts (`fleet up --nats-cluster N`; 1: one server).
    pub(crate) nats_cluster: usize,
}

/// Every scenario, in `list` order.
pub(crate) const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "steady-async",
        description: "open-model constant arrival rate of invokeAsync(echo-py.echo), each job polled with getJob until terminal",
        implemented: true,
        default_rate: 20.0,
        nats_cluster: 1,
    },
    Scenario {
        name: "steady-sync",
        description: "open-model constant arrival rate of sync tools.invoke(echo) over 20 users (raise --users with --rate for the knee)",
        implemented: true,
        default_rate: 20.0,
        nats_cluster: 1,
    },
    Scenario {
        name: "sync-burst",
        description: "each second, the second's whole quota of sync tools.invoke(echo) arrives at once (20 users)",
        implemented: true,
        default_rate: 20.0,
        nats_cluster: 1,
    },
    Scenario {
        name: "cold-start-storm",
        description: "bursts of brand-new users (one per request) calling tools.invoke(echo): every call is a plugin cold start",
        implemented: true,
        default_rate: 5.0,
        nats_cluster: 1,
    },
    Scenario {
        name: "quota-flood",
        description: "few users submitting 1.5 s sleep jobs faster than they finish: beyond 5 active jobs each gets job_quota_exceeded, accepted jobs all finish",
        implemented: true,
        default_rate: 10.0,
        nats_cluster: 1,
    },
    Scenario {
        name: "cancel-storm",
        description: "invokeAsync(sleep 10 s) then cancelJob 50-300 ms later; every job must end cancelled (counter not_cancelled)",
        implemented: true,
        default_rate: 10.0,
        nats_cluster: 1,
    },
    Scenario {
        name: "progress-flood",
        description: "jobs emitting 200 progress events each, read back incrementally with getJob sinceSeq (counter progress_events)",
        implemented: true,
        default_rate: 5.0,
        nats_cluster: 1,
    },
    Scenario {
        name: "big-frames",
        description: "results near the caps: sync invoke of a ~4 MB result (cap 4 MiB) alternating with async jobs of a ~240 KB result (cap 256 KB)",
        implemented: true,
        default_rate: 4.0,
        nats_cluster: 1,
    },
    Scenario {
        name: "fairness",
        description: "one noisy tenant (4x the rate of 1 s sleep jobs, hitting quota and rate limits) vs 10 quiet users' sync echo: quiet p99 must hold",
        implemented: true,
        default_rate: 10.0,
        nats_cluster: 1,
    },
    Scenario {
        name: "chaos-worker-kill",
        description: "starts 2 extra `fleet worker` processes, SIGKILLs one halfway through a mix of async sleep jobs and sync echo: no job may be lost (they fail with worker_lost)",
        implemented: true,
        default_rate: 10.0,
        nats_cluster: 1,
    },
    Scenario {
        name: "hostile-neighbour",
        description: "one hostile tenant driving the native echo's spin/alloc/fork (half the rate) next to 10 quiet users' sync echo-py echo: quiet p99 must hold (needs the native `echo` plugin)",
        implemented: true,
        default_rate: 10.0,
        nats_cluster: 1,
    },
    Scenario {
        name: "host-storage",
        description: "APS KV through the host services: 10 granted users' sync notes-py invokes each doing one storage/set or storage/get reverse call, against the same plugin's plain echo measured first in the same run (counter storage_errors)",
        implemented: true,
        default_rate: 20.0,
        nats_cluster: 1,
    },
    Scenario {
        name: "mixed",
        description: "a weighted mix: 40% sync echo, 30% async echo, 10% async progress, 10% async sleep + cancel, 10% listJobs",
        implemented: true,
        default_rate: 20.0,
        nats_cluster: 1,
    },
    Scenario {
        name: "rolling-workers",
        description: "starts 2 extra `fleet worker` processes, then replaces each in turn (a new one registers, the old one gets SIGTERM and drains) during async sleep jobs and sync echo: no call may fail and no job be lost; counters workers_rolled, longest_gap_ms (without a successful probe call)",
        implemented: true,
        default_rate: 10.0,
        nats_cluster: 1,
    },
    Scenario {
        name: "rolling-fronts",
        description: "starts 2 extra front replicas (`fleet up --workers 0 --nats-url …`), then replaces each in turn (a new one serves, the old one gets SIGTERM and drains) during async sleep jobs and sync echo: no call may fail and no job be lost; counters fronts_rolled, longest_gap_ms (without a successful probe call)",
        implemented: true,
        default_rate: 10.0,
        nats_cluster: 1,
    },
    Scenario {
        name: "nats-node-kill",
        description: "on a 3-node NATS cluster (--spawn starts `fleet up --nats-cluster 3`), SIGKILLs the node leading the active-set bucket a third of the way through async sleep jobs and sync echo, restarts it at two thirds: no accepted job may be lost; counters recovery_ms (kill to the first successful probe call sent after it), longest_gap_ms (without a successful probe), catch_up_ms (restart to every stream current)",
        implemented: true,
        default_rate: 10.0,
        nats_cluster: 3,
    },
];

/// Looks a scenario up by name.
pub(crate) fn find(name: &str) -> Option<&'static Scenario> {
    SCENARIOS.iter().find(|s| s.name == name)
}

/// What a scenario runs with.
#[derive(Debug, Clone)]
pub(crate) struct Params {
    /// Arrivals per second.
    pub(crate) rate: f64,
    /// Length of the arrival phase.
    pub(crate) duration: Duration,
    /// Whether the native `echo` plugin is served.
    pub(crate) native_echo: bool,
    /// How many users the load is spread over (`--users`; default: the scenario's own count).
    pub(crate) users: Option<u64>,
    /// Where and as whom the worker processes `chaos-worker-kill` starts connect.
    pub(crate) worker_nats: fleet_client::nats_conn::Connector,
    /// The fleet's data dir (`nats-node-kill` finds the cluster's nodes under it).
    pub(crate) data_dir: std::path::PathBuf,
    /// Whether the fleet is this run's own `--spawn` (a node it restarts is then stopped at the end).
    pub(crate) spawned: bool,
    /// The fleet's NATS auth material (`rolling-fronts` starts fronts with it).
    pub(crate) auth_dir: std::path::PathBuf,
}

const SYNC_WAIT: Duration = Duration::from_secs(30);
/// How long an operator call (a grant) may take.
const OPERATOR_WAIT: Duration = Duration::from_secs(10);
const PY: &str = "echo-py";
/// The host-services demo plugin (`plugins/notes-py`).
const NOTES: &str = "notes-py";
/// Users of `host-storage`.
const STORAGE_USERS: u64 = 10;

/// A call of `tool` of `tool_id` with `args` (an object: anything else sends no arguments).
fn invoke_body(tool_id: &str, tool: &str, args: &Value) -> InvokeArgs {
    InvokeArgs {
        tool_id: tool_id.to_owned(),
        method: Some(tool.to_owned()),
        args: args.as_object().cloned(),
        timeout_ms: None,
    }
}

/// How many users a scenario spreads its load over: `--users`, else the scenario's `default` (at least 1).
fn user_count(p: &Params, default: u64) -> u64 {
    p.users.unwrap_or(default).max(1)
}

/// Runs the named scenario's arrival phase (and, through the followers, its drain).
pub(crate) async fn run(name: &str, ctx: &Arc<Ctx>, p: &Params) -> anyhow::Result<()> {
    let rate = p.rate;
    let d = p.duration;
    match name {
        "steady-async" => {
            let users = user_count(p, 20);
            open_loop(ctx, "invokeAsync", Arrivals::Constant, rate, d, move |i, t| {
                let c = Arc::clone(ctx);
                async move {
                    let user = format!("steady-{}", i % users);
                    let body = invoke_body(PY, "echo", &json!({ "i": i }));
                    if let Some(job) = c.invoke_async("invokeAsync", t, &user, &body).await {
                        c.follow(&user, &job).await;
                        c.rec.record("job", t, Ok(()));
                    }
                }
            })
            .await;
        }
        // The same sync echo of 20 users (or --users), evenly spaced or each second's arrivals at once.
        "steady-sync" | "sync-burst" => {
            let users = user_count(p, 20);
            let (arrivals, prefix) = if name == "steady-sync" {
                (Arrivals::Constant, "steady-sync")
            } else {
                (Arrivals::Burst, "burst")
            };
            open_loop(ctx, "invoke", arrivals, rate, d, move |i, t| {
                let c = Arc::clone(ctx);
                async move {
                    let user = format!("{prefix}-{}", i % users);
                    let body = invoke_body(PY, "echo", &json!({ "i": i }));
                    let _ = c.invoke("invoke", t, &user, &body, SYNC_WAIT).await;
                }
            })
            .await;
        }
        "cold-start-storm" => {
            open_loop(ctx, "invoke", Arrivals::Burst, rate, d, |i, t| {
                let c = Arc::clone(ctx);
                async move {
                    let user = format!("cold-{}-{i}", c.run_tag);
                    let body = invoke_body(PY, "echo", &json!({ "i": i }));
                    let _ = c.invoke("invoke", t, &user, &body, SYNC_WAIT).await;
                }
            })
            .await;
        }
        "quota-flood" => {
            let users = user_count(p, to_u64((rate / 10.0).ceil().max(1.0)));
            open_loop(ctx, "invokeAsync", Arrivals::Constant, rate, d, move |i, t| {
                let c = Arc::clone(ctx);
                async move {
                    let user = format!("flood-{}-{}", c.run_tag, i % users);
                    let body = invoke_body(PY, "sleep", &json!({ "ms": 1500 }));
                    if let Some(job) = c.invoke_async("invokeAsync", t, &user, &body).await {
                        c.follow(&user, &job).await;
                    }
                }
            })
            .await;
        }
        "cancel-storm" => {
            let users = user_count(p, to_u64((rate / 2.0).ceil().max(4.0)));
            open_loop(ctx, "invokeAsync", Arrivals::Constant, rate, d, move |i, t| {
                let c = Arc::clone(ctx);
                async move {
                    let user = format!("cancel-{}", i % users);
                    let body = invoke_body(PY, "sleep", &json!({ "ms": 10_000 }));
                    if let Some(job) = c.invoke_async("invokeAsync", t, &user, &body).await {
                        tokio::time::sleep(Duration::from_millis(50 + (i * 37) % 250)).await;
                        let args = CancelJobArgs {
                            job_id: job.clone(),
                            reason: Some("loadtest cancel-storm".into()),
                        };
                        let _ = c.cancel_job("cancelJob", &user, &args, SYNC_WAIT).await;
                        let end = c.follow(&user, &job).await;
                        if end.is_some_and(|s| s != JobState::Cancelled) {
                            c.rec.count("not_cancelled", 1);
                        }
                    }
                }
            })
            .await;
        }
        "progress-flood" => {
            let users = user_count(p, 10);
            open_loop(ctx, "invokeAsync", Arrivals::Constant, rate, d, move |i, t| {
                let c = Arc::clone(ctx);
                async move {
                    let user = format!("progress-{}", i % users);
                    let body = invoke_body(PY, "progress", &json!({ "count": 200 }));
                    if let Some(job) = c.invoke_async("invokeAsync", t, &user, &body).await {
                        c.rec.count("progress_events_emitted", 200);
                        c.follow(&user, &job).await;
                        c.rec.record("job", t, Ok(()));
                    }
                }
            })
            .await;
        }
        "big-frames" => {
            let users = user_count(p, 4);
            open_loop(ctx, "invoke", Arrivals::Constant, rate, d, move |i, t| {
                let c = Arc::clone(ctx);
                async move {
                    let user = format!("big-{}", i % users);
                    if i % 2 == 0 {
                        let body = invoke_body(PY, "big_result", &json!({ "bytes": 4_000_000 }));
                        let _ = c.invoke("invoke", t, &user, &body, SYNC_WAIT).await;
                    } else {
                        let body = invoke_body(PY, "big_result", &json!({ "bytes": 240_000 }));
                        if let Some(job) = c.invoke_async("invokeAsync", t, &user, &body).await
                            && c.follow(&user, &job)
                                .await
                                .is_some_and(|s| s != JobState::Succeeded)
                        {
                            c.rec.count("big_jobs_not_succeeded", 1);
                        }
                    }
                }
            })
            .await;
        }
        "fairness" => {
            let noisy = open_loop(
                ctx,
                "noisy.invokeAsync",
                Arrivals::Constant,
                rate * 4.0,
                d,
                |_, t| {
                    let c = Arc::clone(ctx);
                    async move {
                        let user = format!("noisy-{}", c.run_tag);
                        let body = invoke_body(PY, "sleep", &json!({ "ms": 1000 }));
                        if let Some(job) = c.invoke_async("noisy.invokeAsync", t, &user, &body).await {
                            c.follow(&user, &job).await;
                        }
                    }
                },
            );
            let quiet = quiet_echo(ctx, "quiet.invoke", "quiet", rate, d);
            tokio::join!(noisy, quiet);
        }
        "chaos-worker-kill" => {
            let mut workers = crate::chaos::Workers::start(ctx, &p.worker_nats, 2).await?;
            let killer = {
                let c = Arc::clone(ctx);
                let victim = workers.victim();
                async move {
                    tokio::time::sleep(d / 2).await;
                    if let Some(mut child) = victim {
                        let _ = child.kill();
                        let _ = child.wait();
                        c.rec.count("workers_killed", 1);
                    }
                }
            };
            let load = churn_load(ctx, p, (rate, d), "chaos", CHAOS_MIX);
            tokio::join!(killer, load);
            workers.stop();
        }
        "nats-node-kill" => nats_node_kill(ctx, p, rate, d).await?,
        "rolling-workers" => rolling_workers(ctx, p, rate, d).await?,
        "rolling-fronts" => rolling_fronts(ctx, p, rate, d).await?,
        "hostile-neighbour" => {
            if !p.native_echo {
                anyhow::bail!(
                    "hostile-neighbour needs the native `echo` plugin (fleet-echo-plugin: build target/release, or serve a \
                     catalogue with it)"
                );
            }
            let hostile = open_loop(
                ctx,
                "hostile.invoke",
                Arrivals::Constant,
                rate / 2.0,
                d,
                |i, t| {
                    let c = Arc::clone(ctx);
                    async move {
                        let user = format!("hostile-{}", c.run_tag);
                        let (tool, args) = match i % 3 {
                            0 => ("spin", json!({ "ms": 300, "threads": 2 })),
                            1 => ("alloc", json!({ "mib": 64, "hold_ms": 300 })),
                            _ => ("fork", json!({ "count": 16, "hold_ms": 1000 })),
                        };
                        let body = invoke_body("echo", tool, &args);
                        let _ = c.invoke("hostile.invoke", t, &user, &body, SYNC_WAIT).await;
                    }
                },
            );
            // The quiet tenant's solo baseline first (half the duration), in the same run, then the same load
            // next to the hostile tenant; the SLO compares the two p99s (within 2×).
            quiet_echo(ctx, "quiet.solo.invoke", "neighbour", rate, d / 2).await;
            let quiet = quiet_echo(ctx, "quiet.invoke", "neighbour", rate, d);
            tokio::join!(hostile, quiet);
        }
        "mixed" => {
            let native = p.native_echo;
            let users = user_count(p, 10);
            open_loop(ctx, "mixed", Arrivals::Constant, rate, d, move |i, t| {
                let c = Arc::clone(ctx);
                async move {
                    let user = format!("mixed-{}", i % users);
                    match i % 10 {
                        0..=3 => {
                            let tool_id = if native && i % 2 == 1 { "echo" } else { PY };
                            let body = invoke_body(tool_id, "echo", &json!({ "i": i }));
                            let _ = c.invoke("invoke", t, &user, &body, SYNC_WAIT).await;
                        }
                        4..=7 => {
                            let body = if i % 10 == 7 {
                                invoke_body(PY, "progress", &json!({ "count": 20 }))
                            } else {
                                invoke_body(PY, "echo", &json!({ "i": i }))
                            };
                            if let Some(job) = c.invoke_async("invokeAsync", t, &user, &body).await {
                                c.follow(&user, &job).await;
                            }
                        }
                        8 => {
                            let body = invoke_body(PY, "sleep", &json!({ "ms": 5000 }));
                            if let Some(job) = c.invoke_async("invokeAsync", t, &user, &body).await {
                                tokio::time::sleep(Duration::from_millis(100)).await;
                                let args = CancelJobArgs {
                                    job_id: job.clone(),
                                    reason: None,
                                };
                                let _ = c.cancel_job("cancelJob", &user, &args, SYNC_WAIT).await;
                                c.follow(&user, &job).await;
                            }
                        }
                        _ => {
                            let args = ListJobsArgs {
                                limit: Some(20),
                                ..ListJobsArgs::default()
                            };
                            let _ = c.list_jobs("listJobs", t, &user, &args, SYNC_WAIT).await;
                        }
                    }
                }
            })
            .await;
        }
        "host-storage" => {
            for u in 0..STORAGE_USERS {
                let grant = grants::SetArgs {
                    user: format!("storage-{u}"),
                    tool_id: NOTES.to_owned(),
                    allow: vec!["aps.kv".to_owned()],
                    revoke: Vec::new(),
                    image: None,
                    web_grant: None,
                    granted_tools: None,
                };
                let operator = ctx
                    .operator()
                    .map_err(|e| anyhow::anyhow!("{}: {}", e.code, e.message))?;
                operator.grants_set(&grant, OPERATOR_WAIT).await.map_err(CallError::from).map_err(|e| {
                    anyhow::anyhow!(
                        "granting aps.kv for {NOTES}: {}: {} (the data dir's dev key must be one the fleet accepts)",
                        e.code,
                        e.message
                    )
                })?;
            }
            // The same plugin process without a reverse call first, then with one storage call per invoke.
            storage_invokes(ctx, "storage.baseline.invoke", rate, d / 2, false).await;
            storage_invokes(ctx, "storage.invoke", rate, d, true).await;
        }
        other => anyhow::bail!("scenario {other} is not implemented yet"),
    }
    Ok(())
}

/// The quiet tenant of `fairness` and `hostile-neighbour`: ten users (`<prefix>-0..9`) sending sync `echo-py` echoes
/// at `rate`, recorded as `op`.
async fn quiet_echo(ctx: &Arc<Ctx>, op: &'static str, prefix: &'static str, rate: f64, d: Duration) {
    open_loop(ctx, op, Arrivals::Constant, rate, d, |i, t| {
        let c = Arc::clone(ctx);
        async move {
            let user = format!("{prefix}-{}", i % 10);
            let body = invoke_body(PY, "echo", &json!({ "i": i }));
            let _ = c.invoke(op, t, &user, &body, SYNC_WAIT).await;
        }
    })
    .await;
}

/// `host-storage`'s load: sync `notes-py` invokes by `storage-0..9` at `rate`, recorded as `op`; with `storage`,
/// each one `storage/set` (even arrivals) or `storage/get` (odd) of one of 50 keys through `reverse`, counting
/// reverse calls that answered an error as `storage_errors`; without, the plugin's plain `echo`.
async fn storage_invokes(ctx: &Arc<Ctx>, op: &'static str, rate: f64, d: Duration, storage: bool) {
    open_loop(ctx, op, Arrivals::Constant, rate, d, move |i, t| {
        let c = Arc::clone(ctx);
        async move {
            let user = format!("storage-{}", i % STORAGE_USERS);
            let key = format!("load/k{}", i % 50);
            let body = if !storage {
                invoke_body(NOTES, "echo", &json!({ "i": i }))
            } else if i % 2 == 0 {
                let params = json!({ "scope": "tool", "key": key, "value": { "i": i } });
                invoke_body(
                    NOTES,
                    "reverse",
                    &json!({ "method": "storage/set", "params": params }),
                )
            } else {
                let params = json!({ "scope": "tool", "key": key });
                invoke_body(
                    NOTES,
                    "reverse",
                    &json!({ "method": "storage/get", "params": params }),
                )
            };
            if let Ok(data) = c.invoke(op, t, &user, &body, SYNC_WAIT).await
                && storage
                && data.get("error").is_some()
            {
                c.rec.count("storage_errors", 1);
            }
        }
    })
    .await;
}

/// `nats-node-kill`: async sleep jobs (followed to their end) and sync echo at `rate`, a probe (one sync echo
/// every 50 ms) timing the outage, the node leading the active sets killed at a third and restarted at two thirds.
async fn nats_node_kill(ctx: &Arc<Ctx>, p: &Params, rate: f64, d: Duration) -> anyhow::Result<()> {
    use crate::nats_nodes;
    let nodes = nats_nodes::nodes(&p.data_dir)?;
    let streams = nats_nodes::stream_count(&nodes);
    let killed_at: Arc<Disruption> = Arc::default();
    let killer = {
        let (c, nodes, killed_at) = (Arc::clone(ctx), nodes.clone(), Arc::clone(&killed_at));
        async move {
            tokio::time::sleep(d / 3).await;
            let victim = nats_nodes::leader_of(&nodes, "KV_fleet_active").unwrap_or(0);
            let killed = nats_nodes::kill(&nodes, victim)?;
            disrupt(&killed_at);
            c.rec.count("nats_nodes_killed", 1);
            tokio::time::sleep(d / 3).await;
            let child = killed.restart()?;
            let restarted = Instant::now();
            let catch_up = Duration::from_secs(60);
            loop {
                let n = nodes.clone();
                if tokio::task::spawn_blocking(move || nats_nodes::all_current(&n, streams)).await? {
                    c.rec
                        .count("catch_up_ms", to_u64(restarted.elapsed().as_secs_f64() * 1000.0));
                    break;
                }
                if restarted.elapsed() > catch_up {
                    c.rec.count("not_caught_up", 1);
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            anyhow::Ok(child)
        }
    };
    let probe = probe(ctx, d, &killed_at);
    let load = churn_load(ctx, p, (rate, d), "nnk", CHURN_MIX);
    let (restarted, oks, ()) = tokio::join!(killer, probe, load);
    let mut restarted = restarted?;
    if let Some(killed_at) = disrupted_at(&killed_at) {
        outage_counters(ctx, &oks, killed_at);
    }
    if p.spawned {
        // Ours: stopped with the rest of the spawned fleet.
        let _ = restarted.kill();
        let _ = restarted.wait();
    }
    Ok(())
}

/// How long the probe goes on past the scenario's duration while no call sent after the disruption has succeeded
/// yet: `recovery_ms` is measured even when the outage (or one call lost in it, `KEEPALIVE_SILENCE`) outlasts a
/// short run.
const PROBE_RECOVERY_CAP: Duration = Duration::from_secs(30);

/// When a scenario's disruption (a kill, the first replacement) happened, once it has.
type Disruption = std::sync::Mutex<Option<Instant>>;

fn disrupted_at(d: &Disruption) -> Option<Instant> {
    *d.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Records the disruption as happening now, unless one already did (the first one counts).
fn disrupt(d: &Disruption) {
    d.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get_or_insert_with(Instant::now);
}

/// A probe: one sync echo every 50 ms for `d` — and past it, up to [`PROBE_RECOVERY_CAP`], until a call sent after
/// the `disruption` succeeded; (sent, answered) of each success.
async fn probe(ctx: &Arc<Ctx>, d: Duration, disruption: &Disruption) -> Vec<(Instant, Instant)> {
    let mut oks: Vec<(Instant, Instant)> = Vec::new();
    let end = Instant::now() + d;
    let user = format!("probe-{}", ctx.run_tag);
    loop {
        let now = Instant::now();
        if now >= end {
            let recovered = disrupted_at(disruption).is_none_or(|at| oks.iter().any(|(sent, _)| *sent > at));
            if recovered || now >= end + PROBE_RECOVERY_CAP {
                break;
            }
        }
        let sent = Instant::now();
        let body = invoke_body(PY, "echo", &json!({ "probe": true }));
        if ctx
            .invoke("probe.invoke", sent, &user, &body, SYNC_WAIT)
            .await
            .is_ok()
        {
            oks.push((sent, Instant::now()));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    oks
}

/// Counters of an outage that began at `from`, from the probe's successes: `recovery_ms` (to the first success of
/// a call sent after it) and `longest_gap_ms` (the longest time without a success after it).
fn outage_counters(ctx: &Ctx, oks: &[(Instant, Instant)], from: Instant) {
    let ms = |x: Duration| to_u64(x.as_secs_f64() * 1000.0);
    if let Some((_, at)) = oks.iter().find(|(sent, _)| *sent > from) {
        ctx.rec.count("recovery_ms", ms(at.duration_since(from)));
    }
    let mut last = from;
    let mut gap = Duration::ZERO;
    for (_, at) in oks.iter().filter(|(_, at)| *at > from) {
        gap = gap.max(at.duration_since(last));
        last = *at;
    }
    ctx.rec.count("longest_gap_ms", ms(gap));
}

/// What [`churn_load`] sends: async sleep jobs of `sleep_ms`, and sync echoes with an optional `timeoutMs`,
/// waited for `sync_wait`.
#[derive(Debug, Clone, Copy)]
struct ChurnMix {
    sleep_ms: u64,
    sync_timeout_ms: Option<u64>,
    sync_wait: Duration,
}

/// The rolling and node-kill scenarios' mix: 300 ms jobs, sync calls with the default timeout.
const CHURN_MIX: ChurnMix = ChurnMix {
    sleep_ms: 300,
    sync_timeout_ms: None,
    sync_wait: SYNC_WAIT,
};

/// `chaos-worker-kill`'s mix: 500 ms jobs, sync calls bounded to 5 s (waited for 10 s).
const CHAOS_MIX: ChurnMix = ChurnMix {
    sleep_ms: 500,
    sync_timeout_ms: Some(5000),
    sync_wait: Duration::from_secs(10),
};

/// The load of the churn scenarios: half async sleep jobs (followed to their end), half sync echo, over
/// `<prefix>-<n>` users.
async fn churn_load(
    ctx: &Arc<Ctx>,
    p: &Params,
    (rate, d): (f64, Duration),
    prefix: &'static str,
    mix: ChurnMix,
) {
    let users = user_count(p, 20);
    open_loop(ctx, "invokeAsync", Arrivals::Constant, rate, d, move |i, t| {
        let c = Arc::clone(ctx);
        async move {
            let user = format!("{prefix}-{}", i % users);
            if i % 2 == 0 {
                let body = invoke_body(PY, "sleep", &json!({ "ms": mix.sleep_ms }));
                if let Some(job) = c.invoke_async("invokeAsync", t, &user, &body).await {
                    c.follow(&user, &job).await;
                }
            } else {
                let mut body = invoke_body(PY, "echo", &json!({ "i": i }));
                if let Some(ms) = mix.sync_timeout_ms {
                    body.timeout_ms = Some(ms);
                }
                let _ = c.invoke("invoke", t, &user, &body, mix.sync_wait).await;
            }
        }
    })
    .await;
}

/// A rolling update under the churn load: at a third and at two thirds of the run one replica is replaced (surge
/// one: the new one serves before the old one drains); then the replacements leave, drained too. Counters
/// `<what>_rolled` and `<what>_killed_after_grace`, and the probe's outage counters from the first replacement.
async fn rolling(
    ctx: &Arc<Ctx>,
    p: &Params,
    (rate, d): (f64, Duration),
    mut replicas: impl Replicas,
    what: &'static str,
) -> anyhow::Result<()> {
    let started = Instant::now();
    let first: Disruption = std::sync::Mutex::new(None);
    let roll = {
        let c = Arc::clone(ctx);
        let first = &first;
        async move {
            for k in 1..=2u32 {
                tokio::time::sleep_until((started + d * k / 3).into()).await;
                replicas.add().await?;
                disrupt(first);
                if replicas.retire_oldest().await {
                    c.rec.count(&format!("{what}_rolled"), 1);
                } else {
                    c.rec.count(&format!("{what}_killed_after_grace"), 1);
                }
            }
            while replicas.retire_oldest().await {}
            anyhow::Ok(())
        }
    };
    let (rolled, oks, ()) = tokio::join!(
        roll,
        probe(ctx, d, &first),
        churn_load(ctx, p, (rate, d), what, CHURN_MIX)
    );
    rolled?;
    if let Some(from) = disrupted_at(&first) {
        outage_counters(ctx, &oks, from);
    }
    Ok(())
}

/// `rolling-workers`: two extra workers, each replaced in turn.
async fn rolling_workers(ctx: &Arc<Ctx>, p: &Params, rate: f64, d: Duration) -> anyhow::Result<()> {
    let workers = crate::chaos::Workers::start(ctx, &p.worker_nats, 2).await?;
    rolling(ctx, p, (rate, d), workers, "workers").await
}

/// `rolling-fronts`: two extra front replicas, each replaced in turn.
async fn rolling_fronts(ctx: &Arc<Ctx>, p: &Params, rate: f64, d: Duration) -> anyhow::Result<()> {
    let nats_url = p.worker_nats.url.clone();
    let fronts = crate::fronts::Fronts::start(&nats_url, p.auth_dir.clone(), p.data_dir.clone(), 2).await?;
    rolling(ctx, p, (rate, d), fronts, "fronts").await
}
