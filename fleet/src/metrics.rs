//! The fleet's Prometheus metrics (prometheus-client): one registry per process, rendered on `/metrics`.
//!
//! Being written (observability issue): this module owns every metric name. The HTTP listener only calls
//! [`FleetMetrics::encode`].

use std::sync::Mutex;

use prometheus_client::encoding::text::encode;
use prometheus_client::registry::Registry;

/// The process's metrics.
#[derive(Debug, Default)]
pub struct FleetMetrics {
    registry: Mutex<Registry>,
}

impl FleetMetrics {
    /// An empty registry.
    pub fn new() -> FleetMetrics {
        FleetMetrics::default()
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        let registry = self.registry.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let _ = encode(&mut out, &registry);
        out
    }
}
