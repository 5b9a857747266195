//! The messages between a worker and its sandbox stubs (`stub.rs`, `stub_pool.rs`): what every stub does before
//! it is claimed ([`Setup`]), what a session asks of it ([`Claim`]), each a little-endian `u32` length and that
//! many bytes of JSON on the stub's stdin; and the status bytes it answers on its status pipe. A private
//! protocol between a worker and the copies of its own binary it starts, not a wire of the product.

use std::io;

use serde::{Deserialize, Serialize};

/// `argv[1]` of a stub.
pub const STUB_ARG: &str = "__fleet-sandbox-stub";

/// The version of the messages below and of the confinement they ask for: a stub from another build refuses a
/// setup it was not built for (3: the minimal `/dev`, the session's own cgroups in a cgroup namespace).
pub(crate) const STUB_PROTOCOL: u32 = 3;

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
    /// What the plugin sees under `/sys/fs/cgroup` (mounted on the claim, in a cgroup namespace rooted at the
    /// session's cgroup).
    pub(crate) cgroups: super::confine::CgroupView,
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
    /// The session's writable directories outside `/tmp`, bound back writable over the read-only host.
    pub(crate) writable: Vec<String>,
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
    /// Mounted writable, else read-only.
    pub(crate) writable: bool,
}

/// Where a stub failed (the byte after [`FAILED`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Step {
    /// Reading or parsing a message (or a setup of another protocol).
    Message = 1,
    /// `setsid`, the namespaces, `lo`, the private `/proc`, `/tmp` and `/dev`.
    Confine = 2,
    /// Joining the session's cgroup.
    Cgroup = 3,
    /// Sealing the host's mounts (read-only; the session's own cgroups, in a cgroup namespace) and mounting the
    /// session's paths back.
    Mounts = 4,
    /// Groups, gid, uid, no-new-privileges.
    Ids = 5,
    /// Marking the descriptors above stderr close-on-exec.
    Descriptors = 8,
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
            Step::Descriptors,
            Step::Seccomp,
            Step::Exec,
        ]
        .into_iter()
        .find(|s| *s as u8 == b)
    }

    /// What the step does, for errors.
    pub fn describe(self) -> &'static str {
        match self {
            Step::Message => "reading its instructions",
            Step::Confine => "entering its namespaces",
            Step::Cgroup => "joining the session's cgroup",
            Step::Mounts => "mounting the session's paths",
            Step::Ids => "switching to the plugin's ids",
            Step::Descriptors => "marking the worker's descriptors close-on-exec",
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

/// Reads one message; `None` on EOF before its first byte.
pub(crate) fn read_message<T: serde::de::DeserializeOwned>(
    input: &mut impl io::Read,
) -> io::Result<Option<T>> {
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
            writable: vec!["/var/lib/fleet/users/k/tmp/t".into()],
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
