//! Request/response plumbing of the fleet's NATS API and the client the CLI, `loadtest` and the tests share:
//! where a local fleet (`fleet up`) leaves its URL and keys, dev tokens, one request with `Authorization: Bearer
//! <token>` unwrapped from the API envelope, and [`ApiClient`] (one connection, one token, the app API
//! `fleet.v1.api.tools.*` — a typed method per method, with the wire types of `fleet_proto::api` and a
//! [`CallError`] per failure — and the operator API `fleet.v1.admin.*`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use fleet_proto::admin::{self, credentials, creds, grants, plugins};
use fleet_proto::api::{
    ApiError, ApiErrorCode, ApiResponse, CancelJobArgs, CancelJobResult, GetJobArgs, InvokeArgs,
    InvokeAsyncArgs, InvokeAsyncResult, InvokePayload, JobQuotaDetails, JobSnapshot, ListJobsArgs,
    ListJobsResult, ListToolsArgs, ListToolsResult, methods, subjects,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
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
    connect_typed(connector, name).await.map_err(ApiError::from)
}

/// [`connect`], failing with [`CallError::Connect`].
async fn connect_typed(connector: &Connector, name: &str) -> Result<async_nats::Client, CallError> {
    connector
        .connect(name)
        .await
        .map_err(|e| CallError::Connect(e.to_string()))
}

/// Why a request got no answer (each is `agent_unavailable` on the wire's terms).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoAnswer {
    /// Nobody serves the subject (no front is up).
    NoResponders,
    /// No answer within the wait.
    TimedOut,
    /// The request is over the server's maximum payload.
    MaxPayloadExceeded,
    /// The connection was lost and re-established with the request in flight, and no answer came within
    /// [`nats_conn::RECONNECT_GRACE`]: its outcome is unknown.
    ConnectionLost,
    /// Nothing was heard from the front — no keepalive, no answer — for
    /// [`KEEPALIVE_SILENCE`](fleet_proto::api::subjects::KEEPALIVE_SILENCE): the request or its answer was lost
    /// in the cluster (a NATS server died with it); its outcome is unknown.
    Silent,
    /// Any other failure to send the request or receive its answer.
    Failed,
}

impl NoAnswer {
    fn of(kind: async_nats::RequestErrorKind) -> NoAnswer {
        use async_nats::RequestErrorKind as K;
        match kind {
            K::NoResponders => NoAnswer::NoResponders,
            K::TimedOut => NoAnswer::TimedOut,
            K::MaxPayloadExceeded => NoAnswer::MaxPayloadExceeded,
            _ => NoAnswer::Failed,
        }
    }
}

/// Why a call of [`ApiClient`] failed. [`CallError::code`] is the wire error code of each (what the CLI
/// prints): the fleet's own for [`CallError::Api`], `agent_unavailable` when there was no connection or no
/// answer, `internal_error` for an answer that is not the method's envelope. Never carries the token.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CallError {
    /// The fleet answered with an API error (`{ok: false, error}`); match on its `code` (and see
    /// [`CallError::job_quota`] for `job_quota_exceeded`).
    #[error("{0}")]
    Api(ApiError),
    /// No connection to the fleet: refused, unreachable, or unreadable credentials (the one-line reason).
    #[error("agent_unavailable: {0}")]
    Connect(String),
    /// The request on `subject` got no answer.
    #[error("agent_unavailable: {subject}: {detail}")]
    NoAnswer {
        /// The request's subject.
        subject: String,
        /// Why.
        kind: NoAnswer,
        /// The NATS client's reason.
        detail: String,
    },
    /// An answer came that is not the method's envelope (or not its result type).
    #[error("internal_error: unreadable answer: {0}")]
    Unreadable(String),
}

impl CallError {
    /// The wire error code.
    pub fn code(&self) -> ApiErrorCode {
        match self {
            CallError::Api(e) => e.code,
            CallError::Connect(_) | CallError::NoAnswer { .. } => ApiErrorCode::AgentUnavailable,
            CallError::Unreadable(_) => ApiErrorCode::InternalError,
        }
    }

    /// The fleet's error, when it answered with one.
    pub fn api_error(&self) -> Option<&ApiError> {
        match self {
            CallError::Api(e) => Some(e),
            _ => None,
        }
    }

    /// The details of a `job_quota_exceeded` (which quota, and for the retained-jobs cap `retry_after_ms`).
    pub fn job_quota(&self) -> Option<JobQuotaDetails> {
        self.api_error().and_then(ApiError::job_quota)
    }

    /// Whether the same call may succeed later (spec §10.10 "Retryable"; no connection or no answer is
    /// `agent_unavailable`, retryable).
    pub fn retryable(&self) -> bool {
        self.code().retryable()
    }
}

impl From<CallError> for ApiError {
    /// The error as the API states it: the fleet's own, or the code of [`CallError::code`] with the message.
    fn from(e: CallError) -> ApiError {
        match e {
            CallError::Api(e) => e,
            CallError::Connect(message) => ApiError::new(ApiErrorCode::AgentUnavailable, message),
            CallError::NoAnswer { subject, detail, .. } => {
                ApiError::new(ApiErrorCode::AgentUnavailable, format!("{subject}: {detail}"))
            }
            CallError::Unreadable(e) => {
                ApiError::new(ApiErrorCode::InternalError, format!("unreadable answer: {e}"))
            }
        }
    }
}

/// An API request: the `Authorization` header set to `authorization` (`Bearer <token>`, or whatever a test
/// presents), `body` as JSON, answered within `wait`.
pub fn api_request(authorization: &str, body: &impl Serialize, wait: Duration) -> async_nats::Request {
    let payload = serde_json::to_vec(body).unwrap_or_default();
    async_nats::Request::new()
        .headers(api_headers(authorization))
        .payload(payload.into())
        .timeout(Some(wait))
}

/// The headers of an API request: `Authorization` set to `authorization`.
fn api_headers(authorization: &str) -> async_nats::HeaderMap {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(subjects::AUTH_HEADER, authorization);
    headers
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
    send(client, token, subject, body, wait, Via::WatchReconnect)
        .await
        .map_err(ApiError::from)
}

/// How an [`ApiClient`]'s calls wait for their answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Waiting {
    /// Plain request/reply, given up [`nats_conn::RECONNECT_GRACE`] after the connection was re-established
    /// under it (the default).
    WatchReconnect,
    /// Plain request/reply for the whole wait.
    Plain,
    /// Keepalives asked for, coming to the reply subject (a connection of the fleet's own account).
    KeepaliveOwn,
    /// Keepalives asked for, coming on the events export (an app's connection: its requests cross a service
    /// import).
    KeepaliveThroughImport,
}

/// How one [`send`] waits for its answer.
enum Via<'a> {
    /// Keepalives asked for ([`nats_conn::Requester`]): fails once nothing was heard for `KEEPALIVE_SILENCE`.
    Keepalive(&'a nats_conn::Requester),
    /// Plain request/reply, given up [`nats_conn::RECONNECT_GRACE`] after the connection was re-established
    /// under it.
    WatchReconnect,
    /// Plain request/reply for the whole wait.
    Plain,
}

/// [`request`] with a typed result, waiting as `via` says. A request no front subscribed to is sent again for up
/// to [`NO_FRONT_WAIT`] (bounded by `wait`).
async fn send<T: DeserializeOwned>(
    client: &async_nats::Client,
    token: &str,
    subject: String,
    body: &impl Serialize,
    wait: Duration,
    via: Via<'_>,
) -> Result<T, CallError> {
    let give_up = tokio::time::Instant::now() + NO_FRONT_WAIT.min(wait);
    let mut pause = NO_FRONT_PAUSE;
    // Serialised once, sent again as it is.
    let authorization = bearer(token);
    let payload = bytes::Bytes::from(serde_json::to_vec(body).unwrap_or_default());
    let plain = || {
        async_nats::Request::new()
            .headers(api_headers(&authorization))
            .payload(payload.clone())
            .timeout(Some(wait))
    };
    let reply = loop {
        let sent = match via {
            Via::Keepalive(requester) => {
                let headers = api_headers(&authorization);
                requester
                    .request(subject.clone(), headers, payload.clone(), wait)
                    .await
            }
            Via::WatchReconnect => nats_conn::request(client, subject.clone(), plain()).await,
            Via::Plain => client
                .send_request(subject.clone(), plain())
                .await
                .map_err(RequestError::Nats),
        };
        match sent {
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
        RequestError::LostInReconnect | RequestError::Silent => CallError::NoAnswer {
            subject: subject.clone(),
            kind: if matches!(e, RequestError::Silent) {
                NoAnswer::Silent
            } else {
                NoAnswer::ConnectionLost
            },
            detail: format!("{e} (an invokeAsync may have created a job: list your jobs before retrying)"),
        },
        RequestError::Nats(e) => CallError::NoAnswer {
            subject: subject.clone(),
            kind: NoAnswer::of(e.kind()),
            detail: e.to_string(),
        },
    })?;
    let response: ApiResponse<T> =
        serde_json::from_slice(&reply.payload).map_err(|e| CallError::Unreadable(e.to_string()))?;
    response.into_result().map_err(CallError::Api)
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
///
/// The app API has a typed method per method (`tools.list` → [`ApiClient::list_tools`], …): the arguments and
/// results are the wire types of `fleet_proto::api`, failures a [`CallError`]. [`ApiClient::call`] sends any
/// method with any body (a test's malformed arguments, say).
#[derive(Clone)]
pub struct ApiClient {
    nats: async_nats::Client,
    token: String,
    /// How calls wait for their answer.
    waiting: Waiting,
    /// The keepalive requests' subscription, made at the first call.
    requester: Arc<tokio::sync::OnceCell<nats_conn::Requester>>,
}

impl std::fmt::Debug for ApiClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiClient").finish_non_exhaustive()
    }
}

impl ApiClient {
    /// A client on `nats` presenting `token`.
    pub fn new(nats: async_nats::Client, token: String) -> ApiClient {
        ApiClient {
            nats,
            token,
            waiting: Waiting::WatchReconnect,
            requester: Arc::default(),
        }
    }

    /// Connects through `connector` (connection name `name`).
    pub async fn connect(connector: &Connector, name: &str, token: String) -> Result<ApiClient, CallError> {
        Ok(ApiClient::new(connect_typed(connector, name).await?, token))
    }

    /// Calls that wait for their answer until their own wait ends ([`NoAnswer::TimedOut`]) even when their
    /// connection was re-established under them; by default they give up [`nats_conn::RECONNECT_GRACE`] after the
    /// reconnect ([`NoAnswer::ConnectionLost`]).
    pub fn waiting_through_reconnects(mut self) -> ApiClient {
        self.waiting = Waiting::Plain;
        self
    }

    /// Calls that ask the front for keepalives and give up once nothing was heard for
    /// [`KEEPALIVE_SILENCE`](fleet_proto::api::subjects::KEEPALIVE_SILENCE) ([`NoAnswer::Silent`]): a request or
    /// an answer lost inside the cluster costs that, not the call's whole wait. For a connection of the fleet's own
    /// account (the operator tooling): the keepalives come to the request's reply subject.
    pub fn keeping_alive(mut self) -> ApiClient {
        self.waiting = Waiting::KeepaliveOwn;
        self
    }

    /// [`ApiClient::keeping_alive`] for a connection of an app's account, whose requests reach the fronts through
    /// a service import that passes one message back (the answer): the keepalives come on the events export
    /// (`fleet.v1.events.keepalive.<token>`).
    pub fn keeping_alive_as_app(mut self) -> ApiClient {
        self.waiting = Waiting::KeepaliveThroughImport;
        self
    }

    /// One request through this client's way of waiting.
    async fn send<T: DeserializeOwned>(
        &self,
        subject: String,
        args: &impl Serialize,
        wait: Duration,
    ) -> Result<T, CallError> {
        let through_import = match self.waiting {
            Waiting::WatchReconnect => {
                return send(&self.nats, &self.token, subject, args, wait, Via::WatchReconnect).await;
            }
            Waiting::Plain => return send(&self.nats, &self.token, subject, args, wait, Via::Plain).await,
            Waiting::KeepaliveOwn => false,
            Waiting::KeepaliveThroughImport => true,
        };
        let requester = self
            .requester
            .get_or_try_init(|| async {
                if through_import {
                    nats_conn::Requester::through_import(&self.nats).await
                } else {
                    nats_conn::Requester::new(&self.nats).await
                }
            })
            .await
            .map_err(|e| CallError::NoAnswer {
                subject: subject.clone(),
                kind: NoAnswer::Failed,
                detail: format!("cannot subscribe the reply subjects: {e}"),
            })?;
        send(
            &self.nats,
            &self.token,
            subject,
            args,
            wait,
            Via::Keepalive(requester),
        )
        .await
    }

    /// The connection.
    pub fn nats(&self) -> &async_nats::Client {
        &self.nats
    }

    /// An app API call (`fleet.v1.api.<method>`, e.g. `tools.invoke`) with any body: its result, or the API
    /// error.
    pub async fn call(&self, method: &str, body: &Value, wait: Duration) -> Result<Value, ApiError> {
        self.app(method, body, wait).await.map_err(ApiError::from)
    }

    /// A typed app API call.
    async fn app<T: DeserializeOwned>(
        &self,
        method: &str,
        args: &impl Serialize,
        wait: Duration,
    ) -> Result<T, CallError> {
        self.send(subjects::api(method), args, wait).await
    }

    /// `tools.list`: the tools the fleet's workers have described.
    pub async fn list_tools(&self, wait: Duration) -> Result<ListToolsResult, CallError> {
        self.app(methods::TOOLS_LIST, &ListToolsArgs::default(), wait)
            .await
    }

    /// `tools.invoke`: one synchronous call; the plugin's payload. [`wait_for`] gives the wait the CLI uses.
    pub async fn invoke(&self, args: &InvokeArgs, wait: Duration) -> Result<InvokePayload, CallError> {
        self.app(methods::TOOLS_INVOKE, args, wait).await
    }

    /// `tools.invokeAsync`: a new job (`job_quota_exceeded`: see [`CallError::job_quota`]).
    pub async fn invoke_async(
        &self,
        args: &InvokeAsyncArgs,
        wait: Duration,
    ) -> Result<InvokeAsyncResult, CallError> {
        self.app(methods::TOOLS_INVOKE_ASYNC, args, wait).await
    }

    /// `tools.getJob`: the job's snapshot with its progress after `sinceSeq`.
    pub async fn get_job(&self, args: &GetJobArgs, wait: Duration) -> Result<JobSnapshot, CallError> {
        self.app(methods::TOOLS_GET_JOB, args, wait).await
    }

    /// `tools.cancelJob`.
    pub async fn cancel_job(
        &self,
        args: &CancelJobArgs,
        wait: Duration,
    ) -> Result<CancelJobResult, CallError> {
        self.app(methods::TOOLS_CANCEL_JOB, args, wait).await
    }

    /// `tools.listJobs`: one page of the caller's jobs, newest first.
    pub async fn list_jobs(&self, args: &ListJobsArgs, wait: Duration) -> Result<ListJobsResult, CallError> {
        self.app(methods::TOOLS_LIST_JOBS, args, wait).await
    }

    /// One operator API call with typed arguments and result (`fleet.v1.admin.<area>.<method>`; the token must be
    /// an operator's).
    async fn operator<T: DeserializeOwned>(
        &self,
        area: &str,
        method: &str,
        args: &impl Serialize,
        wait: Duration,
    ) -> Result<T, CallError> {
        self.send(admin::subject(area, method), args, wait).await
    }

    /// `admin.grants.set`: the grant as it is after the edit.
    pub async fn grants_set(
        &self,
        args: &grants::SetArgs,
        wait: Duration,
    ) -> Result<grants::Grant, CallError> {
        self.operator(grants::AREA, grants::SET, args, wait).await
    }

    /// `admin.grants.get`: the grant as it is.
    pub async fn grants_get(
        &self,
        args: &grants::GetArgs,
        wait: Duration,
    ) -> Result<grants::Grant, CallError> {
        self.operator(grants::AREA, grants::GET, args, wait).await
    }

    /// `admin.credentials.set`: the names now stored in that scope (never values).
    pub async fn credentials_set(
        &self,
        args: &credentials::SetArgs,
        wait: Duration,
    ) -> Result<credentials::Listed, CallError> {
        self.operator(credentials::AREA, credentials::SET, args, wait)
            .await
    }

    /// `admin.credentials.list`: the user's credentials, names and scopes only.
    pub async fn credentials_list(
        &self,
        args: &credentials::ListArgs,
        wait: Duration,
    ) -> Result<credentials::Listed, CallError> {
        self.operator(credentials::AREA, credentials::LIST, args, wait)
            .await
    }

    /// `admin.credentials.delete`: the names that were removed.
    pub async fn credentials_delete(
        &self,
        args: &credentials::DeleteArgs,
        wait: Duration,
    ) -> Result<credentials::Deleted, CallError> {
        self.operator(credentials::AREA, credentials::DELETE, args, wait)
            .await
    }

    /// `admin.credentials.rewrap`: every record wrapped under the keyring's first key.
    pub async fn credentials_rewrap(&self, wait: Duration) -> Result<credentials::Rewrapped, CallError> {
        self.operator(credentials::AREA, credentials::REWRAP, &json!({}), wait)
            .await
    }

    /// `admin.creds.issue`: a new app credential (its `.creds` text is a secret).
    pub async fn creds_issue(
        &self,
        args: &creds::NameArgs,
        wait: Duration,
    ) -> Result<creds::Issued, CallError> {
        self.operator(creds::AREA, creds::ISSUE, args, wait).await
    }

    /// `admin.creds.list`: every app credential issued.
    pub async fn creds_list(&self, wait: Duration) -> Result<creds::Listed, CallError> {
        self.operator(creds::AREA, creds::LIST, &json!({}), wait).await
    }

    /// `admin.creds.revoke`: the credential, revoked.
    pub async fn creds_revoke(
        &self,
        args: &creds::NameArgs,
        wait: Duration,
    ) -> Result<creds::Revoked, CallError> {
        self.operator(creds::AREA, creds::REVOKE, args, wait).await
    }

    /// `admin.plugins.install`: the version published.
    pub async fn plugins_install(
        &self,
        args: &plugins::InstallArgs,
        wait: Duration,
    ) -> Result<plugins::Published, CallError> {
        self.operator(plugins::AREA, plugins::INSTALL, args, wait).await
    }

    /// `admin.plugins.list`: every plugin published.
    pub async fn plugins_list(&self, wait: Duration) -> Result<plugins::Listed, CallError> {
        self.operator(plugins::AREA, plugins::LIST, &json!({}), wait)
            .await
    }

    /// `admin.plugins.remove`: the versions removed.
    pub async fn plugins_remove(
        &self,
        args: &plugins::RemoveArgs,
        wait: Duration,
    ) -> Result<plugins::Removed, CallError> {
        self.operator(plugins::AREA, plugins::REMOVE, args, wait).await
    }

    /// `admin.plugins.describe`: the plugin's record and described manifest.
    pub async fn plugins_describe(
        &self,
        args: &plugins::DescribeArgs,
        wait: Duration,
    ) -> Result<plugins::Described, CallError> {
        self.operator(plugins::AREA, plugins::DESCRIBE, args, wait).await
    }

    /// An operator API call with a raw body and result (for bodies the typed methods cannot send, e.g. a test's
    /// malformed ones).
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Each failure states the same code and message as the `ApiError` the raw calls return.
    #[test]
    fn call_errors_convert_to_the_api_error_they_print_as() {
        let quota = ApiError::job_quota_exceeded(JobQuotaDetails::Active { active: 5, max: 5 });
        let cases = [
            CallError::Api(quota.clone()),
            CallError::Connect("cannot connect to nats://127.0.0.1:1: connection refused".into()),
            CallError::NoAnswer {
                subject: "fleet.v1.api.tools.invoke".into(),
                kind: NoAnswer::TimedOut,
                detail: "request timed out: deadline has elapsed".into(),
            },
            CallError::Unreadable("expected value at line 1 column 1".into()),
        ];
        let codes = [
            ApiErrorCode::JobQuotaExceeded,
            ApiErrorCode::AgentUnavailable,
            ApiErrorCode::AgentUnavailable,
            ApiErrorCode::InternalError,
        ];
        for (e, code) in cases.into_iter().zip(codes) {
            assert_eq!(e.code(), code, "{e:?}");
            let printed = e.to_string();
            let api = ApiError::from(e);
            assert_eq!(api.code, code);
            assert_eq!(api.to_string(), printed);
        }
        assert_eq!(
            ApiError::from(CallError::NoAnswer {
                subject: "fleet.v1.api.tools.list".into(),
                kind: NoAnswer::NoResponders,
                detail: "no responders".into(),
            })
            .message,
            "fleet.v1.api.tools.list: no responders"
        );
        let e = CallError::Api(quota);
        assert!(e.retryable());
        assert_eq!(e.job_quota(), Some(JobQuotaDetails::Active { active: 5, max: 5 }));
        assert_eq!(CallError::Connect("x".into()).job_quota(), None);
    }
}
