//! Every durable fact of the job layer, on NATS JetStream: job records, per-user active sets (the 5-job quota),
//! progress rings, and the worker registry. The front is stateless; any replica can serve any call, and every
//! write that decides something (admission, a state transition) is a compare-and-set on a KV revision.
//!
//! Resources and their settings: [`settings`] (one place; see also docs/operations.md "State in JetStream").
//!
//! Keys:
//! * jobs: `<user_key>.<job_id>` — the user is part of the key, so reading another user's job is simply "absent"
//!   and listing one user's jobs reads only that user's keys;
//! * active sets: `<user_key>`;
//! * workers: `<worker_id>`;
//! * manifests: the [`user_key`]-style hash of the tool id (the id is kept in the value);
//! * job index: `<user_key>` (the head: the open page) and `<user_key>.<n>` (sealed pages), see [`index`];
//! * progress subjects: `<prefix>.v1.progress.<user_key>.<job_id>`;
//! * job queue subjects: `<prefix>.v1.job_queue.<user_key>` ([`JobQueue`]).
//!
//! [`user_key`] maps any user id to 32 hex characters (user ids may hold characters subjects and keys forbid);
//! the real id is kept inside the values.
//!
//! Invariants:
//! * a job never gets two terminal states, and a terminal record is never written again
//!   ([`Store::transition`], [`Store::update_job`]);
//! * a user never has more than `max_active` ids in the active set, however many replicas race
//!   ([`Store::create_job`]); a slot is taken before the record exists and given back when the record becomes
//!   terminal, and [`Store::heal_active_set`] drops slots left behind by a replica that died in between;
//! * of a user's active jobs only the first [`MAX_LONG_JOBS_PER_AGENT`](fleet_proto::limits::MAX_LONG_JOBS_PER_AGENT)
//!   in admission order may run (the agent's long-job slots, [`may_run`]); whichever edit of the active set moves
//!   a job into them queues it ([`Store::enqueue_job`]);
//! * every job is in its user's index before [`Store::create_job`] returns, and a user never has more than
//!   `max_retained_jobs_per_user` jobs created within the retention ([`StoreError::RetainedQuotaExceeded`]);
//! * a user's jobs never keep more than `max_job_bytes_per_user` bytes of records and progress: admission reserves
//!   the most a job can keep, its terminal write replaces the reserve by what it keeps
//!   ([`StoreError::StorageQuotaExceeded`], the index's storage account);
//! * a job is admitted only while the FLEET account's JetStream store, as last read, stays under the high-water
//!   mark of its budget ([`StoreError::StoreFull`], [`fill`]); what is already admitted is never refused by it.

mod active;
pub mod active_cache;
pub mod cas;
mod direct;
mod error;
pub mod failover;
pub mod fill;
pub mod index;
mod jobs;
mod manifests;
mod progress;
pub mod provision;
mod queue;
mod record;
mod scan;
pub mod settings;
mod watched;
mod workers;

use std::sync::Arc;

use async_nats::jetstream::{self, kv, stream::Stream};
use fleet_proto::api::{JobId, JobState};
use serde::de::DeserializeOwned;

pub use active::Acquired;
pub(crate) use cas::encode;
pub use error::{Op, StoreError};
pub use fill::FillReading;
pub use index::{JobPage, ListCursor, ListCursorError};
pub use jobs::JobView;
pub use provision::{BoxError, Provision, ProvisionError};
pub use queue::{JobQueue, Pulled, QueuedJob, may_run};
pub use record::{JobRecord, rfc3339_ms};
pub use settings::{SettingsError, StoreSettings};
pub use workers::{WorkerChange, WorkerInfo};

use fleet_proto::api::user_key;

/// A value and the KV revision it was read or written at.
#[derive(Debug, Clone, PartialEq)]
pub struct Revisioned<T> {
    /// The value.
    pub value: T,
    /// Its revision (the stream sequence of the write).
    pub revision: u64,
}

/// The outcome of [`Store::transition`].
#[derive(Debug, Clone, PartialEq)]
pub enum Transition {
    /// Written: the record as stored now.
    Done(Revisioned<JobRecord>),
    /// The state machine forbids it (e.g. the job is terminal already): the current record, unchanged.
    Refused(Revisioned<JobRecord>),
    /// No such job for this user.
    NotFound,
}

/// `listJobs` filters (spec §10.8). Empty `states` = any state.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JobFilter {
    /// Only this tool id.
    pub tool_id: Option<String>,
    /// Only these states (any, when empty).
    pub states: Vec<JobState>,
    /// Exact `clientTag`.
    pub client_tag: Option<String>,
    /// `created_at_ms >= since_ms`.
    pub since_ms: Option<u64>,
}

impl JobFilter {
    /// Whether a record passes the filter.
    pub fn matches(&self, r: &JobRecord) -> bool {
        self.tool_id.as_ref().is_none_or(|t| *t == r.tool_id)
            && (self.states.is_empty() || self.states.contains(&r.state))
            && self
                .client_tag
                .as_ref()
                .is_none_or(|t| r.client_tag.as_ref() == Some(t))
            && self.since_ms.is_none_or(|s| r.created_at_ms >= s)
    }
}

/// The job store. Cheap to clone; every clone shares one JetStream context.
#[derive(Debug, Clone)]
pub struct Store {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    js: jetstream::Context,
    settings: StoreSettings,
    jobs: kv::Store,
    active: kv::Store,
    workers: kv::Store,
    manifests: kv::Store,
    index: kv::Store,
    active_cache: active_cache::ActiveCache,
    manifest_copy: manifests::ManifestCopy,
    progress: Stream,
    job_queue: Stream,
    fill: fill::Fill,
}

impl Store {
    /// Creates every resource, or updates it to `settings` (idempotent: opening twice with the same settings
    /// changes nothing; any number of replicas may open concurrently).
    pub async fn open(js: jetstream::Context, settings: StoreSettings) -> Result<Store, StoreError> {
        settings.validate()?;
        let jobs = open_kv(&js, settings.jobs_kv_config(), settings.provision).await?;
        let active = open_kv(&js, settings.active_kv_config(), settings.provision).await?;
        let workers = open_kv(&js, settings.workers_kv_config(), settings.provision).await?;
        let manifests = open_kv(&js, settings.manifests_kv_config(), settings.provision).await?;
        let index = open_kv(&js, settings.job_index_kv_config(), settings.provision).await?;
        let config = settings.progress_stream_config();
        let name = config.name.clone();
        let resource = |source: BoxError| StoreError::Resource {
            resource: name.clone(),
            source,
        };
        let progress = provision::stream(&js, config, settings.provision)
            .await
            .map_err(|e| resource(e.into()))?;
        let config = settings.job_queue_stream_config();
        let queue_name = config.name.clone();
        let job_queue = provision::stream(&js, config, settings.provision)
            .await
            .map_err(|e| StoreError::Resource {
                resource: queue_name,
                source: e.into(),
            })?;
        Ok(Store {
            inner: Arc::new(Inner {
                js,
                settings,
                jobs,
                active,
                workers,
                manifests,
                index,
                active_cache: active_cache::ActiveCache::default(),
                manifest_copy: manifests::ManifestCopy::default(),
                progress,
                job_queue,
                fill: fill::Fill::default(),
            }),
        })
    }

    /// The settings it was opened with.
    pub fn settings(&self) -> &StoreSettings {
        &self.inner.settings
    }

    fn job_key(user: &str, job_id: &JobId) -> String {
        format!("{}.{}", user_key(user), job_id)
    }
}

pub async fn open_kv(
    js: &jetstream::Context,
    config: kv::Config,
    provision: Provision,
) -> Result<kv::Store, StoreError> {
    let bucket = config.bucket.clone();
    provision::key_value(js, config, provision)
        .await
        .map_err(|e| StoreError::Resource {
            resource: bucket,
            source: e.into(),
        })
}

/// Reads a KV value; a deleted or purged key is `None`.
pub async fn read<T: DeserializeOwned>(
    kv: &kv::Store,
    key: &str,
    op: Op,
) -> Result<Option<Revisioned<T>>, StoreError> {
    Ok(read_sized(kv, key, op).await?.map(|(value, _)| value))
}

/// [`read`], with the size of the stored JSON.
pub(crate) async fn read_sized<T: DeserializeOwned>(
    kv: &kv::Store,
    key: &str,
    op: Op,
) -> Result<Option<(Revisioned<T>, usize)>, StoreError> {
    match kv.entry(key).await.map_err(|e| StoreError::nats(op, e))? {
        Some(entry) if entry.operation == kv::Operation::Put => {
            decode(key, op, &entry.value, entry.revision).map(Some)
        }
        _ => Ok(None),
    }
}

/// The JSON value stored at `key` at `revision`, and its size.
fn decode<T: DeserializeOwned>(
    key: &str,
    op: Op,
    bytes: &[u8],
    revision: u64,
) -> Result<(Revisioned<T>, usize), StoreError> {
    let value = serde_json::from_slice(bytes).map_err(|source| StoreError::Corrupt {
        op,
        key: key.to_string(),
        source,
    })?;
    Ok((Revisioned { value, revision }, bytes.len()))
}

/// [`read`], answered by the bucket's stream leader (a `STREAM.MSG.GET` request, which only the leader answers)
/// instead of by any replica. A [`read`] is a direct get, which JetStream lets every replica answer — a follower
/// that has not applied the latest writes yet (one lagging by a few messages, or a restarted node catching up)
/// answers with an older revision, or "absent" for a key created since: direct gets have no read-after-write
/// (nats-server ADR-8 and "JetStream Read-after-Write"). Such a read is harmless before a compare-and-set write
/// (the leader refuses a stale revision), but a decision that writes nothing — "no such job", "refused from this
/// state", "nothing to change" — must be taken on the leader's answer: [`cas::compare_and_set`] confirms every
/// such decision with this read.
pub async fn read_current<T: DeserializeOwned>(
    kv: &kv::Store,
    key: &str,
    op: Op,
) -> Result<Option<Revisioned<T>>, StoreError> {
    Ok(read_current_sized(kv, key, op).await?.map(|(value, _)| value))
}

/// [`read_current`], with the size of the stored JSON.
pub(crate) async fn read_current_sized<T: DeserializeOwned>(
    kv: &kv::Store,
    key: &str,
    op: Op,
) -> Result<Option<(Revisioned<T>, usize)>, StoreError> {
    use async_nats::jetstream::stream::LastRawMessageErrorKind;
    let subject = format!("{}{key}", kv.prefix);
    match kv.stream.get_last_raw_message_by_subject(&subject).await {
        Ok(message) if is_marker(&message.headers) => Ok(None),
        Ok(message) => decode(key, op, &message.payload, message.sequence).map(Some),
        Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
        Err(e) => Err(StoreError::nats(op, e)),
    }
}

/// [`read`], with "absent" confirmed by the leader ([`read_current`]) on a replicated bucket: for reads whose
/// "absent" is an answer someone acts on — "no such job" to a client, a job failed for an unknown tool, an agent
/// call refused for an unknown delegation — where a follower that has not applied the key's creation yet must not
/// decide. A value found is returned as read (it may be older than the last write: callers that decide on it
/// write by compare-and-set).
pub async fn read_settled<T: DeserializeOwned>(
    kv: &kv::Store,
    key: &str,
    op: Op,
) -> Result<Option<Revisioned<T>>, StoreError> {
    match read(kv, key, op).await? {
        None if replicated(kv) => read_current(kv, key, op).await,
        found => Ok(found),
    }
}

/// Whether replicas other than the leader may answer `kv`'s direct gets (more than one replica): only then can a
/// [`read`] be older than the last write acknowledged.
pub fn replicated(kv: &kv::Store) -> bool {
    kv.stream.cached_info().config.num_replicas > 1
}

/// Whether a KV message (read through a consumer) is a delete/purge marker rather than a value.
fn is_kv_marker(message: &async_nats::Message) -> bool {
    message.headers.as_ref().is_some_and(is_marker)
}

/// Whether the headers of a KV message mark a delete or purge rather than a value.
fn is_marker(headers: &async_nats::HeaderMap) -> bool {
    headers
        .get("KV-Operation")
        .is_some_and(|v| matches!(v.as_str(), "DEL" | "PURGE"))
        || headers.get(async_nats::header::NATS_MARKER_REASON).is_some()
}
