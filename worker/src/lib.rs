//! The Cloud Agents worker: it owns untrusted plugin processes on behalf of many users.
//!
//! It will own the plugin catalogue, one long-lived session per (user, tool_id) — spawned into its own cgroup
//! with a scrubbed environment, private workspace and TMPDIR —, the JSON-RPC multiplexer over the plugin's stdio
//! (built on `fleet_proto::codec`), reverse-RPC routing, progress forwarding, cancellation and the warm pool.
//! Until the worker issue lands this crate only re-exports the protocol it will speak.
#![forbid(unsafe_code)]

pub use fleet_proto as proto;
