//! Delegated tool calls (spec §8.2: a session's tool call is a real `tools.invoke` as the invoke's user).
//!
//! A front dispatching a sync invoke mints a **delegation** for it: a random handle (`<front id>.<256-bit
//! secret>`) that it alone resolves to (user, plugin, invoke, deadline, depth). It travels in the sealed exec
//! request (so only a front grants one), the worker keeps it from the plugin, and the worker's agent sessions
//! present it on `fleet.v1.delegate.<front id>.tools.{list,invoke}`. The front answers such a call as the user
//! the *handle* names — the request names no user — only while the invoke it was minted for is running (the
//! handle is forgotten when the front has the invoke's answer, whatever it is), never after its deadline, never
//! for the plugin that holds it (no self-recursion), and a delegated invoke's own delegation is one level deeper,
//! refused past [`AGENT_DELEGATION_MAX_DEPTH`]. The child's timeout is cut to the parent's remaining time.
//!
//! Jobs (`tools.invokeAsync`) outlive their front: their delegations ([`JobDelegations`]) are records in JetStream KV
//! that any front resolves, on `fleet.v1.delegate.jobs.<method>` (ARCHITECTURE.md "Delegated tool calls").
//!
//! What a compromised worker can do with a handle it was given is what the invoke's agent sessions could: call
//! that user's tools until that invoke ends. Handles are compared by their full secret (a map lookup of the
//! whole string; an unknown handle and an ended one are the same refusal).

use std::sync::Arc;

use async_nats::jetstream::{self, kv};
use dashmap::DashMap;
use fleet_proto::api::JobId;
use fleet_proto::api::delegation::{self, DelegationToken};
use fleet_proto::app_manifest::list_admits;
use fleet_proto::limits::AGENT_DELEGATION_MAX_DEPTH;
use fleet_proto::util::now_ms;
use fleet_store::{Op, StoreError, StoreSettings};
use serde::{Deserialize, Serialize};

/// What a delegation stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delegated {
    /// The user the invoke runs for.
    pub user: String,
    /// The plugin whose invoke holds it.
    pub plugin: String,
    /// The invoke.
    pub invoke_id: String,
    /// The invoke's deadline, Unix ms (the front's own wait).
    pub deadline_ms: u64,
    /// 0 for an invoke an app made; n + 1 for an invoke made with a depth-n delegation.
    pub depth: u32,
    /// The allow-list of the app window the invoke was made under (its token's `tools`), handed down to every
    /// delegation below it: a delegated call may reach only what the window could ([`list_admits`]). `None`: no
    /// window narrowed the invoke.
    pub window_tools: Option<Vec<String>>,
}

/// Why a delegated call is refused. Never carries the handle.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DelegationError {
    /// Not a handle of this front.
    #[error("the delegation is not one of this front's")]
    Foreign,
    /// Never minted, or its invoke has ended.
    #[error("the delegation is unknown or its invoke has ended")]
    Unknown,
    /// Past the invoke's deadline.
    #[error("the delegation's invoke is past its deadline")]
    Expired,
    /// A call would exceed the depth cap.
    #[error("delegated tool calls may nest at most {AGENT_DELEGATION_MAX_DEPTH} deep")]
    TooDeep,
    /// The plugin holding the delegation named itself.
    #[error("a plugin's agent session cannot call the plugin itself")]
    SelfCall,
    /// The tool is outside the allow-list of the app window the invoke was made under.
    #[error("the app window this invoke was made under does not allow that tool")]
    OutsideWindow,
    /// The store of job delegations did not answer.
    #[error("the job delegations cannot be read now")]
    Unavailable,
}

/// The live delegations of one front.
#[derive(Debug)]
pub struct Delegations {
    front_id: String,
    live: DashMap<String, Delegated>,
}

impl Default for Delegations {
    fn default() -> Self {
        Delegations {
            front_id: hex::encode(rand::random::<[u8; 8]>()),
            live: DashMap::new(),
        }
    }
}

/// A minted delegation; dropping it (when the front has the invoke's answer) revokes it.
#[derive(Debug)]
pub struct Live {
    owner: Arc<Delegations>,
    secret: String,
    /// The handle, for the exec request.
    pub token: DelegationToken,
}

impl Drop for Live {
    fn drop(&mut self) {
        self.owner.live.remove(&self.secret);
    }
}

impl Delegations {
    /// This front's id (its delegated subjects: `fleet.v1.delegate.<id>.>`).
    pub fn front_id(&self) -> &str {
        &self.front_id
    }

    /// Delegations alive now.
    pub fn live(&self) -> usize {
        self.live.len()
    }

    /// Mints the delegation of one invoke; it lives as long as the returned guard. `None` when `what` is
    /// already at the depth cap (its sessions get no tools).
    pub fn mint(self: &Arc<Self>, what: Delegated) -> Option<Live> {
        if what.depth >= AGENT_DELEGATION_MAX_DEPTH {
            return None;
        }
        let secret = hex::encode(rand::random::<[u8; 32]>());
        self.live.insert(secret.clone(), what);
        Some(Live {
            owner: self.clone(),
            token: DelegationToken(format!("{}.{secret}", self.front_id)),
            secret,
        })
    }

    /// What `token` stands for, while its invoke runs and before its deadline.
    pub fn resolve(&self, token: &DelegationToken) -> Result<Delegated, DelegationError> {
        let (front, secret) = token.0.split_once('.').ok_or(DelegationError::Foreign)?;
        if front != self.front_id {
            return Err(DelegationError::Foreign);
        }
        let found = self
            .live
            .get(secret)
            .map(|e| e.clone())
            .ok_or(DelegationError::Unknown)?;
        if now_ms() >= found.deadline_ms {
            return Err(DelegationError::Expired);
        }
        Ok(found)
    }

    /// The checks of a delegated `tools.invoke` of `plugin` under `by`: not the holder itself, not deeper
    /// than the cap. Returns the child's depth.
    pub fn admit(by: &Delegated, plugin: &str) -> Result<u32, DelegationError> {
        if plugin == by.plugin {
            return Err(DelegationError::SelfCall);
        }
        if !list_admits(by.window_tools.as_deref(), plugin) {
            return Err(DelegationError::OutsideWindow);
        }
        let depth = by.depth + 1;
        if depth > AGENT_DELEGATION_MAX_DEPTH {
            return Err(DelegationError::TooDeep);
        }
        Ok(depth)
    }
}

/// What a job's delegation stands for, as stored in `<prefix>_delegations` under the SHA-256 of its secret (never
/// the secret itself).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobDelegation {
    /// The user the job runs for.
    pub user: String,
    /// The job's plugin.
    pub plugin: String,
    /// The job (its invoke id).
    pub job_id: JobId,
    /// The job's deadline, Unix ms.
    pub deadline_ms: u64,
    /// 0: an app's job (jobs are never made by a delegated call).
    pub depth: u32,
    /// [`Delegated::window_tools`] of the window the job was made under (absent: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_tools: Option<Vec<String>>,
}

/// The delegations of jobs (`tools.invokeAsync`), which outlive the front that accepted them: minted by that
/// front before the job is dispatched, recorded in the KV bucket `<prefix>_delegations` (only fronts may write
/// it) under the SHA-256 of the handle's secret, resolved by **any** front on `fleet.v1.delegate.jobs.<method>`
/// (queue group [`delegation::JOBS_QUEUE_GROUP`]), only while the job is `running` and before its deadline;
/// deleted when a front decides the job's terminal state, and by the bucket's `max_age` anyway. The handle itself
/// travels in the job's record (which the worker reads when it starts the job) and never reaches the plugin.
#[derive(Debug, Clone)]
pub struct JobDelegations {
    kv: kv::Store,
}

/// The key of a job handle's record: the hex SHA-256 of its secret; `None` for a handle that is not a job's.
fn job_key(token: &DelegationToken) -> Option<String> {
    use sha2::Digest as _;
    let (front, secret) = token.0.split_once('.')?;
    (front == delegation::JOBS && token.front_id() == Some(delegation::JOBS))
        .then(|| hex::encode(sha2::Sha256::digest(secret.as_bytes())))
}

impl JobDelegations {
    /// Opens (fronts: creates) `<prefix>_delegations`.
    pub async fn open(
        js: &jetstream::Context,
        settings: &StoreSettings,
    ) -> Result<JobDelegations, StoreError> {
        let kv = fleet_store::open_kv(js, settings.delegations_kv_config(), settings.provision).await?;
        Ok(JobDelegations { kv })
    }

    /// A fresh handle for a job: `jobs.<256-bit secret>`.
    pub fn mint() -> DelegationToken {
        DelegationToken(format!(
            "{}.{}",
            delegation::JOBS,
            hex::encode(rand::random::<[u8; 32]>())
        ))
    }

    /// Records what `token` stands for (before the job is dispatched).
    pub async fn record(&self, token: &DelegationToken, what: &JobDelegation) -> Result<(), StoreError> {
        let Some(key) = job_key(token) else {
            return Err(StoreError::Invalid {
                op: Op::Delegation,
                what: "job delegation",
                reason: "not a job's handle".into(),
            });
        };
        let bytes = serde_json::to_vec(what).map_err(|e| StoreError::Invalid {
            op: Op::Delegation,
            what: "job delegation",
            reason: e.to_string(),
        })?;
        self.kv
            .create(&key, bytes.into())
            .await
            .map(|_| ())
            .map_err(|e| StoreError::Nats {
                op: Op::Delegation,
                source: e.into(),
            })
    }

    /// What `token` stands for, before its deadline (the caller checks that its job still runs).
    pub async fn resolve(&self, token: &DelegationToken) -> Result<JobDelegation, DelegationError> {
        let key = job_key(token).ok_or(DelegationError::Foreign)?;
        let found = fleet_store::read_settled::<JobDelegation>(&self.kv, &key, Op::Delegation)
            .await
            .map_err(|e| {
                tracing::warn!(error = %e, "cannot read a job delegation");
                DelegationError::Unavailable
            })?
            .ok_or(DelegationError::Unknown)?;
        if now_ms() >= found.value.deadline_ms {
            return Err(DelegationError::Expired);
        }
        Ok(found.value)
    }

    /// Deletes `token`'s record (its job reached a terminal state). Best effort: it expires anyway.
    pub async fn forget(&self, token: &DelegationToken) {
        if let Some(key) = job_key(token)
            && let Err(e) = self.kv.delete(&key).await
        {
            tracing::warn!(error = %e, "cannot delete a job delegation");
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn what(depth: u32, deadline_ms: u64) -> Delegated {
        Delegated {
            user: "alice".into(),
            plugin: "agent-py".into(),
            invoke_id: "inv-1".into(),
            deadline_ms,
            depth,
            window_tools: None,
        }
    }

    #[test]
    fn a_delegation_resolves_only_while_its_invoke_runs() {
        let d = Arc::new(Delegations::default());
        let live = d.mint(what(0, now_ms() + 60_000)).unwrap();
        let token = live.token.clone();
        assert_eq!(token.front_id(), Some(d.front_id()));
        assert_eq!(d.resolve(&token).unwrap().user, "alice");
        assert!(!format!("{token:?}").contains(token.0.split_once('.').unwrap().1));
        drop(live);
        // Replayed after the invoke ended.
        assert_eq!(d.resolve(&token), Err(DelegationError::Unknown));
        assert_eq!(d.live(), 0);
    }

    #[test]
    fn forged_foreign_and_expired_delegations_are_refused() {
        let d = Arc::new(Delegations::default());
        let other = Arc::new(Delegations::default());
        let live = other.mint(what(0, now_ms() + 60_000)).unwrap();
        assert_eq!(d.resolve(&live.token), Err(DelegationError::Foreign));
        let forged = DelegationToken(format!("{}.{}", d.front_id(), "0".repeat(64)));
        assert_eq!(d.resolve(&forged), Err(DelegationError::Unknown));
        assert_eq!(
            d.resolve(&DelegationToken("garbage".into())),
            Err(DelegationError::Foreign)
        );
        let past = d.mint(what(0, now_ms().saturating_sub(1))).unwrap();
        assert_eq!(d.resolve(&past.token), Err(DelegationError::Expired));
    }

    #[test]
    fn a_job_handle_is_keyed_by_the_hash_of_its_secret_only() {
        let token = JobDelegations::mint();
        assert_eq!(token.front_id(), Some(delegation::JOBS));
        let secret = token.0.split_once('.').unwrap().1.to_owned();
        assert_eq!(secret.len(), 64);
        let key = job_key(&token).unwrap();
        assert_eq!(key.len(), 64);
        assert_ne!(key, secret, "the key is the secret's hash, not the secret");
        assert!(!format!("{token:?}").contains(&secret));
        assert_ne!(job_key(&JobDelegations::mint()), Some(key));
        // A front's (sync) handle, and malformed ones, are not jobs' handles.
        let d = Arc::new(Delegations::default());
        let live = d.mint(what(0, now_ms() + 60_000)).unwrap();
        assert_eq!(job_key(&live.token), None);
        for bad in ["jobs.", "jobs", "jobs.a.b", "jobs.*"] {
            assert_eq!(job_key(&DelegationToken(bad.into())), None, "{bad}");
        }
    }

    #[test]
    fn depth_is_capped_and_a_plugin_cannot_call_itself() {
        let by = what(0, u64::MAX);
        assert_eq!(Delegations::admit(&by, "echo-py"), Ok(1));
        assert_eq!(
            Delegations::admit(&by, "agent-py"),
            Err(DelegationError::SelfCall)
        );
        let deepest = what(AGENT_DELEGATION_MAX_DEPTH - 1, u64::MAX);
        assert_eq!(
            Delegations::admit(&deepest, "echo-py"),
            Ok(AGENT_DELEGATION_MAX_DEPTH)
        );
        let at_cap = what(AGENT_DELEGATION_MAX_DEPTH, u64::MAX);
        assert_eq!(
            Delegations::admit(&at_cap, "echo-py"),
            Err(DelegationError::TooDeep)
        );
        // An invoke at the cap gets no delegation at all.
        let d = Arc::new(Delegations::default());
        assert!(d.mint(at_cap).is_none());
    }
}
