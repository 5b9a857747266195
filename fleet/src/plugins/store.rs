//! The fleet's plugin store: package bytes in the JetStream object store `<prefix>_plugin_packages`
//! (content-addressed), records in the KV bucket `<prefix>_plugins` (key: the hash of the tool id; every change
//! is a compare-and-set on the key's revision).

use std::path::Path;
use std::time::Duration;

use async_nats::jetstream::{self, kv, object_store};
use futures::StreamExt as _;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};

use super::download::READ_TIMEOUT;
use super::{MAX_PACKAGE_BYTES, PluginError, PluginRecord};
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

    /// Copies a package object into `dest` (a new file). With `expected_size` (the record's, or the publisher's
    /// claim) the object must have that size; it is never more than [`MAX_PACKAGE_BYTES`]. No pause longer than
    /// [`READ_TIMEOUT`] between two reads: a stalled read fails, it does not hold the caller (a worker's install
    /// of the tool waits behind it).
    pub async fn get_object(
        &self,
        name: &str,
        dest: &Path,
        expected_size: Option<u64>,
    ) -> Result<u64, PluginError> {
        let object = self
            .objects
            .get(name)
            .await
            .map_err(|e| PluginError::store("fetch a package")(&e))?;
        let size = object.info.size as u64;
        if let Some(expected) = expected_size.filter(|e| *e != size) {
            return Err(fleet_worker::install::InstallError::SizeMismatch {
                expected,
                actual: size,
            }
            .into());
        }
        if size > MAX_PACKAGE_BYTES {
            return Err(PluginError::BadRequest(format!(
                "the package is larger than {MAX_PACKAGE_BYTES} bytes"
            )));
        }
        let mut file = tokio::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(dest)
            .await
            .map_err(PluginError::io(format!("create {}", dest.display())))?;
        // The object's chunks are bounded by its recorded size too (a record that lies is refused).
        // Boxed: the object (its consumer, its stream) is large.
        let n = Box::pin(copy_bounded(object, &mut file, size, READ_TIMEOUT))
            .await
            .map_err(|e| match e {
                CopyError::Read(e) => PluginError::store("fetch a package")(&e),
                CopyError::Write(e) => PluginError::io(format!("write {}", dest.display()))(e),
                e @ (CopyError::Stalled { .. } | CopyError::TooLarge { .. }) => {
                    PluginError::store("fetch a package")(&e)
                }
            })?;
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

/// Why [`copy_bounded`] stopped.
#[derive(Debug, thiserror::Error)]
enum CopyError {
    #[error("reading failed: {0}")]
    Read(std::io::Error),
    #[error("writing failed: {0}")]
    Write(std::io::Error),
    #[error("no data for {} s after {after} bytes", stall.as_secs())]
    Stalled { after: u64, stall: Duration },
    #[error("more than the {cap} bytes expected")]
    TooLarge { cap: u64 },
}

/// Copies `from` into `to` until its end: fails past `cap` bytes or when a read waits longer than `stall`.
async fn copy_bounded(
    mut from: impl AsyncRead + Unpin,
    to: &mut (impl AsyncWrite + Unpin),
    cap: u64,
    stall: Duration,
) -> Result<u64, CopyError> {
    let mut buf = vec![0u8; 64 * 1024];
    let mut copied = 0u64;
    loop {
        let n = tokio::time::timeout(stall, from.read(&mut buf))
            .await
            .map_err(|_| CopyError::Stalled { after: copied, stall })?
            .map_err(CopyError::Read)?;
        if n == 0 {
            return Ok(copied);
        }
        copied += n as u64;
        if copied > cap {
            return Err(CopyError::TooLarge { cap });
        }
        to.write_all(&buf[..n]).await.map_err(CopyError::Write)?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_copy_fails_when_its_source_stalls_and_past_its_cap() {
        let stall = Duration::from_secs(30);
        // A source that sends 5 bytes, then nothing (its writer is kept open).
        let (mut writer, reader) = tokio::io::duplex(64);
        writer.write_all(b"hello").await.unwrap();
        let mut out = Vec::new();
        let err = copy_bounded(reader, &mut out, 1024, stall).await.unwrap_err();
        assert!(matches!(err, CopyError::Stalled { after: 5, .. }), "{err}");
        assert_eq!(out, b"hello");
        drop(writer);

        // At its cap exactly: copied; one byte more: refused.
        let mut out = Vec::new();
        assert_eq!(copy_bounded(&b"12345"[..], &mut out, 5, stall).await.unwrap(), 5);
        assert_eq!(out, b"12345");
        let err = copy_bounded(&b"123456"[..], &mut Vec::new(), 5, stall)
            .await
            .unwrap_err();
        assert!(matches!(err, CopyError::TooLarge { cap: 5 }), "{err}");
    }
}
