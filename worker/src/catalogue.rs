//! The plugin catalogue: a directory of plugin installs, one sub-directory each, described by an `executa.json`
//! (spec §14.5), resolved at load time into everything the worker needs to launch the plugin.
//!
//! ```text
//! <catalogue_dir>/
//!   basic-tool/executa.json     {"tool_id": "tool-dev-example-text-tool", "type": "python", "name": "example-text-tool"}
//!   basic-tool/pyproject.toml   [project.scripts] example-text-tool = "example_plugin:main"
//!   basic-tool/example_plugin.py
//!   notes/executa.json          {"tool_id": "tool-acme-notes-3c4d", "type": "binary", "limits": {"memory_bytes": 268435456}}
//!   notes/bin/tool-acme-notes-3c4d
//!   .staging-x/                 hidden: skipped
//!   scratch/                    no executa.json: skipped
//! ```
//!
//! The `executa.json` format is the public SDK's (`tool_id`, `type`, `command`, `enabled`, `_comment`, and the
//! labels `name` and `slug`, which only name the script to run; unknown fields are ignored) plus our extensions
//! `limits`, `env`, `idle_timeout_secs`, `protocol` (`executa` | `animus`; absent: probed once), and for Animus
//! plugins `ping_interval_secs` and `allow_methods`. Every launch is resolved into an **absolute** argv at load
//! time, so a missing runtime or entry point is reported when the catalogue loads, with the file, the reason and
//! what was tried, rather than as a spawn failure in a user's invoke:
//!
//! | `type` | Default argv | Requires |
//! |---|---|---|
//! | `python` | the `pyproject.toml` `[project.scripts]` key equal to `tool_id`, else to `name`, else to `slug`, else the only script: `[<python>, "-c", PYTHON_SCRIPT_LAUNCHER, <root>, <module>, <attr>, <script>]` (the module from `<dir>` or `<dir>/src`), `<python>` the `uv`-prepared environment's (below) or, without `uv`, `python3`. No script: `[<dir>/.fleet-venv/bin/<tool_id>]` if `uv` is there and `pyproject.toml` declares none, else `[<python3>, <dir>/<f>]` with `f` the first of `{tool_id}.py`, `main.py`, `__main__.py` | `uv`, or `python3` and a stdlib-only project; the module or fallback script present |
//! | `node` | `[<node>, <entry>]`, entry = `package.json` `bin[tool_id]` → `bin[name]` (`name`, `slug`, then the package's `name`) → `bin` (string) → `main` → `module` | `node` on PATH, `<dir>/package.json` with an existing entry |
//! | `go` | `[<go>, "run", "."]` (development only: production installs ship a prebuilt `binary`) | `go` on PATH, `<dir>/go.mod` |
//! | `binary` | `[<dir>/bin/<tool_id>]` | that file, executable; otherwise `command` must be set |
//!
//! An explicit `command` replaces the default entirely: its `argv[0]` is resolved against the install directory
//! when it contains a `/` (and must be an executable file), otherwise looked up on the search path. Other
//! arguments are passed verbatim. The working directory is always the install directory.
//!
//! **Who runs it.** Programs are resolved for the plugins' uids, not the worker's ([`Runner`],
//! [`LoadOptions::for_worker`]). Under per-user uids only the "other" permission bits count: a program on the
//! search path that they cannot execute (a pyenv shim in root's 0700 home) is skipped for the next entry, and
//! reported with its fix ([`CatalogueError::RuntimeUnreachable`]) when no entry works; an install directory, a
//! program or a script's module they cannot reach is [`CatalogueError::Unreachable`], naming the blocking
//! directory and the `chmod` that opens it ([`crate::sandbox::reach`]). With a private `/tmp` the directories
//! leading to what the sandbox mounts back into it do not count (they are re-created there).
//!
//! **`uv` installs are prepared once.** With `uv` on the worker's search path (executable by the plugins' uids:
//! a build uid runs it), a `python` install carries [`Prepare::UvSync`]: at its first use, before the dialect
//! probe, a confined `uv sync` fills `<dir>/`[`UV_VENV_DIR`] ([`crate::prepare`]), and the plugin runs that environment's
//! interpreter (with the script launcher) or its `bin/<tool_id>` — never `uv` itself, so its first `initialize`
//! cannot race a dependency download and its uid needs neither `uv`'s cache nor a writable project directory.
//! Without `uv`, stdlib-only projects run on `python3`.
//!
//! [`Catalogue::load`] never stops at a bad entry: each one becomes a [`CatalogueProblem`] naming the file and the
//! reason, and the rest loads. Only an unreadable catalogue directory is an error (a catalogue the plugins
//! cannot reach is one problem, and nothing loads).

use std::collections::HashMap;
use std::collections::btree_map::{self, BTreeMap};
use std::fmt;
use std::fs::{self, File};
use std::io::{self, Read};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use fleet_proto::limits;
use rustix::fs::{Mode, OFlags};
use serde_json::{Map, Value};

use crate::config::{IsolationMode, LimitOverrides, RunAs, WorkerConfig};
use crate::sandbox::reach::{self, Access, Blocker};

/// The file that describes an install.
pub const MANIFEST_FILE: &str = "executa.json";
/// The record the installer writes beside a package's files (`crate::install`): its presence marks an install
/// whose `executa.json` came from a package, not from the operator.
pub const PACKAGE_RECORD_FILE: &str = "INSTALL.json";

/// Marker file (in the install directory) written once the worker has described the install successfully.
pub const DESCRIBED_MARKER: &str = ".fleet-described";

/// Largest `executa.json` / `package.json` read (anything larger is refused, not truncated).
pub const MAX_MANIFEST_BYTES: u64 = 1024 * 1024;

/// Longest accepted `tool_id`, in characters.
pub const MAX_TOOL_ID_CHARS: usize = 128;

/// `protocol` of an Executa plugin.
pub const PROTOCOL_EXECUTA: &str = "executa";

/// `protocol` of an Animus plugin (seed 004).
pub const PROTOCOL_ANIMUS: &str = "animus";

/// The stdio dialect a plugin speaks. Declared by `executa.json` `protocol` (then verified), otherwise probed once
/// (`--manifest`, then Executa `describe`) by [`crate::animus::detect`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dialect {
    /// Executa (seeds 000/001).
    Executa,
    /// Animus (seed 004).
    Animus,
}

impl Dialect {
    /// The `protocol` value (and the `dialect` metric label).
    pub fn as_str(self) -> &'static str {
        match self {
            Dialect::Executa => PROTOCOL_EXECUTA,
            Dialect::Animus => PROTOCOL_ANIMUS,
        }
    }
}

impl fmt::Display for Dialect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The runtime of an install (`executa.json` `type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum InstallType {
    /// A Python project: its `[project.scripts]` entry, in a `uv`-prepared environment or on `python3`.
    Python,
    /// A Node.js package run with `node`.
    Node,
    /// A Go module run with `go run` (development only).
    Go,
    /// A prebuilt executable.
    Binary,
}

impl InstallType {
    /// The `type` value in `executa.json`.
    pub fn as_str(self) -> &'static str {
        match self {
            InstallType::Python => "python",
            InstallType::Node => "node",
            InstallType::Go => "go",
            InstallType::Binary => "binary",
        }
    }

    /// Parses an `executa.json` `type` value (exact, lowercase).
    pub fn parse(s: &str) -> Option<InstallType> {
        match s {
            "python" => Some(InstallType::Python),
            "node" => Some(InstallType::Node),
            "go" => Some(InstallType::Go),
            "binary" => Some(InstallType::Binary),
            _ => None,
        }
    }
}

impl fmt::Display for InstallType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One plugin install, validated and resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Install {
    /// The identity (`executa.json` `tool_id`), unique in the catalogue.
    pub tool_id: String,
    /// The runtime (`type`).
    pub kind: InstallType,
    /// The install directory, canonical (symbolic links resolved). The plugin's working directory.
    pub dir: PathBuf,
    /// The launch command, `argv[0]` an absolute path. Empty when the install is disabled (disabled installs are
    /// listed but their launch is not resolved).
    pub argv: Vec<String>,
    /// `false` when `executa.json` says `"enabled": false`: listed, never launched.
    pub enabled: bool,
    /// Per-install resource limit overrides (`limits`).
    pub limits: LimitOverrides,
    /// Extra variable names passed from the worker's environment (`env`), validated, without duplicates.
    pub env: Vec<String>,
    /// Per-install idle timeout (`idle_timeout_secs`); `None` means the worker's default.
    pub idle_timeout: Option<Duration>,
    /// `true` if the worker has never described this install (no [`DESCRIBED_MARKER`] at load time): its first
    /// `describe` gets [`limits::DESCRIBE_TIMEOUT_FIRST_LAUNCH`].
    pub first_launch: bool,
    /// The declared dialect (`protocol`); `None`: probed once before the first spawn.
    pub protocol: Option<Dialect>,
    /// Animus: period of `$/ping` (`ping_interval_secs`); `None`: [`limits::ANIMUS_PING_INTERVAL`].
    pub ping_interval: Option<Duration>,
    /// Animus `custom` kind: the operator's allow-list of methods / MCP tools exposed as tools
    /// (`allow_methods`); `None` or empty exposes none.
    pub allow_methods: Option<Vec<String>>,
    /// Installed from a package ([`PACKAGE_RECORD_FILE`] present): its `executa.json` is the package author's,
    /// so it names no worker environment variable (`env` is ignored) and its `limits` only lower the worker's.
    pub packaged: bool,
    /// What must be done once before the first spawn ([`crate::prepare`]); `None`: nothing.
    pub prepare: Option<Prepare>,
    /// Files of the plugin's own code that the launch runs but its argv does not name (the module of a
    /// `[project.scripts]` entry): fingerprinted with the argv's ([`crate::animus::detect`]), so a changed
    /// module quarantines the install as a changed program does.
    pub code: Vec<PathBuf>,
}

/// A one-time preparation an install needs before its first spawn, run by the worker ([`crate::prepare`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prepare {
    /// `uv sync` of the project into `venv` ([`UV_VENV_DIR`]): the plugin then runs the environment's own
    /// interpreter or script, never `uv`, so its first `initialize` cannot race a dependency download and its
    /// uid needs neither `uv`, nor its cache, nor a writable project directory.
    UvSync {
        /// `uv`.
        uv: PathBuf,
        /// The interpreter the environment is made with (`--python`): the first `python3` the plugins' uids can
        /// execute; `None`: `uv`'s choice.
        python: Option<PathBuf>,
        /// The environment (`UV_PROJECT_ENVIRONMENT`).
        venv: PathBuf,
    },
}

/// The environment `uv sync` prepares for a `python` install, in its directory.
pub const UV_VENV_DIR: &str = ".fleet-venv";

impl Install {
    /// The limits a session of this install runs with: `base` (the worker's) with this install's `limits`
    /// applied; a package may only lower them, the operator's own catalogue entries may also raise them.
    pub fn effective_limits(&self, base: crate::config::ResourceLimits) -> crate::config::ResourceLimits {
        if self.packaged {
            base.lowered_by(&self.limits)
        } else {
            base.with(&self.limits)
        }
    }

    /// How long a session of this install may stay idle: its own `idle_timeout_secs`, else `base` (the worker's);
    /// a package may only shorten it (a longer one would keep its sessions — their memory, their slots — warm
    /// against the operator's setting), the operator's own catalogue entries may also lengthen it.
    pub fn effective_idle_timeout(&self, base: Duration) -> Duration {
        match self.idle_timeout {
            Some(own) if self.packaged => own.min(base),
            Some(own) => own,
            None => base,
        }
    }

    /// The `executa.json` this install was loaded from.
    pub fn manifest_path(&self) -> PathBuf {
        self.dir.join(MANIFEST_FILE)
    }

    /// The first-launch marker's path.
    pub fn marker_path(&self) -> PathBuf {
        self.dir.join(DESCRIBED_MARKER)
    }

    /// Whether the worker may launch this install.
    pub fn is_runnable(&self) -> bool {
        self.enabled && !self.argv.is_empty()
    }

    /// The `describe` timeout for a launch of this install: 60 s on its first launch, 5 s afterwards.
    pub fn describe_timeout(&self) -> Duration {
        if self.first_launch {
            limits::DESCRIBE_TIMEOUT_FIRST_LAUNCH
        } else {
            limits::DESCRIBE_TIMEOUT
        }
    }

    /// Records that the install has been described once, so the next [`Catalogue::load`] reports
    /// `first_launch == false`. (This value is not changed.) Idempotent.
    ///
    /// The marker is created without following symbolic links: an install shipping a `.fleet-described` symlink
    /// cannot make the worker create or truncate a file elsewhere (the call fails instead). Fails too when the
    /// install directory is read-only; the install then simply keeps the first-launch timeout.
    pub fn mark_described(&self) -> io::Result<()> {
        let fd = rustix::fs::open(
            self.marker_path(),
            OFlags::WRONLY | OFlags::CREATE | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
            Mode::from_bits_truncate(0o644),
        )?;
        let file = File::from(fd);
        if file.metadata()?.is_file() {
            Ok(())
        } else {
            Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{} exists and is not a regular file",
                    self.marker_path().display()
                ),
            ))
        }
    }
}

/// Who runs the plugins, which decides what counts as a usable program or directory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Runner {
    /// The worker's own uid (`run_as: inherit`): any execute bit will do.
    #[default]
    Worker,
    /// Unprivileged per-user uids (a root worker with `run_as: per_user`): only the "other" permission bits
    /// apply, so a program, the install directory and every directory on their way must grant them (see
    /// [`crate::sandbox::reach`]). A program found only where they cannot reach it (a pyenv shim in root's 0700
    /// home) is skipped for the next `PATH` entry, and reported with its fix when no entry works.
    OtherUsers {
        /// The plugins get a private `/tmp` (namespaces on): what they need under `/tmp` is mounted back into
        /// it and the directories leading there are created afresh, so only the mounted directory and what is
        /// beneath it keep their modes (a catalogue in a 0700 `mktemp -d` works then).
        private_tmp: bool,
    },
}

impl Runner {
    /// The runner of a worker's plugins: its `run_as`, and whether its confinement gives them a private `/tmp`.
    pub fn of(config: &WorkerConfig) -> Runner {
        match config.run_as {
            RunAs::Inherit => Runner::Worker,
            RunAs::PerUser { .. } => Runner::OtherUsers {
                private_tmp: config.isolation == IsolationMode::Cgroup && config.confinement.namespaces,
            },
        }
    }
}

/// How [`Catalogue::load`] resolves programs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadOptions {
    /// Directories searched, in order, for bare program names (`uv`, `python3`, `node`, `go`, and a `command`'s
    /// `argv[0]` without a `/`): normally the worker's `PATH`. Relative entries are ignored.
    pub search_path: Vec<PathBuf>,
    /// Who must be able to run what is resolved.
    pub runner: Runner,
}

impl LoadOptions {
    /// Options searching the worker's own `PATH`, for plugins run as the worker's own uid.
    pub fn from_env() -> LoadOptions {
        let search_path = std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).collect())
            .unwrap_or_default();
        LoadOptions {
            search_path,
            runner: Runner::Worker,
        }
    }

    /// Options searching the worker's own `PATH` for what the plugins of a worker with `config` can run (its
    /// `run_as` and confinement: [`Runner::of`]).
    pub fn for_worker(config: &WorkerConfig) -> LoadOptions {
        LoadOptions::from_env().with_runner(Runner::of(config))
    }

    /// Options searching exactly `dirs`.
    pub fn with_search_path<I, P>(dirs: I) -> LoadOptions
    where
        I: IntoIterator<Item = P>,
        P: Into<PathBuf>,
    {
        LoadOptions {
            search_path: dirs.into_iter().map(Into::into).collect(),
            runner: Runner::Worker,
        }
    }

    /// These options with `runner`.
    #[must_use]
    pub fn with_runner(mut self, runner: Runner) -> LoadOptions {
        self.runner = runner;
        self
    }

    /// The absolute path of the first executable regular file named `program` on the search path that the
    /// [`Runner`] can execute.
    pub fn lookup(&self, program: &str) -> Option<PathBuf> {
        self.search(program).ok()
    }

    /// [`lookup`](Self::lookup), or every candidate found and what stops the runner from executing it (empty:
    /// `program` is nowhere on the search path).
    fn search(&self, program: &str) -> Result<PathBuf, Vec<BlockedProgram>> {
        if program.is_empty() || program.contains('/') || program.contains('\0') {
            return Err(Vec::new());
        }
        let mut blocked = Vec::new();
        for candidate in self
            .search_path
            .iter()
            .filter(|dir| dir.is_absolute())
            .map(|dir| dir.join(program))
            .filter(|candidate| executable_file(candidate) == FileCheck::Ok)
        {
            let kept = candidate.parent().unwrap_or(&candidate).to_path_buf();
            match self.blockers(&candidate, Access::Execute, &kept) {
                None => return Ok(candidate),
                Some(blockers) => blocked.push(BlockedProgram {
                    path: candidate,
                    blockers,
                }),
            }
        }
        Err(blocked)
    }

    /// What stops the runner from reaching `path` with `access`; `None`: nothing (always for
    /// [`Runner::Worker`]). `kept` is the directory the sandbox mounts back into a private `/tmp` for this path
    /// (the install directory, a program's directory): the directories strictly between `/tmp` and it are
    /// created afresh there, so they cannot block. A path that cannot be inspected is left to fail at spawn.
    fn blockers(&self, path: &Path, access: Access, kept: &Path) -> Option<Vec<Blocker>> {
        let Runner::OtherUsers { private_tmp } = self.runner else {
            return None;
        };
        let mut blockers = reach::blockers(path, access).ok()?;
        if private_tmp {
            blockers = reach::beyond_private_tmp(blockers, kept);
        }
        Some(blockers).filter(|b| !b.is_empty())
    }

    /// `program` on the search path, or why not: [`CatalogueError::MissingRuntime`] (for `kind`'s default
    /// launch) or [`CatalogueError::CommandNotFound`] (for a `command`) when it is nowhere,
    /// [`CatalogueError::RuntimeUnreachable`] when it is only where the plugins cannot run it.
    fn require(
        &self,
        program: &str,
        missing: impl FnOnce() -> CatalogueError,
    ) -> Result<PathBuf, CatalogueError> {
        self.search(program).map_err(|blocked| {
            if blocked.is_empty() {
                missing()
            } else {
                CatalogueError::RuntimeUnreachable {
                    program: program.to_string(),
                    blocked,
                }
            }
        })
    }
}

/// What of an install the plugins' uids must reach ([`CatalogueError::Unreachable`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Needed {
    /// The catalogue directory (every install is below it).
    CatalogueDir,
    /// The install directory (the plugin's working directory).
    InstallDir,
    /// The program the launch runs (`argv[0]`).
    Program,
    /// The module a `[project.scripts]` entry imports (and the directory Python lists to find it).
    Module,
}

impl fmt::Display for Needed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Needed::CatalogueDir => "the catalogue directory",
            Needed::InstallDir => "the install directory",
            Needed::Program => "the program",
            Needed::Module => "the script's module",
        })
    }
}

/// A program found on the search path that the plugins' uids cannot execute.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockedProgram {
    /// Where it was found.
    pub path: PathBuf,
    /// What is in the way (outermost first).
    pub blockers: Vec<Blocker>,
}

/// Why an install could not be loaded (or, for [`Catalogue::load`]'s `Err`, why the catalogue could not be read).
///
/// Errors about a file carry its path and display as `file: reason`; the others display the reason alone and are
/// given their file by [`CatalogueProblem`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CatalogueError {
    /// A file or directory could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        /// What could not be read.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A file that must be a regular file is not (a directory, a FIFO, a device…).
    #[error("{}: not a regular file", path.display())]
    NotAFile {
        /// The file.
        path: PathBuf,
    },
    /// A file is larger than [`MAX_MANIFEST_BYTES`].
    #[error("{}: larger than {limit} bytes", path.display())]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// The limit.
        limit: u64,
    },
    /// A file is not valid JSON.
    #[error("{}: invalid JSON: {source}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// The parser's error (line and column).
        #[source]
        source: serde_json::Error,
    },
    /// `executa.json` is JSON but not an object.
    #[error("expected a JSON object, found {found}")]
    NotAnObject {
        /// What was found (`an array`, `a string`…).
        found: &'static str,
    },
    /// A required field is absent.
    #[error("missing required field `{field}`")]
    MissingField {
        /// The field.
        field: &'static str,
    },
    /// A field has the wrong type or value.
    #[error("invalid `{field}`: {reason}")]
    InvalidField {
        /// The field, with an index or key where it helps (`command[1]`, `limits`).
        field: String,
        /// Why.
        reason: String,
    },
    /// `type` is not one of `python`, `node`, `go`, `binary`.
    #[error("unknown type `{found}` (expected python, node, go or binary)")]
    UnknownType {
        /// The value found.
        found: String,
    },
    /// The type's default launch needs a program that is not on the search path.
    #[error("type {kind} needs `{program}` on PATH (or set `command`)")]
    MissingRuntime {
        /// The install's type.
        kind: InstallType,
        /// The missing program.
        program: &'static str,
    },
    /// The type's default launch has nothing to run (no `package.json` entry, no `bin/<tool_id>`…).
    #[error("{reason}")]
    NoEntrypoint {
        /// What is missing, and where.
        reason: String,
    },
    /// A `command`'s bare `argv[0]` is not on the search path.
    #[error("`command[0]` `{program}` was not found on PATH")]
    CommandNotFound {
        /// The program name.
        program: String,
    },
    /// A `command`'s `argv[0]` path does not name an executable file.
    #[error("`command[0]` resolves to {}, which {reason}", path.display())]
    CommandUnusable {
        /// The resolved path.
        path: PathBuf,
        /// `does not exist`, `is not executable`…
        reason: String,
    },
    /// Another install already has this `tool_id` (the first in directory order wins).
    #[error("duplicate tool_id `{tool_id}`: already provided by {}", first.display())]
    Duplicate {
        /// The contested identity.
        tool_id: String,
        /// The `executa.json` of the install that kept it.
        first: PathBuf,
    },
    /// A program the launch needs is on the search path only where the plugins' uids cannot execute it (a
    /// pyenv shim under root's 0700 home…).
    #[error(
        "`{program}` is on PATH only where the plugins' uids cannot execute it: {}; install `{program}` \
         system-wide (e.g. /usr/bin/{program}), or run `{}`",
        blocked.iter().map(|b| format!("{} ({})", b.path.display(), join_blockers(&b.blockers))).collect::<Vec<_>>().join("; "),
        blocked.first().map(|b| reach::fix(&b.blockers)).unwrap_or_default()
    )]
    RuntimeUnreachable {
        /// The program name.
        program: String,
        /// Every candidate found, with what stops the plugins from executing it.
        blocked: Vec<BlockedProgram>,
    },
    /// A directory or file the plugin needs is out of its uid's reach (a catalogue under a 0700 `mktemp -d`…).
    #[error("{what} {} is out of the plugins' reach: {}", path.display(), reach::describe(blockers))]
    Unreachable {
        /// What it is.
        what: Needed,
        /// The path.
        path: PathBuf,
        /// What is in the way, and (in the message) the `chmod` that fixes it.
        blockers: Vec<Blocker>,
    },
    /// The type's default launch found nothing to run; every place looked at is listed.
    #[error("type {kind}: nothing to launch; tried {} (or set `command`)", tried.join("; "))]
    NothingToLaunch {
        /// The install's type.
        kind: InstallType,
        /// What was looked for, in order, and why each did not apply.
        tried: Vec<String>,
    },
    /// A `pyproject.toml` is not valid TOML.
    #[error("{}: invalid TOML: {source}", path.display())]
    Toml {
        /// The file.
        path: PathBuf,
        /// The parser's error (line and column).
        #[source]
        source: toml::de::Error,
    },
    /// A `pyproject.toml` is well-formed but a field the launch uses is not usable.
    #[error("{}: {reason}", path.display())]
    BadFile {
        /// The file.
        path: PathBuf,
        /// The field and what is wrong with it.
        reason: String,
    },
    /// A path that must appear in the argv is not valid UTF-8.
    #[error("{}: path is not valid UTF-8", path.display())]
    NonUtf8Path {
        /// The path.
        path: PathBuf,
    },
}

impl CatalogueError {
    /// The file this error is about, when it names one itself.
    pub fn path(&self) -> Option<&Path> {
        match self {
            CatalogueError::Io { path, .. }
            | CatalogueError::NotAFile { path }
            | CatalogueError::TooLarge { path, .. }
            | CatalogueError::Json { path, .. }
            | CatalogueError::Toml { path, .. }
            | CatalogueError::BadFile { path, .. }
            | CatalogueError::Unreachable { path, .. }
            | CatalogueError::NonUtf8Path { path } => Some(path),
            _ => None,
        }
    }

    fn invalid(field: impl Into<String>, reason: impl Into<String>) -> CatalogueError {
        CatalogueError::InvalidField {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

/// An install that did not load: its `executa.json` (or its directory) and the reason.
#[derive(Debug, thiserror::Error)]
pub struct CatalogueProblem {
    /// The `executa.json`, as listed under the catalogue directory (or the install directory when the problem
    /// is the directory itself).
    pub path: PathBuf,
    /// Why it did not load.
    #[source]
    pub error: CatalogueError,
}

impl fmt::Display for CatalogueProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.error.path() == Some(self.path.as_path()) {
            write!(f, "{}", self.error)
        } else {
            write!(f, "{}: {}", self.path.display(), self.error)
        }
    }
}

/// The loaded installs, by `tool_id`.
#[derive(Debug, Clone, Default)]
pub struct Catalogue {
    dir: PathBuf,
    installs: BTreeMap<String, Arc<Install>>,
}

impl Catalogue {
    /// Loads every `<dir>/*/executa.json`.
    ///
    /// Sub-directories are visited in byte order of their names; hidden ones (`.name`) and those without an
    /// `executa.json` are skipped silently, as are plain files; symbolic links to directories are followed.
    /// Every invalid entry is reported as a [`CatalogueProblem`] and the rest still loads. When two valid
    /// installs share a `tool_id`, the first in directory order wins and the later ones are problems
    /// ([`CatalogueError::Duplicate`]). Problems come in directory order.
    ///
    /// # Errors
    ///
    /// [`CatalogueError::Io`] only if `dir` itself cannot be listed.
    pub fn load(
        dir: &Path,
        opts: &LoadOptions,
    ) -> Result<(Catalogue, Vec<CatalogueProblem>), CatalogueError> {
        let io_err = |source| CatalogueError::Io {
            path: dir.to_path_buf(),
            source,
        };
        let mut names = Vec::new();
        for entry in fs::read_dir(dir).map_err(io_err)? {
            let name = entry.map_err(io_err)?.file_name();
            if !name.as_encoded_bytes().starts_with(b".") {
                names.push(name);
            }
        }
        names.sort();

        let mut catalogue = Catalogue {
            dir: dir.to_path_buf(),
            installs: BTreeMap::new(),
        };
        // A catalogue the plugins cannot reach is one problem, not one per install.
        // (Under a private `/tmp` the catalogue directory itself is re-created: only its installs are mounted.)
        let any_install = fs::canonicalize(dir)
            .unwrap_or_else(|_| dir.to_path_buf())
            .join(MANIFEST_FILE);
        if let Some(blockers) = opts.blockers(dir, Access::Search, &any_install) {
            let error = CatalogueError::Unreachable {
                what: Needed::CatalogueDir,
                path: dir.to_path_buf(),
                blockers,
            };
            return Ok((
                catalogue,
                vec![CatalogueProblem {
                    path: dir.to_path_buf(),
                    error,
                }],
            ));
        }
        let mut first_paths: HashMap<String, PathBuf> = HashMap::new();
        let mut problems = Vec::new();
        for name in names {
            let sub = dir.join(&name);
            if !sub.is_dir() {
                continue;
            }
            let manifest = sub.join(MANIFEST_FILE);
            match fs::symlink_metadata(&manifest) {
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                _ => {}
            }
            let install = match load_install(&sub, &manifest, opts) {
                Ok(install) => install,
                Err(error) => {
                    problems.push(CatalogueProblem {
                        path: manifest,
                        error,
                    });
                    continue;
                }
            };
            match catalogue.installs.entry(install.tool_id.clone()) {
                btree_map::Entry::Occupied(_) => {
                    let first = first_paths.get(&install.tool_id).cloned().unwrap_or_default();
                    let error = CatalogueError::Duplicate {
                        tool_id: install.tool_id,
                        first,
                    };
                    problems.push(CatalogueProblem {
                        path: manifest,
                        error,
                    });
                }
                btree_map::Entry::Vacant(slot) => {
                    first_paths.insert(install.tool_id.clone(), manifest);
                    slot.insert(Arc::new(install));
                }
            }
        }
        Ok((catalogue, problems))
    }

    /// The directory this catalogue was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The install with this `tool_id` (enabled or not).
    pub fn get(&self, tool_id: &str) -> Option<&Install> {
        self.installs.get(tool_id).map(|i| &**i)
    }

    /// The install with this `tool_id`, shared (no copy: what a call holds while it runs).
    pub fn get_shared(&self, tool_id: &str) -> Option<Arc<Install>> {
        self.installs.get(tool_id).cloned()
    }

    /// Every install, in `tool_id` order.
    pub fn iter(&self) -> impl Iterator<Item = &Install> {
        self.installs.values().map(|i| &**i)
    }

    /// Number of installs (enabled or not).
    pub fn len(&self) -> usize {
        self.installs.len()
    }

    /// `true` if nothing loaded.
    pub fn is_empty(&self) -> bool {
        self.installs.is_empty()
    }
}

impl<'a> IntoIterator for &'a Catalogue {
    type Item = &'a Install;
    type IntoIter =
        std::iter::Map<btree_map::Values<'a, String, Arc<Install>>, fn(&'a Arc<Install>) -> &'a Install>;

    fn into_iter(self) -> Self::IntoIter {
        let unshare: fn(&'a Arc<Install>) -> &'a Install = |i| i;
        self.installs.values().map(unshare)
    }
}

/// The fields of an `executa.json`, validated.
struct Entry {
    tool_id: String,
    kind: InstallType,
    /// The SDK's `name` (a label, not the identity): a script / `bin` key the launch looks for.
    name: Option<String>,
    /// The SDK's `slug`: likewise.
    slug: Option<String>,
    command: Option<Vec<String>>,
    enabled: bool,
    limits: LimitOverrides,
    env: Vec<String>,
    idle_timeout: Option<Duration>,
    protocol: Option<Dialect>,
    ping_interval: Option<Duration>,
    allow_methods: Option<Vec<String>>,
}

/// Loads the single install in `dir` (its `executa.json`), as [`Catalogue::load`] would load a sub-directory:
/// used for versioned installs (`tools/{tool_id}/v{version}/`, see [`crate::install`]).
///
/// # Errors
/// Every [`CatalogueError`] a catalogue entry can have.
pub fn load_dir(dir: &Path, opts: &LoadOptions) -> Result<Install, CatalogueError> {
    load_install(dir, &dir.join(MANIFEST_FILE), opts)
}

fn load_install(sub: &Path, manifest: &Path, opts: &LoadOptions) -> Result<Install, CatalogueError> {
    let bytes = read_small_file(manifest)?;
    let value: Value = serde_json::from_slice(&bytes).map_err(|source| CatalogueError::Json {
        path: manifest.to_path_buf(),
        source,
    })?;
    let entry = parse_entry(&value)?;

    let dir = fs::canonicalize(sub).map_err(|source| CatalogueError::Io {
        path: sub.to_path_buf(),
        source,
    })?;
    // The directory appears in argvs (and is the working directory): it must be valid UTF-8.
    path_string(dir.clone())?;
    if entry.enabled
        && let Some(blockers) = opts.blockers(&dir, Access::Search, &dir)
    {
        return Err(CatalogueError::Unreachable {
            what: Needed::InstallDir,
            path: dir,
            blockers,
        });
    }
    let Launch { argv, prepare, code } = if entry.enabled {
        resolve_argv(&entry, &dir, opts)?
    } else {
        Vec::new().into()
    };
    let first_launch = !fs::symlink_metadata(dir.join(DESCRIBED_MARKER)).is_ok_and(|m| m.is_file());
    let packaged = fs::symlink_metadata(dir.join(PACKAGE_RECORD_FILE)).is_ok();

    Ok(Install {
        tool_id: entry.tool_id,
        kind: entry.kind,
        dir,
        argv,
        enabled: entry.enabled,
        limits: entry.limits,
        // Only the operator passes worker variables through (installs made before `install` dropped `env`).
        env: if packaged { Vec::new() } else { entry.env },
        idle_timeout: entry.idle_timeout,
        first_launch,
        protocol: entry.protocol,
        ping_interval: entry.ping_interval,
        allow_methods: entry.allow_methods,
        packaged,
        prepare,
        code,
    })
}

fn parse_entry(value: &Value) -> Result<Entry, CatalogueError> {
    let Some(obj) = value.as_object() else {
        return Err(CatalogueError::NotAnObject {
            found: json_kind(value),
        });
    };

    let tool_id = match obj.get("tool_id") {
        None | Some(Value::Null) => return Err(CatalogueError::MissingField { field: "tool_id" }),
        Some(Value::String(s)) => s.clone(),
        Some(other) => return Err(expected("tool_id", "a string", other)),
    };
    validate_tool_id(&tool_id)?;

    let kind = match obj.get("type") {
        None | Some(Value::Null) => return Err(CatalogueError::MissingField { field: "type" }),
        Some(Value::String(s)) => {
            InstallType::parse(s).ok_or_else(|| CatalogueError::UnknownType { found: s.clone() })?
        }
        Some(other) => return Err(expected("type", "a string", other)),
    };

    let [name, slug] = ["name", "slug"].map(|field| match optional(obj, field) {
        None => Ok(None),
        Some(Value::String(s)) if s.is_empty() => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(expected(field, "a string", other)),
    });
    let (name, slug) = (name?, slug?);

    let command = optional(obj, "command").map(parse_command).transpose()?;

    let enabled = match optional(obj, "enabled") {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(other) => return Err(expected("enabled", "a boolean", other)),
    };

    let limits = optional(obj, "limits")
        .map(parse_limits)
        .transpose()?
        .unwrap_or_default();
    let env = optional(obj, "env")
        .map(parse_env)
        .transpose()?
        .unwrap_or_default();

    let idle_timeout = match optional(obj, "idle_timeout_secs") {
        None => None,
        Some(Value::Number(n)) => {
            let secs = n.as_f64().unwrap_or(f64::NAN);
            if secs.is_nan() || secs <= 0.0 {
                return Err(CatalogueError::invalid(
                    "idle_timeout_secs",
                    format!("must be > 0, found {n}"),
                ));
            }
            let d = Duration::try_from_secs_f64(secs)
                .map_err(|e| CatalogueError::invalid("idle_timeout_secs", format!("{n}: {e}")))?;
            Some(d)
        }
        Some(other) => return Err(expected("idle_timeout_secs", "a number of seconds", other)),
    };

    let protocol = match optional(obj, "protocol") {
        None => None,
        Some(Value::String(s)) if s == PROTOCOL_EXECUTA => Some(Dialect::Executa),
        Some(Value::String(s)) if s == PROTOCOL_ANIMUS => Some(Dialect::Animus),
        Some(Value::String(s)) => {
            return Err(CatalogueError::invalid(
                "protocol",
                format!("unsupported protocol `{s}` (expected `executa` or `animus`, or omit it to probe)"),
            ));
        }
        Some(other) => return Err(expected("protocol", "a string", other)),
    };

    let ping_interval = match optional(obj, "ping_interval_secs") {
        None => None,
        Some(Value::Number(n)) => {
            let secs = n.as_f64().unwrap_or(f64::NAN);
            if secs.is_nan() || secs <= 0.0 {
                return Err(CatalogueError::invalid(
                    "ping_interval_secs",
                    format!("must be > 0, found {n}"),
                ));
            }
            let d = Duration::try_from_secs_f64(secs)
                .map_err(|e| CatalogueError::invalid("ping_interval_secs", format!("{n}: {e}")))?;
            Some(d)
        }
        Some(other) => return Err(expected("ping_interval_secs", "a number of seconds", other)),
    };

    let allow_methods = match optional(obj, "allow_methods") {
        None => None,
        Some(Value::Array(items)) => {
            let mut names = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                match item {
                    Value::String(s) if !s.is_empty() => names.push(s.clone()),
                    other => return Err(expected(format!("allow_methods[{i}]"), "a method name", other)),
                }
            }
            Some(names)
        }
        Some(other) => return Err(expected("allow_methods", "an array of method names", other)),
    };

    Ok(Entry {
        tool_id,
        kind,
        name,
        slug,
        command,
        enabled,
        limits,
        env,
        idle_timeout,
        protocol,
        ping_interval,
        allow_methods,
    })
}

/// An optional field: absent and `null` are the same.
fn optional<'a>(obj: &'a Map<String, Value>, field: &str) -> Option<&'a Value> {
    obj.get(field).filter(|v| !v.is_null())
}

fn validate_tool_id(id: &str) -> Result<(), CatalogueError> {
    let reason = if id.is_empty() {
        "must not be empty".to_string()
    } else if id.chars().count() > MAX_TOOL_ID_CHARS {
        format!("longer than {MAX_TOOL_ID_CHARS} characters")
    } else if !id.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_')
        || !id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
    {
        format!(
            "{id:?}: must match [A-Za-z0-9_][A-Za-z0-9._-]* (it is used as a file name and a command argument)"
        )
    } else {
        return Ok(());
    };
    Err(CatalogueError::invalid("tool_id", reason))
}

fn parse_command(value: &Value) -> Result<Vec<String>, CatalogueError> {
    let Value::Array(items) = value else {
        return Err(expected("command", "an array of strings", value));
    };
    if items.is_empty() {
        return Err(CatalogueError::invalid("command", "must not be empty"));
    }
    let mut argv = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let field = format!("command[{i}]");
        let Value::String(s) = item else {
            return Err(expected(field, "a string", item));
        };
        if s.contains('\0') {
            return Err(CatalogueError::invalid(field, "must not contain NUL"));
        }
        if i == 0 && s.is_empty() {
            return Err(CatalogueError::invalid(field, "must not be empty"));
        }
        argv.push(s.clone());
    }
    Ok(argv)
}

fn parse_limits(value: &Value) -> Result<LimitOverrides, CatalogueError> {
    // serde would also accept the struct as an array (`[memory_bytes, pids_max, cpu_millis]`): refuse that.
    if !value.is_object() {
        return Err(expected("limits", "an object", value));
    }
    let limits: LimitOverrides = serde_json::from_value(value.clone())
        .map_err(|e| CatalogueError::invalid("limits", e.to_string()))?;
    for (name, v) in [
        ("memory_bytes", limits.memory_bytes),
        ("pids_max", limits.pids_max),
        ("cpu_millis", limits.cpu_millis),
    ] {
        if v == Some(0) {
            return Err(CatalogueError::invalid(format!("limits.{name}"), "must be > 0"));
        }
    }
    Ok(limits)
}

fn parse_env(value: &Value) -> Result<Vec<String>, CatalogueError> {
    let Value::Array(items) = value else {
        return Err(expected("env", "an array of variable names", value));
    };
    let mut names: Vec<String> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let field = format!("env[{i}]");
        let Value::String(name) = item else {
            return Err(expected(field, "a variable name", item));
        };
        if !is_env_name(name) {
            return Err(CatalogueError::invalid(
                field,
                format!(
                    "{name:?} is not a variable name ([A-Za-z_][A-Za-z0-9_]*); list names only, not values"
                ),
            ));
        }
        if !names.contains(name) {
            names.push(name.clone());
        }
    }
    Ok(names)
}

fn is_env_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// A resolved launch: the argv, what must be done once before it can run, and the files of its code the argv
/// does not name.
struct Launch {
    argv: Vec<String>,
    prepare: Option<Prepare>,
    code: Vec<PathBuf>,
}

impl From<Vec<String>> for Launch {
    fn from(argv: Vec<String>) -> Launch {
        Launch {
            argv,
            prepare: None,
            code: Vec::new(),
        }
    }
}

fn resolve_argv(entry: &Entry, dir: &Path, opts: &LoadOptions) -> Result<Launch, CatalogueError> {
    let launch = match (&entry.command, entry.kind) {
        (Some(command), _) => resolve_command(command, dir, opts)?.into(),
        (None, InstallType::Python) => python_launch(entry, dir, opts)?,
        (None, _) => default_argv(entry, dir, opts)?.into(),
    };
    let argv = &launch.argv;
    // Bare names were looked up for the runner already; a path (an install's own binary, a `command` with a
    // `/`) is checked here.
    if let Some(program) = argv.first()
        && let Some(blockers) = opts.blockers(
            Path::new(program),
            Access::Execute,
            Path::new(program).parent().unwrap_or(dir),
        )
    {
        return Err(CatalogueError::Unreachable {
            what: Needed::Program,
            path: PathBuf::from(program),
            blockers,
        });
    }
    Ok(launch)
}

fn default_argv(entry: &Entry, dir: &Path, opts: &LoadOptions) -> Result<Vec<String>, CatalogueError> {
    let runtime = |program: &'static str| {
        opts.require(program, || CatalogueError::MissingRuntime {
            kind: entry.kind,
            program,
        })
        .and_then(path_string)
    };
    match entry.kind {
        InstallType::Python => Ok(python_launch(entry, dir, opts)?.argv),
        InstallType::Node => {
            let main = node_entry(dir, entry)?;
            let node = runtime("node")?;
            Ok(vec![node, path_string(main)?])
        }
        InstallType::Go => {
            require_file(dir, "go.mod", entry.kind)?;
            let go = runtime("go")?;
            Ok(vec![go, "run".into(), ".".into()])
        }
        InstallType::Binary => {
            let bin = dir.join("bin").join(&entry.tool_id);
            match executable_file(&bin) {
                FileCheck::Ok => Ok(vec![path_string(bin)?]),
                FileCheck::Missing => Err(CatalogueError::NoEntrypoint {
                    reason: format!(
                        "type binary needs an executable `bin/{}` (or set `command`)",
                        entry.tool_id
                    ),
                }),
                problem => Err(CatalogueError::NoEntrypoint {
                    reason: format!(
                        "`bin/{}` {} (or set `command`)",
                        entry.tool_id,
                        problem.describe()
                    ),
                }),
            }
        }
    }
}

fn resolve_command(
    command: &[String],
    dir: &Path,
    opts: &LoadOptions,
) -> Result<Vec<String>, CatalogueError> {
    let Some((program, args)) = command.split_first() else {
        return Err(CatalogueError::invalid("command", "must not be empty"));
    };
    let resolved = if program.contains('/') {
        let path = normalize(&dir.join(program));
        match executable_file(&path) {
            FileCheck::Ok => path,
            problem => {
                return Err(CatalogueError::CommandUnusable {
                    path,
                    reason: problem.describe(),
                });
            }
        }
    } else {
        opts.require(program, || CatalogueError::CommandNotFound {
            program: program.clone(),
        })?
    };
    let mut argv = Vec::with_capacity(command.len());
    argv.push(path_string(resolved)?);
    argv.extend(args.iter().cloned());
    Ok(argv)
}

/// The scripts the `python` fallback runs, in order (`{tool_id}` is replaced), when `pyproject.toml` names no
/// script to run.
pub const PYTHON_FALLBACK_SCRIPTS: [&str; 3] = ["{tool_id}.py", "main.py", "__main__.py"];

/// The project file of a `python` install.
pub const PYPROJECT_FILE: &str = "pyproject.toml";

/// Where a project's top-level modules are looked for, in order: the flat layout, then the `src/` layout.
pub const PYTHON_MODULE_ROOTS: [&str; 2] = [".", "src"];

/// The program `python3 -c` runs for a console script: what pip's generated wrapper does
/// (`sys.exit(<module>:<attr>())`). Its four arguments — the directory put first on `sys.path`, the module, the
/// attribute path and the script's name — follow the program and are removed from `sys.argv` before the
/// plugin's code runs, so the plugin sees `sys.argv == [<script name>, <arguments the host adds>…]`. Nothing
/// of the install is spliced into the code itself.
pub const PYTHON_SCRIPT_LAUNCHER: &str = "import importlib, sys
root, module, attr, name = sys.argv[1:5]
del sys.argv[1:5]
sys.argv[0] = name
sys.path.insert(0, root)
target = importlib.import_module(module)
for part in attr.split('.'):
    target = getattr(target, part)
sys.exit(target())
";

/// A `[project.scripts]` entry: `name = "module.path:attr.path [extras]"`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Script {
    name: String,
    module: String,
    attr: String,
}

/// The launch of a `python` install (spec §14.5, extended to what the SDK's examples ship):
///
/// 1. The script: the `pyproject.toml` `[project.scripts]` key equal to the `tool_id`, else to the manifest's
///    `name`, else to its `slug`, else the only script. It runs as `<python> -c <PYTHON_SCRIPT_LAUNCHER> <root>
///    <module> <attr> <script>` (the module looked for under [`PYTHON_MODULE_ROOTS`]; with `uv`, one the project
///    does not hold is left to its environment), `<python>` being, with
///    `uv`, the interpreter of the environment `uv sync` prepares once ([`Prepare::UvSync`]), and without it
///    `python3` (stdlib-only projects).
/// 2. No such script: with `uv` and a `pyproject.toml` that declares no script at all, the environment's
///    `bin/<tool_id>` (for build back-ends that declare scripts elsewhere); else the first of
///    [`PYTHON_FALLBACK_SCRIPTS`] present, run by `python3`.
/// 3. Otherwise [`CatalogueError::NothingToLaunch`], listing each step tried.
fn python_launch(entry: &Entry, dir: &Path, opts: &LoadOptions) -> Result<Launch, CatalogueError> {
    let pyproject = dir.join(PYPROJECT_FILE);
    let scripts = read_scripts(&pyproject)?;
    let mut tried = Vec::new();
    let python3 = || {
        opts.require("python3", || CatalogueError::MissingRuntime {
            kind: InstallType::Python,
            program: "python3",
        })
        .and_then(path_string)
    };
    let uv_sync = opts.lookup("uv").map(|uv| {
        let venv = dir.join(UV_VENV_DIR);
        Prepare::UvSync {
            uv,
            python: opts.lookup("python3"),
            venv,
        }
    });
    let venv_bin = |name: &str| dir.join(UV_VENV_DIR).join("bin").join(name);
    if let Some(scripts) = &scripts {
        if let Some(script) = choose_script(scripts, entry, &mut tried) {
            let script = parse_script(&pyproject, script)?;
            let (root, module_file) = match module_root(dir, &script, opts) {
                // With `uv`, a module the project does not hold itself comes from its environment (a dependency).
                Err(CatalogueError::NothingToLaunch { .. }) if uv_sync.is_some() => (dir.to_path_buf(), None),
                other => other?,
            };
            let python = match &uv_sync {
                Some(_) => path_string(venv_bin("python"))?,
                None => python3()?,
            };
            return Ok(Launch {
                argv: vec![
                    python,
                    "-c".into(),
                    PYTHON_SCRIPT_LAUNCHER.into(),
                    path_string(root)?,
                    script.module,
                    script.attr,
                    script.name,
                ],
                prepare: uv_sync,
                code: module_file.into_iter().collect(),
            });
        }
        if scripts.is_empty() {
            match uv_sync {
                Some(prepare) => {
                    return Ok(Launch {
                        argv: vec![path_string(venv_bin(&entry.tool_id))?],
                        prepare: Some(prepare),
                        code: Vec::new(),
                    });
                }
                None => tried.push(format!(
                    "`{UV_VENV_DIR}/bin/{}` after `uv sync` (`uv` is not on PATH)",
                    entry.tool_id
                )),
            }
        }
    } else {
        tried.push(format!(
            "`{PYPROJECT_FILE}` `[project.scripts]` (no {PYPROJECT_FILE})"
        ));
    }
    let fallbacks: Vec<String> = PYTHON_FALLBACK_SCRIPTS
        .iter()
        .map(|s| s.replace("{tool_id}", &entry.tool_id))
        .collect();
    if let Some(script) = fallbacks
        .iter()
        .map(|s| dir.join(s))
        .find(|p| fs::symlink_metadata(p).is_ok_and(|m| m.is_file()))
    {
        return Ok(vec![python3()?, path_string(script)?].into());
    }
    tried.push(format!("the scripts {} (none exists)", fallbacks.join(", ")));
    Err(CatalogueError::NothingToLaunch {
        kind: InstallType::Python,
        tried,
    })
}

/// The `[project.scripts]` of `path`, in key order; `None` when there is no such file, empty when it declares
/// no script.
fn read_scripts(path: &Path) -> Result<Option<Vec<(String, String)>>, CatalogueError> {
    let bytes = match read_small_file(path) {
        Err(CatalogueError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
            return Ok(None);
        }
        other => other?,
    };
    let bad = |reason: String| CatalogueError::BadFile {
        path: path.to_path_buf(),
        reason,
    };
    let text = String::from_utf8(bytes).map_err(|e| bad(format!("not UTF-8: {e}")))?;
    let doc: toml::Table = text.parse().map_err(|source| CatalogueError::Toml {
        path: path.to_path_buf(),
        source,
    })?;
    let scripts = match doc.get("project") {
        None => return Ok(Some(Vec::new())),
        Some(toml::Value::Table(project)) => match project.get("scripts") {
            None => return Ok(Some(Vec::new())),
            Some(toml::Value::Table(scripts)) => scripts,
            Some(other) => {
                return Err(bad(format!(
                    "`[project.scripts]` must be a table, found {}",
                    other.type_str()
                )));
            }
        },
        Some(other) => {
            return Err(bad(format!(
                "`project` must be a table, found {}",
                other.type_str()
            )));
        }
    };
    let mut out = Vec::with_capacity(scripts.len());
    for (name, target) in scripts {
        let toml::Value::String(target) = target else {
            return Err(bad(format!(
                "`[project.scripts]` `{name}` must be a string (\"module:function\"), found {}",
                target.type_str()
            )));
        };
        out.push((name.clone(), target.clone()));
    }
    Ok(Some(out))
}

/// The script to run: the key equal to the `tool_id`, the manifest's `name`, its `slug`, else the only one.
/// Each step that did not match is added to `tried`.
fn choose_script<'a>(
    scripts: &'a [(String, String)],
    entry: &Entry,
    tried: &mut Vec<String>,
) -> Option<&'a (String, String)> {
    if scripts.is_empty() {
        tried.push(format!(
            "`[project.scripts]` ({PYPROJECT_FILE} declares no script)"
        ));
        return None;
    }
    let keys = [
        ("tool_id", Some(entry.tool_id.as_str())),
        ("name", entry.name.as_deref()),
        ("slug", entry.slug.as_deref()),
    ];
    for (field, key) in keys {
        let Some(key) = key else { continue };
        if let Some(found) = scripts.iter().find(|(name, _)| name == key) {
            return Some(found);
        }
        tried.push(format!(
            "`[project.scripts]` key `{key}` (the manifest's `{field}`)"
        ));
    }
    if let [only] = scripts {
        return Some(only);
    }
    let names: Vec<&str> = scripts.iter().map(|(n, _)| n.as_str()).collect();
    tried.push(format!(
        "the only `[project.scripts]` entry (it declares {}: {})",
        names.len(),
        names.join(", ")
    ));
    None
}

/// Parses a `[project.scripts]` target (`module.path:attr.path`, an optional `[extras]` suffix ignored). Both
/// sides must be dotted identifiers: they are passed to Python as data, never as code, but a typo is better
/// reported at load.
fn parse_script(pyproject: &Path, (name, target): &(String, String)) -> Result<Script, CatalogueError> {
    let bad = |why: &str| CatalogueError::BadFile {
        path: pyproject.to_path_buf(),
        reason: format!("`[project.scripts]` `{name}` = {target:?}: {why}"),
    };
    let spec = target.split('[').next().unwrap_or_default().trim();
    let Some((module, attr)) = spec.split_once(':') else {
        return Err(bad("expected \"module:function\""));
    };
    let (module, attr) = (module.trim(), attr.trim());
    let dotted = |s: &str| {
        !s.is_empty()
            && s.split('.').all(|part| {
                part.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
                    && part.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            })
    };
    if !dotted(module) {
        return Err(bad("the module is not a dotted Python name"));
    }
    if !dotted(attr) {
        return Err(bad("the function is not a dotted Python name"));
    }
    Ok(Script {
        name: name.clone(),
        module: module.to_string(),
        attr: attr.to_string(),
    })
}

/// The directory under [`PYTHON_MODULE_ROOTS`] holding the script's top-level module (`<m>.py`, `<m>/`), checked
/// readable by the runner (Python lists the directory and reads the file), and the file of the module itself
/// when there is one (a namespace package has none).
fn module_root(
    dir: &Path,
    script: &Script,
    opts: &LoadOptions,
) -> Result<(PathBuf, Option<PathBuf>), CatalogueError> {
    let top = script.module.split('.').next().unwrap_or_default();
    let mut tried = Vec::new();
    for root in PYTHON_MODULE_ROOTS {
        let base = normalize(&dir.join(root));
        for candidate in [base.join(format!("{top}.py")), base.join(top)] {
            if !candidate.exists() {
                tried.push(path_display(dir, &candidate));
                continue;
            }
            for (path, access) in [(&base, Access::Read), (&candidate, Access::Read)] {
                if let Some(blockers) = opts.blockers(path, access, dir) {
                    return Err(CatalogueError::Unreachable {
                        what: Needed::Module,
                        path: path.clone(),
                        blockers,
                    });
                }
            }
            // The file holding the function: `a/b.py` or `a/b/__init__.py` for module `a.b`.
            let module = base.join(script.module.replace('.', "/"));
            let file = [module.with_extension("py"), module.join("__init__.py")]
                .into_iter()
                .find(|f| f.is_file());
            return Ok((base, file));
        }
    }
    Err(CatalogueError::NothingToLaunch {
        kind: InstallType::Python,
        tried: vec![format!(
            "`[project.scripts]` `{}` = module `{}`: none of {} exists",
            script.name,
            script.module,
            tried.join(", ")
        )],
    })
}

/// `path` relative to `dir` when it is under it (for messages).
fn path_display(dir: &Path, path: &Path) -> String {
    path.strip_prefix(dir).unwrap_or(path).display().to_string()
}

fn require_file(dir: &Path, name: &str, kind: InstallType) -> Result<(), CatalogueError> {
    if dir.join(name).is_file() {
        Ok(())
    } else {
        Err(CatalogueError::NoEntrypoint {
            reason: format!("type {kind} needs a `{name}` in the install directory (or set `command`)"),
        })
    }
}

/// The file `node` should run: `package.json` `bin[tool_id]` → `bin[name]` (the manifest's `name`, then its
/// `slug`, then `package.json`'s own `name`) → `bin` (a string) → `main` → `module`.
fn node_entry(dir: &Path, entry: &Entry) -> Result<PathBuf, CatalogueError> {
    let tool_id = entry.tool_id.as_str();
    let pkg_path = dir.join("package.json");
    let bytes = match read_small_file(&pkg_path) {
        Err(CatalogueError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
            return Err(CatalogueError::NoEntrypoint {
                reason: "type node needs a `package.json` in the install directory (or set `command`)".into(),
            });
        }
        other => other?,
    };
    let pkg: Value = serde_json::from_slice(&bytes).map_err(|source| CatalogueError::Json {
        path: pkg_path,
        source,
    })?;
    let bin = pkg.get("bin");
    let bin_map = bin.and_then(|b| b.as_object());
    let mut keys: Vec<&str> = vec![tool_id];
    for key in [
        entry.name.as_deref(),
        entry.slug.as_deref(),
        non_empty(pkg.get("name")),
    ]
    .into_iter()
    .flatten()
    {
        if !keys.contains(&key) {
            keys.push(key);
        }
    }
    let mut candidates: Vec<(String, Option<&str>)> = keys
        .iter()
        .map(|k| (format!("bin.{k}"), bin_map.and_then(|m| non_empty(m.get(*k)))))
        .collect();
    candidates.extend([
        ("bin".to_string(), non_empty(bin)),
        ("main".to_string(), non_empty(pkg.get("main"))),
        ("module".to_string(), non_empty(pkg.get("module"))),
    ]);
    let Some((field, entry)) = candidates
        .iter()
        .find_map(|(field, entry)| entry.map(|e| (field, e)))
    else {
        let tried: Vec<String> = candidates.iter().map(|(f, _)| format!("`{f}`")).collect();
        return Err(CatalogueError::NoEntrypoint {
            reason: format!(
                "`package.json` has no entry point: none of {} (`bin` a string) (or set `command`)",
                tried.join(", ")
            ),
        });
    };
    let base = normalize(&dir.join(entry));
    let mut tried = vec![base.clone()];
    for ext in ["js", "mjs", "cjs"] {
        let mut with_ext = base.clone().into_os_string();
        with_ext.push(".");
        with_ext.push(ext);
        tried.push(PathBuf::from(with_ext));
    }
    tried.push(base.join("index.js"));
    tried
        .into_iter()
        .find(|p| p.is_file())
        .ok_or_else(|| CatalogueError::NoEntrypoint {
            reason: format!(
                "`package.json` `{field}` is {entry:?}, which does not exist in the install directory"
            ),
        })
}

fn join_blockers(blockers: &[Blocker]) -> String {
    blockers
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

fn non_empty(value: Option<&Value>) -> Option<&str> {
    value.and_then(Value::as_str).filter(|s| !s.is_empty())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FileCheck {
    Ok,
    Missing,
    NotAFile,
    NotExecutable,
    Unreadable,
}

impl FileCheck {
    fn describe(self) -> String {
        match self {
            FileCheck::Ok => "is usable",
            FileCheck::Missing => "does not exist",
            FileCheck::NotAFile => "is not a regular file",
            FileCheck::NotExecutable => "is not executable",
            FileCheck::Unreadable => "cannot be inspected",
        }
        .to_string()
    }
}

/// Whether `path` (symbolic links followed) is a regular file with an execute bit.
fn executable_file(path: &Path) -> FileCheck {
    match fs::metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => FileCheck::Missing,
        Err(_) => FileCheck::Unreadable,
        Ok(m) if !m.is_file() => FileCheck::NotAFile,
        Ok(m) if m.permissions().mode() & 0o111 == 0 => FileCheck::NotExecutable,
        Ok(_) => FileCheck::Ok,
    }
}

/// Reads a small regular file, refusing anything else (a FIFO cannot block the load: it is opened non-blocking
/// and rejected by its type).
fn read_small_file(path: &Path) -> Result<Vec<u8>, CatalogueError> {
    let io_err = |source: io::Error| CatalogueError::Io {
        path: path.to_path_buf(),
        source,
    };
    let fd = rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io_err(e.into()))?;
    let file = File::from(fd);
    let meta = file.metadata().map_err(io_err)?;
    if !meta.is_file() {
        return Err(CatalogueError::NotAFile {
            path: path.to_path_buf(),
        });
    }
    let too_large = || CatalogueError::TooLarge {
        path: path.to_path_buf(),
        limit: MAX_MANIFEST_BYTES,
    };
    if meta.len() > MAX_MANIFEST_BYTES {
        return Err(too_large());
    }
    let mut bytes = Vec::new();
    file.take(MAX_MANIFEST_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(io_err)?;
    if bytes.len() as u64 > MAX_MANIFEST_BYTES {
        return Err(too_large());
    }
    Ok(bytes)
}

/// Drops `.` components (`/a/./b` → `/a/b`); `..` is kept (resolving it lexically would be wrong with symlinks).
fn normalize(path: &Path) -> PathBuf {
    path.components().collect()
}

fn path_string(path: PathBuf) -> Result<String, CatalogueError> {
    path.into_os_string()
        .into_string()
        .map_err(|os| CatalogueError::NonUtf8Path {
            path: PathBuf::from(os),
        })
}

fn expected(field: impl Into<String>, what: &str, found: &Value) -> CatalogueError {
    CatalogueError::invalid(field, format!("expected {what}, found {}", json_kind(found)))
}

fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}
