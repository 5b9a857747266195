//! `nats-node-kill`'s view of a `fleet up --nats-cluster N`: the nodes under `<data-dir>/nats/node-<i>` (their
//! configuration names the server and its monitoring port, their pid file the process), which node leads a
//! stream (the monitoring endpoint's `/jsz`), killing one with SIGKILL and starting it again with the very
//! command line it ran with.

use std::ffi::OsString;
use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

/// One clustered nats-server of the fleet.
#[derive(Debug, Clone)]
pub(crate) struct Node {
    dir: PathBuf,
    monitor: u16,
    name: String,
}

/// The nodes of the fleet whose data dir is `data_dir`; an error naming what is needed when it has none.
pub(crate) fn nodes(data_dir: &Path) -> anyhow::Result<Vec<Node>> {
    let mut nodes = Vec::new();
    for i in 0.. {
        let dir = data_dir.join("nats").join(format!("node-{i}"));
        let Ok(conf) = std::fs::read_to_string(dir.join("nats.conf")) else {
            break;
        };
        let value = |key: &str| {
            conf.lines()
                .find_map(|l| l.trim().strip_prefix(key))
                .map(|v| v.trim().trim_matches('"').to_owned())
        };
        let monitor = value("http:")
            .and_then(|v| v.rsplit(':').next().and_then(|p| p.parse().ok()))
            .ok_or_else(|| anyhow::anyhow!("{}: no monitoring port", dir.display()))?;
        let name =
            value("server_name:").ok_or_else(|| anyhow::anyhow!("{}: no server_name", dir.display()))?;
        nodes.push(Node { dir, monitor, name });
    }
    if nodes.len() < 3 {
        anyhow::bail!(
            "nats-node-kill needs a fleet on a NATS cluster: give --spawn (it starts `fleet up --nats-cluster 3`), or \
             the --data-dir of a `fleet up --nats-cluster 3`; {} has {} node(s)",
            data_dir.join("nats").display(),
            nodes.len()
        );
    }
    Ok(nodes)
}

/// `GET /jsz?accounts=true&streams=true` of a node, parsed.
fn jsz(monitor: u16) -> Option<Value> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", monitor)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(b"GET /jsz?accounts=true&streams=true HTTP/1.0\r\n\r\n")
        .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    serde_json::from_str(text.split("\r\n\r\n").nth(1)?).ok()
}

/// Every stream's (name, leader, every follower current) as the live nodes report the streams they lead.
fn led_streams(nodes: &[Node]) -> Vec<(String, String, bool)> {
    let mut out = Vec::new();
    for n in nodes {
        let Some(body) = jsz(n.monitor) else { continue };
        for account in body["account_details"].as_array().into_iter().flatten() {
            for st in account["stream_detail"].as_array().into_iter().flatten() {
                let cluster = &st["cluster"];
                if cluster["leader"].as_str() != Some(n.name.as_str()) {
                    continue;
                }
                let current = cluster["replicas"].as_array().is_some_and(|r| {
                    r.iter()
                        .all(|f| f["current"] == Value::Bool(true) && f["offline"] != Value::Bool(true))
                });
                out.push((
                    st["name"].as_str().unwrap_or_default().to_owned(),
                    n.name.clone(),
                    current,
                ));
            }
        }
    }
    out
}

/// The index of the node leading `stream`.
pub(crate) fn leader_of(nodes: &[Node], stream: &str) -> Option<usize> {
    let (_, leader, _) = led_streams(nodes).into_iter().find(|s| s.0 == stream)?;
    nodes.iter().position(|n| n.name == leader)
}

/// Whether `streams` streams have a leader and every follower is current.
pub(crate) fn all_current(nodes: &[Node], streams: usize) -> bool {
    let led = led_streams(nodes);
    led.len() >= streams && led.iter().all(|s| s.2)
}

/// How many streams the cluster holds now.
pub(crate) fn stream_count(nodes: &[Node]) -> usize {
    led_streams(nodes).len()
}

/// A node killed with SIGKILL, and how to start it again.
#[derive(Debug)]
pub(crate) struct Killed {
    program: OsString,
    args: Vec<OsString>,
    cwd: PathBuf,
}

/// Kills node `i` with SIGKILL after reading its command line and working directory from `/proc`.
pub(crate) fn kill(nodes: &[Node], i: usize) -> anyhow::Result<Killed> {
    let pid_file = nodes[i].dir.join("nats-server.pid");
    let pid: i32 = std::fs::read_to_string(&pid_file)?
        .trim()
        .parse()
        .map_err(|e| anyhow::anyhow!("{}: {e}", pid_file.display()))?;
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))?;
    let cwd = std::fs::read_link(format!("/proc/{pid}/cwd"))?;
    let mut parts = cmdline
        .split(|b| *b == 0)
        .filter(|p| !p.is_empty())
        .map(|p| OsString::from(String::from_utf8_lossy(p).into_owned()));
    let program = parts
        .next()
        .ok_or_else(|| anyhow::anyhow!("pid {pid}: no command line"))?;
    let killed = Killed {
        program,
        args: parts.collect(),
        cwd,
    };
    let pid = rustix::process::Pid::from_raw(pid).ok_or_else(|| anyhow::anyhow!("pid {pid}"))?;
    rustix::process::kill_process(pid, rustix::process::Signal::KILL)?;
    Ok(killed)
}

impl Killed {
    /// Starts the node again, as a restarted pod would: same binary, configuration, ports and store.
    pub(crate) fn restart(&self) -> anyhow::Result<Child> {
        Ok(Command::new(&self.program)
            .args(&self.args)
            .current_dir(&self.cwd)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?)
    }
}
