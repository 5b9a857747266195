//! The extra workers of `chaos-worker-kill` and `rolling-workers`: `fleet worker --nats-url URL` processes
//! (isolation `none`, the demo catalogue), each waited for until it is in the fleet's worker registry; one of
//! them SIGKILLed, or each in turn replaced by a new one and stopped with SIGTERM (a rolling update).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::engine::Ctx;

/// How long a started worker may take to show up in the registry.
const REGISTER_WITHIN: Duration = Duration::from_secs(30);

/// The worker processes; dropped or stopped, the survivors get SIGTERM.
#[derive(Debug)]
pub(crate) struct Workers {
    children: Vec<Child>,
    /// Workers started so far (the next one's id).
    started: usize,
    nats: fleet_client::nats_conn::Connector,
    run_tag: String,
    registry: async_nats::jetstream::kv::Store,
    _state: tempfile::TempDir,
}

/// How long a worker told to stop (SIGTERM: it drains) may take before it is killed: its drain grace
/// (`fleet worker --drain-grace-secs`, default 30 s) and the plugin shutdown ladder.
const STOP_WITHIN: Duration = Duration::from_secs(45);

fn catalogue() -> PathBuf {
    std::env::var_os("FLEET_PLUGINS_DIR").map_or_else(fleet_client::api::default_plugins_dir, PathBuf::from)
}

impl Workers {
    /// Starts `n` workers against `nats` and waits until each is registered.
    pub(crate) async fn start(
        ctx: &Ctx,
        nats: &fleet_client::nats_conn::Connector,
        n: usize,
    ) -> anyhow::Result<Workers> {
        let state = tempfile::Builder::new().prefix("loadtest-workers-").tempdir()?;
        let registry = async_nats::jetstream::new(ctx.ops.clone())
            .get_key_value("fleet_workers")
            .await
            .map_err(|e| anyhow::anyhow!("the fleet's worker registry: {e}"))?;
        let mut workers = Workers {
            children: Vec::new(),
            started: 0,
            nats: nats.clone(),
            run_tag: ctx.run_tag.clone(),
            registry,
            _state: state,
        };
        for _ in 0..n {
            workers.add().await?;
        }
        Ok(workers)
    }

    /// Starts one more worker and waits until it is registered.
    pub(crate) async fn add(&mut self) -> anyhow::Result<()> {
        let nats = &self.nats;
        let id = format!("chaos-{}-{}", self.run_tag, self.started);
        self.started += 1;
        let log = std::fs::File::create(self._state.path().join(format!("{id}.log")))?;
        let child = Command::new(crate::spawn::fleet_binary())
            .args([
                "worker",
                "--isolation",
                "none",
                "--nats-url",
                nats.url.as_str(),
                "--worker-id",
                &id,
            ])
            .args(
                nats.creds
                    .iter()
                    .flat_map(|c| [std::ffi::OsStr::new("--nats-creds"), c.as_os_str()]),
            )
            .args(
                nats.tls
                    .ca
                    .iter()
                    .flat_map(|c| [std::ffi::OsStr::new("--nats-tls-ca"), c.as_os_str()]),
            )
            .arg("--catalogue")
            .arg(catalogue())
            .arg("--state-dir")
            .arg(self._state.path().join(&id))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .map_err(|e| anyhow::anyhow!("cannot start fleet worker: {e}"))?;
        self.children.push(child);
        let deadline = Instant::now() + REGISTER_WITHIN;
        loop {
            if let Ok(Some(_)) = self.registry.get(&id).await {
                return Ok(());
            }
            if let Some(Ok(Some(status))) = self.children.last_mut().map(Child::try_wait) {
                anyhow::bail!("fleet worker {id} exited ({status}) before it registered");
            }
            if Instant::now() > deadline {
                anyhow::bail!("fleet worker {id} did not register within {REGISTER_WITHIN:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops the oldest worker as a rolling update does: SIGTERM (it leaves the registry, finishes its calls and
    /// jobs, exits), waited for up to [`STOP_WITHIN`], then SIGKILL. Whether it exited on its own.
    pub(crate) async fn retire_oldest(&mut self) -> bool {
        if self.children.is_empty() {
            return false;
        }
        crate::spawn::terminate(self.children.remove(0), STOP_WITHIN).await
    }

    /// The worker to kill (taken out of the set).
    pub(crate) fn victim(&mut self) -> Option<Child> {
        (!self.children.is_empty()).then(|| self.children.remove(0))
    }

    /// SIGTERM to the survivors, then waits for them (SIGKILL after 15 s).
    pub(crate) fn stop(&mut self) {
        for child in &self.children {
            if let Some(pid) = rustix::process::Pid::from_raw(i32::try_from(child.id()).unwrap_or(i32::MAX)) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(15);
        for child in &mut self.children {
            while Instant::now() < deadline && !matches!(child.try_wait(), Ok(Some(_))) {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        self.children.clear();
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.stop();
    }
}

impl crate::replicas::Replicas for Workers {
    async fn add(&mut self) -> anyhow::Result<()> {
        Workers::add(self).await
    }

    async fn retire_oldest(&mut self) -> bool {
        Workers::retire_oldest(self).await
    }
}
