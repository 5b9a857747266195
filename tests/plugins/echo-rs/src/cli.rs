//! Command-line flags of the fixture plugin, hand-parsed from `std::env::args`.

use std::fmt;

/// How the plugin answers `initialize`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InitMode {
    /// The normal v2 reply.
    V2,
    /// JSON-RPC error -32601.
    MethodNotFound,
    /// JSON-RPC error -32603 "boom".
    Error,
    /// Never answer `initialize` (everything else is still served).
    Hang,
    /// A v2-shaped reply whose `protocolVersion` is "1.1".
    V1Version,
    /// The normal v2 reply, but only once the next request (`describe`) has arrived: a host that waits for
    /// the answer before it writes `describe` times `initialize` out and falls back to v1.
    AfterDescribe,
}

/// The shape of the `describe` result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DescribeMode {
    /// The bare manifest.
    Normal,
    /// `{"manifest": <manifest>}` (a known plugin bug the host must reject).
    Wrapped,
    /// The manifest without its `name` key (allowed by the spec).
    OmitName,
    /// `tools` is a string instead of a list.
    Invalid,
}

/// How the plugin answers `health`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HealthMode {
    /// `{"status":"ready"}`.
    Ready,
    /// `{"status":"ok"}`.
    Ok,
    /// `{"status":"healthy"}`.
    Healthy,
    /// `{"status":"initializing"}`.
    Initializing,
    /// `{"status":"error","message":"unhealthy on purpose"}`.
    Error,
    /// JSON-RPC error -32601.
    MethodNotFound,
    /// Never answer `health` (everything else is still served).
    Hang,
}

/// What the process does, chosen by the flags.
#[derive(Debug)]
pub(crate) enum Mode {
    /// `--noop`: exit 0 at once.
    Noop,
    /// `--sleep-forever`: sleep until killed (the grandchild of `spawn_grandchild`).
    SleepForever,
    /// `--sleep-ms N`: sleep N ms then exit 0 (the children of `fork`).
    SleepMs(u64),
    /// Serve the Executa protocol on stdio.
    Serve(Box<Config>),
}

/// Configuration of a serving plugin.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    /// `--protocol v1`: refuse `initialize`, no reverse RPC / progress.
    pub(crate) protocol_v1: bool,
    pub(crate) initialize: InitMode,
    /// `--server-info-style snake`: `server_info` instead of `serverInfo`.
    pub(crate) server_info_snake: bool,
    /// Keys of `client_capabilities` in the `initialize` reply.
    pub(crate) capabilities: Vec<String>,
    /// The manifest's `host_capabilities`.
    pub(crate) host_capabilities: Vec<String>,
    pub(crate) startup_delay_ms: u64,
    pub(crate) describe_delay_ms: u64,
    pub(crate) describe_mode: DescribeMode,
    /// `--health MODE`: how `health` is answered.
    pub(crate) health: HealthMode,
    /// Declared `timeout` (seconds) of the `timed_sleep` tool.
    pub(crate) tool_timeout_s: u64,
    pub(crate) exit_after_first_response: bool,
    /// `--ignore-eof`: park instead of exiting at stdin EOF (logs `stdin EOF ignored, parking` to stderr).
    pub(crate) ignore_eof: bool,
    /// `--ignore-sigterm`: ignore SIGTERM from startup, logging `SIGTERM ignored` to stderr for each one.
    pub(crate) ignore_sigterm: bool,
    pub(crate) stderr_banner: Option<String>,
    pub(crate) stdout_banner: Option<String>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            protocol_v1: false,
            initialize: InitMode::V2,
            server_info_snake: false,
            capabilities: vec!["sampling".to_owned(), "storage".to_owned()],
            host_capabilities: Vec::new(),
            startup_delay_ms: 0,
            describe_delay_ms: 0,
            describe_mode: DescribeMode::Normal,
            health: HealthMode::Ready,
            tool_timeout_s: 1,
            exit_after_first_response: false,
            ignore_eof: false,
            ignore_sigterm: false,
            stderr_banner: None,
            stdout_banner: None,
        }
    }
}

/// A flag the parser did not accept.
#[derive(Debug)]
pub(crate) struct CliError(String);

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn err(msg: impl Into<String>) -> CliError {
    CliError(msg.into())
}

fn split_list(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

fn parse_u64(flag: &str, v: &str) -> Result<u64, CliError> {
    v.parse()
        .map_err(|_| err(format!("{flag}: expected a non-negative integer, got {v:?}")))
}

/// Parses the arguments (without the program name). `--flag value` and `--flag=value` are both accepted.
pub(crate) fn parse(args: impl IntoIterator<Item = String>) -> Result<Mode, CliError> {
    let mut cfg = Config::default();
    let mut it = args.into_iter();
    let mut sleep_ms = None;
    let mut sleep_forever = false;
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_owned(), Some(v.to_owned())),
            _ => (arg.clone(), None),
        };
        let value = |it: &mut dyn Iterator<Item = String>| -> Result<String, CliError> {
            match inline.clone() {
                Some(v) => Ok(v),
                None => it.next().ok_or_else(|| err(format!("{flag}: missing value"))),
            }
        };
        match flag.as_str() {
            "--noop" => return Ok(Mode::Noop),
            "--sleep-forever" => sleep_forever = true,
            "--sleep-ms" => sleep_ms = Some(parse_u64(&flag, &value(&mut it)?)?),
            "--protocol" => {
                cfg.protocol_v1 = match value(&mut it)?.as_str() {
                    "v2" | "2" | "2.0" => false,
                    "v1" | "1" | "1.1" => true,
                    other => return Err(err(format!("--protocol: unknown {other:?}"))),
                }
            }
            "--initialize" => {
                cfg.initialize = match value(&mut it)?.as_str() {
                    "v2" => InitMode::V2,
                    "method-not-found" => InitMode::MethodNotFound,
                    "error" => InitMode::Error,
                    "hang" => InitMode::Hang,
                    "v1-version" => InitMode::V1Version,
                    "after-describe" => InitMode::AfterDescribe,
                    other => return Err(err(format!("--initialize: unknown mode {other:?}"))),
                }
            }
            "--server-info-style" => {
                cfg.server_info_snake = match value(&mut it)?.as_str() {
                    "camel" => false,
                    "snake" => true,
                    other => return Err(err(format!("--server-info-style: unknown {other:?}"))),
                }
            }
            "--capabilities" => cfg.capabilities = split_list(&value(&mut it)?),
            "--host-capabilities" => cfg.host_capabilities = split_list(&value(&mut it)?),
            "--startup-delay-ms" => cfg.startup_delay_ms = parse_u64(&flag, &value(&mut it)?)?,
            "--describe-delay-ms" => cfg.describe_delay_ms = parse_u64(&flag, &value(&mut it)?)?,
            "--describe-mode" => {
                cfg.describe_mode = match value(&mut it)?.as_str() {
                    "normal" => DescribeMode::Normal,
                    "wrapped" => DescribeMode::Wrapped,
                    "omit-name" => DescribeMode::OmitName,
                    "invalid" => DescribeMode::Invalid,
                    other => return Err(err(format!("--describe-mode: unknown {other:?}"))),
                }
            }
            "--health" => {
                cfg.health = match value(&mut it)?.as_str() {
                    "ready" => HealthMode::Ready,
                    "ok" => HealthMode::Ok,
                    "healthy" => HealthMode::Healthy,
                    "initializing" => HealthMode::Initializing,
                    "error" => HealthMode::Error,
                    "method-not-found" => HealthMode::MethodNotFound,
                    "hang" => HealthMode::Hang,
                    other => return Err(err(format!("--health: unknown mode {other:?}"))),
                }
            }
            "--tool-timeout-s" => cfg.tool_timeout_s = parse_u64(&flag, &value(&mut it)?)?,
            "--exit-after-first-response" => cfg.exit_after_first_response = true,
            "--ignore-eof" => cfg.ignore_eof = true,
            "--ignore-sigterm" => cfg.ignore_sigterm = true,
            "--stderr-banner" => cfg.stderr_banner = Some(value(&mut it)?),
            "--stdout-banner" => cfg.stdout_banner = Some(value(&mut it)?),
            other => return Err(err(format!("unknown argument {other:?}"))),
        }
    }
    if sleep_forever {
        return Ok(Mode::SleepForever);
    }
    if let Some(ms) = sleep_ms {
        return Ok(Mode::SleepMs(ms));
    }
    Ok(Mode::Serve(Box::new(cfg)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &[&str]) -> Vec<String> {
        s.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn defaults() {
        let Ok(Mode::Serve(cfg)) = parse(args(&[])) else {
            panic!("expected serve")
        };
        assert!(!cfg.protocol_v1);
        assert_eq!(cfg.initialize, InitMode::V2);
        assert_eq!(cfg.capabilities, ["sampling", "storage"]);
        assert!(cfg.host_capabilities.is_empty());
        assert_eq!(cfg.tool_timeout_s, 1);
        assert_eq!(cfg.health, HealthMode::Ready);
    }

    #[test]
    fn flags_both_forms() {
        let Ok(Mode::Serve(cfg)) = parse(args(&[
            "--initialize=hang",
            "--capabilities",
            "a,b,c",
            "--host-capabilities=",
            "--describe-mode",
            "wrapped",
            "--server-info-style=snake",
            "--health",
            "method-not-found",
            "--stdout-banner",
            "hello world",
        ])) else {
            panic!("expected serve")
        };
        assert_eq!(cfg.initialize, InitMode::Hang);
        assert_eq!(cfg.capabilities, ["a", "b", "c"]);
        assert!(cfg.host_capabilities.is_empty());
        assert_eq!(cfg.describe_mode, DescribeMode::Wrapped);
        assert!(cfg.server_info_snake);
        assert_eq!(cfg.health, HealthMode::MethodNotFound);
        assert_eq!(cfg.stdout_banner.as_deref(), Some("hello world"));
    }

    #[test]
    fn modes_and_errors() {
        assert!(matches!(parse(args(&["--noop", "--bogus"])), Ok(Mode::Noop)));
        assert!(matches!(parse(args(&["--sleep-ms", "5"])), Ok(Mode::SleepMs(5))));
        assert!(matches!(
            parse(args(&["--sleep-forever"])),
            Ok(Mode::SleepForever)
        ));
        assert!(parse(args(&["--bogus"])).is_err());
        assert!(parse(args(&["--health", "sick"])).is_err());
        assert!(parse(args(&["--startup-delay-ms"])).is_err());
        assert!(parse(args(&["--startup-delay-ms", "x"])).is_err());
    }
}
