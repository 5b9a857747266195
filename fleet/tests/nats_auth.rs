//! `fleet::nats_auth` against a real nats-server in operator mode (full resolver, accounts preloaded): key
//! persistence and file modes, every role's creds, refusals (no creds, foreign signer), the FLEET → APP service
//! and stream imports, permission violations, JetStream per account, and revocation pushed through SYS (the
//! open connection is closed, new ones are refused, and the pushed JWT survives a restart over the preload).
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::fs;
use std::net::TcpStream;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::{ConnectErrorKind, ConnectOptions, Event};
use fleet::nats_auth::jwt::{self, UserNats};
use fleet::nats_auth::{AuthMaterial, NatsAuthError, Permissions, push_account_jwt};
use fleet_client::creds::Role;
use fleet_client::creds::format_creds;
use futures::StreamExt as _;
use nkeys::KeyPair;
use tempfile::TempDir;
use tokio::sync::mpsc;

const WAIT: Duration = Duration::from_secs(10);

/// What the APP role may do in these tests: call the API, read events, talk to JetStream's API (so a JetStream
/// failure is the account's, not a permission's), receive replies.
fn app_permissions() -> Permissions {
    Permissions {
        publish_allow: vec!["fleet.v1.api.>".into(), "$JS.API.>".into()],
        subscribe_allow: vec!["_INBOX.>".into(), "fleet.v1.events.>".into()],
        ..Permissions::default()
    }
}

fn permissions(role: Role) -> Permissions {
    match role {
        Role::App => app_permissions(),
        _ => Permissions::all(),
    }
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs()
}

fn mode(path: &Path) -> u32 {
    fs::metadata(path).unwrap().permissions().mode() & 0o7777
}

/// A nats-server child in operator mode, killed on drop.
struct Server {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl Server {
    /// Starts a server with `material`'s operator config, storing under `root`; waits (bounded) until it accepts
    /// TCP connections.
    fn start(root: &Path, material: &AuthMaterial) -> Server {
        let bin = fleet::nats_server::find().expect("nats-server");
        let port = fleet::nats_server::free_port().unwrap();
        let conf = root.join("nats.conf");
        fs::write(
            &conf,
            format!(
                "listen: 127.0.0.1:{port}\njetstream: {{ store_dir: {:?} }}\n{}",
                root.join("js").display().to_string(),
                material.server_config(&root.join("resolver"))
            ),
        )
        .unwrap();
        let log = root.join(format!("nats-{port}.log"));
        let mut args = vec!["-c".to_owned(), conf.display().to_string()];
        if std::env::var_os("NATS_AUTH_TEST_DEBUG").is_some() {
            args.push("-DV".to_owned());
        }
        let child = Command::new(bin)
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut server = Server { child, port, log };
        let deadline = Instant::now() + WAIT;
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Ok(Some(status)) = server.child.try_wait() {
                panic!("nats-server exited with {status}:\n{}", server.log());
            }
            assert!(
                Instant::now() < deadline,
                "nats-server not up after 10 s:\n{}",
                server.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A fresh auth dir and material, and a server trusting it.
fn setup() -> (TempDir, AuthMaterial, Server) {
    let tmp = tempfile::tempdir().unwrap();
    let material = AuthMaterial::load_or_create(&tmp.path().join("auth"), permissions).unwrap();
    let server = Server::start(tmp.path(), &material);
    (tmp, material, server)
}

async fn connect_role(server: &Server, material: &AuthMaterial, role: Role) -> async_nats::Client {
    ConnectOptions::with_credentials_file(material.creds_path(role))
        .await
        .unwrap()
        .name(role.as_str())
        .connection_timeout(Duration::from_secs(5))
        .connect(server.url())
        .await
        .unwrap_or_else(|e| panic!("{role} connect: {e}\n{}", server.log()))
}

/// Connects with creds text, sending every connection event to the returned channel.
async fn connect_with_events(
    url: &str,
    creds: &str,
) -> Result<(async_nats::Client, mpsc::UnboundedReceiver<Event>), async_nats::ConnectError> {
    let (tx, rx) = mpsc::unbounded_channel();
    let client = ConnectOptions::new()
        .credentials(creds)
        .unwrap()
        .connection_timeout(Duration::from_secs(5))
        .event_callback(move |event| {
            let tx = tx.clone();
            async move {
                let _ = tx.send(event);
            }
        })
        .connect(url)
        .await?;
    Ok((client, rx))
}

/// Waits (bounded) for an event `pred` accepts; returns it.
async fn wait_for_event(rx: &mut mpsc::UnboundedReceiver<Event>, pred: impl Fn(&Event) -> bool) -> Event {
    tokio::time::timeout(WAIT, async {
        loop {
            let event = rx.recv().await.expect("event channel closed");
            if pred(&event) {
                return event;
            }
        }
    })
    .await
    .expect("no such event within 10 s")
}

fn assert_refused(result: Result<async_nats::Client, async_nats::ConnectError>, what: &str) {
    match result {
        Ok(_) => panic!("{what}: connected"),
        Err(e) => assert_eq!(
            e.kind(),
            ConnectErrorKind::AuthorizationViolation,
            "{what}: {e:?}"
        ),
    }
}

async fn connect_creds_text(url: &str, creds: &str) -> Result<async_nats::Client, async_nats::ConnectError> {
    ConnectOptions::new()
        .credentials(creds)
        .unwrap()
        .connection_timeout(Duration::from_secs(5))
        .connect(url)
        .await
}

#[test]
fn load_or_create_twice_reuses_the_keys_and_keeps_everything_private() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("auth");
    let first = AuthMaterial::load_or_create(&dir, permissions).unwrap();
    let creds_before: Vec<String> = Role::ALL
        .iter()
        .map(|r| fs::read_to_string(first.creds_path(*r)).unwrap())
        .collect();

    let second = AuthMaterial::load_or_create(&dir, permissions).unwrap();
    assert_eq!(first.operator_public_key(), second.operator_public_key());
    assert_eq!(first.sys_account_public_key(), second.sys_account_public_key());
    assert_eq!(
        first.fleet_account_public_key(),
        second.fleet_account_public_key()
    );
    assert_eq!(first.app_account_public_key(), second.app_account_public_key());
    for role in Role::ALL {
        assert_eq!(
            first.user_public_key(role),
            second.user_public_key(role),
            "{role}"
        );
    }
    // Nothing changed, so nothing was re-signed: the preload baseline keeps its iat.
    assert_eq!(first.operator_jwt(), second.operator_jwt());
    assert_eq!(first.app_account_jwt(), second.app_account_jwt());
    assert_eq!(first.fleet_account_jwt(), second.fleet_account_jwt());
    for (role, before) in Role::ALL.iter().zip(&creds_before) {
        assert_eq!(
            &fs::read_to_string(second.creds_path(*role)).unwrap(),
            before,
            "{role}"
        );
    }

    assert_eq!(mode(&dir), 0o700);
    let mut names: Vec<String> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "app.creds",
            "exec.pub",
            "exec.seed",
            "front.creds",
            "jwts.json",
            "operator.creds",
            "seeds.json",
            "sys.creds",
            "worker.creds"
        ]
    );
    for name in &names {
        assert_eq!(mode(&dir.join(name)), 0o600, "{name}");
    }

    // New permissions for a role: its creds follow the code, its user key stays.
    let third = AuthMaterial::load_or_create(&dir, |role| match role {
        Role::Worker => Permissions {
            publish_allow: vec!["fleet.v1.worker.>".into()],
            ..Permissions::all()
        },
        other => permissions(other),
    })
    .unwrap();
    assert_eq!(
        third.user_public_key(Role::Worker),
        first.user_public_key(Role::Worker)
    );
    let worker = fs::read_to_string(third.creds_path(Role::Worker)).unwrap();
    assert_ne!(worker, creds_before[1]);
    let claims = jwt::decode(fleet_client::creds::creds_jwt(&worker).unwrap()).unwrap();
    assert_eq!(claims["nats"]["pub"]["allow"][0], "fleet.v1.worker.>");
    assert_eq!(mode(&third.creds_path(Role::Worker)), 0o600);
    assert_eq!(
        fs::read_to_string(third.creds_path(Role::Front)).unwrap(),
        creds_before[0]
    );

    // An existing, too-open directory and file are tightened.
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
    fs::set_permissions(dir.join("seeds.json"), fs::Permissions::from_mode(0o644)).unwrap();
    AuthMaterial::load_or_create(&dir, permissions).unwrap();
    assert_eq!(mode(&dir), 0o700);
    assert_eq!(mode(&dir.join("seeds.json")), 0o600);
}

#[test]
fn app_user_names_are_validated() {
    let tmp = tempfile::tempdir().unwrap();
    let material = AuthMaterial::load_or_create(tmp.path(), permissions).unwrap();
    for bad in ["", "has space", "dot.ted", "star*", "é", &"x".repeat(65)] {
        assert!(
            matches!(
                material.issue_app_user(bad, &app_permissions()),
                Err(NatsAuthError::InvalidUserName(_))
            ),
            "{bad:?}"
        );
    }
    let ok = material
        .issue_app_user(&"A-z_09".repeat(10), &app_permissions())
        .unwrap();
    assert!(ok.public_key.starts_with('U'));
}

#[tokio::test]
async fn every_role_connects_and_strangers_are_refused() {
    let (_tmp, material, server) = setup();
    for role in Role::ALL {
        let client = connect_role(&server, &material, role).await;
        fleet_client::nats_conn::round_trip(&client).await.unwrap();
    }

    // No credentials.
    assert_refused(
        ConnectOptions::new()
            .connection_timeout(Duration::from_secs(5))
            .connect(server.url())
            .await,
        "no credentials",
    );

    // A user claiming the APP account, signed by a key that is not one of its signing keys.
    let intruder = KeyPair::new_account();
    let user = KeyPair::new_user();
    let token = jwt::encode(
        &intruder,
        &user.public_key(),
        "intruder",
        now(),
        None,
        UserNats::new(&Permissions::all(), Some(material.app_account_public_key())),
    )
    .unwrap();
    assert_refused(
        connect_creds_text(&server.url(), &format_creds(&token, &user.seed().unwrap())).await,
        "user signed by a foreign key claiming APP",
    );

    // A user of an account the operator never signed.
    let token = jwt::encode(
        &intruder,
        &user.public_key(),
        "intruder",
        now(),
        None,
        UserNats::new(&Permissions::all(), None),
    )
    .unwrap();
    assert_refused(
        connect_creds_text(&server.url(), &format_creds(&token, &user.seed().unwrap())).await,
        "user of an unknown account",
    );

    // A valid JWT presented with another user's seed (fails the nonce signature).
    let app_creds = fs::read_to_string(material.creds_path(Role::App)).unwrap();
    let app_jwt = fleet_client::creds::creds_jwt(&app_creds).unwrap();
    assert_refused(
        connect_creds_text(&server.url(), &format_creds(app_jwt, &user.seed().unwrap())).await,
        "JWT with the wrong seed",
    );
}

#[tokio::test]
async fn app_requests_reach_a_fleet_service_and_permissions_are_enforced() {
    let (_tmp, material, server) = setup();
    let front = connect_role(&server, &material, Role::Front).await;
    let mut requests = front.subscribe("fleet.v1.api.tools.echo").await.unwrap();
    fleet_client::nats_conn::round_trip(&front).await.unwrap();
    let responder = front.clone();
    let serving = tokio::spawn(async move {
        while let Some(msg) = requests.next().await {
            if let Some(reply) = msg.reply {
                responder.publish(reply, msg.payload).await.unwrap();
                responder.flush().await.unwrap();
            }
        }
    });

    let app_creds = fs::read_to_string(material.creds_path(Role::App)).unwrap();
    let (app, mut events) = connect_with_events(&server.url(), &app_creds).await.unwrap();
    let reply = tokio::time::timeout(WAIT, app.request("fleet.v1.api.tools.echo", "ping".into()))
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("request through the import: {e}\n{}", server.log()));
    assert_eq!(&reply.payload[..], b"ping");

    // An issued app user, too.
    let issued = material.issue_app_user("tenant-1", &app_permissions()).unwrap();
    let tenant = connect_creds_text(&server.url(), &issued.creds).await.unwrap();
    let reply = tokio::time::timeout(WAIT, tenant.request("fleet.v1.api.tools.echo", "pong".into()))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&reply.payload[..], b"pong");

    // Outside the allow list.
    app.publish("fleet.v1.internal.secret", "x".into()).await.unwrap();
    fleet_client::nats_conn::round_trip(&app).await.unwrap();
    let event = wait_for_event(&mut events, |e| matches!(e, Event::ServerError(_))).await;
    let Event::ServerError(err) = event else {
        unreachable!()
    };
    assert!(err.to_string().contains("Permissions Violation"), "{err}");
    assert!(err.to_string().contains("fleet.v1.internal.secret"), "{err}");

    serving.abort();
}

#[tokio::test]
async fn fleet_events_reach_app_subscribers_through_the_stream_import() {
    let (_tmp, material, server) = setup();
    let app = connect_role(&server, &material, Role::App).await;
    let mut events = app.subscribe("fleet.v1.events.>").await.unwrap();
    fleet_client::nats_conn::round_trip(&app).await.unwrap();

    let front = connect_role(&server, &material, Role::Front).await;
    front.publish("fleet.v1.events.x", "hello".into()).await.unwrap();
    fleet_client::nats_conn::round_trip(&front).await.unwrap();

    let msg = tokio::time::timeout(WAIT, events.next()).await.unwrap().unwrap();
    assert_eq!(msg.subject.as_str(), "fleet.v1.events.x");
    assert_eq!(&msg.payload[..], b"hello");
}

/// `nats_conn::round_trip` is the barrier between subscribing and what the subscription waits for: once it
/// returned, a message another connection publishes is delivered — and once that connection's own round trip
/// returned and the subscriber's after it, the message is already in the subscription (no wait at all). For every
/// role, an app too (a PING needs no permission). Without its server, a round trip fails.
#[tokio::test]
async fn a_round_trip_puts_a_subscription_in_place_for_every_other_connection() {
    use futures::FutureExt as _;
    let (_tmp, material, server) = setup();
    let front = connect_role(&server, &material, Role::Front).await;
    let app = connect_role(&server, &material, Role::App).await;
    for i in 0..200 {
        let subject = format!("fleet.v1.events.rt{i}");
        let mut events = app.subscribe(subject.clone()).await.unwrap();
        fleet_client::nats_conn::round_trip(&app).await.unwrap();
        front.publish(subject, "x".into()).await.unwrap();
        fleet_client::nats_conn::round_trip(&front).await.unwrap();
        fleet_client::nats_conn::round_trip(&app).await.unwrap();
        let msg = events
            .next()
            .now_or_never()
            .unwrap_or_else(|| panic!("round {i}: the message is not in the subscription"))
            .expect("the subscription is open");
        assert_eq!(&msg.payload[..], b"x");
    }
    // The server gone, the PING is never answered: the round trip fails (the connection's loss, or
    // `FLUSH_TIMEOUT`), it does not hang.
    drop(server);
    assert!(fleet_client::nats_conn::round_trip(&app).await.is_err());
}

#[tokio::test]
async fn jetstream_is_on_for_fleet_and_off_for_app() {
    let (_tmp, material, server) = setup();
    let front = connect_role(&server, &material, Role::Front).await;
    let js = async_nats::jetstream::new(front);
    let kv = js
        .create_key_value(async_nats::jetstream::kv::Config {
            bucket: "jobs".into(),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("FLEET KV: {e}\n{}", server.log()));
    kv.put("k", "v".into()).await.unwrap();
    assert_eq!(&kv.get("k").await.unwrap().unwrap()[..], b"v");

    let app = connect_role(&server, &material, Role::App).await;
    let js = async_nats::jetstream::new(app);
    let account = js.query_account().await;
    let err = account.expect_err("APP has JetStream");
    assert!(err.to_string().to_lowercase().contains("not enabled"), "{err}");
    let kv = js.get_key_value("jobs").await;
    assert!(kv.is_err(), "APP sees FLEET's bucket");
}

#[tokio::test]
async fn a_revoked_app_user_is_disconnected_and_refused_even_after_a_restart() {
    let (tmp, material, server) = setup();
    let issued = material.issue_app_user("tenant-7", &app_permissions()).unwrap();
    let keeper = material.issue_app_user("tenant-8", &app_permissions()).unwrap();
    let (victim, mut victim_events) = connect_with_events(&server.url(), &issued.creds).await.unwrap();
    fleet_client::nats_conn::round_trip(&victim).await.unwrap();
    let bystander = connect_creds_text(&server.url(), &keeper.creds).await.unwrap();

    let sys = connect_role(&server, &material, Role::Sys).await;

    // What is not a signed account JWT is refused before it is sent; what the server finds invalid is refused
    // by the server.
    let app_creds = fs::read_to_string(material.creds_path(Role::App)).unwrap();
    let user_jwt = fleet_client::creds::creds_jwt(&app_creds).unwrap();
    let local = push_account_jwt(&sys, user_jwt).await;
    assert!(
        matches!(local, Err(NatsAuthError::NotAnAccountJwt(_))),
        "{local:?}"
    );
    let local = push_account_jwt(&sys, "not.a.jwt").await;
    assert!(matches!(local, Err(NatsAuthError::MalformedJwt(_))), "{local:?}");
    let mut invalid = jwt::AccountNats::new(
        jwt::AccountLimits::unlimited_without_jetstream(),
        vec![],
        vec![],
        vec![],
    );
    invalid.imports.push(jwt::Import {
        name: "bad".into(),
        subject: "fleet..api".into(),
        account: material.fleet_account_public_key(),
        kind: jwt::ExportKind::Service,
    });
    let invalid = jwt::encode(
        &KeyPair::new_operator(),
        &material.app_account_public_key(),
        "APP",
        now(),
        None,
        invalid,
    )
    .unwrap();
    let refused = push_account_jwt(&sys, &invalid).await;
    assert!(
        matches!(refused, Err(NatsAuthError::PushRejected { .. })),
        "{refused:?}"
    );

    let revoked = BTreeMap::from([(issued.public_key.clone(), now())]);
    let update = material.app_account_jwt_with_revocations(&revoked).unwrap();
    push_account_jwt(&sys, &update)
        .await
        .unwrap_or_else(|e| panic!("push: {e}\n{}", server.log()));

    // The server closes the revoked user's connection ...
    let revoked_error = wait_for_event(&mut victim_events, |e| matches!(e, Event::ServerError(_))).await;
    assert!(
        revoked_error.to_string().contains("User Authentication Revoked"),
        "{revoked_error}"
    );
    wait_for_event(&mut victim_events, |e| matches!(e, Event::Disconnected)).await;
    // ... refuses it from now on ...
    assert_refused(
        connect_creds_text(&server.url(), &issued.creds).await,
        "revoked user",
    );
    // ... and leaves the others alone.
    fleet_client::nats_conn::round_trip(&bystander).await.unwrap();
    fleet_client::nats_conn::round_trip(&connect_role(&server, &material, Role::App).await)
        .await
        .unwrap();

    // The full resolver stored the pushed JWT; on a restart the older preload does not replace it.
    let stored = tmp
        .path()
        .join("resolver")
        .join(format!("{}.jwt", material.app_account_public_key()));
    assert_eq!(fs::read_to_string(&stored).unwrap().trim(), update);
    drop((victim, bystander, sys));
    drop(server);
    let server = Server::start(tmp.path(), &material);
    assert_refused(
        connect_creds_text(&server.url(), &issued.creds).await,
        "revoked user after a restart",
    );
    fleet_client::nats_conn::round_trip(&connect_creds_text(&server.url(), &keeper.creds).await.unwrap())
        .await
        .unwrap();
    assert_eq!(fs::read_to_string(&stored).unwrap().trim(), update);
}

/// Whether a worker may answer apps directly is read from its own credentials: the table's worker user may
/// publish on the imported requests' reply subjects (`_R_.>`), an app may not, a worker credential issued before
/// that grant (or with it denied) may not — such a worker answers through the front — and `>` allows it.
#[test]
fn a_workers_credentials_say_whether_it_may_answer_apps_directly() {
    use fleet::nats_auth::permissions::{DEFAULT_PREFIX, IMPORTED_REPLIES, for_role};
    use fleet_client::creds::creds_publish_allows;
    let tmp = TempDir::new().unwrap();
    let read = |m: &AuthMaterial, role: Role| fs::read_to_string(m.creds_path(role)).unwrap();
    let table =
        AuthMaterial::load_or_create(&tmp.path().join("table"), |r| for_role(r, DEFAULT_PREFIX)).unwrap();
    assert!(creds_publish_allows(
        &read(&table, Role::Worker),
        IMPORTED_REPLIES
    ));
    assert!(!creds_publish_allows(&read(&table, Role::App), IMPORTED_REPLIES));
    let older = |deny: Vec<String>| {
        move |role: Role| match role {
            Role::Worker => {
                let mut p = for_role(role, DEFAULT_PREFIX);
                p.publish_allow.retain(|s| s != IMPORTED_REPLIES);
                p.publish_deny.extend(deny.clone());
                p
            }
            other => for_role(other, DEFAULT_PREFIX),
        }
    };
    let before = AuthMaterial::load_or_create(&tmp.path().join("before"), older(Vec::new())).unwrap();
    assert!(!creds_publish_allows(
        &read(&before, Role::Worker),
        IMPORTED_REPLIES
    ));
    let denied = AuthMaterial::load_or_create(&tmp.path().join("denied"), |role| {
        let mut p = Permissions::all();
        if role == Role::Worker {
            p.publish_deny.push(IMPORTED_REPLIES.to_owned());
        }
        p
    })
    .unwrap();
    assert!(!creds_publish_allows(
        &read(&denied, Role::Worker),
        IMPORTED_REPLIES
    ));
    assert!(creds_publish_allows(
        &read(&denied, Role::Front),
        IMPORTED_REPLIES
    ));
    assert!(!creds_publish_allows("not a creds file", IMPORTED_REPLIES));
}
