//! The seccomp profile every plugin runs under: compiled once per worker (seccompiler, Firecracker's BPF
//! compiler), installed by the spawn hook as the last step before `exec` (after the uid switch and
//! `PR_SET_NO_NEW_PRIVS`), inherited by everything the plugin starts.
//!
//! It is a deny list on top of "allow": plugins are arbitrary programs (CPython, Node, Go binaries), and an
//! allow list tight enough to matter breaks some of them with every runtime release. What it takes away is
//! the kernel surface no tool plugin needs and every container escape of the last years went through:
//!
//! | refused with `EPERM`                                           | why                                             |
//! |----------------------------------------------------------------|-------------------------------------------------|
//! | `unshare`, `clone` with `CLONE_NEWUSER`; `setns`                | a user namespace hands out `CAP_SYS_ADMIN` over nf_tables, mounts, … |
//! | `mount`, `umount2`, `pivot_root`, `chroot`, the new mount API (`open_tree`, `move_mount`, `fsopen`, `fsconfig`, `fsmount`, `fspick`, `mount_setattr`) | the session's mount namespace is the worker's to shape |
//! | `ptrace`, `process_vm_readv`, `process_vm_writev`, `kcmp`       | no reading or steering another process           |
//! | `bpf`, `perf_event_open`, `userfaultfd`, `io_uring_setup`, `io_uring_enter`, `io_uring_register` | big, often-exploited kernel interfaces |
//! | `keyctl`, `add_key`, `request_key`                              | the kernel keyring is shared per uid             |
//! | `kexec_load`, `kexec_file_load`, `init_module`, `finit_module`, `delete_module`, `reboot`, `swapon`, `swapoff`, `acct`, `quotactl`, `syslog`, `settimeofday`, `clock_settime`, `clock_adjtime`, `adjtimex`, `open_by_handle_at`, `name_to_handle_at` | node administration |
//!
//! and `clone3` with `ENOSYS`: its flags live in a structure a filter cannot read, so a plugin could pass
//! `CLONE_NEWUSER` there; `ENOSYS` makes glibc, musl and Go fall back to `clone`, where the flag is checked
//! (what Docker's default profile does).
//!
//! Operators add names with `confinement.seccomp_deny` in the worker configuration (refused with `EPERM` like
//! the defaults); an unknown name is a configuration error at start, not a silently missing rule.

use std::collections::BTreeSet;

use seccompiler::{BpfProgram, TargetArch};
use serde_json::{Value, json};

/// `CLONE_NEWUSER` (the same bit for `clone` and `unshare`).
const CLONE_NEWUSER: u64 = 0x1000_0000;

/// `EPERM`: what a refused call returns.
const EPERM: u32 = 1;

/// `ENOSYS`: what `clone3` returns, so C libraries fall back to `clone`.
const ENOSYS: u32 = 38;

/// Refused unconditionally (see the module documentation).
pub const DENIED: &[&str] = &[
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "keyctl",
    "add_key",
    "request_key",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "syslog",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "open_by_handle_at",
    "name_to_handle_at",
];

/// Refused when their flags argument (argument 0) has `CLONE_NEWUSER`.
pub const DENIED_WITH_NEWUSER: &[&str] = &["unshare", "clone"];

/// Answered with `ENOSYS`.
pub const NOT_IMPLEMENTED: &[&str] = &["clone3"];

/// Why the profile could not be compiled.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    /// This CPU architecture has no syscall table in seccompiler.
    #[error("seccomp filters are not supported on {0}")]
    Arch(&'static str),
    /// A name is not a system call of this architecture, or the filter does not compile.
    #[error("the seccomp profile does not compile: {0}")]
    Compile(String),
}

/// The compiled filters, in the order they are installed.
#[derive(Debug, Clone, PartialEq)]
pub struct SeccompProfile {
    pub(crate) programs: Vec<BpfProgram>,
}

impl SeccompProfile {
    /// The default profile plus `extra` names refused with `EPERM`.
    pub fn compile(extra: &[String]) -> Result<SeccompProfile, SeccompError> {
        let arch = TargetArch::try_from(std::env::consts::ARCH)
            .map_err(|_| SeccompError::Arch(std::env::consts::ARCH))?;
        let text = profile_json(extra).to_string();
        let mut map = seccompiler::compile_from_json(text.as_bytes(), arch)
            .map_err(|e| SeccompError::Compile(e.to_string()))?;
        let mut programs = Vec::with_capacity(2);
        for name in ["deny", "nosys"] {
            let program = map
                .remove(name)
                .ok_or_else(|| SeccompError::Compile(format!("filter {name} missing")))?;
            programs.push(program);
        }
        Ok(SeccompProfile { programs })
    }
}

/// The profile in seccompiler's JSON form (documented in the module header; also what `fleet` prints for
/// operators who want to see it).
pub fn profile_json(extra: &[String]) -> Value {
    let names: BTreeSet<&str> = DENIED
        .iter()
        .copied()
        .chain(extra.iter().map(String::as_str))
        .filter(|n| !DENIED_WITH_NEWUSER.contains(n) && !NOT_IMPLEMENTED.contains(n))
        .collect();
    let mut deny: Vec<Value> = names.iter().map(|n| json!({ "syscall": n })).collect();
    for name in DENIED_WITH_NEWUSER {
        deny.push(json!({
            "syscall": name,
            "args": [{
                "index": 0, "type": "qword", "op": { "masked_eq": CLONE_NEWUSER }, "val": CLONE_NEWUSER,
                "comment": "CLONE_NEWUSER"
            }]
        }));
    }
    let nosys: Vec<Value> = NOT_IMPLEMENTED.iter().map(|n| json!({ "syscall": n })).collect();
    json!({
        "deny": { "mismatch_action": "allow", "match_action": { "errno": EPERM }, "filter": deny },
        "nosys": { "mismatch_action": "allow", "match_action": { "errno": ENOSYS }, "filter": nosys },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_profile_compiles_and_an_operator_name_is_added() {
        let base = SeccompProfile::compile(&[]).unwrap();
        assert_eq!(base.programs.len(), 2);
        let more = SeccompProfile::compile(&["uname".to_owned()]).unwrap();
        assert!(more.programs[0].len() > base.programs[0].len());
        // A name already denied, or one of the conditional ones, adds nothing twice.
        let same = SeccompProfile::compile(&["ptrace".to_owned(), "clone".to_owned()]).unwrap();
        assert_eq!(same, base);
    }

    #[test]
    fn an_unknown_syscall_name_is_a_compile_error() {
        let err = SeccompProfile::compile(&["no_such_call".to_owned()]).unwrap_err();
        assert!(matches!(err, SeccompError::Compile(_)), "{err}");
    }
}
