//! `rolling-fronts`' extra front replicas: `fleet up --workers 0 --nats-url URL --nats-auth-dir DIR --data-dir D`
//! processes (the fleet's own data dir, so they accept the tokens of its dev key), each waited for until it
//! serves, replaced one at a time (a new one serves, the old one gets SIGTERM and drains).

use std::io::{BufRead as _, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a started front may take to serve (its "front" line).
const SERVE_WITHIN: Duration = Duration::from_secs(60);

/// How long a front told to stop (SIGTERM: it drains the requests in flight) may take before it is killed.
const STOP_WITHIN: Duration = Duration::from_secs(45);

/// The front processes; dropped, the survivors get SIGTERM.
#[derive(Debug)]
pub(crate) struct Fronts {
    children: Vec<Child>,
    nats_url: String,
    auth_dir: PathBuf,
    data_dir: PathBuf,
}

impl Fronts {
    /// Starts `n` fronts and waits until each serves.
    pub(crate) async fn start(
        nats_url: &str,
        auth_dir: PathBuf,
        data_dir: PathBuf,
        n: usize,
    ) -> anyhow::Result<Fronts> {
        let mut fronts = Fronts {
            children: Vec::new(),
            nats_url: nats_url.to_owned(),
            auth_dir,
            data_dir,
        };
        for _ in 0..n {
            fronts.add().await?;
        }
        Ok(fronts)
    }

    /// Starts one more front and waits until it prints that it serves.
    pub(crate) async fn add(&mut self) -> anyhow::Result<()> {
        let http = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        let mut child = Command::new(crate::spawn::fleet_binary())
            .args(["up", "--workers", "0", "--nats-url", &self.nats_url])
            .arg("--nats-auth-dir")
            .arg(&self.auth_dir)
            .arg("--data-dir")
            .arg(&self.data_dir)
            .args(["--http", &http.to_string()])
            .env_remove("FLEET_NATS_URL")
            .env_remove("FLEET_DATA_DIR")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| anyhow::anyhow!("cannot start a front (fleet up --workers 0): {e}"))?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| anyhow::anyhow!("front: no stdout"))?;
        self.children.push(child);
        let serving = tokio::task::spawn_blocking(move || {
            BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
                .any(|l| l.starts_with("front "))
        });
        match tokio::time::timeout(SERVE_WITHIN, serving).await {
            Ok(Ok(true)) => Ok(()),
            Ok(_) => anyhow::bail!("a front (fleet up --workers 0) exited before it served"),
            Err(_) => anyhow::bail!("a front did not serve within {SERVE_WITHIN:?}"),
        }
    }

    /// Stops the oldest front as a rolling update does: SIGTERM (it stops taking requests, answers those in
    /// flight, exits), waited for up to [`STOP_WITHIN`], then SIGKILL. Whether it exited on its own.
    pub(crate) async fn retire_oldest(&mut self) -> bool {
        if self.children.is_empty() {
            return false;
        }
        crate::spawn::terminate(self.children.remove(0), STOP_WITHIN).await
    }
}

impl crate::replicas::Replicas for Fronts {
    async fn add(&mut self) -> anyhow::Result<()> {
        Fronts::add(self).await
    }

    async fn retire_oldest(&mut self) -> bool {
        Fronts::retire_oldest(self).await
    }
}

impl Drop for Fronts {
    fn drop(&mut self) {
        for child in &mut self.children {
            if let Some(pid) = rustix::process::Pid::from_raw(i32::try_from(child.id()).unwrap_or(i32::MAX)) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
            }
        }
        let deadline = Instant::now() + STOP_WITHIN;
        for child in &mut self.children {
            while Instant::now() < deadline && !matches!(child.try_wait(), Ok(Some(_))) {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
