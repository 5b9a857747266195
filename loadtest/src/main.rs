//! `loadtest`: SLO scenarios against a running Cloud Agents fleet over NATS.
//!
//! It will own the scenario catalogue (`loadtest list`, `loadtest run SCENARIO`), its own token minting, bounded
//! pipelined request loops on loopback, and the reports (latency percentiles, error rates, warm-hit ratio)
//! compared against a baseline measured in the same run. Not implemented yet (the deploy-and-prove issue): the
//! binary says so and exits with status 2.
#![forbid(unsafe_code)]

use std::process::ExitCode;

#[allow(clippy::print_stderr)] // The CLI's error channel.
fn main() -> ExitCode {
    eprintln!("loadtest: not implemented yet — scenarios arrive with the deploy-and-prove issue");
    ExitCode::from(2)
}
