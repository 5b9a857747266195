//! The production log lines (`fleet::telemetry`): JSON events only — no span and its fields in any line — and,
//! inside a span being traced, the trace id that finds the request's spans. The traced test installs the global
//! subscriber, as `fleet up`, `fleet front` and `fleet worker` do (the trace id is read through it); the other one
//! installs its subscriber for its own thread only.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Mutex};

use opentelemetry::trace::TraceContextExt as _;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// Log lines written into memory.
#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Lines {
    fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }

    fn parsed(&self) -> Vec<serde_json::Value> {
        self.text()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }
}

#[test]
fn without_traces_log_lines_have_no_trace_id_and_no_span_fields() {
    let lines = Lines::default();
    let out = lines.clone();
    let (layers, provider) =
        fleet::telemetry::layers_to(None, "fleet-test", "info", move || out.clone()).unwrap();
    assert!(provider.is_none());
    tracing::subscriber::with_default(tracing_subscriber::registry().with(layers), || {
        let span = tracing::info_span!(target: "fleet::front", "request", fleet.user_hash = "u-hash");
        span.in_scope(|| tracing::warn!(job = "tjob_1", "inside"));
        tracing::warn!("outside");
    });
    let logged = lines.parsed();
    assert_eq!(logged.len(), 2, "{logged:?}");
    for line in &logged {
        assert!(line.get("trace_id").is_none(), "{line}");
        assert!(
            line.get("span").is_none() && line.get("spans").is_none(),
            "{line}"
        );
    }
    assert!(!lines.text().contains("u-hash"));
}

// The OTLP exporter (tonic) is built inside a runtime, as in the fleet.
#[tokio::test]
async fn log_lines_carry_the_trace_id_of_a_traced_span_and_no_span_fields() {
    let lines = Lines::default();
    let out = lines.clone();
    // No receiver at this endpoint: nothing is exported before the provider is shut down.
    let (layers, provider) =
        fleet::telemetry::layers_to(Some("http://127.0.0.1:9"), "fleet-test", "info", move || {
            out.clone()
        })
        .unwrap();
    let provider = provider.unwrap();
    tracing_subscriber::registry().with(layers).init();
    // Only the fleet's own spans are traced (by target).
    let span = tracing::info_span!(target: "fleet::front", "request", fleet.user_hash = "u-hash");
    let trace_id = span.context().span().span_context().trace_id().to_string();
    span.in_scope(|| tracing::warn!(job = "tjob_1", "inside"));
    tracing::warn!("outside");
    drop(span);
    let (text, logged) = (lines.text(), lines.parsed());
    // Not shut down: that would wait out an export to nowhere (and log it); the process ends with the test.
    std::mem::forget(provider);
    assert_eq!(logged.len(), 2, "{text}");
    assert_eq!(trace_id.len(), 32);
    assert_ne!(trace_id, "0".repeat(32));
    assert_eq!(logged[0]["trace_id"], serde_json::json!(trace_id), "{text}");
    assert_eq!(logged[0]["fields"]["message"], "inside");
    assert_eq!(logged[0]["fields"]["job"], "tjob_1");
    assert!(logged[1].get("trace_id").is_none(), "{text}");
    for line in &logged {
        assert!(
            line.get("span").is_none() && line.get("spans").is_none(),
            "{line}"
        );
    }
    assert!(!text.contains("u-hash"), "{text}");
}
