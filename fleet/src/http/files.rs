//! The signed links of host files and uploads ([`fleet_services::files`]):
//!
//! | Route | What |
//! |---|---|
//! | `GET /v1/files/{bucket}/{object}?exp&d&fn&sig` | streams the object; `Content-Type` as stored, `Content-Disposition: <d>; filename=…` |
//! | `PUT /v1/files/{bucket}/{object}?exp&ct&n&sig` | stores the body (at most `n` bytes, `Content-Type` must be the media type `ct`) |
//!
//! User content cannot script the origin that serves it: the stored type is parsed again by
//! [`MediaType::parse`] and served as that value (one that does not parse, from an object stored before types
//! were validated, is served as `application/octet-stream`); the disposition is `inline` only when the link was
//! signed `inline` **and** the served type is one a browser does not run ([`MediaType::disposition`]); and every
//! response of these routes carries `Content-Security-Policy: sandbox; default-src 'none'` and
//! `X-Content-Type-Options: nosniff` ([`USER_CONTENT_CSP`]).
//!
//! A link whose signature does not verify is `403`; an expired one is `410`; an object that is not there is
//! `404`; a PUT whose `Content-Type` is not the signed media type (compared after both are normalised) is
//! `400`; a body over the signed size is `413`. Bodies are streamed both ways (the object store reads and writes
//! in chunks), so memory does not grow with the object.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use async_nats::jetstream::object_store;
use axum::Router;
use axum::body::{Body, BodyDataStream};
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::map_response;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bytes::{Bytes, BytesMut};
use futures::Stream;
use tokio::io::{AsyncRead, AsyncReadExt as _, ReadBuf};

use fleet_services::files::{Bucket, HostObjects, LinkError, META_CONTENT_TYPE};
use fleet_services::media_type::{Disposition, MediaType, OCTET_STREAM};

/// Bytes read from the object store per response chunk.
const CHUNK: usize = 64 * 1024;

/// The `Content-Security-Policy` of every response of these routes: a document served from a link runs no
/// script, loads nothing and has an origin of its own, whatever its type.
pub const USER_CONTENT_CSP: &str = "sandbox; default-src 'none'";

/// The routes, with their own state (merge into the gateway's router).
pub fn router(objects: HostObjects) -> Router {
    Router::new()
        .route("/v1/files/{bucket}/{object}", get(download).put(upload))
        .layer(map_response(user_content_headers))
        .with_state(objects)
}

/// Adds [`USER_CONTENT_CSP`] and `X-Content-Type-Options: nosniff` to a response.
async fn user_content_headers(mut response: Response) -> Response {
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(USER_CONTENT_CSP),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    response
}

/// Serves only these routes on `listener` (tests, or a process that serves nothing else).
pub async fn serve(listener: tokio::net::TcpListener, objects: HostObjects) -> std::io::Result<()> {
    let limits = super::listener::ListenerLimits::default();
    super::listener::serve(listener, router(objects), limits, std::future::pending()).await
}

/// The query of a GET link.
#[derive(Debug, serde::Deserialize)]
pub struct GetQuery {
    exp: u64,
    d: String,
    #[serde(rename = "fn")]
    filename: String,
    sig: String,
}

/// The query of a PUT link.
#[derive(Debug, serde::Deserialize)]
pub struct PutQuery {
    exp: u64,
    ct: String,
    n: u64,
    sig: String,
}

fn plain(status: StatusCode, message: impl Into<String>) -> Response {
    let mut body = message.into();
    body.push('\n');
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        body,
    )
        .into_response()
}

fn refused(e: &LinkError) -> Response {
    match e {
        LinkError::BadSignature | LinkError::Malformed(_) => {
            plain(StatusCode::FORBIDDEN, format!("forbidden: {e}"))
        }
        LinkError::Expired(_) => plain(StatusCode::GONE, format!("gone: {e}; ask for a fresh link")),
    }
}

/// `attachment; filename="a.txt"; filename*=UTF-8''a.txt`.
fn content_disposition(disposition: Disposition, filename: &str) -> HeaderValue {
    let ascii: String = filename
        .chars()
        .map(|c| {
            if c.is_ascii_graphic() && c != '"' && c != '\\' || c == ' ' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let mut encoded = String::new();
    for b in filename.bytes() {
        if b.is_ascii_alphanumeric() || b"!#$&+-.^_`|~".contains(&b) {
            encoded.push(char::from(b));
        } else {
            encoded.push_str(&format!("%{b:02X}"));
        }
    }
    let d = disposition.as_str();
    HeaderValue::from_str(&format!("{d}; filename=\"{ascii}\"; filename*=UTF-8''{encoded}"))
        .unwrap_or_else(|_| HeaderValue::from_static("attachment"))
}

async fn download(
    State(objects): State<HostObjects>,
    Path((bucket, object)): Path<(String, String)>,
    query: Result<Query<GetQuery>, QueryRejection>,
) -> Response {
    let Ok(Query(q)) = query else {
        return plain(
            StatusCode::FORBIDDEN,
            "forbidden: not a signed link (exp, d, fn, sig required)",
        );
    };
    let link = match objects.verify_get(&bucket, &object, q.exp, &q.d, &q.filename, &q.sig) {
        Ok(l) => l,
        Err(e) => return refused(&e),
    };
    let obj = match objects.store(link.bucket).get(&link.object).await {
        Ok(o) => o,
        Err(e) if e.kind() == object_store::GetErrorKind::NotFound => {
            return plain(StatusCode::NOT_FOUND, "not found: the object no longer exists");
        }
        Err(e) => return plain(StatusCode::BAD_GATEWAY, format!("object store: {e}")),
    };
    let info = obj.info().clone();
    let media = MediaType::parse_or_octet_stream(info.metadata.get(META_CONTENT_TYPE).map(String::as_str));
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_str(media.as_str()).unwrap_or_else(|_| HeaderValue::from_static(OCTET_STREAM)),
    );
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(info.size as u64));
    headers.insert(
        header::CONTENT_DISPOSITION,
        content_disposition(link.disposition.narrowest(media.disposition()), &link.filename),
    );
    headers.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("private, no-store"),
    );
    let stream = futures::stream::unfold(Some(obj), |state| async move {
        let mut obj = state?;
        let mut buf = BytesMut::with_capacity(CHUNK);
        match obj.read_buf(&mut buf).await {
            Ok(0) => None,
            Ok(_) => Some((Ok::<Bytes, std::io::Error>(buf.freeze()), Some(obj))),
            Err(e) => Some((Err(e), None)),
        }
    });
    (StatusCode::OK, headers, Body::from_stream(stream)).into_response()
}

/// The request body as an [`AsyncRead`] that fails once more than `cap` bytes arrive.
struct CappedBody {
    stream: BodyDataStream,
    chunk: Bytes,
    seen: u64,
    cap: u64,
    over: Arc<AtomicBool>,
}

impl AsyncRead for CappedBody {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        loop {
            if !self.chunk.is_empty() {
                let n = self.chunk.len().min(buf.remaining());
                let part = self.chunk.split_to(n);
                buf.put_slice(&part);
                return Poll::Ready(Ok(()));
            }
            match Pin::new(&mut self.stream).poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => return Poll::Ready(Ok(())),
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(std::io::Error::other(e))),
                Poll::Ready(Some(Ok(bytes))) => {
                    self.seen += bytes.len() as u64;
                    if self.seen > self.cap {
                        self.over.store(true, Ordering::Relaxed);
                        return Poll::Ready(Err(std::io::Error::new(
                            std::io::ErrorKind::InvalidData,
                            "body larger than the signed size",
                        )));
                    }
                    self.chunk = bytes;
                }
            }
        }
    }
}

async fn upload(
    State(objects): State<HostObjects>,
    Path((bucket, object)): Path<(String, String)>,
    query: Result<Query<PutQuery>, QueryRejection>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let Ok(Query(q)) = query else {
        return plain(
            StatusCode::FORBIDDEN,
            "forbidden: not a signed link (exp, ct, n, sig required)",
        );
    };
    let link = match objects.verify_put(&bucket, &object, q.exp, &q.ct, q.n, &q.sig) {
        Ok(l) => l,
        Err(e) => return refused(&e),
    };
    if link.bucket == Bucket::Files {
        return plain(
            StatusCode::FORBIDDEN,
            "forbidden: committed files are not written by PUT",
        );
    }
    let Ok(signed) = MediaType::parse(&link.content_type) else {
        return plain(
            StatusCode::BAD_REQUEST,
            "bad request: the link's media type is not accepted; begin the upload again",
        );
    };
    let sent = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(MediaType::parse);
    if !matches!(sent, Some(Ok(ref m)) if *m == signed) {
        return plain(
            StatusCode::BAD_REQUEST,
            format!("bad request: Content-Type must be {signed} (the media type the link was signed for)"),
        );
    }
    if let Some(len) = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        && len > link.max_bytes
    {
        return plain(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("{len} bytes exceed the signed size of {} bytes", link.max_bytes),
        );
    }
    let store = objects.store(link.bucket);
    if let Ok(info) = store.info(&link.object).await
        && fleet_services::upload::is_confirmed(&info)
    {
        return plain(
            StatusCode::CONFLICT,
            "conflict: this upload was confirmed already",
        );
    }
    let over = Arc::new(AtomicBool::new(false));
    let mut reader = CappedBody {
        stream: body.into_data_stream(),
        chunk: Bytes::new(),
        seen: 0,
        cap: link.max_bytes,
        over: over.clone(),
    };
    let meta = object_store::ObjectMetadata {
        name: link.object.clone(),
        metadata: HashMap::from([(META_CONTENT_TYPE.to_owned(), signed.as_str().to_owned())]),
        ..Default::default()
    };
    match store.put(meta, &mut reader).await {
        Ok(info) => (
            StatusCode::OK,
            axum::Json(serde_json::json!({ "ok": true, "size_bytes": info.size })),
        )
            .into_response(),
        Err(_) if over.load(Ordering::Relaxed) => {
            let _ = store.delete(&link.object).await;
            plain(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the body exceeds the signed size of {} bytes", link.max_bytes),
            )
        }
        Err(e) => plain(StatusCode::BAD_GATEWAY, format!("object store: {e}")),
    }
}
