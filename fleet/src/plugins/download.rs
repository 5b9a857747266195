//! Step 2 of the pipeline: a package download to `<tmp>/executa-{tool_id}-{rand}`, with progress.
//!
//! Only `http` and `https` URLs. The file is removed when the returned [`TempPackage`] is dropped, so a failed or
//! interrupted download leaves nothing behind and commits nothing; retrying starts afresh.
//!
//! **Where a download may connect** ([`SourcePolicy`]). The front downloads from its own place in the network —
//! one a confined plugin never has — so an operator token must not turn it into a way in: the host is resolved
//! once, every address it resolves to is checked, and the request connects only to those addresses (no second
//! lookup: a name that answers differently the second time gains nothing). Refused unless the operator allowed
//! the address's range (`fleet up --package-source-allow CIDR`, for a private package host): loopback and
//! unspecified, link-local (the cloud metadata address `169.254.169.254`), multicast and broadcast, and every
//! private or special-purpose range (`fleet_worker::egress::special_ranges`: RFC 1918, CGNAT, ULA, …); IPv4-mapped
//! IPv6 addresses are judged as the IPv4 address they carry. Redirects are followed by hand, at most
//! [`MAX_REDIRECTS`], each a new URL checked the same way. Refusals name the rule, never the address.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use fleet_services::web::ssrf::Vetted;
use fleet_worker::egress;
use ipnet::IpNet;
use reqwest::Url;
use tokio::io::AsyncWriteExt as _;

use super::{MAX_PACKAGE_BYTES, PluginError};

/// Redirects a download follows at most (each one checked like the first URL).
pub const MAX_REDIRECTS: usize = 5;

/// Where package downloads may connect (see the module docs).
#[derive(Debug, Clone, Default)]
pub struct SourcePolicy {
    allow: Vec<IpNet>,
}

/// Why a package URL's address is refused (fixed strings: never the address).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SourceRefusal {
    /// Loopback, link-local, multicast (the rules the egress policy never relaxes either).
    #[error("{0}; allow its range with --package-source-allow to download from it")]
    Address(egress::Refusal),
    /// A private or special-purpose range.
    #[error(
        "a private or special-purpose address; allow its range with --package-source-allow to download from it"
    )]
    Private,
    /// The URL has no host.
    #[error("the URL has no host")]
    NoHost,
    /// The name resolved to no address.
    #[error("the name resolved to no address")]
    NoAddress,
    /// More redirects than [`MAX_REDIRECTS`].
    #[error("more than 5 redirects")]
    TooManyRedirects,
}

impl SourcePolicy {
    /// The default policy, with `allow`'s ranges opened (an operator's private package hosts).
    pub fn allowing(allow: Vec<IpNet>) -> SourcePolicy {
        SourcePolicy {
            allow: allow.into_iter().map(|n| n.trunc()).collect(),
        }
    }

    /// Whether the download may connect to `ip`.
    pub fn check(&self, ip: IpAddr) -> Result<(), SourceRefusal> {
        let ip = egress::canonical(ip);
        if self.allow.iter().any(|n| n.contains(&ip)) {
            return Ok(());
        }
        if let Some(refusal) = egress::fixed_refusal(ip) {
            return Err(SourceRefusal::Address(refusal));
        }
        if egress::special_ranges().iter().any(|n| n.contains(&ip)) {
            return Err(SourceRefusal::Private);
        }
        Ok(())
    }

    /// Resolves `url`'s host once and checks every address: the DNS name to pin (`None` for an IP literal) and
    /// the addresses to connect to.
    async fn vet(&self, url: &Url) -> Result<Vetted, VetFailure> {
        let port = url.port_or_known_default().unwrap_or(80);
        let (name, addrs) = match url.host() {
            None => return Err(VetFailure::Refused(SourceRefusal::NoHost)),
            Some(url::Host::Ipv4(ip)) => (None, vec![SocketAddr::new(IpAddr::V4(ip), port)]),
            Some(url::Host::Ipv6(ip)) => (None, vec![SocketAddr::new(IpAddr::V6(ip), port)]),
            Some(url::Host::Domain(name)) => {
                let addrs: Vec<SocketAddr> = tokio::net::lookup_host((name, port))
                    .await
                    .map_err(VetFailure::Resolve)?
                    .collect();
                (Some(name.to_owned()), addrs)
            }
        };
        if addrs.is_empty() {
            return Err(VetFailure::Refused(SourceRefusal::NoAddress));
        }
        for addr in &addrs {
            self.check(addr.ip()).map_err(VetFailure::Refused)?;
        }
        Ok(Vetted { name, addrs })
    }
}

enum VetFailure {
    Refused(SourceRefusal),
    Resolve(std::io::Error),
}

/// Connecting to the package host.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest pause between two reads of the body.
pub const READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Progress is reported at least every this many bytes.
pub const PROGRESS_EVERY_BYTES: u64 = 1024 * 1024;

/// A package file on local disk, removed on drop.
#[derive(Debug)]
pub struct TempPackage {
    path: PathBuf,
}

impl TempPackage {
    /// A new, empty, uniquely named file `<dir>/executa-{tool_id}-{rand}{suffix}` (created exclusively).
    pub async fn create(
        dir: &Path,
        tool_hint: &str,
        suffix: &str,
    ) -> Result<(TempPackage, tokio::fs::File), PluginError> {
        let hint: String = tool_hint
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                    c
                } else {
                    '_'
                }
            })
            .take(64)
            .collect();
        let path = dir.join(format!("executa-{hint}-{:016x}{suffix}", rand::random::<u64>()));
        let file = tokio::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .await
            .map_err(PluginError::io(format!("create {}", path.display())))?;
        Ok((TempPackage { path }, file))
    }

    /// An existing path to remove on drop.
    pub fn adopt(path: PathBuf) -> TempPackage {
        TempPackage { path }
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempPackage {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Downloads `url` into a new temporary file in `dir`. A declared `expected_size` is checked against
/// `Content-Length` before the body is read and caps the body; the sha256 is verified by the install pipeline.
/// `progress(bytes_so_far, total)` is called as the body arrives.
pub async fn download(
    url: &str,
    dir: &Path,
    tool_hint: &str,
    expected_size: Option<u64>,
    policy: &SourcePolicy,
    progress: &(dyn Fn(u64, Option<u64>) + Send + Sync),
) -> Result<TempPackage, PluginError> {
    let fail = |reason: String| PluginError::Download {
        url: url.to_string(),
        reason,
    };
    let mut current = Url::parse(url).map_err(|e| fail(e.to_string()))?;
    let mut redirects = 0;
    let mut response = loop {
        if !matches!(current.scheme(), "http" | "https") {
            return Err(PluginError::BadRequest(format!(
                "unsupported URL scheme {:?}: only http and https",
                current.scheme()
            )));
        }
        let vetted = policy.vet(&current).await.map_err(|e| match e {
            VetFailure::Refused(why) => {
                tracing::warn!(rule = ?why, "a plugin package URL was refused by the source policy");
                fail(format!("refused: {why}"))
            }
            VetFailure::Resolve(e) => fail(format!("cannot resolve the host: {e}")),
        })?;
        let client = vetted
            .pin(
                reqwest::Client::builder()
                    .connect_timeout(CONNECT_TIMEOUT)
                    .read_timeout(READ_TIMEOUT),
            )
            .build()
            .map_err(|e| fail(e.to_string()))?;
        let response = client
            .get(current.clone())
            .send()
            .await
            .map_err(|e| fail(e.to_string()))?;
        let status = response.status();
        if status.is_redirection()
            && let Some(location) = response.headers().get(reqwest::header::LOCATION)
        {
            if redirects == MAX_REDIRECTS {
                return Err(fail(format!("refused: {}", SourceRefusal::TooManyRedirects)));
            }
            redirects += 1;
            let location = location
                .to_str()
                .map_err(|_| fail("a redirect to a location that is not text".into()))?;
            current = current
                .join(location)
                .map_err(|e| fail(format!("a redirect to a location that is not a URL: {e}")))?;
            continue;
        }
        break response;
    };
    if !response.status().is_success() {
        return Err(fail(format!("HTTP {}", response.status())));
    }
    let total = response.content_length();
    let cap = expected_size.unwrap_or(MAX_PACKAGE_BYTES).min(MAX_PACKAGE_BYTES);
    if let (Some(expected), Some(len)) = (expected_size, total)
        && expected != len
    {
        return Err(fleet_worker::install::InstallError::SizeMismatch {
            expected,
            actual: len,
        }
        .into());
    }
    if total.is_some_and(|len| len > cap) {
        return Err(fail(format!("the package is larger than {cap} bytes")));
    }
    let suffix = match fleet_worker::install::Format::infer(url) {
        fleet_worker::install::Format::TarGz => ".tar.gz",
        fleet_worker::install::Format::Zip => ".zip",
        fleet_worker::install::Format::Raw => "",
    };
    let (temp, mut file) = TempPackage::create(dir, tool_hint, suffix).await?;
    let mut received = 0u64;
    let mut reported = 0u64;
    progress(0, total);
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| fail(format!("after {received} bytes: {e}")))?
    {
        received += chunk.len() as u64;
        if received > cap {
            return Err(match expected_size {
                Some(expected) => fleet_worker::install::InstallError::SizeMismatch {
                    expected,
                    actual: received,
                }
                .into(),
                None => fail(format!("the package is larger than {cap} bytes")),
            });
        }
        file.write_all(&chunk)
            .await
            .map_err(PluginError::io(format!("write {}", temp.path().display())))?;
        if received - reported >= PROGRESS_EVERY_BYTES {
            reported = received;
            progress(received, total);
        }
    }
    if let Some(len) = total
        && received != len
    {
        return Err(fail(format!("interrupted: {received} of {len} bytes")));
    }
    file.flush()
        .await
        .map_err(PluginError::io(format!("write {}", temp.path().display())))?;
    file.sync_all()
        .await
        .map_err(PluginError::io(format!("write {}", temp.path().display())))?;
    progress(received, total);
    Ok(temp)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use axum::http::{StatusCode, header};
    use axum::response::IntoResponse;
    use axum::routing::get;

    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("an address")
    }

    #[test]
    fn only_public_addresses_unless_the_operator_allowed_the_range() {
        let default = SourcePolicy::default();
        for (addr, refusal) in [
            ("127.0.0.1", SourceRefusal::Address(egress::Refusal::Loopback)),
            ("::1", SourceRefusal::Address(egress::Refusal::Loopback)),
            ("0.0.0.0", SourceRefusal::Address(egress::Refusal::Loopback)),
            (
                "169.254.169.254",
                SourceRefusal::Address(egress::Refusal::LinkLocal),
            ),
            ("fe80::1", SourceRefusal::Address(egress::Refusal::LinkLocal)),
            ("224.0.0.1", SourceRefusal::Address(egress::Refusal::Multicast)),
            (
                "255.255.255.255",
                SourceRefusal::Address(egress::Refusal::Multicast),
            ),
            ("10.1.2.3", SourceRefusal::Private),
            ("172.16.0.1", SourceRefusal::Private),
            ("192.168.1.1", SourceRefusal::Private),
            ("100.64.0.1", SourceRefusal::Private),
            ("fd00::1", SourceRefusal::Private),
            // IPv4-mapped IPv6 is judged as the IPv4 address it carries.
            (
                "::ffff:169.254.169.254",
                SourceRefusal::Address(egress::Refusal::LinkLocal),
            ),
            ("::ffff:10.0.0.1", SourceRefusal::Private),
        ] {
            assert_eq!(default.check(ip(addr)), Err(refusal), "{addr}");
        }
        for public in ["93.184.216.34", "2606:2800:220:1::1", "::ffff:93.184.216.34"] {
            assert_eq!(default.check(ip(public)), Ok(()), "{public}");
        }
        // An allowed range opens exactly itself (its host bits ignored), whatever rule it would break.
        let allowed = SourcePolicy::allowing(vec![
            "127.0.0.1/32".parse().expect("cidr"),
            "10.9.8.7/16".parse().expect("cidr"),
        ]);
        assert_eq!(allowed.check(ip("127.0.0.1")), Ok(()));
        assert_eq!(allowed.check(ip("::ffff:127.0.0.1")), Ok(()));
        assert_eq!(
            allowed.check(ip("127.0.0.2")),
            Err(SourceRefusal::Address(egress::Refusal::Loopback))
        );
        assert_eq!(allowed.check(ip("10.9.0.1")), Ok(()));
        assert_eq!(allowed.check(ip("10.10.0.1")), Err(SourceRefusal::Private));
        assert_eq!(
            allowed.check(ip("169.254.169.254")),
            Err(SourceRefusal::Address(egress::Refusal::LinkLocal))
        );
    }

    /// A package server on 127.0.0.1: `/pkg` (counted), and redirects to it, to the metadata address, to this
    /// host over IPv6, and to itself.
    async fn server(hits: Arc<AtomicUsize>) -> (SocketAddr, tokio::task::JoinHandle<()>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let redirect = |to: String| (StatusCode::FOUND, [(header::LOCATION, to)]).into_response();
        let router = axum::Router::new()
            .route(
                "/pkg",
                get(move || {
                    hits.fetch_add(1, Ordering::SeqCst);
                    async { b"package bytes".to_vec() }
                }),
            )
            .route("/to-pkg", get(move || async move { redirect("/pkg".into()) }))
            .route(
                "/to-metadata",
                get(move || async move { redirect("http://169.254.169.254/latest/meta-data/".into()) }),
            )
            .route(
                "/to-v6",
                get(move || async move { redirect(format!("http://[::1]:{}/pkg", addr.port())) }),
            )
            .route(
                "/to-localhost",
                get(move || async move { redirect(format!("http://localhost:{}/pkg", addr.port())) }),
            )
            .route("/loop", get(move || async move { redirect("/loop".into()) }));
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        (addr, task)
    }

    async fn fetch(url: &str, policy: &SourcePolicy) -> Result<Vec<u8>, PluginError> {
        let dir = tempfile::tempdir().expect("dir");
        let temp = download(url, dir.path(), "t", None, policy, &|_, _| {}).await?;
        Ok(std::fs::read(temp.path()).expect("read"))
    }

    fn refused(r: Result<Vec<u8>, PluginError>, what: &str) {
        match r {
            Err(PluginError::Download { reason, .. }) => {
                assert!(reason.starts_with(&format!("refused: {what}")), "{reason}")
            }
            other => panic!("not refused: {other:?}"),
        }
    }

    #[tokio::test]
    async fn downloads_connect_only_to_checked_addresses_redirects_included() {
        let hits = Arc::new(AtomicUsize::new(0));
        let (addr, _server) = server(hits.clone()).await;
        let base = format!("http://{addr}");
        // Loopback is refused by default: nothing is sent.
        refused(
            fetch(&format!("{base}/pkg"), &SourcePolicy::default()).await,
            "loopback",
        );
        assert_eq!(hits.load(Ordering::SeqCst), 0, "no request reached the server");
        // Allowed: the package, directly and through a relative redirect.
        let allowed = SourcePolicy::allowing(vec!["127.0.0.1/32".parse().expect("cidr")]);
        assert_eq!(
            fetch(&format!("{base}/pkg"), &allowed).await.expect("ok"),
            b"package bytes"
        );
        assert_eq!(
            fetch(&format!("{base}/to-pkg"), &allowed).await.expect("ok"),
            b"package bytes"
        );
        assert_eq!(hits.load(Ordering::SeqCst), 2);
        // A redirect is a new URL, checked like the first: to the metadata address, to this host over IPv6 (not
        // in the allowed range) — refused before any connection; a name resolving to an allowed address passes.
        refused(
            fetch(&format!("{base}/to-metadata"), &allowed).await,
            "link-local",
        );
        refused(fetch(&format!("{base}/to-v6"), &allowed).await, "loopback");
        assert_eq!(hits.load(Ordering::SeqCst), 2);
        if tokio::net::lookup_host(("localhost", 80))
            .await
            .is_ok_and(|mut a| a.all(|a| a.ip() == ip("127.0.0.1")))
        {
            let got = fetch(&format!("{base}/to-localhost"), &allowed).await;
            assert_eq!(got.expect("localhost is 127.0.0.1 here"), b"package bytes");
        }
        // At most MAX_REDIRECTS.
        refused(
            fetch(&format!("{base}/loop"), &allowed).await,
            "more than 5 redirects",
        );
        // A literal in another spelling is the address it means.
        refused(
            fetch(
                &format!("http://2130706433:{}/pkg", addr.port()),
                &SourcePolicy::default(),
            )
            .await,
            "loopback",
        );
    }
}
