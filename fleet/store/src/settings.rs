//! Every JetStream bucket and stream of the fleet and its settings, in one place (design.md "State in
//! JetStream"): the job layer's, which [`Store::open`](super::Store::open) creates, and those the other crates
//! open with the configs built here — the fleet crate's plugin store and app credentials, fleet-services' grants,
//! APS storage and files, and `host/uploadFile` objects. The fleet crate's NATS permission table
//! (`nats_auth::permissions::RESOURCES`) names the same resources; a test there keeps the two equal.
//!
//! | Resource | Kind | Key / subject | Settings |
//! |---|---|---|---|
//! | `<prefix>_jobs` | KV | `<user_key>.<job_id>` → [`JobRecord`](super::JobRecord) JSON | history 1, `max_age` = job retention (8 d), `max_value_size` = 384 KiB |
//! | `<prefix>_active` | KV | `<user_key>` → the user's active (queued + running) job ids | history 1, `max_age` = job retention, `max_value_size` = 64 KiB |
//! | `<prefix>_workers` | KV | `<worker_id>` → [`WorkerInfo`](super::WorkerInfo) JSON | history 1, `max_age` = worker TTL (10 s): an expired key is a dead worker |
//! | `<prefix>_manifests` | KV | `<hash of tool_id>` → `{tool_id, manifest}` | history 1, no `max_age`, `max_value_size` = 512 KiB |
//! | `<prefix>_job_index` | KV | `<user_key>` → the user's index head (the open page); `<user_key>.<n>` → sealed page `n` | history 1, `max_age` = job retention, `max_value_size` = 192 KiB |
//! | `<prefix>_progress` | stream | `<prefix>.v1.progress.<user_key>.<job_id>`, header `Fleet-Seq` | 500 msgs per subject, discard old, `max_msg_size` = 8 KiB + 1 KiB, `max_age` = job retention, `allow_direct` |
//! | `<prefix>_job_queue` | stream, work queue | `<prefix>.v1.job_queue.<user_key>` → `{user, job_id}` | work-queue retention (a message is gone once a worker acks it), `max_age` = the longest job deadline (24 h), `max_msg_size` = 1 KiB; one durable pull consumer `workers` (explicit ack, ack wait 30 s) |
//! | `<prefix>_plugins` | KV (fleet: plugin store) | `<hash of tool_id>` → the plugin record | history 5, no `max_age`, `max_value_size` = 1 MiB, file storage |
//! | `<prefix>_plugin_packages` | object store (fleet: plugin store) | `sha256-<hex>` → a plugin package | no `max_age`, file storage |
//! | `<prefix>_app_creds` | KV (fleet: app credentials) | `<name>` → the issued credential's record (no secrets) | history 1, no `max_age`, `max_value_size` = 64 KiB |
//! | `<prefix>_grants` | KV (fleet-services: grants) | `<user_key>.<hash of tool_id>` → the user's grant to a plugin | history 1, no `max_age`, `max_value_size` = 16 KiB, file storage |
//! | `<prefix>_credentials` | KV (fleet-services: per-user credentials) | `<user_key>` → the user's credentials, sealed (a wrapped data key and AES-256-GCM ciphertexts) | history 1, no `max_age`, `max_value_size` = 256 KiB, file storage |
//! | `<prefix>_oauth_accounts` | KV (fleet-services: OAuth accounts, spec §8.8) | `<user_key>` → the user's connected accounts per provider, their refresh tokens and cached access tokens sealed (a wrapped data key and AES-256-GCM ciphertexts) | history 1, no `max_age`, `max_value_size` = 64 KiB, file storage |
//! | `<prefix>_oauth_state` | KV (fleet-services: the OAuth connect flow) | `<sha256(state)>` → a started flow: its user, provider, binding digest and sealed PKCE verifier (single use) | history 1, `max_age` = 10 min, `max_value_size` = 4 KiB |
//! | `<prefix>_aps_kv` | KV (fleet-services: `storage/*`) | `<user_key>.<scope>.<sha256(key)>` → a value's envelope | history 1, no `max_age`, `max_value_size` = 256 KiB + 64 KiB |
//! | `<prefix>_aps_usage` | KV (fleet-services: storage quota) | `<user_key>` → the user's stored bytes (decimal), or with the holds of their uploads not completed `{used, holds: [{id, bytes, exp}]}` | history 1, no `max_age`, `max_value_size` = 32 KiB |
//! | `<prefix>_usage` | KV (fleet-services: the daily quotas of `image/*` and `web/*`) | `<family>.<user_key>` → the user's units of the family's window, per slot (`image.`: images per minute of the last 24 h; `web.`: compute units of the UTC day) | history 1, `max_age` = 25 h, `max_value_size` = 64 KiB |
//! | `<prefix>_agent_sessions` | KV (fleet-services: `agent/session.*`) | `s.<user_key>.<hash of tool_id>.<uuid>` → a session (settings, history); `r.<user_key>.<hash of tool_id>.<uuid>` → its run lease (run id, holder, expiry, cancel flag); `u.<user_key>` → the user's sessions in least-recently-used order | history 1, `max_age` = a session's lifetime (24 h) + 1 h, `max_value_size` = 512 KiB |
//! | `<prefix>_delegations` | KV (fleet: the delegations of jobs) | hex SHA-256 of a job delegation's secret → `{user, plugin, job_id, deadline_ms, depth}` (never the secret) | history 1, `max_age` = the longest job deadline (24 h) + 1 h, `max_value_size` = 4 KiB; written by fronts only |
//! | `<prefix>_aps_files` | KV (fleet-services: `files/*`) | `f.<user_key>.<scope>.<sha256(path)>` → a file's index entry | history 1, no `max_age`, `max_value_size` = 16 KiB |
//! | `<prefix>_aps_pending` | KV (fleet-services: `files/*`) | `<user_key>.<scope>.<sha256(path)>` → a begun upload | history 1, `max_age` = staging retention (1 h), `max_value_size` = 16 KiB |
//! | `<prefix>_aps_objects` | object store (fleet-services: `files/*`) | the bytes of committed files | no `max_age` |
//! | `<prefix>_aps_staging` | object store (fleet-services: `files/*`) | bytes uploaded, not yet completed | `max_age` = staging retention (1 h), `max_bytes` = 5 % of `job_store_max_bytes` ÷ `replicas` (none without a budget) |
//! | `<prefix>_uploads` | object store (fleet-services: `host/uploadFile`) | uploaded objects, named by their `r2_key` | `max_age` = upload retention (24 h), `max_bytes` = 5 % of `job_store_max_bytes` ÷ `replicas` (none without a budget) |
//!
//! Each is created (or a KV bucket or stream updated to these settings; an existing object store is kept as it
//! is but for its `max_bytes`, set to the settings') by the process that opens it with [`Provision::Create`](super::Provision::Create), and attached to
//! otherwise. `replicas` applies to every one; `storage` to every one but `<prefix>_plugins`,
//! `<prefix>_plugin_packages`, `<prefix>_grants`, `<prefix>_credentials` and `<prefix>_oauth_accounts`, which keep JetStream's default, file storage. The job
//! layer's KV buckets and the progress stream allow direct gets: reads are answered by any replica without a
//! consumer, and batched direct gets (the job index, `listJobs`' records, the progress ring's slices) need
//! nats-server ≥ 2.11.

use std::time::Duration;

use async_nats::jetstream::{kv, object_store, stream};
use fleet_proto::limits;

const KIB: usize = 1024;

/// Bytes a progress message may carry beyond the event itself: headers (`Fleet-Seq`, `Nats-Msg-Id`) and the
/// `{seq, type, data}` envelope around `data`.
pub const PROGRESS_ENVELOPE_HEADROOM: usize = KIB;

/// Bytes of job data (records and progress rings) one user may keep by default
/// ([`StoreSettings::max_job_bytes_per_user`]): the fleet's own cap, not the spec's. A user at the caps of the
/// spec could keep 10 000 records of up to 384 KiB and their rings of up to 500 × 9 KiB for the retention
/// (≈ 45 GiB); this bounds what one tenant can take from the JetStream store all tenants share.
pub const MAX_JOB_BYTES_PER_USER: u64 = 256 * 1024 * 1024;

/// What a stored message costs beyond its payload, as the job storage budget counts it: its subject (a key of
/// ≤ ~110 bytes), its headers and the file store's framing.
pub const STORED_MESSAGE_OVERHEAD: u64 = 256;

/// The span of creation time one entry of a user's storage account covers (see the job index's module docs).
pub const STORAGE_SPAN_MS: u64 = 3_600_000;

/// Percent of the JetStream store's budget up to which new jobs are admitted ([`crate::fill`]); the rest is kept
/// for the writes of work already admitted (progress, outcomes, grants, sessions), which the guard never refuses.
pub const STORE_HIGH_WATER_PERCENT: u64 = 90;

/// Percent of the JetStream store's budget (`job_store_max_bytes`) that `<prefix>_aps_staging` may hold, every
/// replica counted: its `max_bytes` is this share divided by `replicas` (a stream's `max_bytes` is per replica,
/// and JetStream reserves it on every replica's file store). The fill guard counts it as used ([`crate::fill`]).
pub const STAGING_STORE_PERCENT: u64 = 5;

/// Percent of the JetStream store's budget that `<prefix>_uploads` may hold, the same way as
/// [`STAGING_STORE_PERCENT`].
pub const UPLOADS_STORE_PERCENT: u64 = 5;

/// How old the reading of the store's fill may grow before an admission refreshes it in the background
/// ([`StoreSettings::store_fill_refresh`]).
pub const STORE_FILL_REFRESH: Duration = Duration::from_secs(2);

/// Largest active-set value (a few job ids; far above `max_active` × 60 bytes).
pub const ACTIVE_SET_MAX_BYTES: usize = 64 * KIB;

/// Largest worker registry value.
pub const WORKER_INFO_MAX_BYTES: usize = 64 * KIB;

/// Largest recorded manifest (with its tool id).
pub const MANIFEST_MAX_BYTES: usize = 512 * KIB;

/// Warm sessions listed per worker at most (the rest are dropped from the summary).
pub const WORKER_WARM_SESSIONS_MAX: usize = 256;

/// Window in which a re-published progress event (same job, same seq) is dropped as a duplicate.
pub const PROGRESS_DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

/// Largest job-queue message (`{user, job_id}`: a user id is at most a few hundred bytes).
pub const JOB_QUEUE_MAX_MESSAGE_BYTES: usize = KIB;

/// The job queue's durable pull consumer, shared by every worker.
pub const JOB_QUEUE_CONSUMER: &str = "workers";

/// How long a pulled job-queue message may stay unacknowledged before JetStream hands it to another worker (a
/// worker acks once the job is started, or seen to be no longer queued).
pub const JOB_QUEUE_ACK_WAIT: Duration = Duration::from_secs(30);

/// Header carrying a progress event's per-job seq.
pub const SEQ_HEADER: &str = "Fleet-Seq";

/// Largest job index value (a head or a sealed page): [`JOB_INDEX_PAGE_MAX`] entries of at most ~2.4 KB (the
/// id, the creation time, and the JSON — escapes included — of a tool id kept up to [`INDEX_TOOL_ID_MAX_BYTES`]
/// and of a 120-character tag), and the user id (≤ 256 bytes, the API tokens' `sub`); a head also holds its
/// user's storage account, one `"<hour>":<bytes>` entry (≤ 32 bytes) per hour of the ~9 days a job's bytes are
/// kept (≤ 7 KiB).
pub const JOB_INDEX_MAX_BYTES: usize = 192 * KIB;

/// Entries per page of the job index by default: `listJobs`' default page (20) and its probe fit in the open
/// page and one sealed page; the head, rewritten at every job creation, stays a few KiB.
pub const JOB_INDEX_PAGE_ENTRIES: usize = 32;

/// Largest page of the job index (see [`JOB_INDEX_MAX_BYTES`]).
pub const JOB_INDEX_PAGE_MAX: usize = 64;

/// A tool id longer than this is not kept in the index entry (`listJobs` then checks it on the record).
pub const INDEX_TOOL_ID_MAX_BYTES: usize = 256;

/// Largest plugin record of `<prefix>_plugins` (every version's metadata with its cached manifest).
pub const PLUGIN_RECORD_MAX_BYTES: usize = 1024 * KIB;

/// Largest issued-credential record of `<prefix>_app_creds`.
pub const CRED_RECORD_MAX_BYTES: usize = 64 * KIB;

/// Largest grant record of `<prefix>_grants`.
pub const GRANT_MAX_BYTES: usize = 16 * KIB;

/// Largest record of `<prefix>_credentials`: one user's sealed credentials, every scope.
pub const CREDENTIALS_RECORD_MAX_BYTES: usize = 256 * KIB;

/// Largest record of `<prefix>_oauth_accounts`: one user's connected OAuth accounts, every provider (at most
/// 10 per provider), each with its sealed refresh token and cached access token.
pub const OAUTH_ACCOUNTS_RECORD_MAX_BYTES: usize = 64 * KIB;

/// Largest value of `<prefix>_oauth_state`: one started connect flow.
pub const OAUTH_STATE_MAX_BYTES: usize = 4 * KIB;

/// How long a started OAuth connect flow may wait for its callback (`<prefix>_oauth_state`'s `max_age`): the
/// state is single-use and forgotten after this.
pub const OAUTH_STATE_TTL: Duration = Duration::from_secs(600);

/// Largest value of `<prefix>_usage`: one user's units of one family's window, at most one entry per slot (a
/// minute for `image/*`).
pub const USAGE_MAX_BYTES: usize = 64 * KIB;

/// How long an untouched `<prefix>_usage` record is kept: the longest window (24 h) and an hour (a record older
/// than its window counts nothing).
pub const USAGE_MAX_AGE: Duration = Duration::from_secs(25 * 3600);

/// Largest value of `<prefix>_agent_sessions`: a session (its settings and its bounded history) or a user's
/// index of sessions (at most 4 096 entries of ~120 bytes).
pub const AGENT_SESSIONS_MAX_BYTES: usize = 512 * KIB;

/// How long an untouched `<prefix>_agent_sessions` record is kept: a session's hard lifetime (24 h, spec §8.2) and
/// an hour (every session a record names has expired by then).
pub const AGENT_SESSIONS_MAX_AGE: Duration =
    Duration::from_secs(limits::AGENT_SESSION_MAX_LIFETIME.as_secs() + 3600);

/// Largest value of `<prefix>_delegations`: a job delegation (a user id, a tool id, a job id, two numbers).
pub const DELEGATION_MAX_BYTES: usize = 4 * KIB;

/// How long a job delegation is kept at most: the longest job deadline (24 h) and an hour.
pub const DELEGATION_MAX_AGE: Duration = Duration::from_millis(limits::JOB_DEADLINE_MAX_MS + 3_600_000);

/// Largest value of `<prefix>_aps_usage`: one user's stored bytes and the holds of their uploads not completed
/// (at most [`limits::PENDING_UPLOADS_MAX_PER_USER`], each an object name of at most ~700 bytes, its size and its
/// expiry), in JSON: 1 KiB per hold.
pub const APS_USAGE_MAX_BYTES: usize = limits::PENDING_UPLOADS_MAX_PER_USER * KIB;

/// How long staged APS file bytes (`<prefix>_aps_staging`) and their pending records (`<prefix>_aps_pending`)
/// are kept without `upload_complete`.
pub const STAGING_RETENTION: Duration = Duration::from_secs(3600);

/// How long `host/uploadFile` objects (`<prefix>_uploads`) are kept.
pub const UPLOAD_RETENTION: Duration = Duration::from_secs(24 * 3600);

/// Settings of every resource of the [`Store`](super::Store).
#[derive(Debug, Clone, PartialEq)]
pub struct StoreSettings {
    /// Prefix of every bucket, stream and subject (`[A-Za-z0-9_-]+`). Default `fleet`.
    pub prefix: String,
    /// JetStream replicas of every resource (1 for a single server, 3 in a cluster). Default 1.
    pub replicas: usize,
    /// Storage of every resource. Default file.
    pub storage: stream::StorageType,
    /// How long job records, active sets and progress are kept: at least the 7-day `listJobs` lookback
    /// (spec §10.8 HR-LJ-01). Default 8 days.
    pub job_retention: Duration,
    /// Largest stored job record: the 256 KB result cap + the 64 KB args cap + 64 KiB for the rest. Default 384 KiB.
    pub job_record_max_bytes: usize,
    /// Progress events kept per job (the ring, spec §8.10 HR-PG-05). Default 500.
    pub progress_max_per_job: usize,
    /// Largest progress event (`{seq, type, data}` JSON), spec §8.10 HR-PG-05. Default 8 KiB; the stream's
    /// message limit adds [`PROGRESS_ENVELOPE_HEADROOM`].
    pub progress_max_bytes_per_event: usize,
    /// A worker whose registry key was not refreshed for this long is dead. Default 10 s.
    pub worker_ttl: Duration,
    /// Entries per page of the per-user job index (`listJobs`). Default [`JOB_INDEX_PAGE_ENTRIES`]; 1 to
    /// [`JOB_INDEX_PAGE_MAX`]. An index keeps the page size it was created with.
    pub job_index_page: usize,
    /// Jobs one user may have created within `job_retention`: a creation beyond it is refused
    /// ([`StoreError::RetainedQuotaExceeded`](super::StoreError::RetainedQuotaExceeded)) until the user's oldest
    /// index page leaves the window. Default [`limits::MAX_RETAINED_JOBS_PER_USER`]; more than one page.
    pub max_retained_jobs_per_user: usize,
    /// Bytes of job records and progress rings one user may keep: a job is admitted only while what the user's
    /// jobs keep, with the most a new job may take ([`job_storage_reserve`](Self::job_storage_reserve)), fits
    /// ([`StoreError::StorageQuotaExceeded`](super::StoreError::StorageQuotaExceeded)). Default
    /// [`MAX_JOB_BYTES_PER_USER`]; at least one job's reserve.
    pub max_job_bytes_per_user: u64,
    /// Bytes the FLEET account's JetStream store may hold, as the server counts them (`$JS.API.INFO`'s `storage`:
    /// in a cluster every replica counts): a new job is admitted only while the store stays under
    /// [`STORE_HIGH_WATER_PERCENT`] of it ([`StoreError::StoreFull`](super::StoreError::StoreFull), [`crate::fill`]).
    /// 0 = the account's own JetStream disk limit, or no fleet-wide guard when it has none. Default 0; else at
    /// least one job's reserve above the high-water mark.
    pub job_store_max_bytes: u64,
    /// How old the reading of the store's fill may grow before an admission refreshes it. Default
    /// [`STORE_FILL_REFRESH`].
    pub store_fill_refresh: Duration,
    /// An id in a user's active set whose job record does not exist is dropped by
    /// [`heal_active_set`](super::Store::heal_active_set) only once its slot is this old (a replica may be
    /// between taking the slot and creating the record). Default 30 s.
    pub orphan_slot_grace: Duration,
    /// Whether this process creates the resources (fronts) or attaches to them (workers, tooling). Default
    /// create.
    pub provision: super::provision::Provision,
}

impl Default for StoreSettings {
    fn default() -> Self {
        StoreSettings {
            prefix: "fleet".to_string(),
            replicas: 1,
            storage: stream::StorageType::File,
            job_retention: limits::JOB_RETENTION + Duration::from_secs(24 * 3600),
            job_record_max_bytes: limits::MAX_JOB_RESULT_BYTES + limits::MAX_JOB_ARGS_BYTES + 64 * KIB,
            progress_max_per_job: limits::PROGRESS_RING_SIZE,
            progress_max_bytes_per_event: limits::MAX_PROGRESS_EVENT_BYTES,
            worker_ttl: Duration::from_secs(10),
            job_index_page: JOB_INDEX_PAGE_ENTRIES,
            max_retained_jobs_per_user: limits::MAX_RETAINED_JOBS_PER_USER,
            max_job_bytes_per_user: MAX_JOB_BYTES_PER_USER,
            job_store_max_bytes: 0,
            store_fill_refresh: STORE_FILL_REFRESH,
            orphan_slot_grace: Duration::from_secs(30),
            provision: super::provision::Provision::Create,
        }
    }
}

/// Settings that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettingsError {
    /// The prefix must be a subject token and part of a bucket name.
    #[error("prefix {0:?} must be 1–32 characters of [A-Za-z0-9_-]")]
    Prefix(String),
    /// Replicas out of range.
    #[error("replicas must be 1–5, got {0}")]
    Replicas(usize),
    /// Retention below the spec's minimum.
    #[error("job_retention {0:?} is below the 7-day listJobs lookback (spec §10.8 HR-LJ-01)")]
    Retention(Duration),
    /// A size or count out of range.
    #[error("{field} = {value} is out of range ({range})")]
    Range {
        /// The setting.
        field: &'static str,
        /// Its value.
        value: u128,
        /// The allowed range.
        range: &'static str,
    },
}

impl StoreSettings {
    /// Checks the settings can be turned into resources.
    pub fn validate(&self) -> Result<(), SettingsError> {
        let p = &self.prefix;
        if p.is_empty()
            || p.len() > 32
            || !p
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        {
            return Err(SettingsError::Prefix(p.clone()));
        }
        if !(1..=5).contains(&self.replicas) {
            return Err(SettingsError::Replicas(self.replicas));
        }
        if self.job_retention < limits::JOB_RETENTION {
            return Err(SettingsError::Retention(self.job_retention));
        }
        let range = |field, value: u128, ok: bool, range| {
            if ok {
                Ok(())
            } else {
                Err(SettingsError::Range { field, value, range })
            }
        };
        let r = self.job_record_max_bytes;
        range(
            "job_record_max_bytes",
            r as u128,
            (KIB..=1024 * KIB).contains(&r),
            "1 KiB–1 MiB",
        )?;
        let n = self.progress_max_per_job;
        range(
            "progress_max_per_job",
            n as u128,
            (1..=100_000).contains(&n),
            "1–100000",
        )?;
        let b = self.progress_max_bytes_per_event;
        range(
            "progress_max_bytes_per_event",
            b as u128,
            (64..=512 * KIB).contains(&b),
            "64 B–512 KiB",
        )?;
        let t = self.worker_ttl;
        range("worker_ttl", t.as_millis(), t >= Duration::from_secs(1), "≥ 1 s")?;
        let page = self.job_index_page;
        range(
            "job_index_page",
            page as u128,
            (1..=JOB_INDEX_PAGE_MAX).contains(&page),
            "1–64",
        )?;
        let cap = self.max_retained_jobs_per_user;
        range(
            "max_retained_jobs_per_user",
            cap as u128,
            cap > page,
            "more than job_index_page",
        )?;
        let bytes = self.max_job_bytes_per_user;
        range(
            "max_job_bytes_per_user",
            u128::from(bytes),
            bytes >= self.job_storage_reserve(),
            "at least one job's reserve (job_record_max_bytes + progress_max_per_job × the largest progress message, each with its overhead)",
        )?;
        let budget = self.job_store_max_bytes;
        range(
            "job_store_max_bytes",
            u128::from(budget),
            budget == 0 || self.store_budget_holds_a_job(budget),
            "0 (the account's limit) or a budget whose high-water mark holds at least one job's reserve",
        )?;
        let t = self.store_fill_refresh;
        range(
            "store_fill_refresh",
            t.as_millis(),
            t >= Duration::from_millis(1),
            "≥ 1 ms",
        )?;
        Ok(())
    }

    /// Whether a JetStream store budget (`job_store_max_bytes`) admits at least one job: its high-water mark holds
    /// one [`job_storage_reserve`](Self::job_storage_reserve).
    pub fn store_budget_holds_a_job(&self, budget: u64) -> bool {
        crate::fill::high_water(budget) >= self.job_storage_reserve()
    }

    /// What admitting a job reserves in its user's storage account: the largest record and a full ring of the
    /// largest events, each message with [`STORED_MESSAGE_OVERHEAD`]. Replaced by what the job keeps at its
    /// terminal write. ≈ 4.8 MiB with the defaults.
    pub fn job_storage_reserve(&self) -> u64 {
        let record = self.job_record_max_bytes as u64 + STORED_MESSAGE_OVERHEAD;
        record.saturating_add(self.ring_storage_bound(u64::MAX))
    }

    /// The most a ring of `events` appended events can keep (only the newest `progress_max_per_job` stay): what
    /// a job finished by someone other than its worker is charged for its progress (its worker counts the ring
    /// exactly).
    pub fn ring_storage_bound(&self, events: u64) -> u64 {
        let kept = events.min(self.progress_max_per_job as u64);
        kept.saturating_mul(self.progress_max_message_bytes() as u64 + STORED_MESSAGE_OVERHEAD)
    }

    /// How long after its creation a job's bytes may still be stored: its last write comes by its deadline (at
    /// most [`limits::JOB_DEADLINE_MAX_MS`]), and records and progress are kept `job_retention` after it.
    pub fn job_storage_kept_ms(&self) -> u64 {
        let retention = u64::try_from(self.job_retention.as_millis()).unwrap_or(u64::MAX);
        retention.saturating_add(limits::JOB_DEADLINE_MAX_MS)
    }

    /// `<prefix>_jobs`.
    pub fn jobs_bucket(&self) -> String {
        format!("{}_jobs", self.prefix)
    }

    /// `<prefix>_active`.
    pub fn active_bucket(&self) -> String {
        format!("{}_active", self.prefix)
    }

    /// `<prefix>_workers`.
    pub fn workers_bucket(&self) -> String {
        format!("{}_workers", self.prefix)
    }

    /// `<prefix>_manifests`.
    pub fn manifests_bucket(&self) -> String {
        format!("{}_manifests", self.prefix)
    }

    /// `<prefix>_job_index`.
    pub fn job_index_bucket(&self) -> String {
        format!("{}_job_index", self.prefix)
    }

    /// `<prefix>_progress`.
    pub fn progress_stream(&self) -> String {
        format!("{}_progress", self.prefix)
    }

    /// `<prefix>.v1.progress` (the stream listens on `<prefix>.v1.progress.>`).
    pub fn progress_subject_prefix(&self) -> String {
        format!("{}.v1.progress", self.prefix)
    }

    /// `<prefix>_job_queue`.
    pub fn job_queue_stream(&self) -> String {
        format!("{}_job_queue", self.prefix)
    }

    /// `<prefix>.v1.job_queue` (the stream listens on `<prefix>.v1.job_queue.>`).
    pub fn job_queue_subject_prefix(&self) -> String {
        format!("{}.v1.job_queue", self.prefix)
    }

    /// `<prefix>_plugins`.
    pub fn plugins_bucket(&self) -> String {
        format!("{}_plugins", self.prefix)
    }

    /// `<prefix>_plugin_packages`.
    pub fn plugin_packages_bucket(&self) -> String {
        format!("{}_plugin_packages", self.prefix)
    }

    /// `<prefix>_app_creds`.
    pub fn app_creds_bucket(&self) -> String {
        format!("{}_app_creds", self.prefix)
    }

    /// `<prefix>_grants`.
    pub fn grants_bucket(&self) -> String {
        format!("{}_grants", self.prefix)
    }

    /// `<prefix>_credentials`.
    pub fn credentials_bucket(&self) -> String {
        format!("{}_credentials", self.prefix)
    }

    /// `<prefix>_oauth_accounts`.
    pub fn oauth_accounts_bucket(&self) -> String {
        format!("{}_oauth_accounts", self.prefix)
    }

    /// `<prefix>_oauth_state`.
    pub fn oauth_state_bucket(&self) -> String {
        format!("{}_oauth_state", self.prefix)
    }

    /// `<prefix>_aps_kv`.
    pub fn aps_kv_bucket(&self) -> String {
        format!("{}_aps_kv", self.prefix)
    }

    /// `<prefix>_usage`.
    pub fn usage_bucket(&self) -> String {
        format!("{}_usage", self.prefix)
    }

    /// `<prefix>_agent_sessions`.
    pub fn agent_sessions_bucket(&self) -> String {
        format!("{}_agent_sessions", self.prefix)
    }

    /// `<prefix>_delegations`.
    pub fn delegations_bucket(&self) -> String {
        format!("{}_delegations", self.prefix)
    }

    /// `<prefix>_aps_usage`.
    pub fn aps_usage_bucket(&self) -> String {
        format!("{}_aps_usage", self.prefix)
    }

    /// `<prefix>_aps_files`.
    pub fn aps_files_bucket(&self) -> String {
        format!("{}_aps_files", self.prefix)
    }

    /// `<prefix>_aps_pending`.
    pub fn aps_pending_bucket(&self) -> String {
        format!("{}_aps_pending", self.prefix)
    }

    /// `<prefix>_aps_objects`.
    pub fn aps_objects_bucket(&self) -> String {
        format!("{}_aps_objects", self.prefix)
    }

    /// `<prefix>_aps_staging`.
    pub fn aps_staging_bucket(&self) -> String {
        format!("{}_aps_staging", self.prefix)
    }

    /// `<prefix>_uploads`.
    pub fn uploads_bucket(&self) -> String {
        format!("{}_uploads", self.prefix)
    }

    /// The largest progress message the stream accepts (event + headroom).
    pub fn progress_max_message_bytes(&self) -> usize {
        self.progress_max_bytes_per_event + PROGRESS_ENVELOPE_HEADROOM
    }

    fn kv(&self, bucket: String, description: &str, max_age: Duration, max_value_size: usize) -> kv::Config {
        kv::Config {
            bucket,
            description: description.to_string(),
            max_value_size: i32::try_from(max_value_size).unwrap_or(i32::MAX),
            history: 1,
            max_age,
            max_bytes: -1,
            storage: self.storage,
            num_replicas: self.replicas,
            ..Default::default()
        }
    }

    /// The jobs bucket: one record per job, history 1, kept for the retention.
    pub fn jobs_kv_config(&self) -> kv::Config {
        self.kv(
            self.jobs_bucket(),
            "fleet job records",
            self.job_retention,
            self.job_record_max_bytes,
        )
    }

    /// The per-user active sets.
    pub fn active_kv_config(&self) -> kv::Config {
        self.kv(
            self.active_bucket(),
            "fleet per-user active job sets",
            self.job_retention,
            ACTIVE_SET_MAX_BYTES,
        )
    }

    /// The per-user job index of `listJobs`: heads and sealed pages, kept for the retention (a head is rewritten
    /// at every creation of its user's jobs; a sealed page never).
    pub fn job_index_kv_config(&self) -> kv::Config {
        self.kv(
            self.job_index_bucket(),
            "fleet per-user job index",
            self.job_retention,
            JOB_INDEX_MAX_BYTES,
        )
    }

    /// The worker registry: keys expire after the worker TTL unless refreshed.
    pub fn workers_kv_config(&self) -> kv::Config {
        self.kv(
            self.workers_bucket(),
            "fleet live workers",
            self.worker_ttl,
            WORKER_INFO_MAX_BYTES,
        )
    }

    /// The manifests of installed tools, kept until replaced.
    pub fn manifests_kv_config(&self) -> kv::Config {
        self.kv(
            self.manifests_bucket(),
            "fleet plugin manifests",
            Duration::ZERO,
            MANIFEST_MAX_BYTES,
        )
    }

    /// The progress stream: one subject per job, the newest `progress_max_per_job` kept.
    pub fn progress_stream_config(&self) -> stream::Config {
        stream::Config {
            name: self.progress_stream(),
            description: Some("fleet job progress rings".to_string()),
            subjects: vec![format!("{}.>", self.progress_subject_prefix())],
            max_messages_per_subject: i64::try_from(self.progress_max_per_job).unwrap_or(i64::MAX),
            max_message_size: i32::try_from(self.progress_max_message_bytes()).unwrap_or(i32::MAX),
            max_age: self.job_retention,
            max_messages: -1,
            max_bytes: -1,
            discard: stream::DiscardPolicy::Old,
            retention: stream::RetentionPolicy::Limits,
            storage: self.storage,
            num_replicas: self.replicas,
            duplicate_window: PROGRESS_DUPLICATE_WINDOW,
            allow_direct: true,
            ..Default::default()
        }
    }

    /// The job queue: the jobs that may start (within their user's agent slots) and wait for a worker with room.
    pub fn job_queue_stream_config(&self) -> stream::Config {
        stream::Config {
            name: self.job_queue_stream(),
            description: Some("fleet jobs waiting for a worker with room".to_string()),
            subjects: vec![format!("{}.>", self.job_queue_subject_prefix())],
            max_message_size: i32::try_from(JOB_QUEUE_MAX_MESSAGE_BYTES).unwrap_or(i32::MAX),
            max_age: Duration::from_millis(limits::JOB_DEADLINE_MAX_MS),
            max_messages: -1,
            max_bytes: -1,
            discard: stream::DiscardPolicy::Old,
            retention: stream::RetentionPolicy::WorkQueue,
            storage: self.storage,
            num_replicas: self.replicas,
            ..Default::default()
        }
    }

    /// The job queue's consumer: durable, pulled, acknowledged one by one.
    pub fn job_queue_consumer_config(&self) -> async_nats::jetstream::consumer::pull::Config {
        async_nats::jetstream::consumer::pull::Config {
            durable_name: Some(JOB_QUEUE_CONSUMER.to_string()),
            description: Some("every worker pulls queued jobs here".to_string()),
            ack_policy: async_nats::jetstream::consumer::AckPolicy::Explicit,
            ack_wait: JOB_QUEUE_ACK_WAIT,
            max_deliver: -1,
            num_replicas: self.replicas,
            ..Default::default()
        }
    }

    /// The plugin records (the fleet crate's plugin store): history 5. `storage` is not applied (file storage).
    pub fn plugins_kv_config(&self) -> kv::Config {
        kv::Config {
            bucket: self.plugins_bucket(),
            description: "Cloud Agents plugin records (versions, current)".to_string(),
            history: 5,
            max_value_size: i32::try_from(PLUGIN_RECORD_MAX_BYTES).unwrap_or(i32::MAX),
            num_replicas: self.replicas,
            ..Default::default()
        }
    }

    /// The plugin packages, content-addressed (the fleet crate's plugin store). `storage` is not applied (file
    /// storage).
    pub fn plugin_packages_config(&self) -> object_store::Config {
        object_store::Config {
            bucket: self.plugin_packages_bucket(),
            description: Some("Cloud Agents plugin packages (sha256-<hex>)".to_string()),
            num_replicas: self.replicas,
            ..Default::default()
        }
    }

    /// The issued app credentials and revocations (the fleet crate's `creds`).
    pub fn app_creds_kv_config(&self) -> kv::Config {
        kv::Config {
            bucket: self.app_creds_bucket(),
            description: "Cloud Agents: issued app NATS credentials (no secrets)".to_string(),
            history: 1,
            max_value_size: i32::try_from(CRED_RECORD_MAX_BYTES).unwrap_or(i32::MAX),
            num_replicas: self.replicas,
            storage: self.storage,
            ..Default::default()
        }
    }

    /// The user grants of host capabilities (fleet-services' `grants`). `storage` is not applied (file storage).
    pub fn grants_kv_config(&self) -> kv::Config {
        kv::Config {
            bucket: self.grants_bucket(),
            description: "Cloud Agents: user grants of host capabilities per plugin".to_string(),
            history: 1,
            max_value_size: i32::try_from(GRANT_MAX_BYTES).unwrap_or(i32::MAX),
            num_replicas: self.replicas,
            ..Default::default()
        }
    }

    /// Per-user credentials (fleet-services' `credentials`), sealed. `storage` is not applied (file storage: they
    /// are configuration, not cache).
    pub fn credentials_kv_config(&self) -> kv::Config {
        kv::Config {
            bucket: self.credentials_bucket(),
            description: "Cloud Agents: per-user plugin credentials (encrypted)".to_string(),
            history: 1,
            max_value_size: i32::try_from(CREDENTIALS_RECORD_MAX_BYTES).unwrap_or(i32::MAX),
            num_replicas: self.replicas,
            ..Default::default()
        }
    }

    /// The users' connected OAuth accounts (fleet-services' `oauth`), sealed. `storage` is not applied (file
    /// storage: a lost refresh token means the user connects again).
    pub fn oauth_accounts_kv_config(&self) -> kv::Config {
        kv::Config {
            bucket: self.oauth_accounts_bucket(),
            description: "Cloud Agents: users' OAuth accounts (tokens encrypted)".to_string(),
            history: 1,
            max_value_size: i32::try_from(OAUTH_ACCOUNTS_RECORD_MAX_BYTES).unwrap_or(i32::MAX),
            num_replicas: self.replicas,
            ..Default::default()
        }
    }

    /// The OAuth connect flows started and not yet called back (fleet-services' `oauth`), kept for
    /// [`OAUTH_STATE_TTL`].
    pub fn oauth_state_kv_config(&self) -> kv::Config {
        self.kv(
            self.oauth_state_bucket(),
            "OAuth connect flows in progress (single-use state)",
            OAUTH_STATE_TTL,
            OAUTH_STATE_MAX_BYTES,
        )
    }

    /// The APS storage KV (`storage/*`), whose values are envelopes of at most `max_value` bytes (the services'
    /// value cap plus the envelope).
    pub fn aps_kv_config(&self, max_value: usize) -> kv::Config {
        self.kv(
            self.aps_kv_bucket(),
            "APS KV (storage/*)",
            Duration::ZERO,
            max_value,
        )
    }

    /// Each user's daily usage per metered family (`image/*` images, `web/*` compute units), shared by every
    /// worker.
    pub fn usage_kv_config(&self) -> kv::Config {
        self.kv(
            self.usage_bucket(),
            "daily usage per user and family (image/*, web/*)",
            USAGE_MAX_AGE,
            USAGE_MAX_BYTES,
        )
    }

    /// The agent sessions the fleet runs (`agent/session.*`), their run leases and each user's index, shared by
    /// every worker.
    pub fn agent_sessions_kv_config(&self) -> kv::Config {
        self.kv(
            self.agent_sessions_bucket(),
            "agent sessions, run leases and per-user indexes (agent/session.*)",
            AGENT_SESSIONS_MAX_AGE,
            AGENT_SESSIONS_MAX_BYTES,
        )
    }

    /// The delegations of jobs (the fleet crate's `delegation::JobDelegations`), written by fronts only.
    pub fn delegations_kv_config(&self) -> kv::Config {
        self.kv(
            self.delegations_bucket(),
            "delegations of jobs' agent-session tool calls (by SHA-256 of the secret)",
            DELEGATION_MAX_AGE,
            DELEGATION_MAX_BYTES,
        )
    }

    /// The APS bytes stored per user (the quota KV values and files share).
    pub fn aps_usage_kv_config(&self) -> kv::Config {
        kv::Config {
            bucket: self.aps_usage_bucket(),
            description: "APS storage bytes per user".to_string(),
            max_value_size: i32::try_from(APS_USAGE_MAX_BYTES).unwrap_or(i32::MAX),
            history: 1,
            storage: self.storage,
            num_replicas: self.replicas,
            ..Default::default()
        }
    }

    /// The APS file index (`files/*`), entries of at most `max_value` bytes.
    pub fn aps_files_kv_config(&self, max_value: usize) -> kv::Config {
        self.kv(
            self.aps_files_bucket(),
            "APS files (files/*)",
            Duration::ZERO,
            max_value,
        )
    }

    /// The APS files begun and not completed, entries of at most `max_value` bytes, kept for
    /// [`STAGING_RETENTION`].
    pub fn aps_pending_kv_config(&self, max_value: usize) -> kv::Config {
        self.kv(
            self.aps_pending_bucket(),
            "APS files begun, not completed",
            STAGING_RETENTION,
            max_value,
        )
    }

    /// The `max_bytes` of a bucket given `percent` of the store budget: that share, every replica counted, divided
    /// by `replicas`; 0 (no cap) without a configured budget.
    pub fn budget_share_max_bytes(&self, percent: u64) -> i64 {
        let share = crate::fill::percent_of(self.job_store_max_bytes, percent) / self.replicas.max(1) as u64;
        i64::try_from(share).unwrap_or(i64::MAX)
    }

    /// The object store of `bucket`, with `storage` and `replicas`.
    fn objects(
        &self,
        bucket: String,
        description: &str,
        max_age: Duration,
        max_bytes: i64,
    ) -> object_store::Config {
        object_store::Config {
            bucket,
            description: Some(description.to_string()),
            max_age,
            max_bytes,
            storage: self.storage,
            num_replicas: self.replicas,
            ..Default::default()
        }
    }

    /// The bytes of committed APS files.
    pub fn aps_objects_config(&self) -> object_store::Config {
        self.objects(self.aps_objects_bucket(), "APS files", Duration::ZERO, 0)
    }

    /// The bytes of APS files uploaded but not completed, kept for [`STAGING_RETENTION`], at most
    /// [`STAGING_STORE_PERCENT`] of the store budget.
    pub fn aps_staging_config(&self) -> object_store::Config {
        self.objects(
            self.aps_staging_bucket(),
            "APS files uploaded but not completed",
            STAGING_RETENTION,
            self.budget_share_max_bytes(STAGING_STORE_PERCENT),
        )
    }

    /// The `host/uploadFile` objects, kept for [`UPLOAD_RETENTION`], at most [`UPLOADS_STORE_PERCENT`] of the
    /// store budget.
    pub fn uploads_config(&self) -> object_store::Config {
        self.objects(
            self.uploads_bucket(),
            "host/uploadFile objects",
            UPLOAD_RETENTION,
            self.budget_share_max_bytes(UPLOADS_STORE_PERCENT),
        )
    }

    /// The streams behind the object stores whose `max_bytes` is a share of the store budget (staging and
    /// uploads): what the fill guard counts as used up to their caps.
    pub fn budget_share_streams(&self) -> [String; 2] {
        [
            format!("OBJ_{}", self.aps_staging_bucket()),
            format!("OBJ_{}", self.uploads_bucket()),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The buckets other crates open keep the exact configuration they were created with before they were
    /// configured here (a change would update live buckets at the next front start).
    #[test]
    fn a_store_budget_holds_one_reserve_under_its_mark() {
        let reserve = StoreSettings::default().job_storage_reserve();
        let with = |budget| StoreSettings {
            job_store_max_bytes: budget,
            ..StoreSettings::default()
        };
        // The smallest budget whose mark holds one reserve passes; one byte less is refused; 0 = no budget.
        let mut budget = reserve;
        while crate::fill::high_water(budget) < reserve {
            budget += 1;
        }
        assert_eq!(with(budget).validate(), Ok(()));
        assert!(matches!(
            with(budget - 1).validate(),
            Err(SettingsError::Range {
                field: "job_store_max_bytes",
                ..
            })
        ));
        assert_eq!(with(0).validate(), Ok(()));
        let no_refresh = StoreSettings {
            store_fill_refresh: Duration::ZERO,
            ..StoreSettings::default()
        };
        assert!(matches!(
            no_refresh.validate(),
            Err(SettingsError::Range {
                field: "store_fill_refresh",
                ..
            })
        ));
    }

    #[test]
    fn the_storage_cap_needs_one_reserve_and_the_chart_says_so() {
        let s = StoreSettings::default();
        // The reserve: the largest record and a full ring of the largest events, each message with its overhead.
        let per_event =
            (limits::MAX_PROGRESS_EVENT_BYTES + PROGRESS_ENVELOPE_HEADROOM) as u64 + STORED_MESSAGE_OVERHEAD;
        let reserve = s.job_record_max_bytes as u64
            + STORED_MESSAGE_OVERHEAD
            + limits::PROGRESS_RING_SIZE as u64 * per_event;
        assert_eq!(s.job_storage_reserve(), reserve);
        assert_eq!(s.ring_storage_bound(0), 0);
        assert_eq!(s.ring_storage_bound(3), 3 * per_event);
        assert_eq!(
            s.ring_storage_bound(10_000),
            limits::PROGRESS_RING_SIZE as u64 * per_event
        );
        // At the boundary: one reserve is enough, one byte less is refused.
        let at = StoreSettings {
            max_job_bytes_per_user: reserve,
            ..StoreSettings::default()
        };
        assert_eq!(at.validate(), Ok(()));
        let below = StoreSettings {
            max_job_bytes_per_user: reserve - 1,
            ..StoreSettings::default()
        };
        assert!(
            matches!(
                below.validate(),
                Err(SettingsError::Range {
                    field: "max_job_bytes_per_user",
                    ..
                })
            ),
            "{:?}",
            below.validate()
        );
        // The chart's default and its schema's minimum are these numbers.
        let chart = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/helm/cloud-agents");
        let values = std::fs::read_to_string(format!("{chart}/values.yaml")).expect("values.yaml");
        assert!(
            values.contains(&format!("\n  maxJobBytesPerUser: {MAX_JOB_BYTES_PER_USER}\n")),
            "values.yaml's quotas.maxJobBytesPerUser is MAX_JOB_BYTES_PER_USER"
        );
        let schema: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(format!("{chart}/values.schema.json")).expect("schema"),
        )
        .expect("schema JSON");
        assert_eq!(
            schema["properties"]["quotas"]["properties"]["maxJobBytesPerUser"]["minimum"],
            serde_json::json!(reserve),
            "the schema's minimum is one job's reserve"
        );
    }

    #[test]
    fn staging_and_uploads_take_their_share_of_the_store_budget_per_replica() {
        let with = |budget, replicas| StoreSettings {
            job_store_max_bytes: budget,
            replicas,
            ..StoreSettings::default()
        };
        // 5 % of 30 GiB, every replica counted, over 3 replicas: 512 MiB each.
        let s = with(30 << 30, 3);
        assert_eq!((STAGING_STORE_PERCENT, UPLOADS_STORE_PERCENT), (5, 5));
        assert_eq!(s.aps_staging_config().max_bytes, 512 << 20);
        assert_eq!(s.uploads_config().max_bytes, 512 << 20);
        // Rounded down at the boundary: 5 % of 1003 is 50, over 3 replicas 16.
        assert_eq!(with(1003, 3).budget_share_max_bytes(5), 16);
        assert_eq!(with(1003, 1).budget_share_max_bytes(5), 50);
        // The committed files and the other object stores are not capped; without a budget nothing is.
        assert_eq!(s.aps_objects_config().max_bytes, 0);
        assert_eq!(with(0, 3).aps_staging_config().max_bytes, 0);
        assert_eq!(
            s.budget_share_streams(),
            ["OBJ_fleet_aps_staging".to_owned(), "OBJ_fleet_uploads".to_owned()]
        );
    }

    #[test]
    fn the_other_crates_buckets_keep_their_settings() {
        let s = StoreSettings {
            prefix: "p".to_string(),
            replicas: 3,
            storage: stream::StorageType::Memory,
            ..StoreSettings::default()
        };
        let (file, memory) = (stream::StorageType::File, stream::StorageType::Memory);
        let kvs = [
            (
                s.plugins_kv_config(),
                ("p_plugins", "Cloud Agents plugin records (versions, current)"),
                (5, 1024 * 1024, Duration::ZERO, 0, file),
            ),
            (
                s.app_creds_kv_config(),
                (
                    "p_app_creds",
                    "Cloud Agents: issued app NATS credentials (no secrets)",
                ),
                (1, 64 * 1024, Duration::ZERO, 0, memory),
            ),
            (
                s.grants_kv_config(),
                (
                    "p_grants",
                    "Cloud Agents: user grants of host capabilities per plugin",
                ),
                (1, 16 * 1024, Duration::ZERO, 0, file),
            ),
            (
                s.credentials_kv_config(),
                (
                    "p_credentials",
                    "Cloud Agents: per-user plugin credentials (encrypted)",
                ),
                (1, 256 * 1024, Duration::ZERO, 0, file),
            ),
            (
                s.oauth_accounts_kv_config(),
                (
                    "p_oauth_accounts",
                    "Cloud Agents: users' OAuth accounts (tokens encrypted)",
                ),
                (1, 64 * 1024, Duration::ZERO, 0, file),
            ),
            (
                s.oauth_state_kv_config(),
                (
                    "p_oauth_state",
                    "OAuth connect flows in progress (single-use state)",
                ),
                (1, 4 * 1024, Duration::from_secs(600), -1, memory),
            ),
            (
                s.aps_usage_kv_config(),
                ("p_aps_usage", "APS storage bytes per user"),
                (1, 32 * 1024, Duration::ZERO, 0, memory),
            ),
            (
                s.aps_kv_config(320 * 1024),
                ("p_aps_kv", "APS KV (storage/*)"),
                (1, 320 * 1024, Duration::ZERO, -1, memory),
            ),
            (
                s.aps_files_kv_config(16 * 1024),
                ("p_aps_files", "APS files (files/*)"),
                (1, 16 * 1024, Duration::ZERO, -1, memory),
            ),
            (
                s.aps_pending_kv_config(16 * 1024),
                ("p_aps_pending", "APS files begun, not completed"),
                (1, 16 * 1024, Duration::from_secs(3600), -1, memory),
            ),
        ];
        for (c, (bucket, description), (history, max_value, max_age, max_bytes, storage)) in kvs {
            assert_eq!((c.bucket.as_str(), c.description.as_str()), (bucket, description));
            assert_eq!(c.history, history, "{bucket}: history");
            assert_eq!(c.max_value_size, max_value, "{bucket}: max_value_size");
            assert_eq!(c.max_age, max_age, "{bucket}: max_age");
            assert_eq!(c.max_bytes, max_bytes, "{bucket}: max_bytes");
            assert_eq!(c.storage, storage, "{bucket}: storage");
            assert_eq!(c.num_replicas, 3, "{bucket}: replicas");
        }
        let objects = [
            (
                s.plugin_packages_config(),
                ("p_plugin_packages", "Cloud Agents plugin packages (sha256-<hex>)"),
                (Duration::ZERO, file),
            ),
            (
                s.aps_objects_config(),
                ("p_aps_objects", "APS files"),
                (Duration::ZERO, memory),
            ),
            (
                s.aps_staging_config(),
                ("p_aps_staging", "APS files uploaded but not completed"),
                (Duration::from_secs(3600), memory),
            ),
            (
                s.uploads_config(),
                ("p_uploads", "host/uploadFile objects"),
                (Duration::from_secs(24 * 3600), memory),
            ),
        ];
        for (c, (bucket, description), (max_age, storage)) in objects {
            assert_eq!(
                (c.bucket.as_str(), c.description.as_deref()),
                (bucket, Some(description))
            );
            assert_eq!(c.max_age, max_age, "{bucket}: max_age");
            assert_eq!(c.max_bytes, 0, "{bucket}: max_bytes without a store budget");
            assert_eq!(c.storage, storage, "{bucket}: storage");
            assert_eq!(c.num_replicas, 3, "{bucket}: replicas");
        }
    }
}
