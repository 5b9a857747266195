//! The Cloud Agents worker: it owns untrusted plugin processes on behalf of many users. No NATS, no JetStream:
//! the fleet drives it (`fleet::node`) and implements its [`services`] traits.
//!
//! - [`config`]: every knob, with production defaults.
//! - [`catalogue`]: the directory of plugin installs (`executa.json`), per-type launch commands.
//! - [`sandbox`]: one cgroup per session (v1 or v2) inside a per-user ceiling cgroup, spawning into it before the
//!   plugin's first instruction; confinement (namespaces, private `/proc` and `/tmp`, a network namespace,
//!   seccomp), a uid per (user, tool), per-tool directories, process-tree kill, OOM detection, the sweep of stale
//!   cgroups.
//! - [`egress`]: the egress policy of operator-granted plugins and the proxy that enforces it.
//! - [`child`]: the process core of both dialects: spawn into the sandbox, the pending-request table, the reader
//!   with a per-dialect hook, the stderr ring (bounded, redacted), the exit watcher (tree kill, OOM attribution).
//! - [`session`]: one long-lived Executa process per (user, tool_id): the lifecycle, the JSON-RPC multiplexer,
//!   reverse-RPC routing, progress, cancellation, restarts.
//! - [`animus`]: the second dialect (Animus, seed 004): detection, lifecycle, liveness, provider runs as jobs,
//!   the cancellation ladder.
//! - [`types`]: what the dialects and their callers share (worker context, invokes, health states);
//!   [`progress`]: the progress sink and its gate.
//! - [`pool`]: the warm pool of sessions with caps, LRU and idle eviction; routes each install to its dialect.
//! - [`prepare`]: the one-time preparation of an install before its first spawn (`uv sync` of a Python project).
//! - [`install`]: plugin installs from archives (spec §14): verify, extract (zip-slip refused), entrypoint,
//!   atomic versioned commit, `current` pointer, `INSTALL.json`, garbage collection.
//! - [`services`]: the traits the fleet implements (`HostServices`, `TokenSource`); [`metrics`]: the counters.
#![deny(unsafe_code)]

pub mod animus;
pub mod catalogue;
pub mod child;
pub mod config;
pub mod egress;
pub mod install;
pub mod metrics;
pub mod pool;
pub mod prepare;
pub mod progress;
pub mod sandbox;
pub mod services;
pub mod session;
pub mod types;

pub use fleet_proto as proto;
