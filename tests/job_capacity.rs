//! Async concurrency (the job-path issue): a worker runs as many long jobs as its capacity
//! (`WorkerConfig::job_capacity`), each user at most `MAX_LONG_JOBS_PER_AGENT` at once fleet-wide (spec §12.2
//! HR-NT-06: per agent identity, here the user), and a queued job starts the moment a slot frees — through the
//! job queue the workers pull from, not at a sweeper tick (these clusters run no sweeper at all).
//!
//! Every wait polls an observable (a job record in JetStream) under a failure guard; no test asserts on elapsed
//! time.

// Test code: helpers panic on purpose when the system under test misbehaves.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use fleet_e2e::cluster::Cluster;
use fleet_e2e::worker::Plugin;
use fleet_proto::api::{JobId, JobState, methods};
use fleet_proto::limits::{MAX_ACTIVE_JOBS_PER_USER, MAX_LONG_JOBS_PER_AGENT};
use fleet_store::JobRecord;
use serde_json::{Value, json};

/// Failure guard of every wait.
const GUARD: Duration = Duration::from_secs(30);

/// A job that runs until it is cancelled (its deadline, 60 s at least, is never reached by these tests).
fn sleeper() -> Value {
    json!({"tool_id": "echo.sleep", "args": {"ms": 600_000}})
}

async fn start(name: &str) -> Cluster {
    let c = Cluster::start(name, 1, 0, &[Plugin::echo("echo", &[])]).await;
    c.wait_for_api(GUARD).await;
    c
}

async fn create_job(c: &Cluster, user: &str) -> JobId {
    let res = c.ok(user, methods::TOOLS_INVOKE_ASYNC, sleeper()).await;
    assert_eq!(res["state"], "queued", "{res}");
    res["jobId"].as_str().expect("jobId").parse().expect("a tjob_ id")
}

async fn cancel(c: &Cluster, user: &str, id: &JobId) {
    let res = c
        .ok(user, methods::TOOLS_CANCEL_JOB, json!({ "jobId": id }))
        .await;
    assert_eq!(res["state"], "cancelled", "{res}");
}

async fn record(c: &Cluster, user: &str, id: &JobId) -> JobRecord {
    c.store
        .get_job(user, id)
        .await
        .expect("store read")
        .expect("the job exists")
        .value
}

fn worker_id(c: &Cluster, i: usize) -> &str {
    c.workers[i].node.as_ref().expect("a running worker").id()
}

async fn wait_state(c: &Cluster, user: &str, id: &JobId, state: JobState) -> JobRecord {
    let deadline = Instant::now() + GUARD;
    loop {
        let r = record(c, user, id).await;
        if r.state == state {
            return r;
        }
        assert!(
            Instant::now() < deadline,
            "job {id} of {user} never became {state} (it is {})",
            r.state
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The agent's long-job slots: of one user's five active jobs the first three run; the fourth starts the moment
/// one of them ends, the fifth when another does — while another user's job on the same worker runs throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_users_jobs_beyond_its_three_agent_slots_wait_and_start_as_earlier_ones_end() {
    let mut c = start("cap-agent").await;
    c.add_worker().await;
    let u = "agent-user";
    let mut jobs = Vec::new();
    for _ in 0..MAX_ACTIVE_JOBS_PER_USER {
        jobs.push(create_job(&c, u).await);
    }
    let (slots, waiting) = jobs.split_at(MAX_LONG_JOBS_PER_AGENT);
    for id in slots {
        wait_state(&c, u, id, JobState::Running).await;
    }
    // With the three running, the others are still queued: nothing on the worker's side took them.
    for id in waiting {
        assert_eq!(record(&c, u, id).await.state, JobState::Queued, "{id}");
    }
    let other = create_job(&c, "someone-else").await;
    wait_state(&c, "someone-else", &other, JobState::Running).await;

    cancel(&c, u, &slots[0]).await;
    wait_state(&c, u, &waiting[0], JobState::Running).await;
    assert_eq!(record(&c, u, &waiting[1]).await.state, JobState::Queued);
    cancel(&c, u, &slots[1]).await;
    wait_state(&c, u, &waiting[1], JobState::Running).await;
    assert_eq!(record(&c, "someone-else", &other).await.state, JobState::Running);
    c.shutdown().await;
}

/// Worker capacity: a worker with room for two runs two users' jobs; a third user's job waits queued (in the job
/// queue: no worker had room) and starts on that worker the moment one of the two ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_worker_starts_a_queued_job_the_moment_a_slot_frees() {
    const CAPACITY: usize = 2;
    let mut c = start("cap-worker").await;
    let w = c
        .add_worker_with("cap-worker-w0", |w| w.job_capacity = CAPACITY)
        .await;
    let users: Vec<String> = (0..=CAPACITY).map(|i| format!("cap-user-{i}")).collect();
    let mut jobs = Vec::new();
    for u in &users[..CAPACITY] {
        let id = create_job(&c, u).await;
        wait_state(&c, u, &id, JobState::Running).await;
        jobs.push(id);
    }
    let last = &users[CAPACITY];
    let queued = create_job(&c, last).await;
    assert_eq!(record(&c, last, &queued).await.state, JobState::Queued);

    cancel(&c, &users[0], &jobs[0]).await;
    let started = wait_state(&c, last, &queued, JobState::Running).await;
    assert_eq!(started.worker.as_deref(), Some(worker_id(&c, w)));
    c.shutdown().await;
}

/// The job queue serves every worker: a job queued while the only worker is full starts on a worker that joins
/// later, as soon as it is up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_job_starts_on_a_worker_that_joins_later() {
    let mut c = start("cap-join").await;
    c.add_worker_with("cap-join-w0", |w| w.job_capacity = 1).await;
    let first = create_job(&c, "join-a").await;
    wait_state(&c, "join-a", &first, JobState::Running).await;
    let queued = create_job(&c, "join-b").await;
    assert_eq!(record(&c, "join-b", &queued).await.state, JobState::Queued);
    let w1 = c.add_worker_with("cap-join-w1", |w| w.job_capacity = 1).await;
    let started = wait_state(&c, "join-b", &queued, JobState::Running).await;
    assert_eq!(started.worker.as_deref(), Some(worker_id(&c, w1)));
    c.shutdown().await;
}
