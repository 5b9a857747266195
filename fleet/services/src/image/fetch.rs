//! Input images of `image/edit` and `reference_image_urls` (spec §8.6 `-32314 REFERENCE_FETCH_FAILED`):
//!
//! * a link the fleet signed ([`HostObjects::get_link`]: `/v1/files/{bucket}/{object}?exp&d&fn&sig`, relative
//!   or on any host) is read from the object store directly, never over HTTP, and only when it verifies, has
//!   not expired, and names an object of the calling user (an `image/*` result, a `host/uploadFile` object or
//!   one of the user's APS files);
//! * any other URL is fetched under the SSRF policy: `http`/`https` only, no credentials, ports 80, 443, 8080
//!   and 8443; the host is resolved once and **every** address must be public (no private, loopback,
//!   link-local, CGNAT, multicast, reserved or documentation range, IPv4-mapped and NAT64 IPv6 included); the
//!   connection goes to the address that was checked (no second resolution to rebind); redirects are not
//!   followed; at most [`MAX_INPUT_BYTES`].
//!
//! Errors name the input (`image_url`, `reference_image_urls[2]`) and the rule, never the URL's query.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use fleet_proto::api::user_key;
use tokio::io::AsyncReadExt as _;

use crate::files::{Bucket, HostObjects};

/// Largest input image read (the upload family's per-file default, spec §7.4: 20 MiB).
pub(crate) const MAX_INPUT_BYTES: usize = fleet_proto::limits::UPLOAD_MAX_FILE_BYTES;

/// Ports a fetched URL may name (spec §8.9's SSRF policy).
pub(crate) const ALLOWED_PORTS: [u16; 4] = [80, 443, 8080, 8443];

/// Why an input image could not be had. `Display` carries no URL.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum FetchError {
    /// Not an absolute http(s) URL, or credentials in it.
    #[error("not an absolute http(s) URL without credentials")]
    BadUrl,
    /// A port outside [`ALLOWED_PORTS`].
    #[error("port {0} is not allowed (80, 443, 8080, 8443)")]
    Port(u16),
    /// The host resolves to an address that is not public.
    #[error("the host resolves to a non-public address")]
    Private,
    /// The host did not resolve.
    #[error("the host does not resolve")]
    Unresolved,
    /// A fleet link that does not verify, expired, or is another user's.
    #[error("a fleet link that is invalid, expired or not the caller's: {0}")]
    Link(&'static str),
    /// Not found in the object store.
    #[error("the linked object does not exist")]
    Missing,
    /// Over [`MAX_INPUT_BYTES`].
    #[error("larger than {MAX_INPUT_BYTES} bytes")]
    TooLarge,
    /// HTTP status other than 2xx (redirects included).
    #[error("HTTP status {0}")]
    Status(u16),
    /// Transport failure.
    #[error("the request failed: {0}")]
    Transport(&'static str),
}

/// Whether `ip` is a public unicast address (the SSRF policy).
pub(crate) fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_public_v4(v4),
        IpAddr::V6(v6) => {
            if let Some(v4) = embedded_v4(v6) {
                return is_public_v4(v4);
            }
            let s = v6.segments();
            !(v6.is_unspecified()
                || v6.is_loopback()
                || v6.is_multicast()
                || (s[0] & 0xfe00) == 0xfc00 // unique local fc00::/7
                || (s[0] & 0xffc0) == 0xfe80 // link-local fe80::/10
                || (s[0] & 0xffc0) == 0xfec0 // site-local fec0::/10
                || (s[0] == 0x2001 && s[1] == 0x0db8)) // documentation 2001:db8::/32
        }
    }
}

/// The IPv4 address inside an IPv4-mapped (`::ffff:a.b.c.d`), IPv4-compatible (`::a.b.c.d`) or NAT64
/// (`64:ff9b::a.b.c.d`) IPv6 address.
fn embedded_v4(v6: Ipv6Addr) -> Option<Ipv4Addr> {
    let s = v6.segments();
    let tail = Ipv4Addr::new(
        (s[6] >> 8) as u8,
        (s[6] & 0xff) as u8,
        (s[7] >> 8) as u8,
        (s[7] & 0xff) as u8,
    );
    let mapped = s[..5] == [0; 5] && s[5] == 0xffff;
    let compatible = s[..6] == [0; 6] && !v6.is_loopback() && !v6.is_unspecified();
    let nat64 = s[0] == 0x64 && s[1] == 0xff9b && s[2..6] == [0; 4];
    (mapped || compatible || nat64).then_some(tail)
}

fn is_public_v4(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    !(ip.is_unspecified()
        || a == 0 // "this network" 0/8
        || ip.is_private()
        || ip.is_loopback()
        || ip.is_link_local()
        || ip.is_multicast()
        || ip.is_broadcast()
        || ip.is_documentation()
        || a >= 240 // reserved 240/4
        || (a == 100 && (b & 0xc0) == 64) // CGNAT 100.64/10
        || (a == 192 && b == 0 && c == 0) // IETF 192.0.0/24
        || (a == 198 && (b & 0xfe) == 18)) // benchmarking 198.18/15
}

/// Reads a fleet-signed link of `user` from the object store; `None` when `url` is not shaped like a fleet
/// link (`/v1/files/{bucket}/{object}` with `exp`, `d`, `fn` and `sig`).
pub(crate) async fn fleet_link(
    objects: &HostObjects,
    user: &str,
    url: &str,
) -> Option<Result<(Vec<u8>, String), FetchError>> {
    let path_and_query = match url.strip_prefix('/') {
        Some(_) => url.to_owned(),
        None => {
            let parsed = reqwest::Url::parse(url).ok()?;
            format!("{}?{}", parsed.path(), parsed.query()?)
        }
    };
    let (path, query) = path_and_query.split_once('?')?;
    let rest = path.strip_prefix("/v1/files/")?;
    let (bucket, object) = rest.split_once('/')?;
    let mut q = std::collections::HashMap::new();
    for pair in query.split('&') {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        q.insert(k, v);
    }
    // Without every part of a signed GET link, it is some other site's URL.
    let (Some(exp), Some(d), Some(f), Some(sig)) = (q.get("exp"), q.get("d"), q.get("fn"), q.get("sig"))
    else {
        return None;
    };
    let Ok(exp) = exp.parse::<u64>() else {
        return Some(Err(FetchError::Link("bad expiry")));
    };
    let link = match objects.verify_get(bucket, object, exp, d, f, sig) {
        Ok(l) => l,
        Err(_) => return Some(Err(FetchError::Link("signature or expiry"))),
    };
    let owner = user_key(user);
    let segments: Vec<&str> = link.object.split('/').collect();
    let own = match link.bucket {
        Bucket::Uploads => segments.get(2) == Some(&owner.as_str()),
        Bucket::Files => segments.first() == Some(&owner.as_str()),
        Bucket::Staging => false,
    };
    if !own {
        return Some(Err(FetchError::Link("another user's object")));
    }
    Some(read_object(objects, link.bucket, &link.object).await)
}

async fn read_object(
    objects: &HostObjects,
    bucket: Bucket,
    name: &str,
) -> Result<(Vec<u8>, String), FetchError> {
    let store = objects.store(bucket);
    let info = store.info(name).await.map_err(|_| FetchError::Missing)?;
    if info.size > MAX_INPUT_BYTES {
        return Err(FetchError::TooLarge);
    }
    let mime = info
        .metadata
        .get(crate::files::META_CONTENT_TYPE)
        .cloned()
        .unwrap_or_default();
    let object = store.get(name).await.map_err(|_| FetchError::Missing)?;
    let mut bytes = Vec::with_capacity(info.size);
    object
        .take(MAX_INPUT_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .await
        .map_err(|_| FetchError::Transport("object store read"))?;
    if bytes.len() > MAX_INPUT_BYTES {
        return Err(FetchError::TooLarge);
    }
    Ok((bytes, mime))
}

/// Fetches a public URL under the SSRF policy, within `timeout`.
pub(crate) async fn fetch_public(url: &str, timeout: Duration) -> Result<(Vec<u8>, String), FetchError> {
    let parsed = reqwest::Url::parse(url).map_err(|_| FetchError::BadUrl)?;
    if !matches!(parsed.scheme(), "http" | "https")
        || !parsed.username().is_empty()
        || parsed.password().is_some()
    {
        return Err(FetchError::BadUrl);
    }
    let port = parsed.port_or_known_default().ok_or(FetchError::BadUrl)?;
    if !ALLOWED_PORTS.contains(&port) {
        return Err(FetchError::Port(port));
    }
    let host = parsed.host_str().ok_or(FetchError::BadUrl)?;
    let literal = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<IpAddr>()
        .ok();
    let work = async {
        let (name, addrs): (Option<&str>, Vec<SocketAddr>) = match literal {
            Some(ip) => (None, vec![SocketAddr::new(ip, port)]),
            None => {
                let found: Vec<SocketAddr> = tokio::net::lookup_host((host, port))
                    .await
                    .map_err(|_| FetchError::Unresolved)?
                    .collect();
                (Some(host), found)
            }
        };
        let first = *addrs.first().ok_or(FetchError::Unresolved)?;
        if addrs.iter().any(|a| !is_public(a.ip())) {
            return Err(FetchError::Private);
        }
        let mut builder = reqwest::Client::builder()
            // A proxy would resolve the host itself, after the check.
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(crate::llm::CONNECT_TIMEOUT);
        if let Some(name) = name {
            // Connect to the address checked above, not to a second resolution.
            builder = builder.resolve(name, first);
        }
        let client = builder.build().map_err(|_| FetchError::Transport("client"))?;
        read_capped(client.get(parsed.clone()).send().await).await
    };
    tokio::time::timeout(timeout, work)
        .await
        .unwrap_or(Err(FetchError::Transport("timed out")))
}

/// The body of a 2xx answer, at most [`MAX_INPUT_BYTES`], and its `Content-Type`.
pub(crate) async fn read_capped(
    sent: Result<reqwest::Response, reqwest::Error>,
) -> Result<(Vec<u8>, String), FetchError> {
    let mut response = sent.map_err(|_| FetchError::Transport("connection or request"))?;
    let status = response.status();
    if !status.is_success() {
        return Err(FetchError::Status(status.as_u16()));
    }
    if response
        .content_length()
        .is_some_and(|n| n > MAX_INPUT_BYTES as u64)
    {
        return Err(FetchError::TooLarge);
    }
    let mime = response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let mut bytes = Vec::new();
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|_| FetchError::Transport("body"))?
    {
        if bytes.len() + chunk.len() > MAX_INPUT_BYTES {
            return Err(FetchError::TooLarge);
        }
        bytes.extend_from_slice(&chunk);
    }
    Ok((bytes, mime))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn only_public_addresses_pass() {
        for private in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "0.0.0.0",
            "100.64.0.1",
            "224.0.0.1",
            "255.255.255.255",
            "240.0.0.1",
            "192.0.2.1",
            "198.18.0.1",
            "::1",
            "::",
            "fc00::1",
            "fd12::1",
            "fe80::1",
            "ff02::1",
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
            "::127.0.0.1",
            "64:ff9b::a9fe:a9fe",
            "2001:db8::1",
        ] {
            assert!(!is_public(ip(private)), "{private}");
        }
        for public in ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8"] {
            assert!(is_public(ip(public)), "{public}");
        }
    }

    #[tokio::test]
    async fn urls_outside_the_policy_are_refused_before_any_connection() {
        let t = Duration::from_secs(5);
        for (url, want) in [
            ("file:///etc/passwd", FetchError::BadUrl),
            ("ftp://example.com/x.png", FetchError::BadUrl),
            ("http://user:pw@example.com/x.png", FetchError::BadUrl),
            ("http://example.com:22/x.png", FetchError::Port(22)),
            ("http://127.0.0.1/x.png", FetchError::Private),
            // Decimal, octal and hex forms of 127.0.0.1 are normalised by the URL parser.
            ("http://2130706433/x.png", FetchError::Private),
            ("http://0177.0.0.1/x.png", FetchError::Private),
            ("http://0x7f.1/x.png", FetchError::Private),
            ("http://[::ffff:127.0.0.1]/x.png", FetchError::Private),
            ("http://169.254.169.254/latest/meta-data", FetchError::Private),
            ("http://localhost:8080/x.png", FetchError::Private),
        ] {
            assert_eq!(fetch_public(url, t).await.err(), Some(want), "{url}");
        }
    }
}
