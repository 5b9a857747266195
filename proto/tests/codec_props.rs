//! Property tests: no byte stream, cut into reads of any sizes, panics the codec; valid frames always come
//! out intact and in order, whatever junk surrounds them; memory stays bounded by the frame limit.
#![allow(clippy::unwrap_used)]

use bytes::{BufMut, BytesMut};
use fleet_proto::codec::{Frame, FrameDecoder, FrameError};
use proptest::prelude::*;

/// Runs the decoder over `data` cut at the given read sizes; returns outcomes and the peak buffer length.
fn run(max: usize, data: &[u8], reads: &[usize]) -> (Vec<Result<Frame, FrameError>>, usize) {
    let mut dec = FrameDecoder::new(max);
    let mut buf = BytesMut::new();
    let mut out = Vec::new();
    let mut peak = 0;
    let mut pos = 0;
    let mut k = 0;
    while pos < data.len() {
        let step = reads.get(k % reads.len().max(1)).copied().unwrap_or(1).max(1);
        k += 1;
        let end = (pos + step).min(data.len());
        buf.put_slice(&data[pos..end]);
        pos = end;
        peak = peak.max(buf.len());
        while let Some(item) = dec.decode(&mut buf) {
            out.push(item);
        }
    }
    while let Some(item) = dec.decode_eof(&mut buf) {
        out.push(item);
    }
    (out, peak)
}

fn message() -> impl Strategy<Value = serde_json::Value> {
    let id = prop_oneof![
        any::<u32>().prop_map(serde_json::Value::from),
        "[a-z0-9-]{1,12}".prop_map(serde_json::Value::from)
    ];
    let text = "\\PC{0,40}";
    prop_oneof![
        (id.clone(), "[a-z/]{1,20}", text)
            .prop_map(|(id, m, t)| serde_json::json!({"jsonrpc":"2.0","id":id,"method":m,"params":{"t":t}})),
        ("[a-z/]{1,20}", text)
            .prop_map(|(m, t)| serde_json::json!({"jsonrpc":"2.0","method":m,"params":[t]})),
        (id.clone(), text)
            .prop_map(|(id, t)| serde_json::json!({"jsonrpc":"2.0","id":id,"result":{"data":t}})),
        (id, any::<i32>(), text).prop_map(
            |(id, c, t)| serde_json::json!({"jsonrpc":"2.0","id":id,"error":{"code":c,"message":t}})
        ),
    ]
}

fn junk() -> impl Strategy<Value = Vec<u8>> {
    // Arbitrary bytes without LF: a junk line.
    proptest::collection::vec(any::<u8>().prop_filter("no LF", |b| *b != b'\n'), 0..200)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..4096),
                                   reads in proptest::collection::vec(1usize..512, 1..8),
                                   max in 1usize..256) {
        let (out, peak) = run(max, &data, &reads);
        // Every frame that comes out is within the limit.
        for f in out.iter().flatten() {
            prop_assert!(f.as_bytes().len() <= max);
        }
        // The buffer never holds more than the limit plus one read (plus one CR of slack).
        prop_assert!(peak <= max + 1 + reads.iter().max().unwrap());
    }

    #[test]
    fn arbitrary_lines_never_panic(lines in proptest::collection::vec(junk(), 0..30),
                                   reads in proptest::collection::vec(1usize..64, 1..5)) {
        let data: Vec<u8> = lines.iter().flat_map(|l| l.iter().copied().chain([b'\n'])).collect();
        let (out, _) = run(1 << 20, &data, &reads);
        // At most one outcome per line.
        prop_assert!(out.len() <= lines.len());
    }

    #[test]
    fn valid_frames_survive_any_chunking_and_surrounding_junk(
        items in proptest::collection::vec((message(), junk(), any::<bool>(), any::<bool>()), 1..20),
        reads in proptest::collection::vec(1usize..300, 1..6),
    ) {
        let mut data = Vec::new();
        let mut expected = Vec::new();
        for (msg, junk, crlf, with_junk) in &items {
            let line = serde_json::to_vec(msg).unwrap();
            expected.push(line.clone());
            data.extend_from_slice(&line);
            data.extend_from_slice(if *crlf { b"\r\n" } else { b"\n" });
            if *with_junk {
                // A junk line that cannot be JSON (starts with '#').
                data.push(b'#');
                data.extend_from_slice(junk);
                data.push(b'\n');
            }
        }
        let (out, _) = run(1 << 20, &data, &reads);
        let frames: Vec<Vec<u8>> = out.iter().filter_map(|r| r.as_ref().ok()).map(|f| f.as_bytes().to_vec()).collect();
        prop_assert_eq!(frames, expected);
        let errors = out.iter().filter(|r| r.is_err()).count();
        prop_assert_eq!(errors, items.iter().filter(|i| i.3).count());
    }
}
