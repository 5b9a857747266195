//! Worker membership as the front sees it, pushed rather than polled: a KV watch of the registry
//! (`<prefix>_workers`) applies every registration, refresh and deregistration the moment JetStream stores it.
//!
//! The watch starts before the registry is read, so no change between the read and the first change is missed
//! (a change seen twice is applied twice, harmlessly: the changes are idempotent and in order). A key removed by
//! the bucket's `max_age` produces no change, so every entry also ages out here after the worker TTL without a
//! refresh — the same rule JetStream applies, on the registry's clock (see [`Membership::snapshot`]: a registry
//! that stores nothing for a while stops the ageing). When the watch breaks (a NATS restart, the stream electing a
//! leader, the bucket deleted), it is set up again and the registry re-read, the last membership serving
//! meanwhile; until the first read, [`Membership::snapshot`] says it knows nothing (`None`) so callers never
//! mistake "not read" for "no workers".

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use tokio::sync::watch;

use fleet_store::{Store, StoreError, WorkerChange, WorkerInfo};

use crate::policy;

/// How long to wait before watching again after the watch broke.
const REWATCH_AFTER: Duration = Duration::from_millis(500);

/// The registry's entries by worker id, each with when it was last seen refreshed.
type Members = HashMap<String, (Arc<WorkerInfo>, Instant)>;

/// The live workers known to this process, kept current by a background watch.
#[derive(Debug)]
pub struct Membership {
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Debug)]
struct Shared {
    /// `None` until the registry was read once. Entries are shared, not copied, with every snapshot: an entry
    /// lists up to 256 warm sessions, and a snapshot is taken at every dispatch.
    members: Mutex<Option<Members>>,
    /// Bumped on every applied change.
    version: watch::Sender<u64>,
    /// An entry not refreshed for this long is dead (the registry bucket's `max_age`).
    ttl: Duration,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Members>> {
        fleet_proto::util::lock(&self.members)
    }

    fn bump(&self) {
        self.version.send_modify(|v| *v = v.wrapping_add(1));
    }
}

impl Membership {
    /// Follows the registry of `store` from now on (spawns the watch on the current tokio runtime).
    pub fn follow(store: Store) -> Membership {
        let shared = Arc::new(Shared {
            members: Mutex::new(None),
            version: watch::channel(0).0,
            ttl: store.settings().worker_ttl,
        });
        let task = tokio::spawn(run(store, shared.clone()));
        Membership { shared, task }
    }

    /// The live workers sorted by id, or `None` while the registry has not been read yet.
    ///
    /// An entry is live until the worker TTL after its last refresh, on the registry's clock: while the registry
    /// stores refreshes that is now; once no worker's refresh has arrived for [`policy::REGISTRY_QUIET`], it is
    /// the newest refresh seen, so a registry that cannot store (its stream electing a leader) does not empty the
    /// membership, and entries age again from the first refresh it stores.
    pub fn snapshot(&self) -> Option<Vec<Arc<WorkerInfo>>> {
        let guard = self.shared.lock();
        Some(live_at(guard.as_ref()?, Instant::now(), self.shared.ttl))
    }

    /// The exec-seal session key in the entry of worker `id` (live or not: a grant for a worker that left is
    /// harmless), `None` when it has none or is unknown.
    pub fn seal_key(&self, id: &str) -> Option<String> {
        self.shared.lock().as_ref()?.get(id)?.0.seal_key.clone()
    }

    /// A receiver that wakes on every change applied from now on.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.shared.version.subscribe()
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The entries of `members` live at `now` (sorted by id): refreshed less than `ttl` before the registry's clock —
/// `now`, or the newest refresh once none arrived for [`policy::REGISTRY_QUIET`].
fn live_at(members: &Members, now: Instant, ttl: Duration) -> Vec<Arc<WorkerInfo>> {
    let newest = members.values().map(|(_, seen)| *seen).max().unwrap_or(now);
    let clock = if now.saturating_duration_since(newest) > policy::REGISTRY_QUIET {
        newest
    } else {
        now
    };
    let mut live: Vec<Arc<WorkerInfo>> = members
        .values()
        .filter(|(_, seen)| clock.saturating_duration_since(*seen) < ttl)
        .map(|(info, _)| info.clone())
        .collect();
    live.sort_by(|a, b| a.id.cmp(&b.id));
    live
}

async fn run(store: Store, shared: Arc<Shared>) {
    loop {
        if let Err(e) = follow_once(&store, &shared).await {
            tracing::warn!(error = %e, "the worker registry watch broke; watching again");
        }
        // What was known stays until the registry is read again: the watch breaks when its stream loses its
        // leader (a NATS node died), which is when workers keep running and only the registry is unavailable;
        // no refresh arrives meanwhile, so the entries stop ageing (`snapshot`), and a worker that did go away
        // costs a call one "no responders" round trip.
        tokio::time::sleep(REWATCH_AFTER).await;
    }
}

/// Watches, reads the registry, then applies changes until the watch ends or fails.
async fn follow_once(store: &Store, shared: &Shared) -> Result<(), StoreError> {
    let mut changes = store.watch_workers().await?;
    let listed = store.live_workers_aged().await?;
    let now = Instant::now();
    {
        let members = listed
            .into_iter()
            .map(|(info, age)| {
                let seen = now.checked_sub(age).unwrap_or(now);
                (info.id.clone(), (Arc::new(info), seen))
            })
            .collect();
        *shared.lock() = Some(members);
    }
    shared.bump();
    while let Some(change) = changes.next().await {
        let change = change?;
        {
            let mut guard = shared.lock();
            let members = guard.get_or_insert_with(HashMap::new);
            match change {
                WorkerChange::Up(info) => {
                    members.insert(info.id.clone(), (Arc::new(info), Instant::now()));
                }
                WorkerChange::Down(id) => {
                    members.remove(&id);
                }
            }
        }
        shared.bump();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(10);

    fn members(seen: &[(&str, Instant)]) -> Members {
        seen.iter()
            .map(|(id, at)| {
                let info = WorkerInfo {
                    id: (*id).to_owned(),
                    capacity_long_jobs: 1,
                    long_jobs_running: 0,
                    sessions_warm: Vec::new(),
                    started_at_ms: 0,
                    seal_key: None,
                };
                ((*id).to_owned(), (Arc::new(info), *at))
            })
            .collect()
    }

    fn ids(live: &[Arc<WorkerInfo>]) -> Vec<&str> {
        live.iter().map(|w| w.id.as_str()).collect()
    }

    #[test]
    fn while_the_registry_stores_refreshes_an_entry_lives_until_the_ttl_after_its_last() {
        let t0 = Instant::now();
        let now = t0 + TTL + Duration::from_secs(1);
        // "b" refreshed just now: the registry stores; "a" is exactly at, then past, the TTL.
        let m = members(&[("a", t0 + Duration::from_secs(1)), ("b", now)]);
        assert_eq!(ids(&live_at(&m, now - Duration::from_millis(1), TTL)), ["a", "b"]);
        assert_eq!(ids(&live_at(&m, now, TTL)), ["b"]);
    }

    #[test]
    fn a_registry_quiet_for_longer_than_registry_quiet_stops_the_ageing() {
        let t0 = Instant::now();
        // Every entry's last refresh is older than REGISTRY_QUIET: nothing is stored (a stream electing its
        // leader); both stay, however long the silence lasts, as long as they were live at the newest refresh.
        let m = members(&[("a", t0), ("b", t0 + Duration::from_secs(2))]);
        let later = t0 + policy::REGISTRY_QUIET + TTL * 3;
        assert_eq!(ids(&live_at(&m, later, TTL)), ["a", "b"]);
        // An entry already dead at the newest refresh stays dead.
        let m = members(&[("a", t0), ("b", t0 + TTL)]);
        assert_eq!(ids(&live_at(&m, later + TTL, TTL)), ["b"]);
        // At REGISTRY_QUIET exactly the registry still counts as storing (its clock is now).
        let m = members(&[("a", t0), ("b", t0 + TTL - policy::REGISTRY_QUIET)]);
        assert_eq!(ids(&live_at(&m, t0 + TTL, TTL)), ["b"]);
    }
}
