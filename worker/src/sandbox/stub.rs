//! The sandbox stub: a process the worker starts ahead of need ([`super::stub_pool`]) that confines itself as far
//! as nothing session-specific is involved, then waits on its stdin for a session to claim it and becomes that
//! session's plugin (`exec`). It takes the worker's `fork` and the namespace work off a session's cold start.
//!
//! # Life of a stub
//!
//! 1. The worker spawns `<program> __fleet-sandbox-stub <status fd>` with the plugin's three stdio pipes and an
//!    empty environment; `<status fd>` is the write end of a pipe whose read end the worker keeps (its
//!    close-on-exec flag cleared for this one `exec` only). `<program>` is the worker's own binary
//!    (`/proc/self/exe`: `fleet` calls [`run_if_stub`] first thing) or `fleet-sandbox-stub` (this crate's bin,
//!    for tests and benches that link the worker as a library).
//! 2. It reads a [`Setup`] from stdin (one length-prefixed JSON message), then: `setsid`; new network, mount,
//!    IPC and UTS namespaces (one `unshare`: this process has a single thread); `lo` up; mount propagation
//!    private; `O_PATH` descriptors of `/tmp` and `/sys/fs/cgroup` as they are, kept to reach the session's
//!    paths and `cgroup.procs` under them later; a private `/proc` (`hidepid`), a tmpfs on `/tmp`, a minimal
//!    `/dev` (the host's `null`, `zero`, `full`, `random`, `urandom`, `tty`, a `devpts` of its own, a tmpfs on
//!    `/dev/shm`) and the skeleton of the cgroup view (v1: an empty tmpfs on `/sys/fs/cgroup` with a directory
//!    per hierarchy). It writes `R` on the status pipe: ready.
//! 3. It blocks reading a [`Claim`]. EOF (the worker dropped it, or died) ends it quietly.
//! 4. On a claim: join the session's cgroup in every hierarchy (`cgroup.procs` ← `0`, through the kept
//!    descriptor), seal the host's mounts (`spawn.rs`'s `seal_host`: only now, as `cgroup.procs` is on one of
//!    them — a cgroup namespace rooted at the session's cgroup, that cgroup's own hierarchies mounted on the
//!    skeleton, the [`Setup`]'s view, then everything read-only), mount the session's paths under `/tmp` back into its private `/tmp` (`open_tree`
//!    through the kept descriptor, `move_mount`; writable where they hold its TMPDIR or workspace) and bind its
//!    writable directories elsewhere back writable,
//!    drop supplementary groups and switch gid and uid (real, effective, saved), `PR_SET_NO_NEW_PRIVS`, mark
//!    every descriptor above stderr close-on-exec ([`cloexec_above_stderr`]), install the seccomp filters
//!    (last), and `exec` the plugin with the claim's argv, environment and working directory
//!    (`std::process::Command::exec`, so the program is resolved exactly as a direct spawn resolves it). The
//!    status pipe is close-on-exec: the worker reads EOF when the `exec` succeeded, and the plugin starts with
//!    descriptors 0, 1 and 2 only.
//! 5. Any failure writes `E`, the [`Step`] and the `errno` (6 bytes) on the status pipe and exits 1: the worker
//!    reports it as the spawn error a direct spawn would have given.
//!
//! The order of the confinement steps is the direct spawn's (`spawn.rs`): the namespaces before the ids (they
//! need `CAP_SYS_ADMIN`), the filters last. What differs is only when the session-independent half happens.
//!
//! The stub writes nothing on stdout or stderr: they are the plugin's.
//!
//! # `unsafe`
//!
//! Two blocks about the status descriptor the worker passed by number (checking that it is open, and taking
//! ownership of it), and [`cloexec_above_stderr`]'s `close_range(2)` (rustix has no wrapper: one raw `syscall`
//! with three integers; the direct spawn's hook calls it too). The namespaces and mounts are `spawn.rs`'s own functions, shared with the direct
//! spawn (`enter_namespaces`, `mount_private_views`, `seal_host`, `mount_back`, `bind_writable`).

use std::ffi::{CString, OsStr};
use std::io::{self, Write as _};
use std::os::fd::{FromRawFd as _, OwnedFd};
use std::os::unix::process::CommandExt as _;

use rustix::fs::{Mode, OFlags};
use rustix::mount::OpenTreeFlags;
use rustix::process::Gid;

use super::confine::{CGROUP_ROOT, CgroupMounts};
use super::spawn::{bind_writable, enter_namespaces, mount_back, mount_private_views, seal_host};
use super::stub_msg::{
    Claim, FAILED, FAILURE_BYTES, KeptPath, READY, STUB_ARG, STUB_PROTOCOL, Setup, Step, read_message,
};

/// If this process was started as a stub (`argv[1]` is [`STUB_ARG`]), runs it and exits; otherwise returns at
/// once. Call it first thing in `main` of a binary that a worker uses as its stub program.
pub fn run_if_stub() {
    let mut args = std::env::args_os().skip(1);
    if args.next().as_deref() != Some(OsStr::new(STUB_ARG)) {
        return;
    }
    let fd = args
        .next()
        .and_then(|a| a.to_str().and_then(|s| s.parse::<i32>().ok()))
        .filter(|fd| *fd > 2);
    let code = match fd.and_then(status_fd) {
        Some(status) => run(status),
        None => 2,
    };
    std::process::exit(code);
}

/// Takes the status descriptor `fd` if it is open, and marks it close-on-exec.
#[allow(unsafe_code)]
fn status_fd(fd: i32) -> Option<OwnedFd> {
    // SAFETY: only checks whether `fd` is open; the borrow ends with the call.
    let open = rustix::io::fcntl_getfd(unsafe { rustix::fd::BorrowedFd::borrow_raw(fd) }).is_ok();
    if !open {
        return None;
    }
    // SAFETY: the worker left exactly this descriptor open for the stub (the `<status fd>` argument), nothing
    // else in this fresh process refers to it, and it is owned from here on.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    rustix::io::fcntl_setfd(&owned, rustix::io::FdFlags::CLOEXEC).ok()?;
    Some(owned)
}

/// The stub's life (module documentation); the exit code when it does not `exec`.
fn run(status: OwnedFd) -> i32 {
    let mut status = std::fs::File::from(status);
    let mut stdin = RawStdin;
    let fail = |status: &mut std::fs::File, step: Step, e: &io::Error| {
        let errno = e.raw_os_error().unwrap_or(libc::EIO);
        let mut report = [0u8; FAILURE_BYTES];
        report[0] = FAILED;
        report[1] = step as u8;
        report[2..].copy_from_slice(&errno.to_le_bytes());
        let _ = status.write_all(&report);
        1
    };
    let setup: Setup = match read_message(&mut stdin) {
        Ok(Some(s)) => s,
        Ok(None) => return 0,
        Err(e) => return fail(&mut status, Step::Message, &e),
    };
    if setup.protocol != STUB_PROTOCOL {
        return fail(
            &mut status,
            Step::Message,
            &io::Error::from_raw_os_error(libc::EPROTO),
        );
    }
    let confined = match confine(&setup) {
        Ok(confined) => confined,
        Err(e) => return fail(&mut status, Step::Confine, &e),
    };
    if status.write_all(&[READY]).is_err() {
        return 1;
    }
    let claim: Claim = match read_message(&mut stdin) {
        Ok(Some(c)) => c,
        Ok(None) => return 0,
        Err(e) => return fail(&mut status, Step::Message, &e),
    };
    let (step, e) = become_plugin(&setup, &confined, &claim);
    fail(&mut status, step, &e)
}

/// Fd 0, unbuffered: the stub must not read a byte past its claim (what follows is the plugin's first request).
struct RawStdin;

impl io::Read for RawStdin {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match rustix::io::read(rustix::stdio::stdin(), &mut *buf) {
                Err(rustix::io::Errno::INTR) => {}
                other => return other.map_err(Into::into),
            }
        }
    }
}

/// What step 2 leaves for the claim.
struct Confined {
    /// The `O_PATH` descriptor of `/tmp` as it was, to reach the session's paths under it.
    tmp: OwnedFd,
    /// `/tmp` as the worker resolves it (the setup's).
    tmp_root: CString,
    /// What the plugin is to see under `/sys/fs/cgroup` (the setup's).
    cgroups: CgroupMounts,
    /// The `O_PATH` descriptor of `/sys/fs/cgroup` as it was (none where the host has none), to reach the
    /// session's `cgroup.procs` beneath the cgroup view's skeleton.
    cgroup_root: Option<OwnedFd>,
}

/// Step 2: the session-independent confinement.
fn confine(setup: &Setup) -> io::Result<Confined> {
    let c = |s: &str| CString::new(s).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL));
    let (tmp_root, tmp_options, proc_options) = (
        c(&setup.tmp_root)?,
        c(&setup.tmp_options)?,
        c(&setup.proc_options)?,
    );
    let cgroups =
        CgroupMounts::new(&setup.cgroups).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    rustix::process::setsid()?;
    enter_namespaces(true)?;
    let tmp = rustix::fs::open(
        tmp_root.as_c_str(),
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let cgroup_root = match rustix::fs::open(
        CGROUP_ROOT,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => Some(fd),
        Err(rustix::io::Errno::NOENT) => None,
        Err(e) => return Err(e.into()),
    };
    mount_private_views(&proc_options, &tmp_root, &tmp_options, &cgroups)?;
    Ok(Confined {
        tmp,
        tmp_root,
        cgroups,
        cgroup_root,
    })
}

/// Step 4; returns only on failure.
fn become_plugin(setup: &Setup, confined: &Confined, claim: &Claim) -> (Step, io::Error) {
    let einval = || io::Error::from_raw_os_error(libc::EINVAL);
    if claim.uid == Some(u32::MAX) || claim.gid == Some(u32::MAX) || claim.argv.is_empty() {
        return (Step::Message, einval());
    }
    for file in &claim.procs {
        if let Err(e) = join(confined.cgroup_root.as_ref(), file) {
            return (Step::Cgroup, e);
        }
    }
    // Sealed only now: `cgroup.procs` is on a host mount (and the cgroup namespace is rooted where the stub is).
    if let Err(e) = seal_host(&confined.tmp_root, &confined.cgroups) {
        return (Step::Mounts, e);
    }
    for kept in &claim.kept {
        if let Err(e) = mount_kept(&confined.tmp, kept) {
            return (Step::Mounts, e);
        }
    }
    for path in &claim.writable {
        let bound = CString::new(path.as_str())
            .map_err(|_| einval())
            .and_then(|p| bind_writable(&p));
        if let Err(e) = bound {
            return (Step::Mounts, e);
        }
    }
    if let Err(e) = switch_ids(claim) {
        return (Step::Ids, e);
    }
    if let Err(e) = cloexec_above_stderr() {
        return (Step::Descriptors, e);
    }
    for program in &setup.seccomp {
        let program: seccompiler::BpfProgram = program
            .iter()
            .map(|&(code, jt, jf, k)| seccompiler::sock_filter { code, jt, jf, k })
            .collect();
        if let Err(e) = seccompiler::apply_filter(&program) {
            let e = match e {
                seccompiler::Error::Prctl(e) | seccompiler::Error::Seccomp(e) => e,
                _ => einval(),
            };
            return (Step::Seccomp, e);
        }
    }
    let e = std::process::Command::new(&claim.argv[0])
        .args(&claim.argv[1..])
        .env_clear()
        .envs(claim.env.iter().map(|(k, v)| (k, v)))
        .current_dir(&claim.cwd)
        .exec();
    (Step::Exec, e)
}

/// Marks every descriptor above stderr close-on-exec: `close_range(3, ~0, CLOSE_RANGE_CLOEXEC)` (Linux ≥ 5.11,
/// below the 5.12 the read-only view needs). Whatever the worker — or whoever started the worker — left open
/// without the flag is gone at the `exec`, so a plugin starts with 0, 1 and 2 only; a descriptor still needed
/// until the `exec` stays usable (a stub's status pipe, std's exec-error pipe of a direct spawn, which a plain
/// `close_range` would break). Run by the stub before its `exec` and by the direct spawn's hook (`spawn.rs`'s
/// `child_setup`): one raw system call, async-signal-safe and allocation-free.
#[allow(unsafe_code)]
pub(super) fn cloexec_above_stderr() -> io::Result<()> {
    // SAFETY: close_range(2) takes three integers and reads or writes no memory of this process; with
    // CLOSE_RANGE_CLOEXEC it closes nothing, so no `OwnedFd` of this process is invalidated.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3 as libc::c_uint,
            libc::c_uint::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Moves this process into the cgroup whose `cgroup.procs` is `file`: beneath `/sys/fs/cgroup` through
/// `cgroup_root` (the descriptor of it from before the cgroup view's skeleton covered it), elsewhere by its path.
fn join(cgroup_root: Option<&OwnedFd>, file: &str) -> io::Result<()> {
    let flags = OFlags::WRONLY | OFlags::CLOEXEC;
    let beneath = file
        .strip_prefix(CGROUP_ROOT)
        .and_then(|rest| rest.strip_prefix('/'));
    let fd = match (cgroup_root, beneath) {
        (Some(root), Some(relative)) => rustix::fs::openat(root, relative, flags, Mode::empty())?,
        _ => rustix::fs::open(file, flags, Mode::empty())?,
    };
    let mut f = std::fs::File::from(fd);
    f.write_all(b"0")
}

/// Mounts `kept` (found through the descriptor of the old `/tmp`) at its path in the private `/tmp`.
fn mount_kept(tmp: &OwnedFd, kept: &KeptPath) -> io::Result<()> {
    let tree = rustix::mount::open_tree(
        tmp,
        kept.relative.as_str(),
        OpenTreeFlags::OPEN_TREE_CLONE | OpenTreeFlags::OPEN_TREE_CLOEXEC | OpenTreeFlags::AT_RECURSIVE,
    )?;
    mount_back(
        &tree,
        kept.path.as_str(),
        kept.parents.iter().map(String::as_str),
        kept.is_dir,
        kept.writable,
    )
}

/// Groups, gid, uid, no new privileges — the direct spawn's own steps.
fn switch_ids(claim: &Claim) -> io::Result<()> {
    let groups: Vec<Gid> = claim.groups.iter().map(|g| Gid::from_raw(*g)).collect();
    super::spawn::switch_ids(claim.uid, claim.gid, &groups)
}
