//! `fleet replay --spawn`: a `fleet up` of its own for the replay — this binary as a child, over the given
//! plugin catalogue, with a temporary data directory (its NATS on a free port when 4222 is taken, its HTTP on a
//! free port), tied to this process (it dies with it), stopped with SIGTERM after the replay.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::AsyncBufReadExt as _;

use super::ReplayError;

/// How long the spawned fleet may take to be ready (its nats-server, JetStream resources, the catalogue's
/// plugins described): `fleet up`'s own start-up bound is its nats-server's readiness wait plus the catalogue.
pub const READY_WAIT: Duration = Duration::from_secs(120);
/// How long it may take to stop after SIGTERM (its drain grace, then its sessions' shutdown ladders) before it is
/// killed.
pub const STOP_WAIT: Duration = Duration::from_secs(60);

/// Environment that would point the child at another fleet.
const SCRUBBED_ENV: &[&str] = &[
    "FLEET_NATS_URL",
    "FLEET_NATS_CREDS",
    "FLEET_NATS_AUTH_DIR",
    "FLEET_DATA_DIR",
    "FLEET_PLUGINS_DIR",
    "FLEET_NATS_CLUSTER",
    "FLEET_EXEC_SIGNING_KEY",
    "FLEET_EXEC_VERIFY_KEY",
];

/// A running `fleet up` child.
#[derive(Debug)]
pub struct Spawned {
    child: tokio::process::Child,
    data_dir: PathBuf,
    _tmp: tempfile::TempDir,
}

impl Spawned {
    /// Starts `fleet up --data-dir <tmp>/data --plugins-dir <plugins_dir> --http 127.0.0.1:<free>` (and
    /// `--isolation` when given) and waits until it prints its "try" line.
    pub async fn start(plugins_dir: &Path, isolation: Option<&str>) -> Result<Spawned, ReplayError> {
        let failed = |what: &str, e: &dyn std::fmt::Display| ReplayError::Spawn(format!("{what}: {e}"));
        let plugins_dir = std::fs::canonicalize(plugins_dir)
            .map_err(|e| failed(&format!("--plugins-dir {}", plugins_dir.display()), &e))?;
        let tmp = tempfile::Builder::new()
            .prefix("fleet-replay-")
            .tempdir()
            .map_err(|e| failed("temporary data directory", &e))?;
        // The plugins' uids traverse the data directory to their workspaces: not a 0700 parent.
        std::fs::set_permissions(tmp.path(), std::os::unix::fs::PermissionsExt::from_mode(0o711))
            .map_err(|e| failed("temporary data directory", &e))?;
        let data_dir = tmp.path().join("data");
        let http = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| failed("a free HTTP port", &e))?;
        let exe = std::env::current_exe().map_err(|e| failed("this program's path", &e))?;
        let stderr = std::fs::File::create(tmp.path().join("up.stderr"))
            .map_err(|e| failed("temporary data directory", &e))?;
        let mut cmd = std::process::Command::new(exe);
        cmd.arg("up")
            .arg("--data-dir")
            .arg(&data_dir)
            .arg("--plugins-dir")
            .arg(&plugins_dir)
            .arg("--http")
            .arg(http.to_string())
            .current_dir(tmp.path())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr);
        if let Some(i) = isolation {
            cmd.arg("--isolation").arg(i);
        }
        for var in SCRUBBED_ENV {
            cmd.env_remove(var);
        }
        fleet_worker::sandbox::die_with_parent(&mut cmd);
        let mut cmd = tokio::process::Command::from(cmd);
        cmd.kill_on_drop(true);
        let mut child = cmd.spawn().map_err(|e| failed("fleet up", &e))?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| ReplayError::Spawn("fleet up: no stdout".into()))?;
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let ready = async {
            while let Ok(Some(line)) = lines.next_line().await {
                if line.starts_with("try ") {
                    return true;
                }
            }
            false
        };
        let ready = tokio::time::timeout(READY_WAIT, ready).await;
        // Keep reading its stdout so it never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let mut spawned = Spawned {
            child,
            data_dir,
            _tmp: tmp,
        };
        match ready {
            Ok(true) => Ok(spawned),
            Ok(false) => {
                let _ = spawned.child.wait().await;
                Err(ReplayError::Spawn(format!(
                    "fleet up exited before it was ready: {}",
                    spawned.error_line()
                )))
            }
            Err(_) => {
                spawned.stop().await;
                Err(ReplayError::Spawn(format!(
                    "fleet up not ready within {READY_WAIT:?}: {}",
                    spawned.error_line()
                )))
            }
        }
    }

    /// Its data directory (the clients' `--data-dir`).
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// The error line `fleet up` printed (`fleet: …`), if any.
    fn error_line(&self) -> String {
        std::fs::read_to_string(self._tmp.path().join("up.stderr"))
            .ok()
            .and_then(|s| {
                s.lines()
                    .rev()
                    .find(|l| l.starts_with("fleet: "))
                    .map(str::to_owned)
            })
            .unwrap_or_else(|| "no error line on its stderr".to_owned())
    }

    /// SIGTERM, then waits [`STOP_WAIT`] for it to exit (killed after that).
    pub async fn stop(&mut self) {
        if let Some(pid) = self
            .child
            .id()
            .and_then(|id| i32::try_from(id).ok())
            .and_then(rustix::process::Pid::from_raw)
        {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        if tokio::time::timeout(STOP_WAIT, self.child.wait()).await.is_err() {
            let _ = self.child.kill().await;
        }
    }
}
