//! The fleet's own API, used over NATS and HTTP: `tools.list`, `tools.invoke`, `tools.invokeAsync`,
//! `tools.getJob`, `tools.cancelJob`, `tools.listJobs` (spec §10), their arguments, results, the job types and
//! the string error codes of spec §10.10.
//!
//! Casing follows each surface exactly as documented (spec §16 A-48): the job API is camelCase (`jobId`,
//! `lastSeq`, `clientTag`, `deadlineMs`) except `tool_id`; the `tool_job` event is snake_case.
//!
//! Argument types carry `validate()` for the format rules of the contract (sizes, lengths, ranges); policy
//! (timeouts, quotas) is the fleet's.

use std::fmt;
use std::str::FromStr;

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value, json};

use crate::executa::invoke::ProgressType;
use crate::limits;

/// Method names (spec §10).
pub mod methods {
    /// List the caller's tools.
    pub const TOOLS_LIST: &str = "tools.list";
    /// Synchronous invoke.
    pub const TOOLS_INVOKE: &str = "tools.invoke";
    /// Create an async job.
    pub const TOOLS_INVOKE_ASYNC: &str = "tools.invokeAsync";
    /// Job snapshot.
    pub const TOOLS_GET_JOB: &str = "tools.getJob";
    /// Cancel a job.
    pub const TOOLS_CANCEL_JOB: &str = "tools.cancelJob";
    /// List jobs.
    pub const TOOLS_LIST_JOBS: &str = "tools.listJobs";
    /// Every method.
    pub const ALL: &[&str] = &[
        TOOLS_LIST,
        TOOLS_INVOKE,
        TOOLS_INVOKE_ASYNC,
        TOOLS_GET_JOB,
        TOOLS_CANCEL_JOB,
        TOOLS_LIST_JOBS,
    ];
}

/// The users of the fleet's own work (describing a catalogue plugin, detecting a plugin's dialect) are named
/// `fleet:…`: no token may name one, so no tenant shares their sessions, directories or uids.
pub const RESERVED_USER_PREFIX: &str = "fleet:";

/// The subject-, key- and file-name-safe form of a user id: the first 32 hex digits (128 bits) of its
/// SHA-256. It names the user's NATS subjects and KV keys, and the worker's per-user directories and cgroups.
pub fn user_key(user: &str) -> String {
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(user.as_bytes());
    hex::encode(&digest[..16])
}

/// NATS subjects (one place; spec §12, §16 A-51).
pub mod subjects {
    /// Prefix of the API service endpoints: `fleet.v1.api.tools.<method>` (queue group [`API_QUEUE_GROUP`]).
    pub const API_PREFIX: &str = "fleet.v1.api";
    /// Queue group of the API endpoints.
    pub const API_QUEUE_GROUP: &str = "fleet-api";
    /// Header carrying the caller's JWT.
    pub const AUTH_HEADER: &str = "Authorization";
    /// Request header (any value) asking the responder to say it is still working: until it answers, it sends
    /// the request's reply subject an empty message with [`STATUS_HEADER`] `working` every [`KEEPALIVE_EVERY`].
    /// A requester that hears nothing for [`KEEPALIVE_SILENCE`] knows its request or its answer was lost (a NATS
    /// server of the cluster died with it) instead of waiting for its whole timeout. Without the header the
    /// answer is the only message, as in plain NATS request/reply.
    pub const KEEPALIVE_HEADER: &str = "Fleet-Keepalive";
    /// Header of a keepalive message; its value is [`STATUS_WORKING`].
    pub const STATUS_HEADER: &str = "Fleet-Status";
    /// Where a front sends the keepalives of a request it got from another account (an app's: its reply
    /// subject passes one message, the answer): `fleet.v1.events.keepalive.<token>`, the token being the
    /// [`KEEPALIVE_HEADER`]'s value ([`keepalive_token_ok`]; the fleet's client sends random ones, never derived
    /// from its inbox). Apps hear the events export already: what arrives there is taken only with the request's
    /// [`ANSWER_TOKEN_HEADER`].
    pub const KEEPALIVE_EVENTS_PREFIX: &str = "fleet.v1.events.keepalive";
    /// The reply subjects NATS gives a request that came through a service import (an app's API request, seen
    /// from the fleet's account): `_R_.<token>…`. Only these are answered by a worker directly.
    pub const IMPORTED_REPLY_PREFIX: &str = "_R_.";
    /// The longest [`KEEPALIVE_HEADER`] token a front accepts.
    pub const KEEPALIVE_TOKEN_MAX: usize = 64;
    /// Request header: a secret of the request, [`ANSWER_TOKEN_HEX`] lowercase hex digits (128 random bits), that a
    /// responder repeats on every message it sends to the request's keepalive subject (its keepalives, an answer
    /// copy). Keepalive subjects are heard by other apps; a requester takes a message there only with its own
    /// secret, so no one who learned the subject can answer in the requester's place.
    pub const ANSWER_TOKEN_HEADER: &str = "Fleet-Answer-Token";
    /// The length of an [`ANSWER_TOKEN_HEADER`] value: 32 hex digits, 128 bits.
    pub const ANSWER_TOKEN_HEX: usize = 32;

    /// Whether `token` is an [`ANSWER_TOKEN_HEADER`] value: [`ANSWER_TOKEN_HEX`] lowercase hex digits.
    pub fn answer_token_ok(token: &str) -> bool {
        token.len() == ANSWER_TOKEN_HEX && token.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    }

    /// The subject of the keepalives of token `token` (see [`KEEPALIVE_EVENTS_PREFIX`]).
    pub fn keepalive(token: &str) -> String {
        format!("{KEEPALIVE_EVENTS_PREFIX}.{token}")
    }

    /// Whether `token` may name a keepalive subject: 1 to [`KEEPALIVE_TOKEN_MAX`] ASCII letters and digits in
    /// dot-separated non-empty parts (no wildcard, no space, no empty token).
    pub fn keepalive_token_ok(token: &str) -> bool {
        !token.is_empty()
            && token.len() <= KEEPALIVE_TOKEN_MAX
            && token
                .split('.')
                .all(|part| !part.is_empty() && part.bytes().all(|b| b.is_ascii_alphanumeric()))
    }
    /// [`STATUS_HEADER`]'s value on a keepalive.
    pub const STATUS_WORKING: &str = "working";
    /// [`STATUS_HEADER`]'s value on the copy of an accepted job's answer (`tools.invokeAsync`, success) that a
    /// front also publishes on the keepalive subject of a request from another account: that request's reply
    /// mapping lives on the NATS server the app is connected to and dies with it, while the events export reaches
    /// the app again once it reconnected. So an app whose server died under its `invokeAsync` still learns the job
    /// id. The payload is the answer's, byte for byte; only accepted jobs' answers are copied (no user data).
    pub const STATUS_ANSWERED: &str = "answered";
    /// How often a responder asked for keepalives sends one while it works.
    pub const KEEPALIVE_EVERY: std::time::Duration = std::time::Duration::from_secs(1);
    /// How long a requester that asked for keepalives waits without hearing anything (neither a keepalive nor
    /// the answer) before it gives the request up as lost: four keepalive periods, so a responder whose timer is
    /// late by up to three (a starved machine) is not taken for lost.
    pub const KEEPALIVE_SILENCE: std::time::Duration = std::time::Duration::from_secs(4);

    /// The subject of an API method, e.g. `fleet.v1.api.tools.invoke`.
    pub fn api(method: &str) -> String {
        format!("{API_PREFIX}.{method}")
    }

    /// A worker's execution subject.
    pub fn worker_exec(worker_id: &str) -> String {
        format!("fleet.v1.worker.{worker_id}.exec")
    }

    /// A worker's cancel subject.
    pub fn worker_cancel(worker_id: &str) -> String {
        format!("fleet.v1.worker.{worker_id}.cancel")
    }

    /// A worker's job-holding subject: which of the jobs named it runs ([`super::worker::JobsHeldQuery`]).
    pub fn worker_jobs(worker_id: &str) -> String {
        format!("fleet.v1.worker.{worker_id}.jobs")
    }

    /// Where a job's terminal record is published as it is written (its JSON, at most
    /// [`FINISHED_ANNOUNCE_MAX_BYTES`]), for the fronts' memory of finished jobs: inside the fleet's account
    /// only (neither exported nor open to apps).
    pub const JOBS_FINISHED: &str = "fleet.v1.jobs.finished";

    /// The largest terminal record announced on [`JOBS_FINISHED`]; a larger one (a big result) is read from the
    /// store by the first `getJob` instead, so a front's share of the announcements stays small.
    pub const FINISHED_ANNOUNCE_MAX_BYTES: usize = 64 * 1024;

    /// `tool_job` events of one user (keyed by the user's subject-safe key).
    pub fn user_events(user_key: &str) -> String {
        format!("fleet.v1.events.{user_key}")
    }

    /// The compatibility cancel subject, verbatim from the spec (§12.1 N6, HR-NT-04).
    pub fn matrix_cancel(client_id: &str) -> String {
        format!("matrix.cancel.{client_id}")
    }
}

/// The string error codes of the app-facing API (spec §10.10).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApiErrorCode {
    /// Bad or expired token.
    InvalidToken,
    /// Not allowed.
    PermissionDenied,
    /// Bad argument.
    InvalidArg,
    /// Not found (window/storage).
    NotFound,
    /// No worker can take the call.
    AgentUnavailable,
    /// Outer envelope failure: the plugin could not be run.
    ExecutaUnavailable,
    /// The plugin answered with a JSON-RPC error.
    ExecutaError,
    /// The plugin returned `success: false`.
    ToolFailed,
    /// The invoke or job ran out of time.
    ToolTimeout,
    /// A reverse-RPC subcall timed out.
    SubcallTimeout,
    /// Result over the cap.
    ResultTooLarge,
    /// The job was cancelled.
    Cancelled,
    /// Client-side wait elapsed (SDK only; listed for completeness).
    WaitTimeout,
    /// More than 5 active jobs.
    JobQuotaExceeded,
    /// More than 3 long jobs on the worker.
    LongJobCapacity,
    /// Unknown job, or another user's.
    JobNotFound,
    /// Too many requests.
    RateLimited,
    /// Not implemented.
    NotImplemented,
    /// Anything unhandled.
    InternalError,
}

impl ApiErrorCode {
    /// The wire string.
    pub fn as_str(self) -> &'static str {
        match self {
            ApiErrorCode::InvalidToken => "invalid_token",
            ApiErrorCode::PermissionDenied => "permission_denied",
            ApiErrorCode::InvalidArg => "invalid_arg",
            ApiErrorCode::NotFound => "not_found",
            ApiErrorCode::AgentUnavailable => "agent_unavailable",
            ApiErrorCode::ExecutaUnavailable => "executa_unavailable",
            ApiErrorCode::ExecutaError => "executa_error",
            ApiErrorCode::ToolFailed => "tool_failed",
            ApiErrorCode::ToolTimeout => "tool_timeout",
            ApiErrorCode::SubcallTimeout => "subcall_timeout",
            ApiErrorCode::ResultTooLarge => "result_too_large",
            ApiErrorCode::Cancelled => "cancelled",
            ApiErrorCode::WaitTimeout => "wait_timeout",
            ApiErrorCode::JobQuotaExceeded => "job_quota_exceeded",
            ApiErrorCode::LongJobCapacity => "long_job_capacity",
            ApiErrorCode::JobNotFound => "job_not_found",
            ApiErrorCode::RateLimited => "rate_limited",
            ApiErrorCode::NotImplemented => "not_implemented",
            ApiErrorCode::InternalError => "internal_error",
        }
    }

    /// Whether retrying the same call later may succeed (spec §10.10 "Retryable").
    pub fn retryable(self) -> bool {
        matches!(
            self,
            ApiErrorCode::AgentUnavailable
                | ApiErrorCode::ExecutaUnavailable
                | ApiErrorCode::JobQuotaExceeded
                | ApiErrorCode::LongJobCapacity
                | ApiErrorCode::RateLimited
                | ApiErrorCode::InvalidToken
        )
    }
}

impl fmt::Display for ApiErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An API error `{code, message, details?}` (spec §10.1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ApiError {
    /// The string code.
    pub code: ApiErrorCode,
    /// Human-readable.
    pub message: String,
    /// Structured details (e.g. `{size, max, retriable}` for `result_too_large`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub details: Option<Value>,
}

impl ApiError {
    /// An error without details.
    pub fn new(code: ApiErrorCode, message: impl Into<String>) -> Self {
        ApiError {
            code,
            message: message.into(),
            details: None,
        }
    }

    /// An error with details.
    pub fn with_details(code: ApiErrorCode, message: impl Into<String>, details: Value) -> Self {
        ApiError {
            code,
            message: message.into(),
            details: Some(details),
        }
    }

    /// `invalid_arg` naming the field.
    pub fn invalid_arg(field: &str, message: impl Into<String>) -> Self {
        ApiError::with_details(ApiErrorCode::InvalidArg, message, json!({ "field": field }))
    }

    /// `job_quota_exceeded` for any of the three quotas, its message and `details` made from `details` (the one
    /// place both are spelled; the retained-jobs and stored-bytes quotas' `retriable` is always `true`).
    pub fn job_quota_exceeded(details: JobQuotaDetails) -> Self {
        let (message, details) = match details {
            JobQuotaDetails::Active { active, max } => (
                format!("{active} jobs are active; at most {max} per user"),
                JobQuotaDetails::Active { active, max },
            ),
            JobQuotaDetails::Retained {
                retained,
                max,
                retry_after_ms,
                ..
            } => (
                format!(
                    "{retained} jobs were created within the retention, the limit is {max}; retry in {} s",
                    retry_after_ms.div_ceil(1000)
                ),
                JobQuotaDetails::Retained {
                    retained,
                    max,
                    retry_after_ms,
                    retriable: true,
                },
            ),
            JobQuotaDetails::Stored {
                stored_bytes,
                job_reserve_bytes,
                max_bytes,
                retry_after_ms,
                ..
            } => (
                format!(
                    "the user's jobs keep {stored_bytes} bytes and one more may keep {job_reserve_bytes}, the \
                     limit is {max_bytes}; retry in {} s",
                    retry_after_ms.div_ceil(1000)
                ),
                JobQuotaDetails::Stored {
                    stored_bytes,
                    job_reserve_bytes,
                    max_bytes,
                    retry_after_ms,
                    retriable: true,
                },
            ),
        };
        let details = serde_json::to_value(details).unwrap_or(Value::Null);
        ApiError::with_details(ApiErrorCode::JobQuotaExceeded, message, details)
    }

    /// The typed `details` of a `job_quota_exceeded` error (`None` for any other code, or details of another
    /// shape).
    pub fn job_quota(&self) -> Option<JobQuotaDetails> {
        if self.code != ApiErrorCode::JobQuotaExceeded {
            return None;
        }
        JobQuotaDetails::deserialize(self.details.as_ref()?).ok()
    }

    /// `invalid_arg` for a request's arguments over a size cap, with `{field: "args", reason: "args_too_large",
    /// size, max}` ([`ARGS_TOO_LARGE`]): a sync `tools.invoke` request over the front's cap (refused before it is
    /// parsed), or `tools.invokeAsync` args over 64 KB (spec §10.4).
    pub fn args_too_large(size: usize, max: usize) -> Self {
        ApiError::with_details(
            ApiErrorCode::InvalidArg,
            format!("args are {size} bytes, over the limit of {max}"),
            json!({ "field": "args", "reason": ARGS_TOO_LARGE, "size": size, "max": max }),
        )
    }

    /// `result_too_large` with `{size, max, retriable: false}` (spec §10.3 HR-SI-05).
    pub fn result_too_large(size: usize, max: usize) -> Self {
        ApiError::with_details(
            ApiErrorCode::ResultTooLarge,
            format!("the result is {size} bytes, over the limit of {max}"),
            json!({ "size": size, "max": max, "retriable": false }),
        )
    }
}

/// The `details.reason` of an `invalid_arg` refusing arguments over a size cap ([`ApiError::args_too_large`]): the
/// code stays `invalid_arg` (spec §10.10's closed list), the reason tells it from a malformed argument.
pub const ARGS_TOO_LARGE: &str = "args_too_large";

/// The `details` of `job_quota_exceeded` (`tools.invokeAsync`): which of the two quotas refused the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum JobQuotaDetails {
    /// `max_retained_jobs_per_user` jobs were created within the retention; room frees when the user's oldest
    /// jobs leave it, `retry_after_ms` from the answer.
    Retained {
        /// Jobs created within the retention.
        retained: u64,
        /// The cap.
        max: u64,
        /// When a creation may succeed again, in ms from the answer.
        retry_after_ms: u64,
        /// Always `true`.
        #[serde(default)]
        retriable: bool,
    },
    /// The bytes the user's jobs keep (records and progress), with what one more job may keep
    /// (`job_reserve_bytes`), would pass `max_bytes` (the fleet's per-user storage cap); room frees when the
    /// user's oldest jobs leave the store, `retry_after_ms` from the answer, or when an active job ends keeping
    /// less than its reserve.
    Stored {
        /// Bytes the user's jobs keep now (active jobs counted at their reserve).
        stored_bytes: u64,
        /// What a new job reserves until it ends.
        job_reserve_bytes: u64,
        /// The cap.
        max_bytes: u64,
        /// When the oldest jobs' bytes leave the store, in ms from the answer.
        retry_after_ms: u64,
        /// Always `true`.
        #[serde(default)]
        retriable: bool,
    },
    /// The user has `max` active (queued or running) jobs.
    Active {
        /// The user's active jobs.
        active: u64,
        /// The cap (5).
        max: u64,
    },
}

impl JobQuotaDetails {
    /// How long to wait before trying again, when the quota says (the retained-jobs cap does; the active-jobs
    /// quota frees when one of the user's jobs ends).
    pub fn retry_after(&self) -> Option<std::time::Duration> {
        match self {
            JobQuotaDetails::Retained { retry_after_ms, .. }
            | JobQuotaDetails::Stored { retry_after_ms, .. } => {
                Some(std::time::Duration::from_millis(*retry_after_ms))
            }
            JobQuotaDetails::Active { .. } => None,
        }
    }
}

/// The response envelope of every API call: `{ok: true, result}` or `{ok: false, error}` (spec §10.1).
#[derive(Debug, Clone, PartialEq)]
pub enum ApiResponse<T> {
    /// `ok: true`.
    Ok(T),
    /// `ok: false`.
    Err(ApiError),
}

impl<T: Serialize> Serialize for ApiResponse<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Wire<'a, T> {
            ok: bool,
            #[serde(skip_serializing_if = "Option::is_none")]
            result: Option<&'a T>,
            #[serde(skip_serializing_if = "Option::is_none")]
            error: Option<&'a ApiError>,
        }
        match self {
            ApiResponse::Ok(r) => Wire {
                ok: true,
                result: Some(r),
                error: None,
            }
            .serialize(serializer),
            ApiResponse::Err(e) => Wire::<T> {
                ok: false,
                result: None,
                error: Some(e),
            }
            .serialize(serializer),
        }
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for ApiResponse<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(bound = "T: Deserialize<'de>")]
        struct Wire<T> {
            ok: bool,
            // `deserialize_with` keeps `"result": null` as `Some(null)` rather than "absent".
            #[serde(default = "Option::default", deserialize_with = "present")]
            result: Option<T>,
            #[serde(default)]
            error: Option<ApiError>,
        }
        fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<T>, D::Error> {
            T::deserialize(d).map(Some)
        }
        let w = Wire::<T>::deserialize(deserializer)?;
        match (w.ok, w.result, w.error) {
            (true, Some(r), _) => Ok(ApiResponse::Ok(r)),
            (false, _, Some(e)) => Ok(ApiResponse::Err(e)),
            (true, None, _) => Err(D::Error::custom("ok: true without result")),
            (false, _, None) => Err(D::Error::custom("ok: false without error")),
        }
    }
}

impl<T> From<Result<T, ApiError>> for ApiResponse<T> {
    fn from(r: Result<T, ApiError>) -> Self {
        match r {
            Ok(v) => ApiResponse::Ok(v),
            Err(e) => ApiResponse::Err(e),
        }
    }
}

impl<T> ApiResponse<T> {
    /// As a `Result`.
    pub fn into_result(self) -> Result<T, ApiError> {
        match self {
            ApiResponse::Ok(v) => Ok(v),
            ApiResponse::Err(e) => Err(e),
        }
    }
}

/// The HTTP RPC request envelope `{id, method, args}` (spec §10.1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApiRequest {
    /// Caller's correlation id, echoed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// One of [`methods::ALL`].
    pub method: String,
    /// The method's arguments.
    #[serde(default)]
    pub args: Value,
}

// -------------------------------------------------------------------------------------------------------------
// Jobs
// -------------------------------------------------------------------------------------------------------------

/// A job id: `tjob_` + 32 lowercase hex, also the plugin-side `invoke_id` (spec §10.4 HR-AJ-01). Nothing else
/// can be constructed or deserialized.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JobId(String);

/// A string that is not a job id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a jobId must match ^tjob_[0-9a-f]{{32}}$, got {0:?}")]
pub struct InvalidJobId(pub String);

impl JobId {
    /// The prefix.
    pub const PREFIX: &'static str = "tjob_";

    /// The id made of 16 (random) bytes.
    pub fn from_bytes(bytes: [u8; 16]) -> JobId {
        let mut s = String::with_capacity(37);
        s.push_str(Self::PREFIX);
        for b in bytes {
            s.push(char::from_digit(u32::from(b >> 4), 16).unwrap_or('0'));
            s.push(char::from_digit(u32::from(b & 0xf), 16).unwrap_or('0'));
        }
        JobId(s)
    }

    /// The id as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for JobId {
    type Err = InvalidJobId;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let ok = s.len() == 37
            && s.starts_with(Self::PREFIX)
            && s[5..]
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if ok {
            Ok(JobId(s.to_string()))
        } else {
            Err(InvalidJobId(s.to_string()))
        }
    }
}

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for JobId {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for JobId {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = std::borrow::Cow::<'de, str>::deserialize(deserializer)?;
        s.parse().map_err(D::Error::custom)
    }
}

/// A job's state (spec §10.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    /// Accepted, not started.
    Queued,
    /// The invoke was sent to the plugin.
    Running,
    /// `success: true`.
    Succeeded,
    /// `success: false`, JSON-RPC error, crash, `result_too_large`, worker lost.
    Failed,
    /// Cancelled by the caller.
    Cancelled,
    /// Deadline elapsed.
    Expired,
}

impl JobState {
    /// Every state.
    pub const ALL: [JobState; 6] = [
        JobState::Queued,
        JobState::Running,
        JobState::Succeeded,
        JobState::Failed,
        JobState::Cancelled,
        JobState::Expired,
    ];

    /// The wire string.
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Running => "running",
            JobState::Succeeded => "succeeded",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
            JobState::Expired => "expired",
        }
    }

    /// Terminal states are final (spec §10.5 HR-JS-01).
    pub fn is_terminal(self) -> bool {
        !self.is_active()
    }

    /// Queued or running: counts against the per-user quota.
    pub fn is_active(self) -> bool {
        matches!(self, JobState::Queued | JobState::Running)
    }

    /// Whether the state machine allows `self → next` (spec §10.5).
    pub fn can_become(self, next: JobState) -> bool {
        match self {
            JobState::Queued => next != JobState::Queued,
            JobState::Running => next.is_terminal(),
            _ => false,
        }
    }
}

impl fmt::Display for JobState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One stored progress event `{seq, type, data}` (spec §8.10 HR-PG-07).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProgressEvent {
    /// Per-job, strictly increasing.
    pub seq: u64,
    /// `progress` or `tool_update`.
    #[serde(rename = "type")]
    pub kind: ProgressType,
    /// The plugin's payload.
    pub data: Value,
}

/// The authoritative view of a job (spec §10.7).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct JobSnapshot {
    /// The id.
    pub job_id: JobId,
    /// The state.
    pub state: JobState,
    /// The tool id as the caller named it.
    #[serde(rename = "tool_id")]
    pub tool_id: String,
    /// The tool name inside the plugin.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    /// The caller's tag.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_tag: Option<String>,
    /// The plugin payload, on `succeeded`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    /// On `failed`, `cancelled`, `expired`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ApiError>,
    /// Events with `seq > sinceSeq`, at most `limit` (empty in `listJobs`).
    #[serde(default)]
    pub progress: Vec<ProgressEvent>,
    /// The highest stored seq (0 when none).
    pub last_seq: u64,
    /// RFC 3339.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_heartbeat_at: Option<String>,
    /// RFC 3339.
    pub created_at: String,
    /// RFC 3339.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<String>,
    /// RFC 3339.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<String>,
    /// RFC 3339.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<String>,
    /// Absolute deadline, Unix epoch ms.
    pub deadline_ms: u64,
}

/// The `tool_job` push event (spec §10.9), snake_case. Never carries the result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolJobEvent {
    /// The job.
    pub job_id: JobId,
    /// Its tool.
    pub tool_id: String,
    /// Its state after this event.
    pub state: JobState,
    /// The job's last seq.
    pub seq: u64,
    /// The progress event folded in, if this event is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event: Option<ProgressEvent>,
    /// Whether `state` is terminal.
    pub terminal: bool,
}

// -------------------------------------------------------------------------------------------------------------
// Arguments and results
// -------------------------------------------------------------------------------------------------------------

/// `tools.list` result entry (spec §10.2, the superset of §16 A-44).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolInfo {
    /// The callable id (`plugin.tool` / `plugin__tool`, or a plugin id with `method`).
    pub tool_id: String,
    /// The plugin's installed id.
    pub plugin_name: String,
    /// The tool name inside the plugin.
    pub tool_name: String,
    /// Shown to the LLM.
    pub description: String,
    /// JSON Schema of the arguments.
    pub input_schema: Value,
    /// `available | deploying | unavailable`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
}

/// `tools.list` arguments: none (any object is accepted and ignored).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ListToolsArgs {}

/// `tools.invoke` result: the plugin's payload (its `InvokeResult.data`), always an object — a payload that is
/// not one comes back as `{"value": <payload>}`, none as `{}` (spec §10.3).
pub type InvokePayload = Map<String, Value>;

/// `tools.list` result.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ListToolsResult {
    /// The tools.
    pub tools: Vec<ToolInfo>,
}

/// `tools.invoke` arguments (spec §10.3).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InvokeArgs {
    /// The tool id.
    pub tool_id: String,
    /// The tool name; required for ids without `.` or `__`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    /// The tool's arguments.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args: Option<Map<String, Value>>,
    /// Requested timeout in ms (≥ 1000; clamped to 90 000).
    #[serde(rename = "timeoutMs", default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
}

/// A tool's arguments kept as their JSON text, always an object: what a front forwards to a worker without building
/// their tree ([`RawInvokeArgs::args`], [`worker::ExecRequest::arguments`]); the same JSON on the wire as a map.
/// The default is `{}`.
#[derive(Debug, Clone, Serialize)]
#[serde(transparent)]
pub struct RawArgs(Box<serde_json::value::RawValue>);

impl RawArgs {
    /// The arguments of `map`.
    pub fn from_map(map: &Map<String, Value>) -> RawArgs {
        serde_json::value::to_raw_value(map).map_or_else(|_| RawArgs::default(), RawArgs)
    }

    /// Their tree, where it is needed (the worker, handing them to the plugin).
    pub fn to_map(&self) -> Result<Map<String, Value>, serde_json::Error> {
        serde_json::from_str(self.0.get())
    }

    /// Their JSON text.
    pub fn get(&self) -> &str {
        self.0.get()
    }
}

impl Default for RawArgs {
    fn default() -> Self {
        RawArgs(serde_json::value::RawValue::from_string("{}".to_owned()).unwrap_or_default())
    }
}

impl PartialEq for RawArgs {
    fn eq(&self, other: &Self) -> bool {
        self.get() == other.get()
    }
}

impl<'de> Deserialize<'de> for RawArgs {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = Box::<serde_json::value::RawValue>::deserialize(deserializer)?;
        // The text is valid JSON already; an object is the one shape tool arguments take.
        if raw.get().trim_start().starts_with('{') {
            Ok(RawArgs(raw))
        } else {
            Err(D::Error::custom("invalid type: arguments must be a JSON object"))
        }
    }
}

/// `tools.invoke` arguments as a front reads them: [`InvokeArgs`] with `args` kept as text ([`RawArgs`]), since the
/// front only forwards them.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct RawInvokeArgs {
    /// The tool id.
    pub tool_id: String,
    /// The tool name; required for ids without `.` or `__`.
    #[serde(default)]
    pub method: Option<String>,
    /// The tool's arguments.
    #[serde(default)]
    pub args: Option<RawArgs>,
    /// Requested timeout in ms (≥ 1000; clamped to 90 000).
    #[serde(rename = "timeoutMs", default)]
    pub timeout_ms: Option<u64>,
}

impl RawInvokeArgs {
    /// [`InvokeArgs::validate`].
    pub fn validate(&self) -> Result<Target, ApiError> {
        validate_invoke(&self.tool_id, self.method.as_deref(), self.timeout_ms)
    }
}

/// `tools.invokeAsync` arguments (spec §10.4).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InvokeAsyncArgs {
    /// The tool id.
    pub tool_id: String,
    /// The tool name; required for ids without `.` or `__`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    /// The tool's arguments (≤ 64 KB serialized).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args: Option<Map<String, Value>>,
    /// The job deadline in ms (clamped to [60 s, 24 h], default 30 min).
    #[serde(rename = "timeoutMs", default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// ≤ 120 chars.
    #[serde(rename = "clientTag", default, skip_serializing_if = "Option::is_none")]
    pub client_tag: Option<String>,
}

/// `tools.invokeAsync` result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InvokeAsyncResult {
    /// The new job.
    pub job_id: JobId,
    /// Always `queued`.
    pub state: JobState,
    /// Absolute deadline, Unix epoch ms.
    pub deadline_ms: u64,
}

/// `tools.getJob` arguments (spec §10.7).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GetJobArgs {
    /// The job.
    pub job_id: JobId,
    /// Only events with `seq > sinceSeq`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since_seq: Option<u64>,
    /// 1–500.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

/// `tools.cancelJob` arguments (spec §10.6).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CancelJobArgs {
    /// The job.
    pub job_id: JobId,
    /// ≤ 200 chars; lands in the error message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// `tools.cancelJob` result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CancelJobResult {
    /// The job.
    pub job_id: JobId,
    /// Its state after the call.
    pub state: JobState,
    /// Whether this call cancelled it (`false` for a terminal job).
    pub cancelled: bool,
}

/// One state or several (`tools.listJobs` `state`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany<T> {
    /// One.
    One(T),
    /// Several.
    Many(Vec<T>),
}

impl<T: Clone> OneOrMany<T> {
    /// As a list.
    pub fn to_vec(&self) -> Vec<T> {
        match self {
            OneOrMany::One(t) => vec![t.clone()],
            OneOrMany::Many(v) => v.clone(),
        }
    }
}

/// `tools.listJobs` arguments (spec §10.8).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ListJobsArgs {
    /// Only this tool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_id: Option<String>,
    /// Only these states.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<OneOrMany<JobState>>,
    /// Exact match.
    #[serde(rename = "clientTag", default, skip_serializing_if = "Option::is_none")]
    pub client_tag: Option<String>,
    /// RFC 3339 lower bound on `createdAt` (lookback ≤ 7 days).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
    /// 1–100, default 20.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
    /// The `cursor` of the previous page, to continue after it (an extension of spec §10.8; absent = the newest
    /// jobs). Opaque, ≤ [`limits::LIST_JOBS_CURSOR_MAX_CHARS`] characters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cursor: Option<String>,
}

/// `tools.listJobs` result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ListJobsResult {
    /// Newest first.
    pub jobs: Vec<JobSnapshot>,
    /// More rows may match: more matched than `limit`, or the page's scan stopped before the user's oldest job
    /// (pass `cursor` to continue).
    pub truncated: bool,
    /// Where the next page starts, present exactly when `truncated` (an extension of spec §10.8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cursor: Option<String>,
}

/// Parses the arguments of a method, mapping any shape error to `invalid_arg` (booleans where numbers belong,
/// non-string `method`, a malformed `jobId`, ...).
pub fn parse_args<T: serde::de::DeserializeOwned>(args: &Value) -> Result<T, ApiError> {
    let args = if args.is_null() {
        &Value::Object(Map::new())
    } else {
        args
    };
    T::deserialize(args)
        .map_err(|e| ApiError::new(ApiErrorCode::InvalidArg, format!("invalid arguments: {e}")))
}

/// [`parse_args`] straight from the request body, without building a JSON tree first (the API's requests are
/// parsed once): an empty body or `null` is `{}`; a body that is not JSON is `invalid_arg` "arguments are not
/// JSON", a JSON body of the wrong shape `invalid_arg` "invalid arguments", as [`parse_args`] says.
pub fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let trimmed = body.trim_ascii();
    if trimmed.is_empty() || trimmed == b"null" {
        return parse_args(&Value::Null);
    }
    serde_json::from_slice(body).map_err(|e| {
        // A shape error may come before the syntax error further on: only a body that is JSON is "invalid".
        match serde_json::from_slice::<serde::de::IgnoredAny>(body) {
            Err(syntax) => ApiError::new(
                ApiErrorCode::InvalidArg,
                format!("arguments are not JSON: {syntax}"),
            ),
            Ok(_) => ApiError::new(ApiErrorCode::InvalidArg, format!("invalid arguments: {e}")),
        }
    })
}

/// The (plugin, tool) a call names (spec §10.3 "Resolution of (plugin_name, tool_name)").
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Target {
    /// The installed plugin id.
    pub plugin: String,
    /// The tool inside it.
    pub tool: String,
}

impl Target {
    /// With `method`, `tool_id` is the plugin verbatim and `method` the tool; without it, `tool_id` is split on
    /// its first `__` or `.` (whichever comes first); neither → `invalid_arg`.
    pub fn resolve(tool_id: &str, method: Option<&str>) -> Result<Target, ApiError> {
        if tool_id.is_empty() {
            return Err(ApiError::invalid_arg("tool_id", "tool_id must not be empty"));
        }
        if let Some(m) = method {
            if m.is_empty() {
                return Err(ApiError::invalid_arg("method", "method must not be empty"));
            }
            return Ok(Target {
                plugin: tool_id.to_string(),
                tool: m.to_string(),
            });
        }
        let dunder = tool_id.find("__").map(|i| (i, 2));
        let dot = tool_id.find('.').map(|i| (i, 1));
        let split = match (dunder, dot) {
            (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
            (a, b) => a.or(b),
        };
        match split {
            Some((i, w)) if i > 0 && i + w < tool_id.len() => Ok(Target {
                plugin: tool_id[..i].to_string(),
                tool: tool_id[i + w..].to_string(),
            }),
            _ => Err(ApiError::invalid_arg(
                "method",
                format!("tool_id {tool_id:?} has no '.' or '__' separator: method is required"),
            )),
        }
    }
}

fn check_chars(field: &str, value: Option<&str>, max: usize) -> Result<(), ApiError> {
    match value {
        Some(v) if v.chars().count() > max => Err(ApiError::invalid_arg(
            field,
            format!(
                "{field} is {} characters, over the limit of {max}",
                v.chars().count()
            ),
        )),
        _ => Ok(()),
    }
}

fn check_limit(field: &str, value: Option<u32>, max: u32) -> Result<(), ApiError> {
    match value {
        Some(v) if v == 0 || v > max => Err(ApiError::invalid_arg(
            field,
            format!("{field} must be 1–{max}, got {v}"),
        )),
        _ => Ok(()),
    }
}

impl InvokeArgs {
    /// The contract's format rules: `timeoutMs` ≥ 1000 (spec §10.3 HR-SI-01); the tool resolves.
    pub fn validate(&self) -> Result<Target, ApiError> {
        validate_invoke(&self.tool_id, self.method.as_deref(), self.timeout_ms)
    }
}

/// `tools.invoke`'s format rules, whichever way its arguments were read.
fn validate_invoke(tool_id: &str, method: Option<&str>, timeout_ms: Option<u64>) -> Result<Target, ApiError> {
    if let Some(t) = timeout_ms
        && t < limits::INVOKE_TIMEOUT_MIN_MS
    {
        return Err(ApiError::invalid_arg(
            "timeoutMs",
            format!(
                "timeoutMs must be at least {} ms, got {t}",
                limits::INVOKE_TIMEOUT_MIN_MS
            ),
        ));
    }
    Target::resolve(tool_id, method)
}

impl InvokeAsyncArgs {
    /// The contract's format rules: args ≤ 64 KB, `clientTag` ≤ 120 chars (spec §10.4); the tool resolves.
    pub fn validate(&self) -> Result<Target, ApiError> {
        if let Some(args) = &self.args {
            let size = serde_json::to_vec(args).map(|v| v.len()).unwrap_or(usize::MAX);
            if size > limits::MAX_JOB_ARGS_BYTES {
                return Err(ApiError::args_too_large(size, limits::MAX_JOB_ARGS_BYTES));
            }
        }
        check_chars(
            "clientTag",
            self.client_tag.as_deref(),
            limits::MAX_CLIENT_TAG_CHARS,
        )?;
        Target::resolve(&self.tool_id, self.method.as_deref())
    }
}

impl GetJobArgs {
    /// `limit` within 1–500 (spec §10.7).
    pub fn validate(&self) -> Result<(), ApiError> {
        check_limit("limit", self.limit, limits::GET_JOB_LIMIT_MAX)
    }
}

impl CancelJobArgs {
    /// `reason` ≤ 200 chars (spec §10.6 HR-CJ-04).
    pub fn validate(&self) -> Result<(), ApiError> {
        check_chars("reason", self.reason.as_deref(), limits::MAX_CANCEL_REASON_CHARS)
    }
}

impl ListJobsArgs {
    /// `limit` within 1–100 (spec §10.8); `clientTag` ≤ 120 chars; `cursor` ≤ 64 chars (its content is the
    /// fleet's to check).
    pub fn validate(&self) -> Result<(), ApiError> {
        check_limit("limit", self.limit, limits::LIST_JOBS_LIMIT_MAX)?;
        check_chars(
            "clientTag",
            self.client_tag.as_deref(),
            limits::MAX_CLIENT_TAG_CHARS,
        )?;
        check_chars(
            "cursor",
            self.cursor.as_deref(),
            limits::LIST_JOBS_CURSOR_MAX_CHARS,
        )
    }
}

// -------------------------------------------------------------------------------------------------------------
// Front ↔ worker (NATS, internal)
// -------------------------------------------------------------------------------------------------------------

/// What the front sends a worker on `fleet.v1.worker.<id>.exec` and what comes back (spec §12.2 HR-NT-02).
pub mod worker {
    use serde::{Deserialize, Serialize};
    use serde_json::value::RawValue;

    use super::{ApiError, JobId};

    /// Sync invoke or job.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(rename_all = "snake_case")]
    pub enum ExecKind {
        /// `tools.invoke`: the reply carries the result.
        Sync,
        /// `tools.invokeAsync`: the reply only accepts (or refuses) the job; the worker records the outcome.
        Job,
    }

    /// One execution request.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    pub struct ExecRequest {
        /// Sync or job.
        pub kind: ExecKind,
        /// The user (the JWT's `sub`).
        pub user: String,
        /// The tool id as the caller named it.
        pub tool_id: String,
        /// The installed plugin.
        pub plugin: String,
        /// The tool inside it.
        pub tool: String,
        /// Arguments, as the app sent them (the front never parses them into a tree).
        #[serde(default)]
        pub arguments: super::RawArgs,
        /// The invoke id (= job id for jobs).
        pub invoke_id: String,
        /// Explicit plugin-facing timeout (clamped); `None`: the manifest's tool timeout if declared, else
        /// `default_timeout_ms`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub timeout_ms: Option<u64>,
        /// The default when neither the caller nor the manifest gives one.
        pub default_timeout_ms: u64,
        /// The ceiling a manifest timeout is clamped to.
        pub max_timeout_ms: u64,
        /// Absolute deadline (Unix epoch ms) for jobs.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub deadline_ms: Option<u64>,
        /// The job, for `Job`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub job_id: Option<JobId>,
        /// What the caller asked for, when it was clamped (for `tool_timeout` details).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub requested_timeout_ms: Option<u64>,
        /// Sync only: the app's own reply subject (an imported request's, [`crate::api::subjects::IMPORTED_REPLY_PREFIX`]).
        /// The worker publishes the API answer there itself and tells the front it did ([`ExecReply::delivered`]),
        /// saving the answer's hop through the front. Sealed with the rest of the request, so only a front
        /// chooses it. Absent: the worker answers the front, which answers the caller.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub reply_to: Option<String>,
        /// Sync only: the authority the invoke's agent sessions call the user's tools with
        /// ([`super::delegation`]). Sealed with the rest of the request, so only a front grants it; the worker
        /// keeps it from the plugin.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub delegation: Option<super::delegation::DelegationToken>,
    }

    /// The two-layer reply: outer `success` = the worker could run it; `data` = the plugin's `InvokeResult`
    /// (spec §12.1 N8). For jobs, `success: true` means accepted.
    #[derive(Debug, Clone, Serialize, Deserialize)]
    pub struct ExecReply {
        /// Delivered and executed (sync) / accepted (job).
        pub success: bool,
        /// The plugin's `InvokeResult`, unparsed.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub data: Option<Box<RawValue>>,
        /// Why not.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub error: Option<ApiError>,
        /// The worker is draining (it left the registry and takes no new work): nothing ran, the front tries the
        /// next ranked worker. Absent (false) from workers that predate it.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        pub draining: bool,
        /// The worker published the API answer on the request's [`ExecRequest::reply_to`] itself: the front
        /// answers nobody. `success` and `error` still say what the answer was (for the front's metrics and
        /// traces); `data` is absent.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        pub delivered: bool,
    }

    impl ExecReply {
        /// Whether the front passes the call to the next ranked worker: this one is draining or refused it
        /// for capacity (`agent_unavailable`), and nothing ran. Such a reply is never delivered to the caller
        /// directly.
        pub fn passes_to_next_worker(&self) -> bool {
            self.draining
                || (!self.success
                    && self
                        .error
                        .as_ref()
                        .is_some_and(|e| e.code == super::ApiErrorCode::AgentUnavailable))
        }

        /// The refusal of a draining worker: nothing ran, another worker may take it.
        pub fn draining() -> ExecReply {
            ExecReply {
                success: false,
                data: None,
                error: Some(ApiError::new(
                    super::ApiErrorCode::AgentUnavailable,
                    "the worker is draining",
                )),
                draining: true,
                delivered: false,
            }
        }
    }

    /// Header of every exec request and cancel command: the front's Ed25519 signature, base64url without
    /// padding, over [`seal_input`].
    pub const SEAL_SIGNATURE_HEADER: &str = "Fleet-Exec-Signature";
    /// Header of every exec request and cancel command: `<issued Unix ms>.<32 hex digits of nonce>`, signed with
    /// the subject and the body.
    pub const SEAL_STAMP_HEADER: &str = "Fleet-Exec-Stamp";
    /// Header of an exec request, cancel command or jobs query sealed by a session grant (instead of
    /// [`SEAL_SIGNATURE_HEADER`]): HMAC-SHA256, base64url without padding, over [`seal_input`], keyed by the
    /// key the grant in [`SEAL_GRANT_HEADER`] establishes between the front and the one worker it names.
    pub const SEAL_MAC_HEADER: &str = "Fleet-Exec-Mac";
    /// Header beside [`SEAL_MAC_HEADER`]: `<expires Unix ms>.<the front's X25519 session public key>.<the
    /// front's Ed25519 signature over grant_input>`, both base64url without padding.
    pub const SEAL_GRANT_HEADER: &str = "Fleet-Exec-Grant";
    /// What a front signs to grant a session key to one worker: a domain tag, the worker's X25519 session public
    /// key (as its registry entry spells it, so the grant is good for that worker only), the front's session
    /// public key and the grant's expiry (Unix ms), each length-prefixed.
    pub fn grant_input(worker_key: &str, front_key: &str, expires_ms: u64) -> Vec<u8> {
        let expires = expires_ms.to_string();
        length_prefixed(&[
            b"fleet-exec-grant-v1",
            worker_key.as_bytes(),
            front_key.as_bytes(),
            expires.as_bytes(),
        ])
    }

    /// What the front signs: a domain tag, the subject (so a request cannot be redirected to another worker),
    /// the stamp (so it expires and is seen once) and the body, each length-prefixed.
    pub fn seal_input(subject: &str, stamp: &str, body: &[u8]) -> Vec<u8> {
        length_prefixed(&[b"fleet-exec-seal-v1", subject.as_bytes(), stamp.as_bytes(), body])
    }

    /// What a job's seal covers: everything of a job record that decides what runs, as whom and until when. A
    /// front signs [`job_seal_input`] of it with its exec key when it creates the record (`JobRecord::seal`), and
    /// workers and the fronts' sweepers verify it before they start or dispatch a queued job.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct JobSealed<'a> {
        /// The user the job runs as (the JWT's `sub`).
        pub user: &'a str,
        /// The user's tenant. The fleet has no tenants yet: always `""` (a slot, so that sealing one later
        /// changes the domain tag, not the layout).
        pub tenant: &'a str,
        /// The tool id as the caller named it.
        pub tool_id: &'a str,
        /// The installed plugin.
        pub plugin: &'a str,
        /// The method: the tool inside the plugin.
        pub tool: &'a str,
        /// SHA-256 of the arguments' JSON as the record holds them.
        pub args_sha256: &'a [u8; 32],
        /// The job id (also the plugin-side invoke id).
        pub job_id: &'a str,
        /// The absolute deadline (Unix epoch ms).
        pub deadline_ms: u64,
        /// The (clamped) timeout the deadline was computed from.
        pub timeout_ms: u64,
    }

    /// What a front signs to seal a job record: a domain tag and every field of `sealed`, each length-prefixed.
    pub fn job_seal_input(sealed: &JobSealed<'_>) -> Vec<u8> {
        let deadline = sealed.deadline_ms.to_string();
        let timeout = sealed.timeout_ms.to_string();
        length_prefixed(&[
            b"fleet-job-seal-v1",
            sealed.user.as_bytes(),
            sealed.tenant.as_bytes(),
            sealed.tool_id.as_bytes(),
            sealed.plugin.as_bytes(),
            sealed.tool.as_bytes(),
            sealed.args_sha256,
            sealed.job_id.as_bytes(),
            deadline.as_bytes(),
            timeout.as_bytes(),
        ])
    }

    /// `parts` concatenated, each preceded by its length (8 bytes, big-endian): no two lists of parts give the
    /// same bytes.
    fn length_prefixed(parts: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::with_capacity(parts.iter().map(|p| p.len() + 8).sum());
        for part in parts {
            out.extend_from_slice(&(part.len() as u64).to_be_bytes());
            out.extend_from_slice(part);
        }
        out
    }

    /// The cancel command on `fleet.v1.worker.<id>.cancel` and `matrix.cancel.<client_id>` (spec §12.1 N6).
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct CancelCommand {
        /// Always `_cancel_invoke`.
        pub command: String,
        /// The invoke to cancel.
        pub invoke_id: String,
    }

    impl CancelCommand {
        /// `_cancel_invoke` for `invoke_id`.
        pub fn new(invoke_id: &str) -> Self {
            CancelCommand {
                command: "_cancel_invoke".into(),
                invoke_id: invoke_id.into(),
            }
        }
    }

    /// Most job ids one [`JobsHeldQuery`] may name (a worker answers a longer query with nothing).
    pub const JOBS_HELD_QUERY_MAX: usize = 256;

    /// A sweeper's question on `fleet.v1.worker.<id>.jobs`: which of these running jobs, recorded as started by
    /// this worker, does it still run? Asked about jobs whose heartbeat stopped while the worker is listed.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub struct JobsHeldQuery {
        /// At most [`JOBS_HELD_QUERY_MAX`].
        pub job_ids: Vec<JobId>,
    }

    /// The worker's answer to a [`JobsHeldQuery`]: the ids it names that the worker starts or runs now.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub struct JobsHeld {
        /// A subset of the query's ids.
        pub held: Vec<JobId>,
    }
}

// -------------------------------------------------------------------------------------------------------------
// Delegated tool calls (worker → front, internal)
// -------------------------------------------------------------------------------------------------------------

/// The tool calls of agent sessions the fleet runs (spec §8.2): a worker calls `tools.list` / `tools.invoke` as
/// the invoke's user only with the delegation the front put in that invoke's sealed exec request. The token is a
/// random handle: the minting front alone knows what it stands for (user, plugin, invoke, deadline, depth) and
/// forgets it when the invoke ends, so it can neither name another user nor outlive its invoke.
pub mod delegation {
    use std::fmt;

    use serde::{Deserialize, Serialize};
    use serde_json::Value;

    /// Subjects: `fleet.v1.delegate.<front id>.<method>`.
    pub const PREFIX: &str = "fleet.v1.delegate";
    /// Every delegated subject (fronts subscribe to their own, workers publish).
    pub const ALL: &str = "fleet.v1.delegate.>";
    /// The delegated methods.
    pub const METHODS: [&str; 2] = [super::methods::TOOLS_LIST, super::methods::TOOLS_INVOKE];
    /// The "front id" of the delegations of jobs (`tools.invokeAsync`): `jobs.<secret>`, on
    /// `fleet.v1.delegate.jobs.<method>`, which every front serves (a job outlives the front that accepted it).
    /// Not a front's id (those are 16 hex digits).
    pub const JOBS: &str = "jobs";
    /// The queue group every front serves the jobs' delegated subjects in.
    pub const JOBS_QUEUE_GROUP: &str = "fleet-delegate-jobs";

    /// The subject a delegated `method` goes to for the front `front_id`.
    pub fn subject(front_id: &str, method: &str) -> String {
        format!("{PREFIX}.{front_id}.{method}")
    }

    /// A delegation: `<front id>.<secret>`. `Debug` shows the front id only.
    #[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(transparent)]
    pub struct DelegationToken(pub String);

    impl DelegationToken {
        /// The minting front's id (where a delegated call goes), if the token is well-formed.
        pub fn front_id(&self) -> Option<&str> {
            let (front, secret) = self.0.split_once('.')?;
            let ok = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric());
            (ok(front) && ok(secret)).then_some(front)
        }
    }

    impl fmt::Debug for DelegationToken {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.debug_tuple("DelegationToken")
                .field(&self.front_id().unwrap_or("?"))
                .finish()
        }
    }

    /// A delegated call: the delegation and the method's arguments (those of `tools.list` / `tools.invoke`).
    /// The answer is the API's [`super::ApiResponse`].
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    pub struct DelegatedCall {
        /// The invoke's delegation.
        pub delegation: DelegationToken,
        /// The method's arguments.
        #[serde(default)]
        pub args: Value,
    }
}
