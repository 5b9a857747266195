//! The fleet's one compare-and-set loop (`fleet_store::cas`), against a real nats-server with production auth
//! (the `front` user, on one of its own buckets): racing writers each land exactly once, a stale read is decided
//! again, `Keep` writes nothing, `Delete` removes at the revision read, and an error that is not a lost race
//! (too large, a value that does not parse, the decision's own) ends the loop at once, without a retry.

// Test code: helpers panic on purpose when the system under test misbehaves.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use async_nats::jetstream::{self, kv};
use fleet::nats_auth::permissions::APS_USAGE;
use fleet::nats_server::NatsServer;
use fleet_e2e::cluster::{Role, connect};
use fleet_store::cas::{Committed, Edit, Target, compare_and_set};
use fleet_store::{Op, Provision, Revisioned, StoreError};

/// Size limit of the test values (a counter's JSON).
const LIMIT: (&str, usize) = ("counter", 32);

/// A server, and a bucket the `front` user may administer (the storage service's per-user byte counters).
async fn bucket() -> (NatsServer, kv::Store, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start(&dir.path().join("nats")).expect("nats-server (run scripts/test.sh once)");
    let js = jetstream::new(connect(&nats, Role::Front).await);
    let kv = fleet_store::provision::key_value(
        &js,
        kv::Config {
            bucket: APS_USAGE.bucket("fleet"),
            history: 1,
            ..Default::default()
        },
        Provision::Create,
    )
    .await
    .unwrap();
    (nats, kv, dir)
}

fn target<'a>(kv: &'a kv::Store, key: &'a str) -> Target<'a> {
    Target {
        kv,
        key,
        op: Op::StorageQuota,
        limit: LIMIT,
    }
}

/// Adds one to the counter at `key`; returns how many times its decision ran.
async fn increment(kv: &kv::Store, key: &str) -> usize {
    let mut decisions = 0;
    let committed = compare_and_set(target(kv, key), None, |current: Option<Revisioned<u64>>| {
        decisions += 1;
        Ok::<_, StoreError>(Edit::Write(current.map_or(0, |c| c.value) + 1, ()))
    })
    .await
    .unwrap();
    assert!(committed.written.is_some());
    decisions
}

async fn value(kv: &kv::Store, key: &str) -> Option<u64> {
    fleet_store::read::<u64>(kv, key, Op::StorageQuota)
        .await
        .unwrap()
        .map(|r| r.value)
}

/// 8 writers × 25 increments of one key at once: every increment lands exactly once (none lost to a race, none
/// applied twice), and the writers did collide (some decisions ran again after a lost race).
#[tokio::test]
async fn racing_writers_each_land_exactly_once() {
    let (_nats, kv, _dir) = bucket().await;
    let decisions = Arc::new(AtomicUsize::new(0));
    let writers: Vec<_> = (0..8)
        .map(|_| {
            let (kv, decisions) = (kv.clone(), decisions.clone());
            tokio::spawn(async move {
                for _ in 0..25 {
                    decisions.fetch_add(increment(&kv, "k").await, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for w in writers {
        w.await.unwrap();
    }
    assert_eq!(value(&kv, "k").await, Some(200));
    assert!(
        decisions.load(Ordering::Relaxed) > 200,
        "8 writers on one key lost no race at all: the test did not race"
    );
}

/// A read taken earlier (`first`) saves the first read; when the key moved since, the write loses and the
/// decision runs again on what is stored now.
#[tokio::test]
async fn a_stale_first_read_is_decided_again_on_the_current_value() {
    let (_nats, kv, _dir) = bucket().await;
    increment(&kv, "k").await;
    let stale = fleet_store::read::<u64>(&kv, "k", Op::StorageQuota)
        .await
        .unwrap();
    increment(&kv, "k").await;
    let mut seen = Vec::new();
    compare_and_set(
        target(&kv, "k"),
        Some(stale),
        |current: Option<Revisioned<u64>>| {
            let n = current.map_or(0, |c| c.value);
            seen.push(n);
            Ok::<_, StoreError>(Edit::Write(n * 10, ()))
        },
    )
    .await
    .unwrap();
    assert_eq!(
        seen,
        vec![1, 2],
        "decided on the stale read, then on the current value"
    );
    assert_eq!(value(&kv, "k").await, Some(20));
}

/// `Keep` writes nothing (the revision stays); `Delete` removes the key at the revision read, and deleting an
/// absent key is done without a write; an absent (deleted) key is then created again.
#[tokio::test]
async fn keep_writes_nothing_and_delete_removes_at_the_revision_read() {
    let (_nats, kv, _dir) = bucket().await;
    increment(&kv, "k").await;
    let before = kv.entry("k").await.unwrap().unwrap().revision;
    let kept: Committed<u64, &str> = compare_and_set(target(&kv, "k"), None, |_| {
        Ok::<_, StoreError>(Edit::Keep("kept"))
    })
    .await
    .unwrap();
    assert_eq!((kept.out, kept.written.is_none()), ("kept", true));
    assert_eq!(kv.entry("k").await.unwrap().unwrap().revision, before);

    let deleted: Committed<u64, ()> =
        compare_and_set(target(&kv, "k"), None, |_| Ok::<_, StoreError>(Edit::Delete(())))
            .await
            .unwrap();
    assert!(deleted.written.is_none());
    assert_eq!(value(&kv, "k").await, None);
    let stream_last = kv.status().await.unwrap().info.state.last_sequence;
    let mut saw = Vec::new();
    compare_and_set(target(&kv, "k"), None, |current: Option<Revisioned<u64>>| {
        saw.push(current.is_some());
        Ok::<_, StoreError>(Edit::Delete(()))
    })
    .await
    .unwrap();
    assert_eq!(saw, vec![false], "a deleted key reads as absent");
    assert_eq!(
        kv.status().await.unwrap().info.state.last_sequence,
        stream_last,
        "deleting an absent key writes nothing"
    );
    assert_eq!(increment(&kv, "k").await, 1, "created again after the delete");
    assert_eq!(value(&kv, "k").await, Some(1));
}

/// Errors that are not a lost race end the loop at once: a value over the limit, a stored value that does not
/// parse, and the decision's own error — each after one decision (or none), with nothing written.
#[tokio::test]
async fn an_error_that_is_not_a_lost_race_is_not_retried() {
    let (_nats, kv, _dir) = bucket().await;
    increment(&kv, "k").await;
    let revision = kv.entry("k").await.unwrap().unwrap().revision;

    let mut decisions = 0;
    let err = compare_and_set(
        Target {
            // One byte short of u64::MAX's 20 digits.
            limit: ("counter", 19),
            ..target(&kv, "k")
        },
        None,
        |_: Option<Revisioned<u64>>| {
            decisions += 1;
            Ok::<_, StoreError>(Edit::Write(u64::MAX, ()))
        },
    )
    .await
    .unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::TooLarge {
                size: 20,
                max: 19,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(decisions, 1);

    #[derive(Debug)]
    enum Mine {
        Store,
        Refused,
    }
    impl From<StoreError> for Mine {
        fn from(_: StoreError) -> Mine {
            Mine::Store
        }
    }
    let mut decisions = 0;
    let err = compare_and_set(target(&kv, "k"), None, |_: Option<Revisioned<u64>>| {
        decisions += 1;
        Err::<Edit<u64, ()>, _>(Mine::Refused)
    })
    .await
    .unwrap_err();
    assert!(matches!(err, Mine::Refused));
    assert_eq!(decisions, 1);
    assert_eq!(
        kv.entry("k").await.unwrap().unwrap().revision,
        revision,
        "nothing written"
    );

    kv.put("bad", "not a counter".into()).await.unwrap();
    let mut decisions = 0;
    let err = compare_and_set(target(&kv, "bad"), None, |_: Option<Revisioned<u64>>| {
        decisions += 1;
        Ok::<_, StoreError>(Edit::Write(1, ()))
    })
    .await
    .unwrap_err();
    assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
    assert_eq!(decisions, 0, "no decision on a value that does not parse");
}
