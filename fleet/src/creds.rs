//! App credentials: issued, listed and revoked by the operator, without restarting NATS.
//!
//! The front serves `fleet.v1.admin.creds.{issue,list,revoke}` (operator tokens only, like every operator API)
//! when it holds the issuer material (`--nats-auth-dir`, or `<data-dir>/nats` of `fleet up`): the APP account's
//! signing key signs each new user (permissions of [`permissions::app_user`]: the API, its own inbox, the events),
//! and a revocation re-signs the APP account JWT with the revoked user keys and pushes it to the servers through
//! the SYS user (`$SYS.REQ.CLAIMS.UPDATE`): the server closes the user's connections and refuses it from then on.
//!
//! What was issued is kept in the KV bucket `<prefix>_app_creds` (key: the name; value: [`CredRecord`], never the
//! seed or the `.creds` text, which only the caller of `issue` receives). At start the front pushes the
//! revocations again, so they survive a server whose resolver directory was lost or a baseline account JWT that
//! changed.
//!
//! The CLI: `fleet creds issue --name NAME [--out FILE]`, `fleet creds list`, `fleet creds revoke NAME`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, kv};
use fleet_proto::admin::creds::{AREA, CredRecord, ISSUE, Issued, LIST, Listed, NameArgs, REVOKE, Revoked};
use fleet_proto::admin::{ADMIN_QUEUE_GROUP, parse_args};
use fleet_proto::api::{ApiError, ApiErrorCode};
use serde_json::{Value, json};

use crate::client_cmd::{OperatorConn, printable};
use crate::nats_auth::{self, AuthMaterial, permissions, push_account_jwt};
use crate::operator;
use fleet_client::auth::OperatorVerifier;
use fleet_client::creds::{Role, inbox_prefix};
use fleet_store::cas::{Edit, Target, compare_and_set};
use fleet_store::settings::CRED_RECORD_MAX_BYTES;
use fleet_store::{Op, Revisioned, StoreSettings};

/// Why a credentials operation failed.
#[derive(Debug, thiserror::Error)]
pub enum CredsError {
    /// The name is not valid.
    #[error("{0}")]
    Name(String),
    /// An active credential of that name exists.
    #[error("an app credential named {0:?} exists and is not revoked; revoke it first")]
    Exists(String),
    /// None of that name.
    #[error("no app credential named {0:?}")]
    NotFound(String),
    /// Signing or pushing.
    #[error("{0}")]
    Auth(#[from] nats_auth::NatsAuthError),
    /// The bucket.
    #[error("app credentials bucket: {0}")]
    Store(String),
}

impl From<fleet_store::StoreError> for CredsError {
    fn from(e: fleet_store::StoreError) -> CredsError {
        CredsError::Store(e.to_string())
    }
}

impl CredsError {
    /// The API error (codes of the operator API).
    pub fn to_api_error(&self) -> ApiError {
        let code = match self {
            CredsError::Name(_) => ApiErrorCode::InvalidArg,
            CredsError::Exists(_) => ApiErrorCode::InvalidArg,
            CredsError::NotFound(_) => ApiErrorCode::NotFound,
            CredsError::Auth(_) | CredsError::Store(_) => ApiErrorCode::InternalError,
        };
        ApiError::new(code, self.to_string())
    }
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Issues and revokes app credentials. Cheap to clone.
#[derive(Clone)]
pub struct Issuer {
    material: Arc<AuthMaterial>,
    kv: kv::Store,
    sys: async_nats::Client,
}

impl std::fmt::Debug for Issuer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Issuer").finish_non_exhaustive()
    }
}

impl Issuer {
    /// An issuer over `material` (read from the auth dir), the bucket under `settings` (created by fronts) and a
    /// connection as the SYS user (for pushing account updates).
    pub async fn open(
        js: &jetstream::Context,
        settings: &StoreSettings,
        material: AuthMaterial,
        sys: async_nats::Client,
    ) -> Result<Issuer, CredsError> {
        let kv = fleet_store::provision::key_value(js, settings.app_creds_kv_config(), settings.provision)
            .await
            .map_err(|e| CredsError::Store(e.to_string()))?;
        Ok(Issuer {
            material: Arc::new(material),
            kv,
            sys,
        })
    }

    fn check_name(name: &str) -> Result<(), CredsError> {
        nats_auth::validate_user_name(name).map_err(|e| CredsError::Name(e.to_string()))?;
        if Role::ALL.iter().any(|r| r.as_str() == name) {
            return Err(CredsError::Name(format!(
                "{name:?} is the name of one of the fleet's own users"
            )));
        }
        Ok(())
    }

    async fn record(&self, name: &str) -> Result<Option<(CredRecord, u64)>, CredsError> {
        let entry = self
            .kv
            .entry(name)
            .await
            .map_err(|e| CredsError::Store(e.to_string()))?;
        match entry {
            Some(e) if e.operation == kv::Operation::Put => {
                let record =
                    serde_json::from_slice(&e.value).map_err(|e| CredsError::Store(e.to_string()))?;
                Ok(Some((record, e.revision)))
            }
            // Deleted or purged (only by hand): as if never issued.
            Some(_) | None => Ok(None),
        }
    }

    /// Issues a new credential named `name`; returns its record and the `.creds` text (a secret, for the
    /// caller alone).
    pub async fn issue(&self, name: &str) -> Result<(CredRecord, String), CredsError> {
        Self::check_name(name)?;
        let committed = compare_and_set(
            self.target(name),
            None,
            |existing: Option<Revisioned<CredRecord>>| {
                let existing = existing.map(|r| r.value);
                if let Some(r) = &existing
                    && r.revoked_at.is_none()
                {
                    return Err(CredsError::Exists(name.to_owned()));
                }
                let user = self.material.issue_app_user(name, &permissions::app_user(name))?;
                let mut revoked_keys = BTreeMap::new();
                if let Some(old) = &existing {
                    revoked_keys.clone_from(&old.revoked_keys);
                    if let Some(at) = old.revoked_at {
                        revoked_keys.insert(old.public_key.clone(), at);
                    }
                }
                let record = CredRecord {
                    name: name.to_owned(),
                    public_key: user.public_key.clone(),
                    issued_at: user.issued_at,
                    revoked_at: None,
                    revoked_keys,
                };
                Ok(Edit::Write(record, user.creds))
            },
        )
        .await?;
        let record = committed
            .written
            .map(|w| w.value)
            .ok_or_else(|| CredsError::Store("the credential record was not written".to_owned()))?;
        Ok((record, committed.out))
    }

    /// Every credential ever issued, by name.
    pub async fn list(&self) -> Result<Vec<CredRecord>, CredsError> {
        use futures::TryStreamExt as _;
        let names: Vec<String> = match self.kv.keys().await {
            Ok(keys) => keys
                .try_collect()
                .await
                .map_err(|e| CredsError::Store(e.to_string()))?,
            Err(e) => return Err(CredsError::Store(e.to_string())),
        };
        let mut out = Vec::new();
        for name in names {
            if let Some((r, _)) = self.record(&name).await? {
                out.push(r);
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Revokes the credential `name` (its current key): the servers close its connections and refuse it.
    pub async fn revoke(&self, name: &str) -> Result<CredRecord, CredsError> {
        let committed = compare_and_set(
            self.target(name),
            None,
            |current: Option<Revisioned<CredRecord>>| {
                let Some(mut record) = current.map(|r| r.value) else {
                    return Err(CredsError::NotFound(name.to_owned()));
                };
                if record.revoked_at.is_some() {
                    return Ok(Edit::Keep(Some(record)));
                }
                // At or after the user JWT's `iat`: the server refuses every JWT of the key issued until then.
                record.revoked_at = Some(now_secs().max(record.issued_at));
                Ok(Edit::Write(record, None))
            },
        )
        .await?;
        let record = committed
            .written
            .map(|w| w.value)
            .or(committed.out)
            .ok_or_else(|| CredsError::NotFound(name.to_owned()))?;
        self.push_revocations().await?;
        Ok(record)
    }

    /// The compare-and-set target of the record `name`.
    fn target<'a>(&'a self, name: &'a str) -> Target<'a> {
        Target {
            kv: &self.kv,
            key: name,
            op: Op::EditCredential,
            limit: ("app credential record", CRED_RECORD_MAX_BYTES),
        }
    }

    /// Signs the APP account with every revocation on record and pushes it to the servers.
    pub async fn push_revocations(&self) -> Result<usize, CredsError> {
        let mut revoked = BTreeMap::new();
        for r in self.list().await? {
            revoked.extend(r.revoked_keys.clone());
            if let Some(at) = r.revoked_at {
                revoked.insert(r.public_key.clone(), at);
            }
        }
        if revoked.is_empty() {
            return Ok(0);
        }
        let jwt = self.material.app_account_jwt_with_revocations(&revoked)?;
        push_account_jwt(&self.sys, &jwt).await?;
        Ok(revoked.len())
    }
}

/// Serves `fleet.v1.admin.creds.*` (operator tokens only), after pushing the revocations on record.
pub async fn serve_admin(
    client: async_nats::Client,
    issuer: Issuer,
    verifier: OperatorVerifier,
) -> Result<tokio::task::JoinHandle<()>, async_nats::Error> {
    if let Err(e) = issuer.push_revocations().await {
        tracing::error!(error = %e, "pushing the app credential revocations failed");
    }
    operator::serve(
        client,
        AREA,
        ADMIN_QUEUE_GROUP.to_owned(),
        verifier,
        "app credentials are operator actions",
        move |method, payload| {
            let issuer = issuer.clone();
            async move { admin_call(&issuer, &method, &payload).await }
        },
    )
    .await
}

fn to_value(answer: &impl serde::Serialize) -> Value {
    serde_json::to_value(answer).unwrap_or(Value::Null)
}

async fn admin_call(issuer: &Issuer, method: &str, payload: &[u8]) -> Result<Value, ApiError> {
    let api = |e: CredsError| e.to_api_error();
    match method {
        ISSUE => {
            let a: NameArgs = parse_args(payload)?;
            let (credential, creds) = issuer.issue(&a.name).await.map_err(api)?;
            Ok(to_value(&Issued {
                credential,
                inbox_prefix: inbox_prefix(&a.name),
                creds,
            }))
        }
        LIST => Ok(to_value(&Listed {
            credentials: issuer.list().await.map_err(api)?,
        })),
        REVOKE => {
            let a: NameArgs = parse_args(payload)?;
            Ok(to_value(&Revoked {
                credential: issuer.revoke(&a.name).await.map_err(api)?,
            }))
        }
        other => Err(ApiError::new(
            ApiErrorCode::NotFound,
            format!("no operator method creds.{other}"),
        )),
    }
}

/// `fleet creds …` (this exact interface).
#[derive(Debug, Clone, clap::Subcommand)]
pub enum CredsCmd {
    /// Issue an app credential (a standard NATS `.creds` file for an app backend).
    Issue {
        /// Its name: 1–64 of `[A-Za-z0-9_-]`; the client's inbox prefix must be `_INBOX.<name>`.
        #[arg(long)]
        name: String,
        /// Write the `.creds` here (mode 0600) instead of printing it.
        #[arg(long)]
        out: Option<PathBuf>,
        /// `--nats-url`, `--data-dir`, `--token`.
        #[command(flatten)]
        conn: OperatorConn,
    },
    /// List every app credential issued (names, keys, issue and revocation times).
    List {
        /// `--nats-url`, `--data-dir`, `--token`.
        #[command(flatten)]
        conn: OperatorConn,
    },
    /// Revoke an app credential: its connections are closed and it cannot connect again.
    Revoke {
        /// The name.
        name: String,
        /// `--nats-url`, `--data-dir`, `--token`.
        #[command(flatten)]
        conn: OperatorConn,
    },
}

/// Runs a `fleet creds` command and returns what to print.
pub async fn run(cmd: &CredsCmd) -> Result<Value, ApiError> {
    let wait = Duration::from_secs(15);
    match cmd {
        CredsCmd::Issue { name, conn, out } => {
            let client = conn.client().await?;
            let issued = client.creds_issue(&NameArgs { name: name.clone() }, wait).await?;
            let Some(path) = out else {
                return printable(&issued);
            };
            // 0600 from its creation, replaced atomically (the auth directory's own writer).
            nats_auth::creds::write_private_atomic(path, issued.creds.as_bytes())
                .map_err(|e| ApiError::new(ApiErrorCode::InternalError, e.to_string()))?;
            Ok(json!({
                "credential": issued.credential,
                "inbox_prefix": issued.inbox_prefix,
                "written": path.display().to_string(),
            }))
        }
        CredsCmd::List { conn } => printable(conn.client().await?.creds_list(wait).await?),
        CredsCmd::Revoke { name, conn } => {
            let client = conn.client().await?;
            printable(
                client
                    .creds_revoke(&NameArgs { name: name.clone() }, wait)
                    .await?,
            )
        }
    }
}
