//! Crashes in the fleet, on real processes: a worker (`fleet worker --nats-url …`, a separate process) killed with
//! `-9` after or before it started a job, a running job of a dead worker overtaken by its deadline (and racing a
//! cancel), a front replica stopped under load, and no job left `running` on a dead worker.
//!
//! The sweeper (`fleet::sweeper`) is what repairs all of this; a `Cluster` front does not run it, so every test
//! that needs it spawns `sweeper::run` itself (or calls `sweeper::sweep` to decide exactly when a sweep happens).
//! A killed worker's registry entry lives for the worker TTL (10 s), so the tests that wait for `worker_lost` take
//! about that long; they run in parallel.
//!
//! Every wait is a poll of an observable under a failure guard ([`GUARD`]); no test asserts on elapsed time.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::{Child, ExitStatus};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use fleet_client::api::api_request;
use fleet_e2e::cluster::{Cluster, Role, connect};
use fleet_e2e::worker::{Plugin, alive, eventually};
use fleet_proto::api::{ApiError, ApiResponse, JobId, JobState, methods, subjects};
use fleet_proto::util::now_ms;
use fleet_store::JobRecord;
use fleet_worker::config::{IsolationMode, RunAs, WorkerConfig};
use fleet_worker::sandbox::Sandbox;
use serde_json::{Value, json};

/// Failure guard only: every wait returns as soon as its observable holds.
const GUARD: Duration = Duration::from_secs(60);

const USER: &str = "alice";

/// A bounded poll: `tick` sleeps briefly between two looks at an observable and fails the test once the guard
/// has passed.
struct Deadline {
    until: Instant,
    what: String,
}

impl Deadline {
    fn new(what: impl Into<String>) -> Deadline {
        Deadline {
            until: Instant::now() + GUARD,
            what: what.into(),
        }
    }

    async fn tick(&self) {
        assert!(
            Instant::now() < self.until,
            "failure guard: {} did not happen within {GUARD:?}",
            self.what
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// A background task aborted when dropped (the sweeper of a test).
struct Bg(tokio::task::JoinHandle<()>);

impl Bg {
    /// `fleet::sweeper::run` on the cluster's first front.
    fn sweeper(c: &Cluster) -> Bg {
        Bg(tokio::spawn(fleet::sweeper::run(c.fronts[0].0.clone())))
    }
}

impl Drop for Bg {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Sends `sig` (a `kill` signal name) to `pid`.
fn signal(pid: u32, sig: &str) {
    let status = std::process::Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .unwrap();
    assert!(status.success(), "kill -{sig} {pid}: {status}");
}

/// The parent pid of a live process.
fn ppid(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()
}

/// A `fleet worker --nats-url …` process of a cluster. Dropping it kills it (`-9`) and then sweeps its cgroup
/// subtree, as a restarted worker with the same id would: a `kill -9` leaves its plugins running.
struct WorkerProc {
    id: String,
    child: Option<Child>,
    state_dir: PathBuf,
}

impl WorkerProc {
    async fn spawn(c: &Cluster, name: &str) -> WorkerProc {
        let id = format!("{name}-{}", std::process::id());
        let child = c.spawn_worker_process(&id).await;
        WorkerProc {
            state_dir: c.root.path().join(format!("proc-{id}")).join("state"),
            id,
            child: Some(child),
        }
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// `kill -9`, and reaps it.
    fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts a new process with the same worker id (which sweeps what its predecessor left).
    async fn restart(&mut self, c: &Cluster) {
        assert!(self.child.is_none(), "kill it first");
        self.child = Some(c.spawn_worker_process(&self.id).await);
    }

    /// SIGTERM, and waits for the exit.
    async fn terminate(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("running");
        signal(child.id(), "TERM");
        let d = Deadline::new(format!("worker {} exiting after SIGTERM", self.id));
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            d.tick().await;
        }
    }
}

impl Drop for WorkerProc {
    fn drop(&mut self) {
        self.kill9();
        let config = WorkerConfig {
            worker_id: self.id.clone(),
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

/// A cluster whose replicas and workers serve the echo fixture as `echo`, once its API answers (a request sent at
/// once on another connection could otherwise race the front's subscriptions; see
/// `replacement_front_serves_as_soon_as_serve_returns`).
async fn start(name: &str, fronts: usize, workers: usize) -> Cluster {
    let c = Cluster::start(name, fronts, workers, &[Plugin::echo("echo", &[])]).await;
    let auth = format!("Bearer {}", c.token(USER));
    let d = Deadline::new("the API answering");
    while !matches!(
        request(&c.app, &auth, methods::TOOLS_LIST_JOBS, &json!({})).await,
        Outcome::Ok(_)
    ) {
        d.tick().await;
    }
    c
}

/// `tools.invokeAsync` of the echo fixture's `tool`; returns the job id.
async fn submit(c: &Cluster, user: &str, tool: &str, args: Value) -> String {
    let r = c
        .ok(
            user,
            methods::TOOLS_INVOKE_ASYNC,
            json!({ "tool_id": "echo", "method": tool, "args": args }),
        )
        .await;
    assert_eq!(r["state"], "queued", "{r}");
    r["jobId"].as_str().unwrap().to_string()
}

async fn get_job(c: &Cluster, user: &str, id: &str) -> Value {
    c.ok(user, methods::TOOLS_GET_JOB, json!({ "jobId": id })).await
}

async fn cancel_job(c: &Cluster, user: &str, id: &str) -> Value {
    c.ok(user, methods::TOOLS_CANCEL_JOB, json!({ "jobId": id }))
        .await
}

fn is_terminal(job: &Value) -> bool {
    matches!(
        job["state"].as_str(),
        Some("succeeded" | "failed" | "cancelled" | "expired")
    )
}

/// Polls `tools.getJob` until `pred` holds; returns that snapshot.
async fn wait_job(c: &Cluster, user: &str, id: &str, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let until = Instant::now() + GUARD;
    loop {
        let job = get_job(c, user, id).await;
        if pred(&job) {
            return job;
        }
        assert!(
            Instant::now() < until,
            "failure guard: job {id}: {what} did not happen within {GUARD:?}; last snapshot {job}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

async fn record(c: &Cluster, user: &str, id: &str) -> (JobRecord, u64) {
    let job_id: JobId = id.parse().unwrap();
    let r = c.store.get_job(user, &job_id).await.unwrap().expect("record");
    (r.value, r.revision)
}

async fn live_ids(c: &Cluster) -> Vec<String> {
    c.store
        .live_workers()
        .await
        .unwrap()
        .into_iter()
        .map(|w| w.id)
        .collect()
}

/// Polls until the registry no longer lists `worker` (its key expired: the worker TTL after its last heartbeat).
async fn wait_unregistered(c: &Cluster, worker: &str) {
    let d = Deadline::new(format!("worker {worker} leaving the registry"));
    while live_ids(c).await.iter().any(|w| w == worker) {
        d.tick().await;
    }
}

/// The pid of `user`'s echo session, through the fixture's `inspect` tool (a sync invoke multiplexed next to
/// whatever the session runs).
async fn session_pid(c: &Cluster, user: &str) -> u32 {
    let r = c
        .ok(
            user,
            methods::TOOLS_INVOKE,
            json!({ "tool_id": "echo", "method": "inspect" }),
        )
        .await;
    u32::try_from(r["pid"].as_u64().expect("pid")).unwrap()
}

/// Running jobs whose worker is not in the registry or is one of `killed`.
async fn stranded(c: &Cluster, killed: &[&str]) -> Vec<JobRecord> {
    let live = live_ids(c).await;
    c.store
        .active_jobs()
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.value)
        .filter(|r| {
            r.state == JobState::Running
                && r.worker
                    .as_deref()
                    .is_none_or(|w| killed.contains(&w) || !live.iter().any(|l| l == w))
        })
        .collect()
}

/// Polls until no running job sits on a dead worker (one the registry lacks, or one of `killed`).
async fn assert_nothing_stranded(c: &Cluster, killed: &[&str]) {
    let d = Deadline::new(format!("no running job on a dead worker (killed: {killed:?})"));
    while !stranded(c, killed).await.is_empty() {
        d.tick().await;
    }
}

/// 1. The worker dies after `queued → running`: the job fails (`executa_unavailable`, `worker_lost`, retriable)
///    once the worker's registry entry expires, and is never run again (attempt stays 1). The plugin process
///    outlives the `kill -9` (its stdin closes, but the fixture finishes in-flight requests before exiting on EOF);
///    the next start of a worker with the same id sweeps it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_killed_mid_job_fails_the_job_as_worker_lost_and_never_reruns_it() {
    let c = start("crash-mid", 1, 0).await;
    let _sweeper = Bg::sweeper(&c);
    let mut w = WorkerProc::spawn(&c, "crash-mid").await;

    let id = submit(&c, USER, "sleep", json!({ "ms": 600_000 })).await;
    wait_job(&c, USER, &id, "running", |j| j["state"] == "running").await;
    let (rec, _) = record(&c, USER, &id).await;
    assert_eq!(rec.attempt, 1);
    assert_eq!(rec.worker.as_deref(), Some(w.id.as_str()));
    let plugin = session_pid(&c, USER).await;
    assert_eq!(ppid(plugin), Some(w.pid()), "the plugin is the worker's child");

    w.kill9();
    let killed = Instant::now();
    let failed = wait_job(&c, USER, &id, "terminal", is_terminal).await;
    let took = killed.elapsed();
    assert_eq!(failed["state"], "failed", "{failed}");
    let error = &failed["error"];
    assert_eq!(error["code"], "executa_unavailable", "{failed}");
    assert_eq!(error["details"]["reason"], "worker_lost", "{failed}");
    assert_eq!(error["details"]["retriable"], true, "{failed}");
    assert_eq!(error["details"]["worker"], w.id.as_str(), "{failed}");
    assert!(failed["finishedAt"].is_string(), "{failed}");
    let (rec, revision) = record(&c, USER, &id).await;
    assert_eq!(rec.state, JobState::Failed);
    assert_eq!(rec.attempt, 1, "never dispatched again");
    let plugin_outlived_worker = alive(plugin);
    println!(
        "worker {} killed -9; job failed as worker_lost {took:?} later; its plugin (pid {plugin}) {}",
        w.id,
        if plugin_outlived_worker {
            "outlived the worker (still in its sleep)"
        } else {
            "died with it"
        }
    );

    // The worker's entry is gone (that is what failed the job): another sweep changes nothing.
    assert!(!live_ids(&c).await.contains(&w.id));
    let front = c.fronts[0].0.clone();
    assert_eq!(fleet::sweeper::sweep(&front).await, (0, 0, 0));

    // A worker started with the same id sweeps what the killed one left, and does not pick the job up.
    w.restart(&c).await;
    assert!(
        eventually(GUARD, || !alive(plugin)).await,
        "the restarted worker swept the orphaned plugin {plugin}"
    );
    assert_eq!(fleet::sweeper::sweep(&front).await, (0, 0, 0));
    let (after, after_revision) = record(&c, USER, &id).await;
    assert_eq!(
        after_revision, revision,
        "a terminal record is never written again"
    );
    assert_eq!(after.attempt, 1);
    assert!(w.terminate().await.success());

    assert_nothing_stranded(&c, &[&w.id]).await;
    assert!(c.store.active_jobs().await.unwrap().is_empty());
    c.shutdown().await;
}

/// 2a. A job no worker took (there was none) stays queued, with no worker and attempt 0; once a worker starts,
///     the sweeper hands it over and it succeeds on its first attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_job_is_dispatched_by_the_sweeper_when_a_worker_appears() {
    let c = start("crash-q", 1, 0).await;
    let _sweeper = Bg::sweeper(&c);

    let id = submit(&c, USER, "echo", json!({ "x": 1 })).await;
    let (rec, _) = record(&c, USER, &id).await;
    assert_eq!(rec.state, JobState::Queued);
    assert_eq!(rec.worker, None);
    assert_eq!(rec.attempt, 0);
    assert_eq!(get_job(&c, USER, &id).await["state"], "queued");

    let mut w = WorkerProc::spawn(&c, "crash-q").await;
    let done = wait_job(&c, USER, &id, "terminal", is_terminal).await;
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(done["result"], json!({ "arguments": { "x": 1 } }));
    let (rec, _) = record(&c, USER, &id).await;
    assert_eq!(rec.attempt, 1);
    assert_eq!(rec.worker.as_deref(), Some(w.id.as_str()));
    assert!(w.terminate().await.success());

    assert_nothing_stranded(&c, &[]).await;
    c.shutdown().await;
}

/// 2b. A worker killed before it moved the job to `running` (the job is queued, its recorded worker dead): once
///     the dead worker's registry entry expires, the sweeper re-dispatches the job to a live worker, where it runs
///     once. The killed worker is a real `kill -9`ed process; recording it on the queued job is done in the store
///     (the window between a worker's accept and its compare-and-set cannot be hit from outside).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_job_of_a_dead_worker_is_redispatched_to_a_live_one() {
    let mut c = start("crash-rd", 1, 0).await;
    let mut dead = WorkerProc::spawn(&c, "crash-rd").await;
    dead.kill9();
    // Still registered (its key lives for the TTL), but nobody answers on its subjects: the job stays queued.
    let id = submit(&c, USER, "echo", json!({ "y": 2 })).await;
    let (rec, _) = record(&c, USER, &id).await;
    assert_eq!(
        (rec.state, rec.worker.clone(), rec.attempt),
        (JobState::Queued, None, 0)
    );
    let dead_id = dead.id.clone();
    let updated = c
        .store
        .update_job(USER, &id.parse().unwrap(), move |r| {
            r.worker = Some(dead_id.clone());
            true
        })
        .await
        .unwrap()
        .expect("queued");
    assert_eq!(updated.value.state, JobState::Queued);

    let live = c.add_worker().await;
    let live_id = c.workers[live].node.as_ref().unwrap().id().to_string();
    let _sweeper = Bg::sweeper(&c);
    let done = wait_job(&c, USER, &id, "terminal", is_terminal).await;
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(done["result"], json!({ "arguments": { "y": 2 } }));
    let (rec, _) = record(&c, USER, &id).await;
    assert_eq!(rec.attempt, 1, "run exactly once");
    assert_eq!(rec.worker.as_deref(), Some(live_id.as_str()));

    assert_nothing_stranded(&c, &[&dead.id]).await;
    drop(dead);
    c.shutdown().await;
}

/// 3. A running job whose worker was killed, with a deadline shorter than the worker TTL: the sweeper expires it
///    (`tool_timeout`) before it could be failed as `worker_lost`, and it never gets a second terminal state —
///    not when the worker's entry expires afterwards, not through a late `cancelJob`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_job_of_a_killed_worker_expires_once_at_its_deadline() {
    let c = start("crash-exp", 1, 0).await;
    let _sweeper = Bg::sweeper(&c);
    let mut w = WorkerProc::spawn(&c, "crash-exp").await;
    let id = submit(&c, USER, "sleep", json!({ "ms": 600_000 })).await;
    wait_job(&c, USER, &id, "running", |j| j["state"] == "running").await;

    w.kill9();
    let deadline = now_ms() + 1_500;
    c.store
        .update_job(USER, &id.parse().unwrap(), move |r| {
            r.deadline_ms = deadline;
            true
        })
        .await
        .unwrap()
        .expect("still running");

    let expired = wait_job(&c, USER, &id, "terminal", is_terminal).await;
    assert_eq!(expired["state"], "expired", "{expired}");
    assert_eq!(expired["error"]["code"], "tool_timeout", "{expired}");
    assert_eq!(expired["deadlineMs"], deadline);
    let (rec, revision) = record(&c, USER, &id).await;
    assert!(rec.finished_at_ms.unwrap() >= deadline);
    assert_eq!(rec.attempt, 1);

    // The dead worker's entry expires now; sweeps after that (the background one, and this one) leave the
    // expired record alone.
    wait_unregistered(&c, &w.id).await;
    let front = c.fronts[0].0.clone();
    assert_eq!(fleet::sweeper::sweep(&front).await, (0, 0, 0));
    let cancel = cancel_job(&c, USER, &id).await;
    assert_eq!(cancel["cancelled"], false, "{cancel}");
    assert_eq!(cancel["state"], "expired", "{cancel}");
    let (after, after_revision) = record(&c, USER, &id).await;
    assert_eq!(after_revision, revision, "never written again");
    assert_eq!(after.state, JobState::Expired);
    let snapshot = get_job(&c, USER, &id).await;
    assert_eq!(snapshot["state"], "expired");
    assert_eq!(snapshot["error"]["code"], "tool_timeout");

    assert_nothing_stranded(&c, &[&w.id]).await;
    c.shutdown().await;
}

/// 3b. Expiry racing `cancelJob` — and two front replicas sweeping at once, as every replica does: each job ends
///     in exactly one terminal state, the loser of each race is told so (`cancelled: false` with the winner's
///     state, or not counted by its sweep), and every quota slot comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_racing_cancel_leaves_exactly_one_terminal_state() {
    let c = start("crash-race", 2, 0).await;
    let users = ["r0", "r1", "r2", "r3"];
    let mut jobs = Vec::new();
    for i in 0..5 {
        for user in users {
            jobs.push((user, submit(&c, user, "echo", json!({ "i": i })).await));
        }
    }
    // No worker: all of them stay queued. Put their deadlines behind us, then expire and cancel at once (the
    // sweeps take the oldest first, the cancels go newest first).
    let past = now_ms().saturating_sub(1);
    for (user, id) in &jobs {
        c.store
            .update_job(user, &id.parse().unwrap(), move |r| {
                r.deadline_ms = past;
                true
            })
            .await
            .unwrap()
            .expect("queued");
    }
    let mut sweeps = tokio::task::JoinSet::new();
    for (front, _) in &c.fronts {
        let front = front.clone();
        sweeps.spawn(async move { fleet::sweeper::sweep(&front).await });
    }
    // One cancel after the other, newest first, while the sweeps work through the jobs oldest first.
    let (client, auths) = (
        c.app.clone(),
        jobs.iter()
            .map(|(user, id)| (format!("Bearer {}", c.token(user)), id.clone()))
            .collect::<Vec<_>>(),
    );
    let cancels = tokio::spawn(async move {
        let mut out = vec![Value::Null; auths.len()];
        for (i, (auth, id)) in auths.iter().enumerate().rev() {
            let args = json!({ "jobId": id });
            match request(&client, auth, methods::TOOLS_CANCEL_JOB, &args).await {
                Outcome::Ok(v) => out[i] = v,
                other => panic!("cancelJob {id}: {other:?}"),
            }
        }
        out
    });
    let cancelled = cancels.await.unwrap();
    let mut expired = 0;
    for (e, lost, _) in sweeps.join_all().await {
        assert_eq!(lost, 0);
        expired += e;
    }

    let mut cancel_wins = 0;
    for ((user, id), cancel) in jobs.iter().zip(&cancelled) {
        let job = get_job(&c, user, id).await;
        if cancel["cancelled"] == true {
            cancel_wins += 1;
            assert_eq!(job["state"], "cancelled", "{job}");
            assert_eq!(job["error"]["code"], "cancelled", "{job}");
        } else {
            assert_eq!(cancel["state"], "expired", "{cancel}");
            assert_eq!(job["state"], "expired", "{job}");
            assert_eq!(job["error"]["code"], "tool_timeout", "{job}");
        }
    }
    assert_eq!(
        expired + cancel_wins,
        jobs.len(),
        "one winner per job: {expired} expiries, cancels {cancelled:?}"
    );
    println!(
        "race over {} jobs: {cancel_wins} cancels won, {expired} expiries won",
        jobs.len()
    );
    let front = c.fronts[0].0.clone();
    assert_eq!(fleet::sweeper::sweep(&front).await, (0, 0, 0));
    assert!(c.store.active_jobs().await.unwrap().is_empty());
    // Every slot came back: each user is admitted five new jobs.
    for user in users {
        for i in 0..5 {
            submit(&c, user, "echo", json!({ "again": i })).await;
        }
    }
    c.shutdown().await;
}

/// The outcome of one API request made with a bounded wait.
#[derive(Debug)]
enum Outcome {
    Ok(Value),
    /// A clean error: the API's envelope, or NATS saying nobody serves the subject.
    Clean(String),
    /// No answer within the wait (the request was lost).
    Lost(String),
}

async fn request(client: &async_nats::Client, auth: &str, method: &str, args: &Value) -> Outcome {
    let req = api_request(auth, args, Duration::from_secs(30));
    match client.send_request(subjects::api(method), req).await {
        Ok(msg) => match serde_json::from_slice::<ApiResponse<Value>>(&msg.payload) {
            Ok(ApiResponse::Ok(v)) => Outcome::Ok(v),
            Ok(ApiResponse::Err(ApiError { code, message, .. })) => {
                Outcome::Clean(format!("{code}: {message}"))
            }
            Err(e) => Outcome::Lost(format!("unreadable answer: {e}")),
        },
        Err(e) if e.kind() == async_nats::client::RequestErrorKind::NoResponders => {
            Outcome::Clean(format!("no responders: {e}"))
        }
        Err(e) => Outcome::Lost(format!("{:?}: {e}", e.kind())),
    }
}

/// 4. Two front replicas; one is stopped while sync invokes are in flight and a trickle of requests keeps
///    arriving: every request succeeds or fails cleanly (none is lost), everything after the stop succeeds through
///    the survivor, and jobs created before the stop are intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn front_replica_stopped_under_load_loses_no_request() {
    let mut c = start("crash-front", 2, 1).await;
    let client = connect(&c.nats, Role::App).await;

    // Jobs created before the stop: three finished, one running.
    let jobs_user = "jobs-user";
    let mut finished = Vec::new();
    for i in 0..3 {
        let id = submit(&c, jobs_user, "echo", json!({ "before": i })).await;
        wait_job(&c, jobs_user, &id, "succeeded", |j| j["state"] == "succeeded").await;
        finished.push(id);
    }
    let long = submit(&c, jobs_user, "sleep", json!({ "ms": 600_000 })).await;
    wait_job(&c, jobs_user, &long, "running", |j| j["state"] == "running").await;

    // A trickle of requests across the stop (two users, each well under its rate limit).
    let stop_trickle = Arc::new(AtomicBool::new(false));
    let mut trickles = tokio::task::JoinSet::new();
    for user in ["trickle-a", "trickle-b"] {
        let (client, auth, stop) = (
            client.clone(),
            format!("Bearer {}", c.token(user)),
            stop_trickle.clone(),
        );
        trickles.spawn(async move {
            let mut outcomes = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                let args = json!({ "tool_id": "echo", "method": "sleep", "args": { "ms": 20 } });
                outcomes.push(request(&client, &auth, methods::TOOLS_INVOKE, &args).await);
            }
            outcomes
        });
    }

    // Wave A: 20 sync invokes of different lengths at once; front #0 stops after the first five answered.
    let auth = format!("Bearer {}", c.token(USER));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for i in 0..20u64 {
        let (client, auth, tx) = (client.clone(), auth.clone(), tx.clone());
        tokio::spawn(async move {
            let ms = 300 + 100 * i;
            let args = json!({ "tool_id": "echo", "method": "sleep", "args": { "ms": ms } });
            let outcome = request(&client, &auth, methods::TOOLS_INVOKE, &args).await;
            let _ = tx.send((ms, outcome));
        });
    }
    drop(tx);
    let mut wave_a = Vec::new();
    while wave_a.len() < 5 {
        wave_a.push(rx.recv().await.expect("a wave A answer"));
    }
    let (_, service) = c.fronts.remove(0);
    service.stop().await;
    while let Some(r) = rx.recv().await {
        wave_a.push(r);
    }
    assert_eq!(wave_a.len(), 20);

    // Wave B, after the stop: all through front #1.
    let mut wave_b = tokio::task::JoinSet::new();
    for i in 0..20 {
        let (client, auth) = (client.clone(), auth.clone());
        wave_b.spawn(async move {
            let args = json!({ "tool_id": "echo", "method": "echo", "args": { "after": i } });
            (i, request(&client, &auth, methods::TOOLS_INVOKE, &args).await)
        });
    }
    let wave_b = wave_b.join_all().await;
    stop_trickle.store(true, Ordering::SeqCst);
    let trickle: Vec<Outcome> = trickles.join_all().await.into_iter().flatten().collect();

    let lost: Vec<String> = wave_a
        .iter()
        .map(|(ms, o)| (format!("sleep {ms}"), o))
        .chain(trickle.iter().map(|o| ("trickle".to_string(), o)))
        .filter_map(|(what, o)| match o {
            Outcome::Lost(why) => Some(format!("{what}: {why}")),
            _ => None,
        })
        .collect();
    assert!(lost.is_empty(), "requests lost when front #0 stopped: {lost:?}");
    for (ms, o) in &wave_a {
        match o {
            Outcome::Ok(v) => assert_eq!(v, &json!({ "slept_ms": ms })),
            Outcome::Clean(e) => println!("wave A sleep {ms}: clean error {e}"),
            Outcome::Lost(_) => unreachable!(),
        }
    }
    for (i, o) in &wave_b {
        match o {
            Outcome::Ok(v) => assert_eq!(v, &json!({ "arguments": { "after": i } })),
            other => panic!("after the stop, request {i} did not succeed: {other:?}"),
        }
    }
    let clean = trickle.iter().filter(|o| matches!(o, Outcome::Clean(_))).count();
    println!(
        "wave A: {} ok of 20; trickle: {} requests, {clean} clean errors",
        wave_a.iter().filter(|(_, o)| matches!(o, Outcome::Ok(_))).count(),
        trickle.len()
    );

    // Jobs from before the stop, read through the surviving front.
    for (i, id) in finished.iter().enumerate() {
        let job = get_job(&c, jobs_user, id).await;
        assert_eq!(job["state"], "succeeded", "{job}");
        assert_eq!(job["result"], json!({ "arguments": { "before": i } }));
    }
    assert_eq!(get_job(&c, jobs_user, &long).await["state"], "running");
    let cancel = cancel_job(&c, jobs_user, &long).await;
    assert_eq!(cancel["cancelled"], true, "{cancel}");
    let (rec, _) = record(&c, jobs_user, &long).await;
    assert_eq!((rec.state, rec.attempt), (JobState::Cancelled, 1));
    c.shutdown().await;
}

/// 5. Several users' jobs running on two worker processes that are both killed, new jobs arriving while no
///    worker lives, then a fresh worker: every killed job ends `failed`/`worker_lost` after exactly one attempt,
///    the new jobs run once on the fresh worker, and eventually no job is `running` on a dead worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_job_stays_running_on_a_dead_worker() {
    let c = start("crash-all", 1, 0).await;
    let _sweeper = Bg::sweeper(&c);
    let mut a = WorkerProc::spawn(&c, "crash-all-a").await;
    let mut b = WorkerProc::spawn(&c, "crash-all-b").await;

    let mut running = Vec::new();
    for user in ["u1", "u2"] {
        for _ in 0..2 {
            let id = submit(&c, user, "sleep", json!({ "ms": 600_000 })).await;
            running.push((user, id));
        }
    }
    for (user, id) in &running {
        wait_job(&c, user, id, "running", |j| j["state"] == "running").await;
    }
    a.kill9();
    b.kill9();

    let mut queued = Vec::new();
    for i in 0..2 {
        queued.push(submit(&c, "u3", "echo", json!({ "late": i })).await);
    }
    let fresh = WorkerProc::spawn(&c, "crash-all-c").await;

    assert_nothing_stranded(&c, &[&a.id, &b.id]).await;
    for (user, id) in &running {
        let job = wait_job(&c, user, id, "terminal", is_terminal).await;
        assert_eq!(job["state"], "failed", "{job}");
        assert_eq!(job["error"]["code"], "executa_unavailable", "{job}");
        assert_eq!(job["error"]["details"]["reason"], "worker_lost", "{job}");
        let (rec, _) = record(&c, user, id).await;
        assert_eq!(rec.attempt, 1);
        assert!(rec.worker == Some(a.id.clone()) || rec.worker == Some(b.id.clone()));
    }
    for (i, id) in queued.iter().enumerate() {
        let job = wait_job(&c, "u3", id, "terminal", is_terminal).await;
        assert_eq!(job["state"], "succeeded", "{job}");
        assert_eq!(job["result"], json!({ "arguments": { "late": i } }));
        let (rec, _) = record(&c, "u3", id).await;
        assert_eq!((rec.attempt, rec.worker.as_deref()), (1, Some(fresh.id.as_str())));
    }
    let d = Deadline::new("no active job left");
    while !c.store.active_jobs().await.unwrap().is_empty() {
        d.tick().await;
    }
    drop((a, b, fresh));
    c.shutdown().await;
}

/// A registry that cannot be read (here: its KV stream is gone; in production a JetStream timeout or a leader
/// election) says nothing about the workers. The sweeper must not conclude from it that every worker is dead: a job
/// running on a live, heartbeating worker must stay running. (The bug: `Dispatcher::live` turned the read error
/// into an empty list, so one sweep failed every running job as `worker_lost`. The sweeper now reads the registry
/// itself, `Dispatcher::registry`, which says `None` when it cannot; the membership watch keeps its last view.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_registry_does_not_fail_running_jobs() {
    let c = start("crash-reg", 1, 1).await;
    let id = submit(&c, USER, "sleep", json!({ "ms": 600_000 })).await;
    wait_job(&c, USER, &id, "running", |j| j["state"] == "running").await;
    let plugin = session_pid(&c, USER).await;

    let registry = format!("KV_{}", c.store.settings().workers_bucket());
    // No fleet role may delete a stream: the operator's break-glass user does.
    async_nats::jetstream::new(c.break_glass().await)
        .delete_stream(&registry)
        .await
        .unwrap();
    let front = c.fronts[0].0.clone();
    let d = Deadline::new("the front finding the registry unreadable");
    while front.dispatcher().registry().await.is_some() {
        d.tick().await;
    }
    let (_, lost, _) = fleet::sweeper::sweep(&front).await;
    let job = get_job(&c, USER, &id).await;
    assert!(alive(plugin), "the job still runs on its worker");
    assert_eq!((lost, job["state"].as_str()), (0, Some("running")), "{job}");
    cancel_job(&c, USER, &id).await;
    c.shutdown().await;
}

/// A job recorded as `running` under a live, listed worker that does not run it (its start was written and the
/// run then ended on that worker without an outcome: seen under a NATS node kill, where a replica's stale read
/// made the worker's outcome write find "no such job") must not wait for its deadline (30 min by default): its
/// heartbeat stops, the sweeper asks the worker which of its recorded jobs it still runs, and fails the one it
/// does not (`worker_lost`, retriable). The jobs it does run stay running although their heartbeats are just as
/// old: the worker's own answer tells a lost job from a late heartbeat (a store that cannot take writes for a
/// while).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_its_listed_worker_no_longer_runs_is_failed_and_the_ones_it_runs_are_kept() {
    let c = start("crash-held", 1, 1).await;
    let limit = fleet_proto::limits::MAX_LONG_JOBS_PER_AGENT;
    let mut running = Vec::new();
    for _ in 0..limit {
        let id = submit(&c, USER, "sleep", json!({ "ms": 600_000 })).await;
        wait_job(&c, USER, &id, "running", |j| j["state"] == "running").await;
        running.push(id);
    }
    // The agent's long-job slots are full: the next job waits, queued, and no worker is handed it.
    let stray = submit(&c, USER, "sleep", json!({ "ms": 600_000 })).await;
    let (queued, _) = record(&c, USER, &stray).await;
    assert_eq!(queued.state, JobState::Queued);
    let worker = c.workers[0].node.as_ref().unwrap().id().to_string();
    let ttl_ms = u64::try_from(c.store.settings().worker_ttl.as_millis()).unwrap();
    let silent_since = now_ms() - ttl_ms - 1_000;
    // What a worker whose run of it ended without an outcome leaves behind: started by that worker, then silent.
    let stray_id: JobId = stray.parse().unwrap();
    let started = c
        .store
        .transition(USER, &stray_id, JobState::Running, |r| {
            r.worker = Some(worker.clone());
            r.started_at_ms = Some(now_ms());
            r.last_heartbeat_ms = Some(silent_since);
        })
        .await
        .unwrap();
    assert!(matches!(started, fleet_store::Transition::Done(_)), "{started:?}");
    // The jobs it runs, with heartbeats as old (a store that took none of the worker's writes for that long).
    for id in &running {
        let job_id: JobId = id.parse().unwrap();
        c.store
            .update_job(USER, &job_id, |r| {
                r.last_heartbeat_ms = Some(silent_since);
                true
            })
            .await
            .unwrap()
            .expect("running");
    }

    let (_, lost, _) = fleet::sweeper::sweep(&c.fronts[0].0).await;
    assert_eq!(lost, 1, "exactly the job its worker does not run is lost");
    let failed = get_job(&c, USER, &stray).await;
    assert_eq!(failed["state"], "failed", "{failed}");
    assert_eq!(failed["error"]["code"], "executa_unavailable", "{failed}");
    assert_eq!(failed["error"]["details"]["reason"], "worker_lost", "{failed}");
    assert_eq!(failed["error"]["details"]["retriable"], true, "{failed}");
    for id in &running {
        let job = get_job(&c, USER, id).await;
        assert_eq!(job["state"], "running", "{job}");
        cancel_job(&c, USER, id).await;
    }
    c.shutdown().await;
}

/// A front replica started to replace a dead one must serve as soon as `Front::serve` returned. Its endpoint
/// subscriptions are only written to its own connection: nothing waits for the server to have processed them (the
/// `client.flush()` being added to `serve` writes the socket, async-nats' flush is no server round trip), so a
/// request sent at once from another connection sometimes gets "no responders". A hundred replacements in a row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replacement_front_serves_as_soon_as_serve_returns() {
    let mut c = start("crash-repl", 1, 0).await;
    let auth = format!("Bearer {}", c.token(USER));
    let mut refused = Vec::new();
    for round in 0..100 {
        let (_, service) = c.fronts.remove(0);
        service.stop().await;
        c.add_front().await;
        let outcome = request(&c.app, &auth, methods::TOOLS_LIST_JOBS, &json!({})).await;
        if !matches!(outcome, Outcome::Ok(_)) {
            refused.push(format!("round {round}: {outcome:?}"));
        }
    }
    assert!(refused.is_empty(), "{refused:#?}");
    c.shutdown().await;
}

/// A worker killed with `-9` and restarted under the same `--worker-id` before its registry entry expired (what a
/// supervisor does, and what the README recommends so the new process sweeps the old one's cgroups): the job the
/// dead process was running must still end (`worker_lost`, retriable) instead of staying `running` — holding one
/// of the user's five slots — until its deadline (30 min by default).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_of_a_worker_restarted_under_the_same_id_is_not_stranded() {
    let c = start("crash-same", 1, 0).await;
    let _sweeper = Bg::sweeper(&c);
    let mut w = WorkerProc::spawn(&c, "crash-same").await;
    let id = submit(&c, USER, "sleep", json!({ "ms": 600_000 })).await;
    wait_job(&c, USER, &id, "running", |j| j["state"] == "running").await;

    w.kill9();
    w.restart(&c).await;
    let job = wait_job(&c, USER, &id, "terminal", is_terminal).await;
    assert_eq!(job["state"], "failed", "{job}");
    assert_eq!(job["error"]["details"]["reason"], "worker_lost", "{job}");
    let (rec, _) = record(&c, USER, &id).await;
    assert_eq!(rec.attempt, 1);
    assert!(w.terminate().await.success());
    c.shutdown().await;
}
