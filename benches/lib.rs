//! Shared corpora for the benchmarks, kept out of the bench files so each bench measures only its subject.
//!
//! Every corpus is deterministic (no randomness), so runs and machines compare like with like.
#![forbid(unsafe_code)]

use std::time::Duration;

use serde_json::json;

/// Nearest-rank percentile `p` (0–100) of sorted samples (at least one).
#[allow(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_precision_loss
)]
pub fn pct(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// A duration in microseconds.
pub fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// One corpus: a name and a byte stream of LF-terminated JSON-RPC frames.
#[derive(Debug, Clone)]
pub struct Corpus {
    /// Short name used in benchmark ids.
    pub name: &'static str,
    /// The frames, each ending in LF.
    pub bytes: Vec<u8>,
    /// How many frames.
    pub frames: usize,
}

fn frame(v: &serde_json::Value) -> Vec<u8> {
    let mut out = serde_json::to_vec(v).unwrap_or_default();
    out.push(b'\n');
    out
}

/// A ≈200-byte `invoke` request.
pub fn request_frame(i: u64) -> Vec<u8> {
    frame(&json!({
        "jsonrpc": "2.0", "id": i, "method": "invoke",
        "params": {"tool": "search", "arguments": {"query": "weather in Paris", "limit": 5},
                   "context": {"invoke_id": format!("tjob_{:032x}", i), "deadline_ms": 1_767_225_600_000u64}}
    }))
}

/// An `invoke` result whose `data` holds text of about `size` bytes, with some escapes and non-ASCII,
/// nested like real tool output.
pub fn result_frame(i: u64, size: usize) -> Vec<u8> {
    let unit =
        "Lorem ipsum dolor sit amet, \"quoted\" \\ back-slashed, caf\u{e9} \u{65e5}\u{672c}, tab\there.\n";
    let items: Vec<_> = (0..(size / 160).max(1))
        .map(|k| json!({"rank": k, "title": format!("result {k}"), "snippet": unit}))
        .collect();
    frame(&json!({
        "jsonrpc": "2.0", "id": i,
        "result": {"success": true, "data": {"items": items, "total": items.len()}, "duration_ms": 12}
    }))
}

/// A progress notification.
pub fn progress_frame(i: u64) -> Vec<u8> {
    frame(&json!({
        "jsonrpc": "2.0", "method": "executa/progress",
        "params": {"type": "progress", "data": {"step": i, "total": 100, "message": "working"},
                   "context": {"invoke_id": format!("tjob_{:032x}", i)}}
    }))
}

fn build(name: &'static str, target_bytes: usize, mut next: impl FnMut(u64) -> Vec<u8>) -> Corpus {
    let mut bytes = Vec::with_capacity(target_bytes + 2 * 1024 * 1024);
    let mut frames = 0;
    while bytes.len() < target_bytes {
        bytes.extend_from_slice(&next(frames as u64));
        frames += 1;
    }
    Corpus { name, bytes, frames }
}

/// The fixed corpora of `benches/frame_parse.rs`: ≈200 B requests, ≈2 KB results, 64 KB results, 1 MiB
/// results, and a mix (per 100 frames: 60 requests, 30 progress events, 8 × 2 KB, 1 × 64 KB, 1 × 1 MiB).
pub fn corpora() -> Vec<Corpus> {
    const TARGET: usize = 4 * 1024 * 1024;
    vec![
        build("request_200B", TARGET, request_frame),
        build("result_2KB", TARGET, |i| result_frame(i, 2 * 1024)),
        build("result_64KB", TARGET, |i| result_frame(i, 64 * 1024)),
        build("result_1MiB", 8 * 1024 * 1024, |i| result_frame(i, 1024 * 1024)),
        build("mix", 2 * TARGET, |i| match i % 100 {
            0..=59 => request_frame(i),
            60..=89 => progress_frame(i),
            90..=97 => result_frame(i, 2 * 1024),
            98 => result_frame(i, 64 * 1024),
            _ => result_frame(i, 1024 * 1024),
        }),
    ]
}
