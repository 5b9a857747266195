//! Membership under change (the churn issue): a draining worker finishes what it runs while the next ranked
//! worker takes every new call, and a call that finds no worker waits for one to register instead of failing.
//!
//! Every wait polls an observable under a failure guard; no test asserts on elapsed time.
#![allow(clippy::unwrap_used)]

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use fleet::dispatch::rank;
use fleet::front::FrontConfig;
use fleet::node::DRAIN_GRACE;
use fleet_client::api::{ApiClient, CallError, api_request, bearer};
use fleet_e2e::cluster::Cluster;
use fleet_e2e::hang_report;
use fleet_e2e::worker::Plugin;
use fleet_proto::api::user_key;
use fleet_proto::api::{ApiResponse, InvokeArgs, InvokeAsyncArgs, methods, subjects};
use serde_json::{Value, json};

/// Failure guard only.
const GUARD: Duration = Duration::from_secs(60);

const USER: &str = "alice";

async fn until<T>(what: &str, mut f: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + GUARD;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "failure guard: {what} did not happen within {GUARD:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `user`'s client on the cluster's app connection; a call waits for its answer for its whole wait.
fn client(c: &Cluster, user: &str) -> ApiClient {
    ApiClient::new(c.app.clone(), c.token(user)).waiting_through_reconnects()
}

/// The fleet's answer, or a panic when there was none.
fn answer<T>(r: Result<T, CallError>) -> ApiResponse<T> {
    match r {
        Ok(v) => ApiResponse::Ok(v),
        Err(CallError::Api(e)) => ApiResponse::Err(e),
        Err(e) => panic!("an answer: {e}"),
    }
}

/// A sync invoke of the echo fixture (owning its client, so it can run in a task).
async fn invoke(client: ApiClient, method: &str, args: Value) -> ApiResponse<Value> {
    let args = InvokeArgs {
        tool_id: "echo".into(),
        method: Some(method.into()),
        args: args.as_object().cloned(),
        timeout_ms: None,
    };
    match answer(client.invoke(&args, GUARD).await) {
        ApiResponse::Ok(data) => ApiResponse::Ok(Value::Object(data)),
        ApiResponse::Err(e) => ApiResponse::Err(e),
    }
}

/// Of a two-worker cluster: the index of the worker ranked first for `USER`'s `echo`, the other's, and the first's
/// id.
fn first_ranked(c: &Cluster) -> (usize, usize, String) {
    let ids: Vec<String> = c
        .workers
        .iter()
        .map(|w| w.node.as_ref().unwrap().id().to_string())
        .collect();
    let first = rank(
        ids.iter().map(String::as_str),
        &format!("{}\u{0}echo", user_key(USER)),
    )[0]
    .clone();
    let fi = usize::from(ids[0] != first);
    (fi, 1 - fi, first)
}

/// Every request a worker's subscription already holds when it starts draining is answered — "draining" (the
/// front tries the next worker) or run —: a burst of calls meets a drain and every call succeeds. A drain that
/// waited only for "nothing in flight" could stop between two buffered requests and leave the rest unanswered
/// (seen as a sync call failing `agent_unavailable` after the keepalive silence in `rolling-workers`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_meeting_a_drain_is_answered_in_full() {
    let mut c = Cluster::start("churn-burst", 1, 2, &[Plugin::echo("echo", &[])]).await;
    let (fi, _, _) = first_ranked(&c);
    // The first-ranked worker's session is warm: the burst reaches it at once.
    assert!(matches!(
        invoke(client(&c, USER), "echo", json!({ "warm": true })).await,
        ApiResponse::Ok(_)
    ));
    // As many calls as one session takes at once (more would be refused for capacity by both workers).
    let burst = fleet_worker::config::WorkerConfig::default().max_in_flight_per_session;
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..burst {
        calls.spawn(invoke(client(&c, USER), "echo", json!({ "i": i })));
    }
    let node = c.workers[fi].node.take().unwrap();
    let drain = tokio::spawn(node.drain(DRAIN_GRACE));
    let mut answered = 0;
    while let Some(joined) = calls.join_next().await {
        match joined.unwrap() {
            ApiResponse::Ok(v) => assert!(v["arguments"]["i"].is_u64(), "{v}"),
            ApiResponse::Err(e) => panic!("a call of the burst failed during the drain: {e}"),
        }
        answered += 1;
    }
    assert_eq!(answered, burst);
    drain.await.unwrap();
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_worker_finishes_its_calls_while_the_next_worker_takes_new_ones() {
    let mut c = Cluster::start("churn-drain", 1, 2, &[Plugin::echo("echo", &[])]).await;
    let (fi, other, first) = first_ranked(&c);

    // A long call runs on the first-ranked worker…
    let long = tokio::spawn(invoke(client(&c, USER), "sleep", json!({ "ms": 1500 })));
    let pool = c.workers[fi].node.as_ref().unwrap().pool().clone();
    until("the long call reaching the plugin", async || {
        pool.session(USER, "echo")
            .ok()
            .filter(|s| s.in_flight() == 1)
            .map(|_| ())
    })
    .await;

    // …when it starts draining: it leaves the registry at once,
    let node = c.workers[fi].node.take().unwrap();
    let drain = tokio::spawn(node.drain(DRAIN_GRACE));
    until("the draining worker leaving the registry", async || {
        let live = c.store.live_workers().await.ok()?;
        (!live.iter().any(|w| w.id == first)).then_some(())
    })
    .await;

    // every new call succeeds on the other worker,
    for i in 0..10 {
        let r = c
            .ok(
                USER,
                methods::TOOLS_INVOKE,
                json!({ "tool_id": "echo", "method": "echo", "args": { "i": i } }),
            )
            .await;
        assert_eq!(r, json!({ "arguments": { "i": i } }));
    }
    let other_pool = c.workers[other].node.as_ref().unwrap().pool().clone();
    assert!(
        other_pool.session(USER, "echo").is_ok(),
        "the next ranked worker served the new calls"
    );

    // and the call it was running finishes there, with its result.
    match long.await.unwrap() {
        ApiResponse::Ok(v) => assert_eq!(v, json!({ "slept_ms": 1500 })),
        ApiResponse::Err(e) => panic!("the in-flight call failed during the drain: {e}"),
    }
    drain.await.unwrap();
    assert!(
        !pool.session(USER, "echo").is_ok_and(|s| s.pid().is_some()),
        "its plugins are stopped"
    );
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_that_finds_no_worker_waits_for_one_to_register() {
    // The front waits as long as the failure guard here (the default is NO_WORKER_WAIT; fleet_api's
    // invoke_without_workers_is_agent_unavailable checks the answer once it has passed), so how long a worker
    // takes to start on a busy machine cannot decide the outcome.
    let mut c = Cluster::start("churn-wait", 0, 0, &[Plugin::echo("echo", &[])]).await;
    c.add_front_with(FrontConfig {
        no_worker_wait: GUARD,
        ..FrontConfig::default()
    })
    .await;
    let call = tokio::spawn(invoke(client(&c, USER), "echo", json!({ "waited": true })));
    // The front holds the call (it found no worker and waits for membership to change)…
    until("the front holding the call", async || {
        (c.fronts[0].1.in_flight() == 1).then_some(())
    })
    .await;
    hang_report::milestone("the front holds the call");
    // …and a worker that registers takes it.
    c.add_worker().await;
    match call.await.unwrap() {
        ApiResponse::Ok(v) => assert_eq!(v, json!({ "arguments": { "waited": true } })),
        ApiResponse::Err(e) => panic!("the call did not wait for the new worker: {e}"),
    }
    hang_report::milestone("the call answered");
    c.shutdown().await;
}

/// What the load of [`rolling_restart_of_every_worker_under_load_fails_no_call_and_loses_no_job`] saw.
#[derive(Debug, Default)]
struct Seen {
    sync_ok: usize,
    /// Failed calls by (method, code).
    failed: std::collections::BTreeMap<(&'static str, String), usize>,
    /// Jobs whose invokeAsync was answered: (user, job id).
    accepted: Vec<(String, String)>,
}

impl Seen {
    fn failure(&mut self, method: &'static str, e: &fleet_proto::api::ApiError) {
        *self.failed.entry((method, e.code.to_string())).or_default() += 1;
    }
}

/// Steady sync and async load on the cluster's API from many users, until stopped.
struct Load {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    seen: std::sync::Arc<std::sync::Mutex<Seen>>,
    lanes: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    /// Four sync lanes (quick echoes and 200 ms sleeps, so calls are in flight at every restart) and two async
    /// lanes (300 ms jobs), each over 8 users of its own.
    fn start(c: &Cluster, prefix: &str) -> Load {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::{Arc, Mutex};
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Seen::default()));
        let mut lanes = Vec::new();
        for lane in 0..6usize {
            let (stop, seen) = (stop.clone(), seen.clone());
            let clients: Vec<(String, ApiClient)> = (0..8)
                .map(|u| {
                    let user = format!("{prefix}-{lane}-{u}");
                    let api = client(c, &user);
                    (user, api)
                })
                .collect();
            lanes.push(tokio::spawn(async move {
                let sync = lane < 4;
                let mut n = 0usize;
                while !stop.load(Ordering::SeqCst) {
                    let (user, api) = &clients[n % clients.len()];
                    n += 1;
                    if sync {
                        let (method, args) = if n.is_multiple_of(3) {
                            ("sleep", json!({ "ms": 200 }))
                        } else {
                            ("echo", json!({ "n": n }))
                        };
                        match invoke(api.clone(), method, args).await {
                            ApiResponse::Ok(_) => seen.lock().unwrap().sync_ok += 1,
                            ApiResponse::Err(e) => seen.lock().unwrap().failure("invoke", &e),
                        }
                    } else {
                        let args = InvokeAsyncArgs {
                            tool_id: "echo".into(),
                            method: Some("sleep".into()),
                            args: json!({ "ms": 300 }).as_object().cloned(),
                            timeout_ms: None,
                            client_tag: None,
                        };
                        match answer(api.invoke_async(&args, GUARD).await) {
                            ApiResponse::Ok(r) => seen
                                .lock()
                                .unwrap()
                                .accepted
                                .push((user.clone(), r.job_id.to_string())),
                            ApiResponse::Err(e) => seen.lock().unwrap().failure("invokeAsync", &e),
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            }));
        }
        Load { stop, seen, lanes }
    }

    /// (sync calls answered, jobs accepted) so far.
    fn progress(&self) -> (usize, usize) {
        let s = self.seen.lock().unwrap();
        (s.sync_ok, s.accepted.len())
    }

    /// Waits until 20 more sync calls were answered and 5 more jobs accepted.
    async fn served(&self, what: &str) {
        let (s, a) = self.progress();
        until(what, async || {
            let (s2, a2) = self.progress();
            (s2 >= s + 20 && a2 >= a + 5).then_some(())
        })
        .await;
    }

    /// Stops the load, waits for every accepted job to be terminal, prints the figures and asserts that no call
    /// failed but for the caller's own limit (5 active jobs per user) and that every accepted job succeeded.
    async fn finish(self, c: &Cluster, scenario: &str) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        for t in self.lanes {
            t.await.unwrap();
        }
        let (failed, accepted, sync_ok) = {
            let s = self.seen.lock().unwrap();
            (s.failed.clone(), s.accepted.clone(), s.sync_ok)
        };
        let mut states = std::collections::BTreeMap::<String, usize>::new();
        for (user, id) in &accepted {
            let state = until("every accepted job terminal", async || {
                match c.call(user, methods::TOOLS_GET_JOB, json!({ "jobId": id })).await {
                    ApiResponse::Ok(v) => {
                        let state = v["state"].as_str().unwrap_or_default().to_owned();
                        matches!(state.as_str(), "succeeded" | "failed" | "cancelled" | "expired")
                            .then_some(state)
                    }
                    ApiResponse::Err(e) => panic!("getJob {id}: {e}"),
                }
            })
            .await;
            *states.entry(state).or_default() += 1;
        }
        println!(
            "{scenario}: {sync_ok} sync calls answered, {} jobs accepted, failed by (method, code) {failed:?}; \
             accepted jobs by state {states:?}",
            accepted.len()
        );
        let unexpected: Vec<_> = failed
            .iter()
            .filter(|((method, code), _)| !(*method == "invokeAsync" && code == "job_quota_exceeded"))
            .collect();
        assert!(unexpected.is_empty(), "{scenario}: calls failed: {unexpected:?}");
        assert_eq!(
            states.get("succeeded"),
            Some(&accepted.len()),
            "{scenario}: every accepted job succeeded: {states:?}"
        );
    }
}

/// Chaos test 1 of the churn issue: a rolling restart of every worker, one at a time (a new worker joins, then
/// the old one drains: Kubernetes' default surge of one), under steady sync and async load from many users →
/// no sync call fails, no invokeAsync is refused for anything but the caller's own limits, and every accepted
/// job reaches a terminal state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_restart_of_every_worker_under_load_fails_no_call_and_loses_no_job() {
    let mut c = Cluster::start("churn-roll", 1, 3, &[Plugin::echo("echo", &[])]).await;
    // The sweeper runs as in production: it must not take a draining worker's running jobs for lost.
    let sweeper = tokio::spawn(fleet::sweeper::run(c.fronts[0].0.clone()));
    let load = Load::start(&c, "roll");
    load.served("load running").await;
    for old in 0..3 {
        // A new worker joins and registers…
        let new = c.add_worker().await;
        let new_id = c.workers[new].node.as_ref().unwrap().id().to_string();
        until("the new worker registered", async || {
            let live = c.store.live_workers().await.ok()?;
            live.iter().any(|w| w.id == new_id).then_some(())
        })
        .await;
        // …then the old one drains (leaves the registry, finishes its calls and jobs) and stops.
        let node = c.workers[old].node.take().unwrap();
        node.drain(DRAIN_GRACE).await;
        load.served("load served after the restart").await;
    }
    load.finish(&c, "rolling-workers").await;
    sweeper.abort();
    c.shutdown().await;
}

/// Chaos test 2 of the churn issue: the same for fronts — a new front replica starts serving, then an old one
/// stops (its service drains: no new request, every request in flight answered), every front in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_restart_of_every_front_under_load_fails_no_call_and_loses_no_job() {
    let mut c = Cluster::start("churn-fronts", 2, 2, &[Plugin::echo("echo", &[])]).await;
    let load = Load::start(&c, "rollf");
    load.served("load running").await;
    for _ in 0..2 {
        c.add_front().await;
        let (_, service) = c.fronts.remove(0);
        service.stop().await;
        load.served("load served after the restart").await;
    }
    load.finish(&c, "rolling-fronts").await;
    c.shutdown().await;
}

/// A request sent while no front listens (every replica restarting, or failing over to another NATS server):
/// `fleet_client::api::request` sends it again until a front answers (within `api::NO_FRONT_WAIT`), instead of
/// failing with "no responders" — nothing ran, so sending it again is safe. The front is added only after the
/// client's first attempt was refused (a front's start opens its store first: many JetStream round trips).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_sent_while_no_front_listens_is_answered_once_one_does() {
    let mut c = Cluster::start("churn-no-front", 0, 0, &[]).await;
    let probe = c
        .app
        .send_request(
            subjects::api(methods::TOOLS_LIST),
            api_request(&bearer(&c.token(USER)), &json!({}), Duration::from_secs(5)),
        )
        .await
        .expect_err("no front yet");
    assert_eq!(probe.kind(), async_nats::client::RequestErrorKind::NoResponders);
    // The server's "no responders" answers reach the app's connection as messages: one more than now is the
    // client's first attempt, refused.
    let refusals = || c.app.statistics().in_messages.load(Ordering::Relaxed);
    let before = refusals();
    let (app, token) = (c.app.clone(), c.token(USER));
    let ask = tokio::spawn(async move {
        fleet_client::api::request(
            &app,
            &token,
            subjects::api(methods::TOOLS_LIST),
            &json!({}),
            GUARD,
        )
        .await
    });
    until("the first attempt's refusal", async || {
        (refusals() > before).then_some(())
    })
    .await;
    c.add_front().await;
    let answer = tokio::time::timeout(GUARD, ask)
        .await
        .expect("failure guard")
        .unwrap();
    assert!(answer.is_ok(), "{answer:?}");
    c.shutdown().await;
}
