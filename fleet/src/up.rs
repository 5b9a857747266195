//! `fleet up`: everything on one machine — a child nats-server (unless `--nats-url`), the front with its
//! sweeper, N in-process workers over the plugin catalogue, and the HTTP gateway (`crate::http`: `/v1/rpc`, SSE,
//! `/healthz`, `/readyz`, `/metrics`, the operator page). Ctrl-C (or SIGTERM) shuts it all down: every plugin session through its ladder, every cgroup,
//! the nats-server.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use fleet_worker::catalogue::{Catalogue, LoadOptions};
use fleet_worker::config::{IsolationMode, RunAs, WorkerConfig};
use fleet_worker::metrics::WorkerMetrics;
use fleet_worker::pool::Pool;
use fleet_worker::sandbox::{Sandbox, SandboxError};
use fleet_worker::session::WorkerContext;

use crate::front::{Front, FrontConfig};
use crate::nats_auth::exec_seal::{ExecSigner, ExecVerifier, SealKeyError};
use crate::nats_server::{NatsServer, free_port};
use crate::node::WorkerNode;
use fleet_client::api::{DEFAULT_DATA_DIR, default_plugins_dir, nats_url_file};
use fleet_client::auth::{DEFAULT_AUDIENCE, DEFAULT_ISSUER, DevKey, OperatorVerifier, Verifier, VerifyKey};
use fleet_client::creds::{Role, creds_in};
use fleet_store::{Provision, Store, StoreSettings};

/// `fleet up`'s flags (this exact interface: scripts, the README and docs/ use it).
#[derive(Debug, Clone, clap::Args)]
pub struct UpArgs {
    /// On Ctrl-C/SIGTERM, how long the in-process workers let in-flight invokes and running jobs finish after
    /// leaving the registry (seconds).
    #[arg(long, env = "FLEET_DRAIN_GRACE_SECS", default_value_t = crate::node::DRAIN_GRACE.as_secs())]
    pub drain_grace_secs: u64,
    /// Use this NATS server (or comma-separated servers) instead of starting one.
    #[arg(long, env = "FLEET_NATS_URL")]
    pub nats_url: Option<String>,
    /// Start this many clustered nats-servers on loopback instead of one (1, 3 or 5): the production topology on
    /// one machine. `<data-dir>/nats-url` then lists them comma-separated, and every JetStream resource gets this
    /// many replicas unless --jetstream-replicas says otherwise.
    #[arg(long, env = "FLEET_NATS_CLUSTER", default_value_t = 1, conflicts_with = "nats_url",
          value_parser = parse_cluster_size)]
    pub nats_cluster: usize,
    /// The client port of our own nats-server (of the first node of a cluster; the others, and every route and
    /// monitoring port, are picked free). Default: 4222 when it is free, else any free port; 0: any free port
    /// (what tests use, so a server of theirs restarted on its port never races another for 4222).
    #[arg(long, env = "FLEET_NATS_PORT", conflicts_with = "nats_url")]
    pub nats_port: Option<u16>,
    /// Credentials and TLS of the connections (`--nats-creds` is the front's; with --nats-url and no
    /// --nats-auth-dir, the in-process workers use it too).
    #[command(flatten)]
    pub nats: fleet_client::nats_conn::NatsAuthArgs,
    /// A directory of NATS auth material (`fleet nats-auth init`): the front connects with its `front.creds`,
    /// in-process workers with its `worker.creds`, and the front serves `fleet creds` (it needs `seeds.json`,
    /// `jwts.json`, `sys.creds`). Default with its own nats-server: `<data-dir>/nats`.
    #[arg(long, env = "FLEET_NATS_AUTH_DIR")]
    pub nats_auth_dir: Option<PathBuf>,
    /// The seed the front seals exec requests and cancels with (`exec.seed`). Default: `exec.seed` of
    /// --nats-auth-dir (with its own nats-server: `<data-dir>/nats`), else beside --nats-creds.
    #[arg(long, env = "FLEET_EXEC_SIGNING_KEY")]
    pub exec_signing_key: Option<PathBuf>,
    /// The public keys the in-process workers accept seals of (`exec.pub`). Default: `exec.pub` of
    /// --nats-auth-dir, else beside --nats-creds, else this front's own key.
    #[arg(long, env = "FLEET_EXEC_VERIFY_KEY")]
    pub exec_verify_key: Option<PathBuf>,
    /// The plugin catalogue (default: the demo plugins shipped in the repo).
    #[arg(long, env = "FLEET_PLUGINS_DIR")]
    pub plugins_dir: Option<PathBuf>,
    /// State: the nats-server store, the dev signing key, per-user workspaces.
    #[arg(long, env = "FLEET_DATA_DIR", default_value = DEFAULT_DATA_DIR)]
    pub data_dir: PathBuf,
    /// In-process workers (0: a front only — the Helm layout, with `fleet worker` pods beside it).
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    /// The HTTP listener (health, metrics).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub http: String,
    /// `cgroup` (default when root) or `none` (the default when not root: no cgroups, plugins run as you).
    #[arg(long, env = "FLEET_ISOLATION")]
    pub isolation: Option<String>,
    /// A file holding an HS256 secret (≥ 32 bytes) that API tokens may be signed with (repeatable). When any key
    /// flag is given, the dev key of --data-dir is NOT accepted.
    #[arg(long = "jwt-hs256-secret-file", env = "FLEET_JWT_HS256_SECRET_FILE")]
    pub jwt_hs256_secret_files: Vec<PathBuf>,
    /// A PEM file with an Ed25519 public key API tokens may be signed with (repeatable).
    #[arg(long = "jwt-ed25519-public-key", env = "FLEET_JWT_ED25519_PUBLIC_KEY")]
    pub jwt_ed25519_public_keys: Vec<PathBuf>,
    /// A file holding an HS256 secret (≥ 32 bytes) that operator tokens (audience `cloud-agents-operator`) may be
    /// signed with (repeatable). When any operator key flag is given, the dev operator key of --data-dir is NOT
    /// accepted. User-token keys never verify operator tokens.
    #[arg(
        long = "operator-jwt-hs256-secret-file",
        env = "FLEET_OPERATOR_JWT_HS256_SECRET_FILE"
    )]
    pub operator_jwt_hs256_secret_files: Vec<PathBuf>,
    /// A PEM file with an Ed25519 public key operator tokens may be signed with (repeatable).
    #[arg(
        long = "operator-jwt-ed25519-public-key",
        env = "FLEET_OPERATOR_JWT_ED25519_PUBLIC_KEY"
    )]
    pub operator_jwt_ed25519_public_keys: Vec<PathBuf>,
    /// The `iss` API tokens must carry.
    #[arg(long, env = "FLEET_JWT_ISSUER", default_value = DEFAULT_ISSUER)]
    pub jwt_issuer: String,
    /// The `aud` API tokens must carry.
    #[arg(long, env = "FLEET_JWT_AUDIENCE", default_value = DEFAULT_AUDIENCE)]
    pub jwt_audience: String,
    /// The longest lifetime an API or window token may have when it is used: an `exp` further than this from
    /// now is `invalid_token` (`lifetime_too_long`). 0 accepts any `exp`.
    #[arg(long, env = "FLEET_JWT_MAX_LIFETIME_SECS", default_value_t = fleet_client::auth::DEFAULT_MAX_LIFETIME_SECS)]
    pub jwt_max_lifetime_secs: u64,
    /// Package downloads (`fleet plugins install URL`) may connect to this range (a CIDR; repeat, or separate by
    /// commas) although it is loopback, link-local or private: an operator's own package host. Without it only
    /// public addresses are reached.
    #[arg(long, env = "FLEET_PACKAGE_SOURCE_ALLOW", value_delimiter = ',')]
    pub package_source_allow: Vec<ipnet::IpNet>,
    /// The package index hosts an install's confined preparation (`uv sync`) may reach through its egress proxy
    /// (repeat, or separate by commas; `none` for no network at all: `uv` then runs offline). Default: PyPI
    /// (`pypi.org`, `files.pythonhosted.org`).
    #[arg(long, env = "FLEET_PREPARE_INDEX_HOSTS", value_delimiter = ',')]
    pub prepare_index_host: Vec<String>,
    /// Ranges those index hosts may resolve into although the proxy refuses them by default (a mirror on a
    /// private network; a CIDR, repeat or separate by commas).
    #[arg(long, env = "FLEET_PREPARE_ALLOW_CIDRS", value_delimiter = ',')]
    pub prepare_allow_cidr: Vec<ipnet::IpNet>,
    /// Serve `/metrics` (and `/healthz`, `/readyz`) on this address, and not on --http: a port only Prometheus and
    /// the probes reach (the chart sets it). Without it `/metrics` is served on --http.
    #[arg(long, env = "FLEET_METRICS_HTTP")]
    pub metrics_http: Option<String>,
    /// Export traces over OTLP/gRPC to this endpoint (e.g. http://127.0.0.1:4317); off when absent.
    #[arg(long, env = "FLEET_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// Replicas of every JetStream resource (3 on a NATS cluster); every process of a fleet must agree. Default:
    /// the --nats-cluster size with its own servers, else 1.
    #[arg(long, env = "FLEET_JETSTREAM_REPLICAS")]
    pub jetstream_replicas: Option<usize>,
    /// Active (queued + running) jobs per user (spec: 5).
    #[arg(long, env = "FLEET_MAX_ACTIVE_JOBS_PER_USER", default_value_t = fleet_proto::limits::MAX_ACTIVE_JOBS_PER_USER)]
    pub max_active_jobs_per_user: usize,
    /// Bytes of job records and progress one user's jobs may keep in JetStream (admission refuses a job that
    /// would pass it: `job_quota_exceeded`); at least one job's reserve (~4.9 MiB).
    #[arg(long, env = "FLEET_MAX_JOB_BYTES_PER_USER", default_value_t = fleet_store::settings::MAX_JOB_BYTES_PER_USER)]
    pub max_job_bytes_per_user: u64,
    /// Bytes the FLEET account's JetStream store may hold, as the server counts them (in a cluster every replica
    /// counts): new jobs are refused (`long_job_capacity`, retriable) above 90 % of it, the rest is kept for the
    /// work already admitted; `fleet up`'s own servers get it as their file stores' cap (split between them).
    /// 0 = with its own servers, 75 % of the disk free under the data dir at start; with --nats-url, the
    /// account's own JetStream disk limit, or no fleet-wide guard when it has none.
    #[arg(long, env = "FLEET_JOB_STORE_MAX_BYTES", default_value_t = 0)]
    pub job_store_max_bytes: u64,
    /// Admission: requests per second per user (token bucket refill).
    #[arg(long, env = "FLEET_RATE_LIMIT_PER_SEC", default_value_t = 50)]
    pub rate_limit_per_sec: u32,
    /// Admission: burst per user.
    #[arg(long, env = "FLEET_RATE_LIMIT_BURST", default_value_t = 100)]
    pub rate_limit_burst: u32,
    /// Admission: API requests of one user this front handles at once (more are `rate_limited`).
    #[arg(long, env = "FLEET_MAX_IN_FLIGHT_PER_USER", default_value_t = crate::front::MAX_IN_FLIGHT_PER_USER)]
    pub max_in_flight_per_user: usize,
    /// Admission: bytes of one API request's arguments (a sync tools.invoke's whole request) this front reads;
    /// larger requests are refused before they are parsed (invalid_arg, details.reason args_too_large).
    #[arg(long, env = "FLEET_MAX_ARGS_BYTES", default_value_t = crate::front::MAX_ARGS_BYTES)]
    pub max_args_bytes: usize,
    /// Admission: bytes of API requests of one user this front holds at once (their payloads together; more are
    /// rate_limited). A request held costs the front at most 3 times its bytes.
    #[arg(long, env = "FLEET_MAX_BYTES_IN_FLIGHT_PER_USER", default_value_t = crate::front::MAX_BYTES_IN_FLIGHT_PER_USER)]
    pub max_bytes_in_flight_per_user: usize,
    /// HTTP listeners (--http, --metrics-http): seconds a client may take to send a request's head (or, on an
    /// idle keep-alive connection, the next one) before the connection is closed.
    #[arg(long, env = "FLEET_HTTP_HEADER_TIMEOUT_SECS", value_parser = clap::value_parser!(u64).range(1..), default_value_t = crate::http::listener::HEADER_READ_TIMEOUT.as_secs())]
    pub http_header_timeout_secs: u64,
    /// HTTP listeners: seconds a client may take to send a request's body, from its head (uploads included); a
    /// body not complete by then fails and its connection is closed.
    #[arg(long, env = "FLEET_HTTP_BODY_TIMEOUT_SECS", value_parser = clap::value_parser!(u64).range(1..), default_value_t = crate::http::listener::BODY_READ_TIMEOUT.as_secs())]
    pub http_body_timeout_secs: u64,
    /// HTTP listeners: connections each serves at once; further connections wait in the kernel's backlog until
    /// one closes.
    #[arg(long, env = "FLEET_HTTP_MAX_CONNECTIONS", default_value_t = crate::http::listener::MAX_CONNECTIONS)]
    pub http_max_connections: usize,
    /// Host services (sampling, embeddings, APS storage and files, uploads).
    #[command(flatten)]
    pub services: fleet_services::args::ServicesArgs,
    /// The developer harness: mock upstreams and the per-family mode matrix (`--mocks`, `--dev-mode`).
    #[command(flatten)]
    pub dev: fleet_services::dev::DevArgs,
}

/// `--nats-cluster`: one of [`CLUSTER_SIZES`](crate::nats_server::CLUSTER_SIZES).
fn parse_cluster_size(text: &str) -> Result<usize, String> {
    text.parse::<usize>()
        .ok()
        .filter(|n| crate::nats_server::CLUSTER_SIZES.contains(n))
        .ok_or_else(|| format!("{text:?}: a NATS cluster here has 1, 3 or 5 servers"))
}

/// The verifier: the configured keys, or the dev key of the data dir when none is configured.
/// A sandbox that cannot start, with what the operator of `fleet up` can do about it (the error itself names
/// the directory and the `chmod` when the plugins' uids cannot reach the data directory).
fn sandbox_hint(e: &SandboxError, root: bool) -> String {
    match e {
        SandboxError::Unavailable { .. } | SandboxError::CgroupMount(_) if root => {
            format!("{e} (pass --isolation none to run plugins without cgroups: development only)")
        }
        SandboxError::Unavailable { .. } | SandboxError::CgroupMount(_) => {
            format!("{e} (run as root for cgroup isolation, or pass --isolation none)")
        }
        SandboxError::Config { .. } => format!("{e} (the state directory is <--data-dir>/state)"),
        _ => e.to_string(),
    }
}

/// How the in-process workers prepare installs: the index hosts and ranges of the flags, and the whole data
/// directory (the NATS credentials, the keys, the state) hidden from every preparation.
fn preparation(args: &UpArgs, data_dir: &Path) -> fleet_worker::config::Preparation {
    let mut p = fleet_worker::config::Preparation {
        allow_cidrs: args.prepare_allow_cidr.clone(),
        hidden_paths: vec![data_dir.to_path_buf()],
        ..fleet_worker::config::Preparation::default()
    };
    if !args.prepare_index_host.is_empty() {
        p.index_hosts = index_hosts(&args.prepare_index_host);
    }
    p
}

/// The index hosts of `--prepare-index-host` values: `none` alone means no network; names are trimmed and empty
/// ones dropped.
fn index_hosts(values: &[String]) -> Vec<String> {
    values
        .iter()
        .map(|h| h.trim())
        .filter(|h| !h.is_empty() && *h != "none")
        .map(str::to_owned)
        .collect()
}

fn verifier(args: &UpArgs, data_dir: &Path) -> Result<Verifier, UpError> {
    let mut keys = load_keys(&args.jwt_hs256_secret_files, &args.jwt_ed25519_public_keys)?;
    if keys.is_empty() {
        let key = DevKey::load_or_create(data_dir).map_err(|e| other("dev signing key")(&e))?;
        keys.push(key.verify_key().map_err(|e| other("dev key")(&e))?);
    }
    let max_lifetime = (args.jwt_max_lifetime_secs > 0).then_some(args.jwt_max_lifetime_secs);
    Verifier::new(keys, &args.jwt_issuer, &args.jwt_audience)
        .map(|v| v.with_max_lifetime(max_lifetime))
        .map_err(|e| other("verifier")(&e))
}

/// The operator verifier: the configured operator keys, or the dev operator key of the data dir when none is
/// configured (never the user-token keys).
fn operator_verifier(args: &UpArgs, data_dir: &Path) -> Result<OperatorVerifier, UpError> {
    let mut keys = load_keys(
        &args.operator_jwt_hs256_secret_files,
        &args.operator_jwt_ed25519_public_keys,
    )?;
    if keys.is_empty() {
        let key = DevKey::load_or_create_operator(data_dir).map_err(|e| other("dev operator key")(&e))?;
        keys.push(key.verify_key().map_err(|e| other("dev operator key")(&e))?);
    }
    OperatorVerifier::new(keys, &args.jwt_issuer).map_err(|e| other("operator verifier")(&e))
}

/// Verification keys from HS256 secret files and Ed25519 public key PEM files.
fn load_keys(hs256_files: &[PathBuf], ed25519_files: &[PathBuf]) -> Result<Vec<VerifyKey>, UpError> {
    let mut keys = Vec::new();
    for path in hs256_files {
        let secret = std::fs::read(path).map_err(|e| other(&path.display().to_string())(&e))?;
        let secret = secret.strip_suffix(b"\n").unwrap_or(&secret);
        keys.push(VerifyKey::hs256(secret).map_err(|e| other(&path.display().to_string())(&e))?);
    }
    for path in ed25519_files {
        let pem = std::fs::read(path).map_err(|e| other(&path.display().to_string())(&e))?;
        keys.push(VerifyKey::ed25519_public_pem(&pem).map_err(|e| other(&path.display().to_string())(&e))?);
    }
    Ok(keys)
}

/// Why `fleet up` could not run.
#[derive(Debug, thiserror::Error)]
pub enum UpError {
    /// The nats-server.
    #[error(transparent)]
    Nats(#[from] crate::nats_server::NatsServerError),
    /// Connecting.
    #[error(transparent)]
    Connect(#[from] fleet_client::nats_conn::ConnectError),
    /// Anything else, with context.
    #[error("{0}")]
    Other(String),
}

fn other(context: &str) -> impl Fn(&dyn std::fmt::Display) -> UpError + '_ {
    move |e| UpError::Other(format!("{context}: {e}"))
}

fn say(line: &str) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Runs until Ctrl-C / SIGTERM.
pub async fn run(args: &UpArgs) -> Result<(), UpError> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).map_err(|e| other("signals")(&e))?;
    let mut int = signal(SignalKind::interrupt()).map_err(|e| other("signals")(&e))?;
    std::fs::create_dir_all(&args.data_dir).map_err(|e| other("data dir")(&e))?;
    let data_dir = std::fs::canonicalize(&args.data_dir).map_err(|e| other("data dir")(&e))?;
    let plugins_dir = args.plugins_dir.clone().unwrap_or_else(default_plugins_dir);

    // The developer harness before anything starts: a broken mock file or `real` without an upstream is an
    // error now, naming the file and line or the family.
    let dev = args
        .dev
        .settings(&plugins_dir)
        .map_err(|e| UpError::Other(e.to_string()))?;
    let services_config = args
        .services
        .config()
        .map_err(|e| UpError::Other(e.to_string()))?;
    let modes = dev
        .resolve(fleet_services::dev::Upstreams::of(&services_config))
        .map_err(|e| UpError::Other(e.to_string()))?;

    // The HTTP listener first, held until it serves: the ports picked free below for the NATS servers (client,
    // routes, monitoring) cannot take it meanwhile, and a taken `--http` fails before anything starts.
    let http = tokio::net::TcpListener::bind(&args.http)
        .await
        .map_err(|e| other(&format!("--http {}", args.http))(&e))?;
    let metrics_http = match &args.metrics_http {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| other(&format!("--metrics-http {addr}"))(&e))?,
        ),
        None => None,
    };

    // Metrics: one registry for the front, the sweeper and every in-process worker.
    let metrics = Arc::new(crate::metrics::FleetMetrics::new());

    // The JetStream store's budget: given, or — with our own servers — a share of the disk the data dir is on,
    // each server's file store capped at its part (each holds a replica of everything).
    let store_budget = match (&args.nats_url, args.job_store_max_bytes) {
        (_, given) if given > 0 => given,
        (Some(_), _) => 0,
        (None, _) => own_store_budget(&data_dir),
    };
    // NATS: our own server (auth on, material in <data-dir>/nats), or the given one.
    let mut server = None;
    let url = match &args.nats_url {
        Some(u) => u.clone(),
        None => {
            let port = match args.nats_port {
                Some(0) => free_port()?,
                Some(port) => port,
                None if std::net::TcpListener::bind("127.0.0.1:4222").is_ok() => 4222,
                None => free_port()?,
            };
            let store = data_dir.join("nats");
            let per_server = (store_budget > 0).then(|| store_budget / args.nats_cluster as u64);
            let s = match NatsServer::start_cluster_with(&store, args.nats_cluster, port, per_server) {
                // Another server took 4222 between the check and the start (a second `fleet up`): any free port.
                // A port asked for by --nats-port is that port or an error.
                Err(crate::nats_server::NatsServerError::PortTaken(_)) if args.nats_port.is_none() => {
                    NatsServer::start_cluster_with(&store, args.nats_cluster, free_port()?, per_server)?
                }
                other => other?,
            };
            let pids: Vec<String> = (0..s.size())
                .filter_map(|i| s.node_pid(i))
                .map(|p| p.to_string())
                .collect();
            say(&format!(
                "nats-server   {} ({} {}, JetStream in {})",
                s.url(),
                if s.size() == 1 { "pid" } else { "pids" },
                pids.join(", "),
                s.store_dir().display()
            ));
            let url = s.url();
            server = Some(s);
            url
        }
    };
    std::fs::write(nats_url_file(&data_dir), &url).map_err(|e| other("data dir")(&e))?;
    let auth_dir = args
        .nats_auth_dir
        .clone()
        .or_else(|| server.as_ref().map(|s: &NatsServer| s.store_dir().to_path_buf()));
    let role_creds = |role: Role| auth_dir.as_ref().map(|d| creds_in(d, role));
    let front_conn = args.nats.connector(&url, role_creds(Role::Front));
    let worker_conn = match role_creds(Role::Worker).filter(|p| p.exists()) {
        Some(creds) if args.nats.nats_creds.is_none() || args.nats_auth_dir.is_some() => {
            front_conn.with_creds(Some(creds))
        }
        _ => front_conn.clone(),
    };
    let direct_replies = crate::node::direct_replies_allowed(worker_conn.creds.as_deref());
    let client = front_conn
        .connect_with("front", metrics.nats_options(async_nats::ConnectOptions::new()))
        .await?;
    let seal_signer = ExecSigner::locate(
        args.exec_signing_key.as_deref(),
        auth_dir.as_deref(),
        args.nats.nats_creds.as_deref(),
    )
    .map_err(|e| UpError::Other(e.to_string()))?;
    let seal_verifier = Arc::new(
        match ExecVerifier::locate(
            args.exec_verify_key.as_deref(),
            auth_dir.as_deref(),
            args.nats.nats_creds.as_deref(),
        ) {
            Ok(v) => v,
            Err(SealKeyError::Missing { .. }) => ExecVerifier::trusting(&seal_signer),
            Err(e) => return Err(UpError::Other(e.to_string())),
        },
    );
    let seal_signer = Arc::new(seal_signer.also_verifying_jobs_with(&seal_verifier));
    let settings = StoreSettings {
        replicas: args.jetstream_replicas.unwrap_or(if args.nats_url.is_some() {
            1
        } else {
            args.nats_cluster
        }),
        max_job_bytes_per_user: args.max_job_bytes_per_user,
        job_store_max_bytes: store_budget,
        ..StoreSettings::default()
    };
    let js = async_nats::jetstream::new(client.clone());
    let store = Store::open(js.clone(), settings.clone())
        .await
        .map_err(|e| other("JetStream resources")(&e))?;
    // Host services of the front: grants (operator API) and the HTTP listener's download and upload links.
    let public_url = Some(format!("http://{}", args.http));
    let services =
        Box::pin(
            args.services
                .open_with_dev(&js, &settings, &data_dir, public_url.clone(), dev.clone()),
        )
        .await
        .map_err(|e| other("host services")(&e))?;
    // Plugin distribution: the operator API `fleet.v1.admin.plugins.*` (packages in the object store). Created
    // before the workers start: they attach to it.
    let plugin_store = crate::plugins::PluginStore::open(&js, store.settings())
        .await
        .map_err(|e| other("plugin store")(&e))?;
    // The in-process workers: their own connection, as the worker user, attached to what the front created.
    let worker_settings = StoreSettings {
        provision: Provision::Attach,
        ..settings.clone()
    };
    let (worker_client, worker_store, worker_services) = if args.workers == 0 {
        (client.clone(), store.clone(), services.clone())
    } else {
        let wc = worker_conn
            .connect_with("worker", metrics.nats_options(async_nats::ConnectOptions::new()))
            .await?;
        let wjs = async_nats::jetstream::new(wc.clone());
        let ws = Store::open(wjs.clone(), worker_settings.clone())
            .await
            .map_err(|e| other("JetStream resources (worker)")(&e))?;
        let wsv =
            Box::pin(
                args.services
                    .open_with_dev(&wjs, &worker_settings, &data_dir, public_url, dev.clone()),
            )
            .await
            .map_err(|e| other("host services (worker)")(&e))?;
        (wc, ws, wsv)
    };

    // Auth: the configured keys, else the dev key in the data dir.
    let verifier = verifier(args, &data_dir)?;
    let operator_verifier = operator_verifier(args, &data_dir)?;

    // Workers.
    let root = rustix::process::geteuid().is_root();
    let isolation = match args.isolation.as_deref() {
        Some("cgroup") => IsolationMode::Cgroup,
        Some("none") => IsolationMode::None,
        Some(o) => {
            return Err(UpError::Other(format!(
                "--isolation must be cgroup or none, not {o:?}"
            )));
        }
        None if root => IsolationMode::Cgroup,
        None => IsolationMode::None,
    };
    let mut nodes = Vec::new();
    let mut sandboxes = Vec::new();
    for i in 0..args.workers {
        let config = WorkerConfig {
            worker_id: format!("up-{}-{i}", std::process::id()),
            catalogue_dir: plugins_dir.clone(),
            state_dir: data_dir.join("state"),
            isolation,
            run_as: if root { RunAs::default() } else { RunAs::Inherit },
            sandbox_stub: Some(crate::worker_cmd::STUB_PROGRAM.into()),
            preparation: preparation(args, &data_dir),
            egress: fleet_worker::config::Egress {
                deny_cidrs: args.services.cluster_cidr.clone(),
                ..fleet_worker::config::Egress::default()
            },
            ..WorkerConfig::default()
        };
        let (catalogue, problems) = Catalogue::load(&config.catalogue_dir, &LoadOptions::for_worker(&config))
            .map_err(|e| other("catalogue")(&e))?;
        if i == 0 {
            for p in &problems {
                say(&format!("catalogue     skipped {p}"));
            }
            say(&format!(
                "catalogue     {} plugin(s) from {}: {}",
                catalogue.len(),
                plugins_dir.display(),
                catalogue
                    .iter()
                    .map(|i| i.tool_id.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        let sandbox = Sandbox::new(&config).map_err(|e| UpError::Other(sandbox_hint(&e, root)))?;
        let _ = sandbox.sweep_stale();
        sandbox.start_stubs();
        let ctx = WorkerContext {
            config: Arc::new(config.clone()),
            sandbox: sandbox.clone(),
            services: Arc::new(worker_services.clone()),
            tokens: Arc::new(crate::recorded::RecordedTokens::new(
                worker_services.clone(),
                worker_store.clone(),
            )),
            metrics: Arc::new(WorkerMetrics::default()),
        };
        let pool = Pool::new(ctx, Arc::new(catalogue));
        let node = WorkerNode::start(
            worker_client.clone(),
            worker_store.clone(),
            pool,
            &config.worker_id,
            metrics.clone(),
            seal_verifier.clone(),
            direct_replies,
        )
        .await
        .map_err(|e| other("worker")(&e))?;
        say(&format!(
            "worker        {} (isolation {})",
            node.id(),
            sandbox.mode()
        ));
        nodes.push(node);
        sandboxes.push(sandbox);
    }

    // Front + sweeper.
    let front = Front::new(
        client.clone(),
        store.clone(),
        verifier.clone(),
        FrontConfig {
            max_active_jobs: args.max_active_jobs_per_user,
            rate_per_user: args.rate_limit_per_sec,
            burst_per_user: args.rate_limit_burst,
            max_in_flight_per_user: args.max_in_flight_per_user,
            max_args_bytes: args.max_args_bytes,
            max_bytes_in_flight_per_user: args.max_bytes_in_flight_per_user,
            ..FrontConfig::default()
        },
        seal_signer.clone(),
    )
    .with_metrics(metrics.clone());
    let service = front.serve().await.map_err(|e| other("API service")(&e))?;
    let admin = crate::grants::serve_admin(
        client.clone(),
        services.grants().clone(),
        operator_verifier.clone(),
    )
    .await
    .map_err(|e| other("operator API")(&e))?;
    let credentials_api = crate::credentials::serve_admin(
        client.clone(),
        services.credential_store().clone(),
        services.oauth().accounts().clone(),
        operator_verifier.clone(),
    )
    .await
    .map_err(|e| other("credentials API")(&e))?;
    let plugins_api = crate::plugins::service::serve(
        client.clone(),
        plugin_store,
        store.clone(),
        operator_verifier.clone(),
        crate::plugins::publish::scratch_dir(&data_dir),
        crate::plugins::download::SourcePolicy::allowing(args.package_source_allow.clone()),
    )
    .await
    .map_err(|e| other("plugins API")(&e))?;
    // App credentials (`fleet creds`): served when this front holds the issuer material.
    let creds_api = match auth_dir
        .as_ref()
        .filter(|d| d.join(crate::nats_auth::SEEDS_FILE).exists())
    {
        None => None,
        Some(dir) => {
            let material = crate::nats_auth::AuthMaterial::load_read_only(dir)
                .map_err(|e| other("NATS issuer material")(&e))?;
            let sys = front_conn
                .with_creds(Some(creds_in(dir, Role::Sys)))
                .connect("front-sys")
                .await?;
            let issuer = crate::creds::Issuer::open(&js, &settings, material, sys)
                .await
                .map_err(|e| other("app credentials")(&e))?;
            Some(
                crate::creds::serve_admin(client.clone(), issuer, operator_verifier.clone())
                    .await
                    .map_err(|e| other("app credentials API")(&e))?,
            )
        }
    };
    let sweeper = tokio::spawn(crate::sweeper::run(front.clone()));
    let http_state = crate::http::HttpState::start(
        front.clone(),
        client.clone(),
        verifier,
        operator_verifier,
        metrics.clone(),
        crate::http::HttpConfig {
            public_metrics: metrics_http.is_none(),
            listener: crate::http::listener::ListenerLimits {
                header_read_timeout: Duration::from_secs(args.http_header_timeout_secs),
                body_read_timeout: Duration::from_secs(args.http_body_timeout_secs),
                max_connections: args.http_max_connections,
            },
            ..crate::http::HttpConfig::default()
        },
    )
    .await
    .map_err(|e| other("HTTP gateway")(&e))?;
    // Download and upload links of the host services, the users' credentials and OAuth accounts and the connect
    // flow are served here too.
    let http_drain = http_state.clone();
    let metrics_task = metrics_http.map(|listener| {
        let addr = listener
            .local_addr()
            .map_or_else(|_| "?".to_owned(), |a| a.to_string());
        say(&format!(
            "metrics       http://{addr}/metrics, /healthz, /readyz (not on the public port)"
        ));
        tokio::spawn(crate::http::serve_ops(listener, http_state.clone()))
    });
    let http_task = tokio::spawn(crate::http::serve_with_services(
        http,
        http_state,
        services.clone(),
    ));
    say(&format!(
        "front         fleet.v1.api.tools.* on {url}; HTTP http://{0}/ (operator page), http://{0}/v1/rpc, /healthz",
        args.http
    ));
    say(
        "plugins       fleet.v1.admin.plugins.* (operator): fleet plugins install SOURCE | list | remove | describe",
    );
    say(
        "credentials   fleet.v1.admin.credentials.* (operator): fleet credentials set --user U [--tool-id T] NAME=VALUE | list | delete",
    );
    if dev.is_active() || !args.dev.dev_modes.is_empty() {
        let families: Vec<String> = fleet_services::dev::DevFamily::ALL
            .iter()
            .map(|f| format!("{}={}", f.as_str(), modes.get(*f).as_str()))
            .collect();
        say(&format!(
            "dev harness   {} ({} mock entries)",
            families.join(" "),
            dev.mocks().len()
        ));
    }
    if let Some(dir) = &auth_dir {
        say(&format!(
            "nats auth     credentials per role in {} (app.creds for app backends; fleet creds issue --name N for more)",
            dir.display()
        ));
    }
    // The line below says the fleet is ready: by then `tools.list` lists every catalogue's tools. A signal in
    // the meantime stops it at once.
    let listed = futures::future::join_all(nodes.iter().map(WorkerNode::catalogue_listed));
    let stopped_early = tokio::select! {
        _ = listed => false,
        _ = term.recv() => true,
        _ = int.recv() => true,
    };
    if !stopped_early {
        say(
            "try           fleet invoke --user alice --tool-id echo-py --tool echo --args '{\"hello\":\"world\"}'",
        );
        say(&format!(
            "              (data dir {}; Ctrl-C stops everything)",
            data_dir.display()
        ));
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    }
    say("stopping      …");
    // The HTTP gateway drains like the NATS front: no new connection, /readyz 503, SSE streams ended, every
    // request in flight answered (bounded by the longest sync call's grace).
    // Each step of the stop is logged: a stop that does not end names the step it is in.
    http_drain.start_draining();
    let http_abort = http_task.abort_handle();
    if tokio::time::timeout(crate::front::FRONT_DRAIN_GRACE, http_task)
        .await
        .is_err()
    {
        tracing::warn!("the HTTP gateway's requests did not end within the drain grace: aborted");
        http_abort.abort();
    }
    if let Some(task) = metrics_task {
        // Served through the drain (readiness 503, the drain's metrics); a scrape in progress is not waited for.
        task.abort();
    }
    tracing::info!(step = "http", "stopping: the HTTP gateway has stopped");
    admin.abort();
    credentials_api.abort();
    plugins_api.abort();
    if let Some(task) = creds_api {
        task.abort();
    }
    sweeper.abort();
    service.stop().await;
    tracing::info!(step = "front", "stopping: the front has drained");
    for node in nodes {
        node.drain(Duration::from_secs(args.drain_grace_secs)).await;
    }
    tracing::info!(step = "workers", "stopping: the workers have drained");
    for sandbox in sandboxes {
        let _ = tokio::task::spawn_blocking(move || sandbox.remove_subtree()).await;
    }
    tracing::info!(step = "cgroups", "stopping: the workers' cgroups are removed");
    for c in [&worker_client, &client] {
        if let Err(e) = fleet_client::nats_conn::drain_for_stop(c).await {
            tracing::warn!(error = %e, "cannot drain a NATS connection");
        }
    }
    tracing::info!(step = "nats", "stopping: the NATS connections are drained");
    if let Some(mut s) = server {
        tokio::task::spawn_blocking(move || s.stop())
            .await
            .map_err(|e| other("nats-server")(&e))?;
    }
    say("stopped");
    Ok(())
}

/// Percent of the disk free under the data dir that `fleet up`'s own NATS servers may fill with JetStream data
/// when `--job-store-max-bytes` is not given.
pub const OWN_STORE_DISK_PERCENT: u64 = 75;

/// `fleet up`'s default JetStream budget with its own servers: [`OWN_STORE_DISK_PERCENT`] of the space free to
/// unprivileged users on `dir`'s filesystem now; 0 (no guard) when that cannot be read, or is too small to hold a
/// job's reserve under the admission mark.
fn own_store_budget(dir: &std::path::Path) -> u64 {
    let free = rustix::fs::statvfs(dir)
        .map(|s| s.f_bavail.saturating_mul(s.f_frsize))
        .unwrap_or(0);
    store_budget_of_free(free)
}

/// [`own_store_budget`] for `free` bytes.
fn store_budget_of_free(free: u64) -> u64 {
    let budget = fleet_store::fill::percent_of(free, OWN_STORE_DISK_PERCENT);
    if StoreSettings::default().store_budget_holds_a_job(budget) {
        budget
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_own_servers_budget_is_three_quarters_of_the_free_disk_or_none() {
        assert_eq!(OWN_STORE_DISK_PERCENT, 75);
        assert_eq!(store_budget_of_free(40 << 30), 30 << 30);
        assert_eq!(store_budget_of_free(u64::MAX), 13_835_058_055_282_163_711);
        // Too small to admit one job under the mark: no guard rather than a fleet that refuses every job.
        let reserve = StoreSettings::default().job_storage_reserve();
        let mut free = reserve;
        while fleet_store::fill::high_water(free * 3 / 4) < reserve {
            free += 1;
        }
        assert_eq!(store_budget_of_free(free), free * 3 / 4);
        assert_eq!(store_budget_of_free(free - 1), 0);
        assert_eq!(store_budget_of_free(0), 0);
    }
}
