//! The HTTP gateway (axum): the App Host API over HTTP, window events over SSE, health, metrics and the live
//! operator page.
//!
//! | Route | What | Auth |
//! |---|---|---|
//! | `POST /v1/rpc` | `{id, window_uuid, ns, method, args}` → `{id, ok, result}` / `{id, ok: false, error}` ([`rpc`]) | window token |
//! | `GET /v1/windows/{window_uuid}/events` | `tool_job` events of the window's user, SSE, `Last-Event-ID` resume ([`sse`]) | window token (`Authorization: Bearer` or `?token=`) |
//! | `GET /healthz` | the process is alive | none |
//! | `GET /readyz` | NATS connected, a JetStream round trip, ≥ 1 live worker (else 503 and the reason) | none |
//! | `GET /metrics` | [`FleetMetrics::encode`] — on the public port unless the metrics have their own listener ([`serve_ops`], `fleet up --metrics-http`) | none |
//! | `GET /` | the operator page (one embedded HTML file) ([`page`]) | none: it holds no data |
//! | `GET /v1/ops/overview`, `GET /v1/ops/events` | the page's data: JSON snapshot, SSE stream | operator token (audience `cloud-agents-operator`, an operator key) |
//! | `GET`, `PUT /v1/files/{bucket}/{object}` | host files and uploads: signed download links and presigned PUTs ([`files`]; only with [`serve_with_services`]); user content: every response `Content-Security-Policy: sandbox; default-src 'none'` and `nosniff`, `inline` only for types a browser does not run | the link's HMAC signature and expiry |
//! | `GET`, `PUT /v1/credentials`, `DELETE /v1/credentials/{name}` | the user's own plugin credentials ([`user`]; only with [`serve_with_services`]) | the user's API token (`Authorization: Bearer`) |
//! | `GET /v1/oauth/providers`, `/v1/oauth/{provider}/accounts[/…]` | the user's own OAuth accounts ([`user`]) | the user's API token |
//! | `GET /v1/oauth/{provider}/start`, `/v1/oauth/{provider}/callback` | the OAuth connect flow ([`user`]) | start: the user's API token; callback: the flow's single-use state and the browser's binding cookie |
//!
//! The gateway is a thin adapter: after authentication, the ACL and the per-window in-flight cap it calls
//! [`Front::handle_as`], the same code the NATS API runs (per-user rate limit, validation, handlers).

pub mod files;
pub mod listener;
pub mod ops_stats;
pub mod page;
pub mod rpc;
pub mod sse;
pub mod user;
pub mod window;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use fleet_proto::api::{ApiError, ApiErrorCode};

use crate::front::Front;
use crate::metrics::FleetMetrics;
use fleet_client::auth::{OperatorVerifier, Principal, Verifier};

/// Gateway settings.
#[derive(Debug, Clone)]
pub struct HttpConfig {
    /// Requests in flight per window (`window_uuid`) before `rate_limited`.
    pub max_in_flight_per_window: usize,
    /// Open window event streams per user on this gateway before `rate_limited` (each holds a task and a place
    /// in the events' fan-out for as long as it is open).
    pub max_streams_per_user: usize,
    /// Events kept for `Last-Event-ID` resumption (all users together, newest kept).
    pub replay_capacity: usize,
    /// SSE heartbeat comment interval.
    pub heartbeat: Duration,
    /// How often the operator stream pushes an `overview`.
    pub overview_interval: Duration,
    /// Whether the public router serves `/metrics`. Off when the metrics have a listener of their own
    /// ([`serve_ops`], `fleet up --metrics-http`): the counters name every installed tool and the fleet's load,
    /// nothing anyone who reaches the public port should read.
    pub public_metrics: bool,
    /// What a client may hold of the gateway's listeners: header- and body-read timeouts, connections at once
    /// ([`listener::ListenerLimits`]).
    pub listener: listener::ListenerLimits,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            max_in_flight_per_window: 16,
            max_streams_per_user: 32,
            replay_capacity: 10_000,
            heartbeat: Duration::from_secs(15),
            overview_interval: Duration::from_secs(2),
            public_metrics: true,
            listener: listener::ListenerLimits::default(),
        }
    }
}

/// Everything the routes share. Cheap to clone.
#[derive(Clone)]
pub struct HttpState {
    inner: Arc<Inner>,
}

struct Inner {
    front: Front,
    client: async_nats::Client,
    /// API tokens (the user routes: credentials, OAuth accounts).
    api: Verifier,
    window: Verifier,
    operator: OperatorVerifier,
    metrics: Arc<FleetMetrics>,
    config: HttpConfig,
    /// Each window's requests in flight ([`HttpConfig::max_in_flight_per_window`]).
    windows: crate::in_flight::PerKey,
    /// Each user's open window event streams ([`HttpConfig::max_streams_per_user`]).
    streams: crate::in_flight::PerKey,
    hub: Arc<sse::Hub>,
    ops: Arc<ops_stats::OpsStats>,
    pump: tokio::task::JoinHandle<()>,
    /// Set once the gateway drains: `/readyz` answers 503, SSE streams end, no new connection is accepted.
    draining: tokio::sync::watch::Sender<bool>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.pump.abort();
    }
}

impl std::fmt::Debug for HttpState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpState")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl HttpState {
    /// The gateway's state over `front`: subscribes to every user's `tool_job` events (`fleet.v1.events.*`) for
    /// the SSE streams and the operator page. Window tokens are verified with `api`'s keys under the audience
    /// [`window::WINDOW_AUDIENCE`]; the operator page's data with `operator` (its own keys and audience).
    pub async fn start(
        front: Front,
        client: async_nats::Client,
        api: Verifier,
        operator: OperatorVerifier,
        metrics: Arc<FleetMetrics>,
        config: HttpConfig,
    ) -> Result<HttpState, async_nats::Error> {
        let window = window::window_verifier(&api)?;
        let hub = Arc::new(sse::Hub::new(config.replay_capacity));
        let ops = Arc::new(ops_stats::OpsStats::default());
        let pump = sse::start_pump(&client, hub.clone(), ops.clone()).await?;
        Ok(HttpState {
            inner: Arc::new(Inner {
                front,
                client,
                api,
                window,
                operator,
                metrics,
                config,
                windows: crate::in_flight::PerKey::default(),
                streams: crate::in_flight::PerKey::default(),
                hub,
                ops,
                pump,
                draining: tokio::sync::watch::Sender::new(false),
            }),
        })
    }

    /// Starts draining (a front's SIGTERM): `/readyz` answers 503 so load balancers stop sending, SSE streams
    /// end (clients reconnect elsewhere with `Last-Event-ID`), and [`serve`] stops accepting connections and
    /// returns once the requests in flight are answered.
    pub fn start_draining(&self) {
        self.inner.draining.send_replace(true);
    }

    /// Resolves once [`start_draining`](Self::start_draining) was called.
    pub(crate) fn drained(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.inner.draining.subscribe();
        async move {
            let _ = rx.wait_for(|d| *d).await;
        }
    }

    /// Takes one of the window's in-flight slots, or `None` when it has none left (the window is forgotten when
    /// its last slot is returned).
    fn acquire_window(&self, window: &str) -> Option<crate::in_flight::PerKeyGuard> {
        self.inner
            .windows
            .try_enter(window, self.inner.config.max_in_flight_per_window)
    }

    /// Verifies an operator token ([`OperatorVerifier::authorize`]).
    fn operator(&self, token: Option<&str>) -> Result<Principal, ApiError> {
        self.inner.operator.authorize(token, "the operator page's data")
    }
}

/// The token of a request: `Authorization` (`Bearer <jwt>`), else the `token` query parameter.
fn request_token(headers: &HeaderMap, query: Option<&str>) -> Option<String> {
    if let Some(v) = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) {
        return Some(v.to_owned());
    }
    query.filter(|t| !t.is_empty()).map(str::to_owned)
}

/// The HTTP status of an API error code when it is the gateway's own verdict.
fn status_of(code: ApiErrorCode) -> StatusCode {
    match code {
        ApiErrorCode::InvalidToken => StatusCode::UNAUTHORIZED,
        ApiErrorCode::PermissionDenied => StatusCode::FORBIDDEN,
        ApiErrorCode::RateLimited => StatusCode::TOO_MANY_REQUESTS,
        ApiErrorCode::InvalidArg => StatusCode::BAD_REQUEST,
        ApiErrorCode::InternalError => StatusCode::INTERNAL_SERVER_ERROR,
        _ => StatusCode::OK,
    }
}

/// A bare `{ok: false, error}` answer (routes without an RPC envelope).
fn error_response(e: &ApiError) -> Response {
    let body = serde_json::json!({ "ok": false, "error": e });
    (status_of(e.code), axum::Json(body)).into_response()
}

/// The router: the public routes, and `/metrics` unless [`HttpConfig::public_metrics`] is off.
pub fn router(state: HttpState) -> Router {
    let router = Router::new()
        .route("/", get(page::page))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/v1/rpc", post(rpc::rpc))
        .route("/v1/windows/{window_uuid}/events", get(sse::window_events))
        .route("/v1/ops/overview", get(page::overview))
        .route("/v1/ops/events", get(page::ops_events));
    let router = if state.inner.config.public_metrics {
        router.route("/metrics", get(metrics))
    } else {
        router
    };
    router.with_state(state)
}

/// The operations router of the metrics listener: `/metrics`, `/healthz` and `/readyz` (the gateway's).
pub fn ops_router(state: HttpState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(state)
}

/// Serves [`ops_router`] on `listener` (`fleet up --metrics-http`, a port only the metrics scraper and the
/// probes reach) until the task is dropped or aborted — through a drain too: `/readyz` then answers 503 and the
/// drain's metrics are still scraped.
pub async fn serve_ops(listener: tokio::net::TcpListener, state: HttpState) -> std::io::Result<()> {
    let limits = state.inner.config.listener;
    listener::serve(listener, ops_router(state), limits, std::future::pending()).await
}

/// Serves the router on `listener` until the task is dropped or aborted, or — after
/// [`HttpState::start_draining`] — until every request in flight is answered (no new connection is accepted).
pub async fn serve(listener: tokio::net::TcpListener, state: HttpState) -> std::io::Result<()> {
    let drained = state.drained();
    let limits = state.inner.config.listener;
    listener::serve(listener, router(state), limits, drained).await
}

/// Like [`serve`], with the routes of the host services: files and uploads ([`files::router`]), the user's
/// credentials and OAuth accounts and the connect flow ([`user::router`]).
pub async fn serve_with_services(
    listener: tokio::net::TcpListener,
    state: HttpState,
    services: fleet_services::FleetServices,
) -> std::io::Result<()> {
    let drained = state.drained();
    let limits = state.inner.config.listener;
    let objects = services.objects().clone();
    let user = user::router(state.clone(), services);
    let router = router(state).merge(files::router(objects)).merge(user);
    listener::serve(listener, router, limits, drained).await
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(state): State<HttpState>) -> Response {
    use async_nats::connection::State as Conn;
    let unavailable =
        |reason: String| (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {reason}\n")).into_response();
    if *state.inner.draining.borrow() {
        return unavailable("draining".into());
    }
    if !matches!(state.inner.client.connection_state(), Conn::Connected) {
        return unavailable("NATS is not connected".into());
    }
    match tokio::time::timeout(Duration::from_secs(2), state.inner.front.store().live_workers()).await {
        Err(_) => unavailable("JetStream did not answer within 2 s".into()),
        Ok(Err(e)) => unavailable(format!("JetStream: {e}")),
        Ok(Ok(workers)) if workers.is_empty() => unavailable("no live worker".into()),
        Ok(Ok(_)) => "ready\n".into_response(),
    }
}

async fn metrics(State(state): State<HttpState>) -> Response {
    (
        [(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)],
        state.inner.metrics.encode(),
    )
        .into_response()
}
