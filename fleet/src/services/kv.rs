//! APS KV (`storage/*`, spec §8.3) on JetStream KV. (Being written: see the issue-5 helper's module.)

use fleet_proto::jsonrpc::ErrorObject;
use serde_json::Value;

use super::{CallContext, ServicesError};
use crate::store::StoreSettings;

/// Storage settings (`[services.storage]`).
#[derive(Debug, Clone, Default, serde::Deserialize)]
pub struct StorageConfig {
    /// Per-user byte quota (KV values and files together).
    #[serde(default)]
    pub quota_bytes: Option<u64>,
}

/// The KV service.
#[derive(Debug)]
pub struct KvService {}

impl KvService {
    /// Opens its bucket.
    pub async fn open(
        _js: &async_nats::jetstream::Context,
        _settings: &StoreSettings,
        _config: &StorageConfig,
    ) -> Result<KvService, ServicesError> {
        Ok(KvService {})
    }

    /// Serves one call.
    pub async fn call(&self, _ctx: &CallContext, method: &str, _params: Value) -> Result<Value, ErrorObject> {
        Err(fleet_proto::executa::reverse::method_not_found(method))
    }
}
