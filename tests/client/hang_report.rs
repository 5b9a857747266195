//! The hang report of a test process: a test that is still running [`HANG_REPORT_AFTER`] after it armed the
//! report prints every thread's stack and the milestones it passed to stderr, then aborts — so a test that waits
//! forever (a task blocked in the kernel, a lock never released, a runtime that cannot shut down because a blocking
//! task never returns) fails with the place it waits at instead of holding the suite until CI's deadline.
//!
//! Armed only in a process that runs one test (nextest's process-per-test mode: `NEXTEST_EXECUTION_MODE`), where
//! the process's age is the test's age; under `cargo test` one process runs a whole binary and nothing is armed.
//! nextest's own `terminate-after` (`.config/nextest.toml`) stays the backstop for every test.

use std::io::Write as _;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a test may run before its hang report. Above the longest test of the suite on a busy two-core
/// machine (~100 s: the Animus CLI test and the loadtest scenarios) by a wide margin, and below nextest's
/// terminate-after (`.config/nextest.toml`: 10 × 60 s), so the report is printed before nextest kills the process.
pub const HANG_REPORT_AFTER: Duration = Duration::from_secs(300);

/// Sets the report's delay in seconds instead of [`HANG_REPORT_AFTER`] (the report's own test).
pub const AFTER_ENV: &str = "FLEET_TEST_HANG_REPORT_SECS";

/// What the test passed so far (its milestones), printed with the report.
static MILESTONES: Mutex<Vec<(Duration, String)>> = Mutex::new(Vec::new());
static ARMED: OnceLock<Instant> = OnceLock::new();

/// Arms the report once per process (a no-op outside nextest's process-per-test mode and when already armed).
pub fn arm() {
    if std::env::var("NEXTEST_EXECUTION_MODE").as_deref() != Ok("process-per-test") {
        return;
    }
    let after = std::env::var(AFTER_ENV)
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(HANG_REPORT_AFTER, Duration::from_secs);
    ARMED.get_or_init(|| {
        let spawned = std::thread::Builder::new()
            .name("hang-report".into())
            .spawn(move || {
                // A watchdog's timer, not a synchronisation: nothing waits for this thread.
                std::thread::sleep(after);
                report(after);
                std::process::abort();
            });
        if let Err(e) = spawned {
            let _ = writeln!(std::io::stderr(), "hang report not armed: {e}");
        }
        Instant::now()
    });
}

/// Whether this process armed its report.
pub fn is_armed() -> bool {
    ARMED.get().is_some()
}

/// Records that the test passed `what` (kept for the report; cheap, never printed otherwise).
pub fn milestone(what: impl Into<String>) {
    let at = ARMED.get().map_or(Duration::ZERO, Instant::elapsed);
    MILESTONES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push((at, what.into()));
}

/// Prints the milestones and every thread's stack (gdb, when installed; the kernel's view of each thread
/// otherwise) to stderr.
fn report(after: Duration) {
    let mut err = std::io::stderr().lock();
    let _ = writeln!(
        err,
        "\n=== hang report: the test still runs after {after:?} ===\nmilestones (since the report was armed):"
    );
    for (at, what) in MILESTONES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
    {
        let _ = writeln!(err, "  {:>8.3} s  {what}", at.as_secs_f64());
    }
    let pid = std::process::id().to_string();
    let gdb = std::process::Command::new("gdb")
        .args(["-p", &pid, "-batch", "-nx", "-ex", "thread apply all bt"])
        .stdin(std::process::Stdio::null())
        .output();
    match gdb {
        // (Attached: its backtraces name each thread; not attached — ptrace refused — it prints none.)
        Ok(out) if out.status.success() && String::from_utf8_lossy(&out.stdout).contains("\nThread ") => {
            let _ = err.write_all(&out.stdout);
        }
        _ => {
            let _ = writeln!(err, "(no gdb backtrace; each thread as the kernel sees it)");
            if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
                for task in tasks.flatten() {
                    let dir = task.path();
                    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
                    let _ = writeln!(
                        err,
                        "thread {} {}: wchan {} syscall {}\n{}",
                        task.file_name().to_string_lossy(),
                        read("comm").trim(),
                        read("wchan").trim(),
                        read("syscall").trim(),
                        read("stack")
                    );
                }
            }
        }
    }
    let _ = writeln!(err, "=== end of the hang report ===");
}
