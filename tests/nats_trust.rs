//! The NATS trust boundary (issue 13), against real nats-servers in operator mode with the production permission
//! table: refusals (no credentials, foreign credentials, a revoked app credential), what an app user may not
//! touch, what a worker user may not write, app credentials issued and revoked by the operator API, `fleet up`'s
//! credentials generated once and reused, and a hostile plugin dialling NATS itself.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead as _, BufReader};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::ConnectOptions;
use fleet::nats_auth::{AuthMaterial, permissions};
use fleet_client::creds::Role;
use fleet_client::nats_conn::{ConnectError, Connector};
use fleet_e2e::cluster::{Cluster, connect};
use fleet_e2e::worker::Plugin;
use fleet_e2e::{fleet_bin, workspace_root};
use fleet_proto::api::{methods, subjects};
use serde_json::{Value, json};
use tokio::sync::mpsc;

/// Failure guard of every wait (never reached when the fleet behaves).
const GUARD: Duration = Duration::from_secs(30);

/// A connection whose events (server errors: permission violations) arrive on the returned channel.
async fn watched(connector: &Connector, name: &str) -> (async_nats::Client, mpsc::UnboundedReceiver<String>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let options = ConnectOptions::new().event_callback(move |event| {
        let tx = tx.clone();
        async move {
            let _ = tx.send(event.to_string());
        }
    });
    let client = connector.connect_with(name, options).await.expect("connect");
    (client, rx)
}

/// Waits for a permission violation naming `subject`.
async fn violation(rx: &mut mpsc::UnboundedReceiver<String>, subject: &str) {
    let deadline = tokio::time::Instant::now() + GUARD;
    loop {
        let event = tokio::time::timeout_at(deadline, rx.recv())
            .await
            .unwrap_or_else(|_| panic!("no permission violation for {subject}"))
            .expect("events");
        if event.contains("Permissions Violation") && event.contains(subject) {
            return;
        }
    }
}

async fn subscribe_refused(
    client: &async_nats::Client,
    rx: &mut mpsc::UnboundedReceiver<String>,
    subject: &str,
) {
    let _sub = client
        .subscribe(subject.to_owned())
        .await
        .expect("subscribe is sent");
    client.flush().await.expect("flush");
    violation(rx, subject).await;
}

async fn publish_refused(
    client: &async_nats::Client,
    rx: &mut mpsc::UnboundedReceiver<String>,
    subject: &str,
) {
    client
        .publish(subject.to_owned(), "x".into())
        .await
        .expect("publish is sent");
    client.flush().await.expect("flush");
    violation(rx, subject).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_wrong_or_missing_credentials_are_refused_in_one_line() {
    let c = Cluster::start("trust-refused", 0, 0, &[]).await;
    let url = c.nats.url();

    let err = Connector::new(&url, None)
        .connect("anon")
        .await
        .expect_err("refused");
    assert!(matches!(err, ConnectError::Refused { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("without credentials") && text.contains("--nats-creds"),
        "{text}"
    );

    // Credentials of another operator: well-formed, not trusted here.
    let foreign = tempfile::tempdir().unwrap();
    let other =
        AuthMaterial::load_or_create(&foreign.path().join("auth"), permissions::default_for_role).unwrap();
    let path = other.creds_path(Role::App);
    let err = Connector::new(&url, Some(path.clone()))
        .connect("foreign")
        .await
        .expect_err("refused");
    assert!(matches!(err, ConnectError::Refused { .. }), "{err:?}");
    assert!(err.to_string().contains(&path.display().to_string()), "{err}");
    assert!(!err.to_string().contains("SU"), "no seed in the message: {err}");

    // A missing file: named, no connection attempt.
    let missing = foreign.path().join("nope.creds");
    let err = Connector::new(&url, Some(missing.clone()))
        .connect("missing")
        .await
        .expect_err("no file");
    assert!(matches!(err, ConnectError::Creds { .. }), "{err:?}");
    assert!(err.to_string().contains(&missing.display().to_string()), "{err}");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn app_credentials_reach_the_api_and_nothing_else() {
    let c = Cluster::start("trust-app", 1, 1, &[Plugin::echo("echo", &[])]).await;
    // Every call of the API suites goes through the app user; here one of each kind.
    c.ok("alice", methods::TOOLS_LIST, json!({})).await;
    let (app, mut rx) = watched(&c.nats.connector(Role::App), "app-probe").await;
    for subject in [
        "$KV.>",
        "$JS.API.>",
        "fleet.v1.worker.>",
        "fleet.v1.admin.>",
        "$SYS.>",
        "_INBOX.front.>",
        "_INBOX.billing.>",
        // Finished jobs' records, results included: the fronts' only.
        subjects::JOBS_FINISHED,
        ">",
    ] {
        subscribe_refused(&app, &mut rx, subject).await;
    }
    let worker_id = c.workers[0].node.as_ref().unwrap().id().to_owned();
    for subject in [
        subjects::worker_exec(&worker_id),
        subjects::worker_cancel(&worker_id),
        "fleet.v1.admin.grants.set".to_owned(),
        subjects::JOBS_FINISHED.to_owned(),
        "$KV.fleet_jobs.x".to_owned(),
        "$JS.API.STREAM.DELETE.KV_fleet_jobs".to_owned(),
    ] {
        publish_refused(&app, &mut rx, &subject).await;
    }
    // No JetStream in the APP account at all.
    let js = async_nats::jetstream::new(app.clone());
    assert!(
        js.query_account().await.is_err(),
        "JetStream is unavailable to apps"
    );
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_credentials_cannot_write_grants_plugins_or_admin_subjects() {
    let c = Cluster::start("trust-worker", 0, 0, &[]).await;
    // The grants bucket, as a front creates it.
    fleet_services::grants::GrantStore::open(
        &async_nats::jetstream::new(c.client.clone()),
        c.store.settings(),
    )
    .await
    .unwrap();
    // The credentials bucket, as a front creates it.
    fleet_services::credentials::CredentialStore::open(
        &async_nats::jetstream::new(c.client.clone()),
        c.store.settings(),
        fleet_services::credentials::Keyring::fixed(&[("k1", [1; 32])]),
    )
    .await
    .unwrap();
    let (worker, mut rx) = watched(&c.nats.connector(Role::Worker), "worker-probe").await;
    for subject in [
        "fleet.v1.admin.grants.set",
        "fleet.v1.admin.plugins.install",
        "$KV.fleet_grants.x",
        "$KV.fleet_plugins.x",
        "$O.fleet_plugin_packages.C.x",
        "$KV.fleet_app_creds.x",
        "$KV.fleet_credentials.x",
        // The OAuth connect flows' single-use states are the fronts' alone.
        "$KV.fleet_oauth_state.x",
        "fleet.v1.admin.credentials.set",
        "$JS.API.STREAM.CREATE.KV_fleet_evil",
        "$JS.API.STREAM.UPDATE.KV_fleet_jobs",
        "$JS.API.STREAM.DELETE.KV_fleet_jobs",
        "fleet.v1.api.tools.invoke",
        "fleet.v1.worker.other.exec",
    ] {
        publish_refused(&worker, &mut rx, subject).await;
    }
    subscribe_refused(&worker, &mut rx, "fleet.v1.api.>").await;
    subscribe_refused(&worker, &mut rx, "_INBOX.front.>").await;
    // It answers apps' sync calls on their reply subjects, but cannot hear any.
    subscribe_refused(&worker, &mut rx, "_R_.>").await;
    // What a worker needs works: a job record write and read, a grant read.
    let js = async_nats::jetstream::new(worker.clone());
    let jobs = js.get_key_value("fleet_jobs").await.expect("jobs bucket");
    jobs.put("trust.probe", "v".into())
        .await
        .expect("a worker writes job records");
    assert_eq!(jobs.get("trust.probe").await.unwrap().unwrap(), "v");
    let grants = js.get_key_value("fleet_grants").await.expect("grants bucket");
    assert!(grants.get("nobody").await.unwrap().is_none());
    // A worker reads the users' sealed credentials (at each invoke) and cannot change them.
    let credentials = js
        .get_key_value("fleet_credentials")
        .await
        .expect("credentials bucket");
    assert!(credentials.get("nobody").await.unwrap().is_none());
    // It writes the users' sealed OAuth accounts (a refresh's new tokens, an account needing re-authorization)
    // and cannot reach the connect flows' states.
    let accounts = js
        .get_key_value("fleet_oauth_accounts")
        .await
        .expect("OAuth accounts bucket");
    accounts
        .put("trust.probe", "v".into())
        .await
        .expect("a worker writes OAuth account records");
    assert!(js.get_key_value("fleet_oauth_state").await.is_err());
    c.shutdown().await;
}

/// Returns once the server has processed everything `client` sent before (its subscriptions are in place): a
/// flush only writes them out, so a message from another connection could overtake them.
async fn registered(client: &async_nats::Client) {
    fleet_client::nats_conn::round_trip(client)
        .await
        .expect("a PING round trip");
}

/// The next message of `sub` (at most [`GUARD`] away; `what` names it in the failure).
async fn arrives(sub: &mut async_nats::Subscriber, what: &str) -> async_nats::Message {
    tokio::time::timeout(GUARD, futures::StreamExt::next(sub))
        .await
        .unwrap_or_else(|_| panic!("failure guard: {what} did not arrive"))
        .expect("the subscription is open")
}

/// Waits until `events` reports the connection (re-)established.
async fn reconnected(events: &mut mpsc::UnboundedReceiver<String>) {
    let deadline = tokio::time::Instant::now() + GUARD;
    loop {
        let event = tokio::time::timeout_at(deadline, events.recv())
            .await
            .expect("no reconnect")
            .expect("events");
        if event == "connected" {
            return;
        }
    }
}

/// The churn issue (a NATS node killed under load): a responder whose connection fails over to another server
/// still answers the requests it took before. NATS's response permission is granted per delivered request by the
/// server that delivered it, so it does not survive the reconnect; the front answers every requester (an app's
/// imported request, an operator's) and a worker the fronts' inboxes explicitly. Here the failover is a reconnect
/// to the same server, which forgets the grant just the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_survive_a_reconnect_of_the_responder() {
    let c = Cluster::start("trust-answer", 0, 0, &[]).await;
    for (asker_role, answerer_role, subject) in [
        (Role::App, Role::Front, "fleet.v1.api.test.reconnect"),
        (Role::Operator, Role::Front, "fleet.v1.admin.test.reconnect"),
        (Role::Front, Role::Worker, "fleet.v1.worker.w-reconnect.exec"),
    ] {
        let asker = c.nats.connector(asker_role).connect("asker").await.unwrap();
        let (answerer, mut events) = watched(&c.nats.connector(answerer_role), "answerer").await;
        reconnected(&mut events).await;
        let mut requests = answerer.subscribe(subject).await.unwrap();
        registered(&answerer).await;
        let ask = tokio::spawn(async move {
            let request = async_nats::Request::new()
                .payload("ping".into())
                .timeout(Some(GUARD));
            asker.send_request(subject, request).await
        });
        let request = arrives(&mut requests, "the request").await;
        answerer.force_reconnect().await.unwrap();
        reconnected(&mut events).await;
        answerer
            .publish(request.reply.expect("a reply subject"), "pong".into())
            .await
            .unwrap();
        answerer.flush().await.unwrap();
        let answer = ask.await.unwrap().unwrap_or_else(|e| {
            panic!("{asker_role:?} got no answer from a {answerer_role:?} that reconnected: {e}")
        });
        assert_eq!(&answer.payload[..], b"pong");
    }
    c.shutdown().await;
}

/// The other side of the same failover: a request whose own connection is re-established while it waits (its
/// answer, sent meanwhile, is gone with the old connection) gives up `RECONNECT_GRACE` after the reconnect, as
/// `RequestError::LostInReconnect`, instead of waiting out its timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_connection_fails_over_gives_up_after_the_grace() {
    let c = Cluster::start("trust-lost", 0, 0, &[]).await;
    let asker = c.nats.connector(Role::Front).connect("asker").await.unwrap();
    let worker = c.nats.connector(Role::Worker).connect("silent").await.unwrap();
    let subject = "fleet.v1.worker.w-silent.exec";
    let mut requests = worker.subscribe(subject).await.unwrap();
    registered(&worker).await;
    let waiting = asker.clone();
    let ask = tokio::spawn(async move {
        // A timeout far beyond the test's guard: only the reconnect can end the wait in time.
        let request = async_nats::Request::new()
            .payload("ping".into())
            .timeout(Some(GUARD * 10));
        fleet_client::nats_conn::request(&waiting, subject.to_owned(), request).await
    });
    let _unanswered = arrives(&mut requests, "the request").await;
    asker.force_reconnect().await.unwrap();
    let outcome = tokio::time::timeout(GUARD, ask)
        .await
        .expect("the request gives up after the reconnect")
        .unwrap();
    assert!(
        matches!(
            outcome,
            Err(fleet_client::nats_conn::RequestError::LostInReconnect)
        ),
        "{outcome:?}"
    );
    c.shutdown().await;
}

/// The churn issue: a request, or its answer, lost inside the cluster (a NATS server killed with it in its
/// buffers) while neither end's connection fails. A requester that asked for keepalives gives it up once it has
/// heard nothing for `KEEPALIVE_SILENCE` (`RequestError::Silent`), not at its timeout; a responder that keeps
/// alive is waited for as long as its call runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_lost_in_the_cluster_is_given_up_after_the_keepalive_silence() {
    use fleet_client::nats_conn::{RequestError, Requester, keeping_alive};
    use fleet_proto::api::subjects::KEEPALIVE_SILENCE;
    let c = Cluster::start("trust-keepalive", 0, 0, &[]).await;
    let front = c.nats.connector(Role::Front).connect("asker").await.unwrap();
    let worker = c.nats.connector(Role::Worker).connect("responder").await.unwrap();
    let mut requests = worker.subscribe("fleet.v1.worker.w-ka.exec").await.unwrap();
    registered(&worker).await;
    let requester = Requester::new(&front).await.unwrap();

    // Lost: the request arrives and nothing ever comes back. The timeout is far beyond the guard: only the
    // silence rule can end the wait in time.
    let asking = requester.clone();
    let ask = tokio::spawn(async move {
        let sent = Instant::now();
        let outcome = asking
            .request(
                "fleet.v1.worker.w-ka.exec".into(),
                async_nats::HeaderMap::new(),
                "ping".into(),
                GUARD * 10,
            )
            .await;
        (outcome, sent.elapsed())
    });
    let lost = arrives(&mut requests, "the request").await;
    assert!(
        lost.headers
            .as_ref()
            .is_some_and(|h| h.get(subjects::KEEPALIVE_HEADER).is_some()),
        "the request asks for keepalives"
    );
    let (outcome, waited) = tokio::time::timeout(GUARD, ask)
        .await
        .expect("the request gives up on the silence")
        .unwrap();
    assert!(matches!(outcome, Err(RequestError::Silent)), "{outcome:?}");
    assert!(
        waited >= KEEPALIVE_SILENCE,
        "given up only after the silence: {waited:?}"
    );

    // Kept alive: the call runs for twice the silence (the worker's keepalives reach the front's inbox under
    // the production permissions), and its answer is what the requester gets.
    let asking = requester.clone();
    let ask = tokio::spawn(async move {
        asking
            .request(
                "fleet.v1.worker.w-ka.exec".into(),
                async_nats::HeaderMap::new(),
                "ping".into(),
                GUARD * 10,
            )
            .await
    });
    let msg = arrives(&mut requests, "the request").await;
    let long_call = tokio::time::sleep(KEEPALIVE_SILENCE * 2);
    keeping_alive(&worker, &msg, long_call).await;
    worker
        .publish(msg.reply.clone().unwrap(), "pong".into())
        .await
        .unwrap();
    let answer = tokio::time::timeout(GUARD, ask)
        .await
        .expect("answered")
        .unwrap()
        .unwrap();
    assert_eq!(&answer.payload[..], b"pong");
    c.shutdown().await;
}

/// The churn issue, an app's side: the reply mapping of an app's request (the service import's) lives on the NATS
/// server the app is connected to and dies with it, while the events export reaches the app again once it
/// reconnected. A front's copy of the answer on the request's keepalive subject (`STATUS_ANSWERED`) is then what
/// the app's requester returns — here the responder never answers on the reply subject at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_app_whose_answer_is_lost_takes_the_answer_copy() {
    use fleet_client::nats_conn::{Requester, publish_answer_copy};
    let c = Cluster::start("trust-answer-copy", 0, 0, &[]).await;
    let front = c.nats.connector(Role::Front).connect("responder").await.unwrap();
    let subject = subjects::api(methods::TOOLS_INVOKE_ASYNC);
    let mut requests = front.subscribe(subject.clone()).await.unwrap();
    registered(&front).await;
    let requester = Requester::through_import(&c.app).await.unwrap();
    let ask = tokio::spawn(async move {
        // A timeout far beyond the guard: only the copy can end the wait in time.
        requester
            .request(subject, async_nats::HeaderMap::new(), "{}".into(), GUARD * 10)
            .await
    });
    let msg = arrives(&mut requests, "the request").await;
    assert!(
        msg.reply
            .as_ref()
            .is_some_and(|r| r.as_str().starts_with(subjects::IMPORTED_REPLY_PREFIX)),
        "an app's request crosses the import"
    );
    let answer: &[u8] =
        br#"{"ok":true,"result":{"jobId":"tjob_0123456789abcdef0123456789abcdef","state":"queued","deadlineMs":1}}"#;
    publish_answer_copy(&front, &msg, answer.to_vec().into()).await;
    let got = tokio::time::timeout(GUARD, ask)
        .await
        .expect("the copy ends the wait")
        .unwrap()
        .expect("taken for the answer");
    assert_eq!(&got.payload[..], answer);
    assert_eq!(
        got.headers
            .as_ref()
            .and_then(|h| h.get(subjects::STATUS_HEADER))
            .map(|v| v.as_str().to_owned()),
        Some(subjects::STATUS_ANSWERED.to_owned())
    );
    c.shutdown().await;
}

/// A front copies the answer of an accepted job (`invokeAsync`, success) to the keepalive subject of an app's
/// request, and nothing else: not a sync invoke's answer (it may carry the user's data), not a refused
/// `invokeAsync` (no job exists).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_front_copies_only_an_accepted_jobs_answer() {
    let c = Cluster::start("trust-answer-copy-e2e", 1, 1, &[Plugin::echo("echo", &[])]).await;
    c.wait_for_api(GUARD).await;
    // Another app connection on the events export, as an app's requester listens there.
    let listener = c.nats.connector(Role::App).connect("listener").await.unwrap();
    let mut heard = listener
        .subscribe(format!("{}.copytest.*", subjects::KEEPALIVE_EVENTS_PREFIX))
        .await
        .unwrap();
    registered(&listener).await;
    let call = |method: &'static str, body: Value, token: &'static str| {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(
            subjects::AUTH_HEADER,
            format!("Bearer {}", c.token("copier")).as_str(),
        );
        headers.insert(subjects::KEEPALIVE_HEADER, token);
        let request = async_nats::Request::new()
            .headers(headers)
            .payload(serde_json::to_vec(&body).unwrap().into())
            .timeout(Some(GUARD));
        let app = c.app.clone();
        async move {
            let reply = app.send_request(subjects::api(method), request).await.unwrap();
            (
                reply.payload.clone(),
                serde_json::from_slice::<Value>(&reply.payload).unwrap(),
            )
        }
    };
    // A sync invoke (answered), a refused invokeAsync (args not an object), an accepted one: only the last is
    // copied.
    let mut last = None;
    for (method, args, token, ok) in [
        (methods::TOOLS_INVOKE, json!({"m": 1}), "copytest.1", true),
        (methods::TOOLS_INVOKE_ASYNC, json!([1]), "copytest.2", false),
        (methods::TOOLS_INVOKE_ASYNC, json!({"m": 2}), "copytest.3", true),
    ] {
        let (bytes, answer) = call(method, json!({"tool_id": "echo.echo", "args": args}), token).await;
        assert_eq!(answer["ok"], json!(ok), "{method}: {answer}");
        last = Some(bytes);
    }
    let bytes = last.unwrap();
    // The first message heard that is not a keepalive is the accepted job's copy: the front publishes on one
    // connection, in order, so a copy of either earlier answer would have come first.
    let copy = loop {
        let msg = arrives(&mut heard, "the copy of the accepted job's answer").await;
        let status = msg
            .headers
            .as_ref()
            .and_then(|h| h.get(subjects::STATUS_HEADER))
            .map(|v| v.as_str().to_owned());
        if status.as_deref() != Some(subjects::STATUS_WORKING) {
            assert_eq!(status.as_deref(), Some(subjects::STATUS_ANSWERED));
            break msg;
        }
    };
    assert_eq!(copy.subject.as_str(), subjects::keepalive("copytest.3"));
    assert_eq!(copy.payload, bytes, "the answer, byte for byte");
    c.shutdown().await;
}

/// Keepalives through the fleet: a sync invoke that runs longer than `KEEPALIVE_SILENCE` is answered (the worker
/// keeps the front's dispatch alive); an app's client that asks with a token hears the front's keepalives on the
/// events export; and an app's request gets the answer as the only message on its reply subject (it reaches the
/// front through the service import whose response mapping passes one message).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_sync_call_outlasts_the_silence_and_an_app_gets_only_the_answer() {
    use fleet_proto::api::subjects::{KEEPALIVE_EVERY, KEEPALIVE_SILENCE};
    let c = Cluster::start("trust-keepalive-e2e", 1, 1, &[Plugin::echo("echo", &[])]).await;
    let long_ms = u64::try_from((KEEPALIVE_SILENCE + KEEPALIVE_EVERY * 2).as_millis()).unwrap();
    let ask = |user: &str, keepalive: bool| {
        let mut request = fleet_client::api::api_request(
            &format!("Bearer {}", c.token(user)),
            &json!({"tool_id": "echo.sleep", "args": {"ms": long_ms}}),
            GUARD,
        );
        if keepalive {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(
                subjects::AUTH_HEADER,
                format!("Bearer {}", c.token(user)).as_str(),
            );
            headers.insert(subjects::KEEPALIVE_HEADER, "1");
            request = request.headers(headers);
        }
        c.app.send_request(subjects::api(methods::TOOLS_INVOKE), request)
    };
    // The CLI's client: keepalives on the events export (a silence of `KEEPALIVE_SILENCE` would end the call).
    let app = fleet_client::api::ApiClient::new(c.app.clone(), c.token("kept")).keeping_alive_as_app();
    let long = json!({"tool_id": "echo.sleep", "args": {"ms": long_ms}});
    let kept = app.call(methods::TOOLS_INVOKE, &long, GUARD);
    let (plain, asking, kept) = tokio::join!(ask("plain", false), ask("asking", true), kept);
    let kept = kept.expect("the app's long call is kept alive and answered");
    assert_eq!(kept["slept_ms"], json!(long_ms), "{kept}");
    for answer in [plain, asking] {
        let answer = answer.expect("the long call is answered");
        assert!(
            answer
                .headers
                .is_none_or(|h| h.get(subjects::STATUS_HEADER).is_none())
        );
        let body: Value = serde_json::from_slice(&answer.payload).expect("the answer, not a keepalive");
        assert_eq!(body["ok"], json!(true), "{body}");
        assert_eq!(body["result"]["slept_ms"], json!(long_ms), "{body}");
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_issued_app_credential_works_until_revoked_then_is_closed_and_refused() {
    let c = Cluster::start("trust-revoke", 1, 1, &[Plugin::echo("echo", &[])]).await;
    let material = AuthMaterial::load_read_only(c.nats.store_dir()).unwrap();
    let sys = connect(&c.nats, Role::Sys).await;
    let js = async_nats::jetstream::new(c.client.clone());
    let issuer = fleet::creds::Issuer::open(&js, c.store.settings(), material, sys)
        .await
        .unwrap();
    for reserved in ["app", "front", "worker", "bad name", ""] {
        assert!(issuer.issue(reserved).await.is_err(), "{reserved:?} is refused");
    }
    let (record, creds) = issuer.issue("billing").await.unwrap();
    assert!(matches!(
        issuer.issue("billing").await,
        Err(fleet::creds::CredsError::Exists(_))
    ));
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("billing.creds");
    std::fs::write(&file, &creds).unwrap();
    let connector = Connector::new(c.nats.url(), Some(file.clone()));
    let (client, mut rx) = watched(&connector, "billing").await;
    // The API through the issued user (its inbox prefix `_INBOX.billing`), not another app's inbox.
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(
        subjects::AUTH_HEADER,
        format!("Bearer {}", c.token("bob")).as_str(),
    );
    let reply = client
        .send_request(
            subjects::api(methods::TOOLS_LIST),
            async_nats::Request::new().headers(headers).payload("{}".into()),
        )
        .await
        .expect("tools.list through an issued credential");
    assert!(String::from_utf8_lossy(&reply.payload).contains("\"ok\""));
    subscribe_refused(&client, &mut rx, "_INBOX.app.>").await;

    let revoked = issuer.revoke("billing").await.unwrap();
    assert!(revoked.revoked_at.is_some());
    // The open connection is closed by the server…
    let deadline = tokio::time::Instant::now() + GUARD;
    loop {
        let event = tokio::time::timeout_at(deadline, rx.recv())
            .await
            .expect("the revoked connection is closed")
            .expect("events");
        if event.contains("disconnected") || event.contains("authorization") {
            break;
        }
    }
    // …and a new one is refused, naming the file.
    let err = connector.connect("billing-again").await.expect_err("refused");
    assert!(matches!(err, ConnectError::Refused { .. }), "{err:?}");
    assert!(err.to_string().contains(&file.display().to_string()), "{err}");
    let listed = issuer.list().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].public_key, record.public_key);
    assert!(listed[0].revoked_at.is_some());
    // Issued again: a new key that works, while the old file stays refused.
    let (again, creds2) = issuer.issue("billing").await.unwrap();
    assert_ne!(again.public_key, record.public_key);
    assert!(again.revoked_keys.contains_key(&record.public_key));
    let file2 = dir.path().join("billing2.creds");
    std::fs::write(&file2, &creds2).unwrap();
    Connector::new(c.nats.url(), Some(file2))
        .connect("billing-2")
        .await
        .expect("the re-issued credential connects");
    assert!(connector.connect("billing-old").await.is_err());
    c.shutdown().await;
}

// ---------------------------------------------------------------------------------------------------------------
// `fleet up`: credentials generated once, the README's commands, `fleet creds`, a hostile plugin.
// ---------------------------------------------------------------------------------------------------------------

const SCRUBBED_ENV: &[&str] = &[
    "FLEET_NATS_URL",
    "FLEET_DATA_DIR",
    "FLEET_PLUGINS_DIR",
    "FLEET_TOKEN",
    "FLEET_ISOLATION",
    "FLEET_NATS_SERVER",
    "FLEET_NATS_CREDS",
    "FLEET_NATS_AUTH_DIR",
];

/// A `fleet up` child on a data dir; killed on drop.
struct UpProc {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl UpProc {
    fn start(data_dir: &Path, plugins: &Path, extra: &[&str]) -> UpProc {
        let http = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .to_string();
        let mut cmd = Command::new(fleet_bin());
        cmd.arg("up")
            .arg("--data-dir")
            .arg(data_dir)
            .arg("--plugins-dir")
            .arg(plugins)
            .args(["--http", &http])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(data_dir.with_extension("stderr")).unwrap());
        for var in SCRUBBED_ENV {
            cmd.env_remove(var);
        }
        let mut child = cmd.spawn().unwrap();
        let stderr = || std::fs::read_to_string(data_dir.with_extension("stderr")).unwrap_or_default();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = lines.clone();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(90);
        while !lines.lock().unwrap().iter().any(|l| l.starts_with("try ")) {
            assert!(
                child.try_wait().unwrap().is_none(),
                "fleet up exited: {:?}\n{}",
                lines.lock().unwrap(),
                stderr()
            );
            assert!(
                Instant::now() < deadline,
                "fleet up not ready: {:?}",
                lines.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(25));
        }
        UpProc { child, lines }
    }

    /// SIGINT, then waits for the exit (bounded).
    fn stop(mut self) {
        let _ = Command::new("kill")
            .args(["-INT", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.child.try_wait().unwrap().is_none() {
            assert!(
                Instant::now() < deadline,
                "fleet up did not stop: {:?}",
                self.lines.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(25));
        }
    }
}

impl Drop for UpProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `fleet ARGS --data-dir DIR`; (success, stdout JSON, stderr).
fn cli(data_dir: &Path, args: &[&str]) -> (bool, Value, String) {
    let mut cmd = Command::new(fleet_bin());
    cmd.args(args)
        .arg("--data-dir")
        .arg(data_dir)
        .stdin(Stdio::null());
    for var in SCRUBBED_ENV {
        cmd.env_remove(var);
    }
    let out = cmd.output().unwrap();
    (
        out.status.success(),
        serde_json::from_slice(&out.stdout).unwrap_or(Value::Null),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o7777
}

const README_INVOKE: &[&str] = &[
    "invoke",
    "--user",
    "alice",
    "--tool-id",
    "echo-py",
    "--tool",
    "echo",
    "--args",
    r#"{"hello":"world"}"#,
];

#[test]
fn fleet_up_makes_its_credentials_once_and_the_operator_issues_and_revokes_app_credentials() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let plugins = workspace_root().join("plugins");
    let up = UpProc::start(&data, &plugins, &[]);
    let auth = data.join("nats");
    assert_eq!(mode(&auth), 0o700);
    for file in [
        "seeds.json",
        "jwts.json",
        "app.creds",
        "front.creds",
        "worker.creds",
        "operator.creds",
        "sys.creds",
    ] {
        assert_eq!(mode(&auth.join(file)), 0o600, "{file}");
    }
    let seeds = std::fs::read(auth.join("seeds.json")).unwrap();
    let app_creds = std::fs::read(auth.join("app.creds")).unwrap();

    // The README's commands, unchanged (the CLI finds app.creds in the data dir).
    let (ok, out, err) = cli(&data, README_INVOKE);
    assert!(ok, "{err}");
    assert_eq!(out["arguments"]["hello"], "world", "{out}");

    // An app credential issued, used, listed, revoked.
    let file = tmp.path().join("billing.creds");
    let (ok, out, err) = cli(
        &data,
        &[
            "creds",
            "issue",
            "--name",
            "billing",
            "--out",
            file.to_str().unwrap(),
        ],
    );
    assert!(ok, "{err}");
    assert_eq!(out["inbox_prefix"], "_INBOX.billing", "{out}");
    assert!(
        out.get("creds").is_none(),
        "the secret went to the file only: {out}"
    );
    assert_eq!(mode(&file), 0o600);
    let with_billing = |args: &[&str]| {
        let mut a = args.to_vec();
        a.extend(["--nats-creds", file.to_str().unwrap()]);
        cli(&data, &a)
    };
    let (ok, _, err) = with_billing(README_INVOKE);
    assert!(ok, "the issued credential calls the API: {err}");
    let (ok, out, err) = cli(&data, &["creds", "list"]);
    assert!(ok, "{err}");
    assert_eq!(out["credentials"][0]["name"], "billing", "{out}");
    let (ok, _, err) = cli(&data, &["creds", "revoke", "billing"]);
    assert!(ok, "{err}");
    let (ok, _, err) = with_billing(README_INVOKE);
    assert!(!ok, "a revoked credential cannot connect");
    assert!(
        err.contains("refused") && err.contains(file.to_str().unwrap()),
        "{err}"
    );
    up.stop();

    // Again on the same data dir: the same keys and credentials, the revocation still holds.
    let up = UpProc::start(&data, &plugins, &[]);
    assert_eq!(
        std::fs::read(auth.join("seeds.json")).unwrap(),
        seeds,
        "keys are reused"
    );
    assert_eq!(
        std::fs::read(auth.join("app.creds")).unwrap(),
        app_creds,
        "credentials are reused"
    );
    let (ok, _, err) = cli(&data, README_INVOKE);
    assert!(ok, "{err}");
    let (ok, _, _) = with_billing(README_INVOKE);
    assert!(!ok, "still revoked after a restart");
    up.stop();
}

/// A catalogue of the shipped `echo-py` and the fixture with its hostile tool.
fn hostile_catalogue(dir: &Path) -> PathBuf {
    let root = dir.join("plugins");
    for (id, extra) in [("echo-py", ""), ("mallory-tools", "--hostile")] {
        let d = root.join(id);
        std::fs::create_dir_all(&d).unwrap();
        let mut command = vec![
            "/usr/bin/python3".to_owned(),
            workspace_root()
                .join("tests/plugins/python/echo_plugin.py")
                .display()
                .to_string(),
        ];
        if !extra.is_empty() {
            command.push(extra.to_owned());
        }
        std::fs::write(
            d.join("executa.json"),
            serde_json::to_vec(&json!({ "tool_id": id, "type": "binary", "command": command })).unwrap(),
        )
        .unwrap();
    }
    root
}

fn hostile_plugin_hears_nothing(isolation: Option<&str>) {
    let tmp = tempfile::tempdir().unwrap();
    // Reachable by the plugins' uids (a 0700 temporary directory is not): the data dir's own modes decide.
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let data = tmp.path().join("data");
    let plugins = hostile_catalogue(tmp.path());
    let extra: Vec<&str> = isolation.map(|i| vec!["--isolation", i]).unwrap_or_default();
    let up = UpProc::start(&data, &plugins, &extra);
    let url = std::fs::read_to_string(data.join("nats-url")).unwrap();
    let port = url.trim().rsplit(':').next().unwrap().to_owned();
    let auth = data.join("nats");
    let files: Vec<String> = [
        "worker.creds",
        "front.creds",
        "app.creds",
        "operator.creds",
        "sys.creds",
        "seeds.json",
    ]
    .iter()
    .map(|f| auth.join(f).display().to_string())
    .collect();

    // The victim calls a plugin with a secret while mallory's plugin dials NATS.
    let (ok, _, err) = cli(
        &data,
        &[
            "invoke",
            "--user",
            "victim",
            "--tool-id",
            "echo-py",
            "--tool",
            "echo",
            "--args",
            r#"{"secret":"s3cr3t"}"#,
        ],
    );
    assert!(ok, "{err}");
    let probe = json!({ "port": port.parse::<u16>().unwrap(), "paths": files });
    let (ok, out, err) = cli(
        &data,
        &[
            "invoke",
            "--user",
            "mallory",
            "--tool-id",
            "mallory-tools",
            "--tool",
            "nats_probe",
            "--args",
            &probe.to_string(),
        ],
    );
    assert!(ok, "{err}");
    let report = &out;
    let connect = report["connect"].as_str().unwrap_or_default();
    assert!(
        connect.contains("Authorization Violation") || connect.starts_with("error:"),
        "an unauthenticated connection is refused (or cannot be made): {report}"
    );
    assert!(!report.to_string().contains("s3cr3t"), "{report}");
    if rustix::process::geteuid().is_root() {
        // Confined (the default as root), the plugin's private /tmp does not even hold the data dir when it
        // lives under /tmp; elsewhere, or without isolation, the plugin runs under a per-tool uid and the
        // root-owned 0600 files are not its to read.
        let tmp = std::fs::canonicalize("/tmp").unwrap();
        let under_tmp = std::fs::canonicalize(&data).unwrap().starts_with(&tmp);
        let expected = if isolation != Some("none") && under_tmp {
            "FileNotFoundError"
        } else {
            "PermissionError"
        };
        for f in &files {
            assert_eq!(report["files"][f], expected, "{f}: {report}");
        }
    }
    up.stop();
}

#[test]
fn a_plugin_dialling_nats_hears_nothing_and_can_do_nothing() {
    hostile_plugin_hears_nothing(None);
}

#[test]
fn a_plugin_dialling_nats_hears_nothing_with_isolation_none() {
    hostile_plugin_hears_nothing(Some("none"));
}

/// The operator guide's permission table (`docs/operations.md`) is the code's
/// (`fleet::nats_auth::permissions::markdown_table`).
#[test]
fn the_documented_permission_table_is_the_one_enforced() {
    let path = workspace_root().join("docs").join("operations.md");
    let doc = std::fs::read_to_string(&path).unwrap();
    let begin = "<!-- nats-permissions:begin -->\n";
    let end = "<!-- nats-permissions:end -->";
    let start = doc
        .find(begin)
        .expect("docs/operations.md has the permission table markers")
        + begin.len();
    let stop = doc[start..].find(end).expect("end marker") + start;
    let table = permissions::markdown_table(permissions::DEFAULT_PREFIX);
    if std::env::var_os("FLEET_WRITE_README_TABLE").is_some() {
        let mut updated = doc.clone();
        updated.replace_range(start..stop, &table);
        std::fs::write(&path, updated).unwrap();
    }
    assert_eq!(
        &doc[start..stop],
        table,
        "docs/operations.md's NATS permission table differs from the code; regenerate it with FLEET_WRITE_README_TABLE=1"
    );
}

/// Refused or missing credentials end every command at once with one line naming the file and NATS's reason:
/// `fleet worker` without credentials, a client with a missing file, a client with another fleet's file.
#[test]
fn refused_or_missing_credentials_fail_every_command_in_one_line() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let c = rt.block_on(Cluster::start("trust-cli", 0, 0, &[]));
    let url = c.nats.url();
    let tmp = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        let mut cmd = Command::new(fleet_bin());
        cmd.args(args).stdin(Stdio::null());
        for var in SCRUBBED_ENV {
            cmd.env_remove(var);
        }
        let out = cmd.output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let state = tmp.path().join("state");
    let (ok, err) = run(&[
        "worker",
        "--isolation",
        "none",
        "--nats-url",
        &url,
        "--state-dir",
        state.to_str().unwrap(),
        "--catalogue",
        workspace_root().join("plugins").to_str().unwrap(),
    ]);
    assert!(!ok, "a worker without credentials does not join");
    assert!(
        err.contains("without credentials") && err.contains("--nats-creds"),
        "{err}"
    );

    let missing = tmp.path().join("missing.creds");
    let (ok, err) = run(&[
        "invoke",
        "--token",
        "not-checked-before-connecting",
        "--tool-id",
        "echo",
        "--tool",
        "echo",
        "--nats-url",
        &url,
        "--nats-creds",
        missing.to_str().unwrap(),
    ]);
    assert!(!ok);
    assert!(err.contains(missing.to_str().unwrap()), "{err}");

    let foreign =
        AuthMaterial::load_or_create(&tmp.path().join("other"), permissions::default_for_role).unwrap();
    let path = foreign.creds_path(Role::Operator);
    let (ok, err) = run(&[
        "creds",
        "list",
        "--token",
        "not-checked-before-connecting",
        "--nats-url",
        &url,
        "--nats-creds",
        path.to_str().unwrap(),
    ]);
    assert!(!ok);
    assert!(
        err.contains("refused") && err.contains(path.to_str().unwrap()),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");

    // Good credentials without the exec seal's public key beside them: the worker says which flag it needs.
    let lone = tmp.path().join("lone");
    std::fs::create_dir_all(&lone).unwrap();
    let creds = lone.join("worker.creds");
    std::fs::copy(c.nats.creds(Role::Worker), &creds).unwrap();
    let (ok, err) = run(&[
        "worker",
        "--isolation",
        "none",
        "--nats-url",
        &url,
        "--nats-creds",
        creds.to_str().unwrap(),
        "--state-dir",
        state.to_str().unwrap(),
        "--catalogue",
        workspace_root().join("plugins").to_str().unwrap(),
    ]);
    assert!(!ok, "a worker that cannot check seals does not join");
    // The worker's own start-up log lines come first; the refusal is one line of its own.
    let fatal: Vec<&str> = err.lines().filter(|l| l.starts_with("fleet: ")).collect();
    assert_eq!(fatal.len(), 1, "{err}");
    assert!(
        fatal[0].contains("--exec-verify-key") && fatal[0].contains(lone.join("exec.pub").to_str().unwrap()),
        "{err}"
    );
    drop(c);
}

/// The value of `cloud_agents_exec_seal_refusals_total{reason}` in `text` (0 when absent).
fn seal_refusals(text: &str, reason: &str) -> u64 {
    let series = format!("cloud_agents_exec_seal_refusals_total{{reason=\"{reason}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(series.as_str()))
        .map_or(0, |v| v.trim().parse().unwrap())
}

/// Where NATS permissions stop (a credential an operator widened by hand, a bus left open), the exec seal holds:
/// a client allowed to publish on every worker subject still cannot inject a request (unsigned), change one it
/// overheard (the seal covers the body), replay one verbatim, or cancel someone's call with an unsealed command.
/// Nothing it sent ran: no session was started for the user it forged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_may_publish_on_worker_subjects_still_cannot_inject_work() {
    let c = Cluster::start("trust-seal", 1, 1, &[Plugin::echo("echo", &[])]).await;
    let worker = c.workers[0].node.as_ref().unwrap();
    let exec = subjects::worker_exec(worker.id());
    let glass = c.break_glass().await;
    let mut tap = glass.subscribe(exec.clone()).await.unwrap();
    registered(&glass).await;
    c.ok(
        "victim",
        methods::TOOLS_INVOKE,
        json!({"tool_id": "echo.echo", "args": {"text": "mine"}}),
    )
    .await;
    let genuine = arrives(&mut tap, "the genuine request, overheard").await;
    // Sealed with a session grant for this worker (its registry entry carries its session key), not signed.
    let sealed_with = |name: &str| genuine.headers.as_ref().is_some_and(|h| h.get(name).is_some());
    assert!(
        sealed_with(fleet_proto::api::worker::SEAL_GRANT_HEADER)
            && sealed_with(fleet_proto::api::worker::SEAL_MAC_HEADER)
            && !sealed_with(fleet_proto::api::worker::SEAL_SIGNATURE_HEADER),
        "fronts seal what they send, with a session grant: {:?}",
        genuine.headers
    );
    let mut forged: Value = serde_json::from_slice(&genuine.payload).unwrap();
    forged["user"] = json!("forged-user");
    let forged = serde_json::to_vec(&forged).unwrap();
    let reply = glass.new_inbox();
    // Unsigned.
    glass
        .publish_with_reply(exec.clone(), reply.clone(), forged.clone().into())
        .await
        .unwrap();
    // The genuine seal on a changed body.
    glass
        .publish_with_reply_and_headers(
            exec.clone(),
            reply.clone(),
            genuine.headers.clone().unwrap(),
            forged.clone().into(),
        )
        .await
        .unwrap();
    // The genuine request, verbatim, again.
    glass
        .publish_with_reply_and_headers(
            exec.clone(),
            reply.clone(),
            genuine.headers.clone().unwrap(),
            genuine.payload.clone(),
        )
        .await
        .unwrap();
    // An unsealed cancel.
    glass
        .publish(
            subjects::worker_cancel(worker.id()),
            serde_json::to_vec(&fleet_proto::api::worker::CancelCommand::new("any"))
                .unwrap()
                .into(),
        )
        .await
        .unwrap();
    glass.flush().await.unwrap();
    let deadline = Instant::now() + GUARD;
    loop {
        let text = c.metrics.encode();
        let counts = (
            seal_refusals(&text, "unsigned"),
            seal_refusals(&text, "bad_signature"),
            seal_refusals(&text, "replayed"),
        );
        if counts == (2, 1, 1) {
            break;
        }
        assert!(Instant::now() < deadline, "refusals so far: {counts:?}\n{text}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        worker.pool().sessions().iter().all(|s| s.user() != "forged-user"),
        "nothing forged ran"
    );
    // The fleet itself is unaffected.
    c.ok(
        "victim",
        methods::TOOLS_INVOKE,
        json!({"tool_id": "echo.echo", "args": {"text": "still mine"}}),
    )
    .await;
    c.shutdown().await;
}

/// The values of `cloud_agents_job_seal_rejected_total{reason, by}` for the reasons `unsealed` and
/// `bad_signature` in `text` (0 when absent).
fn job_seal_rejections(text: &str, by: &str) -> (u64, u64) {
    let value = |reason: &str| {
        let series = format!("cloud_agents_job_seal_rejected_total{{reason=\"{reason}\",by=\"{by}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(series.as_str()))
            .map_or(0, |v| v.trim().parse().unwrap())
    };
    (value("unsealed"), value("bad_signature"))
}

/// Puts `record` at its key of the jobs bucket as it is (no compare-and-set, no slot): `nats kv put`.
async fn kv_put_job(kv: &async_nats::jetstream::kv::Store, record: &fleet_store::JobRecord) {
    let key = format!("{}.{}", fleet_proto::api::user_key(&record.user), record.job_id);
    kv.put(key, serde_json::to_vec(record).unwrap().into())
        .await
        .expect("the worker credential writes job records");
}

/// Waits until `user`'s job `id` is terminal and returns it.
async fn ended(
    store: &fleet_store::Store,
    user: &str,
    id: &fleet_proto::api::JobId,
) -> fleet_store::JobRecord {
    let deadline = Instant::now() + GUARD;
    loop {
        if let Some(r) = store.get_job(user, id).await.unwrap()
            && r.value.state.is_terminal()
        {
            return r.value;
        }
        assert!(Instant::now() < deadline, "failure guard: job {id} never ended");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Refused for its seal: failed with `permission_denied`, reason `job_seal`, `seal` = `why`, no result.
fn refused_for_seal(r: &fleet_store::JobRecord, why: &str) {
    let error = r.error.as_ref().expect("an error");
    assert_eq!(
        (r.state, error.code, r.result.as_ref()),
        (
            fleet_proto::api::JobState::Failed,
            fleet_proto::api::ApiErrorCode::PermissionDenied,
            None
        ),
        "{r:?}"
    );
    let details = error.details.as_ref().expect("details");
    assert_eq!(
        (&details["reason"], &details["seal"]),
        (&json!("job_seal"), &json!(why)),
        "{r:?}"
    );
}

/// Issue 43 (finding 5 of the second security review): only a front can create work. With the worker role's own
/// credentials (what a stolen `worker.creds` gives), a queued job record written into the jobs bucket — forged
/// without a seal, or a front's genuine record altered (its arguments, its user) — and named on the job queue, or
/// put in the victim's active set for the sweeper to dispatch, or handed to a worker by a front (as a sweeper
/// racing a rewrite of the record would), is failed and counted in `cloud_agents_job_seal_rejected_total`, never
/// run: no plugin session ever starts for the victim, no result is ever written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_credentials_cannot_make_a_worker_or_a_sweeper_run_a_job() {
    use fleet_proto::api::{JobId, JobState};
    use fleet_store::JobRecord;

    let c = Cluster::start("trust-jobs", 1, 2, &[Plugin::echo("echo", &[])]).await;
    let front = c.fronts[0].0.clone();
    // The attacker's side: the worker role's credentials, and the store as a worker opens it.
    let stolen = connect(&c.nats, Role::Worker).await;
    let js = async_nats::jetstream::new(stolen.clone());
    let store = fleet_store::Store::open(js.clone(), fleet_e2e::cluster::worker_settings())
        .await
        .unwrap();
    let jobs = js
        .get_key_value(fleet_store::StoreSettings::default().jobs_bucket())
        .await
        .unwrap();
    let victim = "victim";
    let forged = |args: Value| {
        let mut r = JobRecord::queued(
            fleet::node::new_invoke_id(),
            victim,
            "echo.echo",
            "echo",
            "echo",
            fleet_proto::util::now_ms(),
            60_000,
        );
        r.args = args.as_object().unwrap().clone();
        r
    };

    // A genuine job: sealed by the front that created it, run.
    let created = c
        .ok(
            "alice",
            methods::TOOLS_INVOKE_ASYNC,
            json!({"tool_id": "echo.echo", "args": {"text": "mine"}}),
        )
        .await;
    let alice_job: JobId = created["jobId"].as_str().unwrap().parse().unwrap();
    let genuine = ended(&store, "alice", &alice_job).await;
    assert_eq!(genuine.state, JobState::Succeeded, "{genuine:?}");
    assert!(genuine.seal.is_some(), "a front seals the records it creates");

    // 1. The job queue (the workers' path): a forged record, and the genuine one altered — its arguments under
    //    its own key, its user under the victim's — each put back `queued` and named on the queue.
    let unsealed = forged(json!({"text": "forged"}));
    let mut other_args = genuine.clone();
    other_args.state = JobState::Queued;
    other_args.result = None;
    other_args.finished_at_ms = None;
    other_args.deadline_ms = fleet_proto::util::now_ms() + 60_000;
    other_args
        .args
        .insert("text".into(), json!("not what alice asked"));
    let mut other_user = other_args.clone();
    other_user.args = genuine.args.clone();
    other_user.user = victim.into();
    for record in [&unsealed, &other_args, &other_user] {
        kv_put_job(&jobs, record).await;
        store.enqueue_job(&record.user, &record.job_id).await.unwrap();
    }
    refused_for_seal(&ended(&store, victim, &unsealed.job_id).await, "unsealed");
    refused_for_seal(&ended(&store, "alice", &alice_job).await, "bad_signature");
    refused_for_seal(&ended(&store, victim, &other_user.job_id).await, "bad_signature");
    let text = c.metrics.encode();
    assert_eq!(job_seal_rejections(&text, "worker"), (1, 2), "{text}");

    // 2. The sweeper's dispatch: forged records admitted into the victim's active set (slot and index, as a front
    //    admits a job), never queued; one sweep fails them instead of dispatching them.
    let mut sealed_elsewhere = forged(json!({"text": "sealed for another job"}));
    sealed_elsewhere.seal = genuine.seal.clone();
    let unsealed = forged(json!({"text": "forged for the sweeper"}));
    for record in [&sealed_elsewhere, &unsealed] {
        store.create_job(record.clone(), 5).await.unwrap();
    }
    let (_, _, dispatched) = fleet::sweeper::sweep(&front).await;
    assert_eq!(dispatched, 0);
    refused_for_seal(
        &ended(&store, victim, &sealed_elsewhere.job_id).await,
        "bad_signature",
    );
    refused_for_seal(&ended(&store, victim, &unsealed.job_id).await, "unsealed");
    let text = c.metrics.encode();
    assert_eq!(job_seal_rejections(&text, "sweeper"), (1, 1), "{text}");
    assert!(
        store.active_set(victim).await.unwrap().is_empty(),
        "their slots are given back"
    );

    // 3. A front's exec request for a record it did not seal (a sweeper that read the record before it was
    //    rewritten): the worker checks the record its start won, and runs nothing.
    let unsealed = forged(json!({"text": "handed over"}));
    store.create_job(unsealed.clone(), 5).await.unwrap();
    assert_eq!(front.dispatch_job(&unsealed).await, Ok(true), "a worker took it");
    refused_for_seal(&ended(&store, victim, &unsealed.job_id).await, "unsealed");
    let text = c.metrics.encode();
    assert_eq!(job_seal_rejections(&text, "worker"), (2, 2), "{text}");

    // Nothing of it reached a plugin: no worker ever started a session for the victim.
    for w in &c.workers {
        let node = w.node.as_ref().unwrap();
        assert!(
            node.pool().sessions().iter().all(|s| s.user() != victim),
            "nothing forged ran on {}",
            node.id()
        );
    }
    // The fleet itself is unaffected: the victim's own job runs.
    let created = c
        .ok(
            victim,
            methods::TOOLS_INVOKE_ASYNC,
            json!({"tool_id": "echo.echo"}),
        )
        .await;
    let own: JobId = created["jobId"].as_str().unwrap().parse().unwrap();
    assert_eq!(ended(&store, victim, &own).await.state, JobState::Succeeded);
    c.shutdown().await;
}

/// Answers reach only their caller (issue 43, review 2 finding 4b): a requester's keepalive subject is random per
/// request (not derived from its inbox, not sequential), and another app that hears it on the events export and
/// sends a real `invokeAsync` naming it gets the front to publish its job's answer copy there — which the victim's
/// requester ignores, because the copy carries the other request's secret, not its own. The victim gets its own
/// answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_app_that_hears_a_keepalive_subject_cannot_answer_in_its_place() {
    use fleet_client::nats_conn::Requester;
    use fleet_proto::api::subjects::{
        ANSWER_TOKEN_HEADER, KEEPALIVE_EVERY, KEEPALIVE_SILENCE, answer_token_ok,
    };
    let c = Cluster::start("trust-answer-token", 1, 1, &[Plugin::echo("echo", &[])]).await;
    c.wait_for_api(GUARD).await;
    let hostile = c.nats.connector(Role::App).connect("hostile").await.unwrap();
    let mut heard = hostile
        .subscribe(format!("{}.>", subjects::KEEPALIVE_EVENTS_PREFIX))
        .await
        .unwrap();
    registered(&hostile).await;

    // The victim: a long sync call through its requester, kept alive on the events export.
    let long_ms = u64::try_from((KEEPALIVE_SILENCE + KEEPALIVE_EVERY * 3).as_millis()).unwrap();
    let requester = Requester::through_import(&c.app).await.unwrap();
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(
        subjects::AUTH_HEADER,
        format!("Bearer {}", c.token("victim")).as_str(),
    );
    let body = json!({"tool_id": "echo.sleep", "args": {"ms": long_ms}});
    let victim = tokio::spawn(async move {
        requester
            .request(
                subjects::api(methods::TOOLS_INVOKE),
                headers,
                serde_json::to_vec(&body).unwrap().into(),
                GUARD,
            )
            .await
    });

    // The hostile app hears a keepalive: its subject is two random parts, and it carries the victim's secret.
    let keepalive = arrives(&mut heard, "the victim's first keepalive").await;
    let token = keepalive
        .subject
        .as_str()
        .strip_prefix(&format!("{}.", subjects::KEEPALIVE_EVENTS_PREFIX))
        .unwrap()
        .to_owned();
    let parts: Vec<&str> = token.split('.').collect();
    assert_eq!(
        parts.iter().map(|p| p.len()).collect::<Vec<_>>(),
        [16, 32],
        "{token}"
    );
    assert!(
        !c.app.new_inbox().contains(parts[0]),
        "the keepalive prefix is not the inbox's"
    );
    let secret = keepalive
        .headers
        .as_ref()
        .and_then(|h| h.get(ANSWER_TOKEN_HEADER))
        .map(|v| v.as_str().to_owned())
        .expect("the keepalive carries the victim's secret");
    assert!(answer_token_ok(&secret), "{secret}");

    // It makes a job whose answer copy goes to the victim's keepalive subject, with its own secret.
    let mut forged = async_nats::HeaderMap::new();
    forged.insert(
        subjects::AUTH_HEADER,
        format!("Bearer {}", c.token("hostile")).as_str(),
    );
    forged.insert(subjects::KEEPALIVE_HEADER, token.as_str());
    forged.insert(ANSWER_TOKEN_HEADER, "0".repeat(32).as_str());
    let request = async_nats::Request::new()
        .headers(forged)
        .payload(
            serde_json::to_vec(&json!({"tool_id": "echo.echo", "args": {"forged": true}}))
                .unwrap()
                .into(),
        )
        .timeout(Some(GUARD));
    let made = hostile
        .send_request(subjects::api(methods::TOOLS_INVOKE_ASYNC), request)
        .await
        .unwrap();
    let made: Value = serde_json::from_slice(&made.payload).unwrap();
    assert_eq!(made["ok"], json!(true), "{made}");
    // The copy was published where the victim listens (the front publishes on one connection, in order).
    let copy = loop {
        let msg = arrives(&mut heard, "the hostile job's answer copy").await;
        let status = msg
            .headers
            .as_ref()
            .and_then(|h| h.get(subjects::STATUS_HEADER))
            .map(|v| v.as_str().to_owned());
        if status.as_deref() == Some(subjects::STATUS_ANSWERED) {
            break msg;
        }
    };
    assert_eq!(copy.subject.as_str(), subjects::keepalive(&token));

    // The victim takes its own answer, not the copy.
    let answer = tokio::time::timeout(GUARD, victim)
        .await
        .expect("failure guard")
        .unwrap()
        .expect("the victim's answer");
    let answer: Value = serde_json::from_slice(&answer.payload).unwrap();
    assert_eq!(answer["result"]["slept_ms"], json!(long_ms), "{answer}");
    c.shutdown().await;
}
