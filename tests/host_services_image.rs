//! `image/generate` and `image/edit` (spec §8.6; budgets §7.4; deadlines §7.3) on real parts: a real plugin
//! process (the Rust fixture's `reverse_rpc` tool) calls back over stdio into a worker whose host services are
//! the fleet's, with real tokens and grants in JetStream KV on a real nats-server, images stored in the
//! JetStream object store and downloaded over the fleet's real HTTP file routes. Only the images API is a fake
//! (`fleet_e2e::fake_images`): no real image provider can exist here.

use std::sync::Arc;

use fleet::nats_server::NatsServer;
use fleet_e2e::fake_images::{Answer, EDITS, FakeImages, GENERATIONS};
use fleet_e2e::worker::{Plugin, TestWorker, data, test_config};
use fleet_proto::admin::grants::ImageGrant;
use fleet_proto::executa::reverse::family_of;
use fleet_proto::jsonrpc::ErrorObject;
use fleet_proto::util::now_ms;
use fleet_services::credentials::Keyring;
use fleet_services::files::{HostObjects, LinkSigner};
use fleet_services::image::{ImageConfig, ImageModelConfig};
use fleet_services::{FleetServices, ServicesConfig};
use fleet_store::StoreSettings;
use fleet_worker::services::{HostServices, InvokeTokens, ReverseCall, TokenRequest, TokenSource};
use serde_json::{Value, json};

const SECRET: &[u8] = b"image-test-link-signing-secret";
const API_KEY: &str = "sk-image-test-key-never-logged";
/// The plugin: claims `image` and `image.edit`, declares `llm.image` and `llm.image.edit`.
const TOOL: &str = "img";
/// A second plugin of the same kind (the daily quota is shared across plugins).
const TOOL_2: &str = "img-2";
/// Declares `llm.image` but does not claim `image` in `initialize`.
const UNCLAIMED: &str = "img-unclaimed";
/// Claims `image` but its manifest does not declare `llm.image`.
const UNDECLARED: &str = "img-undeclared";

fn image_plugin(tool_id: &str, claims: &str, declares: &str) -> Plugin {
    Plugin::echo(
        tool_id,
        &[
            "--capabilities",
            claims,
            "--host-capabilities",
            declares,
            "--tool-timeout-s",
            "60",
        ],
    )
}

fn model(name: &str, edit: bool, mask: bool, max_n: u32, max_edit_n: u32) -> ImageModelConfig {
    ImageModelConfig {
        name: name.into(),
        supports_edit: edit,
        supports_mask: mask,
        max_n,
        max_edit_n,
        sizes: Vec::new(),
    }
}

struct Env {
    worker: TestWorker,
    /// The worker's services.
    services: FleetServices,
    /// A front's services (grant edits; a second process counting the same quota).
    admin: FleetServices,
    fake: FakeImages,
    /// The front's JetStream context (it may update streams: the test of a refused write seals one).
    front_js: async_nats::jetstream::Context,
    base: String,
    http: reqwest::Client,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
    _nats: NatsServer,
    _dir: tempfile::TempDir,
}

impl Drop for Env {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// A nats-server, the fake images API, a front's and a worker's services (`configured`: the worker's with
/// `[image]`; `front_configured`: the front's too), the file routes and a worker running the fixture plugins.
async fn env_with(name: &str, configured: bool, front_configured: bool) -> Env {
    let dir = tempfile::tempdir().expect("tempdir");
    let nats = NatsServer::start(&dir.path().join("nats")).expect("nats-server (run scripts/test.sh once)");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let fake = FakeImages::start().await;
    let key_file = dir.path().join("image.key");
    std::fs::write(&key_file, format!("{API_KEY}\n")).expect("key file");
    let mut sized = model("fake-sized", true, false, 1, 1);
    sized.sizes = vec!["1024x1024".into()];
    let config = ServicesConfig {
        public_url: Some(base.clone()),
        image: configured.then(|| ImageConfig {
            base_url: fake.base_url(),
            api_key_file: Some(key_file),
            provider: Some("fake-images".into()),
            models: vec![
                model("fake-image-1", true, true, 4, 2),
                model("gen-only", false, false, 1, 1),
                model("edit-no-mask", true, false, 1, 1),
                sized,
            ],
            ..ImageConfig::default()
        }),
        ..ServicesConfig::default()
    };
    let front = nats
        .connect(fleet_client::creds::Role::Front)
        .await
        .expect("connect");
    let front_js = async_nats::jetstream::new(front);
    let settings = StoreSettings::default();
    let front_config = ServicesConfig {
        image: config.image.clone().filter(|_| front_configured),
        ..config.clone()
    };
    let admin = Box::pin(FleetServices::open(
        &front_js,
        &settings,
        &front_config,
        LinkSigner::new(SECRET),
        Keyring::fixed(&[("k1", [7; 32])]),
    ))
    .await
    .expect("services (front)");
    let worker_js = async_nats::jetstream::new(
        nats.connect(fleet_client::creds::Role::Worker)
            .await
            .expect("connect"),
    );
    let services = Box::pin(FleetServices::open(
        &worker_js,
        &StoreSettings {
            provision: fleet_store::Provision::Attach,
            ..settings.clone()
        },
        &config,
        LinkSigner::new(SECRET),
        Keyring::fixed(&[("k1", [7; 32])]),
    ))
    .await
    .expect("services (worker)");
    let objects = HostObjects::open(&front_js, &settings, LinkSigner::new(SECRET), None)
        .await
        .expect("objects");
    let server = tokio::spawn(fleet::http::files::serve(listener, objects));
    let both = "image,image.edit";
    let caps = "llm.image,llm.image.edit";
    let worker = TestWorker::with_services(
        test_config(name),
        &[
            image_plugin(TOOL, both, caps),
            image_plugin(TOOL_2, both, caps),
            image_plugin(UNCLAIMED, "sampling", caps),
            image_plugin(UNDECLARED, both, "aps.kv"),
        ],
        Arc::new(services.clone()),
        Arc::new(services.clone()),
    );
    Env {
        worker,
        services,
        admin,
        fake,
        front_js,
        base,
        http: reqwest::Client::new(),
        server,
        _nats: nats,
        _dir: dir,
    }
}

async fn env(name: &str) -> Env {
    Box::pin(env_with(name, true, true)).await
}

impl Env {
    async fn grant(&self, user: &str, tool_id: &str, caps: &[&str], image: Option<ImageGrant>) {
        let allow: Vec<String> = caps.iter().map(|c| (*c).to_owned()).collect();
        self.admin
            .grants()
            .edit_with(
                user,
                tool_id,
                &allow,
                &[],
                fleet_services::grants::GrantSettings {
                    image,
                    ..Default::default()
                },
            )
            .await
            .expect("grant");
    }

    /// One reverse call of `method` from a fresh invoke of `tool_id` for `user`: the JSON-RPC response.
    async fn rpc(&self, user: &str, tool_id: &str, method: &str, params: Value) -> Value {
        let out = data(
            &self.worker,
            user,
            tool_id,
            "reverse_rpc",
            json!({"method": method, "params": params, "timeout_ms": 60_000}),
        )
        .await;
        out["response"].clone()
    }

    async fn generate(&self, user: &str, params: Value) -> Value {
        self.rpc(user, TOOL, "image/generate", params).await
    }

    async fn edit(&self, user: &str, params: Value) -> Value {
        self.rpc(user, TOOL, "image/edit", params).await
    }

    /// GET of a link the services returned: the status, `Content-Type` and body.
    async fn download(&self, url: &str) -> (u16, String, Vec<u8>) {
        assert!(
            url.starts_with(&self.base),
            "an absolute link of the fleet: {url}"
        );
        let r = self.http.get(url).send().await.expect("GET");
        let status = r.status().as_u16();
        let ct = r
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        (status, ct, r.bytes().await.expect("body").to_vec())
    }
}

#[track_caller]
fn ok(response: &Value) -> &Value {
    assert!(response.get("error").is_none(), "expected a result: {response}");
    &response["result"]
}

#[track_caller]
fn err(response: &Value) -> (i64, String, Value) {
    let e = &response["error"];
    assert!(e.is_object(), "expected an error: {response}");
    (
        e["code"].as_i64().expect("code"),
        e["data"]["errorCode"].as_str().expect("errorCode").to_owned(),
        e["data"].clone(),
    )
}

const IMAGE: &[&str] = &["llm.image"];
const BOTH: &[&str] = &["llm.image", "llm.image.edit"];

/// The `exp` (Unix seconds) of a signed link.
fn link_exp(url: &str) -> u64 {
    url.split(['?', '&'])
        .find_map(|kv| kv.strip_prefix("exp="))
        .and_then(|e| e.parse().ok())
        .expect("exp")
}

// -------------------------------------------------------------------------------------------------------------
// Round trips
// -------------------------------------------------------------------------------------------------------------

/// Generate: the upstream gets the request (key, model, prompt, n, size, b64_json; nothing of the invoke's
/// context), the images land in the object store, the plugin gets signed links that expire after 1800 s and
/// serve exactly the bytes the provider returned, with their MIME type and pixel size read from the images.
#[tokio::test]
async fn generate_stores_the_images_and_returns_signed_links() {
    let env = env("img-gen").await;
    env.grant("alice", TOOL, IMAGE, None).await;
    let before_s = now_ms() / 1000;
    let r = env
        .generate(
            "alice",
            json!({"prompt": "A bold art-deco poster of Mars.", "n": 2, "size": "512x256", "quality": "high",
                "output_format": "png", "resolution": "1K", "metadata": {"executa_invoke_id": "x"},
                "modelPreferences": {"hints": [{"name": "IMAGE-1"}]}, "_clientTimeoutS": 30}),
        )
        .await;
    let after_s = now_ms() / 1000;
    let result = ok(&r);
    let sent = env.fake.requests();
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].path, GENERATIONS);
    assert_eq!(
        sent[0].authorization.as_deref(),
        Some(format!("Bearer {API_KEY}").as_str())
    );
    assert_eq!(
        sent[0].body,
        json!({"model": "fake-image-1", "prompt": "A bold art-deco poster of Mars.", "n": 2, "size": "512x256",
            "quality": "high", "output_format": "png", "response_format": "b64_json"})
    );
    assert_eq!(result["model"], "fake-image-1");
    assert_eq!(
        result["quota_used"],
        json!({"images_today": 2, "images_quota": 50})
    );
    assert_eq!(result["_meta"]["provider"], "fake-images");
    let images = result["images"].as_array().expect("images");
    assert_eq!(images.len(), 2);
    let returned = env.fake.returned();
    for (image, bytes) in images.iter().zip(&returned) {
        assert_eq!(image["mimeType"], "image/png");
        assert_eq!(
            (image["width"].clone(), image["height"].clone()),
            (json!(512), json!(256))
        );
        let url = image["url"].as_str().expect("url");
        let exp = link_exp(url);
        let ttl = fleet_proto::limits::R2_TRANSIENT_PRESIGN_EXPIRY.as_secs();
        assert!(
            exp >= before_s + ttl && exp <= after_s + ttl,
            "expires {ttl} s after the call: {url}"
        );
        let (status, ct, body) = env.download(url).await;
        assert_eq!((status, ct.as_str()), (200, "image/png"));
        assert_eq!(&body, bytes, "the link serves the provider's bytes");
    }
    assert_ne!(returned[0], returned[1]);
}

/// A provider answering with image URLs on its own origin: the host fetches them (without the key) and
/// stores them like base64 answers.
#[tokio::test]
async fn images_answered_by_url_are_fetched_and_stored() {
    let env = env("img-url").await;
    env.grant("alice", TOOL, IMAGE, None).await;
    env.fake.answer(Answer::Url);
    let r = env.generate("alice", json!({"prompt": "a fox"})).await;
    let image = &ok(&r)["images"][0];
    let (status, _, body) = env.download(image["url"].as_str().expect("url")).await;
    assert_eq!(status, 200);
    assert_eq!(body, env.fake.returned()[0]);
    assert_eq!(
        (image["width"].clone(), image["height"].clone()),
        (json!(1024), json!(1024))
    );
}

/// Edit: `image_url` and `mask_url` are links the fleet issued to this user, read from the object store and
/// sent to the provider as multipart; another user's link, a tampered one, and `image/edit` without
/// `llm.image.edit` are refused.
#[tokio::test]
async fn edit_takes_fleet_issued_links_of_the_caller_only() {
    let env = env("img-edit").await;
    env.grant("alice", TOOL, BOTH, None).await;
    env.grant("bob", TOOL, IMAGE, None).await;
    let first = env.generate("alice", json!({"prompt": "a poster"})).await;
    let link = ok(&first)["images"][0]["url"].as_str().expect("url").to_owned();
    let original = env.fake.returned()[0].clone();

    let edited = env
        .edit("alice", json!({"image_url": link, "mask_url": link, "prompt": "Restyle in cyberpunk. Preserve composition.",
                "n": 1}),
        )
        .await;
    let result = ok(&edited);
    let sent = env.fake.requests();
    let edit = sent.last().expect("the edit request");
    assert_eq!(edit.path, EDITS);
    assert_eq!(
        edit.authorization.as_deref(),
        Some(format!("Bearer {API_KEY}").as_str())
    );
    assert_eq!(edit.body["model"], "fake-image-1");
    assert_eq!(edit.body["prompt"], "Restyle in cyberpunk. Preserve composition.");
    assert_eq!(edit.body["n"], "1");
    assert_eq!(edit.body["response_format"], "b64_json");
    let part = |name: &str| edit.parts.iter().find(|p| p.name == name).expect(name).clone();
    assert_eq!(part("image").bytes, original, "the fleet link's bytes were sent");
    assert_eq!(part("image").content_type.as_deref(), Some("image/png"));
    assert_eq!(part("mask").bytes, original);
    let (status, _, body) = env
        .download(result["images"][0]["url"].as_str().expect("url"))
        .await;
    assert_eq!(status, 200);
    assert_eq!(&body, env.fake.returned().last().expect("edited"));
    assert_eq!(result["quota_used"]["images_today"], 2);

    // Bob may not edit (no llm.image.edit), and Alice's link is not his anyway.
    let (code, name, _) = err(&env.edit("bob", json!({"image_url": link, "prompt": "x"})).await);
    assert_eq!((code, name.as_str()), (-32101, "IMAGE_NOT_GRANTED"));
    env.grant("bob", TOOL, BOTH, None).await;
    let r = env.edit("bob", json!({"image_url": link, "prompt": "x"})).await;
    let (code, name, data) = err(&r);
    assert_eq!(
        (code, name.as_str(), data["field"].as_str()),
        (-32314, "REFERENCE_FETCH_FAILED", Some("image_url"))
    );
    // A tampered signature.
    let tampered = format!("{}0", link.trim_end_matches(|c: char| c.is_ascii_hexdigit()));
    let r = env
        .edit("alice", json!({"image_url": tampered, "prompt": "x"}))
        .await;
    assert_eq!(err(&r).0, -32314);
    assert_eq!(
        env.fake.requests().len(),
        2,
        "refused edits never reach the provider"
    );
}

// -------------------------------------------------------------------------------------------------------------
// Caps and the daily quota
// -------------------------------------------------------------------------------------------------------------

/// `n`: the host's cap (8, `data.hostCap`), the grant's per-call cap (default 4 for generate, 1 for edit;
/// `data.images`/`data.maxImages`), the model's edit cap (`-32313`); a generate above the model's `max_n` is
/// split into several upstream requests.
#[tokio::test]
async fn n_caps_hold_at_their_boundaries() {
    let env = env("img-n").await;
    env.grant("alice", TOOL, BOTH, None).await;
    ok(&env.generate("alice", json!({"prompt": "x", "n": 4})).await);
    let (code, name, data) = err(&env.generate("alice", json!({"prompt": "x", "n": 5})).await);
    assert_eq!((code, name.as_str()), (-32106, "IMAGE_MAX_IMAGES_EXCEEDED"));
    assert_eq!(
        (data["images"].clone(), data["maxImages"].clone()),
        (json!(5), json!(4))
    );
    assert!(
        data.get("hostCap").is_none(),
        "the grant's cap, not the host's: {data}"
    );

    env.grant(
        "alice",
        TOOL,
        BOTH,
        Some(ImageGrant {
            max_per_call: Some(8),
            max_images_per_day: Some(100),
            max_per_invoke: Some(8),
        }),
    )
    .await;
    let eight = env.generate("alice", json!({"prompt": "x", "n": 8})).await;
    assert_eq!(ok(&eight)["images"].as_array().map(Vec::len), Some(8));
    let generations = env
        .fake
        .requests()
        .iter()
        .filter(|r| r.path == GENERATIONS)
        .count();
    assert_eq!(
        generations,
        1 + 2,
        "8 images of a model with max_n 4: two requests"
    );
    let (code, _, data) = err(&env.generate("alice", json!({"prompt": "x", "n": 9})).await);
    assert_eq!((code, data["hostCap"].clone()), (-32106, json!(8)));

    let link = ok(&eight)["images"][0]["url"].as_str().expect("url").to_owned();
    ok(&env
        .edit("alice", json!({"image_url": link, "prompt": "x", "n": 2}))
        .await);
    let (code, name, _) = err(&env
        .edit("alice", json!({"image_url": link, "prompt": "x", "n": 3}))
        .await);
    assert_eq!((code, name.as_str()), (-32313, "N_UNSUPPORTED"));
}

/// The day quota is exact at its boundary, shared by every plugin of the user, counted in JetStream KV (a
/// second process sees the same count), and given back when no image was delivered.
#[tokio::test]
async fn the_daily_quota_is_exact_shared_and_refunded_on_failure() {
    let env = env("img-quota").await;
    let limits = Some(ImageGrant {
        max_images_per_day: Some(5),
        max_per_call: Some(8),
        max_per_invoke: Some(8),
    });
    env.grant("alice", TOOL, IMAGE, limits).await;
    env.grant("alice", TOOL_2, IMAGE, limits).await;

    env.fake.answer(Answer::Error(500, "server_error".into()));
    assert_eq!(
        err(&env.generate("alice", json!({"prompt": "x", "n": 5})).await).0,
        -32103
    );
    env.fake.answer(Answer::B64);
    let r = env.generate("alice", json!({"prompt": "x", "n": 3})).await;
    assert_eq!(
        ok(&r)["quota_used"],
        json!({"images_today": 3, "images_quota": 5}),
        "the failure was refunded"
    );
    let r = env
        .rpc("alice", TOOL_2, "image/generate", json!({"prompt": "x", "n": 2}))
        .await;
    assert_eq!(
        ok(&r)["quota_used"],
        json!({"images_today": 5, "images_quota": 5}),
        "shared across plugins"
    );
    let (code, name, data) = err(&env.generate("alice", json!({"prompt": "x"})).await);
    assert_eq!((code, name.as_str()), (-32102, "IMAGE_QUOTA_EXCEEDED"));
    assert_eq!(
        (data["images_today"].clone(), data["images_quota"].clone()),
        (json!(5), json!(5))
    );
    let front_count = env
        .admin
        .image()
        .expect("configured")
        .images_today("alice")
        .await
        .expect("count");
    assert_eq!(front_count, 5, "another process reads the same count");
    // Another user has a quota of their own.
    env.grant("bob", TOOL, IMAGE, None).await;
    ok(&env.generate("bob", json!({"prompt": "x"})).await);
}

/// Spec §8.6: an image the object store refuses to store is `-32110` (`IMAGE_STORAGE_ERROR`), and the images of
/// the failed call go back to the daily quota. The refusal is JetStream's own: the uploads object store's stream
/// is sealed (a sealed stream takes no write), as the front's credential may do.
#[tokio::test]
async fn an_image_the_object_store_refuses_is_32110_and_refunded() {
    let env = env("img-store").await;
    env.grant("alice", TOOL, IMAGE, None).await;
    let r = env.generate("alice", json!({"prompt": "x"})).await;
    assert_eq!(ok(&r)["quota_used"]["images_today"], 1);
    let stream_name = format!("OBJ_{}", StoreSettings::default().uploads_bucket());
    let mut stream = env
        .front_js
        .get_stream(&stream_name)
        .await
        .expect("uploads stream");
    let mut config = stream.info().await.expect("stream info").config.clone();
    config.sealed = true;
    env.front_js
        .update_stream(&config)
        .await
        .expect("seal the uploads stream");

    let (code, name, _) = err(&env.generate("alice", json!({"prompt": "x", "n": 2})).await);
    assert_eq!((code, name.as_str()), (-32110, "IMAGE_STORAGE_ERROR"));
    assert_eq!(
        env.fake.requests().len(),
        2,
        "the provider was asked: the failure is the store's"
    );
    let used = env
        .admin
        .image()
        .expect("configured")
        .images_today("alice")
        .await
        .expect("count");
    assert_eq!(used, 1, "the failed call's 2 images were given back");
}

/// Concurrent calls race for the last images of the quota: exactly the quota is delivered.
#[tokio::test]
async fn concurrent_calls_never_exceed_the_daily_quota() {
    let env = env("img-race").await;
    let limits = Some(ImageGrant {
        max_images_per_day: Some(4),
        max_per_call: None,
        max_per_invoke: None,
    });
    env.grant("carol", TOOL, IMAGE, limits).await;
    let calls = (0..7).map(|i| {
        let services = env.services.clone();
        async move {
            let invoke_id = format!("race-{i}");
            let tokens = image_tokens(&services, "carol", &invoke_id).await;
            services
                .serve(reverse_call(
                    "carol",
                    &invoke_id,
                    "image/generate",
                    json!({"prompt": "x"}),
                    tokens,
                ))
                .await
        }
    });
    let outcomes = futures::future::join_all(calls).await;
    let served = outcomes.iter().filter(|r| r.is_ok()).count();
    let refused: Vec<i64> = outcomes
        .iter()
        .filter_map(|r| r.as_ref().err().map(|e| e.code))
        .collect();
    assert_eq!(served, 4, "{outcomes:?}");
    assert_eq!(refused, vec![-32102; 3]);
}

/// One invoke gets at most 4 images (spec §7.4 `image_token.max_images`), its `image/*` calls together: the 4th
/// image is served, the 5th refused with `-32106` `{images, maxImages}` before the provider is asked; images not
/// delivered are given back; another invoke has its own 4; the grant's `max_per_invoke` widens it.
#[tokio::test]
async fn one_invoke_gets_at_most_4_images() {
    let env = env("img-invoke").await;
    let limits = Some(ImageGrant {
        max_images_per_day: Some(100),
        max_per_call: None,
        max_per_invoke: None,
    });
    env.grant("dave", TOOL, IMAGE, limits).await;
    let tokens = image_tokens(&env.services, "dave", "inv-4").await;
    let call = |n: u32| {
        env.services.serve(reverse_call(
            "dave",
            "inv-4",
            "image/generate",
            json!({"prompt": "x", "n": n}),
            tokens.clone(),
        ))
    };
    call(3).await.expect("3 of 4");
    // A provider failure delivers nothing and gives its image back.
    env.fake.answer(Answer::Error(500, "server_error".into()));
    assert_eq!(call(1).await.expect_err("provider failure").code, -32103);
    env.fake.answer(Answer::B64);
    let before = env.fake.requests().len();
    let e = call(2).await.expect_err("3 + 2 > 4");
    let data = e.data.clone().expect("data");
    assert_eq!(
        (
            e.code,
            data["errorCode"].clone(),
            data["images"].clone(),
            data["maxImages"].clone()
        ),
        (-32106, json!("IMAGE_MAX_IMAGES_EXCEEDED"), json!(5), json!(4)),
        "{e:?}"
    );
    assert!(data.get("hostCap").is_none(), "{data}");
    assert_eq!(env.fake.requests().len(), before, "refused before the provider");
    call(1).await.expect("the 4th image");
    assert_eq!(call(1).await.expect_err("the 5th").code, -32106);
    assert_eq!(env.services.budget("inv-4").expect("budget").images_used(), 4);

    // Another invoke of the same user has its own 4; the day quota counted only what was delivered.
    let other = image_tokens(&env.services, "dave", "inv-4b").await;
    let r = env
        .services
        .serve(reverse_call(
            "dave",
            "inv-4b",
            "image/generate",
            json!({"prompt": "x", "n": 4}),
            other,
        ))
        .await
        .expect("a fresh invoke");
    assert_eq!(r["quota_used"]["images_today"], 8);

    // Concurrent calls of one invoke race for its 4 images: exactly 4 are served.
    let racing = image_tokens(&env.services, "dave", "inv-race").await;
    let calls = (0..8).map(|_| {
        env.services.serve(reverse_call(
            "dave",
            "inv-race",
            "image/generate",
            json!({"prompt": "x"}),
            racing.clone(),
        ))
    });
    let outcomes = futures::future::join_all(calls).await;
    let served = outcomes.iter().filter(|r| r.is_ok()).count();
    let refused: Vec<i64> = outcomes
        .iter()
        .filter_map(|r| r.as_ref().err().map(|e| e.code))
        .collect();
    assert_eq!(served, 4, "{outcomes:?}");
    assert_eq!(refused, vec![-32106; 4]);

    // The grant widens it.
    env.grant(
        "dave",
        TOOL,
        IMAGE,
        Some(ImageGrant {
            max_per_invoke: Some(6),
            ..ImageGrant::default()
        }),
    )
    .await;
    let wide = image_tokens(&env.services, "dave", "inv-6").await;
    let call = |n: u32| {
        env.services.serve(reverse_call(
            "dave",
            "inv-6",
            "image/generate",
            json!({"prompt": "x", "n": n}),
            wide.clone(),
        ))
    };
    for _ in 0..3 {
        call(2).await.expect("2 more, up to 6");
    }
    let e = call(1).await.expect_err("the 7th");
    assert_eq!(
        (e.code, e.data.as_ref().map(|d| d["maxImages"].clone())),
        (-32106, Some(json!(6)))
    );
}

/// The tokens of an invoke of [`TOOL`] that negotiated `image` and declares `llm.image` (calls served directly).
async fn image_tokens(services: &FleetServices, user: &str, invoke_id: &str) -> InvokeTokens {
    <FleetServices as TokenSource>::tokens(
        services,
        TokenRequest {
            user: user.into(),
            tool_id: TOOL.into(),
            invoke_id: invoke_id.into(),
            negotiated: ["image".to_owned()].into(),
            declared: vec!["llm.image".into()],
            credentials: Vec::new(),
            deadline_ms: now_ms() + 60_000,
        },
    )
    .await
}

fn reverse_call(
    user: &str,
    invoke_id: &str,
    method: &str,
    params: Value,
    tokens: InvokeTokens,
) -> ReverseCall {
    ReverseCall {
        user: user.into(),
        tool_id: TOOL.into(),
        invoke_id: invoke_id.into(),
        tool: "run".into(),
        method: method.into(),
        family: family_of(method).expect("image family"),
        params,
        client_timeout_s: None,
        deadline_ms: now_ms() + 60_000,
        tokens,
    }
}

// -------------------------------------------------------------------------------------------------------------
// Validation, references, model support
// -------------------------------------------------------------------------------------------------------------

/// Every `-32104` of the spec, the reference count (4 accepted and sent as the input images of an edit
/// request, 5 refused), references under the SSRF policy (`-32314`), and model support (`-32311`, `-32312`).
#[tokio::test]
async fn validation_references_and_model_support() {
    let env = env("img-valid").await;
    env.grant(
        "alice",
        TOOL,
        BOTH,
        Some(ImageGrant {
            max_per_call: Some(8),
            max_images_per_day: None,
            max_per_invoke: Some(8),
        }),
    )
    .await;
    for bad in [
        json!({"prompt": ""}),
        json!({"prompt": "  \n"}),
        json!({"n": 1}),
        json!({"prompt": "x", "n": 0}),
        json!({"prompt": "x", "size": "huge"}),
        json!({"prompt": "x", "quality": "ultra"}),
        json!({"prompt": "x", "resolution": "3K"}),
        json!({"prompt": "x", "output_format": "bmp"}),
        json!({"prompt": "x", "thinking_level": "deep"}),
        json!({"prompt": "x", "reference_image_urls": [7]}),
        json!({"prompt": "x", "size": "512x512", "modelPreferences": {"hints": [{"name": "sized"}]}}),
    ] {
        let r = env.generate("alice", bad.clone()).await;
        assert_eq!(err(&r).0, -32104, "{bad}: {r}");
    }
    let first = env.generate("alice", json!({"prompt": "x", "n": 4})).await;
    let links: Vec<Value> = ok(&first)["images"]
        .as_array()
        .expect("images")
        .iter()
        .map(|i| i["url"].clone())
        .collect();
    let with_refs = |refs: Vec<Value>| json!({"prompt": "in this style", "reference_image_urls": refs});
    let r = env.generate("alice", with_refs(links.clone())).await;
    ok(&r);
    let sent = env.fake.requests();
    let edit = sent.last().expect("request");
    assert_eq!(
        edit.path, EDITS,
        "references go as the input images of an edit request"
    );
    assert_eq!(edit.parts.iter().filter(|p| p.name == "image[]").count(), 4);
    let mut five = links.clone();
    five.push(links[0].clone());
    assert_eq!(
        err(&env.generate("alice", with_refs(five)).await).0,
        -32104,
        "5 references"
    );

    let own_origin = env.fake.base_url().replace("/v1", "/v1/files/img-0.png");
    for url in [
        own_origin.as_str(),
        "http://10.0.0.1/a.png",
        "http://169.254.169.254/latest/meta-data",
        "http://[::ffff:127.0.0.1]/a.png",
        "http://2130706433/a.png",
        "file:///etc/passwd",
        "/v1/files/u/Zm9v?exp=1&d=inline&fn=eA&sig=00",
    ] {
        let r = env.generate("alice", with_refs(vec![json!(url)])).await;
        let (code, _, data) = err(&r);
        assert_eq!(
            (code, data["field"].as_str()),
            (-32314, Some("reference_image_urls[0]")),
            "{url}: {r}"
        );
        let message = r["error"]["message"].as_str().unwrap_or_default();
        assert!(
            !message.contains("sig=") && !message.contains("169.254"),
            "{message}"
        );
    }

    let hinted = |name: &str, extra: Value| {
        let mut p =
            json!({"prompt": "x", "image_url": links[0], "modelPreferences": {"hints": [{"name": name}]}});
        if let (Some(p), Some(e)) = (p.as_object_mut(), extra.as_object()) {
            p.extend(e.clone());
        }
        p
    };
    let (code, name, _) = err(&env.edit("alice", hinted("gen-only", json!({}))).await);
    assert_eq!((code, name.as_str()), (-32311, "EDIT_NOT_SUPPORTED"));
    let r = env
        .generate("alice", json!({"prompt": "x", "reference_image_urls": [links[0]], "modelPreferences": {"hints": [{"name": "gen-only"}]}}))
        .await;
    assert_eq!(err(&r).0, -32311);
    let masked = hinted("no-mask", json!({"mask_url": links[1]}));
    let (code, name, _) = err(&env.edit("alice", masked).await);
    assert_eq!((code, name.as_str()), (-32312, "MASK_UNSUPPORTED"));
}

// -------------------------------------------------------------------------------------------------------------
// Provider failures and timeouts
// -------------------------------------------------------------------------------------------------------------

/// Provider errors are `-32103` with `data.subcall == "image"`, the status and the upstream's short code,
/// never its body (nor the prompt, nor the key); an answer that is not an image is `-32103`; an upstream that
/// does not answer within `_clientTimeoutS` is `-32103` with `data.timeout_s`; one cut by the invoke's
/// deadline is `-32105`. None of them counts against the quota.
#[tokio::test]
async fn provider_failures_and_timeouts() {
    let env = env("img-fail").await;
    env.grant("alice", TOOL, IMAGE, None).await;
    for (answer, status, code) in [
        (Answer::Error(500, "server_error".into()), 500, "server_error"),
        (
            Answer::Error(400, "content_policy_violation".into()),
            400,
            "content_policy_violation",
        ),
    ] {
        env.fake.answer(answer);
        let r = env.generate("alice", json!({"prompt": "secret prompt"})).await;
        let (c, name, data) = err(&r);
        assert_eq!((c, name.as_str()), (-32103, "IMAGE_PROVIDER_ERROR"));
        assert_eq!(data["subcall"], "image");
        assert!(
            data["timeout_s"].as_f64().is_some_and(|t| t > 0.0 && t <= 180.0),
            "the subcall's timeout (the default, cut by the invoke's deadline): {data}"
        );
        assert_eq!(
            (data["status"].clone(), data["upstreamCode"].clone()),
            (json!(status), json!(code))
        );
        let shown = r.to_string();
        assert!(
            !shown.contains("sk-") && !shown.contains("secret prompt") && !shown.contains("fake failure"),
            "{shown}"
        );
    }
    env.fake.answer(Answer::NotAnImage);
    assert_eq!(
        err(&env.generate("alice", json!({"prompt": "x"})).await).0,
        -32103
    );

    env.fake.answer(Answer::Hang);
    let r = env
        .generate("alice", json!({"prompt": "x", "_clientTimeoutS": 1}))
        .await;
    let (code, _, data) = err(&r);
    assert_eq!(
        (code, data["subcall"].clone(), data["timeout_s"].clone()),
        (-32103, json!("image"), json!(1.0))
    );

    // The invoke's deadline cuts the call: -32105 (served directly, with a deadline a second away).
    let tokens = image_tokens(&env.services, "alice", "deadline").await;
    let mut call = reverse_call(
        "alice",
        "deadline",
        "image/generate",
        json!({"prompt": "x"}),
        tokens,
    );
    call.deadline_ms = now_ms() + 1_000;
    let e: ErrorObject = env.services.serve(call).await.expect_err("cut by the deadline");
    assert_eq!((e.code, e.error_code()), (-32105, Some("IMAGE_TIMEOUT")));
    let data = e.data.expect("data");
    assert_eq!(data["subcall"], "image");
    assert!(data["timeout_s"].as_f64().is_some_and(|t| t <= 1.0), "{data}");

    env.fake.answer(Answer::B64);
    let r = env.generate("alice", json!({"prompt": "x"})).await;
    assert_eq!(ok(&r)["quota_used"]["images_today"], 1, "no failure was counted");
}

// -------------------------------------------------------------------------------------------------------------
// Preconditions
// -------------------------------------------------------------------------------------------------------------

/// Not negotiated (`image` not claimed, or `llm.image` not declared) is `-32107` whatever the grant; not
/// granted is `-32101`; the calls never reach the provider.
#[tokio::test]
async fn not_negotiated_and_not_granted() {
    let env = env("img-pre").await;
    let r = env
        .rpc("alice", TOOL, "image/generate", json!({"prompt": "x"}))
        .await;
    assert_eq!(err(&r).0, -32101, "no grant");
    for tool in [UNCLAIMED, UNDECLARED] {
        env.grant("alice", tool, BOTH, None).await;
        let r = env
            .rpc("alice", tool, "image/generate", json!({"prompt": "x"}))
            .await;
        let (code, name, _) = err(&r);
        assert_eq!((code, name.as_str()), (-32107, "IMAGE_NOT_NEGOTIATED"), "{tool}");
    }
    assert!(env.fake.requests().is_empty());
    assert!(HostServices::offer(&env.services).contains_key("image"));
}

/// Without `[image]`, `image/*` is not offered in `initialize` and answers `-32109` (granted or not).
#[tokio::test]
async fn without_a_provider_the_family_is_not_offered_and_answers_32109() {
    let env = Box::pin(env_with("img-none", false, false)).await;
    let offer = HostServices::offer(&env.services);
    assert!(
        !offer.contains_key("image") && !offer.contains_key("image.edit"),
        "{offer:?}"
    );
    env.grant("alice", TOOL, BOTH, None).await;
    for method in ["image/generate", "image/edit"] {
        let r = env
            .rpc("alice", TOOL, method, json!({"prompt": "x", "image_url": "/x"}))
            .await;
        let (code, name, _) = err(&r);
        assert_eq!(
            (code, name.as_str()),
            (-32109, "IMAGE_NO_MODEL_AVAILABLE"),
            "{method}"
        );
    }
}

/// A front without `[image]` still creates the quota bucket, so a worker that has `[image]` serves images.
#[tokio::test]
async fn a_worker_with_images_works_behind_a_front_without() {
    let env = Box::pin(env_with("img-front", true, false)).await;
    assert!(env.admin.image().is_none());
    env.grant("alice", TOOL, IMAGE, None).await;
    let r = env.generate("alice", json!({"prompt": "x"})).await;
    assert_eq!(ok(&r)["quota_used"]["images_today"], 1);
}
