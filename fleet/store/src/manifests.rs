//! Plugin manifests as described by a worker (`<prefix>_manifests`, key = [`user_key`] of the tool id, i.e. a
//! fixed-length hash, since tool ids may hold characters keys forbid), for `tools.list` on any front replica.
//!
//! A front keeps a copy of every manifest, current by a watch of the bucket ([`Store::watch_manifests`]), so
//! `tools.list` costs one look at the bucket's last sequence instead of a scan (an ephemeral consumer, its
//! messages, its deletion) per call. Invariants:
//! * the copy answers only when it has applied every write up to the bucket's last sequence as read for this
//!   call: a manifest whose put was acknowledged before the call is in the answer, as with a scan;
//! * otherwise — the watch not running, behind, or past [`MAX_COPIED_MANIFESTS`] — the call scans;
//! * the watch's end or failure empties the copy.

use std::collections::BTreeMap;
use std::sync::Mutex;

use async_nats::jetstream::consumer::DeliverPolicy;
use async_nats::jetstream::kv;
use fleet_proto::executa::manifest::Manifest;
use serde::{Deserialize, Serialize};

use super::scan::{Scan, scan};
use super::settings::MANIFEST_MAX_BYTES;
use fleet_proto::api::user_key;

use super::{Op, Store, StoreError, encode, is_kv_marker, read_settled};

/// The value: the real tool id and its manifest.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct ManifestEntry {
    tool_id: String,
    manifest: Manifest,
}

/// Manifests a front copies; past it, `tools.list` scans the bucket.
pub(crate) const MAX_COPIED_MANIFESTS: usize = 10_000;

#[derive(Debug, Default)]
struct CopyState {
    watching: bool,
    /// The newest stream sequence the watch delivered.
    applied: u64,
    /// More keys than [`MAX_COPIED_MANIFESTS`] were seen: the copy is incomplete.
    overflowed: bool,
    /// By key: the tool id and its manifest.
    entries: BTreeMap<String, (String, Manifest)>,
}

/// See the module documentation.
#[derive(Debug, Default)]
pub(crate) struct ManifestCopy {
    state: Mutex<CopyState>,
    /// Calls of [`Store::manifests`] answered by a scan (tests, diagnostics).
    scans: std::sync::atomic::AtomicU64,
}

impl ManifestCopy {
    fn state(&self) -> std::sync::MutexGuard<'_, CopyState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn reset(&self, watching: bool) {
        let mut state = self.state();
        *state = CopyState {
            watching,
            ..CopyState::default()
        };
    }

    fn watching(&self) -> bool {
        self.state().watching
    }

    /// One entry the watch delivered.
    fn apply(&self, entry: &kv::Entry) {
        let mut state = self.state();
        state.applied = state.applied.max(entry.revision);
        match entry.operation {
            kv::Operation::Put => match serde_json::from_slice::<ManifestEntry>(&entry.value) {
                Ok(e) => {
                    if state.entries.len() >= MAX_COPIED_MANIFESTS && !state.entries.contains_key(&entry.key)
                    {
                        state.overflowed = true;
                    } else {
                        state.entries.insert(entry.key.clone(), (e.tool_id, e.manifest));
                    }
                }
                // Skipped as a scan skips it (which logs it).
                Err(_) => {
                    state.entries.remove(&entry.key);
                }
            },
            kv::Operation::Delete | kv::Operation::Purge => {
                state.entries.remove(&entry.key);
            }
        }
    }

    /// Every manifest by tool id, if the copy is complete up to stream sequence `last`.
    fn current(&self, last: u64) -> Option<Vec<(String, Manifest)>> {
        let state = self.state();
        if !state.watching || state.overflowed || state.applied < last {
            return None;
        }
        let mut out: Vec<(String, Manifest)> = state.entries.values().cloned().collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Some(out)
    }
}

/// Empties the copy when the watch task ends, however it ends.
struct Unwatched<'a>(&'a ManifestCopy);

impl Drop for Unwatched<'_> {
    fn drop(&mut self) {
        self.0.reset(false);
    }
}

impl Store {
    /// Starts keeping this replica's copy of the manifests current (a watch of `<prefix>_manifests` with its
    /// history, restarted a second later when it fails or ends); [`manifests`](Self::manifests) answers from
    /// it from then on while it is complete. For the replicas that answer `tools.list` (fronts); the task runs
    /// until aborted.
    pub fn watch_manifests(&self) -> tokio::task::JoinHandle<()> {
        let store = self.clone();
        tokio::spawn(async move {
            let copy = &store.inner.manifest_copy;
            let _unwatched = Unwatched(copy);
            super::watched::keep_current(
                "manifests",
                || store.inner.manifests.watch_with_history(">"),
                |watching| copy.reset(watching),
                |entry| copy.apply(entry),
            )
            .await;
        })
    }

    /// Whether [`manifests`](Self::manifests) can answer from this replica's copy now (tests, diagnostics): the
    /// watch runs and has applied every write the bucket holds.
    pub async fn manifests_copied(&self) -> bool {
        matches!(self.copied_manifests().await, Ok(Some(_)))
    }

    /// Every manifest from this replica's copy, if its watch runs and it holds every write up to the bucket's last
    /// sequence (read now: one request).
    async fn copied_manifests(&self) -> Result<Option<Vec<(String, Manifest)>>, StoreError> {
        if !self.inner.manifest_copy.watching() {
            return Ok(None);
        }
        let info = self
            .inner
            .manifests
            .stream
            .get_info()
            .await
            .map_err(|e| StoreError::nats(Op::ListManifests, e))?;
        Ok(self.inner.manifest_copy.current(info.state.last_sequence))
    }

    /// How many calls of [`manifests`](Self::manifests) this replica answered by a scan of the bucket (tests,
    /// diagnostics).
    pub fn manifest_scans(&self) -> u64 {
        self.inner
            .manifest_copy
            .scans
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Records (or replaces) the manifest of an installed tool id.
    pub async fn put_manifest(&self, tool_id: &str, manifest: &Manifest) -> Result<(), StoreError> {
        let entry = ManifestEntry {
            tool_id: tool_id.to_string(),
            manifest: manifest.clone(),
        };
        let bytes = encode(&entry, ("manifest", MANIFEST_MAX_BYTES), Op::PutManifest)?;
        let manifests = &self.inner.manifests;
        manifests
            .put(user_key(tool_id), bytes)
            .await
            .map_err(|e| StoreError::nats(Op::PutManifest, e))?;
        Ok(())
    }

    /// Forgets the manifest of a tool id that is no longer installed (a removed published plugin), so `tools.list`
    /// stops listing it. Idempotent.
    pub async fn delete_manifest(&self, tool_id: &str) -> Result<(), StoreError> {
        self.inner
            .manifests
            .delete(user_key(tool_id))
            .await
            .map_err(|e| StoreError::nats(Op::DeleteManifest, e))
    }

    /// The recorded manifest of a tool id, if any.
    pub async fn manifest(&self, tool_id: &str) -> Result<Option<Manifest>, StoreError> {
        let entry =
            read_settled::<ManifestEntry>(&self.inner.manifests, &user_key(tool_id), Op::GetManifest).await?;
        Ok(entry
            .map(|e| e.value)
            .filter(|e| e.tool_id == tool_id)
            .map(|e| e.manifest))
    }

    /// Every recorded manifest, by tool id. Entries that do not parse are skipped (and logged). From this replica's
    /// copy when it is complete up to the bucket's last sequence (one request), else by a scan of the bucket.
    pub async fn manifests(&self) -> Result<Vec<(String, Manifest)>, StoreError> {
        let manifests = &self.inner.manifests;
        if let Some(copied) = self.copied_manifests().await? {
            return Ok(copied);
        }
        self.inner
            .manifest_copy
            .scans
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let messages = scan(
            &manifests.stream,
            Scan {
                filter: format!("{}>", manifests.prefix),
                deliver: DeliverPolicy::LastPerSubject,
                headers_only: false,
                max: usize::MAX,
            },
        )
        .await
        .map_err(|e| StoreError::nats(Op::ListManifests, e))?;
        let mut out: Vec<(String, Manifest)> = messages
            .iter()
            .filter(|m| !is_kv_marker(&m.message))
            .filter_map(|m| match serde_json::from_slice::<ManifestEntry>(&m.message.payload) {
                Ok(e) => Some((e.tool_id, e.manifest)),
                Err(e) => {
                    tracing::warn!(subject = %m.message.subject, error = %e, "skipping a manifest that does not parse");
                    None
                }
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }
}
