//! Worker configuration: every knob of the plugin host, with production defaults.
//!
//! Spec timeouts that the spec calls "not configurable" (`initialize`, `describe`, `health`) are not here; they
//! are `fleet_proto::limits` constants. What is here is operational policy: resource limits, pool sizes, paths,
//! isolation, and the shutdown / restart / cancel schedule (configurable so tests and operators can tighten them,
//! defaulting to the spec's values).

use std::path::PathBuf;
use std::time::Duration;

use fleet_proto::limits;
use serde::{Deserialize, Serialize};

/// Resource limits of one plugin session's cgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResourceLimits {
    /// Memory limit in bytes (cgroup v1 `memory.limit_in_bytes`, v2 `memory.max`).
    pub memory_bytes: u64,
    /// Maximum number of processes/threads (`pids.max`).
    pub pids_max: u64,
    /// CPU bandwidth in millicores: 1000 = one full core (`cpu.cfs_quota_us` / `cpu.max` over a 100 ms period).
    pub cpu_millis: u64,
}

impl Default for ResourceLimits {
    fn default() -> Self {
        ResourceLimits {
            memory_bytes: 512 * 1024 * 1024,
            pids_max: 256,
            cpu_millis: 1000,
        }
    }
}

/// Per-install overrides of [`ResourceLimits`] (from `executa.json`'s `limits` extension).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitOverrides {
    /// Overrides `memory_bytes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
    /// Overrides `pids_max`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pids_max: Option<u64>,
    /// Overrides `cpu_millis`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_millis: Option<u64>,
}

impl ResourceLimits {
    /// These limits with `overrides` applied.
    pub fn with(self, overrides: &LimitOverrides) -> ResourceLimits {
        ResourceLimits {
            memory_bytes: overrides.memory_bytes.unwrap_or(self.memory_bytes),
            pids_max: overrides.pids_max.unwrap_or(self.pids_max),
            cpu_millis: overrides.cpu_millis.unwrap_or(self.cpu_millis),
        }
    }

    /// These limits lowered by `overrides`: an override above a limit leaves the limit as it is.
    pub fn lowered_by(self, overrides: &LimitOverrides) -> ResourceLimits {
        let min = |o: Option<u64>, base: u64| o.map_or(base, |v| v.min(base));
        ResourceLimits {
            memory_bytes: min(overrides.memory_bytes, self.memory_bytes),
            pids_max: min(overrides.pids_max, self.pids_max),
            cpu_millis: min(overrides.cpu_millis, self.cpu_millis),
        }
    }
}

/// How plugin processes are isolated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IsolationMode {
    /// Every session in its own cgroup (v1 or v2, detected). The worker refuses to start if cgroups are unusable.
    Cgroup,
    /// No cgroups (explicit opt-out: logged as a warning and shown in the `isolation` metric label).
    None,
}

/// Which user id plugin processes run as.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "mode")]
pub enum RunAs {
    /// The worker's own uid (the only choice when the worker is not root). Per-user workspaces are then
    /// protected by nothing but the plugins' good manners: fine for development, not for production.
    Inherit,
    /// Each user gets a dedicated unprivileged uid (= gid) from `[first, first + count)`, allocated once per node
    /// and persisted under the state directory; the user's workspace and TMPDIRs are owned by it, mode 0700, so one
    /// user's plugins cannot read another's files. Requires root.
    PerUser {
        /// First uid of the range.
        first: u32,
        /// Size of the range.
        count: u32,
    },
}

impl Default for RunAs {
    fn default() -> Self {
        RunAs::PerUser {
            first: 200_000,
            count: 65_536,
        }
    }
}

/// Whether a user's tools share one workspace.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkspaceSharing {
    /// Each (user, tool_id) has its own workspace, owned by its own uid (the default: one tool cannot read
    /// what another tool of the same user wrote).
    #[default]
    PerTool,
    /// The user's tools share `users/<user_key>/workspace` through a per-user group (set-gid, 2770).
    PerUser,
}

/// How plugin processes are confined beyond their cgroup (with `isolation = "cgroup"`; see
/// `worker/src/sandbox/confine.rs` for what each part does).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Confinement {
    /// New network (loopback only), mount, IPC and UTS namespaces per session, with a private `/proc` that
    /// hides other uids' processes and a private `/tmp`. Needs root (`CAP_SYS_ADMIN`).
    pub namespaces: bool,
    /// The seccomp profile (`worker/src/sandbox/seccomp.rs`).
    pub seccomp: bool,
    /// System calls refused (`EPERM`) on top of the profile's, by name.
    pub seccomp_deny: Vec<String>,
    /// Size of the private `/tmp` (a tmpfs, charged to the session's memory limit).
    pub tmp_bytes: u64,
    /// Empty network namespaces kept ready for new sessions by a background thread (making one is the largest
    /// single cost of a confined spawn); 0: each spawn makes its own. Used only when sandbox stubs are off
    /// (`stub_pool = 0`, or no stub program): a stub makes its own namespaces ahead of need.
    pub netns_pool: usize,
    /// Sandbox stubs kept ready for new sessions (`worker/src/sandbox/stub.rs`): processes already in their
    /// own namespaces with a private `/proc` and `/tmp`, each waiting to become one session's plugin (cgroup,
    /// ids, seccomp, `exec`). They take the worker's `fork` and the namespace work off a cold start. 0: every
    /// plugin is spawned directly. Needs a stub program (`fleet` is its own).
    pub stub_pool: usize,
}

impl Default for Confinement {
    fn default() -> Self {
        Confinement {
            namespaces: true,
            seccomp: true,
            seccomp_deny: Vec::new(),
            tmp_bytes: 64 * 1024 * 1024,
            netns_pool: 4,
            stub_pool: 4,
        }
    }
}

/// Network egress the operator grants to some plugins (none by default: a confined plugin has only its own
/// loopback). A granted session's network namespace holds the worker's egress proxy on
/// `127.0.0.1:`[`EGRESS_PROXY_PORT`] (`HTTP_PROXY`/`HTTPS_PROXY` point there), which resolves each destination
/// itself and connects only to addresses the policy allows (`worker/src/egress.rs`). Never read from a
/// package: only the worker's own configuration grants it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Egress {
    /// The `tool_id`s whose plugins get egress.
    pub tools: Vec<String>,
    /// Ranges opened although they are refused by default (private, shared, benchmarking, documentation and
    /// reserved ranges). Never opens loopback, link-local (the metadata address), multicast, the worker's own
    /// addresses or `deny_cidrs`.
    pub allow_cidrs: Vec<ipnet::IpNet>,
    /// Ranges always refused on top of the built-in ones (the fleet adds its NATS servers' addresses).
    pub deny_cidrs: Vec<ipnet::IpNet>,
    /// Destination ports allowed (empty: any).
    pub ports: Vec<u16>,
    /// Connections through the proxy at once, per session (more wait for one to close).
    pub max_connections: usize,
}

impl Default for Egress {
    fn default() -> Self {
        Egress {
            tools: Vec::new(),
            allow_cidrs: Vec::new(),
            deny_cidrs: Vec::new(),
            ports: Vec::new(),
            max_connections: 64,
        }
    }
}

/// The port of the egress proxy inside an egress-granted plugin's network namespace (its own loopback: no
/// other process shares it).
pub const EGRESS_PROXY_PORT: u16 = 3128;

/// How the one-time preparation of an install (`uv sync` and the build back-ends it runs) is confined
/// (`worker/src/prepare.rs`). It runs package code, so it is confined like a plugin: a build uid of its own per
/// tool and version, a cgroup with these limits, the plugins' namespaces and seccomp profile, a scrubbed
/// environment, a mount view in which the worker's state directory and [`hidden_paths`](Self::hidden_paths) are
/// empty, and network only through the egress proxy to [`index_hosts`](Self::index_hosts).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Preparation {
    /// The package index hosts a preparation may reach (through the egress proxy, which still refuses private,
    /// loopback, link-local and denied addresses); exact names, compared case-insensitively. Empty: no network
    /// at all, and `uv` runs offline.
    pub index_hosts: Vec<String>,
    /// Ranges the index hosts may resolve into although the proxy refuses them by default (a mirror on a private
    /// network). As `egress.allow_cidrs`, it never opens loopback, link-local, multicast, the worker's own
    /// addresses or `egress.deny_cidrs` (the fleet's NATS servers among them).
    pub allow_cidrs: Vec<ipnet::IpNet>,
    /// The limits of a preparation's cgroup.
    pub limits: ResourceLimits,
    /// The longest a preparation may run before its whole tree is killed.
    #[serde(with = "secs")]
    pub timeout: Duration,
    /// Directories that do not exist in a preparation's view, besides the worker's `state_dir` (which is always
    /// hidden): the data directory, the NATS credentials' and the keys' directories. The binary that embeds the
    /// worker fills them.
    pub hidden_paths: Vec<PathBuf>,
}

/// The package indexes a preparation may reach by default: PyPI's index and its file host.
pub const DEFAULT_INDEX_HOSTS: &[&str] = &["pypi.org", "files.pythonhosted.org"];

impl Default for Preparation {
    fn default() -> Self {
        Preparation {
            index_hosts: DEFAULT_INDEX_HOSTS.iter().map(|h| (*h).to_owned()).collect(),
            allow_cidrs: Vec::new(),
            limits: ResourceLimits {
                memory_bytes: 2 * 1024 * 1024 * 1024,
                pids_max: 512,
                cpu_millis: 2000,
            },
            timeout: Duration::from_secs(600),
            hidden_paths: Vec::new(),
        }
    }
}

/// The ceiling on the sum of one user's sessions on a worker: a parent cgroup per user.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UserLimits {
    /// Memory of all the user's sessions together, in bytes.
    pub memory_bytes: u64,
    /// Processes and threads of all the user's sessions together.
    pub pids_max: u64,
    /// Bytes all the user's TMPDIRs and workspaces on a worker may hold together: the size of the user's own
    /// tmpfs (with isolation; `crate::sandbox` "Disk"). A plugin writing past it gets `ENOSPC`.
    #[serde(default = "default_user_disk_bytes")]
    pub disk_bytes: u64,
}

/// [`UserLimits::disk_bytes`]' default: 256 MiB, below a session's default memory limit (512 MiB) because the
/// tmpfs's pages are charged to the memory cgroup of the session that writes them.
pub const DEFAULT_USER_DISK_BYTES: u64 = 256 * 1024 * 1024;

fn default_user_disk_bytes() -> u64 {
    DEFAULT_USER_DISK_BYTES
}

impl Default for UserLimits {
    fn default() -> Self {
        UserLimits {
            memory_bytes: 2 * 1024 * 1024 * 1024,
            pids_max: 1024,
            disk_bytes: DEFAULT_USER_DISK_BYTES,
        }
    }
}

/// What cancelling an invoke does when the plugin is still busy with it after the fallback delay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CancelKill {
    /// Kill the session's process tree at once, even if other invokes are in flight on it (they fail).
    Always,
    /// Kill it as soon as nothing else runs on the process (at once if nothing does): a stuck invoke never takes
    /// other calls down with it, and is still reclaimed (spec §16 A-4's stance).
    #[default]
    WhenIdle,
}

/// The worker's configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerConfig {
    /// Stable identity of this worker on its node: names its cgroup subtree, so a restarted worker finds (and
    /// sweeps) what a killed predecessor left.
    pub worker_id: String,
    /// Directory of plugin installs (one sub-directory with an `executa.json` each).
    pub catalogue_dir: PathBuf,
    /// Root of per-user state: `users/<user_key>/workspace` and `users/<user_key>/tmp/<tool_key>`.
    pub state_dir: PathBuf,
    /// Isolation of plugin processes.
    pub isolation: IsolationMode,
    /// Default resource limits per session.
    pub limits: ResourceLimits,
    /// Which uid plugins run as.
    pub run_as: RunAs,
    /// Whether a user's tools share a workspace.
    pub workspace: WorkspaceSharing,
    /// Namespaces, private mounts and seccomp for every plugin.
    pub confinement: Confinement,
    /// The program sandbox stubs run (`confinement.stub_pool`): a binary whose `main` starts with
    /// `fleet_worker::sandbox::run_if_stub()` — `fleet` itself (`/proc/self/exe`), or this crate's
    /// `fleet-sandbox-stub`. Set by the binary that embeds the worker, never by configuration files (`None`:
    /// no stubs).
    #[serde(skip)]
    pub sandbox_stub: Option<PathBuf>,
    /// The ceiling on each user's sessions together.
    pub user_limits: UserLimits,
    /// What the users this worker admits may hold together, in bytes: a new user is admitted only while the
    /// sum of the admitted users' memory ceilings and disk caps (`user_limits.memory_bytes +
    /// user_limits.disk_bytes` each) stays within it. 0: the worker's own memory limit when its cgroup has one;
    /// without one, no budget (every user admitted, no disk caps).
    pub user_budget_bytes: u64,
    /// Network egress granted to some plugins.
    pub egress: Egress,
    /// How installs are prepared (`uv sync`).
    pub preparation: Preparation,
    /// Ask the kernel (Linux >= 6.1, from the host's cgroup namespace, with namespaces on) to favor dynamic
    /// cgroup modifications: a `cgroup2` mount with `favordynmods`, made once at start in the confinement
    /// probe's private mount namespace. Without it the first move of a process into a cgroup after a quiet
    /// spell waits for an RCU grace period (7–30 ms measured here) — every cold start on an idle worker. The
    /// kernel's stated cost: forks and exits take a slower path of the same lock, node-wide. The flag stays set
    /// until a `cgroup2` is mounted without it.
    pub favor_dynmods: bool,
    /// Variables passed from the worker's environment to plugins (everything else is scrubbed).
    pub env_allowlist: Vec<String>,
    /// Sessions idle this long are shut down.
    #[serde(with = "secs")]
    pub idle_timeout: Duration,
    /// Sessions per worker (LRU eviction of idle ones beyond it).
    pub max_sessions: usize,
    /// Sessions per user.
    pub max_sessions_per_user: usize,
    /// Invokes in flight per session.
    pub max_in_flight_per_session: usize,
    /// Long jobs this worker runs at once (its share of the fleet's async capacity); 0: one per session it may
    /// hold ([`max_sessions`](Self::max_sessions)), see [`effective_job_capacity`](Self::effective_job_capacity).
    pub job_capacity: usize,
    /// Grace between closing stdin and SIGTERM, and between SIGTERM and SIGKILL (spec §3.7: 5 s).
    #[serde(with = "secs")]
    pub shutdown_grace: Duration,
    /// Restart attempts after an unexpected exit before the session is Stopped (spec §3.8: 3).
    pub max_restarts: u32,
    /// Base of the exponential restart backoff (spec §3.8: 1 s).
    #[serde(with = "secs")]
    pub restart_backoff: Duration,
    /// Delay before a cancelled invoke's process tree is killed if the plugin is still busy (spec §10.6: 500 ms).
    #[serde(with = "secs")]
    pub cancel_kill_after: Duration,
    /// What that kill does when other invokes are in flight.
    pub cancel_kill: CancelKill,
    /// Bytes of stderr kept per session (ring).
    pub stderr_ring_bytes: usize,
}

impl WorkerConfig {
    /// Long jobs this worker runs at once: [`job_capacity`](Self::job_capacity) when not 0, else
    /// [`max_sessions`](Self::max_sessions) — each running job keeps one session busy, and memory is bounded per
    /// session and per user by their cgroups, not by this count.
    pub fn effective_job_capacity(&self) -> usize {
        match self.job_capacity {
            0 => self.max_sessions.max(1),
            n => n,
        }
    }
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            worker_id: "worker-0".into(),
            catalogue_dir: PathBuf::from("/var/lib/cloud-agents/plugins"),
            state_dir: PathBuf::from("/var/lib/cloud-agents/state"),
            isolation: IsolationMode::Cgroup,
            limits: ResourceLimits::default(),
            run_as: RunAs::default(),
            workspace: WorkspaceSharing::default(),
            confinement: Confinement::default(),
            user_limits: UserLimits::default(),
            user_budget_bytes: 0,
            egress: Egress::default(),
            preparation: Preparation::default(),
            favor_dynmods: true,
            sandbox_stub: None,
            env_allowlist: ["PATH", "LANG", "LC_ALL", "TZ"]
                .into_iter()
                .map(String::from)
                .collect(),
            idle_timeout: Duration::from_secs(30 * 60),
            max_sessions: 256,
            max_sessions_per_user: 16,
            max_in_flight_per_session: 64,
            job_capacity: 0,
            shutdown_grace: limits::SHUTDOWN_GRACE,
            max_restarts: limits::MAX_RESTART_ATTEMPTS,
            restart_backoff: limits::RESTART_BACKOFF_BASE,
            cancel_kill_after: limits::CANCEL_KILL_FALLBACK,
            cancel_kill: CancelKill::WhenIdle,
            stderr_ring_bytes: 64 * 1024,
        }
    }
}

/// Durations as (fractional) seconds in config files.
mod secs {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let v = f64::deserialize(d)?;
        Duration::try_from_secs_f64(v).map_err(serde::de::Error::custom)
    }
}
