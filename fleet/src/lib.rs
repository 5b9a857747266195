//! Cloud Agents front and node: the `fleet` binary's library. Stateless replicas over NATS and JetStream.
//!
//! - API: [`front`] (the NATS API service: authentication, rate limits, admission, validation, handlers),
//!   [`finished`] (the front's memory of finished jobs' records, for `getJob`),
//!   [`http`] (the axum gateway: `/v1/rpc` with window tokens, SSE, health, metrics, the operator page, signed
//!   file links), [`in_flight`], [`policy`] (timeout arithmetic);
//! - jobs: [`dispatch`] (rendezvous ranking, front ↔ worker requests, retries, cancel), [`membership`] (the live
//!   workers, pushed by a KV watch), [`node`] (a worker's NATS side), [`sweeper`] (expiry, lost workers, waiting
//!   jobs);
//! - operators: [`operator`] (serving plumbing of `fleet.v1.admin.*`), [`grants`], [`credentials`] (users'
//!   plugin credentials), [`creds`] (app NATS credentials), [`plugins`] (distribution: packages, records, install on workers);
//! - NATS trust: [`nats_auth`] (operator-mode material, the role table, exec seals), [`nats_server`];
//! - the binary's commands: [`up`], [`worker_cmd`], [`client_cmd`], [`probe`], [`replay`] (the plugin developer's
//!   harness: `fleet replay`, `fleet fixture verify|summarize`); [`metrics`], [`telemetry`].
//!
//! What is not here: the job store (`fleet-store`), the host services and the grants bucket (`fleet-services`),
//! connections, credentials, tokens and the API client (`fleet-client`), wire types (`fleet-proto`, including
//! `proto::admin`), the plugin host (`fleet-worker`). See ARCHITECTURE.md for what each crate promises.
#![forbid(unsafe_code)]

pub mod client_cmd;
pub mod credentials;
pub mod creds;
pub mod delegation;
pub mod dispatch;
pub mod exec_answer;
pub mod finished;
pub mod front;
pub mod grants;
pub mod http;
pub mod in_flight;
pub mod job_steps;
pub mod known_plugins;
pub mod membership;
pub mod metrics;
pub mod nats_auth;
pub mod nats_server;
pub mod node;
pub mod operator;
pub mod plugins;
pub mod policy;
pub mod probe;
pub mod recorded;
pub mod replay;
pub mod sweeper;
pub mod telemetry;
pub mod up;
pub mod worker_cmd;
