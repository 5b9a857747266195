//! F3 mock fixtures (`MockEntry`, spec §15.4): one JSON object per line of a JSONL file, each a canned answer for
//! calls addressed as `ns`/`method` whose `match` predicates hold, e.g.
//!
//! ```jsonl
//! {"ns":"llm","method":"complete","match":{"contentIncludes":"weather"},"result":{"role":"assistant","content":{"type":"text","text":"sunny"},"model":"mock","stopReason":"endTurn"}}
//! {"ns":"agent","method":"session.run","events":[{"payload":{"event":"token","text":"hello"}}]}
//! {"ns":"host","method":"uploadFile","match":{"modeEquals":"inline"},"result":{"r2_key":"…"}}
//! ```
//!
//! This module is the format only: the entry types, their validation, and the parsing of a whole file with the
//! 1-based line of the first broken entry. Matching entries to calls and serving them is the host's
//! (`fleet_services::mock`).

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One F3 line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MockEntry {
    /// The namespace: the part of a wire method before its first `/` (`image` for `image/generate`), or a
    /// routing name of the local-dev table (`llm` for `embeddings/create` → `llm`/`embed`).
    pub ns: String,
    /// The method within `ns` (`generate`, `uploadFile`, `session.run`, `complete`, `embed`).
    pub method: String,
    /// The predicates a call must satisfy (all of them); absent or empty: any call to `ns`/`method`.
    #[serde(default, rename = "match", skip_serializing_if = "MockMatch::is_empty")]
    pub matcher: MockMatch,
    /// The answer, returned as the call's `result`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    /// A failure instead of a result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<MockError>,
    /// Agent runs: the stream frames, in order (the host adds the final `done: true` terminator).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub events: Option<Vec<MockEvent>>,
}

/// The `match` predicates of an entry (spec §15.4: `contentIncludes`, `promptIncludes`, `modeEquals`, and
/// `tool_id` + `method`). Unknown keys are refused: a misspelt predicate would otherwise match every call.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MockMatch {
    /// Case-sensitive substring of the call's payload (any string in its params).
    #[serde(default, rename = "contentIncludes", skip_serializing_if = "Option::is_none")]
    pub content_includes: Option<String>,
    /// Case-sensitive substring of `params.prompt` (image calls).
    #[serde(default, rename = "promptIncludes", skip_serializing_if = "Option::is_none")]
    pub prompt_includes: Option<String>,
    /// `params.mode` equals this (`host/uploadFile`: `inline`, `negotiate`, `confirm`).
    #[serde(default, rename = "modeEquals", skip_serializing_if = "Option::is_none")]
    pub mode_equals: Option<String>,
    /// The plugin (`tool_id`) the call comes from equals this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_id: Option<String>,
    /// The tool (method) of the invoke the call belongs to equals this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
}

impl MockMatch {
    /// No predicate at all.
    pub fn is_empty(&self) -> bool {
        self == &MockMatch::default()
    }
}

/// A canned failure: the JSON-RPC `error` object the call answers with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MockError {
    /// `error.code`.
    pub code: i64,
    /// `error.message`.
    pub message: String,
    /// `error.data`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
}

/// One frame of a mocked agent run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MockEvent {
    /// The frame (`{"event": "token", "text": "…"}`, `{"event": "final", …}`, …).
    pub payload: Value,
}

/// Why a line is not a valid [`MockEntry`].
#[derive(Debug, thiserror::Error)]
pub enum MockEntryError {
    /// Not JSON, not an object, a missing or mistyped field, an unknown `match` key (serde's message, its
    /// position given as the column within the line).
    #[error("{0}")]
    Json(String),
    /// `ns` or `method` is empty.
    #[error("`ns` and `method` must not be empty")]
    EmptyAddress,
    /// Neither `result`, `error` nor `events`.
    #[error("the entry has no answer: give `result`, `error` or `events`")]
    NoAnswer,
    /// More than one of them.
    #[error("the entry has more than one answer: give only one of `result`, `error` and `events`")]
    TwoAnswers,
    /// A `match` predicate with an empty string (it would match everything).
    #[error("`match.{0}` must not be empty")]
    EmptyPredicate(&'static str),
}

/// A broken line of a mock file.
#[derive(Debug, thiserror::Error)]
#[error("line {line}: {source}")]
pub struct MockLineError {
    /// 1-based line number.
    pub line: usize,
    /// What is wrong with it.
    #[source]
    pub source: MockEntryError,
}

impl MockEntry {
    /// Parses and validates one line.
    ///
    /// # Errors
    /// [`MockEntryError`] for anything but one well-formed entry.
    pub fn parse(line: &str) -> Result<MockEntry, MockEntryError> {
        let entry: MockEntry = serde_json::from_str(line).map_err(|e| {
            let shown = e.to_string();
            let position = format!(" at line {} column {}", e.line(), e.column());
            MockEntryError::Json(match shown.strip_suffix(&position) {
                Some(message) => format!("{message} (column {})", e.column()),
                None => shown,
            })
        })?;
        entry.validate()?;
        Ok(entry)
    }

    fn validate(&self) -> Result<(), MockEntryError> {
        if self.ns.is_empty() || self.method.is_empty() {
            return Err(MockEntryError::EmptyAddress);
        }
        let answers = [self.result.is_some(), self.error.is_some(), self.events.is_some()]
            .into_iter()
            .filter(|a| *a)
            .count();
        match answers {
            0 => return Err(MockEntryError::NoAnswer),
            1 => {}
            _ => return Err(MockEntryError::TwoAnswers),
        }
        let m = &self.matcher;
        for (name, value) in [
            ("contentIncludes", &m.content_includes),
            ("promptIncludes", &m.prompt_includes),
            ("modeEquals", &m.mode_equals),
            ("tool_id", &m.tool_id),
            ("method", &m.method),
        ] {
            if value.as_deref() == Some("") {
                return Err(MockEntryError::EmptyPredicate(name));
            }
        }
        Ok(())
    }
}

/// Parses a whole JSONL mock file: every non-blank line one entry, in file order (first match wins).
///
/// # Errors
/// The first broken line, with its 1-based number.
pub fn parse_jsonl(text: &str) -> Result<Vec<MockEntry>, MockLineError> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| MockEntry::parse(l).map_err(|source| MockLineError { line: i + 1, source }))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spec_examples_parse() {
        let text = concat!(
            r#"{"ns":"llm","method":"complete","match":{"contentIncludes":"weather"},"result":{"role":"assistant","content":{"type":"text","text":"sunny"},"model":"mock","stopReason":"endTurn"}}"#,
            "\n\n",
            r#"{"ns":"agent","method":"session.run","events":[{"payload":{"event":"token","text":"hello"}},{"payload":{"event":"token","text":" world"}}]}"#,
            "\n",
            r#"{"ns":"tools","method":"invoke","match":{"tool_id":"tool-test-long-task-engine-12345678","method":"run_steps"},"result":{"success":true}}"#,
            "\n",
            r#"{"ns":"host","method":"uploadFile","match":{"modeEquals":"inline"},"result":{}}"#,
            "\n",
            r#"{"ns":"image","method":"generate","match":{"promptIncludes":"Mars"},"error":{"code":-32103,"message":"no"}}"#,
        );
        let entries = parse_jsonl(text).unwrap();
        assert_eq!(entries.len(), 5);
        assert_eq!(entries[0].matcher.content_includes.as_deref(), Some("weather"));
        assert_eq!(entries[1].events.as_ref().map(Vec::len), Some(2));
        assert_eq!(
            entries[2].matcher.tool_id.as_deref(),
            Some("tool-test-long-task-engine-12345678")
        );
        assert_eq!(entries[2].matcher.method.as_deref(), Some("run_steps"));
        assert_eq!(entries[3].matcher.mode_equals.as_deref(), Some("inline"));
        assert_eq!(entries[4].error.as_ref().map(|e| e.code), Some(-32103));
    }

    #[test]
    fn a_broken_line_is_named_by_its_number() {
        let cases = [
            ("{not json", "line 3"),
            (r#"["an","array"]"#, "line 3"),
            (r#"{"ns":"llm","result":{}}"#, "missing field `method` (column "),
            (r#"{"ns":"llm","method":"complete"}"#, "no answer"),
            (
                r#"{"ns":"llm","method":"complete","result":{},"events":[]}"#,
                "more than one answer",
            ),
            (
                r#"{"ns":"llm","method":"complete","match":{"contentInclude":"x"},"result":{}}"#,
                "contentInclude",
            ),
            (
                r#"{"ns":"llm","method":"complete","match":{"modeEquals":""},"result":{}}"#,
                "match.modeEquals",
            ),
            (
                r#"{"ns":"","method":"complete","result":{}}"#,
                "must not be empty",
            ),
            (
                r#"{"ns":"agent","method":"session.run","events":[{"text":"no payload"}]}"#,
                "payload",
            ),
        ];
        for (bad, needle) in cases {
            let text = format!("{}\n\n{bad}\n", r#"{"ns":"llm","method":"complete","result":{}}"#);
            let e = parse_jsonl(&text).unwrap_err();
            assert_eq!(e.line, 3, "{bad}");
            let shown = e.to_string();
            assert!(shown.starts_with("line 3: "), "{shown}");
            assert!(shown.contains(needle), "{bad}: {shown}");
        }
    }
}
