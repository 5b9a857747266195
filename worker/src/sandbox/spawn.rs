//! Spawning a plugin into its session (and a helper process tied to its parent's life): with `netns.rs` (an
//! egress namespace's `unshare` on a thread of its own, and the loopback ioctls both use) and `stub.rs` (a
//! stub taking its status descriptor), the only code of this crate allowed to use `unsafe`. The namespace and
//! mount steps ([`enter_namespaces`], [`mount_private_views`] with its minimal `/dev`, [`seal_host`] with the
//! session's own cgroups, [`mount_back`], [`bind_writable`]) serve both the spawn hook and the sandbox
//! stubs (`stub.rs`), so a plugin is confined the same way whichever started it.
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
//! 3. with namespaces (`namespaces_child`): new network, mount, IPC and UTS namespaces, a private `/proc`, `/tmp`
//!    and a minimal `/dev`, and an empty tmpfs over `/sys/fs/cgroup` (where `cgroup.procs` was) with a
//!    directory per v1 hierarchy ([`mount_private_views`]), then [`seal_host`] — after step 2: it enters a
//!    cgroup namespace rooted at the cgroup just joined and mounts that cgroup's own hierarchies there, then
//!    makes the host read-only — and the session's paths mounted back; for a preparation, last, the hidden directories covered by empty tmpfs mounts with the
//!    build's own paths mounted back (`hide`);
//! 4. if a uid/gid is given: `setgroups([])`, `setresgid(g, g, g)`, `setresuid(u, u, u)` — real, effective and
//!    saved ids, so the plugin cannot regain root — and then `PR_SET_NO_NEW_PRIVS`, so it cannot gain privileges
//!    through set-uid binaries or file capabilities either;
//! 5. every descriptor above stderr marked close-on-exec, and the seccomp filters last.
//!
//! std's own `Command::uid`/`gid` are not used: std switches ids *before* running `pre_exec` hooks, and the
//! unprivileged child could then no longer write to the root-owned `cgroup.procs`.
//!
//! # The `unsafe` block
//!
//! The `pre_exec` calls: [`apply`]'s (plugins), [`die_with_parent`]'s (helpers such as `fleet up`'s
//! nats-server: one `prctl(PR_SET_PDEATHSIG)` and one `getppid`) and [`pass_fd`]'s (a stub's status pipe: one
//! `fcntl`); besides them, the confinement probe's `fork`/`_exit`/`waitpid`, [`enter_namespaces`]'s and
//! `mount_own_cgroups`' `unshare` (no `CLONE_FILES`) and [`set_read_only`]'s `mount_setattr(2)` (rustix has
//! no wrapper: one raw `syscall` with a stack `struct mount_attr`, no allocation, no lock). The first is the
//! call to `tokio::process::Command::pre_exec`. It is `unsafe` because the closure runs in a
//! forked copy of a multi-threaded process, where only one thread exists and any lock another thread held at fork
//! time stays locked forever; the closure must therefore only make async-signal-safe calls — in particular no
//! allocation (the allocator's lock) and no logging. [`child_setup`] upholds that:
//! - every path is a `CString` built in the parent ([`SpawnPlan::new`]), borrowed as `&CStr` (rustix passes a
//!   `&CStr` straight to the syscall, without copying);
//! - every call is a direct system call through rustix's `linux_raw` backend (`setsid`, `open`, `write`,
//!   `close` via `OwnedFd`'s drop, `unshare`, `mount`, `open_tree`, `move_mount`, `mkdir`, `symlinkat`,
//!   `setgroups`, `setresgid`, `setresuid`, `prctl`), not a libc wrapper with its own locking (glibc's
//!   `setuid` would signal the — non-existent — other threads to switch them too);
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

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsFd as _, AsRawFd as _, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use rustix::fs::{CWD, Mode, OFlags};
use rustix::mount::{
    MountFlags, MountPropagationFlags, MoveMountFlags, OpenTreeFlags, mount, mount_change, move_mount,
    open_tree,
};
use rustix::process::{Gid, Uid};
use rustix::thread::{LinkNameSpaceType, UnshareFlags};

use super::confine::{CgroupMounts, Confinement, MAX_KEPT};
use super::netns::loopback_up;
use super::{SessionCgroup, UserSpace};

/// What [`apply`] does in the child: which cgroup to join, which ids to take, how to confine.
#[derive(Debug, Clone, Default)]
pub struct SpawnPlan {
    /// `cgroup.procs` of every hierarchy of the session (empty without isolation).
    procs_files: Vec<CString>,
    uid: Option<u32>,
    gid: Option<u32>,
    /// Supplementary groups after the switch (a shared workspace's group).
    groups: Vec<Gid>,
    /// Namespaces, private `/proc` and `/tmp`, seccomp (none: the plugin shares the worker's view).
    confine: Option<Arc<Confinement>>,
    /// Variables set on top of the spawn site's environment (an egress-granted plugin's proxy).
    env: Vec<(String, String)>,
}

impl SpawnPlan {
    /// A plan joining `cgroup` (none: no isolation, the plugin stays in the worker's cgroup) and switching to
    /// `uid` / `gid` (none: keep the worker's), without confinement.
    pub fn new(cgroup: Option<&SessionCgroup>, uid: Option<u32>, gid: Option<u32>) -> SpawnPlan {
        SpawnPlan {
            procs_files: cgroup.map(|c| c.procs_files().to_vec()).unwrap_or_default(),
            uid,
            gid,
            groups: Vec::new(),
            confine: None,
            env: Vec::new(),
        }
    }

    /// [`SpawnPlan::new`] with the ids and supplementary groups of `user`.
    pub fn for_user(cgroup: Option<&SessionCgroup>, user: &UserSpace) -> SpawnPlan {
        let mut plan = SpawnPlan::new(cgroup, user.uid, user.gid);
        plan.groups = user.groups.iter().map(|g| Gid::from_raw(*g)).collect();
        plan
    }

    /// This plan, confined as `confine` says.
    pub(crate) fn confined(mut self, confine: Option<Arc<Confinement>>) -> SpawnPlan {
        self.confine = confine;
        self
    }

    /// This plan, also setting `env` in the child.
    pub(crate) fn with_env(mut self, env: Vec<(String, String)>) -> SpawnPlan {
        self.env = env;
        self
    }

    /// Whether the plan confines the plugin (namespaces or seccomp).
    pub fn is_confined(&self) -> bool {
        self.confine.is_some()
    }

    /// What a sandbox stub needs to become the plugin `argv` run from `dir` with exactly `env` under this plan
    /// (`stub.rs`); `None` when a stub cannot carry the plan: no namespaces (a stub always makes them), a
    /// network namespace to join (an egress-granted plugin's holds the worker's proxy), hidden directories (a
    /// preparation's), extra variables, or a path that is not UTF-8.
    pub(crate) fn stub_claim(
        &self,
        argv: &[String],
        dir: &std::path::Path,
        env: &[(String, String)],
    ) -> Option<super::stub_msg::Claim> {
        let ns = self.confine.as_ref()?.namespaces.as_ref()?;
        if ns.join_net.is_some() || !ns.masks.is_empty() || !self.env.is_empty() || argv.is_empty() {
            return None;
        }
        let text = |c: &CStr| c.to_str().ok().map(str::to_owned);
        let tmp_root = ns.tmp_root.to_str().ok()?;
        let mut kept = Vec::with_capacity(ns.kept.len());
        for k in &ns.kept {
            let path = text(&k.path)?;
            let relative = path.strip_prefix(tmp_root)?.trim_start_matches('/').to_owned();
            kept.push(super::stub_msg::KeptPath {
                relative,
                parents: k.parents.iter().map(|p| text(p)).collect::<Option<_>>()?,
                is_dir: k.is_dir,
                writable: k.writable,
                path,
            });
        }
        Some(super::stub_msg::Claim {
            procs: self.procs_files.iter().map(|p| text(p)).collect::<Option<_>>()?,
            uid: self.uid,
            gid: self.gid,
            groups: self.groups.iter().map(|g| g.as_raw()).collect(),
            kept,
            writable: ns.writable.iter().map(|p| text(p)).collect::<Option<_>>()?,
            argv: argv.to_vec(),
            env: env.to_vec(),
            cwd: dir.to_str()?.to_owned(),
        })
    }
}

/// Configures `cmd` so that its child runs `plan` between `fork` and `exec` (see the module documentation).
/// Do not combine with `Command::process_group`, `uid` or `gid`: `setsid` fails for a process-group leader, and
/// std's id switch would happen before the cgroup write.
#[allow(unsafe_code)]
pub fn apply(cmd: &mut tokio::process::Command, plan: &SpawnPlan) {
    cmd.envs(plan.env.iter().map(|(k, v)| (k, v)));
    let plan = plan.clone();
    // SAFETY: the closure only calls `child_setup`, which makes async-signal-safe raw system calls on data
    // prepared before the fork and does not allocate (module documentation, "The `unsafe` block").
    unsafe {
        cmd.pre_exec(move || child_setup(&plan));
    }
}

/// Leaves `fd` open across the `exec` of `cmd`'s child (its close-on-exec flag is cleared in the child only):
/// how a sandbox stub gets its status pipe (`stub_pool.rs`). Forces the `fork` path; stubs are spawned in the
/// background, never on a session's cold start.
#[allow(unsafe_code)]
pub(crate) fn pass_fd(cmd: &mut tokio::process::Command, fd: std::os::fd::RawFd) {
    // SAFETY: the closure makes one raw `fcntl` through rustix on a descriptor number copied before the fork;
    // it allocates nothing and takes no lock (module documentation, "The `unsafe` block").
    unsafe {
        cmd.pre_exec(move || {
            let fd = std::os::fd::BorrowedFd::borrow_raw(fd);
            rustix::io::fcntl_setfd(fd, rustix::io::FdFlags::empty())?;
            Ok(())
        });
    }
}

/// The probe child's exit code when it confined itself but the kernel refused the `favordynmods` mount.
const FAVOR_REFUSED: i32 = 250;

/// How long [`probe`] waits for its child (which ends within milliseconds; creating a network namespace on a busy
/// machine can take a second or two) before it kills it and fails.
const PROBE_WAIT: Duration = Duration::from_secs(30);

/// Runs the confinement of `confine` in a forked child that exits at once, and reports whether it worked: what
/// [`Sandbox::new`](super::Sandbox::new) does before it accepts sessions, so a worker that cannot confine
/// plugins refuses to start instead of running them unconfined. No program is executed.
///
/// With `favor` (a directory path in the child's private `/tmp`), the child — in its own mount namespace,
/// before its filters — also mounts a `cgroup2` there with `favordynmods` and leaves: the kernel keeps favoring
/// dynamic cgroup changes (task migrations) from then on, so moving a new plugin into its cgroup no longer waits
/// for an RCU grace period after a quiet spell (`WorkerConfig::favor_dynmods`). `Ok(false)` when
/// the kernel refused that mount (older than 6.1, or not the host's cgroup namespace): confinement still works.
#[allow(unsafe_code)]
pub(crate) fn probe(confine: &Confinement, favor: Option<&CStr>) -> io::Result<bool> {
    // SAFETY: the child only runs `confine_child` and `favor_child` (async-signal-safe raw system calls on data
    // prepared before the fork, no allocation) and leaves with `_exit`, which runs no atexit handler and no
    // destructor.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if pid == 0 {
        let code = match confine_child(confine, favor) {
            Ok(true) => 0,
            Ok(false) => FAVOR_REFUSED,
            Err(e) => e.raw_os_error().unwrap_or(libc::EIO).clamp(1, 255),
        };
        // SAFETY: see above.
        unsafe { libc::_exit(code) };
    }
    // Bounded: a probe stuck in the kernel (a namespace or mount that never completes) fails the start with a
    // reason instead of holding the caller for good.
    let status = wait_exit(pid, PROBE_WAIT).map_err(|e| match e.kind() {
        io::ErrorKind::TimedOut => io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "the confinement probe did not finish within {} s",
                PROBE_WAIT.as_secs()
            ),
        ),
        _ => e,
    })?;
    if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0 {
        Ok(true)
    } else if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == FAVOR_REFUSED {
        Ok(false)
    } else if libc::WIFEXITED(status) {
        Err(io::Error::from_raw_os_error(libc::WEXITSTATUS(status)))
    } else {
        Err(io::Error::other("the confinement probe was killed"))
    }
}

/// Waits up to `limit` for our own child `pid` to end and reaps it: its wait status. Past `limit` the child is
/// killed (SIGKILL) and the error is `TimedOut`; one that does not die at once stays a zombie until this process
/// ends. Polled ([`super::control::poll_until`]): for children that end within milliseconds.
#[allow(unsafe_code)]
fn wait_exit(pid: libc::pid_t, limit: Duration) -> io::Result<libc::c_int> {
    let mut status = 0;
    let mut outcome = None;
    super::control::poll_until(limit, || {
        loop {
            // SAFETY: plain non-blocking waitpid on our own child with a valid pointer.
            let rc = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            if rc == pid {
                outcome = Some(Ok(status));
            } else if rc < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                outcome = Some(Err(e));
            }
            return outcome.is_some();
        }
    });
    outcome.unwrap_or_else(|| {
        // SAFETY: signals our own child, not reaped yet (so its pid cannot have been reused), then reaps it if it
        // died at once.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
            libc::waitpid(pid, &mut status, libc::WNOHANG);
        }
        Err(io::ErrorKind::TimedOut.into())
    })
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

/// Runs in the forked child: async-signal-safe and allocation-free (module documentation). Before the filters it
/// marks every descriptor above stderr close-on-exec (`stub.rs`'s `cloexec_above_stderr`, the stub's own step):
/// the plugin starts with 0, 1 and 2 only, whatever the worker's other threads had open without the flag at the
/// `fork`, while std's exec-error pipe keeps working until the `exec`.
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
    if let Some(confine) = &plan.confine {
        namespaces_child(confine, None)?;
    }
    switch_ids(plan.uid, plan.gid, &plan.groups)?;
    super::stub::cloexec_above_stderr()?;
    if let Some(confine) = &plan.confine {
        seccomp_child(confine)?;
    }
    Ok(())
}

/// With a uid or gid: supplementary groups ← `groups`, then gid and uid (real, effective and saved: no way
/// back to root), then no new privileges. Allocation-free (a forked child runs it; so does a stub).
pub(super) fn switch_ids(uid: Option<u32>, gid: Option<u32>, groups: &[Gid]) -> io::Result<()> {
    if uid.is_some() || gid.is_some() {
        rustix::thread::set_thread_groups(groups)?;
    }
    if let Some(gid) = gid {
        let gid = Gid::from_raw(gid);
        rustix::thread::set_thread_res_gid(gid, gid, gid)?;
    }
    if let Some(uid) = uid {
        let uid = Uid::from_raw(uid);
        rustix::thread::set_thread_res_uid(uid, uid, uid)?;
        rustix::thread::set_no_new_privs(true)?;
    }
    Ok(())
}

/// The probe's child: everything [`child_setup`] does to confine, without cgroups or ids (and the
/// `favordynmods` mount, whose outcome it returns).
fn confine_child(confine: &Confinement, favor: Option<&CStr>) -> io::Result<bool> {
    let favored = namespaces_child(confine, favor)?;
    seccomp_child(confine)?;
    // The filter is in force: a refused call must now fail.
    if confine.seccomp.is_some() {
        match rustix::process::chroot(c"/") {
            Err(rustix::io::Errno::PERM) => {}
            Err(e) => return Err(e.into()),
            Ok(()) => return Err(io::ErrorKind::PermissionDenied.into()),
        }
    }
    Ok(favored)
}

/// New network, mount, IPC and UTS namespaces; loopback up; a private `/proc` (other uids' processes hidden),
/// a private `/tmp` with the session's own paths mounted back in and a minimal `/dev`; the host sealed, its
/// cgroups replaced by the session's own in a cgroup namespace rooted there (joined before: [`child_setup`]).
///
/// With `favor` (the confinement probe's), the `favordynmods` `cgroup2` mount of [`probe`] happens before the
/// cgroup namespace (the kernel applies a cgroup2 mount's flags only from the initial one); its outcome is
/// returned (`true` without `favor`).
fn namespaces_child(confine: &Confinement, favor: Option<&CStr>) -> io::Result<bool> {
    let Some(ns) = &confine.namespaces else {
        return Ok(true);
    };
    if let Some(net) = &ns.join_net {
        rustix::thread::move_into_link_name_space(net.ns.as_fd(), Some(LinkNameSpaceType::Network))?;
    }
    enter_namespaces(ns.join_net.is_none())?;
    // Detached copies of the kept paths, taken before `/tmp` is covered.
    let mut held = hold(&ns.kept)?;
    mount_private_views(&ns.proc_options, &ns.tmp_root, &ns.tmp_options, &ns.cgroups)?;
    // The probe's: from the initial cgroup namespace (the kernel applies a cgroup2 mount's flags only there),
    // so before `seal_host` enters a new one.
    let favored = match favor {
        Some(dir) => mkdir_exists_ok(dir)
            .and_then(|()| {
                mount(c"none", dir, c"cgroup2", MountFlags::empty(), c"favordynmods").map_err(Into::into)
            })
            .is_ok(),
        None => true,
    };
    seal_host(&ns.tmp_root, &ns.cgroups)?;
    mount_all_back(&mut held, &ns.kept)?;
    for path in &ns.writable {
        bind_writable(path.as_c_str())?;
    }
    for mask in &ns.masks {
        hide(mask)?;
    }
    Ok(favored)
}

/// Detached copies (`open_tree` clones) of the `kept` paths, taken before what holds them is covered.
/// Allocation-free.
fn hold(kept: &[super::confine::Kept]) -> io::Result<[Option<OwnedFd>; MAX_KEPT]> {
    let mut held: [Option<OwnedFd>; MAX_KEPT] = [const { None }; MAX_KEPT];
    for (slot, kept) in held.iter_mut().zip(kept.iter()) {
        *slot = Some(open_tree(
            CWD,
            kept.path.as_c_str(),
            OpenTreeFlags::OPEN_TREE_CLONE | OpenTreeFlags::OPEN_TREE_CLOEXEC | OpenTreeFlags::AT_RECURSIVE,
        )?);
    }
    Ok(held)
}

/// Mounts each of [`hold`]'s copies back at its path ([`mount_back`]). Allocation-free.
fn mount_all_back(held: &mut [Option<OwnedFd>; MAX_KEPT], kept: &[super::confine::Kept]) -> io::Result<()> {
    for (slot, kept) in held.iter_mut().zip(kept.iter()) {
        if let Some(tree) = slot.take() {
            mount_back(
                &tree,
                kept.path.as_c_str(),
                kept.parents.iter().map(CString::as_c_str),
                kept.is_dir,
                kept.writable,
            )?;
        }
    }
    Ok(())
}

/// The mount options of the empty tmpfs that hides a directory ([`hide`]).
const MASK_OPTIONS: &CStr = c"size=1m,nr_inodes=1024,mode=755";

/// Covers `mask.root` with an empty tmpfs, mounts the session's paths beneath it back (as they were in the
/// view, writable only when they hold a writable directory), then makes the tmpfs itself read-only. A root the
/// view does not hold (beneath the private `/tmp`, and not kept) is hidden already. Allocation-free.
fn hide(mask: &super::confine::Mask) -> io::Result<()> {
    let mut held = hold(&mask.kept)?;
    match mount(
        c"tmpfs",
        mask.root.as_c_str(),
        c"tmpfs",
        MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
        MASK_OPTIONS,
    ) {
        Err(rustix::io::Errno::NOENT) if mask.kept.is_empty() => return Ok(()),
        other => other?,
    }
    mount_all_back(&mut held, &mask.kept)?;
    // This mount only (a bind remount changes the mount's flags, not those of the trees mounted back on it).
    rustix::mount::mount_remount(
        mask.root.as_c_str(),
        MountFlags::BIND | MountFlags::RDONLY | MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
        c"",
    )?;
    Ok(())
}

/// New mount, IPC and UTS namespaces — and a new network namespace with `lo` up when `new_net` — for the
/// calling process, which has a single thread (a forked child, a sandbox stub); then every mount made private.
/// Allocation-free.
#[allow(unsafe_code)]
pub(super) fn enter_namespaces(new_net: bool) -> io::Result<()> {
    let net = if new_net {
        UnshareFlags::NEWNET
    } else {
        UnshareFlags::empty()
    };
    // SAFETY: none of these flags is CLONE_FILES, so no file descriptor another part of the process holds is
    // affected; the callers are single-threaded, so no other thread observes the unshared tables.
    unsafe {
        rustix::thread::unshare_unsafe(
            net | UnshareFlags::NEWNS | UnshareFlags::NEWIPC | UnshareFlags::NEWUTS,
        )?;
    }
    if new_net {
        loopback_up()?;
    }
    mount_change(c"/", MountPropagationFlags::REC | MountPropagationFlags::PRIVATE)?;
    Ok(())
}

/// Where the cgroup hierarchies are mounted (by every runtime and init system; the worker's own `cgroup2`
/// mount, when it needs one, is in a directory mode 0700: `detect.rs`).
const CGROUP_DIR: &CStr = c"/sys/fs/cgroup";

/// The flags of every mount of a plugin's cgroup view.
const CGROUP_VIEW_FLAGS: MountFlags = MountFlags::RDONLY
    .union(MountFlags::NOSUID)
    .union(MountFlags::NODEV)
    .union(MountFlags::NOEXEC);

/// The session-independent half of a plugin's cgroup view (`view`), made with its other private mounts
/// ([`mount_private_views`]; a stub's while it waits): on v1, an empty tmpfs over `/sys/fs/cgroup` with a
/// directory per hierarchy and the links to them, where [`mount_own_cgroups`] mounts the hierarchies; nothing on
/// v2 (one mount there). It covers the host's `cgroup.procs` files: the direct spawn makes it after joining the
/// session's cgroup, a stub joins through a descriptor of `/sys/fs/cgroup` opened before (`stub.rs`).
/// Allocation-free.
fn cgroup_skeleton(view: &CgroupMounts) -> io::Result<()> {
    if view.unified {
        return Ok(());
    }
    // Read-only with the rest of the host (`seal_host`).
    mount(
        c"tmpfs",
        CGROUP_DIR,
        c"tmpfs",
        MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
        MASK_OPTIONS,
    )?;
    for h in &view.hierarchies {
        mkdir_exists_ok(h.dir.as_c_str())?;
        for (target, link) in &h.links {
            rustix::fs::symlinkat(target.as_c_str(), CWD, link.as_c_str())?;
        }
    }
    Ok(())
}

/// The session's own cgroups as the caller's view of `/sys/fs/cgroup` (`view`, on its [`cgroup_skeleton`]): a
/// new cgroup namespace, rooted at the cgroup the caller is in — the session's, joined before —, then new
/// read-only mounts, made in it, of the worker's hierarchies, covering whatever the host has there (the unified
/// one on `/sys/fs/cgroup`; v1: each on its directory of the skeleton). So the plugin reads its own limits and
/// usage (runtimes size their heaps and threads from them) and nothing of the worker's subtree, its users' keys
/// or other sessions — a cgroup namespace alone would not do that: it changes `/proc/self/cgroup` (now `/`) and
/// what a *new* mount shows, not the host's mounts already in the view. The worker still sees, limits and kills
/// the plugin at its full path. The hierarchies' mount points elsewhere (`view.covered`) get an empty read-only
/// tmpfs. Allocation-free.
#[allow(unsafe_code)]
fn mount_own_cgroups(view: &CgroupMounts) -> io::Result<()> {
    // SAFETY: CLONE_NEWCGROUP is not CLONE_FILES, so no file descriptor another part of the process holds is
    // affected; the callers are single-threaded (a forked child, a sandbox stub).
    unsafe { rustix::thread::unshare_unsafe(UnshareFlags::NEWCGROUP)? };
    for dir in &view.covered {
        mount(
            c"tmpfs",
            dir.as_c_str(),
            c"tmpfs",
            CGROUP_VIEW_FLAGS,
            MASK_OPTIONS,
        )?;
    }
    if view.unified {
        return mount(c"cgroup2", CGROUP_DIR, c"cgroup2", CGROUP_VIEW_FLAGS, c"").map_err(Into::into);
    }
    for h in &view.hierarchies {
        mount(
            c"cgroup",
            h.dir.as_c_str(),
            c"cgroup",
            CGROUP_VIEW_FLAGS,
            h.options.as_c_str(),
        )?;
    }
    Ok(())
}

/// The host's device nodes a plugin's `/dev` holds, each bound from the host's own (those the host has): a
/// node of a new `/dev` would need `mknod`, which a runtime may refuse.
const DEV_NODES: [&CStr; 6] = [
    c"/dev/null",
    c"/dev/zero",
    c"/dev/full",
    c"/dev/random",
    c"/dev/urandom",
    c"/dev/tty",
];

/// The symbolic links of a plugin's `/dev` (target, link).
const DEV_LINKS: [(&CStr, &CStr); 5] = [
    (c"/proc/self/fd", c"/dev/fd"),
    (c"/proc/self/fd/0", c"/dev/stdin"),
    (c"/proc/self/fd/1", c"/dev/stdout"),
    (c"/proc/self/fd/2", c"/dev/stderr"),
    (c"pts/ptmx", c"/dev/ptmx"),
];

/// The mount options of a plugin's `/dev` (its nodes are mounts of their own; it holds only their mount
/// points, the links and two directories).
const DEV_OPTIONS: &CStr = c"size=64k,nr_inodes=64,mode=755";

/// Where pseudo-terminals live; a new `devpts` instance of the plugin's own covers it.
const PTS_DIR: &CStr = c"/dev/pts";

/// The mount options of a plugin's `devpts`: an instance of its own (`newinstance`: the only kind since Linux
/// 4.7, said for older ones), whose `ptmx` anyone may open; new terminals are their opener's.
const PTS_OPTIONS: &CStr = c"newinstance,ptmxmode=0666,mode=0620";

/// Where POSIX shared memory lives; a private tmpfs covers it.
const SHM_DIR: &CStr = c"/dev/shm";

/// Replaces `/dev` in the caller's mount namespace by a minimal one: a new tmpfs (mode 0755, `nosuid`,
/// `nodev`, `noexec`) holding the host's [`DEV_NODES`] bound back (a bind mount keeps the node usable on a
/// `nodev` parent), a new `devpts` instance on `/dev/pts`, a private tmpfs on `/dev/shm` (`shm_options`) and
/// the links [`DEV_LINKS`]. Every other device of the host (`/dev/kmsg`, `/dev/kvm`, disks, the host's own
/// terminals) is absent. Allocation-free.
fn minimal_dev(shm_options: &CStr) -> io::Result<()> {
    // Detached copies of the host's nodes, taken before `/dev` is covered.
    let mut held: [Option<OwnedFd>; DEV_NODES.len()] = [const { None }; DEV_NODES.len()];
    for (slot, node) in held.iter_mut().zip(DEV_NODES) {
        *slot = match open_tree(
            CWD,
            node,
            OpenTreeFlags::OPEN_TREE_CLONE | OpenTreeFlags::OPEN_TREE_CLOEXEC,
        ) {
            Ok(tree) => Some(tree),
            Err(rustix::io::Errno::NOENT) => None,
            Err(e) => return Err(e.into()),
        };
    }
    mount(
        c"tmpfs",
        c"/dev",
        c"tmpfs",
        MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
        DEV_OPTIONS,
    )?;
    for (slot, node) in held.iter_mut().zip(DEV_NODES) {
        if let Some(tree) = slot.take() {
            drop(rustix::fs::open(
                node,
                OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC,
                Mode::empty(),
            )?);
            move_mount(&tree, c"", CWD, node, MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH)?;
        }
    }
    mkdir_exists_ok(PTS_DIR)?;
    mount(
        c"devpts",
        PTS_DIR,
        c"devpts",
        MountFlags::NOSUID | MountFlags::NOEXEC,
        PTS_OPTIONS,
    )?;
    mkdir_exists_ok(SHM_DIR)?;
    mount(
        c"tmpfs",
        SHM_DIR,
        c"tmpfs",
        MountFlags::NOSUID | MountFlags::NODEV,
        shm_options,
    )?;
    for (target, link) in DEV_LINKS {
        rustix::fs::symlinkat(target, CWD, link)?;
    }
    Ok(())
}

/// The private `/proc` (mounted with `proc_options`: other uids' processes hidden), a tmpfs on `tmp_root`, a
/// minimal `/dev` ([`minimal_dev`]) whose `/dev/shm` is a tmpfs too (both tmpfs with `tmp_options`) and the
/// skeleton of the cgroup view `cgroups` ([`cgroup_skeleton`]), in the caller's own mount namespace
/// ([`enter_namespaces`]). Session-independent: a stub does it before its claim. Allocation-free.
pub(super) fn mount_private_views(
    proc_options: &CStr,
    tmp_root: &CStr,
    tmp_options: &CStr,
    cgroups: &CgroupMounts,
) -> io::Result<()> {
    mount(
        c"proc",
        c"/proc",
        c"proc",
        MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
        proc_options,
    )?;
    mount(
        c"tmpfs",
        tmp_root,
        c"tmpfs",
        MountFlags::NOSUID | MountFlags::NODEV,
        tmp_options,
    )?;
    minimal_dev(tmp_options)?;
    cgroup_skeleton(cgroups)
}

/// `struct mount_attr` of `<linux/mount.h>` (`MOUNT_ATTR_SIZE_VER0`).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// `MOUNT_ATTR_RDONLY`.
const MOUNT_ATTR_RDONLY: u64 = 0x1;

/// Makes the mount at `path` (relative to `dir`; `dir` itself, a detached tree's descriptor, with an empty
/// path) and every mount beneath it read-only, or writable. Only the mounts' flag changes: a read-only
/// filesystem stays read-only. Allocation-free.
#[allow(unsafe_code)]
pub(super) fn set_read_only(dir: BorrowedFd<'_>, path: &CStr, read_only: bool) -> io::Result<()> {
    let attr = MountAttr {
        attr_set: if read_only { MOUNT_ATTR_RDONLY } else { 0 },
        attr_clr: if read_only { 0 } else { MOUNT_ATTR_RDONLY },
        propagation: 0,
        userns_fd: 0,
    };
    let empty = if path.is_empty() { libc::AT_EMPTY_PATH } else { 0 };
    let flags = libc::AT_RECURSIVE | empty;
    // SAFETY: mount_setattr(2) reads the NUL-terminated `path` and `size_of::<MountAttr>()` bytes of `attr`,
    // both alive for the call, and writes nothing of this process's memory.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            dir.as_raw_fd(),
            path.as_ptr(),
            flags,
            &raw const attr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Seals the host's filesystems in the caller's mount namespace: `/sys/fs/cgroup` shows the session's own
/// cgroups only ([`mount_own_cgroups`] on the skeleton [`mount_private_views`] made: a cgroup namespace), every
/// mount read-only, recursively from `/` (the
/// minimal `/dev` and its nodes included: a device node works on a read-only mount), then the private `/proc`,
/// `tmp_root` and `/dev/shm` writable again (the session's own directories are bound back writable after this:
/// [`mount_back`], [`bind_writable`]). Run after the session's cgroup was joined (`cgroup.procs` is on a host
/// mount). Allocation-free.
pub(super) fn seal_host(tmp_root: &CStr, cgroups: &CgroupMounts) -> io::Result<()> {
    mount_own_cgroups(cgroups)?;
    set_read_only(CWD, c"/", true)?;
    for dir in [c"/proc", tmp_root, SHM_DIR] {
        set_read_only(CWD, dir, false)?;
    }
    Ok(())
}

/// Binds the directory `path` (outside the private `/tmp`) back over itself writable, on the sealed host
/// ([`seal_host`]). Allocation-free.
pub(super) fn bind_writable(path: &CStr) -> io::Result<()> {
    let tree = open_tree(
        CWD,
        path,
        OpenTreeFlags::OPEN_TREE_CLONE | OpenTreeFlags::OPEN_TREE_CLOEXEC | OpenTreeFlags::AT_RECURSIVE,
    )?;
    set_read_only(tree.as_fd(), c"", false)?;
    move_mount(&tree, c"", CWD, path, MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH)?;
    Ok(())
}

/// Mounts the detached tree `tree` (a kept path's `open_tree` clone) at `path` in the private `/tmp`, after
/// creating `parents` (outermost first) and the mount point (a directory, or an empty file); the tree is
/// writable only when `writable` (it holds the session's TMPDIR or workspace). Allocation-free with `&CStr`
/// paths.
pub(super) fn mount_back<P: rustix::path::Arg + Copy>(
    tree: &OwnedFd,
    path: P,
    parents: impl IntoIterator<Item = P>,
    is_dir: bool,
    writable: bool,
) -> io::Result<()> {
    set_read_only(tree.as_fd(), c"", !writable)?;
    for dir in parents {
        mkdir_exists_ok(dir)?;
    }
    if is_dir {
        mkdir_exists_ok(path)?;
    } else {
        drop(rustix::fs::open(
            path,
            OFlags::WRONLY | OFlags::CREATE | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o644),
        )?);
    }
    move_mount(tree, c"", CWD, path, MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH)?;
    Ok(())
}

/// `mkdir` (mode 0755), an existing entry accepted.
fn mkdir_exists_ok<P: rustix::path::Arg>(path: P) -> io::Result<()> {
    match rustix::fs::mkdir(path, Mode::from_raw_mode(0o755)) {
        Ok(()) | Err(rustix::io::Errno::EXIST) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// The session's filters, last (after the id switch; `apply_filter` sets `PR_SET_NO_NEW_PRIVS` itself).
fn seccomp_child(confine: &Confinement) -> io::Result<()> {
    let Some(profile) = &confine.seccomp else {
        return Ok(());
    };
    for program in &profile.programs {
        seccompiler::apply_filter(program).map_err(|e| match e {
            seccompiler::Error::Prctl(e) | seccompiler::Error::Seccomp(e) => e,
            _ => io::ErrorKind::InvalidInput.into(),
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use std::os::unix::process::ExitStatusExt as _;

    fn pid_of(child: &std::process::Child) -> libc::pid_t {
        libc::pid_t::try_from(child.id()).unwrap()
    }

    #[test]
    #[allow(clippy::zombie_processes)] // reaped by `wait_exit`, which is what is tested
    fn a_child_that_ends_is_reaped_with_its_status() {
        let child = std::process::Command::new("/bin/sh")
            .args(["-c", "exit 7"])
            .spawn()
            .unwrap();
        let status = wait_exit(pid_of(&child), Duration::from_secs(30)).unwrap();
        assert!(libc::WIFEXITED(status));
        assert_eq!(libc::WEXITSTATUS(status), 7);
    }

    #[test]
    fn a_child_still_running_at_the_limit_is_killed_and_reported() {
        let mut child = std::process::Command::new("/bin/sh")
            .args(["-c", "exec sleep 600"])
            .spawn()
            .unwrap();
        let e = wait_exit(pid_of(&child), Duration::from_millis(20)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        // Killed: reaped already by `wait_exit` (no child left to wait for), or a zombie killed by SIGKILL.
        match child.wait() {
            Err(e) => assert_eq!(e.raw_os_error(), Some(libc::ECHILD)),
            Ok(status) => assert_eq!(status.signal(), Some(libc::SIGKILL)),
        }
    }
}
