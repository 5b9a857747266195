//! Step 2 of the pipeline: a package download to `<tmp>/executa-{tool_id}-{rand}`, with progress.
//!
//! Only `http` and `https` URLs. The file is removed when the returned [`TempPackage`] is dropped, so a failed or
//! interrupted download leaves nothing behind and commits nothing; retrying starts afresh.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::AsyncWriteExt as _;

use super::{MAX_PACKAGE_BYTES, PluginError};

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
    progress: &(dyn Fn(u64, Option<u64>) + Send + Sync),
) -> Result<TempPackage, PluginError> {
    let fail = |reason: String| PluginError::Download {
        url: url.to_string(),
        reason,
    };
    let parsed = reqwest::Url::parse(url).map_err(|e| fail(e.to_string()))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(PluginError::BadRequest(format!(
            "unsupported URL scheme {:?}: only http and https",
            parsed.scheme()
        )));
    }
    let client = reqwest::Client::builder()
        .connect_timeout(CONNECT_TIMEOUT)
        .read_timeout(READ_TIMEOUT)
        .build()
        .map_err(|e| fail(e.to_string()))?;
    let mut response = client.get(parsed).send().await.map_err(|e| fail(e.to_string()))?;
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
