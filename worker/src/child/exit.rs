//! How a plugin process ended.

/// How a process ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExitInfo {
    /// `exit status: 0`, `killed by signal 9 (SIGKILL)`, ...
    pub status: String,
    /// Whether it exited with status 0.
    pub clean: bool,
    /// Whether the cgroup's OOM counter rose while it ran.
    pub oom: bool,
    /// Whether the host ended it (shutdown, eviction, cancel fallback) rather than the plugin crashing.
    pub host_initiated: bool,
}

impl std::fmt::Display for ExitInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.status)?;
        if self.oom {
            write!(f, " (killed by the OOM killer: memory limit reached)")?;
        }
        Ok(())
    }
}

impl ExitInfo {
    /// An end whose status could not be learned (the exit watcher went away).
    pub(crate) fn unknown() -> ExitInfo {
        ExitInfo {
            status: "unknown".into(),
            clean: false,
            oom: false,
            host_initiated: false,
        }
    }

    /// What `wait` returned, with the OOM attribution and whether the host ended it.
    pub(crate) fn from_wait(
        status: &std::io::Result<std::process::ExitStatus>,
        oom: bool,
        host_initiated: bool,
    ) -> ExitInfo {
        let (status, clean) = match status {
            Ok(s) => (describe_status(*s), s.success()),
            Err(e) => (format!("wait failed: {e}"), false),
        };
        ExitInfo {
            status,
            clean,
            oom,
            host_initiated,
        }
    }
}

fn describe_status(s: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt as _;
    match (s.code(), s.signal()) {
        (Some(code), _) => format!("exit status: {code}"),
        (None, Some(sig)) => {
            let name = match sig {
                6 => " (SIGABRT)",
                9 => " (SIGKILL)",
                11 => " (SIGSEGV)",
                15 => " (SIGTERM)",
                _ => "",
            };
            format!("killed by signal {sig}{name}")
        }
        (None, None) => "unknown exit".into(),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt as _;
    use std::process::ExitStatus;

    use super::ExitInfo;

    #[test]
    fn statuses_are_described_and_oom_is_named() {
        let ok = ExitInfo::from_wait(&Ok(ExitStatus::from_raw(0)), false, false);
        assert_eq!((ok.status.as_str(), ok.clean), ("exit status: 0", true));
        let killed = ExitInfo::from_wait(&Ok(ExitStatus::from_raw(9)), true, false);
        assert_eq!(killed.status, "killed by signal 9 (SIGKILL)");
        assert!(!killed.clean);
        assert!(
            killed
                .to_string()
                .ends_with("(killed by the OOM killer: memory limit reached)")
        );
    }
}
