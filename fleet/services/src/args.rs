//! The host-services flags shared by `fleet up` and `fleet worker`.

use std::path::{Path, PathBuf};

use super::credentials::{KEYRING_FILE, Keyring};
use super::dev::DevSettings;
use super::files::LinkSigner;
use super::{FleetServices, ServicesConfig, ServicesError};
use fleet_store::StoreSettings;

/// The file under the data dir holding the download-link secret when `--link-signing-key-file` is absent.
pub const LINK_KEY_FILE: &str = "link-signing-key";

/// Flags of the host services (sampling, embeddings, APS storage and files, uploads).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ServicesArgs {
    /// TOML file configuring the host services (`public_url`, `[llm]`, `[storage]`, `[image]`, `[web]`, `[agent]`;
    /// see docs/configuration.md). Without it: storage, files and uploads on JetStream, no LLM upstream (sampling,
    /// embeddings and agent sessions not offered), no images, web/fetch native and no web search.
    #[arg(long, env = "FLEET_SERVICES_CONFIG")]
    pub services_config: Option<PathBuf>,
    /// The base URL download links point at (overrides `public_url` of the services config).
    #[arg(long, env = "FLEET_PUBLIC_URL")]
    pub public_url: Option<String>,
    /// The base URL of file download and upload links when user content has an origin of its own (overrides
    /// `files_public_url` of the services config; default: the public URL). Recommended in production: a
    /// cookieless host that routes only `/v1/files/` to the fronts.
    #[arg(long, env = "FLEET_FILES_PUBLIC_URL")]
    pub files_public_url: Option<String>,
    /// A file with the secret (64 hex digits or ≥ 32 bytes) that signs download and upload links; every fleet
    /// process must share it. Default: `<data-dir>/link-signing-key`, created on first use.
    #[arg(long, env = "FLEET_LINK_SIGNING_KEY_FILE")]
    pub link_signing_key_file: Option<PathBuf>,
    /// The keyring that encrypts the users' plugin credentials at rest: `<key id> <64 hex digits>` per line, the
    /// first key wraps, every key unwraps (`fleet credentials rotate-key` prepends one). Fronts and workers must
    /// share it. Default: `<data-dir>/credentials.keys`, created (mode 0600) on first use.
    #[arg(long, env = "FLEET_CREDENTIALS_KEY_FILE")]
    pub credentials_key_file: Option<PathBuf>,
    /// The cluster's own ranges — pod, service and node CIDRs, IPv4 and IPv6 (a CIDR; repeat, or separate by
    /// commas) — refused to `web/fetch` and image inputs and, on a worker, to the egress proxy and preparations,
    /// whatever else is allowed. Needed on dual-stack and IPv6 clusters, whose addresses are global unicast (the
    /// private IPv4 ranges are refused anyway).
    #[arg(long, env = "FLEET_CLUSTER_CIDRS", value_delimiter = ',')]
    pub cluster_cidr: Vec<ipnet::IpNet>,
}

impl ServicesArgs {
    /// The configuration: the TOML file, then the flags.
    pub fn config(&self) -> Result<ServicesConfig, ServicesError> {
        let mut config = match &self.services_config {
            None => ServicesConfig::default(),
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| ServicesError::Config(format!("{}: {e}", path.display())))?;
                toml::from_str(&text)
                    .map_err(|e| ServicesError::Config(format!("{}: {e}", path.display())))?
            }
        };
        if let Some(url) = &self.public_url {
            config.public_url = Some(url.clone());
        }
        if let Some(url) = &self.files_public_url {
            config.files_public_url = Some(url.clone());
        }
        config.web.deny_cidrs.extend(self.cluster_cidr.iter().copied());
        Ok(config)
    }

    /// The link signer: `--link-signing-key-file`, else `<data_dir>/link-signing-key` (created).
    pub fn link_signer(&self, data_dir: &Path) -> Result<LinkSigner, ServicesError> {
        let secret = match &self.link_signing_key_file {
            Some(path) => fleet_client::auth::load_secret_file(path),
            None => fleet_client::auth::load_or_create_secret(data_dir, LINK_KEY_FILE),
        }
        .map_err(|e| ServicesError::Config(e.to_string()))?;
        Ok(LinkSigner::new(&secret))
    }

    /// The credentials keyring: `--credentials-key-file` (which must exist), else `<data_dir>/credentials.keys`
    /// (created).
    pub fn keyring(&self, data_dir: &Path) -> Result<Keyring, ServicesError> {
        match &self.credentials_key_file {
            Some(path) => Keyring::load(path),
            None => Keyring::load_or_create(&data_dir.join(KEYRING_FILE)),
        }
        .map_err(|e| ServicesError::Config(e.to_string()))
    }

    /// Opens the services on `js`, with `default_public_url` when neither the file nor the flag sets one.
    pub async fn open(
        &self,
        js: &async_nats::jetstream::Context,
        settings: &StoreSettings,
        data_dir: &Path,
        default_public_url: Option<String>,
    ) -> Result<FleetServices, ServicesError> {
        Box::pin(self.open_with_dev(js, settings, data_dir, default_public_url, DevSettings::default())).await
    }

    /// [`Self::open`] with the developer harness of `fleet up` (`--mocks`, `--dev-mode`).
    pub async fn open_with_dev(
        &self,
        js: &async_nats::jetstream::Context,
        settings: &StoreSettings,
        data_dir: &Path,
        default_public_url: Option<String>,
        dev: DevSettings,
    ) -> Result<FleetServices, ServicesError> {
        let mut config = self.config()?;
        config.dev = dev;
        if config.public_url.is_none() {
            config.public_url = default_public_url;
        }
        let links = self.link_signer(data_dir)?;
        let keyring = self.keyring(data_dir)?;
        Box::pin(FleetServices::open(js, settings, &config, links, keyring)).await
    }
}
