//! Reverse RPC (plugin → host): method names, the families they belong to, and every family's error codes
//! (spec §7–§9). Every host-generated error carries `data.errorCode` with the symbolic name (spec §9 HR-ER-01).

use serde_json::Value;

use super::capabilities::{self, keys};
use crate::jsonrpc::{ErrorObject, codes as std_codes};

/// A numeric code with its symbolic name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RpcCode {
    /// The JSON-RPC `error.code`.
    pub code: i64,
    /// The `error.data.errorCode`.
    pub name: &'static str,
}

impl RpcCode {
    /// The error object `{code, message, data: {errorCode}}`.
    pub fn error(&self, message: impl Into<String>) -> ErrorObject {
        ErrorObject::with_error_code(self.code, self.name, message)
    }

    /// The error object with more `data` members (e.g. `{requested, modelName}` for -32010).
    pub fn error_with(
        &self,
        message: impl Into<String>,
        data: serde_json::Map<String, Value>,
    ) -> ErrorObject {
        let mut e = self.error(message);
        if let Some(Value::Object(m)) = e.data.as_mut() {
            m.extend(data);
        }
        e
    }
}

macro_rules! rpc_codes {
    ($(#[$m:meta])* $vis:vis mod $module:ident { $($(#[$doc:meta])* $name:ident = $code:expr;)* }) => {
        $(#[$m])*
        $vis mod $module {
            use super::RpcCode;
            $(
                $(#[$doc])*
                pub const $name: RpcCode = RpcCode { code: $code, name: stringify!($name) };
            )*
            /// Every code of this family.
            pub const ALL: &[RpcCode] = &[$($name),*];
        }
    };
}

rpc_codes! {
    /// Invoke-context correlation failures, code -32602 (spec §7.2).
    pub mod correlation {
        /// `context.invoke_id` names no active invoke of this process.
        UNKNOWN_INVOKE_CONTEXT = -32602;
        /// No `context.invoke_id` while several invokes are active: the host never guesses.
        MISSING_INVOKE_CONTEXT = -32602;
    }
}

rpc_codes! {
    /// `sampling/createMessage`, -32001…-32010 (spec §8.1).
    pub mod sampling {
        /// The user has not enabled sampling for this plugin.
        SAMPLING_NOT_GRANTED = -32001;
        /// The user's account quota is exhausted.
        SAMPLING_QUOTA_EXCEEDED = -32002;
        /// The upstream LLM provider failed.
        SAMPLING_PROVIDER_ERROR = -32003;
        /// Malformed params.
        SAMPLING_INVALID_REQUEST = -32004;
        /// The completion did not finish in time.
        SAMPLING_TIMEOUT = -32005;
        /// Per-invoke call cap reached (terminal).
        SAMPLING_MAX_CALLS_EXCEEDED = -32006;
        /// Per-invoke token cap reached (terminal).
        SAMPLING_MAX_TOKENS_EXCEEDED = -32007;
        /// v2 not negotiated or manifest lacks `llm.sample`.
        SAMPLING_NOT_NEGOTIATED = -32008;
        /// The user rejected this request.
        SAMPLING_USER_DENIED = -32009;
        /// The model cannot honour `responseFormat`; `data: {requested, modelName}`.
        SAMPLING_UNSUPPORTED_RESPONSE_FORMAT = -32010;
    }
}

rpc_codes! {
    /// App session lifecycle, -32011/-32017/-32018 (spec §9).
    pub mod app_session {
        /// The app session was revoked.
        APP_SESSION_REVOKED = -32011;
        /// The app session expired.
        APP_SESSION_EXPIRED = -32017;
        /// The app session token expired.
        APP_SESSION_TOKEN_EXPIRED = -32018;
    }
}

rpc_codes! {
    /// APS storage and files, -32021…-32029 (spec §8.3–§8.4).
    pub mod storage {
        /// Missing token or capability, or scope not allowed.
        STORAGE_NOT_GRANTED = -32021;
        /// Key or path does not exist.
        NOT_FOUND = -32022;
        /// `if_match` etag mismatch.
        PRECONDITION_FAILED = -32023;
        /// Plan storage quota exhausted (terminal).
        QUOTA_EXCEEDED = -32024;
        /// Value or object too large.
        VALUE_TOO_LARGE = -32025;
        /// Per-invoke RPC budget exhausted or throttled (terminal within the invoke).
        RATE_LIMITED = -32026;
        /// Reserved or out-of-bucket path.
        INVALID_PATH = -32027;
        /// Missing field or wrong type.
        INVALID_REQUEST = -32028;
        /// Upstream failure.
        UPSTREAM_ERROR = -32029;
    }
}

rpc_codes! {
    /// Agent sessions, -32041…-32048, in the runtime/SDK numbering (spec §8.2, §16 A-17).
    pub mod agent {
        /// No grant (or fixed client not allowed).
        AGENT_NOT_GRANTED = -32041;
        /// Session uuid unknown to the host cache.
        AGENT_SESSION_NOT_FOUND = -32042;
        /// Malformed payload.
        AGENT_INVALID_REQUEST = -32043;
        /// Submode mismatch.
        AGENT_SUBMODE_MISMATCH = -32044;
        /// Quota or the 4 096-frame cap.
        AGENT_QUOTA_EXCEEDED = -32045;
        /// Nexus or LLM failure.
        AGENT_PROVIDER_ERROR = -32046;
        /// Rate limited.
        AGENT_RATE_LIMITED = -32047;
        /// Tool not granted.
        AGENT_TOOL_NOT_GRANTED = -32048;
    }
}

rpc_codes! {
    /// `credentials/*`, -32061…-32063 (spec §8.8).
    pub mod credentials {
        /// Token missing, provider not covered, unknown account, or re-auth needed.
        CREDENTIALS_NOT_GRANTED = -32061;
        /// Malformed request.
        CREDENTIALS_INVALID_REQUEST = -32062;
        /// Upstream failure.
        CREDENTIALS_UPSTREAM = -32063;
    }
}

rpc_codes! {
    /// `image/*`, -32101…-32110 and -32311…-32314 (spec §8.6, §16 A-34).
    pub mod image {
        /// Not granted.
        IMAGE_NOT_GRANTED = -32101;
        /// Daily quota exhausted.
        IMAGE_QUOTA_EXCEEDED = -32102;
        /// Provider failure; `data.subcall == "image"`, `data.timeout_s` on timeouts.
        IMAGE_PROVIDER_ERROR = -32103;
        /// Bad request.
        IMAGE_INVALID_REQUEST = -32104;
        /// Host wall clock exceeded.
        IMAGE_TIMEOUT = -32105;
        /// `n` over a cap; `data.hostCap` or `data.images`/`data.maxImages`.
        IMAGE_MAX_IMAGES_EXCEEDED = -32106;
        /// Not negotiated / manifest lacks `llm.image`.
        IMAGE_NOT_NEGOTIATED = -32107;
        /// The user declined.
        IMAGE_USER_DENIED = -32108;
        /// No provider configured.
        IMAGE_NO_MODEL_AVAILABLE = -32109;
        /// Persisting the image failed.
        IMAGE_STORAGE_ERROR = -32110;
        /// Provider lacks `image/edit`.
        EDIT_NOT_SUPPORTED = -32311;
        /// Provider lacks masks.
        MASK_UNSUPPORTED = -32312;
        /// Provider lacks `n > 1` for edits.
        N_UNSUPPORTED = -32313;
        /// A reference image could not be fetched.
        REFERENCE_FETCH_FAILED = -32314;
    }
}

rpc_codes! {
    /// `host/uploadFile`, -32201…-32213, wire numbering (spec §8.7, §16 A-30).
    pub mod upload {
        /// Capability, manifest declaration or grant missing.
        UPLOAD_NOT_GRANTED = -32201;
        /// Plan quota exhausted; also the per-invoke byte cap (spec §16 A-32).
        QUOTA_EXCEEDED = -32202;
        /// Bad mode, missing fields, malformed base64, foreign key.
        INVALID_REQUEST = -32203;
        /// Over the file or inline cap (terminal).
        TOO_LARGE = -32204;
        /// MIME rejected.
        MIME_REJECTED = -32205;
        /// Purpose rejected.
        PURPOSE_REJECTED = -32206;
        /// Storage failure; wraps subcall timeouts (`errorName: "subcall_timeout"`).
        STORAGE_ERROR = -32207;
        /// Provider call exceeded the host wall clock.
        TIMEOUT = -32208;
        /// The user declined.
        USER_DENIED = -32209;
        /// v2 not negotiated or called outside any invoke.
        UPLOAD_NOT_NEGOTIATED = -32210;
        /// Per-invoke file count reached (terminal).
        MAX_FILES_EXCEEDED = -32211;
        /// `confirm` on an unknown key.
        NOT_FOUND = -32212;
        /// Presigning failed.
        PRESIGN_FAILED = -32213;
    }
}

rpc_codes! {
    /// `embeddings/create`, -32501…-32508 (spec §8.5).
    pub mod embeddings {
        /// Manifest lacks `llm.embed`.
        EMBED_NOT_GRANTED = -32501;
        /// Quota exhausted.
        EMBED_QUOTA_EXCEEDED = -32502;
        /// Provider failure (also upstream timeout).
        EMBED_PROVIDER_ERROR = -32503;
        /// Bad request (too many inputs, too long, claim mismatch).
        EMBED_INVALID_REQUEST = -32504;
        /// Timed out.
        EMBED_TIMEOUT = -32505;
        /// Token cap (SDK only).
        EMBED_MAX_TOKENS_EXCEEDED = -32506;
        /// Not negotiated.
        EMBED_NOT_NEGOTIATED = -32507;
        /// The user opted out.
        EMBED_USER_DENIED = -32508;
    }
}

rpc_codes! {
    /// `web/*`, -32521…-32528 (spec §8.9).
    pub mod web {
        /// Not granted.
        WEB_NOT_GRANTED = -32521;
        /// CU pool exhausted.
        WEB_QUOTA_EXCEEDED = -32522;
        /// Provider failure.
        WEB_PROVIDER_ERROR = -32523;
        /// Bad request.
        WEB_INVALID_REQUEST = -32524;
        /// Timed out.
        WEB_TIMEOUT = -32525;
        /// Not negotiated.
        WEB_NOT_NEGOTIATED = -32526;
        /// The user declined.
        WEB_USER_DENIED = -32527;
        /// Token expired.
        WEB_TOKEN_EXPIRED = -32528;
    }
}

/// The error for a reverse-RPC method the host does not serve (spec §2 HR-TX-12).
pub fn method_not_found(method: &str) -> ErrorObject {
    ErrorObject::new(std_codes::METHOD_NOT_FOUND, format!("Method not found: {method}"))
}

/// A family of reverse-RPC methods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    /// `sampling/createMessage`.
    Sampling,
    /// `agent/*`.
    Agent,
    /// `storage/*`.
    Storage,
    /// `files/*`.
    Files,
    /// `embeddings/create`.
    Embeddings,
    /// `image/*`.
    Image,
    /// `host/uploadFile`.
    Upload,
    /// `credentials/*`.
    Credentials,
    /// `web/*`.
    Web,
}

impl Family {
    /// The stable name (metrics label).
    pub fn as_str(self) -> &'static str {
        match self {
            Family::Sampling => "sampling",
            Family::Agent => "agent",
            Family::Storage => "storage",
            Family::Files => "files",
            Family::Embeddings => "embeddings",
            Family::Image => "image",
            Family::Upload => "upload",
            Family::Credentials => "credentials",
            Family::Web => "web",
        }
    }

    /// The `initialize` capability keys any of which negotiates this family (spec §3.3 HR-LC-15).
    pub fn negotiation_keys(self) -> &'static [&'static str] {
        match self {
            Family::Sampling => &[keys::SAMPLING],
            // Agent sessions ride on the sampling token (spec §8.2); `agent` is their own key.
            Family::Agent => &[keys::AGENT, keys::SAMPLING],
            Family::Storage | Family::Files => &[keys::STORAGE],
            Family::Embeddings => &[keys::EMBED, keys::SAMPLING],
            Family::Image => &[keys::IMAGE, keys::IMAGE_EDIT],
            Family::Upload => &[keys::UPLOAD],
            Family::Credentials | Family::Web => &[],
        }
    }

    /// The manifest `host_capabilities` string that declares this family, if any.
    pub fn manifest_capability(self) -> Option<&'static str> {
        match self {
            Family::Sampling | Family::Agent => Some(capabilities::LLM_SAMPLE),
            Family::Storage => Some(capabilities::APS_KV),
            Family::Files => Some(capabilities::APS_FILES),
            Family::Embeddings => Some(capabilities::LLM_EMBED),
            Family::Image => Some(capabilities::LLM_IMAGE),
            Family::Upload => Some(capabilities::HOST_UPLOAD),
            // Each `web/*` method has its own capability: see [`Family::method_capability`].
            Family::Credentials | Family::Web => None,
        }
    }

    /// The manifest `host_capabilities` string a call of `method` (a method of this family) needs: the
    /// family's, except `web/*`, where each method has its own (`web/fetch` needs `web.fetch`, …; an unknown
    /// `web/…` method needs `web.search`, so it is refused at the gate rather than served).
    pub fn method_capability(self, method: &str) -> Option<&'static str> {
        match self {
            Family::Web => Some(match method {
                methods::WEB_FETCH => capabilities::WEB_FETCH,
                methods::WEB_IMAGE_SEARCH => capabilities::WEB_IMAGE_SEARCH,
                methods::WEB_IMAGE_FETCH => capabilities::WEB_IMAGE_FETCH,
                _ => capabilities::WEB_SEARCH,
            }),
            other => other.manifest_capability(),
        }
    }

    /// The family's "not negotiated" error code (spec §3.3, §8).
    pub fn not_negotiated(self) -> RpcCode {
        match self {
            Family::Sampling => sampling::SAMPLING_NOT_NEGOTIATED,
            Family::Agent => agent::AGENT_NOT_GRANTED,
            Family::Storage | Family::Files => storage::STORAGE_NOT_GRANTED,
            Family::Embeddings => embeddings::EMBED_NOT_NEGOTIATED,
            Family::Image => image::IMAGE_NOT_NEGOTIATED,
            Family::Upload => upload::UPLOAD_NOT_NEGOTIATED,
            Family::Credentials => credentials::CREDENTIALS_NOT_GRANTED,
            Family::Web => web::WEB_NOT_NEGOTIATED,
        }
    }

    /// The family's "not granted" error code (spec §3.3, §8).
    pub fn not_granted(self) -> RpcCode {
        match self {
            Family::Sampling => sampling::SAMPLING_NOT_GRANTED,
            Family::Agent => agent::AGENT_NOT_GRANTED,
            Family::Storage | Family::Files => storage::STORAGE_NOT_GRANTED,
            Family::Embeddings => embeddings::EMBED_NOT_GRANTED,
            Family::Image => image::IMAGE_NOT_GRANTED,
            Family::Upload => upload::UPLOAD_NOT_GRANTED,
            Family::Credentials => credentials::CREDENTIALS_NOT_GRANTED,
            Family::Web => web::WEB_NOT_GRANTED,
        }
    }
}

/// Reverse-RPC method names (spec §7.1).
pub mod methods {
    /// LLM completion.
    pub const SAMPLING_CREATE_MESSAGE: &str = "sampling/createMessage";
    /// One-shot agent completion.
    pub const AGENT_COMPLETE: &str = "agent/complete";
    /// KV get.
    pub const STORAGE_GET: &str = "storage/get";
    /// KV set.
    pub const STORAGE_SET: &str = "storage/set";
    /// KV delete.
    pub const STORAGE_DELETE: &str = "storage/delete";
    /// KV list.
    pub const STORAGE_LIST: &str = "storage/list";
    /// Begin a file upload.
    pub const FILES_UPLOAD_BEGIN: &str = "files/upload_begin";
    /// Complete a file upload.
    pub const FILES_UPLOAD_COMPLETE: &str = "files/upload_complete";
    /// Download URL for a file.
    pub const FILES_DOWNLOAD_URL: &str = "files/download_url";
    /// List files.
    pub const FILES_LIST: &str = "files/list";
    /// Delete a file.
    pub const FILES_DELETE: &str = "files/delete";
    /// Embeddings.
    pub const EMBEDDINGS_CREATE: &str = "embeddings/create";
    /// Image generation.
    pub const IMAGE_GENERATE: &str = "image/generate";
    /// Image edit.
    pub const IMAGE_EDIT: &str = "image/edit";
    /// Host upload.
    pub const HOST_UPLOAD_FILE: &str = "host/uploadFile";
    /// OAuth accounts.
    pub const CREDENTIALS_LIST_ACCOUNTS: &str = "credentials/listAccounts";
    /// OAuth token.
    pub const CREDENTIALS_GET_TOKEN: &str = "credentials/getToken";
    /// Web search.
    pub const WEB_SEARCH: &str = "web/search";
    /// Web fetch.
    pub const WEB_FETCH: &str = "web/fetch";
    /// Image search.
    pub const WEB_IMAGE_SEARCH: &str = "web/image_search";
    /// Image fetch.
    pub const WEB_IMAGE_FETCH: &str = "web/image_fetch";
}

/// The family a reverse-RPC method belongs to; `None` for methods the protocol does not define (answered with
/// -32601, spec §2 HR-TX-12).
pub fn family_of(method: &str) -> Option<Family> {
    let (prefix, _) = method.split_once('/')?;
    Some(match prefix {
        "sampling" if method == methods::SAMPLING_CREATE_MESSAGE => Family::Sampling,
        "agent" => Family::Agent,
        "storage" => Family::Storage,
        "files" => Family::Files,
        "embeddings" if method == methods::EMBEDDINGS_CREATE => Family::Embeddings,
        "image" if method == methods::IMAGE_GENERATE || method == methods::IMAGE_EDIT => Family::Image,
        "host" if method == methods::HOST_UPLOAD_FILE => Family::Upload,
        "credentials" => Family::Credentials,
        "web" => Family::Web,
        _ => return None,
    })
}
