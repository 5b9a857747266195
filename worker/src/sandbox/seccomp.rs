//! The seccomp profile every plugin runs under: compiled once per worker (seccompiler, Firecracker's BPF
//! compiler, plus one small program of this module), installed by the spawn hook as the last step before `exec`
//! (after the uid switch and `PR_SET_NO_NEW_PRIVS`), inherited by everything the plugin starts.
//!
//! It is a deny list on top of "allow". What it takes away is the kernel surface no tool plugin needs and every
//! container escape of the last years went through:
//!
//! | refused with `EPERM`                                           | why                                             |
//! |----------------------------------------------------------------|-------------------------------------------------|
//! | every number ≥ `0x40000000` (x86_64's x32 ABI: `__X32_SYSCALL_BIT` set) | the other rules match numbers, and an x32 call is the same call under another number with the same `AUDIT_ARCH_X86_64`; no supported architecture has a system call there |
//! | `unshare`, `clone` with `CLONE_NEWUSER`; `setns`                | a user namespace hands out `CAP_SYS_ADMIN` over nf_tables, mounts, … |
//! | `mount`, `umount2`, `pivot_root`, `chroot`, the new mount API (`open_tree`, `move_mount`, `fsopen`, `fsconfig`, `fsmount`, `fspick`, `mount_setattr`) | the session's mount namespace is the worker's to shape |
//! | `ptrace`, `process_vm_readv`, `process_vm_writev`, `kcmp`       | no reading or steering another process           |
//! | `bpf`, `perf_event_open`, `userfaultfd`, `io_uring_setup`, `io_uring_enter`, `io_uring_register` | big, often-exploited kernel interfaces |
//! | `keyctl`, `add_key`, `request_key`                              | the kernel keyring is shared per uid             |
//! | `kexec_load`, `kexec_file_load`, `init_module`, `finit_module`, `delete_module`, `reboot`, `swapon`, `swapoff`, `acct`, `quotactl`, `syslog`, `settimeofday`, `clock_settime`, `clock_adjtime`, `adjtimex`, `open_by_handle_at`, `name_to_handle_at` | node administration |
//!
//! and `clone3` with `ENOSYS`: its flags live in a structure a filter cannot read, so a plugin could pass
//! `CLONE_NEWUSER` there; `ENOSYS` makes glibc, musl and Go fall back to `clone`, where the flag is checked
//! (what Docker's default profile does). A system call of another architecture (i386's `int 0x80` from a 64-bit
//! plugin: `AUDIT_ARCH_I386`, other numbers) kills the process.
//!
//! # Three programs
//!
//! [`SeccompProfile::programs`] holds, in the order they are installed: the **guard** ([`guard_program`],
//! written here: seccompiler's rules match system call numbers and cannot say "every number from here on"),
//! which kills on a foreign architecture and refuses `nr ≥ 0x40000000` with `EPERM`; seccompiler's `deny`
//! (`EPERM`) and `nosys` (`ENOSYS`) filters, each of which also kills on a foreign architecture. The kernel runs
//! every installed filter on every call and takes the most restrictive answer, so the guard's refusal holds
//! whatever the other filters say (none of their rules can match such a number). The stubs receive the same
//! list in their setup message. [`profile_json`] is seccompiler's part only.
//!
//! # Deny list, not allow list
//!
//! Weighed again for the x32 hole and kept. Plugins are arbitrary programs (CPython, Node, Go binaries, native
//! code, and whatever they start): an allow list tight enough to matter has to follow every runtime and C
//! library release (`rseq`, `clone3`, `faccessat2`, `epoll_pwait2`, `futex_waitv`, `fchmodat2`,
//! `map_shadow_stack` each arrived that way), and a missing entry fails a plugin on some call deep inside it,
//! with nothing the operator can see. The side doors that made the deny list leaky were structural — a second
//! numbering (x32) and a second architecture (i386) — and the guard closes both for every rule at once. What a
//! deny list still admits is a system call newer than this list: new kernel interfaces are reviewed when the
//! node kernel moves, and operators add names with `confinement.seccomp_deny`.
//!
//! Operators add names with `confinement.seccomp_deny` in the worker configuration (refused with `EPERM` like
//! the defaults); an unknown name is a configuration error at start, not a silently missing rule.

use std::collections::BTreeSet;

use seccompiler::{BpfProgram, TargetArch, sock_filter};
use serde_json::{Value, json};

/// `CLONE_NEWUSER` (the same bit for `clone` and `unshare`).
const CLONE_NEWUSER: u64 = 0x1000_0000;

/// `EPERM`: what a refused call returns.
const EPERM: u32 = 1;

/// `ENOSYS`: what `clone3` returns, so C libraries fall back to `clone`.
const ENOSYS: u32 = 38;

/// `__X32_SYSCALL_BIT`: an x32 system call is an x86_64 one with this bit set in its number. The guard refuses
/// every number from here on (as unsigned: "negative" numbers too).
pub const X32_SYSCALL_BIT: u32 = 0x4000_0000;

/// Offsets in `struct seccomp_data`.
const SECCOMP_DATA_NR: u32 = 0;
const SECCOMP_DATA_ARCH: u32 = 4;

/// Classic BPF opcodes (`<linux/bpf_common.h>`): `BPF_LD | BPF_W | BPF_ABS`, `BPF_JMP | BPF_JEQ | BPF_K`,
/// `BPF_JMP | BPF_JGE | BPF_K`, `BPF_RET | BPF_K`.
const BPF_LD_W_ABS: u16 = 0x20;
const BPF_JEQ_K: u16 = 0x05 | 0x10;
const BPF_JGE_K: u16 = 0x05 | 0x30;
const BPF_RET_K: u16 = 0x06;

/// Return values of a seccomp filter (`<linux/seccomp.h>`).
const SECCOMP_RET_KILL_PROCESS: u32 = 0x8000_0000;
const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;
const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;

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

/// The compiled filters, in the order they are installed: the guard, seccompiler's `deny` and `nosys` (module
/// documentation, "Three programs").
#[derive(Debug, Clone, PartialEq)]
pub struct SeccompProfile {
    pub(crate) programs: Vec<BpfProgram>,
}

impl SeccompProfile {
    /// The default profile plus `extra` names refused with `EPERM`.
    pub fn compile(extra: &[String]) -> Result<SeccompProfile, SeccompError> {
        let arch_name = std::env::consts::ARCH;
        let arch = TargetArch::try_from(arch_name).map_err(|_| SeccompError::Arch(arch_name))?;
        let audit = audit_arch(arch_name).ok_or(SeccompError::Arch(arch_name))?;
        let text = profile_json(extra).to_string();
        let mut map = seccompiler::compile_from_json(text.as_bytes(), arch)
            .map_err(|e| SeccompError::Compile(e.to_string()))?;
        let mut programs = Vec::with_capacity(3);
        programs.push(guard_program(audit));
        for name in ["deny", "nosys"] {
            let program = map
                .remove(name)
                .ok_or_else(|| SeccompError::Compile(format!("filter {name} missing")))?;
            programs.push(program);
        }
        Ok(SeccompProfile { programs })
    }
}

/// `AUDIT_ARCH_*` (`<linux/audit.h>`) of the architectures seccompiler compiles for: what the kernel puts in
/// `seccomp_data.arch` for a native system call.
fn audit_arch(arch: &str) -> Option<u32> {
    const ARCH_64BIT_LE: u32 = 0x8000_0000 | 0x4000_0000;
    match arch {
        "x86_64" => Some(62 | ARCH_64BIT_LE),
        "aarch64" => Some(183 | ARCH_64BIT_LE),
        "riscv64" => Some(243 | ARCH_64BIT_LE),
        _ => None,
    }
}

/// The guard installed before seccompiler's filters: a system call of an architecture other than `audit`
/// kills the process; one numbered `X32_SYSCALL_BIT` or above is refused with `EPERM`; anything else is left
/// to the other filters.
pub(crate) fn guard_program(audit: u32) -> BpfProgram {
    let op = |code, k, jt, jf| sock_filter { code, jt, jf, k };
    vec![
        op(BPF_LD_W_ABS, SECCOMP_DATA_ARCH, 0, 0),
        op(BPF_JEQ_K, audit, 1, 0),
        op(BPF_RET_K, SECCOMP_RET_KILL_PROCESS, 0, 0),
        op(BPF_LD_W_ABS, SECCOMP_DATA_NR, 0, 0),
        op(BPF_JGE_K, X32_SYSCALL_BIT, 0, 1),
        op(BPF_RET_K, SECCOMP_RET_ERRNO | EPERM, 0, 0),
        op(BPF_RET_K, SECCOMP_RET_ALLOW, 0, 0),
    ]
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
        assert_eq!(base.programs.len(), 3);
        let more = SeccompProfile::compile(&["uname".to_owned()]).unwrap();
        assert_eq!(more.programs[0], base.programs[0], "the guard does not change");
        assert!(more.programs[1].len() > base.programs[1].len());
        // A name already denied, or one of the conditional ones, adds nothing twice.
        let same = SeccompProfile::compile(&["ptrace".to_owned(), "clone".to_owned()]).unwrap();
        assert_eq!(same, base);
    }

    #[test]
    fn an_unknown_syscall_name_is_a_compile_error() {
        let err = SeccompProfile::compile(&["no_such_call".to_owned()]).unwrap_err();
        assert!(matches!(err, SeccompError::Compile(_)), "{err}");
    }

    /// Runs `program` on a system call `nr` of architecture `arch` with every argument 0, as the kernel's
    /// classic BPF interpreter does (the instructions seccompiler and [`guard_program`] emit).
    fn run(program: &[sock_filter], arch: u32, nr: u32) -> u32 {
        let mut data = [0u8; 64];
        data[0..4].copy_from_slice(&nr.to_ne_bytes());
        data[4..8].copy_from_slice(&arch.to_ne_bytes());
        let (mut a, mut pc) = (0u32, 0usize);
        loop {
            let i = &program[pc];
            pc += 1;
            let k = i.k;
            let jump = |taken: bool| usize::from(if taken { i.jt } else { i.jf });
            match i.code {
                BPF_LD_W_ABS => {
                    let at = usize::try_from(k).unwrap();
                    a = u32::from_ne_bytes(data[at..at + 4].try_into().unwrap());
                }
                0x54 => a &= k,                            // ALU AND K
                0x05 => pc += usize::try_from(k).unwrap(), // JA
                BPF_JEQ_K => pc += jump(a == k),
                0x25 => pc += jump(a > k), // JGT K
                BPF_JGE_K => pc += jump(a >= k),
                0x45 => pc += jump(a & k != 0), // JSET K
                BPF_RET_K => return k,
                other => panic!("instruction {other:#x} not interpreted"),
            }
        }
    }

    /// What the kernel answers with every program of `profile` installed: the most restrictive action.
    fn verdict(profile: &SeccompProfile, arch: u32, nr: u32) -> u32 {
        #[allow(clippy::cast_possible_wrap)] // the kernel compares the actions as signed
        let severity = |ret: &u32| (ret & 0xffff_0000) as i32;
        profile
            .programs
            .iter()
            .map(|p| run(p, arch, nr))
            .min_by_key(severity)
            .unwrap()
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn x32_numbers_are_refused_and_a_foreign_architecture_is_killed() {
        const X86_64: u32 = 62 | 0x8000_0000 | 0x4000_0000;
        const I386: u32 = 3 | 0x4000_0000;
        let profile = SeccompProfile::compile(&[]).unwrap();
        let (getpid, chroot, unshare, clone3) = (39, 161, 272, 435);
        assert_eq!(verdict(&profile, X86_64, getpid), SECCOMP_RET_ALLOW);
        assert_eq!(verdict(&profile, X86_64, chroot), SECCOMP_RET_ERRNO | EPERM);
        assert_eq!(verdict(&profile, X86_64, clone3), SECCOMP_RET_ERRNO | ENOSYS);
        // The same calls under x32 numbers: refused, by the guard alone (seccompiler's filters allow them).
        for nr in [0, getpid, chroot, unshare, clone3] {
            let x32 = X32_SYSCALL_BIT | nr;
            assert_eq!(
                verdict(&profile, X86_64, x32),
                SECCOMP_RET_ERRNO | EPERM,
                "{x32:#x}"
            );
            assert_eq!(run(&profile.programs[1], X86_64, x32), SECCOMP_RET_ALLOW);
        }
        assert_eq!(verdict(&profile, X86_64, X32_SYSCALL_BIT - 1), SECCOMP_RET_ALLOW);
        assert_eq!(verdict(&profile, X86_64, u32::MAX), SECCOMP_RET_ERRNO | EPERM);
        // i386 (`int 0x80`; its getpid is 20): killed by every program, the guard included.
        for program in &profile.programs {
            assert_eq!(run(program, I386, 20), SECCOMP_RET_KILL_PROCESS);
        }
    }
}
