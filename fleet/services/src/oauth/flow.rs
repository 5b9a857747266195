//! The connect flow's server-side state (`<prefix>_oauth_state`): one short-lived, single-use record per started
//! flow, so that any front replica can finish the callback.
//!
//! * `state` (the `state` parameter) is 256 random bits; the record's key is its SHA-256, so the bucket never
//!   holds a value that finishes a flow;
//! * the PKCE verifier (RFC 7636, S256) is 256 random bits, sealed with the keyring's wrapping key for the
//!   record's key (the authorization endpoint only ever sees its SHA-256, the challenge);
//! * the flow is bound to the user whose API token started it (the record names the user; the account lands in
//!   that user's record) and to the browser that started it: a random binding secret goes to that browser in an
//!   `HttpOnly` cookie and only its SHA-256 into the record (RFC 6749 §10.12). A callback without the cookie is
//!   refused and leaves the state usable (a forged callback cannot spend the user's flow);
//! * it is consumed by a compare-and-set delete before the code is exchanged, so a replayed callback (same
//!   `state`, same `code`) finds nothing; the bucket's `max_age` ([`OAUTH_STATE_TTL`]) forgets flows never
//!   called back, and the record's own `expires_at_ms` is checked too.

use async_nats::jetstream::{self, kv};
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64URL;
use fleet_proto::util::now_ms;
use fleet_store::cas::{Edit, Target, compare_and_set};
use fleet_store::settings::{OAUTH_STATE_MAX_BYTES, OAUTH_STATE_TTL};
use fleet_store::{self as store, Op, Revisioned, StoreSettings};
use serde::{Deserialize, Serialize};
use sha2::Digest as _;
use zeroize::Zeroizing;

use crate::credentials::{CredentialError, Keyring, random_bytes};

const AAD_VERIFIER: &str = "fleet.oauth.v1.verifier";

/// A started flow, as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Pending {
    pub(crate) user: String,
    pub(crate) provider: String,
    /// SHA-256 (hex) of the browser binding secret.
    pub(crate) binding: String,
    /// The keyring key that sealed the verifier.
    pub(crate) kid: String,
    /// The PKCE verifier, sealed.
    pub(crate) verifier: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) label: Option<String>,
    #[serde(default)]
    pub(crate) make_default: bool,
    pub(crate) expires_at_ms: u64,
}

/// A started flow, as the front hands it out.
pub(crate) struct Begun {
    /// The `state` parameter.
    pub(crate) state: String,
    /// The PKCE challenge (`S256`).
    pub(crate) challenge: String,
    /// The binding secret for the browser's cookie.
    pub(crate) binding: Zeroizing<String>,
    pub(crate) expires_at_ms: u64,
}

/// Why a callback's state was refused. The texts name no secret.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// No flow with this state: never started, already finished (a replay), or expired.
    #[error("unknown, used or expired state: start the connect flow again")]
    Unknown,
    /// The state is another provider's.
    #[error("the state was issued for another provider")]
    WrongProvider,
    /// The browser's binding cookie is missing or not this flow's.
    #[error("this browser did not start the flow (the binding cookie is missing or wrong)")]
    NotBound,
    /// The store or the keyring.
    #[error(transparent)]
    Store(#[from] CredentialError),
}

impl From<fleet_store::StoreError> for StateError {
    fn from(e: fleet_store::StoreError) -> Self {
        StateError::Store(e.into())
    }
}

/// 256 random bits, base64url without padding (43 characters).
fn random_token() -> String {
    B64URL.encode(random_bytes::<32>())
}

fn sha256_hex(text: &str) -> String {
    hex::encode(sha2::Sha256::digest(text.as_bytes()))
}

/// The PKCE S256 challenge of `verifier` (RFC 7636 §4.2).
pub(crate) fn challenge_of(verifier: &str) -> String {
    B64URL.encode(sha2::Sha256::digest(verifier.as_bytes()))
}

/// Compares two strings in time independent of where they differ.
fn same(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The bucket of started flows.
#[derive(Debug, Clone)]
pub(crate) struct FlowStore {
    kv: kv::Store,
    keyring: Keyring,
}

impl FlowStore {
    /// Creates (or updates, or attaches to) `<prefix>_oauth_state`. Fronts only.
    pub(crate) async fn open(
        js: &jetstream::Context,
        settings: &StoreSettings,
        keyring: Keyring,
    ) -> Result<FlowStore, CredentialError> {
        let kv = store::open_kv(js, settings.oauth_state_kv_config(), settings.provision).await?;
        Ok(FlowStore { kv, keyring })
    }

    /// Records a new flow of `user` at `provider`.
    pub(crate) async fn begin(
        &self,
        user: &str,
        provider: &str,
        label: Option<String>,
        make_default: bool,
    ) -> Result<Begun, CredentialError> {
        let state = random_token();
        let verifier = Zeroizing::new(random_token());
        let binding = Zeroizing::new(random_token());
        let key = sha256_hex(&state);
        let (kid, kek) = self.keyring.wrapping();
        let expires_at_ms = now_ms() + u64::try_from(OAUTH_STATE_TTL.as_millis()).unwrap_or(u64::MAX);
        let pending = Pending {
            user: user.to_owned(),
            provider: provider.to_owned(),
            binding: sha256_hex(&binding),
            kid,
            verifier: kek.seal(&verifier_aad(&key), verifier.as_bytes()),
            label,
            make_default,
            expires_at_ms,
        };
        let target = Target {
            kv: &self.kv,
            key: &key,
            op: Op::OAuthState,
            limit: ("OAuth flow state", OAUTH_STATE_MAX_BYTES),
        };
        compare_and_set(target, Some(None), |current: Option<Revisioned<Pending>>| {
            // 256 random bits never collide; should the key exist, nothing is overwritten.
            if current.is_some() {
                return Err(CredentialError::Store("an OAuth state collided".into()));
            }
            Ok(Edit::Write(pending.clone(), ()))
        })
        .await?;
        Ok(Begun {
            challenge: challenge_of(&verifier),
            state,
            binding,
            expires_at_ms,
        })
    }

    /// Consumes the flow of `state` at `provider` for the browser holding `binding`: checks it, deletes it (only
    /// one caller ever gets it), and answers it with its PKCE verifier.
    pub(crate) async fn finish(
        &self,
        provider: &str,
        state: &str,
        binding: Option<&str>,
    ) -> Result<(Pending, Zeroizing<String>), StateError> {
        let key = sha256_hex(state);
        let target = Target {
            kv: &self.kv,
            key: &key,
            op: Op::OAuthState,
            limit: ("OAuth flow state", OAUTH_STATE_MAX_BYTES),
        };
        let pending = compare_and_set(target, None, |current: Option<Revisioned<Pending>>| {
            let Some(pending) = current.map(|c| c.value) else {
                return Err(StateError::Unknown);
            };
            if pending.expires_at_ms <= now_ms() {
                return Ok(Edit::Delete(Err(StateError::Unknown)));
            }
            if pending.provider != provider {
                return Err(StateError::WrongProvider);
            }
            if !binding.is_some_and(|b| same(&sha256_hex(b), &pending.binding)) {
                return Err(StateError::NotBound);
            }
            Ok(Edit::Delete(Ok(pending)))
        })
        .await?
        .out?;
        let kek = self
            .keyring
            .key(&pending.kid)
            .ok_or_else(|| CredentialError::UnknownKey {
                user: pending.user.clone(),
                kid: pending.kid.clone(),
            })?;
        let verifier =
            kek.open(&verifier_aad(&key), &pending.verifier)
                .map_err(|_| CredentialError::Tampered {
                    user: pending.user.clone(),
                    kid: pending.kid.clone(),
                })?;
        let verifier = String::from_utf8(verifier.to_vec()).map_err(|_| CredentialError::Tampered {
            user: pending.user.clone(),
            kid: pending.kid.clone(),
        })?;
        Ok((pending, Zeroizing::new(verifier)))
    }
}

fn verifier_aad(key: &str) -> Vec<u8> {
    format!("{AAD_VERIFIER}\0{key}").into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_challenge_is_rfc_7636s_example() {
        // RFC 7636 Appendix B.
        assert_eq!(
            challenge_of("dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk"),
            "E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM"
        );
        assert!(same("abc", "abc") && !same("abc", "abd") && !same("abc", "ab"));
        assert_eq!(random_token().len(), 43);
    }
}
