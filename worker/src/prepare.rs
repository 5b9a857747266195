//! One-time preparation of an install before its first spawn ([`Install::prepare`]): for a `python` project
//! with `uv` on the worker's search path, `uv sync` into the install's
//! [`UV_VENV_DIR`](crate::catalogue::UV_VENV_DIR).
//!
//! It runs at the install's first use (before the dialect probe, so neither the probe nor the first
//! `initialize` ever waits on a dependency download), with its own wall-clock cap (`preparation.timeout`);
//! concurrent first uses wait for the one run. A success is recorded in the environment ([`PREPARED_MARKER`]: a
//! digest of `pyproject.toml` and `uv.lock`), so a restarted worker does not sync an unchanged project again; a
//! failure is not remembered (the next use tries again). The plugin itself then runs the environment's
//! interpreter (or script) under its own uid: it needs neither `uv`, nor `uv`'s cache, nor a writable project
//! directory, and what it runs is checked to be within its reach ([`crate::sandbox::reach`]).
//!
//! # Confined like a plugin
//!
//! `uv sync` runs code the package controls (its build back-end, the back-ends of its sdist dependencies), so
//! it never runs as the worker ([`crate::sandbox::Sandbox::prepare_build`]):
//!
//! - under a build uid of its own per tool and version (never root, never a user's plugin uid), in a cgroup of
//!   its own (`preparation.limits`), with the plugins' namespaces and seccomp profile;
//! - with a scrubbed environment ([`build_env`]: none of the worker's variables);
//! - in a view where the worker's state directory and `preparation.hidden_paths` are empty, the host read-only,
//!   and only the install's directory (its environment target inside it) and the build's TMPDIR writable;
//! - with network only through the egress proxy to `preparation.index_hosts` (none: `uv` runs offline).
//!
//! The install's tree belongs to the build uid only while the build runs ([`hand_over`]); once its cgroup is
//! empty, the tree is the worker's again, readable by every plugin uid and writable by none ([`take_back`]). A
//! failed or timed-out preparation is one line of error (the end of its stderr, redacted) and leaves nothing
//! behind: its processes killed with the cgroup, the partial environment removed, the build's TMPDIR wiped.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fleet_proto::util::lock;
use sha2::{Digest as _, Sha256};
use tokio::sync::watch;

use crate::catalogue::{Install, PYPROJECT_FILE, Prepare, Runner};
use crate::child::{Sandboxed, StderrRing};
use crate::sandbox::UserSpace;
use crate::sandbox::reach::{self, Access};
use crate::types::WorkerContext;

/// The file, in a prepared environment, recording what it was prepared from.
pub const PREPARED_MARKER: &str = ".fleet-prepared";

/// The lock file `uv` keeps beside `pyproject.toml` (part of what the environment is prepared from).
pub const UV_LOCK_FILE: &str = "uv.lock";

/// The most of a preparation's stderr kept (its end) while it runs.
const STDERR_TAIL_BYTES: usize = 4096;

/// The lines of that end an error names.
const STDERR_TAIL_LINES: usize = 8;

/// The longest an error's account of the stderr may be, in bytes (its end is kept).
const STDERR_LINE_BYTES: usize = 600;

/// The search path of a preparation, after the directories of `uv` and the interpreter.
const BUILD_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// Why an install could not be prepared.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PrepareError {
    /// The preparation did not finish in time; its whole tree was killed.
    #[error("`{command}` did not finish within {timeout:?} (killed; the next use tries again)")]
    Timeout {
        /// The command.
        command: String,
        /// The limit.
        timeout: Duration,
    },
    /// The preparation's sandbox could not be made.
    #[error("cannot confine `{command}`: {reason}")]
    Sandbox {
        /// The command.
        command: String,
        /// The sandbox's answer.
        reason: String,
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
        /// The end of its stderr, on one line, redacted.
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
    /// the same project files), confined in `ctx`'s sandbox. The preparation runs in a task of its own, so a
    /// caller that gives up (its request timed out) does not kill it: concurrent and later callers wait for the
    /// same run.
    ///
    /// # Errors
    /// [`PrepareError`]: nothing is remembered, the next call tries again.
    pub async fn ensure(
        self: &Arc<Self>,
        ctx: &WorkerContext,
        install: &Install,
    ) -> Result<(), PrepareError> {
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
                    let (this, ctx, install) = (self.clone(), ctx.clone(), install.clone());
                    tokio::spawn(async move {
                        let result = prepare(&ctx, &install).await;
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
async fn prepare(ctx: &WorkerContext, install: &Install) -> Result<(), PrepareError> {
    let Some(prepare) = &install.prepare else {
        return Ok(());
    };
    match prepare {
        Prepare::UvSync { uv, python, venv } => {
            let sync = UvSync {
                uv,
                python: python.as_deref(),
                venv,
            };
            sync.run(ctx, install).await?;
        }
    }
    check_launch(install, prepare, Runner::of(&ctx.config))
}

/// One `uv sync` of an install's project into its environment.
struct UvSync<'a> {
    uv: &'a Path,
    python: Option<&'a Path>,
    venv: &'a Path,
}

impl UvSync<'_> {
    /// The command line.
    fn argv(&self, install: &Install) -> Vec<String> {
        let mut argv = vec![
            self.uv.display().to_string(),
            "sync".into(),
            "--project".into(),
            install.dir.display().to_string(),
            "--no-dev".into(),
        ];
        if let Some(python) = self.python {
            argv.extend(["--python".into(), python.display().to_string()]);
        }
        argv
    }

    /// `uv sync`, confined, unless the environment's marker says it was made from the same `pyproject.toml` and
    /// `uv.lock`.
    async fn run(&self, ctx: &WorkerContext, install: &Install) -> Result<(), PrepareError> {
        let stamp = project_digest(&install.dir)?;
        let marker = self.venv.join(PREPARED_MARKER);
        if std::fs::read_to_string(&marker).is_ok_and(|s| s.trim() == stamp) {
            return Ok(());
        }
        let argv = self.argv(install);
        let command = argv.join(" ");
        let sandbox_err = |e: &dyn std::fmt::Display| PrepareError::Sandbox {
            command: command.clone(),
            reason: e.to_string(),
        };
        let prepared = ctx
            .sandbox
            .prepare_build(&build_id(install), &install.dir, &argv)
            .map_err(|e| sandbox_err(&e))?;
        let sandbox = Sandboxed::new(prepared);
        let space = sandbox.space().clone();
        tracing::info!(tool_id = %install.tool_id, %command, "preparing the install (confined)");
        let ran = match hand_over(&install.dir, &space) {
            Ok(()) => {
                let env = build_env(&space, self, ctx.sandbox.build_has_network());
                self.spawn_and_wait(&sandbox, &argv, &install.dir, env, ctx.config.preparation.timeout)
                    .await
                    .map_err(|e| e.into_error(&command))
            }
            Err(e) => Err(e),
        };
        // The cgroup emptied (every process of the build killed) before the tree is taken back.
        let released = tokio::task::spawn_blocking(move || sandbox.release()).await;
        let taken = take_back(&install.dir);
        wipe(&space);
        let result = ran.and(taken).and(match released {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(sandbox_err(&e)),
            Err(e) => Err(sandbox_err(&e)),
        });
        if result.is_err() {
            // Nothing of a failed preparation is left for a plugin to run.
            let _ = std::fs::remove_dir_all(self.venv);
            return result;
        }
        std::fs::write(&marker, format!("{stamp}\n")).map_err(|e| PrepareError::Io {
            path: marker,
            reason: e.to_string(),
        })
    }

    /// Spawns `argv` in `sandbox` and waits for it within `timeout`, keeping the end of its stderr.
    async fn spawn_and_wait(
        &self,
        sandbox: &Sandboxed,
        argv: &[String],
        dir: &Path,
        env: Vec<(String, String)>,
        timeout: Duration,
    ) -> Result<(), RunError> {
        let mut cmd = sandbox.command(argv, dir, env);
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().map_err(|e| RunError::Spawn(e.to_string()))?;
        let ring = StderrRing::new(STDERR_TAIL_BYTES);
        let drained = child
            .stderr
            .take()
            .map(|err| tokio::spawn(ring.clone().drain(err)));
        let status = match tokio::time::timeout(timeout, child.wait()).await {
            // The tree is killed with its cgroup when the sandbox is released; `kill_on_drop` ends the leader.
            Err(_) => return Err(RunError::Timeout(timeout)),
            Ok(Err(e)) => return Err(RunError::Spawn(e.to_string())),
            Ok(Ok(status)) => status,
        };
        if let Some(drained) = drained {
            // The pipe closes when the last process holding it ends; a descendant still holding it is killed
            // with the cgroup, so this waits no longer than the cap.
            let _ = tokio::time::timeout(timeout, drained).await;
        }
        if status.success() {
            Ok(())
        } else {
            Err(RunError::Failed {
                status: status.to_string(),
                stderr: one_line(&ring.tail(STDERR_TAIL_LINES)),
            })
        }
    }
}

/// How a confined run ended, before it is an error of a command.
enum RunError {
    Spawn(String),
    Timeout(Duration),
    Failed { status: String, stderr: String },
}

impl RunError {
    fn into_error(self, command: &str) -> PrepareError {
        let command = command.to_owned();
        match self {
            RunError::Spawn(reason) => PrepareError::Spawn { command, reason },
            RunError::Timeout(timeout) => PrepareError::Timeout { command, timeout },
            RunError::Failed { status, stderr } => PrepareError::Failed {
                command,
                status,
                stderr,
            },
        }
    }
}

/// The identity a preparation of `install` runs under: its tool and a digest of its directory (one per tool
/// and version: a version is installed in a directory of its own).
fn build_id(install: &Install) -> String {
    let digest = Sha256::digest(install.dir.as_os_str().as_encoded_bytes());
    format!("{}@{}", install.tool_id, &hex::encode(digest)[..12])
}

/// The whole environment of a preparation: a search path holding `uv` and the interpreter, its TMPDIR as home,
/// cache and temporary directory, the environment target, copies rather than links, no interpreter downloads,
/// and offline unless it has the network (then the egress proxy's variables are added by the sandbox's plan).
fn build_env(space: &UserSpace, sync: &UvSync<'_>, network: bool) -> Vec<(String, String)> {
    let mut path: Vec<String> = [Some(sync.uv), sync.python]
        .into_iter()
        .flatten()
        .filter_map(|p| p.parent().map(|d| d.display().to_string()))
        .collect();
    path.dedup();
    path.push(BUILD_PATH.to_owned());
    let tmp = space.tmpdir.display().to_string();
    let mut env = vec![
        ("PATH".to_owned(), path.join(":")),
        ("HOME".to_owned(), tmp.clone()),
        ("TMPDIR".to_owned(), tmp.clone()),
        ("XDG_CACHE_HOME".to_owned(), format!("{tmp}/.cache")),
        ("XDG_CONFIG_HOME".to_owned(), format!("{tmp}/.config")),
        ("XDG_DATA_HOME".to_owned(), format!("{tmp}/.local/share")),
        ("UV_CACHE_DIR".to_owned(), format!("{tmp}/uv-cache")),
        (
            "UV_PROJECT_ENVIRONMENT".to_owned(),
            sync.venv.display().to_string(),
        ),
        // Copies, not links into the build's cache: the plugins' uids read the environment, and the cache is
        // wiped with the build's TMPDIR.
        ("UV_LINK_MODE".to_owned(), "copy".to_owned()),
        ("UV_PYTHON_DOWNLOADS".to_owned(), "never".to_owned()),
        // The node's trust store (an operator's mirror or TLS-inspecting proxy has its CA there), not only the
        // roots built into `uv`.
        ("UV_SYSTEM_CERTS".to_owned(), "1".to_owned()),
        // (`uv` before 0.13 reads this name only; later ones warn that it is deprecated.)
        ("UV_NATIVE_TLS".to_owned(), "1".to_owned()),
        ("LANG".to_owned(), "C.UTF-8".to_owned()),
    ];
    if !network {
        env.push(("UV_OFFLINE".to_owned(), "1".to_owned()));
    }
    env
}

/// Gives the install's tree to the build's uid for the time of the build (nothing without a uid of its own:
/// `run_as = "inherit"`). Symbolic links are changed, never followed.
fn hand_over(dir: &Path, space: &UserSpace) -> Result<(), PrepareError> {
    let Some(uid) = space.uid else {
        return Ok(());
    };
    walk(dir, &mut |path, _| {
        std::os::unix::fs::lchown(path, Some(uid), space.gid.or(Some(uid)))
    })
}

/// Takes the install's tree back from the build's uid: owned by the worker, readable by everyone, writable by
/// the owner alone, no set-id bit (what the build made included). Symbolic links are changed, never followed.
fn take_back(dir: &Path) -> Result<(), PrepareError> {
    use std::os::unix::fs::PermissionsExt as _;
    let (uid, gid) = (
        rustix::process::getuid().as_raw(),
        rustix::process::getgid().as_raw(),
    );
    walk(dir, &mut |path, meta| {
        std::os::unix::fs::lchown(path, Some(uid), Some(gid))?;
        if meta.file_type().is_symlink() {
            return Ok(());
        }
        let mode = meta.permissions().mode();
        let exec = meta.is_dir() || mode & 0o100 != 0;
        let sealed = 0o644 | if exec { 0o111 } else { 0 };
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(sealed))
    })
}

/// Runs `f` on `dir` and everything beneath it (children first is not needed: no entry is removed), without
/// following symbolic links.
fn walk(
    dir: &Path,
    f: &mut dyn FnMut(&Path, &std::fs::Metadata) -> std::io::Result<()>,
) -> Result<(), PrepareError> {
    let io = |path: &Path, e: std::io::Error| PrepareError::Io {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    let mut stack = vec![dir.to_path_buf()];
    while let Some(path) = stack.pop() {
        let meta = std::fs::symlink_metadata(&path).map_err(|e| io(&path, e))?;
        f(&path, &meta).map_err(|e| io(&path, e))?;
        if meta.is_dir() {
            for entry in std::fs::read_dir(&path).map_err(|e| io(&path, e))? {
                stack.push(entry.map_err(|e| io(&path, e))?.path());
            }
        }
    }
    Ok(())
}

/// Empties the build identity's directories (its cache, what the build left in its TMPDIR).
fn wipe(space: &UserSpace) {
    for dir in [&space.tmpdir, &space.workspace] {
        if let Ok(entries) = std::fs::read_dir(dir) {
            for entry in entries.flatten() {
                let path = entry.path();
                let _ = match entry.file_type() {
                    Ok(t) if t.is_dir() => std::fs::remove_dir_all(&path),
                    _ => std::fs::remove_file(&path),
                };
            }
        }
    }
}

/// The end of a build's stderr as one line of an error: lines joined by ` | `, control characters dropped,
/// JWT-looking words and the credentials of URLs (`scheme://user:secret@`) redacted, at most
/// [`STDERR_LINE_BYTES`] (the end kept).
fn one_line(tail: &str) -> String {
    let joined: String = tail
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" | ")
        .chars()
        .filter(|c| !c.is_control())
        .collect();
    let redacted = redact_userinfo(&crate::child::redact(&joined));
    let mut start = redacted.len().saturating_sub(STDERR_LINE_BYTES);
    while !redacted.is_char_boundary(start) {
        start += 1;
    }
    if start == 0 {
        redacted
    } else {
        format!("…{}", &redacted[start..])
    }
}

/// `scheme://user:secret@host` → `scheme://<redacted>@host`.
fn redact_userinfo(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("://") {
        let (head, tail) = rest.split_at(i + 3);
        out.push_str(head);
        let authority_end = tail
            .find(|c: char| c == '/' || c.is_whitespace())
            .unwrap_or(tail.len());
        match tail[..authority_end].rfind('@') {
            Some(at) => {
                out.push_str("<redacted>");
                rest = &tail[at..];
            }
            None => rest = tail,
        }
    }
    out.push_str(rest);
    out
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

#[cfg(test)]
mod tests {
    use super::{STDERR_LINE_BYTES, one_line, redact_userinfo};

    #[test]
    fn a_builds_stderr_is_one_bounded_redacted_line() {
        let tail = "  Building x\n\nerror: Failed to fetch https://bob:hunter2@mirror.example/simple/x/\n\
                    token eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ4In0.c2ln\u{7}\n";
        let line = one_line(tail);
        assert_eq!(
            line,
            "Building x | error: Failed to fetch https://<redacted>@mirror.example/simple/x/ | token <redacted-jwt>"
        );
        let long = "é".repeat(STDERR_LINE_BYTES);
        let cut = one_line(&long);
        assert!(
            cut.starts_with('…') && cut.len() <= STDERR_LINE_BYTES + '…'.len_utf8(),
            "{cut}"
        );
        assert!(!one_line("a\nb\r\nc").contains(['\n', '\r']));
    }

    #[test]
    fn only_the_userinfo_of_urls_is_redacted() {
        assert_eq!(
            redact_userinfo("see http://host/a@b and ssh://u@h:22/x, no url@here"),
            "see http://host/a@b and ssh://<redacted>@h:22/x, no url@here"
        );
        assert_eq!(redact_userinfo("://"), "://");
        assert_eq!(redact_userinfo("x://@"), "x://<redacted>@");
    }
}
