//! A count of work in flight that a drain can wait on: the front's API requests, a worker's exec requests.

use std::sync::Arc;

use tokio::sync::watch;

/// Work in flight. Cheap to clone; every clone counts into the same number.
#[derive(Debug, Clone)]
pub struct InFlight(Arc<watch::Sender<usize>>);

impl Default for InFlight {
    fn default() -> Self {
        InFlight(Arc::new(watch::channel(0).0))
    }
}

impl InFlight {
    /// Counts one piece of work for as long as the returned guard lives.
    pub fn enter(&self) -> InFlightGuard {
        self.0.send_modify(|n| *n += 1);
        InFlightGuard(self.clone())
    }

    /// How many are in flight now.
    pub fn current(&self) -> usize {
        *self.0.borrow()
    }

    /// Returns once nothing is in flight.
    pub async fn idle(&self) {
        let mut rx = self.0.subscribe();
        // The sender lives in `self`, so the channel cannot close while we wait.
        let _ = rx.wait_for(|n| *n == 0).await.is_ok();
    }
}

/// One piece of work in flight; dropping it ends it.
#[derive(Debug)]
pub struct InFlightGuard(InFlight);

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.0.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// Work in flight per key (a front's API requests per user), each key capped: what one user can hold of a
/// replica. Keys with nothing in flight take no memory. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct PerKey(Arc<std::sync::Mutex<std::collections::HashMap<String, usize>>>);

impl PerKey {
    /// Counts one piece of work of `key` for as long as the returned guard lives, if `key` has fewer than `cap`
    /// in flight; `None` (nothing counted) at the cap.
    pub fn try_enter(&self, key: &str, cap: usize) -> Option<PerKeyGuard> {
        let mut counts = fleet_proto::util::lock(&self.0);
        let n = counts.entry(key.to_owned()).or_default();
        if *n >= cap {
            if *n == 0 {
                counts.remove(key);
            }
            return None;
        }
        *n += 1;
        Some(PerKeyGuard {
            table: self.clone(),
            key: key.to_owned(),
        })
    }

    /// How many of `key` are in flight now.
    pub fn current(&self, key: &str) -> usize {
        fleet_proto::util::lock(&self.0).get(key).copied().unwrap_or(0)
    }

    /// How many keys have work in flight.
    pub fn keys(&self) -> usize {
        fleet_proto::util::lock(&self.0).len()
    }
}

/// One piece of one key's work in flight; dropping it ends it (and forgets the key at zero).
#[derive(Debug)]
pub struct PerKeyGuard {
    table: PerKey,
    key: String,
}

impl Drop for PerKeyGuard {
    fn drop(&mut self) {
        let mut counts = fleet_proto::util::lock(&self.table.0);
        if let Some(n) = counts.get_mut(&self.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::PerKey;

    #[test]
    fn each_key_is_capped_and_forgotten_at_zero() {
        let table = PerKey::default();
        let held: Vec<_> = (0..3)
            .map(|_| table.try_enter("a", 3).expect("under the cap"))
            .collect();
        assert!(table.try_enter("a", 3).is_none(), "the cap+1-th is refused");
        let b = table.try_enter("b", 3).expect("another key is not held back");
        assert_eq!((table.current("a"), table.current("b"), table.keys()), (3, 1, 2));
        drop(held);
        assert!(table.try_enter("a", 3).is_some(), "room again");
        drop(b);
        assert_eq!(table.keys(), 0, "no memory for keys with nothing in flight");
        assert!(table.try_enter("c", 0).is_none());
        assert_eq!(table.keys(), 0, "a refusal at a zero cap leaves nothing behind");
    }
}
