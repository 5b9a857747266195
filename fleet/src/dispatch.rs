//! Choosing a worker and talking to it: rendezvous hashing of (user, plugin) over the live workers (affinity
//! without a coordinator: a user's calls to a plugin go to the worker that has it warm while that worker lives
//! and has room; a new or dead worker moves only its share), and the request/reply to the chosen worker.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fleet_client::nats_conn;
use fleet_proto::api::worker::{
    CancelCommand, ExecKind, ExecReply, ExecRequest, JOBS_HELD_QUERY_MAX, JobsHeld, JobsHeldQuery,
};
use fleet_proto::api::{ApiError, ApiErrorCode, JobId, subjects};
use sha2::{Digest, Sha256};
use tracing::Instrument as _;

use crate::membership::Membership;
use crate::nats_auth::exec_seal::ExecSigner;
use fleet_store::{Store, WorkerInfo};

/// How long the registry's last read is reused while the membership watch has not read it yet.
const REGISTRY_CACHE: Duration = Duration::from_millis(500);

/// How long a sync call that finds no worker able to take it (none registered, or every one draining or gone)
/// waits for membership to change before it answers `agent_unavailable` — bounded further by the call's own
/// timeout (the default of [`FrontConfig::no_worker_wait`](crate::front::FrontConfig::no_worker_wait)). A rolling restart replaces a worker within this (a new worker registers before it takes work).
pub const NO_WORKER_WAIT: Duration = Duration::from_secs(5);

/// How long a sync call waits before it asks again a registered worker whose exec subject had no subscriber (a
/// worker whose NATS connection is failing over to another server; nothing ran, so asking again is safe).
const NO_RESPONDERS_PAUSE: Duration = Duration::from_millis(100);

/// How long a worker may take to accept (or refuse) a job.
const JOB_ACCEPT_TIMEOUT: Duration = Duration::from_secs(10);

/// The rendezvous score of a worker for a key: the first 8 bytes of sha256(worker ‖ 0 ‖ key).
fn score(worker: &str, key: &str) -> u64 {
    let mut h = Sha256::new();
    h.update(worker.as_bytes());
    h.update([0]);
    h.update(key.as_bytes());
    let d = h.finalize();
    u64::from_be_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]])
}

/// Worker ids ranked for `key` (highest score first).
pub fn rank<'a>(workers: impl IntoIterator<Item = &'a str>, key: &str) -> Vec<String> {
    let mut v: Vec<(u64, &str)> = workers.into_iter().map(|w| (score(w, key), w)).collect();
    v.sort_by(|a, b| b.cmp(a));
    v.into_iter().map(|(_, w)| w.to_string()).collect()
}

/// Routes executions to workers.
#[derive(Debug)]
pub struct Dispatcher {
    client: async_nats::Client,
    store: Store,
    /// The registry, pushed by a KV watch.
    membership: Membership,
    /// The last direct read, used only until the watch has read the registry.
    cache: Mutex<Option<(Instant, Vec<Arc<WorkerInfo>>)>>,
    /// See [`NO_WORKER_WAIT`].
    no_worker_wait: Duration,
    /// Seals every exec request and cancel command (workers serve nothing else).
    seals: Arc<ExecSigner>,
    /// Exec requests ask the worker for keepalives: the subscription of their answers, made at the first.
    requester: tokio::sync::OnceCell<nats_conn::Requester>,
}

impl Dispatcher {
    /// A dispatcher over the registry in `store`, sealing what it sends with `seals`.
    pub fn new(client: async_nats::Client, store: Store, seals: Arc<ExecSigner>) -> Dispatcher {
        Dispatcher {
            client,
            membership: Membership::follow(store.clone()),
            store,
            cache: Mutex::new(None),
            no_worker_wait: NO_WORKER_WAIT,
            seals,
            requester: tokio::sync::OnceCell::new(),
        }
    }

    /// The front's exec key: it seals job records too, and checks their seals before a sweeper dispatches one.
    pub fn seals(&self) -> &ExecSigner {
        &self.seals
    }

    /// How long a sync call that finds no worker waits for one (default [`NO_WORKER_WAIT`]).
    pub fn with_no_worker_wait(mut self, wait: Duration) -> Dispatcher {
        self.no_worker_wait = wait;
        self
    }

    /// The live workers to dispatch to, as the membership watch sees them (pushed, no read per call); read from
    /// the registry while the watch does not know (not read yet, or broken); empty when neither answers.
    pub async fn live(&self) -> Vec<Arc<WorkerInfo>> {
        if let Some(list) = self.membership.snapshot() {
            return list;
        }
        self.registry().await.unwrap_or_default()
    }

    /// The live workers read from the registry itself (cached for half a second), or `None` when it cannot be
    /// read right now, so callers never mistake a JetStream hiccup for dead workers. This is what destructive
    /// decisions (the sweeper failing a lost worker's jobs) rest on: a watch that went quiet is not evidence.
    pub async fn registry(&self) -> Option<Vec<Arc<WorkerInfo>>> {
        if let Some((at, list)) = self
            .cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            && at.elapsed() < REGISTRY_CACHE
        {
            return Some(list.clone());
        }
        match self.store.live_workers().await {
            Ok(list) => {
                let list: Vec<Arc<WorkerInfo>> = list.into_iter().map(Arc::new).collect();
                *self
                    .cache
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) =
                    Some((Instant::now(), list.clone()));
                Some(list)
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the worker registry");
                None
            }
        }
    }

    /// The exec-seal session key of `worker` as the membership watch last saw it (`None`: sealed with the
    /// Ed25519 signature, which every worker accepts).
    fn seal_key(&self, worker: &str) -> Option<String> {
        self.membership.seal_key(worker)
    }

    /// Whether a worker is registered (heartbeat not expired); `None` when the registry cannot be read.
    pub async fn is_live(&self, worker_id: &str) -> Option<bool> {
        self.registry().await.map(|l| l.iter().any(|w| w.id == worker_id))
    }

    async fn ranked(&self, user: &str, plugin: &str) -> Vec<String> {
        let live = self.live().await;
        rank(
            live.iter().map(|w| w.id.as_str()),
            &format!("{}\u{0}{plugin}", fleet_proto::api::user_key(user)),
        )
    }

    async fn request(
        &self,
        worker: &str,
        req: &ExecRequest,
        wait: Duration,
    ) -> Result<ExecReply, RequestFailure> {
        let payload = serde_json::to_vec(req).map_err(|e| RequestFailure::Other(e.to_string()))?;
        let subject = subjects::worker_exec(worker);
        // The client span of this request; its context travels in the message headers (W3C `traceparent`), so
        // the worker's `worker.exec` span is its child.
        let span = tracing::info_span!(
            "worker.request",
            otel.kind = "client",
            messaging.system = "nats",
            messaging.destination.name = %subject,
            fleet.worker = %worker,
        );
        let mut headers = crate::telemetry::headers(&span).unwrap_or_default();
        self.seals
            .seal_for(self.seal_key(worker).as_deref(), &subject, &payload, &mut headers);
        let requester = self
            .requester
            .get_or_try_init(|| nats_conn::Requester::new(&self.client))
            .await
            .map_err(|e| RequestFailure::Other(format!("cannot subscribe the workers' answers: {e}")))?;
        // The worker says every second that it still runs the call; an answer (or the request) lost with a NATS
        // server is noticed after `KEEPALIVE_SILENCE`, not at the call's timeout.
        match requester
            .request(subject, headers, payload.into(), wait)
            .instrument(span)
            .await
        {
            Ok(msg) => serde_json::from_slice(&msg.payload).map_err(|e| RequestFailure::Other(e.to_string())),
            Err(nats_conn::RequestError::LostInReconnect | nats_conn::RequestError::Silent) => {
                Err(RequestFailure::Lost)
            }
            Err(nats_conn::RequestError::Nats(e)) => Err(match e.kind() {
                async_nats::client::RequestErrorKind::NoResponders => RequestFailure::NoResponders,
                async_nats::client::RequestErrorKind::TimedOut => RequestFailure::TimedOut,
                _ => RequestFailure::Other(e.to_string()),
            }),
        }
    }

    /// A synchronous invoke: the first ranked worker that answers runs it. A worker that refuses for capacity is
    /// skipped; one that is registered but has no subscriber (gone, or failing over to another NATS server) is
    /// asked again every [`NO_RESPONDERS_PAUSE`] until [`NO_WORKER_WAIT`]; a timeout is final (the invoke may have
    /// run), and so is an answer lost with the front's own connection.
    pub async fn sync(&self, req: &ExecRequest, wait: Duration) -> Result<(String, ExecReply), ApiError> {
        let span = dispatch_span(req);
        let result = self.sync_inner(req, wait).instrument(span.clone()).await;
        record_dispatch(&span, result.as_ref().map(|(w, _)| w.as_str()));
        result
    }

    async fn sync_inner(&self, req: &ExecRequest, wait: Duration) -> Result<(String, ExecReply), ApiError> {
        let started = Instant::now();
        let deadline = started + wait;
        let give_up = started + self.no_worker_wait.min(wait);
        let mut changes = self.membership.changes();
        let mut tried: HashSet<String> = HashSet::new();
        loop {
            changes.mark_unchanged();
            // Whether a worker was gone or draining (membership is changing), as opposed to every live worker
            // refusing for capacity, which is answered at once.
            let mut churn = false;
            // Whether a registered worker had no subscriber: it is asked again after a pause.
            let mut unheard = false;
            let ranked = self.ranked(&req.user, &req.plugin).await;
            if ranked.is_empty() {
                churn = true;
            }
            for worker in ranked {
                if !tried.insert(worker.clone()) {
                    continue;
                }
                let remaining = deadline.saturating_duration_since(Instant::now());
                if remaining.is_zero() {
                    return Err(timed_out(wait));
                }
                match self.request(&worker, req, remaining).await {
                    Ok(reply) if reply.draining => churn = true,
                    Ok(reply) if reply.passes_to_next_worker() => {}
                    Ok(reply) => return Ok((worker, reply)),
                    Err(RequestFailure::NoResponders) => {
                        churn = true;
                        unheard = true;
                        tried.remove(&worker);
                    }
                    Err(RequestFailure::TimedOut) => return Err(timed_out(wait)),
                    Err(RequestFailure::Lost) => return Err(lost()),
                    Err(RequestFailure::Other(e)) => {
                        return Err(ApiError::new(ApiErrorCode::AgentUnavailable, e));
                    }
                }
            }
            let until = give_up.min(deadline);
            if !churn || Instant::now() >= until {
                break;
            }
            if unheard {
                // A worker between two connections: ask it again soon (or earlier, on a membership change).
                let pause = until.min(Instant::now() + NO_RESPONDERS_PAUSE);
                let _ = tokio::time::timeout_at(pause.into(), changes.changed()).await;
                continue;
            }
            // Wait for a worker to register (or any other change), then try the ones not tried yet.
            if tokio::time::timeout_at(until.into(), changes.changed())
                .await
                .is_err()
            {
                break;
            }
        }
        Err(ApiError::new(
            ApiErrorCode::AgentUnavailable,
            "no worker can take the call",
        ))
    }

    /// Hands a job to the first ranked worker that accepts it. `long_job_capacity` when every live worker is
    /// full, `agent_unavailable` when there is none.
    pub async fn job(&self, req: &ExecRequest) -> Result<String, ApiError> {
        let span = dispatch_span(req);
        let result = self.job_inner(req).instrument(span.clone()).await;
        record_dispatch(&span, result.as_deref());
        result
    }

    async fn job_inner(&self, req: &ExecRequest) -> Result<String, ApiError> {
        let mut full = false;
        // Workers whose last heartbeat reported every long-job slot taken are skipped without a round trip.
        let busy: Vec<String> = self
            .live()
            .await
            .into_iter()
            .filter(|w| w.long_jobs_running >= w.capacity_long_jobs)
            .map(|w| w.id.clone())
            .collect();
        for worker in self.ranked(&req.user, &req.plugin).await {
            if busy.contains(&worker) {
                full = true;
                continue;
            }
            match self.request(&worker, req, JOB_ACCEPT_TIMEOUT).await {
                Ok(reply) if reply.success => return Ok(worker),
                Ok(reply) if reply.draining => {}
                Ok(reply) => match reply.error {
                    Some(e) if e.code == ApiErrorCode::LongJobCapacity => full = true,
                    Some(e) if e.code == ApiErrorCode::AgentUnavailable => {}
                    Some(e) => return Err(e),
                    None => {}
                },
                Err(RequestFailure::NoResponders | RequestFailure::TimedOut | RequestFailure::Lost) => {}
                Err(RequestFailure::Other(e)) => {
                    return Err(ApiError::new(ApiErrorCode::AgentUnavailable, e));
                }
            }
        }
        Err(if full {
            ApiError::with_details(
                ApiErrorCode::LongJobCapacity,
                "every worker runs its maximum of long jobs; retry later",
                serde_json::json!({ "retriable": true }),
            )
        } else {
            ApiError::new(ApiErrorCode::AgentUnavailable, "no worker can take the job")
        })
    }

    /// Best-effort cancel of an invoke on `worker` (or on every live worker when unknown).
    pub async fn cancel(&self, worker: Option<&str>, invoke_id: &str) {
        let Ok(payload) = serde_json::to_vec(&CancelCommand::new(invoke_id)) else {
            return;
        };
        let targets: Vec<String> = match worker {
            Some(w) => vec![w.to_string()],
            None => self.live().await.iter().map(|w| w.id.clone()).collect(),
        };
        let trace = crate::telemetry::headers(&tracing::Span::current()).unwrap_or_default();
        for w in targets {
            let subject = subjects::worker_cancel(&w);
            let mut headers = trace.clone();
            self.seals
                .seal_for(self.seal_key(&w).as_deref(), &subject, &payload, &mut headers);
            let _ = self
                .client
                .publish_with_headers(subject, headers, payload.clone().into())
                .await;
        }
        let _ = fleet_client::nats_conn::flush(&self.client).await;
    }
}

impl Dispatcher {
    /// Which of `job_ids` (running jobs recorded as started by `worker`; at most
    /// [`JOBS_HELD_QUERY_MAX`] are asked about) `worker` still starts or runs, by its own account; `None` when it
    /// does not answer within `wait` (gone, failing over, or busy: nothing can be concluded).
    pub async fn jobs_held(&self, worker: &str, job_ids: &[JobId], wait: Duration) -> Option<HashSet<JobId>> {
        let query = JobsHeldQuery {
            job_ids: job_ids.iter().take(JOBS_HELD_QUERY_MAX).cloned().collect(),
        };
        let payload = serde_json::to_vec(&query).ok()?;
        let subject = subjects::worker_jobs(worker);
        let mut headers = async_nats::HeaderMap::new();
        self.seals
            .seal_for(self.seal_key(worker).as_deref(), &subject, &payload, &mut headers);
        let answer = tokio::time::timeout(
            wait,
            self.client.request_with_headers(subject, headers, payload.into()),
        )
        .await
        .ok()?
        .ok()?;
        let held: JobsHeld = serde_json::from_slice(&answer.payload).ok()?;
        Some(held.held.into_iter().collect())
    }
}

/// The exec request that runs the job of `record` (a job's arguments, deadline and timeout are its record's).
pub fn job_request(record: &fleet_store::JobRecord) -> ExecRequest {
    ExecRequest {
        kind: ExecKind::Job,
        user: record.user.clone(),
        tool_id: record.tool_id.clone(),
        plugin: record.plugin.clone(),
        tool: record.tool.clone(),
        arguments: fleet_proto::api::RawArgs::from_map(&record.args),
        invoke_id: record.job_id.to_string(),
        timeout_ms: Some(record.timeout_ms),
        default_timeout_ms: record.timeout_ms,
        max_timeout_ms: record.timeout_ms,
        deadline_ms: Some(record.deadline_ms),
        job_id: Some(record.job_id.clone()),
        requested_timeout_ms: None,
        reply_to: None,
        delegation: None,
    }
}

/// The `job.dispatch` span: choosing a worker and handing it a sync invoke or a job.
fn dispatch_span(req: &ExecRequest) -> tracing::Span {
    tracing::info_span!(
        "job.dispatch",
        fleet.exec.kind = match req.kind {
            ExecKind::Sync => "sync",
            ExecKind::Job => "job",
        },
        gen_ai.tool.name = %req.tool,
        executa.tool_id = %req.plugin,
        executa.invoke_id = %req.invoke_id,
        fleet.worker = tracing::field::Empty,
        fleet.outcome = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    )
}

fn record_dispatch(span: &tracing::Span, result: Result<&str, &ApiError>) {
    match result {
        Ok(worker) => {
            span.record("fleet.worker", worker);
            span.record("fleet.outcome", "dispatched");
        }
        Err(e) => {
            span.record("fleet.outcome", e.code.as_str());
            span.record("otel.status_code", "ERROR");
        }
    }
}

/// The answer to a sync call whose worker did not answer within the call's timeout (it may have run).
fn timed_out(wait: Duration) -> ApiError {
    ApiError::new(ApiErrorCode::ToolTimeout, format!("no answer within {wait:?}"))
}

/// The answer to a sync call whose request or answer was lost with a NATS server (nothing heard from the worker
/// for `KEEPALIVE_SILENCE`): it may have run, so it is not sent again; the caller may retry.
fn lost() -> ApiError {
    ApiError::with_details(
        ApiErrorCode::AgentUnavailable,
        format!(
            "the call or the worker's answer was lost with a NATS server (nothing heard from the worker for {} ms): \
             the call's outcome is unknown",
            fleet_proto::api::subjects::KEEPALIVE_SILENCE.as_millis()
        ),
        serde_json::json!({ "retriable": true }),
    )
}

enum RequestFailure {
    NoResponders,
    TimedOut,
    /// Nothing was heard from the worker for `KEEPALIVE_SILENCE`: the request or its answer was lost.
    Lost,
    Other(String),
}

#[cfg(test)]
mod tests {
    use super::rank;

    #[test]
    fn rendezvous_moves_only_the_share_of_a_departed_worker() {
        let workers = ["w1", "w2", "w3", "w4"];
        let keys: Vec<String> = (0..400).map(|i| format!("user{i}\u{0}plugin")).collect();
        let before: Vec<String> = keys.iter().map(|k| rank(workers, k)[0].clone()).collect();
        let after: Vec<String> = keys
            .iter()
            .map(|k| rank(["w1", "w2", "w4"], k)[0].clone())
            .collect();
        for (b, a) in before.iter().zip(&after) {
            if b != "w3" {
                assert_eq!(a, b, "keys of surviving workers stay put");
            }
        }
        let share = before.iter().filter(|w| *w == "w3").count();
        assert!(share > 50 && share < 150, "roughly a quarter each: {share}");
        // Deterministic.
        assert_eq!(rank(workers, "k"), rank(workers, "k"));
    }
}
