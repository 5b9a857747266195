//! The user's own routes: their plugin credentials and their OAuth accounts, authenticated by the user's API
//! token — the JWT `tools.*` calls present (`Authorization: Bearer`, audience `cloud-agents`), never a window or
//! operator token. The user is the token's `sub` and nothing else: no route takes a user in its path, query or
//! body (an unknown query parameter or body field is refused), so a user can only ever read or change their own
//! records. Every request passes the per-user rate limit of the API ([`Front::admit`]).
//!
//! | Route | What |
//! |---|---|
//! | `GET /v1/credentials[?tool_id=T]` | the user's credentials: names, scopes, when set — never values (with `tool_id`, those an invoke of T can receive) |
//! | `PUT /v1/credentials[?tool_id=T]` | body `{"values": {"NAME": "value", …}}`: stores them, user-wide or for T; answers the names now in that scope |
//! | `DELETE /v1/credentials/{name}[?tool_id=T]` | removes one from that scope; answers `{user, deleted}` |
//! | `GET /v1/oauth/providers` | the configured providers and the credential names each fills |
//! | `GET /v1/oauth/{provider}/accounts` | the user's accounts there, metadata only, the default first |
//! | `POST /v1/oauth/{provider}/accounts/{account_id}/default` | makes it the default |
//! | `DELETE /v1/oauth/{provider}/accounts/{account_id}` | removes it and its tokens |
//! | `GET /v1/oauth/{provider}/start[?label=L&default=true]` | begins the connect flow: a 302 to the provider (or, with `Accept: application/json`, `{authorize_url, expires_at_ms}`) and an `HttpOnly` cookie binding the flow to this browser |
//! | `GET /v1/oauth/{provider}/callback` | where the provider sends the browser back (`state`, `code`): no token, the flow's state and the browser's cookie instead; answers a short page (or JSON) |
//!
//! Errors are `{ok: false, error: {code, message}}` with 400 (`invalid_arg`), 401 (`invalid_token`), 403
//! (`permission_denied`: the callback from a browser that did not start the flow), 404 (`not_found`: an unknown
//! provider or account), 429 (`rate_limited`), 502 (the provider failed) or 500. No answer and no error carries
//! a credential value or a token.
//!
//! [`Front::admit`]: crate::front::Front::admit

use std::collections::{BTreeMap, HashMap};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{FromRequestParts, Path, Query, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use fleet_proto::admin::credentials::Listed;
use fleet_proto::api::{ApiError, ApiErrorCode};
use fleet_proto::executa::credentials::{Connected, ProviderAccounts, Started};
use fleet_services::FleetServices;
use fleet_services::oauth::OAuthError;
use fleet_services::oauth::flow::StateError;
use serde::Deserialize;
use serde::de::DeserializeOwned;

use super::{HttpState, status_of};

/// The cookie carrying a flow's browser binding: `fleet_oauth_<16 hex digits of the state's hash>`.
pub const COOKIE_PREFIX: &str = "fleet_oauth_";

/// What the user routes share.
#[derive(Clone)]
struct UserState {
    http: HttpState,
    services: FleetServices,
    /// `Secure` on the binding cookie (the fleet's public URL is https).
    secure: bool,
}

/// The user routes over `services` (its credentials store and OAuth service); the binding cookie is `Secure`
/// when the services' public URL is https.
pub fn router(http: HttpState, services: FleetServices) -> Router {
    let secure = services
        .oauth()
        .public_url()
        .is_some_and(|u| u.starts_with("https://"));
    let state = UserState {
        http,
        services,
        secure,
    };
    Router::new()
        .route("/v1/credentials", get(list_credentials).put(set_credentials))
        .route("/v1/credentials/{name}", delete(delete_credential))
        .route("/v1/oauth/providers", get(providers))
        .route("/v1/oauth/{provider}/accounts", get(accounts))
        .route(
            "/v1/oauth/{provider}/accounts/{account_id}/default",
            post(set_default),
        )
        .route(
            "/v1/oauth/{provider}/accounts/{account_id}",
            delete(remove_account),
        )
        .route("/v1/oauth/{provider}/start", get(start))
        .route("/v1/oauth/{provider}/callback", get(callback))
        .with_state(state)
}

/// The HTTP status of an error of these routes.
fn status(code: ApiErrorCode) -> StatusCode {
    match code {
        ApiErrorCode::NotFound => StatusCode::NOT_FOUND,
        other => status_of(other),
    }
}

fn reply(status: StatusCode, body: &impl serde::Serialize) -> Response {
    let mut response = (status, axum::Json(body)).into_response();
    no_store(response.headers_mut());
    response
}

fn no_store(headers: &mut HeaderMap) {
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
}

fn error(e: &ApiError) -> Response {
    reply(status(e.code), &serde_json::json!({ "ok": false, "error": e }))
}

fn ok(body: &impl serde::Serialize) -> Response {
    reply(StatusCode::OK, body)
}

/// The API error and HTTP status of an OAuth failure.
fn oauth_error(e: &OAuthError) -> (StatusCode, ApiError) {
    let (status, code) = match e {
        OAuthError::UnknownProvider(_) | OAuthError::UnknownAccount(_) | OAuthError::NoAccount(_) => {
            (StatusCode::NOT_FOUND, ApiErrorCode::NotFound)
        }
        OAuthError::Invalid(_)
        | OAuthError::TooManyAccounts
        | OAuthError::State(StateError::Unknown | StateError::WrongProvider) => {
            (StatusCode::BAD_REQUEST, ApiErrorCode::InvalidArg)
        }
        OAuthError::State(StateError::NotBound) | OAuthError::NotCovered(_) | OAuthError::NeedsReauth(_) => {
            (StatusCode::FORBIDDEN, ApiErrorCode::PermissionDenied)
        }
        OAuthError::Upstream(_) => (StatusCode::BAD_GATEWAY, ApiErrorCode::InternalError),
        OAuthError::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, ApiErrorCode::NotImplemented),
        OAuthError::State(StateError::Store(_)) | OAuthError::Store(_) => {
            (StatusCode::INTERNAL_SERVER_ERROR, ApiErrorCode::InternalError)
        }
    };
    (status, ApiError::new(code, e.to_string()))
}

fn oauth_response(e: &OAuthError) -> Response {
    let (status, e) = oauth_error(e);
    reply(status, &serde_json::json!({ "ok": false, "error": e }))
}

/// The user of the request's API token, admitted by the per-user rate limit.
fn user_of(state: &UserState, headers: &HeaderMap) -> Result<String, ApiError> {
    let Some(value) = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) else {
        return Err(ApiError::new(
            ApiErrorCode::InvalidToken,
            "missing Authorization header: present your API token (`Bearer <jwt>`)",
        ));
    };
    let principal = state.http.inner.api.verify(value).map_err(|e| e.to_api_error())?;
    state.http.inner.front.admit(&principal.user)?;
    Ok(principal.user)
}

/// The user whose API token the request presents ([`user_of`]), as an extractor: a request without a valid one is
/// answered with [`user_of`]'s error, and the route's handler never runs.
struct User(String);

impl FromRequestParts<UserState> for User {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &UserState) -> Result<Self, Response> {
        user_of(state, &parts.headers).map(User).map_err(|e| error(&e))
    }
}

/// The query string as `T`; an unknown or malformed parameter is `invalid_arg`.
fn query<T: DeserializeOwned>(uri: &Uri) -> Result<T, ApiError> {
    Query::<T>::try_from_uri(uri)
        .map(|q| q.0)
        .map_err(|e| ApiError::new(ApiErrorCode::InvalidArg, format!("bad query: {}", e.body_text())))
}

/// `?tool_id=T`, nothing else.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ToolQuery {
    #[serde(default)]
    tool_id: Option<String>,
}

/// `PUT /v1/credentials`'s body: the values, nothing else (no user: the token says whose they are).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SetBody {
    values: BTreeMap<String, String>,
}

async fn list_credentials(State(state): State<UserState>, uri: Uri, User(user): User) -> Response {
    let run = async {
        let q: ToolQuery = query(&uri)?;
        state
            .services
            .credential_store()
            .list(&user, q.tool_id.as_deref())
            .await
            .map_err(|e| e.to_api_error())
    };
    match run.await {
        Ok(listed) => ok(&listed),
        Err(e) => error(&e),
    }
}

async fn set_credentials(
    State(state): State<UserState>,
    uri: Uri,
    User(user): User,
    body: Bytes,
) -> Response {
    let run = async {
        let q: ToolQuery = query(&uri)?;
        // Refused by position, never by content (it is a secret).
        let body: SetBody = serde_json::from_slice(&body).map_err(|e| {
            ApiError::new(
                ApiErrorCode::InvalidArg,
                format!(
                    "the body must be {{\"values\": {{NAME: string}}}} and nothing else (line {} column {})",
                    e.line(),
                    e.column()
                ),
            )
        })?;
        let listed: Listed = state
            .services
            .credential_store()
            .set(&user, q.tool_id.as_deref(), &body.values)
            .await
            .map_err(|e| e.to_api_error())?;
        Ok::<_, ApiError>(listed)
    };
    match run.await {
        Ok(listed) => ok(&listed),
        Err(e) => error(&e),
    }
}

async fn delete_credential(
    State(state): State<UserState>,
    uri: Uri,
    Path(name): Path<String>,
    User(user): User,
) -> Response {
    let run = async {
        let q: ToolQuery = query(&uri)?;
        state
            .services
            .credential_store()
            .delete(&user, q.tool_id.as_deref(), &[name])
            .await
            .map_err(|e| e.to_api_error())
    };
    match run.await {
        Ok(deleted) => ok(&deleted),
        Err(e) => error(&e),
    }
}

async fn providers(State(state): State<UserState>, _: User) -> Response {
    ok(&state.services.oauth().providers())
}

fn provider_accounts(
    provider: String,
    result: Result<Vec<fleet_proto::executa::credentials::Account>, OAuthError>,
) -> Response {
    match result {
        Ok(accounts) => ok(&ProviderAccounts { provider, accounts }),
        Err(e) => oauth_response(&e),
    }
}

async fn accounts(
    State(state): State<UserState>,
    Path(provider): Path<String>,
    User(user): User,
) -> Response {
    let result = state.services.oauth().list(&user, &provider).await;
    provider_accounts(provider, result)
}

async fn set_default(
    State(state): State<UserState>,
    Path((provider, account_id)): Path<(String, String)>,
    User(user): User,
) -> Response {
    let result = state
        .services
        .oauth()
        .set_default(&user, &provider, &account_id)
        .await;
    provider_accounts(provider, result)
}

async fn remove_account(
    State(state): State<UserState>,
    Path((provider, account_id)): Path<(String, String)>,
    User(user): User,
) -> Response {
    let result = state.services.oauth().remove(&user, &provider, &account_id).await;
    provider_accounts(provider, result)
}

/// `?label=L&default=true`, nothing else.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StartQuery {
    #[serde(default)]
    label: Option<String>,
    #[serde(default)]
    default: bool,
}

fn wants_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("application/json"))
}

fn cookie(name: &str, value: &str, path: &str, max_age: u64, secure: bool) -> Option<HeaderValue> {
    let secure = if secure { "; Secure" } else { "" };
    HeaderValue::from_str(&format!(
        "{name}={value}; Path={path}; Max-Age={max_age}; HttpOnly; SameSite=Lax{secure}"
    ))
    .ok()
}

async fn start(
    State(state): State<UserState>,
    headers: HeaderMap,
    uri: Uri,
    Path(provider): Path<String>,
    User(user): User,
) -> Response {
    let q: StartQuery = match query(&uri) {
        Ok(q) => q,
        Err(e) => return error(&e),
    };
    let started = match state
        .services
        .oauth()
        .begin(&user, &provider, q.label, q.default)
        .await
    {
        Ok(s) => s,
        Err(e) => return oauth_response(&e),
    };
    let max_age = fleet_store::settings::OAUTH_STATE_TTL.as_secs();
    let set_cookie = cookie(
        &format!("{COOKIE_PREFIX}{}", started.cookie_suffix),
        &started.binding.0,
        &format!("/v1/oauth/{provider}/callback"),
        max_age,
        state.secure,
    );
    let mut response = if wants_json(&headers) {
        ok(&Started {
            authorize_url: started.authorize_url,
            expires_at_ms: started.expires_at_ms,
        })
    } else {
        let mut r = StatusCode::FOUND.into_response();
        match HeaderValue::from_str(&started.authorize_url) {
            Ok(location) => {
                r.headers_mut().insert(header::LOCATION, location);
            }
            Err(_) => {
                return error(&ApiError::new(
                    ApiErrorCode::InternalError,
                    "the authorization URL is not a valid header value",
                ));
            }
        }
        no_store(r.headers_mut());
        r
    };
    if let Some(c) = set_cookie {
        response.headers_mut().append(header::SET_COOKIE, c);
    }
    response
}

/// The value of the cookie `name` among the request's `Cookie` headers.
fn cookie_value<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The callback's page: no referrer (the URL carried the code), no caching, no script.
fn page(status: StatusCode, title: &str, text: &str) -> Response {
    let body = format!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>{0}</title></head>\
         <body><h1>{0}</h1><p>{1}</p></body></html>\n",
        escape(title),
        escape(text)
    );
    let mut r = (status, body).into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static("default-src 'none'"),
    );
    no_store(h);
    r
}

async fn callback(
    State(state): State<UserState>,
    headers: HeaderMap,
    Path(provider): Path<String>,
    Query(params): Query<HashMap<String, String>>,
) -> Response {
    let json = wants_json(&headers);
    let fail = |status: StatusCode, e: ApiError| {
        if json {
            reply(status, &serde_json::json!({ "ok": false, "error": e }))
        } else {
            page(status, "Not connected", &e.message)
        }
    };
    if let Some(refused) = params.get("error") {
        let code: String = refused.chars().filter(char::is_ascii_graphic).take(64).collect();
        return fail(
            StatusCode::BAD_REQUEST,
            ApiError::new(
                ApiErrorCode::PermissionDenied,
                format!("the provider did not authorize the account ({code})"),
            ),
        );
    }
    let (Some(flow_state), Some(code)) = (params.get("state"), params.get("code")) else {
        return fail(
            StatusCode::BAD_REQUEST,
            ApiError::new(ApiErrorCode::InvalidArg, "the callback needs state and code"),
        );
    };
    let cookie_name = format!(
        "{COOKIE_PREFIX}{}",
        fleet_services::oauth::cookie_suffix(flow_state)
    );
    let binding = cookie_value(&headers, &cookie_name);
    let result = state
        .services
        .oauth()
        .finish(&provider, flow_state, code, binding)
        .await;
    let mut response = match result {
        Ok((_, account)) => {
            if json {
                ok(&Connected {
                    provider: provider.clone(),
                    account,
                })
            } else {
                page(
                    StatusCode::OK,
                    "Connected",
                    &format!(
                        "Your {provider} account {} is connected. You can close this window.",
                        account.label
                    ),
                )
            }
        }
        Err(e) => {
            let (status, e) = oauth_error(&e);
            fail(status, e)
        }
    };
    // The flow is over either way for this browser's cookie (a refused state keeps the server-side record).
    if binding.is_some()
        && let Some(c) = cookie(
            &cookie_name,
            "",
            &format!("/v1/oauth/{provider}/callback"),
            0,
            state.secure,
        )
    {
        response.headers_mut().append(header::SET_COOKIE, c);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cookies_are_found_by_name_and_pages_escape() {
        let mut h = HeaderMap::new();
        h.append(
            header::COOKIE,
            HeaderValue::from_static("a=1; fleet_oauth_ab=xyz"),
        );
        h.append(header::COOKIE, HeaderValue::from_static("b=2"));
        assert_eq!(cookie_value(&h, "fleet_oauth_ab"), Some("xyz"));
        assert_eq!(cookie_value(&h, "b"), Some("2"));
        assert_eq!(cookie_value(&h, "fleet_oauth_cd"), None);
        assert_eq!(escape("<a href=\"x\">&"), "&lt;a href=&quot;x&quot;&gt;&amp;");
    }
}
