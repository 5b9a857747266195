//! The API answer of a sync call, from its worker's [`ExecReply`]: built by the worker when it answers the caller
//! directly (the request's `reply_to`), else by the front. One function, so both hops give the same envelope.

use fleet_proto::api::worker::ExecReply;
use fleet_proto::api::{ApiError, ApiErrorCode};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Value, json};

/// What `tools.invoke` answers for `reply`: the worker's refusal or failure as it is, else the plugin's
/// `InvokeResult` unwrapped ([`unwrap_result`]).
pub fn api_answer(reply: &ExecReply) -> Result<Value, ApiError> {
    if !reply.success {
        return Err(reply
            .error
            .clone()
            .unwrap_or_else(|| ApiError::new(ApiErrorCode::ExecutaUnavailable, "the worker failed")));
    }
    unwrap_result(reply.data.as_deref())
}

/// Unwraps the plugin's `InvokeResult`: `success: false` → `tool_failed`; otherwise the payload, forced to an
/// object (spec §4.4 HR-RD-05).
pub fn unwrap_result(data: Option<&RawValue>) -> Result<Value, ApiError> {
    #[derive(Deserialize)]
    struct Inner {
        #[serde(default)]
        success: bool,
        #[serde(default)]
        data: Option<Value>,
        #[serde(default)]
        error: Option<Value>,
    }
    let inner: Inner = data
        .map(|d| serde_json::from_str(d.get()))
        .transpose()
        .map_err(|e| ApiError::new(ApiErrorCode::ExecutaError, format!("unreadable result: {e}")))?
        .ok_or_else(|| ApiError::new(ApiErrorCode::ExecutaError, "empty result"))?;
    if !inner.success {
        let message = match &inner.error {
            Some(Value::String(s)) => s.clone(),
            Some(v) => v.to_string(),
            None => "the tool failed".into(),
        };
        return Err(ApiError::with_details(
            ApiErrorCode::ToolFailed,
            message,
            json!({ "error": inner.error }),
        ));
    }
    Ok(match inner.data {
        Some(v @ Value::Object(_)) => v,
        Some(Value::Null) | None => json!({}),
        Some(other) => json!({ "value": other }),
    })
}
