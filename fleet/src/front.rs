//! The front: the app-facing API over NATS (`fleet.v1.api.tools.*`, async-nats `service`, so
//! `$SRV.PING|INFO|STATS` work). Every request is authenticated (JWT in the `Authorization` header, `sub` = the
//! user), rate-limited per user, validated, and answered with `{ok, result}` / `{ok: false, error}`. Stateless:
//! every fact lives in JetStream (`store`), so any replica serves any request.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fleet_proto::api::delegation;
use fleet_proto::api::worker::{ExecKind, ExecRequest};
use fleet_proto::api::{
    ApiError, ApiErrorCode, ApiResponse, CancelJobArgs, CancelJobResult, GetJobArgs, InvokeAsyncArgs,
    InvokeAsyncResult, JobId, JobState, ListJobsArgs, ListJobsResult, ListToolsResult, RawInvokeArgs,
    ToolInfo, methods, parse_args, parse_body, subjects,
};
use fleet_proto::limits::{
    GET_JOB_LIMIT_MAX, INVOKE_TIMEOUT_MAX_MS, JOB_RETENTION, LIST_JOBS_LIMIT_DEFAULT,
    MAX_ACTIVE_JOBS_PER_USER,
};
use futures::StreamExt as _;
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use serde_json::{Value, json};
use tracing::Instrument as _;

use crate::delegation::{Delegated, DelegationError, Delegations, JobDelegation, JobDelegations};
use crate::dispatch::Dispatcher;
use crate::in_flight::InFlight;
use crate::job_steps::{Decider, JobSteps};
use crate::known_plugins::KnownPlugins;
use crate::metrics::FleetMetrics;
use crate::nats_auth::exec_seal::ExecSigner;
use crate::node::new_invoke_id;
use crate::policy::{self, SyncTimeout};
use fleet_client::auth::Verifier;
use fleet_proto::app_manifest::list_admits;
use fleet_proto::util::now_ms;
use fleet_services::agent::LLM_AGENT_AUTO;
use fleet_services::grants::GrantStore;
use fleet_store::{JobFilter, JobRecord, ListCursor, Store, StoreError, Transition};

use crate::finished::FinishedJobs;

/// Front settings.
#[derive(Debug, Clone)]
pub struct FrontConfig {
    /// Active (queued + running) jobs per user (spec §10.4: 5).
    pub max_active_jobs: usize,
    /// Requests per second per user (token bucket refill) at admission.
    pub rate_per_user: u32,
    /// Burst per user.
    pub burst_per_user: u32,
    /// How long a sync call that finds no worker waits for one to register (bounded by the call's timeout).
    pub no_worker_wait: Duration,
    /// API requests of one user this front handles at once; one more is `rate_limited` at once.
    pub max_in_flight_per_user: usize,
    /// Bytes of one API request's arguments (its whole payload: a sync `tools.invoke`'s `args` and envelope)
    /// this front reads; a larger request is `invalid_arg` with reason `args_too_large` before it is parsed.
    pub max_args_bytes: usize,
    /// Bytes of API requests of one user this front holds at once (their payloads together); one more that would
    /// pass it is `rate_limited` at once, like one past [`FrontConfig::max_in_flight_per_user`].
    pub max_bytes_in_flight_per_user: usize,
}

impl Default for FrontConfig {
    fn default() -> Self {
        FrontConfig {
            max_active_jobs: MAX_ACTIVE_JOBS_PER_USER,
            rate_per_user: 50,
            burst_per_user: 100,
            no_worker_wait: crate::dispatch::NO_WORKER_WAIT,
            max_in_flight_per_user: MAX_IN_FLIGHT_PER_USER,
            max_args_bytes: MAX_ARGS_BYTES,
            max_bytes_in_flight_per_user: MAX_BYTES_IN_FLIGHT_PER_USER,
        }
    }
}

struct Inner {
    store: Store,
    /// Finished jobs' records, for `getJob` without a read.
    finished: FinishedJobs,
    /// Plugins whose jobs are handed off after the reply.
    known: KnownPlugins,
    /// Hand-offs running after their reply (a drain waits for them too).
    hand_offs: InFlight,
    dispatcher: Dispatcher,
    verifier: Verifier,
    limiter: DefaultKeyedRateLimiter<String>,
    /// Each user's API requests in progress here ([`FrontConfig::max_in_flight_per_user`]).
    users_in_flight: crate::in_flight::PerKey,
    config: FrontConfig,
    client: async_nats::Client,
    /// The delegations of the sync invokes this front dispatches ([`crate::delegation`]).
    delegations: Arc<Delegations>,
    /// The grants, opened at the first delegated call (what the holder plugin's sessions may call).
    grants: tokio::sync::OnceCell<GrantStore>,
    /// The delegations of jobs, which any front resolves (opened when the front starts serving).
    job_delegations: tokio::sync::OnceCell<JobDelegations>,
}

/// The front. Cheap to clone.
#[derive(Clone)]
pub struct Front {
    inner: Arc<Inner>,
    metrics: Arc<FleetMetrics>,
}

impl std::fmt::Debug for Front {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Front").finish_non_exhaustive()
    }
}

/// API requests of one user a front handles at once by default ([`FrontConfig::max_in_flight_per_user`]): the rate
/// limit bounds how many a user starts per second, this how many they hold — sync invokes last up to 90 s.
pub const MAX_IN_FLIGHT_PER_USER: usize = 256;

/// Bytes of one API request's arguments a front reads by default ([`FrontConfig::max_args_bytes`]): 1 MiB, room
/// for a sync `tools.invoke` of inline text or a small file (larger inputs go through host files), and a bound on
/// what one request makes a front hold (the request, its arguments kept as text, the worker's copy being sent).
pub const MAX_ARGS_BYTES: usize = 1024 * 1024;

/// Bytes of API requests one user has in flight on a front by default
/// ([`FrontConfig::max_bytes_in_flight_per_user`]): 16 MiB, sixteen requests of [`MAX_ARGS_BYTES`]. A request in
/// flight holds its payload, its arguments as text and, while it is sent to a worker, the sealed request: at most
/// [`FRONT_COPIES_PER_REQUEST`] times its bytes, so one user makes a front hold at most 48 MiB of requests.
pub const MAX_BYTES_IN_FLIGHT_PER_USER: usize = 16 * 1024 * 1024;

/// Copies of a request's bytes a front holds while it serves it (the payload as received, the arguments as text,
/// the exec request being sent): what [`MAX_BYTES_IN_FLIGHT_PER_USER`] is multiplied by to bound the memory one
/// user's requests take.
pub const FRONT_COPIES_PER_REQUEST: usize = 3;

/// How often a front forgets the users whose rate-limit buckets are full again (such a user's state is no
/// different from a new one's): the limiter holds the users of the last moments, not every user ever seen.
pub const RATE_LIMIT_PRUNE_EVERY: Duration = Duration::from_secs(60);

/// How long [`FrontService::stop`] lets the requests in flight finish: the longest sync invoke the API admits,
/// plus the time to answer it.
pub const FRONT_DRAIN_GRACE: Duration = Duration::from_millis(INVOKE_TIMEOUT_MAX_MS + 5_000);

/// A running API service; dropping it keeps serving until `stop`.
#[derive(Debug)]
pub struct FrontService {
    service: Option<async_nats::service::Service>,
    /// One loop per endpoint; each ends when its subscription has delivered its last message.
    endpoints: tokio::task::JoinSet<()>,
    /// The loops of this front's delegated-call subjects: they serve the agent sessions of the invokes in flight,
    /// so they stay until those are answered, then end with `stop` (their subscriptions dropped).
    delegates: tokio::task::JoinSet<()>,
    /// The loop keeping announced finished records (ends with `stop`).
    finished: tokio::task::JoinHandle<()>,
    /// The watch keeping this front's copy of the active sets (ends with `stop`).
    active_sets: tokio::task::JoinHandle<()>,
    /// Forgets idle users' rate-limit state every [`RATE_LIMIT_PRUNE_EVERY`] (ends with `stop`).
    prune: tokio::task::JoinHandle<()>,
    /// The watch keeping this front's copy of the manifests (`tools.list`; ends with `stop`).
    manifests: tokio::task::JoinHandle<()>,
    /// Requests being handled.
    in_flight: InFlight,
    /// `invokeAsync` hand-offs running after their reply.
    hand_offs: InFlight,
    /// The connection the answers go out on (flushed before `stop` returns).
    client: async_nats::Client,
}

impl FrontService {
    /// API requests this replica is handling right now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.current()
    }

    /// Drains: unsubscribes every endpoint (the other replicas of the queue group take new requests), handles
    /// every request this replica was already delivered, waits up to [`FRONT_DRAIN_GRACE`] for the requests in
    /// flight to be answered and the `invokeAsync` hand-offs that follow their reply to end, then returns. No
    /// request this replica received goes unanswered.
    pub async fn stop(mut self) {
        if let Some(service) = self.service.take() {
            // The endpoints unsubscribe and then yield what is buffered until their stream ends.
            let _ = service.stop().await;
        }
        // The endpoints' streams end once the server confirms their drain: one round trip, like a flush — never,
        // when the server is gone (it died before this stop), so that wait is bounded the same way. The requests
        // in flight are awaited either way (their own handlers; they may still answer after a reconnect).
        let wait = fleet_client::nats_conn::stop_wait(&self.client);
        let ended = tokio::time::timeout(wait, async {
            while self.endpoints.join_next().await.is_some() {}
        })
        .await;
        if ended.is_err() {
            fleet_client::nats_conn::warn_unconfirmed(&self.client, "the API endpoints' drain");
        }
        let drained = tokio::time::timeout(FRONT_DRAIN_GRACE, async {
            self.in_flight.idle().await;
            self.hand_offs.idle().await;
        })
        .await;
        if drained.is_err() {
            tracing::warn!("front drain grace elapsed with requests in flight");
        }
        // No invoke of this front runs any more: nothing can hold one of its delegations.
        self.delegates.abort_all();
        while self.delegates.join_next().await.is_some() {}
        // The last answers may still be queued in the client: write them out before the caller may drop it.
        if let Err(e) = fleet_client::nats_conn::flush_for_stop(&self.client).await {
            tracing::warn!(error = %e, "cannot flush the last answers");
        }
        self.endpoints.abort_all();
        while self.endpoints.join_next().await.is_some() {}
        self.finished.abort();
        self.active_sets.abort();
        self.prune.abort();
        self.manifests.abort();
    }
}

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN)
}

impl Front {
    /// A front over `store`; `seals` signs what it sends to workers.
    pub fn new(
        client: async_nats::Client,
        store: Store,
        verifier: Verifier,
        config: FrontConfig,
        seals: Arc<ExecSigner>,
    ) -> Front {
        let quota = Quota::per_second(nz(config.rate_per_user)).allow_burst(nz(config.burst_per_user));
        Front {
            inner: Arc::new(Inner {
                dispatcher: Dispatcher::new(client.clone(), store.clone(), seals)
                    .with_no_worker_wait(config.no_worker_wait),
                finished: FinishedJobs::new(store.settings().job_retention),
                known: KnownPlugins::default(),
                hand_offs: InFlight::default(),
                store,
                verifier,
                limiter: RateLimiter::keyed(quota),
                users_in_flight: crate::in_flight::PerKey::default(),
                config,
                client,
                delegations: Arc::new(Delegations::default()),
                grants: tokio::sync::OnceCell::new(),
                job_delegations: tokio::sync::OnceCell::new(),
            }),
            metrics: Arc::new(FleetMetrics::new()),
        }
    }

    /// Records into `metrics` (the process's registry) instead of a private one.
    pub fn with_metrics(mut self, metrics: Arc<FleetMetrics>) -> Front {
        self.metrics = metrics;
        self
    }

    /// The metrics this front records into.
    pub fn metrics(&self) -> &Arc<FleetMetrics> {
        &self.metrics
    }

    /// The dispatcher (shared with the sweeper).
    pub fn dispatcher(&self) -> &Dispatcher {
        &self.inner.dispatcher
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.inner.store
    }

    /// The delegations of this front's sync invokes (what a delegated call is checked against; tests mint with it).
    pub fn delegations(&self) -> &Arc<Delegations> {
        &self.inner.delegations
    }

    async fn grants(&self) -> Result<&GrantStore, ApiError> {
        self.inner
            .grants
            .get_or_try_init(|| async {
                let js = async_nats::jetstream::new(self.inner.client.clone());
                GrantStore::open(&js, self.inner.store.settings()).await
            })
            .await
            .map_err(|e| self.js_error("grants", e))
    }

    /// The delegations of jobs (`<prefix>_delegations`).
    pub async fn job_delegations(&self) -> Result<&JobDelegations, ApiError> {
        self.inner
            .job_delegations
            .get_or_try_init(|| async {
                let js = async_nats::jetstream::new(self.inner.client.clone());
                JobDelegations::open(&js, self.inner.store.settings()).await
            })
            .await
            .map_err(|e| self.js_error("delegations", e))
    }

    /// The finished jobs this front answers `getJob` for from memory.
    pub fn finished_jobs(&self) -> &FinishedJobs {
        &self.inner.finished
    }

    /// Starts the NATS service: one endpoint per method under `fleet.v1.api`, queue group `fleet-api`.
    pub async fn serve(&self) -> Result<FrontService, async_nats::Error> {
        use async_nats::service::ServiceExt as _;
        // Jobs' delegations: recorded at `invokeAsync`, resolved on the jobs' delegated subjects, deleted at the
        // terminal steps this front decides.
        self.job_delegations()
            .await
            .map_err(|e| format!("job delegations: {}", e.message))?;
        let service = self
            .inner
            .client
            .service_builder()
            .description("Cloud Agents app-facing API")
            .queue_group(subjects::API_QUEUE_GROUP)
            .start("cloud-agents", env!("CARGO_PKG_VERSION"))
            .await?;
        let group = service.group(subjects::API_PREFIX);
        let mut tasks = tokio::task::JoinSet::new();
        let in_flight = InFlight::default();
        for method in methods::ALL {
            let mut endpoint = group.endpoint(*method).await?;
            let front = self.clone();
            let in_flight = in_flight.clone();
            tasks.spawn(async move {
                while let Some(request) = endpoint.next().await {
                    let front = front.clone();
                    let handling = in_flight.enter();
                    tokio::spawn(async move {
                        let _handling = handling;
                        let auth = request
                            .message
                            .headers
                            .as_ref()
                            .and_then(|h| h.get(subjects::AUTH_HEADER))
                            .map(|v| v.as_str().to_string());
                        let span = api_span(method, "nats");
                        crate::telemetry::extract_into(&span, request.message.headers.as_ref());
                        // An app's request (through the account import) may be answered by the worker itself.
                        let direct =
                            fleet_client::nats_conn::imported_reply(&request.message).map(str::to_owned);
                        let handled = Box::pin(
                            front
                                .answer(
                                    method,
                                    auth.as_deref(),
                                    &request.message.payload,
                                    direct.as_deref(),
                                )
                                .instrument(span),
                        );
                        let answer = fleet_client::nats_conn::keeping_alive(
                            &front.inner.client,
                            &request.message,
                            handled,
                        )
                        .await;
                        if let Answer::Respond(response) = answer {
                            let accepted_job = *method == methods::TOOLS_INVOKE_ASYNC
                                && matches!(response, ApiResponse::Ok(_));
                            let payload = Bytes::from(serde_json::to_vec(&response).unwrap_or_default());
                            let _ = request.respond(Ok(payload.clone())).await;
                            if accepted_job {
                                // The job exists: its id must reach the app even if the answer's way back
                                // (the import's reply mapping, on the app's server) died (`STATUS_ANSWERED`).
                                fleet_client::nats_conn::publish_answer_copy(
                                    &front.inner.client,
                                    &request.message,
                                    payload,
                                )
                                .await;
                            }
                        }
                    });
                }
            });
        }
        // Delegated tool calls of the agent sessions of the invokes this front dispatched (its own subjects; not
        // part of the service, so `stop` ends them itself once its requests in flight are answered).
        // The jobs' delegated subjects are every front's (queue group): a job outlives the front that accepted it.
        let mut delegates = tokio::task::JoinSet::new();
        for method in delegation::METHODS {
            let own = delegation::subject(self.inner.delegations.front_id(), method);
            let own = self.inner.client.subscribe(own).await?;
            let jobs = self
                .inner
                .client
                .queue_subscribe(
                    delegation::subject(delegation::JOBS, method),
                    delegation::JOBS_QUEUE_GROUP.to_owned(),
                )
                .await?;
            for mut sub in [own, jobs] {
                let front = self.clone();
                let in_flight = in_flight.clone();
                delegates.spawn(async move {
                    while let Some(message) = sub.next().await {
                        let front = front.clone();
                        let handling = in_flight.enter();
                        tokio::spawn(async move {
                            let _handling = handling;
                            let Some(reply) = message.reply.clone() else {
                                return;
                            };
                            let response = front
                                .delegated(method, &message.payload)
                                .instrument(api_span(method, "delegated"))
                                .await;
                            let payload = serde_json::to_vec(&response).unwrap_or_default();
                            let _ = front.inner.client.publish(reply, Bytes::from(payload)).await;
                        });
                    }
                });
            }
        }
        // This front's copy of the users' active sets, current by a watch: admission starts its compare-and-set
        // from it instead of reading the set first.
        let active_sets = self.inner.store.watch_active_sets();
        // And of the manifests: `tools.list` answered from it (after one look at the bucket's last sequence).
        let manifests = self.inner.store.watch_manifests();
        // Finished jobs' records as their terminal step writes them (any worker's or front's): `getJob` of a job
        // that just finished is answered from memory, also the first time.
        let mut finished_sub = self.inner.client.subscribe(subjects::JOBS_FINISHED).await?;
        let front = self.clone();
        let finished = tokio::spawn(async move {
            while let Some(message) = finished_sub.next().await {
                front.keep_finished(&message.payload);
            }
        });
        let front = self.clone();
        let prune = tokio::spawn(async move {
            let mut every = tokio::time::interval(RATE_LIMIT_PRUNE_EVERY);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                front.prune_rate_limits();
            }
        });
        // The endpoints' subscriptions are processed by the server before `serve` returns (no "no responders"
        // right after): the server answers a PING only once it has processed every earlier SUB of this connection.
        fleet_client::nats_conn::round_trip(&self.inner.client)
            .await
            .map_err(|e| format!("the NATS server did not confirm the API subscriptions: {e}"))?;
        Ok(FrontService {
            service: Some(service),
            endpoints: tasks,
            delegates,
            finished,
            active_sets,
            prune,
            manifests,
            in_flight,
            hand_offs: self.inner.hand_offs.clone(),
            client: self.inner.client.clone(),
        })
    }

    /// API requests of `user` this front is handling now ([`FrontConfig::max_in_flight_per_user`]).
    pub fn in_flight_of(&self, user: &str) -> usize {
        self.inner.users_in_flight.current(user)
    }

    /// Bytes of the API requests of `user` this front is handling now
    /// ([`FrontConfig::max_bytes_in_flight_per_user`]).
    pub fn bytes_in_flight_of(&self, user: &str) -> usize {
        self.inner.users_in_flight.held(user).bytes
    }

    /// Forgets the users whose rate-limit buckets are full again (their state is a new user's); returns how many
    /// users are still tracked. [`serve`](Self::serve) calls it every [`RATE_LIMIT_PRUNE_EVERY`].
    pub fn prune_rate_limits(&self) -> usize {
        self.inner.limiter.retain_recent();
        self.inner.limiter.shrink_to_fit();
        self.inner.limiter.len()
    }

    /// Keeps an announced terminal record (`fleet.v1.jobs.finished`) in the memory of finished jobs. Anything else
    /// (not a record, not terminal, too big) is dropped: the first `getJob` reads the store then.
    fn keep_finished(&self, payload: &[u8]) {
        if payload.len() > subjects::FINISHED_ANNOUNCE_MAX_BYTES {
            return;
        }
        match serde_json::from_slice::<JobRecord>(payload) {
            Ok(record) => self
                .inner
                .finished
                .insert(Arc::new(record), payload.len(), now_ms()),
            // Not quoted: serde's message may carry the payload's bytes.
            Err(_) => tracing::debug!("an announced finished record that does not parse"),
        }
    }

    /// Handles one API call (also the HTTP gateway's entry point, later). Traced in the caller's span (the
    /// NATS service opens `api.request` for it).
    pub async fn handle(&self, method: &str, auth: Option<&str>, payload: &[u8]) -> ApiResponse<Value> {
        match self.answer(method, auth, payload, None).await {
            Answer::Respond(response) => response,
            // Only a call given a reply subject is answered by its worker.
            Answer::Delivered(_) => ApiResponse::Err(internal("answered elsewhere")),
        }
    }

    /// [`Front::handle`] for a request whose caller waits on `direct` (an imported request's reply subject): a
    /// sync call's worker may publish the answer there itself ([`Answer::Delivered`]).
    async fn answer(&self, method: &str, auth: Option<&str>, payload: &[u8], direct: Option<&str>) -> Answer {
        let started = std::time::Instant::now();
        let answer = match auth {
            None => Answer::Respond(ApiResponse::Err(ApiError::new(
                ApiErrorCode::InvalidToken,
                "missing Authorization header",
            ))),
            Some(h) => match self.inner.verifier.verify(h) {
                Ok(p) => {
                    self.handle_user(Caller::app(&p.user), method, payload, direct)
                        .await
                }
                Err(e) => Answer::Respond(ApiResponse::Err(e.to_api_error())),
            },
        };
        let code = answer.code();
        record_outcome(&tracing::Span::current(), code);
        self.metrics.api_request(method, code, started.elapsed());
        answer
    }

    /// Handles one API call for an already authenticated caller (the HTTP gateway verifies window tokens
    /// itself): the same rate limit, validation, handlers and metrics as [`Front::handle`], without the token.
    pub async fn handle_as(&self, caller: Caller<'_>, method: &str, payload: &[u8]) -> ApiResponse<Value> {
        let started = std::time::Instant::now();
        let span = api_span(method, "http");
        let response = match self
            .handle_user(caller, method, payload, None)
            .instrument(span.clone())
            .await
        {
            Answer::Respond(response) => response,
            Answer::Delivered(_) => ApiResponse::Err(internal("answered elsewhere")),
        };
        let code = match &response {
            ApiResponse::Ok(_) => None,
            ApiResponse::Err(e) => Some(e.code),
        };
        record_outcome(&span, code);
        self.metrics.api_request(method, code, started.elapsed());
        response
    }

    /// The per-user rate limit of every API call (also the HTTP listener's user routes: credentials, OAuth
    /// accounts): `rate_limited` when `user` is over it.
    pub fn admit(&self, user: &str) -> Result<(), ApiError> {
        let span = tracing::info_span!(
            "admission",
            fleet.admission.kind = "rate",
            fleet.admission.outcome = tracing::field::Empty,
        );
        let ok = self.inner.limiter.check_key(&user.to_owned()).is_ok();
        span.record(
            "fleet.admission.outcome",
            if ok { "admitted" } else { "rate_limited" },
        );
        if ok {
            Ok(())
        } else {
            Err(ApiError::new(
                ApiErrorCode::RateLimited,
                "too many requests; retry shortly",
            ))
        }
    }

    async fn handle_user(
        &self,
        caller: Caller<'_>,
        method: &str,
        payload: &[u8],
        direct: Option<&str>,
    ) -> Answer {
        let user = caller.user;
        crate::telemetry::record_user(user);
        if let Err(e) = self.admit(user) {
            return Answer::Respond(ApiResponse::Err(e));
        }
        let cap = self.inner.config.max_in_flight_per_user;
        let max_bytes = self.inner.config.max_bytes_in_flight_per_user;
        let _in_flight = match self
            .inner
            .users_in_flight
            .try_enter_bytes(user, cap, payload.len(), max_bytes)
        {
            Ok(guard) => guard,
            Err(held) if held.count >= cap => {
                return Answer::Respond(ApiResponse::Err(ApiError::with_details(
                    ApiErrorCode::RateLimited,
                    format!(
                        "{cap} requests of this user are in progress on this front; retry when one has ended"
                    ),
                    json!({ "max_in_flight": cap }),
                )));
            }
            Err(held) => {
                return Answer::Respond(ApiResponse::Err(ApiError::with_details(
                    ApiErrorCode::RateLimited,
                    format!(
                        "requests of this user hold {} bytes on this front, and this one {} more: the limit is \
                         {max_bytes}; retry when one has ended",
                        held.bytes,
                        payload.len()
                    ),
                    json!({ "max_bytes_in_flight": max_bytes, "bytes_in_flight": held.bytes }),
                )));
            }
        };
        // Bounded before anything is parsed: what a request makes the front hold is a small multiple of this.
        let max = self.inner.config.max_args_bytes;
        if payload.len() > max {
            return Answer::Respond(ApiResponse::Err(ApiError::args_too_large(payload.len(), max)));
        }
        // Each method parses the body once, into its own arguments (no JSON tree in between).
        let args = payload;
        let result = match method {
            methods::TOOLS_LIST => match parse_body::<serde::de::IgnoredAny>(args) {
                Ok(_) => self.list_tools().await,
                Err(e) => Err(e),
            },
            methods::TOOLS_INVOKE => match self.invoke(caller, args, direct).await {
                Ok(Invoked::Delivered(code)) => return Answer::Delivered(code),
                Ok(Invoked::Answer(v)) => Ok(v),
                Err(e) => Err(e),
            },
            methods::TOOLS_INVOKE_ASYNC => self.invoke_async(caller, args).await,
            methods::TOOLS_GET_JOB => self.get_job(user, args).await,
            methods::TOOLS_CANCEL_JOB => self.cancel_job(user, args).await,
            methods::TOOLS_LIST_JOBS => self.list_jobs(user, args).await,
            other => parse_body::<serde::de::IgnoredAny>(args).and_then(|_| {
                Err(ApiError::new(
                    ApiErrorCode::NotImplemented,
                    format!("unknown method {other:?}"),
                ))
            }),
        };
        Answer::Respond(result.into())
    }

    fn js_error(&self, op: &'static str, e: impl std::fmt::Display) -> ApiError {
        self.metrics.jetstream_error(op);
        internal(e)
    }

    /// Dispatches a queued job. `Ok(true)`: a worker took it (and records itself on the job as it starts it,
    /// by the `queued → running` compare-and-set: the front writes nothing after the hand-off, so it never races
    /// that write); `Ok(false)`: none could now (it stays queued); `Err`: no worker will ever run it (e.g. an
    /// unknown plugin) — the job is failed with that error (its quota slot given back, the failure announced).
    pub async fn dispatch_job(&self, record: &JobRecord) -> Result<bool, ApiError> {
        let req = crate::dispatch::job_request(record);
        match self.inner.dispatcher.job(&req).await {
            Ok(_worker) => {
                self.inner.known.accepted(&record.plugin);
                Ok(true)
            }
            Err(e) if matches!(e.code, ApiErrorCode::PermissionDenied | ApiErrorCode::InvalidArg) => {
                self.steps().fail_undispatchable(record, e.clone()).await;
                Err(e)
            }
            Err(e) => {
                tracing::debug!(job = %record.job_id, error = %e, "job not dispatched yet");
                Ok(false)
            }
        }
    }

    /// This front's job transitions: its store, metrics and connection.
    pub fn steps(&self) -> JobSteps<'_> {
        JobSteps::new(&self.inner.store, &self.metrics, &self.inner.client)
            .with_delegations(self.inner.job_delegations.get())
    }

    async fn list_tools(&self) -> Result<Value, ApiError> {
        let manifests = self
            .inner
            .store
            .manifests()
            .await
            .map_err(|e| self.js_error("manifests", e))?;
        let mut tools = Vec::new();
        for (plugin, manifest) in manifests {
            for t in &manifest.tools {
                tools.push(ToolInfo {
                    tool_id: plugin.clone(),
                    plugin_name: plugin.clone(),
                    tool_name: t.name.clone(),
                    description: t.description.clone(),
                    input_schema: t.input_schema(),
                    status: Some("available".into()),
                });
            }
        }
        to_value(&ListToolsResult { tools })
    }

    async fn invoke(
        &self,
        caller: Caller<'_>,
        args: &[u8],
        direct: Option<&str>,
    ) -> Result<Invoked, ApiError> {
        let args: RawInvokeArgs = parse_body(args)?;
        let target = args.validate()?;
        let timeout = SyncTimeout::resolve(args.timeout_ms)?;
        self.invoke_target(caller, args, target, timeout, direct, 0).await
    }

    /// A delegated call (`fleet.v1.delegate.<this front>.<method>`): `tools.list` or `tools.invoke` as the user
    /// the delegation names, within its invoke's life and deadline ([`crate::delegation`]).
    pub async fn delegated(&self, method: &str, payload: &[u8]) -> ApiResponse<Value> {
        let started = std::time::Instant::now();
        let result = self.delegated_inner(method, payload).await;
        let code = result.as_ref().err().map(|e| e.code);
        record_outcome(&tracing::Span::current(), code);
        self.metrics.api_request(method, code, started.elapsed());
        result.into()
    }

    async fn delegated_inner(&self, method: &str, payload: &[u8]) -> Result<Value, ApiError> {
        // The same cap as the API's, before parsing; the delegation's few hundred bytes ride within it.
        let max = self.inner.config.max_args_bytes;
        if payload.len() > max {
            return Err(ApiError::args_too_large(payload.len(), max));
        }
        let call: delegation::DelegatedCall = serde_json::from_slice(payload)
            .map_err(|_| ApiError::new(ApiErrorCode::InvalidArg, "not a delegated call"))?;
        let by = if call.delegation.front_id() == Some(delegation::JOBS) {
            self.resolve_job_delegation(&call.delegation).await?
        } else {
            self.inner
                .delegations
                .resolve(&call.delegation)
                .map_err(|e| ApiError::new(ApiErrorCode::PermissionDenied, e.to_string()))?
        };
        crate::telemetry::record_user(&by.user);
        if self.inner.limiter.check_key(&by.user).is_err() {
            return Err(ApiError::new(
                ApiErrorCode::RateLimited,
                "too many requests; retry shortly",
            ));
        }
        let denied = |m: String| ApiError::new(ApiErrorCode::PermissionDenied, m);
        // The grant as it is now: revoking llm.agent.auto or narrowing granted_tools applies at once.
        let grant = self
            .grants()
            .await?
            .get(&by.user, &by.plugin)
            .await
            .map_err(|e| self.js_error("grants", e))?;
        if !grant.allows(LLM_AGENT_AUTO) {
            return Err(denied(format!(
                "the user has not granted {LLM_AGENT_AUTO} to {}",
                by.plugin
            )));
        }
        match method {
            methods::TOOLS_LIST => {
                // The holder's own tools are not among those its sessions may call, nor tools outside its grant.
                let mut listed = self.list_tools().await?;
                if let Some(Value::Array(tools)) = listed.get_mut("tools") {
                    tools.retain(|t| {
                        let field = |k: &str| t.get(k).and_then(Value::as_str).unwrap_or_default();
                        field("tool_id") != by.plugin
                            && list_admits(by.window_tools.as_deref(), field("tool_id"))
                            && grant.allows_agent_tool(field("tool_id"), field("tool_name"))
                    });
                }
                Ok(listed)
            }
            methods::TOOLS_INVOKE => {
                let args: RawInvokeArgs = parse_args(&call.args)?;
                let target = args.validate()?;
                let depth = Delegations::admit(&by, &target.plugin).map_err(|e| denied(e.to_string()))?;
                let caller = Caller {
                    user: &by.user,
                    window_tools: by.window_tools.as_deref(),
                };
                if !grant.allows_agent_tool(&target.plugin, &target.tool) {
                    return Err(denied(format!(
                        "the grant does not let {}'s agent sessions call {}.{}",
                        by.plugin, target.plugin, target.tool
                    )));
                }
                // Never past the parent's deadline.
                let left = by.deadline_ms.saturating_sub(now_ms());
                let wanted = args.timeout_ms.unwrap_or(policy::SYNC_DEFAULT_MS);
                let timeout = SyncTimeout::resolve(Some(wanted.min(left)))?;
                match self
                    .invoke_target(caller, args, target, timeout, None, depth)
                    .await?
                {
                    Invoked::Answer(v) => Ok(v),
                    Invoked::Delivered(_) => Err(internal("answered elsewhere")),
                }
            }
            other => Err(ApiError::new(
                ApiErrorCode::NotImplemented,
                format!("{other:?} cannot be delegated"),
            )),
        }
    }

    /// What a job's delegation stands for: recorded by the front that accepted the job, before its deadline, and
    /// only while the job is `running` (a terminal job's delegation is refused, deleted or not).
    async fn resolve_job_delegation(
        &self,
        token: &delegation::DelegationToken,
    ) -> Result<Delegated, ApiError> {
        let denied = |e: DelegationError| ApiError::new(ApiErrorCode::PermissionDenied, e.to_string());
        let found = self
            .job_delegations()
            .await?
            .resolve(token)
            .await
            .map_err(denied)?;
        let job = self
            .inner
            .store
            .get_job(&found.user, &found.job_id)
            .await
            .map_err(|e| self.js_error("get_job", e))?;
        let running = job.is_some_and(|r| {
            r.value.state == JobState::Running && r.value.delegation.as_ref() == Some(token)
        });
        if !running {
            return Err(denied(DelegationError::Unknown));
        }
        Ok(Delegated {
            user: found.user,
            plugin: found.plugin,
            invoke_id: found.job_id.to_string(),
            deadline_ms: found.deadline_ms,
            depth: found.depth,
            window_tools: found.window_tools,
        })
    }

    async fn invoke_target(
        &self,
        caller: Caller<'_>,
        args: RawInvokeArgs,
        target: fleet_proto::api::Target,
        timeout: SyncTimeout,
        direct: Option<&str>,
        depth: u32,
    ) -> Result<Invoked, ApiError> {
        let invoke_id = new_invoke_id();
        let wait = Duration::from_millis(timeout.front_wait_ms());
        // Revoked when this function returns: the front has the invoke's answer (or gave up on it).
        let user = caller.user;
        let live = self.inner.delegations.mint(Delegated {
            user: user.to_owned(),
            plugin: target.plugin.clone(),
            invoke_id: invoke_id.to_string(),
            deadline_ms: now_ms() + timeout.front_wait_ms(),
            depth,
            window_tools: caller.window_tools.map(<[String]>::to_vec),
        });
        let req = ExecRequest {
            kind: ExecKind::Sync,
            user: user.to_string(),
            tool_id: args.tool_id.clone(),
            plugin: target.plugin,
            tool: target.tool,
            arguments: args.args.unwrap_or_default(),
            invoke_id: invoke_id.to_string(),
            timeout_ms: timeout.timeout_ms,
            default_timeout_ms: policy::SYNC_DEFAULT_MS,
            max_timeout_ms: INVOKE_TIMEOUT_MAX_MS,
            deadline_ms: None,
            job_id: None,
            requested_timeout_ms: timeout.requested_ms,
            reply_to: direct.map(str::to_owned),
            delegation: live.as_ref().map(|l| l.token.clone()),
        };
        let (_, reply) = match self.inner.dispatcher.sync(&req, wait).await {
            Ok(r) => r,
            Err(mut e) => {
                if e.code == ApiErrorCode::ToolTimeout {
                    // Best effort: stop the invocation wherever it runs.
                    self.inner.dispatcher.cancel(None, invoke_id.as_str()).await;
                    e.details = policy::timeout_details(
                        timeout.timeout_ms.unwrap_or(INVOKE_TIMEOUT_MAX_MS),
                        timeout.requested_ms,
                    );
                }
                return Err(e);
            }
        };
        if reply.delivered {
            return Ok(Invoked::Delivered(reply.error.map(|e| e.code)));
        }
        crate::exec_answer::api_answer(&reply).map(Invoked::Answer)
    }

    async fn invoke_async(&self, caller: Caller<'_>, args: &[u8]) -> Result<Value, ApiError> {
        let user = caller.user;
        let args: InvokeAsyncArgs = parse_body(args)?;
        let target = args.validate()?;
        let timeout_ms = policy::job_timeout_ms(args.timeout_ms);
        let now = now_ms();
        let job_id = new_invoke_id();
        let mut record = JobRecord::queued(
            job_id.clone(),
            user,
            &args.tool_id,
            &target.plugin,
            &target.tool,
            now,
            timeout_ms,
        );
        record.args = args.args.unwrap_or_default();
        record.client_tag = args.client_tag;
        // The job's delegation for its agent sessions' tool calls, which any front resolves: recorded (under the
        // SHA-256 of its secret) while the job is admitted, so before it can be dispatched.
        let job_delegations = self.inner.job_delegations.get();
        record.delegation = job_delegations.map(|_| JobDelegations::mint());
        // Only a front makes work: workers and sweepers run or dispatch a queued job only under this seal.
        record.seal = Some(self.inner.dispatcher.seals().seal_job(&record));
        let delegated = JobDelegation {
            user: user.to_owned(),
            plugin: record.plugin.clone(),
            job_id: job_id.clone(),
            deadline_ms: record.deadline_ms,
            depth: 0,
            window_tools: caller.window_tools.map(<[String]>::to_vec),
        };
        let admission = tracing::info_span!(
            "admission",
            fleet.admission.kind = "quota",
            fleet.job_id = %job_id,
            fleet.admission.outcome = tracing::field::Empty,
        );
        // Admission is idempotent by job id (the slot is found again, the record is never created twice): while
        // the store does not answer (a NATS node lost, its streams electing new leaders) it is tried again, up
        // to STORE_FAILOVER_WAIT (`fleet_store::failover`).
        let admitted = fleet_store::failover::ride_out(
            fleet_store::Op::CreateJob,
            fleet_store::failover::give_up_at(None),
            || {
                self.inner
                    .store
                    .admit_job(record.clone(), self.inner.config.max_active_jobs)
                    .instrument(admission.clone())
            },
            |_| self.metrics.jetstream_error("create_job"),
        );
        let recorded = async {
            match (job_delegations, &record.delegation) {
                (Some(store), Some(token)) => store.record(token, &delegated).await,
                _ => Ok(()),
            }
        };
        let (created, recorded) = tokio::join!(admitted, recorded);
        self.metrics.job_store(self.inner.store.fill());
        if let Err(e) = recorded {
            self.metrics.jetstream_error("delegations");
            tracing::warn!(job = %job_id, error = %e, "cannot record the job's delegation: its agent sessions have no tools");
        }
        if created.is_err()
            && let (Some(store), Some(token)) = (job_delegations, &record.delegation)
        {
            store.forget(token).await;
        }
        admission.record(
            "fleet.admission.outcome",
            match &created {
                Ok(_) => "admitted",
                Err(
                    StoreError::QuotaExceeded { .. }
                    | StoreError::RetainedQuotaExceeded { .. }
                    | StoreError::StorageQuotaExceeded { .. },
                ) => "job_quota_exceeded",
                Err(StoreError::StoreFull { .. }) => "store_full",
                Err(_) => "error",
            },
        );
        drop(admission);
        let (created, may_run) = match created {
            Ok((r, acquired)) => (r.value, fleet_store::may_run(acquired.position())),
            Err(
                e @ (StoreError::QuotaExceeded { .. }
                | StoreError::RetainedQuotaExceeded { .. }
                | StoreError::StorageQuotaExceeded { .. }),
            ) => {
                return Err(e.to_api_error());
            }
            Err(e @ StoreError::StoreFull { .. }) => {
                self.metrics.rejection("store_full");
                tracing::warn!(error = %e, "a job refused: the JetStream store is nearly full");
                return Err(e.to_api_error());
            }
            Err(e @ StoreError::Nats { .. }) => {
                self.metrics.jetstream_error("create_job");
                tracing::warn!(error = %e, "the job store did not answer within the failover wait");
                return Err(ApiError::with_details(
                    ApiErrorCode::AgentUnavailable,
                    format!(
                        "the job store did not answer for {} s; retry",
                        fleet_store::failover::STORE_FAILOVER_WAIT.as_secs()
                    ),
                    json!({ "retriable": true }),
                ));
            }
            Err(e) => return Err(self.js_error("create_job", e)),
        };
        self.steps().created(&created).await;
        let answer = to_value(&InvokeAsyncResult {
            job_id,
            state: JobState::Queued,
            deadline_ms: created.deadline_ms,
        });
        // Within the user's agent slots, hand it to a worker; if none has room it goes to the job queue, which the
        // first worker with a free slot pulls from. Beyond them it waits: the end of one of the user's earlier jobs
        // queues it. For a plugin a worker recently accepted a job of, the hand-off runs after the reply (the
        // record and the slot are written already; see `known_plugins`); for any other, before it, so a plugin no
        // worker has is refused now (and the job ended).
        if may_run {
            if self.inner.known.knows(&created.plugin) {
                let front = self.clone();
                let handing = self.inner.hand_offs.enter();
                tokio::spawn(async move {
                    let _handing = handing;
                    let _ = front.hand_off(&created).await;
                });
            } else {
                self.hand_off(&created).await?;
            }
        }
        answer
    }

    /// Hands a job that may run to a worker ([`Front::dispatch_job`]), or queues it when none has room now.
    async fn hand_off(&self, created: &JobRecord) -> Result<(), ApiError> {
        if !self.dispatch_job(created).await?
            && let Err(e) = self.inner.store.enqueue_job(&created.user, &created.job_id).await
        {
            // Still queued: the sweeper dispatches it.
            self.metrics.jetstream_error("enqueue_job");
            tracing::warn!(job = %created.job_id, error = %e, "cannot queue the job");
        }
        Ok(())
    }

    async fn get_job(&self, user: &str, args: &[u8]) -> Result<Value, ApiError> {
        let args: GetJobArgs = parse_body(args)?;
        args.validate()?;
        let limit = args.limit.unwrap_or(GET_JOB_LIMIT_MAX) as usize;
        let now = now_ms();
        // A finished job's record is never written again: kept here, it needs no read (nor does its progress,
        // when nothing is due).
        let known = self.inner.finished.get(user, &args.job_id, now);
        let fresh = known.is_none();
        let Some(view) = self
            .inner
            .store
            .view_job(user, &args.job_id, args.since_seq.unwrap_or(0), limit, known)
            .await
            .map_err(|e| self.js_error("get_job", e))?
        else {
            return Err(not_found(&args.job_id));
        };
        if fresh && view.record.state.is_terminal() {
            self.inner
                .finished
                .insert(view.record.clone(), view.record_bytes, now);
        }
        to_value(&view.into_snapshot())
    }

    async fn cancel_job(&self, user: &str, args: &[u8]) -> Result<Value, ApiError> {
        let args: CancelJobArgs = parse_body(args)?;
        args.validate()?;
        let span = tracing::info_span!(
            "job.cancel",
            fleet.job_id = %args.job_id,
            fleet.job.cancelled = tracing::field::Empty,
        );
        let result = self.cancel_job_inner(user, args).instrument(span.clone()).await;
        if let Ok(v) = &result {
            span.record("fleet.job.cancelled", v["cancelled"].as_bool().unwrap_or(false));
        }
        result
    }

    async fn cancel_job_inner(&self, user: &str, args: CancelJobArgs) -> Result<Value, ApiError> {
        let reason = args
            .reason
            .clone()
            .unwrap_or_else(|| "cancelled by the caller".into());
        let outcome = self
            .steps()
            .step(user, &args.job_id, JobState::Cancelled, Decider::Other, |r| {
                r.finished_at_ms = Some(now_ms());
                r.error = Some(ApiError::new(ApiErrorCode::Cancelled, reason.clone()));
            })
            .await
            .map_err(internal)?;
        match outcome {
            Transition::Done(r) => {
                // The row flipped first; now stop the execution wherever it runs.
                self.inner
                    .dispatcher
                    .cancel(r.value.worker.as_deref(), args.job_id.as_str())
                    .await;
                to_value(&CancelJobResult {
                    job_id: args.job_id,
                    state: JobState::Cancelled,
                    cancelled: true,
                })
            }
            Transition::Refused(r) => to_value(&CancelJobResult {
                job_id: args.job_id,
                state: r.value.state,
                cancelled: false,
            }),
            Transition::NotFound => Err(not_found(&args.job_id)),
        }
    }

    async fn list_jobs(&self, user: &str, args: &[u8]) -> Result<Value, ApiError> {
        let args: ListJobsArgs = parse_body(args)?;
        args.validate()?;
        let floor = now_ms().saturating_sub(u64::try_from(JOB_RETENTION.as_millis()).unwrap_or(u64::MAX));
        let since_ms = match &args.since {
            None => None,
            Some(s) => {
                let t = humantime::parse_rfc3339_weak(s)
                    .map_err(|e| ApiError::invalid_arg("since", format!("since must be RFC 3339: {e}")))?;
                let ms = t
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
                Some(ms.max(floor))
            }
        };
        let filter = JobFilter {
            tool_id: args.tool_id.clone(),
            states: args.state.as_ref().map(|s| s.to_vec()).unwrap_or_default(),
            client_tag: args.client_tag.clone(),
            since_ms: Some(since_ms.unwrap_or(floor)),
        };
        let limit = args.limit.unwrap_or(LIST_JOBS_LIMIT_DEFAULT) as usize;
        let cursor = args
            .cursor
            .as_deref()
            .map(str::parse::<ListCursor>)
            .transpose()
            .map_err(|e| {
                ApiError::invalid_arg("cursor", format!("cursor: {e}; pass back a listJobs cursor"))
            })?;
        let page = self
            .inner
            .store
            .list_jobs(user, &filter, limit, cursor)
            .await
            .map_err(|e| self.js_error("list_jobs", e))?;
        let jobs = page.jobs.iter().map(|r| r.snapshot(Vec::new())).collect();
        to_value(&ListJobsResult {
            jobs,
            truncated: page.truncated,
            cursor: page.cursor.map(|c| c.to_string()),
        })
    }
}

/// Who makes an API call: the user, and the allow-list of the app window it comes through (its token's `tools`),
/// which every delegation made under the call inherits ([`Delegated::window_tools`]).
#[derive(Debug, Clone, Copy)]
pub struct Caller<'a> {
    /// The user.
    pub user: &'a str,
    /// The window's allow-list; `None`: not through a window (an app over NATS), or a window without one.
    pub window_tools: Option<&'a [String]>,
}

impl<'a> Caller<'a> {
    /// An app's call for `user`, narrowed by no window.
    pub fn app(user: &'a str) -> Caller<'a> {
        Caller {
            user,
            window_tools: None,
        }
    }
}

/// How the answer of one API request reaches its caller.
enum Answer {
    /// The front answers with this.
    Respond(ApiResponse<Value>),
    /// The worker published the answer on the caller's reply subject itself; its outcome (`None`: ok).
    Delivered(Option<ApiErrorCode>),
}

impl Answer {
    /// The outcome code, for metrics and traces (`None`: ok).
    fn code(&self) -> Option<ApiErrorCode> {
        match self {
            Answer::Respond(ApiResponse::Ok(_)) => None,
            Answer::Respond(ApiResponse::Err(e)) => Some(e.code),
            Answer::Delivered(code) => *code,
        }
    }
}

/// A sync call's result at the front.
enum Invoked {
    /// The front answers with this.
    Answer(Value),
    /// Its worker answered the caller ([`Answer::Delivered`]).
    Delivered(Option<ApiErrorCode>),
}

fn to_value<T: serde::Serialize>(v: &T) -> Result<Value, ApiError> {
    serde_json::to_value(v).map_err(|e| ApiError::new(ApiErrorCode::InternalError, e.to_string()))
}

fn internal(e: impl std::fmt::Display) -> ApiError {
    ApiError::new(ApiErrorCode::InternalError, e.to_string())
}

fn not_found(id: &JobId) -> ApiError {
    ApiError::new(ApiErrorCode::JobNotFound, format!("no job {id}"))
}

/// The `api.request` span of one API call (server side; never the token or the user id: `fleet.user_hash`).
fn api_span(method: &str, system: &'static str) -> tracing::Span {
    tracing::info_span!(
        "api.request",
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        rpc.system = system,
        rpc.service = "cloud-agents",
        rpc.method = %method,
        fleet.user_hash = tracing::field::Empty,
        fleet.outcome = tracing::field::Empty,
        error.type = tracing::field::Empty,
    )
}

/// Records an API call's outcome on its span: `ok`, or the error code (also as `error.type`).
fn record_outcome(span: &tracing::Span, code: Option<ApiErrorCode>) {
    match code {
        None => {
            span.record("fleet.outcome", "ok");
        }
        Some(c) => {
            span.record("fleet.outcome", c.as_str());
            span.record("error.type", c.as_str());
            span.record("otel.status_code", "ERROR");
        }
    }
}
