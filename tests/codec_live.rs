//! The production codec and `fleet probe` against real plugin processes (the Rust and Python fixtures).
#![allow(clippy::unwrap_used)]

use std::process::Stdio;
use std::time::Duration;

use fleet::probe::{ProbeError, ProbeOptions, run};
use fleet_e2e::{echo_plugin_bin, python_plugin_path};
use fleet_proto::codec::io::{FrameReader, FrameWriter, ReadError};
use fleet_proto::codec::{FrameError, FrameKind};
use fleet_proto::executa::invoke::{InvokeParams, InvokeResult};
use fleet_proto::jsonrpc::{Id, Request};
use fleet_proto::limits::MAX_FRAME_BYTES;
use serde_json::{Map, Value, json};
use tokio::process::Command;

/// Failure guard only: nothing here waits on time to synchronise.
const GUARD: Duration = Duration::from_secs(60);

fn echo(args: &[&str]) -> Vec<String> {
    let mut v = vec![echo_plugin_bin().display().to_string()];
    v.extend(args.iter().map(|s| s.to_string()));
    v
}

fn opts(command: Vec<String>, invoke: Option<(&str, Value)>) -> ProbeOptions {
    ProbeOptions {
        command,
        invoke: invoke.map(|(t, a)| {
            (
                t.to_string(),
                serde_json::from_value::<Map<String, Value>>(a).unwrap(),
            )
        }),
        invoke_timeout: Duration::from_secs(30),
        sandbox: None,
    }
}

#[tokio::test]
async fn probe_runs_a_v2_plugin_end_to_end() {
    let report = tokio::time::timeout(
        GUARD,
        run(&opts(echo(&[]), Some(("echo", json!({"hello": "world"}))))),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(report.protocol, "v2");
    assert_eq!(report.v1_reason, None);
    assert_eq!(report.capabilities, ["sampling", "storage"]);
    assert!(report.tools.iter().any(|t| t == "echo"));
    assert_eq!(report.invoke.as_ref().unwrap()["success"], true);
    assert_eq!(
        report.invoke.as_ref().unwrap()["data"]["arguments"]["hello"],
        "world"
    );
    assert_eq!(report.exit, "exit status: 0");
}

#[tokio::test]
async fn probe_falls_back_to_v1_on_method_not_found_and_tolerates_a_banner() {
    let report = tokio::time::timeout(
        GUARD,
        run(&opts(
            echo(&[
                "--initialize",
                "method-not-found",
                "--stdout-banner",
                "Listening…",
            ]),
            None,
        )),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(report.protocol, "v1");
    assert!(
        report.v1_reason.as_deref().unwrap().contains("-32601"),
        "{:?}",
        report.v1_reason
    );
    assert_eq!(report.other_frames, ["bad frame: invalid_json"]);
}

#[tokio::test]
async fn probe_rejects_a_wrapped_manifest_with_its_path() {
    let err = tokio::time::timeout(GUARD, run(&opts(echo(&["--describe-mode", "wrapped"]), None)))
        .await
        .unwrap()
        .unwrap_err();
    match err {
        ProbeError::Describe(msg) => assert!(msg.contains("$.manifest"), "{msg}"),
        other => panic!("expected a describe error, got {other}"),
    }
}

#[tokio::test]
async fn probe_runs_the_python_plugin() {
    let cmd = vec!["python3".to_string(), python_plugin_path().display().to_string()];
    let report = tokio::time::timeout(GUARD, run(&opts(cmd, Some(("echo", json!({"x": 1}))))))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(report.protocol, "v2");
    assert_eq!(report.invoke.as_ref().unwrap()["data"]["arguments"]["x"], 1);
}

/// A plugin answering with a frame over 16 MiB: the reader reports `frame_too_large` with the answered id,
/// never buffers the frame whole, and the same process keeps serving the next call.
#[tokio::test]
async fn oversized_frame_from_a_real_plugin_then_the_next_call_is_served() {
    let mut child = Command::new(echo_plugin_bin())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let (writer, _task) = FrameWriter::spawn(child.stdin.take().unwrap());
    let mut reader = FrameReader::new(child.stdout.take().unwrap());
    let invoke = |tool: &str, args: Value| InvokeParams {
        tool: tool.into(),
        arguments: serde_json::from_value(args).unwrap(),
        context: Default::default(),
        timeout: None,
        invoke_id: None,
    };
    writer
        .send(&Request::new(
            7u64,
            "invoke",
            invoke("big_result", json!({"bytes": MAX_FRAME_BYTES})),
        ))
        .await
        .unwrap();
    writer
        .send(&Request::new(
            8u64,
            "invoke",
            invoke("echo", json!({"after": true})),
        ))
        .await
        .unwrap();

    // The plugin serves invokes concurrently: the two answers may come in either order.
    let mut too_large = None;
    let mut echoed = None;
    for _ in 0..2 {
        match tokio::time::timeout(GUARD, reader.next()).await.unwrap().unwrap() {
            Err(ReadError::Frame(e @ FrameError::TooLarge { .. })) => too_large = Some(e),
            Ok(frame) => echoed = Some(frame),
            other => panic!("unexpected outcome {other:?}"),
        }
    }
    match too_large {
        Some(FrameError::TooLarge {
            frame_bytes,
            max_frame_bytes,
            id_hint,
        }) => {
            assert!(frame_bytes > MAX_FRAME_BYTES as u64);
            assert_eq!(max_frame_bytes, MAX_FRAME_BYTES as u64);
            assert_eq!(id_hint, Some(Id::number(7)));
        }
        other => panic!("expected frame_too_large, got {other:?}"),
    }
    let second = echoed.unwrap();
    assert_eq!(second.kind(), FrameKind::Response);
    assert_eq!(second.id(), Some(&Id::number(8)));
    let result: InvokeResult = second.parse_payload().unwrap().unwrap();
    assert!(result.success);
    assert_eq!(result.data.unwrap()["arguments"]["after"], true);
    // And the process still serves calls after the oversized frame.
    writer
        .send(&Request::new(9u64, "invoke", invoke("echo", json!({}))))
        .await
        .unwrap();
    let third = tokio::time::timeout(GUARD, reader.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(third.id(), Some(&Id::number(9)));
    drop(writer);
    let status = tokio::time::timeout(GUARD, child.wait()).await.unwrap().unwrap();
    assert!(status.success());
}
