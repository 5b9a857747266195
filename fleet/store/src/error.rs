//! The store's typed errors: one enum, every variant names the operation that failed.

use std::fmt;

use fleet_proto::api::{ApiError, ApiErrorCode, JobId, JobQuotaDetails};

use super::provision::BoxError;
use super::settings::{STORE_HIGH_WATER_PERCENT, SettingsError};

/// The store operation an error comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// [`Store::open`](super::Store::open).
    Open,
    /// [`Store::create_job`](super::Store::create_job).
    CreateJob,
    /// [`Store::get_job`](super::Store::get_job).
    GetJob,
    /// [`Store::transition`](super::Store::transition).
    Transition,
    /// [`Store::update_job`](super::Store::update_job).
    UpdateJob,
    /// [`Store::list_jobs`](super::Store::list_jobs).
    ListJobs,
    /// Adding a job to its user's index (part of [`Store::create_job`](super::Store::create_job)).
    IndexJob,
    /// [`Store::active_jobs`](super::Store::active_jobs).
    ActiveJobs,
    /// Taking a slot in a user's active set.
    AcquireSlot,
    /// Giving a slot back.
    ReleaseSlot,
    /// Reading a user's active set.
    ActiveSet,
    /// [`Store::heal_active_set`](super::Store::heal_active_set).
    HealActiveSet,
    /// [`Store::append_progress`](super::Store::append_progress).
    AppendProgress,
    /// [`Store::progress`](super::Store::progress).
    Progress,
    /// [`Store::heartbeat_worker`](super::Store::heartbeat_worker).
    HeartbeatWorker,
    /// [`Store::live_workers`](super::Store::live_workers).
    LiveWorkers,
    /// [`Store::remove_worker`](super::Store::remove_worker).
    RemoveWorker,
    /// [`Store::watch_workers`](super::Store::watch_workers).
    WatchWorkers,
    /// [`Store::put_manifest`](super::Store::put_manifest).
    PutManifest,
    /// [`Store::manifest`](super::Store::manifest).
    GetManifest,
    /// [`Store::manifests`](super::Store::manifests).
    ListManifests,
    /// [`Store::delete_manifest`](super::Store::delete_manifest).
    DeleteManifest,
    /// The job queue: queueing, pulling, acknowledging.
    JobQueue,
    /// `GrantStore::get` (fleet-services).
    ReadGrant,
    /// `GrantStore::edit` (fleet-services).
    EditGrant,
    /// `CredentialStore`'s read of a user's record (fleet-services).
    ReadCredentials,
    /// `CredentialStore`'s edits (fleet-services).
    EditCredentials,
    /// Reading a user's OAuth accounts (fleet-services `oauth`).
    ReadAccounts,
    /// Editing a user's OAuth accounts: connect, refresh, default, delete (fleet-services `oauth`).
    EditAccounts,
    /// An OAuth connect flow's single-use state (fleet-services `oauth`).
    OAuthState,
    /// The storage service's per-user byte counter (fleet-services).
    StorageQuota,
    /// The daily usage counter of `image/*` and `web/*` (fleet-services `usage`).
    Usage,
    /// The agent sessions of `agent/session.*` (fleet-services `agent::store`).
    AgentSessions,
    /// The delegations of jobs (fleet `delegation::JobDelegations`).
    Delegation,
    /// Reading the JetStream store's fill (`Store::refresh_fill`).
    StoreFill,
    /// `PluginStore::edit` (fleet).
    EditPlugin,
    /// Issuing or revoking an operator credential (fleet).
    EditCredential,
}

impl Op {
    /// A short name.
    pub fn as_str(self) -> &'static str {
        match self {
            Op::Open => "open",
            Op::CreateJob => "create_job",
            Op::GetJob => "get_job",
            Op::Transition => "transition",
            Op::UpdateJob => "update_job",
            Op::ListJobs => "list_jobs",
            Op::IndexJob => "index_job",
            Op::ActiveJobs => "active_jobs",
            Op::AcquireSlot => "acquire_slot",
            Op::ReleaseSlot => "release_slot",
            Op::ActiveSet => "active_set",
            Op::HealActiveSet => "heal_active_set",
            Op::AppendProgress => "append_progress",
            Op::Progress => "progress",
            Op::HeartbeatWorker => "heartbeat_worker",
            Op::LiveWorkers => "live_workers",
            Op::RemoveWorker => "remove_worker",
            Op::WatchWorkers => "watch_workers",
            Op::PutManifest => "put_manifest",
            Op::GetManifest => "manifest",
            Op::ListManifests => "manifests",
            Op::DeleteManifest => "delete_manifest",
            Op::JobQueue => "job_queue",
            Op::ReadGrant => "read_grant",
            Op::EditGrant => "edit_grant",
            Op::ReadCredentials => "read_credentials",
            Op::EditCredentials => "edit_credentials",
            Op::ReadAccounts => "read_accounts",
            Op::EditAccounts => "edit_accounts",
            Op::OAuthState => "oauth_state",
            Op::StorageQuota => "storage_quota",
            Op::Usage => "usage",
            Op::AgentSessions => "agent_sessions",
            Op::Delegation => "delegation",
            Op::StoreFill => "store_fill",
            Op::EditPlugin => "edit_plugin",
            Op::EditCredential => "edit_credential",
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The user already has `max` active jobs (spec §10.4 `job_quota_exceeded`).
    #[error("{active} active jobs, the limit is {max}")]
    QuotaExceeded {
        /// Active jobs now.
        active: usize,
        /// The limit.
        max: usize,
    },
    /// The user created `max` jobs within the retention already (`limits::MAX_RETAINED_JOBS_PER_USER`); room frees
    /// when the oldest page of the user's index leaves the window, `retry_after_ms` from now.
    #[error("{retained} jobs created within the retention, the limit is {max}; retry in {retry_after_ms} ms")]
    RetainedQuotaExceeded {
        /// Jobs the user's index counts now.
        retained: usize,
        /// The limit.
        max: usize,
        /// When room frees, from now.
        retry_after_ms: u64,
    },
    /// The user's jobs keep `stored` bytes; with the `reserve` a new job takes, that would pass `max`
    /// (`max_job_bytes_per_user`); room frees when the oldest hour of the account leaves it, `retry_after_ms` from
    /// now (or when an active job ends and keeps less than its reserve).
    #[error(
        "the user's jobs keep {stored} bytes; one more job may keep {reserve}, the limit is {max}; retry in {retry_after_ms} ms"
    )]
    StorageQuotaExceeded {
        /// Bytes the user's storage account holds.
        stored: u64,
        /// What a new job reserves.
        reserve: u64,
        /// The limit.
        max: u64,
        /// When the account's oldest hour frees, from now.
        retry_after_ms: u64,
    },
    /// The FLEET account's JetStream store holds `used` bytes (with the reserves admitted since it was read); with
    /// the `reserve` of a new job that passes `high_water` ([`STORE_HIGH_WATER_PERCENT`] of `budget`). Room frees as
    /// jobs leave the store; the reading is refreshed every `retry_after_ms`.
    #[error(
        "the JetStream store holds {used} bytes; with a job's reserve of {reserve} that passes its high-water mark of {high_water} bytes ({STORE_HIGH_WATER_PERCENT} % of {budget})"
    )]
    StoreFull {
        /// Bytes the store holds, with the reserves admitted since the reading.
        used: u64,
        /// What a new job reserves.
        reserve: u64,
        /// The mark.
        high_water: u64,
        /// The budget.
        budget: u64,
        /// How often the reading is refreshed.
        retry_after_ms: u64,
    },
    /// A record with this id exists already (never overwritten).
    #[error("{op}: job {job_id} exists already")]
    JobExists {
        /// The operation.
        op: Op,
        /// The id.
        job_id: JobId,
    },
    /// A value over its resource's size limit; nothing was written.
    #[error("{op}: {what} is {size} bytes, over the limit of {max}")]
    TooLarge {
        /// The operation.
        op: Op,
        /// What was too large.
        what: &'static str,
        /// Its size.
        size: usize,
        /// The limit.
        max: usize,
    },
    /// An argument the store cannot use (a limit of 0, a worker id that is not a key, a record that is not active).
    #[error("{op}: invalid {what}: {reason}")]
    Invalid {
        /// The operation.
        op: Op,
        /// The argument.
        what: &'static str,
        /// Why.
        reason: String,
    },
    /// The settings cannot work.
    #[error("open: {0}")]
    Settings(#[from] SettingsError),
    /// Creating or updating a JetStream resource failed.
    #[error("open: cannot create or update {resource}: {source}")]
    Resource {
        /// The bucket or stream.
        resource: String,
        /// Why.
        #[source]
        source: BoxError,
    },
    /// Too many concurrent writers on one key: the compare-and-set lost every bounded retry.
    #[error("{op}: gave up after {attempts} conflicting writes on {key}")]
    Contention {
        /// The operation.
        op: Op,
        /// The key.
        key: String,
        /// Attempts made.
        attempts: u32,
    },
    /// A stored value that does not parse.
    #[error("{op}: the value at {key} is not valid: {source}")]
    Corrupt {
        /// The operation.
        op: Op,
        /// The key or subject.
        key: String,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// NATS or JetStream failed (timeout, no server, a server-side error).
    #[error("{op}: {source}")]
    Nats {
        /// The operation.
        op: Op,
        /// Why.
        #[source]
        source: BoxError,
    },
}

impl StoreError {
    pub(crate) fn nats(op: Op, source: impl Into<BoxError>) -> StoreError {
        StoreError::Nats {
            op,
            source: source.into(),
        }
    }

    /// [`StoreError::Contention`] of a compare-and-set loop on `key` that gave up.
    pub fn contended(op: Op, key: &str, c: super::cas::Contended) -> StoreError {
        StoreError::Contention {
            op,
            key: key.to_owned(),
            attempts: c.attempts,
        }
    }

    pub(crate) fn invalid(op: Op, what: &'static str, reason: impl Into<String>) -> StoreError {
        StoreError::Invalid {
            op,
            what,
            reason: reason.into(),
        }
    }

    /// Whether retrying the same call later may succeed (quota, contention, NATS trouble).
    pub fn retryable(&self) -> bool {
        matches!(
            self,
            StoreError::QuotaExceeded { .. }
                | StoreError::RetainedQuotaExceeded { .. }
                | StoreError::StorageQuotaExceeded { .. }
                | StoreError::StoreFull { .. }
                | StoreError::Contention { .. }
                | StoreError::Nats { .. }
        )
    }

    /// The app-facing error: `job_quota_exceeded` for any of the three quotas (`{active, max}` for the active jobs,
    /// `{retained, max, retry_after_ms}` for the jobs kept, `{stored_bytes, job_reserve_bytes, max_bytes,
    /// retry_after_ms}` for their bytes), `long_job_capacity` `{retriable, retry_after_ms}` for a nearly full
    /// store, `internal_error` for everything else (the details stay in logs).
    pub fn to_api_error(&self) -> ApiError {
        match self {
            StoreError::QuotaExceeded { active, max } => {
                ApiError::job_quota_exceeded(JobQuotaDetails::Active {
                    active: *active as u64,
                    max: *max as u64,
                })
            }
            StoreError::RetainedQuotaExceeded {
                retained,
                max,
                retry_after_ms,
            } => ApiError::job_quota_exceeded(JobQuotaDetails::Retained {
                retained: *retained as u64,
                max: *max as u64,
                retry_after_ms: *retry_after_ms,
                retriable: true,
            }),
            StoreError::StorageQuotaExceeded {
                stored,
                reserve,
                max,
                retry_after_ms,
            } => ApiError::job_quota_exceeded(JobQuotaDetails::Stored {
                stored_bytes: *stored,
                job_reserve_bytes: *reserve,
                max_bytes: *max,
                retry_after_ms: *retry_after_ms,
                retriable: true,
            }),
            // A fleet-wide capacity, not the caller's quota: nothing about the store's size reaches the app.
            StoreError::StoreFull { retry_after_ms, .. } => ApiError::with_details(
                ApiErrorCode::LongJobCapacity,
                "the fleet's job store is nearly full; retry later",
                serde_json::json!({ "retriable": true, "retry_after_ms": retry_after_ms }),
            ),
            _ => ApiError::new(ApiErrorCode::InternalError, "the job store failed"),
        }
    }
}
