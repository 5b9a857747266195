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
//! - [`animus`]: the second dialect (Animus, seed 004): detection, lifecycle, liveness, provider runs as jobs,
//!   the cancellation ladder.
#![deny(unsafe_code)]

pub mod animus;
pub mod catalogue;
pub mod config;
pub mod egress;
pub mod install;
pub mod metrics;
pub mod pool;
pub mod sandbox;
pub mod services;
pub mod session;

pub use fleet_proto as proto;
