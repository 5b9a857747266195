//! `loadtest`: SLO scenarios against a running Cloud Agents fleet over NATS.
//!
//! `loadtest list` prints the scenario catalogue; `loadtest run SCENARIO` drives one scenario with open-model
//! arrivals (every request is scheduled at its intended start and its latency measured from there, so a stalled
//! fleet shows up instead of being omitted), mints its own tokens with the dev key of `--data-dir`, and writes
//! `report.md`, `report.json` and `latency.svg` into `--report DIR`. SLO thresholds per scenario live in
//! `loadtest/slo.toml`. Exit codes: 0 all SLOs held, 1 an SLO failed, 2 usage error, scenario not implemented, or
//! the run could not happen (no fleet, no key).
#![forbid(unsafe_code)]

mod chaos;
mod engine;
mod fronts;
mod metrics;
mod nats_nodes;
mod replicas;
mod report;
mod scenarios;
mod spawn;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use fleet_proto::api::InvokeArgs;
use serde_json::{Value, json};

use crate::engine::{Ctx, lock};

/// Most tasks in flight at once; arrivals beyond it are counted as `overload` errors.
const MAX_IN_FLIGHT: usize = 2000;
/// How long accepted jobs are followed after the arrival phase before the rest count as lost.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, Parser)]
#[command(
    name = "loadtest",
    about = "Load and SLO scenarios against a running Cloud Agents fleet"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Print every scenario with its one-line description.
    List,
    /// Run one scenario and write its report.
    Run(Box<RunArgs>),
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// The scenario (see `loadtest list`).
    scenario: String,
    /// Start `fleet up` as a child for the run (data dir: --data-dir, else a temporary one).
    #[arg(long)]
    spawn: bool,
    /// NATS URL of the fleet (default: the URL in <data-dir>/nats-url, else nats://127.0.0.1:4222).
    #[arg(long)]
    nats_url: Option<String>,
    /// The fleet's data directory, holding the dev signing key tokens are minted with and the NATS credentials
    /// of each role under `nats/` (default `.fleet`).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// The app credential the calls are made with (default `<auth-dir>/app.creds`), and TLS.
    #[command(flatten)]
    nats: fleet_client::nats_conn::NatsAuthArgs,
    /// Where each role's credentials are (`app.creds`, `operator.creds` for operator calls and registry reads,
    /// `worker.creds` for the workers `chaos-worker-kill` starts; with --spawn and --nats-url, the child `fleet
    /// up` gets it too). Default `<data-dir>/nats`.
    #[arg(long, env = "FLEET_NATS_AUTH_DIR")]
    nats_auth_dir: Option<PathBuf>,
    /// Length of the arrival phase, e.g. `10s`, `2m`.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Arrivals per second (default: the scenario's).
    #[arg(long)]
    rate: Option<f64>,
    /// How many users the load is spread over (default: the scenario's own count): raise it with --rate to find
    /// the fleet's knee rather than the per-user rate limit and job quota.
    #[arg(long)]
    users: Option<u64>,
    /// Where report.md, report.json and latency.svg go.
    #[arg(long, default_value = "loadtest-report")]
    report: PathBuf,
}

#[allow(clippy::print_stderr)] // The CLI's error channel.
fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Cmd::List => {
            list();
            ExitCode::SUCCESS
        }
        Cmd::Run(args) => match run(&args) {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::from(1),
            Err(e) => {
                eprintln!("loadtest: {e:#}");
                ExitCode::from(2)
            }
        },
    }
}

#[allow(clippy::print_stdout)] // `list` prints the catalogue.
fn list() {
    for s in scenarios::SCENARIOS {
        let mark = if s.implemented {
            ""
        } else {
            " [not implemented yet]"
        };
        println!("{:<18} {}{mark}", s.name, s.description);
    }
}

#[allow(clippy::print_stdout, clippy::print_stderr)] // The summary and where the report is.
fn run(args: &RunArgs) -> anyhow::Result<bool> {
    let Some(scenario) = scenarios::find(&args.scenario) else {
        anyhow::bail!("unknown scenario {:?} (see `loadtest list`)", args.scenario);
    };
    if !scenario.implemented {
        anyhow::bail!("scenario {} is not implemented yet", scenario.name);
    }
    if args.rate.is_some_and(|r| !(r > 0.0 && r.is_finite())) {
        anyhow::bail!("--rate must be a positive number");
    }
    let slo_text = match std::env::var_os("LOADTEST_SLO_FILE") {
        Some(p) => std::fs::read_to_string(&p)?,
        None => report::DEFAULT_SLO.to_string(),
    };
    let slo = report::parse_slo(&slo_text)?.remove(scenario.name);

    // The fleet: a child `fleet up`, or the one named by the flags.
    let mut tmp = None;
    let data_dir = match (&args.data_dir, args.spawn) {
        (Some(d), _) => d.clone(),
        (None, true) => {
            let t = tempfile::Builder::new().prefix("loadtest-fleet-").tempdir()?;
            let p = t.path().to_path_buf();
            tmp = Some(t);
            p
        }
        (None, false) => PathBuf::from(fleet_client::api::DEFAULT_DATA_DIR),
    };
    let spawned = if args.spawn {
        eprintln!("loadtest: starting fleet up (data dir {})", data_dir.display());
        Some(spawn::SpawnedFleet::start(
            &data_dir,
            args.nats_url.as_deref(),
            args.nats_auth_dir.as_deref(),
            &args.nats,
            scenario.nats_cluster,
        )?)
    } else {
        None
    };
    let nats_url = match (&spawned, &args.nats_url) {
        (Some(f), _) => f.nats_url.clone(),
        (None, Some(u)) => u.clone(),
        (None, None) => std::fs::read_to_string(fleet_client::api::nats_url_file(&data_dir))
            .map(|s| s.trim().to_string())
            .ok()
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| fleet_client::api::DEFAULT_NATS_URL.to_string()),
    };
    let key = fleet_client::auth::DevKey::load(&data_dir)
        .map_err(|e| anyhow::anyhow!("{e} (give --data-dir of the fleet, or --spawn)"))?;
    // Operator calls (grants of the host-storage scenario) need the fleet's dev operator key; without it they
    // fail with a message naming the file.
    let operator_key = fleet_client::auth::DevKey::load_operator(&data_dir).map_err(|e| e.to_string());
    let auth_dir = args
        .nats_auth_dir
        .clone()
        .unwrap_or_else(|| fleet_client::nats_conn::auth_dir(&data_dir));
    let creds = |role: fleet_client::creds::Role| {
        Some(fleet_client::creds::creds_in(&auth_dir, role)).filter(|p| p.exists())
    };
    let app = args
        .nats
        .connector(&nats_url, creds(fleet_client::creds::Role::App));
    let operator = app.with_creds(creds(fleet_client::creds::Role::Operator));
    let worker = app.with_creds(creds(fleet_client::creds::Role::Worker));
    let params = scenarios::Params {
        rate: args.rate.unwrap_or(scenario.default_rate),
        duration: args.duration,
        native_echo: false,
        users: args.users,
        worker_nats: worker,
        data_dir: data_dir.clone(),
        spawned: args.spawn,
        auth_dir: auth_dir.clone(),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let metrics_url = spawned
        .as_ref()
        .map(|f| f.metrics_url.clone())
        .or_else(|| std::env::var("LOADTEST_METRICS_URL").ok());
    let result = runtime.block_on(drive(
        scenario,
        params,
        (&app, &operator),
        (key, operator_key),
        spawned.is_some(),
        slo,
        metrics_url.as_deref(),
    ));
    drop(runtime);
    drop(spawned); // SIGINT to the child fleet, at the end and on error alike.
    drop(tmp);
    let (report, ctx) = result?;
    report::write(&args.report, &report, &ctx.rec)?;
    let md = report::markdown(&report);
    println!("{md}");
    println!("report: {}", args.report.display());
    Ok(report["slo"]["passed"] == json!(true))
}

async fn drive(
    scenario: &'static scenarios::Scenario,
    mut params: scenarios::Params,
    (app, operator): (
        &fleet_client::nats_conn::Connector,
        &fleet_client::nats_conn::Connector,
    ),
    (key, operator_key): (
        fleet_client::auth::SigningKey,
        Result<fleet_client::auth::SigningKey, String>,
    ),
    spawned: bool,
    slo: Option<report::Slo>,
    metrics_url: Option<&str>,
) -> anyhow::Result<(Value, Arc<Ctx>)> {
    let nats_url = app.url.as_str();
    let nats = app.connect("loadtest").await?;
    let ops = operator.connect("loadtest-operator").await?;
    let ctx = Arc::new(Ctx::new(nats, ops, key, MAX_IN_FLIGHT).with_operator_key(operator_key));
    // Which demo plugins are served (the native `echo` needs `target/release`).
    let user = format!("loadtest-{}", ctx.run_tag);
    let tools = ctx
        .list_tools(&user, Duration::from_secs(10))
        .await
        .map_err(|e| anyhow::anyhow!("tools.list on {nats_url}: {}: {}", e.code, e.message))?;
    let ids: Vec<&str> = tools.tools.iter().map(|t| t.tool_id.as_str()).collect();
    // tools.list shows only what workers have described so far: when `echo` is not there yet, one probe call says.
    params.native_echo = ids
        .iter()
        .any(|id| *id == "echo" || id.starts_with("echo.") || id.starts_with("echo__"));
    if !params.native_echo {
        let probe = InvokeArgs {
            tool_id: "echo".into(),
            method: Some("echo".into()),
            args: Some(serde_json::Map::new()),
            timeout_ms: Some(5000),
        };
        let probe = &probe;
        params.native_echo = ctx
            .call(&user, |c| async move {
                c.invoke(probe, Duration::from_secs(10)).await
            })
            .await
            .is_ok();
    }
    let head = json!({
        "scenario": scenario.name,
        "description": scenario.description,
        "started_at_unix_s": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or_default(),
        "parameters": {
            "rate": params.rate,
            "duration_s": params.duration.as_secs_f64(),
            "nats_url": nats_url,
            "spawned": spawned,
            "native_echo": params.native_echo,
            "max_in_flight": MAX_IN_FLIGHT,
            "drain_timeout_s": DRAIN_TIMEOUT.as_secs(),
        },
    });
    *lock(&ctx.drain_deadline) = Instant::now() + params.duration + DRAIN_TIMEOUT;
    let stop = Arc::new(AtomicBool::new(false));
    let progress = engine::progress_line(Arc::clone(&ctx), params.duration, Arc::clone(&stop));
    let before = metrics_url.map(metrics::scrape);
    let started = Instant::now();
    let outcome = scenarios::run(scenario.name, &ctx, &params).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = progress.await;
    outcome?;
    let elapsed = started.elapsed();
    let mut report = report::build(&ctx.rec, head, elapsed, slo.as_ref());
    match (metrics_url, before) {
        (Some(url), Some(Ok(before))) => match metrics::scrape(url) {
            Ok(after) => {
                report["warm_hit_ratio"] = json!(metrics::ratio(before, after));
                report["warm_hit_ratio_note"] = json!(format!(
                    "warm hits / (warm hits + cold starts) of every plugin call during the run, from {url}: {} warm, {} cold",
                    after.0 - before.0,
                    after.1 - before.1
                ));
            }
            Err(e) => report["warm_hit_ratio_note"] = json!(format!("not obtainable: {e}")),
        },
        (_, Some(Err(e))) => report["warm_hit_ratio_note"] = json!(format!("not obtainable: {e}")),
        _ => {
            report["warm_hit_ratio_note"] = json!(
                "not measured: give --spawn, or LOADTEST_METRICS_URL=http://127.0.0.1:PORT/metrics of the fleet's HTTP listener"
            )
        }
    }
    Ok((report, ctx))
}
