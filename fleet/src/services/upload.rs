//! `host/uploadFile` (spec §8.7): inline and negotiate/confirm, stored in the object store. (Being written: see
//! the issue-5 helper's module.)

use fleet_proto::jsonrpc::ErrorObject;
use serde_json::Value;

use super::CallContext;
use super::files::FilesService;

/// The purposes a plugin may upload for (spec §8.7).
pub const PURPOSES: [&str; 3] = ["image_input", "image_reference", "user_artifact"];

/// The upload service.
#[derive(Debug)]
pub struct UploadService {
    _files: FilesService,
}

impl UploadService {
    /// Over the files service's object store.
    pub fn new(files: FilesService) -> UploadService {
        UploadService { _files: files }
    }

    /// Serves one call.
    pub async fn call(&self, _ctx: &CallContext, method: &str, _params: Value) -> Result<Value, ErrorObject> {
        Err(fleet_proto::executa::reverse::method_not_found(method))
    }
}
