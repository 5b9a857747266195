//! Request/response plumbing of the fleet's NATS API and the typed client the CLI, `loadtest`, the benches and
//! the tests share: where a local fleet (`fleet up`) leaves its URL and keys, dev tokens, one request with
//! `Authorization: Bearer <token>` unwrapped from the API envelope, and [`ApiClient`] (one connection, one token,
//! the app API `fleet.v1.api.tools.*` and the operator API `fleet.v1.admin.*`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use fleet_proto::admin;
use fleet_proto::api::{ApiError, ApiErrorCode, ApiResponse, methods, subjects};
use serde::Serialize;
use serde_json::{Value, json};

use crate::auth::{DEFAULT_AUDIENCE, DEFAULT_ISSUER, DevKey, OPERATOR_AUDIENCE};
use crate::nats_conn::{self, Connector, RequestError};

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

/// How long [`request`] keeps sending again a request no front subscribed to ("no responders": every front
/// replica restarting or failing over to another NATS server) before it answers `agent_unavailable`. A front
/// re-subscribes within a second of its reconnect; a fleet with no front at all is reported after this.
pub const NO_FRONT_WAIT: Duration = Duration::from_secs(5);
/// The first pause before a request that had no responders is sent again; it doubles up to [`NO_FRONT_PAUSE_MAX`].
const NO_FRONT_PAUSE: Duration = Duration::from_millis(50);
const NO_FRONT_PAUSE_MAX: Duration = Duration::from_millis(500);

/// Sends one request with `Authorization: Bearer <token>` to `subject` and unwraps the `ApiResponse`. A request
/// that no front subscribed to is sent again for up to [`NO_FRONT_WAIT`] (bounded by `wait`). When the
/// connection is lost and re-established while it waits (its server died: the request or its answer went with
/// it), it gives up [`nats_conn::RECONNECT_GRACE`] after the reconnect with `agent_unavailable` (retriable), naming the
/// unknown outcome.
pub async fn request(
    client: &async_nats::Client,
    token: &str,
    subject: String,
    body: &Value,
    wait: Duration,
) -> Result<Value, ApiError> {
    let give_up = tokio::time::Instant::now() + NO_FRONT_WAIT.min(wait);
    let mut pause = NO_FRONT_PAUSE;
    let reply = loop {
        let request = api_request(&bearer(token), body, wait);
        match nats_conn::request(client, subject.clone(), request).await {
            // No front subscribed at this instant (a replica failing over to another server, or restarting):
            // nothing ran, so the request is sent again, at growing intervals.
            Err(RequestError::Nats(e))
                if e.kind() == async_nats::client::RequestErrorKind::NoResponders
                    && tokio::time::Instant::now() + pause < give_up =>
            {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(NO_FRONT_PAUSE_MAX);
            }
            other => break other,
        }
    }
    .map_err(|e| match e {
        RequestError::LostInReconnect => ApiError::new(
            ApiErrorCode::AgentUnavailable,
            format!("{subject}: {e} (an invokeAsync may have created a job: list your jobs before retrying)"),
        ),
        RequestError::Nats(e) => ApiError::new(ApiErrorCode::AgentUnavailable, format!("{subject}: {e}")),
    })?;
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
