//! Membership under change (the churn issue): a draining worker finishes what it runs while the next ranked
//! worker takes every new call, and a call that finds no worker waits for one to register instead of failing.
//!
//! Every wait polls an observable under a failure guard; no test asserts on elapsed time.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use fleet::dispatch::rank;
use fleet::front::FrontConfig;
use fleet::node::DRAIN_GRACE;
use fleet_client::api::{api_request, bearer};
use fleet_e2e::cluster::Cluster;
use fleet_e2e::worker::Plugin;
use fleet_proto::api::user_key;
use fleet_proto::api::{ApiResponse, methods, subjects};
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

/// A sync invoke of the echo fixture over its own request (so it can run in a task).
async fn invoke(client: async_nats::Client, token: String, method: &str, args: Value) -> ApiResponse<Value> {
    let body = json!({ "tool_id": "echo", "method": method, "args": args });
    let request = api_request(&bearer(&token), &body, GUARD);
    let msg = client
        .send_request(subjects::api(methods::TOOLS_INVOKE), request)
        .await
        .expect("an answer");
    serde_json::from_slice(&msg.payload).expect("an envelope")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_worker_finishes_its_calls_while_the_next_worker_takes_new_ones() {
    let mut c = Cluster::start("churn-drain", 1, 2, &[Plugin::echo("echo", &[])]).await;
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
    let (fi, other) = if ids[0] == first { (0, 1) } else { (1, 0) };

    // A long call runs on the first-ranked worker…
    let long = tokio::spawn(invoke(
        c.app.clone(),
        c.token(USER),
        "sleep",
        json!({ "ms": 1500 }),
    ));
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
    let call = tokio::spawn(invoke(
        c.app.clone(),
        c.token(USER),
        "echo",
        json!({ "waited": true }),
    ));
    // The front holds the call (it found no worker and waits for membership to change)…
    until("the front holding the call", async || {
        (c.fronts[0].1.in_flight() == 1).then_some(())
    })
    .await;
    // …and a worker that registers takes it.
    c.add_worker().await;
    match call.await.unwrap() {
        ApiResponse::Ok(v) => assert_eq!(v, json!({ "arguments": { "waited": true } })),
        ApiResponse::Err(e) => panic!("the call did not wait for the new worker: {e}"),
    }
    c.shutdown().await;
}
