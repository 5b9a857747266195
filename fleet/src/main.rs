//! The `fleet` binary: the Cloud Agents service and its operator commands.
//!
//! Today: `fleet probe -- CMD ARGS…` runs one plugin through the Executa handshake with the production codec.
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
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
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
    }
}

#[allow(clippy::print_stderr)] // The CLI's error channel.
fn eprintln_error(message: &str) {
    eprintln!("fleet: {message}");
}
