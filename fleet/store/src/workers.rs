//! The worker registry (`<prefix>_workers`, key `<worker_id>`). The bucket's `max_age` is the worker TTL: a key
//! not refreshed within it is removed by JetStream, and a worker without a key is dead.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::consumer::DeliverPolicy;
use async_nats::jetstream::kv::Operation;
use futures::{Stream, StreamExt as _};
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
    /// Its exec-seal session public key (X25519, base64url): fronts seal what they send it with a session grant
    /// for this key (`fleet::nats_auth::exec_seal`); absent (a worker of an earlier release), they sign each
    /// message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seal_key: Option<String>,
}

/// One change of the worker registry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkerChange {
    /// A worker registered or refreshed its entry.
    Up(WorkerInfo),
    /// A worker deregistered (by id).
    Down(String),
}

/// How long ago a server timestamp (Unix ns) was, by our clock.
fn age_of(unix_nanos: i128) -> Duration {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i128::try_from(d.as_nanos()).unwrap_or(i128::MAX));
    u64::try_from((now - unix_nanos).max(0)).map_or(Duration::MAX, Duration::from_nanos)
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
        Ok(self
            .live_workers_aged()
            .await?
            .into_iter()
            .map(|(info, _)| info)
            .collect())
    }

    /// Like [`live_workers`](Self::live_workers), with how long ago each entry was written (by the server's
    /// clock; zero when that clock is ahead of ours).
    pub async fn live_workers_aged(&self) -> Result<Vec<(WorkerInfo, Duration)>, StoreError> {
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
        let mut out: Vec<(WorkerInfo, Duration)> = messages
            .iter()
            .filter(|m| !is_kv_marker(&m.message))
            .filter_map(|m| match serde_json::from_slice::<WorkerInfo>(&m.message.payload) {
                Ok(info) => {
                    let age = m
                        .info()
                        .map_or(Duration::ZERO, |i| age_of(i.published.unix_timestamp_nanos()));
                    Some((info, age))
                }
                Err(e) => {
                    tracing::warn!(subject = %m.message.subject, error = %e, "skipping a worker entry that does not parse");
                    None
                }
            })
            .collect();
        out.sort_by(|a, b| a.0.id.cmp(&b.0.id));
        Ok(out)
    }

    /// The registry's changes from now on (no history: read [`live_workers_aged`](Self::live_workers_aged)
    /// after this returns to know the state the changes apply to). A key that expires by the bucket's `max_age`
    /// produces no change: whoever follows the registry also ages the entries it holds (the worker TTL).
    pub async fn watch_workers(
        &self,
    ) -> Result<impl Stream<Item = Result<WorkerChange, StoreError>> + Send + Unpin + 'static, StoreError>
    {
        let watch = self
            .inner
            .workers
            .watch_all()
            .await
            .map_err(|e| StoreError::nats(Op::WatchWorkers, e))?;
        Ok(Box::pin(watch.filter_map(|entry| async move {
            match entry {
                Err(e) => Some(Err(StoreError::nats(Op::WatchWorkers, e))),
                Ok(e) => match e.operation {
                    Operation::Delete | Operation::Purge => Some(Ok(WorkerChange::Down(e.key))),
                    Operation::Put => match serde_json::from_slice::<WorkerInfo>(&e.value) {
                        Ok(info) => Some(Ok(WorkerChange::Up(info))),
                        Err(err) => {
                            tracing::warn!(worker = %e.key, error = %err, "skipping a worker entry that does not parse");
                            None
                        }
                    },
                },
            }
        })))
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
