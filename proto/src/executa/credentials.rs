//! `credentials/listAccounts` and `credentials/getToken` (spec §8.8): the results plugins read, and the account
//! metadata the fleet's HTTP listener shows a user about their own connected accounts. The numeric codes are
//! [`super::reverse::credentials`]. A plugin reaches these methods only with the invoke's `credentials_token`,
//! minted when the manifest's `credentials[]` declares a name that a configured provider's `credential_mapping`
//! maps (spec §8.8: no `host_capabilities` entry, no grant).
//!
//! Params are read by the host from the raw JSON (`{provider}`, `{provider, account_id?}`), so that a mistyped
//! field is `-32062` with the field named rather than a parser message.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The `credentials_token` claim listing the providers an invoke may ask about.
pub const PROVIDERS_CLAIM: &str = "providers";

/// Whether a connected account can mint access tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AccountStatus {
    /// Its refresh token works (or has not been tried since it was connected).
    Active,
    /// The provider refused its refresh token (revoked, expired, scopes changed): the user must connect it again.
    /// `getToken` answers `-32061` for it.
    NeedsReauth,
}

/// One connected account, metadata only (spec §8.8: "never returns tokens").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Account {
    /// The host's id of the account (`acc_` and 16 hex digits), what `getToken`'s `account_id` takes.
    pub account_id: String,
    /// The account's e-mail address as the provider reported it, if it did.
    pub email: Option<String>,
    /// A label: the one the user gave when connecting, else the e-mail address, else the provider's name.
    pub label: String,
    /// The account `getToken` and the credential mapping use when no `account_id` is given.
    pub is_default: bool,
    /// Whether it can mint access tokens.
    pub status: AccountStatus,
    /// The scopes the provider granted.
    pub scopes: Vec<String>,
}

/// `credentials/listAccounts` → `{accounts}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Accounts {
    /// The user's accounts at the provider, the default first.
    pub accounts: Vec<Account>,
}

/// `credentials/getToken` → `{access_token, account_id, expires_at}`. `Debug` never shows the token.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Token {
    /// A live access token of the account (never a refresh token: spec §8.8 HR-CD-01).
    pub access_token: String,
    /// The account it belongs to.
    pub account_id: String,
    /// When it expires, RFC 3339 UTC with milliseconds.
    pub expires_at: String,
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Token")
            .field("access_token", &"<redacted>")
            .field("account_id", &self.account_id)
            .field("expires_at", &self.expires_at)
            .finish()
    }
}

/// A provider as the fleet's HTTP listener shows it to a user (`GET /v1/oauth/providers`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Provider {
    /// Its name (`[credentials.providers.<name>]`).
    pub name: String,
    /// The credential names its `credential_mapping` fills.
    pub credentials: Vec<String>,
    /// The scopes the connect flow asks for.
    pub scopes: Vec<String>,
}

/// `GET /v1/oauth/providers`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Providers {
    /// Every configured provider.
    pub providers: Vec<Provider>,
}

/// `GET /v1/oauth/{provider}/accounts` and the answers of the account edits: the user's accounts at one provider.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProviderAccounts {
    /// The provider.
    pub provider: String,
    /// The user's accounts there, the default first.
    pub accounts: Vec<Account>,
}

/// `GET /v1/oauth/{provider}/start` with `Accept: application/json` (else a 302 to `authorize_url`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Started {
    /// Where the browser goes next: the provider's authorization endpoint with the flow's `state` and PKCE
    /// challenge.
    pub authorize_url: String,
    /// When the flow's state is forgotten (Unix ms): the callback must come before.
    pub expires_at_ms: u64,
}

/// The callback's answer with `Accept: application/json` (else a short HTML page).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Connected {
    /// The provider.
    pub provider: String,
    /// The account connected (new, or an existing one of the same provider identity, updated).
    pub account: Account,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_debug_hides_the_token_and_accounts_have_the_spec_shape() {
        let t = Token {
            access_token: "ya29.secret".into(),
            account_id: "acc_1".into(),
            expires_at: "2026-01-01T00:00:00.000Z".into(),
        };
        assert!(!format!("{t:?}").contains("ya29"));
        let a = Account {
            account_id: "acc_1".into(),
            email: None,
            label: "google".into(),
            is_default: true,
            status: AccountStatus::NeedsReauth,
            scopes: vec!["email".into()],
        };
        assert_eq!(
            serde_json::to_value(&a).unwrap_or_default(),
            serde_json::json!({"account_id": "acc_1", "email": null, "label": "google", "is_default": true,
                               "status": "needs_reauth", "scopes": ["email"]})
        );
    }
}
