//! `web/*` (spec §8.9): `web/fetch` served natively under an SSRF policy that cannot be disabled ([`ssrf`],
//! [`fetch`], [`html`]); `web/search` and `web/image_search` against a SearXNG-compatible provider configured
//! in `[web]` of the services TOML ([`search`]); `web/image_fetch` downloads under the same policy, keeps only
//! JPEG, PNG, WebP and GIF (by their magic bytes) and stores the image as an upload of the invoke (the object
//! store of `host/uploadFile`, kept 24 h), answering with a 30-minute signed link.
//!
//! Accounting: a daily pool of compute units (CU) per user, `daily_quota_cu` of `[web]` (default
//! [`DEFAULT_DAILY_QUOTA_CU`]): a search or an image search costs [`SEARCH_CU`], a fetched page [`PAGE_CU`]. A
//! call reserves its worst case first (a fetch: one CU per URL) and is refused whole with `-32522` when the pool
//! cannot cover it; what it did not use (failed pages, a failed provider call) goes back. The pool is the
//! services' daily-usage counter ([`crate::usage`], family `web`, the UTC day) in JetStream KV: exact across
//! every worker.
//!
//! Deadlines: a call gets `min(_clientTimeoutS, the invoke's remaining time, 60 s)`; each page of a fetch
//! `min(timeout_ms or 15 s, that)`; the provider `min(search_timeout_s, that)`.

pub mod fetch;
pub mod html;
pub mod search;
pub mod ssrf;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use fleet_proto::executa::capabilities;
use fleet_proto::executa::reverse::{methods, web as codes};
use fleet_proto::executa::web::{
    self as wire, FetchParams, FetchResult, ImageFetchParams, ImageFetchResult, ImageSearchParams,
    ImageSearchResult, SearchParams, SearchResult, fetch_errors,
};
use fleet_proto::jsonrpc::ErrorObject;
use fleet_proto::limits::{
    WEB_FETCH_DEFAULT_PAGE_TIMEOUT, WEB_FETCH_MAX_CHARS_PER_PAGE, WEB_FETCH_MAX_URLS,
    WEB_FETCH_RESPONSE_BUDGET_BYTES, WEB_IMAGE_FETCH_DEFAULT_BYTES, WEB_IMAGE_FETCH_MAX_BYTES,
    WEB_IMAGE_SEARCH_DEFAULT_RESULTS, WEB_MAX_RESULTS_PER_CALL, WEB_REQUEST_TIMEOUT,
};
use serde_json::{Map, Value};

use crate::media_type::MediaType;
use crate::upload::{Described, UploadService};
use crate::usage::{self, Reserved, UsageCounter, UsageError};
use crate::{CallContext, ServicesError};

/// CU of one search or image search.
pub const SEARCH_CU: u64 = 1;
/// CU of one fetched page.
pub const PAGE_CU: u64 = 1;
/// CU of one fetched image.
pub const IMAGE_CU: u64 = 1;
/// Longest `purpose` of `web/image_fetch`, characters.
pub const MAX_PURPOSE_CHARS: usize = 64;
/// The daily pool per user when `[web]` sets none.
pub const DEFAULT_DAILY_QUOTA_CU: u64 = 500;
/// The provider's timeout when `[web]` sets none.
pub const DEFAULT_SEARCH_TIMEOUT: Duration = Duration::from_secs(15);
/// Longest `query`, characters.
pub const MAX_QUERY_CHARS: usize = 400;
/// Most `include_domains` / `exclude_domains` entries.
pub const MAX_DOMAINS: usize = 20;

/// `[web]` of the services TOML.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebConfig {
    /// Base URL of a SearXNG-compatible search API (its JSON format enabled), e.g. `http://searxng:8080`;
    /// absent: `web/search` and `web/image_search` are not offered.
    #[serde(default)]
    pub search_url: Option<String>,
    /// File holding a key for the provider, sent as `Authorization: Bearer …` (surrounding whitespace ignored).
    #[serde(default)]
    pub api_key_file: Option<PathBuf>,
    /// The provider's timeout, seconds (default 15; never beyond the call's own deadline).
    #[serde(default)]
    pub search_timeout_s: Option<u64>,
    /// Serve `web/fetch` (default true: it needs no upstream).
    #[serde(default = "yes")]
    pub fetch: bool,
    /// Each user's daily pool of compute units (default 500): a search costs 1, a fetched page 1; UTC days,
    /// counted fleet-wide (the services' daily-usage counter).
    #[serde(default)]
    pub daily_quota_cu: Option<u64>,
    /// FOR TESTS ONLY: exact `ip:port` pairs `web/*` fetches and `image/*` inputs may reach despite the SSRF
    /// policy (a test server on this host). Never ranges; each entry is logged at warning level at start-up. Leave empty in production.
    #[serde(default)]
    pub test_allow_addrs: Vec<SocketAddr>,
    /// Ranges always refused on top of the built-in ones: the cluster's pod, service and node CIDRs (IPv6 ones
    /// are global unicast). `--cluster-cidr` adds to it.
    #[serde(default)]
    pub deny_cidrs: Vec<ipnet::IpNet>,
}

fn yes() -> bool {
    true
}

impl Default for WebConfig {
    fn default() -> Self {
        WebConfig {
            search_url: None,
            api_key_file: None,
            search_timeout_s: None,
            fetch: true,
            daily_quota_cu: None,
            test_allow_addrs: Vec::new(),
            deny_cidrs: Vec::new(),
        }
    }
}

/// A call's reserved CU: [`Hold::keep`] settles it (what is not kept goes back to the pool). A hold dropped
/// unsettled (the call was cancelled) gives everything back in the background.
#[derive(Debug)]
struct Hold {
    usage: UsageCounter,
    user: String,
    reserved: Option<Reserved>,
}

impl Hold {
    /// Keeps `n` of the held CU and gives the rest back; returns what was kept.
    async fn keep(mut self, n: u64) -> u64 {
        let Some(reserved) = self.reserved.take() else {
            return 0;
        };
        self.usage.refund(&self.user, reserved, n).await;
        n.min(reserved.units())
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        let Some(reserved) = self.reserved.take() else {
            return;
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let usage = self.usage.clone();
            let user = std::mem::take(&mut self.user);
            runtime.spawn(async move { usage.refund(&user, reserved, 0).await });
        }
    }
}

/// The one fetcher of the host services under the one SSRF policy (`[web] test_allow_addrs` its only
/// exception, each entry logged at warning level here): `web/*` and the `image/*` family's URL inputs.
pub fn fetcher(config: &WebConfig, resolver: Arc<dyn ssrf::Resolve>) -> fetch::Fetcher {
    for addr in &config.test_allow_addrs {
        tracing::warn!(
            %addr,
            "services.web.test_allow_addrs: web/fetch and image inputs may reach this address despite the SSRF \
             policy — FOR TESTS ONLY, remove it in production"
        );
    }
    let policy = ssrf::SsrfPolicy::new(config.test_allow_addrs.clone()).denying(&config.deny_cidrs);
    fetch::Fetcher::new(policy, resolver)
}

/// The web service.
#[derive(Debug)]
pub struct WebService {
    fetcher: Option<fetch::Fetcher>,
    provider: Option<search::Provider>,
    usage: UsageCounter,
    daily_cu: u64,
}

impl WebService {
    /// Checks `[web]` and reads the provider key; `fetcher` is the one the services share (built by
    /// [`fetcher`]: `[web] fetch = false` only turns `web/fetch` and `web/image_fetch` off, not the policy of the
    /// other families' fetches), `usage` their daily-usage counter (the CU pool).
    pub fn with_fetcher(
        config: &WebConfig,
        fetcher: fetch::Fetcher,
        usage: UsageCounter,
    ) -> Result<WebService, ServicesError> {
        let bad = |what: String| ServicesError::Config(format!("services.web: {what}"));
        let provider = match &config.search_url {
            None => None,
            Some(url) => {
                let base = crate::llm::upstream_base_url(url).map_err(|e| bad(format!("search_url: {e}")))?;
                let key = match &config.api_key_file {
                    None => None,
                    Some(path) => {
                        let raw = std::fs::read_to_string(path)
                            .map_err(|e| bad(format!("api_key_file {}: {e}", path.display())))?;
                        Some(
                            crate::llm::bearer(&raw)
                                .ok_or_else(|| bad("api_key_file: not a usable key".to_owned()))?,
                        )
                    }
                };
                let timeout = config
                    .search_timeout_s
                    .map_or(DEFAULT_SEARCH_TIMEOUT, Duration::from_secs);
                if timeout.is_zero() {
                    return Err(bad("search_timeout_s must be at least 1".to_owned()));
                }
                Some(search::Provider::new(&base, key, timeout).map_err(bad)?)
            }
        };
        if config.api_key_file.is_some() && provider.is_none() {
            return Err(bad("api_key_file without search_url".to_owned()));
        }
        let fetcher = config.fetch.then_some(fetcher);
        Ok(WebService {
            fetcher,
            provider,
            usage,
            daily_cu: config.daily_quota_cu.unwrap_or(DEFAULT_DAILY_QUOTA_CU),
        })
    }

    /// Whether `capability` (`web.search`, …) is served here.
    pub fn serves(&self, capability: &str) -> bool {
        match capability {
            capabilities::WEB_FETCH | capabilities::WEB_IMAGE_FETCH => self.fetcher.is_some(),
            capabilities::WEB_SEARCH | capabilities::WEB_IMAGE_SEARCH => self.provider.is_some(),
            _ => false,
        }
    }

    /// The `initialize` offer: `{"search": bool, "fetch": bool, "image_search": bool, "image_fetch": false}`;
    /// `None` when nothing is served.
    pub fn offer(&self) -> Option<Value> {
        let methods = [
            ("search", capabilities::WEB_SEARCH),
            ("fetch", capabilities::WEB_FETCH),
            ("image_search", capabilities::WEB_IMAGE_SEARCH),
            ("image_fetch", capabilities::WEB_IMAGE_FETCH),
        ];
        let offer: Map<String, Value> = methods
            .iter()
            .map(|(k, c)| ((*k).to_owned(), Value::Bool(self.serves(c))))
            .collect();
        offer
            .values()
            .any(|v| v == &Value::Bool(true))
            .then_some(Value::Object(offer))
    }

    /// CU `user` used today, all workers together.
    pub async fn used(&self, user: &str) -> Result<u64, ServicesError> {
        self.usage
            .used(usage::WEB, user)
            .await
            .map_err(|e| ServicesError::Store(e.to_string()))
    }

    /// Serves one `web/*` call whose token verified and carries the method's capability; `web/image_fetch`
    /// stores its image through `uploads`.
    pub async fn call(
        &self,
        ctx: &CallContext,
        method: &str,
        params: Value,
        uploads: &UploadService,
    ) -> Result<Value, ErrorObject> {
        let timeout = ctx.subcall_timeout(WEB_REQUEST_TIMEOUT);
        if timeout.is_zero() {
            return Err(codes::WEB_TIMEOUT.error("the invoke has no time left for this call"));
        }
        match method {
            methods::WEB_FETCH => self.fetch(ctx, params, timeout).await,
            methods::WEB_SEARCH => self.search(ctx, params, timeout).await,
            methods::WEB_IMAGE_SEARCH => self.image_search(ctx, params, timeout).await,
            methods::WEB_IMAGE_FETCH => self.image_fetch(ctx, params, timeout, uploads).await,
            _ => Err(codes::WEB_NOT_GRANTED.error(format!("{method} is not offered on this host"))),
        }
    }

    /// Reserves `n` CU of the caller's daily pool (`-32522` when it cannot cover them).
    async fn reserve(&self, ctx: &CallContext, n: u64) -> Result<Hold, ErrorObject> {
        match self.usage.reserve(usage::WEB, &ctx.user, n, self.daily_cu).await {
            Ok(reserved) => Ok(Hold {
                usage: self.usage.clone(),
                user: ctx.user.clone(),
                reserved: Some(reserved),
            }),
            Err(UsageError::Exhausted { used, cap, asked }) => Err(codes::WEB_QUOTA_EXCEEDED.error_with(
                format!("the user's daily web quota is spent: {used} of {cap} CU used, {asked} more needed"),
                Map::from_iter([
                    ("used".to_owned(), Value::from(used)),
                    ("limit".to_owned(), Value::from(cap)),
                ]),
            )),
            Err(e @ UsageError::Store(_)) => {
                tracing::warn!(invoke_id = %ctx.invoke_id, error = %e, "web quota unavailable");
                Err(codes::WEB_PROVIDER_ERROR.error("the web quota could not be read or written"))
            }
        }
    }

    async fn fetch(&self, ctx: &CallContext, params: Value, timeout: Duration) -> Result<Value, ErrorObject> {
        let Some(fetcher) = &self.fetcher else {
            return Err(codes::WEB_NOT_GRANTED.error("web/fetch is not offered on this host"));
        };
        let req = FetchRequest::parse(params, timeout)?;
        let hold = self
            .reserve(ctx, PAGE_CU.saturating_mul(req.urls.len() as u64))
            .await?;
        let options = fetch::PageOptions {
            format: req.format,
            max_chars: req.max_chars,
            timeout: req.page_timeout,
        };
        let mut pages = futures::future::join_all(req.urls.iter().map(|u| fetcher.page(u, options))).await;
        // The answer's budget, in the order of the URLs.
        let mut spent = 0_usize;
        for page in &mut pages {
            let size = page.content.as_ref().map_or(0, String::len);
            if page.ok && spent + size > WEB_FETCH_RESPONSE_BUDGET_BYTES {
                *page = wire::FetchedPage {
                    url: std::mem::take(&mut page.url),
                    ok: false,
                    error: Some(fetch_errors::RESPONSE_BUDGET_EXCEEDED.to_owned()),
                    ..wire::FetchedPage::default()
                };
            } else {
                spent += size;
            }
        }
        let fetched = pages.iter().filter(|p| p.ok).count() as u64;
        let quota_consumed = hold.keep(fetched.saturating_mul(PAGE_CU)).await;
        to_value(&FetchResult {
            pages,
            quota_consumed,
        })
    }

    async fn image_fetch(
        &self,
        ctx: &CallContext,
        params: Value,
        timeout: Duration,
        uploads: &UploadService,
    ) -> Result<Value, ErrorObject> {
        let Some(fetcher) = &self.fetcher else {
            return Err(codes::WEB_NOT_GRANTED.error("web/image_fetch is not offered on this host"));
        };
        let p: ImageFetchParams = parse(params, "{url, max_bytes?, purpose?}")?;
        let source = p
            .url
            .as_str()
            .filter(|u| !u.trim().is_empty())
            .ok_or_else(|| invalid("url must be a URL string"))?;
        let cap = match positive(p.max_bytes.as_ref(), "max_bytes")? {
            None => WEB_IMAGE_FETCH_DEFAULT_BYTES,
            Some(n) if n <= WEB_IMAGE_FETCH_MAX_BYTES as u64 => usize::try_from(n).unwrap_or(usize::MAX),
            Some(_) => {
                return Err(invalid(format!(
                    "max_bytes must be 1–{WEB_IMAGE_FETCH_MAX_BYTES}"
                )));
            }
        };
        match &p.purpose {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s.chars().count() <= MAX_PURPOSE_CHARS => {}
            Some(_) => {
                return Err(invalid(format!(
                    "purpose must be a string of at most {MAX_PURPOSE_CHARS} characters"
                )));
            }
        }
        let hold = self.reserve(ctx, IMAGE_CU).await?;
        match self.download(ctx, fetcher, source, cap, timeout, uploads).await {
            Ok(mut result) => {
                result.quota_consumed = hold.keep(IMAGE_CU).await;
                to_value(&result)
            }
            Err(e) => {
                hold.keep(0).await;
                Err(e)
            }
        }
    }

    /// The download, check and storage of `web/image_fetch` (its `quota_consumed` left 0).
    async fn download(
        &self,
        ctx: &CallContext,
        fetcher: &fetch::Fetcher,
        source: &str,
        cap: usize,
        timeout: Duration,
        uploads: &UploadService,
    ) -> Result<ImageFetchResult, ErrorObject> {
        let (final_url, bytes) = fetcher
            .bytes(source, cap, timeout)
            .await
            .map_err(|e| image_error(&e))?;
        let (mime, ext) = sniff_image(&bytes).ok_or_else(|| {
            codes::WEB_INVALID_REQUEST.error_with(
                "the URL is not a JPEG, PNG, WebP or GIF image (judged by its bytes)",
                Map::from_iter([("error".to_owned(), Value::from("UNSUPPORTED_MEDIA"))]),
            )
        })?;
        let described = Described {
            filename: format!("image.{ext}"),
            mime: MediaType::parse(mime)
                .map_err(|_| codes::WEB_PROVIDER_ERROR.error("the image could not be stored"))?,
            purpose: "user_artifact".to_owned(),
        };
        let path = uploads
            .store(ctx, &described, &bytes)
            .await
            .map_err(|_| codes::WEB_PROVIDER_ERROR.error("the image could not be stored"))?;
        let (get_url, _) = uploads.link(&path, &described.filename, &described.mime);
        use sha2::Digest as _;
        Ok(ImageFetchResult {
            path,
            get_url,
            mime_type: mime.to_owned(),
            bytes_size: bytes.len() as u64,
            sha256: hex::encode(sha2::Sha256::digest(&bytes)),
            source_url: source.to_owned(),
            final_url,
            quota_consumed: 0,
        })
    }

    fn provider(&self, method: &str) -> Result<&search::Provider, ErrorObject> {
        self.provider.as_ref().ok_or_else(|| {
            codes::WEB_NOT_GRANTED.error(format!("{method}: no search provider is configured"))
        })
    }

    /// One provider call, charged [`SEARCH_CU`] only when it answers: its results and the CU charged.
    async fn ask(
        &self,
        ctx: &CallContext,
        provider: &search::Provider,
        query: &search::Query,
        timeout: Duration,
    ) -> Result<(Vec<search::RawResult>, u64), ErrorObject> {
        let hold = self.reserve(ctx, SEARCH_CU).await?;
        match provider.search(query, timeout.min(provider.timeout())).await {
            Ok(raw) => Ok((raw, hold.keep(SEARCH_CU).await)),
            Err(e) => {
                hold.keep(0).await;
                Err(provider_error(e))
            }
        }
    }

    async fn search(
        &self,
        ctx: &CallContext,
        params: Value,
        timeout: Duration,
    ) -> Result<Value, ErrorObject> {
        let provider = self.provider(methods::WEB_SEARCH)?;
        let req = SearchRequest::parse(params, max_results(ctx))?;
        if req.advanced && !ctx.claims.web_advanced.unwrap_or(false) {
            return Err(codes::WEB_NOT_GRANTED.error(
                "search_depth \"advanced\" needs web_grant.allowAdvanced, which this user has not granted",
            ));
        }
        let (raw, quota_consumed) = self.ask(ctx, provider, &req.query, timeout).await?;
        let results = search::web_hits(raw, &req.include, &req.exclude, req.max_results);
        // SearXNG has one tier: an advanced request is served (and billed) as basic, and says so.
        to_value(&SearchResult {
            results,
            provider_tier: wire::TIER_BASIC.to_owned(),
            quota_consumed,
        })
    }

    async fn image_search(
        &self,
        ctx: &CallContext,
        params: Value,
        timeout: Duration,
    ) -> Result<Value, ErrorObject> {
        let provider = self.provider(methods::WEB_IMAGE_SEARCH)?;
        let (query, filter, max) = parse_image_search(params, max_results(ctx))?;
        let (raw, quota_consumed) = self.ask(ctx, provider, &query, timeout).await?;
        let results = search::image_hits(raw, filter, max);
        to_value(&ImageSearchResult {
            results,
            quota_consumed,
        })
    }
}

fn to_value<T: serde::Serialize>(v: &T) -> Result<Value, ErrorObject> {
    serde_json::to_value(v).map_err(|_| codes::WEB_PROVIDER_ERROR.error("the answer could not be encoded"))
}

/// A failed image download as the call's error, with the page error's name in `data.error`.
fn image_error(e: &fetch::PageError) -> ErrorObject {
    let code = match e {
        fetch::PageError::Timeout => codes::WEB_TIMEOUT,
        fetch::PageError::Status(_) | fetch::PageError::Unreachable => codes::WEB_PROVIDER_ERROR,
        fetch::PageError::Blocked(_) | fetch::PageError::Parse | fetch::PageError::TooLarge => {
            codes::WEB_INVALID_REQUEST
        }
    };
    let name = e.name();
    code.error_with(
        format!("the image could not be fetched: {name}"),
        Map::from_iter([("error".to_owned(), Value::from(name))]),
    )
}

/// The image type of `bytes` by its magic bytes: (MIME type, extension).
fn sniff_image(bytes: &[u8]) -> Option<(&'static str, &'static str)> {
    if bytes.starts_with(&[0xff, 0xd8, 0xff]) {
        Some(("image/jpeg", "jpg"))
    } else if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
        Some(("image/png", "png"))
    } else if bytes.starts_with(b"GIF87a") || bytes.starts_with(b"GIF89a") {
        Some(("image/gif", "gif"))
    } else if bytes.len() >= 12 && bytes.starts_with(b"RIFF") && &bytes[8..12] == b"WEBP" {
        Some(("image/webp", "webp"))
    } else {
        None
    }
}

fn provider_error(e: search::ProviderError) -> ErrorObject {
    match e {
        search::ProviderError::Timeout => codes::WEB_TIMEOUT.error(e.to_string()),
        other => codes::WEB_PROVIDER_ERROR.error(other.to_string()),
    }
}

/// The grant's `maxResultsPerCall`, within the host's cap.
fn max_results(ctx: &CallContext) -> usize {
    ctx.claims
        .max_results
        .map_or(WEB_MAX_RESULTS_PER_CALL, |m| {
            (m as usize).min(WEB_MAX_RESULTS_PER_CALL)
        })
        .max(1)
}

fn invalid(message: impl Into<String>) -> ErrorObject {
    codes::WEB_INVALID_REQUEST.error(message)
}

/// A positive integer param, or the error naming it.
fn positive(v: Option<&Value>, name: &str) -> Result<Option<u64>, ErrorObject> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .filter(|n| *n > 0)
            .map(Some)
            .ok_or_else(|| invalid(format!("{name} must be a positive integer"))),
    }
}

/// A string param from a fixed set, or the error naming the set.
fn one_of(
    v: Option<&Value>,
    name: &str,
    allowed: &[&'static str],
) -> Result<Option<&'static str>, ErrorObject> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => allowed
            .iter()
            .find(|a| **a == s.as_str())
            .copied()
            .map(Some)
            .ok_or_else(|| invalid(format!("{name} must be one of {}", allowed.join(", ")))),
        Some(_) => Err(invalid(format!("{name} must be one of {}", allowed.join(", ")))),
    }
}

fn query_text(v: &Value) -> Result<String, ErrorObject> {
    let q = v
        .as_str()
        .map(str::trim)
        .filter(|q| !q.is_empty())
        .ok_or_else(|| invalid("query must be a non-empty string"))?;
    if q.chars().count() > MAX_QUERY_CHARS {
        return Err(invalid(format!(
            "query is longer than {MAX_QUERY_CHARS} characters"
        )));
    }
    Ok(q.to_owned())
}

/// `max_results`: absent → `default`; outside 1 … `cap` refused (spec: "never silently truncated").
fn result_count(v: Option<&Value>, default: usize, cap: usize) -> Result<usize, ErrorObject> {
    match positive(v, "max_results")? {
        None => Ok(default.min(cap)),
        Some(n) if usize::try_from(n).is_ok_and(|n| n <= cap) => Ok(usize::try_from(n).unwrap_or(cap)),
        Some(_) => Err(invalid(format!("max_results must be 1–{cap}"))),
    }
}

fn parse<T: serde::de::DeserializeOwned>(params: Value, shape: &str) -> Result<T, ErrorObject> {
    serde_json::from_value(params).map_err(|_| invalid(format!("params must be {shape}")))
}

/// A validated `web/fetch`.
#[derive(Debug)]
struct FetchRequest {
    urls: Vec<String>,
    format: html::Format,
    max_chars: usize,
    page_timeout: Duration,
}

impl FetchRequest {
    fn parse(params: Value, call_timeout: Duration) -> Result<FetchRequest, ErrorObject> {
        let p: FetchParams = parse(
            params,
            "{urls: [string] (1–10), format?, max_chars?, timeout_ms?}",
        )?;
        let urls: Vec<String> = match &p.urls {
            Value::Array(items) => items
                .iter()
                .map(|u| u.as_str().map(str::to_owned))
                .collect::<Option<_>>()
                .ok_or_else(|| invalid("urls must be strings"))?,
            _ => return Err(invalid("urls must be an array of 1–10 URLs")),
        };
        if urls.is_empty() || urls.len() > WEB_FETCH_MAX_URLS {
            return Err(invalid(format!("urls must hold 1–{WEB_FETCH_MAX_URLS} URLs")));
        }
        let format = match one_of(
            p.format.as_ref(),
            "format",
            &[wire::FORMAT_MARKDOWN, wire::FORMAT_TEXT],
        )? {
            Some(wire::FORMAT_TEXT) => html::Format::Text,
            _ => html::Format::Markdown,
        };
        let max_chars =
            positive(p.max_chars.as_ref(), "max_chars")?.map_or(WEB_FETCH_MAX_CHARS_PER_PAGE, |n| {
                usize::try_from(n)
                    .unwrap_or(usize::MAX)
                    .min(WEB_FETCH_MAX_CHARS_PER_PAGE)
            });
        let page_timeout = positive(p.timeout_ms.as_ref(), "timeout_ms")?
            .map_or(WEB_FETCH_DEFAULT_PAGE_TIMEOUT, Duration::from_millis)
            .min(call_timeout);
        Ok(FetchRequest {
            urls,
            format,
            max_chars,
            page_timeout,
        })
    }
}

/// A validated `web/search`.
#[derive(Debug)]
struct SearchRequest {
    query: search::Query,
    advanced: bool,
    max_results: usize,
    include: Vec<String>,
    exclude: Vec<String>,
}

fn domains(v: Option<&Value>, name: &str) -> Result<Vec<String>, ErrorObject> {
    let bad = || {
        invalid(format!(
            "{name} must be an array of at most {MAX_DOMAINS} domain names"
        ))
    };
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) if items.len() <= MAX_DOMAINS => items
            .iter()
            .map(|d| {
                d.as_str()
                    .map(str::trim)
                    .filter(|d| {
                        !d.is_empty()
                            && d.len() <= 253
                            && d.chars()
                                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '*'))
                    })
                    .map(str::to_owned)
                    .ok_or_else(bad)
            })
            .collect(),
        Some(_) => Err(bad()),
    }
}

fn region(v: Option<&Value>) -> Result<Option<String>, ErrorObject> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(r))
            if (2..=16).contains(&r.len())
                && r.chars().all(|c| c.is_ascii_alphabetic() || c == '-' || c == '_') =>
        {
            Ok(Some(r.replace('_', "-")))
        }
        Some(_) => Err(invalid(
            "region must be a language or locale code such as \"en\" or \"en-US\"",
        )),
    }
}

impl SearchRequest {
    fn parse(params: Value, cap: usize) -> Result<SearchRequest, ErrorObject> {
        let p: SearchParams = parse(
            params,
            "{query, max_results?, search_depth?, topic?, time_range?, region?, include_domains?, exclude_domains?}",
        )?;
        let q = query_text(&p.query)?;
        let max_results = result_count(p.max_results.as_ref(), cap, cap)?;
        let advanced = one_of(
            p.search_depth.as_ref(),
            "search_depth",
            &[wire::TIER_BASIC, wire::TIER_ADVANCED],
        )? == Some(wire::TIER_ADVANCED);
        let category = match one_of(p.topic.as_ref(), "topic", &["general", "news"])? {
            Some("news") => "news",
            _ => "general",
        };
        let time_range = one_of(
            p.time_range.as_ref(),
            "time_range",
            &["day", "week", "month", "year"],
        )?;
        Ok(SearchRequest {
            query: search::Query {
                q,
                category,
                time_range: time_range.map(str::to_owned),
                language: region(p.region.as_ref())?,
                safesearch: 1,
            },
            advanced,
            max_results,
            include: domains(p.include_domains.as_ref(), "include_domains")?,
            exclude: domains(p.exclude_domains.as_ref(), "exclude_domains")?,
        })
    }
}

/// A validated `web/image_search`: the query (safe search forced strict), the filters and the result count.
fn parse_image_search(
    params: Value,
    cap: usize,
) -> Result<(search::Query, search::ImageFilter, usize), ErrorObject> {
    let p: ImageSearchParams = parse(params, "{query, max_results?, min_width?, min_height?, aspect?}")?;
    match &p.safe_search {
        None | Some(Value::Null) | Some(Value::Bool(true)) => {}
        Some(_) => {
            return Err(invalid(
                "safe search is forced on this host: safe_search may only be true",
            ));
        }
    }
    let q = query_text(&p.query)?;
    let max = result_count(p.max_results.as_ref(), WEB_IMAGE_SEARCH_DEFAULT_RESULTS, cap)?;
    let aspect = match one_of(p.aspect.as_ref(), "aspect", &["any", "wide", "tall", "square"])? {
        Some("wide") => Some(search::Aspect::Wide),
        Some("tall") => Some(search::Aspect::Tall),
        Some("square") => Some(search::Aspect::Square),
        _ => None,
    };
    let filter = search::ImageFilter {
        min_width: positive(p.min_width.as_ref(), "min_width")?,
        min_height: positive(p.min_height.as_ref(), "min_height")?,
        aspect,
    };
    Ok((
        search::Query {
            q,
            category: "images",
            time_range: None,
            language: None,
            safesearch: 2,
        },
        filter,
        max,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fetch_params_are_checked_and_max_chars_clamped() {
        let t = Duration::from_secs(60);
        let ok = FetchRequest::parse(serde_json::json!({"urls": ["http://a.example/"]}), t).expect("minimal");
        assert_eq!(ok.max_chars, 8000);
        assert_eq!(ok.format, html::Format::Markdown);
        assert_eq!(ok.page_timeout, Duration::from_secs(15));
        let clamped = FetchRequest::parse(
            serde_json::json!({"urls": ["x"], "max_chars": 100_000, "format": "text", "timeout_ms": 90_000}),
            Duration::from_secs(20),
        )
        .expect("clamped");
        assert_eq!(clamped.max_chars, 8000);
        assert_eq!(clamped.format, html::Format::Text);
        assert_eq!(
            clamped.page_timeout,
            Duration::from_secs(20),
            "never beyond the call"
        );
        let ten: Vec<String> = (0..10).map(|i| format!("http://e.example/{i}")).collect();
        assert!(FetchRequest::parse(serde_json::json!({ "urls": ten }), t).is_ok());
        for bad in [
            serde_json::json!({}),
            serde_json::json!({"urls": []}),
            serde_json::json!({"urls": "http://a.example/"}),
            serde_json::json!({"urls": [1]}),
            serde_json::json!({"urls": (0..11).map(|i| format!("http://e.example/{i}")).collect::<Vec<_>>()}),
            serde_json::json!({"urls": ["x"], "format": "html"}),
            serde_json::json!({"urls": ["x"], "max_chars": 0}),
            serde_json::json!({"urls": ["x"], "max_chars": -1}),
            serde_json::json!({"urls": ["x"], "timeout_ms": "soon"}),
            serde_json::json!(["x"]),
        ] {
            let e = FetchRequest::parse(bad.clone(), t).expect_err(&bad.to_string());
            assert_eq!(e.code, -32524, "{bad}");
        }
    }

    #[test]
    fn search_params_are_refused_out_of_range_never_truncated() {
        let ok = SearchRequest::parse(
            serde_json::json!({"query": " cats ", "max_results": 10, "topic": "news", "time_range": "week",
                "region": "en_US", "include_domains": ["example.org"], "search_depth": "advanced"}),
            10,
        )
        .expect("valid");
        assert_eq!(ok.query.q, "cats");
        assert_eq!(ok.query.category, "news");
        assert_eq!(ok.query.language.as_deref(), Some("en-US"));
        assert!(ok.advanced);
        assert_eq!(ok.max_results, 10);
        assert_eq!(
            SearchRequest::parse(serde_json::json!({"query": "x"}), 4)
                .expect("cap")
                .max_results,
            4
        );
        for bad in [
            serde_json::json!({}),
            serde_json::json!({"query": ""}),
            serde_json::json!({"query": "x".repeat(401)}),
            serde_json::json!({"query": "x", "max_results": 11}),
            serde_json::json!({"query": "x", "max_results": 0}),
            serde_json::json!({"query": "x", "topic": "sports"}),
            serde_json::json!({"query": "x", "time_range": "hour"}),
            serde_json::json!({"query": "x", "search_depth": "deep"}),
            serde_json::json!({"query": "x", "region": "en US; drop"}),
            serde_json::json!({"query": "x", "include_domains": "example.org"}),
            serde_json::json!({"query": "x", "exclude_domains": ["a b"]}),
        ] {
            let e = SearchRequest::parse(bad.clone(), 10).expect_err(&bad.to_string());
            assert_eq!(e.code, -32524, "{bad}");
        }
        assert_eq!(
            SearchRequest::parse(serde_json::json!({"query": "x", "max_results": 5}), 4)
                .expect_err("over the grant")
                .code,
            -32524
        );
    }

    #[test]
    fn images_are_known_by_their_magic_bytes() {
        assert_eq!(sniff_image(b"\xff\xd8\xff\xe0rest"), Some(("image/jpeg", "jpg")));
        assert_eq!(sniff_image(b"\x89PNG\r\n\x1a\nIHDR"), Some(("image/png", "png")));
        assert_eq!(sniff_image(b"GIF89a..."), Some(("image/gif", "gif")));
        assert_eq!(sniff_image(b"RIFF\0\0\0\0WEBPVP8 "), Some(("image/webp", "webp")));
        for other in [
            &b"<svg xmlns='http://www.w3.org/2000/svg'/>"[..],
            b"RIFF\0\0\0\0WAVE",
            b"\x89PN",
            b"",
        ] {
            assert_eq!(sniff_image(other), None);
        }
    }

    #[test]
    fn image_search_forces_safe_search() {
        let (q, _, max) = parse_image_search(serde_json::json!({"query": "cats"}), 10).expect("valid");
        assert_eq!((q.category, q.safesearch, max), ("images", 2, 8));
        assert!(parse_image_search(serde_json::json!({"query": "cats", "safe_search": true}), 10).is_ok());
        for bad in [
            serde_json::json!({"query": "cats", "safe_search": false}),
            serde_json::json!({"query": "cats", "safe_search": "off"}),
            serde_json::json!({"query": "cats", "aspect": "round"}),
            serde_json::json!({"query": "cats", "min_width": -5}),
            serde_json::json!({"query": "cats", "max_results": 11}),
        ] {
            assert_eq!(
                parse_image_search(bad.clone(), 10)
                    .expect_err(&bad.to_string())
                    .code,
                -32524,
                "{bad}"
            );
        }
    }
}
