//! The suite's hang report (`fleet_e2e_client::hang_report`): a test process still running after the report's
//! delay prints the milestones it passed and every thread's stack, then aborts.
#![allow(clippy::unwrap_used)]

use std::process::Command;

use fleet_e2e_client::hang_report;

/// Set in the child process only: the fixture below then hangs.
const FIXTURE_ENV: &str = "FLEET_TEST_HANG_FIXTURE";

/// Blocks its thread for good (its name is what the report must show).
#[inline(never)]
fn block_forever_for_the_hang_report() -> ! {
    loop {
        std::thread::park();
    }
}

/// The hanging test, run only as the child of the test below.
#[test]
fn hang_fixture() {
    if std::env::var(FIXTURE_ENV).is_err() {
        return;
    }
    hang_report::arm();
    hang_report::milestone("fixture: about to block");
    block_forever_for_the_hang_report();
}

#[test]
fn a_test_still_running_after_the_delay_reports_where_it_waits_and_aborts() {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "hang_fixture", "--nocapture", "--test-threads=1"])
        .env(FIXTURE_ENV, "1")
        .env("NEXTEST_EXECUTION_MODE", "process-per-test")
        .env(hang_report::AFTER_ENV, "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    use std::os::unix::process::ExitStatusExt as _;
    assert_eq!(
        out.status.signal(),
        Some(SIGABRT),
        "the hanging test is aborted: {:?}\n{stderr}",
        out.status
    );
    assert!(
        stderr.contains("=== hang report: the test still runs after 1s ==="),
        "{stderr}"
    );
    assert!(
        stderr.contains("fixture: about to block"),
        "the milestones: {stderr}"
    );
    assert!(stderr.contains("=== end of the hang report ==="), "{stderr}");
    let gdb = Command::new("gdb")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if stderr.contains("(no gdb backtrace") {
        assert!(
            stderr.contains("hang-report"),
            "the kernel's view names each thread: {stderr}"
        );
        // Without gdb, or where it may not attach (not root: ptrace restricted by Yama).
        assert!(
            !gdb || !is_root(),
            "gdb is installed and may attach as root: {stderr}"
        );
    } else {
        assert!(
            stderr.contains("block_forever_for_the_hang_report"),
            "gdb's backtrace names the blocked function: {stderr}"
        );
    }
}

/// Whether this process runs as root (the real uid of /proc/self/status).
fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|ids| ids.split_whitespace().next())
            == Some("0")
    })
}

/// SIGABRT (6 on Linux).
const SIGABRT: i32 = 6;

#[test]
fn outside_a_process_per_test_run_nothing_is_armed() {
    // Under `cargo test` one process runs a whole binary: its age is not a test's.
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "hang_fixture_unarmed", "--nocapture"])
        .env(FIXTURE_ENV, "1")
        .env_remove("NEXTEST_EXECUTION_MODE")
        .env(hang_report::AFTER_ENV, "0")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
}

/// Arms and checks nothing was: run only as the child of the test above.
#[test]
fn hang_fixture_unarmed() {
    if std::env::var(FIXTURE_ENV).is_err() {
        return;
    }
    hang_report::arm();
    assert!(!hang_report::is_armed());
}
