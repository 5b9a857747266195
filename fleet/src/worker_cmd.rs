//! `fleet worker`: run the plugin host on its own (until the fleet issue gives it a NATS front).
//!
//! Loads the catalogue, builds the sandbox (refusing to start if cgroups are unusable, unless `--isolation none`),
//! sweeps what a killed predecessor with the same worker id left, prewarms the requested sessions, prints one
//! JSON line per event on stdout (`{"swept": …}`, `{"ready": […]}`, `{"stopped": …}`), and on SIGTERM or SIGINT
//! shuts every session down with the full ladder and removes its cgroup subtree.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use fleet_worker::catalogue::{Catalogue, LoadOptions};
use fleet_worker::config::{IsolationMode, WorkerConfig};
use fleet_worker::metrics::WorkerMetrics;
use fleet_worker::pool::Pool;
use fleet_worker::sandbox::Sandbox;
use fleet_worker::services::{HostServices, NoServices, NoTokens, TokenSource};
use fleet_worker::session::WorkerContext;
use serde_json::json;

use crate::node::WorkerNode;

/// Options of `fleet worker`.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkerArgs {
    /// On SIGTERM, how long in-flight invokes and running jobs may finish after the worker left the registry
    /// (seconds), before their plugins are stopped.
    #[arg(long, env = "FLEET_DRAIN_GRACE_SECS", default_value_t = crate::node::DRAIN_GRACE.as_secs())]
    pub drain_grace_secs: u64,
    /// TOML file with a `WorkerConfig` (every field optional); flags override it.
    #[arg(long, env = "FLEET_WORKER_CONFIG")]
    pub config: Option<PathBuf>,
    /// Stable id of this worker on its node (names its cgroup subtree).
    #[arg(long, env = "FLEET_WORKER_ID")]
    pub worker_id: Option<String>,
    /// Directory of plugin installs.
    #[arg(long, env = "FLEET_CATALOGUE_DIR")]
    pub catalogue: Option<PathBuf>,
    /// Root of per-user state (workspaces, TMPDIRs, uid map).
    #[arg(long, env = "FLEET_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// `cgroup` (default) or `none` (no isolation: development only).
    #[arg(long, env = "FLEET_ISOLATION")]
    pub isolation: Option<String>,
    /// Sessions to start at once, as USER:TOOL_ID (repeatable).
    #[arg(long = "prewarm")]
    pub prewarm: Vec<String>,
    /// Join a fleet: serve `fleet.v1.worker.<id>.*` on this NATS server (without it the worker runs standalone).
    #[arg(long, env = "FLEET_NATS_URL")]
    pub nats_url: Option<String>,
    /// Credentials (the worker role's `.creds`, e.g. `.fleet/nats/worker.creds` of a local `fleet up`) and TLS.
    #[command(flatten)]
    pub nats: fleet_client::nats_conn::NatsAuthArgs,
    /// The public keys of the fronts' exec seals (`exec.pub` of the NATS auth directory, one key per line): the
    /// worker serves only exec requests and cancels sealed by one of them. Default: `exec.pub` beside
    /// --nats-creds.
    #[arg(long, env = "FLEET_EXEC_VERIFY_KEY")]
    pub exec_verify_key: Option<PathBuf>,
    /// Serve `/metrics`, `/healthz` and `/readyz` on this address (e.g. 127.0.0.1:9101).
    #[arg(long, env = "FLEET_WORKER_HTTP")]
    pub http: Option<String>,
    /// Export traces over OTLP/gRPC to this endpoint (e.g. http://127.0.0.1:4317); off when absent.
    #[arg(long, env = "FLEET_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// Replicas of every JetStream resource (3 on a NATS cluster); every process of a fleet must agree.
    #[arg(long, env = "FLEET_JETSTREAM_REPLICAS", default_value_t = 1)]
    pub jetstream_replicas: usize,
    /// Host services (with --nats-url only; a standalone worker offers none).
    #[command(flatten)]
    pub services: fleet_services::args::ServicesArgs,
}

/// Why `fleet worker` could not run.
#[derive(Debug, thiserror::Error)]
pub enum WorkerCmdError {
    /// The config file.
    #[error("config {path}: {reason}")]
    Config {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A bad flag value.
    #[error("{0}")]
    Usage(String),
    /// The catalogue directory.
    #[error(transparent)]
    Catalogue(#[from] fleet_worker::catalogue::CatalogueError),
    /// The sandbox.
    #[error(transparent)]
    Sandbox(#[from] fleet_worker::sandbox::SandboxError),
    /// A prewarm failed.
    #[error("prewarm {target}: {reason}")]
    Prewarm {
        /// USER:TOOL_ID.
        target: String,
        /// Why.
        reason: String,
    },
    /// Signal handling.
    #[error("signals: {0}")]
    Signals(std::io::Error),
}

/// The sandbox stubs' program: this binary (its `main` runs `fleet_worker::sandbox::run_if_stub` first). The
/// spawning child resolves it, so it is the worker's own binary even if the file was replaced since.
pub const STUB_PROGRAM: &str = "/proc/self/exe";

/// Builds the config from the file and flags.
pub fn config(args: &WorkerArgs) -> Result<WorkerConfig, WorkerCmdError> {
    let mut config = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| WorkerCmdError::Config {
                path: path.clone(),
                reason: e.to_string(),
            })?;
            toml::from_str(&text).map_err(|e| WorkerCmdError::Config {
                path: path.clone(),
                reason: e.to_string(),
            })?
        }
        None => WorkerConfig::default(),
    };
    config.sandbox_stub = Some(STUB_PROGRAM.into());
    if let Some(v) = &args.worker_id {
        config.worker_id.clone_from(v);
    }
    if let Some(v) = &args.catalogue {
        config.catalogue_dir.clone_from(v);
    }
    if let Some(v) = &args.state_dir {
        config.state_dir.clone_from(v);
    }
    match args.isolation.as_deref() {
        None => {}
        Some("cgroup") => config.isolation = IsolationMode::Cgroup,
        Some("none") => config.isolation = IsolationMode::None,
        Some(other) => {
            return Err(WorkerCmdError::Usage(format!(
                "--isolation must be cgroup or none, not {other:?}"
            )));
        }
    }
    Ok(config)
}

/// The directories holding the worker's NATS credentials and the fronts' seal keys (hidden from preparations).
fn secret_dirs(creds: Option<&std::path::Path>, exec_key: Option<&std::path::Path>) -> Vec<PathBuf> {
    [creds, exec_key]
        .into_iter()
        .flatten()
        .filter_map(|file| file.parent())
        .filter(|dir| !dir.as_os_str().is_empty())
        .map(std::path::Path::to_path_buf)
        .collect()
}

/// The addresses of the NATS servers in `urls` (comma-separated `nats://`/`tls://` URLs or `host:port`), as
/// single-address ranges; names that do not resolve are skipped (they cannot be connected to either).
async fn nats_addresses(urls: &str) -> Vec<ipnet::IpNet> {
    let mut out = Vec::new();
    for url in urls.split(',').map(str::trim).filter(|u| !u.is_empty()) {
        let authority = url.split_once("://").map_or(url, |(_, rest)| rest);
        let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
        let authority = authority.split('/').next().unwrap_or(authority);
        let with_port = if authority.ends_with(']') || !authority.contains(':') {
            format!("{authority}:4222")
        } else {
            authority.to_owned()
        };
        if let Ok(addrs) = tokio::net::lookup_host(with_port.as_str()).await {
            out.extend(addrs.map(|a| ipnet::IpNet::from(a.ip())));
        }
    }
    out
}

fn emit(v: &serde_json::Value) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{v}");
    let _ = out.flush();
}

/// Runs the worker until SIGTERM/SIGINT.
pub async fn run(args: &WorkerArgs) -> Result<(), WorkerCmdError> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).map_err(WorkerCmdError::Signals)?;
    let mut int = signal(SignalKind::interrupt()).map_err(WorkerCmdError::Signals)?;

    let mut config = config(args)?;
    if let Some(urls) = &args.nats_url {
        // Egress-granted plugins must never reach the bus, whatever range the operator opens.
        config.egress.deny_cidrs.extend(nats_addresses(urls).await);
    }
    // The cluster's own ranges: never reached through the proxy (plugins' or preparations'), whatever is opened.
    config
        .egress
        .deny_cidrs
        .extend(args.services.cluster_cidr.iter().copied());
    // What preparations must not see, whatever the configuration file lists: the worker's credentials and keys.
    config.preparation.hidden_paths.extend(secret_dirs(
        args.nats.nats_creds.as_deref(),
        args.exec_verify_key.as_deref(),
    ));
    let (catalogue, problems) = Catalogue::load(&config.catalogue_dir, &LoadOptions::for_worker(&config))?;
    for p in &problems {
        tracing::warn!(problem = %p, "catalogue entry skipped");
    }
    let sandbox = Sandbox::new(&config)?;
    let swept = sandbox.sweep_stale()?;
    sandbox.start_stubs();
    emit(
        &json!({ "swept": { "cgroups_removed": swept.cgroups_removed, "processes_killed": swept.processes_killed },
                  "isolation": sandbox.mode(), "plugins": catalogue.len(), "problems": problems.len() }),
    );
    let metrics = Arc::new(crate::metrics::FleetMetrics::new());
    // In a fleet: connect first, so the sessions get the host services (JetStream-backed) from the start.
    let joined = match &args.nats_url {
        None => None,
        Some(url) => {
            let client = args
                .nats
                .connector(url, None)
                .connect_with("worker", metrics.nats_options(async_nats::ConnectOptions::new()))
                .await
                .map_err(|e| WorkerCmdError::Usage(e.to_string()))?;
            let seals = crate::nats_auth::exec_seal::ExecVerifier::locate(
                args.exec_verify_key.as_deref(),
                None,
                args.nats.nats_creds.as_deref(),
            )
            .and_then(|v| {
                v.keep_session_in(
                    &config
                        .state_dir
                        .join(crate::nats_auth::exec_seal::EXEC_SESSION_FILE),
                )
            })
            .map_err(|e| WorkerCmdError::Usage(e.to_string()))?;
            // Workers attach to the resources a front created: their NATS user may not create streams.
            let settings = fleet_store::StoreSettings {
                replicas: args.jetstream_replicas,
                provision: fleet_store::Provision::Attach,
                ..fleet_store::StoreSettings::default()
            };
            let js = async_nats::jetstream::new(client.clone());
            let store = fleet_store::Store::open(js.clone(), settings.clone())
                .await
                .map_err(|e| WorkerCmdError::Usage(format!("JetStream: {e}")))?;
            let services = args
                .services
                .open(&js, &settings, &config.state_dir, None)
                .await
                .map_err(|e| WorkerCmdError::Usage(e.to_string()))?;
            Some((url.clone(), client, store, services, Arc::new(seals)))
        }
    };
    let (services, tokens): (Arc<dyn HostServices>, Arc<dyn TokenSource>) = match &joined {
        Some((_, _, store, s, _)) => (
            Arc::new(s.clone()),
            Arc::new(crate::recorded::RecordedTokens::new(s.clone(), store.clone())),
        ),
        None => (Arc::new(NoServices), Arc::new(NoTokens)),
    };
    let ctx = WorkerContext {
        config: Arc::new(config),
        sandbox: sandbox.clone(),
        services,
        tokens,
        metrics: Arc::new(WorkerMetrics::default()),
    };
    let pool = Pool::new(ctx, Arc::new(catalogue));

    let mut ready = Vec::new();
    for target in &args.prewarm {
        let Some((user, tool_id)) = target.split_once(':') else {
            return Err(WorkerCmdError::Usage(format!(
                "--prewarm takes USER:TOOL_ID, not {target:?}"
            )));
        };
        let session = pool
            .prewarm(user, tool_id, Duration::from_secs(60))
            .await
            .map_err(|e| WorkerCmdError::Prewarm {
                target: target.clone(),
                reason: e.to_string(),
            })?;
        ready.push(json!({ "user": user, "tool_id": tool_id, "pid": session.pid() }));
    }
    let node = match joined {
        None => {
            metrics.register_pool(&pool);
            None
        }
        Some((url, client, store, _services, seals)) => {
            let worker_id = pool.context().config.worker_id.clone();
            Some(
                crate::node::WorkerNode::start(
                    client,
                    store,
                    pool.clone(),
                    &worker_id,
                    metrics.clone(),
                    seals,
                    crate::node::direct_replies_allowed(args.nats.nats_creds.as_deref()),
                )
                .await
                .map_err(|e| WorkerCmdError::Usage(format!("serving on {url}: {e}")))?,
            )
        }
    };
    let http = match &args.http {
        None => None,
        Some(addr) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| WorkerCmdError::Usage(format!("--http {addr}: {e}")))?;
            let local = listener.local_addr().map(|a| a.to_string()).unwrap_or_default();
            let client = node.as_ref().map(|n| n.client().clone());
            Some((
                tokio::spawn(crate::metrics::serve(listener, metrics.clone(), client)),
                local,
            ))
        }
    };
    // Ready once `tools.list` lists this worker's catalogue (a plugin that cannot be described is logged); a
    // signal in the meantime stops it at once.
    let listed = node.as_ref().map(WorkerNode::catalogue_listed);
    let stopped_early = tokio::select! {
        () = async { if let Some(listed) = listed { listed.await } } => false,
        _ = term.recv() => true,
        _ = int.recv() => true,
    };
    if !stopped_early {
        emit(&json!({ "ready": ready, "nats": args.nats_url, "http": http.as_ref().map(|h| &h.1) }));
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    }
    if let Some((task, _)) = http {
        task.abort();
    }
    match node {
        Some(node) => node.drain(Duration::from_secs(args.drain_grace_secs)).await,
        None => pool.shutdown().await,
    }
    let removed = tokio::task::spawn_blocking(move || sandbox.remove_subtree()).await;
    let removed = match removed {
        Ok(Ok(r)) => json!({ "cgroups_removed": r.cgroups_removed, "processes_killed": r.processes_killed }),
        Ok(Err(e)) => json!({ "error": e.to_string() }),
        Err(e) => json!({ "error": e.to_string() }),
    };
    emit(&json!({ "stopped": removed }));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::nats_addresses;

    #[tokio::test]
    async fn every_nats_server_of_a_url_list_is_denied_to_egress() {
        let nets = nats_addresses(
            "nats://127.0.0.1:4222, tls://user:pw@10.1.2.3:4443,[::1]:4222,192.0.2.9,nats://no-such-host.invalid:4222",
        )
        .await;
        let strings: Vec<String> = nets.iter().map(ToString::to_string).collect();
        assert_eq!(
            strings,
            ["127.0.0.1/32", "10.1.2.3/32", "::1/128", "192.0.2.9/32"]
        );
    }
}
