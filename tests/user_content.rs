//! User content cannot script the fleet's origin (issue 43; security review 2, finding 2), on real parts: a real
//! nats-server, a front and the whole HTTP gateway (`fleet::http::serve_with_services`, as `fleet up` and the
//! chart's fronts serve it), a worker whose host services are the fleet's, the Rust fixture plugin calling
//! `files/*` and `host/uploadFile` over its stdio (`reverse_rpc`), and headless Chromium opening the links.
//!
//! The probe is the review's: HTML (or SVG, or XML) whose script marks the document. Refused where its type is not
//! one media type (a comma list, quotes, a control character); where it is accepted it is served as exactly the
//! normalised type, as an attachment, with `Content-Security-Policy: sandbox; default-src 'none'` and `nosniff`,
//! and Chromium runs nothing. With `files_public_url`, links are minted on that origin.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::sync::Arc;

use fleet::http::HttpConfig;
use fleet::http::files::USER_CONTENT_CSP;
use fleet_e2e::chromium::{Browser, Visit};
use fleet_e2e::cluster::{Cluster, Role, connect, worker_settings};
use fleet_e2e::worker::{Plugin, TestWorker, data, test_config};
use fleet_services::credentials::Keyring;
use fleet_services::files::{Bucket, LinkSigner, META_CONTENT_TYPE};
use fleet_services::media_type::MediaType;
use fleet_services::{FleetServices, ServicesConfig};
use fleet_store::StoreSettings;
use serde_json::{Value, json};

const USER: &str = "mallory";
const TOOL: &str = "files-probe";
const SECRET: &[u8] = b"user-content-test-link-signing-secret";

/// The probe page: its script, if it ever runs, titles the document `xss-ran` and marks its root with `data-xss`
/// (the markers are assembled at run time, so the page's source text never contains them).
const HTML_PROBE: &str = "<!doctype html><html><head><title>probe</title></head><body><p>user content</p>\
    <script>document.title='xss'+'-ran';document.documentElement.setAttribute('data-'+'xss',location.host)</script>\
    </body></html>";
/// The same in SVG.
const SVG_PROBE: &str = "<svg xmlns=\"http://www.w3.org/2000/svg\"><text y=\"20\">user content</text>\
    <script>document.documentElement.setAttribute('data-'+'xss',location.host)</script></svg>";
/// The same in XML, with an XHTML script element.
const XML_PROBE: &str = "<?xml version=\"1.0\"?><root xmlns:h=\"http://www.w3.org/1999/xhtml\">user content\
    <h:script>document.documentElement.setAttribute('data-'+'xss',location.host)</h:script></root>";

struct AbortOnDrop(tokio::task::JoinHandle<std::io::Result<()>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

struct Env {
    /// The worker running the plugin, with the worker's host services.
    worker: TestWorker,
    /// The fleet's public URL (the gateway on 127.0.0.1).
    fleet: String,
    /// Where links are minted: the fleet's URL, or with `files_public_url` the same gateway as `localhost`.
    files: String,
    /// The front's host services (the gateway's).
    front: FleetServices,
    http: reqwest::Client,
    _gateway: AbortOnDrop,
    _cluster: Cluster,
}

/// A cluster (nats-server, one front), the gateway with the host services' routes on a real socket, and a worker
/// running the fixture plugin (claims storage and upload, declares `aps.files` and `host.upload`, granted both).
/// `own_origin`: the services are configured with `files_public_url` (the gateway reached as `localhost`).
async fn env(name: &str, own_origin: bool) -> Env {
    let cluster = Cluster::start(name, 1, 0, &[]).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let fleet = format!("http://127.0.0.1:{port}");
    let files = if own_origin {
        format!("http://localhost:{port}")
    } else {
        fleet.clone()
    };
    let config = ServicesConfig {
        public_url: Some(fleet.clone()),
        files_public_url: own_origin.then(|| format!("{files}/")),
        ..ServicesConfig::default()
    };
    let open = |js, settings: StoreSettings| {
        let config = config.clone();
        async move {
            Box::pin(FleetServices::open(
                &js,
                &settings,
                &config,
                LinkSigner::new(SECRET),
                Keyring::fixed(&[("k1", [7; 32])]),
            ))
            .await
            .expect("host services")
        }
    };
    let front = open(
        async_nats::jetstream::new(cluster.client.clone()),
        StoreSettings::default(),
    )
    .await;
    let worker_js = async_nats::jetstream::new(connect(&cluster.nats, Role::Worker).await);
    let services = open(worker_js, worker_settings()).await;
    let caps = ["aps.files".to_owned(), "host.upload".to_owned()];
    front.grants().edit(USER, TOOL, &caps, &[]).await.expect("grant");
    let plugin = Plugin::echo(
        TOOL,
        &[
            "--capabilities",
            "storage,upload",
            "--host-capabilities",
            "aps.files,host.upload",
        ],
    );
    let worker = TestWorker::with_services(
        test_config(name),
        &[plugin],
        Arc::new(services.clone()),
        Arc::new(services),
    );
    let gateway = start_gateway(&cluster, listener, front.clone()).await;
    Env {
        worker,
        fleet,
        files,
        front,
        http: reqwest::Client::new(),
        _gateway: gateway,
        _cluster: cluster,
    }
}

/// The whole gateway of the cluster's front, with the host services' routes, on `listener`.
async fn start_gateway(
    cluster: &Cluster,
    listener: tokio::net::TcpListener,
    services: FleetServices,
) -> AbortOnDrop {
    let state = cluster.http_state(HttpConfig::default()).await;
    AbortOnDrop(tokio::spawn(fleet::http::serve_with_services(
        listener, state, services,
    )))
}

/// A served response: status, the headers that matter here, body.
#[derive(Debug)]
struct Served {
    status: u16,
    headers: HashMap<String, String>,
    body: Vec<u8>,
}

impl Served {
    fn header(&self, name: &str) -> &str {
        self.headers.get(name).map_or("", String::as_str)
    }

    /// Carries the user-content CSP and `nosniff`.
    #[track_caller]
    fn assert_protected(&self) {
        assert_eq!(
            self.header("content-security-policy"),
            USER_CONTENT_CSP,
            "{self:?}"
        );
        assert_eq!(self.header("x-content-type-options"), "nosniff", "{self:?}");
    }
}

impl Env {
    /// One reverse call of the plugin (a fresh invoke): the JSON-RPC response it received.
    async fn rpc(&self, method: &str, params: Value) -> Value {
        let out = data(
            &self.worker,
            USER,
            TOOL,
            "reverse_rpc",
            json!({"method": method, "params": params, "timeout_ms": 30_000}),
        )
        .await;
        out["response"].clone()
    }

    /// The result of a reverse call that must succeed.
    async fn ok(&self, method: &str, params: Value) -> Value {
        let r = self.rpc(method, params.clone()).await;
        assert!(r.get("error").is_none(), "{method} {params}: {r}");
        r["result"].clone()
    }

    /// The error of a reverse call that must fail: (code, message).
    async fn err(&self, method: &str, params: Value) -> (i64, String) {
        let r = self.rpc(method, params.clone()).await;
        let e = &r["error"];
        assert!(e.is_object(), "{method} {params}: expected an error, got {r}");
        (
            e["code"].as_i64().unwrap(),
            e["message"].as_str().unwrap().to_owned(),
        )
    }

    /// `files/upload_begin` of `path` as `content_type`, for `body`.
    async fn begin(&self, path: &str, content_type: &str, body: &str) -> Result<Value, (i64, String)> {
        let params =
            json!({"scope": "user", "path": path, "content_type": content_type, "size_bytes": body.len()});
        let r = self.rpc("files/upload_begin", params).await;
        match r.get("error") {
            Some(e) => Err((
                e["code"].as_i64().unwrap(),
                e["message"].as_str().unwrap().to_owned(),
            )),
            None => Ok(r["result"].clone()),
        }
    }

    async fn put(&self, url: &str, content_type: &str, body: &str) -> Served {
        let r = self
            .http
            .put(url)
            .header("content-type", content_type)
            .body(body.to_owned())
            .send()
            .await
            .expect("PUT");
        served(r).await
    }

    async fn get(&self, url: &str) -> Served {
        served(self.http.get(url).send().await.expect("GET")).await
    }

    /// The whole upload of `body` as `content_type` (begin, PUT with the answer's headers, complete) and a
    /// download link: (the type the answer said, the link).
    async fn upload(&self, path: &str, content_type: &str, body: &str) -> (String, String) {
        let begun = self.begin(path, content_type, body).await.expect("upload_begin");
        let normalised = begun["headers"]["Content-Type"].as_str().unwrap().to_owned();
        let put = self
            .put(begun["put_url"].as_str().unwrap(), &normalised, body)
            .await;
        assert_eq!(put.status, 200, "{put:?}");
        let done = self
            .ok("files/upload_complete", json!({"scope": "user", "path": path}))
            .await;
        assert_eq!(done["content_type"], json!(normalised));
        let link = self
            .ok("files/download_url", json!({"scope": "user", "path": path}))
            .await;
        assert_eq!(link["content_type"], json!(normalised));
        (normalised, link["url"].as_str().unwrap().to_owned())
    }
}

async fn served(r: reqwest::Response) -> Served {
    let status = r.status().as_u16();
    let headers = r
        .headers()
        .iter()
        .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap_or_default().to_owned()))
        .collect();
    let body = r.bytes().await.expect("body").to_vec();
    Served {
        status,
        headers,
        body,
    }
}

/// Headless Chromium (DevTools protocol) with a profile of its own.
struct Chromium {
    browser: Browser,
    _profile: tempfile::TempDir,
}

impl Chromium {
    async fn launch() -> Chromium {
        let profile = tempfile::tempdir().expect("profile");
        Chromium {
            browser: Browser::launch(profile.path()).await,
            _profile: profile,
        }
    }

    /// Opens `url` as a victim would (a link followed in a tab): what the browser made of it, after checking
    /// that no script of a probe ran.
    async fn open(&mut self, url: &str, what: &str) -> Visit {
        let visit = self.browser.visit(url).await;
        assert!(
            !visit.html.contains("data-xss") && !visit.title.contains("xss-ran"),
            "{what}: the probe's script ran: {visit:?}"
        );
        visit
    }

    /// The control: this Chromium runs the probe's script when a server serves it as HTML (here a server of the
    /// test's own, on its own port), so the absence of the markers elsewhere means something.
    async fn assert_probe_runs_as_html(&mut self) {
        let app = axum::Router::new().route(
            "/probe",
            axum::routing::get(|| async { ([("content-type", "text/html")], HTML_PROBE) }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}/probe", listener.local_addr().expect("addr"));
        let _server = AbortOnDrop(tokio::spawn(async move { axum::serve(listener, app).await }));
        let visit = self.browser.visit(&url).await;
        assert!(
            visit.html.contains("data-xss=\"127.0.0.1:") && visit.title == "xss-ran" && !visit.download,
            "the probe's script did not run even as plain HTML: {visit:?}"
        );
    }
}

/// A download: nothing rendered (the fresh tab's empty document stays).
#[track_caller]
fn assert_downloaded(visit: &Visit, what: &str) {
    assert!(visit.download, "{what}: not taken as a download: {visit:?}");
    assert!(
        !visit.html.contains("user content"),
        "{what}: rendered: {visit:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_type_that_is_not_one_media_type_is_refused_at_every_door() {
    let env = env("uc-refused", false).await;
    // files/upload_begin: the review's comma list, and its kin. Same code as any invalid argument (-32028); the
    // message says what is wrong without repeating the text.
    for bad in [
        "image/png;x=1,text/html",
        "image/png,text/html",
        "text/plain;charset=\"utf-8\"",
        "text/html\r\nx-a: b",
        "image/",
        "image/png;x",
    ] {
        let (code, message) = env.begin("probe.png", bad, HTML_PROBE).await.unwrap_err();
        assert_eq!(code, -32028, "{bad:?}: {message}");
        assert!(
            message.starts_with("content_type: ") && !message.contains("html") && !message.contains("png"),
            "{bad:?}: {message}"
        );
    }
    // host/uploadFile, inline and negotiate: MIME rejected (-32205).
    for mode in ["inline", "negotiate"] {
        let (code, message) = env
            .err(
                "host/uploadFile",
                json!({"mode": mode, "filename": "p.png", "mime_type": "image/png;x=1,text/html",
                       "content_b64": "PHA+", "expected_bytes": 3}),
            )
            .await;
        assert_eq!(code, -32205, "{mode}: {message}");
        assert!(!message.contains("html"), "{mode}: {message}");
    }
    // The PUT of a signed link: only the signed media type, compared normalised; a list is refused even when its
    // first type is the signed one. Nothing lands.
    let begun = env.begin("p.png", "image/png;x=1", "<p>").await.expect("begin");
    let put_url = begun["put_url"].as_str().unwrap();
    for sent in ["image/png;x=1,text/html", "text/html", "image/png"] {
        let put = env.put(put_url, sent, "<p>").await;
        assert_eq!(put.status, 400, "{sent:?}: {put:?}");
        assert!(!String::from_utf8_lossy(&put.body).contains("html"), "{put:?}");
        put.assert_protected();
    }
    let (code, _) = env
        .err("files/upload_complete", json!({"scope": "user", "path": "p.png"}))
        .await;
    assert_eq!(code, -32029, "nothing was stored by the refused PUTs");
    // The same type written otherwise (case, spaces) is the signed one.
    assert_eq!(env.put(put_url, " Image/PNG ; X=1", "<p>").await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepted_probes_are_served_as_attachments_that_run_nothing() {
    let env = env("uc-probes", false).await;
    let mut chromium = Chromium::launch().await;
    chromium.assert_probe_runs_as_html().await;

    // (path, type given, type stored and served, body)
    let cases = [
        ("a.html", "text/html", "text/html", HTML_PROBE),
        ("b.svg", "image/svg+xml", "image/svg+xml", SVG_PROBE),
        ("c.xml", "text/xml", "text/xml", XML_PROBE),
        ("d.xml", "application/xml", "application/xml", XML_PROBE),
        (
            "e.html",
            "text/html; charset=utf-8",
            "text/html;charset=utf-8",
            HTML_PROBE,
        ),
        ("f.html", "  Text/HTML ", "text/html", HTML_PROBE),
    ];
    for (path, given, stored, body) in cases {
        let (answered, url) = env.upload(path, given, body).await;
        assert_eq!(answered, stored, "{given:?}");
        assert!(url.starts_with(&format!("{}/v1/files/f/", env.fleet)), "{url}");
        // A plain client: exactly the stored type, an attachment, the CSP and nosniff.
        let got = env.get(&url).await;
        assert_eq!(got.status, 200, "{got:?}");
        assert_eq!(got.header("content-type"), stored, "{given:?}");
        let disposition = got.header("content-disposition");
        assert!(disposition.starts_with("attachment;"), "{given:?}: {disposition}");
        got.assert_protected();
        assert_eq!(got.body, body.as_bytes());
        // The browser downloads it: nothing is rendered, nothing runs.
        assert_downloaded(&chromium.open(&url, given).await, given);
    }
    chromium.browser.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inline_types_render_without_running_the_probe() {
    let env = env("uc-inline", false).await;
    let mut chromium = Chromium::launch().await;
    // An image type with a parameter and a plain-text type, both inline, both holding the HTML probe: Chromium
    // shows an (undecodable) image and the text, never the page.
    let cases = [
        ("g.png", "image/png;x=1", "<img"),
        ("h.txt", "text/plain;charset=utf-8", "&lt;script&gt;"),
    ];
    for (path, given, shown) in cases {
        let (answered, url) = env.upload(path, given, HTML_PROBE).await;
        assert_eq!(answered, given);
        let got = env.get(&url).await;
        assert_eq!(got.header("content-type"), given);
        assert!(
            got.header("content-disposition").starts_with("inline;"),
            "{got:?}"
        );
        got.assert_protected();
        let visit = chromium.open(&url, given).await;
        assert!(
            !visit.download && visit.html.contains(shown),
            "{given:?}: {visit:?}"
        );
    }
    chromium.browser.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_type_that_no_longer_validates_is_served_as_an_octet_stream_attachment() {
    let env = env("uc-legacy", false).await;
    let mut chromium = Chromium::launch().await;
    // An object as a version before validation stored it, behind a link signed `inline` (for `image/png`): the
    // served type is what the gateway validates, and the disposition follows it.
    let object = "legacy/probe";
    let meta = async_nats::jetstream::object_store::ObjectMetadata {
        name: object.to_owned(),
        metadata: HashMap::from([(META_CONTENT_TYPE.to_owned(), "image/png;x=1,text/html".to_owned())]),
        ..Default::default()
    };
    let mut body = HTML_PROBE.as_bytes();
    let objects = env.front.objects();
    objects
        .store(Bucket::Files)
        .put(meta, &mut body)
        .await
        .expect("put");
    let png = MediaType::parse("image/png").unwrap();
    let (url, _) = objects.get_link(
        Bucket::Files,
        object,
        "probe.png",
        &png,
        std::time::Duration::from_secs(60),
    );
    assert!(url.contains("&d=inline&"), "{url}");
    let got = env.get(&url).await;
    assert_eq!(got.status, 200, "{got:?}");
    assert_eq!(got.header("content-type"), "application/octet-stream");
    assert!(
        got.header("content-disposition").starts_with("attachment;"),
        "{got:?}"
    );
    got.assert_protected();
    assert_downloaded(&chromium.open(&url, "legacy").await, "legacy");
    chromium.browser.close().await;
    // Refusals of the same routes carry the headers too.
    let forged = env.get(&url.replace("&d=inline&", "&d=attachment&")).await;
    assert_eq!(forged.status, 403, "{forged:?}");
    forged.assert_protected();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_files_public_url_links_are_minted_on_that_origin() {
    let env = env("uc-origin", true).await;
    assert_ne!(env.files, env.fleet);
    let on_files_origin = |url: &str| url.starts_with(&format!("{}/v1/files/", env.files));
    // files/*: the PUT and the GET link.
    let begun = env.begin("o.txt", "text/plain", "hello").await.expect("begin");
    let put_url = begun["put_url"].as_str().unwrap();
    assert!(on_files_origin(put_url), "{put_url}");
    let (_, url) = env.upload("o.txt", "text/plain", "hello").await;
    assert!(on_files_origin(&url), "{url}");
    let got = env.get(&url).await;
    assert_eq!(
        (got.status, got.body.as_slice()),
        (200, b"hello".as_slice()),
        "{got:?}"
    );
    got.assert_protected();
    // host/uploadFile: inline and negotiate.
    let inline = env
        .ok(
            "host/uploadFile",
            json!({"mode": "inline", "filename": "u.txt", "mime_type": "text/plain", "content_b64": "aGk="}),
        )
        .await;
    let download = inline["download_url"].as_str().unwrap();
    assert!(on_files_origin(download), "{inline}");
    assert_eq!(env.get(download).await.body, b"hi");
    let negotiated = env
        .ok(
            "host/uploadFile",
            json!({"mode": "negotiate", "filename": "n.txt", "mime_type": "text/plain", "expected_bytes": 2}),
        )
        .await;
    assert!(
        on_files_origin(negotiated["put_url"].as_str().unwrap()),
        "{negotiated}"
    );
}
