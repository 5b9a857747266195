//! The operator API's serving plumbing, shared by every area (`fleet.v1.admin.{grants,plugins,creds}.*`; subjects,
//! arguments and results are `proto::admin`'s): one queue-group subscription per area (any front answers),
//! request/reply with `Authorization: Bearer <JWT>`, the token verified as an operator token (its own audience and
//! key set: [`OperatorVerifier`]), each request handled on its own task, answers in the API envelope
//! (`{"ok": …}` / `{"error": {code, message, details}}`).

use std::future::Future;

use bytes::Bytes;
use fleet_proto::admin::subject;
use fleet_proto::api::{ApiError, ApiResponse, subjects};
use futures::StreamExt as _;
use serde_json::Value;

use fleet_client::auth::OperatorVerifier;
use fleet_client::nats_conn::keeping_alive;

/// Serves `fleet.v1.admin.<area>.*` in queue group `queue` until the client closes: every request from a token
/// with the operator claim goes to `handler(method, payload)` (`what` names the area in the refusal of other
/// tokens).
pub async fn serve<H, Fut>(
    client: async_nats::Client,
    area: &'static str,
    queue: String,
    verifier: OperatorVerifier,
    what: &'static str,
    handler: H,
) -> Result<tokio::task::JoinHandle<()>, async_nats::Error>
where
    H: Fn(String, Bytes) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<Value, ApiError>> + Send + 'static,
{
    let mut sub = client.queue_subscribe(subject(area, "*"), queue).await?;
    // Served from the moment this returns: the server has processed the subscription.
    fleet_client::nats_conn::round_trip(&client).await?;
    Ok(tokio::spawn(async move {
        while let Some(msg) = sub.next().await {
            let (client, verifier, handler) = (client.clone(), verifier.clone(), handler.clone());
            tokio::spawn(async move {
                let Some(reply) = msg.reply.clone() else { return };
                let auth = msg
                    .headers
                    .as_ref()
                    .and_then(|h| h.get(subjects::AUTH_HEADER))
                    .map(|v| v.as_str().to_owned());
                let method = msg
                    .subject
                    .as_str()
                    .rsplit('.')
                    .next()
                    .unwrap_or_default()
                    .to_owned();
                let response = match verifier.authorize(auth.as_deref(), what) {
                    // An install can take minutes: the caller hears every second that it still runs.
                    Ok(_) => match keeping_alive(&client, &msg, handler(method, msg.payload.clone())).await {
                        Ok(v) => ApiResponse::Ok(v),
                        Err(e) => ApiResponse::Err(e),
                    },
                    Err(e) => ApiResponse::Err(e),
                };
                let payload = serde_json::to_vec(&response).unwrap_or_default();
                let _ = client.publish(reply, payload.into()).await;
            });
        }
    }))
}
