//! The Executa plugin protocol (v1.1 and v2): what host and plugin exchange over stdio.
//!
//! - [`lifecycle`]: method names host → plugin, `initialize` (v2 handshake, both response dialects), `health`.
//! - [`manifest`]: the `describe` result and its validator.
//! - [`invoke`]: `invoke` params with the per-invoke context, `InvokeResult`, `executa/progress`.
//! - [`reverse`]: reverse-RPC method names (plugin → host) and every family's error codes (spec §7–§9).
//! - [`capabilities`]: `host_capabilities` strings and `initialize` capability keys.
//! - [`credentials`]: the results of `credentials/*` and the OAuth account metadata (spec §8.8).
//! - [`web`]: the params and results of `web/*` and the per-page error names of `web/fetch` (spec §8.9).

pub mod capabilities;
pub mod credentials;
pub mod invoke;
pub mod lifecycle;
pub mod manifest;
pub mod reverse;
pub mod web;

/// The key of a file-transport pointer frame (spec §5).
pub const FILE_TRANSPORT_KEY: &str = "__file_transport";
