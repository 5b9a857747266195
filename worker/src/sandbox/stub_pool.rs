//! The worker's side of the sandbox stubs (`stub.rs`): a few stubs started ahead of need by one background task
//! of the worker's runtime, each confined as far as nothing session-specific is involved and waiting for a
//! claim; a session's spawn takes one ([`StubPool::take`]) and turns it into its plugin ([`Stub::claim`]).
//!
//! A stub is a child of the worker like a directly spawned plugin (a `tokio::process::Child` with the plugin's
//! stdio pipes, killed on drop), so everything after the spawn — the exit watcher, the tree kill, the OOM
//! count — is the same for both paths. A session whose plan a stub cannot carry (an egress-granted plugin
//! joins a namespace with the worker's proxy in it; a sandbox without namespaces) spawns directly, as does any
//! session that finds the pool empty: the pool is a fast path, never a queue.
//!
//! The refill task starts with the first [`take`](StubPool::take) (the worker's runtime is known then). If a
//! stub fails before it is ready (no stub program, a kernel that refuses), the failure is logged once and the
//! pool stops refilling: every spawn is then direct.

use std::os::fd::{AsRawFd as _, OwnedFd};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::unix::pipe;
use tokio::sync::Notify;

use super::SpawnPlan;
use super::seat::{Seat, SeatPlan};
use super::stub_msg::{FAILED, FAILURE_BYTES, READY, STUB_ARG, Setup, Step};

/// How long a new stub may take to be ready, and a claimed one to `exec`: failure guards (a stub is ready in a
/// few milliseconds and `exec`s in well under one).
pub(crate) const STUB_WAIT: Duration = Duration::from_secs(10);

/// How long after a take the refill task waits before it starts the replacement: making a stub costs a `fork`
/// of the worker and a new network namespace (about a millisecond of CPU), which would otherwise compete with
/// the cold start that just took one (its `exec`, the plugin's start, the handshake). A burst of session starts
/// takes several stubs before the first replacement begins; sessions finding the pool empty spawn directly.
pub(crate) const STUB_REFILL_DELAY: Duration = Duration::from_millis(25);

/// Why a stub could not become the plugin.
#[derive(Debug, thiserror::Error)]
pub enum StubError {
    /// The stub reported a failed step (the `errno` of that step).
    #[error("{}: {source}", .step.describe())]
    Step {
        /// What failed.
        step: Step,
        /// The system's error.
        source: std::io::Error,
    },
    /// Talking to the stub failed, or it did not answer within `STUB_WAIT`.
    #[error("the sandbox stub did not answer: {0}")]
    Io(#[source] std::io::Error),
}

/// A confined stub waiting for its claim.
#[derive(Debug)]
pub(crate) struct Stub {
    child: tokio::process::Child,
    status: pipe::Receiver,
    /// The cgroups it waits in (`seat.rs`), when the pool makes seats.
    seat: Option<Seat>,
}

impl Stub {
    /// Kills the stub and reaps it, waiting at most [`STUB_WAIT`] (a stub stuck in the kernel is left to the
    /// runtime's reaper then, and said so), then removes its seat.
    async fn end(mut self) {
        let _ = self.child.start_kill();
        if tokio::time::timeout(STUB_WAIT, self.child.wait()).await.is_err() {
            tracing::warn!("a killed sandbox stub did not exit within {STUB_WAIT:?}");
        }
        if let Some(seat) = self.seat.take() {
            // Left to the sweep at the next start if the stub is somehow still in it.
            let _ = tokio::task::spawn_blocking(move || seat.remove_if_empty()).await;
        }
    }

    /// Its seat, taken out (the caller now owns the seat's cgroups).
    pub(crate) fn take_seat(&mut self) -> Option<Seat> {
        self.seat.take()
    }

    /// Hands the stub `claim` (a framed [`super::stub_msg::Claim`]) and returns at once: the child (soon the plugin,
    /// with the stub's stdio pipes) and the outcome of its `exec`, to await when it matters. What the caller
    /// writes to the child's stdin meanwhile waits in the pipe behind the claim for the plugin (the stub reads
    /// exactly its claim), so the plugin's first request costs no extra round trip.
    /// The claim's write is bounded by [`STUB_WAIT`]: a claim larger than the pipe holds waits for the stub to
    /// read it, and a stub that does not (stopped, stuck) is given up (dropped: killed) — its caller, which holds
    /// the session's launch, tries the next stub or spawns directly.
    pub(crate) async fn claim(
        self,
        claim: &[u8],
        program: String,
    ) -> Result<(tokio::process::Child, ExecStatus), StubError> {
        self.claim_within(claim, program, STUB_WAIT).await
    }

    async fn claim_within(
        mut self,
        claim: &[u8],
        program: String,
        wait: Duration,
    ) -> Result<(tokio::process::Child, ExecStatus), StubError> {
        let stdin = self
            .child
            .stdin
            .as_mut()
            .ok_or_else(|| StubError::Io(std::io::ErrorKind::BrokenPipe.into()))?;
        tokio::time::timeout(wait, stdin.write_all(claim))
            .await
            .map_err(|_| StubError::Io(std::io::ErrorKind::TimedOut.into()))?
            .map_err(StubError::Io)?;
        Ok((
            self.child,
            ExecStatus {
                status: self.status,
                program,
            },
        ))
    }
}

/// How a claimed stub's `exec` ended (read once).
#[derive(Debug)]
pub struct ExecStatus {
    status: pipe::Receiver,
    /// argv[0], for the error.
    program: String,
}

impl ExecStatus {
    /// `Ok` once the plugin runs (the status pipe closed on `exec`); the failed step otherwise. Bounded by
    /// [`STUB_WAIT`].
    pub(crate) async fn outcome(mut self) -> Result<(), (String, StubError)> {
        match read_status(&mut self.status).await {
            Ok(Status::Exec) => Ok(()),
            Ok(Status::Ready) => Err((
                self.program,
                StubError::Io(std::io::Error::other("a second ready byte")),
            )),
            Ok(Status::Failed(step, source)) => Err((self.program, StubError::Step { step, source })),
            Err(e) => Err((self.program, e)),
        }
    }
}

enum Status {
    /// EOF: the status pipe closed on `exec`.
    Exec,
    Ready,
    Failed(Step, std::io::Error),
}

/// Reads the stub's next status (bounded by [`STUB_WAIT`]).
async fn read_status(status: &mut pipe::Receiver) -> Result<Status, StubError> {
    let read = async {
        let mut first = [0u8; 1];
        if status.read(&mut first).await? == 0 {
            return Ok(Status::Exec);
        }
        match first[0] {
            READY => Ok(Status::Ready),
            FAILED => {
                let mut rest = [0u8; FAILURE_BYTES - 1];
                status.read_exact(&mut rest).await?;
                let step = Step::from_byte(rest[0]).unwrap_or(Step::Message);
                let errno = i32::from_le_bytes([rest[1], rest[2], rest[3], rest[4]]);
                Ok(Status::Failed(step, std::io::Error::from_raw_os_error(errno)))
            }
            _ => Err(std::io::Error::other("an unknown status byte")),
        }
    };
    match tokio::time::timeout(STUB_WAIT, read).await {
        Ok(r) => r.map_err(StubError::Io),
        Err(_) => Err(StubError::Io(std::io::ErrorKind::TimedOut.into())),
    }
}

/// Stubs kept ready for new sessions (module documentation).
#[derive(Debug, Clone)]
pub(crate) struct StubPool {
    inner: Arc<PoolInner>,
}

#[derive(Debug)]
struct PoolInner {
    program: PathBuf,
    /// The framed [`Setup`] every stub reads first.
    setup: Vec<u8>,
    target: usize,
    ready: Mutex<Vec<Stub>>,
    /// Wakes the refill task (a take, or the pool's end).
    wake: Arc<Notify>,
    started: AtomicBool,
    failed: AtomicBool,
    /// Set (under `ready`'s lock) by [`StubPool::shutdown`]: nothing is pushed to `ready` after it.
    closed: AtomicBool,
    /// How stubs are seated (`None`: they wait in the worker's cgroup and always join a session's on a claim).
    seats: Option<SeatPlan>,
    /// Set when making a seat failed once (logged then): later stubs are not seated.
    seats_failed: AtomicBool,
    /// Seats whose stub left them (joined another session's cgroup, or was discarded), removed by the refill
    /// task once empty.
    emptied: Mutex<Vec<Seat>>,
    claims: AtomicU64,
    /// The refill task, once started (awaited by [`StubPool::shutdown`]).
    refill: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl StubPool {
    /// A pool of `target` stubs of `program` that each run `setup` first, each seated as `seats` says. Nothing
    /// starts before the first take.
    pub(crate) fn new(
        program: PathBuf,
        target: usize,
        setup: &Setup,
        seats: Option<SeatPlan>,
    ) -> std::io::Result<StubPool> {
        Ok(StubPool {
            inner: Arc::new(PoolInner {
                program,
                setup: super::stub_msg::frame(setup)?,
                target,
                ready: Mutex::new(Vec::with_capacity(target)),
                wake: Arc::new(Notify::new()),
                started: AtomicBool::new(false),
                failed: AtomicBool::new(false),
                closed: AtomicBool::new(false),
                seats,
                seats_failed: AtomicBool::new(false),
                emptied: Mutex::new(Vec::new()),
                claims: AtomicU64::new(0),
                refill: Mutex::new(None),
            }),
        })
    }

    /// A ready stub, if one waits (the refill task is started or woken to replace it). Without a tokio runtime,
    /// or once the pool gave up, none.
    pub(crate) fn take(&self) -> Option<Stub> {
        if !self.start() {
            return None;
        }
        let inner = &self.inner;
        let stub = inner.ready.lock().unwrap_or_else(PoisonError::into_inner).pop();
        inner.wake.notify_one();
        stub
    }

    /// A ready stub that sits in a seat, for a session that adopts the seat (`seat.rs`); none if none waits.
    pub(crate) fn take_seated(&self) -> Option<Stub> {
        if !self.start() {
            return None;
        }
        let inner = &self.inner;
        let stub = {
            let mut ready = inner.ready.lock().unwrap_or_else(PoisonError::into_inner);
            let at = ready.iter().rposition(|s| s.seat.is_some())?;
            ready.swap_remove(at)
        };
        inner.wake.notify_one();
        Some(stub)
    }

    /// Gives up a stub taken with its seat: it is killed, and the seat removed once empty.
    pub(crate) fn discard(&self, mut stub: Stub, seat: Seat) {
        let _ = stub.child.start_kill();
        stub.seat = Some(seat);
        self.abandon_seat(&mut stub);
        drop(stub);
    }

    /// Moves `stub`'s seat, if any, to the seats the refill task removes once empty.
    fn abandon_seat(&self, stub: &mut Stub) {
        if let Some(seat) = stub.seat.take() {
            let mut emptied = self.inner.emptied.lock().unwrap_or_else(PoisonError::into_inner);
            emptied.push(seat);
        }
        self.inner.wake.notify_one();
    }

    /// Turns `stub`, taken with [`take_seated`](Self::take_seated) and whose seat is the session's cgroup now,
    /// into the plugin `argv` run from `dir` with exactly `env` under `plan` — without joining any cgroup (it is
    /// in the session's already). `None` when the plan is not one a stub can carry or the stub died while it
    /// waited (it is then dropped: killed in the session's cgroup, which the caller spawns into directly).
    pub(crate) async fn launch_seated(
        &self,
        mut stub: Stub,
        plan: &SpawnPlan,
        argv: &[String],
        dir: &std::path::Path,
        env: &[(String, String)],
    ) -> Option<Result<(tokio::process::Child, ExecStatus), StubError>> {
        let mut claim = plan.stub_claim(argv, dir, env)?;
        claim.procs.clear();
        let bytes = match super::stub_msg::frame(&claim) {
            Ok(bytes) => bytes,
            Err(e) => return Some(Err(StubError::Io(e))),
        };
        // A stub that died while it waited (killed, OOM) cannot take the claim: the caller spawns directly.
        if !matches!(stub.child.try_wait(), Ok(None)) {
            return None;
        }
        match stub.claim(&bytes, claim.argv[0].clone()).await {
            Err(StubError::Io(_)) => None,
            started => {
                self.inner.claims.fetch_add(1, Ordering::Relaxed);
                Some(started)
            }
        }
    }

    /// Starts the refill task on the current runtime if it is not running yet, so the first session finds stubs
    /// waiting. False without a runtime or once the pool gave up.
    pub(crate) fn start(&self) -> bool {
        let inner = &self.inner;
        if inner.failed.load(Ordering::Relaxed) {
            return false;
        }
        if inner.started.load(Ordering::Acquire) {
            return true;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return false;
        };
        if !inner.started.swap(true, Ordering::AcqRel) {
            let task = rt.spawn(refill(Arc::downgrade(inner), inner.wake.clone()));
            *inner.refill.lock().unwrap_or_else(PoisonError::into_inner) = Some(task);
        }
        true
    }

    /// Ends the pool: no stub is made or handed out from now on, and every waiting stub (and one the refill task
    /// was making) is killed and reaped before this returns — a worker that stops leaves no stub behind.
    pub(crate) async fn shutdown(&self) {
        let inner = &self.inner;
        inner.failed.store(true, Ordering::Relaxed);
        let waiting: Vec<Stub> = {
            let mut ready = inner.ready.lock().unwrap_or_else(PoisonError::into_inner);
            inner.closed.store(true, Ordering::Release);
            ready.drain(..).collect()
        };
        inner.wake.notify_one();
        let task = inner.refill.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(mut task) = task {
            // It ends at its next look at the pool: at once when waiting, after the stub it is making otherwise
            // (bounded by STUB_WAIT), which it then kills and reaps itself. A shutdown is bounded whatever happens.
            if tokio::time::timeout(2 * STUB_WAIT, &mut task).await.is_err() {
                tracing::warn!(
                    "the sandbox stubs' refill task did not end within {:?}",
                    2 * STUB_WAIT
                );
                task.abort();
            }
        }
        for stub in waiting {
            stub.end().await;
        }
        remove_emptied_seats(inner).await;
    }

    /// Starts `argv` in `dir` with exactly `env` under `plan` from a waiting stub: `None` when the plan is not
    /// one a stub can carry ([`SpawnPlan::stub_claim`]) or no stub waits — the caller then spawns directly.
    pub(crate) async fn try_launch(
        &self,
        plan: &SpawnPlan,
        argv: &[String],
        dir: &std::path::Path,
        env: &[(String, String)],
    ) -> Option<Result<(tokio::process::Child, ExecStatus), StubError>> {
        let claim = plan.stub_claim(argv, dir, env)?;
        let bytes = match super::stub_msg::frame(&claim) {
            Ok(bytes) => bytes,
            Err(e) => return Some(Err(StubError::Io(e))),
        };
        // A stub that died while it waited (killed, OOM) cannot take the claim: the next one can, or the
        // caller spawns directly. Each attempt uses a stub up, so this ends.
        for _ in 0..=self.inner.target {
            let mut stub = self.take()?;
            // It joins the session's cgroup on the claim: its seat, if any, is left behind.
            self.abandon_seat(&mut stub);
            if !matches!(stub.child.try_wait(), Ok(None)) {
                continue;
            }
            match stub.claim(&bytes, claim.argv[0].clone()).await {
                Err(StubError::Io(_)) => continue,
                started => {
                    self.inner.claims.fetch_add(1, Ordering::Relaxed);
                    return Some(started);
                }
            }
        }
        None
    }

    /// How many stubs wait.
    pub(crate) fn ready(&self) -> usize {
        self.inner
            .ready
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// How many plugin processes started from a stub so far.
    pub(crate) fn claims(&self) -> u64 {
        self.inner.claims.load(Ordering::Relaxed)
    }

    /// Whether the pool gave up (a stub failed before it was ready).
    pub(crate) fn failed(&self) -> bool {
        self.inner.failed.load(Ordering::Relaxed)
    }
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        self.wake.notify_one();
    }
}

/// The refill task: keeps `target` stubs ready while the pool lives (it holds only a weak reference; the
/// pool's drop wakes it to end).
async fn refill(pool: Weak<PoolInner>, wake: Arc<Notify>) {
    loop {
        {
            let Some(inner) = pool.upgrade() else { return };
            if inner.closed.load(Ordering::Acquire) {
                return;
            }
            remove_emptied_seats(&inner).await;
            if inner.ready.lock().unwrap_or_else(PoisonError::into_inner).len() < inner.target {
                match start_stub(&inner).await {
                    Ok(mut stub) => {
                        seat_stub(&inner, &mut stub).await;
                        let mut ready = inner.ready.lock().unwrap_or_else(PoisonError::into_inner);
                        if inner.closed.load(Ordering::Acquire) {
                            drop(ready);
                            stub.end().await;
                            return;
                        }
                        ready.push(stub);
                    }
                    Err(e) => {
                        tracing::warn!(
                            program = %inner.program.display(),
                            error = %e,
                            "cannot start sandbox stubs: every plugin is spawned directly (slower cold starts)"
                        );
                        inner.failed.store(true, Ordering::Relaxed);
                        return;
                    }
                }
                continue;
            }
        }
        // A take (or the pool's drop) since the check left a permit: nothing is missed.
        wake.notified().await;
        tokio::time::sleep(STUB_REFILL_DELAY).await;
    }
}

/// Removes the seats whose stub has left them; the ones still occupied wait for the next round.
async fn remove_emptied_seats(inner: &PoolInner) {
    let seats: Vec<Seat> = std::mem::take(&mut *inner.emptied.lock().unwrap_or_else(PoisonError::into_inner));
    if seats.is_empty() {
        return;
    }
    let busy = tokio::task::spawn_blocking(move || {
        seats
            .into_iter()
            .filter_map(Seat::remove_if_empty)
            .collect::<Vec<Seat>>()
    })
    .await
    .unwrap_or_default();
    inner
        .emptied
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .extend(busy);
}

/// Makes a seat for the ready `stub` and moves it in, when the pool seats its stubs. A failure is logged once
/// and ends seating (the stubs then join a session's cgroup on each claim, as without seats).
async fn seat_stub(inner: &PoolInner, stub: &mut Stub) {
    let (Some(plan), Some(pid)) = (inner.seats.clone(), stub.child.id()) else {
        return;
    };
    if inner.seats_failed.load(Ordering::Relaxed) {
        return;
    }
    let made = tokio::task::spawn_blocking(move || {
        let seat = plan.make().map_err(|e| (None, e.to_string()))?;
        match seat.seat(pid) {
            Ok(()) => Ok(seat),
            Err(e) => Err((
                Some(Box::new(seat)),
                format!("cannot move a stub into its seat: {e}"),
            )),
        }
    })
    .await;
    match made {
        Ok(Ok(seat)) => stub.seat = Some(seat),
        Ok(Err((seat, error))) => {
            inner.seats_failed.store(true, Ordering::Relaxed);
            tracing::warn!(
                %error,
                "cannot seat sandbox stubs in cgroups of their own: every claim joins the session's cgroup \
                 (slower cold starts)"
            );
            // Partly attached: removed once the stub has left it.
            if let Some(seat) = seat {
                inner
                    .emptied
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(*seat);
            }
        }
        Err(_) => {}
    }
}

/// Spawns one stub, hands it the setup and waits until it is ready.
async fn start_stub(inner: &PoolInner) -> Result<Stub, StubError> {
    let (read, write): (OwnedFd, OwnedFd) =
        rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).map_err(|e| StubError::Io(e.into()))?;
    let mut cmd = tokio::process::Command::new(&inner.program);
    cmd.arg(STUB_ARG)
        .arg(write.as_raw_fd().to_string())
        .env_clear()
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    super::spawn::pass_fd(&mut cmd, write.as_raw_fd());
    let mut child = cmd.spawn().map_err(StubError::Io)?;
    drop(write);
    let mut status = pipe::Receiver::from_owned_fd(read).map_err(StubError::Io)?;
    let stdin = child
        .stdin
        .as_mut()
        .ok_or_else(|| StubError::Io(std::io::ErrorKind::BrokenPipe.into()))?;
    stdin.write_all(&inner.setup).await.map_err(StubError::Io)?;
    match read_status(&mut status).await? {
        Status::Ready => Ok(Stub {
            child,
            status,
            seat: None,
        }),
        Status::Exec => Err(StubError::Io(std::io::Error::other(
            "the stub program exited before it was ready (is it a stub?)",
        ))),
        Status::Failed(step, source) => Err(StubError::Step { step, source }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stub that does not read its claim (stopped, stuck) does not hold the launch: a claim larger than the pipe
    /// holds fails once its bound has passed, and the process is killed with the stub.
    #[tokio::test]
    async fn a_claim_the_stub_does_not_read_is_given_up() {
        // A real process that never reads its stdin, standing in the stub's place.
        let mut cmd = tokio::process::Command::new("/bin/sleep");
        cmd.arg("600")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .kill_on_drop(true);
        let child = cmd.spawn().unwrap();
        let pid = child.id().unwrap();
        let (_status_tx, status) = pipe::pipe().unwrap();
        let stub = Stub {
            child,
            status,
            seat: None,
        };
        // More than a pipe holds (64 KiB by default, at most 1 MiB unprivileged).
        let claim = vec![0u8; 2 << 20];
        let err = stub
            .claim_within(&claim, "plugin".into(), Duration::from_millis(200))
            .await
            .unwrap_err();
        assert!(
            matches!(&err, StubError::Io(e) if e.kind() == std::io::ErrorKind::TimedOut),
            "{err}"
        );
        // Dropped with the stub: killed (a zombie until the runtime reaps it, so its state is looked at).
        let dead = || {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| {
                s.rsplit_once(')')
                    .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
            })
        };
        let deadline = std::time::Instant::now() + STUB_WAIT;
        while !dead() {
            assert!(std::time::Instant::now() < deadline, "the stub was not killed");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
