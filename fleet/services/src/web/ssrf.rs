//! The SSRF policy of `web/fetch` (spec §8.9: "cannot be disabled"): which URLs and addresses the host may
//! fetch on a plugin's behalf — the one policy of every fetch the host services make to a URL a plugin or a
//! provider named (`web/fetch`, `web/image_fetch`, and `image/*` inputs and result URLs, through
//! [`super::fetch::Fetcher`]).
//!
//! * Scheme `http` or `https`; a host; no user name or password; port 80, 443, 8080 or 8443 (explicit or the scheme's default).
//! * The host is resolved once ([`Resolve`]); **every** address it resolves to must pass [`SsrfPolicy::check_addr`],
//!   and the fetch then connects only to those checked addresses (the fetcher pins them: no second lookup, so
//!   a name that answers differently the second time — DNS rebinding — gains nothing).
//! * Refused addresses, whatever the configuration: loopback, unspecified, link-local (the cloud metadata
//!   address `169.254.169.254`), multicast and broadcast (the worker egress proxy's fixed rules,
//!   `fleet_worker::egress::fixed_refusal`); every private and special-purpose range (RFC 1918, CGNAT, ULA,
//!   documentation, benchmarking, reserved, NAT64, 6to4, Teredo, site-local: `egress::special_ranges`) plus the
//!   IPv4-compatible IPv6 block `::/96`; IPv4-mapped IPv6 addresses are judged as the IPv4 address they carry;
//!   and any address of the worker's own host.
//! * IPv4 literals in any spelling the URL standard accepts (decimal `2130706433`, octal `0177.0.0.1`, hex
//!   `0x7f.1`) are parsed to the address they mean before the check.
//! * Each redirect is a new URL that goes through all of this again, at most
//!   [`fleet_proto::limits::WEB_MAX_REDIRECTS`] times (the fetcher counts).
//!
//! The one exception is `test_allow_addrs` of `[web]`: exact `ip:port` pairs (never ranges) that tests use to
//! reach a server on this host. It is for tests only, documented as such, and every entry is logged at
//! warning level when the services start.

use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;

use fleet_proto::limits::WEB_FETCH_PORTS;
use fleet_worker::egress::{self, Refusal};
use ipnet::IpNet;
use reqwest::Url;

/// Ranges refused here on top of `egress::special_ranges` (the worker's proxy lets an operator open those; the
/// fetch policy never does).
const EXTRA_RANGES: &[&str] = &[
    // IPv4-compatible IPv6 (`::a.b.c.d`, deprecated; `::` and `::1` are refused as unspecified and loopback).
    "::/96",
];

/// Why a URL or an address is refused (fixed strings: never the URL or the address).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Blocked {
    /// Neither `http` nor `https`.
    #[error("only http and https URLs may be fetched")]
    Scheme,
    /// No host.
    #[error("the URL has no host")]
    NoHost,
    /// A user name or password in the URL.
    #[error("URLs with credentials are not fetched")]
    Credentials,
    /// A port other than 80, 443, 8080, 8443.
    #[error("only ports 80, 443, 8080 and 8443 may be fetched")]
    Port,
    /// A fixed rule of the address check (loopback, link-local, multicast).
    #[error("{0}")]
    Address(Refusal),
    /// A private or special-purpose range.
    #[error("a private or special-purpose address")]
    Private,
    /// An address of the worker's own host.
    #[error("an address of this host")]
    ThisHost,
    /// The name resolved to no address.
    #[error("the name resolved to no address")]
    NoAddress,
    /// More redirects than the policy follows.
    #[error("more than 5 redirects")]
    TooManyRedirects,
}

impl Blocked {
    /// A short stable label (logs and metrics).
    pub fn as_str(self) -> &'static str {
        match self {
            Blocked::Scheme => "scheme",
            Blocked::NoHost => "no_host",
            Blocked::Credentials => "credentials",
            Blocked::Port => "port",
            Blocked::Address(r) => r.as_str(),
            Blocked::Private => "private",
            Blocked::ThisHost => "this_host",
            Blocked::NoAddress => "no_address",
            Blocked::TooManyRedirects => "redirects",
        }
    }
}

/// Why a URL could not be vetted.
#[derive(Debug, thiserror::Error)]
pub enum VetError {
    /// The policy refuses it.
    #[error("refused by the fetch policy: {0}")]
    Blocked(#[from] Blocked),
    /// The name could not be resolved.
    #[error("the name could not be resolved")]
    Resolve(#[source] io::Error),
}

/// The boxed future of a lookup.
pub type ResolveFuture<'a> = Pin<Box<dyn Future<Output = io::Result<Vec<SocketAddr>>> + Send + 'a>>;

/// Name resolution (the system's, or a test's).
pub trait Resolve: Send + Sync + std::fmt::Debug {
    /// Every address of `host` (a DNS name, never an IP literal), with `port`.
    fn resolve<'a>(&'a self, host: &'a str, port: u16) -> ResolveFuture<'a>;
}

/// The system resolver (`getaddrinfo` through tokio).
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemResolver;

impl Resolve for SystemResolver {
    fn resolve<'a>(&'a self, host: &'a str, port: u16) -> ResolveFuture<'a> {
        Box::pin(async move { Ok(tokio::net::lookup_host((host, port)).await?.collect()) })
    }
}

/// A URL that passed the policy: where to connect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vetted {
    /// The DNS name to pin to [`Self::addrs`], `None` for an IP literal (the client connects to it as is).
    pub name: Option<String>,
    /// The checked addresses, each with the URL's port.
    pub addrs: Vec<SocketAddr>,
}

impl Vetted {
    /// `builder` made to reach these addresses only: no proxy, no automatic redirects (each hop is a new URL for
    /// its caller to vet), and a resolver that answers nothing but [`Self::name`], pinned to [`Self::addrs`] —
    /// nothing is looked up a second time. Every client that connects to a vetted URL is built through this
    /// (the host's `web/*` and `image/*` fetches, the fleet's plugin package downloads).
    pub fn pin(&self, builder: reqwest::ClientBuilder) -> reqwest::ClientBuilder {
        let builder = builder
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .dns_resolver(std::sync::Arc::new(NoLookup));
        match &self.name {
            Some(name) => builder.resolve_to_addrs(name, &self.addrs),
            None => builder,
        }
    }
}

/// A resolver that resolves nothing: a pinned client may only use the addresses pinned for its one name.
#[derive(Debug)]
struct NoLookup;

impl reqwest::dns::Resolve for NoLookup {
    fn resolve(&self, _name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        Box::pin(async {
            Err::<reqwest::dns::Addrs, Box<dyn std::error::Error + Send + Sync>>(
                "name not vetted by the fetch policy".into(),
            )
        })
    }
}

/// The policy (see the module documentation).
#[derive(Debug, Clone)]
pub struct SsrfPolicy {
    refused_ranges: Vec<IpNet>,
    test_allow: Vec<SocketAddr>,
    /// The operator's ranges (the cluster's): refused before any exception.
    denied: Vec<IpNet>,
}

impl SsrfPolicy {
    /// The policy, with the test-only exact `ip:port` exceptions (empty in production).
    pub fn new(test_allow: Vec<SocketAddr>) -> SsrfPolicy {
        let mut refused_ranges = egress::special_ranges();
        refused_ranges.extend(EXTRA_RANGES.iter().filter_map(|r| r.parse::<IpNet>().ok()));
        let test_allow = test_allow
            .into_iter()
            .map(|a| SocketAddr::new(egress::canonical(a.ip()), a.port()))
            .collect();
        SsrfPolicy {
            refused_ranges,
            test_allow,
            denied: Vec::new(),
        }
    }

    /// This policy refusing `ranges` too (the cluster's own, `WebConfig::deny_cidrs`), whatever
    /// `test_allow_addrs` says.
    #[must_use]
    pub fn denying(mut self, ranges: &[IpNet]) -> SsrfPolicy {
        self.denied.extend(ranges.iter().map(IpNet::trunc));
        self
    }

    /// The URL's own rules (scheme, host, port), before any lookup. Returns the host and port.
    pub fn check_url<'u>(&self, url: &'u Url) -> Result<(url::Host<&'u str>, u16), Blocked> {
        if !matches!(url.scheme(), "http" | "https") {
            return Err(Blocked::Scheme);
        }
        let host = url.host().ok_or(Blocked::NoHost)?;
        if !url.username().is_empty() || url.password().is_some() {
            return Err(Blocked::Credentials);
        }
        let port = url.port_or_known_default().ok_or(Blocked::Port)?;
        if !WEB_FETCH_PORTS.contains(&port) && !self.test_allow.iter().any(|a| a.port() == port) {
            return Err(Blocked::Port);
        }
        Ok((host, port))
    }

    /// Whether the fetcher may connect to `addr`.
    pub fn check_addr(&self, addr: SocketAddr) -> Result<(), Blocked> {
        let ip = egress::canonical(addr.ip());
        if self.denied.iter().any(|n| n.contains(&ip)) {
            return Err(Blocked::Private);
        }
        if self.test_allow.contains(&SocketAddr::new(ip, addr.port())) {
            return Ok(());
        }
        if !WEB_FETCH_PORTS.contains(&addr.port()) {
            return Err(Blocked::Port);
        }
        if let Some(refusal) = egress::fixed_refusal(ip) {
            return Err(Blocked::Address(refusal));
        }
        if self.refused_ranges.iter().any(|n| n.contains(&ip)) {
            return Err(Blocked::Private);
        }
        if egress::is_local(ip) {
            return Err(Blocked::ThisHost);
        }
        Ok(())
    }

    /// Checks `url`, resolves its host once (`resolver`; IP literals are not looked up) and checks every
    /// address: all of them must pass, or the URL is refused.
    pub async fn vet(&self, url: &Url, resolver: &dyn Resolve) -> Result<Vetted, VetError> {
        let (host, port) = self.check_url(url)?;
        let (name, addrs) = match host {
            url::Host::Ipv4(ip) => (None, vec![SocketAddr::new(IpAddr::V4(ip), port)]),
            url::Host::Ipv6(ip) => (None, vec![SocketAddr::new(IpAddr::V6(ip), port)]),
            url::Host::Domain(name) => {
                let addrs = resolver.resolve(name, port).await.map_err(VetError::Resolve)?;
                (Some(name.to_owned()), addrs)
            }
        };
        if addrs.is_empty() {
            return Err(Blocked::NoAddress.into());
        }
        for addr in &addrs {
            // The port of every address is the URL's, whatever the resolver said.
            self.check_addr(SocketAddr::new(addr.ip(), port))?;
        }
        let addrs = addrs.into_iter().map(|a| SocketAddr::new(a.ip(), port)).collect();
        Ok(Vetted { name, addrs })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    fn policy() -> SsrfPolicy {
        SsrfPolicy::new(Vec::new())
    }

    fn addr(text: &str) -> SocketAddr {
        text.parse().expect("socket address")
    }

    /// A resolver answering from a table, counting its lookups.
    #[derive(Debug, Default)]
    struct Table {
        answers: Mutex<Vec<Vec<SocketAddr>>>,
        lookups: AtomicUsize,
    }

    impl Table {
        /// Answers `rounds` in order (the last one again once they run out).
        fn new(rounds: &[&[&str]]) -> Table {
            Table {
                answers: Mutex::new(
                    rounds
                        .iter()
                        .rev()
                        .map(|r| r.iter().map(|a| addr(a)).collect())
                        .collect(),
                ),
                lookups: AtomicUsize::new(0),
            }
        }
    }

    impl Resolve for Table {
        fn resolve<'a>(&'a self, _host: &'a str, _port: u16) -> ResolveFuture<'a> {
            self.lookups.fetch_add(1, Ordering::SeqCst);
            let mut answers = self
                .answers
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let next = if answers.len() > 1 {
                answers.pop().unwrap_or_default()
            } else {
                answers.last().cloned().unwrap_or_default()
            };
            Box::pin(async move { Ok(next) })
        }
    }

    #[test]
    fn every_blocked_range_is_refused_at_its_edges() {
        let p = policy();
        let blocked = [
            // Loopback, unspecified.
            ("127.0.0.1:80", "loopback"),
            ("127.255.255.255:80", "loopback"),
            ("0.0.0.0:80", "loopback"),
            ("[::1]:80", "loopback"),
            ("[::]:80", "loopback"),
            // Link-local, the metadata address among them.
            ("169.254.169.254:80", "link_local"),
            ("169.254.0.0:80", "link_local"),
            ("169.254.255.255:443", "link_local"),
            ("[fe80::1]:80", "link_local"),
            ("[febf:ffff::1]:80", "link_local"),
            // Multicast, broadcast.
            ("224.0.0.1:80", "multicast"),
            ("239.255.255.255:80", "multicast"),
            ("255.255.255.255:80", "multicast"),
            ("[ff02::1]:80", "multicast"),
            // RFC 1918.
            ("10.0.0.0:80", "private"),
            ("10.255.255.255:80", "private"),
            ("172.16.0.0:80", "private"),
            ("172.31.255.255:80", "private"),
            ("192.168.0.0:80", "private"),
            ("192.168.255.255:80", "private"),
            // CGNAT.
            ("100.64.0.0:80", "private"),
            ("100.127.255.255:80", "private"),
            // "This network", documentation, benchmarking, reserved.
            ("0.1.2.3:80", "private"),
            ("192.0.2.1:80", "private"),
            ("198.18.0.1:80", "private"),
            ("198.51.100.7:80", "private"),
            ("203.0.113.9:80", "private"),
            ("240.0.0.1:80", "private"),
            // ULA, site-local, documentation, NAT64, 6to4, Teredo, discard.
            ("[fc00::1]:80", "private"),
            ("[fd00::2]:80", "private"),
            ("[fdff:ffff::1]:80", "private"),
            ("[fec0::1]:80", "private"),
            ("[2001:db8::1]:80", "private"),
            ("[64:ff9b::a00:1]:80", "private"),
            ("[2002:a00:1::1]:80", "private"),
            ("[2001::1]:80", "private"),
            ("[100::1]:80", "private"),
            // IPv4-mapped IPv6: judged as the IPv4 address.
            ("[::ffff:127.0.0.1]:80", "loopback"),
            ("[::ffff:169.254.169.254]:80", "link_local"),
            ("[::ffff:10.1.2.3]:80", "private"),
            // IPv4-compatible IPv6.
            ("[::127.0.0.1]:80", "private"),
            ("[::10.0.0.1]:80", "private"),
        ];
        for (a, why) in blocked {
            let got = p.check_addr(addr(a)).expect_err(a);
            assert_eq!(got.as_str(), why, "{a}: {got}");
        }
        // Just outside the ranges: public addresses pass.
        for a in [
            "8.8.8.8:80",
            "9.255.255.255:443",
            "11.0.0.0:8080",
            "100.63.255.255:80",
            "100.128.0.0:80",
            "172.15.255.255:80",
            "172.32.0.0:80",
            "169.253.255.255:80",
            "169.255.0.0:80",
            "192.167.255.255:80",
            "192.169.0.0:8443",
            "223.255.255.255:80",
            "[2606:4700::1111]:443",
            "[::ffff:8.8.8.8]:80",
            "[fbff:ffff::1]:80",
        ] {
            assert_eq!(p.check_addr(addr(a)), Ok(()), "{a}");
        }
    }

    #[test]
    fn only_the_four_ports_pass() {
        let p = policy();
        for port in [80, 443, 8080, 8443] {
            assert_eq!(
                p.check_addr(SocketAddr::new("8.8.8.8".parse().unwrap(), port)),
                Ok(())
            );
        }
        for port in [22, 79, 81, 442, 444, 8079, 8081, 8442, 8444, 0, 65535] {
            assert_eq!(
                p.check_addr(SocketAddr::new("8.8.8.8".parse().unwrap(), port)),
                Err(Blocked::Port),
                "{port}"
            );
        }
        for (url, ok) in [
            ("http://example.com/", true),
            ("https://example.com/", true),
            ("http://example.com:8080/", true),
            ("https://example.com:8443/", true),
            ("http://example.com:443/", true),
            ("http://example.com:8081/", false),
            ("http://example.com:22/", false),
            ("https://example.com:444/", false),
        ] {
            let url = Url::parse(url).unwrap();
            assert_eq!(p.check_url(&url).is_ok(), ok, "{url}");
        }
    }

    #[test]
    fn only_http_and_https_with_a_host_pass() {
        let p = policy();
        for url in [
            "ftp://example.com/",
            "file:///etc/passwd",
            "gopher://example.com:80/",
            "data:text/plain,hi",
            "ws://example.com/",
            "javascript:alert(1)",
            "http://user:pw@example.com/",
            "https://user@example.com/",
        ] {
            let url = Url::parse(url).unwrap();
            assert!(
                matches!(
                    p.check_url(&url),
                    Err(Blocked::Scheme | Blocked::NoHost | Blocked::Credentials)
                ),
                "{url}"
            );
        }
    }

    #[tokio::test]
    async fn ip_literals_in_every_spelling_are_checked_without_a_lookup() {
        let p = policy();
        let table = Table::new(&[&["8.8.8.8:80"]]);
        for url in [
            "http://127.0.0.1/",
            "http://2130706433/",
            "http://0177.0.0.1/",
            "http://0x7f.0.0.1/",
            "http://0x7f000001/",
            "http://127.1/",
            "http://[::1]/",
            "http://[::ffff:7f00:1]/",
            "http://[0:0:0:0:0:ffff:127.0.0.1]/",
            "http://169.254.169.254/latest/meta-data/",
            "http://0251.0376.0251.0376/",
            "http://10.0.0.1/",
            "http://012.0.0.1/",
        ] {
            let parsed = Url::parse(url).unwrap();
            let got = p.vet(&parsed, &table).await;
            assert!(matches!(got, Err(VetError::Blocked(_))), "{url}: {got:?}");
        }
        assert_eq!(
            table.lookups.load(Ordering::SeqCst),
            0,
            "literals are never looked up"
        );
    }

    #[tokio::test]
    async fn a_name_passes_only_if_every_address_it_resolves_to_passes() {
        let p = policy();
        let url = Url::parse("https://example.test/page").unwrap();
        let good = Table::new(&[&["8.8.8.8:0", "[2606:4700::1111]:0"]]);
        let vetted = p.vet(&url, &good).await.expect("public");
        assert_eq!(vetted.name.as_deref(), Some("example.test"));
        assert_eq!(
            vetted.addrs,
            vec![addr("8.8.8.8:443"), addr("[2606:4700::1111]:443")]
        );
        for bad in [
            &["8.8.8.8:0", "127.0.0.1:0"][..],
            &["10.0.0.1:0"],
            &["8.8.8.8:0", "[::1]:0"],
            &["169.254.169.254:0"],
            &["[::ffff:192.168.1.1]:0"],
        ] {
            let table = Table::new(&[bad]);
            assert!(
                matches!(p.vet(&url, &table).await, Err(VetError::Blocked(_))),
                "{bad:?}"
            );
        }
        let none = Table::new(&[&[]]);
        assert!(matches!(
            p.vet(&url, &none).await,
            Err(VetError::Blocked(Blocked::NoAddress))
        ));
    }

    #[tokio::test]
    async fn a_rebinding_name_is_looked_up_once_and_only_the_checked_addresses_are_returned() {
        // First answer public, every later one loopback: the policy looks up once, so what it returns (and
        // what the fetcher pins) is what it checked.
        let p = policy();
        let url = Url::parse("http://rebind.test/").unwrap();
        let table = Table::new(&[&["8.8.8.8:0"], &["127.0.0.1:0"]]);
        let vetted = p.vet(&url, &table).await.expect("first answer is public");
        assert_eq!(vetted.addrs, vec![addr("8.8.8.8:80")]);
        assert_eq!(table.lookups.load(Ordering::SeqCst), 1);
        // A second vet (a redirect back to the same name) looks up again and is refused.
        assert!(matches!(p.vet(&url, &table).await, Err(VetError::Blocked(_))));
    }

    #[test]
    fn the_clusters_own_ranges_are_refused_even_where_global() {
        let cluster: Vec<IpNet> = vec![
            "2600:1f18:4000::/40".parse().unwrap(),
            "34.118.224.0/20".parse().unwrap(),
        ];
        let p = SsrfPolicy::new(vec![addr("[2600:1f18:4000::7]:443")]).denying(&cluster);
        for refused in [
            "[2600:1f18:4000::7]:443",
            "[2600:1f18:40ff::1]:80",
            "34.118.230.1:443",
            "[::ffff:34.118.230.1]:443",
        ] {
            assert_eq!(p.check_addr(addr(refused)), Err(Blocked::Private), "{refused}");
        }
        // Just outside them, the public internet as before.
        for allowed in ["[2600:1f18:4100::1]:443", "34.118.240.1:443"] {
            assert_eq!(p.check_addr(addr(allowed)), Ok(()), "{allowed}");
        }
        assert_eq!(
            SsrfPolicy::new(Vec::new()).check_addr(addr("[2600:1f18:4000::7]:443")),
            Ok(())
        );
    }

    #[test]
    fn test_allow_addrs_open_exactly_one_ip_and_port() {
        let p = SsrfPolicy::new(vec![addr("127.0.0.1:4567")]);
        assert_eq!(p.check_addr(addr("127.0.0.1:4567")), Ok(()));
        assert_eq!(p.check_addr(addr("[::ffff:127.0.0.1]:4567")), Ok(()));
        assert!(p.check_addr(addr("127.0.0.1:4568")).is_err());
        assert!(p.check_addr(addr("127.0.0.2:4567")).is_err());
        assert!(p.check_addr(addr("127.0.0.1:80")).is_err());
        assert!(p.check_addr(addr("[::1]:4567")).is_err());
        let url = Url::parse("http://127.0.0.1:4567/").unwrap();
        assert!(p.check_url(&url).is_ok());
    }
}
