//! The plugin developer's harness end to end with the real binary (issue 18, spec §15.4): `fleet replay` of the
//! recorded sessions in `tests/fixtures/replay/` through a real fleet — spawned by `--spawn` over a plugin
//! catalogue, or a `fleet up` already running — green against the plugin they were recorded with, red against a
//! changed copy (the call and the JSON path named); `--map-tool`, `--strict`, `--json`, `--manifest`; format
//! detection (F1, F2, F4 replayed, F3 refused); `fleet fixture verify` naming every broken line, `fleet fixture
//! summarize`.
//!
//! The changed plugin is a copy of the Python fixture whose `echo` answers one field more (`changed`: an extra,
//! which passes unless `--strict`) and whose `progress` reports one event more than it emitted (`emitted`: a
//! mismatch). Every wait polls an observable (a stdout line) under a failure guard.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use fleet_e2e_client::{fleet_bin, workspace_root};
use serde_json::{Value, json};

/// Failure guard only: `fleet up` prints its "try" line as soon as it serves.
const GUARD: Duration = Duration::from_secs(120);

/// Environment that would point `fleet` at another fleet than the test's.
const SCRUBBED_ENV: &[&str] = &[
    "FLEET_NATS_URL",
    "FLEET_NATS_CREDS",
    "FLEET_NATS_AUTH_DIR",
    "FLEET_DATA_DIR",
    "FLEET_PLUGINS_DIR",
    "FLEET_TOKEN",
    "FLEET_ISOLATION",
];

fn fixture(name: &str) -> PathBuf {
    workspace_root().join("tests/fixtures/replay").join(name)
}

/// A temporary directory the plugins' uids can traverse (a 0700 parent would hide the plugin from them).
fn open_tempdir() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::set_permissions(tmp.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    tmp
}

/// The demo `echo-py` plugin copied to `<dir>/<tool_id>/` under `tool_id`; `changed` edits its output.
fn plugin(dir: &Path, tool_id: &str, changed: bool) {
    let to = dir.join(tool_id);
    std::fs::create_dir_all(&to).unwrap();
    let mut source =
        std::fs::read_to_string(workspace_root().join("plugins/echo-py/echo_plugin.py")).unwrap();
    if changed {
        for (from, into) in [
            (
                r#"return "ok", {"arguments": args}"#,
                r#"return "ok", {"arguments": args, "changed": True}"#,
            ),
            (
                r#"return "ok", {"emitted": count}"#,
                r#"return "ok", {"emitted": count + 1}"#,
            ),
        ] {
            assert!(source.contains(from), "the fixture plugin no longer has {from:?}");
            source = source.replace(from, into);
        }
    }
    std::fs::write(to.join("echo_plugin.py"), source).unwrap();
    let manifest =
        json!({"tool_id": tool_id, "type": "binary", "command": ["/usr/bin/python3", "echo_plugin.py"]});
    std::fs::write(to.join("executa.json"), manifest.to_string()).unwrap();
}

/// `fleet <args>`, the environment scrubbed.
fn fleet(args: &[&str]) -> Output {
    let mut cmd = Command::new(fleet_bin());
    cmd.args(args).stdin(Stdio::null());
    for var in SCRUBBED_ENV {
        cmd.env_remove(var);
    }
    cmd.output().unwrap()
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn exit(out: &Output) -> i32 {
    out.status.code().unwrap_or(-1)
}

/// The `--json` report's row of the request on `line`.
fn row(report: &Value, line: u64) -> &Value {
    report["calls"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["line"] == line)
        .unwrap_or_else(|| panic!("no row for line {line}: {report:#}"))
}

fn json_report(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", text(out)))
}

/// The table line of the request on `line` (`   6  3   tools.invoke …`).
fn table_line(stdout: &str, line: u64) -> &str {
    stdout
        .lines()
        .find(|l| l.split_whitespace().next() == Some(&line.to_string()))
        .unwrap_or_else(|| panic!("no table line for line {line}:\n{stdout}"))
}

/// The processes whose command line mentions `needle` (`--spawn`'s `fleet up` names its `--plugins-dir`).
fn processes_mentioning(needle: &str) -> Vec<String> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.chars().all(|c| c.is_ascii_digit()))
        })
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .filter(|cmd| cmd.contains(needle))
        .collect()
}

#[test]
fn a_recorded_f2_session_replays_green_then_red_against_a_changed_plugin() {
    let f2 = fixture("echo-session.f2.jsonl");
    let original = open_tempdir();
    plugin(original.path(), "echo-py", false);
    let out = fleet(&[
        "replay",
        f2.to_str().unwrap(),
        "--spawn",
        "--plugins-dir",
        original.path().to_str().unwrap(),
    ]);
    let (stdout, stderr) = text(&out);
    assert_eq!(exit(&out), 0, "{stdout}\n{stderr}");
    for line in [4, 6, 8, 10, 12, 16, 18] {
        assert!(
            table_line(&stdout, line).contains(" pass"),
            "line {line}:\n{stdout}"
        );
    }
    // window.* calls and events are listed, not replayed.
    assert!(table_line(&stdout, 2).contains("window.hello") && table_line(&stdout, 2).contains("skipped"));
    assert!(
        table_line(&stdout, 14).contains("window.set_title") && table_line(&stdout, 14).contains("skipped")
    );
    assert!(table_line(&stdout, 20).contains("auth.refresh") && table_line(&stdout, 20).contains("skipped"));
    assert!(
        stdout.contains("✓ 7 call(s): 7 pass, 0 mismatch, 0 without a recorded outcome; 3 skipped"),
        "{stdout}"
    );
    // The spawned fleet was stopped (and waited for) before the replay exited.
    let catalogue = std::fs::canonicalize(original.path()).unwrap();
    assert_eq!(
        processes_mentioning(catalogue.to_str().unwrap()),
        Vec::<String>::new()
    );

    let changed = open_tempdir();
    plugin(changed.path(), "echo-py", true);
    let out = fleet(&[
        "replay",
        f2.to_str().unwrap(),
        "--spawn",
        "--plugins-dir",
        changed.path().to_str().unwrap(),
    ]);
    let (stdout, stderr) = text(&out);
    assert_eq!(exit(&out), 1, "{stdout}\n{stderr}");
    // The sync progress call (line 6, id 3) and the async job's end (the getJob of line 16) differ.
    let progress = table_line(&stdout, 6);
    assert!(
        progress.contains("tools.invoke echo-py") && progress.contains("mismatch"),
        "{stdout}"
    );
    assert!(
        progress.contains("$.result.data.emitted (recorded 3, replayed 4)"),
        "{stdout}"
    );
    let job = table_line(&stdout, 16);
    assert!(
        job.contains("tools.getJob") && job.contains("$.result.result.emitted (recorded 2, replayed 3)"),
        "{stdout}"
    );
    // The extra field passes and is listed.
    assert!(table_line(&stdout, 4).contains(" pass"), "{stdout}");
    assert!(
        stdout.contains("line 4: extra field $.result.data.changed"),
        "{stdout}"
    );
    assert!(stdout.contains("✗ 7 call(s): 5 pass, 2 mismatch"), "{stdout}");
}

/// A `fleet up` child; killed (with its nats-server, which dies with it) when dropped.
struct Up {
    child: Child,
    data_dir: PathBuf,
    _tmp: tempfile::TempDir,
}

impl Up {
    /// `fleet up` over a catalogue of `echo-py` and its changed copy `echo-changed`, ready.
    fn start() -> Up {
        let tmp = open_tempdir();
        let plugins = tmp.path().join("plugins");
        plugin(&plugins, "echo-py", false);
        plugin(&plugins, "echo-changed", true);
        let data_dir = tmp.path().join("data");
        let http = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let mut cmd = Command::new(fleet_bin());
        cmd.arg("up")
            .arg("--data-dir")
            .arg(&data_dir)
            .arg("--plugins-dir")
            .arg(&plugins)
            .args(["--http", &http.to_string(), "--nats-port", "0"])
            .current_dir(tmp.path())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        for var in SCRUBBED_ENV {
            cmd.env_remove(var);
        }
        let mut child = cmd.spawn().unwrap();
        let (tx, rx) = mpsc::channel();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if line.starts_with("try ") {
                    let _ = tx.send(());
                }
            }
        });
        let up = Up {
            child,
            data_dir,
            _tmp: tmp,
        };
        rx.recv_timeout(GUARD)
            .unwrap_or_else(|e| panic!("failure guard: fleet up not ready within {GUARD:?}: {e}"));
        up
    }

    /// `fleet replay FILE --data-dir <its data dir> <args>`.
    fn replay(&self, file: &Path, args: &[&str]) -> Output {
        let mut all = vec![
            "replay",
            file.to_str().unwrap(),
            "--data-dir",
            self.data_dir.to_str().unwrap(),
        ];
        all.extend_from_slice(args);
        fleet(&all)
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn against_a_running_fleet_map_tool_strict_json_and_manifest() {
    let up = Up::start();
    let f2 = fixture("echo-session.f2.jsonl");

    // Green against the plugin it was recorded with, through the running fleet (found through --data-dir).
    let out = up.replay(&f2, &["--user", "dev"]);
    assert_eq!(exit(&out), 0, "{:?}", text(&out));

    // --map-tool: the same session on the changed copy.
    let out = up.replay(&f2, &["--map-tool", "echo-py=echo-changed", "--json"]);
    assert_eq!(exit(&out), 1, "{:?}", text(&out));
    let report = json_report(&out);
    assert_eq!(report["format"], "F2");
    assert_eq!(report["strict"], false);
    let echo = row(&report, 4);
    assert_eq!(
        (echo["verdict"].as_str(), echo["tool_id"].as_str()),
        (Some("pass"), Some("echo-changed"))
    );
    assert_eq!(echo["extra"], json!(["$.result.data.changed"]));
    let progress = row(&report, 6);
    assert_eq!(progress["verdict"], "mismatch");
    assert_eq!(progress["id"], "3");
    assert_eq!(progress["call"], "tools.invoke");
    assert_eq!(progress["path"], "$.result.data.emitted");
    assert_eq!(
        (progress["recorded"].clone(), progress["replayed"].clone()),
        (json!(3), json!(4))
    );
    assert_eq!(row(&report, 16)["path"], "$.result.result.emitted");
    assert_eq!(row(&report, 2)["verdict"], "skipped");
    assert_eq!(
        report["summary"],
        json!({"calls": 7, "pass": 5, "mismatch": 2, "no_outcome": 0, "skipped": 3, "rejected": 0,
               "extra_fields": 1, "green": false})
    );

    // --strict: the extra field is the mismatch, absent from the recording.
    let out = up.replay(&f2, &["--map-tool", "echo-py=echo-changed", "--json", "--strict"]);
    assert_eq!(exit(&out), 1, "{:?}", text(&out));
    let report = json_report(&out);
    assert_eq!(report["strict"], true);
    let echo = row(&report, 4);
    assert_eq!(echo["verdict"], "mismatch");
    assert_eq!(echo["path"], "$.result.data.changed");
    assert_eq!(echo.get("recorded"), None);
    assert_eq!(echo["replayed"], true);

    // A recording made against another tool_id: red as it is, green mapped.
    let tmp = open_tempdir();
    let minted = tmp.path().join("minted.jsonl");
    let text_f2 = std::fs::read_to_string(&f2).unwrap();
    std::fs::write(
        &minted,
        text_f2.replace("\"echo-py\"", "\"tool-dev-echo-a1b2c3d4\""),
    )
    .unwrap();
    let out = up.replay(&minted, &["--json"]);
    assert_eq!(exit(&out), 1, "{:?}", text(&out));
    let report = json_report(&out);
    assert_eq!(row(&report, 4)["path"], "$.ok");
    assert_eq!(row(&report, 4)["tool_id"], "tool-dev-echo-a1b2c3d4");
    let out = up.replay(&minted, &["--map-tool", "tool-dev-echo-a1b2c3d4=echo-py"]);
    assert_eq!(exit(&out), 0, "{:?}", text(&out));

    // --manifest: a manifest that declares the tool lets every call through; one that does not rejects the
    // tools.invoke / invokeAsync calls (window.* is always allowed), and the replay fails.
    let allowing = tmp.path().join("allowing.json");
    std::fs::write(
        &allowing,
        json!({"schema": 2, "required_executas": [{"tool_id": "echo-py"}], "ui": {"host_api": {"tools": ["required:*"]}}})
            .to_string(),
    )
    .unwrap();
    let out = up.replay(&f2, &["--manifest", allowing.to_str().unwrap(), "--json"]);
    assert_eq!(exit(&out), 0, "{:?}", text(&out));
    assert_eq!(json_report(&out)["summary"]["rejected"], 0);
    let narrowing = tmp.path().join("narrowing.json");
    std::fs::write(
        &narrowing,
        json!({"schema": 2, "required_executas": [{"tool_id": "echo-py"}], "optional_executas": ["other"],
               "ui": {"host_api": {"tools": ["optional:*"]}}})
        .to_string(),
    )
    .unwrap();
    let out = up.replay(&f2, &["--manifest", narrowing.to_str().unwrap(), "--json"]);
    assert_eq!(exit(&out), 1, "{:?}", text(&out));
    let report = json_report(&out);
    assert_eq!(report["summary"]["rejected"], 5);
    assert_eq!(report["summary"]["mismatch"], 0);
    assert_eq!(
        row(&report, 4)["rejected"],
        "no ui.host_api.tools entry admits tool_id echo-py"
    );
    assert_eq!(row(&report, 4)["verdict"], "pass");
    assert_eq!(row(&report, 2).get("rejected"), None);
    let undeclared = tmp.path().join("undeclared.json");
    std::fs::write(
        &undeclared,
        json!({"schema": 2, "required_executas": ["other"]}).to_string(),
    )
    .unwrap();
    let out = up.replay(&f2, &["--manifest", undeclared.to_str().unwrap()]);
    let (stdout, _) = text(&out);
    assert_eq!(exit(&out), 1, "{stdout}");
    assert!(
        stdout.contains(
            "line 4: the manifest's ACL would reject tools.invoke: tool_id echo-py is not declared in required_executas or optional_executas"
        ),
        "{stdout}"
    );

    // F1 and F4 recordings drive their tools.* calls too.
    for (file, format, calls) in [
        ("echo-session.f1.jsonl", "F1", 4),
        ("echo-session.f4.jsonl", "F4", 2),
    ] {
        let out = up.replay(&fixture(file), &["--json"]);
        assert_eq!(exit(&out), 0, "{file}: {:?}", text(&out));
        let report = json_report(&out);
        assert_eq!(report["format"], format);
        assert_eq!(report["summary"]["pass"], calls, "{report:#}");
    }
}

#[test]
fn fixture_verify_names_every_broken_line() {
    let broken = fixture("broken.f2.jsonl");
    let out = fleet(&["fixture", "verify", broken.to_str().unwrap()]);
    let (stdout, _) = text(&out);
    assert_eq!(exit(&out), 1, "{stdout}");
    let file = broken.display().to_string();
    for (line, problem) in [
        (3, "bad JSON"),
        (4, "a res without req: no req with id 7 waits for one"),
        (5, "F2: missing required field `id`"),
        (6, "mixed formats: an F1 line in an F2 file"),
        (7, "unknown format"),
        (8, "unknown method tools.invokeEverything"),
        (9, "F2: `error` must be an object with a string `code`"),
    ] {
        assert!(
            stdout.contains(&format!("{file}:{line}: {problem}")),
            "line {line}:\n{stdout}"
        );
    }
    assert!(stdout.contains("9 line(s), 7 issue(s)"), "{stdout}");
    // Sound files pass; --json lists the problems with their lines.
    let good = fixture("echo-session.f2.jsonl");
    let out = fleet(&["fixture", "verify", good.to_str().unwrap(), "--json"]);
    assert_eq!(exit(&out), 0, "{:?}", text(&out));
    assert_eq!(json_report(&out)["files"][0]["ok"], true);
    let out = fleet(&[
        "fixture",
        "verify",
        good.to_str().unwrap(),
        broken.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(exit(&out), 1);
    let problems = &json_report(&out)["files"][1]["problems"];
    assert_eq!(problems.as_array().map(Vec::len), Some(7));
    assert_eq!(problems[0]["line"], 3);
    // A broken recording is not replayed: the first problem is named.
    let out = fleet(&[
        "replay",
        broken.to_str().unwrap(),
        "--nats-url",
        "nats://127.0.0.1:1",
    ]);
    let (_, stderr) = text(&out);
    assert_eq!(exit(&out), 2, "{stderr}");
    assert!(
        stderr.contains("7 problem(s), the first at line 3: bad JSON"),
        "{stderr}"
    );
}

#[test]
fn formats_are_detected_and_a_mock_file_is_refused() {
    let files = [
        "echo-session.f1.jsonl",
        "echo-session.f2.jsonl",
        "mocks.f3.jsonl",
        "echo-session.f4.jsonl",
    ];
    let paths: Vec<String> = files.iter().map(|f| fixture(f).display().to_string()).collect();
    let mut args = vec!["fixture", "summarize", "--json"];
    args.extend(paths.iter().map(String::as_str));
    let out = fleet(&args);
    assert_eq!(exit(&out), 0, "{:?}", text(&out));
    let summary = json_report(&out);
    let formats: Vec<&str> = (0..4)
        .map(|i| summary["files"][i]["format"].as_str().unwrap())
        .collect();
    assert_eq!(formats, ["F1", "F2", "F3", "F4"]);
    let f2 = &summary["files"][1];
    assert_eq!(
        f2["calls"],
        json!({"tools.getJob": 2, "tools.invoke": 4, "tools.invokeAsync": 1, "window.hello": 1, "window.set_title": 1})
    );
    assert_eq!(
        f2["tool_ids"],
        json!({"echo-py.echo": 2, "echo-py.fail": 1, "echo-py.progress": 2})
    );
    assert_eq!(
        f2["outcomes"],
        json!({"ok": 7, "error invalid_arg": 1, "error job_not_found": 1})
    );
    assert_eq!(f2["events"], json!({"auth.refresh": 1}));
    assert_eq!(f2["duration_ms"], 1800.0);
    let out = fleet(&["fixture", "summarize", &paths[1]]);
    let (stdout, _) = text(&out);
    assert!(
        stdout.contains("Top tools: echo-py.echo (2), echo-py.progress (2), echo-py.fail (1)"),
        "{stdout}"
    );
    assert!(stdout.contains("Duration: 1.8s"), "{stdout}");
    // An F3 file is a mock fixture, not a recording: refused before any connection.
    let out = fleet(&["replay", &paths[2], "--nats-url", "nats://127.0.0.1:1"]);
    let (stdout, stderr) = text(&out);
    assert_eq!(exit(&out), 2, "{stdout}{stderr}");
    assert!(
        stderr.contains("an F3 mock fixture file (MockEntry lines), not a recording"),
        "{stderr}"
    );
}
