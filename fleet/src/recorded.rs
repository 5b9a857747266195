//! A worker's token source in a fleet: the host services' tokens and credential lookups, and the manifests the
//! fleet recorded (`fleet_manifests`: what `tools.list` and `fleet plugins describe` show) as what a plugin's
//! sessions may use. The worker narrows every real user's runtime manifest to its record
//! (`fleet_worker::session`'s `pin.rs`).

use fleet_services::FleetServices;
use fleet_store::Store;
use fleet_worker::services::{
    CredentialFuture, Recorded, RecordedFuture, TokenFuture, TokenRequest, TokenSource,
};

/// [`FleetServices`] with the fleet's manifest records.
#[derive(Debug, Clone)]
pub struct RecordedTokens {
    services: FleetServices,
    store: Store,
}

impl RecordedTokens {
    /// The services' tokens, `store`'s manifests.
    pub fn new(services: FleetServices, store: Store) -> RecordedTokens {
        RecordedTokens { services, store }
    }
}

impl TokenSource for RecordedTokens {
    fn tokens(&self, request: TokenRequest) -> TokenFuture {
        self.services.tokens(request)
    }

    fn credentials(&self, user: &str, tool_id: &str, names: &[String], deadline_ms: u64) -> CredentialFuture {
        self.services.credentials(user, tool_id, names, deadline_ms)
    }

    fn delegate(&self, invoke_id: &str, delegation: fleet_proto::api::delegation::DelegationToken) {
        self.services.delegate(invoke_id, delegation);
    }

    fn recorded_manifest(&self, tool_id: &str) -> RecordedFuture {
        let (store, tool_id) = (self.store.clone(), tool_id.to_owned());
        Box::pin(async move {
            match store.manifest(&tool_id).await {
                Ok(Some(manifest)) => Recorded::Manifest(Box::new(manifest)),
                // None recorded yet, or the store did not answer: nothing of the user's is given.
                Ok(None) | Err(_) => Recorded::Missing,
            }
        })
    }
}
