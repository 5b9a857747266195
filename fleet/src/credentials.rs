//! Per-user plugin credentials, the operator side (spec §4.2): the operator API
//! `fleet.v1.admin.credentials.{set,list,delete,rewrap}` (operator tokens only; wire types in
//! `proto::admin::credentials`) over the sealed bucket of `fleet_services::credentials`, and `fleet credentials`.
//!
//! Values go in and never come back out: answers name credentials and scopes only, and a refused request's
//! error names no value (arguments that do not parse are refused by position, not by content).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use fleet_client::auth::OperatorVerifier;
use fleet_proto::admin::ADMIN_QUEUE_GROUP;
use fleet_proto::admin::credentials::{self as wire, AREA, DELETE, LIST, REWRAP, SET};
use fleet_proto::api::{ApiError, ApiErrorCode};
use fleet_services::credentials::{CredentialStore, KEYRING_FILE, rotate_key_file};
use fleet_services::oauth::accounts::AccountStore;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use crate::client_cmd::{OperatorConn, printable};
use crate::operator;

/// Serves `fleet.v1.admin.credentials.*` (queue group: any front answers) until the client closes.
pub async fn serve_admin(
    client: async_nats::Client,
    store: CredentialStore,
    accounts: AccountStore,
    verifier: OperatorVerifier,
) -> Result<tokio::task::JoinHandle<()>, async_nats::Error> {
    operator::serve(
        client,
        AREA,
        ADMIN_QUEUE_GROUP.to_owned(),
        verifier,
        "credentials are operator actions",
        move |method, payload| {
            let (store, accounts) = (store.clone(), accounts.clone());
            async move { admin_call(&store, &accounts, &method, &payload).await }
        },
    )
    .await
}

/// The arguments, or `invalid_arg` naming where they stop parsing — never what is there (it may be a value).
fn parse<T: DeserializeOwned>(payload: &[u8]) -> Result<T, ApiError> {
    let payload = if payload.iter().all(u8::is_ascii_whitespace) {
        b"{}".as_slice()
    } else {
        payload
    };
    serde_json::from_slice(payload).map_err(|e| {
        ApiError::new(
            ApiErrorCode::InvalidArg,
            format!(
                "bad arguments at line {} column {}: expected {{user, tool_id?, values: {{NAME: string}}}} \
                 for set, {{user, tool_id?}} for list, {{user, tool_id?, names: [NAME]}} for delete",
                e.line(),
                e.column()
            ),
        )
    })
}

fn to_value(answer: &impl serde::Serialize) -> Value {
    serde_json::to_value(answer).unwrap_or(Value::Null)
}

async fn admin_call(
    store: &CredentialStore,
    accounts: &AccountStore,
    method: &str,
    payload: &[u8],
) -> Result<Value, ApiError> {
    let api = |e: fleet_services::credentials::CredentialError| e.to_api_error();
    match method {
        SET => {
            let a: wire::SetArgs = parse(payload)?;
            let listed = store
                .set(&a.user, a.tool_id.as_deref(), &a.values)
                .await
                .map_err(api)?;
            Ok(to_value(&listed))
        }
        LIST => {
            let a: wire::ListArgs = parse(payload)?;
            Ok(to_value(
                &store.list(&a.user, a.tool_id.as_deref()).await.map_err(api)?,
            ))
        }
        DELETE => {
            let a: wire::DeleteArgs = parse(payload)?;
            Ok(to_value(
                &store
                    .delete(&a.user, a.tool_id.as_deref(), &a.names)
                    .await
                    .map_err(api)?,
            ))
        }
        REWRAP => {
            // Both sealed buckets: the stored values and the OAuth accounts.
            let mut done = store.rewrap().await.map_err(api)?;
            let (records, rewrapped) = accounts.rewrap().await.map_err(api)?;
            done.records += records;
            done.rewrapped += rewrapped;
            Ok(to_value(&done))
        }
        other => Err(ApiError::new(
            ApiErrorCode::NotFound,
            format!("no operator method credentials.{other}"),
        )),
    }
}

/// `fleet credentials …` (this exact interface).
#[derive(Debug, Clone, clap::Subcommand)]
pub enum CredentialsCmd {
    /// Store credentials for a user, user-wide or (`--tool-id`) for one plugin. Each `NAME=VALUE`; `NAME=@FILE`
    /// takes the value from a file (one trailing newline dropped) and `NAME=@-` from stdin, so a secret need not
    /// appear in the shell history or the process list. Values are never printed back.
    Set {
        /// The user.
        #[arg(long)]
        user: String,
        /// The plugin (absent: every plugin of the user that declares the name).
        #[arg(long)]
        tool_id: Option<String>,
        /// `NAME=VALUE`, `NAME=@FILE` or `NAME=@-` (stdin).
        #[arg(required = true, value_name = "NAME=VALUE")]
        values: Vec<String>,
        /// `--nats-url`, `--data-dir`, `--token`.
        #[command(flatten)]
        conn: OperatorConn,
    },
    /// List a user's credentials: names, scopes and when each was set — never values. With `--tool-id`, those
    /// an invoke of that plugin could receive (its own and the user-wide ones).
    List {
        /// The user.
        #[arg(long)]
        user: String,
        /// The plugin.
        #[arg(long)]
        tool_id: Option<String>,
        /// `--nats-url`, `--data-dir`, `--token`.
        #[command(flatten)]
        conn: OperatorConn,
    },
    /// Delete credentials from one scope (the plugin's with `--tool-id`, else the user-wide one).
    Delete {
        /// The user.
        #[arg(long)]
        user: String,
        /// The plugin.
        #[arg(long)]
        tool_id: Option<String>,
        /// The names.
        #[arg(required = true, value_name = "NAME")]
        names: Vec<String>,
        /// `--nats-url`, `--data-dir`, `--token`.
        #[command(flatten)]
        conn: OperatorConn,
    },
    /// Prepend a new key to the credentials keyring file (local: no fleet call). New and changed records are
    /// wrapped with it as soon as each process sees the file change; old keys still unwrap. Then run `rewrap`.
    RotateKey {
        /// The keyring (default: `<data-dir>/credentials.keys`, as `fleet up` uses it).
        #[arg(long, env = "FLEET_CREDENTIALS_KEY_FILE")]
        credentials_key_file: Option<PathBuf>,
        /// The data directory of `fleet up`.
        #[arg(long, env = "FLEET_DATA_DIR", default_value = fleet_client::api::DEFAULT_DATA_DIR)]
        data_dir: PathBuf,
    },
    /// Wrap every user's record under the keyring's first key (after `rotate-key` reached every process);
    /// afterwards the old keys can be removed from the file.
    Rewrap {
        /// `--nats-url`, `--data-dir`, `--token`.
        #[command(flatten)]
        conn: OperatorConn,
    },
}

/// Why a `NAME=VALUE` argument was refused (never with the value).
fn bad_value(arg_name: &str, why: &str) -> ApiError {
    ApiError::new(ApiErrorCode::InvalidArg, format!("{arg_name}: {why}"))
}

/// Parses `NAME=VALUE`, `NAME=@FILE`, `NAME=@-` arguments; `stdin` is read at most once.
fn read_values(args: &[String], mut stdin: impl std::io::Read) -> Result<BTreeMap<String, String>, ApiError> {
    let mut out = BTreeMap::new();
    let mut stdin_used = false;
    for arg in args {
        let Some((name, value)) = arg.split_once('=') else {
            // The argument may be a value typed without its name: never echoed.
            return Err(bad_value(
                "an argument",
                "expected NAME=VALUE, NAME=@FILE or NAME=@- (the argument is not shown)",
            ));
        };
        let value = match value.strip_prefix('@') {
            None => value.to_owned(),
            Some("-") => {
                if stdin_used {
                    return Err(bad_value(name, "only one value can come from stdin"));
                }
                stdin_used = true;
                let mut text = String::new();
                stdin
                    .read_to_string(&mut text)
                    .map_err(|e| bad_value(name, &format!("cannot read stdin: {e}")))?;
                strip_newline(text)
            }
            Some(path) => strip_newline(read_file(name, Path::new(path))?),
        };
        if out.insert(name.to_owned(), value).is_some() {
            return Err(bad_value(name, "given twice"));
        }
    }
    Ok(out)
}

fn read_file(name: &str, path: &Path) -> Result<String, ApiError> {
    std::fs::read_to_string(path).map_err(|e| bad_value(name, &format!("{}: {e}", path.display())))
}

fn strip_newline(mut text: String) -> String {
    if text.ends_with('\n') {
        text.pop();
        if text.ends_with('\r') {
            text.pop();
        }
    }
    text
}

/// Runs a `fleet credentials` command and returns what to print.
pub async fn run(cmd: &CredentialsCmd) -> Result<Value, ApiError> {
    let wait = Duration::from_secs(15);
    match cmd {
        CredentialsCmd::Set {
            user,
            tool_id,
            values,
            conn,
        } => {
            let args = wire::SetArgs {
                user: user.clone(),
                tool_id: tool_id.clone(),
                values: read_values(values, std::io::stdin().lock())?,
            };
            printable(conn.client().await?.credentials_set(&args, wait).await?)
        }
        CredentialsCmd::List { user, tool_id, conn } => {
            let args = wire::ListArgs {
                user: user.clone(),
                tool_id: tool_id.clone(),
            };
            printable(conn.client().await?.credentials_list(&args, wait).await?)
        }
        CredentialsCmd::Delete {
            user,
            tool_id,
            names,
            conn,
        } => {
            let args = wire::DeleteArgs {
                user: user.clone(),
                tool_id: tool_id.clone(),
                names: names.clone(),
            };
            printable(conn.client().await?.credentials_delete(&args, wait).await?)
        }
        CredentialsCmd::RotateKey {
            credentials_key_file,
            data_dir,
        } => {
            let path = credentials_key_file
                .clone()
                .unwrap_or_else(|| data_dir.join(KEYRING_FILE));
            let kid = rotate_key_file(&path)
                .map_err(|e| ApiError::new(ApiErrorCode::InternalError, e.to_string()))?;
            Ok(json!({ "key_id": kid, "keyring": path.display().to_string() }))
        }
        CredentialsCmd::Rewrap { conn } => printable(conn.client().await?.credentials_rewrap(wait).await?),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn values_come_from_arguments_files_and_stdin_and_errors_never_show_them() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("key");
        std::fs::write(&file, "from-file\n").unwrap();
        let args = [
            "A=plain".to_owned(),
            format!("B=@{}", file.display()),
            "C=@-".to_owned(),
            "D=x=y".to_owned(),
        ];
        let values = read_values(&args, "from-stdin\r\n".as_bytes()).unwrap();
        assert_eq!(values["A"], "plain");
        assert_eq!(values["B"], "from-file");
        assert_eq!(values["C"], "from-stdin");
        assert_eq!(values["D"], "x=y");

        let e = read_values(&["sk-typed-without-name".to_owned()], &b""[..]).unwrap_err();
        assert_eq!(e.code, ApiErrorCode::InvalidArg);
        assert!(!e.message.contains("sk-typed"), "{}", e.message);
        let twice = read_values(&["A=@-".to_owned(), "B=@-".to_owned()], &b"v"[..]).unwrap_err();
        assert!(twice.message.contains("stdin"), "{}", twice.message);
        let dup = read_values(&["A=secret1".to_owned(), "A=secret2".to_owned()], &b""[..]).unwrap_err();
        assert!(!dup.message.contains("secret"), "{}", dup.message);
    }

    #[test]
    fn unparsable_arguments_are_refused_without_their_content() {
        let e = parse::<wire::SetArgs>(br#"{"user":"u","values":"sk-SECRET"}"#).unwrap_err();
        assert_eq!(e.code, ApiErrorCode::InvalidArg);
        assert!(!e.message.contains("sk-SECRET"), "{}", e.message);
        let e = parse::<wire::SetArgs>(br#"{"user":"u","values":{"A":12345678}}"#).unwrap_err();
        assert!(!e.message.contains("12345678"), "{}", e.message);
    }
}
