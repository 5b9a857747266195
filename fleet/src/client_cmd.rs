//! The client subcommands' flags: `fleet token`, `fleet invoke`, `fleet invoke-async`, `fleet job get|cancel|list`
//! and the operator subcommands. They talk to a running fleet over NATS through `fleet_client` (the plumbing and
//! the typed client), authenticate with `--token` or mint a dev token for `--user` with the key `fleet up` keeps
//! in `--data-dir`, print JSON on stdout, and exit non-zero with the spec's error code on any error.

use std::path::PathBuf;
use std::time::Duration;

use std::future::Future;

use fleet_client::api::{ApiClient, CallError, DEFAULT_DATA_DIR, connect, mint, resolve_url};
use fleet_client::creds::Role;
use fleet_client::nats_conn::{Connector, NatsAuthArgs, role_creds};
use fleet_proto::api::{ApiError, ApiErrorCode, ListToolsArgs, methods, parse_args};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

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

    /// The operator API client: the token first (a missing key is reported before any connection), then the
    /// connection.
    pub async fn client(&self) -> Result<ApiClient, ApiError> {
        let token = self.token()?;
        Ok(ApiClient::connect(&self.connector(), "operator", token)
            .await?
            .keeping_alive())
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

/// Sends one app API call with the typed client and returns its result as JSON. `body` is the subcommand's flags
/// as the method's arguments.
pub async fn call(args: &ClientArgs, method: &str, body: &Value, wait: Duration) -> Result<Value, ApiError> {
    let token = args.token()?;
    let client = ApiClient::connect(&args.connector(), "fleet-cli", token)
        .await?
        .keeping_alive_as_app();
    let c = &client;
    let call = Typed {
        client: c,
        method,
        body,
        wait,
    };
    match method {
        methods::TOOLS_LIST => call.send(|_: ListToolsArgs| c.list_tools(wait)).await,
        methods::TOOLS_INVOKE => call.send(|a| async move { c.invoke(&a, wait).await }).await,
        methods::TOOLS_INVOKE_ASYNC => call.send(|a| async move { c.invoke_async(&a, wait).await }).await,
        methods::TOOLS_GET_JOB => call.send(|a| async move { c.get_job(&a, wait).await }).await,
        methods::TOOLS_CANCEL_JOB => call.send(|a| async move { c.cancel_job(&a, wait).await }).await,
        methods::TOOLS_LIST_JOBS => call.send(|a| async move { c.list_jobs(&a, wait).await }).await,
        _ => client.call(method, body, wait).await,
    }
}

/// One app API call of the CLI: `body` as the method's arguments.
struct Typed<'a> {
    client: &'a ApiClient,
    method: &'a str,
    body: &'a Value,
    wait: Duration,
}

impl Typed<'_> {
    /// `send`s the body parsed as the method's arguments `A` (by the fleet's own parser, `parse_args`) and returns
    /// the result as JSON. Arguments that do not parse are sent as they are: the fleet refuses them exactly as it
    /// refuses any caller's (it checks the token first, then the arguments).
    async fn send<A, R, Fut>(self, send: impl FnOnce(A) -> Fut) -> Result<Value, ApiError>
    where
        A: DeserializeOwned,
        R: Serialize,
        Fut: Future<Output = Result<R, CallError>>,
    {
        let Ok(args) = parse_args::<A>(self.body) else {
            return self.client.call(self.method, self.body, self.wait).await;
        };
        printable(send(args).await?)
    }
}

/// A command's typed result as the JSON it prints.
pub fn printable(result: impl Serialize) -> Result<Value, ApiError> {
    serde_json::to_value(result)
        .map_err(|e| ApiError::new(ApiErrorCode::InternalError, format!("unprintable result: {e}")))
}
