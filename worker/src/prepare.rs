//! One-time preparation of an install before its first spawn ([`Install::prepare`]): for a `python` project
//! with `uv` on the worker's search path, `uv sync` into the install's
//! [`UV_VENV_DIR`](crate::catalogue::UV_VENV_DIR).
//!
//! It runs at the install's first use (before the dialect probe, so neither the probe nor the first
//! `initialize` ever waits on a dependency download), as the worker, with its own timeout
//! ([`UV_SYNC_TIMEOUT`]); concurrent first uses wait for the one run. A success is recorded in the environment
//! ([`PREPARED_MARKER`]: a digest of `pyproject.toml` and `uv.lock`), so a restarted worker does not sync an
//! unchanged project again; a failure is not remembered (the next use tries again). The plugin itself then runs
//! the environment's interpreter (or script) under its own uid: it needs neither `uv`, nor `uv`'s cache, nor a
//! writable project directory, and what it runs is checked to be within its reach ([`crate::sandbox::reach`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fleet_proto::util::lock;
use sha2::{Digest as _, Sha256};
use tokio::io::AsyncReadExt as _;
use tokio::sync::watch;

use crate::catalogue::{Install, PYPROJECT_FILE, Prepare, Runner};
use crate::sandbox::reach::{self, Access};

/// How long one `uv sync` may take (resolution, downloads, builds) before it is killed.
pub const UV_SYNC_TIMEOUT: Duration = Duration::from_secs(600);

/// The file, in a prepared environment, recording what it was prepared from.
pub const PREPARED_MARKER: &str = ".fleet-prepared";

/// The lock file `uv` keeps beside `pyproject.toml` (part of what the environment is prepared from).
pub const UV_LOCK_FILE: &str = "uv.lock";

/// The most of `uv sync`'s stderr kept for an error (its end).
const STDERR_TAIL_BYTES: usize = 4096;

/// Why an install could not be prepared.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PrepareError {
    /// The preparation did not finish in time; it was killed.
    #[error("`{command}` did not finish within {timeout:?} (killed; the next use tries again)")]
    Timeout {
        /// The command.
        command: String,
        /// The limit.
        timeout: Duration,
    },
    /// The preparation could not be started.
    #[error("cannot run `{command}`: {reason}")]
    Spawn {
        /// The command.
        command: String,
        /// The OS's answer.
        reason: String,
    },
    /// The preparation failed.
    #[error("`{command}` failed ({status}): {stderr}")]
    Failed {
        /// The command.
        command: String,
        /// Its exit status.
        status: String,
        /// The end of its stderr.
        stderr: String,
    },
    /// It succeeded, but what the plugin runs is not there (a script the project does not declare).
    #[error("after `{command}`, {} does not exist", path.display())]
    Missing {
        /// The command.
        command: String,
        /// What the launch needs.
        path: PathBuf,
    },
    /// It succeeded, but what the plugin runs is out of its uid's reach (an interpreter `uv` placed in root's
    /// home…).
    #[error("after `{command}`, {} is out of the plugins' reach: {reason}", path.display())]
    Unreachable {
        /// The command.
        command: String,
        /// What the launch needs.
        path: PathBuf,
        /// The blocking directories and the `chmod` that opens them.
        reason: String,
    },
    /// A file of the project or the environment could not be read or written.
    #[error("{}: {reason}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS's answer.
        reason: String,
    },
}

/// The preparations of a worker, one slot per install directory.
#[derive(Debug, Default)]
pub struct Preparations {
    slots: Mutex<HashMap<PathBuf, Slot>>,
}

/// Where one install's preparation stands.
#[derive(Debug)]
enum Slot {
    /// Running, in a task of its own: its outcome is published here.
    Running(watch::Receiver<Option<Result<(), PrepareError>>>),
    /// Done: nothing more to do for this worker.
    Done,
}

impl Preparations {
    /// Prepares `install` if it needs it and has not been prepared yet (by this worker, or before a restart with
    /// the same project files). The preparation runs in a task of its own, so a caller that gives up (its
    /// request timed out) does not kill it: concurrent and later callers wait for the same run.
    ///
    /// # Errors
    /// [`PrepareError`]: nothing is remembered, the next call tries again.
    pub async fn ensure(self: &Arc<Self>, install: &Install, runner: Runner) -> Result<(), PrepareError> {
        if install.prepare.is_none() {
            return Ok(());
        }
        let mut outcome = {
            let mut slots = lock(&self.slots);
            match slots.get(&install.dir) {
                Some(Slot::Done) => return Ok(()),
                Some(Slot::Running(rx)) => rx.clone(),
                None => {
                    let (tx, rx) = watch::channel(None);
                    slots.insert(install.dir.clone(), Slot::Running(rx.clone()));
                    let (this, install) = (self.clone(), install.clone());
                    tokio::spawn(async move {
                        let result = prepare(&install, runner).await;
                        let mut slots = lock(&this.slots);
                        if result.is_ok() {
                            slots.insert(install.dir.clone(), Slot::Done);
                        } else {
                            slots.remove(&install.dir);
                        }
                        drop(slots);
                        let _ = tx.send(Some(result));
                    });
                    rx
                }
            }
        };
        let Ok(published) = outcome.wait_for(Option::is_some).await else {
            // The task ended without publishing (it panicked): the next call starts afresh.
            lock(&self.slots).remove(&install.dir);
            return Err(PrepareError::Io {
                path: install.dir.clone(),
                reason: "the preparation task ended without an outcome".into(),
            });
        };
        published.clone().unwrap_or(Ok(()))
    }
}

/// Runs `install`'s preparation, then checks what its launch runs.
async fn prepare(install: &Install, runner: Runner) -> Result<(), PrepareError> {
    let Some(prepare) = &install.prepare else {
        return Ok(());
    };
    match prepare {
        Prepare::UvSync { uv, python, venv } => {
            uv_sync(install, uv, python.as_deref(), venv, UV_SYNC_TIMEOUT).await?;
        }
    }
    check_launch(install, prepare, runner)
}

/// `uv sync` of `install`'s project into `venv`, unless the environment's marker says it was made from the
/// same `pyproject.toml` and `uv.lock`.
async fn uv_sync(
    install: &Install,
    uv: &Path,
    python: Option<&Path>,
    venv: &Path,
    timeout: Duration,
) -> Result<(), PrepareError> {
    let stamp = project_digest(&install.dir)?;
    let marker = venv.join(PREPARED_MARKER);
    if std::fs::read_to_string(&marker).is_ok_and(|s| s.trim() == stamp) {
        return Ok(());
    }
    let mut cmd = tokio::process::Command::new(uv);
    cmd.arg("sync").arg("--project").arg(&install.dir).arg("--no-dev");
    if let Some(python) = python {
        cmd.arg("--python").arg(python);
    }
    let command = format!(
        "{} sync --project {} --no-dev{}",
        uv.display(),
        install.dir.display(),
        python
            .map(|p| format!(" --python {}", p.display()))
            .unwrap_or_default()
    );
    cmd.current_dir(&install.dir)
        .env("UV_PROJECT_ENVIRONMENT", venv)
        // Copies, not links into the worker's cache: the plugins' uids read the environment, not the cache.
        .env("UV_LINK_MODE", "copy")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    tracing::info!(tool_id = %install.tool_id, %command, "preparing the install");
    let mut child = cmd.spawn().map_err(|e| PrepareError::Spawn {
        command: command.clone(),
        reason: e.to_string(),
    })?;
    let mut stderr = Vec::new();
    let run = async {
        if let Some(mut err) = child.stderr.take() {
            let _ = err.read_to_end(&mut stderr).await;
        }
        child.wait().await
    };
    let status = match tokio::time::timeout(timeout, run).await {
        Err(_) => {
            // `kill_on_drop` ends it when `child` goes out of scope.
            return Err(PrepareError::Timeout { command, timeout });
        }
        Ok(Err(e)) => {
            return Err(PrepareError::Spawn {
                command,
                reason: e.to_string(),
            });
        }
        Ok(Ok(status)) => status,
    };
    if !status.success() {
        let from = stderr.len().saturating_sub(STDERR_TAIL_BYTES);
        return Err(PrepareError::Failed {
            command,
            status: status.to_string(),
            stderr: String::from_utf8_lossy(&stderr[from..]).trim().to_string(),
        });
    }
    std::fs::write(&marker, format!("{stamp}\n")).map_err(|e| PrepareError::Io {
        path: marker,
        reason: e.to_string(),
    })?;
    Ok(())
}

/// SHA-256 (hex) of `pyproject.toml` and, when present, `uv.lock`.
fn project_digest(dir: &Path) -> Result<String, PrepareError> {
    let mut h = Sha256::new();
    for (name, required) in [(PYPROJECT_FILE, true), (UV_LOCK_FILE, false)] {
        let path = dir.join(name);
        match std::fs::read(&path) {
            Ok(bytes) => {
                h.update(name.as_bytes());
                h.update([0]);
                h.update(&bytes);
            }
            Err(e) if !required && e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(PrepareError::Io {
                    path,
                    reason: e.to_string(),
                });
            }
        }
    }
    Ok(hex::encode(h.finalize()))
}

/// After a preparation: the program the launch runs exists, and the plugins' uids can execute it.
fn check_launch(install: &Install, prepare: &Prepare, runner: Runner) -> Result<(), PrepareError> {
    let Prepare::UvSync { uv, .. } = prepare;
    let command = format!("{} sync", uv.display());
    let Some(program) = install.argv.first().map(PathBuf::from) else {
        return Ok(());
    };
    if !program.exists() {
        return Err(PrepareError::Missing {
            command,
            path: program,
        });
    }
    if let Runner::OtherUsers { private_tmp } = runner {
        let mut blockers = reach::blockers(&program, Access::Execute).map_err(|e| PrepareError::Io {
            path: program.clone(),
            reason: e.to_string(),
        })?;
        if private_tmp {
            let kept = program.parent().unwrap_or(&program).to_path_buf();
            blockers = reach::beyond_private_tmp(blockers, &kept);
        }
        if !blockers.is_empty() {
            return Err(PrepareError::Unreachable {
                command,
                path: program,
                reason: reach::describe(&blockers),
            });
        }
    }
    Ok(())
}
