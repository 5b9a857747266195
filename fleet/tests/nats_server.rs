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
