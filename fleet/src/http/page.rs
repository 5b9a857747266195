//! The live operator page: `GET /` (one self-contained HTML file, [`PAGE`]: inline CSS and JS, no build step, no
//! CDN) and its data, `GET /v1/ops/overview` (a JSON snapshot) and `GET /v1/ops/events` (SSE: an `overview` event
//! at once and every 2 s, and every user's `tool_job` events with the user's key).
//!
//! **Auth.** The page itself holds no data and is served to anyone; its data needs an *operator* token — an API
//! token (audience `cloud-agents`) with `"operator": true`, e.g. `fleet token --user ops --operator` — passed as
//! `?token=` (the page forwards its own `?token=`; EventSource cannot set headers) or `Authorization: Bearer`.
//! Chosen over "unauthenticated on loopback" because the gateway also runs behind load balancers, where every
//! peer address is the proxy's; operator tokens already exist in the auth model.
//!
//! The snapshot: live workers and their warm sessions (the JetStream registry), active jobs by state (the
//! active sets), the jobs this gateway saw events for (newest 200, with their state), per-tool latency (job:
//! first `queued` event → terminal event; sync invokes through this gateway: request → answer), and the last 20
//! errors (failed/expired jobs, error answers of `/v1/rpc`).

use std::collections::HashMap;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::{HeaderMap, header};
use axum::response::sse::Event;
use axum::response::{Html, IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::sse::{Feed, TokenQuery, forward, last_event_id, sse_response};
use super::{HttpState, error_response, request_token};
use fleet_proto::util::now_ms;

/// The operator page.
pub const PAGE: &str = include_str!("page.html");

/// `GET /`.
pub async fn page() -> Response {
    (
        [
            (header::CACHE_CONTROL, "no-store"),
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'self'; style-src 'unsafe-inline'; script-src 'unsafe-inline'",
            ),
            // The page is opened with `?token=` (its event stream cannot send a header): never passed on.
            (header::REFERRER_POLICY, "no-referrer"),
        ],
        Html(PAGE),
    )
        .into_response()
}

/// The overview JSON.
async fn overview_value(state: &HttpState) -> Value {
    let store = state.inner.front.store();
    let workers = match tokio::time::timeout(Duration::from_secs(2), store.live_workers()).await {
        Ok(Ok(ws)) => json!(
            ws.iter()
                .map(|w| json!({
                    "id": w.id,
                    "capacity_long_jobs": w.capacity_long_jobs,
                    "long_jobs_running": w.long_jobs_running,
                    "started_at_ms": w.started_at_ms,
                    "sessions": w.sessions_warm.iter()
                        .map(|(user_key, tool_id)| json!({"user_key": user_key, "tool_id": tool_id}))
                        .collect::<Vec<_>>(),
                }))
                .collect::<Vec<_>>()
        ),
        Ok(Err(e)) => json!({ "error": e.to_string() }),
        Err(_) => json!({ "error": "JetStream did not answer within 2 s" }),
    };
    let active = match tokio::time::timeout(Duration::from_secs(2), store.active_jobs()).await {
        Ok(Ok(jobs)) => {
            let mut counts: HashMap<&'static str, usize> = HashMap::new();
            for j in &jobs {
                *counts.entry(j.value.state.as_str()).or_default() += 1;
            }
            json!(counts)
        }
        Ok(Err(e)) => json!({ "error": e.to_string() }),
        Err(_) => json!({ "error": "JetStream did not answer within 2 s" }),
    };
    let mut snapshot = state.inner.ops.snapshot();
    snapshot["now_ms"] = json!(now_ms());
    snapshot["nats"] = json!(format!("{:?}", state.inner.client.connection_state()));
    snapshot["workers"] = workers;
    snapshot["active_jobs"] = active;
    // Plugins' health (Executa `health`, Animus `health/check`) of the workers in this process, if any.
    snapshot["plugin_health"] = json!(state.inner.metrics.plugin_health());
    snapshot
}

/// `GET /v1/ops/overview` (operator token).
pub async fn overview(
    State(state): State<HttpState>,
    Query(query): Query<TokenQuery>,
    headers: HeaderMap,
) -> Response {
    if let Err(e) = state.operator(request_token(&headers, query.token.as_deref()).as_deref()) {
        return error_response(&e);
    }
    axum::Json(overview_value(&state).await).into_response()
}

/// `GET /v1/ops/events` (operator token): `overview` events and every user's `tool_job` events.
pub async fn ops_events(
    State(state): State<HttpState>,
    Query(query): Query<TokenQuery>,
    headers: HeaderMap,
) -> Response {
    let principal = match state.operator(request_token(&headers, query.token.as_deref()).as_deref()) {
        Ok(p) => p,
        Err(e) => return error_response(&e),
    };
    let after = last_event_id(&headers);
    let (tx, rx) = mpsc::channel(64);
    let stop = query.lifetime(principal.expires_at);
    let hub = state.inner.hub.clone();
    let events_tx = tx.clone();
    // The job events (ids = the hub's) …
    let feed = Feed::open(&hub, after);
    let events = tokio::spawn(async move { forward(&hub, feed, None, &events_tx, stop).await });
    // … and an overview now and every interval (no id: it does not move Last-Event-ID).
    let interval = state.inner.config.overview_interval;
    let heartbeat = state.inner.config.heartbeat;
    let drained = state.drained();
    tokio::spawn(async move {
        let deadline = tokio::time::Instant::now() + stop;
        let mut first = true;
        loop {
            let data = overview_value(&state).await.to_string();
            let mut event = Event::default().event("overview").data(data);
            if std::mem::take(&mut first) {
                // Reconnect quickly when the stream ends (max_ms, token expiry).
                event = event.retry(Duration::from_secs(1));
            }
            if tx.send(event).await.is_err() {
                break;
            }
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                () = tx.closed() => break,
                () = tokio::time::sleep_until(deadline) => break,
            }
        }
        events.abort();
    });
    sse_response(rx, heartbeat, drained)
}
