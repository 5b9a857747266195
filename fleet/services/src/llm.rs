//! Sampling (`sampling/createMessage`, spec §8.1) and embeddings (`embeddings/create`, §8.5) against an
//! OpenAI-compatible HTTP upstream (`POST {base_url}/chat/completions`, `POST {base_url}/embeddings`).
//!
//! A sampling call goes through, in this order:
//! 1. **validation** (`-32004 SAMPLING_INVALID_REQUEST`): `messages` non-empty and ≤ 64 entries of
//!    `{role: user|assistant|system, content: {type: "text", text}}`; `maxTokens` a positive integer ≤ 8 192
//!    (rejected, not clamped: spec §16 A-16); `includeContext` only `"none"`; `temperature` a number in
//!    `[0, 2]`; `stopSequences` strings; `responseFormat` `json_object` / `json_schema` with the schema hard limits
//!    (≤ 32 KB serialized, depth ≤ 8, ≤ 512 nodes, `name` `^[a-zA-Z0-9_-]{1,64}$`); `onUnsupported`
//!    `error` / `json_object` / `text`;
//! 2. **model selection**: the first `modelPreferences.hints[*].name` that is a case-insensitive substring of a
//!    configured model's name picks that model (models in configuration order), else the default model;
//! 3. **response format gating**: `json_schema` on a model without `structured_output` is `-32010` when
//!    `onUnsupported` is `"error"` (the default), else downgraded to `json_object` or dropped, and reported in
//!    `_meta.responseFormat`; `json_object` is never gated;
//! 4. **budget admission** (spec §7.4): the call is counted; `-32006` once the invoke has made its 8 calls,
//!    `-32007` once its reported usage reached 32 000 tokens;
//! 5. **the upstream call**, bounded by the model budget (`_clientTimeoutS` clamped to [30 s, 300 s], default
//!    90 s, spec §7.3) and by the time left to the invoke's deadline; the future is dropped with the invoke
//!    (spec §7.3 HR-DL-03), which aborts the HTTP request;
//! 6. **settlement**: the upstream's reported `usage.total_tokens` is added to the invoke's budget (an upstream
//!    that reports no usage is charged `maxTokens`). A failed upstream call still counts as a call.
//!
//! **The daily meter** ([`crate::usage`], family `llm`, the UTC day): each user's tokens over every sampling call and
//! agent step, all workers together, capped by `daily_quota_tokens` (default [`DEFAULT_DAILY_QUOTA_TOKENS`]). A call
//! reserves its `maxTokens` after step 4 and is refused with `-32002` (`agent/*`: `-32045`), `data: {used, limit}`,
//! when that does not fit what is left of the day; at step 6 it is settled at what it was charged (the reported
//! total, else `maxTokens`; a failed upstream call at nothing): the rest given back, or the excess (the prompt's
//! tokens) counted whatever the cap, so a day's spend passes the cap by at most one call's prompt. A call abandoned
//! while the upstream runs keeps its reservation counted (the user loses quota, never gains it).
//!
//! Upstream failures: HTTP 429 / 402 / `insufficient_quota` → `-32002`; other statuses, network failures and
//! unreadable bodies → `-32003`; the timeout → `-32005`. Embeddings: every provider failure is `-32503`
//! (spec §8.5 "flattened"), the timeout (30 s, or less when the invoke ends sooner) `-32505`, bad input
//! `-32504` (reject, never truncate).
//!
//! The API key is read once, from `api_key_file` or the environment variable `api_key_env`; it is sent only as
//! `Authorization: Bearer` (a header marked sensitive), never logged, never in `Debug`, and never in an error:
//! upstream error bodies are not echoed to plugins (only the HTTP status and a short symbolic upstream code).

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use fleet_proto::executa::reverse::{
    embeddings as embed_codes, method_not_found, methods, sampling as codes,
};
use fleet_proto::jsonrpc::ErrorObject;
use fleet_proto::limits;
use reqwest::header::{AUTHORIZATION, HeaderValue};
use serde_json::{Map, Value, json};

use super::{CallContext, Exhausted, ServicesError};
use crate::usage::{self, Reserved, UsageCounter, UsageError};

/// The host-stable embedding alias served by default (spec §8.5: `anna-managed-v1`).
pub const DEFAULT_EMBED_ALIAS: &str = "anna-managed-v1";

/// `_meta.provider` when the configuration names none.
pub const DEFAULT_PROVIDER: &str = "openai-compatible";

/// Environment variable read for the API key when neither `api_key_file` nor `api_key_env` is configured.
pub const DEFAULT_API_KEY_ENV: &str = "FLEET_LLM_API_KEY";

/// Each user's LLM tokens per UTC day when `[llm]` sets no `daily_quota_tokens`.
pub const DEFAULT_DAILY_QUOTA_TOKENS: u64 = 1_000_000;

/// Largest upstream response body read (a result must fit in one stdio frame anyway).
const MAX_UPSTREAM_BODY_BYTES: usize = limits::MAX_FRAME_BYTES;

/// Time allowed to establish the upstream connection (within the call's own timeout).
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Highest `temperature` accepted (the OpenAI range).
const MAX_TEMPERATURE: f64 = 2.0;

/// Longest upstream error code quoted back to a plugin.
const MAX_UPSTREAM_CODE_CHARS: usize = 64;

/// The upstream (`[services.llm]` of the TOML configuration).
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlmConfig {
    /// Base URL of the OpenAI-compatible API, including its version prefix, e.g. `https://api.openai.com/v1`.
    pub base_url: String,
    /// File holding the API key (surrounding whitespace ignored).
    #[serde(default)]
    pub api_key_file: Option<PathBuf>,
    /// Environment variable holding the API key. When neither this nor `api_key_file` is set,
    /// [`DEFAULT_API_KEY_ENV`] is read if present; with no key at all, no `Authorization` header is sent.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// `_meta.provider` of every result (default [`DEFAULT_PROVIDER`]).
    #[serde(default)]
    pub provider: Option<String>,
    /// The chat models, in preference order (`modelPreferences.hints` pick the first containing the hint).
    /// May be empty when `default_model` is set (that one model, without structured output).
    #[serde(default)]
    pub models: Vec<ModelConfig>,
    /// The model used when no hint matches (default: the first of `models`).
    #[serde(default)]
    pub default_model: Option<String>,
    /// The upstream embedding model behind the alias [`DEFAULT_EMBED_ALIAS`]; absent: `embeddings/create` is
    /// not offered.
    #[serde(default)]
    pub embedding_model: Option<String>,
    /// More embedding aliases: alias → upstream embedding model.
    #[serde(default)]
    pub embedding_aliases: BTreeMap<String, String>,
    /// Each user's LLM tokens per UTC day (default 1 000 000), sampling and agent steps together, counted
    /// fleet-wide: a call is admitted while its `maxTokens` fits what is left and charged what the upstream
    /// reports (prompt + completion, else `maxTokens`).
    #[serde(default)]
    pub daily_quota_tokens: Option<u64>,
}

/// One chat model (`[[services.llm.models]]`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The upstream model id, e.g. `gpt-4o-mini`.
    pub name: String,
    /// Whether the model honours `response_format: json_schema` (spec §8.1 `supports_structured_output`;
    /// missing = unsupported).
    #[serde(default)]
    pub structured_output: bool,
}

/// Why an [`LlmConfig`] was refused.
#[derive(Debug, thiserror::Error)]
pub enum LlmConfigError {
    /// `base_url` is not an absolute http(s) URL.
    #[error("services.llm.base_url must be an absolute http(s) URL without credentials: {0}")]
    BaseUrl(String),
    /// No chat model.
    #[error("services.llm: set default_model or list at least one of models")]
    NoModels,
    /// A model name is empty or repeated.
    #[error("services.llm.models: model name {0:?} is empty or repeated")]
    BadModelName(String),
    /// `default_model` is not among `models`.
    #[error("services.llm.default_model {0:?} is not one of services.llm.models")]
    UnknownDefaultModel(String),
    /// An embedding alias or model is empty.
    #[error("services.llm: embedding alias {0:?} or its model is empty")]
    BadEmbeddingAlias(String),
    /// Both key sources are configured.
    #[error("services.llm: set api_key_file or api_key_env, not both")]
    TwoKeySources,
    /// The key file could not be read.
    #[error("services.llm.api_key_file {path}: {source}")]
    KeyFile {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The configured environment variable is not set.
    #[error("services.llm.api_key_env: environment variable {0} is not set")]
    KeyEnv(String),
    /// The key is empty or cannot be sent in a header (its value is never shown).
    #[error("services.llm: the API key is empty or contains characters not allowed in an HTTP header")]
    BadKey,
    /// The HTTP client could not be built.
    #[error("services.llm: HTTP client: {0}")]
    Client(String),
}

impl From<LlmConfigError> for ServicesError {
    fn from(e: LlmConfigError) -> Self {
        ServicesError::Config(e.to_string())
    }
}

/// The `Authorization` header value, marked sensitive; `Debug` never shows it.
#[derive(Clone)]
pub(crate) struct ApiKey(HeaderValue);

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

/// Why an upstream's API key could not be read (the key itself is never in it).
#[derive(Debug, thiserror::Error)]
pub enum KeySourceError {
    /// Both `api_key_file` and `api_key_env`.
    #[error("set api_key_file or api_key_env, not both")]
    TwoSources,
    /// The key file could not be read.
    #[error("api_key_file {path}: {source}")]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The configured environment variable is not set.
    #[error("api_key_env: environment variable {0} is not set")]
    Env(String),
    /// Empty, or not sendable in a header.
    #[error("the API key is empty or contains characters not allowed in an HTTP header")]
    Bad,
}

impl From<KeySourceError> for LlmConfigError {
    fn from(e: KeySourceError) -> Self {
        match e {
            KeySourceError::TwoSources => LlmConfigError::TwoKeySources,
            KeySourceError::File { path, source } => LlmConfigError::KeyFile { path, source },
            KeySourceError::Env(var) => LlmConfigError::KeyEnv(var),
            KeySourceError::Bad => LlmConfigError::BadKey,
        }
    }
}

impl ApiKey {
    /// Reads the key from `file` or the environment variable `env`, else `default_env` if set; `None`: no key.
    pub(crate) fn read(
        file: Option<&PathBuf>,
        env: Option<&String>,
        default_env: &str,
    ) -> Result<Option<ApiKey>, KeySourceError> {
        let raw = match (file, env) {
            (Some(_), Some(_)) => return Err(KeySourceError::TwoSources),
            (Some(path), None) => {
                Some(
                    std::fs::read_to_string(path).map_err(|source| KeySourceError::File {
                        path: path.clone(),
                        source,
                    })?,
                )
            }
            (None, Some(var)) => Some(std::env::var(var).map_err(|_| KeySourceError::Env(var.clone()))?),
            (None, None) => std::env::var(default_env).ok(),
        };
        let Some(raw) = raw else { return Ok(None) };
        bearer(&raw).map(|v| Some(ApiKey(v))).ok_or(KeySourceError::Bad)
    }

    fn load(config: &LlmConfig) -> Result<Option<ApiKey>, LlmConfigError> {
        Ok(Self::read(
            config.api_key_file.as_ref(),
            config.api_key_env.as_ref(),
            DEFAULT_API_KEY_ENV,
        )?)
    }

    /// The `Authorization` header value (sensitive).
    pub(crate) fn header(&self) -> HeaderValue {
        self.0.clone()
    }
}

/// `Bearer <key>` (surrounding whitespace trimmed) as a sensitive header value; `None` for an empty key or one
/// that is not a header value. Every upstream key of the services goes through here.
pub(crate) fn bearer(raw: &str) -> Option<HeaderValue> {
    let key = raw.trim();
    if key.is_empty() {
        return None;
    }
    let mut value = HeaderValue::from_str(&format!("Bearer {key}")).ok()?;
    value.set_sensitive(true);
    Some(value)
}

/// An upstream's configured base URL, checked: `http`/`https`, no credentials (they belong in a key file), no
/// query or fragment; the trailing `/` removed. The error says which rule, never the URL.
pub(crate) fn upstream_base_url(text: &str) -> Result<reqwest::Url, String> {
    let base = text.trim().trim_end_matches('/');
    let url = reqwest::Url::parse(base).map_err(|e| e.to_string())?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!("scheme {:?}", url.scheme()));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err("credentials belong in api_key_file".into());
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err("no query or fragment".into());
    }
    Ok(url)
}

/// The sampling and embeddings service.
#[derive(Debug)]
pub struct LlmService {
    client: reqwest::Client,
    chat_url: String,
    embed_url: String,
    key: Option<ApiKey>,
    provider: String,
    models: Vec<ModelConfig>,
    default_model: ModelConfig,
    /// alias → upstream embedding model; empty: embeddings are not served.
    embed_aliases: BTreeMap<String, String>,
    /// Each user's tokens per UTC day.
    daily_tokens: u64,
    /// The daily-usage counter the tokens are metered on; `None`: not metered (unit tests only).
    usage: Option<UsageCounter>,
}

/// Why the daily meter refused a call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum DailyRefusal {
    /// The call's `maxTokens` does not fit what is left of the user's day.
    #[error(
        "the user's daily LLM quota is spent: {used} of {cap} tokens used today, {asked} more asked (maxTokens)"
    )]
    Spent {
        /// Tokens used today.
        used: u64,
        /// The cap.
        cap: u64,
        /// The call's `maxTokens`.
        asked: u64,
    },
    /// The counter could not be read or written.
    #[error("the daily LLM quota could not be read or written")]
    Store,
}

impl DailyRefusal {
    /// The error of a refused call, in `code`'s family, with `data: {used, limit}` when spent.
    pub(crate) fn error(
        &self,
        spent: fleet_proto::executa::reverse::RpcCode,
        store: fleet_proto::executa::reverse::RpcCode,
    ) -> ErrorObject {
        match self {
            DailyRefusal::Spent { used, cap, .. } => spent.error_with(
                self.to_string(),
                Map::from_iter([
                    ("used".to_owned(), Value::from(*used)),
                    ("limit".to_owned(), Value::from(*cap)),
                ]),
            ),
            DailyRefusal::Store => store.error(self.to_string()),
        }
    }
}

impl LlmService {
    /// Checks the configuration, reads the API key and builds the HTTP client.
    pub fn new(config: &LlmConfig) -> Result<LlmService, ServicesError> {
        Ok(Self::build(config)?)
    }

    fn build(config: &LlmConfig) -> Result<LlmService, LlmConfigError> {
        let base = check_base_url(&config.base_url).map_err(LlmConfigError::BaseUrl)?;
        let base = base.as_str();
        // `default_model` alone is a one-model configuration (without structured output).
        let models = match (&config.default_model, config.models.is_empty()) {
            (Some(name), true) => vec![ModelConfig {
                name: name.clone(),
                structured_output: false,
            }],
            (None, true) => return Err(LlmConfigError::NoModels),
            (_, false) => config.models.clone(),
        };
        for (i, m) in models.iter().enumerate() {
            if m.name.trim().is_empty() || models[..i].iter().any(|o| o.name == m.name) {
                return Err(LlmConfigError::BadModelName(m.name.clone()));
            }
        }
        let default_model = match &config.default_model {
            Some(name) => models
                .iter()
                .find(|m| &m.name == name)
                .ok_or_else(|| LlmConfigError::UnknownDefaultModel(name.clone()))?,
            None => models.first().ok_or(LlmConfigError::NoModels)?,
        }
        .clone();
        let mut embed_aliases = BTreeMap::new();
        if let Some(m) = &config.embedding_model {
            embed_aliases.insert(DEFAULT_EMBED_ALIAS.to_owned(), m.clone());
        }
        for (alias, model) in &config.embedding_aliases {
            embed_aliases.insert(alias.clone(), model.clone());
        }
        if let Some((alias, _)) = embed_aliases
            .iter()
            .find(|(a, m)| a.trim().is_empty() || m.trim().is_empty())
        {
            return Err(LlmConfigError::BadEmbeddingAlias(alias.clone()));
        }
        let key = ApiKey::load(config)?;
        let client = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            // Never follow a redirect with the key (nor without it: the upstream is configured, not discovered).
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| LlmConfigError::Client(e.to_string()))?;
        Ok(LlmService {
            client,
            chat_url: format!("{base}/chat/completions"),
            embed_url: format!("{base}/embeddings"),
            key,
            provider: config
                .provider
                .clone()
                .unwrap_or_else(|| DEFAULT_PROVIDER.to_owned()),
            models,
            default_model,
            embed_aliases,
            daily_tokens: config.daily_quota_tokens.unwrap_or(DEFAULT_DAILY_QUOTA_TOKENS),
            usage: None,
        })
    }

    /// Meters every call's tokens per user and UTC day on `usage` (all workers share its bucket).
    #[must_use]
    pub fn metered(mut self, usage: UsageCounter) -> LlmService {
        self.usage = Some(usage);
        self
    }

    /// Reserves `max_tokens` of the caller's day.
    async fn reserve_day(
        &self,
        ctx: &CallContext,
        max_tokens: u32,
    ) -> Result<Option<Reserved>, DailyRefusal> {
        let Some(usage) = &self.usage else { return Ok(None) };
        match usage
            .reserve(usage::LLM, &ctx.user, u64::from(max_tokens), self.daily_tokens)
            .await
        {
            Ok(reserved) => Ok(Some(reserved)),
            Err(UsageError::Exhausted { used, cap, asked }) => Err(DailyRefusal::Spent { used, cap, asked }),
            Err(e @ UsageError::Store(_)) => {
                tracing::warn!(invoke_id = %ctx.invoke_id, error = %e, "daily LLM quota unavailable");
                Err(DailyRefusal::Store)
            }
        }
    }

    /// Settles a reservation of [`reserve_day`](Self::reserve_day) at the tokens the call was charged.
    async fn settle_day(&self, ctx: &CallContext, reserved: Option<Reserved>, spent: u64) {
        if let (Some(usage), Some(reserved)) = (&self.usage, reserved) {
            usage.settle(&ctx.user, reserved, spent).await;
        }
    }

    /// Whether `embeddings/create` is served (an embedding model is configured).
    pub fn embeddings_enabled(&self) -> bool {
        !self.embed_aliases.is_empty()
    }

    /// Serves one call (`sampling/createMessage` or `embeddings/create`).
    pub async fn call(&self, ctx: &CallContext, method: &str, params: Value) -> Result<Value, ErrorObject> {
        match method {
            methods::SAMPLING_CREATE_MESSAGE => self.sample(ctx, &params).await,
            methods::EMBEDDINGS_CREATE => self.embed(ctx, &params).await,
            _ => Err(method_not_found(method)),
        }
    }

    /// The model a request's hints select (spec §8.1 `modelPreferences`).
    fn select_model(&self, hints: &[String]) -> &ModelConfig {
        select_by_hints(hints, &self.models, |m| &m.name).unwrap_or(&self.default_model)
    }

    /// One chat step of an agent session ([`crate::agent`]): `body` without its `model` (chosen from `hints`),
    /// admitted on and settled against the invoke's sampling budget (a step is a sampling call, spec §8.2),
    /// bounded like a sampling call. Returns the upstream's answer and the model.
    pub(crate) async fn agent_step(
        &self,
        ctx: &CallContext,
        hints: &[String],
        mut body: Map<String, Value>,
        max_tokens: u32,
    ) -> Result<(Value, String), StepError> {
        let model = self.select_model(hints).name.clone();
        body.insert("model".into(), Value::from(model.clone()));
        body.insert("max_tokens".into(), Value::from(max_tokens));
        body.insert("stream".into(), Value::Bool(false));
        ctx.budget.admit_sampling().map_err(StepError::Budget)?;
        let day = self
            .reserve_day(ctx, max_tokens)
            .await
            .map_err(StepError::Daily)?;
        let reply = match self
            .post(&self.chat_url, &Value::Object(body), sampling_timeout(ctx))
            .await
        {
            Ok(reply) => reply,
            Err(e) => {
                self.settle_day(ctx, day, 0).await;
                return Err(StepError::Upstream(e));
            }
        };
        let charged = Usage::of_chat(&reply).charge(max_tokens);
        ctx.budget.settle_sampling(charged);
        self.settle_day(ctx, day, charged).await;
        Ok((reply, model))
    }

    /// `sampling/createMessage` (also `agent/complete`, [`crate::agent`]).
    pub(crate) async fn sample(&self, ctx: &CallContext, params: &Value) -> Result<Value, ErrorObject> {
        let req = SamplingRequest::parse(params)?;
        let model = self.select_model(&req.hints);
        let format = resolve_format(req.response_format.as_ref(), req.on_unsupported, model)?;
        let body = chat_body(&req, model, format.as_ref());
        ctx.budget.admit_sampling().map_err(exhausted)?;
        let day = self
            .reserve_day(ctx, req.max_tokens)
            .await
            .map_err(|e| e.error(codes::SAMPLING_QUOTA_EXCEEDED, codes::SAMPLING_PROVIDER_ERROR))?;
        let timeout = sampling_timeout(ctx);
        let started = Instant::now();
        let reply = self.post(&self.chat_url, &body, timeout).await;
        let latency_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        let reply = match reply {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(invoke_id = %ctx.invoke_id, model = %model.name, error = %e, "sampling upstream failed");
                self.settle_day(ctx, day, 0).await;
                return Err(e.sampling_error());
            }
        };
        let usage = Usage::of_chat(&reply);
        let charged = usage.charge(req.max_tokens);
        ctx.budget.settle_sampling(charged);
        self.settle_day(ctx, day, charged).await;
        let completion = Completion::of(&reply, &req.stop).ok_or_else(|| {
            tracing::warn!(invoke_id = %ctx.invoke_id, model = %model.name, "sampling upstream answered without a choice");
            codes::SAMPLING_PROVIDER_ERROR.error("the LLM provider returned no completion")
        })?;
        let mut meta = Map::new();
        meta.insert("provider".into(), Value::from(self.provider.clone()));
        meta.insert("latencyMs".into(), Value::from(latency_ms));
        if usage.reported.is_none() {
            meta.insert("usageReported".into(), Value::Bool(false));
        }
        if let Some(f) = &format {
            meta.insert("responseFormat".into(), f.meta(&completion.text));
        }
        let (input, output, total) = usage.reported.unwrap_or((0, 0, charged));
        Ok(json!({
            "role": "assistant",
            "content": {"type": "text", "text": completion.text},
            "model": reply.get("model").and_then(Value::as_str).unwrap_or(&model.name),
            "stopReason": completion.stop_reason,
            "usage": {"inputTokens": input, "outputTokens": output, "totalTokens": total},
            "_meta": meta,
        }))
    }

    async fn embed(&self, ctx: &CallContext, params: &Value) -> Result<Value, ErrorObject> {
        if self.embed_aliases.is_empty() {
            return Err(embed_codes::EMBED_NOT_NEGOTIATED.error("embeddings are not enabled on this host"));
        }
        let req = EmbedRequest::parse(params, ctx, &self.embed_aliases)?;
        let timeout = ctx.subcall_timeout(limits::EMBED_REQUEST_TIMEOUT);
        let body = json!({"model": req.backend, "input": req.inputs});
        let started = Instant::now();
        let reply = self.post(&self.embed_url, &body, timeout).await;
        let latency_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        let reply = match reply {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(invoke_id = %ctx.invoke_id, alias = %req.alias, error = %e, "embeddings upstream failed");
                return Err(e.embed_error());
            }
        };
        let data = embedding_data(&reply, req.inputs.len()).ok_or_else(|| {
            tracing::warn!(invoke_id = %ctx.invoke_id, alias = %req.alias, "embeddings upstream answered with malformed data");
            embed_codes::EMBED_PROVIDER_ERROR.error("the embedding provider returned malformed data")
        })?;
        let dimensions = data
            .first()
            .and_then(|d| d.get("embedding"))
            .and_then(Value::as_array)
            .map_or(0, Vec::len);
        let usage = reply.get("usage").cloned().unwrap_or_else(|| json!({}));
        let prompt = usage.get("prompt_tokens").and_then(Value::as_u64).unwrap_or(0);
        let total = usage
            .get("total_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(prompt);
        Ok(json!({
            "object": "list",
            "model": req.alias,
            "data": data,
            "usage": {"prompt_tokens": prompt, "total_tokens": total},
            "_meta": {
                "alias": req.alias,
                "dimensions": dimensions,
                "backendModel": req.backend,
                "provider": self.provider,
                "latencyMs": latency_ms,
            },
        }))
    }

    /// POSTs `body` as JSON and returns the JSON answer, within `timeout` (connection, status and body).
    async fn post(&self, url: &str, body: &Value, timeout: Duration) -> Result<Value, UpstreamError> {
        let exchange = async {
            let mut request = self.client.post(url).json(body);
            if let Some(key) = &self.key {
                request = request.header(AUTHORIZATION, key.0.clone());
            }
            let mut response = request.send().await.map_err(|e| UpstreamError::network(&e))?;
            let status = response.status();
            let mut bytes = Vec::new();
            while let Some(chunk) = response.chunk().await.map_err(|e| UpstreamError::network(&e))? {
                if bytes.len() + chunk.len() > MAX_UPSTREAM_BODY_BYTES {
                    return Err(UpstreamError::Body("response too large"));
                }
                bytes.extend_from_slice(&chunk);
            }
            if !status.is_success() {
                return Err(UpstreamError::Status {
                    status: status.as_u16(),
                    code: upstream_code(&bytes),
                });
            }
            serde_json::from_slice::<Value>(&bytes).map_err(|_| UpstreamError::Body("response is not JSON"))
        };
        match tokio::time::timeout(timeout, exchange).await {
            Ok(r) => r,
            Err(_) => Err(UpstreamError::Timeout(timeout)),
        }
    }
}

/// The first of `models` (in order) whose name contains the first hint that any contains, case-insensitively
/// (spec §8.1 `modelPreferences.hints`; `image/*` picks its models the same way).
pub(crate) fn select_by_hints<'a, T>(
    hints: &[String],
    models: &'a [T],
    name: impl Fn(&T) -> &str,
) -> Option<&'a T> {
    hints
        .iter()
        .map(|h| h.to_lowercase())
        .filter(|h| !h.is_empty())
        .find_map(|h| models.iter().find(|m| name(m).to_lowercase().contains(&h)))
}

/// A configured upstream's base URL, without its trailing `/`: absolute http(s), no credentials, query or
/// fragment (the reason otherwise).
pub(crate) fn check_base_url(base_url: &str) -> Result<String, String> {
    upstream_base_url(base_url).map(|_| base_url.trim().trim_end_matches('/').to_owned())
}

/// The checks a `sampling/createMessage` passes before any upstream sees it (validation, step 1 above), for
/// the mock upstream ([`crate::mock`]): its `maxTokens` and the text of its last `user` message.
pub(crate) fn validate_sampling(params: &Value) -> Result<(u32, String), ErrorObject> {
    let req = SamplingRequest::parse(params)?;
    let last = req
        .messages
        .iter()
        .rev()
        .find(|(role, _)| role == "user")
        .map(|(_, text)| text.clone())
        .unwrap_or_default();
    Ok((req.max_tokens, last))
}

/// The checks an `embeddings/create` passes before any upstream sees it, for the mock upstream, which serves
/// the one alias [`DEFAULT_EMBED_ALIAS`]: the alias and the inputs.
pub(crate) fn validate_embed(
    params: &Value,
    ctx: &CallContext,
) -> Result<(String, Vec<String>), ErrorObject> {
    let aliases = BTreeMap::from([(DEFAULT_EMBED_ALIAS.to_owned(), String::new())]);
    let req = EmbedRequest::parse(params, ctx, &aliases)?;
    Ok((req.alias, req.inputs))
}

/// The model budget of a sampling call: `_clientTimeoutS` clamped to [30 s, 300 s], default 90 s (spec §7.3).
pub fn model_budget(client_timeout_s: Option<f64>) -> Duration {
    match client_timeout_s.filter(|s| s.is_finite() && *s > 0.0) {
        Some(s) => Duration::from_secs_f64(s.min(limits::SAMPLING_MODEL_BUDGET_MAX.as_secs_f64())).clamp(
            limits::SAMPLING_MODEL_BUDGET_MIN,
            limits::SAMPLING_MODEL_BUDGET_MAX,
        ),
        None => limits::DEFAULT_SAMPLING_TIMEOUT,
    }
}

/// The upstream timeout of a sampling call: the model budget, cut by the invoke's deadline (spec §7.3
/// HR-DL-01: the floor applies to the client's budget, never beyond the parent invoke).
fn sampling_timeout(ctx: &CallContext) -> Duration {
    ctx.remaining().min(model_budget(ctx.client_timeout_s))
}

/// The sampling error of an exhausted budget (`-32006`, `-32007`).
pub(crate) fn exhausted(e: Exhausted) -> ErrorObject {
    match e {
        Exhausted::SamplingCalls(_) => codes::SAMPLING_MAX_CALLS_EXCEEDED.error(e.to_string()),
        Exhausted::SamplingTokens { .. } => codes::SAMPLING_MAX_TOKENS_EXCEEDED.error(e.to_string()),
        other => codes::SAMPLING_PROVIDER_ERROR.error(other.to_string()),
    }
}

// -------------------------------------------------------------------------------------------------------------
// Upstream failures
// -------------------------------------------------------------------------------------------------------------

/// Why an agent step failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum StepError {
    /// The invoke's sampling budget.
    #[error("{0}")]
    Budget(Exhausted),
    /// The upstream.
    #[error("the LLM provider failed: {0}")]
    Upstream(UpstreamError),
    /// The user's daily LLM quota.
    #[error("{0}")]
    Daily(DailyRefusal),
}

/// How an upstream call failed. `Display` carries no URL, key or upstream body.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum UpstreamError {
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("HTTP status {status}{}", .code.as_ref().map(|c| format!(" ({c})")).unwrap_or_default())]
    Status { status: u16, code: Option<String> },
    #[error("network: {0}")]
    Network(&'static str),
    #[error("unreadable answer: {0}")]
    Body(&'static str),
}

impl UpstreamError {
    fn network(e: &reqwest::Error) -> UpstreamError {
        UpstreamError::Network(if e.is_timeout() {
            "timed out"
        } else if e.is_connect() {
            "connection failed"
        } else if e.is_body() || e.is_decode() {
            "response body failed"
        } else if e.is_request() {
            "request failed"
        } else {
            "transport failed"
        })
    }

    /// HTTP 429: throttled.
    pub(crate) fn is_throttled(&self) -> bool {
        matches!(self, UpstreamError::Status { status: 429, .. })
    }

    pub(crate) fn is_quota(&self) -> bool {
        match self {
            UpstreamError::Status { status, code } => {
                *status == 429
                    || *status == 402
                    || code
                        .as_deref()
                        .is_some_and(|c| c.contains("quota") || c.contains("rate_limit"))
            }
            _ => false,
        }
    }

    pub(crate) fn data(&self) -> Map<String, Value> {
        let mut data = Map::new();
        match self {
            UpstreamError::Timeout(t) => {
                data.insert(
                    "timeoutMs".into(),
                    Value::from(u64::try_from(t.as_millis()).unwrap_or(u64::MAX)),
                );
            }
            UpstreamError::Status { status, code } => {
                data.insert("status".into(), Value::from(*status));
                if let Some(c) = code {
                    data.insert("upstreamCode".into(), Value::from(c.clone()));
                }
            }
            UpstreamError::Network(_) | UpstreamError::Body(_) => {}
        }
        data
    }

    fn sampling_error(&self) -> ErrorObject {
        let code = match self {
            UpstreamError::Timeout(_) => codes::SAMPLING_TIMEOUT,
            _ if self.is_quota() => codes::SAMPLING_QUOTA_EXCEEDED,
            _ => codes::SAMPLING_PROVIDER_ERROR,
        };
        code.error_with(format!("the LLM provider failed: {self}"), self.data())
    }

    fn embed_error(&self) -> ErrorObject {
        let code = match self {
            UpstreamError::Timeout(_) => embed_codes::EMBED_TIMEOUT,
            _ => embed_codes::EMBED_PROVIDER_ERROR,
        };
        code.error_with(format!("the embedding provider failed: {self}"), self.data())
    }
}

/// The symbolic `error.code` (or `error.type`) of an OpenAI-style error body, when it is short and plain.
pub(crate) fn upstream_code(body: &[u8]) -> Option<String> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let err = v.get("error")?;
    ["code", "type"]
        .iter()
        .filter_map(|k| err.get(*k).and_then(Value::as_str))
        .find(|c| {
            !c.is_empty()
                && c.chars().count() <= MAX_UPSTREAM_CODE_CHARS
                && c.chars()
                    .all(|ch| ch.is_ascii_alphanumeric() || matches!(ch, '_' | '-' | '.'))
        })
        .map(str::to_owned)
}

// -------------------------------------------------------------------------------------------------------------
// Sampling request validation
// -------------------------------------------------------------------------------------------------------------

fn invalid(message: impl Into<String>) -> ErrorObject {
    codes::SAMPLING_INVALID_REQUEST.error(message)
}

/// The `responseFormat` a plugin asked for.
#[derive(Debug, Clone, PartialEq)]
enum RequestedFormat {
    JsonObject,
    /// The `json_schema` object (`{name, schema, strict?, description?}`), forwarded as is.
    JsonSchema(Value),
}

impl RequestedFormat {
    fn name(&self) -> &'static str {
        match self {
            RequestedFormat::JsonObject => "json_object",
            RequestedFormat::JsonSchema(_) => "json_schema",
        }
    }
}

/// `onUnsupported`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OnUnsupported {
    Error,
    JsonObject,
    Text,
}

/// A validated `sampling/createMessage` request.
#[derive(Debug, Clone, PartialEq)]
struct SamplingRequest {
    /// `(role, text)`.
    messages: Vec<(String, String)>,
    system_prompt: Option<String>,
    max_tokens: u32,
    temperature: f64,
    stop: Vec<String>,
    hints: Vec<String>,
    response_format: Option<RequestedFormat>,
    on_unsupported: OnUnsupported,
}

/// A member, treating `null` as absent.
fn member<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

impl SamplingRequest {
    fn parse(params: &Value) -> Result<SamplingRequest, ErrorObject> {
        let p = params
            .as_object()
            .ok_or_else(|| invalid("params must be an object"))?;

        let messages = member(p, "messages")
            .ok_or_else(|| invalid("messages is required"))?
            .as_array()
            .ok_or_else(|| invalid("messages must be an array"))?;
        if messages.is_empty() {
            return Err(invalid("messages must not be empty"));
        }
        if messages.len() > limits::SAMPLING_MAX_MESSAGES {
            return Err(invalid(format!(
                "messages has {} entries, more than the {} allowed",
                messages.len(),
                limits::SAMPLING_MAX_MESSAGES
            )));
        }
        let messages = messages
            .iter()
            .enumerate()
            .map(|(i, m)| parse_message(i, m))
            .collect::<Result<Vec<_>, _>>()?;

        let max_tokens = parse_max_tokens(member(p, "maxTokens"))?;

        let system_prompt = match member(p, "systemPrompt") {
            None => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(_) => return Err(invalid("systemPrompt must be a string")),
        };

        let temperature = match member(p, "temperature") {
            None => limits::SAMPLING_DEFAULT_TEMPERATURE,
            Some(v) => match v.as_f64() {
                Some(t) if t.is_finite() && (0.0..=MAX_TEMPERATURE).contains(&t) => t,
                _ => {
                    return Err(invalid(format!(
                        "temperature must be a number in [0, {MAX_TEMPERATURE}]"
                    )));
                }
            },
        };

        let stop = match member(p, "stopSequences") {
            None => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|s| match s.as_str() {
                    Some(s) if !s.is_empty() => Ok(s.to_owned()),
                    _ => Err(invalid("stopSequences must be non-empty strings")),
                })
                .collect::<Result<Vec<_>, _>>()?,
            Some(_) => return Err(invalid("stopSequences must be an array of strings")),
        };

        let hints = match member(p, "modelPreferences") {
            None => Vec::new(),
            Some(Value::Object(prefs)) => match member(prefs, "hints") {
                None => Vec::new(),
                Some(Value::Array(hints)) => hints
                    .iter()
                    .map(|h| match h {
                        Value::Object(h) => match member(h, "name") {
                            None => Ok(None),
                            Some(Value::String(n)) => Ok(Some(n.clone())),
                            Some(_) => Err(invalid("modelPreferences.hints[].name must be a string")),
                        },
                        _ => Err(invalid("modelPreferences.hints[] must be objects")),
                    })
                    .filter_map(Result::transpose)
                    .collect::<Result<Vec<_>, _>>()?,
                Some(_) => return Err(invalid("modelPreferences.hints must be an array")),
            },
            Some(_) => return Err(invalid("modelPreferences must be an object")),
        };

        match member(p, "includeContext") {
            None => {}
            Some(Value::String(s)) if s == "none" => {}
            Some(_) => return Err(invalid("includeContext: only \"none\" is supported")),
        }

        match member(p, "metadata") {
            None | Some(Value::Object(_)) => {}
            Some(_) => return Err(invalid("metadata must be an object")),
        }

        let response_format = match member(p, "responseFormat") {
            None => None,
            Some(v) => parse_response_format(v)?,
        };

        let on_unsupported = match member(p, "onUnsupported") {
            None => OnUnsupported::Error,
            Some(Value::String(s)) => match s.as_str() {
                "error" => OnUnsupported::Error,
                "json_object" => OnUnsupported::JsonObject,
                "text" => OnUnsupported::Text,
                _ => {
                    return Err(invalid(
                        "onUnsupported must be \"error\", \"json_object\" or \"text\"",
                    ));
                }
            },
            Some(_) => return Err(invalid("onUnsupported must be a string")),
        };

        Ok(SamplingRequest {
            messages,
            system_prompt,
            max_tokens,
            temperature,
            stop,
            hints,
            response_format,
            on_unsupported,
        })
    }
}

fn parse_message(i: usize, m: &Value) -> Result<(String, String), ErrorObject> {
    let m = m
        .as_object()
        .ok_or_else(|| invalid(format!("messages[{i}] must be an object")))?;
    let role = match member(m, "role").and_then(Value::as_str) {
        Some(r @ ("user" | "assistant" | "system")) => r.to_owned(),
        _ => {
            return Err(invalid(format!(
                "messages[{i}].role must be \"user\", \"assistant\" or \"system\""
            )));
        }
    };
    let content = member(m, "content").and_then(Value::as_object).ok_or_else(|| {
        invalid(format!(
            "messages[{i}].content must be an object {{type: \"text\", text}}"
        ))
    })?;
    if member(content, "type").and_then(Value::as_str) != Some("text") {
        return Err(invalid(format!("messages[{i}].content.type must be \"text\"")));
    }
    let text = member(content, "text")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid(format!("messages[{i}].content.text must be a string")))?;
    Ok((role, text.to_owned()))
}

fn parse_max_tokens(v: Option<&Value>) -> Result<u32, ErrorObject> {
    let cap = limits::SAMPLING_MAX_TOKENS_PER_CALL;
    let v = v.ok_or_else(|| invalid("maxTokens is required"))?;
    let n = match v {
        Value::Number(n) => n.as_u64().or_else(|| {
            n.as_f64()
                .filter(|f| f.is_finite() && f.fract() == 0.0 && *f >= 1.0 && *f <= f64::from(cap) + 1.0)
                .and_then(|f| format!("{f:.0}").parse::<u64>().ok())
        }),
        _ => None,
    };
    match n {
        Some(n) if n >= 1 && n <= u64::from(cap) => {
            u32::try_from(n).map_err(|_| invalid("maxTokens is too large"))
        }
        Some(n) if n > u64::from(cap) => Err(invalid(format!(
            "maxTokens {n} exceeds the host's maxTokensPerCall of {cap}"
        ))),
        _ => Err(invalid(format!("maxTokens must be a positive integer ≤ {cap}"))),
    }
}

fn parse_response_format(v: &Value) -> Result<Option<RequestedFormat>, ErrorObject> {
    let f = v
        .as_object()
        .ok_or_else(|| invalid("responseFormat must be an object"))?;
    match member(f, "type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(RequestedFormat::JsonObject)),
        Some("json_schema") => {
            let js = member(f, "json_schema")
                .and_then(Value::as_object)
                .ok_or_else(|| invalid("responseFormat.json_schema must be an object"))?;
            let name = member(js, "name").and_then(Value::as_str).unwrap_or("");
            if !valid_schema_name(name) {
                return Err(invalid(
                    "responseFormat.json_schema.name must match ^[a-zA-Z0-9_-]{1,64}$",
                ));
            }
            let schema = member(js, "schema")
                .filter(|s| s.is_object())
                .ok_or_else(|| invalid("responseFormat.json_schema.schema must be an object"))?;
            check_schema_limits(schema)?;
            match member(js, "strict") {
                None | Some(Value::Bool(_)) => {}
                Some(_) => return Err(invalid("responseFormat.json_schema.strict must be a boolean")),
            }
            Ok(Some(RequestedFormat::JsonSchema(Value::Object(js.clone()))))
        }
        _ => Err(invalid(
            "responseFormat.type must be \"json_object\" or \"json_schema\"",
        )),
    }
}

fn valid_schema_name(name: &str) -> bool {
    (1..=limits::SAMPLING_SCHEMA_NAME_MAX_CHARS).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Nesting depth (a scalar is 0, `{}` is 1) and node count (objects + arrays + leaves) of a JSON value.
fn depth_and_nodes(v: &Value) -> (usize, usize) {
    // Iterative, so a hostile schema cannot exhaust the stack (serde_json already caps parse depth at 128).
    let mut stack = vec![(v, 1usize)];
    let (mut depth, mut nodes) = (0, 0);
    while let Some((v, level)) = stack.pop() {
        nodes += 1;
        match v {
            Value::Object(m) => {
                depth = depth.max(level);
                stack.extend(m.values().map(|c| (c, level + 1)));
            }
            Value::Array(a) => {
                depth = depth.max(level);
                stack.extend(a.iter().map(|c| (c, level + 1)));
            }
            _ => {}
        }
    }
    (depth, nodes)
}

fn check_schema_limits(schema: &Value) -> Result<(), ErrorObject> {
    let bytes = serde_json::to_vec(schema).map_or(usize::MAX, |b| b.len());
    if bytes > limits::SAMPLING_SCHEMA_MAX_BYTES {
        return Err(invalid(format!(
            "responseFormat schema is {bytes} bytes serialized, more than {}",
            limits::SAMPLING_SCHEMA_MAX_BYTES
        )));
    }
    let (depth, nodes) = depth_and_nodes(schema);
    if depth > limits::SAMPLING_SCHEMA_MAX_DEPTH {
        return Err(invalid(format!(
            "responseFormat schema nests {depth} deep, more than {}",
            limits::SAMPLING_SCHEMA_MAX_DEPTH
        )));
    }
    if nodes > limits::SAMPLING_SCHEMA_MAX_NODES {
        return Err(invalid(format!(
            "responseFormat schema has {nodes} nodes, more than {}",
            limits::SAMPLING_SCHEMA_MAX_NODES
        )));
    }
    Ok(())
}

// -------------------------------------------------------------------------------------------------------------
// Response format gating and the upstream body
// -------------------------------------------------------------------------------------------------------------

/// What was requested and what is sent upstream (`applied: None` = the constraint was dropped).
#[derive(Debug, Clone, PartialEq)]
struct FormatPlan {
    requested: &'static str,
    applied: Option<RequestedFormat>,
}

impl FormatPlan {
    fn meta(&self, text: &str) -> Value {
        let applied = self.applied.as_ref().map(RequestedFormat::name);
        let structured_valid = serde_json::from_str::<Value>(text.trim())
            .map(|v| v.is_object() || v.is_array())
            .unwrap_or(false);
        json!({
            "requested": self.requested,
            "applied": applied,
            "structuredValid": structured_valid,
            "downgraded": applied != Some(self.requested),
        })
    }
}

fn resolve_format(
    requested: Option<&RequestedFormat>,
    on_unsupported: OnUnsupported,
    model: &ModelConfig,
) -> Result<Option<FormatPlan>, ErrorObject> {
    let Some(requested) = requested else {
        return Ok(None);
    };
    let applied = match requested {
        RequestedFormat::JsonSchema(_) if !model.structured_output => match on_unsupported {
            OnUnsupported::Error => {
                return Err(codes::SAMPLING_UNSUPPORTED_RESPONSE_FORMAT.error_with(
                    format!(
                        "model {} does not support json_schema response formats (set onUnsupported to \
                         \"json_object\" or \"text\" to downgrade)",
                        model.name
                    ),
                    Map::from_iter([
                        ("requested".to_owned(), Value::from("json_schema")),
                        ("modelName".to_owned(), Value::from(model.name.clone())),
                    ]),
                ));
            }
            OnUnsupported::JsonObject => Some(RequestedFormat::JsonObject),
            OnUnsupported::Text => None,
        },
        other => Some(other.clone()),
    };
    Ok(Some(FormatPlan {
        requested: requested.name(),
        applied,
    }))
}

/// The OpenAI `POST /chat/completions` body.
fn chat_body(req: &SamplingRequest, model: &ModelConfig, format: Option<&FormatPlan>) -> Value {
    let mut messages = Vec::with_capacity(req.messages.len() + 1);
    if let Some(s) = &req.system_prompt {
        messages.push(json!({"role": "system", "content": s}));
    }
    messages.extend(
        req.messages
            .iter()
            .map(|(role, text)| json!({"role": role, "content": text})),
    );
    let mut body = Map::new();
    body.insert("model".into(), Value::from(model.name.clone()));
    body.insert("messages".into(), Value::Array(messages));
    body.insert("max_tokens".into(), Value::from(req.max_tokens));
    body.insert("temperature".into(), Value::from(req.temperature));
    body.insert("stream".into(), Value::Bool(false));
    if !req.stop.is_empty() {
        body.insert("stop".into(), json!(req.stop));
    }
    match format.and_then(|f| f.applied.as_ref()) {
        Some(RequestedFormat::JsonObject) => {
            body.insert("response_format".into(), json!({"type": "json_object"}));
        }
        Some(RequestedFormat::JsonSchema(js)) => {
            body.insert(
                "response_format".into(),
                json!({"type": "json_schema", "json_schema": js}),
            );
        }
        None => {}
    }
    Value::Object(body)
}

// -------------------------------------------------------------------------------------------------------------
// Upstream answers
// -------------------------------------------------------------------------------------------------------------

/// Reported usage of a chat completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Usage {
    /// `(input, output, total)`, when the upstream reported usage.
    reported: Option<(u64, u64, u64)>,
}

impl Usage {
    fn of_chat(reply: &Value) -> Usage {
        let Some(u) = reply.get("usage").and_then(Value::as_object) else {
            return Usage { reported: None };
        };
        let field = |k: &str| u.get(k).and_then(Value::as_u64);
        let (input, output, total) = (
            field("prompt_tokens"),
            field("completion_tokens"),
            field("total_tokens"),
        );
        if input.is_none() && output.is_none() && total.is_none() {
            return Usage { reported: None };
        }
        let (input, output) = (input.unwrap_or(0), output.unwrap_or(0));
        let total = total.unwrap_or_else(|| input.saturating_add(output));
        Usage {
            reported: Some((input, output, total)),
        }
    }

    /// The tokens the invoke's budget is charged: the reported total, else `maxTokens`.
    fn charge(&self, max_tokens: u32) -> u64 {
        self.reported.map_or(u64::from(max_tokens), |(_, _, t)| t)
    }
}

/// The first choice of a chat completion.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Completion {
    text: String,
    stop_reason: &'static str,
}

impl Completion {
    fn of(reply: &Value, stop: &[String]) -> Option<Completion> {
        let choice = reply.get("choices")?.as_array()?.first()?;
        let message = choice.get("message")?;
        let text = message
            .get("content")
            .and_then(Value::as_str)
            .or_else(|| message.get("refusal").and_then(Value::as_str))
            .unwrap_or("")
            .to_owned();
        let stop_reason = match choice.get("finish_reason").and_then(Value::as_str) {
            Some("length") => "maxTokens",
            Some("stop") => {
                // OpenAI says "stop" for both; vLLM (`stop_reason`) and SGLang (`matched_stop`) name the match.
                let matched = ["stop_reason", "matched_stop"]
                    .iter()
                    .filter_map(|k| choice.get(*k).and_then(Value::as_str))
                    .any(|m| stop.iter().any(|s| s == m));
                if matched { "stopSequence" } else { "endTurn" }
            }
            _ => "endTurn",
        };
        Some(Completion { text, stop_reason })
    }
}

// -------------------------------------------------------------------------------------------------------------
// Embeddings
// -------------------------------------------------------------------------------------------------------------

fn embed_invalid(message: impl Into<String>) -> ErrorObject {
    embed_codes::EMBED_INVALID_REQUEST.error(message)
}

/// A validated `embeddings/create` request.
#[derive(Debug, Clone, PartialEq, Eq)]
struct EmbedRequest {
    inputs: Vec<String>,
    alias: String,
    backend: String,
}

impl EmbedRequest {
    fn parse(
        params: &Value,
        ctx: &CallContext,
        aliases: &BTreeMap<String, String>,
    ) -> Result<EmbedRequest, ErrorObject> {
        let p = params
            .as_object()
            .ok_or_else(|| embed_invalid("params must be an object"))?;
        // Body fields that name the caller must agree with the token (spec §8.5).
        for (key, expected) in [
            ("executa_tool_id", ctx.tool_id.as_str()),
            ("tool_invoke_id", ctx.invoke_id.as_str()),
            ("user_id", ctx.user.as_str()),
        ] {
            if let Some(v) = member(p, key)
                && v.as_str() != Some(expected)
            {
                return Err(embed_invalid(format!("{key} disagrees with the invoke's token")));
            }
        }
        let inputs = parse_embed_inputs(member(p, "input"))?;
        let alias = match member(p, "model") {
            None => DEFAULT_EMBED_ALIAS.to_owned(),
            Some(Value::String(s)) => s.clone(),
            Some(_) => return Err(embed_invalid("model must be a string")),
        };
        let backend = aliases.get(&alias).cloned().ok_or_else(|| {
            embed_invalid(format!(
                "unknown embedding model {alias:?}; available: {}",
                aliases.keys().cloned().collect::<Vec<_>>().join(", ")
            ))
        })?;
        Ok(EmbedRequest {
            inputs,
            alias,
            backend,
        })
    }
}

fn parse_embed_inputs(input: Option<&Value>) -> Result<Vec<String>, ErrorObject> {
    let items: Vec<&Value> = match input {
        None => return Err(embed_invalid("input is required")),
        Some(v @ Value::String(_)) => vec![v],
        Some(Value::Array(a)) => a.iter().collect(),
        Some(_) => return Err(embed_invalid("input must be a string or an array of strings")),
    };
    if items.is_empty() {
        return Err(embed_invalid("input must not be empty"));
    }
    if items.len() > limits::EMBED_MAX_INPUTS {
        return Err(embed_invalid(format!(
            "{} inputs, more than the {} allowed per request",
            items.len(),
            limits::EMBED_MAX_INPUTS
        )));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let s = v
                .as_str()
                .ok_or_else(|| embed_invalid(format!("input[{i}] must be a string")))?;
            if s.trim().is_empty() {
                return Err(embed_invalid(format!("input[{i}] is empty")));
            }
            let chars = s.chars().count();
            if chars > limits::EMBED_MAX_INPUT_CHARS {
                return Err(embed_invalid(format!(
                    "input[{i}] has {chars} characters, more than the {} allowed (inputs are never truncated)",
                    limits::EMBED_MAX_INPUT_CHARS
                )));
            }
            Ok(s.to_owned())
        })
        .collect()
}

/// The upstream's `data`, ordered by `index`, each `{object, index, embedding}`; `None` unless it holds exactly
/// one embedding (an array of numbers) per input.
fn embedding_data(reply: &Value, inputs: usize) -> Option<Vec<Value>> {
    let data = reply.get("data")?.as_array()?;
    if data.len() != inputs {
        return None;
    }
    let mut slots: Vec<Option<Value>> = vec![None; inputs];
    for (pos, d) in data.iter().enumerate() {
        let index = match d.get("index") {
            None => pos,
            Some(i) => usize::try_from(i.as_u64()?).ok()?,
        };
        let embedding = d.get("embedding")?;
        if !embedding.as_array()?.iter().all(Value::is_number) {
            return None;
        }
        let slot = slots.get_mut(index)?;
        if slot.is_some() {
            return None;
        }
        *slot = Some(json!({"object": "embedding", "index": index, "embedding": embedding}));
    }
    slots.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::TokenMinter;
    use crate::{BudgetLimits, InvokeBudget};

    fn msgs(n: usize) -> Value {
        Value::Array(
            (0..n)
                .map(|i| json!({"role": "user", "content": {"type": "text", "text": format!("m{i}")}}))
                .collect(),
        )
    }

    #[allow(clippy::needless_pass_by_value)]
    fn parse(p: Value) -> Result<SamplingRequest, ErrorObject> {
        SamplingRequest::parse(&p)
    }

    fn code(r: Result<impl fmt::Debug, ErrorObject>) -> i64 {
        r.expect_err("an error").code
    }

    fn config(models: &[(&str, bool)]) -> LlmConfig {
        LlmConfig {
            base_url: "http://127.0.0.1:9/v1".into(),
            api_key_env: Some("PATH".into()),
            models: models
                .iter()
                .map(|(n, s)| ModelConfig {
                    name: (*n).into(),
                    structured_output: *s,
                })
                .collect(),
            ..LlmConfig::default()
        }
    }

    fn ctx() -> CallContext {
        CallContext {
            user: "u".into(),
            tool_id: "t".into(),
            invoke_id: "i".into(),
            deadline_ms: u64::MAX,
            client_timeout_s: None,
            claims: TokenMinter::claims(
                crate::Binding {
                    user: "u",
                    tool_id: "t",
                    invoke_id: "i",
                },
                "",
                Duration::ZERO,
            ),
            budget: Arc::new(InvokeBudget::new(BudgetLimits::default())),
        }
    }

    #[test]
    fn messages_boundaries() {
        assert!(parse(json!({"messages": msgs(64), "maxTokens": 10})).is_ok());
        assert_eq!(
            code(parse(json!({"messages": msgs(65), "maxTokens": 10}))),
            -32004
        );
        assert_eq!(code(parse(json!({"messages": [], "maxTokens": 10}))), -32004);
        assert_eq!(code(parse(json!({"maxTokens": 10}))), -32004);
        assert_eq!(code(parse(json!({"messages": "hi", "maxTokens": 10}))), -32004);
        assert_eq!(code(parse(json!([1, 2]))), -32004);
    }

    #[test]
    fn message_shape() {
        let one = |m: Value| parse(json!({"messages": [m], "maxTokens": 10}));
        for role in ["user", "assistant", "system"] {
            assert!(one(json!({"role": role, "content": {"type": "text", "text": "x"}})).is_ok());
        }
        assert_eq!(
            code(one(
                json!({"role": "tool", "content": {"type": "text", "text": "x"}})
            )),
            -32004
        );
        assert_eq!(
            code(one(json!({"content": {"type": "text", "text": "x"}}))),
            -32004
        );
        assert_eq!(code(one(json!({"role": "user", "content": "x"}))), -32004);
        assert_eq!(
            code(one(
                json!({"role": "user", "content": {"type": "image", "data": "x"}})
            )),
            -32004
        );
        assert_eq!(
            code(one(json!({"role": "user", "content": {"type": "text"}}))),
            -32004
        );
        assert_eq!(
            code(one(
                json!({"role": "user", "content": {"type": "text", "text": 3}})
            )),
            -32004
        );
        assert_eq!(code(one(json!("user: hi"))), -32004);
    }

    #[test]
    fn max_tokens_boundaries() {
        let mt = |v: Value| parse(json!({"messages": msgs(1), "maxTokens": v}));
        assert_eq!(mt(json!(8192)).expect("8192").max_tokens, 8192);
        assert_eq!(mt(json!(1)).expect("1").max_tokens, 1);
        assert_eq!(mt(json!(400.0)).expect("integral float").max_tokens, 400);
        for bad in [
            json!(8193),
            json!(0),
            json!(-1),
            json!(1.5),
            json!("10"),
            json!(null),
            json!(1e300),
            json!(u64::MAX),
        ] {
            assert_eq!(code(mt(bad.clone())), -32004, "{bad}");
        }
        assert_eq!(code(parse(json!({"messages": msgs(1)}))), -32004);
    }

    #[test]
    fn optional_fields() {
        let base = |extra: Value| {
            let mut p = json!({"messages": msgs(1), "maxTokens": 5});
            for (k, v) in extra.as_object().expect("object") {
                p[k] = v.clone();
            }
            parse(p)
        };
        let r = base(json!({})).expect("minimal");
        assert!((r.temperature - 0.7).abs() < f64::EPSILON, "default temperature");
        assert_eq!(r.on_unsupported, OnUnsupported::Error);
        let r = base(
            json!({"temperature": 0.0, "stopSequences": ["\n\n###"], "systemPrompt": "be brief",
            "includeContext": "none", "metadata": {"executa_invoke_id": "i"},
            "modelPreferences": {"hints": [{"name": "Sonnet"}, {}], "costPriority": 0.4}}),
        )
        .expect("full");
        assert_eq!(r.temperature, 0.0);
        assert_eq!(r.stop, vec!["\n\n###".to_owned()]);
        assert_eq!(r.hints, vec!["Sonnet".to_owned()]);
        assert_eq!(r.system_prompt.as_deref(), Some("be brief"));
        for bad in [
            json!({"includeContext": "thisServer"}),
            json!({"includeContext": "allServers"}),
            json!({"temperature": "hot"}),
            json!({"temperature": 2.5}),
            json!({"temperature": -0.1}),
            json!({"stopSequences": "###"}),
            json!({"stopSequences": [1]}),
            json!({"stopSequences": [""]}),
            json!({"systemPrompt": 5}),
            json!({"modelPreferences": []}),
            json!({"modelPreferences": {"hints": "claude"}}),
            json!({"modelPreferences": {"hints": [{"name": 1}]}}),
            json!({"metadata": "x"}),
            json!({"onUnsupported": "ignore"}),
            json!({"responseFormat": {"type": "xml"}}),
            json!({"responseFormat": "json"}),
        ] {
            assert_eq!(code(base(bad.clone())), -32004, "{bad}");
        }
        assert!(base(json!({"onUnsupported": "text", "responseFormat": {"type": "text"}})).is_ok());
    }

    #[allow(clippy::needless_pass_by_value)]
    fn schema_req(js: Value) -> Result<SamplingRequest, ErrorObject> {
        parse(json!({"messages": msgs(1), "maxTokens": 5,
            "responseFormat": {"type": "json_schema", "json_schema": js}}))
    }

    /// An object schema nested `depth` objects deep (`{}` is depth 1).
    fn nested(depth: usize) -> Value {
        let mut v = json!({});
        for _ in 1..depth {
            v = json!({ "p": v });
        }
        v
    }

    #[test]
    fn schema_limits() {
        assert!(
            schema_req(json!({"name": "ok_name-1", "strict": true, "schema": {"type": "object"}})).is_ok()
        );
        assert!(schema_req(json!({"name": "a".repeat(64), "schema": {}})).is_ok());
        for bad in ["", "has space", "dot.name", "ünï"] {
            assert_eq!(
                code(schema_req(json!({"name": bad, "schema": {}}))),
                -32004,
                "{bad:?}"
            );
        }
        assert_eq!(
            code(schema_req(json!({"name": "a".repeat(65), "schema": {}}))),
            -32004
        );
        assert_eq!(code(schema_req(json!({"schema": {}}))), -32004);
        assert_eq!(code(schema_req(json!({"name": "n"}))), -32004);
        assert_eq!(code(schema_req(json!({"name": "n", "schema": [1]}))), -32004);
        assert_eq!(
            code(schema_req(json!({"name": "n", "schema": {}, "strict": "yes"}))),
            -32004
        );

        // Depth 8 ok, 9 refused.
        assert_eq!(depth_and_nodes(&nested(8)).0, 8);
        assert!(schema_req(json!({"name": "n", "schema": nested(8)})).is_ok());
        assert_eq!(
            code(schema_req(json!({"name": "n", "schema": nested(9)}))),
            -32004
        );

        // 512 nodes ok, 513 refused: an object (1 node) with an array (1 node) of n leaves.
        let wide = |leaves: usize| json!({"enum": vec![1; leaves]});
        assert_eq!(depth_and_nodes(&wide(510)).1, 512);
        assert!(schema_req(json!({"name": "n", "schema": wide(510)})).is_ok());
        assert_eq!(
            code(schema_req(json!({"name": "n", "schema": wide(511)}))),
            -32004
        );

        // 32 KiB serialized ok, one byte more refused (few nodes, long strings).
        let sized = |bytes: usize| {
            let overhead = serde_json::to_vec(&json!({"description": ""}))
                .expect("json")
                .len();
            json!({"description": "x".repeat(bytes - overhead)})
        };
        assert_eq!(
            serde_json::to_vec(&sized(32 * 1024)).expect("json").len(),
            32 * 1024
        );
        assert!(schema_req(json!({"name": "n", "schema": sized(32 * 1024)})).is_ok());
        assert_eq!(
            code(schema_req(json!({"name": "n", "schema": sized(32 * 1024 + 1)}))),
            -32004
        );
    }

    #[test]
    fn response_format_gating() {
        let strict = ModelConfig {
            name: "gpt-4o".into(),
            structured_output: true,
        };
        let plain = ModelConfig {
            name: "llama-3".into(),
            structured_output: false,
        };
        let schema = RequestedFormat::JsonSchema(json!({"name": "n", "schema": {}}));
        let obj = RequestedFormat::JsonObject;

        assert_eq!(
            resolve_format(None, OnUnsupported::Error, &plain).expect("none"),
            None
        );
        let p = resolve_format(Some(&obj), OnUnsupported::Error, &plain)
            .expect("json_object is never gated")
            .expect("plan");
        assert_eq!(p.applied, Some(RequestedFormat::JsonObject));
        let p = resolve_format(Some(&schema), OnUnsupported::Error, &strict)
            .expect("supported")
            .expect("plan");
        assert_eq!(p.applied, Some(schema.clone()));
        assert_eq!(p.meta("{\"a\":1}")["downgraded"], json!(false));

        let e = resolve_format(Some(&schema), OnUnsupported::Error, &plain).expect_err("-32010");
        assert_eq!(e.code, -32010);
        let data = e.data.expect("data");
        assert_eq!(data["requested"], json!("json_schema"));
        assert_eq!(data["modelName"], json!("llama-3"));
        assert_eq!(data["errorCode"], json!("SAMPLING_UNSUPPORTED_RESPONSE_FORMAT"));

        let p = resolve_format(Some(&schema), OnUnsupported::JsonObject, &plain)
            .expect("downgrade")
            .expect("plan");
        assert_eq!(
            p.meta("{\"a\":1}"),
            json!({"requested": "json_schema", "applied": "json_object", "structuredValid": true, "downgraded": true})
        );
        let p = resolve_format(Some(&schema), OnUnsupported::Text, &plain)
            .expect("drop")
            .expect("plan");
        assert_eq!(
            p.meta("not json"),
            json!({"requested": "json_schema", "applied": null, "structuredValid": false, "downgraded": true})
        );
        let body = chat_body(
            &parse(json!({"messages": msgs(1), "maxTokens": 5})).expect("req"),
            &plain,
            Some(&p),
        );
        assert!(body.get("response_format").is_none());
    }

    #[test]
    fn chat_body_shape() {
        let req = parse(json!({"messages": [
                {"role": "user", "content": {"type": "text", "text": "hi"}},
                {"role": "assistant", "content": {"type": "text", "text": "yo"}}],
            "maxTokens": 77, "systemPrompt": "sys", "stopSequences": ["END"], "temperature": 0.2}))
        .expect("req");
        let model = ModelConfig {
            name: "m".into(),
            structured_output: true,
        };
        let body = chat_body(&req, &model, None);
        assert_eq!(
            body,
            json!({"model": "m", "max_tokens": 77, "temperature": 0.2, "stream": false, "stop": ["END"],
                "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "yo"}]})
        );
    }

    #[test]
    fn model_selection() {
        let svc = LlmService::build(&LlmConfig {
            default_model: Some("gpt-4o-mini".into()),
            ..config(&[
                ("claude-3-5-sonnet", false),
                ("gpt-4o-mini", true),
                ("GPT-4o", true),
            ])
        })
        .expect("service");
        let pick = |h: &[&str]| {
            svc.select_model(&h.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>())
                .name
                .clone()
        };
        assert_eq!(pick(&[]), "gpt-4o-mini");
        assert_eq!(pick(&["SONNET"]), "claude-3-5-sonnet");
        assert_eq!(pick(&["gpt-4o"]), "gpt-4o-mini", "first in configuration order");
        assert_eq!(pick(&["nomatch", "4O"]), "gpt-4o-mini");
        assert_eq!(pick(&["nomatch"]), "gpt-4o-mini", "default");
        assert_eq!(pick(&[""]), "gpt-4o-mini", "an empty hint matches nothing");
    }

    #[test]
    fn config_errors() {
        let e = |c: LlmConfig| LlmService::build(&c).expect_err("refused");
        assert!(matches!(e(config(&[])), LlmConfigError::NoModels));
        assert!(matches!(
            e(LlmConfig {
                base_url: "ftp://x".into(),
                ..config(&[("m", false)])
            }),
            LlmConfigError::BaseUrl(_)
        ));
        assert!(matches!(
            e(LlmConfig {
                base_url: "http://u:p@x/v1".into(),
                ..config(&[("m", false)])
            }),
            LlmConfigError::BaseUrl(_)
        ));
        assert!(matches!(
            e(LlmConfig {
                base_url: "not a url".into(),
                ..config(&[("m", false)])
            }),
            LlmConfigError::BaseUrl(_)
        ));
        assert!(matches!(
            e(config(&[("m", false), ("m", true)])),
            LlmConfigError::BadModelName(_)
        ));
        assert!(matches!(
            e(LlmConfig {
                default_model: Some("x".into()),
                ..config(&[("m", false)])
            }),
            LlmConfigError::UnknownDefaultModel(_)
        ));
        assert!(matches!(
            e(LlmConfig {
                api_key_file: Some("/nonexistent/key".into()),
                ..config(&[("m", false)])
            }),
            LlmConfigError::TwoKeySources
        ));
        assert!(matches!(
            e(LlmConfig {
                api_key_env: None,
                api_key_file: Some("/nonexistent/key".into()),
                ..config(&[("m", false)])
            }),
            LlmConfigError::KeyFile { .. }
        ));
        assert!(matches!(
            e(LlmConfig {
                api_key_env: Some("FLEET_TEST_SURELY_UNSET_VAR".into()),
                ..config(&[("m", false)])
            }),
            LlmConfigError::KeyEnv(_)
        ));
        let toml_cfg: LlmConfig = toml::from_str(
            "base_url = \"http://h/v1\"\nembedding_model = \"e\"\n[[models]]\nname = \"m\"\nstructured_output = true\n",
        )
        .expect("toml");
        assert_eq!(toml_cfg.models[0].name, "m");
        assert!(toml::from_str::<LlmConfig>("base_url = \"x\"\nbogus = 1\n").is_err());
        let only_default = LlmService::build(&LlmConfig {
            default_model: Some("solo".into()),
            ..config(&[])
        })
        .expect("default_model alone");
        assert_eq!(only_default.select_model(&[]).name, "solo");
        assert!(!only_default.embeddings_enabled());
    }

    /// The example of the "Sampling and embeddings" section of docs/plugins.md.
    #[test]
    fn the_readme_example_parses() {
        #[derive(serde::Deserialize)]
        struct File {
            llm: LlmConfig,
        }
        let file: File = toml::from_str(
            r#"
            [llm]
            base_url = "https://api.openai.com/v1"
            api_key_env = "PATH"
            provider = "openai"
            default_model = "gpt-4o-mini"
            embedding_model = "text-embedding-3-small"
            embedding_aliases = { "anna-managed-v2" = "text-embedding-3-large" }

            [[llm.models]]
            name = "gpt-4o-mini"
            structured_output = true

            [[llm.models]]
            name = "llama-3.1-8b-instruct"
            "#,
        )
        .expect("toml");
        let svc = LlmService::build(&file.llm).expect("service");
        assert!(svc.embeddings_enabled());
        assert_eq!(svc.embed_aliases.len(), 2);
        assert_eq!(svc.select_model(&["LLAMA".into()]).name, "llama-3.1-8b-instruct");
        assert!(!svc.select_model(&["llama".into()]).structured_output);
        assert_eq!(svc.chat_url, "https://api.openai.com/v1/chat/completions");
        assert_eq!(svc.embed_url, "https://api.openai.com/v1/embeddings");
    }

    #[test]
    fn the_key_is_never_shown() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("key");
        std::fs::write(&path, "sk-very-secret\n").expect("write");
        let svc = LlmService::build(&LlmConfig {
            api_key_env: None,
            api_key_file: Some(path),
            ..config(&[("m", false)])
        })
        .expect("service");
        assert!(!format!("{svc:?}").contains("sk-very-secret"));
        let key = svc.key.as_ref().expect("key");
        assert!(key.0.is_sensitive());
        assert_eq!(key.0.to_str().expect("ascii"), "Bearer sk-very-secret");
    }

    #[test]
    fn model_budget_clamps() {
        assert_eq!(model_budget(None), Duration::from_secs(90));
        assert_eq!(model_budget(Some(5.0)), Duration::from_secs(30));
        assert_eq!(model_budget(Some(45.5)), Duration::from_secs_f64(45.5));
        assert_eq!(model_budget(Some(1e9)), Duration::from_secs(300));
        assert_eq!(model_budget(Some(f64::NAN)), Duration::from_secs(90));
        assert_eq!(model_budget(Some(-3.0)), Duration::from_secs(90));
    }

    #[test]
    fn the_invoke_deadline_cuts_the_model_budget() {
        let mut c = ctx();
        c.client_timeout_s = Some(5.0);
        assert_eq!(
            sampling_timeout(&c),
            Duration::from_secs(30),
            "the floor applies to the client's budget"
        );
        c.client_timeout_s = None;
        assert_eq!(sampling_timeout(&c), Duration::from_secs(90));
        c.deadline_ms = fleet_proto::util::now_ms() + 1_000;
        assert!(
            sampling_timeout(&c) <= Duration::from_secs(1),
            "never beyond the invoke"
        );
        c.deadline_ms = 0;
        assert_eq!(
            sampling_timeout(&c),
            Duration::ZERO,
            "a finished invoke leaves no time"
        );
    }

    #[test]
    fn completion_and_usage() {
        let reply = |finish: &str, extra: Value| {
            let mut choice = json!({"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": finish});
            for (k, v) in extra.as_object().expect("object") {
                choice[k] = v.clone();
            }
            json!({"choices": [choice], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}})
        };
        let stop = vec!["###".to_owned()];
        let of = |r: &Value| Completion::of(r, &stop).expect("completion").stop_reason;
        assert_eq!(of(&reply("stop", json!({}))), "endTurn");
        assert_eq!(of(&reply("length", json!({}))), "maxTokens");
        assert_eq!(of(&reply("stop", json!({"stop_reason": "###"}))), "stopSequence");
        assert_eq!(of(&reply("stop", json!({"matched_stop": "###"}))), "stopSequence");
        assert_eq!(of(&reply("content_filter", json!({}))), "endTurn");
        assert_eq!(
            Usage::of_chat(&reply("stop", json!({}))).reported,
            Some((3, 4, 7))
        );
        assert_eq!(Usage::of_chat(&json!({})).charge(50), 50);
        assert_eq!(
            Usage::of_chat(&json!({"usage": {"prompt_tokens": 2, "completion_tokens": 5}})).charge(50),
            7
        );
        assert!(Completion::of(&json!({"choices": []}), &stop).is_none());
        assert!(Completion::of(&json!({"choices": "x"}), &stop).is_none());
    }

    #[test]
    fn upstream_errors_map() {
        let status = |s: u16, c: Option<&str>| UpstreamError::Status {
            status: s,
            code: c.map(str::to_owned),
        };
        assert_eq!(status(429, None).sampling_error().code, -32002);
        assert_eq!(
            status(400, Some("insufficient_quota")).sampling_error().code,
            -32002
        );
        assert_eq!(status(500, None).sampling_error().code, -32003);
        assert_eq!(status(401, None).sampling_error().code, -32003);
        assert_eq!(
            UpstreamError::Network("connection failed").sampling_error().code,
            -32003
        );
        assert_eq!(
            UpstreamError::Timeout(Duration::from_secs(1))
                .sampling_error()
                .code,
            -32005
        );
        assert_eq!(status(429, None).embed_error().code, -32503);
        assert_eq!(
            UpstreamError::Timeout(Duration::from_secs(1)).embed_error().code,
            -32505
        );
        assert_eq!(
            upstream_code(
                br#"{"error":{"message":"Incorrect API key provided: sk-abc","code":"invalid_api_key"}}"#
            ),
            Some("invalid_api_key".into())
        );
        assert_eq!(upstream_code(br#"{"error":{"code":"has spaces sk-abc"}}"#), None);
        assert_eq!(upstream_code(b"<html>"), None);
    }

    #[test]
    fn embed_inputs() {
        let aliases = BTreeMap::from([(
            DEFAULT_EMBED_ALIAS.to_owned(),
            "text-embedding-3-small".to_owned(),
        )]);
        let ctx = ctx();
        let req = |p: Value| EmbedRequest::parse(&p, &ctx, &aliases);
        let r = req(json!({"input": "hello"})).expect("bare string");
        assert_eq!(r.inputs, vec!["hello".to_owned()]);
        assert_eq!(r.alias, DEFAULT_EMBED_ALIAS);
        assert_eq!(r.backend, "text-embedding-3-small");
        assert!(req(json!({"input": vec!["x"; 64]})).is_ok());
        assert_eq!(code(req(json!({"input": vec!["x"; 65]}))), -32504);
        assert!(
            req(json!({"input": "é".repeat(32_000)})).is_ok(),
            "characters, not bytes"
        );
        assert_eq!(code(req(json!({"input": "x".repeat(32_001)}))), -32504);
        for bad in [
            json!({}),
            json!({"input": ""}),
            json!({"input": "  \n"}),
            json!({"input": []}),
            json!({"input": ["ok", " "]}),
            json!({"input": [1]}),
            json!({"input": 5}),
            json!({"input": "x", "model": "anna-managed-v9"}),
            json!({"input": "x", "model": 1}),
            json!({"input": "x", "tool_invoke_id": "other"}),
            json!({"input": "x", "executa_tool_id": "other"}),
        ] {
            assert_eq!(code(req(bad.clone())), -32504, "{bad}");
        }
        assert!(req(json!({"input": "x", "tool_invoke_id": "i", "executa_tool_id": "t"})).is_ok());
    }

    #[test]
    fn embedding_data_is_checked() {
        let ok = json!({"data": [{"index": 1, "embedding": [0.5]}, {"index": 0, "embedding": [0.25]}]});
        let d = embedding_data(&ok, 2).expect("data");
        assert_eq!(d[0]["embedding"], json!([0.25]));
        assert_eq!(d[1]["index"], json!(1));
        assert!(embedding_data(&ok, 3).is_none());
        assert!(
            embedding_data(
                &json!({"data": [{"index": 0, "embedding": [0.5]}, {"index": 0, "embedding": [0.5]}]}),
                2
            )
            .is_none()
        );
        assert!(embedding_data(&json!({"data": [{"index": 5, "embedding": [0.5]}]}), 1).is_none());
        assert!(embedding_data(&json!({"data": [{"index": 0, "embedding": "x"}]}), 1).is_none());
        assert!(embedding_data(&json!({"data": [{"index": 0, "embedding": ["x"]}]}), 1).is_none());
    }
}
