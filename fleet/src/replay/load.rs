//! Reading a recording or fixture file (spec §15.4): every line parsed (`fleet_proto::recording`), the file's
//! format, its calls with their recorded outcomes (F2 `req`/`res` paired by `id`, F4 requests and results by
//! adjacency, F1 one line each), its events, and every problem with its line number: bad JSON, unknown format,
//! missing required field, a `res` without its `req`, mixed formats, a timeline that goes back, an unknown
//! `tools.*` method.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use fleet_proto::api::methods;
use fleet_proto::recording::{F1Line, F2Line, F4Line, Format, Outcome, Record, parse_line};
use serde::Serialize;
use serde_json::Value;

/// A problem of one line.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Problem {
    /// 1-based line number.
    pub line: usize,
    /// What is wrong.
    pub problem: String,
}

/// A recorded outcome and the line it is on.
#[derive(Debug, Clone, PartialEq)]
pub struct Recorded {
    /// 1-based line number of the outcome (F2: the `res` line).
    pub line: usize,
    /// The outcome.
    pub outcome: Outcome,
}

/// One call of the recording.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    /// 1-based line number of the request.
    pub line: usize,
    /// The correlation id as its JSON text (F2 only).
    pub id: Option<String>,
    /// The namespace (`tools`, `window`, …); empty when the call names no namespace (an F4 `POST /api/…`).
    pub ns: String,
    /// The method (the whole F4 `method` when `ns` is empty).
    pub method: String,
    /// The arguments.
    pub args: Value,
    /// The recorded outcome (`None`: the recording ends before it).
    pub recorded: Option<Recorded>,
}

impl Call {
    /// `ns.method` (or the F4 method as written).
    pub fn name(&self) -> String {
        if self.ns.is_empty() {
            self.method.clone()
        } else {
            format!("{}.{}", self.ns, self.method)
        }
    }

    /// `args.tool_id`, when it is a string.
    pub fn tool_id(&self) -> Option<&str> {
        self.args.get("tool_id").and_then(Value::as_str)
    }
}

/// One entry of the recording, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Entry {
    /// A call.
    Call(Call),
    /// An event (F1 `in`, F2 kinds other than `meta`/`req`/`res`, F4 `event`).
    Event {
        /// 1-based line number.
        line: usize,
        /// Its name.
        name: String,
    },
}

/// A file as read.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// The file.
    pub path: PathBuf,
    /// Its format: that of its first well-formed line (`None`: no well-formed line).
    pub format: Option<Format>,
    /// Non-blank lines.
    pub lines: usize,
    /// F3 entries (`ns.method` of each), for `summarize`.
    pub mocks: Vec<String>,
    /// Calls and events, in order.
    pub entries: Vec<Entry>,
    /// Every problem, in line order.
    pub problems: Vec<Problem>,
    /// From the first timestamp to the last, in ms.
    pub duration_ms: Option<f64>,
}

/// Why a file could not be read at all.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {source}")]
pub struct ReadError {
    /// The file.
    pub path: String,
    /// Why.
    pub source: std::io::Error,
}

/// Reads and checks `path`.
pub fn load(path: &Path) -> Result<Loaded, ReadError> {
    let bytes = std::fs::read(path).map_err(|source| ReadError {
        path: path.display().to_string(),
        source,
    })?;
    Ok(load_bytes(path, &bytes))
}

/// [`load`] over the file's bytes.
pub fn load_bytes(path: &Path, bytes: &[u8]) -> Loaded {
    let mut r = Reader {
        out: Loaded {
            path: path.to_path_buf(),
            format: None,
            lines: 0,
            mocks: Vec::new(),
            entries: Vec::new(),
            problems: Vec::new(),
            duration_ms: None,
        },
        pending: HashMap::new(),
        last_request: None,
        first_time: None,
        last_time: None,
    };
    for (i, raw) in bytes.split(|b| *b == b'\n').enumerate() {
        let line = i + 1;
        let Ok(text) = std::str::from_utf8(raw) else {
            r.problem(line, "not UTF-8".to_owned());
            continue;
        };
        let text = text.trim();
        if text.is_empty() {
            continue;
        }
        r.out.lines += 1;
        match parse_line(text) {
            Ok(record) => r.record(line, record),
            Err(e) => r.problem(line, e.to_string()),
        }
    }
    if let (Some(a), Some(b)) = (r.first_time, r.last_time) {
        r.out.duration_ms = Some(b - a);
    }
    r.out
}

struct Reader {
    out: Loaded,
    /// F2: request id → index of its call in `entries`, until its `res`.
    pending: HashMap<String, usize>,
    /// F4: index of the last request in `entries`, until its result.
    last_request: Option<usize>,
    /// Timeline, in ms.
    first_time: Option<f64>,
    last_time: Option<f64>,
}

impl Reader {
    fn problem(&mut self, line: usize, problem: String) {
        self.out.problems.push(Problem { line, problem });
    }

    fn record(&mut self, line: usize, record: Record) {
        let format = record.format();
        match self.out.format {
            None => self.out.format = Some(format),
            Some(f) if f != format => {
                self.problem(
                    line,
                    format!("mixed formats: an {format} line in an {f} file (its first record is {f})"),
                );
                return;
            }
            Some(_) => {}
        }
        match record {
            Record::F1(l) => self.f1(line, l),
            Record::F2(l) => self.f2(line, l),
            Record::F3 { ns, method } => self.out.mocks.push(format!("{ns}.{method}")),
            Record::F4(l) => self.f4(line, l),
        }
    }

    /// The timeline is monotonic (non-decreasing).
    fn time(&mut self, line: usize, t: f64, shown: &str) {
        if let Some(last) = self.last_time
            && t < last
        {
            self.problem(
                line,
                format!("the timeline goes back: {shown} is before the line above"),
            );
            return;
        }
        self.first_time.get_or_insert(t);
        self.last_time = Some(t);
    }

    fn call(&mut self, call: Call) -> usize {
        if call.ns == "tools" && !methods::ALL.contains(&call.name().as_str()) {
            self.problem(
                call.line,
                format!(
                    "unknown method {}: not one of {}",
                    call.name(),
                    methods::ALL.join(", ")
                ),
            );
        }
        self.out.entries.push(Entry::Call(call));
        self.out.entries.len() - 1
    }

    fn f1(&mut self, line: usize, l: F1Line) {
        match l {
            F1Line::Out {
                t,
                ns,
                method,
                args,
                outcome,
            } => {
                self.time(line, t, &format!("t {t}"));
                self.call(Call {
                    line,
                    id: None,
                    ns,
                    method,
                    args,
                    recorded: Some(Recorded { line, outcome }),
                });
            }
            F1Line::In { t, name } => {
                self.time(line, t, &format!("t {t}"));
                self.out.entries.push(Entry::Event { line, name });
            }
        }
    }

    fn f2(&mut self, line: usize, l: F2Line) {
        match l {
            F2Line::Meta { t } => self.time(line, t, &format!("t {t}")),
            F2Line::Event { t, kind } => {
                self.time(line, t, &format!("t {t}"));
                self.out.entries.push(Entry::Event { line, name: kind });
            }
            F2Line::Req {
                t,
                id,
                ns,
                method,
                args,
            } => {
                self.time(line, t, &format!("t {t}"));
                if let Some(&earlier) = self.pending.get(&id) {
                    let at = self.line_of(earlier);
                    self.problem(
                        line,
                        format!("req id {id} is already waiting for its res (line {at})"),
                    );
                    return;
                }
                let index = self.call(Call {
                    line,
                    id: Some(id.clone()),
                    ns,
                    method,
                    args,
                    recorded: None,
                });
                self.pending.insert(id, index);
            }
            F2Line::Res { t, id, outcome } => {
                self.time(line, t, &format!("t {t}"));
                match self.pending.remove(&id) {
                    Some(index) => {
                        if let Some(Entry::Call(c)) = self.out.entries.get_mut(index) {
                            c.recorded = Some(Recorded { line, outcome });
                        }
                    }
                    None => self.problem(
                        line,
                        format!("a res without req: no req with id {id} waits for one"),
                    ),
                }
            }
        }
    }

    fn f4(&mut self, line: usize, l: F4Line) {
        let ts = match &l {
            F4Line::Event { ts, .. } | F4Line::Request { ts, .. } | F4Line::Result { ts, .. } => ts.clone(),
        };
        match humantime::parse_rfc3339_weak(&ts) {
            Ok(when) => {
                let ms = when
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64() * 1000.0);
                self.time(line, ms, &format!("ts {ts}"));
            }
            Err(_) => self.problem(line, format!("ts {ts:?} is not an ISO-8601 (RFC 3339) timestamp")),
        }
        match l {
            F4Line::Event { name, .. } => {
                self.out.entries.push(Entry::Event {
                    line,
                    name: name.unwrap_or_else(|| "event".to_owned()),
                });
            }
            F4Line::Request { method, params, .. } => {
                let (ns, method, args) = f4_call(method, params);
                let index = self.call(Call {
                    line,
                    id: None,
                    ns,
                    method,
                    args,
                    recorded: None,
                });
                self.last_request = Some(index);
            }
            F4Line::Result { outcome, .. } => match self.last_request.take() {
                Some(index) => {
                    if let Some(Entry::Call(c)) = self.out.entries.get_mut(index) {
                        c.recorded = Some(Recorded { line, outcome });
                    }
                }
                None => self.problem(
                    line,
                    "a result without a request: no app→host rpc line before it".to_owned(),
                ),
            },
        }
    }

    fn line_of(&self, index: usize) -> usize {
        match self.out.entries.get(index) {
            Some(Entry::Call(c)) => c.line,
            Some(Entry::Event { line, .. }) => *line,
            None => 0,
        }
    }
}

/// An F4 request's namespace, method and arguments: the runtime RPC envelope (`params: {ns, method, args}`),
/// else `ns.method` written as the method, else the method as written with no namespace.
fn f4_call(method: String, params: Value) -> (String, String, Value) {
    if let (Some(ns), Some(m)) = (
        params.get("ns").and_then(Value::as_str),
        params.get("method").and_then(Value::as_str),
    ) {
        let args = params
            .get("args")
            .cloned()
            .unwrap_or_else(|| Value::Object(Default::default()));
        return (ns.to_owned(), m.to_owned(), args);
    }
    match method.split_once('.') {
        Some((ns, m)) if !method.contains(char::is_whitespace) && !ns.is_empty() && !m.is_empty() => {
            (ns.to_owned(), m.to_owned(), params)
        }
        _ => (String::new(), method, params),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load_text(text: &str) -> Loaded {
        load_bytes(Path::new("test.jsonl"), text.as_bytes())
    }

    fn calls(l: &Loaded) -> Vec<&Call> {
        l.entries
            .iter()
            .filter_map(|e| match e {
                Entry::Call(c) => Some(c),
                Entry::Event { .. } => None,
            })
            .collect()
    }

    #[test]
    fn f2_pairs_req_and_res_by_id() {
        let l = load_text(concat!(
            r#"{"t":0,"kind":"meta","harness_version":"0.1"}"#,
            "\n",
            r#"{"t":1,"kind":"req","id":1,"ns":"window","method":"hello","args":{}}"#,
            "\n",
            r#"{"t":2,"kind":"req","id":2,"ns":"tools","method":"invoke","args":{"tool_id":"echo-py"}}"#,
            "\n\n",
            r#"{"t":3,"kind":"res","id":2,"ok":true,"result":{"success":true,"data":{}}}"#,
            "\n",
            r#"{"t":4,"kind":"res","id":1,"ok":true,"result":{"wid":"w"}}"#,
            "\n",
            r#"{"t":1800,"kind":"auth.refresh","token":"t"}"#,
        ));
        assert_eq!(l.problems, vec![]);
        assert_eq!(l.format, Some(Format::F2));
        assert_eq!(l.lines, 6);
        assert_eq!(l.duration_ms, Some(1800.0));
        let c = calls(&l);
        assert_eq!(c.len(), 2);
        assert_eq!(
            (c[0].name(), c[0].recorded.as_ref().map(|r| r.line)),
            ("window.hello".into(), Some(6))
        );
        assert_eq!(
            (c[1].name(), c[1].recorded.as_ref().map(|r| r.line)),
            ("tools.invoke".into(), Some(5))
        );
        assert_eq!(c[1].tool_id(), Some("echo-py"));
        assert!(matches!(l.entries.last(), Some(Entry::Event { line: 7, .. })));
    }

    #[test]
    fn every_broken_line_is_named() {
        let l = load_text(concat!(
            r#"{"t":0,"kind":"req","id":1,"ns":"tools","method":"invoke"}"#,
            "\n",
            r#"{"t":1,"kind":"res","id":9,"ok":true,"result":{}}"#,
            "\n",
            "{not json\n",
            r#"{"t":2,"dir":"out","ns":"tools","method":"invoke","result":{}}"#,
            "\n",
            r#"{"t":3,"kind":"req","ns":"tools","method":"invoke"}"#,
            "\n",
            r#"{"what":1}"#,
            "\n",
            r#"{"t":2,"kind":"req","id":1,"ns":"tools","method":"list"}"#,
            "\n",
            r#"{"t":5,"kind":"req","id":3,"ns":"tools","method":"explode"}"#,
        ));
        let lines: Vec<usize> = l.problems.iter().map(|p| p.line).collect();
        assert_eq!(lines, vec![2, 3, 4, 5, 6, 7, 8], "{:#?}", l.problems);
        let text: Vec<&str> = l.problems.iter().map(|p| p.problem.as_str()).collect();
        assert!(text[0].contains("res without req"), "{}", text[0]);
        assert!(text[1].starts_with("bad JSON"), "{}", text[1]);
        assert!(text[2].contains("mixed formats"), "{}", text[2]);
        assert!(text[3].contains("missing required field `id`"), "{}", text[3]);
        assert!(text[4].starts_with("unknown format"), "{}", text[4]);
        assert!(text[5].contains("already waiting"), "{}", text[5]);
        assert!(text[6].contains("unknown method tools.explode"), "{}", text[6]);
    }

    #[test]
    fn a_timeline_that_goes_back_is_a_problem() {
        let l = load_text(concat!(
            r#"{"t":10,"dir":"in","name":"a"}"#,
            "\n",
            r#"{"t":5,"dir":"in","name":"b"}"#,
        ));
        assert_eq!(l.problems.len(), 1);
        assert_eq!(l.problems[0].line, 2);
    }

    #[test]
    fn f4_pairs_by_adjacency_and_reads_the_runtime_envelope() {
        let l = load_text(concat!(
            r#"{"type":"event","ts":"2025-11-01T00:00:00Z","direction":"app→host","method":"connect","params":{}}"#,
            "\n",
            r#"{"type":"rpc","ts":"2025-11-01T00:00:01Z","direction":"app→host","method":"POST /api/v1/anna-apps/runtime/rpc","params":{"ns":"tools","method":"invoke","args":{"tool_id":"x"}}}"#,
            "\n",
            r#"{"type":"rpc","ts":"2025-11-01T00:00:02Z","direction":"host→app","result":{"success":true}}"#,
            "\n",
            r#"{"type":"rpc","ts":"2025-11-01T00:00:03Z","direction":"app→host","method":"POST /api/v1/copilot/app/image/generate","params":{"n":1}}"#,
            "\n",
            r#"{"type":"rpc","ts":"2025-11-01T00:00:04Z","direction":"host→app","result":{}}"#,
            "\n",
            r#"{"type":"rpc","ts":"2025-11-01T00:00:05Z","direction":"host→app","result":{}}"#,
        ));
        assert_eq!(l.format, Some(Format::F4));
        assert_eq!(l.problems.len(), 1, "{:?}", l.problems);
        assert_eq!(l.problems[0].line, 6);
        assert_eq!(l.duration_ms, Some(5000.0));
        let c = calls(&l);
        assert_eq!(c[0].name(), "tools.invoke");
        assert_eq!(c[0].tool_id(), Some("x"));
        assert_eq!(c[0].recorded.as_ref().map(|r| r.line), Some(3));
        assert_eq!(c[1].name(), "POST /api/v1/copilot/app/image/generate");
    }

    #[test]
    fn a_mock_file_is_f3() {
        let l = load_text(concat!(
            r#"{"ns":"llm","method":"complete","match":{"contentIncludes":"weather"},"result":{}}"#,
            "\n",
            r#"{"ns":"agent","method":"session.run","events":[]}"#,
        ));
        assert_eq!(l.format, Some(Format::F3));
        assert_eq!(l.mocks, vec!["llm.complete", "agent.session.run"]);
        assert!(l.problems.is_empty());
    }
}
