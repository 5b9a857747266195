//! Batched direct gets: the JetStream direct-get API's `batch` and `multi_last` requests (nats-server ≥ 2.11),
//! which async-nats 0.51 does not expose (its `DirectGetBuilder` sends one message per request).
//!
//! One request to `$JS.API.DIRECT.GET.<stream>` with a reply inbox; the server answers with one message per
//! stored message (headers `Nats-Subject`, `Nats-Sequence`, `Nats-Time-Stamp`, `Nats-Num-Pending`, …), then an
//! end-of-batch status (`204 EOB`). Any replica of a stream with `allow_direct` may answer, like every direct get:
//! no consumer is created, nothing is left behind. A read is one round trip, however many messages it returns.
//!
//! The store's JetStream context uses the default API prefix (no domain): [`JS_API_PREFIX`].

use std::time::Duration;

use async_nats::jetstream::message::StreamMessage;
use bytes::Bytes;
use futures::StreamExt as _;
use serde::Serialize;

use super::provision::BoxError;

/// The JetStream API prefix of the fleet's account (the fleet uses no JetStream domain).
pub(crate) const JS_API_PREFIX: &str = "$JS.API";

/// How long a batched read waits for its next message (the JetStream context's default request timeout).
pub(crate) const DIRECT_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// The header every message of a batch carries (a server without batched direct gets sends none).
const NUM_PENDING: &str = "Nats-Num-Pending";

/// Most subjects one `multi_last` request may name (the server answers at most 1024 messages per request).
pub(crate) const MULTI_LAST_MAX: usize = 1024;

/// What to read.
#[derive(Debug, Serialize)]
pub(crate) struct BatchRequest<'a> {
    /// From this stream sequence on (`next_by_subj`), or at least this sequence (`multi_last`).
    #[serde(rename = "seq", skip_serializing_if = "Option::is_none")]
    pub(crate) start: Option<u64>,
    /// The messages on this subject (wildcards allowed), oldest first.
    #[serde(rename = "next_by_subj", skip_serializing_if = "Option::is_none")]
    pub(crate) next_by_subject: Option<&'a str>,
    /// The last message of each of these subjects (in stream order).
    #[serde(rename = "multi_last", skip_serializing_if = "<[String]>::is_empty")]
    pub(crate) multi_last: &'a [String],
    /// At most this many messages.
    pub(crate) batch: usize,
}

/// Why a batched read failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DirectError {
    /// NATS failed (no connection, a refused subscription or publish).
    #[error("direct get on {stream}: {source}")]
    Nats {
        /// The stream.
        stream: String,
        /// Why.
        #[source]
        source: BoxError,
    },
    /// No message within [`DIRECT_READ_TIMEOUT`].
    #[error("direct get on {stream}: no answer within {DIRECT_READ_TIMEOUT:?}")]
    TimedOut {
        /// The stream.
        stream: String,
    },
    /// The server refused the request (a status other than 204 or 404).
    #[error("direct get on {stream}: {status} {description}")]
    Refused {
        /// The stream.
        stream: String,
        /// The status code.
        status: u16,
        /// The server's words.
        description: String,
    },
    /// The server answered a batch without batch headers: it predates batched direct gets.
    #[error(
        "direct get on {stream}: the server does not answer batched direct gets (nats-server ≥ 2.11 needed)"
    )]
    Unsupported {
        /// The stream.
        stream: String,
    },
    /// A message without the headers of a stored message.
    #[error("direct get on {stream}: {source}")]
    Malformed {
        /// The stream.
        stream: String,
        /// Why.
        #[source]
        source: BoxError,
    },
}

/// Reads the messages `request` names from `stream`, in stream order, in one round trip. No stored message is
/// an empty list, not an error.
pub(crate) async fn batch(
    client: &async_nats::Client,
    stream: &str,
    request: &BatchRequest<'_>,
) -> Result<Vec<StreamMessage>, DirectError> {
    let nats = |source: BoxError| DirectError::Nats {
        stream: stream.to_owned(),
        source,
    };
    if request.batch == 0 {
        return Ok(Vec::new());
    }
    let payload: Bytes = serde_json::to_vec(request).map_err(|e| nats(e.into()))?.into();
    let inbox = client.new_inbox();
    // The SUB goes out before the request on the same connection, so the server knows the inbox when it answers.
    let mut replies = client
        .subscribe(inbox.clone())
        .await
        .map_err(|e| nats(e.into()))?;
    client
        .publish_with_reply(format!("{JS_API_PREFIX}.DIRECT.GET.{stream}"), inbox, payload)
        .await
        .map_err(|e| nats(e.into()))?;
    let mut out = Vec::new();
    loop {
        let Ok(next) = tokio::time::timeout(DIRECT_READ_TIMEOUT, replies.next()).await else {
            return Err(DirectError::TimedOut {
                stream: stream.to_owned(),
            });
        };
        let Some(message) = next else {
            return Err(nats("the reply subscription ended".into()));
        };
        if let Some(status) = message.status {
            return match status.as_u16() {
                204 | 404 => Ok(out),
                code => Err(DirectError::Refused {
                    stream: stream.to_owned(),
                    status: code,
                    description: message.description.unwrap_or_default(),
                }),
            };
        }
        if message
            .headers
            .as_ref()
            .is_none_or(|h| h.get(NUM_PENDING).is_none())
        {
            return Err(DirectError::Unsupported {
                stream: stream.to_owned(),
            });
        }
        let message = StreamMessage::try_from(message).map_err(|e| DirectError::Malformed {
            stream: stream.to_owned(),
            source: e.into(),
        })?;
        out.push(message);
        if out.len() >= request.batch {
            // The server sends no more than asked; its end-of-batch status is not waited for.
            return Ok(out);
        }
    }
}
