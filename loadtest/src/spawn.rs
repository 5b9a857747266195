//! `--spawn`: `fleet up` as a child, stopped with SIGINT when dropped (at the end, and on any error).

use std::io::{BufRead as _, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long `fleet up` may take to print its "try" line.
const READY_WITHIN: Duration = Duration::from_secs(90);

/// A running `fleet up`.
#[derive(Debug)]
pub(crate) struct SpawnedFleet {
    child: Child,
    /// Its NATS URL.
    pub(crate) nats_url: String,
    /// Its HTTP listener's `/metrics`.
    pub(crate) metrics_url: String,
}

/// The `fleet` binary: next to this executable, else `fleet` on PATH.
pub(crate) fn fleet_binary() -> PathBuf {
    if let Ok(exe) = std::env::current_exe()
        && let Some(dir) = exe.parent()
    {
        let candidate = dir.join(format!("fleet{}", std::env::consts::EXE_SUFFIX));
        if candidate.is_file() {
            return candidate;
        }
    }
    PathBuf::from("fleet")
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl SpawnedFleet {
    /// Starts `fleet up --data-dir DIR --http 127.0.0.1:<free port> [--nats-url URL | --nats-cluster N]` (the
    /// cluster when the scenario needs one and no URL is given) and waits for its "try" line. Its output goes to `DIR/fleet-up.log`.
    pub(crate) fn start(
        data_dir: &Path,
        nats_url: Option<&str>,
        nats_auth_dir: Option<&Path>,
        nats: &fleet_client::nats_conn::NatsAuthArgs,
        nats_cluster: usize,
    ) -> anyhow::Result<SpawnedFleet> {
        std::fs::create_dir_all(data_dir)?;
        let log_path = data_dir.join("fleet-up.log");
        let log = std::fs::File::create(&log_path)?;
        let bin = fleet_binary();
        let http_port = free_port()?;
        let mut cmd = Command::new(&bin);
        cmd.arg("up")
            .arg("--data-dir")
            .arg(data_dir)
            .arg("--http")
            .arg(format!("127.0.0.1:{http_port}"))
            .env_remove("FLEET_NATS_URL")
            .env_remove("FLEET_DATA_DIR")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log.try_clone()?));
        if nats_url.is_none() {
            // A free port: a node a scenario restarts on its port never races another server for 4222.
            cmd.args(["--nats-port", "0"]);
            if nats_cluster > 1 {
                cmd.arg("--nats-cluster").arg(nats_cluster.to_string());
            }
        }
        if let Some(url) = nats_url {
            cmd.arg("--nats-url").arg(url);
            // An external server: the fleet connects with the role credentials of the auth dir, and TLS.
            if let Some(dir) = nats_auth_dir {
                cmd.arg("--nats-auth-dir").arg(dir);
            }
            for (flag, value) in [
                ("--nats-tls-ca", &nats.nats_tls_ca),
                ("--nats-tls-cert", &nats.nats_tls_cert),
                ("--nats-tls-key", &nats.nats_tls_key),
            ] {
                if let Some(v) = value {
                    cmd.arg(flag).arg(v);
                }
            }
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| anyhow::anyhow!("cannot start {} up: {e}", bin.display()))?;
        let stdout = child.stdout.take();
        let (tx, rx) = mpsc::channel::<String>();
        std::thread::spawn(move || {
            let Some(stdout) = stdout else { return };
            let mut log = log;
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = writeln!(log, "{line}");
                let _ = tx.send(line);
            }
        });
        let mut fleet = SpawnedFleet {
            child,
            nats_url: String::new(),
            metrics_url: format!("http://127.0.0.1:{http_port}/metrics"),
        };
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(line) if line.starts_with("try") => break,
                Ok(_) | Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    anyhow::bail!(
                        "fleet up exited before it was ready (see {}); it ended with:\n{}",
                        log_path.display(),
                        log_tail(&log_path)
                    )
                }
            }
            if let Ok(Some(status)) = fleet.child.try_wait() {
                anyhow::bail!(
                    "fleet up exited ({status}) before it was ready (see {}); it ended with:\n{}",
                    log_path.display(),
                    log_tail(&log_path)
                );
            }
            if Instant::now() > deadline {
                anyhow::bail!(
                    "fleet up was not ready within {READY_WITHIN:?} (see {})",
                    log_path.display()
                );
            }
        }
        fleet.nats_url = match nats_url {
            Some(u) => u.to_string(),
            None => std::fs::read_to_string(data_dir.join("nats-url"))?
                .trim()
                .to_string(),
        };
        Ok(fleet)
    }
}

impl Drop for SpawnedFleet {
    fn drop(&mut self) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        if let Some(pid) = rustix::process::Pid::from_raw(i32::try_from(self.child.id()).unwrap_or(i32::MAX))
        {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::INT);
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// SIGTERM to `child`, then waits up to `within` for it to exit (SIGKILL after); whether it exited on its own.
pub(crate) async fn terminate(mut child: Child, within: Duration) -> bool {
    if let Some(pid) = rustix::process::Pid::from_raw(i32::try_from(child.id()).unwrap_or(i32::MAX)) {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    }
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = child.kill();
    let _ = child.wait();
    false
}

/// The last lines of `fleet up`'s log (its JSON logs carry no token), for an error that must say why it stopped.
fn log_tail(path: &Path) -> String {
    const LINES: usize = 5;
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(LINES)..].join("\n")
}
