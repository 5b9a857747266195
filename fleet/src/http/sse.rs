//! `GET /v1/windows/{window_uuid}/events`: the window's user's `tool_job` events as Server-Sent Events.
//!
//! One subscription per gateway to `fleet.v1.events.*` feeds a [`Hub`]: every event gets an id from a
//! per-gateway counter (starting at the gateway's start time in ms, so ids grow across restarts of one gateway)
//! and is kept in a bounded ring (the newest [`super::HttpConfig::replay_capacity`] events of all users). A
//! stream sends `event: tool_job`, `id: N`, `data: {job_id, tool_id, state, seq, event, terminal}`; a client
//! reconnecting with `Last-Event-ID: N` first gets the ring's events of its user after `N`, then live ones. An id
//! the gateway does not know (from another replica, or one larger than its counter) resumes from "now". A
//! heartbeat comment is sent every 15 s; the stream ends when the window token expires (the client reconnects
//! with a fresh token and `Last-Event-ID`). Events are best-effort (spec §10.9): a lost one is harmless, the job
//! API is the truth.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use fleet_proto::api::{ApiError, ApiErrorCode, ToolJobEvent};
use futures::StreamExt as _;
use serde::Deserialize;
use tokio::sync::{broadcast, mpsc};

use super::ops_stats::OpsStats;
use super::window::verify_window;
use super::{HttpState, error_response, request_token};
use fleet_proto::api::user_key;

/// One event as the hub keeps it.
#[derive(Debug)]
pub struct HubEvent {
    /// The gateway's id.
    pub id: u64,
    /// The user's key (the subject's last token).
    pub user_key: String,
    /// The `ToolJobEvent` JSON, as published.
    pub data: String,
}

/// The replay ring and the live fan-out.
#[derive(Debug)]
pub struct Hub {
    next: AtomicU64,
    ring: Mutex<VecDeque<Arc<HubEvent>>>,
    capacity: usize,
    live: broadcast::Sender<Arc<HubEvent>>,
}

impl Hub {
    /// A hub keeping the newest `capacity` events.
    pub fn new(capacity: usize) -> Hub {
        let start = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX / 2))
            .unwrap_or(1);
        Hub {
            next: AtomicU64::new(start),
            ring: Mutex::new(VecDeque::with_capacity(capacity.min(1024))),
            capacity: capacity.max(1),
            live: broadcast::channel(4096).0,
        }
    }

    /// Records and fans out one event.
    pub fn push(&self, user_key: String, data: String) -> Arc<HubEvent> {
        let mut ring = self.ring.lock().unwrap_or_else(PoisonError::into_inner);
        // Ids are taken under the ring's lock, so the ring (and the broadcast) are in id order.
        let event = Arc::new(HubEvent {
            id: self.next.fetch_add(1, Ordering::Relaxed),
            user_key,
            data,
        });
        if ring.len() >= self.capacity {
            ring.pop_front();
        }
        ring.push_back(event.clone());
        let _ = self.live.send(event.clone());
        event
    }

    /// The last id handed out (0 before any).
    pub fn last_id(&self) -> u64 {
        self.next.load(Ordering::Relaxed).saturating_sub(1)
    }

    /// A live receiver.
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<HubEvent>> {
        self.live.subscribe()
    }

    /// The ring's events after `after` whose user matches (`None`: every user).
    pub fn since(&self, after: u64, user: Option<&str>) -> Vec<Arc<HubEvent>> {
        let ring = self.ring.lock().unwrap_or_else(PoisonError::into_inner);
        ring.iter()
            .filter(|e| e.id > after && user.is_none_or(|u| e.user_key == u))
            .cloned()
            .collect()
    }
}

/// Subscribes to every user's events and feeds the hub and the operator statistics.
pub(super) async fn start_pump(
    client: &async_nats::Client,
    hub: Arc<Hub>,
    ops: Arc<OpsStats>,
) -> Result<tokio::task::JoinHandle<()>, async_nats::Error> {
    let prefix = fleet_proto::api::subjects::user_events("");
    let mut sub = client.subscribe(format!("{prefix}*")).await?;
    // The subscription is in place once the server has processed it (a PING round trip).
    fleet_client::nats_conn::round_trip(client).await?;
    Ok(tokio::spawn(async move {
        while let Some(message) = sub.next().await {
            let Some(key) = message.subject.as_str().strip_prefix(prefix.as_str()) else {
                continue;
            };
            let Ok(event) = serde_json::from_slice::<ToolJobEvent>(&message.payload) else {
                continue;
            };
            let Ok(data) = String::from_utf8(message.payload.to_vec()) else {
                continue;
            };
            ops.observe(key, &event);
            hub.push(key.to_owned(), data);
        }
    }))
}

/// `?token=` (EventSource cannot set headers) and `?max_ms=` (end the stream after this long, 1 s – 1 h; the
/// client reconnects with `Last-Event-ID` and loses nothing the ring still holds).
#[derive(Debug, Deserialize)]
pub struct TokenQuery {
    /// The token.
    pub token: Option<String>,
    /// Stream lifetime cap in ms.
    pub max_ms: Option<u64>,
}

impl TokenQuery {
    /// How long a stream may last: until the token's `exp`, at most `max_ms`.
    pub(super) fn lifetime(&self, exp: u64) -> Duration {
        let left = until(exp);
        match self.max_ms {
            Some(ms) => left.min(Duration::from_millis(ms.clamp(1_000, 3_600_000))),
            None => left,
        }
    }
}

/// The `Last-Event-ID` header, parsed.
pub(super) fn last_event_id(headers: &HeaderMap) -> Option<u64> {
    headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok())
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Time left until `exp` (Unix seconds).
pub(super) fn until(exp: u64) -> Duration {
    Duration::from_secs(exp.saturating_sub(unix_now()))
}

/// Where a stream starts: taken when its request is handled (not when its task first runs), so an event the hub
/// receives in between is replayed or received live, never skipped.
pub(super) struct Feed {
    live: broadcast::Receiver<Arc<HubEvent>>,
    last: u64,
}

impl Feed {
    /// A stream resuming after `after` (`Last-Event-ID`); an unknown id (another replica's, or from the future),
    /// or none, starts from now.
    pub(super) fn open(hub: &Hub, after: Option<u64>) -> Self {
        // Subscribed before the ring's last id is read: an event in between is both, and deduplicated by id.
        let live = hub.subscribe();
        let last = match after {
            Some(id) if id <= hub.last_id() => id,
            _ => hub.last_id(),
        };
        Self { live, last }
    }
}

/// Replays the ring after the feed's start, then forwards live events, of `user` (`None`: every user) into `tx`,
/// until `tx` is closed or `stop` elapses. Returns when done.
pub(super) async fn forward(
    hub: &Hub,
    feed: Feed,
    user: Option<&str>,
    tx: &mpsc::Sender<Event>,
    stop: Duration,
) {
    let deadline = tokio::time::Instant::now() + stop;
    let Feed { mut live, mut last } = feed;
    let send = |e: &HubEvent| {
        Event::default()
            .event("tool_job")
            .id(e.id.to_string())
            .data(e.data.as_str())
    };
    for e in hub.since(last, user) {
        if tx.send(send(&e)).await.is_err() {
            return;
        }
        last = e.id;
    }
    loop {
        let received = tokio::select! {
            r = live.recv() => r,
            () = tx.closed() => return,
            () = tokio::time::sleep_until(deadline) => return,
        };
        let batch = match received {
            Ok(e) => vec![e],
            // Fell behind the fan-out: catch up from the ring.
            Err(broadcast::error::RecvError::Lagged(_)) => hub.since(last, user),
            Err(broadcast::error::RecvError::Closed) => return,
        };
        for e in batch {
            if e.id <= last || user.is_some_and(|u| e.user_key != u) {
                continue;
            }
            if tx.send(send(&e)).await.is_err() {
                return;
            }
            last = e.id;
        }
    }
}

/// An SSE response over a channel fed by a task; it ends when the gateway drains.
pub(super) fn sse_response(
    rx: mpsc::Receiver<Event>,
    heartbeat: Duration,
    drained: impl std::future::Future<Output = ()> + Send + 'static,
) -> Response {
    use futures::StreamExt as _;
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|e| (Ok::<_, Infallible>(e), rx))
    })
    .take_until(Box::pin(drained));
    Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(heartbeat).text("heartbeat"))
        .into_response()
}

/// `GET /v1/windows/{window_uuid}/events`.
pub async fn window_events(
    State(state): State<HttpState>,
    Path(window_uuid): Path<String>,
    Query(query): Query<TokenQuery>,
    headers: HeaderMap,
) -> Response {
    let Some(token) = request_token(&headers, query.token.as_deref()) else {
        return error_response(&ApiError::with_details(
            ApiErrorCode::InvalidToken,
            "no token: expected `Authorization: Bearer <jwt>` or `?token=`",
            serde_json::json!({ "reason": "missing" }),
        ));
    };
    let claims = match verify_window(&state.inner.window, &token) {
        Ok(c) => c,
        Err(e) => return error_response(&e),
    };
    if claims.window != window_uuid {
        return error_response(&wid_mismatch());
    }
    let key = user_key(&claims.user);
    let cap = state.inner.config.max_streams_per_user;
    // Held by the stream's task, which ends when the client's stream is dropped (`tx.closed()`).
    let Some(open) = state.inner.streams.try_enter(&key, cap) else {
        return error_response(&ApiError::with_details(
            ApiErrorCode::RateLimited,
            format!("{cap} event streams of this user are open on this gateway; close one first"),
            serde_json::json!({ "max_streams": cap }),
        ));
    };
    let after = last_event_id(&headers);
    let (tx, rx) = mpsc::channel(64);
    let hub = state.inner.hub.clone();
    let stop = query.lifetime(claims.expires_at);
    let feed = Feed::open(&hub, after);
    tokio::spawn(async move {
        let _open = open;
        forward(&hub, feed, Some(&key), &tx, stop).await;
    });
    sse_response(rx, state.inner.config.heartbeat, state.drained())
}

/// The token's `wid` is not the window addressed.
pub(super) fn wid_mismatch() -> ApiError {
    ApiError::with_details(
        ApiErrorCode::InvalidToken,
        "the window token was issued for another window",
        serde_json::json!({ "reason": "wid_mismatch" }),
    )
}
