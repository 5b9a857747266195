//! Delegated tool calls (issue 17; ARCHITECTURE.md "Delegated tool calls"): what a worker credential — the one a
//! compromised worker holds — can and cannot do with the delegation a front minted for one invoke, against real
//! fronts, a real worker and a real nats-server. The delegation names the user; the call cannot. It works only
//! while its invoke runs, before its deadline, on the front that minted it, for tools the user's grant lets the
//! holder plugin's agent sessions call (never the holder itself), and never deeper than the cap. A job's
//! delegation is served by any front, also after the one that accepted the job restarted, while the job runs.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use fleet::delegation::Delegated;
use fleet_e2e::cluster::{Cluster, Role, connect};
use fleet_e2e::worker::Plugin;
use fleet_proto::api::delegation::{self, DelegatedCall, DelegationToken};
use fleet_proto::api::{ApiErrorCode, ApiResponse};
use fleet_proto::limits::AGENT_DELEGATION_MAX_DEPTH;
use fleet_proto::util::now_ms;
use fleet_services::grants::{GrantSettings, GrantStore};
use fleet_store::StoreSettings;
use serde_json::{Value, json};

const GUARD: Duration = Duration::from_secs(60);
/// The plugin whose invoke holds the delegation.
const HOLDER: &str = "agent-x";

async fn delegated(
    client: &async_nats::Client,
    subject_of: &DelegationToken,
    token: &DelegationToken,
    method: &str,
    args: Value,
) -> ApiResponse<Value> {
    let subject = delegation::subject(subject_of.front_id().unwrap(), method);
    let call = DelegatedCall {
        delegation: token.clone(),
        args,
    };
    let reply = tokio::time::timeout(
        GUARD,
        client.request(subject, serde_json::to_vec(&call).unwrap().into()),
    )
    .await
    .expect("failure guard")
    .expect("an answer");
    serde_json::from_slice(&reply.payload).unwrap()
}

#[track_caller]
fn refused(r: &ApiResponse<Value>) -> String {
    match r {
        ApiResponse::Err(e) => {
            assert_eq!(e.code, ApiErrorCode::PermissionDenied, "{e:?}");
            e.message.clone()
        }
        ApiResponse::Ok(v) => panic!("expected permission_denied, got {v}"),
    }
}

/// The grants bucket of `c`.
async fn grants_of(c: &Cluster) -> GrantStore {
    GrantStore::open(
        &async_nats::jetstream::new(c.client.clone()),
        &StoreSettings::default(),
    )
    .await
    .unwrap()
}

/// Alice grants `holder` `llm.sample` and `llm.agent.auto`, its agent sessions limited to `tools` (one pattern).
async fn grant_agent(grants: &GrantStore, holder: &str, tools: &str) {
    grants
        .edit_with(
            "alice",
            holder,
            &["llm.sample".into(), "llm.agent.auto".into()],
            &[],
            GrantSettings {
                granted_tools: Some(&[tools.into()]),
                ..GrantSettings::default()
            },
        )
        .await
        .unwrap();
}

fn invoke(tool_id: &str) -> Value {
    json!({"tool_id": tool_id, "method": "echo", "args": {"n": 1}})
}

fn what(depth: u32, deadline_ms: u64) -> Delegated {
    Delegated {
        user: "alice".into(),
        plugin: HOLDER.into(),
        invoke_id: format!("inv-parent-{depth}"),
        deadline_ms,
        depth,
        window_tools: None,
    }
}

#[tokio::test]
async fn a_delegation_acts_only_as_its_user_within_its_grant_and_its_invoke() {
    let c = Cluster::start(
        "delegation",
        2,
        1,
        &[Plugin::echo("echo-a", &[]), Plugin::echo("echo-b", &[])],
    )
    .await;
    c.wait_for_api(GUARD).await;
    c.wait_listed(&["echo-a", "echo-b"], GUARD).await;
    let grants = grants_of(&c).await;
    // What a compromised worker holds.
    let worker = connect(&c.nats, Role::Worker).await;
    let front = &c.fronts[0].0;
    let live = front.delegations().mint(what(0, now_ms() + 60_000)).unwrap();
    let token = live.token.clone();
    let call = |method: &'static str, args: Value| {
        let (worker, token) = (worker.clone(), token.clone());
        async move { delegated(&worker, &token, &token, method, args).await }
    };

    // Without llm.agent.auto granted to the holder, nothing.
    refused(&call("tools.list", json!({})).await);
    refused(&call("tools.invoke", invoke("echo-a")).await);

    // Granted, with its sessions limited to echo-a.
    grant_agent(&grants, HOLDER, "echo-a").await;
    let listed = match call("tools.list", json!({})).await {
        ApiResponse::Ok(v) => v,
        ApiResponse::Err(e) => panic!("{e:?}"),
    };
    let ids: Vec<&str> = listed["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["tool_id"].as_str().unwrap())
        .collect();
    assert!(!ids.is_empty() && ids.iter().all(|t| *t == "echo-a"), "{listed}");
    match call("tools.invoke", invoke("echo-a")).await {
        ApiResponse::Ok(v) => assert_eq!(v["arguments"], json!({"n": 1})),
        ApiResponse::Err(e) => panic!("{e:?}"),
    }
    // Outside the grant's tools.
    let why = refused(&call("tools.invoke", invoke("echo-b")).await);
    assert!(why.contains("echo-b"), "{why}");
    // The holder itself, even when the grant would cover it.
    grants
        .edit_with(
            "alice",
            HOLDER,
            &[],
            &[],
            GrantSettings {
                granted_tools: Some(&["*".into()]),
                ..GrantSettings::default()
            },
        )
        .await
        .unwrap();
    refused(&call("tools.invoke", invoke(HOLDER)).await);
    match call("tools.invoke", invoke("echo-b")).await {
        ApiResponse::Ok(_) => {}
        ApiResponse::Err(e) => panic!("{e:?}"),
    }
    // The call cannot name another user: the only user is the delegation's.
    let as_bob = json!({"tool_id": "echo-a", "method": "echo", "args": {}, "user": "bob"});
    if let ApiResponse::Ok(v) = call("tools.invoke", as_bob).await {
        assert_eq!(v["arguments"], json!({}), "{v}");
    }

    // Forged, and another front's delegation on this front's subject.
    let forged = DelegationToken(format!("{}.{}", front.delegations().front_id(), "ab".repeat(32)));
    refused(&delegated(&worker, &forged, &forged, "tools.invoke", invoke("echo-a")).await);
    let other = c.fronts[1]
        .0
        .delegations()
        .mint(what(0, now_ms() + 60_000))
        .unwrap();
    refused(&delegated(&worker, &token, &other.token, "tools.invoke", invoke("echo-a")).await);

    // Depth: a delegation one level down still works (its child is at the cap and gets none); at the cap there
    // is no delegation to mint.
    let deep = front
        .delegations()
        .mint(what(AGENT_DELEGATION_MAX_DEPTH - 1, now_ms() + 60_000))
        .unwrap();
    match delegated(
        &worker,
        &deep.token,
        &deep.token,
        "tools.invoke",
        invoke("echo-a"),
    )
    .await
    {
        ApiResponse::Ok(_) => {}
        ApiResponse::Err(e) => panic!("{e:?}"),
    }
    assert!(
        front
            .delegations()
            .mint(what(AGENT_DELEGATION_MAX_DEPTH, now_ms() + 60_000))
            .is_none()
    );

    // Past its deadline.
    let late = front.delegations().mint(what(0, now_ms())).unwrap();
    let why = refused(
        &delegated(
            &worker,
            &late.token,
            &late.token,
            "tools.invoke",
            invoke("echo-a"),
        )
        .await,
    );
    assert!(why.contains("deadline"), "{why}");

    // Revoking llm.agent.auto applies to a live delegation at once.
    grants
        .edit("alice", HOLDER, &[], &["llm.agent.auto".into()])
        .await
        .unwrap();
    refused(&call("tools.invoke", invoke("echo-a")).await);
    grants
        .edit("alice", HOLDER, &["llm.agent.auto".into()], &[])
        .await
        .unwrap();

    // The invoke ended: the same delegation is replayed in vain.
    drop(live);
    let why = refused(&call("tools.invoke", invoke("echo-a")).await);
    assert!(why.contains("ended"), "{why}");
    assert_eq!(front.delegations().live(), 2, "deep and late are still alive");

    // An app credential cannot even publish on the delegated subjects.
    let app = connect(&c.nats, Role::App).await;
    let subject = delegation::subject(front.delegations().front_id(), "tools.list");
    let attempt = tokio::time::timeout(
        GUARD,
        app.request(
            subject,
            serde_json::to_vec(&DelegatedCall {
                delegation: deep.token.clone(),
                args: json!({}),
            })
            .unwrap()
            .into(),
        ),
    )
    .await
    .expect("failure guard");
    assert!(
        attempt.is_err(),
        "an app reached a delegated subject: {attempt:?}"
    );
}

#[tokio::test]
async fn every_sync_invoke_carries_a_delegation_that_ends_with_it() {
    use futures::StreamExt as _;

    let c = Cluster::start("delegation-life", 1, 1, &[Plugin::echo("echo-a", &[])]).await;
    c.wait_for_api(GUARD).await;
    let front = &c.fronts[0].0;
    let spy = connect(&c.nats, Role::Worker).await;
    let mut exec = spy.subscribe("fleet.v1.worker.*.exec").await.unwrap();
    fleet_client::nats_conn::round_trip(&spy).await.unwrap();
    let out = c
        .ok(
            "alice",
            "tools.invoke",
            json!({"tool_id": "echo-a", "method": "echo", "args": {"x": 1}}),
        )
        .await;
    assert_eq!(out["arguments"], json!({"x": 1}));
    let sent = tokio::time::timeout(GUARD, exec.next())
        .await
        .expect("failure guard")
        .unwrap();
    let request: Value = serde_json::from_slice(&sent.payload).unwrap();
    let token = DelegationToken(request["delegation"].as_str().expect("a delegation").to_owned());
    assert_eq!(token.front_id(), Some(front.delegations().front_id()));
    // Revoked once the front has the invoke's outcome (the worker may have answered the app a moment before).
    assert!(
        fleet_e2e::worker::eventually(GUARD, || front.delegations().live() == 0).await,
        "the delegation outlived its invoke"
    );
    refused(&delegated(&spy, &token, &token, "tools.list", json!({})).await);
}

/// Waits until `job` of alice is in `state` (polling its record: a test's wait, bounded by the guard).
async fn job_in(
    c: &Cluster,
    job: &fleet_proto::api::JobId,
    state: fleet_proto::api::JobState,
) -> fleet_store::JobRecord {
    let deadline = std::time::Instant::now() + GUARD;
    loop {
        if let Some(r) = c.store.get_job("alice", job).await.unwrap()
            && r.value.state == state
        {
            return r.value;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "failure guard: {job} never {state:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A job (`tools.invokeAsync`) carries a delegation too, which any front resolves (the job outlives the front
/// that accepted it): recorded before the job is dispatched, in the job's record for the worker that starts it
/// (never in its snapshot), refused like a sync one outside its grant, for the holder itself, forged, and once
/// its job is terminal — whether a front ended it (cancel) or its worker did (its outcome).
#[tokio::test]
async fn a_jobs_delegation_is_served_by_any_front_until_the_job_ends() {
    use fleet_proto::api::{JobId, JobState};
    let mut c = Cluster::start(
        "delegation-jobs",
        1,
        1,
        &[
            Plugin::echo(HOLDER, &[]),
            Plugin::echo("echo-a", &[]),
            Plugin::echo("echo-b", &[]),
        ],
    )
    .await;
    c.wait_for_api(GUARD).await;
    c.wait_listed(&[HOLDER, "echo-a", "echo-b"], GUARD).await;
    let grants = grants_of(&c).await;
    grant_agent(&grants, HOLDER, "echo-a").await;
    let worker = connect(&c.nats, Role::Worker).await;
    let sleeping =
        |ms: u64| json!({"tool_id": HOLDER, "method": "sleep", "args": {"ms": ms}, "timeoutMs": 120_000});
    let accepted = c.ok("alice", "tools.invokeAsync", sleeping(60_000)).await;
    let job: JobId = serde_json::from_value(accepted["jobId"].clone()).unwrap();
    let record = job_in(&c, &job, JobState::Running).await;
    let token = record
        .delegation
        .clone()
        .expect("the job's delegation is in its record");
    assert_eq!(token.front_id(), Some(delegation::JOBS));
    // Never in what the API shows.
    let snapshot = c.ok("alice", "tools.getJob", json!({"jobId": job})).await;
    assert!(!snapshot.to_string().contains(&token.0), "{snapshot}");
    let call = |method: &'static str, args: Value| {
        let (worker, token) = (worker.clone(), token.clone());
        async move { delegated(&worker, &token, &token, method, args).await }
    };
    match call("tools.invoke", invoke("echo-a")).await {
        ApiResponse::Ok(v) => assert_eq!(v["arguments"], json!({"n": 1})),
        ApiResponse::Err(e) => panic!("{e:?}"),
    }
    let listed = match call("tools.list", json!({})).await {
        ApiResponse::Ok(v) => v,
        ApiResponse::Err(e) => panic!("{e:?}"),
    };
    assert!(
        listed["tools"]
            .as_array()
            .unwrap()
            .iter()
            .all(|t| t["tool_id"] == "echo-a"),
        "{listed}"
    );
    // The sync path's refusals hold for a job's delegation.
    refused(&call("tools.invoke", invoke("echo-b")).await);
    refused(&call("tools.invoke", invoke(HOLDER)).await);
    let forged = DelegationToken(format!("{}.{}", delegation::JOBS, "ab".repeat(32)));
    let why = refused(&delegated(&worker, &forged, &forged, "tools.invoke", invoke("echo-a")).await);
    assert!(why.contains("ended"), "{why}");
    grants
        .edit("alice", HOLDER, &[], &["llm.agent.auto".into()])
        .await
        .unwrap();
    refused(&call("tools.invoke", invoke("echo-a")).await);
    grants
        .edit("alice", HOLDER, &["llm.agent.auto".into()], &[])
        .await
        .unwrap();

    // The front that accepted the job restarts: the next front serves the delegation.
    let (front, service) = c.fronts.remove(0);
    service.stop().await;
    drop(front);
    c.add_front().await;
    match call("tools.invoke", invoke("echo-a")).await {
        ApiResponse::Ok(v) => assert_eq!(v["arguments"], json!({"n": 1})),
        ApiResponse::Err(e) => panic!("after a front restart: {e:?}"),
    }

    // Cancelled (a front's terminal step): refused at once, its record deleted.
    c.ok("alice", "tools.cancelJob", json!({"jobId": job})).await;
    let why = refused(&call("tools.invoke", invoke("echo-a")).await);
    assert!(why.contains("ended"), "{why}");

    // A job its worker ends (succeeded): refused too.
    let accepted = c.ok("alice", "tools.invokeAsync", sleeping(1)).await;
    let quick: JobId = serde_json::from_value(accepted["jobId"].clone()).unwrap();
    let done = job_in(&c, &quick, JobState::Succeeded).await;
    let ended = done.delegation.expect("a delegation");
    let why = refused(&delegated(&worker, &ended, &ended, "tools.invoke", invoke("echo-a")).await);
    assert!(why.contains("ended"), "{why}");
}

/// Delegations cannot widen a window (issue 43, review 2 finding 10): an invoke made through an app window whose
/// token allows `echo-h` and `echo-a` carries that allow-list into its delegation — a sync invoke's and a job's —
/// so the holder's agent sessions reach `echo-a` but not `echo-b` (refused, and not listed), even with a grant of
/// every tool. An app's own invoke (no window) is narrowed by the grant only.
#[tokio::test]
async fn a_delegation_made_under_a_window_reaches_only_what_the_window_allows() {
    use fleet::http::window::WindowToken;
    use futures::StreamExt as _;

    let c = Cluster::start(
        "delegation-window",
        1,
        1,
        &[
            Plugin::echo("echo-h", &[]),
            Plugin::echo("echo-a", &[]),
            Plugin::echo("echo-b", &[]),
        ],
    )
    .await;
    c.wait_for_api(GUARD).await;
    c.wait_listed(&["echo-h", "echo-a", "echo-b"], GUARD).await;
    let grants = grants_of(&c).await;
    grant_agent(&grants, "echo-h", "*").await;
    let state = c.http_state(fleet::http::HttpConfig::default()).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}/v1/rpc", listener.local_addr().unwrap());
    let _gateway = AbortOnDrop(tokio::spawn(fleet::http::serve(listener, state)));
    let allowed = vec!["echo-h".to_owned(), "required:echo-a".to_owned()];
    let window = WindowToken {
        user: "alice",
        window: "w-1",
        app: "app-1",
        version: "v1",
        tools: Some(&allowed),
        ttl: Duration::from_secs(120),
    }
    .mint(&c.key, None)
    .unwrap();
    let spy = connect(&c.nats, Role::Worker).await;
    let mut exec = spy.subscribe("fleet.v1.worker.*.exec").await.unwrap();
    fleet_client::nats_conn::round_trip(&spy).await.unwrap();

    // A sync invoke of echo-h through the window, held open while its delegation is used.
    let body = json!({"id": "1", "window_uuid": "w-1", "ns": "tools", "method": "invoke",
        "args": {"tool_id": "echo-h", "method": "sleep", "args": {"ms": 80_000}, "timeout_ms": 90_000}});
    let http = reqwest::Client::new();
    let request = http.post(&base).bearer_auth(&window).json(&body);
    let _held = AbortOnDrop(tokio::spawn(async move { request.send().await.map(drop) }));
    let sent = tokio::time::timeout(GUARD, exec.next())
        .await
        .expect("failure guard")
        .unwrap();
    let request: Value = serde_json::from_slice(&sent.payload).unwrap();
    let token = DelegationToken(request["delegation"].as_str().expect("a delegation").to_owned());
    let ids = |v: &Value| -> Vec<String> {
        v["tools"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["tool_id"].as_str().unwrap().to_owned())
            .collect()
    };
    match delegated(&spy, &token, &token, "tools.list", json!({})).await {
        ApiResponse::Ok(v) => assert!(
            !ids(&v).is_empty() && ids(&v).iter().all(|t| t == "echo-a"),
            "{v}"
        ),
        ApiResponse::Err(e) => panic!("{e:?}"),
    }
    match delegated(&spy, &token, &token, "tools.invoke", invoke("echo-a")).await {
        ApiResponse::Ok(v) => assert_eq!(v["arguments"], json!({"n": 1})),
        ApiResponse::Err(e) => panic!("{e:?}"),
    }
    let why = refused(&delegated(&spy, &token, &token, "tools.invoke", invoke("echo-b")).await);
    assert!(why.contains("window"), "{why}");

    // A job made through the window: its recorded delegation carries the same list, on any front.
    let body = json!({"id": "2", "window_uuid": "w-1", "ns": "tools", "method": "invokeAsync",
        "args": {"tool_id": "echo-h", "method": "sleep", "args": {"ms": 80_000}, "timeout_ms": 90_000}});
    let made: Value = http
        .post(&base)
        .bearer_auth(&window)
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let job: fleet_proto::api::JobId =
        serde_json::from_value(made["result"]["jobId"].clone()).unwrap_or_else(|e| panic!("{e}: {made}"));
    let record = job_in(&c, &job, fleet_proto::api::JobState::Running).await;
    let jobs = record.delegation.expect("the job's delegation");
    match delegated(&spy, &jobs, &jobs, "tools.invoke", invoke("echo-a")).await {
        ApiResponse::Ok(v) => assert_eq!(v["arguments"], json!({"n": 1})),
        ApiResponse::Err(e) => panic!("{e:?}"),
    }
    let why = refused(&delegated(&spy, &jobs, &jobs, "tools.invoke", invoke("echo-b")).await);
    assert!(why.contains("window"), "{why}");

    // The same user's invoke made by the app itself (no window): the grant alone decides; echo-b is reached.
    let own = front_invoke_delegation(&c, &mut exec).await;
    match delegated(&spy, &own, &own, "tools.invoke", invoke("echo-b")).await {
        ApiResponse::Ok(v) => assert_eq!(v["arguments"], json!({"n": 1})),
        ApiResponse::Err(e) => panic!("{e:?}"),
    }
}

/// Starts a held sync invoke of `echo-h` by alice's app (over NATS, no window) and answers its delegation.
async fn front_invoke_delegation(c: &Cluster, exec: &mut async_nats::Subscriber) -> DelegationToken {
    use futures::StreamExt as _;
    let request = fleet_client::api::api_request(
        &format!("Bearer {}", c.token("alice")),
        &json!({"tool_id": "echo-h", "method": "sleep", "args": {"ms": 80_000}, "timeout_ms": 90_000}),
        GUARD,
    );
    let app = c.app.clone();
    let subject = fleet_proto::api::subjects::api(fleet_proto::api::methods::TOOLS_INVOKE);
    tokio::spawn(async move { app.send_request(subject, request).await.map(drop) });
    // The first sync request of echo-h (the delegated calls' and the job's went out on the same subjects before).
    loop {
        let sent = tokio::time::timeout(GUARD, exec.next())
            .await
            .expect("failure guard")
            .unwrap();
        let request: Value = serde_json::from_slice(&sent.payload).unwrap();
        if let Some(d) = request["delegation"].as_str()
            && request["plugin"] == "echo-h"
            && !d.starts_with(&format!("{}.", delegation::JOBS))
        {
            return DelegationToken(d.to_owned());
        }
    }
}

struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}
