//! Operator rights are not a claim in a user token (the NATS trust issue): every admin API verifies tokens
//! against its own audience (`cloud-agents-operator`) and its own key set, so whoever can mint user tokens
//! cannot mint operator rights, and an operator token is no user token either.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use fleet::plugins::PluginStore;
use fleet::plugins::service;
use fleet_client::auth::{DEFAULT_AUDIENCE, DEFAULT_ISSUER, OPERATOR_AUDIENCE};
use fleet_e2e::cluster::Cluster;
use fleet_e2e::worker::Plugin;
use fleet_proto::admin::grants::{AREA as GRANTS_AREA, GET as GRANTS_GET, SET as GRANTS_SET};
use fleet_proto::admin::plugins::{AREA as PLUGINS_AREA, DESCRIBE, INSTALL, LIST, REMOVE};
use fleet_proto::api::{ApiErrorCode, ApiResponse, methods, subjects};
use fleet_services::grants::GrantStore;
use serde_json::{Value, json};

const TTL: Duration = Duration::from_secs(600);

async fn admin(c: &Cluster, token: &str, area: &str, method: &str, args: &Value) -> ApiResponse<Value> {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(subjects::AUTH_HEADER, format!("Bearer {token}").as_str());
    let request = async_nats::Request::new()
        .headers(headers)
        .payload(serde_json::to_vec(args).unwrap().into())
        .timeout(Some(Duration::from_secs(30)));
    let msg = c
        .operator
        .send_request(fleet_proto::admin::subject(area, method), request)
        .await
        .expect("an answer");
    serde_json::from_slice(&msg.payload).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_token_claiming_operator_is_refused_by_every_admin_api() {
    let c = Cluster::start("op-auth", 1, 1, &[Plugin::echo("echo", &[])]).await;
    let js = async_nats::jetstream::new(c.client.clone());
    let grants = GrantStore::open(&js, c.store.settings()).await.unwrap();
    let grants_api = fleet::grants::serve_admin(c.client.clone(), grants.clone(), c.operator_verifier())
        .await
        .unwrap();
    let plugins = PluginStore::open(&js, c.store.settings()).await.unwrap();
    let plugins_api = service::serve(
        c.client.clone(),
        plugins,
        c.store.clone(),
        c.operator_verifier(),
        c.root.path().join("scratch"),
        fleet::plugins::download::SourcePolicy::default(),
    )
    .await
    .unwrap();
    let issuer = fleet::creds::Issuer::open(
        &js,
        c.store.settings(),
        fleet::nats_auth::AuthMaterial::load_read_only(c.nats.store_dir()).unwrap(),
        fleet_e2e::cluster::connect(&c.nats, fleet_e2e::cluster::Role::Sys).await,
    )
    .await
    .unwrap();
    let creds_api = fleet::creds::serve_admin(c.client.clone(), issuer.clone(), c.operator_verifier())
        .await
        .unwrap();
    let credentials = fleet_services::credentials::CredentialStore::open(
        &js,
        c.store.settings(),
        fleet_services::credentials::Keyring::fixed(&[("k1", [3; 32])]),
    )
    .await
    .unwrap();
    let accounts = fleet_services::oauth::accounts::AccountStore::open(
        &js,
        c.store.settings(),
        fleet_services::credentials::Keyring::fixed(&[("k1", [3; 32])]),
    )
    .await
    .unwrap();
    let credentials_api = fleet::credentials::serve_admin(
        c.client.clone(),
        credentials.clone(),
        accounts,
        c.operator_verifier(),
    )
    .await
    .unwrap();
    // A JetStream round trip on the services' connection: the server has processed their subscriptions (a flush
    // only writes them out; the operator's request comes on another connection).
    async_nats::jetstream::new(c.client.clone())
        .query_account()
        .await
        .expect("a JetStream API round trip");
    use fleet_proto::admin::credentials as user_creds;

    let calls: Vec<(&str, &str, Value)> = vec![
        (
            user_creds::AREA,
            user_creds::SET,
            json!({ "user": "victim", "values": { "API_KEY": "planted" } }),
        ),
        (user_creds::AREA, user_creds::LIST, json!({ "user": "victim" })),
        (
            user_creds::AREA,
            user_creds::DELETE,
            json!({ "user": "victim", "names": ["API_KEY"] }),
        ),
        (user_creds::AREA, user_creds::REWRAP, json!({})),
        (
            fleet_proto::admin::creds::AREA,
            fleet_proto::admin::creds::ISSUE,
            json!({ "name": "mallory" }),
        ),
        (
            fleet_proto::admin::creds::AREA,
            fleet_proto::admin::creds::LIST,
            json!({}),
        ),
        (
            fleet_proto::admin::creds::AREA,
            fleet_proto::admin::creds::REVOKE,
            json!({ "name": "victim" }),
        ),
        (
            GRANTS_AREA,
            GRANTS_SET,
            json!({ "user": "mallory", "tool_id": "echo", "allow": ["aps.kv"] }),
        ),
        (
            GRANTS_AREA,
            GRANTS_GET,
            json!({ "user": "victim", "tool_id": "echo" }),
        ),
        (
            PLUGINS_AREA,
            INSTALL,
            json!({ "source": "http://127.0.0.1:9/evil.tar.gz" }),
        ),
        (PLUGINS_AREA, LIST, json!({})),
        (PLUGINS_AREA, REMOVE, json!({ "tool_id": "echo" })),
        (PLUGINS_AREA, DESCRIBE, json!({ "tool_id": "echo" })),
    ];
    // Tokens that must not pass: the user key with the operator claim (for the API audience, and for the operator
    // audience), and the operator key for the API audience.
    let forged = [
        (
            "user key, operator claim",
            c.key
                .mint("mallory", DEFAULT_ISSUER, DEFAULT_AUDIENCE, TTL, true)
                .unwrap(),
        ),
        (
            "user key, operator audience",
            c.key
                .mint("mallory", DEFAULT_ISSUER, OPERATOR_AUDIENCE, TTL, true)
                .unwrap(),
        ),
        (
            "operator key, API audience",
            c.operator_key
                .mint("ops", DEFAULT_ISSUER, DEFAULT_AUDIENCE, TTL, true)
                .unwrap(),
        ),
    ];
    for (area, method, args) in &calls {
        for (what, token) in &forged {
            match admin(&c, token, area, method, args).await {
                ApiResponse::Err(e) => assert_eq!(
                    e.code,
                    ApiErrorCode::PermissionDenied,
                    "{area}.{method} / {what}: {e}"
                ),
                ApiResponse::Ok(v) => panic!("{area}.{method} accepted a {what} token: {v}"),
            }
        }
    }
    assert!(
        grants.get("mallory", "echo").await.unwrap().allow.is_empty(),
        "nothing was granted"
    );
    assert!(
        issuer.list().await.unwrap().is_empty(),
        "no credential was issued"
    );
    assert!(
        credentials
            .list("victim", None)
            .await
            .unwrap()
            .credentials
            .is_empty(),
        "no user credential was set"
    );

    // The operator's own token passes (a read is enough to show it), and is no user token.
    let ops = c.operator_token();
    match admin(&c, &ops, PLUGINS_AREA, LIST, &json!({})).await {
        ApiResponse::Ok(_) => {}
        ApiResponse::Err(e) => panic!("the operator token was refused: {e}"),
    }
    let e = match c
        .call_with_token(&format!("Bearer {ops}"), methods::TOOLS_LIST_JOBS, json!({}))
        .await
    {
        ApiResponse::Err(e) => e,
        ApiResponse::Ok(v) => panic!("an operator token served as a user token: {v}"),
    };
    assert_eq!(e.code, ApiErrorCode::InvalidToken, "{e}");
    grants_api.abort();
    plugins_api.abort();
    creds_api.abort();
    credentials_api.abort();
    c.shutdown().await;
}
