//! The per-user daily-usage counter of the metered families (`image/*`'s images, `web/*`'s compute units,
//! `llm.*`'s tokens): one
//! record per (family, user) in the JetStream KV bucket `<prefix>_usage` (key `<family>.<user_key>`), so that
//! every worker counts against the same pool. A record holds the units of each slot of the family's window
//! (`image`: each minute of a rolling 24 h; `web`: the current UTC day, one slot); slots that left the window
//! count nothing and are dropped at the next write. Reservations and refunds are compare-and-set edits
//! ([`fleet_store::cas`]), exact under concurrent calls on any number of workers.

use async_nats::jetstream::{self, kv};
use fleet_proto::api::user_key;
use fleet_proto::util::now_ms;
use fleet_store::cas::{Edit, Target, compare_and_set};
use fleet_store::settings::USAGE_MAX_BYTES;
use fleet_store::{Op, Revisioned, StoreError, StoreSettings};
use serde::{Deserialize, Serialize};

use crate::ServicesError;

const MINUTE_MS: u64 = 60_000;
const DAY_MS: u64 = 86_400_000;
/// Minutes of a day.
const MINUTES_PER_DAY: u64 = DAY_MS / MINUTE_MS;

/// A metered family: its key prefix and its window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Family {
    /// The key prefix (`image`, `web`).
    pub name: &'static str,
    /// The length of one slot, ms.
    slot_ms: u64,
    /// Slots in the window (the current one included).
    window_slots: u64,
}

/// `image/*`: images of any rolling 24 h, counted per minute (spec §8.6 `-32102`).
pub const IMAGE: Family = Family {
    name: "image",
    slot_ms: MINUTE_MS,
    window_slots: MINUTES_PER_DAY,
};

/// `web/*`: compute units of the current UTC day (spec §8.9 `-32522`).
pub const WEB: Family = Family {
    name: "web",
    slot_ms: DAY_MS,
    window_slots: 1,
};

/// `llm.*` (`sampling/createMessage`, `agent/complete`, agent session steps): tokens of the current UTC day.
pub const LLM: Family = Family {
    name: "llm",
    slot_ms: DAY_MS,
    window_slots: 1,
};

impl Family {
    fn slot_now(self) -> u64 {
        now_ms() / self.slot_ms
    }

    fn key(self, user: &str) -> String {
        format!("{}.{}", self.name, user_key(user))
    }
}

/// Why a reservation failed.
#[derive(Debug, thiserror::Error)]
pub enum UsageError {
    /// The reservation would take the user over the cap.
    #[error("{used} of {cap} used in the window; {asked} more would exceed the quota")]
    Exhausted {
        /// Units used in the window.
        used: u64,
        /// The cap.
        cap: u64,
        /// Units asked for.
        asked: u64,
    },
    /// The bucket.
    #[error("usage store: {0}")]
    Store(String),
}

impl From<StoreError> for UsageError {
    fn from(e: StoreError) -> Self {
        UsageError::Store(e.to_string())
    }
}

/// One user's units per slot (`[slot, units]`, oldest first).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Usage {
    #[serde(default)]
    slots: Vec<(u64, u64)>,
}

impl Usage {
    /// Drops the slots that left `family`'s window (as of slot `now`).
    fn prune(&mut self, family: Family, now: u64) {
        self.slots
            .retain(|(s, _)| s.saturating_add(family.window_slots) > now);
    }

    fn used(&self) -> u64 {
        self.slots.iter().map(|(_, n)| *n).sum()
    }
}

/// A reservation: its family, the slot it was counted in and how many units.
#[derive(Debug, Clone, Copy)]
pub struct Reserved {
    family: Family,
    slot: u64,
    units: u64,
    /// Units of the window, this reservation included.
    pub used: u64,
}

impl Reserved {
    /// Units reserved.
    pub fn units(&self) -> u64 {
        self.units
    }
}

/// The usage bucket (cheap to clone).
#[derive(Debug, Clone)]
pub struct UsageCounter {
    kv: kv::Store,
}

impl UsageCounter {
    /// Opens (or creates, as `settings.provision` says) `<prefix>_usage`.
    pub async fn open(
        js: &jetstream::Context,
        settings: &StoreSettings,
    ) -> Result<UsageCounter, ServicesError> {
        let config = settings.usage_kv_config();
        let bucket = config.bucket.clone();
        let kv = Box::pin(fleet_store::provision::key_value(js, config, settings.provision))
            .await
            .map_err(|e| ServicesError::Store(format!("{bucket}: {e}")))?;
        Ok(UsageCounter { kv })
    }

    fn target<'a>(&'a self, key: &'a str) -> Target<'a> {
        Target {
            kv: &self.kv,
            key,
            op: Op::Usage,
            limit: ("daily usage", USAGE_MAX_BYTES),
        }
    }

    /// Counts `units` of `family` for `user` unless that takes the window over `cap`.
    pub async fn reserve(
        &self,
        family: Family,
        user: &str,
        units: u64,
        cap: u64,
    ) -> Result<Reserved, UsageError> {
        let key = family.key(user);
        let slot = family.slot_now();
        let committed = compare_and_set(self.target(&key), None, |current: Option<Revisioned<Usage>>| {
            let mut usage = current.map(|r| r.value).unwrap_or_default();
            usage.prune(family, slot);
            let used = usage.used();
            if used.saturating_add(units) > cap {
                return Err(UsageError::Exhausted {
                    used,
                    cap,
                    asked: units,
                });
            }
            match usage.slots.last_mut() {
                Some((s, n)) if *s == slot => *n += units,
                _ => usage.slots.push((slot, units)),
            }
            Ok(Edit::Write(usage, used + units))
        })
        .await?;
        Ok(Reserved {
            family,
            slot,
            units,
            used: committed.out,
        })
    }

    /// Units of `family` `user` used in the window.
    pub async fn used(&self, family: Family, user: &str) -> Result<u64, UsageError> {
        let found = fleet_store::read::<Usage>(&self.kv, &family.key(user), Op::Usage).await?;
        let mut usage = found.map(|r| r.value).unwrap_or_default();
        usage.prune(family, family.slot_now());
        Ok(usage.used())
    }

    /// Gives back `reserved`, but `keep` of its units (a call that used less than it reserved).
    pub async fn refund(&self, user: &str, reserved: Reserved, keep: u64) {
        let give_back = reserved.units.saturating_sub(keep);
        if give_back == 0 {
            return;
        }
        let key = reserved.family.key(user);
        let result = compare_and_set(self.target(&key), None, |current: Option<Revisioned<Usage>>| {
            let Some(mut usage) = current.map(|r| r.value) else {
                return Ok::<_, UsageError>(Edit::Keep(()));
            };
            let Some(slot) = usage.slots.iter_mut().find(|(s, _)| *s == reserved.slot) else {
                return Ok(Edit::Keep(()));
            };
            slot.1 = slot.1.saturating_sub(give_back);
            usage.slots.retain(|(_, n)| *n > 0);
            Ok(Edit::Write(usage, ()))
        })
        .await;
        if let Err(e) = result {
            // The units stay counted until the window passes: the user loses quota, never gains it.
            tracing::warn!(family = reserved.family.name, error = %e, "usage refund failed");
        }
    }

    /// Settles `reserved` at `spent` units: gives back what it did not use, or counts what it used beyond the
    /// reservation whatever the cap (the spend happened; the next reservation sees it).
    pub async fn settle(&self, user: &str, reserved: Reserved, spent: u64) {
        let Some(extra) = spent.checked_sub(reserved.units).filter(|n| *n > 0) else {
            return self.refund(user, reserved, spent).await;
        };
        let key = reserved.family.key(user);
        let result = compare_and_set(self.target(&key), None, |current: Option<Revisioned<Usage>>| {
            let mut usage = current.map(|r| r.value).unwrap_or_default();
            usage.prune(reserved.family, reserved.family.slot_now());
            match usage.slots.iter_mut().find(|(s, _)| *s == reserved.slot) {
                Some((_, n)) => *n = n.saturating_add(extra),
                // The reservation's slot left the window meanwhile: nothing of it counts any more.
                None => return Ok::<_, UsageError>(Edit::Keep(())),
            }
            Ok(Edit::Write(usage, ()))
        })
        .await;
        if let Err(e) = result {
            tracing::warn!(family = reserved.family.name, error = %e, "usage settlement failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minutes_leave_the_image_window_after_24_hours() {
        let mut u = Usage {
            slots: vec![(0, 3), (1, 2), (1439, 1), (1440, 4)],
        };
        u.prune(IMAGE, 1440);
        assert_eq!(u.slots, vec![(1, 2), (1439, 1), (1440, 4)]);
        assert_eq!(u.used(), 7);
        u.prune(IMAGE, 1441);
        assert_eq!(u.used(), 5);
    }

    #[test]
    fn the_web_window_is_the_current_utc_day() {
        let mut u = Usage {
            slots: vec![(19_999, 7), (20_000, 3)],
        };
        u.prune(WEB, 20_000);
        assert_eq!(u.slots, vec![(20_000, 3)]);
        u.prune(WEB, 20_001);
        assert_eq!(u.used(), 0);
    }

    #[test]
    fn families_have_their_own_keys() {
        assert_ne!(IMAGE.key("alice"), WEB.key("alice"));
        assert_ne!(LLM.key("alice"), WEB.key("alice"));
        assert!(WEB.key("alice").starts_with("web."));
    }
}
