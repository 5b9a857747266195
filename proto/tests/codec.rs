//! The frame codec against every case the foundation issue names, each asserting the exact outcome.
#![allow(clippy::unwrap_used, clippy::cast_possible_truncation)]

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{BufMut, BytesMut};
use fleet_proto::codec::io::{FrameReader, FrameWriter, ReadError, WRITE_QUEUE, WriteError};
use fleet_proto::codec::{EncodeError, Frame, FrameDecoder, FrameError, FrameKind, NotJsonRpc, encode_frame};
use fleet_proto::jsonrpc::{ErrorObject, Id, Response};
use fleet_proto::limits::MAX_FRAME_BYTES;
use serde_json::json;
use tokio::io::{AsyncRead, ReadBuf};

/// Feeds `chunks` to a fresh decoder, then signals EOF; returns every outcome in order.
fn decode_chunks(max: usize, chunks: &[&[u8]]) -> Vec<Result<Frame, FrameError>> {
    let mut dec = FrameDecoder::new(max);
    let mut buf = BytesMut::new();
    let mut out = Vec::new();
    for chunk in chunks {
        buf.put_slice(chunk);
        while let Some(item) = dec.decode(&mut buf) {
            out.push(item);
        }
    }
    while let Some(item) = dec.decode_eof(&mut buf) {
        out.push(item);
    }
    out
}

fn decode_all(input: &[u8]) -> Vec<Result<Frame, FrameError>> {
    decode_chunks(MAX_FRAME_BYTES, &[input])
}

fn only_frame(input: &[u8]) -> Frame {
    let mut out = decode_all(input);
    assert_eq!(out.len(), 1, "expected exactly one outcome, got {out:?}");
    out.remove(0).unwrap()
}

fn only_error(input: &[u8]) -> FrameError {
    let mut out = decode_all(input);
    assert_eq!(out.len(), 1, "expected exactly one outcome, got {out:?}");
    out.remove(0).unwrap_err()
}

fn not_json_rpc(input: &[u8]) -> NotJsonRpc {
    match only_error(input) {
        FrameError::NotJsonRpc { reason, .. } => reason,
        other => panic!("expected NotJsonRpc, got {other:?}"),
    }
}

/// An `AsyncRead` that returns its data in fixed-size pieces, then EOF (or an error).
struct Chunked {
    data: Vec<u8>,
    pos: usize,
    step: usize,
    fail_at_end: bool,
}

impl AsyncRead for Chunked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.pos >= self.data.len() {
            if self.fail_at_end {
                return Poll::Ready(Err(io::Error::new(io::ErrorKind::BrokenPipe, "pipe broke")));
            }
            return Poll::Ready(Ok(()));
        }
        let n = self.step.min(self.data.len() - self.pos).min(buf.remaining());
        let start = self.pos;
        buf.put_slice(&self.data[start..start + n]);
        self.pos += n;
        Poll::Ready(Ok(()))
    }
}

async fn read_all<R: AsyncRead + Unpin>(mut r: FrameReader<R>) -> Vec<Result<Frame, ReadError>> {
    let mut out = Vec::new();
    while let Some(item) = r.next().await {
        out.push(item);
    }
    out
}

const REQ: &[u8] =
    br#"{"jsonrpc":"2.0","id":1,"method":"invoke","params":{"tool":"echo","arguments":{"x":1}}}"#;

#[test]
fn single_frame() {
    let mut line = REQ.to_vec();
    line.push(b'\n');
    let f = only_frame(&line);
    assert_eq!(f.kind(), FrameKind::Request);
    assert_eq!(f.id(), Some(&Id::number(1)));
    assert_eq!(f.method(), Some("invoke"));
    assert_eq!(f.params_json(), Some(r#"{"tool":"echo","arguments":{"x":1}}"#));
    assert_eq!(f.as_bytes().as_ref(), REQ);
}

#[test]
fn two_frames_in_one_read() {
    let input =
        b"{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}\n{\"jsonrpc\":\"2.0\",\"id\":2,\"result\":[]}\n";
    let out = decode_all(input);
    assert_eq!(out.len(), 2);
    let ids: Vec<_> = out
        .iter()
        .map(|r| r.as_ref().unwrap().id().unwrap().as_u64().unwrap())
        .collect();
    assert_eq!(ids, [1, 2]);
    assert_eq!(out[0].as_ref().unwrap().result_json(), Some("{}"));
    assert_eq!(out[1].as_ref().unwrap().result_json(), Some("[]"));
}

#[tokio::test]
async fn one_frame_over_many_one_byte_reads() {
    let mut data = REQ.to_vec();
    data.push(b'\n');
    let reader = FrameReader::new(Chunked {
        data,
        pos: 0,
        step: 1,
        fail_at_end: false,
    });
    let out = read_all(reader).await;
    assert_eq!(out.len(), 1);
    let f = out.into_iter().next().unwrap().unwrap();
    assert_eq!(f.method(), Some("invoke"));
    assert_eq!(f.as_bytes().as_ref(), REQ);
}

#[test]
fn frame_split_across_reads_at_every_position() {
    let mut data = REQ.to_vec();
    data.push(b'\n');
    for cut in 1..data.len() {
        let out = decode_chunks(MAX_FRAME_BYTES, &[&data[..cut], &data[cut..]]);
        assert_eq!(out.len(), 1, "cut at {cut}");
        assert_eq!(out[0].as_ref().unwrap().as_bytes().as_ref(), REQ, "cut at {cut}");
    }
}

#[test]
fn crlf_is_tolerated() {
    let f = only_frame(b"{\"jsonrpc\":\"2.0\",\"method\":\"executa/progress\",\"params\":{}}\r\n");
    assert_eq!(f.kind(), FrameKind::Notification);
    assert_eq!(f.as_bytes().last(), Some(&b'}'));
}

#[test]
fn blank_lines_are_skipped() {
    let out = decode_all(b"\n\n   \n\r\n\t\n{\"jsonrpc\":\"2.0\",\"id\":3,\"result\":true}\n\n");
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].as_ref().unwrap().result_json(), Some("true"));
}

#[test]
fn junk_line_between_frames_is_reported_and_the_stream_goes_on() {
    let out = decode_all(
        b"{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":1}\nStarting server on port 8080...\n{\"jsonrpc\":\"2.0\",\"id\":2,\"result\":2}\n",
    );
    assert_eq!(out.len(), 3);
    assert_eq!(out[0].as_ref().unwrap().result_json(), Some("1"));
    match &out[1] {
        Err(FrameError::InvalidJson { excerpt, .. }) => {
            assert_eq!(excerpt, "Starting server on port 8080...")
        }
        other => panic!("expected InvalidJson, got {other:?}"),
    }
    assert_eq!(out[2].as_ref().unwrap().result_json(), Some("2"));
}

#[test]
fn junk_excerpt_is_bounded() {
    let junk = vec![b'x'; 10_000];
    match only_error(&[junk.as_slice(), b"\n"].concat()) {
        FrameError::InvalidJson { excerpt, .. } => {
            assert_eq!(excerpt.chars().count(), 257);
            assert!(excerpt.ends_with('…'));
        }
        other => panic!("expected InvalidJson, got {other:?}"),
    }
}

#[test]
fn json_that_is_not_an_object() {
    for (input, found) in [
        (&b"[1,2,3]\n"[..], "an array"),
        (b"\"hello\"\n", "a string"),
        (b"42\n", "a number"),
        (b"null\n", "null"),
        (b"true\n", "a boolean"),
    ] {
        match only_error(input) {
            FrameError::NotAnObject { found: f, .. } => assert_eq!(f, found),
            other => panic!("{input:?}: expected NotAnObject, got {other:?}"),
        }
    }
}

#[test]
fn array_shaped_like_a_message_is_not_an_object() {
    // serde would happily map a sequence onto a struct by position; the codec must not.
    match only_error(b"[\"2.0\",1,\"invoke\"]\n") {
        FrameError::NotAnObject { found, .. } => assert_eq!(found, "an array"),
        other => panic!("expected NotAnObject, got {other:?}"),
    }
}

#[test]
fn object_without_jsonrpc() {
    assert_eq!(
        not_json_rpc(b"{\"id\":1,\"result\":{}}\n"),
        NotJsonRpc::MissingVersion
    );
}

#[test]
fn wrong_jsonrpc_version() {
    assert_eq!(
        not_json_rpc(b"{\"jsonrpc\":\"1.0\",\"id\":1,\"result\":{}}\n"),
        NotJsonRpc::WrongVersion
    );
    assert_eq!(
        not_json_rpc(b"{\"jsonrpc\":2.0,\"id\":1,\"result\":{}}\n"),
        NotJsonRpc::WrongVersion
    );
}

#[test]
fn response_with_both_result_and_error() {
    assert_eq!(
        not_json_rpc(
            b"{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{},\"error\":{\"code\":1,\"message\":\"m\"}}\n"
        ),
        NotJsonRpc::BothResultAndError
    );
}

#[test]
fn object_with_neither_method_nor_result() {
    assert_eq!(
        not_json_rpc(b"{\"jsonrpc\":\"2.0\",\"id\":1}\n"),
        NotJsonRpc::NeitherMethodNorResult
    );
}

#[test]
fn response_without_id() {
    assert_eq!(
        not_json_rpc(b"{\"jsonrpc\":\"2.0\",\"result\":{}}\n"),
        NotJsonRpc::ResponseWithoutId
    );
}

#[test]
fn request_carrying_a_result() {
    assert_eq!(
        not_json_rpc(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"m\",\"result\":{}}\n"),
        NotJsonRpc::RequestWithResult
    );
}

#[test]
fn method_that_is_not_a_string() {
    assert_eq!(
        not_json_rpc(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":7}\n"),
        NotJsonRpc::MethodNotString
    );
}

#[test]
fn scalar_params() {
    assert_eq!(
        not_json_rpc(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"m\",\"params\":5}\n"),
        NotJsonRpc::ParamsNotStructured
    );
    // `params: null` is the same as no params.
    let f = only_frame(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"m\",\"params\":null}\n");
    assert_eq!(f.params_json(), None);
}

#[test]
fn ids_of_the_wrong_type() {
    assert_eq!(
        not_json_rpc(b"{\"jsonrpc\":\"2.0\",\"id\":{},\"method\":\"m\"}\n"),
        NotJsonRpc::InvalidId("an object")
    );
    assert_eq!(
        not_json_rpc(b"{\"jsonrpc\":\"2.0\",\"id\":[1],\"result\":1}\n"),
        NotJsonRpc::InvalidId("an array")
    );
    assert_eq!(
        not_json_rpc(b"{\"jsonrpc\":\"2.0\",\"id\":true,\"result\":1}\n"),
        NotJsonRpc::InvalidId("a boolean")
    );
}

#[test]
fn duplicate_members() {
    assert_eq!(
        not_json_rpc(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"id\":2,\"result\":{}}\n"),
        NotJsonRpc::DuplicateMember("`id`".into())
    );
}

#[test]
fn ids_round_trip_unchanged() {
    for (raw, is_string) in [
        ("\"7\"", true),
        ("7", false),
        ("1.5e3", false),
        ("\"req-7\"", true),
        ("-0", false),
    ] {
        let line =
            format!("{{\"jsonrpc\":\"2.0\",\"id\":{raw},\"method\":\"storage/get\",\"params\":{{}}}}\n");
        let f = only_frame(line.as_bytes());
        let id = f.id().unwrap().clone();
        assert_eq!(id.as_json(), raw);
        assert_eq!(id.is_string(), is_string);
        let reply = serde_json::to_string(&Response::ok(id, json!({}))).unwrap();
        assert_eq!(
            reply,
            format!("{{\"jsonrpc\":\"2.0\",\"id\":{raw},\"result\":{{}}}}")
        );
    }
    assert_eq!(Id::string("7").as_u64(), None);
    assert_eq!(Id::number(7).as_u64(), Some(7));
}

#[test]
fn unicode_escapes() {
    let f = only_frame(
        "{\"jsonrpc\":\"2.0\",\"id\":\"\\u00e9t\u{e9}\",\"method\":\"\\u0069nvoke\",\"params\":{\"t\":\"\\ud83d\\ude00 日本\"}}\n"
            .as_bytes(),
    );
    assert_eq!(f.method(), Some("invoke"));
    assert_eq!(f.id().unwrap().as_json(), "\"\\u00e9t\u{e9}\"");
    assert_eq!(f.id().unwrap().as_str().as_deref(), Some("\u{e9}t\u{e9}"));
    let params: serde_json::Value = f.parse_payload().unwrap().unwrap();
    assert_eq!(params["t"], "\u{1f600} 日本");
}

#[test]
fn invalid_utf8_fails_that_frame_only() {
    let mut input = b"{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":\"\xff\xfe\"}\n".to_vec();
    input.extend_from_slice(b"{\"jsonrpc\":\"2.0\",\"id\":2,\"result\":\"ok\"}\n");
    let out = decode_all(&input);
    assert_eq!(out.len(), 2);
    match &out[0] {
        Err(FrameError::InvalidUtf8 { valid_up_to, .. }) => {
            assert_eq!(*valid_up_to, br#"{"jsonrpc":"2.0","id":1,"result":""#.len())
        }
        other => panic!("expected InvalidUtf8, got {other:?}"),
    }
    assert_eq!(out[1].as_ref().unwrap().result_json(), Some("\"ok\""));
}

/// A response frame of exactly `len` bytes.
fn response_of_len(len: usize) -> Vec<u8> {
    let head = b"{\"jsonrpc\":\"2.0\",\"id\":9,\"result\":\"";
    let tail = b"\"}";
    let mut v = head.to_vec();
    v.resize(len - tail.len(), b'a');
    v.extend_from_slice(tail);
    assert_eq!(v.len(), len);
    v
}

#[test]
fn frame_of_exactly_the_limit_is_accepted() {
    let max = 100;
    for terminator in [&b"\n"[..], b"\r\n"] {
        let frame = response_of_len(max);
        let out = decode_chunks(max, &[&frame, terminator]);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].as_ref().unwrap().as_bytes().len(), max);
    }
}

#[test]
fn limit_plus_one_is_frame_too_large_and_the_next_frame_is_read() {
    let max = 100;
    let big = response_of_len(max + 1);
    let next = b"{\"jsonrpc\":\"2.0\",\"id\":10,\"result\":1}\n";
    // Whole, and in 7-byte pieces (so the decoder enters its discard mode).
    let mut input = big.clone();
    input.push(b'\n');
    input.extend_from_slice(next);
    let pieces: Vec<&[u8]> = input.chunks(7).collect();
    for chunks in [vec![input.as_slice()], pieces] {
        let out = decode_chunks(max, &chunks);
        assert_eq!(out.len(), 2);
        assert_eq!(
            out[0].as_ref().unwrap_err(),
            &FrameError::TooLarge {
                frame_bytes: 101,
                max_frame_bytes: 100,
                id_hint: Some(Id::number(9))
            }
        );
        assert_eq!(out[1].as_ref().unwrap().id(), Some(&Id::number(10)));
    }
}

#[test]
fn real_16_mib_limit_boundary() {
    let exact = response_of_len(MAX_FRAME_BYTES);
    let over = response_of_len(MAX_FRAME_BYTES + 1);
    let input = [exact.as_slice(), b"\n", over.as_slice(), b"\n"].concat();
    let out = decode_all(&input);
    assert_eq!(out.len(), 2);
    assert_eq!(out[0].as_ref().unwrap().as_bytes().len(), MAX_FRAME_BYTES);
    match &out[1] {
        Err(FrameError::TooLarge {
            frame_bytes,
            max_frame_bytes,
            ..
        }) => {
            assert_eq!(*frame_bytes, MAX_FRAME_BYTES as u64 + 1);
            assert_eq!(*max_frame_bytes, MAX_FRAME_BYTES as u64);
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
}

#[test]
fn oversized_frame_is_never_buffered_whole() {
    let max = 1024;
    let mut dec = FrameDecoder::new(max);
    let mut buf = BytesMut::new();
    let head = br#"{"jsonrpc":"2.0","id":"big","result":""#;
    buf.put_slice(head);
    let mut peak = 0;
    for _ in 0..1000 {
        buf.put_slice(&[b'z'; 4096]);
        assert!(dec.decode(&mut buf).is_none());
        peak = peak.max(buf.len());
    }
    buf.put_slice(b"\"}\n");
    let err = dec.decode(&mut buf).unwrap().unwrap_err();
    assert!(peak <= max + 4096 + 64, "buffered {peak} bytes");
    assert_eq!(
        err,
        FrameError::TooLarge {
            frame_bytes: (head.len() + 4096 * 1000 + 2) as u64,
            max_frame_bytes: 1024,
            id_hint: Some(Id::string("big"))
        }
    );
    let data = err.to_error_object().data.unwrap();
    assert_eq!(data["frame_bytes"], head.len() + 4096 * 1000 + 2);
    assert_eq!(data["max_frame_bytes"], 1024);
    assert_eq!(data["errorCode"], "frame_too_large");
}

#[test]
fn sixteen_mib_result_is_classified_without_copying_the_payload() {
    let payload_len = 16 * 1024 * 1024 - 64;
    let mut line = b"{\"jsonrpc\":\"2.0\",\"id\":42,\"result\":{\"success\":true,\"data\":\"".to_vec();
    line.resize(line.len() + payload_len, b'q');
    line.extend_from_slice(b"\"}}\n");
    let f = only_frame(&line);
    assert_eq!(f.kind(), FrameKind::Response);
    let frame_start = f.as_bytes().as_ptr() as usize;
    let frame_end = frame_start + f.as_bytes().len();
    let result = f.result_json().unwrap();
    let at = result.as_ptr() as usize;
    assert!(
        at > frame_start && at + result.len() <= frame_end,
        "result must point into the frame buffer"
    );
    assert_eq!(
        result.len(),
        payload_len + "{\"success\":true,\"data\":\"\"}".len()
    );
    let shared = f.payload_bytes().unwrap();
    assert_eq!(
        shared.as_ptr() as usize,
        at,
        "payload_bytes shares the frame's allocation"
    );
}

#[test]
fn eof_in_the_middle_of_a_frame() {
    let out = decode_all(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":1}\n{\"jsonrpc\":\"2.0\",\"id\":2,\"res");
    assert_eq!(out.len(), 2);
    assert_eq!(out[0].as_ref().unwrap().id(), Some(&Id::number(1)));
    match &out[1] {
        Err(FrameError::TruncatedAtEof { partial_bytes, .. }) => {
            assert_eq!(*partial_bytes, br#"{"jsonrpc":"2.0","id":2,"res"#.len() as u64)
        }
        other => panic!("expected TruncatedAtEof, got {other:?}"),
    }
}

#[test]
fn eof_while_discarding_an_oversized_frame() {
    let out = decode_chunks(16, &[&[b'x'; 40], &[b'x'; 40]]);
    assert_eq!(
        out,
        vec![Err(FrameError::TooLarge {
            frame_bytes: 80,
            max_frame_bytes: 16,
            id_hint: None
        })]
    );
}

#[test]
fn trailing_whitespace_at_eof_is_not_a_frame() {
    assert!(decode_all(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":1}\n  \r").len() == 1);
}

#[test]
fn notification_and_request_are_told_apart() {
    let n = only_frame(
        b"{\"jsonrpc\":\"2.0\",\"method\":\"executa/progress\",\"params\":{\"type\":\"progress\"}}\n",
    );
    assert_eq!((n.kind(), n.id()), (FrameKind::Notification, None));
    let r = only_frame(
        b"{\"jsonrpc\":\"2.0\",\"id\":\"u-1\",\"method\":\"storage/get\",\"params\":{\"key\":\"k\"}}\n",
    );
    assert_eq!(
        (r.kind(), r.id().cloned()),
        (FrameKind::Request, Some(Id::string("u-1")))
    );
}

#[test]
fn error_response_is_parsed_on_demand() {
    let f = only_frame(
        b"{\"jsonrpc\":\"2.0\",\"id\":2,\"error\":{\"code\":-32601,\"message\":\"Unknown tool\",\"data\":{\"errorCode\":\"X\"}}}\n",
    );
    assert_eq!(f.kind(), FrameKind::ErrorResponse);
    let e: ErrorObject = f.error().unwrap().unwrap();
    assert_eq!(
        (e.code, e.message.as_str(), e.error_code()),
        (-32601, "Unknown tool", Some("X"))
    );
    assert_eq!(
        not_json_rpc(b"{\"jsonrpc\":\"2.0\",\"id\":2,\"error\":\"oops\"}\n"),
        NotJsonRpc::ErrorNotObject
    );
}

#[test]
fn null_id_and_null_result() {
    let f = only_frame(
        b"{\"jsonrpc\":\"2.0\",\"id\":null,\"error\":{\"code\":-32700,\"message\":\"Parse error\"}}\n",
    );
    assert!(f.id().unwrap().is_null());
    let f = only_frame(b"{\"jsonrpc\":\"2.0\",\"id\":3,\"result\":null}\n");
    assert_eq!((f.kind(), f.result_json()), (FrameKind::Response, Some("null")));
}

#[test]
fn file_transport_pointer() {
    let f = only_frame(b"{\"jsonrpc\":\"2.0\",\"id\":4,\"__file_transport\":\"/tmp/executa-resp-1.json\"}\n");
    assert_eq!(f.kind(), FrameKind::FileTransport);
    assert_eq!(f.file_transport_path(), Some("/tmp/executa-resp-1.json"));
    assert_eq!(f.id(), Some(&Id::number(4)));
    assert_eq!(
        not_json_rpc(b"{\"jsonrpc\":\"2.0\",\"id\":4,\"__file_transport\":1}\n"),
        NotJsonRpc::FileTransportNotString
    );
}

#[test]
fn encode_frame_is_one_line_and_respects_the_limit() {
    let msg = json!({"jsonrpc": "2.0", "id": 1, "result": {"text": "line1\nline2"}});
    let bytes = encode_frame(&msg, MAX_FRAME_BYTES).unwrap();
    assert_eq!(bytes.iter().filter(|&&b| b == b'\n').count(), 1);
    assert_eq!(bytes.last(), Some(&b'\n'));
    assert_eq!(
        only_frame(&bytes).result_json(),
        Some(r#"{"text":"line1\nline2"}"#)
    );
    match encode_frame(&msg, 10) {
        Err(EncodeError::TooLarge {
            frame_bytes,
            max_frame_bytes,
        }) => {
            assert_eq!((frame_bytes, max_frame_bytes), (bytes.len() as u64 - 1, 10));
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
}

#[tokio::test]
async fn writer_rejects_what_is_not_one_line() {
    let (a, _b) = tokio::io::duplex(1024);
    let (w, _task) = FrameWriter::spawn(a);
    assert!(matches!(
        w.send_raw(bytes::Bytes::from_static(b"{}")).await,
        Err(WriteError::NotOneLine)
    ));
    assert!(matches!(
        w.send_raw(bytes::Bytes::from_static(b"{}\n{}\n")).await,
        Err(WriteError::NotOneLine)
    ));
    w.send_raw(bytes::Bytes::from_static(b"{}\n")).await.unwrap();
}

#[tokio::test]
async fn concurrent_writers_never_interleave() {
    let (a, b) = tokio::io::duplex(4096);
    let (writer, task) = FrameWriter::spawn(a);
    let mut handles = Vec::new();
    for t in 0..16u64 {
        let w = writer.clone();
        handles.push(tokio::spawn(async move {
            for i in 0..200u64 {
                let pad = "p".repeat(((t * 7919 + i * 104_729) % 20_000) as usize);
                w.send(&json!({"jsonrpc": "2.0", "id": t * 1000 + i, "result": {"pad": pad}}))
                    .await
                    .unwrap();
            }
        }));
    }
    drop(writer);
    let reader = tokio::spawn(read_all(FrameReader::new(b)));
    for h in handles {
        h.await.unwrap();
    }
    task.await.unwrap().unwrap();
    let frames = reader.await.unwrap();
    assert_eq!(frames.len(), 16 * 200);
    let mut per_task = [0u64; 16];
    for f in frames {
        let f = f.expect("every frame intact");
        let id = f.id().unwrap().as_u64().unwrap();
        let (t, i) = ((id / 1000) as usize, id % 1000);
        assert_eq!(i, per_task[t], "frames of one task stay in order");
        per_task[t] += 1;
    }
}

#[tokio::test]
async fn io_error_is_reported_once_then_the_stream_ends() {
    let data = b"{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":1}\n".to_vec();
    let out = read_all(FrameReader::new(Chunked {
        data,
        pos: 0,
        step: 5,
        fail_at_end: true,
    }))
    .await;
    assert_eq!(out.len(), 2);
    assert!(out[0].is_ok());
    assert!(matches!(&out[1], Err(ReadError::Io(e)) if e.kind() == io::ErrorKind::BrokenPipe));
}

#[tokio::test]
async fn async_reader_handles_limit_and_resync() {
    let mut data = response_of_len(5000);
    data.push(b'\n');
    data.extend_from_slice(b"{\"jsonrpc\":\"2.0\",\"id\":2,\"result\":2}\n");
    let reader = FrameReader::with_max_frame_bytes(
        Chunked {
            data,
            pos: 0,
            step: 333,
            fail_at_end: false,
        },
        1000,
    );
    let out = read_all(reader).await;
    assert_eq!(out.len(), 2);
    assert!(matches!(
        &out[0],
        Err(ReadError::Frame(FrameError::TooLarge {
            frame_bytes: 5000,
            max_frame_bytes: 1000,
            ..
        }))
    ));
    assert_eq!(out[1].as_ref().unwrap().result_json(), Some("2"));
}

#[tokio::test]
async fn close_ends_the_stream_after_queued_frames_even_with_live_handles() {
    let (a, b) = tokio::io::duplex(1 << 16);
    let (writer, task) = FrameWriter::spawn(a);
    let other = writer.clone();
    writer
        .send(&json!({"jsonrpc": "2.0", "id": 1, "result": 1}))
        .await
        .unwrap();
    writer.close();
    task.await.unwrap().unwrap();
    assert!(matches!(other.send(&json!({})).await, Err(WriteError::Closed)));
    let frames = read_all(FrameReader::new(b)).await;
    assert_eq!(frames.len(), 1, "the queued frame, then EOF");
    assert_eq!(frames[0].as_ref().unwrap().id(), Some(&Id::number(1)));
    other.close(); // closing twice is harmless
}

#[tokio::test]
async fn a_reader_that_stopped_reading_fills_the_queue_and_close_never_waits() {
    let (a, b) = tokio::io::duplex(64);
    let (writer, task) = FrameWriter::spawn(a);
    let frame = json!({"jsonrpc": "2.0", "method": "x", "params": "y".repeat(100)});
    // The task takes the first frame and blocks writing it (the pipe holds 64 bytes); the queue then fills.
    let mut queued = 0;
    loop {
        match writer.try_send(&frame) {
            Ok(()) => queued += 1,
            Err(WriteError::Full) => break,
            Err(e) => panic!("unexpected {e}"),
        }
        tokio::task::yield_now().await;
    }
    assert!(queued >= WRITE_QUEUE, "{queued} frames queued before Full");
    writer.close(); // a plain call: it cannot wait for queue space
    assert!(matches!(writer.try_send(&frame), Err(WriteError::Closed)));
    assert!(matches!(writer.send(&frame).await, Err(WriteError::Closed)));
    // The blocked write ends when the reader goes away, and so does the task.
    drop(b);
    assert!(
        task.await.unwrap().is_err(),
        "the write failed: the reader is gone"
    );
}
