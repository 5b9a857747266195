//! API and window token parsing: an `Authorization` value as the front and the HTTP gateway verify it
//! (`fleet_client::auth::Verifier::verify`, `OperatorVerifier::verify`, `fleet::http::window::verify_window`).
//! A forged signature stops at the signature check, so two more modes sign what the fuzzer makes with the
//! verifier's own key, reaching the claim checks: fuzzed claims (minted by `SigningKey::mint_with_claims`) and
//! fuzzed raw header and payload bytes (signed by jsonwebtoken, as any HS256 issuer would).
//!
//! Checked: nothing panics; every refusal is `invalid_token` (or `unauthorized` for the operator API); a
//! principal has a valid subject.
#![no_main]

use std::sync::OnceLock;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use fleet::http::window::{verify_window, window_verifier};
use fleet_client::auth::{OperatorVerifier, SigningKey, Verifier};
use fleet_proto::api::ApiErrorCode;
use jsonwebtoken::{Algorithm, EncodingKey};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

const SECRET: &[u8] = b"fuzzing-secret-fuzzing-secret-32";
const ISSUER: &str = "fleet-fuzz";
const AUDIENCE: &str = "fleet-api";

struct Keys {
    signing: SigningKey,
    api: Verifier,
    window: Verifier,
    operator: OperatorVerifier,
}

fn keys() -> &'static Keys {
    static KEYS: OnceLock<Keys> = OnceLock::new();
    KEYS.get_or_init(|| {
        let signing = SigningKey::hs256(SECRET).expect("key");
        let verify = || vec![signing.verify_key().expect("verify key")];
        let api = Verifier::new(verify(), ISSUER, AUDIENCE).expect("verifier");
        let window = window_verifier(&api).expect("window verifier");
        let operator = OperatorVerifier::new(verify(), ISSUER).expect("operator verifier");
        Keys {
            signing,
            api,
            window,
            operator,
        }
    })
}

/// No error text repeats the token (checked for tokens long enough not to occur in a message by chance).
fn no_token_in(text: &str, header: &str) {
    let token = header.trim();
    let token = token.strip_prefix("Bearer ").unwrap_or(token).trim();
    if token.len() >= 24 {
        assert!(!text.contains(token), "an error repeats the token: {text}");
    }
}

fn check(header: &str) {
    let k = keys();
    match k.api.verify(header) {
        Ok(p) => assert!(!p.user.is_empty(), "a principal has a subject"),
        Err(e) => {
            assert!(e.is_token_error(), "{e:?}");
            let api = e.to_api_error();
            no_token_in(&format!("{e} {e:?} {} {:?}", api.message, api.details), header);
        }
    }
    if let Err(e) = verify_window(&k.window, header) {
        assert_eq!(e.code, ApiErrorCode::InvalidToken, "{e:?}");
        no_token_in(&format!("{} {:?}", e.message, e.details), header);
    }
    let _ = k.operator.verify(header);
    let _ = k.operator.authorize(Some(header), "fuzzing");
}

fuzz_target!(|data: &[u8]| {
    let Some((mode, rest)) = data.split_first() else {
        return;
    };
    let k = keys();
    match mode % 3 {
        0 => check(&String::from_utf8_lossy(rest)),
        1 => {
            let Ok(Value::Object(mut claims)) = serde_json::from_slice::<Value>(rest) else {
                return;
            };
            let user = match claims.remove("sub") {
                Some(Value::String(s)) => s,
                _ => "fuzz-user".to_owned(),
            };
            let audience = match claims.remove("aud") {
                Some(Value::String(s)) if s == "window" => k.window.audience().to_owned(),
                _ => AUDIENCE.to_owned(),
            };
            if let Ok(token) =
                k.signing
                    .mint_with_claims(&user, ISSUER, &audience, Duration::from_secs(600), claims)
            {
                check(&format!("Bearer {token}"));
            }
        }
        _ => {
            let Some((&n, rest)) = rest.split_first() else {
                return;
            };
            let (header, payload) = rest.split_at(usize::from(n).min(rest.len()));
            let message = format!(
                "{}.{}",
                URL_SAFE_NO_PAD.encode(header),
                URL_SAFE_NO_PAD.encode(payload)
            );
            let Ok(key) = EncodingKey::from_secret(SECRET) else {
                return;
            };
            if let Ok(sig) = jsonwebtoken::crypto::sign(message.as_bytes(), &key, Algorithm::HS256) {
                check(&format!("Bearer {message}.{sig}"));
            }
        }
    }
});
