//! APS files (`files/*`, spec §8.4) on the JetStream object store, and the signed links the fleet's HTTP
//! listener serves (`fleet::http::files`).
//!
//! Resources (configured in `fleet_store::settings`, all with the store's `replicas` and `storage`):
//!
//! | Resource | Kind | What |
//! |---|---|---|
//! | `<prefix>_aps_files` | KV ([`Index`]) | `f.<user_key>.<scope>.<sha256(path)>` → `{path, object, size, content_type, etag, updated_at_ms}` |
//! | `<prefix>_aps_pending` | KV, `max_age` 1 h | `<user_key>.<scope>.<sha256(path)>` → the begun upload of a path |
//! | `<prefix>_aps_objects` | object store | the bytes of committed files, `<user_key>/<scope>/<hash>/<nonce>` |
//! | `<prefix>_aps_staging` | object store, `max_age` 1 h | bytes PUT after `upload_begin`, until `upload_complete` (abandoned ones expire) |
//! | `<prefix>_uploads` | object store, `max_age` 24 h | `host/uploadFile` objects, named by their `r2_key` |
//!
//! Flow: `upload_begin` checks the path, the content type (one media type, [`MediaType::parse`]: `-32028` for a
//! list, quotes, anything but token parameters; stored, signed, answered and served normalised) and the size
//! (≤ 256 MiB, `-32025`), **holds** the whole size in the user's quota (`-32024` at the first byte over, stored
//! bytes and every live hold counted: a replaced file's bytes stay stored until the complete), records the pending
//! upload and returns a signed PUT link (600 s) into staging; the PUT streams the body into the object store
//! (capped at the declared size, the same media type); `upload_complete` claims the pending
//! record (a compare-and-set purge: of two racing completes of one begin, the second finds nothing pending,
//! `-32022`), reserves the quota for the bytes that landed (its own hold not counted), copies them from staging
//! into `<prefix>_aps_objects`, swaps the index entry with a compare-and-set, removes what it replaced and gives
//! the hold back; a failure before the swap puts the pending record back (the hold stays), so the complete can be
//! retried.
//!
//! Holds ([`Quota::hold`]) live in the user's `<prefix>_aps_usage` value next to the stored bytes, changed by
//! compare-and-set, so every front and worker counts the same. A hold carries its expiry: its link's, plus
//! [`HOLD_GRACE`] for a PUT still streaming. It is given back by the complete, by `files/delete` of the pending
//! path, by `host/uploadFile` `confirm` (a `negotiate` holds its bytes the same way); an expired hold no longer
//! counts, and the user's next hold removes what its link stored and nobody completed. `download_url` signs a GET link
//! (1..3600 s, default 300). Every call runs to its end on a task of its own (`kv::timed`): the subcall timeout
//! abandons the wait, never a reservation.
//!
//! Links: `GET|PUT /v1/files/{bucket}/{base64url(object)}?exp=<unix s>&…&sig=<hex>`, where `sig` is
//! HMAC-SHA256, keyed with the secret every fleet process shares ([`LinkSigner`]), over the method, the bucket,
//! the object, the expiry and (GET) the disposition ([`MediaType::disposition`] of the stored type) and file name
//! or (PUT) the content type and the byte cap. Links are on `files_public_url` when one is configured (user
//! content on an origin of its own), else on `public_url`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, object_store};
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use fleet_proto::executa::reverse::{method_not_found, methods, storage as codes};
use fleet_proto::jsonrpc::ErrorObject;
use fleet_proto::limits;
use rand::RngCore as _;
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

use super::kv::{
    HOLD_GRACE, Head, Hold, Index, IndexError, Page, Quota, Scope, heads_headers, object, paging,
    required_str, scope, timed,
};
use super::media_type::{Disposition, MediaType};
use super::{CallContext, ServicesError};
use fleet_proto::util::now_ms;
use fleet_store::cas::Races;
use fleet_store::{StoreSettings, rfc3339_ms};

/// Object metadata: the content type.
pub const META_CONTENT_TYPE: &str = "content-type";
/// Object metadata: set once a host upload was confirmed.
pub const META_CONFIRMED: &str = "confirmed";

// ------------------------------------------------------------------------------------------------------------
// Link signing
// ------------------------------------------------------------------------------------------------------------

/// HMAC-SHA256 (RFC 2104) over SHA-256.
fn hmac_sha256(key: &[u8], message: &[u8]) -> [u8; 32] {
    let mut k = [0_u8; 64];
    if key.len() > 64 {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let mut ipad = [0x36_u8; 64];
    let mut opad = [0x5c_u8; 64];
    for i in 0..64 {
        ipad[i] ^= k[i];
        opad[i] ^= k[i];
    }
    let inner = Sha256::new().chain_update(ipad).chain_update(message).finalize();
    Sha256::new()
        .chain_update(opad)
        .chain_update(inner)
        .finalize()
        .into()
}

/// Signs and verifies links (HMAC-SHA256 with a secret shared by every fleet process).
#[derive(Clone)]
pub struct LinkSigner {
    secret: Arc<[u8]>,
}

impl std::fmt::Debug for LinkSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkSigner").finish_non_exhaustive()
    }
}

impl LinkSigner {
    /// A signer with `secret`.
    pub fn new(secret: &[u8]) -> LinkSigner {
        LinkSigner {
            secret: Arc::from(secret),
        }
    }

    /// The hex signature of `parts` (joined by LF).
    pub fn sign(&self, parts: &[&str]) -> String {
        hex::encode(hmac_sha256(&self.secret, parts.join("\n").as_bytes()))
    }

    /// Whether `sig` is the signature of `parts` (constant time).
    pub fn verify(&self, parts: &[&str], sig: &str) -> bool {
        let Ok(given) = hex::decode(sig) else {
            return false;
        };
        let want = hmac_sha256(&self.secret, parts.join("\n").as_bytes());
        given.len() == want.len()
            && given
                .iter()
                .zip(want.iter())
                .fold(0_u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }
}

/// The object store a link points into (its path segment).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bucket {
    /// Committed APS files (`f`).
    Files,
    /// Staged APS uploads (`s`).
    Staging,
    /// Host uploads (`u`).
    Uploads,
}

impl Bucket {
    /// The path segment.
    pub fn as_str(self) -> &'static str {
        match self {
            Bucket::Files => "f",
            Bucket::Staging => "s",
            Bucket::Uploads => "u",
        }
    }

    /// From the path segment.
    pub fn parse(s: &str) -> Option<Bucket> {
        match s {
            "f" => Some(Bucket::Files),
            "s" => Some(Bucket::Staging),
            "u" => Some(Bucket::Uploads),
            _ => None,
        }
    }
}

/// Why a link was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkError {
    /// Not a link this fleet signed (or altered).
    #[error("the link's signature does not verify")]
    BadSignature,
    /// Past its expiry.
    #[error("the link expired at {0} (Unix seconds)")]
    Expired(u64),
    /// Not a link at all.
    #[error("malformed link: {0}")]
    Malformed(&'static str),
}

/// A verified GET link.
#[derive(Debug, Clone)]
pub struct GetLink {
    /// The bucket.
    pub bucket: Bucket,
    /// The object name.
    pub object: String,
    /// The disposition the link was signed with (the served type's at signing).
    pub disposition: Disposition,
    /// The file name for `Content-Disposition`.
    pub filename: String,
}

/// A verified PUT link.
#[derive(Debug, Clone)]
pub struct PutLink {
    /// The bucket.
    pub bucket: Bucket,
    /// The object name.
    pub object: String,
    /// The `Content-Type` the PUT must send.
    pub content_type: String,
    /// The most bytes the PUT may send.
    pub max_bytes: u64,
}

fn unb64(s: &str) -> Option<String> {
    String::from_utf8(URL_SAFE_NO_PAD.decode(s).ok()?).ok()
}

fn b64(s: &str) -> String {
    URL_SAFE_NO_PAD.encode(s.as_bytes())
}

/// The object stores of host files and uploads, and the link signer: what the services and the HTTP routes
/// share. Cheap to clone.
#[derive(Debug, Clone)]
pub struct HostObjects {
    inner: Arc<ObjectsInner>,
}

struct ObjectsInner {
    files: object_store::ObjectStore,
    staging: object_store::ObjectStore,
    uploads: object_store::ObjectStore,
    signer: LinkSigner,
    link_base: Option<String>,
}

impl std::fmt::Debug for ObjectsInner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostObjects")
            .field("link_base", &self.link_base)
            .finish_non_exhaustive()
    }
}

/// Creates (when missing) the object store of `config` (one of [`StoreSettings`]' configs), or attaches to it.
async fn open_objects(
    js: &jetstream::Context,
    settings: &StoreSettings,
    config: object_store::Config,
) -> Result<object_store::ObjectStore, ServicesError> {
    fleet_store::provision::object_store(js, config, settings.provision)
        .await
        .map_err(|e| ServicesError::Store(e.to_string()))
}

impl HostObjects {
    /// Opens (creating if needed) `<prefix>_aps_objects`, `<prefix>_aps_staging` and `<prefix>_uploads`.
    /// `link_base` makes links absolute (`https://files.example.com` + `/v1/files/…`): the services'
    /// [`ServicesConfig::files_link_base`](crate::ServicesConfig::files_link_base).
    pub async fn open(
        js: &jetstream::Context,
        settings: &StoreSettings,
        signer: LinkSigner,
        link_base: Option<String>,
    ) -> Result<HostObjects, ServicesError> {
        let files = open_objects(js, settings, settings.aps_objects_config()).await?;
        let staging = open_objects(js, settings, settings.aps_staging_config()).await?;
        let uploads = open_objects(js, settings, settings.uploads_config()).await?;
        Ok(HostObjects {
            inner: Arc::new(ObjectsInner {
                files,
                staging,
                uploads,
                signer,
                link_base: link_base.map(|u| u.trim_end_matches('/').to_owned()),
            }),
        })
    }

    /// The object store behind a bucket.
    pub fn store(&self, bucket: Bucket) -> &object_store::ObjectStore {
        match bucket {
            Bucket::Files => &self.inner.files,
            Bucket::Staging => &self.inner.staging,
            Bucket::Uploads => &self.inner.uploads,
        }
    }

    fn base(&self) -> &str {
        self.inner.link_base.as_deref().unwrap_or("")
    }

    /// A signed GET link valid for `ttl`, with the disposition of `media` (the object's stored type); returns the
    /// URL and its expiry (Unix seconds).
    pub fn get_link(
        &self,
        bucket: Bucket,
        object: &str,
        filename: &str,
        media: &MediaType,
        ttl: Duration,
    ) -> (String, u64) {
        let exp = now_ms() / 1000 + ttl.as_secs();
        let (b, o, d, f) = (
            bucket.as_str(),
            b64(object),
            media.disposition().as_str(),
            b64(filename),
        );
        let e = exp.to_string();
        let sig = self.inner.signer.sign(&["GET", b, &o, &e, d, &f]);
        (
            format!("{}/v1/files/{b}/{o}?exp={e}&d={d}&fn={f}&sig={sig}", self.base()),
            exp,
        )
    }

    /// A signed PUT link valid for `ttl`, whose body must be sent as `media`; returns the URL and its expiry (Unix
    /// seconds).
    pub fn put_link(
        &self,
        bucket: Bucket,
        object: &str,
        media: &MediaType,
        max_bytes: u64,
        ttl: Duration,
    ) -> (String, u64) {
        let exp = now_ms() / 1000 + ttl.as_secs();
        let (b, o, ct, n) = (
            bucket.as_str(),
            b64(object),
            b64(media.as_str()),
            max_bytes.to_string(),
        );
        let e = exp.to_string();
        let sig = self.inner.signer.sign(&["PUT", b, &o, &e, &ct, &n]);
        (
            format!("{}/v1/files/{b}/{o}?exp={e}&ct={ct}&n={n}&sig={sig}", self.base()),
            exp,
        )
    }

    fn check(&self, parts: &[&str], sig: &str, exp: u64) -> Result<(), LinkError> {
        if !self.inner.signer.verify(parts, sig) {
            return Err(LinkError::BadSignature);
        }
        if now_ms() / 1000 >= exp {
            return Err(LinkError::Expired(exp));
        }
        Ok(())
    }

    /// Verifies a GET link's parts (the signature first, then the expiry).
    pub fn verify_get(
        &self,
        bucket: &str,
        object: &str,
        exp: u64,
        disposition: &str,
        filename: &str,
        sig: &str,
    ) -> Result<GetLink, LinkError> {
        let e = exp.to_string();
        self.check(&["GET", bucket, object, &e, disposition, filename], sig, exp)?;
        let disposition = match disposition {
            "inline" => Disposition::Inline,
            "attachment" => Disposition::Attachment,
            _ => return Err(LinkError::Malformed("d")),
        };
        Ok(GetLink {
            bucket: Bucket::parse(bucket).ok_or(LinkError::Malformed("bucket"))?,
            object: unb64(object).ok_or(LinkError::Malformed("object"))?,
            disposition,
            filename: unb64(filename).ok_or(LinkError::Malformed("fn"))?,
        })
    }

    /// Verifies a PUT link's parts.
    pub fn verify_put(
        &self,
        bucket: &str,
        object: &str,
        exp: u64,
        content_type: &str,
        max_bytes: u64,
        sig: &str,
    ) -> Result<PutLink, LinkError> {
        let (e, n) = (exp.to_string(), max_bytes.to_string());
        self.check(&["PUT", bucket, object, &e, content_type, &n], sig, exp)?;
        Ok(PutLink {
            bucket: Bucket::parse(bucket).ok_or(LinkError::Malformed("bucket"))?,
            object: unb64(object).ok_or(LinkError::Malformed("object"))?,
            content_type: unb64(content_type).ok_or(LinkError::Malformed("ct"))?,
            max_bytes,
        })
    }
}

/// The id of the quota hold of an upload into `bucket` under `object`: `<bucket>/<object>`.
pub(crate) fn hold_id(bucket: Bucket, object: &str) -> String {
    format!("{}/{object}", bucket.as_str())
}

/// A random 32-hex nonce.
pub(crate) fn nonce() -> String {
    let mut b = [0_u8; 16];
    rand::rng().fill_bytes(&mut b);
    hex::encode(b)
}

/// The hex etag of an object store digest (`SHA-256=<base64url>`).
pub(crate) fn etag_of_digest(digest: Option<&str>) -> String {
    let raw = digest
        .and_then(|d| d.strip_prefix("SHA-256="))
        .and_then(|d| URL_SAFE_NO_PAD.decode(d.trim_end_matches('=')).ok())
        .unwrap_or_default();
    let mut h = hex::encode(raw);
    h.truncate(32);
    h
}

// ------------------------------------------------------------------------------------------------------------
// files/*
// ------------------------------------------------------------------------------------------------------------

/// `validate_path` (spec §8.4 HR-FI-02) → `-32027`.
pub fn validate_path(path: &str) -> Result<(), ErrorObject> {
    let n = path.chars().count();
    if n == 0 || n > limits::FILES_PATH_MAX_CHARS {
        return Err(codes::INVALID_PATH.error(format!(
            "path must be 1–{} characters, got {n}",
            limits::FILES_PATH_MAX_CHARS
        )));
    }
    if path.starts_with('/') {
        return Err(codes::INVALID_PATH.error("path must be relative (no leading '/')"));
    }
    if path.split('/').any(|s| s.is_empty() || s == "." || s == "..") {
        return Err(codes::INVALID_PATH.error("path must not contain empty, '.' or '..' segments"));
    }
    let forbidden = |c: char| {
        c.is_control()
            || c == '\\'
            || matches!(c, '\u{200B}'..='\u{200F}' | '\u{2060}' | '\u{FEFF}' | '\u{061C}')
            || matches!(c, '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}')
    };
    if path.chars().any(forbidden) {
        return Err(codes::INVALID_PATH.error(
            "path must not contain control, backslash, zero-width or bidirectional-override characters",
        ));
    }
    Ok(())
}

/// `files/upload_begin`'s `content_type`, validated and normalised by [`MediaType::parse`] → `-32028` (the message
/// says what is wrong, never repeating the text).
pub fn content_type(raw: &str) -> Result<MediaType, ErrorObject> {
    MediaType::parse(raw).map_err(|e| codes::INVALID_REQUEST.error(format!("content_type: {e}")))
}

/// A committed file.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct FileRecord {
    path: String,
    object: String,
    size: u64,
    content_type: String,
    etag: String,
    updated_at_ms: u64,
}

/// A begun upload.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct PendingRecord {
    path: String,
    object: String,
    content_type: String,
    size: u64,
    expires_at_ms: u64,
}

impl PendingRecord {
    /// Its `<prefix>_aps_pending` entry: the heads headers (for listings) and the body.
    fn entry(&self) -> Result<(async_nats::HeaderMap, Vec<u8>), ErrorObject> {
        let body = serde_json::to_vec(self).map_err(|e| codes::UPSTREAM_ERROR.error(e.to_string()))?;
        let headers = heads_headers(&Head {
            name: self.path.clone(),
            revision: 0,
            size: self.size,
            etag: String::new(),
            updated_ms: now_ms(),
            expires_ms: Some(self.expires_at_ms),
            content_type: Some(self.content_type.clone()),
        });
        Ok((headers, body))
    }
}

/// How a claimed upload failed to be stored.
enum Failed {
    /// Nothing was stored: the upload is pending again and `files/upload_complete` may be retried.
    Retry(ErrorObject),
    /// Another write of the path completed first: the upload is dropped.
    Superseded(ErrorObject),
}

/// The files methods.
#[derive(Debug, Clone, Copy)]
enum Method {
    Begin,
    Complete,
    DownloadUrl,
    List,
    Delete,
}

/// The files service. Cheap to clone (each call runs on a task of its own, see [`timed`]).
#[derive(Debug, Clone)]
pub struct FilesService {
    objects: HostObjects,
    index: Index,
    pending: Index,
    quota: Quota,
}

impl FilesService {
    /// Opens its buckets and object stores.
    pub(crate) async fn open(
        js: &jetstream::Context,
        settings: &StoreSettings,
        quota: Quota,
        links: LinkSigner,
        link_base: Option<String>,
    ) -> Result<FilesService, ServicesError> {
        let objects = HostObjects::open(js, settings, links, link_base).await?;
        let max = 16 * 1024;
        let index = Index::open(js, settings, settings.aps_files_kv_config(max)).await?;
        let pending = Index::open(js, settings, settings.aps_pending_kv_config(max)).await?;
        Ok(FilesService {
            objects,
            index,
            pending,
            quota,
        })
    }

    /// The object stores and signer (for the HTTP routes and uploads).
    pub fn objects(&self) -> &HostObjects {
        &self.objects
    }

    /// Serves one call.
    pub async fn call(&self, ctx: &CallContext, method: &str, params: Value) -> Result<Value, ErrorObject> {
        let p = object(params)?;
        let scope = scope(ctx, &p)?;
        let method = match method {
            methods::FILES_UPLOAD_BEGIN => Method::Begin,
            methods::FILES_UPLOAD_COMPLETE => Method::Complete,
            methods::FILES_DOWNLOAD_URL => Method::DownloadUrl,
            methods::FILES_LIST => Method::List,
            methods::FILES_DELETE => Method::Delete,
            _ => return Err(method_not_found(method)),
        };
        let (this, call) = (self.clone(), ctx.clone());
        timed(ctx, async move {
            match method {
                Method::Begin => Box::pin(this.begin(&call, &scope, &p)).await,
                Method::Complete => Box::pin(this.complete(&call, &scope, &p)).await,
                Method::DownloadUrl => Box::pin(this.download_url(&scope, &p)).await,
                Method::List => Box::pin(this.list(&scope, &p)).await,
                Method::Delete => Box::pin(this.delete(&call, &scope, &p)).await,
            }
        })
        .await
    }

    fn key(scope: &Scope, path: &str) -> String {
        format!("f.{}.{}", scope.space, super::kv::name_hash(path))
    }

    fn pending_key(scope: &Scope, path: &str) -> String {
        format!("{}.{}", scope.space, super::kv::name_hash(path))
    }

    fn object_name(scope: &Scope, path: &str) -> String {
        format!(
            "{}/{}/{}",
            scope.space.replace('.', "/"),
            &super::kv::name_hash(path)[..32],
            nonce()
        )
    }

    async fn record(&self, scope: &Scope, path: &str) -> Result<(u64, Option<FileRecord>), ErrorObject> {
        let slot = self
            .index
            .read(&Self::key(scope, path))
            .await
            .map_err(|e| e.to_rpc())?;
        let rec = match slot.envelope {
            Some(v) => Some(
                serde_json::from_value(v)
                    .map_err(|_| IndexError::Corrupt(Self::key(scope, path)).to_rpc())?,
            ),
            None => None,
        };
        Ok((slot.revision, rec))
    }

    async fn pending_record(&self, scope: &Scope, path: &str) -> Result<Option<PendingRecord>, ErrorObject> {
        Ok(self.pending_slot(scope, path).await?.1)
    }

    /// The pending upload of `path` and the revision to claim it at.
    async fn pending_slot(
        &self,
        scope: &Scope,
        path: &str,
    ) -> Result<(u64, Option<PendingRecord>), ErrorObject> {
        let slot = self
            .pending
            .read(&Self::pending_key(scope, path))
            .await
            .map_err(|e| e.to_rpc())?;
        let rec = slot
            .envelope
            .and_then(|v| serde_json::from_value::<PendingRecord>(v).ok())
            .filter(|p| p.expires_at_ms > now_ms());
        Ok((slot.revision, rec))
    }

    /// Puts back a pending upload that a failed `files/upload_complete` had claimed, unless a new
    /// `files/upload_begin` of the path came since (best effort: the staged bytes expire anyway).
    async fn unclaim(&self, scope: &Scope, pending: &PendingRecord) {
        let key = Self::pending_key(scope, pending.path.as_str());
        let Ok(slot) = self.pending.read(&key).await else {
            return;
        };
        if slot.envelope.is_some() {
            return;
        }
        let Ok((headers, body)) = pending.entry() else {
            return;
        };
        if let Err(e) = self.pending.write(&key, Some(slot.revision), headers, body).await {
            tracing::warn!(error = %e, "a failed files/upload_complete could not put its pending upload back");
        }
    }

    /// Holds `bytes` of the user's quota for the upload `id` whose link expires at `link_exp_ms` (and
    /// [`HOLD_GRACE`] after), or refuses past the quota. Removes what the user's expired holds left behind.
    pub(crate) async fn hold(
        &self,
        user: &str,
        id: &str,
        bytes: u64,
        link_exp_ms: u64,
    ) -> Result<(), IndexError> {
        let grace = u64::try_from(HOLD_GRACE.as_millis()).unwrap_or(u64::MAX);
        let hold = Hold {
            id: id.to_owned(),
            bytes,
            exp: link_exp_ms.saturating_add(grace),
        };
        let expired = self.quota.hold(user, hold).await?;
        for h in expired {
            self.drop_uncompleted(&h.id).await;
        }
        Ok(())
    }

    /// Gives the hold `id` back (its upload was completed, confirmed or deleted).
    pub(crate) async fn unhold(&self, user: &str, id: &str) {
        self.quota.unhold(user, id).await;
    }

    /// Removes the bytes an expired hold's link stored, if they were never completed: a staged object, or a
    /// `host/uploadFile` object never confirmed (best effort: staging and uploads expire on their own).
    async fn drop_uncompleted(&self, id: &str) {
        let Some((bucket, object)) = id.split_once('/') else {
            return;
        };
        match Bucket::parse(bucket) {
            Some(Bucket::Staging) => {
                let _ = self.objects.store(Bucket::Staging).delete(object).await;
            }
            Some(Bucket::Uploads) => {
                let store = self.objects.store(Bucket::Uploads);
                if let Ok(info) = store.info(object).await
                    && !info.deleted
                    && !super::upload::is_confirmed(&info)
                {
                    let _ = store.delete(object).await;
                }
            }
            Some(Bucket::Files) | None => {}
        }
    }

    async fn begin(
        &self,
        ctx: &CallContext,
        scope: &Scope,
        p: &Map<String, Value>,
    ) -> Result<Value, ErrorObject> {
        let path = required_str(p, "path")?;
        validate_path(path)?;
        let media = content_type(required_str(p, "content_type")?)?;
        let size = super::kv::opt_u64(p, "size_bytes")?
            .ok_or_else(|| codes::INVALID_REQUEST.error("missing required field 'size_bytes'"))?;
        if size > limits::FILES_OBJECT_MAX_BYTES {
            return Err(codes::VALUE_TOO_LARGE.error(format!(
                "size_bytes {size} exceeds the {}-byte object limit",
                limits::FILES_OBJECT_MAX_BYTES
            )));
        }
        let object = Self::object_name(scope, path);
        let upload_id = object.rsplit('/').next().unwrap_or_default().to_owned();
        let expires_at_ms = now_ms() + limits::FILES_UPLOAD_TTL.as_secs() * 1000;
        // The whole size is held, a replaced file's bytes included: until the complete, both are stored.
        let hold = hold_id(Bucket::Staging, &object);
        self.hold(&ctx.user, &hold, size, expires_at_ms)
            .await
            .map_err(|e| e.to_rpc())?;
        let rec = PendingRecord {
            path: path.to_owned(),
            object: object.clone(),
            content_type: media.as_str().to_owned(),
            size,
            expires_at_ms,
        };
        let written = match rec.entry() {
            Ok((headers, body)) => self
                .pending
                .write(&Self::pending_key(scope, path), None, headers, body)
                .await
                .map_err(|e| e.to_rpc()),
            Err(e) => Err(e),
        };
        if let Err(e) = written {
            self.quota.unhold(&ctx.user, &hold).await;
            return Err(e);
        }
        let (url, exp) =
            self.objects
                .put_link(Bucket::Staging, &object, &media, size, limits::FILES_UPLOAD_TTL);
        let expires_at = rfc3339_ms(exp * 1000);
        Ok(json!({
            "upload_id": upload_id,
            "put_url": url,
            "presigned_url": url,
            "method": "PUT",
            "headers": { "Content-Type": media.as_str() },
            "fields": {},
            "expires_at": expires_at,
            "expires_in": limits::FILES_UPLOAD_TTL.as_secs(),
            "path": path,
            "scope": scope.name,
        }))
    }

    async fn complete(
        &self,
        ctx: &CallContext,
        scope: &Scope,
        p: &Map<String, Value>,
    ) -> Result<Value, ErrorObject> {
        let path = required_str(p, "path")?;
        validate_path(path)?;
        let (pending_rev, Some(mut pending)) = self.pending_slot(scope, path).await? else {
            return Err(codes::NOT_FOUND.error(format!(
                "no pending upload for {path:?} in scope '{}' (call files/upload_begin first)",
                scope.name
            )));
        };
        // Begun by a version that validated less: stored only as a valid, normalised type.
        pending.content_type = content_type(&pending.content_type)?.as_str().to_owned();
        // One complete per begin: the call that removes the pending record at the revision it read owns the
        // upload; a racing one finds nothing pending. A failure below puts the record back.
        match self
            .pending
            .purge(&Self::pending_key(scope, path), pending_rev)
            .await
        {
            Ok(()) => {}
            Err(IndexError::Conflict) => {
                return Err(codes::NOT_FOUND.error(format!(
                    "no pending upload for {path:?} in scope '{}' (another files/upload_complete took it)",
                    scope.name
                )));
            }
            Err(e) => return Err(e.to_rpc()),
        }
        let staging = self.objects.store(Bucket::Staging);
        let found = match staging.info(&pending.object).await {
            // Deleted (a delete marker): as if never PUT.
            Ok(i) if i.deleted => Err(object_store::InfoError::new(
                object_store::InfoErrorKind::NotFound,
            )),
            found => found,
        };
        let info = match found {
            Ok(i) => i,
            Err(e) if e.kind() == object_store::InfoErrorKind::NotFound => {
                self.unclaim(scope, &pending).await;
                return Err(codes::UPSTREAM_ERROR.error_with(
                    "pending_upload: the bytes were not PUT to put_url yet",
                    Map::from_iter([("reason".to_owned(), json!("pending_upload"))]),
                ));
            }
            Err(e) => {
                self.unclaim(scope, &pending).await;
                return Err(codes::UPSTREAM_ERROR.error(format!("object store: {e}")));
            }
        };
        let stored = Box::pin(self.store_claimed(ctx, scope, &pending, &info)).await;
        match stored {
            Ok(done) => {
                let _ = staging.delete(&pending.object).await;
                Ok(done)
            }
            Err(Failed::Retry(e)) => {
                self.unclaim(scope, &pending).await;
                Err(e)
            }
            Err(Failed::Superseded(e)) => {
                let _ = staging.delete(&pending.object).await;
                self.quota
                    .unhold(&ctx.user, &hold_id(Bucket::Staging, &pending.object))
                    .await;
                Err(e)
            }
        }
    }

    /// Moves a claimed upload's staged bytes into the files store and the index, with its bytes counted.
    async fn store_claimed(
        &self,
        ctx: &CallContext,
        scope: &Scope,
        pending: &PendingRecord,
        info: &object_store::ObjectInfo,
    ) -> Result<Value, Failed> {
        let path = pending.path.as_str();
        let size = info.size as u64;
        let etag = etag_of_digest(info.digest.as_deref());
        let key = Self::key(scope, path);
        let (revision, current) = self.record(scope, path).await.map_err(Failed::Retry)?;
        let old = current.as_ref().map_or(0, |c| c.size);
        let hold = hold_id(Bucket::Staging, &pending.object);
        self.quota
            .reserve_growth(&ctx.user, old, size, Some(&hold))
            .await
            .map_err(|e| Failed::Retry(e.to_rpc()))?;
        // A name of its own: a write of the same path that wins the index swap leaves this copy to be removed.
        let committed = Self::object_name(scope, path);
        let copy = async {
            let mut src = self
                .objects
                .store(Bucket::Staging)
                .get(&pending.object)
                .await
                .map_err(|e| codes::UPSTREAM_ERROR.error(format!("object store: {e}")))?;
            let meta = object_store::ObjectMetadata {
                name: committed.clone(),
                metadata: HashMap::from([(META_CONTENT_TYPE.to_owned(), pending.content_type.clone())]),
                ..Default::default()
            };
            self.objects
                .store(Bucket::Files)
                .put(meta, &mut src)
                .await
                .map_err(|e| codes::UPSTREAM_ERROR.error(format!("object store: {e}")))
        };
        let copied = match tokio::time::timeout(limits::STORAGE_REQUEST_TIMEOUT, copy).await {
            Ok(r) => r.map(|_| ()),
            Err(_) => Err(IndexError::Timeout.to_rpc()),
        };
        if let Err(e) = copied {
            self.quota.undo_growth(&ctx.user, old, size).await;
            let _ = self.objects.store(Bucket::Files).delete(&committed).await;
            return Err(Failed::Retry(e));
        }
        let now = now_ms();
        let rec = FileRecord {
            path: path.to_owned(),
            object: committed.clone(),
            size,
            content_type: pending.content_type.clone(),
            etag: etag.clone(),
            updated_at_ms: now,
        };
        let body = serde_json::to_vec(&rec)
            .map_err(|e| Failed::Retry(codes::UPSTREAM_ERROR.error(e.to_string())))?;
        let headers = heads_headers(&Head {
            name: path.to_owned(),
            revision: 0,
            size,
            etag: etag.clone(),
            updated_ms: now,
            expires_ms: None,
            content_type: Some(pending.content_type.clone()),
        });
        if let Err(e) = self.index.write(&key, Some(revision), headers, body).await {
            self.quota.undo_growth(&ctx.user, old, size).await;
            let _ = self.objects.store(Bucket::Files).delete(&committed).await;
            return Err(match e {
                IndexError::Conflict => Failed::Superseded(
                    codes::UPSTREAM_ERROR
                        .error(format!("another write to {path:?} completed first; begin again")),
                ),
                e => Failed::Retry(e.to_rpc()),
            });
        }
        self.quota.settle(&ctx.user, old, size, Some(&hold)).await;
        if let Some(c) = current {
            let _ = self.objects.store(Bucket::Files).delete(&c.object).await;
        }
        Ok(json!({
            "path": path,
            "etag": etag,
            "size_bytes": size,
            "content_type": pending.content_type,
            "updated_at": rfc3339_ms(now),
        }))
    }

    async fn download_url(&self, scope: &Scope, p: &Map<String, Value>) -> Result<Value, ErrorObject> {
        let path = required_str(p, "path")?;
        validate_path(path)?;
        let ttl = match (
            super::kv::opt_u64(p, "ttl_seconds")?,
            super::kv::opt_u64(p, "expires_in")?,
        ) {
            (Some(t), _) | (None, Some(t)) => t,
            (None, None) => limits::FILES_DOWNLOAD_TTL_DEFAULT.as_secs(),
        };
        let max = limits::FILES_DOWNLOAD_TTL_MAX.as_secs();
        if !(1..=max).contains(&ttl) {
            return Err(codes::INVALID_REQUEST.error(format!("ttl_seconds must be 1..{max}, got {ttl}")));
        }
        let (_, rec) = self.record(scope, path).await?;
        let Some(rec) = rec else {
            if self.pending_record(scope, path).await?.is_some() {
                return Err(codes::UPSTREAM_ERROR.error_with(
                    format!("{path:?} is a pending upload (files/upload_complete not called)"),
                    Map::from_iter([("reason".to_owned(), json!("pending_upload"))]),
                ));
            }
            return Err(codes::NOT_FOUND.error(format!("no file {path:?} in scope '{}'", scope.name)));
        };
        let filename = path.rsplit('/').next().unwrap_or(path);
        let (url, exp) = self.objects.get_link(
            Bucket::Files,
            &rec.object,
            filename,
            &MediaType::parse_or_octet_stream(Some(&rec.content_type)),
            Duration::from_secs(ttl),
        );
        Ok(json!({
            "url": url,
            "get_url": url,
            "expires_at": rfc3339_ms(exp * 1000),
            "expires_in": ttl,
            "path": path,
            "size_bytes": rec.size,
            "content_type": rec.content_type,
        }))
    }

    async fn list(&self, scope: &Scope, p: &Map<String, Value>) -> Result<Value, ErrorObject> {
        let (prefix, cursor, limit) = paging(p, true)?;
        let mut page = Page::new(prefix, cursor, limit);
        self.index
            .heads(&format!("f.{}", scope.space), |h| page.offer(h))
            .await
            .map_err(|e| e.to_rpc())?;
        let (items, next) = page.finish();
        let items: Vec<Value> = items
            .into_iter()
            .map(|h| {
                json!({
                    "path": h.name,
                    "size_bytes": h.size,
                    "content_type": h.content_type,
                    "etag": h.etag,
                    "updated_at": rfc3339_ms(h.updated_ms),
                })
            })
            .collect();
        Ok(json!({ "items": items, "next_cursor": next }))
    }

    async fn delete(
        &self,
        ctx: &CallContext,
        scope: &Scope,
        p: &Map<String, Value>,
    ) -> Result<Value, ErrorObject> {
        let path = required_str(p, "path")?;
        validate_path(path)?;
        let pending = self.pending_record(scope, path).await?;
        if let Some(pend) = &pending {
            let _ = self.objects.store(Bucket::Staging).delete(&pend.object).await;
            let _ = self.pending.remove(&Self::pending_key(scope, path)).await;
            self.quota
                .unhold(&ctx.user, &hold_id(Bucket::Staging, &pend.object))
                .await;
        }
        let key = Self::key(scope, path);
        let mut races = Races::new();
        loop {
            let (revision, rec) = self.record(scope, path).await?;
            let Some(rec) = rec else {
                return if pending.is_some() {
                    Ok(json!({ "deleted": true }))
                } else {
                    Err(codes::NOT_FOUND.error(format!("no file {path:?} in scope '{}'", scope.name)))
                };
            };
            match self.index.purge(&key, revision).await {
                Ok(()) => {
                    self.quota.release(&ctx.user, rec.size).await;
                    let _ = self.objects.store(Bucket::Files).delete(&rec.object).await;
                    return Ok(json!({ "deleted": true }));
                }
                Err(IndexError::Conflict) => {
                    races.lost().await.map_err(|_| IndexError::Contention.to_rpc())?
                }
                Err(e) => return Err(e.to_rpc()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_rfc_4231_case_2() {
        let mac = hmac_sha256(b"Jefe", b"what do ya want for nothing?");
        assert_eq!(
            hex::encode(mac),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn a_tampered_part_or_signature_does_not_verify() {
        let s = LinkSigner::new(b"secret");
        let sig = s.sign(&["GET", "f", "obj", "100", "inline", "x"]);
        assert!(s.verify(&["GET", "f", "obj", "100", "inline", "x"], &sig));
        assert!(!s.verify(&["GET", "f", "obj", "101", "inline", "x"], &sig));
        assert!(!s.verify(&["GET", "f", "obj", "100", "attachment", "x"], &sig));
        assert!(!s.verify(&["GET", "f", "obj", "100", "inline", "x"], "00"));
        assert!(!LinkSigner::new(b"other").verify(&["GET", "f", "obj", "100", "inline", "x"], &sig));
    }

    #[test]
    fn upload_begin_refuses_an_invalid_type_with_its_invalid_request_code() {
        assert_eq!(
            content_type(" Image/PNG ").map(|m| m.to_string()),
            Ok("image/png".to_owned())
        );
        let Err(e) = content_type("image/png;x=1,text/html") else {
            panic!("a comma list was accepted");
        };
        assert_eq!(e.code, -32028);
        assert!(
            e.message.starts_with("content_type: ") && !e.message.contains("html"),
            "{}",
            e.message
        );
    }

    #[test]
    fn paths_follow_validate_path() {
        assert!(validate_path("a/b.txt").is_ok());
        assert!(validate_path(&"a".repeat(1024)).is_ok());
        for bad in [
            "",
            "/a",
            "a//b",
            "a/./b",
            "a/../b",
            "a\\b",
            "a\u{202E}b",
            "a\u{200B}b",
            "a\nb",
        ] {
            assert_eq!(validate_path(bad).err().map(|e| e.code), Some(-32027), "{bad:?}");
        }
        assert!(validate_path(&"a".repeat(1025)).is_err());
    }
}
