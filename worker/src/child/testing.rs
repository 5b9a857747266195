//! Test helpers for the process core and both dialects: a worker context over a real sandbox (run as root, on a
//! machine with cgroups) and installs that run a real program. Every wait polls an observable under a failure
//! guard.

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::catalogue::{Install, LoadOptions};
use crate::config::WorkerConfig;
use crate::metrics::WorkerMetrics;
use crate::sandbox::Sandbox;
use crate::services::{NoServices, NoTokens};
use crate::types::WorkerContext;

/// Failure guard of every wait (never a timing assertion).
pub(crate) const GUARD: Duration = Duration::from_secs(30);

/// A worker context over a real sandbox; its cgroup subtree (with whatever is left in it) goes on drop.
pub(crate) struct Worker {
    pub(crate) ctx: WorkerContext,
    pub(crate) metrics: Arc<WorkerMetrics>,
    root: tempfile::TempDir,
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.ctx.sandbox.remove_subtree();
    }
}

fn open_up(path: &Path) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// A worker named `name` (unique per test), its configuration adjusted by `tune`.
pub(crate) fn worker(name: &str, tune: impl FnOnce(&mut WorkerConfig)) -> Worker {
    let root = tempfile::tempdir().unwrap();
    open_up(root.path());
    let mut config = WorkerConfig {
        worker_id: format!("core-{name}-{}", std::process::id()),
        state_dir: root.path().join("state"),
        ..WorkerConfig::default()
    };
    tune(&mut config);
    let sandbox = Sandbox::new(&config).expect("sandbox (cgroups, as root)");
    let metrics = Arc::new(WorkerMetrics::default());
    let ctx = WorkerContext {
        config: Arc::new(config),
        sandbox,
        services: Arc::new(NoServices),
        tokens: Arc::new(NoTokens),
        metrics: metrics.clone(),
    };
    Worker { ctx, metrics, root }
}

impl Worker {
    /// An install `tool_id` running `argv`; `extra` is merged into its `executa.json` (e.g. `limits`).
    pub(crate) fn install(&self, tool_id: &str, argv: &[&str], extra: Value) -> Install {
        let catalogue = self.root.path().join("catalogue");
        let dir = catalogue.join(tool_id);
        std::fs::create_dir_all(&dir).unwrap();
        let mut entry = json!({ "tool_id": tool_id, "type": "binary", "command": argv });
        if let Value::Object(m) = extra {
            for (k, v) in m {
                entry[k] = v;
            }
        }
        std::fs::write(dir.join("executa.json"), entry.to_string()).unwrap();
        std::fs::write(dir.join(".fleet-described"), b"").unwrap();
        open_up(&catalogue);
        open_up(&dir);
        crate::catalogue::load_dir(&dir, &LoadOptions::from_env()).unwrap()
    }
}

/// Polls `cond` until it holds or the guard passes; whether it held.
pub(crate) async fn eventually(mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + GUARD;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Whether `pid` runs (exists and is not a zombie).
pub(crate) fn alive(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = stat.rsplit_once(')').map(|(_, rest)| rest.trim_start());
    state.is_some_and(|s| !s.starts_with('Z'))
}

/// A JWT-looking token (never a real one) and the stderr script that logs it beside a 10 000-byte line.
pub(crate) const FAKE_JWT: &str = "eyJhbGciOiJub25lIn0.eyJzdWIiOiJ0ZXN0In0.c2lnbmF0dXJl";

/// Shell lines writing to stderr: a line with [`FAKE_JWT`], a line of 10 000 `x`, then `end`.
pub(crate) fn noisy_stderr() -> String {
    format!(
        "printf 'token={FAKE_JWT} ok\\n' >&2; head -c 10000 /dev/zero | tr '\\0' x >&2; printf '\\nend\\n' >&2"
    )
}

/// Asserts the last three lines of a stderr ring are the [`noisy_stderr`] lines, redacted and bounded.
pub(crate) fn assert_noisy_stderr_kept_safely(tail: &str) {
    let lines: Vec<&str> = tail.split('\n').collect();
    assert_eq!(lines.len(), 3, "{tail:.200}");
    assert_eq!(lines[0], "token=<redacted-jwt> ok");
    assert!(!tail.contains("eyJ"), "no token survives");
    assert_eq!(lines[1], format!("{} …[truncated]", "x".repeat(4096)));
    assert_eq!(lines[2], "end");
}
