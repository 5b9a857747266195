//! `fleet::auth`: token verification rules, minting, key rotation and `kid` selection, and the dev signing key.
//! Every rejection asserts the exact [`AuthError`] variant and that its API error is `invalid_token` without the
//! token's text.
#![allow(clippy::unwrap_used)]

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fleet_client::auth::{
    AuthError, DEFAULT_AUDIENCE, DEFAULT_ISSUER, DevKey, KeyAlgorithm, Principal, SigningKey, Verifier,
    VerifyKey,
};
use fleet_proto::api::ApiErrorCode;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{Map, Value, json};

const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";
const OTHER_SECRET: &[u8] = b"fedcba9876543210fedcba9876543210";

// Two Ed25519 key pairs, generated once with `openssl genpkey -algorithm ed25519` / `openssl pkey -pubout`.
const ED_A_PRIVATE: &str = "-----BEGIN PRIVATE KEY-----
MC4CAQAwBQYDK2VwBCIEIPU998kzpV/GLdbLsTFxG4h5Xz++IRuTNZkEnDspxbhn
-----END PRIVATE KEY-----
";
const ED_A_PUBLIC: &str = "-----BEGIN PUBLIC KEY-----
MCowBQYDK2VwAyEAkTX7WLeanadEz1bczdvdtqnvfyAy/amY9TBOnr6AD7Q=
-----END PUBLIC KEY-----
";
const ED_B_PRIVATE: &str = "-----BEGIN PRIVATE KEY-----
MC4CAQAwBQYDK2VwBCIEIB5DXZpaM2eGLPOJXFz7KAtqxud/FntbxzX0lBQ0YOcc
-----END PRIVATE KEY-----
";
const ED_B_PUBLIC: &str = "-----BEGIN PUBLIC KEY-----
MCowBQYDK2VwAyEApiJIablZY4VaRbSsdfTPaUzoY14Za5S6yOX8+dmLmxU=
-----END PUBLIC KEY-----
";
/// Key A in the PKCS#8 v2 form (with the public key) that ring and ed25519-dalek write.
const ED_A_PRIVATE_V2: &str = "-----BEGIN PRIVATE KEY-----
MFECAQEwBQYDK2VwBCIEIPU998kzpV/GLdbLsTFxG4h5Xz++IRuTNZkEnDspxbhn
gSEAkTX7WLeanadEz1bczdvdtqnvfyAy/amY9TBOnr6AD7Q=
-----END PRIVATE KEY-----
";

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs()
}

/// Valid claims for `user`, as a map a test can take a claim out of.
fn claims(user: &str) -> Map<String, Value> {
    let now = now();
    let Value::Object(map) = json!({
        "sub": user,
        "iss": DEFAULT_ISSUER,
        "aud": DEFAULT_AUDIENCE,
        "iat": now,
        "exp": now + 600,
    }) else {
        unreachable!()
    };
    map
}

fn sign_hs(secret: &[u8], claims: &Map<String, Value>, kid: Option<&str>) -> String {
    let mut header = Header::new(Algorithm::HS256);
    header.kid = kid.map(str::to_owned);
    jsonwebtoken::encode(&header, claims, &EncodingKey::from_secret(secret).unwrap()).unwrap()
}

fn sign_ed(private_pem: &str, claims: &Map<String, Value>) -> String {
    let key = EncodingKey::from_ed_pem(private_pem.as_bytes()).unwrap();
    jsonwebtoken::encode(&Header::new(Algorithm::EdDSA), claims, &key).unwrap()
}

fn hs_verifier() -> Verifier {
    Verifier::new(
        vec![VerifyKey::hs256(SECRET).unwrap()],
        DEFAULT_ISSUER,
        DEFAULT_AUDIENCE,
    )
    .unwrap()
}

fn ed_verifier() -> Verifier {
    Verifier::new(
        vec![VerifyKey::ed25519_public_pem(ED_A_PUBLIC.as_bytes()).unwrap()],
        DEFAULT_ISSUER,
        DEFAULT_AUDIENCE,
    )
    .unwrap()
}

fn b64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..=chunk.len() {
            out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
        }
    }
    out
}

/// Verifies `token` (bare), expecting a failure; checks the API rendering never carries the token.
fn reject(verifier: &Verifier, token: &str) -> AuthError {
    let err = verifier.verify(token).expect_err("the token must be rejected");
    assert_api_error_is_clean(&err, token);
    err
}

fn assert_api_error_is_clean(err: &AuthError, token: &str) {
    assert!(err.is_token_error(), "{err:?}");
    let api = err.to_api_error();
    assert_eq!(api.code, ApiErrorCode::InvalidToken, "{err:?}");
    assert_eq!(api.details.as_ref().unwrap()["reason"], err.reason());
    let rendered = serde_json::to_string(&api).unwrap();
    let debug = format!("{err:?} {err}");
    for text in [&rendered, &debug] {
        if !token.is_empty() {
            assert!(!text.contains(token), "{text} echoes the token");
        }
        for part in token.split('.').filter(|p| p.len() >= 8) {
            assert!(!text.contains(part), "{text} echoes a part of the token");
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Accepted tokens.

#[test]
fn valid_hs256_token_gives_the_principal() {
    let c = claims("alice");
    let exp = c["exp"].as_u64().unwrap();
    let token = sign_hs(SECRET, &c, None);
    let p = hs_verifier().verify(&format!("Bearer {token}")).unwrap();
    assert_eq!(
        p,
        Principal {
            user: "alice".into(),
            operator: false,
            expires_at: exp
        }
    );
}

#[test]
fn operator_claim() {
    let mut c = claims("root");
    c.insert("operator".into(), json!(true));
    assert!(hs_verifier().verify(&sign_hs(SECRET, &c, None)).unwrap().operator);

    c.insert("operator".into(), json!(false));
    assert!(!hs_verifier().verify(&sign_hs(SECRET, &c, None)).unwrap().operator);

    c.insert("operator".into(), json!("true"));
    let token = sign_hs(SECRET, &c, None);
    assert!(matches!(
        reject(&hs_verifier(), &token),
        AuthError::InvalidClaim("operator")
    ));
}

#[test]
fn bearer_prefix_and_bare_token_both_work() {
    let token = sign_hs(SECRET, &claims("alice"), None);
    let v = hs_verifier();
    for value in [
        token.clone(),
        format!("Bearer {token}"),
        format!("bearer {token}"),
        format!("  Bearer   {token}  "),
    ] {
        assert_eq!(v.verify(&value).unwrap().user, "alice", "{value:?}");
    }
    let err = v.verify(&format!("Basic {token}")).unwrap_err();
    assert!(matches!(err, AuthError::Malformed(_)), "{err:?}");
    assert_api_error_is_clean(&err, &token);
}

#[test]
fn minted_tokens_verify() {
    let key = SigningKey::hs256(SECRET).unwrap();
    let v = Verifier::new(vec![key.verify_key().unwrap()], DEFAULT_ISSUER, DEFAULT_AUDIENCE).unwrap();
    let token = key
        .mint(
            "bob",
            DEFAULT_ISSUER,
            DEFAULT_AUDIENCE,
            Duration::from_secs(60),
            false,
        )
        .unwrap();
    let p = v.verify(&token).unwrap();
    assert_eq!(p.user, "bob");
    assert!(!p.operator);
    assert!(p.expires_at >= now() + 59 && p.expires_at <= now() + 60);

    let token = key
        .mint(
            "ops",
            DEFAULT_ISSUER,
            DEFAULT_AUDIENCE,
            Duration::from_secs(60),
            true,
        )
        .unwrap();
    assert!(v.verify(&token).unwrap().operator);

    // Minted for another audience / issuer: refused by this verifier.
    let token = key
        .mint("bob", DEFAULT_ISSUER, "elsewhere", Duration::from_secs(60), false)
        .unwrap();
    assert!(matches!(reject(&v, &token), AuthError::WrongAudience));

    assert!(matches!(
        key.mint(
            "",
            DEFAULT_ISSUER,
            DEFAULT_AUDIENCE,
            Duration::from_secs(60),
            false
        ),
        Err(AuthError::Mint(_))
    ));
}

// ---------------------------------------------------------------------------------------------------------------
// Time.

#[test]
fn expired_beyond_leeway_is_expired() {
    let mut c = claims("alice");
    c.insert("exp".into(), json!(now() - 60));
    let token = sign_hs(SECRET, &c, None);
    assert!(matches!(reject(&hs_verifier(), &token), AuthError::Expired));
    // A larger leeway accepts it.
    assert_eq!(
        hs_verifier().with_leeway(120).verify(&token).unwrap().user,
        "alice"
    );
}

#[test]
fn exp_within_leeway_is_accepted() {
    let mut c = claims("alice");
    c.insert("exp".into(), json!(now() - 2));
    let token = sign_hs(SECRET, &c, None);
    assert_eq!(hs_verifier().leeway(), 5);
    assert_eq!(hs_verifier().verify(&token).unwrap().user, "alice");
    // Without leeway it has expired.
    assert!(matches!(
        reject(&hs_verifier().with_leeway(0), &token),
        AuthError::Expired
    ));
}

#[test]
fn leeway_is_clamped() {
    assert_eq!(
        hs_verifier().with_leeway(u64::MAX).leeway(),
        fleet_client::auth::MAX_LEEWAY_SECS
    );
    let mut c = claims("alice");
    c.insert("exp".into(), json!(1));
    let token = sign_hs(SECRET, &c, None);
    assert!(matches!(
        reject(&hs_verifier().with_leeway(u64::MAX), &token),
        AuthError::Expired
    ));
}

#[test]
fn nbf_is_honoured() {
    let mut c = claims("alice");
    c.insert("nbf".into(), json!(now() + 600));
    let token = sign_hs(SECRET, &c, None);
    assert!(matches!(reject(&hs_verifier(), &token), AuthError::NotYetValid));

    c.insert("nbf".into(), json!(now() + 2));
    assert_eq!(
        hs_verifier().verify(&sign_hs(SECRET, &c, None)).unwrap().user,
        "alice"
    );

    c.insert("nbf".into(), json!("soon"));
    let token = sign_hs(SECRET, &c, None);
    assert!(matches!(
        reject(&hs_verifier(), &token),
        AuthError::InvalidClaim("nbf")
    ));
}

// ---------------------------------------------------------------------------------------------------------------
// Audience, issuer, required claims.

#[test]
fn wrong_audience() {
    let mut c = claims("alice");
    c.insert("aud".into(), json!("someone-else"));
    assert!(matches!(
        reject(&hs_verifier(), &sign_hs(SECRET, &c, None)),
        AuthError::WrongAudience
    ));
    c.insert("aud".into(), json!(["someone-else", "another"]));
    assert!(matches!(
        reject(&hs_verifier(), &sign_hs(SECRET, &c, None)),
        AuthError::WrongAudience
    ));
    // An audience array containing ours is accepted (RFC 7519 §4.1.3).
    c.insert("aud".into(), json!(["someone-else", DEFAULT_AUDIENCE]));
    assert_eq!(
        hs_verifier().verify(&sign_hs(SECRET, &c, None)).unwrap().user,
        "alice"
    );
    // Only the exact string: no prefix or case folding.
    c.insert("aud".into(), json!("cloud-agents-x"));
    assert!(matches!(
        reject(&hs_verifier(), &sign_hs(SECRET, &c, None)),
        AuthError::WrongAudience
    ));
}

#[test]
fn wrong_issuer() {
    let mut c = claims("alice");
    c.insert("iss".into(), json!("mallory"));
    assert!(matches!(
        reject(&hs_verifier(), &sign_hs(SECRET, &c, None)),
        AuthError::WrongIssuer
    ));
    // An issuer is one string, not a list to pick from.
    c.insert("iss".into(), json!(["mallory", DEFAULT_ISSUER]));
    assert!(matches!(
        reject(&hs_verifier(), &sign_hs(SECRET, &c, None)),
        AuthError::InvalidClaim("iss")
    ));
}

#[test]
fn each_missing_required_claim_is_named() {
    for claim in ["exp", "aud", "iss", "sub"] {
        let mut c = claims("alice");
        c.remove(claim);
        let token = sign_hs(SECRET, &c, None);
        let err = reject(&hs_verifier(), &token);
        assert!(
            matches!(err, AuthError::MissingClaim(name) if name == claim),
            "{claim}: {err:?}"
        );
        assert_eq!(err.to_api_error().details.unwrap()["claim"], claim);
        // null counts as missing
        let mut c = claims("alice");
        c.insert(claim.into(), Value::Null);
        let err = reject(&hs_verifier(), &sign_hs(SECRET, &c, None));
        assert!(
            matches!(err, AuthError::MissingClaim(name) if name == claim),
            "{claim}: {err:?}"
        );
    }
}

#[test]
fn several_missing_claims_are_reported_in_a_fixed_order() {
    let mut c = claims("alice");
    for claim in ["sub", "aud", "iss"] {
        c.remove(claim);
    }
    for _ in 0..20 {
        let err = reject(&hs_verifier(), &sign_hs(SECRET, &c, None));
        assert!(matches!(err, AuthError::MissingClaim("iss")), "{err:?}");
    }
}

#[test]
fn empty_or_odd_sub_is_rejected() {
    // The fleet's own users (`fleet:catalogue`, `fleet:detect`) are no tenant's.
    for sub in [
        json!(""),
        json!("a\nb"),
        json!("x".repeat(257)),
        json!("fleet:catalogue"),
        json!("fleet:"),
    ] {
        let mut c = claims("alice");
        c.insert("sub".into(), sub.clone());
        let err = reject(&hs_verifier(), &sign_hs(SECRET, &c, None));
        assert!(matches!(err, AuthError::InvalidClaim("sub")), "{sub}: {err:?}");
    }
    let mut c = claims("alice");
    c.insert("sub".into(), json!(42));
    let err = reject(&hs_verifier(), &sign_hs(SECRET, &c, None));
    assert!(matches!(err, AuthError::InvalidClaim("sub")), "{err:?}");
}

// ---------------------------------------------------------------------------------------------------------------
// Algorithms and signatures.

#[test]
fn alg_none_is_not_allowed() {
    let payload = serde_json::to_vec(&claims("alice")).unwrap();
    for header in [
        json!({"alg": "none", "typ": "JWT"}),
        json!({"alg": "None"}),
        json!({"alg": "NONE"}),
    ] {
        let token = format!(
            "{}.{}.",
            b64url(&serde_json::to_vec(&header).unwrap()),
            b64url(&payload)
        );
        let err = reject(&hs_verifier(), &token);
        assert!(
            matches!(&err, AuthError::AlgorithmNotAllowed(alg) if alg.eq_ignore_ascii_case("none")),
            "{err:?}"
        );
        let err = reject(&ed_verifier(), &token);
        assert!(matches!(&err, AuthError::AlgorithmNotAllowed(_)), "{err:?}");
    }
}

#[test]
fn other_algorithms_are_not_allowed() {
    // A correctly signed HS512 token: the key is pinned to HS256.
    let token = jsonwebtoken::encode(
        &Header::new(Algorithm::HS512),
        &claims("alice"),
        &EncodingKey::from_secret(SECRET).unwrap(),
    )
    .unwrap();
    let err = reject(&hs_verifier(), &token);
    assert!(
        matches!(&err, AuthError::AlgorithmNotAllowed(alg) if alg == "HS512"),
        "{err:?}"
    );
}

/// Documented choice: a token whose `alg` no configured key uses is `AlgorithmNotAllowed` (not `NoMatchingKey`,
/// which is reserved for a `kid` naming no key of the right algorithm).
#[test]
fn hs256_token_to_eddsa_only_verifier_is_algorithm_not_allowed() {
    // The classic confusion: HMAC keyed with the public key's PEM text.
    let token = sign_hs(ED_A_PUBLIC.as_bytes(), &claims("alice"), None);
    let err = reject(&ed_verifier(), &token);
    assert!(
        matches!(&err, AuthError::AlgorithmNotAllowed(alg) if alg == "HS256"),
        "{err:?}"
    );
    // ... and with an ordinary secret.
    let token = sign_hs(SECRET, &claims("alice"), None);
    let err = reject(&ed_verifier(), &token);
    assert!(
        matches!(&err, AuthError::AlgorithmNotAllowed(alg) if alg == "HS256"),
        "{err:?}"
    );
}

#[test]
fn eddsa_token_to_hs256_only_verifier_is_algorithm_not_allowed() {
    let token = sign_ed(ED_A_PRIVATE, &claims("alice"));
    let err = reject(&hs_verifier(), &token);
    assert!(
        matches!(&err, AuthError::AlgorithmNotAllowed(alg) if alg == "EdDSA"),
        "{err:?}"
    );
}

#[test]
fn another_secret_is_a_bad_signature() {
    let token = sign_hs(OTHER_SECRET, &claims("alice"), None);
    assert!(matches!(reject(&hs_verifier(), &token), AuthError::BadSignature));
}

#[test]
fn tampered_payload_is_a_bad_signature() {
    let token = sign_hs(SECRET, &claims("alice"), None);
    let parts: Vec<&str> = token.split('.').collect();
    let mut c = claims("mallory");
    c.insert("operator".into(), json!(true));
    let forged = format!(
        "{}.{}.{}",
        parts[0],
        b64url(&serde_json::to_vec(&c).unwrap()),
        parts[2]
    );
    assert!(matches!(reject(&hs_verifier(), &forged), AuthError::BadSignature));

    // The same for EdDSA.
    let token = sign_ed(ED_A_PRIVATE, &claims("alice"));
    let parts: Vec<&str> = token.split('.').collect();
    let forged = format!(
        "{}.{}.{}",
        parts[0],
        b64url(&serde_json::to_vec(&c).unwrap()),
        parts[2]
    );
    assert!(matches!(reject(&ed_verifier(), &forged), AuthError::BadSignature));

    // A stripped signature.
    let stripped = format!("{}.{}.", parts[0], parts[1]);
    assert!(matches!(
        reject(&ed_verifier(), &stripped),
        AuthError::BadSignature
    ));
}

#[test]
fn garbage_is_malformed() {
    let v = hs_verifier();
    for garbage in [
        "garbage",
        "not.a.jwt",
        "a.b",
        "a.b.c.d",
        "....",
        "eyJhbGciOiJIUzI1NiJ9..sig",
        "!!!.???.###",
        "eyJhbGciOiJIUzI1NiJ9.e30.***",
    ] {
        let err = reject(&v, garbage);
        assert!(matches!(err, AuthError::Malformed(_)), "{garbage}: {err:?}");
    }
    // A header that is JSON but not an object / has no alg / a non-string kid.
    for header in [
        json!([1, 2]),
        json!({"typ": "JWT"}),
        json!({"alg": "HS256", "kid": 7}),
    ] {
        let token = format!("{}.e30.c2ln", b64url(&serde_json::to_vec(&header).unwrap()));
        let err = reject(&v, &token);
        assert!(matches!(err, AuthError::Malformed(_)), "{header}: {err:?}");
    }
    // Claims that are not an object, correctly signed.
    let token = jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &json!([1, 2, 3]),
        &EncodingKey::from_secret(SECRET).unwrap(),
    )
    .unwrap();
    let err = reject(&v, &token);
    assert!(matches!(err, AuthError::Malformed(_)), "{err:?}");
    // Too long.
    let long = format!("{}.{}.{}", "a".repeat(4000), "b".repeat(4000), "c".repeat(1000));
    assert!(matches!(reject(&v, &long), AuthError::Malformed(_)));
}

#[test]
fn empty_header_is_missing() {
    let v = hs_verifier();
    for value in ["", "   ", "Bearer", "Bearer ", "bearer   "] {
        let err = v.verify(value).unwrap_err();
        assert!(matches!(err, AuthError::Missing), "{value:?}: {err:?}");
        assert_api_error_is_clean(&err, "");
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Ed25519.

#[test]
fn eddsa_round_trip() {
    let key = SigningKey::ed25519_private_pem(ED_A_PRIVATE.as_bytes()).unwrap();
    assert_eq!(key.algorithm(), KeyAlgorithm::EdDsa);
    let token = key
        .mint(
            "carol",
            DEFAULT_ISSUER,
            DEFAULT_AUDIENCE,
            Duration::from_secs(60),
            true,
        )
        .unwrap();
    // Through the derived public key ...
    let derived = Verifier::new(vec![key.verify_key().unwrap()], DEFAULT_ISSUER, DEFAULT_AUDIENCE).unwrap();
    let p = derived.verify(&format!("Bearer {token}")).unwrap();
    assert_eq!((p.user.as_str(), p.operator), ("carol", true));
    // ... and through the PEM openssl wrote.
    assert_eq!(ed_verifier().verify(&token).unwrap().user, "carol");
    // A token of the other key pair does not verify.
    let other = sign_ed(ED_B_PRIVATE, &claims("carol"));
    assert!(matches!(reject(&ed_verifier(), &other), AuthError::BadSignature));
}

#[test]
fn eddsa_pkcs8_v2_private_key_is_accepted() {
    let key = SigningKey::ed25519_private_pem(ED_A_PRIVATE_V2.as_bytes()).unwrap();
    let token = key
        .mint(
            "dave",
            DEFAULT_ISSUER,
            DEFAULT_AUDIENCE,
            Duration::from_secs(60),
            false,
        )
        .unwrap();
    assert_eq!(ed_verifier().verify(&token).unwrap().user, "dave");
    let derived = Verifier::new(vec![key.verify_key().unwrap()], DEFAULT_ISSUER, DEFAULT_AUDIENCE).unwrap();
    assert_eq!(derived.verify(&token).unwrap().user, "dave");
}

#[test]
fn bad_keys_are_refused() {
    assert!(matches!(VerifyKey::hs256(b"short"), Err(AuthError::Key(_))));
    assert!(matches!(VerifyKey::hs256(&SECRET[..31]), Err(AuthError::Key(_))));
    assert!(matches!(SigningKey::hs256(b""), Err(AuthError::Key(_))));
    // A private key where a public one is expected, and the other way round.
    assert!(matches!(
        VerifyKey::ed25519_public_pem(ED_A_PRIVATE.as_bytes()),
        Err(AuthError::Key(_))
    ));
    assert!(matches!(
        SigningKey::ed25519_private_pem(ED_A_PUBLIC.as_bytes()),
        Err(AuthError::Key(_))
    ));
    assert!(matches!(
        VerifyKey::ed25519_public_pem(b"not a pem"),
        Err(AuthError::Key(_))
    ));
    // An SPKI whose key is too short (the library would slice out of bounds).
    let short = "-----BEGIN PUBLIC KEY-----\nMCkwBQYDK2VwAyAAAQIDBAUGBwgJCgsMDQ4PEBESExQVFhcYGRobHB0eHw==\n-----END PUBLIC KEY-----\n";
    assert!(matches!(
        VerifyKey::ed25519_public_pem(short.as_bytes()),
        Err(AuthError::Key(_))
    ));
    // A verifier needs a key, an issuer and an audience.
    assert!(matches!(
        Verifier::new(vec![], DEFAULT_ISSUER, DEFAULT_AUDIENCE),
        Err(AuthError::Key(_))
    ));
    assert!(matches!(
        Verifier::new(vec![VerifyKey::hs256(SECRET).unwrap()], "", DEFAULT_AUDIENCE),
        Err(AuthError::Key(_))
    ));
    // Configuration errors are the server's fault, not the caller's token.
    let err = VerifyKey::hs256(b"short").unwrap_err();
    assert!(!err.is_token_error());
    assert_eq!(err.to_api_error().code, ApiErrorCode::InternalError);
}

#[test]
fn debug_output_has_no_key_material() {
    let v = Verifier::new(
        vec![VerifyKey::hs256(SECRET).unwrap().with_kid("k1")],
        DEFAULT_ISSUER,
        DEFAULT_AUDIENCE,
    )
    .unwrap();
    let debug = format!("{v:?}");
    assert!(debug.contains("k1") && debug.contains(DEFAULT_ISSUER), "{debug}");
    assert!(!debug.contains("0123456789abcdef"), "{debug}");
    assert!(!debug.contains("48, 49, 50"), "{debug}");
    let key = SigningKey::ed25519_private_pem(ED_A_PRIVATE.as_bytes()).unwrap();
    let debug = format!("{key:?} {:?}", key.verify_key().unwrap());
    assert!(!debug.contains("MC4C") && !debug.contains('['), "{debug}");
}

// ---------------------------------------------------------------------------------------------------------------
// Rotation and kid.

#[test]
fn rotation_accepts_old_and_new_keys() {
    let v = Verifier::new(
        vec![
            VerifyKey::hs256(SECRET).unwrap(),
            VerifyKey::hs256(OTHER_SECRET).unwrap(),
        ],
        DEFAULT_ISSUER,
        DEFAULT_AUDIENCE,
    )
    .unwrap();
    assert_eq!(
        v.verify(&sign_hs(SECRET, &claims("old"), None)).unwrap().user,
        "old"
    );
    assert_eq!(
        v.verify(&sign_hs(OTHER_SECRET, &claims("new"), None))
            .unwrap()
            .user,
        "new"
    );
    let third = sign_hs(b"yet another secret of thirty-two!", &claims("x"), None);
    assert!(matches!(reject(&v, &third), AuthError::BadSignature));

    // Mixed algorithms: each token only meets keys of its own algorithm.
    let mixed = Verifier::new(
        vec![
            VerifyKey::hs256(SECRET).unwrap(),
            VerifyKey::ed25519_public_pem(ED_A_PUBLIC.as_bytes()).unwrap(),
            VerifyKey::ed25519_public_pem(ED_B_PUBLIC.as_bytes()).unwrap(),
        ],
        DEFAULT_ISSUER,
        DEFAULT_AUDIENCE,
    )
    .unwrap();
    assert_eq!(
        mixed.verify(&sign_hs(SECRET, &claims("h"), None)).unwrap().user,
        "h"
    );
    assert_eq!(
        mixed.verify(&sign_ed(ED_A_PRIVATE, &claims("a"))).unwrap().user,
        "a"
    );
    assert_eq!(
        mixed.verify(&sign_ed(ED_B_PRIVATE, &claims("b"))).unwrap().user,
        "b"
    );
    // A claims failure under the right key is reported as such, not as a signature failure of the others.
    let mut c = claims("b");
    c.insert("exp".into(), json!(now() - 3600));
    assert!(matches!(
        reject(&mixed, &sign_ed(ED_B_PRIVATE, &c)),
        AuthError::Expired
    ));
}

#[test]
fn kid_selects_the_key() {
    let v = Verifier::new(
        vec![
            VerifyKey::hs256(SECRET).unwrap().with_kid("old"),
            VerifyKey::hs256(OTHER_SECRET).unwrap().with_kid("new"),
        ],
        DEFAULT_ISSUER,
        DEFAULT_AUDIENCE,
    )
    .unwrap();
    assert_eq!(
        v.verify(&sign_hs(SECRET, &claims("a"), Some("old")))
            .unwrap()
            .user,
        "a"
    );
    assert_eq!(
        v.verify(&sign_hs(OTHER_SECRET, &claims("b"), Some("new")))
            .unwrap()
            .user,
        "b"
    );
    // The kid names a key, and only that key is tried: signed by "new" but labelled "old".
    let mislabelled = sign_hs(OTHER_SECRET, &claims("c"), Some("old"));
    assert!(matches!(reject(&v, &mislabelled), AuthError::BadSignature));
    // An unknown kid.
    let unknown = sign_hs(SECRET, &claims("d"), Some("nope"));
    assert!(matches!(reject(&v, &unknown), AuthError::NoMatchingKey));
    // No kid: every key of the algorithm is tried.
    assert_eq!(
        v.verify(&sign_hs(OTHER_SECRET, &claims("e"), None)).unwrap().user,
        "e"
    );

    // Keys without a kid are not tried for a token that names one.
    let unlabelled = hs_verifier();
    let err = reject(&unlabelled, &sign_hs(SECRET, &claims("f"), Some("k")));
    assert!(matches!(err, AuthError::NoMatchingKey), "{err:?}");

    // A signing key's kid goes into the header and into its verify key.
    let key = SigningKey::hs256(OTHER_SECRET).unwrap().with_kid("new");
    let token = key
        .mint(
            "g",
            DEFAULT_ISSUER,
            DEFAULT_AUDIENCE,
            Duration::from_secs(60),
            false,
        )
        .unwrap();
    assert_eq!(
        jsonwebtoken::decode_header(&token).unwrap().kid.as_deref(),
        Some("new")
    );
    assert_eq!(key.verify_key().unwrap().kid(), Some("new"));
    assert_eq!(v.verify(&token).unwrap().user, "g");
}

// ---------------------------------------------------------------------------------------------------------------
// Dev key.

fn dev_verifier(key: &SigningKey) -> Verifier {
    Verifier::new(vec![key.verify_key().unwrap()], DEFAULT_ISSUER, DEFAULT_AUDIENCE).unwrap()
}

fn mint(key: &SigningKey, user: &str) -> String {
    key.mint(
        user,
        DEFAULT_ISSUER,
        DEFAULT_AUDIENCE,
        Duration::from_secs(60),
        false,
    )
    .unwrap()
}

#[test]
fn dev_key_is_created_0600_and_reloaded() {
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("data");
    let first = DevKey::load_or_create(&data_dir).unwrap();
    let path = data_dir.join("dev-signing-key");
    assert_eq!(DevKey::path(&data_dir), path);
    let meta = std::fs::metadata(&path).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let text = std::fs::read_to_string(&path).unwrap();
    assert_eq!(text.len(), 65);
    assert!(text.trim_end().chars().all(|c| c.is_ascii_hexdigit()) && text.ends_with('\n'));
    // No temp files left behind.
    assert_eq!(std::fs::read_dir(&data_dir).unwrap().count(), 1);

    let again = DevKey::load_or_create(&data_dir).unwrap();
    let loaded = DevKey::load(&data_dir).unwrap();
    assert_eq!(std::fs::read_to_string(&path).unwrap(), text);
    // The same key: each verifies the others' tokens.
    let token = mint(&first, "alice");
    assert_eq!(dev_verifier(&again).verify(&token).unwrap().user, "alice");
    assert_eq!(
        dev_verifier(&loaded).verify(&mint(&again, "bob")).unwrap().user,
        "bob"
    );
}

#[test]
fn dev_key_existing_file_is_never_overwritten() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dev-signing-key");
    let hex: String = SECRET.iter().map(|b| format!("{b:02x}")).collect();
    std::fs::write(&path, format!("{hex}\n")).unwrap();
    let key = DevKey::load_or_create(dir.path()).unwrap();
    assert_eq!(hs_verifier().verify(&mint(&key, "alice")).unwrap().user, "alice");

    // An invalid file is an error, and stays as it was.
    std::fs::write(&path, "not hex\n").unwrap();
    let err = DevKey::load_or_create(dir.path()).unwrap_err();
    assert!(matches!(err, AuthError::DevKeyInvalid { .. }), "{err:?}");
    assert!(err.to_string().contains(&path.display().to_string()));
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "not hex\n");
}

#[test]
fn dev_key_racing_creators_agree() {
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().to_path_buf();
    let handles: Vec<_> = (0..6)
        .map(|_| {
            let data_dir = data_dir.clone();
            std::thread::spawn(move || DevKey::load_or_create(&data_dir).unwrap())
        })
        .collect();
    let keys: Vec<SigningKey> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let token = mint(&keys[0], "alice");
    for key in &keys {
        assert_eq!(dev_verifier(key).verify(&token).unwrap().user, "alice");
    }
    assert_eq!(std::fs::read_dir(&data_dir).unwrap().count(), 1);
}

#[test]
fn dev_key_load_of_a_missing_dir_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("never-created");
    let err = DevKey::load(&data_dir).unwrap_err();
    let expected = data_dir.join("dev-signing-key");
    assert!(
        matches!(&err, AuthError::DevKeyMissing(p) if *p == expected),
        "{err:?}"
    );
    assert!(err.to_string().contains(&expected.display().to_string()), "{err}");
    assert!(!data_dir.exists(), "load must not create anything");
    assert_eq!(err.to_api_error().code, ApiErrorCode::InternalError);
}
