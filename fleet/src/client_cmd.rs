//! The client subcommands: `fleet token`, `fleet invoke`, `fleet invoke-async`, `fleet job get|cancel|list`.
//! They talk to a running fleet over NATS, authenticate with `--token` or mint a dev token for `--user` with the
//! key `fleet up` keeps in `--data-dir`, print JSON on stdout, and exit non-zero with the spec's error code on any
//! error.

use std::path::{Path, PathBuf};
use std::time::Duration;

use fleet_proto::api::{ApiError, ApiErrorCode, ApiResponse, methods, subjects};
use serde_json::{Value, json};

use crate::auth::{DEFAULT_AUDIENCE, DEFAULT_ISSUER, DevKey, OPERATOR_AUDIENCE};
use crate::nats_auth::Role;
use crate::nats_conn::{Connector, NatsAuthArgs, role_creds};

/// The NATS URL clients use by default.
pub const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";

/// The data directory `fleet up` and the clients share by default.
pub const DEFAULT_DATA_DIR: &str = ".fleet";

/// Where `fleet up` records the URL of the nats-server it started.
pub fn nats_url_file(data_dir: &Path) -> PathBuf {
    data_dir.join("nats-url")
}

/// Connection and identity flags shared by every client subcommand.
#[derive(Debug, Clone, clap::Args)]
pub struct ClientArgs {
    /// NATS URL of the fleet (default: the one `fleet up` recorded in --data-dir, else nats://127.0.0.1:4222).
    #[arg(long, env = "FLEET_NATS_URL")]
    pub nats_url: Option<String>,
    /// The data directory of `fleet up` (holds the dev signing key and `nats/app.creds`).
    #[arg(long, env = "FLEET_DATA_DIR", default_value = DEFAULT_DATA_DIR)]
    pub data_dir: PathBuf,
    /// NATS credentials (default `<data-dir>/nats/app.creds`) and TLS.
    #[command(flatten)]
    pub nats: NatsAuthArgs,
    /// A JWT to present.
    #[arg(long, env = "FLEET_TOKEN", conflicts_with = "user")]
    pub token: Option<String>,
    /// Mint a dev token for this user with the data dir's signing key.
    #[arg(long)]
    pub user: Option<String>,
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

/// Connects a client (5 s connection timeout); a refusal or an unreadable credential is `AGENT_UNAVAILABLE`
/// with the one-line reason.
pub async fn connect(connector: &Connector, name: &str) -> Result<async_nats::Client, ApiError> {
    connector
        .connect(name)
        .await
        .map_err(|e| ApiError::new(ApiErrorCode::AgentUnavailable, e.to_string()))
}

/// Sends one request with `Authorization: Bearer <token>` to `subject` and unwraps the `ApiResponse`.
pub async fn request(
    client: &async_nats::Client,
    token: &str,
    subject: String,
    body: &Value,
    wait: Duration,
) -> Result<Value, ApiError> {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(subjects::AUTH_HEADER, format!("Bearer {token}").as_str());
    let payload = serde_json::to_vec(body).unwrap_or_default();
    let request = async_nats::Request::new()
        .headers(headers)
        .payload(payload.into())
        .timeout(Some(wait));
    let reply = client
        .send_request(subject.clone(), request)
        .await
        .map_err(|e| ApiError::new(ApiErrorCode::AgentUnavailable, format!("{subject}: {e}")))?;
    let response: ApiResponse<Value> = serde_json::from_slice(&reply.payload)
        .map_err(|e| ApiError::new(ApiErrorCode::InternalError, format!("unreadable answer: {e}")))?;
    response.into_result()
}

/// Connection flags of the operator subcommands (`fleet grant`, `fleet plugins …`): the client subcommands'
/// `--nats-url`, `--data-dir`, `--token`; without a token, an operator token is minted with the data dir's dev key.
#[derive(Debug, Clone, clap::Args)]
pub struct OperatorConn {
    /// NATS URL of the fleet (default: the one `fleet up` recorded in --data-dir, else nats://127.0.0.1:4222).
    #[arg(long, env = "FLEET_NATS_URL")]
    pub nats_url: Option<String>,
    /// The data directory of `fleet up` (its dev key mints an operator token when --token is absent; its
    /// `nats/operator.creds` is the default NATS credential).
    #[arg(long, env = "FLEET_DATA_DIR", default_value = DEFAULT_DATA_DIR)]
    pub data_dir: PathBuf,
    /// NATS credentials (default `<data-dir>/nats/operator.creds`) and TLS.
    #[command(flatten)]
    pub nats: NatsAuthArgs,
    /// An operator JWT to present.
    #[arg(long, env = "FLEET_TOKEN")]
    pub token: Option<String>,
}

impl OperatorConn {
    /// The URL to connect to.
    pub fn url(&self) -> String {
        resolve_url(self.nats_url.as_deref(), &self.data_dir)
    }

    /// `--token`, or an operator dev token (5 minutes).
    pub fn token(&self) -> Result<String, ApiError> {
        match &self.token {
            Some(t) => Ok(t.clone()),
            None => mint(&self.data_dir, "operator", Duration::from_secs(300), true),
        }
    }

    /// Where and how to connect (as the operator tooling user).
    pub fn connector(&self) -> Connector {
        self.nats
            .connector(&self.url(), Some(role_creds(&self.data_dir, Role::Operator)))
    }

    /// A connection to the fleet.
    pub async fn connect(&self) -> Result<async_nats::Client, ApiError> {
        connect(&self.connector(), "operator").await
    }
}

impl ClientArgs {
    /// The URL to connect to.
    pub fn url(&self) -> String {
        resolve_url(self.nats_url.as_deref(), &self.data_dir)
    }

    /// Where and how to connect (as an app user).
    pub fn connector(&self) -> Connector {
        self.nats
            .connector(&self.url(), Some(role_creds(&self.data_dir, Role::App)))
    }

    /// The token to present.
    pub fn token(&self) -> Result<String, ApiError> {
        if let Some(t) = &self.token {
            return Ok(t.clone());
        }
        let Some(user) = &self.user else {
            return Err(ApiError::new(
                ApiErrorCode::InvalidToken,
                "give --token JWT or --user U",
            ));
        };
        mint(&self.data_dir, user, Duration::from_secs(3600), false)
    }
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

/// Sends one API call and returns its result.
pub async fn call(args: &ClientArgs, method: &str, body: &Value, wait: Duration) -> Result<Value, ApiError> {
    let token = args.token()?;
    let client = connect(&args.connector(), "fleet-cli").await?;
    request(&client, &token, subjects::api(method), body, wait).await
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
