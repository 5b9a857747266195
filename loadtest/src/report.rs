//! Reports: `report.json`, `report.md`, `latency.svg`, and the SLO verdicts from `slo.toml`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::engine::{Recorder, lock, to_u64};

/// Per operation, per second: (p50, p99) in ms, or `None` for an empty second.
type Series = Vec<(String, Vec<Option<(f64, f64)>>)>;

/// The SLO file shipped with the binary (`loadtest/slo.toml`); `LOADTEST_SLO_FILE` overrides it.
pub(crate) const DEFAULT_SLO: &str = include_str!("../slo.toml");

/// One scenario's thresholds.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Slo {
    /// Upper bound of p99 per operation, ms.
    #[serde(default)]
    pub p99_ms: BTreeMap<String, f64>,
    /// Upper bound of p50 per operation, ms.
    #[serde(default)]
    pub p50_ms: BTreeMap<String, f64>,
    /// Errors (except `expected_errors`) / operations.
    pub(crate) max_error_rate: Option<f64>,
    /// When set, `max_error_rate` counts only these operations (every error code of them): the quiet side of
    /// `fairness` / `hostile-neighbour`.
    #[serde(default)]
    pub(crate) error_rate_ops: Vec<String>,
    /// Jobs accepted but never seen terminal.
    pub(crate) max_jobs_lost: Option<u64>,
    /// Codes the scenario provokes on purpose: not counted by `max_error_rate`.
    #[serde(default)]
    pub(crate) expected_errors: Vec<String>,
    /// Codes that must occur at least once (the scenario must actually hit the limit it tests).
    #[serde(default)]
    pub(crate) required_errors: Vec<String>,
    /// Upper bounds of scenario counters (e.g. `not_cancelled = 0`).
    #[serde(default)]
    pub(crate) max_counters: BTreeMap<String, u64>,
    /// Lower bounds of scenario counters (e.g. `workers_killed = 1`).
    #[serde(default)]
    pub(crate) min_counters: BTreeMap<String, u64>,
    /// Upper bounds of p99 ratios between two operations measured in the same run, keyed `"a/b"` (p99 of `a`
    /// over p99 of `b`): e.g. the quiet tenant next to a hostile one against its solo baseline.
    #[serde(default)]
    pub(crate) max_p99_ratio: BTreeMap<String, f64>,
}

/// Parses an SLO file: a table per scenario.
pub(crate) fn parse_slo(text: &str) -> anyhow::Result<BTreeMap<String, Slo>> {
    Ok(toml::from_str(text)?)
}

fn ms(us: u64) -> f64 {
    (us as f64 / 1000.0 * 1000.0).round() / 1000.0
}

fn op_json(h: &Histogram<u64>, ok: u64, errors: u64, elapsed: Duration) -> Value {
    let count = ok + errors;
    let secs = elapsed.as_secs_f64().max(0.001);
    let q = |p: f64| {
        if h.is_empty() {
            0.0
        } else {
            ms(h.value_at_quantile(p))
        }
    };
    json!({
        "count": count,
        "ok": ok,
        "errors": errors,
        "throughput_per_s": (count as f64 / secs * 100.0).round() / 100.0,
        "p50_ms": q(0.50),
        "p90_ms": q(0.90),
        "p99_ms": q(0.99),
        "max_ms": if h.is_empty() { 0.0 } else { ms(h.max()) },
    })
}

/// Builds `report.json`'s value (SLO verdicts included).
pub(crate) fn build(rec: &Recorder, head: Value, elapsed: Duration, slo: Option<&Slo>) -> Value {
    let ops = lock(&rec.ops);
    let operations: serde_json::Map<String, Value> = ops
        .iter()
        .map(|(name, s)| (name.clone(), op_json(&s.hist, s.ok, s.errors, elapsed)))
        .collect();
    let total: u64 = ops.values().map(|s| s.ok + s.errors).sum();
    drop(ops);
    let errors = lock(&rec.errors).clone();
    let counters = lock(&rec.counters).clone();
    let accepted = rec.jobs.accepted.load(Ordering::Relaxed);
    let terminal = rec.jobs.terminal.load(Ordering::Relaxed);
    let lost = accepted.saturating_sub(terminal);
    let by_state = lock(&rec.jobs.by_state).clone();
    let mut report = head;
    report["elapsed_s"] = json!((elapsed.as_secs_f64() * 100.0).round() / 100.0);
    report["operations"] = Value::Object(operations.clone());
    report["errors"] = json!(errors);
    report["jobs"] =
        json!({ "accepted": accepted, "terminal": terminal, "lost": lost, "by_state": by_state });
    report["warm_hit_ratio"] = Value::Null;
    report["warm_hit_ratio_note"] = json!("not measured");
    report["counters"] = json!(counters);
    let mut checks = Vec::new();
    if let Some(slo) = slo {
        let mut check = |name: String, limit: Value, actual: Value, passed: bool| {
            checks.push(json!({ "check": name, "limit": limit, "actual": actual, "passed": passed }));
        };
        for (field, table) in [("p99_ms", &slo.p99_ms), ("p50_ms", &slo.p50_ms)] {
            for (op, limit) in table {
                match operations
                    .get(op)
                    .and_then(|o| o.get(field))
                    .and_then(Value::as_f64)
                {
                    Some(actual) => check(
                        format!("{field}.{op}"),
                        json!(limit),
                        json!(actual),
                        actual <= *limit,
                    ),
                    None => check(format!("{field}.{op}"), json!(limit), Value::Null, false),
                }
            }
        }
        if let Some(limit) = slo.max_error_rate
            && !slo.error_rate_ops.is_empty()
        {
            let pick = |k: &str| {
                slo.error_rate_ops
                    .iter()
                    .filter_map(|op| operations.get(op).and_then(|o| o[k].as_u64()))
                    .sum::<u64>()
            };
            let (errs, count) = (pick("errors"), pick("count"));
            let rate = if count == 0 {
                0.0
            } else {
                errs as f64 / count as f64
            };
            let rate = (rate * 10_000.0).round() / 10_000.0;
            check(
                format!("max_error_rate({})", slo.error_rate_ops.join(",")),
                json!(limit),
                json!(rate),
                rate <= limit,
            );
        } else if let Some(limit) = slo.max_error_rate {
            let unexpected: u64 = errors
                .iter()
                .filter(|(code, _)| !slo.expected_errors.contains(code))
                .map(|(_, n)| n)
                .sum();
            let rate = if total == 0 {
                0.0
            } else {
                unexpected as f64 / total as f64
            };
            let rate = (rate * 10_000.0).round() / 10_000.0;
            check("max_error_rate".into(), json!(limit), json!(rate), rate <= limit);
        }
        for (pair, limit) in &slo.max_p99_ratio {
            let p99 = |op: &str| {
                operations
                    .get(op)
                    .and_then(|o| o.get("p99_ms"))
                    .and_then(Value::as_f64)
            };
            let ratio = pair
                .split_once('/')
                .and_then(|(a, b)| Some((p99(a)?, p99(b)?)))
                .filter(|(_, b)| *b > 0.0)
                .map(|(a, b)| (a / b * 1000.0).round() / 1000.0);
            match ratio {
                Some(r) => check(
                    format!("max_p99_ratio.{pair}"),
                    json!(limit),
                    json!(r),
                    r <= *limit,
                ),
                None => check(format!("max_p99_ratio.{pair}"), json!(limit), Value::Null, false),
            }
        }
        if let Some(limit) = slo.max_jobs_lost {
            check("max_jobs_lost".into(), json!(limit), json!(lost), lost <= limit);
        }
        for code in &slo.required_errors {
            let n = errors.get(code).copied().unwrap_or(0);
            check(format!("required_errors.{code}"), json!(">= 1"), json!(n), n >= 1);
        }
        for (name, limit) in &slo.max_counters {
            let n = counters.get(name).copied().unwrap_or(0);
            check(
                format!("max_counters.{name}"),
                json!(limit),
                json!(n),
                n <= *limit,
            );
        }
        for (name, limit) in &slo.min_counters {
            let n = counters.get(name).copied().unwrap_or(0);
            check(
                format!("min_counters.{name}"),
                json!(format!(">= {limit}")),
                json!(n),
                n >= *limit,
            );
        }
        check(
            "operations_completed".into(),
            json!(">= 1"),
            json!(total),
            total >= 1,
        );
    }
    let passed = checks.iter().all(|c| c["passed"] == json!(true));
    report["slo"] = json!({ "defined": slo.is_some(), "passed": passed, "checks": checks });
    report
}

/// `report.md`.
pub(crate) fn markdown(r: &Value) -> String {
    let mut md = String::new();
    let s = |v: &Value| match v {
        Value::String(s) => s.clone(),
        Value::Null => "null".into(),
        other => other.to_string(),
    };
    let _ = writeln!(
        md,
        "# loadtest `{}`\n\n{}\n",
        s(&r["scenario"]),
        s(&r["description"])
    );
    let p = &r["parameters"];
    let _ = writeln!(
        md,
        "Rate {} /s for {} s (elapsed {} s incl. drain), NATS {}, spawned fleet: {}, native echo: {}.\n",
        s(&p["rate"]),
        s(&p["duration_s"]),
        s(&r["elapsed_s"]),
        s(&p["nats_url"]),
        s(&p["spawned"]),
        s(&p["native_echo"])
    );
    let _ = writeln!(
        md,
        "| operation | count | errors | throughput /s | p50 ms | p90 ms | p99 ms | max ms |"
    );
    let _ = writeln!(md, "|---|---:|---:|---:|---:|---:|---:|---:|");
    if let Some(ops) = r["operations"].as_object() {
        for (name, o) in ops {
            let _ = writeln!(
                md,
                "| {name} | {} | {} | {} | {} | {} | {} | {} |",
                s(&o["count"]),
                s(&o["errors"]),
                s(&o["throughput_per_s"]),
                s(&o["p50_ms"]),
                s(&o["p90_ms"]),
                s(&o["p99_ms"]),
                s(&o["max_ms"])
            );
        }
    }
    let j = &r["jobs"];
    let _ = writeln!(
        md,
        "\nJobs: accepted {}, terminal {}, **lost {}** (terminal states: {}).\n",
        s(&j["accepted"]),
        s(&j["terminal"]),
        s(&j["lost"]),
        s(&j["by_state"])
    );
    let _ = writeln!(md, "Errors by code: {}.\n", s(&r["errors"]));
    let _ = writeln!(md, "Counters: {}.\n", s(&r["counters"]));
    let _ = writeln!(
        md,
        "Warm-hit ratio: {} ({}).\n",
        s(&r["warm_hit_ratio"]),
        s(&r["warm_hit_ratio_note"])
    );
    let slo = &r["slo"];
    if slo["defined"] == json!(true) {
        let verdict = if slo["passed"] == json!(true) {
            "PASSED"
        } else {
            "FAILED"
        };
        let _ = writeln!(
            md,
            "## SLO: {verdict}\n\n| check | limit | actual | passed |\n|---|---|---|---|"
        );
        for c in slo["checks"].as_array().into_iter().flatten() {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} |",
                s(&c["check"]),
                s(&c["limit"]),
                s(&c["actual"]),
                if c["passed"] == json!(true) {
                    "yes"
                } else {
                    "**no**"
                }
            );
        }
    } else {
        let _ = writeln!(md, "## SLO: none defined for this scenario");
    }
    let _ = writeln!(md, "\n![latency over time](latency.svg)");
    md
}

const COLORS: &[&str] = &[
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
];

/// `latency.svg`: p50 (dashed) and p99 (solid) per 1-second bucket over time, one colour per operation.
pub(crate) fn svg(rec: &Recorder, title: &str) -> String {
    let ops = lock(&rec.ops);
    let series: Series = ops
        .iter()
        .filter(|(_, s)| !s.buckets.is_empty())
        .map(|(name, s)| {
            let pts = s
                .buckets
                .iter()
                .map(|h| {
                    (!h.is_empty()).then(|| {
                        (
                            h.value_at_quantile(0.5) as f64 / 1000.0,
                            h.value_at_quantile(0.99) as f64 / 1000.0,
                        )
                    })
                })
                .collect();
            (name.clone(), pts)
        })
        .collect();
    drop(ops);
    let (w, h, left, right, top, bottom) = (900.0, 420.0, 70.0, 180.0, 40.0, 50.0);
    let pw = w - left - right;
    let ph = h - top - bottom;
    let secs = series.iter().map(|(_, p)| p.len()).max().unwrap_or(1).max(1) as f64;
    let ymax = series
        .iter()
        .flat_map(|(_, p)| p.iter().flatten().map(|(_, p99)| *p99))
        .fold(1.0_f64, f64::max)
        * 1.1;
    let x = |i: usize| left + pw * (i as f64 + 0.5) / secs;
    let y = |v: f64| top + ph - ph * (v / ymax).min(1.0);
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{left}" y="22" font-size="14">{} — latency per 1 s bucket (solid p99, dashed p50)</text>"#,
        xml(title)
    );
    for k in 0..=4 {
        let v = ymax * f64::from(k) / 4.0;
        let yy = y(v);
        let _ = writeln!(
            out,
            r##"<line x1="{left}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{v:.1} ms</text>"##,
            left + pw,
            left - 6.0,
            yy + 4.0
        );
    }
    let step = usize::try_from(to_u64((secs / 10.0).ceil().max(1.0))).unwrap_or(1);
    for i in (0..usize::try_from(to_u64(secs)).unwrap_or(0)).step_by(step) {
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{i}s</text>"#,
            x(i),
            top + ph + 18.0
        );
    }
    let _ = writeln!(
        out,
        r##"<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#333"/><text x="{:.1}" y="{:.1}" text-anchor="middle">seconds since start (by intended start)</text>"##,
        left + pw / 2.0,
        h - 10.0
    );
    for (n, (name, pts)) in series.iter().enumerate() {
        let color = COLORS[n % COLORS.len()];
        for (which, dash) in [(0usize, r#" stroke-dasharray="4 3""#), (1, "")] {
            let points: Vec<String> = pts
                .iter()
                .enumerate()
                .filter_map(|(i, p)| {
                    p.map(|(p50, p99)| format!("{:.1},{:.1}", x(i), y(if which == 0 { p50 } else { p99 })))
                })
                .collect();
            if !points.is_empty() {
                let _ = writeln!(
                    out,
                    r#"<polyline fill="none" stroke="{color}" stroke-width="2"{dash} points="{}"/>"#,
                    points.join(" ")
                );
            }
        }
        let ly = top + 16.0 * n as f64 + 10.0;
        let _ = writeln!(
            out,
            r#"<line x1="{:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{color}" stroke-width="3"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            left + pw + 10.0,
            left + pw + 30.0,
            left + pw + 36.0,
            ly + 4.0,
            xml(name)
        );
    }
    let _ = writeln!(out, "</svg>");
    out
}

fn xml(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// Writes the three files.
pub(crate) fn write(dir: &Path, report: &Value, rec: &Recorder) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(
        dir.join("report.json"),
        serde_json::to_string_pretty(report)? + "\n",
    )?;
    std::fs::write(dir.join("report.md"), markdown(report))?;
    let title = report["scenario"].as_str().unwrap_or("loadtest");
    std::fs::write(dir.join("latency.svg"), svg(rec, title))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_slo_file_parses_and_names_known_scenarios() {
        let slo = parse_slo(DEFAULT_SLO).unwrap();
        for name in slo.keys() {
            assert!(
                crate::scenarios::find(name).is_some(),
                "unknown scenario {name} in slo.toml"
            );
        }
        for s in crate::scenarios::SCENARIOS.iter().filter(|s| s.implemented) {
            assert!(slo.contains_key(s.name), "no SLO for {}", s.name);
        }
    }

    #[test]
    fn slo_checks_fail_and_pass() {
        let rec = Recorder::new();
        let t = std::time::Instant::now();
        rec.record("invoke", t, Ok(()));
        rec.record("invoke", t, Err("rate_limited"));
        let slo = Slo {
            max_error_rate: Some(0.1),
            ..Slo::default()
        };
        let r = build(&rec, json!({}), Duration::from_secs(1), Some(&slo));
        assert_eq!(r["slo"]["passed"], json!(false));
        let slo = Slo {
            max_error_rate: Some(0.1),
            expected_errors: vec!["rate_limited".into()],
            required_errors: vec!["rate_limited".into()],
            ..Slo::default()
        };
        let r = build(&rec, json!({}), Duration::from_secs(1), Some(&slo));
        assert_eq!(r["slo"]["passed"], json!(true), "{r}");
        assert_eq!(r["operations"]["invoke"]["count"], json!(2));
        assert!(svg(&rec, "t").contains("<polyline"));
        assert!(markdown(&r).contains("| invoke | 2 | 1 |"));
    }
}
