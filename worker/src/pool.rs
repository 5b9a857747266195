//! The warm pool: at most one session per (user, tool_id), created on first use or by an explicit prewarm,
//! kept warm until idle for the configured time, bounded per worker and per user with LRU eviction of idle
//! sessions. Eviction and worker shutdown use the session shutdown ladder.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dashmap::DashMap;
use tokio::task::{JoinHandle, JoinSet};

use crate::catalogue::{Catalogue, Install};
use crate::metrics::WorkerMetrics;
use crate::session::{Attempt, Session, SessionError};
use crate::types::{InvokeError, InvokeOutput, InvokeRequest, WorkerContext};

/// Why the pool could not serve a call.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// No such plugin in the catalogue.
    #[error("unknown plugin {0:?}")]
    UnknownPlugin(String),
    /// Every session slot is busy, or the worker admits no more users (retriable: another worker may have room,
    /// and this one has once sessions go idle).
    #[error("no session slot free ({scope} limit {limit}; every session is busy)")]
    Capacity {
        /// `worker` or `user` (the session caps), `user_budget` (the users' memory ceilings and disk caps fill
        /// the worker's budget: `limit` users are admitted) or `uids` (every uid of the range is held).
        scope: &'static str,
        /// The limit.
        limit: usize,
    },
    /// The session could not be created.
    #[error(transparent)]
    Session(#[from] SessionError),
    /// The invoke failed.
    #[error(transparent)]
    Invoke(#[from] InvokeError),
    /// The worker is shutting down.
    #[error("the worker is shutting down")]
    Closed,
    /// The install was refused at detection or quarantined (kind not hosted, version, changed binary…).
    #[error(transparent)]
    Refused(#[from] crate::animus::DetectError),
    /// The install speaks Animus: it has no Executa [`Session`] (use [`Pool::invoke`]).
    #[error("plugin {0:?} speaks Animus: it is served by Pool::invoke, not by an Executa session")]
    NotExecuta(String),
}

/// What serves a call, resolved once per call ([`Pool::target`]).
#[derive(Debug)]
pub enum Target {
    /// The user's Executa session of the plugin.
    Executa(Session),
    /// An Animus install, with its detection record.
    Animus {
        /// The install.
        install: Arc<Install>,
        /// Its detection (dialect, manifest, fingerprint).
        detected: Box<crate::animus::Detected>,
    },
}

impl Target {
    /// The per-tool timeout `tool`'s manifest declares, once the session is ready (Executa only: an Animus
    /// call takes the default, spec §16 A-3).
    pub fn manifest_timeout(&self, tool: &str) -> Option<Duration> {
        let Target::Executa(session) = self else {
            return None;
        };
        let secs = session.manifest()?.tool(tool)?.timeout?;
        Duration::try_from_secs_f64(secs).ok()
    }
}

type Key = (String, String);

/// How often a draining session's in-flight count is checked.
const DRAIN_POLL: Duration = Duration::from_millis(25);

struct Inner {
    ctx: WorkerContext,
    catalogue: Arc<Catalogue>,
    /// Installs added at run time (versioned installs, see `crate::install`), by tool id.
    installed: std::sync::RwLock<HashMap<String, Arc<Install>>>,
    /// Sessions of replaced installs, finishing their invokes before they stop.
    draining: Mutex<Vec<Session>>,
    sessions: Mutex<HashMap<Key, Session>>,
    invokes: DashMap<String, Session>,
    early_cancels: crate::session::EarlyCancels,
    closed: AtomicBool,
    reaper: Mutex<Option<JoinHandle<()>>>,
    animus: crate::animus::AnimusHost,
    /// The last Executa `health` answer per tool_id (polled every [`EXECUTA_HEALTH_POLL`]).
    health: Mutex<HashMap<String, crate::types::HealthState>>,
    health_poller: Mutex<Option<JoinHandle<()>>>,
}

/// How often the ready Executa sessions are asked for `health` (spec §3.6: 3 s timeout each; never per invoke).
pub const EXECUTA_HEALTH_POLL: Duration = Duration::from_secs(30);

/// The pool. Cheap to clone.
#[derive(Clone)]
pub struct Pool {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("sessions", &self.len()).finish()
    }
}

use fleet_proto::util::lock;

impl Pool {
    /// A pool over `catalogue`; starts the idle reaper.
    pub fn new(ctx: WorkerContext, catalogue: Arc<Catalogue>) -> Pool {
        let inner = Arc::new(Inner {
            animus: crate::animus::AnimusHost::new(ctx.clone()),
            health: Mutex::new(HashMap::new()),
            health_poller: Mutex::new(None),
            ctx,
            catalogue,
            installed: std::sync::RwLock::new(HashMap::new()),
            draining: Mutex::new(Vec::new()),
            sessions: Mutex::new(HashMap::new()),
            invokes: DashMap::new(),
            early_cancels: crate::session::EarlyCancels::default(),
            closed: AtomicBool::new(false),
            reaper: Mutex::new(None),
        });
        let pool = Pool { inner };
        let period = (pool.inner.ctx.config.idle_timeout / 4)
            .clamp(Duration::from_millis(100), Duration::from_secs(30));
        let weak = Arc::downgrade(&pool.inner);
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { return };
                Pool { inner }.evict_idle().await;
            }
        });
        *lock(&pool.inner.reaper) = Some(task);
        let weak = Arc::downgrade(&pool.inner);
        let poller = tokio::spawn(async move {
            let start = tokio::time::Instant::now() + EXECUTA_HEALTH_POLL;
            let mut tick = tokio::time::interval_at(start, EXECUTA_HEALTH_POLL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { return };
                Pool { inner }.poll_executa_health().await;
            }
        });
        *lock(&pool.inner.health_poller) = Some(poller);
        pool
    }

    /// Asks every ready Executa session for `health` and records the answer, mapped onto the states Animus
    /// `health/check` uses (one state per tool_id: the worst of its sessions).
    pub async fn poll_executa_health(&self) {
        use crate::types::HealthState;
        let ready: Vec<Session> = self
            .sessions()
            .into_iter()
            .filter(|s| s.state() == crate::session::SessionState::Ready)
            .collect();
        let mut seen: HashMap<String, HealthState> = HashMap::new();
        for s in ready {
            let state = HealthState::from_executa(s.health().await);
            let e = seen.entry(s.tool_id().to_string()).or_insert(state);
            *e = (*e).max(state);
        }
        *lock(&self.inner.health) = seen;
    }

    /// The plugins' health as last seen, both dialects: (tool_id, dialect, state).
    pub fn health_states(&self) -> Vec<(String, crate::catalogue::Dialect, crate::types::HealthState)> {
        let mut out: Vec<_> = lock(&self.inner.health)
            .iter()
            .map(|(t, h)| (t.clone(), crate::catalogue::Dialect::Executa, *h))
            .collect();
        out.extend(
            self.inner
                .animus
                .health()
                .into_iter()
                .map(|(t, h)| (t, crate::catalogue::Dialect::Animus, h)),
        );
        out.sort();
        out
    }

    /// The catalogue.
    pub fn catalogue(&self) -> &Catalogue {
        &self.inner.catalogue
    }

    /// The install of `tool_id`: the catalogue's (the local catalogue always wins), else one added with
    /// [`Pool::set_install`].
    pub fn install(&self, tool_id: &str) -> Option<Arc<Install>> {
        if let Some(i) = self.inner.catalogue.get_shared(tool_id) {
            return Some(i);
        }
        self.inner
            .installed
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(tool_id)
            .cloned()
    }

    /// The install added with [`Pool::set_install`] for `tool_id`, if any (not the catalogue's).
    pub fn added_install(&self, tool_id: &str) -> Option<Arc<Install>> {
        self.inner
            .installed
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(tool_id)
            .cloned()
    }

    /// Adds or replaces the install of `install.tool_id` (an upgrade). New sessions start on it at once; sessions
    /// of the previous install leave the pool now and stop once their in-flight invokes have finished (their
    /// process keeps its version directory). The returned task completes when they have all stopped.
    pub fn set_install(&self, install: Install) -> JoinHandle<()> {
        let install = Arc::new(install);
        let tool_id = install.tool_id.clone();
        let previous = self
            .inner
            .installed
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(tool_id.clone(), install.clone());
        let changed = previous.is_some_and(|p| *p != *install);
        self.drain(&tool_id, changed)
    }

    /// Removes an install added with [`Pool::set_install`]; its sessions drain as on an upgrade.
    pub fn remove_install(&self, tool_id: &str) -> Option<JoinHandle<()>> {
        let removed = self
            .inner
            .installed
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(tool_id);
        removed.map(|_| self.drain(tool_id, true))
    }

    /// Takes `tool_id`'s sessions out of the pool (when `now`) and stops each once it has no invoke in flight.
    fn drain(&self, tool_id: &str, now: bool) -> JoinHandle<()> {
        let old: Vec<Session> = if now {
            let mut sessions = lock(&self.inner.sessions);
            let keys: Vec<Key> = sessions.keys().filter(|(_, t)| t == tool_id).cloned().collect();
            keys.iter().filter_map(|k| sessions.remove(k)).collect()
        } else {
            Vec::new()
        };
        self.keep_draining(&old);
        tokio::spawn(async move {
            let mut set = JoinSet::new();
            for s in old {
                set.spawn(async move {
                    // The session has no idle notification: poll its in-flight count (cheap, an atomic).
                    while s.in_flight() > 0 {
                        tokio::time::sleep(DRAIN_POLL).await;
                    }
                    s.shutdown().await;
                });
            }
            while set.join_next().await.is_some() {}
        })
    }

    /// Keeps `sessions` (out of the map, stopping or about to) in `draining` until they have ended, so
    /// [`shutdown`](Self::shutdown) waits for them too; the ones that have ended are forgotten here.
    fn keep_draining(&self, sessions: &[Session]) {
        let mut draining = lock(&self.inner.draining);
        draining.retain(|s| !s.finished());
        draining.extend(sessions.iter().cloned());
    }

    /// Evicts `sessions` (already out of the map): each is asked to stop now — its supervisor runs the ladder on
    /// its own, whoever waits for it or not — and kept draining until it has ended.
    fn retire(&self, sessions: &[Session]) {
        for s in sessions {
            WorkerMetrics::inc(&self.inner.ctx.metrics.evictions);
            s.request_shutdown();
        }
        self.keep_draining(sessions);
    }

    /// The shared context.
    pub fn context(&self) -> &WorkerContext {
        &self.inner.ctx
    }

    /// Live sessions.
    pub fn len(&self) -> usize {
        lock(&self.inner.sessions).len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every live session.
    pub fn sessions(&self) -> Vec<Session> {
        lock(&self.inner.sessions).values().cloned().collect()
    }

    /// The session of (user, tool_id), created if needed (evicting the least recently used idle session when a
    /// cap is reached).
    pub fn session(&self, user: &str, tool_id: &str) -> Result<Session, PoolError> {
        if self.inner.closed.load(Ordering::SeqCst) {
            return Err(PoolError::Closed);
        }
        let key = (user.to_string(), tool_id.to_string());
        let mut evicted = Vec::new();
        let session = {
            let mut sessions = lock(&self.inner.sessions);
            // Checked again under the lock: `shutdown` drains the map under it, so no session is created after.
            if self.inner.closed.load(Ordering::SeqCst) {
                return Err(PoolError::Closed);
            }
            if let Some(s) = sessions.get(&key) {
                return Ok(s.clone());
            }
            let install = self
                .install(tool_id)
                .ok_or_else(|| PoolError::UnknownPlugin(tool_id.to_string()))?;
            // Never an Executa session (and its `initialize`) for an install known to speak Animus.
            if install.protocol == Some(crate::catalogue::Dialect::Animus)
                || self
                    .inner
                    .animus
                    .registry()
                    .known(&install)
                    .is_some_and(|d| d.is_ok_and(|d| d.dialect == crate::catalogue::Dialect::Animus))
            {
                return Err(PoolError::NotExecuta(tool_id.to_string()));
            }
            let config = &self.inner.ctx.config;
            if sessions.keys().filter(|(u, _)| u == user).count() >= config.max_sessions_per_user {
                let victim = lru_idle(&sessions, |(u, _)| u == user).ok_or(PoolError::Capacity {
                    scope: "user",
                    limit: config.max_sessions_per_user,
                })?;
                evicted.extend(sessions.remove(&victim));
            }
            if sessions.len() >= config.max_sessions {
                let victim = lru_idle(&sessions, |_| true).ok_or(PoolError::Capacity {
                    scope: "worker",
                    limit: config.max_sessions,
                })?;
                evicted.extend(sessions.remove(&victim));
            }
            let session = Session::new(user, &install, &self.inner.ctx).map_err(admission)?;
            sessions.insert(key, session.clone());
            session
        };
        self.retire(&evicted);
        Ok(session)
    }

    /// The Animus side of the pool (detection records, cancellation records, health).
    pub fn animus(&self) -> &crate::animus::AnimusHost {
        &self.inner.animus
    }

    /// The dialect of `tool_id`, detected once (see [`crate::animus::detect`]) and cross-checked against the
    /// install's files on every call: a changed binary is quarantined.
    pub async fn dialect(&self, tool_id: &str) -> Result<crate::catalogue::Dialect, PoolError> {
        let install = self
            .install(tool_id)
            .ok_or_else(|| PoolError::UnknownPlugin(tool_id.to_string()))?;
        if !install.is_runnable() {
            return Ok(install.protocol.unwrap_or(crate::catalogue::Dialect::Executa));
        }
        Ok(self.inner.animus.resolve(&install).await?.dialect)
    }

    /// The manifest `tools.list` shows for `tool_id`, whatever its dialect: Executa `describe` (the session is
    /// started as `user`, then shut down), or the tools an Animus plugin maps to.
    pub async fn describe(
        &self,
        user: &str,
        tool_id: &str,
        wait: Duration,
    ) -> Result<Arc<fleet_proto::executa::manifest::Manifest>, PoolError> {
        if self.dialect(tool_id).await? == crate::catalogue::Dialect::Animus {
            let install = self
                .install(tool_id)
                .ok_or_else(|| PoolError::UnknownPlugin(tool_id.to_string()))?;
            return Ok(Arc::new(self.inner.animus.describe(user, &install).await?));
        }
        let session = self.prewarm(user, tool_id, wait).await?;
        let manifest = session.manifest();
        session.shutdown().await;
        manifest.ok_or(PoolError::Invoke(InvokeError::NotReady(wait)))
    }

    /// Starts (user, tool_id)'s plugin now and waits until it is ready (Executa installs only).
    pub async fn prewarm(&self, user: &str, tool_id: &str, wait: Duration) -> Result<Session, PoolError> {
        if self.dialect(tool_id).await? == crate::catalogue::Dialect::Animus {
            return Err(PoolError::NotExecuta(tool_id.to_string()));
        }
        let session = self.session(user, tool_id)?;
        session.prewarm(wait).await?;
        Ok(session)
    }

    /// What serves a call of `tool_id` for `user`, resolved once: the install, its dialect (the plugin's files
    /// checked against its detection once) and, for Executa, the user's session (looked up or created once).
    /// A call then warms it, reads its manifest and runs on it ([`Pool::run`]) without resolving anything again.
    pub async fn target(&self, user: &str, tool_id: &str) -> Result<Target, PoolError> {
        let install = self
            .install(tool_id)
            .ok_or_else(|| PoolError::UnknownPlugin(tool_id.to_string()))?;
        if install.is_runnable() {
            let detected = self.inner.animus.resolve(&install).await?;
            if detected.dialect == crate::catalogue::Dialect::Animus {
                return Ok(Target::Animus {
                    install,
                    detected: Box::new(detected),
                });
            }
        }
        Ok(Target::Executa(self.session(user, tool_id)?))
    }

    /// Runs one invoke on (user, tool_id)'s session.
    pub async fn invoke(
        &self,
        user: &str,
        tool_id: &str,
        req: InvokeRequest,
    ) -> Result<InvokeOutput, PoolError> {
        let target = self.target(user, tool_id).await?;
        self.run(user, tool_id, target, req).await
    }

    /// Runs one invoke on the [`Target`] resolved for (user, tool_id). The request is never copied: a session
    /// evicted between the lookup and the call hands it back, and it goes to a fresh session, once.
    pub async fn run(
        &self,
        user: &str,
        tool_id: &str,
        target: Target,
        req: InvokeRequest,
    ) -> Result<InvokeOutput, PoolError> {
        let mut session = match target {
            Target::Animus { install, detected } => {
                if self.inner.closed.load(Ordering::SeqCst) {
                    return Err(PoolError::Closed);
                }
                if self.inner.early_cancels.take(&req.invoke_id) {
                    return Err(PoolError::Invoke(InvokeError::Cancelled));
                }
                return Ok(self.inner.animus.invoke(user, &install, &detected, req).await?);
            }
            Target::Executa(session) => session,
        };
        let invoke_id = req.invoke_id.clone();
        let mut req = req;
        for attempt in 0..2 {
            if attempt > 0 {
                session = self.session(user, tool_id)?;
            }
            self.inner.invokes.insert(invoke_id.clone(), session.clone());
            // A cancel that came before the invoke reached this pool.
            if self.inner.early_cancels.take(&invoke_id) {
                session.cancel(&invoke_id);
            }
            let result = session.attempt(req).await;
            self.inner.invokes.remove(&invoke_id);
            match result {
                Attempt::Ran(result) => return result.map_err(PoolError::from),
                // The session was evicted between lookup and use: take a fresh one, once.
                Attempt::Closed(back) => {
                    req = back;
                    let mut sessions = lock(&self.inner.sessions);
                    let key = (user.to_string(), tool_id.to_string());
                    if sessions
                        .get(&key)
                        .is_some_and(|s| s.state() == crate::session::SessionState::Closed)
                    {
                        sessions.remove(&key);
                    }
                }
            }
        }
        Err(PoolError::Invoke(InvokeError::Closed))
    }

    /// Cancels an invoke wherever it runs; one not started yet is cancelled when it starts (for a while).
    /// Returns whether it was active.
    pub fn cancel(&self, invoke_id: &str) -> bool {
        if self.inner.animus.cancel(invoke_id) {
            return true;
        }
        let session = self.inner.invokes.get(invoke_id).map(|s| s.clone());
        match session {
            Some(s) => s.cancel(invoke_id),
            None => {
                self.inner.early_cancels.note(invoke_id);
                // It may have registered in between.
                let session = self.inner.invokes.get(invoke_id).map(|s| s.clone());
                session.is_some_and(|s| s.cancel(invoke_id))
            }
        }
    }

    /// How long a session of `tool_id` may stay idle ([`Install::effective_idle_timeout`]; the worker's own for a
    /// tool id it does not know).
    fn idle_timeout_of(&self, tool_id: &str) -> Duration {
        let base = self.inner.ctx.config.idle_timeout;
        self.install(tool_id)
            .map_or(base, |i| i.effective_idle_timeout(base))
    }

    /// Shuts down sessions idle longer than their idle timeout (the install's, else the worker's). Returns how
    /// many.
    pub async fn evict_idle(&self) -> usize {
        let now = Instant::now();
        let victims: Vec<Session> = {
            let mut sessions = lock(&self.inner.sessions);
            let keys: Vec<Key> = sessions
                .iter()
                .filter(|(_, s)| {
                    let timeout = self.idle_timeout_of(s.tool_id());
                    // A session still starting is not idle (a prewarm waits for it; its time counts from use).
                    s.in_flight() == 0
                        && s.state() != crate::session::SessionState::Starting
                        && now.duration_since(s.last_used()) >= timeout
                })
                .map(|(k, _)| k.clone())
                .collect();
            keys.iter().filter_map(|k| sessions.remove(k)).collect()
        };
        let n = victims.len();
        self.retire(&victims);
        // All asked at once: waiting for each in turn ends with the slowest.
        for s in &victims {
            s.shutdown().await;
        }
        let animus = self
            .inner
            .animus
            .evict_idle(|tool_id| self.idle_timeout_of(tool_id))
            .await;
        n + animus
    }

    /// Shuts every session down (in parallel, each with the full ladder), kills and reaps the sandbox stubs,
    /// and refuses new work.
    pub async fn shutdown(&self) {
        {
            let _sessions = lock(&self.inner.sessions);
            self.inner.closed.store(true, Ordering::SeqCst);
        }
        if let Some(reaper) = lock(&self.inner.reaper).take() {
            reaper.abort();
        }
        if let Some(poller) = lock(&self.inner.health_poller).take() {
            poller.abort();
        }
        let mut sessions: Vec<Session> = lock(&self.inner.sessions).drain().map(|(_, s)| s).collect();
        sessions.append(&mut lock(&self.inner.draining));
        let mut set = JoinSet::new();
        for s in sessions {
            set.spawn(async move { s.shutdown().await });
        }
        let animus = self.inner.animus.clone();
        set.spawn(async move { animus.shutdown().await });
        let sandbox = self.inner.ctx.sandbox.clone();
        set.spawn(async move { sandbox.shutdown_stubs().await });
        while set.join_next().await.is_some() {}
    }
}

/// A session refused because the worker's users fill its budget or its uids is a [`PoolError::Capacity`].
fn admission(e: SessionError) -> PoolError {
    use crate::sandbox::SandboxError;
    match e {
        SessionError::Sandbox(SandboxError::UserBudget { admitted, .. }) => PoolError::Capacity {
            scope: "user_budget",
            limit: admitted,
        },
        SessionError::Sandbox(SandboxError::UidRangeExhausted { count, .. }) => PoolError::Capacity {
            scope: "uids",
            limit: usize::try_from(count).unwrap_or(usize::MAX),
        },
        e => PoolError::Session(e),
    }
}

fn lru_idle(sessions: &HashMap<Key, Session>, filter: impl Fn(&Key) -> bool) -> Option<Key> {
    sessions
        .iter()
        .filter(|(k, s)| filter(k) && s.in_flight() == 0)
        .min_by_key(|(_, s)| s.last_used())
        .map(|(k, _)| k.clone())
}
