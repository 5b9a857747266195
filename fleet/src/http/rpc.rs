//! `POST /v1/rpc`: the App Host API envelope (spec §10.1).
//!
//! Request `{id, window_uuid, ns, method, args}`, answer `{id, ok: true, result}` or
//! `{id, ok: false, error: {code, message, details?}}`. In order:
//!
//! 1. **Envelope.** A JSON object with `id` (string or number, echoed), `window_uuid` (non-empty string), `ns`,
//!    `method` (strings) and `args` (object; absent = `{}`). Anything else: `invalid_arg` (HTTP 400), with
//!    `details.field`.
//! 2. **Auth.** `Authorization: Bearer <window token>` ([`super::window`]); its `wid` must equal `window_uuid`.
//!    Every failure is `invalid_token` (HTTP 401) with `details.reason` (`expired`, `wrong_audience`,
//!    `bad_signature`, `algorithm_not_allowed`, `wid_mismatch`, …).
//! 3. **ACL.** `ns` must be `tools` (another namespace: `not_implemented`); `method` one of `list`, `invoke`,
//!    `invokeAsync`, `getJob`, `cancelJob`, `listJobs`. With a non-empty `tools` allow-list in the token,
//!    `invoke`/`invokeAsync` of a plugin it does not admit are `permission_denied` (HTTP 403), and `list` shows
//!    only admitted plugins.
//! 4. **In-flight cap.** At most [`super::HttpConfig::max_in_flight_per_window`] requests of one window at once;
//!    more are `rate_limited` (HTTP 429) at once (never queued).
//! 5. [`Front::handle_as`] as the token's user: the per-user rate limit, validation and the handlers of the NATS
//!    API. Its answers are HTTP 200, errors included (the envelope carries them).
//!
//! [`Front::handle_as`]: crate::front::Front::handle_as

use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use fleet_client::auth::Verifier;
use fleet_proto::api::{ApiError, ApiErrorCode, ApiResponse, Target};
use serde_json::{Map, Value, json};

use super::window::{WindowClaims, verify_window};
use super::{HttpState, status_of};
use crate::front::Caller;

/// The `tools` methods, as the envelope names them.
pub const TOOLS_METHODS: &[&str] = &["list", "invoke", "invokeAsync", "getJob", "cancelJob", "listJobs"];

/// A checked envelope.
#[derive(Debug)]
struct Envelope {
    id: Value,
    window_uuid: String,
    ns: String,
    method: String,
    args: Value,
}

fn shape(field: &str, message: &str) -> ApiError {
    ApiError::with_details(
        ApiErrorCode::InvalidArg,
        format!("bad envelope: {message}"),
        json!({ "field": field }),
    )
}

/// The envelope, or the error and whatever `id` could be read.
fn parse(body: &[u8]) -> Result<Envelope, (Value, ApiError)> {
    let value: Value =
        serde_json::from_slice(body).map_err(|_| (Value::Null, shape("", "the body is not JSON")))?;
    let Value::Object(mut map) = value else {
        return Err((Value::Null, shape("", "the body is not a JSON object")));
    };
    let id = match map.remove("id") {
        Some(v @ (Value::String(_) | Value::Number(_))) => v,
        _ => return Err((Value::Null, shape("id", "`id` must be a string or a number"))),
    };
    let string = |map: &mut Map<String, Value>, field: &'static str| match map.remove(field) {
        Some(Value::String(s)) if !s.is_empty() => Ok(s),
        _ => Err(shape(field, &format!("`{field}` must be a non-empty string"))),
    };
    let fields = (|| {
        let window_uuid = string(&mut map, "window_uuid")?;
        let ns = string(&mut map, "ns")?;
        let method = string(&mut map, "method")?;
        let args = match map.remove("args") {
            None | Some(Value::Null) => Value::Object(Map::new()),
            Some(v @ Value::Object(_)) => v,
            Some(_) => return Err(shape("args", "`args` must be an object")),
        };
        Ok((window_uuid, ns, method, args))
    })();
    match fields {
        Ok((window_uuid, ns, method, args)) => Ok(Envelope {
            id,
            window_uuid,
            ns,
            method,
            args,
        }),
        Err(e) => Err((id, e)),
    }
}

fn answer(id: &Value, response: ApiResponse<Value>, status: StatusCode) -> Response {
    let body = match response {
        ApiResponse::Ok(result) => json!({ "id": id, "ok": true, "result": result }),
        ApiResponse::Err(error) => json!({ "id": id, "ok": false, "error": error }),
    };
    (status, axum::Json(body)).into_response()
}

fn refuse(state: &HttpState, id: &Value, method: &str, error: ApiError) -> Response {
    state.inner.ops.rpc_error(method, &error);
    let status = status_of(error.code);
    answer(id, ApiResponse::Err(error), status)
}

/// The ACL of spec §10.1 for the `tools` namespace, narrowed by the token's allow-list.
fn acl(claims: &WindowClaims, env: &Envelope) -> Result<(), ApiError> {
    if env.ns != "tools" {
        return Err(ApiError::new(
            ApiErrorCode::NotImplemented,
            format!("namespace {:?} is not served here (only `tools`)", env.ns),
        ));
    }
    if !TOOLS_METHODS.contains(&env.method.as_str()) {
        return Err(ApiError::new(
            ApiErrorCode::NotImplemented,
            format!("unknown method tools.{}", env.method),
        ));
    }
    if matches!(env.method.as_str(), "invoke" | "invokeAsync") {
        let tool_id = env.args.get("tool_id").and_then(Value::as_str).unwrap_or("");
        let method = env.args.get("method").and_then(Value::as_str);
        // A bad tool_id is the handler's `invalid_arg`; only a resolvable one is checked here.
        if let Ok(target) = Target::resolve(tool_id, method)
            && !claims.allows(&target.plugin)
        {
            return Err(ApiError::with_details(
                ApiErrorCode::PermissionDenied,
                format!("tool {:?} is not in this app's host_api.tools", target.plugin),
                json!({ "tool_id": target.plugin }),
            ));
        }
    }
    Ok(())
}

/// `tools.list` narrowed to the allow-list.
fn filter_list(claims: &WindowClaims, mut result: Value) -> Value {
    if let Some(tools) = result.get_mut("tools").and_then(Value::as_array_mut) {
        tools.retain(|t| {
            t.get("tool_id")
                .and_then(Value::as_str)
                .is_some_and(|id| claims.allows(id))
        });
    }
    result
}

/// A refusal of steps 1–3: the `id` to echo, the method as `ns.method` (empty before the envelope is read), the
/// error.
type Refusal = (Value, String, ApiError);

/// Steps 1–3: the envelope, the window token (its `wid` equal to `window_uuid`), the ACL.
fn checked(window: &Verifier, authorization: &str, body: &[u8]) -> Result<(Envelope, WindowClaims), Refusal> {
    let env = parse(body).map_err(|(id, e)| (id, String::new(), e))?;
    let full = format!("{}.{}", env.ns, env.method);
    let claims = match verify_window(window, authorization) {
        Ok(c) => c,
        Err(e) => return Err((env.id, full, e)),
    };
    if claims.window != env.window_uuid {
        return Err((env.id, full, super::sse::wid_mismatch()));
    }
    if let Err(e) = acl(&claims, &env) {
        return Err((env.id, full, e));
    }
    Ok((env, claims))
}

/// Steps 1–3 of [`rpc`] on a request's `Authorization` value and body, before anything else is touched. Public
/// only for the fuzz targets (fuzz/).
#[doc(hidden)]
pub fn check_request(window: &Verifier, authorization: &str, body: &[u8]) -> Result<(), ApiError> {
    checked(window, authorization, body)
        .map(drop)
        .map_err(|(_, _, e)| e)
}

/// `POST /v1/rpc`.
pub async fn rpc(State(state): State<HttpState>, headers: HeaderMap, body: Bytes) -> Response {
    let auth = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let (env, claims) = match checked(&state.inner.window, auth, &body) {
        Ok(checked) => checked,
        Err((id, full, e)) => return refuse(&state, &id, &full, e),
    };
    let full = format!("{}.{}", env.ns, env.method);
    let Some(_permit) = state.acquire_window(&claims.window) else {
        let cap = state.inner.config.max_in_flight_per_window;
        return refuse(
            &state,
            &env.id,
            &full,
            ApiError::with_details(
                ApiErrorCode::RateLimited,
                format!("this window already has {cap} requests in flight"),
                json!({ "max_in_flight": cap }),
            ),
        );
    };
    let payload = serde_json::to_vec(&env.args).unwrap_or_default();
    let started = Instant::now();
    let caller = Caller {
        user: &claims.user,
        window_tools: claims.tools.as_deref(),
    };
    let mut response = state.inner.front.handle_as(caller, &full, &payload).await;
    if env.method == "list"
        && let ApiResponse::Ok(result) = response
    {
        response = ApiResponse::Ok(filter_list(&claims, result));
    }
    let tool = env.args.get("tool_id").and_then(Value::as_str).unwrap_or("");
    state
        .inner
        .ops
        .rpc_done(&full, tool, started.elapsed(), &response);
    answer(&env.id, response, StatusCode::OK)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_shapes() {
        assert!(parse(br#"{"id":"1","window_uuid":"w","ns":"tools","method":"list"}"#).is_ok());
        let (id, e) = parse(br#"{"id":7,"window_uuid":"","ns":"tools","method":"list"}"#).unwrap_err();
        assert_eq!(id, json!(7));
        assert_eq!(e.details, Some(json!({"field": "window_uuid"})));
        let (id, _) = parse(b"[1]").unwrap_err();
        assert_eq!(id, Value::Null);
        let (_, e) =
            parse(br#"{"id":"1","window_uuid":"w","ns":"tools","method":"list","args":[]}"#).unwrap_err();
        assert_eq!(e.details, Some(json!({"field": "args"})));
    }
}
