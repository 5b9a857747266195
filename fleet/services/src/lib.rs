//! The host services behind reverse RPC (spec §7, §8) and the per-invoke tokens (spec §11), as the fleet
//! provides them on real parts: an OpenAI-compatible HTTP upstream for sampling and embeddings ([`llm`]),
//! JetStream KV for APS storage ([`kv`]), the JetStream object store for APS files and host uploads
//! ([`files`], [`upload`]), with signed, expiring download links served by the fleet's HTTP listener.
//!
//! [`FleetServices`] is both the worker's [`TokenSource`] and its [`HostServices`]:
//!
//! * **minting** (at each invoke): for each family, a token is minted only when the capability was negotiated
//!   in `initialize`, declared in the manifest's `host_capabilities`, **and** allowed by the user's grant
//!   ([`grants`]); the invoke's [`InvokeBudget`] is created with the caps the tokens carry;
//! * **serving** (each reverse call, after the worker's routing and negotiation/manifest gates): the family's
//!   token is verified ([`tokens`]: signature, audience, expiry, and binding to this user, plugin and invoke);
//!   a missing or bad token is the family's not-granted error; then the family's service answers;
//! * **forgetting** (invoke end): the budget and every trace of the tokens are dropped (spec §11 HR-JW-01).
//!
//! [`credentials`] keeps the users' plugin credentials, sealed; as the token source, the services resolve them
//! at each invoke of a plugin that declares some (spec §4.2).
//!
//! Each family of the developer mode matrix ([`dev`]: sampling, embeddings, agent, storage, image, upload) is
//! `off` (not offered, its "off" code), `mock` (answered by [`mock`] from F3 entries — after the same token,
//! grant, validation and budget checks as a real upstream) or `real`. `agent/*` is real over `[llm]` ([`agent`]);
//! `image/*` is real against the `[image]` upstream ([`image`]; without one it is not offered and answers
//! `-32109`); `credentials/*` ([`oauth`]) is offered when `[credentials.providers]` configures an OAuth provider
//! and answers plugins whose manifest declares a credential a provider maps (their `credentials_token`). `web/*`
//! ([`web`]) is outside the matrix: `web/fetch` is native (always served unless `[web] fetch = false`),
//! `web/search` and `web/image_search` need a provider in `[web]` (docs/plugins.md "Host services").

pub mod agent;
pub mod args;
pub mod budget;
pub mod credentials;
pub mod dev;
pub mod files;
pub mod grants;
pub mod image;
pub mod kv;
pub mod llm;
pub mod media_type;
pub mod mock;
pub mod oauth;
pub mod tokens;
pub mod upload;
pub mod usage;
pub mod web;

use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use fleet_proto::executa::capabilities::{self, keys};
use fleet_proto::executa::reverse::{
    Family, credentials as credentials_codes, family_of, image as image_codes, method_not_found,
    storage as storage_codes, upload as upload_codes, web as web_codes,
};
use fleet_proto::jsonrpc::ErrorObject;
use fleet_worker::services::{
    CredentialFuture, CredentialValues, CredentialsUnavailable, HostServices, InvokeTokens, ReverseCall,
    ServiceFuture, TokenFuture, TokenRequest, TokenSource, sampling_offer,
};
use serde_json::{Map, Value};

use crate::credentials::{CredentialStore, Keyring};
use crate::dev::{DevFamily, DevMode};
use crate::grants::GrantStore;
use fleet_proto::admin::grants::Grant;
use fleet_proto::util::now_ms;

pub use budget::{BudgetLimits, Exhausted, InvokeBudget};
pub use tokens::{Binding, ServiceClaims, TokenError, TokenMinter};

/// Budgets whose invoke-end was never reported are dropped after this long (the longest token TTL).
const BUDGET_MAX_AGE: Duration = fleet_proto::limits::LONG_JOB_TOKEN_TTL_CAP;

/// The host capabilities these services mint tokens for.
pub const SERVICE_CAPABILITIES: [&str; 11] = [
    capabilities::LLM_SAMPLE,
    capabilities::LLM_EMBED,
    capabilities::LLM_IMAGE,
    capabilities::LLM_IMAGE_EDIT,
    capabilities::APS_KV,
    capabilities::APS_FILES,
    capabilities::HOST_UPLOAD,
    capabilities::WEB_SEARCH,
    capabilities::WEB_FETCH,
    capabilities::WEB_IMAGE_SEARCH,
    capabilities::WEB_IMAGE_FETCH,
];

/// The `web.*` capabilities a web token may carry.
const WEB_TOKEN_CAPABILITIES: [&str; 4] = [
    capabilities::WEB_SEARCH,
    capabilities::WEB_FETCH,
    capabilities::WEB_IMAGE_SEARCH,
    capabilities::WEB_IMAGE_FETCH,
];

/// The scopes a plugin's storage token permits (spec §8.3 HR-ST-02).
pub const PLUGIN_SCOPES: [&str; 2] = ["tool", "user"];

/// What one reverse call runs with, after its token verified.
#[derive(Debug, Clone)]
pub struct CallContext {
    /// The user.
    pub user: String,
    /// The plugin.
    pub tool_id: String,
    /// The parent invoke.
    pub invoke_id: String,
    /// The parent invoke's absolute deadline, Unix ms.
    pub deadline_ms: u64,
    /// `_clientTimeoutS` as the SDK sent it.
    pub client_timeout_s: Option<f64>,
    /// The verified claims of the family's token.
    pub claims: ServiceClaims,
    /// The parent invoke's budget.
    pub budget: Arc<InvokeBudget>,
}

impl CallContext {
    /// Time left until the parent invoke's deadline.
    pub fn remaining(&self) -> Duration {
        Duration::from_millis(self.deadline_ms.saturating_sub(now_ms()))
    }

    /// The effective subcall timeout (spec §7.3 HR-DL-01): `min(_clientTimeoutS, remaining, cap)`.
    pub fn subcall_timeout(&self, cap: Duration) -> Duration {
        let mut t = self.remaining().min(cap);
        if let Some(c) = self.client_timeout_s.filter(|c| c.is_finite() && *c > 0.0) {
            t = t.min(Duration::from_secs_f64(c.min(cap.as_secs_f64())));
        }
        t
    }

    /// Whether the verified token carries `capability` (the grant at mint time).
    pub fn granted(&self, capability: &str) -> bool {
        self.claims.caps.iter().any(|c| c == capability)
    }
}

/// Configuration of the host services (`[services]` of the TOML config; flags override).
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServicesConfig {
    /// The base URL download links point at (the fleet's HTTP listener as clients reach it), e.g.
    /// `https://fleet.example.com`. Without it, links are relative (`/v1/files/…`).
    #[serde(default)]
    pub public_url: Option<String>,
    /// The base URL of file download and upload links when user content has an origin of its own (a cookieless
    /// host that routes only `/v1/files/` to the fleet), e.g. `https://files.fleet-usercontent.example`; without
    /// it, links use `public_url`.
    #[serde(default)]
    pub files_public_url: Option<String>,
    /// The OpenAI-compatible upstream for sampling and embeddings; absent: neither is offered.
    #[serde(default)]
    pub llm: Option<llm::LlmConfig>,
    /// APS storage settings.
    #[serde(default)]
    pub storage: kv::StorageConfig,
    /// The OpenAI-compatible images upstream; absent: `image/*` is not offered (`-32109`).
    #[serde(default)]
    pub image: Option<image::ImageConfig>,
    /// `web/*`: the search provider, the daily pool, fetch on or off.
    #[serde(default)]
    pub web: web::WebConfig,
    /// Agent sessions (served over `llm`).
    #[serde(default)]
    pub agent: agent::AgentConfig,
    /// Platform credentials: the OAuth providers users connect accounts of (`[credentials.providers.<name>]`).
    #[serde(default)]
    pub credentials: oauth::config::CredentialsConfig,
    /// The developer harness (`fleet up --mocks`, `--dev-mode`); not part of the TOML file.
    #[serde(skip)]
    pub dev: dev::DevSettings,
}

/// Why the services could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServicesError {
    /// A JetStream resource.
    #[error("host services: {0}")]
    Store(String),
    /// Configuration.
    #[error("host services configuration: {0}")]
    Config(String),
}

impl ServicesConfig {
    /// The base URL of file links: `files_public_url` (which must be an `http://` or `https://` URL), else
    /// `public_url`, else none (relative links).
    pub fn files_link_base(&self) -> Result<Option<String>, ServicesError> {
        match &self.files_public_url {
            Some(url) if !(url.starts_with("https://") || url.starts_with("http://")) => Err(
                ServicesError::Config("files_public_url must be an http:// or https:// URL".to_owned()),
            ),
            Some(url) => Ok(Some(url.clone())),
            None => Ok(self.public_url.clone()),
        }
    }
}

/// The fleet's host services and token source (one per worker process).
#[derive(Debug, Clone)]
pub struct FleetServices {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    minter: TokenMinter,
    grants: GrantStore,
    credentials: CredentialStore,
    budgets: DashMap<String, Arc<InvokeBudget>>,
    llm: Option<llm::LlmService>,
    kv: kv::KvService,
    files: files::FilesService,
    upload: upload::UploadService,
    image: Option<image::ImageService>,
    /// `image/*` is off because no upstream is configured (not because `--dev-mode image=off` said so).
    image_unconfigured: bool,
    web: web::WebService,
    /// Agent sessions (`agent/*` when `real`).
    agent: agent::AgentService,
    /// OAuth providers and accounts (`credentials/*`, platform credentials).
    oauth: oauth::OAuthService,
    /// `[credentials] require_grant`: platform credentials only where the user's grant names them.
    platform_needs_grant: bool,
    /// Each sync invoke's delegation for its sessions' tool calls (never given to the plugin).
    delegations: DashMap<String, fleet_proto::api::delegation::DelegationToken>,
    /// Every family's mode.
    modes: dev::Modes,
    /// What families in `mock` mode answer from.
    mocks: Arc<mock::MockSet>,
}

impl FleetServices {
    /// Opens every resource the services need; `keyring` seals and opens the users' credentials.
    pub async fn open(
        js: &async_nats::jetstream::Context,
        settings: &fleet_store::StoreSettings,
        config: &ServicesConfig,
        links: files::LinkSigner,
        keyring: Keyring,
    ) -> Result<FleetServices, ServicesError> {
        let modes = config
            .dev
            .resolve(dev::Upstreams::of(config))
            .map_err(|e| ServicesError::Config(e.to_string()))?;
        let grants = GrantStore::open(js, settings)
            .await
            .map_err(|e| ServicesError::Store(e.to_string()))?;
        let credentials = CredentialStore::open(js, settings, keyring.clone())
            .await
            .map_err(|e| ServicesError::Store(e.to_string()))?;
        let oauth = oauth::OAuthService::open(
            js,
            settings,
            &config.credentials,
            config.public_url.clone(),
            keyring,
        )
        .await?;
        // One per-user byte quota for KV values and files.
        let quota = kv::Quota::open(js, settings, &config.storage).await?;
        let kv = kv::KvService::open(js, settings, quota.clone()).await?;
        let files = files::FilesService::open(js, settings, quota, links, config.files_link_base()?).await?;
        let upload = upload::UploadService::new(files.clone()).with_env(&settings.prefix);
        // One fetcher, one SSRF policy, for every URL a plugin or a provider names.
        let fetcher = web::fetcher(&config.web, Arc::new(web::ssrf::SystemResolver));
        // One daily-usage counter for every metered family (`image/*`, `web/*`, `llm.*`), shared by all workers; a front
        // creates its bucket whatever its own configuration.
        let usage = usage::UsageCounter::open(js, settings).await?;
        let llm = match &config.llm {
            Some(c) => Some(llm::LlmService::new(c)?.metered(usage.clone())),
            None => None,
        };
        let image = match (&config.image, modes.get(DevFamily::Image)) {
            (Some(c), DevMode::Real) => Some(
                image::ImageService::open(
                    settings,
                    c,
                    files.objects().clone(),
                    fetcher.clone(),
                    usage.clone(),
                )
                .await?,
            ),
            _ => None,
        };
        let image_unconfigured = config.image.is_none() && !config.dev.is_explicit(DevFamily::Image);
        let web = web::WebService::with_fetcher(&config.web, fetcher, usage)?;
        // Agent sessions in JetStream KV: any worker serves any session (a front creates the bucket).
        let max_sessions = config.agent.max_sessions;
        if max_sessions == 0 || max_sessions > fleet_proto::limits::AGENT_SESSION_CACHE_MAX {
            return Err(ServicesError::Config(format!(
                "agent.max_sessions must be 1–{}",
                fleet_proto::limits::AGENT_SESSION_CACHE_MAX
            )));
        }
        let agent_sessions = agent::store::SessionStore::open(js, settings, max_sessions)
            .await
            .map_err(|e| ServicesError::Store(e.to_string()))?;
        Ok(FleetServices {
            inner: Arc::new(Inner {
                minter: TokenMinter::new().map_err(|e| ServicesError::Config(e.to_string()))?,
                grants,
                credentials,
                budgets: DashMap::new(),
                llm,
                kv,
                files,
                upload,
                image,
                image_unconfigured,
                web,
                agent: agent::AgentService::new(agent_sessions, Some(js.client())),
                oauth,
                platform_needs_grant: config.credentials.require_grant,
                delegations: DashMap::new(),
                modes,
                mocks: config.dev.mocks().clone(),
            }),
        })
    }

    /// The object store of files and uploads, for the HTTP listener's `/v1/files` routes.
    pub fn objects(&self) -> &files::HostObjects {
        self.inner.files.objects()
    }

    /// The grants store.
    pub fn grants(&self) -> &GrantStore {
        &self.inner.grants
    }

    /// The image service, when `[image]` is configured and real.
    pub fn image(&self) -> Option<&image::ImageService> {
        self.inner.image.as_ref()
    }

    /// The users' credentials.
    pub fn credential_store(&self) -> &CredentialStore {
        &self.inner.credentials
    }

    /// OAuth providers, accounts and the connect flow.
    pub fn oauth(&self) -> &oauth::OAuthService {
        &self.inner.oauth
    }

    /// The `web/*` service (its daily pool).
    pub fn web(&self) -> &web::WebService {
        &self.inner.web
    }

    /// The token minter (tests mint tampered tokens with it).
    pub fn minter(&self) -> &TokenMinter {
        &self.inner.minter
    }

    /// Budgets currently held (one per invoke that has tokens).
    pub fn budgets_held(&self) -> usize {
        self.inner.budgets.len()
    }

    /// The budget of an invoke, if it has one.
    pub fn budget(&self, invoke_id: &str) -> Option<Arc<InvokeBudget>> {
        self.inner.budgets.get(invoke_id).map(|b| b.clone())
    }

    fn sweep_budgets(&self) {
        self.inner
            .budgets
            .retain(|_, b| b.created().elapsed() < BUDGET_MAX_AGE);
    }

    /// The invoke's tokens: the services' ([`Self::mint_services`]) and the `credentials_token` (spec §8.8:
    /// minted whenever the manifest declares a credential name a configured provider maps; with
    /// `[credentials] require_grant`, only for the names the user's grant allows — [`Self::platform_names`]).
    async fn mint(&self, req: TokenRequest) -> InvokeTokens {
        let mut tokens = self.mint_services(&req).await;
        let give_up = fleet_store::failover::instant_of_epoch_ms(req.deadline_ms);
        let names = self
            .platform_names(&req.user, &req.tool_id, &req.credentials, give_up)
            .await;
        let providers = self.inner.oauth.covering(&names);
        if !providers.is_empty() {
            let binding = Binding {
                user: &req.user,
                tool_id: &req.tool_id,
                invoke_id: &req.invoke_id,
            };
            let ttl = TokenMinter::ttl_for(req.deadline_ms);
            let mut c = TokenMinter::claims(binding, tokens::AUD_CREDENTIALS, ttl);
            c.user_id = Some(req.user.clone());
            c.providers = Some(providers);
            match self.inner.minter.sign(&c) {
                Ok(t) => {
                    tokens.credentials = Some(t);
                    tokens.renew_at_ms = tokens::renew_at_ms(now_ms(), ttl, req.deadline_ms);
                }
                Err(e) => tracing::error!(error = %e, "credentials token minting failed"),
            }
        }
        tokens
    }

    /// Of `names` (a manifest's credential names), those whose platform credential `tool_id` may receive for `user`:
    /// all of them, unless `[credentials] require_grant` is on — then those a provider maps and the user's grant
    /// allows (`credential:<NAME>`). A grant that cannot be read grants none (logged without values).
    async fn platform_names(
        &self,
        user: &str,
        tool_id: &str,
        names: &[String],
        give_up: tokio::time::Instant,
    ) -> Vec<String> {
        let mapped = self.inner.oauth.mapped(names);
        if !self.inner.platform_needs_grant || mapped.is_empty() {
            return mapped;
        }
        match self.inner.grants.get_until(user, tool_id, give_up).await {
            Ok(grant) => mapped
                .into_iter()
                .filter(|n| grant.allows_credential(n))
                .collect(),
            Err(e) => {
                tracing::warn!(tool_id = %tool_id, error = %e, "grant lookup failed: no platform credentials");
                Vec::new()
            }
        }
    }

    async fn mint_services(&self, req: &TokenRequest) -> InvokeTokens {
        let offered = |k: &str| req.negotiated.contains(k);
        let declared = |c: &str| req.declared.iter().any(|d| d == c);
        // Nothing could be minted: skip the grant lookup entirely.
        if !SERVICE_CAPABILITIES.iter().any(|c| declared(c)) {
            return InvokeTokens::default();
        }
        // Waited for while the store does not answer (a NATS node lost), up to the invoke's deadline: a grant
        // that cannot be read yet must not cost the invoke its services.
        let give_up = fleet_store::failover::instant_of_epoch_ms(req.deadline_ms);
        let grant = match self
            .inner
            .grants
            .get_until(&req.user, &req.tool_id, give_up)
            .await
        {
            Ok(g) => g,
            Err(e) => {
                tracing::warn!(tool_id = %req.tool_id, error = %e, "grant lookup failed: no service tokens for this invoke");
                Grant::default()
            }
        };
        let ok = |cap: &str, keys_: &[&str]| {
            declared(cap) && grant.allows(cap) && keys_.iter().any(|k| offered(k))
        };
        let on = |f: DevFamily| self.inner.modes.on(f);
        let sampling_caps: Vec<String> = [
            (
                capabilities::LLM_SAMPLE,
                (on(DevFamily::Sampling) || on(DevFamily::Agent))
                    && ok(capabilities::LLM_SAMPLE, &[keys::SAMPLING, keys::AGENT]),
            ),
            (
                agent::LLM_AGENT_AUTO,
                on(DevFamily::Agent) && ok(agent::LLM_AGENT_AUTO, &[keys::AGENT, keys::SAMPLING]),
            ),
            (
                capabilities::LLM_EMBED,
                on(DevFamily::Embeddings) && ok(capabilities::LLM_EMBED, &[keys::EMBED, keys::SAMPLING]),
            ),
        ]
        .into_iter()
        .filter(|&(_, on)| on)
        .map(|(c, _)| c.to_owned())
        .collect();
        let storage_caps: Vec<String> = [capabilities::APS_KV, capabilities::APS_FILES]
            .into_iter()
            .filter(|c| on(DevFamily::Storage) && ok(c, &[keys::STORAGE]))
            .map(str::to_owned)
            .collect();
        let upload_ok = on(DevFamily::Upload) && ok(capabilities::HOST_UPLOAD, &[keys::UPLOAD]);
        let image_caps: Vec<String> = [capabilities::LLM_IMAGE, capabilities::LLM_IMAGE_EDIT]
            .into_iter()
            .filter(|c| on(DevFamily::Image) && ok(c, &[keys::IMAGE, keys::IMAGE_EDIT]))
            .map(str::to_owned)
            .collect();
        // Web needs no `initialize` key (spec §3.3: "(v2)"; the worker withholds every token from v1 sessions).
        let web_served: Vec<&str> = WEB_TOKEN_CAPABILITIES
            .into_iter()
            .filter(|c| declared(c) && self.inner.web.serves(c))
            .collect();
        let web_caps: Vec<String> = web_served
            .iter()
            .filter(|c| grant.allows(c))
            .map(|c| (*c).to_owned())
            .collect();
        let web_denied = grant.web.as_ref().is_some_and(|w| !w.enabled);

        let binding = Binding {
            user: &req.user,
            tool_id: &req.tool_id,
            invoke_id: &req.invoke_id,
        };
        let ttl = TokenMinter::ttl_for(req.deadline_ms);
        let mut limits = BudgetLimits::default();
        if let Some(n) = grant.image.and_then(|i| i.max_per_invoke) {
            limits.images_per_invoke = n;
        }
        if let Some(u) = &grant.upload {
            limits.upload_files = u
                .max_files
                .map_or(limits.upload_files, |m| m.min(limits.upload_files));
            limits.upload_file_bytes = u.max_file_bytes.unwrap_or(limits.upload_file_bytes);
            limits.upload_total_bytes = u
                .max_total_bytes
                .map_or(limits.upload_total_bytes, |m| m.min(limits.upload_total_bytes));
        }
        let mut tokens = InvokeTokens::default();
        let sign = |c: &ServiceClaims| match self.inner.minter.sign(c) {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::error!(error = %e, "service token minting failed");
                None
            }
        };
        if !sampling_caps.is_empty() {
            let mut c = TokenMinter::claims(binding, tokens::AUD_SAMPLING, ttl);
            c.caps = sampling_caps;
            c.max_calls = Some(limits.sampling_calls);
            c.max_tokens_total = Some(limits.sampling_tokens);
            tokens.sampling = sign(&c);
        }
        if !storage_caps.is_empty() {
            let mut c = TokenMinter::claims(binding, tokens::AUD_STORAGE, ttl);
            c.caps = storage_caps;
            c.allowed_scopes = Some(PLUGIN_SCOPES.iter().map(|s| (*s).to_owned()).collect());
            c.max_calls = Some(limits.storage_calls);
            tokens.storage = sign(&c);
        }
        if upload_ok {
            let mut c = TokenMinter::claims(binding, tokens::AUD_UPLOAD, ttl);
            c.caps = vec![capabilities::HOST_UPLOAD.to_owned()];
            c.max_files = Some(limits.upload_files);
            c.max_file_bytes = Some(limits.upload_file_bytes);
            c.max_total_bytes = Some(limits.upload_total_bytes);
            c.allowed_purposes = Some(
                grant
                    .upload
                    .as_ref()
                    .and_then(|u| u.allowed_purposes.clone())
                    .unwrap_or_else(|| upload::PURPOSES.iter().map(|p| (*p).to_owned()).collect()),
            );
            tokens.upload = sign(&c);
        }
        if !image_caps.is_empty() {
            let mut c = TokenMinter::claims(binding, tokens::AUD_IMAGE, ttl);
            c.caps = image_caps;
            let limits_ = grant.image.unwrap_or_default();
            let per_call = |default: u32| limits_.max_per_call.unwrap_or(default);
            c.max_per_call_generate =
                Some(per_call(fleet_proto::limits::IMAGE_DEFAULT_MAX_PER_CALL_GENERATE));
            c.max_per_call_edit = Some(per_call(fleet_proto::limits::IMAGE_DEFAULT_MAX_PER_CALL_EDIT));
            c.max_images_per_day = Some(
                limits_
                    .max_images_per_day
                    .unwrap_or(fleet_proto::limits::IMAGE_DEFAULT_MAX_PER_DAY),
            );
            c.max_images = Some(limits.images_per_invoke);
            tokens.image = sign(&c);
        }
        if !web_caps.is_empty() || (web_denied && !web_served.is_empty()) {
            let mut c = TokenMinter::claims(binding, tokens::AUD_WEB, ttl);
            c.caps = web_caps;
            let settings = grant.web.clone().unwrap_or_default();
            c.web_advanced = Some(settings.allow_advanced);
            c.max_results = settings.max_results_per_call;
            c.web_denied = web_denied.then_some(true);
            tokens.web = sign(&c);
        }
        if tokens.sampling.is_some()
            || tokens.storage.is_some()
            || tokens.upload.is_some()
            || tokens.image.is_some()
            || tokens.web.is_some()
        {
            self.sweep_budgets();
            // A renewal (the same invoke, minted again) keeps the budget it has.
            self.inner
                .budgets
                .entry(req.invoke_id.clone())
                .or_insert_with(|| Arc::new(InvokeBudget::new(limits)));
            tokens.renew_at_ms = tokens::renew_at_ms(now_ms(), ttl, req.deadline_ms);
        }
        tokens
    }

    /// Serves one reverse call (the [`HostServices`] entry point, callable directly by tests).
    pub async fn serve(&self, call: ReverseCall) -> Result<Value, ErrorObject> {
        let mode = self.inner.modes.of(call.family);
        if mode == Some(DevMode::Off) && call.family == Family::Image && self.inner.image_unconfigured {
            return Err(image_codes::IMAGE_NO_MODEL_AVAILABLE
                .error("no image provider is configured on this host ([image] of --services-config)"));
        }
        if mode == Some(DevMode::Off)
            && let Some(family) = DevFamily::of(call.family)
        {
            return Err(family
                .off_code()
                .error(format!("{} is off on this host", call.method)));
        }
        let (aud, token, missing) = match call.family {
            Family::Sampling | Family::Embeddings | Family::Agent => (
                tokens::AUD_SAMPLING,
                call.tokens.sampling.as_deref(),
                call.family.not_granted().error(format!(
                    "sampling_token missing — the user has not granted {} to this plugin",
                    call.family.manifest_capability().unwrap_or("llm.sample")
                )),
            ),
            Family::Storage | Family::Files => (
                tokens::AUD_STORAGE,
                call.tokens.storage.as_deref(),
                storage_codes::STORAGE_NOT_GRANTED
                    .error("storage_token missing — host did not authorize storage for this invoke"),
            ),
            Family::Upload => (
                tokens::AUD_UPLOAD,
                call.tokens.upload.as_deref(),
                upload_codes::UPLOAD_NOT_GRANTED
                    .error("Upload token missing — host did not authorize host/uploadFile"),
            ),
            Family::Image => (
                tokens::AUD_IMAGE,
                call.tokens.image.as_deref(),
                image_codes::IMAGE_NOT_GRANTED
                    .error("image_token missing — the user has not granted llm.image to this plugin"),
            ),
            Family::Web => (
                tokens::AUD_WEB,
                call.tokens.web.as_deref(),
                web_codes::WEB_NOT_GRANTED.error(format!(
                    "{} is not granted to this plugin (web_grant is disabled by default)",
                    call.method
                )),
            ),
            Family::Credentials => {
                if !self.inner.oauth.configured() {
                    return Err(credentials_codes::CREDENTIALS_NOT_GRANTED.error(format!(
                        "{} is not offered on this host (no [credentials.providers] is configured)",
                        call.method
                    )));
                }
                (
                    tokens::AUD_CREDENTIALS,
                    call.tokens.credentials.as_deref(),
                    credentials_codes::CREDENTIALS_NOT_GRANTED.error(
                        "credentials_token missing — the manifest's credentials[] declares no name a configured \
                         OAuth provider maps",
                    ),
                )
            }
        };
        let binding = Binding {
            user: &call.user,
            tool_id: &call.tool_id,
            invoke_id: &call.invoke_id,
        };
        let claims = match self.inner.minter.verify(token, aud, binding) {
            Ok(c) => c,
            Err(TokenError::Missing) => return Err(missing),
            Err(TokenError::Expired) if call.family == Family::Web => {
                return Err(web_codes::WEB_TOKEN_EXPIRED.error("the invoke's web token has expired"));
            }
            Err(e) => {
                return Err(call
                    .family
                    .not_granted()
                    .error(format!("the invoke's token was refused: {e}")));
            }
        };
        if claims.web_denied == Some(true) {
            return Err(web_codes::WEB_USER_DENIED.error("the user has turned web off for this plugin"));
        }
        // The capability within the family's token (one storage token serves aps.kv and aps.files).
        let needed = call.family.method_capability(&call.method);
        if let Some(cap) = needed
            && !claims.caps.iter().any(|c| c == cap)
        {
            return Err(call
                .family
                .not_granted()
                .error(format!("the user has not granted {cap} to this plugin")));
        }
        let budget = self
            .inner
            .budgets
            .entry(call.invoke_id.clone())
            .or_insert_with(|| Arc::new(InvokeBudget::new(BudgetLimits::default())))
            .clone();
        let ctx = CallContext {
            user: call.user.clone(),
            tool_id: call.tool_id.clone(),
            invoke_id: call.invoke_id.clone(),
            deadline_ms: call.deadline_ms,
            client_timeout_s: call.client_timeout_s,
            claims,
            budget,
        };
        if matches!(call.family, Family::Storage | Family::Files)
            && let Err(e) = ctx.budget.admit_storage()
        {
            return Err(storage_codes::RATE_LIMITED.error_with(
                e.to_string(),
                Map::from_iter([("reason".to_owned(), Value::from("invoke_budget"))]),
            ));
        }
        if mode == Some(DevMode::Mock) {
            let site = mock::CallSite {
                method: &call.method,
                params: &call.params,
                tool_id: &call.tool_id,
                tool: &call.tool,
            };
            return mock::serve(&self.inner.mocks, &ctx, call.family, &site);
        }
        match call.family {
            Family::Sampling | Family::Embeddings => match &self.inner.llm {
                Some(llm) => llm.call(&ctx, &call.method, call.params).await,
                None => Err(call
                    .family
                    .not_granted()
                    .error("no LLM upstream is configured on this host")),
            },
            Family::Storage => self.inner.kv.call(&ctx, &call.method, call.params).await,
            Family::Files => self.inner.files.call(&ctx, &call.method, call.params).await,
            Family::Upload => self.inner.upload.call(&ctx, &call.method, call.params).await,
            Family::Image => match &self.inner.image {
                Some(image) => image.call(&ctx, &call.method, call.params).await,
                None => Err(image_codes::IMAGE_NO_MODEL_AVAILABLE
                    .error("no image provider is configured on this host")),
            },
            Family::Web => {
                self.inner
                    .web
                    .call(&ctx, &call.method, call.params, &self.inner.upload)
                    .await
            }
            Family::Agent => match &self.inner.llm {
                Some(llm) => {
                    let delegation = self.inner.delegations.get(&call.invoke_id).map(|d| d.clone());
                    (self.inner.agent)
                        .call(&ctx, llm, &call.method, &call.params, delegation.as_ref())
                        .await
                }
                None => Err(call
                    .family
                    .not_granted()
                    .error("no LLM upstream is configured on this host")),
            },
            Family::Credentials => self.inner.oauth.call(&ctx, &call.method, &call.params).await,
        }
    }
}

impl TokenSource for FleetServices {
    fn delegate(&self, invoke_id: &str, delegation: fleet_proto::api::delegation::DelegationToken) {
        self.inner.delegations.insert(invoke_id.to_owned(), delegation);
    }

    fn tokens(&self, request: TokenRequest) -> TokenFuture {
        let this = self.clone();
        Box::pin(async move { this.mint(request).await })
    }

    fn credentials(&self, user: &str, tool_id: &str, names: &[String], deadline_ms: u64) -> CredentialFuture {
        let this = self.clone();
        let (user, tool_id, names) = (user.to_owned(), tool_id.to_owned(), names.to_vec());
        Box::pin(async move {
            let give_up = fleet_store::failover::instant_of_epoch_ms(deadline_ms);
            // Spec §4.2 HR-CR-01: platform credentials (a provider's mapping, the default account's live access
            // token) first, then the plugin's and the user's stored values; the manifest default is the worker's.
            let platform_names = this.platform_names(&user, &tool_id, &names, give_up).await;
            let (platform, stored) = tokio::join!(
                this.inner
                    .oauth
                    .platform_credentials(&user, &platform_names, give_up),
                this.inner.credentials.resolve(&user, &tool_id, &names, give_up)
            );
            let unavailable = |e: credentials::CredentialError| {
                // The error names the user and key id, never a value.
                tracing::warn!(tool_id = %tool_id, error = %e, "credentials lookup failed");
                CredentialsUnavailable(e.to_string())
            };
            let mut found = stored.map_err(unavailable)?;
            found.extend(platform.map_err(unavailable)?);
            Ok(CredentialValues(
                found
                    .into_iter()
                    .map(|(name, value)| (name, Value::String(value.as_str().to_owned())))
                    .collect(),
            ))
        })
    }
}

impl FleetServices {
    /// The agent sessions' service.
    pub fn agent(&self) -> &agent::AgentService {
        &self.inner.agent
    }

    /// Delegations held (one per sync invoke whose exec request carried one, until it ends).
    pub fn delegations_held(&self) -> usize {
        self.inner.delegations.len()
    }
}

impl HostServices for FleetServices {
    fn call(&self, call: ReverseCall) -> ServiceFuture {
        let this = self.clone();
        if family_of(&call.method).is_none() {
            let e = method_not_found(&call.method);
            return Box::pin(async move { Err(e) });
        }
        Box::pin(async move { this.serve(call).await })
    }

    fn offer(&self) -> Map<String, Value> {
        let mut offer = Map::new();
        let on = |f: DevFamily| self.inner.modes.on(f);
        if on(DevFamily::Sampling) {
            offer.insert(keys::SAMPLING.into(), sampling_offer());
        }
        for (family, keys_) in [
            (DevFamily::Embeddings, &[keys::EMBED][..]),
            (DevFamily::Agent, &[keys::AGENT][..]),
            (DevFamily::Storage, &[keys::STORAGE][..]),
            (DevFamily::Upload, &[keys::UPLOAD][..]),
            (DevFamily::Image, &[keys::IMAGE, keys::IMAGE_EDIT][..]),
        ] {
            if on(family) {
                for k in keys_ {
                    offer.insert((*k).into(), Value::Object(Map::new()));
                }
            }
        }
        if let Some(web) = self.inner.web.offer() {
            offer.insert(keys::WEB.into(), web);
        }
        if let Some(credentials) = self.inner.oauth.offer() {
            offer.insert(keys::CREDENTIALS.into(), credentials);
        }
        offer.insert(keys::FILE_TRANSPORT.into(), Value::Bool(true));
        offer
    }

    fn invoke_finished(&self, invoke_id: &str) {
        self.inner.budgets.remove(invoke_id);
        self.inner.delegations.remove(invoke_id);
    }
}
