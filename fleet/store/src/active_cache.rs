//! What this replica knows of its users' active sets, kept current by a watch of `<prefix>_active`: admission
//! (and every other edit of a set) starts its compare-and-set from the cached value and revision instead of
//! reading the key first — one JetStream round trip less per `invokeAsync` while the cache is current.
//!
//! Invariants:
//! * the cache is only a guess: every write still goes through the key's revision check, so a stale entry costs
//!   one refused write (then the key is read, as without a cache) and never a lost update; a decision that writes
//!   nothing (a quota found full) taken on a cached value is always checked against the leader's copy;
//! * it is consulted only while its watch runs ([`Store::watch_active_sets`]; [`Store::active_sets_watched`] waits
//!   for that); the watch's end or failure empties it, and a new watch starts from empty (no history: a set is
//!   learnt at its first write after the watch started);
//! * an entry only moves forward: a value older than the one held (by revision) is ignored, whoever brings it
//!   (the watch, or this replica's own write);
//! * at most [`MAX_CACHED_SETS`] users are held: past that, only users already held are updated.

use std::collections::HashMap;
use std::sync::Mutex;

use async_nats::jetstream::kv;

use super::active::ActiveSet;
use super::{Revisioned, Store};

/// Users whose active set a replica keeps (each a few hundred bytes: ids of queued and running jobs).
pub const MAX_CACHED_SETS: usize = 100_000;

#[derive(Debug, Default)]
struct State {
    watching: bool,
    sets: HashMap<String, Revisioned<ActiveSet>>,
}

/// See the module documentation.
#[derive(Debug)]
pub(crate) struct ActiveCache {
    state: Mutex<State>,
    /// Mirrors `State::watching` for those who wait for the watch to run ([`Store::active_sets_watched`]).
    watching: tokio::sync::watch::Sender<bool>,
}

impl Default for ActiveCache {
    fn default() -> Self {
        Self {
            state: Mutex::default(),
            watching: tokio::sync::watch::Sender::new(false),
        }
    }
}

impl ActiveCache {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The cached set at `key` (a user key), while the watch runs.
    pub(crate) fn guess(&self, key: &str) -> Option<Revisioned<ActiveSet>> {
        let state = self.state();
        if !state.watching {
            return None;
        }
        state.sets.get(key).cloned()
    }

    /// Keeps `set` for `key` unless what is held is as new or newer.
    pub(crate) fn learn(&self, key: &str, set: &Revisioned<ActiveSet>) {
        let mut state = self.state();
        if !state.watching {
            return;
        }
        let len = state.sets.len();
        match state.sets.get_mut(key) {
            Some(held) if held.revision >= set.revision => {}
            Some(held) => *held = set.clone(),
            None if len < MAX_CACHED_SETS => {
                state.sets.insert(key.to_owned(), set.clone());
            }
            None => {}
        }
    }

    fn forget(&self, key: &str) {
        self.state().sets.remove(key);
    }

    fn reset(&self, watching: bool) {
        let mut state = self.state();
        state.sets.clear();
        state.watching = watching;
        // Under the state's lock: a waiter never sees the flag ahead of the copy it stands for.
        self.watching.send_replace(watching);
    }

    /// One update the watch delivered.
    fn apply(&self, entry: &kv::Entry) {
        match entry.operation {
            kv::Operation::Put => match serde_json::from_slice::<ActiveSet>(&entry.value) {
                Ok(value) => self.learn(
                    &entry.key,
                    &Revisioned {
                        value,
                        revision: entry.revision,
                    },
                ),
                // Not a set this code can read: edits of this key read it (and report it) themselves.
                Err(_) => self.forget(&entry.key),
            },
            kv::Operation::Delete | kv::Operation::Purge => self.forget(&entry.key),
        }
    }

    /// How many users are held (tests, diagnostics).
    pub(crate) fn len(&self) -> usize {
        self.state().sets.len()
    }
}

/// Empties the cache and stops its use when the watch task ends, however it ends.
struct Stopped<'a>(&'a ActiveCache);

impl Drop for Stopped<'_> {
    fn drop(&mut self) {
        self.0.reset(false);
    }
}

impl Store {
    /// Starts keeping this replica's copy of the active sets current (a watch of `<prefix>_active`, restarted
    /// a second later when it fails or ends); admission starts from that copy from then on. For the
    /// replicas that admit jobs (fronts); the task runs until aborted.
    pub fn watch_active_sets(&self) -> tokio::task::JoinHandle<()> {
        let store = self.clone();
        tokio::spawn(async move {
            let cache = &store.inner.active_cache;
            // Aborted (or ended) anywhere, the task leaves no copy behind that nothing keeps current.
            let _stopped = Stopped(cache);
            super::watched::keep_current(
                "active sets",
                || store.inner.active.watch_all(),
                |watching| cache.reset(watching),
                |entry| cache.apply(entry),
            )
            .await;
        })
    }

    /// Resolves once this replica's watch of the active sets runs: every write of a set from then on reaches the
    /// copy (the watch delivers no history, so a write before that is learnt only at the set's next write). Waits
    /// for good while no watch runs ([`watch_active_sets`](Self::watch_active_sets) not called, or its watch
    /// failed and is not yet started again): bound it with the caller's own deadline.
    pub async fn active_sets_watched(&self) {
        let mut watching = self.inner.active_cache.watching.subscribe();
        // The sender lives as long as the store; `Err` (it dropped) cannot happen while `self` is borrowed.
        let _ = watching.wait_for(|w| *w).await;
    }

    /// The active set this replica holds for `user`, with its revision, if any (tests, diagnostics): what the
    /// next edit of the set starts from.
    pub fn cached_active_set(&self, user: &str) -> Option<(Vec<fleet_proto::api::JobId>, u64)> {
        self.inner
            .active_cache
            .guess(&fleet_proto::api::user_key(user))
            .map(|s| (s.value.jobs.into_iter().map(|s| s.job_id).collect(), s.revision))
    }

    /// How many users' active sets this replica holds.
    pub fn cached_active_sets(&self) -> usize {
        self.inner.active_cache.len()
    }
}
