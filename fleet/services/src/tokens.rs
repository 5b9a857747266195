//! The per-invoke service tokens (spec §11): minted by the worker for one invoke, handed to the plugin in
//! `params.context`, and verified again on every reverse call against the invoke it arrives for.
//!
//! * Signed HS256 with a key of 32 random bytes made when the process starts and never written anywhere: the
//!   reverse calls of an invoke always come back to the worker process that minted its tokens (the plugin
//!   talks to its own worker over stdio), so no other process needs to verify them, and a token cannot outlive
//!   the process (spec §11 HR-JW-01: never persisted).
//! * Claims: `sub` (the user), `iss` [`ISSUER`], `aud` (per family), `iat`, `exp`, `executa_tool_id`,
//!   `tool_invoke_id`, and the caps of the family (`allowed_scopes`, `max_calls`, `max_tokens_total`,
//!   `max_file_bytes`, `max_total_bytes`, `max_files`, `allowed_purposes`).
//! * TTL: 600 s; for invokes whose deadline is further away, `min(remaining + 5 min, 1 h)` (spec §11 HR-JW-02).
//! * Verification pins HS256, requires `exp`, `aud`, `iss`, `sub`, allows no leeway, and checks the invoke
//!   binding (user, tool id, invoke id) — a token of another invoke is refused even when its signature is good.

use std::fmt;
use std::time::Duration;

use fleet_proto::limits;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation, errors::ErrorKind};
use rand::RngCore;
use serde::{Deserialize, Serialize};

use fleet_proto::util::now_ms;

/// `iss` of every service token.
pub const ISSUER: &str = "cloud-agents-host";

/// `aud` of the sampling token (also embeddings and agent sessions).
pub const AUD_SAMPLING: &str = "executa-sampling";
/// `aud` of the storage token (`storage/*`, `files/*`).
pub const AUD_STORAGE: &str = "aps-storage";
/// `aud` of the upload token.
pub const AUD_UPLOAD: &str = "executa-upload";
/// `aud` of the image token (`image/generate`, `image/edit`; spec §8.6).
pub const AUD_IMAGE: &str = "executa-image";
/// `aud` of the web token (`web/*`; spec §8.9 names none: this one never leaves the host).
pub const AUD_WEB: &str = "executa-web";
/// `aud` of the credentials token (`credentials/*`; spec §8.8, §11).
pub const AUD_CREDENTIALS: &str = "executa-credentials";

/// How long before its tokens expire a still-running invoke gets new ones (spec §11 HR-JW-02).
pub const RENEW_BEFORE_EXPIRY: Duration = Duration::from_secs(300);

/// When tokens minted at `now_ms` with `ttl` must be renewed for an invoke ending at `deadline_ms`: `None` when
/// they outlive the deadline, else [`RENEW_BEFORE_EXPIRY`] before they expire (at least half-way through their
/// life).
pub fn renew_at_ms(now_ms: u64, ttl: Duration, deadline_ms: u64) -> Option<u64> {
    let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
    let expires = now_ms.saturating_add(ttl_ms);
    if deadline_ms < expires {
        return None;
    }
    let margin = u64::try_from(RENEW_BEFORE_EXPIRY.as_millis())
        .unwrap_or(u64::MAX)
        .min(ttl_ms / 2);
    Some(expires - margin)
}

/// The claims of a service token.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceClaims {
    /// The user.
    pub sub: String,
    /// [`ISSUER`].
    pub iss: String,
    /// The family's audience.
    pub aud: String,
    /// Issued at, Unix seconds.
    pub iat: u64,
    /// Expiry, Unix seconds.
    pub exp: u64,
    /// The plugin.
    pub executa_tool_id: String,
    /// The invoke.
    pub tool_invoke_id: String,
    /// The granted capabilities this token covers (`llm.sample`, `llm.embed`; `aps.kv`, `aps.files`;
    /// `host.upload`).
    #[serde(default)]
    pub caps: Vec<String>,
    /// Storage: the scopes a plugin may use (`["tool", "user"]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed_scopes: Option<Vec<String>>,
    /// Sampling / storage: calls per invoke.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_calls: Option<u32>,
    /// Sampling: tokens per invoke.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens_total: Option<u64>,
    /// Upload: largest file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_file_bytes: Option<u64>,
    /// Upload: bytes per invoke.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_total_bytes: Option<u64>,
    /// Upload: files per invoke.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_files: Option<u32>,
    /// Upload: purposes allowed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed_purposes: Option<Vec<String>>,
    /// Image: images one `image/generate` call may ask for (spec §7.4 `max_per_call_generate`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_per_call_generate: Option<u32>,
    /// Image: images one `image/edit` call may ask for (spec §7.4 `max_per_call_edit`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_per_call_edit: Option<u32>,
    /// Image: the user's images per rolling 24 h (spec §8.6 `max_images_per_day`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_images_per_day: Option<u32>,
    /// Image: images per invoke, all its calls together (spec §7.4 `image_token.max_images`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_images: Option<u32>,
    /// Web: `search_depth: "advanced"` allowed (`web_grant.allowAdvanced`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub web_advanced: Option<bool>,
    /// Web: results per search call (`web_grant.maxResultsPerCall`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_results: Option<u32>,
    /// Web: the user turned web off for this plugin (`web_grant.enabled: false`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub web_denied: Option<bool>,
    /// Credentials: the user, as spec §11 names the claim (`sub` too).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_id: Option<String>,
    /// Credentials: the OAuth providers the manifest's declared credentials map to (spec §11 `providers[]`):
    /// `credentials/*` answers for these only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub providers: Option<Vec<String>>,
}

impl fmt::Debug for ServiceClaims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServiceClaims")
            .field("sub", &self.sub)
            .field("aud", &self.aud)
            .field("exp", &self.exp)
            .field("executa_tool_id", &self.executa_tool_id)
            .field("tool_invoke_id", &self.tool_invoke_id)
            .finish_non_exhaustive()
    }
}

/// Which invoke a token must belong to.
#[derive(Debug, Clone, Copy)]
pub struct Binding<'a> {
    /// The user.
    pub user: &'a str,
    /// The plugin.
    pub tool_id: &'a str,
    /// The invoke.
    pub invoke_id: &'a str,
}

/// Why a token was refused. Never carries the token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// The invoke has no token for this family.
    #[error("no token for this invoke")]
    Missing,
    /// Not a JWT, or not ours.
    #[error("the token is malformed")]
    Malformed,
    /// The signature does not verify.
    #[error("the token's signature does not verify")]
    BadSignature,
    /// Another family's token.
    #[error("the token's audience is not {0}")]
    WrongAudience(&'static str),
    /// Past `exp`.
    #[error("the token has expired")]
    Expired,
    /// Good signature, but minted for another user, plugin or invoke.
    #[error("the token was minted for another {0}")]
    WrongBinding(&'static str),
    /// Minting failed.
    #[error("minting failed: {0}")]
    Mint(String),
}

/// Mints and verifies service tokens with the process's own key.
pub struct TokenMinter {
    encoding: EncodingKey,
    decoding: DecodingKey,
}

impl fmt::Debug for TokenMinter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TokenMinter").finish_non_exhaustive()
    }
}

impl TokenMinter {
    /// A minter with a fresh random key.
    pub fn new() -> Result<TokenMinter, TokenError> {
        let mut secret = [0_u8; 32];
        rand::rng().fill_bytes(&mut secret);
        let unusable = |e: jsonwebtoken::errors::Error| TokenError::Mint(e.to_string());
        Ok(TokenMinter {
            encoding: EncodingKey::from_secret(&secret).map_err(unusable)?,
            decoding: DecodingKey::from_secret(&secret).map_err(unusable)?,
        })
    }

    /// The TTL of a token for an invoke ending at `deadline_ms` (spec §11: 600 s; long jobs
    /// `min(remaining + 5 min, 1 h)`).
    pub fn ttl_for(deadline_ms: u64) -> Duration {
        let remaining = Duration::from_millis(deadline_ms.saturating_sub(now_ms()));
        (remaining + limits::LONG_JOB_TOKEN_TTL_SLACK)
            .clamp(limits::INVOKE_TOKEN_TTL, limits::LONG_JOB_TOKEN_TTL_CAP)
    }

    /// Claims for `binding` and `aud`, valid for `ttl`, without caps (fill them in, then [`Self::sign`]).
    pub fn claims(binding: Binding<'_>, aud: &str, ttl: Duration) -> ServiceClaims {
        let now = now_ms() / 1000;
        ServiceClaims {
            sub: binding.user.to_owned(),
            iss: ISSUER.to_owned(),
            aud: aud.to_owned(),
            iat: now,
            exp: now.saturating_add(ttl.as_secs()),
            executa_tool_id: binding.tool_id.to_owned(),
            tool_invoke_id: binding.invoke_id.to_owned(),
            caps: Vec::new(),
            allowed_scopes: None,
            max_calls: None,
            max_tokens_total: None,
            max_file_bytes: None,
            max_total_bytes: None,
            max_files: None,
            allowed_purposes: None,
            max_per_call_generate: None,
            max_per_call_edit: None,
            max_images_per_day: None,
            max_images: None,
            web_advanced: None,
            max_results: None,
            web_denied: None,
            user_id: None,
            providers: None,
        }
    }

    /// Signs `claims`.
    pub fn sign(&self, claims: &ServiceClaims) -> Result<String, TokenError> {
        jsonwebtoken::encode(&Header::new(Algorithm::HS256), claims, &self.encoding)
            .map_err(|e| TokenError::Mint(e.to_string()))
    }

    /// Verifies `token` for `aud` and `binding`.
    pub fn verify(
        &self,
        token: Option<&str>,
        aud: &'static str,
        binding: Binding<'_>,
    ) -> Result<ServiceClaims, TokenError> {
        let token = token.ok_or(TokenError::Missing)?;
        let mut v = Validation::new(Algorithm::HS256);
        v.leeway = 0;
        v.set_audience(&[aud]);
        v.set_issuer(&[ISSUER]);
        v.set_required_spec_claims(&["exp", "aud", "iss", "sub"]);
        let claims = jsonwebtoken::decode::<ServiceClaims>(token, &self.decoding, &v)
            .map_err(|e| match e.kind() {
                ErrorKind::InvalidSignature => TokenError::BadSignature,
                ErrorKind::InvalidAudience => TokenError::WrongAudience(aud),
                ErrorKind::ExpiredSignature => TokenError::Expired,
                _ => TokenError::Malformed,
            })?
            .claims;
        if claims.sub != binding.user {
            return Err(TokenError::WrongBinding("user"));
        }
        if claims.executa_tool_id != binding.tool_id {
            return Err(TokenError::WrongBinding("plugin"));
        }
        if claims.tool_invoke_id != binding.invoke_id {
            return Err(TokenError::WrongBinding("invoke"));
        }
        Ok(claims)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: Binding<'static> = Binding {
        user: "alice",
        tool_id: "tool-x",
        invoke_id: "inv-1",
    };

    fn token(m: &TokenMinter, aud: &str, ttl: Duration) -> String {
        m.sign(&TokenMinter::claims(B, aud, ttl)).expect("sign")
    }

    #[test]
    fn a_good_token_verifies_with_its_claims() {
        let m = TokenMinter::new().expect("minter");
        let t = token(&m, AUD_STORAGE, Duration::from_secs(600));
        let c = m.verify(Some(&t), AUD_STORAGE, B).expect("valid");
        assert_eq!((c.sub.as_str(), c.tool_invoke_id.as_str()), ("alice", "inv-1"));
        assert_eq!(c.exp - c.iat, 600);
    }

    #[test]
    fn tampering_is_refused_with_the_reason() {
        let m = TokenMinter::new().expect("minter");
        let t = token(&m, AUD_STORAGE, Duration::from_secs(600));
        assert_eq!(m.verify(None, AUD_STORAGE, B), Err(TokenError::Missing));
        // Another process's key.
        let other = token(
            &TokenMinter::new().expect("minter"),
            AUD_STORAGE,
            Duration::from_secs(600),
        );
        assert_eq!(
            m.verify(Some(&other), AUD_STORAGE, B),
            Err(TokenError::BadSignature)
        );
        // A flipped payload byte.
        let mut parts: Vec<String> = t.split('.').map(str::to_owned).collect();
        let mut payload = parts[1].clone().into_bytes();
        payload[5] ^= 1;
        parts[1] = String::from_utf8(payload).expect("ascii");
        let forged = parts.join(".");
        assert!(m.verify(Some(&forged), AUD_STORAGE, B).is_err());
        // Another family.
        assert_eq!(
            m.verify(Some(&t), AUD_SAMPLING, B),
            Err(TokenError::WrongAudience(AUD_SAMPLING))
        );
        // Expired.
        let mut c = TokenMinter::claims(B, AUD_STORAGE, Duration::ZERO);
        c.exp = c.iat.saturating_sub(1);
        let old = m.sign(&c).expect("sign");
        assert_eq!(m.verify(Some(&old), AUD_STORAGE, B), Err(TokenError::Expired));
        // Another invoke, plugin, user.
        let other_invoke = Binding {
            invoke_id: "inv-2",
            ..B
        };
        assert_eq!(
            m.verify(Some(&t), AUD_STORAGE, other_invoke),
            Err(TokenError::WrongBinding("invoke"))
        );
        let other_tool = Binding {
            tool_id: "tool-y",
            ..B
        };
        assert_eq!(
            m.verify(Some(&t), AUD_STORAGE, other_tool),
            Err(TokenError::WrongBinding("plugin"))
        );
        let other_user = Binding { user: "bob", ..B };
        assert_eq!(
            m.verify(Some(&t), AUD_STORAGE, other_user),
            Err(TokenError::WrongBinding("user"))
        );
        assert_eq!(m.verify(Some("x.y"), AUD_STORAGE, B), Err(TokenError::Malformed));
    }

    #[test]
    fn tokens_of_invokes_that_outlive_them_are_renewed_five_minutes_before_expiry() {
        let now = 1_000_000_000;
        let hour = Duration::from_secs(3600);
        // Ends before the tokens expire: never renewed.
        assert_eq!(renew_at_ms(now, hour, now + 3_599_999), None);
        // A 24 h job: renewed at 55 min, and again 55 min after each renewal.
        assert_eq!(
            renew_at_ms(now, hour, now + 24 * 3_600_000),
            Some(now + 3_300_000)
        );
        // A short TTL renews half-way rather than before it was minted.
        assert_eq!(
            renew_at_ms(now, Duration::from_secs(60), now + 3_600_000),
            Some(now + 30_000)
        );
    }

    #[test]
    fn ttl_is_600s_and_grows_with_long_deadlines_up_to_an_hour() {
        let now = now_ms();
        assert_eq!(TokenMinter::ttl_for(now + 60_000), Duration::from_secs(600));
        let long = TokenMinter::ttl_for(now + 30 * 60_000).as_secs();
        assert!((2099..=2100).contains(&long), "{long}");
        assert_eq!(
            TokenMinter::ttl_for(now + 5 * 3_600_000),
            Duration::from_secs(3600)
        );
    }
}
