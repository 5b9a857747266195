//! OAuth accounts (spec §4.2 platform credentials, §8.8 `credentials/listAccounts` / `credentials/getToken`).
//!
//! * **Providers** ([`config`]): `[credentials.providers.<name>]` of the services TOML — endpoints, client,
//!   scopes, and the `credential_mapping` that says which declared credential names a provider fills.
//! * **Connect flow** ([`flow`], served by the fleet's HTTP listener): `/v1/oauth/<provider>/start` (the user's
//!   API token) records a single-use state with a sealed PKCE verifier and sends the browser to the provider;
//!   `/v1/oauth/<provider>/callback` consumes the state, exchanges the code with the verifier, learns the
//!   account's identity and stores the account ([`OAuthService::begin`], [`OAuthService::finish`]).
//! * **Accounts** ([`accounts`]): per user, several per provider, one default; refresh tokens and the last
//!   access token sealed with the credentials keyring in `<prefix>_oauth_accounts`.
//! * **Access tokens** ([`OAuthService::access_token`]): from this process's cache until they expire (less
//!   [`EXPIRY_MARGIN`]), else from the record's sealed copy (another process's refresh), else refreshed at the
//!   provider — one refresh at a time per account in a process (single-flight), the new tokens written back by
//!   compare-and-set so every replica shares them. A refresh the provider refuses (`invalid_grant`) marks the
//!   account `needs_reauth`.
//! * **Plugins**: the `credentials_token` is minted when the manifest's `credentials[]` declares a name some
//!   provider maps; `credentials/listAccounts` and `credentials/getToken` ([`OAuthService::call`]) answer only
//!   for the providers that token names. At every invoke, a declared name a provider maps resolves first to the
//!   live access token of the user's default account there ([`OAuthService::platform_credentials`]).
//!
//! Refresh tokens never leave this module: not in a reverse-RPC answer, not in `params.context`, not in a log or
//! an error (spec §8.8 HR-CD-01).

pub mod accounts;
pub mod config;
pub mod flow;
mod upstream;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dashmap::DashMap;
use fleet_proto::executa::credentials::{self as wire, AccountStatus};
use fleet_proto::executa::reverse::{credentials as codes, method_not_found, methods};
use fleet_proto::jsonrpc::ErrorObject;
use fleet_proto::util::{lock, now_ms};
use serde_json::{Map, Value};
use zeroize::Zeroizing;

use self::accounts::{AccountStore, AccountsRecord, Connect, EditError, Kind, Tokens, valid_account_id};
use self::config::{CredentialsConfig, Provider, Providers};
use self::flow::{FlowStore, StateError};
use crate::credentials::{CredentialError, Keyring};
use crate::{CallContext, ServicesError};

/// An access token this close to its expiry is refreshed rather than used (the plugin needs time to use it).
pub const EXPIRY_MARGIN: Duration = Duration::from_secs(30);

/// How long an access token lives when the provider does not say (`expires_in` absent).
pub const DEFAULT_ACCESS_TTL: Duration = Duration::from_secs(3600);

/// A provider endpoint call's timeout (within the invoke's deadline for reverse calls).
pub const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(15);

/// Connection timeout of the provider endpoints.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Access tokens cached per process at most (an entry is one account's token).
const CACHE_MAX_ENTRIES: usize = 10_000;

/// Why an account operation failed. No variant carries a token.
#[derive(Debug, thiserror::Error)]
pub enum OAuthError {
    /// The provider is not configured here.
    #[error("no OAuth provider {0:?} is configured on this host")]
    UnknownProvider(String),
    /// The plugin's `credentials_token` does not name the provider.
    #[error("provider {0:?} is not covered by this plugin's declared credentials")]
    NotCovered(String),
    /// The user has no account at the provider.
    #[error("no {0} account is connected for this user")]
    NoAccount(String),
    /// No account with this id.
    #[error("no account {0:?} at this provider")]
    UnknownAccount(String),
    /// The provider refused the account's refresh token: the user must connect it again.
    #[error("account {0} needs to be connected again (the provider refused its refresh token)")]
    NeedsReauth(String),
    /// The account has a max of accounts already.
    #[error("at most {} accounts per provider", accounts::ACCOUNTS_PER_PROVIDER_MAX)]
    TooManyAccounts,
    /// A malformed request (the message names the field).
    #[error("{0}")]
    Invalid(String),
    /// The provider failed (network, timeout, an unexpected answer).
    #[error("the provider failed: {0}")]
    Upstream(String),
    /// The callback's state was refused.
    #[error(transparent)]
    State(#[from] StateError),
    /// The accounts store or the keyring.
    #[error(transparent)]
    Store(#[from] CredentialError),
    /// This process cannot run connect flows (a worker, or no `public_url`).
    #[error("{0}")]
    Unavailable(String),
}

impl From<EditError> for OAuthError {
    fn from(e: EditError) -> Self {
        match e {
            EditError::UnknownAccount(id) => OAuthError::UnknownAccount(id),
            EditError::TooMany => OAuthError::TooManyAccounts,
            EditError::Credentials(c) => OAuthError::Store(c),
        }
    }
}

impl From<upstream::UpstreamError> for OAuthError {
    fn from(e: upstream::UpstreamError) -> Self {
        OAuthError::Upstream(e.to_string())
    }
}

impl OAuthError {
    /// The reverse-RPC error (spec §8.8): -32061 for what the plugin may not have (token, provider, account,
    /// re-authorization), -32062 for a malformed request, -32063 for the provider or the store.
    pub fn to_rpc(&self) -> ErrorObject {
        let code = match self {
            OAuthError::UnknownProvider(_)
            | OAuthError::NotCovered(_)
            | OAuthError::NoAccount(_)
            | OAuthError::UnknownAccount(_)
            | OAuthError::NeedsReauth(_)
            | OAuthError::Unavailable(_) => codes::CREDENTIALS_NOT_GRANTED,
            OAuthError::Invalid(_) | OAuthError::TooManyAccounts => codes::CREDENTIALS_INVALID_REQUEST,
            OAuthError::Upstream(_) | OAuthError::Store(_) | OAuthError::State(_) => {
                codes::CREDENTIALS_UPSTREAM
            }
        };
        let mut data = Map::new();
        if let OAuthError::NeedsReauth(id) = self {
            data.insert("account_id".into(), Value::String(id.clone()));
            data.insert("reason".into(), Value::String("needs_reauth".into()));
        }
        if matches!(self, OAuthError::NotCovered(_)) {
            data.insert("reason".into(), Value::String("APP_NOT_GRANTED".into()));
        }
        code.error_with(self.to_string(), data)
    }
}

type CacheKey = (String, String, String);

/// A cached access token.
struct Cached {
    token: Zeroizing<String>,
    expires_at_ms: u64,
}

fn margin_ms() -> u64 {
    u64::try_from(EXPIRY_MARGIN.as_millis()).unwrap_or(u64::MAX)
}

/// Whether a token expiring at `expires_at_ms` may still be handed out.
fn fresh(expires_at_ms: u64) -> bool {
    expires_at_ms > now_ms().saturating_add(margin_ms())
}

/// A live access token of one account.
#[derive(Clone)]
pub struct AccessToken {
    /// The token.
    pub token: Zeroizing<String>,
    /// Its account.
    pub account_id: String,
    /// When it expires, Unix ms.
    pub expires_at_ms: u64,
}

impl std::fmt::Debug for AccessToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AccessToken")
            .field("account_id", &self.account_id)
            .field("expires_at_ms", &self.expires_at_ms)
            .finish_non_exhaustive()
    }
}

/// A connect flow begun: where to send the browser, and the binding secret for its cookie.
#[derive(Debug)]
pub struct Started {
    /// The provider's authorization URL with the flow's parameters.
    pub authorize_url: String,
    /// The browser binding secret (the cookie's value). Secret.
    pub binding: BindingSecret,
    /// The state's hash prefix, naming the cookie (several flows may run at once).
    pub cookie_suffix: String,
    /// When the state expires, Unix ms.
    pub expires_at_ms: u64,
}

/// The binding secret of a flow; `Debug` never shows it.
pub struct BindingSecret(pub Zeroizing<String>);

impl std::fmt::Debug for BindingSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BindingSecret(<redacted>)")
    }
}

/// The name of the cookie carrying a flow's binding secret, for the flow whose `state` this is.
pub fn cookie_suffix(state: &str) -> String {
    use sha2::Digest as _;
    hex::encode(&sha2::Sha256::digest(state.as_bytes())[..8])
}

/// OAuth providers, accounts, flows and tokens of one process.
#[derive(Debug, Clone)]
pub struct OAuthService {
    inner: Arc<Inner>,
}

struct Inner {
    providers: Providers,
    accounts: AccountStore,
    /// Fronts only.
    flows: Option<FlowStore>,
    public_url: Option<String>,
    http: reqwest::Client,
    cache: DashMap<CacheKey, Cached>,
    /// One lock per account being refreshed in this process.
    refreshing: Mutex<HashMap<CacheKey, Arc<tokio::sync::Mutex<()>>>>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OAuthService")
            .field(
                "providers",
                &self.providers.iter().map(|p| &p.name).collect::<Vec<_>>(),
            )
            .field("flows", &self.flows.is_some())
            .field("cached", &self.cache.len())
            .finish_non_exhaustive()
    }
}

impl OAuthService {
    /// Opens the accounts bucket (every process) and, for a process that creates resources (a front), the
    /// flows' bucket; checks the provider table.
    pub async fn open(
        js: &async_nats::jetstream::Context,
        settings: &fleet_store::StoreSettings,
        config: &CredentialsConfig,
        public_url: Option<String>,
        keyring: Keyring,
    ) -> Result<OAuthService, ServicesError> {
        let providers = Providers::new(config)?;
        let store_err = |e: CredentialError| ServicesError::Store(e.to_string());
        let accounts = AccountStore::open(js, settings, keyring.clone())
            .await
            .map_err(store_err)?;
        let flows = match settings.provision {
            fleet_store::Provision::Create => {
                Some(FlowStore::open(js, settings, keyring).await.map_err(store_err)?)
            }
            fleet_store::Provision::Attach => None,
        };
        let http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| ServicesError::Config(format!("credentials: HTTP client: {e}")))?;
        Ok(OAuthService {
            inner: Arc::new(Inner {
                providers,
                accounts,
                flows,
                public_url: public_url.map(|u| u.trim_end_matches('/').to_owned()),
                http,
                cache: DashMap::new(),
                refreshing: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// The accounts store (the operator's rewrap).
    pub fn accounts(&self) -> &AccountStore {
        &self.inner.accounts
    }

    /// The fleet's URL as browsers reach it (the connect flow's redirect URIs start with it).
    pub fn public_url(&self) -> Option<&str> {
        self.inner.public_url.as_deref()
    }

    /// Whether any provider is configured (else `credentials/*` is not offered).
    pub fn configured(&self) -> bool {
        !self.inner.providers.is_empty()
    }

    /// The `credentials` capability offered in `initialize`: the configured providers; `None` without any.
    pub fn offer(&self) -> Option<Value> {
        self.configured().then(|| {
            let providers: Vec<Value> = self
                .inner
                .providers
                .iter()
                .map(|p| Value::String(p.name.clone()))
                .collect();
            serde_json::json!({ "providers": providers })
        })
    }

    /// The providers a manifest declaring `names` is covered for (the `credentials_token`'s `providers`).
    pub fn covering(&self, names: &[String]) -> Vec<String> {
        self.inner.providers.covering(names)
    }

    /// Those of `names` a configured provider maps (platform credentials), in their order.
    pub fn mapped(&self, names: &[String]) -> Vec<String> {
        names
            .iter()
            .filter(|n| self.inner.providers.for_credential(n).is_some())
            .cloned()
            .collect()
    }

    /// The configured providers, for users.
    pub fn providers(&self) -> wire::Providers {
        wire::Providers {
            providers: self
                .inner
                .providers
                .iter()
                .map(|p| wire::Provider {
                    name: p.name.clone(),
                    credentials: p.credentials.clone(),
                    scopes: p.scopes.clone(),
                })
                .collect(),
        }
    }

    fn provider(&self, name: &str) -> Result<&Provider, OAuthError> {
        self.inner
            .providers
            .get(name)
            .ok_or_else(|| OAuthError::UnknownProvider(name.to_owned()))
    }

    // ---------------------------------------------------------------------------------------------------------
    // The connect flow

    fn redirect_uri(&self, provider: &str) -> Result<String, OAuthError> {
        let base = self.inner.public_url.as_deref().ok_or_else(|| {
            OAuthError::Unavailable(
                "the connect flow needs public_url (the fleet's URL as browsers reach it) in the services config"
                    .into(),
            )
        })?;
        Ok(format!("{base}/v1/oauth/{provider}/callback"))
    }

    fn flows(&self) -> Result<&FlowStore, OAuthError> {
        self.inner
            .flows
            .as_ref()
            .ok_or_else(|| OAuthError::Unavailable("this process does not run connect flows".into()))
    }

    /// Begins a connect flow of `user` at `provider` (`label`: the account's label; `make_default`: make it the
    /// default): the authorization URL (state, PKCE S256 challenge, scopes, redirect URI) and the browser
    /// binding secret.
    pub async fn begin(
        &self,
        user: &str,
        provider: &str,
        label: Option<String>,
        make_default: bool,
    ) -> Result<Started, OAuthError> {
        let p = self.provider(provider)?;
        crate::credentials::check_user(user)?;
        if let Some(l) = &label
            && (l.is_empty()
                || l.chars().count() > accounts::LABEL_MAX_CHARS
                || l.chars().any(char::is_control))
        {
            return Err(OAuthError::Invalid(format!(
                "label: 1–{} characters without control characters",
                accounts::LABEL_MAX_CHARS
            )));
        }
        let redirect_uri = self.redirect_uri(provider)?;
        let flows = self.flows()?;
        let begun = flows.begin(user, provider, label, make_default).await?;
        let mut url = p.authorize_url.clone();
        {
            let mut q = url.query_pairs_mut();
            for (k, v) in &p.authorize_params {
                q.append_pair(k, v);
            }
            q.append_pair("response_type", "code")
                .append_pair("client_id", &p.client_id)
                .append_pair("redirect_uri", &redirect_uri)
                .append_pair("state", &begun.state)
                .append_pair("code_challenge", &begun.challenge)
                .append_pair("code_challenge_method", "S256");
            if !p.scopes.is_empty() {
                q.append_pair("scope", &p.scopes.join(" "));
            }
        }
        Ok(Started {
            authorize_url: url.to_string(),
            binding: BindingSecret(begun.binding),
            cookie_suffix: cookie_suffix(&begun.state),
            expires_at_ms: begun.expires_at_ms,
        })
    }

    /// Finishes a connect flow: consumes `state` (for the browser holding `binding`), exchanges `code` with the
    /// flow's PKCE verifier, reads the account's identity and stores it for the user who began the flow.
    pub async fn finish(
        &self,
        provider: &str,
        state: &str,
        code: &str,
        binding: Option<&str>,
    ) -> Result<(String, wire::Account), OAuthError> {
        let p = self.provider(provider)?;
        let redirect_uri = self.redirect_uri(provider)?;
        let (pending, verifier) = self.flows()?.finish(provider, state, binding).await?;
        let http = &self.inner.http;
        let grant =
            upstream::exchange_code(http, p, code, &verifier, &redirect_uri, UPSTREAM_TIMEOUT).await?;
        let identity = upstream::identity(http, p, &grant, UPSTREAM_TIMEOUT).await?;
        let expires_at_ms = expiry(grant.expires_in);
        let account = self
            .inner
            .accounts
            .connect(
                &pending.user,
                Connect {
                    provider,
                    subject: identity.subject,
                    email: identity.email,
                    label: pending.label.clone(),
                    make_default: pending.make_default,
                    tokens: Tokens {
                        access_token: &grant.access_token,
                        expires_at_ms,
                        refresh_token: grant.refresh_token.as_deref().map(String::as_str),
                        scopes: Some(scopes_of(grant.scope.as_deref(), p)),
                    },
                },
            )
            .await?;
        self.cache_put(
            (
                pending.user.clone(),
                provider.to_owned(),
                account.account_id.clone(),
            ),
            &grant.access_token,
            expires_at_ms,
        );
        Ok((pending.user, account))
    }

    // ---------------------------------------------------------------------------------------------------------
    // The user's accounts

    /// The user's accounts at `provider`, the default first.
    pub async fn list(&self, user: &str, provider: &str) -> Result<Vec<wire::Account>, OAuthError> {
        self.provider(provider)?;
        let record = self
            .inner
            .accounts
            .read(user, fleet_store::failover::give_up_at(None))
            .await?;
        Ok(record.map_or_else(Vec::new, |r| accounts::listed(r.accounts(provider))))
    }

    /// Makes `account_id` the user's default at `provider`.
    pub async fn set_default(
        &self,
        user: &str,
        provider: &str,
        account_id: &str,
    ) -> Result<Vec<wire::Account>, OAuthError> {
        self.provider(provider)?;
        Ok(self
            .inner
            .accounts
            .set_default(user, provider, account_id)
            .await?)
    }

    /// Removes one of the user's accounts (and its tokens, cached ones included).
    pub async fn remove(
        &self,
        user: &str,
        provider: &str,
        account_id: &str,
    ) -> Result<Vec<wire::Account>, OAuthError> {
        self.provider(provider)?;
        let left = self.inner.accounts.remove(user, provider, account_id).await?;
        self.inner
            .cache
            .remove(&(user.to_owned(), provider.to_owned(), account_id.to_owned()));
        Ok(left)
    }

    // ---------------------------------------------------------------------------------------------------------
    // Access tokens

    fn cache_put(&self, key: CacheKey, token: &str, expires_at_ms: u64) {
        let cache = &self.inner.cache;
        if cache.len() >= CACHE_MAX_ENTRIES {
            cache.retain(|_, c| fresh(c.expires_at_ms));
            if cache.len() >= CACHE_MAX_ENTRIES {
                cache.clear();
            }
        }
        cache.insert(
            key,
            Cached {
                token: Zeroizing::new(token.to_owned()),
                expires_at_ms,
            },
        );
    }

    fn cache_get(&self, key: &CacheKey) -> Option<(Zeroizing<String>, u64)> {
        let hit = self.inner.cache.get(key)?;
        if fresh(hit.expires_at_ms) {
            return Some((hit.token.clone(), hit.expires_at_ms));
        }
        drop(hit);
        self.inner.cache.remove(key);
        None
    }

    /// A live access token of the user's account `account_id` at `provider` (the default account when `None`):
    /// cached, else the record's sealed copy, else refreshed. The store is waited for until `give_up`.
    pub async fn access_token(
        &self,
        user: &str,
        provider: &str,
        account_id: Option<&str>,
        give_up: tokio::time::Instant,
    ) -> Result<AccessToken, OAuthError> {
        let p = self.provider(provider)?;
        let record = self.inner.accounts.read(user, give_up).await?;
        let Some(record) = record.filter(|r| !r.accounts(provider).is_empty()) else {
            return Err(OAuthError::NoAccount(provider.to_owned()));
        };
        let account = record
            .pick(provider, account_id)
            .ok_or_else(|| OAuthError::UnknownAccount(account_id.unwrap_or_default().to_owned()))?;
        let id = account.account_id.clone();
        let key: CacheKey = (user.to_owned(), provider.to_owned(), id.clone());
        if account.status == AccountStatus::NeedsReauth {
            self.inner.cache.remove(&key);
            return Err(OAuthError::NeedsReauth(id));
        }
        if let Some((token, expires_at_ms)) = self.cache_get(&key) {
            return Ok(AccessToken {
                token,
                account_id: id,
                expires_at_ms,
            });
        }
        if let Some(t) = self.sealed_access(&record, provider, &id)? {
            return Ok(t);
        }
        // One refresh per account at a time in this process; whoever waited finds the token cached.
        let gate = {
            let mut map = lock(&self.inner.refreshing);
            map.entry(key.clone()).or_default().clone()
        };
        let result = {
            let _held = gate.lock().await;
            match self.cache_get(&key) {
                Some((token, expires_at_ms)) => Ok(AccessToken {
                    token,
                    account_id: id.clone(),
                    expires_at_ms,
                }),
                None => self.refresh(p, user, &id, give_up).await,
            }
        };
        {
            let mut map = lock(&self.inner.refreshing);
            // The map's Arc and ours: nobody else holds or waits for this gate.
            if Arc::strong_count(&gate) == 2 {
                map.remove(&key);
            }
        }
        result
    }

    /// The record's sealed access token of the account, when it is still fresh (cached on the way).
    fn sealed_access(
        &self,
        record: &AccountsRecord,
        provider: &str,
        account_id: &str,
    ) -> Result<Option<AccessToken>, OAuthError> {
        let Some(account) = record.pick(provider, Some(account_id)) else {
            return Ok(None);
        };
        let Some(access) = account.access_token.as_ref().filter(|a| fresh(a.expires_at_ms)) else {
            return Ok(None);
        };
        let dek = record.data_key(self.inner.accounts.keyring())?;
        let token = record.open(&dek, provider, account_id, Kind::Access, &access.sealed)?;
        self.cache_put(
            (record.user.clone(), provider.to_owned(), account_id.to_owned()),
            &token,
            access.expires_at_ms,
        );
        Ok(Some(AccessToken {
            token,
            account_id: account_id.to_owned(),
            expires_at_ms: access.expires_at_ms,
        }))
    }

    /// Refreshes the account's access token (the gate held): reads the record again (another process may have
    /// refreshed it), else asks the provider and writes the new tokens back.
    async fn refresh(
        &self,
        p: &Provider,
        user: &str,
        account_id: &str,
        give_up: tokio::time::Instant,
    ) -> Result<AccessToken, OAuthError> {
        let provider = p.name.as_str();
        let record = self
            .inner
            .accounts
            .read(user, give_up)
            .await?
            .ok_or_else(|| OAuthError::UnknownAccount(account_id.to_owned()))?;
        let account = record
            .pick(provider, Some(account_id))
            .ok_or_else(|| OAuthError::UnknownAccount(account_id.to_owned()))?;
        if account.status == AccountStatus::NeedsReauth {
            return Err(OAuthError::NeedsReauth(account_id.to_owned()));
        }
        if let Some(t) = self.sealed_access(&record, provider, account_id)? {
            return Ok(t);
        }
        let Some(sealed) = account.refresh_token.as_deref() else {
            // The provider gave no refresh token and the access token has expired.
            return Err(OAuthError::NeedsReauth(account_id.to_owned()));
        };
        let read_at = account.updated_at_ms;
        let dek = record.data_key(self.inner.accounts.keyring())?;
        let refresh_token = record.open(&dek, provider, account_id, Kind::Refresh, sealed)?;
        let left = give_up.saturating_duration_since(tokio::time::Instant::now());
        let timeout = UPSTREAM_TIMEOUT.min(left).max(Duration::from_millis(1));
        match upstream::refresh(&self.inner.http, p, &refresh_token, timeout).await {
            Ok(grant) => {
                let expires_at_ms = expiry(grant.expires_in);
                self.inner
                    .accounts
                    .refreshed(
                        user,
                        provider,
                        account_id,
                        &Tokens {
                            access_token: &grant.access_token,
                            expires_at_ms,
                            refresh_token: grant.refresh_token.as_deref().map(String::as_str),
                            scopes: grant.scope.as_deref().map(|s| scopes_of(Some(s), p)),
                        },
                    )
                    .await?;
                let key = (user.to_owned(), provider.to_owned(), account_id.to_owned());
                self.cache_put(key, &grant.access_token, expires_at_ms);
                Ok(AccessToken {
                    token: grant.access_token,
                    account_id: account_id.to_owned(),
                    expires_at_ms,
                })
            }
            Err(upstream::UpstreamError::InvalidGrant(_)) => {
                let marked = self
                    .inner
                    .accounts
                    .needs_reauth(user, provider, account_id, read_at)
                    .await?;
                if !marked {
                    // Another process refreshed the account meanwhile (a provider that rotates refresh tokens
                    // refuses the one read before), or the user connected it again: its token is in the record.
                    if let Some(record) = self.inner.accounts.read(user, give_up).await?
                        && let Some(t) = self.sealed_access(&record, provider, account_id)?
                    {
                        return Ok(t);
                    }
                }
                tracing::info!(
                    provider,
                    account_id,
                    "OAuth refresh refused: the account needs re-authorization"
                );
                Err(OAuthError::NeedsReauth(account_id.to_owned()))
            }
            Err(e) => {
                tracing::warn!(provider, account_id, error = %e, "OAuth refresh failed");
                Err(e.into())
            }
        }
    }

    // ---------------------------------------------------------------------------------------------------------
    // Plugins

    /// Platform credentials (spec §4.2 HR-CR-01, first tier): for each of `names` a provider maps, the live
    /// access token of the user's default account there. A name whose provider has no usable account (none
    /// connected, needs re-authorization, the provider failing) is absent: the next tier fills it. Only a store
    /// that cannot be read is an error (the invoke does not run).
    pub async fn platform_credentials(
        &self,
        user: &str,
        names: &[String],
        give_up: tokio::time::Instant,
    ) -> Result<BTreeMap<String, Zeroizing<String>>, CredentialError> {
        let mut out = BTreeMap::new();
        let mut by_provider: BTreeMap<&str, Vec<&String>> = BTreeMap::new();
        for name in names {
            if let Some(p) = self.inner.providers.for_credential(name) {
                by_provider.entry(p.name.as_str()).or_default().push(name);
            }
        }
        for (provider, names) in by_provider {
            match self.access_token(user, provider, None, give_up).await {
                Ok(t) => {
                    for name in names {
                        out.insert(name.clone(), t.token.clone());
                    }
                }
                Err(OAuthError::Store(e)) => return Err(e),
                Err(e) => {
                    tracing::debug!(provider, reason = %e, "no platform credential from this provider");
                }
            }
        }
        Ok(out)
    }

    /// Serves `credentials/listAccounts` and `credentials/getToken` for a call whose `credentials_token`
    /// verified (its `providers` claim in `ctx`).
    pub async fn call(&self, ctx: &CallContext, method: &str, params: &Value) -> Result<Value, ErrorObject> {
        let (provider, account_id) = match method {
            methods::CREDENTIALS_LIST_ACCOUNTS => (parse_provider(params)?, None),
            methods::CREDENTIALS_GET_TOKEN => (parse_provider(params)?, parse_account_id(params)?),
            _ => return Err(method_not_found(method)),
        };
        let covered = ctx
            .claims
            .providers
            .as_ref()
            .is_some_and(|p| p.iter().any(|c| c == &provider));
        if !covered || self.inner.providers.get(&provider).is_none() {
            return Err(OAuthError::NotCovered(provider).to_rpc());
        }
        let give_up = fleet_store::failover::instant_of_epoch_ms(ctx.deadline_ms);
        let result = if method == methods::CREDENTIALS_LIST_ACCOUNTS {
            let record = self
                .inner
                .accounts
                .read(&ctx.user, give_up)
                .await
                .map_err(|e| OAuthError::from(e).to_rpc())?;
            let accounts = record.map_or_else(Vec::new, |r| accounts::listed(r.accounts(&provider)));
            serde_json::to_value(wire::Accounts { accounts })
        } else {
            let token = self
                .access_token(&ctx.user, &provider, account_id.as_deref(), give_up)
                .await
                .map_err(|e| e.to_rpc())?;
            serde_json::to_value(wire::Token {
                access_token: token.token.as_str().to_owned(),
                account_id: token.account_id,
                expires_at: fleet_store::rfc3339_ms(token.expires_at_ms),
            })
        };
        result.map_err(|e| codes::CREDENTIALS_UPSTREAM.error(format!("encoding the answer: {e}")))
    }
}

fn expiry(expires_in: Option<u64>) -> u64 {
    let secs = expires_in.unwrap_or(DEFAULT_ACCESS_TTL.as_secs());
    now_ms().saturating_add(secs.saturating_mul(1000))
}

fn scopes_of(granted: Option<&str>, p: &Provider) -> Vec<String> {
    match granted {
        Some(s) => s
            .split([' ', ','])
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect(),
        None => p.scopes.clone(),
    }
}

fn invalid(message: impl Into<String>) -> ErrorObject {
    OAuthError::Invalid(message.into()).to_rpc()
}

fn parse_provider(params: &Value) -> Result<String, ErrorObject> {
    let Value::Object(map) = params else {
        return Err(invalid("params must be an object"));
    };
    match map.get("provider") {
        Some(Value::String(p)) if !p.is_empty() => Ok(p.clone()),
        Some(_) => Err(invalid("provider must be a non-empty string")),
        None => Err(invalid("provider is required")),
    }
}

/// `account_id`: absent or null (the default account), else an account id — never an e-mail (spec §8.8).
fn parse_account_id(params: &Value) -> Result<Option<String>, ErrorObject> {
    match params.get("account_id") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.contains('@') => Err(invalid(
            "account_id takes an account id from credentials/listAccounts; e-mail addresses are not accepted",
        )),
        Some(Value::String(s)) if valid_account_id(s) => Ok(Some(s.clone())),
        Some(Value::String(_)) => Err(invalid(
            "account_id is not an account id (acc_ and 16 hex digits)",
        )),
        Some(_) => Err(invalid("account_id must be a string")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_are_checked_and_emails_refused() {
        let code = |r: Result<Option<String>, ErrorObject>| r.map_err(|e| e.code);
        assert_eq!(code(parse_account_id(&serde_json::json!({}))), Ok(None));
        assert_eq!(
            code(parse_account_id(
                &serde_json::json!({"account_id": "acc_00112233aabbccdd"})
            )),
            Ok(Some("acc_00112233aabbccdd".into()))
        );
        for bad in [
            serde_json::json!({"account_id": "me@example.com"}),
            serde_json::json!({"account_id": 7}),
            serde_json::json!({"account_id": "acc_zz"}),
        ] {
            assert_eq!(code(parse_account_id(&bad)), Err(-32062), "{bad}");
        }
        assert!(parse_provider(&serde_json::json!({"provider": ""})).is_err());
        assert!(parse_provider(&serde_json::json!([])).is_err());
        assert_eq!(
            parse_provider(&serde_json::json!({"provider": "google"})).ok(),
            Some("google".to_owned())
        );
        let e = OAuthError::NeedsReauth("acc_1".into()).to_rpc();
        assert_eq!(
            (e.code, e.error_code()),
            (-32061, Some("CREDENTIALS_NOT_GRANTED"))
        );
    }
}
