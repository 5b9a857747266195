//! User grants (spec §8 preconditions: "the user's grant allows it"): which host capabilities a user allows
//! one plugin to use, kept in the JetStream KV bucket `<prefix>_grants`, one record per (user, tool id)
//! ([`Grant`], the wire type of `proto::admin::grants`), changed only by operators through the operator API
//! `fleet.v1.admin.grants.{set,get}` (served by the fleet crate's `grants`).
//!
//! Default: nothing is granted. A token is minted for an invoke only when the capability was negotiated in
//! `initialize`, declared in the manifest's `host_capabilities`, **and** granted here (spec §3.3 HR-LC-15).
//! The caps that come with a grant (calls, tokens, bytes) are the spec's defaults; the record has room for
//! per-grant overrides (`sampling`, `storage`, `upload`), accepting both field spellings of spec §16 A-29. The
//! image limits (`image`: images per rolling day, images per call) are set by operators with the grant.

use async_nats::jetstream::{self, kv};
use fleet_proto::admin::grants::{CREDENTIAL_PREFIX, Grant, ImageGrant, REVOKE_ALL, WebGrantShape};
use fleet_proto::api::{ApiError, ApiErrorCode, user_key};
use fleet_proto::executa::capabilities::is_known_host_capability;
use fleet_proto::limits;
use fleet_proto::util::now_ms;
use fleet_store::cas::{Edit, Target, compare_and_set};
use fleet_store::settings::GRANT_MAX_BYTES;
use fleet_store::{self as store, Op, Revisioned, StoreError, StoreSettings};

/// Why a grant operation failed.
#[derive(Debug, thiserror::Error)]
pub enum GrantError {
    /// A capability string not on the platform allow-list.
    #[error(
        "unknown host capabilities {0:?}; known: aps.kv, aps.files, llm.sample, llm.embed, host.upload, …, \
         and credential:<NAME> for a platform credential"
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

/// Whether `entry` is `credential:<NAME>` with a valid credential name (a platform credential's grant).
fn is_credential_entry(entry: &str) -> bool {
    entry
        .strip_prefix(CREDENTIAL_PREFIX)
        .is_some_and(crate::credentials::valid_name)
}

fn store_err(e: impl std::fmt::Display) -> GrantError {
    GrantError::Store(e.to_string())
}

/// The grants bucket.
#[derive(Debug, Clone)]
pub struct GrantStore {
    kv: kv::Store,
}

/// What a grant edit sets besides its capabilities ([`GrantStore::edit_with`]); each part absent is kept as it is.
#[derive(Debug, Clone, Copy, Default)]
pub struct GrantSettings<'a> {
    /// Image limits (spec §8.6 `image_grant`), merged field by field into the grant's.
    pub image: Option<ImageGrant>,
    /// The spec's `web_grant` (§8.9): every `web.*` capability allowed or revoked as it says, and its settings
    /// (`allowAdvanced`, `maxResultsPerCall`) kept in the grant's `web`.
    pub web_grant: Option<&'a WebGrantShape>,
    /// The tools the plugin's agent sessions may call as the user (spec §8.2 `granted_tools`), replaced.
    pub granted_tools: Option<&'a [String]>,
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
        self.get_until(user, tool_id, fleet_store::failover::give_up_at(None))
            .await
    }

    /// [`Self::get`], asking a store that does not answer (a NATS node lost) again until `give_up` (an invoke's
    /// deadline).
    pub async fn get_until(
        &self,
        user: &str,
        tool_id: &str,
        give_up: tokio::time::Instant,
    ) -> Result<Grant, GrantError> {
        Self::check(user, tool_id)?;
        Ok(self
            .read(user, tool_id, give_up)
            .await?
            .map(|r| r.value)
            .unwrap_or_else(|| Grant {
                user: user.to_owned(),
                tool_id: tool_id.to_owned(),
                ..Grant::default()
            }))
    }

    /// The grant record; a store that does not answer (a NATS node lost, the bucket electing a leader) is asked
    /// again until `give_up` ([`fleet_store::failover`]).
    async fn read(
        &self,
        user: &str,
        tool_id: &str,
        give_up: tokio::time::Instant,
    ) -> Result<Option<Revisioned<Grant>>, GrantError> {
        let key = Self::key(user, tool_id);
        fleet_store::failover::ride_out(
            Op::ReadGrant,
            give_up,
            || store::read(&self.kv, &key, Op::ReadGrant),
            |_| {},
        )
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
        self.edit_with(user, tool_id, allow, revoke, GrantSettings::default())
            .await
    }

    /// [`GrantStore::edit`], also setting what `settings` gives (each part absent: kept as it is).
    pub async fn edit_with(
        &self,
        user: &str,
        tool_id: &str,
        allow: &[String],
        revoke: &[String],
        settings: GrantSettings<'_>,
    ) -> Result<Grant, GrantError> {
        let GrantSettings {
            image,
            web_grant,
            granted_tools,
        } = settings;
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
        if let Some(per_call) = image.and_then(|i| i.max_per_call)
            && !(1..=limits::IMAGE_MAX_PER_CALL).contains(&u64::from(per_call))
        {
            return Err(GrantError::Invalid(format!(
                "image max_per_call must be 1–{} (the host's cap)",
                limits::IMAGE_MAX_PER_CALL
            )));
        }
        if image.and_then(|i| i.max_per_invoke) == Some(0) {
            return Err(GrantError::Invalid(
                "image max_per_invoke must be at least 1".into(),
            ));
        }
        if let Some(max) = web_grant.and_then(|w| w.max_results_per_call)
            && (max == 0 || max as usize > limits::WEB_MAX_RESULTS_PER_CALL)
        {
            return Err(GrantError::Invalid(format!(
                "web_grant.maxResultsPerCall must be 1–{}",
                limits::WEB_MAX_RESULTS_PER_CALL
            )));
        }
        let unknown: Vec<String> = allow
            .iter()
            .chain(revoke.iter().filter(|r| r.as_str() != REVOKE_ALL))
            .filter(|c| !is_known_host_capability(c) && !is_credential_entry(c))
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
            if let Some(image) = image {
                grant.image = Some(grant.image.unwrap_or_default().merged(image));
            }
            if let Some(web) = web_grant {
                let (on, off) = web.capabilities();
                for c in off {
                    grant.allow.remove(&c);
                }
                grant.allow.extend(on);
                grant.web = Some(web.settings());
            }
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
