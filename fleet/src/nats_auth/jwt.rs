//! NATS JWT (v2) encoding and decoding: the claim shapes of operators, accounts and users, the `ed25519-nkey`
//! signature, and the `jti` (base32 of the SHA-256 of the claims with an empty `jti`, as the Go `jwt` library
//! computes it; the server does not check it, but it makes two different tokens differ and equal ones equal).
//!
//! A token is `b64url(header) "." b64url(claims) "." b64url(ed25519 signature over the first two parts)`, the
//! header always being [`HEADER_JSON`], the signature by the issuer's nkey (`iss`).
//!
//! Nothing here ever sees a seed except through a [`KeyPair`], whose `Debug` prints only its type.

use std::collections::BTreeMap;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use nkeys::KeyPair;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::{NatsAuthError, Permissions};

/// The header of every NATS JWT.
pub const HEADER_JSON: &str = r#"{"typ":"JWT","alg":"ed25519-nkey"}"#;

/// The claims version this module writes.
pub const VERSION: u8 = 2;

/// The standard claims of a NATS JWT around the NATS-specific part `nats`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Claims<N> {
    /// Unique id: base32 (no padding) of SHA-256 of these claims serialised with an empty `jti`.
    pub jti: String,
    /// Issued at, unix seconds.
    pub iat: u64,
    /// Issuer: the public nkey that signed the token.
    pub iss: String,
    /// A human name.
    pub name: String,
    /// Subject: the public nkey the token is about.
    pub sub: String,
    /// Expiry, unix seconds; absent = never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exp: Option<u64>,
    /// The type-specific claims.
    pub nats: N,
}

/// `nats` of an operator JWT.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OperatorNats {
    /// Operator signing keys (public, prefix `O`) allowed to sign account JWTs besides the identity key.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub signing_keys: Vec<String>,
    /// The system account's public key.
    pub system_account: String,
    /// Always `"operator"`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Always [`VERSION`].
    pub version: u8,
}

/// An account's limits (`nats.limits`); `-1` = unlimited. JetStream is enabled for the account when
/// `mem_storage` or `disk_storage` is non-zero.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AccountLimits {
    /// Max subscriptions.
    pub subs: i64,
    /// Max bytes of data.
    pub data: i64,
    /// Max message payload.
    pub payload: i64,
    /// Max imports.
    pub imports: i64,
    /// Max exports.
    pub exports: i64,
    /// Whether wildcard exports are allowed.
    pub wildcards: bool,
    /// Max connections.
    pub conn: i64,
    /// Max leaf-node connections.
    pub leaf: i64,
    /// JetStream memory storage in bytes (0 = JetStream off unless `disk_storage` is set).
    pub mem_storage: i64,
    /// JetStream file storage in bytes.
    pub disk_storage: i64,
    /// Max streams.
    pub streams: i64,
    /// Max consumers.
    pub consumer: i64,
}

impl AccountLimits {
    /// Everything unlimited, JetStream included.
    pub fn unlimited_with_jetstream() -> AccountLimits {
        AccountLimits {
            mem_storage: -1,
            disk_storage: -1,
            streams: -1,
            consumer: -1,
            ..AccountLimits::unlimited_without_jetstream()
        }
    }

    /// Core NATS unlimited, JetStream disabled.
    pub fn unlimited_without_jetstream() -> AccountLimits {
        AccountLimits {
            subs: -1,
            data: -1,
            payload: -1,
            imports: -1,
            exports: -1,
            wildcards: true,
            conn: -1,
            leaf: -1,
            mem_storage: 0,
            disk_storage: 0,
            streams: 0,
            consumer: 0,
        }
    }
}

/// Whether an export/import is a request/reply service or a message stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ExportKind {
    /// Request/reply.
    Service,
    /// One-way messages.
    Stream,
}

/// One entry of an account's `exports`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Export {
    /// A label.
    pub name: String,
    /// The exported subject (wildcards allowed).
    pub subject: String,
    /// Service or stream.
    #[serde(rename = "type")]
    pub kind: ExportKind,
    /// For services: `"Singleton"`, `"Stream"` or `"Chunked"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_type: Option<String>,
}

/// One entry of an account's `imports`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Import {
    /// A label.
    pub name: String,
    /// The subject, as exported by `account`.
    pub subject: String,
    /// The exporting account's public key.
    pub account: String,
    /// Service or stream.
    #[serde(rename = "type")]
    pub kind: ExportKind,
}

/// A set of subject permissions (`allow` / `deny`, each omitted when empty).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PermissionSet {
    /// Subjects allowed; empty = everything not denied.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<String>,
    /// Subjects denied.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny: Vec<String>,
}

/// Publish and subscribe permissions (an account's `default_permissions`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PubSubPermissions {
    /// Publish.
    #[serde(rename = "pub")]
    pub publish: PermissionSet,
    /// Subscribe.
    #[serde(rename = "sub")]
    pub subscribe: PermissionSet,
}

/// `nats` of an account JWT.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AccountNats {
    /// Limits.
    pub limits: AccountLimits,
    /// Exports.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exports: Vec<Export>,
    /// Imports.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub imports: Vec<Import>,
    /// Account signing keys (public, prefix `A`) allowed to sign users of the account.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub signing_keys: Vec<String>,
    /// Revoked users: user public key → unix seconds; users of that key issued at or before it are refused.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub revocations: BTreeMap<String, u64>,
    /// Permissions of users whose JWT has none.
    pub default_permissions: PubSubPermissions,
    /// Always `"account"`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Always [`VERSION`].
    pub version: u8,
}

/// A user's response permission (`resp`): may publish `max` replies to a request's reply subject within `ttl`
/// nanoseconds (0 = the server's default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResponsePermission {
    /// Max replies per request.
    pub max: i64,
    /// Validity in nanoseconds (0 = server default).
    pub ttl: i64,
}

/// `nats` of a user JWT.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UserNats {
    /// Publish permissions.
    #[serde(rename = "pub")]
    pub publish: PermissionSet,
    /// Subscribe permissions.
    #[serde(rename = "sub")]
    pub subscribe: PermissionSet,
    /// Permission to reply to requests received, when present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resp: Option<ResponsePermission>,
    /// Max subscriptions (-1 = unlimited).
    pub subs: i64,
    /// Max data (-1 = unlimited).
    pub data: i64,
    /// Max payload (-1 = unlimited).
    pub payload: i64,
    /// The account when the issuer (`iss`) is one of its signing keys.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub issuer_account: Option<String>,
    /// Always `"user"`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Always [`VERSION`].
    pub version: u8,
}

impl OperatorNats {
    /// An operator whose system account is `system_account`.
    pub fn new(signing_keys: Vec<String>, system_account: String) -> OperatorNats {
        OperatorNats {
            signing_keys,
            system_account,
            kind: "operator".to_owned(),
            version: VERSION,
        }
    }
}

impl AccountNats {
    /// An account with `limits`, its exports, imports and signing keys, no revocations, and empty default
    /// permissions.
    pub fn new(
        limits: AccountLimits,
        exports: Vec<Export>,
        imports: Vec<Import>,
        signing_keys: Vec<String>,
    ) -> AccountNats {
        AccountNats {
            limits,
            exports,
            imports,
            signing_keys,
            revocations: BTreeMap::new(),
            default_permissions: PubSubPermissions::default(),
            kind: "account".to_owned(),
            version: VERSION,
        }
    }
}

impl UserNats {
    /// A user with `permissions`; `issuer_account` when signed by an account signing key.
    pub fn new(permissions: &Permissions, issuer_account: Option<String>) -> UserNats {
        UserNats {
            publish: PermissionSet {
                allow: permissions.publish_allow.clone(),
                deny: permissions.publish_deny.clone(),
            },
            subscribe: PermissionSet {
                allow: permissions.subscribe_allow.clone(),
                deny: permissions.subscribe_deny.clone(),
            },
            resp: permissions
                .allow_responses
                .then_some(ResponsePermission { max: 1, ttl: 0 }),
            subs: -1,
            data: -1,
            payload: -1,
            issuer_account,
            kind: "user".to_owned(),
            version: VERSION,
        }
    }
}

/// RFC 4648 base32, upper case, no padding (what the Go `jwt` library uses for `jti`).
fn base32_nopad(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let mut out = String::with_capacity(bytes.len().div_ceil(5) * 8);
    let mut buffer: u32 = 0;
    let mut bits: u32 = 0;
    for &b in bytes {
        buffer = (buffer << 8) | u32::from(b);
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            out.push(char::from(ALPHABET[((buffer >> bits) & 31) as usize]));
        }
        buffer &= (1 << bits) - 1;
    }
    if bits > 0 {
        out.push(char::from(ALPHABET[((buffer << (5 - bits)) & 31) as usize]));
    }
    out
}

/// Signs `nats` as a JWT about `subject`, issued by `issuer` at `iat`, named `name`, expiring at `exp`.
pub fn encode<N: Serialize>(
    issuer: &KeyPair,
    subject: &str,
    name: &str,
    iat: u64,
    exp: Option<u64>,
    nats: N,
) -> Result<String, NatsAuthError> {
    let mut claims = Claims {
        jti: String::new(),
        iat,
        iss: issuer.public_key(),
        name: name.to_owned(),
        sub: subject.to_owned(),
        exp,
        nats,
    };
    let unsigned = serde_json::to_vec(&claims).map_err(|e| NatsAuthError::Json {
        what: "JWT claims",
        reason: e.to_string(),
    })?;
    claims.jti = base32_nopad(&Sha256::digest(&unsigned));
    let body = serde_json::to_vec(&claims).map_err(|e| NatsAuthError::Json {
        what: "JWT claims",
        reason: e.to_string(),
    })?;
    let signing_input = format!(
        "{}.{}",
        URL_SAFE_NO_PAD.encode(HEADER_JSON),
        URL_SAFE_NO_PAD.encode(body)
    );
    let signature = issuer
        .sign(signing_input.as_bytes())
        .map_err(|e| NatsAuthError::Nkey {
            what: "signing a JWT",
            reason: e.to_string(),
        })?;
    Ok(format!("{signing_input}.{}", URL_SAFE_NO_PAD.encode(signature)))
}

/// The claims of `token` as JSON, after checking its header and its signature by the key in its `iss`
/// ([`fleet_client::creds::decode_jwt`]).
pub fn decode(token: &str) -> Result<Value, NatsAuthError> {
    Ok(fleet_client::creds::decode_jwt(token)?)
}

/// `claims` without the fields that change on every signing (`iat`, `jti`), for "did anything change" checks.
pub(crate) fn stable_part(mut claims: Value) -> Value {
    if let Some(map) = claims.as_object_mut() {
        map.remove("iat");
        map.remove("jti");
    }
    claims
}

/// The stable part (see [`stable_part`]) of the claims [`encode`] would produce.
pub(crate) fn stable_part_of<N: Serialize>(
    issuer: &KeyPair,
    subject: &str,
    name: &str,
    exp: Option<u64>,
    nats: N,
) -> Result<Value, NatsAuthError> {
    let claims = Claims {
        jti: String::new(),
        iat: 0,
        iss: issuer.public_key(),
        name: name.to_owned(),
        sub: subject.to_owned(),
        exp,
        nats,
    };
    serde_json::to_value(claims)
        .map(stable_part)
        .map_err(|e| NatsAuthError::Json {
            what: "JWT claims",
            reason: e.to_string(),
        })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::nats_auth::{AuthMaterial, IssuedUser, NatsAuthError};
    use fleet_client::creds::Role;

    fn split(token: &str) -> (Value, Value, Vec<u8>) {
        let parts: Vec<&str> = token.split('.').collect();
        assert_eq!(parts.len(), 3);
        let header = serde_json::from_slice(&URL_SAFE_NO_PAD.decode(parts[0]).unwrap()).unwrap();
        let claims = serde_json::from_slice(&URL_SAFE_NO_PAD.decode(parts[1]).unwrap()).unwrap();
        (header, claims, URL_SAFE_NO_PAD.decode(parts[2]).unwrap())
    }

    #[test]
    fn base32_matches_rfc4648_vectors() {
        for (input, want) in [
            ("", ""),
            ("f", "MY"),
            ("fo", "MZXQ"),
            ("foo", "MZXW6"),
            ("foob", "MZXW6YQ"),
            ("fooba", "MZXW6YTB"),
            ("foobar", "MZXW6YTBOI"),
        ] {
            assert_eq!(base32_nopad(input.as_bytes()), want, "{input:?}");
        }
    }

    #[test]
    fn a_user_jwt_decodes_back_and_its_signature_verifies() {
        let account = KeyPair::new_account();
        let user = KeyPair::new_user();
        let perms = Permissions {
            publish_allow: vec!["a.>".into()],
            publish_deny: vec![],
            subscribe_allow: vec!["_INBOX.>".into()],
            subscribe_deny: vec!["secret.>".into()],
            allow_responses: true,
        };
        let token = encode(
            &account,
            &user.public_key(),
            "u1",
            1_700_000_000,
            Some(1_800_000_000),
            UserNats::new(&perms, None),
        )
        .unwrap();
        let (header, claims, signature) = split(&token);
        assert_eq!(header, serde_json::json!({"typ": "JWT", "alg": "ed25519-nkey"}));
        assert_eq!(claims["iss"], account.public_key());
        assert_eq!(claims["sub"], user.public_key());
        assert_eq!(claims["name"], "u1");
        assert_eq!(claims["iat"], 1_700_000_000);
        assert_eq!(claims["exp"], 1_800_000_000);
        let nats = &claims["nats"];
        assert_eq!(nats["type"], "user");
        assert_eq!(nats["version"], 2);
        assert_eq!(nats["pub"], serde_json::json!({"allow": ["a.>"]}));
        assert_eq!(
            nats["sub"],
            serde_json::json!({"allow": ["_INBOX.>"], "deny": ["secret.>"]})
        );
        assert_eq!(nats["resp"], serde_json::json!({"max": 1, "ttl": 0}));
        assert_eq!(nats["subs"], -1);
        assert!(nats.get("issuer_account").is_none());

        // The jti is the base32 SHA-256 of the claims with an empty jti.
        let typed: Claims<UserNats> = serde_json::from_value(claims.clone()).unwrap();
        let mut blank = typed.clone();
        blank.jti = String::new();
        assert_eq!(
            typed.jti,
            base32_nopad(&Sha256::digest(serde_json::to_vec(&blank).unwrap()))
        );

        // The signature verifies with the issuer's public key alone.
        let signed = token.rsplit_once('.').unwrap().0;
        let verifier = KeyPair::from_public_key(claims["iss"].as_str().unwrap()).unwrap();
        verifier.verify(signed.as_bytes(), &signature).unwrap();
        assert_eq!(decode(&token).unwrap(), claims);

        // A tampered body does not.
        let (h, rest) = token.split_once('.').unwrap();
        let (_, s) = rest.split_once('.').unwrap();
        let mut forged = claims.clone();
        forged["name"] = "u2".into();
        let forged = format!(
            "{h}.{}.{s}",
            URL_SAFE_NO_PAD.encode(serde_json::to_vec(&forged).unwrap())
        );
        assert!(matches!(decode(&forged), Err(NatsAuthError::BadSignature)));
        assert!(matches!(decode("a.b"), Err(NatsAuthError::MalformedJwt(_))));
    }

    #[test]
    fn the_material_signs_a_verifiable_chain_and_never_shows_a_seed() {
        let dir = tempfile::tempdir().unwrap();
        let material = AuthMaterial::load_or_create(dir.path(), |_| Permissions::all()).unwrap();

        let operator = decode(material.operator_jwt()).unwrap();
        assert_eq!(operator["iss"], operator["sub"]);
        assert!(operator["sub"].as_str().unwrap().starts_with('O'));
        assert_eq!(operator["nats"]["type"], "operator");
        assert_eq!(
            operator["nats"]["system_account"],
            material.sys_account_public_key()
        );
        let operator_signing_keys = operator["nats"]["signing_keys"].as_array().unwrap().clone();
        assert_eq!(operator_signing_keys.len(), 1);

        let app = decode(material.app_account_jwt()).unwrap();
        assert_eq!(app["sub"], material.app_account_public_key());
        assert!(operator_signing_keys.contains(&app["iss"]));
        assert_eq!(app["nats"]["limits"]["mem_storage"], 0);
        assert_eq!(app["nats"]["limits"]["disk_storage"], 0);
        assert_eq!(app["nats"]["imports"].as_array().unwrap().len(), 2);
        let fleet = decode(material.fleet_account_jwt()).unwrap();
        assert_eq!(fleet["nats"]["limits"]["disk_storage"], -1);
        assert_eq!(fleet["nats"]["exports"][0]["response_type"], "Singleton");

        let issued = material
            .issue_app_user("app-user_1", &Permissions::all())
            .unwrap();
        let user_jwt = issued.creds.lines().nth(1).unwrap();
        let user = decode(user_jwt).unwrap();
        assert_eq!(user["sub"], issued.public_key);
        assert_eq!(user["nats"]["issuer_account"], material.app_account_public_key());
        assert!(
            app["nats"]["signing_keys"]
                .as_array()
                .unwrap()
                .contains(&user["iss"])
        );

        let revoked = BTreeMap::from([(issued.public_key.clone(), issued.issued_at)]);
        let updated = decode(&material.app_account_jwt_with_revocations(&revoked).unwrap()).unwrap();
        assert_eq!(
            updated["nats"]["revocations"][&issued.public_key],
            issued.issued_at
        );
        assert!(updated["iat"].as_u64().unwrap() > app["iat"].as_u64().unwrap());
        assert_eq!(updated["nats"]["imports"], app["nats"]["imports"]);

        // No seed in any Debug output.
        let seeds: serde_json::Map<String, Value> =
            serde_json::from_slice(&std::fs::read(dir.path().join("seeds.json")).unwrap()).unwrap();
        let mut all_seeds: Vec<String> = Vec::new();
        for (k, v) in &seeds {
            match v {
                Value::String(s) if k != "version" => all_seeds.push(s.clone()),
                Value::Object(users) => {
                    all_seeds.extend(users.values().filter_map(|s| s.as_str().map(str::to_owned)));
                }
                _ => {}
            }
        }
        assert_eq!(all_seeds.len(), 6 + Role::ALL.len());
        let issued_seed = issued
            .creds
            .lines()
            .find(|l| l.starts_with("SU"))
            .unwrap()
            .to_owned();
        all_seeds.push(issued_seed);
        let debug_outputs = [
            format!("{material:?}"),
            format!("{material:#?}"),
            format!("{issued:?}"),
            format!("{issued:#?}"),
            format!("{:?}", Permissions::all()),
            format!("{:?}", Role::ALL),
            format!("{:?}", IssuedUser::clone(&issued)),
            format!("{:?}", NatsAuthError::InvalidSeed { key: "x" }),
        ];
        for out in &debug_outputs {
            for seed in &all_seeds {
                assert!(!out.contains(seed.as_str()), "a seed in {out}");
                assert!(!out.contains(&seed[..20]), "a seed prefix in {out}");
            }
        }
        assert!(debug_outputs[2].contains(&issued.public_key));
        assert!(!debug_outputs[2].contains("BEGIN"));
    }

    #[test]
    fn a_corrupt_seeds_file_is_reported_without_its_content() {
        let dir = tempfile::tempdir().unwrap();
        let secret = "SUAIO3FHUX5PNV2LQIIP7TZ3N4L7TX3W53MQGEIVYFIGA635OZCKEYHFLM";
        for text in [
            format!(r#"{{"version": "{secret}"}}"#),
            format!(r#"{{"version": 1, "operator": {secret}}}"#),
            format!(
                r#"{{"version": 1, "operator": "{secret}", "operator_signing": "{secret}", "sys_account": "{secret}", "fleet_account": "{secret}", "app_account": "{secret}", "app_signing": "{secret}"}}"#
            ),
        ] {
            std::fs::write(dir.path().join("seeds.json"), &text).unwrap();
            let err = AuthMaterial::load_or_create(dir.path(), |_| Permissions::all()).unwrap_err();
            let shown = format!("{err} {err:?}");
            assert!(!shown.contains(&secret[..12]), "{shown}");
        }
    }
}
