//! Agent sessions and `agent/complete` (spec §8.2, budgets §7.4) over a fake OpenAI-compatible upstream, through
//! `FleetServices::serve` with real tokens minted by the fleet's token source over a real nats-server (grants in
//! JetStream KV). These invokes have no front delegation, so their sessions run without tools (the tool calls
//! through a real front are in `fleet_up.rs`); a model that calls a tool anyway gets a failed `tool_result`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;

use fleet::nats_server::NatsServer;
use fleet_e2e::fake_llm::{CHAT, FakeLlm};
use fleet_proto::executa::reverse::{agent as codes, family_of};
use fleet_proto::jsonrpc::ErrorObject;
use fleet_proto::limits;
use fleet_proto::util::now_ms;
use fleet_services::agent::AgentConfig;
use fleet_services::llm::LlmConfig;
use fleet_services::{FleetServices, ServicesConfig};
use fleet_worker::services::{HostServices, InvokeTokens, ReverseCall, TokenRequest, TokenSource};
use serde_json::{Value, json};

const USER: &str = "user-1";
const TOOL: &str = "tool-agent";

struct Env {
    services: FleetServices,
    llm: FakeLlm,
    config: ServicesConfig,
    nats: NatsServer,
    _dir: tempfile::TempDir,
}

/// A nats-server, the fake upstream and the services (at most `max_sessions` sessions); the user is granted
/// `llm.sample` and, with `auto`, `llm.agent.auto` on [`TOOL`].
async fn env_with(max_sessions: usize, auto: bool) -> Env {
    let dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start(&dir.path().join("nats")).expect("nats-server (run scripts/test.sh once)");
    let client = nats.connect(fleet_client::creds::Role::Front).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let llm = FakeLlm::start().await;
    let config = ServicesConfig {
        llm: Some(LlmConfig {
            base_url: llm.base_url(),
            default_model: Some("fake-agent".into()),
            ..LlmConfig::default()
        }),
        agent: AgentConfig { max_sessions },
        ..ServicesConfig::default()
    };
    let services = fleet_e2e::open_services(&js, &config).await;
    let mut allow = vec!["llm.sample".to_owned()];
    if auto {
        allow.push("llm.agent.auto".into());
    }
    services.grants().edit(USER, TOOL, &allow, &[]).await.unwrap();
    Env {
        services,
        llm,
        config,
        nats,
        _dir: dir,
    }
}

async fn env() -> Env {
    env_with(limits::AGENT_SESSION_CACHE_MAX, true).await
}

#[derive(Clone)]
struct Invoke {
    services: FleetServices,
    user: String,
    invoke_id: String,
    tokens: InvokeTokens,
}

impl Env {
    /// Another worker's services: its own process state (token key, budgets), the worker's NATS credential, the
    /// same JetStream (a worker restarted, or the next worker an invoke lands on).
    async fn worker(&self) -> FleetServices {
        let js = async_nats::jetstream::new(
            self.nats
                .connect(fleet_client::creds::Role::Worker)
                .await
                .unwrap(),
        );
        Box::pin(FleetServices::open(
            &js,
            &fleet_store::StoreSettings {
                provision: fleet_store::Provision::Attach,
                ..fleet_store::StoreSettings::default()
            },
            &self.config,
            fleet_services::files::LinkSigner::new(b"host-services-test-link-secret-32b"),
            fleet_services::credentials::Keyring::fixed(&[("k1", [7; 32])]),
        ))
        .await
        .expect("services (worker)")
    }

    /// An invoke of [`TOOL`] by `user` on `services` (tokens are minted and checked by the same process).
    async fn invoke_on(&self, services: &FleetServices, user: &str, invoke_id: &str) -> Invoke {
        let tokens = <FleetServices as TokenSource>::tokens(
            services,
            TokenRequest {
                user: user.into(),
                tool_id: TOOL.into(),
                invoke_id: invoke_id.into(),
                negotiated: ["agent", "sampling"]
                    .iter()
                    .map(|s| (*s).to_owned())
                    .collect::<BTreeSet<_>>(),
                declared: vec!["llm.sample".into(), "llm.agent.auto".into()],
                credentials: Vec::new(),
                deadline_ms: now_ms() + 60_000,
            },
        )
        .await;
        Invoke {
            services: services.clone(),
            user: user.into(),
            invoke_id: invoke_id.into(),
            tokens,
        }
    }

    /// An invoke of [`TOOL`] by `user` that negotiated `agent` and declared `declared`.
    async fn invoke_as(&self, user: &str, invoke_id: &str, declared: &[&str]) -> Invoke {
        let tokens = <FleetServices as TokenSource>::tokens(
            &self.services,
            TokenRequest {
                user: user.into(),
                tool_id: TOOL.into(),
                invoke_id: invoke_id.into(),
                negotiated: ["agent", "sampling"]
                    .iter()
                    .map(|s| (*s).to_owned())
                    .collect::<BTreeSet<_>>(),
                declared: declared.iter().map(|s| (*s).to_owned()).collect(),
                credentials: Vec::new(),
                deadline_ms: now_ms() + 60_000,
            },
        )
        .await;
        Invoke {
            services: self.services.clone(),
            user: user.into(),
            invoke_id: invoke_id.into(),
            tokens,
        }
    }

    async fn invoke_declaring(&self, invoke_id: &str, declared: &[&str]) -> Invoke {
        self.invoke_as(USER, invoke_id, declared).await
    }

    async fn invoke(&self, invoke_id: &str) -> Invoke {
        self.invoke_declaring(invoke_id, &["llm.sample", "llm.agent.auto"])
            .await
    }
}

impl Invoke {
    async fn call(&self, method: &str, params: Value) -> Result<Value, ErrorObject> {
        self.services
            .serve(ReverseCall {
                user: self.user.clone(),
                tool_id: TOOL.into(),
                invoke_id: self.invoke_id.clone(),
                tool: "reverse".into(),
                method: method.into(),
                family: family_of(method).unwrap(),
                params,
                client_timeout_s: None,
                deadline_ms: now_ms() + 60_000,
                tokens: self.tokens.clone(),
            })
            .await
    }

    async fn create(&self, params: Value) -> String {
        let created = self.call("agent/session.create", params).await.unwrap();
        created["app_session_uuid"].as_str().unwrap().to_owned()
    }
}

#[track_caller]
fn code_of(r: &Result<Value, ErrorObject>) -> (i64, String) {
    match r {
        Ok(v) => panic!("expected an error, got {v}"),
        Err(e) => (e.code, e.error_code().unwrap_or_default().to_owned()),
    }
}

fn tool_call(id: &str, name: &str, args: &str) -> Value {
    json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}})
}

/// An assistant message with `n` tool calls (to a tool nobody offered) and, optionally, text.
fn calls(n: usize, text: Option<&str>) -> Value {
    let calls: Vec<Value> = (0..n)
        .map(|i| tool_call(&format!("c{i}"), "ghost__tool", "{}"))
        .collect();
    json!({"role": "assistant", "content": text, "tool_calls": calls})
}

fn final_text(text: &str) -> Value {
    json!({"role": "assistant", "content": text})
}

// -------------------------------------------------------------------------------------------------------------
// agent/complete
// -------------------------------------------------------------------------------------------------------------

#[tokio::test]
async fn complete_answers_mcp_shaped_over_the_upstream_and_counts_on_the_sampling_budget() {
    let env = env().await;
    env.llm.set(|b| b.text = Some("Paris.".into()));
    // `llm.sample` alone is enough for agent/complete.
    let inv = env.invoke_declaring("inv-complete", &["llm.sample"]).await;
    let out = inv
        .call(
            "agent/complete",
            json!({"messages": [{"role": "user", "content": "Capital of France?"}], "systemPrompt": "Be brief."}),
        )
        .await
        .unwrap();
    assert_eq!(out["role"], "assistant");
    assert_eq!(out["content"], json!({"type": "text", "text": "Paris."}));
    assert_eq!(out["model"], "fake-agent");
    assert_eq!(out["stopReason"], "endTurn");
    assert_eq!(out["usage"]["totalTokens"], 15);
    let chat = env.llm.last_chat();
    assert_eq!(chat["max_tokens"], limits::AGENT_COMPLETE_DEFAULT_MAX_TOKENS);
    assert_eq!(
        chat["messages"][0],
        json!({"role": "system", "content": "Be brief."})
    );
    assert_eq!(
        chat["messages"][1],
        json!({"role": "user", "content": "Capital of France?"})
    );
    assert_eq!(
        env.services.budget("inv-complete").unwrap().sampling_used(),
        (1, 15)
    );

    // Malformed: -32043; over the calls budget: -32045.
    for bad in [
        json!({}),
        json!({"messages": []}),
        json!({"messages": [{"role": "user", "content": "x"}], "maxTokens": 0}),
    ] {
        let r = inv.call("agent/complete", bad).await;
        assert_eq!(code_of(&r).0, codes::AGENT_INVALID_REQUEST.code);
    }
    let ok = json!({"messages": [{"role": "user", "content": "again"}]});
    for _ in 1..limits::SAMPLING_MAX_CALLS_PER_INVOKE {
        inv.call("agent/complete", ok.clone()).await.unwrap();
    }
    let r = inv.call("agent/complete", ok).await;
    assert_eq!(code_of(&r).0, codes::AGENT_QUOTA_EXCEEDED.code);
}

/// The sampling budget under concurrency: more `agent/complete` calls than the invoke may make, all at once, and
/// exactly `SAMPLING_MAX_CALLS_PER_INVOKE` reach the upstream; the rest are `-32045` and cost nothing.
#[tokio::test]
async fn concurrent_completes_never_pass_the_invokes_calls_budget() {
    let env = env().await;
    env.llm.set(|b| b.text = Some("ok".into()));
    let inv = env.invoke_declaring("inv-race", &["llm.sample"]).await;
    let max = limits::SAMPLING_MAX_CALLS_PER_INVOKE;
    let calls = (0..max + 6).map(|i| {
        let inv = &inv;
        async move {
            inv.call(
                "agent/complete",
                json!({"messages": [{"role": "user", "content": format!("call {i}")}]}),
            )
            .await
        }
    });
    let results = futures::future::join_all(calls).await;
    let served = results.iter().filter(|r| r.is_ok()).count();
    let refused: Vec<i64> = results
        .iter()
        .filter(|r| r.is_err())
        .map(|r| code_of(r).0)
        .collect();
    assert_eq!(served, max as usize);
    assert_eq!(refused, vec![codes::AGENT_QUOTA_EXCEEDED.code; 6]);
    assert_eq!(env.services.budget("inv-race").unwrap().sampling_used().0, max);
}

#[tokio::test]
async fn upstream_failures_map_to_the_agent_codes_without_echoing_the_body() {
    let env = env().await;
    let inv = env.invoke("inv-upstream").await;
    let uuid = inv.create(json!({})).await;
    for (status, expected) in [
        (500, codes::AGENT_PROVIDER_ERROR),
        (429, codes::AGENT_RATE_LIMITED),
        (402, codes::AGENT_QUOTA_EXCEEDED),
    ] {
        env.llm.set(|b| b.status = Some(status));
        let r = inv
            .call(
                "agent/session.run",
                json!({"app_session_uuid": uuid, "content": "hi"}),
            )
            .await;
        assert_eq!(
            code_of(&r),
            (expected.code, expected.name.to_owned()),
            "HTTP {status}"
        );
        let shown = format!("{r:?}");
        assert!(!shown.contains("sk-should-never-leak"), "{shown}");
        let c = inv
            .call(
                "agent/complete",
                json!({"messages": [{"role": "user", "content": "x"}]}),
            )
            .await;
        assert!(code_of(&c).0 <= -32041 && code_of(&c).0 >= -32048, "{c:?}");
    }
}

// -------------------------------------------------------------------------------------------------------------
// Sessions
// -------------------------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_session_runs_remembers_and_is_listed_refreshed_and_deleted() {
    let env = env().await;
    let inv = env.invoke("inv-life").await;
    let created = inv
        .call(
            "agent/session.create",
            json!({"kind": "agent", "agent_submode": "auto", "label": "demo", "system_prompt": "You are terse.",
                "ttl_seconds": 300}),
        )
        .await
        .unwrap();
    let uuid = created["app_session_uuid"].as_str().unwrap().to_owned();
    assert!(uuid.starts_with("aps_"), "{created}");
    assert_eq!(created["agent_submode"], "auto");
    assert_eq!(created["granted_tools"], json!(["*"]));
    assert_eq!(created["inherit_host_tools"], true);
    assert_eq!(created["expires_in"], 300);
    assert!(created.get("app_session_token").is_none() && !created.to_string().contains("eyJ"));

    env.llm.set(|b| b.text = Some("Hello there.".into()));
    let run = inv
        .call(
            "agent/session.run",
            json!({"app_session_uuid": uuid, "content": "Say hello", "allowed_tools": [], "run_id": "run_1"}),
        )
        .await
        .unwrap();
    assert_eq!(run["run_id"], "run_1");
    let frames = run["frames"].as_array().unwrap();
    let events: Vec<&str> = frames.iter().map(|f| f["event"].as_str().unwrap()).collect();
    assert_eq!(events, ["delta", "final"]);
    for (i, f) in frames.iter().enumerate() {
        assert_eq!(f["seq"], i);
        assert_eq!(f["stream_id"], run["stream_id"]);
    }
    assert_eq!(frames[1]["text"], "Hello there.");
    assert_eq!(run["final"]["text"], "Hello there.");
    assert_eq!(run["final"]["usage"]["totalTokens"], 15);
    // No tools were offered for `allowed_tools: []`; the session's system prompt came first.
    let chat = env.llm.last_chat();
    assert!(chat.get("tools").is_none(), "{chat}");
    assert_eq!(
        chat["messages"][0],
        json!({"role": "system", "content": "You are terse."})
    );

    // The next run continues the conversation.
    env.llm.set(|b| b.text = Some("Again.".into()));
    inv.call(
        "agent/session.run",
        json!({"app_session_uuid": uuid, "content": "Once more", "allowed_tools": []}),
    )
    .await
    .unwrap();
    let chat = env.llm.last_chat();
    let sent: Vec<&str> = chat["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["content"].as_str().unwrap())
        .collect();
    assert_eq!(sent, ["You are terse.", "Say hello", "Hello there.", "Once more"]);

    let history = inv
        .call(
            "agent/session.history",
            json!({"app_session_uuid": uuid, "limit": 3}),
        )
        .await
        .unwrap();
    assert_eq!(history["messages"].as_array().unwrap().len(), 3);
    assert_eq!(history["next_cursor"], "3");
    let rest = inv
        .call(
            "agent/session.history",
            json!({"app_session_uuid": uuid, "limit": 200, "cursor": "3"}),
        )
        .await
        .unwrap();
    assert_eq!(rest["messages"][0]["content"], "Again.");
    assert!(rest["next_cursor"].is_null());

    // Sessions outlive the invoke that created them (keyed by user, plugin and uuid).
    let later = env.invoke("inv-life-2").await;
    let listed = later.call("agent/session.list", json!({})).await.unwrap();
    assert_eq!(listed["sessions"][0]["app_session_uuid"], uuid);
    assert_eq!(listed["sessions"][0]["label"], "demo");
    let refreshed = later
        .call(
            "agent/session.refresh",
            json!({"app_session_uuid": uuid, "ttl_seconds": 7200}),
        )
        .await
        .unwrap();
    assert_eq!(refreshed["expires_in"], 7200);
    assert_eq!(refreshed["idle_ttl_seconds"], 7200);
    let cancel = later
        .call(
            "agent/session.cancel",
            json!({"app_session_uuid": uuid, "run_id": "run_1"}),
        )
        .await
        .unwrap();
    assert_eq!(cancel, json!({"cancelled": false, "run_id": "run_1"}));
    let deleted = later
        .call("agent/session.delete", json!({"app_session_uuid": uuid}))
        .await
        .unwrap();
    assert_eq!(deleted["deleted"], true);
    // Idempotent; afterwards the uuid is unknown.
    let again = later
        .call("agent/session.delete", json!({"app_session_uuid": uuid}))
        .await
        .unwrap();
    assert_eq!(again["deleted"], false);
    let r = later
        .call(
            "agent/session.run",
            json!({"app_session_uuid": uuid, "content": "x"}),
        )
        .await;
    assert_eq!(code_of(&r).0, codes::AGENT_SESSION_NOT_FOUND.code);
    assert_eq!(env.services.agent().sessions_of(USER).await.unwrap(), 0);
}

#[tokio::test]
async fn a_run_without_delegation_warns_and_a_called_tool_fails_in_its_frame() {
    let env = env().await;
    let inv = env.invoke("inv-notools").await;
    let uuid = inv.create(json!({})).await;
    env.llm.set(|b| {
        b.script.push_back(json!({"role": "assistant", "content": null,
            "tool_calls": [tool_call("call_1", "echo-py__echo", "{\"x\":1}")]}));
        b.script.push_back(final_text("done"));
    });
    let run = inv
        .call(
            "agent/session.run",
            json!({"app_session_uuid": uuid, "content": "use a tool"}),
        )
        .await
        .unwrap();
    let frames = run["frames"].as_array().unwrap();
    let events: Vec<&str> = frames.iter().map(|f| f["event"].as_str().unwrap()).collect();
    assert_eq!(events, ["run_meta", "tool_call", "tool_result", "delta", "final"]);
    assert_eq!(frames[0]["warnings"][0]["code"], "NO_TOOLS_AVAILABLE");
    assert_eq!(frames[1]["name"], "echo-py__echo");
    assert_eq!(frames[1]["args"], json!({"x": 1}));
    assert_eq!(frames[1]["call_id"], "call_1");
    assert_eq!(frames[2]["call_id"], "call_1");
    assert_eq!(frames[2]["ok"], false);
    assert_eq!(frames[2]["error"]["code"], "tool_not_available");
    // The model saw the failed result on its second step.
    let chat = env.llm.last_chat();
    let last = chat["messages"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["role"], "tool");
    assert_eq!(last["tool_call_id"], "call_1");
    assert_eq!(env.llm.bodies(CHAT).len(), 2);
}

#[tokio::test]
async fn the_frame_cap_holds_at_4096_and_the_next_frame_aborts_the_run() {
    let env = env().await;
    let inv = env.invoke("inv-frames").await;
    let uuid = inv.create(json!({})).await;
    // 2 × 2 047 tool frames + delta + final = 4 096.
    let n = (limits::AGENT_MAX_FRAMES - 2) / 2;
    env.llm.set(|b| {
        b.script.push_back(calls(n, None));
        b.script.push_back(final_text("ok"));
    });
    let run = inv
        .call(
            "agent/session.run",
            json!({"app_session_uuid": uuid, "content": "many", "allowed_tools": []}),
        )
        .await
        .unwrap();
    let frames = run["frames"].as_array().unwrap();
    assert_eq!(frames.len(), limits::AGENT_MAX_FRAMES);
    assert_eq!(frames.last().unwrap()["seq"], limits::AGENT_MAX_FRAMES - 1);
    assert_eq!(frames.last().unwrap()["event"], "final");

    // One more frame (text beside the tool calls): -32045 with AGENT_RUN_TOO_LARGE.
    let inv = env.invoke("inv-frames-2").await;
    env.llm.set(|b| {
        b.script.push_back(calls(n, Some("thinking")));
        b.script.push_back(final_text("ok"));
    });
    let r = inv
        .call(
            "agent/session.run",
            json!({"app_session_uuid": uuid, "content": "many", "allowed_tools": []}),
        )
        .await;
    let e = r.unwrap_err();
    assert_eq!(e.code, codes::AGENT_QUOTA_EXCEEDED.code);
    assert_eq!(e.error_code(), Some("AGENT_RUN_TOO_LARGE"));
    assert_eq!(e.data.as_ref().unwrap()["maxFrames"], limits::AGENT_MAX_FRAMES);
}

#[tokio::test]
async fn each_step_is_a_sampling_call_and_the_ninth_is_refused() {
    let env = env().await;
    let inv = env.invoke("inv-steps").await;
    let uuid = inv.create(json!({})).await;
    let looping = |b: &mut fleet_e2e::fake_llm::Behaviour| {
        b.script.clear();
        for _ in 0..limits::AGENT_MAX_RECURSION_LIMIT {
            b.script.push_back(calls(1, None));
        }
    };
    env.llm.set(looping);
    // 8 steps: the whole per-invoke call budget, ending on the recursion limit.
    let run = inv
        .call(
            "agent/session.run",
            json!({"app_session_uuid": uuid, "content": "loop", "allowed_tools": [],
                "recursion_limit": limits::SAMPLING_MAX_CALLS_PER_INVOKE}),
        )
        .await
        .unwrap();
    assert_eq!(run["final"]["stopReason"], "recursion_limit");
    assert_eq!(
        env.services.budget("inv-steps").unwrap().sampling_used().0,
        limits::SAMPLING_MAX_CALLS_PER_INVOKE
    );
    let r = inv
        .call(
            "agent/session.run",
            json!({"app_session_uuid": uuid, "content": "loop", "allowed_tools": [], "recursion_limit": 1}),
        )
        .await;
    assert_eq!(code_of(&r).0, codes::AGENT_QUOTA_EXCEEDED.code);

    // A fresh invoke, 9 steps allowed by the run: the 9th is the budget's.
    let inv = env.invoke("inv-steps-2").await;
    env.llm.set(looping);
    let r = inv
        .call(
            "agent/session.run",
            json!({"app_session_uuid": uuid, "content": "loop", "allowed_tools": [],
                "recursion_limit": limits::SAMPLING_MAX_CALLS_PER_INVOKE + 1}),
        )
        .await;
    assert_eq!(code_of(&r).0, codes::AGENT_QUOTA_EXCEEDED.code);
    assert_eq!(
        env.services.budget("inv-steps-2").unwrap().sampling_used().0,
        limits::SAMPLING_MAX_CALLS_PER_INVOKE
    );
}

#[tokio::test]
async fn every_session_error_code() {
    let env = env().await;
    let inv = env.invoke("inv-codes").await;
    let uuid = inv
        .create(json!({"quota_caps": {"inherit_host_tools": false, "allowed_tools": ["echo-py"]}}))
        .await;
    let cases: Vec<(&str, Value, i64)> = vec![
        // -32043: malformed.
        (
            "agent/session.create",
            json!({"kind": "robot"}),
            codes::AGENT_INVALID_REQUEST.code,
        ),
        (
            "agent/session.create",
            json!({"agent_submode": "fixed"}),
            codes::AGENT_INVALID_REQUEST.code,
        ),
        (
            "agent/session.create",
            json!({"ttl_seconds": "long"}),
            codes::AGENT_INVALID_REQUEST.code,
        ),
        (
            "agent/session.run",
            json!({"app_session_uuid": "sess_1", "content": "x"}),
            codes::AGENT_INVALID_REQUEST.code,
        ),
        (
            "agent/session.run",
            json!({"app_session_uuid": uuid, "content": "   "}),
            codes::AGENT_INVALID_REQUEST.code,
        ),
        (
            "agent/session.run",
            json!({"app_session_uuid": uuid, "content": "x",
            "attachments": [{}, {}, {}, {}, {}, {}, {}]}),
            codes::AGENT_INVALID_REQUEST.code,
        ),
        (
            "agent/session.history",
            json!({"app_session_uuid": uuid, "limit": 0}),
            codes::AGENT_INVALID_REQUEST.code,
        ),
        (
            "agent/session.history",
            json!({"app_session_uuid": uuid, "limit": 201}),
            codes::AGENT_INVALID_REQUEST.code,
        ),
        (
            "agent/session.cancel",
            json!({"app_session_uuid": uuid}),
            codes::AGENT_INVALID_REQUEST.code,
        ),
        // -32041: a fixed client is never allowed here.
        (
            "agent/session.create",
            json!({"agent_submode": "fixed", "fixed_client_id": "c1"}),
            codes::AGENT_NOT_GRANTED.code,
        ),
        // -32044: contradictory kind and submode.
        (
            "agent/session.create",
            json!({"kind": "fixed", "agent_submode": "auto"}),
            codes::AGENT_SUBMODE_MISMATCH.code,
        ),
        // -32046 (422): the server-side limits (HR-AG-03).
        (
            "agent/session.create",
            json!({"ttl_seconds": 7201}),
            codes::AGENT_PROVIDER_ERROR.code,
        ),
        (
            "agent/session.create",
            json!({"ttl_seconds": 0}),
            codes::AGENT_PROVIDER_ERROR.code,
        ),
        (
            "agent/session.create",
            json!({"label": "x".repeat(121)}),
            codes::AGENT_PROVIDER_ERROR.code,
        ),
        (
            "agent/session.create",
            json!({"system_prompt": "x".repeat(4001)}),
            codes::AGENT_PROVIDER_ERROR.code,
        ),
        (
            "agent/session.run",
            json!({"app_session_uuid": uuid, "content": "x", "recursion_limit": 33}),
            codes::AGENT_PROVIDER_ERROR.code,
        ),
        (
            "agent/session.run",
            json!({"app_session_uuid": uuid, "content": "x", "recursion_limit": 0}),
            codes::AGENT_PROVIDER_ERROR.code,
        ),
        // -32042: unknown uuid.
        (
            "agent/session.run",
            json!({"app_session_uuid": "aps_0000", "content": "x"}),
            codes::AGENT_SESSION_NOT_FOUND.code,
        ),
        (
            "agent/session.history",
            json!({"app_session_uuid": "aps_0000"}),
            codes::AGENT_SESSION_NOT_FOUND.code,
        ),
        (
            "agent/session.refresh",
            json!({"app_session_uuid": "aps_0000"}),
            codes::AGENT_SESSION_NOT_FOUND.code,
        ),
        // -32048: a run may only narrow the session's tools.
        (
            "agent/session.run",
            json!({"app_session_uuid": uuid, "content": "x", "allowed_tools": ["notes-py"]}),
            codes::AGENT_TOOL_NOT_GRANTED.code,
        ),
        (
            "agent/session.run",
            json!({"app_session_uuid": uuid, "content": "x", "allowed_tools": ["*"]}),
            codes::AGENT_TOOL_NOT_GRANTED.code,
        ),
    ];
    for (method, params, expected) in cases {
        let r = inv.call(method, params.clone()).await;
        assert_eq!(code_of(&r).0, expected, "{method} {params}");
    }
    // Upper bounds are inclusive.
    inv.create(json!({"ttl_seconds": 7200, "label": "x".repeat(120), "system_prompt": "x".repeat(4000)}))
        .await;
    env.llm.set(|b| b.text = Some("ok".into()));
    inv.call(
        "agent/session.run",
        json!({"app_session_uuid": uuid, "content": "x", "allowed_tools": ["echo-py.echo"], "recursion_limit": 32}),
    )
    .await
    .unwrap();
    // An unknown agent method is -32601.
    let r = inv.call("agent/session.explode", json!({})).await;
    assert_eq!(code_of(&r).0, -32601);
}

#[tokio::test]
async fn sessions_need_llm_agent_auto_declared_and_granted() {
    // Granted but not declared.
    let env = env().await;
    let inv = env.invoke_declaring("inv-undeclared", &["llm.sample"]).await;
    let r = inv.call("agent/session.create", json!({})).await;
    assert_eq!(
        code_of(&r),
        (
            codes::AGENT_NOT_GRANTED.code,
            codes::AGENT_NOT_GRANTED.name.to_owned()
        )
    );
    // Declared but not granted.
    let env = env_with(limits::AGENT_SESSION_CACHE_MAX, false).await;
    let inv = env.invoke("inv-ungranted").await;
    let r = inv.call("agent/session.list", json!({})).await;
    assert_eq!(code_of(&r).0, codes::AGENT_NOT_GRANTED.code);
    // agent/complete needs only llm.sample.
    inv.call(
        "agent/complete",
        json!({"messages": [{"role": "user", "content": "x"}]}),
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn a_session_belongs_to_its_user_and_plugin() {
    let env = env().await;
    let inv = env.invoke("inv-owner").await;
    let uuid = inv.create(json!({})).await;
    env.services
        .grants()
        .edit(
            "user-2",
            TOOL,
            &["llm.sample".into(), "llm.agent.auto".into()],
            &[],
        )
        .await
        .unwrap();
    let other = env
        .invoke_as("user-2", "inv-other-user", &["llm.sample", "llm.agent.auto"])
        .await;
    for method in [
        "agent/session.run",
        "agent/session.history",
        "agent/session.refresh",
    ] {
        let r = other
            .call(method, json!({"app_session_uuid": uuid, "content": "steal"}))
            .await;
        assert_eq!(code_of(&r).0, codes::AGENT_SESSION_NOT_FOUND.code, "{method}");
    }
    // Its owner still has it.
    inv.call("agent/session.history", json!({"app_session_uuid": uuid}))
        .await
        .unwrap();
}

#[tokio::test]
async fn a_session_expires_ttl_seconds_after_its_last_use() {
    let env = env().await;
    let inv = env.invoke("inv-ttl").await;
    let created = inv
        .call("agent/session.create", json!({"ttl_seconds": 1}))
        .await
        .unwrap();
    let uuid = created["app_session_uuid"].as_str().unwrap();
    let expires_at = created["expires_at"].as_u64().unwrap();
    // Before its expiry it answers (and the use does not extend it past `expires_at` + ttl).
    assert!(now_ms() < expires_at);
    let listed = inv.call("agent/session.list", json!({})).await.unwrap();
    assert_eq!(listed["sessions"].as_array().unwrap().len(), 1);
    // Wait out the product's own expiry instant, then the uuid is unknown.
    let wait = expires_at.saturating_sub(now_ms()) + 1;
    tokio::time::sleep(std::time::Duration::from_millis(wait)).await;
    let r = inv
        .call("agent/session.history", json!({"app_session_uuid": uuid}))
        .await;
    assert_eq!(code_of(&r).0, codes::AGENT_SESSION_NOT_FOUND.code);
    let listed = inv.call("agent/session.list", json!({})).await.unwrap();
    assert_eq!(listed["sessions"], json!([]));
    // Expired for every worker (the sessions are in JetStream KV).
    let other = env.worker().await;
    let on_other = env.invoke_on(&other, USER, "inv-ttl-2").await;
    let r = on_other
        .call(
            "agent/session.run",
            json!({"app_session_uuid": uuid, "content": "x"}),
        )
        .await;
    assert_eq!(code_of(&r).0, codes::AGENT_SESSION_NOT_FOUND.code);
    assert_eq!(other.agent().sessions_of(USER).await.unwrap(), 0);
}

#[tokio::test]
async fn the_session_cache_keeps_its_cap_and_evicts_the_least_recently_used() {
    const CAP: usize = 3;
    let env = env_with(CAP, true).await;
    let inv = env.invoke("inv-cap").await;
    let mut uuids = Vec::new();
    for _ in 0..CAP {
        uuids.push(inv.create(json!({})).await);
    }
    assert_eq!(env.services.agent().sessions_of(USER).await.unwrap(), CAP);
    // Touch the oldest: the second becomes the least recently used.
    inv.call("agent/session.refresh", json!({"app_session_uuid": uuids[0]}))
        .await
        .unwrap();
    let newest = inv.create(json!({})).await;
    assert_eq!(env.services.agent().sessions_of(USER).await.unwrap(), CAP);
    let r = inv
        .call("agent/session.history", json!({"app_session_uuid": uuids[1]}))
        .await;
    assert_eq!(code_of(&r).0, codes::AGENT_SESSION_NOT_FOUND.code);
    for kept in [&uuids[0], &uuids[2], &newest] {
        inv.call("agent/session.history", json!({"app_session_uuid": kept}))
            .await
            .unwrap();
    }
    // The cap is per user: another user's sessions neither count nor evict.
    env.services
        .grants()
        .edit(
            "user-2",
            TOOL,
            &["llm.sample".into(), "llm.agent.auto".into()],
            &[],
        )
        .await
        .unwrap();
    let other = env
        .invoke_as("user-2", "inv-cap-2", &["llm.sample", "llm.agent.auto"])
        .await;
    for _ in 0..CAP {
        other.create(json!({})).await;
    }
    assert_eq!(env.services.agent().sessions_of("user-2").await.unwrap(), CAP);
    assert_eq!(env.services.agent().sessions_of(USER).await.unwrap(), CAP);
    inv.call("agent/session.history", json!({"app_session_uuid": newest}))
        .await
        .unwrap();
}

#[tokio::test]
async fn the_agent_family_is_offered_with_an_llm_upstream() {
    let env = env().await;
    let offer = <FleetServices as HostServices>::offer(&env.services);
    assert!(offer.contains_key("agent"), "{offer:?}");
}

#[tokio::test]
async fn a_second_run_while_one_runs_is_rate_limited_and_cancel_stops_the_first_at_its_next_step() {
    let env = env().await;
    let inv = env.invoke("inv-busy").await;
    let uuid = inv.create(json!({})).await;
    // The first step holds the upstream (the fake answers after its delay); then calls a tool, so the loop
    // would go on.
    env.llm.set(|b| {
        b.delay = Some(std::time::Duration::from_secs(10));
        b.script.push_back(calls(1, None));
        b.script.push_back(final_text("never reached"));
    });
    let first = tokio::spawn({
        let inv = inv.clone();
        let uuid = uuid.clone();
        async move {
            inv.call(
                "agent/session.run",
                json!({"app_session_uuid": uuid, "content": "slow", "run_id": "run_slow", "allowed_tools": []}),
            )
            .await
        }
    });
    env.llm.received(1).await;
    let second = inv
        .call(
            "agent/session.run",
            json!({"app_session_uuid": uuid, "content": "again"}),
        )
        .await;
    assert_eq!(
        code_of(&second),
        (
            codes::AGENT_RATE_LIMITED.code,
            codes::AGENT_RATE_LIMITED.name.to_owned()
        )
    );
    let cancel = inv
        .call(
            "agent/session.cancel",
            json!({"app_session_uuid": uuid, "run_id": "run_slow"}),
        )
        .await
        .unwrap();
    assert_eq!(cancel, json!({"cancelled": true, "run_id": "run_slow"}));
    let run = first.await.unwrap().unwrap();
    assert_eq!(run["final"]["stopReason"], "cancelled", "{run}");
    assert_eq!(env.llm.bodies(CHAT).len(), 1, "no step after the cancel");
    // The session is free again.
    env.llm.set(|b| {
        b.delay = None;
        b.text = Some("ok".into());
    });
    inv.call(
        "agent/session.run",
        json!({"app_session_uuid": uuid, "content": "now", "allowed_tools": []}),
    )
    .await
    .unwrap();
}

// -------------------------------------------------------------------------------------------------------------
// Sessions across workers (JetStream KV)
// -------------------------------------------------------------------------------------------------------------

/// The `content`s of the messages the upstream got in its last chat request.
fn sent_contents(llm: &FakeLlm) -> Vec<String> {
    llm.last_chat()["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["content"].as_str().unwrap_or_default().to_owned())
        .collect()
}

/// A session created on one worker runs, pages its history and is listed on another, and outlives the worker
/// that created it: a worker started afterwards (a restart) continues the conversation.
#[tokio::test]
async fn a_session_continues_on_another_worker_and_after_a_restart() {
    let env = env().await;
    let first = env.worker().await;
    let second = env.worker().await;
    let on_first = env.invoke_on(&first, USER, "inv-w1").await;
    let uuid = on_first
        .create(json!({"label": "travels", "system_prompt": "Be brief.", "ttl_seconds": 600}))
        .await;
    env.llm.set(|b| b.text = Some("One.".into()));
    on_first
        .call(
            "agent/session.run",
            json!({"app_session_uuid": uuid, "content": "first", "allowed_tools": []}),
        )
        .await
        .unwrap();

    // The second worker continues the same conversation.
    let on_second = env.invoke_on(&second, USER, "inv-w2").await;
    env.llm.set(|b| b.text = Some("Two.".into()));
    on_second
        .call(
            "agent/session.run",
            json!({"app_session_uuid": uuid, "content": "second", "allowed_tools": []}),
        )
        .await
        .unwrap();
    assert_eq!(sent_contents(&env.llm), ["Be brief.", "first", "One.", "second"]);
    let history = on_second
        .call("agent/session.history", json!({"app_session_uuid": uuid}))
        .await
        .unwrap();
    let contents: Vec<&str> = history["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["content"].as_str().unwrap())
        .collect();
    assert_eq!(contents, ["first", "One.", "second", "Two."]);
    let listed = on_second.call("agent/session.list", json!({})).await.unwrap();
    assert_eq!(listed["sessions"].as_array().unwrap().len(), 1);
    assert_eq!(listed["sessions"][0]["app_session_uuid"], uuid);
    assert_eq!(listed["sessions"][0]["label"], "travels");

    // The first worker goes away; one started afterwards still has the session.
    drop(on_first);
    drop(first);
    let restarted = env.worker().await;
    let on_restarted = env.invoke_on(&restarted, USER, "inv-w3").await;
    let listed = on_restarted.call("agent/session.list", json!({})).await.unwrap();
    assert_eq!(listed["sessions"][0]["app_session_uuid"], uuid);
    env.llm.set(|b| b.text = Some("Three.".into()));
    on_restarted
        .call(
            "agent/session.run",
            json!({"app_session_uuid": uuid, "content": "third", "allowed_tools": []}),
        )
        .await
        .unwrap();
    assert_eq!(
        sent_contents(&env.llm),
        ["Be brief.", "first", "One.", "second", "Two.", "third"]
    );
    // Deleted on one worker: unknown on every other.
    let deleted = on_restarted
        .call("agent/session.delete", json!({"app_session_uuid": uuid}))
        .await
        .unwrap();
    assert_eq!(deleted["deleted"], true);
    let r = on_second
        .call("agent/session.history", json!({"app_session_uuid": uuid}))
        .await;
    assert_eq!(code_of(&r).0, codes::AGENT_SESSION_NOT_FOUND.code);
    assert_eq!(restarted.agent().sessions_of(USER).await.unwrap(), 0);
}

/// A run holds its session on every worker: a second run from another worker is `-32047`, a cancel from that
/// other worker stops the first run at its next step, and the session is free again afterwards.
#[tokio::test]
async fn one_run_at_a_time_across_workers_and_a_cancel_from_another_worker_stops_it() {
    let env = env().await;
    let first = env.worker().await;
    let second = env.worker().await;
    let on_first = env.invoke_on(&first, USER, "inv-run-1").await;
    let on_second = env.invoke_on(&second, USER, "inv-run-2").await;
    let uuid = on_first.create(json!({})).await;
    env.llm.set(|b| {
        b.delay = Some(std::time::Duration::from_secs(10));
        b.script.push_back(calls(1, None));
        b.script.push_back(final_text("never reached"));
    });
    let running = tokio::spawn({
        let inv = on_first.clone();
        let uuid = uuid.clone();
        async move {
            inv.call(
                "agent/session.run",
                json!({"app_session_uuid": uuid, "content": "slow", "run_id": "run_a", "allowed_tools": []}),
            )
            .await
        }
    });
    env.llm.received(1).await;
    let second_run = on_second
        .call(
            "agent/session.run",
            json!({"app_session_uuid": uuid, "content": "again", "allowed_tools": []}),
        )
        .await;
    assert_eq!(
        code_of(&second_run),
        (
            codes::AGENT_RATE_LIMITED.code,
            codes::AGENT_RATE_LIMITED.name.to_owned()
        )
    );
    // Another run id is not that run.
    let other = on_second
        .call(
            "agent/session.cancel",
            json!({"app_session_uuid": uuid, "run_id": "run_b"}),
        )
        .await
        .unwrap();
    assert_eq!(other, json!({"cancelled": false, "run_id": "run_b"}));
    let cancel = on_second
        .call(
            "agent/session.cancel",
            json!({"app_session_uuid": uuid, "run_id": "run_a"}),
        )
        .await
        .unwrap();
    assert_eq!(cancel, json!({"cancelled": true, "run_id": "run_a"}));
    let run = running.await.unwrap().unwrap();
    assert_eq!(run["final"]["stopReason"], "cancelled", "{run}");
    assert_eq!(env.llm.bodies(CHAT).len(), 1, "no step after the cancel");
    // Free again, on the other worker.
    env.llm.set(|b| {
        b.delay = None;
        b.text = Some("ok".into());
    });
    on_second
        .call(
            "agent/session.run",
            json!({"app_session_uuid": uuid, "content": "now", "allowed_tools": []}),
        )
        .await
        .unwrap();
}

/// The lease of a worker that died mid-run (never given back) holds the session until its expiry, and not after:
/// written here as the dead worker left it.
#[tokio::test]
async fn a_dead_workers_run_lease_holds_until_its_expiry_only() {
    use fleet_proto::api::user_key;
    let env = env().await;
    let inv = env.invoke("inv-lease").await;
    let uuid = inv.create(json!({})).await;
    let js = async_nats::jetstream::new(env.nats.connect(fleet_client::creds::Role::Front).await.unwrap());
    let bucket = js.get_key_value("fleet_agent_sessions").await.unwrap();
    let key = format!("r.{}.{}.{uuid}", user_key(USER), user_key(TOOL));
    let lease = |until_ms: u64| {
        serde_json::to_vec(&json!({"run_id": "run_dead", "holder": "dead-worker", "until_ms": until_ms}))
            .unwrap()
    };
    env.llm.set(|b| b.text = Some("ok".into()));
    let run = || {
        inv.call(
            "agent/session.run",
            json!({"app_session_uuid": uuid, "content": "x", "allowed_tools": []}),
        )
    };
    bucket.put(&key, lease(now_ms() + 60_000).into()).await.unwrap();
    assert_eq!(code_of(&run().await).0, codes::AGENT_RATE_LIMITED.code);
    // At its expiry instant the lease no longer holds.
    bucket.put(&key, lease(now_ms()).into()).await.unwrap();
    run().await.unwrap();
}

/// Another user's session is indistinguishable from a missing one on every worker, for every method; it is not
/// listed, not counted, and cannot be deleted or cancelled by them.
#[tokio::test]
async fn another_users_session_is_unknown_on_every_worker() {
    let env = env().await;
    env.services
        .grants()
        .edit(
            "user-2",
            TOOL,
            &["llm.sample".into(), "llm.agent.auto".into()],
            &[],
        )
        .await
        .unwrap();
    let first = env.worker().await;
    let second = env.worker().await;
    let owner = env.invoke_on(&first, USER, "inv-own").await;
    let uuid = owner.create(json!({})).await;
    let thief = env.invoke_on(&second, "user-2", "inv-thief").await;
    for (method, params) in [
        (
            "agent/session.run",
            json!({"app_session_uuid": uuid, "content": "steal"}),
        ),
        ("agent/session.history", json!({"app_session_uuid": uuid})),
        ("agent/session.refresh", json!({"app_session_uuid": uuid})),
        (
            "agent/session.cancel",
            json!({"app_session_uuid": uuid, "run_id": "r"}),
        ),
    ] {
        let r = thief.call(method, params).await;
        assert_eq!(
            code_of(&r),
            (
                codes::AGENT_SESSION_NOT_FOUND.code,
                codes::AGENT_SESSION_NOT_FOUND.name.to_owned()
            ),
            "{method}"
        );
    }
    let unknown = thief
        .call(
            "agent/session.history",
            json!({"app_session_uuid": "aps_00000000000000000000000000000000"}),
        )
        .await;
    assert_eq!(code_of(&unknown).0, codes::AGENT_SESSION_NOT_FOUND.code);
    let deleted = thief
        .call("agent/session.delete", json!({"app_session_uuid": uuid}))
        .await
        .unwrap();
    assert_eq!(deleted["deleted"], false);
    let listed = thief.call("agent/session.list", json!({})).await.unwrap();
    assert_eq!(listed["sessions"], json!([]));
    assert_eq!(second.agent().sessions_of("user-2").await.unwrap(), 0);
    // A uuid that could not even be a key.
    let r = thief
        .call("agent/session.history", json!({"app_session_uuid": "aps_x.*"}))
        .await;
    assert_eq!(code_of(&r).0, codes::AGENT_SESSION_NOT_FOUND.code);
    // Its owner still has it, on the other worker.
    let again = env.invoke_on(&second, USER, "inv-own-2").await;
    again
        .call("agent/session.history", json!({"app_session_uuid": uuid}))
        .await
        .unwrap();
}
