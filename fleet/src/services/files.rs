//! APS files (`files/*`, spec §8.4) on the JetStream object store, and the signed download links the fleet's
//! HTTP listener serves. (Being written: see the issue-5 helper's module.)

use fleet_proto::jsonrpc::ErrorObject;
use serde_json::Value;

use super::kv::StorageConfig;
use super::{CallContext, ServicesError};
use crate::store::StoreSettings;

/// Signs and verifies download links (HMAC-SHA256 with a secret shared by every fleet process).
#[derive(Debug, Clone)]
pub struct LinkSigner {
    _secret: Vec<u8>,
}

impl LinkSigner {
    /// A signer with `secret`.
    pub fn new(secret: &[u8]) -> LinkSigner {
        LinkSigner {
            _secret: secret.to_vec(),
        }
    }
}

/// The files service.
#[derive(Debug, Clone)]
pub struct FilesService {}

impl FilesService {
    /// Opens its object store.
    pub async fn open(
        _js: &async_nats::jetstream::Context,
        _settings: &StoreSettings,
        _config: &StorageConfig,
        _links: LinkSigner,
        _public_url: Option<String>,
    ) -> Result<FilesService, ServicesError> {
        Ok(FilesService {})
    }

    /// Serves one call.
    pub async fn call(&self, _ctx: &CallContext, method: &str, _params: Value) -> Result<Value, ErrorObject> {
        Err(fleet_proto::executa::reverse::method_not_found(method))
    }
}
