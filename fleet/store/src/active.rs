//! Per-user active sets (`<prefix>_active`, key `<user_key>`): the ids of the user's queued and running jobs.
//! Every change is a compare-and-set on the key's revision, so the quota check and taking the slot are one
//! atomic step however many replicas race.

use fleet_proto::api::JobId;
use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};

use super::settings::ACTIVE_SET_MAX_BYTES;
use fleet_proto::api::user_key;
use fleet_proto::limits::MAX_LONG_JOBS_PER_AGENT;
use fleet_proto::util::now_ms;

use super::cas::{Edit, Target, compare_and_set_guessed};
use super::{JobRecord, Op, Revisioned, Store, StoreError, read, read_settled};

/// The value at `<user_key>`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct ActiveSet {
    /// The real user id.
    pub(crate) user: String,
    /// One slot per active job.
    #[serde(default)]
    pub(crate) jobs: Vec<Slot>,
}

/// One taken slot.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Slot {
    /// The job.
    pub(crate) job_id: JobId,
    /// When the slot was taken (epoch ms), for the orphan grace of [`Store::heal_active_set`].
    pub(crate) taken_at_ms: u64,
}

/// The outcome of [`Store::acquire_slot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acquired {
    /// This call took the slot.
    New {
        /// When.
        taken_at_ms: u64,
        /// Its place in the set (admission order, 0-based): [`may_run`](super::may_run) tells whether it holds
        /// one of the agent's long-job slots.
        position: usize,
    },
    /// The job held a slot already (a retried creation): nothing changed.
    Already {
        /// When it was taken.
        taken_at_ms: u64,
        /// Its place in the set now.
        position: usize,
    },
}

impl Acquired {
    /// When the slot was taken.
    pub fn taken_at_ms(&self) -> u64 {
        match self {
            Acquired::New { taken_at_ms, .. } | Acquired::Already { taken_at_ms, .. } => *taken_at_ms,
        }
    }

    /// The job's place in its user's active set (admission order, 0-based).
    pub fn position(&self) -> usize {
        match self {
            Acquired::New { position, .. } | Acquired::Already { position, .. } => *position,
        }
    }
}

const LIMIT: (&str, usize) = ("active set", ACTIVE_SET_MAX_BYTES);

/// Concurrent record reads while healing.
const HEAL_READS: usize = 8;

impl Store {
    /// The ids in the user's active set, in the order the slots were taken.
    pub async fn active_set(&self, user: &str) -> Result<Vec<JobId>, StoreError> {
        let set = read::<ActiveSet>(&self.inner.active, &user_key(user), Op::ActiveSet).await?;
        Ok(set
            .map(|s| s.value.jobs.into_iter().map(|s| s.job_id).collect())
            .unwrap_or_default())
    }

    /// Takes a slot for `job_id` in the user's active set if it holds fewer than `max_active` ids
    /// ([`StoreError::QuotaExceeded`] otherwise), by compare-and-set (create when absent; retried on conflict).
    /// When the set is full it is healed once ([`heal_active_set`](Self::heal_active_set)) before refusing.
    ///
    /// The low-level half of [`create_job`](Self::create_job), which is what callers normally use.
    pub async fn acquire_slot(
        &self,
        user: &str,
        job_id: &JobId,
        max_active: usize,
    ) -> Result<Acquired, StoreError> {
        let take = |mut set: ActiveSet| {
            if let Some((position, slot)) = set.jobs.iter().enumerate().find(|(_, s)| s.job_id == *job_id) {
                return Ok(Edit::Keep(Acquired::Already {
                    taken_at_ms: slot.taken_at_ms,
                    position,
                }));
            }
            if set.jobs.len() >= max_active {
                return Err(StoreError::QuotaExceeded {
                    active: set.jobs.len(),
                    max: max_active,
                });
            }
            let taken_at_ms = now_ms();
            let position = set.jobs.len();
            set.jobs.push(Slot {
                job_id: job_id.clone(),
                taken_at_ms,
            });
            Ok(Edit::Write(
                set,
                Acquired::New {
                    taken_at_ms,
                    position,
                },
            ))
        };
        match self.edit_active_set(user, Op::AcquireSlot, take).await {
            Err(StoreError::QuotaExceeded { .. }) if self.heal_active_set(user).await? > 0 => {
                self.edit_active_set(user, Op::AcquireSlot, take).await
            }
            other => other,
        }
    }

    /// Puts `job_id` back into the set if it is missing, ignoring the quota (a record was created after its slot
    /// was healed away). Returns whether it had to.
    pub(crate) async fn ensure_slot(
        &self,
        user: &str,
        job_id: &JobId,
        taken_at_ms: u64,
    ) -> Result<bool, StoreError> {
        self.edit_active_set(user, Op::AcquireSlot, |mut set| {
            if set.jobs.iter().any(|s| s.job_id == *job_id) {
                return Ok(Edit::Keep(false));
            }
            set.jobs.push(Slot {
                job_id: job_id.clone(),
                taken_at_ms,
            });
            Ok(Edit::Write(set, true))
        })
        .await
    }

    /// Gives the job's slot back (compare-and-set; retried on conflict) and queues the job this moves into the
    /// agent's long-job slots, if any. Returns whether the id was in the set.
    pub async fn release_slot(&self, user: &str, job_id: &JobId) -> Result<bool, StoreError> {
        let (removed, promoted) = self
            .edit_active_set(user, Op::ReleaseSlot, |set| {
                Ok(remove(set, |s| s.job_id == *job_id))
            })
            .await?;
        self.enqueue_promoted(user, &promoted).await;
        Ok(removed > 0)
    }

    /// Heals a user's active set: drops ids whose record is terminal, and ids whose record does not exist once
    /// their slot is older than [`orphan_slot_grace`](super::StoreSettings::orphan_slot_grace) (a replica that
    /// died between taking the slot and creating the record). Returns how many were dropped.
    pub async fn heal_active_set(&self, user: &str) -> Result<usize, StoreError> {
        let key = user_key(user);
        let grace_ms = u64::try_from(self.inner.settings.orphan_slot_grace.as_millis()).unwrap_or(u64::MAX);
        let Some(current) = read::<ActiveSet>(&self.inner.active, &key, Op::HealActiveSet).await? else {
            return Ok(0);
        };
        let job_keys: Vec<String> = current
            .value
            .jobs
            .iter()
            .map(|s| format!("{key}.{}", s.job_id))
            .collect();
        // Per slot: Some(whether the record is active), None when there is no record.
        let records: Vec<Option<bool>> = futures::stream::iter(job_keys)
            .map(|job_key| async move {
                // "No record" drops the slot: the leader's answer, not a follower's that has not seen the creation.
                match read_settled::<JobRecord>(&self.inner.jobs, &job_key, Op::HealActiveSet).await {
                    Ok(r) => Ok(r.map(|r| r.value.state.is_active())),
                    // A record that does not parse is no evidence the job is over: keep the slot.
                    Err(StoreError::Corrupt { .. }) => Ok(Some(true)),
                    Err(e) => Err(e),
                }
            })
            .buffered(HEAL_READS)
            .try_collect()
            .await?;
        let now = now_ms();
        // The verdicts hold whatever happens to the set meanwhile (a terminal job stays terminal; a slot
        // re-taken for a late record is a new entry `ensure_slot` adds after this): drop exactly these ids.
        let dead: Vec<JobId> = records
            .iter()
            .zip(&current.value.jobs)
            .filter(|(record, slot)| match record {
                Some(active) => !*active,
                None => now.saturating_sub(slot.taken_at_ms) >= grace_ms,
            })
            .map(|(_, slot)| slot.job_id.clone())
            .collect();
        if dead.is_empty() {
            return Ok(0);
        }
        let (removed, promoted) = self
            .edit_active_set(user, Op::HealActiveSet, |set| {
                Ok(remove(set, |s| dead.contains(&s.job_id)))
            })
            .await?;
        self.enqueue_promoted(user, &promoted).await;
        Ok(removed)
    }

    /// A compare-and-set of a user's active set ([`compare_and_set`]): an absent key is an empty set owned by
    /// `user`; `edit` decides.
    async fn edit_active_set<T>(
        &self,
        user: &str,
        op: Op,
        mut edit: impl FnMut(ActiveSet) -> Result<Edit<ActiveSet, T>, StoreError>,
    ) -> Result<T, StoreError> {
        let key = user_key(user);
        let target = Target {
            kv: &self.inner.active,
            key: &key,
            op,
            limit: LIMIT,
        };
        // Started from this replica's copy of the set while it keeps one (fronts: `watch_active_sets`).
        let guess = self.inner.active_cache.guess(&key);
        let committed = compare_and_set_guessed(target, guess, |current: Option<Revisioned<ActiveSet>>| {
            let set = current.map_or_else(
                || ActiveSet {
                    user: user.to_string(),
                    jobs: Vec::new(),
                },
                |r| r.value,
            );
            Ok::<_, StoreError>(match edit(set)? {
                Edit::Write(mut set, out) => {
                    set.user = user.to_string();
                    Edit::Write(set, out)
                }
                other => other,
            })
        })
        .await?;
        if let Some(written) = &committed.written {
            self.inner.active_cache.learn(&key, written);
        }
        Ok(committed.out)
    }
}

/// Removes the slots matching `dead`; the edit writes only when something was removed, and yields how many and
/// the ids that moved into the agent's long-job slots ([`may_run`](super::may_run)) by it.
fn remove(mut set: ActiveSet, dead: impl Fn(&Slot) -> bool) -> Edit<ActiveSet, (usize, Vec<JobId>)> {
    let running_before: Vec<JobId> = set
        .jobs
        .iter()
        .take(MAX_LONG_JOBS_PER_AGENT)
        .map(|s| s.job_id.clone())
        .collect();
    let before = set.jobs.len();
    set.jobs.retain(|s| !dead(s));
    let promoted: Vec<JobId> = set
        .jobs
        .iter()
        .take(MAX_LONG_JOBS_PER_AGENT)
        .filter(|s| !running_before.contains(&s.job_id))
        .map(|s| s.job_id.clone())
        .collect();
    match before - set.jobs.len() {
        0 => Edit::Keep((0, Vec::new())),
        n => Edit::Write(set, (n, promoted)),
    }
}
