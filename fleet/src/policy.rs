//! The app-facing timeout and deadline policies (spec §10.3, §10.4, §16 A-3): pure functions, so every
//! boundary is unit-tested here.

use fleet_proto::api::ApiError;
use fleet_proto::limits::{
    INVOKE_TIMEOUT_DEFAULT_MS, INVOKE_TIMEOUT_GRACE_MS, INVOKE_TIMEOUT_MAX_MS, INVOKE_TIMEOUT_MIN_MS,
    JOB_DEADLINE_DEFAULT_MS, JOB_DEADLINE_MAX_MS, JOB_DEADLINE_MIN_MS,
};
use serde_json::json;
use std::time::Duration;

/// The resolved `tools.invoke` timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncTimeout {
    /// The explicit plugin-facing timeout after clamping; `None`: the manifest's tool timeout, else 65 s.
    pub timeout_ms: Option<u64>,
    /// What the caller asked for, when it was clamped.
    pub requested_ms: Option<u64>,
}

impl SyncTimeout {
    /// `timeoutMs` < 1000 → `invalid_arg`; > 90 000 → clamped (spec §10.3 HR-SI-01). Booleans never get here:
    /// the argument type is a number.
    pub fn resolve(requested: Option<u64>) -> Result<SyncTimeout, ApiError> {
        match requested {
            None => Ok(SyncTimeout {
                timeout_ms: None,
                requested_ms: None,
            }),
            Some(t) if t < INVOKE_TIMEOUT_MIN_MS => Err(ApiError::invalid_arg(
                "timeoutMs",
                format!("timeoutMs must be at least {INVOKE_TIMEOUT_MIN_MS} ms, got {t}"),
            )),
            Some(t) if t > INVOKE_TIMEOUT_MAX_MS => Ok(SyncTimeout {
                timeout_ms: Some(INVOKE_TIMEOUT_MAX_MS),
                requested_ms: Some(t),
            }),
            Some(t) => Ok(SyncTimeout {
                timeout_ms: Some(t),
                requested_ms: None,
            }),
        }
    }

    /// How long the front waits for the worker: the longest the plugin may take, plus the 2 s grace.
    pub fn front_wait_ms(&self) -> u64 {
        self.timeout_ms.unwrap_or(INVOKE_TIMEOUT_MAX_MS) + INVOKE_TIMEOUT_GRACE_MS
    }
}

/// The plugin-facing timeout a worker applies (spec §16 A-3): the explicit one, else the manifest's tool timeout
/// when declared (clamped to the maximum), else the default.
pub fn effective_timeout_ms(
    explicit: Option<u64>,
    manifest_ms: Option<u64>,
    default_ms: u64,
    max_ms: u64,
) -> u64 {
    explicit
        .or(manifest_ms.map(|m| m.min(max_ms)))
        .unwrap_or(default_ms)
}

/// `tool_timeout` details when the timeout was clamped (spec §10.3 HR-SI-04).
pub fn timeout_details(timeout_ms: u64, requested_ms: Option<u64>) -> Option<serde_json::Value> {
    requested_ms.map(|r| {
        json!({ "timeout_ms": timeout_ms, "requested_timeout_ms": r, "max_timeout_ms": INVOKE_TIMEOUT_MAX_MS })
    })
}

/// A job deadline in ms from now: default 30 min, clamped to [60 s, 24 h] (spec §10.4).
pub fn job_timeout_ms(requested: Option<u64>) -> u64 {
    requested
        .unwrap_or(JOB_DEADLINE_DEFAULT_MS)
        .clamp(JOB_DEADLINE_MIN_MS, JOB_DEADLINE_MAX_MS)
}

/// The default when the manifest declares nothing.
pub const SYNC_DEFAULT_MS: u64 = INVOKE_TIMEOUT_DEFAULT_MS;

/// How often a worker refreshes its registry entry and its running jobs' heartbeats.
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(2);

/// How long the worker registry may go without storing any worker's refresh before a front stops ageing its
/// entries (twice a worker's refresh interval: a live worker refreshes within one). Every worker falling silent
/// at once is a registry that cannot store (its stream electing a leader after a NATS node died, 5–8 s), not
/// every worker dying: the front keeps the last membership it saw, and a worker that is really gone costs a call
/// one "no responders" round trip.
pub const REGISTRY_QUIET: Duration = HEARTBEAT_EVERY.saturating_mul(2);

#[cfg(test)]
mod tests {
    use fleet_proto::api::ApiErrorCode;

    use super::*;

    #[test]
    fn sync_timeout_boundaries() {
        assert_eq!(
            SyncTimeout::resolve(Some(999)).unwrap_err().code,
            ApiErrorCode::InvalidArg
        );
        assert_eq!(
            SyncTimeout::resolve(Some(1000)).unwrap(),
            SyncTimeout {
                timeout_ms: Some(1000),
                requested_ms: None
            }
        );
        assert_eq!(
            SyncTimeout::resolve(Some(90_000)).unwrap(),
            SyncTimeout {
                timeout_ms: Some(90_000),
                requested_ms: None
            }
        );
        assert_eq!(
            SyncTimeout::resolve(Some(90_001)).unwrap(),
            SyncTimeout {
                timeout_ms: Some(90_000),
                requested_ms: Some(90_001)
            }
        );
        assert_eq!(SyncTimeout::resolve(None).unwrap().timeout_ms, None);
        assert_eq!(SyncTimeout::resolve(Some(5000)).unwrap().front_wait_ms(), 7000);
        assert_eq!(SyncTimeout::resolve(None).unwrap().front_wait_ms(), 92_000);
    }

    #[test]
    fn manifest_timeout_is_the_default_when_declared() {
        assert_eq!(effective_timeout_ms(None, None, SYNC_DEFAULT_MS, 90_000), 65_000);
        assert_eq!(
            effective_timeout_ms(None, Some(10_000), SYNC_DEFAULT_MS, 90_000),
            10_000
        );
        assert_eq!(
            effective_timeout_ms(None, Some(600_000), SYNC_DEFAULT_MS, 90_000),
            90_000
        );
        assert_eq!(
            effective_timeout_ms(Some(2000), Some(10_000), SYNC_DEFAULT_MS, 90_000),
            2000
        );
    }

    #[test]
    fn clamp_details() {
        assert_eq!(timeout_details(90_000, None), None);
        assert_eq!(
            timeout_details(90_000, Some(120_000)).unwrap(),
            json!({"timeout_ms": 90000, "requested_timeout_ms": 120000, "max_timeout_ms": 90000})
        );
    }

    #[test]
    fn job_deadline_boundaries() {
        assert_eq!(job_timeout_ms(None), 1_800_000);
        assert_eq!(job_timeout_ms(Some(59_000)), 60_000);
        assert_eq!(job_timeout_ms(Some(60_000)), 60_000);
        assert_eq!(job_timeout_ms(Some(86_400_000)), 86_400_000);
        assert_eq!(job_timeout_ms(Some(86_400_001)), 86_400_000);
    }
}
