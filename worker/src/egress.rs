//! Network egress for the plugins the operator grants it: the policy (which destinations a plugin may reach) and
//! the proxy that enforces it.
//!
//! A confined plugin lives in a network namespace of its own with nothing but its loopback. For a granted
//! session the sandbox makes that namespace itself, before the spawn, and binds a listener on its
//! `127.0.0.1:`[`EGRESS_PROXY_PORT`] (`sandbox/netns.rs`); the plugin joins the namespace and finds
//! `HTTP_PROXY` / `HTTPS_PROXY` / `ALL_PROXY` pointing at that listener. [`serve`] answers on it, in the
//! worker's own network namespace:
//!
//! - `CONNECT host:port` (HTTPS and any TCP tunnel), and absolute-form `http://` requests (plain HTTP through a
//!   proxy), one destination per connection;
//! - the proxy resolves the host itself and connects to the **address it checked** (no second lookup, so a
//!   name that resolves differently the second time — DNS rebinding — gains nothing);
//! - [`Policy::check`] refuses, whatever the operator allows: loopback, unspecified, link-local (the cloud
//!   metadata address `169.254.169.254`), multicast and broadcast addresses, the worker's own addresses (any
//!   address a socket of the worker can bind), and `deny_cidrs` (the fleet adds its NATS servers); and, unless
//!   `allow_cidrs` opens them, the private and special-purpose ranges (RFC 1918, CGNAT, benchmarking,
//!   documentation, reserved, ULA, …) where cluster services live;
//! - a refusal is an HTTP `403` whose body names the rule, never the destination; a failed connect `502`, a
//!   slow one `504`, a malformed request `400`. Nothing the plugin sends reaches a log or a metric label.
//!
//! Raw sockets to anything but the plugin's loopback still fail with `ENETUNREACH`: egress is only ever
//! through the proxy, so every byte that leaves passed [`Policy::check`].

use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use ipnet::IpNet;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

pub use crate::config::EGRESS_PROXY_PORT;
use crate::config::Egress;

/// The longest request head the proxy reads (request line and headers).
pub const MAX_HEAD_BYTES: usize = 16 * 1024;
/// The longest a plugin may take to send its request head.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest a name lookup plus a connect to the destination may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Headers the proxy reads per request.
const MAX_HEADERS: usize = 64;

/// Ranges refused unless `allow_cidrs` opens them: where a cluster's own services, a cloud's internals and
/// addresses that are not the internet live.
const SPECIAL_RANGES: &[&str] = &[
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.0.2.0/24",
    "192.88.99.0/24",
    "192.168.0.0/16",
    "198.18.0.0/15",
    "198.51.100.0/24",
    "203.0.113.0/24",
    "240.0.0.0/4",
    "64:ff9b::/96",
    "64:ff9b:1::/48",
    "100::/64",
    "2001::/23",
    "2001:db8::/32",
    "2002::/16",
    "fc00::/7",
    "fec0::/10",
];

/// [`SPECIAL_RANGES`], parsed (each is a literal a unit test parses).
pub fn special_ranges() -> Vec<IpNet> {
    SPECIAL_RANGES.iter().filter_map(|r| r.parse().ok()).collect()
}

/// The rules no configuration relaxes, in [`Policy::check`]'s order: loopback or unspecified, link-local,
/// multicast or broadcast (`ip` as [`canonical`] makes it). The host's own `web/fetch` applies them too.
pub fn fixed_refusal(ip: IpAddr) -> Option<Refusal> {
    let ip = canonical(ip);
    if ip.is_loopback() || ip.is_unspecified() {
        return Some(Refusal::Loopback);
    }
    if link_local(ip) {
        return Some(Refusal::LinkLocal);
    }
    if ip.is_multicast() || ip == IpAddr::V4(Ipv4Addr::BROADCAST) {
        return Some(Refusal::Multicast);
    }
    None
}

/// Why a destination is refused (the `403` body and the metric label: fixed strings, never the destination).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// A loopback or unspecified address.
    #[error("loopback or unspecified address")]
    Loopback,
    /// Link-local (the metadata address among them).
    #[error("link-local address")]
    LinkLocal,
    /// Multicast or broadcast.
    #[error("multicast or broadcast address")]
    Multicast,
    /// An address of the worker itself.
    #[error("an address of the worker itself")]
    WorkerAddress,
    /// In the operator's (or the fleet's) `deny_cidrs`.
    #[error("a denied range")]
    Denied,
    /// A private or special-purpose range the operator did not open.
    #[error("a private or special-purpose range")]
    Private,
    /// A port outside `ports`.
    #[error("a port that is not allowed")]
    Port,
    /// A host name outside the policy's host allow-list (a preparation's package indexes).
    #[error("a host that is not allowed")]
    Host,
}

impl Refusal {
    /// Every rule, in declaration order (the index of [`EgressCounters::refused`]).
    pub const ALL: [Refusal; 8] = [
        Refusal::Loopback,
        Refusal::LinkLocal,
        Refusal::Multicast,
        Refusal::WorkerAddress,
        Refusal::Denied,
        Refusal::Private,
        Refusal::Port,
        Refusal::Host,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Loopback => "loopback",
            Refusal::LinkLocal => "link_local",
            Refusal::Multicast => "multicast",
            Refusal::WorkerAddress => "worker_address",
            Refusal::Denied => "denied",
            Refusal::Private => "private",
            Refusal::Port => "port",
            Refusal::Host => "host",
        }
    }
}

/// A bad `allow_cidrs`/`deny_cidrs` configuration.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// `max_connections` is 0.
    #[error("egress.max_connections must be at least 1")]
    NoConnections,
}

/// Which destinations egress-granted plugins may reach (see the module documentation).
#[derive(Debug, Clone)]
pub struct Policy {
    tools: Vec<String>,
    allow: Vec<IpNet>,
    deny: Vec<IpNet>,
    special: Vec<IpNet>,
    ports: Vec<u16>,
    max_connections: usize,
    /// Host names a connection may name (compared case-insensitively); `None`: any name (the addresses are checked
    /// either way).
    hosts: Option<Vec<String>>,
}

impl Policy {
    /// The policy of `config`.
    pub fn new(config: &Egress) -> Result<Policy, PolicyError> {
        if config.max_connections == 0 {
            return Err(PolicyError::NoConnections);
        }
        Ok(Policy {
            tools: config.tools.clone(),
            allow: config.allow_cidrs.iter().map(IpNet::trunc).collect(),
            deny: config.deny_cidrs.iter().map(IpNet::trunc).collect(),
            special: special_ranges(),
            ports: config.ports.clone(),
            max_connections: config.max_connections,
            hosts: None,
        })
    }

    /// The policy of `config` (its ranges and ports), reaching only the host names `hosts` (a preparation's
    /// package indexes): a request naming any other host, or an address literal, is refused ([`Refusal::Host`]).
    pub fn for_hosts(config: &Egress, hosts: &[String]) -> Result<Policy, PolicyError> {
        let mut policy = Policy::new(config)?;
        policy.hosts = Some(hosts.to_vec());
        Ok(policy)
    }

    /// Whether a request may name `host` (as the request spelled it, brackets and all).
    pub fn allows_host(&self, host: &str) -> bool {
        self.hosts
            .as_ref()
            .is_none_or(|hosts| hosts.iter().any(|h| h.eq_ignore_ascii_case(host)))
    }

    /// Whether the operator granted egress to `tool_id`.
    pub fn grants(&self, tool_id: &str) -> bool {
        self.tools.iter().any(|t| t == tool_id)
    }

    /// Whether a plugin may connect to `addr` (see the module documentation for the order of the rules).
    pub fn check(&self, addr: SocketAddr) -> Result<(), Refusal> {
        let ip = canonical(addr.ip());
        if let Some(refusal) = fixed_refusal(ip) {
            return Err(refusal);
        }
        if self.deny.iter().any(|n| n.contains(&ip)) {
            return Err(Refusal::Denied);
        }
        if is_local(ip) {
            return Err(Refusal::WorkerAddress);
        }
        if self.special.iter().any(|n| n.contains(&ip)) && !self.allow.iter().any(|n| n.contains(&ip)) {
            return Err(Refusal::Private);
        }
        if !self.ports.is_empty() && !self.ports.contains(&addr.port()) {
            return Err(Refusal::Port);
        }
        Ok(())
    }
}

/// An IPv4-mapped IPv6 address as the IPv4 address it is.
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

fn link_local(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
    }
}

/// Whether `ip` is one of this host's own addresses: the kernel lets a socket bind only those (no
/// `IP_FREEBIND` here), so one bind answers for every interface, including ones added after start.
pub fn is_local(ip: IpAddr) -> bool {
    match std::net::UdpSocket::bind(SocketAddr::new(ip, 0)) {
        Ok(_) => true,
        // Not an address of this host (EADDRNOTAVAIL); anything else (out of fds, …): refuse to be safe.
        Err(e) => e.raw_os_error() != Some(libc::EADDRNOTAVAIL),
    }
}

/// What the proxies of a worker did, by outcome (scrape-time counters).
#[derive(Debug, Default)]
pub struct EgressCounters {
    /// Connections made to an allowed destination.
    pub connected: AtomicU64,
    /// Refused by the policy, indexed as [`Refusal::ALL`].
    pub refused: [AtomicU64; Refusal::ALL.len()],
    /// Allowed, but the destination could not be reached (or not in time).
    pub failed: AtomicU64,
    /// Requests the proxy could not read (malformed, too large, too slow).
    pub bad_request: AtomicU64,
}

impl EgressCounters {
    fn refused(&self, r: Refusal) {
        self.refused[r as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Refusals by label, for the metrics.
    pub fn refusals(&self) -> [(&'static str, u64); Refusal::ALL.len()] {
        Refusal::ALL.map(|r| (r.as_str(), self.refused[r as usize].load(Ordering::Relaxed)))
    }
}

/// The environment a granted plugin gets: every spelling of the proxy variables common clients read.
pub fn proxy_env() -> Vec<(String, String)> {
    let url = format!("http://127.0.0.1:{EGRESS_PROXY_PORT}");
    let mut env: Vec<(String, String)> = ["HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"]
        .into_iter()
        .flat_map(|k| [(k.to_owned(), url.clone()), (k.to_lowercase(), url.clone())])
        .collect();
    for k in ["NO_PROXY", "no_proxy"] {
        env.push((k.to_owned(), "localhost,127.0.0.1,::1".to_owned()));
    }
    env
}

/// Serves the proxy on `listener` (bound inside a plugin's network namespace) until the task is dropped or
/// aborted; each connection runs on a task of the returned loop's own [`JoinSet`], so aborting the loop ends
/// them all.
pub async fn serve(listener: TcpListener, policy: Arc<Policy>, counters: Arc<EgressCounters>) {
    let permits = Arc::new(Semaphore::new(policy.max_connections));
    let mut conns = JoinSet::new();
    loop {
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return;
        };
        let stream = loop {
            tokio::select! {
                accepted = listener.accept() => break accepted,
                Some(_) = conns.join_next() => {}
            }
        };
        let Ok((stream, _)) = stream else {
            // EMFILE and friends: the next accept may work; the permit goes back.
            drop(permit);
            tokio::task::yield_now().await;
            continue;
        };
        let (policy, counters) = (policy.clone(), counters.clone());
        conns.spawn(async move {
            handle(stream, &policy, &counters).await;
            drop(permit);
        });
    }
}

/// Where a request wants to go, and what to send there first.
struct Target {
    host: String,
    port: u16,
    /// `None` for `CONNECT` (answer `200`, then tunnel); else the request head to send in origin form.
    forward: Option<Vec<u8>>,
}

/// A request the proxy does not serve (the `400` body).
#[derive(Debug, thiserror::Error)]
enum BadRequest {
    #[error("request head too large or incomplete")]
    Head,
    #[error("malformed request")]
    Malformed,
    #[error("only CONNECT and absolute http:// requests are proxied")]
    Unsupported,
}

async fn handle(mut stream: TcpStream, policy: &Policy, counters: &EgressCounters) {
    let mut buf = Vec::with_capacity(1024);
    let parsed = tokio::time::timeout(HEAD_TIMEOUT, read_head(&mut stream, &mut buf)).await;
    let (target, head_len) = match parsed {
        Ok(Ok(Some(found))) => found,
        Ok(Ok(None)) => return,
        Ok(Err(e)) => {
            counters.bad_request.fetch_add(1, Ordering::Relaxed);
            let _ = respond(&mut stream, "400 Bad Request", &e.to_string()).await;
            return;
        }
        Err(_) => {
            counters.bad_request.fetch_add(1, Ordering::Relaxed);
            let _ = respond(&mut stream, "408 Request Timeout", "request head too slow").await;
            return;
        }
    };
    let rest = buf.split_off(head_len);
    let upstream = tokio::time::timeout(CONNECT_TIMEOUT, connect(&target, policy)).await;
    let mut upstream = match upstream {
        Ok(Ok(s)) => s,
        Ok(Err(Outcome::Refused(r))) => {
            counters.refused(r);
            tracing::debug!(rule = r.as_str(), "egress refused");
            let _ = respond(&mut stream, "403 Forbidden", &format!("egress refused: {r}")).await;
            return;
        }
        Ok(Err(Outcome::Failed)) => {
            counters.failed.fetch_add(1, Ordering::Relaxed);
            let _ = respond(&mut stream, "502 Bad Gateway", "destination unreachable").await;
            return;
        }
        Err(_) => {
            counters.failed.fetch_add(1, Ordering::Relaxed);
            let _ = respond(&mut stream, "504 Gateway Timeout", "destination too slow").await;
            return;
        }
    };
    counters.connected.fetch_add(1, Ordering::Relaxed);
    let first = match &target.forward {
        None => {
            if stream
                .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
                .await
                .is_err()
            {
                return;
            }
            rest
        }
        Some(head) => {
            let mut first = head.clone();
            first.extend_from_slice(&rest);
            first
        }
    };
    if !first.is_empty() && upstream.write_all(&first).await.is_err() {
        return;
    }
    let _ = tokio::io::copy_bidirectional(&mut stream, &mut upstream).await;
}

enum Outcome {
    Refused(Refusal),
    Failed,
}

/// Resolves `target` and connects to the first address the policy allows (the first refusal is the answer when
/// none is allowed).
async fn connect(target: &Target, policy: &Policy) -> Result<TcpStream, Outcome> {
    if !policy.allows_host(&target.host) {
        return Err(Outcome::Refused(Refusal::Host));
    }
    let host = target.host.trim_start_matches('[').trim_end_matches(']');
    let addrs: Vec<SocketAddr> = match host.parse::<IpAddr>() {
        Ok(ip) => vec![SocketAddr::new(ip, target.port)],
        Err(_) => match tokio::net::lookup_host((host, target.port)).await {
            Ok(found) => found.collect(),
            Err(_) => return Err(Outcome::Failed),
        },
    };
    let mut refusal = None;
    for addr in addrs {
        let addr = SocketAddr::new(canonical(addr.ip()), addr.port());
        match policy.check(addr) {
            Ok(()) => {
                if let Ok(s) = TcpStream::connect(addr).await {
                    return Ok(s);
                }
            }
            Err(r) => {
                refusal.get_or_insert(r);
            }
        }
    }
    Err(refusal.map_or(Outcome::Failed, Outcome::Refused))
}

/// Reads until a whole request head is in `buf`: the target and the head's length, or `None` if the plugin
/// closed the connection first.
async fn read_head(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Result<Option<(Target, usize)>, BadRequest> {
    let mut chunk = [0u8; 2048];
    loop {
        let n = stream.read(&mut chunk).await.map_err(|_| BadRequest::Head)?;
        if n == 0 {
            return if buf.is_empty() {
                Ok(None)
            } else {
                Err(BadRequest::Head)
            };
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(found) = parse_head(buf)? {
            return Ok(Some(found));
        }
        if buf.len() > MAX_HEAD_BYTES {
            return Err(BadRequest::Head);
        }
    }
}

/// Parses a complete request head, `Ok(None)` while it is incomplete.
fn parse_head(buf: &[u8]) -> Result<Option<(Target, usize)>, BadRequest> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let len = match req.parse(buf) {
        Ok(httparse::Status::Complete(len)) if len <= MAX_HEAD_BYTES => len,
        Ok(httparse::Status::Complete(_)) => return Err(BadRequest::Head),
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(_) => return Err(BadRequest::Malformed),
    };
    let (Some(method), Some(path)) = (req.method, req.path) else {
        return Err(BadRequest::Malformed);
    };
    if method.eq_ignore_ascii_case("CONNECT") {
        let (host, port) = split_authority(path, None)?;
        return Ok(Some((
            Target {
                host,
                port,
                forward: None,
            },
            len,
        )));
    }
    let Some(rest) = path
        .strip_prefix("http://")
        .or_else(|| path.strip_prefix("HTTP://"))
    else {
        return Err(BadRequest::Unsupported);
    };
    let (authority, origin) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    if authority.contains('@') {
        return Err(BadRequest::Malformed);
    }
    let (host, port) = split_authority(authority, Some(80))?;
    let mut head = format!("{method} {origin} HTTP/1.1\r\n").into_bytes();
    for h in req.headers.iter() {
        let name = h.name;
        if name.eq_ignore_ascii_case("connection")
            || name.eq_ignore_ascii_case("proxy-connection")
            || name.eq_ignore_ascii_case("proxy-authorization")
            || name.eq_ignore_ascii_case("keep-alive")
        {
            continue;
        }
        head.extend_from_slice(name.as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(h.value);
        head.extend_from_slice(b"\r\n");
    }
    head.extend_from_slice(b"Connection: close\r\n\r\n");
    Ok(Some((
        Target {
            host,
            port,
            forward: Some(head),
        },
        len,
    )))
}

/// `host:port` (or `[v6]:port`; `default` when the port is absent).
fn split_authority(authority: &str, default: Option<u16>) -> Result<(String, u16), BadRequest> {
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (h, after) = v6.split_once(']').ok_or(BadRequest::Malformed)?;
        (h, after.strip_prefix(':'))
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        }
    };
    let port = match port {
        Some(p) => p.parse::<u16>().map_err(|_| BadRequest::Malformed)?,
        None => default.ok_or(BadRequest::Malformed)?,
    };
    if host.is_empty() || port == 0 {
        return Err(BadRequest::Malformed);
    }
    Ok((host.to_owned(), port))
}

async fn respond(stream: &mut TcpStream, status: &str, body: &str) -> io::Result<()> {
    let msg = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}\n",
        body.len() + 1
    );
    stream.write_all(msg.as_bytes()).await?;
    stream.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(allow: &[&str], deny: &[&str], ports: &[u16]) -> Policy {
        Policy::new(&Egress {
            tools: vec!["t".into()],
            allow_cidrs: allow.iter().map(|s| s.parse().unwrap()).collect(),
            deny_cidrs: deny.iter().map(|s| s.parse().unwrap()).collect(),
            ports: ports.to_vec(),
            max_connections: 4,
        })
        .unwrap()
    }

    fn at(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn built_in_refusals_hold_whatever_the_operator_allows() {
        let p = policy(&["0.0.0.0/0", "::/0"], &[], &[]);
        assert_eq!(p.check(at("127.0.0.1:4222")), Err(Refusal::Loopback));
        assert_eq!(p.check(at("127.9.9.9:80")), Err(Refusal::Loopback));
        assert_eq!(p.check(at("[::1]:80")), Err(Refusal::Loopback));
        assert_eq!(p.check(at("[::ffff:127.0.0.1]:80")), Err(Refusal::Loopback));
        assert_eq!(p.check(at("0.0.0.0:80")), Err(Refusal::Loopback));
        assert_eq!(p.check(at("169.254.169.254:80")), Err(Refusal::LinkLocal));
        assert_eq!(
            p.check(at("[::ffff:169.254.169.254]:80")),
            Err(Refusal::LinkLocal)
        );
        assert_eq!(p.check(at("[fe80::1]:80")), Err(Refusal::LinkLocal));
        assert_eq!(p.check(at("224.0.0.1:80")), Err(Refusal::Multicast));
        assert_eq!(p.check(at("255.255.255.255:80")), Err(Refusal::Multicast));
    }

    #[test]
    fn private_ranges_are_refused_unless_opened_and_deny_beats_allow() {
        let closed = policy(&[], &[], &[]);
        for a in [
            "10.1.2.3:80",
            "172.16.0.1:80",
            "192.168.1.1:80",
            "100.64.0.1:80",
            "198.18.0.2:80",
            "[fd00::1]:80",
        ] {
            assert_eq!(closed.check(at(a)), Err(Refusal::Private), "{a}");
        }
        assert_eq!(closed.check(at("1.1.1.1:443")), Ok(()));
        let open = policy(&["198.18.0.0/30", "10.0.0.0/8"], &["10.9.0.0/16"], &[]);
        assert_eq!(open.check(at("198.18.0.2:80")), Ok(()));
        assert_eq!(open.check(at("198.18.0.6:80")), Err(Refusal::Private));
        assert_eq!(open.check(at("10.1.2.3:80")), Ok(()));
        assert_eq!(open.check(at("10.9.1.1:4222")), Err(Refusal::Denied));
    }

    #[test]
    fn ports_are_limited_when_listed() {
        let p = policy(&[], &[], &[443]);
        assert_eq!(p.check(at("1.1.1.1:443")), Ok(()));
        assert_eq!(p.check(at("1.1.1.1:22")), Err(Refusal::Port));
    }

    #[test]
    fn a_host_allow_list_admits_only_its_names() {
        let base = Egress::default();
        let indexes =
            Policy::for_hosts(&base, &["pypi.org".into(), "Files.PythonHosted.org".into()]).unwrap();
        assert!(indexes.allows_host("pypi.org"));
        assert!(indexes.allows_host("PYPI.ORG"));
        assert!(indexes.allows_host("files.pythonhosted.org"));
        for other in ["evil.pypi.org", "pypi.org.evil", "127.0.0.1", "[::1]", "", "pypi"] {
            assert!(!indexes.allows_host(other), "{other}");
        }
        let none = Policy::for_hosts(&base, &[]).unwrap();
        assert!(!none.allows_host("pypi.org"));
        assert!(policy(&[], &[], &[]).allows_host("anything.example"));
    }

    #[tokio::test]
    async fn a_host_outside_the_allow_list_is_refused_before_any_lookup() {
        let p = Policy::for_hosts(&Egress::default(), &["pypi.org".into()]).unwrap();
        let target = Target {
            host: "localhost".into(),
            port: 4222,
            forward: None,
        };
        assert!(matches!(
            connect(&target, &p).await,
            Err(Outcome::Refused(Refusal::Host))
        ));
    }

    #[test]
    fn the_workers_own_addresses_are_refused() {
        // Every host has a non-loopback address only sometimes; the bind probe must at least agree with
        // loopback being local and a documentation address not.
        assert!(is_local(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        assert!(!is_local("198.51.100.77".parse().unwrap()));
    }

    #[test]
    fn connect_and_absolute_requests_parse_and_others_are_refused() {
        let head = b"CONNECT example.com:443 HTTP/1.1\r\nHost: x\r\n\r\n";
        let with_body = [head.as_slice(), b"extra"].concat();
        let (t, len) = parse_head(&with_body).unwrap().unwrap();
        assert_eq!(
            (t.host.as_str(), t.port, t.forward.is_none()),
            ("example.com", 443, true)
        );
        assert_eq!(len, head.len(), "the head ends before the tunnel's first bytes");
        let (t, _) = parse_head(b"GET http://[2001:db8::1]:8080/a?b HTTP/1.1\r\nProxy-Connection: keep-alive\r\nAccept: */*\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!((t.host.as_str(), t.port), ("2001:db8::1", 8080));
        assert_eq!(
            String::from_utf8(t.forward.unwrap()).unwrap(),
            "GET /a?b HTTP/1.1\r\nAccept: */*\r\nConnection: close\r\n\r\n"
        );
        let (t, _) = parse_head(b"GET http://h HTTP/1.1\r\n\r\n").unwrap().unwrap();
        assert_eq!((t.host.as_str(), t.port), ("h", 80));
        assert!(parse_head(b"GET http://h").unwrap().is_none());
        assert!(matches!(
            parse_head(b"GET /x HTTP/1.1\r\n\r\n"),
            Err(BadRequest::Unsupported)
        ));
        assert!(matches!(
            parse_head(b"GET https://h/ HTTP/1.1\r\n\r\n"),
            Err(BadRequest::Unsupported)
        ));
        assert!(matches!(
            parse_head(b"CONNECT h HTTP/1.1\r\n\r\n"),
            Err(BadRequest::Malformed)
        ));
        assert!(matches!(
            parse_head(b"CONNECT h:0 HTTP/1.1\r\n\r\n"),
            Err(BadRequest::Malformed)
        ));
        assert!(matches!(
            parse_head(b"GET http://u@h/ HTTP/1.1\r\n\r\n"),
            Err(BadRequest::Malformed)
        ));
        assert!(matches!(
            parse_head(b"\x00\x01 nonsense\r\n\r\n"),
            Err(BadRequest::Malformed)
        ));
    }

    #[test]
    fn every_special_range_parses_and_rules_index_their_counters() {
        assert_eq!(special_ranges().len(), SPECIAL_RANGES.len());
        for (i, r) in Refusal::ALL.iter().enumerate() {
            assert_eq!(*r as usize, i);
        }
    }

    #[test]
    fn a_policy_needs_a_connection() {
        let e = Policy::new(&Egress {
            max_connections: 0,
            ..Egress::default()
        });
        assert!(matches!(e, Err(PolicyError::NoConnections)));
    }
}
