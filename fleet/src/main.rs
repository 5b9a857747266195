//! The `fleet` binary: the Cloud Agents service and its operator commands.
//!
//! `fleet up` (a nats-server unless `--nats-url`, the fronts, N workers, HTTP), `fleet worker` (the plugin host
//! on its own); the clients `token`, `invoke`, `invoke-async`, `job get|cancel|list`; the operator commands
//! `grant`, `creds`, `plugins`, `nats-auth init`; the plugin developer's harness `replay` and `fixture
//! verify|summarize`; and `probe` (one plugin through the Executa handshake with the
//! production codec, confined as a worker runs it).
#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::time::Duration;

use std::io::Write as _;

use clap::{Parser, Subcommand};
use fleet_proto::api::methods;
use serde_json::{Map, Value, json};

#[cfg(test)]
mod docs_reference;

/// jemalloc rather than glibc's malloc: a sync invoke allocates and frees many small buffers across threads, on
/// which glibc's arenas spent about a quarter of the process's CPU; jemalloc also keeps less memory per idle
/// session. mimalloc was as fast but doubled the memory per session (docs/performance.md, "Allocator").
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Debug, Parser)]
#[command(
    name = "fleet",
    version,
    about = "Cloud Agents: run tool plugins for many users, fast and safely"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Spawn a plugin, run initialize → describe → (optionally) one invoke, print a JSON report.
    Probe {
        /// Tool to invoke after describe.
        #[arg(long)]
        tool: Option<String>,
        /// JSON object of arguments for --tool.
        #[arg(long, default_value = "{}")]
        args: String,
        /// Invoke timeout in milliseconds.
        #[arg(long, default_value_t = 60_000)]
        timeout_ms: u64,
        /// Run the plugin as a plain child instead of confined as the worker runs it (cgroup, namespaces,
        /// seccomp, a uid of its own; the default as root, impossible otherwise).
        #[arg(long)]
        no_confine: bool,
        /// The plugin's command line.
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Run the plugin host: load the catalogue, sweep stale cgroups, prewarm, serve until SIGTERM.
    Worker(fleet::worker_cmd::WorkerArgs),
    /// Run everything on this machine: nats-server (unless --nats-url), the front, N workers, HTTP.
    Up(Box<fleet::up::UpArgs>),
    /// Allow or revoke host capabilities (aps.kv, aps.files, llm.sample, llm.embed, host.upload, …) for one
    /// user and plugin; with neither --allow nor --revoke, print the grant. An operator action (the dev key
    /// of --data-dir mints an operator token when --token is absent).
    Grant(fleet::grants::GrantArgs),
    /// Users' plugin credentials (operator): set, list (names only), delete; rotate-key and rewrap the keyring
    /// that encrypts them at rest. Values reach plugins only in `params.context.credentials`.
    Credentials {
        #[command(subcommand)]
        command: fleet::credentials::CredentialsCmd,
    },
    /// App NATS credentials (operator): issue, list, revoke — without restarting NATS.
    Creds {
        #[command(subcommand)]
        command: fleet::creds::CredsCmd,
    },
    /// NATS auth material for a fleet on an external server: `init --dir DIR` creates (once) the keys, each
    /// role's `.creds` and `server-auth.conf` (include it in the nats-server configuration).
    NatsAuth {
        #[command(subcommand)]
        command: fleet::nats_auth::cli::NatsAuthCmd,
    },
    /// Plugin distribution (operator): install, list, remove, describe plugins across the fleet.
    Plugins {
        #[command(subcommand)]
        command: fleet::plugins::cli::PluginsCmd,
    },
    /// Mint a dev token for a user with the data dir's signing key (with --window: a window token for the HTTP
    /// gateway, audience `anna-app-window`, 120 s).
    Token {
        /// The user (`sub`).
        #[arg(long)]
        user: String,
        /// Lifetime in seconds (default 3600; 120 with --window).
        #[arg(long)]
        ttl_secs: Option<u64>,
        /// Mint a window token for this window uuid (`wid`).
        #[arg(long)]
        window: Option<String>,
        /// The window token's app id (`app`).
        #[arg(long, default_value = "dev-app", requires = "window")]
        app: String,
        /// The window token's app version id (`ver`).
        #[arg(long, default_value = "dev", requires = "window")]
        app_version: String,
        /// An entry of the window token's `tools` allow-list (repeatable; none: every tool).
        #[arg(long = "allow-tool", requires = "window")]
        allow_tools: Vec<String>,
        /// An operator token instead (audience `cloud-agents-operator`, the data dir's dev operator key).
        #[arg(long, conflicts_with = "window")]
        operator: bool,
        /// The data directory of `fleet up`.
        #[arg(long, env = "FLEET_DATA_DIR", default_value = fleet_client::api::DEFAULT_DATA_DIR)]
        data_dir: std::path::PathBuf,
    },
    /// tools.invoke: run a tool and print its result.
    Invoke {
        #[command(flatten)]
        client: fleet::client_cmd::ClientArgs,
        /// The plugin's tool_id.
        #[arg(long)]
        tool_id: String,
        /// The tool inside it.
        #[arg(long)]
        tool: String,
        /// Arguments as a JSON object.
        #[arg(long)]
        args: Option<String>,
        /// timeoutMs (1000–90000; larger is clamped).
        #[arg(long)]
        timeout_ms: Option<u64>,
    },
    /// tools.invokeAsync: create a job and print {jobId, state, deadlineMs}.
    InvokeAsync {
        #[command(flatten)]
        client: fleet::client_cmd::ClientArgs,
        /// The plugin's tool_id.
        #[arg(long)]
        tool_id: String,
        /// The tool inside it.
        #[arg(long)]
        tool: String,
        /// Arguments as a JSON object.
        #[arg(long)]
        args: Option<String>,
        /// The job deadline in ms (60 s – 24 h; default 30 min).
        #[arg(long)]
        timeout_ms: Option<u64>,
        /// A tag stored on the job (≤ 120 chars).
        #[arg(long)]
        client_tag: Option<String>,
    },
    /// Jobs: get, cancel, list.
    Job {
        #[command(subcommand)]
        command: JobCmd,
    },
    /// Replay a recorded session (JSONL, spec §15.4 F1/F2/F4): drive its tools.* calls through a fleet (or
    /// --spawn one), compare each outcome with the recorded one, print a per-call table; exit 1 on a mismatch.
    Replay(Box<fleet::replay::ReplayArgs>),
    /// Recording and fixture files (spec §15.4): verify, summarize.
    Fixture {
        #[command(subcommand)]
        command: fleet::replay::FixtureCmd,
    },
}

#[derive(Debug, Subcommand)]
enum JobCmd {
    /// tools.getJob.
    Get {
        /// The job id.
        job_id: String,
        #[command(flatten)]
        client: fleet::client_cmd::ClientArgs,
        /// Only progress events after this seq.
        #[arg(long)]
        since_seq: Option<u64>,
        /// At most this many progress events (1–500).
        #[arg(long)]
        limit: Option<u32>,
    },
    /// tools.cancelJob.
    Cancel {
        /// The job id.
        job_id: String,
        #[command(flatten)]
        client: fleet::client_cmd::ClientArgs,
        /// Why (≤ 200 chars).
        #[arg(long)]
        reason: Option<String>,
    },
    /// tools.listJobs.
    List {
        #[command(flatten)]
        client: fleet::client_cmd::ClientArgs,
        /// Only jobs in this state (repeatable).
        #[arg(long)]
        state: Vec<String>,
        /// Only jobs with this tag.
        #[arg(long)]
        client_tag: Option<String>,
        /// Only jobs of this tool_id.
        #[arg(long)]
        tool_id: Option<String>,
        /// RFC 3339 lower bound on createdAt.
        #[arg(long)]
        since: Option<String>,
        /// At most this many (1–100, default 20).
        #[arg(long)]
        limit: Option<u32>,
        /// Continue after the page that answered this `cursor`.
        #[arg(long)]
        cursor: Option<String>,
    },
}

fn main() -> ExitCode {
    // A sandbox stub (the worker starts this binary as one) runs single-threaded and never returns: before
    // anything else, in particular before the runtime's threads exist.
    fleet_worker::sandbox::run_if_stub();
    match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt.block_on(run()),
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "fleet: cannot start the async runtime: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> ExitCode {
    let cli = Cli::parse();
    // Services log at info; client commands only warn (their stdout is the JSON answer, stderr one error line). Services export traces
    // when an OTLP endpoint is configured.
    let (default_filter, otlp, service) = match &cli.command {
        Cmd::Up(a) => ("info", a.otlp_endpoint.as_deref(), "cloud-agents"),
        Cmd::Worker(a) => ("info", a.otlp_endpoint.as_deref(), "cloud-agents-worker"),
        // The NATS client's own log lines would repeat the one-line error a refused connection ends with.
        _ => ("warn,async_nats=off", None, "cloud-agents-cli"),
    };
    let _telemetry = init_logs(default_filter, otlp, service);
    match cli.command {
        Cmd::Probe {
            tool,
            args,
            timeout_ms,
            no_confine,
            command,
        } => {
            let arguments: Map<String, Value> = match serde_json::from_str(&args) {
                Ok(a) => a,
                Err(e) => {
                    eprintln_error(&format!("--args must be a JSON object: {e}"));
                    return ExitCode::from(2);
                }
            };
            let sandbox = if no_confine {
                None
            } else if !rustix::process::geteuid().is_root() {
                eprintln_error("not root: the plugin runs unconfined (the report says \"confined\": false)");
                None
            } else {
                match fleet::probe::ProbeSandbox::new() {
                    Ok(sb) => Some(std::sync::Arc::new(sb)),
                    Err(e) => {
                        eprintln_error(&e.to_string());
                        return ExitCode::FAILURE;
                    }
                }
            };
            let opts = fleet::probe::ProbeOptions {
                command,
                invoke: tool.map(|t| (t, arguments)),
                invoke_timeout: Duration::from_millis(timeout_ms),
                sandbox,
            };
            match fleet::probe::run(&opts).await {
                Ok(report) => {
                    println!("{}", serde_json::to_string_pretty(&report).unwrap_or_default());
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln_error(&e.to_string());
                    ExitCode::FAILURE
                }
            }
        }
        Cmd::Worker(args) => match Box::pin(fleet::worker_cmd::run(&args)).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln_error(&e.to_string());
                ExitCode::FAILURE
            }
        },
        Cmd::Up(args) => match Box::pin(fleet::up::run(&args)).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln_error(&e.to_string());
                ExitCode::FAILURE
            }
        },
        Cmd::Grant(args) => print_outcome(fleet::grants::run_grant(&args).await),
        Cmd::Plugins { command } => print_outcome(fleet::plugins::cli::run(&command).await),
        Cmd::Creds { command } => print_outcome(fleet::creds::run(&command).await),
        Cmd::Credentials { command } => print_outcome(fleet::credentials::run(&command).await),
        Cmd::NatsAuth { command } => match fleet::nats_auth::cli::run(&command) {
            Ok(v) => print_outcome(Ok(v)),
            Err(e) => {
                eprintln_error(&e.to_string());
                ExitCode::FAILURE
            }
        },
        Cmd::Token {
            user,
            ttl_secs,
            window: Some(window),
            app,
            app_version,
            allow_tools,
            data_dir,
            ..
        } => print_outcome(
            fleet::http::window::WindowToken {
                user: &user,
                window: &window,
                app: &app,
                version: &app_version,
                tools: (!allow_tools.is_empty()).then_some(allow_tools.as_slice()),
                ttl: ttl_secs.map_or(fleet::http::window::WINDOW_TOKEN_TTL, Duration::from_secs),
            }
            .mint_dev(&data_dir)
            .map(|t| json!({ "token": t, "window_uuid": window })),
        ),
        Cmd::Token {
            user,
            ttl_secs,
            operator,
            data_dir,
            ..
        } => print_outcome(
            fleet_client::api::mint(
                &data_dir,
                &user,
                Duration::from_secs(ttl_secs.unwrap_or(3600)),
                operator,
            )
            .map(|t| json!({ "token": t })),
        ),
        Cmd::Invoke {
            client,
            tool_id,
            tool,
            args,
            timeout_ms,
        } => {
            let outcome =
                match fleet_client::api::invoke_body(&tool_id, &tool, args.as_deref(), timeout_ms, None) {
                    Ok(body) => {
                        let wait = fleet_client::api::wait_for(methods::TOOLS_INVOKE, timeout_ms);
                        fleet::client_cmd::call(&client, methods::TOOLS_INVOKE, &body, wait).await
                    }
                    Err(e) => Err(e),
                };
            print_outcome(outcome)
        }
        Cmd::InvokeAsync {
            client,
            tool_id,
            tool,
            args,
            timeout_ms,
            client_tag,
        } => {
            let outcome = match fleet_client::api::invoke_body(
                &tool_id,
                &tool,
                args.as_deref(),
                timeout_ms,
                client_tag.as_deref(),
            ) {
                Ok(body) => {
                    let wait = fleet_client::api::wait_for(methods::TOOLS_INVOKE_ASYNC, None);
                    fleet::client_cmd::call(&client, methods::TOOLS_INVOKE_ASYNC, &body, wait).await
                }
                Err(e) => Err(e),
            };
            print_outcome(outcome)
        }
        Cmd::Replay(args) => harness_outcome(Box::pin(fleet::replay::run(&args)).await),
        Cmd::Fixture { command } => harness_outcome(fleet::replay::fixture(&command)),
        Cmd::Job { command } => {
            let (client, method, body) = match command {
                JobCmd::Get {
                    job_id,
                    client,
                    since_seq,
                    limit,
                } => {
                    let mut body = json!({ "jobId": job_id });
                    if let Some(s) = since_seq {
                        body["sinceSeq"] = json!(s);
                    }
                    if let Some(l) = limit {
                        body["limit"] = json!(l);
                    }
                    (client, methods::TOOLS_GET_JOB, body)
                }
                JobCmd::Cancel {
                    job_id,
                    client,
                    reason,
                } => {
                    let mut body = json!({ "jobId": job_id });
                    if let Some(r) = reason {
                        body["reason"] = json!(r);
                    }
                    (client, methods::TOOLS_CANCEL_JOB, body)
                }
                JobCmd::List {
                    client,
                    state,
                    client_tag,
                    tool_id,
                    since,
                    limit,
                    cursor,
                } => {
                    let mut body = json!({});
                    if !state.is_empty() {
                        body["state"] = json!(state);
                    }
                    if let Some(c) = client_tag {
                        body["clientTag"] = json!(c);
                    }
                    if let Some(t) = tool_id {
                        body["tool_id"] = json!(t);
                    }
                    if let Some(s) = since {
                        body["since"] = json!(s);
                    }
                    if let Some(l) = limit {
                        body["limit"] = json!(l);
                    }
                    if let Some(c) = cursor {
                        body["cursor"] = json!(c);
                    }
                    (client, methods::TOOLS_LIST_JOBS, body)
                }
            };
            let wait = fleet_client::api::wait_for(method, None);
            print_outcome(fleet::client_cmd::call(&client, method, &body, wait).await)
        }
    }
}

/// JSON on stdout; on error the error object on stdout, `fleet: <code>: <message>` on stderr, exit 1.
fn print_outcome(outcome: Result<Value, fleet_proto::api::ApiError>) -> ExitCode {
    match outcome {
        Ok(v) => {
            println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!(
                "{}",
                serde_json::to_string_pretty(&json!({ "error": e })).unwrap_or_default()
            );
            eprintln_error(&format!("{}: {}", e.code, e.message));
            ExitCode::FAILURE
        }
    }
}

/// `fleet replay` / `fleet fixture`: 0 when green, 1 on a mismatch or a problem, 2 when it could not run.
fn harness_outcome(outcome: Result<bool, fleet::replay::ReplayError>) -> ExitCode {
    match outcome {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(fleet::replay::EXIT_MISMATCH),
        Err(e) => {
            eprintln_error(&e.to_string());
            ExitCode::from(fleet::replay::EXIT_ERROR)
        }
    }
}

/// JSON logs on stderr (the filter comes from `FLEET_LOG`, tracing `EnvFilter` syntax, else `default`) and, with
/// an OTLP endpoint, traces; both layers share one subscriber (`fleet::telemetry::init`). Without a usable
/// exporter the process runs with logs only.
fn init_logs(
    default: &str,
    otlp_endpoint: Option<&str>,
    service: &str,
) -> Option<fleet::telemetry::TelemetryGuard> {
    match fleet::telemetry::init(otlp_endpoint, service, default) {
        Ok(guard) => guard,
        Err(e) => {
            eprintln_error(&format!("traces disabled: {e}"));
            let _ = fleet::telemetry::init(None, service, default);
            None
        }
    }
}

#[allow(clippy::print_stderr)] // The CLI's error channel.
fn eprintln_error(message: &str) {
    eprintln!("fleet: {message}");
}
