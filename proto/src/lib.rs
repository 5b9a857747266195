//! Every wire type of Cloud Agents, and the stdio frame codec.
//!
//! This crate owns the bytes on the wire and nothing else: JSON-RPC 2.0 ([`jsonrpc`]), the Executa plugin
//! protocol — manifest, `initialize`, `invoke`, `health`, progress, reverse-RPC method names and error codes,
//! file transport ([`executa`]) —, the second plugin dialect, Animus ([`animus`]: lifecycle, `agent/*`, `$/ping`,
//! `health/check`, error codes and their meaning by direction), the fleet's own API used over NATS and HTTP
//! ([`api`]), the spec's numeric limits ([`limits`]), the F3 mock-fixture format ([`mocks`]) and the LF-delimited frame codec ([`codec`]). It performs no I/O of its own except in the
//! optional tokio adapter (`codec::io`, feature `tokio`). Types here are serde types with validation; behaviour
//! (sessions, jobs, quotas) lives in `fleet-worker` and `fleet`.
#![forbid(unsafe_code)]

pub mod admin;
pub mod animus;
pub mod api;
pub mod codec;
pub mod executa;
pub mod jsonrpc;
pub mod limits;
pub mod mocks;
pub mod util;
