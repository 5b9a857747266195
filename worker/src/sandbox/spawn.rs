//! Spawning a plugin into its session (and a helper process tied to its parent's life): the only code of this
//! crate allowed to use `unsafe`.
//!
//! [`apply`] installs a `pre_exec` hook on a [`tokio::process::Command`]. The hook runs in the child between
//! `fork` and `exec` and does, in this order:
//!
//! 1. `setsid()`: the plugin leads its own session and process group (so, without cgroups, `killpg` reaches its
//!    tree, and it has no controlling terminal);
//! 2. writes `0` (= "this process") to the `cgroup.procs` file of each of the session's hierarchies: the child is
//!    in its cgroup before `exec`, i.e. before the plugin's first instruction, and on v1 everything it charges
//!    from then on (the exec'd image, its heap) is charged to the session (v1 never moves charges made before an
//!    attach, so attaching after spawn would leave the plugin's start-up memory outside its limit);
//! 3. if a uid/gid is given: `setgroups([])`, `setresgid(g, g, g)`, `setresuid(u, u, u)` — real, effective and
//!    saved ids, so the plugin cannot regain root — and then `PR_SET_NO_NEW_PRIVS`, so it cannot gain privileges
//!    through set-uid binaries or file capabilities either.
//!
//! std's own `Command::uid`/`gid` are not used: std switches ids *before* running `pre_exec` hooks, and the
//! unprivileged child could then no longer write to the root-owned `cgroup.procs`.
//!
//! # The `unsafe` block
//!
//! There are two, both `pre_exec` calls: [`apply`]'s (plugins) and [`die_with_parent`]'s (helpers such as
//! `fleet up`'s nats-server: one `prctl(PR_SET_PDEATHSIG)` and one `getppid`). The first is the call to
//! `tokio::process::Command::pre_exec`. It is `unsafe` because the closure runs in a
//! forked copy of a multi-threaded process, where only one thread exists and any lock another thread held at fork
//! time stays locked forever; the closure must therefore only make async-signal-safe calls — in particular no
//! allocation (the allocator's lock) and no logging. [`child_setup`] upholds that:
//! - every path is a `CString` built in the parent ([`SpawnPlan::new`]), borrowed as `&CStr` (rustix passes a
//!   `&CStr` straight to the syscall, without copying);
//! - every call is a direct system call through rustix's `linux_raw` backend (`setsid`, `open`, `write`,
//!   `close` via `OwnedFd`'s drop, `setgroups`, `setresgid`, `setresuid`, `prctl`), not a libc wrapper with
//!   its own locking (glibc's `setuid` would signal the — non-existent — other threads to switch them too);
//! - the rustix ids are per-thread calls, which is exactly right here: the child has a single thread;
//! - errors become `io::Error::from_raw_os_error` / `io::ErrorKind` values, which do not allocate; std sends
//!   them to the parent through its exec-status pipe, so they surface as the `spawn()` error.
//!
//! # Cost
//!
//! std (and tokio, which wraps it) takes the fast `posix_spawn` path (`clone(CLONE_VM | CLONE_VFORK)`: no copy
//! of the parent's page tables) only when there is no `pre_exec` hook, no uid/gid/groups change (and no `PATH`
//! set in the child's environment for a bare program name); any of those forces a real `fork` + `exec`, whose
//! cost grows with the parent's address space. A plan always has a hook (at
//! least `setsid`), so every plugin spawn pays for `fork`. Measured on the 2-core development VM (cgroup v1)
//! with `cargo test -p fleet-worker --release --test sandbox spawn_cost -- --ignored --nocapture`: spawn and
//! wait for `/bin/true`, 200 times per variant, variants interleaved, from the small test process; three runs
//! (the VM is shared: expect ±30 %):
//!
//! | spawn + wait of `/bin/true`                         | mean           | vs plain    |
//! |-----------------------------------------------------|----------------|-------------|
//! | plain `tokio::process::Command` (`posix_spawn`)     | 0.73–0.82 ms   | 1           |
//! | plan, `setsid` only (forces `fork`)                 | 0.84–0.95 ms   | 1.16–1.17×  |
//! | plan, `setsid` + join the 5 v1 hierarchies          | 0.92–0.99 ms   | 1.21–1.27×  |
//! | plan, `setsid` + 5 hierarchies + uid/gid switch     | 0.89–0.96 ms   | 1.18–1.22×  |
//!
//! So `fork` instead of `vfork` costs ~0.12 ms here and the five `cgroup.procs` writes ~0.07 ms; the id switch
//! is lost in the noise. `fork`'s share grows with the parent's address space (page tables are copied), so a
//! big worker pays more than this small test process.
//!
//! A plugin is spawned once per session and then serves many invokes, so this is far below anything a user
//! notices; it is no reason to give up attaching before `exec`. (On v2, `clone3(CLONE_INTO_CGROUP)` would let
//! a vfork-style spawn start directly in the cgroup; std does not expose it.)

use std::ffi::CString;
use std::io;

use rustix::fs::{Mode, OFlags};
use rustix::process::{Gid, Uid};

use super::{SessionCgroup, UserSpace};

/// What [`apply`] does in the child: which cgroup to join and which ids to take.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpawnPlan {
    /// `cgroup.procs` of every hierarchy of the session (empty without isolation).
    procs_files: Vec<CString>,
    uid: Option<u32>,
    gid: Option<u32>,
}

impl SpawnPlan {
    /// A plan joining `cgroup` (none: no isolation, the plugin stays in the worker's cgroup) and switching to
    /// `uid` / `gid` (none: keep the worker's).
    pub fn new(cgroup: Option<&SessionCgroup>, uid: Option<u32>, gid: Option<u32>) -> SpawnPlan {
        SpawnPlan {
            procs_files: cgroup.map(|c| c.procs_files().to_vec()).unwrap_or_default(),
            uid,
            gid,
        }
    }

    /// [`SpawnPlan::new`] with the ids of `user`.
    pub fn for_user(cgroup: Option<&SessionCgroup>, user: &UserSpace) -> SpawnPlan {
        SpawnPlan::new(cgroup, user.uid, user.gid)
    }
}

/// Configures `cmd` so that its child runs `plan` between `fork` and `exec` (see the module documentation).
/// Do not combine with `Command::process_group`, `uid` or `gid`: `setsid` fails for a process-group leader, and
/// std's id switch would happen before the cgroup write.
#[allow(unsafe_code)]
pub fn apply(cmd: &mut tokio::process::Command, plan: &SpawnPlan) {
    let plan = plan.clone();
    // SAFETY: the closure only calls `child_setup`, which makes async-signal-safe raw system calls on data
    // prepared before the fork and does not allocate (module documentation, "The `unsafe` block").
    unsafe {
        cmd.pre_exec(move || child_setup(&plan));
    }
}

/// Makes the process `cmd` spawns die (SIGKILL) when the thread that spawned it exits — with the whole parent
/// when that is its main or a runtime thread — so a helper such as `fleet up`'s nats-server never outlives a
/// `kill -9` of its parent. If the parent is already gone by the time the child runs, the child does not start.
/// (Spawn from a long-lived thread: the kernel ties the signal to the spawning *thread*.)
#[allow(unsafe_code)]
pub fn die_with_parent(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt as _;
    let parent = rustix::process::getpid();
    // SAFETY: the closure makes two raw system calls through rustix (`prctl`, `getppid`) on a value copied
    // before the fork, allocates nothing and takes no lock (module documentation, "The `unsafe` block").
    unsafe {
        cmd.pre_exec(move || {
            rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))?;
            if rustix::process::getppid() != Some(parent) {
                return Err(io::ErrorKind::NotConnected.into());
            }
            Ok(())
        });
    }
}

/// Runs in the forked child: async-signal-safe and allocation-free (module documentation).
fn child_setup(plan: &SpawnPlan) -> io::Result<()> {
    // `(uid_t)-1` means "unchanged" to the kernel: refuse it rather than silently keep root.
    if plan.uid == Some(u32::MAX) || plan.gid == Some(u32::MAX) {
        return Err(io::ErrorKind::InvalidInput.into());
    }
    rustix::process::setsid()?;
    for file in &plan.procs_files {
        let fd = rustix::fs::open(file.as_c_str(), OFlags::WRONLY | OFlags::CLOEXEC, Mode::empty())?;
        if rustix::io::write(&fd, b"0")? != 1 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        drop(fd);
    }
    if plan.uid.is_some() || plan.gid.is_some() {
        rustix::thread::set_thread_groups(&[])?;
    }
    if let Some(gid) = plan.gid {
        let gid = Gid::from_raw(gid);
        rustix::thread::set_thread_res_gid(gid, gid, gid)?;
    }
    if let Some(uid) = plan.uid {
        let uid = Uid::from_raw(uid);
        rustix::thread::set_thread_res_uid(uid, uid, uid)?;
        rustix::thread::set_no_new_privs(true)?;
    }
    Ok(())
}
