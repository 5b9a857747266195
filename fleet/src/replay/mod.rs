//! The plugin developer's harness (spec §15.4): `fleet replay FILE.jsonl` drives a recorded session's
//! `tools.*` calls through a running fleet (or one it spawns) and compares each outcome with the recorded one;
//! `fleet fixture verify` checks recording and fixture files line by line; `fleet fixture summarize` counts what
//! they hold.
//!
//! Modules: `load` (a file → its format, calls, events and problems), `diff` (the JSON-path comparison, pure),
//! `engine` (the replay and the verdicts), `acl` (what an app manifest's ACL would reject), `spawn` (the
//! `--spawn`ed `fleet up`), `report` (tables and JSON). The record types are `fleet_proto::recording`'s.

pub mod acl;
pub mod diff;
pub mod engine;
pub mod load;
pub mod report;
pub mod spawn;

use std::collections::HashMap;
use std::path::PathBuf;

use fleet_client::api::ApiClient;
use fleet_proto::app_manifest::AppManifestAcl;
use fleet_proto::recording::Format;

use crate::client_cmd::ClientArgs;

/// The user `fleet replay` mints a dev token for when neither `--token` nor `--user` is given.
pub const DEFAULT_USER: &str = "replay";

/// Exit status of a replay or a verification that found a difference or a problem.
pub const EXIT_MISMATCH: u8 = 1;
/// Exit status when the replay could not run (unreadable or invalid file, no fleet, bad flags).
pub const EXIT_ERROR: u8 = 2;

/// `fleet replay`'s flags.
#[derive(Debug, Clone, clap::Args)]
pub struct ReplayArgs {
    /// The recording (JSONL: F1, F2 or F4 of spec §15.4).
    pub file: PathBuf,
    /// Where the fleet is and who calls it (default user: `replay`).
    #[command(flatten)]
    pub client: ClientArgs,
    /// Start a fleet of its own for the replay (`fleet up` over --plugins-dir, temporary data dir, free ports),
    /// stopped after it; calls carry a dev token of --user (default `replay`) minted with its key.
    #[arg(long)]
    pub spawn: bool,
    /// The plugin catalogue of the --spawn'ed fleet (default: the demo plugins).
    #[arg(long, requires = "spawn")]
    pub plugins_dir: Option<PathBuf>,
    /// The --spawn'ed fleet's `--isolation` (`cgroup` or `none`; default: `fleet up`'s).
    #[arg(long, requires = "spawn")]
    pub isolation: Option<String>,
    /// Replay calls recorded against tool_id OLD on tool_id NEW (repeatable).
    #[arg(long = "map-tool", value_name = "OLD=NEW", value_parser = parse_mapping)]
    pub map_tool: Vec<(String, String)>,
    /// Exact equality: a field only the replay has is a mismatch.
    #[arg(long)]
    pub strict: bool,
    /// Report which calls this app manifest's ACL would reject (a rejected call fails the replay).
    #[arg(long, value_name = "APP_MANIFEST")]
    pub manifest: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `fleet fixture …`.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum FixtureCmd {
    /// Check every line of each file: JSON, a known format, the format's required fields, `res` paired with a
    /// `req`, one format per file, a monotonic timeline, known `tools.*` methods. Exits non-zero on any problem.
    Verify {
        /// The files.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Per file: its format, calls per ns.method, tool_ids, outcomes (ok / error codes), events, duration.
    Summarize {
        /// The files.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
}

/// Why a replay could not run.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The file cannot be read.
    #[error(transparent)]
    Read(#[from] load::ReadError),
    /// The file is a mock fixture (F3), not a recording.
    #[error(
        "{0}: an F3 mock fixture file (MockEntry lines), not a recording: mocks answer a plugin's reverse RPCs, there are no calls to replay"
    )]
    MockFile(String),
    /// The file has no recognisable line.
    #[error("{0}: no line of a recording format (F1, F2, F4)")]
    Empty(String),
    /// The file has problems (`fleet fixture verify` lists them all).
    #[error(
        "{file}: {count} problem(s), the first at line {line}: {problem} (fleet fixture verify lists them)"
    )]
    Invalid {
        /// The file.
        file: String,
        /// How many.
        count: usize,
        /// The first one's line.
        line: usize,
        /// The first one.
        problem: String,
    },
    /// The manifest cannot be read.
    #[error("--manifest {path}: {reason}")]
    Manifest {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
    /// A flag does not fit.
    #[error("{0}")]
    Flags(String),
    /// The spawned fleet did not start.
    #[error("--spawn: {0}")]
    Spawn(String),
    /// No fleet to talk to.
    #[error("{0}")]
    Connect(String),
}

/// `OLD=NEW`.
fn parse_mapping(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((old, new)) if !old.is_empty() && !new.is_empty() => Ok((old.to_owned(), new.to_owned())),
        _ => Err(format!("{text:?}: expected OLD=NEW (two tool_ids)")),
    }
}

/// The loaded recording, refused when it is not one.
fn recording(args: &ReplayArgs) -> Result<load::Loaded, ReplayError> {
    let loaded = load::load(&args.file)?;
    let file = args.file.display().to_string();
    match loaded.format {
        Some(Format::F3) => return Err(ReplayError::MockFile(file)),
        None if loaded.problems.is_empty() => return Err(ReplayError::Empty(file)),
        _ => {}
    }
    if let Some(first) = loaded.problems.first() {
        return Err(ReplayError::Invalid {
            file,
            count: loaded.problems.len(),
            line: first.line,
            problem: first.problem.clone(),
        });
    }
    Ok(loaded)
}

fn manifest(path: &std::path::Path) -> Result<AppManifestAcl, ReplayError> {
    let failed = |reason: String| ReplayError::Manifest {
        path: path.display().to_string(),
        reason,
    };
    let text = std::fs::read_to_string(path).map_err(|e| failed(e.to_string()))?;
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| failed(e.to_string()))?;
    AppManifestAcl::from_json(&value).map_err(|e| failed(e.to_string()))
}

/// `fleet replay`: the report on stdout; whether every call passed.
pub async fn run(args: &ReplayArgs) -> Result<bool, ReplayError> {
    let loaded = recording(args)?;
    let opts = engine::Options {
        strict: args.strict,
        map_tool: args.map_tool.iter().cloned().collect::<HashMap<_, _>>(),
        manifest: args.manifest.as_deref().map(manifest).transpose()?,
    };
    if args.spawn && args.client.nats_url.is_some() {
        return Err(ReplayError::Flags(
            "--spawn starts a fleet of its own: drop --nats-url".into(),
        ));
    }
    let mut client_args = args.client.clone();
    if client_args.token.is_none() && client_args.user.is_none() {
        client_args.user = Some(DEFAULT_USER.to_owned());
    }
    let mut spawned = None;
    if args.spawn {
        let plugins = args
            .plugins_dir
            .clone()
            .unwrap_or_else(fleet_client::api::default_plugins_dir);
        let s = spawn::Spawned::start(&plugins, args.isolation.as_deref()).await?;
        client_args.data_dir = s.data_dir().to_path_buf();
        // Only the spawned fleet's own dev key is accepted there (a `FLEET_TOKEN` of another fleet would not be).
        client_args.token = None;
        client_args.user.get_or_insert_with(|| DEFAULT_USER.to_owned());
        spawned = Some(s);
    }
    let rows = match connect(&client_args).await {
        Ok(client) => Ok(engine::replay(&client, &loaded.entries, &opts).await),
        Err(e) => Err(e),
    };
    if let Some(mut s) = spawned {
        s.stop().await;
    }
    let rows = rows?;
    let report = report::Report::new(&loaded, rows, args.strict);
    if args.json {
        report::print_json(&report.to_json());
    } else {
        report.print_table();
    }
    Ok(report.green())
}

async fn connect(args: &ClientArgs) -> Result<ApiClient, ReplayError> {
    let token = args.token().map_err(|e| ReplayError::Connect(e.to_string()))?;
    Ok(ApiClient::connect(&args.connector(), "fleet-replay", token)
        .await
        .map_err(|e| ReplayError::Connect(e.to_string()))?
        .keeping_alive_as_app())
}

/// `fleet fixture verify|summarize`: the result on stdout; false when `verify` found a problem.
pub fn fixture(cmd: &FixtureCmd) -> Result<bool, ReplayError> {
    let (files, json, verify) = match cmd {
        FixtureCmd::Verify { files, json } => (files, *json, true),
        FixtureCmd::Summarize { files, json } => (files, *json, false),
    };
    let loaded = files
        .iter()
        .map(|f| load::load(f))
        .collect::<Result<Vec<_>, _>>()?;
    let sound = loaded.iter().all(|l| l.problems.is_empty() && l.format.is_some());
    let out = if verify {
        report::verify(&loaded)
    } else {
        report::summarize(&loaded)
    };
    if json {
        report::print_json(&out.json);
    } else {
        report::print_text(&out.text);
    }
    // A summary reports problems without failing; a verification fails on them.
    Ok(!verify || sound)
}
