//! The fleet's plugin store: package bytes in the JetStream object store `<prefix>_plugin_packages`
//! (content-addressed), records in the KV bucket `<prefix>_plugins` (key: the hash of the tool id; every change
//! is a compare-and-set on the key's revision).

use std::path::Path;

use async_nats::jetstream::{self, kv, object_store};
use futures::StreamExt as _;
use tokio::io::AsyncWriteExt as _;

use super::{PluginError, PluginRecord};
use fleet_proto::api::user_key;
use fleet_store::cas::{Edit as CasEdit, Target, compare_and_set};
use fleet_store::settings::PLUGIN_RECORD_MAX_BYTES;
use fleet_store::{Op, Revisioned, StoreSettings};

/// The store. Cheap to clone.
#[derive(Clone)]
pub struct PluginStore {
    kv: kv::Store,
    objects: object_store::ObjectStore,
}

impl std::fmt::Debug for PluginStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginStore").finish_non_exhaustive()
    }
}

/// What a record edit decides.
#[derive(Debug)]
pub enum Edit {
    /// Write this record.
    Put(PluginRecord),
    /// Delete the key.
    Delete,
    /// Change nothing.
    Keep,
}

impl PluginStore {
    /// Opens (creating when missing) the bucket and the object store. Idempotent; any number of processes may
    /// open concurrently.
    pub async fn open(js: &jetstream::Context, settings: &StoreSettings) -> Result<PluginStore, PluginError> {
        let kv = fleet_store::provision::key_value(js, settings.plugins_kv_config(), settings.provision)
            .await
            .map_err(|e| PluginError::store("open the plugins bucket")(&e))?;
        let objects =
            fleet_store::provision::object_store(js, settings.plugin_packages_config(), settings.provision)
                .await
                .map_err(|e| PluginError::store("open the packages object store")(&e))?;
        Ok(PluginStore { kv, objects })
    }

    /// The record of `tool_id` and its revision.
    pub async fn get(&self, tool_id: &str) -> Result<Option<(PluginRecord, u64)>, PluginError> {
        let entry = self
            .kv
            .entry(user_key(tool_id))
            .await
            .map_err(|e| PluginError::store("read a plugin record")(&e))?;
        match entry {
            Some(e) if e.operation == kv::Operation::Put => {
                let record: PluginRecord = serde_json::from_slice(&e.value)
                    .map_err(|err| PluginError::store("decode a plugin record")(&err))?;
                Ok((record.tool_id == tool_id).then_some((record, e.revision)))
            }
            _ => Ok(None),
        }
    }

    /// The tool ids of records published (put) from now on, as they happen (for workers that prepare a newly
    /// published version before its first call).
    pub async fn watch_published(
        &self,
    ) -> Result<impl futures::Stream<Item = String> + Send + 'static, PluginError> {
        use futures::StreamExt as _;
        let watch = self
            .kv
            .watch_all()
            .await
            .map_err(|e| PluginError::store("watch the plugin records")(&e))?;
        Ok(watch.filter_map(|entry| async move {
            let entry = entry.ok()?;
            if entry.operation != kv::Operation::Put {
                return None;
            }
            serde_json::from_slice::<PluginRecord>(&entry.value)
                .ok()
                .map(|r| r.tool_id)
        }))
    }

    /// Every record, by tool id.
    pub async fn list(&self) -> Result<Vec<PluginRecord>, PluginError> {
        let mut keys = match self.kv.keys().await {
            Ok(k) => k,
            Err(e) => return Err(PluginError::store("list plugin records")(&e)),
        };
        let mut names = Vec::new();
        while let Some(k) = keys.next().await {
            names.push(k.map_err(|e| PluginError::store("list plugin records")(&e))?);
        }
        let mut out = Vec::new();
        for key in names {
            if let Some(e) = self
                .kv
                .entry(key)
                .await
                .map_err(|e| PluginError::store("read a plugin record")(&e))?
                && e.operation == kv::Operation::Put
                && let Ok(r) = serde_json::from_slice::<PluginRecord>(&e.value)
            {
                out.push(r);
            }
        }
        out.sort_by(|a, b| a.tool_id.cmp(&b.tool_id));
        Ok(out)
    }

    /// Edits `tool_id`'s record by compare-and-set: `f` sees the current record (or `None`) and decides; it is
    /// called again when another writer won. Returns what was written (`None` when deleted or kept absent).
    pub async fn edit(
        &self,
        tool_id: &str,
        mut f: impl FnMut(Option<PluginRecord>) -> Result<Edit, PluginError>,
    ) -> Result<Option<PluginRecord>, PluginError> {
        let key = user_key(tool_id);
        let target = Target {
            kv: &self.kv,
            key: &key,
            op: Op::EditPlugin,
            limit: ("plugin record", PLUGIN_RECORD_MAX_BYTES),
        };
        let committed = compare_and_set(target, None, |current: Option<Revisioned<PluginRecord>>| {
            // Another tool id under the same key (a hash collision) reads as absent.
            let existing = current.map(|r| r.value).filter(|r| r.tool_id == tool_id);
            Ok::<_, PluginError>(match f(existing.clone())? {
                Edit::Keep => CasEdit::Keep(existing),
                Edit::Put(record) => CasEdit::Write(record, None),
                Edit::Delete => CasEdit::Delete(None),
            })
        })
        .await?;
        Ok(committed.written.map(|w| w.value).or(committed.out))
    }

    /// Whether the package object exists with this size.
    pub async fn has_object(&self, name: &str, size: u64) -> bool {
        self.objects
            .info(name)
            .await
            .is_ok_and(|i| !i.deleted && i.size as u64 == size)
    }

    /// Stores a package file under `name` (skipped when already there with the same size: names are hashes).
    pub async fn put_object(&self, name: &str, path: &Path, size: u64) -> Result<(), PluginError> {
        if self.has_object(name, size).await {
            return Ok(());
        }
        let mut file = tokio::fs::File::open(path)
            .await
            .map_err(PluginError::io(format!("open {}", path.display())))?;
        self.objects
            .put(name, &mut file)
            .await
            .map_err(|e| PluginError::store("store a package")(&e))?;
        Ok(())
    }

    /// Copies a package object into `dest` (a new file).
    pub async fn get_object(&self, name: &str, dest: &Path) -> Result<u64, PluginError> {
        let mut object = self
            .objects
            .get(name)
            .await
            .map_err(|e| PluginError::store("fetch a package")(&e))?;
        let mut file = tokio::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(dest)
            .await
            .map_err(PluginError::io(format!("create {}", dest.display())))?;
        let n = tokio::io::copy(&mut object, &mut file)
            .await
            .map_err(|e| PluginError::store("fetch a package")(&e))?;
        file.flush()
            .await
            .map_err(PluginError::io(format!("write {}", dest.display())))?;
        Ok(n)
    }

    /// Deletes a package object (absent is fine).
    pub async fn delete_object(&self, name: &str) -> Result<(), PluginError> {
        match self.objects.delete(name).await {
            Ok(()) => Ok(()),
            Err(e) if self.objects.info(name).await.is_err() => {
                tracing::debug!(error = %e, object = name, "package already gone");
                Ok(())
            }
            Err(e) => Err(PluginError::store("delete a package")(&e)),
        }
    }
}
