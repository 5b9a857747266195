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
//!    private; an `O_PATH` descriptor of `/tmp` as it is, kept to reach the session's paths under it later;
//!    a private `/proc` (`hidepid`) and a tmpfs on `/tmp`. It writes `R` on the status pipe: ready.
//! 3. It blocks reading a [`Claim`]. EOF (the worker dropped it, or died) ends it quietly.
//! 4. On a claim: join the session's cgroup in every hierarchy (`cgroup.procs` ← `0`), mount the session's
//!    paths under `/tmp` back into its private `/tmp` (`open_tree` through the kept descriptor, `move_mount`),
//!    drop supplementary groups and switch gid and uid (real, effective, saved), `PR_SET_NO_NEW_PRIVS`, install
//!    the seccomp filters (last), and `exec` the plugin with the claim's argv, environment and working directory
//!    (`std::process::Command::exec`, so the program is resolved exactly as a direct spawn resolves it). The
//!    status pipe is close-on-exec: the worker reads EOF when the `exec` succeeded.
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
//! Two blocks: taking ownership of the status descriptor the worker passed by number (checked open first), and
//! `unshare` (safe here: the stub is single-threaded, and no flag is `CLONE_FILES`).

use std::ffi::{CString, OsStr};
use std::io::{self, Write as _};
use std::os::fd::{FromRawFd as _, OwnedFd};
use std::os::unix::process::CommandExt as _;

use rustix::fs::{CWD, Mode, OFlags};
use rustix::mount::{MountFlags, MountPropagationFlags, MoveMountFlags, OpenTreeFlags};
use rustix::process::Gid;
use rustix::thread::UnshareFlags;
use serde::{Deserialize, Serialize};

use super::netns::loopback_up;
use super::spawn::mkdir_exists_ok;

/// `argv[1]` of a stub.
pub const STUB_ARG: &str = "__fleet-sandbox-stub";

/// The version of the messages below: a stub from another build refuses a setup it was not built for.
pub(crate) const STUB_PROTOCOL: u32 = 1;

/// Largest message the stub accepts (a claim carries the plugin's argv and environment).
pub(crate) const MAX_MESSAGE_BYTES: usize = 1024 * 1024;

/// The status byte of a stub that is confined and waiting for a claim.
pub(crate) const READY: u8 = b'R';
/// The status byte of a failure (followed by the [`Step`] and the `errno`, little-endian).
pub(crate) const FAILED: u8 = b'E';
/// Length of a failure report.
pub(crate) const FAILURE_BYTES: usize = 6;

/// What every stub of a worker does before it is claimed.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Setup {
    /// [`STUB_PROTOCOL`] of the worker.
    pub(crate) protocol: u32,
    /// `/tmp` as the worker resolves it.
    pub(crate) tmp_root: String,
    /// Mount options of the private `/tmp`.
    pub(crate) tmp_options: String,
    /// Mount options of the private `/proc`.
    pub(crate) proc_options: String,
    /// The seccomp programs, instruction by instruction (`code`, `jt`, `jf`, `k`), applied in order.
    pub(crate) seccomp: Vec<Vec<(u16, u8, u8, u32)>>,
}

/// What a session asks of a waiting stub.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Claim {
    /// `cgroup.procs` of each of the session's hierarchies.
    pub(crate) procs: Vec<String>,
    /// The ids to switch to (none: keep the worker's).
    pub(crate) uid: Option<u32>,
    pub(crate) gid: Option<u32>,
    /// Supplementary groups after the switch.
    pub(crate) groups: Vec<u32>,
    /// The session's paths under `/tmp` to mount back in.
    pub(crate) kept: Vec<KeptPath>,
    /// The plugin's command line, environment and working directory.
    pub(crate) argv: Vec<String>,
    pub(crate) env: Vec<(String, String)>,
    pub(crate) cwd: String,
}

/// One path under `/tmp` of a [`Claim`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct KeptPath {
    /// Absolute.
    pub(crate) path: String,
    /// Relative to `/tmp`, for the lookup through the kept descriptor.
    pub(crate) relative: String,
    /// Ancestors strictly between `/tmp` and it, outermost first.
    pub(crate) parents: Vec<String>,
    pub(crate) is_dir: bool,
}

/// Where a stub failed (the byte after [`FAILED`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Step {
    /// Reading or parsing a message (or a setup of another protocol).
    Message = 1,
    /// `setsid`, the namespaces, `lo`, the private `/proc` and `/tmp`.
    Confine = 2,
    /// Joining the session's cgroup.
    Cgroup = 3,
    /// Mounting the session's paths into the private `/tmp`.
    Mounts = 4,
    /// Groups, gid, uid, no-new-privileges.
    Ids = 5,
    /// The seccomp filters.
    Seccomp = 6,
    /// The `exec` of the plugin.
    Exec = 7,
}

impl Step {
    /// The step of a failure report's second byte.
    pub(crate) fn from_byte(b: u8) -> Option<Step> {
        [
            Step::Message,
            Step::Confine,
            Step::Cgroup,
            Step::Mounts,
            Step::Ids,
            Step::Seccomp,
            Step::Exec,
        ]
        .into_iter()
        .find(|s| *s as u8 == b)
    }

    /// What the step does, for errors.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Step::Message => "reading its instructions",
            Step::Confine => "entering its namespaces",
            Step::Cgroup => "joining the session's cgroup",
            Step::Mounts => "mounting the session's paths",
            Step::Ids => "switching to the plugin's ids",
            Step::Seccomp => "installing the seccomp filters",
            Step::Exec => "executing the plugin",
        }
    }
}

/// A message on the stub's stdin: a little-endian `u32` length, then that many bytes of JSON.
pub(crate) fn frame<T: Serialize>(message: &T) -> io::Result<Vec<u8>> {
    let body = serde_json::to_vec(message)?;
    if body.len() > MAX_MESSAGE_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "the stub message is too large",
        ));
    }
    let len = u32::try_from(body.len()).map_err(io::Error::other)?;
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

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
    let tmp = match confine(&setup) {
        Ok(tmp) => tmp,
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
    let (step, e) = become_plugin(&setup, &tmp, &claim);
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

/// Reads one message; `None` on EOF before its first byte.
fn read_message<T: serde::de::DeserializeOwned>(input: &mut impl io::Read) -> io::Result<Option<T>> {
    let mut len = [0u8; 4];
    match input.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_MESSAGE_BYTES {
        return Err(io::Error::from_raw_os_error(libc::EMSGSIZE));
    }
    let mut body = vec![0u8; len];
    input.read_exact(&mut body)?;
    serde_json::from_slice(&body)
        .map(Some)
        .map_err(|_| io::Error::from_raw_os_error(libc::EBADMSG))
}

/// Step 2: the session-independent confinement. Returns the `O_PATH` descriptor of `/tmp` as it was.
#[allow(unsafe_code)]
fn confine(setup: &Setup) -> io::Result<OwnedFd> {
    let c = |s: &str| CString::new(s).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL));
    let (tmp_root, tmp_options, proc_options) = (
        c(&setup.tmp_root)?,
        c(&setup.tmp_options)?,
        c(&setup.proc_options)?,
    );
    rustix::process::setsid()?;
    // SAFETY: the stub has a single thread, so no other thread can observe the unshared tables; none of these
    // flags is CLONE_FILES.
    unsafe {
        rustix::thread::unshare_unsafe(
            UnshareFlags::NEWNET | UnshareFlags::NEWNS | UnshareFlags::NEWIPC | UnshareFlags::NEWUTS,
        )?;
    }
    loopback_up()?;
    rustix::mount::mount_change(c"/", MountPropagationFlags::REC | MountPropagationFlags::PRIVATE)?;
    let tmp = rustix::fs::open(
        tmp_root.as_c_str(),
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    rustix::mount::mount(
        c"proc",
        c"/proc",
        c"proc",
        MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
        proc_options.as_c_str(),
    )?;
    rustix::mount::mount(
        c"tmpfs",
        tmp_root.as_c_str(),
        c"tmpfs",
        MountFlags::NOSUID | MountFlags::NODEV,
        tmp_options.as_c_str(),
    )?;
    Ok(tmp)
}

/// Step 4; returns only on failure.
fn become_plugin(setup: &Setup, tmp: &OwnedFd, claim: &Claim) -> (Step, io::Error) {
    let einval = || io::Error::from_raw_os_error(libc::EINVAL);
    if claim.uid == Some(u32::MAX) || claim.gid == Some(u32::MAX) || claim.argv.is_empty() {
        return (Step::Message, einval());
    }
    for file in &claim.procs {
        if let Err(e) = join(file) {
            return (Step::Cgroup, e);
        }
    }
    for kept in &claim.kept {
        if let Err(e) = mount_kept(tmp, kept) {
            return (Step::Mounts, e);
        }
    }
    if let Err(e) = switch_ids(claim) {
        return (Step::Ids, e);
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

/// Moves this process into the cgroup whose `cgroup.procs` is `file`.
fn join(file: &str) -> io::Result<()> {
    let mut f = std::fs::OpenOptions::new().write(true).open(file)?;
    f.write_all(b"0")
}

/// Mounts `kept` (found through the descriptor of the old `/tmp`) at its path in the private `/tmp`.
fn mount_kept(tmp: &OwnedFd, kept: &KeptPath) -> io::Result<()> {
    let tree = rustix::mount::open_tree(
        tmp,
        kept.relative.as_str(),
        OpenTreeFlags::OPEN_TREE_CLONE | OpenTreeFlags::OPEN_TREE_CLOEXEC | OpenTreeFlags::AT_RECURSIVE,
    )?;
    for dir in &kept.parents {
        mkdir_exists_ok(dir.as_str())?;
    }
    if kept.is_dir {
        mkdir_exists_ok(kept.path.as_str())?;
    } else {
        drop(rustix::fs::open(
            kept.path.as_str(),
            OFlags::WRONLY | OFlags::CREATE | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o644),
        )?);
    }
    rustix::mount::move_mount(
        &tree,
        c"",
        CWD,
        kept.path.as_str(),
        MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
    )?;
    Ok(())
}

/// Groups, gid, uid, no new privileges — the direct spawn's own steps.
fn switch_ids(claim: &Claim) -> io::Result<()> {
    let groups: Vec<Gid> = claim.groups.iter().map(|g| Gid::from_raw(*g)).collect();
    super::spawn::switch_ids(claim.uid, claim.gid, &groups)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_framed_message_reads_back_and_eof_is_none() {
        let claim = Claim {
            procs: vec!["/sys/fs/cgroup/x/cgroup.procs".into()],
            uid: Some(1000),
            gid: Some(1000),
            groups: vec![],
            kept: vec![],
            argv: vec!["/bin/true".into()],
            env: vec![("PATH".into(), "/usr/bin".into())],
            cwd: "/".into(),
        };
        let bytes = frame(&claim).unwrap();
        let mut input = &bytes[..];
        let back: Claim = read_message(&mut input).unwrap().unwrap();
        assert_eq!(back.argv, claim.argv);
        assert!(read_message::<Claim>(&mut input).unwrap().is_none());
    }

    #[test]
    fn an_oversized_or_broken_message_is_refused() {
        let mut big = (u32::try_from(MAX_MESSAGE_BYTES).unwrap() + 1)
            .to_le_bytes()
            .to_vec();
        big.extend_from_slice(b"{}");
        let e = read_message::<Claim>(&mut &big[..]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EMSGSIZE));
        let mut bad = 3u32.to_le_bytes().to_vec();
        bad.extend_from_slice(b"{x}");
        let e = read_message::<Claim>(&mut &bad[..]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EBADMSG));
        let mut short = 10u32.to_le_bytes().to_vec();
        short.extend_from_slice(b"{}");
        assert!(read_message::<Claim>(&mut &short[..]).is_err());
    }

    #[test]
    fn every_step_round_trips_its_byte() {
        for b in 0..=255u8 {
            if let Some(step) = Step::from_byte(b) {
                assert_eq!(step as u8, b);
                assert!(!step.describe().is_empty());
            }
        }
        assert_eq!(Step::from_byte(0), None);
        assert_eq!(Step::from_byte(Step::Exec as u8), Some(Step::Exec));
    }
}
