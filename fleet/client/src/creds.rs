//! What a client needs to know of NATS credentials: the fleet's roles and where their `.creds` files are, the
//! standard `.creds` text (a user JWT and its nkey seed, as `nsc` writes it and every client library reads it),
//! the rules of a user name and its inbox prefix, and the decoding of a NATS JWT (signature checked against its
//! issuer's key). Issuing credentials is the fleet's (`fleet::nats_auth`).

use std::fmt;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use nkeys::KeyPair;
use serde_json::Value;

const JWT_BEGIN: &str = "-----BEGIN NATS USER JWT-----";
const JWT_END: &str = "------END NATS USER JWT------";
const SEED_BEGIN: &str = "-----BEGIN USER NKEY SEED-----";
const SEED_END: &str = "------END USER NKEY SEED------";

/// The longest user name ([`check_user_name`]).
pub const MAX_USER_NAME_LEN: usize = 64;

/// The fleet's own NATS users, one `.creds` file each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// The front (FLEET account).
    Front,
    /// A worker (FLEET account).
    Worker,
    /// The human operator's tools (FLEET account) — not the NATS operator.
    Operator,
    /// The in-process app user (APP account, signed by the APP signing key).
    App,
    /// The system user (SYS account): pushes account updates.
    Sys,
}

impl Role {
    /// Every role.
    pub const ALL: [Role; 5] = [Role::Front, Role::Worker, Role::Operator, Role::App, Role::Sys];

    /// `"front"`, `"worker"`, `"operator"`, `"app"` or `"sys"`: the user's name and its creds file's stem.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Front => "front",
            Role::Worker => "worker",
            Role::Operator => "operator",
            Role::App => "app",
            Role::Sys => "sys",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `<dir>/<role>.creds`: where every auth directory keeps a role's credentials.
pub fn creds_in(dir: &Path, role: Role) -> PathBuf {
    dir.join(format!("{}.creds", role.as_str()))
}

/// The `.creds` text for a user JWT and the user's seed (`SU…`). The result contains the seed: treat it as a
/// secret (never log it; the fleet writes it only through its private-file writer).
pub fn format_creds(jwt: &str, seed: &str) -> String {
    format!(
        "{JWT_BEGIN}\n{jwt}\n{JWT_END}\n\
         \n\
         ************************* IMPORTANT *************************\n\
         NKEY Seed printed below can be used to sign and prove identity.\n\
         NKEYs are sensitive and should be treated as secrets.\n\
         \n\
         {SEED_BEGIN}\n{seed}\n{SEED_END}\n\
         \n\
         *************************************************************\n"
    )
}

/// The user JWT of a `.creds` text (`None` if the text is not in the format).
pub fn creds_jwt(creds: &str) -> Option<&str> {
    block(creds, JWT_BEGIN, JWT_END)
}

/// The user seed of a `.creds` text (`None` if the text is not in the format). A secret.
pub fn creds_seed(creds: &str) -> Option<&str> {
    block(creds, SEED_BEGIN, SEED_END)
}

/// Whether the user JWT of a `.creds` text lets its holder publish on every subject of `pattern`, a pattern as
/// the permission table grants it (e.g. `_R_.>`): its publish allow list is empty (NATS: everything) or names
/// `pattern` or `>`, and its deny list names neither. `false` when the text holds no JWT whose claims read.
/// (Read from the holder's own file: the server enforces the permissions; this only tells a process whether to
/// try.)
pub fn creds_publish_allows(creds: &str, pattern: &str) -> bool {
    let Some(claims) = creds_jwt(creds).and_then(|jwt| decode_jwt(jwt).ok()) else {
        return false;
    };
    let list = |kind: &str| -> Vec<String> {
        claims["nats"]["pub"][kind]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect())
            .unwrap_or_default()
    };
    let names = |l: &[String]| l.iter().any(|p| p == pattern || p == ">");
    let allow = list("allow");
    (allow.is_empty() || names(&allow)) && !names(&list("deny"))
}

/// The single non-empty line between `begin` and `end`.
fn block<'a>(text: &'a str, begin: &str, end: &str) -> Option<&'a str> {
    let mut lines = text.lines().map(str::trim);
    lines.by_ref().find(|l| *l == begin)?;
    let mut value = None;
    for line in lines {
        if line == end {
            return value;
        }
        if !line.is_empty() {
            if value.is_some() {
                return None;
            }
            value = Some(line);
        }
    }
    None
}

/// Checks a user name: 1–[`MAX_USER_NAME_LEN`] characters of `[A-Za-z0-9_-]`; the error is the reason.
pub fn check_user_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        return Err("empty");
    }
    if name.len() > MAX_USER_NAME_LEN {
        return Err("longer than 64 characters");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        return Err("only ASCII letters, digits, '_' and '-' are allowed");
    }
    Ok(())
}

/// The inbox prefix of a user named `name`: `_INBOX.<name>`. Each user may subscribe only to its own inboxes
/// (`_INBOX.<name>.>`), so no user can read another client's replies; clients must set this prefix (async-nats
/// `custom_inbox_prefix`, nats.go `CustomInboxPrefix`, nats.py `inbox_prefix`).
pub fn inbox_prefix(name: &str) -> String {
    format!("_INBOX.{name}")
}

/// Why a NATS JWT did not decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum JwtError {
    /// It is not well formed.
    #[error("malformed NATS JWT: {0}")]
    Malformed(&'static str),
    /// Its signature does not verify with its `iss` key.
    #[error("the NATS JWT's signature does not verify")]
    BadSignature,
}

/// The claims of a NATS JWT as JSON, after checking its header and its signature by the key in its `iss`.
pub fn decode_jwt(token: &str) -> Result<Value, JwtError> {
    let malformed = JwtError::Malformed;
    let token = token.trim();
    let (signing_input, signature) = token
        .rsplit_once('.')
        .ok_or(malformed("not three dot-separated parts"))?;
    let (header, body) = signing_input
        .split_once('.')
        .filter(|(_, body)| !body.contains('.'))
        .ok_or(malformed("not three dot-separated parts"))?;
    let header: Value = URL_SAFE_NO_PAD
        .decode(header)
        .ok()
        .and_then(|h| serde_json::from_slice(&h).ok())
        .ok_or(malformed("the header is not base64url JSON"))?;
    if header.get("alg").and_then(Value::as_str) != Some("ed25519-nkey") {
        return Err(malformed("the header's alg is not ed25519-nkey"));
    }
    let claims: Value = URL_SAFE_NO_PAD
        .decode(body)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .ok_or(malformed("the claims are not base64url JSON"))?;
    let signature = URL_SAFE_NO_PAD
        .decode(signature)
        .map_err(|_| malformed("the signature is not base64url"))?;
    let issuer = claims
        .get("iss")
        .and_then(Value::as_str)
        .ok_or(malformed("no iss claim"))?;
    let key = KeyPair::from_public_key(issuer).map_err(|_| malformed("iss is not a public nkey"))?;
    key.verify(signing_input.as_bytes(), &signature)
        .map_err(|_| JwtError::BadSignature)?;
    Ok(claims)
}

/// The user name in a `.creds` text's JWT, when it is a valid, correctly signed user token.
pub fn creds_user_name(text: &str) -> Option<String> {
    let token = creds_jwt(text)?;
    let claims = decode_jwt(token).ok()?;
    let name = claims.get("name")?.as_str()?;
    check_user_name(name).ok()?;
    Some(name.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn creds_round_trip_and_exact_layout() {
        let text = format_creds("eyJhbGc.eyJzdWIi.c2ln", "SUAXYZ");
        assert_eq!(
            text,
            "-----BEGIN NATS USER JWT-----\neyJhbGc.eyJzdWIi.c2ln\n------END NATS USER JWT------\n\n\
             ************************* IMPORTANT *************************\n\
             NKEY Seed printed below can be used to sign and prove identity.\n\
             NKEYs are sensitive and should be treated as secrets.\n\n\
             -----BEGIN USER NKEY SEED-----\nSUAXYZ\n------END USER NKEY SEED------\n\n\
             *************************************************************\n"
        );
        assert_eq!(creds_jwt(&text), Some("eyJhbGc.eyJzdWIi.c2ln"));
        assert_eq!(creds_seed(&text), Some("SUAXYZ"));
        assert_eq!(creds_jwt("nothing"), None);
    }
}
