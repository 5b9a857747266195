//! The worker side: lazy installs from the fleet's plugin store into the worker's executa home
//! (`$ANNA_EXECUTA_HOME`, else `<state_dir>/executa`), handed to the pool.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fleet_worker::catalogue::{self, LoadOptions};
use fleet_worker::install::{self, InstallOptions, InstallRequest};
use fleet_worker::pool::Pool;
use serde_json::json;

use super::download::TempPackage;
use super::store::PluginStore;
use super::{EXECUTA_HOME_ENV, KEEP_VERSIONS_ENV, PackageVersion, PluginError};
use fleet_store::Store;

/// The internal user under which a newly installed version is described once (its manifest feeds `tools.list`);
/// a token cannot name it ([`fleet_proto::api::RESERVED_USER_PREFIX`]).
pub const DESCRIBE_USER: &str = "fleet:catalogue";

/// A replaced version and the task that ends when its last session has stopped.
type Draining = (String, tokio::task::JoinHandle<()>);

/// Lazy installer of one worker.
pub struct Installer {
    plugins: PluginStore,
    store: Store,
    opts: InstallOptions,
    load: LoadOptions,
    /// tool id → (version, sha256) active in the pool.
    active: Mutex<HashMap<String, (String, String)>>,
    /// tool id → versions replaced while sessions still ran them, with the task that ends when those stopped:
    /// the garbage collection keeps them until then.
    draining: Mutex<HashMap<String, Vec<Draining>>>,
    /// One install at a time per tool id.
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl std::fmt::Debug for Installer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Installer")
            .field("home", &self.opts.home)
            .finish_non_exhaustive()
    }
}

/// What [`Installer::ensure`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ensured {
    /// The plugin store has no such tool id.
    Unknown,
    /// The current version was already active.
    Active,
    /// A version was installed (from the local cache or the object store) and handed to the pool.
    Installed {
        /// The version.
        version: String,
        /// Whether it was fetched from the object store (false: local cache).
        fetched: bool,
    },
}

use fleet_proto::util::lock;

impl Installer {
    /// An installer with the worker's defaults: home `$ANNA_EXECUTA_HOME`, else `<state_dir>/executa`; keeps
    /// `$EXECUTA_KEEP_VERSIONS` old versions (default 1); programs looked up on `PATH`, usable by the uids the
    /// pool runs plugins as.
    pub async fn for_pool(
        client: &async_nats::Client,
        store: &Store,
        pool: &Pool,
    ) -> Result<Installer, PluginError> {
        let home = std::env::var_os(EXECUTA_HOME_ENV)
            .map(PathBuf::from)
            .unwrap_or_else(|| pool.context().config.state_dir.join("executa"));
        let mut opts = InstallOptions::new(home);
        if let Some(keep) = std::env::var(KEEP_VERSIONS_ENV)
            .ok()
            .and_then(|v| v.trim().parse().ok())
        {
            opts.keep_versions = keep;
        }
        Installer::new(
            client,
            store,
            opts,
            LoadOptions::for_worker(&pool.context().config),
        )
        .await
    }

    /// An installer with explicit options.
    pub async fn new(
        client: &async_nats::Client,
        store: &Store,
        opts: InstallOptions,
        load: LoadOptions,
    ) -> Result<Installer, PluginError> {
        let plugins =
            PluginStore::open(&async_nats::jetstream::new(client.clone()), store.settings()).await?;
        Ok(Installer {
            plugins,
            store: store.clone(),
            opts,
            load,
            active: Mutex::new(HashMap::new()),
            draining: Mutex::new(HashMap::new()),
            locks: Mutex::new(HashMap::new()),
        })
    }

    /// The plugin records.
    pub fn plugins(&self) -> &PluginStore {
        &self.plugins
    }

    /// The install options (home, kept versions, platform).
    pub fn options(&self) -> &InstallOptions {
        &self.opts
    }

    /// Makes the plugin store's current version of `tool_id` the pool's: a no-op when it is active already,
    /// else from the local cache (its `INSTALL.json` sha256 must be the record's) or downloaded from the object
    /// store and verified by hash, committed, and handed to the pool (running sessions of the previous version
    /// finish their invokes, then stop). A tool id the store does not know leaves the pool too (removed).
    pub async fn ensure(&self, pool: &Pool, tool_id: &str) -> Result<Ensured, PluginError> {
        let record = match self.plugins.get(tool_id).await {
            Ok(r) => r,
            // The store is unreachable: keep serving the version this worker already runs.
            Err(e) if pool.added_install(tool_id).is_some() => {
                tracing::warn!(%tool_id, error = %e, "plugin store unreadable: serving the active version");
                return Ok(Ensured::Active);
            }
            Err(e) => return Err(e),
        };
        let Some((record, _)) = record else {
            if let Some(drained) = pool.remove_install(tool_id) {
                lock(&self.active).remove(tool_id);
                tracing::info!(%tool_id, "plugin removed from the fleet: its sessions drain, then its files go");
                // Once its sessions have stopped, the local copies go too.
                let (opts, t, pool) = (self.opts.clone(), tool_id.to_string(), pool.clone());
                let guard = self.tool_lock(tool_id);
                tokio::spawn(async move {
                    let _ = drained.await;
                    // Not while an install of the same tool id (published again meanwhile) runs or is active.
                    let _held = guard.lock().await;
                    if pool.added_install(&t).is_some() {
                        return;
                    }
                    let removed = tokio::task::spawn_blocking(move || install::remove(&opts, &t, None)).await;
                    if let Ok(Err(e)) = removed {
                        tracing::warn!(error = %e, "cannot remove a removed plugin's files");
                    }
                });
            }
            return Ok(Ensured::Unknown);
        };
        let Some(package) = record.current_package().cloned() else {
            return Ok(Ensured::Unknown);
        };
        if self.is_active(pool, tool_id, &package) {
            return Ok(Ensured::Active);
        }
        let guard = self.tool_lock(tool_id);
        let _held = guard.lock().await;
        if self.is_active(pool, tool_id, &package) {
            return Ok(Ensured::Active);
        }
        let (installed, fetched) = self.install_local(tool_id, &package).await?;
        let load = self.load.clone();
        let dir = installed.dir.clone();
        let install = tokio::task::spawn_blocking(move || catalogue::load_dir(&dir, &load))
            .await
            .map_err(|e| PluginError::BadRequest(e.to_string()))?
            .map_err(|e| PluginError::Launch {
                tool_id: tool_id.to_string(),
                reason: e.to_string(),
            })?;
        let drained = pool.set_install(install);
        let previous = lock(&self.active).insert(
            tool_id.to_string(),
            (package.version.clone(), package.sha256.clone()),
        );
        if let Some((old, _)) = previous.filter(|(v, _)| *v != package.version) {
            lock(&self.draining)
                .entry(tool_id.to_string())
                .or_default()
                .push((old, drained));
        }
        tracing::info!(%tool_id, version = %package.version, fetched, collected = ?installed.collected, "plugin version active");
        self.describe_later(pool, tool_id);
        Ok(Ensured::Installed {
            version: package.version,
            fetched,
        })
    }

    /// Versions of `tool_id` whose sessions have not all stopped yet (finished drains are forgotten).
    fn still_draining(&self, tool_id: &str) -> Vec<String> {
        let mut draining = lock(&self.draining);
        let Some(list) = draining.get_mut(tool_id) else {
            return Vec::new();
        };
        list.retain(|(_, task)| !task.is_finished());
        list.iter().map(|(v, _)| v.clone()).collect()
    }

    fn tool_lock(&self, tool_id: &str) -> Arc<tokio::sync::Mutex<()>> {
        lock(&self.locks).entry(tool_id.to_string()).or_default().clone()
    }

    fn is_active(&self, pool: &Pool, tool_id: &str, package: &PackageVersion) -> bool {
        pool.added_install(tool_id).is_some()
            && lock(&self.active)
                .get(tool_id)
                .is_some_and(|(v, sha)| *v == package.version && *sha == package.sha256)
    }

    /// The version on local disk: the cache when its hash matches, else fetched and installed.
    async fn install_local(
        &self,
        tool_id: &str,
        package: &PackageVersion,
    ) -> Result<(install::Installed, bool), PluginError> {
        let mut opts = self.opts.clone();
        opts.protected = self.still_draining(tool_id);
        let (t, v, sha) = (
            tool_id.to_string(),
            package.version.clone(),
            package.sha256.clone(),
        );
        let cached = tokio::task::spawn_blocking(move || match install::version_record(&opts, &t, &v) {
            Some(r) if r.sha256 == sha => install::activate(&opts, &t, &v).map(Some),
            _ => Ok(None),
        })
        .await
        .map_err(|e| PluginError::BadRequest(e.to_string()))??;
        if let Some(installed) = cached {
            return Ok((installed, false));
        }
        let tmp = std::env::temp_dir();
        let (temp, file) = TempPackage::create(&tmp, tool_id, "").await?;
        drop(file);
        let _ = tokio::fs::remove_file(temp.path()).await;
        self.plugins
            .get_object(&package.object, temp.path(), Some(package.size))
            .await?;
        let req = InstallRequest {
            package: temp.path().to_path_buf(),
            format: Some(package.format),
            tool_id: Some(tool_id.to_string()),
            version: Some(package.version.clone()),
            expected_size: Some(package.size),
            expected_sha256: Some(package.sha256.clone()),
            entrypoint: package.entrypoint.clone(),
            source: json!({ "object": package.object, "fleet": package.source }),
        };
        let mut opts = self.opts.clone();
        opts.protected = self.still_draining(tool_id);
        let installed = tokio::task::spawn_blocking(move || install::install(&opts, &req))
            .await
            .map_err(|e| PluginError::BadRequest(e.to_string()))??;
        drop(temp);
        Ok((installed, true))
    }

    /// Describes the new version once in the background and records its manifest for `tools.list`.
    fn describe_later(&self, pool: &Pool, tool_id: &str) {
        let (pool, store, tool_id) = (pool.clone(), self.store.clone(), tool_id.to_string());
        tokio::spawn(async move {
            match pool
                .prewarm(DESCRIBE_USER, &tool_id, Duration::from_secs(60))
                .await
            {
                Ok(session) => {
                    if let Some(m) = session.manifest()
                        && let Err(e) = store.put_manifest(&tool_id, &m).await
                    {
                        tracing::warn!(%tool_id, error = %e, "cannot record the manifest");
                    }
                    session.shutdown().await;
                }
                Err(e) => tracing::warn!(%tool_id, error = %e, "describing the installed plugin failed"),
            }
        });
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_describe_user_is_one_no_token_can_name() {
        assert!(super::DESCRIBE_USER.starts_with(fleet_proto::api::RESERVED_USER_PREFIX));
    }
}
