//! Every NATS connection of the fleet is made here: `fleet up`, `fleet worker`, the client and operator
//! subcommands, `loadtest`, benches and tests. A connection takes a URL (a comma-separated list of servers), the
//! credentials of one NATS user (a standard `.creds` file) and, optionally, TLS (a CA, a client certificate and
//! key). It sets the inbox prefix the user's permissions allow (`_INBOX.<user name>`, read from the credentials'
//! JWT) and fails in one clear line naming the file and NATS's reason: no hang, no retry loop on a refusal.

use std::path::{Path, PathBuf};
use std::time::Duration;

use async_nats::{ConnectErrorKind, ConnectOptions};

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
    /// The client refused (it is closed).
    #[error("flushing to NATS failed: {0}")]
    Flush(#[from] async_nats::client::FlushError),
    /// The client refused to drain (it is closed).
    #[error("draining the NATS connection failed: {0}")]
    Drain(#[from] async_nats::client::DrainError),
}

/// Writes out what `client` has queued and waits for the server's confirmation, at most [`FLUSH_TIMEOUT`].
pub async fn flush(client: &async_nats::Client) -> Result<(), FlushError> {
    tokio::time::timeout(FLUSH_TIMEOUT, client.flush())
        .await
        .map_err(|_| FlushError::TimedOut)??;
    Ok(())
}

/// Drains `client` (unsubscribes everything, delivers what is buffered, closes), giving up after
/// [`FLUSH_TIMEOUT`].
pub async fn drain(client: &async_nats::Client) -> Result<(), FlushError> {
    tokio::time::timeout(FLUSH_TIMEOUT, client.drain())
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
    /// NATS's own failure (no responders, the request's timeout, a closed client).
    #[error(transparent)]
    Nats(#[from] async_nats::RequestError),
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
