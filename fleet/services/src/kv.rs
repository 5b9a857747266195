//! APS KV (`storage/*`, spec §8.3) on JetStream KV, and what APS files share with it: the scope rules, the
//! per-user byte quota, and the [`Index`] (a KV bucket whose entries carry their heads in message headers, so a
//! listing reads headers only, never values).
//!
//! * **Keys.** Scope `tool` is keyed by (user, tool id), scope `user` by the user alone (shared by the user's
//!   plugins): the KV key is `<user_key>.<scope>.<sha256(key)>` with `<scope>` = `u` or `t<hash of tool id>`, so
//!   any key of 1–1024 characters fits a subject; the real key travels base64url-encoded in the `Aps-Key`
//!   header and inside the stored envelope.
//! * **Values.** Canonical JSON (object members sorted, no whitespace) of at most 256 KiB (`-32025`);
//!   `etag` = the first 32 hex characters of its SHA-256; `generation` = the KV revision of the write (it grows
//!   with every write); `if_match` takes an etag (string) or a generation (number or digit string), a mismatch
//!   or a missing key is `-32023`.
//! * **TTL.** `ttl_seconds` (1..31 536 000) is kept as `expires_at` in the envelope and its headers; an expired
//!   entry reads as absent everywhere and is purged (with its quota bytes released) by the first call that meets
//!   it. Not the server's per-message TTL: a server-side expiry would leave the quota counter charged forever.
//! * **Quota.** Bytes per user (KV values and files together) in `<prefix>_aps_usage`, one compare-and-set
//!   counter per user: a write reserves `new − old` before it is written and gives it back if the write loses; a
//!   delete or a shrinking overwrite releases after it succeeded. Default 5 GiB (`[services.storage]
//!   quota_bytes`); `-32024` at the first byte over. Uploads begun and not completed hold their bytes in the same
//!   value until they complete or expire ([`Hold`]); every write counts the live holds.
//! * **List.** Keys in byte order; `cursor` is the base64url of the last key returned; `limit` 1..1000 (default
//!   100, silently clamped); items are heads only. Memory is bounded by `limit`: a scan keeps the `limit + 1`
//!   smallest keys past the cursor in a heap.
//! * **Delete** is a purge (not recoverable); deleting a missing key answers `{"deleted": false}`.

use std::collections::BinaryHeap;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer, context, kv, stream::Stream};
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use bytes::Bytes;
use fleet_proto::executa::reverse::{method_not_found, methods, storage as codes};
use fleet_proto::jsonrpc::ErrorObject;
use fleet_proto::limits;
use futures::StreamExt as _;
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

use super::{CallContext, ServicesError};
use fleet_proto::api::user_key;
use fleet_proto::util::now_ms;
use fleet_store::cas::{self, Conflict, Races};
use fleet_store::{Op, StoreSettings, rfc3339_ms};

/// Largest `storage/set` `metadata` (canonical JSON; ours: the spec names no number).
const METADATA_MAX_BYTES: usize = 16 * 1024;
/// Longest tag (ours: the spec names no number).
const TAG_MAX_BYTES: usize = 256;

/// Header: the real key or path, base64url.
pub(crate) const H_KEY: &str = "Aps-Key";
/// Header: size in bytes.
pub(crate) const H_SIZE: &str = "Aps-Size";
/// Header: etag.
pub(crate) const H_ETAG: &str = "Aps-Etag";
/// Header: last write, Unix ms.
pub(crate) const H_UPDATED: &str = "Aps-Updated";
/// Header: expiry, Unix ms.
pub(crate) const H_EXPIRES: &str = "Aps-Expires";
/// Header: content type (files).
pub(crate) const H_TYPE: &str = "Aps-Type";

/// Storage settings (`[services.storage]`).
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StorageConfig {
    /// Per-user byte quota (KV values and files together). Default 5 GiB.
    #[serde(default)]
    pub quota_bytes: Option<u64>,
}

impl StorageConfig {
    /// The effective quota.
    pub fn quota(&self) -> u64 {
        self.quota_bytes.unwrap_or(limits::STORAGE_QUOTA_DEFAULT_BYTES)
    }
}

// ------------------------------------------------------------------------------------------------------------
// Shared by storage/* and files/*
// ------------------------------------------------------------------------------------------------------------

/// The scope of a call, resolved to its key segment.
#[derive(Debug, Clone)]
pub(crate) struct Scope {
    /// `tool` or `user`.
    pub name: &'static str,
    /// `<user_key>.<u | t<hash>>`.
    pub space: String,
}

/// Resolves `params.scope` against the token's `allowed_scopes` (spec §8.3 HR-ST-02, HR-ST-03).
pub(crate) fn scope(ctx: &CallContext, params: &Map<String, Value>) -> Result<Scope, ErrorObject> {
    let name = match params.get("scope") {
        None | Some(Value::Null) => {
            tracing::warn!(tool_id = %ctx.tool_id, "storage call without scope: defaulting to 'tool' (spec §16 A-22)");
            "tool"
        }
        Some(Value::String(s)) => s.as_str(),
        Some(_) => return Err(codes::INVALID_REQUEST.error("scope must be a string")),
    };
    let mut allowed: Vec<String> = ctx.claims.allowed_scopes.clone().unwrap_or_default();
    allowed.sort();
    let known = match name {
        "tool" => "tool",
        "user" => "user",
        "app" => "app",
        other => {
            return Err(
                codes::INVALID_REQUEST.error(format!("unknown scope {other:?}; one of 'tool', 'user'"))
            );
        }
    };
    if !allowed.iter().any(|a| a == known) {
        let list = allowed
            .iter()
            .map(|a| format!("'{a}'"))
            .collect::<Vec<_>>()
            .join(", ");
        return Err(codes::UPSTREAM_ERROR.error(format!(
            "storage_token does not permit scope='{known}'; allowed=[{list}]"
        )));
    }
    let user = user_key(&ctx.user);
    let space = match known {
        "user" => format!("{user}.u"),
        "tool" => format!("{user}.t{}", user_key(&ctx.tool_id)),
        _ => format!("{user}.a"),
    };
    Ok(Scope { name: known, space })
}

/// The params as an object (`-32028` otherwise).
pub(crate) fn object(params: Value) -> Result<Map<String, Value>, ErrorObject> {
    match params {
        Value::Object(m) => Ok(m),
        Value::Null => Ok(Map::new()),
        _ => Err(codes::INVALID_REQUEST.error("params must be an object")),
    }
}

/// A required string member.
pub(crate) fn required_str<'a>(p: &'a Map<String, Value>, name: &str) -> Result<&'a str, ErrorObject> {
    match p.get(name) {
        Some(Value::String(s)) => Ok(s),
        None | Some(Value::Null) => {
            Err(codes::INVALID_REQUEST.error(format!("missing required field '{name}'")))
        }
        Some(_) => Err(codes::INVALID_REQUEST.error(format!("'{name}' must be a string"))),
    }
}

/// An optional non-negative integer member.
pub(crate) fn opt_u64(p: &Map<String, Value>, name: &str) -> Result<Option<u64>, ErrorObject> {
    match p.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| codes::INVALID_REQUEST.error(format!("'{name}' must be a non-negative integer"))),
    }
}

/// `validate_kv_key`: 1–1024 characters, no control characters (spec §8.3 HR-ST-04) → `-32027`.
pub(crate) fn validate_key(key: &str) -> Result<(), ErrorObject> {
    let n = key.chars().count();
    if n == 0 || n > limits::STORAGE_KEY_MAX_CHARS {
        return Err(codes::INVALID_PATH.error(format!(
            "key must be 1–{} characters, got {n}",
            limits::STORAGE_KEY_MAX_CHARS
        )));
    }
    if key.chars().any(char::is_control) {
        return Err(codes::INVALID_PATH.error("key must not contain control characters"));
    }
    Ok(())
}

/// A list prefix: ≤ 1024 characters, no leading `/`, no `.`/`..` segments (spec §8.3 HR-ST-04) → `-32027`.
pub(crate) fn validate_prefix(prefix: &str) -> Result<(), ErrorObject> {
    let n = prefix.chars().count();
    if n > limits::STORAGE_KEY_MAX_CHARS {
        return Err(codes::INVALID_PATH.error(format!(
            "prefix must be at most {} characters, got {n}",
            limits::STORAGE_KEY_MAX_CHARS
        )));
    }
    if prefix.starts_with('/') {
        return Err(codes::INVALID_PATH.error("prefix must not start with '/'"));
    }
    if prefix.split('/').any(|s| s == "." || s == "..") {
        return Err(codes::INVALID_PATH.error("prefix must not contain '.' or '..' segments"));
    }
    Ok(())
}

/// `list` paging: `(prefix, cursor, limit)`; `limit_strict` refuses an out-of-range limit with `-32027`
/// (`files/list`, spec §16 A-28) instead of clamping it (`storage/list`).
pub(crate) fn paging(
    p: &Map<String, Value>,
    limit_strict: bool,
) -> Result<(String, Option<String>, usize), ErrorObject> {
    let prefix = match p.get("prefix") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(codes::INVALID_REQUEST.error("'prefix' must be a string")),
    };
    validate_prefix(&prefix)?;
    let cursor = match p.get("cursor") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s.is_empty() => None,
        Some(Value::String(s)) => Some(
            URL_SAFE_NO_PAD
                .decode(s)
                .ok()
                .and_then(|b| String::from_utf8(b).ok())
                .ok_or_else(|| codes::INVALID_REQUEST.error("'cursor' is not a cursor this host returned"))?,
        ),
        Some(_) => return Err(codes::INVALID_REQUEST.error("'cursor' must be a string")),
    };
    let max = limits::STORAGE_LIST_LIMIT_MAX;
    let limit = match p.get("limit") {
        None | Some(Value::Null) => limits::STORAGE_LIST_LIMIT_DEFAULT,
        Some(v) => match v.as_i64() {
            Some(l) if usize::try_from(l).is_ok_and(|l| (1..=max).contains(&l)) => {
                usize::try_from(l).unwrap_or(max)
            }
            _ if limit_strict => {
                return Err(codes::INVALID_PATH.error(format!("'limit' must be an integer 1..{max}")));
            }
            Some(l) if l < 1 => 1,
            Some(_) => max,
            None if v.as_f64().is_some() => limits::STORAGE_LIST_LIMIT_MAX,
            None => limits::STORAGE_LIST_LIMIT_DEFAULT,
        },
    };
    Ok((prefix, cursor, limit))
}

/// A cursor for `key`.
pub(crate) fn cursor_of(key: &str) -> String {
    URL_SAFE_NO_PAD.encode(key.as_bytes())
}

/// The hex SHA-256 of a name (the last key segment).
pub(crate) fn name_hash(name: &str) -> String {
    hex::encode(Sha256::digest(name.as_bytes()))
}

/// Canonical JSON: members sorted at every level, no whitespace.
pub fn canonical_json(v: &Value) -> Vec<u8> {
    fn sorted(v: &Value) -> Value {
        match v {
            Value::Object(m) => {
                let mut keys: Vec<&String> = m.keys().collect();
                keys.sort();
                let mut out = Map::new();
                for k in keys {
                    if let Some(x) = m.get(k) {
                        out.insert(k.clone(), sorted(x));
                    }
                }
                Value::Object(out)
            }
            Value::Array(a) => Value::Array(a.iter().map(sorted).collect()),
            other => other.clone(),
        }
    }
    // Without serde_json's `preserve_order` the map is sorted already; with it, `sorted` inserts in order.
    serde_json::to_vec(&sorted(v)).unwrap_or_default()
}

/// The etag of canonical bytes: the first 32 hex characters of their SHA-256.
pub fn etag_of(bytes: &[u8]) -> String {
    let mut h = hex::encode(Sha256::digest(bytes));
    h.truncate(32);
    h
}

/// Why an index or quota operation failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum IndexError {
    /// Another write came first (compare-and-set lost).
    #[error("another write changed the entry first")]
    Conflict,
    /// JetStream failed.
    #[error("JetStream: {0}")]
    Nats(String),
    /// A stored value does not parse.
    #[error("stored entry {0} is corrupt")]
    Corrupt(String),
    /// The quota would be exceeded.
    #[error(
        "storage quota exceeded: {used} of {cap} bytes stored, {reserved} held by uploads not completed, {wanted} more requested"
    )]
    Quota {
        /// Bytes in use.
        used: u64,
        /// Bytes held by uploads begun and not completed.
        reserved: u64,
        /// The cap.
        cap: u64,
        /// Bytes requested.
        wanted: u64,
    },
    /// The user has as many uploads begun and not completed as they may.
    #[error("{pending} uploads begun and not completed, at most {max} at once: complete or delete one first")]
    PendingUploads {
        /// Live holds.
        pending: usize,
        /// The cap.
        max: usize,
    },
    /// Too many lost compare-and-sets.
    #[error("too much contention on the entry")]
    Contention,
    /// The call ran out of time.
    #[error("the storage call timed out")]
    Timeout,
    /// The host stopped the call's task (it is shutting down).
    #[error("the storage call was stopped: the host is shutting down")]
    Cancelled,
}

impl IndexError {
    fn nats(e: impl std::fmt::Display) -> IndexError {
        IndexError::Nats(e.to_string())
    }

    /// The plugin-facing error.
    pub(crate) fn to_rpc(&self) -> ErrorObject {
        match self {
            IndexError::Conflict => codes::PRECONDITION_FAILED.error(self.to_string()),
            IndexError::Quota {
                used,
                reserved,
                cap,
                wanted,
            } => codes::QUOTA_EXCEEDED.error_with(
                self.to_string(),
                Map::from_iter([
                    ("used_bytes".to_owned(), json!(used)),
                    ("reserved_bytes".to_owned(), json!(reserved)),
                    ("quota_bytes".to_owned(), json!(cap)),
                    ("requested_bytes".to_owned(), json!(wanted)),
                ]),
            ),
            IndexError::PendingUploads { pending, max } => codes::QUOTA_EXCEEDED.error_with(
                self.to_string(),
                Map::from_iter([
                    ("reason".to_owned(), json!("pending_uploads")),
                    ("pending_uploads".to_owned(), json!(pending)),
                    ("max_pending_uploads".to_owned(), json!(max)),
                ]),
            ),
            _ => codes::UPSTREAM_ERROR.error(self.to_string()),
        }
    }
}

/// The current state of one index key.
#[derive(Debug)]
pub(crate) struct Slot {
    /// The revision to compare-and-set against (0: the subject never had a message).
    pub revision: u64,
    /// The stored envelope, when the last operation is a put.
    pub envelope: Option<Value>,
}

/// One head of a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Head {
    /// The real key or path.
    pub name: String,
    /// Its revision.
    pub revision: u64,
    /// Size.
    pub size: u64,
    /// Etag.
    pub etag: String,
    /// Last write, Unix ms.
    pub updated_ms: u64,
    /// Expiry, Unix ms.
    pub expires_ms: Option<u64>,
    /// Content type.
    pub content_type: Option<String>,
}

impl Ord for Head {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.name.cmp(&other.name)
    }
}

impl PartialOrd for Head {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// A KV bucket whose entries carry their heads in headers.
#[derive(Debug, Clone)]
pub(crate) struct Index {
    js: jetstream::Context,
    kv: kv::Store,
    stream: Stream,
}

impl Index {
    /// Creates or updates the bucket of `config` (one of [`StoreSettings`]' configs), or attaches to it.
    pub(crate) async fn open(
        js: &jetstream::Context,
        settings: &StoreSettings,
        config: kv::Config,
    ) -> Result<Index, ServicesError> {
        let bucket = config.bucket.clone();
        let kv = fleet_store::provision::key_value(js, config, settings.provision)
            .await
            .map_err(|e| ServicesError::Store(format!("{bucket}: {e}")))?;
        let stream = kv.stream.clone();
        Ok(Index {
            js: js.clone(),
            kv,
            stream,
        })
    }

    /// Reads a key.
    pub(crate) async fn read(&self, key: &str) -> Result<Slot, IndexError> {
        match self.kv.entry(key).await.map_err(IndexError::nats)? {
            None => Ok(Slot {
                revision: 0,
                envelope: None,
            }),
            Some(e) if e.operation != kv::Operation::Put => Ok(Slot {
                revision: e.revision,
                envelope: None,
            }),
            Some(e) => Ok(Slot {
                revision: e.revision,
                envelope: Some(
                    serde_json::from_slice(&e.value).map_err(|_| IndexError::Corrupt(key.to_owned()))?,
                ),
            }),
        }
    }

    /// Writes `body` with `headers` if the key is still at `expected` (0: never written; `None`: whatever it
    /// is). Returns the revision.
    pub(crate) async fn write(
        &self,
        key: &str,
        expected: Option<u64>,
        mut headers: HeaderMap,
        body: Vec<u8>,
    ) -> Result<u64, IndexError> {
        if let Some(expected) = expected {
            headers.insert(
                "Nats-Expected-Last-Subject-Sequence",
                expected.to_string().as_str(),
            );
        }
        let subject = format!("{}{key}", self.kv.prefix);
        let ack = self
            .js
            .publish_with_headers(subject, headers, Bytes::from(body))
            .await
            .map_err(IndexError::nats)?;
        match ack.await {
            Ok(a) => Ok(a.sequence),
            Err(e) if e.kind() == context::PublishErrorKind::WrongLastSequence => Err(IndexError::Conflict),
            Err(e) => Err(IndexError::nats(e)),
        }
    }

    /// Purges a key if it is still at `expected`.
    pub(crate) async fn purge(&self, key: &str, expected: u64) -> Result<(), IndexError> {
        match self.kv.purge_expect_revision(key, Some(expected)).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => Err(IndexError::Conflict),
            Err(e) => Err(IndexError::nats(e)),
        }
    }

    /// Deletes a key unconditionally (missing is fine).
    pub(crate) async fn remove(&self, key: &str) -> Result<(), IndexError> {
        self.kv.purge(key).await.map_err(IndexError::nats)
    }

    /// Visits the heads of every live entry under `space.` (headers only, no values), in no particular order.
    pub(crate) async fn heads(&self, space: &str, mut visit: impl FnMut(Head)) -> Result<(), IndexError> {
        let filter = format!("{}{space}.>", self.kv.prefix);
        let consumer = self
            .stream
            .create_consumer(consumer::push::OrderedConfig {
                deliver_subject: self.js.client().new_inbox(),
                filter_subject: filter,
                headers_only: true,
                replay_policy: consumer::ReplayPolicy::Instant,
                deliver_policy: consumer::DeliverPolicy::LastPerSubject,
                ..Default::default()
            })
            .await
            .map_err(IndexError::nats)?;
        if consumer.cached_info().num_pending == 0 {
            return Ok(());
        }
        let mut messages = consumer.messages().await.map_err(IndexError::nats)?;
        while let Some(m) = messages.next().await {
            let m = m.map_err(IndexError::nats)?;
            let info = m.info().map_err(IndexError::nats)?;
            let (revision, pending) = (info.stream_sequence, info.pending);
            if let Some(h) = m.headers.as_ref().and_then(|h| head_of(h, revision)) {
                visit(h);
            }
            if pending == 0 {
                break;
            }
        }
        Ok(())
    }
}

fn header<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).map(|v| v.as_str())
}

fn head_of(h: &HeaderMap, revision: u64) -> Option<Head> {
    if header(h, "KV-Operation").is_some_and(|op| op != "PUT") {
        return None;
    }
    let name = String::from_utf8(URL_SAFE_NO_PAD.decode(header(h, H_KEY)?).ok()?).ok()?;
    Some(Head {
        name,
        revision,
        size: header(h, H_SIZE).and_then(|s| s.parse().ok()).unwrap_or(0),
        etag: header(h, H_ETAG).unwrap_or_default().to_owned(),
        updated_ms: header(h, H_UPDATED).and_then(|s| s.parse().ok()).unwrap_or(0),
        expires_ms: header(h, H_EXPIRES).and_then(|s| s.parse().ok()),
        content_type: header(h, H_TYPE).map(str::to_owned),
    })
}

/// The heads of an entry, for [`Index::write`].
pub(crate) fn heads_headers(head: &Head) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(H_KEY, URL_SAFE_NO_PAD.encode(head.name.as_bytes()).as_str());
    h.insert(H_SIZE, head.size.to_string().as_str());
    h.insert(H_ETAG, head.etag.as_str());
    h.insert(H_UPDATED, head.updated_ms.to_string().as_str());
    if let Some(e) = head.expires_ms {
        h.insert(H_EXPIRES, e.to_string().as_str());
    }
    if let Some(t) = &head.content_type {
        h.insert(H_TYPE, t.as_str());
    }
    h
}

/// Keeps the `limit + 1` smallest heads named past `cursor` under `prefix` (bounded memory), then pages them.
pub(crate) struct Page {
    heap: BinaryHeap<Head>,
    prefix: String,
    cursor: Option<String>,
    limit: usize,
}

impl Page {
    /// A page of `limit` after `cursor`.
    pub(crate) fn new(prefix: String, cursor: Option<String>, limit: usize) -> Page {
        Page {
            heap: BinaryHeap::with_capacity(limit + 2),
            prefix,
            cursor,
            limit,
        }
    }

    /// Offers one head.
    pub(crate) fn offer(&mut self, head: Head) {
        if !head.name.starts_with(&self.prefix) || self.cursor.as_ref().is_some_and(|c| head.name <= *c) {
            return;
        }
        if self.heap.len() <= self.limit {
            self.heap.push(head);
        } else if self.heap.peek().is_some_and(|top| head < *top) {
            self.heap.pop();
            self.heap.push(head);
        }
    }

    /// The page, sorted, and the next cursor if more remain.
    pub(crate) fn finish(self) -> (Vec<Head>, Option<String>) {
        let mut items = self.heap.into_sorted_vec();
        let more = items.len() > self.limit;
        items.truncate(self.limit);
        let next = if more {
            items.last().map(|h| cursor_of(&h.name))
        } else {
            None
        };
        (items, next)
    }
}

/// How long past its link's expiry an upload's hold is kept: a PUT begun just before the expiry may still be
/// streaming its body into the object store. Past it the hold no longer counts, and the next hold of its user
/// removes the bytes that were never completed ([`Quota::hold`]).
pub(crate) const HOLD_GRACE: std::time::Duration = std::time::Duration::from_secs(600);

/// A reservation of quota for an upload begun and not completed (`files/upload_begin`, `host/uploadFile`
/// `negotiate`): the bytes its signed PUT link may store, until its expiry.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Hold {
    /// `s/<staging object>` or `u/<r2_key>`: where the link puts its bytes.
    pub id: String,
    /// The bytes reserved (the link's byte cap).
    pub bytes: u64,
    /// When it stops counting, Unix ms.
    pub exp: u64,
}

/// One user's `<prefix>_aps_usage` value: the bytes stored and the uploads held. Kept as bare decimal digits
/// while nothing is held (the format before holds), as JSON otherwise.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Usage {
    used: u64,
    #[serde(default)]
    holds: Vec<Hold>,
}

impl Usage {
    fn parse(raw: &[u8]) -> Option<Usage> {
        let s = std::str::from_utf8(raw).ok()?;
        match s.parse::<u64>() {
            Ok(used) => Some(Usage {
                used,
                holds: Vec::new(),
            }),
            Err(_) => serde_json::from_str(s).ok(),
        }
    }

    fn encode(&self) -> Bytes {
        if self.holds.is_empty() {
            Bytes::from(self.used.to_string())
        } else {
            Bytes::from(serde_json::to_vec(self).unwrap_or_default())
        }
    }

    /// Bytes of the holds live at `now`, but the one named `except`.
    fn held(&self, now: u64, except: Option<&str>) -> u64 {
        self.holds
            .iter()
            .filter(|h| h.exp > now && Some(h.id.as_str()) != except)
            .fold(0, |sum, h| sum.saturating_add(h.bytes))
    }

    /// Removes and returns the holds expired at `now`.
    fn expire(&mut self, now: u64) -> Vec<Hold> {
        let (live, expired) = std::mem::take(&mut self.holds)
            .into_iter()
            .partition(|h| h.exp > now);
        self.holds = live;
        expired
    }

    /// Refuses `wanted` more bytes past the cap, counting the live holds but `except`.
    fn room(&self, cap: u64, wanted: u64, now: u64, except: Option<&str>) -> Result<(), IndexError> {
        let reserved = self.held(now, except);
        if self.used.saturating_add(reserved).saturating_add(wanted) > cap {
            return Err(IndexError::Quota {
                used: self.used,
                reserved,
                cap,
                wanted,
            });
        }
        Ok(())
    }
}

/// The per-user byte quota (KV values and files together), with the uploads each user holds.
#[derive(Debug, Clone)]
pub(crate) struct Quota {
    kv: kv::Store,
    cap: u64,
}

impl Quota {
    /// Opens `<prefix>_aps_usage`.
    pub(crate) async fn open(
        js: &jetstream::Context,
        settings: &StoreSettings,
        config: &StorageConfig,
    ) -> Result<Quota, ServicesError> {
        let bucket_config = settings.aps_usage_kv_config();
        let bucket = bucket_config.bucket.clone();
        let kv = Box::pin(fleet_store::provision::key_value(
            js,
            bucket_config,
            settings.provision,
        ))
        .await
        .map_err(|e| ServicesError::Store(format!("{bucket}: {e}")))?;
        Ok(Quota {
            kv,
            cap: config.quota(),
        })
    }

    async fn read(&self, key: &str) -> Result<(Usage, Option<u64>), IndexError> {
        match self.kv.entry(key).await.map_err(IndexError::nats)? {
            Some(e) if e.operation == kv::Operation::Put => {
                let usage = Usage::parse(&e.value).ok_or_else(|| IndexError::Corrupt(key.to_owned()))?;
                Ok((usage, Some(e.revision)))
            }
            Some(e) => Ok((Usage::default(), Some(e.revision))),
            None => Ok((Usage::default(), None)),
        }
    }

    /// Changes the user's usage with `change` (given the usage and the time) by compare-and-set, retrying lost
    /// races; `change` refusing writes nothing. Returns what `change` returned.
    async fn update<T>(
        &self,
        user: &str,
        mut change: impl FnMut(&mut Usage, u64) -> Result<T, IndexError>,
    ) -> Result<T, IndexError> {
        let key = user_key(user);
        let mut races = Races::new();
        loop {
            let (mut usage, rev) = self.read(&key).await?;
            let before = usage.clone();
            let out = change(&mut usage, now_ms())?;
            if usage == before {
                return Ok(out);
            }
            match cas::write_bytes(&self.kv, &key, usage.encode(), rev, Op::StorageQuota).await {
                Ok(Ok(_)) => return Ok(out),
                Ok(Err(Conflict)) => races.lost().await.map_err(|_| IndexError::Contention)?,
                Err(e) => return Err(IndexError::nats(e)),
            }
        }
    }

    /// Adds `delta` to the user's stored bytes; growth is refused at the first byte over the cap, counting the
    /// live holds but `except`.
    async fn adjust(&self, user: &str, delta: i128, except: Option<&str>) -> Result<(), IndexError> {
        let cap = self.cap;
        self.update(user, |u, now| {
            if delta > 0 {
                u.room(cap, u64::try_from(delta).unwrap_or(u64::MAX), now, except)?;
            }
            u.used = u64::try_from((i128::from(u.used) + delta).max(0)).unwrap_or(u64::MAX);
            Ok(())
        })
        .await
    }

    /// Gives `bytes` back (best effort: a failure is logged).
    pub(crate) async fn release(&self, user: &str, bytes: u64) {
        if bytes == 0 {
            return;
        }
        if let Err(e) = self.adjust(user, -i128::from(bytes), None).await {
            tracing::warn!(error = %e, bytes, "storage quota release failed");
        }
    }

    /// Reserves `new − old` before a write; releasing is left to [`Quota::settle`]. The write's own hold
    /// (`hold`, when it completes an upload) is not counted against it: it is given back at the settle.
    pub(crate) async fn reserve_growth(
        &self,
        user: &str,
        old: u64,
        new: u64,
        hold: Option<&str>,
    ) -> Result<(), IndexError> {
        let growth = new.saturating_sub(old);
        if growth == 0 {
            return Ok(());
        }
        self.adjust(user, i128::from(growth), hold).await
    }

    /// After a write of `new` over `old` succeeded: releases the shrink, and the write's hold with it.
    pub(crate) async fn settle(&self, user: &str, old: u64, new: u64, hold: Option<&str>) {
        let shrink = old.saturating_sub(new);
        let settled = self
            .update(user, |u, _| {
                u.used = u.used.saturating_sub(shrink);
                if let Some(id) = hold {
                    u.holds.retain(|h| h.id != id);
                }
                Ok(())
            })
            .await;
        if let Err(e) = settled {
            tracing::warn!(error = %e, bytes = shrink, "storage quota settle failed");
        }
    }

    /// After a write failed: gives the growth back (the write's hold stays, for a retry).
    pub(crate) async fn undo_growth(&self, user: &str, old: u64, new: u64) {
        self.release(user, new.saturating_sub(old)).await;
    }

    /// Holds `hold.bytes` of the user's quota for an upload until `hold.exp` (or [`Quota::unhold`]): refused
    /// with [`IndexError::PendingUploads`] when the user holds [`limits::PENDING_UPLOADS_MAX_PER_USER`] already,
    /// with [`IndexError::Quota`] at the first byte over the cap (stored bytes and live holds counted). Returns
    /// the user's holds that had expired, dropped by this write: their bytes, if they landed, were never
    /// completed, and the caller removes them.
    pub(crate) async fn hold(&self, user: &str, hold: Hold) -> Result<Vec<Hold>, IndexError> {
        let cap = self.cap;
        self.update(user, |u, now| {
            let expired = u.expire(now);
            let max = limits::PENDING_UPLOADS_MAX_PER_USER;
            if u.holds.len() >= max {
                return Err(IndexError::PendingUploads {
                    pending: u.holds.len(),
                    max,
                });
            }
            u.room(cap, hold.bytes, now, None)?;
            u.holds.push(hold.clone());
            Ok(expired)
        })
        .await
    }

    /// Gives an upload's hold back (completed, confirmed or deleted; best effort: a failure is logged and the
    /// hold expires on its own).
    pub(crate) async fn unhold(&self, user: &str, id: &str) {
        let dropped = self
            .update(user, |u, _| {
                u.holds.retain(|h| h.id != id);
                Ok(())
            })
            .await;
        if let Err(e) = dropped {
            tracing::warn!(error = %e, "releasing an upload's quota hold failed; it expires on its own");
        }
    }
}

/// Runs one storage or files call on a task of its own and waits for it within the storage subcall timeout
/// (spec §7.3).
///
/// The timeout (or a caller that goes away) abandons the wait, never the call: a call changes the index, the
/// quota counter and the object store in several steps, and stopping between two of them would leave bytes
/// reserved that no write holds, or a written value whose bytes are not counted. Every step below is bounded on
/// its own (NATS request timeouts, [`limits::STORAGE_REQUEST_TIMEOUT`] around object copies), so the task ends.
pub(crate) async fn timed<T: Send + 'static>(
    ctx: &CallContext,
    f: impl std::future::Future<Output = Result<T, ErrorObject>> + Send + 'static,
) -> Result<T, ErrorObject> {
    let task = tokio::spawn(tracing::Instrument::in_current_span(f));
    match tokio::time::timeout(ctx.subcall_timeout(limits::STORAGE_REQUEST_TIMEOUT), task).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Ok(Err(_)) => Err(IndexError::Cancelled.to_rpc()),
        Err(_) => Err(IndexError::Timeout.to_rpc()),
    }
}

// ------------------------------------------------------------------------------------------------------------
// storage/*
// ------------------------------------------------------------------------------------------------------------

/// One stored KV value.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Envelope {
    key: String,
    value: Value,
    etag: String,
    size: u64,
    updated_at_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    expires_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    metadata: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tags: Option<Vec<String>>,
}

impl Envelope {
    fn expired(&self, now: u64) -> bool {
        self.expires_at_ms.is_some_and(|e| e <= now)
    }
}

/// What `if_match` names.
#[derive(Debug, Clone, PartialEq, Eq)]
enum IfMatch {
    Etag(String),
    Generation(u64),
}

impl IfMatch {
    fn parse(p: &Map<String, Value>) -> Result<Option<IfMatch>, ErrorObject> {
        match p.get("if_match") {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) => n.as_u64().map(|g| Some(IfMatch::Generation(g))).ok_or_else(|| {
                codes::INVALID_REQUEST.error("'if_match' generation must be a non-negative integer")
            }),
            Some(Value::String(s)) => {
                let s = s.trim().trim_matches('"');
                if s.len() != 32
                    && !s.is_empty()
                    && s.bytes().all(|b| b.is_ascii_digit())
                    && let Ok(g) = s.parse()
                {
                    return Ok(Some(IfMatch::Generation(g)));
                }
                Ok(Some(IfMatch::Etag(s.to_ascii_lowercase())))
            }
            Some(_) => {
                Err(codes::INVALID_REQUEST.error("'if_match' must be an etag string or a generation number"))
            }
        }
    }

    fn matches(&self, etag: &str, generation: u64) -> bool {
        match self {
            IfMatch::Etag(e) => e == etag,
            IfMatch::Generation(g) => *g == generation,
        }
    }

    fn refused(&self, current: Option<(&str, u64)>) -> ErrorObject {
        let (message, data) = match current {
            Some((etag, generation)) => (
                format!("if_match {self:?} does not match the current etag {etag} / generation {generation}"),
                json!({ "etag": etag, "generation": generation }),
            ),
            None => (
                format!("if_match {self:?} given but the key does not exist"),
                json!({ "etag": null, "generation": null }),
            ),
        };
        let data = match data {
            Value::Object(m) => m,
            _ => Map::new(),
        };
        codes::PRECONDITION_FAILED.error_with(message, data)
    }
}

/// The storage methods.
#[derive(Debug, Clone, Copy)]
enum Method {
    Get,
    Set,
    Delete,
    List,
}

/// The KV service. Cheap to clone (each call runs on a task of its own, see [`timed`]).
#[derive(Debug, Clone)]
pub struct KvService {
    index: Index,
    quota: Quota,
}

impl KvService {
    /// Opens its bucket (`<prefix>_aps_kv`); `quota` is the per-user byte quota it shares with the files service.
    pub(crate) async fn open(
        js: &jetstream::Context,
        settings: &StoreSettings,
        quota: Quota,
    ) -> Result<KvService, ServicesError> {
        // The envelope around a 256 KiB value: the key (≤ 4 KiB of UTF-8), metadata, tags, headers.
        let max_value = limits::STORAGE_VALUE_MAX_BYTES + 64 * 1024;
        let index = Index::open(js, settings, settings.aps_kv_config(max_value)).await?;
        Ok(KvService { index, quota })
    }

    /// Serves one call.
    pub async fn call(&self, ctx: &CallContext, method: &str, params: Value) -> Result<Value, ErrorObject> {
        let p = object(params)?;
        let scope = scope(ctx, &p)?;
        let method = match method {
            methods::STORAGE_GET => Method::Get,
            methods::STORAGE_SET => Method::Set,
            methods::STORAGE_DELETE => Method::Delete,
            methods::STORAGE_LIST => Method::List,
            _ => return Err(method_not_found(method)),
        };
        let (this, call) = (self.clone(), ctx.clone());
        timed(ctx, async move {
            match method {
                Method::Get => Box::pin(this.get(&call, &scope, &p)).await,
                Method::Set => Box::pin(this.set(&call, &scope, &p)).await,
                Method::Delete => Box::pin(this.delete(&call, &scope, &p)).await,
                Method::List => Box::pin(this.list(&call, &scope, &p)).await,
            }
        })
        .await
    }

    fn entry_key(scope: &Scope, key: &str) -> String {
        format!("{}.{}", scope.space, name_hash(key))
    }

    /// Reads a key; an expired entry is purged (its bytes released) and reads as absent.
    async fn current(
        &self,
        ctx: &CallContext,
        entry_key: &str,
    ) -> Result<(u64, Option<Envelope>), ErrorObject> {
        let slot = self.index.read(entry_key).await.map_err(|e| e.to_rpc())?;
        let Some(env) = slot.envelope else {
            return Ok((slot.revision, None));
        };
        let env: Envelope =
            serde_json::from_value(env).map_err(|_| IndexError::Corrupt(entry_key.to_owned()).to_rpc())?;
        if env.expired(now_ms()) {
            match self.index.purge(entry_key, slot.revision).await {
                Ok(()) => {
                    self.quota.release(&ctx.user, env.size).await;
                    // The purge marker is the new revision: read it back for the caller's compare-and-set.
                    let slot = self.index.read(entry_key).await.map_err(|e| e.to_rpc())?;
                    return Ok((slot.revision, None));
                }
                Err(IndexError::Conflict) => {
                    let slot = self.index.read(entry_key).await.map_err(|e| e.to_rpc())?;
                    let env = slot
                        .envelope
                        .and_then(|v| serde_json::from_value::<Envelope>(v).ok())
                        .filter(|e| !e.expired(now_ms()));
                    return Ok((slot.revision, env));
                }
                Err(e) => return Err(e.to_rpc()),
            }
        }
        Ok((slot.revision, Some(env)))
    }

    async fn get(
        &self,
        ctx: &CallContext,
        scope: &Scope,
        p: &Map<String, Value>,
    ) -> Result<Value, ErrorObject> {
        let key = required_str(p, "key")?;
        validate_key(key)?;
        let (revision, env) = self.current(ctx, &Self::entry_key(scope, key)).await?;
        Ok(match env {
            None => json!({ "value": null, "exists": false, "etag": null }),
            Some(e) => json!({
                "value": e.value,
                "exists": true,
                "etag": e.etag,
                "generation": revision,
                "size_bytes": e.size,
                "updated_at": rfc3339_ms(e.updated_at_ms),
                "expires_at": e.expires_at_ms.map(rfc3339_ms),
                "metadata": e.metadata,
                "tags": e.tags,
            }),
        })
    }

    async fn set(
        &self,
        ctx: &CallContext,
        scope: &Scope,
        p: &Map<String, Value>,
    ) -> Result<Value, ErrorObject> {
        let key = required_str(p, "key")?;
        validate_key(key)?;
        let value = p
            .get("value")
            .ok_or_else(|| codes::INVALID_REQUEST.error("missing required field 'value'"))?;
        let canonical = canonical_json(value);
        let size = canonical.len() as u64;
        if canonical.len() > limits::STORAGE_VALUE_MAX_BYTES {
            return Err(codes::VALUE_TOO_LARGE.error_with(
                format!(
                    "value is {size} bytes of canonical JSON; the limit is {}",
                    limits::STORAGE_VALUE_MAX_BYTES
                ),
                Map::from_iter([
                    ("size_bytes".to_owned(), json!(size)),
                    ("max_bytes".to_owned(), json!(limits::STORAGE_VALUE_MAX_BYTES)),
                ]),
            ));
        }
        let ttl = opt_u64(p, "ttl_seconds")?;
        if let Some(t) = ttl
            && !(1..=limits::STORAGE_TTL_MAX_SECONDS).contains(&t)
        {
            return Err(codes::INVALID_REQUEST.error(format!(
                "'ttl_seconds' must be 1..{}",
                limits::STORAGE_TTL_MAX_SECONDS
            )));
        }
        let if_match = IfMatch::parse(p)?;
        let metadata = match p.get("metadata") {
            None | Some(Value::Null) => None,
            Some(m @ Value::Object(_)) if canonical_json(m).len() <= METADATA_MAX_BYTES => Some(m.clone()),
            Some(Value::Object(_)) => {
                return Err(codes::INVALID_REQUEST.error(format!(
                    "'metadata' must be at most {METADATA_MAX_BYTES} bytes of JSON"
                )));
            }
            Some(_) => return Err(codes::INVALID_REQUEST.error("'metadata' must be an object")),
        };
        let tags = match p.get("tags") {
            None | Some(Value::Null) => None,
            Some(Value::Array(a)) => {
                if a.len() > limits::STORAGE_TAGS_MAX {
                    return Err(codes::INVALID_REQUEST.error(format!(
                        "at most {} tags, got {}",
                        limits::STORAGE_TAGS_MAX,
                        a.len()
                    )));
                }
                Some(
                    a.iter()
                        .map(|t| t.as_str().filter(|t| t.len() <= TAG_MAX_BYTES).map(str::to_owned))
                        .collect::<Option<Vec<_>>>()
                        .ok_or_else(|| {
                            codes::INVALID_REQUEST
                                .error(format!("'tags' must be strings of at most {TAG_MAX_BYTES} bytes"))
                        })?,
                )
            }
            Some(_) => return Err(codes::INVALID_REQUEST.error("'tags' must be an array of strings")),
        };
        let etag = etag_of(&canonical);
        let entry_key = Self::entry_key(scope, key);
        let mut races = Races::new();
        loop {
            let (revision, current) = self.current(ctx, &entry_key).await?;
            if let Some(m) = &if_match {
                match &current {
                    Some(c) if m.matches(&c.etag, revision) => {}
                    Some(c) => return Err(m.refused(Some((&c.etag, revision)))),
                    None => return Err(m.refused(None)),
                }
            }
            let old = current.as_ref().map_or(0, |c| c.size);
            let now = now_ms();
            let env = Envelope {
                key: key.to_owned(),
                value: value.clone(),
                etag: etag.clone(),
                size,
                updated_at_ms: now,
                expires_at_ms: ttl.map(|t| now.saturating_add(t.saturating_mul(1000))),
                metadata: metadata.clone(),
                tags: tags.clone(),
            };
            let body = serde_json::to_vec(&env).map_err(|e| codes::UPSTREAM_ERROR.error(e.to_string()))?;
            let headers = heads_headers(&Head {
                name: key.to_owned(),
                revision: 0,
                size,
                etag: etag.clone(),
                updated_ms: now,
                expires_ms: env.expires_at_ms,
                content_type: None,
            });
            self.quota
                .reserve_growth(&ctx.user, old, size, None)
                .await
                .map_err(|e| e.to_rpc())?;
            match self.index.write(&entry_key, Some(revision), headers, body).await {
                Ok(generation) => {
                    self.quota.settle(&ctx.user, old, size, None).await;
                    return Ok(json!({
                        "etag": etag,
                        "generation": generation,
                        "size_bytes": size,
                        "expires_at": env.expires_at_ms.map(rfc3339_ms),
                    }));
                }
                Err(IndexError::Conflict) => {
                    self.quota.undo_growth(&ctx.user, old, size).await;
                    if let Some(m) = &if_match {
                        return Err(m.refused(None));
                    }
                    races.lost().await.map_err(|_| IndexError::Contention.to_rpc())?;
                }
                Err(e) => {
                    self.quota.undo_growth(&ctx.user, old, size).await;
                    return Err(e.to_rpc());
                }
            }
        }
    }

    async fn delete(
        &self,
        ctx: &CallContext,
        scope: &Scope,
        p: &Map<String, Value>,
    ) -> Result<Value, ErrorObject> {
        let key = required_str(p, "key")?;
        validate_key(key)?;
        let if_match = IfMatch::parse(p)?;
        let entry_key = Self::entry_key(scope, key);
        let mut races = Races::new();
        loop {
            let (revision, current) = self.current(ctx, &entry_key).await?;
            let Some(current) = current else {
                return match &if_match {
                    Some(m) => Err(m.refused(None)),
                    None => Ok(json!({ "deleted": false })),
                };
            };
            if let Some(m) = &if_match
                && !m.matches(&current.etag, revision)
            {
                return Err(m.refused(Some((&current.etag, revision))));
            }
            match self.index.purge(&entry_key, revision).await {
                Ok(()) => {
                    self.quota.release(&ctx.user, current.size).await;
                    return Ok(json!({ "deleted": true }));
                }
                Err(IndexError::Conflict) if if_match.is_some() => {
                    return Err(if_match
                        .as_ref()
                        .map_or_else(|| IndexError::Conflict.to_rpc(), |m| m.refused(None)));
                }
                Err(IndexError::Conflict) => {
                    races.lost().await.map_err(|_| IndexError::Contention.to_rpc())?
                }
                Err(e) => return Err(e.to_rpc()),
            }
        }
    }

    async fn list(
        &self,
        ctx: &CallContext,
        scope: &Scope,
        p: &Map<String, Value>,
    ) -> Result<Value, ErrorObject> {
        if let Some(kind) = p.get("kind").and_then(Value::as_str)
            && kind != "kv"
        {
            return Err(codes::INVALID_REQUEST.error(format!(
                "kind {kind:?} is not listed by storage/list here; use files/list for files"
            )));
        }
        let (prefix, cursor, limit) = paging(p, false)?;
        let now = now_ms();
        let mut page = Page::new(prefix, cursor, limit);
        let mut expired = Vec::new();
        self.index
            .heads(&scope.space, |h| {
                if h.expires_ms.is_some_and(|e| e <= now) {
                    // Purged below; at most `limit` per call, so memory stays bounded.
                    if expired.len() < limit {
                        expired.push(h.name);
                    }
                } else {
                    page.offer(h);
                }
            })
            .await
            .map_err(|e| e.to_rpc())?;
        // Expired entries met on the way are purged (and their bytes released) through the usual read.
        for name in &expired {
            self.current(ctx, &Self::entry_key(scope, name)).await?;
        }
        let (items, next) = page.finish();
        let items: Vec<Value> = items
            .into_iter()
            .map(|h| {
                json!({
                    "key": h.name,
                    "etag": h.etag,
                    "generation": h.revision,
                    "size_bytes": h.size,
                    "updated_at": rfc3339_ms(h.updated_ms),
                    "expires_at": h.expires_ms.map(rfc3339_ms),
                })
            })
            .collect();
        Ok(json!({ "items": items, "next_cursor": next }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(holds: &[Hold]) -> Vec<&str> {
        holds.iter().map(|h| h.id.as_str()).collect()
    }

    #[test]
    fn holds_count_until_their_expiry_and_the_bare_counter_still_reads() {
        // The format before holds reads, and is written again while nothing is held.
        let bare = Usage::parse(b"1234").expect("digits");
        assert_eq!(
            bare,
            Usage {
                used: 1234,
                holds: Vec::new()
            }
        );
        assert_eq!(bare.encode(), Bytes::from("1234"));
        for corrupt in [&b"x"[..], b"-1", b"[]", b""] {
            assert_eq!(Usage::parse(corrupt), None, "{corrupt:?}");
        }
        let hold = |id: &str, bytes, exp| Hold {
            id: id.to_owned(),
            bytes,
            exp,
        };
        let mut u = Usage {
            used: 100,
            holds: vec![hold("s/a", 300, 1000), hold("u/b", 600, 2000)],
        };
        assert_eq!(Usage::parse(&u.encode()), Some(u.clone()));
        // At the boundary: 100 stored + 900 held fill a 1000-byte quota; one byte more is refused, with the limit.
        assert!(u.room(1000, 0, 999, None).is_ok());
        assert!(matches!(
            u.room(1000, 1, 999, None),
            Err(IndexError::Quota {
                used: 100,
                reserved: 900,
                cap: 1000,
                wanted: 1
            })
        ));
        // A write completing an upload is not counted against its own hold.
        assert!(u.room(1000, 600, 999, Some("u/b")).is_ok());
        assert!(u.room(1000, 601, 999, Some("u/b")).is_err());
        // A hold stops counting at its expiry.
        assert_eq!(u.held(999, None), 900);
        assert_eq!(u.held(1000, None), 600);
        assert!(u.room(1000, 300, 1000, None).is_ok());
        assert!(u.room(1000, 301, 1000, None).is_err());
        // Expiring removes exactly the expired ones.
        assert_eq!(ids(&u.expire(999)), Vec::<&str>::new());
        assert_eq!(ids(&u.expire(1000)), ["s/a"]);
        assert_eq!(ids(&u.holds), ["u/b"]);
    }

    #[test]
    fn a_full_set_of_the_longest_holds_fits_the_usage_value() {
        // An r2_key is at most ~600 bytes (its segments' caps), a staging object name ~140.
        let full = Usage {
            used: u64::MAX,
            holds: (0..limits::PENDING_UPLOADS_MAX_PER_USER)
                .map(|_| Hold {
                    id: format!("u/{}", "k".repeat(700)),
                    bytes: u64::MAX,
                    exp: u64::MAX,
                })
                .collect(),
        };
        assert!(full.encode().len() <= fleet_store::settings::APS_USAGE_MAX_BYTES);
    }

    fn head(name: &str) -> Head {
        Head {
            name: name.to_owned(),
            revision: 1,
            size: 1,
            etag: String::new(),
            updated_ms: 0,
            expires_ms: None,
            content_type: None,
        }
    }

    #[test]
    fn canonical_json_sorts_members_at_every_level() {
        let v = json!({"b": 1, "a": {"z": [ {"y": 1, "x": 2} ], "c": null}});
        assert_eq!(
            String::from_utf8(canonical_json(&v)).expect("utf8"),
            r#"{"a":{"c":null,"z":[{"x":2,"y":1}]},"b":1}"#
        );
        assert_eq!(etag_of(&canonical_json(&v)).len(), 32);
    }

    #[test]
    fn a_page_keeps_the_smallest_keys_past_the_cursor() {
        let mut page = Page::new("k".into(), Some("k02".into()), 2);
        for n in ["k05", "x1", "k01", "k03", "k02", "k04"] {
            page.offer(head(n));
        }
        let (items, next) = page.finish();
        let names: Vec<&str> = items.iter().map(|h| h.name.as_str()).collect();
        assert_eq!(names, ["k03", "k04"]);
        assert_eq!(next, Some(cursor_of("k04")));
        let mut last = Page::new(String::new(), Some("k04".into()), 2);
        last.offer(head("k05"));
        assert_eq!(last.finish().1, None);
    }

    #[test]
    fn keys_and_prefixes_are_validated() {
        assert!(validate_key(&"a".repeat(1024)).is_ok());
        assert_eq!(
            validate_key(&"a".repeat(1025)).err().map(|e| e.code),
            Some(-32027)
        );
        assert!(validate_key("").is_err());
        assert!(validate_prefix("a/b/").is_ok());
        assert!(validate_prefix("/a").is_err());
        assert!(validate_prefix("a/../b").is_err());
    }
}
