//! A plugin cannot make the worker hold more of its reverse-RPC requests than the per-session byte budget
//! ([`MAX_REVERSE_BYTES_IN_FLIGHT`]): a real plugin process writes many large requests at once to a service that
//! holds them; the requests past the budget are refused (-32603) before they are parsed, the worker's resident
//! memory stays within a bound derived from the budget, and another session is served meanwhile.
//!
//! Its own test binary: the resident memory it reads is the worker's (in this process) and nothing else's.
#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use fleet_e2e::worker::{Plugin, TestWorker, call, data, eventually, req, test_config};
use fleet_proto::limits::{MAX_FRAME_BYTES, MAX_REVERSE_BYTES_IN_FLIGHT};
use fleet_worker::metrics::WorkerMetrics;
use fleet_worker::services::{
    HostServices, InvokeTokens, ReverseCall, ServiceFuture, TokenFuture, TokenRequest, TokenSource,
};
use serde_json::{Value, json};
use tokio::sync::watch;

/// Failure guard only.
const GUARD: Duration = Duration::from_secs(60);
/// [`GUARD`] in milliseconds: the plugin's own wait for its answers.
const GUARD_MS: u64 = 60_000;

/// The user whose calls the service holds until the test opens it.
const HELD_USER: &str = "u";

/// Holds every call of [`HELD_USER`] until opened (counting them as they arrive); answers others at once.
#[derive(Debug)]
struct Gate {
    open: watch::Sender<bool>,
    arrived: watch::Sender<usize>,
    users: Mutex<Vec<String>>,
}

impl Gate {
    fn new() -> Gate {
        Gate {
            open: watch::channel(false).0,
            arrived: watch::channel(0).0,
            users: Mutex::new(Vec::new()),
        }
    }
}

impl HostServices for Gate {
    fn call(&self, call: ReverseCall) -> ServiceFuture {
        self.users.lock().unwrap().push(call.user.clone());
        let held = call.user == HELD_USER;
        // The params (the padding) stay held with the call, as a real service holds them.
        let params = call.params;
        let mut open = self.open.subscribe();
        if held {
            self.arrived.send_modify(|n| *n += 1);
        }
        Box::pin(async move {
            if held {
                let _ = open.wait_for(|o| *o).await;
            }
            Ok(json!({ "pad_bytes": params["pad"].as_str().map_or(0, str::len) }))
        })
    }
}

/// Mints the storage token only.
#[derive(Debug)]
struct StorageToken;

impl TokenSource for StorageToken {
    fn tokens(&self, r: TokenRequest) -> TokenFuture {
        let tokens = InvokeTokens {
            storage: Some(format!("tok-{}", r.invoke_id)),
            ..InvokeTokens::default()
        };
        Box::pin(async move { tokens })
    }
}

/// This process's resident memory (`VmRSS` of /proc/self/status), in bytes.
fn resident_bytes() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kib: usize = line
        .trim_start_matches("VmRSS:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .unwrap();
    kib * 1024
}

#[tokio::test]
async fn reverse_requests_past_the_session_byte_budget_are_refused_and_memory_stays_bounded() {
    // Half-size frames: exactly `FITS` of them fill the budget, the next one is one frame over it.
    const FRAME: usize = MAX_FRAME_BYTES / 2;
    const FITS: usize = MAX_REVERSE_BYTES_IN_FLIGHT / FRAME;
    /// Eight budgets' worth of requests at once.
    const SENT: usize = 8 * FITS;
    // Held at most: the admitted frames (the budget) and their parsed params (as much again); the two
    // sessions' read buffers (each grown to hold at most two frames of the largest size).
    const BOUND: usize = 2 * MAX_REVERSE_BYTES_IN_FLIGHT + 4 * MAX_FRAME_BYTES;
    const _: () = assert!(MAX_REVERSE_BYTES_IN_FLIGHT.is_multiple_of(FRAME) && FITS >= 2);
    // Without the budget every request would be held, raw and parsed: well above the bound.
    const _: () = assert!(2 * SENT * FRAME > 2 * BOUND);

    let gate = Arc::new(Gate::new());
    let flags = ["--capabilities", "storage", "--host-capabilities", "aps.kv"];
    let w = Arc::new(TestWorker::with_services(
        test_config("rbudget"),
        &[Plugin::echo("kv", &flags)],
        gate.clone(),
        Arc::new(StorageToken),
    ));
    // Both sessions running and warmed up before the baseline.
    for user in [HELD_USER, "v"] {
        w.pool.prewarm(user, "kv", GUARD).await.unwrap();
    }
    let small = json!({"method": "storage/get", "params": {"key": "k"}});
    data(&w, "v", "kv", "reverse_rpc", small).await;
    let baseline = resident_bytes();
    let refused_before = WorkerMetrics::get(&w.metrics.reverse_refused);

    let flooding = w.clone();
    let burst = json!({
        "method": "storage/set", "params": {"key": "k"}, "count": SENT, "frame_bytes": FRAME,
        "timeout_ms": GUARD_MS,
    });
    let flood =
        tokio::spawn(async move { call(&flooding, HELD_USER, "kv", req("reverse_rpc", burst)).await });

    // The service holds exactly the requests that fit; every later one was refused before it was parsed.
    let mut arrived = gate.arrived.subscribe();
    tokio::time::timeout(GUARD, arrived.wait_for(|n| *n == FITS))
        .await
        .expect("failure guard: the requests within the budget reach the service")
        .unwrap();
    assert!(
        eventually(GUARD, || WorkerMetrics::get(&w.metrics.reverse_refused)
            - refused_before
            == (SENT - FITS) as u64)
        .await,
        "every request past the budget is refused"
    );
    assert_eq!(
        *gate.arrived.borrow(),
        FITS,
        "none past the budget reached the service"
    );

    // Another session is unaffected: a request of the largest legal size is served while the first is full.
    let largest = json!({
        "method": "storage/set", "params": {"key": "k"}, "frame_bytes": MAX_FRAME_BYTES,
        "timeout_ms": GUARD_MS,
    });
    let other = data(&w, "v", "kv", "reverse_rpc", largest).await;
    let answer = &other["responses"][0];
    assert!(answer["result"]["pad_bytes"].as_u64().unwrap() > 0, "{answer}");

    let held = resident_bytes().saturating_sub(baseline);
    println!(
        "resident growth with the budget full: {} MiB (bound {} MiB, sent {} MiB)",
        held >> 20,
        BOUND >> 20,
        (SENT * FRAME) >> 20
    );
    assert!(held <= BOUND, "the worker grew by {held} bytes, bound {BOUND}");

    gate.open.send_replace(true);
    let out = tokio::time::timeout(GUARD, flood)
        .await
        .expect("failure guard")
        .unwrap();
    let out = out.expect("the flooding invoke ends");
    let responses = out.data().expect("data")["responses"].as_array().unwrap().clone();
    assert_eq!(responses.len(), SENT);
    let (served, refused) = responses.split_at(FITS);
    for r in served {
        assert!(r["result"]["pad_bytes"].as_u64().unwrap() > 0, "{r}");
    }
    for r in refused {
        assert_eq!(r["error"]["code"], -32603, "{r}");
        let message = r["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(&format!("more than {MAX_REVERSE_BYTES_IN_FLIGHT} bytes")),
            "{message}"
        );
    }

    // The budget is given back when the calls end: two frames of the largest size fit again at once.
    gate.open.send_replace(false);
    let two = json!({
        "method": "storage/set", "params": {"key": "k"}, "count": 2, "frame_bytes": MAX_FRAME_BYTES,
        "timeout_ms": GUARD_MS,
    });
    let arrived_before = *gate.arrived.borrow();
    let again = w.clone();
    let pair = tokio::spawn(async move { call(&again, HELD_USER, "kv", req("reverse_rpc", two)).await });
    tokio::time::timeout(GUARD, arrived.wait_for(|n| *n == arrived_before + 2))
        .await
        .expect("failure guard: both largest frames are held at once")
        .unwrap();
    gate.open.send_replace(true);
    let out = tokio::time::timeout(GUARD, pair)
        .await
        .expect("failure guard")
        .unwrap()
        .unwrap();
    let responses: Vec<Value> = out.data().unwrap()["responses"].as_array().unwrap().clone();
    assert!(
        responses.iter().all(|r| r.get("result").is_some()),
        "{responses:?}"
    );
    assert!(gate.users.lock().unwrap().iter().any(|u| u == "v"));
    w.pool.shutdown().await;
}
