//! A fake OAuth 2.0 provider for the platform-credentials tests (spec §4.2, §8.8): `GET /authorize`,
//! `POST /token`, `GET /userinfo` on 127.0.0.1 (an ephemeral port). No real provider can exist here.
//!
//! It is strict where the fleet must be right: `/authorize` wants `response_type=code`, the registered
//! `client_id`, a `redirect_uri`, a `state` and a PKCE `S256` challenge; `/token` wants the client's HTTP Basic
//! credentials, and for `authorization_code` a code it issued, not used before, for the same `redirect_uri`,
//! whose `code_verifier` hashes to the challenge (RFC 7636) — a replayed code or a wrong verifier is
//! `invalid_grant`; a `refresh_token` it issued and did not revoke. The browser "logs in" as the identity the
//! test set ([`FakeOAuth::login_as`]). It records every token it issued (so the tests can look for them where
//! they must not be) and counts the grants it served.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{Form, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use base64::Engine as _;
use fleet_proto::util::lock;
use serde_json::json;
use sha2::Digest as _;

/// The client id the fake registers.
pub const CLIENT_ID: &str = "fleet-test-client";
/// The client secret the fake registers.
pub const CLIENT_SECRET: &str = "fake-oauth-client-secret-9c1e";

#[derive(Debug, Clone)]
struct Code {
    challenge: String,
    redirect_uri: String,
    subject: String,
    email: String,
    scope: String,
    used: bool,
}

#[derive(Debug, Clone)]
struct Refresh {
    subject: String,
    scope: String,
    revoked: bool,
}

#[derive(Debug)]
struct Shared {
    counter: AtomicU64,
    login: Mutex<(String, String)>,
    codes: Mutex<HashMap<String, Code>>,
    refresh: Mutex<HashMap<String, Refresh>>,
    /// Access token → (subject, email).
    access: Mutex<HashMap<String, (String, String)>>,
    expires_in: AtomicU64,
    rotate: std::sync::atomic::AtomicBool,
    /// Non-zero: `/token` refresh grants answer this status.
    refresh_status: AtomicU16,
    /// Every refresh grant waits this long (ms) before answering.
    refresh_delay_ms: AtomicU64,
    code_grants: AtomicU64,
    refresh_grants: AtomicU64,
    /// Code exchanges refused because the verifier did not match the challenge.
    pkce_refusals: AtomicU64,
    /// Code exchanges refused because the code was used before.
    replays: AtomicU64,
    /// Every token issued, access and refresh.
    issued_access: Mutex<Vec<String>>,
    issued_refresh: Mutex<Vec<String>>,
}

/// The running fake (stopped on drop).
#[derive(Debug)]
pub struct FakeOAuth {
    addr: std::net::SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeOAuth {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn oauth_error(status: StatusCode, error: &str) -> Response {
    (status, axum::Json(json!({"error": error}))).into_response()
}

async fn authorize(State(s): State<Arc<Shared>>, Query(q): Query<HashMap<String, String>>) -> Response {
    let get = |k: &str| q.get(k).cloned().unwrap_or_default();
    if get("response_type") != "code" || get("client_id") != CLIENT_ID {
        return oauth_error(StatusCode::BAD_REQUEST, "unauthorized_client");
    }
    if get("code_challenge_method") != "S256" || get("code_challenge").len() != 43 {
        return oauth_error(StatusCode::BAD_REQUEST, "invalid_request");
    }
    let (redirect_uri, state) = (get("redirect_uri"), get("state"));
    if redirect_uri.is_empty() || state.is_empty() {
        return oauth_error(StatusCode::BAD_REQUEST, "invalid_request");
    }
    let n = s.counter.fetch_add(1, Ordering::SeqCst);
    let code = format!("code-{n}-{:08x}", rand_u32(n));
    let (subject, email) = lock(&s.login).clone();
    lock(&s.codes).insert(
        code.clone(),
        Code {
            challenge: get("code_challenge"),
            redirect_uri: redirect_uri.clone(),
            subject,
            email,
            scope: get("scope"),
            used: false,
        },
    );
    let mut location = url::Url::parse(&redirect_uri).expect("redirect_uri");
    location
        .query_pairs_mut()
        .append_pair("code", &code)
        .append_pair("state", &state)
        .append_pair("scope", &get("scope"));
    (StatusCode::FOUND, [(header::LOCATION, location.to_string())]).into_response()
}

fn rand_u32(n: u64) -> u32 {
    let d = sha2::Sha256::digest(format!("{n}-{:?}", std::time::SystemTime::now()).as_bytes());
    u32::from_be_bytes([d[0], d[1], d[2], d[3]])
}

fn client_ok(headers: &HeaderMap) -> bool {
    let Some(v) = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let Some(b64) = v.strip_prefix("Basic ") else {
        return false;
    };
    let Ok(raw) = base64::engine::general_purpose::STANDARD.decode(b64) else {
        return false;
    };
    raw == format!("{CLIENT_ID}:{CLIENT_SECRET}").into_bytes()
}

impl Shared {
    fn issue(&self, subject: &str, email: &str, scope: &str, with_refresh: bool) -> serde_json::Value {
        let n = self.counter.fetch_add(1, Ordering::SeqCst);
        let access = format!("fake-at-{n}-{:08x}", rand_u32(n));
        lock(&self.access).insert(access.clone(), (subject.to_owned(), email.to_owned()));
        lock(&self.issued_access).push(access.clone());
        let mut body = json!({
            "access_token": access,
            "token_type": "Bearer",
            "expires_in": self.expires_in.load(Ordering::SeqCst),
            "scope": scope,
        });
        if with_refresh {
            let refresh = format!("fake-rt-{n}-{:08x}", rand_u32(n + 1_000_000));
            lock(&self.refresh).insert(
                refresh.clone(),
                Refresh {
                    subject: subject.to_owned(),
                    scope: scope.to_owned(),
                    revoked: false,
                },
            );
            lock(&self.issued_refresh).push(refresh.clone());
            body["refresh_token"] = json!(refresh);
        }
        body
    }
}

async fn token(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    Form(form): Form<HashMap<String, String>>,
) -> Response {
    if !client_ok(&headers) {
        return oauth_error(StatusCode::UNAUTHORIZED, "invalid_client");
    }
    let get = |k: &str| form.get(k).cloned().unwrap_or_default();
    match get("grant_type").as_str() {
        "authorization_code" => {
            s.code_grants.fetch_add(1, Ordering::SeqCst);
            let grant = {
                let mut codes = lock(&s.codes);
                let Some(c) = codes.get_mut(&get("code")) else {
                    return oauth_error(StatusCode::BAD_REQUEST, "invalid_grant");
                };
                if c.used {
                    s.replays.fetch_add(1, Ordering::SeqCst);
                    return oauth_error(StatusCode::BAD_REQUEST, "invalid_grant");
                }
                c.used = true;
                c.clone()
            };
            if grant.redirect_uri != get("redirect_uri") {
                return oauth_error(StatusCode::BAD_REQUEST, "invalid_grant");
            }
            let verifier = get("code_verifier");
            let challenge = base64::engine::general_purpose::URL_SAFE_NO_PAD
                .encode(sha2::Sha256::digest(verifier.as_bytes()));
            if verifier.len() < 43 || challenge != grant.challenge {
                s.pkce_refusals.fetch_add(1, Ordering::SeqCst);
                return oauth_error(StatusCode::BAD_REQUEST, "invalid_grant");
            }
            axum::Json(s.issue(&grant.subject, &grant.email, &grant.scope, true)).into_response()
        }
        "refresh_token" => {
            s.refresh_grants.fetch_add(1, Ordering::SeqCst);
            let delay = s.refresh_delay_ms.load(Ordering::SeqCst);
            if delay > 0 {
                tokio::time::sleep(Duration::from_millis(delay)).await;
            }
            let status = s.refresh_status.load(Ordering::SeqCst);
            if status != 0 {
                return oauth_error(
                    StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY),
                    "temporarily_unavailable",
                );
            }
            let presented = get("refresh_token");
            let current = {
                let mut refresh = lock(&s.refresh);
                let Some(r) = refresh.get_mut(&presented).filter(|r| !r.revoked) else {
                    return oauth_error(StatusCode::BAD_REQUEST, "invalid_grant");
                };
                let current = r.clone();
                if s.rotate.load(Ordering::SeqCst) {
                    r.revoked = true;
                }
                current
            };
            let email = lock(&s.access)
                .values()
                .find(|(sub, _)| *sub == current.subject)
                .map(|(_, e)| e.clone())
                .unwrap_or_default();
            let rotate = s.rotate.load(Ordering::SeqCst);
            axum::Json(s.issue(&current.subject, &email, &current.scope, rotate)).into_response()
        }
        _ => oauth_error(StatusCode::BAD_REQUEST, "unsupported_grant_type"),
    }
}

async fn userinfo(State(s): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or_default();
    match lock(&s.access).get(token) {
        Some((sub, email)) => axum::Json(json!({"sub": sub, "email": email})).into_response(),
        None => oauth_error(StatusCode::UNAUTHORIZED, "invalid_token"),
    }
}

impl FakeOAuth {
    /// Starts the fake; the browser logs in as `alice-sub` / `alice@example.com` until [`Self::login_as`].
    pub async fn start() -> FakeOAuth {
        let shared = Arc::new(Shared {
            counter: AtomicU64::new(1),
            login: Mutex::new(("alice-sub".into(), "alice@example.com".into())),
            codes: Mutex::default(),
            refresh: Mutex::default(),
            access: Mutex::default(),
            expires_in: AtomicU64::new(3600),
            rotate: std::sync::atomic::AtomicBool::new(false),
            refresh_status: AtomicU16::new(0),
            refresh_delay_ms: AtomicU64::new(0),
            code_grants: AtomicU64::new(0),
            refresh_grants: AtomicU64::new(0),
            pkce_refusals: AtomicU64::new(0),
            replays: AtomicU64::new(0),
            issued_access: Mutex::default(),
            issued_refresh: Mutex::default(),
        });
        let app = Router::new()
            .route("/authorize", get(authorize))
            .route("/token", post(token))
            .route("/userinfo", get(userinfo))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the fake OAuth provider");
        let addr = listener.local_addr().expect("addr");
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        FakeOAuth { addr, shared, task }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn origin(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The `[credentials.providers.<name>]` TOML table for this fake, mapping `credentials`, with the client
    /// secret in `secret_file` (written here).
    pub fn provider_toml(&self, name: &str, secret_file: &std::path::Path, credentials: &[&str]) -> String {
        std::fs::write(secret_file, format!("{CLIENT_SECRET}\n")).expect("write the client secret");
        let mapping: Vec<String> = credentials
            .iter()
            .map(|c| format!("{c} = \"$access_token\""))
            .collect();
        format!(
            "[credentials.providers.{name}]\nauthorize_url = \"{o}/authorize\"\ntoken_url = \"{o}/token\"\n\
             userinfo_url = \"{o}/userinfo\"\nclient_id = \"{CLIENT_ID}\"\nclient_secret_file = \"{}\"\n\
             scopes = [\"openid\", \"email\", \"mail.read\"]\ncredential_mapping = {{ {} }}\n",
            secret_file.display(),
            mapping.join(", "),
            o = self.origin(),
        )
    }

    /// The next authorizations log in as this identity.
    pub fn login_as(&self, subject: &str, email: &str) {
        *lock(&self.shared.login) = (subject.into(), email.into());
    }

    /// Access tokens issued from now on live this many seconds.
    pub fn set_expires_in(&self, secs: u64) {
        self.shared.expires_in.store(secs, Ordering::SeqCst);
    }

    /// Refreshes rotate the refresh token (the old one stops working).
    pub fn set_rotate(&self, rotate: bool) {
        self.shared.rotate.store(rotate, Ordering::SeqCst);
    }

    /// Refresh grants answer `status` (0: normally).
    pub fn fail_refreshes_with(&self, status: u16) {
        self.shared.refresh_status.store(status, Ordering::SeqCst);
    }

    /// Every refresh grant waits this long first.
    pub fn delay_refreshes(&self, delay: Duration) {
        self.shared.refresh_delay_ms.store(
            u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
            Ordering::SeqCst,
        );
    }

    /// Revokes every refresh token issued so far (the user revoked the grant at the provider).
    pub fn revoke_refresh_tokens(&self) {
        for r in lock(&self.shared.refresh).values_mut() {
            r.revoked = true;
        }
    }

    /// Code exchanges served (refused ones included).
    pub fn code_grants(&self) -> u64 {
        self.shared.code_grants.load(Ordering::SeqCst)
    }

    /// Refresh grants served (refused ones included).
    pub fn refresh_grants(&self) -> u64 {
        self.shared.refresh_grants.load(Ordering::SeqCst)
    }

    /// Code exchanges refused for a verifier that does not match the challenge.
    pub fn pkce_refusals(&self) -> u64 {
        self.shared.pkce_refusals.load(Ordering::SeqCst)
    }

    /// Code exchanges refused because the code had been used.
    pub fn replays(&self) -> u64 {
        self.shared.replays.load(Ordering::SeqCst)
    }

    /// Every access token issued, oldest first.
    pub fn issued_access_tokens(&self) -> Vec<String> {
        lock(&self.shared.issued_access).clone()
    }

    /// Every refresh token issued, oldest first.
    pub fn issued_refresh_tokens(&self) -> Vec<String> {
        lock(&self.shared.issued_refresh).clone()
    }

    /// Exchanges a code directly (as an attacker holding a code but not the verifier would).
    pub async fn exchange_directly(&self, code: &str, redirect_uri: &str, verifier: &str) -> (u16, String) {
        raw_token_post(self.addr, code, redirect_uri, verifier).await
    }
}

/// A raw HTTP/1.0 `POST /token` (the client crate has no HTTP client dependency).
async fn raw_token_post(
    addr: std::net::SocketAddr,
    code: &str,
    redirect_uri: &str,
    verifier: &str,
) -> (u16, String) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let body: String = url::form_urlencoded::Serializer::new(String::new())
        .append_pair("grant_type", "authorization_code")
        .append_pair("code", code)
        .append_pair("redirect_uri", redirect_uri)
        .append_pair("code_verifier", verifier)
        .finish();
    let auth = base64::engine::general_purpose::STANDARD.encode(format!("{CLIENT_ID}:{CLIENT_SECRET}"));
    let request = format!(
        "POST /token HTTP/1.0\r\nHost: {addr}\r\nAuthorization: Basic {auth}\r\n\
         Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut out = String::new();
    stream.read_to_string(&mut out).await.expect("read");
    let status = out
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = out.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned();
    (status, body)
}
