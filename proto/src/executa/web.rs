//! `web/search`, `web/fetch`, `web/image_search`, `web/image_fetch` (spec §8.9): params and results as plugins
//! send and read them, and the per-item error names of `web/fetch`. The numeric codes are
//! [`super::reverse::web`]; the numbers (8 000 chars, 256 KB, 10 URLs, 5 redirects, ports) are
//! [`crate::limits`]'s `WEB_*`.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `web/search` params. Numbers are kept as JSON values so that out-of-range or mistyped ones are refused with
/// `-32524` by the host's validation rather than by the parser.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct SearchParams {
    /// The query (non-empty).
    #[serde(default)]
    pub query: Value,
    /// Results wanted, 1 … `maxResultsPerCall` (out of range: refused, never truncated).
    #[serde(default, alias = "maxResults")]
    pub max_results: Option<Value>,
    /// `"basic"` (default) or `"advanced"` (needs the grant's `allowAdvanced`).
    #[serde(default, alias = "searchDepth")]
    pub search_depth: Option<Value>,
    /// `"general"` (default) or `"news"`.
    #[serde(default)]
    pub topic: Option<Value>,
    /// `"day"`, `"week"`, `"month"` or `"year"`.
    #[serde(default, alias = "timeRange")]
    pub time_range: Option<Value>,
    /// A region / language hint (e.g. `"en-US"`).
    #[serde(default)]
    pub region: Option<Value>,
    /// Only results from these sites.
    #[serde(default, alias = "includeDomains")]
    pub include_domains: Option<Value>,
    /// No results from these sites.
    #[serde(default, alias = "excludeDomains")]
    pub exclude_domains: Option<Value>,
}

/// One `web/search` result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SearchHit {
    /// The page title.
    pub title: String,
    /// The page URL.
    pub url: String,
    /// A short extract.
    pub snippet: String,
    /// The host name of `url`.
    pub site: String,
    /// Publication date as the provider gave it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub published_at: Option<String>,
    /// The provider's relevance score.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub score: Option<f64>,
}

/// The `web/search` result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SearchResult {
    /// The results, best first.
    pub results: Vec<SearchHit>,
    /// The tier that actually ran: [`TIER_BASIC`] or [`TIER_ADVANCED`].
    pub provider_tier: String,
    /// Compute units charged to the user's daily pool.
    pub quota_consumed: u64,
}

/// `provider_tier` of a basic search.
pub const TIER_BASIC: &str = "basic";
/// `provider_tier` of an advanced search.
pub const TIER_ADVANCED: &str = "advanced";

/// `web/image_search` params.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct ImageSearchParams {
    /// The query (non-empty).
    #[serde(default)]
    pub query: Value,
    /// Results wanted, 1 … `maxResultsPerCall` (default 8).
    #[serde(default, alias = "maxResults")]
    pub max_results: Option<Value>,
    /// Smallest width, pixels.
    #[serde(default, alias = "minWidth")]
    pub min_width: Option<Value>,
    /// Smallest height, pixels.
    #[serde(default, alias = "minHeight")]
    pub min_height: Option<Value>,
    /// `"any"`, `"wide"`, `"tall"` or `"square"`.
    #[serde(default)]
    pub aspect: Option<Value>,
    /// Safe search is forced: `false` is refused.
    #[serde(default, alias = "safeSearch")]
    pub safe_search: Option<Value>,
}

/// One `web/image_search` result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImageHit {
    /// The image itself.
    pub image_url: String,
    /// A thumbnail.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thumbnail_url: Option<String>,
    /// The page the image is on.
    pub source_url: String,
    /// Its title.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    /// Width, pixels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub width: Option<u64>,
    /// Height, pixels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub height: Option<u64>,
    /// MIME type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mime_type: Option<String>,
    /// Best-effort licence text (no warranty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub license_hint: Option<String>,
}

/// The `web/image_search` result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImageSearchResult {
    /// The results.
    pub results: Vec<ImageHit>,
    /// Compute units charged.
    pub quota_consumed: u64,
}

/// `web/fetch` params.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct FetchParams {
    /// 1 … 10 absolute `http`/`https` URLs.
    #[serde(default)]
    pub urls: Value,
    /// [`FORMAT_MARKDOWN`] (default) or [`FORMAT_TEXT`].
    #[serde(default)]
    pub format: Option<Value>,
    /// Characters of content per page, clamped to 8 000.
    #[serde(default, alias = "maxChars")]
    pub max_chars: Option<Value>,
    /// Per-page timeout, ms (bounded by the call's own deadline).
    #[serde(default, alias = "timeoutMs")]
    pub timeout_ms: Option<Value>,
}

/// `format` of extracted content: Markdown-ish (headings, list items, links).
pub const FORMAT_MARKDOWN: &str = "markdown";
/// `format` of extracted content: plain text.
pub const FORMAT_TEXT: &str = "text";

/// One `web/fetch` page: `ok` with content, or `ok: false` with [`fetch_errors`]' name (per-item failure
/// isolation: same length and order as `urls`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FetchedPage {
    /// The URL as asked.
    pub url: String,
    /// Where it ended after redirects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_url: Option<String>,
    /// Whether it was fetched.
    pub ok: bool,
    /// The document title.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    /// The extracted content.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// Whether `content` was cut at `max_chars`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub truncated: Option<bool>,
    /// Why it was not fetched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The `web/fetch` result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FetchResult {
    /// One per URL, in order.
    pub pages: Vec<FetchedPage>,
    /// Compute units charged (pages fetched).
    pub quota_consumed: u64,
}

/// `web/image_fetch` params.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct ImageFetchParams {
    /// One absolute `http`/`https` URL of an image.
    #[serde(default)]
    pub url: Value,
    /// The largest image accepted, bytes (default 5 MiB, at most 20 MiB).
    #[serde(default, alias = "maxBytes")]
    pub max_bytes: Option<Value>,
    /// What the image is for (free text, at most 64 characters; not interpreted).
    #[serde(default)]
    pub purpose: Option<Value>,
}

/// The `web/image_fetch` result: a reference to the stored image, never its bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImageFetchResult {
    /// Where it is stored (the upload key).
    pub path: String,
    /// A signed download link, valid 30 minutes.
    pub get_url: String,
    /// From the image's magic bytes: `image/jpeg`, `image/png`, `image/webp` or `image/gif`.
    pub mime_type: String,
    /// Its size.
    pub bytes_size: u64,
    /// SHA-256 of its bytes, lower-case hex.
    pub sha256: String,
    /// The URL as asked.
    pub source_url: String,
    /// Where it was found after redirects.
    pub final_url: String,
    /// Compute units charged.
    pub quota_consumed: u64,
}

/// The `error` of a page that failed (spec §8.9).
pub mod fetch_errors {
    /// The URL, an address it resolved to, or a redirect is outside the SSRF policy.
    pub const SSRF_BLOCKED: &str = "SSRF_BLOCKED";
    /// The page did not arrive in time.
    pub const TIMEOUT: &str = "TIMEOUT";
    /// Not a URL, not text, or not decodable.
    pub const PARSE_FAILED: &str = "PARSE_FAILED";
    /// The body is longer than 256 KB.
    pub const TOO_LARGE: &str = "TOO_LARGE";
    /// The answer's 256 KB are spent by the pages before this one.
    pub const RESPONSE_BUDGET_EXCEEDED: &str = "RESPONSE_BUDGET_EXCEEDED";
    /// The page could not be reached (connection refused or reset, TLS failure, too many redirects).
    pub const FETCH_FAILED: &str = "FETCH_FAILED";

    /// `HTTP_<status>` for a non-2xx answer.
    pub fn http_status(status: u16) -> String {
        format!("HTTP_{status}")
    }
}
