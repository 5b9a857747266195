//! The child nats-server of `fleet up` and the tests: a server left running on a store by an earlier run (a
//! `fleet up` killed before its children were tied to it, or started by hand) is detected and named, instead of
//! a second server silently taking another port.
#![allow(clippy::unwrap_used)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fleet::nats_server::{NatsServer, NatsServerError, PID_FILE, find, free_port};

#[test]
fn a_server_left_on_the_store_is_named_not_duplicated() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("nats");
    std::fs::create_dir_all(&store).unwrap();
    // A leftover: a nats-server on this store that nobody owns any more.
    let mut stale = Command::new(find().unwrap())
        .args([
            "-a",
            "127.0.0.1",
            "-p",
            &free_port().unwrap().to_string(),
            "-js",
            "-sd",
        ])
        .arg(&store)
        .arg("-P")
        .arg(store.join(PID_FILE))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !store.join(PID_FILE).exists() {
        assert!(
            Instant::now() < deadline,
            "the leftover server never wrote its pid file"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let err = NatsServer::start(&store).expect_err("a second server on the same store");
    match &err {
        NatsServerError::Stale { pid, store: named } => {
            assert_eq!(*pid, stale.id());
            assert_eq!(named, &store);
        }
        other => panic!("not named as stale: {other}"),
    }
    assert!(err.to_string().contains(&format!("kill {}", stale.id())), "{err}");
    stale.kill().unwrap();
    stale.wait().unwrap();
    // Once it is gone, the store is usable again (the pid file it left names a dead process).
    let mut server = NatsServer::start(&store).expect("a server once the leftover is gone");
    server.stop();
}

/// `fleet up` caps its own servers' file stores (`start_cluster_with`): past the cap, JetStream refuses writes —
/// the limit the front's store budget is derived from is really the server's.
#[tokio::test]
async fn a_server_given_a_file_store_cap_refuses_writes_beyond_it() {
    const CAP: u64 = 4 << 20;
    const VALUE: usize = 256 << 10;
    let dir = tempfile::tempdir().unwrap();
    let server = NatsServer::start_cluster_with(dir.path(), 1, free_port().unwrap(), Some(CAP)).unwrap();
    let client = server.connect(fleet_client::creds::Role::Front).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let kv = js
        .create_key_value(async_nats::jetstream::kv::Config {
            bucket: "capped".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let value = bytes::Bytes::from(vec![b'x'; VALUE]);
    let mut written = 0_u64;
    let refused = loop {
        match kv.put(format!("k{written}"), value.clone()).await {
            Ok(_) => written += 1,
            Err(e) => break e,
        }
        assert!(
            written * VALUE as u64 <= CAP,
            "{written} values of {VALUE} bytes stored under a cap of {CAP}"
        );
    };
    // Refused for the cap (JetStream's "insufficient resources", 10023), once the store is at it.
    assert!(
        format!("{refused:?}").contains("insufficient resources"),
        "{refused:?}"
    );
    assert!(
        written * VALUE as u64 > CAP - 2 * VALUE as u64,
        "refused at {written} values, far under the cap: {refused:?}"
    );
}
