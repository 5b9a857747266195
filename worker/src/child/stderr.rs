//! The stderr ring of a plugin, both dialects (an Executa session's successive processes share one; an Animus
//! process has its own): drained continuously so a chatty plugin can never block on a full pipe, bounded in
//! bytes, long lines truncated, JWT-looking strings and the credential values the plugin was given redacted (spec
//! §6). Never parsed: it only feeds error messages and operators.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncRead, AsyncReadExt};

/// Longest line kept; the rest of a longer line is dropped.
const MAX_LINE: usize = 4096;

/// Shortest credential value redacted from stderr: shorter ones (a region, a flag) are no secret worth the false
/// matches.
const MIN_SECRET_LEN: usize = 8;

/// Credential values a ring remembers (the newest): a ring serves one user's one plugin.
const MAX_SECRETS: usize = 32;

/// What a remembered credential value is replaced by.
const REDACTED_CREDENTIAL: &str = "<redacted-credential>";

/// A bounded ring of stderr lines, shared between the drain task and readers.
#[derive(Debug, Clone)]
pub(crate) struct StderrRing {
    inner: Arc<Mutex<Ring>>,
}

#[derive(Debug)]
struct Ring {
    lines: VecDeque<String>,
    bytes: usize,
    cap: usize,
    dropped_lines: u64,
    /// Credential values the plugin was given ([`StderrRing::remember_secrets`]).
    secrets: VecDeque<String>,
}

impl StderrRing {
    pub(crate) fn new(cap: usize) -> Self {
        StderrRing {
            inner: Arc::new(Mutex::new(Ring {
                lines: VecDeque::new(),
                bytes: 0,
                cap,
                dropped_lines: 0,
                secrets: VecDeque::new(),
            })),
        }
    }

    /// Credential values the plugin is given (spec §6 HR-SE-05: known credential values are redacted before
    /// stderr is stored): every later line has them replaced. Values shorter than [`MIN_SECRET_LEN`] are not
    /// remembered; past [`MAX_SECRETS`] the oldest is forgotten.
    pub(crate) fn remember_secrets<'a>(&self, values: impl IntoIterator<Item = &'a str>) {
        let Ok(mut ring) = self.inner.lock() else { return };
        for value in values {
            if value.len() < MIN_SECRET_LEN || ring.secrets.iter().any(|s| s == value) {
                continue;
            }
            if ring.secrets.len() == MAX_SECRETS {
                ring.secrets.pop_front();
            }
            ring.secrets.push_back(value.to_owned());
        }
    }

    pub(crate) fn push(&self, line: &[u8]) {
        let mut text = redact(&String::from_utf8_lossy(line));
        let Ok(mut ring) = self.inner.lock() else { return };
        for secret in &ring.secrets {
            if text.contains(secret.as_str()) {
                text = text.replace(secret.as_str(), REDACTED_CREDENTIAL);
            }
        }
        ring.bytes += text.len();
        ring.lines.push_back(text);
        while ring.bytes > ring.cap {
            match ring.lines.pop_front() {
                Some(old) => {
                    ring.bytes -= old.len();
                    ring.dropped_lines += 1;
                }
                None => break,
            }
        }
    }

    /// The lines kept, oldest first.
    pub(crate) fn lines(&self) -> Vec<String> {
        self.inner
            .lock()
            .map(|r| r.lines.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// The last `n` lines joined, for error messages.
    pub(crate) fn tail(&self, n: usize) -> String {
        let lines = self.lines();
        let start = lines.len().saturating_sub(n);
        lines[start..].join("\n")
    }

    /// Drains `stderr` into the ring until EOF.
    pub(crate) async fn drain<R: AsyncRead + Unpin>(self, mut stderr: R) {
        let mut buf = vec![0u8; 8192];
        let mut line: Vec<u8> = Vec::new();
        let mut truncated = false;
        loop {
            let n = match stderr.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            for &b in &buf[..n] {
                if b == b'\n' {
                    if truncated {
                        line.extend_from_slice(" …[truncated]".as_bytes());
                    }
                    self.push(&line);
                    line.clear();
                    truncated = false;
                } else if line.len() < MAX_LINE {
                    line.push(b);
                } else {
                    truncated = true;
                }
            }
        }
        if !line.is_empty() {
            self.push(&line);
        }
    }
}

/// Plugin-written text made fit for a log line: JWTs redacted, cut at the longest stderr line kept (on a
/// character boundary) and marked as the ring marks a cut line.
pub(crate) fn for_log(text: &str) -> String {
    let mut end = text.len().min(MAX_LINE);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let mut out = redact(&text[..end]);
    if end < text.len() {
        out.push_str(" …[truncated]");
    }
    out
}

/// Replaces JWT-looking words (`eyJ…` with two dots) by `<redacted-jwt>`: plugins are told never to log tokens,
/// and this keeps a careless one from leaking them into traces (spec §6 HR-SE-05).
pub(crate) fn redact(text: &str) -> String {
    if !text.contains("eyJ") {
        return text.to_string();
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("eyJ") {
        out.push_str(&rest[..i]);
        let word_len = rest[i..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.'))
            .unwrap_or(rest.len() - i);
        let word = &rest[i..i + word_len];
        if word.matches('.').count() >= 2 {
            out.push_str("<redacted-jwt>");
        } else {
            out.push_str(word);
        }
        rest = &rest[i + word_len..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::{StderrRing, for_log, redact};

    #[test]
    fn jwts_are_redacted_and_other_text_kept() {
        assert_eq!(
            redact("token=eyJhbGc.eyJzdWIi.sig1 ok"),
            "token=<redacted-jwt> ok"
        );
        assert_eq!(redact("eyJ alone and a.b"), "eyJ alone and a.b");
        assert_eq!(redact("plain"), "plain");
    }

    #[test]
    fn log_text_is_redacted_and_cut_on_a_character_boundary() {
        assert_eq!(for_log("{\"t\":\"eyJa.eyJb.c\"}"), "{\"t\":\"<redacted-jwt>\"}");
        let long = format!("x{}", "é".repeat(3000));
        let cut = for_log(&long);
        let kept = cut.strip_suffix(" …[truncated]").unwrap();
        assert!(kept.len() <= 4096 && kept.len() > 4090, "{}", kept.len());
        assert!(long.starts_with(kept));
    }

    #[test]
    fn remembered_credential_values_are_redacted() {
        let ring = StderrRing::new(1 << 20);
        ring.remember_secrets(["sk-live-0123456789", "eu-1", "sk-live-0123456789"]);
        ring.push(b"key sk-live-0123456789 twice sk-live-0123456789, region eu-1");
        assert_eq!(
            ring.lines(),
            ["key <redacted-credential> twice <redacted-credential>, region eu-1"]
        );
        // At its length bound: remembered; one shorter: not.
        ring.remember_secrets(["12345678", "1234567"]);
        ring.push(b"12345678 1234567");
        assert_eq!(ring.tail(1), "<redacted-credential> 1234567");
        // The newest MAX_SECRETS are kept.
        let many: Vec<String> = (0..=super::MAX_SECRETS)
            .map(|i| format!("secret-value-{i:03}"))
            .collect();
        ring.remember_secrets(many.iter().map(String::as_str));
        ring.push(b"secret-value-000 secret-value-032");
        assert_eq!(ring.tail(1), "secret-value-000 <redacted-credential>");
    }

    #[test]
    fn ring_is_bounded_in_bytes() {
        let ring = StderrRing::new(10);
        for l in ["aaaa", "bbbb", "cccc"] {
            ring.push(l.as_bytes());
        }
        assert_eq!(ring.lines(), ["bbbb", "cccc"]);
        assert_eq!(ring.tail(1), "cccc");
    }

    #[tokio::test]
    async fn long_lines_are_truncated() {
        let ring = StderrRing::new(1 << 20);
        let mut input = vec![b'x'; 10_000];
        input.extend_from_slice(b"\nshort\n");
        ring.clone().drain(&input[..]).await;
        let lines = ring.lines();
        assert_eq!(lines.len(), 2);
        assert!(lines[0].starts_with(&"x".repeat(4096)) && lines[0].ends_with("…[truncated]"));
        assert_eq!(lines[1], "short");
    }
}
