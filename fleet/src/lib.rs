//! Cloud Agents front: the stateless, NATS-fronted service.
//!
//! It will own authentication (JWT), admission (rate limits, the 5-active-jobs quota), the job records and their
//! state machine in JetStream KV, dispatch to workers, expiry, the HTTP gateway, host services that need shared
//! state, and telemetry. Today it owns [`probe`] (`fleet probe`: drive one plugin through the Executa handshake with
//! the real codec) and [`worker_cmd`] (`fleet worker`: the plugin host on its own).
#![forbid(unsafe_code)]

pub mod client_cmd;
pub mod creds;
pub mod dispatch;
pub mod front;
pub mod grants;
pub mod http;
pub mod in_flight;
pub mod membership;
pub mod metrics;
pub mod nats_auth;
pub mod nats_server;
pub mod node;
pub mod operator;
pub mod plugins;
pub mod policy;
pub mod probe;
pub mod sweeper;
pub mod telemetry;
pub mod up;
pub mod worker_cmd;
