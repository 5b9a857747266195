//! The native page fetcher of `web/fetch` (spec §8.9): one URL → one [`FetchedPage`], never an error (per-item
//! failure isolation), under the SSRF policy of [`super::ssrf`].
//!
//! Each hop: the URL is vetted (scheme, port, one lookup, every address checked), then requested through a
//! client that can reach only the vetted addresses (they are pinned for the name, and its resolver refuses
//! every other name), with no proxy and no automatic redirects. A redirect is a new hop, vetted again; the
//! sixth is refused. The body is read up to [`WEB_FETCH_MAX_BODY_BYTES`] and no further (`TOO_LARGE`), then
//! turned into text ([`super::html`] for HTML; text types as they are; anything else `PARSE_FAILED`) and cut at
//! `max_chars` (`truncated`). Nothing of the page — its URL, headers or body — is logged.

use std::sync::Arc;
use std::time::Duration;

use fleet_proto::executa::web::{FetchedPage, fetch_errors};
use fleet_proto::limits::{WEB_FETCH_MAX_BODY_BYTES, WEB_MAX_REDIRECTS};
use reqwest::Url;
use reqwest::header::{ACCEPT, CONTENT_TYPE, LOCATION};

use super::html::{self, Format};
use super::ssrf::{Blocked, Resolve, SsrfPolicy, VetError, Vetted};

/// The `User-Agent` of fetches.
const USER_AGENT: &str = concat!("cloud-agents-web-fetch/", env!("CARGO_PKG_VERSION"));
/// The longest URL accepted (longer: `PARSE_FAILED`).
const MAX_URL_CHARS: usize = 4096;

/// What one page fetch needs besides the URL.
#[derive(Debug, Clone, Copy)]
pub struct PageOptions {
    /// Markdown or text.
    pub format: Format,
    /// Characters of content kept.
    pub max_chars: usize,
    /// The whole page (every hop and the body) must arrive within this.
    pub timeout: Duration,
}

/// Why a page failed (the item's `error`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PageError {
    /// `SSRF_BLOCKED`.
    #[error("SSRF_BLOCKED")]
    Blocked(Blocked),
    /// `TIMEOUT`.
    #[error("TIMEOUT")]
    Timeout,
    /// `HTTP_<status>`.
    #[error("HTTP_{0}")]
    Status(u16),
    /// `PARSE_FAILED`.
    #[error("PARSE_FAILED")]
    Parse,
    /// `TOO_LARGE`.
    #[error("TOO_LARGE")]
    TooLarge,
    /// `FETCH_FAILED`: unreachable, unresolvable, TLS.
    #[error("FETCH_FAILED")]
    Unreachable,
}

impl PageError {
    /// The item's `error` string.
    pub fn name(&self) -> String {
        match self {
            PageError::Blocked(_) => fetch_errors::SSRF_BLOCKED.to_owned(),
            PageError::Timeout => fetch_errors::TIMEOUT.to_owned(),
            PageError::Status(s) => fetch_errors::http_status(*s),
            PageError::Parse => fetch_errors::PARSE_FAILED.to_owned(),
            PageError::TooLarge => fetch_errors::TOO_LARGE.to_owned(),
            PageError::Unreachable => fetch_errors::FETCH_FAILED.to_owned(),
        }
    }
}

/// A fetched page, before the answer's budget is applied.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Page {
    final_url: String,
    title: Option<String>,
    content: String,
    truncated: bool,
}

/// The fetcher (one per services instance).
#[derive(Debug, Clone)]
pub struct Fetcher {
    policy: Arc<SsrfPolicy>,
    resolver: Arc<dyn Resolve>,
    connect_timeout: Duration,
}

impl Fetcher {
    /// A fetcher under `policy`, looking names up with `resolver`.
    pub fn new(policy: SsrfPolicy, resolver: Arc<dyn Resolve>) -> Fetcher {
        Fetcher {
            policy: Arc::new(policy),
            resolver,
            connect_timeout: Duration::from_secs(10),
        }
    }

    /// Fetches `url`: always a page, `ok` or with its error.
    pub async fn page(&self, url: &str, options: PageOptions) -> FetchedPage {
        let outcome = match tokio::time::timeout(options.timeout, self.fetch(url, options)).await {
            Ok(outcome) => outcome,
            Err(_) => Err(PageError::Timeout),
        };
        match outcome {
            Ok(page) => FetchedPage {
                url: url.to_owned(),
                final_url: Some(page.final_url),
                ok: true,
                title: page.title,
                content: Some(page.content),
                truncated: Some(page.truncated),
                error: None,
            },
            Err(e) => {
                if let PageError::Blocked(why) = &e {
                    tracing::info!(
                        rule = why.as_str(),
                        "web/fetch: a URL was refused by the fetch policy"
                    );
                }
                FetchedPage {
                    url: url.to_owned(),
                    ok: false,
                    error: Some(e.name()),
                    ..FetchedPage::default()
                }
            }
        }
    }

    async fn fetch(&self, raw: &str, options: PageOptions) -> Result<Page, PageError> {
        let (url, response) = self.get(raw).await?;
        let content_type = response
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_ascii_lowercase);
        let body = read_capped(response, WEB_FETCH_MAX_BODY_BYTES).await?;
        let (title, text) = to_text(content_type.as_deref(), &body, options.format)?;
        let (content, truncated) = super::html::cut(&text, options.max_chars);
        Ok(Page {
            final_url: url.to_string(),
            title,
            content,
            truncated,
        })
    }

    /// The body of `raw` (at most `cap` bytes, else `TOO_LARGE`) and where it was found, within `timeout`: the
    /// download of `web/image_fetch`, under the same policy.
    pub async fn bytes(
        &self,
        raw: &str,
        cap: usize,
        timeout: Duration,
    ) -> Result<(String, Vec<u8>), PageError> {
        let work = async {
            let (url, response) = self.get(raw).await?;
            Ok((url.to_string(), read_capped(response, cap).await?))
        };
        tokio::time::timeout(timeout, work)
            .await
            .unwrap_or(Err(PageError::Timeout))
            .inspect_err(|e| {
                if let PageError::Blocked(why) = e {
                    tracing::info!(
                        rule = why.as_str(),
                        "web/image_fetch: a URL was refused by the fetch policy"
                    );
                }
            })
    }

    /// The successful response to `raw` after at most [`WEB_MAX_REDIRECTS`] redirects, each hop vetted.
    async fn get(&self, raw: &str) -> Result<(Url, reqwest::Response), PageError> {
        if raw.chars().count() > MAX_URL_CHARS {
            return Err(PageError::Parse);
        }
        let mut url = Url::parse(raw.trim()).map_err(|_| PageError::Parse)?;
        let mut redirects = 0;
        loop {
            let vetted = self
                .policy
                .vet(&url, self.resolver.as_ref())
                .await
                .map_err(|e| match e {
                    VetError::Blocked(b) => PageError::Blocked(b),
                    VetError::Resolve(_) => PageError::Unreachable,
                })?;
            let response = self.request(&url, &vetted).await?;
            let status = response.status();
            if status.is_redirection()
                && let Some(location) = response.headers().get(LOCATION)
            {
                if redirects == WEB_MAX_REDIRECTS {
                    return Err(PageError::Blocked(Blocked::TooManyRedirects));
                }
                redirects += 1;
                let location = location.to_str().map_err(|_| PageError::Parse)?;
                url = url.join(location).map_err(|_| PageError::Parse)?;
                continue;
            }
            if !status.is_success() {
                return Err(PageError::Status(status.as_u16()));
            }
            return Ok((url, response));
        }
    }

    /// One request to the vetted addresses of `url`, without following redirects.
    async fn request(&self, url: &Url, vetted: &Vetted) -> Result<reqwest::Response, PageError> {
        let client = vetted
            .pin(
                reqwest::Client::builder()
                    .connect_timeout(self.connect_timeout)
                    .user_agent(USER_AGENT),
            )
            .build()
            .map_err(|_| PageError::Unreachable)?;
        client
            .get(url.clone())
            .header(
                ACCEPT,
                "text/html,application/xhtml+xml,text/plain;q=0.9,*/*;q=0.1",
            )
            .send()
            .await
            .map_err(|e| {
                if e.is_timeout() {
                    PageError::Timeout
                } else {
                    PageError::Unreachable
                }
            })
    }
}

/// The body, or `TOO_LARGE` as soon as it would pass `cap` (nothing more is read): the one body-cap reader of
/// the host's fetches (`image/*` reads its upstream's own image URLs through it too).
pub(crate) async fn read_capped(mut response: reqwest::Response, cap: usize) -> Result<Vec<u8>, PageError> {
    if response
        .content_length()
        .is_some_and(|n| n > u64::try_from(cap).unwrap_or(u64::MAX))
    {
        return Err(PageError::TooLarge);
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(|e| {
        if e.is_timeout() {
            PageError::Timeout
        } else {
            PageError::Unreachable
        }
    })? {
        if body.len() + chunk.len() > cap {
            return Err(PageError::TooLarge);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// The title and text of a body of `content_type`.
fn to_text(
    content_type: Option<&str>,
    body: &[u8],
    format: Format,
) -> Result<(Option<String>, String), PageError> {
    let mime = content_type
        .and_then(|c| c.split(';').next())
        .map(str::trim)
        .unwrap_or("");
    let charset = content_type
        .and_then(|c| c.split(';').find_map(|p| p.trim().strip_prefix("charset=")))
        .map(|c| c.trim_matches('"'));
    let text = decode(body, charset)?;
    let html = match mime {
        "text/html" | "application/xhtml+xml" => true,
        "" => looks_like_html(&text),
        m if m.starts_with("text/") => false,
        "application/json" | "application/xml" | "application/rss+xml" | "application/atom+xml" => false,
        m if m.ends_with("+json") || m.ends_with("+xml") => false,
        _ => return Err(PageError::Parse),
    };
    if html {
        let e = html::extract(&text, format);
        Ok((e.title, e.text))
    } else {
        Ok((None, text.trim().to_owned()))
    }
}

/// Text from bytes: UTF-8 (the default), or Latin-1 when the charset says so; binary (NUL bytes) or
/// undecodable bodies are `PARSE_FAILED`.
fn decode(body: &[u8], charset: Option<&str>) -> Result<String, PageError> {
    if body.contains(&0) {
        return Err(PageError::Parse);
    }
    let latin1 = charset.is_some_and(|c| {
        matches!(
            c.to_ascii_lowercase().as_str(),
            "iso-8859-1" | "latin1" | "latin-1" | "windows-1252" | "us-ascii"
        )
    });
    if latin1 {
        return Ok(body.iter().map(|b| char::from(*b)).collect());
    }
    match std::str::from_utf8(body) {
        Ok(s) => Ok(s.trim_start_matches('\u{feff}').to_owned()),
        // Mostly text with a few bad bytes: replace them; mostly garbage: refuse.
        Err(_) => {
            let lossy = String::from_utf8_lossy(body);
            let bad = lossy
                .chars()
                .filter(|c| *c == char::REPLACEMENT_CHARACTER)
                .count();
            if bad * 20 > lossy.chars().count() {
                Err(PageError::Parse)
            } else {
                Ok(lossy.into_owned())
            }
        }
    }
}

fn looks_like_html(text: &str) -> bool {
    let head: String = text
        .trim_start()
        .chars()
        .take(512)
        .collect::<String>()
        .to_ascii_lowercase();
    head.starts_with("<!doctype html") || head.starts_with("<html") || head.contains("<body")
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use axum::extract::Path;
    use axum::http::{HeaderMap, StatusCode, header};
    use axum::response::IntoResponse;
    use axum::routing::get;
    use fleet_proto::limits::WEB_FETCH_MAX_CHARS_PER_PAGE;

    use super::super::ssrf::SystemResolver;
    use super::*;

    /// A page server on 127.0.0.1 (reachable only through the test-only exception) and a fetcher allowed to
    /// reach exactly it.
    async fn server() -> (Fetcher, String, tokio::task::JoinHandle<()>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr: SocketAddr = listener.local_addr().expect("addr");
        let html = |body: String| ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], body);
        let redirect = |to: String| (StatusCode::FOUND, [(header::LOCATION, to)]).into_response();
        let app =
            axum::Router::new()
                .route(
                    "/page",
                    get(move || async move { html("<title>Cats</title><p>Cats sleep.</p>".to_owned()) }),
                )
                .route(
                    "/hop/{n}",
                    get(move |Path(n): Path<u32>| async move {
                        if n == 0 {
                            html("<p>landed</p>".to_owned()).into_response()
                        } else {
                            redirect(format!("/hop/{}", n - 1))
                        }
                    }),
                )
                .route(
                    "/to/{target}",
                    get(move |Path(target): Path<String>| async move {
                        redirect(match target.as_str() {
                            "private" => "http://10.0.0.1/".to_owned(),
                            "metadata" => "http://169.254.169.254/latest/meta-data/".to_owned(),
                            "loopback" => "http://127.0.0.1:1/".to_owned(),
                            "v6-loopback" => format!("http://[::1]:{}/page", addr.port()),
                            "file" => "file:///etc/passwd".to_owned(),
                            _ => "/page".to_owned(),
                        })
                    }),
                )
                .route(
                    "/size/{n}",
                    get(|Path(n): Path<usize>| async move {
                        ([(header::CONTENT_TYPE, "text/plain")], "a".repeat(n))
                    }),
                )
                .route(
                    "/stream/{n}",
                    get(|Path(n): Path<usize>| async move {
                        // No Content-Length: the cap is found while reading.
                        let chunks = (0..n.div_ceil(1024)).map(move |i| {
                            Ok::<_, std::io::Error>(bytes::Bytes::from("b".repeat(1024.min(n - i * 1024))))
                        });
                        let mut headers = HeaderMap::new();
                        headers.insert(header::CONTENT_TYPE, "text/plain".parse().expect("value"));
                        (
                            headers,
                            axum::body::Body::from_stream(futures::stream::iter(chunks)),
                        )
                    }),
                )
                .route(
                    "/status/{code}",
                    get(|Path(code): Path<u16>| async move {
                        StatusCode::from_u16(code).unwrap_or(StatusCode::IM_A_TEAPOT)
                    }),
                )
                .route(
                    "/png",
                    get(|| async {
                        (
                            [(header::CONTENT_TYPE, "image/png")],
                            b"\x89PNG\r\n\x1a\n".to_vec(),
                        )
                    }),
                )
                .route("/never", get(std::future::pending::<String>));
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        let fetcher = Fetcher::new(SsrfPolicy::new(vec![addr]), Arc::new(SystemResolver));
        (fetcher, format!("http://{addr}"), task)
    }

    /// Resolves every name to `first` on its first lookup and to `then` on every later one, counting lookups.
    #[derive(Debug)]
    struct Rebinding {
        first: SocketAddr,
        then: SocketAddr,
        lookups: std::sync::atomic::AtomicUsize,
    }

    impl Resolve for Rebinding {
        fn resolve<'a>(&'a self, _host: &'a str, _port: u16) -> super::super::ssrf::ResolveFuture<'a> {
            let n = self.lookups.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let addr = if n == 0 { self.first } else { self.then };
            Box::pin(async move { Ok(vec![addr]) })
        }
    }

    #[tokio::test]
    async fn a_name_is_fetched_from_the_address_that_was_checked_and_never_looked_up_again() {
        let (plain, base, task) = server().await;
        drop(plain);
        let allowed: SocketAddr = base.trim_start_matches("http://").parse().expect("addr");
        // Between the check and the connect the name "moves" to the metadata address: the client must not
        // look it up again (the pinned, checked address is used).
        let resolver = Arc::new(Rebinding {
            first: allowed,
            then: "169.254.169.254:80".parse().expect("addr"),
            lookups: std::sync::atomic::AtomicUsize::new(0),
        });
        let f = Fetcher::new(SsrfPolicy::new(vec![allowed]), resolver.clone());
        let url = format!("http://pages.test:{}/page", allowed.port());
        let page = f.page(&url, options()).await;
        assert!(page.ok, "{page:?}");
        assert_eq!(page.title.as_deref(), Some("Cats"));
        assert_eq!(resolver.lookups.load(std::sync::atomic::Ordering::SeqCst), 1);
        // The next vet of the same name sees the new answer and refuses it.
        assert_eq!(
            f.page(&url, options()).await.error.as_deref(),
            Some("SSRF_BLOCKED")
        );
        task.abort();
    }

    fn options() -> PageOptions {
        PageOptions {
            format: Format::Markdown,
            max_chars: WEB_FETCH_MAX_CHARS_PER_PAGE,
            timeout: Duration::from_secs(30),
        }
    }

    async fn error_of(f: &Fetcher, url: &str) -> Option<String> {
        f.page(url, options()).await.error
    }

    #[tokio::test]
    async fn five_redirects_are_followed_and_the_sixth_is_refused() {
        let (f, base, task) = server().await;
        let five = f.page(&format!("{base}/hop/5"), options()).await;
        assert!(five.ok, "{five:?}");
        assert_eq!(five.final_url, Some(format!("{base}/hop/0")));
        assert_eq!(five.content.as_deref(), Some("landed"));
        assert_eq!(
            error_of(&f, &format!("{base}/hop/6")).await.as_deref(),
            Some("SSRF_BLOCKED")
        );
        task.abort();
    }

    #[tokio::test]
    async fn a_redirect_out_of_the_policy_is_refused() {
        let (f, base, task) = server().await;
        for target in ["private", "metadata", "loopback", "v6-loopback", "file"] {
            assert_eq!(
                error_of(&f, &format!("{base}/to/{target}")).await.as_deref(),
                Some("SSRF_BLOCKED"),
                "{target}"
            );
        }
        let ok = f.page(&format!("{base}/to/page"), options()).await;
        assert_eq!(ok.title.as_deref(), Some("Cats"));
        task.abort();
    }

    #[tokio::test]
    async fn a_body_of_256_kib_is_read_and_one_byte_more_is_too_large() {
        let (f, base, task) = server().await;
        let cap = WEB_FETCH_MAX_BODY_BYTES;
        for route in ["size", "stream"] {
            let exact = f.page(&format!("{base}/{route}/{cap}"), options()).await;
            assert!(exact.ok, "{route}: {:?}", exact.error);
            assert_eq!(
                exact.truncated,
                Some(true),
                "256 KiB of text is more than 8 000 characters"
            );
            assert_eq!(
                exact.content.map(|c| c.chars().count()),
                Some(WEB_FETCH_MAX_CHARS_PER_PAGE)
            );
            assert_eq!(
                error_of(&f, &format!("{base}/{route}/{}", cap + 1))
                    .await
                    .as_deref(),
                Some("TOO_LARGE"),
                "{route}"
            );
        }
        let short = f.page(&format!("{base}/size/8000"), options()).await;
        assert_eq!(
            short.truncated,
            Some(false),
            "exactly 8 000 characters are not cut"
        );
        task.abort();
    }

    #[tokio::test]
    async fn statuses_types_and_timeouts_are_per_page_errors() {
        let (f, base, task) = server().await;
        assert_eq!(
            error_of(&f, &format!("{base}/status/404")).await.as_deref(),
            Some("HTTP_404")
        );
        assert_eq!(
            error_of(&f, &format!("{base}/status/503")).await.as_deref(),
            Some("HTTP_503")
        );
        assert_eq!(
            error_of(&f, &format!("{base}/png")).await.as_deref(),
            Some("PARSE_FAILED")
        );
        assert_eq!(error_of(&f, "not a url").await.as_deref(), Some("PARSE_FAILED"));
        let quick = PageOptions {
            timeout: Duration::from_millis(200),
            ..options()
        };
        // The server never answers: the page times out, whatever the machine's speed.
        let slow = f.page(&format!("{base}/never"), quick).await;
        assert_eq!(slow.error.as_deref(), Some("TIMEOUT"));
        task.abort();
    }

    #[test]
    fn bodies_become_text_by_type() {
        let html = b"<html><title>T</title><p>Hello</p></html>";
        assert_eq!(
            to_text(Some("text/html; charset=utf-8"), html, Format::Text),
            Ok((Some("T".into()), "Hello".into()))
        );
        assert_eq!(
            to_text(None, html, Format::Text),
            Ok((Some("T".into()), "Hello".into())),
            "sniffed"
        );
        assert_eq!(
            to_text(Some("text/plain"), b"  plain <p>kept</p> ", Format::Text),
            Ok((None, "plain <p>kept</p>".into()))
        );
        assert_eq!(
            to_text(Some("application/json"), br#"{"a":1}"#, Format::Text),
            Ok((None, r#"{"a":1}"#.into()))
        );
        assert_eq!(
            to_text(Some("text/plain; charset=ISO-8859-1"), b"caf\xe9", Format::Text),
            Ok((None, "café".into()))
        );
        for (ct, body) in [
            (Some("image/png"), &b"\x89PNG\r\n"[..]),
            (Some("application/pdf"), b"%PDF-1.7"),
            (Some("application/octet-stream"), b"abc"),
            (Some("text/plain"), b"bin\0ary"),
            (Some("text/plain"), b"\xff\xfe\xfd\xfc\xfb"),
        ] {
            assert_eq!(to_text(ct, body, Format::Text), Err(PageError::Parse), "{ct:?}");
        }
    }

    #[test]
    fn item_errors_have_the_spec_names() {
        assert_eq!(PageError::Blocked(Blocked::Port).name(), "SSRF_BLOCKED");
        assert_eq!(PageError::Status(404).name(), "HTTP_404");
        assert_eq!(PageError::Timeout.name(), "TIMEOUT");
        assert_eq!(PageError::TooLarge.name(), "TOO_LARGE");
        assert_eq!(PageError::Parse.name(), "PARSE_FAILED");
    }
}
