//! The daily image quota (spec §8.6 `-32102`): the images each user got in any rolling 24 h, all plugins and
//! grants together, kept in the JetStream KV bucket `<prefix>_image_usage` so that every worker counts the same
//! images. One record per user: the images of each minute of the last 24 h (an image counts until 24 h after
//! the minute it was reserved in). Reservations and refunds are compare-and-set edits, exact under concurrency.

use async_nats::jetstream::{self, kv};
use fleet_proto::api::user_key;
use fleet_proto::limits;
use fleet_proto::util::now_ms;
use fleet_store::cas::{Edit, Target, compare_and_set};
use fleet_store::settings::IMAGE_USAGE_MAX_BYTES;
use fleet_store::{Op, Revisioned, StoreError, StoreSettings};
use serde::{Deserialize, Serialize};

use crate::ServicesError;

const MINUTE_MS: u64 = 60_000;

/// Why a reservation failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum QuotaError {
    /// The reservation would take the user over the cap.
    #[error("{used} of {cap} images used in the last 24 h; {asked} more would exceed the daily quota")]
    Exhausted {
        /// Images of the last 24 h.
        used: u64,
        /// The cap.
        cap: u64,
        /// Images asked for.
        asked: u64,
    },
    /// The bucket.
    #[error("image quota store: {0}")]
    Store(String),
}

impl From<StoreError> for QuotaError {
    fn from(e: StoreError) -> Self {
        QuotaError::Store(e.to_string())
    }
}

/// One user's images per minute (`[minute since the epoch, images]`, oldest first).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Usage {
    #[serde(default)]
    minutes: Vec<(u64, u64)>,
}

impl Usage {
    /// Drops the minutes older than the window (as of minute `now`).
    fn prune(&mut self, now: u64) {
        let window = u64::try_from(limits::IMAGE_QUOTA_WINDOW.as_millis()).unwrap_or(u64::MAX) / MINUTE_MS;
        self.minutes.retain(|(m, _)| m.saturating_add(window) > now);
    }

    fn used(&self) -> u64 {
        self.minutes.iter().map(|(_, n)| *n).sum()
    }
}

/// A reservation: the minute it was counted in and how many images.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Reserved {
    minute: u64,
    images: u64,
    /// Images of the last 24 h, this reservation included.
    pub(crate) used: u64,
}

impl Reserved {
    /// Images reserved.
    pub(crate) fn images(&self) -> u64 {
        self.images
    }
}

/// The quota bucket.
#[derive(Debug, Clone)]
pub(crate) struct DailyQuota {
    kv: kv::Store,
}

impl DailyQuota {
    /// Opens (or creates) `<prefix>_image_usage`.
    pub(crate) async fn open(
        js: &jetstream::Context,
        settings: &StoreSettings,
    ) -> Result<DailyQuota, ServicesError> {
        let config = settings.image_usage_kv_config();
        let bucket = config.bucket.clone();
        let kv = Box::pin(fleet_store::provision::key_value(js, config, settings.provision))
            .await
            .map_err(|e| ServicesError::Store(format!("{bucket}: {e}")))?;
        Ok(DailyQuota { kv })
    }

    fn target<'a>(&'a self, key: &'a str) -> Target<'a> {
        Target {
            kv: &self.kv,
            key,
            op: Op::ImageQuota,
            limit: ("image usage", IMAGE_USAGE_MAX_BYTES),
        }
    }

    /// Counts `images` for `user` unless that takes the last 24 h over `cap`.
    pub(crate) async fn reserve(&self, user: &str, images: u64, cap: u64) -> Result<Reserved, QuotaError> {
        let key = user_key(user);
        let minute = now_ms() / MINUTE_MS;
        let committed = compare_and_set(self.target(&key), None, |current: Option<Revisioned<Usage>>| {
            let mut usage = current.map(|r| r.value).unwrap_or_default();
            usage.prune(minute);
            let used = usage.used();
            if used.saturating_add(images) > cap {
                return Err(QuotaError::Exhausted {
                    used,
                    cap,
                    asked: images,
                });
            }
            match usage.minutes.last_mut() {
                Some((m, n)) if *m == minute => *n += images,
                _ => usage.minutes.push((minute, images)),
            }
            Ok(Edit::Write(usage, used + images))
        })
        .await?;
        Ok(Reserved {
            minute,
            images,
            used: committed.out,
        })
    }

    /// Images `user` got in the last 24 h.
    pub(crate) async fn used(&self, user: &str) -> Result<u64, QuotaError> {
        let found = fleet_store::read::<Usage>(&self.kv, &user_key(user), Op::ImageQuota).await?;
        let mut usage = found.map(|r| r.value).unwrap_or_default();
        usage.prune(now_ms() / MINUTE_MS);
        Ok(usage.used())
    }

    /// Gives back `reserved`, or `keep` of its images kept (a call that produced fewer images than reserved).
    pub(crate) async fn refund(&self, user: &str, reserved: Reserved, keep: u64) {
        let give_back = reserved.images.saturating_sub(keep);
        if give_back == 0 {
            return;
        }
        let key = user_key(user);
        let result = compare_and_set(self.target(&key), None, |current: Option<Revisioned<Usage>>| {
            let Some(mut usage) = current.map(|r| r.value) else {
                return Ok::<_, QuotaError>(Edit::Keep(()));
            };
            let Some(slot) = usage.minutes.iter_mut().find(|(m, _)| *m == reserved.minute) else {
                return Ok(Edit::Keep(()));
            };
            slot.1 = slot.1.saturating_sub(give_back);
            usage.minutes.retain(|(_, n)| *n > 0);
            Ok(Edit::Write(usage, ()))
        })
        .await;
        if let Err(e) = result {
            // The images stay counted until the window passes: the user loses quota, never gains it.
            tracing::warn!(error = %e, "image quota refund failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minutes_leave_the_window_after_24_hours() {
        let mut u = Usage {
            minutes: vec![(0, 3), (1, 2), (1439, 1), (1440, 4)],
        };
        u.prune(1440);
        assert_eq!(u.minutes, vec![(1, 2), (1439, 1), (1440, 4)]);
        assert_eq!(u.used(), 7);
        u.prune(1441);
        assert_eq!(u.used(), 5);
    }
}
