//! The job record kept in the jobs bucket, and its app-facing snapshot.

use std::time::{Duration, UNIX_EPOCH};

use fleet_proto::api::{ApiError, JobId, JobSnapshot, JobState, ProgressEvent};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// One job, as stored at `<user_key>.<job_id>` in `<prefix>_jobs`. Times are Unix epoch milliseconds.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct JobRecord {
    /// The id (also the plugin-side `invoke_id`).
    pub job_id: JobId,
    /// The real user id (keys use [`user_key`](fleet_proto::api::user_key)).
    pub user: String,
    /// The tool id as the caller named it.
    pub tool_id: String,
    /// The plugin.
    pub plugin: String,
    /// The tool inside it.
    pub tool: String,
    /// The tool's arguments (≤ 64 KB serialized, checked by the caller).
    #[serde(default)]
    pub args: Map<String, Value>,
    /// The caller's tag (≤ 120 chars).
    #[serde(default)]
    pub client_tag: Option<String>,
    /// The state.
    pub state: JobState,
    /// Creation.
    pub created_at_ms: u64,
    /// Last write.
    pub updated_at_ms: u64,
    /// When it became `running`.
    #[serde(default)]
    pub started_at_ms: Option<u64>,
    /// When it became terminal.
    #[serde(default)]
    pub finished_at_ms: Option<u64>,
    /// The absolute deadline.
    pub deadline_ms: u64,
    /// The (clamped) `timeoutMs` the deadline was computed from.
    pub timeout_ms: u64,
    /// The worker running it.
    #[serde(default)]
    pub worker: Option<String>,
    /// Dispatch attempts.
    #[serde(default)]
    pub attempt: u32,
    /// The plugin payload, on `succeeded` (≤ 256 KB, checked by the caller).
    #[serde(default)]
    pub result: Option<Value>,
    /// On `failed`, `cancelled`, `expired`.
    #[serde(default)]
    pub error: Option<ApiError>,
    /// The last heartbeat of its invoke.
    #[serde(default)]
    pub last_heartbeat_ms: Option<u64>,
    /// The highest progress seq folded into the record.
    #[serde(default)]
    pub last_seq: u64,
    /// The bytes the job's progress ring keeps, as counted by the worker that ran it (its events' payloads, each
    /// with [`STORED_MESSAGE_OVERHEAD`](crate::settings::STORED_MESSAGE_OVERHEAD)): set with its outcome, and
    /// charged to its user's storage account. Absent: the ring is charged at its bound for `last_seq` events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress_bytes: Option<u64>,
    /// The job's delegation for its agent sessions' tool calls (`jobs.<secret>`, see the fleet crate's
    /// `delegation::JobDelegations`): read by the worker that starts the job, never in a snapshot, an event or a
    /// log (`Debug` shows `jobs` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delegation: Option<fleet_proto::api::delegation::DelegationToken>,
    /// The front's seal on what the job runs (`fleet_proto::api::worker::job_seal_input` of the user, tool id,
    /// plugin, method, the arguments' digest, job id, deadline and timeout): its exec key's Ed25519 signature,
    /// base64url, set once at creation. Workers and sweepers run or dispatch a queued job only when it verifies
    /// (the fleet crate's `nats_auth::exec_seal`); a record without one (written before seals existed, or not by
    /// a front) is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seal: Option<String>,
}

/// The last millisecond RFC 3339 can show (9999-12-31T23:59:59.999Z).
const MAX_RFC3339_MS: u64 = 253_402_300_799_999;

/// Epoch milliseconds as RFC 3339 with milliseconds (`2024-01-02T03:04:05.678Z`); clamped to year 9999.
pub fn rfc3339_ms(ms: u64) -> String {
    let t = UNIX_EPOCH + Duration::from_millis(ms.min(MAX_RFC3339_MS));
    humantime::format_rfc3339_millis(t).to_string()
}

impl JobRecord {
    /// A new job as `tools.invokeAsync` records it before admission: `queued` at `now_ms`, its deadline
    /// `timeout_ms` later, no arguments or tag yet (set them on the result), never started or tried.
    pub fn queued(
        job_id: JobId,
        user: &str,
        tool_id: &str,
        plugin: &str,
        tool: &str,
        now_ms: u64,
        timeout_ms: u64,
    ) -> JobRecord {
        JobRecord {
            job_id,
            user: user.to_owned(),
            tool_id: tool_id.to_owned(),
            plugin: plugin.to_owned(),
            tool: tool.to_owned(),
            args: Map::new(),
            client_tag: None,
            state: JobState::Queued,
            created_at_ms: now_ms,
            updated_at_ms: now_ms,
            started_at_ms: None,
            finished_at_ms: None,
            deadline_ms: now_ms.saturating_add(timeout_ms),
            timeout_ms,
            worker: None,
            attempt: 0,
            result: None,
            error: None,
            last_heartbeat_ms: None,
            last_seq: 0,
            progress_bytes: None,
            delegation: None,
            seal: None,
        }
    }

    /// The app-facing snapshot with the given progress slice. `lastSeq` is the higher of the record's and the
    /// slice's last seq (the ring may be ahead of the record).
    pub fn snapshot(&self, progress: Vec<ProgressEvent>) -> JobSnapshot {
        let last_seq = progress.iter().map(|e| e.seq).fold(self.last_seq, u64::max);
        JobSnapshot {
            job_id: self.job_id.clone(),
            state: self.state,
            tool_id: self.tool_id.clone(),
            method: Some(self.tool.clone()),
            client_tag: self.client_tag.clone(),
            result: self.result.clone(),
            error: self.error.clone(),
            progress,
            last_seq,
            last_heartbeat_at: self.last_heartbeat_ms.map(rfc3339_ms),
            created_at: rfc3339_ms(self.created_at_ms),
            started_at: self.started_at_ms.map(rfc3339_ms),
            finished_at: self.finished_at_ms.map(rfc3339_ms),
            updated_at: Some(rfc3339_ms(self.updated_at_ms)),
            deadline_ms: self.deadline_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_is_millisecond_precise_and_clamped() {
        assert_eq!(rfc3339_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339_ms(1_700_000_000_123), "2023-11-14T22:13:20.123Z");
        assert_eq!(rfc3339_ms(u64::MAX), "9999-12-31T23:59:59.999Z");
    }
}
