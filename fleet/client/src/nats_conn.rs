//! Every NATS connection of the fleet is made here: `fleet up`, `fleet worker`, the client and operator
//! subcommands, `loadtest`, benches and tests. A connection takes a URL (a comma-separated list of servers), the
//! credentials of one NATS user (a standard `.creds` file) and, optionally, TLS (a CA, a client certificate and
//! key). It sets the inbox prefix the user's permissions allow (`_INBOX.<user name>`, read from the credentials'
//! JWT) and fails in one clear line naming the file and NATS's reason: no hang, no retry loop on a refusal.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::{ConnectErrorKind, ConnectOptions};
use fleet_proto::api::subjects::{
    ANSWER_TOKEN_HEADER, IMPORTED_REPLY_PREFIX, KEEPALIVE_EVENTS_PREFIX, KEEPALIVE_EVERY, KEEPALIVE_HEADER,
    KEEPALIVE_SILENCE, STATUS_ANSWERED, STATUS_HEADER, STATUS_WORKING, answer_token_ok, keepalive,
    keepalive_token_ok,
};

use fleet_proto::util::lock;

use crate::creds::{Role, creds_in, creds_user_name, inbox_prefix};

/// How long connecting may take before it fails.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a flush (or a drain) may wait for the server. A client whose server is gone waits for a reconnect
/// that may never come — a `fleet up` stopping after its nats-server died, a request whose connection dropped —
/// so past this the caller goes on without the confirmation.
pub const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// Why [`flush`] or [`drain`] did not confirm.
#[derive(Debug, thiserror::Error)]
pub enum FlushError {
    /// No confirmation within [`FLUSH_TIMEOUT`] (the server is unreachable).
    #[error("the NATS server did not confirm within {} s", FLUSH_TIMEOUT.as_secs())]
    TimedOut,
    /// A stop's wait ([`flush_for_stop`], [`drain_for_stop`]) found the connection down: nothing can be confirmed
    /// before a reconnect, which a stop does not wait for.
    #[error("the NATS connection is down: nothing to confirm")]
    Disconnected,
    /// The client refused (it is closed).
    #[error("flushing to NATS failed: {0}")]
    Flush(#[from] async_nats::client::FlushError),
    /// The client refused to drain (it is closed).
    #[error("draining the NATS connection failed: {0}")]
    Drain(#[from] async_nats::client::DrainError),
}

/// Writes out what `client` has queued (to the socket: the server may not have read it yet), at most
/// [`FLUSH_TIMEOUT`]. To know the server has processed it, [`round_trip`].
pub async fn flush(client: &async_nats::Client) -> Result<(), FlushError> {
    within_flush_timeout(client.flush()).await
}

/// Waits, at most [`FLUSH_TIMEOUT`], until the server has processed everything `client` sent before (a PING and
/// its PONG): a subscription made before this receives every message any connection publishes after it returns.
/// The barrier between subscribing and triggering what the subscription waits for.
pub async fn round_trip(client: &async_nats::Client) -> Result<(), FlushError> {
    within_flush_timeout(client.round_trip()).await
}

/// Drains `client` (unsubscribes everything, delivers what is buffered, closes), giving up after
/// [`FLUSH_TIMEOUT`].
pub async fn drain(client: &async_nats::Client) -> Result<(), FlushError> {
    within_flush_timeout(client.drain()).await
}

/// Whether `client` is connected now.
pub fn connected(client: &async_nats::Client) -> bool {
    client.connection_state() == async_nats::connection::State::Connected
}

/// How long a stopping process waits for `client`'s server to confirm something (a drained subscription's end, a
/// flush): [`FLUSH_TIMEOUT`] while connected; nothing while the connection is down — the confirmation could only
/// come after a reconnect, and a stop after its server died would otherwise spend [`FLUSH_TIMEOUT`] on every
/// confirmation of its sequence, one after the other.
pub fn stop_wait(client: &async_nats::Client) -> Duration {
    if connected(client) {
        FLUSH_TIMEOUT
    } else {
        Duration::ZERO
    }
}

/// Logs that `what` (e.g. "the API endpoints' drain") was not confirmed within a stop's wait, and why: the
/// connection is down, or the server did not answer.
pub fn warn_unconfirmed(client: &async_nats::Client, what: &str) {
    if connected(client) {
        tracing::warn!("the NATS server did not confirm {what}");
    } else {
        tracing::warn!("the NATS connection is down: {what} is not confirmed");
    }
}

/// [`flush`] for a stop: [`FlushError::Disconnected`] at once when the connection is down ([`stop_wait`]).
pub async fn flush_for_stop(client: &async_nats::Client) -> Result<(), FlushError> {
    if !connected(client) {
        return Err(FlushError::Disconnected);
    }
    flush(client).await
}

/// [`drain`] for a stop: when the connection is down nothing is waited for ([`FlushError::Disconnected`]), and
/// the client is left to its drop.
pub async fn drain_for_stop(client: &async_nats::Client) -> Result<(), FlushError> {
    if !connected(client) {
        return Err(FlushError::Disconnected);
    }
    drain(client).await
}

/// `wait`, given up after [`FLUSH_TIMEOUT`].
async fn within_flush_timeout<E>(
    wait: impl std::future::Future<Output = Result<(), E>>,
) -> Result<(), FlushError>
where
    FlushError: From<E>,
{
    tokio::time::timeout(FLUSH_TIMEOUT, wait)
        .await
        .map_err(|_| FlushError::TimedOut)??;
    Ok(())
}

/// How often [`request`] looks whether its connection was re-established.
pub const RECONNECT_CHECK: Duration = Duration::from_millis(50);

/// How long a [`request`] still waits for its answer after its connection was re-established: a request in
/// flight when its NATS server died is lost (or its answer is), and without this it would wait its whole
/// timeout (30 s for most API methods, a sync invoke's own timeout for a front's call to a worker) for an answer
/// that cannot come.
pub const RECONNECT_GRACE: Duration = Duration::from_secs(2);

/// Why [`request`] got no answer.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// The client's connection was lost and re-established while the request was in flight, and no answer
    /// came within [`RECONNECT_GRACE`] of the reconnect: whether the request was served is unknown.
    #[error(
        "the NATS connection was lost and re-established with the request in flight, and no answer came within \
         {} ms of the reconnect: its outcome is unknown",
        RECONNECT_GRACE.as_millis()
    )]
    LostInReconnect,
    /// The request asked for keepalives ([`Requester`]) and nothing came — neither one nor the answer — for
    /// [`KEEPALIVE_SILENCE`]: the request, or its answer, was lost on the way (a server of the cluster died with
    /// it), or the responder died. Whether it was served is unknown.
    #[error(
        "nothing was heard from the responder for {} ms (no keepalive, no answer): the request or its answer was \
         lost, its outcome is unknown",
        KEEPALIVE_SILENCE.as_millis()
    )]
    Silent,
    /// NATS's own failure (no responders, the request's timeout, a closed client).
    #[error(transparent)]
    Nats(#[from] async_nats::RequestError),
}

/// Requests whose responder says it is still working (the [`KEEPALIVE_HEADER`] protocol): one subscription per
/// connection on `<inbox>.*`, each request's messages routed to it by the last token of its reply subject — a
/// random 128-bit id per request. A request is answered, or fails as [`RequestError::Silent`] once nothing was
/// heard for [`KEEPALIVE_SILENCE`], or at its own timeout. Cheap to clone.
///
/// A requester of an app's account ([`Requester::through_import`]) also hears its keepalives on the events export
/// (`KEEPALIVE_EVENTS_PREFIX.<connection id>.<request id>`, both random, neither derived from the inbox), where
/// other apps may hear and publish: a message there is taken only with the request's own
/// [`ANSWER_TOKEN_HEADER`] secret.
#[derive(Clone)]
pub struct Requester {
    client: async_nats::Client,
    prefix: String,
    /// For a connection of an app's account: the random token prefix its keepalives are sent under.
    keepalive_prefix: Option<String>,
    pending: Arc<Mutex<HashMap<String, Pending>>>,
    _router: Arc<AbortOnDrop>,
}

/// One request in flight: its secret and where its messages go.
struct Pending {
    secret: String,
    to: tokio::sync::mpsc::UnboundedSender<async_nats::Message>,
}

/// 128 random bits as 32 lowercase hex digits (a request's id, its answer secret).
fn random_hex_128() -> String {
    format!("{:032x}", rand::random::<u128>())
}

impl std::fmt::Debug for Requester {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Requester")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// Aborts the task when the last [`Requester`] clone is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Removes a request's route when it ends, however it ends.
struct Route<'a> {
    pending: &'a Mutex<HashMap<String, Pending>>,
    token: String,
}

impl Drop for Route<'_> {
    fn drop(&mut self) {
        lock(self.pending).remove(&self.token);
    }
}

impl Requester {
    /// Subscribes `client`'s reply subjects for keepalive requests.
    ///
    /// # Errors
    /// The subscription failed (the client is closed).
    pub async fn new(client: &async_nats::Client) -> Result<Requester, async_nats::SubscribeError> {
        Requester::start(client, false).await
    }

    /// A requester for a connection of an app's account, whose requests reach the fronts through a service
    /// import: the fronts send its keepalives to `KEEPALIVE_EVENTS_PREFIX.<nuid>.<n>`, which it subscribes too.
    ///
    /// # Errors
    /// A subscription failed (the client is closed).
    pub async fn through_import(
        client: &async_nats::Client,
    ) -> Result<Requester, async_nats::SubscribeError> {
        Requester::start(client, true).await
    }

    async fn start(
        client: &async_nats::Client,
        imported: bool,
    ) -> Result<Requester, async_nats::SubscribeError> {
        use futures::StreamExt as _;
        let prefix = client.new_inbox();
        let replies = client.subscribe(format!("{prefix}.*")).await?;
        // Random, unrelated to the inbox (others hear the keepalive subjects; the inbox must stay unknown).
        let keepalive_prefix = imported.then(|| format!("{:016x}", rand::random::<u64>()));
        let mut messages = match &keepalive_prefix {
            Some(nuid) => {
                let keepalives = client
                    .subscribe(format!("{KEEPALIVE_EVENTS_PREFIX}.{nuid}.*"))
                    .await?;
                futures::stream::select(replies, keepalives).boxed()
            }
            None => replies.boxed(),
        };
        let pending: Arc<Mutex<HashMap<String, Pending>>> = Arc::default();
        let routes = pending.clone();
        let router = tokio::spawn(async move {
            while let Some(msg) = messages.next().await {
                let subject = msg.subject.as_str();
                let Some(id) = subject.rsplit('.').next() else {
                    continue;
                };
                let shared = subject.starts_with(KEEPALIVE_EVENTS_PREFIX);
                if let Some(p) = lock(&routes).get(id)
                    && (!shared || carries_secret(&msg, &p.secret))
                {
                    let _ = p.to.send(msg);
                }
            }
        });
        Ok(Requester {
            client: client.clone(),
            prefix,
            keepalive_prefix,
            pending,
            _router: Arc::new(AbortOnDrop(router)),
        })
    }

    /// Sends `payload` with `headers` (plus [`KEEPALIVE_HEADER`]) to `subject` and waits for the answer, at most
    /// `timeout`, and at most [`KEEPALIVE_SILENCE`] without hearing from the responder.
    pub async fn request(
        &self,
        subject: String,
        mut headers: async_nats::HeaderMap,
        payload: bytes::Bytes,
        timeout: Duration,
    ) -> Result<async_nats::Message, RequestError> {
        use async_nats::client::RequestErrorKind as Kind;
        let token = random_hex_128();
        let secret = random_hex_128();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        match &self.keepalive_prefix {
            Some(conn) => {
                headers.insert(KEEPALIVE_HEADER, format!("{conn}.{token}").as_str());
                headers.insert(ANSWER_TOKEN_HEADER, secret.as_str());
            }
            None => headers.insert(KEEPALIVE_HEADER, "1"),
        }
        lock(&self.pending).insert(token.clone(), Pending { secret, to: tx });
        let _route = Route {
            pending: &self.pending,
            token: token.clone(),
        };
        self.client
            .publish_with_reply_and_headers(subject, format!("{}.{token}", self.prefix), headers, payload)
            .await
            .map_err(|e| {
                let kind = match e.kind() {
                    async_nats::client::PublishErrorKind::MaxPayloadExceeded => Kind::MaxPayloadExceeded,
                    async_nats::client::PublishErrorKind::InvalidSubject => Kind::InvalidSubject,
                    async_nats::client::PublishErrorKind::Send => Kind::Other,
                };
                async_nats::RequestError::with_source(kind, e)
            })?;
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let silent_at = tokio::time::Instant::now() + KEEPALIVE_SILENCE;
            let msg = match tokio::time::timeout_at(deadline.min(silent_at), rx.recv()).await {
                Ok(Some(msg)) => msg,
                Ok(None) => return Err(async_nats::RequestError::new(Kind::Other).into()),
                Err(_) if tokio::time::Instant::now() >= deadline => {
                    return Err(async_nats::RequestError::new(Kind::TimedOut).into());
                }
                Err(_) => return Err(RequestError::Silent),
            };
            if msg.status == Some(async_nats::StatusCode::NO_RESPONDERS) {
                return Err(async_nats::RequestError::new(Kind::NoResponders).into());
            }
            let working = msg
                .headers
                .as_ref()
                .and_then(|h| h.get(STATUS_HEADER))
                .is_some_and(|v| v.as_str() == STATUS_WORKING);
            if !working {
                return Ok(msg);
            }
        }
    }
}

/// The reply subject of `msg` when it came through a service import from another account (an app's request):
/// one of the subjects nats-server maps such replies to ([`IMPORTED_REPLY_PREFIX`]).
pub fn imported_reply(msg: &async_nats::Message) -> Option<&str> {
    msg.reply
        .as_ref()
        .map(|r| r.as_str())
        .filter(|r| r.starts_with(IMPORTED_REPLY_PREFIX))
}

/// Where the keepalives of `msg` go, if it asked for them: its reply subject, or — for a request imported from
/// another account (an app's), whose response mapping passes one message, the answer — the keepalive subject
/// of the token it gave (`KEEPALIVE_EVENTS_PREFIX.<token>`; none for a token that is not `keepalive_token_ok`).
fn keepalive_subject(msg: &async_nats::Message) -> Option<String> {
    let asked = msg.headers.as_ref()?.get(KEEPALIVE_HEADER)?.as_str();
    let reply = msg.reply.as_ref()?.as_str();
    if imported_reply(msg).is_none() {
        return Some(reply.to_owned());
    }
    keepalive_token_ok(asked).then(|| keepalive(asked))
}

/// Whether `msg` carries [`ANSWER_TOKEN_HEADER`] `secret` (compared in constant time).
fn carries_secret(msg: &async_nats::Message, secret: &str) -> bool {
    msg.headers
        .as_ref()
        .and_then(|h| h.get(ANSWER_TOKEN_HEADER))
        .is_some_and(|v| {
            let (a, b) = (v.as_str().as_bytes(), secret.as_bytes());
            a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
        })
}

/// The headers of a message a responder sends to `msg`'s keepalive subject: `status`, and `msg`'s
/// [`ANSWER_TOKEN_HEADER`] when it gave a well-formed one.
fn keepalive_headers(msg: &async_nats::Message, status: &str) -> async_nats::HeaderMap {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(STATUS_HEADER, status);
    if let Some(secret) = msg
        .headers
        .as_ref()
        .and_then(|h| h.get(ANSWER_TOKEN_HEADER))
        .map(|v| v.as_str())
        .filter(|v| answer_token_ok(v))
    {
        headers.insert(ANSWER_TOKEN_HEADER, secret);
    }
    headers
}

/// Publishes `answer` — what `msg` was just answered — again on the keepalive subject of `msg`, with
/// [`STATUS_HEADER`] [`STATUS_ANSWERED`], when `msg` came from another account and asked for keepalives: a
/// [`Requester::through_import`] whose answer was lost with its server takes this copy for the answer. Nothing
/// for any other request.
pub async fn publish_answer_copy(
    client: &async_nats::Client,
    msg: &async_nats::Message,
    answer: bytes::Bytes,
) {
    if imported_reply(msg).is_none() {
        return;
    }
    if let Some(subject) = keepalive_subject(msg) {
        let headers = keepalive_headers(msg, STATUS_ANSWERED);
        let _ = client.publish_with_headers(subject, headers, answer).await;
    }
}

/// Runs `work` — the handling of `msg` — and, when `msg` asked for keepalives ([`KEEPALIVE_HEADER`]), tells the
/// requester every [`KEEPALIVE_EVERY`] that it is still working ([`keepalive_subject`]), until `work` ends (the
/// caller then publishes the answer).
///
/// The keepalives come from a task of their own, not from the task polling `work`: a long step inside `work`
/// (a synchronous stretch of a plugin's start, a slow poll on a busy machine) must not silence them while the
/// process is alive and its runtime has a thread free. The task ends with `work` (or when this future is dropped).
pub async fn keeping_alive<F: std::future::Future>(
    client: &async_nats::Client,
    msg: &async_nats::Message,
    work: F,
) -> F::Output {
    let Some(reply) = keepalive_subject(msg) else {
        return work.await;
    };
    let client = client.clone();
    let headers = keepalive_headers(msg, STATUS_WORKING);
    let ticking = tokio::spawn(async move {
        let mut tick =
            tokio::time::interval_at(tokio::time::Instant::now() + KEEPALIVE_EVERY, KEEPALIVE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let headers = headers.clone();
            let _ = client
                .publish_with_headers(reply.clone(), headers, bytes::Bytes::new())
                .await;
        }
    });
    let _stop = AbortOnDrop(ticking);
    work.await
}

/// Sends `request` to `subject` and waits for its answer (at most the request's own timeout). Every request of
/// the fleet that crosses a server goes through here — a client's to the API, a front's to a worker — so a
/// connection that fails over to another server of the cluster costs a caller [`RECONNECT_GRACE`], not the
/// request's whole timeout.
pub async fn request(
    client: &async_nats::Client,
    subject: String,
    request: async_nats::Request,
) -> Result<async_nats::Message, RequestError> {
    let stats = client.statistics();
    let connects = stats.connects.load(std::sync::atomic::Ordering::Relaxed);
    let send = client.send_request(subject, request);
    tokio::pin!(send);
    let mut check = tokio::time::interval(RECONNECT_CHECK);
    // Once the connection was re-established under the request: how long its answer may still take.
    let mut lost_by: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            reply = &mut send => return Ok(reply?),
            _ = check.tick() => {
                let now = tokio::time::Instant::now();
                match lost_by {
                    None if stats.connects.load(std::sync::atomic::Ordering::Relaxed) != connects => {
                        lost_by = Some(now + RECONNECT_GRACE);
                    }
                    Some(by) if now >= by => return Err(RequestError::LostInReconnect),
                    _ => {}
                }
            }
        }
    }
}

/// The directory, under a data dir, where `fleet up` keeps the NATS auth material and each role's `.creds`.
pub fn auth_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("nats")
}

/// `<data-dir>/nats/<role>.creds`.
pub fn role_creds(data_dir: &Path, role: Role) -> PathBuf {
    creds_in(&auth_dir(data_dir), role)
}

/// The NATS credential and TLS flags every fleet command takes (this exact interface: scripts use it).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct NatsAuthArgs {
    /// A NATS credentials file (`.creds`: a user JWT and its nkey seed). Default: the role's file that `fleet
    /// up` wrote in --data-dir (`<data-dir>/nats/<role>.creds`), when it exists.
    #[arg(long, env = "FLEET_NATS_CREDS")]
    pub nats_creds: Option<PathBuf>,
    /// PEM file of the CA(s) that sign the NATS servers' certificates (turns TLS on).
    #[arg(long, env = "FLEET_NATS_TLS_CA")]
    pub nats_tls_ca: Option<PathBuf>,
    /// PEM client certificate for TLS client authentication (with --nats-tls-key).
    #[arg(long, env = "FLEET_NATS_TLS_CERT", requires = "nats_tls_key")]
    pub nats_tls_cert: Option<PathBuf>,
    /// PEM private key of --nats-tls-cert.
    #[arg(long, env = "FLEET_NATS_TLS_KEY", requires = "nats_tls_cert")]
    pub nats_tls_key: Option<PathBuf>,
}

impl NatsAuthArgs {
    /// A connector to `url` with these flags; without `--nats-creds`, `default_creds` when that file exists.
    pub fn connector(&self, url: &str, default_creds: Option<PathBuf>) -> Connector {
        let creds = self
            .nats_creds
            .clone()
            .or_else(|| default_creds.filter(|p| p.exists()));
        Connector {
            url: url.to_owned(),
            creds,
            tls: Tls {
                ca: self.nats_tls_ca.clone(),
                cert: self.nats_tls_cert.clone(),
                key: self.nats_tls_key.clone(),
            },
        }
    }
}

/// TLS settings of a connection.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tls {
    /// CA bundle (PEM); TLS is required when set.
    pub ca: Option<PathBuf>,
    /// Client certificate (PEM).
    pub cert: Option<PathBuf>,
    /// Client key (PEM).
    pub key: Option<PathBuf>,
}

impl Tls {
    /// Whether any TLS setting is given.
    pub fn enabled(&self) -> bool {
        self.ca.is_some() || self.cert.is_some()
    }
}

/// Why a connection could not be made. Messages name the file and NATS's reason, never a secret.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The credentials file cannot be read or is not a `.creds` file.
    #[error("NATS credentials {}: {reason}", path.display())]
    Creds {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A TLS file is missing.
    #[error("NATS TLS {what} {}: {reason}", path.display())]
    TlsFile {
        /// Which one (`CA`, `certificate`, `key`).
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The server refused the credentials (or their absence).
    #[error("NATS at {url} refused {}: {reason}{}", who(creds.as_deref()), hint(creds.as_deref()))]
    Refused {
        /// The server(s).
        url: String,
        /// The credentials presented.
        creds: Option<PathBuf>,
        /// NATS's reason.
        reason: String,
    },
    /// Anything else: unreachable, TLS handshake, timeout, bad URL.
    #[error("cannot connect to {url}{}: {reason}", with(creds.as_deref()))]
    Failed {
        /// The server(s).
        url: String,
        /// The credentials presented.
        creds: Option<PathBuf>,
        /// NATS's reason.
        reason: String,
    },
}

fn who(creds: Option<&Path>) -> String {
    match creds {
        Some(p) => format!("the credentials in {}", p.display()),
        None => "a connection without credentials".to_owned(),
    }
}

fn hint(creds: Option<&Path>) -> &'static str {
    match creds {
        Some(_) => " (revoked, expired, or not issued by this fleet's operator?)",
        None => {
            " (pass --nats-creds FILE or FLEET_NATS_CREDS; `fleet up` writes each role's file as <data-dir>/nats/<role>.creds)"
        }
    }
}

fn with(creds: Option<&Path>) -> String {
    creds
        .map(|p| format!(" with {}", p.display()))
        .unwrap_or_default()
}

/// Where and how to connect. Cheap to clone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connector {
    /// The server URL, or several separated by commas.
    pub url: String,
    /// The credentials file, if any.
    pub creds: Option<PathBuf>,
    /// TLS.
    pub tls: Tls,
}

impl Connector {
    /// A connector with `creds` and no TLS.
    pub fn new(url: impl Into<String>, creds: Option<PathBuf>) -> Connector {
        Connector {
            url: url.into(),
            creds,
            tls: Tls::default(),
        }
    }

    /// The same server and TLS with other credentials.
    pub fn with_creds(&self, creds: Option<PathBuf>) -> Connector {
        Connector {
            creds,
            ..self.clone()
        }
    }

    /// The servers, split on commas.
    pub fn servers(&self) -> Vec<String> {
        self.url
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    }

    /// Connects with default options (connection name `name`).
    pub async fn connect(&self, name: &str) -> Result<async_nats::Client, ConnectError> {
        self.connect_with(name, ConnectOptions::new()).await
    }

    /// Connects with `options` (event callback, capacities, …) plus the credentials, the inbox prefix, TLS and
    /// the connection timeout.
    pub async fn connect_with(
        &self,
        name: &str,
        options: ConnectOptions,
    ) -> Result<async_nats::Client, ConnectError> {
        let mut options = options.name(name).connection_timeout(CONNECT_TIMEOUT);
        if let Some(path) = &self.creds {
            let text = std::fs::read_to_string(path).map_err(|e| ConnectError::Creds {
                path: path.clone(),
                reason: e.to_string(),
            })?;
            let user = creds_user_name(&text).ok_or_else(|| ConnectError::Creds {
                path: path.clone(),
                reason: "not a NATS credentials file (a user JWT and its nkey seed)".to_owned(),
            })?;
            options = options
                .credentials(&text)
                .map_err(|_| ConnectError::Creds {
                    path: path.clone(),
                    reason: "not a NATS credentials file (a user JWT and its nkey seed)".to_owned(),
                })?
                .custom_inbox_prefix(inbox_prefix(&user));
        }
        if let Some(ca) = &self.tls.ca {
            check_file("CA", ca)?;
            options = options.add_root_certificates(ca.clone()).require_tls(true);
        }
        if let (Some(cert), Some(key)) = (&self.tls.cert, &self.tls.key) {
            check_file("certificate", cert)?;
            check_file("key", key)?;
            options = options
                .add_client_certificate(cert.clone(), key.clone())
                .require_tls(true);
        }
        let servers = self.servers();
        let addrs: Vec<async_nats::ServerAddr> = servers
            .iter()
            .map(|s| s.parse())
            .collect::<Result<_, _>>()
            .map_err(|e: std::io::Error| ConnectError::Failed {
                url: self.url.clone(),
                creds: self.creds.clone(),
                reason: e.to_string(),
            })?;
        options.connect(addrs).await.map_err(|e| match e.kind() {
            ConnectErrorKind::AuthorizationViolation | ConnectErrorKind::Authentication => {
                ConnectError::Refused {
                    url: self.url.clone(),
                    creds: self.creds.clone(),
                    reason: e.to_string(),
                }
            }
            _ => ConnectError::Failed {
                url: self.url.clone(),
                creds: self.creds.clone(),
                reason: e.to_string(),
            },
        })
    }
}

fn check_file(what: &'static str, path: &Path) -> Result<(), ConnectError> {
    std::fs::metadata(path)
        .map(|_| ())
        .map_err(|e| ConnectError::TlsFile {
            what,
            path: path.to_path_buf(),
            reason: e.to_string(),
        })
}
