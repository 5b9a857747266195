//! Request/response plumbing of the fleet's NATS API and the typed client the CLI, `loadtest`, the benches and
//! the tests share: where a local fleet (`fleet up`) leaves its URL and keys, dev tokens, one request with
//! `Authorization: Bearer <token>` unwrapped from the API envelope, and [`ApiClient`] (one connection, one token,
//! the app API `fleet.v1.api.tools.*` and the operator API `fleet.v1.admin.*`).

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Duration;

use fleet_proto::admin;
use fleet_proto::api::{ApiError, ApiErrorCode, ApiResponse, methods, subjects};
use serde::Serialize;
use serde_json::{Value, json};

use crate::auth::{DEFAULT_AUDIENCE, DEFAULT_ISSUER, DevKey, OPERATOR_AUDIENCE};
use crate::nats_conn::Connector;

/// The NATS URL clients use by default.
pub const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";

/// The data directory `fleet up` and the clients share by default.
pub const DEFAULT_DATA_DIR: &str = ".fleet";

/// Where `fleet up` records the URL of the nats-server it started.
pub fn nats_url_file(data_dir: &Path) -> PathBuf {
    data_dir.join("nats-url")
}

/// The NATS URL a client uses: `--nats-url`, else the one `fleet up` recorded in the data dir, else the default.
pub fn resolve_url(nats_url: Option<&str>, data_dir: &Path) -> String {
    nats_url.map(str::to_owned).unwrap_or_else(|| {
        std::fs::read_to_string(nats_url_file(data_dir))
            .map(|s| s.trim().to_string())
            .ok()
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| DEFAULT_NATS_URL.to_string())
    })
}

/// The demo plugin catalogue of this checkout: `./plugins` when run from the repository root, else the one beside
/// the workspace.
pub fn default_plugins_dir() -> PathBuf {
    let local = PathBuf::from("plugins");
    if local.join("echo-py/executa.json").is_file() {
        return local;
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../plugins")
}

/// Mints a dev token: a user token with the data dir's dev key, or (`operator`) an operator token — audience
/// `cloud-agents-operator` — with its dev operator key.
pub fn mint(data_dir: &Path, user: &str, ttl: Duration, operator: bool) -> Result<String, ApiError> {
    let (key, audience) = if operator {
        (DevKey::load_operator(data_dir), OPERATOR_AUDIENCE)
    } else {
        (DevKey::load(data_dir), DEFAULT_AUDIENCE)
    };
    let key = key.map_err(|e| e.to_api_error())?;
    key.mint(user, DEFAULT_ISSUER, audience, ttl, operator)
        .map_err(|e| e.to_api_error())
}

/// Connects a client (5 s connection timeout); a refusal or an unreadable credential is `AGENT_UNAVAILABLE`
/// with the one-line reason.
pub async fn connect(connector: &Connector, name: &str) -> Result<async_nats::Client, ApiError> {
    connector
        .connect(name)
        .await
        .map_err(|e| ApiError::new(ApiErrorCode::AgentUnavailable, e.to_string()))
}

/// An API request: the `Authorization` header set to `authorization` (`Bearer <token>`, or whatever a test
/// presents), `body` as JSON, answered within `wait`.
pub fn api_request(authorization: &str, body: &impl Serialize, wait: Duration) -> async_nats::Request {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(subjects::AUTH_HEADER, authorization);
    let payload = serde_json::to_vec(body).unwrap_or_default();
    async_nats::Request::new()
        .headers(headers)
        .payload(payload.into())
        .timeout(Some(wait))
}

/// The `Authorization` value of a token: `Bearer <token>`.
pub fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

/// How often a waiting [`request`] checks whether its connection was re-established under it.
pub const RECONNECT_CHECK: Duration = Duration::from_millis(50);

/// How long a [`request`] still waits for its answer after its connection was re-established: a request in
/// flight when its NATS server died is lost (or its answer is), and without this it would wait its whole `wait`
/// (30 s for most methods) for an answer that cannot come.
pub const RECONNECT_GRACE: Duration = Duration::from_secs(2);

/// Sends one request with `Authorization: Bearer <token>` to `subject` and unwraps the `ApiResponse`. When the
/// connection is lost and re-established while it waits (its server died: the request or its answer went with
/// it), it gives up [`RECONNECT_GRACE`] after the reconnect with `agent_unavailable` (retriable), naming the
/// unknown outcome.
pub async fn request(
    client: &async_nats::Client,
    token: &str,
    subject: String,
    body: &Value,
    wait: Duration,
) -> Result<Value, ApiError> {
    let request = api_request(&bearer(token), body, wait);
    let stats = client.statistics();
    let connects = stats.connects.load(Ordering::Relaxed);
    let send = client.send_request(subject.clone(), request);
    tokio::pin!(send);
    let mut check = tokio::time::interval(RECONNECT_CHECK);
    // Once the connection was re-established under the request: how long its answer may still take.
    let mut lost_by: Option<tokio::time::Instant> = None;
    let reply = loop {
        tokio::select! {
            reply = &mut send => break reply
                .map_err(|e| ApiError::new(ApiErrorCode::AgentUnavailable, format!("{subject}: {e}")))?,
            _ = check.tick() => {
                let now = tokio::time::Instant::now();
                match lost_by {
                    None if stats.connects.load(Ordering::Relaxed) != connects => {
                        lost_by = Some(now + RECONNECT_GRACE);
                    }
                    Some(by) if now >= by => {
                        return Err(ApiError::new(
                            ApiErrorCode::AgentUnavailable,
                            format!(
                                "{subject}: the NATS connection was lost and re-established with the request in \
                                 flight, and no answer came within {} ms of the reconnect: its outcome is unknown \
                                 (an invokeAsync may have created a job: list your jobs before retrying)",
                                RECONNECT_GRACE.as_millis()
                            ),
                        ));
                    }
                    _ => {}
                }
            }
        }
    };
    let response: ApiResponse<Value> = serde_json::from_slice(&reply.payload)
        .map_err(|e| ApiError::new(ApiErrorCode::InternalError, format!("unreadable answer: {e}")))?;
    response.into_result()
}

/// `fleet invoke` / `invoke-async` arguments into the API's.
pub fn invoke_body(
    tool_id: &str,
    tool: &str,
    args: Option<&str>,
    timeout_ms: Option<u64>,
    client_tag: Option<&str>,
) -> Result<Value, ApiError> {
    let args: Value = match args {
        Some(a) => serde_json::from_str(a)
            .map_err(|e| ApiError::invalid_arg("args", format!("--args must be JSON: {e}")))?,
        None => json!({}),
    };
    let mut body = json!({ "tool_id": tool_id, "method": tool, "args": args });
    if let Some(t) = timeout_ms {
        body["timeoutMs"] = json!(t);
    }
    if let Some(c) = client_tag {
        body["clientTag"] = json!(c);
    }
    Ok(body)
}

/// How long a client waits for an answer to `method`.
pub fn wait_for(method: &str, timeout_ms: Option<u64>) -> Duration {
    match method {
        methods::TOOLS_INVOKE => Duration::from_millis(timeout_ms.unwrap_or(90_000).min(90_000) + 10_000),
        _ => Duration::from_secs(30),
    }
}

/// One connection to a fleet and the token it presents. Cheap to clone.
#[derive(Clone)]
pub struct ApiClient {
    nats: async_nats::Client,
    token: String,
}

impl std::fmt::Debug for ApiClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiClient").finish_non_exhaustive()
    }
}

impl ApiClient {
    /// A client on `nats` presenting `token`.
    pub fn new(nats: async_nats::Client, token: String) -> ApiClient {
        ApiClient { nats, token }
    }

    /// Connects through `connector` (connection name `name`).
    pub async fn connect(connector: &Connector, name: &str, token: String) -> Result<ApiClient, ApiError> {
        Ok(ApiClient::new(connect(connector, name).await?, token))
    }

    /// The connection.
    pub fn nats(&self) -> &async_nats::Client {
        &self.nats
    }

    /// An app API call (`fleet.v1.api.<method>`, e.g. `tools.invoke`): its result, or the API error.
    pub async fn call(&self, method: &str, body: &Value, wait: Duration) -> Result<Value, ApiError> {
        request(&self.nats, &self.token, subjects::api(method), body, wait).await
    }

    /// An operator API call (`fleet.v1.admin.<area>.<method>`; the token must be an operator's).
    pub async fn admin(
        &self,
        area: &str,
        method: &str,
        body: &impl Serialize,
        wait: Duration,
    ) -> Result<Value, ApiError> {
        let body = serde_json::to_value(body)
            .map_err(|e| ApiError::new(ApiErrorCode::InternalError, format!("arguments: {e}")))?;
        request(&self.nats, &self.token, admin::subject(area, method), &body, wait).await
    }
}
