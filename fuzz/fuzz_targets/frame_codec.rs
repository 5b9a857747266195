//! The stdio frame codec (`fleet_proto::codec`): a plugin's stdout split into frames and classified
//! (request, notification, response, error response, file transport), fed in chunks of a fuzzed size, and the
//! Animus classification of what the frames carry (run events, run errors).
//!
//! Checked: nothing panics; a frame re-parses to itself; its payload is JSON; feeding the bytes in chunks gives
//! the same frames and errors as feeding them whole.
#![no_main]

use bytes::{Bytes, BytesMut};
use fleet_proto::animus::{RunEvent, classify_run_error};
use fleet_proto::codec::{Frame, FrameDecoder, FrameError, FrameKind};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

/// What one decoding produced, to compare the chunked and the whole feed.
#[derive(Debug, PartialEq)]
enum Item {
    Frame(Bytes),
    Error(&'static str),
}

fn decode_all(input: &[u8], max: usize, step: usize) -> Vec<Item> {
    let mut decoder = FrameDecoder::new(max);
    let mut buf = BytesMut::new();
    let mut items = Vec::new();
    for chunk in input.chunks(step.max(1)) {
        buf.extend_from_slice(chunk);
        while let Some(item) = decoder.decode(&mut buf) {
            items.push(inspect(item));
        }
    }
    while let Some(item) = decoder.decode_eof(&mut buf) {
        items.push(inspect(item));
    }
    items
}

fn inspect(item: Result<Frame, FrameError>) -> Item {
    match item {
        Ok(frame) => {
            let again = Frame::parse(frame.as_bytes().clone()).expect("a frame's line re-parses");
            assert!(again == frame, "a frame re-parses to itself");
            let _ = (
                frame.id(),
                frame.as_str(),
                frame.detached(),
                frame.file_transport_path(),
            );
            for part in [frame.payload_json(), frame.params_json(), frame.result_json()]
                .into_iter()
                .flatten()
            {
                serde_json::from_str::<serde::de::IgnoredAny>(part).expect("a payload is JSON");
            }
            let payload = frame.parse_payload::<Value>();
            match frame.kind() {
                FrameKind::Notification | FrameKind::Request => {
                    let method = frame.method().expect("a request has a method");
                    if let Ok(Some(params)) = &payload {
                        let _ = RunEvent::classify(method, params);
                    }
                }
                FrameKind::ErrorResponse => {
                    if let Some(Ok(error)) = frame.error() {
                        let _ = classify_run_error(error.code, error.data.as_ref());
                    }
                }
                FrameKind::Response | FrameKind::FileTransport => {}
            }
            Item::Frame(frame.as_bytes().clone())
        }
        Err(e) => {
            let _ = (e.to_string(), e.to_error_object());
            Item::Error(e.kind())
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let [split, limit, input @ ..] = data else {
        return;
    };
    // A small limit now and then, so the over-limit paths are reached with small inputs.
    let max = if limit & 1 == 0 {
        fleet_proto::limits::MAX_FRAME_BYTES
    } else {
        8 + usize::from(*limit)
    };
    let whole = decode_all(input, max, input.len());
    let chunked = decode_all(input, max, usize::from(*split));
    assert_eq!(whole, chunked, "chunked decoding equals whole decoding");
    let _ = inspect(Frame::parse(Bytes::copy_from_slice(input)));
});
