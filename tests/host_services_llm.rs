//! Sampling and embeddings host services (spec §8.1, §8.5, budgets §7.4, deadlines §7.3) against a fake
//! OpenAI-compatible upstream, through `FleetServices::serve` with real tokens minted by the fleet's token source
//! over a real nats-server (grants in JetStream KV).

use std::collections::BTreeSet;

use fleet::nats_server::NatsServer;
use fleet_e2e::fake_llm::{CHAT, EMBEDDINGS, FakeLlm};
use fleet_proto::executa::reverse::family_of;
use fleet_proto::jsonrpc::ErrorObject;
use fleet_proto::util::now_ms;
use fleet_services::llm::{LlmConfig, ModelConfig};
use fleet_services::{FleetServices, ServicesConfig};
use fleet_worker::services::{HostServices, InvokeTokens, ReverseCall, TokenRequest, TokenSource};
use serde_json::{Value, json};

const USER: &str = "user-1";
const TOOL: &str = "tool-llm";
const API_KEY: &str = "sk-test-key-never-logged";

struct Env {
    services: FleetServices,
    llm: FakeLlm,
    _nats: NatsServer,
    _dir: tempfile::TempDir,
}

fn llm_config(llm: &FakeLlm, dir: &std::path::Path) -> LlmConfig {
    let key_file = dir.join("llm.key");
    std::fs::write(&key_file, format!("{API_KEY}\n")).expect("key file");
    LlmConfig {
        base_url: llm.base_url(),
        api_key_file: Some(key_file),
        provider: Some("fake".into()),
        models: vec![
            ModelConfig {
                name: "gpt-fake-mini".into(),
                structured_output: true,
            },
            ModelConfig {
                name: "llama-local".into(),
                structured_output: false,
            },
        ],
        embedding_model: Some("embed-fake-small".into()),
        ..LlmConfig::default()
    }
}

/// A nats-server, the fake upstream and the services; `configure` edits the LLM configuration (`None`: no
/// upstream configured at all). The user is granted `llm.sample` and `llm.embed` on [`TOOL`].
async fn env_with(configure: impl FnOnce(LlmConfig) -> Option<LlmConfig>) -> Env {
    let dir = tempfile::tempdir().expect("tempdir");
    let llm = FakeLlm::start().await;
    let config = ServicesConfig {
        llm: configure(llm_config(&llm, dir.path())),
        ..ServicesConfig::default()
    };
    let (nats, services) =
        fleet_e2e::host_services(dir.path(), &config, b"host-services-llm-test-link-secret").await;
    services
        .grants()
        .edit(USER, TOOL, &["llm.sample".into(), "llm.embed".into()], &[])
        .await
        .expect("grant");
    Env {
        services,
        llm,
        _nats: nats,
        _dir: dir,
    }
}

async fn env() -> Env {
    env_with(Some).await
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

impl Env {
    /// Tokens for an invoke of `tool` that negotiated `negotiated` and declared `declared`.
    async fn tokens_for(
        &self,
        tool: &str,
        invoke_id: &str,
        negotiated: &[&str],
        declared: &[&str],
        deadline_ms: u64,
    ) -> InvokeTokens {
        <FleetServices as TokenSource>::tokens(
            &self.services,
            TokenRequest {
                user: USER.into(),
                tool_id: tool.into(),
                invoke_id: invoke_id.into(),
                negotiated: set(negotiated),
                declared: declared.iter().map(|s| (*s).to_owned()).collect(),
                credentials: Vec::new(),
                deadline_ms,
            },
        )
        .await
    }

    /// A fully entitled invoke with a deadline a minute away.
    async fn invoke(&self, invoke_id: &str) -> Invoke {
        self.invoke_until(invoke_id, now_ms() + 60_000).await
    }

    async fn invoke_until(&self, invoke_id: &str, deadline_ms: u64) -> Invoke {
        let tokens = self
            .tokens_for(
                TOOL,
                invoke_id,
                &["sampling", "embed"],
                &["llm.sample", "llm.embed"],
                deadline_ms,
            )
            .await;
        assert!(tokens.sampling.is_some(), "a sampling token is minted");
        Invoke {
            services: self.services.clone(),
            tool: TOOL.into(),
            invoke_id: invoke_id.into(),
            deadline_ms,
            tokens,
        }
    }

    fn used(&self, invoke_id: &str) -> (u32, u64) {
        self.services
            .budget(invoke_id)
            .expect("the invoke has a budget")
            .sampling_used()
    }
}

#[derive(Clone)]
struct Invoke {
    services: FleetServices,
    tool: String,
    invoke_id: String,
    deadline_ms: u64,
    tokens: InvokeTokens,
}

impl Invoke {
    async fn call(&self, method: &str, params: Value) -> Result<Value, ErrorObject> {
        self.services
            .serve(ReverseCall {
                user: USER.into(),
                tool_id: self.tool.clone(),
                invoke_id: self.invoke_id.clone(),
                tool: "run".into(),
                method: method.into(),
                family: family_of(method).expect("a reverse-RPC method"),
                params,
                client_timeout_s: None,
                deadline_ms: self.deadline_ms,
                tokens: self.tokens.clone(),
            })
            .await
    }

    async fn sample(&self, params: Value) -> Result<Value, ErrorObject> {
        self.call("sampling/createMessage", params).await
    }

    async fn embed(&self, params: Value) -> Result<Value, ErrorObject> {
        self.call("embeddings/create", params).await
    }
}

fn messages(n: usize) -> Value {
    Value::Array(
        (0..n)
            .map(|i| json!({"role": "user", "content": {"type": "text", "text": format!("message {i}")}}))
            .collect(),
    )
}

fn simple() -> Value {
    json!({"messages": messages(1), "maxTokens": 100})
}

#[track_caller]
fn code(r: &Result<Value, ErrorObject>) -> i64 {
    match r {
        Ok(v) => panic!("expected an error, got {v}"),
        Err(e) => e.code,
    }
}

#[track_caller]
fn error_code(r: &Result<Value, ErrorObject>) -> String {
    match r {
        Ok(v) => panic!("expected an error, got {v}"),
        Err(e) => e.error_code().expect("data.errorCode").to_owned(),
    }
}

// -------------------------------------------------------------------------------------------------------------
// The round trip
// -------------------------------------------------------------------------------------------------------------

#[tokio::test]
async fn sampling_forwards_the_request_and_shapes_the_result() {
    let env = env().await;
    env.llm.set(|b| b.usage = Some((312, 187)));
    let inv = env.invoke("inv-roundtrip").await;
    let result = inv
        .sample(json!({
            "messages": [
                {"role": "system", "content": {"type": "text", "text": "context"}},
                {"role": "user", "content": {"type": "text", "text": "Summarize: x"}},
                {"role": "assistant", "content": {"type": "text", "text": "ok"}},
            ],
            "maxTokens": 8192,
            "systemPrompt": "You are concise.",
            "stopSequences": ["\n\n###", "END"],
            "includeContext": "none",
            "metadata": {"executa_invoke_id": "inv-roundtrip"},
        }))
        .await
        .expect("maxTokens 8192 is accepted");

    let sent = env.llm.requests();
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].path, CHAT);
    assert_eq!(
        sent[0].authorization.as_deref(),
        Some(format!("Bearer {API_KEY}").as_str())
    );
    let body = &sent[0].body;
    assert_eq!(body["model"], json!("gpt-fake-mini"), "the default model");
    assert_eq!(body["max_tokens"], json!(8192));
    assert_eq!(body["stop"], json!(["\n\n###", "END"]));
    assert_eq!(body["temperature"], json!(0.7), "the host substitutes 0.7");
    assert_eq!(
        body["messages"],
        json!([
            {"role": "system", "content": "You are concise."},
            {"role": "system", "content": "context"},
            {"role": "user", "content": "Summarize: x"},
            {"role": "assistant", "content": "ok"},
        ])
    );
    assert!(body.get("response_format").is_none());
    assert!(body.get("metadata").is_none() && body.get("context").is_none());

    assert_eq!(result["role"], json!("assistant"));
    assert_eq!(
        result["content"],
        json!({"type": "text", "text": "hello from fake"})
    );
    assert_eq!(result["model"], json!("gpt-fake-mini"));
    assert_eq!(result["stopReason"], json!("endTurn"));
    assert_eq!(
        result["usage"],
        json!({"inputTokens": 312, "outputTokens": 187, "totalTokens": 499})
    );
    assert_eq!(result["_meta"]["provider"], json!("fake"));
    assert!(result["_meta"]["latencyMs"].is_u64());
    assert!(result["_meta"].get("responseFormat").is_none());
    assert_eq!(
        env.used("inv-roundtrip"),
        (1, 499),
        "settled with the reported usage"
    );

    // An explicit temperature is forwarded; stop reasons map.
    env.llm.set(|b| {
        b.finish_reason = "stop".into();
        b.stop_reason = Some("END".into());
    });
    let r = inv
        .sample(
            json!({"messages": messages(1), "maxTokens": 5, "temperature": 0.1, "stopSequences": ["END"]}),
        )
        .await
        .expect("sample");
    assert_eq!(env.llm.last_chat()["temperature"], json!(0.1));
    assert_eq!(r["stopReason"], json!("stopSequence"));
    env.llm.set(|b| {
        b.finish_reason = "length".into();
        b.stop_reason = None;
    });
    let r = inv.sample(simple()).await.expect("sample");
    assert_eq!(r["stopReason"], json!("maxTokens"));
}

#[tokio::test]
async fn model_hints_pick_a_configured_model() {
    let env = env().await;
    let inv = env.invoke("inv-hints").await;
    let with_hints = |hints: Value| json!({"messages": messages(1), "maxTokens": 10, "modelPreferences": {"hints": hints}});
    inv.sample(with_hints(json!([{"name": "LLAMA"}])))
        .await
        .expect("sample");
    assert_eq!(env.llm.last_chat()["model"], json!("llama-local"));
    inv.sample(with_hints(json!([{"name": "claude"}, {"name": "mini"}])))
        .await
        .expect("sample");
    assert_eq!(env.llm.last_chat()["model"], json!("gpt-fake-mini"));
    inv.sample(with_hints(json!([{"name": "claude"}])))
        .await
        .expect("sample");
    assert_eq!(
        env.llm.last_chat()["model"],
        json!("gpt-fake-mini"),
        "no match: the default"
    );
}

// -------------------------------------------------------------------------------------------------------------
// Validation boundaries
// -------------------------------------------------------------------------------------------------------------

#[tokio::test]
async fn per_call_limits_are_exact_and_rejections_cost_nothing() {
    let env = env().await;
    let inv = env.invoke("inv-limits").await;

    let r = inv
        .sample(json!({"messages": messages(1), "maxTokens": 8193}))
        .await;
    assert_eq!(code(&r), -32004, "maxTokens 8193 is rejected (spec §16 A-16)");
    assert_eq!(error_code(&r), "SAMPLING_INVALID_REQUEST");
    inv.sample(json!({"messages": messages(64), "maxTokens": 10}))
        .await
        .expect("64 messages are accepted");
    assert_eq!(env.llm.last_chat()["messages"].as_array().map(Vec::len), Some(64));
    let r = inv
        .sample(json!({"messages": messages(65), "maxTokens": 10}))
        .await;
    assert_eq!(code(&r), -32004, "65 messages are rejected");
    for bad in [
        json!({"messages": [], "maxTokens": 10}),
        json!({"messages": messages(1), "maxTokens": 0}),
        json!({"messages": messages(1)}),
        json!({"messages": messages(1), "maxTokens": 10, "includeContext": "thisServer"}),
        json!({"messages": [{"role": "tool", "content": {"type": "text", "text": "x"}}], "maxTokens": 10}),
        json!({"messages": [{"role": "user", "content": {"type": "image", "data": "x"}}], "maxTokens": 10}),
    ] {
        assert_eq!(code(&inv.sample(bad.clone()).await), -32004, "{bad}");
    }
    assert_eq!(
        env.llm.bodies(CHAT).len(),
        1,
        "only the valid call reached the upstream"
    );
    assert_eq!(env.used("inv-limits").0, 1, "invalid requests are not counted");
}

// -------------------------------------------------------------------------------------------------------------
// Per-invoke budgets
// -------------------------------------------------------------------------------------------------------------

#[tokio::test]
async fn the_eighth_call_is_served_and_the_ninth_refused() {
    let env = env().await;
    env.llm.set(|b| b.usage = Some((1, 1)));
    let inv = env.invoke("inv-calls").await;
    for i in 1..=8 {
        inv.sample(simple())
            .await
            .unwrap_or_else(|e| panic!("call {i}: {e:?}"));
    }
    let r = inv.sample(simple()).await;
    assert_eq!(code(&r), -32006);
    assert_eq!(error_code(&r), "SAMPLING_MAX_CALLS_EXCEEDED");
    assert_eq!(
        code(&inv.sample(simple()).await),
        -32006,
        "terminal within the invoke"
    );
    assert_eq!(env.llm.bodies(CHAT).len(), 8);

    // Another invoke has its own budget.
    let other = env.invoke("inv-calls-2").await;
    other.sample(simple()).await.expect("a fresh invoke");
}

#[tokio::test]
async fn the_call_after_usage_reaches_32000_tokens_is_refused() {
    let env = env().await;
    let inv = env.invoke("inv-tokens").await;
    env.llm.set(|b| b.usage = Some((31_000, 999)));
    inv.sample(simple()).await.expect("first call");
    assert_eq!(env.used("inv-tokens"), (1, 31_999));
    env.llm.set(|b| b.usage = Some((1, 0)));
    inv.sample(simple()).await.expect("31 999 < 32 000: admitted");
    assert_eq!(env.used("inv-tokens"), (2, 32_000));
    let r = inv.sample(simple()).await;
    assert_eq!(code(&r), -32007);
    assert_eq!(error_code(&r), "SAMPLING_MAX_TOKENS_EXCEEDED");
    assert_eq!(env.llm.bodies(CHAT).len(), 2);
}

#[tokio::test]
async fn eight_concurrent_calls_race_for_the_last_slot() {
    let env = env().await;
    env.llm.set(|b| b.usage = Some((1, 1)));
    let inv = env.invoke("inv-race").await;
    for _ in 0..7 {
        inv.sample(simple()).await.expect("one of the first seven");
    }
    let racers: Vec<_> = (0..8)
        .map(|_| {
            let inv = inv.clone();
            tokio::spawn(async move { inv.sample(simple()).await })
        })
        .collect();
    let mut ok = 0;
    let mut refused = 0;
    for r in racers {
        match r.await.expect("join") {
            Ok(_) => ok += 1,
            Err(e) => {
                assert_eq!(e.code, -32006, "{e:?}");
                refused += 1;
            }
        }
    }
    assert_eq!((ok, refused), (1, 7));
    assert_eq!(env.llm.bodies(CHAT).len(), 8);
    assert_eq!(env.used("inv-race").0, 8);
}

// -------------------------------------------------------------------------------------------------------------
// The daily meter (per user, UTC day, every invoke and worker together)
// -------------------------------------------------------------------------------------------------------------

/// A call of its own invoke (the per-invoke budget never binds), `max_tokens` asked.
async fn day_call(env: &Env, n: u64, max_tokens: u64) -> Result<Value, ErrorObject> {
    let inv = env.invoke(&format!("inv-day-{n}")).await;
    inv.sample(json!({"messages": messages(1), "maxTokens": max_tokens}))
        .await
}

#[track_caller]
fn daily_refusal(r: &Result<Value, ErrorObject>, used: u64, limit: u64) {
    assert_eq!(code(r), -32002, "the sampling quota family: {r:?}");
    let Err(e) = r else { unreachable!() };
    let data = e.data.as_ref().expect("data");
    assert_eq!(
        (data["used"].clone(), data["limit"].clone()),
        (json!(used), json!(limit)),
        "{e:?}"
    );
}

/// An upstream that reports no usage: each call is charged its `maxTokens` (the service's own estimate), so the
/// call that takes the day exactly to the cap is admitted and the next is refused before the upstream.
#[tokio::test]
async fn the_daily_token_cap_admits_the_call_that_reaches_it_and_refuses_the_next() {
    const CAP: u64 = 300;
    const MAX_TOKENS: u64 = 100;
    let env = env_with(|c| {
        Some(LlmConfig {
            daily_quota_tokens: Some(CAP),
            ..c
        })
    })
    .await;
    env.llm.set(|b| b.usage = None);
    for n in 0..CAP / MAX_TOKENS {
        day_call(&env, n, MAX_TOKENS)
            .await
            .unwrap_or_else(|e| panic!("call {n} fits the day: {e:?}"));
    }
    let upstream_calls = env.llm.requests().len();
    let refused = day_call(&env, 99, 1).await;
    daily_refusal(&refused, CAP, CAP);
    assert_eq!(
        env.llm.requests().len(),
        upstream_calls,
        "a refused call never reaches the upstream"
    );
}

/// An upstream that reports usage: the day is charged prompt + completion as reported (more than `maxTokens`); a
/// failed upstream call is charged nothing; a call whose `maxTokens` fits exactly what is left is admitted and its
/// overshoot counted, and the next is refused.
#[tokio::test]
async fn the_daily_token_meter_counts_reported_prompt_and_completion_tokens() {
    const PROMPT: u64 = 300;
    const COMPLETION: u64 = 100;
    const REPORTED: u64 = PROMPT + COMPLETION;
    const MAX_TOKENS: u64 = 100;
    // Two calls leave exactly MAX_TOKENS of the day.
    const CAP: u64 = 2 * REPORTED + MAX_TOKENS;
    let env = env_with(|c| {
        Some(LlmConfig {
            daily_quota_tokens: Some(CAP),
            ..c
        })
    })
    .await;
    env.llm.set(|b| b.usage = Some((PROMPT, COMPLETION)));
    for n in 0..2 {
        day_call(&env, n, MAX_TOKENS)
            .await
            .unwrap_or_else(|e| panic!("call {n} fits the day: {e:?}"));
    }
    // One token more than what is left is refused.
    daily_refusal(&day_call(&env, 2, MAX_TOKENS + 1).await, 2 * REPORTED, CAP);
    // A failed upstream call gives its reservation back.
    env.llm.set(|b| b.status = Some(500));
    assert_eq!(code(&day_call(&env, 3, MAX_TOKENS).await), -32003);
    env.llm.set(|b| b.status = None);
    // Exactly what is left: admitted, charged what the upstream reports.
    day_call(&env, 4, MAX_TOKENS)
        .await
        .expect("the call that fits exactly what is left");
    daily_refusal(&day_call(&env, 5, 1).await, 3 * REPORTED, CAP);
}

// -------------------------------------------------------------------------------------------------------------
// Gating: negotiated AND declared AND granted, else no token
// -------------------------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_token_needs_negotiation_declaration_and_grant() {
    let env = env().await;
    let deadline = now_ms() + 60_000;
    let all_negotiated = ["sampling", "embed"];
    let all_declared = ["llm.sample", "llm.embed"];

    // Everything present: both capabilities in one sampling token.
    let t = env
        .tokens_for(TOOL, "inv-g0", &all_negotiated, &all_declared, deadline)
        .await;
    assert!(t.sampling.is_some());

    let cases: [(&str, &str, &[&str], &[&str]); 3] = [
        ("not negotiated", TOOL, &[], &all_declared),
        ("not declared", TOOL, &all_negotiated, &[]),
        (
            "not granted",
            "tool-without-grant",
            &all_negotiated,
            &all_declared,
        ),
    ];
    for (i, (why, tool, negotiated, declared)) in cases.into_iter().enumerate() {
        let invoke_id = format!("inv-g{}", i + 1);
        let tokens = env
            .tokens_for(tool, &invoke_id, negotiated, declared, deadline)
            .await;
        assert!(tokens.sampling.is_none(), "{why}: no sampling token");
        let inv = Invoke {
            services: env.services.clone(),
            tool: tool.into(),
            invoke_id,
            deadline_ms: deadline,
            tokens,
        };
        let r = inv.sample(simple()).await;
        assert_eq!(code(&r), -32001, "{why}");
        assert_eq!(error_code(&r), "SAMPLING_NOT_GRANTED");
        assert_eq!(code(&inv.embed(json!({"input": "x"})).await), -32501, "{why}");
    }

    // Sampling granted but not embeddings: the token covers only llm.sample.
    env.services
        .grants()
        .edit(USER, "tool-sample-only", &["llm.sample".into()], &[])
        .await
        .expect("grant");
    let tokens = env
        .tokens_for(
            "tool-sample-only",
            "inv-g4",
            &all_negotiated,
            &all_declared,
            deadline,
        )
        .await;
    let inv = Invoke {
        services: env.services.clone(),
        tool: "tool-sample-only".into(),
        invoke_id: "inv-g4".into(),
        deadline_ms: deadline,
        tokens,
    };
    inv.sample(simple()).await.expect("sampling is granted");
    assert_eq!(code(&inv.embed(json!({"input": "x"})).await), -32501);
    assert!(env.llm.bodies(EMBEDDINGS).is_empty());
    assert_eq!(
        env.llm.bodies(CHAT).len(),
        1,
        "only the granted call reached the upstream"
    );
}

#[tokio::test]
async fn without_an_upstream_sampling_is_neither_offered_nor_minted() {
    let env = env_with(|_| None).await;
    let offer = env.services.offer();
    assert!(!offer.contains_key("sampling"), "{offer:?}");
    assert!(!offer.contains_key("embed"), "{offer:?}");
    let deadline = now_ms() + 60_000;
    let tokens = env
        .tokens_for(
            TOOL,
            "inv-none",
            &["sampling", "embed"],
            &["llm.sample", "llm.embed"],
            deadline,
        )
        .await;
    assert!(tokens.sampling.is_none());
    let inv = Invoke {
        services: env.services.clone(),
        tool: TOOL.into(),
        invoke_id: "inv-none".into(),
        deadline_ms: deadline,
        tokens,
    };
    // Sampling is off without an upstream: spec §15.2's `sampling_disabled`.
    assert_eq!(code(&inv.sample(simple()).await), -32008);
    assert!(env.llm.requests().is_empty());

    // With an upstream but no embedding model: sampling offered, embeddings not.
    let env = env_with(|c| {
        Some(LlmConfig {
            embedding_model: None,
            ..c
        })
    })
    .await;
    let offer = env.services.offer();
    assert!(offer.contains_key("sampling"), "{offer:?}");
    assert!(!offer.contains_key("embed"), "{offer:?}");
    let inv = env.invoke("inv-no-embed").await;
    assert_eq!(code(&inv.embed(json!({"input": "x"})).await), -32507);
    inv.sample(simple()).await.expect("sampling still works");
}

// -------------------------------------------------------------------------------------------------------------
// responseFormat
// -------------------------------------------------------------------------------------------------------------

#[tokio::test]
async fn response_formats_map_to_openai_response_format() {
    let env = env().await;
    let inv = env.invoke("inv-format").await;
    let schema = json!({
        "name": "summary_analysis",
        "strict": true,
        "schema": {"type": "object", "properties": {"summary": {"type": "string"}},
            "required": ["summary"], "additionalProperties": false},
    });
    let ask = |format: Value, extra: Value| {
        let mut p = json!({"messages": messages(1), "maxTokens": 50, "responseFormat": format});
        for (k, v) in extra.as_object().expect("object") {
            p[k] = v.clone();
        }
        p
    };

    // json_object: never gated.
    let r = inv
        .sample(ask(
            json!({"type": "json_object"}),
            json!({"modelPreferences": {"hints": [{"name": "llama"}]}}),
        ))
        .await
        .expect("json_object");
    assert_eq!(
        env.llm.last_chat()["response_format"],
        json!({"type": "json_object"})
    );
    assert_eq!(
        r["_meta"]["responseFormat"],
        json!({"requested": "json_object", "applied": "json_object", "structuredValid": true, "downgraded": false})
    );
    assert!(r["content"]["text"].is_string(), "content.text stays a string");

    // json_schema on a structured-output model: forwarded as OpenAI's response_format.
    let r = inv
        .sample(ask(
            json!({"type": "json_schema", "json_schema": schema}),
            json!({}),
        ))
        .await
        .expect("json_schema");
    assert_eq!(
        env.llm.last_chat()["response_format"],
        json!({"type": "json_schema", "json_schema": schema})
    );
    assert_eq!(r["_meta"]["responseFormat"]["applied"], json!("json_schema"));
    assert_eq!(r["_meta"]["responseFormat"]["downgraded"], json!(false));

    // json_schema on a model without structured output.
    let llama = json!({"modelPreferences": {"hints": [{"name": "llama"}]}});
    let before = env.llm.bodies(CHAT).len();
    let r = inv
        .sample(ask(
            json!({"type": "json_schema", "json_schema": schema}),
            llama.clone(),
        ))
        .await;
    assert_eq!(code(&r), -32010, "onUnsupported defaults to error");
    let data = r.expect_err("error").data.expect("data");
    assert_eq!(data["requested"], json!("json_schema"));
    assert_eq!(data["modelName"], json!("llama-local"));
    assert_eq!(env.llm.bodies(CHAT).len(), before, "refused before the upstream");

    let mut downgrade = llama.clone();
    downgrade["onUnsupported"] = json!("json_object");
    let r = inv
        .sample(ask(
            json!({"type": "json_schema", "json_schema": schema}),
            downgrade,
        ))
        .await
        .expect("downgraded");
    assert_eq!(
        env.llm.last_chat()["response_format"],
        json!({"type": "json_object"})
    );
    assert_eq!(
        r["_meta"]["responseFormat"],
        json!({"requested": "json_schema", "applied": "json_object", "structuredValid": true, "downgraded": true})
    );

    let mut drop = llama;
    drop["onUnsupported"] = json!("text");
    env.llm.set(|b| b.text = Some("plain words".into()));
    let r = inv
        .sample(ask(json!({"type": "json_schema", "json_schema": schema}), drop))
        .await
        .expect("dropped");
    assert!(env.llm.last_chat().get("response_format").is_none());
    assert_eq!(
        r["_meta"]["responseFormat"],
        json!({"requested": "json_schema", "applied": null, "structuredValid": false, "downgraded": true})
    );

    // Schema limits are checked locally.
    let r = inv
        .sample(ask(
            json!({"type": "json_schema", "json_schema": {"name": "bad name", "schema": {}}}),
            json!({}),
        ))
        .await;
    assert_eq!(code(&r), -32004);
}

// -------------------------------------------------------------------------------------------------------------
// Upstream failures and deadlines
// -------------------------------------------------------------------------------------------------------------

#[tokio::test]
async fn upstream_failures_map_to_the_spec_codes() {
    let env = env().await;
    let inv = env.invoke("inv-fail").await;

    env.llm.set(|b| b.status = Some(429));
    let r = inv.sample(simple()).await;
    assert_eq!(code(&r), -32002);
    assert_eq!(error_code(&r), "SAMPLING_QUOTA_EXCEEDED");

    env.llm.set(|b| b.status = Some(500));
    let r = inv.sample(simple()).await;
    assert_eq!(code(&r), -32003);
    let e = r.expect_err("error");
    assert_eq!(e.data.as_ref().expect("data")["status"], json!(500));
    assert!(
        !e.message.contains("sk-"),
        "upstream bodies are not echoed: {}",
        e.message
    );
    assert!(!format!("{e:?}").contains(API_KEY));

    env.llm.set(|b| b.status = Some(503));
    assert_eq!(code(&inv.sample(simple()).await), -32003);
    assert_eq!(code(&inv.embed(json!({"input": "x"})).await), -32503);
    env.llm.set(|b| b.status = Some(429));
    assert_eq!(
        code(&inv.embed(json!({"input": "x"})).await),
        -32503,
        "embedding provider errors are flattened"
    );

    assert_eq!(
        env.used("inv-fail"),
        (3, 0),
        "failed upstream calls count as calls, with no tokens"
    );
}

#[tokio::test]
async fn an_unreachable_upstream_is_a_provider_error() {
    // A port that was free a moment ago: nothing listens there.
    let port = fleet::nats_server::free_port().expect("port");
    let env = env_with(|c| {
        Some(LlmConfig {
            base_url: format!("http://127.0.0.1:{port}/v1"),
            ..c
        })
    })
    .await;
    let inv = env.invoke("inv-unreachable").await;
    assert_eq!(code(&inv.sample(simple()).await), -32003);
    assert_eq!(code(&inv.embed(json!({"input": "x"})).await), -32503);
    assert_eq!(env.used("inv-unreachable").0, 1);
}

#[tokio::test]
async fn the_invoke_deadline_caps_the_upstream_wait() {
    let env = env().await;
    // The upstream would take a minute; the invoke ends in one second.
    env.llm
        .set(|b| b.delay = Some(std::time::Duration::from_secs(60)));
    let inv = env.invoke_until("inv-deadline", now_ms() + 1_000).await;
    let r = inv.sample(simple()).await;
    assert_eq!(code(&r), -32005);
    assert_eq!(error_code(&r), "SAMPLING_TIMEOUT");
    let timeout_ms = r.expect_err("error").data.expect("data")["timeoutMs"]
        .as_u64()
        .expect("timeoutMs");
    assert!(
        timeout_ms <= 1_000,
        "the wait was capped by the deadline, not the 90 s budget: {timeout_ms}"
    );
    assert_eq!(env.llm.bodies(CHAT).len(), 1, "the request reached the upstream");

    let inv = env.invoke_until("inv-deadline-embed", now_ms() + 1_000).await;
    let r = inv.embed(json!({"input": "x"})).await;
    assert_eq!(code(&r), -32505);
    assert_eq!(error_code(&r), "EMBED_TIMEOUT");
}

#[tokio::test]
async fn dropping_the_call_aborts_the_upstream_request() {
    let env = env().await;
    env.llm
        .set(|b| b.delay = Some(std::time::Duration::from_secs(600)));
    let inv = env.invoke("inv-drop").await;
    // The worker drops the service future when the invoke ends (spec §7.3 HR-DL-03); so does this abort.
    let call = tokio::spawn(async move { inv.sample(simple()).await });
    env.llm.received(1).await;
    call.abort();
    assert!(call.await.expect_err("aborted").is_cancelled());
    // The upstream sees its client go away: the connection is closed, the pending answer abandoned.
    tokio::time::timeout(std::time::Duration::from_secs(60), env.llm.abandoned(1))
        .await
        .expect("the upstream request was aborted, not left running");
    assert_eq!(
        env.used("inv-drop"),
        (1, 0),
        "counted as a call, no tokens settled"
    );
}

// -------------------------------------------------------------------------------------------------------------
// Embeddings
// -------------------------------------------------------------------------------------------------------------

#[tokio::test]
async fn embeddings_limits_are_exact_and_the_result_is_openai_shaped() {
    let env = env().await;
    let inv = env.invoke("inv-embed").await;

    let r = inv.embed(json!({"input": "hello"})).await.expect("bare string");
    let sent = env.llm.requests();
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].path, EMBEDDINGS);
    assert_eq!(
        sent[0].authorization.as_deref(),
        Some(format!("Bearer {API_KEY}").as_str())
    );
    assert_eq!(
        sent[0].body,
        json!({"model": "embed-fake-small", "input": ["hello"]}),
        "wrapped"
    );
    assert_eq!(r["object"], json!("list"));
    assert_eq!(r["model"], json!("anna-managed-v1"));
    assert_eq!(r["data"][0]["index"], json!(0));
    assert_eq!(r["data"][0]["embedding"].as_array().map(Vec::len), Some(4));
    assert_eq!(r["_meta"]["dimensions"], json!(4));
    assert_eq!(r["_meta"]["backendModel"], json!("embed-fake-small"));
    assert_eq!(r["_meta"]["provider"], json!("fake"));
    assert_eq!(r["usage"]["total_tokens"], json!(5));

    let r = inv
        .embed(json!({"input": vec!["x"; 64], "model": "anna-managed-v1"}))
        .await
        .expect("64 inputs");
    assert_eq!(r["data"].as_array().map(Vec::len), Some(64));
    assert_eq!(code(&inv.embed(json!({"input": vec!["x"; 65]})).await), -32504);
    inv.embed(json!({"input": ["y".repeat(32_000)]}))
        .await
        .expect("32 000 characters");
    let r = inv.embed(json!({"input": ["ok", "y".repeat(32_001)]})).await;
    assert_eq!(code(&r), -32504, "reject, not truncate");
    assert_eq!(error_code(&r), "EMBED_INVALID_REQUEST");
    for bad in [
        json!({"input": ""}),
        json!({"input": "   "}),
        json!({"input": []}),
        json!({"input": "x", "model": "anna-managed-v9"}),
        json!({"input": "x", "tool_invoke_id": "someone-else"}),
    ] {
        assert_eq!(code(&inv.embed(bad.clone()).await), -32504, "{bad}");
    }
    assert_eq!(
        env.llm.bodies(EMBEDDINGS).len(),
        3,
        "rejected requests never reach the upstream"
    );
    assert_eq!(
        env.used("inv-embed"),
        (0, 0),
        "embeddings do not spend the sampling budget"
    );
}
