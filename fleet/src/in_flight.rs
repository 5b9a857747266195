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

/// Work in flight per key (a front's API requests per user), each key capped in count and in bytes: what one
/// user can hold of a replica. Keys with nothing in flight take no memory. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct PerKey(Arc<std::sync::Mutex<std::collections::HashMap<String, Held>>>);

/// What one key has in flight: how many pieces of work, and the bytes they were entered with.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Held {
    /// Pieces of work.
    pub count: usize,
    /// Their bytes together.
    pub bytes: usize,
}

impl PerKey {
    /// Counts one piece of work of `key` for as long as the returned guard lives, if `key` has fewer than `cap`
    /// in flight; `None` (nothing counted) at the cap.
    pub fn try_enter(&self, key: &str, cap: usize) -> Option<PerKeyGuard> {
        self.try_enter_bytes(key, cap, 0, usize::MAX).ok()
    }

    /// Counts one piece of work of `key` holding `bytes` for as long as the returned guard lives, if `key` has
    /// fewer than `cap` in flight and its bytes with these stay within `max_bytes`; else what `key` holds now
    /// (nothing counted).
    pub fn try_enter_bytes(
        &self,
        key: &str,
        cap: usize,
        bytes: usize,
        max_bytes: usize,
    ) -> Result<PerKeyGuard, Held> {
        let mut held = fleet_proto::util::lock(&self.0);
        let h = held.entry(key.to_owned()).or_default();
        if h.count >= cap || h.bytes.saturating_add(bytes) > max_bytes {
            let now = *h;
            if h.count == 0 {
                held.remove(key);
            }
            return Err(now);
        }
        h.count += 1;
        h.bytes += bytes;
        Ok(PerKeyGuard {
            table: self.clone(),
            key: key.to_owned(),
            bytes,
        })
    }

    /// How many of `key` are in flight now.
    pub fn current(&self, key: &str) -> usize {
        self.held(key).count
    }

    /// What `key` has in flight now.
    pub fn held(&self, key: &str) -> Held {
        fleet_proto::util::lock(&self.0)
            .get(key)
            .copied()
            .unwrap_or_default()
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
    bytes: usize,
}

impl Drop for PerKeyGuard {
    fn drop(&mut self) {
        let mut held = fleet_proto::util::lock(&self.table.0);
        if let Some(h) = held.get_mut(&self.key) {
            h.count = h.count.saturating_sub(1);
            h.bytes = h.bytes.saturating_sub(self.bytes);
            if h.count == 0 {
                held.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Held, PerKey};

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

    #[test]
    fn each_keys_bytes_are_capped_at_their_boundary() {
        let table = PerKey::default();
        let a = table.try_enter_bytes("a", 10, 60, 100).expect("under both caps");
        let b = table
            .try_enter_bytes("a", 10, 40, 100)
            .expect("exactly at the byte cap");
        assert_eq!(table.held("a"), Held { count: 2, bytes: 100 });
        assert_eq!(
            table.try_enter_bytes("a", 10, 1, 100).unwrap_err(),
            Held { count: 2, bytes: 100 },
            "one byte over is refused, with what the key holds"
        );
        assert!(
            table.try_enter_bytes("b", 10, 100, 100).is_ok(),
            "another key has its own bytes"
        );
        drop(a);
        assert_eq!(
            table.held("a"),
            Held { count: 1, bytes: 40 },
            "a guard gives back its bytes"
        );
        assert!(table.try_enter_bytes("a", 10, 60, 100).is_ok());
        assert!(
            table.try_enter_bytes("c", 10, 101, 100).is_err(),
            "one piece over the cap alone"
        );
        drop(b);
        assert_eq!(table.held("c"), Held::default());
    }
}
