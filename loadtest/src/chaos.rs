//! `chaos-worker-kill`'s extra workers: `fleet worker --nats-url URL` processes (isolation `none`, the demo
//! catalogue), each waited for until it is in the fleet's worker registry, one of them to be SIGKILLed.

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
    _state: tempfile::TempDir,
}

fn catalogue() -> PathBuf {
    std::env::var_os("FLEET_PLUGINS_DIR").map_or_else(fleet_client::api::default_plugins_dir, PathBuf::from)
}

impl Workers {
    /// Starts `n` workers against `nats_url` and waits until each is registered.
    pub(crate) async fn start(
        ctx: &Ctx,
        nats: &fleet_client::nats_conn::Connector,
        n: usize,
    ) -> anyhow::Result<Workers> {
        let nats_url = nats.url.as_str();
        let state = tempfile::Builder::new().prefix("loadtest-workers-").tempdir()?;
        let mut workers = Workers {
            children: Vec::new(),
            _state: state,
        };
        let kv = async_nats::jetstream::new(ctx.ops.clone())
            .get_key_value("fleet_workers")
            .await
            .map_err(|e| anyhow::anyhow!("the fleet's worker registry: {e}"))?;
        for i in 0..n {
            let id = format!("chaos-{}-{i}", ctx.run_tag);
            let log = std::fs::File::create(workers._state.path().join(format!("{id}.log")))?;
            let child = Command::new(crate::spawn::fleet_binary())
                .args([
                    "worker",
                    "--isolation",
                    "none",
                    "--nats-url",
                    nats_url,
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
                .arg(workers._state.path().join(&id))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::from(log))
                .spawn()
                .map_err(|e| anyhow::anyhow!("cannot start fleet worker: {e}"))?;
            workers.children.push(child);
            let deadline = Instant::now() + REGISTER_WITHIN;
            loop {
                if let Ok(Some(_)) = kv.get(&id).await {
                    break;
                }
                if let Some(Ok(Some(status))) = workers.children.last_mut().map(Child::try_wait) {
                    anyhow::bail!("fleet worker {id} exited ({status}) before it registered");
                }
                if Instant::now() > deadline {
                    anyhow::bail!("fleet worker {id} did not register within {REGISTER_WITHIN:?}");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        Ok(workers)
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
