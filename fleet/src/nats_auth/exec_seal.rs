//! Exec seals: the front signs every exec request and cancel command it sends to a worker, and a worker serves
//! only what carries a valid, fresh, unseen seal.
//!
//! NATS permissions already keep every credential but the front's off the worker subjects
//! ([`super::permissions`]). The seal closes what they cannot: a credential with wider publish rights (one an
//! operator configures by hand, a break-glass user, a bus left open by `natsAuth.insecureOpenBus`) still cannot
//! inject work or cancel another user's call, because it does not hold the front's signing key.
//!
//! * **Key.** One Ed25519 nkey (server type, `SN…` seed) in `<auth dir>/exec.seed` (0600, created once, never
//!   regenerated), its public key in `<auth dir>/exec.pub`. Fronts hold the seed (`--exec-signing-key`,
//!   default: `exec.seed` of `--nats-auth-dir`, else beside `--nats-creds`); workers hold only public keys
//!   (`--exec-verify-key`, default: `exec.pub` beside `--nats-creds`), one per line, so a key can be rotated:
//!   add the new public key to the workers, roll them, switch the fronts' seed, drop the old line.
//! * **Seal.** Headers [`SEAL_STAMP_HEADER`] = `<issued Unix ms>.<128-bit nonce, hex>` and
//!   [`SEAL_SIGNATURE_HEADER`] = the signature over [`seal_input`]`(subject, stamp, body)`: bound to the one
//!   worker subject, the exact body, and a time.
//! * **Check** (in this order, so unauthenticated bytes never reach the replay set): both headers present
//!   ([`SealError::Unsigned`]), well formed ([`SealError::Malformed`]), the signature verifies with one of the
//!   keys ([`SealError::BadSignature`]), the stamp is within [`MAX_SKEW`] of the worker's clock
//!   ([`SealError::Stale`]), and its nonce was not accepted before ([`SealError::Replayed`]): nonces are kept
//!   for at least `2 × MAX_SKEW`, longer than any stamp is accepted.

use std::collections::HashSet;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use fleet_proto::api::worker::{SEAL_SIGNATURE_HEADER, SEAL_STAMP_HEADER, seal_input};
use nkeys::{KeyPair, KeyPairType};

use super::NatsAuthError;
use super::creds::{create_private_exclusive, ensure_private_file, write_private_atomic};
use fleet_proto::util::now_ms;

/// The signing seed, under the auth directory (fronts only).
pub const EXEC_SEED_FILE: &str = "exec.seed";
/// The public keys that verify seals, under the auth directory (what workers get).
pub const EXEC_PUB_FILE: &str = "exec.pub";
/// How far a seal's stamp may be from the verifying worker's clock, either way.
pub const MAX_SKEW: Duration = Duration::from_secs(30);

/// Why a signing or verifying key could not be loaded. Never carries a seed.
#[derive(Debug, thiserror::Error)]
pub enum SealKeyError {
    /// The file could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The file does not hold one server nkey seed (`SN…`); its content is not quoted.
    #[error("{}: not an exec signing seed (one nkey server seed, `fleet nats-auth init` writes it)", path.display())]
    NotASeed {
        /// The file.
        path: PathBuf,
    },
    /// A line is not a server nkey public key (`N…`).
    #[error("{}: line {line} is not an exec public key (an nkey server public key)", path.display())]
    NotAPublicKey {
        /// The file.
        path: PathBuf,
        /// The 1-based line.
        line: usize,
    },
    /// The file holds no key.
    #[error("{}: holds no exec public key", path.display())]
    Empty {
        /// The file.
        path: PathBuf,
    },
    /// No key file was given and none is where the defaults look.
    #[error(
        "no exec {what}: pass {flag} FILE (`{file}` of `fleet nats-auth init` or of `fleet up`'s <data-dir>/nats){}",
        looked_in(looked)
    )]
    Missing {
        /// `signing key` or `verifying key`.
        what: &'static str,
        /// The flag that names it.
        flag: &'static str,
        /// `exec.seed` or `exec.pub`.
        file: &'static str,
        /// Where the defaults looked.
        looked: Vec<PathBuf>,
    },
}

fn looked_in(paths: &[PathBuf]) -> String {
    if paths.is_empty() {
        return String::new();
    }
    let list: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    format!("; not found at {}", list.join(", "))
}

/// Where a key file is: `explicit`, else `file` in `auth_dir`, else `file` beside the credentials `creds`.
fn locate(
    explicit: Option<&Path>,
    auth_dir: Option<&Path>,
    creds: Option<&Path>,
    file: &'static str,
) -> Result<PathBuf, Vec<PathBuf>> {
    if let Some(p) = explicit {
        return Ok(p.to_path_buf());
    }
    let candidates: Vec<PathBuf> = auth_dir
        .map(|d| d.join(file))
        .into_iter()
        .chain(creds.and_then(Path::parent).map(|d| d.join(file)))
        .collect();
    candidates.iter().find(|p| p.exists()).cloned().ok_or(candidates)
}

/// Why a message's seal was refused. The variants are the `reason` label of
/// `cloud_agents_exec_seal_refusals`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    /// No seal headers.
    #[error("the message carries no exec seal")]
    Unsigned,
    /// The headers do not parse.
    #[error("the exec seal is malformed")]
    Malformed,
    /// The signature does not verify with any configured key.
    #[error("the exec seal's signature does not verify")]
    BadSignature,
    /// The stamp is more than [`MAX_SKEW`] away from now.
    #[error("the exec seal is not fresh")]
    Stale,
    /// The nonce was accepted before.
    #[error("the exec seal was already used")]
    Replayed,
}

impl SealError {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            SealError::Unsigned => "unsigned",
            SealError::Malformed => "malformed",
            SealError::BadSignature => "bad_signature",
            SealError::Stale => "stale",
            SealError::Replayed => "replayed",
        }
    }
}

fn io_error(path: &Path, source: io::Error) -> SealKeyError {
    SealKeyError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Creates `exec.seed` (once, exclusively) and keeps `exec.pub` holding its public key, in the auth directory
/// `dir` (which exists, 0700).
pub(crate) fn ensure_keys(dir: &Path) -> Result<(), NatsAuthError> {
    let seed_path = dir.join(EXEC_SEED_FILE);
    if !seed_path.exists() {
        let fresh = KeyPair::new_server().seed().map_err(|e| NatsAuthError::Nkey {
            what: "generating the exec signing seed",
            reason: e.to_string(),
        })?;
        // Another process may have created it first: its key is the one kept.
        create_private_exclusive(&seed_path, format!("{fresh}\n").as_bytes())?;
    }
    ensure_private_file(&seed_path)?;
    let signer =
        ExecSigner::from_file(&seed_path).map_err(|_| NatsAuthError::InvalidSeed { key: EXEC_SEED_FILE })?;
    let pub_path = dir.join(EXEC_PUB_FILE);
    let wanted = format!("{}\n", signer.public_key());
    match fs::read_to_string(&pub_path) {
        Ok(text) if text == wanted => ensure_private_file(&pub_path),
        Ok(_) => write_private_atomic(&pub_path, wanted.as_bytes()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => write_private_atomic(&pub_path, wanted.as_bytes()),
        Err(source) => Err(NatsAuthError::Io {
            path: pub_path,
            source,
        }),
    }
}

/// Signs what a front sends to workers. Its `Debug` shows the public key only.
pub struct ExecSigner {
    key: KeyPair,
}

impl std::fmt::Debug for ExecSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecSigner")
            .field("public_key", &self.key.public_key())
            .finish()
    }
}

impl ExecSigner {
    /// Loads the seed file (`exec.seed`).
    pub fn from_file(path: &Path) -> Result<ExecSigner, SealKeyError> {
        let text = fs::read_to_string(path).map_err(|e| io_error(path, e))?;
        match KeyPair::from_seed(text.trim()) {
            Ok(key) if key.key_pair_type() == KeyPairType::Server => Ok(ExecSigner { key }),
            _ => Err(SealKeyError::NotASeed {
                path: path.to_path_buf(),
            }),
        }
    }

    /// A front's key: `--exec-signing-key` (`explicit`), else `exec.seed` in `--nats-auth-dir`, else beside
    /// `--nats-creds`.
    pub fn locate(
        explicit: Option<&Path>,
        auth_dir: Option<&Path>,
        creds: Option<&Path>,
    ) -> Result<ExecSigner, SealKeyError> {
        match locate(explicit, auth_dir, creds, EXEC_SEED_FILE) {
            Ok(path) => ExecSigner::from_file(&path),
            Err(looked) => Err(SealKeyError::Missing {
                what: "signing key",
                flag: "--exec-signing-key",
                file: EXEC_SEED_FILE,
                looked,
            }),
        }
    }

    /// The public key workers verify with (`N…`).
    pub fn public_key(&self) -> String {
        self.key.public_key()
    }

    fn key_for_verifying(&self) -> KeyPair {
        // The public half only: a verifier never holds the seed. Parsing a key's own public key cannot fail; the
        // fallback (a fresh key, which verifies nothing) keeps it fail-closed anyway.
        KeyPair::from_public_key(&self.key.public_key()).unwrap_or_else(|_| KeyPair::new_server())
    }

    /// Adds the seal of `body` sent on `subject` to `headers`.
    pub fn seal(&self, subject: &str, body: &[u8], headers: &mut HeaderMap) {
        let stamp = format!("{}.{:032x}", now_ms(), rand::random::<u128>());
        self.seal_with_stamp(subject, &stamp, body, headers);
    }

    /// [`ExecSigner::seal`] with a given stamp (tests of staleness and replays).
    #[doc(hidden)]
    pub fn seal_with_stamp(&self, subject: &str, stamp: &str, body: &[u8], headers: &mut HeaderMap) {
        // Signing with a seed-backed key cannot fail; a key without its seed is never built here.
        let Ok(sig) = self.key.sign(&seal_input(subject, stamp, body)) else {
            return;
        };
        headers.insert(SEAL_STAMP_HEADER, stamp);
        headers.insert(SEAL_SIGNATURE_HEADER, URL_SAFE_NO_PAD.encode(sig).as_str());
    }
}

/// The nonces accepted recently: two generations, the older dropped when the newer is `2 × MAX_SKEW` old.
#[derive(Debug)]
struct Seen {
    current: HashSet<u128>,
    previous: HashSet<u128>,
    since: Instant,
}

impl Seen {
    /// Records `nonce`; false if it was seen.
    fn first_time(&mut self, nonce: u128) -> bool {
        if self.since.elapsed() >= 2 * MAX_SKEW {
            self.previous = std::mem::take(&mut self.current);
            self.since = Instant::now();
        }
        !self.previous.contains(&nonce) && self.current.insert(nonce)
    }
}

/// Checks the seals of what a worker receives.
#[derive(Debug)]
pub struct ExecVerifier {
    keys: Vec<KeyPair>,
    seen: Mutex<Seen>,
}

impl ExecVerifier {
    /// A worker's keys: `--exec-verify-key` (`explicit`), else `exec.pub` in `auth_dir`, else beside
    /// `--nats-creds`.
    pub fn locate(
        explicit: Option<&Path>,
        auth_dir: Option<&Path>,
        creds: Option<&Path>,
    ) -> Result<ExecVerifier, SealKeyError> {
        match locate(explicit, auth_dir, creds, EXEC_PUB_FILE) {
            Ok(path) => ExecVerifier::from_file(&path),
            Err(looked) => Err(SealKeyError::Missing {
                what: "verifying key",
                flag: "--exec-verify-key",
                file: EXEC_PUB_FILE,
                looked,
            }),
        }
    }

    /// A verifier of `signer`'s seals only (a front and its in-process workers).
    pub fn trusting(signer: &ExecSigner) -> ExecVerifier {
        ExecVerifier::with_keys(vec![signer.key_for_verifying()])
    }

    fn with_keys(keys: Vec<KeyPair>) -> ExecVerifier {
        ExecVerifier {
            keys,
            seen: Mutex::new(Seen {
                current: HashSet::new(),
                previous: HashSet::new(),
                since: Instant::now(),
            }),
        }
    }

    /// Loads `exec.pub`: one public key per line; blank lines and `#` comments are skipped.
    pub fn from_file(path: &Path) -> Result<ExecVerifier, SealKeyError> {
        let text = fs::read_to_string(path).map_err(|e| io_error(path, e))?;
        let mut keys = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            match KeyPair::from_public_key(line) {
                Ok(key) if key.key_pair_type() == KeyPairType::Server => keys.push(key),
                _ => {
                    return Err(SealKeyError::NotAPublicKey {
                        path: path.to_path_buf(),
                        line: i + 1,
                    });
                }
            }
        }
        if keys.is_empty() {
            return Err(SealKeyError::Empty {
                path: path.to_path_buf(),
            });
        }
        Ok(ExecVerifier::with_keys(keys))
    }

    /// Checks the seal of `body` received on `subject`.
    pub fn verify(&self, subject: &str, headers: Option<&HeaderMap>, body: &[u8]) -> Result<(), SealError> {
        let header = |name: &str| headers.and_then(|h| h.get(name)).map(|v| v.as_str().to_owned());
        let (Some(stamp), Some(sig)) = (header(SEAL_STAMP_HEADER), header(SEAL_SIGNATURE_HEADER)) else {
            return Err(SealError::Unsigned);
        };
        let (issued, nonce) = stamp.split_once('.').ok_or(SealError::Malformed)?;
        if nonce.len() != 32 || issued.is_empty() || issued.len() > 20 {
            return Err(SealError::Malformed);
        }
        let issued: u64 = issued.parse().map_err(|_| SealError::Malformed)?;
        let nonce = u128::from_str_radix(nonce, 16).map_err(|_| SealError::Malformed)?;
        let sig = URL_SAFE_NO_PAD
            .decode(sig.as_bytes())
            .map_err(|_| SealError::Malformed)?;
        let input = seal_input(subject, &stamp, body);
        if !self.keys.iter().any(|k| k.verify(&input, &sig).is_ok()) {
            return Err(SealError::BadSignature);
        }
        let skew = u64::try_from(MAX_SKEW.as_millis()).unwrap_or(u64::MAX);
        if now_ms().abs_diff(issued) > skew {
            return Err(SealError::Stale);
        }
        let first = self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .first_time(nonce);
        if first { Ok(()) } else { Err(SealError::Replayed) }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn pair() -> (ExecSigner, ExecVerifier) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
        ensure_keys(dir.path()).unwrap();
        (
            ExecSigner::from_file(&dir.path().join(EXEC_SEED_FILE)).unwrap(),
            ExecVerifier::from_file(&dir.path().join(EXEC_PUB_FILE)).unwrap(),
        )
    }

    fn sealed(signer: &ExecSigner, subject: &str, body: &[u8]) -> HeaderMap {
        let mut h = HeaderMap::new();
        signer.seal(subject, body, &mut h);
        h
    }

    #[test]
    fn a_seal_verifies_once_and_only_for_its_subject_and_body() {
        let (signer, verifier) = pair();
        let h = sealed(&signer, "fleet.v1.worker.w1.exec", b"{}");
        assert_eq!(
            verifier.verify("fleet.v1.worker.w2.exec", Some(&h), b"{}"),
            Err(SealError::BadSignature)
        );
        assert_eq!(
            verifier.verify("fleet.v1.worker.w1.exec", Some(&h), b"{ }"),
            Err(SealError::BadSignature)
        );
        assert_eq!(
            verifier.verify("fleet.v1.worker.w1.exec", Some(&h), b"{}"),
            Ok(())
        );
        assert_eq!(
            verifier.verify("fleet.v1.worker.w1.exec", Some(&h), b"{}"),
            Err(SealError::Replayed)
        );
        assert_eq!(verifier.verify("s", None, b"{}"), Err(SealError::Unsigned));
    }

    #[test]
    fn another_key_and_malformed_headers_are_refused() {
        let (_, verifier) = pair();
        let (other, _) = pair();
        let h = sealed(&other, "s", b"x");
        assert_eq!(verifier.verify("s", Some(&h), b"x"), Err(SealError::BadSignature));
        for stamp in [
            "",
            "123",
            "x.00000000000000000000000000000000",
            "1.zz",
            "1.0123456789abcdef0123456789abcdef0",
        ] {
            let mut bad = h.clone();
            bad.insert(SEAL_STAMP_HEADER, stamp);
            assert_eq!(
                verifier.verify("s", Some(&bad), b"x"),
                Err(SealError::Malformed),
                "{stamp:?}"
            );
        }
        let mut bad = h.clone();
        bad.insert(SEAL_SIGNATURE_HEADER, "not base64!");
        assert_eq!(verifier.verify("s", Some(&bad), b"x"), Err(SealError::Malformed));
    }

    #[test]
    fn the_stamp_is_accepted_within_max_skew_and_not_beyond() {
        let (signer, verifier) = pair();
        let skew = u64::try_from(MAX_SKEW.as_millis()).unwrap();
        // A second inside the window either way: no clock step between sealing and checking reaches it.
        for (issued, want) in [
            (now_ms() - skew + 1_000, Ok(())),
            (now_ms() + skew - 1_000, Ok(())),
            (now_ms() - skew - 1_000, Err(SealError::Stale)),
            (now_ms() + skew + 1_000, Err(SealError::Stale)),
        ] {
            let mut h = HeaderMap::new();
            signer.seal_with_stamp(
                "s",
                &format!("{issued}.{:032x}", rand::random::<u128>()),
                b"x",
                &mut h,
            );
            assert_eq!(verifier.verify("s", Some(&h), b"x"), want, "issued {issued}");
        }
    }

    #[test]
    fn keys_are_created_once_and_rotation_takes_several_public_keys() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
        ensure_keys(dir.path()).unwrap();
        let seed = std::fs::read(dir.path().join(EXEC_SEED_FILE)).unwrap();
        ensure_keys(dir.path()).unwrap();
        assert_eq!(
            std::fs::read(dir.path().join(EXEC_SEED_FILE)).unwrap(),
            seed,
            "never regenerated"
        );
        let old = ExecSigner::from_file(&dir.path().join(EXEC_SEED_FILE)).unwrap();
        let (new, _) = pair();
        let pub_file = dir.path().join("both.pub");
        std::fs::write(
            &pub_file,
            format!("# old\n{}\n\n{}\n", old.public_key(), new.public_key()),
        )
        .unwrap();
        let both = ExecVerifier::from_file(&pub_file).unwrap();
        for s in [&old, &new] {
            let h = sealed(s, "s", b"x");
            assert_eq!(both.verify("s", Some(&h), b"x"), Ok(()));
        }
        std::fs::write(&pub_file, format!("{}\nUABC\n", old.public_key())).unwrap();
        assert!(matches!(
            ExecVerifier::from_file(&pub_file),
            Err(SealKeyError::NotAPublicKey { line: 2, .. })
        ));
        std::fs::write(&pub_file, "# none\n\n").unwrap();
        assert!(matches!(
            ExecVerifier::from_file(&pub_file),
            Err(SealKeyError::Empty { .. })
        ));
        std::fs::write(
            &pub_file,
            "SUACSSL3UAHUDXKFSNVUZRF5UHPMWZ6BFDTJ7M6USDXIEDNPPQYYYCU3VY\n",
        )
        .unwrap();
        assert!(
            ExecSigner::from_file(&pub_file).is_err(),
            "a user seed is not an exec seed"
        );
    }
}
