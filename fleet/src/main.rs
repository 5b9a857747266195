//! The `fleet` binary: the Cloud Agents service and its operator commands.
//!
//! Today: `fleet probe -- CMD ARGS…` runs one plugin through the Executa handshake with the production codec;
//! `fleet worker` runs the plugin host on its own.
//! `fleet up` (all roles plus a child nats-server) arrives with the fleet issue.
#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use serde_json::{Map, Value};

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
        /// The plugin's command line.
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Run the plugin host: load the catalogue, sweep stale cgroups, prewarm, serve until SIGTERM.
    Worker(fleet::worker_cmd::WorkerArgs),
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logs();
    match cli.command {
        Cmd::Probe {
            tool,
            args,
            timeout_ms,
            command,
        } => {
            let arguments: Map<String, Value> = match serde_json::from_str(&args) {
                Ok(a) => a,
                Err(e) => {
                    eprintln_error(&format!("--args must be a JSON object: {e}"));
                    return ExitCode::from(2);
                }
            };
            let opts = fleet::probe::ProbeOptions {
                command,
                invoke: tool.map(|t| (t, arguments)),
                invoke_timeout: Duration::from_millis(timeout_ms),
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
        Cmd::Worker(args) => match fleet::worker_cmd::run(&args).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln_error(&e.to_string());
                ExitCode::FAILURE
            }
        },
    }
}

/// JSON logs on stderr; the filter comes from `FLEET_LOG` (tracing `EnvFilter` syntax), default `info`.
fn init_logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("FLEET_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .json()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

#[allow(clippy::print_stderr)] // The CLI's error channel.
fn eprintln_error(message: &str) {
    eprintln!("fleet: {message}");
}
