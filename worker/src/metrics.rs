//! The worker's counters. Plain atomics, cheap to bump on hot paths; the observability issue exports them to
//! Prometheus. Every drop and failure is counted by reason.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Why a progress notification was not delivered (spec §8.10).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProgressDrop {
    /// No `context.invoke_id`.
    Uncorrelated,
    /// The invoke id names no active invoke of the process.
    UnknownInvoke,
    /// The invoke has no progress channel (a synchronous invoke, spec §8.10 HR-PG-06).
    NoChannel,
    /// `data` over 8 KB.
    TooLarge,
    /// Over 50 events/s for the invoke.
    RateLimited,
    /// Unreadable params.
    Malformed,
}

impl ProgressDrop {
    /// Every reason, in a fixed order.
    pub const ALL: [ProgressDrop; 6] = [
        ProgressDrop::Uncorrelated,
        ProgressDrop::UnknownInvoke,
        ProgressDrop::NoChannel,
        ProgressDrop::TooLarge,
        ProgressDrop::RateLimited,
        ProgressDrop::Malformed,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            ProgressDrop::Uncorrelated => "uncorrelated",
            ProgressDrop::UnknownInvoke => "unknown_invoke",
            ProgressDrop::NoChannel => "no_channel",
            ProgressDrop::TooLarge => "too_large",
            ProgressDrop::RateLimited => "rate_limited",
            ProgressDrop::Malformed => "malformed",
        }
    }
}

/// Counters of one worker.
#[derive(Debug, Default)]
pub struct WorkerMetrics {
    /// Processes spawned.
    pub spawns: AtomicU64,
    /// Sessions that fell back to v1.
    pub v1_fallbacks: AtomicU64,
    /// Unexpected process exits.
    pub crashes: AtomicU64,
    /// Exits attributed to the OOM killer.
    pub oom_kills: AtomicU64,
    /// Restarts after a crash.
    pub restarts: AtomicU64,
    /// Sessions that ended Stopped.
    pub stopped: AtomicU64,
    /// Process trees killed (cancel fallback, shutdown ladder's last step).
    pub tree_kills: AtomicU64,
    /// Frames read from plugins.
    pub frames_read: AtomicU64,
    /// Bytes read from plugins' stdout.
    pub bytes_read: AtomicU64,
    /// Frames written to plugins.
    pub frames_written: AtomicU64,
    /// Bad frames by kind, see [`WorkerMetrics::frame_error`].
    pub frame_errors: [AtomicU64; 6],
    /// Responses whose id matched nothing (late, after a timeout or cancel, or bogus).
    pub unmatched_responses: AtomicU64,
    /// Notifications other than progress.
    pub ignored_notifications: AtomicU64,
    /// Progress events delivered.
    pub progress_accepted: AtomicU64,
    /// Progress events dropped, by [`ProgressDrop`] (index = position in `ProgressDrop::ALL`).
    pub progress_dropped: [AtomicU64; 6],
    /// Reverse-RPC calls answered (any outcome).
    pub reverse_calls: AtomicU64,
    /// Reverse-RPC calls refused by routing or gating.
    pub reverse_refused: AtomicU64,
    /// Files read through `__file_transport`.
    pub file_transports: AtomicU64,
    /// `__file_transport` pointers refused (outside TMPDIR, too big, unreadable).
    pub file_transport_refused: AtomicU64,
    /// Invokes completed (a result or a JSON-RPC error came back).
    pub invokes_completed: AtomicU64,
    /// Invokes that timed out.
    pub invokes_timed_out: AtomicU64,
    /// Invokes cancelled.
    pub invokes_cancelled: AtomicU64,
    /// Invokes failed because their process died.
    pub invokes_lost: AtomicU64,
    /// Sessions evicted (idle or LRU).
    pub evictions: AtomicU64,
    /// Cold starts (a process spawned for a call) vs warm hits.
    pub cold_starts: AtomicU64,
    /// Calls served by an already-running process.
    pub warm_hits: AtomicU64,
    /// Cold-start durations (the wait for a ready process when a call found none), per bucket of
    /// [`COLD_START_BUCKETS`] (non-cumulative; the last slot counts those above every bound).
    pub cold_start_buckets: [AtomicU64; COLD_START_BUCKETS.len() + 1],
    /// Sum of cold-start durations, µs.
    pub cold_start_sum_us: AtomicU64,
    /// Reverse-RPC calls answered, by family (index in [`REVERSE_FAMILIES`]) and outcome (0 = ok, 1 = error).
    pub reverse_outcomes: [[AtomicU64; 2]; REVERSE_FAMILIES.len()],
    /// Reverse-RPC calls refused because a quota or rate budget was exhausted (any `*_QUOTA_EXCEEDED` or
    /// `*_RATE_LIMITED` code).
    pub reverse_budget_exhausted: AtomicU64,
    /// The Animus driver's counters (detection probes, liveness, cancellation paths).
    pub animus: AnimusMetrics,
    /// Sessions whose runtime manifest declared more than the recorded one, by tool id (`session/pin.rs`).
    pub manifest_drift: std::sync::Mutex<std::collections::BTreeMap<String, u64>>,
}

/// Counters of the Animus driver (exported with `dialect="animus"`).
#[derive(Debug, Default)]
pub struct AnimusMetrics {
    /// `--manifest` probes run.
    pub probes: AtomicU64,
    /// Animus processes spawned.
    pub spawns: AtomicU64,
    /// Handshakes refused (version, kind, bad answer).
    pub refused: AtomicU64,
    /// Installs quarantined.
    pub quarantines: AtomicU64,
    /// Calls started.
    pub calls: AtomicU64,
    /// Calls that ended with `success: true`.
    pub calls_succeeded: AtomicU64,
    /// Calls that ended otherwise (plugin errors, failed runs, lost processes; not cancels).
    pub calls_failed: AtomicU64,
    /// `$/ping` misses.
    pub ping_misses: AtomicU64,
    /// Processes recycled (ping misses, unhealthy).
    pub recycles: AtomicU64,
    /// Cancels (and deadline expiries) by the path that ended them, index = the position in
    /// `animus::CancelPath::ALL`.
    pub cancel_paths: [AtomicU64; 4],
}

/// Upper bounds (seconds) of the cold-start histogram.
pub const COLD_START_BUCKETS: [f64; 10] = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// Reverse-RPC families (the `family` label), `unknown` last for methods no family claims.
pub const REVERSE_FAMILIES: [&str; 10] = [
    "sampling",
    "agent",
    "storage",
    "files",
    "embeddings",
    "image",
    "upload",
    "credentials",
    "web",
    "unknown",
];

/// JSON-RPC error codes that mean a budget (quota or rate) was exhausted.
pub const BUDGET_CODES: [i64; 9] = [
    -32002, -32024, -32026, -32045, -32047, -32102, -32202, -32502, -32522,
];

/// The frame error kinds, in the order of `WorkerMetrics::frame_errors`.
pub const FRAME_ERROR_KINDS: [&str; 6] = [
    "frame_too_large",
    "invalid_utf8",
    "invalid_json",
    "not_an_object",
    "not_json_rpc",
    "truncated_at_eof",
];

impl WorkerMetrics {
    /// Counts a session of `tool_id` whose runtime manifest declared more than the recorded one.
    pub fn manifest_drift(&self, tool_id: &str) {
        let mut drift = fleet_proto::util::lock(&self.manifest_drift);
        *drift.entry(tool_id.to_owned()).or_default() += 1;
    }

    /// [`manifest_drift`](Self::manifest_drift) so far, by tool id.
    pub fn manifest_drifts(&self) -> Vec<(String, u64)> {
        fleet_proto::util::lock(&self.manifest_drift)
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect()
    }

    /// Adds one to a counter.
    pub fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a progress drop.
    pub fn progress_drop(&self, reason: ProgressDrop) {
        let i = ProgressDrop::ALL.iter().position(|r| *r == reason).unwrap_or(0);
        Self::inc(&self.progress_dropped[i]);
    }

    /// Progress drops for one reason.
    pub fn progress_dropped(&self, reason: ProgressDrop) -> u64 {
        let i = ProgressDrop::ALL.iter().position(|r| *r == reason).unwrap_or(0);
        self.progress_dropped[i].load(Ordering::Relaxed)
    }

    /// Counts a bad frame by its `FrameError::kind()`.
    pub fn frame_error(&self, kind: &str) {
        if let Some(i) = FRAME_ERROR_KINDS.iter().position(|k| *k == kind) {
            Self::inc(&self.frame_errors[i]);
        }
    }

    /// Bad frames of one kind.
    pub fn frame_errors(&self, kind: &str) -> u64 {
        FRAME_ERROR_KINDS
            .iter()
            .position(|k| *k == kind)
            .map_or(0, |i| self.frame_errors[i].load(Ordering::Relaxed))
    }

    /// Records one cold start's duration.
    pub fn observe_cold_start(&self, took: Duration) {
        let secs = took.as_secs_f64();
        let i = COLD_START_BUCKETS
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(COLD_START_BUCKETS.len());
        Self::inc(&self.cold_start_buckets[i]);
        self.cold_start_sum_us.fetch_add(
            u64::try_from(took.as_micros()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// Counts an answered reverse-RPC call of `family` (a [`REVERSE_FAMILIES`] name; anything else is
    /// `unknown`) with its error code, if it failed.
    pub fn reverse_call(&self, family: Option<&str>, error_code: Option<i64>) {
        let i = family
            .and_then(|f| REVERSE_FAMILIES.iter().position(|k| *k == f))
            .unwrap_or(REVERSE_FAMILIES.len() - 1);
        Self::inc(&self.reverse_outcomes[i][usize::from(error_code.is_some())]);
        if error_code.is_some_and(|c| BUDGET_CODES.contains(&c)) {
            Self::inc(&self.reverse_budget_exhausted);
        }
    }

    /// Reads a counter.
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}
