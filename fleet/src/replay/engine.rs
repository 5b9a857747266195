//! Driving a recording's `tools.*` calls through a fleet and judging each against its recorded outcome.
//!
//! What is compared (spec §15.4 HR-FX-01), as a projection of the recorded line's envelope so every path names a
//! field of the recording (`$.ok`, `$.error.code`, `$.result.data.…`):
//! - every call: `ok`, and `error.code` when it failed;
//! - `tools.invoke`: the `success` / `data` of a recorded `InvokeResult` (F2 stores the plugin's whole result;
//!   the fleet answers the payload, a plugin's `success: false` as `tool_failed`), or the whole result when the
//!   recording stored the payload itself;
//! - `tools.invokeAsync`: `result.state`; the job is then followed: at a recorded `tools.getJob` whose snapshot is
//!   terminal, the replayed job is polled to its end and its `state`, `result` and `error.code` compared;
//!   jobs the recording never saw end are polled to their end after the last line and their state reported.
//!
//! Recorded job ids are replaced by the replayed ones in later calls; `--map-tool OLD=NEW` rewrites `tool_id`.

use std::collections::HashMap;
use std::time::Duration;

use fleet_client::api::{ApiClient, wait_for};
use fleet_proto::api::{ApiError, JobState, methods};
use fleet_proto::app_manifest::AppManifestAcl;
use fleet_proto::recording::Outcome;
use serde::Serialize;
use serde_json::{Map, Value, json};

use super::acl::rejection;
use super::diff::diff;
use super::load::{Call, Entry};

/// Between two `tools.getJob` of a job being followed to its end.
pub const JOB_POLL_EVERY: Duration = Duration::from_millis(200);
/// After a job's own deadline, how long its terminal state may take to be written (the sweeper's expiry).
pub const JOB_END_GRACE: Duration = Duration::from_secs(30);

/// A call's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    /// Every compared field matches.
    Pass,
    /// A compared field differs.
    Mismatch,
    /// Not a `tools.*` call (or an event): not replayed.
    Skipped,
    /// Replayed, but the recording holds no outcome to compare with.
    NoOutcome,
}

impl Verdict {
    /// As printed.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::Mismatch => "mismatch",
            Verdict::Skipped => "skipped",
            Verdict::NoOutcome => "no-outcome",
        }
    }
}

/// One row of the report.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// The request's line.
    pub line: usize,
    /// The recorded correlation id (F2).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// `ns.method`, or the event's name.
    pub call: String,
    /// The `tool_id` sent (after `--map-tool`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_id: Option<String>,
    /// The verdict.
    pub verdict: Verdict,
    /// The line of the recorded outcome `path` refers to, when it is not `line` (F2: the `res`; F4: the result).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub outcome_line: Option<usize>,
    /// The first differing JSON path (mismatch only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// The recorded value at `path` (absent: the recording has no such field).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recorded: Option<Value>,
    /// The replayed value at `path` (absent: the replay has no such field).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replayed: Option<Value>,
    /// Fields only the replay has (they pass unless `--strict`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub extra: Vec<String>,
    /// Why the `--manifest` ACL would reject the call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rejected: Option<String>,
    /// Anything else worth saying (why skipped, the replayed job's end, …).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl Row {
    fn new(line: usize, id: Option<String>, call: String, verdict: Verdict) -> Row {
        Row {
            line,
            id,
            call,
            tool_id: None,
            verdict,
            outcome_line: None,
            path: None,
            recorded: None,
            replayed: None,
            extra: Vec::new(),
            rejected: None,
            note: None,
        }
    }
}

/// How to replay.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Exact equality: fields only the replay has are mismatches.
    pub strict: bool,
    /// `tool_id` rewrites, old → new.
    pub map_tool: HashMap<String, String>,
    /// The ACL to check every call against.
    pub manifest: Option<AppManifestAcl>,
}

/// A replayed job being followed.
struct Job {
    /// The replayed id.
    id: String,
    /// The row of its `tools.invokeAsync`.
    row: usize,
    /// Its deadline (epoch ms) as the fleet answered.
    deadline_ms: u64,
    /// Its terminal snapshot once polled.
    end: Option<Value>,
}

/// Replays `entries` through `client`.
pub async fn replay(client: &ApiClient, entries: &[Entry], opts: &Options) -> Vec<Row> {
    let mut rows = Vec::new();
    // Recorded job id → the replayed job.
    let mut jobs: HashMap<String, Job> = HashMap::new();
    for entry in entries {
        match entry {
            Entry::Event { line, name } => {
                let mut row = Row::new(*line, None, name.clone(), Verdict::Skipped);
                row.note = Some("event: outside the plugin host".into());
                rows.push(row);
            }
            Entry::Call(call) => {
                let row = replay_call(client, call, opts, &mut jobs, rows.len()).await;
                rows.push(row);
            }
        }
    }
    // Jobs no recorded getJob saw end: followed to their end, reported on their invokeAsync row.
    for job in jobs.values_mut().filter(|j| j.end.is_none()) {
        let note = match follow(client, job).await {
            Ok(end) => format!(
                "replayed job {} ended {} (the recording shows no end to compare)",
                job.id,
                end.get("state").and_then(Value::as_str).unwrap_or("?")
            ),
            Err(e) => format!("replayed job {} not followed to its end: {e}", job.id),
        };
        if let Some(row) = rows.get_mut(job.row) {
            row.note = Some(note);
        }
    }
    rows
}

async fn replay_call(
    client: &ApiClient,
    call: &Call,
    opts: &Options,
    jobs: &mut HashMap<String, Job>,
    index: usize,
) -> Row {
    let name = call.name();
    let mut row = Row::new(call.line, call.id.clone(), name.clone(), Verdict::Skipped);
    row.outcome_line = call.recorded.as_ref().map(|r| r.line).filter(|l| *l != call.line);
    let mut args = call.args.clone();
    if let Some(old) = call.tool_id()
        && let Some(new) = opts.map_tool.get(old)
    {
        args["tool_id"] = json!(new);
    }
    row.tool_id = args.get("tool_id").and_then(Value::as_str).map(str::to_owned);
    if let Some(acl) = &opts.manifest {
        row.rejected = rejection(acl, &call.ns, &call.method, row.tool_id.as_deref());
    }
    if call.ns != "tools" {
        row.note = Some("not a tools.* call: not replayed".into());
        return row;
    }
    // A recorded job id names the replayed job.
    let recorded_job = args.get("jobId").and_then(Value::as_str).map(str::to_owned);
    if let Some(job) = recorded_job.as_deref().and_then(|j| jobs.get(j)) {
        args["jobId"] = json!(job.id);
    }
    let recorded = call.recorded.as_ref().map(|r| &r.outcome);
    // A terminal snapshot recorded for a replayed job: follow the replayed one to its end.
    if name == methods::TOOLS_GET_JOB
        && let Some(Outcome::Ok(snapshot)) = recorded
        && is_terminal(snapshot)
        && let Some(job) = recorded_job.as_deref().and_then(|j| jobs.get_mut(j))
    {
        let replayed = follow(client, job).await;
        let (expected, actual) = (
            job_projection_recorded(snapshot),
            job_projection_replayed(&replayed),
        );
        judge(&mut row, &expected, &actual, opts.strict);
        return row;
    }
    let timeout_ms = args.get("timeoutMs").and_then(Value::as_u64);
    let replayed = client.call(&name, &args, wait_for(&name, timeout_ms)).await;
    if name == methods::TOOLS_INVOKE_ASYNC
        && let Ok(result) = &replayed
        && let Some(id) = result.get("jobId").and_then(Value::as_str)
    {
        let job = Job {
            id: id.to_owned(),
            row: index,
            deadline_ms: result.get("deadlineMs").and_then(Value::as_u64).unwrap_or(0),
            end: None,
        };
        let key = match recorded {
            Some(Outcome::Ok(r)) => r.get("jobId").and_then(Value::as_str).map(str::to_owned),
            _ => None,
        };
        jobs.insert(key.unwrap_or_else(|| format!("line {}", call.line)), job);
    }
    let Some(recorded) = recorded else {
        row.verdict = Verdict::NoOutcome;
        row.note = Some(match &replayed {
            Ok(_) => "the recording has no outcome; replayed: ok".into(),
            Err(e) => format!("the recording has no outcome; replayed: {}", e.code),
        });
        return row;
    };
    let (expected, actual) = if name == methods::TOOLS_INVOKE {
        invoke_projection(recorded, &replayed)
    } else {
        let keep: &[&str] = if name == methods::TOOLS_INVOKE_ASYNC {
            &["state"]
        } else {
            &[]
        };
        (
            envelope_projection(recorded, keep),
            envelope_projection(&outcome_of(&replayed), keep),
        )
    };
    judge(&mut row, &expected, &actual, opts.strict);
    row
}

fn judge(row: &mut Row, expected: &Value, actual: &Value, strict: bool) {
    // A different `ok` is the difference to name, not the `error` or `result` it implies.
    if expected["ok"] != actual["ok"] {
        row.note = Some(match actual["error"]["code"].as_str() {
            Some(code) => format!("replayed: error {code}"),
            None => "replayed: ok".to_owned(),
        });
        let d = diff(
            &json!({ "ok": expected["ok"] }),
            &json!({ "ok": actual["ok"] }),
            strict,
        );
        return judge_diff(row, d);
    }
    judge_diff(row, diff(expected, actual, strict));
}

fn judge_diff(row: &mut Row, d: super::diff::Diff) {
    row.extra = d.extra;
    match d.mismatch {
        None => row.verdict = Verdict::Pass,
        Some(m) => {
            row.verdict = Verdict::Mismatch;
            row.path = Some(m.path);
            row.recorded = m.recorded;
            row.replayed = m.replayed;
        }
    }
}

fn outcome_of(replayed: &Result<Value, ApiError>) -> Outcome {
    match replayed {
        Ok(v) => Outcome::Ok(v.clone()),
        Err(e) => Outcome::Err(serde_json::to_value(e).unwrap_or(Value::Null)),
    }
}

/// `{ok, error: {code}}`, or `{ok, result: {<keep>…}}` with only the `keep` fields of the result.
fn envelope_projection(outcome: &Outcome, keep: &[&str]) -> Value {
    match outcome {
        Outcome::Err(_) => json!({ "ok": false, "error": { "code": outcome.error_code() } }),
        Outcome::Ok(result) => {
            let mut out = json!({ "ok": true });
            let kept: Map<String, Value> = keep
                .iter()
                .filter_map(|k| result.get(*k).map(|v| ((*k).to_owned(), v.clone())))
                .collect();
            if !kept.is_empty() {
                out["result"] = Value::Object(kept);
            }
            out
        }
    }
}

/// The recorded and replayed projections of a `tools.invoke`.
fn invoke_projection(recorded: &Outcome, replayed: &Result<Value, ApiError>) -> (Value, Value) {
    let invoke_result = match recorded {
        Outcome::Ok(r) => r
            .get("success")
            .and_then(Value::as_bool)
            .map(|s| (s, r.get("data"))),
        Outcome::Err(_) => None,
    };
    match (recorded, invoke_result) {
        // An InvokeResult: success and data.
        (_, Some((success, data))) => {
            let mut result = json!({ "success": success });
            if success && let Some(d) = data {
                result["data"] = d.clone();
            }
            let expected = json!({ "ok": true, "result": result });
            let actual = match replayed {
                Ok(payload) => json!({ "ok": true, "result": {
                    "success": true,
                    "data": unwrap_payload(payload, data),
                }}),
                // The fleet answers a plugin's `success: false` as `tool_failed`.
                Err(e) if e.code == fleet_proto::api::ApiErrorCode::ToolFailed => {
                    json!({ "ok": true, "result": { "success": false } })
                }
                Err(_) => envelope_projection(&outcome_of(replayed), &[]),
            };
            // A different `success` is the difference to name, not the `data` it implies.
            let mut expected = expected;
            if actual["result"]["success"] != expected["result"]["success"]
                && let Some(r) = expected["result"].as_object_mut()
            {
                r.remove("data");
            }
            (expected, actual)
        }
        // The payload itself (F1 as documented), or an error.
        (Outcome::Ok(payload), None) => (
            json!({ "ok": true, "result": payload }),
            match replayed {
                Ok(p) => json!({ "ok": true, "result": p }),
                Err(_) => envelope_projection(&outcome_of(replayed), &[]),
            },
        ),
        (Outcome::Err(_), None) => (
            envelope_projection(recorded, &[]),
            envelope_projection(&outcome_of(replayed), &[]),
        ),
    }
}

/// The fleet's payload as the recorded `data` would hold it: a payload that is not an object comes back as
/// `{"value": …}`, none as `{}` (`fleet_proto::api::InvokePayload`).
fn unwrap_payload(payload: &Value, recorded_data: Option<&Value>) -> Value {
    match (recorded_data, payload.as_object()) {
        (Some(Value::Object(_)), _) => payload.clone(),
        (None | Some(Value::Null), Some(p)) if p.is_empty() => recorded_data.cloned().unwrap_or(Value::Null),
        (Some(_), Some(p)) if p.len() == 1 && p.contains_key("value") => p["value"].clone(),
        _ => payload.clone(),
    }
}

fn is_terminal(snapshot: &Value) -> bool {
    state_of(snapshot).is_some_and(JobState::is_terminal)
}

fn state_of(snapshot: &Value) -> Option<JobState> {
    snapshot
        .get("state")
        .and_then(|s| serde_json::from_value(s.clone()).ok())
}

/// `{ok: true, result: {state, result?, error?: {code}}}` of a recorded terminal snapshot.
fn job_projection_recorded(snapshot: &Value) -> Value {
    let mut result = json!({ "state": snapshot.get("state") });
    if let Some(r) = snapshot.get("result") {
        result["result"] = r.clone();
    }
    if let Some(code) = snapshot.get("error").and_then(|e| e.get("code")) {
        result["error"] = json!({ "code": code });
    }
    json!({ "ok": true, "result": result })
}

/// The same projection of the replayed job's end (or of the error that ended the following).
fn job_projection_replayed(end: &Result<Value, ApiError>) -> Value {
    match end {
        Ok(snapshot) => job_projection_recorded(snapshot),
        Err(e) => json!({ "ok": false, "error": { "code": e.code } }),
    }
}

/// Polls the job with `tools.getJob` until its state is terminal, within its deadline plus [`JOB_END_GRACE`].
async fn follow(client: &ApiClient, job: &mut Job) -> Result<Value, ApiError> {
    if let Some(end) = &job.end {
        return Ok(end.clone());
    }
    let now = fleet_proto::util::now_ms();
    let until = tokio::time::Instant::now()
        + Duration::from_millis(job.deadline_ms.saturating_sub(now))
        + JOB_END_GRACE;
    let body = json!({ "jobId": job.id });
    loop {
        let snapshot = client
            .call(
                methods::TOOLS_GET_JOB,
                &body,
                wait_for(methods::TOOLS_GET_JOB, None),
            )
            .await?;
        if is_terminal(&snapshot) {
            job.end = Some(snapshot.clone());
            return Ok(snapshot);
        }
        if tokio::time::Instant::now() >= until {
            return Err(ApiError::new(
                fleet_proto::api::ApiErrorCode::ToolTimeout,
                format!("job {} not terminal after its deadline", job.id),
            ));
        }
        tokio::time::sleep(JOB_POLL_EVERY).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fleet_proto::api::ApiErrorCode;

    /// The path `judge` names for these projections.
    fn judged(e: &Value, a: &Value, strict: bool) -> Option<String> {
        let mut row = Row::new(1, None, "tools.invoke".into(), Verdict::Skipped);
        judge(&mut row, e, a, strict);
        row.path
    }

    #[test]
    fn an_invoke_result_is_compared_on_success_and_data() {
        let recorded = Outcome::Ok(json!({"success": true, "data": {"emitted": 3}, "duration_ms": 4}));
        let (e, a) = invoke_projection(&recorded, &Ok(json!({"emitted": 3})));
        assert_eq!(judged(&e, &a, true), None, "{e} {a}");
        let (e, a) = invoke_projection(&recorded, &Ok(json!({"emitted": 4})));
        assert_eq!(judged(&e, &a, false), Some("$.result.data.emitted".into()));
        let failed = Err(ApiError::new(ApiErrorCode::ToolFailed, "x"));
        let (e, a) = invoke_projection(&recorded, &failed);
        assert_eq!(judged(&e, &a, false), Some("$.result.success".into()));
        // A recorded plugin failure is the fleet's tool_failed.
        let (e, a) = invoke_projection(&Outcome::Ok(json!({"success": false, "error": "boom"})), &failed);
        assert_eq!(judged(&e, &a, true), None, "{e} {a}");
        // A recorded error compares its code.
        let recorded = Outcome::Err(json!({"code": "permission_denied", "message": "m"}));
        let other = Err(ApiError::new(ApiErrorCode::InvalidArg, "m"));
        let (e, a) = invoke_projection(&recorded, &other);
        assert_eq!(judged(&e, &a, false), Some("$.error.code".into()));
        let (e, a) = invoke_projection(&recorded, &Ok(json!({})));
        assert_eq!(judged(&e, &a, false), Some("$.ok".into()));
    }

    #[test]
    fn payloads_that_are_not_objects_are_unwrapped() {
        assert_eq!(unwrap_payload(&json!({"value": 5}), Some(&json!(5))), json!(5));
        assert_eq!(unwrap_payload(&json!({}), None), Value::Null);
        assert_eq!(unwrap_payload(&json!({}), Some(&Value::Null)), Value::Null);
        assert_eq!(
            unwrap_payload(&json!({"a": 1}), Some(&json!({"a": 1}))),
            json!({"a": 1})
        );
    }

    #[test]
    fn job_calls_compare_ok_code_and_state_only() {
        let recorded = Outcome::Ok(json!({"jobId": "tjob_1", "state": "queued", "deadlineMs": 1}));
        let replayed = Outcome::Ok(json!({"jobId": "tjob_2", "state": "queued", "deadlineMs": 2}));
        let e = envelope_projection(&recorded, &["state"]);
        assert!(diff(&e, &envelope_projection(&replayed, &["state"]), true).is_match());
        let terminal =
            json!({"state": "failed", "error": {"code": "tool_failed", "message": "a"}, "lastSeq": 3});
        let p = job_projection_recorded(&terminal);
        assert_eq!(
            p,
            json!({"ok": true, "result": {"state": "failed", "error": {"code": "tool_failed"}}})
        );
        assert!(is_terminal(&terminal));
        assert!(!is_terminal(&json!({"state": "running"})));
    }
}
