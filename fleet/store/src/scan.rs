//! Bounded reads of many messages of one stream: an ephemeral pull consumer (no acks) filtered server-side,
//! drained with `fetch` (no-wait) batches.
//!
//! Why not the KV API of async-nats 0.51: `keys()` and `history()` accept no wildcard (they validate the key),
//! `keys()` only scans the whole bucket, and `watch*()` streams never end and give no way to tell "no entries"
//! from "not delivered yet". A pull consumer tells how many messages match when it is created
//! (`num_pending`) and a no-wait fetch ends when nothing is left, so a scan ends on its own — even when a
//! message expires between the two.

use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, ReplayPolicy, pull};
use async_nats::jetstream::{self, stream::Stream};
use futures::StreamExt;

use super::provision::BoxError;

/// Messages asked for per fetch.
const FETCH_BATCH: usize = 100;

/// An abandoned scan consumer is removed by the server after this long.
const SCAN_INACTIVE: Duration = Duration::from_secs(30);

/// How long a scan waits for the next message of a fetch (the JetStream context's request timeout, like every
/// other read of the store). A no-wait fetch of async-nats 0.51 has no expiry of its own: when the server that
/// holds the scan's consumer dies (a NATS node of a cluster lost), nothing ever answers it, and without this
/// bound the scan — and a sweeper or registry read waiting for it — would wait forever.
pub(crate) const SCAN_READ_TIMEOUT: Duration = super::direct::DIRECT_READ_TIMEOUT;

/// What to read.
#[derive(Debug, Clone)]
pub(crate) struct Scan {
    /// Subject filter (wildcards allowed).
    pub(crate) filter: String,
    /// Where to start.
    pub(crate) deliver: DeliverPolicy,
    /// Headers only (no payloads).
    pub(crate) headers_only: bool,
    /// At most this many messages.
    pub(crate) max: usize,
}

/// Reads the messages matching `scan`, in stream order.
pub(crate) async fn scan(stream: &Stream, scan: Scan) -> Result<Vec<jetstream::Message>, BoxError> {
    if scan.max == 0 {
        return Ok(Vec::new());
    }
    let consumer = stream
        .create_consumer(pull::Config {
            description: Some("fleet store scan".to_string()),
            deliver_policy: scan.deliver,
            ack_policy: AckPolicy::None,
            filter_subject: scan.filter,
            headers_only: scan.headers_only,
            replay_policy: ReplayPolicy::Instant,
            inactive_threshold: SCAN_INACTIVE,
            memory_storage: true,
            ..Default::default()
        })
        .await?;
    let name = consumer.cached_info().name.clone();
    let pending = usize::try_from(consumer.cached_info().num_pending).unwrap_or(usize::MAX);
    let total = pending.min(scan.max);
    let result = drain(&consumer, total).await;
    // Best effort: the server removes it anyway once inactive.
    let stream = stream.clone();
    tokio::spawn(async move {
        let _ = stream.delete_consumer(&name).await;
    });
    result
}

async fn drain(
    consumer: &jetstream::consumer::Consumer<pull::Config>,
    total: usize,
) -> Result<Vec<jetstream::Message>, BoxError> {
    let mut out = Vec::with_capacity(total.min(1024));
    while out.len() < total {
        let want = (total - out.len()).min(FETCH_BATCH);
        let mut batch = consumer.fetch().max_messages(want).messages().await?;
        let before = out.len();
        loop {
            let Ok(next) = tokio::time::timeout(SCAN_READ_TIMEOUT, batch.next()).await else {
                return Err(format!(
                    "scan: no message within {} ms of {total} expected (the consumer's server is gone?)",
                    SCAN_READ_TIMEOUT.as_millis()
                )
                .into());
            };
            let Some(message) = next else { break };
            out.push(message?);
            if out.len() >= total {
                break;
            }
        }
        if out.len() == before {
            break; // nothing left (expired or purged since the consumer was created)
        }
    }
    Ok(out)
}
