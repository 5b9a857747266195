//! `fleet nats-auth init --dir DIR [--resolver-dir PATH]`: the auth material of a fleet whose nats-server is not
//! `fleet up`'s own (a Helm install, an operator-run cluster). Creates the keys once (reused at every later run),
//! writes each role's `.creds`, the exec seal key (`exec.seed`, `exec.pub`) and `server-auth.conf`, the
//! operator-mode fragment to `include` in the server's configuration (see `deploy/nats/`).

use std::path::PathBuf;

use serde_json::{Value, json};

use fleet_client::creds::Role;

use super::{AuthMaterial, NatsAuthError, permissions};

/// The server configuration fragment `init` writes.
pub const SERVER_AUTH_CONF: &str = "server-auth.conf";

/// The resolver directory `init` puts in the fragment by default (the nats Helm chart's resolver volume).
pub const DEFAULT_RESOLVER_DIR: &str = "/data/resolver";

/// `fleet nats-auth …`.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum NatsAuthCmd {
    /// Create (or reuse) the material in DIR: seeds.json, jwts.json, <role>.creds, server-auth.conf, exec.seed,
    /// exec.pub.
    Init {
        /// The directory (created 0700; every file 0600).
        #[arg(long)]
        dir: PathBuf,
        /// The server's resolver directory, as written in server-auth.conf.
        #[arg(long, default_value = DEFAULT_RESOLVER_DIR)]
        resolver_dir: PathBuf,
    },
}

/// Runs a `fleet nats-auth` command; returns what to print (paths and public keys, never a seed).
pub fn run(cmd: &NatsAuthCmd) -> Result<Value, NatsAuthError> {
    match cmd {
        NatsAuthCmd::Init { dir, resolver_dir } => {
            let material = AuthMaterial::load_or_create(dir, permissions::default_for_role)?;
            let conf = dir.join(SERVER_AUTH_CONF);
            super::creds::write_private_atomic(&conf, material.server_config(resolver_dir).as_bytes())?;
            let creds: serde_json::Map<String, Value> = Role::ALL
                .iter()
                .map(|r| {
                    (
                        r.as_str().to_owned(),
                        json!(material.creds_path(*r).display().to_string()),
                    )
                })
                .collect();
            Ok(json!({
                "dir": dir.display().to_string(),
                "server_config": conf.display().to_string(),
                "operator": material.operator_public_key(),
                "accounts": {
                    "SYS": material.sys_account_public_key(),
                    "FLEET": material.fleet_account_public_key(),
                    "APP": material.app_account_public_key(),
                },
                "creds": creds,
                "exec_seal": {
                    "seed": dir.join(super::exec_seal::EXEC_SEED_FILE).display().to_string(),
                    "public_keys": dir.join(super::exec_seal::EXEC_PUB_FILE).display().to_string(),
                },
            }))
        }
    }
}
