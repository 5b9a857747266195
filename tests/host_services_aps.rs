//! APS KV (`storage/*`), APS files (`files/*`) and `host/uploadFile` on a real nats-server (JetStream KV and
//! object store), with real per-invoke tokens minted by `FleetServices`, and the signed links served over real
//! HTTP by the fleet's file routes.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use fleet::nats_server::NatsServer;
use fleet_proto::executa::reverse::family_of;
use fleet_proto::jsonrpc::ErrorObject;
use fleet_proto::util::now_ms;
use fleet_services::credentials::Keyring;
use fleet_services::files::{HostObjects, LinkSigner};
use fleet_services::kv::StorageConfig;
use fleet_services::{FleetServices, ServicesConfig};
use fleet_store::StoreSettings;
use fleet_worker::services::{InvokeTokens, ReverseCall, TokenRequest, TokenSource};
use serde_json::{Value, json};

const SECRET: &[u8] = b"aps-test-link-signing-secret";
const MIB: usize = 1024 * 1024;

static NEXT_INVOKE: AtomicU64 = AtomicU64::new(1);

struct Env {
    /// The services under test: a worker's.
    services: FleetServices,
    /// The front's services (grant edits).
    admin: FleetServices,
    base: String,
    http: reqwest::Client,
    /// A front's JetStream (to look at the stores as they are).
    js: async_nats::jetstream::Context,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
    _nats: NatsServer,
    _root: tempfile::TempDir,
}

impl Drop for Env {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// One invoke of one plugin for one user, with its real tokens.
#[derive(Clone)]
struct Invoke {
    user: String,
    tool_id: String,
    invoke_id: String,
    deadline_ms: u64,
    tokens: InvokeTokens,
}

async fn env(quota_bytes: Option<u64>) -> Env {
    env_with(quota_bytes, false).await
}

/// `absolute`: configure `public_url`, so links are absolute. Boxed: the setup's future is large.
fn env_with(
    quota_bytes: Option<u64>,
    absolute: bool,
) -> std::pin::Pin<Box<impl std::future::Future<Output = Env>>> {
    Box::pin(make_env(quota_bytes, absolute, StoreSettings::default()))
}

async fn make_env(quota_bytes: Option<u64>, absolute: bool, settings: StoreSettings) -> Env {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let root = tempfile::tempdir().expect("tempdir");
    let nats = NatsServer::start(&root.path().join("nats")).expect("nats-server (run scripts/test.sh once)");
    // A front creates the resources and edits grants; the services under test are a worker's (its user, its
    // attached resources), as in production.
    let front = nats
        .connect(fleet_client::creds::Role::Front)
        .await
        .expect("connect");
    let front_js = async_nats::jetstream::new(front);
    let js = front_js.clone();
    let client = nats
        .connect(fleet_client::creds::Role::Worker)
        .await
        .expect("connect");
    let worker_js = async_nats::jetstream::new(client);
    let config = ServicesConfig {
        storage: StorageConfig { quota_bytes },
        public_url: absolute.then(|| format!("{base}/")),
        ..Default::default()
    };
    let admin = Box::pin(FleetServices::open(
        &front_js,
        &settings,
        &config,
        LinkSigner::new(SECRET),
        Keyring::fixed(&[("k1", [7; 32])]),
    ))
    .await
    .expect("services (front)");
    let worker_settings = StoreSettings {
        provision: fleet_store::Provision::Attach,
        ..settings.clone()
    };
    let services = Box::pin(FleetServices::open(
        &worker_js,
        &worker_settings,
        &config,
        LinkSigner::new(SECRET),
        Keyring::fixed(&[("k1", [7; 32])]),
    ))
    .await
    .expect("services (worker)");
    // The HTTP side opens its own handles, like a front process would.
    let objects = HostObjects::open(&front_js, &settings, LinkSigner::new(SECRET), None)
        .await
        .expect("objects");
    let server = tokio::spawn(fleet::http::files::serve(listener, objects));
    Env {
        services,
        admin,
        base,
        http: reqwest::Client::new(),
        js,
        server,
        _nats: nats,
        _root: root,
    }
}

impl Env {
    async fn invoke(&self, user: &str, tool_id: &str) -> Invoke {
        self.invoke_on(&self.services, user, tool_id).await
    }

    /// An invoke whose tokens `services` minted (and only it verifies).
    async fn invoke_on(&self, services: &FleetServices, user: &str, tool_id: &str) -> Invoke {
        let caps: Vec<String> = ["aps.kv", "aps.files", "host.upload"].map(String::from).to_vec();
        self.admin
            .grants()
            .edit(user, tool_id, &caps, &[])
            .await
            .expect("grant");
        let invoke_id = format!("inv-{}-{}", now_ms(), NEXT_INVOKE.fetch_add(1, Ordering::Relaxed));
        let deadline_ms = now_ms() + 600_000;
        let tokens = <FleetServices as TokenSource>::tokens(
            services,
            TokenRequest {
                user: user.to_owned(),
                tool_id: tool_id.to_owned(),
                invoke_id: invoke_id.clone(),
                negotiated: BTreeSet::from(["storage".to_owned(), "upload".to_owned()]),
                declared: caps,
                credentials: Vec::new(),
                deadline_ms,
            },
        )
        .await;
        assert!(
            tokens.storage.is_some() && tokens.upload.is_some(),
            "tokens minted"
        );
        Invoke {
            user: user.to_owned(),
            tool_id: tool_id.to_owned(),
            invoke_id,
            deadline_ms,
            tokens,
        }
    }

    async fn call(&self, inv: &Invoke, method: &str, params: Value) -> Result<Value, ErrorObject> {
        self.call_within(inv, method, params, None).await
    }

    /// A call with the SDK's `_clientTimeoutS`.
    async fn call_within(
        &self,
        inv: &Invoke,
        method: &str,
        params: Value,
        client_timeout_s: Option<f64>,
    ) -> Result<Value, ErrorObject> {
        self.services
            .serve(ReverseCall {
                user: inv.user.clone(),
                tool_id: inv.tool_id.clone(),
                invoke_id: inv.invoke_id.clone(),
                tool: "run".into(),
                method: method.to_owned(),
                family: family_of(method).expect("a known family"),
                params,
                client_timeout_s,
                deadline_ms: inv.deadline_ms,
                tokens: inv.tokens.clone(),
            })
            .await
    }

    async fn ok(&self, inv: &Invoke, method: &str, params: Value) -> Value {
        match self.call(inv, method, params.clone()).await {
            Ok(v) => v,
            Err(e) => panic!("{method} {params}: {e:?}"),
        }
    }

    async fn err(&self, inv: &Invoke, method: &str, params: Value) -> ErrorObject {
        match self.call(inv, method, params.clone()).await {
            Ok(v) => panic!("{method} {params}: expected an error, got {v}"),
            Err(e) => e,
        }
    }

    /// Exactly `bytes` of the user's quota are free: a value of that size fits, one byte more does not.
    async fn assert_free(&self, inv: &Invoke, bytes: usize) {
        // A JSON string value counts its quotes.
        self.ok(
            inv,
            "storage/set",
            json!({"scope": "tool", "key": "rest", "value": "x".repeat(bytes - 2)}),
        )
        .await;
        let e = self
            .err(
                inv,
                "storage/set",
                json!({"scope": "tool", "key": "one", "value": 1}),
            )
            .await;
        assert_eq!(e.code, -32024, "{e:?}");
    }

    fn url(&self, link: &Value) -> String {
        let link = link.as_str().expect("a link string");
        if link.starts_with(&self.base) {
            return link.to_owned();
        }
        assert!(
            link.starts_with("/v1/files/"),
            "relative link without public_url: {link}"
        );
        format!("{}{link}", self.base)
    }
}

fn code_name(e: &ErrorObject) -> (i64, String) {
    let name = e
        .data
        .as_ref()
        .and_then(|d| d.get("errorCode"))
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    (e.code, name)
}

/// Polls an async condition until it holds (a failure guard: it returns as soon as the observable holds).
async fn eventually<F, Fut>(limit: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    loop {
        if cond().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ------------------------------------------------------------------------------------------------------------
// storage/*
// ------------------------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storage_get_set_delete_with_if_match_by_etag_and_generation() {
    let env = env(None).await;
    let inv = env.invoke("alice", "notes").await;
    let miss = env
        .ok(&inv, "storage/get", json!({"scope": "tool", "key": "a/b"}))
        .await;
    assert_eq!(miss, json!({"value": null, "exists": false, "etag": null}));

    let set = env
        .ok(
            &inv,
            "storage/set",
            json!({"scope": "tool", "key": "a/b", "value": {"b": 2, "a": [1]}}),
        )
        .await;
    let etag = set["etag"].as_str().expect("etag").to_owned();
    assert_eq!(etag.len(), 32);
    assert!(etag.bytes().all(|b| b.is_ascii_hexdigit()));
    let gen1 = set["generation"].as_u64().expect("generation");
    assert_eq!(set["size_bytes"], json!(r#"{"a":[1],"b":2}"#.len()));

    let hit = env
        .ok(&inv, "storage/get", json!({"scope": "tool", "key": "a/b"}))
        .await;
    assert_eq!(hit["exists"], json!(true));
    assert_eq!(hit["value"], json!({"a": [1], "b": 2}));
    assert_eq!(hit["etag"], json!(etag));
    assert_eq!(hit["generation"], json!(gen1));

    // The same value with members in another order has the same etag (canonical JSON); generation bumps.
    let again = env
        .ok(
            &inv,
            "storage/set",
            json!({"scope": "tool", "key": "a/b", "value": {"a": [1], "b": 2}, "if_match": etag}),
        )
        .await;
    assert_eq!(again["etag"], json!(etag));
    let gen2 = again["generation"].as_u64().expect("generation");
    assert!(gen2 > gen1);

    // Mismatches: a wrong etag, a stale generation, and if_match on a missing key.
    let e = env
        .err(
            &inv,
            "storage/set",
            json!({"scope": "tool", "key": "a/b", "value": 1, "if_match": "0".repeat(32)}),
        )
        .await;
    assert_eq!(code_name(&e), (-32023, "PRECONDITION_FAILED".into()));
    let e = env
        .err(
            &inv,
            "storage/set",
            json!({"scope": "tool", "key": "a/b", "value": 1, "if_match": gen1}),
        )
        .await;
    assert_eq!(e.code, -32023);
    let e = env
        .err(
            &inv,
            "storage/set",
            json!({"scope": "tool", "key": "nope", "value": 1, "if_match": etag}),
        )
        .await;
    assert_eq!(e.code, -32023);
    // The current generation (as a number, then as a digit string) matches.
    let v3 = env
        .ok(
            &inv,
            "storage/set",
            json!({"scope": "tool", "key": "a/b", "value": 3, "if_match": gen2}),
        )
        .await;
    let gen3 = v3["generation"].as_u64().expect("generation");
    let v4 = env
        .ok(
            &inv,
            "storage/set",
            json!({"scope": "tool", "key": "a/b", "value": 4, "if_match": gen3.to_string()}),
        )
        .await;

    let e = env
        .err(
            &inv,
            "storage/delete",
            json!({"scope": "tool", "key": "a/b", "if_match": gen3}),
        )
        .await;
    assert_eq!(e.code, -32023);
    let del = env
        .ok(
            &inv,
            "storage/delete",
            json!({"scope": "tool", "key": "a/b", "if_match": v4["etag"]}),
        )
        .await;
    assert_eq!(del, json!({"deleted": true}));
    let miss = env
        .ok(&inv, "storage/get", json!({"scope": "tool", "key": "a/b"}))
        .await;
    assert_eq!(miss["exists"], json!(false));
    assert_eq!(
        env.ok(&inv, "storage/delete", json!({"scope": "tool", "key": "a/b"}))
            .await,
        json!({"deleted": false})
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_with_ttl_expires_and_reads_as_absent() {
    let env = env(Some(10_000)).await;
    let inv = env.invoke("alice", "notes").await;
    env.ok(
        &inv,
        "storage/set",
        json!({"scope": "user", "key": "short", "value": "x", "ttl_seconds": 1}),
    )
    .await;
    let hit = env
        .ok(&inv, "storage/get", json!({"scope": "user", "key": "short"}))
        .await;
    assert_eq!(hit["exists"], json!(true));
    assert!(hit["expires_at"].is_string());
    let expired = eventually(Duration::from_secs(10), || {
        let env = &env;
        let inv = &inv;
        async move {
            env.ok(inv, "storage/get", json!({"scope": "user", "key": "short"}))
                .await
                .get("exists")
                == Some(&json!(false))
        }
    })
    .await;
    assert!(expired, "the key expired");
    let listed = env.ok(&inv, "storage/list", json!({"scope": "user"})).await;
    assert_eq!(listed["items"], json!([]));
    // The expired value's bytes were released: the whole quota is available again.
    let big = "y".repeat(10_000 - 2);
    env.ok(
        &inv,
        "storage/set",
        json!({"scope": "user", "key": "big", "value": big}),
    )
    .await;
    for bad in [json!(0), json!(31_536_001), json!("1")] {
        let e = env
            .err(
                &inv,
                "storage/set",
                json!({"scope": "user", "key": "k", "value": 1, "ttl_seconds": bad}),
            )
            .await;
        assert_eq!(e.code, -32028, "ttl {bad}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_pages_through_sorted_keys_with_an_opaque_cursor() {
    let env = env(None).await;
    let inv = env.invoke("alice", "notes").await;
    for i in (0..25).rev() {
        env.ok(
            &inv,
            "storage/set",
            json!({"scope": "tool", "key": format!("k/{i:02}"), "value": i}),
        )
        .await;
    }
    env.ok(
        &inv,
        "storage/set",
        json!({"scope": "tool", "key": "other", "value": 0}),
    )
    .await;

    let mut seen = Vec::new();
    let mut cursor = Value::Null;
    let mut pages = 0;
    loop {
        let page = env
            .ok(
                &inv,
                "storage/list",
                json!({"scope": "tool", "prefix": "k/", "limit": 10, "cursor": cursor}),
            )
            .await;
        pages += 1;
        for item in page["items"].as_array().expect("items") {
            assert!(item.get("value").is_none(), "heads only: {item}");
            let n: u32 = item["key"]
                .as_str()
                .and_then(|k| k.strip_prefix("k/"))
                .and_then(|n| n.parse().ok())
                .expect("k/NN");
            assert_eq!(item["size_bytes"], json!(n.to_string().len()), "{item}");
            seen.push(item["key"].as_str().expect("key").to_owned());
        }
        cursor = page["next_cursor"].clone();
        if cursor.is_null() {
            break;
        }
    }
    assert_eq!(pages, 3);
    let want: Vec<String> = (0..25).map(|i| format!("k/{i:02}")).collect();
    assert_eq!(seen, want);

    // limit is clamped silently: 0 → 1, 5000 → 1000.
    let one = env
        .ok(&inv, "storage/list", json!({"scope": "tool", "limit": 0}))
        .await;
    assert_eq!(one["items"].as_array().map(Vec::len), Some(1));
    let all = env
        .ok(&inv, "storage/list", json!({"scope": "tool", "limit": 5000}))
        .await;
    assert_eq!(all["items"].as_array().map(Vec::len), Some(26));
    assert!(all["next_cursor"].is_null());
    let e = env
        .err(&inv, "storage/list", json!({"scope": "tool", "prefix": "/k"}))
        .await;
    assert_eq!(e.code, -32027);
    let e = env
        .err(&inv, "storage/list", json!({"scope": "tool", "cursor": "%%%"}))
        .await;
    assert_eq!(e.code, -32028);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quota_refuses_at_the_first_byte_over_and_deletes_release() {
    let env = env(Some(1000)).await;
    let inv = env.invoke("bob", "notes").await;
    let s = |n: usize| json!("x".repeat(n - 2)); // a JSON string of n bytes
    env.ok(
        &inv,
        "storage/set",
        json!({"scope": "tool", "key": "a", "value": s(600)}),
    )
    .await;
    env.ok(
        &inv,
        "storage/set",
        json!({"scope": "user", "key": "b", "value": s(400)}),
    )
    .await;
    let e = env
        .err(
            &inv,
            "storage/set",
            json!({"scope": "tool", "key": "c", "value": 1}),
        )
        .await;
    assert_eq!(code_name(&e), (-32024, "QUOTA_EXCEEDED".into()));
    // Shrinking an overwrite releases the difference: exactly one byte.
    env.ok(
        &inv,
        "storage/set",
        json!({"scope": "tool", "key": "a", "value": s(599)}),
    )
    .await;
    env.ok(
        &inv,
        "storage/set",
        json!({"scope": "tool", "key": "c", "value": 1}),
    )
    .await;
    let e = env
        .err(
            &inv,
            "storage/set",
            json!({"scope": "tool", "key": "d", "value": 1}),
        )
        .await;
    assert_eq!(e.code, -32024);
    // Growing an overwrite needs room for the growth only.
    let e = env
        .err(
            &inv,
            "storage/set",
            json!({"scope": "tool", "key": "a", "value": s(600)}),
        )
        .await;
    assert_eq!(e.code, -32024);
    env.ok(&inv, "storage/delete", json!({"scope": "tool", "key": "c"}))
        .await;
    env.ok(
        &inv,
        "storage/set",
        json!({"scope": "tool", "key": "a", "value": s(600)}),
    )
    .await;
    // Another user has a quota of their own.
    let other = env.invoke("carol", "notes").await;
    env.ok(
        &other,
        "storage/set",
        json!({"scope": "tool", "key": "a", "value": s(1000)}),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scopes_keys_and_values_are_checked_at_their_boundaries() {
    let env = env(None).await;
    let inv = env.invoke("alice", "notes").await;
    let e = env
        .err(&inv, "storage/get", json!({"scope": "app", "key": "k"}))
        .await;
    assert_eq!(code_name(&e), (-32029, "UPSTREAM_ERROR".into()));
    assert_eq!(
        e.message,
        "storage_token does not permit scope='app'; allowed=['tool', 'user']"
    );
    let e = env.err(&inv, "files/list", json!({"scope": "app"})).await;
    assert_eq!(
        e.message,
        "storage_token does not permit scope='app'; allowed=['tool', 'user']"
    );
    let e = env
        .err(&inv, "storage/get", json!({"scope": "galaxy", "key": "k"}))
        .await;
    assert_eq!(e.code, -32028);

    // tool scope is per (user, tool); user scope is shared by the user's plugins; users never see each other.
    env.ok(
        &inv,
        "storage/set",
        json!({"scope": "tool", "key": "t", "value": 1}),
    )
    .await;
    env.ok(
        &inv,
        "storage/set",
        json!({"scope": "user", "key": "u", "value": 2}),
    )
    .await;
    let sibling = env.invoke("alice", "other-tool").await;
    let get = |inv: Invoke, scope: &'static str, key: &'static str| {
        let env = &env;
        async move {
            env.ok(&inv, "storage/get", json!({"scope": scope, "key": key}))
                .await["exists"]
                .clone()
        }
    };
    assert_eq!(get(sibling.clone(), "tool", "t").await, json!(false));
    assert_eq!(get(sibling.clone(), "user", "u").await, json!(true));
    let stranger = env.invoke("mallory", "notes").await;
    assert_eq!(get(stranger.clone(), "tool", "t").await, json!(false));
    assert_eq!(get(stranger, "user", "u").await, json!(false));
    // Omitted scope defaults to tool.
    assert_eq!(
        env.ok(&inv, "storage/get", json!({"key": "t"})).await["value"],
        json!(1)
    );

    // Keys: 1024 characters are fine, 1025 are not; nor is an empty key.
    let k1024 = "é".repeat(1024);
    env.ok(
        &inv,
        "storage/set",
        json!({"scope": "tool", "key": k1024, "value": true}),
    )
    .await;
    assert_eq!(
        env.ok(&inv, "storage/get", json!({"scope": "tool", "key": k1024}))
            .await["value"],
        json!(true)
    );
    for bad in ["k".repeat(1025), String::new()] {
        let e = env
            .err(
                &inv,
                "storage/set",
                json!({"scope": "tool", "key": bad, "value": 1}),
            )
            .await;
        assert_eq!(code_name(&e), (-32027, "INVALID_PATH".into()));
    }
    let e = env
        .err(&inv, "storage/set", json!({"scope": "tool", "key": "k"}))
        .await;
    assert_eq!(e.code, -32028, "value is required");

    // Values: exactly 256 KiB of canonical JSON is stored, one byte more is refused.
    let max = 256 * 1024;
    let v = json!("v".repeat(max - 2));
    let set = env
        .ok(
            &inv,
            "storage/set",
            json!({"scope": "tool", "key": "big", "value": v}),
        )
        .await;
    assert_eq!(set["size_bytes"], json!(max));
    assert_eq!(
        env.ok(&inv, "storage/get", json!({"scope": "tool", "key": "big"}))
            .await["value"],
        v
    );
    let e = env
        .err(
            &inv,
            "storage/set",
            json!({"scope": "tool", "key": "big2", "value": "v".repeat(max - 1)}),
        )
        .await;
    assert_eq!(code_name(&e), (-32025, "VALUE_TOO_LARGE".into()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_200th_storage_call_is_admitted_and_the_201st_is_rate_limited() {
    let env = env(None).await;
    let inv = env.invoke("alice", "notes").await;
    for i in 0..200 {
        let method = if i % 2 == 0 { "storage/get" } else { "files/list" };
        let params = if i % 2 == 0 {
            json!({"key": "k"})
        } else {
            json!({})
        };
        env.ok(&inv, method, params).await;
    }
    let e = env.err(&inv, "storage/get", json!({"key": "k"})).await;
    assert_eq!(code_name(&e), (-32026, "RATE_LIMITED".into()));
    assert_eq!(
        e.data.as_ref().and_then(|d| d.get("reason")),
        Some(&json!("invoke_budget"))
    );
    // Another invoke has its own budget.
    let next = env.invoke("alice", "notes").await;
    env.ok(&next, "storage/get", json!({"key": "k"})).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_invokes_tokens_are_refused() {
    let env = env(None).await;
    let a = env.invoke("alice", "notes").await;
    let b = env.invoke("alice", "notes").await;
    let stolen = Invoke {
        tokens: a.tokens.clone(),
        ..b.clone()
    };
    let e = env.err(&stolen, "storage/get", json!({"key": "k"})).await;
    assert_eq!(code_name(&e), (-32021, "STORAGE_NOT_GRANTED".into()));
    let e = env.err(&stolen, "files/list", json!({})).await;
    assert_eq!(e.code, -32021);
    let e = env
        .err(
            &stolen,
            "host/uploadFile",
            json!({"mode": "inline", "filename": "a.txt", "mime_type": "text/plain", "content_b64": "aGk="}),
        )
        .await;
    assert_eq!(code_name(&e), (-32201, "UPLOAD_NOT_GRANTED".into()));
    let none = Invoke {
        tokens: InvokeTokens::default(),
        ..b.clone()
    };
    let e = env.err(&none, "storage/get", json!({"key": "k"})).await;
    assert_eq!(e.code, -32021);
    env.ok(&b, "storage/get", json!({"key": "k"})).await;
}

// ------------------------------------------------------------------------------------------------------------
// files/*
// ------------------------------------------------------------------------------------------------------------

/// `upload_begin` → PUT → `upload_complete`; returns the complete result.
async fn put_file(env: &Env, inv: &Invoke, scope: &str, path: &str, ct: &str, bytes: &[u8]) -> Value {
    let begin = env
        .ok(
            inv,
            "files/upload_begin",
            json!({"scope": scope, "path": path, "content_type": ct, "size_bytes": bytes.len()}),
        )
        .await;
    assert_eq!(begin["put_url"], begin["presigned_url"]);
    assert_eq!(begin["headers"]["Content-Type"], json!(ct));
    let put = env
        .http
        .put(env.url(&begin["put_url"]))
        .header("content-type", ct)
        .body(bytes.to_vec())
        .send()
        .await
        .expect("PUT");
    assert_eq!(put.status(), 200, "{}", put.text().await.unwrap_or_default());
    env.ok(
        inv,
        "files/upload_complete",
        json!({"scope": scope, "path": path}),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_round_trip_through_the_object_store_and_the_download_link() {
    let env = env(Some(1_000_000)).await;
    let inv = env.invoke("alice", "notes").await;
    let pdf: Vec<u8> = (0..300_000_u32).map(|i| (i % 251) as u8).collect();
    let done = put_file(&env, &inv, "user", "docs/report.pdf", "application/pdf", &pdf).await;
    assert_eq!(done["size_bytes"], json!(pdf.len()));
    assert_eq!(done["path"], json!("docs/report.pdf"));
    put_file(&env, &inv, "user", "docs/notes.txt", "text/plain", b"hello").await;

    let link = env
        .ok(
            &inv,
            "files/download_url",
            json!({"scope": "user", "path": "docs/report.pdf"}),
        )
        .await;
    assert_eq!(link["url"], link["get_url"]);
    assert_eq!(link["expires_in"], json!(300));
    let resp = env.http.get(env.url(&link["url"])).send().await.expect("GET");
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "application/pdf");
    let cd = resp.headers()["content-disposition"]
        .to_str()
        .expect("ascii")
        .to_owned();
    assert!(cd.starts_with("inline; filename=\"report.pdf\""), "{cd}");
    assert_eq!(resp.bytes().await.expect("body").as_ref(), pdf.as_slice());

    let link = env
        .ok(
            &inv,
            "files/download_url",
            json!({"scope": "user", "path": "docs/notes.txt", "expires_in": 60}),
        )
        .await;
    assert_eq!(link["expires_in"], json!(60));
    let resp = env.http.get(env.url(&link["get_url"])).send().await.expect("GET");
    // Plain text is inline (a browser runs nothing of it; `nosniff`); HTML and the rest are attachments
    // (tests/user_content.rs).
    assert!(
        resp.headers()["content-disposition"]
            .to_str()
            .expect("ascii")
            .starts_with("inline")
    );
    assert_eq!(
        resp.headers()["content-security-policy"],
        fleet::http::files::USER_CONTENT_CSP
    );
    assert_eq!(resp.text().await.expect("body"), "hello");

    let list = env
        .ok(&inv, "files/list", json!({"scope": "user", "prefix": "docs/"}))
        .await;
    let paths: Vec<&str> = list["items"]
        .as_array()
        .expect("items")
        .iter()
        .filter_map(|i| i["path"].as_str())
        .collect();
    assert_eq!(paths, ["docs/notes.txt", "docs/report.pdf"]);
    assert_eq!(list["items"][1]["content_type"], json!("application/pdf"));
    let e = env
        .err(&inv, "files/list", json!({"scope": "user", "limit": 0}))
        .await;
    assert_eq!(e.code, -32027, "files/list refuses a bad limit (spec A-28)");
    // The tool scope does not see user-scope files.
    let e = env
        .err(
            &inv,
            "files/download_url",
            json!({"scope": "tool", "path": "docs/notes.txt"}),
        )
        .await;
    assert_eq!(code_name(&e), (-32022, "NOT_FOUND".into()));

    // Files count against the same quota as KV values.
    let e = env
        .err(&inv, "files/upload_begin", json!({"scope": "user", "path": "huge.bin", "content_type": "application/octet-stream", "size_bytes": 700_000}))
        .await;
    assert_eq!(e.code, -32024);
    let e = env
        .err(
            &inv,
            "files/upload_begin",
            json!({"scope": "user", "path": "x.bin", "content_type": "a/b", "size_bytes": 256 * MIB + 1}),
        )
        .await;
    assert_eq!(e.code, -32025);
    for bad in ["/abs", "a/../b", "a\\b", "a\u{202E}b"] {
        let e = env
            .err(
                &inv,
                "files/upload_begin",
                json!({"scope": "user", "path": bad, "content_type": "a/b", "size_bytes": 1}),
            )
            .await;
        assert_eq!(e.code, -32027, "{bad:?}");
    }

    // The PUT is held to the signed content type and size; complete before the bytes landed is pending.
    let begin = env
        .ok(
            &inv,
            "files/upload_begin",
            json!({"scope": "tool", "path": "p.txt", "content_type": "text/plain", "size_bytes": 4}),
        )
        .await;
    let e = env
        .err(
            &inv,
            "files/upload_complete",
            json!({"scope": "tool", "path": "p.txt"}),
        )
        .await;
    assert_eq!(e.code, -32029);
    assert_eq!(
        e.data.as_ref().and_then(|d| d.get("reason")),
        Some(&json!("pending_upload"))
    );
    let put = |ct: &'static str, body: &'static [u8]| {
        env.http
            .put(env.url(&begin["put_url"]))
            .header("content-type", ct)
            .body(body)
            .send()
    };
    assert_eq!(put("text/html", b"abcd").await.expect("PUT").status(), 400);
    assert_eq!(put("text/plain", b"abcde").await.expect("PUT").status(), 413);
    assert_eq!(put("text/plain", b"abcd").await.expect("PUT").status(), 200);
    env.ok(
        &inv,
        "files/upload_complete",
        json!({"scope": "tool", "path": "p.txt"}),
    )
    .await;
    let e = env
        .err(
            &inv,
            "files/upload_complete",
            json!({"scope": "tool", "path": "p.txt"}),
        )
        .await;
    assert_eq!(e.code, -32022, "complete is not idempotent");

    // Delete, and the bytes are gone.
    assert_eq!(
        env.ok(
            &inv,
            "files/delete",
            json!({"scope": "user", "path": "docs/report.pdf"})
        )
        .await,
        json!({"deleted": true})
    );
    let e = env
        .err(
            &inv,
            "files/download_url",
            json!({"scope": "user", "path": "docs/report.pdf"}),
        )
        .await;
    assert_eq!(e.code, -32022);
    // Its 300 000 bytes were released: a 700 000-byte file now fits (5 + 4 bytes are still stored).
    env.ok(&inv, "files/upload_begin", json!({"scope": "user", "path": "huge.bin", "content_type": "application/octet-stream", "size_bytes": 700_000}))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_and_tampered_links_are_refused() {
    let env = env(None).await;
    let inv = env.invoke("alice", "notes").await;
    put_file(&env, &inv, "tool", "a.png", "image/png", b"\x89PNG....").await;
    let link = env
        .ok(
            &inv,
            "files/download_url",
            json!({"scope": "tool", "path": "a.png", "ttl_seconds": 1}),
        )
        .await;
    let url = env.url(&link["url"]);
    for bad in [0, 3601] {
        let e = env
            .err(
                &inv,
                "files/download_url",
                json!({"scope": "tool", "path": "a.png", "ttl_seconds": bad}),
            )
            .await;
        assert_eq!(e.code, -32028);
    }

    // Tampering: the signature, the expiry, the disposition.
    let tampered_sig = {
        let (head, sig) = url.rsplit_once("sig=").expect("sig");
        let flipped: String = sig
            .chars()
            .enumerate()
            .map(|(i, c)| {
                if i == 0 {
                    if c == '0' { '1' } else { '0' }
                } else {
                    c
                }
            })
            .collect();
        format!("{head}sig={flipped}")
    };
    let exp = link["expires_at"].as_str().expect("expires_at").to_owned();
    assert!(!exp.is_empty());
    let later = {
        let (before, after) = url.split_once("exp=").expect("exp");
        let (n, rest) = after.split_once('&').expect("&");
        let n: u64 = n.parse().expect("exp number");
        format!("{before}exp={}&{rest}", n + 3600)
    };
    let disposition = url.replace("d=inline", "d=attachment");
    assert_ne!(disposition, url);
    for bad in [
        tampered_sig,
        later,
        disposition,
        url.split('?').next().unwrap_or_default().to_owned(),
    ] {
        let r = env.http.get(&bad).send().await.expect("GET");
        assert_eq!(r.status(), 403, "{bad}");
    }

    // Expiry: the link answers 410 once it is past its exp.
    let gone = eventually(Duration::from_secs(10), || {
        let (http, url) = (&env.http, &url);
        async move {
            http.get(url)
                .send()
                .await
                .map(|r| r.status() == 410)
                .unwrap_or(false)
        }
    })
    .await;
    assert!(gone, "the link expired");
    let body = env
        .http
        .get(&url)
        .send()
        .await
        .expect("GET")
        .text()
        .await
        .expect("body");
    assert!(body.contains("expired"), "{body}");
}

// ------------------------------------------------------------------------------------------------------------
// host/uploadFile
// ------------------------------------------------------------------------------------------------------------

fn inline(name: &str, mime: &str, bytes: &[u8]) -> Value {
    json!({"mode": "inline", "filename": name, "mime_type": mime, "purpose": "user_artifact", "content_b64": STANDARD.encode(bytes)})
}

fn assert_envelope(env: &Value, mode: &str, size: usize, mime: &str) {
    assert_eq!(env["download_url"], env["url"]);
    assert_eq!(env["size_bytes"], json!(size));
    assert_eq!(env["bytes"], json!(size));
    assert_eq!(env["expires_in"], json!(1800));
    assert!(env["expires_at"].as_str().is_some_and(|s| s.ends_with('Z')));
    assert_eq!(env["mime_type"], json!(mime));
    assert_eq!(env["_meta"]["mode"], json!(mode));
    assert!(
        env["r2_key"]
            .as_str()
            .is_some_and(|k| k.starts_with("exec-uploads/fleet/"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inline_uploads_enforce_size_count_mime_purpose_and_base64() {
    let env = env(None).await;
    let inv = env.invoke("alice", "notes").await;
    let exactly = vec![7_u8; 8 * MIB];
    let up = env
        .ok(
            &inv,
            "host/uploadFile",
            inline("big.bin", "application/octet-stream", &exactly),
        )
        .await;
    assert_envelope(&up, "inline", 8 * MIB, "application/octet-stream");
    let key = up["r2_key"].as_str().expect("key");
    assert!(
        key.contains("/notes/") && key.contains(&format!("/{}/", inv.invoke_id)) && key.ends_with("_big.bin")
    );
    let resp = env
        .http
        .get(env.url(&up["download_url"]))
        .send()
        .await
        .expect("GET");
    assert_eq!(resp.status(), 200);
    assert!(
        resp.headers()["content-disposition"]
            .to_str()
            .expect("ascii")
            .starts_with("attachment")
    );
    assert_eq!(resp.bytes().await.expect("body").len(), 8 * MIB);

    let over = vec![7_u8; 8 * MIB + 1];
    let e = env
        .err(
            &inv,
            "host/uploadFile",
            inline("big.bin", "application/octet-stream", &over),
        )
        .await;
    assert_eq!(code_name(&e), (-32204, "TOO_LARGE".into()));
    let e = env
        .err(
            &inv,
            "host/uploadFile",
            inline("x.svg", "image/svg+xml", b"<svg/>"),
        )
        .await;
    assert_eq!(code_name(&e), (-32205, "MIME_REJECTED".into()));
    let e = env
        .err(&inv, "host/uploadFile", inline("x", "not a mime", b"x"))
        .await;
    assert_eq!(e.code, -32205);
    let mut bad_purpose = inline("a.txt", "text/plain", b"x");
    bad_purpose["purpose"] = json!("exfiltration");
    let e = env.err(&inv, "host/uploadFile", bad_purpose).await;
    assert_eq!(code_name(&e), (-32206, "PURPOSE_REJECTED".into()));
    let mut bad_b64 = inline("a.txt", "text/plain", b"x");
    bad_b64["content_b64"] = json!("@@not base64@@");
    let e = env.err(&inv, "host/uploadFile", bad_b64).await;
    assert_eq!(code_name(&e), (-32203, "INVALID_REQUEST".into()));
    let e = env
        .err(&inv, "host/uploadFile", json!({"mode": "sideways"}))
        .await;
    assert_eq!(e.code, -32203);
    let e = env
        .err(
            &inv,
            "host/uploadFile",
            json!({"mode": "inline", "mime_type": "text/plain", "content_b64": "eA=="}),
        )
        .await;
    assert_eq!(e.code, -32203, "filename is required");
    let budget = env.services.budget(&inv.invoke_id).expect("budget");
    assert_eq!(budget.upload_used(), (1, 8 * MIB as u64), "refusals cost nothing");

    // 16 files per invoke: 15 more are stored, the 17th is refused.
    for i in 0..15 {
        let up = env
            .ok(
                &inv,
                "host/uploadFile",
                inline(&format!("f{i}.png"), "image/png", b"png"),
            )
            .await;
        assert_envelope(&up, "inline", 3, "image/png");
    }
    let e = env
        .err(&inv, "host/uploadFile", inline("f17.png", "image/png", b"png"))
        .await;
    assert_eq!(code_name(&e), (-32211, "MAX_FILES_EXCEEDED".into()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negotiate_put_confirm_round_trip_and_foreign_or_unknown_keys() {
    let env = env(None).await;
    let inv = env.invoke("alice", "notes").await;
    let video: Vec<u8> = (0..3_000_000_u32).map(|i| (i % 253) as u8).collect();
    let neg = env
        .ok(&inv, "host/uploadFile", json!({"mode": "negotiate", "filename": "clip.mp4", "mime_type": "video/mp4", "purpose": "user_artifact", "expected_bytes": video.len()}))
        .await;
    assert_eq!(neg["_meta"]["mode"], json!("presigned-put"));
    assert_eq!(neg["expires_in"], json!(300));
    assert_eq!(neg["headers"]["Content-Type"], json!("video/mp4"));
    let budget = env.services.budget(&inv.invoke_id).expect("budget");
    assert_eq!(budget.upload_used(), (0, 0), "negotiate is free");
    assert_eq!(
        budget.uploads_offered(),
        (1, video.len() as u64),
        "but its bytes are held until its confirm"
    );

    // Confirm before the PUT: nothing landed under the key.
    let e = env
        .err(
            &inv,
            "host/uploadFile",
            json!({"mode": "confirm", "r2_key": neg["r2_key"]}),
        )
        .await;
    assert_eq!(code_name(&e), (-32212, "NOT_FOUND".into()));

    let put = env
        .http
        .put(env.url(&neg["put_url"]))
        .header("content-type", "video/mp4")
        .body(video.clone())
        .send()
        .await
        .expect("PUT");
    assert_eq!(put.status(), 200);
    let up = env
        .ok(
            &inv,
            "host/uploadFile",
            json!({"mode": "confirm", "r2_key": neg["r2_key"]}),
        )
        .await;
    assert_envelope(&up, "confirm", video.len(), "video/mp4");
    assert_eq!(up["r2_key"], neg["r2_key"]);
    assert_eq!(budget.upload_used(), (1, video.len() as u64));
    assert_eq!(budget.uploads_offered(), (0, 0), "the offer became the file");
    let resp = env.http.get(env.url(&up["url"])).send().await.expect("GET");
    assert_eq!(resp.headers()["content-type"], "video/mp4");
    assert!(
        resp.headers()["content-disposition"]
            .to_str()
            .expect("ascii")
            .starts_with("inline")
    );
    assert_eq!(resp.bytes().await.expect("body").as_ref(), video.as_slice());
    // A re-confirm mints a fresh envelope at no cost; a PUT after the confirm is refused.
    env.ok(
        &inv,
        "host/uploadFile",
        json!({"mode": "confirm", "r2_key": neg["r2_key"]}),
    )
    .await;
    assert_eq!(budget.upload_used(), (1, video.len() as u64));
    let again = env
        .http
        .put(env.url(&neg["put_url"]))
        .header("content-type", "video/mp4")
        .body("x")
        .send()
        .await
        .expect("PUT");
    assert_eq!(again.status(), 409);

    // size_bytes is accepted for expected_bytes; over max_file_bytes is refused at once.
    let neg2 = env
        .ok(
            &inv,
            "host/uploadFile",
            json!({"mode": "negotiate", "filename": "a.txt", "mime_type": "text/plain", "size_bytes": 3}),
        )
        .await;
    let e = env
        .err(&inv, "host/uploadFile", json!({"mode": "negotiate", "filename": "a.txt", "mime_type": "text/plain", "size_bytes": 20 * MIB + 1}))
        .await;
    assert_eq!(e.code, -32204);
    let e = env
        .err(
            &inv,
            "host/uploadFile",
            json!({"mode": "negotiate", "filename": "a.txt", "mime_type": "text/plain", "size_bytes": 0}),
        )
        .await;
    assert_eq!(e.code, -32203);

    // Another invoke's key (even of the same user and plugin) is foreign; a well-formed key never PUT is unknown.
    let other = env.invoke("alice", "notes").await;
    let e = env
        .err(
            &other,
            "host/uploadFile",
            json!({"mode": "confirm", "r2_key": neg2["r2_key"]}),
        )
        .await;
    assert_eq!(code_name(&e), (-32203, "INVALID_REQUEST".into()));
    assert!(e.message.contains("does not belong to this invoke"));
    let e = env
        .err(
            &inv,
            "host/uploadFile",
            json!({"mode": "confirm", "r2_key": "exec-uploads/elsewhere/x"}),
        )
        .await;
    assert_eq!(e.code, -32203);
    let e = env
        .err(
            &inv,
            "host/uploadFile",
            json!({"mode": "confirm", "r2_key": neg2["r2_key"]}),
        )
        .await;
    assert_eq!(e.code, -32212);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_writers_fill_the_quota_exactly() {
    let env = env(Some(1000)).await;
    let inv = env.invoke("dave", "notes").await;
    // 20 writers of 100 bytes each race for a 1000-byte quota: exactly 10 win.
    let results = futures::future::join_all((0..20).map(|i| {
        let (env, inv) = (&env, &inv);
        async move {
            env.call(
                inv,
                "storage/set",
                json!({"scope": "tool", "key": format!("k{i}"), "value": "x".repeat(98)}),
            )
            .await
        }
    }))
    .await;
    let won = results.iter().filter(|r| r.is_ok()).count();
    assert_eq!(won, 10, "{results:?}");
    assert!(
        results
            .iter()
            .filter_map(|r| r.as_ref().err())
            .all(|e| e.code == -32024)
    );
    let listed = env.ok(&inv, "storage/list", json!({"scope": "tool"})).await;
    assert_eq!(listed["items"].as_array().map(Vec::len), Some(10));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_per_invoke_upload_total_is_80_mib() {
    let env = env(None).await;
    let inv = env.invoke("erin", "notes").await;
    let chunk = vec![1_u8; 8 * MIB];
    for i in 0..10 {
        env.ok(
            &inv,
            "host/uploadFile",
            inline(&format!("part{i}.bin"), "application/octet-stream", &chunk),
        )
        .await;
    }
    let e = env
        .err(
            &inv,
            "host/uploadFile",
            inline("one-more.bin", "application/octet-stream", b"x"),
        )
        .await;
    assert_eq!(code_name(&e), (-32202, "UPLOAD_MAX_BYTES_EXCEEDED".into()));
    // The negotiate/confirm path is held to the same total, from the negotiate on: no link is handed out whose
    // bytes would pass it (bytes PUT and never confirmed are bounded like confirmed ones).
    let e = env
        .err(
            &inv,
            "host/uploadFile",
            json!({"mode": "negotiate", "filename": "late.txt", "mime_type": "text/plain", "size_bytes": 1}),
        )
        .await;
    assert_eq!(code_name(&e), (-32202, "UPLOAD_MAX_BYTES_EXCEEDED".into()));
    assert_eq!(
        env.services.budget(&inv.invoke_id).expect("budget").upload_used(),
        (10, 80 * MIB as u64)
    );
}

/// Negotiated links never confirmed are bounded like files: at most 16 wait for their confirm (the 17th is
/// `-32211`), and a confirm frees its link's place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unconfirmed_negotiated_uploads_are_bounded_like_files() {
    let env = env(None).await;
    let inv = env.invoke("erin", "notes").await;
    let negotiate = |i: usize| json!({"mode": "negotiate", "filename": format!("f{i}.txt"), "mime_type": "text/plain", "size_bytes": 1});
    let mut links = Vec::new();
    for i in 0..16 {
        links.push(env.ok(&inv, "host/uploadFile", negotiate(i)).await);
    }
    let e = env.err(&inv, "host/uploadFile", negotiate(16)).await;
    assert_eq!(code_name(&e), (-32211, "MAX_FILES_EXCEEDED".into()));
    let put = env
        .http
        .put(env.url(&links[0]["put_url"]))
        .header("content-type", "text/plain")
        .body("x")
        .send()
        .await
        .expect("PUT");
    assert_eq!(put.status(), 200);
    env.ok(
        &inv,
        "host/uploadFile",
        json!({"mode": "confirm", "r2_key": links[0]["r2_key"]}),
    )
    .await;
    env.ok(&inv, "host/uploadFile", negotiate(16)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_public_url_links_are_absolute() {
    let env = env_with(None, true).await;
    let inv = env.invoke("alice", "notes").await;
    let up = env
        .ok(&inv, "host/uploadFile", inline("a.txt", "text/plain", b"abs"))
        .await;
    let url = up["download_url"].as_str().expect("url");
    assert!(url.starts_with(&format!("{}/v1/files/u/", env.base)), "{url}");
    let resp = env.http.get(url).send().await.expect("GET");
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.text().await.expect("body"), "abs");
    let neg = env
        .ok(
            &inv,
            "host/uploadFile",
            json!({"mode": "negotiate", "filename": "b.txt", "mime_type": "text/plain", "size_bytes": 1}),
        )
        .await;
    assert!(neg["put_url"].as_str().is_some_and(|u| u.starts_with(&env.base)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_completes_of_one_upload_store_it_once() {
    let env = env(Some(10_000)).await;
    let inv = env.invoke("frank", "notes").await;
    let begin = env
        .ok(
            &inv,
            "files/upload_begin",
            json!({"scope": "tool", "path": "r.txt", "content_type": "text/plain", "size_bytes": 5}),
        )
        .await;
    let put = env
        .http
        .put(env.url(&begin["put_url"]))
        .header("content-type", "text/plain")
        .body("race!")
        .send()
        .await
        .expect("PUT");
    assert_eq!(put.status(), 200);
    let complete = || {
        env.call(
            &inv,
            "files/upload_complete",
            json!({"scope": "tool", "path": "r.txt"}),
        )
    };
    let (a, b) = tokio::join!(complete(), complete());
    // One complete per begin: the loser finds nothing pending.
    let lost = match (&a, &b) {
        (Ok(_), Err(e)) | (Err(e), Ok(_)) => e,
        _ => panic!("exactly one complete must win: {a:?} {b:?}"),
    };
    assert_eq!(lost.code, -32022, "{lost:?}");
    let link = env
        .ok(
            &inv,
            "files/download_url",
            json!({"scope": "tool", "path": "r.txt"}),
        )
        .await;
    let body = env
        .http
        .get(env.url(&link["url"]))
        .send()
        .await
        .expect("GET")
        .text()
        .await
        .expect("body");
    assert_eq!(body, "race!");
    // Whoever won, the quota holds the file once: 10 000 − 5 bytes remain.
    env.assert_free(&inv, 10_000 - 5).await;
}

/// The subcall timeout abandons the wait, not the call: a complete still running when its caller's
/// `_clientTimeoutS` ends finishes on its own, and the quota counts its bytes exactly once.
#[tokio::test]
async fn a_complete_that_outlives_its_timeout_counts_its_bytes_once() {
    let size = 8 * MIB;
    let env = env(Some(size as u64 + 10_000)).await;
    let inv = env.invoke("grace", "notes").await;
    let begin = env
        .ok(
            &inv,
            "files/upload_begin",
            json!({"scope": "tool", "path": "big.bin", "content_type": "application/octet-stream", "size_bytes": size}),
        )
        .await;
    let put = env
        .http
        .put(env.url(&begin["put_url"]))
        .header("content-type", "application/octet-stream")
        .body(vec![7u8; size])
        .send()
        .await
        .expect("PUT");
    assert_eq!(put.status(), 200);
    // 1 ms cannot hold the claim, the quota reservation and an 8 MiB copy through JetStream.
    let e = env
        .call_within(
            &inv,
            "files/upload_complete",
            json!({"scope": "tool", "path": "big.bin"}),
            Some(0.001),
        )
        .await
        .expect_err("the wait times out");
    assert_eq!(e.code, -32029, "{e:?}");
    assert!(e.message.contains("timed out"), "{e:?}");
    // The complete goes on without its caller: wait for the file, as long as the product lets one call run.
    let until = Instant::now() + 2 * fleet_proto::limits::STORAGE_REQUEST_TIMEOUT;
    let link = loop {
        match env
            .call(
                &inv,
                "files/download_url",
                json!({"scope": "tool", "path": "big.bin"}),
            )
            .await
        {
            Ok(link) => break link,
            Err(e) if Instant::now() < until => {
                assert!(matches!(e.code, -32022 | -32029), "{e:?}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("the abandoned complete never stored the file: {e:?}"),
        }
    };
    assert_eq!(link["size_bytes"], json!(size));
    // Exactly the file's bytes are counted: 10 000 remain, not one more or less.
    env.assert_free(&inv, 10_000).await;
    // And a second complete of the same begin finds nothing pending.
    let e = env
        .err(
            &inv,
            "files/upload_complete",
            json!({"scope": "tool", "path": "big.bin"}),
        )
        .await;
    assert_eq!(e.code, -32022, "{e:?}");
}

impl Env {
    /// PUTs `body` to a signed link as `content_type`, which must store it.
    async fn put_ok(&self, link: &Value, content_type: &str, body: impl Into<reqwest::Body>) {
        let put = self
            .http
            .put(self.url(link))
            .header("content-type", content_type)
            .body(body)
            .send()
            .await
            .expect("PUT");
        assert_eq!(put.status(), 200);
    }
}

/// The user's `<prefix>_aps_usage` value, as JSON (`{"used", "holds"}`; bare digits read as `{"used"}`).
async fn usage_of(env: &Env, user: &str) -> (Value, u64) {
    let kv = env
        .js
        .get_key_value(StoreSettings::default().aps_usage_bucket())
        .await
        .expect("usage bucket");
    let entry = kv
        .entry(fleet_proto::api::user_key(user))
        .await
        .expect("entry")
        .expect("a usage value");
    let value = serde_json::from_slice::<Value>(&entry.value).expect("usage JSON");
    let value = if value.is_u64() {
        json!({"used": value, "holds": []})
    } else {
        value
    };
    (value, entry.revision)
}

/// Issue 42: a begin holds its whole size of the user's quota until its complete (or delete): the quota counts
/// what signed PUT links may store, at the first byte over it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_begin_holds_its_size_until_complete_or_delete() {
    let env = env(Some(1000)).await;
    let inv = env.invoke("hana", "notes").await;
    let begin = |path: &str, size: u64| json!({"scope": "tool", "path": path, "content_type": "application/octet-stream", "size_bytes": size});
    let a = env.ok(&inv, "files/upload_begin", begin("a.bin", 600)).await;
    // 600 held: 401 more is one byte over, refused with the limit; 400 fills the quota exactly.
    let e = env.err(&inv, "files/upload_begin", begin("b.bin", 401)).await;
    assert_eq!(code_name(&e), (-32024, "QUOTA_EXCEEDED".into()));
    let data = e.data.as_ref().expect("data");
    assert_eq!(
        (
            &data["used_bytes"],
            &data["reserved_bytes"],
            &data["quota_bytes"],
            &data["requested_bytes"]
        ),
        (&json!(0), &json!(600), &json!(1000), &json!(401)),
        "{e:?}"
    );
    env.ok(&inv, "files/upload_begin", begin("b.bin", 400)).await;
    // What uploads hold, KV values cannot take either.
    let e = env
        .err(
            &inv,
            "storage/set",
            json!({"scope": "tool", "key": "k", "value": 1}),
        )
        .await;
    assert_eq!(e.code, -32024, "{e:?}");
    // A complete turns its hold into the stored bytes.
    env.put_ok(&a["put_url"], "application/octet-stream", vec![1u8; 600])
        .await;
    env.ok(
        &inv,
        "files/upload_complete",
        json!({"scope": "tool", "path": "a.bin"}),
    )
    .await;
    let (usage, _) = usage_of(&env, "hana").await;
    assert_eq!(usage["used"], json!(600));
    assert_eq!(usage["holds"].as_array().map(Vec::len), Some(1), "{usage}");
    // Deleting the pending upload gives its hold back: exactly 400 bytes are free.
    assert_eq!(
        env.ok(&inv, "files/delete", json!({"scope": "tool", "path": "b.bin"}))
            .await,
        json!({"deleted": true})
    );
    env.assert_free(&inv, 400).await;
}

/// Issue 42: a `host/uploadFile` negotiate holds its bytes in the user's storage quota until its confirm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_negotiated_upload_holds_its_bytes_until_its_confirm() {
    let env = env(Some(1000)).await;
    let inv = env.invoke("iris", "notes").await;
    let negotiate = |size: u64| json!({"mode": "negotiate", "filename": "a.png", "mime_type": "image/png", "expected_bytes": size});
    let neg = env.ok(&inv, "host/uploadFile", negotiate(700)).await;
    let e = env
        .err(
            &inv,
            "files/upload_begin",
            json!({"scope": "tool", "path": "c.bin", "content_type": "a/b", "size_bytes": 301}),
        )
        .await;
    assert_eq!(code_name(&e), (-32024, "QUOTA_EXCEEDED".into()));
    let e = env.err(&inv, "host/uploadFile", negotiate(301)).await;
    assert_eq!(code_name(&e), (-32202, "STORAGE_QUOTA_EXCEEDED".into()));
    let data = e.data.as_ref().expect("data");
    assert_eq!(
        (&data["reserved_bytes"], &data["quota_bytes"], &data["size_bytes"]),
        (&json!(700), &json!(1000), &json!(301)),
        "{e:?}"
    );
    // The refused negotiate took nothing of the invoke's upload budget.
    let budget = env.services.budget(&inv.invoke_id).expect("budget");
    assert_eq!(budget.uploads_offered(), (1, 700));
    env.ok(&inv, "host/uploadFile", negotiate(300)).await;
    env.put_ok(&neg["put_url"], "image/png", vec![2u8; 700]).await;
    env.ok(
        &inv,
        "host/uploadFile",
        json!({"mode": "confirm", "r2_key": neg["r2_key"]}),
    )
    .await;
    // The confirmed 700 are free again; the other negotiate still holds 300.
    let (usage, _) = usage_of(&env, "iris").await;
    assert_eq!(usage["used"], json!(0));
    assert_eq!(usage["holds"][0]["bytes"], json!(300), "{usage}");
    env.assert_free(&inv, 700).await;
}

/// Issue 42: a hold carries its expiry. Once expired it no longer counts, and the next hold of its user removes
/// the bytes its link staged. (The expiry is moved into the past in the store itself: no waiting.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_hold_stops_counting_and_its_staged_bytes_are_removed() {
    let env = env(Some(1000)).await;
    let inv = env.invoke("jade", "notes").await;
    let begin = |path: &str, size: u64| json!({"scope": "tool", "path": path, "content_type": "application/octet-stream", "size_bytes": size});
    let x = env.ok(&inv, "files/upload_begin", begin("x.bin", 800)).await;
    env.put_ok(&x["put_url"], "application/octet-stream", vec![3u8; 800])
        .await;
    let (mut usage, revision) = usage_of(&env, "jade").await;
    let id = usage["holds"][0]["id"].as_str().expect("hold id").to_owned();
    let object = id.strip_prefix("s/").expect("a staging hold").to_owned();
    let staging = env
        .js
        .get_object_store(StoreSettings::default().aps_staging_bucket())
        .await
        .expect("staging");
    assert!(
        staging
            .info(&object)
            .await
            .is_ok_and(|i| !i.deleted && i.size == 800),
        "the PUT staged its bytes"
    );
    // Still live: 201 more is over.
    let e = env.err(&inv, "files/upload_begin", begin("y.bin", 201)).await;
    assert_eq!(e.code, -32024, "{e:?}");
    let exp = usage["holds"][0]["exp"].as_u64().expect("exp");
    assert!(
        exp >= now_ms() + 600_000,
        "a hold outlives its 600 s link by its grace: {usage}"
    );
    usage["holds"][0]["exp"] = json!(now_ms() - 1);
    let kv = env
        .js
        .get_key_value(StoreSettings::default().aps_usage_bucket())
        .await
        .expect("usage bucket");
    kv.update(
        fleet_proto::api::user_key("jade"),
        serde_json::to_vec(&usage).expect("JSON").into(),
        revision,
    )
    .await
    .expect("expire the hold");
    // Expired: the whole quota is there for a new hold, and that hold removed the expired one's staged bytes.
    env.ok(&inv, "files/upload_begin", begin("y.bin", 1000)).await;
    let (usage, _) = usage_of(&env, "jade").await;
    let holds: Vec<&str> = usage["holds"]
        .as_array()
        .expect("holds")
        .iter()
        .filter_map(|h| h["id"].as_str())
        .collect();
    assert_eq!(holds.len(), 1, "{usage}");
    assert_ne!(holds[0], id, "{usage}");
    assert!(
        staging.info(&object).await.is_ok_and(|i| i.deleted),
        "the expired hold's staged bytes were removed"
    );
}

/// Issue 42: holds are exact across replicas: 20 begins of 100 bytes race through a front's and a worker's
/// services for a 1000-byte quota, and exactly 10 win.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_begins_on_two_replicas_hold_the_quota_exactly() {
    let env = env(Some(1000)).await;
    let on_worker = env.invoke("kate", "notes").await;
    let on_front = env.invoke_on(&env.admin, "kate", "notes").await;
    let calls = (0..20).map(|i| {
        let (services, inv) = if i % 2 == 0 {
            (&env.services, on_worker.clone())
        } else {
            (&env.admin, on_front.clone())
        };
        async move {
            services
                .serve(ReverseCall {
                    user: inv.user.clone(),
                    tool_id: inv.tool_id.clone(),
                    invoke_id: inv.invoke_id.clone(),
                    tool: "run".into(),
                    method: "files/upload_begin".to_owned(),
                    family: family_of("files/upload_begin").expect("a known family"),
                    params: json!({"scope": "tool", "path": format!("r{i}.bin"), "content_type": "a/b", "size_bytes": 100}),
                    client_timeout_s: None,
                    deadline_ms: inv.deadline_ms,
                    tokens: inv.tokens.clone(),
                })
                .await
        }
    });
    let results = futures::future::join_all(calls).await;
    let won = results.iter().filter(|r| r.is_ok()).count();
    for r in &results {
        if let Err(e) = r {
            assert_eq!(e.code, -32024, "{e:?}");
        }
    }
    assert_eq!(won, 10, "{results:?}");
    let (usage, _) = usage_of(&env, "kate").await;
    assert_eq!(usage["holds"].as_array().map(Vec::len), Some(10), "{usage}");
}

/// Issue 42: a user's uploads begun and not completed are capped (`files/upload_begin` and `negotiate`
/// together): the 32nd is admitted, the 33rd refused with the limit, and a complete makes room for one more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_begins_are_capped_per_user() {
    let max = fleet_proto::limits::PENDING_UPLOADS_MAX_PER_USER;
    assert_eq!(max, 32);
    let env = env(None).await;
    let inv = env.invoke("lena", "notes").await;
    let begin = |i: usize| json!({"scope": "tool", "path": format!("p{i}.txt"), "content_type": "text/plain", "size_bytes": 1});
    let first = env.ok(&inv, "files/upload_begin", begin(0)).await;
    for i in 1..max - 1 {
        env.ok(&inv, "files/upload_begin", begin(i)).await;
    }
    // The 32nd through host/uploadFile.
    env.ok(
        &inv,
        "host/uploadFile",
        json!({"mode": "negotiate", "filename": "n.png", "mime_type": "image/png", "expected_bytes": 1}),
    )
    .await;
    let e = env.err(&inv, "files/upload_begin", begin(max)).await;
    assert_eq!(code_name(&e), (-32024, "QUOTA_EXCEEDED".into()));
    let data = e.data.as_ref().expect("data");
    assert_eq!(
        (
            &data["reason"],
            &data["pending_uploads"],
            &data["max_pending_uploads"]
        ),
        (&json!("pending_uploads"), &json!(max), &json!(max)),
        "{e:?}"
    );
    let e = env
        .err(
            &inv,
            "host/uploadFile",
            json!({"mode": "negotiate", "filename": "m.png", "mime_type": "image/png", "expected_bytes": 1}),
        )
        .await;
    assert_eq!(code_name(&e), (-32202, "PENDING_UPLOADS_EXCEEDED".into()));
    assert_eq!(e.data.as_ref().expect("data")["max_pending_uploads"], json!(max));
    // Another user is not affected.
    let other = env.invoke("mona", "notes").await;
    env.ok(&other, "files/upload_begin", begin(0)).await;
    // Completing one makes room for exactly one.
    env.put_ok(&first["put_url"], "text/plain", "x").await;
    env.ok(
        &inv,
        "files/upload_complete",
        json!({"scope": "tool", "path": "p0.txt"}),
    )
    .await;
    env.ok(&inv, "files/upload_begin", begin(max)).await;
    let e = env.err(&inv, "files/upload_begin", begin(max + 1)).await;
    assert_eq!(e.code, -32024, "{e:?}");
}

/// Issue 42: staging has a `max_bytes`, its share of the store budget (5 %, per replica): a PUT past it is refused
/// and nothing of it can be completed; a front started with another budget updates the cap of the existing bucket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staging_is_capped_at_its_share_of_the_store_budget() {
    const KIB: usize = 1024;
    let settings = StoreSettings {
        job_store_max_bytes: 20 * MIB as u64,
        ..StoreSettings::default()
    };
    let env = Box::pin(make_env(None, false, settings.clone())).await;
    let stream = format!("OBJ_{}", settings.aps_staging_bucket());
    let max_bytes = |env: &Env| {
        let js = env.js.clone();
        let stream = stream.clone();
        async move {
            js.get_stream(stream)
                .await
                .expect("staging stream")
                .cached_info()
                .config
                .max_bytes
        }
    };
    assert_eq!(max_bytes(&env).await, MIB as i64, "5 % of 20 MiB");
    let inv = env.invoke("nina", "notes").await;
    let begin = |path: &str| json!({"scope": "tool", "path": path, "content_type": "application/octet-stream", "size_bytes": 700 * KIB});
    let a = env.ok(&inv, "files/upload_begin", begin("a.bin")).await;
    env.put_ok(&a["put_url"], "application/octet-stream", vec![1u8; 700 * KIB])
        .await;
    // 1400 KiB do not fit a 1 MiB staging bucket: the second PUT is refused.
    let b = env.ok(&inv, "files/upload_begin", begin("b.bin")).await;
    let put = env
        .http
        .put(env.url(&b["put_url"]))
        .header("content-type", "application/octet-stream")
        .body(vec![2u8; 700 * KIB])
        .send()
        .await
        .expect("PUT");
    assert!(!put.status().is_success(), "{}", put.status());
    let e = env
        .err(
            &inv,
            "files/upload_complete",
            json!({"scope": "tool", "path": "b.bin"}),
        )
        .await;
    assert_eq!(e.code, -32029, "{e:?}");
    env.ok(
        &inv,
        "files/upload_complete",
        json!({"scope": "tool", "path": "a.bin"}),
    )
    .await;
    // Another budget, the existing bucket's cap follows it.
    let doubled = StoreSettings {
        job_store_max_bytes: 40 * MIB as u64,
        ..settings
    };
    HostObjects::open(&env.js, &doubled, LinkSigner::new(SECRET), None)
        .await
        .expect("objects");
    assert_eq!(max_bytes(&env).await, 2 * MIB as i64);
}
