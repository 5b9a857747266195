//! Recording and fixture files (spec §15.4): JSONL, one record per line, in four formats.
//!
//! - **F1**, the documented recording: one envelope per line, `{"t", "dir": "out", "ns", "method", "args",
//!   "result" | "error"}` for a call (request and outcome on one line), `{"t", "dir": "in", "name", "payload"}`
//!   for an event the host pushed.
//! - **F2**, what the harness records: `{"t", "kind": "req", "id", "ns", "method", "args"}` and `{"t", "kind":
//!   "res", "id", "ok", "result" | "error"}` paired by `id`, plus `kind: "meta"` and other kinds (events such as
//!   `auth.refresh`). A `tools.invoke` result is the plugin's whole `InvokeResult` (`{"success", "data"}`).
//! - **F3**, mock fixtures (`MockEntry`): `{"ns", "method", "match"?, "result" | "error" | "events"}`. Not a
//!   recording: recognised here, validated as [`crate::mocks::MockEntry`].
//! - **F4**, event/RPC transcripts: `{"type": "event" | "rpc", "ts", "direction": "app→host" | "host→app",
//!   "method"?, "params"?, "result" | "error"}`, requests and results paired by adjacency.
//!
//! [`parse_line`] classifies one line and checks the fields its format requires; what spans lines (pairing,
//! mixed formats, the timeline) is the reader's (`fleet::replay`).

use std::fmt;

use serde_json::{Map, Value};

/// The four formats of spec §15.4.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Format {
    /// The documented recording format (one envelope per line).
    F1,
    /// The harness's `req` / `res` pairs.
    F2,
    /// Mock fixtures (`MockEntry`): not a recording.
    F3,
    /// Event/RPC transcripts.
    F4,
}

impl Format {
    /// The short name (`F1` … `F4`).
    pub fn as_str(self) -> &'static str {
        match self {
            Format::F1 => "F1",
            Format::F2 => "F2",
            Format::F3 => "F3",
            Format::F4 => "F4",
        }
    }

    /// What the format is, in a few words.
    pub fn describe(self) -> &'static str {
        match self {
            Format::F1 => "documented envelopes (dir out/in)",
            Format::F2 => "req/res pairs (kind)",
            Format::F3 => "mock fixtures (MockEntry)",
            Format::F4 => "event/RPC transcript (type/direction)",
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The outcome of a call as recorded: `{"ok": true, "result"}` or `{"ok": false, "error"}` (F1 and F4 have no
/// `ok`: an `error` member means failure).
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The result (may be `null`).
    Ok(Value),
    /// The error object (`{code, message, details?}`).
    Err(Value),
}

impl Outcome {
    /// The error's string `code`, when the outcome is an error that has one.
    pub fn error_code(&self) -> Option<&str> {
        match self {
            Outcome::Err(e) => e.get("code").and_then(Value::as_str),
            Outcome::Ok(_) => None,
        }
    }
}

/// One F1 line.
#[derive(Debug, Clone, PartialEq)]
pub enum F1Line {
    /// `dir: "out"`: a call of the bundle and its outcome.
    Out {
        /// Elapsed time (ms).
        t: f64,
        /// The namespace (`tools`, `window`, …).
        ns: String,
        /// The method inside it.
        method: String,
        /// The arguments (`{}` when absent).
        args: Value,
        /// The outcome.
        outcome: Outcome,
    },
    /// `dir: "in"`: an event the host pushed.
    In {
        /// Elapsed time (ms).
        t: f64,
        /// The event's name.
        name: String,
    },
}

/// One F2 line.
#[derive(Debug, Clone, PartialEq)]
pub enum F2Line {
    /// `kind: "meta"`: the session's header.
    Meta {
        /// Elapsed time (ms).
        t: f64,
    },
    /// `kind: "req"`.
    Req {
        /// Elapsed time (ms).
        t: f64,
        /// The correlation id as its JSON text (`1`, `"a"`).
        id: String,
        /// The namespace.
        ns: String,
        /// The method inside it.
        method: String,
        /// The arguments (`{}` when absent).
        args: Value,
    },
    /// `kind: "res"`.
    Res {
        /// Elapsed time (ms).
        t: f64,
        /// The correlation id as its JSON text.
        id: String,
        /// The outcome.
        outcome: Outcome,
    },
    /// Any other kind: an event outside the plugin host (`auth.refresh`, …).
    Event {
        /// Elapsed time (ms).
        t: f64,
        /// The kind.
        kind: String,
    },
}

/// The direction of an F4 line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// `app→host` (a request, or an event the app sent).
    AppToHost,
    /// `host→app` (a result, or an event the host pushed).
    HostToApp,
}

/// One F4 line.
#[derive(Debug, Clone, PartialEq)]
pub enum F4Line {
    /// `type: "event"`.
    Event {
        /// ISO-8601 timestamp, as written.
        ts: String,
        /// Its direction.
        direction: Direction,
        /// The event's name (`method`), when given.
        name: Option<String>,
    },
    /// `type: "rpc"`, `app→host`: a request.
    Request {
        /// ISO-8601 timestamp, as written.
        ts: String,
        /// `tools.invoke`, `POST /api/…`, …
        method: String,
        /// The parameters (`{}` when absent).
        params: Value,
    },
    /// `type: "rpc"`, `host→app`: the result of the request before it.
    Result {
        /// ISO-8601 timestamp, as written.
        ts: String,
        /// The outcome.
        outcome: Outcome,
    },
}

/// One line of a recording or fixture file.
#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    /// An F1 envelope.
    F1(F1Line),
    /// An F2 line.
    F2(F2Line),
    /// An F3 mock entry (`ns`, `method`), kept as read.
    F3 {
        /// The namespace.
        ns: String,
        /// The method.
        method: String,
    },
    /// An F4 line.
    F4(F4Line),
}

impl Record {
    /// The line's format.
    pub fn format(&self) -> Format {
        match self {
            Record::F1(_) => Format::F1,
            Record::F2(_) => Format::F2,
            Record::F3 { .. } => Format::F3,
            Record::F4(_) => Format::F4,
        }
    }
}

/// Why one line is not a record.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LineError {
    /// Not JSON.
    #[error("bad JSON: {0}")]
    BadJson(String),
    /// JSON, but not an object.
    #[error("not a JSON object")]
    NotAnObject,
    /// An object of none of the four formats.
    #[error(
        "unknown format: none of F1 (`dir`), F2 (`kind`), F3 (`ns` + `method` + `match`/`result`/`error`/`events`), F4 (`type` + `direction`)"
    )]
    UnknownFormat,
    /// An F3 line that is not a valid mock entry (`crate::mocks::MockEntryError`'s message).
    #[error("F3: {0}")]
    Mock(String),
    /// A field the line's format requires is absent.
    #[error("{format}: missing required field `{field}`")]
    Missing {
        /// The line's format.
        format: Format,
        /// The field.
        field: &'static str,
    },
    /// A field has the wrong type or value.
    #[error("{format}: `{field}` must be {expected}")]
    Invalid {
        /// The line's format.
        format: Format,
        /// The field.
        field: &'static str,
        /// What it must be.
        expected: &'static str,
    },
}

/// Which format an object is in, from its shape alone: `kind` → F2, `dir` → F1, `type` + `direction` → F4,
/// `ns` + `method` with a mock's `match` / `result` / `error` / `events` → F3.
pub fn detect(line: &Map<String, Value>) -> Option<Format> {
    if line.contains_key("kind") {
        Some(Format::F2)
    } else if line.contains_key("dir") {
        Some(Format::F1)
    } else if line.contains_key("type") && line.contains_key("direction") {
        Some(Format::F4)
    } else if line.contains_key("ns")
        && line.contains_key("method")
        && ["match", "result", "error", "events"]
            .iter()
            .any(|k| line.contains_key(*k))
    {
        Some(Format::F3)
    } else {
        None
    }
}

/// Parses one line (without its LF) into a [`Record`], checking the fields its format requires.
pub fn parse_line(text: &str) -> Result<Record, LineError> {
    let value: Value = serde_json::from_str(text).map_err(|e| LineError::BadJson(e.to_string()))?;
    let Value::Object(line) = value else {
        return Err(LineError::NotAnObject);
    };
    let format = detect(&line).ok_or(LineError::UnknownFormat)?;
    let f = Fields { line: &line, format };
    match format {
        Format::F1 => f1(&f).map(Record::F1),
        Format::F2 => f2(&f).map(Record::F2),
        Format::F3 => crate::mocks::MockEntry::parse(text)
            .map(|e| Record::F3 {
                ns: e.ns,
                method: e.method,
            })
            .map_err(|e| LineError::Mock(e.to_string())),
        Format::F4 => f4(&f).map(Record::F4),
    }
}

/// Typed access to a line's fields, failing with the format's [`LineError`].
struct Fields<'a> {
    line: &'a Map<String, Value>,
    format: Format,
}

impl Fields<'_> {
    fn get(&self, field: &'static str) -> Result<&Value, LineError> {
        self.line.get(field).ok_or(LineError::Missing {
            format: self.format,
            field,
        })
    }

    fn invalid(&self, field: &'static str, expected: &'static str) -> LineError {
        LineError::Invalid {
            format: self.format,
            field,
            expected,
        }
    }

    fn string(&self, field: &'static str) -> Result<String, LineError> {
        self.get(field)?
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| self.invalid(field, "a string"))
    }

    fn time(&self) -> Result<f64, LineError> {
        self.get("t")?
            .as_f64()
            .filter(|t| *t >= 0.0)
            .ok_or_else(|| self.invalid("t", "a non-negative number (elapsed ms)"))
    }

    /// `args` (or `params`): an object, `{}` when absent.
    fn object_or_empty(&self, field: &'static str) -> Result<Value, LineError> {
        match self.line.get(field) {
            None | Some(Value::Null) => Ok(Value::Object(Map::new())),
            Some(v @ Value::Object(_)) => Ok(v.clone()),
            Some(_) => Err(self.invalid(field, "an object")),
        }
    }

    /// An `error` member: an object with a string `code`.
    fn error(&self) -> Result<Value, LineError> {
        let e = self.get("error")?;
        match e.get("code") {
            Some(Value::String(_)) => Ok(e.clone()),
            _ => Err(self.invalid("error", "an object with a string `code`")),
        }
    }

    /// `result` or `error`, whichever the line has (no `ok` member: F1, F4).
    fn outcome(&self) -> Result<Outcome, LineError> {
        if self.line.contains_key("error") {
            Ok(Outcome::Err(self.error()?))
        } else if let Some(r) = self.line.get("result") {
            Ok(Outcome::Ok(r.clone()))
        } else {
            Err(LineError::Missing {
                format: self.format,
                field: "result",
            })
        }
    }
}

fn f1(f: &Fields<'_>) -> Result<F1Line, LineError> {
    let t = f.time()?;
    match f.string("dir")?.as_str() {
        "out" => Ok(F1Line::Out {
            t,
            ns: f.string("ns")?,
            method: f.string("method")?,
            args: f.object_or_empty("args")?,
            outcome: f.outcome()?,
        }),
        "in" => Ok(F1Line::In {
            t,
            name: f.string("name")?,
        }),
        _ => Err(f.invalid("dir", "\"out\" or \"in\"")),
    }
}

fn f2(f: &Fields<'_>) -> Result<F2Line, LineError> {
    let t = f.time()?;
    let id = || -> Result<String, LineError> {
        match f.get("id")? {
            v @ (Value::Number(_) | Value::String(_)) => Ok(v.to_string()),
            _ => Err(f.invalid("id", "a number or a string")),
        }
    };
    match f.string("kind")?.as_str() {
        "meta" => Ok(F2Line::Meta { t }),
        "req" => Ok(F2Line::Req {
            t,
            id: id()?,
            ns: f.string("ns")?,
            method: f.string("method")?,
            args: f.object_or_empty("args")?,
        }),
        "res" => {
            let id = id()?;
            let ok = f
                .get("ok")?
                .as_bool()
                .ok_or_else(|| f.invalid("ok", "a boolean"))?;
            let outcome = if ok {
                Outcome::Ok(f.get("result")?.clone())
            } else {
                Outcome::Err(f.error()?)
            };
            Ok(F2Line::Res { t, id, outcome })
        }
        kind => Ok(F2Line::Event {
            t,
            kind: kind.to_owned(),
        }),
    }
}

fn f4(f: &Fields<'_>) -> Result<F4Line, LineError> {
    let ts = f.string("ts")?;
    let direction = match f.string("direction")?.as_str() {
        "app→host" | "app->host" => Direction::AppToHost,
        "host→app" | "host->app" => Direction::HostToApp,
        _ => return Err(f.invalid("direction", "\"app→host\" or \"host→app\"")),
    };
    match (f.string("type")?.as_str(), direction) {
        ("event", _) => Ok(F4Line::Event {
            ts,
            direction,
            name: f.line.get("method").and_then(Value::as_str).map(str::to_owned),
        }),
        ("rpc", Direction::AppToHost) => Ok(F4Line::Request {
            ts,
            method: f.string("method")?,
            params: f.object_or_empty("params")?,
        }),
        ("rpc", Direction::HostToApp) => Ok(F4Line::Result {
            ts,
            outcome: f.outcome()?,
        }),
        _ => Err(f.invalid("type", "\"event\" or \"rpc\"")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_format_is_detected_from_its_spec_example() {
        let cases = [
            (
                r#"{"t": 12, "dir": "out", "ns": "tools", "method": "invoke", "args": {"tool_id": "x"}, "result": {}}"#,
                Format::F1,
            ),
            (
                r#"{"t": 1500, "dir": "in", "name": "auth.refresh", "payload": {}}"#,
                Format::F1,
            ),
            (
                r#"{"t":0,"kind":"meta","harness_version":"0.1","session_id":"dev-session","window_uuid":"dev-wid"}"#,
                Format::F2,
            ),
            (
                r#"{"t":2,"kind":"res","id":1,"ok":true,"result":{"wid":"dev-wid"}}"#,
                Format::F2,
            ),
            (
                r#"{"t":1800,"kind":"auth.refresh","token":"dev-token-rotated"}"#,
                Format::F2,
            ),
            (
                r#"{"ns":"llm","method":"complete","match":{"contentIncludes":"weather"},"result":{"role":"assistant"}}"#,
                Format::F3,
            ),
            (
                r#"{"type":"rpc","ts":"2025-11-01T00:00:02Z","direction":"app→host","method":"POST /api/v1/copilot/app/image/generate","params":{"n":1}}"#,
                Format::F4,
            ),
            (
                r#"{"type":"rpc","ts":"2025-11-01T00:00:05Z","direction":"host→app","result":{"images":[]}}"#,
                Format::F4,
            ),
        ];
        for (line, format) in cases {
            assert_eq!(parse_line(line).map(|r| r.format()), Ok(format), "{line}");
        }
    }

    #[test]
    fn a_broken_line_names_its_problem() {
        assert!(matches!(parse_line("{\"t\": 1,"), Err(LineError::BadJson(_))));
        assert_eq!(parse_line("[1]"), Err(LineError::NotAnObject));
        assert_eq!(parse_line(r#"{"hello": 1}"#), Err(LineError::UnknownFormat));
        assert_eq!(
            parse_line(
                r#"{"ns":"llm","method":"complete","result":{},"error":{"code":-32000,"message":"y"}}"#
            ),
            Err(LineError::Mock(
                "the entry has more than one answer: give only one of `result`, `error` and `events`".into()
            ))
        );
        assert_eq!(
            parse_line(r#"{"t":1,"kind":"req","id":1,"method":"invoke"}"#),
            Err(LineError::Missing {
                format: Format::F2,
                field: "ns"
            })
        );
        assert_eq!(
            parse_line(r#"{"t":1,"kind":"res","id":1,"ok":false,"error":{"message":"x"}}"#),
            Err(LineError::Invalid {
                format: Format::F2,
                field: "error",
                expected: "an object with a string `code`"
            })
        );
        assert_eq!(
            parse_line(r#"{"t":1,"dir":"out","ns":"tools","method":"invoke","args":{}}"#),
            Err(LineError::Missing {
                format: Format::F1,
                field: "result"
            })
        );
        assert_eq!(
            parse_line(r#"{"t":-1,"kind":"meta"}"#),
            Err(LineError::Invalid {
                format: Format::F2,
                field: "t",
                expected: "a non-negative number (elapsed ms)"
            })
        );
        assert_eq!(
            parse_line(r#"{"type":"rpc","ts":"x","direction":"sideways","method":"m"}"#),
            Err(LineError::Invalid {
                format: Format::F4,
                field: "direction",
                expected: "\"app→host\" or \"host→app\""
            })
        );
    }

    #[test]
    fn ids_and_outcomes_are_kept_as_recorded() {
        let Ok(Record::F2(F2Line::Res { id, outcome, .. })) = parse_line(
            r#"{"t":51,"kind":"res","id":"2","ok":false,"error":{"code":"permission_denied","message":"no"}}"#,
        ) else {
            panic!("not a res")
        };
        assert_eq!(id, "\"2\"");
        assert_eq!(outcome.error_code(), Some("permission_denied"));
        let Ok(Record::F2(F2Line::Req { id, args, .. })) =
            parse_line(r#"{"t":1,"kind":"req","id":7,"ns":"window","method":"hello"}"#)
        else {
            panic!("not a req")
        };
        assert_eq!(id, "7");
        assert_eq!(args, Value::Object(Map::new()));
    }
}
