//! What `fleet replay` and `fleet fixture` print: a per-call table and a summary, or JSON.

use std::collections::BTreeMap;
use std::io::Write as _;

use serde_json::{Value, json};

use super::engine::{Row, Verdict};
use super::load::{Entry, Loaded};

/// Longest value shown in a table cell.
const CELL_MAX: usize = 60;

/// A replay's report.
#[derive(Debug)]
pub struct Report {
    file: String,
    format: String,
    strict: bool,
    rows: Vec<Row>,
}

impl Report {
    /// The report of `rows` replayed from `loaded`.
    pub fn new(loaded: &Loaded, rows: Vec<Row>, strict: bool) -> Report {
        Report {
            file: loaded.path.display().to_string(),
            format: loaded.format.map(|f| f.as_str().to_owned()).unwrap_or_default(),
            strict,
            rows,
        }
    }

    fn count(&self, v: Verdict) -> usize {
        self.rows.iter().filter(|r| r.verdict == v).count()
    }

    fn rejected(&self) -> usize {
        self.rows.iter().filter(|r| r.rejected.is_some()).count()
    }

    /// No mismatch and nothing the manifest rejects.
    pub fn green(&self) -> bool {
        self.count(Verdict::Mismatch) == 0 && self.rejected() == 0
    }

    fn summary(&self) -> Value {
        json!({
            "calls": self.rows.iter().filter(|r| r.verdict != Verdict::Skipped).count(),
            "pass": self.count(Verdict::Pass),
            "mismatch": self.count(Verdict::Mismatch),
            "no_outcome": self.count(Verdict::NoOutcome),
            "skipped": self.count(Verdict::Skipped),
            "rejected": self.rejected(),
            "extra_fields": self.rows.iter().map(|r| r.extra.len()).sum::<usize>(),
            "green": self.green(),
        })
    }

    /// `{file, format, strict, calls: [Row…], summary}`.
    pub fn to_json(&self) -> Value {
        json!({
            "file": self.file,
            "format": self.format,
            "strict": self.strict,
            "calls": self.rows,
            "summary": self.summary(),
        })
    }

    /// The table, then the extras, rejections and notes, then the summary line.
    pub fn print_table(&self) {
        let mut lines = vec![format!("replay of {} ({})", self.file, self.format)];
        let header = ["LINE", "ID", "CALL", "VERDICT", "PATH"];
        let cells: Vec<[String; 5]> = self
            .rows
            .iter()
            .map(|r| {
                let path = match (&r.path, r.verdict) {
                    (Some(p), _) => format!(
                        "{p} (recorded {}, replayed {})",
                        shown(r.recorded.as_ref()),
                        shown(r.replayed.as_ref())
                    ),
                    (None, Verdict::Pass) if !r.extra.is_empty() => {
                        format!("+{} extra field(s)", r.extra.len())
                    }
                    _ => String::new(),
                };
                [
                    r.line.to_string(),
                    r.id.clone().unwrap_or_else(|| "-".into()),
                    match &r.tool_id {
                        Some(t) => format!("{} {t}", r.call),
                        None => r.call.clone(),
                    },
                    r.verdict.as_str().to_owned(),
                    path,
                ]
            })
            .collect();
        let width = |i: usize| {
            cells
                .iter()
                .map(|c| c[i].chars().count())
                .chain([header[i].len()])
                .max()
                .unwrap_or(0)
        };
        let widths = [width(0), width(1), width(2), width(3)];
        let row = |c: [&str; 5]| {
            format!(
                "{:>w0$}  {:<w1$}  {:<w2$}  {:<w3$}  {}",
                c[0],
                c[1],
                c[2],
                c[3],
                c[4],
                w0 = widths[0],
                w1 = widths[1],
                w2 = widths[2],
                w3 = widths[3]
            )
            .trim_end()
            .to_owned()
        };
        lines.push(row(header));
        for c in &cells {
            lines.push(row([&c[0], &c[1], &c[2], &c[3], &c[4]]));
        }
        for r in &self.rows {
            for e in &r.extra {
                lines.push(format!(
                    "line {}: extra field {e} (passes{})",
                    r.line,
                    if self.strict { "" } else { " without --strict" }
                ));
            }
            if let Some(why) = &r.rejected {
                lines.push(format!(
                    "line {}: the manifest's ACL would reject {}: {why}",
                    r.line, r.call
                ));
            }
            if let Some(note) = &r.note
                && r.verdict != Verdict::Skipped
            {
                lines.push(format!("line {}: {note}", r.line));
            }
        }
        let s = self.summary();
        lines.push(format!(
            "{} {} call(s): {} pass, {} mismatch, {} without a recorded outcome; {} skipped; {} rejected by the manifest",
            if self.green() { "✓" } else { "✗" },
            s["calls"],
            s["pass"],
            s["mismatch"],
            s["no_outcome"],
            s["skipped"],
            s["rejected"],
        ));
        print_text(&lines.join("\n"));
    }
}

/// A value for a table cell: compact JSON, cut at [`CELL_MAX`] characters; `absent` for none.
fn shown(v: Option<&Value>) -> String {
    match v {
        None => "absent".into(),
        Some(v) => {
            let s = v.to_string();
            if s.chars().count() > CELL_MAX {
                format!("{}…", s.chars().take(CELL_MAX).collect::<String>())
            } else {
                s
            }
        }
    }
}

/// A result of `fleet fixture`, as text and as JSON.
#[derive(Debug)]
pub struct Printed {
    /// For people.
    pub text: String,
    /// For machines.
    pub json: Value,
}

/// `fleet fixture verify`: each problem as `FILE:LINE: problem`, then one line per file.
pub fn verify(files: &[Loaded]) -> Printed {
    let mut text = Vec::new();
    let mut out = Vec::new();
    for l in files {
        let file = l.path.display().to_string();
        for p in &l.problems {
            text.push(format!("{file}:{}: {}", p.line, p.problem));
        }
        let format = l
            .format
            .map_or("none".to_owned(), |f| format!("{f}, {}", f.describe()));
        let mark = if l.problems.is_empty() && l.format.is_some() {
            "✓"
        } else {
            "✗"
        };
        text.push(format!(
            "{mark} {file}: {format}; {} line(s), {} issue(s)",
            l.lines,
            l.problems.len()
        ));
        out.push(json!({
            "file": file,
            "format": l.format.map(|f| f.as_str()),
            "lines": l.lines,
            "problems": l.problems,
            "ok": l.problems.is_empty() && l.format.is_some(),
        }));
    }
    Printed {
        text: text.join("\n"),
        json: json!({ "files": out }),
    }
}

/// `fleet fixture summarize`: per file its format, calls per ns.method, tool_ids, outcomes, events, duration.
pub fn summarize(files: &[Loaded]) -> Printed {
    let mut text = Vec::new();
    let mut out = Vec::new();
    for l in files {
        let file = l.path.display().to_string();
        let mut calls: BTreeMap<String, usize> = BTreeMap::new();
        let mut tools: BTreeMap<String, usize> = BTreeMap::new();
        let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
        let mut events: BTreeMap<String, usize> = BTreeMap::new();
        for e in &l.entries {
            match e {
                Entry::Call(c) => {
                    *calls.entry(c.name()).or_default() += 1;
                    if let Some(t) = c.tool_id() {
                        let tool = match c.args.get("method").and_then(Value::as_str) {
                            Some(m) => format!("{t}.{m}"),
                            None => t.to_owned(),
                        };
                        *tools.entry(tool).or_default() += 1;
                    }
                    let outcome = match &c.recorded {
                        None => "no outcome".to_owned(),
                        Some(r) => match r.outcome.error_code() {
                            Some(code) => format!("error {code}"),
                            None => "ok".to_owned(),
                        },
                    };
                    *outcomes.entry(outcome).or_default() += 1;
                }
                Entry::Event { name, .. } => *events.entry(name.clone()).or_default() += 1,
            }
        }
        for m in &l.mocks {
            *calls.entry(m.clone()).or_default() += 1;
        }
        let list = |m: &BTreeMap<String, usize>| {
            let mut v: Vec<(&String, &usize)> = m.iter().collect();
            v.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
            v.iter()
                .map(|(k, n)| format!("{k} ({n})"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let format = l
            .format
            .map_or("none".to_owned(), |f| format!("{f}, {}", f.describe()));
        text.push(file.clone());
        text.push(format!("  Format: {format}"));
        text.push(format!("  Lines: {}, issues: {}", l.lines, l.problems.len()));
        if l.format == Some(fleet_proto::recording::Format::F3) {
            text.push(format!("  Mock entries: {}", list(&calls)));
        } else {
            text.push(format!("  Calls: {}", list(&calls)));
            text.push(format!("  Top tools: {}", list(&tools)));
            text.push(format!("  Outcomes: {}", list(&outcomes)));
            text.push(format!("  Events: {}", list(&events)));
        }
        if let Some(ms) = l.duration_ms {
            text.push(format!("  Duration: {:.1}s", ms / 1000.0));
        }
        out.push(json!({
            "file": file,
            "format": l.format.map(|f| f.as_str()),
            "lines": l.lines,
            "issues": l.problems.len(),
            "calls": calls,
            "tool_ids": tools,
            "outcomes": outcomes,
            "events": events,
            "duration_ms": l.duration_ms,
        }));
    }
    Printed {
        text: text.join("\n"),
        json: json!({ "files": out }),
    }
}

/// Pretty JSON on stdout.
pub fn print_json(v: &Value) {
    print_text(&serde_json::to_string_pretty(v).unwrap_or_default());
}

/// Text on stdout (a closed pipe is not an error worth a panic).
pub fn print_text(text: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{text}");
    let _ = out.flush();
}
