//! Frame-parse throughput of the stdio codec, against physical baselines measured in the same run.
//!
//! For each corpus (`fleet_benches::corpora`) four ways to consume the same byte stream:
//! - `memchr_split` — find every LF and touch nothing else: the floor, no parser can beat it;
//! - `codec` — `FrameDecoder`: split, UTF-8 check, classify, keep payload as byte ranges (what the worker runs);
//! - `serde_value` — split + `serde_json::from_slice::<Value>` per line: the naive host;
//! - `simd_borrowed` — split + simd-json `to_borrowed_value_with_buffers` per line (buffers reused; the line
//!   copied into a scratch buffer first, since simd-json parses in place): the candidate replacement.
//!
//! After criterion's runs, an interleaved pass (ABCD ABCD …, median of 15 rounds) prints the ratios, so slow
//! and fast phases of a noisy machine hit every method alike.
#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::cast_possible_truncation)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use fleet_benches::{Corpus, corpora};
use fleet_proto::codec::FrameDecoder;
use fleet_proto::limits::MAX_FRAME_BYTES;

fn memchr_split(bytes: &[u8]) -> usize {
    let mut n = 0;
    let mut start = 0;
    while let Some(i) = memchr::memchr(b'\n', &bytes[start..]) {
        n += i;
        start += i + 1;
    }
    n
}

fn codec(bytes: &[u8]) -> usize {
    let mut dec = FrameDecoder::new(MAX_FRAME_BYTES);
    // The adapter reads into a BytesMut; model one read of the whole stream.
    let mut buf = BytesMut::from(bytes);
    let mut n = 0;
    while let Some(f) = dec.decode(&mut buf) {
        n += f.map(|f| f.payload_json().map_or(0, str::len)).unwrap_or(0);
    }
    n
}

fn serde_value(bytes: &[u8]) -> usize {
    let mut n = 0;
    for line in bytes.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        let v: serde_json::Value = serde_json::from_slice(line).unwrap();
        n += usize::from(v.get("id").is_some());
    }
    n
}

fn simd_borrowed(bytes: &[u8], scratch: &mut Vec<u8>, buffers: &mut simd_json::Buffers) -> usize {
    use simd_json::prelude::*;
    let mut n = 0;
    for line in bytes.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        scratch.clear();
        scratch.extend_from_slice(line);
        let v = simd_json::to_borrowed_value_with_buffers(scratch, buffers).unwrap();
        n += usize::from(v.get("id").is_some());
    }
    n
}

fn bench(c: &mut Criterion) {
    for corpus in corpora() {
        let mut g = c.benchmark_group(format!("frame_parse/{}", corpus.name));
        g.throughput(Throughput::Bytes(corpus.bytes.len() as u64));
        g.sample_size(20)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(3));
        let bytes = corpus.bytes.as_slice();
        g.bench_function("memchr_split", |b| b.iter(|| memchr_split(black_box(bytes))));
        g.bench_function("codec", |b| b.iter(|| codec(black_box(bytes))));
        g.bench_function("serde_value", |b| b.iter(|| serde_value(black_box(bytes))));
        let mut scratch = Vec::new();
        let mut buffers = simd_json::Buffers::default();
        g.bench_function("simd_borrowed", |b| {
            b.iter(|| simd_borrowed(black_box(bytes), &mut scratch, &mut buffers))
        });
        g.finish();
    }
    print_ratios(&corpora());
}

fn time(f: &mut dyn FnMut() -> usize) -> Duration {
    let t = Instant::now();
    black_box(f());
    t.elapsed()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn print_ratios(corpora: &[Corpus]) {
    println!();
    println!("frame_parse ratios (interleaved, median of 15 rounds; MB/s = 10^6 bytes/s)");
    println!(
        "{:<14} {:>7} {:>11} {:>11} {:>11} {:>11} {:>12} {:>12} {:>12}",
        "corpus",
        "frames",
        "floor MB/s",
        "codec MB/s",
        "serde MB/s",
        "simd MB/s",
        "codec/floor",
        "codec/serde",
        "codec/simd"
    );
    for c in corpora {
        let bytes = c.bytes.as_slice();
        let mut scratch = Vec::new();
        let mut buffers = simd_json::Buffers::default();
        let (mut floor, mut ours, mut serde, mut simd) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..15 {
            floor.push(time(&mut || memchr_split(bytes)));
            ours.push(time(&mut || codec(bytes)));
            serde.push(time(&mut || serde_value(bytes)));
            simd.push(time(&mut || simd_borrowed(bytes, &mut scratch, &mut buffers)));
        }
        let (floor, ours, serde, simd) = (median(floor), median(ours), median(serde), median(simd));
        let mbps = |d: Duration| bytes.len() as f64 / d.as_secs_f64() / 1e6;
        println!(
            "{:<14} {:>7} {:>11.0} {:>11.0} {:>11.0} {:>11.0} {:>11.2}x {:>11.2}x {:>11.2}x",
            c.name,
            c.frames,
            mbps(floor),
            mbps(ours),
            mbps(serde),
            mbps(simd),
            mbps(ours) / mbps(floor),
            mbps(ours) / mbps(serde),
            mbps(ours) / mbps(simd),
        );
    }
    println!(
        "(codec/floor < 1: the share of the LF-scan speed the full classification keeps; codec/serde and"
    );
    println!(" codec/simd > 1: how much faster the codec is than parsing each line into a value tree)");
}

criterion_group!(benches, bench);
criterion_main!(benches);
