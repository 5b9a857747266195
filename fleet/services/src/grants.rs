//! User grants (spec §8 preconditions: "the user's grant allows it"): which host capabilities a user allows
//! one plugin to use, kept in the JetStream KV bucket `<prefix>_grants`, one record per (user, tool id)
//! ([`Grant`], the wire type of `proto::admin::grants`), changed only by operators through the operator API
//! `fleet.v1.admin.grants.{set,get}` (served by the fleet crate's `grants`).
//!
//! Default: nothing is granted. A token is minted for an invoke only when the capability was negotiated in
//! `initialize`, declared in the manifest's `host_capabilities`, **and** granted here (spec §3.3 HR-LC-15).
//! The caps that come with a grant (calls, tokens, bytes) are the spec's defaults; the record has room for
//! per-grant overrides (`sampling`, `storage`, `upload`), accepting both field spellings of spec §16 A-29.

use async_nats::jetstream::{self, kv};
use fleet_proto::admin::grants::{Grant, REVOKE_ALL};
use fleet_proto::api::{ApiError, ApiErrorCode, user_key};
use fleet_proto::executa::capabilities::is_known_host_capability;
use fleet_proto::util::now_ms;
use fleet_store::cas::{Edit, Target, compare_and_set};
use fleet_store::settings::GRANT_MAX_BYTES;
use fleet_store::{self as store, Op, Revisioned, StoreError, StoreSettings};

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
        let kv = store::open_kv(js, settings.grants_kv_config(), settings.provision)
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
        self.edit_with_tools(user, tool_id, allow, revoke, None).await
    }

    /// [`GrantStore::edit`], also replacing the agent sessions' `granted_tools` when `granted_tools` is given.
    pub async fn edit_with_tools(
        &self,
        user: &str,
        tool_id: &str,
        allow: &[String],
        revoke: &[String],
        granted_tools: Option<&[String]>,
    ) -> Result<Grant, GrantError> {
        if let Some(bad) = granted_tools
            .unwrap_or_default()
            .iter()
            .find(|t| t.trim().is_empty() || t.len() > 256 || t.chars().any(char::is_control))
        {
            return Err(GrantError::Invalid(format!(
                "granted tool {bad:?} must be 1–256 characters without control characters"
            )));
        }
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
        let target = Target {
            kv: &self.kv,
            key: &key,
            op: Op::EditGrant,
            limit: ("grant", GRANT_MAX_BYTES),
        };
        let committed = compare_and_set(target, None, |current: Option<Revisioned<Grant>>| {
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
            if let Some(tools) = granted_tools {
                grant.granted_tools = Some(tools.iter().cloned().collect());
            }
            grant.updated_at_ms = now_ms();
            Ok::<_, StoreError>(Edit::Write(grant, ()))
        })
        .await
        .map_err(store_err)?;
        Ok(committed.written.map(|w| w.value).unwrap_or_default())
    }
}
