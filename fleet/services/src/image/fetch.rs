//! Input images of `image/edit` and `reference_image_urls` (spec §8.6 `-32314 REFERENCE_FETCH_FAILED`), and
//! the image URLs a provider answers with:
//!
//! * a link the fleet signed ([`HostObjects::get_link`]: `/v1/files/{bucket}/{object}?exp&d&fn&sig`, relative
//!   or on any host) is read from the object store directly, never over HTTP, and only when it verifies, has
//!   not expired, and names an object of the calling user (an `image/*` result, a `host/uploadFile` object or
//!   one of the user's APS files);
//! * any other URL is fetched by the `web/*` family's [`Fetcher`] under its one SSRF policy
//!   ([`crate::web::ssrf`]: http(s) without credentials, ports 80/443/8080/8443, one lookup with every address
//!   checked and pinned, each of at most 5 redirects checked again), at most [`MAX_INPUT_BYTES`];
//! * an image URL on the images upstream's own origin is read with the upstream's client, through the same
//!   body cap ([`crate::web::fetch::read_capped`]).
//!
//! Errors name the input (`image_url`, `reference_image_urls[2]`) and the rule, never the URL.

use fleet_proto::api::user_key;
use fleet_proto::limits::IMAGE_MAX_REQUEST_TIMEOUT;
use tokio::io::AsyncReadExt as _;

use crate::files::{Bucket, HostObjects};
use crate::web::fetch::{Fetcher, PageError, read_capped};
use crate::web::ssrf::Blocked;

/// Largest input image read (the upload family's per-file default, spec §7.4: 20 MiB).
pub(crate) const MAX_INPUT_BYTES: usize = fleet_proto::limits::UPLOAD_MAX_FILE_BYTES;

/// Why an input image could not be had. `Display` carries no URL.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum FetchError {
    /// Not a URL (or too long to be one).
    #[error("not a usable URL")]
    BadUrl,
    /// Refused by the SSRF policy.
    #[error("refused by the fetch policy: {0}")]
    Blocked(Blocked),
    /// A fleet link that does not verify, expired, or is another user's.
    #[error("a fleet link that is invalid, expired or not the caller's: {0}")]
    Link(&'static str),
    /// Not found in the object store.
    #[error("the linked object does not exist")]
    Missing,
    /// Over [`MAX_INPUT_BYTES`].
    #[error("larger than {MAX_INPUT_BYTES} bytes")]
    TooLarge,
    /// HTTP status other than 2xx (a redirect without a `Location` included).
    #[error("HTTP status {0}")]
    Status(u16),
    /// Not within the time allowed.
    #[error("timed out")]
    Timeout,
    /// Transport failure (unresolvable, unreachable, TLS, the object store).
    #[error("the request failed: {0}")]
    Transport(&'static str),
}

impl From<PageError> for FetchError {
    fn from(e: PageError) -> Self {
        match e {
            PageError::Blocked(b) => FetchError::Blocked(b),
            PageError::Timeout => FetchError::Timeout,
            PageError::Status(s) => FetchError::Status(s),
            PageError::Parse => FetchError::BadUrl,
            PageError::TooLarge => FetchError::TooLarge,
            PageError::Unreachable => FetchError::Transport("unresolvable or unreachable"),
        }
    }
}

/// Fetches a URL that is neither a fleet link nor the upstream's own under the SSRF policy of `fetcher`.
pub(crate) async fn public(fetcher: &Fetcher, url: &str) -> Result<Vec<u8>, FetchError> {
    let (_, bytes) = fetcher
        .bytes(url, MAX_INPUT_BYTES, IMAGE_MAX_REQUEST_TIMEOUT)
        .await?;
    Ok(bytes)
}

/// The body of the upstream's own answer to a request for one of its image URLs (2xx only, capped).
pub(crate) async fn own_origin(
    sent: Result<reqwest::Response, reqwest::Error>,
) -> Result<Vec<u8>, FetchError> {
    let response = sent.map_err(|_| FetchError::Transport("connection or request"))?;
    let status = response.status();
    if !status.is_success() {
        return Err(FetchError::Status(status.as_u16()));
    }
    Ok(read_capped(response, MAX_INPUT_BYTES).await?)
}

/// Reads a fleet-signed link of `user` from the object store; `None` when `url` is not shaped like a fleet
/// link (`/v1/files/{bucket}/{object}` with `exp`, `d`, `fn` and `sig`).
pub(crate) async fn fleet_link(
    objects: &HostObjects,
    user: &str,
    url: &str,
) -> Option<Result<Vec<u8>, FetchError>> {
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

async fn read_object(objects: &HostObjects, bucket: Bucket, name: &str) -> Result<Vec<u8>, FetchError> {
    let store = objects.store(bucket);
    let info = store.info(name).await.map_err(|_| FetchError::Missing)?;
    if info.size > MAX_INPUT_BYTES {
        return Err(FetchError::TooLarge);
    }
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
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use fleet_worker::egress::Refusal;

    use super::*;
    use crate::web::ssrf::{SsrfPolicy, SystemResolver};

    #[tokio::test]
    async fn urls_outside_the_policy_are_refused_before_any_connection() {
        let fetcher = Fetcher::new(SsrfPolicy::new(Vec::new()), Arc::new(SystemResolver));
        let loopback = FetchError::Blocked(Blocked::Address(Refusal::Loopback));
        for (url, want) in [
            ("file:///etc/passwd", FetchError::Blocked(Blocked::Scheme)),
            ("ftp://example.com/x.png", FetchError::Blocked(Blocked::Scheme)),
            (
                "http://user:pw@example.com/x.png",
                FetchError::Blocked(Blocked::Credentials),
            ),
            ("http://example.com:22/x.png", FetchError::Blocked(Blocked::Port)),
            ("not a url", FetchError::BadUrl),
            ("http://127.0.0.1/x.png", loopback.clone()),
            // Decimal, octal and hex forms of 127.0.0.1 are normalised by the URL parser.
            ("http://2130706433/x.png", loopback.clone()),
            ("http://0177.0.0.1/x.png", loopback.clone()),
            ("http://0x7f.1/x.png", loopback.clone()),
            ("http://[::ffff:127.0.0.1]/x.png", loopback.clone()),
            ("http://10.0.0.1/x.png", FetchError::Blocked(Blocked::Private)),
            (
                "http://169.254.169.254/latest/meta-data",
                FetchError::Blocked(Blocked::Address(Refusal::LinkLocal)),
            ),
            ("http://localhost:8080/x.png", loopback.clone()),
        ] {
            assert_eq!(public(&fetcher, url).await.err(), Some(want), "{url}");
        }
    }
}
