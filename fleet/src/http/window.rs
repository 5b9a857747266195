//! Window tokens: the JWT an app window presents to the HTTP gateway (spec §10.1 "Auth").
//!
//! Claims: `aud` = [`WINDOW_AUDIENCE`], `iss` = the API issuer, `sub` = the user, `wid` = the window uuid, `app` =
//! the app id, `ver` = the app version id, `exp` (TTL [`WINDOW_TOKEN_TTL`] when minted here), and optionally
//! `tools`, the app's `host_api.tools` allow-list (an array of patterns, see [`entry_admits`]). Verified with the
//! API's keys (algorithms pinned per key) by a separate [`Verifier`] whose audience is [`WINDOW_AUDIENCE`].

use std::path::Path;
use std::time::Duration;

use fleet_proto::api::{ApiError, ApiErrorCode};
#[cfg(doc)]
use fleet_proto::app_manifest::entry_admits;
use fleet_proto::app_manifest::list_admits;
use serde_json::{Map, Value, json};

use fleet_client::auth::{AuthError, DEFAULT_ISSUER, DevKey, Principal, SigningKey, Verifier};

/// The audience of window tokens.
pub const WINDOW_AUDIENCE: &str = "anna-app-window";
/// The lifetime of a window token minted by `fleet token --window`.
pub const WINDOW_TOKEN_TTL: Duration = Duration::from_secs(120);
/// Longest accepted `wid`, `app`, `ver`.
const MAX_ID_LEN: usize = 256;
/// Most allow-list entries accepted in `tools`.
const MAX_TOOLS: usize = 256;

/// A verified window token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WindowClaims {
    /// The user (`sub`).
    pub user: String,
    /// The window uuid (`wid`).
    pub window: String,
    /// The app id (`app`).
    pub app: String,
    /// The app version id (`ver`).
    pub version: String,
    /// The `host_api.tools` allow-list; `None` (claim absent) or empty: every tool.
    pub tools: Option<Vec<String>>,
    /// `exp`, Unix seconds.
    pub expires_at: u64,
}

impl WindowClaims {
    /// Whether the allow-list lets this window use the plugin `tool_id` ([`list_admits`]).
    pub fn allows(&self, tool_id: &str) -> bool {
        list_admits(self.tools.as_deref(), tool_id)
    }
}

/// The window verifier: the API verifier's keys and issuer, audience [`WINDOW_AUDIENCE`].
pub fn window_verifier(api: &Verifier) -> Result<Verifier, AuthError> {
    api.for_audience(WINDOW_AUDIENCE)
}

/// Verifies an `Authorization` value (or a bare token) as a window token. Every failure is `invalid_token`.
pub fn verify_window(verifier: &Verifier, header_value: &str) -> Result<WindowClaims, ApiError> {
    let (principal, claims) = verifier
        .verify_with_claims(header_value)
        .map_err(|e| e.to_api_error())?;
    claims_of(principal, &claims)
}

fn invalid_claim(claim: &str) -> ApiError {
    ApiError::with_details(
        ApiErrorCode::InvalidToken,
        format!("the window token's `{claim}` claim is missing or invalid"),
        json!({ "reason": "invalid_claim", "claim": claim }),
    )
}

fn id_claim(claims: &Map<String, Value>, name: &str) -> Result<String, ApiError> {
    match claims.get(name) {
        Some(Value::String(s))
            if !s.is_empty() && s.len() <= MAX_ID_LEN && !s.chars().any(char::is_control) =>
        {
            Ok(s.clone())
        }
        _ => Err(invalid_claim(name)),
    }
}

fn claims_of(principal: Principal, claims: &Map<String, Value>) -> Result<WindowClaims, ApiError> {
    let tools = match claims.get("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(items)) if items.len() <= MAX_TOOLS => Some(
            items
                .iter()
                .map(|v| {
                    v.as_str()
                        .map(str::to_owned)
                        .ok_or_else(|| invalid_claim("tools"))
                })
                .collect::<Result<Vec<_>, _>>()?,
        ),
        Some(_) => return Err(invalid_claim("tools")),
    };
    Ok(WindowClaims {
        window: id_claim(claims, "wid")?,
        app: id_claim(claims, "app")?,
        version: id_claim(claims, "ver")?,
        tools,
        user: principal.user,
        expires_at: principal.expires_at,
    })
}

/// What a window token is minted for.
#[derive(Debug, Clone)]
pub struct WindowToken<'a> {
    /// The user (`sub`).
    pub user: &'a str,
    /// The window uuid (`wid`).
    pub window: &'a str,
    /// The app id (`app`).
    pub app: &'a str,
    /// The version id (`ver`).
    pub version: &'a str,
    /// The allow-list (`tools`), if any.
    pub tools: Option<&'a [String]>,
    /// Lifetime.
    pub ttl: Duration,
}

impl WindowToken<'_> {
    /// Mints the token with `key` (issuer [`DEFAULT_ISSUER`] unless `issuer` says otherwise).
    pub fn mint(&self, key: &SigningKey, issuer: Option<&str>) -> Result<String, AuthError> {
        for (name, v) in [("wid", self.window), ("app", self.app), ("ver", self.version)] {
            if v.is_empty() || v.len() > MAX_ID_LEN || v.chars().any(char::is_control) {
                return Err(AuthError::Mint(format!(
                    "`{name}` must be 1 to {MAX_ID_LEN} bytes without control characters"
                )));
            }
        }
        let mut extra = Map::new();
        extra.insert("wid".into(), Value::from(self.window));
        extra.insert("app".into(), Value::from(self.app));
        extra.insert("ver".into(), Value::from(self.version));
        if let Some(tools) = self.tools {
            extra.insert("tools".into(), json!(tools));
        }
        key.mint_with_claims(
            self.user,
            issuer.unwrap_or(DEFAULT_ISSUER),
            WINDOW_AUDIENCE,
            self.ttl,
            extra,
        )
    }

    /// Mints the token with the dev key of `fleet up`'s data dir.
    pub fn mint_dev(&self, data_dir: &Path) -> Result<String, ApiError> {
        let key = DevKey::load(data_dir).map_err(|e| e.to_api_error())?;
        self.mint(&key, None).map_err(|e| e.to_api_error())
    }
}
