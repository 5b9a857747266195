//! User grants (spec §8 preconditions: "the user's grant allows it"): which host capabilities a user allows
//! one plugin to use, kept in the JetStream KV bucket `<prefix>_grants`, one record per (user, tool id), set by
//! operators with `fleet grant` through the operator API `fleet.v1.admin.grants.{set,get}` (token with the
//! operator claim).
//!
//! Default: nothing is granted. A token is minted for an invoke only when the capability was negotiated in
//! `initialize`, declared in the manifest's `host_capabilities`, **and** granted here (spec §3.3 HR-LC-15).
//! The caps that come with a grant (calls, tokens, bytes) are the spec's defaults; the record has room for
//! per-grant overrides (`sampling`, `storage`, `upload`), accepting both field spellings of spec §16 A-29.

use std::collections::BTreeSet;
use std::time::Duration;

use async_nats::jetstream::{self, kv};
use fleet_proto::api::{ApiError, ApiErrorCode, subjects};
use fleet_proto::executa::capabilities::is_known_host_capability;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::client_cmd::OperatorConn;
use crate::operator;
use fleet_client::auth::OperatorVerifier;
use fleet_proto::api::user_key;
use fleet_proto::util::now_ms;
use fleet_store::{self as store, Op, Revisioned, StoreError, StoreSettings};

/// The operator API area of grants (`fleet.v1.admin.grants.*`).
pub const GRANTS_AREA: &str = "grants";
/// `fleet.v1.admin.grants.set`: `{user, tool_id, allow?: [..], revoke?: [..]}` → the grant.
pub const GRANTS_SET: &str = "set";
/// `fleet.v1.admin.grants.get`: `{user, tool_id}` → the grant.
pub const GRANTS_GET: &str = "get";
/// `--revoke '*'`: every capability.
pub const REVOKE_ALL: &str = "*";
/// Largest grant record.
const GRANT_MAX_BYTES: usize = 16 * 1024;
/// Compare-and-set attempts before giving up.
const MAX_CAS_ATTEMPTS: u32 = 50;

/// Upload caps a grant may narrow (spec §8.7; both spellings, §16 A-29).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UploadGrant {
    /// Files per invoke.
    #[serde(default, alias = "maxFiles", skip_serializing_if = "Option::is_none")]
    pub max_files: Option<u32>,
    /// Largest file.
    #[serde(default, alias = "maxFileBytes", skip_serializing_if = "Option::is_none")]
    pub max_file_bytes: Option<u64>,
    /// Bytes per invoke.
    #[serde(default, alias = "maxTotalBytes", skip_serializing_if = "Option::is_none")]
    pub max_total_bytes: Option<u64>,
    /// Purposes.
    #[serde(default, alias = "allowedPurposes", skip_serializing_if = "Option::is_none")]
    pub allowed_purposes: Option<Vec<String>>,
}

/// One user's grant to one plugin.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    /// The user.
    pub user: String,
    /// The plugin.
    pub tool_id: String,
    /// Host capabilities allowed (`aps.kv`, `aps.files`, `llm.sample`, `llm.embed`, `host.upload`, …).
    #[serde(default)]
    pub allow: BTreeSet<String>,
    /// Upload caps narrower than the spec's defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upload: Option<UploadGrant>,
    /// Last change, Unix ms (0: never set).
    #[serde(default)]
    pub updated_at_ms: u64,
}

impl Grant {
    /// Whether `capability` is allowed.
    pub fn allows(&self, capability: &str) -> bool {
        self.allow.contains(capability)
    }
}

/// Why a grant operation failed.
#[derive(Debug, thiserror::Error)]
pub enum GrantError {
    /// A capability string not on the platform allow-list.
    #[error(
        "unknown host capabilities {0:?}; known: aps.kv, aps.files, llm.sample, llm.embed, host.upload, …"
    )]
    Unknown(Vec<String>),
    /// Missing or bad user / tool id.
    #[error("{0}")]
    Invalid(String),
    /// JetStream failed.
    #[error("grants store: {0}")]
    Store(String),
}

impl GrantError {
    /// The API error.
    pub fn to_api_error(&self) -> ApiError {
        match self {
            GrantError::Unknown(_) | GrantError::Invalid(_) => {
                ApiError::new(ApiErrorCode::InvalidArg, self.to_string())
            }
            GrantError::Store(_) => ApiError::new(ApiErrorCode::InternalError, self.to_string()),
        }
    }
}

fn store_err(e: impl std::fmt::Display) -> GrantError {
    GrantError::Store(e.to_string())
}

/// The grants bucket.
#[derive(Debug, Clone)]
pub struct GrantStore {
    kv: kv::Store,
}

impl GrantStore {
    /// Creates (or updates to these settings) `<prefix>_grants`.
    pub async fn open(js: &jetstream::Context, settings: &StoreSettings) -> Result<GrantStore, GrantError> {
        let kv = store::open_kv(
            js,
            kv::Config {
                bucket: format!("{}_grants", settings.prefix),
                description: "Cloud Agents: user grants of host capabilities per plugin".into(),
                history: 1,
                max_value_size: i32::try_from(GRANT_MAX_BYTES).unwrap_or(i32::MAX),
                num_replicas: settings.replicas,
                ..Default::default()
            },
            settings.provision,
        )
        .await
        .map_err(store_err)?;
        Ok(GrantStore { kv })
    }

    fn key(user: &str, tool_id: &str) -> String {
        format!("{}.{}", user_key(user), user_key(tool_id))
    }

    fn check(user: &str, tool_id: &str) -> Result<(), GrantError> {
        if user.is_empty() || user.len() > 256 || user.chars().any(char::is_control) {
            return Err(GrantError::Invalid(
                "user must be 1–256 characters without control characters".into(),
            ));
        }
        if tool_id.is_empty() || tool_id.len() > 128 || tool_id.chars().any(char::is_control) {
            return Err(GrantError::Invalid(
                "tool_id must be 1–128 characters without control characters".into(),
            ));
        }
        Ok(())
    }

    /// The grant of `user` to `tool_id` (an empty one when none was ever set).
    pub async fn get(&self, user: &str, tool_id: &str) -> Result<Grant, GrantError> {
        Self::check(user, tool_id)?;
        Ok(self
            .read(user, tool_id)
            .await?
            .map(|r| r.value)
            .unwrap_or_else(|| Grant {
                user: user.to_owned(),
                tool_id: tool_id.to_owned(),
                ..Grant::default()
            }))
    }

    async fn read(&self, user: &str, tool_id: &str) -> Result<Option<Revisioned<Grant>>, GrantError> {
        store::read(&self.kv, &Self::key(user, tool_id), Op::ReadGrant)
            .await
            .map_err(store_err)
    }

    /// Adds `allow` and removes `revoke` (`*` = everything), atomically (compare-and-set).
    pub async fn edit(
        &self,
        user: &str,
        tool_id: &str,
        allow: &[String],
        revoke: &[String],
    ) -> Result<Grant, GrantError> {
        Self::check(user, tool_id)?;
        let unknown: Vec<String> = allow
            .iter()
            .chain(revoke.iter().filter(|r| r.as_str() != REVOKE_ALL))
            .filter(|c| !is_known_host_capability(c))
            .cloned()
            .collect();
        if !unknown.is_empty() {
            return Err(GrantError::Unknown(unknown));
        }
        let key = Self::key(user, tool_id);
        for attempt in 0..MAX_CAS_ATTEMPTS {
            let current = self.read(user, tool_id).await?;
            let revision = current.as_ref().map(|r| r.revision);
            let mut grant = current.map(|r| r.value).unwrap_or_default();
            grant.user = user.to_owned();
            grant.tool_id = tool_id.to_owned();
            if revoke.iter().any(|r| r == REVOKE_ALL) {
                grant.allow.clear();
            }
            for r in revoke {
                grant.allow.remove(r);
            }
            grant.allow.extend(allow.iter().cloned());
            grant.updated_at_ms = now_ms();
            let limit = ("grant", GRANT_MAX_BYTES);
            match store::cas_write(&self.kv, &key, &grant, revision, limit, Op::EditGrant)
                .await
                .map_err(store_err)?
            {
                Ok(_) => return Ok(grant),
                Err(store::Conflict) => store::backoff(attempt).await,
            }
        }
        Err(store_err(StoreError::Contention {
            op: Op::EditGrant,
            key,
            attempts: MAX_CAS_ATTEMPTS,
        }))
    }
}

#[derive(Debug, Deserialize)]
struct SetArgs {
    user: String,
    tool_id: String,
    #[serde(default)]
    allow: Vec<String>,
    #[serde(default)]
    revoke: Vec<String>,
}

#[derive(Debug, Deserialize)]
struct GetArgs {
    user: String,
    tool_id: String,
}

/// Serves `fleet.v1.admin.grants.*` (queue group: any front answers) until the client closes. Every call needs
/// an API token with the operator claim.
pub async fn serve_admin(
    client: async_nats::Client,
    grants: GrantStore,
    verifier: OperatorVerifier,
) -> Result<tokio::task::JoinHandle<()>, async_nats::Error> {
    operator::serve(
        client,
        GRANTS_AREA,
        format!("{}-admin", subjects::API_QUEUE_GROUP),
        verifier,
        "grants are operator actions",
        move |method, payload| {
            let grants = grants.clone();
            async move { admin_call(&grants, &method, &payload).await }
        },
    )
    .await
}

async fn admin_call(grants: &GrantStore, method: &str, payload: &[u8]) -> Result<Value, ApiError> {
    let grant = match method {
        GRANTS_SET => {
            let a: SetArgs = operator::parse(payload)?;
            grants.edit(&a.user, &a.tool_id, &a.allow, &a.revoke).await
        }
        GRANTS_GET => {
            let a: GetArgs = operator::parse(payload)?;
            grants.get(&a.user, &a.tool_id).await
        }
        other => {
            return Err(ApiError::new(
                ApiErrorCode::InvalidArg,
                format!("unknown admin method grants.{other}"),
            ));
        }
    };
    grant
        .map(|g| serde_json::to_value(g).unwrap_or(Value::Null))
        .map_err(|e| e.to_api_error())
}

/// `fleet grant` (this exact interface: `--user U --tool-id T --allow a,b` / `--revoke a,b`).
#[derive(Debug, Clone, clap::Args)]
pub struct GrantArgs {
    /// The user the grant is for.
    #[arg(long)]
    pub user: String,
    /// The plugin.
    #[arg(long)]
    pub tool_id: String,
    /// Capabilities to allow, comma-separated (aps.kv, aps.files, llm.sample, llm.embed, host.upload, …).
    #[arg(long, value_delimiter = ',')]
    pub allow: Vec<String>,
    /// Capabilities to revoke, comma-separated (`*`: all).
    #[arg(long, value_delimiter = ',')]
    pub revoke: Vec<String>,
    /// `--nats-url`, `--data-dir`, `--token`.
    #[command(flatten)]
    pub conn: OperatorConn,
}

/// Runs `fleet grant`: prints the grant as it is now.
pub async fn run_grant(args: &GrantArgs) -> Result<Value, ApiError> {
    let token = args.conn.token()?;
    let client = args.conn.connect().await?;
    let method = if args.allow.is_empty() && args.revoke.is_empty() {
        GRANTS_GET
    } else {
        GRANTS_SET
    };
    let body =
        json!({ "user": args.user, "tool_id": args.tool_id, "allow": args.allow, "revoke": args.revoke });
    fleet_client::api::request(
        &client,
        &token,
        operator::subject(GRANTS_AREA, method),
        &body,
        Duration::from_secs(10),
    )
    .await
}
