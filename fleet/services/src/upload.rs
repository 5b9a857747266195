//! `host/uploadFile` (spec §8.7): `inline` (base64 in the call) and `negotiate` → PUT → `confirm`, stored in the
//! `<prefix>_uploads` object store under the returned `r2_key`, answered with the canonical envelope.
//!
//! * `r2_key` = `exec-uploads/<env>/<user_key>/<tool>/<invoke>/<purpose>/<unix ms>_<nonce>_<file name>`
//!   (`<env>` is the store prefix; a tool or invoke id with characters outside `[A-Za-z0-9._-]` is replaced by
//!   a hash). `confirm` accepts only keys of the calling user, plugin and invoke (`-32203` otherwise) and
//!   answers `-32212` when no bytes were PUT under the key.
//! * Checks, in order: mode (`-32203`), file name and MIME present (`-32203`), MIME syntax ([`MediaType::parse`];
//!   stored and served without its parameters) and denylist (`-32205`), purpose in the spec's list and the
//!   token's `allowed_purposes` (`-32206`), then the size: inline over 8 MiB after base64 decoding or over the
//!   token's `max_file_bytes` (`-32204`), malformed base64 (`-32203`), the per-invoke file count (`-32211`) and
//!   byte total (`-32202` `UPLOAD_MAX_BYTES_EXCEEDED`).
//! * The files counter counts `inline` and `confirm` (`negotiate` is free); a re-`confirm` of the same key
//!   returns a fresh envelope at no cost (the object carries a `confirmed` mark). A `negotiate`'s bytes count
//!   against the per-invoke total until its `confirm`, and at most as many links as files wait unconfirmed
//!   (`-32211`): bytes PUT and never confirmed are bounded like confirmed ones. A `negotiate` also holds its bytes
//!   in the user's storage quota until its `confirm` (`-32202`, `errorCode` `STORAGE_QUOTA_EXCEEDED`, past the
//!   quota); an expired hold's unconfirmed object is removed (see `files`).
//! * The negotiate `put_url` is a signed PUT on the fleet's HTTP listener, 300 s, `Content-Type` must be
//!   `mime_type` (the answer's `headers`), the body is capped at the negotiated size. Download links last 1800 s.

use std::collections::HashMap;

use async_nats::jetstream::object_store;
use base64::Engine as _;
use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD};
use fleet_proto::executa::reverse::{method_not_found, methods, upload as codes};
use fleet_proto::jsonrpc::ErrorObject;
use fleet_proto::limits;
use serde_json::{Map, Value, json};

use super::CallContext;
use super::budget::Exhausted;
use super::files::{Bucket, FilesService, META_CONFIRMED, META_CONTENT_TYPE, hold_id, nonce};
use super::kv::IndexError;
use super::media_type::MediaType;
use fleet_proto::api::user_key;
use fleet_proto::util::now_ms;
use fleet_store::rfc3339_ms;

/// The purposes a plugin may upload for (spec §8.7).
pub const PURPOSES: [&str; 3] = ["image_input", "image_reference", "user_artifact"];

/// The default purpose.
pub const DEFAULT_PURPOSE: &str = "user_artifact";

/// MIME types refused whatever the grant (spec §8.7: executables and `image/svg+xml`).
pub const MIME_DENYLIST: [&str; 9] = [
    "image/svg+xml",
    "application/x-msdownload",
    "application/x-msdos-program",
    "application/x-executable",
    "application/x-sharedlib",
    "application/x-dosexec",
    "application/x-mach-binary",
    "application/x-elf",
    "application/vnd.microsoft.portable-executable",
];

/// The object description that marks a confirmed upload.
pub const CONFIRMED_DESCRIPTION: &str = "confirmed";

/// Whether an upload object was stored inline or confirmed already.
pub fn is_confirmed(info: &object_store::ObjectInfo) -> bool {
    info.metadata.get(META_CONFIRMED).is_some_and(|c| c == "1")
        || info.description.as_deref() == Some(CONFIRMED_DESCRIPTION)
}

/// The `r2_key` prefix.
pub const KEY_ROOT: &str = "exec-uploads";

/// Longest file name kept in a key.
const MAX_NAME_CHARS: usize = 100;

/// The upload service.
#[derive(Debug)]
pub struct UploadService {
    files: FilesService,
    env: String,
    /// Confirms of one key run one at a time (an invoke's reverse calls all reach the process that minted its
    /// tokens), so two racing confirms cannot both count the file.
    confirms: [tokio::sync::Mutex<()>; CONFIRM_SHARDS],
}

/// Lock shards for confirms.
const CONFIRM_SHARDS: usize = 16;

pub(crate) fn safe_segment(s: &str) -> String {
    let ok = !s.is_empty()
        && s.len() <= 128
        && s != "."
        && s != ".."
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        s.to_owned()
    } else {
        format!("h{}", user_key(s))
    }
}

fn safe_name(name: &str) -> String {
    let mut out: String = name
        .rsplit(['/', '\\'])
        .next()
        .unwrap_or_default()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .take(MAX_NAME_CHARS)
        .collect();
    while out.ends_with('.') {
        out.pop();
        out.push('_');
    }
    if out.trim_matches(['_', '.']).is_empty() {
        out = "file".to_owned();
    }
    out
}

pub(crate) fn exhausted(e: Exhausted) -> ErrorObject {
    match e {
        Exhausted::UploadFiles(_) | Exhausted::UploadOffers(_) => {
            codes::MAX_FILES_EXCEEDED.error(e.to_string())
        }
        Exhausted::UploadFileTooLarge { bytes, cap } => codes::TOO_LARGE.error_with(
            e.to_string(),
            Map::from_iter([
                ("size_bytes".to_owned(), json!(bytes)),
                ("max_file_bytes".to_owned(), json!(cap)),
            ]),
        ),
        Exhausted::UploadTotalBytes { bytes, used, cap } => quota_exceeded(
            e.to_string(),
            "UPLOAD_MAX_BYTES_EXCEEDED",
            [
                ("size_bytes", json!(bytes)),
                ("used_bytes", json!(used)),
                ("max_total_bytes", json!(cap)),
            ],
        ),
        other => codes::STORAGE_ERROR.error(other.to_string()),
    }
}

/// A refused quota hold of a `negotiate`: `-32202` with the user's storage quota (`errorCode`
/// `STORAGE_QUOTA_EXCEEDED`) or their pending uploads' cap (`PENDING_UPLOADS_EXCEEDED`), `-32207` when the quota
/// could not be read.
fn held(e: &IndexError) -> ErrorObject {
    match *e {
        IndexError::PendingUploads { pending, max } => quota_exceeded(
            e.to_string(),
            "PENDING_UPLOADS_EXCEEDED",
            [
                ("pending_uploads", json!(pending)),
                ("max_pending_uploads", json!(max)),
            ],
        ),
        IndexError::Quota {
            used,
            reserved,
            cap,
            wanted,
        } => quota_exceeded(
            e.to_string(),
            "STORAGE_QUOTA_EXCEEDED",
            [
                ("size_bytes", json!(wanted)),
                ("used_bytes", json!(used)),
                ("reserved_bytes", json!(reserved)),
                ("quota_bytes", json!(cap)),
            ],
        ),
        _ => codes::STORAGE_ERROR.error(e.to_string()),
    }
}

/// `-32202` with `data`, its `errorCode` and `error_name: QUOTA_EXCEEDED`.
fn quota_exceeded<const N: usize>(
    message: String,
    error_code: &str,
    data: [(&str, Value); N],
) -> ErrorObject {
    let mut data: Map<String, Value> = data.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
    data.insert("errorCode".to_owned(), json!(error_code));
    data.insert("error_name".to_owned(), json!("QUOTA_EXCEEDED"));
    codes::QUOTA_EXCEEDED.error_with(message, data)
}

fn storage_error(e: impl std::fmt::Display) -> ErrorObject {
    codes::STORAGE_ERROR.error(format!("object store: {e}"))
}

/// The checked common fields of `inline` and `negotiate`.
pub(crate) struct Described {
    pub(crate) filename: String,
    /// Validated, without parameters: what is stored and served.
    pub(crate) mime: MediaType,
    pub(crate) purpose: String,
}

/// The checked `filename`, `mime_type` and `purpose` of `inline` and `negotiate` (`-32203`, `-32205`, `-32206`).
pub(crate) fn describe(ctx: &CallContext, p: &Map<String, Value>) -> Result<Described, ErrorObject> {
    let field = |name: &str| match p.get(name) {
        Some(Value::String(s)) if !s.trim().is_empty() => Ok(s.as_str()),
        _ => Err(codes::INVALID_REQUEST.error(format!("missing or empty '{name}'"))),
    };
    let filename = field("filename")?.trim().to_owned();
    let mime = MediaType::parse(field("mime_type")?)
        .map_err(|e| codes::MIME_REJECTED.error(format!("mime_type: {e}")))?
        .without_parameters();
    if MIME_DENYLIST.contains(&mime.essence()) {
        return Err(codes::MIME_REJECTED.error(format!("MIME type {mime} is not accepted for uploads")));
    }
    let purpose = match p.get("purpose") {
        None | Some(Value::Null) => DEFAULT_PURPOSE.to_owned(),
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(codes::PURPOSE_REJECTED.error("'purpose' must be a string")),
    };
    if !PURPOSES.contains(&purpose.as_str()) {
        return Err(codes::PURPOSE_REJECTED.error(format!(
            "purpose {purpose:?} is not one of {}",
            PURPOSES.join(", ")
        )));
    }
    if let Some(allowed) = &ctx.claims.allowed_purposes
        && !allowed.contains(&purpose)
    {
        return Err(codes::PURPOSE_REJECTED.error(format!(
            "purpose {purpose:?} is not allowed by the user's grant (allowed: {})",
            allowed.join(", ")
        )));
    }
    Ok(Described {
        filename,
        mime,
        purpose,
    })
}

/// The largest file the invoke may upload: its budget's cap, lowered by the token's.
pub(crate) fn max_file_bytes(ctx: &CallContext) -> u64 {
    let budget = ctx.budget.limits().upload_file_bytes;
    ctx.claims.max_file_bytes.map_or(budget, |m| m.min(budget))
}

/// The checks of an `inline` upload before anything is reserved or stored: the described fields, then the
/// decoded bytes within the inline and per-file caps.
pub(crate) fn check_inline(
    ctx: &CallContext,
    p: &Map<String, Value>,
) -> Result<(Described, Vec<u8>), ErrorObject> {
    let d = describe(ctx, p)?;
    let b64 = match p.get("content_b64") {
        Some(Value::String(s)) => s.as_str(),
        _ => return Err(codes::INVALID_REQUEST.error("missing 'content_b64'")),
    };
    let b64: String = b64.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    let inline_max = limits::UPLOAD_INLINE_MAX_BYTES as u64;
    // Refuse before decoding what cannot fit (4 characters carry 3 bytes).
    let at_least = (b64.len() as u64 / 4) * 3;
    let too_large = |bytes: u64| {
        codes::TOO_LARGE.error_with(
            format!("{bytes} decoded bytes exceed the {inline_max}-byte inline limit; use mode=negotiate"),
            Map::from_iter([
                ("size_bytes".to_owned(), json!(bytes)),
                ("max_inline_bytes".to_owned(), json!(inline_max)),
            ]),
        )
    };
    if at_least.saturating_sub(2) > inline_max {
        return Err(too_large(at_least.saturating_sub(2)));
    }
    let bytes = STANDARD
        .decode(&b64)
        .or_else(|_| STANDARD_NO_PAD.decode(&b64))
        .map_err(|e| codes::INVALID_REQUEST.error(format!("malformed content_b64: {e}")))?;
    let size = bytes.len() as u64;
    if size > inline_max {
        return Err(too_large(size));
    }
    let max_file = max_file_bytes(ctx);
    if size > max_file {
        return Err(exhausted(Exhausted::UploadFileTooLarge {
            bytes: size,
            cap: max_file,
        }));
    }
    Ok((d, bytes))
}

/// The checks of a `negotiate`: the described fields and the announced size within the per-file cap.
pub(crate) fn check_negotiate(
    ctx: &CallContext,
    p: &Map<String, Value>,
) -> Result<(Described, u64), ErrorObject> {
    let d = describe(ctx, p)?;
    let size = match p.get("expected_bytes").or_else(|| p.get("size_bytes")) {
        Some(v) => match v.as_u64() {
            Some(n) if n > 0 => n,
            _ => {
                return Err(
                    codes::INVALID_REQUEST.error("'expected_bytes' / 'size_bytes' must be an integer > 0")
                );
            }
        },
        None => return Err(codes::INVALID_REQUEST.error("missing 'expected_bytes' (or 'size_bytes')")),
    };
    let max_file = max_file_bytes(ctx);
    if size > max_file {
        return Err(exhausted(Exhausted::UploadFileTooLarge {
            bytes: size,
            cap: max_file,
        }));
    }
    Ok((d, size))
}

/// The `mode` of an upload call (`inline` when absent but `content_b64` is given).
pub(crate) fn mode_of(p: &Map<String, Value>) -> Result<&str, ErrorObject> {
    match p.get("mode") {
        None | Some(Value::Null) if p.contains_key("content_b64") => Ok("inline"),
        Some(Value::String(m)) => Ok(m.as_str()),
        _ => Err(codes::INVALID_REQUEST.error("'mode' must be one of inline, negotiate, confirm")),
    }
}

impl UploadService {
    /// Over the files service's object stores.
    pub fn new(files: FilesService) -> UploadService {
        UploadService {
            files,
            env: "fleet".to_owned(),
            confirms: std::array::from_fn(|_| tokio::sync::Mutex::new(())),
        }
    }

    /// The `<env>` segment of keys (the store prefix).
    pub fn with_env(mut self, env: &str) -> UploadService {
        self.env = safe_segment(env);
        self
    }

    /// The key prefix of one invoke's uploads.
    fn invoke_prefix(&self, ctx: &CallContext) -> String {
        format!(
            "{KEY_ROOT}/{}/{}/{}/{}/",
            self.env,
            user_key(&ctx.user),
            safe_segment(&ctx.tool_id),
            safe_segment(&ctx.invoke_id)
        )
    }

    /// Serves one call.
    pub async fn call(&self, ctx: &CallContext, method: &str, params: Value) -> Result<Value, ErrorObject> {
        if method != methods::HOST_UPLOAD_FILE {
            return Err(method_not_found(method));
        }
        let p = match params {
            Value::Object(m) => m,
            _ => return Err(codes::INVALID_REQUEST.error("params must be an object")),
        };
        let mode = mode_of(&p)?;
        let timeout = ctx.subcall_timeout(limits::UPLOAD_REQUEST_TIMEOUT);
        let work = async {
            match mode {
                "inline" => Box::pin(self.inline(ctx, &p)).await,
                "negotiate" => Box::pin(self.negotiate(ctx, &p)).await,
                "confirm" => Box::pin(self.confirm(ctx, &p)).await,
                other => Err(codes::INVALID_REQUEST.error(format!(
                    "unknown mode {other:?}; one of inline, negotiate, confirm"
                ))),
            }
        };
        match tokio::time::timeout(timeout, work).await {
            Ok(r) => r,
            Err(_) => Err(codes::STORAGE_ERROR.error_with(
                format!("the upload did not finish within {timeout:?}"),
                Map::from_iter([
                    ("errorName".to_owned(), json!("subcall_timeout")),
                    ("subcall".to_owned(), json!("upload")),
                ]),
            )),
        }
    }

    fn new_key(&self, ctx: &CallContext, d: &Described) -> String {
        format!(
            "{}{}/{}_{}_{}",
            self.invoke_prefix(ctx),
            d.purpose,
            now_ms(),
            &nonce()[..12],
            safe_name(&d.filename)
        )
    }

    fn envelope(&self, key: &str, mime: &MediaType, size: u64, mode: &str) -> Value {
        let filename = key.rsplit('/').next().unwrap_or(key);
        let filename = filename.splitn(3, '_').nth(2).unwrap_or(filename);
        let (url, exp) = self.link(key, filename, mime);
        result_envelope(
            key,
            &url,
            mime.as_str(),
            size,
            exp * 1000,
            &json!({ "mode": mode }),
        )
    }

    async fn inline(&self, ctx: &CallContext, p: &Map<String, Value>) -> Result<Value, ErrorObject> {
        let (d, bytes) = check_inline(ctx, p)?;
        let size = bytes.len() as u64;
        let reservation = ctx.budget.reserve_upload(size).map_err(exhausted)?;
        let key = self.store(ctx, &d, &bytes).await?;
        reservation.commit();
        Ok(self.envelope(&key, &d.mime, size, "inline"))
    }

    /// Stores `bytes` as a confirmed upload of this invoke (24 h, like `inline`): its key. The caller has
    /// checked and counted it.
    pub(crate) async fn store(
        &self,
        ctx: &CallContext,
        d: &Described,
        bytes: &[u8],
    ) -> Result<String, ErrorObject> {
        let key = self.new_key(ctx, d);
        let meta = object_store::ObjectMetadata {
            name: key.clone(),
            metadata: HashMap::from([
                (META_CONTENT_TYPE.to_owned(), d.mime.as_str().to_owned()),
                (META_CONFIRMED.to_owned(), "1".to_owned()),
            ]),
            ..Default::default()
        };
        let mut reader: &[u8] = bytes;
        self.files
            .objects()
            .store(Bucket::Uploads)
            .put(meta, &mut reader)
            .await
            .map_err(storage_error)?;
        Ok(key)
    }

    /// A signed download link of a stored upload, valid 30 min: (url, expiry in Unix seconds).
    pub(crate) fn link(&self, key: &str, filename: &str, mime: &MediaType) -> (String, u64) {
        self.files
            .objects()
            .get_link(Bucket::Uploads, key, filename, mime, limits::UPLOAD_GET_URL_TTL)
    }

    async fn negotiate(&self, ctx: &CallContext, p: &Map<String, Value>) -> Result<Value, ErrorObject> {
        let (d, size) = check_negotiate(ctx, p)?;
        let key = self.new_key(ctx, &d);
        // The link's bytes are held in the user's storage quota until the confirm (or the hold's expiry).
        let hold = hold_id(Bucket::Uploads, &key);
        let link_exp_ms = now_ms() + limits::UPLOAD_PUT_URL_TTL.as_secs() * 1000;
        self.files
            .hold(&ctx.user, &hold, size, link_exp_ms)
            .await
            .map_err(|e| held(&e))?;
        if let Err(e) = ctx.budget.offer_upload(&key, size) {
            self.files.unhold(&ctx.user, &hold).await;
            return Err(exhausted(e));
        }
        let (url, exp) =
            self.files
                .objects()
                .put_link(Bucket::Uploads, &key, &d.mime, size, limits::UPLOAD_PUT_URL_TTL);
        Ok(json!({
            "r2_key": key,
            "put_url": url,
            "headers": { "Content-Type": d.mime.as_str() },
            "expires_in": limits::UPLOAD_PUT_URL_TTL.as_secs(),
            "expires_at": rfc3339_ms(exp * 1000),
            "_meta": { "mode": "presigned-put" },
        }))
    }

    async fn confirm(&self, ctx: &CallContext, p: &Map<String, Value>) -> Result<Value, ErrorObject> {
        let key = match p.get("r2_key") {
            Some(Value::String(s)) if !s.is_empty() => s.as_str(),
            _ => return Err(codes::INVALID_REQUEST.error("missing 'r2_key'")),
        };
        let prefix = self.invoke_prefix(ctx);
        let purpose_ok = key
            .strip_prefix(&prefix)
            .and_then(|rest| rest.split_once('/'))
            .is_some_and(|(purpose, name)| {
                PURPOSES.contains(&purpose) && !name.is_empty() && !name.contains('/')
            });
        if !purpose_ok {
            return Err(codes::INVALID_REQUEST.error("r2_key does not belong to this invoke"));
        }
        let shard = key
            .bytes()
            .fold(0_usize, |h, b| h.wrapping_mul(31).wrapping_add(usize::from(b)));
        let _serial = self.confirms[shard % CONFIRM_SHARDS].lock().await;
        let store = self.files.objects().store(Bucket::Uploads);
        let info = match store.info(key).await {
            // Deleted: removed with its expired hold.
            Ok(i) if !i.deleted => i,
            Ok(_) => {
                return Err(codes::NOT_FOUND.error(format!(
                    "no upload under r2_key {key:?} any more (its link expired unconfirmed)"
                )));
            }
            Err(e) if e.kind() == object_store::InfoErrorKind::NotFound => {
                return Err(codes::NOT_FOUND.error(format!(
                    "no upload landed under r2_key {key:?} (PUT the bytes to put_url first)"
                )));
            }
            Err(e) => return Err(storage_error(e)),
        };
        let size = info.size as u64;
        let mime = MediaType::parse_or_octet_stream(info.metadata.get(META_CONTENT_TYPE).map(String::as_str));
        if is_confirmed(&info) {
            return Ok(self.envelope(key, &mime, size, "confirm"));
        }
        let reservation = ctx
            .budget
            .reserve_confirmed_upload(key, size)
            .map_err(exhausted)?;
        // async-nats 0.51's `update_metadata` keeps the object's metadata map as it was and writes only the
        // name and the description: the confirmation mark is the description.
        store
            .update_metadata(
                key,
                object_store::UpdateMetadata {
                    name: key.to_owned(),
                    description: Some(CONFIRMED_DESCRIPTION.to_owned()),
                    metadata: info.metadata.clone(),
                    headers: info.headers.clone(),
                },
            )
            .await
            .map_err(storage_error)?;
        reservation.commit();
        self.files.unhold(&ctx.user, &hold_id(Bucket::Uploads, key)).await;
        Ok(self.envelope(key, &mime, size, "confirm"))
    }
}

/// The upload result envelope with both field sets (spec §8.7 HR-UP-02), for a link expiring at `expires_at_ms`
/// (Unix ms); `meta` becomes `_meta`. Real and mocked uploads answer with it.
pub(crate) fn result_envelope(
    key: &str,
    url: &str,
    mime: &str,
    size: u64,
    expires_at_ms: u64,
    meta: &Value,
) -> Value {
    json!({
        "r2_key": key,
        "download_url": url,
        "url": url,
        "mime_type": mime,
        "size_bytes": size,
        "bytes": size,
        "expires_at": rfc3339_ms(expires_at_ms),
        "expires_in": limits::UPLOAD_GET_URL_TTL.as_secs(),
        "_meta": meta,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_segments_are_object_store_safe() {
        assert_eq!(safe_name("../etc/pass wd.txt"), "pass_wd.txt");
        assert_eq!(safe_name("a."), "a_");
        assert_eq!(safe_name("///"), "file");
        assert_eq!(safe_segment("echo-rs"), "echo-rs");
        assert!(safe_segment("a/b").starts_with('h'));
    }
}
