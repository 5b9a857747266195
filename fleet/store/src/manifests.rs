//! Plugin manifests as described by a worker (`<prefix>_manifests`, key = [`user_key`] of the tool id, i.e. a
//! fixed-length hash, since tool ids may hold characters keys forbid), for `tools.list` on any front replica.

use async_nats::jetstream::consumer::DeliverPolicy;
use fleet_proto::executa::manifest::Manifest;
use serde::{Deserialize, Serialize};

use super::scan::{Scan, scan};
use super::settings::MANIFEST_MAX_BYTES;
use fleet_proto::api::user_key;

use super::{Op, Store, StoreError, encode, is_kv_marker, read_settled};

/// The value: the real tool id and its manifest.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct ManifestEntry {
    tool_id: String,
    manifest: Manifest,
}

impl Store {
    /// Records (or replaces) the manifest of an installed tool id.
    pub async fn put_manifest(&self, tool_id: &str, manifest: &Manifest) -> Result<(), StoreError> {
        let entry = ManifestEntry {
            tool_id: tool_id.to_string(),
            manifest: manifest.clone(),
        };
        let bytes = encode(&entry, ("manifest", MANIFEST_MAX_BYTES), Op::PutManifest)?;
        let manifests = &self.inner.manifests;
        manifests
            .put(user_key(tool_id), bytes)
            .await
            .map_err(|e| StoreError::nats(Op::PutManifest, e))?;
        Ok(())
    }

    /// Forgets the manifest of a tool id that is no longer installed (a removed published plugin), so `tools.list`
    /// stops listing it. Idempotent.
    pub async fn delete_manifest(&self, tool_id: &str) -> Result<(), StoreError> {
        self.inner
            .manifests
            .delete(user_key(tool_id))
            .await
            .map_err(|e| StoreError::nats(Op::DeleteManifest, e))
    }

    /// The recorded manifest of a tool id, if any.
    pub async fn manifest(&self, tool_id: &str) -> Result<Option<Manifest>, StoreError> {
        let entry =
            read_settled::<ManifestEntry>(&self.inner.manifests, &user_key(tool_id), Op::GetManifest).await?;
        Ok(entry
            .map(|e| e.value)
            .filter(|e| e.tool_id == tool_id)
            .map(|e| e.manifest))
    }

    /// Every recorded manifest, by tool id. Entries that do not parse are skipped (and logged).
    pub async fn manifests(&self) -> Result<Vec<(String, Manifest)>, StoreError> {
        let manifests = &self.inner.manifests;
        let messages = scan(
            &manifests.stream,
            Scan {
                filter: format!("{}>", manifests.prefix),
                deliver: DeliverPolicy::LastPerSubject,
                headers_only: false,
                max: usize::MAX,
            },
        )
        .await
        .map_err(|e| StoreError::nats(Op::ListManifests, e))?;
        let mut out: Vec<(String, Manifest)> = messages
            .iter()
            .filter(|m| !is_kv_marker(&m.message))
            .filter_map(|m| match serde_json::from_slice::<ManifestEntry>(&m.message.payload) {
                Ok(e) => Some((e.tool_id, e.manifest)),
                Err(e) => {
                    tracing::warn!(subject = %m.message.subject, error = %e, "skipping a manifest that does not parse");
                    None
                }
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }
}
