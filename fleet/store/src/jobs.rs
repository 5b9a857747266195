//! Job records (`<prefix>_jobs`, key `<user_key>.<job_id>`): creation with admission, reads (`getJob`'s view:
//! the record and its progress), compare-and-set transitions and updates, and every active job for the sweeper.
//! Listing one user's jobs is the index's ([`super::index`]).

use std::sync::Arc;

use async_nats::jetstream::consumer::DeliverPolicy;
use fleet_proto::api::{JobId, JobSnapshot, JobState, ProgressEvent};
use futures::{StreamExt, TryStreamExt};

use fleet_proto::util::now_ms;

use super::active::{Acquired, ActiveSet};
use super::cas::{Edit, Target, compare_and_set};
use super::scan::{Scan, scan};
use super::settings::STORED_MESSAGE_OVERHEAD;
use super::{
    JobRecord, Op, Revisioned, Store, StoreError, Transition, encode, is_kv_marker, read, read_current_sized,
    read_settled, read_sized, replicated,
};

/// Concurrent record reads of [`Store::active_jobs`].
const ACTIVE_READS: usize = 16;

impl Store {
    fn record_limit(&self) -> (&'static str, usize) {
        ("job record", self.inner.settings.job_record_max_bytes)
    }

    /// Admission and creation: takes a slot in the user's active set (at most `max_active`, else
    /// [`StoreError::QuotaExceeded`]), then creates the record at `<user_key>.<job_id>` (never overwriting:
    /// [`StoreError::JobExists`]) and adds the job to its user's index (at most `max_retained_jobs_per_user` jobs
    /// created within the retention, else [`StoreError::RetainedQuotaExceeded`]). If either fails, the slot is
    /// given back (and a record the index refused is deleted). The record must be active (`queued`, normally).
    pub async fn create_job(
        &self,
        record: JobRecord,
        max_active: usize,
    ) -> Result<Revisioned<JobRecord>, StoreError> {
        self.admit_job(record, max_active).await.map(|(r, _)| r)
    }

    /// [`create_job`](Self::create_job), with where the job landed in its user's active set: whether it may run
    /// now is [`may_run`](super::may_run) of it (else it starts once earlier jobs end: the edit that moves it
    /// into the agent's slots queues it).
    pub async fn admit_job(
        &self,
        record: JobRecord,
        max_active: usize,
    ) -> Result<(Revisioned<JobRecord>, Acquired), StoreError> {
        if !record.state.is_active() {
            return Err(StoreError::invalid(
                Op::CreateJob,
                "record",
                format!("a new job must be queued or running, not {}", record.state),
            ));
        }
        let bytes = encode(&record, self.record_limit(), Op::CreateJob)?;
        let key = Self::job_key(&record.user, &record.job_id);
        // The fleet-wide guard (`fill`): from this replica's last reading, no round trip unless it has none.
        self.check_fill(self.inner.settings.job_storage_reserve()).await?;
        // The index head is read while the slot is taken, and written while the record is created: the index
        // costs no round trip of its own on this path.
        let (acquired, head) = tokio::join!(
            self.acquire_slot(&record.user, &record.job_id, max_active),
            self.index_head(&record.user),
        );
        let acquired = acquired?;
        let (created, indexed) = tokio::join!(
            self.inner.jobs.create(&key, bytes),
            self.index_job(&record, head, matches!(acquired, Acquired::Already { .. })),
        );
        let revision = match created {
            Ok(revision) => revision,
            Err(e) => {
                // A retried creation whose first attempt got through holds the slot already: leave it.
                if matches!(acquired, Acquired::New { .. })
                    && let Err(release) = self.release_slot(&record.user, &record.job_id).await
                {
                    tracing::warn!(job = %record.job_id, error = %release, "cannot give a slot back");
                }
                return Err(
                    if e.kind() == async_nats::jetstream::kv::CreateErrorKind::AlreadyExists {
                        StoreError::JobExists {
                            op: Op::CreateJob,
                            job_id: record.job_id,
                        }
                    } else {
                        StoreError::nats(Op::CreateJob, e)
                    },
                );
            }
        };
        if let Err(e) = indexed {
            // Refused by the user's cap, or not indexed: the job must not exist unlisted. Nothing ran it yet.
            if let Err(undo) = self.inner.jobs.delete(&key).await {
                tracing::warn!(job = %record.job_id, error = %undo, "cannot delete an unindexed job record");
            }
            if matches!(acquired, Acquired::New { .. })
                && let Err(release) = self.release_slot(&record.user, &record.job_id).await
            {
                tracing::warn!(job = %record.job_id, error = %release, "cannot give a slot back");
            }
            return Err(e);
        }
        // A replica that stalled between the two steps may have had its slot healed away as an orphan: put it
        // back, so every active record is in its user's set (the sweeper finds active jobs through the sets).
        let taken_at_ms = acquired.taken_at_ms();
        let grace_ms =
            u64::try_from(self.inner.settings.orphan_slot_grace.as_millis() / 2).unwrap_or(u64::MAX);
        if now_ms().saturating_sub(taken_at_ms) >= grace_ms
            && let Err(e) = self.ensure_slot(&record.user, &record.job_id, taken_at_ms).await
        {
            tracing::warn!(job = %record.job_id, error = %e, "cannot re-check the job's slot");
        }
        Ok((
            Revisioned {
                value: record,
                revision,
            },
            acquired,
        ))
    }

    /// The record and its revision, or `None` (no such job for this user — another user's job is `None` too).
    pub async fn get_job(
        &self,
        user: &str,
        job_id: &JobId,
    ) -> Result<Option<Revisioned<JobRecord>>, StoreError> {
        self.read_job(user, job_id, Op::GetJob).await
    }

    /// What `tools.getJob` shows (spec §10.7): the record, the progress events with `seq > since_seq` (at most
    /// `limit`, 1..=`progress_max_per_job`) and the `lastSeq` to report; `None` when the user has no such job.
    ///
    /// Round trips: the record and the ring's newest message are read concurrently (two direct gets, one round
    /// trip); a slice of older events is one more (a batched direct get), only when more than the newest event
    /// is due. `known` is a terminal record the caller kept (a finished job's record is never written again): it
    /// replaces the record read, so a finished job with nothing due costs no read at all.
    ///
    /// Consistency of the two concurrent reads: the ring's newest message may have been read before or after
    /// the record. For an active record that is harmless — the slice stops at that newest message, so `lastSeq`
    /// never passes an event that was not returned, and later events come with the next call. For a terminal
    /// record the ring is read up to the record's `last_seq` (which freezes what a caller may see: events a
    /// worker appended after a cancel or an expiry are never shown), never up to that message: it may predate
    /// the terminal write, while the slice, read after the record, holds every event stored before it.
    pub async fn view_job(
        &self,
        user: &str,
        job_id: &JobId,
        since_seq: u64,
        limit: usize,
        known: Option<Arc<JobRecord>>,
    ) -> Result<Option<JobView>, StoreError> {
        self.check_progress_limit(limit, Op::GetJob)?;
        let known = known.filter(|r| r.state.is_terminal() && r.user == user && r.job_id == *job_id);
        let (record, record_bytes, tail) = match known {
            Some(record) => (record, 0, None),
            None => {
                let key = Self::job_key(user, job_id);
                let (record, tail) = tokio::join!(
                    read_sized::<JobRecord>(&self.inner.jobs, &key, Op::GetJob),
                    self.ring_tail(user, job_id),
                );
                // The key already holds the user's hash; the id inside settles a (theoretical) collision.
                let record = match record? {
                    // "No such job" is the leader's answer, never a follower's that has not seen the creation.
                    None if replicated(&self.inner.jobs) => {
                        read_current_sized::<JobRecord>(&self.inner.jobs, &key, Op::GetJob).await?
                    }
                    found => found,
                };
                let Some((record, bytes)) =
                    record.filter(|(r, _)| r.value.user == user && r.value.job_id == *job_id)
                else {
                    return Ok(None);
                };
                (Arc::new(record.value), bytes, tail?)
            }
        };
        let stored = tail.as_ref().map_or(0, |t| t.seq);
        let upto = if record.state.is_terminal() {
            record.last_seq
        } else {
            stored
        };
        // One more than `limit`: whether the slice was cut.
        let mut events = self
            .ring_slice(user, job_id, (since_seq, upto), limit + 1, tail.as_ref())
            .await?;
        let last_seq = if events.len() > limit {
            events.truncate(limit);
            events.last().map_or(since_seq, |e| e.seq)
        } else if record.state.is_terminal() {
            record.last_seq
        } else {
            events
                .iter()
                .map(|e| e.seq)
                .fold(record.last_seq.max(stored), u64::max)
        };
        Ok(Some(JobView {
            record,
            record_bytes,
            events,
            last_seq,
        }))
    }

    async fn read_job(
        &self,
        user: &str,
        job_id: &JobId,
        op: Op,
    ) -> Result<Option<Revisioned<JobRecord>>, StoreError> {
        let record = read_settled::<JobRecord>(&self.inner.jobs, &Self::job_key(user, job_id), op).await?;
        Ok(Self::own(record, user, job_id))
    }

    /// The compare-and-set target of the record at `key`.
    fn job_target<'a>(&'a self, key: &'a str, op: Op) -> Target<'a> {
        Target {
            kv: &self.inner.jobs,
            key,
            op,
            limit: self.record_limit(),
        }
    }

    /// `record`, when it is `user`'s job `job_id`: the key already holds the user's hash; the id inside settles a
    /// (theoretical) collision.
    fn own(
        record: Option<Revisioned<JobRecord>>,
        user: &str,
        job_id: &JobId,
    ) -> Option<Revisioned<JobRecord>> {
        record.filter(|r| r.value.user == user && r.value.job_id == *job_id)
    }

    /// [`Store::transition`] to a terminal state decided by someone other than the job's worker (a cancel, an
    /// expiry, a lost worker): the record's `last_seq` first takes the seq of the last event stored, so the
    /// terminal record freezes the progress a caller sees — events the worker still appends after it are never
    /// shown ("terminal is final").
    pub async fn finish(
        &self,
        user: &str,
        job_id: &JobId,
        to: JobState,
        edit: impl Fn(&mut JobRecord) + Send + Sync,
    ) -> Result<Transition, StoreError> {
        let stored = self.last_progress_seq(user, job_id).await?;
        self.transition(user, job_id, to, |r| {
            r.last_seq = r.last_seq.max(stored);
            edit(r);
        })
        .await
    }

    /// Moves a job to `to` by compare-and-set: refused ([`Transition::Refused`], with the current record) when
    /// the state machine forbids it — in particular from any terminal state, so no job ever gets two terminal
    /// states. `edit` may set anything but the id, user, creation time and state; the store sets `updated_at_ms`,
    /// `started_at_ms` (on `running`) and `finished_at_ms` (on a terminal state) when `edit` left them unset.
    /// On a revision conflict the record is re-read and the check and `edit` run again (bounded).
    /// Reaching a terminal state also gives the user's active slot back and replaces the job's reserve in its
    /// user's storage account by what it keeps: the record written and its ring — `progress_bytes` when its worker
    /// counted it, else the ring's bound for `last_seq` events ([`StoreSettings::ring_storage_bound`](crate::StoreSettings::ring_storage_bound)).
    pub async fn transition(
        &self,
        user: &str,
        job_id: &JobId,
        to: JobState,
        edit: impl Fn(&mut JobRecord) + Send + Sync,
    ) -> Result<Transition, StoreError> {
        self.transition_from(user, job_id, None, to, edit).await
    }

    /// [`transition`](Self::transition), starting from `known`: the record as this caller last wrote it (a
    /// worker's start or heartbeat). It saves the first read; the write still checks its revision, so a record
    /// written by anyone since is read again and decided on as usual.
    pub async fn transition_from(
        &self,
        user: &str,
        job_id: &JobId,
        known: Option<Revisioned<JobRecord>>,
        to: JobState,
        edit: impl Fn(&mut JobRecord) + Send + Sync,
    ) -> Result<Transition, StoreError> {
        let key = Self::job_key(user, job_id);
        let known = known.filter(|r| r.value.user == user && r.value.job_id == *job_id);
        let committed = compare_and_set(
            self.job_target(&key, Op::Transition),
            known.map(Some),
            |current| {
                let Some(current) = Self::own(current, user, job_id) else {
                    return Ok::<_, StoreError>(Edit::Keep(Some(Transition::NotFound)));
                };
                if !current.value.state.can_become(to) {
                    return Ok(Edit::Keep(Some(Transition::Refused(current))));
                }
                let mut next = current.value.clone();
                edit(&mut next);
                keep_identity(&mut next, &current.value);
                next.state = to;
                let now = now_ms();
                next.updated_at_ms = now;
                if to == JobState::Running && next.started_at_ms.is_none() {
                    next.started_at_ms = Some(now);
                }
                if to.is_terminal() && next.finished_at_ms.is_none() {
                    next.finished_at_ms = Some(now);
                }
                Ok(Edit::Write(next, None))
            },
        )
        .await?;
        let Some(written) = committed.written else {
            // Every decision that writes nothing carries its outcome.
            return Ok(committed.out.unwrap_or(Transition::NotFound));
        };
        if to.is_terminal() {
            let settings = &self.inner.settings;
            let ring = written
                .value
                .progress_bytes
                .unwrap_or_else(|| settings.ring_storage_bound(written.value.last_seq));
            let kept = (committed.written_bytes as u64 + STORED_MESSAGE_OVERHEAD).saturating_add(ring);
            let (released, settled) = tokio::join!(
                self.release_slot(user, job_id),
                self.settle_storage(&written.value, kept)
            );
            if let Err(e) = released {
                // The job is terminal; the slot is healed later (heal_active_set, or the next admission that
                // finds the set full).
                tracing::warn!(job = %job_id, error = %e, "cannot give the slot of a finished job back");
            }
            if let Err(e) = settled {
                // The job's reserve stays in the account until its hour leaves it: the user is charged more
                // than the job keeps, never less.
                tracing::warn!(job = %job_id, error = %e, "cannot settle the storage of a finished job");
            }
        }
        Ok(Transition::Done(written))
    }

    /// A non-state update (heartbeat, worker, `last_seq`) by compare-and-set, retried on conflict. `edit` returns
    /// whether it changed anything (nothing is written otherwise); it cannot change the id, user, creation time or
    /// state. Returns the record as it is now (written, or unchanged when `edit` returned `false`), or `None`
    /// when the job does not exist or is terminal (terminal records are never written again).
    pub async fn update_job(
        &self,
        user: &str,
        job_id: &JobId,
        edit: impl Fn(&mut JobRecord) -> bool + Send + Sync,
    ) -> Result<Option<Revisioned<JobRecord>>, StoreError> {
        let key = Self::job_key(user, job_id);
        let committed = compare_and_set(self.job_target(&key, Op::UpdateJob), None, |current| {
            let Some(current) = Self::own(current, user, job_id) else {
                return Ok::<_, StoreError>(Edit::Keep(None));
            };
            if current.value.state.is_terminal() {
                return Ok(Edit::Keep(None));
            }
            let mut next = current.value.clone();
            if !edit(&mut next) {
                return Ok(Edit::Keep(Some(current)));
            }
            keep_identity(&mut next, &current.value);
            next.state = current.value.state;
            next.updated_at_ms = now_ms();
            Ok(Edit::Write(next, None))
        })
        .await?;
        Ok(committed.written.or(committed.out))
    }

    /// Every queued or running job of every user, for the expiry sweeper. Found through the active sets (small:
    /// at most `max_active` ids per user) rather than by reading every record of the retention window.
    pub async fn active_jobs(&self) -> Result<Vec<Revisioned<JobRecord>>, StoreError> {
        let active = &self.inner.active;
        let sets = scan(
            &active.stream,
            Scan {
                filter: format!("{}>", active.prefix),
                deliver: DeliverPolicy::LastPerSubject,
                headers_only: false,
                max: usize::MAX,
            },
        )
        .await
        .map_err(|e| StoreError::nats(Op::ActiveJobs, e))?;
        let mut keys = Vec::new();
        for message in sets.iter().filter(|m| !is_kv_marker(&m.message)) {
            let Some(user_key) = message.message.subject.strip_prefix(active.prefix.as_str()) else {
                continue;
            };
            match serde_json::from_slice::<ActiveSet>(&message.message.payload) {
                Ok(set) => keys.extend(set.jobs.into_iter().map(|s| format!("{user_key}.{}", s.job_id))),
                Err(e) => {
                    tracing::warn!(key = %user_key, error = %e, "skipping an active set that does not parse")
                }
            }
        }
        let records: Vec<Option<Revisioned<JobRecord>>> = futures::stream::iter(keys)
            .map(|key| async move {
                match read::<JobRecord>(&self.inner.jobs, &key, Op::ActiveJobs).await {
                    Err(StoreError::Corrupt { key, source, .. }) => {
                        tracing::warn!(%key, error = %source, "skipping a job record that does not parse");
                        Ok(None)
                    }
                    other => other,
                }
            })
            .buffer_unordered(ACTIVE_READS)
            .try_collect()
            .await?;
        let mut out: Vec<_> = records
            .into_iter()
            .flatten()
            .filter(|r| r.value.state.is_active())
            .collect();
        out.sort_by_key(|r| r.value.created_at_ms);
        Ok(out)
    }
}

/// Restores what no edit may change.
fn keep_identity(next: &mut JobRecord, current: &JobRecord) {
    next.job_id.clone_from(&current.job_id);
    next.user.clone_from(&current.user);
    next.created_at_ms = current.created_at_ms;
}

/// What `tools.getJob` shows of a job ([`Store::view_job`]).
#[derive(Debug, Clone, PartialEq)]
pub struct JobView {
    /// The record (shared: a caller may keep a finished one).
    pub record: Arc<JobRecord>,
    /// Bytes of the stored record's JSON; 0 when the caller passed the record in.
    pub record_bytes: usize,
    /// Events with `seq > sinceSeq`, oldest first, at most `limit`; for a terminal job, none after its
    /// `last_seq`.
    pub events: Vec<ProgressEvent>,
    /// What to feed back as `sinceSeq`: the last event returned when `limit` cut the slice; else the highest seq
    /// a caller may see (a terminal record's `last_seq`; for an active job, the ring's newest or the record's).
    pub last_seq: u64,
}

impl JobView {
    /// The app-facing snapshot.
    pub fn into_snapshot(self) -> JobSnapshot {
        let mut snapshot = self.record.snapshot(self.events);
        snapshot.last_seq = self.last_seq;
        snapshot
    }
}
