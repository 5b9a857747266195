//! The wire types other than the manifest: JSON-RPC ids and responses, the Executa lifecycle, invoke and
//! reverse-RPC types, and the fleet API (ids, states, error codes, envelopes, argument validation).
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeSet, HashSet};
use std::ops::RangeInclusive;
use std::str::FromStr;

use fleet_proto::api::{
    ApiError, ApiErrorCode, ApiResponse, CancelJobArgs, GetJobArgs, InvokeArgs, InvokeAsyncArgs, JobId,
    JobQuotaDetails, JobSnapshot, JobState, ListJobsArgs, ListJobsResult, OneOrMany, ProgressEvent, Target,
    ToolJobEvent, parse_args, parse_body,
};
use fleet_proto::executa::invoke::{InvokeContext, InvokeResult, ProgressParams, ProgressType};
use fleet_proto::executa::lifecycle::{Health, HealthResult, InitializeResult, PeerInfo, ProtocolVersion};
use fleet_proto::executa::reverse::{
    self, Family, RpcCode, agent, app_session, correlation, credentials, embeddings, family_of, image,
    sampling, storage, upload, web,
};
use fleet_proto::jsonrpc::{ErrorObject, Id, Outcome, Request, Response, V2};
use serde_json::value::RawValue;
use serde_json::{Map, Value, json};

// =============================================================================================================
// jsonrpc
// =============================================================================================================

fn raw(text: &str) -> Box<RawValue> {
    RawValue::from_string(text.to_string()).unwrap()
}

#[test]
fn id_constructors() {
    let n = Id::number(7);
    assert_eq!(n.as_json(), "7");
    assert_eq!(n.as_u64(), Some(7));
    assert_eq!(n.as_str(), None);
    assert!(!n.is_string());
    assert!(!n.is_null());
    assert_eq!(Id::from(7u64), n);

    let s = Id::string("7");
    assert_eq!(s.as_json(), "\"7\"");
    assert_eq!(s.as_u64(), None);
    assert_eq!(s.as_str().as_deref(), Some("7"));
    assert!(s.is_string());
    assert_ne!(s, n, "the string \"7\" is not the number 7");

    let q = Id::string("a\"b");
    assert_eq!(q.as_json(), r#""a\"b""#);
    assert_eq!(q.as_str().as_deref(), Some("a\"b"));

    let z = Id::null();
    assert_eq!(z.as_json(), "null");
    assert!(z.is_null());
    assert_eq!(z.as_u64(), None);
    assert_eq!(z.as_str(), None);
}

#[test]
fn id_from_raw_accepts_number_string_null() {
    for text in ["7", "-1", "1e3", "0.5", "\"abc\"", "\"7\"", "null"] {
        let id = Id::from_raw(&raw(text)).unwrap();
        assert_eq!(id.as_json(), text);
    }
    assert_eq!(Id::from_raw(&raw("-1")).unwrap().as_u64(), None);
}

#[test]
fn id_from_raw_rejects_object_array_bool() {
    for (text, found) in [
        ("{}", "an object"),
        ("{\"a\":1}", "an object"),
        ("[]", "an array"),
        ("[1]", "an array"),
        ("true", "a boolean"),
        ("false", "a boolean"),
    ] {
        let err = Id::from_raw(&raw(text)).unwrap_err();
        assert_eq!(err.found, found, "{text}");
    }
}

#[test]
fn id_serde_round_trips_verbatim() {
    for text in ["7", "\"7\"", "1e3", "null", "\"x y\""] {
        let id: Id = serde_json::from_str(text).unwrap();
        assert_eq!(id.as_json(), text);
        assert_eq!(serde_json::to_string(&id).unwrap(), text);
    }
    for text in ["{}", "[1]", "true"] {
        assert!(serde_json::from_str::<Id>(text).is_err(), "{text}");
    }
}

#[test]
fn request_keeps_id_type_and_requires_v2() {
    let r: Request = serde_json::from_str(r#"{"jsonrpc":"2.0","id":"7","method":"describe"}"#).unwrap();
    assert!(r.id.is_string());
    assert_eq!(r.method, "describe");
    assert_eq!(r.params, None);
    assert_eq!(
        serde_json::to_string(&r).unwrap(),
        r#"{"jsonrpc":"2.0","id":"7","method":"describe"}"#
    );

    let bad = serde_json::from_str::<Request>(r#"{"jsonrpc":"1.0","id":1,"method":"x"}"#);
    assert!(bad.is_err());
    let bad = serde_json::from_str::<Request>(r#"{"jsonrpc":"2.0","id":{},"method":"x"}"#);
    assert!(bad.is_err());

    let built = Request::new(3u64, "invoke", json!({"tool": "t"}));
    assert_eq!(
        serde_json::to_value(&built).unwrap(),
        json!({"jsonrpc": "2.0", "id": 3, "method": "invoke", "params": {"tool": "t"}})
    );
}

#[test]
fn v2_marker() {
    assert_eq!(serde_json::to_value(V2).unwrap(), json!("2.0"));
    assert_eq!(serde_json::from_value::<V2>(json!("2.0")).unwrap(), V2);
    for bad in [json!("1.0"), json!("2"), json!("2.0 "), json!(2.0), json!(null)] {
        assert!(serde_json::from_value::<V2>(bad.clone()).is_err(), "{bad}");
    }
    let e = serde_json::from_value::<V2>(json!("1.0")).unwrap_err();
    assert!(e.to_string().contains("\"1.0\""), "{e}");
}

#[test]
fn response_with_null_result_is_a_result() {
    let r: Response = serde_json::from_str(r#"{"jsonrpc":"2.0","id":1,"result":null}"#).unwrap();
    assert_eq!(r.id, Id::number(1));
    assert_eq!(r.outcome, Outcome::Result(Value::Null));
}

#[test]
fn response_with_result_or_error() {
    let r: Response = serde_json::from_str(r#"{"jsonrpc":"2.0","id":"a","result":{"x":1}}"#).unwrap();
    assert_eq!(r.id, Id::string("a"));
    assert_eq!(r.outcome, Outcome::Result(json!({"x": 1})));

    let r: Response =
        serde_json::from_str(r#"{"jsonrpc":"2.0","id":2,"error":{"code":-32601,"message":"nope"}}"#).unwrap();
    assert_eq!(r.outcome, Outcome::Error(ErrorObject::new(-32601, "nope")));

    let r: Response =
        serde_json::from_str(r#"{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"p"}}"#).unwrap();
    assert!(r.id.is_null());
}

#[test]
fn response_with_both_or_neither_is_an_error() {
    let both = serde_json::from_str::<Response>(
        r#"{"jsonrpc":"2.0","id":1,"result":1,"error":{"code":-1,"message":"m"}}"#,
    )
    .unwrap_err();
    assert!(both.to_string().contains("both result and error"), "{both}");

    let neither = serde_json::from_str::<Response>(r#"{"jsonrpc":"2.0","id":1}"#).unwrap_err();
    assert!(
        neither.to_string().contains("neither result nor error"),
        "{neither}"
    );

    assert!(serde_json::from_str::<Response>(r#"{"jsonrpc":"1.0","id":1,"result":1}"#).is_err());
}

#[test]
fn response_serialization() {
    assert_eq!(
        serde_json::to_value(Response::ok(Id::number(4), json!([1]))).unwrap(),
        json!({"jsonrpc": "2.0", "id": 4, "result": [1]})
    );
    assert_eq!(
        serde_json::to_value(Response::<Value>::err(
            Id::string("x"),
            ErrorObject::new(-32603, "boom")
        ))
        .unwrap(),
        json!({"jsonrpc": "2.0", "id": "x", "error": {"code": -32603, "message": "boom"}})
    );
}

#[test]
fn error_object_with_error_code_shape() {
    let e = ErrorObject::with_error_code(-32001, "SAMPLING_NOT_GRANTED", "not granted");
    assert_eq!(
        serde_json::to_value(&e).unwrap(),
        json!({"code": -32001, "message": "not granted", "data": {"errorCode": "SAMPLING_NOT_GRANTED"}})
    );
    assert_eq!(e.error_code(), Some("SAMPLING_NOT_GRANTED"));
    assert_eq!(
        e.to_string(),
        "JSON-RPC error -32001: not granted (SAMPLING_NOT_GRANTED)"
    );
    let plain = ErrorObject::new(-32602, "bad");
    assert_eq!(plain.error_code(), None);
    assert_eq!(
        serde_json::to_value(&plain).unwrap(),
        json!({"code": -32602, "message": "bad"})
    );
}

// =============================================================================================================
// executa::lifecycle
// =============================================================================================================

fn set(keys: &[&str]) -> BTreeSet<String> {
    keys.iter().map(ToString::to_string).collect()
}

#[test]
fn initialize_result_camel_case_server_info_and_client_capabilities() {
    let r: InitializeResult = serde_json::from_value(json!({
        "protocolVersion": "2.0",
        "serverInfo": {"name": "x", "version": "1"},
        "client_capabilities": {"image": {}, "image.edit": {}, "upload": {}},
        "capabilities": {}
    }))
    .unwrap();
    assert_eq!(
        r.server_info,
        Some(PeerInfo {
            name: "x".into(),
            version: "1".into()
        })
    );
    assert_eq!(r.protocol(), ProtocolVersion::V2);
    assert_eq!(r.negotiated(), set(&["image", "image.edit", "upload"]));
    assert_eq!(r.extra, Map::new());
}

#[test]
fn initialize_result_snake_case_server_info_and_capabilities() {
    let r: InitializeResult = serde_json::from_value(json!({
        "protocolVersion": "2.0",
        "server_info": {"name": "y", "version": "2.1"},
        "capabilities": {"storage": {"kv": true, "files": true}}
    }))
    .unwrap();
    assert_eq!(
        r.server_info,
        Some(PeerInfo {
            name: "y".into(),
            version: "2.1".into()
        })
    );
    assert_eq!(r.protocol(), ProtocolVersion::V2);
    assert_eq!(r.negotiated(), set(&["storage"]));
}

#[test]
fn initialize_negotiated_is_the_union_ignoring_false_and_null() {
    let r: InitializeResult = serde_json::from_value(json!({
        "protocolVersion": "2.0",
        "capabilities": {"sampling": {}, "upload": false, "embed": null, "storage": true},
        "client_capabilities": {"sampling": true, "image": {}, "agent": false, "upload": {}},
        "vendor": 1
    }))
    .unwrap();
    assert_eq!(r.negotiated(), set(&["image", "sampling", "storage", "upload"]));
    let mut extra = Map::new();
    extra.insert("vendor".into(), json!(1));
    assert_eq!(r.extra, extra);
}

/// Spec §3.3 (issue 17): the SDK's embeddings demo claims `embeddings`, the documentation `embed`; both negotiate
/// the embeddings family, under the one key the host checks. `embeddings: false` claims nothing.
#[test]
fn initialize_negotiated_takes_the_sdks_embeddings_key_as_embed() {
    for claims in [
        json!({"client_capabilities": {"embeddings": {}}}),
        json!({"capabilities": {"embeddings": true}}),
        json!({"client_capabilities": {"embed": {}, "embeddings": {}}}),
    ] {
        let mut v = claims.clone();
        v["protocolVersion"] = json!("2.0");
        let r: InitializeResult = serde_json::from_value(v).unwrap();
        assert_eq!(r.negotiated(), set(&["embed"]), "{claims}");
    }
    let r: InitializeResult = serde_json::from_value(
        json!({"protocolVersion": "2.0", "client_capabilities": {"embeddings": false}}),
    )
    .unwrap();
    assert_eq!(r.negotiated(), BTreeSet::new());
}

#[test]
fn initialize_protocol_is_v2_only_for_2_0() {
    for (v, expected) in [
        (json!({"protocolVersion": "2.0"}), ProtocolVersion::V2),
        (json!({"protocolVersion": "1.1"}), ProtocolVersion::V1),
        (json!({"protocolVersion": "3"}), ProtocolVersion::V1),
        (json!({"protocolVersion": "2"}), ProtocolVersion::V1),
        (json!({}), ProtocolVersion::V1),
    ] {
        let r: InitializeResult = serde_json::from_value(v.clone()).unwrap();
        assert_eq!(r.protocol(), expected, "{v}");
    }
    assert_eq!(InitializeResult::default().protocol(), ProtocolVersion::V1);
    assert_eq!(InitializeResult::default().negotiated(), BTreeSet::new());
}

#[test]
fn health_classify() {
    for (status, expected) in [
        (Some("ready"), Health::Healthy),
        (Some("healthy"), Health::Healthy),
        (Some("ok"), Health::Healthy),
        (Some("initializing"), Health::Starting),
        (Some("error"), Health::Unhealthy),
        (Some("degraded"), Health::Unhealthy),
        (Some("OK"), Health::Unhealthy),
        (Some(""), Health::Unhealthy),
        (None, Health::Unhealthy),
    ] {
        let v = match status {
            Some(s) => json!({"status": s}),
            None => json!({"uptime": 3}),
        };
        let h: HealthResult = serde_json::from_value(v).unwrap();
        assert_eq!(h.classify(), expected, "{status:?}");
    }
}

// =============================================================================================================
// executa::invoke
// =============================================================================================================

#[test]
fn invoke_result_success_defaults_to_false() {
    let r: InvokeResult = serde_json::from_value(json!({"data": {"x": 1}})).unwrap();
    assert!(!r.success);
    assert_eq!(r.data, Some(json!({"x": 1})));
    assert_eq!(
        r.error_message(),
        "the plugin returned success: false without an error"
    );

    let r: InvokeResult = serde_json::from_value(json!({"success": true, "data": "ok"})).unwrap();
    assert!(r.success);
    assert_eq!(r.error_message(), "");

    let r: InvokeResult = serde_json::from_value(json!({"success": false, "error": "quota hit"})).unwrap();
    assert_eq!(r.error_message(), "quota hit");

    let r: InvokeResult =
        serde_json::from_value(json!({"success": false, "error": {"code": 3, "msg": "x"}})).unwrap();
    assert_eq!(r.error_message(), r#"{"code":3,"msg":"x"}"#);

    let r: InvokeResult =
        serde_json::from_value(json!({"success": true, "duration_ms": 12.5, "tool": "t"})).unwrap();
    assert_eq!(r.duration_ms.map(|n| n.to_string()).as_deref(), Some("12.5"));
    assert_eq!(r.tool.as_deref(), Some("t"));
    assert_eq!(r.data, None);
}

#[test]
fn invoke_context_round_trips_unknown_keys() {
    let wire = json!({
        "invoke_id": "tjob_0123456789abcdef0123456789abcdef",
        "deadline_ms": 1_700_000_000_000u64,
        "credentials": {"K": "v"},
        "sampling_token": "t1",
        "plugin_name": "p",
        "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "x_custom": {"a": [1, 2]}
    });
    let ctx: InvokeContext = serde_json::from_value(wire.clone()).unwrap();
    assert_eq!(
        ctx.extra.get("traceparent"),
        Some(&json!("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"))
    );
    assert_eq!(ctx.extra.len(), 2);
    assert_eq!(ctx.deadline_ms, Some(1_700_000_000_000));
    assert_eq!(serde_json::to_value(&ctx).unwrap(), wire);
    assert_eq!(serde_json::to_value(InvokeContext::default()).unwrap(), json!({}));
}

#[test]
fn invoke_context_debug_redacts_tokens_and_credentials() {
    let mut credentials = Map::new();
    credentials.insert("K".into(), json!("sk-secret"));
    let ctx = InvokeContext {
        invoke_id: Some("inv-1".into()),
        credentials: Some(credentials),
        sampling_token: Some("eyJsecret".into()),
        storage_token: Some("eyJstorage".into()),
        upload_token: Some("eyJupload".into()),
        image_token: Some("eyJimage".into()),
        credentials_token: Some("eyJcreds".into()),
        ..InvokeContext::default()
    };
    let debug = format!("{ctx:?}");
    let pretty = format!("{ctx:#?}");
    for text in [&debug, &pretty] {
        for secret in [
            "eyJsecret",
            "sk-secret",
            "eyJstorage",
            "eyJupload",
            "eyJimage",
            "eyJcreds",
        ] {
            assert!(!text.contains(secret), "{secret} leaked in {text}");
        }
        assert!(text.contains("inv-1"), "{text}");
        assert!(text.contains("\"K\""), "credential names stay visible: {text}");
    }

    // Secrets hidden in unknown keys are not printed either (only the keys are).
    let ctx: InvokeContext = serde_json::from_value(json!({"x_api_key": "sk-hidden"})).unwrap();
    let debug = format!("{ctx:?}");
    assert!(!debug.contains("sk-hidden"), "{debug}");
    assert!(debug.contains("x_api_key"), "{debug}");
}

#[test]
fn progress_type_coercion() {
    for (kind, expected) in [
        (Some(json!("progress")), ProgressType::Progress),
        (Some(json!("tool_update")), ProgressType::ToolUpdate),
        (Some(json!("completed")), ProgressType::Progress),
        (Some(json!("failed")), ProgressType::Progress),
        (Some(json!(3)), ProgressType::Progress),
        (Some(json!(null)), ProgressType::Progress),
        (None, ProgressType::Progress),
    ] {
        let mut v = json!({"data": {"pct": 50}, "context": {"invoke_id": "i"}});
        if let Some(k) = &kind {
            v["type"] = k.clone();
        }
        let p: ProgressParams = serde_json::from_value(v).unwrap();
        assert_eq!(p.progress_type(), expected, "{kind:?}");
        assert_eq!(p.data, json!({"pct": 50}));
        assert_eq!(p.context.unwrap().invoke_id.as_deref(), Some("i"));
    }
    assert_eq!(ProgressType::Progress.as_str(), "progress");
    assert_eq!(ProgressType::ToolUpdate.as_str(), "tool_update");
    assert_eq!(
        serde_json::to_value(ProgressType::ToolUpdate).unwrap(),
        json!("tool_update")
    );
}

// =============================================================================================================
// executa::reverse
// =============================================================================================================

/// A family's name, its codes and their documented ranges.
type FamilyCodes = (&'static str, &'static [RpcCode], Vec<RangeInclusive<i64>>);

/// Every family module with its documented code ranges.
fn families() -> Vec<FamilyCodes> {
    vec![
        ("sampling", sampling::ALL, vec![-32010..=-32001]),
        (
            "app_session",
            app_session::ALL,
            vec![-32011..=-32011, -32018..=-32017],
        ),
        ("storage", storage::ALL, vec![-32029..=-32021]),
        ("agent", agent::ALL, vec![-32048..=-32041]),
        ("credentials", credentials::ALL, vec![-32063..=-32061]),
        ("image", image::ALL, vec![-32110..=-32101, -32314..=-32311]),
        ("upload", upload::ALL, vec![-32213..=-32201]),
        ("embeddings", embeddings::ALL, vec![-32508..=-32501]),
        ("web", web::ALL, vec![-32528..=-32521]),
    ]
}

#[test]
fn reverse_codes_are_in_range_and_unique_per_family() {
    for (family, codes, ranges) in families() {
        let range_size: usize = ranges.iter().map(|r| r.clone().count()).sum();
        assert_eq!(
            codes.len(),
            range_size,
            "{family}: one code per number of its range(s)"
        );
        let mut numbers = HashSet::new();
        let mut names = HashSet::new();
        for c in codes {
            assert!(
                ranges.iter().any(|r| r.contains(&c.code)),
                "{family}: {} = {} outside {ranges:?}",
                c.name,
                c.code
            );
            assert!(numbers.insert(c.code), "{family}: duplicate code {}", c.code);
            assert!(names.insert(c.name), "{family}: duplicate name {}", c.name);
        }
    }
}

#[test]
fn reverse_codes_are_unique_across_families() {
    let mut seen = HashSet::new();
    for (family, codes, _) in families() {
        for c in codes {
            assert!(seen.insert(c.code), "{family}: {} reuses {}", c.name, c.code);
        }
    }
}

#[test]
fn reverse_code_family_sizes_and_names() {
    let sizes: Vec<(&str, usize)> = families().iter().map(|(f, c, _)| (*f, c.len())).collect();
    assert_eq!(
        sizes,
        [
            ("sampling", 10),
            ("app_session", 3),
            ("storage", 9),
            ("agent", 8),
            ("credentials", 3),
            ("image", 14),
            ("upload", 13),
            ("embeddings", 8),
            ("web", 8),
        ]
    );
    assert_eq!(sampling::SAMPLING_NOT_GRANTED.code, -32001);
    assert_eq!(sampling::SAMPLING_NOT_GRANTED.name, "SAMPLING_NOT_GRANTED");
    assert_eq!(sampling::SAMPLING_UNSUPPORTED_RESPONSE_FORMAT.code, -32010);
    assert_eq!(storage::STORAGE_NOT_GRANTED.code, -32021);
    assert_eq!(storage::UPSTREAM_ERROR.code, -32029);
    assert_eq!(upload::UPLOAD_NOT_GRANTED.code, -32201);
    assert_eq!(upload::PRESIGN_FAILED.code, -32213);
    assert_eq!(upload::QUOTA_EXCEEDED.name, "QUOTA_EXCEEDED");
    assert_eq!(embeddings::EMBED_NOT_GRANTED.code, -32501);
    assert_eq!(embeddings::EMBED_USER_DENIED.code, -32508);
    assert_eq!(web::WEB_NOT_GRANTED.code, -32521);
    assert_eq!(web::WEB_TOKEN_EXPIRED.code, -32528);
    assert_eq!(image::REFERENCE_FETCH_FAILED.code, -32314);
}

#[test]
fn correlation_codes_share_invalid_params() {
    assert_eq!(correlation::ALL.len(), 2);
    for c in correlation::ALL {
        assert_eq!(c.code, -32602);
    }
    assert_eq!(correlation::UNKNOWN_INVOKE_CONTEXT.name, "UNKNOWN_INVOKE_CONTEXT");
    assert_eq!(correlation::MISSING_INVOKE_CONTEXT.name, "MISSING_INVOKE_CONTEXT");
}

#[test]
fn rpc_code_error_puts_the_name_in_data() {
    let e = sampling::SAMPLING_TIMEOUT.error("too slow");
    assert_eq!(
        serde_json::to_value(&e).unwrap(),
        json!({"code": -32005, "message": "too slow", "data": {"errorCode": "SAMPLING_TIMEOUT"}})
    );
    assert_eq!(e.error_code(), Some("SAMPLING_TIMEOUT"));

    let mut more = Map::new();
    more.insert("requested".into(), json!("json_schema"));
    more.insert("modelName".into(), json!("m"));
    let e = sampling::SAMPLING_UNSUPPORTED_RESPONSE_FORMAT.error_with("nope", more);
    assert_eq!(
        serde_json::to_value(&e).unwrap(),
        json!({
            "code": -32010,
            "message": "nope",
            "data": {"errorCode": "SAMPLING_UNSUPPORTED_RESPONSE_FORMAT", "requested": "json_schema", "modelName": "m"}
        })
    );

    let e = reverse::method_not_found("video/generate");
    assert_eq!(e.code, -32601);
    assert_eq!(e.data, None);
    assert!(e.message.contains("video/generate"), "{}", e.message);
}

#[test]
fn family_of_every_method() {
    use reverse::methods as m;
    for (method, family) in [
        (m::SAMPLING_CREATE_MESSAGE, Family::Sampling),
        (m::AGENT_COMPLETE, Family::Agent),
        (m::STORAGE_GET, Family::Storage),
        (m::STORAGE_SET, Family::Storage),
        (m::STORAGE_DELETE, Family::Storage),
        (m::STORAGE_LIST, Family::Storage),
        (m::FILES_UPLOAD_BEGIN, Family::Files),
        (m::FILES_UPLOAD_COMPLETE, Family::Files),
        (m::FILES_DOWNLOAD_URL, Family::Files),
        (m::FILES_LIST, Family::Files),
        (m::FILES_DELETE, Family::Files),
        (m::EMBEDDINGS_CREATE, Family::Embeddings),
        (m::IMAGE_GENERATE, Family::Image),
        (m::IMAGE_EDIT, Family::Image),
        (m::HOST_UPLOAD_FILE, Family::Upload),
        (m::CREDENTIALS_LIST_ACCOUNTS, Family::Credentials),
        (m::CREDENTIALS_GET_TOKEN, Family::Credentials),
        (m::WEB_SEARCH, Family::Web),
        (m::WEB_FETCH, Family::Web),
        (m::WEB_IMAGE_SEARCH, Family::Web),
        (m::WEB_IMAGE_FETCH, Family::Web),
    ] {
        assert_eq!(family_of(method), Some(family), "{method}");
    }
}

#[test]
fn family_of_unknown_methods_is_none() {
    for method in [
        "video/generate",
        "foo",
        "sampling/other",
        "embeddings/other",
        "image/other",
        "host/other",
        "",
        "/",
        "sampling",
    ] {
        assert_eq!(family_of(method), None, "{method:?}");
    }
}

#[test]
fn family_error_codes() {
    assert_eq!(Family::Sampling.not_negotiated().code, -32008);
    assert_eq!(
        Family::Sampling.not_negotiated(),
        sampling::SAMPLING_NOT_NEGOTIATED
    );
    assert_eq!(Family::Sampling.not_granted().code, -32001);
    assert_eq!(Family::Sampling.not_granted(), sampling::SAMPLING_NOT_GRANTED);
    assert_eq!(Family::Storage.not_granted().code, -32021);
    assert_eq!(Family::Upload.not_negotiated().code, -32210);
    assert_eq!(Family::Embeddings.not_negotiated().code, -32507);
    assert_eq!(Family::Image.not_negotiated().code, -32107);
    assert_eq!(Family::Web.not_granted().code, -32521);
    assert_eq!(Family::Sampling.as_str(), "sampling");
    assert_eq!(Family::Sampling.manifest_capability(), Some("llm.sample"));
}

#[test]
fn each_web_method_needs_its_own_capability() {
    assert_eq!(Family::Web.not_negotiated().code, -32526);
    assert_eq!(Family::Web.manifest_capability(), None);
    for (method, cap) in [
        ("web/search", "web.search"),
        ("web/fetch", "web.fetch"),
        ("web/image_search", "web.image_search"),
        ("web/image_fetch", "web.image_fetch"),
        ("web/unknown", "web.search"),
    ] {
        assert_eq!(Family::Web.method_capability(method), Some(cap), "{method}");
    }
    assert_eq!(
        Family::Image.method_capability("image/edit"),
        Some("llm.image"),
        "other families keep the family's capability"
    );
}

// =============================================================================================================
// api: JobId, JobState
// =============================================================================================================

const HEX32: &str = "0123456789abcdef0123456789abcdef";

fn job_id() -> JobId {
    JobId::from_str(&format!("tjob_{HEX32}")).unwrap()
}

#[test]
fn job_id_accepts_exactly_the_pattern() {
    let good = format!("tjob_{HEX32}");
    assert_eq!(JobId::from_str(&good).unwrap().as_str(), good);
    assert_eq!(
        serde_json::from_value::<JobId>(json!(good)).unwrap().as_str(),
        good
    );
    assert_eq!(
        serde_json::from_str::<JobId>(&format!("\"{good}\""))
            .unwrap()
            .to_string(),
        good
    );

    let bad = [
        format!("tjob_{}", HEX32.to_uppercase()),
        "tjob_0123456789ABCDEF0123456789abcdef".to_string(),
        format!("tjob_{}", &HEX32[..31]),
        format!("tjob_{HEX32}0"),
        format!("job_{HEX32}"),
        format!("TJOB_{HEX32}"),
        format!("tjob-{HEX32}"),
        format!("xjob_{HEX32}"),
        format!("tjob_{}g", &HEX32[..31]),
        format!("tjob_{}é", &HEX32[..30]),
        format!(" tjob_{HEX32}"),
        format!("tjob_{HEX32}\n"),
        "tjob_".to_string(),
        String::new(),
    ];
    for s in &bad {
        let err = JobId::from_str(s).unwrap_err();
        assert_eq!(&err.0, s);
        assert!(serde_json::from_value::<JobId>(json!(s)).is_err(), "{s:?}");
    }
    assert!(serde_json::from_value::<JobId>(json!(5)).is_err());
}

#[test]
fn job_id_from_bytes_parses_back() {
    let mut counting = [0u8; 16];
    for (i, b) in counting.iter_mut().enumerate() {
        *b = u8::try_from(i * 17).unwrap();
    }
    for bytes in [[0u8; 16], [0xff; 16], [0xab; 16], counting] {
        let id = JobId::from_bytes(bytes);
        assert_eq!(JobId::from_str(id.as_str()).unwrap(), id);
        assert_eq!(id.as_str().len(), 37);
    }
    assert_eq!(
        JobId::from_bytes([0u8; 16]).as_str(),
        "tjob_00000000000000000000000000000000"
    );
    assert_eq!(
        JobId::from_bytes(counting).as_str(),
        "tjob_00112233445566778899aabbccddeeff"
    );
    assert_eq!(
        serde_json::to_value(JobId::from_bytes([0xff; 16])).unwrap(),
        json!("tjob_ffffffffffffffffffffffffffffffff")
    );
}

#[test]
fn job_state_serde_strings() {
    let expected = ["queued", "running", "succeeded", "failed", "cancelled", "expired"];
    for (state, s) in JobState::ALL.iter().zip(expected) {
        assert_eq!(serde_json::to_value(state).unwrap(), json!(s));
        assert_eq!(serde_json::from_value::<JobState>(json!(s)).unwrap(), *state);
        assert_eq!(state.as_str(), s);
        assert_eq!(state.to_string(), s);
    }
    assert!(serde_json::from_value::<JobState>(json!("Queued")).is_err());
    assert!(serde_json::from_value::<JobState>(json!("done")).is_err());
}

#[test]
fn job_state_transitions() {
    use JobState::*;
    let terminal = [Succeeded, Failed, Cancelled, Expired];
    assert!(!Queued.can_become(Queued));
    assert!(Queued.can_become(Running));
    for t in terminal {
        assert!(Queued.can_become(t), "queued → {t}");
        assert!(Running.can_become(t), "running → {t}");
    }
    assert!(!Running.can_become(Queued));
    assert!(!Running.can_become(Running));
    for from in terminal {
        for to in JobState::ALL {
            assert!(!from.can_become(to), "{from} → {to}");
        }
    }
    let active: Vec<JobState> = JobState::ALL.into_iter().filter(|s| s.is_active()).collect();
    assert_eq!(active, [Queued, Running]);
    for s in JobState::ALL {
        assert_eq!(s.is_terminal(), !s.is_active());
    }
}

// =============================================================================================================
// api: error codes and envelopes
// =============================================================================================================

const ALL_CODES: [(ApiErrorCode, &str); 19] = [
    (ApiErrorCode::InvalidToken, "invalid_token"),
    (ApiErrorCode::PermissionDenied, "permission_denied"),
    (ApiErrorCode::InvalidArg, "invalid_arg"),
    (ApiErrorCode::NotFound, "not_found"),
    (ApiErrorCode::AgentUnavailable, "agent_unavailable"),
    (ApiErrorCode::ExecutaUnavailable, "executa_unavailable"),
    (ApiErrorCode::ExecutaError, "executa_error"),
    (ApiErrorCode::ToolFailed, "tool_failed"),
    (ApiErrorCode::ToolTimeout, "tool_timeout"),
    (ApiErrorCode::SubcallTimeout, "subcall_timeout"),
    (ApiErrorCode::ResultTooLarge, "result_too_large"),
    (ApiErrorCode::Cancelled, "cancelled"),
    (ApiErrorCode::WaitTimeout, "wait_timeout"),
    (ApiErrorCode::JobQuotaExceeded, "job_quota_exceeded"),
    (ApiErrorCode::LongJobCapacity, "long_job_capacity"),
    (ApiErrorCode::JobNotFound, "job_not_found"),
    (ApiErrorCode::RateLimited, "rate_limited"),
    (ApiErrorCode::NotImplemented, "not_implemented"),
    (ApiErrorCode::InternalError, "internal_error"),
];

#[test]
fn api_error_codes_serialize_snake_case() {
    let mut seen = HashSet::new();
    for (code, s) in ALL_CODES {
        assert_eq!(serde_json::to_value(code).unwrap(), json!(s));
        assert_eq!(serde_json::from_value::<ApiErrorCode>(json!(s)).unwrap(), code);
        assert_eq!(code.as_str(), s);
        assert_eq!(code.to_string(), s);
        assert!(seen.insert(s));
    }
    assert!(serde_json::from_value::<ApiErrorCode>(json!("InvalidArg")).is_err());
}

#[test]
fn api_response_ok_and_err_shapes() {
    let ok: ApiResponse<Value> = ApiResponse::Ok(json!({"x": 1}));
    let wire = serde_json::to_value(&ok).unwrap();
    assert_eq!(wire, json!({"ok": true, "result": {"x": 1}}));
    assert_eq!(serde_json::from_value::<ApiResponse<Value>>(wire).unwrap(), ok);

    let err: ApiResponse<Value> = ApiResponse::Err(ApiError::new(ApiErrorCode::JobNotFound, "no such job"));
    let wire = serde_json::to_value(&err).unwrap();
    assert_eq!(
        wire,
        json!({"ok": false, "error": {"code": "job_not_found", "message": "no such job"}})
    );
    assert_eq!(serde_json::from_value::<ApiResponse<Value>>(wire).unwrap(), err);

    let err: ApiResponse<Value> = ApiResponse::Err(ApiError::invalid_arg("limit", "bad"));
    let wire = serde_json::to_value(&err).unwrap();
    assert_eq!(
        wire,
        json!({"ok": false, "error": {"code": "invalid_arg", "message": "bad", "details": {"field": "limit"}}})
    );
    assert_eq!(serde_json::from_value::<ApiResponse<Value>>(wire).unwrap(), err);

    assert!(serde_json::from_value::<ApiResponse<Value>>(json!({"ok": true})).is_err());
    assert!(serde_json::from_value::<ApiResponse<Value>>(json!({"ok": false})).is_err());
    assert!(serde_json::from_value::<ApiResponse<Value>>(json!({"result": 1})).is_err());

    assert_eq!(
        ApiResponse::<u8>::from(Err(ApiError::new(ApiErrorCode::Cancelled, "c"))).into_result(),
        Err(ApiError::new(ApiErrorCode::Cancelled, "c"))
    );
    assert_eq!(ApiResponse::<u8>::from(Ok(3)).into_result(), Ok(3));
}

#[test]
fn api_response_null_result_round_trips() {
    let ok: ApiResponse<Value> = ApiResponse::Ok(Value::Null);
    let wire = serde_json::to_value(&ok).unwrap();
    assert_eq!(wire, json!({"ok": true, "result": null}));
    assert_eq!(serde_json::from_value::<ApiResponse<Value>>(wire).unwrap(), ok);
}

#[test]
fn api_error_result_too_large_details() {
    let e = ApiError::result_too_large(300_000, 262_144);
    assert_eq!(e.code, ApiErrorCode::ResultTooLarge);
    assert_eq!(
        e.details,
        Some(json!({"size": 300_000, "max": 262_144, "retriable": false}))
    );
    assert_eq!(
        serde_json::to_value(&e).unwrap()["details"],
        json!({"size": 300_000, "max": 262_144, "retriable": false})
    );
    assert!(e.to_string().starts_with("result_too_large: "), "{e}");
}

// =============================================================================================================
// api: target resolution and argument validation
// =============================================================================================================

fn target(plugin: &str, tool: &str) -> Target {
    Target {
        plugin: plugin.into(),
        tool: tool.into(),
    }
}

fn assert_invalid_arg<T: std::fmt::Debug>(r: Result<T, ApiError>, field: Option<&str>) {
    let e = r.unwrap_err();
    assert_eq!(e.code, ApiErrorCode::InvalidArg, "{e}");
    if let Some(field) = field {
        assert_eq!(
            e.details.as_ref().and_then(|d| d.get("field")),
            Some(&json!(field)),
            "{e}"
        );
    }
}

#[test]
fn target_resolution() {
    assert_eq!(
        Target::resolve("plugin.x__y", Some("run")).unwrap(),
        target("plugin.x__y", "run")
    );
    assert_eq!(Target::resolve("abc", Some("run")).unwrap(), target("abc", "run"));
    assert_eq!(Target::resolve("a.b", None).unwrap(), target("a", "b"));
    assert_eq!(Target::resolve("a__b", None).unwrap(), target("a", "b"));
    assert_eq!(Target::resolve("a__b.c", None).unwrap(), target("a", "b.c"));
    assert_eq!(Target::resolve("a.b__c", None).unwrap(), target("a", "b__c"));
    assert_eq!(
        Target::resolve("my-plugin.do_something", None).unwrap(),
        target("my-plugin", "do_something")
    );
}

#[test]
fn target_resolution_failures() {
    assert_invalid_arg(Target::resolve("abc", None), Some("method"));
    assert_invalid_arg(Target::resolve("abc", Some("")), Some("method"));
    assert_invalid_arg(Target::resolve("a.b", Some("")), Some("method"));
    assert_invalid_arg(Target::resolve("", None), Some("tool_id"));
    assert_invalid_arg(Target::resolve("", Some("m")), Some("tool_id"));
    for id in ["a.", ".b", "a__", "__b", ".", "__"] {
        assert_invalid_arg(Target::resolve(id, None), Some("method"));
    }
}

#[test]
fn invoke_args_timeout_minimum() {
    let args = |t: u64| InvokeArgs {
        tool_id: "a.b".into(),
        method: None,
        args: None,
        timeout_ms: Some(t),
    };
    assert_invalid_arg(args(999).validate(), Some("timeoutMs"));
    assert_invalid_arg(args(0).validate(), Some("timeoutMs"));
    assert_eq!(args(1000).validate().unwrap(), target("a", "b"));
    assert_eq!(
        args(1_000_000).validate().unwrap(),
        target("a", "b"),
        "large values are clamped elsewhere"
    );
    let no_timeout = InvokeArgs {
        timeout_ms: None,
        ..args(1000)
    };
    assert_eq!(no_timeout.validate().unwrap(), target("a", "b"));
}

#[test]
fn parse_args_maps_shape_errors_to_invalid_arg() {
    let a: InvokeArgs =
        parse_args(&json!({"tool_id": "p", "method": "m", "args": {"q": 1}, "timeoutMs": 5000})).unwrap();
    assert_eq!(a.method.as_deref(), Some("m"));
    assert_eq!(a.timeout_ms, Some(5000));
    assert_eq!(a.validate().unwrap(), target("p", "m"));

    assert_invalid_arg(
        parse_args::<InvokeArgs>(&json!({"tool_id": "a.b", "timeoutMs": true})),
        None,
    );
    assert_invalid_arg(
        parse_args::<InvokeArgs>(&json!({"tool_id": "a.b", "method": 5})),
        None,
    );
    assert_invalid_arg(
        parse_args::<InvokeArgs>(&json!({"tool_id": "a.b", "timeoutMs": -1})),
        None,
    );
    assert_invalid_arg(parse_args::<InvokeArgs>(&json!({"method": "m"})), None);
    assert_invalid_arg(
        parse_args::<InvokeArgs>(&json!({"tool_id": "a.b", "args": [1]})),
        None,
    );
    assert_invalid_arg(parse_args::<GetJobArgs>(&json!({"jobId": "tjob_XYZ"})), None);

    let l: ListJobsArgs = parse_args(&Value::Null).unwrap();
    assert_eq!(l, ListJobsArgs::default());
}

#[test]
fn parse_body_parses_once_and_agrees_with_parse_args() {
    let body = br#"{"tool_id": "p", "method": "m", "args": {"q": [1, {"r": "s"}]}, "timeoutMs": 5000}"#;
    let once: InvokeArgs = parse_body(body).unwrap();
    let tree: InvokeArgs = parse_args(&serde_json::from_slice(body).unwrap()).unwrap();
    assert_eq!(once.args, tree.args);
    assert_eq!(once.timeout_ms, Some(5000));
    assert_eq!(once.validate().unwrap(), target("p", "m"));
    // Nothing, `null` (with blanks) and `{}` are the empty arguments.
    for empty in [&b""[..], b"null", b" null\n", b"{}"] {
        assert_eq!(
            parse_body::<ListJobsArgs>(empty).unwrap(),
            ListJobsArgs::default()
        );
    }
    // Not JSON, and JSON of the wrong shape: both invalid_arg, told apart by their message.
    for (body, says) in [
        (&b"{\"tool_id\": "[..], "arguments are not JSON"),
        (b"{} trailing", "arguments are not JSON"),
        (br#"{"tool_id": "a.b", "timeoutMs": true}"#, "invalid arguments"),
        (br#"{"tool_id": "a.b", "args": [1]}"#, "invalid arguments"),
        (b"[1]", "invalid arguments"),
    ] {
        let e = parse_body::<InvokeArgs>(body).unwrap_err();
        assert_eq!(e.code, ApiErrorCode::InvalidArg, "{e:?}");
        assert!(
            e.message.starts_with(says),
            "{:?}: {}",
            String::from_utf8_lossy(body),
            e.message
        );
    }
}

#[test]
fn invoke_async_args_size_limit_is_exact() {
    // {"a":"xxx…"} is 8 bytes plus the x's.
    let args_of = |n: usize| -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("a".into(), json!("x".repeat(n)));
        m
    };
    let at_limit = args_of(65_536 - 8);
    let over = args_of(65_537 - 8);
    assert_eq!(serde_json::to_vec(&at_limit).unwrap().len(), 65_536);
    assert_eq!(serde_json::to_vec(&over).unwrap().len(), 65_537);

    let with = |args: Map<String, Value>| InvokeAsyncArgs {
        tool_id: "a.b".into(),
        method: None,
        args: Some(args),
        timeout_ms: None,
        client_tag: None,
    };
    assert_eq!(with(at_limit).validate().unwrap(), target("a", "b"));
    let e = with(over).validate().unwrap_err();
    assert_eq!(e.code, ApiErrorCode::InvalidArg);
    assert_eq!(
        e.details,
        Some(json!({"field": "args", "reason": "args_too_large", "size": 65_537, "max": 65_536}))
    );
}

#[test]
fn invoke_async_client_tag_counts_characters() {
    let with = |tag: String| InvokeAsyncArgs {
        tool_id: "p".into(),
        method: Some("t".into()),
        args: None,
        timeout_ms: Some(1),
        client_tag: Some(tag),
    };
    assert_eq!(with("a".repeat(120)).validate().unwrap(), target("p", "t"));
    assert_invalid_arg(with("a".repeat(121)).validate(), Some("clientTag"));
    assert_eq!(with("é".repeat(120)).validate().unwrap(), target("p", "t"));
    assert_invalid_arg(with("é".repeat(121)).validate(), Some("clientTag"));
    assert_eq!(with("🔧".repeat(120)).validate().unwrap(), target("p", "t"));
    assert_eq!(with(String::new()).validate().unwrap(), target("p", "t"));
    // The tool must still resolve.
    let unresolvable = InvokeAsyncArgs {
        method: None,
        ..with("x".into())
    };
    assert_invalid_arg(unresolvable.validate(), Some("method"));
}

#[test]
fn cancel_job_reason_length() {
    let with = |reason: Option<String>| CancelJobArgs {
        job_id: job_id(),
        reason,
    };
    assert!(with(None).validate().is_ok());
    assert!(with(Some("r".repeat(200))).validate().is_ok());
    assert!(with(Some("é".repeat(200))).validate().is_ok());
    assert_invalid_arg(with(Some("r".repeat(201))).validate(), Some("reason"));
    assert_invalid_arg(with(Some("é".repeat(201))).validate(), Some("reason"));
}

#[test]
fn get_job_limit_range() {
    let with = |limit: Option<u32>| GetJobArgs {
        job_id: job_id(),
        since_seq: None,
        limit,
    };
    assert!(with(None).validate().is_ok());
    assert!(with(Some(1)).validate().is_ok());
    assert!(with(Some(500)).validate().is_ok());
    assert_invalid_arg(with(Some(0)).validate(), Some("limit"));
    assert_invalid_arg(with(Some(501)).validate(), Some("limit"));

    let parsed: GetJobArgs =
        parse_args(&json!({"jobId": format!("tjob_{HEX32}"), "sinceSeq": 4, "limit": 10})).unwrap();
    assert_eq!(parsed.since_seq, Some(4));
    assert_eq!(parsed.limit, Some(10));
}

#[test]
fn list_jobs_limit_range_and_state_shapes() {
    let with = |limit: Option<u32>| ListJobsArgs {
        limit,
        ..ListJobsArgs::default()
    };
    assert!(with(None).validate().is_ok());
    assert!(with(Some(1)).validate().is_ok());
    assert!(with(Some(100)).validate().is_ok());
    assert_invalid_arg(with(Some(0)).validate(), Some("limit"));
    assert_invalid_arg(with(Some(101)).validate(), Some("limit"));

    let tagged = ListJobsArgs {
        client_tag: Some("t".repeat(121)),
        ..ListJobsArgs::default()
    };
    assert_invalid_arg(tagged.validate(), Some("clientTag"));
    let cursor = |chars: usize| ListJobsArgs {
        cursor: Some("c".repeat(chars)),
        ..ListJobsArgs::default()
    };
    assert!(cursor(64).validate().is_ok());
    assert_invalid_arg(cursor(65).validate(), Some("cursor"));

    let one: ListJobsArgs = parse_args(&json!({"state": "running"})).unwrap();
    assert_eq!(one.state, Some(OneOrMany::One(JobState::Running)));
    assert_eq!(one.state.unwrap().to_vec(), [JobState::Running]);

    let many: ListJobsArgs = parse_args(&json!({"state": ["queued", "failed"]})).unwrap();
    assert_eq!(
        many.state,
        Some(OneOrMany::Many(vec![JobState::Queued, JobState::Failed]))
    );
    assert_eq!(many.state.unwrap().to_vec(), [JobState::Queued, JobState::Failed]);

    assert_invalid_arg(parse_args::<ListJobsArgs>(&json!({"state": "done"})), None);
    assert_invalid_arg(parse_args::<ListJobsArgs>(&json!({"state": 1})), None);

    let full: ListJobsArgs = parse_args(&json!({
        "tool_id": "a.b", "clientTag": "t", "since": "2024-01-01T00:00:00Z", "limit": 5, "cursor": "1f.a"
    }))
    .unwrap();
    assert_eq!(full.tool_id.as_deref(), Some("a.b"));
    assert_eq!(full.client_tag.as_deref(), Some("t"));
    assert_eq!(full.limit, Some(5));
    assert_eq!(full.cursor.as_deref(), Some("1f.a"));
    assert_invalid_arg(parse_args::<ListJobsArgs>(&json!({"cursor": 7})), None);

    // The result's cursor is there only to continue; a result without one reads as before.
    let last = ListJobsResult {
        jobs: Vec::new(),
        truncated: false,
        cursor: None,
    };
    assert_eq!(
        serde_json::to_value(&last).unwrap(),
        json!({"jobs": [], "truncated": false})
    );
    let more: ListJobsResult =
        serde_json::from_value(json!({"jobs": [], "truncated": true, "cursor": "1f.a"})).unwrap();
    assert_eq!(more.cursor.as_deref(), Some("1f.a"));
    let old: ListJobsResult = serde_json::from_value(json!({"jobs": [], "truncated": true})).unwrap();
    assert_eq!(old.cursor, None);
}

// =============================================================================================================
// api: job snapshot and event casing
// =============================================================================================================

fn keys(v: &Value) -> BTreeSet<String> {
    v.as_object().unwrap().keys().cloned().collect()
}

#[test]
fn job_snapshot_is_camel_case_with_tool_id() {
    let snap = JobSnapshot {
        job_id: job_id(),
        state: JobState::Running,
        tool_id: "a.b".into(),
        method: None,
        client_tag: Some("tag".into()),
        result: None,
        error: None,
        progress: vec![ProgressEvent {
            seq: 1,
            kind: ProgressType::Progress,
            data: json!({"pct": 10}),
        }],
        last_seq: 1,
        last_heartbeat_at: None,
        created_at: "2024-01-01T00:00:00Z".into(),
        started_at: None,
        finished_at: None,
        updated_at: None,
        deadline_ms: 1_700_000_000_000,
    };
    let wire = serde_json::to_value(&snap).unwrap();
    assert_eq!(
        keys(&wire),
        set(&[
            "jobId",
            "state",
            "tool_id",
            "clientTag",
            "lastSeq",
            "createdAt",
            "deadlineMs",
            "progress",
        ])
    );
    assert_eq!(
        wire,
        json!({
            "jobId": format!("tjob_{HEX32}"),
            "state": "running",
            "tool_id": "a.b",
            "clientTag": "tag",
            "progress": [{"seq": 1, "type": "progress", "data": {"pct": 10}}],
            "lastSeq": 1,
            "createdAt": "2024-01-01T00:00:00Z",
            "deadlineMs": 1_700_000_000_000u64
        })
    );
    assert_eq!(serde_json::from_value::<JobSnapshot>(wire).unwrap(), snap);

    let finished = JobSnapshot {
        state: JobState::Failed,
        method: Some("b".into()),
        error: Some(ApiError::new(ApiErrorCode::ToolFailed, "x")),
        last_heartbeat_at: Some("h".into()),
        started_at: Some("s".into()),
        finished_at: Some("f".into()),
        updated_at: Some("u".into()),
        progress: Vec::new(),
        ..snap
    };
    let wire = serde_json::to_value(&finished).unwrap();
    assert_eq!(
        keys(&wire),
        set(&[
            "jobId",
            "state",
            "tool_id",
            "method",
            "clientTag",
            "error",
            "progress",
            "lastSeq",
            "lastHeartbeatAt",
            "createdAt",
            "startedAt",
            "finishedAt",
            "updatedAt",
            "deadlineMs",
        ])
    );
    assert_eq!(serde_json::from_value::<JobSnapshot>(wire).unwrap(), finished);
}

#[test]
fn tool_job_event_is_snake_case() {
    let ev = ToolJobEvent {
        job_id: job_id(),
        tool_id: "a.b".into(),
        state: JobState::Running,
        seq: 3,
        event: Some(ProgressEvent {
            seq: 3,
            kind: ProgressType::ToolUpdate,
            data: json!("x"),
        }),
        terminal: false,
    };
    let wire = serde_json::to_value(&ev).unwrap();
    assert_eq!(
        keys(&wire),
        set(&["job_id", "tool_id", "state", "seq", "event", "terminal"])
    );
    assert_eq!(
        wire,
        json!({
            "job_id": format!("tjob_{HEX32}"),
            "tool_id": "a.b",
            "state": "running",
            "seq": 3,
            "event": {"seq": 3, "type": "tool_update", "data": "x"},
            "terminal": false
        })
    );
    assert_eq!(serde_json::from_value::<ToolJobEvent>(wire).unwrap(), ev);

    let done = ToolJobEvent {
        state: JobState::Succeeded,
        event: None,
        terminal: true,
        ..ev
    };
    assert_eq!(
        keys(&serde_json::to_value(&done).unwrap()),
        set(&["job_id", "tool_id", "state", "seq", "terminal"])
    );
}

#[test]
fn job_quota_details_are_typed_for_every_quota() {
    let active = ApiError::with_details(
        ApiErrorCode::JobQuotaExceeded,
        "5 jobs are active; at most 5 per user",
        json!({ "active": 5, "max": 5 }),
    );
    assert_eq!(
        active.job_quota(),
        Some(JobQuotaDetails::Active { active: 5, max: 5 })
    );
    // The server's constructor spells message and details from the typed value, and they read back.
    let made = ApiError::job_quota_exceeded(JobQuotaDetails::Active { active: 5, max: 5 });
    assert_eq!(made.code, ApiErrorCode::JobQuotaExceeded);
    assert_eq!(made.message, "5 jobs are active; at most 5 per user");
    assert_eq!(made.details, Some(json!({ "active": 5, "max": 5 })));
    let made = ApiError::job_quota_exceeded(JobQuotaDetails::Retained {
        retained: 10_000,
        max: 10_000,
        retry_after_ms: 1_001,
        retriable: false,
    });
    assert_eq!(
        made.message,
        "10000 jobs were created within the retention, the limit is 10000; retry in 2 s"
    );
    assert_eq!(
        made.details,
        Some(json!({ "retained": 10_000, "max": 10_000, "retry_after_ms": 1_001, "retriable": true }))
    );
    assert_eq!(
        made.job_quota().and_then(|d| d.retry_after()),
        Some(std::time::Duration::from_millis(1_001))
    );
    assert_eq!(active.job_quota().unwrap().retry_after(), None);
    // The stored-bytes quota: its own fields, read back as themselves (not as the retained-jobs shape).
    let made = ApiError::job_quota_exceeded(JobQuotaDetails::Stored {
        stored_bytes: 268_000_000,
        job_reserve_bytes: 5_000_000,
        max_bytes: 268_435_456,
        retry_after_ms: 3_600_000,
        retriable: false,
    });
    assert_eq!(
        made.message,
        "the user's jobs keep 268000000 bytes and one more may keep 5000000, the limit is 268435456; retry in 3600 s"
    );
    assert_eq!(
        made.details,
        Some(json!({
            "stored_bytes": 268_000_000u64, "job_reserve_bytes": 5_000_000, "max_bytes": 268_435_456u64,
            "retry_after_ms": 3_600_000, "retriable": true
        }))
    );
    assert_eq!(
        made.job_quota(),
        Some(JobQuotaDetails::Stored {
            stored_bytes: 268_000_000,
            job_reserve_bytes: 5_000_000,
            max_bytes: 268_435_456,
            retry_after_ms: 3_600_000,
            retriable: true,
        })
    );
    assert_eq!(
        made.job_quota().and_then(|d| d.retry_after()),
        Some(std::time::Duration::from_secs(3_600))
    );
    let retained = ApiError::with_details(
        ApiErrorCode::JobQuotaExceeded,
        "10000 jobs created within the retention",
        json!({ "retained": 10_000, "max": 10_000, "retry_after_ms": 1500, "retriable": true }),
    );
    let details = retained.job_quota().unwrap();
    assert_eq!(
        details,
        JobQuotaDetails::Retained {
            retained: 10_000,
            max: 10_000,
            retry_after_ms: 1500,
            retriable: true
        }
    );
    assert_eq!(
        details.retry_after(),
        Some(std::time::Duration::from_millis(1500))
    );
    // Another code, or details of another shape, are not a quota.
    let other = ApiError::with_details(
        ApiErrorCode::RateLimited,
        "slow down",
        json!({ "active": 5, "max": 5 }),
    );
    assert_eq!(other.job_quota(), None);
    let odd = ApiError::with_details(ApiErrorCode::JobQuotaExceeded, "?", json!({ "max": "five" }));
    assert_eq!(odd.job_quota(), None);
    assert_eq!(
        ApiError::new(ApiErrorCode::JobQuotaExceeded, "?").job_quota(),
        None
    );
}

#[test]
fn keepalive_tokens_name_one_subject_and_nothing_else() {
    use fleet_proto::api::subjects::{KEEPALIVE_TOKEN_MAX, keepalive, keepalive_token_ok};
    assert_eq!(keepalive("abc.7"), "fleet.v1.events.keepalive.abc.7");
    assert!(keepalive_token_ok("Xy9.12"));
    assert!(keepalive_token_ok(&"a".repeat(KEEPALIVE_TOKEN_MAX)));
    for bad in [
        String::new(),
        "a".repeat(KEEPALIVE_TOKEN_MAX + 1),
        "*".into(),
        ">".into(),
        "a.>".into(),
        "a..b".into(),
        ".a".into(),
        "a.".into(),
        "a b".into(),
        "a-b".into(),
        "ü".into(),
    ] {
        assert!(!keepalive_token_ok(&bad), "{bad:?} is refused");
    }
}

/// The bytes a front signs or MACs: each part preceded by its length, 8 bytes big-endian, domain tag first
/// (a change here breaks every seal between releases).
#[test]
fn seal_and_grant_inputs_are_length_prefixed_parts() {
    use fleet_proto::api::worker::{grant_input, seal_input};
    let framed = |parts: &[&[u8]]| -> Vec<u8> {
        parts
            .iter()
            .flat_map(|p| {
                (p.len() as u64)
                    .to_be_bytes()
                    .into_iter()
                    .chain(p.iter().copied())
            })
            .collect()
    };
    assert_eq!(
        seal_input("fleet.v1.worker.w.exec", "1.ab", b"{}"),
        framed(&[b"fleet-exec-seal-v1", b"fleet.v1.worker.w.exec", b"1.ab", b"{}"])
    );
    assert_eq!(&seal_input("s", "t", b"")[..8], &18u64.to_be_bytes());
    assert_eq!(
        grant_input("W", "F", 1_700_000_000_000),
        framed(&[b"fleet-exec-grant-v1", b"W", b"F", b"1700000000000"])
    );
}

/// A front reads `tools.invoke`'s `args` as text (`RawInvokeArgs`): kept byte for byte, `null` or absent is no
/// args, anything but an object is `invalid_arg` as with `InvokeArgs`; forwarded in the exec request, they are the
/// same JSON a map gives, and the worker's tree is the app's.
#[test]
fn raw_invoke_args_keep_the_apps_text_and_forward_the_same_json() {
    use fleet_proto::api::worker::ExecRequest;
    use fleet_proto::api::{RawArgs, RawInvokeArgs};
    let body =
        br#"{"tool_id": "p", "method": "m", "args": {"q": [1, {"r": "s"}],  "t": 1.50}, "timeoutMs": 5000}"#;
    let raw: RawInvokeArgs = parse_body(body).unwrap();
    let tree: InvokeArgs = parse_body(body).unwrap();
    let args = raw.args.clone().unwrap();
    assert_eq!(
        args.get(),
        r#"{"q": [1, {"r": "s"}],  "t": 1.50}"#,
        "the app's bytes, not re-serialized"
    );
    assert_eq!(args.to_map().unwrap(), tree.args.clone().unwrap());
    assert_eq!(raw.validate().unwrap(), tree.validate().unwrap());
    for none in [
        &br#"{"tool_id": "a.b"}"#[..],
        br#"{"tool_id": "a.b", "args": null}"#,
    ] {
        assert_eq!(parse_body::<RawInvokeArgs>(none).unwrap().args, None);
    }
    for bad in [
        &br#"{"tool_id": "a.b", "args": [1]}"#[..],
        br#"{"tool_id": "a.b", "args": "x"}"#,
    ] {
        let e = parse_body::<RawInvokeArgs>(bad).unwrap_err();
        assert_eq!(e.code, ApiErrorCode::InvalidArg, "{e:?}");
        assert!(e.message.starts_with("invalid arguments"), "{e:?}");
    }
    // From a tree too (a delegated call's arguments).
    let from_tree: RawInvokeArgs = parse_args(&json!({"tool_id": "a.b", "args": {"k": "v"}})).unwrap();
    assert_eq!(
        from_tree.args.unwrap().to_map().unwrap(),
        json!({"k": "v"}).as_object().unwrap().clone()
    );
    // The exec request: the same wire as a map, and `{}` when absent.
    let map = tree.args.unwrap();
    let req: ExecRequest = serde_json::from_value(json!({
        "kind": "sync", "user": "u", "tool_id": "p", "plugin": "p", "tool": "m", "arguments": map,
        "invoke_id": "i", "default_timeout_ms": 1, "max_timeout_ms": 2,
    }))
    .unwrap();
    assert_eq!(req.arguments, RawArgs::from_map(&map));
    let wire: Value = serde_json::to_value(&req).unwrap();
    assert_eq!(wire["arguments"], Value::Object(map));
    let mut bare = wire;
    bare.as_object_mut().unwrap().remove("arguments");
    let req: ExecRequest = serde_json::from_value(bare).unwrap();
    assert_eq!(req.arguments.get(), "{}");
    assert_eq!(RawArgs::default().to_map().unwrap(), Map::new());
}
