//! Per-user plugin credentials (spec §4.2): stored encrypted at rest in the JetStream KV bucket
//! `<prefix>_credentials`, written only by operators (`fleet.v1.admin.credentials.*`, served by the fleet crate's
//! `credentials`), resolved by the worker at every invoke into `params.context.credentials`.
//!
//! **Envelope encryption.** One record per user (key: the user's key), holding a random 256-bit *data key*
//! wrapped (AES-256-GCM) by a *key-encryption key* of the operator's [`Keyring`], the wrapping key's id
//! (`kid`), and every value of every scope sealed (AES-256-GCM, random 96-bit nonce) under the data key. The
//! associated data binds each ciphertext to its place: the data key to its user, a value to (user, scope,
//! name), so a ciphertext copied into another user's record or another name does not open.
//!
//! **Rotation.** The keyring is a file of `<kid> <64 hex digits>` lines: the first key wraps new and changed
//! records, every key opens. Rotating is prepending a key ([`rotate_key_file`], `fleet credentials
//! rotate-key`): every use of the keyring checks whether the file changed (its modification time and size, one
//! `stat`) and re-reads it, so a key added or removed takes effect at the next wrap or open of every process. [`CredentialStore::rewrap`] (`fleet credentials rewrap`) then wraps every
//! record's data key under the first key; values are not re-encrypted (the data keys do not change). Once it
//! reports nothing left under an old key, that key's line can be removed.
//!
//! **Resolution** ([`CredentialStore::resolve`], at every invoke of a plugin whose manifest declares
//! credentials): one KV read of the user's record, one unwrap, one open per declared name found — plugin value
//! first, then the user-wide one. Nothing decrypted is cached: values live only in the invoke's context.
//! No value reaches a log, metric, trace or error: errors name users, tools, names and key ids only.
//!
//! The record keeps fields it does not know ([`Record::rest`]), so later additions (OAuth accounts of spec §8.8,
//! their refresh tokens sealed under the same data key) survive edits by older fronts.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use async_nats::jetstream::{self, kv};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use fleet_proto::admin::credentials::{
    Deleted, Entry, Listed, NAME_MAX_CHARS, NAMES_PER_CALL_MAX, Rewrapped, Scope, VALUE_MAX_BYTES,
};
use fleet_proto::api::{ApiError, ApiErrorCode, user_key};
use fleet_proto::util::{lock, now_ms};
use fleet_store::cas::{Edit, Target, compare_and_set};
use fleet_store::settings::CREDENTIALS_RECORD_MAX_BYTES;
use fleet_store::{self as store, Op, Revisioned, StoreError, StoreSettings};
use futures::StreamExt as _;
use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::rand::{SecureRandom as _, SystemRandom};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use zeroize::Zeroizing;

/// The file under the data dir holding the keyring when `--credentials-key-file` is absent.
pub const KEYRING_FILE: &str = "credentials.keys";

/// Bytes of a key (AES-256).
const KEY_BYTES: usize = 32;

/// Longest key id.
const KID_MAX_CHARS: usize = 64;

/// Associated-data prefixes: a format version and what is sealed.
const AAD_DEK: &str = "fleet.credentials.v1.dek";
const AAD_VALUE: &str = "fleet.credentials.v1.value";

/// Why a credentials operation failed. No variant carries a credential value or key material.
#[derive(Debug, thiserror::Error)]
pub enum CredentialError {
    /// A bad user, tool id, name or value (the message names which, never the value).
    #[error("{0}")]
    Invalid(String),
    /// The keyring file is missing, unreadable or malformed.
    #[error("credentials keyring {path}: {reason}")]
    Keyring {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A record is wrapped with a key id the keyring does not hold.
    #[error("the credentials of user {user:?} are wrapped with key {kid:?}, which the keyring does not hold")]
    UnknownKey {
        /// The user.
        user: String,
        /// The key id.
        kid: String,
    },
    /// A ciphertext did not open (wrong key, or tampered).
    #[error("the credentials of user {user:?} do not open with key {kid:?} (wrong key or tampered record)")]
    Tampered {
        /// The user.
        user: String,
        /// The key id.
        kid: String,
    },
    /// The user's record would exceed its cap.
    #[error("the credentials of one user are capped at {max} bytes stored")]
    TooLarge {
        /// The cap.
        max: usize,
    },
    /// JetStream failed.
    #[error("credentials store: {0}")]
    Store(String),
}

impl CredentialError {
    /// The operator API's error.
    pub fn to_api_error(&self) -> ApiError {
        match self {
            CredentialError::Invalid(_) | CredentialError::TooLarge { .. } => {
                ApiError::new(ApiErrorCode::InvalidArg, self.to_string())
            }
            _ => ApiError::new(ApiErrorCode::InternalError, self.to_string()),
        }
    }
}

impl From<StoreError> for CredentialError {
    fn from(e: StoreError) -> CredentialError {
        match e {
            StoreError::TooLarge { .. } => CredentialError::TooLarge {
                max: CREDENTIALS_RECORD_MAX_BYTES,
            },
            other => CredentialError::Store(other.to_string()),
        }
    }
}

// -------------------------------------------------------------------------------------------------------------
// The envelope

pub(crate) fn random_bytes<const N: usize>() -> [u8; N] {
    let mut out = [0u8; N];
    // The system's CSPRNG; it fails only where no such source exists, which no supported platform lacks.
    SystemRandom::new()
        .fill(&mut out)
        .unwrap_or_else(|_| out = rand::random());
    out
}

/// An AES-256-GCM key (a key-encryption key of the keyring, or a record's data key).
#[derive(Clone)]
pub struct SealKey(Arc<LessSafeKey>);

impl std::fmt::Debug for SealKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SealKey(<redacted>)")
    }
}

/// A ciphertext did not open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the ciphertext does not open with this key (wrong key, wrong place, or tampered)")]
pub struct OpenError;

impl SealKey {
    /// A key from its 32 bytes.
    pub fn new(bytes: &[u8; KEY_BYTES]) -> SealKey {
        // AES-256 accepts exactly 32 bytes, which the type guarantees.
        let unbound = UnboundKey::new(&AES_256_GCM, bytes).unwrap_or_else(|_| unreachable!("32-byte key"));
        SealKey(Arc::new(LessSafeKey::new(unbound)))
    }

    /// Seals `plain` for the place `aad`: base64 of nonce ‖ ciphertext ‖ tag.
    pub fn seal(&self, aad: &[u8], plain: &[u8]) -> String {
        let nonce = random_bytes::<NONCE_LEN>();
        let mut buf = Zeroizing::new(plain.to_vec());
        // Sealing fails only for inputs beyond GCM's 64 GiB limit (every input here is capped far below); should
        // it ever fail, the plaintext is dropped and the result is a nonce alone, which never opens.
        if self
            .0
            .seal_in_place_append_tag(Nonce::assume_unique_for_key(nonce), Aad::from(aad), &mut *buf)
            .is_err()
        {
            buf.clear();
        }
        let mut out = Vec::with_capacity(NONCE_LEN + buf.len());
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&buf);
        B64.encode(out)
    }

    /// Opens what [`SealKey::seal`] sealed for the same `aad`.
    pub fn open(&self, aad: &[u8], sealed: &str) -> Result<Zeroizing<Vec<u8>>, OpenError> {
        let bytes = B64.decode(sealed).map_err(|_| OpenError)?;
        if bytes.len() < NONCE_LEN + AES_256_GCM.tag_len() {
            return Err(OpenError);
        }
        let (nonce, rest) = bytes.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| OpenError)?;
        let mut buf = Zeroizing::new(rest.to_vec());
        let len = self
            .0
            .open_in_place(nonce, Aad::from(aad), &mut buf)
            .map_err(|_| OpenError)?
            .len();
        buf.truncate(len);
        Ok(buf)
    }
}

fn tampered(user: &str, kid: &str) -> CredentialError {
    CredentialError::Tampered {
        user: user.to_owned(),
        kid: kid.to_owned(),
    }
}

/// A fresh random data key, and it wrapped for the place `aad` by the keyring's wrapping key: (the wrapping
/// key's id, the wrapped key, the key). Every sealed record of a user (its credentials, its OAuth accounts)
/// carries one.
pub(crate) fn new_data_key(keyring: &Keyring, aad: &[u8]) -> (String, String, SealKey) {
    let dek = Zeroizing::new(random_bytes::<KEY_BYTES>());
    let (kid, kek) = keyring.wrapping();
    let wrapped = kek.seal(aad, &*dek);
    (kid, wrapped, SealKey::new(&dek))
}

/// A record's data key as stored: wrapped by the keyring key `kid`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WrappedKey<'a> {
    /// The id of the keyring key that wrapped it.
    pub kid: &'a str,
    /// base64 of the sealed key.
    pub wrapped: &'a str,
}

impl WrappedKey<'_> {
    /// The key, unwrapped for the place `aad` of `user`'s record (errors name the user and the key id).
    pub(crate) fn open(&self, keyring: &Keyring, aad: &[u8], user: &str) -> Result<SealKey, CredentialError> {
        let raw = self.raw(keyring, aad, user)?;
        let bytes: &[u8; KEY_BYTES] = raw.as_slice().try_into().map_err(|_| tampered(user, self.kid))?;
        Ok(SealKey::new(bytes))
    }

    fn raw(&self, keyring: &Keyring, aad: &[u8], user: &str) -> Result<Zeroizing<Vec<u8>>, CredentialError> {
        let kek = keyring.key(self.kid).ok_or_else(|| CredentialError::UnknownKey {
            user: user.to_owned(),
            kid: self.kid.to_owned(),
        })?;
        kek.open(aad, self.wrapped).map_err(|_| tampered(user, self.kid))
    }

    /// The key wrapped again by the keyring's wrapping key, as (its id, the wrapped key); `None` when it already
    /// is.
    pub(crate) fn rewrap(
        &self,
        keyring: &Keyring,
        aad: &[u8],
        user: &str,
    ) -> Result<Option<(String, String)>, CredentialError> {
        let (kid, kek) = keyring.wrapping();
        if kid == self.kid {
            return Ok(None);
        }
        let raw = self.raw(keyring, aad, user)?;
        Ok(Some((kid, kek.seal(aad, &raw))))
    }
}

fn dek_aad(user: &str) -> Vec<u8> {
    format!("{AAD_DEK}\0{user}").into_bytes()
}

fn value_aad(user: &str, tool_id: Option<&str>, name: &str) -> Vec<u8> {
    // A tool id is never empty, so "" is unambiguous for the user-wide scope.
    format!("{AAD_VALUE}\0{user}\0{}\0{name}", tool_id.unwrap_or_default()).into_bytes()
}

// -------------------------------------------------------------------------------------------------------------
// The keyring

/// The operator's key-encryption keys: the first wraps, every one unwraps. Loaded from a file and re-read when
/// it changed at any use (see the module docs), or fixed ([`Keyring::fixed`], tests).
#[derive(Debug, Clone)]
pub struct Keyring {
    path: Option<PathBuf>,
    loaded: Arc<Mutex<Loaded>>,
}

#[derive(Debug, Clone)]
struct Loaded {
    /// (kid, key), the wrapping key first.
    keys: Vec<(String, SealKey)>,
    /// The file's modification time and size when read.
    stamp: Option<(SystemTime, u64)>,
}

fn keyring_err(path: &Path, reason: impl Into<String>) -> CredentialError {
    CredentialError::Keyring {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

fn stamp_of(path: &Path) -> Option<(SystemTime, u64)> {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}

fn valid_kid(kid: &str) -> bool {
    !kid.is_empty()
        && kid.len() <= KID_MAX_CHARS
        && kid
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
}

/// Parses keyring text: `<kid> <64 hex digits>` per line; blank lines and `#` comments ignored.
fn parse_keyring(path: &Path, text: &str) -> Result<Vec<(String, SealKey)>, CredentialError> {
    let mut keys: Vec<(String, SealKey)> = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bad = |what: &str| keyring_err(path, format!("line {}: {what}", n + 1));
        let mut parts = line.split_whitespace();
        let (Some(kid), Some(hex_key), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(bad("expected `<key id> <64 hex digits>`"));
        };
        if !valid_kid(kid) {
            return Err(bad("a key id is 1–64 of [A-Za-z0-9._-]"));
        }
        let mut bytes = Zeroizing::new([0u8; KEY_BYTES]);
        hex::decode_to_slice(hex_key, &mut *bytes).map_err(|_| bad("the key is not 64 hex digits"))?;
        if keys.iter().any(|(k, _)| k == kid) {
            return Err(bad("a key id appears twice"));
        }
        keys.push((kid.to_owned(), SealKey::new(&bytes)));
    }
    if keys.is_empty() {
        return Err(keyring_err(path, "no key"));
    }
    Ok(keys)
}

fn new_key_line() -> (String, String) {
    let kid = format!("k{}-{}", now_ms() / 1000, hex::encode(random_bytes::<3>()));
    let key = Zeroizing::new(hex::encode(random_bytes::<KEY_BYTES>()));
    let line = format!("{kid} {}\n", key.as_str());
    (kid, line)
}

const KEYRING_HEADER: &str = "# Cloud Agents credentials keyring: `<key id> <64 hex digits>` per line. The first key \
                              wraps, every key unwraps.\n# Rotate: `fleet credentials rotate-key`, then `fleet \
                              credentials rewrap`; drop old lines only after the rewrap.\n";

/// Writes `text` to `path` atomically and durably with mode 0600 ([`fleet_client::private_file::write_atomic`]).
fn write_private(path: &Path, text: &str) -> Result<(), CredentialError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| keyring_err(path, e.to_string()))?;
    fleet_client::private_file::write_atomic(path, text.as_bytes())
        .map_err(|e| keyring_err(path, e.to_string()))
}

/// Prepends a new random key to the keyring file (created with mode 0600 when absent): it wraps from now on;
/// the old keys still unwrap. Returns the new key id.
pub fn rotate_key_file(path: &Path) -> Result<String, CredentialError> {
    let old = match std::fs::read_to_string(path) {
        Ok(text) => {
            parse_keyring(path, &text)?;
            text.lines()
                .filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
                .map(|l| format!("{l}\n"))
                .collect::<String>()
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(keyring_err(path, e.to_string())),
    };
    let (kid, line) = new_key_line();
    let text = Zeroizing::new(format!("{KEYRING_HEADER}{line}{old}"));
    write_private(path, &text)?;
    Ok(kid)
}

impl Keyring {
    /// Reads the keyring file.
    pub fn load(path: &Path) -> Result<Keyring, CredentialError> {
        let loaded = Self::read(path)?;
        Ok(Keyring {
            path: Some(path.to_path_buf()),
            loaded: Arc::new(Mutex::new(loaded)),
        })
    }

    /// Reads the keyring file, creating it with one new key (mode 0600) when absent (`fleet up`'s data dir).
    pub fn load_or_create(path: &Path) -> Result<Keyring, CredentialError> {
        if !path.exists() {
            rotate_key_file(path)?;
        }
        Self::load(path)
    }

    /// A keyring of these keys (at least one: the first wraps), never re-read (tests).
    pub fn fixed(keys: &[(&str, [u8; KEY_BYTES])]) -> Keyring {
        Keyring {
            path: None,
            loaded: Arc::new(Mutex::new(Loaded {
                keys: keys
                    .iter()
                    .map(|(kid, k)| ((*kid).to_owned(), SealKey::new(k)))
                    .collect(),
                stamp: None,
            })),
        }
    }

    fn read(path: &Path) -> Result<Loaded, CredentialError> {
        let stamp = stamp_of(path);
        let text =
            Zeroizing::new(std::fs::read_to_string(path).map_err(|e| keyring_err(path, e.to_string()))?);
        Ok(Loaded {
            keys: parse_keyring(path, &text)?,
            stamp,
        })
    }

    /// Re-reads the file when it changed since it was read. A file that became unreadable or malformed keeps
    /// the keys already loaded (and the next call tries again).
    fn refresh(&self) {
        let Some(path) = &self.path else { return };
        let now = stamp_of(path);
        let current = lock(&self.loaded).stamp;
        if now.is_none() || now == current {
            return;
        }
        match Self::read(path) {
            Ok(loaded) => *lock(&self.loaded) = loaded,
            Err(e) => {
                tracing::warn!(error = %e, "credentials keyring changed but cannot be read; keeping the keys loaded")
            }
        }
    }

    /// The wrapping key and its id (the file's first line, as of now).
    pub fn wrapping(&self) -> (String, SealKey) {
        self.refresh();
        let loaded = lock(&self.loaded);
        // A keyring always holds at least one key (parse_keyring refuses an empty one).
        loaded.keys[0].clone()
    }

    /// The key `kid`, as the file holds it now (a key removed from the file no longer opens anything).
    pub fn key(&self, kid: &str) -> Option<SealKey> {
        self.refresh();
        lock(&self.loaded)
            .keys
            .iter()
            .find(|(k, _)| k == kid)
            .map(|(_, key)| key.clone())
    }

    /// The key ids, the wrapping one first.
    pub fn key_ids(&self) -> Vec<String> {
        lock(&self.loaded).keys.iter().map(|(k, _)| k.clone()).collect()
    }
}

// -------------------------------------------------------------------------------------------------------------
// The record

/// One sealed value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SealedValue {
    /// base64 of nonce ‖ ciphertext ‖ tag, under the record's data key.
    pub sealed: String,
    /// Last set, Unix ms.
    pub updated_at_ms: u64,
}

/// One user's credentials, as stored in `<prefix>_credentials` under the user's key.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// The user.
    pub user: String,
    /// The id of the keyring key that wrapped [`Record::data_key`].
    pub kid: String,
    /// The data key, sealed under key `kid` for this user.
    pub data_key: String,
    /// User-wide values, by name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub user_values: BTreeMap<String, SealedValue>,
    /// Per-plugin values: tool id → name → value.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tool_values: BTreeMap<String, BTreeMap<String, SealedValue>>,
    /// Last change, Unix ms.
    #[serde(default)]
    pub updated_at_ms: u64,
    /// Fields this version does not know, kept as they are.
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

impl Record {
    fn is_empty(&self) -> bool {
        self.user_values.is_empty() && self.tool_values.is_empty() && self.rest.is_empty()
    }

    /// The data key, unwrapped with the keyring.
    fn data_key(&self, keyring: &Keyring) -> Result<SealKey, CredentialError> {
        self.wrapped().open(keyring, &dek_aad(&self.user), &self.user)
    }

    fn wrapped(&self) -> WrappedKey<'_> {
        WrappedKey {
            kid: &self.kid,
            wrapped: &self.data_key,
        }
    }

    fn tampered(&self) -> CredentialError {
        tampered(&self.user, &self.kid)
    }

    /// A new, empty record with a fresh data key wrapped by the keyring's wrapping key.
    fn new(user: &str, keyring: &Keyring) -> (Record, SealKey) {
        let (kid, data_key, dek) = new_data_key(keyring, &dek_aad(user));
        let record = Record {
            user: user.to_owned(),
            kid,
            data_key,
            ..Record::default()
        };
        (record, dek)
    }

    /// Wraps the data key again under the keyring's wrapping key; `false` when it already was.
    fn rewrap(&mut self, keyring: &Keyring) -> Result<bool, CredentialError> {
        let Some((kid, data_key)) = self.wrapped().rewrap(keyring, &dek_aad(&self.user), &self.user)? else {
            return Ok(false);
        };
        (self.kid, self.data_key) = (kid, data_key);
        Ok(true)
    }

    fn scope_mut(&mut self, tool_id: Option<&str>) -> &mut BTreeMap<String, SealedValue> {
        match tool_id {
            None => &mut self.user_values,
            Some(t) => self.tool_values.entry(t.to_owned()).or_default(),
        }
    }

    fn entries(&self, tool_id: Option<&str>) -> Vec<Entry> {
        let mut out: Vec<Entry> = self
            .user_values
            .iter()
            .map(|(name, v)| Entry {
                name: name.clone(),
                scope: Scope::User,
                tool_id: None,
                updated_at_ms: v.updated_at_ms,
            })
            .collect();
        for (tool, values) in &self.tool_values {
            if tool_id.is_some_and(|t| t != tool) {
                continue;
            }
            out.extend(values.iter().map(|(name, v)| Entry {
                name: name.clone(),
                scope: Scope::Tool,
                tool_id: Some(tool.clone()),
                updated_at_ms: v.updated_at_ms,
            }));
        }
        out
    }
}

// -------------------------------------------------------------------------------------------------------------
// Validation

pub(crate) fn check_user(user: &str) -> Result<(), CredentialError> {
    if user.is_empty() || user.len() > 256 || user.chars().any(char::is_control) {
        return Err(CredentialError::Invalid(
            "user must be 1–256 characters without control characters".into(),
        ));
    }
    Ok(())
}

pub(crate) fn check_tool(tool_id: Option<&str>) -> Result<(), CredentialError> {
    match tool_id {
        Some(t) if t.is_empty() || t.len() > 128 || t.chars().any(char::is_control) => Err(
            CredentialError::Invalid("tool_id must be 1–128 characters without control characters".into()),
        ),
        _ => Ok(()),
    }
}

/// Whether `name` is a credential name: `[A-Za-z_][A-Za-z0-9_]*`, at most [`NAME_MAX_CHARS`].
pub fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    name.len() <= NAME_MAX_CHARS
        && chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn check_names<'a>(names: impl ExactSizeIterator<Item = &'a String>) -> Result<(), CredentialError> {
    if names.len() == 0 || names.len() > NAMES_PER_CALL_MAX {
        return Err(CredentialError::Invalid(format!(
            "give 1–{NAMES_PER_CALL_MAX} credential names"
        )));
    }
    for name in names {
        if !valid_name(name) {
            // The name is not a secret; still, only a bounded, printable prefix of it is shown.
            let shown: String = name.chars().filter(|c| !c.is_control()).take(64).collect();
            return Err(CredentialError::Invalid(format!(
                "credential name {shown:?} is not [A-Za-z_][A-Za-z0-9_]* of at most {NAME_MAX_CHARS} characters"
            )));
        }
    }
    Ok(())
}

// -------------------------------------------------------------------------------------------------------------
// The store

/// A bucket of one sealed record per user under the user's key (`<prefix>_credentials`,
/// `<prefix>_oauth_accounts`): reads that ride out a store that does not answer, compare-and-set edits, and the
/// rewrap of every record.
#[derive(Debug, Clone)]
pub(crate) struct UserRecords {
    kv: kv::Store,
    read_op: Op,
    edit_op: Op,
    /// What a record is and its largest size.
    limit: (&'static str, usize),
}

impl UserRecords {
    /// Creates (or updates to `config`, or attaches to) the bucket.
    pub(crate) async fn open(
        js: &jetstream::Context,
        config: kv::Config,
        settings: &StoreSettings,
        (read_op, edit_op): (Op, Op),
        limit: (&'static str, usize),
    ) -> Result<UserRecords, CredentialError> {
        let kv = store::open_kv(js, config, settings.provision).await?;
        Ok(UserRecords {
            kv,
            read_op,
            edit_op,
            limit,
        })
    }

    /// The user's record; a store that does not answer (a NATS node lost, the bucket electing a leader) is asked
    /// again until `give_up`.
    pub(crate) async fn read<T: serde::de::DeserializeOwned>(
        &self,
        user: &str,
        give_up: tokio::time::Instant,
    ) -> Result<Option<Revisioned<T>>, CredentialError> {
        let key = user_key(user);
        Ok(fleet_store::failover::ride_out(
            self.read_op,
            give_up,
            || store::read(&self.kv, &key, self.read_op),
            |_| {},
        )
        .await?)
    }

    /// A compare-and-set edit of the user's record: `decide` sees it (absent: `None`) and says what to write.
    pub(crate) async fn edit<T, R, E>(
        &self,
        user: &str,
        mut decide: impl FnMut(Option<T>) -> Result<Edit<T, R>, E>,
    ) -> Result<R, E>
    where
        T: Serialize + serde::de::DeserializeOwned,
        E: From<fleet_store::StoreError>,
    {
        let key = user_key(user);
        let target = Target {
            kv: &self.kv,
            key: &key,
            op: self.edit_op,
            limit: self.limit,
        };
        let committed = compare_and_set(target, None, |current: Option<Revisioned<T>>| {
            decide(current.map(|r| r.value))
        })
        .await?;
        Ok(committed.out)
    }

    /// Runs `rewrap` (which answers whether it changed the record) on every record, each by compare-and-set;
    /// answers (records seen, records rewrapped).
    pub(crate) async fn rewrap<T>(
        &self,
        mut rewrap: impl FnMut(&mut T) -> Result<bool, CredentialError>,
    ) -> Result<(u64, u64), CredentialError>
    where
        T: Serialize + serde::de::DeserializeOwned,
    {
        let mut keys = self
            .kv
            .keys()
            .await
            .map_err(|e| CredentialError::Store(e.to_string()))?;
        let mut all = Vec::new();
        while let Some(key) = keys.next().await {
            all.push(key.map_err(|e| CredentialError::Store(e.to_string()))?);
        }
        let (mut records, mut rewrapped) = (0, 0);
        for key in all {
            let target = Target {
                kv: &self.kv,
                key: &key,
                op: self.edit_op,
                limit: self.limit,
            };
            let changed = compare_and_set(target, None, |current: Option<Revisioned<T>>| {
                let Some(mut record) = current.map(|r| r.value) else {
                    return Ok(Edit::Keep(None));
                };
                Ok::<_, CredentialError>(if rewrap(&mut record)? {
                    Edit::Write(record, Some(true))
                } else {
                    Edit::Keep(Some(false))
                })
            })
            .await?
            .out;
            if let Some(changed) = changed {
                records += 1;
                rewrapped += u64::from(changed);
            }
        }
        Ok((records, rewrapped))
    }
}

/// The credentials bucket and the keyring that seals it.
#[derive(Debug, Clone)]
pub struct CredentialStore {
    records: UserRecords,
    keyring: Keyring,
}

impl CredentialStore {
    /// Creates (or updates to these settings, or attaches to) `<prefix>_credentials`.
    pub async fn open(
        js: &jetstream::Context,
        settings: &StoreSettings,
        keyring: Keyring,
    ) -> Result<CredentialStore, CredentialError> {
        let records = UserRecords::open(
            js,
            settings.credentials_kv_config(),
            settings,
            (Op::ReadCredentials, Op::EditCredentials),
            ("credentials record", CREDENTIALS_RECORD_MAX_BYTES),
        )
        .await?;
        Ok(CredentialStore { records, keyring })
    }

    /// The keyring.
    pub fn keyring(&self) -> &Keyring {
        &self.keyring
    }

    /// The user's record; a store that does not answer (a NATS node lost, the bucket electing a leader) is asked
    /// again for up to `STORE_FAILOVER_WAIT` ([`fleet_store::failover`]).
    async fn read(&self, user: &str) -> Result<Option<Revisioned<Record>>, CredentialError> {
        self.read_until(user, fleet_store::failover::give_up_at(None))
            .await
    }

    /// [`Self::read`], asked again until `give_up`.
    async fn read_until(
        &self,
        user: &str,
        give_up: tokio::time::Instant,
    ) -> Result<Option<Revisioned<Record>>, CredentialError> {
        self.records.read(user, give_up).await
    }

    async fn edit<R>(
        &self,
        user: &str,
        decide: impl FnMut(Option<Record>) -> Result<Edit<Record, R>, CredentialError>,
    ) -> Result<R, CredentialError> {
        self.records.edit(user, decide).await
    }

    /// Stores `values` in one scope (the plugin's when `tool_id` is given, else user-wide); answers the names
    /// now stored in that scope.
    pub async fn set(
        &self,
        user: &str,
        tool_id: Option<&str>,
        values: &BTreeMap<String, String>,
    ) -> Result<Listed, CredentialError> {
        check_user(user)?;
        check_tool(tool_id)?;
        check_names(values.keys())?;
        if let Some((name, _)) = values.iter().find(|(_, v)| v.len() > VALUE_MAX_BYTES) {
            return Err(CredentialError::Invalid(format!(
                "the value of {name} is longer than {VALUE_MAX_BYTES} bytes"
            )));
        }
        let keyring = &self.keyring;
        self.edit(user, |current| {
            let (mut record, dek) = match current {
                Some(r) => {
                    let dek = r.data_key(keyring)?;
                    (r, dek)
                }
                None => Record::new(user, keyring),
            };
            let now = now_ms();
            for (name, value) in values {
                let sealed = dek.seal(&value_aad(user, tool_id, name), value.as_bytes());
                record.scope_mut(tool_id).insert(
                    name.clone(),
                    SealedValue {
                        sealed,
                        updated_at_ms: now,
                    },
                );
            }
            record.updated_at_ms = now;
            let listed = Listed {
                user: user.to_owned(),
                credentials: scoped(&record, tool_id),
            };
            Ok(Edit::Write(record, listed))
        })
        .await
    }

    /// The user's credentials (names and scopes); with `tool_id`, only the user-wide ones and that plugin's.
    pub async fn list(&self, user: &str, tool_id: Option<&str>) -> Result<Listed, CredentialError> {
        check_user(user)?;
        check_tool(tool_id)?;
        let credentials = self
            .read(user)
            .await?
            .map(|r| r.value.entries(tool_id))
            .unwrap_or_default();
        Ok(Listed {
            user: user.to_owned(),
            credentials,
        })
    }

    /// Removes `names` from one scope; answers those that were there. A record left empty is deleted.
    pub async fn delete(
        &self,
        user: &str,
        tool_id: Option<&str>,
        names: &[String],
    ) -> Result<Deleted, CredentialError> {
        check_user(user)?;
        check_tool(tool_id)?;
        check_names(names.iter())?;
        let deleted = self
            .edit(user, |current| {
                let Some(mut record) = current else {
                    return Ok(Edit::Keep(Vec::new()));
                };
                let scope = record.scope_mut(tool_id);
                let gone: Vec<String> = names
                    .iter()
                    .filter(|n| scope.remove(*n).is_some())
                    .cloned()
                    .collect();
                if let Some(t) = tool_id
                    && record.tool_values.get(t).is_some_and(BTreeMap::is_empty)
                {
                    record.tool_values.remove(t);
                }
                if gone.is_empty() {
                    return Ok(Edit::Keep(gone));
                }
                record.updated_at_ms = now_ms();
                Ok(if record.is_empty() {
                    Edit::Delete(gone)
                } else {
                    Edit::Write(record, gone)
                })
            })
            .await?;
        Ok(Deleted {
            user: user.to_owned(),
            deleted,
        })
    }

    /// The values of `names` for an invoke of `tool_id` by `user`: the plugin's value, else the user-wide one;
    /// a name with neither is absent. One KV read; nothing is cached.
    /// A store that does not answer (a NATS node lost) is asked again until `give_up` (the invoke's deadline).
    pub async fn resolve(
        &self,
        user: &str,
        tool_id: &str,
        names: &[String],
        give_up: tokio::time::Instant,
    ) -> Result<BTreeMap<String, Zeroizing<String>>, CredentialError> {
        let mut out = BTreeMap::new();
        if names.is_empty() {
            return Ok(out);
        }
        let Some(record) = self.read_until(user, give_up).await?.map(|r| r.value) else {
            return Ok(out);
        };
        if record.user != user {
            // Two users whose keys collide never share a record: this one is not `user`'s.
            return Ok(out);
        }
        let tool_values = record.tool_values.get(tool_id);
        let mut dek: Option<SealKey> = None;
        for name in names {
            let (scope, sealed) = match tool_values.and_then(|t| t.get(name)) {
                Some(v) => (Some(tool_id), v),
                None => match record.user_values.get(name) {
                    Some(v) => (None, v),
                    None => continue,
                },
            };
            let key = match &dek {
                Some(k) => k,
                None => dek.insert(record.data_key(&self.keyring)?),
            };
            let plain = key
                .open(&value_aad(user, scope, name), &sealed.sealed)
                .map_err(|_| record.tampered())?;
            let text = String::from_utf8(plain.to_vec()).map_err(|_| record.tampered())?;
            out.insert(name.clone(), Zeroizing::new(text));
        }
        Ok(out)
    }

    /// Wraps every record's data key under the keyring's wrapping key (after a rotation).
    pub async fn rewrap(&self) -> Result<Rewrapped, CredentialError> {
        let (kid, _) = self.keyring.wrapping();
        let (records, rewrapped) = self
            .records
            .rewrap(|record: &mut Record| record.rewrap(&self.keyring))
            .await?;
        Ok(Rewrapped {
            key_id: kid,
            records,
            rewrapped,
        })
    }
}

fn scoped(record: &Record, tool_id: Option<&str>) -> Vec<Entry> {
    record
        .entries(tool_id)
        .into_iter()
        .filter(|e| e.tool_id.as_deref() == tool_id)
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const K1: [u8; 32] = [1; 32];
    const K2: [u8; 32] = [2; 32];

    #[test]
    fn a_sealed_value_opens_only_with_its_key_and_its_place() {
        let key = SealKey::new(&K1);
        let sealed = key.seal(b"place", b"sk-secret");
        assert!(!sealed.contains("sk-secret"));
        assert_eq!(key.open(b"place", &sealed).unwrap().as_slice(), b"sk-secret");
        // Two seals of one value differ (random nonces).
        assert_ne!(key.seal(b"place", b"sk-secret"), sealed);
        // Wrong key, wrong place.
        assert_eq!(SealKey::new(&K2).open(b"place", &sealed), Err(OpenError));
        assert_eq!(key.open(b"other place", &sealed), Err(OpenError));
    }

    #[test]
    fn a_tampered_ciphertext_is_refused() {
        let key = SealKey::new(&K1);
        let sealed = key.seal(b"p", b"value");
        let mut bytes = B64.decode(&sealed).unwrap();
        for i in [0, NONCE_LEN, bytes.len() - 1] {
            bytes[i] ^= 1;
            assert_eq!(key.open(b"p", &B64.encode(&bytes)), Err(OpenError), "byte {i}");
            bytes[i] ^= 1;
        }
        assert_eq!(
            key.open(b"p", &B64.encode(&bytes[..NONCE_LEN + 15])),
            Err(OpenError)
        );
        assert_eq!(key.open(b"p", "not base64!"), Err(OpenError));
    }

    fn record_with(keyring: &Keyring, user: &str, name: &str, value: &str) -> Record {
        let (mut r, dek) = Record::new(user, keyring);
        r.user_values.insert(
            name.to_owned(),
            SealedValue {
                sealed: dek.seal(&value_aad(user, None, name), value.as_bytes()),
                updated_at_ms: 1,
            },
        );
        r
    }

    fn open_value(r: &Record, keyring: &Keyring, name: &str) -> Result<String, CredentialError> {
        let dek = r.data_key(keyring)?;
        let plain = dek
            .open(&value_aad(&r.user, None, name), &r.user_values[name].sealed)
            .map_err(|_| r.tampered())?;
        Ok(String::from_utf8(plain.to_vec()).unwrap())
    }

    #[test]
    fn a_record_is_bound_to_its_user_and_refuses_the_wrong_key() {
        let ring1 = Keyring::fixed(&[("k1", K1)]);
        let r = record_with(&ring1, "alice", "API_KEY", "v-alice");
        assert_eq!(open_value(&r, &ring1, "API_KEY").unwrap(), "v-alice");
        // A keyring with another key under the same id: refused, not garbage.
        let wrong = Keyring::fixed(&[("k1", K2)]);
        assert!(matches!(
            open_value(&r, &wrong, "API_KEY"),
            Err(CredentialError::Tampered { .. })
        ));
        // A keyring without the id.
        let other = Keyring::fixed(&[("k9", K1)]);
        assert!(matches!(
            open_value(&r, &other, "API_KEY"),
            Err(CredentialError::UnknownKey { .. })
        ));
        // Alice's record copied under bob's name does not open.
        let mut stolen = r.clone();
        stolen.user = "bob".into();
        assert!(open_value(&stolen, &ring1, "API_KEY").is_err());
        // A value moved to another name does not open.
        let mut moved = r.clone();
        let v = moved.user_values.remove("API_KEY").unwrap();
        moved.user_values.insert("OTHER".into(), v);
        assert!(open_value(&moved, &ring1, "OTHER").is_err());
        // No error names the value.
        let e = open_value(&stolen, &ring1, "API_KEY").unwrap_err().to_string();
        assert!(!e.contains("v-alice"), "{e}");
    }

    #[test]
    fn rotation_wraps_with_the_new_key_and_old_records_still_open_until_rewrapped() {
        let old = Keyring::fixed(&[("k1", K1)]);
        let mut r = record_with(&old, "alice", "API_KEY", "v1");
        assert_eq!(r.kid, "k1");
        // Rotated: k2 first. The old record still opens (k1 is kept) …
        let rotated = Keyring::fixed(&[("k2", K2), ("k1", K1)]);
        assert_eq!(open_value(&r, &rotated, "API_KEY").unwrap(), "v1");
        // … a new record is wrapped with k2 …
        assert_eq!(record_with(&rotated, "bob", "X", "y").kid, "k2");
        // … and the rewrap moves the old one to k2 without touching its values.
        let values = r.user_values.clone();
        assert!(r.rewrap(&rotated).unwrap());
        assert!(!r.rewrap(&rotated).unwrap(), "a second rewrap has nothing to do");
        assert_eq!(r.kid, "k2");
        assert_eq!(r.user_values, values);
        // Now k1 can go.
        let only_new = Keyring::fixed(&[("k2", K2)]);
        assert_eq!(open_value(&r, &only_new, "API_KEY").unwrap(), "v1");
    }

    #[test]
    fn the_keyring_file_rotates_and_is_private() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub").join(KEYRING_FILE);
        let ring = Keyring::load_or_create(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let first = ring.wrapping().0;
        let r = record_with(&ring, "alice", "API_KEY", "v1");
        let new = rotate_key_file(&path).unwrap();
        assert_ne!(new, first);
        // The running keyring sees the change at its next wrap, and still opens the old record.
        assert_eq!(ring.wrapping().0, new);
        assert_eq!(ring.key_ids(), vec![new.clone(), first.clone()]);
        assert_eq!(open_value(&r, &ring, "API_KEY").unwrap(), "v1");
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        // A fresh load agrees.
        assert_eq!(Keyring::load(&path).unwrap().key_ids(), vec![new, first]);
        // The old line dropped: the running keyring no longer opens the record wrapped with it.
        let text = std::fs::read_to_string(&path).unwrap();
        let newest = text.lines().find(|l| !l.starts_with('#')).unwrap().to_owned();
        std::fs::write(&path, format!("{newest}\n")).unwrap();
        assert!(matches!(
            open_value(&r, &ring, "API_KEY"),
            Err(CredentialError::UnknownKey { .. })
        ));
    }

    #[test]
    fn a_malformed_keyring_is_refused_without_echoing_key_material() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys");
        for (text, why) in [
            ("", "no key"),
            ("k1 abcd\n", "64 hex"),
            ("k1\n", "expected"),
            (
                &format!("k1 {}\nk1 {}\n", "00".repeat(32), "11".repeat(32)),
                "twice",
            ),
            (&format!("bad/id {}\n", "00".repeat(32)), "key id"),
        ] {
            std::fs::write(&path, text).unwrap();
            let e = Keyring::load(&path).unwrap_err().to_string();
            assert!(e.contains(why), "{text:?}: {e}");
            assert!(!e.contains("0000"), "{e}");
        }
        assert!(Keyring::load(&dir.path().join("absent")).is_err());
    }

    #[test]
    fn names_are_checked() {
        for ok in ["API_KEY", "_x", "a1", &"A".repeat(NAME_MAX_CHARS)] {
            assert!(valid_name(ok), "{ok}");
        }
        for bad in ["", "1A", "A-B", "A B", "É", &"A".repeat(NAME_MAX_CHARS + 1)] {
            assert!(!valid_name(bad), "{bad}");
        }
    }

    #[test]
    fn unknown_fields_of_a_record_survive() {
        let ring = Keyring::fixed(&[("k1", K1)]);
        let mut r = record_with(&ring, "alice", "A", "b");
        r.rest
            .insert("accounts".into(), serde_json::json!({"google": []}));
        let text = serde_json::to_string(&r).unwrap();
        let back: Record = serde_json::from_str(&text).unwrap();
        assert_eq!(back, r);
        assert!(!text.contains("\"b\""));
    }
}
