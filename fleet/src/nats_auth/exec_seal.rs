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
//! * **Session grants** (the fast path; one Ed25519 signature per front and worker every [`GRANT_ROTATE`]
//!   instead of a signature and a verification per message). Each worker makes an X25519 session key pair at
//!   start and publishes the public half in its registry entry ([`fleet_store::WorkerInfo::seal_key`]); each
//!   front makes one too, again every [`GRANT_ROTATE`]. To seal for a worker whose entry carries a key, a front
//!   derives the key it shares with that worker (X25519, then HKDF-SHA256) and signs once, with its exec key, a
//!   *grant* naming both public keys and an expiry ([`GRANT_TTL`] ahead): header [`SEAL_GRANT_HEADER`]. Every
//!   message then carries the grant, the stamp, and [`SEAL_MAC_HEADER`] = HMAC-SHA256 of [`seal_input`] under
//!   the shared key. The worker verifies a grant's signature the first time it sees it (with the same public
//!   keys), that it names the worker's own session key ([`SealError::BadGrant`] otherwise) and has not expired
//!   ([`SealError::Stale`]; checked again at every use), keeps the derived key (at most [`GRANT_CACHE_MAX`]
//!   grants), then checks the MAC, the stamp and the nonce as above. What this keeps: only a holder of the
//!   signing seed can make a grant, and a grant is good for one worker only, so a worker (which holds only
//!   public keys and its own session secret) still cannot seal anything another worker accepts, and a
//!   credential that can publish on worker subjects still cannot seal at all. A worker entry without a key (a
//!   worker of an earlier release) gets the Ed25519 seal, which every worker still accepts.
//! * **Restarts.** A worker refuses every stamp issued before its verifier was made ([`SealError::Stale`]): its
//!   nonce set lives in memory, so without this a message sealed in the 30 s before a restart could be replayed
//!   to it once after.
//! * **Job seals.** A job does not travel in an exec request only: its record waits in KV (`fleet_jobs`) and its
//!   id on the job queue, both of which the worker credential may write. So a front also seals each job record
//!   at creation ([`ExecSigner::seal_job`]: the exec key's Ed25519 signature over
//!   [`job_seal_input`](fleet_proto::api::worker::job_seal_input) of the user, tool id, plugin, method, the
//!   arguments' SHA-256, job id, deadline and timeout, in `JobRecord::seal`), and a worker
//!   ([`ExecVerifier::verify_job`]) and a sweeper ([`ExecSigner::verify_job`]) start or dispatch a queued job
//!   only when its seal verifies ([`JobSealError`] otherwise). A job seal carries no nonce: the record is the
//!   job, and a job runs at most once per `queued → running` compare-and-set; what a writer of the bucket can
//!   still do with a genuine record is put it back to `queued` before its sealed deadline (documented in
//!   ARCHITECTURE.md, "The gap NATS cannot close").

use std::collections::{HashMap, HashSet};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use curve25519_dalek::montgomery::MontgomeryPoint;
use fleet_proto::api::worker::{
    JobSealed, SEAL_GRANT_HEADER, SEAL_MAC_HEADER, SEAL_SIGNATURE_HEADER, SEAL_STAMP_HEADER, grant_input,
    job_seal_input, seal_input,
};
use fleet_proto::util::lock;
use fleet_store::JobRecord;
use nkeys::{KeyPair, KeyPairType};
use ring::rand::{SecureRandom as _, SystemRandom};
use ring::{hkdf, hmac};
use zeroize::Zeroizing;

use super::NatsAuthError;
use super::creds::{create_private_exclusive, ensure_private_file, write_private_atomic};
use fleet_proto::util::now_ms;

/// The signing seed, under the auth directory (fronts only).
pub const EXEC_SEED_FILE: &str = "exec.seed";
/// A worker's session secret, under its state directory (0600): a worker restarted with the same id and state
/// directory keeps its session key, so the grants fronts made for it stay good across the restart.
pub const EXEC_SESSION_FILE: &str = "exec-session.key";
/// The public keys that verify seals, under the auth directory (what workers get).
pub const EXEC_PUB_FILE: &str = "exec.pub";
/// How far a seal's stamp may be from the verifying worker's clock, either way.
pub const MAX_SKEW: Duration = Duration::from_secs(30);
/// How long a session grant is good for after its front made its session key.
pub const GRANT_TTL: Duration = Duration::from_secs(3600);
/// How old a front's session key gets before the front makes a new one (and new grants): half of
/// [`GRANT_TTL`], so every grant still in use has at least that long to live.
pub const GRANT_ROTATE: Duration = Duration::from_secs(1800);
/// Verified grants a worker keeps (each front's current one and the one before: far fewer in any fleet); beyond
/// it the expired ones are dropped, then all.
pub const GRANT_CACHE_MAX: usize = 256;
/// Grants a front keeps (one per worker it sealed for with its current session key); beyond it all are dropped
/// and made again as needed.
const FRONT_GRANTS_MAX: usize = 4096;
/// The HKDF salt of a grant's shared key.
const GRANT_KDF_SALT: &[u8] = b"fleet-exec-grant-v1";

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
    /// The file does not hold one session secret (32 bytes, base64url); its content is not quoted.
    #[error("{}: not an exec session secret (delete it: the worker makes a new one)", path.display())]
    NotASessionSecret {
        /// The file.
        path: PathBuf,
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
    /// The session grant's signature does not verify with any configured key, it names another worker's
    /// session key, its front key is unusable, or it claims a longer life than any front gives.
    #[error("the exec seal's session grant is not valid for this worker")]
    BadGrant,
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
            SealError::BadGrant => "bad_grant",
        }
    }
}

/// Why a job record's seal was refused. The variants are the `reason` label of
/// `cloud_agents_job_seal_rejected_total`. Never carries anything of the record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum JobSealError {
    /// The record has no seal: not made by a front, or made before job seals existed.
    #[error("the job record carries no front's seal")]
    Unsealed,
    /// The seal is not base64url.
    #[error("the job record's seal is malformed")]
    Malformed,
    /// The seal does not verify with any configured key over what the record says now: forged, or sealed for
    /// other content (another user, tool, arguments, id or deadline).
    #[error("the job record's seal does not verify")]
    BadSignature,
}

impl JobSealError {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            JobSealError::Unsealed => "unsealed",
            JobSealError::Malformed => "malformed",
            JobSealError::BadSignature => "bad_signature",
        }
    }
}

/// SHA-256 of the arguments' JSON as the record holds them (the same bytes wherever the record is read: a JSON
/// map serializes the same after a round trip).
fn args_sha256(args: &serde_json::Map<String, serde_json::Value>) -> [u8; 32] {
    let json = serde_json::to_vec(args).unwrap_or_default();
    let digest = ring::digest::digest(&ring::digest::SHA256, &json);
    let mut out = [0u8; 32];
    out.copy_from_slice(digest.as_ref());
    out
}

/// What a job's seal is made over: the record's sealed content. The fleet has no tenants yet: the tenant slot is
/// empty.
fn job_input(record: &JobRecord) -> Vec<u8> {
    let args = args_sha256(&record.args);
    job_seal_input(&JobSealed {
        user: &record.user,
        tenant: "",
        tool_id: &record.tool_id,
        plugin: &record.plugin,
        tool: &record.tool,
        args_sha256: &args,
        job_id: record.job_id.as_str(),
        deadline_ms: record.deadline_ms,
        timeout_ms: record.timeout_ms,
    })
}

/// Whether `record`'s seal verifies with one of `keys`.
fn verify_job_with(keys: &[KeyPair], record: &JobRecord) -> Result<(), JobSealError> {
    let seal = record.seal.as_deref().ok_or(JobSealError::Unsealed)?;
    let sig = URL_SAFE_NO_PAD
        .decode(seal.as_bytes())
        .map_err(|_| JobSealError::Malformed)?;
    let input = job_input(record);
    if keys.iter().any(|k| k.verify(&input, &sig).is_ok()) {
        Ok(())
    } else {
        Err(JobSealError::BadSignature)
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

/// An X25519 key pair for session grants; the secret is zeroed when dropped and never leaves this module.
struct SessionPair {
    secret: Zeroizing<[u8; 32]>,
    /// The public key, base64url without padding (as it travels in registry entries and grants).
    public: String,
}

impl SessionPair {
    fn generate() -> SessionPair {
        let mut secret = Zeroizing::new([0u8; 32]);
        if SystemRandom::new().fill(&mut secret[..]).is_err() {
            // The OS random source failed (it does not, once the process runs): fall back to the thread RNG
            // (a CSPRNG seeded from the OS) rather than an all-zero secret.
            *secret = rand::random();
        }
        SessionPair::from_secret(secret)
    }

    fn from_secret(secret: Zeroizing<[u8; 32]>) -> SessionPair {
        let public = MontgomeryPoint::mul_base_clamped(*secret).to_bytes();
        SessionPair {
            secret,
            public: URL_SAFE_NO_PAD.encode(public),
        }
    }

    /// The pair whose secret `path` holds, the file made first (0600, exclusively: two processes agree on one)
    /// with a new secret when there is none.
    fn kept_in(path: &Path) -> Result<SessionPair, SealKeyError> {
        let file_error = |e: NatsAuthError| io_error(path, io::Error::other(e.to_string()));
        if !path.exists() {
            if let Some(dir) = path.parent() {
                fs::create_dir_all(dir).map_err(|e| io_error(dir, e))?;
            }
            let fresh = SessionPair::generate();
            let text = Zeroizing::new(format!("{}\n", URL_SAFE_NO_PAD.encode(*fresh.secret)));
            create_private_exclusive(path, text.as_bytes()).map_err(file_error)?;
        }
        ensure_private_file(path).map_err(file_error)?;
        let text = Zeroizing::new(fs::read_to_string(path).map_err(|e| io_error(path, e))?);
        let bytes = Zeroizing::new(URL_SAFE_NO_PAD.decode(text.trim()).unwrap_or_default());
        let secret: [u8; 32] = bytes
            .as_slice()
            .try_into()
            .map_err(|_| SealKeyError::NotASessionSecret {
                path: path.to_path_buf(),
            })?;
        Ok(SessionPair::from_secret(Zeroizing::new(secret)))
    }

    /// The HMAC key this pair shares with the holder of `peer` (base64url) for the grant between `front` and
    /// `worker` (both public keys, base64url); `None` for a peer key that is not 32 bytes or is of low order
    /// (its shared secret would be all zeros).
    fn shared(&self, peer: &str, front: &str, worker: &str) -> Option<hmac::Key> {
        let peer: [u8; 32] = URL_SAFE_NO_PAD.decode(peer).ok()?.try_into().ok()?;
        let dh = Zeroizing::new(MontgomeryPoint(peer).mul_clamped(*self.secret).to_bytes());
        if dh.iter().all(|b| *b == 0) {
            return None;
        }
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, GRANT_KDF_SALT).extract(&dh[..]);
        let info = [front.as_bytes(), b".", worker.as_bytes()];
        let okm = prk.expand(&info, hmac::HMAC_SHA256).ok()?;
        Some(hmac::Key::from(okm))
    }
}

/// A grant a front made for one worker: its header and the key it establishes.
struct Grant {
    header: String,
    key: hmac::Key,
}

/// A front's session key and the grants made with it.
struct FrontSessions {
    pair: SessionPair,
    made: Instant,
    /// The expiry of every grant made with `pair` (Unix ms).
    expires_ms: u64,
    /// By worker session key.
    grants: HashMap<String, Arc<Grant>>,
}

impl FrontSessions {
    fn new() -> FrontSessions {
        FrontSessions {
            pair: SessionPair::generate(),
            made: Instant::now(),
            expires_ms: now_ms().saturating_add(u64::try_from(GRANT_TTL.as_millis()).unwrap_or(u64::MAX)),
            grants: HashMap::new(),
        }
    }
}

/// A fresh stamp: now and a random 128-bit nonce.
fn new_stamp() -> String {
    format!("{}.{:032x}", now_ms(), rand::random::<u128>())
}

/// Signs what a front sends to workers. Its `Debug` shows the public key only.
pub struct ExecSigner {
    key: KeyPair,
    sessions: Mutex<FrontSessions>,
    /// The public keys a job's seal may verify with: this front's own, and those of
    /// [`ExecSigner::also_verifying_jobs_with`] (a key rotation: jobs other fronts sealed with the old key).
    job_keys: Vec<KeyPair>,
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
            Ok(key) if key.key_pair_type() == KeyPairType::Server => {
                let own = public_half(&key);
                Ok(ExecSigner {
                    key,
                    sessions: Mutex::new(FrontSessions::new()),
                    job_keys: vec![own],
                })
            }
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
        public_half(&self.key)
    }

    /// Also accepts job seals made with the keys `verifier` trusts (the workers' `exec.pub`): during a rotation of
    /// the exec key, jobs the fronts still on the old key sealed are dispatched by the sweepers of those on the
    /// new one.
    pub fn also_verifying_jobs_with(mut self, verifier: &ExecVerifier) -> ExecSigner {
        for key in &verifier.keys {
            if !self.job_keys.iter().any(|k| k.public_key() == key.public_key()) {
                self.job_keys.push(public_half(key));
            }
        }
        self
    }

    /// The seal of `record` as it is now (its sealed content: see [`JobSealed`]), for `JobRecord::seal`.
    pub fn seal_job(&self, record: &JobRecord) -> String {
        // Signing with a seed-backed key cannot fail; an empty seal (never built here) verifies nothing.
        self.key
            .sign(&job_input(record))
            .map(|sig| URL_SAFE_NO_PAD.encode(sig))
            .unwrap_or_default()
    }

    /// Whether `record`'s seal verifies (a sweeper, before it dispatches a queued job).
    pub fn verify_job(&self, record: &JobRecord) -> Result<(), JobSealError> {
        verify_job_with(&self.job_keys, record)
    }

    /// Adds the Ed25519 seal of `body` sent on `subject` to `headers` (what any worker accepts).
    pub fn seal(&self, subject: &str, body: &[u8], headers: &mut HeaderMap) {
        self.seal_with_stamp(subject, &new_stamp(), body, headers);
    }

    /// Adds the seal of `body` sent on `subject` to the worker whose registry entry gives `worker_key` (its
    /// session public key): a session grant and a MAC, or the Ed25519 seal when there is no key or it is not
    /// usable.
    pub fn seal_for(&self, worker_key: Option<&str>, subject: &str, body: &[u8], headers: &mut HeaderMap) {
        let stamp = new_stamp();
        match worker_key.and_then(|w| self.grant(w)) {
            Some(grant) => {
                let mac = hmac::sign(&grant.key, &seal_input(subject, &stamp, body));
                headers.insert(SEAL_STAMP_HEADER, stamp.as_str());
                headers.insert(SEAL_GRANT_HEADER, grant.header.as_str());
                headers.insert(SEAL_MAC_HEADER, URL_SAFE_NO_PAD.encode(mac.as_ref()).as_str());
            }
            None => self.seal_with_stamp(subject, &stamp, body, headers),
        }
    }

    /// The grant for the worker with session key `worker_key`, made (one X25519 and one signature) the first
    /// time; the session key is made again once it is [`GRANT_ROTATE`] old.
    fn grant(&self, worker_key: &str) -> Option<Arc<Grant>> {
        let mut sessions = lock(&self.sessions);
        if sessions.made.elapsed() >= GRANT_ROTATE {
            *sessions = FrontSessions::new();
        }
        if let Some(grant) = sessions.grants.get(worker_key) {
            return Some(grant.clone());
        }
        let front = sessions.pair.public.clone();
        let key = sessions.pair.shared(worker_key, &front, worker_key)?;
        let expires = sessions.expires_ms;
        let sig = self.key.sign(&grant_input(worker_key, &front, expires)).ok()?;
        let grant = Arc::new(Grant {
            header: format!("{expires}.{front}.{}", URL_SAFE_NO_PAD.encode(sig)),
            key,
        });
        if sessions.grants.len() >= FRONT_GRANTS_MAX {
            sessions.grants.clear();
        }
        sessions.grants.insert(worker_key.to_owned(), grant.clone());
        Some(grant)
    }

    /// Makes the session key again now, as [`GRANT_ROTATE`] does (tests of rotation).
    #[doc(hidden)]
    pub fn rotate_session(&self) {
        *lock(&self.sessions) = FrontSessions::new();
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

/// The public half of `key`: a verifier never holds a seed. Parsing a key's own public key cannot fail; the
/// fallback (a fresh key, which verifies nothing) keeps it fail-closed anyway.
fn public_half(key: &KeyPair) -> KeyPair {
    KeyPair::from_public_key(&key.public_key()).unwrap_or_else(|_| KeyPair::new_server())
}

/// Hashes a nonce by folding its two halves: nonces are random, and only sealed messages (whose seal verified)
/// reach the set, so no sender can choose colliding ones; SipHash's flood resistance would only cost time on
/// every message.
#[derive(Debug, Default, Clone, Copy)]
struct NonceHasher(u64);

impl std::hash::Hasher for NonceHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.0 = self.0.rotate_left(29) ^ u64::from_le_bytes(word);
        }
    }

    #[allow(clippy::cast_possible_truncation)]
    fn write_u128(&mut self, n: u128) {
        // Truncation is the point: the low half folded with the high half.
        self.0 ^= (n as u64) ^ ((n >> 64) as u64);
    }
}

type NonceSet = HashSet<u128, std::hash::BuildHasherDefault<NonceHasher>>;

/// The nonces accepted recently: two generations, the older dropped when the newer is `2 × MAX_SKEW` old.
#[derive(Debug)]
struct Seen {
    current: NonceSet,
    previous: NonceSet,
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
pub struct ExecVerifier {
    keys: Vec<KeyPair>,
    seen: Mutex<Seen>,
    session: SessionPair,
    /// Verified grants (header → shared key, expiry in Unix ms).
    grants: Mutex<HashMap<String, (Arc<hmac::Key>, u64)>>,
    /// When this verifier was made (Unix ms): stamps issued before are refused, since the nonces seen before
    /// (by this process's previous run) are not known.
    not_before_ms: u64,
}

impl std::fmt::Debug for ExecVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecVerifier")
            .field("keys", &self.keys.len())
            .field("session_key", &self.session.public)
            .finish_non_exhaustive()
    }
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
                current: NonceSet::default(),
                previous: NonceSet::default(),
                since: Instant::now(),
            }),
            session: SessionPair::generate(),
            grants: Mutex::new(HashMap::new()),
            not_before_ms: now_ms(),
        }
    }

    /// Whether `record`'s seal verifies (a worker, before it starts a queued job).
    pub fn verify_job(&self, record: &JobRecord) -> Result<(), JobSealError> {
        verify_job_with(&self.keys, record)
    }

    /// Accepts stamps from `ms` on instead of from its making (tests of the freshness window).
    #[cfg(test)]
    fn accepting_from(mut self, ms: u64) -> ExecVerifier {
        self.not_before_ms = ms;
        self
    }

    /// Keeps this worker's session secret in `path` (a worker's `<state dir>/`[`EXEC_SESSION_FILE`]): the
    /// secret there when there is one, else a new one written there. Without it a worker makes a new session key
    /// at every start, and a restart under the same id refuses (`bad_grant`) what fronts sealed for the previous
    /// key until they see its new registry entry.
    pub fn keep_session_in(mut self, path: &Path) -> Result<ExecVerifier, SealKeyError> {
        self.session = SessionPair::kept_in(path)?;
        lock(&self.grants).clear();
        Ok(self)
    }

    /// This worker's session public key (base64url), for its registry entry.
    pub fn session_key(&self) -> &str {
        &self.session.public
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

    /// Checks the seal of `body` received on `subject`: a session grant and its MAC, or an Ed25519 signature.
    pub fn verify(&self, subject: &str, headers: Option<&HeaderMap>, body: &[u8]) -> Result<(), SealError> {
        let header = |name: &str| headers.and_then(|h| h.get(name)).map(|v| v.as_str().to_owned());
        let Some(stamp) = header(SEAL_STAMP_HEADER) else {
            return Err(SealError::Unsigned);
        };
        if let Some(mac) = header(SEAL_MAC_HEADER) {
            let grant = header(SEAL_GRANT_HEADER).ok_or(SealError::Malformed)?;
            let (issued, nonce) = parse_stamp(&stamp)?;
            let mac = URL_SAFE_NO_PAD
                .decode(mac.as_bytes())
                .map_err(|_| SealError::Malformed)?;
            let key = self.granted_key(&grant)?;
            hmac::verify(&key, &seal_input(subject, &stamp, body), &mac)
                .map_err(|_| SealError::BadSignature)?;
            return self.fresh_and_first(issued, nonce);
        }
        let Some(sig) = header(SEAL_SIGNATURE_HEADER) else {
            return Err(SealError::Unsigned);
        };
        let (issued, nonce) = parse_stamp(&stamp)?;
        let sig = URL_SAFE_NO_PAD
            .decode(sig.as_bytes())
            .map_err(|_| SealError::Malformed)?;
        let input = seal_input(subject, &stamp, body);
        if !self.keys.iter().any(|k| k.verify(&input, &sig).is_ok()) {
            return Err(SealError::BadSignature);
        }
        self.fresh_and_first(issued, nonce)
    }

    /// The key of `grant`: from the verified grants, else verified now (its signature, this worker's session key,
    /// its expiry) and kept.
    fn granted_key(&self, grant: &str) -> Result<Arc<hmac::Key>, SealError> {
        let now = now_ms();
        if let Some((key, expires)) = lock(&self.grants).get(grant) {
            return if now > *expires {
                Err(SealError::Stale)
            } else {
                Ok(key.clone())
            };
        }
        let mut parts = grant.splitn(3, '.');
        let (Some(expires), Some(front), Some(sig)) = (parts.next(), parts.next(), parts.next()) else {
            return Err(SealError::Malformed);
        };
        if expires.is_empty() || expires.len() > 20 {
            return Err(SealError::Malformed);
        }
        let expires_ms: u64 = expires.parse().map_err(|_| SealError::Malformed)?;
        let sig = URL_SAFE_NO_PAD
            .decode(sig.as_bytes())
            .map_err(|_| SealError::Malformed)?;
        let input = grant_input(&self.session.public, front, expires_ms);
        if !self.keys.iter().any(|k| k.verify(&input, &sig).is_ok()) {
            return Err(SealError::BadGrant);
        }
        let longest = u64::try_from((GRANT_TTL + MAX_SKEW).as_millis()).unwrap_or(u64::MAX);
        if expires_ms > now.saturating_add(longest) {
            return Err(SealError::BadGrant);
        }
        if now > expires_ms {
            return Err(SealError::Stale);
        }
        let key = Arc::new(
            self.session
                .shared(front, front, &self.session.public)
                .ok_or(SealError::BadGrant)?,
        );
        let mut grants = lock(&self.grants);
        if grants.len() >= GRANT_CACHE_MAX {
            grants.retain(|_, (_, expires)| now <= *expires);
            if grants.len() >= GRANT_CACHE_MAX {
                grants.clear();
            }
        }
        grants.insert(grant.to_owned(), (key.clone(), expires_ms));
        Ok(key)
    }

    /// The stamp's freshness (within [`MAX_SKEW`], and not before this verifier was made), then its nonce seen
    /// once (only after the seal verified, so unauthenticated bytes never reach the replay set).
    fn fresh_and_first(&self, issued: u64, nonce: u128) -> Result<(), SealError> {
        let skew = u64::try_from(MAX_SKEW.as_millis()).unwrap_or(u64::MAX);
        if now_ms().abs_diff(issued) > skew || issued < self.not_before_ms {
            return Err(SealError::Stale);
        }
        if lock(&self.seen).first_time(nonce) {
            Ok(())
        } else {
            Err(SealError::Replayed)
        }
    }
}

/// `<issued Unix ms>.<32 hex digits>` → (issued, nonce).
fn parse_stamp(stamp: &str) -> Result<(u64, u128), SealError> {
    let (issued, nonce) = stamp.split_once('.').ok_or(SealError::Malformed)?;
    if nonce.len() != 32 || issued.is_empty() || issued.len() > 20 {
        return Err(SealError::Malformed);
    }
    let issued: u64 = issued.parse().map_err(|_| SealError::Malformed)?;
    let nonce = u128::from_str_radix(nonce, 16).map_err(|_| SealError::Malformed)?;
    Ok((issued, nonce))
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

    /// `b"x"` on subject `s`, signed with a stamp issued at `issued` (Unix ms) and a random nonce.
    fn stamped(signer: &ExecSigner, issued: u64) -> HeaderMap {
        let mut h = HeaderMap::new();
        let stamp = format!("{issued}.{:032x}", rand::random::<u128>());
        signer.seal_with_stamp("s", &stamp, b"x", &mut h);
        h
    }

    #[test]
    fn the_stamp_is_accepted_within_max_skew_and_not_beyond() {
        let (signer, verifier) = pair();
        // A verifier running for longer than the window (one made now refuses every earlier stamp).
        let verifier = verifier.accepting_from(0);
        let skew = u64::try_from(MAX_SKEW.as_millis()).unwrap();
        // A second inside the window either way: no clock step between sealing and checking reaches it.
        for (issued, want) in [
            (now_ms() - skew + 1_000, Ok(())),
            (now_ms() + skew - 1_000, Ok(())),
            (now_ms() - skew - 1_000, Err(SealError::Stale)),
            (now_ms() + skew + 1_000, Err(SealError::Stale)),
        ] {
            let h = stamped(&signer, issued);
            assert_eq!(verifier.verify("s", Some(&h), b"x"), want, "issued {issued}");
        }
    }

    /// A grant as a front makes it, by hand: signed by `signer`'s exec key for `worker_key`, with front key
    /// `front` (base64url) and expiry `expires_ms`.
    fn grant_header(signer: &ExecSigner, worker_key: &str, front: &str, expires_ms: u64) -> String {
        let sig = signer
            .key
            .sign(&grant_input(worker_key, front, expires_ms))
            .unwrap();
        format!("{expires_ms}.{front}.{}", URL_SAFE_NO_PAD.encode(sig))
    }

    /// Headers sealed under `grant` with the key `key`.
    fn mac_sealed(grant: &str, key: &hmac::Key, subject: &str, body: &[u8]) -> HeaderMap {
        let stamp = new_stamp();
        let mut h = HeaderMap::new();
        h.insert(SEAL_STAMP_HEADER, stamp.as_str());
        h.insert(SEAL_GRANT_HEADER, grant);
        let mac = hmac::sign(key, &seal_input(subject, &stamp, body));
        h.insert(SEAL_MAC_HEADER, URL_SAFE_NO_PAD.encode(mac.as_ref()).as_str());
        h
    }

    fn grant_ms(d: Duration) -> u64 {
        u64::try_from(d.as_millis()).unwrap()
    }

    #[test]
    fn a_session_grant_seals_for_its_worker_only_and_once() {
        let (signer, worker) = pair();
        let other = ExecVerifier::trusting(&signer);
        let subject = "fleet.v1.worker.w1.exec";
        let mut h = HeaderMap::new();
        signer.seal_for(Some(worker.session_key()), subject, b"{}", &mut h);
        assert!(h.get(SEAL_SIGNATURE_HEADER).is_none(), "no signature per message");
        assert!(h.get(SEAL_GRANT_HEADER).is_some() && h.get(SEAL_MAC_HEADER).is_some());
        // Another worker trusting the same front: the grant names the first worker's key.
        assert_eq!(other.verify(subject, Some(&h), b"{}"), Err(SealError::BadGrant));
        // The MAC covers the subject and the body.
        assert_eq!(
            worker.verify("fleet.v1.worker.w2.exec", Some(&h), b"{}"),
            Err(SealError::BadSignature)
        );
        assert_eq!(
            worker.verify(subject, Some(&h), b"{ }"),
            Err(SealError::BadSignature)
        );
        assert_eq!(worker.verify(subject, Some(&h), b"{}"), Ok(()));
        assert_eq!(worker.verify(subject, Some(&h), b"{}"), Err(SealError::Replayed));
        // The grant is made once per worker, then reused.
        let mut again = HeaderMap::new();
        signer.seal_for(Some(worker.session_key()), subject, b"{}", &mut again);
        assert_eq!(again.get(SEAL_GRANT_HEADER), h.get(SEAL_GRANT_HEADER));
        assert_eq!(worker.verify(subject, Some(&again), b"{}"), Ok(()));
        assert_eq!(lock(&worker.grants).len(), 1);
        // A MAC without its grant, or one that is not base64.
        let mut bad = HeaderMap::new();
        for name in [SEAL_STAMP_HEADER, SEAL_MAC_HEADER] {
            bad.insert(name, again.get(name).unwrap().as_str());
        }
        assert_eq!(
            worker.verify(subject, Some(&bad), b"{}"),
            Err(SealError::Malformed)
        );
        let mut bad = again.clone();
        bad.insert(SEAL_MAC_HEADER, "not base64!");
        assert_eq!(
            worker.verify(subject, Some(&bad), b"{}"),
            Err(SealError::Malformed)
        );
    }

    #[test]
    fn without_a_usable_worker_key_the_seal_is_the_signature() {
        let (signer, worker) = pair();
        for key in [None, Some("not base64!"), Some("AAAA"), Some("")] {
            let mut h = HeaderMap::new();
            signer.seal_for(key, "s", b"x", &mut h);
            assert!(
                h.get(SEAL_SIGNATURE_HEADER).is_some() && h.get(SEAL_MAC_HEADER).is_none(),
                "{key:?}"
            );
            assert_eq!(worker.verify("s", Some(&h), b"x"), Ok(()), "{key:?}");
        }
    }

    /// What a credential that may publish on worker subjects can try with a worker's public session key: grants
    /// of its own making. Its own front key under a genuine grant's signature, a grant signed by another exec
    /// key, a low-order front key (a shared secret it would know): all refused, and none is kept.
    #[test]
    fn a_grant_not_made_by_a_front_for_this_worker_is_refused_and_not_kept() {
        let (signer, worker) = pair();
        let (stranger, _) = pair();
        let expires = now_ms() + grant_ms(GRANT_TTL);
        let mine = SessionPair::generate();
        let key = mine
            .shared(worker.session_key(), &mine.public, worker.session_key())
            .unwrap();
        // The genuine grant's signature with the attacker's front key swapped in.
        let genuine = grant_header(
            &signer,
            worker.session_key(),
            &SessionPair::generate().public,
            expires,
        );
        let sig = genuine.rsplit('.').next().unwrap();
        let swapped = format!("{expires}.{}.{sig}", mine.public);
        assert_eq!(
            worker.verify("s", Some(&mac_sealed(&swapped, &key, "s", b"x")), b"x"),
            Err(SealError::BadGrant)
        );
        // A grant signed by a key the worker does not trust.
        let foreign = grant_header(&stranger, worker.session_key(), &mine.public, expires);
        assert_eq!(
            worker.verify("s", Some(&mac_sealed(&foreign, &key, "s", b"x")), b"x"),
            Err(SealError::BadGrant)
        );
        // A low-order front key (the identity point): the shared secret would be all zeros.
        let zero = URL_SAFE_NO_PAD.encode([0u8; 32]);
        let low = grant_header(&signer, worker.session_key(), &zero, expires);
        assert_eq!(
            worker.verify("s", Some(&mac_sealed(&low, &key, "s", b"x")), b"x"),
            Err(SealError::BadGrant)
        );
        assert!(lock(&worker.grants).is_empty(), "nothing unverified is kept");
        for grant in [
            "",
            "1.2",
            "x.AAAA.AAAA",
            "123456789012345678901.AAAA.AAAA",
            "1.AAAA.not base64!",
        ] {
            assert_eq!(
                worker.verify("s", Some(&mac_sealed(grant, &key, "s", b"x")), b"x"),
                Err(SealError::Malformed),
                "{grant:?}"
            );
        }
    }

    #[test]
    fn a_grant_is_good_until_its_expiry_and_never_longer_than_a_front_gives() {
        let (signer, worker) = pair();
        let front = SessionPair::generate();
        let key = front
            .shared(worker.session_key(), &front.public, worker.session_key())
            .unwrap();
        let now = now_ms();
        let longest = grant_ms(GRANT_TTL + MAX_SKEW);
        // A second inside each bound: no clock step between sealing and checking reaches it.
        for (expires, want) in [
            (now + 1_000, Ok(())),
            (now + longest - 1_000, Ok(())),
            (now - 1_000, Err(SealError::Stale)),
            (now + longest + 1_000, Err(SealError::BadGrant)),
        ] {
            let grant = grant_header(&signer, worker.session_key(), &front.public, expires);
            assert_eq!(
                worker.verify("s", Some(&mac_sealed(&grant, &key, "s", b"x")), b"x"),
                want,
                "expires in {} ms",
                i128::from(expires) - i128::from(now)
            );
        }
        // A kept grant is checked again at every use: once it has expired, it seals nothing.
        let grant = grant_header(&signer, worker.session_key(), &front.public, now + 1_000);
        lock(&worker.grants).insert(grant.clone(), (Arc::new(key.clone()), now - 1));
        assert_eq!(
            worker.verify("s", Some(&mac_sealed(&grant, &key, "s", b"x")), b"x"),
            Err(SealError::Stale)
        );
    }

    #[test]
    fn a_rotated_session_makes_new_grants_and_the_worker_keeps_a_bounded_number() {
        let (signer, worker) = pair();
        let mut first = HeaderMap::new();
        signer.seal_for(Some(worker.session_key()), "s", b"x", &mut first);
        signer.rotate_session();
        let mut second = HeaderMap::new();
        signer.seal_for(Some(worker.session_key()), "s", b"x", &mut second);
        assert_ne!(first.get(SEAL_GRANT_HEADER), second.get(SEAL_GRANT_HEADER));
        // Messages sealed before the rotation are still good (their grant has not expired).
        assert_eq!(worker.verify("s", Some(&first), b"x"), Ok(()));
        assert_eq!(worker.verify("s", Some(&second), b"x"), Ok(()));
        for _ in 0..GRANT_CACHE_MAX {
            signer.rotate_session();
            let mut h = HeaderMap::new();
            signer.seal_for(Some(worker.session_key()), "s", b"x", &mut h);
            assert_eq!(worker.verify("s", Some(&h), b"x"), Ok(()));
            assert!(lock(&worker.grants).len() <= GRANT_CACHE_MAX);
        }
    }

    /// A worker restarted with the same state directory keeps its session key: what a front sealed for it before
    /// the restart is good after it (no `bad_grant` until the front sees a new registry entry).
    #[test]
    fn a_kept_session_survives_a_restart_and_a_bad_file_is_named_not_quoted() {
        let (signer, _) = pair();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state").join(EXEC_SESSION_FILE);
        let before = ExecVerifier::trusting(&signer).keep_session_in(&path).unwrap();
        let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&path).unwrap().permissions());
        assert_eq!(mode & 0o777, 0o600);
        let mut h = HeaderMap::new();
        signer.seal_for(Some(before.session_key()), "s", b"x", &mut h);
        let issued: u64 = h
            .get(SEAL_STAMP_HEADER)
            .and_then(|s| s.as_str().split('.').next()?.parse().ok())
            .unwrap();
        // The restart happens a millisecond after the seal at the earliest.
        let after = ExecVerifier::trusting(&signer)
            .keep_session_in(&path)
            .unwrap()
            .accepting_from(issued + 1);
        assert_eq!(after.session_key(), before.session_key());
        // What was sealed before the restart is refused (its nonce may have been seen by the previous run)…
        assert_eq!(after.verify("s", Some(&h), b"x"), Err(SealError::Stale));
        // …what the front seals after it with the same grant is good.
        let mut later = HeaderMap::new();
        signer.seal_for(Some(before.session_key()), "s", b"x", &mut later);
        assert_eq!(later.get(SEAL_GRANT_HEADER), h.get(SEAL_GRANT_HEADER));
        let after = after.accepting_from(issued);
        assert_eq!(after.verify("s", Some(&later), b"x"), Ok(()));
        // Without the file, a new key: a seal for the old one is refused.
        assert_eq!(
            ExecVerifier::trusting(&signer)
                .accepting_from(0)
                .verify("s", Some(&h), b"x"),
            Err(SealError::BadGrant)
        );
        std::fs::write(&path, "c2VjcmV0LWJ1dC10b28tc2hvcnQ\n").unwrap();
        let err = ExecVerifier::trusting(&signer)
            .keep_session_in(&path)
            .unwrap_err();
        assert!(matches!(err, SealKeyError::NotASessionSecret { .. }), "{err}");
        assert!(!err.to_string().contains("c2VjcmV0"), "{err}");
    }

    /// Finding 16 of the second security review: the nonce set lives in memory, so a restarted worker refuses
    /// every stamp issued before it started, even one well within [`MAX_SKEW`].
    #[test]
    fn a_restarted_worker_refuses_seals_stamped_before_it_started() {
        let (signer, _) = pair();
        let issued = now_ms();
        let h = stamped(&signer, issued);
        let running = ExecVerifier::trusting(&signer).accepting_from(issued);
        assert_eq!(running.verify("s", Some(&h), b"x"), Ok(()));
        assert_eq!(running.verify("s", Some(&h), b"x"), Err(SealError::Replayed));
        let restarted = ExecVerifier::trusting(&signer).accepting_from(issued + 1);
        assert_eq!(restarted.verify("s", Some(&h), b"x"), Err(SealError::Stale));
        // A verifier made now: a stamp of a second ago is within the skew but before its start.
        let fresh = ExecVerifier::trusting(&signer);
        let old = stamped(&signer, now_ms() - 1_000);
        assert_eq!(fresh.verify("s", Some(&old), b"x"), Err(SealError::Stale));
    }

    fn sealed_job(signer: &ExecSigner) -> JobRecord {
        let mut r = JobRecord::queued(
            fleet_proto::api::JobId::from_bytes([3; 16]),
            "alice",
            "echo.echo",
            "echo",
            "echo",
            1_000,
            60_000,
        );
        r.args = serde_json::json!({"text": "hi", "n": 1.5, "nested": {"b": [1, 2], "a": null}})
            .as_object()
            .unwrap()
            .clone();
        r.seal = Some(signer.seal_job(&r));
        r
    }

    /// A job record's seal covers its user, tool id, plugin, method, arguments, id, deadline and timeout: changing
    /// any of them, removing the seal or mangling it is refused by workers and sweepers alike; what the record's
    /// life changes (state, worker, times, result) is not sealed.
    #[test]
    fn a_job_seal_covers_what_runs_and_nothing_else() {
        let (signer, worker) = pair();
        let genuine = sealed_job(&signer);
        assert_eq!(worker.verify_job(&genuine), Ok(()));
        assert_eq!(signer.verify_job(&genuine), Ok(()));
        // Read back from JSON, as the bucket gives it.
        let read: JobRecord = serde_json::from_slice(&serde_json::to_vec(&genuine).unwrap()).unwrap();
        assert_eq!(worker.verify_job(&read), Ok(()));
        let mut lived = genuine.clone();
        lived.state = fleet_proto::api::JobState::Running;
        lived.worker = Some("w1".into());
        lived.started_at_ms = Some(2_000);
        lived.attempt = 3;
        lived.last_heartbeat_ms = Some(2_500);
        assert_eq!(worker.verify_job(&lived), Ok(()));
        type Alter = fn(&mut JobRecord);
        let altered: [(&str, Alter); 9] = [
            ("user", |r| r.user = "mallory".into()),
            ("tool_id", |r| r.tool_id = "echo.write_file".into()),
            ("plugin", |r| r.plugin = "other".into()),
            ("tool", |r| r.tool = "write_file".into()),
            ("args", |r| {
                r.args.insert("text".into(), serde_json::json!("bye"));
            }),
            ("no args", |r| r.args.clear()),
            ("job_id", |r| {
                r.job_id = fleet_proto::api::JobId::from_bytes([4; 16])
            }),
            ("deadline", |r| r.deadline_ms += 1),
            ("timeout", |r| r.timeout_ms += 1),
        ];
        for (what, alter) in altered {
            let mut r = genuine.clone();
            alter(&mut r);
            assert_eq!(worker.verify_job(&r), Err(JobSealError::BadSignature), "{what}");
            assert_eq!(signer.verify_job(&r), Err(JobSealError::BadSignature), "{what}");
        }
        let mut r = genuine.clone();
        r.seal = None;
        assert_eq!(worker.verify_job(&r), Err(JobSealError::Unsealed));
        r.seal = Some("not base64!".into());
        assert_eq!(worker.verify_job(&r), Err(JobSealError::Malformed));
        r.seal = Some(String::new());
        assert_eq!(worker.verify_job(&r), Err(JobSealError::BadSignature));
        // Another exec key (a credential holder's own): refused, unless the other side trusts it.
        let (stranger, stranger_worker) = pair();
        let foreign = sealed_job(&stranger);
        assert_eq!(worker.verify_job(&foreign), Err(JobSealError::BadSignature));
        assert_eq!(signer.verify_job(&foreign), Err(JobSealError::BadSignature));
        let (other_front, _) = pair();
        let rotating = other_front.also_verifying_jobs_with(&stranger_worker);
        assert_eq!(rotating.verify_job(&foreign), Ok(()));
        assert_eq!(rotating.verify_job(&genuine), Err(JobSealError::BadSignature));
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
