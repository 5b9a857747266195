//! Authentication: verifying the JWT every API request carries, minting tokens, and the dev signing key.
//!
//! A request carries `Authorization: Bearer <jwt>` (the bare `<jwt>` is accepted too). [`Verifier::verify`]
//! turns it into a [`Principal`] — the user is the token's `sub` — or a typed [`AuthError`], which
//! [`AuthError::to_api_error`] renders as the API's `invalid_token`.
//!
//! **Rules.**
//! - The algorithm is pinned per key: only keys whose [`KeyAlgorithm`] equals the header's `alg` are tried.
//!   `alg: none`, any algorithm this module does not know, and an algorithm no configured key uses are
//!   [`AuthError::AlgorithmNotAllowed`]; an HS256 token never meets an Ed25519 public key as an HMAC secret.
//! - When the header has a `kid`, only keys carrying that `kid` are tried ([`AuthError::NoMatchingKey`] if none
//!   does); without a `kid` every key of the algorithm is tried in order (key rotation: old and new side by side).
//! - `exp`, `iss`, `aud` and `sub` are required ([`AuthError::MissingClaim`], reported in that order when several
//!   are missing). `iss` must be the configured issuer (a single string), `aud` the configured audience (a string,
//!   or per RFC 7519 §4.1.3 an array containing it), `sub` a non-empty string of at most [`MAX_SUBJECT_LEN`]
//!   bytes without control characters, not naming one of the fleet's own users (`fleet:…`,
//!   [`RESERVED_USER_PREFIX`]). `nbf` is honoured when present. `exp` and `nbf` get the leeway
//!   ([`DEFAULT_LEEWAY_SECS`], at most [`MAX_LEEWAY_SECS`]). With a cap ([`Verifier::with_max_lifetime`], `fleet up
//!   --jwt-max-lifetime-secs`), an `exp` further than the cap (and the leeway) from now is
//!   [`AuthError::LifetimeTooLong`].
//! - The custom claim `"operator": true` makes the principal an operator; `false` or absent does not; any other
//!   value is [`AuthError::InvalidClaim`].
//!
//! **Secrets.** Nothing here logs, and no error message or `Debug` output contains a token or key material: the
//! reasons are fixed texts chosen here (the library's own messages, which may quote claim values, are not
//! forwarded). The only header value echoed is a sanitised, truncated `alg` name.
//!
//! The signature checks and claim validation are jsonwebtoken 12's (`rust_crypto` provider); this module adds the
//! header pre-parse (so `alg: none` is reported as such), key selection, and the stricter claim shapes.

use std::fmt;
use std::fs::{DirBuilder, File};
use std::io::{self, Read};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fleet_proto::api::{ApiError, ApiErrorCode, RESERVED_USER_PREFIX};
use jsonwebtoken::crypto::CryptoProvider;
use jsonwebtoken::errors::{Error as JwtError, ErrorKind};
use jsonwebtoken::jwk::{AlgorithmParameters, Jwk};
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use rand::TryRngCore;
use serde_json::{Map, Value, json};

/// The issuer `fleet up` and the CLI use.
pub const DEFAULT_ISSUER: &str = "cloud-agents-dev";
/// The audience `fleet up` and the CLI use.
pub const DEFAULT_AUDIENCE: &str = "cloud-agents";

/// The longest lifetime `fleet up` accepts of an API or window token by default (`--jwt-max-lifetime-secs`,
/// [`Verifier::with_max_lifetime`]): a day. Apps mint short tokens (`fleet token`: an hour); one valid for longer
/// is a leak that stays useful for longer.
pub const DEFAULT_MAX_LIFETIME_SECS: u64 = 86_400;
/// Default clock-skew leeway for `exp` and `nbf`, in seconds.
pub const DEFAULT_LEEWAY_SECS: u64 = 5;
/// Upper bound of the leeway: [`Verifier::with_leeway`] clamps to it (more is a broken clock, not skew).
pub const MAX_LEEWAY_SECS: u64 = 3600;
/// Minimum length of an HS256 secret (RFC 7518 §3.2: at least the hash size).
pub const MIN_HS256_SECRET_LEN: usize = 32;
/// Longest token accepted; anything longer is [`AuthError::Malformed`] before any decoding.
pub const MAX_TOKEN_LEN: usize = 8 * 1024;

/// Verified tokens a [`Verifier`] remembers (by SHA-256 of the token), so a client that sends the same token on
/// every call pays the signature check once. Past it, expired entries are dropped, and if none were, the cache
/// starts over: memory stays bounded whatever a caller sends (only tokens that verified are ever stored).
pub const VERIFIED_CACHE_ENTRIES: usize = 4096;
/// Longest `sub` accepted, in bytes.
pub const MAX_SUBJECT_LEN: usize = 256;
/// File name of the dev signing key inside `fleet up`'s data dir.
pub const DEV_KEY_FILE: &str = "dev-signing-key";
/// The audience of operator tokens: the admin APIs accept no other, and no user-facing API accepts it.
pub const OPERATOR_AUDIENCE: &str = "cloud-agents-operator";
/// File name of the dev operator key inside `fleet up`'s data dir (a key of its own: whoever can mint user tokens
/// cannot mint operator tokens).
pub const DEV_OPERATOR_KEY_FILE: &str = "dev-operator-key";

/// The claims every token must carry, in the order a missing one is reported.
const REQUIRED_CLAIMS: [&str; 4] = ["exp", "iss", "aud", "sub"];
/// The custom claim marking an operator.
const OPERATOR_CLAIM: &str = "operator";

/// Why a token (or a key) was refused.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// No token: the header is absent, empty, or `Bearer` alone.
    #[error("no token: expected an `Authorization: Bearer <jwt>` header")]
    Missing,
    /// Not a well-formed JWT (the reason is a fixed text, never the token).
    #[error("malformed token: {0}")]
    Malformed(String),
    /// `exp` is in the past, beyond the leeway.
    #[error("the token has expired")]
    Expired,
    /// `nbf` is in the future, beyond the leeway.
    #[error("the token is not valid yet (nbf)")]
    NotYetValid,
    /// `exp` is further from now than the verifier's longest accepted lifetime ([`Verifier::with_max_lifetime`]):
    /// a token that stays valid for long is a leak that stays useful for long.
    #[error("the token expires more than {0} s from now, the longest lifetime accepted")]
    LifetimeTooLong(u64),
    /// `aud` is not the configured audience.
    #[error("the token is meant for another audience")]
    WrongAudience,
    /// `iss` is not the configured issuer.
    #[error("the token was issued by an unknown issuer")]
    WrongIssuer,
    /// A required claim (`exp`, `iss`, `aud`, `sub`) is absent or null.
    #[error("the token has no `{0}` claim")]
    MissingClaim(&'static str),
    /// A claim is present but has the wrong shape (e.g. an empty `sub`, a non-integer `exp`, a non-boolean
    /// `operator`).
    #[error("the token's `{0}` claim is invalid")]
    InvalidClaim(&'static str),
    /// The header's `alg` is `none`, unknown, or not the algorithm of any configured key.
    #[error("signing algorithm `{0}` is not accepted")]
    AlgorithmNotAllowed(String),
    /// The signature does not verify under any candidate key.
    #[error("the token's signature does not verify")]
    BadSignature,
    /// The header's `kid` names no configured key of its algorithm.
    #[error("no verification key matches the token's `kid`")]
    NoMatchingKey,
    /// A key could not be built or used (configuration, not the caller's token).
    #[error("unusable key: {0}")]
    Key(String),
    /// A token could not be minted.
    #[error("cannot mint a token: {0}")]
    Mint(String),
    /// The dev signing key file does not exist.
    #[error("the dev signing key {} does not exist (`fleet up` creates it)", .0.display())]
    DevKeyMissing(PathBuf),
    /// The dev signing key file (or its directory) could not be read or written.
    #[error("cannot access the dev signing key {}: {source}", path.display())]
    DevKeyIo {
        /// The file.
        path: PathBuf,
        /// The failure.
        source: io::Error,
    },
    /// The dev signing key file exists but does not hold a key.
    #[error("the dev signing key {} is invalid: {reason}", path.display())]
    DevKeyInvalid {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: &'static str,
    },
}

impl AuthError {
    /// Whether this is a verdict on the caller's token (as opposed to a server-side key or file problem).
    pub fn is_token_error(&self) -> bool {
        matches!(
            self,
            AuthError::Missing
                | AuthError::Malformed(_)
                | AuthError::Expired
                | AuthError::NotYetValid
                | AuthError::LifetimeTooLong(_)
                | AuthError::WrongAudience
                | AuthError::WrongIssuer
                | AuthError::MissingClaim(_)
                | AuthError::InvalidClaim(_)
                | AuthError::AlgorithmNotAllowed(_)
                | AuthError::BadSignature
                | AuthError::NoMatchingKey
        )
    }

    /// A stable machine-readable reason, sent as `details.reason`.
    pub fn reason(&self) -> &'static str {
        match self {
            AuthError::Missing => "missing",
            AuthError::Malformed(_) => "malformed",
            AuthError::Expired => "expired",
            AuthError::NotYetValid => "not_yet_valid",
            AuthError::LifetimeTooLong(_) => "lifetime_too_long",
            AuthError::WrongAudience => "wrong_audience",
            AuthError::WrongIssuer => "wrong_issuer",
            AuthError::MissingClaim(_) => "missing_claim",
            AuthError::InvalidClaim(_) => "invalid_claim",
            AuthError::AlgorithmNotAllowed(_) => "algorithm_not_allowed",
            AuthError::BadSignature => "bad_signature",
            AuthError::NoMatchingKey => "no_matching_key",
            AuthError::Key(_) => "key",
            AuthError::Mint(_) => "mint",
            AuthError::DevKeyMissing(_) | AuthError::DevKeyIo { .. } | AuthError::DevKeyInvalid { .. } => {
                "dev_key"
            }
        }
    }

    /// The API error for this failure.
    ///
    /// Token verdicts ([`AuthError::is_token_error`], everything [`Verifier::verify`] returns for a well-built
    /// verifier) are `invalid_token` with the reason as message and `details: {reason, claim?}`. Key, minting and
    /// dev-key-file errors are the server's fault and become `internal_error` with a generic message (they would
    /// otherwise leak file paths and tell the client to fix a token that is not the problem). Neither ever contains
    /// the token.
    pub fn to_api_error(&self) -> ApiError {
        if !self.is_token_error() {
            return ApiError::with_details(
                ApiErrorCode::InternalError,
                "authentication is misconfigured on the server",
                json!({ "reason": self.reason() }),
            );
        }
        let details = match self {
            AuthError::MissingClaim(claim) | AuthError::InvalidClaim(claim) => {
                json!({ "reason": self.reason(), "claim": claim })
            }
            _ => json!({ "reason": self.reason() }),
        };
        ApiError::with_details(ApiErrorCode::InvalidToken, self.to_string(), details)
    }
}

/// The signing algorithms a key can be pinned to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeyAlgorithm {
    /// HMAC-SHA256 with a shared secret of at least [`MIN_HS256_SECRET_LEN`] bytes.
    Hs256,
    /// Ed25519 (JOSE `EdDSA`).
    EdDsa,
}

impl KeyAlgorithm {
    /// The JOSE `alg` name.
    pub fn as_str(self) -> &'static str {
        match self {
            KeyAlgorithm::Hs256 => "HS256",
            KeyAlgorithm::EdDsa => "EdDSA",
        }
    }

    /// The algorithm named by a header's `alg` (exact, case-sensitive, as RFC 7515 says).
    fn from_header(alg: &str) -> Option<Self> {
        match alg {
            "HS256" => Some(KeyAlgorithm::Hs256),
            "EdDSA" => Some(KeyAlgorithm::EdDsa),
            _ => None,
        }
    }

    fn jwt(self) -> Algorithm {
        match self {
            KeyAlgorithm::Hs256 => Algorithm::HS256,
            KeyAlgorithm::EdDsa => Algorithm::EdDSA,
        }
    }
}

impl fmt::Display for KeyAlgorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A key that verifies tokens: its algorithm, the key, and an optional `kid`.
#[derive(Clone)]
pub struct VerifyKey {
    alg: KeyAlgorithm,
    key: DecodingKey,
    kid: Option<String>,
}

impl VerifyKey {
    /// An HS256 key; the secret must be at least [`MIN_HS256_SECRET_LEN`] bytes.
    pub fn hs256(secret: &[u8]) -> Result<VerifyKey, AuthError> {
        ensure_provider()?;
        check_hs256_secret(secret)?;
        let key =
            DecodingKey::from_secret(secret).map_err(|_| AuthError::Key("unusable HS256 secret".into()))?;
        Ok(VerifyKey {
            alg: KeyAlgorithm::Hs256,
            key,
            kid: None,
        })
    }

    /// An Ed25519 public key in PEM (`-----BEGIN PUBLIC KEY-----`, SubjectPublicKeyInfo, as
    /// `openssl pkey -pubout` writes it).
    pub fn ed25519_public_pem(pem: &[u8]) -> Result<VerifyKey, AuthError> {
        ensure_provider()?;
        let key = DecodingKey::from_ed_pem(pem).map_err(|_| {
            AuthError::Key("not an Ed25519 public key in PEM (`-----BEGIN PUBLIC KEY-----`)".into())
        })?;
        check_ed25519_public(&key)?;
        Ok(VerifyKey {
            alg: KeyAlgorithm::EdDsa,
            key,
            kid: None,
        })
    }

    /// Tags the key with a `kid`: a token whose header names a `kid` is only tried against keys with that `kid`.
    pub fn with_kid(mut self, kid: impl Into<String>) -> Self {
        self.kid = Some(kid.into());
        self
    }

    /// The pinned algorithm.
    pub fn algorithm(&self) -> KeyAlgorithm {
        self.alg
    }

    /// The `kid`, if any.
    pub fn kid(&self) -> Option<&str> {
        self.kid.as_deref()
    }
}

impl fmt::Debug for VerifyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerifyKey")
            .field("alg", &self.alg)
            .field("kid", &self.kid)
            .finish_non_exhaustive()
    }
}

/// Who a verified token speaks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    /// The user: the token's `sub`.
    pub user: String,
    /// Whether the token carries `"operator": true`.
    pub operator: bool,
    /// The token's `exp` (Unix seconds).
    pub expires_at: u64,
}

/// Verifies API tokens against a fixed set of keys, issuer and audience. Cheap to clone (one `Arc`).
#[derive(Clone)]
pub struct Verifier {
    inner: Arc<VerifierInner>,
}

struct VerifierInner {
    /// Principals of tokens that verified, by SHA-256 of the token (successes only).
    verified: std::sync::Mutex<std::collections::HashMap<[u8; 32], Principal>>,
    keys: Vec<VerifyKey>,
    issuer: String,
    audience: String,
    leeway: u64,
    /// The longest lifetime accepted (`exp` − now, in seconds), when capped.
    max_lifetime: Option<u64>,
    hs256: Validation,
    eddsa: Validation,
}

impl VerifierInner {
    fn build(
        keys: Vec<VerifyKey>,
        issuer: String,
        audience: String,
        leeway: u64,
        max_lifetime: Option<u64>,
    ) -> Self {
        let validation = |alg: KeyAlgorithm| {
            let mut v = Validation::new(alg.jwt());
            v.set_required_spec_claims(&REQUIRED_CLAIMS);
            v.leeway = leeway;
            v.validate_exp = true;
            v.validate_nbf = true;
            v.validate_aud = true;
            v.set_issuer(&[issuer.as_str()]);
            v.set_audience(&[audience.as_str()]);
            v
        };
        VerifierInner {
            verified: std::sync::Mutex::default(),
            hs256: validation(KeyAlgorithm::Hs256),
            eddsa: validation(KeyAlgorithm::EdDsa),
            keys,
            issuer,
            audience,
            leeway,
            max_lifetime,
        }
    }

    fn validation(&self, alg: KeyAlgorithm) -> &Validation {
        match alg {
            KeyAlgorithm::Hs256 => &self.hs256,
            KeyAlgorithm::EdDsa => &self.eddsa,
        }
    }
}

impl Verifier {
    /// A verifier accepting tokens signed by any of `keys` (at least one) for `issuer` and `audience` (both
    /// non-empty), with the default leeway.
    pub fn new(keys: Vec<VerifyKey>, issuer: &str, audience: &str) -> Result<Verifier, AuthError> {
        if keys.is_empty() {
            return Err(AuthError::Key("a verifier needs at least one key".into()));
        }
        if issuer.is_empty() || audience.is_empty() {
            return Err(AuthError::Key(
                "the issuer and the audience must not be empty".into(),
            ));
        }
        Ok(Verifier {
            inner: Arc::new(VerifierInner::build(
                keys,
                issuer.to_owned(),
                audience.to_owned(),
                DEFAULT_LEEWAY_SECS,
                None,
            )),
        })
    }

    /// Sets the leeway for `exp` and `nbf`, clamped to [`MAX_LEEWAY_SECS`].
    pub fn with_leeway(self, secs: u64) -> Self {
        Verifier {
            inner: Arc::new(VerifierInner::build(
                self.inner.keys.clone(),
                self.inner.issuer.clone(),
                self.inner.audience.clone(),
                secs.min(MAX_LEEWAY_SECS),
                self.inner.max_lifetime,
            )),
        }
    }

    /// Refuses tokens whose `exp` is more than `secs` (plus the leeway) from the moment they are verified
    /// ([`AuthError::LifetimeTooLong`]); `None` accepts any `exp`. Window tokens made by
    /// [`for_audience`](Self::for_audience) keep the cap.
    pub fn with_max_lifetime(self, secs: Option<u64>) -> Self {
        Verifier {
            inner: Arc::new(VerifierInner::build(
                self.inner.keys.clone(),
                self.inner.issuer.clone(),
                self.inner.audience.clone(),
                self.inner.leeway,
                secs,
            )),
        }
    }

    /// The longest lifetime accepted, when capped.
    pub fn max_lifetime(&self) -> Option<u64> {
        self.inner.max_lifetime
    }

    /// The accepted issuer.
    pub fn issuer(&self) -> &str {
        &self.inner.issuer
    }

    /// The accepted audience.
    pub fn audience(&self) -> &str {
        &self.inner.audience
    }

    /// The leeway in seconds.
    pub fn leeway(&self) -> u64 {
        self.inner.leeway
    }

    /// Verifies the value of an `Authorization` header: `Bearer <jwt>` (scheme case-insensitive) or the bare
    /// `<jwt>`. An absent header is `""` ([`AuthError::Missing`]).
    ///
    /// A token that verified before is answered from memory (keyed by its SHA-256; see
    /// [`VERIFIED_CACHE_ENTRIES`]) as long as it has not expired: `exp` is checked on every hit with the same
    /// leeway; `nbf`, `iss`, `aud` and the signature cannot change for the same bytes and this verifier's keys.
    pub fn verify(&self, header_value: &str) -> Result<Principal, AuthError> {
        self.verify_at(header_value, unix_now())
    }

    /// [`Verifier::verify`] at `now` (Unix seconds) for the cache's expiry check.
    fn verify_at(&self, header_value: &str, now: u64) -> Result<Principal, AuthError> {
        use sha2::Digest as _;
        let token = bounded_token(header_value)?;
        let digest: [u8; 32] = sha2::Sha256::digest(token.as_bytes()).into();
        let live = |p: &Principal| now <= p.expires_at.saturating_add(self.inner.leeway);
        {
            let mut cache = fleet_proto::util::lock(&self.inner.verified);
            match cache.get(&digest) {
                Some(p) if live(p) => return Ok(p.clone()),
                Some(_) => {
                    cache.remove(&digest);
                    return Err(AuthError::Expired);
                }
                None => {}
            }
        }
        let (principal, _) = self.verify_token(token)?;
        // Checked once, before the token is remembered: its `exp` only comes closer.
        if let Some(max) = self.inner.max_lifetime
            && principal.expires_at > now.saturating_add(max).saturating_add(self.inner.leeway)
        {
            return Err(AuthError::LifetimeTooLong(max));
        }
        let mut cache = fleet_proto::util::lock(&self.inner.verified);
        if cache.len() >= VERIFIED_CACHE_ENTRIES {
            cache.retain(|_, p| live(p));
            if cache.len() >= VERIFIED_CACHE_ENTRIES {
                cache.clear();
            }
        }
        cache.insert(digest, principal.clone());
        Ok(principal)
    }

    /// A verifier with the same keys, issuer and leeway that accepts another audience (the HTTP gateway's
    /// window tokens, `anna-app-window`): same pinned algorithms, separate audience.
    pub fn for_audience(&self, audience: &str) -> Result<Verifier, AuthError> {
        if audience.is_empty() {
            return Err(AuthError::Key("the audience must not be empty".into()));
        }
        Ok(Verifier {
            inner: Arc::new(VerifierInner::build(
                self.inner.keys.clone(),
                self.inner.issuer.clone(),
                audience.to_owned(),
                self.inner.leeway,
                self.inner.max_lifetime,
            )),
        })
    }

    /// [`Verifier::verify`], also returning every claim of the verified token (for custom claims such as the
    /// window token's `wid`, `app`, `ver`, `tools`).
    pub fn verify_with_claims(
        &self,
        header_value: &str,
    ) -> Result<(Principal, Map<String, Value>), AuthError> {
        self.verify_token(bounded_token(header_value)?)
    }

    /// Verifies a bare token (already through [`bounded_token`]): header, key, signature, claims.
    fn verify_token(&self, token: &str) -> Result<(Principal, Map<String, Value>), AuthError> {
        let (alg_name, kid) = parse_header(token)?;
        let Some(alg) = KeyAlgorithm::from_header(&alg_name) else {
            return Err(AuthError::AlgorithmNotAllowed(sanitize_alg(&alg_name)));
        };
        let mut of_alg = self.inner.keys.iter().filter(|k| k.alg == alg).peekable();
        if of_alg.peek().is_none() {
            return Err(AuthError::AlgorithmNotAllowed(alg.as_str().to_owned()));
        }
        let validation = self.inner.validation(alg);
        let mut tried = false;
        for key in of_alg.filter(|k| kid.is_none() || k.kid == kid) {
            tried = true;
            match jsonwebtoken::decode::<Map<String, Value>>(token, &key.key, validation) {
                Ok(data) => return principal(&data.claims).map(|p| (p, data.claims)),
                Err(e) if matches!(e.kind(), ErrorKind::InvalidSignature) => {}
                // Every other failure is either the token's shape (the same under any key) or, once the
                // signature has verified, its claims: no other key can change the verdict.
                Err(e) => return Err(map_jwt_error(e, alg, token)),
            }
        }
        Err(if tried {
            AuthError::BadSignature
        } else {
            AuthError::NoMatchingKey
        })
    }
}

impl fmt::Debug for Verifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Verifier")
            .field("keys", &self.inner.keys)
            .field("issuer", &self.inner.issuer)
            .field("audience", &self.inner.audience)
            .field("leeway", &self.inner.leeway)
            .field("max_lifetime", &self.inner.max_lifetime)
            .finish()
    }
}

/// A private key that mints tokens: an HS256 secret or an Ed25519 private key.
#[derive(Clone)]
pub struct SigningKey {
    alg: KeyAlgorithm,
    key: EncodingKey,
    /// The matching verification key, derived when the key is loaded.
    public: DecodingKey,
    kid: Option<String>,
}

impl SigningKey {
    /// An HS256 key; the secret must be at least [`MIN_HS256_SECRET_LEN`] bytes.
    pub fn hs256(secret: &[u8]) -> Result<SigningKey, AuthError> {
        ensure_provider()?;
        check_hs256_secret(secret)?;
        let unusable = |_| AuthError::Key("unusable HS256 secret".into());
        Ok(SigningKey {
            alg: KeyAlgorithm::Hs256,
            key: EncodingKey::from_secret(secret).map_err(unusable)?,
            public: DecodingKey::from_secret(secret).map_err(unusable)?,
            kid: None,
        })
    }

    /// An Ed25519 private key in PKCS#8 PEM (`-----BEGIN PRIVATE KEY-----`): the v1 form
    /// `openssl genpkey -algorithm ed25519` writes, or the v2 form with the public key that ring and
    /// ed25519-dalek write (an embedded public key must match the private one). The public key is derived from
    /// the private one, so [`SigningKey::verify_key`] needs no second file.
    pub fn ed25519_private_pem(pem: &[u8]) -> Result<SigningKey, AuthError> {
        ensure_provider()?;
        let key = EncodingKey::from_ed_pem(pem).map_err(|_| {
            AuthError::Key("not an Ed25519 private key in PKCS#8 PEM (`-----BEGIN PRIVATE KEY-----`)".into())
        })?;
        // The signer parses the PKCS#8 document (and checks an embedded public key against the private one).
        jsonwebtoken::crypto::sign(b"probe", &key, Algorithm::EdDSA)
            .map_err(|_| AuthError::Key("the Ed25519 private key cannot sign".into()))?;
        let public = ed25519_public_from_pkcs8(key.as_bytes())?;
        Ok(SigningKey {
            alg: KeyAlgorithm::EdDsa,
            key,
            public,
            kid: None,
        })
    }

    /// Tags the key with a `kid`, written into the header of every token it mints (and carried by
    /// [`SigningKey::verify_key`]).
    pub fn with_kid(mut self, kid: impl Into<String>) -> Self {
        self.kid = Some(kid.into());
        self
    }

    /// The algorithm.
    pub fn algorithm(&self) -> KeyAlgorithm {
        self.alg
    }

    /// The `kid`, if any.
    pub fn kid(&self) -> Option<&str> {
        self.kid.as_deref()
    }

    /// The key that verifies this key's tokens: the same secret for HS256, the derived public key for Ed25519;
    /// same `kid`.
    pub fn verify_key(&self) -> Result<VerifyKey, AuthError> {
        Ok(VerifyKey {
            alg: self.alg,
            key: self.public.clone(),
            kid: self.kid.clone(),
        })
    }

    /// Mints a token: `sub` = `user`, `iss`, `aud`, `iat` = now, `exp` = now + `ttl` (whole seconds), plus
    /// `"operator": true` when `operator`; the header carries this key's `kid` if it has one.
    pub fn mint(
        &self,
        user: &str,
        issuer: &str,
        audience: &str,
        ttl: Duration,
        operator: bool,
    ) -> Result<String, AuthError> {
        let mut extra = Map::new();
        if operator {
            extra.insert(OPERATOR_CLAIM.into(), Value::Bool(true));
        }
        self.mint_with_claims(user, issuer, audience, ttl, extra)
    }

    /// [`SigningKey::mint`] with extra custom claims (e.g. the window token's `wid`, `app`, `ver`, `tools`); they
    /// cannot override `sub`, `iss`, `aud`, `iat` or `exp`.
    pub fn mint_with_claims(
        &self,
        user: &str,
        issuer: &str,
        audience: &str,
        ttl: Duration,
        extra: Map<String, Value>,
    ) -> Result<String, AuthError> {
        if !valid_subject(user) {
            return Err(AuthError::Mint(format!(
                "the user must be 1 to {MAX_SUBJECT_LEN} bytes without control characters, not starting with \
                 {RESERVED_USER_PREFIX:?}"
            )));
        }
        if issuer.is_empty() || audience.is_empty() {
            return Err(AuthError::Mint(
                "the issuer and the audience must not be empty".into(),
            ));
        }
        let now = unix_now();
        let mut claims = extra;
        claims.insert("sub".into(), Value::from(user));
        claims.insert("iss".into(), Value::from(issuer));
        claims.insert("aud".into(), Value::from(audience));
        claims.insert("iat".into(), Value::from(now));
        claims.insert("exp".into(), Value::from(now.saturating_add(ttl.as_secs())));
        let mut header = Header::new(self.alg.jwt());
        header.kid = self.kid.clone();
        jsonwebtoken::encode(&header, &claims, &self.key)
            .map_err(|_| AuthError::Mint(format!("{} signing failed", self.alg)))
    }
}

impl fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SigningKey")
            .field("alg", &self.alg)
            .field("kid", &self.kid)
            .finish_non_exhaustive()
    }
}

/// The dev signing key `fleet up` keeps in its data dir: `<data_dir>/dev-signing-key`, an HS256 secret of 32
/// random bytes written as 64 hex digits and a newline, mode 0600.
///
/// It is created on first use, atomically — a 0600 temp file in the same directory, fsynced, then
/// `renameat2(RENAME_NOREPLACE)` (a hard link where the filesystem lacks it) — so a reader never sees a partial
/// key and an existing key is never overwritten: when two processes race, both end up with the winner's key.
#[derive(Debug)]
pub struct DevKey;

impl DevKey {
    /// `<data_dir>/dev-signing-key`.
    pub fn path(data_dir: &Path) -> PathBuf {
        data_dir.join(DEV_KEY_FILE)
    }

    /// `<data_dir>/dev-operator-key`.
    pub fn operator_path(data_dir: &Path) -> PathBuf {
        data_dir.join(DEV_OPERATOR_KEY_FILE)
    }

    /// Loads the key, creating it (and `data_dir`, mode 0700) if it does not exist yet.
    pub fn load_or_create(data_dir: &Path) -> Result<SigningKey, AuthError> {
        DevKey::load_or_create_at(data_dir, &DevKey::path(data_dir))
    }

    /// Loads the dev operator key, creating it like [`load_or_create`](Self::load_or_create).
    pub fn load_or_create_operator(data_dir: &Path) -> Result<SigningKey, AuthError> {
        DevKey::load_or_create_at(data_dir, &DevKey::operator_path(data_dir))
    }

    /// Loads the key; [`AuthError::DevKeyMissing`] (naming the file) if it does not exist.
    pub fn load(data_dir: &Path) -> Result<SigningKey, AuthError> {
        DevKey::load_at(DevKey::path(data_dir))
    }

    /// Loads the dev operator key; [`AuthError::DevKeyMissing`] (naming the file) if it does not exist.
    pub fn load_operator(data_dir: &Path) -> Result<SigningKey, AuthError> {
        DevKey::load_at(DevKey::operator_path(data_dir))
    }

    fn load_or_create_at(data_dir: &Path, path: &Path) -> Result<SigningKey, AuthError> {
        match DevKey::load_at(path.to_path_buf()) {
            Err(AuthError::DevKeyMissing(_)) => {}
            loaded => return loaded,
        }
        if create_secret_file(data_dir, path)? {
            tracing::info!(path = %path.display(), "created a dev signing key");
        }
        DevKey::load_at(path.to_path_buf())
    }

    fn load_at(path: PathBuf) -> Result<SigningKey, AuthError> {
        let file = match File::open(&path) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(AuthError::DevKeyMissing(path)),
            Err(source) => return Err(AuthError::DevKeyIo { path, source }),
        };
        let invalid = |path: PathBuf, reason: &'static str| AuthError::DevKeyInvalid { path, reason };
        match file.metadata() {
            Ok(meta) if meta.is_file() => {}
            Ok(_) => return Err(invalid(path, "not a regular file")),
            Err(source) => return Err(AuthError::DevKeyIo { path, source }),
        }
        let mut text = String::new();
        if let Err(e) = file.take(1024).read_to_string(&mut text) {
            return Err(if e.kind() == io::ErrorKind::InvalidData {
                invalid(path, "expected 64 hex digits")
            } else {
                AuthError::DevKeyIo { path, source: e }
            });
        }
        let trimmed = text.trim();
        let secret = match hex_decode(trimmed) {
            Some(secret) if secret.len() == 32 => secret,
            _ => return Err(invalid(path, "expected 64 hex digits")),
        };
        SigningKey::hs256(&secret)
    }
}

/// The verifier of operator tokens: its own keys, and the audience [`OPERATOR_AUDIENCE`] fixed by construction, so
/// an admin API cannot be handed the user-token verifier by mistake, and a user-token key never verifies an
/// operator token.
#[derive(Debug, Clone)]
pub struct OperatorVerifier(Verifier);

impl OperatorVerifier {
    /// Operator tokens signed by one of `keys`, issued by `issuer`, for [`OPERATOR_AUDIENCE`].
    pub fn new(keys: Vec<VerifyKey>, issuer: &str) -> Result<OperatorVerifier, AuthError> {
        Verifier::new(keys, issuer, OPERATOR_AUDIENCE).map(OperatorVerifier)
    }

    /// Verifies an operator token (`Authorization` header value or bare token). The `operator` claim is not
    /// needed: the audience and the key are what make a token an operator's.
    pub fn verify(&self, header_value: &str) -> Result<Principal, AuthError> {
        self.0.verify(header_value)
    }

    /// The admin APIs' gate (`what` names the API in the refusal): a missing, malformed or expired token is
    /// `invalid_token`; a current token that is not an operator's (another audience or issuer, another key: a
    /// user token, whatever claims it carries) is `permission_denied`.
    pub fn authorize(&self, header_value: Option<&str>, what: &str) -> Result<Principal, ApiError> {
        let Some(header_value) = header_value else {
            return Err(ApiError::new(
                ApiErrorCode::InvalidToken,
                "missing Authorization header",
            ));
        };
        match self.verify(header_value) {
            Ok(p) => Ok(p),
            Err(
                e @ (AuthError::WrongAudience
                | AuthError::WrongIssuer
                | AuthError::BadSignature
                | AuthError::NoMatchingKey
                | AuthError::AlgorithmNotAllowed(_)),
            ) => Err(ApiError::with_details(
                ApiErrorCode::PermissionDenied,
                format!(
                    "{what}: an operator token is required (audience {OPERATOR_AUDIENCE}, an operator key)"
                ),
                json!({ "reason": e.reason() }),
            )),
            Err(e) => Err(e.to_api_error()),
        }
    }
}

/// Creates `path` in `data_dir` (and `data_dir`, mode 0700) with 32 random bytes as 64 hex digits and a newline,
/// mode 0600, atomically and never replacing an existing file; `true` if this call created it.
fn create_secret_file(data_dir: &Path, path: &Path) -> Result<bool, AuthError> {
    let io_err = |source| AuthError::DevKeyIo {
        path: path.to_path_buf(),
        source,
    };
    DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(data_dir)
        .map_err(io_err)?;
    let mut secret = [0u8; 32];
    rand::rngs::OsRng
        .try_fill_bytes(&mut secret)
        .map_err(|e| io_err(io::Error::other(e)))?;
    let mut text = hex_encode(&secret).into_bytes();
    text.push(b'\n');
    let created = crate::private_file::create_exclusive(path, &text).map_err(io_err);
    wipe(&mut secret);
    wipe(&mut text);
    created
}

/// A 32-byte secret kept in `<data_dir>/<name>` as 64 hex digits (mode 0600), created atomically on first use
/// exactly like the dev key (e.g. `link-signing-key`, the HMAC secret of download links).
pub fn load_or_create_secret(data_dir: &Path, name: &str) -> Result<Vec<u8>, AuthError> {
    let path = data_dir.join(name);
    if !path.exists() {
        create_secret_file(data_dir, &path)?;
    }
    load_secret_file(&path)
}

/// Reads a secret file: 64 hex digits (a trailing newline is fine), or at least 32 raw bytes.
pub fn load_secret_file(path: &Path) -> Result<Vec<u8>, AuthError> {
    let bytes = std::fs::read(path).map_err(|source| AuthError::DevKeyIo {
        path: path.to_path_buf(),
        source,
    })?;
    let text = String::from_utf8_lossy(&bytes);
    if let Some(secret) = hex_decode(text.trim()).filter(|s| s.len() >= 32) {
        return Ok(secret);
    }
    let raw = bytes.strip_suffix(b"\n").unwrap_or(&bytes);
    if raw.len() >= 32 {
        return Ok(raw.to_vec());
    }
    Err(AuthError::DevKeyInvalid {
        path: path.to_path_buf(),
        reason: "expected 64 hex digits or at least 32 bytes",
    })
}

// ---------------------------------------------------------------------------------------------------------------
// Verification helpers.

fn malformed(reason: &str) -> AuthError {
    AuthError::Malformed(reason.to_owned())
}

/// The token of an `Authorization` value: `Bearer <jwt>` or `<jwt>`.
fn bearer_token(value: &str) -> Result<&str, AuthError> {
    let value = value.trim();
    if value.is_empty() {
        return Err(AuthError::Missing);
    }
    match value.split_once(|c: char| c.is_ascii_whitespace()) {
        None if value.eq_ignore_ascii_case("bearer") => Err(AuthError::Missing),
        None => Ok(value),
        Some((scheme, rest)) => {
            if !scheme.eq_ignore_ascii_case("bearer") {
                return Err(malformed(
                    "the Authorization header must be `Bearer <jwt>` or a bare JWT",
                ));
            }
            let token = rest.trim_start();
            if token.contains(|c: char| c.is_ascii_whitespace()) {
                return Err(malformed("a JWT contains no whitespace"));
            }
            Ok(token)
        }
    }
}

/// The header's `alg` and `kid`, read without the library so that `none` and unknown algorithms are reported as
/// such (the library's typed header cannot represent them). The library re-parses the header authoritatively.
fn parse_header(token: &str) -> Result<(String, Option<String>), AuthError> {
    let mut parts = token.split('.');
    let (Some(header), Some(payload), Some(_signature), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(malformed("a JWT has three dot-separated parts"));
    };
    if header.is_empty() || payload.is_empty() {
        return Err(malformed("the token's header or payload is empty"));
    }
    let bytes = b64url_decode(header).ok_or_else(|| malformed("the token's header is not base64url"))?;
    let Ok(Value::Object(map)) = serde_json::from_slice::<Value>(&bytes) else {
        return Err(malformed("the token's header is not a JSON object"));
    };
    let alg = match map.get("alg") {
        Some(Value::String(alg)) => alg.clone(),
        _ => return Err(malformed("the token's header has no `alg`")),
    };
    let kid = match map.get("kid") {
        None | Some(Value::Null) => None,
        Some(Value::String(kid)) => Some(kid.clone()),
        Some(_) => return Err(malformed("the token's `kid` is not a string")),
    };
    Ok((alg, kid))
}

/// An `alg` value fit for an error message: at most 16 characters of `[A-Za-z0-9_-]`.
fn sanitize_alg(alg: &str) -> String {
    let mut out: String = alg
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
        .take(16)
        .collect();
    if out.len() != alg.len() {
        out.push('…');
    }
    out
}

fn static_claim(name: &str) -> &'static str {
    match name {
        "exp" => "exp",
        "nbf" => "nbf",
        "iss" => "iss",
        "aud" => "aud",
        "sub" => "sub",
        _ => "unknown",
    }
}

fn map_jwt_error(e: JwtError, alg: KeyAlgorithm, token: &str) -> AuthError {
    match e.into_kind() {
        ErrorKind::ExpiredSignature => AuthError::Expired,
        ErrorKind::ImmatureSignature => AuthError::NotYetValid,
        ErrorKind::InvalidAudience => AuthError::WrongAudience,
        ErrorKind::InvalidIssuer => AuthError::WrongIssuer,
        ErrorKind::InvalidSubject => AuthError::InvalidClaim("sub"),
        ErrorKind::InvalidSignature => AuthError::BadSignature,
        ErrorKind::InvalidAlgorithm | ErrorKind::MissingAlgorithm => {
            AuthError::AlgorithmNotAllowed(alg.as_str().to_owned())
        }
        ErrorKind::MissingRequiredClaim(name) => missing_claim(token, &name),
        ErrorKind::InvalidClaimFormat(name) => AuthError::InvalidClaim(static_claim(&name)),
        ErrorKind::InvalidToken => malformed("the token is not a well-formed JWS"),
        ErrorKind::Base64(_) => malformed("a part of the token is not base64url"),
        ErrorKind::Json(_) | ErrorKind::Utf8(_) => {
            malformed("the token's header or claims are not a valid JSON object")
        }
        ErrorKind::InvalidEddsaKey
        | ErrorKind::InvalidEcdsaKey
        | ErrorKind::InvalidRsaKey(_)
        | ErrorKind::InvalidKeyFormat
        | ErrorKind::UnsupportedAlgorithm => {
            AuthError::Key(format!("the {alg} verification key cannot be used"))
        }
        _ => malformed("the token could not be verified"),
    }
}

/// The library reports the first missing required claim of a hash set, in no fixed order; the signature has
/// verified by then, so read the claims and report the first missing one in [`REQUIRED_CLAIMS`] order. A claim
/// the library counted as missing but that is present has the wrong type.
fn missing_claim(token: &str, library_name: &str) -> AuthError {
    let claims = token
        .split('.')
        .nth(1)
        .and_then(b64url_decode)
        .and_then(|bytes| serde_json::from_slice::<Map<String, Value>>(&bytes).ok());
    if let Some(claims) = claims {
        for claim in REQUIRED_CLAIMS {
            if matches!(claims.get(claim), None | Some(Value::Null)) {
                return AuthError::MissingClaim(claim);
            }
        }
        return AuthError::InvalidClaim(static_claim(library_name));
    }
    AuthError::MissingClaim(static_claim(library_name))
}

/// A user id a token may carry: 1 to [`MAX_SUBJECT_LEN`] bytes, no control character, not one of the fleet's own
/// users ([`RESERVED_USER_PREFIX`]).
fn valid_subject(sub: &str) -> bool {
    !sub.is_empty()
        && sub.len() <= MAX_SUBJECT_LEN
        && !sub.chars().any(char::is_control)
        && !sub.starts_with(RESERVED_USER_PREFIX)
}

/// The principal of verified, validated claims, with the shapes the library is lenient about checked strictly.
fn principal(claims: &Map<String, Value>) -> Result<Principal, AuthError> {
    let user = match claims.get("sub") {
        Some(Value::String(sub)) if valid_subject(sub) => sub.clone(),
        _ => return Err(AuthError::InvalidClaim("sub")),
    };
    // The library accepts an array of issuers; an issuer is one StringOrURI (RFC 7519 §4.1.1).
    if !matches!(claims.get("iss"), Some(Value::String(_))) {
        return Err(AuthError::InvalidClaim("iss"));
    }
    // The library accepts a float `exp`; a principal's expiry is whole seconds.
    let expires_at = claims
        .get("exp")
        .and_then(Value::as_u64)
        .ok_or(AuthError::InvalidClaim("exp"))?;
    let operator = match claims.get(OPERATOR_CLAIM) {
        None | Some(Value::Null) => false,
        Some(Value::Bool(operator)) => *operator,
        Some(_) => return Err(AuthError::InvalidClaim(OPERATOR_CLAIM)),
    };
    Ok(Principal {
        user,
        operator,
        expires_at,
    })
}

// ---------------------------------------------------------------------------------------------------------------
// Key helpers.

/// jsonwebtoken picks its crypto provider from its features and panics on first use when it cannot (both or
/// neither of `rust_crypto` / `aws_lc_rs` enabled by feature unification). Refuse to build keys instead.
fn ensure_provider() -> Result<(), AuthError> {
    match CryptoProvider::try_get_default() {
        Some(_) => Ok(()),
        None => Err(AuthError::Key(
            "jsonwebtoken has no crypto provider (enable exactly one of `rust_crypto` and `aws_lc_rs`)"
                .into(),
        )),
    }
}

fn check_hs256_secret(secret: &[u8]) -> Result<(), AuthError> {
    if secret.len() < MIN_HS256_SECRET_LEN {
        return Err(AuthError::Key(format!(
            "an HS256 secret must be at least {MIN_HS256_SECRET_LEN} bytes, this one has {}",
            secret.len()
        )));
    }
    Ok(())
}

/// A usable Ed25519 public key: exactly 32 bytes (the library's verifier slices `[..32]` and would panic on
/// less) that decode to a curve point (checked by building the library's verifier once).
fn check_ed25519_public(key: &DecodingKey) -> Result<(), AuthError> {
    let bad = || AuthError::Key("not a valid Ed25519 public key".into());
    if key.try_get_as_bytes().map_err(|_| bad())?.len() != 32 {
        return Err(bad());
    }
    // An empty signature never verifies (`Ok(false)`); an invalid key is an `Err`.
    jsonwebtoken::crypto::verify("", b"", key, Algorithm::EdDSA).map_err(|_| bad())?;
    Ok(())
}

/// PKCS#8 v1 prefix of an Ed25519 private key: SEQUENCE, version 0, AlgorithmIdentifier id-Ed25519,
/// OCTET STRING { OCTET STRING (32) }. The 32-byte seed follows.
const PKCS8_V1_PREFIX: [u8; 16] = [
    0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20,
];
/// AlgorithmIdentifier id-Ed25519 followed by the private key's nested OCTET STRING header.
const ED25519_ALG_AND_KEY_HEADER: [u8; 11] =
    [0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20];

/// The 32-byte seed of an Ed25519 PKCS#8 document (v1, or v2 with attributes and/or the public key).
fn pkcs8_ed25519_seed(der: &[u8]) -> Option<&[u8]> {
    let rest = match der {
        [0x30, len, rest @ ..] if *len < 0x80 => rest,
        [0x30, 0x81, _, rest @ ..] => rest,
        _ => return None,
    };
    let rest = match rest {
        [0x02, 0x01, 0x00 | 0x01, rest @ ..] => rest,
        _ => return None,
    };
    rest.strip_prefix(&ED25519_ALG_AND_KEY_HEADER)?.get(..32)
}

/// The public key of an Ed25519 private key, derived through the library's JWK support (which only takes the
/// 48-byte v1 form, hence the rebuild from the seed).
fn ed25519_public_from_pkcs8(der: &[u8]) -> Result<DecodingKey, AuthError> {
    let bad = || AuthError::Key("cannot derive the Ed25519 public key".into());
    let seed = pkcs8_ed25519_seed(der).ok_or_else(bad)?;
    let mut v1 = Vec::with_capacity(PKCS8_V1_PREFIX.len() + seed.len());
    v1.extend_from_slice(&PKCS8_V1_PREFIX);
    v1.extend_from_slice(seed);
    let encoding = EncodingKey::from_ed_der(&v1);
    wipe(&mut v1);
    let jwk = Jwk::from_encoding_key(&encoding, Algorithm::EdDSA).map_err(|_| bad())?;
    let AlgorithmParameters::OctetKeyPair(params) = &jwk.algorithm else {
        return Err(bad());
    };
    let public = DecodingKey::from_ed_components(&params.x).map_err(|_| bad())?;
    check_ed25519_public(&public)?;
    Ok(public)
}

/// Best-effort zeroing of a secret copy before it is dropped.
fn wipe(bytes: &mut [u8]) {
    bytes.fill(0);
    std::hint::black_box(bytes);
}

// ---------------------------------------------------------------------------------------------------------------
// Dev key file helpers.

fn hex_encode(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
    out
}

fn hex_decode(text: &str) -> Option<Vec<u8>> {
    fn nibble(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            b'A'..=b'F' => Some(c - b'A' + 10),
            _ => None,
        }
    }
    let bytes = text.as_bytes();
    if !bytes.len().is_multiple_of(2) {
        return None;
    }
    bytes
        .chunks_exact(2)
        .map(|pair| Some((nibble(pair[0])? << 4) | nibble(pair[1])?))
        .collect()
}

/// Unpadded base64url (RFC 4648 §5), as JWS uses.
fn b64url_decode(text: &str) -> Option<Vec<u8>> {
    fn value(c: u8) -> Option<u8> {
        match c {
            b'A'..=b'Z' => Some(c - b'A'),
            b'a'..=b'z' => Some(c - b'a' + 26),
            b'0'..=b'9' => Some(c - b'0' + 52),
            b'-' => Some(62),
            b'_' => Some(63),
            _ => None,
        }
    }
    let bytes = text.as_bytes();
    if bytes.len() % 4 == 1 {
        return None;
    }
    let mut out = Vec::with_capacity(bytes.len() / 4 * 3 + 2);
    for chunk in bytes.chunks(4) {
        let mut v = [0u8; 4];
        for (slot, &c) in v.iter_mut().zip(chunk) {
            *slot = value(c)?;
        }
        out.push((v[0] << 2) | (v[1] >> 4));
        if chunk.len() > 2 {
            out.push((v[1] << 4) | (v[2] >> 2));
        }
        if chunk.len() > 3 {
            out.push((v[2] << 6) | v[3]);
        }
    }
    Some(out)
}

/// The token of an `Authorization` header value, refused past [`MAX_TOKEN_LEN`] before any other work.
fn bounded_token(header_value: &str) -> Result<&str, AuthError> {
    let token = bearer_token(header_value)?;
    if token.len() > MAX_TOKEN_LEN {
        return Err(malformed("the token is too long"));
    }
    Ok(token)
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CACHE_SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";

    fn cache_pair() -> (Verifier, SigningKey) {
        let verifier = Verifier::new(vec![VerifyKey::hs256(CACHE_SECRET).unwrap()], "iss", "aud")
            .unwrap()
            .with_leeway(0);
        (verifier, SigningKey::hs256(CACHE_SECRET).unwrap())
    }

    fn cached(v: &Verifier) -> usize {
        fleet_proto::util::lock(&v.inner.verified).len()
    }

    #[test]
    fn a_verified_token_is_remembered_and_its_expiry_checked_on_every_hit() {
        let (v, key) = cache_pair();
        let token = key
            .mint("alice", "iss", "aud", Duration::from_secs(60), false)
            .unwrap();
        let now = unix_now();
        let first = v.verify_at(&token, now).unwrap();
        assert_eq!(cached(&v), 1);
        let again = v.verify_at(&format!("Bearer {token}"), now).unwrap();
        assert_eq!((again.user.as_str(), cached(&v)), ("alice", 1));
        assert_eq!(first, again);
        // At exp (leeway 0) still valid; one second later refused, and forgotten.
        assert!(v.verify_at(&token, first.expires_at).is_ok());
        assert!(matches!(
            v.verify_at(&token, first.expires_at + 1),
            Err(AuthError::Expired)
        ));
        assert_eq!(cached(&v), 0);
    }

    #[test]
    fn a_token_living_longer_than_the_cap_is_refused_at_the_boundary() {
        let (v, key) = cache_pair();
        let v = v.with_max_lifetime(Some(3_600));
        assert_eq!(v.max_lifetime(), Some(3_600));
        // The window tokens' verifier keeps the cap.
        assert_eq!(v.for_audience("win").unwrap().max_lifetime(), Some(3_600));
        let token = key
            .mint("alice", "iss", "aud", Duration::from_secs(3_600), false)
            .unwrap();
        let exp = v
            .clone()
            .with_max_lifetime(None)
            .verify(&token)
            .unwrap()
            .expires_at;
        // exp exactly the cap from now: accepted; one second more: refused, with a token verdict, and never
        // remembered (a later call is refused again).
        let long = v.verify_at(&token, exp - 3_600 - 1);
        assert!(matches!(long, Err(AuthError::LifetimeTooLong(3_600))), "{long:?}");
        assert!(matches!(
            v.verify_at(&token, exp - 3_600 - 1),
            Err(AuthError::LifetimeTooLong(3_600))
        ));
        assert_eq!(cached(&v), 0);
        let e = long.unwrap_err();
        assert!(e.is_token_error());
        let api = e.to_api_error();
        assert_eq!(api.code, ApiErrorCode::InvalidToken);
        assert_eq!(api.details, Some(json!({"reason": "lifetime_too_long"})));
        assert!(v.verify_at(&token, exp - 3_600).is_ok());
        // The leeway widens the cap like it widens `exp` (a fresh verifier each: a token verified once is
        // remembered).
        let lenient = || v.clone().with_leeway(30);
        assert!(matches!(
            lenient().verify_at(&token, exp - 3_600 - 31),
            Err(AuthError::LifetimeTooLong(3_600))
        ));
        assert!(lenient().verify_at(&token, exp - 3_600 - 30).is_ok());
        // Uncapped: any lifetime.
        let forever = key
            .mint(
                "alice",
                "iss",
                "aud",
                Duration::from_secs(10 * 365 * 86_400),
                false,
            )
            .unwrap();
        assert!(v.clone().with_max_lifetime(None).verify(&forever).is_ok());
        assert!(matches!(
            v.verify(&forever),
            Err(AuthError::LifetimeTooLong(3_600))
        ));
    }

    #[test]
    fn failures_are_never_remembered_and_the_cache_stays_bounded() {
        let (v, _) = cache_pair();
        let forged = SigningKey::hs256(b"another secret, 32 bytes long...")
            .unwrap()
            .mint("mallory", "iss", "aud", Duration::from_secs(60), false)
            .unwrap();
        for _ in 0..2 {
            assert!(matches!(v.verify(&forged), Err(AuthError::BadSignature)));
        }
        assert_eq!(cached(&v), 0);
        let (v, key) = cache_pair();
        for i in 0..=VERIFIED_CACHE_ENTRIES {
            let t = key
                .mint(&format!("u{i}"), "iss", "aud", Duration::from_secs(60), false)
                .unwrap();
            v.verify(&t).unwrap();
            assert!(cached(&v) <= VERIFIED_CACHE_ENTRIES);
        }
        // Full of live entries, the cache started over: only the last token is remembered.
        assert_eq!(cached(&v), 1);
    }

    #[test]
    fn base64url_round_trips_known_vectors() {
        assert_eq!(b64url_decode("").as_deref(), Some(&b""[..]));
        assert_eq!(b64url_decode("Zg").as_deref(), Some(&b"f"[..]));
        assert_eq!(b64url_decode("Zm8").as_deref(), Some(&b"fo"[..]));
        assert_eq!(b64url_decode("Zm9v").as_deref(), Some(&b"foo"[..]));
        assert_eq!(b64url_decode("-_8").as_deref(), Some(&[0xfb, 0xff][..]));
        assert_eq!(b64url_decode("Zm9v="), None);
        assert_eq!(b64url_decode("Z"), None);
        assert_eq!(b64url_decode("Zm+v"), None);
    }

    #[test]
    fn hex_round_trips() {
        let bytes = [0u8, 1, 0x7f, 0x80, 0xff];
        assert_eq!(hex_encode(&bytes), "00017f80ff");
        assert_eq!(hex_decode("00017F80ff").as_deref(), Some(&bytes[..]));
        assert_eq!(hex_decode("0"), None);
        assert_eq!(hex_decode("zz"), None);
    }

    #[test]
    fn bearer_parsing() {
        assert_eq!(bearer_token("Bearer a.b.c").ok(), Some("a.b.c"));
        assert_eq!(bearer_token("bearer   a.b.c  ").ok(), Some("a.b.c"));
        assert_eq!(bearer_token("a.b.c").ok(), Some("a.b.c"));
        assert!(matches!(bearer_token(""), Err(AuthError::Missing)));
        assert!(matches!(bearer_token("  Bearer  "), Err(AuthError::Missing)));
        assert!(matches!(bearer_token("Basic abc"), Err(AuthError::Malformed(_))));
        assert!(matches!(bearer_token("Bearer a b"), Err(AuthError::Malformed(_))));
    }

    #[test]
    fn alg_names_are_sanitised() {
        assert_eq!(sanitize_alg("none"), "none");
        assert_eq!(sanitize_alg("HS512"), "HS512");
        assert_eq!(sanitize_alg("x\"y"), "x…");
        assert_eq!(sanitize_alg(&"A".repeat(40)), format!("{}…", "A".repeat(16)));
    }

    #[test]
    fn pkcs8_seed_forms() {
        let mut v1 = PKCS8_V1_PREFIX.to_vec();
        v1.extend_from_slice(&[7u8; 32]);
        assert_eq!(pkcs8_ed25519_seed(&v1), Some(&[7u8; 32][..]));
        assert_eq!(pkcs8_ed25519_seed(&v1[..40]), None);
        assert_eq!(pkcs8_ed25519_seed(b"\x30\x03\x02\x01\x00"), None);
    }
}
