//! A fake OpenAI-compatible upstream for the sampling and embeddings services: `POST /v1/chat/completions` and
//! `POST /v1/embeddings` on 127.0.0.1 (an ephemeral port). It records every request (path, `Authorization`,
//! JSON body), reports the configured `usage`, and can answer with an error status or answer slowly (a slow
//! answer sleeps server-side: that is the upstream's behaviour, never the test's synchronisation).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use fleet_proto::util::lock;
use serde_json::{Value, json};

/// One recorded request.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// `/v1/chat/completions` or `/v1/embeddings`.
    pub path: String,
    /// The `Authorization` header, if any.
    pub authorization: Option<String>,
    /// The JSON body.
    pub body: Value,
}

/// How the fake answers (shared by both endpoints).
#[derive(Debug, Clone)]
pub struct Behaviour {
    /// Reported `usage.prompt_tokens`, `completion_tokens` (total = their sum). `None`: no `usage` at all.
    pub usage: Option<(u64, u64)>,
    /// Answer with this status and an OpenAI-style error body instead.
    pub status: Option<u16>,
    /// `error.code` of the error body.
    pub error_code: Option<String>,
    /// Sleep this long before answering.
    pub delay: Option<Duration>,
    /// The completion text; `None`: `{"ok":true}` when a `response_format` was sent, else `"hello from fake"`.
    pub text: Option<String>,
    /// `finish_reason`.
    pub finish_reason: String,
    /// vLLM-style `stop_reason` (the matched stop sequence).
    pub stop_reason: Option<String>,
    /// Dimensions of every embedding.
    pub dimensions: usize,
    /// Scripted chat answers, used in order before the rest of this behaviour: each is the `message` of the
    /// first choice (e.g. `{"role": "assistant", "content": null, "tool_calls": [...]}`), answered with
    /// `finish_reason` `tool_calls` when it has tool calls.
    pub script: std::collections::VecDeque<Value>,
}

impl Default for Behaviour {
    fn default() -> Self {
        Behaviour {
            usage: Some((10, 5)),
            status: None,
            error_code: None,
            delay: None,
            text: None,
            finish_reason: "stop".into(),
            stop_reason: None,
            dimensions: 4,
            script: std::collections::VecDeque::new(),
        }
    }
}

#[derive(Debug)]
struct Shared {
    requests: Mutex<Vec<Recorded>>,
    behaviour: Mutex<Behaviour>,
    /// Requests received so far.
    received: tokio::sync::watch::Sender<usize>,
    /// Requests whose handler was dropped before answering (the client went away).
    abandoned: tokio::sync::watch::Sender<usize>,
}

impl Default for Shared {
    fn default() -> Self {
        Shared {
            requests: Mutex::default(),
            behaviour: Mutex::default(),
            received: tokio::sync::watch::Sender::new(0),
            abandoned: tokio::sync::watch::Sender::new(0),
        }
    }
}

/// Counts its request as abandoned if dropped before [`Pending::answered`].
struct Pending<'a> {
    shared: &'a Shared,
    answered: bool,
}

impl Pending<'_> {
    fn answered(mut self) {
        self.answered = true;
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if !self.answered {
            self.shared.abandoned.send_modify(|n| *n += 1);
        }
    }
}

/// The running fake (stopped on drop).
#[derive(Debug)]
pub struct FakeLlm {
    addr: std::net::SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl FakeLlm {
    /// Binds 127.0.0.1:0 and serves.
    pub async fn start() -> FakeLlm {
        let shared = Arc::new(Shared::default());
        let app = Router::new()
            .route("/v1/chat/completions", post(chat))
            .route("/v1/embeddings", post(embeddings))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the fake LLM");
        let addr = listener.local_addr().expect("local addr");
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        FakeLlm { addr, shared, task }
    }

    /// The base URL to configure (`http://127.0.0.1:<port>/v1`).
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Changes how it answers from now on.
    pub fn set(&self, change: impl FnOnce(&mut Behaviour)) {
        change(&mut lock(&self.shared.behaviour));
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<Recorded> {
        lock(&self.shared.requests).clone()
    }

    /// The bodies of the requests to `path` (`"/v1/chat/completions"`, `"/v1/embeddings"`).
    pub fn bodies(&self, path: &str) -> Vec<Value> {
        self.requests()
            .into_iter()
            .filter(|r| r.path == path)
            .map(|r| r.body)
            .collect()
    }

    /// Waits until `n` requests have been received (panics after [`WAIT`]: what should have called the fake
    /// did not).
    pub async fn received(&self, n: usize) {
        let mut rx = self.shared.received.subscribe();
        tokio::time::timeout(WAIT, rx.wait_for(|c| *c >= n))
            .await
            .unwrap_or_else(|_| panic!("the fake LLM did not receive {n} requests within {WAIT:?}"))
            .expect("the fake LLM runs");
    }

    /// Waits until `n` requests were abandoned by their client before being answered (the handler dropped;
    /// panics after [`WAIT`]).
    pub async fn abandoned(&self, n: usize) {
        let mut rx = self.shared.abandoned.subscribe();
        tokio::time::timeout(WAIT, rx.wait_for(|c| *c >= n))
            .await
            .unwrap_or_else(|_| panic!("the fake LLM did not see {n} requests abandoned within {WAIT:?}"))
            .expect("the fake LLM runs");
    }

    /// The last chat request's body.
    pub fn last_chat(&self) -> Value {
        self.bodies(CHAT).pop().expect("a chat request reached the fake")
    }
}

impl Drop for FakeLlm {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The chat completions path.
pub const CHAT: &str = "/v1/chat/completions";

/// The longest [`Fake::received`] and [`Fake::abandoned`] wait: a test's failure guard, far above any call's time.
pub const WAIT: Duration = Duration::from_secs(60);
/// The embeddings path.
pub const EMBEDDINGS: &str = "/v1/embeddings";

/// Records the request and returns the behaviour to answer it with (after its delay), or the error answer.
async fn record(
    shared: &Shared,
    path: &str,
    headers: &HeaderMap,
    body: &Value,
) -> Result<Behaviour, Response> {
    lock(&shared.requests).push(Recorded {
        path: path.to_owned(),
        authorization: headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned),
        body: body.clone(),
    });
    shared.received.send_modify(|n| *n += 1);
    let b = {
        let mut current = lock(&shared.behaviour);
        let b = current.clone();
        if path == CHAT {
            current.script.pop_front();
        }
        b
    };
    if let Some(d) = b.delay {
        let pending = Pending {
            shared,
            answered: false,
        };
        tokio::time::sleep(d).await;
        pending.answered();
    }
    if let Some(s) = b.status {
        let status = StatusCode::from_u16(s).expect("status");
        let error = json!({"error": {"message": "fake failure (sk-should-never-leak)", "type": "fake_error",
            "code": b.error_code}});
        return Err((status, Json(error)).into_response());
    }
    Ok(b)
}

fn usage_of(b: &Behaviour) -> Option<Value> {
    b.usage
        .map(|(p, c)| json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}))
}

async fn chat(State(shared): State<Arc<Shared>>, headers: HeaderMap, Json(body): Json<Value>) -> Response {
    let b = match record(&shared, CHAT, &headers, &body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let text = b.text.clone().unwrap_or_else(|| {
        if body.get("response_format").is_some() {
            "{\"ok\":true}".into()
        } else {
            "hello from fake".into()
        }
    });
    let mut choice = match b.script.front() {
        Some(message) => {
            let reason = if message.get("tool_calls").is_some() {
                "tool_calls"
            } else {
                "stop"
            };
            json!({"index": 0, "message": message, "finish_reason": reason})
        }
        None => json!({"index": 0, "message": {"role": "assistant", "content": text},
            "finish_reason": b.finish_reason}),
    };
    if let Some(s) = &b.stop_reason {
        choice["stop_reason"] = json!(s);
    }
    let mut reply = json!({"id": "chatcmpl-fake", "object": "chat.completion", "created": 0,
        "model": body.get("model").cloned().unwrap_or(Value::Null), "choices": [choice]});
    if let Some(u) = usage_of(&b) {
        reply["usage"] = u;
    }
    Json(reply).into_response()
}

async fn embeddings(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let b = match record(&shared, EMBEDDINGS, &headers, &body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let inputs: Vec<String> = match body.get("input") {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a.iter().map(|v| v.as_str().unwrap_or("").to_owned()).collect(),
        _ => Vec::new(),
    };
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let embedding: Vec<f64> = (0..b.dimensions)
                .map(|d| (s.len() + i + d) as f64 / 1000.0)
                .collect();
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    let tokens: u64 = inputs.iter().map(|s| s.len() as u64).sum();
    Json(
        json!({"object": "list", "model": body.get("model").cloned().unwrap_or(Value::Null), "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}),
    )
    .into_response()
}
