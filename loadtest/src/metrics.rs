//! The warm-hit ratio from the fleet's Prometheus `/metrics` (`cloud_agents_plugin_warm_hits_total` and
//! `cloud_agents_plugin_cold_starts_total`, summed over every series), scraped before and after the run: with
//! `--spawn` from the child's HTTP listener, else from `LOADTEST_METRICS_URL` (e.g.
//! `http://127.0.0.1:8080/metrics`) when set. Loopback only.

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::time::Duration;

const WARM: &str = "cloud_agents_plugin_warm_hits_total";
const COLD: &str = "cloud_agents_plugin_cold_starts_total";

/// (warm hits, cold starts) so far, or why not.
pub(crate) fn scrape(url: &str) -> Result<(f64, f64), String> {
    let rest = url
        .strip_prefix("http://127.0.0.1:")
        .ok_or_else(|| format!("{url}: only http://127.0.0.1:PORT/... is scraped"))?;
    let (port, path) = rest
        .split_once('/')
        .map_or((rest, "/metrics".to_string()), |(p, path)| {
            (p, format!("/{path}"))
        });
    let port: u16 = port.parse().map_err(|_| format!("{url}: bad port"))?;
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut stream =
        TcpStream::connect_timeout(&addr, Duration::from_secs(2)).map_err(|e| format!("{url}: {e}"))?;
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut body = String::new();
    stream
        .read_to_string(&mut body)
        .map_err(|e| format!("{url}: {e}"))?;
    if !body.starts_with("HTTP/1.1 200") && !body.starts_with("HTTP/1.0 200") {
        return Err(format!("{url}: {}", body.lines().next().unwrap_or("no answer")));
    }
    let sum = |name: &str| -> Option<f64> {
        let values: Vec<f64> = body
            .lines()
            .filter(|l| l.starts_with(name) && matches!(l.as_bytes().get(name.len()), Some(b' ' | b'{')))
            .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse().ok()))
            .collect();
        (!values.is_empty()).then(|| values.iter().sum())
    };
    match (sum(WARM), sum(COLD)) {
        (Some(w), Some(c)) => Ok((w, c)),
        _ => Err(format!("{url} exports no {WARM} / {COLD}")),
    }
}

/// The ratio between two scrapes (`None` when no plugin call happened in between).
pub(crate) fn ratio(before: (f64, f64), after: (f64, f64)) -> Option<f64> {
    let warm = (after.0 - before.0).max(0.0);
    let cold = (after.1 - before.1).max(0.0);
    (warm + cold > 0.0).then(|| (warm / (warm + cold) * 10_000.0).round() / 10_000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratio_of_deltas() {
        assert_eq!(ratio((10.0, 5.0), (19.0, 6.0)), Some(0.9));
        assert_eq!(ratio((1.0, 1.0), (1.0, 1.0)), None);
        assert!(scrape("http://example.invalid/metrics").is_err());
    }
}
