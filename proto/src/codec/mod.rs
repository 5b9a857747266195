//! The stdio frame codec: one JSON-RPC message per LF-terminated line (spec §2).
//!
//! The core is synchronous and allocation-light: [`FrameDecoder`] splits a byte buffer into lines with `memchr`,
//! never holds more than `max_frame_bytes` (+ one read) of an oversized line, and classifies each line into a
//! [`Frame`] without materialising `params` / `result` / `error` — they stay byte ranges into the frame's shared
//! buffer, so forwarding a 16 MiB result costs no copy and no re-serialisation. The async adapter in [`io`]
//! (feature `tokio`) drives it from an `AsyncRead` and writes frames through a single writer task.
//!
//! Every problem with one line is a [`FrameError`] for that line only; the stream goes on with the next line.
//!
//! ## Why serde_json (and not simd-json) parses frames
//!
//! Classification needs the top-level members only. serde_json's borrowed `RawValue` skips the payload in one
//! validating pass with no allocation and lets us keep byte ranges into the original buffer. simd-json must
//! build a tape of the whole document, and its in-place parser rewrites escaped strings in the buffer, which
//! would break zero-copy forwarding. `benches/frame_parse.rs` measures both on the same corpus; see
//! docs/performance.md for the figures that decided this.

mod frame;
mod sniff;

#[cfg(feature = "tokio")]
pub mod io;

use bytes::{Bytes, BytesMut};
use serde::Serialize;

pub use frame::{Frame, FrameKind, NotJsonRpc};

use crate::jsonrpc::{ErrorObject, Id, codes};
use crate::limits::{FRAME_EXCERPT_BYTES, MAX_FRAME_BYTES};

/// How much of an oversized frame's head is kept to find its `id` (see [`FrameError::TooLarge::id_hint`]).
const ID_SNIFF_BYTES: usize = 4096;

/// A problem with one frame. The stream continues with the next line.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FrameError {
    /// The line is longer than the limit. It was discarded without being buffered whole.
    #[error("frame_too_large: {frame_bytes} bytes exceeds the limit of {max_frame_bytes}")]
    TooLarge {
        /// Length of the line, excluding its LF (and a CR before it).
        frame_bytes: u64,
        /// The limit in force.
        max_frame_bytes: u64,
        /// The top-level `id`, when it appears in the frame's first 4 KiB (as JSON-RPC SDKs write it), so the
        /// host can fail the request the frame answered instead of waiting for its timeout.
        id_hint: Option<Id>,
    },
    /// The line is not valid UTF-8.
    #[error("frame is not valid UTF-8 (valid up to byte {valid_up_to}): {excerpt:?}")]
    InvalidUtf8 {
        /// Bytes before the first invalid sequence.
        valid_up_to: usize,
        /// The start of the line (lossy).
        excerpt: String,
    },
    /// The line is not JSON.
    #[error("frame is not JSON ({message}): {excerpt:?}")]
    InvalidJson {
        /// The parser's message, with line and column.
        message: String,
        /// The start of the line.
        excerpt: String,
    },
    /// The line is JSON but not an object.
    #[error("frame is JSON {found}, not an object: {excerpt:?}")]
    NotAnObject {
        /// What it is instead.
        found: &'static str,
        /// The start of the line.
        excerpt: String,
    },
    /// The line is a JSON object but not a JSON-RPC 2.0 message.
    #[error("frame is not JSON-RPC 2.0 ({reason}): {excerpt:?}")]
    NotJsonRpc {
        /// What is wrong with it.
        reason: NotJsonRpc,
        /// The start of the line.
        excerpt: String,
    },
    /// The stream ended in the middle of a line; the partial line is never interpreted.
    #[error("stream ended inside a frame after {partial_bytes} bytes: {excerpt:?}")]
    TruncatedAtEof {
        /// Bytes of the unterminated line.
        partial_bytes: u64,
        /// The start of the line.
        excerpt: String,
    },
}

impl FrameError {
    /// A stable, low-cardinality name of the error kind (for metrics labels and logs).
    pub fn kind(&self) -> &'static str {
        match self {
            FrameError::TooLarge { .. } => "frame_too_large",
            FrameError::InvalidUtf8 { .. } => "invalid_utf8",
            FrameError::InvalidJson { .. } => "invalid_json",
            FrameError::NotAnObject { .. } => "not_an_object",
            FrameError::NotJsonRpc { .. } => "not_json_rpc",
            FrameError::TruncatedAtEof { .. } => "truncated_at_eof",
        }
    }

    /// The JSON-RPC error a host answers with when it must answer this frame (spec §2 HR-TX-05: a structured
    /// `frame_too_large` with `data: {frame_bytes, max_frame_bytes}`).
    pub fn to_error_object(&self) -> ErrorObject {
        match self {
            FrameError::TooLarge {
                frame_bytes,
                max_frame_bytes,
                ..
            } => ErrorObject {
                code: codes::INVALID_REQUEST,
                message: "frame_too_large".into(),
                data: Some(serde_json::json!({
                    "errorCode": "frame_too_large",
                    "frame_bytes": frame_bytes,
                    "max_frame_bytes": max_frame_bytes,
                })),
            },
            FrameError::InvalidUtf8 { .. } | FrameError::InvalidJson { .. } => {
                ErrorObject::with_error_code(codes::PARSE_ERROR, self.kind(), self.to_string())
            }
            FrameError::NotAnObject { .. }
            | FrameError::NotJsonRpc { .. }
            | FrameError::TruncatedAtEof { .. } => {
                ErrorObject::with_error_code(codes::INVALID_REQUEST, self.kind(), self.to_string())
            }
        }
    }
}

/// The start of a line, for error messages: at most [`FRAME_EXCERPT_BYTES`], cut on a char boundary.
pub(crate) fn excerpt(line: &[u8]) -> String {
    let cut = &line[..line.len().min(FRAME_EXCERPT_BYTES)];
    let mut s = String::from_utf8_lossy(cut).into_owned();
    if line.len() > FRAME_EXCERPT_BYTES {
        s.push('…');
    }
    s
}

/// An oversized line being skipped up to its LF.
#[derive(Debug)]
struct Discard {
    bytes: u64,
    head: Vec<u8>,
    last: u8,
}

impl Discard {
    fn account(&mut self, chunk: &[u8]) {
        if let Some(&b) = chunk.last() {
            self.last = b;
        }
        self.bytes += chunk.len() as u64;
        let room = ID_SNIFF_BYTES.saturating_sub(self.head.len());
        self.head.extend_from_slice(&chunk[..chunk.len().min(room)]);
    }

    fn into_error(self, max_frame_bytes: usize, terminated: bool) -> FrameError {
        let cr = u64::from(terminated && self.last == b'\r');
        FrameError::TooLarge {
            frame_bytes: self.bytes - cr,
            max_frame_bytes: max_frame_bytes as u64,
            id_hint: sniff::top_level_id(&self.head),
        }
    }
}

/// Splits a byte stream into frames. Feed it with [`decode`](Self::decode) after every read and with
/// [`decode_eof`](Self::decode_eof) once the stream has ended.
#[derive(Debug)]
pub struct FrameDecoder {
    max_frame_bytes: usize,
    /// How far `buf` has already been searched for LF (so a long frame arriving in pieces is scanned once).
    scanned: usize,
    discard: Option<Discard>,
}

impl Default for FrameDecoder {
    fn default() -> Self {
        FrameDecoder::new(MAX_FRAME_BYTES)
    }
}

impl FrameDecoder {
    /// A decoder with the given frame limit (bytes, excluding the LF).
    pub fn new(max_frame_bytes: usize) -> Self {
        FrameDecoder {
            max_frame_bytes,
            scanned: 0,
            discard: None,
        }
    }

    /// The frame limit in force.
    pub fn max_frame_bytes(&self) -> usize {
        self.max_frame_bytes
    }

    /// Takes the next complete line out of `buf` and classifies it. `None` means more bytes are needed.
    /// Blank lines (and CR-only lines) are skipped.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Option<Result<Frame, FrameError>> {
        loop {
            if let Some(discard) = &mut self.discard {
                match memchr::memchr(b'\n', buf) {
                    Some(i) => {
                        let taken = buf.split_to(i + 1);
                        discard.account(&taken[..i]);
                        let discard = self.discard.take()?;
                        return Some(Err(discard.into_error(self.max_frame_bytes, true)));
                    }
                    None => {
                        discard.account(buf);
                        buf.clear();
                        return None;
                    }
                }
            }
            match memchr::memchr(b'\n', &buf[self.scanned..]) {
                Some(rel) => {
                    let lf = self.scanned + rel;
                    self.scanned = 0;
                    let line = buf.split_to(lf + 1).freeze();
                    let mut end = lf;
                    if end > 0 && line[end - 1] == b'\r' {
                        end -= 1;
                    }
                    if end > self.max_frame_bytes {
                        return Some(Err(FrameError::TooLarge {
                            frame_bytes: end as u64,
                            max_frame_bytes: self.max_frame_bytes as u64,
                            id_hint: sniff::top_level_id(&line[..end.min(ID_SNIFF_BYTES)]),
                        }));
                    }
                    if line[..end].iter().all(u8::is_ascii_whitespace) {
                        continue;
                    }
                    return Some(Frame::parse(line.slice(..end)));
                }
                None => {
                    self.scanned = buf.len();
                    // One byte of slack for a CR that may precede the LF.
                    if buf.len() > self.max_frame_bytes + 1 {
                        let mut discard = Discard {
                            bytes: 0,
                            head: Vec::new(),
                            last: 0,
                        };
                        discard.account(buf);
                        buf.clear();
                        self.scanned = 0;
                        self.discard = Some(discard);
                    }
                    return None;
                }
            }
        }
    }

    /// Like [`decode`](Self::decode), after the stream has ended: an unterminated line is reported as
    /// [`FrameError::TruncatedAtEof`] (or `TooLarge` if it was already over the limit) and never interpreted.
    pub fn decode_eof(&mut self, buf: &mut BytesMut) -> Option<Result<Frame, FrameError>> {
        if let Some(item) = self.decode(buf) {
            return Some(item);
        }
        self.scanned = 0;
        if let Some(discard) = self.discard.take() {
            return Some(Err(discard.into_error(self.max_frame_bytes, false)));
        }
        if buf.is_empty() {
            return None;
        }
        let rest = buf.split();
        if rest.iter().all(u8::is_ascii_whitespace) {
            return None;
        }
        Some(Err(FrameError::TruncatedAtEof {
            partial_bytes: rest.len() as u64,
            excerpt: excerpt(&rest),
        }))
    }
}

/// Why a message could not be encoded as a frame.
#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    /// Serialization failed (e.g. a map with non-string keys).
    #[error("cannot serialize frame: {0}")]
    Serialize(#[from] serde_json::Error),
    /// The encoded message is over the limit; it was not sent.
    #[error("frame_too_large: {frame_bytes} bytes exceeds the limit of {max_frame_bytes}")]
    TooLarge {
        /// Length of the encoded message, without its LF.
        frame_bytes: u64,
        /// The limit in force.
        max_frame_bytes: u64,
    },
}

/// Encodes one message as a frame: compact JSON (which never contains a raw LF) plus the terminating LF.
pub fn encode_frame<T: Serialize + ?Sized>(
    message: &T,
    max_frame_bytes: usize,
) -> Result<Bytes, EncodeError> {
    let mut out = Vec::with_capacity(128);
    serde_json::to_writer(&mut out, message)?;
    if out.len() > max_frame_bytes {
        return Err(EncodeError::TooLarge {
            frame_bytes: out.len() as u64,
            max_frame_bytes: max_frame_bytes as u64,
        });
    }
    out.push(b'\n');
    Ok(Bytes::from(out))
}
