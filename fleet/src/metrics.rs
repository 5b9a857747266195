//! The fleet's Prometheus metrics (prometheus-client): one registry per process, rendered on `/metrics` in the
//! Prometheus text format 0.0.4 (what `promtool check metrics` lints and every Prometheus scrapes).
//!
//! This module owns every metric name (prefix `cloud_agents_`); the "Metrics" section of docs/operations.md
//! lists them. The front, the worker nodes and the sweeper call the recording methods; the worker's hot-path
//! counters stay plain atomics ([`WorkerMetrics`]) and are read at scrape time by a collector over the
//! registered pools.
//!
//! Cardinality is bounded by construction: labels are API method names (a fixed list, anything else is
//! `other`), error codes (a fixed enum), job states, catalogue tool ids (only for executions a worker accepted,
//! so never a caller-chosen string), reverse-RPC families, frame error kinds and drop reasons. No label ever
//! carries a user id; per-user load is a distribution (`cloud_agents_users_by_active_jobs`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fleet_proto::api::{ApiErrorCode, JobState, methods};
use fleet_worker::metrics::{
    COLD_START_BUCKETS, FRAME_ERROR_KINDS, ProgressDrop, REVERSE_FAMILIES, WorkerMetrics,
};
use fleet_worker::pool::Pool;
use fleet_worker::session::SessionState;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric as _, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// The `Content-Type` of [`FleetMetrics::encode`]'s output.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// API latency buckets, seconds.
const LATENCY_BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Queue-wait and run-time buckets, seconds (jobs run up to hours).
const JOB_BUCKETS: [f64; 16] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0, 7200.0,
];

/// How many sessions `cloud_agents_plugin_session_top_memory_bytes` lists (the largest by memory).
pub const TOP_SESSIONS: usize = 10;

type L1 = [(&'static str, &'static str); 1];
type L2 = [(&'static str, &'static str); 2];
type ToolLabel = [(&'static str, String); 1];
type HistFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}

fn job_histogram() -> Histogram {
    Histogram::new(JOB_BUCKETS)
}

/// The process's metrics.
#[derive(Debug)]
pub struct FleetMetrics {
    registry: Mutex<Registry>,
    api_requests: Family<L2, Counter>,
    api_duration: HistFamily<L1>,
    job_transitions: Family<L2, Counter>,
    queue_wait: HistFamily<ToolLabel>,
    run_time: HistFamily<ToolLabel>,
    rejections: Family<L1, Counter>,
    users_by_active: Family<L1, Gauge>,
    jobs_active: Family<L1, Gauge>,
    nats_events: Family<L1, Counter>,
    nats_reconnects: Counter,
    jobs_worker_lost: Counter,
    jetstream_errors: Family<L1, Counter>,
    exec_seal_refusals: Family<L1, Counter>,
    job_seal_rejected: Family<L2, Counter>,
    direct_replies: Counter,
    job_store: Family<L1, Gauge>,
    workers: Arc<WorkerCollector>,
}

impl Default for FleetMetrics {
    fn default() -> Self {
        FleetMetrics::new()
    }
}

/// The `method` label: a known API method, else `other` (the HTTP gateway may pass anything).
fn method_label(method: &str) -> &'static str {
    methods::ALL
        .iter()
        .find(|m| **m == method)
        .copied()
        .unwrap_or("other")
}

impl FleetMetrics {
    /// Every fleet metric, registered, at zero.
    pub fn new() -> FleetMetrics {
        let mut r = Registry::with_prefix("cloud_agents");
        let m = FleetMetrics {
            registry: Mutex::new(Registry::default()),
            api_requests: Family::default(),
            api_duration: Family::new_with_constructor(latency_histogram),
            job_transitions: Family::default(),
            queue_wait: Family::new_with_constructor(job_histogram),
            run_time: Family::new_with_constructor(job_histogram),
            rejections: Family::default(),
            users_by_active: Family::default(),
            jobs_active: Family::default(),
            nats_events: Family::default(),
            nats_reconnects: Counter::default(),
            jobs_worker_lost: Counter::default(),
            jetstream_errors: Family::default(),
            exec_seal_refusals: Family::default(),
            job_seal_rejected: Family::default(),
            direct_replies: Counter::default(),
            job_store: Family::default(),
            workers: Arc::new(WorkerCollector::default()),
        };
        r.register(
            "api_requests",
            "API requests by method and outcome code (ok or the error code)",
            m.api_requests.clone(),
        );
        r.register(
            "api_request_duration_seconds",
            "API request latency by method",
            m.api_duration.clone(),
        );
        r.register(
            "job_transitions",
            "Job state transitions (from new|queued|running to a state)",
            m.job_transitions.clone(),
        );
        r.register(
            "job_queue_wait_seconds",
            "Schedule-to-start: job creation to running, by tool_id",
            m.queue_wait.clone(),
        );
        r.register(
            "job_run_seconds",
            "Start-to-close: running to terminal, by tool_id",
            m.run_time.clone(),
        );
        r.register(
            "rejections",
            "Admission rejections by kind (job_quota, rate_limit, long_job_capacity, worker_capacity, store_full)",
            m.rejections.clone(),
        );
        r.register(
            "users_by_active_jobs",
            "Users having `active` queued+running jobs (1..5, >5), as of the last sweep",
            m.users_by_active.clone(),
        );
        r.register(
            "jobs_active",
            "Active jobs by state, as of the last sweep",
            m.jobs_active.clone(),
        );
        r.register(
            "nats_connection_events",
            "NATS client connection events by kind",
            m.nats_events.clone(),
        );
        r.register(
            "nats_reconnects",
            "NATS reconnections after a disconnect",
            m.nats_reconnects.clone(),
        );
        r.register(
            "jobs_worker_lost",
            "Running jobs failed by the sweeper because their worker was lost",
            m.jobs_worker_lost.clone(),
        );
        r.register(
            "jetstream_errors",
            "JetStream (KV/stream) operations that failed, by operation",
            m.jetstream_errors.clone(),
        );
        r.register(
            "exec_seal_refusals",
            "Exec requests and cancel commands a worker refused for their seal, by reason (unsigned, malformed, bad_signature, bad_grant, stale, replayed)",
            m.exec_seal_refusals.clone(),
        );
        r.register(
            "job_seal_rejected",
            "Queued jobs a worker (by=worker) or a sweeper (by=sweeper) failed instead of running or dispatching them because their record's seal did not verify, by reason (unsealed, malformed, bad_signature)",
            m.job_seal_rejected.clone(),
        );
        r.register(
            "direct_replies",
            "Sync calls whose answer a worker published on the app's reply subject itself (not through the front)",
            m.direct_replies.clone(),
        );
        r.register(
            "job_store_bytes",
            "The FLEET account's JetStream store as this front's admission last read it: used (with the reserves it admitted since), budget (0 = no fleet-wide guard)",
            m.job_store.clone(),
        );
        r.register_collector(Box::new(m.workers.clone()));
        *m.registry
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = r;
        m
    }

    /// The Prometheus text exposition (format 0.0.4, [`CONTENT_TYPE`]).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        let registry = self
            .registry
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &registry);
        out
    }

    /// One API call: its method, outcome (`None` = ok, else the error code) and latency.
    pub fn api_request(&self, method: &str, error: Option<ApiErrorCode>, took: Duration) {
        let method = method_label(method);
        let code = error.map_or("ok", ApiErrorCode::as_str);
        self.api_requests
            .get_or_create(&[("method", method), ("code", code)])
            .inc();
        self.api_duration
            .get_or_create(&[("method", method)])
            .observe(took.as_secs_f64());
        match error {
            Some(ApiErrorCode::RateLimited) => self.rejection("rate_limit"),
            Some(ApiErrorCode::JobQuotaExceeded) => self.rejection("job_quota"),
            _ => {}
        }
    }

    /// A job changed state; `from = None` is creation.
    pub fn job_transition(&self, from: Option<JobState>, to: JobState) {
        let from = from.map_or("new", JobState::as_str);
        self.job_transitions
            .get_or_create(&[("from", from), ("to", to.as_str())])
            .inc();
    }

    /// Schedule-to-start of a job of a catalogue `tool_id`.
    pub fn queue_wait(&self, tool_id: &str, took: Duration) {
        self.queue_wait
            .get_or_create(&[("tool_id", tool_id.to_string())])
            .observe(took.as_secs_f64());
    }

    /// Start-to-close of a job of a catalogue `tool_id`.
    pub fn run_time(&self, tool_id: &str, took: Duration) {
        self.run_time
            .get_or_create(&[("tool_id", tool_id.to_string())])
            .observe(took.as_secs_f64());
    }

    /// An admission rejection: `job_quota`, `rate_limit`, `long_job_capacity`, `worker_capacity`, `store_full`.
    pub fn rejection(&self, kind: &'static str) {
        self.rejections.get_or_create(&[("kind", kind)]).inc();
    }

    /// The sweep's view: active jobs per user (`per_user` = each user's count) and by state.
    pub fn active_jobs(&self, per_user: impl IntoIterator<Item = usize>, queued: usize, running: usize) {
        const BINS: [&str; 6] = ["1", "2", "3", "4", "5", ">5"];
        let mut counts = [0i64; 6];
        for n in per_user {
            if n > 0 {
                counts[(n - 1).min(5)] += 1;
            }
        }
        for (bin, n) in BINS.iter().zip(counts) {
            self.users_by_active.get_or_create(&[("active", bin)]).set(n);
        }
        self.jobs_active
            .get_or_create(&[("state", "queued")])
            .set(i64::try_from(queued).unwrap_or(i64::MAX));
        self.jobs_active
            .get_or_create(&[("state", "running")])
            .set(i64::try_from(running).unwrap_or(i64::MAX));
    }

    /// The sweeper failed a running job whose worker is gone.
    pub fn job_worker_lost(&self) {
        self.jobs_worker_lost.inc();
    }

    /// A worker refused an exec request or a cancel command for its seal (`SealError::as_str`).
    pub fn exec_seal_refused(&self, reason: &'static str) {
        self.exec_seal_refusals.get_or_create(&[("reason", reason)]).inc();
    }

    /// A queued job failed for its record's seal (`JobSealError::as_str`), by `worker` or `sweeper`.
    pub fn job_seal_rejected(&self, reason: &'static str, by: &'static str) {
        self.job_seal_rejected
            .get_or_create(&[("reason", reason), ("by", by)])
            .inc();
    }

    /// The JetStream store's fill as admission knows it.
    pub fn job_store(&self, fill: fleet_store::FillReading) {
        let gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        self.job_store
            .get_or_create(&[("kind", "used")])
            .set(gauge(fill.used_bytes.saturating_add(fill.pending_bytes)));
        self.job_store
            .get_or_create(&[("kind", "budget")])
            .set(gauge(fill.budget_bytes));
    }

    /// A worker answered a sync call's caller directly.
    pub fn direct_reply(&self) {
        self.direct_replies.inc();
    }

    /// A JetStream operation failed.
    pub fn jetstream_error(&self, op: &'static str) {
        self.jetstream_errors.get_or_create(&[("op", op)]).inc();
    }

    /// A NATS client event.
    pub fn nats_event(&self, event: &async_nats::Event) {
        let kind = match event {
            async_nats::Event::Connected => "connected",
            async_nats::Event::Disconnected => "disconnected",
            async_nats::Event::LameDuckMode => "lame_duck",
            async_nats::Event::SlowConsumer(_) => "slow_consumer",
            async_nats::Event::ServerError(_) => "server_error",
            async_nats::Event::ClientError(_) => "client_error",
            _ => "other",
        };
        self.nats_events.get_or_create(&[("event", kind)]).inc();
        // A permission violation names the fleet's own subject: say it, or a refused publish is just a timeout.
        if let async_nats::Event::ServerError(e) = event {
            tracing::error!(error = %e, "NATS server error");
        }
        if matches!(event, async_nats::Event::Connected) {
            self.nats_reconnects.inc();
        }
    }

    /// `options` with an event callback feeding `cloud_agents_nats_*`.
    pub fn nats_options(self: &Arc<Self>, options: async_nats::ConnectOptions) -> async_nats::ConnectOptions {
        let m = self.clone();
        options.event_callback(move |event| {
            let m = m.clone();
            async move { m.nats_event(&event) }
        })
    }

    /// The last health of every plugin of the registered pools, both dialects (for the operator page):
    /// `[{tool_id, dialect, state}]`.
    pub fn plugin_health(&self) -> Vec<serde_json::Value> {
        let pools = self
            .workers
            .pools
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        pools
            .iter()
            .flat_map(Pool::health_states)
            .map(|(tool_id, dialect, state)| {
                serde_json::json!({ "tool_id": tool_id, "dialect": dialect.as_str(), "state": state.as_str() })
            })
            .collect()
    }

    /// Exports `pool`'s counters, sessions and cgroup usage (summed over every registered pool).
    pub fn register_pool(&self, pool: &Pool) {
        self.workers.add(pool.clone());
    }
}

/// Reads the registered pools at scrape time.
#[derive(Debug, Default)]
struct WorkerCollector {
    pools: Mutex<Vec<Pool>>,
    registered: AtomicBool,
}

impl WorkerCollector {
    fn add(&self, pool: Pool) {
        self.registered.store(true, Ordering::Relaxed);
        self.pools
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(pool);
    }
}

fn counter(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    v: u64,
) -> Result<(), std::fmt::Error> {
    let c = ConstCounter::new(v);
    c.encode(encoder.encode_descriptor(name, help, None, c.metric_type())?)
}

fn gauge(encoder: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: f64) -> Result<(), std::fmt::Error> {
    let g = ConstGauge::new(v);
    g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)
}

fn gauge_family<S: prometheus_client::encoding::EncodeLabelSet>(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    rows: &[(S, f64)],
) -> Result<(), std::fmt::Error> {
    let mut me = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, v) in rows {
        ConstGauge::new(*v).encode(me.encode_family(labels)?)?;
    }
    Ok(())
}

fn counter_family<S: prometheus_client::encoding::EncodeLabelSet>(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    rows: &[(S, u64)],
) -> Result<(), std::fmt::Error> {
    let mut me = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, v) in rows {
        ConstCounter::new(*v).encode(me.encode_family(labels)?)?;
    }
    Ok(())
}

/// Reads one worker counter.
type Read = fn(&WorkerMetrics) -> u64;

/// Sums of the worker counters over pools.
fn sum(pools: &[Pool], f: impl Fn(&WorkerMetrics) -> u64) -> u64 {
    pools.iter().map(|p| f(&p.context().metrics)).sum()
}

fn load(a: &std::sync::atomic::AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

impl Collector for WorkerCollector {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        if !self.registered.load(Ordering::Relaxed) {
            return Ok(());
        }
        let pools = self
            .pools
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let plain: [(&str, &str, Read); 14] = [
            ("plugin_spawns", "Plugin processes spawned", |m| load(&m.spawns)),
            (
                "plugin_cold_starts",
                "Calls that had to start a plugin process",
                |m| load(&m.cold_starts),
            ),
            (
                "plugin_warm_hits",
                "Calls served by an already-running plugin process",
                |m| load(&m.warm_hits),
            ),
            ("plugin_restarts", "Plugin restarts after a crash", |m| {
                load(&m.restarts)
            }),
            ("plugin_crashes", "Unexpected plugin process exits", |m| {
                load(&m.crashes)
            }),
            (
                "plugin_oom_kills",
                "Plugin exits attributed to the cgroup OOM killer",
                |m| load(&m.oom_kills),
            ),
            (
                "plugin_process_tree_kills",
                "Plugin process trees killed and reaped",
                |m| load(&m.tree_kills),
            ),
            (
                "plugin_sessions_stopped",
                "Sessions that gave up (ended Stopped)",
                |m| load(&m.stopped),
            ),
            ("plugin_sessions_evicted", "Sessions evicted (idle or LRU)", |m| {
                load(&m.evictions)
            }),
            (
                "plugin_v1_fallbacks",
                "Sessions that fell back to protocol v1",
                |m| load(&m.v1_fallbacks),
            ),
            ("plugin_frames_read", "Frames read from plugins", |m| {
                load(&m.frames_read)
            }),
            (
                "plugin_frames_written",
                "Request frames written to plugins",
                |m| load(&m.frames_written),
            ),
            ("plugin_read_bytes", "Bytes read from plugins' stdout", |m| {
                load(&m.bytes_read)
            }),
            (
                "plugin_unmatched_responses",
                "Plugin responses matching no pending request",
                |m| load(&m.unmatched_responses),
            ),
        ];
        for (name, help, f) in plain {
            counter(&mut e, name, help, sum(&pools, f))?;
        }
        // Frame errors by kind.
        let rows: Vec<(L1, u64)> = FRAME_ERROR_KINDS
            .iter()
            .enumerate()
            .map(|(i, k)| ([("kind", *k)], sum(&pools, |m| load(&m.frame_errors[i]))))
            .collect();
        counter_family(
            &mut e,
            "plugin_frame_errors",
            "Bad frames from plugins by kind",
            &rows,
        )?;
        // Invokes by outcome.
        let outcomes: [(&str, Read); 4] = [
            ("completed", |m| load(&m.invokes_completed)),
            ("timed_out", |m| load(&m.invokes_timed_out)),
            ("cancelled", |m| load(&m.invokes_cancelled)),
            ("lost", |m| load(&m.invokes_lost)),
        ];
        let rows: Vec<(L1, u64)> = outcomes
            .iter()
            .map(|(o, f)| ([("outcome", *o)], sum(&pools, f)))
            .collect();
        counter_family(&mut e, "plugin_invokes", "Plugin invokes by outcome", &rows)?;
        // Progress.
        counter(
            &mut e,
            "progress_events_accepted",
            "Progress events delivered",
            sum(&pools, |m| load(&m.progress_accepted)),
        )?;
        let rows: Vec<(L1, u64)> = ProgressDrop::ALL
            .iter()
            .map(|r| ([("reason", r.as_str())], sum(&pools, |m| m.progress_dropped(*r))))
            .collect();
        counter_family(
            &mut e,
            "progress_events_dropped",
            "Progress events dropped by reason",
            &rows,
        )?;
        // Reverse RPC.
        let mut rows: Vec<(L2, u64)> = Vec::new();
        for (i, family) in REVERSE_FAMILIES.iter().enumerate() {
            for (j, outcome) in ["ok", "error"].iter().enumerate() {
                rows.push((
                    [("family", *family), ("outcome", *outcome)],
                    sum(&pools, |m| load(&m.reverse_outcomes[i][j])),
                ));
            }
        }
        counter_family(
            &mut e,
            "reverse_rpc_calls",
            "Reverse-RPC calls answered, by method family and outcome",
            &rows,
        )?;
        counter(
            &mut e,
            "reverse_rpc_refused",
            "Reverse-RPC calls refused (routing, gating, concurrency)",
            sum(&pools, |m| load(&m.reverse_refused)),
        )?;
        counter(
            &mut e,
            "reverse_rpc_budget_exhausted",
            "Reverse-RPC calls refused for an exhausted quota or rate budget",
            sum(&pools, |m| load(&m.reverse_budget_exhausted)),
        )?;
        counter(
            &mut e,
            "file_transports",
            "Files read through __file_transport",
            sum(&pools, |m| load(&m.file_transports)),
        )?;
        counter(
            &mut e,
            "file_transports_refused",
            "__file_transport pointers refused",
            sum(&pools, |m| load(&m.file_transport_refused)),
        )?;
        // Sandbox stubs: plugins started from one, and those waiting.
        counter(
            &mut e,
            "plugin_stub_starts",
            "Plugin processes started from a waiting sandbox stub (the rest of plugin_spawns were spawned directly)",
            pools.iter().map(|p| p.context().sandbox.stub_claims()).sum(),
        )?;
        let ready: usize = pools.iter().map(|p| p.context().sandbox.stubs_ready()).sum();
        gauge(
            &mut e,
            "plugin_stubs_ready",
            "Sandbox stubs waiting for a session",
            ready as f64,
        )?;
        // Sessions whose runtime manifest declared more than the recorded one (the extra withheld), by tool id.
        let mut drift: BTreeMap<String, u64> = BTreeMap::new();
        for pool in &pools {
            for (tool_id, n) in pool.context().metrics.manifest_drifts() {
                *drift.entry(tool_id).or_default() += n;
            }
        }
        let rows: Vec<(ToolLabel, u64)> = drift.into_iter().map(|(t, n)| ([("tool_id", t)], n)).collect();
        counter_family(
            &mut e,
            "manifest_drift",
            "Plugin sessions whose runtime manifest declared credentials, host capabilities or tools their recorded manifest does not (withheld)",
            &rows,
        )?;
        // Egress through the proxies of egress-granted plugins, by outcome (refusals by the rule that refused).
        let mut outcomes: BTreeMap<&str, u64> = BTreeMap::new();
        for pool in &pools {
            let c = pool.context().sandbox.egress_counters();
            *outcomes.entry("connected").or_default() += load(&c.connected);
            *outcomes.entry("failed").or_default() += load(&c.failed);
            *outcomes.entry("bad_request").or_default() += load(&c.bad_request);
            for (rule, n) in c.refusals() {
                *outcomes.entry(rule).or_default() += n;
            }
        }
        let rows: Vec<(L1, u64)> = outcomes.into_iter().map(|(o, n)| ([("outcome", o)], n)).collect();
        counter_family(
            &mut e,
            "plugin_egress_connections",
            "Connections through the egress proxy, by outcome (connected, failed, bad_request, or the refusing rule)",
            &rows,
        )?;
        // Cold-start duration histogram.
        let mut buckets: Vec<(f64, u64)> = Vec::new();
        let mut count = 0;
        for (i, bound) in COLD_START_BUCKETS
            .iter()
            .copied()
            .chain(std::iter::once(f64::INFINITY))
            .enumerate()
        {
            let n = sum(&pools, |m| load(&m.cold_start_buckets[i]));
            count += n;
            buckets.push((bound, n));
        }
        let sum_s = sum(&pools, |m| load(&m.cold_start_sum_us)) as f64 / 1e6;
        e.encode_descriptor(
            "plugin_cold_start_duration_seconds",
            "Wait for a ready plugin process on a cold start",
            None,
            MetricType::Histogram,
        )?
        .encode_histogram::<NoLabelSet>(sum_s, count, &buckets, None)?;
        // Sessions by state and cgroup usage.
        let mut states: BTreeMap<&str, f64> = ["idle", "starting", "ready", "backoff", "stopped", "closed"]
            .into_iter()
            .map(|s| (s, 0.0))
            .collect();
        let mut mem: BTreeMap<String, f64> = BTreeMap::new();
        let mut cpu: BTreeMap<String, f64> = BTreeMap::new();
        let mut sessions: Vec<(u64, String)> = Vec::new();
        for pool in &pools {
            for s in pool.sessions() {
                let state = match s.state() {
                    SessionState::Idle => "idle",
                    SessionState::Starting => "starting",
                    SessionState::Ready => "ready",
                    SessionState::Backoff => "backoff",
                    SessionState::Stopped(_) => "stopped",
                    SessionState::Closed => "closed",
                };
                *states.entry(state).or_default() += 1.0;
                let usage = s.with_cgroup(|cg| cg.and_then(|c| c.usage().ok()));
                if let Some(u) = usage {
                    *mem.entry(s.tool_id().to_string()).or_default() += u.memory_bytes as f64;
                    *cpu.entry(s.tool_id().to_string()).or_default() += u.cpu_usec as f64 / 1e6;
                    sessions.push((u.memory_bytes, s.tool_id().to_string()));
                }
            }
        }
        let rows: Vec<(L1, f64)> = states.into_iter().map(|(s, n)| ([("state", s)], n)).collect();
        gauge_family(
            &mut e,
            "plugin_sessions",
            "Plugin sessions in the pool by state",
            &rows,
        )?;
        let rows: Vec<(ToolLabel, f64)> = mem.into_iter().map(|(t, v)| ([("tool_id", t)], v)).collect();
        gauge_family(
            &mut e,
            "plugin_cgroup_memory_bytes",
            "Memory charged to live sessions' cgroups, summed per tool_id",
            &rows,
        )?;
        let rows: Vec<(ToolLabel, f64)> = cpu.into_iter().map(|(t, v)| ([("tool_id", t)], v)).collect();
        gauge_family(
            &mut e,
            "plugin_cgroup_cpu_seconds",
            "CPU time consumed by live sessions' cgroups, summed per tool_id (drops when sessions end)",
            &rows,
        )?;
        sessions.sort_by_key(|s| std::cmp::Reverse(s.0));
        let rows: Vec<([(&str, String); 2], f64)> = sessions
            .into_iter()
            .take(TOP_SESSIONS)
            .enumerate()
            .map(|(i, (bytes, tool))| ([("tool_id", tool), ("rank", (i + 1).to_string())], bytes as f64))
            .collect();
        gauge_family(
            &mut e,
            "plugin_session_top_memory_bytes",
            "Memory of the 10 largest sessions (rank 1 = largest), labelled by tool_id only",
            &rows,
        )?;
        encode_dialects(&mut e, &pools)?;
        Ok(())
    }
}

/// The per-dialect families: spawns, Animus liveness, quarantines, cancellation paths, and every plugin's health
/// (Executa `health` and Animus `health/check` mapped onto one set of states).
fn encode_dialects(e: &mut DescriptorEncoder<'_>, pools: &[Pool]) -> Result<(), std::fmt::Error> {
    use fleet_worker::animus::{CancelPath, HealthState};
    let animus_spawns = sum(pools, |m| load(&m.animus.spawns));
    let all_spawns = sum(pools, |m| load(&m.spawns));
    counter_family(
        e,
        "plugin_spawns_by_dialect",
        "Plugin processes spawned, by protocol dialect",
        &[
            ([("dialect", "executa")], all_spawns.saturating_sub(animus_spawns)),
            ([("dialect", "animus")], animus_spawns),
        ],
    )?;
    let events: [(&str, Read); 5] = [
        ("probes", |m| load(&m.animus.probes)),
        ("ping_misses", |m| load(&m.animus.ping_misses)),
        ("recycles", |m| load(&m.animus.recycles)),
        ("quarantines", |m| load(&m.animus.quarantines)),
        ("refused", |m| load(&m.animus.refused)),
    ];
    let rows: Vec<([(&str, &str); 2], u64)> = events
        .iter()
        .map(|(what, f)| ([("dialect", "animus"), ("event", *what)], sum(pools, f)))
        .collect();
    counter_family(
        e,
        "plugin_lifecycle_events",
        "Dialect detections, ping misses, processes recycled, installs quarantined or refused",
        &rows,
    )?;
    let outcomes: [(&str, Read); 2] = [
        ("succeeded", |m| load(&m.animus.calls_succeeded)),
        ("failed", |m| load(&m.animus.calls_failed)),
    ];
    let rows: Vec<([(&str, &str); 2], u64)> = outcomes
        .iter()
        .map(|(o, f)| ([("dialect", "animus"), ("outcome", *o)], sum(pools, f)))
        .collect();
    counter_family(
        e,
        "plugin_calls_by_dialect",
        "Calls that ended, by dialect and outcome",
        &rows,
    )?;
    let rows: Vec<([(&str, &str); 2], u64)> = CancelPath::ALL
        .iter()
        .enumerate()
        .map(|(i, p)| {
            (
                [("dialect", "animus"), ("path", p.as_str())],
                sum(pools, |m| load(&m.animus.cancel_paths[i])),
            )
        })
        .collect();
    counter_family(
        e,
        "plugin_cancel_paths",
        "Cancelled or expired calls by the path that ended them on the plugin's side",
        &rows,
    )?;
    let mut rows: Vec<([(&str, String); 3], f64)> = Vec::new();
    for pool in pools {
        for (tool, dialect, state) in pool.health_states() {
            for s in HealthState::ALL {
                rows.push((
                    [
                        ("tool_id", tool.clone()),
                        ("dialect", dialect.as_str().to_string()),
                        ("state", s.as_str().to_string()),
                    ],
                    if s == state { 1.0 } else { 0.0 },
                ));
            }
        }
    }
    gauge_family(
        e,
        "plugin_health",
        "1 for each plugin's last health state (Executa health and Animus health/check on one scale)",
        &rows,
    )
}

/// Serves `/metrics`, `/healthz` and `/readyz` (when `client` is given: NATS connected) on `addr` until the task
/// is dropped. For processes without the HTTP gateway (`fleet worker --http`) and for tests.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<FleetMetrics>,
    client: Option<async_nats::Client>,
) -> std::io::Result<()> {
    use axum::http::{StatusCode, header};
    use axum::routing::get;
    let router = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let m = metrics.clone();
                async move { ([(header::CONTENT_TYPE, CONTENT_TYPE)], m.encode()) }
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(move || {
                let ready = client
                    .as_ref()
                    .is_none_or(|c| c.connection_state() == async_nats::connection::State::Connected);
                async move {
                    if ready {
                        (StatusCode::OK, "ready\n")
                    } else {
                        (StatusCode::SERVICE_UNAVAILABLE, "nats disconnected\n")
                    }
                }
            }),
        );
    let limits = crate::http::listener::ListenerLimits::default();
    crate::http::listener::serve(listener, router, limits, std::future::pending()).await
}
