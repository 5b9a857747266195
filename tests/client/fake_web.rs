//! A fake web for the `web/*` tests, on one ephemeral port of 127.0.0.1 (no real search provider or web site
//! can exist here):
//!
//! * `GET /search` — a SearXNG-compatible JSON API (`q`, `format=json`, `categories`, `safesearch`, …): web
//!   results for `general`/`news`, image results for `images`. It records every request's query parameters
//!   and `Authorization`, and can answer with an error status (whose body carries [`UPSTREAM_SECRET`], which
//!   must never reach a plugin), with a body that is not JSON, or never.
//! * `GET /pages/…` — pages to fetch: `article` (HTML, title [`ARTICLE_TITLE`]), `emoji` (8 001 four-byte
//!   characters of text), `big` (a body over 256 KiB), `missing` (404), `to-loopback` (a redirect to
//!   `http://127.0.0.1:8080/`), `to-metadata` (a redirect to `http://169.254.169.254/`); images: `cat.png`
//!   ([`CAT_PNG`]), `cat.svg` (an SVG served as `image/png`), `to-cat` (a redirect to `cat.png`).
//!
//! Loopback is outside the fetch policy: the services reach this server only through `[web]
//! test_allow_addrs = ["<its address>"]`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use fleet_proto::util::lock;
use serde_json::json;

/// Text of the fake provider's error bodies: a plugin must never see it.
pub const UPSTREAM_SECRET: &str = "upstream-secret-body-7f3a";
/// `<title>` of `/pages/article`.
pub const ARTICLE_TITLE: &str = "All about cats";
/// The bytes of `/pages/cat.png` (a PNG signature and header; served as `image/png`).
pub const CAT_PNG: &[u8] = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR\0\0\0\x01\0\0\0\x01\x08\x06\0\0\0\x1f\x15\xc4\x89";
/// A sentence of `/pages/article`.
pub const ARTICLE_TEXT: &str = "Cats sleep up to sixteen hours a day.";

/// How `/search` answers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum SearchBehaviour {
    /// Results.
    #[default]
    Results,
    /// This status, with [`UPSTREAM_SECRET`] in the body.
    Status(u16),
    /// 200 with a body that is not JSON.
    NotJson,
    /// Never answers.
    Hang,
}

/// One `/search` request.
#[derive(Debug, Clone)]
pub struct SearchRequest {
    /// Its query parameters.
    pub params: BTreeMap<String, String>,
    /// Its `Authorization` header.
    pub authorization: Option<String>,
}

#[derive(Debug, Default)]
struct Shared {
    searches: Mutex<Vec<SearchRequest>>,
    behaviour: Mutex<SearchBehaviour>,
    page_hits: Mutex<BTreeMap<String, usize>>,
}

/// The running fake; stops when dropped.
#[derive(Debug)]
pub struct FakeWeb {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeWeb {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakeWeb {
    /// Starts it on 127.0.0.1, an ephemeral port.
    ///
    /// # Panics
    /// If it cannot bind.
    pub async fn start() -> FakeWeb {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let shared = Arc::new(Shared::default());
        let app = Router::new()
            .route("/search", get(search))
            .route("/pages/{name}", get(page))
            .with_state(shared.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        FakeWeb { addr, shared, task }
    }

    /// `ip:port`.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ip:port`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The URL of `/pages/{name}`.
    pub fn page(&self, name: &str) -> String {
        format!("http://{}/pages/{name}", self.addr)
    }

    /// Sets how `/search` answers.
    pub fn set(&self, behaviour: SearchBehaviour) {
        *lock(&self.shared.behaviour) = behaviour;
    }

    /// Every `/search` request so far.
    pub fn searches(&self) -> Vec<SearchRequest> {
        lock(&self.shared.searches).clone()
    }

    /// How often `/pages/{name}` was requested.
    pub fn hits(&self, name: &str) -> usize {
        lock(&self.shared.page_hits).get(name).copied().unwrap_or(0)
    }
}

async fn search(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Query(params): Query<BTreeMap<String, String>>,
) -> Response {
    let category = params.get("categories").cloned().unwrap_or_default();
    let q = params.get("q").cloned().unwrap_or_default();
    lock(&shared.searches).push(SearchRequest {
        params,
        authorization: headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned),
    });
    let behaviour = lock(&shared.behaviour).clone();
    match behaviour {
        SearchBehaviour::Status(code) => (
            StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            format!("{{\"error\":\"{UPSTREAM_SECRET}\"}}"),
        )
            .into_response(),
        SearchBehaviour::NotJson => format!("<html>{UPSTREAM_SECRET}</html>").into_response(),
        SearchBehaviour::Hang => std::future::pending::<Response>().await,
        SearchBehaviour::Results if category == "images" => axum::Json(json!({"query": q, "results": [
            {"url": "https://photos.example.com/cat-1", "title": "Cat on a sofa", "img_src": "https://img.example.com/1.jpg",
             "thumbnail_src": "https://img.example.com/1-thumb.jpg", "resolution": "1920x1080", "img_format": "JPEG"},
            {"url": "https://photos.example.com/cat-2", "title": "Tall cat", "img_src": "https://img.example.com/2.png",
             "resolution": "600 x 1200", "img_format": "png"},
            {"url": "https://photos.example.com/cat-3", "title": "No size", "img_src": "https://img.example.com/3.webp"},
        ]}))
        .into_response(),
        SearchBehaviour::Results => {
            let results: Vec<_> = (1..=12)
                .map(|i| {
                    let site = if i % 3 == 0 { "news.example.org" } else { "www.example.com" };
                    json!({"url": format!("https://{site}/{i}"), "title": format!("{q} result {i}"),
                           "content": format!("snippet {i} about {q}"), "engine": "fake", "score": 12.0 - f64::from(i),
                           "publishedDate": if i == 1 { json!("2026-11-30T00:00:00") } else { json!(null) }})
                })
                .collect();
            axum::Json(json!({"query": q, "number_of_results": results.len(), "results": results})).into_response()
        }
    }
}

async fn page(State(shared): State<Arc<Shared>>, Path(name): Path<String>) -> Response {
    *lock(&shared.page_hits).entry(name.clone()).or_default() += 1;
    let html = |body: String| ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], body).into_response();
    let redirect = |to: &str| (StatusCode::FOUND, [(header::LOCATION, to.to_owned())]).into_response();
    match name.as_str() {
        "article" => html(format!(
            "<!doctype html><html><head><title>{ARTICLE_TITLE}</title><script>var secret = 1;</script></head>\
             <body><nav>Home | About</nav><h1>Cats</h1><p>{ARTICLE_TEXT}</p><ul><li>Whiskers</li></ul></body></html>"
        )),
        "emoji" => (
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            "😺".repeat(8_001),
        )
            .into_response(),
        "big" => ([(header::CONTENT_TYPE, "text/plain")], "x".repeat(300 * 1024)).into_response(),
        "cat.png" => ([(header::CONTENT_TYPE, "image/png")], CAT_PNG.to_vec()).into_response(),
        // An SVG can carry script: refused whatever its Content-Type says.
        "cat.svg" => (
            [(header::CONTENT_TYPE, "image/png")],
            "<svg xmlns=\"http://www.w3.org/2000/svg\"><script>alert(1)</script></svg>",
        )
            .into_response(),
        "to-cat" => redirect("/pages/cat.png"),
        "to-loopback" => redirect("http://127.0.0.1:8080/"),
        "to-metadata" => redirect("http://169.254.169.254/latest/meta-data/"),
        _ => StatusCode::NOT_FOUND.into_response(),
    }
}
