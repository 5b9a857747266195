//! What the operator page shows, gathered as events pass: the jobs this gateway saw events for (newest 200, with
//! their state), per-tool latency (job: first `queued` event → terminal event; sync invokes through this gateway:
//! request → answer), and the last 20 errors (failed/expired jobs, error answers of `/v1/rpc`). Fed by the SSE
//! hub ([`super::sse`]) and `/v1/rpc`; read by the page's snapshot ([`super::page`]).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use fleet_proto::api::{ApiError, ApiResponse, JobState, ToolJobEvent};
use fleet_proto::util::now_ms;
use serde::Serialize;
use serde_json::{Value, json};

const JOBS_KEPT: usize = 200;
const ERRORS_KEPT: usize = 20;
const LATENCIES_KEPT: usize = 256;

/// A job as the page shows it.
#[derive(Debug, Clone, Serialize)]
struct JobView {
    job_id: String,
    tool_id: String,
    user_key: String,
    state: JobState,
    seq: u64,
    first_seen_ms: u64,
    updated_ms: u64,
    #[serde(skip)]
    queued_at_ms: Option<u64>,
}

/// An error as the page shows it.
#[derive(Debug, Clone, Serialize)]
struct ErrorView {
    at_ms: u64,
    source: &'static str,
    code: String,
    message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    job_id: Option<String>,
    #[serde(skip_serializing_if = "String::is_empty")]
    tool_id: String,
}

#[derive(Debug, Default)]
struct Stats {
    jobs: HashMap<String, JobView>,
    order: VecDeque<String>,
    /// (tool, kind) → latencies in ms, newest last.
    latency: HashMap<(String, &'static str), VecDeque<u64>>,
    errors: VecDeque<ErrorView>,
}

impl Stats {
    fn latency(&mut self, tool: &str, kind: &'static str, ms: u64) {
        let ring = self.latency.entry((tool.to_owned(), kind)).or_default();
        if ring.len() >= LATENCIES_KEPT {
            ring.pop_front();
        }
        ring.push_back(ms);
    }

    fn error(&mut self, e: ErrorView) {
        if self.errors.len() >= ERRORS_KEPT {
            self.errors.pop_front();
        }
        self.errors.push_back(e);
    }
}

/// What the gateway observed, for the page. Bounded.
#[derive(Debug, Default)]
pub struct OpsStats {
    inner: Mutex<Stats>,
}

impl OpsStats {
    fn lock(&self) -> std::sync::MutexGuard<'_, Stats> {
        fleet_proto::util::lock(&self.inner)
    }

    /// A `tool_job` event of the user `user_key`.
    pub fn observe(&self, user_key: &str, event: &ToolJobEvent) {
        let now = now_ms();
        let mut s = self.lock();
        let id = event.job_id.to_string();
        if !s.jobs.contains_key(&id) {
            if s.order.len() >= JOBS_KEPT
                && let Some(old) = s.order.pop_front()
            {
                s.jobs.remove(&old);
            }
            s.order.push_back(id.clone());
            s.jobs.insert(
                id.clone(),
                JobView {
                    job_id: id.clone(),
                    tool_id: event.tool_id.clone(),
                    user_key: user_key.to_owned(),
                    state: event.state,
                    seq: event.seq,
                    first_seen_ms: now,
                    updated_ms: now,
                    queued_at_ms: (event.state == JobState::Queued).then_some(now),
                },
            );
        }
        let mut finished = None;
        if let Some(job) = s.jobs.get_mut(&id) {
            let was_terminal = job.state.is_terminal();
            // A late non-terminal event never overrides a terminal state.
            if !was_terminal {
                job.state = event.state;
            }
            job.seq = job.seq.max(event.seq);
            job.updated_ms = now;
            if event.terminal && !was_terminal {
                finished = Some((
                    job.tool_id.clone(),
                    job.queued_at_ms.map(|q| now.saturating_sub(q)),
                ));
            }
        }
        if let Some((tool, took)) = finished {
            if let Some(ms) = took {
                s.latency(&tool, "job", ms);
            }
            if matches!(event.state, JobState::Failed | JobState::Expired) {
                s.error(ErrorView {
                    at_ms: now,
                    source: "job",
                    code: event.state.as_str().to_owned(),
                    message: format!("job {} ended {}", id, event.state),
                    job_id: Some(id),
                    tool_id: tool,
                });
            }
        }
    }

    /// An `/v1/rpc` request the gateway refused.
    pub fn rpc_error(&self, method: &str, error: &ApiError) {
        self.lock().error(ErrorView {
            at_ms: now_ms(),
            source: "rpc",
            code: error.code.as_str().to_owned(),
            message: format!("{method}: {}", error.message),
            job_id: None,
            tool_id: String::new(),
        });
    }

    /// An `/v1/rpc` request the front answered.
    pub fn rpc_done(&self, method: &str, tool: &str, took: Duration, response: &ApiResponse<Value>) {
        match response {
            ApiResponse::Ok(_) if method == "tools.invoke" => {
                let ms = u64::try_from(took.as_millis()).unwrap_or(u64::MAX);
                self.lock().latency(tool, "invoke", ms);
            }
            ApiResponse::Ok(_) => {}
            ApiResponse::Err(e) => {
                let mut s = self.lock();
                s.error(ErrorView {
                    at_ms: now_ms(),
                    source: "rpc",
                    code: e.code.as_str().to_owned(),
                    message: format!("{method}: {}", e.message),
                    job_id: None,
                    tool_id: tool.to_owned(),
                });
            }
        }
    }

    pub(super) fn snapshot(&self) -> Value {
        let s = self.lock();
        let jobs: Vec<&JobView> = s.order.iter().rev().filter_map(|id| s.jobs.get(id)).collect();
        let mut by_state: HashMap<&'static str, usize> = HashMap::new();
        for j in &jobs {
            *by_state.entry(j.state.as_str()).or_default() += 1;
        }
        let mut latency: Vec<Value> = s
            .latency
            .iter()
            .map(|((tool, kind), ring)| {
                let mut v: Vec<u64> = ring.iter().copied().collect();
                v.sort_unstable();
                let pct = |p: usize| v.get((v.len().saturating_sub(1)) * p / 100).copied().unwrap_or(0);
                json!({
                    "tool_id": tool, "kind": kind, "count": v.len(),
                    "p50_ms": pct(50), "p95_ms": pct(95), "max_ms": v.last().copied().unwrap_or(0),
                })
            })
            .collect();
        latency.sort_by(|a, b| a["tool_id"].as_str().cmp(&b["tool_id"].as_str()));
        let errors: Vec<&ErrorView> = s.errors.iter().rev().collect();
        json!({ "jobs": jobs, "jobs_by_state": by_state, "latency": latency, "errors": errors })
    }
}
