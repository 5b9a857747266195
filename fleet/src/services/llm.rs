//! Sampling (`sampling/createMessage`, spec §8.1) and embeddings (`embeddings/create`, §8.5) against an
//! OpenAI-compatible HTTP upstream. (Being written: see the issue-5 helper's module.)

use fleet_proto::jsonrpc::ErrorObject;
use serde_json::Value;

use super::{CallContext, ServicesError};

/// The upstream (`[services.llm]`).
#[derive(Debug, Clone, Default, serde::Deserialize)]
pub struct LlmConfig {
    /// Base URL, e.g. `https://api.openai.com/v1`.
    pub base_url: String,
}

/// The sampling and embeddings service.
#[derive(Debug)]
pub struct LlmService {
    _config: LlmConfig,
}

impl LlmService {
    /// Builds the HTTP client.
    pub fn new(config: &LlmConfig) -> Result<LlmService, ServicesError> {
        Ok(LlmService {
            _config: config.clone(),
        })
    }

    /// Whether `embeddings/create` is served (an embedding model is configured).
    pub fn embeddings_enabled(&self) -> bool {
        false
    }

    /// Serves one call.
    pub async fn call(&self, _ctx: &CallContext, method: &str, _params: Value) -> Result<Value, ErrorObject> {
        Err(fleet_proto::executa::reverse::method_not_found(method))
    }
}
