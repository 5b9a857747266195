//! What [`Sandbox::prepare`](crate::sandbox::Sandbox::prepare) made for a plugin, held for as long as a process
//! may run in it: the spawn plan, the user's space, and the process tree (its cgroup, or its process group
//! without isolation) to signal, kill, read the OOM count of and finally remove.

use std::path::Path;
use std::process::Stdio;
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use tokio::process::Command;

use super::SpawnError;
use crate::sandbox::{ExecStatus, Prepared, SandboxError, SessionCgroup, Stub, UserSpace};

/// A prepared sandbox. The whole [`Prepared`] is kept, so everything it holds lives exactly as long as this
/// value (the processes spawned into it hold it); only the cgroup is moved out, to be removed on
/// [`release`](Self::release).
#[derive(Debug)]
pub(crate) struct Sandboxed {
    /// What `prepare` made, less its cgroup (moved to `cgroup`).
    prepared: Prepared,
    cgroup: RwLock<Option<SessionCgroup>>,
    /// A stub already in `cgroup` (an adopted seat), used by the first launch.
    seated: Mutex<Option<Stub>>,
    /// Whether it had a cgroup at all: once released, nothing is signalled (never a process group whose
    /// leader's pid may have been reused).
    isolated: bool,
    /// Held by a kill of the tree from its start until the cgroup is empty, and by a launch while it spawns: the
    /// cgroup is the session's for all its processes, and a kill takes whatever is in it, so a process started
    /// while the previous one's kill still runs (the session restarting for its next call) would be killed too.
    kill_gate: tokio::sync::Mutex<()>,
}

impl Sandboxed {
    /// Takes what `prepare` made.
    pub(crate) fn new(mut prepared: Prepared) -> Sandboxed {
        let cgroup = prepared.cgroup.take();
        let seated = prepared.seated.take();
        Sandboxed {
            isolated: cgroup.is_some(),
            cgroup: RwLock::new(cgroup),
            seated: Mutex::new(seated),
            prepared,
            kill_gate: tokio::sync::Mutex::new(()),
        }
    }

    /// The user's identity and directories.
    pub(crate) fn space(&self) -> &UserSpace {
        &self.prepared.space
    }

    /// `argv` as a command in `dir` with exactly `env`, killed on drop, confined by the sandbox's plan; stdio is
    /// the caller's to set.
    pub(crate) fn command(&self, argv: &[String], dir: &Path, env: Vec<(String, String)>) -> Command {
        let program = argv.first().map_or("", String::as_str);
        let mut cmd = Command::new(program);
        cmd.args(argv.iter().skip(1))
            .current_dir(dir)
            .env_clear()
            .envs(env)
            .kill_on_drop(true);
        crate::sandbox::apply(&mut cmd, &self.prepared.plan);
        cmd
    }

    /// `argv` started in `dir` with exactly `env` and piped stdio, confined by the sandbox's plan: from a waiting
    /// sandbox stub when the plan allows it and one waits (`sandbox/stub_pool.rs`; the `exec`'s outcome is then
    /// still to come), else spawned directly (the `exec` succeeded).
    pub(crate) async fn launch(
        &self,
        argv: &[String],
        dir: &Path,
        env: Vec<(String, String)>,
    ) -> Result<(tokio::process::Child, Option<ExecStatus>), SpawnError> {
        let program = || argv.first().cloned().unwrap_or_default();
        let _no_kill_running = self.kill_gate.lock().await;
        let seated = self.seated.lock().unwrap_or_else(PoisonError::into_inner).take();
        let plan = &self.prepared.plan;
        // Boxed: a claim's future is large, and every spawn path awaits this one.
        let started = match (&self.prepared.stubs, seated) {
            (Some(pool), Some(stub)) => Box::pin(pool.launch_seated(stub, plan, argv, dir, &env)).await,
            (Some(pool), None) => Box::pin(pool.try_launch(plan, argv, dir, &env)).await,
            (None, _) => None,
        };
        if let Some(started) = started {
            return started
                .map(|(child, exec)| (child, Some(exec)))
                .map_err(|source| SpawnError::Stub {
                    program: program(),
                    source,
                });
        }
        let mut cmd = self.command(argv, dir, env);
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd.spawn()
            .map(|child| (child, None))
            .map_err(|source| SpawnError::Os {
                program: program(),
                source,
            })
    }

    /// Runs `f` on the cgroup, if there still is one.
    pub(crate) fn with_cgroup<T>(&self, f: impl FnOnce(Option<&SessionCgroup>) -> T) -> T {
        let cgroup = self
            .cgroup
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f(cgroup.as_ref())
    }

    /// Kills every process of the tree whose root is `pid`, holding off any launch until it is done (the cgroup
    /// kill waits for the kernel, off the async threads).
    pub(crate) async fn kill_tree_now(self: &Arc<Self>, pid: u32, tool_id: &str) {
        let _killing = self.kill_gate.lock().await;
        let sandbox = self.clone();
        let tool_id = tool_id.to_owned();
        let _ = tokio::task::spawn_blocking(move || sandbox.kill_tree(pid, &tool_id)).await;
    }

    /// Kills every process of the tree whose root is `pid` (blocking: the cgroup kill waits for the kernel).
    fn kill_tree(&self, pid: u32, tool_id: &str) {
        self.with_cgroup(|cgroup| match cgroup {
            Some(cg) => {
                if let Err(e) = cg.kill_all() {
                    tracing::warn!(tool_id, error = %e, "killing the plugin's cgroup failed");
                }
            }
            None if !self.isolated => kill_group(pid, rustix::process::Signal::KILL),
            None => {}
        });
    }

    /// Sends `signal` to every process of the tree whose root is `pid`.
    pub(crate) fn signal_tree(&self, pid: u32, signal: rustix::process::Signal) {
        self.with_cgroup(|cgroup| match cgroup {
            Some(cg) => {
                let _ = cg.signal_all(signal);
            }
            None if !self.isolated => kill_group(pid, signal),
            None => {}
        });
    }

    /// OOM kills in the cgroup so far (0 without one).
    pub(crate) fn oom_kills(&self) -> u64 {
        self.with_cgroup(|cgroup| cgroup.map_or(0, SessionCgroup::oom_kills))
    }

    /// Kills what is left in the cgroup and removes it (blocking). Once released, the tree is gone: killing or
    /// signalling it does nothing. Releasing twice is harmless.
    pub(crate) fn release(&self) -> Result<(), SandboxError> {
        let cgroup = self
            .cgroup
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        cgroup.map_or(Ok(()), SessionCgroup::remove)
    }
}

/// Without cgroups, the plugin's process group (it called setsid, so its pgid is its pid).
fn kill_group(pid: u32, signal: rustix::process::Signal) {
    if let Some(pid) = i32::try_from(pid).ok().and_then(rustix::process::Pid::from_raw) {
        let _ = rustix::process::kill_process_group(pid, signal);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use serde_json::json;

    use super::Sandboxed;
    use crate::child::testing::worker;
    use crate::sandbox::Start;

    /// The churn of a session: its process is killed (a cancelled invoke's fallback) while it restarts for its
    /// next call, in the same cgroup. The kill takes whatever is in the cgroup, so the new process must not start
    /// until the kill is done — and then it lives.
    #[tokio::test]
    async fn no_process_starts_in_the_cgroup_while_its_tree_is_being_killed() {
        let w = worker("kill-gate", |_| {});
        let install = w.install("kill-gate", &["/bin/sleep", "600"], json!({}));
        let prepared = w
            .ctx
            .sandbox
            .prepare(
                "alice",
                &install.tool_id,
                "e",
                install.effective_limits(w.ctx.config.limits),
                &install.dir,
                &install.argv,
                Start::Caller,
            )
            .unwrap();
        let sandbox = Arc::new(Sandboxed::new(prepared));
        let (mut first, _) = sandbox
            .launch(&install.argv, &install.dir, Vec::new())
            .await
            .unwrap();
        let first_pid = first.id().unwrap();

        // A kill in progress holds the gate: a launch waits for it.
        let killing = sandbox.kill_gate.lock().await;
        let launching = sandbox.launch(&install.argv, &install.dir, Vec::new());
        tokio::pin!(launching);
        // (A zero timeout polls the launch once, then gives up on it without dropping it.)
        assert!(
            tokio::time::timeout(Duration::ZERO, &mut launching)
                .await
                .is_err(),
            "a launch while the tree is being killed waits"
        );
        // The kill's own work, under the gate (as `kill_tree_now` does it), then the gate released: the launch it
        // held off goes on, after the first process is gone, and the second lives alone in the cgroup.
        let killer = sandbox.clone();
        let tool_id = install.tool_id.clone();
        tokio::task::spawn_blocking(move || killer.kill_tree(first_pid, &tool_id))
            .await
            .unwrap();
        let _ = tokio::time::timeout(Duration::from_secs(30), first.wait())
            .await
            .expect("the killed process exits");
        drop(killing);
        let (mut second, _) = launching.await.unwrap();
        let second_pid = second.id().unwrap();
        let members = sandbox.with_cgroup(|cg| cg.map(|cg| cg.pids().unwrap()).unwrap_or_default());
        assert_eq!(
            members,
            vec![second_pid],
            "the new process alone, alive, in the cgroup"
        );
        assert!(second.try_wait().unwrap().is_none());
        sandbox.kill_tree_now(second_pid, &install.tool_id).await;
        let _ = second.wait().await;
        let _ = sandbox.release();
    }
}
