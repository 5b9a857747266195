//! One classified frame, and the classification rules (spec §2 HR-TX-08).

use std::fmt;
use std::ops::Range;

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer};
use serde_json::error::Category;
use serde_json::value::RawValue;

use super::{FrameError, excerpt};
use crate::jsonrpc::{ErrorObject, Id, VERSION};

/// What a frame is. Plugin → host: a `method` with an `id` is a reverse-RPC request, a `method` without one a
/// notification, no `method` but `result`/`error` a response (spec §2 HR-TX-08). A `__file_transport` pointer
/// must be resolved and the file's content classified in its place (spec §5 HR-FT-01).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FrameKind {
    /// `method` and `id`.
    Request,
    /// `method`, no `id`.
    Notification,
    /// `id` and `result`.
    Response,
    /// `id` and `error`.
    ErrorResponse,
    /// `__file_transport`: the real message is in a file.
    FileTransport,
}

/// Why a JSON object is not a JSON-RPC 2.0 message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotJsonRpc {
    /// No `jsonrpc` member.
    MissingVersion,
    /// `jsonrpc` is not `"2.0"`.
    WrongVersion,
    /// A member appears twice.
    DuplicateMember(String),
    /// `id` is not a string, number or null.
    InvalidId(&'static str),
    /// `method` is not a string.
    MethodNotString,
    /// `params` is not an object or array.
    ParamsNotStructured,
    /// A request or notification also carries `result` or `error`.
    RequestWithResult,
    /// A response has both `result` and `error`.
    BothResultAndError,
    /// No `method`, `result` or `error`.
    NeitherMethodNorResult,
    /// A response without `id`.
    ResponseWithoutId,
    /// `error` is not an object.
    ErrorNotObject,
    /// `__file_transport` is not a string.
    FileTransportNotString,
    /// Another type mismatch reported by the parser.
    Other(String),
}

impl fmt::Display for NotJsonRpc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NotJsonRpc::MissingVersion => f.write_str("missing \"jsonrpc\": \"2.0\""),
            NotJsonRpc::WrongVersion => f.write_str("\"jsonrpc\" is not \"2.0\""),
            NotJsonRpc::DuplicateMember(m) => write!(f, "duplicate member {m}"),
            NotJsonRpc::InvalidId(found) => write!(f, "id is {found}, not a string, number or null"),
            NotJsonRpc::MethodNotString => f.write_str("method is not a string"),
            NotJsonRpc::ParamsNotStructured => f.write_str("params is not an object or array"),
            NotJsonRpc::RequestWithResult => f.write_str("a request carries result or error"),
            NotJsonRpc::BothResultAndError => f.write_str("a response has both result and error"),
            NotJsonRpc::NeitherMethodNorResult => f.write_str("neither method nor result nor error"),
            NotJsonRpc::ResponseWithoutId => f.write_str("a response without id"),
            NotJsonRpc::ErrorNotObject => f.write_str("error is not an object"),
            NotJsonRpc::FileTransportNotString => f.write_str("__file_transport is not a string"),
            NotJsonRpc::Other(m) => f.write_str(m),
        }
    }
}

/// A classified frame. Holds the line (without LF) as shared [`Bytes`]; `params`, `result` and `error` are
/// byte ranges into it, parsed only when asked for.
#[derive(Clone, PartialEq, Eq)]
pub struct Frame {
    line: Bytes,
    kind: FrameKind,
    id: Option<Id>,
    method: Option<Box<str>>,
    payload: Option<Range<usize>>,
    file_transport: Option<Box<str>>,
}

/// The top-level members, borrowed from the line. Every member is wrapped so that `null` counts as present.
#[derive(Deserialize)]
struct Envelope<'a> {
    #[serde(borrow, default, deserialize_with = "present")]
    jsonrpc: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    id: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    method: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    params: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    result: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    error: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present", rename = "__file_transport")]
    file_transport: Option<&'a RawValue>,
}

fn present<'de, D: Deserializer<'de>>(d: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&'de RawValue>::deserialize(d).map(Some)
}

fn json_type(first: u8) -> &'static str {
    match first {
        b'[' => "an array",
        b'"' => "a string",
        b't' | b'f' => "a boolean",
        b'n' => "null",
        _ => "a number",
    }
}

impl Frame {
    /// Classifies one line (without its LF). This is the whole per-frame work of the decoder; it is public so
    /// a file-transported message can be classified the same way.
    pub fn parse(line: Bytes) -> Result<Frame, FrameError> {
        let text = match std::str::from_utf8(&line) {
            Ok(t) => t,
            Err(e) => {
                return Err(FrameError::InvalidUtf8 {
                    valid_up_to: e.valid_up_to(),
                    excerpt: excerpt(&line),
                });
            }
        };
        let first = text.bytes().find(|b| !b.is_ascii_whitespace()).unwrap_or(b' ');
        if first != b'{' {
            return Err(match serde_json::from_str::<serde::de::IgnoredAny>(text) {
                Ok(_) => FrameError::NotAnObject {
                    found: json_type(first),
                    excerpt: excerpt(&line),
                },
                Err(e) => FrameError::InvalidJson {
                    message: e.to_string(),
                    excerpt: excerpt(&line),
                },
            });
        }
        let env: Envelope<'_> = match serde_json::from_str(text) {
            Ok(env) => env,
            Err(e) => {
                return Err(match e.classify() {
                    Category::Data => {
                        let message = e.to_string();
                        let reason = match message.strip_prefix("duplicate field ") {
                            Some(rest) => NotJsonRpc::DuplicateMember(
                                rest.split(" at line").next().unwrap_or(rest).to_string(),
                            ),
                            None => NotJsonRpc::Other(message),
                        };
                        FrameError::NotJsonRpc {
                            reason,
                            excerpt: excerpt(&line),
                        }
                    }
                    _ => FrameError::InvalidJson {
                        message: e.to_string(),
                        excerpt: excerpt(&line),
                    },
                });
            }
        };
        let base = text.as_ptr() as usize;
        let span = |raw: &RawValue| {
            let start = raw.get().as_ptr() as usize - base;
            start..start + raw.get().len()
        };
        let bad = |reason| FrameError::NotJsonRpc {
            reason,
            excerpt: excerpt(&line),
        };

        match env.jsonrpc {
            None => return Err(bad(NotJsonRpc::MissingVersion)),
            Some(v) if v.get() != concat!("\"", "2.0", "\"") => return Err(bad(NotJsonRpc::WrongVersion)),
            Some(_) => debug_assert_eq!(VERSION, "2.0"),
        }
        let id = match env.id {
            Some(raw) => Some(Id::from_raw(raw).map_err(|e| bad(NotJsonRpc::InvalidId(e.found)))?),
            None => None,
        };

        if let Some(path) = env.file_transport {
            let path: String =
                serde_json::from_str(path.get()).map_err(|_| bad(NotJsonRpc::FileTransportNotString))?;
            return Ok(Frame {
                kind: FrameKind::FileTransport,
                id,
                method: None,
                payload: None,
                file_transport: Some(path.into()),
                line,
            });
        }

        if let Some(method) = env.method {
            let method: String =
                serde_json::from_str(method.get()).map_err(|_| bad(NotJsonRpc::MethodNotString))?;
            if env.result.is_some() || env.error.is_some() {
                return Err(bad(NotJsonRpc::RequestWithResult));
            }
            let payload = match env.params {
                Some(p) if p.get() == "null" => None,
                Some(p) if p.get().starts_with(['{', '[']) => Some(span(p)),
                Some(_) => return Err(bad(NotJsonRpc::ParamsNotStructured)),
                None => None,
            };
            let kind = if id.is_some() {
                FrameKind::Request
            } else {
                FrameKind::Notification
            };
            return Ok(Frame {
                kind,
                id,
                method: Some(method.into()),
                payload,
                file_transport: None,
                line,
            });
        }

        let (kind, payload) = match (env.result, env.error) {
            (Some(_), Some(_)) => return Err(bad(NotJsonRpc::BothResultAndError)),
            (None, None) => return Err(bad(NotJsonRpc::NeitherMethodNorResult)),
            (Some(r), None) => (FrameKind::Response, span(r)),
            (None, Some(e)) if e.get().starts_with('{') => (FrameKind::ErrorResponse, span(e)),
            (None, Some(_)) => return Err(bad(NotJsonRpc::ErrorNotObject)),
        };
        if id.is_none() {
            return Err(bad(NotJsonRpc::ResponseWithoutId));
        }
        Ok(Frame {
            kind,
            id,
            method: None,
            payload: Some(payload),
            file_transport: None,
            line,
        })
    }

    /// What the frame is.
    pub fn kind(&self) -> FrameKind {
        self.kind
    }

    /// The `id`, exactly as received; `None` for notifications (and pointers without one).
    pub fn id(&self) -> Option<&Id> {
        self.id.as_ref()
    }

    /// The `method` of a request or notification.
    pub fn method(&self) -> Option<&str> {
        self.method.as_deref()
    }

    /// The same frame over a copy of its own line: holding it no longer keeps alive the read buffer it was cut
    /// from (a short line cut from a buffer grown for a long one would otherwise pin the whole buffer).
    #[must_use]
    pub fn detached(&self) -> Frame {
        Frame {
            line: Bytes::copy_from_slice(&self.line),
            ..self.clone()
        }
    }

    /// The whole line, without its LF (a CR before the LF is also stripped).
    pub fn as_bytes(&self) -> &Bytes {
        &self.line
    }

    /// The whole line as text (validated UTF-8).
    pub fn as_str(&self) -> &str {
        // `parse` only builds frames from valid UTF-8.
        std::str::from_utf8(&self.line).unwrap_or_default()
    }

    /// The raw JSON text of `params` (requests, notifications), `result` (responses) or `error` (error
    /// responses). A slice of the frame's buffer: no copy.
    pub fn payload_json(&self) -> Option<&str> {
        let range = self.payload.clone()?;
        self.as_str().get(range)
    }

    /// The payload as shared bytes (a cheap reference-counted slice of the frame's buffer).
    pub fn payload_bytes(&self) -> Option<Bytes> {
        Some(self.line.slice(self.payload.clone()?))
    }

    /// `params` as raw JSON text (requests and notifications only).
    pub fn params_json(&self) -> Option<&str> {
        match self.kind {
            FrameKind::Request | FrameKind::Notification => self.payload_json(),
            _ => None,
        }
    }

    /// `result` as raw JSON text (success responses only).
    pub fn result_json(&self) -> Option<&str> {
        match self.kind {
            FrameKind::Response => self.payload_json(),
            _ => None,
        }
    }

    /// Parses the payload into `T`.
    pub fn parse_payload<T: DeserializeOwned>(&self) -> Result<Option<T>, serde_json::Error> {
        self.payload_json().map(serde_json::from_str).transpose()
    }

    /// The `error` object of an error response, parsed.
    pub fn error(&self) -> Option<Result<ErrorObject, serde_json::Error>> {
        if self.kind != FrameKind::ErrorResponse {
            return None;
        }
        self.payload_json().map(serde_json::from_str)
    }

    /// The path of a `__file_transport` pointer.
    pub fn file_transport_path(&self) -> Option<&str> {
        self.file_transport.as_deref()
    }
}

impl fmt::Debug for Frame {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Frame")
            .field("kind", &self.kind)
            .field("id", &self.id)
            .field("method", &self.method)
            .field("bytes", &self.line.len())
            .field("file_transport", &self.file_transport)
            .finish()
    }
}
