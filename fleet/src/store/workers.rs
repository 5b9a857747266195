//! The worker registry (`<prefix>_workers`, key `<worker_id>`). The bucket's `max_age` is the worker TTL: a key
//! not refreshed within it is removed by JetStream, and a worker without a key is dead.

use async_nats::jetstream::consumer::DeliverPolicy;
use serde::{Deserialize, Serialize};

use super::scan::{Scan, scan};
use super::settings::{WORKER_INFO_MAX_BYTES, WORKER_WARM_SESSIONS_MAX};
use super::{Op, Store, StoreError, encode, is_kv_marker};

/// A live worker's registry entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerInfo {
    /// Its id (`[A-Za-z0-9_=-]`, ≤ 128 bytes: a key and a subject token).
    pub id: String,
    /// Long jobs it may run at once.
    pub capacity_long_jobs: usize,
    /// Long jobs it is running.
    pub long_jobs_running: usize,
    /// (user_key, tool_id) of its warm sessions; at most [`WORKER_WARM_SESSIONS_MAX`] are stored.
    #[serde(default)]
    pub sessions_warm: Vec<(String, String)>,
    /// When it started (epoch ms).
    pub started_at_ms: u64,
}

fn check_worker_id(op: Op, id: &str) -> Result<(), StoreError> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'='));
    if ok {
        Ok(())
    } else {
        Err(StoreError::invalid(
            op,
            "worker id",
            format!("{id:?} must be 1–128 characters of [A-Za-z0-9_=-]"),
        ))
    }
}

impl Store {
    /// Registers or refreshes a worker (its key lives for `worker_ttl` from now). Warm sessions beyond
    /// [`WORKER_WARM_SESSIONS_MAX`] are left out.
    pub async fn heartbeat_worker(&self, info: &WorkerInfo) -> Result<(), StoreError> {
        check_worker_id(Op::HeartbeatWorker, &info.id)?;
        let limit = ("worker info", WORKER_INFO_MAX_BYTES);
        let bytes = if info.sessions_warm.len() > WORKER_WARM_SESSIONS_MAX {
            let mut bounded = info.clone();
            bounded.sessions_warm.truncate(WORKER_WARM_SESSIONS_MAX);
            encode(&bounded, limit, Op::HeartbeatWorker)?
        } else {
            encode(info, limit, Op::HeartbeatWorker)?
        };
        self.inner
            .workers
            .put(&info.id, bytes)
            .await
            .map_err(|e| StoreError::nats(Op::HeartbeatWorker, e))?;
        Ok(())
    }

    /// Every worker whose key has not expired, by id. Entries that do not parse are skipped (and logged).
    pub async fn live_workers(&self) -> Result<Vec<WorkerInfo>, StoreError> {
        let workers = &self.inner.workers;
        let messages = scan(
            &workers.stream,
            Scan {
                filter: format!("{}>", workers.prefix),
                deliver: DeliverPolicy::LastPerSubject,
                headers_only: false,
                max: usize::MAX,
            },
        )
        .await
        .map_err(|e| StoreError::nats(Op::LiveWorkers, e))?;
        let mut out: Vec<WorkerInfo> = messages
            .iter()
            .filter(|m| !is_kv_marker(&m.message))
            .filter_map(|m| match serde_json::from_slice(&m.message.payload) {
                Ok(info) => Some(info),
                Err(e) => {
                    tracing::warn!(subject = %m.message.subject, error = %e, "skipping a worker entry that does not parse");
                    None
                }
            })
            .collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(out)
    }

    /// Deregisters a worker now (a clean shutdown) instead of waiting for its key to expire.
    pub async fn remove_worker(&self, worker_id: &str) -> Result<(), StoreError> {
        check_worker_id(Op::RemoveWorker, worker_id)?;
        self.inner
            .workers
            .delete(worker_id)
            .await
            .map_err(|e| StoreError::nats(Op::RemoveWorker, e))
    }
}
