//! The client side of a Cloud Agents fleet: everything a process needs to talk to a fleet and nothing of the
//! fleet's own behaviour, so the CLI, `loadtest`, the benches and the tests link this crate (and `fleet-proto`)
//! instead of the whole `fleet`.
//!
//! - [`nats_conn`]: every NATS connection — URL(s), the credentials of one NATS user, the inbox prefix its
//!   permissions allow, TLS — with one-line refusals;
//! - [`creds`]: the fleet's roles and where their `.creds` files live, the `.creds` format, user names and
//!   inboxes, NATS JWT decoding;
//! - [`auth`]: the API's JWTs (mint and verify, one module so the token format has one home), the dev keys of
//!   `fleet up`'s data dir and its secret files;
//! - [`api`]: request/response plumbing and [`api::ApiClient`], the typed client of the app and operator APIs;
//! - [`private_file`]: the one writer of the fleet's secret files (0600, atomic, durable).
//!
//! Depends only on `fleet-proto` among the workspace's crates.
#![forbid(unsafe_code)]

pub mod api;
pub mod auth;
pub mod creds;
pub mod nats_conn;
pub mod private_file;
