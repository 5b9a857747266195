//! The host services' gates, tokens and grants (issue 5), on a real nats-server: a service token is minted
//! only when the capability is negotiated AND declared AND granted; every reverse call is checked against its
//! token (signature, audience, expiry, and the user/plugin/invoke it was minted for); the grant is set by
//! operators only, with `fleet grant`; an invoke's budget lives exactly as long as the invoke.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::process::Command;
use std::sync::Arc;

use fleet::nats_server::NatsServer;
use fleet_client::auth::{DEFAULT_AUDIENCE, DEFAULT_ISSUER};
use fleet_e2e::fleet_bin;
use fleet_e2e::worker::{Plugin, TestWorker, data, test_config};
use fleet_proto::executa::reverse::{Family, family_of};
use fleet_proto::util::now_ms;
use fleet_services::args::ServicesArgs;
use fleet_services::dev::{DevArgs, parse_dev_mode};
use fleet_services::grants::GrantStore;
use fleet_services::tokens::{AUD_SAMPLING, AUD_STORAGE};
use fleet_services::{Binding, FleetServices, TokenMinter};
use fleet_store::StoreSettings;
use fleet_worker::services::{HostServices, InvokeTokens, ReverseCall, TokenRequest, TokenSource};
use serde_json::{Value, json};

const USER: &str = "alice";
const TOOL: &str = "tool-notes";

struct Env {
    nats: NatsServer,
    services: FleetServices,
    _dir: tempfile::TempDir,
}

async fn env() -> Env {
    env_with(DevArgs::default()).await
}

/// [`env`] with the developer harness of `dev` (its mock files written by the caller).
async fn env_with(dev: DevArgs) -> Env {
    let dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start(&dir.path().join("nats")).expect("nats-server (run scripts/test.sh once)");
    let client = nats.connect(fleet_client::creds::Role::Front).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let dev = dev
        .settings(&dir.path().join("no-catalogue"))
        .expect("mock files");
    let services = ServicesArgs::default()
        .open_with_dev(&js, &StoreSettings::default(), dir.path(), None, dev)
        .await
        .expect("services");
    Env {
        nats,
        services,
        _dir: dir,
    }
}

fn request(invoke: &str, negotiated: &[&str], declared: &[&str]) -> TokenRequest {
    TokenRequest {
        user: USER.into(),
        tool_id: TOOL.into(),
        invoke_id: invoke.into(),
        negotiated: negotiated
            .iter()
            .map(|s| (*s).to_owned())
            .collect::<BTreeSet<_>>(),
        declared: declared.iter().map(|s| (*s).to_owned()).collect(),
        credentials: Vec::new(),
        deadline_ms: now_ms() + 60_000,
    }
}

fn call(invoke: &str, method: &str, params: Value, tokens: InvokeTokens) -> ReverseCall {
    ReverseCall {
        user: USER.into(),
        tool_id: TOOL.into(),
        invoke_id: invoke.into(),
        tool: "run".into(),
        method: method.into(),
        family: family_of(method).expect("known family"),
        params,
        client_timeout_s: None,
        deadline_ms: now_ms() + 60_000,
        tokens,
    }
}

fn code(r: &Result<Value, fleet_proto::jsonrpc::ErrorObject>) -> (i64, String) {
    let e = r.as_ref().expect_err("an error");
    (e.code, e.error_code().unwrap_or_default().to_owned())
}

#[tokio::test]
async fn a_token_needs_negotiated_declared_and_granted() {
    let env = env().await;
    let all_keys = ["storage", "upload", "sampling"];
    let all_caps = ["aps.kv", "aps.files", "host.upload", "llm.sample"];

    // Nothing granted yet: no token, whatever was negotiated and declared.
    let t = env.services.tokens(request("i-0", &all_keys, &all_caps)).await;
    assert_eq!(t, InvokeTokens::default(), "default-deny without a grant");

    env.services
        .grants()
        .edit(
            USER,
            TOOL,
            &["aps.kv".into(), "host.upload".into(), "llm.sample".into()],
            &[],
        )
        .await
        .unwrap();
    let t = env.services.tokens(request("i-1", &all_keys, &all_caps)).await;
    assert!(
        t.storage.is_some() && t.upload.is_some(),
        "granted, declared, negotiated"
    );
    assert!(
        t.sampling.is_none(),
        "no LLM upstream configured: sampling is never minted"
    );
    assert!(
        !env.services.offer().contains_key("sampling"),
        "and not offered in initialize"
    );
    assert!(env.services.offer().contains_key("storage") && env.services.offer().contains_key("upload"));

    // Not negotiated.
    let t = env.services.tokens(request("i-2", &["upload"], &all_caps)).await;
    assert!(t.storage.is_none() && t.upload.is_some());
    // Not declared.
    let t = env
        .services
        .tokens(request("i-3", &all_keys, &["host.upload"]))
        .await;
    assert!(t.storage.is_none() && t.upload.is_some());
    // Not granted (revoked).
    env.services
        .grants()
        .edit(USER, TOOL, &[], &["host.upload".into()])
        .await
        .unwrap();
    let t = env.services.tokens(request("i-4", &all_keys, &all_caps)).await;
    assert!(t.storage.is_some() && t.upload.is_none());
    // Another plugin of the same user has no grant.
    let mut other = request("i-5", &all_keys, &all_caps);
    other.tool_id = "tool-other".into();
    assert_eq!(env.services.tokens(other).await, InvokeTokens::default());
    drop(env.nats);
}

#[tokio::test]
async fn every_reverse_call_is_checked_against_its_token() {
    let env = env().await;
    env.services
        .grants()
        .edit(USER, TOOL, &["aps.kv".into(), "aps.files".into()], &[])
        .await
        .unwrap();
    let tokens = env
        .services
        .tokens(request("inv-a", &["storage"], &["aps.kv"]))
        .await;
    assert!(tokens.storage.is_some());
    let get = json!({ "scope": "tool", "key": "k" });

    // Missing token: the spec's exact message.
    let r = env
        .services
        .serve(call("inv-a", "storage/get", get.clone(), InvokeTokens::default()))
        .await;
    assert_eq!(code(&r), (-32021, "STORAGE_NOT_GRANTED".into()));
    assert!(r.unwrap_err().message.contains("storage_token missing"));

    let tampered = |token: String| InvokeTokens {
        storage: Some(token),
        ..InvokeTokens::default()
    };
    let b = Binding {
        user: USER,
        tool_id: TOOL,
        invoke_id: "inv-a",
    };
    let ttl = std::time::Duration::from_secs(600);
    // Signed by another key.
    let foreign = TokenMinter::new().unwrap();
    let mut claims = TokenMinter::claims(b, AUD_STORAGE, ttl);
    claims.caps = vec!["aps.kv".into()];
    let bad_sig = foreign.sign(&claims).unwrap();
    // Another audience, our key.
    let mut wrong_aud = TokenMinter::claims(b, AUD_SAMPLING, ttl);
    wrong_aud.caps = vec!["aps.kv".into()];
    let wrong_aud = env.services.minter().sign(&wrong_aud).unwrap();
    // Expired.
    let mut expired = claims.clone();
    expired.exp = expired.iat - 1;
    let expired = env.services.minter().sign(&expired).unwrap();
    // Another invoke's token (valid in every other respect).
    let other_invoke = env
        .services
        .tokens(request("inv-b", &["storage"], &["aps.kv"]))
        .await;
    // A token without the capability of the family (aps.files only, calling storage/*).
    let mut files_only = claims.clone();
    files_only.caps = vec!["aps.files".into()];
    let files_only = env.services.minter().sign(&files_only).unwrap();

    for (what, t) in [
        ("signature", tampered(bad_sig)),
        ("audience", tampered(wrong_aud)),
        ("expired", tampered(expired)),
        ("another invoke", other_invoke),
        ("capability", tampered(files_only)),
        ("garbage", tampered("not-a-jwt".into())),
    ] {
        let r = env
            .services
            .serve(call("inv-a", "storage/get", get.clone(), t))
            .await;
        assert_eq!(code(&r), (-32021, "STORAGE_NOT_GRANTED".into()), "{what}");
    }
    drop(env.nats);
}

/// Families that are off (no upstream, no `--dev-mode …=mock`) answer the codes of spec §15.2's mode matrix
/// ("Host-visible error when off"; embeddings its not-negotiated code; images, without `[image]`, spec §8.6's
/// `-32109 IMAGE_NO_MODEL_AVAILABLE`); web and credentials, outside the matrix, their not-granted codes.
#[tokio::test]
async fn families_not_offered_answer_their_off_codes() {
    let env = env().await;
    for (method, expected) in [
        ("image/generate", -32109),
        ("agent/session.create", Family::Agent.not_granted().code),
        ("web/search", Family::Web.not_granted().code),
        ("credentials/listAccounts", Family::Credentials.not_granted().code),
        // No LLM upstream: sampling is off (`sampling_disabled`), embeddings not negotiated.
        ("sampling/createMessage", -32008),
        ("embeddings/create", -32507),
    ] {
        let r = env
            .services
            .serve(call("inv-x", method, json!({}), InvokeTokens::default()))
            .await;
        assert_eq!(code(&r).0, expected, "{method}");
    }
    let unknown = HostServices::call(
        &env.services,
        ReverseCall {
            method: "nope/thing".into(),
            ..call("inv-x", "storage/get", json!({}), InvokeTokens::default())
        },
    )
    .await;
    assert_eq!(code(&unknown).0, -32601);
    drop(env.nats);

    // `--dev-mode image=off` is the harness's "off" code (spec §15.2), not "no provider".
    let off = env_with(DevArgs {
        mocks: Vec::new(),
        dev_modes: vec![parse_dev_mode("image=off").unwrap()],
    })
    .await;
    let r = off
        .services
        .serve(call(
            "inv-y",
            "image/generate",
            json!({}),
            InvokeTokens::default(),
        ))
        .await;
    assert_eq!(code(&r).0, Family::Image.not_granted().code);
}

#[tokio::test]
async fn an_invoke_budget_lives_exactly_as_long_as_the_invoke() {
    let env = env().await;
    env.services
        .grants()
        .edit(USER, TOOL, &["aps.kv".into()], &[])
        .await
        .unwrap();
    let before = env.services.budgets_held();
    let t = env
        .services
        .tokens(request("inv-live", &["storage"], &["aps.kv"]))
        .await;
    assert!(t.storage.is_some());
    assert_eq!(env.services.budgets_held(), before + 1);
    assert!(env.services.budget("inv-live").is_some());
    env.services.invoke_finished("inv-live");
    assert!(env.services.budget("inv-live").is_none(), "dropped at invoke end");
    // No token, no budget.
    let t = env.services.tokens(request("inv-none", &[], &[])).await;
    assert_eq!(t, InvokeTokens::default());
    assert!(env.services.budget("inv-none").is_none());
    drop(env.nats);
}

#[tokio::test]
async fn a_long_invoke_gets_a_renewal_time_and_a_renewal_keeps_its_budget() {
    let env = env().await;
    env.services
        .grants()
        .edit(USER, TOOL, &["aps.kv".into()], &[])
        .await
        .unwrap();
    // A 1-minute invoke: the 600 s tokens outlive it.
    let short = env
        .services
        .tokens(request("inv-short", &["storage"], &["aps.kv"]))
        .await;
    assert_eq!(short.renew_at_ms, None);
    // A 2-hour job: tokens capped at 1 h, renewed 5 minutes before they expire.
    let mut long = request("inv-long", &["storage"], &["aps.kv"]);
    long.deadline_ms = now_ms() + 2 * 3_600_000;
    let minted_at = now_ms();
    let t = env.services.tokens(long.clone()).await;
    let at = t.renew_at_ms.expect("a renewal time");
    assert!(
        (minted_at + 3_300_000..=now_ms() + 3_300_000).contains(&at),
        "{at}"
    );
    let budget = env.services.budget("inv-long").unwrap();
    for _ in 0..3 {
        budget.admit_storage().unwrap();
    }
    // The renewal: new tokens, the same budget (its 3 calls still counted).
    let renewed = env.services.tokens(long).await;
    assert!(renewed.storage.is_some());
    assert_eq!(env.services.budget("inv-long").unwrap().storage_used(), 3);
    let r = env
        .services
        .serve(call(
            "inv-long",
            "storage/get",
            json!({"scope": "tool", "key": "k"}),
            renewed,
        ))
        .await;
    assert_eq!(r.unwrap()["exists"], false);
    assert_eq!(env.services.budget("inv-long").unwrap().storage_used(), 4);
    drop(env.nats);
}

// Multi-threaded: the CLI runs as a blocking child process while the admin service answers on the runtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_grant_is_an_operator_action_over_nats() {
    let dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start(&dir.path().join("nats")).expect("nats-server");
    let client = nats.connect(fleet_client::creds::Role::Front).await.unwrap();
    let js = async_nats::jetstream::new(client.clone());
    let grants = GrantStore::open(&js, &StoreSettings::default()).await.unwrap();
    let key = fleet_client::auth::DevKey::load_or_create(dir.path()).unwrap();
    let operator_key = fleet_client::auth::DevKey::load_or_create_operator(dir.path()).unwrap();
    let verifier =
        fleet_client::auth::OperatorVerifier::new(vec![operator_key.verify_key().unwrap()], DEFAULT_ISSUER)
            .unwrap();
    let admin = fleet::grants::serve_admin(client, grants.clone(), verifier)
        .await
        .unwrap();

    let fleet = |args: &[&str]| {
        let out = Command::new(fleet_bin())
            .args(args)
            .args(["--nats-url", &nats.url(), "--data-dir"])
            .arg(dir.path())
            .env_remove("FLEET_TOKEN")
            .output()
            .unwrap();
        let stdout: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.success(), stdout, stderr)
    };
    let (ok, g, err) = fleet(&[
        "grant",
        "--user",
        USER,
        "--tool-id",
        TOOL,
        "--allow",
        "aps.kv,aps.files,llm.sample",
    ]);
    assert!(ok, "{err}");
    assert_eq!(g["allow"], json!(["aps.files", "aps.kv", "llm.sample"]));
    let (ok, g, err) = fleet(&[
        "grant",
        "--user",
        USER,
        "--tool-id",
        TOOL,
        "--revoke",
        "aps.files",
    ]);
    assert!(ok, "{err}");
    assert_eq!(g["allow"], json!(["aps.kv", "llm.sample"]));
    let (ok, g, _) = fleet(&["grant", "--user", USER, "--tool-id", TOOL]);
    assert!(ok);
    assert_eq!(
        g["allow"],
        json!(["aps.kv", "llm.sample"]),
        "no flags: prints the grant"
    );
    assert!(
        grants.get(USER, TOOL).await.unwrap().allows("aps.kv"),
        "stored in JetStream KV"
    );

    // An unknown capability is refused and changes nothing.
    let (ok, _, err) = fleet(&[
        "grant",
        "--user",
        USER,
        "--tool-id",
        TOOL,
        "--allow",
        "aps.kv,root.shell",
    ]);
    assert!(!ok);
    assert!(err.contains("invalid_arg") && err.contains("root.shell"), "{err}");
    // A user token (no operator claim) is refused.
    let user_token = key
        .mint(
            USER,
            DEFAULT_ISSUER,
            DEFAULT_AUDIENCE,
            std::time::Duration::from_secs(60),
            false,
        )
        .unwrap();
    let (ok, _, err) = fleet(&[
        "grant",
        "--user",
        USER,
        "--tool-id",
        TOOL,
        "--revoke",
        "*",
        "--token",
        &user_token,
    ]);
    assert!(!ok);
    assert!(err.contains("permission_denied"), "{err}");
    assert_eq!(grants.get(USER, TOOL).await.unwrap().allow.len(), 2, "unchanged");
    // `*` revokes everything.
    let (ok, g, err) = fleet(&["grant", "--user", USER, "--tool-id", TOOL, "--revoke", "*"]);
    assert!(ok, "{err}");
    assert_eq!(g["allow"], json!([]));
    admin.abort();
}

/// Issue 18: a mock replaces the upstream, not the policy. Mocked sampling, images and uploads (no upstream
/// configured, `--mocks` given) are offered and minted like real ones, but only when negotiated, declared and
/// granted; the family's validation runs first; and the per-invoke budgets hold at their boundaries — 8 sampling
/// calls, 32 000 tokens of the mock's reported usage, 16 uploaded files —; `image/edit` needs its own grant.
#[tokio::test]
async fn mocked_families_keep_the_grants_validation_and_budgets_of_real_ones() {
    let mocks = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        mocks.path(),
        concat!(
            r#"{"ns":"llm","method":"complete","match":{"contentIncludes":"big"},"result":{"role":"assistant","content":{"type":"text","text":"big"},"model":"mock","stopReason":"endTurn","usage":{"totalTokens":16000}}}"#,
            "\n",
            r#"{"ns":"llm","method":"complete","result":{"role":"assistant","content":{"type":"text","text":"small"},"model":"mock","stopReason":"endTurn","usage":{"totalTokens":1}}}"#,
            "\n",
        ),
    )
    .unwrap();
    let env = env_with(DevArgs {
        mocks: vec![mocks.path().to_path_buf()],
        dev_modes: vec![parse_dev_mode("upload=mock").unwrap()],
    })
    .await;
    let offer = env.services.offer();
    for key in [
        "sampling",
        "embed",
        "agent",
        "image",
        "image.edit",
        "upload",
        "storage",
    ] {
        assert!(offer.contains_key(key), "{key}: {offer:?}");
    }
    let keys = ["sampling", "image", "image.edit", "upload"];
    let caps = ["llm.sample", "llm.image", "llm.image.edit", "host.upload"];
    let sample = |text: &str| json!({"messages": [{"role": "user", "content": {"type": "text", "text": text}}], "maxTokens": 100});

    // No grant: mocked or not, nothing is minted and the call is refused.
    let t = env.services.tokens(request("m-0", &keys, &caps)).await;
    assert_eq!(t, InvokeTokens::default());
    let r = env
        .services
        .serve(call("m-0", "sampling/createMessage", sample("x"), t))
        .await;
    assert_eq!(code(&r).0, -32001);

    env.services
        .grants()
        .edit(
            USER,
            TOOL,
            &["llm.sample".into(), "llm.image".into(), "host.upload".into()],
            &[],
        )
        .await
        .unwrap();

    // The sampling calls cap: 8 answered, the 9th refused (terminal); a malformed request is -32004 first.
    let t = env.services.tokens(request("m-1", &keys, &caps)).await;
    assert!(
        t.sampling.is_some() && t.image.is_some() && t.upload.is_some(),
        "{t:?}"
    );
    let bad = env
        .services
        .serve(call(
            "m-1",
            "sampling/createMessage",
            json!({"messages": []}),
            t.clone(),
        ))
        .await;
    assert_eq!(code(&bad).0, -32004);
    for i in 0..8 {
        let r = env
            .services
            .serve(call("m-1", "sampling/createMessage", sample("hi"), t.clone()))
            .await;
        assert_eq!(r.expect("within the cap")["content"]["text"], "small", "call {i}");
    }
    let r = env
        .services
        .serve(call("m-1", "sampling/createMessage", sample("hi"), t.clone()))
        .await;
    assert_eq!(code(&r), (-32006, "SAMPLING_MAX_CALLS_EXCEEDED".into()));

    // The token cap, from the mock's reported usage: 2 × 16 000 reach 32 000, the 3rd call is refused.
    let t = env.services.tokens(request("m-2", &keys, &caps)).await;
    for _ in 0..2 {
        let r = env
            .services
            .serve(call("m-2", "sampling/createMessage", sample("big"), t.clone()))
            .await;
        assert_eq!(r.expect("within the cap")["content"]["text"], "big");
    }
    let r = env
        .services
        .serve(call("m-2", "sampling/createMessage", sample("big"), t.clone()))
        .await;
    assert_eq!(code(&r), (-32007, "SAMPLING_MAX_TOKENS_EXCEEDED".into()));

    // Images: generate is granted, edit is not.
    let generated = env
        .services
        .serve(call(
            "m-2",
            "image/generate",
            json!({"prompt": "a cat"}),
            t.clone(),
        ))
        .await
        .expect("granted");
    assert_eq!(generated["images"].as_array().map(Vec::len), Some(1));
    let edit = env
        .services
        .serve(call(
            "m-2",
            "image/edit",
            json!({"prompt": "a cat", "image_url": "https://x/y.png"}),
            t.clone(),
        ))
        .await;
    assert_eq!(code(&edit).0, -32101);
    let empty = env
        .services
        .serve(call("m-2", "image/generate", json!({"prompt": " "}), t.clone()))
        .await;
    assert_eq!(code(&empty).0, -32104);

    // Uploads: the upload checks, then 16 files per invoke, the 17th refused.
    let inline =
        json!({"mode": "inline", "filename": "a.txt", "mime_type": "text/plain", "content_b64": "aGk="});
    let svg =
        json!({"mode": "inline", "filename": "a.svg", "mime_type": "image/svg+xml", "content_b64": "aGk="});
    let r = env
        .services
        .serve(call("m-2", "host/uploadFile", svg, t.clone()))
        .await;
    assert_eq!(code(&r).0, -32205);
    for i in 0..16 {
        let r = env
            .services
            .serve(call("m-2", "host/uploadFile", inline.clone(), t.clone()))
            .await;
        let envelope = r.unwrap_or_else(|e| panic!("file {i}: {e:?}"));
        assert_eq!(envelope["size_bytes"], 2);
        assert_eq!(envelope["download_url"], "data:text/plain;base64,aGk=");
    }
    let r = env
        .services
        .serve(call("m-2", "host/uploadFile", inline, t))
        .await;
    assert_eq!(code(&r).0, -32211);
    drop(env.nats);
}

/// Spec §3.3 (issue 17): the SDK's embeddings demo claims `embeddings` in `initialize`, the documentation `embed`.
/// Through a real worker and a real plugin process, a plugin claiming only `embeddings` (not `sampling`, which
/// also unlocks embeddings) negotiates the family and its `embeddings/create` is served; one claiming neither
/// gets the family's not-negotiated code (`-32507`), and — the agent family offered and the plugin granted —
/// `agent/complete` without `agent` or `sampling` claimed gets agent's (`-32041`, spec §8.2 has no other).
#[tokio::test]
async fn a_plugin_claiming_the_sdks_embeddings_key_negotiates_embeddings() {
    let env = env_with(DevArgs {
        mocks: Vec::new(),
        dev_modes: vec![
            parse_dev_mode("embeddings=mock").unwrap(),
            parse_dev_mode("agent=mock").unwrap(),
        ],
    })
    .await;
    let claims_embeddings = "tool-embeddings";
    let claims_nothing = "tool-unclaimed";
    let plugin = |tool_id: &str, claims: &str| {
        Plugin::echo(
            tool_id,
            &[
                "--capabilities",
                claims,
                "--host-capabilities",
                "llm.embed,llm.sample",
            ],
        )
    };
    let worker = TestWorker::with_services(
        test_config("embeddings-key"),
        &[
            plugin(claims_embeddings, "embeddings"),
            plugin(claims_nothing, "storage"),
        ],
        Arc::new(env.services.clone()),
        Arc::new(env.services.clone()),
    );
    for tool_id in [claims_embeddings, claims_nothing] {
        env.services
            .grants()
            .edit(USER, tool_id, &["llm.embed".into(), "llm.sample".into()], &[])
            .await
            .unwrap();
    }
    let embed = |tool_id: &'static str| {
        data(
            &worker,
            USER,
            tool_id,
            "reverse_rpc",
            json!({"method": "embeddings/create", "params": {"input": "hello"}, "timeout_ms": 30_000}),
        )
    };
    let served = embed(claims_embeddings).await;
    let result = &served["response"]["result"];
    assert!(result["data"][0]["embedding"].is_array(), "served: {served}");
    let refused = embed(claims_nothing).await;
    assert_eq!(refused["response"]["error"]["code"], -32507, "{refused}");
    let agent = data(
        &worker,
        USER,
        claims_nothing,
        "reverse_rpc",
        json!({"method": "agent/complete", "params": {"messages": [{"role": "user", "content": "hi"}]},
            "timeout_ms": 30_000}),
    )
    .await;
    assert_eq!(
        agent["response"]["error"]["code"],
        Family::Agent.not_negotiated().code,
        "{agent}"
    );
    assert_eq!(Family::Agent.not_negotiated().code, -32041);
    // The same code as "not granted" (granted it is): the worker refused it for the handshake.
    assert!(
        agent["response"]["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("did not negotiate")),
        "{agent}"
    );
    drop(worker);
    drop(env.nats);
}
