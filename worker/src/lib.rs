//! The Cloud Agents worker: it owns untrusted plugin processes on behalf of many users.
//!
//! - [`config`]: every knob, with production defaults.
//! - [`catalogue`]: the directory of plugin installs (`executa.json`), per-type launch commands.
//! - [`sandbox`]: one cgroup per session (v1 or v2), spawning into it before the plugin's first instruction,
//!   process-tree kill, OOM detection, per-user uids and directories, and the sweep of stale cgroups.
//! - [`session`]: one long-lived plugin process per (user, tool_id): the Executa lifecycle, the JSON-RPC
//!   multiplexer, reverse-RPC routing, progress, cancellation, restarts.
//! - [`install`]: plugin installs from archives (spec §14): verify, extract (zip-slip refused), entrypoint,
//!   atomic versioned commit, `current` pointer, `INSTALL.json`, garbage collection.
//! - [`pool`]: the warm pool of sessions with caps, LRU and idle eviction.
//! - [`child`]: the process core of both dialects: spawn into the sandbox, the pending-request table, the reader
//!   with a per-dialect hook, the stderr ring (bounded, redacted), the exit watcher (tree kill, OOM attribution).
//! - [`types`]: what the dialects and their callers share (worker context, invokes, health states);
//!   [`progress`]: the progress sink and its gate.
//! - [`animus`]: the second dialect (Animus, seed 004): detection, lifecycle, liveness, provider runs as jobs,
//!   the cancellation ladder.
#![deny(unsafe_code)]

pub mod animus;
pub mod catalogue;
pub mod child;
pub mod config;
pub mod egress;
pub mod install;
pub mod metrics;
pub mod pool;
pub mod progress;
pub mod sandbox;
pub mod services;
pub mod session;
pub mod types;

pub use fleet_proto as proto;
