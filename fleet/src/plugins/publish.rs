//! The operator side: publish a package (validated by the full install pipeline in a scratch home before anyone
//! can use it), list, remove, describe.

use std::path::{Path, PathBuf};

use fleet_proto::admin::plugins::{InstallArgs, Published};
use fleet_worker::install::{self, Format, InstallError, InstallOptions, InstallRequest};
use serde_json::{Value, json};

use super::download::{SourcePolicy, TempPackage, download};
use super::store::{Edit, PluginStore};
use super::{PackageVersion, PluginError, PluginRecord, object_name};
use fleet_proto::util::now_ms;

/// Publishes a package: see the module docs. `scratch` holds temporary files and the validation home.
/// A `source` or `binary_urls` download connects only where `source_policy` allows.
pub async fn install(
    store: &PluginStore,
    scratch: &Path,
    source_policy: &SourcePolicy,
    args: InstallArgs,
) -> Result<Published, PluginError> {
    tokio::fs::create_dir_all(scratch)
        .await
        .map_err(PluginError::io(format!("create {}", scratch.display())))?;
    let sources = [
        args.source.is_some(),
        args.binary_urls.is_some(),
        args.object.is_some(),
    ];
    if sources.iter().filter(|s| **s).count() != 1 {
        return Err(PluginError::BadRequest(
            "give exactly one of `source` (an http(s) URL), `binary_urls` or `object`".into(),
        ));
    }
    let platform = install::platform_key();
    let mut format = args
        .format
        .as_deref()
        .map(Format::parse)
        .transpose()
        .map_err(InstallError::from)?;
    let mut sha256 = args
        .sha256
        .as_deref()
        .map(install::normalize_sha256)
        .transpose()?;
    let mut size = args.size;
    let mut entrypoint = args.entrypoint.clone();
    let hint = args.tool_id.clone().unwrap_or_else(|| "package".into());
    let mut download_stats = None;
    let mut uploaded = None;
    let (package, source, name_for_raw): (TempPackage, Value, Option<String>) = if let Some(object) =
        &args.object
    {
        let hex = install::normalize_sha256(object)?;
        if sha256.as_ref().is_some_and(|s| *s != hex) {
            return Err(install::InstallError::Sha256Mismatch {
                expected: sha256.unwrap_or_default(),
                actual: hex,
            }
            .into());
        }
        sha256 = Some(hex.clone());
        let name = args.file_name.clone().unwrap_or_default();
        if format.is_none() {
            format = Some(Format::infer(&name));
        }
        let suffix = if format == Some(Format::Raw) { "" } else { ".pkg" };
        let (temp, file) = TempPackage::create(scratch, &hint, suffix).await?;
        drop(file);
        tokio::fs::remove_file(temp.path()).await.ok();
        store.get_object(&object_name(&hex), temp.path(), size).await?;
        uploaded = Some(object_name(&hex));
        let raw_name = Path::new(&name)
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned());
        (
            temp,
            json!({ "upload": name, "object": object_name(&hex) }),
            raw_name,
        )
    } else {
        let (url, source) = match (&args.source, &args.binary_urls) {
            (Some(url), _) => (url.clone(), json!({ "url": url })),
            (None, Some(map)) => {
                let asset = install::resolve_asset(map, &platform)?;
                if sha256.is_none() {
                    sha256.clone_from(&asset.sha256);
                }
                if size.is_none() {
                    size = asset.size;
                }
                if entrypoint.is_none() {
                    entrypoint.clone_from(&asset.entrypoint);
                }
                if format.is_none() {
                    format = Some(asset.format);
                }
                let source = json!({ "url": asset.url, "binary_urls": map, "platform_key": platform, "asset_key": asset.key });
                (asset.url, source)
            }
            (None, None) => unreachable_source()?,
        };
        if format.is_none() {
            format = Some(Format::infer(&url));
        }
        let started = std::time::Instant::now();
        let url_for_log = url.clone();
        let progress = move |got: u64, total: Option<u64>| {
            tracing::info!(url = %url_for_log, bytes = got, total = ?total, "plugin package download");
        };
        let temp = download(&url, scratch, &hint, size, source_policy, &progress).await?;
        let bytes = tokio::fs::metadata(temp.path())
            .await
            .map(|m| m.len())
            .unwrap_or(0);
        download_stats = Some(
            json!({ "bytes": bytes, "ms": u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX) }),
        );
        let raw_name = url
            .split(['?', '#'])
            .next()
            .and_then(|p| p.rsplit('/').next())
            .map(|s| s.trim_end_matches(".exe").to_string())
            .filter(|s| !s.is_empty());
        (temp, source, raw_name)
    };
    let format = format.unwrap_or(Format::Raw);
    let tool_id = match (&args.tool_id, format) {
        (Some(t), _) => Some(t.clone()),
        (None, Format::Raw) => name_for_raw,
        (None, _) => None,
    };

    // Validate with the whole pipeline in a scratch home (removed afterwards).
    let home = scratch.join(format!("validate-{:016x}", rand::random::<u64>()));
    let req = InstallRequest {
        package: package.path().to_path_buf(),
        format: Some(format),
        tool_id,
        version: args.version.clone(),
        expected_size: size,
        expected_sha256: sha256.clone(),
        entrypoint: entrypoint.clone(),
        source: source.clone(),
    };
    let opts = InstallOptions::new(&home);
    let validated = tokio::task::spawn_blocking(move || {
        let r = install::install(&opts, &req);
        let _ = std::fs::remove_dir_all(&opts.home);
        r
    })
    .await
    .map_err(|e| PluginError::BadRequest(format!("the install task failed: {e}")))??;
    let record = validated.record;
    let object = object_name(&record.sha256);
    if uploaded.as_deref() != Some(object.as_str()) {
        store.put_object(&object, package.path(), record.size).await?;
    }
    drop(package);

    let package = PackageVersion {
        version: record.version.clone(),
        sha256: record.sha256.clone(),
        size: record.size,
        object,
        format: record.format,
        kind: record.kind.clone(),
        entrypoint: record.entrypoint.clone(),
        source,
        manifest: validated.manifest,
        warnings: record.warnings.clone(),
        published_at_ms: now_ms(),
    };
    let mut previous = None;
    let tool_id = record.tool_id.clone();
    store
        .edit(&tool_id, |existing| {
            previous = existing.as_ref().map(|r| r.current.clone());
            let mut r = existing.unwrap_or_else(|| PluginRecord {
                tool_id: tool_id.clone(),
                current: String::new(),
                versions: Default::default(),
                updated_at_ms: 0,
            });
            r.versions.insert(package.version.clone(), package.clone());
            r.current.clone_from(&package.version);
            r.updated_at_ms = now_ms();
            Ok(Edit::Put(r))
        })
        .await?;
    tracing::info!(tool_id = %tool_id, version = %package.version, sha256 = %package.sha256, "plugin published");
    Ok(Published {
        tool_id,
        version: package.version.clone(),
        previous,
        package,
        download: download_stats,
    })
}

fn unreachable_source() -> Result<(String, Value), PluginError> {
    Err(PluginError::BadRequest("no source".into()))
}

/// Every plugin record.
pub async fn list(store: &PluginStore) -> Result<Vec<PluginRecord>, PluginError> {
    store.list().await
}

/// Removes one version (never the current one while others remain: the record is left as it was) or the whole
/// plugin; deletes package objects no remaining version of any plugin uses. Returns the removed versions.
pub async fn remove(
    store: &PluginStore,
    tool_id: &str,
    version: Option<&str>,
) -> Result<Vec<String>, PluginError> {
    let version = version.map(install::sanitize_version).transpose()?;
    let mut removed: Vec<PackageVersion> = Vec::new();
    let mut refused = None;
    store
        .edit(tool_id, |existing| {
            removed.clear();
            let Some(mut r) = existing else {
                return Err(PluginError::NotFound {
                    tool_id: tool_id.to_string(),
                    version: version.clone(),
                });
            };
            match &version {
                None => {
                    removed.extend(r.versions.values().cloned());
                    Ok(Edit::Delete)
                }
                Some(v) => {
                    let Some(p) = r.versions.get(v).cloned() else {
                        return Err(PluginError::NotFound {
                            tool_id: tool_id.to_string(),
                            version: Some(v.clone()),
                        });
                    };
                    if r.current == *v && r.versions.len() > 1 {
                        refused = Some(v.clone());
                        return Ok(Edit::Keep);
                    }
                    r.versions.remove(v);
                    removed.push(p);
                    if r.versions.is_empty() {
                        Ok(Edit::Delete)
                    } else {
                        r.updated_at_ms = now_ms();
                        Ok(Edit::Put(r))
                    }
                }
            }
        })
        .await?;
    if let Some(v) = refused {
        return Err(PluginError::BadRequest(format!(
            "{tool_id} v{v} is the current version: install another version first, or remove the plugin"
        )));
    }
    // Objects still referenced by any version stay.
    let in_use: Vec<String> = store
        .list()
        .await?
        .iter()
        .flat_map(|r| r.versions.values().map(|p| p.object.clone()))
        .collect();
    for p in &removed {
        if !in_use.contains(&p.object) {
            store.delete_object(&p.object).await?;
        }
    }
    Ok(removed.into_iter().map(|p| p.version).collect())
}

/// The record of one plugin.
pub async fn describe(store: &PluginStore, tool_id: &str) -> Result<PluginRecord, PluginError> {
    store
        .get(tool_id)
        .await?
        .map(|(r, _)| r)
        .ok_or_else(|| PluginError::NotFound {
            tool_id: tool_id.to_string(),
            version: None,
        })
}

/// The scratch directory of an operator service in `data_dir`.
pub fn scratch_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("plugin-scratch")
}
