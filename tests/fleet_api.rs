//! The app-facing API (`tools.*`, spec §10) end to end over NATS: a real nats-server with JetStream, front
//! replicas, worker nodes running the echo fixture plugin in cgroups, and real JWTs (`fleet_e2e::cluster`).
//!
//! No test sleeps to synchronise or asserts on elapsed time: every wait polls an observable (a job record in
//! JetStream, a session's in-flight invokes, a worker counter, a received event) and its deadline is only a
//! failure guard. Long deadlines (30 min, 24 h) are never waited for: the deadline arithmetic is checked from
//! `deadlineMs - createdAt`.

// Test code: helpers panic on purpose when the system under test misbehaves.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fleet_client::api::api_request;
use fleet_client::auth::{DEFAULT_AUDIENCE, DEFAULT_ISSUER};
use fleet_e2e::cluster::{Cluster, Role, SECRET, connect};
use fleet_e2e::worker::{Plugin, eventually};
use fleet_proto::api::user_key;
use fleet_proto::api::{ApiError, ApiErrorCode, ApiResponse, JobId, JobState, methods, subjects};
use fleet_proto::limits::MAX_LONG_JOBS_PER_AGENT;
use fleet_store::{JobRecord, Store, StoreSettings, Transition};
use fleet_worker::config::WorkerConfig;
use fleet_worker::session::Session;
use futures::StreamExt as _;
use serde_json::{Value, json};

/// Failure guard of every wait.
const GUARD: Duration = Duration::from_secs(30);

/// The spec's sync result cap (HR-SI-05) and job result cap (§10.4).
const SYNC_MAX: usize = 4_194_304;
const JOB_MAX: usize = 262_144;

// -------------------------------------------------------------------------------------------------------------
// Helpers
// -------------------------------------------------------------------------------------------------------------

/// The echo fixture installed as `echo`.
fn echo() -> Plugin {
    Plugin::echo("echo", &[])
}

/// `{ok:false}` expected: the error, with its code checked.
async fn expect_err(c: &Cluster, user: &str, method: &str, args: Value, code: ApiErrorCode) -> ApiError {
    let e = c.err(user, method, args.clone()).await;
    assert_eq!(e.code, code, "{method} {args}: {e:?}");
    e
}

/// Starts a cluster and waits until its API answers: `Front::serve` returns before the server has seen the
/// endpoints' subscriptions, so a request sent at once may find no responders.
async fn start(name: &str, fronts: usize, workers: usize, plugins: &[Plugin]) -> Cluster {
    let c = Cluster::start(name, fronts, workers, plugins).await;
    c.wait_for_api(GUARD).await;
    c
}

/// Asserts `invalid_arg` naming `field` in `details.field` (spec: bad arguments are `invalid_arg`).
async fn expect_invalid_field(c: &Cluster, user: &str, method: &str, args: Value, field: &str) {
    let e = expect_err(c, user, method, args.clone(), ApiErrorCode::InvalidArg).await;
    assert_eq!(
        e.details.as_ref().and_then(|d| d.get("field")),
        Some(&json!(field)),
        "{method} {args}: {e:?}"
    );
}

/// Creates a job and returns its id (checking the `invokeAsync` result shape).
async fn create_job(c: &Cluster, user: &str, args: Value) -> JobId {
    let res = c.ok(user, methods::TOOLS_INVOKE_ASYNC, args).await;
    assert_eq!(res["state"], "queued", "{res}");
    res["jobId"].as_str().expect("jobId").parse().expect("a tjob_ id")
}

/// `tools.getJob`.
async fn get_job(c: &Cluster, user: &str, id: &JobId, extra: Value) -> Value {
    let mut args = json!({ "jobId": id });
    if let Value::Object(m) = extra {
        args.as_object_mut().expect("object").extend(m);
    }
    c.ok(user, methods::TOOLS_GET_JOB, args).await
}

/// `tools.cancelJob`.
async fn cancel_job(c: &Cluster, user: &str, id: &JobId, reason: Option<&str>) -> Value {
    let mut args = json!({ "jobId": id });
    if let Some(r) = reason {
        args["reason"] = json!(r);
    }
    c.ok(user, methods::TOOLS_CANCEL_JOB, args).await
}

/// `tools.getJob` of another user's job is `job_not_found`, exactly like an id nobody has (no existence oracle).
async fn not_found_like_an_unknown_id(c: &Cluster, user: &str, others: &JobId) {
    let theirs = json!({"jobId": others});
    let e = expect_err(c, user, methods::TOOLS_GET_JOB, theirs, ApiErrorCode::JobNotFound).await;
    let unknown = json!({"jobId": "tjob_0123456789abcdef0123456789abcdef"});
    let e2 = expect_err(
        c,
        user,
        methods::TOOLS_GET_JOB,
        unknown,
        ApiErrorCode::JobNotFound,
    )
    .await;
    assert_eq!(
        e.details, e2.details,
        "another user's job looks exactly like a missing one"
    );
}

/// Polls the job's record in JetStream until `pred` holds (the deadline is a failure guard).
async fn wait_record(
    c: &Cluster,
    user: &str,
    id: &JobId,
    what: &str,
    pred: impl Fn(&JobRecord) -> bool,
) -> JobRecord {
    let deadline = Instant::now() + GUARD;
    loop {
        let record = c.store.get_job(user, id).await.expect("store read");
        if let Some(r) = &record
            && pred(&r.value)
        {
            return r.value.clone();
        }
        assert!(
            Instant::now() < deadline,
            "job {id} never became {what}: {:?}",
            record.map(|r| (r.value.state, r.value.error))
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn wait_state(c: &Cluster, user: &str, id: &JobId, state: JobState) -> JobRecord {
    wait_record(c, user, id, state.as_str(), |r| r.state == state).await
}

/// Every session of `user` on `plugin`, across the cluster's workers.
fn sessions(c: &Cluster, user: &str, plugin: &str) -> Vec<Session> {
    c.workers
        .iter()
        .filter_map(|w| w.node.as_ref())
        .flat_map(|n| n.pool().sessions())
        .filter(|s| s.user() == user && s.tool_id() == plugin)
        .collect()
}

/// Waits until the plugin process is actually running the job's invoke (so a cancel reaches it).
async fn wait_invoke_active(c: &Cluster, user: &str, plugin: &str, id: &JobId) {
    assert!(
        eventually(GUARD, || sessions(c, user, plugin)
            .iter()
            .any(|s| s.has_invoke(id.as_str())))
        .await,
        "the invoke of {id} never became active on a {plugin} session"
    );
}

/// Milliseconds since the epoch of an RFC 3339 timestamp.
fn rfc3339_ms(s: &str) -> u64 {
    let t = humantime::parse_rfc3339(s).unwrap_or_else(|e| panic!("{s:?} is not RFC 3339: {e}"));
    u64::try_from(t.duration_since(UNIX_EPOCH).expect("after 1970").as_millis()).expect("ms")
}

use fleet_proto::util::now_ms;

fn rfc3339_of_ms(ms: u64) -> String {
    humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

/// The ids of a `listJobs` result, in order.
fn ids_of(list: &Value) -> Vec<String> {
    list["jobs"]
        .as_array()
        .expect("jobs")
        .iter()
        .map(|j| j["jobId"].as_str().expect("jobId").to_string())
        .collect()
}

fn ids(jobs: &[&JobId]) -> Vec<String> {
    jobs.iter().map(|j| j.to_string()).collect()
}

/// An API call over a given connection, with an optional `Authorization` header.
async fn raw_call(
    client: &async_nats::Client,
    auth: Option<&str>,
    method: &str,
    args: &Value,
) -> ApiResponse<Value> {
    let request = match auth {
        Some(a) => api_request(a, args, GUARD),
        None => async_nats::Request::new()
            .payload(serde_json::to_vec(args).expect("json").into())
            .timeout(Some(GUARD)),
    };
    let reply = client
        .send_request(subjects::api(method), request)
        .await
        .expect("API reply");
    serde_json::from_slice(&reply.payload).expect("ApiResponse")
}

/// Adds a worker node to `c` with a tweaked configuration (the harness's `add_worker` uses the test defaults).
async fn add_custom_worker(c: &mut Cluster, name: &str, tweak: impl FnOnce(&mut WorkerConfig)) {
    c.add_worker_with(name, tweak).await;
}

fn is_job_id(s: &str) -> bool {
    s.len() == 37
        && s.starts_with("tjob_")
        && s[5..]
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

// -------------------------------------------------------------------------------------------------------------
// tools.invoke
// -------------------------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invoke_round_trip_timeouts_caps_and_failures() {
    let c = start(
        "api-invoke",
        1,
        1,
        &[echo(), Plugin::echo("timed", &["--tool-timeout-s", "1"])],
    )
    .await;
    let u = "alice";
    let invoke = methods::TOOLS_INVOKE;

    // Round trip: the result is the plugin's payload (`data`), nothing else.
    let res = c
        .ok(
            u,
            invoke,
            json!({"tool_id": "echo.echo", "args": {"x": 1, "s": "é"}}),
        )
        .await;
    assert_eq!(res, json!({"arguments": {"x": 1, "s": "é"}}));
    // `plugin__tool` and `tool_id` + `method` name the same tool.
    let res = c
        .ok(u, invoke, json!({"tool_id": "echo__echo", "args": {"y": 2}}))
        .await;
    assert_eq!(res, json!({"arguments": {"y": 2}}));
    let res = c
        .ok(
            u,
            invoke,
            json!({"tool_id": "echo", "method": "echo", "args": {"z": 3}}),
        )
        .await;
    assert_eq!(res, json!({"arguments": {"z": 3}}));
    // No separator and no method: invalid_arg.
    expect_invalid_field(&c, u, invoke, json!({"tool_id": "echo"}), "method").await;
    expect_err(
        &c,
        u,
        invoke,
        json!({"tool_id": "echo", "method": 7}),
        ApiErrorCode::InvalidArg,
    )
    .await;

    // timeoutMs bounds (HR-SI-01): < 1000 invalid, 1000 and 90 000 fine, above clamped (accepted), null = omitted.
    expect_invalid_field(
        &c,
        u,
        invoke,
        json!({"tool_id": "echo.echo", "timeoutMs": 999}),
        "timeoutMs",
    )
    .await;
    expect_invalid_field(
        &c,
        u,
        invoke,
        json!({"tool_id": "echo.echo", "timeoutMs": 0}),
        "timeoutMs",
    )
    .await;
    for t in [
        json!(1000),
        json!(90_000),
        json!(90_001),
        json!(86_400_000),
        Value::Null,
    ] {
        let args = json!({"tool_id": "echo.echo", "args": {"t": t.clone()}, "timeoutMs": t.clone()});
        let res = c.ok(u, invoke, args).await;
        assert_eq!(res, json!({"arguments": {"t": t}}), "timeoutMs {t}");
    }
    // Booleans (and other non-numbers) are refused explicitly.
    for bad in [json!(true), json!(false), json!("5000"), json!(-1), json!(1500.5)] {
        expect_err(
            &c,
            u,
            invoke,
            json!({"tool_id": "echo.echo", "timeoutMs": bad}),
            ApiErrorCode::InvalidArg,
        )
        .await;
    }

    // The manifest's per-tool timeout (1 s) applies when timeoutMs is omitted (spec §16 A-3): tool_timeout, no
    // clamp details.
    let e = expect_err(
        &c,
        u,
        invoke,
        json!({"tool_id": "timed.timed_sleep", "args": {"ms": 5000}}),
        ApiErrorCode::ToolTimeout,
    )
    .await;
    assert_eq!(e.details, None, "{e:?}");
    // An explicit (unclamped) timeout: tool_timeout, no clamp details.
    let e = expect_err(
        &c,
        u,
        invoke,
        json!({"tool_id": "echo.sleep", "args": {"ms": 5000}, "timeoutMs": 1000}),
        ApiErrorCode::ToolTimeout,
    )
    .await;
    assert_eq!(e.details, None, "{e:?}");
    // Both timed-out invokes still owe an answer 500 ms later, so their process trees are killed (the cancel
    // fallback, HR-CJ-03; it would fail whatever else runs on those processes then): wait for both kills.
    let metrics = c.workers[0].metrics.clone();
    assert!(
        eventually(GUARD, || metrics
            .tree_kills
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 2)
        .await,
        "the timed-out invokes' processes were never killed"
    );
    // The plugin answers the next call (the timed-out invoke did not wedge anything).
    let res = c
        .ok(
            u,
            invoke,
            json!({"tool_id": "echo.sleep", "args": {"ms": 1}, "timeoutMs": 90_001}),
        )
        .await;
    assert_eq!(res, json!({"slept_ms": 1}));

    // Result cap (HR-SI-05): the whole serialized InvokeResult `{"data":{"blob":"…"},"duration_ms":N,
    // "success":true}` = bytes + 50 + digits(N). Over the cap → result_too_large {size, max, retriable: false}.
    let over = SYNC_MAX - 50; // size = SYNC_MAX + digits(N) > SYNC_MAX
    let e = expect_err(
        &c,
        u,
        invoke,
        json!({"tool_id": "echo.big_result", "args": {"bytes": over}}),
        ApiErrorCode::ResultTooLarge,
    )
    .await;
    let details = e.details.clone().expect("details");
    let size = usize::try_from(details["size"].as_u64().expect("size")).expect("size");
    assert!(
        (SYNC_MAX + 1..=SYNC_MAX + 6).contains(&size),
        "size {size} must be the InvokeResult's length (bytes + 50 + duration digits)"
    );
    assert_eq!(
        details,
        json!({"size": size, "max": SYNC_MAX, "retriable": false})
    );
    // Just under the cap (allowing a duration of up to 6 digits): succeeds with the whole blob.
    let under = SYNC_MAX - 50 - 6;
    let res = c
        .ok(
            u,
            invoke,
            json!({"tool_id": "echo.big_result", "args": {"bytes": under}}),
        )
        .await;
    let blob = res["blob"].as_str().expect("blob");
    assert!(
        blob.len() == under && blob.bytes().all(|b| b == b'x'),
        "blob of {} bytes",
        blob.len()
    );
    assert_eq!(res.as_object().map(|o| o.len()), Some(1));

    // success:false → tool_failed carrying the plugin's message.
    let e = expect_err(
        &c,
        u,
        invoke,
        json!({"tool_id": "echo.fail", "args": {"message": "the disk is on fire"}}),
        ApiErrorCode::ToolFailed,
    )
    .await;
    assert_eq!(e.message, "the disk is on fire");
    // A JSON-RPC error from the plugin → executa_error with the plugin's code and message.
    let e = expect_err(
        &c,
        u,
        invoke,
        json!({"tool_id": "echo.rpc_error", "args": {"code": -32042, "message": "nope"}}),
        ApiErrorCode::ExecutaError,
    )
    .await;
    let d = e.details.expect("details");
    assert_eq!((&d["code"], &d["message"]), (&json!(-32042), &json!("nope")));

    // A tool the plugin does not have → invalid_arg (naming `method`).
    expect_invalid_field(&c, u, invoke, json!({"tool_id": "echo.no_such_tool"}), "method").await;
    // A plugin that is not installed → permission_denied (node.rs: the worker refuses a tool_id outside its
    // catalogue; dispatch.rs returns that refusal as is — the spec's `tool_id` whitelist gate).
    expect_err(
        &c,
        u,
        invoke,
        json!({"tool_id": "nope.echo"}),
        ApiErrorCode::PermissionDenied,
    )
    .await;

    // Progress notifications of a sync invoke are dropped (HR-SI-06): the call just returns.
    let res = c
        .ok(
            u,
            invoke,
            json!({"tool_id": "echo.progress", "args": {"count": 3}}),
        )
        .await;
    assert_eq!(res, json!({"emitted": 3}));
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invoke_without_workers_is_agent_unavailable() {
    let c = start("api-noworker", 1, 0, &[echo()]).await;
    let e = expect_err(
        &c,
        "alice",
        methods::TOOLS_INVOKE,
        json!({"tool_id": "echo.echo", "args": {}}),
        ApiErrorCode::AgentUnavailable,
    )
    .await;
    assert!(ApiErrorCode::AgentUnavailable.retryable(), "{e:?}");
    // Argument errors still come first.
    expect_invalid_field(
        &c,
        "alice",
        methods::TOOLS_INVOKE,
        json!({"tool_id": "echo.echo", "timeoutMs": 999}),
        "timeoutMs",
    )
    .await;
    c.shutdown().await;
}

// -------------------------------------------------------------------------------------------------------------
// tools.invokeAsync
// -------------------------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invoke_async_shape_deadlines_limits_and_results() {
    let c = start("api-async", 1, 1, &[echo()]).await;
    let async_ = methods::TOOLS_INVOKE_ASYNC;

    // Shape: {jobId, state: queued, deadlineMs}; the job runs to succeeded and getJob shows the payload.
    let res = c
        .ok("alice", async_, json!({"tool_id": "echo.echo", "args": {"x": 1}}))
        .await;
    let keys: Vec<&str> = res
        .as_object()
        .expect("object")
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(keys, ["deadlineMs", "jobId", "state"], "{res}");
    assert!(is_job_id(res["jobId"].as_str().expect("jobId")), "{res}");
    assert_eq!(res["state"], "queued");
    let id: JobId = res["jobId"].as_str().expect("jobId").parse().expect("id");
    wait_state(&c, "alice", &id, JobState::Succeeded).await;
    let snap = get_job(&c, "alice", &id, json!({})).await;
    assert_eq!(snap["state"], "succeeded");
    assert_eq!(snap["jobId"], json!(id));
    assert_eq!(snap["tool_id"], "echo.echo");
    assert_eq!(snap["method"], "echo");
    assert_eq!(snap["result"], json!({"arguments": {"x": 1}}));
    assert_eq!(snap.get("error"), None, "{snap}");
    assert_eq!(snap["progress"], json!([]));
    assert_eq!(snap["lastSeq"], 0);
    assert_eq!(snap["deadlineMs"], res["deadlineMs"]);
    let created = rfc3339_ms(snap["createdAt"].as_str().expect("createdAt"));
    let started = rfc3339_ms(snap["startedAt"].as_str().expect("startedAt"));
    let finished = rfc3339_ms(snap["finishedAt"].as_str().expect("finishedAt"));
    assert!(created <= started && started <= finished, "{snap}");

    // Deadline clamp (§10.4): [60 s, 24 h], default 30 min — checked as deadlineMs - createdAt.
    let cases: [(Option<Value>, u64); 7] = [
        (None, 1_800_000),
        (Some(Value::Null), 1_800_000),
        (Some(json!(0)), 60_000),
        (Some(json!(59_000)), 60_000),
        (Some(json!(60_000)), 60_000),
        (Some(json!(86_400_000)), 86_400_000),
        (Some(json!(86_400_001)), 86_400_000),
    ];
    for (i, (timeout, want)) in cases.iter().enumerate() {
        let user = format!("deadline-{i}");
        let mut args = json!({"tool_id": "echo.echo"});
        if let Some(t) = timeout {
            args["timeoutMs"] = t.clone();
        }
        let res = c.ok(&user, async_, args).await;
        let id: JobId = res["jobId"].as_str().expect("jobId").parse().expect("id");
        // One job at a time: the worker runs at most 3 long jobs, and this harness runs no sweeper to dispatch a
        // job refused for capacity later.
        wait_state(&c, &user, &id, JobState::Succeeded).await;
        let snap = get_job(&c, &user, &id, json!({})).await;
        let created = rfc3339_ms(snap["createdAt"].as_str().expect("createdAt"));
        let deadline = res["deadlineMs"].as_u64().expect("deadlineMs");
        assert_eq!(snap["deadlineMs"], res["deadlineMs"]);
        assert_eq!(deadline - created, *want, "timeoutMs {timeout:?}");
        let record = c
            .store
            .get_job(&user, &id)
            .await
            .expect("read")
            .expect("record")
            .value;
        assert_eq!(
            record.deadline_ms - record.created_at_ms,
            *want,
            "timeoutMs {timeout:?}"
        );
    }
    expect_err(
        &c,
        "alice",
        async_,
        json!({"tool_id": "echo.echo", "timeoutMs": true}),
        ApiErrorCode::InvalidArg,
    )
    .await;

    // args ≤ 64 KB serialized: `{"s":"…"}` is n + 8 bytes.
    let exact = json!({"s": "x".repeat(65_536 - 8)});
    assert_eq!(serde_json::to_vec(&exact).expect("json").len(), 65_536);
    let id = create_job(&c, "args", json!({"tool_id": "echo.echo", "args": exact})).await;
    let record = wait_state(&c, "args", &id, JobState::Succeeded).await;
    assert_eq!(record.result, Some(json!({"arguments": exact})));
    let e = expect_err(
        &c,
        "args",
        async_,
        json!({"tool_id": "echo.echo", "args": {"s": "x".repeat(65_536 - 7)}}),
        ApiErrorCode::InvalidArg,
    )
    .await;
    assert_eq!(
        e.details,
        Some(json!({"field": "args", "reason": "args_too_large", "size": 65_537, "max": 65_536}))
    );

    // clientTag ≤ 120 characters (not bytes).
    let tag = "é".repeat(120);
    let id = create_job(&c, "tags", json!({"tool_id": "echo.echo", "clientTag": tag})).await;
    wait_state(&c, "tags", &id, JobState::Succeeded).await;
    assert_eq!(get_job(&c, "tags", &id, json!({})).await["clientTag"], json!(tag));
    expect_invalid_field(
        &c,
        "tags",
        async_,
        json!({"tool_id": "echo.echo", "clientTag": "é".repeat(121)}),
        "clientTag",
    )
    .await;
    // A bad tool id shape is refused before anything is created.
    expect_invalid_field(&c, "tags", async_, json!({"tool_id": "echo"}), "method").await;

    // Job result cap (§10.4): the serialized `data` `{"blob":"…"}` (bytes + 11) ≤ 256 KB succeeds, above fails.
    let id = create_job(
        &c,
        "cap",
        json!({"tool_id": "echo.big_result", "args": {"bytes": JOB_MAX - 11}}),
    )
    .await;
    wait_state(&c, "cap", &id, JobState::Succeeded).await;
    let snap = get_job(&c, "cap", &id, json!({})).await;
    assert_eq!(snap["state"], "succeeded");
    assert_eq!(snap["result"]["blob"].as_str().map(str::len), Some(JOB_MAX - 11));
    let id = create_job(
        &c,
        "cap",
        json!({"tool_id": "echo.big_result", "args": {"bytes": JOB_MAX - 10}}),
    )
    .await;
    wait_state(&c, "cap", &id, JobState::Failed).await;
    let snap = get_job(&c, "cap", &id, json!({})).await;
    assert_eq!(snap["state"], "failed");
    assert_eq!(snap.get("result"), None, "no result on a failed job");
    assert_eq!(snap["error"]["code"], "result_too_large");
    assert_eq!(
        snap["error"]["details"],
        json!({"size": JOB_MAX + 1, "max": JOB_MAX, "retriable": false})
    );

    // success:false → failed with tool_failed and the plugin's message.
    let id = create_job(
        &c,
        "fail",
        json!({"tool_id": "echo.fail", "args": {"message": "bad input"}}),
    )
    .await;
    wait_state(&c, "fail", &id, JobState::Failed).await;
    let snap = get_job(&c, "fail", &id, json!({})).await;
    assert_eq!(snap["error"]["code"], "tool_failed");
    assert_eq!(snap["error"]["message"], "bad input");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invoke_async_unknown_plugin_is_permission_denied() {
    let c = start("api-async-unknown", 1, 1, &[echo()]).await;
    // Sync and async must agree on the gate: tools.invoke already says permission_denied.
    expect_err(
        &c,
        "alice",
        methods::TOOLS_INVOKE,
        json!({"tool_id": "nope.echo"}),
        ApiErrorCode::PermissionDenied,
    )
    .await;
    match c
        .call(
            "alice",
            methods::TOOLS_INVOKE_ASYNC,
            json!({"tool_id": "nope.echo"}),
        )
        .await
    {
        ApiResponse::Err(e) => assert_eq!(e.code, ApiErrorCode::PermissionDenied, "{e:?}"),
        ApiResponse::Ok(res) => {
            // Accepted: it must at least not stay active (holding a quota slot) until its deadline. Each sweep
            // (what every front runs once a second) re-dispatches it synchronously, so three passes decide.
            let id: JobId = res["jobId"].as_str().expect("jobId").parse().expect("id");
            for _ in 0..3 {
                fleet::sweeper::sweep(&c.fronts[0].0).await;
            }
            let r = c
                .store
                .get_job("alice", &id)
                .await
                .expect("read")
                .expect("record")
                .value;
            assert_eq!(
                (r.state, r.error.map(|e| e.code)),
                (JobState::Failed, Some(ApiErrorCode::PermissionDenied)),
                "a job for a tool_id no worker has must not stay queued"
            );
        }
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_ring_keeps_the_newest_500() {
    let c = start("api-ring", 1, 1, &[echo()]).await;
    let u = "ringo";
    // 501 events, 21 ms apart: under the worker's 50/s per-invoke limit, so none is dropped.
    let id = create_job(
        &c,
        u,
        json!({"tool_id": "echo.progress", "args": {"count": 501, "interval_ms": 21}}),
    )
    .await;
    let record = wait_record(&c, u, &id, "terminal", |r| r.state.is_terminal()).await;
    assert_eq!(record.state, JobState::Succeeded, "{record:?}");
    let metrics = &c.workers[0].metrics;
    let dropped: u64 = metrics
        .progress_dropped
        .iter()
        .map(|d| d.load(std::sync::atomic::Ordering::Relaxed))
        .sum();
    assert_eq!(dropped, 0, "no progress event may be dropped");

    let event = |seq: u64| json!({"seq": seq, "type": "progress", "data": {"i": seq - 1, "pad": ""}});
    let seqs = |snap: &Value| -> Vec<u64> {
        snap["progress"]
            .as_array()
            .expect("progress")
            .iter()
            .map(|e| e["seq"].as_u64().expect("seq"))
            .collect()
    };

    // The ring holds the newest 500: seq 2..=501.
    let snap = get_job(&c, u, &id, json!({"sinceSeq": 0, "limit": 500})).await;
    assert_eq!(snap["state"], "succeeded");
    assert_eq!(snap["result"], json!({"emitted": 501}));
    assert_eq!(seqs(&snap), (2..=501).collect::<Vec<u64>>());
    assert_eq!(snap["lastSeq"], 501);
    assert_eq!(snap["progress"][0], event(2));
    assert_eq!(snap["progress"][499], event(501));
    // The worker counted what the ring keeps — the newest 500 events, each with its overhead, not the first one
    // the ring dropped — and the user's storage account is charged that and the record, its reserve given back.
    let overhead = fleet_store::settings::STORED_MESSAGE_OVERHEAD;
    let ring: u64 = snap["progress"]
        .as_array()
        .expect("progress")
        .iter()
        .map(|e| serde_json::to_vec(e).expect("json").len() as u64 + overhead)
        .sum();
    assert_eq!(record.progress_bytes, Some(ring));
    let charged = serde_json::to_vec(&record).expect("json").len() as u64 + overhead + ring;
    let reserve = c.store.settings().job_storage_reserve();
    let deadline = Instant::now() + GUARD;
    let account = loop {
        // The account is settled beside the slot's release, after the terminal write the wait above saw.
        let account = c.store.stored_job_bytes(u).await.expect("account");
        if account != reserve || Instant::now() >= deadline {
            break account;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(account, charged);
    // Defaults: sinceSeq 0, limit 500.
    assert_eq!(get_job(&c, u, &id, json!({})).await["progress"], snap["progress"]);
    // sinceSeq: only seq > sinceSeq.
    let snap = get_job(&c, u, &id, json!({"sinceSeq": 499})).await;
    assert_eq!(snap["progress"], json!([event(500), event(501)]));
    assert_eq!(snap["lastSeq"], 501);
    let snap = get_job(&c, u, &id, json!({"sinceSeq": 501})).await;
    assert_eq!(snap["progress"], json!([]));
    assert_eq!(snap["lastSeq"], 501);
    // limit: at most that many, oldest first.
    // A slice cut by `limit` reports the last seq it returned, so feeding lastSeq back as sinceSeq pages through
    // the ring without skipping; an uncut slice reports the highest stored seq.
    let snap = get_job(&c, u, &id, json!({"limit": 1})).await;
    assert_eq!(snap["progress"], json!([event(2)]));
    assert_eq!(snap["lastSeq"], 2);
    let snap = get_job(&c, u, &id, json!({"sinceSeq": 2, "limit": 1})).await;
    assert_eq!(snap["progress"], json!([event(3)]));
    assert_eq!(snap["lastSeq"], 3);
    let snap = get_job(&c, u, &id, json!({"sinceSeq": 10, "limit": 3})).await;
    assert_eq!(seqs(&snap), [11, 12, 13]);
    // limit outside 1–500 → invalid_arg.
    for limit in [0, 501] {
        expect_invalid_field(
            &c,
            u,
            methods::TOOLS_GET_JOB,
            json!({"jobId": id, "limit": limit}),
            "limit",
        )
        .await;
    }
    expect_err(
        &c,
        u,
        methods::TOOLS_GET_JOB,
        json!({"jobId": id, "sinceSeq": -1}),
        ApiErrorCode::InvalidArg,
    )
    .await;
    // listJobs never carries progress, but does carry lastSeq.
    let list = c.ok(u, methods::TOOLS_LIST_JOBS, json!({})).await;
    assert_eq!(list["jobs"][0]["progress"], json!([]));
    assert_eq!(list["jobs"][0]["lastSeq"], 501);
    c.shutdown().await;
}

// -------------------------------------------------------------------------------------------------------------
// Quota
// -------------------------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_five_active_jobs_and_a_cancel_frees_a_slot() {
    // The agent's long-job slots (spec §12.2 HR-NT-06, per user here): the first 3 run, the other 2 wait queued.
    let c = start("api-quota", 1, 2, &[echo()]).await;
    let u = "quota";
    let sleep = json!({"tool_id": "echo.sleep", "args": {"ms": 60_000}});
    let mut jobs = Vec::new();
    for _ in 0..5 {
        jobs.push(create_job(&c, u, sleep.clone()).await);
    }
    for id in &jobs[..MAX_LONG_JOBS_PER_AGENT] {
        wait_state(&c, u, id, JobState::Running).await;
    }
    let e = expect_err(
        &c,
        u,
        methods::TOOLS_INVOKE_ASYNC,
        sleep.clone(),
        ApiErrorCode::JobQuotaExceeded,
    )
    .await;
    assert_eq!(e.details, Some(json!({"active": 5, "max": 5})));
    assert!(ApiErrorCode::JobQuotaExceeded.retryable());
    // Another user is not affected; a job that ends frees its slot (the 6th long-job slot of the two workers).
    let other = create_job(&c, "someone-else", json!({"tool_id": "echo.echo"})).await;
    wait_state(&c, "someone-else", &other, JobState::Succeeded).await;
    // (The slot is given back right after the terminal write: poll for it.)
    let deadline = Instant::now() + GUARD;
    while !c.store.active_set("someone-else").await.expect("set").is_empty() {
        assert!(
            Instant::now() < deadline,
            "the finished job's slot was never given back"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // A cancel gives the slot back at once: the next creation is accepted, the one after refused again. (Whether
    // the accepted job finds a free long-job slot on a worker does not matter here: queued counts as active.)
    let res = cancel_job(&c, u, &jobs[0], None).await;
    assert_eq!(
        res,
        json!({"jobId": jobs[0], "state": "cancelled", "cancelled": true})
    );
    let sixth = create_job(&c, u, sleep.clone()).await;
    let e = expect_err(
        &c,
        u,
        methods::TOOLS_INVOKE_ASYNC,
        sleep.clone(),
        ApiErrorCode::JobQuotaExceeded,
    )
    .await;
    assert_eq!(e.details, Some(json!({"active": 5, "max": 5})));
    let mut active = c.store.active_set(u).await.expect("active set");
    active.sort();
    let mut want: Vec<JobId> = jobs[1..].iter().cloned().chain([sixth]).collect();
    want.sort();
    assert_eq!(active, want);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_holds_with_two_front_replicas_racing() {
    // No workers: every accepted job stays queued, which counts as active.
    let c = start("api-race", 2, 0, &[echo()]).await;

    // 12 concurrent requests over NATS (the queue group spreads them over both fronts).
    let token = format!("Bearer {}", c.token("racer"));
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..12 {
        let client = c.app.clone();
        let token = token.clone();
        set.spawn(async move {
            raw_call(
                &client,
                Some(&token),
                methods::TOOLS_INVOKE_ASYNC,
                &json!({"tool_id": "echo.echo"}),
            )
            .await
        });
    }
    let (mut ok, mut refused) = (0, 0);
    while let Some(r) = set.join_next().await {
        match r.expect("task") {
            ApiResponse::Ok(_) => ok += 1,
            ApiResponse::Err(e) => {
                assert_eq!(e.code, ApiErrorCode::JobQuotaExceeded, "{e:?}");
                assert_eq!(e.details, Some(json!({"active": 5, "max": 5})));
                refused += 1;
            }
        }
    }
    assert_eq!((ok, refused), (5, 7));
    assert_eq!(c.store.active_set("racer").await.expect("set").len(), 5);

    // The same race, forced onto both replicas: 6 calls through each front's handler at once.
    let token = format!("Bearer {}", c.token("racer2"));
    let payload = serde_json::to_vec(&json!({"tool_id": "echo.echo"})).expect("json");
    let mut set = tokio::task::JoinSet::new();
    for i in 0..12 {
        let front = c.fronts[i % 2].0.clone();
        let (token, payload) = (token.clone(), payload.clone());
        set.spawn(async move {
            front
                .handle(methods::TOOLS_INVOKE_ASYNC, Some(&token), &payload)
                .await
        });
    }
    let (mut ok, mut refused) = (0, 0);
    while let Some(r) = set.join_next().await {
        match r.expect("task") {
            ApiResponse::Ok(_) => ok += 1,
            ApiResponse::Err(e) => {
                assert_eq!(e.code, ApiErrorCode::JobQuotaExceeded, "{e:?}");
                refused += 1;
            }
        }
    }
    assert_eq!((ok, refused), (5, 7));
    let list = c
        .ok("racer2", methods::TOOLS_LIST_JOBS, json!({"limit": 100}))
        .await;
    assert_eq!(ids_of(&list).len(), 5, "exactly the accepted jobs exist");
    c.shutdown().await;
}

// -------------------------------------------------------------------------------------------------------------
// State machine
// -------------------------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_state_machine_and_late_results() {
    let mut c = start("api-cancel", 1, 0, &[echo()]).await;
    // A worker that never kills a cancelled invoke's process: the plugin's late answer really arrives.
    add_custom_worker(&mut c, "api-cancel-late", |cfg| {
        cfg.cancel_kill_after = Duration::from_secs(600);
    })
    .await;
    let u = "canceller";

    // Cancel a running job: the row flips at once, with the reason in the error message.
    let id = create_job(&c, u, json!({"tool_id": "echo.sleep", "args": {"ms": 1500}})).await;
    wait_state(&c, u, &id, JobState::Running).await;
    wait_invoke_active(&c, u, "echo", &id).await;
    let res = cancel_job(&c, u, &id, Some("user pressed stop")).await;
    assert_eq!(res, json!({"jobId": id, "state": "cancelled", "cancelled": true}));
    let snap = get_job(&c, u, &id, json!({})).await;
    assert_eq!(snap["state"], "cancelled");
    assert_eq!(
        snap["error"],
        json!({"code": "cancelled", "message": "user pressed stop"})
    );
    assert!(snap["finishedAt"].is_string(), "{snap}");
    // Cancelling again is a no-op.
    let res = cancel_job(&c, u, &id, Some("again")).await;
    assert_eq!(
        res,
        json!({"jobId": id, "state": "cancelled", "cancelled": false})
    );

    // The plugin finishes its sleep and answers: the late result is discarded (counted as unmatched) and the job
    // stays cancelled (HR-JS-01).
    let metrics = c.workers[0].metrics.clone();
    assert!(
        eventually(GUARD, || metrics
            .unmatched_responses
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1)
        .await,
        "the plugin's late answer never arrived"
    );
    for _ in 0..3 {
        let snap = get_job(&c, u, &id, json!({})).await;
        assert_eq!(snap["state"], "cancelled", "{snap}");
        assert_eq!(snap["error"]["message"], "user pressed stop");
        assert_eq!(snap.get("result"), None, "{snap}");
    }
    assert!(c.store.active_set(u).await.expect("set").is_empty());

    // Cancel a succeeded job: nothing changes.
    let id = create_job(&c, u, json!({"tool_id": "echo.echo", "args": {"k": 1}})).await;
    wait_state(&c, u, &id, JobState::Succeeded).await;
    let res = cancel_job(&c, u, &id, None).await;
    assert_eq!(
        res,
        json!({"jobId": id, "state": "succeeded", "cancelled": false})
    );
    let snap = get_job(&c, u, &id, json!({})).await;
    assert_eq!(snap["state"], "succeeded");
    assert_eq!(snap["result"], json!({"arguments": {"k": 1}}));
    assert_eq!(snap.get("error"), None);

    // Cancel a failed job: nothing changes either.
    let id = create_job(&c, u, json!({"tool_id": "echo.fail", "args": {"message": "m"}})).await;
    wait_state(&c, u, &id, JobState::Failed).await;
    let res = cancel_job(&c, u, &id, None).await;
    assert_eq!(res, json!({"jobId": id, "state": "failed", "cancelled": false}));
    assert_eq!(
        get_job(&c, u, &id, json!({})).await["error"]["code"],
        "tool_failed"
    );

    // reason ≤ 200 characters.
    let id = create_job(&c, u, json!({"tool_id": "echo.sleep", "args": {"ms": 60_000}})).await;
    expect_invalid_field(
        &c,
        u,
        methods::TOOLS_CANCEL_JOB,
        json!({"jobId": id, "reason": "r".repeat(201)}),
        "reason",
    )
    .await;
    let reason = "ü".repeat(200);
    let res = cancel_job(&c, u, &id, Some(&reason)).await;
    assert_eq!(res["cancelled"], true);
    assert_eq!(
        get_job(&c, u, &id, json!({})).await["error"]["message"],
        json!(reason)
    );
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_while_the_plugin_starts_stops_the_invoke() {
    let c = start(
        "api-cancel-start",
        1,
        1,
        &[Plugin::echo("slow", &["--startup-delay-ms", "3000"])],
    )
    .await;
    let u = "early-canceller";
    let id = create_job(&c, u, json!({"tool_id": "slow.sleep", "args": {"ms": 60_000}})).await;
    wait_state(&c, u, &id, JobState::Running).await;
    // The job's invoke holds its session's in-flight permit while the process starts (3 s).
    assert!(
        eventually(GUARD, || sessions(&c, u, "slow")
            .iter()
            .any(|s| s.in_flight() == 1))
        .await
    );
    let res = cancel_job(&c, u, &id, None).await;
    assert_eq!(res, json!({"jobId": id, "state": "cancelled", "cancelled": true}));
    // A cancelled job must not go on running its plugin invoke (HR-CJ-02/03): the in-flight invoke ends well
    // before the plugin's 60 s sleep would.
    assert!(
        eventually(Duration::from_secs(15), || sessions(&c, u, "slow")
            .iter()
            .all(|s| s.in_flight() == 0))
        .await,
        "the cancelled job's invoke is still running on the plugin (the plugin has it: {})",
        sessions(&c, u, "slow").iter().any(|s| s.has_invoke(id.as_str()))
    );
    c.shutdown().await;
}

// -------------------------------------------------------------------------------------------------------------
// listJobs
// -------------------------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_jobs_filters_order_and_limits() {
    let c = start("api-list", 1, 1, &[echo(), Plugin::echo("echo2", &[])]).await;
    let u = "lister";
    let cluster = &c;
    let list = move |args: Value| async move { cluster.ok(u, methods::TOOLS_LIST_JOBS, args).await };

    let a = create_job(&c, u, json!({"tool_id": "echo.echo", "clientTag": "t-a"})).await;
    wait_state(&c, u, &a, JobState::Succeeded).await;
    let b = create_job(&c, u, json!({"tool_id": "echo2.echo", "clientTag": "t-b"})).await;
    wait_state(&c, u, &b, JobState::Succeeded).await;
    let f = create_job(
        &c,
        u,
        json!({"tool_id": "echo.fail", "clientTag": "t-a", "args": {"message": "x"}}),
    )
    .await;
    wait_state(&c, u, &f, JobState::Failed).await;
    let r = create_job(&c, u, json!({"tool_id": "echo.sleep", "args": {"ms": 60_000}})).await;
    wait_state(&c, u, &r, JobState::Running).await;
    // Another user's jobs never show.
    create_job(&c, "other", json!({"tool_id": "echo.echo", "clientTag": "t-a"})).await;

    // Newest first: by createdAt, ties by id (descending), exactly as the snapshots report them.
    let mut all = Vec::new();
    for id in [&a, &b, &f, &r] {
        let snap = get_job(&c, u, id, json!({})).await;
        all.push((
            rfc3339_ms(snap["createdAt"].as_str().expect("createdAt")),
            id.to_string(),
        ));
    }
    all.sort_by(|x, y| y.cmp(x));
    let newest_first: Vec<String> = all.into_iter().map(|(_, id)| id).collect();
    let res = list(json!({})).await;
    assert_eq!(ids_of(&res), newest_first);
    assert_eq!(res["truncated"], false);
    for job in res["jobs"].as_array().expect("jobs") {
        assert_eq!(job["progress"], json!([]), "{job}");
    }
    let by_id = |jobs: &[&JobId]| {
        let want = ids(jobs);
        newest_first
            .iter()
            .filter(|id| want.contains(id))
            .cloned()
            .collect::<Vec<_>>()
    };
    // The snapshot in a list is the job's (state, tool, tag, result).
    let row = res["jobs"]
        .as_array()
        .expect("jobs")
        .iter()
        .find(|j| j["jobId"] == json!(b))
        .expect("b listed")
        .clone();
    assert_eq!(
        (&row["state"], &row["tool_id"], &row["clientTag"], &row["result"]),
        (
            &json!("succeeded"),
            &json!("echo2.echo"),
            &json!("t-b"),
            &json!({"arguments": {}})
        )
    );

    // tool_id (exact).
    assert_eq!(ids_of(&list(json!({"tool_id": "echo2.echo"})).await), ids(&[&b]));
    assert_eq!(ids_of(&list(json!({"tool_id": "echo.echo"})).await), ids(&[&a]));
    assert_eq!(
        ids_of(&list(json!({"tool_id": "echo"})).await),
        Vec::<String>::new()
    );
    // state: one, or several.
    assert_eq!(
        ids_of(&list(json!({"state": "succeeded"})).await),
        by_id(&[&a, &b])
    );
    assert_eq!(ids_of(&list(json!({"state": "running"})).await), ids(&[&r]));
    assert_eq!(
        ids_of(&list(json!({"state": ["failed", "running"]})).await),
        by_id(&[&f, &r])
    );
    assert_eq!(
        ids_of(&list(json!({"state": ["expired"]})).await),
        Vec::<String>::new()
    );
    expect_err(
        &c,
        u,
        methods::TOOLS_LIST_JOBS,
        json!({"state": "done"}),
        ApiErrorCode::InvalidArg,
    )
    .await;
    // clientTag: exact match only.
    assert_eq!(ids_of(&list(json!({"clientTag": "t-a"})).await), by_id(&[&a, &f]));
    assert_eq!(
        ids_of(&list(json!({"clientTag": "t-"})).await),
        Vec::<String>::new()
    );
    // Filters combine.
    assert_eq!(
        ids_of(&list(json!({"tool_id": "echo.echo", "state": "succeeded", "clientTag": "t-a"})).await),
        ids(&[&a])
    );
    assert_eq!(
        ids_of(&list(json!({"tool_id": "echo.echo", "state": "failed"})).await),
        Vec::<String>::new()
    );
    // since: lower bound on createdAt (inclusive).
    let f_created = get_job(&c, u, &f, json!({})).await["createdAt"].clone();
    let since = list(json!({"since": f_created})).await;
    let f_ms = rfc3339_ms(f_created.as_str().expect("createdAt"));
    for job in since["jobs"].as_array().expect("jobs") {
        assert!(
            rfc3339_ms(job["createdAt"].as_str().expect("createdAt")) >= f_ms,
            "{job}"
        );
    }
    assert!(ids_of(&since).contains(&f.to_string()) && ids_of(&since).contains(&r.to_string()));
    assert!(!ids_of(&since).contains(&a.to_string()));
    assert_eq!(
        ids_of(&list(json!({"since": rfc3339_of_ms(now_ms() + 60_000)})).await),
        Vec::<String>::new()
    );
    expect_invalid_field(
        &c,
        u,
        methods::TOOLS_LIST_JOBS,
        json!({"since": "yesterday"}),
        "since",
    )
    .await;
    // limit and truncation.
    let two = list(json!({"limit": 2})).await;
    assert_eq!(ids_of(&two), newest_first[..2].to_vec());
    assert_eq!(two["truncated"], true);
    let four = list(json!({"limit": 4})).await;
    assert_eq!(ids_of(&four), newest_first);
    assert_eq!(four["truncated"], false);
    assert_eq!(list(json!({"limit": 100})).await["truncated"], false);
    for limit in [0, 101] {
        expect_invalid_field(&c, u, methods::TOOLS_LIST_JOBS, json!({"limit": limit}), "limit").await;
    }
    expect_invalid_field(
        &c,
        u,
        methods::TOOLS_LIST_JOBS,
        json!({"clientTag": "x".repeat(121)}),
        "clientTag",
    )
    .await;
    cancel_job(&c, u, &r, None).await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_jobs_default_limit_since_cap_and_cross_user() {
    // No workers: jobs stay queued.
    let c = start("api-queued", 1, 0, &[echo()]).await;

    // A queued job: getJob shows it, cancel flips it.
    let id = create_job(&c, "alice", json!({"tool_id": "echo.echo", "clientTag": "q"})).await;
    let snap = get_job(&c, "alice", &id, json!({})).await;
    assert_eq!(snap["state"], "queued");
    assert_eq!((&snap["progress"], &snap["lastSeq"]), (&json!([]), &json!(0)));
    assert_eq!(snap.get("startedAt"), None, "{snap}");
    assert_eq!(snap.get("result"), None);
    assert_eq!(snap.get("error"), None);

    // Cross-user: bob's job id is unknown to alice (no existence oracle), and a listing never shows it.
    let bobs = create_job(&c, "bob", json!({"tool_id": "echo.echo", "clientTag": "q"})).await;
    not_found_like_an_unknown_id(&c, "alice", &bobs).await;
    let unknown: JobId = "tjob_0123456789abcdef0123456789abcdef".parse().expect("id");
    expect_err(
        &c,
        "alice",
        methods::TOOLS_CANCEL_JOB,
        json!({"jobId": bobs, "reason": "mine now"}),
        ApiErrorCode::JobNotFound,
    )
    .await;
    expect_err(
        &c,
        "alice",
        methods::TOOLS_CANCEL_JOB,
        json!({"jobId": unknown}),
        ApiErrorCode::JobNotFound,
    )
    .await;
    let alices = c
        .ok(
            "alice",
            methods::TOOLS_LIST_JOBS,
            json!({"clientTag": "q", "limit": 100}),
        )
        .await;
    assert_eq!(ids_of(&alices), ids(&[&id]));
    let snap = get_job(&c, "bob", &bobs, json!({})).await;
    assert_eq!(snap["state"], "queued", "alice's cancel must not touch bob's job");
    assert_eq!(
        ids_of(&c.ok("bob", methods::TOOLS_LIST_JOBS, json!({})).await),
        ids(&[&bobs])
    );
    // Malformed ids are invalid_arg, not job_not_found.
    for bad in [
        json!("tjob_0123"),
        json!("tjob_0123456789ABCDEF0123456789ABCDEF"),
        json!("job_0123456789abcdef0123456789abcdef0"),
        json!("tjob_0123456789abcdef0123456789abcdeg"),
        json!(""),
        json!(42),
    ] {
        for method in [methods::TOOLS_GET_JOB, methods::TOOLS_CANCEL_JOB] {
            expect_err(
                &c,
                "alice",
                method,
                json!({"jobId": bad}),
                ApiErrorCode::InvalidArg,
            )
            .await;
        }
    }
    expect_err(
        &c,
        "alice",
        methods::TOOLS_GET_JOB,
        json!({}),
        ApiErrorCode::InvalidArg,
    )
    .await;

    // Cancel the queued job (no reason: a default message).
    let res = cancel_job(&c, "alice", &id, None).await;
    assert_eq!(res, json!({"jobId": id, "state": "cancelled", "cancelled": true}));
    let snap = get_job(&c, "alice", &id, json!({})).await;
    assert_eq!(snap["state"], "cancelled");
    assert_eq!(snap["error"]["code"], "cancelled");
    assert!(
        !snap["error"]["message"].as_str().unwrap_or("").is_empty(),
        "{snap}"
    );
    let res = cancel_job(&c, "alice", &id, None).await;
    assert_eq!(
        res,
        json!({"jobId": id, "state": "cancelled", "cancelled": false})
    );

    // Default limit 20, truncated when more match; newest first.
    let u = "many";
    for _ in 0..21 {
        let id = create_job(&c, u, json!({"tool_id": "echo.echo"})).await;
        cancel_job(&c, u, &id, None).await;
    }
    let res = c.ok(u, methods::TOOLS_LIST_JOBS, json!({})).await;
    let jobs = res["jobs"].as_array().expect("jobs");
    assert_eq!((jobs.len(), &res["truncated"]), (20, &json!(true)));
    let created: Vec<u64> = jobs
        .iter()
        .map(|j| rfc3339_ms(j["createdAt"].as_str().expect("createdAt")))
        .collect();
    assert!(
        created.windows(2).all(|w| w[0] >= w[1]),
        "newest first: {created:?}"
    );
    let res = c.ok(u, methods::TOOLS_LIST_JOBS, json!({"limit": 21})).await;
    assert_eq!((ids_of(&res).len(), &res["truncated"]), (21, &json!(false)));
    let res = c.ok(u, methods::TOOLS_LIST_JOBS, json!({"limit": 20})).await;
    assert_eq!((ids_of(&res).len(), &res["truncated"]), (20, &json!(true)));

    // `since` older than 7 days is capped, not an error: records of 8 and 6 days ago (written straight to the
    // store), only the younger one is listed however far back `since` reaches.
    let u = "old-timer";
    let day = 24 * 3600 * 1000;
    let mut old = Vec::new();
    for age_days in [8, 6] {
        let created = now_ms() - age_days * day;
        let id: JobId = fleet::node::new_invoke_id();
        let record = JobRecord::queued(id.clone(), u, "echo.echo", "echo", "echo", created, 60_000);
        c.store.create_job(record, 5).await.expect("create");
        let t = c
            .store
            .transition(u, &id, JobState::Cancelled, |_| {})
            .await
            .expect("transition");
        assert!(matches!(t, Transition::Done(_)), "{t:?}");
        old.push(id);
    }
    let (eight, six) = (&old[0], &old[1]);
    for since in [
        Some(rfc3339_of_ms(now_ms() - 30 * day)),
        Some(rfc3339_of_ms(now_ms() - 9 * day)),
        None,
    ] {
        let args = since.as_ref().map_or_else(|| json!({}), |s| json!({"since": s}));
        let res = c.ok(u, methods::TOOLS_LIST_JOBS, args).await;
        assert_eq!(ids_of(&res), ids(&[six]), "since {since:?}");
    }
    let res = c
        .ok(
            u,
            methods::TOOLS_LIST_JOBS,
            json!({"since": rfc3339_of_ms(now_ms() - 5 * day)}),
        )
        .await;
    assert_eq!(ids_of(&res), Vec::<String>::new());
    // The 8-day-old job itself is still readable by id (retention ≥ 7 days).
    assert_eq!(get_job(&c, u, eight, json!({})).await["state"], "cancelled");
    c.shutdown().await;
}

/// An `invokeAsync` of `user` refused with `job_quota_exceeded` by a quota that says when room frees: its details.
async fn job_quota_refusal(c: &Cluster, user: &str) -> Value {
    let e = expect_err(
        c,
        user,
        methods::TOOLS_INVOKE_ASYNC,
        json!({"tool_id": "echo.echo"}),
        ApiErrorCode::JobQuotaExceeded,
    )
    .await;
    let details = e.details.clone().expect("details");
    assert!(
        details["retry_after_ms"].as_u64().is_some_and(|ms| ms > 0),
        "{e:?}"
    );
    details
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bytes_a_users_jobs_keep_are_a_job_quota() {
    // No workers: jobs stay queued until cancelled. A front whose store lets each user keep two active jobs'
    // reserves and 64 KiB (the cap's boundary, reachable in a test).
    let mut c = Cluster::start("api-bytes", 0, 0, &[echo()]).await;
    let base = StoreSettings::default();
    let reserve = base.job_storage_reserve();
    let max = 2 * reserve + 64 * 1024;
    c.add_front_with_store(
        fleet::front::FrontConfig::default(),
        StoreSettings {
            max_job_bytes_per_user: max,
            ..base
        },
    )
    .await;
    c.wait_for_api(GUARD).await;
    let u = "hoarder";
    let first = create_job(&c, u, json!({"tool_id": "echo.echo"})).await;
    create_job(&c, u, json!({"tool_id": "echo.echo"})).await;
    // A third active job's reserve is over: job_quota_exceeded, saying what is kept, the cap and when room frees.
    let details = job_quota_refusal(&c, u).await;
    assert_eq!(
        (
            &details["stored_bytes"],
            &details["job_reserve_bytes"],
            &details["max_bytes"],
            &details["retriable"]
        ),
        (&json!(2 * reserve), &json!(reserve), &json!(max), &json!(true)),
        "{details}"
    );
    // Another user has room of their own.
    create_job(&c, "neighbour", json!({"tool_id": "echo.echo"})).await;
    // A cancel replaces the first job's reserve by its record: room for the third.
    cancel_job(&c, u, &first, None).await;
    create_job(&c, u, json!({"tool_id": "echo.echo"})).await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nearly_full_job_store_refuses_new_jobs_for_everyone() {
    // No workers. One front whose JetStream budget puts the high-water mark at exactly one job's reserve: the
    // store already holds another tenant's job, so the next job of anyone is over it.
    let mut c = Cluster::start("api-full", 0, 0, &[echo()]).await;
    let base = StoreSettings::default();
    let reserve = base.job_storage_reserve();
    let mut budget = reserve;
    while fleet_store::fill::high_water(budget) < reserve {
        budget += 1;
    }
    let earlier = fleet_store::JobRecord::queued(
        JobId::from_bytes([7; 16]),
        "earlier",
        "echo.echo",
        "echo",
        "echo",
        fleet_proto::util::now_ms(),
        60_000,
    );
    c.store.create_job(earlier, 5).await.expect("an earlier job");
    let held = c.store.refresh_fill().await.expect("fill").used_bytes;
    assert!(held > 0, "the store holds a job");
    c.add_front_with_store(
        fleet::front::FrontConfig::default(),
        StoreSettings {
            job_store_max_bytes: budget,
            ..base
        },
    )
    .await;
    c.wait_for_api(GUARD).await;
    for user in ["first", "second"] {
        let e = expect_err(
            &c,
            user,
            methods::TOOLS_INVOKE_ASYNC,
            json!({"tool_id": "echo.echo"}),
            ApiErrorCode::LongJobCapacity,
        )
        .await;
        // Retriable, when to look again, and nothing of the store's size.
        assert_eq!(
            e.details,
            Some(json!({"retriable": true, "retry_after_ms": 2000})),
            "{e:?}"
        );
        assert!(!e.message.contains(&budget.to_string()), "{e:?}");
    }
    // Nothing was created.
    let listed = c.ok("first", methods::TOOLS_LIST_JOBS, json!({})).await;
    assert_eq!(ids_of(&listed), Vec::<String>::new(), "{listed}");
    // Operators see it: the refusals and the fill admission decided on.
    let text = c.metrics.encode();
    assert!(
        text.contains(r#"cloud_agents_rejections_total{kind="store_full"} 2"#),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            r#"cloud_agents_job_store_bytes{{kind="budget"}} {budget}"#
        )),
        "{text}"
    );
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_jobs_pages_with_a_cursor_and_the_retained_cap_is_a_job_quota() {
    // No workers: jobs stay queued until cancelled. One front whose store caps each user at 5 jobs per retention,
    // indexed in pages of 2 (the cap's boundary, reachable in a test).
    let mut c = Cluster::start("api-pages", 0, 0, &[echo()]).await;
    let capped = StoreSettings {
        job_index_page: 2,
        max_retained_jobs_per_user: 5,
        ..StoreSettings::default()
    };
    c.add_front_with_store(fleet::front::FrontConfig::default(), capped)
        .await;
    c.wait_for_api(GUARD).await;
    let u = "pager";
    let mut ids = Vec::new();
    for _ in 0..5 {
        let id = create_job(&c, u, json!({"tool_id": "echo.echo"})).await;
        cancel_job(&c, u, &id, None).await;
        ids.push(id);
    }
    // The sixth job of the retention: job_quota_exceeded, saying what the cap is and when room frees.
    let details = job_quota_refusal(&c, u).await;
    assert_eq!(
        (&details["retained"], &details["max"], &details["retriable"]),
        (&json!(5), &json!(5), &json!(true)),
        "{details}"
    );
    // Another user has room of their own.
    create_job(&c, "neighbour", json!({"tool_id": "echo.echo"})).await;

    // Pages of 2 with the cursor: 2 + 2 + 1, newest first, each job once.
    let (mut listed, mut pages, mut cursor) = (Vec::new(), 0, None::<Value>);
    loop {
        let mut args = json!({"limit": 2});
        if let Some(cursor) = &cursor {
            args["cursor"] = cursor.clone();
        }
        let res = c.ok(u, methods::TOOLS_LIST_JOBS, args).await;
        pages += 1;
        listed.extend(ids_of(&res));
        assert_eq!(
            res.get("cursor").is_some(),
            res["truncated"] == json!(true),
            "{res}"
        );
        match res.get("cursor") {
            Some(next) => cursor = Some(next.clone()),
            None => break,
        }
    }
    let newest_first: Vec<String> = ids.iter().rev().map(ToString::to_string).collect();
    assert_eq!((listed, pages), (newest_first.clone(), 3));
    // Without a cursor, the newest page; a listing with nothing more has the spec's shape, no `cursor` key.
    let all = c.ok(u, methods::TOOLS_LIST_JOBS, json!({})).await;
    assert_eq!(ids_of(&all), newest_first);
    let mut keys: Vec<&String> = all.as_object().expect("object").keys().collect();
    keys.sort();
    assert_eq!(keys, ["jobs", "truncated"]);
    // Another user's cursor shows only their own jobs (none past it here).
    let pagers = c.ok(u, methods::TOOLS_LIST_JOBS, json!({"limit": 1})).await;
    let theirs = c
        .ok(
            "neighbour",
            methods::TOOLS_LIST_JOBS,
            json!({"cursor": pagers["cursor"]}),
        )
        .await;
    assert_eq!(ids_of(&theirs), Vec::<String>::new());
    // What is not a cursor is invalid_arg naming it.
    for bad in [json!("not-a-cursor"), json!("c".repeat(65)), json!("1.2.3")] {
        expect_invalid_field(&c, u, methods::TOOLS_LIST_JOBS, json!({"cursor": bad}), "cursor").await;
    }
    expect_err(
        &c,
        u,
        methods::TOOLS_LIST_JOBS,
        json!({"cursor": 7}),
        ApiErrorCode::InvalidArg,
    )
    .await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_jobs_are_answered_from_memory_and_only_to_their_user() {
    let c = start("api-finished", 1, 1, &[echo()]).await;
    let front = &c.fronts[0].0;
    let id = create_job(
        &c,
        "alice",
        json!({"tool_id": "echo.progress", "args": {"count": 3}}),
    )
    .await;
    let running = create_job(
        &c,
        "alice",
        json!({"tool_id": "echo.sleep", "args": {"ms": 60_000}}),
    )
    .await;
    // (`wait_state` reads the store, never the front.)
    wait_state(&c, "alice", &id, JobState::Succeeded).await;
    wait_state(&c, "alice", &running, JobState::Running).await;
    // The worker's terminal step announced the record: the front keeps it before anyone asked for it.
    assert!(
        eventually(GUARD, || front.finished_jobs().len() == 1).await,
        "the announced finished record was not kept"
    );
    let announced = front.finished_jobs().bytes();
    // A running job is never kept.
    assert_eq!(
        get_job(&c, "alice", &running, json!({})).await["state"],
        "running"
    );
    assert_eq!(front.finished_jobs().len(), 1);
    // Answered from memory, exactly as the store's record reads.
    let first = get_job(&c, "alice", &id, json!({})).await;
    assert_eq!(first["state"], "succeeded");
    assert_eq!(
        first["result"],
        json!(wait_state(&c, "alice", &id, JobState::Succeeded).await.result)
    );
    assert_eq!(get_job(&c, "alice", &id, json!({})).await, first);
    assert_eq!(front.finished_jobs().len(), 1);
    // Its progress slices still come from the ring, cut and frozen as ever.
    let sliced = get_job(&c, "alice", &id, json!({"sinceSeq": 1, "limit": 1})).await;
    assert_eq!(
        (&sliced["progress"][0]["seq"], &sliced["lastSeq"]),
        (&json!(2), &json!(2))
    );
    let tail = get_job(&c, "alice", &id, json!({"sinceSeq": 3})).await;
    assert_eq!((&tail["progress"], &tail["lastSeq"]), (&json!([]), &json!(3)));
    // Bob asking for alice's job finds nothing, exactly as for an id nobody has.
    not_found_like_an_unknown_id(&c, "bob", &id).await;

    // A record over FINISHED_ANNOUNCE_MAX_BYTES is not announced: the first read keeps it. The small job that
    // finishes after it on the same worker is announced after it (one connection's messages keep their order),
    // so once that one is kept, the big one would have been too.
    let big = create_job(
        &c,
        "alice",
        json!({"tool_id": "echo.big_result", "args": {"bytes": subjects::FINISHED_ANNOUNCE_MAX_BYTES}}),
    )
    .await;
    wait_state(&c, "alice", &big, JobState::Succeeded).await;
    let small = create_job(&c, "alice", json!({"tool_id": "echo.echo", "args": {}})).await;
    wait_state(&c, "alice", &small, JobState::Succeeded).await;
    assert!(
        eventually(GUARD, || front.finished_jobs().len() == 2).await,
        "the small job's record was not kept"
    );
    assert!(front.finished_jobs().bytes() < announced + subjects::FINISHED_ANNOUNCE_MAX_BYTES);
    let read = get_job(&c, "alice", &big, json!({})).await;
    assert_eq!(
        read["result"]["blob"].as_str().map(str::len),
        Some(subjects::FINISHED_ANNOUNCE_MAX_BYTES)
    );
    assert_eq!(front.finished_jobs().len(), 3, "the first read keeps it");
    assert_eq!(get_job(&c, "alice", &big, json!({})).await, read);
    cancel_job(&c, "alice", &running, None).await;
    c.shutdown().await;
}

// -------------------------------------------------------------------------------------------------------------
// Auth, service discovery
// -------------------------------------------------------------------------------------------------------------

/// base64url without padding (for hand-made tokens).
fn b64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..=chunk.len() {
            let index = usize::try_from((n >> (18 - 6 * i)) & 63).expect("6 bits");
            out.push(char::from(ALPHABET[index]));
        }
    }
    out
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs()
}

fn claims(user: &str) -> Value {
    let now = now_secs();
    json!({"sub": user, "iss": DEFAULT_ISSUER, "aud": DEFAULT_AUDIENCE, "iat": now, "exp": now + 600})
}

fn sign(alg: jsonwebtoken::Algorithm, secret: &[u8], claims: &Value) -> String {
    let key = jsonwebtoken::EncodingKey::from_secret(secret).expect("key");
    jsonwebtoken::encode(&jsonwebtoken::Header::new(alg), claims, &key).expect("sign")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_method_refuses_bad_tokens() {
    let c = start("api-auth", 1, 0, &[echo()]).await;
    let hs256 = jsonwebtoken::Algorithm::HS256;
    let mut expired = claims("alice");
    expired["exp"] = json!(now_secs() - 3600);
    expired["iat"] = json!(now_secs() - 7200);
    let mut no_sub = claims("alice");
    no_sub.as_object_mut().expect("object").remove("sub");
    let none_token = format!(
        "{}.{}.",
        b64url(br#"{"alg":"none","typ":"JWT"}"#),
        b64url(claims("alice").to_string().as_bytes())
    );
    let bad: Vec<(&str, String, Value)> = vec![
        (
            "expired",
            sign(hs256, SECRET, &expired),
            json!({"reason": "expired"}),
        ),
        (
            "wrong aud",
            c.key
                .mint(
                    "alice",
                    DEFAULT_ISSUER,
                    "someone-else",
                    Duration::from_secs(600),
                    false,
                )
                .expect("mint"),
            json!({"reason": "wrong_audience"}),
        ),
        (
            "wrong iss",
            c.key
                .mint(
                    "alice",
                    "evil-issuer",
                    DEFAULT_AUDIENCE,
                    Duration::from_secs(600),
                    false,
                )
                .expect("mint"),
            json!({"reason": "wrong_issuer"}),
        ),
        ("alg none", none_token, json!({"reason": "algorithm_not_allowed"})),
        (
            "HS512",
            sign(jsonwebtoken::Algorithm::HS512, SECRET, &claims("alice")),
            json!({"reason": "algorithm_not_allowed"}),
        ),
        (
            "missing sub",
            sign(hs256, SECRET, &no_sub),
            json!({"reason": "missing_claim", "claim": "sub"}),
        ),
        (
            "other secret",
            sign(hs256, b"another-secret-that-is-32-bytes-long!!", &claims("alice")),
            json!({"reason": "bad_signature"}),
        ),
        ("garbage", "not.a.jwt".to_string(), json!({"reason": "malformed"})),
    ];
    let args = json!({"tool_id": "echo.echo"});
    for method in methods::ALL {
        // No header at all.
        match raw_call(&c.app, None, method, &args).await {
            ApiResponse::Err(e) => assert_eq!(e.code, ApiErrorCode::InvalidToken, "{method}: {e:?}"),
            ApiResponse::Ok(v) => panic!("{method} without a token succeeded: {v}"),
        }
        // "Bearer" alone.
        match raw_call(&c.app, Some("Bearer"), method, &args).await {
            ApiResponse::Err(e) => {
                assert_eq!(e.code, ApiErrorCode::InvalidToken, "{method}: {e:?}");
                assert_eq!(e.details, Some(json!({"reason": "missing"})));
            }
            ApiResponse::Ok(v) => panic!("{method} with `Bearer` alone succeeded: {v}"),
        }
        for (what, token, details) in &bad {
            match c
                .call_with_token(&format!("Bearer {token}"), method, args.clone())
                .await
            {
                ApiResponse::Err(e) => {
                    assert_eq!(e.code, ApiErrorCode::InvalidToken, "{method} / {what}: {e:?}");
                    assert_eq!(e.details.as_ref(), Some(details), "{method} / {what}: {e:?}");
                    assert!(!e.message.contains(token.as_str()), "the token is never echoed");
                }
                ApiResponse::Ok(v) => panic!("{method} with a token ({what}) succeeded: {v}"),
            }
        }
    }
    // The same claims, correctly signed, pass (a bare JWT is accepted too).
    let good = sign(hs256, SECRET, &claims("alice"));
    let res = c
        .call_with_token(&good, methods::TOOLS_LIST_JOBS, json!({}))
        .await
        .into_result()
        .expect("a valid token works");
    assert_eq!(res, json!({"jobs": [], "truncated": false}));
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn srv_ping_answers() {
    let c = start("api-ping", 2, 0, &[echo()]).await;
    let reply = c
        .operator
        .request("$SRV.PING.cloud-agents", "".into())
        .await
        .expect("a $SRV.PING reply");
    let v: Value = serde_json::from_slice(&reply.payload).expect("json");
    assert_eq!(v["name"], "cloud-agents", "{v}");
    assert_eq!(v["type"], "io.nats.micro.v1.ping_response", "{v}");
    // Every endpoint is listed by $SRV.INFO, under the API prefix and queue group.
    let reply = c
        .operator
        .request("$SRV.INFO.cloud-agents", "".into())
        .await
        .expect("a $SRV.INFO reply");
    let v: Value = serde_json::from_slice(&reply.payload).expect("json");
    let mut subjects_listed: Vec<String> = v["endpoints"]
        .as_array()
        .expect("endpoints")
        .iter()
        .map(|e| e["subject"].as_str().expect("subject").to_string())
        .collect();
    subjects_listed.sort();
    let mut want: Vec<String> = methods::ALL.iter().map(|m| subjects::api(m)).collect();
    want.sort();
    assert_eq!(subjects_listed, want);
    c.shutdown().await;
}

// -------------------------------------------------------------------------------------------------------------
// tool_job events
// -------------------------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_job_events_fold_progress_and_never_carry_the_result() {
    let c = start("api-events", 1, 1, &[echo()]).await;
    let u = "eve";
    let mut events = c
        .app
        .subscribe(subjects::user_events(&user_key(u)))
        .await
        .expect("subscribe");
    let mut others = c
        .app
        .subscribe(subjects::user_events(&user_key("not-eve")))
        .await
        .expect("subscribe");
    let id = create_job(
        &c,
        u,
        json!({"tool_id": "echo.progress", "args": {"count": 3, "type": "tool_update"}}),
    )
    .await;
    let mut got: Vec<Value> = Vec::new();
    while !got.last().is_some_and(|e| e["terminal"] == true) {
        let msg = tokio::time::timeout(GUARD, events.next())
            .await
            .expect("the next tool_job event")
            .expect("subscription open");
        let v: Value = serde_json::from_slice(&msg.payload).expect("event json");
        got.push(v);
    }
    let event = |seq: u64| {
        json!({"job_id": id, "tool_id": "echo.progress", "state": "running", "seq": seq, "terminal": false,
               "event": {"seq": seq, "type": "tool_update", "data": {"i": seq - 1, "pad": ""}}})
    };
    let want = vec![
        json!({"job_id": id, "tool_id": "echo.progress", "state": "queued", "seq": 0, "terminal": false}),
        json!({"job_id": id, "tool_id": "echo.progress", "state": "running", "seq": 0, "terminal": false}),
        event(1),
        event(2),
        event(3),
        json!({"job_id": id, "tool_id": "echo.progress", "state": "succeeded", "seq": 3, "terminal": true}),
    ];
    assert_eq!(got, want);
    for e in &got {
        assert!(!e.to_string().contains("\"result\""), "no result in events: {e}");
    }
    // The snapshot agrees (and does carry the result).
    let snap = get_job(&c, u, &id, json!({})).await;
    assert_eq!(
        (&snap["state"], &snap["lastSeq"]),
        (&json!("succeeded"), &json!(3))
    );
    assert_eq!(snap["result"], json!({"emitted": 3}));
    // Nothing was published on another user's subject (a round trip through the server: whatever it routed to
    // this connection before the PONG is delivered before it).
    fleet_client::nats_conn::round_trip(&c.app)
        .await
        .expect("round trip");
    assert!(
        futures::FutureExt::now_or_never(others.next()).is_none(),
        "events leaked to another user's subject"
    );
    c.shutdown().await;
}

/// A job accepted, whose plugin no worker has by the time it is dispatched (e.g. removed from the catalogue in
/// between), is failed by the dispatch — and, like every terminal transition, announced with a terminal event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_no_worker_can_run_is_failed_and_announced() {
    let c = start("api-undispatchable", 1, 1, &[echo()]).await;
    let u = "frank";
    let mut events = c
        .app
        .subscribe(subjects::user_events(&user_key(u)))
        .await
        .expect("subscribe");
    fleet_client::nats_conn::round_trip(&c.app)
        .await
        .expect("round trip");
    let now = now_ms();
    let id: JobId = fleet::node::new_invoke_id();
    let record = JobRecord::queued(id.clone(), u, "gone.echo", "gone", "echo", now, 60_000);
    c.store.create_job(record.clone(), 5).await.expect("create");
    let refused = c.fronts[0]
        .0
        .dispatch_job(&record)
        .await
        .expect_err("no worker has the plugin");
    assert_eq!(refused.code, ApiErrorCode::PermissionDenied, "{refused:?}");
    let msg = tokio::time::timeout(GUARD, events.next())
        .await
        .expect("a tool_job event")
        .expect("subscription open");
    let event: Value = serde_json::from_slice(&msg.payload).expect("event json");
    assert_eq!(
        event,
        json!({"job_id": id, "tool_id": "gone.echo", "state": "failed", "seq": 0, "terminal": true})
    );
    let r = c
        .store
        .get_job(u, &id)
        .await
        .expect("read")
        .expect("record")
        .value;
    assert_eq!(
        (r.state, r.error.map(|e| e.code)),
        (JobState::Failed, Some(ApiErrorCode::PermissionDenied))
    );
    assert!(
        c.store.active_set(u).await.expect("set").is_empty(),
        "its quota slot is given back"
    );
    c.shutdown().await;
}

// -------------------------------------------------------------------------------------------------------------
// Fairness at admission
// -------------------------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_user_flooding_is_rate_limited_without_starving_another() {
    let c = Cluster::start("api-fair", 0, 0, &[]).await;
    let client = connect(&c.nats, Role::Front).await;
    let store = Store::open(
        async_nats::jetstream::new(client.clone()),
        StoreSettings::default(),
    )
    .await
    .unwrap();
    let verifier = fleet_client::auth::Verifier::new(
        vec![c.key.verify_key().unwrap()],
        DEFAULT_ISSUER,
        DEFAULT_AUDIENCE,
    )
    .unwrap();
    // A tight per-user budget: a burst of 3, refilled at 1 per second.
    let config = fleet::front::FrontConfig {
        rate_per_user: 1,
        burst_per_user: 3,
        ..fleet::front::FrontConfig::default()
    };
    let seals = std::sync::Arc::new(c.nats.exec_signer().unwrap());
    let front = fleet::front::Front::new(
        client.clone(),
        store.clone(),
        verifier.clone(),
        config,
        seals.clone(),
    );
    let flood = format!("Bearer {}", c.token("flooder"));
    let quiet = format!("Bearer {}", c.token("quiet"));
    let mut outcomes = Vec::new();
    for _ in 0..10 {
        outcomes.push(front.handle(methods::TOOLS_LIST, Some(&flood), b"{}").await);
    }
    let limited = outcomes
        .iter()
        .filter(|o| matches!(o, ApiResponse::Err(e) if e.code == ApiErrorCode::RateLimited))
        .count();
    assert!(
        limited >= 6,
        "the burst of 3 (plus at most a refill or so) passes, the rest is rate_limited: {limited}"
    );
    // Another user's budget is untouched.
    for _ in 0..3 {
        assert!(matches!(
            front.handle(methods::TOOLS_LIST, Some(&quiet), b"{}").await,
            ApiResponse::Ok(_)
        ));
    }
    // The limiter's housekeeping keeps both (their buckets refill over seconds)...
    assert_eq!(front.prune_rate_limits(), 2);
    // ...and forgets users whose buckets are full again: the limiter holds the users of the last moments, not
    // every user it ever saw (a bucket of one, refilled every millisecond, is full again 2 ms after its use).
    let brief = fleet::front::FrontConfig {
        rate_per_user: 1000,
        burst_per_user: 1,
        ..fleet::front::FrontConfig::default()
    };
    let front = fleet::front::Front::new(client, store, verifier, brief, seals);
    for i in 0..20 {
        let token = format!("Bearer {}", c.token(&format!("passer-{i}")));
        assert!(matches!(
            front.handle(methods::TOOLS_LIST, Some(&token), b"{}").await,
            ApiResponse::Ok(_)
        ));
    }
    let deadline = std::time::Instant::now() + GUARD;
    while front.prune_rate_limits() > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "failure guard: idle users never forgotten"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    c.shutdown().await;
}

/// Sends each of `bodies` as a sync invoke of `user` in a task of its own, and returns once the first front
/// handles all of them (the calls wait there until a worker registers).
async fn hold_invokes(
    c: &Cluster,
    user: &str,
    bodies: Vec<Value>,
) -> Vec<tokio::task::JoinHandle<Result<Value, ApiError>>> {
    let n = bodies.len();
    let held = bodies
        .into_iter()
        .map(|body| {
            let (app, token) = (c.app.clone(), c.token(user));
            tokio::spawn(async move {
                fleet_client::api::request(&app, &token, subjects::api(methods::TOOLS_INVOKE), &body, GUARD)
                    .await
            })
        })
        .collect();
    let deadline = Instant::now() + GUARD;
    while c.fronts[0].0.in_flight_of(user) < n {
        assert!(
            Instant::now() < deadline,
            "failure guard: the calls never reached the front"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    held
}

/// A user holds at most `max_in_flight_per_user` API requests on a front at once: one more is `rate_limited` at
/// once with `details.max_in_flight` (never queued), another user is not held back, and room frees as calls end.
/// The held calls are sync invokes waiting for a worker to register (none is, until the test adds one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_holds_at_most_max_in_flight_requests_on_a_front() {
    let mut c = Cluster::start("api-inflight", 0, 0, &[echo()]).await;
    c.add_front_with(fleet::front::FrontConfig {
        max_in_flight_per_user: 2,
        no_worker_wait: GUARD,
        ..fleet::front::FrontConfig::default()
    })
    .await;
    c.wait_for_api(GUARD).await;
    let bodies = (0..2).map(|n| json!({"tool_id": "echo.echo", "args": {"n": n}}));
    let held = hold_invokes(&c, "holder", bodies.collect()).await;
    let e = expect_err(
        &c,
        "holder",
        methods::TOOLS_LIST,
        json!({}),
        ApiErrorCode::RateLimited,
    )
    .await;
    assert_eq!(e.details, Some(json!({"max_in_flight": 2})), "{e:?}");
    c.ok("bystander", methods::TOOLS_LIST, json!({})).await;
    // A worker registers: the held calls are served, and the user has room again.
    c.add_worker().await;
    for call in held {
        let answer = tokio::time::timeout(GUARD, call)
            .await
            .expect("failure guard")
            .unwrap();
        assert!(answer.is_ok(), "{answer:?}");
    }
    c.ok("holder", methods::TOOLS_LIST, json!({})).await;
    assert_eq!(c.fronts[0].0.in_flight_of("holder"), 0);
    c.shutdown().await;
}

/// A user's requests on a front are bounded in bytes as well as in count (`max_bytes_in_flight_per_user`): two
/// held sync invokes exactly at the byte cap are admitted, one more request (even a 2-byte `tools.list`) is
/// `rate_limited` at once with `{max_bytes_in_flight, bytes_in_flight}`, another user is not held back, and the
/// bytes are given back as the calls end. The held calls wait for a worker to register.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_holds_at_most_max_bytes_in_flight_on_a_front() {
    let mut c = Cluster::start("api-inflight-bytes", 0, 0, &[echo()]).await;
    let bodies: Vec<Value> = (0..2)
        .map(|n| json!({"tool_id": "echo.echo", "args": {"n": n, "s": "x".repeat(1000 * (n + 1))}}))
        .collect();
    let max = bodies.iter().map(|b| b.to_string().len()).sum::<usize>();
    c.add_front_with(fleet::front::FrontConfig {
        max_bytes_in_flight_per_user: max,
        no_worker_wait: GUARD,
        ..fleet::front::FrontConfig::default()
    })
    .await;
    c.wait_for_api(GUARD).await;
    let held = hold_invokes(&c, "heavy", bodies).await;
    assert_eq!(c.fronts[0].0.bytes_in_flight_of("heavy"), max);
    let e = expect_err(
        &c,
        "heavy",
        methods::TOOLS_LIST,
        json!({}),
        ApiErrorCode::RateLimited,
    )
    .await;
    assert_eq!(
        e.details,
        Some(json!({"max_bytes_in_flight": max, "bytes_in_flight": max})),
        "{e:?}"
    );
    c.ok("light", methods::TOOLS_LIST, json!({})).await;
    c.add_worker().await;
    for call in held {
        let answer = tokio::time::timeout(GUARD, call)
            .await
            .expect("failure guard")
            .unwrap();
        assert!(answer.is_ok(), "{answer:?}");
    }
    // Given back when the front has each call's outcome, which may be just after its worker answered the caller
    // directly.
    let front = c.fronts[0].0.clone();
    assert!(
        fleet_e2e::worker::eventually(GUARD, || front.bytes_in_flight_of("heavy") == 0).await,
        "the held calls' bytes were not given back"
    );
    c.ok("heavy", methods::TOOLS_LIST, json!({})).await;
    c.shutdown().await;
}

/// A request's arguments are capped before they are parsed (`max_args_bytes`): a sync invoke of exactly the cap
/// runs, one byte more is `invalid_arg` with `{field: "args", reason: "args_too_large", size, max}` — also when
/// the bytes are not JSON at all (the size is judged first), over NATS and in-process alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_over_the_args_cap_is_refused_before_it_is_parsed() {
    const MAX: usize = 1000;
    let mut c = Cluster::start("api-args-cap", 0, 1, &[echo()]).await;
    c.add_front_with(fleet::front::FrontConfig {
        max_args_bytes: MAX,
        ..fleet::front::FrontConfig::default()
    })
    .await;
    c.wait_for_api(GUARD).await;
    // `{"tool_id":"echo.echo","args":{"s":"xx…"}}` of exactly `len` bytes.
    let sized = |len: usize| -> Value {
        let frame = json!({"tool_id": "echo.echo", "args": {"s": ""}})
            .to_string()
            .len();
        json!({"tool_id": "echo.echo", "args": {"s": "x".repeat(len - frame)}})
    };
    assert_eq!(sized(MAX).to_string().len(), MAX);
    let at_cap = c.ok("capped", methods::TOOLS_INVOKE, sized(MAX)).await;
    assert_eq!(at_cap, json!({"arguments": sized(MAX)["args"]}));
    let over = expect_err(
        &c,
        "capped",
        methods::TOOLS_INVOKE,
        sized(MAX + 1),
        ApiErrorCode::InvalidArg,
    )
    .await;
    assert_eq!(
        over.details,
        Some(json!({"field": "args", "reason": "args_too_large", "size": MAX + 1, "max": MAX})),
        "{over:?}"
    );
    let token = format!("Bearer {}", c.token("capped"));
    let front = &c.fronts[0].0;
    let not_json = vec![b'['; MAX + 1];
    match front.handle(methods::TOOLS_INVOKE, Some(&token), &not_json).await {
        ApiResponse::Err(e) => assert_eq!(
            e.details,
            Some(json!({"field": "args", "reason": "args_too_large", "size": MAX + 1, "max": MAX})),
            "{e:?}"
        ),
        other => panic!("{other:?}"),
    }
    match front
        .handle(methods::TOOLS_INVOKE, Some(&token), &not_json[..MAX])
        .await
    {
        ApiResponse::Err(e) => assert!(e.message.starts_with("arguments are not JSON"), "{e:?}"),
        other => panic!("{other:?}"),
    }
    c.shutdown().await;
}

/// A worker answers an app's sync call on the app's own reply subject (one hop fewer than through the front),
/// with exactly the envelope the front gives: the same call answered directly over NATS and by the front
/// in-process (`Front::handle`, the HTTP gateway's path, never direct) gives byte-identical JSON for a result, a
/// tool failure, a plugin's JSON-RPC error and an invalid tool; each NATS call counts one direct reply; the
/// front still counts every call's outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_answers_an_apps_sync_call_directly_with_the_fronts_envelope() {
    let c = start("api-direct", 1, 1, &[echo()]).await;
    let direct = |text: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix("cloud_agents_direct_replies_total "))
            .map_or(0, |v| v.trim().parse().unwrap())
    };
    let token = format!("Bearer {}", c.token("direct"));
    let calls = [
        json!({"tool_id": "echo.echo", "args": {"n": 1, "s": "x"}}),
        json!({"tool_id": "echo.fail", "args": {"message": "the disk is on fire"}}),
        json!({"tool_id": "echo.rpc_error", "args": {"code": -32042, "message": "nope"}}),
        json!({"tool_id": "echo.no_such_tool"}),
    ];
    let front = &c.fronts[0].0;
    for (i, args) in calls.iter().enumerate() {
        let before = direct(&c.metrics.encode());
        let over_nats = c
            .call_with_token(&token, methods::TOOLS_INVOKE, args.clone())
            .await;
        assert_eq!(
            direct(&c.metrics.encode()),
            before + 1,
            "call {i} ({args}) was answered by its worker"
        );
        let by_front = front
            .handle(methods::TOOLS_INVOKE, Some(&token), args.to_string().as_bytes())
            .await;
        assert_eq!(
            direct(&c.metrics.encode()),
            before + 1,
            "the front's own path is not direct"
        );
        assert_eq!(
            serde_json::to_string(&over_nats).unwrap(),
            serde_json::to_string(&by_front).unwrap(),
            "call {i} ({args})"
        );
    }
    let text = c.metrics.encode();
    for code in ["ok", "tool_failed", "executa_error", "invalid_arg"] {
        assert!(
            text.lines()
                .any(|l| l.starts_with("cloud_agents_api_requests_total{")
                    && l.contains("tools.invoke")
                    && l.contains(&format!("\"{code}\""))),
            "the front counted the {code} outcome:\n{text}"
        );
    }
    c.shutdown().await;
}
