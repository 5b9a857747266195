//! Capability names: the manifest's `host_capabilities` allow-list and the `initialize` capability keys
//! (spec §3.3 HR-LC-15, HR-LC-16).

/// Every `host_capabilities` string the platform accepts (spec §3.3 HR-LC-16). Anything else is ignored (never
/// granted) and reported by the manifest validator.
pub const KNOWN_HOST_CAPABILITIES: &[&str] = &[
    LLM_SAMPLE,
    "llm.complete",
    LLM_EMBED,
    "llm.agent.auto",
    "llm.agent.fixed",
    LLM_IMAGE,
    LLM_IMAGE_EDIT,
    WEB_SEARCH,
    WEB_FETCH,
    WEB_IMAGE_SEARCH,
    WEB_IMAGE_FETCH,
    HOST_UPLOAD,
    APS_KV,
    APS_FILES,
    "aps.scope.user.read",
    "aps.scope.user.write",
    "aps.scope.app.read",
    "aps.scope.app.write",
    "aps.scope.tool.read",
    "aps.scope.tool.write",
    "aps.scope.admin",
];

/// `llm.sample`: `sampling/createMessage`.
pub const LLM_SAMPLE: &str = "llm.sample";
/// `llm.embed`: `embeddings/create`.
pub const LLM_EMBED: &str = "llm.embed";
/// `llm.image`: `image/generate`.
pub const LLM_IMAGE: &str = "llm.image";
/// `llm.image.edit`: `image/edit`.
pub const LLM_IMAGE_EDIT: &str = "llm.image.edit";
/// `host.upload`: `host/uploadFile`.
pub const HOST_UPLOAD: &str = "host.upload";
/// `aps.kv`: `storage/*`.
pub const APS_KV: &str = "aps.kv";
/// `aps.files`: `files/*`.
pub const APS_FILES: &str = "aps.files";
/// `web.search`: `web/search` (spec §8.9; the grant's `allowSearch`).
pub const WEB_SEARCH: &str = "web.search";
/// `web.fetch`: `web/fetch` (the grant's `allowFetch`).
pub const WEB_FETCH: &str = "web.fetch";
/// `web.image_search`: `web/image_search` (the grant's `allowImageSearch`).
pub const WEB_IMAGE_SEARCH: &str = "web.image_search";
/// `web.image_fetch`: `web/image_fetch` (the grant's `allowImageFetch`).
pub const WEB_IMAGE_FETCH: &str = "web.image_fetch";

/// Whether `s` is on the platform allow-list.
pub fn is_known_host_capability(s: &str) -> bool {
    KNOWN_HOST_CAPABILITIES.contains(&s)
}

/// `initialize` capability keys a plugin may claim (spec §3.3: union of `capabilities` and
/// `client_capabilities`).
pub mod keys {
    /// Sampling (also unlocks embeddings).
    pub const SAMPLING: &str = "sampling";
    /// APS storage (KV and files).
    pub const STORAGE: &str = "storage";
    /// Host upload.
    pub const UPLOAD: &str = "upload";
    /// Image generation.
    pub const IMAGE: &str = "image";
    /// Image editing.
    pub const IMAGE_EDIT: &str = "image.edit";
    /// Embeddings.
    pub const EMBED: &str = "embed";
    /// Agent sessions.
    pub const AGENT: &str = "agent";
    /// Web search and fetch: offered by the host (host → plugin) with the methods it serves; the spec names no
    /// key a plugin must claim (§3.3 HR-LC-15: "(v2)"), so any v2 session may call `web/*`.
    pub const WEB: &str = "web";
    /// `credentials/*` (spec §8.8): offered by the host (host → plugin) with its configured providers; the spec
    /// names no key a plugin must claim (the `credentials_token` follows from the manifest's `credentials[]`).
    pub const CREDENTIALS: &str = "credentials";
    /// File transport support (host → plugin advertisement).
    pub const FILE_TRANSPORT: &str = "fileTransport";

    /// Other spellings the SDKs send for a key, and the key each stands for (spec §3.3: accept every key the SDKs
    /// send). The SDK's embeddings demo claims `embeddings`, the documentation `embed`.
    pub const ALIASES: &[(&str, &str)] = &[("embeddings", EMBED)];

    /// The key `key` stands for: itself, or the key an alias names.
    pub fn canonical(key: &str) -> &str {
        ALIASES
            .iter()
            .find(|(alias, _)| *alias == key)
            .map_or(key, |(_, canonical)| canonical)
    }
}
