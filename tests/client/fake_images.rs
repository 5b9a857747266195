//! A fake OpenAI-compatible images API for the `image/*` host services: `POST /v1/images/generations` (JSON)
//! and `POST /v1/images/edits` (multipart) on 127.0.0.1 (an ephemeral port), and `GET /v1/files/{name}` for
//! the images it answers by URL. It records every request (path, `Authorization`, the JSON body or the
//! multipart fields and file parts) and every image it returned, and answers with PNGs of the requested size
//! (a valid PNG header and a per-image marker chunk), an error status, a body that is not an image, or never
//! (until the test drops it: the upstream that does not answer, for the host's timeouts).

use std::sync::{Arc, Mutex};

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use fleet_proto::util::lock;
use serde_json::{Value, json};

/// The generations path.
pub const GENERATIONS: &str = "/v1/images/generations";
/// The edits path.
pub const EDITS: &str = "/v1/images/edits";

/// One multipart part of an edit request.
#[derive(Debug, Clone)]
pub struct Part {
    /// The field name (`image`, `image[]`, `mask`, `prompt`, …).
    pub name: String,
    /// The file name, for file parts.
    pub filename: Option<String>,
    /// The part's `Content-Type`, for file parts.
    pub content_type: Option<String>,
    /// The bytes.
    pub bytes: Vec<u8>,
}

/// One recorded request.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// [`GENERATIONS`] or [`EDITS`].
    pub path: String,
    /// The `Authorization` header, if any.
    pub authorization: Option<String>,
    /// The JSON body (generations), or the text fields (edits) as a JSON object.
    pub body: Value,
    /// The multipart parts (edits).
    pub parts: Vec<Part>,
}

/// How the fake answers.
#[derive(Debug, Clone, Default)]
pub enum Answer {
    /// `data[].b64_json` PNGs.
    #[default]
    B64,
    /// `data[].url` on the fake itself.
    Url,
    /// `data[].b64_json` of bytes that are not an image.
    NotAnImage,
    /// This status with an OpenAI-style error body carrying this `error.code`.
    Error(u16, String),
    /// Never (the request stays open until the fake is dropped).
    Hang,
}

#[derive(Debug, Default)]
struct Shared {
    requests: Mutex<Vec<Recorded>>,
    answer: Mutex<Answer>,
    /// Every image returned, in order.
    returned: Mutex<Vec<Vec<u8>>>,
    /// Images served by URL: name → bytes.
    files: Mutex<Vec<(String, Vec<u8>)>>,
    /// `http://127.0.0.1:<port>`.
    origin: Mutex<String>,
}

/// The running fake (stopped on drop).
#[derive(Debug)]
pub struct FakeImages {
    addr: std::net::SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl FakeImages {
    /// Binds 127.0.0.1:0 and serves.
    pub async fn start() -> FakeImages {
        let shared = Arc::new(Shared::default());
        let app = Router::new()
            .route(GENERATIONS, post(generations))
            .route(EDITS, post(edits))
            .route("/v1/files/{name}", get(file))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the fake images API");
        let addr = listener.local_addr().expect("local addr");
        *lock(&shared.origin) = format!("http://{addr}");
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        FakeImages { addr, shared, task }
    }

    /// The base URL to configure (`http://127.0.0.1:<port>/v1`).
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Answers this way from now on.
    pub fn answer(&self, answer: Answer) {
        *lock(&self.shared.answer) = answer;
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<Recorded> {
        lock(&self.shared.requests).clone()
    }

    /// Every image returned so far, in order.
    pub fn returned(&self) -> Vec<Vec<u8>> {
        lock(&self.shared.returned).clone()
    }
}

impl Drop for FakeImages {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// CRC-32 (IEEE) of PNG chunks.
fn crc32(parts: &[&[u8]]) -> u32 {
    let mut crc = 0xFFFF_FFFF_u32;
    for b in parts.iter().flat_map(|p| p.iter()) {
        crc ^= u32::from(*b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend_from_slice(&u32::try_from(data.len()).unwrap_or(0).to_be_bytes());
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    out.extend_from_slice(&crc32(&[kind, data]).to_be_bytes());
}

/// A PNG of `width`×`height` (its header; no pixel data) with a `tEXt` chunk carrying `marker`.
pub fn png(width: u32, height: u32, marker: &str) -> Vec<u8> {
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&width.to_be_bytes());
    ihdr.extend_from_slice(&height.to_be_bytes());
    ihdr.extend_from_slice(&[8, 6, 0, 0, 0]);
    chunk(&mut out, b"IHDR", &ihdr);
    chunk(&mut out, b"tEXt", format!("Comment\0{marker}").as_bytes());
    chunk(&mut out, b"IEND", b"");
    out
}

fn size_of(body: &Value) -> (u32, u32) {
    body.get("size")
        .and_then(Value::as_str)
        .and_then(|s| s.split_once('x'))
        .and_then(|(w, h)| Some((w.parse().ok()?, h.parse().ok()?)))
        .unwrap_or((1024, 1024))
}

/// Records the request; answers with `n` images of the body's size, or as configured.
async fn answer(shared: &Shared, recorded: Recorded) -> Response {
    let n = recorded
        .body
        .get("n")
        .and_then(|v| v.as_u64().or_else(|| v.as_str()?.parse().ok()))
        .unwrap_or(1);
    let (w, h) = size_of(&recorded.body);
    lock(&shared.requests).push(recorded);
    let mode = lock(&shared.answer).clone();
    let mut data = Vec::new();
    for _ in 0..n {
        let marker = format!("image {}", lock(&shared.returned).len());
        let bytes = match &mode {
            Answer::NotAnImage => b"this is not an image".to_vec(),
            _ => png(w, h, &marker),
        };
        lock(&shared.returned).push(bytes.clone());
        use base64::Engine as _;
        let b64 = base64::engine::general_purpose::STANDARD.encode(&bytes);
        match &mode {
            Answer::Url => {
                let name = format!("img-{}.png", lock(&shared.files).len());
                lock(&shared.files).push((name.clone(), bytes));
                let origin = lock(&shared.origin).clone();
                data.push(json!({"url": format!("{origin}/v1/files/{name}")}));
            }
            _ => data.push(json!({"b64_json": b64})),
        }
    }
    match mode {
        Answer::Error(status, code) => {
            let status = StatusCode::from_u16(status).expect("status");
            let body = json!({"error": {"message": "fake failure: your prompt 'secret prompt' (sk-should-never-leak)",
                "type": "invalid_request_error", "code": code}});
            (status, Json(body)).into_response()
        }
        Answer::Hang => std::future::pending().await,
        _ => Json(json!({"created": 0, "data": data})).into_response(),
    }
}

fn authorization(headers: &HeaderMap) -> Option<String> {
    headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

async fn generations(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let recorded = Recorded {
        path: GENERATIONS.into(),
        authorization: authorization(&headers),
        body,
        parts: Vec::new(),
    };
    answer(&shared, recorded).await
}

/// Splits a multipart body (the fake trusts its client: no streaming, no nested parts).
fn parse_multipart(content_type: &str, body: &[u8]) -> Vec<Part> {
    let Some(boundary) = content_type.split("boundary=").nth(1) else {
        return Vec::new();
    };
    let delimiter = format!("--{boundary}");
    let mut parts = Vec::new();
    let mut rest = body;
    while let Some(start) = find(rest, delimiter.as_bytes()) {
        rest = &rest[start + delimiter.len()..];
        if rest.starts_with(b"--") {
            break;
        }
        let rest_after_crlf = rest.strip_prefix(b"\r\n").unwrap_or(rest);
        let Some(head_end) = find(rest_after_crlf, b"\r\n\r\n") else {
            break;
        };
        let head = String::from_utf8_lossy(&rest_after_crlf[..head_end]).to_string();
        let content = &rest_after_crlf[head_end + 4..];
        let Some(end) = find(content, format!("\r\n{delimiter}").as_bytes()) else {
            break;
        };
        let quoted = |key: &str| {
            head.split(&format!("{key}=\""))
                .nth(1)
                .and_then(|s| s.split('"').next())
                .map(str::to_owned)
        };
        let content_type = head
            .lines()
            .find_map(|l| l.strip_prefix("Content-Type: "))
            .map(str::to_owned);
        parts.push(Part {
            name: quoted("name").unwrap_or_default(),
            filename: quoted("filename"),
            content_type,
            bytes: content[..end].to_vec(),
        });
        rest = &content[end + 2..];
    }
    parts
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

async fn edits(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    let content_type = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let parts = parse_multipart(&content_type, &body);
    let mut fields = serde_json::Map::new();
    for p in parts.iter().filter(|p| p.filename.is_none()) {
        fields.insert(p.name.clone(), json!(String::from_utf8_lossy(&p.bytes)));
    }
    let recorded = Recorded {
        path: EDITS.into(),
        authorization: authorization(&headers),
        body: Value::Object(fields),
        parts,
    };
    answer(&shared, recorded).await
}

async fn file(State(shared): State<Arc<Shared>>, Path(name): Path<String>) -> Response {
    let found = lock(&shared.files)
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, b)| b.clone());
    match found {
        Some(bytes) => ([("content-type", "image/png")], bytes).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}
