//! The `executa dev` mode matrix (spec §15.2) as flags of `fleet up`: each reverse-RPC family is `off` (not
//! offered in `initialize`, every call answered with the family's "off" code), `mock` (answered from F3 mock
//! entries, [`crate::mock`]) or `real` (its configured upstream).
//!
//! * `--mocks FILE.jsonl…` (repeatable, several files per flag) loads F3 entries for every plugin, and turns the
//!   harness on; so does any `--dev-mode FAMILY=mock`. With the harness on, each plugin's own `dev.fixtures`
//!   (`executa.json` `dev` block) are loaded too; with it off they are ignored, as production ignores them.
//! * `--dev-mode FAMILY=MODE` (repeatable; a later flag for the same family wins). Families: `sampling`,
//!   `embeddings`, `agent`, `storage` (`storage/*` and `files/*`), `image`, `upload`, and `llm` for both
//!   `sampling` and `embeddings`.
//! * Defaults: `real` where an upstream exists (sampling with `[llm]`, embeddings with an `[llm]` embedding model,
//!   storage and uploads always: JetStream); else `mock` when the harness is on; else `off`. So a plain
//!   `fleet up` behaves as before, and `fleet up --mocks f.jsonl` mocks exactly the families nothing else serves.
//! * `real` for a family without an upstream (agent needs `[llm]`; image needs `[image]`) is a start-up error.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use fleet_proto::executa::reverse::{Family, RpcCode, agent, embeddings, image, sampling, storage, upload};

use crate::ServicesConfig;
use crate::mock::{MockFileError, MockSet};

/// A family of the mode matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DevFamily {
    /// `sampling/createMessage`.
    Sampling,
    /// `embeddings/create`.
    Embeddings,
    /// `agent/*`.
    Agent,
    /// `storage/*` and `files/*`.
    Storage,
    /// `image/generate`, `image/edit`.
    Image,
    /// `host/uploadFile`.
    Upload,
}

impl DevFamily {
    /// Every family, in matrix order.
    pub const ALL: [DevFamily; 6] = [
        DevFamily::Sampling,
        DevFamily::Embeddings,
        DevFamily::Agent,
        DevFamily::Storage,
        DevFamily::Image,
        DevFamily::Upload,
    ];

    /// The name `--dev-mode` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            DevFamily::Sampling => "sampling",
            DevFamily::Embeddings => "embeddings",
            DevFamily::Agent => "agent",
            DevFamily::Storage => "storage",
            DevFamily::Image => "image",
            DevFamily::Upload => "upload",
        }
    }

    /// The matrix family of a reverse-RPC family (`None`: `credentials/*` and `web/*`, never offered).
    pub fn of(family: Family) -> Option<DevFamily> {
        Some(match family {
            Family::Sampling => DevFamily::Sampling,
            Family::Embeddings => DevFamily::Embeddings,
            Family::Agent => DevFamily::Agent,
            Family::Storage | Family::Files => DevFamily::Storage,
            Family::Image => DevFamily::Image,
            Family::Upload => DevFamily::Upload,
            Family::Credentials | Family::Web => return None,
        })
    }

    /// The code every call of an `off` family gets (spec §15.2 "Host-visible error when off"; embeddings:
    /// its not-negotiated code, as for a host without an embedding model).
    pub fn off_code(self) -> RpcCode {
        match self {
            DevFamily::Sampling => sampling::SAMPLING_NOT_NEGOTIATED,
            DevFamily::Embeddings => embeddings::EMBED_NOT_NEGOTIATED,
            DevFamily::Agent => agent::AGENT_NOT_GRANTED,
            DevFamily::Storage => storage::STORAGE_NOT_GRANTED,
            DevFamily::Image => image::IMAGE_NOT_GRANTED,
            DevFamily::Upload => upload::UPLOAD_NOT_GRANTED,
        }
    }

    /// What `real` would need, for the start-up error.
    fn upstream_needed(self) -> &'static str {
        match self {
            DevFamily::Sampling => "no LLM upstream is configured (add [llm] to --services-config)",
            DevFamily::Embeddings => {
                "no embedding upstream is configured (set embedding_model in [llm] of --services-config)"
            }
            DevFamily::Agent => {
                "no LLM upstream is configured (agent sessions run over [llm] of --services-config)"
            }
            DevFamily::Image => "no image upstream is configured (add [image] to --services-config)",
            DevFamily::Storage | DevFamily::Upload => "its JetStream store is unavailable",
        }
    }

    /// The families a `--dev-mode` name stands for.
    fn named(name: &str) -> Option<&'static [DevFamily]> {
        Some(match name {
            "sampling" => &[DevFamily::Sampling],
            "embeddings" => &[DevFamily::Embeddings],
            "llm" => &[DevFamily::Sampling, DevFamily::Embeddings],
            "agent" => &[DevFamily::Agent],
            "storage" => &[DevFamily::Storage],
            "image" => &[DevFamily::Image],
            "upload" => &[DevFamily::Upload],
            _ => return None,
        })
    }
}

/// A family's mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DevMode {
    /// Not offered; every call answered with [`DevFamily::off_code`].
    Off,
    /// Answered from the mock entries (else an echo).
    Mock,
    /// Answered by the configured upstream.
    Real,
}

impl DevMode {
    /// The name `--dev-mode` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            DevMode::Off => "off",
            DevMode::Mock => "mock",
            DevMode::Real => "real",
        }
    }
}

/// One `--dev-mode FAMILY=MODE`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DevModeArg {
    /// The families it sets (`llm` is two).
    pub families: &'static [DevFamily],
    /// Their mode.
    pub mode: DevMode,
}

/// Parses `FAMILY=MODE`.
///
/// # Errors
/// A message naming the accepted families and modes.
pub fn parse_dev_mode(text: &str) -> Result<DevModeArg, String> {
    let (family, mode) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?}: expected FAMILY=MODE, e.g. image=mock"))?;
    let families = DevFamily::named(family.trim()).ok_or_else(|| {
        format!("{family:?}: not a family; one of sampling, embeddings, llm, agent, storage, image, upload")
    })?;
    let mode = match mode.trim() {
        "off" => DevMode::Off,
        "mock" => DevMode::Mock,
        "real" => DevMode::Real,
        other => return Err(format!("{other:?}: not a mode; one of off, mock, real")),
    };
    Ok(DevModeArg { families, mode })
}

/// The developer-harness flags of `fleet up`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct DevArgs {
    /// F3 mock files (JSONL, one `MockEntry` per line; spec §15.4): reverse-RPC families in `mock` mode answer
    /// from the first matching entry, else with a deterministic echo. Several files per flag, and repeatable.
    /// Turns the developer harness on (families without an upstream default to `mock`; plugins'
    /// `dev.fixtures` are loaded). A broken line stops the start with its file and line.
    #[arg(long = "mocks", value_name = "FILE.jsonl", num_args = 1..)]
    pub mocks: Vec<PathBuf>,
    /// The mode of a reverse-RPC family: FAMILY=MODE, FAMILY one of sampling, embeddings, llm (= sampling and
    /// embeddings), agent, storage, image, upload; MODE one of off (not offered), mock, real (the configured
    /// upstream; an error at start-up when there is none). `mock` turns the harness on.
    #[arg(long = "dev-mode", value_name = "FAMILY=MODE", value_parser = parse_dev_mode)]
    pub dev_modes: Vec<DevModeArg>,
}

/// Why the developer harness could not start.
#[derive(Debug, thiserror::Error)]
pub enum DevError {
    /// A mock file or a plugin's `dev.fixtures`.
    #[error(transparent)]
    Mocks(#[from] MockFileError),
    /// `real` for a family with no upstream.
    #[error("--dev-mode {family}=real: {needed}")]
    NoUpstream {
        /// The family.
        family: &'static str,
        /// What is missing.
        needed: &'static str,
    },
}

/// The harness as the flags ask for it: explicit modes and the loaded mock entries.
#[derive(Debug, Clone, Default)]
pub struct DevSettings {
    explicit: BTreeMap<DevFamily, DevMode>,
    mocks: Arc<MockSet>,
    active: bool,
}

impl DevArgs {
    /// Loads the mock files and, when the harness is on, the `dev.fixtures` of the plugins in `plugins_dir`.
    ///
    /// # Errors
    /// An unreadable mock file or a broken entry (named by file and line).
    pub fn settings(&self, plugins_dir: &Path) -> Result<DevSettings, DevError> {
        let mut explicit = BTreeMap::new();
        for arg in &self.dev_modes {
            for family in arg.families {
                explicit.insert(*family, arg.mode);
            }
        }
        let active = !self.mocks.is_empty() || explicit.values().any(|m| *m == DevMode::Mock);
        let mocks = if active {
            MockSet::new(
                MockSet::load_files(&self.mocks)?,
                MockSet::load_dev_fixtures(plugins_dir)?,
            )
        } else {
            MockSet::default()
        };
        Ok(DevSettings {
            explicit,
            mocks: Arc::new(mocks),
            active,
        })
    }
}

/// Which families have a real upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Upstreams {
    /// `[llm]` is configured.
    pub sampling: bool,
    /// `[llm]` names an embedding model.
    pub embeddings: bool,
    /// `[image]` is configured.
    pub image: bool,
}

impl Upstreams {
    /// The upstreams of a services configuration.
    pub fn of(config: &ServicesConfig) -> Upstreams {
        Upstreams {
            sampling: config.llm.is_some(),
            embeddings: config
                .llm
                .as_ref()
                .is_some_and(|l| l.embedding_model.is_some() || !l.embedding_aliases.is_empty()),
            image: config.image.is_some(),
        }
    }

    fn has(self, family: DevFamily) -> bool {
        match family {
            DevFamily::Sampling => self.sampling,
            DevFamily::Embeddings => self.embeddings,
            DevFamily::Storage | DevFamily::Upload => true,
            DevFamily::Image => self.image,
            // Agent sessions run over the sampling upstream.
            DevFamily::Agent => self.sampling,
        }
    }
}

/// The resolved mode of every family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Modes([DevMode; 6]);

impl Modes {
    /// The mode of a matrix family.
    pub fn get(&self, family: DevFamily) -> DevMode {
        self.0[DevFamily::ALL.iter().position(|f| *f == family).unwrap_or(0)]
    }

    /// The mode of a reverse-RPC family (`None` outside the matrix: credentials and web).
    pub fn of(&self, family: Family) -> Option<DevMode> {
        DevFamily::of(family).map(|f| self.get(f))
    }

    /// Whether the family is served (mock or real).
    pub fn on(&self, family: DevFamily) -> bool {
        self.get(family) != DevMode::Off
    }
}

impl DevSettings {
    /// Every family's mode given the upstreams that exist.
    ///
    /// # Errors
    /// [`DevError::NoUpstream`] for `real` without an upstream.
    pub fn resolve(&self, upstreams: Upstreams) -> Result<Modes, DevError> {
        let mut modes = [DevMode::Off; 6];
        for (slot, family) in modes.iter_mut().zip(DevFamily::ALL) {
            let real = upstreams.has(family);
            *slot = match self.explicit.get(&family) {
                Some(DevMode::Real) if !real => {
                    return Err(DevError::NoUpstream {
                        family: family.as_str(),
                        needed: family.upstream_needed(),
                    });
                }
                Some(mode) => *mode,
                None if real => DevMode::Real,
                None if self.active => DevMode::Mock,
                None => DevMode::Off,
            };
        }
        Ok(Modes(modes))
    }

    /// The loaded mock entries.
    pub fn mocks(&self) -> &Arc<MockSet> {
        &self.mocks
    }

    /// Whether `--dev-mode` names a mode for `family`.
    pub fn is_explicit(&self, family: DevFamily) -> bool {
        self.explicit.contains_key(&family)
    }

    /// Whether the harness is on (`--mocks` or a `mock` mode).
    pub fn is_active(&self) -> bool {
        self.active
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(flags: &[&str]) -> DevSettings {
        let args = DevArgs {
            mocks: Vec::new(),
            dev_modes: flags.iter().map(|f| parse_dev_mode(f).unwrap()).collect(),
        };
        args.settings(Path::new("/nonexistent")).unwrap()
    }

    const NO_LLM: Upstreams = Upstreams {
        sampling: false,
        embeddings: false,
        image: false,
    };
    const LLM: Upstreams = Upstreams {
        sampling: true,
        embeddings: true,
        image: false,
    };

    #[test]
    fn without_flags_only_what_has_an_upstream_is_on() {
        let modes = settings(&[]).resolve(NO_LLM).unwrap();
        for (family, mode) in [
            (DevFamily::Sampling, DevMode::Off),
            (DevFamily::Embeddings, DevMode::Off),
            (DevFamily::Agent, DevMode::Off),
            (DevFamily::Storage, DevMode::Real),
            (DevFamily::Image, DevMode::Off),
            (DevFamily::Upload, DevMode::Real),
        ] {
            assert_eq!(modes.get(family), mode, "{family:?}");
        }
        assert_eq!(
            settings(&[]).resolve(LLM).unwrap().get(DevFamily::Sampling),
            DevMode::Real
        );
    }

    #[test]
    fn with_the_harness_on_families_without_an_upstream_are_mocked() {
        let modes = settings(&["image=mock"]).resolve(LLM).unwrap();
        assert_eq!(modes.get(DevFamily::Image), DevMode::Mock);
        assert_eq!(
            modes.get(DevFamily::Agent),
            DevMode::Real,
            "agent sessions run over the LLM upstream"
        );
        assert_eq!(
            modes.get(DevFamily::Sampling),
            DevMode::Real,
            "a configured upstream stays real"
        );
        assert_eq!(modes.get(DevFamily::Storage), DevMode::Real);
        let without = settings(&["image=mock"]).resolve(NO_LLM).unwrap();
        assert_eq!(without.get(DevFamily::Agent), DevMode::Mock);
        let modes = settings(&["llm=mock", "image=off", "storage=mock"])
            .resolve(LLM)
            .unwrap();
        assert_eq!(modes.get(DevFamily::Sampling), DevMode::Mock);
        assert_eq!(modes.get(DevFamily::Embeddings), DevMode::Mock);
        assert_eq!(modes.get(DevFamily::Image), DevMode::Off);
        assert_eq!(modes.get(DevFamily::Storage), DevMode::Mock);
        assert_eq!(
            modes.of(Family::Files),
            Some(DevMode::Mock),
            "files follow storage"
        );
        assert_eq!(modes.of(Family::Web), None);
    }

    #[test]
    fn a_later_flag_wins() {
        let modes = settings(&["image=off", "image=mock"]).resolve(NO_LLM).unwrap();
        assert_eq!(modes.get(DevFamily::Image), DevMode::Mock);
    }

    #[test]
    fn real_without_an_upstream_is_refused() {
        for (flag, upstreams) in [
            ("sampling=real", NO_LLM),
            ("llm=real", NO_LLM),
            ("agent=real", NO_LLM),
            ("image=real", LLM),
            (
                "embeddings=real",
                Upstreams {
                    sampling: true,
                    embeddings: false,
                    image: false,
                },
            ),
        ] {
            let e = settings(&[flag]).resolve(upstreams).unwrap_err();
            let shown = e.to_string();
            assert!(shown.starts_with("--dev-mode "), "{shown}");
            assert!(shown.contains("=real: "), "{shown}");
        }
        assert!(settings(&["storage=real", "upload=real"]).resolve(NO_LLM).is_ok());
    }

    #[test]
    fn plugins_dev_fixtures_are_read_only_with_the_harness_on() {
        let dir = tempfile::tempdir().unwrap();
        let plugin = dir.path().join("p");
        std::fs::create_dir_all(plugin.join("fixtures")).unwrap();
        std::fs::write(
            plugin.join("executa.json"),
            r#"{"tool_id":"p","type":"binary","dev":{"fixtures":["fixtures/*.jsonl"]}}"#,
        )
        .unwrap();
        std::fs::write(plugin.join("fixtures/a.jsonl"), "{broken\n").unwrap();
        let args = |flags: &[&str]| DevArgs {
            mocks: Vec::new(),
            dev_modes: flags.iter().map(|f| parse_dev_mode(f).unwrap()).collect(),
        };
        // Off (as production): the block is not even read.
        let off = args(&["image=off"]).settings(dir.path()).unwrap();
        assert!(!off.is_active());
        assert!(off.mocks().is_empty());
        // On: read, and the broken line is named.
        let e = args(&["image=mock"])
            .settings(dir.path())
            .unwrap_err()
            .to_string();
        assert!(e.contains("fixtures/a.jsonl: line 1: "), "{e}");
        std::fs::write(
            plugin.join("fixtures/a.jsonl"),
            r#"{"ns":"image","method":"generate","result":{}}"#,
        )
        .unwrap();
        let on = args(&["image=mock"]).settings(dir.path()).unwrap();
        assert_eq!(on.mocks().len(), 1);
        // A dev block that is not a list of patterns is an error naming the manifest.
        std::fs::write(
            plugin.join("executa.json"),
            r#"{"tool_id":"p","type":"binary","dev":{"fixtures":"x"}}"#,
        )
        .unwrap();
        let e = args(&["image=mock"])
            .settings(dir.path())
            .unwrap_err()
            .to_string();
        assert!(e.contains("executa.json: dev.fixtures: must be an array"), "{e}");
    }

    #[test]
    fn bad_flags_name_what_is_accepted() {
        assert!(parse_dev_mode("image").unwrap_err().contains("FAMILY=MODE"));
        assert!(
            parse_dev_mode("video=mock")
                .unwrap_err()
                .contains("one of sampling")
        );
        assert!(
            parse_dev_mode("image=fake")
                .unwrap_err()
                .contains("one of off, mock, real")
        );
        assert_eq!(
            parse_dev_mode("llm=off").unwrap().families,
            &[DevFamily::Sampling, DevFamily::Embeddings]
        );
    }
}
