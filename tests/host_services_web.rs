//! `web/*` (spec §8.9) through `FleetServices::serve` with real tokens minted by the fleet's token source over a
//! real nats-server (grants in JetStream KV): `web/fetch` against real HTTP pages of a local server (reachable
//! only through the test-only `test_allow_addrs` exception; every other loopback, private, link-local or
//! IPv6 form stays refused), `web/search` and `web/image_search` against a fake SearXNG (no real provider can
//! exist here). Every error code of the family, the daily CU pool under concurrent calls, the answer's budget.

use std::collections::BTreeSet;
use std::sync::Arc;

use fleet::nats_server::NatsServer;
use fleet_e2e::fake_web::{ARTICLE_TEXT, ARTICLE_TITLE, FakeWeb, SearchBehaviour, UPSTREAM_SECRET};
use fleet_proto::admin::grants::WebGrantShape;
use fleet_proto::executa::reverse::family_of;
use fleet_proto::jsonrpc::ErrorObject;
use fleet_proto::util::now_ms;
use fleet_services::tokens::{AUD_WEB, Binding, TokenMinter};
use fleet_services::web::WebConfig;
use fleet_services::{FleetServices, ServicesConfig};
use fleet_worker::services::{HostServices, InvokeTokens, ReverseCall, TokenRequest, TokenSource};
use serde_json::{Value, json};

const USER: &str = "web-user";
const TOOL: &str = "web-tool";
const KEY: &str = "searx-key-never-shown";
const LINK_SECRET: &[u8] = b"host-services-web-test-link-secret";
const ALL_WEB: [&str; 4] = ["web.search", "web.fetch", "web.image_search", "web.image_fetch"];

struct Env {
    services: FleetServices,
    web: FakeWeb,
    config: ServicesConfig,
    nats: NatsServer,
    _dir: tempfile::TempDir,
}

/// A nats-server, the fake web and the services with `[web]` as `configure` leaves it (search at the fake,
/// the fake's address allowed for tests, a key file, a daily pool of 1 000 CU).
async fn env_with(configure: impl FnOnce(&mut WebConfig)) -> Env {
    let dir = tempfile::tempdir().expect("tempdir");
    let web = FakeWeb::start().await;
    let key_file = dir.path().join("searx.key");
    std::fs::write(&key_file, format!("{KEY}\n")).expect("key file");
    let mut config = WebConfig {
        search_url: Some(web.base_url()),
        api_key_file: Some(key_file),
        daily_quota_cu: Some(1_000),
        test_allow_addrs: vec![web.addr()],
        ..WebConfig::default()
    };
    configure(&mut config);
    let config = ServicesConfig {
        web: config,
        ..ServicesConfig::default()
    };
    let (nats, services) = fleet_e2e::host_services(dir.path(), &config, LINK_SECRET).await;
    Env {
        services,
        web,
        config,
        nats,
        _dir: dir,
    }
}

async fn env() -> Env {
    env_with(|_| {}).await
}

fn enabled() -> WebGrantShape {
    WebGrantShape {
        enabled: true,
        allow_image_search: Some(true),
        ..WebGrantShape::default()
    }
}

struct Invoke {
    services: FleetServices,
    invoke_id: String,
    tokens: InvokeTokens,
    client_timeout_s: Option<f64>,
}

impl Env {
    /// CU the user used today, as the services count them (every worker's).
    async fn used(&self) -> u64 {
        self.services.web().used(USER).await.expect("usage")
    }

    /// A second worker process's services on the same NATS (worker credentials, attaching to what the first
    /// created), with the same configuration.
    async fn second_worker(&self) -> FleetServices {
        let js = async_nats::jetstream::new(
            self.nats
                .connect(fleet_client::creds::Role::Worker)
                .await
                .expect("connect"),
        );
        Box::pin(FleetServices::open(
            &js,
            &fleet_store::StoreSettings {
                provision: fleet_store::Provision::Attach,
                ..fleet_store::StoreSettings::default()
            },
            &self.config,
            fleet_services::files::LinkSigner::new(LINK_SECRET),
            fleet_services::credentials::Keyring::fixed(&[("k1", [7; 32])]),
        ))
        .await
        .expect("services (second worker)")
    }

    async fn grant(&self, shape: Option<WebGrantShape>) {
        self.services
            .grants()
            .edit_with(
                USER,
                TOOL,
                &[],
                &["*".to_owned()],
                fleet_services::grants::GrantSettings {
                    web_grant: shape.as_ref(),
                    ..Default::default()
                },
            )
            .await
            .expect("grant");
    }

    /// An invoke of [`TOOL`] (a v2 plugin declaring `declared`) with the tokens the fleet mints for it.
    async fn invoke_declaring(&self, declared: &[&str]) -> Invoke {
        invoke_on(&self.services, declared).await
    }

    async fn invoke(&self) -> Invoke {
        self.invoke_declaring(&ALL_WEB).await
    }
}

/// An invoke of [`TOOL`] on the worker whose services are `services` (they mint and verify its tokens).
async fn invoke_on(services: &FleetServices, declared: &[&str]) -> Invoke {
    {
        let invoke_id = format!("inv-{}-{}", now_ms(), rand_suffix());
        let tokens = <FleetServices as TokenSource>::tokens(
            services,
            TokenRequest {
                user: USER.into(),
                tool_id: TOOL.into(),
                invoke_id: invoke_id.clone(),
                negotiated: BTreeSet::new(),
                declared: declared.iter().map(|s| (*s).to_owned()).collect(),
                credentials: Vec::new(),
                deadline_ms: now_ms() + 120_000,
            },
        )
        .await;
        Invoke {
            services: services.clone(),
            invoke_id,
            tokens,
            client_timeout_s: None,
        }
    }
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl Invoke {
    async fn call(&self, method: &str, params: Value) -> Result<Value, ErrorObject> {
        self.services
            .serve(ReverseCall {
                user: USER.into(),
                tool_id: TOOL.into(),
                invoke_id: self.invoke_id.clone(),
                tool: "run".into(),
                method: method.into(),
                family: family_of(method).expect("a reverse-RPC method"),
                params,
                client_timeout_s: self.client_timeout_s,
                deadline_ms: now_ms() + 120_000,
                tokens: self.tokens.clone(),
            })
            .await
    }

    async fn err(&self, method: &str, params: Value) -> (i64, String) {
        let e = self.call(method, params).await.expect_err("an error");
        let name = e
            .data
            .as_ref()
            .and_then(|d| d["errorCode"].as_str())
            .unwrap_or_default()
            .to_owned();
        (e.code, name)
    }

    async fn fetch(&self, urls: &[String]) -> Value {
        self.call("web/fetch", json!({ "urls": urls }))
            .await
            .expect("web/fetch answers with per-page results")
    }
}

fn errors(result: &Value) -> Vec<Option<String>> {
    result["pages"]
        .as_array()
        .expect("pages")
        .iter()
        .map(|p| p["error"].as_str().map(str::to_owned))
        .collect()
}

/// Spec §8.9 "per-item failure isolation" and the SSRF catalogue: every page that is loopback (other than the
/// test server itself), link-local, private, IPv6 loopback or mapped, a decimal or octal spelling of loopback,
/// or a redirect to loopback or to the metadata address is `SSRF_BLOCKED`, while the other pages of the same
/// call are fetched; only fetched pages are charged.
#[tokio::test]
async fn fetch_refuses_the_ssrf_catalogue_per_item_while_the_other_pages_succeed() {
    let env = env().await;
    env.grant(Some(enabled())).await;
    let inv = env.invoke().await;
    let port = env.web.addr().port();
    let urls: Vec<String> = vec![
        env.web.page("article"),
        "http://127.0.0.1/".into(),
        "http://127.0.0.1:8080/".into(),
        "http://169.254.169.254/latest/meta-data/".into(),
        "http://10.0.0.5/".into(),
        format!("http://[::1]:{port}/pages/article"),
        format!("http://[::ffff:127.0.0.2]:{port}/"),
        "http://2130706433/".into(),
        "http://0177.0.0.1/".into(),
        env.web.page("to-loopback"),
    ];
    let r = inv.fetch(&urls).await;
    let pages = r["pages"].as_array().expect("pages");
    assert_eq!(pages.len(), urls.len(), "same length and order as urls");
    for (page, url) in pages.iter().zip(&urls) {
        assert_eq!(page["url"], json!(url));
    }
    let first = &pages[0];
    assert_eq!(first["ok"], true, "{first}");
    assert_eq!(first["title"], ARTICLE_TITLE);
    assert_eq!(first["final_url"], json!(env.web.page("article")));
    assert_eq!(first["truncated"], false);
    let content = first["content"].as_str().expect("content");
    assert!(content.contains(ARTICLE_TEXT), "{content}");
    assert!(
        content.contains("# Cats") && content.contains("- Whiskers"),
        "markdown: {content}"
    );
    assert!(
        !content.contains("secret") && !content.contains("Home"),
        "script and nav dropped: {content}"
    );
    for (i, page) in pages.iter().enumerate().skip(1) {
        assert_eq!(page["ok"], false, "{i}: {page}");
        assert_eq!(page["error"], "SSRF_BLOCKED", "{}: {page}", urls[i]);
        assert!(page.get("content").is_none());
    }
    assert_eq!(r["quota_consumed"], 1, "only the fetched page is charged");
    assert_eq!(
        env.web.hits("article"),
        1,
        "the refused [::1] URL never reached the server"
    );
    let redirect = inv.fetch(&[env.web.page("to-metadata")]).await;
    assert_eq!(errors(&redirect), vec![Some("SSRF_BLOCKED".to_owned())]);
    assert_eq!(redirect["quota_consumed"], 0);
}

/// The per-page errors other than the policy's, and the answer's 256 KB: 8 pages of 8 000 four-byte characters
/// (256 000 bytes) fit, the 9th and 10th are `RESPONSE_BUDGET_EXCEEDED`; `text` format and `max_chars`.
#[tokio::test]
async fn fetch_reports_statuses_sizes_and_the_response_budget_per_page() {
    let env = env().await;
    env.grant(Some(enabled())).await;
    let inv = env.invoke().await;
    let r = inv
        .fetch(&[
            env.web.page("missing"),
            env.web.page("big"),
            "ftp://example.com/".into(),
            "::".into(),
        ])
        .await;
    assert_eq!(
        errors(&r),
        vec![
            Some("HTTP_404".to_owned()),
            Some("TOO_LARGE".to_owned()),
            Some("SSRF_BLOCKED".to_owned()),
            Some("PARSE_FAILED".to_owned()),
        ]
    );
    assert_eq!(r["quota_consumed"], 0);

    let ten: Vec<String> = (0..10).map(|_| env.web.page("emoji")).collect();
    let r = inv.fetch(&ten).await;
    let pages = r["pages"].as_array().expect("pages");
    for page in &pages[..8] {
        assert_eq!(page["ok"], true, "{page}");
        assert_eq!(page["truncated"], true, "8 001 characters are cut at 8 000");
        assert_eq!(page["content"].as_str().map(|c| c.chars().count()), Some(8_000));
    }
    for page in &pages[8..] {
        assert_eq!(page["error"], "RESPONSE_BUDGET_EXCEEDED", "{page}");
    }
    assert_eq!(r["quota_consumed"], 8);

    let text = inv
        .call(
            "web/fetch",
            json!({"urls": [env.web.page("article")], "format": "text", "max_chars": 10}),
        )
        .await
        .expect("fetch");
    let page = &text["pages"][0];
    assert_eq!(page["content"], "Cats\n\nCats");
    assert_eq!(page["truncated"], true);
}

/// `web/search` maps the provider's results to the spec's shape, sends the key, and reports the tier it ran;
/// `web/image_search` forces safe search (strict) whatever the plugin asks.
#[tokio::test]
async fn search_and_image_search_go_to_the_provider_with_safe_search_forced_for_images() {
    let env = env().await;
    env.grant(Some(enabled())).await;
    let inv = env.invoke().await;
    let r = inv
        .call(
            "web/search",
            json!({"query": "cats", "max_results": 5, "topic": "news", "time_range": "week", "region": "en-US",
                   "exclude_domains": ["news.example.org"]}),
        )
        .await
        .expect("search");
    assert_eq!(r["provider_tier"], "basic");
    assert_eq!(r["quota_consumed"], 1);
    let results = r["results"].as_array().expect("results");
    assert_eq!(results.len(), 5);
    assert_eq!(
        results[0],
        json!({"title": "cats result 1", "url": "https://www.example.com/1", "snippet": "snippet 1 about cats",
               "site": "www.example.com", "published_at": "2026-11-30T00:00:00", "score": 11.0})
    );
    assert!(
        results.iter().all(|h| h["site"] == "www.example.com"),
        "excluded domain dropped"
    );
    let sent = env.web.searches().pop().expect("a search");
    assert_eq!(
        sent.authorization.as_deref(),
        Some(format!("Bearer {KEY}").as_str())
    );
    for (k, v) in [
        ("q", "cats"),
        ("format", "json"),
        ("categories", "news"),
        ("time_range", "week"),
        ("language", "en-US"),
        ("safesearch", "1"),
    ] {
        assert_eq!(sent.params.get(k).map(String::as_str), Some(v), "{k}");
    }
    let images = inv
        .call(
            "web/image_search",
            json!({"query": "cats", "aspect": "wide", "safe_search": true}),
        )
        .await
        .expect("image search");
    assert_eq!(
        images["results"],
        json!([{"image_url": "https://img.example.com/1.jpg", "thumbnail_url": "https://img.example.com/1-thumb.jpg",
                "source_url": "https://photos.example.com/cat-1", "title": "Cat on a sofa", "width": 1920,
                "height": 1080, "mime_type": "image/jpeg"}])
    );
    assert_eq!(images["quota_consumed"], 1);
    let sent = env.web.searches().pop().expect("an image search");
    assert_eq!(sent.params.get("categories").map(String::as_str), Some("images"));
    assert_eq!(
        sent.params.get("safesearch").map(String::as_str),
        Some("2"),
        "strict, forced"
    );
    assert_eq!(
        inv.err("web/image_search", json!({"query": "cats", "safe_search": false}))
            .await,
        (-32524, "WEB_INVALID_REQUEST".into())
    );
}

/// `-32521` (nothing granted, a method not granted, advanced without `allowAdvanced`, search without a
/// provider), `-32527` (web turned off by the user), `-32528` (an expired token); `maxResultsPerCall` caps
/// `max_results` (over it `-32524`).
#[tokio::test]
async fn grants_decide_not_granted_user_denied_and_token_expired() {
    let env = env().await;
    // Default: disabled.
    let inv = env.invoke().await;
    assert!(inv.tokens.web.is_none(), "no grant, no web token");
    assert_eq!(
        inv.err("web/fetch", json!({"urls": ["https://example.com/"]}))
            .await,
        (-32521, "WEB_NOT_GRANTED".into())
    );
    // Enabled with the spec's defaults: search and fetch, not images, not advanced.
    env.grant(Some(WebGrantShape {
        enabled: true,
        max_results_per_call: Some(3),
        ..WebGrantShape::default()
    }))
    .await;
    let grant = env.services.grants().get(USER, TOOL).await.expect("grant");
    assert_eq!(
        grant.allow.iter().map(String::as_str).collect::<Vec<_>>(),
        vec!["web.fetch", "web.search"]
    );
    let inv = env.invoke().await;
    assert_eq!(
        inv.err("web/image_search", json!({"query": "cats"})).await,
        (-32521, "WEB_NOT_GRANTED".into())
    );
    assert_eq!(
        inv.err("web/search", json!({"query": "cats", "search_depth": "advanced"}))
            .await,
        (-32521, "WEB_NOT_GRANTED".into())
    );
    let capped = inv
        .call("web/search", json!({"query": "cats"}))
        .await
        .expect("search");
    assert_eq!(
        capped["results"].as_array().map(Vec::len),
        Some(3),
        "maxResultsPerCall"
    );
    assert_eq!(
        inv.err("web/search", json!({"query": "cats", "max_results": 4}))
            .await,
        (-32524, "WEB_INVALID_REQUEST".into())
    );
    // allowAdvanced: served, as the tier that ran.
    env.grant(Some(WebGrantShape {
        allow_advanced: Some(true),
        ..enabled()
    }))
    .await;
    let inv = env.invoke().await;
    let advanced = inv
        .call("web/search", json!({"query": "cats", "search_depth": "advanced"}))
        .await
        .expect("advanced");
    assert_eq!(advanced["provider_tier"], "basic");
    // Web a manifest does not declare gets no capability in the token.
    let fetch_only = env.invoke_declaring(&["web.fetch"]).await;
    assert_eq!(
        fetch_only.err("web/search", json!({"query": "cats"})).await,
        (-32521, "WEB_NOT_GRANTED".into())
    );
    // The user turned web off.
    env.grant(Some(WebGrantShape::default())).await;
    let inv = env.invoke().await;
    assert_eq!(
        inv.err("web/fetch", json!({"urls": [env.web.page("article")]}))
            .await,
        (-32527, "WEB_USER_DENIED".into())
    );
    // An expired token of this very invoke.
    env.grant(Some(enabled())).await;
    let mut inv = env.invoke().await;
    let mut claims = TokenMinter::claims(
        Binding {
            user: USER,
            tool_id: TOOL,
            invoke_id: &inv.invoke_id,
        },
        AUD_WEB,
        std::time::Duration::ZERO,
    );
    claims.caps = vec!["web.fetch".into()];
    claims.exp = claims.iat.saturating_sub(1);
    inv.tokens.web = Some(env.services.minter().sign(&claims).expect("sign"));
    assert_eq!(
        inv.err("web/fetch", json!({"urls": [env.web.page("article")]}))
            .await,
        (-32528, "WEB_TOKEN_EXPIRED".into())
    );
}

/// Search is offered only with a provider; fetch unless `fetch = false`; nothing at all: no `web` key and no
/// token.
#[tokio::test]
async fn web_is_offered_only_as_configured() {
    let env = env().await;
    assert_eq!(
        env.services.offer()["web"],
        json!({"search": true, "fetch": true, "image_search": true, "image_fetch": true})
    );
    let fetch_only = env_with(|c| {
        c.search_url = None;
        c.api_key_file = None;
    })
    .await;
    assert_eq!(
        fetch_only.services.offer()["web"],
        json!({"search": false, "fetch": true, "image_search": false, "image_fetch": true})
    );
    fetch_only.grant(Some(enabled())).await;
    let inv = fetch_only.invoke().await;
    assert_eq!(
        inv.err("web/search", json!({"query": "cats"})).await,
        (-32521, "WEB_NOT_GRANTED".into()),
        "granted, but no provider: not offered"
    );
    assert_eq!(
        inv.err("web/image_fetch", json!({"url": "https://example.com/a.png"}))
            .await,
        (-32521, "WEB_NOT_GRANTED".into()),
        "allowImageFetch defaults off"
    );
    let nothing = env_with(|c| {
        c.search_url = None;
        c.api_key_file = None;
        c.fetch = false;
    })
    .await;
    assert!(nothing.services.offer().get("web").is_none());
    nothing.grant(Some(enabled())).await;
    assert!(nothing.invoke().await.tokens.web.is_none());
}

/// `-32523` for a failing provider (its body never reaches the plugin), `-32525` for one that never answers;
/// neither is charged. `-32524` for malformed params.
#[tokio::test]
async fn provider_failures_timeouts_and_bad_params_have_their_codes_and_are_not_charged() {
    let env = env().await;
    env.grant(Some(enabled())).await;
    let mut inv = env.invoke().await;
    for behaviour in [SearchBehaviour::Status(502), SearchBehaviour::NotJson] {
        env.web.set(behaviour.clone());
        let e = inv
            .call("web/search", json!({"query": "cats"}))
            .await
            .expect_err("provider error");
        assert_eq!(e.code, -32523, "{behaviour:?}");
        let shown = serde_json::to_string(&e).expect("json");
        assert!(!shown.contains(UPSTREAM_SECRET), "{shown}");
        assert!(!shown.contains(KEY), "{shown}");
    }
    env.web.set(SearchBehaviour::Hang);
    inv.client_timeout_s = Some(1.0);
    assert_eq!(
        inv.err("web/search", json!({"query": "cats"})).await,
        (-32525, "WEB_TIMEOUT".into())
    );
    assert_eq!(env.used().await, 0, "failures are not charged");
    for bad in [
        json!({}),
        json!({"query": ""}),
        json!({"query": "cats", "max_results": 11}),
        json!({"query": "cats", "time_range": "decade"}),
    ] {
        assert_eq!(
            inv.err("web/search", bad.clone()).await,
            (-32524, "WEB_INVALID_REQUEST".into()),
            "{bad}"
        );
    }
    for bad in [
        json!({"urls": []}),
        json!({"urls": (0..11).map(|i| format!("https://e.example/{i}")).collect::<Vec<_>>()}),
        json!({"urls": ["https://e.example/"], "format": "pdf"}),
        json!({"urls": ["https://e.example/"], "max_chars": 0}),
    ] {
        assert_eq!(
            inv.err("web/fetch", bad.clone()).await,
            (-32524, "WEB_INVALID_REQUEST".into()),
            "{bad}"
        );
    }
}

/// `-32522`: the daily pool is exact under concurrent calls of several invokes (a pool of 5: exactly 5 of 8
/// racing searches are served), and a fetch that cannot be covered whole is refused whole.
#[tokio::test]
async fn the_daily_pool_is_exact_under_concurrent_calls() {
    let env = env_with(|c| c.daily_quota_cu = Some(5)).await;
    env.grant(Some(enabled())).await;
    let mut invokes = Vec::new();
    for _ in 0..4 {
        invokes.push(Arc::new(env.invoke().await));
    }
    let calls = (0..8).map(|i| {
        let inv = invokes[i % 4].clone();
        async move { inv.call("web/search", json!({"query": "cats"})).await }
    });
    let outcomes = futures::future::join_all(calls).await;
    let served = outcomes.iter().filter(|o| o.is_ok()).count();
    assert_eq!(served, 5, "{outcomes:?}");
    for e in outcomes.iter().filter_map(|o| o.as_ref().err()) {
        assert_eq!(e.code, -32522);
        assert_eq!(
            e.data.as_ref().map(|d| d["errorCode"].clone()),
            Some(json!("WEB_QUOTA_EXCEEDED"))
        );
    }
    assert_eq!(env.used().await, 5);
    assert_eq!(
        invokes[0]
            .err("web/fetch", json!({"urls": [env.web.page("article")]}))
            .await,
        (-32522, "WEB_QUOTA_EXCEEDED".into())
    );
    assert_eq!(env.web.hits("article"), 0, "refused before any page was fetched");
}

/// The daily-usage counter itself (JetStream KV, compare-and-set): a reservation of exactly the pool passes, one
/// more unit is refused with the counts; pools are per user and per family; a partial refund keeps what was
/// kept; 32 racing reservations of a pool of 10 win exactly 10.
#[tokio::test]
async fn the_usage_counter_is_exact_per_user_and_family() {
    use fleet_services::usage::{self, UsageCounter, UsageError};
    let env = env().await;
    let js = async_nats::jetstream::new(
        env.nats
            .connect(fleet_client::creds::Role::Worker)
            .await
            .expect("connect"),
    );
    let settings = fleet_store::StoreSettings {
        provision: fleet_store::Provision::Attach,
        ..fleet_store::StoreSettings::default()
    };
    let counter = UsageCounter::open(&js, &settings).await.expect("usage bucket");
    let held = counter
        .reserve(usage::WEB, "alice", 3, 3)
        .await
        .expect("exactly the pool");
    match counter.reserve(usage::WEB, "alice", 1, 3).await {
        Err(UsageError::Exhausted { used, cap, asked }) => assert_eq!((used, cap, asked), (3, 3, 1)),
        other => panic!("over the pool: {other:?}"),
    }
    assert!(
        counter.reserve(usage::WEB, "bob", 3, 3).await.is_ok(),
        "pools are per user"
    );
    assert!(
        counter.reserve(usage::IMAGE, "alice", 3, 3).await.is_ok(),
        "pools are per family"
    );
    counter.refund("alice", held, 1).await;
    assert_eq!(
        counter.used(usage::WEB, "alice").await.expect("used"),
        1,
        "two of three went back"
    );
    assert_eq!(counter.used(usage::IMAGE, "alice").await.expect("used"), 3);

    let racing = (0..32).map(|_| {
        let counter = counter.clone();
        async move { counter.reserve(usage::WEB, "carol", 1, 10).await.is_ok() }
    });
    let won = futures::future::join_all(racing)
        .await
        .into_iter()
        .filter(|ok| *ok)
        .count();
    assert_eq!(won, 10);
    assert_eq!(counter.used(usage::WEB, "carol").await.expect("used"), 10);
}

/// The pool is one for the whole fleet: two workers' services (two processes' `WebService`s) racing searches
/// of one user serve exactly the pool between them, each sees the other's charges, and what one refunds the
/// other can use.
#[tokio::test]
async fn two_workers_share_the_daily_pool_exactly() {
    let env = env_with(|c| c.daily_quota_cu = Some(5)).await;
    env.grant(Some(enabled())).await;
    let other = env.second_worker().await;
    let on_first = Arc::new(env.invoke().await);
    let on_second = Arc::new(invoke_on(&other, &ALL_WEB).await);

    // A failed search on the second worker is refunded there and counts nothing on the first.
    env.web.set(SearchBehaviour::Status(500));
    assert_eq!(
        on_second.err("web/search", json!({"query": "cats"})).await.0,
        -32523
    );
    assert_eq!(env.used().await, 0);
    env.web.set(SearchBehaviour::Results);

    let calls = (0..10).map(|i| {
        let inv = if i % 2 == 0 {
            on_first.clone()
        } else {
            on_second.clone()
        };
        async move { inv.call("web/search", json!({"query": "cats"})).await }
    });
    let outcomes = futures::future::join_all(calls).await;
    let served = outcomes.iter().filter(|o| o.is_ok()).count();
    assert_eq!(served, 5, "{outcomes:?}");
    for e in outcomes.iter().filter_map(|o| o.as_ref().err()) {
        assert_eq!(e.code, -32522, "{e:?}");
    }
    assert_eq!(env.used().await, 5);
    assert_eq!(other.web().used(USER).await.expect("usage"), 5);
    for inv in [&on_first, &on_second] {
        assert_eq!(
            inv.err("web/search", json!({"query": "cats"})).await,
            (-32522, "WEB_QUOTA_EXCEEDED".into())
        );
    }
}

/// `web/image_fetch`: the image is downloaded under the fetch policy, known by its magic bytes (an SVG served as
/// `image/png` is refused), stored as an upload of the invoke and answered with a reference and a signed link;
/// `max_bytes` is checked at its boundary; failures carry the page error's name and are not charged.
#[tokio::test]
async fn image_fetch_stores_a_checked_image_and_refuses_the_rest() {
    use fleet_e2e::fake_web::CAT_PNG;
    use tokio::io::AsyncReadExt as _;
    let env = env().await;
    env.grant(Some(WebGrantShape {
        allow_image_fetch: Some(true),
        ..enabled()
    }))
    .await;
    let inv = env.invoke().await;
    let source = env.web.page("to-cat");
    let r = inv
        .call(
            "web/image_fetch",
            json!({"url": source, "purpose": "poster", "max_bytes": CAT_PNG.len()}),
        )
        .await
        .expect("image fetched");
    assert_eq!(r["mime_type"], "image/png");
    assert_eq!(r["bytes_size"], CAT_PNG.len());
    assert_eq!(r["source_url"], json!(source));
    assert_eq!(r["final_url"], json!(env.web.page("cat.png")));
    assert_eq!(r["quota_consumed"], 1);
    use sha2::Digest as _;
    assert_eq!(r["sha256"], hex::encode(sha2::Sha256::digest(CAT_PNG)));
    assert!(r["get_url"].as_str().is_some_and(|u| u.contains("sig=")), "{r}");
    let path = r["path"].as_str().expect("path");
    let mut stored = Vec::new();
    env.services
        .objects()
        .store(fleet_services::files::Bucket::Uploads)
        .get(path)
        .await
        .expect("stored object")
        .read_to_end(&mut stored)
        .await
        .expect("read");
    assert_eq!(stored, CAT_PNG);

    let error_name = |e: &ErrorObject| e.data.as_ref().map(|d| d["error"].clone());
    for (url, max, code, name) in [
        (env.web.page("cat.svg"), None, -32524, "UNSUPPORTED_MEDIA"),
        (
            env.web.page("cat.png"),
            Some(CAT_PNG.len() - 1),
            -32524,
            "TOO_LARGE",
        ),
        (
            "http://169.254.169.254/latest/meta-data/".to_owned(),
            None,
            -32524,
            "SSRF_BLOCKED",
        ),
        (env.web.page("to-loopback"), None, -32524, "SSRF_BLOCKED"),
        (env.web.page("missing"), None, -32523, "HTTP_404"),
    ] {
        let mut params = json!({ "url": url });
        if let Some(max) = max {
            params["max_bytes"] = json!(max);
        }
        let e = inv.call("web/image_fetch", params).await.expect_err(&url);
        assert_eq!((e.code, error_name(&e)), (code, Some(json!(name))), "{url}");
    }
    for bad in [
        json!({}),
        json!({"url": 7}),
        json!({"url": source, "max_bytes": 20 * 1024 * 1024 + 1}),
        json!({"url": source, "max_bytes": 0}),
        json!({"url": source, "purpose": "x".repeat(65)}),
    ] {
        assert_eq!(
            inv.err("web/image_fetch", bad.clone()).await,
            (-32524, "WEB_INVALID_REQUEST".into()),
            "{bad}"
        );
    }
    assert_eq!(env.used().await, 1, "failed downloads are not charged");
}
