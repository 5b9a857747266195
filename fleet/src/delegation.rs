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
//! What a compromised worker can do with a handle it was given is what the invoke's agent sessions could: call
//! that user's tools until that invoke ends. Handles are compared by their full secret (a map lookup of the
//! whole string; an unknown handle and an ended one are the same refusal).

use std::sync::Arc;

use dashmap::DashMap;
use fleet_proto::api::delegation::DelegationToken;
use fleet_proto::limits::AGENT_DELEGATION_MAX_DEPTH;
use fleet_proto::util::now_ms;

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
        let depth = by.depth + 1;
        if depth > AGENT_DELEGATION_MAX_DEPTH {
            return Err(DelegationError::TooDeep);
        }
        Ok(depth)
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
