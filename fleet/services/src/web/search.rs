//! `web/search` and `web/image_search` against a SearXNG-compatible JSON API (the self-hostable default of
//! issue 17): `GET {base_url}/search?q=…&format=json&categories=general|news|images&time_range=…&safesearch=…
//! &language=…`, answered with `{"results": [{url, title, content, publishedDate?, score?, img_src?,
//! thumbnail_src?, resolution?, img_format?}, …]}`.
//!
//! The provider is the operator's (configured, trusted, typically on a private address): it is not subject to
//! the fetch policy. Its answers are: mapped to the spec's shapes, results without an `http(s)` URL dropped,
//! `include_domains` / `exclude_domains` and the image size filters applied here (SearXNG has no portable
//! syntax for them), capped at `max_results`. A failed upstream is `-32523` with its HTTP status, never its
//! body; a slow one `-32525`.

use std::time::Duration;

use fleet_proto::executa::web::{ImageHit, SearchHit};
use reqwest::Url;
use reqwest::header::{AUTHORIZATION, HeaderValue};
use serde::Deserialize;

/// Longest snippet kept per result, characters.
const MAX_SNIPPET_CHARS: usize = 500;
/// Longest title kept per result, characters.
const MAX_TITLE_CHARS: usize = 300;
/// Largest provider answer read.
const MAX_ANSWER_BYTES: usize = 4 * 1024 * 1024;

/// Why the provider did not answer usefully.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProviderError {
    /// It did not answer in time.
    #[error("the search provider did not answer in time")]
    Timeout,
    /// It answered with a non-2xx status.
    #[error("the search provider answered HTTP {0}")]
    Status(u16),
    /// It could not be reached.
    #[error("the search provider could not be reached")]
    Unreachable,
    /// Its answer is not the JSON expected.
    #[error("the search provider's answer is not a SearXNG JSON result")]
    Malformed,
}

/// A search to run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Query {
    /// The text.
    pub q: String,
    /// SearXNG category: `general`, `news` or `images`.
    pub category: &'static str,
    /// `day`, `week`, `month`, `year`.
    pub time_range: Option<String>,
    /// SearXNG `language`.
    pub language: Option<String>,
    /// 0 (off), 1 (moderate), 2 (strict).
    pub safesearch: u8,
}

/// One result as SearXNG gives it (only the fields used).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct RawResult {
    #[serde(default)]
    url: Option<String>,
    #[serde(default)]
    title: Option<String>,
    #[serde(default)]
    content: Option<String>,
    #[serde(default, rename = "publishedDate")]
    published_date: Option<serde_json::Value>,
    #[serde(default)]
    score: Option<f64>,
    #[serde(default)]
    img_src: Option<String>,
    #[serde(default)]
    thumbnail_src: Option<String>,
    #[serde(default)]
    resolution: Option<String>,
    #[serde(default)]
    img_format: Option<String>,
    #[serde(default)]
    license: Option<String>,
}

#[derive(Debug, Deserialize)]
struct Answer {
    #[serde(default)]
    results: Vec<RawResult>,
}

/// The provider client.
#[derive(Debug, Clone)]
pub struct Provider {
    client: reqwest::Client,
    search_url: Url,
    key: Option<HeaderValue>,
    timeout: Duration,
}

impl Provider {
    /// A client of the provider at `base` (already checked), with its key and timeout.
    pub fn new(base: &Url, key: Option<HeaderValue>, timeout: Duration) -> Result<Provider, String> {
        let search_url = Url::parse(&format!("{}/search", base.as_str().trim_end_matches('/')))
            .map_err(|e| e.to_string())?;
        let client = reqwest::Client::builder()
            .connect_timeout(timeout.min(Duration::from_secs(10)))
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| e.to_string())?;
        Ok(Provider {
            client,
            search_url,
            key,
            timeout,
        })
    }

    /// The provider's own timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Runs `query` within `timeout`.
    pub async fn search(&self, query: &Query, timeout: Duration) -> Result<Vec<RawResult>, ProviderError> {
        let mut pairs = vec![
            ("q", query.q.clone()),
            ("format", "json".to_owned()),
            ("categories", query.category.to_owned()),
            ("safesearch", query.safesearch.to_string()),
            ("pageno", "1".to_owned()),
        ];
        if let Some(t) = &query.time_range {
            pairs.push(("time_range", t.clone()));
        }
        if let Some(l) = &query.language {
            pairs.push(("language", l.clone()));
        }
        let mut request = self.client.get(self.search_url.clone()).query(&pairs);
        if let Some(key) = &self.key {
            request = request.header(AUTHORIZATION, key.clone());
        }
        let run = async {
            let mut response = request.send().await.map_err(|e| {
                if e.is_timeout() {
                    ProviderError::Timeout
                } else {
                    ProviderError::Unreachable
                }
            })?;
            if !response.status().is_success() {
                return Err(ProviderError::Status(response.status().as_u16()));
            }
            let mut body = Vec::new();
            while let Some(chunk) = response.chunk().await.map_err(|_| ProviderError::Unreachable)? {
                if body.len() + chunk.len() > MAX_ANSWER_BYTES {
                    return Err(ProviderError::Malformed);
                }
                body.extend_from_slice(&chunk);
            }
            serde_json::from_slice::<Answer>(&body)
                .map(|a| a.results)
                .map_err(|_| ProviderError::Malformed)
        };
        tokio::time::timeout(timeout, run)
            .await
            .unwrap_or(Err(ProviderError::Timeout))
    }
}

/// Whether `host` is `domain` or one of its subdomains.
fn on_domain(host: &str, domain: &str) -> bool {
    let domain = domain
        .trim()
        .trim_start_matches("*.")
        .trim_end_matches('.')
        .to_ascii_lowercase();
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    !domain.is_empty() && (host == domain || host.ends_with(&format!(".{domain}")))
}

/// An `http(s)` URL's host.
fn web_host(url: &str) -> Option<String> {
    let u = Url::parse(url).ok()?;
    if !matches!(u.scheme(), "http" | "https") {
        return None;
    }
    u.host_str().map(str::to_owned)
}

fn clip(s: &str, max: usize) -> String {
    crate::web::html::cut(s.trim(), max).0
}

/// Web results: mapped, filtered by domain, at most `max`.
pub fn web_hits(raw: Vec<RawResult>, include: &[String], exclude: &[String], max: usize) -> Vec<SearchHit> {
    raw.into_iter()
        .filter_map(|r| {
            let url = r.url?;
            let site = web_host(&url)?;
            if !include.is_empty() && !include.iter().any(|d| on_domain(&site, d)) {
                return None;
            }
            if exclude.iter().any(|d| on_domain(&site, d)) {
                return None;
            }
            Some(SearchHit {
                title: clip(r.title.as_deref().unwrap_or(""), MAX_TITLE_CHARS),
                snippet: clip(r.content.as_deref().unwrap_or(""), MAX_SNIPPET_CHARS),
                site,
                url,
                published_at: r.published_date.and_then(|d| match d {
                    serde_json::Value::String(s) if !s.is_empty() => Some(s),
                    _ => None,
                }),
                score: r.score.filter(|s| s.is_finite()),
            })
        })
        .take(max)
        .collect()
}

/// Image shape filters of `web/image_search`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ImageFilter {
    /// Smallest width.
    pub min_width: Option<u64>,
    /// Smallest height.
    pub min_height: Option<u64>,
    /// `wide`, `tall`, `square` (`None`: any).
    pub aspect: Option<Aspect>,
}

/// An aspect filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Aspect {
    /// Width ≥ 1.2 × height.
    Wide,
    /// Height ≥ 1.2 × width.
    Tall,
    /// Within 20 % of square.
    Square,
}

impl ImageFilter {
    fn active(self) -> bool {
        self.min_width.is_some() || self.min_height.is_some() || self.aspect.is_some()
    }

    /// Whether an image of `(w, h)` passes (unknown sizes pass only when no filter is set).
    fn passes(self, size: Option<(u64, u64)>) -> bool {
        let Some((w, h)) = size else { return !self.active() };
        if self.min_width.is_some_and(|m| w < m) || self.min_height.is_some_and(|m| h < m) {
            return false;
        }
        // Ratios compared in integers: wide is w/h ≥ 1.2, tall h/w ≥ 1.2, square both below 1.2.
        let (w5, h5, w6, h6) = (
            w.saturating_mul(5),
            h.saturating_mul(5),
            w.saturating_mul(6),
            h.saturating_mul(6),
        );
        match self.aspect {
            None => true,
            Some(Aspect::Wide) => w5 >= h6,
            Some(Aspect::Tall) => h5 >= w6,
            Some(Aspect::Square) => w5 < h6 && h5 < w6,
        }
    }
}

/// `"1920x1080"`, `"1920 x 1080"`, `"1920×1080"` → (1920, 1080).
fn resolution(text: &str) -> Option<(u64, u64)> {
    let lower = text.to_ascii_lowercase();
    let (w, h) = lower.split_once(['x', '×'])?;
    Some((w.trim().parse().ok()?, h.trim().parse().ok()?))
}

fn mime_of(format: Option<&str>) -> Option<String> {
    let f = format?.trim().to_ascii_lowercase();
    let word = f.split_whitespace().next()?;
    let mime = match word {
        "jpeg" | "jpg" | "image/jpeg" => "image/jpeg",
        "png" | "image/png" => "image/png",
        "webp" | "image/webp" => "image/webp",
        "gif" | "image/gif" => "image/gif",
        _ => return None,
    };
    Some(mime.to_owned())
}

/// Image results: mapped, filtered by size and aspect, at most `max`.
pub fn image_hits(raw: Vec<RawResult>, filter: ImageFilter, max: usize) -> Vec<ImageHit> {
    raw.into_iter()
        .filter_map(|r| {
            let image_url = r.img_src.filter(|u| web_host(u).is_some())?;
            let source_url = r.url.filter(|u| web_host(u).is_some())?;
            let size = r.resolution.as_deref().and_then(resolution);
            if !filter.passes(size) {
                return None;
            }
            Some(ImageHit {
                image_url,
                thumbnail_url: r.thumbnail_src.filter(|u| web_host(u).is_some()),
                source_url,
                title: r
                    .title
                    .map(|t| clip(&t, MAX_TITLE_CHARS))
                    .filter(|t| !t.is_empty()),
                width: size.map(|s| s.0),
                height: size.map(|s| s.1),
                mime_type: mime_of(r.img_format.as_deref()),
                license_hint: r.license.map(|l| clip(&l, MAX_TITLE_CHARS)),
            })
        })
        .take(max)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(v: serde_json::Value) -> Vec<RawResult> {
        serde_json::from_value::<Answer>(v).expect("answer").results
    }

    #[test]
    fn web_results_are_mapped_filtered_and_capped() {
        let results = raw(serde_json::json!({"results": [
            {"url": "https://a.example.com/x", "title": " A ", "content": "alpha", "publishedDate": "2026-01-02", "score": 1.5},
            {"url": "ftp://b.example.com/", "title": "ftp dropped"},
            {"title": "no url dropped"},
            {"url": "https://news.example.org/y", "title": "B", "content": "beta", "publishedDate": null},
            {"url": "https://spam.example.net/z", "title": "C"},
        ]}));
        let hits = web_hits(results.clone(), &[], &["example.net".into()], 10);
        assert_eq!(hits.len(), 2);
        assert_eq!(hits[0].title, "A");
        assert_eq!(hits[0].site, "a.example.com");
        assert_eq!(hits[0].published_at.as_deref(), Some("2026-01-02"));
        assert_eq!(hits[0].score, Some(1.5));
        assert_eq!(hits[1].published_at, None);
        let only_org = web_hits(results.clone(), &["example.org".into()], &[], 10);
        assert_eq!(only_org.len(), 1);
        assert_eq!(web_hits(results, &[], &[], 1).len(), 1);
        assert!(!on_domain("badexample.org", "example.org"));
    }

    #[test]
    fn image_results_filter_by_size_and_aspect() {
        let results = raw(serde_json::json!({"results": [
            {"url": "https://s.example/1", "img_src": "https://i.example/1.jpg", "resolution": "1920x1080", "img_format": "JPEG"},
            {"url": "https://s.example/2", "img_src": "https://i.example/2.png", "resolution": "500 × 800", "img_format": "png"},
            {"url": "https://s.example/3", "img_src": "https://i.example/3.png", "resolution": "600x600"},
            {"url": "https://s.example/4", "img_src": "https://i.example/4.png"},
            {"url": "https://s.example/5", "img_src": "javascript:alert(1)"},
        ]}));
        let all = image_hits(results.clone(), ImageFilter::default(), 10);
        assert_eq!(all.len(), 4);
        assert_eq!(all[0].mime_type.as_deref(), Some("image/jpeg"));
        assert_eq!((all[0].width, all[0].height), (Some(1920), Some(1080)));
        let wide = ImageFilter {
            aspect: Some(Aspect::Wide),
            ..ImageFilter::default()
        };
        assert_eq!(image_hits(results.clone(), wide, 10).len(), 1);
        let tall = ImageFilter {
            aspect: Some(Aspect::Tall),
            ..ImageFilter::default()
        };
        assert_eq!(
            image_hits(results.clone(), tall, 10)[0].source_url,
            "https://s.example/2"
        );
        let square = ImageFilter {
            aspect: Some(Aspect::Square),
            ..ImageFilter::default()
        };
        assert_eq!(
            image_hits(results.clone(), square, 10)[0].source_url,
            "https://s.example/3"
        );
        let big = ImageFilter {
            min_width: Some(600),
            min_height: Some(600),
            aspect: None,
        };
        assert_eq!(image_hits(results, big, 10).len(), 2);
    }
}
