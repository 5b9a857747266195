//! JSON-RPC 2.0 message types and the standard error codes (spec §2).
//!
//! Ids are kept exactly as received ([`Id`] stores the raw JSON text), so a host response to a plugin's reverse
//! RPC echoes the plugin's id verbatim, whatever its JSON type (spec §2 HR-TX-09).

use std::fmt;

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;

/// The only accepted value of the `jsonrpc` member.
pub const VERSION: &str = "2.0";

/// Standard JSON-RPC error codes (spec §2, table "Standard JSON-RPC codes").
pub mod codes {
    /// "Request body is not valid JSON. Host-emitted."
    pub const PARSE_ERROR: i64 = -32700;
    /// "Missing `jsonrpc` or `method`."
    pub const INVALID_REQUEST: i64 = -32600;
    /// Method or tool not found; the v1/v2 fallback depends on it.
    pub const METHOD_NOT_FOUND: i64 = -32601;
    /// Invalid params; also `UNKNOWN_INVOKE_CONTEXT` / `MISSING_INVOKE_CONTEXT` (spec §7.2).
    pub const INVALID_PARAMS: i64 = -32602;
    /// Internal error.
    pub const INTERNAL_ERROR: i64 = -32603;
    /// Lowest code of the implementation-defined server error range.
    pub const SERVER_ERROR_MIN: i64 = -32099;
    /// Highest code of the implementation-defined server error range.
    pub const SERVER_ERROR_MAX: i64 = -32000;

    /// A short meaning for a standard code, `None` for others.
    pub fn standard_meaning(code: i64) -> Option<&'static str> {
        Some(match code {
            PARSE_ERROR => "parse error",
            INVALID_REQUEST => "invalid request",
            METHOD_NOT_FOUND => "method not found",
            INVALID_PARAMS => "invalid params",
            INTERNAL_ERROR => "internal error",
            SERVER_ERROR_MIN..=SERVER_ERROR_MAX => "server error",
            _ => return None,
        })
    }
}

/// A JSON-RPC id: a string, a number, or `null` (only in error responses to unreadable requests).
///
/// The raw JSON text is kept so it round-trips unchanged: `"7"` stays a string, `7` a number, `1e3` stays `1e3`.
/// Equality and hashing are by that text, which is what "echo verbatim" needs; host-issued ids are always
/// non-negative integers, compare them with [`Id::as_u64`].
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Id(Box<str>);

/// Why a JSON value cannot be a JSON-RPC id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a JSON-RPC id must be a string, a number or null, not {found}")]
pub struct InvalidId {
    /// The JSON type found instead.
    pub found: &'static str,
}

impl Id {
    /// A numeric id (what the host issues).
    pub fn number(n: u64) -> Self {
        Id(n.to_string().into_boxed_str())
    }

    /// A string id.
    pub fn string(s: &str) -> Self {
        // Serializing a &str to JSON cannot fail.
        Id(serde_json::to_string(s).unwrap_or_default().into_boxed_str())
    }

    /// The `null` id.
    pub fn null() -> Self {
        Id("null".into())
    }

    /// Builds an id from raw JSON text, checking its type.
    pub fn from_raw(raw: &RawValue) -> Result<Self, InvalidId> {
        let text = raw.get().trim();
        let found = match text.as_bytes().first() {
            Some(b'"') | Some(b'-') | Some(b'0'..=b'9') => return Ok(Id(text.into())),
            Some(b'n') => return Ok(Id(text.into())),
            Some(b'{') => "an object",
            Some(b'[') => "an array",
            Some(b't') | Some(b'f') => "a boolean",
            _ => "an unknown value",
        };
        Err(InvalidId { found })
    }

    /// The raw JSON text of the id.
    pub fn as_json(&self) -> &str {
        &self.0
    }

    /// The id as an unsigned integer, if it is a JSON number that is one.
    pub fn as_u64(&self) -> Option<u64> {
        self.0.parse().ok()
    }

    /// The id's string value, if it is a JSON string.
    pub fn as_str(&self) -> Option<String> {
        if self.is_string() {
            serde_json::from_str(&self.0).ok()
        } else {
            None
        }
    }

    /// Whether the id is a JSON string.
    pub fn is_string(&self) -> bool {
        self.0.starts_with('"')
    }

    /// Whether the id is `null`.
    pub fn is_null(&self) -> bool {
        &*self.0 == "null"
    }
}

impl fmt::Debug for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Id({})", self.0)
    }
}

impl fmt::Display for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<u64> for Id {
    fn from(n: u64) -> Self {
        Id::number(n)
    }
}

impl Serialize for Id {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        // The text was validated on the way in (or built by us), so it is valid JSON.
        match RawValue::from_string(self.0.to_string()) {
            Ok(raw) => raw.serialize(serializer),
            Err(e) => Err(serde::ser::Error::custom(e)),
        }
    }
}

impl<'de> Deserialize<'de> for Id {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = Box::<RawValue>::deserialize(deserializer)?;
        Id::from_raw(&raw).map_err(D::Error::custom)
    }
}

/// A JSON-RPC error object: `{code, message, data?}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorObject {
    /// The numeric code.
    pub code: i64,
    /// A human-readable message.
    pub message: String,
    /// Structured details; Executa puts the symbolic name in `data.errorCode` (spec §9 HR-ER-01).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<serde_json::Value>,
}

impl ErrorObject {
    /// An error without data.
    pub fn new(code: i64, message: impl Into<String>) -> Self {
        ErrorObject {
            code,
            message: message.into(),
            data: None,
        }
    }

    /// An Executa-style error: `data.errorCode` carries the symbolic name (spec §9 HR-ER-01).
    pub fn with_error_code(code: i64, error_code: &str, message: impl Into<String>) -> Self {
        ErrorObject {
            code,
            message: message.into(),
            data: Some(serde_json::json!({ "errorCode": error_code })),
        }
    }

    /// The symbolic `data.errorCode`, if any.
    pub fn error_code(&self) -> Option<&str> {
        self.data.as_ref()?.get("errorCode")?.as_str()
    }
}

impl fmt::Display for ErrorObject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JSON-RPC error {}: {}", self.code, self.message)?;
        if let Some(name) = self.error_code() {
            write!(f, " ({name})")?;
        }
        Ok(())
    }
}

/// The `jsonrpc: "2.0"` marker; serializes as `"2.0"` and accepts nothing else.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct V2;

impl Serialize for V2 {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(VERSION)
    }
}

impl<'de> Deserialize<'de> for V2 {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = std::borrow::Cow::<'de, str>::deserialize(deserializer)?;
        if s == VERSION {
            Ok(V2)
        } else {
            Err(D::Error::custom(format!("jsonrpc must be \"2.0\", got {s:?}")))
        }
    }
}

/// A request: `{jsonrpc, id, method, params?}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Request<P = serde_json::Value> {
    /// Always `"2.0"`.
    pub jsonrpc: V2,
    /// The caller's id.
    pub id: Id,
    /// The method name.
    pub method: String,
    /// Parameters.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub params: Option<P>,
}

impl<P> Request<P> {
    /// A request with params.
    pub fn new(id: impl Into<Id>, method: impl Into<String>, params: P) -> Self {
        Request {
            jsonrpc: V2,
            id: id.into(),
            method: method.into(),
            params: Some(params),
        }
    }
}

impl Request<serde_json::Value> {
    /// A request without params (e.g. `describe`, `health`).
    pub fn bare(id: impl Into<Id>, method: impl Into<String>) -> Self {
        Request {
            jsonrpc: V2,
            id: id.into(),
            method: method.into(),
            params: None,
        }
    }
}

/// A notification: `{jsonrpc, method, params?}` — no id, never answered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Notification<P = serde_json::Value> {
    /// Always `"2.0"`.
    pub jsonrpc: V2,
    /// The method name.
    pub method: String,
    /// Parameters.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub params: Option<P>,
}

impl<P> Notification<P> {
    /// A notification with params.
    pub fn new(method: impl Into<String>, params: P) -> Self {
        Notification {
            jsonrpc: V2,
            method: method.into(),
            params: Some(params),
        }
    }
}

/// A response: exactly one of `result` and `error`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Response<R = serde_json::Value> {
    /// Always `"2.0"`.
    pub jsonrpc: V2,
    /// The id of the request answered.
    pub id: Id,
    /// The outcome, flattened to `result` or `error`.
    #[serde(flatten)]
    pub outcome: Outcome<R>,
}

/// The payload of a response.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum Outcome<R> {
    /// `result`.
    #[serde(rename = "result")]
    Result(R),
    /// `error`.
    #[serde(rename = "error")]
    Error(ErrorObject),
}

impl<R> Response<R> {
    /// A success response.
    pub fn ok(id: Id, result: R) -> Self {
        Response {
            jsonrpc: V2,
            id,
            outcome: Outcome::Result(result),
        }
    }

    /// An error response.
    pub fn err(id: Id, error: ErrorObject) -> Self {
        Response {
            jsonrpc: V2,
            id,
            outcome: Outcome::Error(error),
        }
    }
}

impl<'de, R: Deserialize<'de>> Deserialize<'de> for Response<R> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(bound = "R: Deserialize<'de>")]
        struct Wire<R> {
            jsonrpc: V2,
            id: Id,
            // `deserialize_with` keeps `"result": null` as `Some(null)` rather than "absent".
            #[serde(default = "Option::default", deserialize_with = "present")]
            result: Option<R>,
            #[serde(default)]
            error: Option<ErrorObject>,
        }
        fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<T>, D::Error> {
            T::deserialize(d).map(Some)
        }
        let wire = Wire::<R>::deserialize(deserializer)?;
        let outcome = match (wire.result, wire.error) {
            (Some(r), None) => Outcome::Result(r),
            (None, Some(e)) => Outcome::Error(e),
            (Some(_), Some(_)) => return Err(D::Error::custom("a response has both result and error")),
            (None, None) => return Err(D::Error::custom("a response has neither result nor error")),
        };
        Ok(Response {
            jsonrpc: wire.jsonrpc,
            id: wire.id,
            outcome,
        })
    }
}
