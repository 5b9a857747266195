//! The engine: one NATS connection, tokens minted per user, open-model arrivals, and the recorder (per-operation
//! HDR histograms in µs, per-second buckets for the chart, error codes by count, job accounting).

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fleet_client::api::{ApiClient, NoAnswer};
use fleet_client::auth::{DEFAULT_AUDIENCE, DEFAULT_ISSUER, SigningKey};
use fleet_proto::api::{
    CancelJobArgs, CancelJobResult, GetJobArgs, InvokeArgs, InvokeAsyncArgs, InvokePayload, JobId, JobState,
    ListJobsArgs, ListJobsResult, ListToolsResult,
};
use hdrhistogram::Histogram;

/// Largest latency a histogram holds (1 h, in µs); larger values saturate.
const MAX_LATENCY_US: u64 = 3_600_000_000;
/// How often a followed job is polled with `tools.getJob`.
pub(crate) const POLL_EVERY: Duration = Duration::from_millis(250);

/// Locks, ignoring poisoning (a panicked task must not hide the rest of the report).
pub(crate) use fleet_proto::util::lock;

/// A non-negative, finite count or duration in f64 as u64 (saturating; NaN and negatives give 0).
#[allow(
    clippy::cast_possible_truncation,
    reason = "`as` saturates float-to-int, which is what is wanted"
)]
pub(crate) fn to_u64(x: f64) -> u64 {
    x as u64
}

fn histogram() -> Histogram<u64> {
    // Bounds are constants that are valid: 1 µs .. 1 h at 3 significant digits.
    Histogram::new_with_bounds(1, MAX_LATENCY_US, 3).expect("constant, valid histogram bounds")
}

/// Statistics of one operation.
#[derive(Debug)]
pub(crate) struct OpStats {
    /// Every measured latency, µs.
    pub(crate) hist: Histogram<u64>,
    /// Answers that were `ok`.
    pub(crate) ok: u64,
    /// Everything else (API errors, client timeouts, overload).
    pub(crate) errors: u64,
    /// Per 1-second bucket (by intended start), the latencies, µs.
    pub(crate) buckets: Vec<Histogram<u64>>,
}

impl OpStats {
    fn new() -> Self {
        OpStats {
            hist: histogram(),
            ok: 0,
            errors: 0,
            buckets: Vec::new(),
        }
    }
}

/// Job accounting.
#[derive(Debug, Default)]
pub(crate) struct Jobs {
    /// `invokeAsync` answered with a job id.
    pub(crate) accepted: AtomicU64,
    /// Jobs seen in a terminal state.
    pub(crate) terminal: AtomicU64,
    /// Terminal states by name.
    pub(crate) by_state: Mutex<BTreeMap<String, u64>>,
}

/// Everything a run measures.
#[derive(Debug)]
pub(crate) struct Recorder {
    /// Time zero of the run.
    pub(crate) start: Instant,
    /// Per operation.
    pub(crate) ops: Mutex<BTreeMap<String, OpStats>>,
    /// Error codes by count (the API's string codes, plus `timeout`, `no_responders`, `overload`, ...).
    pub(crate) errors: Mutex<BTreeMap<String, u64>>,
    /// Scenario-specific counters (progress events seen, jobs not cancelled, ...).
    pub(crate) counters: Mutex<BTreeMap<String, u64>>,
    /// Jobs.
    pub(crate) jobs: Jobs,
    /// Requests sent (for the live line).
    pub(crate) sent: AtomicU64,
}

impl Recorder {
    /// A recorder whose time zero is now.
    pub(crate) fn new() -> Self {
        Recorder {
            start: Instant::now(),
            ops: Mutex::new(BTreeMap::new()),
            errors: Mutex::new(BTreeMap::new()),
            counters: Mutex::new(BTreeMap::new()),
            jobs: Jobs::default(),
            sent: AtomicU64::new(0),
        }
    }

    /// Records one completed operation: latency from `intended` (the scheduled start) to now.
    pub(crate) fn record(&self, op: &str, intended: Instant, outcome: Result<(), &str>) {
        let now = Instant::now();
        let latency = u64::try_from(now.saturating_duration_since(intended).as_micros())
            .unwrap_or(MAX_LATENCY_US)
            .clamp(1, MAX_LATENCY_US);
        let bucket =
            usize::try_from(intended.saturating_duration_since(self.start).as_secs()).unwrap_or(usize::MAX);
        let mut ops = lock(&self.ops);
        let stats = ops.entry(op.to_string()).or_insert_with(OpStats::new);
        stats.hist.saturating_record(latency);
        if bucket < 24 * 3600 {
            while stats.buckets.len() <= bucket {
                stats.buckets.push(histogram());
            }
            if let Some(b) = stats.buckets.get_mut(bucket) {
                b.saturating_record(latency);
            }
        }
        match outcome {
            Ok(()) => stats.ok += 1,
            Err(code) => {
                stats.errors += 1;
                drop(ops);
                *lock(&self.errors).entry(code.to_string()).or_default() += 1;
            }
        }
    }

    /// Counts an error that has no latency (`overload`: the arrival was dropped, not delayed).
    pub(crate) fn record_dropped(&self, op: &str, code: &str) {
        lock(&self.ops)
            .entry(op.to_string())
            .or_insert_with(OpStats::new)
            .errors += 1;
        *lock(&self.errors).entry(code.to_string()).or_default() += 1;
    }

    /// Adds to a scenario counter.
    pub(crate) fn count(&self, name: &str, n: u64) {
        *lock(&self.counters).entry(name.to_string()).or_default() += n;
    }

    /// (completed ops, errors) so far.
    pub(crate) fn totals(&self) -> (u64, u64) {
        let ops = lock(&self.ops);
        ops.values()
            .fold((0, 0), |(c, e), s| (c + s.ok + s.errors, e + s.errors))
    }
}

impl Default for Recorder {
    fn default() -> Self {
        Recorder::new()
    }
}

/// A failed call: the API's error code, or a client-side one.
#[derive(Debug, Clone)]
pub(crate) struct CallError {
    /// `job_quota_exceeded`, `rate_limited`, ..., or `timeout`, `lost` (nothing heard from the fleet for
    /// `KEEPALIVE_SILENCE`: the request or its answer was lost with a NATS server), `no_responders`,
    /// `request_failed`, `bad_reply`.
    pub(crate) code: String,
    /// The message.
    pub(crate) message: String,
}

impl From<fleet_client::api::CallError> for CallError {
    /// The API's code, or the client-side code of a request without an answer (`timeout`, `lost`, `no_responders`,
    /// `max_payload_exceeded`, `request_failed`) or with an unreadable one (`bad_reply`).
    fn from(e: fleet_client::api::CallError) -> CallError {
        use fleet_client::api::CallError as E;
        let (code, message) = match e {
            E::Api(e) => (e.code.as_str(), e.message),
            E::NoAnswer { kind, detail, .. } => (
                match kind {
                    NoAnswer::TimedOut => "timeout",
                    NoAnswer::NoResponders => "no_responders",
                    NoAnswer::MaxPayloadExceeded => "max_payload_exceeded",
                    NoAnswer::Silent => "lost",
                    NoAnswer::ConnectionLost | NoAnswer::Failed => "request_failed",
                },
                detail,
            ),
            E::Connect(message) => ("request_failed", message),
            E::Unreadable(message) => ("bad_reply", message),
        };
        CallError {
            code: code.into(),
            message,
        }
    }
}

/// The shared context of a run.
#[derive(Debug)]
pub(crate) struct Ctx {
    /// The connection of the calls (an app credential).
    pub(crate) nats: async_nats::Client,
    /// The connection of operator calls and registry reads (the operator tooling credential).
    pub(crate) ops: async_nats::Client,
    key: SigningKey,
    /// The fleet's operator key (or why it is not available), for [`Ctx::admin`].
    operator_key: Result<SigningKey, String>,
    /// Each user's client: the connection with the user's token.
    clients: Mutex<HashMap<String, ApiClient>>,
    /// The measurements.
    pub(crate) rec: Recorder,
    /// Tasks in flight.
    pub(crate) in_flight: AtomicUsize,
    /// The concurrency guard: arrivals beyond this many tasks in flight are dropped as `overload`.
    pub(crate) max_in_flight: usize,
    /// After this instant, followers stop polling (their jobs count as lost).
    pub(crate) drain_deadline: Mutex<Instant>,
    /// Tag of this run (unique user names for cold starts, client tags).
    pub(crate) run_tag: String,
}

impl Ctx {
    /// A context over a connection and a signing key.
    pub(crate) fn new(
        nats: async_nats::Client,
        ops: async_nats::Client,
        key: SigningKey,
        max_in_flight: usize,
    ) -> Self {
        let run_tag = format!(
            "{:x}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis())
                .unwrap_or_default()
        );
        Ctx {
            nats,
            ops,
            key,
            operator_key: Err("no operator key was loaded".into()),
            clients: Mutex::new(HashMap::new()),
            rec: Recorder::new(),
            in_flight: AtomicUsize::new(0),
            max_in_flight,
            drain_deadline: Mutex::new(Instant::now() + Duration::from_secs(24 * 3600)),
            run_tag,
        }
    }

    /// `user`'s client (its token minted on first use). A call waits for its answer for its whole wait, even
    /// over a reconnect: its outcome is what the run measures.
    fn client(&self, user: &str) -> Result<ApiClient, CallError> {
        if let Some(c) = lock(&self.clients).get(user) {
            return Ok(c.clone());
        }
        let token = self
            .key
            .mint(
                user,
                DEFAULT_ISSUER,
                DEFAULT_AUDIENCE,
                Duration::from_secs(6 * 3600),
                false,
            )
            .map_err(|e| CallError {
                code: "mint_failed".into(),
                message: e.to_string(),
            })?;
        // As the fleet's own CLI does for app calls: keepalives asked for, so a request or answer lost with a NATS
        // server costs `KEEPALIVE_SILENCE` (`lost`), not the call's whole wait.
        let client = ApiClient::new(self.nats.clone(), token).keeping_alive_as_app();
        lock(&self.clients).insert(user.to_string(), client.clone());
        Ok(client)
    }

    /// One API call as `user` (`call` sends it with the user's client); counted as sent, not measured.
    pub(crate) async fn call<T, F, Fut>(&self, user: &str, call: F) -> Result<T, CallError>
    where
        F: FnOnce(ApiClient) -> Fut,
        Fut: Future<Output = Result<T, fleet_client::api::CallError>>,
    {
        let client = self.client(user)?;
        self.rec.sent.fetch_add(1, Ordering::Relaxed);
        call(client).await.map_err(CallError::from)
    }

    /// `tools.list` as `user`, not measured.
    pub(crate) async fn list_tools(&self, user: &str, wait: Duration) -> Result<ListToolsResult, CallError> {
        self.call(user, |c| async move { c.list_tools(wait).await }).await
    }

    /// Operator calls sign with `key` (the fleet's dev operator key) from now on.
    pub(crate) fn with_operator_key(mut self, key: Result<SigningKey, String>) -> Self {
        self.operator_key = key;
        self
    }

    /// An operator client (`fleet.v1.admin.*`) whose token is minted with the operator key; not measured.
    pub(crate) fn operator(&self) -> Result<ApiClient, CallError> {
        let key = self.operator_key.as_ref().map_err(|e| CallError {
            code: "no_operator_key".into(),
            message: e.clone(),
        })?;
        let token = key
            .mint(
                &format!("loadtest-operator-{}", self.run_tag),
                DEFAULT_ISSUER,
                fleet_client::auth::OPERATOR_AUDIENCE,
                Duration::from_secs(600),
                false,
            )
            .map_err(|e| CallError {
                code: "mint_failed".into(),
                message: e.to_string(),
            })?;
        Ok(ApiClient::new(self.ops.clone(), token))
    }

    /// One measured call ([`Ctx::call`]): the latency runs from `intended` (an open-model arrival's scheduled
    /// start, or now).
    pub(crate) async fn op<T, F, Fut>(
        &self,
        op: &str,
        intended: Instant,
        user: &str,
        call: F,
    ) -> Result<T, CallError>
    where
        F: FnOnce(ApiClient) -> Fut,
        Fut: Future<Output = Result<T, fleet_client::api::CallError>>,
    {
        let r = self.call(user, call).await;
        self.rec
            .record(op, intended, r.as_ref().map(|_| ()).map_err(|e| e.code.as_str()));
        r
    }

    /// `tools.invoke`, measured as `op`.
    pub(crate) async fn invoke(
        &self,
        op: &str,
        intended: Instant,
        user: &str,
        args: &InvokeArgs,
        wait: Duration,
    ) -> Result<InvokePayload, CallError> {
        self.op(op, intended, user, |c| async move { c.invoke(args, wait).await })
            .await
    }

    /// `tools.invokeAsync` of the call `args` names (without its sync timeout); counts the job as accepted when
    /// it gets an id.
    pub(crate) async fn invoke_async(
        &self,
        op: &str,
        intended: Instant,
        user: &str,
        args: &InvokeArgs,
    ) -> Option<JobId> {
        let args = InvokeAsyncArgs {
            tool_id: args.tool_id.clone(),
            method: args.method.clone(),
            args: args.args.clone(),
            timeout_ms: None,
            client_tag: None,
        };
        let r = self
            .op(op, intended, user, |c| async move {
                c.invoke_async(&args, Duration::from_secs(30)).await
            })
            .await;
        let id = r.ok()?.job_id;
        self.rec.jobs.accepted.fetch_add(1, Ordering::Relaxed);
        Some(id)
    }

    /// `tools.cancelJob`, measured as `op` from now.
    pub(crate) async fn cancel_job(
        &self,
        op: &str,
        user: &str,
        args: &CancelJobArgs,
        wait: Duration,
    ) -> Result<CancelJobResult, CallError> {
        self.op(op, Instant::now(), user, |c| async move {
            c.cancel_job(args, wait).await
        })
        .await
    }

    /// `tools.listJobs`, measured as `op`.
    pub(crate) async fn list_jobs(
        &self,
        op: &str,
        intended: Instant,
        user: &str,
        args: &ListJobsArgs,
        wait: Duration,
    ) -> Result<ListJobsResult, CallError> {
        self.op(
            op,
            intended,
            user,
            |c| async move { c.list_jobs(args, wait).await },
        )
        .await
    }

    /// Polls `tools.getJob` until the job is terminal (counted) or the drain deadline passes (then it is lost).
    /// Progress events seen are counted under `progress_events`. Returns the terminal state.
    pub(crate) async fn follow(&self, user: &str, job_id: &JobId) -> Option<JobState> {
        let mut since = 0u64;
        loop {
            let args = GetJobArgs {
                job_id: job_id.clone(),
                since_seq: Some(since),
                limit: Some(500),
            };
            let args = &args;
            if let Ok(snap) = self
                .op("getJob", Instant::now(), user, |c| async move {
                    c.get_job(args, Duration::from_secs(10)).await
                })
                .await
            {
                let events = snap.progress.len();
                if events > 0 {
                    self.rec.count("progress_events", events as u64);
                }
                since = snap.last_seq;
                if snap.state.is_terminal() {
                    self.rec.jobs.terminal.fetch_add(1, Ordering::Relaxed);
                    *lock(&self.rec.jobs.by_state)
                        .entry(snap.state.as_str().to_string())
                        .or_default() += 1;
                    return Some(snap.state);
                }
            }
            if Instant::now() >= *lock(&self.drain_deadline) {
                return None;
            }
            tokio::time::sleep(POLL_EVERY).await;
        }
    }
}

/// When arrivals happen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Arrivals {
    /// Evenly spaced at the rate.
    Constant,
    /// Each second, the second's `rate` arrivals all at once.
    Burst,
}

/// Runs an open-model arrival loop: arrival `i` is scheduled at its intended start (from the rate, never from
/// when earlier requests finished) and spawned as a task given that instant; when `max_in_flight` tasks are
/// already running, the arrival is counted as an `overload` error on `op` instead of delaying the schedule.
/// Returns when every spawned task has finished.
pub(crate) async fn open_loop<F, Fut>(
    ctx: &Arc<Ctx>,
    op: &str,
    arrivals: Arrivals,
    rate: f64,
    duration: Duration,
    f: F,
) where
    F: Fn(u64, Instant) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let rate = rate.max(0.001);
    let t0 = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    let mut i: u64 = 0;
    loop {
        let offset = match arrivals {
            Arrivals::Constant => Duration::from_secs_f64(i as f64 / rate),
            Arrivals::Burst => Duration::from_secs(to_u64((i as f64 / rate).floor())),
        };
        if offset >= duration {
            break;
        }
        let intended = t0 + offset;
        tokio::time::sleep_until(intended.into()).await;
        while tasks.try_join_next().is_some() {}
        if ctx.in_flight.load(Ordering::Relaxed) >= ctx.max_in_flight {
            ctx.rec.record_dropped(op, "overload");
        } else {
            ctx.in_flight.fetch_add(1, Ordering::Relaxed);
            let fut = f(i, intended);
            let c = Arc::clone(ctx);
            tasks.spawn(async move {
                fut.await;
                c.in_flight.fetch_sub(1, Ordering::Relaxed);
            });
        }
        i += 1;
    }
    while tasks.join_next().await.is_some() {}
}

/// Prints a live progress line to stderr every second until `stop` flips.
pub(crate) fn progress_line(
    ctx: Arc<Ctx>,
    total: Duration,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    use std::io::{IsTerminal as _, Write as _};
    tokio::spawn(async move {
        let tty = std::io::stderr().is_terminal();
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.tick().await;
        while !stop.load(Ordering::Relaxed) {
            tick.tick().await;
            let (done, errors) = ctx.rec.totals();
            let el = ctx.rec.start.elapsed().as_secs();
            let line = format!(
                "[{el:>4}s/{}s] sent {} done {done} errors {errors} in-flight {} jobs accepted {} terminal {}",
                total.as_secs(),
                ctx.rec.sent.load(Ordering::Relaxed),
                ctx.in_flight.load(Ordering::Relaxed),
                ctx.rec.jobs.accepted.load(Ordering::Relaxed),
                ctx.rec.jobs.terminal.load(Ordering::Relaxed),
            );
            let mut err = std::io::stderr().lock();
            let _ = if tty {
                write!(err, "\r{line}\x1b[K")
            } else {
                writeln!(err, "{line}")
            };
            let _ = err.flush();
        }
        if tty {
            let _ = writeln!(std::io::stderr().lock());
        }
    })
}
