//! How every HTTP listener of the process serves its connections: hyper directly, with its own timer, so a client
//! that never finishes its request head ([`ListenerLimits::header_read_timeout`]) or its body
//! ([`ListenerLimits::body_read_timeout`]) cannot hold a connection, and at most
//! [`ListenerLimits::max_connections`] connections at once (the next waits in the kernel's backlog until one
//! closes). `axum::serve` sets none of the three. HTTP/1.1 only: hyper's header timer is HTTP/1's, and telling
//! HTTP/2 from HTTP/1 first waits for bytes with no timer at all (a client sending nothing would hold its
//! connection for ever); TLS and HTTP/2 to browsers belong to the ingress in front.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use bytes::Bytes;
use http_body::Frame;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tower_service::Service as _;

/// How long a client may take to send a request's head by default ([`ListenerLimits::header_read_timeout`]).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a client may take to send a request's body by default, from its head
/// ([`ListenerLimits::body_read_timeout`]): 2 min, a 64 MiB upload at about 4.5 Mbit/s.
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(120);

/// Connections one listener serves at once by default ([`ListenerLimits::max_connections`]).
pub const MAX_CONNECTIONS: usize = 4096;

/// What one HTTP listener lets its clients hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenerLimits {
    /// A connection whose request head is not complete this long after the request began (or, between requests,
    /// after the connection went idle) is closed (hyper's `header_read_timeout`).
    pub header_read_timeout: Duration,
    /// A request body not complete this long after its head fails to read (the handler answers with the error;
    /// the connection is closed).
    pub body_read_timeout: Duration,
    /// Connections served at once; the next is accepted when one closes.
    pub max_connections: usize,
}

impl Default for ListenerLimits {
    fn default() -> Self {
        ListenerLimits {
            header_read_timeout: HEADER_READ_TIMEOUT,
            body_read_timeout: BODY_READ_TIMEOUT,
            max_connections: MAX_CONNECTIONS,
        }
    }
}

/// Serves `router` on `listener` within `limits` (each request carries `ConnectInfo<SocketAddr>`), until
/// `shutdown` completes: then no new connection is accepted, the open ones finish their requests in flight
/// (hyper's graceful shutdown), and this returns once they have closed.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    limits: ListenerLimits,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        // A slot first: at the cap, the next connection stays in the backlog, not in this process.
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break, // never closed
            },
            () = &mut shutdown => break,
        };
        let (stream, remote) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    accept_failed(&e).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let router = router.clone();
        let body_timeout = limits.body_read_timeout;
        let service = hyper::service::service_fn(move |req: axum::http::Request<hyper::body::Incoming>| {
            let mut req = req.map(|body| Body::new(Deadline::new(body, body_timeout)));
            req.extensions_mut().insert(ConnectInfo(remote));
            router.clone().call(req)
        });
        let conn = graceful.watch(builder.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::trace!(error = %e, "HTTP connection ended");
            }
            drop(slot);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// After an accept error: a connection's own (reset before it was accepted) is nothing; anything else (out of
/// descriptors) is waited out a moment rather than retried in a busy loop.
async fn accept_failed(e: &std::io::Error) {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(e.kind(), ConnectionAborted | ConnectionRefused | ConnectionReset) {
        return;
    }
    tracing::warn!(error = %e, "HTTP accept failed");
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// A request body that fails once its deadline passes before it has ended.
struct Deadline<B> {
    body: B,
    deadline: Pin<Box<tokio::time::Sleep>>,
    timeout: Duration,
}

impl<B> Deadline<B> {
    fn new(body: B, timeout: Duration) -> Self {
        Deadline {
            body,
            deadline: Box::pin(tokio::time::sleep(timeout)),
            timeout,
        }
    }
}

/// A request body not complete within [`ListenerLimits::body_read_timeout`].
#[derive(Debug, thiserror::Error)]
#[error("the request body was not complete within {0:?}")]
pub struct BodyReadTimeout(Duration);

impl<B> http_body::Body for Deadline<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<axum::BoxError>,
{
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.body).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        match self.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Some(Err(Box::new(BodyReadTimeout(self.timeout))))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}
