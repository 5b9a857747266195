//! The fleet-wide guard of job admission: how full the FLEET account's JetStream store is.
//!
//! Each user's jobs are capped in bytes (the job index's storage account), but not the number of users: many
//! tenants, each under the cap, can still fill the store they all share, after which every JetStream write of the
//! fleet fails — the outcomes of the jobs already running included. So admission also reads the account's storage
//! use (`$JS.API.INFO`'s `storage`, as the server counts it: in a cluster every replica counts) and admits a new job
//! only while that use, plus the reserves this replica admitted since it read it, plus the new job's reserve, stays
//! at or under the high-water mark ([`high_water`]: [`STORE_HIGH_WATER_PERCENT`] of the budget). The rest of the
//! budget is for the writes of work already admitted (progress, outcomes, grants, sessions), which this guard never
//! refuses.
//!
//! The buckets that take a share of the budget by their `max_bytes` — `<prefix>_aps_staging` and `<prefix>_uploads`
//! ([`STAGING_STORE_PERCENT`](crate::settings::STAGING_STORE_PERCENT) and
//! [`UPLOADS_STORE_PERCENT`](crate::settings::UPLOADS_STORE_PERCENT)), filled through signed PUT links at any
//! time — are counted as full: the reading adds what they may still take to the account's use. So jobs, staging
//! and uploads together stay under the mark.
//!
//! The budget is [`StoreSettings::job_store_max_bytes`](crate::StoreSettings::job_store_max_bytes), or when it is
//! 0 the account's own JetStream disk limit, or — the account has none — there is no guard. The reading is
//! refreshed in the background (one refresh at a time) by an admission that finds it older than
//! [`store_fill_refresh`](crate::StoreSettings::store_fill_refresh); a replica's first admission reads it before
//! it decides. Between two readings every replica counts only its own admissions, so a fleet of `n` fronts may
//! overshoot the mark by what the other `n − 1` admit within one refresh interval: the headroom above the mark is
//! for that too.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use fleet_proto::util::lock;

use crate::settings::STORE_HIGH_WATER_PERCENT;
use crate::{Op, Store, StoreError};

/// `percent` % of `bytes`, rounded down, without overflow.
pub fn percent_of(bytes: u64, percent: u64) -> u64 {
    u64::try_from(u128::from(bytes) * u128::from(percent) / 100).unwrap_or(u64::MAX)
}

/// The high-water mark of a budget: [`STORE_HIGH_WATER_PERCENT`] of it, rounded down.
pub fn high_water(budget: u64) -> u64 {
    percent_of(budget, STORE_HIGH_WATER_PERCENT)
}

/// Whether a job reserving `reserve` bytes is admitted when the store holds `used` bytes and this replica admitted
/// `pending` bytes of reserves since it read that; `budget` 0 = no guard.
pub fn admits(used: u64, pending: u64, reserve: u64, budget: u64) -> bool {
    budget == 0 || used.saturating_add(pending).saturating_add(reserve) <= high_water(budget)
}

/// What a replica knows of the store's fill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FillReading {
    /// Bytes the account's JetStream store held at the last reading.
    pub used_bytes: u64,
    /// The budget in force (0 = no guard).
    pub budget_bytes: u64,
    /// Reserves of the jobs this replica admitted since the reading.
    pub pending_bytes: u64,
}

/// The state behind [`Store::refresh_fill`] and the admission check (one per [`Store`] and its clones).
#[derive(Debug, Default)]
pub(crate) struct Fill {
    used: AtomicU64,
    budget: AtomicU64,
    pending: AtomicU64,
    /// When the last reading was taken; `None` before the first.
    read_at: Mutex<Option<Instant>>,
    refreshing: AtomicBool,
}

impl Store {
    /// Reads the account's JetStream storage use and limit now (`$JS.API.INFO`) and makes it the fill admission
    /// decides on; the reserves admitted before the reading was asked for are no longer counted apart.
    ///
    /// # Errors
    /// [`StoreError::Nats`] when JetStream does not answer.
    pub async fn refresh_fill(&self) -> Result<FillReading, StoreError> {
        let fill = &self.inner.fill;
        let counted = fill.pending.load(Ordering::Acquire);
        let account = self
            .inner
            .js
            .query_account()
            .await
            .map_err(|e| StoreError::nats(Op::StoreFill, e))?;
        let configured = self.inner.settings.job_store_max_bytes;
        let budget = if configured > 0 {
            configured
        } else {
            account
                .limits
                .max_storage
                .and_then(|m| u64::try_from(m).ok())
                .unwrap_or(0)
        };
        let used = account.storage.saturating_add(self.budget_share_room().await?);
        fill.used.store(used, Ordering::Release);
        fill.budget.store(budget, Ordering::Release);
        let _ = fill
            .pending
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |p| {
                Some(p.saturating_sub(counted))
            });
        *lock(&fill.read_at) = Some(Instant::now());
        Ok(self.fill())
    }

    /// What the buckets sized by a share of the budget (staging and uploads,
    /// [`StoreSettings::budget_share_streams`](crate::StoreSettings::budget_share_streams)) may still take before
    /// their `max_bytes`, every replica counted: the guard counts them full. A bucket not created yet, or without
    /// a cap, counts nothing.
    async fn budget_share_room(&self) -> Result<u64, StoreError> {
        let mut room = 0_u64;
        for name in self.inner.settings.budget_share_streams() {
            let mut stream = match self.inner.js.get_stream(&name).await {
                Ok(s) => s,
                Err(e)
                    if matches!(
                        e.kind(),
                        async_nats::jetstream::context::GetStreamErrorKind::JetStream(ref j)
                            if j.error_code() == async_nats::jetstream::ErrorCode::STREAM_NOT_FOUND
                    ) =>
                {
                    continue;
                }
                Err(e) => return Err(StoreError::nats(Op::StoreFill, e)),
            };
            let info = stream
                .info()
                .await
                .map_err(|e| StoreError::nats(Op::StoreFill, e))?;
            let Ok(max) = u64::try_from(info.config.max_bytes) else {
                continue;
            };
            let replicas = u64::try_from(info.config.num_replicas.max(1)).unwrap_or(1);
            room = room.saturating_add(max.saturating_sub(info.state.bytes).saturating_mul(replicas));
        }
        Ok(room)
    }

    /// The fill as this replica knows it now (no round trip).
    pub fn fill(&self) -> FillReading {
        let fill = &self.inner.fill;
        FillReading {
            used_bytes: fill.used.load(Ordering::Acquire),
            budget_bytes: fill.budget.load(Ordering::Acquire),
            pending_bytes: fill.pending.load(Ordering::Acquire),
        }
    }

    /// Admission's check: admits a job reserving `reserve` bytes (and counts it as pending) or refuses it with
    /// [`StoreError::StoreFull`]. Reads the fill first on this replica's first admission; refreshes it in the
    /// background when it is older than the settings' `store_fill_refresh`.
    pub(crate) async fn check_fill(&self, reserve: u64) -> Result<(), StoreError> {
        let fill = &self.inner.fill;
        let read_at = *lock(&fill.read_at);
        match read_at {
            None => {
                self.refresh_fill().await?;
            }
            Some(at) if at.elapsed() >= self.inner.settings.store_fill_refresh => {
                if !fill.refreshing.swap(true, Ordering::AcqRel) {
                    let store = self.clone();
                    tokio::spawn(async move {
                        if let Err(e) = store.refresh_fill().await {
                            tracing::warn!(error = %e, "cannot read the JetStream store's fill; admission keeps the last reading");
                        }
                        store.inner.fill.refreshing.store(false, Ordering::Release);
                    });
                }
            }
            Some(_) => {}
        }
        let used = fill.used.load(Ordering::Acquire);
        let budget = fill.budget.load(Ordering::Acquire);
        if budget == 0 {
            return Ok(());
        }
        fill.pending
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |p| {
                admits(used, p, reserve, budget).then(|| p.saturating_add(reserve))
            })
            .map(|_| ())
            .map_err(|pending| StoreError::StoreFull {
                used: used.saturating_add(pending),
                reserve,
                high_water: high_water(budget),
                budget,
                retry_after_ms: u64::try_from(self.inner.settings.store_fill_refresh.as_millis())
                    .unwrap_or(u64::MAX),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_high_water_mark_is_its_percent_of_the_budget_rounded_down() {
        assert_eq!(STORE_HIGH_WATER_PERCENT, 90);
        assert_eq!(high_water(1000), 900);
        assert_eq!(high_water(1009), 908);
        assert_eq!(high_water(0), 0);
        // No overflow at the top of the range.
        assert_eq!(high_water(u64::MAX), 16_602_069_666_338_596_453);
    }

    #[test]
    fn a_job_is_admitted_up_to_the_mark_and_not_one_byte_beyond() {
        let budget = 1000; // mark 900
        assert!(admits(600, 200, 100, budget));
        assert!(!admits(600, 200, 101, budget));
        assert!(!admits(601, 200, 100, budget));
        assert!(!admits(600, 201, 100, budget));
        // Over the mark already, nothing is admitted; with no budget, everything is.
        assert!(!admits(950, 0, 1, budget));
        assert!(admits(u64::MAX, u64::MAX, u64::MAX, 0));
        // Saturating sums never wrap into an admission.
        assert!(!admits(u64::MAX, 1, 1, u64::MAX));
    }
}
