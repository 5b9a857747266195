//! Worker membership as the front sees it, pushed rather than polled: a KV watch of the registry
//! (`<prefix>_workers`) applies every registration, refresh and deregistration the moment JetStream stores it.
//!
//! The watch starts before the registry is read, so no change between the read and the first change is missed
//! (a change seen twice is applied twice, harmlessly: the changes are idempotent and in order). A key removed by
//! the bucket's `max_age` produces no change, so every entry also ages out here after the worker TTL without a
//! refresh — the same rule JetStream applies. When the watch breaks (a NATS restart, the bucket deleted), it is
//! set up again and the registry re-read; until the first read and after a break, [`Membership::snapshot`] says
//! it knows nothing (`None`) so callers never mistake "not read" for "no workers".

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use tokio::sync::watch;

use fleet_store::{Store, StoreError, WorkerChange, WorkerInfo};

/// How long to wait before watching again after the watch broke.
const REWATCH_AFTER: Duration = Duration::from_millis(500);

/// The live workers known to this process, kept current by a background watch.
#[derive(Debug)]
pub struct Membership {
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Debug)]
struct Shared {
    /// `None` until the registry was read once.
    members: Mutex<Option<HashMap<String, (WorkerInfo, Instant)>>>,
    /// Bumped on every applied change.
    version: watch::Sender<u64>,
    /// An entry not refreshed for this long is dead (the registry bucket's `max_age`).
    ttl: Duration,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<HashMap<String, (WorkerInfo, Instant)>>> {
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
    pub fn snapshot(&self) -> Option<Vec<WorkerInfo>> {
        let guard = self.shared.lock();
        let members = guard.as_ref()?;
        let mut live: Vec<WorkerInfo> = members
            .values()
            .filter(|(_, seen)| seen.elapsed() < self.shared.ttl)
            .map(|(info, _)| info.clone())
            .collect();
        live.sort_by(|a, b| a.id.cmp(&b.id));
        Some(live)
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

async fn run(store: Store, shared: Arc<Shared>) {
    loop {
        if let Err(e) = follow_once(&store, &shared).await {
            tracing::warn!(error = %e, "the worker registry watch broke; watching again");
        }
        // Whatever was known may be stale now: say so until the registry has been read again.
        *shared.lock() = None;
        shared.bump();
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
                (info.id.clone(), (info, seen))
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
                    members.insert(info.id.clone(), (info, Instant::now()));
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
