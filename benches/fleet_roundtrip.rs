//! The warm request path of the fleet, against the NATS / JetStream operations it is built from, measured in the
//! same run.
//!
//! One process runs a whole fleet as the e2e tests do (`fleet_e2e::cluster`): a real nats-server with
//! JetStream, the store, one front replica and one worker node (cgroup isolation) over the release build of the
//! Rust echo plugin, with real HS256 JWTs. The echo install gets `pids_max = 256`: the fixture runs every invoke
//! on a thread of its own, and 64 invokes in flight plus its own threads exceed the default cgroup `pids.max` of
//! 64 ("cannot spawn a thread"). The worker's `max_in_flight_per_session` is `IN_FLIGHT + 1` (default 64): Dr's
//! running job holds one of the echo session's in-flight slots for the whole run, so the 64 pipelined invokes
//! of B need one more (at the default, the 64th is refused and `tools.invoke` answers `agent_unavailable`, "no
//! worker can take the call"). One user's echo session is warmed by an invoke before anything is timed.
//! Measured, from a client connection of this process:
//! - A `raw_echo` — NATS request/reply to a responder task (its own connection) that answers every message with
//!   its payload: the same ≈150-byte body and the same `Authorization` header as B. The physical floor of one
//!   API call;
//! - Ai the same echo as an API call makes it: from the `app` user, through the app account's service import of
//!   `fleet.v1.api.>`, to a responder on a `front` connection (subject `fleet.v1.api.bench-raw-echo`, no method
//!   of the API). What the trust boundary (the accounts) adds to every API call before the front sees it;
//! - B `invoke` — `tools.invoke` of `echo.echo` through the API: JWT check, rate limiter, dispatch (rendezvous
//!   over the cached worker registry), request/reply to the worker, the plugin's stdio round trip, and back;
//! - A and B pipelined: N requests with 64 in flight (`buffer_unordered(64)`), in requests per second;
//! - C `invokeAsync` — create a job (active-set slot CAS, record create, event, hand-off to the worker) and
//!   D `getJob` of the finished job, the first time (answered from the front's memory: the worker's terminal
//!   step announced the record on `fleet.v1.jobs.finished`; a front that missed it reads the record and the last
//!   progress message), Dk the same again, and Dr `getJob` of a running job polled with `sinceSeq` = its `lastSeq`
//!   (an `echo.progress` job that stored one event and waits an hour for its second), against
//!   E a single JetStream KV `put` and F a single KV `entry` read, on the jobs bucket itself (scratch keys
//!   `bench.<n>` outside every user's key space, deleted at the end) with values the size of a finished job
//!   record.
//!
//! - the floors of the topology, built of the same messages and store operations with nothing of the fleet in
//!   them (no JWT, no limiter, no routing, no envelope, no seal), so B/Bf, C/Cf and Dr/Drf are what the fleet's
//!   own work adds and Bf/A, Cf/E and Drf/F what its shape costs before any of it:
//!   Bf — an app request through the import to a relay on a `front` connection, which requests a raw worker task
//!   on a `worker` connection with the app's reply subject in a header; the worker writes one JSON-RPC `invoke`
//!   line to a release echo plugin's stdin (a plain child process, no cgroup), reads its answer line, publishes
//!   it to the app's reply subject and a short notice to the relay (the four messages of B);
//!   Cf — an app request through the import whose relay makes admission's two sequential phases on the scratch
//!   keys (a compare-and-set ‖ a read, then a create ‖ a compare-and-set) and replies;
//!   Drf — an app request through the import whose relay reads one record-sized KV entry and replies with it;
//!   a finished job's getJob (D, Dk) is answered from the front's memory: its floor is Ai.
//!
//! The nats-server runs with authorization on, as in production: the API calls (B, C, D) go through an `app`
//! user, A is a request from a `front` user to a `worker` user on a worker exec subject (the only core
//! request/reply those users may make), E and F are the `front` user's.
//!
//! C and D run as the warm user: after each `invokeAsync` the bench waits (untimed) for the job's terminal
//! `tool_job` event, so the user never holds more than two of its 5 active slots (the running job of Dr is the
//! other, cancelled at the end) and no job starts a cold session. The front is built as `Cluster::add_front` builds one, with one change: the per-user rate limit
//! (50/s, burst 100 by default) is raised out of reach, since one user drives thousands of calls per second
//! here; the limiter is still consulted on every call. Its store has a budget (`STORE_BUDGET`), so admission's
//! fleet-wide guard on the JetStream store (`fleet_store::fill`) runs on every `invokeAsync`.
//!
//! Tracing: the production subscriber (`fleet::telemetry::layers`: JSON logs on stderr at `info`, spans exported
//! over OTLP/gRPC to an in-process receiver, `opentelemetry-proto`'s `TraceServiceServer` on tonic) is installed
//! at the start under a switch, off except in the traced phase of each round: Bt and Ct are B and C with it on
//! (and Bt pipelined), so Bt/B and Ct/C are the cost of the spans and logs, measured in the same rounds.
//! Run it with stderr to a file (`2>/tmp/bench.log`): the traced phase logs as production does.
//!
//! Criterion measures A, B, E and F (sequential latency). Then an interleaved pass (A and B alternate request
//! by request; C, D, E, F in turn; the pipelined batches of A then B each round) prints p50/p99 of every
//! measure over all its samples, the median pipelined throughput of the rounds, and the ratios, so slow and fast
//! phases of a noisy machine hit every measure alike. Everything is shut down at the end.
#![allow(
    clippy::unwrap_used,
    clippy::print_stdout,
    clippy::cast_possible_truncation,
    clippy::cast_precision_loss
)]

use fleet_benches::{pct, us};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream::kv;
use async_nats::{HeaderMap, Request};
use bytes::Bytes;
use criterion::{Criterion, SamplingMode, criterion_group, criterion_main};
use fleet::front::{Front, FrontConfig};
use fleet_client::auth::{DEFAULT_AUDIENCE, DEFAULT_ISSUER, Verifier};
use fleet_e2e::cluster::{Cluster, Role, connect};
use fleet_e2e::worker::Plugin;
use fleet_proto::api::user_key;
use fleet_proto::api::{
    ApiResponse, InvokeAsyncResult, JobId, JobSnapshot, JobState, ToolJobEvent, methods, subjects,
};
use fleet_store::{Store, StoreSettings};
use futures::StreamExt as _;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use serde_json::json;
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// The `fleet` binary's allocator: the front and the worker run in this process.
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// The front's JetStream store budget (1 TiB: the fleet-wide admission guard runs, never near its mark).
const STORE_BUDGET: u64 = 1 << 40;
/// The user whose echo session is warm.
const USER: &str = "bench-user";
/// Size of the request body of A and B.
const BODY_BYTES: usize = 150;
/// Requests in flight in the pipelined batches.
const IN_FLIGHT: usize = 64;
/// The raw echo's subject.
const ECHO_SUBJECT: &str = "fleet.v1.worker.bench-raw-echo.exec";
/// Ai's method under the API prefix (no method of the API).
const IMPORT_ECHO_METHOD: &str = "bench-raw-echo";
/// Bf's worker subject (a worker exec subject, like A's).
const FLOOR_SUBJECT: &str = "fleet.v1.worker.bench-floor.exec";
/// The header carrying the app's reply subject from Bf's relay to its worker.
const FLOOR_REPLY_HEADER: &str = "Bench-Reply-To";
/// The API-prefix methods (none of the API) of the floors' relays.
const FLOOR_INVOKE_METHOD: &str = "bench-floor-invoke";
const FLOOR_ASYNC_METHOD: &str = "bench-floor-async";
const FLOOR_GET_METHOD: &str = "bench-floor-get";
/// The scratch keys' prefix in the jobs bucket (no user key is `bench`: user keys are 32 hex characters).
const SCRATCH_PREFIX: &str = "bench";
/// A failure guard for a job to finish (never reached in a healthy run).
const JOB_WAIT: Duration = Duration::from_secs(30);
/// Dr's job: one progress event, then an hour's wait for the second (cancelled at the end).
const RUNNING_JOB: &str = r#"{"tool_id": "echo.progress", "args": {"count": 2, "interval_ms": 3600000}}"#;

/// Whether the production subscriber is on (the traced phase of a round).
static TRACING: AtomicBool = AtomicBool::new(false);

/// The in-process OTLP receiver: counts the spans exported to it.
#[derive(Debug, Default, Clone)]
struct Receiver {
    spans: Arc<AtomicU64>,
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let n: usize = request
            .into_inner()
            .resource_spans
            .iter()
            .flat_map(|r| &r.scope_spans)
            .map(|s| s.spans.len())
            .sum();
        self.spans.fetch_add(n as u64, Ordering::Relaxed);
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// Starts the receiver and installs the production subscriber (logs at `info`, spans to the receiver) under the
/// [`TRACING`] switch; returns the receiver and the guard that flushes the exporter.
async fn tracing_on_switch() -> (Receiver, fleet::telemetry::TelemetryGuard) {
    let receiver = Receiver::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let service = receiver.clone();
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(service))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
            .await
            .unwrap();
    });
    let (layers, provider) = fleet::telemetry::layers(Some(&endpoint), "fleet-bench", "info").unwrap();
    let switch = tracing_subscriber::filter::filter_fn(|_| TRACING.load(Ordering::Relaxed));
    tracing_subscriber::registry()
        .with(layers.with_filter(switch))
        .init();
    (receiver, fleet::telemetry::activate(provider.unwrap()))
}

/// How much the interleaved pass does.
#[derive(Debug, Clone, Copy)]
struct Plan {
    /// Printed in the table's title.
    label: &'static str,
    rounds: usize,
    /// Sequential A and B samples per round (each).
    latency: usize,
    /// Requests per pipelined batch (A and B each, per round).
    pipelined: usize,
    /// C, D, E and F samples per round (each).
    jobs: usize,
}

impl Plan {
    /// `cargo bench`: 2 000 sequential A/B samples, 1 000 of C–F, 10 pipelined batches of 5 000 each.
    const FULL: Plan = Plan {
        label: "interleaved",
        rounds: 10,
        latency: 200,
        pipelined: 5000,
        jobs: 100,
    };
    /// `cargo test --benches` / `-- --test`: a smoke run.
    const QUICK: Plan = Plan {
        label: "smoke run, not a measurement",
        rounds: 1,
        latency: 5,
        pipelined: 128,
        jobs: 2,
    };
}

struct Bench {
    cluster: Option<Cluster>,
    /// The OTLP receiver of the traced phase, and the exporter's guard.
    receiver: Receiver,
    telemetry: fleet::telemetry::TelemetryGuard,
    /// The connection the API calls go out on (the cluster's `app` user).
    client: async_nats::Client,
    /// The connection of A, E and F (the cluster's `front` user).
    raw: async_nats::Client,
    headers: HeaderMap,
    /// The `tools.invoke` / `tools.invokeAsync` body (`BODY_BYTES`).
    body: Bytes,
    responder: tokio::task::JoinHandle<()>,
    /// Ai's responder.
    import_responder: tokio::task::JoinHandle<()>,
    /// The warm user's `tool_job` events.
    events: async_nats::Subscriber,
    /// Dr's job, running with one progress event stored.
    running: Option<JobId>,
    /// The set-up's finished job (the profile run's `getJob`).
    finished: Option<JobId>,
    scratch: kv::Store,
    /// A KV value the size of a finished job record.
    value: Bytes,
    record_bytes: usize,
    /// Keys written so far on the scratch bucket.
    puts: u64,
    /// The floors (Bf, Cf, Drf).
    floors: Option<Floors>,
}

/// The `tools.invoke` body, padded to exactly `BODY_BYTES`.
fn invoke_body() -> Bytes {
    let make = |pad: usize| {
        serde_json::to_vec(&json!({
            "tool_id": "echo.echo",
            "args": {"message": "fleet_roundtrip", "payload": {"seq": 1, "pad": "x".repeat(pad)}},
        }))
        .unwrap()
    };
    let base = make(0).len();
    let body = make(BODY_BYTES.saturating_sub(base));
    assert_eq!(body.len(), BODY_BYTES.max(base));
    body.into()
}

/// The scratch keys of Cf and Drf (under `SCRATCH_PREFIX`, purged at the end).
const FLOOR_SLOT_KEY: &str = "bench.floor.slot";
const FLOOR_HEAD_KEY: &str = "bench.floor.head";
const FLOOR_RECORD_KEY: &str = "bench.floor.record";
/// Cf's slot and head values (the size of an active set with one job and of a small index head).
const FLOOR_SMALL_VALUE: usize = 512;

/// The floors' tasks and Bf's plugin (see the module docs).
struct Floors {
    tasks: Vec<tokio::task::JoinHandle<()>>,
    plugin: tokio::process::Child,
}

impl Floors {
    async fn start(cluster: &Cluster, record: Bytes) -> Floors {
        let mut tasks = Vec::new();

        // Bf's worker: a plain child process of the release echo plugin behind two pipes.
        let mut plugin = tokio::process::Command::new(fleet_e2e::echo_plugin_bin())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut stdin = plugin.stdin.take().unwrap();
        let stdout = plugin.stdout.take().unwrap();
        let worker = connect(&cluster.nats, Role::Worker).await;
        let mut sub = worker.subscribe(FLOOR_SUBJECT).await.unwrap();
        fleet_client::nats_conn::round_trip(&worker).await.unwrap();
        // The echo plugin answers `echo` on its reading thread, so in the order asked: a queue matches the
        // answers (each answer's id is checked).
        type Waiting = std::collections::VecDeque<(u64, async_nats::Subject, async_nats::Subject)>;
        let waiting = Arc::new(std::sync::Mutex::new(Waiting::new()));
        let (w, q) = (worker.clone(), Arc::clone(&waiting));
        tasks.push(tokio::spawn(async move {
            use tokio::io::AsyncBufReadExt as _;
            let mut out = tokio::io::BufReader::new(stdout);
            let mut line = Vec::new();
            loop {
                line.clear();
                if out.read_until(b'\n', &mut line).await.unwrap_or(0) == 0 {
                    return;
                }
                let (id, app, front) = q.lock().unwrap().pop_front().unwrap();
                assert!(
                    line.starts_with(format!("{{\"id\":{id},").as_bytes()),
                    "Bf's plugin answered out of order: {}",
                    String::from_utf8_lossy(&line)
                );
                let _ = w.publish(app, Bytes::copy_from_slice(&line)).await;
                let _ = w.publish(front, Bytes::from_static(b"ok")).await;
            }
        }));
        tasks.push(tokio::spawn(async move {
            use tokio::io::AsyncWriteExt as _;
            let mut id = 0_u64;
            while let Some(msg) = sub.next().await {
                let (Some(front), Some(app)) = (
                    msg.reply,
                    msg.headers.as_ref().and_then(|h| h.get(FLOOR_REPLY_HEADER)),
                ) else {
                    continue;
                };
                id += 1;
                let mut line = format!(
                    r#"{{"jsonrpc":"2.0","id":{id},"method":"invoke","params":{{"tool":"echo","arguments":"#
                )
                .into_bytes();
                line.extend_from_slice(&msg.payload);
                line.extend_from_slice(b"}}\n");
                waiting
                    .lock()
                    .unwrap()
                    .push_back((id, app.as_str().into(), front));
                if stdin.write_all(&line).await.is_err() {
                    return;
                }
            }
        }));

        // Bf's relay: the app's request, forwarded with its reply subject; the worker's notice awaited.
        let front = connect(&cluster.nats, Role::Front).await;
        let mut sub = front.subscribe(subjects::api(FLOOR_INVOKE_METHOD)).await.unwrap();
        let relay = front.clone();
        tasks.push(tokio::spawn(async move {
            while let Some(msg) = sub.next().await {
                let Some(reply) = msg.reply else { continue };
                let relay = relay.clone();
                tokio::spawn(async move {
                    let mut headers = HeaderMap::new();
                    headers.insert(FLOOR_REPLY_HEADER, reply.as_str());
                    let request = Request::new().headers(headers).payload(msg.payload);
                    let notice = relay.send_request(FLOOR_SUBJECT, request).await.unwrap();
                    assert_eq!(&notice.payload[..], b"ok");
                });
            }
        }));

        // Cf's and Drf's relays, on the jobs bucket's scratch keys.
        let kv = async_nats::jetstream::new(front.clone())
            .get_key_value(cluster.store.settings().jobs_bucket())
            .await
            .unwrap();
        let small = Bytes::from(vec![b's'; FLOOR_SMALL_VALUE]);
        let slot_rev = kv.put(FLOOR_SLOT_KEY, small.clone()).await.unwrap();
        kv.put(FLOOR_HEAD_KEY, small.clone()).await.unwrap();
        kv.put(FLOOR_RECORD_KEY, record.clone()).await.unwrap();
        let slot_rev = Arc::new(AtomicU64::new(slot_rev));
        let created = Arc::new(AtomicU64::new(0));
        let mut sub = front.subscribe(subjects::api(FLOOR_ASYNC_METHOD)).await.unwrap();
        let (relay, store) = (front.clone(), kv.clone());
        tasks.push(tokio::spawn(async move {
            while let Some(msg) = sub.next().await {
                let Some(reply) = msg.reply else { continue };
                let (relay, kv) = (relay.clone(), store.clone());
                let (small, record) = (small.clone(), record.clone());
                let (slot_rev, created) = (Arc::clone(&slot_rev), Arc::clone(&created));
                tokio::spawn(async move {
                    // Admission's two phases: the slot's compare-and-set ‖ the index head's read, then the
                    // record's create ‖ the head's compare-and-set.
                    let (slot, head) = futures::join!(
                        kv.update(FLOOR_SLOT_KEY, small.clone(), slot_rev.load(Ordering::Relaxed)),
                        kv.entry(FLOOR_HEAD_KEY),
                    );
                    slot_rev.store(slot.unwrap(), Ordering::Relaxed);
                    let head = head.unwrap().unwrap();
                    let n = created.fetch_add(1, Ordering::Relaxed);
                    let (made, headed) = futures::join!(
                        kv.create(format!("{SCRATCH_PREFIX}.floor.j{n}"), record),
                        kv.update(FLOOR_HEAD_KEY, small, head.revision),
                    );
                    made.unwrap();
                    headed.unwrap();
                    let _ = relay.publish(reply, Bytes::from_static(b"ok")).await;
                });
            }
        }));
        let mut sub = front.subscribe(subjects::api(FLOOR_GET_METHOD)).await.unwrap();
        tasks.push(tokio::spawn(async move {
            while let Some(msg) = sub.next().await {
                let Some(reply) = msg.reply else { continue };
                let (relay, kv) = (front.clone(), kv.clone());
                tokio::spawn(async move {
                    let entry = kv.entry(FLOOR_RECORD_KEY).await.unwrap().unwrap();
                    let _ = relay.publish(reply, entry.value).await;
                });
            }
        }));
        Floors { tasks, plugin }
    }

    async fn stop(mut self) {
        for task in &self.tasks {
            task.abort();
        }
        let _ = self.plugin.kill().await;
    }
}

impl Bench {
    async fn new() -> Bench {
        let (receiver, telemetry) = tracing_on_switch().await;
        // The fixture serves each invoke on its own thread: 64 in flight need more than the default pids.max (64).
        let plugin = Plugin::echo("echo", &[]).limits(json!({ "pids_max": 256 }));
        let mut cluster = Cluster::start("bench-rt", 0, 0, &[plugin]).await;
        // One in-flight slot of the echo session more than the pipelined batches use: Dr's running job holds
        // one for the whole run (see the module docs).
        cluster
            .add_worker_with("bench-rt-w0", |w| {
                w.max_in_flight_per_session = IN_FLIGHT + 1;
            })
            .await;
        // The cluster's front, with the per-user rate limit out of reach (see the module docs).
        let front_client = connect(&cluster.nats, Role::Front).await;
        // With a store budget, as production runs: admission's fleet-wide guard is on (far from its mark).
        let store = Store::open(
            async_nats::jetstream::new(front_client.clone()),
            StoreSettings {
                job_store_max_bytes: STORE_BUDGET,
                ..StoreSettings::default()
            },
        )
        .await
        .unwrap();
        let verifier = Verifier::new(
            vec![cluster.key.verify_key().unwrap()],
            DEFAULT_ISSUER,
            DEFAULT_AUDIENCE,
        )
        .unwrap();
        let config = FrontConfig {
            rate_per_user: 1_000_000_000,
            burst_per_user: 1_000_000_000,
            ..FrontConfig::default()
        };
        let seals = std::sync::Arc::new(cluster.nats.exec_signer().unwrap());
        let front = Front::new(front_client, store, verifier, config, seals);
        let service = front.serve().await.unwrap();
        cluster.fronts.push((front, service));

        // A: the responder, on its own connection.
        let responder_client = connect(&cluster.nats, Role::Worker).await;
        let mut sub = responder_client.subscribe(ECHO_SUBJECT).await.unwrap();
        fleet_client::nats_conn::round_trip(&responder_client)
            .await
            .unwrap();
        let responder = tokio::spawn(async move {
            while let Some(msg) = sub.next().await {
                if let Some(reply) = msg.reply {
                    let _ = responder_client.publish(reply, msg.payload).await;
                }
            }
        });

        // Ai: the responder behind the import, on a front connection of its own.
        let import_client = connect(&cluster.nats, Role::Front).await;
        let mut sub = import_client
            .subscribe(subjects::api(IMPORT_ECHO_METHOD))
            .await
            .unwrap();
        fleet_client::nats_conn::round_trip(&import_client).await.unwrap();
        let import_responder = tokio::spawn(async move {
            while let Some(msg) = sub.next().await {
                if let Some(reply) = msg.reply {
                    let _ = import_client.publish(reply, msg.payload).await;
                }
            }
        });

        let client = cluster.app.clone();
        let raw = cluster.client.clone();
        let mut headers = HeaderMap::new();
        headers.insert(
            subjects::AUTH_HEADER,
            format!("Bearer {}", cluster.token(USER)).as_str(),
        );
        let events = client
            .subscribe(subjects::user_events(&user_key(USER)))
            .await
            .unwrap();
        fleet_client::nats_conn::round_trip(&client).await.unwrap();

        // E, F: the jobs bucket, on keys no user has.
        let scratch = async_nats::jetstream::new(raw.clone())
            .get_key_value(cluster.store.settings().jobs_bucket())
            .await
            .unwrap();

        let mut bench = Bench {
            cluster: Some(cluster),
            receiver,
            telemetry,
            client,
            raw,
            headers,
            body: invoke_body(),
            responder,
            import_responder,
            events,
            running: None,
            finished: None,
            scratch,
            value: Bytes::new(),
            record_bytes: 0,
            puts: 0,
            floors: None,
        };
        // Warm the session (the first invoke spawns the plugin), then one job, which also gives the size of a
        // finished record.
        bench.invoke().await;
        let (_, job) = bench.invoke_async().await;
        bench.wait_terminal(&job).await;
        let record = bench.cluster().store.get_job(USER, &job).await.unwrap().unwrap();
        let bytes = serde_json::to_vec(&record.value).unwrap();
        bench.record_bytes = bytes.len();
        bench.value = vec![b'v'; bytes.len()].into();
        let _ = bench.get_job(&job).await;
        bench.finished = Some(job);
        let running = bench.start_running().await;
        bench.running = Some(running);
        let _ = bench.get_running().await;
        bench.kv_put().await;
        bench.kv_get().await;
        bench.raw_echo().await;
        bench.import_echo().await;
        bench.floors = Some(Floors::start(bench.cluster(), bench.value.clone()).await);
        bench.floor_invoke().await;
        bench.floor_async().await;
        bench.floor_get().await;
        bench
    }

    fn cluster(&self) -> &Cluster {
        self.cluster.as_ref().unwrap()
    }

    fn request(&self, body: Bytes) -> Request {
        Request::new().headers(self.headers.clone()).payload(body)
    }

    async fn send(&self, subject: String, body: Bytes) -> Bytes {
        let client = if subject == ECHO_SUBJECT {
            &self.raw
        } else {
            &self.client
        };
        client
            .send_request(subject, self.request(body))
            .await
            .unwrap()
            .payload
    }

    /// A: one raw request/reply echo.
    async fn raw_echo(&self) -> Duration {
        let t = Instant::now();
        let reply = self.send(ECHO_SUBJECT.into(), self.body.clone()).await;
        let d = t.elapsed();
        assert_eq!(reply.len(), BODY_BYTES);
        d
    }

    /// Ai: one raw request/reply echo through the app account's import.
    async fn import_echo(&self) -> Duration {
        let t = Instant::now();
        let reply = self
            .send(subjects::api(IMPORT_ECHO_METHOD), self.body.clone())
            .await;
        let d = t.elapsed();
        assert_eq!(reply.len(), BODY_BYTES);
        d
    }

    /// Bf: B's messages and plugin round trip with nothing of the fleet in them.
    async fn floor_invoke(&self) -> Duration {
        self.timed(FLOOR_INVOKE_METHOD, check_floor_invoke).await
    }

    /// Cf: admission's two JetStream phases behind the API hop.
    async fn floor_async(&self) -> Duration {
        self.timed(FLOOR_ASYNC_METHOD, |r| assert_eq!(r, b"ok")).await
    }

    /// Drf: one record read behind the API hop.
    async fn floor_get(&self) -> Duration {
        let len = self.record_bytes;
        self.timed(FLOOR_GET_METHOD, |r| assert_eq!(r.len(), len)).await
    }

    /// One request of the body to `method` under the API prefix, timed; its reply then checked by `check`.
    async fn timed(&self, method: &str, check: impl Fn(&[u8])) -> Duration {
        let t = Instant::now();
        let reply = self.send(subjects::api(method), self.body.clone()).await;
        let d = t.elapsed();
        check(&reply);
        d
    }

    /// B: one `tools.invoke` of the echo tool.
    async fn invoke(&self) -> Duration {
        let t = Instant::now();
        let reply = self
            .send(subjects::api(methods::TOOLS_INVOKE), self.body.clone())
            .await;
        let d = t.elapsed();
        check_ok(methods::TOOLS_INVOKE, &reply);
        d
    }

    /// C: one `tools.invokeAsync`; the job id.
    async fn invoke_async(&self) -> (Duration, JobId) {
        let t = Instant::now();
        let reply = self
            .send(subjects::api(methods::TOOLS_INVOKE_ASYNC), self.body.clone())
            .await;
        let d = t.elapsed();
        match serde_json::from_slice::<ApiResponse<InvokeAsyncResult>>(&reply).unwrap() {
            ApiResponse::Ok(r) => (d, r.job_id),
            ApiResponse::Err(e) => panic!("tools.invokeAsync failed: {e}"),
        }
    }

    /// Waits (untimed) for the terminal `tool_job` event of `job`.
    async fn wait_terminal(&mut self, job: &JobId) {
        let ev = self.wait_event(job, |ev| ev.terminal).await;
        assert_eq!(ev.state, JobState::Succeeded, "job {job}");
    }

    /// Waits (untimed) for a `tool_job` event of `job` that `pred` accepts.
    async fn wait_event(&mut self, job: &JobId, pred: impl Fn(&ToolJobEvent) -> bool) -> ToolJobEvent {
        let deadline = tokio::time::Instant::now() + JOB_WAIT;
        loop {
            let msg = tokio::time::timeout_at(deadline, self.events.next())
                .await
                .unwrap_or_else(|_| panic!("job {job}: no awaited event within {JOB_WAIT:?}"))
                .unwrap();
            let ev: ToolJobEvent = serde_json::from_slice(&msg.payload).unwrap();
            if ev.job_id == *job && pred(&ev) {
                return ev;
            }
        }
    }

    /// Starts Dr's job and waits (untimed) until its first progress event is stored.
    async fn start_running(&mut self) -> JobId {
        let reply = self
            .send(
                subjects::api(methods::TOOLS_INVOKE_ASYNC),
                Bytes::from_static(RUNNING_JOB.as_bytes()),
            )
            .await;
        let job = match serde_json::from_slice::<ApiResponse<InvokeAsyncResult>>(&reply).unwrap() {
            ApiResponse::Ok(r) => r.job_id,
            ApiResponse::Err(e) => panic!("tools.invokeAsync failed: {e}"),
        };
        self.wait_event(&job, |ev| ev.seq == 1 && ev.event.is_some())
            .await;
        job
    }

    /// D, Dk: one `tools.getJob` of a finished job.
    async fn get_job(&self, job: &JobId) -> Duration {
        self.timed_get_job(json!({ "jobId": job }), JobState::Succeeded, 0)
            .await
    }

    /// Dr: one `tools.getJob` of the running job, polled with `sinceSeq` = its `lastSeq` (nothing new).
    async fn get_running(&self) -> Duration {
        let job = self.running.as_ref().unwrap();
        self.timed_get_job(json!({ "jobId": job, "sinceSeq": 1 }), JobState::Running, 1)
            .await
    }

    async fn timed_get_job(&self, args: serde_json::Value, state: JobState, last_seq: u64) -> Duration {
        let body = serde_json::to_vec(&args).unwrap();
        let t = Instant::now();
        let reply = self
            .send(subjects::api(methods::TOOLS_GET_JOB), body.into())
            .await;
        let d = t.elapsed();
        match serde_json::from_slice::<ApiResponse<JobSnapshot>>(&reply).unwrap() {
            ApiResponse::Ok(s) => {
                assert_eq!(
                    (s.state, s.last_seq, s.progress.len()),
                    (state, last_seq, 0),
                    "{args}"
                );
            }
            ApiResponse::Err(e) => panic!("tools.getJob failed: {e}"),
        }
        d
    }

    /// E: one KV put of a new key.
    async fn kv_put(&mut self) -> Duration {
        self.puts += 1;
        let key = format!("{SCRATCH_PREFIX}.k{}", self.puts);
        let t = Instant::now();
        self.scratch.put(key, self.value.clone()).await.unwrap();
        t.elapsed()
    }

    /// F: one KV read of the last key written.
    async fn kv_get(&self) -> Duration {
        let key = format!("{SCRATCH_PREFIX}.k{}", self.puts);
        let t = Instant::now();
        let entry = self.scratch.entry(key).await.unwrap();
        let d = t.elapsed();
        assert_eq!(entry.unwrap().value.len(), self.record_bytes);
        d
    }

    /// `n` requests of A (`invoke == false`) or B with `IN_FLIGHT` in flight; requests per second.
    async fn pipelined(&self, invoke: bool, n: usize) -> f64 {
        if invoke {
            let (subject, body) = (subjects::api(methods::TOOLS_INVOKE), self.body.clone());
            self.pipelined_to(subject, body, n, |r| check_ok(methods::TOOLS_INVOKE, r))
                .await
        } else {
            self.pipelined_to(ECHO_SUBJECT.to_string(), self.body.clone(), n, |r| {
                assert_eq!(r.len(), BODY_BYTES);
            })
            .await
        }
    }

    /// `n` requests of Bf with `IN_FLIGHT` in flight; requests per second.
    async fn pipelined_floor(&self, n: usize) -> f64 {
        let subject = subjects::api(FLOOR_INVOKE_METHOD);
        self.pipelined_to(subject, self.body.clone(), n, check_floor_invoke)
            .await
    }

    /// `n` `tools.getJob` of the set-up's finished job with `IN_FLIGHT` in flight; requests per second.
    async fn pipelined_get_job(&self, n: usize) -> f64 {
        let body = serde_json::to_vec(&json!({ "jobId": self.finished.as_ref().unwrap() })).unwrap();
        let subject = subjects::api(methods::TOOLS_GET_JOB);
        self.pipelined_to(subject, body.into(), n, |r| check_ok(methods::TOOLS_GET_JOB, r))
            .await
    }

    /// `n` requests of `body` to `subject` with `IN_FLIGHT` in flight, each reply then checked by `check`;
    /// requests per second.
    async fn pipelined_to(&self, subject: String, body: Bytes, n: usize, check: impl Fn(&[u8])) -> f64 {
        let t = Instant::now();
        let replies: Vec<Bytes> = futures::stream::iter(0..n)
            .map(|_| self.send(subject.clone(), body.clone()))
            .buffer_unordered(IN_FLIGHT)
            .collect()
            .await;
        let secs = t.elapsed().as_secs_f64();
        for reply in &replies {
            check(reply);
        }
        n as f64 / secs
    }

    /// `iters` sequential runs of one measure, for criterion's `iter_custom`.
    async fn repeat(&mut self, m: Measure, iters: u64) -> Duration {
        let mut sum = Duration::ZERO;
        for _ in 0..iters {
            sum += match m {
                Measure::RawEcho => self.raw_echo().await,
                Measure::Invoke => self.invoke().await,
                Measure::KvPut => self.kv_put().await,
                Measure::KvGet => self.kv_get().await,
            };
        }
        sum
    }

    /// Cancels the running job, stops the responder, purges the scratch keys and shuts the fleet down (front,
    /// worker node and its plugin sessions; the nats-server stops when the cluster is dropped).
    /// Spans the receiver got (the exporter flushed first).
    fn spans_exported(&self) -> u64 {
        let _ = self.telemetry.force_flush();
        self.receiver.spans.load(Ordering::Relaxed)
    }

    async fn shutdown(mut self) {
        if let Some(job) = self.running.take() {
            let body = serde_json::to_vec(&json!({ "jobId": job })).unwrap();
            let reply = self
                .send(subjects::api(methods::TOOLS_CANCEL_JOB), body.into())
                .await;
            check_ok(methods::TOOLS_CANCEL_JOB, &reply);
        }
        self.responder.abort();
        self.import_responder.abort();
        if let Some(floors) = self.floors.take() {
            floors.stop().await;
        }
        let _ = self
            .scratch
            .stream
            .purge()
            .filter(format!("$KV.{}.{SCRATCH_PREFIX}.>", self.scratch.name))
            .await;
        if let Some(cluster) = self.cluster.take() {
            cluster.shutdown().await;
        }
    }
}

/// Panics unless `reply` is the echo plugin's answer line to Bf's request.
fn check_floor_invoke(reply: &[u8]) {
    assert!(
        reply.starts_with(br#"{"id":"#) && memchr::memmem::find(reply, br#""result""#).is_some(),
        "Bf failed: {}",
        String::from_utf8_lossy(reply)
    );
}

/// Panics unless `reply` is `{"ok":true,…}`.
fn check_ok(method: &str, reply: &[u8]) {
    assert!(
        reply.starts_with(br#"{"ok":true"#),
        "{method} failed: {}",
        String::from_utf8_lossy(reply)
    );
}

#[derive(Debug, Clone, Copy)]
enum Measure {
    RawEcho,
    Invoke,
    KvPut,
    KvGet,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[derive(Default)]
struct Samples {
    a: Vec<Duration>,
    ai: Vec<Duration>,
    b: Vec<Duration>,
    /// The floors.
    bf: Vec<Duration>,
    cf: Vec<Duration>,
    drf: Vec<Duration>,
    bf_rps: Vec<f64>,
    /// B with the production subscriber on.
    bt: Vec<Duration>,
    c: Vec<Duration>,
    /// C with the production subscriber on.
    ct: Vec<Duration>,
    d: Vec<Duration>,
    dk: Vec<Duration>,
    dr: Vec<Duration>,
    e: Vec<Duration>,
    f: Vec<Duration>,
    a_rps: Vec<f64>,
    b_rps: Vec<f64>,
    bt_rps: Vec<f64>,
}

/// The interleaved pass.
async fn interleaved(bench: &mut Bench, plan: Plan) -> Samples {
    let mut s = Samples::default();
    for _ in 0..plan.rounds {
        for _ in 0..plan.latency {
            s.a.push(bench.raw_echo().await);
            s.ai.push(bench.import_echo().await);
            s.bf.push(bench.floor_invoke().await);
            s.b.push(bench.invoke().await);
        }
        for _ in 0..plan.jobs {
            let (c, job) = bench.invoke_async().await;
            s.c.push(c);
            s.cf.push(bench.floor_async().await);
            bench.wait_terminal(&job).await;
            s.d.push(bench.get_job(&job).await);
            s.dk.push(bench.get_job(&job).await);
            s.dr.push(bench.get_running().await);
            s.drf.push(bench.floor_get().await);
            s.e.push(bench.kv_put().await);
            s.f.push(bench.kv_get().await);
        }
        s.a_rps.push(bench.pipelined(false, plan.pipelined).await);
        s.bf_rps.push(bench.pipelined_floor(plan.pipelined).await);
        s.b_rps.push(bench.pipelined(true, plan.pipelined).await);
        // The traced phase: the same B and C, then B pipelined, with the production subscriber on.
        TRACING.store(true, Ordering::Relaxed);
        tracing::callsite::rebuild_interest_cache();
        for _ in 0..plan.latency {
            s.bt.push(bench.invoke().await);
        }
        for _ in 0..plan.jobs {
            let (c, job) = bench.invoke_async().await;
            s.ct.push(c);
            bench.wait_terminal(&job).await;
        }
        s.bt_rps.push(bench.pipelined(true, plan.pipelined).await);
        TRACING.store(false, Ordering::Relaxed);
        tracing::callsite::rebuild_interest_cache();
    }
    s
}

fn print_table(s: Samples, plan: Plan, bench: &Bench) {
    let stats = |mut v: Vec<Duration>| {
        v.sort();
        (v.len(), pct(&v, 50.0), pct(&v, 99.0))
    };
    let (a, b, c, d, e, f) = (
        stats(s.a),
        stats(s.b),
        stats(s.c),
        stats(s.d),
        stats(s.e),
        stats(s.f),
    );
    let (ai, dk, dr) = (stats(s.ai), stats(s.dk), stats(s.dr));
    let (bt, ct) = (stats(s.bt), stats(s.ct));
    let (bf, cf, drf) = (stats(s.bf), stats(s.cf), stats(s.drf));
    let bf_rps = median(s.bf_rps);
    let (a_rps, b_rps, bt_rps) = (median(s.a_rps), median(s.b_rps), median(s.bt_rps));
    println!();
    println!(
        "fleet_roundtrip ({}, {} rounds; 1 front, 1 worker, warm echo session, {}; body {BODY_BYTES} B \
         + Authorization header; KV values {} B = a finished job record; req/s = median of the rounds, \
         {} requests with {IN_FLIGHT} in flight)",
        plan.label,
        plan.rounds,
        bench.cluster().workers.first().map_or("?", |w| w.sandbox.mode()),
        bench.record_bytes,
        plan.pipelined,
    );
    println!(
        "{:<44} {:>8} {:>10} {:>10} {:>10}",
        "measure", "samples", "p50 µs", "p99 µs", "req/s"
    );
    let row = |name: &str, (n, p50, p99): (usize, Duration, Duration), rps: Option<f64>| {
        let rps = rps.map_or_else(String::new, |r| format!("{r:.0}"));
        println!("{name:<44} {n:>8} {:>10.1} {:>10.1} {rps:>10}", us(p50), us(p99));
    };
    row("A raw NATS request/reply echo", a, Some(a_rps));
    row("Ai A through the app account's import", ai, None);
    row("B tools.invoke echo (front→worker→plugin)", b, Some(b_rps));
    row("C tools.invokeAsync (create job)", c, None);
    row("D tools.getJob (finished job, first read)", d, None);
    row("Dk tools.getJob (finished job, again)", dk, None);
    row("Dr tools.getJob (running job, polled)", dr, None);
    row("E JetStream KV put (scratch bucket)", e, None);
    row("F JetStream KV get (scratch bucket)", f, None);
    row("Bt B with tracing on (info logs + OTLP)", bt, Some(bt_rps));
    row("Ct C with tracing on (info logs + OTLP)", ct, None);
    row("Bf B's floor (its messages + the plugin)", bf, Some(bf_rps));
    row("Cf C's floor (admission's two phases)", cf, None);
    row("Drf Dr's floor (one record read)", drf, None);
    println!();
    let ratio = |x: Duration, y: Duration| x.as_secs_f64() / y.as_secs_f64();
    println!(
        "B/A  p50 {:>6.2}x  p99 {:>6.2}x  throughput {:>6.3}x  (+{:.1} µs p50 over the raw round trip)",
        ratio(b.1, a.1),
        ratio(b.2, a.2),
        b_rps / a_rps,
        us(b.1.saturating_sub(a.1))
    );
    println!(
        "B/Ai p50 {:>6.2}x  p99 {:>6.2}x  (Ai/A p50 {:.2}x: the accounts' import on every API call)",
        ratio(b.1, ai.1),
        ratio(b.2, ai.2),
        ratio(ai.1, a.1)
    );
    println!(
        "C/E  p50 {:>6.2}x  p99 {:>6.2}x",
        ratio(c.1, e.1),
        ratio(c.2, e.2)
    );
    println!(
        "Bt/B p50 {:>6.2}x  p99 {:>6.2}x  throughput {:>6.3}x;  Ct/C p50 {:>6.2}x  p99 {:>6.2}x  ({} spans exported)",
        ratio(bt.1, b.1),
        ratio(bt.2, b.2),
        bt_rps / b_rps,
        ratio(ct.1, c.1),
        ratio(ct.2, c.2),
        bench.spans_exported(),
    );
    for (name, x) in [("D/F ", d), ("Dk/F", dk), ("Dr/F", dr)] {
        println!(
            "{name} p50 {:>6.2}x  p99 {:>6.2}x",
            ratio(x.1, f.1),
            ratio(x.2, f.2)
        );
    }
    println!(
        "the floors (the topology with nothing of the fleet in it) against the goals' baselines, and the fleet's own share:"
    );
    for (name, floor, base, fleet) in [
        ("Bf/A ", bf, a, ("B/Bf  ", b)),
        ("Ai/F ", ai, f, ("Dk/Ai ", dk)),
        ("Drf/F", drf, f, ("Dr/Drf", dr)),
        ("Cf/E ", cf, e, ("C/Cf  ", c)),
    ] {
        println!(
            "{name} p50 {:>6.2}x  p99 {:>6.2}x    {} p50 {:>6.2}x  p99 {:>6.2}x",
            ratio(floor.1, base.1),
            ratio(floor.2, base.2),
            fleet.0,
            ratio(fleet.1.1, floor.1),
            ratio(fleet.1.2, floor.2),
        );
    }
    println!(
        "Bf throughput {:.3}x of A; B {:.3}x of Bf",
        bf_rps / a_rps,
        b_rps / bf_rps
    );
}

/// Sequential A and B samples (each) after the pipelined phase of a profile run.
const PROFILE_SEQUENTIAL: usize = 2_000;

/// `FLEET_BENCH_PROFILE_SECS=<n>`: after the set-up, only B pipelined for `n` seconds (for a profiler attached
/// to this process), then the median throughput of its batches and the p50 of sequential A and B; no criterion
/// pass and no table. With `FLEET_BENCH_PROFILE_TRACED` set, all of it with the production subscriber on (Bt);
/// with `FLEET_BENCH_PROFILE_GET_JOB` set, `tools.getJob` of a finished job is pipelined instead of B; with
/// `FLEET_BENCH_PROFILE_RAW` set, A (the raw round trip: the CPU a request costs at the floor, to compare with);
/// with `FLEET_BENCH_PROFILE_FLOOR` set, Bf (B's messages and plugin round trip with nothing of the fleet).
fn profile_secs() -> Option<Duration> {
    let secs = std::env::var("FLEET_BENCH_PROFILE_SECS").ok()?;
    Some(Duration::from_secs(
        secs.parse().expect("FLEET_BENCH_PROFILE_SECS: whole seconds"),
    ))
}

fn bench(c: &mut Criterion) {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--test") || !args.iter().any(|a| a == "--bench");
    let plan = if quick { Plan::QUICK } else { Plan::FULL };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut b = rt.block_on(Box::pin(Bench::new()));
    if let Some(secs) = profile_secs() {
        if std::env::var_os("FLEET_BENCH_PROFILE_TRACED").is_some() {
            TRACING.store(true, Ordering::Relaxed);
            tracing::callsite::rebuild_interest_cache();
        }
        let t = Instant::now();
        let mut batches = Vec::new();
        let get_job = std::env::var_os("FLEET_BENCH_PROFILE_GET_JOB").is_some();
        let raw = std::env::var_os("FLEET_BENCH_PROFILE_RAW").is_some();
        let floor = std::env::var_os("FLEET_BENCH_PROFILE_FLOOR").is_some();
        while t.elapsed() < secs {
            batches.push(if get_job {
                rt.block_on(b.pipelined_get_job(plan.pipelined))
            } else if floor {
                rt.block_on(b.pipelined_floor(plan.pipelined))
            } else {
                rt.block_on(b.pipelined(!raw, plan.pipelined))
            });
        }
        let (mut a, mut bs) = (Vec::new(), Vec::new());
        for _ in 0..PROFILE_SEQUENTIAL {
            a.push(rt.block_on(b.raw_echo()));
            bs.push(rt.block_on(b.invoke()));
        }
        a.sort();
        bs.sort();
        println!(
            "profile: {} pipelined for {secs:?}, {} batches of {}, median {:.0} req/s; then {PROFILE_SEQUENTIAL} \
             sequential A and B: p50 {:.1} / {:.1} µs (B/A {:.2}x)",
            if get_job {
                "Dk"
            } else if floor {
                "Bf"
            } else if raw {
                "A"
            } else {
                "B"
            },
            batches.len(),
            plan.pipelined,
            median(batches),
            us(pct(&a, 50.0)),
            us(pct(&bs, 50.0)),
            pct(&bs, 50.0).as_secs_f64() / pct(&a, 50.0).as_secs_f64(),
        );
        rt.block_on(b.shutdown());
        return;
    }
    {
        let mut g = c.benchmark_group("fleet_roundtrip");
        g.sampling_mode(SamplingMode::Flat)
            .sample_size(10)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2));
        for (name, m) in [
            ("A_raw_echo", Measure::RawEcho),
            ("B_invoke", Measure::Invoke),
            ("E_kv_put", Measure::KvPut),
            ("F_kv_get", Measure::KvGet),
        ] {
            g.bench_function(name, |bn| bn.iter_custom(|iters| rt.block_on(b.repeat(m, iters))));
        }
        g.finish();
    }
    let samples = rt.block_on(interleaved(&mut b, plan));
    print_table(samples, plan, &b);
    rt.block_on(b.shutdown());
}

criterion_group!(benches, bench);
criterion_main!(benches);
