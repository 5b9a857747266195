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
