//! The provider's endpoints: the authorization-code exchange (with the PKCE verifier), the refresh, and the
//! identity of an account (`userinfo_url`, else the `id_token` of the token response).
//!
//! Client authentication is `client_secret_basic` or `client_secret_post` (a public client sends its
//! `client_id` alone). Nothing read from the provider is echoed beyond its short OAuth `error` code and the HTTP
//! status; tokens are held in [`Zeroizing`] strings and never logged.

use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64URL;
use futures::StreamExt as _;
use reqwest::header::{ACCEPT, HeaderValue};
use serde_json::Value;
use zeroize::Zeroizing;

use super::config::{ClientAuth, Provider};

/// The longest answer read from a provider endpoint.
const MAX_BODY_BYTES: usize = 64 * 1024;

/// Longest `error` code of a provider quoted in an error.
const MAX_ERROR_CODE_CHARS: usize = 64;

/// A token endpoint's answer.
pub(crate) struct Grant {
    pub(crate) access_token: Zeroizing<String>,
    /// A new refresh token (always at a code exchange when the provider issues one; at a refresh, only when it
    /// rotates them).
    pub(crate) refresh_token: Option<Zeroizing<String>>,
    /// Seconds; absent: the provider did not say.
    pub(crate) expires_in: Option<u64>,
    /// The scopes granted, when the provider says (else those asked for).
    pub(crate) scope: Option<String>,
    /// An OpenID Connect ID token (read for the account's identity only).
    pub(crate) id_token: Option<String>,
}

impl std::fmt::Debug for Grant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grant")
            .field("refresh_token", &self.refresh_token.is_some())
            .field("expires_in", &self.expires_in)
            .field("scope", &self.scope)
            .finish_non_exhaustive()
    }
}

/// Who an account is at its provider.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Identity {
    /// The provider's stable id of the account (`sub`, or `id`).
    pub(crate) subject: Option<String>,
    /// Its e-mail address.
    pub(crate) email: Option<String>,
}

/// Why an endpoint call failed. Never carries a token or a response body.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum UpstreamError {
    /// The provider refused the grant (`invalid_grant`: a used or expired code, a revoked refresh token):
    /// final for this code or token.
    #[error("the provider refused the grant ({0})")]
    InvalidGrant(String),
    /// Anything else: network, timeout, another status, an unreadable answer.
    #[error("{0}")]
    Failed(String),
}

fn short(code: &str) -> String {
    code.chars()
        .filter(|c| c.is_ascii_graphic())
        .take(MAX_ERROR_CODE_CHARS)
        .collect()
}

/// A bounded read of the body.
async fn body(response: reqwest::Response) -> Result<Vec<u8>, UpstreamError> {
    let mut out = Vec::new();
    let mut stream = response.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| UpstreamError::Failed(format!("reading the answer: {}", kind(&e))))?;
        if out.len() + chunk.len() > MAX_BODY_BYTES {
            return Err(UpstreamError::Failed(format!(
                "the answer is larger than {MAX_BODY_BYTES} bytes"
            )));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

/// What went wrong with a request, without its URL (which the operator configured, but errors reach plugins).
fn kind(e: &reqwest::Error) -> &'static str {
    if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "could not connect"
    } else if e.is_decode() || e.is_body() {
        "unreadable answer"
    } else {
        "request failed"
    }
}

fn string(v: &Value, key: &str) -> Option<String> {
    match v.get(key)? {
        Value::String(s) if !s.is_empty() => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// Calls the token endpoint with `form` (the grant's own fields), the client's authentication added.
async fn token_request(
    http: &reqwest::Client,
    provider: &Provider,
    mut form: Vec<(&'static str, String)>,
    timeout: Duration,
) -> Result<Grant, UpstreamError> {
    let mut request = http
        .post(provider.token_url.clone())
        .timeout(timeout)
        .header(ACCEPT, HeaderValue::from_static("application/json"));
    match (&provider.secret, provider.client_auth) {
        (Some(secret), ClientAuth::Basic) => {
            request = request.basic_auth(&provider.client_id, Some(secret.0.as_str()));
        }
        (Some(secret), ClientAuth::Post) => {
            form.push(("client_id", provider.client_id.clone()));
            form.push(("client_secret", secret.0.as_str().to_owned()));
        }
        (None, _) => form.push(("client_id", provider.client_id.clone())),
    }
    let response = request
        .form(&form)
        .send()
        .await
        .map_err(|e| UpstreamError::Failed(format!("token endpoint: {}", kind(&e))))?;
    // The form held the secret and the grant's code or refresh token.
    for (_, v) in &mut form {
        zeroize::Zeroize::zeroize(v);
    }
    let status = response.status();
    let bytes = Zeroizing::new(body(response).await?);
    let json: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    if !status.is_success() {
        let error = string(&json, "error").map(|e| short(&e));
        return Err(match error.as_deref() {
            Some("invalid_grant") => UpstreamError::InvalidGrant("invalid_grant".into()),
            Some(code) => UpstreamError::Failed(format!("token endpoint: HTTP {} ({code})", status.as_u16())),
            None => UpstreamError::Failed(format!("token endpoint: HTTP {}", status.as_u16())),
        });
    }
    let Some(access_token) = string(&json, "access_token") else {
        return Err(UpstreamError::Failed(
            "token endpoint: the answer has no access_token".into(),
        ));
    };
    if let Some(t) = string(&json, "token_type")
        && !t.eq_ignore_ascii_case("bearer")
    {
        return Err(UpstreamError::Failed(format!(
            "token endpoint: token_type {} is not bearer",
            short(&t)
        )));
    }
    Ok(Grant {
        access_token: Zeroizing::new(access_token),
        refresh_token: string(&json, "refresh_token").map(Zeroizing::new),
        expires_in: json.get("expires_in").and_then(|v| match v {
            Value::Number(n) => n.as_u64(),
            Value::String(s) => s.parse().ok(),
            _ => None,
        }),
        scope: string(&json, "scope"),
        id_token: string(&json, "id_token"),
    })
}

/// The authorization-code exchange (RFC 6749 §4.1.3, RFC 7636 §4.5).
pub(crate) async fn exchange_code(
    http: &reqwest::Client,
    provider: &Provider,
    code: &str,
    verifier: &str,
    redirect_uri: &str,
    timeout: Duration,
) -> Result<Grant, UpstreamError> {
    let form = vec![
        ("grant_type", "authorization_code".to_owned()),
        ("code", code.to_owned()),
        ("redirect_uri", redirect_uri.to_owned()),
        ("code_verifier", verifier.to_owned()),
    ];
    token_request(http, provider, form, timeout).await
}

/// A refresh (RFC 6749 §6).
pub(crate) async fn refresh(
    http: &reqwest::Client,
    provider: &Provider,
    refresh_token: &str,
    timeout: Duration,
) -> Result<Grant, UpstreamError> {
    let form = vec![
        ("grant_type", "refresh_token".to_owned()),
        ("refresh_token", refresh_token.to_owned()),
    ];
    token_request(http, provider, form, timeout).await
}

/// The account's identity: `userinfo_url` with the access token, else the claims of `id_token` (taken from
/// the token endpoint itself over its own connection, so read without a signature check: OpenID Connect Core
/// §3.1.3.7), else none.
pub(crate) async fn identity(
    http: &reqwest::Client,
    provider: &Provider,
    grant: &Grant,
    timeout: Duration,
) -> Result<Identity, UpstreamError> {
    let claims = match (&provider.userinfo_url, &grant.id_token) {
        (Some(url), _) => {
            let response = http
                .get(url.clone())
                .timeout(timeout)
                .bearer_auth(grant.access_token.as_str())
                .header(ACCEPT, HeaderValue::from_static("application/json"))
                .send()
                .await
                .map_err(|e| UpstreamError::Failed(format!("userinfo endpoint: {}", kind(&e))))?;
            let status = response.status();
            if !status.is_success() {
                return Err(UpstreamError::Failed(format!(
                    "userinfo endpoint: HTTP {}",
                    status.as_u16()
                )));
            }
            serde_json::from_slice(&body(response).await?)
                .map_err(|_| UpstreamError::Failed("userinfo endpoint: the answer is not JSON".into()))?
        }
        (None, Some(id_token)) => id_token
            .split('.')
            .nth(1)
            .and_then(|payload| B64URL.decode(payload.trim_end_matches('=')).ok())
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
            .unwrap_or(Value::Null),
        (None, None) => Value::Null,
    };
    Ok(Identity {
        subject: string(&claims, "sub").or_else(|| string(&claims, "id")),
        email: string(&claims, "email"),
    })
}
