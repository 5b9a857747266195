//! OAuth accounts and platform credentials (spec §4.2, §8.8) and users' own credentials, on real parts: a real
//! nats-server with the fleet's NATS users, a front's services behind the fleet's real HTTP listener (the
//! connect flow, the user routes), a worker's services (as the worker NATS user) serving `credentials/*` and
//! resolving credentials at invoke, and the test as the browser. Only the OAuth provider is a fake
//! (`fleet_e2e::fake_oauth`): no real provider can exist here. It checks PKCE, single-use codes and refresh
//! tokens itself.
//!
//! The plugin side over stdio (a Python fixture through `fleet up`) is `tests/fleet_up.rs`'s
//! `a_python_plugin_gets_oauth_tokens_through_fleet_up`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::time::Duration;

use base64::Engine as _;
use fleet::http::{HttpConfig, HttpState};
use fleet_client::auth::{DEFAULT_AUDIENCE, DEFAULT_ISSUER, Verifier};
use fleet_e2e::cluster::{Cluster, Role, worker_settings};
use fleet_e2e::fake_oauth::FakeOAuth;
use fleet_proto::executa::reverse::family_of;
use fleet_proto::util::now_ms;
use fleet_services::credentials::Keyring;
use fleet_services::files::LinkSigner;
use fleet_services::{FleetServices, ServicesConfig};
use fleet_store::StoreSettings;
use fleet_worker::services::{InvokeTokens, ReverseCall, TokenRequest, TokenSource};
use serde_json::{Value, json};

const TOOL: &str = "mailer";
/// The names the fake provider fills (`FAKE_TOKEN`), and one no provider maps.
const MAPPED: &str = "FAKE_TOKEN";
const UNMAPPED: &str = "OTHER_KEY";

struct AbortOnDrop(tokio::task::JoinHandle<std::io::Result<()>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

struct Env {
    cluster: Cluster,
    fake: FakeOAuth,
    /// The HTTP listener, `http://127.0.0.1:<port>`.
    base: String,
    /// The front's services (behind the HTTP listener).
    front: FleetServices,
    /// A worker's services (reverse calls, invoke-time credentials), as the worker NATS user.
    worker: FleetServices,
    http: reqwest::Client,
    _task: AbortOnDrop,
    _dir: tempfile::TempDir,
}

fn keyring() -> Keyring {
    Keyring::fixed(&[("k1", [9; 32])])
}

/// A fleet whose services configure two providers on the fake: `fake` (maps `FAKE_TOKEN`) and `fake2` (maps
/// `FAKE2_TOKEN`).
async fn env(name: &str) -> Env {
    env_with(name, "").await
}

/// [`env`] with `credentials` (the keys of `[credentials]` besides its providers) in the services TOML.
async fn env_with(name: &str, credentials: &str) -> Env {
    let cluster = Cluster::start(name, 1, 0, &[]).await;
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeOAuth::start().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let toml = format!(
        "[credentials]\n{credentials}\n{}\n{}",
        fake.provider_toml("fake", &dir.path().join("secret"), &[MAPPED]),
        fake.provider_toml("fake2", &dir.path().join("secret2"), &["FAKE2_TOKEN"]),
    );
    let mut config: ServicesConfig = toml::from_str(&toml).expect("services TOML");
    config.public_url = Some(base.clone());
    let front_js = async_nats::jetstream::new(cluster.client.clone());
    let front = Box::pin(FleetServices::open(
        &front_js,
        &StoreSettings::default(),
        &config,
        LinkSigner::new(b"oauth-test-link-secret"),
        keyring(),
    ))
    .await
    .expect("front services");
    let worker_js =
        async_nats::jetstream::new(fleet_e2e::cluster::connect(&cluster.nats, Role::Worker).await);
    let worker = Box::pin(FleetServices::open(
        &worker_js,
        &worker_settings(),
        &config,
        LinkSigner::new(b"oauth-test-link-secret"),
        keyring(),
    ))
    .await
    .expect("worker services");
    let api = Verifier::new(
        vec![cluster.key.verify_key().unwrap()],
        DEFAULT_ISSUER,
        DEFAULT_AUDIENCE,
    )
    .unwrap();
    let front_node = cluster.fronts[0].0.clone();
    let state = HttpState::start(
        front_node.clone(),
        cluster.client.clone(),
        api,
        cluster.operator_verifier(),
        front_node.metrics().clone(),
        HttpConfig::default(),
    )
    .await
    .unwrap();
    let task = tokio::spawn(fleet::http::serve_with_services(listener, state, front.clone()));
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    Env {
        cluster,
        fake,
        base,
        front,
        worker,
        http,
        _task: AbortOnDrop(task),
        _dir: dir,
    }
}

/// One HTTP answer: status, `Set-Cookie`s, `Location`, JSON (or text) body.
#[derive(Debug)]
struct Answer {
    status: u16,
    cookies: Vec<String>,
    location: Option<String>,
    text: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.text).unwrap_or_else(|_| panic!("not JSON: {self:?}"))
    }

    fn code(&self) -> String {
        self.json()["error"]["code"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }
}

async fn send(req: reqwest::RequestBuilder) -> Answer {
    let r = req.send().await.expect("HTTP request");
    let cookies = r
        .headers()
        .get_all("set-cookie")
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .collect();
    let location = r
        .headers()
        .get("location")
        .map(|v| v.to_str().unwrap().to_owned());
    Answer {
        status: r.status().as_u16(),
        cookies,
        location,
        text: r.text().await.unwrap_or_default(),
    }
}

impl Env {
    fn bearer(&self, user: &str) -> String {
        format!("Bearer {}", self.cluster.token(user))
    }

    async fn get(&self, user: Option<&str>, path: &str) -> Answer {
        let mut req = self.http.get(format!("{}{path}", self.base));
        if let Some(u) = user {
            req = req.header("authorization", self.bearer(u));
        }
        send(req.header("accept", "application/json")).await
    }

    /// `/start` as `user`: the provider's authorization URL and the binding cookie (`name=value`).
    async fn start(&self, user: &str, provider: &str, query: &str) -> (String, String) {
        let a = send(
            self.http
                .get(format!("{}/v1/oauth/{provider}/start{query}", self.base))
                .header("authorization", self.bearer(user)),
        )
        .await;
        assert_eq!(a.status, 302, "{a:?}");
        let cookie = a.cookies[0].split(';').next().unwrap().to_owned();
        assert!(
            a.cookies[0].contains("HttpOnly") && a.cookies[0].contains("SameSite=Lax"),
            "{a:?}"
        );
        assert!(
            a.cookies[0].contains(&format!("Path=/v1/oauth/{provider}/callback")),
            "{a:?}"
        );
        (a.location.unwrap(), cookie)
    }

    /// The browser at the provider: it logs in (as the fake's current identity) and is sent back; answers the
    /// callback URL.
    async fn authorize(&self, authorize_url: &str) -> String {
        let a = send(self.http.get(authorize_url)).await;
        assert_eq!(a.status, 302, "the fake refused the authorization request: {a:?}");
        a.location.unwrap()
    }

    async fn callback(&self, callback_url: &str, cookie: Option<&str>) -> Answer {
        let mut req = self.http.get(callback_url).header("accept", "application/json");
        if let Some(c) = cookie {
            req = req.header("cookie", c);
        }
        send(req).await
    }

    /// A whole connect flow of `user` at `fake`; answers the callback's JSON.
    async fn connect(&self, user: &str, query: &str) -> Value {
        let (url, cookie) = self.start(user, "fake", query).await;
        let back = self.authorize(&url).await;
        let a = self.callback(&back, Some(&cookie)).await;
        assert_eq!(a.status, 200, "{a:?}");
        a.json()
    }

    async fn accounts(&self, user: &str) -> Vec<Value> {
        let a = self.get(Some(user), "/v1/oauth/fake/accounts").await;
        assert_eq!(a.status, 200, "{a:?}");
        a.json()["accounts"].as_array().unwrap().clone()
    }

    /// The tokens of an invoke of [`TOOL`] by `user` whose manifest declares `credentials`.
    async fn tokens(
        &self,
        services: &FleetServices,
        user: &str,
        invoke: &str,
        credentials: &[&str],
    ) -> InvokeTokens {
        services
            .tokens(TokenRequest {
                user: user.into(),
                tool_id: TOOL.into(),
                invoke_id: invoke.into(),
                negotiated: BTreeSet::new(),
                declared: Vec::new(),
                credentials: credentials.iter().map(|s| (*s).to_owned()).collect(),
                deadline_ms: now_ms() + 60_000,
            })
            .await
    }

    async fn reverse(
        &self,
        services: &FleetServices,
        user: &str,
        invoke: &str,
        tokens: &InvokeTokens,
        method: &str,
        params: Value,
    ) -> Result<Value, fleet_proto::jsonrpc::ErrorObject> {
        services
            .serve(ReverseCall {
                user: user.into(),
                tool_id: TOOL.into(),
                invoke_id: invoke.into(),
                tool: "send".into(),
                method: method.into(),
                family: family_of(method).unwrap(),
                params,
                client_timeout_s: None,
                deadline_ms: now_ms() + 60_000,
                tokens: tokens.clone(),
            })
            .await
    }

    /// `credentials/getToken` as `user` through the worker's services.
    async fn get_token(&self, user: &str, params: Value) -> Result<Value, fleet_proto::jsonrpc::ErrorObject> {
        let invoke = format!("inv-{}", now_ms());
        let tokens = self.tokens(&self.worker, user, &invoke, &[MAPPED]).await;
        self.reverse(
            &self.worker,
            user,
            &invoke,
            &tokens,
            "credentials/getToken",
            params,
        )
        .await
    }

    /// What the worker hands the plugin in `context.credentials` for `names` (the worker's own resolution).
    async fn resolved(&self, user: &str, names: &[&str]) -> Value {
        let names: Vec<String> = names.iter().map(|s| (*s).to_owned()).collect();
        let found = self
            .worker
            .credentials(user, TOOL, &names, now_ms() + 60_000)
            .await
            .expect("credentials");
        Value::Object(found.0)
    }
}

fn claims(jwt: &str) -> Value {
    let payload = jwt.split('.').nth(1).unwrap();
    serde_json::from_slice(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(payload)
            .unwrap(),
    )
    .unwrap()
}

fn code_of(r: &Result<Value, fleet_proto::jsonrpc::ErrorObject>) -> (i64, String) {
    let e = r.as_ref().expect_err("an error");
    let name = e
        .data
        .as_ref()
        .and_then(|d| d["errorCode"].as_str())
        .expect("every error carries data.errorCode (HR-ER-01)")
        .to_owned();
    (e.code, name)
}

/// The connect flow end to end, several accounts with a default, and a plugin's view of them: the
/// `credentials_token` (audience, claims, providers), `listAccounts` (metadata only), `getToken` (the default
/// account, or a named one; cached across processes through the sealed copy), and the first tier of spec §4.2
/// (the mapped name is the default account's live token, ahead of a stored value).
#[tokio::test]
async fn users_connect_accounts_and_plugins_get_their_tokens() {
    let env = env("oauth-flow").await;
    let first = env.connect("alice", "").await;
    let account = &first["account"];
    assert_eq!(first["provider"], "fake");
    assert_eq!(account["email"], "alice@example.com");
    assert_eq!(account["label"], "alice@example.com");
    assert_eq!(account["is_default"], true);
    assert_eq!(account["status"], "active");
    assert_eq!(account["scopes"], json!(["openid", "email", "mail.read"]));
    let first_id = account["account_id"].as_str().unwrap().to_owned();
    assert!(first_id.starts_with("acc_") && first_id.len() == 20, "{first_id}");
    let at_connect = env.fake.issued_access_tokens();
    assert_eq!(at_connect.len(), 1);

    // A second identity, labelled, made the default; the same identity again updates its account.
    env.fake.login_as("alice-work", "alice@work.example");
    let second = env.connect("alice", "?label=work&default=true").await;
    let second_id = second["account"]["account_id"].as_str().unwrap().to_owned();
    assert_eq!(second["account"]["label"], "work");
    let again = env.connect("alice", "").await;
    assert_eq!(
        again["account"]["account_id"],
        second_id.as_str(),
        "same identity, same account"
    );
    assert_eq!(again["account"]["label"], "work", "the label is kept");
    let listed = env.accounts("alice").await;
    assert_eq!(listed.len(), 2, "{listed:?}");
    assert_eq!(listed[0]["account_id"], second_id.as_str(), "the default first");
    assert_eq!(listed[0]["is_default"], true);
    assert_eq!(listed[1]["is_default"], false);
    // The user moves the default back.
    let moved = env
        .http
        .post(format!("{}/v1/oauth/fake/accounts/{first_id}/default", env.base))
        .header("authorization", env.bearer("alice"));
    let moved = send(moved).await;
    assert_eq!(moved.status, 200, "{moved:?}");
    assert_eq!(moved.json()["accounts"][0]["account_id"], first_id.as_str());

    // The plugin's token: minted because the manifest declares a mapped name; none without one.
    let tokens = env
        .tokens(&env.worker, "alice", "inv-1", &[MAPPED, UNMAPPED])
        .await;
    let jwt = tokens.credentials.clone().expect("a credentials_token");
    let c = claims(&jwt);
    assert_eq!(c["aud"], "executa-credentials");
    assert_eq!(c["user_id"], "alice");
    assert_eq!(c["sub"], "alice");
    assert_eq!(c["executa_tool_id"], TOOL);
    assert_eq!(c["tool_invoke_id"], "inv-1");
    assert_eq!(c["providers"], json!(["fake"]));
    let ttl = c["exp"].as_u64().unwrap() - c["iat"].as_u64().unwrap();
    assert_eq!(ttl, 600, "about 10 minutes (spec §11)");
    assert!(
        env.tokens(&env.worker, "alice", "inv-0", &[UNMAPPED])
            .await
            .credentials
            .is_none()
    );

    // listAccounts: metadata only.
    let list = env
        .reverse(
            &env.worker,
            "alice",
            "inv-1",
            &tokens,
            "credentials/listAccounts",
            json!({"provider": "fake"}),
        )
        .await
        .unwrap();
    let accounts = list["accounts"].as_array().unwrap();
    assert_eq!(accounts.len(), 2);
    assert_eq!(accounts[0]["account_id"], first_id.as_str());
    let text = list.to_string();
    for t in env
        .fake
        .issued_access_tokens()
        .iter()
        .chain(&env.fake.issued_refresh_tokens())
    {
        assert!(!text.contains(t.as_str()), "a token in listAccounts: {text}");
    }
    assert_eq!(
        accounts[0]
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect::<BTreeSet<_>>(),
        ["account_id", "email", "is_default", "label", "scopes", "status"]
            .into_iter()
            .map(String::from)
            .collect()
    );

    // getToken: the default account's token as the code exchange issued it — read by the worker from the sealed
    // copy the front stored (no refresh); a named account's; never a refresh token.
    let default = env.get_token("alice", json!({"provider": "fake"})).await.unwrap();
    assert_eq!(default["account_id"], first_id.as_str());
    assert_eq!(default["access_token"], at_connect[0].as_str());
    assert!(
        default["expires_at"].as_str().unwrap().ends_with('Z'),
        "{default}"
    );
    let named = env
        .get_token("alice", json!({"provider": "fake", "account_id": second_id}))
        .await
        .unwrap();
    assert_eq!(named["account_id"], second_id.as_str());
    assert_eq!(
        named["access_token"],
        env.fake.issued_access_tokens().last().unwrap().as_str()
    );
    assert_eq!(env.fake.refresh_grants(), 0, "nothing was refreshed");

    // Spec §4.2: the mapped name is the default account's live token even with a stored value for it; the
    // unmapped one comes from the store.
    env.front
        .credential_store()
        .set(
            "alice",
            Some(TOOL),
            &[
                (MAPPED.to_owned(), "stored-value".to_owned()),
                (UNMAPPED.to_owned(), "other".to_owned()),
            ]
            .into_iter()
            .collect(),
        )
        .await
        .unwrap();
    assert_eq!(
        env.resolved("alice", &[MAPPED, UNMAPPED]).await,
        json!({MAPPED: at_connect[0], UNMAPPED: "other"})
    );
    // Bob has no account: the stored value (none for him) — nothing of alice's.
    assert_eq!(env.resolved("bob", &[MAPPED, UNMAPPED]).await, json!({}));

    // Bob sees, changes and removes nothing of alice's.
    assert!(env.accounts("bob").await.is_empty());
    let bob_default = send(
        env.http
            .post(format!("{}/v1/oauth/fake/accounts/{first_id}/default", env.base))
            .header("authorization", env.bearer("bob")),
    )
    .await;
    assert_eq!(
        (bob_default.status, bob_default.code()),
        (404, "not_found".into())
    );
    let bob_delete = send(
        env.http
            .delete(format!("{}/v1/oauth/fake/accounts/{first_id}", env.base))
            .header("authorization", env.bearer("bob")),
    )
    .await;
    assert_eq!(bob_delete.status, 404, "{bob_delete:?}");
    let bob_token = env.get_token("bob", json!({"provider": "fake"})).await;
    assert_eq!(code_of(&bob_token), (-32061, "CREDENTIALS_NOT_GRANTED".into()));
    let bob_named = env
        .get_token("bob", json!({"provider": "fake", "account_id": first_id}))
        .await;
    assert_eq!(
        code_of(&bob_named).0,
        -32061,
        "alice's account id means nothing to bob"
    );
    assert_eq!(env.accounts("alice").await.len(), 2);

    // Alice removes her default: the other becomes the default, and its token is the mapped value.
    let removed = send(
        env.http
            .delete(format!("{}/v1/oauth/fake/accounts/{first_id}", env.base))
            .header("authorization", env.bearer("alice")),
    )
    .await;
    assert_eq!(removed.status, 200, "{removed:?}");
    assert_eq!(removed.json()["accounts"][0]["account_id"], second_id.as_str());
    assert_eq!(removed.json()["accounts"][0]["is_default"], true);
    assert_eq!(
        env.resolved("alice", &[MAPPED]).await[MAPPED],
        env.fake.issued_access_tokens().last().unwrap().as_str()
    );
    // The providers, as users see them.
    let providers = env.get(Some("alice"), "/v1/oauth/providers").await.json();
    assert_eq!(
        providers["providers"][0],
        json!({"name": "fake", "credentials": [MAPPED], "scopes": ["openid", "email", "mail.read"]})
    );
    drop(env.cluster);
}

/// The connect flow's limits at their boundaries: a label of `LABEL_MAX_CHARS` characters (counted as characters,
/// not bytes) is taken, one more is refused at `/start` before the provider is asked; a user connects
/// `ACCOUNTS_PER_PROVIDER_MAX` identities at one provider, the next is refused at its callback, and an identity
/// already connected still reconnects (it updates its account).
#[tokio::test]
async fn labels_and_accounts_per_provider_are_limited_at_their_boundaries() {
    use fleet_services::oauth::accounts::{ACCOUNTS_PER_PROVIDER_MAX, LABEL_MAX_CHARS};
    let env = env("oauth-limits").await;
    // `é` is two bytes: the limit counts characters.
    let at_max = "é".repeat(LABEL_MAX_CHARS);
    let encoded = |n: usize| "%C3%A9".repeat(n);
    let first = env
        .connect("alice", &format!("?label={}", encoded(LABEL_MAX_CHARS)))
        .await;
    assert_eq!(first["account"]["label"], at_max.as_str());
    let asked = env.fake.issued_access_tokens().len();
    let too_long = send(
        env.http
            .get(format!(
                "{}/v1/oauth/fake/start?label={}",
                env.base,
                encoded(LABEL_MAX_CHARS + 1)
            ))
            .header("authorization", env.bearer("alice")),
    )
    .await;
    assert_eq!((too_long.status, too_long.code()), (400, "invalid_arg".into()));
    assert!(too_long.location.is_none(), "{too_long:?}");

    for i in 1..ACCOUNTS_PER_PROVIDER_MAX {
        env.fake
            .login_as(&format!("alice-{i}"), &format!("alice-{i}@example.com"));
        env.connect("alice", "").await;
    }
    assert_eq!(env.accounts("alice").await.len(), ACCOUNTS_PER_PROVIDER_MAX);
    assert_eq!(
        env.fake.issued_access_tokens().len(),
        asked + ACCOUNTS_PER_PROVIDER_MAX - 1,
        "the refused label asked the provider nothing"
    );

    env.fake.login_as("alice-extra", "alice-extra@example.com");
    let (url, cookie) = env.start("alice", "fake", "").await;
    let back = env.authorize(&url).await;
    let refused = env.callback(&back, Some(&cookie)).await;
    assert_eq!((refused.status, refused.code()), (400, "invalid_arg".into()));
    assert!(
        refused.json()["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains(&ACCOUNTS_PER_PROVIDER_MAX.to_string())),
        "{refused:?}"
    );
    assert_eq!(env.accounts("alice").await.len(), ACCOUNTS_PER_PROVIDER_MAX);

    // An identity already connected reconnects: its account is updated, not added.
    env.fake.login_as("alice-3", "alice-3@example.com");
    let again = env.connect("alice", "").await;
    assert_eq!(again["account"]["email"], "alice-3@example.com");
    assert_eq!(env.accounts("alice").await.len(), ACCOUNTS_PER_PROVIDER_MAX);
}

/// The limits of stored credentials at their boundaries, through the user's own HTTP routes: a value of
/// `VALUE_MAX_BYTES` is stored and one byte more refused; `NAMES_PER_CALL_MAX` names in one call are stored and one
/// more refused; a user's record is capped at `CREDENTIALS_RECORD_MAX_BYTES` stored (sealed) bytes: the write that
/// would pass it is refused, naming the cap, and every value stored before it is kept.
#[tokio::test]
async fn credential_values_names_and_records_are_limited_at_their_boundaries() {
    use fleet_proto::admin::credentials::{NAMES_PER_CALL_MAX, VALUE_MAX_BYTES};
    use fleet_store::settings::CREDENTIALS_RECORD_MAX_BYTES;
    let env = env("credential-limits").await;
    let put = |values: serde_json::Map<String, Value>| {
        send(
            env.http
                .put(format!("{}/v1/credentials", env.base))
                .header("authorization", env.bearer("alice"))
                .json(&json!({ "values": values })),
        )
    };
    let one =
        |name: &str, len: usize| serde_json::Map::from_iter([(name.to_owned(), json!("v".repeat(len)))]);

    assert_eq!(put(one("AT_MAX", VALUE_MAX_BYTES)).await.status, 200);
    let over = put(one("OVER", VALUE_MAX_BYTES + 1)).await;
    assert_eq!((over.status, over.code()), (400, "invalid_arg".into()));

    let names = |n: usize, prefix: &str| {
        serde_json::Map::from_iter((0..n).map(|i| (format!("{prefix}_{i}"), json!("x"))))
    };
    assert_eq!(put(names(NAMES_PER_CALL_MAX, "MANY")).await.status, 200);
    let too_many = put(names(NAMES_PER_CALL_MAX + 1, "MORE")).await;
    assert_eq!((too_many.status, too_many.code()), (400, "invalid_arg".into()));

    // Fill the record with values of the largest size until the cap refuses one: it must come, and before the
    // plain bytes alone reach the cap (sealing only adds).
    let most = CREDENTIALS_RECORD_MAX_BYTES / VALUE_MAX_BYTES;
    let mut stored = Vec::new();
    let refused = loop {
        let name = format!("BIG_{}", stored.len());
        let r = put(one(&name, VALUE_MAX_BYTES)).await;
        if r.status != 200 {
            break r;
        }
        stored.push(name);
        assert!(
            stored.len() < most,
            "{} values of {VALUE_MAX_BYTES} bytes stored",
            stored.len()
        );
    };
    assert_eq!((refused.status, refused.code()), (400, "invalid_arg".into()));
    assert!(
        refused.text.contains(&CREDENTIALS_RECORD_MAX_BYTES.to_string()),
        "{refused:?}"
    );
    assert!(!stored.is_empty());
    let names: Vec<&str> = stored
        .iter()
        .map(String::as_str)
        .chain(["AT_MAX", "MANY_0"])
        .collect();
    let resolved = env.resolved("alice", &names).await;
    for name in &names {
        assert!(resolved[name].is_string(), "{name} kept: {resolved}");
    }
}

/// The flow's guards: the state is single-use (a replayed callback is refused before the provider is asked),
/// bound to the browser that started the flow (a callback without its cookie, or with another flow's, is
/// refused and does not spend the state), and to its provider; PKCE S256 (the provider refuses a stolen code
/// without the verifier); a code used before is refused by the provider and adds nothing; `/start` wants the
/// user's own API token and nothing but `label` and `default`.
#[tokio::test]
async fn state_binding_pkce_and_replays_are_refused() {
    let env = env("oauth-guards").await;
    let (url, cookie) = env.start("alice", "fake", "").await;
    let parsed = url::Url::parse(&url).unwrap();
    let q: std::collections::HashMap<String, String> = parsed.query_pairs().into_owned().collect();
    assert_eq!(q["code_challenge_method"], "S256");
    assert_eq!(q["code_challenge"].len(), 43);
    assert_eq!(q["response_type"], "code");
    assert_eq!(q["redirect_uri"], format!("{}/v1/oauth/fake/callback", env.base));
    assert_eq!(q["scope"], "openid email mail.read");
    assert_eq!(q["state"].len(), 43);
    assert!(!url.contains(fleet_e2e::fake_oauth::CLIENT_SECRET));
    let back = env.authorize(&url).await;

    // No cookie, then another flow's cookie: refused, the state still usable.
    let no_cookie = env.callback(&back, None).await;
    assert_eq!(
        (no_cookie.status, no_cookie.code()),
        (403, "permission_denied".into()),
        "{no_cookie:?}"
    );
    let (_, other_cookie) = env.start("alice", "fake", "").await;
    let other_value = other_cookie.split_once('=').unwrap().1;
    let name = cookie.split_once('=').unwrap().0;
    let forged = env.callback(&back, Some(&format!("{name}={other_value}"))).await;
    assert_eq!(forged.status, 403, "{forged:?}");
    // Another provider's callback with this state: refused, the state still usable.
    let elsewhere = back.replace("/v1/oauth/fake/callback", "/v1/oauth/fake2/callback");
    let wrong_provider = env.callback(&elsewhere, Some(&cookie)).await;
    assert_eq!(
        (wrong_provider.status, wrong_provider.code()),
        (400, "invalid_arg".into())
    );
    // The browser that started it: connected, and the cookie cleared.
    let ok = env.callback(&back, Some(&cookie)).await;
    assert_eq!(ok.status, 200, "{ok:?}");
    assert!(
        ok.cookies
            .iter()
            .any(|c| c.starts_with(&format!("{name}=;")) && c.contains("Max-Age=0"))
    );
    assert_eq!(env.fake.code_grants(), 1);
    // Replayed: the state is spent; the provider is not even asked.
    let replay = env.callback(&back, Some(&cookie)).await;
    assert_eq!(
        (replay.status, replay.code()),
        (400, "invalid_arg".into()),
        "{replay:?}"
    );
    assert_eq!(
        env.fake.code_grants(),
        1,
        "a replayed callback never reaches the provider"
    );
    assert_eq!(
        env.fake.pkce_refusals(),
        0,
        "every verifier the fleet sent matched its challenge"
    );

    // A code with a fresh state (a code replayed into another flow): the provider refuses it, nothing added.
    let old_code = url::Url::parse(&back)
        .unwrap()
        .query_pairs()
        .find(|(k, _)| k == "code")
        .unwrap()
        .1
        .into_owned();
    let (url2, cookie2) = env.start("alice", "fake", "").await;
    let state2 = url::Url::parse(&url2)
        .unwrap()
        .query_pairs()
        .find(|(k, _)| k == "state")
        .unwrap()
        .1
        .into_owned();
    let spliced = format!(
        "{}/v1/oauth/fake/callback?code={old_code}&state={state2}",
        env.base
    );
    let refused = env.callback(&spliced, Some(&cookie2)).await;
    assert_eq!(refused.status, 502, "{refused:?}");
    assert!(refused.text.contains("invalid_grant"), "{refused:?}");
    assert_eq!(env.fake.replays(), 1);
    assert_eq!(env.accounts("alice").await.len(), 1);

    // PKCE: a code intercepted on its way back cannot be exchanged without the verifier.
    let (url3, _) = env.start("alice", "fake", "").await;
    let stolen = url::Url::parse(&env.authorize(&url3).await)
        .unwrap()
        .query_pairs()
        .find(|(k, _)| k == "code")
        .unwrap()
        .1
        .into_owned();
    let (status, body) = env
        .fake
        .exchange_directly(
            &stolen,
            &format!("{}/v1/oauth/fake/callback", env.base),
            "an-attackers-guess-of-the-verifier-0123456789ab",
        )
        .await;
    assert_eq!((status, body.contains("invalid_grant")), (400, true));
    assert_eq!(env.fake.pkce_refusals(), 1);

    // The provider's refusal, an unknown state, missing parameters.
    let denied = env
        .callback(
            &format!("{}/v1/oauth/fake/callback?error=access_denied&state=x", env.base),
            None,
        )
        .await;
    assert_eq!(denied.status, 400);
    let unknown = env
        .callback(
            &format!("{}/v1/oauth/fake/callback?code=c&state=never-issued", env.base),
            Some(&cookie),
        )
        .await;
    assert_eq!((unknown.status, unknown.code()), (400, "invalid_arg".into()));
    let bare = env
        .callback(&format!("{}/v1/oauth/fake/callback", env.base), None)
        .await;
    assert_eq!(bare.status, 400);
    // The HTML page names no secret and sends no referrer.
    let page = send(
        env.http
            .get(format!("{}/v1/oauth/fake/callback?code=c&state=s", env.base)),
    )
    .await;
    assert_eq!(page.status, 400);
    assert!(page.text.contains("Not connected"), "{page:?}");

    // `/start`: the user's API token only; no user in the query; known providers only.
    let no_token = send(env.http.get(format!("{}/v1/oauth/fake/start", env.base))).await;
    assert_eq!((no_token.status, no_token.code()), (401, "invalid_token".into()));
    let operator = send(env.http.get(format!("{}/v1/oauth/fake/start", env.base)).header(
        "authorization",
        format!("Bearer {}", env.cluster.operator_token()),
    ))
    .await;
    assert_eq!(
        operator.status, 401,
        "an operator token is not a user's: {operator:?}"
    );
    let as_bob = env.get(Some("alice"), "/v1/oauth/fake/start?user=bob").await;
    assert_eq!((as_bob.status, as_bob.code()), (400, "invalid_arg".into()));
    let unknown_provider = env.get(Some("alice"), "/v1/oauth/nope/start").await;
    assert_eq!(unknown_provider.status, 404);
    let json_start = env.get(Some("alice"), "/v1/oauth/fake/start?label=home").await;
    assert_eq!(json_start.status, 200, "{json_start:?}");
    assert!(
        json_start.json()["authorize_url"]
            .as_str()
            .unwrap()
            .starts_with(&env.fake.origin())
    );
    assert!(json_start.json()["expires_at_ms"].as_u64().unwrap() > now_ms() + 590_000);
    drop(env.cluster);
}

/// Access tokens: cached until they expire, then refreshed on demand — once for many concurrent callers of a
/// process (single-flight), the new tokens shared with another process through the record; a rotated refresh
/// token replaces the old one; a failing provider is `-32063`; a revoked grant marks the account
/// `needs_reauth` (`-32061`, and the mapped credential falls back to the next tier) until the user connects it
/// again. Tokens of 31–34 s are usable for 1–4 s (the fleet refreshes 30 s before expiry).
#[tokio::test]
async fn access_tokens_refresh_on_expiry_once_and_accounts_need_reauth_when_revoked() {
    let env = env("oauth-refresh").await;
    env.fake.set_expires_in(31);
    env.connect("alice", "").await;
    let t0 = env.fake.issued_access_tokens()[0].clone();
    assert_eq!(
        env.get_token("alice", json!({"provider": "fake"})).await.unwrap()["access_token"],
        t0
    );
    assert_eq!(
        env.fake.refresh_grants(),
        0,
        "the connect flow's token, from the record"
    );

    // Expired. Eight concurrent callers of one process: one refresh, whose refresh token rotates.
    env.fake.set_expires_in(34);
    env.fake.set_rotate(true);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    env.fake.delay_refreshes(Duration::from_millis(300));
    let calls: Vec<_> = (0..8)
        .map(|_| env.get_token("alice", json!({"provider": "fake"})))
        .collect();
    let answers = futures::future::join_all(calls).await;
    assert_eq!(env.fake.refresh_grants(), 1, "single-flight per account");
    let t1 = env.fake.issued_access_tokens().last().unwrap().clone();
    assert_ne!(t1, t0);
    for a in &answers {
        assert_eq!(a.as_ref().unwrap()["access_token"], t1.as_str());
    }
    assert_eq!(env.fake.issued_refresh_tokens().len(), 2, "rotated");
    // Another process (the front) uses the refreshed token from the record: no second refresh.
    let give_up = tokio::time::Instant::now() + Duration::from_secs(10);
    let t = env
        .front
        .oauth()
        .access_token("alice", "fake", None, give_up)
        .await
        .unwrap();
    assert_eq!(t.token.as_str(), t1);
    assert_eq!(env.fake.refresh_grants(), 1);
    env.fake.delay_refreshes(Duration::ZERO);

    // Expired again: the refresh presents the rotated refresh token (the first one is revoked now).
    env.fake.set_rotate(false);
    env.fake.set_expires_in(31);
    tokio::time::sleep(Duration::from_millis(4200)).await;
    let t2 = env.get_token("alice", json!({"provider": "fake"})).await.unwrap();
    assert_eq!(env.fake.refresh_grants(), 2);
    assert_eq!(
        t2["access_token"],
        env.fake.issued_access_tokens().last().unwrap().as_str()
    );
    tokio::time::sleep(Duration::from_millis(1200)).await;

    // The provider fails: -32063, the account stays active.
    env.fake.fail_refreshes_with(503);
    let failed = env.get_token("alice", json!({"provider": "fake"})).await;
    assert_eq!(code_of(&failed), (-32063, "CREDENTIALS_UPSTREAM".into()));
    assert_eq!(env.accounts("alice").await[0]["status"], "active");
    env.fake.fail_refreshes_with(0);

    // Revoked at the provider: -32061 needs re-auth; listed as such; not asked again; the mapped name falls to
    // the stored value.
    env.fake.revoke_refresh_tokens();
    let revoked = env.get_token("alice", json!({"provider": "fake"})).await;
    assert_eq!(code_of(&revoked), (-32061, "CREDENTIALS_NOT_GRANTED".into()));
    assert_eq!(revoked.unwrap_err().data.unwrap()["reason"], "needs_reauth");
    assert_eq!(env.accounts("alice").await[0]["status"], "needs_reauth");
    let grants_before = env.fake.refresh_grants();
    assert!(env.get_token("alice", json!({"provider": "fake"})).await.is_err());
    assert_eq!(
        env.fake.refresh_grants(),
        grants_before,
        "a revoked account is not asked again"
    );
    env.front
        .credential_store()
        .set(
            "alice",
            None,
            &[(MAPPED.to_owned(), "fallback".to_owned())].into_iter().collect(),
        )
        .await
        .unwrap();
    assert_eq!(
        env.resolved("alice", &[MAPPED]).await,
        json!({MAPPED: "fallback"})
    );
    // Connected again: the same account, active, and the platform token wins again.
    env.fake.set_expires_in(3600);
    env.connect("alice", "").await;
    let accounts = env.accounts("alice").await;
    assert_eq!(accounts.len(), 1, "the same identity, reconnected");
    assert_eq!(accounts[0]["status"], "active");
    assert_eq!(
        env.resolved("alice", &[MAPPED]).await[MAPPED],
        env.fake.issued_access_tokens().last().unwrap().as_str()
    );
    drop(env.cluster);
}

/// Two processes refreshing one account at once against a provider that rotates refresh tokens: the provider
/// refuses the loser's (already rotated) refresh token, and the account does not end up `needs_reauth` for it —
/// the winner's tokens are in the record, and the next call of either process uses them.
#[tokio::test]
async fn a_refresh_race_between_processes_leaves_the_account_active() {
    let env = env("oauth-race").await;
    env.fake.set_expires_in(31);
    env.connect("alice", "").await;
    env.fake.set_expires_in(3600);
    env.fake.set_rotate(true);
    env.fake.delay_refreshes(Duration::from_millis(300));
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let give_up = tokio::time::Instant::now() + Duration::from_secs(10);
    let (a, b) = tokio::join!(
        env.front.oauth().access_token("alice", "fake", None, give_up),
        env.worker.oauth().access_token("alice", "fake", None, give_up),
    );
    assert_eq!(env.fake.refresh_grants(), 2, "one refresh per process");
    assert!(a.is_ok() || b.is_ok(), "{a:?} {b:?}");
    env.fake.delay_refreshes(Duration::ZERO);
    assert_eq!(env.accounts("alice").await[0]["status"], "active");
    let winner = env.fake.issued_access_tokens().last().unwrap().clone();
    for services in [&env.front, &env.worker] {
        let t = services
            .oauth()
            .access_token("alice", "fake", None, give_up)
            .await
            .unwrap();
        assert_eq!(t.token.as_str(), winner);
    }
    assert_eq!(env.fake.refresh_grants(), 2, "nothing refreshed again");
    drop(env.cluster);
}

/// Every error of `credentials/*` (spec §8.8, §9 HR-ER-01: each with `data.errorCode`), and the two ways a
/// plugin can be without the family: not offered (no provider configured: absent from `initialize`, no token,
/// -32061 "not offered") versus offered but not covered (its manifest maps no name: no token, -32061 "token
/// missing"; a provider its token does not name: -32061 `APP_NOT_GRANTED`).
#[tokio::test]
async fn every_credentials_error_and_not_offered_versus_not_covered() {
    let env = env("oauth-errors").await;
    env.connect("alice", "").await;

    // Offered: the configured providers, in `initialize`.
    use fleet_worker::services::HostServices as _;
    assert_eq!(
        env.worker.offer().get("credentials"),
        Some(&json!({"providers": ["fake", "fake2"]}))
    );
    // Not offered: a process without providers.
    let bare = Box::pin(FleetServices::open(
        &async_nats::jetstream::new(fleet_e2e::cluster::connect(&env.cluster.nats, Role::Worker).await),
        &worker_settings(),
        &ServicesConfig::default(),
        LinkSigner::new(b"oauth-test-link-secret"),
        keyring(),
    ))
    .await
    .unwrap();
    assert!(bare.offer().get("credentials").is_none());
    let none = env.tokens(&bare, "alice", "inv-b", &[MAPPED]).await;
    assert!(none.credentials.is_none());
    let not_offered = env
        .reverse(
            &bare,
            "alice",
            "inv-b",
            &none,
            "credentials/getToken",
            json!({"provider": "fake"}),
        )
        .await;
    assert_eq!(code_of(&not_offered), (-32061, "CREDENTIALS_NOT_GRANTED".into()));
    assert!(not_offered.unwrap_err().message.contains("not offered"));

    // Offered, not covered: no mapped name declared, no token.
    let uncovered = env.tokens(&env.worker, "alice", "inv-u", &[UNMAPPED]).await;
    let r = env
        .reverse(
            &env.worker,
            "alice",
            "inv-u",
            &uncovered,
            "credentials/listAccounts",
            json!({"provider": "fake"}),
        )
        .await;
    assert_eq!(code_of(&r).0, -32061);
    assert!(r.unwrap_err().message.contains("credentials_token missing"));
    // Covered for `fake` only: `fake2` is not granted (APP_NOT_GRANTED), an unknown provider likewise.
    let tokens = env.tokens(&env.worker, "alice", "inv-e", &[MAPPED]).await;
    let call = |method: &'static str, params: Value| {
        let tokens = tokens.clone();
        let env = &env;
        async move {
            env.reverse(&env.worker, "alice", "inv-e", &tokens, method, params)
                .await
        }
    };
    for provider in ["fake2", "nope"] {
        let r = call("credentials/getToken", json!({"provider": provider})).await;
        assert_eq!(
            code_of(&r),
            (-32061, "CREDENTIALS_NOT_GRANTED".into()),
            "{provider}"
        );
        assert_eq!(r.unwrap_err().data.unwrap()["reason"], "APP_NOT_GRANTED");
    }
    // An unknown (well-formed) account: -32061.
    let r = call(
        "credentials/getToken",
        json!({"provider": "fake", "account_id": "acc_0000000000000000"}),
    )
    .await;
    assert_eq!(code_of(&r).0, -32061);
    // Malformed: -32062 (an e-mail for an account id, a missing or mistyped provider, a mistyped id).
    for params in [
        json!({"provider": "fake", "account_id": "alice@example.com"}),
        json!({}),
        json!({"provider": 5}),
        json!({"provider": "fake", "account_id": 12}),
        json!({"provider": "fake", "account_id": "nope"}),
    ] {
        let r = call("credentials/getToken", params.clone()).await;
        assert_eq!(
            code_of(&r),
            (-32062, "CREDENTIALS_INVALID_REQUEST".into()),
            "{params}"
        );
    }
    let r = call("credentials/listAccounts", json!({"provider": ""})).await;
    assert_eq!(code_of(&r).0, -32062);
    // An unknown method of the family: -32601.
    let r = call("credentials/revoke", json!({"provider": "fake"})).await;
    assert_eq!(r.unwrap_err().code, -32601);
    // Another invoke's token: refused.
    let r = env
        .reverse(
            &env.worker,
            "alice",
            "inv-other",
            &tokens,
            "credentials/listAccounts",
            json!({"provider": "fake"}),
        )
        .await;
    assert_eq!(code_of(&r).0, -32061);
    // Another user's token: refused.
    let r = env
        .reverse(
            &env.worker,
            "bob",
            "inv-e",
            &tokens,
            "credentials/listAccounts",
            json!({"provider": "fake"}),
        )
        .await;
    assert_eq!(code_of(&r).0, -32061);
    // Upstream (-32063) and needs-reauth (-32061) are the refresh test's. No error carries a token.
    for t in env
        .fake
        .issued_access_tokens()
        .iter()
        .chain(&env.fake.issued_refresh_tokens())
    {
        for r in [
            call("credentials/getToken", json!({"provider": "fake2"})).await,
            call(
                "credentials/getToken",
                json!({"provider": "fake", "account_id": "x@y"}),
            )
            .await,
        ] {
            assert!(!format!("{:?}", r.unwrap_err()).contains(t.as_str()));
        }
    }
    drop(env.cluster);
}

/// Users set, list (names only) and delete their own credentials over the HTTP listener with their API token;
/// the values reach their plugins' invokes; no request can name or reach another user's record.
#[tokio::test]
async fn users_manage_their_own_credentials_and_never_anothers() {
    let env = env("user-credentials").await;
    let put = |user: &str, query: &str, body: Value| {
        send(
            env.http
                .put(format!("{}/v1/credentials{query}", env.base))
                .header("authorization", env.bearer(user))
                .json(&body),
        )
    };
    let secret = "sk-alice-own-value-5e1d";
    let set = put("alice", "", json!({"values": {"API_KEY": secret}})).await;
    assert_eq!(set.status, 200, "{set:?}");
    assert_eq!(set.json()["credentials"][0]["name"], "API_KEY");
    assert_eq!(set.json()["credentials"][0]["scope"], "user");
    assert!(!set.text.contains(secret));
    let per_tool = put(
        "alice",
        &format!("?tool_id={TOOL}"),
        json!({"values": {"REGION": "eu"}}),
    )
    .await;
    assert_eq!(per_tool.json()["credentials"][0]["tool_id"], TOOL);
    let listed = env.get(Some("alice"), "/v1/credentials").await;
    assert_eq!(listed.status, 200);
    assert_eq!(listed.json()["credentials"].as_array().unwrap().len(), 2);
    assert!(!listed.text.contains(secret));
    // The values reach alice's invokes.
    assert_eq!(
        env.resolved("alice", &["API_KEY", "REGION"]).await,
        json!({"API_KEY": secret, "REGION": "eu"})
    );

    // Bob: sees nothing of alice's, deletes nothing of hers, cannot name her anywhere.
    let bob = env.get(Some("bob"), "/v1/credentials").await;
    assert_eq!(bob.json()["credentials"], json!([]));
    assert_eq!(bob.json()["user"], "bob");
    let bob_delete = send(
        env.http
            .delete(format!("{}/v1/credentials/API_KEY", env.base))
            .header("authorization", env.bearer("bob")),
    )
    .await;
    assert_eq!(bob_delete.json()["deleted"], json!([]));
    for query in ["?user=alice", "?tool_id=x&user=alice"] {
        let r = env.get(Some("bob"), &format!("/v1/credentials{query}")).await;
        assert_eq!((r.status, r.code()), (400, "invalid_arg".into()), "{query}");
    }
    let r = put("bob", "", json!({"user": "alice", "values": {"API_KEY": "bobs"}})).await;
    assert_eq!((r.status, r.code()), (400, "invalid_arg".into()));
    let r = put("bob", "?user=alice", json!({"values": {"API_KEY": "bobs"}})).await;
    assert_eq!(r.status, 400);
    assert_eq!(
        env.resolved("alice", &["API_KEY"]).await,
        json!({"API_KEY": secret})
    );
    // Only the user's API token: none, an operator's, a bad one.
    let none = env.get(None, "/v1/credentials").await;
    assert_eq!((none.status, none.code()), (401, "invalid_token".into()));
    let operator = send(env.http.get(format!("{}/v1/credentials", env.base)).header(
        "authorization",
        format!("Bearer {}", env.cluster.operator_token()),
    ))
    .await;
    assert_eq!(operator.status, 401);
    let bad = send(
        env.http
            .get(format!("{}/v1/credentials", env.base))
            .header("authorization", "Bearer not.a.jwt"),
    )
    .await;
    assert_eq!(bad.status, 401);
    // A malformed body is refused without echoing it.
    let malformed = send(
        env.http
            .put(format!("{}/v1/credentials", env.base))
            .header("authorization", env.bearer("alice"))
            .body(format!("{{\"values\": {{\"API_KEY\": {secret}}}}}")),
    )
    .await;
    assert_eq!(malformed.status, 400);
    assert!(!malformed.text.contains(secret), "{malformed:?}");
    let bad_name = put("alice", "", json!({"values": {"bad-name": "x"}})).await;
    assert_eq!(bad_name.status, 400);

    // Alice deletes her own.
    let deleted = send(
        env.http
            .delete(format!("{}/v1/credentials/API_KEY", env.base))
            .header("authorization", env.bearer("alice")),
    )
    .await;
    assert_eq!(deleted.json()["deleted"], json!(["API_KEY"]));
    assert_eq!(env.resolved("alice", &["API_KEY"]).await, json!({}));
    drop(env.cluster);
}

/// `[credentials] require_grant = true` (the recommended production setting): a plugin whose manifest declares a
/// mapped name gets neither the platform credential nor a `credentials_token` until the user's grant to that tool
/// names it (`credential:<NAME>`); a grant to one tool gives another nothing; the user's own stored values still
/// resolve; grant entries naming no valid credential are refused.
#[tokio::test]
async fn with_require_grant_platform_credentials_go_only_to_tools_granted_them() {
    let env = env_with("oauth-require-grant", "require_grant = true").await;
    let connected = env.connect("alice", "").await;
    let account = connected["account"]["account_id"].as_str().unwrap().to_owned();
    let live = env.fake.issued_access_tokens()[0].clone();
    env.front
        .credential_store()
        .set(
            "alice",
            Some(TOOL),
            &[(UNMAPPED.to_owned(), "other".to_owned())].into_iter().collect(),
        )
        .await
        .unwrap();

    // Not granted: no token, no platform value, listAccounts refused; the stored value still resolves.
    let tokens = env
        .tokens(&env.worker, "alice", "inv-1", &[MAPPED, UNMAPPED])
        .await;
    assert!(tokens.credentials.is_none(), "{tokens:?}");
    assert_eq!(
        env.resolved("alice", &[MAPPED, UNMAPPED]).await,
        json!({UNMAPPED: "other"})
    );
    let listed = env
        .reverse(
            &env.worker,
            "alice",
            "inv-1",
            &tokens,
            "credentials/listAccounts",
            json!({"provider": "fake"}),
        )
        .await;
    assert_eq!(code_of(&listed).0, -32061, "{listed:?}");

    // Granted to TOOL: both tiers, and the token covers the provider.
    let grants = env.front.grants();
    let grant = vec![format!("credential:{MAPPED}")];
    grants.edit("alice", TOOL, &grant, &[]).await.unwrap();
    let tokens = env.tokens(&env.worker, "alice", "inv-2", &[MAPPED]).await;
    let jwt = tokens
        .credentials
        .clone()
        .expect("a credentials_token once granted");
    assert_eq!(claims(&jwt)["providers"], json!(["fake"]));
    assert_eq!(env.resolved("alice", &[MAPPED]).await, json!({MAPPED: live}));
    let token = env
        .reverse(
            &env.worker,
            "alice",
            "inv-2",
            &tokens,
            "credentials/getToken",
            json!({"provider": "fake"}),
        )
        .await
        .unwrap();
    assert_eq!(token["account_id"], account.as_str());

    // Another tool of the same user, and the same tool of another user, get nothing from alice's grant to TOOL.
    let other_tool = env
        .worker
        .tokens(TokenRequest {
            user: "alice".into(),
            tool_id: "weather".into(),
            invoke_id: "inv-3".into(),
            negotiated: BTreeSet::new(),
            declared: Vec::new(),
            credentials: vec![MAPPED.to_owned()],
            deadline_ms: now_ms() + 60_000,
        })
        .await;
    assert!(other_tool.credentials.is_none());
    let names = vec![MAPPED.to_owned()];
    let weather = env
        .worker
        .credentials("alice", "weather", &names, now_ms() + 60_000)
        .await
        .unwrap();
    assert!(weather.0.is_empty(), "{:?}", weather.0.keys());

    // Revoked: gone again.
    grants.edit("alice", TOOL, &[], &grant).await.unwrap();
    assert!(
        env.tokens(&env.worker, "alice", "inv-4", &[MAPPED])
            .await
            .credentials
            .is_none()
    );
    assert_eq!(env.resolved("alice", &[MAPPED]).await, json!({}));

    // Grant entries: a valid name is a capability; anything else is refused, naming the entry.
    for bad in [
        "credential:",
        "credential:BAD-NAME",
        "credential:1X",
        "credentials:FAKE_TOKEN",
    ] {
        let e = grants
            .edit("alice", TOOL, &[bad.to_owned()], &[])
            .await
            .expect_err(bad);
        assert!(e.to_string().contains(bad), "{bad}: {e}");
    }
    drop(env.cluster);
}

/// Without `require_grant` (the spec's default) the mapped name needs no grant: the published manifest suffices.
#[tokio::test]
async fn without_require_grant_the_manifest_alone_gets_the_platform_credential() {
    let env = env_with("oauth-no-grant", "require_grant = false").await;
    env.connect("alice", "").await;
    let live = env.fake.issued_access_tokens()[0].clone();
    assert!(
        env.tokens(&env.worker, "alice", "inv-1", &[MAPPED])
            .await
            .credentials
            .is_some()
    );
    assert_eq!(env.resolved("alice", &[MAPPED]).await, json!({MAPPED: live}));
    drop(env.cluster);
}
