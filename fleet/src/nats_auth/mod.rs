//! NATS decentralized (JWT) auth material for the fleet: the nkeys, the operator / account / user JWTs, the
//! `.creds` files of the fleet's own roles, the nats-server configuration for operator mode with the `full`
//! resolver, app users issued on demand, and revocation.
//!
//! **Trust chain.** One operator (identity key `O…`, plus one operator signing key that signs the accounts) and
//! three accounts:
//! - `SYS`, the system account (no JetStream); its user (`sys.creds`) pushes account updates;
//! - `FLEET` (JetStream unlimited), the fleet's own users `front`, `worker` and `operator`, signed by the account
//!   identity key; it exports the service `fleet.v1.api.>` (singleton replies) and the stream `fleet.v1.events.>`;
//! - `APP` (JetStream disabled), imports both; its users are signed by the APP signing key (`issuer_account` =
//!   APP): the `app` role user and every user [`AuthMaterial::issue_app_user`] issues.
//!
//! **Files under the auth directory** (created 0700; every file 0600, created with that mode and replaced
//! atomically: temporary file in the same directory, fsync, rename):
//! - `seeds.json` — the only secret-bearing file besides the creds: `{"version":1,"operator","operator_signing",
//!   "sys_account","fleet_account","app_account","app_signing": "S…", "users": {"front": "SU…", …}}`. Written once
//!   (exclusively: two processes initialising the same directory agree on one set of keys); rewritten only to add
//!   the user seed of a role that did not exist yet. Never regenerated.
//! - `jwts.json` — the operator and account JWTs last signed (`{"operator","sys_account","fleet_account",
//!   "app_account"}`). A JWT is re-signed (new `iat`) only when its content as the code defines it changed, so the
//!   baseline preloaded into the server keeps its old `iat` and never wins over a newer update pushed since
//!   (a revocation list, see below).
//! - `<role>.creds` for every [`Role`] — rewritten only when the user's claims (permissions) changed; the user
//!   keys stay the same.
//! - `exec.seed` / `exec.pub` — the key fronts seal exec requests and cancels with, and its public key for the
//!   workers ([`exec_seal`]). Created once, never regenerated.
//!
//! **Revocation.** The revocation list is the caller's state: [`AuthMaterial::app_account_jwt_with_revocations`]
//! signs an APP account JWT carrying it (with an `iat` newer than the baseline), [`push_account_jwt`] sends it to
//! the servers (`$SYS.REQ.CLAIMS.UPDATE`, with the SYS user), which store it in the resolver directory and close
//! the revoked users' connections. The baseline in `jwts.json` does not carry revocations: if the baseline itself
//! changes (new `iat`), or a server starts on an empty resolver directory, push the current list again.
//!
//! **Secrets.** No error message, `Debug` output or log line contains a seed or a `.creds` text.

pub mod cli;
pub mod creds;
pub mod exec_seal;
pub mod jwt;
pub mod permissions;

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use nkeys::{KeyPair, KeyPairType};
use serde::{Deserialize, Serialize};

use fleet_client::creds::{JwtError, Role, check_user_name, creds_in, creds_jwt, creds_seed, format_creds};

use self::creds::{create_private_exclusive, ensure_private_dir, ensure_private_file, write_private_atomic};
use self::jwt::{AccountLimits, AccountNats, Export, ExportKind, Import, OperatorNats, UserNats};

/// The subjects of the fleet's API, exported by FLEET as a service and imported by APP.
pub const API_SUBJECTS: &str = "fleet.v1.api.>";
/// The subjects of the fleet's events, exported by FLEET as a stream and imported by APP.
pub const EVENT_SUBJECTS: &str = "fleet.v1.events.>";
/// The seeds file, under the auth directory.
pub const SEEDS_FILE: &str = "seeds.json";
/// The operator and account JWTs, under the auth directory.
pub const JWTS_FILE: &str = "jwts.json";

/// Why auth material could not be loaded, created, issued or pushed. No variant ever carries a seed.
#[derive(Debug, thiserror::Error)]
pub enum NatsAuthError {
    /// A file or directory could not be read, written or created.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// `seeds.json` is not valid JSON of the expected shape (its content is not quoted: it holds seeds).
    #[error("{}: not a valid seeds file (line {line}, column {column})", path.display())]
    SeedsFile {
        /// The file.
        path: PathBuf,
        /// Where parsing failed.
        line: usize,
        /// Where parsing failed.
        column: usize,
    },
    /// A seed in `seeds.json` is not a valid nkey seed of the expected type.
    #[error("the seed `{key}` in seeds.json is not a valid nkey seed of the expected type")]
    InvalidSeed {
        /// Its key in the file.
        key: &'static str,
    },
    /// JSON (de)serialisation of something that is not secret failed.
    #[error("{what}: {reason}")]
    Json {
        /// What was being (de)serialised.
        what: &'static str,
        /// The cause.
        reason: String,
    },
    /// An nkey operation failed.
    #[error("nkey error while {what}: {reason}")]
    Nkey {
        /// The operation.
        what: &'static str,
        /// The cause (the nkeys library's message, which never quotes a seed).
        reason: String,
    },
    /// A JWT is not well formed.
    #[error("malformed NATS JWT: {0}")]
    MalformedJwt(&'static str),
    /// A JWT's signature does not verify with its `iss` key.
    #[error("the NATS JWT's signature does not verify")]
    BadSignature,
    /// A user name is not 1–64 characters of `[A-Za-z0-9_-]`.
    #[error("invalid NATS user name: {0}")]
    InvalidUserName(&'static str),
    /// The account update request failed (no responder, timeout, connection).
    #[error("pushing the account JWT failed: {0}")]
    PushRequest(String),
    /// The server refused the account update.
    #[error("the server refused the account JWT (code {code}): {description}")]
    PushRejected {
        /// The server's code (e.g. 400, 500).
        code: i64,
        /// The server's description.
        description: String,
    },
    /// The server's reply was not understood.
    #[error("unexpected reply to the account update: {0}")]
    PushReply(String),
    /// [`push_account_jwt`] was given a correctly signed JWT that is not an account JWT.
    #[error("not an account JWT: {0}")]
    NotAnAccountJwt(&'static str),
}

/// The subject permissions of one user. NATS semantics: an empty allow list allows everything not denied, so
/// [`Permissions::default`] allows everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Permissions {
    /// Subjects the user may publish to (empty = all not denied).
    pub publish_allow: Vec<String>,
    /// Subjects the user may not publish to.
    pub publish_deny: Vec<String>,
    /// Subjects the user may subscribe to (empty = all not denied).
    pub subscribe_allow: Vec<String>,
    /// Subjects the user may not subscribe to.
    pub subscribe_deny: Vec<String>,
    /// Whether the user may reply (once) to the reply subject of a request it received, even outside
    /// `publish_allow` (JWT `resp: {max: 1}`).
    pub allow_responses: bool,
}

impl Permissions {
    /// Publish and subscribe `>` (everything); for tests and the system user.
    pub fn all() -> Permissions {
        Permissions {
            publish_allow: vec![">".to_owned()],
            subscribe_allow: vec![">".to_owned()],
            ..Permissions::default()
        }
    }
}

/// A user issued by [`AuthMaterial::issue_app_user`]. Its `Debug` shows everything but the creds.
#[derive(Clone)]
pub struct IssuedUser {
    /// The name given.
    pub name: String,
    /// The user's public nkey (`U…`): the key to revoke.
    pub public_key: String,
    /// The JWT's `iat`, unix seconds (a revocation at or after it refuses the user).
    pub issued_at: u64,
    /// The `.creds` text (JWT and seed): a secret, for the user alone.
    pub creds: String,
}

impl fmt::Debug for IssuedUser {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IssuedUser")
            .field("name", &self.name)
            .field("public_key", &self.public_key)
            .field("issued_at", &self.issued_at)
            .field("creds", &"<redacted>")
            .finish()
    }
}

/// `seeds.json`. No `Debug`: it holds seeds.
#[derive(Serialize, Deserialize)]
struct SeedsFile {
    version: u32,
    operator: String,
    operator_signing: String,
    sys_account: String,
    fleet_account: String,
    app_account: String,
    app_signing: String,
    #[serde(default)]
    users: BTreeMap<String, String>,
}

/// `jwts.json`.
#[derive(Debug, Default, Serialize, Deserialize)]
struct JwtsFile {
    #[serde(default)]
    operator: Option<String>,
    #[serde(default)]
    sys_account: Option<String>,
    #[serde(default)]
    fleet_account: Option<String>,
    #[serde(default)]
    app_account: Option<String>,
}

fn seed_of(kp: &KeyPair, what: &'static str) -> Result<String, NatsAuthError> {
    kp.seed().map_err(|e| NatsAuthError::Nkey {
        what,
        reason: e.to_string(),
    })
}

impl SeedsFile {
    fn generate() -> Result<SeedsFile, NatsAuthError> {
        let mut users = BTreeMap::new();
        for role in Role::ALL {
            users.insert(
                role.as_str().to_owned(),
                seed_of(&KeyPair::new_user(), "generating a seed")?,
            );
        }
        Ok(SeedsFile {
            version: 1,
            operator: seed_of(&KeyPair::new_operator(), "generating a seed")?,
            operator_signing: seed_of(&KeyPair::new_operator(), "generating a seed")?,
            sys_account: seed_of(&KeyPair::new_account(), "generating a seed")?,
            fleet_account: seed_of(&KeyPair::new_account(), "generating a seed")?,
            app_account: seed_of(&KeyPair::new_account(), "generating a seed")?,
            app_signing: seed_of(&KeyPair::new_account(), "generating a seed")?,
            users,
        })
    }

    fn to_bytes(&self) -> Result<Vec<u8>, NatsAuthError> {
        let mut bytes = serde_json::to_vec_pretty(self).map_err(|e| NatsAuthError::Json {
            what: "seeds.json",
            reason: e.to_string(),
        })?;
        bytes.push(b'\n');
        Ok(bytes)
    }

    fn read(path: &Path) -> Result<SeedsFile, NatsAuthError> {
        ensure_private_file(path)?;
        let bytes = fs::read(path).map_err(|source| NatsAuthError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        // serde_json's messages may quote the input: report the position only.
        serde_json::from_slice(&bytes).map_err(|e| NatsAuthError::SeedsFile {
            path: path.to_path_buf(),
            line: e.line(),
            column: e.column(),
        })
    }
}

fn key_from_seed(seed: &str, kind: &KeyPairType, key: &'static str) -> Result<KeyPair, NatsAuthError> {
    match KeyPair::from_seed(seed) {
        Ok(kp) if kp.key_pair_type() == *kind => Ok(kp),
        _ => Err(NatsAuthError::InvalidSeed { key }),
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Checks a user name: 1–64 characters of `[A-Za-z0-9_-]`.
pub fn validate_user_name(name: &str) -> Result<(), NatsAuthError> {
    check_user_name(name).map_err(NatsAuthError::InvalidUserName)
}

impl From<JwtError> for NatsAuthError {
    fn from(e: JwtError) -> NatsAuthError {
        match e {
            JwtError::Malformed(reason) => NatsAuthError::MalformedJwt(reason),
            JwtError::BadSignature => NatsAuthError::BadSignature,
        }
    }
}

/// Quotes `s` as a nats-server config string.
fn conf_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The fleet's NATS auth material, loaded from (or first created in) an auth directory; see the module docs for
/// the files. Its `Debug` shows public keys only.
pub struct AuthMaterial {
    dir: PathBuf,
    operator: KeyPair,
    operator_signing: KeyPair,
    sys: KeyPair,
    fleet: KeyPair,
    app: KeyPair,
    app_signing: KeyPair,
    users: BTreeMap<Role, String>,
    operator_jwt: String,
    sys_jwt: String,
    fleet_jwt: String,
    app_jwt: String,
    app_iat: u64,
}

impl fmt::Debug for AuthMaterial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AuthMaterial")
            .field("dir", &self.dir)
            .field("operator", &self.operator.public_key())
            .field("operator_signing", &self.operator_signing.public_key())
            .field("sys_account", &self.sys.public_key())
            .field("fleet_account", &self.fleet.public_key())
            .field("app_account", &self.app.public_key())
            .field("app_signing", &self.app_signing.public_key())
            .field("users", &self.users)
            .finish_non_exhaustive()
    }
}

/// Reuses `existing` if it verifies and says what `wanted` (its stable part) says; otherwise signs anew.
/// Returns the JWT and whether it is new.
fn reuse_or_sign<N: Serialize + Clone>(
    existing: Option<&str>,
    issuer: &KeyPair,
    subject: &str,
    name: &str,
    nats: &N,
) -> Result<(String, bool), NatsAuthError> {
    let wanted = jwt::stable_part_of(issuer, subject, name, None, nats.clone())?;
    if let Some(token) = existing
        && let Ok(claims) = jwt::decode(token)
        && jwt::stable_part(claims) == wanted
    {
        return Ok((token.to_owned(), false));
    }
    let token = jwt::encode(issuer, subject, name, now_secs(), None, nats.clone())?;
    Ok((token, true))
}

fn iat_of(token: &str) -> Result<u64, NatsAuthError> {
    jwt::decode(token)?
        .get("iat")
        .and_then(serde_json::Value::as_u64)
        .ok_or(NatsAuthError::MalformedJwt("no iat claim"))
}

/// The key pairs of a seeds file.
struct Keys {
    operator: KeyPair,
    operator_signing: KeyPair,
    sys: KeyPair,
    fleet: KeyPair,
    app: KeyPair,
    app_signing: KeyPair,
    users: BTreeMap<Role, KeyPair>,
}

impl Keys {
    fn from_seeds(seeds: &SeedsFile) -> Result<Keys, NatsAuthError> {
        let operator = key_from_seed(&seeds.operator, &KeyPairType::Operator, "operator")?;
        let operator_signing = key_from_seed(
            &seeds.operator_signing,
            &KeyPairType::Operator,
            "operator_signing",
        )?;
        let sys = key_from_seed(&seeds.sys_account, &KeyPairType::Account, "sys_account")?;
        let fleet = key_from_seed(&seeds.fleet_account, &KeyPairType::Account, "fleet_account")?;
        let app = key_from_seed(&seeds.app_account, &KeyPairType::Account, "app_account")?;
        let app_signing = key_from_seed(&seeds.app_signing, &KeyPairType::Account, "app_signing")?;
        let mut user_keys = BTreeMap::new();
        for role in Role::ALL {
            let seed = seeds
                .users
                .get(role.as_str())
                .ok_or(NatsAuthError::InvalidSeed { key: "users" })?;
            user_keys.insert(role, key_from_seed(seed, &KeyPairType::User, "users")?);
        }
        Ok(Keys {
            operator,
            operator_signing,
            sys,
            fleet,
            app,
            app_signing,
            users: user_keys,
        })
    }
}

impl AuthMaterial {
    /// Loads existing material from `dir` without writing or changing anything there (a read-only mount, e.g. a
    /// Kubernetes Secret: files may be group-readable symlinks). `seeds.json` and `jwts.json` must exist; the
    /// role `.creds` files are not read. For issuing and revoking app users on a front.
    pub fn load_read_only(dir: &Path) -> Result<AuthMaterial, NatsAuthError> {
        let read = |name: &str| {
            let path = dir.join(name);
            fs::read(&path).map_err(|source| NatsAuthError::Io { path, source })
        };
        let seeds_path = dir.join(SEEDS_FILE);
        let seeds: SeedsFile =
            serde_json::from_slice(&read(SEEDS_FILE)?).map_err(|e| NatsAuthError::SeedsFile {
                path: seeds_path,
                line: e.line(),
                column: e.column(),
            })?;
        let jwts: JwtsFile = serde_json::from_slice(&read(JWTS_FILE)?).map_err(|e| NatsAuthError::Json {
            what: "jwts.json",
            reason: e.to_string(),
        })?;
        let keys = Keys::from_seeds(&seeds)?;
        let missing = || NatsAuthError::MalformedJwt("jwts.json lacks a JWT");
        let app_jwt = jwts.app_account.ok_or_else(missing)?;
        let app_iat = iat_of(&app_jwt)?;
        Ok(AuthMaterial {
            dir: dir.to_path_buf(),
            users: keys.users.iter().map(|(r, kp)| (*r, kp.public_key())).collect(),
            operator: keys.operator,
            operator_signing: keys.operator_signing,
            sys: keys.sys,
            fleet: keys.fleet,
            app: keys.app,
            app_signing: keys.app_signing,
            operator_jwt: jwts.operator.ok_or_else(missing)?,
            sys_jwt: jwts.sys_account.ok_or_else(missing)?,
            fleet_jwt: jwts.fleet_account.ok_or_else(missing)?,
            app_jwt,
            app_iat,
        })
    }

    /// Loads the material from `dir`, creating the directory (0700), the keys and the JWTs on the first call;
    /// (re)writes each role's `.creds` whose claims differ from what `permissions` now says. Keys are never
    /// regenerated.
    pub fn load_or_create(
        dir: &Path,
        permissions: impl Fn(Role) -> Permissions,
    ) -> Result<AuthMaterial, NatsAuthError> {
        ensure_private_dir(dir)?;
        let seeds_path = dir.join(SEEDS_FILE);
        let mut seeds = if seeds_path.exists() {
            SeedsFile::read(&seeds_path)?
        } else {
            let fresh = SeedsFile::generate()?;
            if create_private_exclusive(&seeds_path, &fresh.to_bytes()?)? {
                fresh
            } else {
                // Another process created it first: use its keys.
                SeedsFile::read(&seeds_path)?
            }
        };
        let mut added = false;
        for role in Role::ALL {
            if !seeds.users.contains_key(role.as_str()) {
                seeds.users.insert(
                    role.as_str().to_owned(),
                    seed_of(&KeyPair::new_user(), "generating a seed")?,
                );
                added = true;
            }
        }
        if added {
            write_private_atomic(&seeds_path, &seeds.to_bytes()?)?;
        }

        let Keys {
            operator,
            operator_signing,
            sys,
            fleet,
            app,
            app_signing,
            users: user_keys,
        } = Keys::from_seeds(&seeds)?;

        // Operator and account JWTs: reuse what is persisted unless the code now says something else.
        let jwts_path = dir.join(JWTS_FILE);
        let persisted: JwtsFile = match fs::read(&jwts_path) {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_default(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => JwtsFile::default(),
            Err(source) => {
                return Err(NatsAuthError::Io {
                    path: jwts_path,
                    source,
                });
            }
        };
        let (operator_jwt, op_new) = reuse_or_sign(
            persisted.operator.as_deref(),
            &operator,
            &operator.public_key(),
            "fleet",
            &OperatorNats::new(vec![operator_signing.public_key()], sys.public_key()),
        )?;
        let (sys_jwt, sys_new) = reuse_or_sign(
            persisted.sys_account.as_deref(),
            &operator_signing,
            &sys.public_key(),
            "SYS",
            &Self::sys_account_nats(),
        )?;
        let (fleet_jwt, fleet_new) = reuse_or_sign(
            persisted.fleet_account.as_deref(),
            &operator_signing,
            &fleet.public_key(),
            "FLEET",
            &Self::fleet_account_nats(),
        )?;
        let (app_jwt, app_new) = reuse_or_sign(
            persisted.app_account.as_deref(),
            &operator_signing,
            &app.public_key(),
            "APP",
            &Self::app_account_nats_for(&fleet.public_key(), &app_signing.public_key()),
        )?;
        if op_new || sys_new || fleet_new || app_new {
            let file = JwtsFile {
                operator: Some(operator_jwt.clone()),
                sys_account: Some(sys_jwt.clone()),
                fleet_account: Some(fleet_jwt.clone()),
                app_account: Some(app_jwt.clone()),
            };
            let mut bytes = serde_json::to_vec_pretty(&file).map_err(|e| NatsAuthError::Json {
                what: "jwts.json",
                reason: e.to_string(),
            })?;
            bytes.push(b'\n');
            write_private_atomic(&jwts_path, &bytes)?;
        } else {
            ensure_private_file(&jwts_path)?;
        }
        let app_iat = iat_of(&app_jwt)?;

        let material = AuthMaterial {
            dir: dir.to_path_buf(),
            operator,
            operator_signing,
            sys,
            fleet,
            app,
            app_signing,
            users: user_keys.iter().map(|(r, kp)| (*r, kp.public_key())).collect(),
            operator_jwt,
            sys_jwt,
            fleet_jwt,
            app_jwt,
            app_iat,
        };

        for (role, user) in &user_keys {
            material.write_role_creds(*role, user, &permissions(*role))?;
        }
        exec_seal::ensure_keys(dir)?;
        Ok(material)
    }

    /// Writes `<role>.creds` unless the existing one already holds this user with these claims.
    fn write_role_creds(&self, role: Role, user: &KeyPair, perms: &Permissions) -> Result<(), NatsAuthError> {
        let (issuer, issuer_account) = match role {
            Role::Front | Role::Worker | Role::Operator => (&self.fleet, None),
            Role::App => (&self.app_signing, Some(self.app.public_key())),
            Role::Sys => (&self.sys, None),
        };
        let path = self.creds_path(role);
        let seed = seed_of(user, "reading a user seed")?;
        let existing = match fs::read_to_string(&path) {
            Ok(text) => Some(text),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(source) => return Err(NatsAuthError::Io { path, source }),
        };
        let existing_jwt = existing
            .as_deref()
            .filter(|text| creds_seed(text) == Some(seed.as_str()))
            .and_then(creds_jwt);
        let (token, is_new) = reuse_or_sign(
            existing_jwt,
            issuer,
            &user.public_key(),
            role.as_str(),
            &UserNats::new(perms, issuer_account),
        )?;
        let text = format_creds(&token, &seed);
        if is_new || existing.as_deref() != Some(text.as_str()) {
            write_private_atomic(&path, text.as_bytes())
        } else {
            ensure_private_file(&path)
        }
    }

    fn sys_account_nats() -> AccountNats {
        AccountNats::new(
            AccountLimits::unlimited_without_jetstream(),
            vec![],
            vec![],
            vec![],
        )
    }

    fn fleet_account_nats() -> AccountNats {
        AccountNats::new(
            AccountLimits::unlimited_with_jetstream(),
            vec![
                Export {
                    name: "fleet-api".to_owned(),
                    subject: API_SUBJECTS.to_owned(),
                    kind: ExportKind::Service,
                    response_type: Some("Singleton".to_owned()),
                },
                Export {
                    name: "fleet-events".to_owned(),
                    subject: EVENT_SUBJECTS.to_owned(),
                    kind: ExportKind::Stream,
                    response_type: None,
                },
            ],
            vec![],
            vec![],
        )
    }

    fn app_account_nats_for(fleet: &str, app_signing: &str) -> AccountNats {
        AccountNats::new(
            AccountLimits::unlimited_without_jetstream(),
            vec![],
            vec![
                Import {
                    name: "fleet-api".to_owned(),
                    subject: API_SUBJECTS.to_owned(),
                    account: fleet.to_owned(),
                    kind: ExportKind::Service,
                },
                Import {
                    name: "fleet-events".to_owned(),
                    subject: EVENT_SUBJECTS.to_owned(),
                    account: fleet.to_owned(),
                    kind: ExportKind::Stream,
                },
            ],
            vec![app_signing.to_owned()],
        )
    }

    /// The auth directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `<dir>/<role>.creds`.
    pub fn creds_path(&self, role: Role) -> PathBuf {
        creds_in(&self.dir, role)
    }

    /// The public key of a role's user.
    pub fn user_public_key(&self, role: Role) -> Option<&str> {
        self.users.get(&role).map(String::as_str)
    }

    /// The operator's identity public key (`O…`).
    pub fn operator_public_key(&self) -> String {
        self.operator.public_key()
    }

    /// The SYS account's public key.
    pub fn sys_account_public_key(&self) -> String {
        self.sys.public_key()
    }

    /// The FLEET account's public key.
    pub fn fleet_account_public_key(&self) -> String {
        self.fleet.public_key()
    }

    /// The APP account's public key.
    pub fn app_account_public_key(&self) -> String {
        self.app.public_key()
    }

    /// The operator JWT.
    pub fn operator_jwt(&self) -> &str {
        &self.operator_jwt
    }

    /// The SYS account JWT.
    pub fn sys_account_jwt(&self) -> &str {
        &self.sys_jwt
    }

    /// The FLEET account JWT.
    pub fn fleet_account_jwt(&self) -> &str {
        &self.fleet_jwt
    }

    /// The baseline APP account JWT (no revocations).
    pub fn app_account_jwt(&self) -> &str {
        &self.app_jwt
    }

    /// The nats-server configuration lines for operator mode: `operator`, `system_account`, a `full` resolver
    /// storing under `resolver_dir` (no deletes, 2 min sync interval), and the three account JWTs preloaded.
    /// Preloading never replaces a newer JWT already in the resolver directory (the server keeps the one with the
    /// later `iat`).
    pub fn server_config(&self, resolver_dir: &Path) -> String {
        let dir = conf_string(&resolver_dir.to_string_lossy());
        format!(
            "operator: {op}\n\
             system_account: {sys}\n\
             resolver: {{\n    type: full\n    dir: {dir}\n    allow_delete: false\n    interval: \"2m\"\n    timeout: \"1.9s\"\n}}\n\
             resolver_preload: {{\n    {sys}: {sys_jwt}\n    {fleet}: {fleet_jwt}\n    {app}: {app_jwt}\n}}\n",
            op = conf_string(&self.operator_jwt),
            sys = self.sys.public_key(),
            fleet = self.fleet.public_key(),
            app = self.app.public_key(),
            sys_jwt = conf_string(&self.sys_jwt),
            fleet_jwt = conf_string(&self.fleet_jwt),
            app_jwt = conf_string(&self.app_jwt),
        )
    }

    /// Issues a FLEET-account user named `name` with `permissions` (signed by the FLEET account key): for an
    /// operator's break-glass work on the fleet's own streams (e.g. deleting a broken one by hand), which no role
    /// may do. Nothing is stored; the user is valid until the FLEET account key changes.
    pub fn issue_fleet_user(
        &self,
        name: &str,
        permissions: &Permissions,
    ) -> Result<IssuedUser, NatsAuthError> {
        issue_user(&self.fleet, None, name, permissions)
    }

    /// Issues a new APP user named `name` (1–64 of `[A-Za-z0-9_-]`) with `permissions`: a fresh user key, its JWT
    /// signed by the APP signing key, and its `.creds` text. Nothing is stored.
    pub fn issue_app_user(&self, name: &str, permissions: &Permissions) -> Result<IssuedUser, NatsAuthError> {
        issue_user(&self.app_signing, Some(self.app.public_key()), name, permissions)
    }

    /// A freshly signed APP account JWT (same limits, imports and signing keys as the baseline) revoking
    /// `revoked` (user public key → unix seconds; users of that key issued at or before it are refused, and
    /// their connections closed). Its `iat` is now, and always later than the baseline's, so it wins over it.
    pub fn app_account_jwt_with_revocations(
        &self,
        revoked: &BTreeMap<String, u64>,
    ) -> Result<String, NatsAuthError> {
        let mut nats = Self::app_account_nats_for(&self.fleet.public_key(), &self.app_signing.public_key());
        nats.revocations = revoked.clone();
        let iat = now_secs().max(self.app_iat.saturating_add(1));
        jwt::encode(
            &self.operator_signing,
            &self.app.public_key(),
            "APP",
            iat,
            None,
            nats,
        )
    }
}

/// A fresh user key named `name` (1–64 of `[A-Za-z0-9_-]`), its JWT signed by `issuer` (`issuer_account`: the
/// account a signing key signs for), and its `.creds` text. Nothing is stored.
fn issue_user(
    issuer: &KeyPair,
    issuer_account: Option<String>,
    name: &str,
    permissions: &Permissions,
) -> Result<IssuedUser, NatsAuthError> {
    validate_user_name(name)?;
    let user = KeyPair::new_user();
    let issued_at = now_secs();
    let token = jwt::encode(
        issuer,
        &user.public_key(),
        name,
        issued_at,
        None,
        UserNats::new(permissions, issuer_account),
    )?;
    let seed = seed_of(&user, "reading a user seed")?;
    Ok(IssuedUser {
        name: name.to_owned(),
        public_key: user.public_key(),
        issued_at,
        creds: format_creds(&token, &seed),
    })
}

/// The server's reply to `$SYS.REQ.CLAIMS.UPDATE`.
#[derive(Debug, Deserialize)]
struct ClaimsUpdateReply {
    #[serde(default)]
    data: Option<ReplyBody>,
    #[serde(default)]
    error: Option<ReplyBody>,
}

#[derive(Debug, Deserialize)]
struct ReplyBody {
    #[serde(default)]
    code: i64,
    #[serde(default)]
    message: Option<String>,
    #[serde(default)]
    description: Option<String>,
}

/// Sends an account JWT to the servers (`$SYS.REQ.CLAIMS.UPDATE`, through a SYS-account connection) and checks
/// the reply (`{"data":{"code":200,…}}`); the first server to answer is the one checked.
///
/// Before sending, the JWT must decode, verify with its `iss` key, and be an account JWT about an account key
/// (else [`NatsAuthError::MalformedJwt`], [`NatsAuthError::BadSignature`] or [`NatsAuthError::NotAnAccountJwt`]).
/// That the issuer is trusted is *not* checked here, and the server does not refuse it either: nats-server
/// 2.15 stores an account JWT signed by an unknown operator in its resolver directory and replies 200, then fails
/// to apply it (logging "account validation failed"). Push only JWTs an [`AuthMaterial`] signed, e.g.
/// [`AuthMaterial::app_account_jwt_with_revocations`]. A push replaces the stored JWT whatever its `iat` (last
/// writer wins); at a restart, a preloaded JWT replaces a stored one unless the stored one has a later `iat`.
pub async fn push_account_jwt(sys_client: &async_nats::Client, jwt: &str) -> Result<(), NatsAuthError> {
    let claims = jwt::decode(jwt)?;
    let nats_type = claims.pointer("/nats/type").and_then(serde_json::Value::as_str);
    if nats_type != Some("account") {
        return Err(NatsAuthError::NotAnAccountJwt("nats.type is not \"account\""));
    }
    let subject = claims
        .get("sub")
        .and_then(serde_json::Value::as_str)
        .unwrap_or_default();
    if !subject.starts_with('A') || KeyPair::from_public_key(subject).is_err() {
        return Err(NatsAuthError::NotAnAccountJwt("sub is not an account public key"));
    }
    let reply = sys_client
        .request("$SYS.REQ.CLAIMS.UPDATE", jwt.to_owned().into())
        .await
        .map_err(|e| NatsAuthError::PushRequest(e.to_string()))?;
    let parsed: ClaimsUpdateReply = serde_json::from_slice(&reply.payload)
        .map_err(|e| NatsAuthError::PushReply(format!("{e}: {}", String::from_utf8_lossy(&reply.payload))))?;
    match (parsed.data, parsed.error) {
        (_, Some(err)) => Err(NatsAuthError::PushRejected {
            code: err.code,
            description: err.description.or(err.message).unwrap_or_default(),
        }),
        (Some(data), None) if data.code == 200 => Ok(()),
        (Some(data), None) => Err(NatsAuthError::PushRejected {
            code: data.code,
            description: data.message.or(data.description).unwrap_or_default(),
        }),
        (None, None) => Err(NatsAuthError::PushReply(
            String::from_utf8_lossy(&reply.payload).into_owned(),
        )),
    }
}
