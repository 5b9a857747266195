//! The agent sessions' state, in the JetStream KV bucket `<prefix>_agent_sessions` (configured in
//! `fleet_store::settings`), so that any worker serves any session and a worker restart forgets none.
//!
//! Three kinds of record, all keyed by the owner — `user_key(user)` and the hash of the plugin's tool id — so that
//! another user's (or plugin's) uuid names a key that does not exist, indistinguishable from an unknown one:
//! * `s.<user>.<plugin>.<uuid>` — the session ([`SessionRecord`]): its settings, TTL, creation and last use, and
//!   its history, bounded ([`bound_history`]);
//! * `r.<user>.<plugin>.<uuid>` — the lease of the run in progress ([`RunLease`]): which run, which holder, until
//!   when, and whether a cancel was asked. A run takes it by compare-and-set (a live lease of another run:
//!   `-32047`), its worker renews it every [`RUN_LEASE_RENEW`] for [`RUN_LEASE_TTL`], and gives it back when the
//!   run ends; a crashed worker's lease lapses after at most [`RUN_LEASE_TTL`]. `agent/session.cancel`, on any
//!   worker, sets its `cancel` flag; the running worker reads the lease before every step (and sees the flag at
//!   each renewal), so a run stops at its next step wherever the cancel came from;
//! * `u.<user>` — the user's index ([`Index`]): every session of the user, all plugins, least recently used
//!   first, with its expiry; `agent/session.list` reads it, and a creation over `[agent] max_sessions` evicts
//!   from its front (spec §8.2: "bounded (LRU)").
//!
//! Every read-modify-write is a `fleet_store::cas::compare_and_set`. A session is written before its index entry
//! (a uuid is usable once `create` answers); an index entry whose session is gone is skipped by `list` and leaves
//! the index at its expiry. Expired sessions are deleted when a call finds them, and by the bucket's `max_age`.

use std::time::Duration;

use async_nats::jetstream::{self, kv};
use fleet_proto::api::user_key;
use fleet_proto::limits;
use fleet_proto::util::now_ms;
use fleet_store::cas::{Edit, Target, compare_and_set};
use fleet_store::settings::AGENT_SESSIONS_MAX_BYTES;
use fleet_store::{Op, Revisioned, StoreError, StoreSettings};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// How long a run lease holds without a renewal: a crashed worker's run frees its session after at most this.
pub const RUN_LEASE_TTL: Duration = Duration::from_secs(30);

/// How often the running worker renews its lease (a third of [`RUN_LEASE_TTL`]: two renewals may fail).
pub const RUN_LEASE_RENEW: Duration = Duration::from_secs(10);

/// Bytes of history a session keeps (its newest messages; the rest of the record is its settings, at most a few
/// tens of KiB).
pub const HISTORY_MAX_BYTES: usize = AGENT_SESSIONS_MAX_BYTES - 64 * 1024;

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A session as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionRecord {
    /// `aps_…`.
    pub uuid: String,
    /// `thread_…`.
    pub thread_id: String,
    /// The label.
    pub label: String,
    /// The session's system prompt.
    pub system_prompt: Option<String>,
    /// `quota_caps.inherit_host_tools`.
    pub inherit_host_tools: bool,
    /// The tools its runs may call (`quota_caps.allowed_tools`).
    pub granted_tools: Vec<String>,
    /// Idle TTL, ms.
    pub ttl_ms: u64,
    /// Created, Unix ms.
    pub created_ms: u64,
    /// Last used, Unix ms.
    pub last_active_ms: u64,
    /// The conversation (OpenAI chat messages, without the system prompt), oldest first.
    #[serde(default)]
    pub messages: Vec<Value>,
}

impl SessionRecord {
    /// Never alive past this, whatever its refreshes (spec §8.2 HR-AG-04: 24 h).
    pub fn max_lifetime_at(&self) -> u64 {
        self.created_ms
            .saturating_add(ms(limits::AGENT_SESSION_MAX_LIFETIME))
    }

    /// Its TTL after its last use, within its lifetime.
    pub fn expires_at(&self) -> u64 {
        self.last_active_ms
            .saturating_add(self.ttl_ms)
            .min(self.max_lifetime_at())
    }

    /// Expired at `now` (the boundary included: at `expires_at` it is gone).
    pub fn expired(&self, now: u64) -> bool {
        now >= self.expires_at()
    }

    /// What `create`, `refresh` and `list` answer.
    pub fn describe(&self, now: u64) -> Value {
        json!({
            "app_session_uuid": self.uuid,
            "thread_id": self.thread_id,
            "kind": "agent",
            "agent_submode": "auto",
            "submode": "auto",
            "fixed_client_id": Value::Null,
            "label": self.label,
            "inherit_host_tools": self.inherit_host_tools,
            "granted_tools": self.granted_tools,
            "system_prompt": self.system_prompt,
            "created_at": self.created_ms,
            "last_active_at": self.last_active_ms,
            "expires_at": self.expires_at(),
            "max_lifetime_at": self.max_lifetime_at(),
            "idle_ttl_seconds": self.ttl_ms / 1000,
            // Whole seconds, rounded up: a session just created or refreshed reports its full TTL.
            "expires_in": self.expires_at().saturating_sub(now).div_ceil(1000),
            "session_expires_in": self.max_lifetime_at().saturating_sub(now).div_ceil(1000),
        })
    }
}

/// The lease of a session's run in progress.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunLease {
    /// The run's id (what `agent/session.cancel` names).
    pub run_id: String,
    /// A random id of the run's holder (one run of one worker).
    pub holder: String,
    /// Held until, Unix ms (renewed while the run goes on).
    pub until_ms: u64,
    /// A cancel was asked.
    #[serde(default)]
    pub cancel: bool,
}

impl RunLease {
    fn live(&self, now: u64) -> bool {
        now < self.until_ms
    }
}

/// One session of a user's index.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Entry {
    /// The plugin's key (hash of its tool id).
    p: String,
    /// The uuid.
    u: String,
    /// Expires at, Unix ms (as of its last use).
    e: u64,
}

/// A user's sessions, least recently used first.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Index {
    #[serde(default)]
    sessions: Vec<Entry>,
}

impl Index {
    fn prune(&mut self, now: u64) {
        self.sessions.retain(|s| s.e > now);
    }

    /// Adds `entry` as the most recently used, after dropping the expired entries and evicting the least
    /// recently used ones while `cap` are kept; the evicted entries.
    fn admit(&mut self, entry: Entry, cap: usize, now: u64) -> Vec<Entry> {
        self.prune(now);
        let excess = (self.sessions.len() + 1).saturating_sub(cap.max(1));
        let evicted: Vec<Entry> = self.sessions.drain(..excess).collect();
        self.sessions.push(entry);
        evicted
    }

    /// Moves a session to the most recently used end with its new expiry; `false` when it is not in the index.
    fn touch(&mut self, p: &str, u: &str, e: u64, now: u64) -> bool {
        let Some(i) = self.sessions.iter().position(|s| s.p == p && s.u == u) else {
            return false;
        };
        let mut entry = self.sessions.remove(i);
        entry.e = e;
        self.sessions.push(entry);
        self.prune(now);
        true
    }

    fn remove(&mut self, p: &str, u: &str) -> bool {
        let before = self.sessions.len();
        self.sessions.retain(|s| !(s.p == p && s.u == u));
        self.sessions.len() != before
    }
}

/// Keeps the newest messages: at most `max_messages`, at most `max_bytes` of JSON together (a message larger
/// than that alone is dropped with everything before it).
pub fn bound_history(messages: &mut Vec<Value>, max_messages: usize, max_bytes: usize) {
    let sizes: Vec<usize> = messages
        .iter()
        .map(|m| serde_json::to_vec(m).map_or(0, |b| b.len()) + 1)
        .collect();
    let mut cut = messages.len().saturating_sub(max_messages);
    let mut total: usize = sizes[cut..].iter().sum();
    while cut < messages.len() && total > max_bytes {
        total -= sizes[cut];
        cut += 1;
    }
    messages.drain(..cut);
}

/// Why a session operation failed.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// No such session for this user and plugin (unknown, expired, deleted, or another owner's).
    #[error("no such session")]
    NotFound,
    /// Another run holds the session's lease.
    #[error("a run of this session is already in progress")]
    Busy,
    /// Refused by the caller's own check (its error for the plugin).
    #[error("refused: {}", .0.message)]
    Refused(Box<fleet_proto::jsonrpc::ErrorObject>),
    /// The bucket.
    #[error("agent session store: {0}")]
    Store(#[from] StoreError),
}

/// The owner of a session: the keys' user and plugin parts.
#[derive(Debug, Clone)]
pub struct Owner {
    user: String,
    plugin: String,
}

impl Owner {
    /// The owner (user, tool id).
    pub fn new(user: &str, tool_id: &str) -> Owner {
        Owner {
            user: user_key(user),
            plugin: user_key(tool_id),
        }
    }

    fn session_key(&self, uuid: &str) -> String {
        format!("s.{}.{}.{uuid}", self.user, self.plugin)
    }

    fn lease_key(&self, uuid: &str) -> String {
        format!("r.{}.{}.{uuid}", self.user, self.plugin)
    }

    fn index_key(&self) -> String {
        format!("u.{}", self.user)
    }
}

/// Whether `uuid` can name a key (a plugin may send anything after `aps_`).
pub fn valid_uuid(uuid: &str) -> bool {
    uuid.len() <= 128
        && uuid
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// The sessions bucket (cheap to clone).
#[derive(Debug, Clone)]
pub struct SessionStore {
    kv: kv::Store,
    max_sessions: usize,
}

impl SessionStore {
    /// Opens (or creates, as `settings.provision` says) `<prefix>_agent_sessions`; a user keeps at most
    /// `max_sessions`.
    pub async fn open(
        js: &jetstream::Context,
        settings: &StoreSettings,
        max_sessions: usize,
    ) -> Result<SessionStore, StoreError> {
        let config = settings.agent_sessions_kv_config();
        let bucket = config.bucket.clone();
        let kv = Box::pin(fleet_store::provision::key_value(js, config, settings.provision))
            .await
            .map_err(|e| StoreError::Resource {
                resource: bucket,
                source: e.into(),
            })?;
        Ok(SessionStore { kv, max_sessions })
    }

    fn target<'a>(&'a self, key: &'a str, what: &'static str) -> Target<'a> {
        Target {
            kv: &self.kv,
            key,
            op: Op::AgentSessions,
            limit: (what, AGENT_SESSIONS_MAX_BYTES),
        }
    }

    /// Stores a new session and adds it to its user's index (evicting the least recently used over the cap).
    pub async fn create(&self, owner: &Owner, record: &SessionRecord) -> Result<(), SessionError> {
        let key = owner.session_key(&record.uuid);
        compare_and_set(self.target(&key, "agent session"), Some(None), |current| {
            match current {
                // A 128-bit random uuid taken already: never.
                Some(_) => Err(SessionError::Busy),
                None => Ok(Edit::Write(record.clone(), ())),
            }
        })
        .await?;
        let entry = Entry {
            p: owner.plugin.clone(),
            u: record.uuid.clone(),
            e: record.expires_at(),
        };
        let cap = self.max_sessions;
        let index_key = owner.index_key();
        let admitted = compare_and_set(
            self.target(&index_key, "agent session index"),
            None,
            |current: Option<Revisioned<Index>>| {
                let mut index = current.map(|r| r.value).unwrap_or_default();
                let evicted = index.admit(entry.clone(), cap, now_ms());
                Ok::<_, SessionError>(Edit::Write(index, evicted))
            },
        )
        .await;
        let evicted = match admitted {
            Ok(c) => c.out,
            Err(e) => {
                // Not in the index: not kept either.
                let _ = self.kv.delete(&key).await;
                return Err(e);
            }
        };
        for gone in evicted {
            let other = Owner {
                user: owner.user.clone(),
                plugin: gone.p,
            };
            for k in [other.session_key(&gone.u), other.lease_key(&gone.u)] {
                if let Err(e) = self.kv.delete(&k).await {
                    tracing::warn!(error = %e, "cannot delete an evicted agent session");
                }
            }
        }
        Ok(())
    }

    /// The live session `uuid` of `owner`.
    pub async fn get(&self, owner: &Owner, uuid: &str) -> Result<SessionRecord, SessionError> {
        let found =
            fleet_store::read_settled::<SessionRecord>(&self.kv, &owner.session_key(uuid), Op::AgentSessions)
                .await?;
        match found {
            Some(r) if !r.value.expired(now_ms()) => Ok(r.value),
            Some(_) => {
                self.forget(owner, uuid).await;
                Err(SessionError::NotFound)
            }
            None => Err(SessionError::NotFound),
        }
    }

    /// Edits the live session `uuid` of `owner` through `f` (compare-and-set: `f` may run again on a lost race);
    /// `touch` counts it as a use (its TTL starts again, it becomes the user's most recently used).
    pub async fn edit<R>(
        &self,
        owner: &Owner,
        uuid: &str,
        touch: bool,
        mut f: impl FnMut(&mut SessionRecord) -> Result<R, SessionError>,
    ) -> Result<R, SessionError> {
        let key = owner.session_key(uuid);
        let edited = compare_and_set(
            self.target(&key, "agent session"),
            None,
            |current: Option<Revisioned<SessionRecord>>| {
                let now = now_ms();
                let mut s = match current {
                    Some(r) if !r.value.expired(now) => r.value,
                    Some(_) => return Ok(Edit::Keep(None)),
                    None => return Err(SessionError::NotFound),
                };
                if touch {
                    s.last_active_ms = now;
                }
                let out = f(&mut s)?;
                let expires = s.expires_at();
                Ok(Edit::Write(s, Some((out, expires))))
            },
        )
        .await?;
        let Some((out, expires)) = edited.out else {
            // Expired: gone for every caller.
            self.forget(owner, uuid).await;
            return Err(SessionError::NotFound);
        };
        if touch {
            let index_key = owner.index_key();
            let touched = compare_and_set(
                self.target(&index_key, "agent session index"),
                None,
                |current: Option<Revisioned<Index>>| {
                    let Some(mut index) = current.map(|r| r.value) else {
                        return Ok::<_, SessionError>(Edit::Keep(()));
                    };
                    if index.touch(&owner.plugin, uuid, expires, now_ms()) {
                        Ok(Edit::Write(index, ()))
                    } else {
                        Ok(Edit::Keep(()))
                    }
                },
            )
            .await;
            if let Err(e) = touched {
                tracing::warn!(error = %e, "cannot update the agent session index");
            }
        }
        Ok(out)
    }

    /// Deletes the session `uuid` of `owner`; whether it existed.
    pub async fn delete(&self, owner: &Owner, uuid: &str) -> Result<bool, SessionError> {
        let key = owner.session_key(uuid);
        let deleted = compare_and_set(
            self.target(&key, "agent session"),
            None,
            |current: Option<Revisioned<SessionRecord>>| match current {
                Some(_) => Ok::<_, SessionError>(Edit::Delete(true)),
                None => Ok(Edit::Keep(false)),
            },
        )
        .await?;
        self.forget(owner, uuid).await;
        Ok(deleted.out)
    }

    /// Removes what is left of a session (its lease, its index entry; best effort: both expire anyway).
    async fn forget(&self, owner: &Owner, uuid: &str) {
        let _ = self.kv.delete(&owner.session_key(uuid)).await;
        let _ = self.kv.delete(&owner.lease_key(uuid)).await;
        let index_key = owner.index_key();
        let removed = compare_and_set(
            self.target(&index_key, "agent session index"),
            None,
            |current: Option<Revisioned<Index>>| {
                let Some(mut index) = current.map(|r| r.value) else {
                    return Ok::<_, SessionError>(Edit::Keep(()));
                };
                if index.remove(&owner.plugin, uuid) {
                    Ok(Edit::Write(index, ()))
                } else {
                    Ok(Edit::Keep(()))
                }
            },
        )
        .await;
        if let Err(e) = removed {
            tracing::warn!(error = %e, "cannot update the agent session index");
        }
    }

    /// The live sessions of `owner`, most recently used first, at most `limit`.
    pub async fn list(&self, owner: &Owner, limit: usize) -> Result<Vec<SessionRecord>, SessionError> {
        let now = now_ms();
        let index = fleet_store::read::<Index>(&self.kv, &owner.index_key(), Op::AgentSessions)
            .await?
            .map(|r| r.value)
            .unwrap_or_default();
        let mut out = Vec::new();
        for entry in index
            .sessions
            .iter()
            .rev()
            .filter(|s| s.p == owner.plugin && s.e > now)
        {
            if out.len() >= limit {
                break;
            }
            let key = owner.session_key(&entry.u);
            if let Some(r) = fleet_store::read::<SessionRecord>(&self.kv, &key, Op::AgentSessions).await?
                && !r.value.expired(now)
            {
                out.push(r.value);
            }
        }
        out.sort_by_key(|s| std::cmp::Reverse(s.last_active_ms));
        Ok(out)
    }

    /// Live sessions of a user, every plugin (the index's count).
    pub async fn count(&self, user: &str) -> Result<usize, SessionError> {
        let owner = Owner::new(user, "");
        let now = now_ms();
        let index = fleet_store::read::<Index>(&self.kv, &owner.index_key(), Op::AgentSessions)
            .await?
            .map(|r| r.value)
            .unwrap_or_default();
        Ok(index.sessions.iter().filter(|s| s.e > now).count())
    }

    /// Takes the run lease of session `uuid` for `lease` (`Busy` while another run's lease is live).
    pub async fn acquire(&self, owner: &Owner, uuid: &str, lease: &RunLease) -> Result<(), SessionError> {
        let key = owner.lease_key(uuid);
        compare_and_set(
            self.target(&key, "agent run lease"),
            None,
            |current: Option<Revisioned<RunLease>>| match current {
                Some(r) if r.value.live(now_ms()) => Err(SessionError::Busy),
                _ => Ok(Edit::Write(lease.clone(), ())),
            },
        )
        .await?;
        Ok(())
    }

    /// Extends `holder`'s lease by [`RUN_LEASE_TTL`]: whether a cancel was asked, or `None` when the lease is no
    /// longer `holder`'s (lapsed and taken, or the session deleted).
    pub async fn renew(&self, owner: &Owner, uuid: &str, holder: &str) -> Result<Option<bool>, SessionError> {
        let key = owner.lease_key(uuid);
        let renewed = compare_and_set(
            self.target(&key, "agent run lease"),
            None,
            |current: Option<Revisioned<RunLease>>| match current {
                Some(r) if r.value.holder == holder => {
                    let mut lease = r.value;
                    lease.until_ms = now_ms().saturating_add(ms(RUN_LEASE_TTL));
                    let cancel = lease.cancel;
                    Ok::<_, SessionError>(Edit::Write(lease, Some(cancel)))
                }
                _ => Ok(Edit::Keep(None)),
            },
        )
        .await?;
        Ok(renewed.out)
    }

    /// Whether a cancel of `holder`'s run was asked (read before each step of the run).
    pub async fn cancel_asked(&self, owner: &Owner, uuid: &str, holder: &str) -> Result<bool, SessionError> {
        let lease =
            fleet_store::read::<RunLease>(&self.kv, &owner.lease_key(uuid), Op::AgentSessions).await?;
        Ok(lease.is_some_and(|l| l.value.holder == holder && l.value.cancel))
    }

    /// Asks the live run `run_id` of session `uuid` to stop; whether one was running.
    pub async fn cancel(&self, owner: &Owner, uuid: &str, run_id: &str) -> Result<bool, SessionError> {
        let key = owner.lease_key(uuid);
        let asked = compare_and_set(
            self.target(&key, "agent run lease"),
            None,
            |current: Option<Revisioned<RunLease>>| match current {
                Some(r) if r.value.run_id == run_id && r.value.live(now_ms()) => {
                    let mut lease = r.value;
                    lease.cancel = true;
                    Ok::<_, SessionError>(Edit::Write(lease, true))
                }
                _ => Ok(Edit::Keep(false)),
            },
        )
        .await?;
        Ok(asked.out)
    }

    /// Gives `holder`'s lease back (nothing when it is no longer `holder`'s).
    pub async fn release(&self, owner: &Owner, uuid: &str, holder: &str) {
        let key = owner.lease_key(uuid);
        let released = compare_and_set(
            self.target(&key, "agent run lease"),
            None,
            |current: Option<Revisioned<RunLease>>| match current {
                Some(r) if r.value.holder == holder => Ok::<_, SessionError>(Edit::Delete(())),
                _ => Ok(Edit::Keep(())),
            },
        )
        .await;
        if let Err(e) = released {
            // It lapses after RUN_LEASE_TTL.
            tracing::warn!(error = %e, "cannot give an agent run lease back");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(last_active_ms: u64, ttl_ms: u64) -> SessionRecord {
        SessionRecord {
            uuid: "aps_1".into(),
            thread_id: "thread_1".into(),
            label: "l".into(),
            system_prompt: None,
            inherit_host_tools: true,
            granted_tools: vec!["*".into()],
            ttl_ms,
            created_ms: 1_000,
            last_active_ms,
            messages: Vec::new(),
        }
    }

    #[test]
    fn a_session_expires_exactly_at_its_ttl_and_never_outlives_24_hours() {
        let s = record(1_000, 600_000);
        assert_eq!(s.expires_at(), 601_000);
        assert!(!s.expired(600_999));
        assert!(s.expired(601_000));
        let day = ms(limits::AGENT_SESSION_MAX_LIFETIME);
        let late = record(1_000 + day - 1, 7_200_000);
        assert_eq!(late.expires_at(), 1_000 + day);
        assert!(!late.expired(1_000 + day - 1));
        assert!(late.expired(1_000 + day));
        assert_eq!(s.describe(1_000)["expires_in"], 600);
        assert_eq!(s.describe(600_999)["expires_in"], 1);
    }

    fn entry(u: &str, e: u64) -> Entry {
        Entry {
            p: "p".into(),
            u: u.into(),
            e,
        }
    }

    #[test]
    fn the_index_evicts_the_least_recently_used_at_the_cap_and_drops_expired_entries() {
        let mut index = Index::default();
        for u in ["a", "b", "c"] {
            assert!(index.admit(entry(u, 100), 3, 0).is_empty());
        }
        assert!(index.touch("p", "a", 100, 0), "a is now the most recently used");
        let evicted = index.admit(entry("d", 100), 3, 0);
        assert_eq!(evicted, vec![entry("b", 100)]);
        let kept: Vec<&str> = index.sessions.iter().map(|s| s.u.as_str()).collect();
        assert_eq!(kept, ["c", "a", "d"]);
        // Expired entries leave first and count nothing.
        index.sessions[0].e = 50;
        assert!(index.admit(entry("e", 100), 3, 50).is_empty());
        assert_eq!(index.sessions.len(), 3);
        assert!(!index.touch("p", "zz", 100, 50));
        assert!(index.remove("p", "a") && !index.remove("p", "a"));
    }

    #[test]
    fn history_keeps_the_newest_messages_within_count_and_bytes() {
        let m = |i: usize| json!({"role": "user", "content": format!("m{i:03}")});
        let one = serde_json::to_vec(&m(0)).map(|b| b.len() + 1).unwrap_or(0);
        let mut h: Vec<Value> = (0..10).map(m).collect();
        bound_history(&mut h, 8, usize::MAX);
        assert_eq!(h.first(), Some(&m(2)));
        bound_history(&mut h, 8, 3 * one);
        assert_eq!(h, vec![m(7), m(8), m(9)]);
        bound_history(&mut h, 8, one - 1);
        assert!(h.is_empty(), "a message larger than the budget alone is dropped");
    }

    #[test]
    fn uuids_that_cannot_be_keys_are_refused() {
        assert!(valid_uuid("aps_0123abcd"));
        let long = format!("aps_{}", "a".repeat(200));
        for bad in ["aps_a.b", "aps_*", "aps_>", "aps_ x", long.as_str()] {
            assert!(!valid_uuid(bad), "{bad}");
        }
    }
}
