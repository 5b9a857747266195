//! `image/generate` and `image/edit` (spec §8.6) against an OpenAI-compatible images API
//! (`POST {base_url}/images/generations`, JSON; `POST {base_url}/images/edits`, multipart), configured as
//! `[image]` of `--services-config`. Results are stored in the `<prefix>_uploads` object store and returned
//! as signed links of the fleet's HTTP listener that expire after 30 min (`R2_TRANSIENT_PRESIGN_EXPIRY`).
//!
//! A call goes through, in this order (each refusal before the upstream costs nothing):
//! 1. **validation** ([`request`], `-32104`; `n` over the host's cap of 8: `-32106` with `data.hostCap`);
//! 2. `image/edit` needs `llm.image.edit` in the token (`-32101`);
//! 3. **model selection**: the first `modelPreferences.hints[*].name` contained (case-insensitively) in a
//!    configured model's name, else the default model; an edit (or a generate with `reference_image_urls`,
//!    which are sent as the input images of an edit request) on a model without `supports_edit` is `-32311`,
//!    a `mask_url` on a model without `supports_mask` `-32312`, an edit with `n` above the model's
//!    `max_edit_n` `-32313`; a `size` outside the model's `sizes` (when listed) `-32104`;
//! 4. **per-call cap** from the grant (`max_per_call`, default 4 for generate and 1 for edit): `-32106` with
//!    `data.images` and `data.maxImages`;
//! 5. **per-invoke cap** ([`crate::budget`]): `n` images are reserved of the invoke's 4 (`image_token.max_images`,
//!    the grant's `max_per_invoke`), all its `image/*` calls together, counted again 30 min after the first; over
//!    it: `-32106` with `data.images` (the invoke's count had the call been served) and `data.maxImages`. Images
//!    not delivered are given back. (`-32108`, a declined confirm prompt, never happens: the fleet asks none.)
//! 6. **daily quota** ([`crate::usage`], family `image`): `n` images are reserved in the user's rolling 24 h (`max_images_per_day`,
//!    default 50, all plugins together, in JetStream KV); over it: `-32102` with
//!    `data.images_today`/`data.images_quota`. Images not delivered (a failure, fewer images than asked) are
//!    given back;
//! 7. **inputs** ([`fetch`]): `image_url`, `mask_url` and references are fleet links of the caller (read from
//!    the object store) or public URLs fetched by the `web/*` family's fetcher under its SSRF policy; a failure is `-32314` naming the field;
//! 8. **the upstream**, bounded by `min(_clientTimeoutS or request_timeout_s (180 s), 240 s)` and by the
//!    parent invoke's deadline: past the former `-32103`, cut by the deadline `-32105`; both, and every other
//!    `-32103`, carry `data.subcall = "image"` and `data.timeout_s` (the subcall's timeout). A generate asking for more images than the model's `max_n`
//!    is split into several upstream requests. Provider failures (statuses, safety refusals, malformed
//!    answers, anything that is not a PNG/JPEG/WebP/GIF) are `-32103` with `data.status` and the upstream's
//!    short error code, never its body;
//! 9. **storage**: each image (`b64_json`, or a `url` the provider returned: fetched with the upstream's client
//!    when on the upstream's own origin, else by the `web/*` fetcher under the SSRF policy) is stored under
//!    `exec-images/<env>/<user_key>/<tool>/<invoke>/<ms>_<nonce>_<i>.<ext>`; a failure is `-32110`.
//!
//! Result: `{images: [{url, mimeType, width, height, expires_at}], model, quota_used: {images_today,
//! images_quota}, _meta: {provider, latencyMs}}`. Of the extra generate params, `quality` and `output_format`
//! are forwarded; `resolution`, `thinking_level` and `enable_web_search` are validated and not forwarded
//! (the OpenAI API has no such fields). The API key is sent only as `Authorization: Bearer` (a sensitive
//! header), never to a URL the provider returned, never logged; prompts and URLs are never logged.

pub mod fetch;
pub mod pixels;
pub mod request;

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use async_nats::jetstream::object_store;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use fleet_proto::api::user_key;
use fleet_proto::executa::capabilities;
use fleet_proto::executa::reverse::{image as codes, method_not_found, methods};
use fleet_proto::jsonrpc::ErrorObject;
use fleet_proto::limits;
use fleet_proto::util::now_ms;
use fleet_store::{StoreSettings, rfc3339_ms};
use reqwest::header::{AUTHORIZATION, CONTENT_TYPE};
use serde_json::{Map, Value, json};

use self::fetch::FetchError;
use self::request::{ImageRequest, Kind};
use super::files::{Bucket, HostObjects, META_CONTENT_TYPE, nonce};
use super::llm::{ApiKey, DEFAULT_PROVIDER, KeySourceError, check_base_url, select_by_hints, upstream_code};
use super::media_type::MediaType;
use super::upload::safe_segment;
use super::usage::{self, Reserved, UsageCounter, UsageError};
use super::web::fetch::Fetcher;
use super::{CallContext, Exhausted, ServicesError};

/// Environment variable read for the API key when neither `api_key_file` nor `api_key_env` is configured.
pub const DEFAULT_API_KEY_ENV: &str = "FLEET_IMAGE_API_KEY";

/// The key prefix of stored images.
pub const KEY_ROOT: &str = "exec-images";

/// Largest upstream answer read (eight large images in base64).
pub const MAX_UPSTREAM_BODY_BYTES: usize = 128 * 1024 * 1024;

fn one() -> u32 {
    1
}

/// The images upstream (`[image]` of the services configuration).
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageConfig {
    /// Base URL of the OpenAI-compatible API, including its version prefix, e.g. `https://api.openai.com/v1`.
    pub base_url: String,
    /// File holding the API key (surrounding whitespace ignored).
    #[serde(default)]
    pub api_key_file: Option<PathBuf>,
    /// Environment variable holding the API key; when neither this nor `api_key_file` is set,
    /// [`DEFAULT_API_KEY_ENV`] is read if present; with no key at all, no `Authorization` header is sent.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// `_meta.provider` of every result (default `openai-compatible`, [`DEFAULT_PROVIDER`]).
    #[serde(default)]
    pub provider: Option<String>,
    /// The image models, in preference order (`modelPreferences.hints` pick the first containing the hint).
    #[serde(default)]
    pub models: Vec<ImageModelConfig>,
    /// The model used when no hint matches (default: the first of `models`). Alone, a one-model
    /// configuration that generates one image per request and does not edit.
    #[serde(default)]
    pub default_model: Option<String>,
    /// Subcall timeout without `_clientTimeoutS`, seconds (default 180; at most 240, spec §7.3).
    #[serde(default)]
    pub request_timeout_s: Option<u64>,
}

/// One image model (`[[image.models]]`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageModelConfig {
    /// The upstream model id, e.g. `gpt-image-1`.
    pub name: String,
    /// Whether it serves `/images/edits` (`image/edit` and reference images).
    #[serde(default)]
    pub supports_edit: bool,
    /// Whether its edits take a mask.
    #[serde(default)]
    pub supports_mask: bool,
    /// Images one generation request may ask for (default 1; more are asked in several requests).
    #[serde(default = "one")]
    pub max_n: u32,
    /// Images one edit request may ask for (default 1; more: `-32313`).
    #[serde(default = "one")]
    pub max_edit_n: u32,
    /// The sizes it accepts (`1024x1024`, …); empty: any well-formed size is forwarded.
    #[serde(default)]
    pub sizes: Vec<String>,
}

/// Why an [`ImageConfig`] was refused.
#[derive(Debug, thiserror::Error)]
pub enum ImageConfigError {
    /// `base_url` is not an absolute http(s) URL.
    #[error("services image.base_url must be an absolute http(s) URL without credentials: {0}")]
    BaseUrl(String),
    /// No model.
    #[error("services image: set default_model or list at least one of models")]
    NoModels,
    /// A model is empty, repeated, or has `max_n`/`max_edit_n` outside 1–8.
    #[error("services image.models: model {0:?} is empty or repeated, or its max_n/max_edit_n is not 1–8")]
    BadModel(String),
    /// `default_model` is not among `models`.
    #[error("services image.default_model {0:?} is not one of image.models")]
    UnknownDefaultModel(String),
    /// `request_timeout_s` is 0 or above the cap.
    #[error("services image.request_timeout_s must be 1–{}", limits::IMAGE_MAX_REQUEST_TIMEOUT.as_secs())]
    Timeout,
    /// The API key.
    #[error("services image.{0}")]
    Key(#[from] KeySourceError),
    /// The HTTP client could not be built.
    #[error("services image: HTTP client: {0}")]
    Client(String),
}

impl From<ImageConfigError> for ServicesError {
    fn from(e: ImageConfigError) -> Self {
        ServicesError::Config(e.to_string())
    }
}

/// How the upstream failed. `Display` carries no URL, key, prompt or upstream body.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum UpstreamError {
    #[error("HTTP status {status}{}", .code.as_ref().map(|c| format!(" ({c})")).unwrap_or_default())]
    Status { status: u16, code: Option<String> },
    #[error("network: {0}")]
    Network(&'static str),
    #[error("unusable answer: {0}")]
    Answer(&'static str),
    #[error("an image URL of the answer: {0}")]
    ResultUrl(FetchError),
}

impl UpstreamError {
    fn to_error(&self) -> ErrorObject {
        let mut data = Map::from_iter([("subcall".to_owned(), json!("image"))]);
        if let UpstreamError::Status { status, code } = self {
            data.insert("status".into(), json!(status));
            if let Some(c) = code {
                data.insert("upstreamCode".into(), json!(c));
            }
        }
        codes::IMAGE_PROVIDER_ERROR.error_with(format!("the image provider failed: {self}"), data)
    }
}

/// A call's failure: the plugin's error (the reservation is given back).
type Failure = ErrorObject;

/// The image service.
#[derive(Debug)]
pub struct ImageService {
    client: reqwest::Client,
    origin: String,
    generations_url: String,
    edits_url: String,
    key: Option<ApiKey>,
    provider: String,
    models: Vec<ImageModelConfig>,
    default_model: ImageModelConfig,
    default_timeout: Duration,
    quota: UsageCounter,
    objects: HostObjects,
    /// The `web/*` family's fetcher: inputs and result URLs under the one SSRF policy.
    fetcher: Fetcher,
    env: String,
}

/// One produced image.
struct Produced {
    bytes: Vec<u8>,
    sniffed: pixels::Sniffed,
}

impl ImageService {
    /// Checks the configuration and reads the API key; `quota` is the services' daily-usage counter.
    pub async fn open(
        settings: &StoreSettings,
        config: &ImageConfig,
        objects: HostObjects,
        fetcher: Fetcher,
        quota: UsageCounter,
    ) -> Result<ImageService, ServicesError> {
        let base = check_base_url(&config.base_url).map_err(ImageConfigError::BaseUrl)?;
        let origin = reqwest::Url::parse(&base)
            .map(|u| u.origin().ascii_serialization())
            .map_err(|e| ImageConfigError::BaseUrl(e.to_string()))?;
        let models = match (&config.default_model, config.models.is_empty()) {
            (Some(name), true) => vec![ImageModelConfig {
                name: name.clone(),
                supports_edit: false,
                supports_mask: false,
                max_n: 1,
                max_edit_n: 1,
                sizes: Vec::new(),
            }],
            (None, true) => return Err(ImageConfigError::NoModels.into()),
            (_, false) => config.models.clone(),
        };
        let host_cap = 1..=u32::try_from(limits::IMAGE_MAX_PER_CALL).unwrap_or(u32::MAX);
        for (i, m) in models.iter().enumerate() {
            if m.name.trim().is_empty()
                || models[..i].iter().any(|o| o.name == m.name)
                || !host_cap.contains(&m.max_n)
                || !host_cap.contains(&m.max_edit_n)
            {
                return Err(ImageConfigError::BadModel(m.name.clone()).into());
            }
        }
        let default_model = match &config.default_model {
            Some(name) => models
                .iter()
                .find(|m| &m.name == name)
                .ok_or_else(|| ImageConfigError::UnknownDefaultModel(name.clone()))?,
            None => models.first().ok_or(ImageConfigError::NoModels)?,
        }
        .clone();
        let default_timeout = match config.request_timeout_s {
            None => limits::IMAGE_DEFAULT_REQUEST_TIMEOUT,
            Some(s) if s >= 1 && s <= limits::IMAGE_MAX_REQUEST_TIMEOUT.as_secs() => Duration::from_secs(s),
            Some(_) => return Err(ImageConfigError::Timeout.into()),
        };
        let key = ApiKey::read(
            config.api_key_file.as_ref(),
            config.api_key_env.as_ref(),
            DEFAULT_API_KEY_ENV,
        )
        .map_err(ImageConfigError::from)?;
        let client = reqwest::Client::builder()
            .connect_timeout(super::llm::CONNECT_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| ImageConfigError::Client(e.to_string()))?;
        Ok(ImageService {
            client,
            origin,
            generations_url: format!("{base}/images/generations"),
            edits_url: format!("{base}/images/edits"),
            key,
            provider: config
                .provider
                .clone()
                .unwrap_or_else(|| DEFAULT_PROVIDER.to_owned()),
            models,
            default_model,
            default_timeout,
            quota,
            objects,
            fetcher,
            env: safe_segment(&settings.prefix),
        })
    }

    /// Images `user` got in the last 24 h (the quota's count).
    pub async fn images_today(&self, user: &str) -> Result<u64, ServicesError> {
        self.quota
            .used(usage::IMAGE, user)
            .await
            .map_err(|e| ServicesError::Store(e.to_string()))
    }

    /// The model a request's hints select.
    fn select_model(&self, hints: &[String]) -> &ImageModelConfig {
        select_by_hints(hints, &self.models, |m| &m.name).unwrap_or(&self.default_model)
    }

    /// The subcall timeout and whether the parent invoke's deadline is what bounds it (spec §7.3 HR-DL-01).
    fn timeout(&self, ctx: &CallContext) -> (Duration, bool) {
        subcall_timeout(ctx.client_timeout_s, self.default_timeout, ctx.remaining())
    }

    /// Serves `image/generate` or `image/edit`.
    pub async fn call(&self, ctx: &CallContext, method: &str, params: Value) -> Result<Value, ErrorObject> {
        let kind = match method {
            methods::IMAGE_GENERATE => Kind::Generate,
            methods::IMAGE_EDIT => Kind::Edit,
            _ => return Err(method_not_found(method)),
        };
        let req = ImageRequest::parse(kind, &params)?;
        if kind == Kind::Edit && !ctx.granted(capabilities::LLM_IMAGE_EDIT) {
            return Err(
                codes::IMAGE_NOT_GRANTED.error("the user has not granted llm.image.edit to this plugin")
            );
        }
        let model = self.select_model(&req.hints);
        check_model(&req, model)?;
        let per_call = match kind {
            Kind::Generate => ctx
                .claims
                .max_per_call_generate
                .unwrap_or(limits::IMAGE_DEFAULT_MAX_PER_CALL_GENERATE),
            Kind::Edit => ctx
                .claims
                .max_per_call_edit
                .unwrap_or(limits::IMAGE_DEFAULT_MAX_PER_CALL_EDIT),
        };
        if req.n > per_call {
            return Err(request::over_cap(req.n, per_call, false));
        }
        // The invoke's images, all its calls together: reserved before the provider is asked, so concurrent calls
        // of one invoke never get more than the cap; what is not delivered is given back when this is dropped.
        let per_invoke = match ctx.budget.reserve_images(req.n) {
            Ok(r) => r,
            Err(Exhausted::Images { asked, images, cap }) => {
                return Err(request::over_invoke_cap(asked, images, cap));
            }
            Err(other) => return Err(codes::IMAGE_MAX_IMAGES_EXCEEDED.error(other.to_string())),
        };
        let day_cap = u64::from(
            ctx.claims
                .max_images_per_day
                .unwrap_or(limits::IMAGE_DEFAULT_MAX_PER_DAY),
        );
        let reserved = match self
            .quota
            .reserve(usage::IMAGE, &ctx.user, u64::from(req.n), day_cap)
            .await
        {
            Ok(r) => r,
            Err(UsageError::Exhausted { used, cap, asked }) => {
                return Err(codes::IMAGE_QUOTA_EXCEEDED.error_with(
                    format!(
                        "{used} of {cap} images used in the last 24 h: {asked} more would exceed max_images_per_day"
                    ),
                    Map::from_iter([
                        ("images_today".to_owned(), json!(used)),
                        ("images_quota".to_owned(), json!(cap)),
                    ]),
                ));
            }
            Err(e @ UsageError::Store(_)) => {
                tracing::warn!(invoke_id = %ctx.invoke_id, error = %e, "image quota unavailable");
                return Err(codes::IMAGE_STORAGE_ERROR.error("the image quota could not be read or written"));
            }
        };
        let (timeout, by_deadline) = self.timeout(ctx);
        let started = Instant::now();
        let outcome = tokio::time::timeout(timeout, self.produce(ctx, &req, model)).await;
        let latency_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        let links = match outcome {
            Ok(Ok(links)) => links,
            Ok(Err(mut e)) => {
                self.quota.refund(&ctx.user, reserved, 0).await;
                // Every provider error names the subcall and its timeout (spec §8.6 `-32103`).
                if e.code == codes::IMAGE_PROVIDER_ERROR.code
                    && let Some(Value::Object(data)) = e.data.as_mut()
                {
                    data.entry("timeout_s").or_insert(json!(timeout.as_secs_f64()));
                }
                return Err(e);
            }
            Err(_) => {
                self.quota.refund(&ctx.user, reserved, 0).await;
                tracing::warn!(invoke_id = %ctx.invoke_id, model = %model.name, ?timeout, by_deadline, "image call timed out");
                return Err(timeout_error(timeout, by_deadline));
            }
        };
        let delivered = links.len() as u64;
        per_invoke.settle(u32::try_from(delivered).unwrap_or(u32::MAX));
        self.quota.refund(&ctx.user, reserved, delivered).await;
        Ok(json!({
            "images": links,
            "model": model.name,
            "quota_used": {
                "images_today": images_today(reserved, delivered),
                "images_quota": day_cap,
            },
            "_meta": {"provider": self.provider, "latencyMs": latency_ms},
        }))
    }

    /// Inputs, upstream, storage: the result images' entries.
    async fn produce(
        &self,
        ctx: &CallContext,
        req: &ImageRequest,
        model: &ImageModelConfig,
    ) -> Result<Vec<Value>, Failure> {
        let mut inputs = Vec::new();
        if let Some(url) = &req.image_url {
            inputs.push(self.input(ctx, "image_url", url).await?);
        }
        for (i, url) in req.references.iter().enumerate() {
            inputs.push(
                self.input(ctx, &format!("reference_image_urls[{i}]"), url)
                    .await?,
            );
        }
        let mask = match &req.mask_url {
            Some(url) => Some(self.input(ctx, "mask_url", url).await?),
            None => None,
        };
        let produced = if inputs.is_empty() {
            let mut out = Vec::new();
            let mut left = req.n;
            while left > 0 {
                let k = left.min(model.max_n);
                out.extend(self.generate(ctx, req, model, k).await?);
                left -= k;
            }
            out
        } else {
            let per_request = match req.kind {
                Kind::Edit => req.n,
                Kind::Generate => model.max_edit_n.min(req.n),
            };
            let mut out = Vec::new();
            let mut left = req.n;
            while left > 0 {
                let k = left.min(per_request);
                out.extend(self.edit(ctx, req, model, k, &inputs, mask.as_ref()).await?);
                left -= k;
            }
            out
        };
        let stamp = now_ms();
        let nonce = nonce();
        let mut links = Vec::with_capacity(produced.len());
        for (i, p) in produced.into_iter().take(req.n as usize).enumerate() {
            links.push(
                self.store(ctx, &format!("{stamp}_{}_{i}", &nonce[..12]), p)
                    .await?,
            );
        }
        Ok(links)
    }

    /// One input image: a fleet link of the caller, or a public URL (`-32314` otherwise).
    async fn input(&self, ctx: &CallContext, field: &str, url: &str) -> Result<Produced, Failure> {
        let fetched = match fetch::fleet_link(&self.objects, &ctx.user, url).await {
            Some(r) => r,
            None => fetch::public(&self.fetcher, url).await,
        };
        let refused = |why: String| {
            codes::REFERENCE_FETCH_FAILED.error_with(
                format!("{field} could not be fetched: {why}"),
                Map::from_iter([("field".to_owned(), json!(field))]),
            )
        };
        let bytes = fetched.map_err(|e| refused(e.to_string()))?;
        let sniffed =
            pixels::sniff(&bytes).ok_or_else(|| refused("not a PNG, JPEG, WebP or GIF image".into()))?;
        Ok(Produced { bytes, sniffed })
    }

    fn authorized(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.key {
            Some(key) => request.header(AUTHORIZATION, key.header()),
            None => request,
        }
    }

    async fn generate(
        &self,
        ctx: &CallContext,
        req: &ImageRequest,
        model: &ImageModelConfig,
        n: u32,
    ) -> Result<Vec<Pending>, Failure> {
        let mut body = Map::new();
        body.insert("model".into(), json!(model.name));
        body.insert("prompt".into(), json!(req.prompt));
        body.insert("n".into(), json!(n));
        body.insert("response_format".into(), json!("b64_json"));
        for (k, v) in [
            ("size", &req.size),
            ("quality", &req.quality),
            ("output_format", &req.output_format),
        ] {
            if let Some(v) = v {
                body.insert(k.into(), json!(v));
            }
        }
        let request = self.authorized(self.client.post(&self.generations_url).json(&body));
        self.exchange(ctx, model, request).await
    }

    async fn edit(
        &self,
        ctx: &CallContext,
        req: &ImageRequest,
        model: &ImageModelConfig,
        n: u32,
        inputs: &[Produced],
        mask: Option<&Produced>,
    ) -> Result<Vec<Pending>, Failure> {
        let mut form = Multipart::new();
        form.field("model", &model.name);
        form.field("prompt", &req.prompt);
        form.field("n", &n.to_string());
        form.field("response_format", "b64_json");
        for (k, v) in [
            ("size", &req.size),
            ("quality", &req.quality),
            ("output_format", &req.output_format),
        ] {
            if let Some(v) = v {
                form.field(k, v);
            }
        }
        let image_field = if inputs.len() == 1 { "image" } else { "image[]" };
        for (i, input) in inputs.iter().enumerate() {
            form.file(
                image_field,
                &format!("image-{i}.{}", input.sniffed.ext),
                input.sniffed.mime,
                &input.bytes,
            );
        }
        if let Some(m) = mask {
            form.file(
                "mask",
                &format!("mask.{}", m.sniffed.ext),
                m.sniffed.mime,
                &m.bytes,
            );
        }
        let (content_type, body) = form.finish();
        let request = self.authorized(
            self.client
                .post(&self.edits_url)
                .header(CONTENT_TYPE, content_type)
                .body(body),
        );
        self.exchange(ctx, model, request).await
    }

    /// Sends a request and turns the answer's `data[]` into images.
    async fn exchange(
        &self,
        ctx: &CallContext,
        model: &ImageModelConfig,
        request: reqwest::RequestBuilder,
    ) -> Result<Vec<Pending>, Failure> {
        let answer = self.send(request).await.and_then(|reply| Self::images_of(&reply));
        match answer {
            Ok(images) => Ok(images),
            Err(e) => {
                tracing::warn!(invoke_id = %ctx.invoke_id, model = %model.name, error = %e, "image upstream failed");
                Err(e.to_error())
            }
        }
    }

    async fn send(&self, request: reqwest::RequestBuilder) -> Result<Value, UpstreamError> {
        let mut response = request.send().await.map_err(|e| {
            UpstreamError::Network(if e.is_connect() {
                "connection failed"
            } else {
                "request failed"
            })
        })?;
        let status = response.status();
        let mut bytes = Vec::new();
        while let Some(chunk) = response
            .chunk()
            .await
            .map_err(|_| UpstreamError::Network("response body failed"))?
        {
            if bytes.len() + chunk.len() > MAX_UPSTREAM_BODY_BYTES {
                return Err(UpstreamError::Answer("response too large"));
            }
            bytes.extend_from_slice(&chunk);
        }
        if !status.is_success() {
            return Err(UpstreamError::Status {
                status: status.as_u16(),
                code: upstream_code(&bytes),
            });
        }
        serde_json::from_slice(&bytes).map_err(|_| UpstreamError::Answer("response is not JSON"))
    }

    /// The images of an answer: `data[].b64_json`, or `data[].url` (fetched at [`ImageService::resolve`]).
    fn images_of(reply: &Value) -> Result<Vec<Pending>, UpstreamError> {
        let data = reply
            .get("data")
            .and_then(Value::as_array)
            .filter(|d| !d.is_empty())
            .ok_or(UpstreamError::Answer("no data"))?;
        data.iter()
            .map(|d| {
                if let Some(b) = d.get("b64_json").and_then(Value::as_str) {
                    STANDARD
                        .decode(b.trim())
                        .map(Pending::Bytes)
                        .map_err(|_| UpstreamError::Answer("b64_json is not base64"))
                } else if let Some(u) = d.get("url").and_then(Value::as_str).filter(|u| !u.is_empty()) {
                    Ok(Pending::Url(u.to_owned()))
                } else {
                    Err(UpstreamError::Answer("an image without b64_json or url"))
                }
            })
            .collect()
    }

    /// An answer's image as bytes of a known format.
    async fn resolve(&self, p: Pending) -> Result<Produced, UpstreamError> {
        let bytes = match p {
            Pending::Bytes(b) => b,
            Pending::Url(u) => self.fetch_result(&u).await.map_err(UpstreamError::ResultUrl)?,
        };
        let sniffed =
            pixels::sniff(&bytes).ok_or(UpstreamError::Answer("not a PNG, JPEG, WebP or GIF image"))?;
        Ok(Produced { bytes, sniffed })
    }

    /// Stores one image; its result entry.
    async fn store(&self, ctx: &CallContext, name: &str, p: Pending) -> Result<Value, Failure> {
        let p = match self.resolve(p).await {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(invoke_id = %ctx.invoke_id, error = %e, "image upstream answer unusable");
                return Err(e.to_error());
            }
        };
        let key = format!(
            "{KEY_ROOT}/{}/{}/{}/{}/{name}.{}",
            self.env,
            user_key(&ctx.user),
            safe_segment(&ctx.tool_id),
            safe_segment(&ctx.invoke_id),
            p.sniffed.ext
        );
        let stored = || codes::IMAGE_STORAGE_ERROR.error("the generated image could not be stored");
        let media = MediaType::parse(p.sniffed.mime).map_err(|_| stored())?;
        let meta = object_store::ObjectMetadata {
            name: key.clone(),
            metadata: HashMap::from([(META_CONTENT_TYPE.to_owned(), media.as_str().to_owned())]),
            ..Default::default()
        };
        let mut reader: &[u8] = &p.bytes;
        if let Err(e) = self.objects.store(Bucket::Uploads).put(meta, &mut reader).await {
            tracing::warn!(invoke_id = %ctx.invoke_id, error = %e, "storing a generated image failed");
            return Err(stored());
        }
        let filename = format!("image.{}", p.sniffed.ext);
        let (url, exp) = self.objects.get_link(
            Bucket::Uploads,
            &key,
            &filename,
            &media,
            limits::R2_TRANSIENT_PRESIGN_EXPIRY,
        );
        Ok(json!({
            "url": url,
            "mimeType": p.sniffed.mime,
            "width": p.sniffed.width,
            "height": p.sniffed.height,
            "size_bytes": p.bytes.len(),
            "expires_at": rfc3339_ms(exp * 1000),
        }))
    }

    /// Fetches an image URL the provider answered with: on the upstream's own origin with its client (without
    /// the key), anywhere else under the SSRF policy.
    async fn fetch_result(&self, url: &str) -> Result<Vec<u8>, FetchError> {
        let same_origin =
            reqwest::Url::parse(url).is_ok_and(|u| u.origin().ascii_serialization() == self.origin);
        if same_origin {
            fetch::own_origin(self.client.get(url).send().await).await
        } else {
            fetch::public(&self.fetcher, url).await
        }
    }
}

/// An image of an answer before it is fetched and recognised.
enum Pending {
    Bytes(Vec<u8>),
    Url(String),
}

/// Images of the last 24 h after a call that delivered `delivered` of its reservation.
fn images_today(reserved: Reserved, delivered: u64) -> u64 {
    reserved
        .used
        .saturating_sub(reserved.units().saturating_sub(delivered))
}

/// Model support (`-32311`, `-32312`, `-32313`) and sizes (`-32104`).
fn check_model(req: &ImageRequest, model: &ImageModelConfig) -> Result<(), ErrorObject> {
    let edits = req.kind == Kind::Edit || !req.references.is_empty();
    if edits && !model.supports_edit {
        return Err(codes::EDIT_NOT_SUPPORTED.error(format!(
            "model {} does not edit images (image/edit and reference_image_urls need one that does)",
            model.name
        )));
    }
    if req.mask_url.is_some() && !model.supports_mask {
        return Err(codes::MASK_UNSUPPORTED.error(format!("model {} does not take masks", model.name)));
    }
    if req.kind == Kind::Edit && req.n > model.max_edit_n {
        return Err(codes::N_UNSUPPORTED.error_with(
            format!(
                "model {} edits at most {} image(s) per call",
                model.name, model.max_edit_n
            ),
            Map::from_iter([("maxN".to_owned(), json!(model.max_edit_n))]),
        ));
    }
    if let Some(size) = &req.size
        && !model.sizes.is_empty()
        && !model.sizes.contains(size)
    {
        return Err(codes::IMAGE_INVALID_REQUEST.error(format!(
            "size {size:?} is not one of model {}'s sizes: {}",
            model.name,
            model.sizes.join(", ")
        )));
    }
    Ok(())
}

/// `min(_clientTimeoutS or the default, 240 s)`, cut to `remaining` (the parent invoke's time left), and whether
/// `remaining` is what bounds it.
fn subcall_timeout(
    client_timeout_s: Option<f64>,
    default: Duration,
    remaining: Duration,
) -> (Duration, bool) {
    let cap = limits::IMAGE_MAX_REQUEST_TIMEOUT;
    let budget = match client_timeout_s.filter(|s| s.is_finite() && *s > 0.0) {
        Some(s) => Duration::from_secs_f64(s.min(cap.as_secs_f64())),
        None => default.min(cap),
    };
    if remaining < budget {
        (remaining, true)
    } else {
        (budget, false)
    }
}

/// The timeout error: `-32105` when the parent invoke's deadline cut the call, else `-32103`; both with
/// `data.subcall = "image"` and `data.timeout_s` (spec §7.3 HR-DL-02).
fn timeout_error(timeout: Duration, by_deadline: bool) -> ErrorObject {
    let data = Map::from_iter([
        ("subcall".to_owned(), json!("image")),
        ("timeout_s".to_owned(), json!(timeout.as_secs_f64())),
        ("errorName".to_owned(), json!("subcall_timeout")),
    ]);
    if by_deadline {
        codes::IMAGE_TIMEOUT.error_with(
            format!("the invoke's deadline passed after {timeout:?} while the image was produced"),
            data,
        )
    } else {
        codes::IMAGE_PROVIDER_ERROR.error_with(
            format!("the image provider did not answer within {timeout:?}"),
            data,
        )
    }
}

/// A `multipart/form-data` body (RFC 7578).
struct Multipart {
    boundary: String,
    body: Vec<u8>,
}

impl Multipart {
    fn new() -> Multipart {
        Multipart {
            boundary: format!("fleet-image-{}", nonce()),
            body: Vec::new(),
        }
    }

    fn head(&mut self, disposition: &str) {
        self.body.extend_from_slice(
            format!(
                "--{}\r\nContent-Disposition: form-data; {disposition}\r\n",
                self.boundary
            )
            .as_bytes(),
        );
    }

    fn field(&mut self, name: &str, value: &str) {
        self.head(&format!("name=\"{name}\""));
        self.body.extend_from_slice(b"\r\n");
        self.body.extend_from_slice(value.as_bytes());
        self.body.extend_from_slice(b"\r\n");
    }

    fn file(&mut self, name: &str, filename: &str, mime: &str, bytes: &[u8]) {
        self.head(&format!("name=\"{name}\"; filename=\"{filename}\""));
        self.body
            .extend_from_slice(format!("Content-Type: {mime}\r\n\r\n").as_bytes());
        self.body.extend_from_slice(bytes);
        self.body.extend_from_slice(b"\r\n");
    }

    /// The `Content-Type` and the body.
    fn finish(mut self) -> (String, Vec<u8>) {
        self.body
            .extend_from_slice(format!("--{}--\r\n", self.boundary).as_bytes());
        (
            format!("multipart/form-data; boundary={}", self.boundary),
            self.body,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_subcall_timeout_is_capped_and_bounded_by_the_deadline() {
        let (default, hour) = (limits::IMAGE_DEFAULT_REQUEST_TIMEOUT, Duration::from_secs(3600));
        assert_eq!(
            subcall_timeout(None, default, hour),
            (Duration::from_secs(180), false)
        );
        assert_eq!(
            subcall_timeout(Some(240.0), default, hour),
            (Duration::from_secs(240), false)
        );
        assert_eq!(
            subcall_timeout(Some(241.0), default, hour),
            (Duration::from_secs(240), false)
        );
        assert_eq!(
            subcall_timeout(Some(2.5), default, hour),
            (Duration::from_millis(2500), false)
        );
        for ignored in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert_eq!(
                subcall_timeout(Some(ignored), default, hour).0,
                Duration::from_secs(180)
            );
        }
        let left = Duration::from_secs(30);
        assert_eq!(subcall_timeout(None, default, left), (left, true));
        assert_eq!(
            subcall_timeout(Some(30.0), default, left),
            (left, false),
            "equal: the client's budget"
        );
    }

    #[test]
    fn timeouts_say_which_limit_passed() {
        let t = Duration::from_secs(2);
        let provider = timeout_error(t, false);
        assert_eq!(provider.code, -32103);
        let data = provider.data.expect("data");
        assert_eq!(
            (data["subcall"].clone(), data["timeout_s"].clone()),
            (json!("image"), json!(2.0))
        );
        assert_eq!(timeout_error(t, true).code, -32105);
    }

    #[test]
    fn multipart_bodies_are_well_formed() {
        let mut form = Multipart::new();
        form.field("prompt", "a \"cat\"");
        form.file("image", "image-0.png", "image/png", b"\x89PNG");
        let boundary = form.boundary.clone();
        let (ct, body) = form.finish();
        assert_eq!(ct, format!("multipart/form-data; boundary={boundary}"));
        let expected = format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\na \"cat\"\r\n\
             --{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"image-0.png\"\r\n\
             Content-Type: image/png\r\n\r\n\u{fffd}PNG\r\n--{boundary}--\r\n"
        );
        assert_eq!(String::from_utf8_lossy(&body), expected);
    }
}
