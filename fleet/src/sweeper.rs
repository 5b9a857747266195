//! The sweeper, run by every front replica (idempotent through compare-and-set, no leader): expires jobs past
//! their deadline (and cancels their execution wherever it runs), fails running jobs whose heartbeat stopped for
//! longer than the worker TTL once the registry no longer lists the worker that started them, or that worker
//! says it no longer runs them (`executa_unavailable`, retriable, `details.reason = "worker_lost"`; a draining
//! worker keeps its jobs' heartbeats, so a rolling restart fails none), and dispatches queued jobs
//! nobody took — within each user's agent slots (`MAX_LONG_JOBS_PER_AGENT`), interleaving users (round robin by
//! user, not FIFO over everyone). Normally the job queue starts a queued job first; this is the safety net. A
//! queued job whose record's seal does not verify is failed, never dispatched (`JobSteps::fail_unsealed`).
//!
//! Bounds: a job is terminal at most one sweep period (1 s) after its deadline while any front runs; a job whose
//! worker died is failed within the worker TTL (10 s) after the later of its last heartbeat and the worker's last
//! registry refresh (each at most `HEARTBEAT_EVERY`, 2 s, before the death), plus the registry read's cache
//! (500 ms) and one sweep period.

use std::collections::BTreeMap;
use std::time::Duration;

use fleet_proto::api::{ApiError, ApiErrorCode, JobState};
use serde_json::json;
use tracing::Instrument as _;

use crate::front::Front;
use crate::job_steps::Decider;
use fleet_proto::api::worker::JOBS_HELD_QUERY_MAX;
use fleet_proto::util::now_ms;
use fleet_store::{JobRecord, Transition};

/// How often a sweep runs.
pub const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// A queued job dispatched this long ago and still not running is dispatched again.
const REDISPATCH_AFTER_MS: u64 = 10_000;

/// One sweep; returns (expired, lost, dispatched).
pub async fn sweep(front: &Front) -> (usize, usize, usize) {
    let store = front.store();
    let metrics = front.metrics();
    let Ok(jobs) = store.active_jobs().await else {
        metrics.jetstream_error("active_jobs");
        return (0, 0, 0);
    };
    let mut per_user: BTreeMap<&str, usize> = BTreeMap::new();
    for j in &jobs {
        *per_user.entry(j.value.user.as_str()).or_default() += 1;
    }
    let running = jobs.iter().filter(|j| j.value.state == JobState::Running).count();
    metrics.active_jobs(per_user.into_values(), jobs.len() - running, running);
    let now = now_ms();
    let (mut expired, mut lost_jobs) = (0, 0);
    let mut waiting: BTreeMap<String, Vec<JobRecord>> = BTreeMap::new();
    let mut silent: Vec<JobRecord> = Vec::new();
    // Each job's place among its user's active jobs (the records come in active-set order): only the first
    // `MAX_LONG_JOBS_PER_AGENT` may be dispatched.
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for job in jobs {
        let r = job.value;
        let position = {
            let n = seen.entry(r.user.clone()).or_default();
            *n += 1;
            *n - 1
        };
        if now >= r.deadline_ms {
            let span = tracing::info_span!(
                "job.expire",
                fleet.job_id = %r.job_id,
                executa.tool_id = %r.plugin,
                fleet.job.from_state = r.state.as_str(),
                fleet.job.expired = tracing::field::Empty,
            );
            let done = async {
                let outcome = front
                    .steps()
                    .step(&r.user, &r.job_id, JobState::Expired, Decider::Other, |rec| {
                        rec.finished_at_ms = Some(now_ms());
                        rec.error = Some(ApiError::new(
                            ApiErrorCode::ToolTimeout,
                            "the job's deadline passed",
                        ));
                    })
                    .await;
                tracing::Span::current()
                    .record("fleet.job.expired", matches!(outcome, Ok(Transition::Done(_))));
                let Ok(Transition::Done(done)) = outcome else {
                    return false;
                };
                front
                    .dispatcher()
                    .cancel(done.value.worker.as_deref(), r.job_id.as_str())
                    .await;
                true
            }
            .instrument(span)
            .await;
            if done {
                expired += 1;
            }
            continue;
        }
        match r.state {
            JobState::Running => {
                // Silent: the job's own heartbeat (refreshed every HEARTBEAT_EVERY, 2 s, by the worker running
                // it, also while that worker drains) is older than the registry TTL. Whether it is lost is decided
                // below, per worker.
                let ttl_ms = u64::try_from(store.settings().worker_ttl.as_millis()).unwrap_or(u64::MAX);
                let last_sign_of_life = r.last_heartbeat_ms.unwrap_or(r.updated_at_ms);
                if now.saturating_sub(last_sign_of_life) > ttl_ms {
                    silent.push(r);
                }
            }
            JobState::Queued => {
                let stale = match &r.worker {
                    None => true,
                    Some(w) => {
                        front.dispatcher().is_live(w).await == Some(false)
                            || now.saturating_sub(r.updated_at_ms) > REDISPATCH_AFTER_MS
                    }
                };
                if stale && fleet_store::may_run(position) {
                    waiting.entry(r.user.clone()).or_default().push(r);
                }
            }
            _ => {}
        }
    }
    for (job, why) in lost(front, silent).await {
        let outcome = front
            .steps()
            .step(&job.user, &job.job_id, JobState::Failed, Decider::Other, |rec| {
                rec.finished_at_ms = Some(now_ms());
                rec.error = Some(ApiError::with_details(
                    ApiErrorCode::ExecutaUnavailable,
                    why,
                    json!({ "reason": "worker_lost", "retriable": true, "worker": rec.worker }),
                ));
            })
            .await;
        if let Ok(Transition::Done(_)) = outcome {
            lost_jobs += 1;
            metrics.job_worker_lost();
        }
    }
    // Round robin across users, oldest first within a user.
    for jobs in waiting.values_mut() {
        jobs.sort_by_key(|j| std::cmp::Reverse(j.created_at_ms));
    }
    let mut dispatched = 0;
    loop {
        let mut any = false;
        for jobs in waiting.values_mut() {
            if let Some(job) = jobs.pop() {
                any = true;
                // Only what a front sealed is dispatched: the record came from KV, which workers may write.
                if let Err(why) = front.dispatcher().seals().verify_job(&job) {
                    front.steps().fail_unsealed(&job, why, "sweeper").await;
                    continue;
                }
                if matches!(front.dispatch_job(&job).await, Ok(true)) {
                    dispatched += 1;
                }
            }
        }
        if !any {
            break;
        }
    }
    (expired, lost_jobs, dispatched)
}

/// Runs sweeps forever.
pub async fn run(front: Front) {
    let mut tick = tokio::time::interval(SWEEP_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        sweep(&front).await;
    }
}

/// Which of the `silent` running jobs (heartbeat older than the registry TTL) are lost, and why:
/// * the registry no longer lists the incarnation of the worker that started it (its id, started no later than
///   the job) — it died (its entry expired: the worker TTL after its last refresh, which may be later than the
///   job's last heartbeat), or restarted under the same id. A registry that cannot be read says nothing, and the
///   heartbeat alone decides;
/// * that worker is listed but, asked ([`Dispatcher::jobs_held`](crate::dispatch::Dispatcher::jobs_held)), says
///   it does not hold the job: its start or its outcome never completed there. A listed worker that does not
///   answer keeps its jobs: a heartbeat is late when the store cannot take writes for a while (a NATS node lost),
///   and the worker's own answer is the only evidence that tells the two apart.
///
/// A draining worker leaves the registry at once but keeps its jobs' heartbeats, so a rolling restart fails none.
async fn lost(front: &Front, silent: Vec<JobRecord>) -> Vec<(JobRecord, &'static str)> {
    if silent.is_empty() {
        return Vec::new();
    }
    let listed = front.dispatcher().registry().await;
    let mut out = Vec::new();
    let mut ask: BTreeMap<String, Vec<JobRecord>> = BTreeMap::new();
    for job in silent {
        let started = job.started_at_ms.unwrap_or(u64::MAX);
        let by_listed = match (&job.worker, &listed) {
            (Some(worker), Some(listed)) => listed
                .iter()
                .any(|w| w.id == *worker && w.started_at_ms <= started),
            _ => false,
        };
        match (&job.worker, by_listed) {
            (Some(worker), true) => ask.entry(worker.clone()).or_default().push(job),
            _ => out.push((job, "the worker running the job is gone")),
        }
    }
    for (worker, jobs) in ask {
        for batch in jobs.chunks(JOBS_HELD_QUERY_MAX) {
            let ids: Vec<_> = batch.iter().map(|j| j.job_id.clone()).collect();
            let Some(held) = front.dispatcher().jobs_held(&worker, &ids, SWEEP_EVERY).await else {
                continue;
            };
            out.extend(
                batch
                    .iter()
                    .filter(|j| !held.contains(&j.job_id))
                    .map(|j| (j.clone(), "the worker that started the job no longer runs it")),
            );
        }
    }
    out
}
