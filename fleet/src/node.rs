//! The worker side of the fleet: a `fleet_worker::Pool` behind NATS. It serves `fleet.v1.worker.<id>.exec`
//! (sync invokes answered with the two-layer envelope; jobs accepted, run, and recorded in JetStream), listens
//! for `_cancel_invoke` on `fleet.v1.worker.<id>.cancel` and `matrix.cancel.<id>`, keeps its registry entry alive,
//! and publishes the manifests it learns for `tools.list`.
//!
//! A job goes `queued → running` by compare-and-set **before** its invoke frame is written to the plugin: a worker
//! that dies before that leaves the job queued (the sweeper re-dispatches it); one that dies after leaves it
//! running, and the sweeper fails it with a retriable error once the worker's registry entry expires — never
//! run twice.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use fleet_proto::api::worker::{
    CancelCommand, ExecKind, ExecReply, ExecRequest, JOBS_HELD_QUERY_MAX, JobsHeld, JobsHeldQuery,
};
use fleet_proto::api::{ApiError, ApiErrorCode, ApiResponse, JobId, JobState, ProgressEvent, subjects};
use fleet_proto::limits::{DESCRIBE_TIMEOUT_FIRST_LAUNCH, MAX_JOB_RESULT_BYTES, MAX_SYNC_RESULT_BYTES};
use fleet_worker::pool::{Pool, PoolError, Target};
use fleet_worker::session::progress::ProgressUpdate;
use fleet_worker::session::{InvokeError, InvokeOutput, InvokeRequest};
use futures::StreamExt as _;
use serde_json::value::RawValue;
use serde_json::{Value, json};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::JoinSet;
use tracing::Instrument as _;

use crate::in_flight::InFlight;
use crate::job_steps::{Decider, JobSteps};
use crate::metrics::FleetMetrics;
use crate::nats_auth::exec_seal::ExecVerifier;
use crate::policy;
use fleet_proto::api::user_key;
use fleet_store::{Store, Transition, WorkerInfo};

/// How long [`WorkerNode::shutdown`] lets in-flight invokes and running jobs finish before it stops their plugins
/// (the Helm chart's `terminationGracePeriodSeconds` must cover it plus the plugin shutdown ladder).
pub const DRAIN_GRACE: Duration = Duration::from_secs(30);

/// How long one pull from the job queue waits for a message before it asks again (a long poll: a message
/// arriving meanwhile is delivered at once).
const QUEUE_PULL_WAIT: Duration = Duration::from_secs(5);

/// Pause before the queue puller retries after a JetStream error.
const QUEUE_RETRY_AFTER: Duration = Duration::from_secs(1);

/// Progress events buffered per job between the plugin's reader and JetStream.
const PROGRESS_BUFFER: usize = 1024;

use fleet_proto::util::now_ms;

/// A running worker node.
#[derive(Debug)]
pub struct WorkerNode {
    id: String,
    client: async_nats::Client,
    tasks: JoinSet<()>,
    pool: Pool,
    ctx: Arc<Ctx>,
    /// Tells the exec loop to drain its subscription (answering what is still buffered with "draining").
    stop_exec: Option<tokio::sync::oneshot::Sender<()>>,
    exec_loop: Option<tokio::task::JoinHandle<()>>,
    /// Set once every enabled catalogue plugin was described (its manifest recorded, or its failure logged).
    listed: tokio::sync::watch::Receiver<bool>,
}

struct Ctx {
    id: String,
    client: async_nats::Client,
    store: Store,
    pool: Pool,
    /// One permit per long job this worker may run at once ([`WorkerConfig::effective_job_capacity`]).
    long_jobs: Arc<Semaphore>,
    /// Its size.
    capacity: usize,
    running_long: AtomicU64,
    /// Whether it answers apps' sync calls on their reply subjects itself ([`direct_replies_allowed`]).
    direct_replies: bool,
    /// Set when the node starts draining: it has left the registry and refuses new exec requests.
    draining: AtomicBool,
    /// Exec requests being served (sync invokes and jobs until their outcome is recorded).
    in_flight: InFlight,
    /// The jobs this worker is starting or running ([`run_job`]): a second dispatch of one of them to this same
    /// worker (the front's hand-off and a sweeper's re-dispatch of a job still queued) ends at once, so a start
    /// that finds the job running under this worker's id and its own start time is this run's own write.
    jobs_here: std::sync::Mutex<std::collections::HashSet<JobId>>,
    started_at_ms: u64,
    metrics: Arc<FleetMetrics>,
    /// Lazy installs of plugins published to the fleet (`crate::plugins`); `None` if its store cannot be opened.
    installer: Option<Arc<crate::plugins::Installer>>,
    /// Checks the front's seal on every exec request and cancel command.
    seals: Arc<ExecVerifier>,
}

impl Ctx {
    /// This node's job transitions: its store, metrics and connection.
    fn steps(&self) -> JobSteps<'_> {
        JobSteps::new(&self.store, &self.metrics, &self.client)
    }
}

impl WorkerNode {
    /// Subscribes and starts serving; records job metrics into `metrics` and exports the pool's there. Serves
    /// only exec requests and cancel commands whose seal `seals` accepts.
    pub async fn start(
        client: async_nats::Client,
        store: Store,
        pool: Pool,
        id: &str,
        metrics: Arc<FleetMetrics>,
        seals: Arc<ExecVerifier>,
        direct_replies: bool,
    ) -> Result<WorkerNode, async_nats::Error> {
        metrics.register_pool(&pool);
        let exec = client.subscribe(subjects::worker_exec(id)).await?;
        let cancel = client.subscribe(subjects::worker_cancel(id)).await?;
        let matrix = client.subscribe(subjects::matrix_cancel(id)).await?;
        let held = client.subscribe(subjects::worker_jobs(id)).await?;
        let installer = match crate::plugins::Installer::for_pool(&client, &store, &pool).await {
            Ok(i) => Some(Arc::new(i)),
            Err(e) => {
                tracing::warn!(worker = %id, error = %e, "plugin store unavailable: only the local catalogue is served");
                None
            }
        };
        let capacity = pool.context().config.effective_job_capacity();
        let ctx = Arc::new(Ctx {
            id: id.to_string(),
            client: client.clone(),
            store: store.clone(),
            pool: pool.clone(),
            long_jobs: Arc::new(Semaphore::new(capacity)),
            capacity,
            running_long: AtomicU64::new(0),
            draining: AtomicBool::new(false),
            in_flight: InFlight::default(),
            jobs_here: std::sync::Mutex::default(),
            started_at_ms: now_ms(),
            metrics,
            installer,
            seals,
            direct_replies,
        });
        // The watch of published plugins runs before this worker registers: a plugin published once the worker
        // is known is prepared by it (the watch delivers no history).
        let published = match &ctx.installer {
            Some(installer) => Some((installer.clone(), watch_published(&ctx, installer).await)),
            None => None,
        };
        heartbeat(&ctx).await;
        let mut tasks = JoinSet::new();
        if let Some((installer, first)) = published {
            tasks.spawn(prepare_published(ctx.clone(), installer, first));
        }
        let c = ctx.clone();
        let (stop_exec, mut stop_rx) = tokio::sync::oneshot::channel::<()>();
        let exec_loop = tokio::spawn(async move {
            let mut exec = exec;
            let mut stopping = false;
            // Once draining: the stream ends on the server's confirmation of the unsubscribe (one round trip), which
            // never comes when the server is gone — bounded like every other wait for a confirmation.
            let confirmed_by = tokio::time::sleep(Duration::MAX);
            tokio::pin!(confirmed_by);
            loop {
                let msg = tokio::select! {
                    m = exec.next() => m,
                    _ = &mut stop_rx, if !stopping => {
                        stopping = true;
                        // Unsubscribe, but deliver what the server already sent: those get "draining".
                        if let Err(e) = exec.drain().await {
                            tracing::warn!(error = %e, "cannot drain the exec subscription");
                            break;
                        }
                        let wait = fleet_client::nats_conn::stop_wait(&c.client);
                        confirmed_by.as_mut().reset(tokio::time::Instant::now() + wait);
                        continue;
                    }
                    () = &mut confirmed_by, if stopping => {
                        fleet_client::nats_conn::warn_unconfirmed(&c.client, "the exec subscription's drain");
                        break;
                    }
                };
                let Some(msg) = msg else { break };
                let guard = c.in_flight.enter();
                let c = c.clone();
                tokio::spawn(async move {
                    Box::pin(serve_exec(c, msg)).await;
                    drop(guard);
                });
            }
        });
        for mut sub in [cancel, matrix] {
            let c = ctx.clone();
            tasks.spawn(async move {
                while let Some(msg) = sub.next().await {
                    if !sealed(&c, &msg) {
                        continue;
                    }
                    if let Ok(cmd) = serde_json::from_slice::<CancelCommand>(&msg.payload)
                        && cmd.command == "_cancel_invoke"
                    {
                        let span = tracing::info_span!(
                            "worker.cancel",
                            otel.kind = "consumer",
                            executa.invoke_id = %cmd.invoke_id,
                            fleet.worker = %c.id,
                        );
                        crate::telemetry::extract_into(&span, msg.headers.as_ref());
                        let _entered = span.enter();
                        c.pool.cancel(&cmd.invoke_id);
                    }
                }
            });
        }
        tasks.spawn(answer_jobs_held(ctx.clone(), held));
        let c = ctx.clone();
        tasks.spawn(async move {
            let mut tick = tokio::time::interval(policy::HEARTBEAT_EVERY);
            loop {
                tick.tick().await;
                heartbeat(&c).await;
            }
        });
        let c = ctx.clone();
        let (listed_tx, listed) = tokio::sync::watch::channel(false);
        tasks.spawn(async move {
            publish_manifests(&c).await;
            listed_tx.send_replace(true);
        });
        tasks.spawn(pull_queued_jobs(ctx.clone()));
        Ok(WorkerNode {
            id: id.to_string(),
            client,
            tasks,
            pool,
            ctx,
            stop_exec: Some(stop_exec),
            exec_loop: Some(exec_loop),
            listed,
        })
    }

    /// The worker's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The node's NATS connection.
    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// The pool.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Resolves once every enabled plugin of this worker's catalogue was described and its manifest recorded (a
    /// plugin that failed is logged and skipped): from then on `tools.list` lists this worker's catalogue. A
    /// worker registers before, so a new fleet would list nothing for the first moments without this wait.
    /// Resolves too when the node stops first, and after [`DESCRIBE_TIMEOUT_FIRST_LAUNCH`] at most (saying so:
    /// the rest is listed as it is described).
    pub fn catalogue_listed(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut listed = self.listed.clone();
        let id = self.id.clone();
        async move {
            if tokio::time::timeout(DESCRIBE_TIMEOUT_FIRST_LAUNCH, listed.wait_for(|l| *l))
                .await
                .is_err()
            {
                tracing::warn!(
                    worker = %id,
                    "the catalogue is still being described after {} s: tools.list lists each plugin once it is",
                    DESCRIBE_TIMEOUT_FIRST_LAUNCH.as_secs()
                );
            }
        }
    }

    /// Drains within [`DRAIN_GRACE`], then shuts every plugin session down (see [`drain`](Self::drain)).
    pub async fn shutdown(self) {
        self.drain(DRAIN_GRACE).await;
    }

    /// Leaves the fleet without failing a call: stops refreshing and removes its registry entry (fronts watching
    /// the registry stop choosing it at once), answers every exec request that still arrives with "draining"
    /// (the front tries the next worker), lets the in-flight invokes and running jobs finish for up to `grace`,
    /// then stops every task and shuts every plugin session down. Jobs still running after `grace` are left to
    /// the sweeper, which fails them `worker_lost` (never run twice).
    pub async fn drain(mut self, grace: Duration) {
        self.ctx.draining.store(true, Ordering::SeqCst);
        // Unreachable server: the entry expires by TTL (waiting for the store's timeout would only delay the stop).
        if self.client.connection_state() != async_nats::connection::State::Connected {
            tracing::warn!(worker = %self.id, "NATS unreachable: cannot leave the worker registry; it expires by TTL");
        } else if let Err(e) = self.ctx.store.remove_worker(&self.id).await {
            tracing::warn!(worker = %self.id, error = %e, "cannot leave the worker registry; it expires by TTL");
        }
        if let Some(stop) = self.stop_exec.take() {
            let _ = stop.send(());
        }
        // First the exec loop's end — the drained subscription has handed over the last request the server sent
        // (each is in flight from then on) —, then no request in flight. Waiting for "none in flight" alone could
        // end between two buffered requests and abort the loop with requests no one would ever answer.
        let mut exec_loop = self.exec_loop.take();
        let drained = tokio::time::timeout(grace, async {
            if let Some(exec) = exec_loop.as_mut() {
                let _ = exec.await;
            }
            self.ctx.in_flight.idle().await;
        })
        .await
        .is_ok();
        if !drained {
            tracing::warn!(
                worker = %self.id,
                in_flight = self.ctx.in_flight.current(),
                "drain grace elapsed; stopping the calls still running"
            );
        }
        // A finished loop's handle is not awaited again (its output may have been taken above).
        if let Some(exec) = exec_loop.filter(|exec| !exec.is_finished()) {
            exec.abort();
            let _ = exec.await;
        }
        // The last answers and job records may still be queued in the client: write them out.
        if let Err(e) = fleet_client::nats_conn::flush_for_stop(&self.client).await {
            tracing::warn!(worker = %self.id, error = %e, "cannot flush the last answers");
        }
        self.tasks.abort_all();
        while self.tasks.join_next().await.is_some() {}
        self.pool.shutdown().await;
    }
}

impl Drop for WorkerNode {
    fn drop(&mut self) {
        if let Some(exec) = &self.exec_loop {
            exec.abort();
        }
    }
}

impl std::fmt::Debug for Ctx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ctx")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

async fn heartbeat(ctx: &Ctx) {
    if ctx.draining.load(Ordering::SeqCst) {
        // A draining worker has left the registry and must not re-enter it.
        return;
    }
    let info = WorkerInfo {
        id: ctx.id.clone(),
        capacity_long_jobs: ctx.capacity,
        long_jobs_running: usize::try_from(ctx.running_long.load(Ordering::Relaxed)).unwrap_or(usize::MAX),
        sessions_warm: ctx
            .pool
            .sessions()
            .iter()
            .take(256)
            .map(|s| (user_key(s.user()), s.tool_id().to_string()))
            .collect(),
        started_at_ms: ctx.started_at_ms,
        seal_key: Some(ctx.seals.session_key().to_owned()),
    };
    if let Err(e) = ctx.store.heartbeat_worker(&info).await {
        ctx.metrics.jetstream_error("heartbeat_worker");
        tracing::warn!(worker = %ctx.id, error = %e, "registry heartbeat failed");
    }
}

/// Prepares every plugin version published from now on before its first call: the worker that the rendezvous
/// ranks first for the tool id (among the live ones) installs it and describes it, so `tools.list` lists it at
/// once. The others install it lazily on their first call, as before.
///
/// `first` is the watch [`WorkerNode::start`] opened before the worker registered (`None` if that failed).
async fn prepare_published(
    ctx: Arc<Ctx>,
    installer: Arc<crate::plugins::Installer>,
    mut first: Option<PublishedWatch>,
) {
    // The watch ends when its consumer is lost (a NATS restart): watch again, from then on.
    const REWATCH_AFTER: Duration = Duration::from_secs(1);
    loop {
        let watch = match first.take() {
            Some(watch) => Some(watch),
            None => watch_published(&ctx, &installer).await,
        };
        if let Some(mut updates) = watch {
            while let Some(tool_id) = updates.next().await {
                prepare_one(&ctx, &installer, &tool_id).await;
            }
            tracing::info!(worker = %ctx.id, "the watch of published plugins ended; watching again");
        }
        tokio::time::sleep(REWATCH_AFTER).await;
    }
}

/// The tool ids of plugin versions published from the moment it was opened.
type PublishedWatch = std::pin::Pin<Box<dyn futures::Stream<Item = String> + Send>>;

/// Opens a watch of published plugins; `None` (logged) when the store refuses.
async fn watch_published(ctx: &Ctx, installer: &crate::plugins::Installer) -> Option<PublishedWatch> {
    match installer.plugins().watch_published().await {
        Ok(updates) => Some(Box::pin(updates)),
        Err(e) => {
            tracing::warn!(worker = %ctx.id, error = %e, "cannot watch published plugins (retrying): until then they are described on first use");
            None
        }
    }
}

/// Installs and describes a newly published `tool_id` if this worker is the first the rendezvous ranks for it.
async fn prepare_one(ctx: &Ctx, installer: &crate::plugins::Installer, tool_id: &str) {
    if ctx.pool.catalogue().get(tool_id).is_some() {
        return;
    }
    let live = ctx.store.live_workers().await.unwrap_or_default();
    let first = crate::dispatch::rank(live.iter().map(|w| w.id.as_str()), tool_id)
        .into_iter()
        .next();
    if first.as_deref().is_some_and(|f| f != ctx.id) {
        return;
    }
    if let Err(e) = installer.ensure(&ctx.pool, tool_id).await {
        tracing::warn!(%tool_id, error = %e, "preparing the published plugin failed");
    }
}

/// Describes every catalogue plugin once (under an internal user) and records its manifest for `tools.list`.
async fn publish_manifests(ctx: &Ctx) {
    // The fleet's own user (a token cannot name it), as for a published plugin's describe.
    const CATALOGUE_USER: &str = crate::plugins::installer::DESCRIBE_USER;
    let ids: Vec<String> = ctx
        .pool
        .catalogue()
        .iter()
        .filter(|i| i.enabled)
        .map(|i| i.tool_id.clone())
        .collect();
    for tool_id in ids {
        // The dialect of every catalogue install is detected now, at load, even when its manifest is already
        // recorded: a refused or changed plugin is reported at start-up rather than in a user's job.
        if let Err(e) = ctx.pool.dialect(&tool_id).await {
            tracing::warn!(%tool_id, error = %e, "plugin refused at detection");
            continue;
        }
        if matches!(ctx.store.manifest(&tool_id).await, Ok(Some(_))) {
            continue;
        }
        // Either dialect: Executa `describe`, or the tools an Animus plugin maps to (detected first, once).
        match ctx
            .pool
            .describe(CATALOGUE_USER, &tool_id, DESCRIBE_TIMEOUT_FIRST_LAUNCH)
            .await
        {
            Ok(m) => {
                if let Err(e) = ctx.store.put_manifest(&tool_id, &m).await {
                    ctx.metrics.jetstream_error("put_manifest");
                    tracing::warn!(%tool_id, error = %e, "cannot record the manifest");
                }
            }
            Err(e) => tracing::warn!(%tool_id, error = %e, "describing the plugin failed"),
        }
    }
}

async fn respond(ctx: &Ctx, msg: &async_nats::Message, reply: &ExecReply) {
    let Some(to) = msg.reply.clone() else { return };
    let payload = serde_json::to_vec(reply).unwrap_or_default();
    if let Err(e) = ctx.client.publish(to, Bytes::from(payload)).await {
        tracing::warn!(error = %e, "cannot answer an exec request");
    }
}

/// Whether a worker connected with `creds` (none: a server without authorization) may answer apps' sync calls
/// on their reply subjects itself: its NATS user must be allowed to publish on them
/// ([`IMPORTED_REPLIES`](crate::nats_auth::permissions::IMPORTED_REPLIES)). A credential issued before that grant
/// is said once; the answers then go through the front, as before.
pub fn direct_replies_allowed(creds: Option<&std::path::Path>) -> bool {
    let Some(path) = creds else { return true };
    let allowed = std::fs::read_to_string(path).is_ok_and(|text| {
        fleet_client::creds::creds_publish_allows(&text, crate::nats_auth::permissions::IMPORTED_REPLIES)
    });
    if !allowed {
        tracing::info!(
            creds = %path.display(),
            "the worker's NATS user may not publish on apps' reply subjects (_R_.>): answers go through the front; re-issue the credentials (fleet nats-auth init) to save that hop"
        );
    }
    allowed
}

/// Publishes the API answer of a finished sync call on the caller's own reply subject `to` (the front chose it and
/// sealed it with the request; only an imported request's reply subject is ever answered), then tells the front
/// it did, with the outcome but not the data. If it cannot, the front gets the whole reply and answers itself.
async fn deliver(ctx: &Ctx, msg: &async_nats::Message, to: &str, reply: ExecReply) {
    if to.starts_with(subjects::IMPORTED_REPLY_PREFIX) {
        let answer: ApiResponse<Value> = crate::exec_answer::api_answer(&reply).into();
        if let Ok(payload) = serde_json::to_vec(&answer)
            && ctx
                .client
                .publish(to.to_owned(), Bytes::from(payload))
                .await
                .is_ok()
        {
            ctx.metrics.direct_reply();
            let error = match answer {
                ApiResponse::Ok(_) => None,
                ApiResponse::Err(e) => Some(e),
            };
            let delivered = ExecReply {
                success: error.is_none(),
                data: None,
                error,
                draining: false,
                delivered: true,
            };
            return respond(ctx, msg, &delivered).await;
        }
    }
    respond(ctx, msg, &reply).await;
}

fn refuse(error: ApiError) -> ExecReply {
    ExecReply {
        success: false,
        data: None,
        error: Some(error),
        draining: false,
        delivered: false,
    }
}

async fn serve_exec(ctx: Arc<Ctx>, msg: async_nats::Message) {
    // `worker.exec`: a child of the front's `worker.request` through the W3C context in the message headers.
    let span = tracing::info_span!(
        "worker.exec",
        otel.kind = "server",
        messaging.system = "nats",
        fleet.worker = %ctx.id,
        fleet.exec.kind = tracing::field::Empty,
        gen_ai.tool.name = tracing::field::Empty,
        executa.tool_id = tracing::field::Empty,
        executa.invoke_id = tracing::field::Empty,
    );
    crate::telemetry::extract_into(&span, msg.headers.as_ref());
    serve_exec_traced(ctx, msg).instrument(span).await;
}

/// Whether `msg` carries a valid seal of a front; a refusal is counted and logged (the reason only: nothing of
/// the message).
/// Answers the sweepers' "which of these jobs do you still run?" ([`JobsHeldQuery`]) from [`Ctx::jobs_here`]: a job
/// recorded as running here that this worker does not hold was lost by it (its start or its outcome never
/// completed here), and a sweeper fails it rather than let it wait for its deadline. Answered while draining too
/// (a draining worker still runs its jobs). Unsealed or malformed queries, and queries over
/// [`JOBS_HELD_QUERY_MAX`] ids, get no answer.
async fn answer_jobs_held(ctx: Arc<Ctx>, mut sub: async_nats::Subscriber) {
    while let Some(msg) = sub.next().await {
        let Some(reply) = msg.reply.clone() else { continue };
        if !sealed(&ctx, &msg) {
            continue;
        }
        let Ok(query) = serde_json::from_slice::<JobsHeldQuery>(&msg.payload) else {
            continue;
        };
        if query.job_ids.len() > JOBS_HELD_QUERY_MAX {
            continue;
        }
        let held: Vec<JobId> = {
            let here = ctx
                .jobs_here
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            query.job_ids.into_iter().filter(|j| here.contains(j)).collect()
        };
        let Ok(answer) = serde_json::to_vec(&JobsHeld { held }) else {
            continue;
        };
        if let Err(e) = ctx.client.publish(reply, answer.into()).await {
            tracing::warn!(worker = %ctx.id, error = %e, "cannot answer which jobs it holds");
        }
    }
}

fn sealed(ctx: &Ctx, msg: &async_nats::Message) -> bool {
    match ctx
        .seals
        .verify(msg.subject.as_str(), msg.headers.as_ref(), &msg.payload)
    {
        Ok(()) => true,
        Err(e) => {
            ctx.metrics.exec_seal_refused(e.as_str());
            tracing::warn!(worker = %ctx.id, reason = e.as_str(), "refused a message on a worker subject: {e}");
            false
        }
    }
}

async fn serve_exec_traced(ctx: Arc<Ctx>, msg: async_nats::Message) {
    // Nothing unsealed runs or is answered: its reply subject is the sender's choice, and a worker publishes
    // nothing on a stranger's behalf.
    if !sealed(&ctx, &msg) {
        return;
    }
    if ctx.draining.load(Ordering::SeqCst) {
        return respond(&ctx, &msg, &ExecReply::draining()).await;
    }
    let mut req: ExecRequest = match serde_json::from_slice(&msg.payload) {
        Ok(r) => r,
        Err(e) => {
            return respond(
                &ctx,
                &msg,
                &refuse(ApiError::new(ApiErrorCode::InvalidArg, e.to_string())),
            )
            .await;
        }
    };
    let span = tracing::Span::current();
    span.record(
        "fleet.exec.kind",
        match req.kind {
            ExecKind::Sync => "sync",
            ExecKind::Job => "job",
        },
    );
    span.record("gen_ai.tool.name", req.tool.as_str());
    span.record("executa.tool_id", req.plugin.as_str());
    span.record("executa.invoke_id", req.invoke_id.as_str());
    // A lazy install, then the call itself, can take long: the front hears every second that it still runs.
    match req.kind {
        ExecKind::Sync => {
            let reply_to = req.reply_to.take();
            let ctx_ = &ctx;
            let outcome = fleet_client::nats_conn::keeping_alive(&ctx.client, &msg, async move {
                ensure_plugin(ctx_, &req).await?;
                Ok::<_, ApiError>(run_sync(ctx_, req).await)
            })
            .await;
            let reply = match outcome {
                Ok(reply) => reply,
                Err(e) => return respond(&ctx, &msg, &refuse(e)).await,
            };
            match reply_to.as_deref() {
                Some(to) if ctx.direct_replies && !reply.passes_to_next_worker() => {
                    deliver(&ctx, &msg, to, reply).await;
                }
                _ => respond(&ctx, &msg, &reply).await,
            }
        }
        ExecKind::Job => {
            let ensured =
                fleet_client::nats_conn::keeping_alive(&ctx.client, &msg, ensure_plugin(&ctx, &req)).await;
            if let Err(e) = ensured {
                return respond(&ctx, &msg, &refuse(e)).await;
            }
            let Ok(permit) = ctx.long_jobs.clone().try_acquire_owned() else {
                ctx.metrics.rejection("long_job_capacity");
                let e = ApiError::with_details(
                    ApiErrorCode::LongJobCapacity,
                    format!("this worker runs its {} long jobs", ctx.capacity),
                    json!({ "retriable": true }),
                );
                return respond(&ctx, &msg, &refuse(e)).await;
            };
            respond(
                &ctx,
                &msg,
                &ExecReply {
                    success: true,
                    data: None,
                    error: None,
                    draining: false,
                    delivered: false,
                },
            )
            .await;
            run_held_job(&ctx, req, permit).await;
        }
    }
}

/// Makes sure the plugin of `req` is installed here: a tool id the local catalogue does not have may be published
/// to the fleet — installed lazily (or switched to its new current version) before the call; the local catalogue
/// always wins. `permission_denied` for a tool id nobody has.
async fn ensure_plugin(ctx: &Ctx, req: &ExecRequest) -> Result<(), ApiError> {
    let published = match (&ctx.installer, ctx.pool.catalogue().get(&req.plugin)) {
        (_, Some(_)) => Ok(true),
        (None, None) => Ok(false),
        (Some(installer), None) => installer
            .ensure(&ctx.pool, &req.plugin)
            .await
            .map(|e| e != crate::plugins::installer::Ensured::Unknown),
    };
    match published {
        Ok(true) => Ok(()),
        Ok(false) => Err(ApiError::new(
            ApiErrorCode::PermissionDenied,
            format!("unknown tool_id {:?}", req.tool_id),
        )),
        Err(e) => {
            tracing::warn!(tool_id = %req.plugin, error = %e, "plugin install failed");
            Err(e.to_api_error())
        }
    }
}

/// Runs a job holding one of the worker's long-job permits; the slot is announced free as soon as it is.
async fn run_held_job(ctx: &Arc<Ctx>, req: ExecRequest, permit: OwnedSemaphorePermit) {
    ctx.running_long.fetch_add(1, Ordering::Relaxed);
    run_job(ctx, req).await;
    ctx.running_long.fetch_sub(1, Ordering::Relaxed);
    drop(permit);
    // Tell the registry a slot is free now rather than at the next tick.
    heartbeat(ctx).await;
}

/// The job queue's consumer on this worker: whenever one of its long-job permits is free, pulls one queued job
/// and starts it here (`queued → running` by compare-and-set in [`run_job`]: never run twice). A message whose
/// job is no longer queued is acknowledged and dropped; a message this worker cannot serve now (draining, an
/// unreadable record, an install failing for a reason other than an unknown tool) is handed back at once.
async fn pull_queued_jobs(ctx: Arc<Ctx>) {
    let queue = loop {
        match ctx.store.job_queue().await {
            Ok(q) => break q,
            Err(e) => {
                ctx.metrics.jetstream_error("job_queue");
                tracing::warn!(worker = %ctx.id, error = %e, "cannot attach to the job queue; retrying");
                tokio::time::sleep(QUEUE_RETRY_AFTER).await;
            }
        }
    };
    loop {
        let Ok(permit) = ctx.long_jobs.clone().acquire_owned().await else {
            return;
        };
        if ctx.draining.load(Ordering::SeqCst) {
            return;
        }
        let pulled = match queue.next(QUEUE_PULL_WAIT).await {
            Ok(Some(pulled)) => pulled,
            Ok(None) => continue,
            Err(e) => {
                ctx.metrics.jetstream_error("job_queue");
                tracing::warn!(worker = %ctx.id, error = %e, "cannot pull from the job queue");
                tokio::time::sleep(QUEUE_RETRY_AFTER).await;
                continue;
            }
        };
        // In flight from the pull on: a drain waits for this job's hand-over (ack and start, or hand back).
        let guard = ctx.in_flight.enter();
        if ctx.draining.load(Ordering::SeqCst) {
            let _ = pulled.hand_back().await;
            return;
        }
        let Some(job) = pulled.job.clone() else {
            tracing::warn!(worker = %ctx.id, "dropping a job queue message that does not parse");
            let _ = pulled.ack().await;
            continue;
        };
        let record = match ctx.store.get_job(&job.user, &job.job_id).await {
            Ok(Some(r)) if r.value.state == JobState::Queued => r.value,
            Ok(_) => {
                // Started elsewhere, ended, or gone: nothing to do.
                let _ = pulled.ack().await;
                continue;
            }
            Err(e) => {
                ctx.metrics.jetstream_error("get_job");
                tracing::warn!(job = %job.job_id, error = %e, "cannot read a queued job");
                let _ = pulled.hand_back().await;
                continue;
            }
        };
        // Only what a front sealed is run, or even prepared for (checked again on the record the start writes).
        if let Err(why) = ctx.seals.verify_job(&record) {
            ctx.steps().fail_unsealed(&record, why, "worker").await;
            let _ = pulled.ack().await;
            continue;
        }
        let req = crate::dispatch::job_request(&record);
        if let Err(e) = ensure_plugin(&ctx, &req).await {
            if e.code == ApiErrorCode::PermissionDenied {
                ctx.steps().fail_undispatchable(&record, e).await;
                let _ = pulled.ack().await;
            } else {
                let _ = pulled.hand_back().await;
            }
            continue;
        }
        // A drain that began while the job was read and its plugin prepared: another worker takes it.
        if ctx.draining.load(Ordering::SeqCst) {
            let _ = pulled.hand_back().await;
            return;
        }
        // Acknowledged before the start: a worker dying in between leaves the job queued, and the sweeper
        // dispatches it (a job is never lost, only delayed by one sweep).
        let _ = pulled.ack().await;
        let c = ctx.clone();
        tokio::spawn(async move {
            run_held_job(&c, req, permit).await;
            drop(guard);
        });
    }
}

async fn run_sync(ctx: &Ctx, req: ExecRequest) -> ExecReply {
    // The plugin resolved once for the whole call (install, dialect, session), then its session warmed so the
    // manifest's per-tool timeout is known (spec §16 A-3). (Animus installs have no Executa session: the
    // default timeout applies.)
    let target = match ctx.pool.target(&req.user, &req.plugin).await {
        Ok(t) => t,
        Err(e) => {
            if matches!(e, PoolError::Capacity { .. }) {
                ctx.metrics.rejection("worker_capacity");
            }
            let timeout_ms = policy::effective_timeout_ms(
                req.timeout_ms,
                None,
                req.default_timeout_ms,
                req.max_timeout_ms,
            );
            return refuse(failure(&e, timeout_ms, req.requested_timeout_ms));
        }
    };
    if let Target::Executa(session) = &target {
        let _ = session.prewarm(Duration::from_secs(60)).await;
    }
    let manifest_ms = target
        .manifest_timeout(&req.tool)
        .and_then(|d| u64::try_from(d.as_millis()).ok());
    let timeout_ms = policy::effective_timeout_ms(
        req.timeout_ms,
        manifest_ms,
        req.default_timeout_ms,
        req.max_timeout_ms,
    );
    // The arguments' tree is built here, where the plugin needs it (the front forwarded their text).
    let Ok(arguments) = req.arguments.to_map() else {
        return refuse(ApiError::invalid_arg("args", "args must be a JSON object"));
    };
    let invoke = InvokeRequest {
        tool: req.tool,
        arguments,
        invoke_id: req.invoke_id,
        timeout: Some(Duration::from_millis(timeout_ms)),
        deadline_ms: Some(now_ms() + timeout_ms),
        app_timeout_ms: Some(timeout_ms),
        extra_context: trace_context(),
        delegation: req.delegation,
        ..InvokeRequest::default()
    };
    match ctx.pool.run(&req.user, &req.plugin, target, invoke).await {
        Ok(out) => {
            if out.result_bytes() > MAX_SYNC_RESULT_BYTES {
                return refuse(ApiError::result_too_large(
                    out.result_bytes(),
                    MAX_SYNC_RESULT_BYTES,
                ));
            }
            match RawValue::from_string(out.result_json().to_string()) {
                Ok(raw) => ExecReply {
                    success: true,
                    data: Some(raw),
                    error: None,
                    draining: false,
                    delivered: false,
                },
                Err(e) => refuse(ApiError::new(ApiErrorCode::InternalError, e.to_string())),
            }
        }
        Err(e) => {
            if matches!(e, PoolError::Capacity { .. }) {
                ctx.metrics.rejection("worker_capacity");
            }
            refuse(failure(&e, timeout_ms, req.requested_timeout_ms))
        }
    }
}

/// Maps a worker failure onto the API's codes.
fn failure(e: &PoolError, timeout_ms: u64, requested_ms: Option<u64>) -> ApiError {
    let message = e.to_string();
    match e {
        PoolError::Invoke(InvokeError::Timeout(_)) => ApiError {
            code: ApiErrorCode::ToolTimeout,
            message,
            details: policy::timeout_details(timeout_ms, requested_ms),
        },
        PoolError::Invoke(InvokeError::Cancelled) => ApiError::new(ApiErrorCode::Cancelled, message),
        PoolError::Invoke(InvokeError::Plugin(err)) => ApiError::with_details(
            ApiErrorCode::ExecutaError,
            message,
            json!({ "code": err.code, "message": err.message, "data": err.data }),
        ),
        PoolError::Invoke(InvokeError::UnknownTool { tool, .. }) => {
            ApiError::invalid_arg("method", format!("the plugin has no tool {tool:?}"))
        }
        // Spec §4.2: "the plugin won't be enabled until required keys are set". The spec names no code; the
        // plugin is not available to this user until an operator sets them (docs/api.md).
        PoolError::Invoke(InvokeError::CredentialsRequired { missing }) => ApiError::with_details(
            ApiErrorCode::PermissionDenied,
            message,
            json!({ "reason": "credentials_required", "missing": missing, "retriable": false }),
        ),
        PoolError::Invoke(InvokeError::FrameTooLarge {
            frame_bytes,
            max_frame_bytes,
        }) => ApiError::result_too_large(
            usize::try_from(*frame_bytes).unwrap_or(usize::MAX),
            usize::try_from(*max_frame_bytes).unwrap_or(usize::MAX),
        ),
        PoolError::Capacity { .. }
        | PoolError::Invoke(InvokeError::TooManyInFlight { .. })
        | PoolError::Closed => ApiError::new(ApiErrorCode::AgentUnavailable, message),
        PoolError::UnknownPlugin(_) => ApiError::new(ApiErrorCode::PermissionDenied, message),
        // Refused at detection or quarantined: retrying the same install cannot help. Only a refusal of the
        // plugin's answer is about its dialect; a program that does not start is a launch failure.
        PoolError::Refused(err) => {
            let stage = err.stage();
            // A failed preparation (a `uv sync` timeout…) is tried again by the next call.
            let retriable = stage == fleet_worker::animus::RefusalStage::Prepare;
            let mut details = json!({ "retriable": retriable, "stage": stage.as_str() });
            if stage == fleet_worker::animus::RefusalStage::Dialect {
                details["dialect"] = json!("animus");
            }
            ApiError::with_details(ApiErrorCode::ExecutaUnavailable, message, details)
        }
        PoolError::NotExecuta(_) => ApiError::with_details(
            ApiErrorCode::ExecutaUnavailable,
            message,
            json!({ "retriable": false, "dialect": "animus" }),
        ),
        // Animus errors by the spec's table (§3.4), host → plugin direction.
        PoolError::Invoke(InvokeError::Animus { class, error }) => {
            use fleet_worker::proto::animus::RunErrorClass;
            let details = json!({
                "dialect": "animus",
                "class": class.as_str(),
                "code": error.code,
                "message": error.message,
                "data": error.data,
                "retriable": *class == RunErrorClass::Unavailable,
            });
            let code = match class {
                RunErrorClass::InvalidArguments => ApiErrorCode::InvalidArg,
                RunErrorClass::Unavailable => ApiErrorCode::ExecutaUnavailable,
                RunErrorClass::Unsupported | RunErrorClass::NotInitialized => ApiErrorCode::ExecutaError,
                _ => ApiErrorCode::ToolFailed,
            };
            ApiError::with_details(code, message, details)
        }
        _ => ApiError::with_details(
            ApiErrorCode::ExecutaUnavailable,
            message,
            json!({ "retriable": true }),
        ),
    }
}

/// The terminal state and record fields for an invoke's outcome.
fn job_outcome(
    result: &Result<InvokeOutput, PoolError>,
    timeout_ms: u64,
) -> (JobState, Option<Value>, Option<ApiError>) {
    match result {
        Ok(out) if out.success() => {
            let data = out.data_json().unwrap_or("{}");
            if data.len() > MAX_JOB_RESULT_BYTES {
                return (
                    JobState::Failed,
                    None,
                    Some(ApiError::result_too_large(data.len(), MAX_JOB_RESULT_BYTES)),
                );
            }
            // The payload lands as an object (spec §4.4 HR-RD-05: "forced to object").
            let value = match serde_json::from_str::<Value>(data) {
                Ok(v @ Value::Object(_)) => v,
                Ok(other) => json!({ "value": other }),
                Err(_) => json!({}),
            };
            (JobState::Succeeded, Some(value), None)
        }
        Ok(out) => (
            JobState::Failed,
            None,
            Some(ApiError::new(
                ApiErrorCode::ToolFailed,
                out.error_message().unwrap_or("the tool failed"),
            )),
        ),
        Err(PoolError::Invoke(InvokeError::Timeout(_))) => (
            JobState::Expired,
            None,
            Some(ApiError::new(
                ApiErrorCode::ToolTimeout,
                format!("the job's deadline passed after {timeout_ms} ms"),
            )),
        ),
        Err(PoolError::Invoke(InvokeError::Cancelled)) => (
            JobState::Cancelled,
            None,
            Some(ApiError::new(ApiErrorCode::Cancelled, "cancelled")),
        ),
        Err(e) => (JobState::Failed, None, Some(failure(e, timeout_ms, None))),
    }
}

async fn run_job(ctx: &Arc<Ctx>, req: ExecRequest) {
    let Some(job_id) = req.job_id.clone() else { return };
    let Some(_here) = JobHere::enter(ctx, &job_id) else {
        return; // this worker starts or runs it already
    };
    let user = req.user.clone();
    let id = ctx.id.clone();
    let start = now_ms();
    // queued → running, by CAS, before the plugin sees anything. This worker told the front it took the job: a
    // store that does not answer for a while (a NATS node lost) is waited out, up to the job's deadline, rather
    // than leaving the job to the sweeper's next dispatch. Safe to repeat: an attempt whose write got through
    // although its answer was lost is recognised by the next one (running, under this worker, from `start`).
    let steps = ctx.steps();
    let started = fleet_store::failover::ride_out(
        fleet_store::Op::Transition,
        fleet_store::failover::give_up_at(req.deadline_ms.map(fleet_store::failover::instant_of_epoch_ms)),
        || {
            steps.step(&user, &job_id, JobState::Running, Decider::Worker, |r| {
                r.worker = Some(id.clone());
                r.started_at_ms = Some(start);
                r.last_heartbeat_ms = Some(start);
                r.attempt += 1;
            })
        },
        |_| ctx.metrics.jetstream_error("start_job"),
    )
    .await;
    let written = match started {
        Ok(Transition::Done(r)) => r,
        Ok(Transition::Refused(r))
            if r.value.state == JobState::Running
                && r.value.worker.as_deref() == Some(id.as_str())
                && r.value.started_at_ms == Some(start) =>
        {
            r
        }
        Ok(_) => return, // cancelled, expired, started elsewhere or gone before it started
        Err(e) => {
            tracing::warn!(job = %job_id, error = %e, "cannot start the job");
            return;
        }
    };
    let record = written.value.clone();
    // What runs is the record this start won (whoever dispatched it, from whatever it read): only when a front
    // sealed it, and before its sealed deadline. The plugin sees nothing of a job refused here.
    if let Err(why) = ctx.seals.verify_job(&record) {
        ctx.steps().fail_unsealed(&record, why, "worker").await;
        return;
    }
    if now_ms() >= record.deadline_ms {
        let _ = steps
            .step_from(&user, &job_id, written, JobState::Expired, |r| {
                r.finished_at_ms = Some(now_ms());
                r.error = Some(ApiError::new(
                    ApiErrorCode::ToolTimeout,
                    "the job's deadline passed before it started",
                ));
            })
            .await;
        return;
    }
    // The record as this run last wrote it (the start, then each heartbeat): the outcome is written over it
    // without reading it first ([`JobSteps::step_from`]; a write by anyone else since is caught by its revision).
    let latest = Arc::new(std::sync::Mutex::new(written));
    let started_at_ms = record.started_at_ms.unwrap_or_else(now_ms);
    ctx.metrics.queue_wait(
        &record.plugin,
        Duration::from_millis(started_at_ms.saturating_sub(record.created_at_ms)),
    );

    // Progress: the plugin's reader hands events to this channel (never blocking); a task stores them in order.
    let (tx, mut rx) = mpsc::channel::<ProgressUpdate>(PROGRESS_BUFFER);
    let sink: fleet_worker::session::progress::ProgressSink = Arc::new(move |u| {
        let _ = tx.try_send(u);
    });
    let progress_ctx = ctx.clone();
    let (p_user, p_job, p_tool) = (user.clone(), job_id.clone(), record.tool_id.clone());
    let mut seq = record.last_seq;
    // What the job's ring keeps, for its user's storage account: the bytes of the newest `progress_max_per_job`
    // events (an earlier attempt's events, whose sizes this run does not know, at their bound).
    let ring_len = ctx.store.settings().progress_max_per_job;
    let earlier_event_bound = ctx.store.settings().ring_storage_bound(1);
    let mut ring: VecDeque<u64> = std::iter::repeat_n(
        earlier_event_bound,
        usize::try_from(seq).unwrap_or(usize::MAX).min(ring_len),
    )
    .collect();
    let progress_task = tokio::spawn(async move {
        while let Some(update) = rx.recv().await {
            seq += 1;
            let data = serde_json::from_str(update.data.get()).unwrap_or(Value::Null);
            let event = ProgressEvent {
                seq,
                kind: update.kind,
                data,
            };
            match progress_ctx.store.append_progress(&p_user, &p_job, &event).await {
                Ok(kept) => {
                    if ring.len() == ring_len {
                        ring.pop_front();
                    }
                    ring.push_back(kept);
                }
                Err(e) => {
                    progress_ctx.metrics.jetstream_error("append_progress");
                    tracing::warn!(job = %p_job, error = %e, "cannot store a progress event");
                    continue;
                }
            }
            progress_ctx
                .steps()
                .progress(&p_user, &p_job, &p_tool, event)
                .await;
        }
        (seq, ring.iter().fold(0u64, |a, b| a.saturating_add(*b)))
    });
    // Heartbeats of the running job.
    let hb_ctx = ctx.clone();
    let (hb_user, hb_job, hb_latest) = (user.clone(), job_id.clone(), latest.clone());
    let heartbeat = tokio::spawn(async move {
        // The start wrote the first heartbeat.
        let mut tick = tokio::time::interval_at(
            tokio::time::Instant::now() + policy::HEARTBEAT_EVERY,
            policy::HEARTBEAT_EVERY,
        );
        loop {
            tick.tick().await;
            if let Ok(Some(now)) = hb_ctx
                .store
                .update_job(&hb_user, &hb_job, |r| {
                    r.last_heartbeat_ms = Some(now_ms());
                    true
                })
                .await
            {
                *hb_latest
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = now;
            }
        }
    });

    let timeout_ms = record.deadline_ms.saturating_sub(now_ms()).max(1);
    let invoke = InvokeRequest {
        tool: record.tool.clone(),
        arguments: record.args.clone(),
        invoke_id: job_id.to_string(),
        timeout: Some(Duration::from_millis(timeout_ms)),
        deadline_ms: Some(record.deadline_ms),
        app_timeout_ms: Some(record.timeout_ms),
        progress: Some(sink),
        extra_context: trace_context(),
        // The job's delegation (its record's, written by the front that accepted it): the token source keeps it
        // for the job's agent sessions, never the plugin.
        delegation: record.delegation.clone(),
        ..InvokeRequest::default()
    };
    let result = ctx.pool.invoke(&record.user, &record.plugin, invoke).await;
    if matches!(result, Err(PoolError::Capacity { .. })) {
        ctx.metrics.rejection("worker_capacity");
    }
    heartbeat.abort();
    let (last_seq, progress_bytes) = match progress_task.await {
        Ok(done) => (done.0, Some(done.1)),
        // The task panicked: its count is lost; the store charges the ring at its bound.
        Err(_) => (record.last_seq, None),
    };
    let (state, result_value, error) = job_outcome(&result, timeout_ms);
    // The outcome is the job's one product: a store that does not answer for a while (a NATS node lost) is
    // waited out. Safe to repeat: once written, the job is terminal and a second attempt is refused.
    let steps = ctx.steps();
    let done = fleet_store::failover::ride_out(
        fleet_store::Op::Transition,
        fleet_store::failover::give_up_at(None),
        || {
            let known = latest
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone();
            steps.step_from(&user, &job_id, known, state, |r| {
                r.finished_at_ms = Some(now_ms());
                r.result.clone_from(&result_value);
                r.error.clone_from(&error);
                r.last_seq = last_seq;
                r.progress_bytes = progress_bytes;
            })
        },
        |_| {},
    )
    .await;
    match done {
        Ok(Transition::Done(r)) => {
            let finished = r.value.finished_at_ms.unwrap_or_else(now_ms);
            ctx.metrics.run_time(
                &record.plugin,
                Duration::from_millis(finished.saturating_sub(started_at_ms)),
            );
        }
        // Ended meanwhile (cancelled, expired, failed by a sweeper): its outcome is not this run's to write.
        Ok(Transition::Refused(r)) if r.value.state.is_terminal() => {}
        Ok(other) => tracing::warn!(
            job = %job_id,
            found = match &other {
                Transition::Refused(r) => r.value.state.as_str(),
                _ => "no record",
            },
            "the job's outcome was refused: its record is not running here"
        ),
        Err(e) => tracing::warn!(job = %job_id, error = %e, "cannot record the job's outcome"),
    }
}

/// A job in [`Ctx::jobs_here`] for as long as it lives.
struct JobHere<'a> {
    ctx: &'a Ctx,
    job_id: JobId,
}

impl<'a> JobHere<'a> {
    /// `None` when this worker starts or runs `job_id` already.
    fn enter(ctx: &'a Ctx, job_id: &JobId) -> Option<Self> {
        let mut here = ctx
            .jobs_here
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        here.insert(job_id.clone()).then(|| JobHere {
            ctx,
            job_id: job_id.clone(),
        })
    }
}

impl Drop for JobHere<'_> {
    fn drop(&mut self) {
        self.ctx
            .jobs_here
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&self.job_id);
    }
}

/// The plugin's share of the trace: `context.traceparent` naming the current (`worker.exec`) span, when traced.
fn trace_context() -> serde_json::Map<String, Value> {
    let mut extra = serde_json::Map::new();
    if let Some(tp) = crate::telemetry::traceparent(&tracing::Span::current()) {
        extra.insert(crate::telemetry::TRACEPARENT.into(), Value::String(tp));
    }
    extra
}

/// The id a sync invoke gets: `tjob_`-shaped like jobs, so one format serves both (spec §16 A-13).
pub fn new_invoke_id() -> JobId {
    JobId::from_bytes(rand::random())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use fleet_worker::animus::DetectError;

    use super::*;

    /// A program that does not start is a launch failure; only a refusal of the plugin's answer names a dialect.
    #[test]
    fn a_launch_failure_is_not_reported_as_a_dialect() {
        let launch = failure(
            &PoolError::Refused(DetectError::Launch {
                program: "/root/.pyenv/shims/python3".into(),
                reason: "Permission denied (os error 13)".into(),
            }),
            1000,
            None,
        );
        assert_eq!(launch.code, ApiErrorCode::ExecutaUnavailable);
        assert_eq!(
            launch.details,
            Some(json!({ "retriable": false, "stage": "launch" }))
        );
        assert!(launch.message.contains("Permission denied"), "{}", launch.message);

        let kind = failure(
            &PoolError::Refused(DetectError::KindNotHosted { kind: "tool".into() }),
            1000,
            None,
        );
        assert_eq!(
            kind.details,
            Some(json!({ "retriable": false, "stage": "dialect", "dialect": "animus" }))
        );
    }
}
