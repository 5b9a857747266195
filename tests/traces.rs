//! OpenTelemetry traces end to end: an in-process OTLP/gRPC receiver (`opentelemetry-proto`'s
//! `TraceServiceServer` on tonic) collects what the real exporter (`fleet::telemetry::init`) sends while a cluster
//! (front + worker, a real nats-server, the echo fixture) serves a sync invoke, a reverse RPC, a job and a cancel.
//!
//! Front and worker share this process (and its tracer), but the worker's `worker.exec` runs in a task spawned by
//! the subscription with no span of its own: its parent can only come from the W3C `traceparent` the front put in
//! the NATS message headers. Tracing state is per process, so every trace assertion lives in one test function.

// Test code: helpers panic on purpose when the system under test misbehaves.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fleet_e2e::cluster::Cluster;
use fleet_e2e::worker::Plugin;
use fleet_proto::api::{JobState, methods, subjects};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value;
use serde_json::json;

/// Failure guard of every wait.
const GUARD: Duration = Duration::from_secs(30);

/// One received span, flattened.
#[derive(Debug, Clone)]
struct Rx {
    name: String,
    trace: String,
    id: String,
    parent: String,
    attrs: HashMap<String, String>,
}

#[derive(Debug, Default, Clone)]
struct Receiver {
    spans: Arc<Mutex<Vec<Rx>>>,
    /// Every string the exporter sent (attribute values, resource attributes, names), for the secrets check.
    strings: Arc<Mutex<Vec<String>>>,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn value_string(v: Option<&opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match v.and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::DoubleValue(d)) => d.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let req = request.into_inner();
        let mut spans = self.spans.lock().unwrap();
        let mut strings = self.strings.lock().unwrap();
        for rs in req.resource_spans {
            if let Some(r) = &rs.resource {
                for kv in &r.attributes {
                    strings.push(value_string(kv.value.as_ref()));
                }
            }
            for ss in rs.scope_spans {
                for s in ss.spans {
                    let attrs: HashMap<String, String> = s
                        .attributes
                        .iter()
                        .map(|kv| (kv.key.clone(), value_string(kv.value.as_ref())))
                        .collect();
                    strings.extend(attrs.values().cloned());
                    strings.push(s.name.clone());
                    for e in &s.events {
                        strings.push(e.name.clone());
                        strings.extend(e.attributes.iter().map(|kv| value_string(kv.value.as_ref())));
                    }
                    spans.push(Rx {
                        name: s.name,
                        trace: hex(&s.trace_id),
                        id: hex(&s.span_id),
                        parent: hex(&s.parent_span_id),
                        attrs,
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

impl Receiver {
    fn spans(&self) -> Vec<Rx> {
        self.spans.lock().unwrap().clone()
    }
}

/// Starts the receiver on a free 127.0.0.1 port; returns its endpoint.
async fn start_receiver(receiver: Receiver) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(receiver))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
            .await
            .expect("OTLP receiver");
    });
    format!("http://{addr}")
}

/// Waits until the API answers (`Front::serve` may return before the server saw every subscription).
async fn wait_api(c: &Cluster) {
    let deadline = Instant::now() + GUARD;
    loop {
        let request = async_nats::Request::new()
            .payload("{}".into())
            .timeout(Some(GUARD));
        match c
            .app
            .send_request(subjects::api(methods::TOOLS_LIST), request)
            .await
        {
            Ok(_) => break,
            Err(e) => assert!(Instant::now() < deadline, "the API never answered: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn wait_job(c: &Cluster, user: &str, job_id: &str, pred: impl Fn(JobState) -> bool) {
    let deadline = Instant::now() + GUARD;
    loop {
        let snap = c
            .ok(user, methods::TOOLS_GET_JOB, json!({ "jobId": job_id }))
            .await;
        let state: JobState = serde_json::from_value(snap["state"].clone()).expect("state");
        if pred(state) {
            return;
        }
        assert!(Instant::now() < deadline, "job {job_id} stuck in {state:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn one<'a>(spans: &'a [Rx], what: &str, pred: impl Fn(&Rx) -> bool) -> &'a Rx {
    let found: Vec<&Rx> = spans.iter().filter(|s| pred(s)).collect();
    assert_eq!(
        found.len(),
        1,
        "exactly one {what} expected, found {}: {found:#?}",
        found.len()
    );
    found[0]
}

fn by_id<'a>(spans: &'a [Rx], id: &str) -> &'a Rx {
    spans.iter().find(|s| s.id == id).unwrap_or_else(|| {
        let all: Vec<String> = spans
            .iter()
            .map(|s| format!("{} {} parent={} trace={}", s.name, s.id, s.parent, s.trace))
            .collect();
        panic!("no span {id:?} among\n{}", all.join("\n"))
    })
}

/// The chain api.request → job.dispatch → worker.request → worker.exec (across NATS) → plugin.invoke for the
/// plugin.invoke span `invoke`; returns (api.request, worker.exec).
fn check_chain<'a>(spans: &'a [Rx], invoke: &'a Rx, api_method: &str) -> (&'a Rx, &'a Rx) {
    let exec = by_id(spans, &invoke.parent);
    assert_eq!(exec.name, "worker.exec", "plugin.invoke's parent: {exec:#?}");
    let request = by_id(spans, &exec.parent);
    assert_eq!(
        request.name, "worker.request",
        "worker.exec's parent is the front's span that sent the NATS request: {request:#?}"
    );
    let dispatch = by_id(spans, &request.parent);
    assert_eq!(dispatch.name, "job.dispatch", "{dispatch:#?}");
    let api = by_id(spans, &dispatch.parent);
    assert_eq!(api.name, "api.request", "{api:#?}");
    assert!(api.parent.is_empty(), "api.request is the root: {api:#?}");
    assert_eq!(api.attrs["rpc.system"], "nats");
    assert_eq!(api.attrs["rpc.method"], api_method);
    assert_eq!(api.attrs["fleet.outcome"], "ok");
    for s in [invoke, exec, request, dispatch, api] {
        assert_eq!(s.trace, api.trace, "one trace across front and worker: {s:#?}");
    }
    assert_eq!(exec.attrs["executa.invoke_id"], invoke.attrs["executa.invoke_id"]);
    (api, exec)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_spans_front_and_worker_through_nats_headers() {
    let receiver = Receiver::default();
    let endpoint = start_receiver(receiver.clone()).await;
    let guard = fleet::telemetry::init(Some(&endpoint), "cloud-agents-test", "warn")
        .expect("telemetry")
        .expect("this test installs the process's subscriber");

    let c = Cluster::start("traces", 1, 1, &[Plugin::echo("echo", &[])]).await;
    wait_api(&c).await;
    let user = "trace-user-4a7c91";
    let token = c.token(user);

    // Sync: echo, then inspect (what the plugin saw in its invoke context), then a reverse RPC.
    let echoed = c
        .ok(
            user,
            methods::TOOLS_INVOKE,
            json!({"tool_id": "echo.echo", "args": {"x": 1}}),
        )
        .await;
    assert_eq!(echoed, json!({"arguments": {"x": 1}}));
    let inspected = c
        .ok(user, methods::TOOLS_INVOKE, json!({"tool_id": "echo.inspect"}))
        .await;
    let traceparent = inspected["context"]["traceparent"]
        .as_str()
        .unwrap_or_else(|| panic!("no context.traceparent: {}", inspected["context"]))
        .to_string();
    let reverse = c
        .ok(
            user,
            methods::TOOLS_INVOKE,
            json!({"tool_id": "echo.reverse_rpc", "args": {"method": "storage/get", "params": {"key": "k"}}}),
        )
        .await;
    assert!(reverse["response"].is_object(), "{reverse}");

    // A job to completion, and one cancelled while it runs.
    let job = c
        .ok(
            user,
            methods::TOOLS_INVOKE_ASYNC,
            json!({"tool_id": "echo.echo", "args": {"job": true}}),
        )
        .await;
    let job_id = job["jobId"].as_str().expect("jobId").to_string();
    wait_job(&c, user, &job_id, |s| s == JobState::Succeeded).await;
    let long = c
        .ok(
            user,
            methods::TOOLS_INVOKE_ASYNC,
            json!({"tool_id": "echo.sleep", "args": {"ms": 20000}}),
        )
        .await;
    let long_id = long["jobId"].as_str().expect("jobId").to_string();
    wait_job(&c, user, &long_id, |s| s == JobState::Running).await;
    let cancelled = c
        .ok(user, methods::TOOLS_CANCEL_JOB, json!({"jobId": long_id}))
        .await;
    assert_eq!(cancelled["cancelled"], true, "{cancelled}");

    // Export everything finished so far; the worker's cancel span ends asynchronously, so poll for it.
    let deadline = Instant::now() + GUARD;
    let spans = loop {
        tokio::task::block_in_place(|| guard.force_flush()).expect("flush");
        let spans = receiver.spans();
        if spans.iter().any(|s| s.name == "worker.cancel")
            && spans
                .iter()
                .any(|s| s.name == "worker.exec" && s.attrs.get("executa.invoke_id") == Some(&long_id))
        {
            break spans;
        }
        assert!(
            Instant::now() < deadline,
            "spans never arrived: {:?}",
            spans.iter().map(|s| &s.name).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };

    // Sync invoke of `echo`: the whole chain, one trace, parent links through the NATS header.
    let echo_invoke = one(&spans, "plugin.invoke of echo (sync)", |s| {
        s.name == "plugin.invoke"
            && s.attrs.get("gen_ai.tool.name").map(String::as_str) == Some("echo")
            && s.attrs.get("executa.invoke_id") != Some(&job_id)
    });
    assert_eq!(echo_invoke.attrs["mcp.method.name"], "invoke");
    assert_eq!(echo_invoke.attrs["gen_ai.operation.name"], "execute_tool");
    assert_eq!(echo_invoke.attrs["executa.outcome"], "success");
    let (api, exec) = check_chain(&spans, echo_invoke, methods::TOOLS_INVOKE);
    assert_eq!(exec.attrs["fleet.exec.kind"], "sync");
    assert!(
        spans.iter().any(|s| s.name == "admission"
            && s.parent == api.id
            && s.attrs["fleet.admission.kind"] == "rate"),
        "the rate admission is a child of api.request"
    );
    // The first call started the session: its spawn span is in this trace, under worker.exec.
    let spawn = spans
        .iter()
        .find(|s| s.name == "plugin.session.spawn" && s.trace == api.trace)
        .expect("plugin.session.spawn in the first invoke's trace");
    assert_eq!(spawn.parent, exec.id);
    assert_eq!(spawn.attrs["executa.outcome"], "ready");

    // `inspect`: the plugin received the W3C traceparent of its worker.exec span.
    let inspect = one(&spans, "plugin.invoke of inspect", |s| {
        s.name == "plugin.invoke" && s.attrs.get("gen_ai.tool.name").map(String::as_str) == Some("inspect")
    });
    let (_, inspect_exec) = check_chain(&spans, inspect, methods::TOOLS_INVOKE);
    assert!(
        traceparent.starts_with(&format!("00-{}-", inspect.trace)),
        "context.traceparent {traceparent} is in trace {}",
        inspect.trace
    );
    assert_eq!(
        traceparent,
        format!("00-{}-{}-01", inspect.trace, inspect_exec.id)
    );

    // The reverse RPC: a child of its invoke.
    let rr_invoke = one(&spans, "plugin.invoke of reverse_rpc", |s| {
        s.name == "plugin.invoke"
            && s.attrs.get("gen_ai.tool.name").map(String::as_str) == Some("reverse_rpc")
    });
    check_chain(&spans, rr_invoke, methods::TOOLS_INVOKE);
    let rr = one(&spans, "plugin.reverse_rpc", |s| s.name == "plugin.reverse_rpc");
    assert_eq!(rr.parent, rr_invoke.id);
    assert_eq!(rr.trace, rr_invoke.trace);
    assert_eq!(rr.attrs["rpc.method"], "storage/get");
    assert_eq!(rr.attrs["executa.reverse.family"], "storage");
    assert_eq!(rr.attrs["executa.outcome"], "error", "NoServices grants nothing");

    // The job: admission (quota) and the dispatch under invokeAsync's api.request; the worker's run in the same
    // trace.
    let job_invoke = one(&spans, "plugin.invoke of the job", |s| {
        s.name == "plugin.invoke" && s.attrs.get("executa.invoke_id") == Some(&job_id)
    });
    let (job_api, job_exec) = check_chain(&spans, job_invoke, methods::TOOLS_INVOKE_ASYNC);
    assert_eq!(job_exec.attrs["fleet.exec.kind"], "job");
    assert!(
        spans.iter().any(|s| s.name == "admission"
            && s.parent == job_api.id
            && s.attrs["fleet.admission.kind"] == "quota"
            && s.attrs["fleet.admission.outcome"] == "admitted"),
        "the quota admission is a child of invokeAsync's api.request"
    );

    // Cancel: job.cancel under cancelJob's api.request; the worker's cancel is its child through the header.
    let cancel = one(&spans, "job.cancel", |s| s.name == "job.cancel");
    let cancel_api = by_id(&spans, &cancel.parent);
    assert_eq!(cancel_api.name, "api.request");
    assert_eq!(cancel_api.attrs["rpc.method"], methods::TOOLS_CANCEL_JOB);
    assert_eq!(cancel.attrs["fleet.job.cancelled"], "true");
    let worker_cancel = spans
        .iter()
        .find(|s| s.name == "worker.cancel" && s.attrs.get("executa.invoke_id") == Some(&long_id))
        .expect("worker.cancel");
    assert_eq!(worker_cancel.parent, cancel.id);
    assert_eq!(worker_cancel.trace, cancel.trace);

    // Nothing exported carries the token or the user id.
    let strings = receiver.strings.lock().unwrap().clone();
    for s in &strings {
        assert!(!s.contains(&token), "a token was exported: {s}");
        assert!(!s.contains(user), "the user id was exported: {s}");
    }
    assert!(
        api.attrs["fleet.user_hash"].len() == 16 && !api.attrs["fleet.user_hash"].contains(user),
        "{:?}",
        api.attrs
    );

    c.shutdown().await;
    drop(guard);
}
