//! What a replica knows of the hot per-user keys that admission edits — the users' active sets
//! (`<prefix>_active`) and their job index heads (`<prefix>_job_index`, the keys `<user_key>`) —, each kept current
//! by a watch of its bucket: an edit starts its compare-and-set from the copy instead of reading the key first,
//! one JetStream request less per `invokeAsync` while the copies are current.
//!
//! Invariants:
//! * a copy is only a guess: every write still goes through the key's revision check, so a stale entry costs one
//!   refused write (then the key is read, as without a copy) and never a lost update; a decision that writes
//!   nothing (a quota found full) taken on a copy is always checked against the leader's copy of the key;
//! * a copy is consulted only while its watch runs ([`Store::watch_active_sets`], [`Store::watch_index_heads`]);
//!   the watch's end or failure empties it, and a new watch starts from empty;
//! * an entry only moves forward: a value older than the one held (by revision) is ignored, whoever brings it
//!   (the watch, or this replica's own write);
//! * a copy holds at most its number of keys and its bytes of stored JSON ([`MAX_CACHED_SETS`],
//!   [`MAX_CACHED_HEADS_BYTES`]); past them, only keys already held are updated.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use async_nats::jetstream::kv;
use futures::StreamExt as _;
use serde::de::DeserializeOwned;

use super::active::ActiveSet;
use super::index::IndexHead;
use super::{Revisioned, Store};

/// Users whose active set a replica keeps (each a few hundred bytes: ids of queued and running jobs).
pub const MAX_CACHED_SETS: usize = 100_000;

/// Bytes of index heads (their stored JSON) a replica keeps: a head is its user's open page, typically 2–3 KiB
/// (32 entries), at most [`JOB_INDEX_MAX_BYTES`](crate::settings::JOB_INDEX_MAX_BYTES); 64 MiB holds the heads
/// of some 25 000 users.
pub const MAX_CACHED_HEADS_BYTES: usize = 64 << 20;

/// The pause before a failed or ended watch is started again.
const WATCH_RETRY: Duration = Duration::from_secs(1);

#[derive(Debug)]
struct State<T> {
    watching: bool,
    /// Each value with the size of its stored JSON.
    values: HashMap<String, (Revisioned<T>, usize)>,
    bytes: usize,
}

impl<T> Default for State<T> {
    fn default() -> Self {
        State {
            watching: false,
            values: HashMap::new(),
            bytes: 0,
        }
    }
}

/// One bucket's copy (see the module documentation).
#[derive(Debug)]
pub(crate) struct KvCopy<T> {
    state: Mutex<State<T>>,
    max_keys: usize,
    max_bytes: usize,
}

impl<T: Clone + DeserializeOwned> KvCopy<T> {
    fn new(max_keys: usize, max_bytes: usize) -> KvCopy<T> {
        KvCopy {
            state: Mutex::new(State::default()),
            max_keys,
            max_bytes,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State<T>> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The copy of `key`, while the watch runs.
    pub(crate) fn guess(&self, key: &str) -> Option<Revisioned<T>> {
        let state = self.state();
        if !state.watching {
            return None;
        }
        state.values.get(key).map(|(v, _)| v.clone())
    }

    /// Keeps `value` (whose stored JSON is `size` bytes) for `key` unless what is held is as new or newer.
    pub(crate) fn learn(&self, key: &str, value: &Revisioned<T>, size: usize) {
        let mut state = self.state();
        if !state.watching {
            return;
        }
        let State { values, bytes, .. } = &mut *state;
        let room = values.len() < self.max_keys && bytes.saturating_add(size) <= self.max_bytes;
        match values.get_mut(key) {
            Some((held, _)) if held.revision >= value.revision => {}
            Some((held, held_size)) => {
                *bytes = bytes.saturating_sub(*held_size).saturating_add(size);
                *held = value.clone();
                *held_size = size;
            }
            None if room => {
                *bytes = bytes.saturating_add(size);
                values.insert(key.to_owned(), (value.clone(), size));
            }
            None => {}
        }
    }

    fn forget(&self, key: &str) {
        let mut state = self.state();
        if let Some((_, size)) = state.values.remove(key) {
            state.bytes = state.bytes.saturating_sub(size);
        }
    }

    fn reset(&self, watching: bool) {
        let mut state = self.state();
        state.values.clear();
        state.bytes = 0;
        state.watching = watching;
    }

    /// One update the watch delivered.
    fn apply(&self, entry: &kv::Entry) {
        match entry.operation {
            kv::Operation::Put => match serde_json::from_slice::<T>(&entry.value) {
                Ok(value) => self.learn(
                    &entry.key,
                    &Revisioned {
                        value,
                        revision: entry.revision,
                    },
                    entry.value.len(),
                ),
                // Not a value this code can read: edits of this key read it (and report it) themselves.
                Err(_) => self.forget(&entry.key),
            },
            kv::Operation::Delete | kv::Operation::Purge => self.forget(&entry.key),
        }
    }

    /// How many keys and bytes are held (tests, diagnostics).
    pub(crate) fn held(&self) -> (usize, usize) {
        let state = self.state();
        (state.values.len(), state.bytes)
    }

    /// Keeps this copy current from `kv`'s keys matching `keys` until the task is aborted; emptied whenever the
    /// watch is not running.
    fn watch(
        self: &std::sync::Arc<Self>,
        kv: kv::Store,
        keys: &'static str,
        what: &'static str,
    ) -> tokio::task::JoinHandle<()>
    where
        T: Send + Sync + 'static,
    {
        let copy = self.clone();
        tokio::spawn(async move {
            // Aborted (or ended) anywhere, the task leaves no copy behind that nothing keeps current.
            let _stopped = Stopped(&*copy);
            loop {
                match kv.watch(keys).await {
                    Ok(mut watch) => {
                        copy.reset(true);
                        while let Some(entry) = watch.next().await {
                            match entry {
                                Ok(entry) => copy.apply(&entry),
                                Err(e) => {
                                    tracing::warn!(error = %e, what, "a watch of a copy failed; restarting it");
                                    break;
                                }
                            }
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, what, "cannot watch a copy"),
                }
                copy.reset(false);
                tokio::time::sleep(WATCH_RETRY).await;
            }
        })
    }
}

/// The active sets' copy.
pub(crate) fn active_sets() -> KvCopy<ActiveSet> {
    KvCopy::new(MAX_CACHED_SETS, usize::MAX)
}

/// The index heads' copy.
pub(crate) fn index_heads() -> KvCopy<IndexHead> {
    KvCopy::new(usize::MAX, MAX_CACHED_HEADS_BYTES)
}

/// Empties a copy and stops its use when its watch task ends, however it ends.
struct Stopped<'a, T: Clone + DeserializeOwned>(&'a KvCopy<T>);

impl<T: Clone + DeserializeOwned> Drop for Stopped<'_, T> {
    fn drop(&mut self) {
        self.0.reset(false);
    }
}

impl Store {
    /// Starts keeping this replica's copy of the active sets current (a watch of `<prefix>_active`, restarted
    /// after [`WATCH_RETRY`] when it fails or ends); admission starts from that copy from then on. For the
    /// replicas that admit jobs (fronts); the task runs until aborted.
    pub fn watch_active_sets(&self) -> tokio::task::JoinHandle<()> {
        self.inner
            .active_copy
            .watch(self.inner.active.clone(), ">", "active sets")
    }

    /// Starts keeping this replica's copy of the job index heads current (a watch of the `<user_key>` keys of
    /// `<prefix>_job_index`, restarted like [`Store::watch_active_sets`]); a job's index entry is then written
    /// from that copy instead of a read of the head. For the replicas that admit jobs; runs until aborted.
    pub fn watch_index_heads(&self) -> tokio::task::JoinHandle<()> {
        self.inner
            .index_copy
            .watch(self.inner.index.clone(), "*", "job index heads")
    }

    /// The active set this replica holds for `user`, with its revision, if any (tests, diagnostics): what the
    /// next edit of the set starts from.
    pub fn cached_active_set(&self, user: &str) -> Option<(Vec<fleet_proto::api::JobId>, u64)> {
        self.inner
            .active_copy
            .guess(&fleet_proto::api::user_key(user))
            .map(|s| (s.value.jobs.into_iter().map(|s| s.job_id).collect(), s.revision))
    }

    /// How many users' active sets this replica holds.
    pub fn cached_active_sets(&self) -> usize {
        self.inner.active_copy.held().0
    }

    /// The index head this replica holds for `user`: its job ids (oldest first) and revision (tests,
    /// diagnostics).
    pub fn cached_index_head(&self, user: &str) -> Option<(Vec<fleet_proto::api::JobId>, u64)> {
        self.inner
            .index_copy
            .guess(&fleet_proto::api::user_key(user))
            .map(|h| (h.value.open.into_iter().map(|e| e.id).collect(), h.revision))
    }

    /// How many index heads this replica holds, and their bytes.
    pub fn cached_index_heads(&self) -> (usize, usize) {
        self.inner.index_copy.held()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(n: u64, revision: u64) -> Revisioned<u64> {
        Revisioned { value: n, revision }
    }

    #[test]
    fn a_copy_is_consulted_only_while_its_watch_runs() {
        let copy: KvCopy<u64> = KvCopy::new(10, 100);
        copy.learn("k", &v(1, 1), 1);
        assert_eq!(copy.guess("k"), None, "nothing is kept before the watch runs");
        copy.reset(true);
        copy.learn("k", &v(1, 1), 1);
        assert_eq!(copy.guess("k"), Some(v(1, 1)));
        copy.reset(false);
        assert_eq!((copy.guess("k"), copy.held()), (None, (0, 0)));
    }

    #[test]
    fn an_entry_only_moves_forward_by_revision() {
        let copy: KvCopy<u64> = KvCopy::new(10, 100);
        copy.reset(true);
        copy.learn("k", &v(2, 5), 1);
        copy.learn("k", &v(1, 4), 1);
        copy.learn("k", &v(3, 5), 1);
        assert_eq!(
            copy.guess("k"),
            Some(v(2, 5)),
            "an older or equal revision is ignored"
        );
        copy.learn("k", &v(4, 6), 1);
        assert_eq!(copy.guess("k"), Some(v(4, 6)));
        copy.forget("k");
        assert_eq!((copy.guess("k"), copy.held()), (None, (0, 0)));
    }

    #[test]
    fn past_its_bounds_a_copy_only_updates_the_keys_it_holds() {
        // Bytes: 10 at most.
        let copy: KvCopy<u64> = KvCopy::new(10, 10);
        copy.reset(true);
        copy.learn("a", &v(1, 1), 6);
        copy.learn("b", &v(1, 1), 6);
        assert_eq!((copy.guess("b"), copy.held()), (None, (1, 6)));
        copy.learn("a", &v(2, 2), 9);
        assert_eq!((copy.guess("a"), copy.held()), (Some(v(2, 2)), (1, 9)));
        copy.learn("b", &v(1, 1), 1);
        assert_eq!(copy.held(), (2, 10), "exactly at the bound");
        // Keys: 2 at most.
        let copy: KvCopy<u64> = KvCopy::new(2, usize::MAX);
        copy.reset(true);
        for k in ["a", "b", "c"] {
            copy.learn(k, &v(1, 1), 1);
        }
        assert_eq!((copy.guess("c"), copy.held()), (None, (2, 2)));
    }
}
