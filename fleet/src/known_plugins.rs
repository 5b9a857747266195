//! The plugins a front has recently seen a worker accept a job for, so that `tools.invokeAsync` of one of them
//! answers before the hand-off to a worker (the hand-off runs after the reply; see `front::Front::invoke_async`).
//!
//! Why it is safe: the record and the quota slot are written before the reply whatever happens next, and a job
//! whose hand-off does not happen (this front dies first) stays `queued` with no worker — the sweeper dispatches
//! it at its next pass; a job whose plugin has gone since (removed from every worker) is failed by that hand-off
//! with its terminal `tool_job` event, as if it had been removed a moment after the reply. A plugin not known
//! here is handed off before the reply, so a `tool_id` no worker has is still refused at once with
//! `permission_denied`.
//!
//! Entries live [`KNOWN_PLUGIN_TTL`] from the last accepted hand-off; at most [`KNOWN_PLUGINS_MAX`] are kept (a
//! full table forgets its oldest entry).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a plugin stays known after a worker last accepted a job for it.
pub const KNOWN_PLUGIN_TTL: Duration = Duration::from_secs(60);

/// Plugins a front remembers at most.
pub const KNOWN_PLUGINS_MAX: usize = 4096;

/// The table. One mutex, held only for a map operation.
#[derive(Debug)]
pub struct KnownPlugins {
    seen: Mutex<HashMap<String, Instant>>,
    ttl: Duration,
    max: usize,
}

impl Default for KnownPlugins {
    fn default() -> KnownPlugins {
        KnownPlugins::with_bounds(KNOWN_PLUGIN_TTL, KNOWN_PLUGINS_MAX)
    }
}

impl KnownPlugins {
    /// A table with these bounds.
    pub fn with_bounds(ttl: Duration, max: usize) -> KnownPlugins {
        KnownPlugins {
            seen: Mutex::new(HashMap::new()),
            ttl,
            max,
        }
    }

    /// Records that a worker accepted a job of `plugin` now.
    pub fn accepted(&self, plugin: &str) {
        self.accepted_at(plugin, Instant::now());
    }

    /// Whether a worker accepted a job of `plugin` within the TTL.
    pub fn knows(&self, plugin: &str) -> bool {
        self.knows_at(plugin, Instant::now())
    }

    fn accepted_at(&self, plugin: &str, now: Instant) {
        let mut seen = fleet_proto::util::lock(&self.seen);
        if !seen.contains_key(plugin) && seen.len() >= self.max {
            seen.retain(|_, at| now.saturating_duration_since(*at) < self.ttl);
            if seen.len() >= self.max
                && let Some(oldest) = seen.iter().min_by_key(|(_, at)| **at).map(|(p, _)| p.clone())
            {
                seen.remove(&oldest);
            }
        }
        seen.insert(plugin.to_owned(), now);
    }

    fn knows_at(&self, plugin: &str, now: Instant) -> bool {
        fleet_proto::util::lock(&self.seen)
            .get(plugin)
            .is_some_and(|at| now.saturating_duration_since(*at) < self.ttl)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Known from an accepted hand-off until the TTL has passed since the last one (exclusive), and not before.
    #[test]
    fn a_plugin_is_known_for_the_ttl_after_its_last_accepted_hand_off() {
        let ttl = Duration::from_secs(60);
        let t = KnownPlugins::with_bounds(ttl, 8);
        let t0 = Instant::now();
        assert!(!t.knows_at("echo", t0));
        t.accepted_at("echo", t0);
        assert!(t.knows_at("echo", t0 + ttl - Duration::from_millis(1)));
        assert!(!t.knows_at("echo", t0 + ttl));
        t.accepted_at("echo", t0 + ttl);
        assert!(
            t.knows_at("echo", t0 + ttl + Duration::from_secs(1)),
            "a new hand-off renews it"
        );
        assert!(!t.knows_at("other", t0));
    }

    /// A full table makes room by dropping expired entries first, then the oldest.
    #[test]
    fn a_full_table_forgets_expired_entries_then_the_oldest() {
        let ttl = Duration::from_secs(60);
        let t = KnownPlugins::with_bounds(ttl, 2);
        let t0 = Instant::now();
        t.accepted_at("a", t0);
        t.accepted_at("b", t0 + Duration::from_secs(1));
        t.accepted_at("c", t0 + Duration::from_secs(2));
        let now = t0 + Duration::from_secs(3);
        assert!(!t.knows_at("a", now), "the oldest went");
        assert!(t.knows_at("b", now) && t.knows_at("c", now));
        t.accepted_at("d", t0 + ttl + Duration::from_secs(1) + Duration::from_millis(1));
        let later = t0 + ttl + Duration::from_millis(1500);
        assert!(!t.knows_at("b", later), "expired: dropped to make room");
        assert!(t.knows_at("c", later) && t.knows_at("d", later));
        assert_eq!(fleet_proto::util::lock(&t.seen).len(), 2);
    }
}
