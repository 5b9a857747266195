//! The users' connected OAuth accounts, sealed, in the JetStream KV bucket `<prefix>_oauth_accounts`: one record
//! per user (key: the user's key) with every provider's accounts.
//!
//! The envelope is the credentials' ([`crate::credentials`]): a random per-record data key wrapped by the
//! operator's keyring (its own associated data, so it opens only as this user's accounts record), and under it,
//! AES-256-GCM, each account's refresh token and its cached access token, bound to (user, provider, account id,
//! kind) — a ciphertext moved to another account or kind does not open. No token is ever stored in plaintext;
//! metadata (e-mail, label, scopes, status) is.
//!
//! Every edit is a compare-and-set on the record's revision ([`fleet_store::cas`]), so fronts (connect, default,
//! delete) and workers (a refresh's new tokens, an account needing re-authorization) never lose each other's
//! writes.

use std::collections::BTreeMap;

use async_nats::jetstream;
use fleet_proto::executa::credentials::{Account, AccountStatus};
use fleet_proto::util::now_ms;
use fleet_store::cas::Edit;
use fleet_store::settings::OAUTH_ACCOUNTS_RECORD_MAX_BYTES;
use fleet_store::{Op, Revisioned, StoreSettings};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use zeroize::Zeroizing;

use crate::credentials::{
    CredentialError, Keyring, SealKey, UserRecords, WrappedKey, new_data_key, random_bytes,
};

/// Accounts one user may connect at one provider.
pub const ACCOUNTS_PER_PROVIDER_MAX: usize = 10;

/// Longest label.
pub const LABEL_MAX_CHARS: usize = 64;

/// Associated-data prefixes (a format version and what is sealed).
const AAD_DEK: &str = "fleet.oauth.v1.dek";
const AAD_TOKEN: &str = "fleet.oauth.v1.token";

fn dek_aad(user: &str) -> Vec<u8> {
    format!("{AAD_DEK}\0{user}").into_bytes()
}

/// What a sealed token is (part of its associated data).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Refresh,
    Access,
}

fn token_aad(user: &str, provider: &str, account_id: &str, kind: Kind) -> Vec<u8> {
    let kind = match kind {
        Kind::Refresh => "refresh",
        Kind::Access => "access",
    };
    format!("{AAD_TOKEN}\0{user}\0{provider}\0{account_id}\0{kind}").into_bytes()
}

/// A cached access token, sealed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SealedAccess {
    pub(crate) sealed: String,
    /// When it expires, Unix ms.
    pub(crate) expires_at_ms: u64,
}

/// One account as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct StoredAccount {
    pub(crate) account_id: String,
    /// The provider's id of the account (`sub`), when known: connecting the same identity again updates this
    /// account rather than adding one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) subject: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) email: Option<String>,
    pub(crate) label: String,
    pub(crate) is_default: bool,
    pub(crate) status: AccountStatus,
    #[serde(default)]
    pub(crate) scopes: Vec<String>,
    /// The refresh token, sealed; absent when the provider gave none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) refresh_token: Option<String>,
    /// The last access token, sealed, so that another process can use it until it expires.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) access_token: Option<SealedAccess>,
    pub(crate) connected_at_ms: u64,
    pub(crate) updated_at_ms: u64,
}

impl StoredAccount {
    /// The metadata a user and a plugin may see.
    pub(crate) fn public(&self) -> Account {
        Account {
            account_id: self.account_id.clone(),
            email: self.email.clone(),
            label: self.label.clone(),
            is_default: self.is_default,
            status: self.status,
            scopes: self.scopes.clone(),
        }
    }
}

/// One user's accounts, as stored under the user's key.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct AccountsRecord {
    pub(crate) user: String,
    /// The id of the keyring key that wrapped [`AccountsRecord::data_key`].
    pub(crate) kid: String,
    /// The data key, sealed under key `kid` for this user.
    pub(crate) data_key: String,
    /// Provider → its accounts (the default first once listed).
    #[serde(default)]
    pub(crate) providers: BTreeMap<String, Vec<StoredAccount>>,
    #[serde(default)]
    pub(crate) updated_at_ms: u64,
    /// Fields this version does not know, kept as they are.
    #[serde(flatten)]
    pub(crate) rest: Map<String, Value>,
}

impl AccountsRecord {
    fn new(user: &str, keyring: &Keyring) -> (AccountsRecord, SealKey) {
        let (kid, data_key, dek) = new_data_key(keyring, &dek_aad(user));
        (
            AccountsRecord {
                user: user.to_owned(),
                kid,
                data_key,
                ..AccountsRecord::default()
            },
            dek,
        )
    }

    fn wrapped(&self) -> WrappedKey<'_> {
        WrappedKey {
            kid: &self.kid,
            wrapped: &self.data_key,
        }
    }

    /// The data key, unwrapped with the keyring.
    pub(crate) fn data_key(&self, keyring: &Keyring) -> Result<SealKey, CredentialError> {
        self.wrapped().open(keyring, &dek_aad(&self.user), &self.user)
    }

    fn rewrap(&mut self, keyring: &Keyring) -> Result<bool, CredentialError> {
        let Some((kid, data_key)) = self.wrapped().rewrap(keyring, &dek_aad(&self.user), &self.user)? else {
            return Ok(false);
        };
        (self.kid, self.data_key) = (kid, data_key);
        Ok(true)
    }

    /// The accounts at `provider` (none: empty).
    pub(crate) fn accounts(&self, provider: &str) -> &[StoredAccount] {
        self.providers.get(provider).map_or(&[], Vec::as_slice)
    }

    /// The account `account_id` at `provider`, else (no id) the default one.
    pub(crate) fn pick(&self, provider: &str, account_id: Option<&str>) -> Option<&StoredAccount> {
        let accounts = self.accounts(provider);
        match account_id {
            Some(id) => accounts.iter().find(|a| a.account_id == id),
            None => accounts
                .iter()
                .find(|a| a.is_default)
                .or_else(|| accounts.first()),
        }
    }

    fn account_mut(&mut self, provider: &str, account_id: &str) -> Option<&mut StoredAccount> {
        self.providers
            .get_mut(provider)?
            .iter_mut()
            .find(|a| a.account_id == account_id)
    }

    /// Opens a sealed token of an account.
    pub(crate) fn open(
        &self,
        dek: &SealKey,
        provider: &str,
        account_id: &str,
        kind: Kind,
        sealed: &str,
    ) -> Result<Zeroizing<String>, CredentialError> {
        let plain = dek
            .open(&token_aad(&self.user, provider, account_id, kind), sealed)
            .map_err(|_| self.tampered())?;
        String::from_utf8(plain.to_vec())
            .map(Zeroizing::new)
            .map_err(|_| self.tampered())
    }

    fn tampered(&self) -> CredentialError {
        CredentialError::Tampered {
            user: self.user.clone(),
            kid: self.kid.clone(),
        }
    }
}

fn seal(dek: &SealKey, user: &str, provider: &str, account_id: &str, kind: Kind, token: &str) -> String {
    dek.seal(&token_aad(user, provider, account_id, kind), token.as_bytes())
}

/// An account's new tokens, from a code exchange or a refresh.
pub(crate) struct Tokens<'a> {
    pub(crate) access_token: &'a str,
    pub(crate) expires_at_ms: u64,
    /// A new refresh token; `None` keeps the one stored (a provider that does not rotate them).
    pub(crate) refresh_token: Option<&'a str>,
    pub(crate) scopes: Option<Vec<String>>,
}

/// A newly connected account.
pub(crate) struct Connect<'a> {
    pub(crate) provider: &'a str,
    pub(crate) subject: Option<String>,
    pub(crate) email: Option<String>,
    pub(crate) label: Option<String>,
    pub(crate) make_default: bool,
    pub(crate) tokens: Tokens<'a>,
}

/// Why an account edit was refused.
#[derive(Debug, thiserror::Error)]
pub(crate) enum EditError {
    /// No such account.
    #[error("no account {0:?} at this provider")]
    UnknownAccount(String),
    /// The user has [`ACCOUNTS_PER_PROVIDER_MAX`] accounts there already.
    #[error("at most {ACCOUNTS_PER_PROVIDER_MAX} accounts per provider")]
    TooMany,
    /// The store or the keyring.
    #[error(transparent)]
    Credentials(#[from] CredentialError),
}

impl From<fleet_store::StoreError> for EditError {
    fn from(e: fleet_store::StoreError) -> Self {
        EditError::Credentials(e.into())
    }
}

/// The accounts bucket and the keyring that seals it.
#[derive(Debug, Clone)]
pub struct AccountStore {
    records: UserRecords,
    keyring: Keyring,
}

fn new_account_id() -> String {
    format!("acc_{}", hex::encode(random_bytes::<8>()))
}

/// Whether `id` has the form of an account id.
pub(crate) fn valid_account_id(id: &str) -> bool {
    id.len() == 20 && id.starts_with("acc_") && id[4..].bytes().all(|b| b.is_ascii_hexdigit())
}

impl AccountStore {
    /// Creates (or updates to these settings, or attaches to) `<prefix>_oauth_accounts`.
    pub async fn open(
        js: &jetstream::Context,
        settings: &StoreSettings,
        keyring: Keyring,
    ) -> Result<AccountStore, CredentialError> {
        let records = UserRecords::open(
            js,
            settings.oauth_accounts_kv_config(),
            settings,
            (Op::ReadAccounts, Op::EditAccounts),
            ("OAuth accounts record", OAUTH_ACCOUNTS_RECORD_MAX_BYTES),
        )
        .await?;
        Ok(AccountStore { records, keyring })
    }

    /// The keyring.
    pub(crate) fn keyring(&self) -> &Keyring {
        &self.keyring
    }

    /// The user's record, asked again until `give_up` while the store does not answer.
    pub(crate) async fn read(
        &self,
        user: &str,
        give_up: tokio::time::Instant,
    ) -> Result<Option<AccountsRecord>, CredentialError> {
        let record: Option<Revisioned<AccountsRecord>> = self.records.read(user, give_up).await?;
        // Two users whose keys collide never share a record.
        Ok(record.map(|r| r.value).filter(|r| r.user == user))
    }

    async fn edit<R>(
        &self,
        user: &str,
        mut decide: impl FnMut(Option<AccountsRecord>) -> Result<Edit<AccountsRecord, R>, EditError>,
    ) -> Result<R, EditError> {
        self.records
            .edit(user, |current: Option<AccountsRecord>| {
                decide(current.filter(|r| r.user == user))
            })
            .await
    }

    /// Stores a connected account: a new one, or — same provider identity (`subject`) — the existing one with
    /// its new tokens. The first account of a provider is its default; `make_default` makes this one the
    /// default. Answers the account.
    pub(crate) async fn connect(&self, user: &str, c: Connect<'_>) -> Result<Account, EditError> {
        let keyring = &self.keyring;
        self.edit(user, |current| {
            let (mut record, dek) = match current {
                Some(r) => {
                    let dek = r.data_key(keyring)?;
                    (r, dek)
                }
                None => AccountsRecord::new(user, keyring),
            };
            let now = now_ms();
            let accounts = record.providers.entry(c.provider.to_owned()).or_default();
            let existing = c
                .subject
                .as_ref()
                .and_then(|s| accounts.iter().position(|a| a.subject.as_ref() == Some(s)));
            let index = match existing {
                Some(i) => i,
                None => {
                    if accounts.len() >= ACCOUNTS_PER_PROVIDER_MAX {
                        return Err(EditError::TooMany);
                    }
                    accounts.push(StoredAccount {
                        account_id: new_account_id(),
                        subject: c.subject.clone(),
                        email: None,
                        label: String::new(),
                        is_default: accounts.is_empty(),
                        status: AccountStatus::Active,
                        scopes: Vec::new(),
                        refresh_token: None,
                        access_token: None,
                        connected_at_ms: now,
                        updated_at_ms: now,
                    });
                    accounts.len() - 1
                }
            };
            if c.make_default {
                for a in accounts.iter_mut() {
                    a.is_default = false;
                }
            }
            let account = &mut accounts[index];
            account.is_default |= c.make_default;
            account.email = c.email.clone().or(account.email.take());
            account.label = c
                .label
                .clone()
                .or_else(|| (!account.label.is_empty()).then(|| account.label.clone()))
                .or_else(|| account.email.clone())
                .unwrap_or_else(|| c.provider.to_owned());
            account.connected_at_ms = now;
            let id = account.account_id.clone();
            apply_tokens(account, &dek, user, c.provider, &id, &c.tokens, now);
            let public = account.public();
            record.updated_at_ms = now;
            Ok(Edit::Write(record, public))
        })
        .await
    }

    /// Records a refresh's new tokens on the account (it stays where it is if it was removed meanwhile: `None`).
    pub(crate) async fn refreshed(
        &self,
        user: &str,
        provider: &str,
        account_id: &str,
        tokens: &Tokens<'_>,
    ) -> Result<(), EditError> {
        let keyring = &self.keyring;
        self.edit(user, |current| {
            let Some(mut record) = current else {
                return Ok(Edit::Keep(()));
            };
            let dek = record.data_key(keyring)?;
            let now = now_ms();
            let user_ = record.user.clone();
            let Some(account) = record.account_mut(provider, account_id) else {
                return Ok(Edit::Keep(()));
            };
            apply_tokens(account, &dek, &user_, provider, account_id, tokens, now);
            record.updated_at_ms = now;
            Ok(Edit::Write(record, ()))
        })
        .await
    }

    /// Marks the account as needing re-authorization (the provider refused its refresh token) and forgets its
    /// tokens, unless it changed after `since_ms` (another process refreshed it, or the user connected it again:
    /// a new refresh token already replaced the one that failed). Answers whether it marked it.
    pub(crate) async fn needs_reauth(
        &self,
        user: &str,
        provider: &str,
        account_id: &str,
        since_ms: u64,
    ) -> Result<bool, EditError> {
        self.edit(user, |current| {
            let Some(mut record) = current else {
                return Ok(Edit::Keep(true));
            };
            let Some(account) = record.account_mut(provider, account_id) else {
                return Ok(Edit::Keep(true));
            };
            if account.updated_at_ms > since_ms {
                return Ok(Edit::Keep(false));
            }
            account.status = AccountStatus::NeedsReauth;
            account.refresh_token = None;
            account.access_token = None;
            account.updated_at_ms = now_ms();
            record.updated_at_ms = now_ms();
            Ok(Edit::Write(record, true))
        })
        .await
    }

    /// Makes `account_id` the default account of `provider`; answers the provider's accounts.
    pub(crate) async fn set_default(
        &self,
        user: &str,
        provider: &str,
        account_id: &str,
    ) -> Result<Vec<Account>, EditError> {
        self.edit(user, |current| {
            let mut record = current.ok_or_else(|| EditError::UnknownAccount(account_id.to_owned()))?;
            let (accounts, _) = holding(&mut record, provider, account_id)?;
            for a in accounts.iter_mut() {
                a.is_default = a.account_id == account_id;
            }
            let listed = listed(accounts);
            record.updated_at_ms = now_ms();
            Ok(Edit::Write(record, listed))
        })
        .await
    }

    /// Removes an account (its tokens with it; the provider keeps its grant until the user revokes it there). The
    /// next account becomes the default when it was. Answers the provider's accounts left.
    pub(crate) async fn remove(
        &self,
        user: &str,
        provider: &str,
        account_id: &str,
    ) -> Result<Vec<Account>, EditError> {
        self.edit(user, |current| {
            let mut record = current.ok_or_else(|| EditError::UnknownAccount(account_id.to_owned()))?;
            let (accounts, i) = holding(&mut record, provider, account_id)?;
            let gone = accounts.remove(i);
            if gone.is_default
                && let Some(next) = accounts.first_mut()
            {
                next.is_default = true;
            }
            let left = listed(accounts);
            if accounts.is_empty() {
                record.providers.remove(provider);
            }
            record.updated_at_ms = now_ms();
            Ok(if record.providers.is_empty() && record.rest.is_empty() {
                Edit::Delete(left)
            } else {
                Edit::Write(record, left)
            })
        })
        .await
    }

    /// Wraps every record's data key under the keyring's wrapping key (after a rotation): (records, rewrapped).
    pub async fn rewrap(&self) -> Result<(u64, u64), CredentialError> {
        self.records
            .rewrap(|record: &mut AccountsRecord| record.rewrap(&self.keyring))
            .await
    }
}

/// The user's accounts at `provider` and the place of `account_id` among them, or `UnknownAccount`.
fn holding<'r>(
    record: &'r mut AccountsRecord,
    provider: &str,
    account_id: &str,
) -> Result<(&'r mut Vec<StoredAccount>, usize), EditError> {
    let unknown = || EditError::UnknownAccount(account_id.to_owned());
    let accounts = record.providers.get_mut(provider).ok_or_else(unknown)?;
    let i = accounts
        .iter()
        .position(|a| a.account_id == account_id)
        .ok_or_else(unknown)?;
    Ok((accounts, i))
}

/// The accounts' metadata, the default first.
pub(crate) fn listed(accounts: &[StoredAccount]) -> Vec<Account> {
    let mut out: Vec<Account> = accounts.iter().map(StoredAccount::public).collect();
    out.sort_by_key(|a| !a.is_default);
    out
}

fn apply_tokens(
    account: &mut StoredAccount,
    dek: &SealKey,
    user: &str,
    provider: &str,
    account_id: &str,
    tokens: &Tokens<'_>,
    now: u64,
) {
    account.access_token = Some(SealedAccess {
        sealed: seal(dek, user, provider, account_id, Kind::Access, tokens.access_token),
        expires_at_ms: tokens.expires_at_ms,
    });
    if let Some(refresh) = tokens.refresh_token {
        account.refresh_token = Some(seal(dek, user, provider, account_id, Kind::Refresh, refresh));
    }
    if let Some(scopes) = &tokens.scopes {
        account.scopes = scopes.clone();
    }
    account.status = AccountStatus::Active;
    account.updated_at_ms = now;
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_sealed_token_opens_only_at_its_place_and_kind() {
        let keyring = Keyring::fixed(&[("k1", [3; 32])]);
        let (mut record, dek) = AccountsRecord::new("alice", &keyring);
        let mut account = StoredAccount {
            account_id: "acc_0000000000000001".into(),
            subject: None,
            email: None,
            label: "x".into(),
            is_default: true,
            status: AccountStatus::Active,
            scopes: Vec::new(),
            refresh_token: None,
            access_token: None,
            connected_at_ms: 1,
            updated_at_ms: 1,
        };
        let tokens = Tokens {
            access_token: "at-secret",
            expires_at_ms: 5,
            refresh_token: Some("rt-secret"),
            scopes: None,
        };
        apply_tokens(
            &mut account,
            &dek,
            "alice",
            "g",
            "acc_0000000000000001",
            &tokens,
            2,
        );
        let refresh = account.refresh_token.clone().unwrap();
        let access = account.access_token.clone().unwrap().sealed;
        record.providers.insert("g".into(), vec![account]);
        let text = serde_json::to_string(&record).unwrap();
        assert!(
            !text.contains("at-secret") && !text.contains("rt-secret"),
            "{text}"
        );
        let dek = record.data_key(&keyring).unwrap();
        let id = "acc_0000000000000001";
        assert_eq!(
            record
                .open(&dek, "g", id, Kind::Refresh, &refresh)
                .unwrap()
                .as_str(),
            "rt-secret"
        );
        assert_eq!(
            record
                .open(&dek, "g", id, Kind::Access, &access)
                .unwrap()
                .as_str(),
            "at-secret"
        );
        // Another kind, account, provider or user: refused.
        assert!(record.open(&dek, "g", id, Kind::Access, &refresh).is_err());
        assert!(
            record
                .open(&dek, "g", "acc_0000000000000002", Kind::Refresh, &refresh)
                .is_err()
        );
        assert!(record.open(&dek, "h", id, Kind::Refresh, &refresh).is_err());
        let mut stolen = record.clone();
        stolen.user = "bob".into();
        assert!(stolen.data_key(&keyring).is_err());
        // The credentials' data-key place is not this one.
        assert!(valid_account_id(id) && !valid_account_id("a@b.c") && !valid_account_id("acc_xyz"));
    }
}
