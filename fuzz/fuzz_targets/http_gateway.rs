//! The HTTP gateway's request parsing, without a front or a store behind it; the first byte picks the part:
//! - `POST /v1/rpc`: the envelope, the window token of `Authorization` and the ACL
//!   (`fleet::http::rpc::check_request`), with fuzzed bodies under a token the fuzzer cannot forge and under a
//!   valid token whose `wid` and `tools` come from the input;
//! - request URIs (paths and queries) as axum's `Query` extracts them: the signed links' `GetQuery` and `PutQuery`,
//!   the event streams' `TokenQuery`, the OAuth callback's parameters;
//! - signed links' signatures (`LinkSigner`): a fuzzed signature is refused, and what was signed verifies;
//! - the `Content-Type` of a link's PUT (`MediaType::parse`) and a file path (`files::validate_path`).
//!
//! Checked: nothing panics; an envelope refused is `invalid_arg`, `invalid_token`, `permission_denied` or
//! `not_implemented`; a signature verifies exactly for what was signed.
#![no_main]

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::Duration;

use axum::extract::Query;
use axum::http::Uri;
use fleet::http::files::{GetQuery, PutQuery};
use fleet::http::rpc::check_request;
use fleet::http::sse::TokenQuery;
use fleet::http::window::window_verifier;
use fleet_client::auth::{SigningKey, Verifier};
use fleet_proto::api::ApiErrorCode;
use fleet_services::files::{LinkSigner, validate_path};
use fleet_services::media_type::MediaType;
use libfuzzer_sys::fuzz_target;
use serde_json::{Map, Value, json};

const SECRET: &[u8] = b"fuzzing-secret-fuzzing-secret-32";
const ISSUER: &str = "fleet-fuzz";

struct Keys {
    signing: SigningKey,
    window: Verifier,
}

fn keys() -> &'static Keys {
    static KEYS: OnceLock<Keys> = OnceLock::new();
    KEYS.get_or_init(|| {
        let signing = SigningKey::hs256(SECRET).expect("key");
        let api = Verifier::new(
            vec![signing.verify_key().expect("verify key")],
            ISSUER,
            "fleet-api",
        )
        .expect("verifier");
        Keys {
            signing,
            window: window_verifier(&api).expect("window verifier"),
        }
    })
}

/// A valid window token for window `wid` of the given allow-list.
fn window_token(wid: &str, tools: Option<Value>) -> Option<String> {
    let k = keys();
    let mut claims = Map::new();
    claims.insert("wid".into(), json!(wid));
    claims.insert("app".into(), json!("fuzz-app"));
    claims.insert("ver".into(), json!("1"));
    if let Some(tools) = tools {
        claims.insert("tools".into(), tools);
    }
    k.signing
        .mint_with_claims(
            "fuzz-user",
            ISSUER,
            k.window.audience(),
            Duration::from_secs(600),
            claims,
        )
        .ok()
}

fn rpc(authorization: &str, body: &[u8]) {
    if let Err(e) = check_request(&keys().window, authorization, body) {
        assert!(
            matches!(
                e.code,
                ApiErrorCode::InvalidArg
                    | ApiErrorCode::InvalidToken
                    | ApiErrorCode::PermissionDenied
                    | ApiErrorCode::NotImplemented
            ),
            "{e:?}"
        );
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((which, rest)) = data.split_first() else {
        return;
    };
    match which % 6 {
        // A body and an Authorization value, split at the first LF.
        0 => {
            let (auth, body) = match rest.iter().position(|&b| b == b'\n') {
                Some(i) => (&rest[..i], &rest[i + 1..]),
                None => (&[][..], rest),
            };
            rpc(&String::from_utf8_lossy(auth), body);
        }
        // A body under a valid token; the token's `wid` is the body's `window_uuid` when it has one, its allow-list
        // the body's `_tools`.
        1 => {
            let parsed = serde_json::from_slice::<Value>(rest).ok();
            let wid = parsed
                .as_ref()
                .and_then(|v| v.get("window_uuid"))
                .and_then(Value::as_str)
                .unwrap_or("w1")
                .to_owned();
            let tools = parsed.as_ref().and_then(|v| v.get("_tools")).cloned();
            if let Some(token) = window_token(&wid, tools) {
                rpc(&format!("Bearer {token}"), rest);
            }
        }
        // A request URI.
        2 => {
            if let Ok(uri) = Uri::try_from(rest) {
                let _ = Query::<GetQuery>::try_from_uri(&uri);
                let _ = Query::<PutQuery>::try_from_uri(&uri);
                let _ = Query::<TokenQuery>::try_from_uri(&uri);
                let _ = Query::<HashMap<String, String>>::try_from_uri(&uri);
                let _ = uri.path().split('/').map(validate_path).count();
            }
        }
        // A signed link's parts (LF-separated, the last one the signature).
        3 => {
            let text = String::from_utf8_lossy(rest);
            let mut parts: Vec<&str> = text.split('\n').collect();
            let sig = parts.pop().unwrap_or_default();
            let signer = LinkSigner::new(SECRET);
            let signed = signer.sign(&parts);
            assert!(signer.verify(&parts, &signed), "what was signed verifies");
            assert_eq!(
                signer.verify(&parts, sig),
                sig.eq_ignore_ascii_case(&signed),
                "a signature verifies exactly"
            );
        }
        // A Content-Type.
        4 => {
            if let Ok(text) = std::str::from_utf8(rest)
                && let Ok(media) = MediaType::parse(text)
            {
                let again = MediaType::parse(media.as_str()).expect("a parsed media type re-parses");
                assert_eq!(again.as_str(), media.as_str(), "a media type's form is stable");
                let _ = (media.essence(), media.disposition(), media.without_parameters());
            }
        }
        // A file path.
        _ => {
            if let Ok(text) = std::str::from_utf8(rest) {
                let _ = validate_path(text);
            }
        }
    }
});
