//! Whether `tools.invokeAsync`'s admission should be one atomic batch (nats-server ≥ 2.12) instead of today's
//! three sequential JetStream round trips — the measurement issue 16 asks for before changing the data model.
//!
//! Today's admission (`fleet_store::Store::admit_job`) writes three KV keys in three buckets: the user's active
//! set (read, then compare-and-set), the job record (create) and the user's index head (read while the set is
//! edited, written while the record is created) — three round trips in sequence. An atomic batch needs all three
//! keys in one stream (one bucket), each message carrying its own `Nats-Expected-Last-Subject-Sequence`, the last
//! one `Nats-Batch-Commit` as the one request: after the reads, one round trip.
//!
//! Measured in one interleaved pass per topology (a KV bucket of 600-byte values, file storage as the fleet's
//! buckets):
//! - E one KV `put` (the unit of C/E in `fleet_roundtrip`);
//! - Eb one atomic batch of the three writes (set at its revision, record created, head at its revision);
//! - E3 today's shape: set ‖ head read, set compare-and-set, record create ‖ head update.
//!
//! on one server (R1, as `fleet up` and the suite run) and on three clustered servers (R3, as the Helm chart).
//! Run: `cargo bench -p fleet-benches --bench atomic_batch`.
#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::cast_precision_loss)]

use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::{self, kv};
use bytes::Bytes;
use fleet::nats_server::{NatsServer, free_port};
use fleet_benches::{pct, us};
use fleet_client::creds::Role;

const ROUNDS: usize = 1000;
const QUICK_ROUNDS: usize = 5;
const VALUE_BYTES: usize = 600;
const BUCKET: &str = "fleet_bench_atomic";

#[derive(Default)]
struct Samples {
    e: Vec<Duration>,
    eb: Vec<Duration>,
    e3: Vec<Duration>,
    /// E3 attempts lost to a stale read (a replica's copy behind the leader's): retried, counted.
    e3_retries: usize,
}

async fn measure(nats: &NatsServer, replicas: usize, rounds: usize) -> Samples {
    let nc = nats.connect(Role::Front).await.unwrap();
    let js = jetstream::new(nc.clone());
    let kvs = js
        .create_key_value(kv::Config {
            bucket: BUCKET.into(),
            history: 1,
            num_replicas: replicas,
            storage: jetstream::stream::StorageType::File,
            ..Default::default()
        })
        .await
        .unwrap();
    let stream = format!("KV_{BUCKET}");
    let mut config = js
        .get_stream(&stream)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .config
        .clone();
    config.allow_atomic_publish = true;
    js.update_stream(config).await.unwrap();

    let value = Bytes::from(vec![b'x'; VALUE_BYTES]);
    let subject = |key: &str| format!("$KV.{BUCKET}.{key}");
    let mut set_rev = kvs.put("set.u", value.clone()).await.unwrap();
    let mut head_rev = kvs.put("head.u", value.clone()).await.unwrap();
    let mut s = Samples::default();
    for i in 0..rounds {
        let t = Instant::now();
        kvs.put(format!("e.{i}"), value.clone()).await.unwrap();
        s.e.push(t.elapsed());

        let t = Instant::now();
        let id = format!("b{i}");
        let headers = |seq: usize, expected: u64, commit: bool| {
            let mut h = HeaderMap::new();
            h.insert("Nats-Batch-Id", id.as_str());
            h.insert("Nats-Batch-Sequence", seq.to_string().as_str());
            h.insert(
                "Nats-Expected-Last-Subject-Sequence",
                expected.to_string().as_str(),
            );
            if commit {
                h.insert("Nats-Batch-Commit", "1");
            }
            h
        };
        nc.publish_with_headers(subject("set.u"), headers(1, set_rev, false), value.clone())
            .await
            .unwrap();
        nc.publish_with_headers(subject(&format!("rec.{i}")), headers(2, 0, false), value.clone())
            .await
            .unwrap();
        let ack = nc
            .request_with_headers(subject("head.u"), headers(3, head_rev, true), value.clone())
            .await
            .unwrap();
        s.eb.push(t.elapsed());
        let ack: serde_json::Value = serde_json::from_slice(&ack.payload).unwrap();
        // Committed whole: its last message follows the two others (E3 below reads both keys afresh).
        assert_eq!(ack["count"].as_u64(), Some(3), "batch refused: {ack}");

        let t = Instant::now();
        loop {
            let (set, head) = tokio::join!(kvs.entry("set.u"), kvs.entry("head.u"));
            let (set, head) = (set.unwrap().unwrap(), head.unwrap().unwrap());
            let Ok(rev) = kvs.update("set.u", value.clone(), set.revision).await else {
                s.e3_retries += 1;
                continue;
            };
            set_rev = rev;
            let key = format!("rec3.{i}.{}", s.e3_retries);
            let (created, head) = tokio::join!(
                kvs.create(key, value.clone()),
                kvs.update("head.u", value.clone(), head.revision)
            );
            created.unwrap();
            let Ok(rev) = head else {
                s.e3_retries += 1;
                continue;
            };
            head_rev = rev;
            break;
        }
        s.e3.push(t.elapsed());
    }
    s
}

fn p(v: &[Duration], q: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort();
    us(pct(&v, q))
}

fn report(label: &str, s: &Samples) {
    let e = p(&s.e, 50.0);
    println!(
        "{label:<28} E p50 {e:>7.0} µs  Eb p50 {:>7.0} µs ({:>5.2}x E, p99 {:>7.0})  E3 p50 {:>7.0} µs ({:>5.2}x E, \
         p99 {:>7.0}; {} stale reads retried)",
        p(&s.eb, 50.0),
        p(&s.eb, 50.0) / e,
        p(&s.eb, 99.0),
        p(&s.e3, 50.0),
        p(&s.e3, 50.0) / e,
        p(&s.e3, 99.0),
        s.e3_retries
    );
}

fn main() {
    // `cargo bench` passes `--bench`; run as a test (`--test`, or no flag) it takes a few rounds on one server.
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--test") || !args.iter().any(|a| a == "--bench");
    let rounds = if quick { QUICK_ROUNDS } else { ROUNDS };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let one = NatsServer::start(&dir.path().join("r1")).unwrap();
    let r1 = rt.block_on(measure(&one, 1, rounds));
    drop(one);
    println!("atomic_batch ({rounds} rounds, {VALUE_BYTES}-byte values, file storage)");
    report("R1 (one server)", &r1);
    if !quick {
        let three = NatsServer::start_cluster(&dir.path().join("r3"), 3, free_port().unwrap()).unwrap();
        let r3 = rt.block_on(measure(&three, 3, rounds));
        drop(three);
        report("R3 (three servers)", &r3);
    }
}
