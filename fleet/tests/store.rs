//! `fleet::store` against a real nats-server (one per test, JetStream on a temp dir).
//!
//! No sleeps synchronise anything: racing tasks are joined, and time bounds are failure guards only. Two waits
//! poll (bounded by the guard) for what is asynchronous by nature: the worker-TTL test for JetStream's `max_age`
//! expiry (the behaviour under test is the passing of time), and the active-set copy test for a watch's delivery
//! of another replica's write.

use std::collections::BTreeSet;
use std::future::Future;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream::DiscardPolicy};
use fleet::nats_server::NatsServer;
use fleet_proto::api::user_key;
use fleet_proto::api::{ApiError, ApiErrorCode, JobId, JobState, ProgressEvent};
use fleet_proto::executa::invoke::ProgressType;
use fleet_proto::util::now_ms;
use fleet_store::index::LIST_SCAN_RECORDS_MAX;
use fleet_store::{
    Acquired, JobFilter, JobPage, JobRecord, ListCursor, Revisioned, Store, StoreError, StoreSettings,
    Transition, WorkerInfo,
};
use futures::FutureExt as _;
use serde_json::{Value, json};
use tempfile::TempDir;

const GUARD: Duration = Duration::from_secs(60);

/// A running server and its store directory (kept alive together).
struct Nats {
    server: NatsServer,
    _dir: TempDir,
}

fn nats() -> Nats {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = NatsServer::start(dir.path()).expect("nats-server (install nats-server >= 2.11)");
    Nats { server, _dir: dir }
}

impl Nats {
    async fn js(&self) -> jetstream::Context {
        // The front's user: fronts create and use the store's resources.
        let client = self
            .server
            .connect(fleet_client::creds::Role::Front)
            .await
            .expect("connect");
        jetstream::new(client)
    }

    /// A store on its own connection (a "replica").
    async fn store(&self, settings: StoreSettings) -> Store {
        Store::open(self.js().await, settings).await.expect("open")
    }
}

async fn guard<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(GUARD, f)
        .await
        .expect("test took longer than its guard")
}

fn job_id() -> JobId {
    JobId::from_bytes(rand::random())
}

fn record(user: &str, tool_id: &str, created_at_ms: u64) -> JobRecord {
    let plugin = tool_id.split('.').next().unwrap_or("p");
    let mut r = JobRecord::queued(job_id(), user, tool_id, plugin, "run", created_at_ms, 1_800_000);
    r.args.insert("text".to_string(), json!("hello"));
    r
}

fn event(seq: u64) -> ProgressEvent {
    ProgressEvent {
        seq,
        kind: ProgressType::Progress,
        data: json!({ "step": seq }),
    }
}

fn state_of(t: &Transition) -> Option<JobState> {
    match t {
        Transition::Done(r) | Transition::Refused(r) => Some(r.value.state),
        Transition::NotFound => None,
    }
}

/// Brings a fresh job of `user` to `state` through allowed transitions.
async fn job_in_state(store: &Store, user: &str, state: JobState) -> JobRecord {
    let r = store
        .create_job(record(user, "echo.run", 1_000), 100)
        .await
        .expect("create")
        .value;
    let mut path = Vec::new();
    match state {
        JobState::Queued => {}
        JobState::Running => path.push(JobState::Running),
        terminal => path.extend([JobState::Running, terminal]),
    }
    for to in path {
        let t = store
            .transition(user, &r.job_id, to, |_| {})
            .await
            .expect("transition");
        assert!(matches!(t, Transition::Done(_)), "setting up {state}: {t:?}");
    }
    r
}

// ---------------------------------------------------------------------------------------------------------------

#[tokio::test]
async fn open_twice_is_idempotent_and_applies_settings() {
    let n = nats();
    guard(Box::pin(async {
        let js = n.js().await;
        let settings = StoreSettings::default();
        let names = [
            "KV_fleet_jobs",
            "KV_fleet_active",
            "KV_fleet_workers",
            "fleet_progress",
            "KV_fleet_manifests",
            "KV_fleet_job_index",
        ];
        let infos = async |js: &jetstream::Context| {
            let mut out = Vec::new();
            for name in names {
                let info = js.get_stream(name).await.expect(name).cached_info().clone();
                out.push((info.config, info.created));
            }
            out
        };
        Store::open(js.clone(), settings.clone())
            .await
            .expect("first open");
        let first = infos(&js).await;
        Store::open(js.clone(), settings.clone())
            .await
            .expect("second open");
        let second = infos(&js).await;
        assert_eq!(first, second, "a second open must change nothing");

        let (jobs, active, workers, progress) = (&first[0].0, &first[1].0, &first[2].0, &first[3].0);
        assert_eq!(jobs.max_messages_per_subject, 1);
        assert_eq!(jobs.max_age, Duration::from_secs(8 * 24 * 3600));
        assert_eq!(jobs.max_message_size, 384 * 1024);
        assert_eq!(jobs.num_replicas, 1);
        assert_eq!(active.max_age, Duration::from_secs(8 * 24 * 3600));
        assert_eq!(workers.max_age, Duration::from_secs(10));
        assert_eq!(progress.subjects, vec!["fleet.v1.progress.>".to_string()]);
        assert_eq!(progress.max_messages_per_subject, 500);
        assert_eq!(progress.max_message_size, 9 * 1024);
        assert_eq!(progress.max_age, Duration::from_secs(8 * 24 * 3600));
        assert_eq!(progress.discard, DiscardPolicy::Old);
        assert_eq!(
            first[4].0.max_age,
            Duration::ZERO,
            "manifests are kept until replaced"
        );
        let index = &first[5].0;
        assert_eq!(index.max_messages_per_subject, 1);
        assert_eq!(index.max_age, Duration::from_secs(8 * 24 * 3600));
        assert_eq!(index.max_message_size, 192 * 1024);
        assert!(
            first.iter().all(|(config, _)| config.allow_direct),
            "every read is a direct get"
        );

        // Create-or-update: a changed setting is applied to the existing resource.
        let changed = StoreSettings {
            worker_ttl: Duration::from_secs(20),
            ..settings
        };
        Store::open(js.clone(), changed)
            .await
            .expect("open with a changed TTL");
        let after = infos(&js).await;
        assert_eq!(after[2].0.max_age, Duration::from_secs(20));
        assert_eq!(after[2].1, first[2].1, "updated in place, not recreated");
    }))
    .await;
}

#[tokio::test]
async fn invalid_settings_are_refused() {
    let n = nats();
    guard(Box::pin(async {
        let js = n.js().await;
        for bad in [
            StoreSettings {
                prefix: "a.b".into(),
                ..Default::default()
            },
            StoreSettings {
                prefix: String::new(),
                ..Default::default()
            },
            StoreSettings {
                replicas: 0,
                ..Default::default()
            },
            StoreSettings {
                job_retention: Duration::from_secs(3600),
                ..Default::default()
            },
            StoreSettings {
                progress_max_per_job: 0,
                ..Default::default()
            },
            StoreSettings {
                job_index_page: 0,
                ..Default::default()
            },
            StoreSettings {
                job_index_page: 65,
                ..Default::default()
            },
            StoreSettings {
                job_index_page: 4,
                max_retained_jobs_per_user: 4,
                ..Default::default()
            },
        ] {
            let err = Store::open(js.clone(), bad.clone())
                .await
                .expect_err("must be refused");
            assert!(matches!(err, StoreError::Settings(_)), "{bad:?}: {err}");
        }
        // The bounds themselves are accepted: the largest page, and a cap one entry above a page.
        for good in [
            StoreSettings {
                job_index_page: 64,
                ..Default::default()
            },
            StoreSettings {
                job_index_page: 4,
                max_retained_jobs_per_user: 5,
                ..Default::default()
            },
        ] {
            assert_eq!(good.validate(), Ok(()), "{good:?}");
        }
        assert_eq!(
            StoreSettings::default().max_retained_jobs_per_user,
            fleet_proto::limits::MAX_RETAINED_JOBS_PER_USER
        );
    }))
    .await;
}

#[test]
fn user_key_is_32_hex_and_stable() {
    let k = user_key("alice@example.com");
    assert_eq!(k.len(), 32);
    assert!(
        k.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    );
    assert_eq!(k, user_key("alice@example.com"));
    assert_ne!(k, user_key("alice@example.con"));
    // sha256("") starts with e3b0c442...
    assert_eq!(user_key(""), "e3b0c44298fc1c149afbf4c8996fb924");
}

#[tokio::test]
async fn create_get_round_trip_and_other_users_see_nothing() {
    let n = nats();
    guard(Box::pin(async {
        let store = n.store(StoreSettings::default()).await;
        // A user id full of characters subjects and keys forbid.
        let user = "ália.*>  tab\there/ünïcode";
        let mut r = record(user, "echo.run", 1_700_000_000_123);
        r.client_tag = Some("tag-1".into());
        let created = store.create_job(r.clone(), 5).await.expect("create");
        assert_eq!(created.value, r);
        assert!(created.revision > 0);

        let got = store
            .get_job(user, &r.job_id)
            .await
            .expect("get")
            .expect("present");
        assert_eq!(got, created);
        assert_eq!(store.get_job("mallory", &r.job_id).await.expect("get"), None);
        assert_eq!(store.get_job(user, &job_id()).await.expect("get"), None);
        assert_eq!(store.active_set(user).await.expect("set"), vec![r.job_id.clone()]);

        // Never overwritten; the failed attempt does not take a second slot or drop the first.
        let err = store.create_job(r.clone(), 5).await.expect_err("duplicate");
        assert!(matches!(err, StoreError::JobExists { .. }), "{err}");
        assert_eq!(store.active_set(user).await.expect("set"), vec![r.job_id.clone()]);

        // Only active records can be created.
        let mut done = record(user, "echo.run", 1);
        done.state = JobState::Succeeded;
        assert!(matches!(
            store.create_job(done, 5).await,
            Err(StoreError::Invalid { .. })
        ));

        let snap = got.value.snapshot(vec![event(3)]);
        assert_eq!(snap.job_id, r.job_id);
        assert_eq!(snap.state, JobState::Queued);
        assert_eq!(snap.created_at, "2023-11-14T22:13:20.123Z");
        assert_eq!(snap.client_tag.as_deref(), Some("tag-1"));
        assert_eq!(snap.method.as_deref(), Some("run"));
        assert_eq!(snap.last_seq, 3);
        assert_eq!(snap.deadline_ms, r.deadline_ms);
        let wire = serde_json::to_value(&snap).expect("json");
        assert_eq!(wire["jobId"], json!(r.job_id.to_string()));
        assert_eq!(wire["tool_id"], json!("echo.run"));
    }))
    .await;
}

#[tokio::test]
async fn too_large_records_are_refused_before_taking_a_slot() {
    let n = nats();
    guard(Box::pin(async {
        let store = n.store(StoreSettings::default()).await;
        let mut r = record("u", "echo.run", 1);
        r.args.insert("blob".into(), json!("x".repeat(400 * 1024)));
        let err = store.create_job(r, 5).await.expect_err("too large");
        assert!(
            matches!(
                err,
                StoreError::TooLarge {
                    what: "job record",
                    ..
                }
            ),
            "{err}"
        );
        assert!(store.active_set("u").await.expect("set").is_empty());

        // A result at the 256 KB cap fits.
        let ok = job_in_state(&store, "u", JobState::Running).await;
        let result = json!({ "text": "y".repeat(256 * 1024 - 20) });
        let t = store
            .transition("u", &ok.job_id, JobState::Succeeded, |r| {
                r.result = Some(result.clone())
            })
            .await
            .expect("transition");
        assert_eq!(state_of(&t), Some(JobState::Succeeded));
    }))
    .await;
}

#[tokio::test]
async fn the_sixth_active_job_is_refused_until_one_ends() {
    let n = nats();
    guard(Box::pin(async {
        let store = n.store(StoreSettings::default()).await;
        let mut ids = Vec::new();
        for i in 0..5 {
            ids.push(
                store
                    .create_job(record("u", "echo.run", i), 5)
                    .await
                    .expect("create")
                    .value
                    .job_id,
            );
        }
        let err = store
            .create_job(record("u", "echo.run", 9), 5)
            .await
            .expect_err("sixth");
        assert!(
            matches!(err, StoreError::QuotaExceeded { active: 5, max: 5 }),
            "{err}"
        );
        assert_eq!(err.to_api_error().code, ApiErrorCode::JobQuotaExceeded);
        // Another user is not affected.
        store
            .create_job(record("v", "echo.run", 9), 5)
            .await
            .expect("other user");

        // Running still counts; a terminal state frees the slot.
        store
            .transition("u", &ids[0], JobState::Running, |_| {})
            .await
            .expect("run");
        assert!(matches!(
            store.create_job(record("u", "echo.run", 9), 5).await,
            Err(StoreError::QuotaExceeded { .. })
        ));
        let t = store
            .transition("u", &ids[0], JobState::Succeeded, |_| {})
            .await
            .expect("finish");
        assert_eq!(state_of(&t), Some(JobState::Succeeded));
        assert_eq!(store.active_set("u").await.expect("set"), ids[1..].to_vec());
        let sixth = store
            .create_job(record("u", "echo.run", 10), 5)
            .await
            .expect("accepted again");
        let mut expected = ids[1..].to_vec();
        expected.push(sixth.value.job_id);
        assert_eq!(store.active_set("u").await.expect("set"), expected);
    }))
    .await;
}

/// Creations of `racer`'s jobs `ids` (as creation times), alternately on `a` and `b`, all at once with a quota of
/// five: the ids created, and how many were refused for the quota (any other outcome fails the test).
async fn race_creations(a: &Store, b: &Store, ids: std::ops::Range<u64>) -> (BTreeSet<JobId>, usize) {
    let mut tasks = tokio::task::JoinSet::new();
    for i in ids {
        let store = if i % 2 == 0 { a.clone() } else { b.clone() };
        tasks.spawn(async move { store.create_job(record("racer", "echo.run", i), 5).await });
    }
    let mut created = BTreeSet::new();
    let mut refused = 0;
    while let Some(joined) = tasks.join_next().await {
        match joined.expect("task") {
            Ok(r) => {
                created.insert(r.value.job_id);
            }
            Err(StoreError::QuotaExceeded { active: 5, max: 5 }) => refused += 1,
            Err(e) => panic!("unexpected error: {e}"),
        }
    }
    (created, refused)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_racing_twenty_creations_admit_exactly_five() {
    let n = nats();
    guard(Box::pin(async {
        let a = n.store(StoreSettings::default()).await;
        let b = n.store(StoreSettings::default()).await;
        let (created, refused) = race_creations(&a, &b, 0..20).await;
        assert_eq!(created.len(), 5);
        assert_eq!(refused, 15);
        let set: BTreeSet<JobId> = a.active_set("racer").await.expect("set").into_iter().collect();
        assert_eq!(set, created);
        let listed = b
            .list_jobs("racer", &JobFilter::default(), 100, None)
            .await
            .expect("list");
        assert!(!listed.truncated);
        assert_eq!(
            listed.jobs.into_iter().map(|r| r.job_id).collect::<BTreeSet<_>>(),
            created
        );
    }))
    .await;
}

#[tokio::test]
async fn every_transition_is_allowed_or_refused_as_the_state_machine_says() {
    let n = nats();
    guard(Box::pin(async {
        let store = n.store(StoreSettings::default()).await;
        let mut done = 0;
        for from in JobState::ALL {
            for to in JobState::ALL {
                let user = format!("{from}-{to}");
                let r = job_in_state(&store, &user, from).await;
                let before = store
                    .get_job(&user, &r.job_id)
                    .await
                    .expect("get")
                    .expect("present");
                let t = store
                    .transition(&user, &r.job_id, to, |rec| {
                        rec.worker = Some("w-1".into());
                        rec.state = JobState::Queued; // ignored: the store sets the state
                        rec.user = "someone else".into(); // ignored: identity is kept
                    })
                    .await
                    .expect("transition");
                if from.can_become(to) {
                    let Transition::Done(after) = t else {
                        panic!("{from} → {to} must be allowed: {t:?}")
                    };
                    assert_eq!(after.value.state, to);
                    assert_eq!(after.value.user, user);
                    assert_eq!(after.value.worker.as_deref(), Some("w-1"));
                    assert!(after.revision > before.revision);
                    if to == JobState::Running {
                        assert!(after.value.started_at_ms.is_some());
                    }
                    assert_eq!(after.value.finished_at_ms.is_some(), to.is_terminal());
                    assert_eq!(store.get_job(&user, &r.job_id).await.expect("get"), Some(after));
                    done += 1;
                } else {
                    assert_eq!(
                        t,
                        Transition::Refused(before.clone()),
                        "{from} → {to} must be refused"
                    );
                    assert_eq!(store.get_job(&user, &r.job_id).await.expect("get"), Some(before));
                }
                // The slot is held exactly while the job is active.
                let state = store
                    .get_job(&user, &r.job_id)
                    .await
                    .expect("get")
                    .expect("present")
                    .value
                    .state;
                let held = store.active_set(&user).await.expect("set").contains(&r.job_id);
                assert_eq!(held, state.is_active(), "{from} → {to}");
            }
        }
        // queued → 5, running → 4.
        assert_eq!(done, 9);
        assert_eq!(
            store
                .transition("nobody", &job_id(), JobState::Running, |_| {})
                .await
                .expect("transition"),
            Transition::NotFound
        );
        let r = job_in_state(&store, "owner", JobState::Queued).await;
        assert_eq!(
            store
                .transition("intruder", &r.job_id, JobState::Cancelled, |_| {})
                .await
                .expect("transition"),
            Transition::NotFound
        );
    }))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_terminal_transitions_have_exactly_one_winner() {
    let n = nats();
    guard(Box::pin(async {
        let a = n.store(StoreSettings::default()).await;
        let b = n.store(StoreSettings::default()).await;
        for from in [JobState::Queued, JobState::Running] {
            let r = job_in_state(&a, "u", from).await;
            let terminals = [
                JobState::Succeeded,
                JobState::Failed,
                JobState::Cancelled,
                JobState::Expired,
            ];
            let mut tasks = tokio::task::JoinSet::new();
            for i in 0..20usize {
                let store = if i % 2 == 0 { a.clone() } else { b.clone() };
                let id = r.job_id.clone();
                let to = terminals[i % terminals.len()];
                tasks.spawn(async move {
                    let t = store
                        .transition("u", &id, to, |rec| {
                            rec.error = Some(ApiError::new(ApiErrorCode::ToolFailed, format!("task {i}")));
                        })
                        .await
                        .expect("transition");
                    (i, to, t)
                });
            }
            let mut winners = Vec::new();
            let mut refused_states = BTreeSet::new();
            while let Some(joined) = tasks.join_next().await {
                let (i, to, t) = joined.expect("task");
                match t {
                    Transition::Done(rec) => winners.push((i, to, rec)),
                    Transition::Refused(rec) => {
                        assert!(rec.value.state.is_terminal(), "refused only by a terminal state");
                        refused_states.insert(rec.value.state);
                    }
                    Transition::NotFound => panic!("the job exists"),
                }
            }
            assert_eq!(
                winners.len(),
                1,
                "exactly one terminal transition wins (from {from})"
            );
            let (i, to, won) = &winners[0];
            let stored = a.get_job("u", &r.job_id).await.expect("get").expect("present");
            assert_eq!(&stored, won);
            assert_eq!(stored.value.state, *to);
            assert_eq!(
                stored.value.error.as_ref().map(|e| e.message.clone()),
                Some(format!("task {i}"))
            );
            assert!(refused_states.iter().all(|s| s == to));
            assert!(a.active_set("u").await.expect("set").is_empty());
        }
    }))
    .await;
}

#[tokio::test]
async fn update_job_writes_active_records_only() {
    let n = nats();
    guard(Box::pin(async {
        let store = n.store(StoreSettings::default()).await;
        let r = job_in_state(&store, "u", JobState::Running).await;
        let updated = store
            .update_job("u", &r.job_id, |rec| {
                rec.last_heartbeat_ms = Some(42);
                rec.last_seq = 7;
                rec.state = JobState::Succeeded; // ignored
                true
            })
            .await
            .expect("update")
            .expect("active");
        assert_eq!(updated.value.last_heartbeat_ms, Some(42));
        assert_eq!(updated.value.last_seq, 7);
        assert_eq!(updated.value.state, JobState::Running);
        assert_eq!(
            store.get_job("u", &r.job_id).await.expect("get"),
            Some(updated.clone())
        );

        // Declined edit: nothing written.
        let same = store
            .update_job("u", &r.job_id, |_| false)
            .await
            .expect("update")
            .expect("active");
        assert_eq!(same, updated);

        store
            .transition("u", &r.job_id, JobState::Cancelled, |_| {})
            .await
            .expect("cancel");
        let terminal = store
            .get_job("u", &r.job_id)
            .await
            .expect("get")
            .expect("present");
        let refused = store
            .update_job("u", &r.job_id, |rec| {
                rec.last_heartbeat_ms = Some(99);
                true
            })
            .await
            .expect("update");
        assert_eq!(refused, None);
        assert_eq!(store.get_job("u", &r.job_id).await.expect("get"), Some(terminal));
        assert_eq!(
            store.update_job("u", &job_id(), |_| true).await.expect("update"),
            None
        );
    }))
    .await;
}

#[tokio::test]
async fn progress_is_a_ring_of_the_newest_500() {
    let n = nats();
    guard(Box::pin(async {
        let store = n.store(StoreSettings::default()).await;
        let id = job_id();
        assert_eq!(
            store.progress("u", &id, 0, 500).await.expect("empty"),
            (Vec::new(), 0)
        );
        for seq in 1..=501 {
            store
                .append_progress("u", &id, &event(seq))
                .await
                .expect("append");
        }
        let seqs = |events: &[ProgressEvent]| events.iter().map(|e| e.seq).collect::<Vec<_>>();

        let (all, last) = store.progress("u", &id, 0, 500).await.expect("all");
        assert_eq!(last, 501);
        assert_eq!(seqs(&all), (2..=501).collect::<Vec<_>>());
        assert_eq!(all[0], event(2));

        let (one, last) = store.progress("u", &id, 0, 1).await.expect("limit 1");
        assert_eq!((seqs(&one), last), (vec![2], 501));
        let (tail, last) = store.progress("u", &id, 499, 500).await.expect("since 499");
        assert_eq!((seqs(&tail), last), (vec![500, 501], 501));
        let (mid, _) = store.progress("u", &id, 250, 10).await.expect("since 250");
        assert_eq!(seqs(&mid), (251..=260).collect::<Vec<_>>());
        let (next, _) = store.progress("u", &id, 1, 1).await.expect("since 1");
        assert_eq!(
            seqs(&next),
            vec![2],
            "since_seq older than the ring: from the oldest kept"
        );
        let (none, last) = store.progress("u", &id, 501, 500).await.expect("nothing new");
        assert_eq!((none.len(), last), (0, 501));

        // A retried publish of the same seq is stored once.
        store.append_progress("u", &id, &event(501)).await.expect("retry");
        let (tail, _) = store.progress("u", &id, 499, 500).await.expect("since 499");
        assert_eq!(seqs(&tail), vec![500, 501]);

        // Another user's view of the same job id is empty; so is another job's.
        assert_eq!(
            store.progress("v", &id, 0, 500).await.expect("other user"),
            (Vec::new(), 0)
        );
        assert_eq!(
            store.progress("u", &job_id(), 0, 500).await.expect("other job"),
            (Vec::new(), 0)
        );

        for bad in [0, 501] {
            let err = store.progress("u", &id, 0, bad).await.expect_err("bad limit");
            assert!(matches!(err, StoreError::Invalid { what: "limit", .. }), "{err}");
        }
        let big = ProgressEvent {
            seq: 600,
            kind: ProgressType::ToolUpdate,
            data: Value::String("z".repeat(9000)),
        };
        let err = store
            .append_progress("u", &id, &big)
            .await
            .expect_err("too large");
        assert!(
            matches!(
                err,
                StoreError::TooLarge {
                    what: "progress event",
                    ..
                }
            ),
            "{err}"
        );
        // An event just under the limit is stored.
        let fits = ProgressEvent {
            seq: 601,
            kind: ProgressType::ToolUpdate,
            data: Value::String("z".repeat(8000)),
        };
        store.append_progress("u", &id, &fits).await.expect("fits");
        let (tail, last) = store.progress("u", &id, 501, 500).await.expect("tail");
        assert_eq!((tail, last), (vec![fits], 601));
    }))
    .await;
}

#[tokio::test]
async fn list_jobs_filters_orders_truncates_and_stays_within_the_user() {
    let n = nats();
    guard(Box::pin(async {
        let store = n.store(StoreSettings::default()).await;
        let mut ids = Vec::new();
        // created_at 1..=6, alternating tools; two tagged; states: 1 succeeded, 2 running, 3 cancelled, rest queued.
        for i in 1..=6u64 {
            let tool = if i % 2 == 0 { "echo.even" } else { "echo.odd" };
            let mut r = record("alice", tool, i * 1000);
            if i == 2 || i == 5 {
                r.client_tag = Some("batch-a".into());
            }
            ids.push(store.create_job(r, 100).await.expect("create").value.job_id);
        }
        store
            .transition("alice", &ids[0], JobState::Succeeded, |_| {})
            .await
            .expect("t");
        store
            .transition("alice", &ids[1], JobState::Running, |_| {})
            .await
            .expect("t");
        store
            .transition("alice", &ids[2], JobState::Cancelled, |_| {})
            .await
            .expect("t");
        for i in 1..=3u64 {
            let mut r = record("bob", "echo.odd", i * 1000 + 500);
            r.client_tag = Some("batch-a".into());
            store.create_job(r, 100).await.expect("bob");
        }

        let list = async |filter: JobFilter, limit: usize| {
            let page = store
                .list_jobs("alice", &filter, limit, None)
                .await
                .expect("list");
            assert!(
                page.jobs.iter().all(|r| r.user == "alice"),
                "never another user's job"
            );
            assert_eq!(page.cursor.is_some(), page.truncated);
            (
                page.jobs
                    .iter()
                    .map(|r| r.created_at_ms / 1000)
                    .collect::<Vec<_>>(),
                page.truncated,
            )
        };
        assert_eq!(
            list(JobFilter::default(), 100).await,
            (vec![6, 5, 4, 3, 2, 1], false)
        );
        assert_eq!(
            list(JobFilter::default(), 6).await,
            (vec![6, 5, 4, 3, 2, 1], false)
        );
        assert_eq!(list(JobFilter::default(), 5).await, (vec![6, 5, 4, 3, 2], true));
        assert_eq!(list(JobFilter::default(), 1).await, (vec![6], true));
        let by_tool = JobFilter {
            tool_id: Some("echo.even".into()),
            ..Default::default()
        };
        assert_eq!(list(by_tool, 100).await, (vec![6, 4, 2], false));
        let one_state = JobFilter {
            states: vec![JobState::Queued],
            ..Default::default()
        };
        assert_eq!(list(one_state, 100).await, (vec![6, 5, 4], false));
        let states = JobFilter {
            states: vec![JobState::Running, JobState::Succeeded],
            ..Default::default()
        };
        assert_eq!(list(states, 100).await, (vec![2, 1], false));
        let tag = JobFilter {
            client_tag: Some("batch-a".into()),
            ..Default::default()
        };
        assert_eq!(list(tag, 100).await, (vec![5, 2], false));
        let tag_prefix = JobFilter {
            client_tag: Some("batch".into()),
            ..Default::default()
        };
        assert_eq!(
            list(tag_prefix, 100).await,
            (vec![], false),
            "clientTag is an exact match"
        );
        let since = JobFilter {
            since_ms: Some(4000),
            ..Default::default()
        };
        assert_eq!(list(since.clone(), 100).await, (vec![6, 5, 4], false));
        assert_eq!(list(since, 2).await, (vec![6, 5], true));
        let combined = JobFilter {
            tool_id: Some("echo.odd".into()),
            states: vec![JobState::Queued, JobState::Cancelled],
            since_ms: Some(2000),
            ..Default::default()
        };
        assert_eq!(list(combined, 100).await, (vec![5, 3], false));

        let bob = store
            .list_jobs("bob", &JobFilter::default(), 100, None)
            .await
            .expect("bob")
            .jobs;
        assert_eq!(bob.len(), 3);
        assert!(bob.iter().all(|r| r.user == "bob"));
        assert_eq!(
            store
                .list_jobs("carol", &JobFilter::default(), 100, None)
                .await
                .expect("carol"),
            JobPage::default()
        );
        assert!(matches!(
            store.list_jobs("alice", &JobFilter::default(), 0, None).await,
            Err(StoreError::Invalid { what: "limit", .. })
        ));
    }))
    .await;
}

/// Creates `count` queued jobs of `user`, created at `first_ms`, `first_ms + 1`, …; their ids, oldest first.
async fn create_jobs(store: &Store, user: &str, count: u64, first_ms: u64) -> Vec<JobId> {
    let mut ids = Vec::new();
    for i in 0..count {
        let r = store
            .create_job(record(user, "echo.run", first_ms + i), 1000)
            .await
            .expect("create");
        ids.push(r.value.job_id);
    }
    ids
}

/// Every page of a listing, following the cursors: the ids, and the number of calls.
async fn list_all(store: &Store, user: &str, filter: &JobFilter, limit: usize) -> (Vec<JobId>, usize) {
    let (mut ids, mut calls, mut cursor) = (Vec::new(), 0, None);
    loop {
        let page = store.list_jobs(user, filter, limit, cursor).await.expect("list");
        calls += 1;
        assert_eq!(
            page.cursor.is_some(),
            page.truncated,
            "a cursor exactly when truncated"
        );
        assert!(page.jobs.len() <= limit);
        assert!(page.jobs.iter().all(|r| r.user == user));
        ids.extend(page.jobs.into_iter().map(|r| r.job_id));
        match page.cursor {
            // A cursor goes over the wire as text.
            Some(c) => cursor = Some(c.to_string().parse::<ListCursor>().expect("cursor text")),
            None => return (ids, calls),
        }
        assert!(calls < 1000, "the cursors never end");
    }
}

#[tokio::test]
async fn list_jobs_pages_with_a_cursor_across_sealed_pages() {
    let n = nats();
    guard(Box::pin(async {
        // Pages of 4: eleven jobs fill two sealed pages and three entries of the open one.
        let store = n
            .store(StoreSettings {
                job_index_page: 4,
                ..Default::default()
            })
            .await;
        let mut ids = Vec::new();
        for i in 1..=11u64 {
            let tool = if i % 3 == 0 { "echo.three" } else { "echo.run" };
            let r = store
                .create_job(record("pager", tool, i * 1000), 1000)
                .await
                .expect("create");
            ids.push(r.value.job_id);
        }
        for id in ids.iter().step_by(2) {
            for to in [JobState::Running, JobState::Succeeded] {
                let t = store.transition("pager", id, to, |_| {}).await.expect("t");
                assert!(matches!(t, Transition::Done(_)), "{t:?}");
            }
        }
        let newest_first =
            |picked: &[usize]| -> Vec<JobId> { picked.iter().rev().map(|i| ids[i - 1].clone()).collect() };
        let all: Vec<usize> = (1..=11).collect();

        // Three at a time: 3 + 3 + 3 + 2, every job once, newest first.
        assert_eq!(
            list_all(&store, "pager", &JobFilter::default(), 3).await,
            (newest_first(&all), 4)
        );
        // One call when the limit covers them all; one per job at limit 1.
        assert_eq!(
            list_all(&store, "pager", &JobFilter::default(), 11).await,
            (newest_first(&all), 1)
        );
        assert_eq!(
            list_all(&store, "pager", &JobFilter::default(), 1).await,
            (newest_first(&all), 11)
        );
        // Filters page the same way: the state on the records, the tool on the index.
        let succeeded = JobFilter {
            states: vec![JobState::Succeeded],
            ..Default::default()
        };
        assert_eq!(
            list_all(&store, "pager", &succeeded, 2).await,
            (newest_first(&[1, 3, 5, 7, 9, 11]), 3)
        );
        let three = JobFilter {
            tool_id: Some("echo.three".into()),
            ..Default::default()
        };
        assert_eq!(
            list_all(&store, "pager", &three, 2).await,
            (newest_first(&[3, 6, 9]), 2)
        );
        let both = JobFilter {
            tool_id: Some("echo.three".into()),
            states: vec![JobState::Queued],
            since_ms: Some(5_000),
            ..Default::default()
        };
        assert_eq!(
            list_all(&store, "pager", &both, 100).await,
            (newest_first(&[6]), 1)
        );

        // A cursor of another index (one that expired, and the user's next job started anew) ends the listing.
        let foreign: ListCursor = "0.5".parse().expect("cursor");
        assert_eq!(
            store
                .list_jobs("pager", &JobFilter::default(), 3, Some(foreign))
                .await
                .expect("list"),
            JobPage::default()
        );
        // A cursor is no key to another user's jobs: bob's own index does not know it.
        let first = store
            .list_jobs("pager", &JobFilter::default(), 3, None)
            .await
            .expect("list");
        create_jobs(&store, "bob", 2, 1).await;
        let bobs = store
            .list_jobs("bob", &JobFilter::default(), 3, first.cursor)
            .await
            .expect("bob");
        assert_eq!(bobs, JobPage::default());
    }))
    .await;
}

#[tokio::test]
async fn a_rarely_matching_filter_pages_within_the_scan_budget() {
    let n = nats();
    guard(Box::pin(async {
        let store = n.store(StoreSettings::default()).await;
        // More jobs than one call reads records of; only the oldest one matches.
        let total = LIST_SCAN_RECORDS_MAX as u64 + 40;
        let ids = create_jobs(&store, "scanner", total, 1_000).await;
        let t = store
            .transition("scanner", &ids[0], JobState::Expired, |_| {})
            .await
            .expect("expire");
        assert!(matches!(t, Transition::Done(_)), "{t:?}");
        let expired = JobFilter {
            states: vec![JobState::Expired],
            ..Default::default()
        };
        let first = store
            .list_jobs("scanner", &expired, 20, None)
            .await
            .expect("first");
        assert!(first.jobs.is_empty());
        assert!(first.truncated, "the budget ran out before the oldest job");
        let second = store
            .list_jobs("scanner", &expired, 20, first.cursor)
            .await
            .expect("second");
        assert_eq!(
            second.jobs.iter().map(|r| r.job_id.clone()).collect::<Vec<_>>(),
            vec![ids[0].clone()]
        );
        assert!(!second.truncated && second.cursor.is_none());
        // Unfiltered, a full page is one call whatever the number of jobs.
        let newest = store
            .list_jobs("scanner", &JobFilter::default(), 100, None)
            .await
            .expect("newest");
        assert_eq!(newest.jobs.len(), 100);
        assert_eq!(newest.jobs[0].job_id, ids[ids.len() - 1]);
        assert!(newest.truncated);
    }))
    .await;
}

/// A cap of 5 jobs per user, indexed in pages of 2.
fn capped_at_five() -> StoreSettings {
    StoreSettings {
        job_index_page: 2,
        max_retained_jobs_per_user: 5,
        ..Default::default()
    }
}

#[tokio::test]
async fn retained_jobs_are_capped_per_user_at_the_boundary() {
    let n = nats();
    guard(Box::pin(async {
        let settings = capped_at_five();
        let retention_ms = u64::try_from(settings.job_retention.as_millis()).expect("ms");
        let store = n.store(settings).await;
        let now = now_ms();
        let kept = create_jobs(&store, "capped", 5, now).await;
        let sixth = record("capped", "echo.run", now + 5);
        let err = store
            .create_job(sixth.clone(), 1000)
            .await
            .expect_err("the sixth is over the cap");
        let StoreError::RetainedQuotaExceeded {
            retained: 5,
            max: 5,
            retry_after_ms,
        } = err
        else {
            panic!("unexpected: {err}");
        };
        assert!(
            retry_after_ms > retention_ms - 60_000 && retry_after_ms <= retention_ms,
            "room frees when the oldest page leaves the window: {retry_after_ms}"
        );
        assert!(err.retryable());
        let api = err.to_api_error();
        assert_eq!(api.code, ApiErrorCode::JobQuotaExceeded);
        assert_eq!(
            api.details,
            Some(json!({"retained": 5, "max": 5, "retry_after_ms": retry_after_ms, "retriable": true}))
        );
        // Refused means nothing stays: no record, no slot, no listing.
        assert_eq!(store.get_job("capped", &sixth.job_id).await.expect("get"), None);
        assert!(
            !store
                .active_set("capped")
                .await
                .expect("set")
                .contains(&sixth.job_id)
        );
        let (listed, _) = list_all(&store, "capped", &JobFilter::default(), 100).await;
        assert_eq!(listed, kept.iter().rev().cloned().collect::<Vec<_>>());
        // The cap is per user.
        create_jobs(&store, "uncapped", 1, now).await;
        // Finishing jobs frees no room: the cap counts jobs kept, not jobs active.
        for id in &kept {
            store
                .transition("capped", id, JobState::Cancelled, |_| {})
                .await
                .expect("cancel");
        }
        assert!(matches!(
            store
                .create_job(record("capped", "echo.run", now + 6), 1000)
                .await,
            Err(StoreError::RetainedQuotaExceeded { retained: 5, .. })
        ));
    }))
    .await;
}

/// The bytes a terminal record of `store`'s keeps, as its storage account counts them (ring apart).
fn record_charge(written: &Revisioned<JobRecord>) -> u64 {
    serde_json::to_vec(&written.value).expect("json").len() as u64
        + fleet_store::settings::STORED_MESSAGE_OVERHEAD
}

fn done(t: Transition) -> Revisioned<JobRecord> {
    match t {
        Transition::Done(r) => r,
        other => panic!("not written: {other:?}"),
    }
}

#[tokio::test]
async fn job_bytes_are_capped_per_user_at_the_boundary() {
    let n = nats();
    guard(Box::pin(async {
        let base = StoreSettings::default();
        let reserve = base.job_storage_reserve();
        // Two active jobs' reserves and 64 KiB: a third active job is over; a finished small job leaves room.
        let margin = 64 * 1024;
        let settings = StoreSettings {
            max_job_bytes_per_user: 2 * reserve + margin,
            ..base
        };
        let kept_ms = settings.job_storage_kept_ms();
        let store = n.store(settings).await;
        let u = "hoarder";
        let now = now_ms();
        let a = store
            .create_job(record(u, "echo.run", now), 100)
            .await
            .expect("a")
            .value;
        let b = store
            .create_job(record(u, "echo.run", now), 100)
            .await
            .expect("b")
            .value;
        assert_eq!(store.stored_job_bytes(u).await.expect("account"), 2 * reserve);
        let third = record(u, "echo.run", now);
        let err = store
            .create_job(third.clone(), 100)
            .await
            .expect_err("a third reserve is over the cap");
        let StoreError::StorageQuotaExceeded {
            stored,
            reserve: r,
            max,
            retry_after_ms,
        } = err
        else {
            panic!("unexpected: {err}");
        };
        assert_eq!((stored, r, max), (2 * reserve, reserve, 2 * reserve + margin));
        // Room frees when the hour of these jobs leaves the account: its end plus how long its data is kept.
        assert!(
            retry_after_ms > kept_ms && retry_after_ms <= kept_ms + fleet_store::settings::STORAGE_SPAN_MS,
            "{retry_after_ms}"
        );
        assert!(err.retryable());
        let api = err.to_api_error();
        assert_eq!(api.code, ApiErrorCode::JobQuotaExceeded);
        assert_eq!(
            api.details,
            Some(json!({
                "stored_bytes": stored, "job_reserve_bytes": reserve, "max_bytes": max,
                "retry_after_ms": retry_after_ms, "retriable": true
            }))
        );
        // Refused means nothing stays: no record, no slot, nothing charged.
        assert_eq!(store.get_job(u, &third.job_id).await.expect("get"), None);
        assert!(!store.active_set(u).await.expect("set").contains(&third.job_id));
        assert_eq!(store.stored_job_bytes(u).await.expect("account"), 2 * reserve);
        // The cap is per user.
        store
            .create_job(record("bystander", "echo.run", now), 100)
            .await
            .expect("another user");

        // A job its worker finishes: its reserve becomes its record and the ring its worker counted.
        store
            .transition(u, &a.job_id, JobState::Running, |_| {})
            .await
            .expect("start");
        let a_done = done(
            store
                .transition(u, &a.job_id, JobState::Succeeded, |r| {
                    r.result = Some(json!({"text": "x".repeat(1000)}));
                    r.last_seq = 3;
                    r.progress_bytes = Some(1_234);
                })
                .await
                .expect("succeed"),
        );
        let a_kept = record_charge(&a_done) + 1_234;
        assert!(a_kept < margin);
        assert_eq!(
            store.stored_job_bytes(u).await.expect("account"),
            reserve + a_kept
        );
        // Room for the third now, to the byte: reserve + a's bytes + reserve ≤ the cap.
        let c = store
            .create_job(third, 100)
            .await
            .expect("fits after a finished")
            .value;
        assert_eq!(
            store.stored_job_bytes(u).await.expect("account"),
            2 * reserve + a_kept
        );

        // A job finished by someone else (a cancel): its ring is charged at its bound for the events stored.
        for seq in 1..=3 {
            store
                .append_progress(u, &b.job_id, &event(seq))
                .await
                .expect("event");
        }
        let b_done = done(
            store
                .finish(u, &b.job_id, JobState::Cancelled, |_| {})
                .await
                .expect("cancel"),
        );
        assert_eq!(b_done.value.last_seq, 3);
        let b_kept = record_charge(&b_done) + store.settings().ring_storage_bound(3);
        assert_eq!(
            store.stored_job_bytes(u).await.expect("account"),
            reserve + a_kept + b_kept
        );
        // A second terminal write is refused, and charges nothing more.
        assert!(matches!(
            store.transition(u, &b.job_id, JobState::Failed, |_| {}).await,
            Ok(Transition::Refused(_))
        ));
        store
            .transition(u, &c.job_id, JobState::Cancelled, |_| {})
            .await
            .expect("cancel c");
        let account = store.stored_job_bytes(u).await.expect("account");
        assert!(
            account < 3 * margin,
            "no reserve left once every job ended: {account}"
        );
    }))
    .await;
}

/// A job admitted by a version without the storage account reserved nothing: its terminal write settles nothing,
/// so the reserves of the jobs admitted since are never taken for its.
#[tokio::test]
async fn a_job_admitted_before_the_account_settles_nothing() {
    let n = nats();
    guard(Box::pin(async {
        let store = n.store(StoreSettings::default()).await;
        let reserve = store.settings().job_storage_reserve();
        let u = "upgraded";
        let now = now_ms();
        let old = store
            .create_job(record(u, "echo.run", now - 10), 100)
            .await
            .expect("old")
            .value;
        // The head as the version before wrote it: no account.
        let index = n
            .js()
            .await
            .get_key_value(format!("{}_job_index", store.settings().prefix))
            .await
            .expect("index bucket");
        let key = user_key(u);
        let mut head: Value =
            serde_json::from_slice(&index.get(&key).await.expect("get").expect("head")).expect("json");
        let fields = head.as_object_mut().expect("object");
        assert!(fields.remove("stored").is_some() && fields.remove("stored_since_ms").is_some());
        index
            .put(&key, serde_json::to_vec(&head).expect("json").into())
            .await
            .expect("put");
        assert_eq!(store.stored_job_bytes(u).await.expect("account"), 0);
        // A job of the same hour admitted now reserves; the old job's end leaves that reserve alone.
        let new = store
            .create_job(record(u, "echo.run", now), 100)
            .await
            .expect("new")
            .value;
        assert_eq!(store.stored_job_bytes(u).await.expect("account"), reserve);
        store
            .transition(u, &old.job_id, JobState::Cancelled, |_| {})
            .await
            .expect("cancel old");
        assert_eq!(store.stored_job_bytes(u).await.expect("account"), reserve);
        let written = done(
            store
                .transition(u, &new.job_id, JobState::Cancelled, |_| {})
                .await
                .expect("cancel new"),
        );
        assert_eq!(
            store.stored_job_bytes(u).await.expect("account"),
            record_charge(&written)
        );
    }))
    .await;
}

#[tokio::test]
async fn job_bytes_of_hours_whose_data_is_gone_leave_the_account() {
    let n = nats();
    guard(Box::pin(async {
        let base = StoreSettings::default();
        let reserve = base.job_storage_reserve();
        let kept_ms = base.job_storage_kept_ms();
        // Room for exactly one active job.
        let store = n
            .store(StoreSettings {
                max_job_bytes_per_user: reserve,
                ..base
            })
            .await;
        let u = "returning";
        let now = now_ms();
        // A job created so long ago that its data can no longer be stored (its hour ended more than the kept time
        // ago) still holds its reserve until the next admission looks.
        let old = record(
            u,
            "echo.run",
            now - kept_ms - 2 * fleet_store::settings::STORAGE_SPAN_MS,
        );
        store.create_job(old.clone(), 100).await.expect("old");
        store
            .transition(u, &old.job_id, JobState::Cancelled, |_| {})
            .await
            .expect("cancel");
        // One active reserve fits exactly; the old hour left the account at this admission.
        let fresh = store
            .create_job(record(u, "echo.run", now), 100)
            .await
            .expect("fits")
            .value;
        assert_eq!(store.stored_job_bytes(u).await.expect("account"), reserve);
        // And the boundary: while it is active, nothing else fits.
        assert!(matches!(
            store.create_job(record(u, "echo.run", now), 100).await,
            Err(StoreError::StorageQuotaExceeded { stored, .. }) if stored == reserve
        ));
        store
            .transition(u, &fresh.job_id, JobState::Cancelled, |_| {})
            .await
            .expect("cancel");
    }))
    .await;
}

#[tokio::test]
async fn room_frees_a_page_at_a_time_as_jobs_leave_the_retention() {
    let n = nats();
    guard(Box::pin(async {
        let store = n.store(capped_at_five()).await;
        let now = now_ms();
        let day = 24 * 3600 * 1000;
        // Four jobs created 9 days ago (two sealed pages), then new ones: each old page stops counting when the
        // cap is reached, so exactly five jobs of the window fit.
        create_jobs(&store, "veteran", 4, now - 9 * day).await;
        let fresh = create_jobs(&store, "veteran", 5, now).await;
        let err = store
            .create_job(record("veteran", "echo.run", now + 5), 1000)
            .await
            .expect_err("five jobs of the window are the cap");
        assert!(
            matches!(
                err,
                StoreError::RetainedQuotaExceeded {
                    retained: 5,
                    max: 5,
                    ..
                }
            ),
            "{err}"
        );
        // Listing within the 7-day lookback shows the five.
        let week = JobFilter {
            since_ms: Some(now - 7 * day),
            ..Default::default()
        };
        let (listed, _) = list_all(&store, "veteran", &week, 20).await;
        assert_eq!(listed, fresh.iter().rev().cloned().collect::<Vec<_>>());
    }))
    .await;
}

#[tokio::test]
async fn view_job_reads_the_record_and_the_ring_and_freezes_a_finished_job() {
    let n = nats();
    guard(Box::pin(async {
        let store = n.store(StoreSettings::default()).await;
        let id = job_in_state(&store, "viewer", JobState::Running).await.job_id;
        let view = async |since: u64, limit: usize, known: Option<std::sync::Arc<JobRecord>>| {
            let v = store
                .view_job("viewer", &id, since, limit, known)
                .await
                .expect("view")
                .expect("the job exists");
            let seqs: Vec<u64> = v.events.iter().map(|e| e.seq).collect();
            (seqs, v.last_seq)
        };
        let fresh = store
            .view_job("viewer", &id, 0, 500, None)
            .await
            .expect("view")
            .expect("exists");
        assert_eq!(
            (fresh.record.state, fresh.events.len(), fresh.last_seq),
            (JobState::Running, 0, 0)
        );
        assert!(fresh.record_bytes > 0);
        for seq in 1..=5 {
            store
                .append_progress("viewer", &id, &event(seq))
                .await
                .expect("append");
        }
        // Running: everything stored is due; the newest alone; nothing new; a slice cut by the limit ends at the cut.
        assert_eq!(view(0, 500, None).await, (vec![1, 2, 3, 4, 5], 5));
        assert_eq!(view(4, 500, None).await, (vec![5], 5));
        assert_eq!(view(5, 500, None).await, (vec![], 5));
        assert_eq!(view(9, 500, None).await, (vec![], 5));
        assert_eq!(view(1, 2, None).await, (vec![2, 3], 3));
        assert_eq!(
            view(0, 5, None).await,
            (vec![1, 2, 3, 4, 5], 5),
            "exactly the limit is not cut"
        );
        assert_eq!(view(0, 4, None).await, (vec![1, 2, 3, 4], 4));

        // Cancelled elsewhere with the progress frozen at 3: what the worker appends after is never shown.
        let t = store
            .transition("viewer", &id, JobState::Cancelled, |r| r.last_seq = 3)
            .await
            .expect("cancel");
        assert!(matches!(t, Transition::Done(_)), "{t:?}");
        store
            .append_progress("viewer", &id, &event(6))
            .await
            .expect("late");
        let done = store
            .view_job("viewer", &id, 0, 500, None)
            .await
            .expect("view")
            .expect("exists");
        assert_eq!(done.record.state, JobState::Cancelled);
        let cases = [
            (0, 500, (vec![1, 2, 3], 3)),
            (2, 500, (vec![3], 3)),
            (3, 500, (vec![], 3)),
            (5, 500, (vec![], 3)),
            (0, 2, (vec![1, 2], 2)),
            (0, 3, (vec![1, 2, 3], 3)),
        ];
        for (since, limit, want) in &cases {
            assert_eq!(
                &view(*since, *limit, None).await,
                want,
                "since {since} limit {limit}"
            );
            // The same from the record a caller kept (a finished record is never written again).
            assert_eq!(
                &view(*since, *limit, Some(done.record.clone())).await,
                want,
                "kept, since {since} limit {limit}"
            );
        }
        let kept = store
            .view_job("viewer", &id, 3, 500, Some(done.record.clone()))
            .await
            .expect("view")
            .expect("exists");
        assert_eq!(
            (kept.record_bytes, &kept.record),
            (0, &done.record),
            "nothing was read"
        );
        assert_eq!(kept.into_snapshot().last_seq, 3);

        // A kept record serves only its own user and job.
        assert_eq!(
            store
                .view_job("intruder", &id, 0, 500, Some(done.record.clone()))
                .await
                .expect("view"),
            None
        );
        assert_eq!(
            store
                .view_job("viewer", &job_id(), 0, 500, Some(done.record.clone()))
                .await
                .expect("view"),
            None
        );
        // A kept record that is not terminal is not trusted: the store's record is read.
        let mut running = (*done.record).clone();
        running.state = JobState::Running;
        let read = store
            .view_job("viewer", &id, 0, 500, Some(std::sync::Arc::new(running)))
            .await
            .expect("view")
            .expect("exists");
        assert_eq!(read.record.state, JobState::Cancelled);
        for bad in [0, 501] {
            assert!(matches!(
                store.view_job("viewer", &id, 0, bad, None).await,
                Err(StoreError::Invalid { what: "limit", .. })
            ));
        }
    }))
    .await;
}

#[tokio::test]
async fn heal_drops_dangling_and_finished_ids_after_the_grace() {
    let n = nats();
    guard(Box::pin(async {
        // Two replicas of one deployment differing only in the orphan grace (not a resource setting).
        let patient = n.store(StoreSettings::default()).await;
        let eager = n
            .store(StoreSettings {
                orphan_slot_grace: Duration::ZERO,
                ..Default::default()
            })
            .await;
        let real = patient
            .create_job(record("u", "echo.run", 1), 5)
            .await
            .expect("create")
            .value
            .job_id;
        // A replica that died between taking the slot and creating the record.
        let dangling = job_id();
        let acquired = patient.acquire_slot("u", &dangling, 5).await.expect("slot");
        assert!(matches!(acquired, Acquired::New { .. }));
        assert!(matches!(
            patient.acquire_slot("u", &dangling, 5).await,
            Ok(Acquired::Already { .. })
        ));
        assert_eq!(
            patient.active_set("u").await.expect("set"),
            vec![real.clone(), dangling.clone()]
        );

        assert_eq!(
            patient.heal_active_set("u").await.expect("heal"),
            0,
            "within the grace: kept"
        );
        assert_eq!(eager.heal_active_set("u").await.expect("heal"), 1);
        assert_eq!(eager.active_set("u").await.expect("set"), vec![real.clone()]);
        assert_eq!(eager.heal_active_set("u").await.expect("heal"), 0);
        assert_eq!(eager.heal_active_set("nobody").await.expect("heal"), 0);

        // A finished job whose slot was not given back (the replica died after the terminal write).
        let done = job_in_state(&patient, "u", JobState::Running).await.job_id;
        patient
            .transition("u", &done, JobState::Failed, |_| {})
            .await
            .expect("fail");
        patient
            .acquire_slot("u", &done, 5)
            .await
            .expect("re-take the slot, as if never released");
        assert_eq!(
            patient.heal_active_set("u").await.expect("heal"),
            1,
            "terminal ids go regardless of the grace"
        );
        assert_eq!(patient.active_set("u").await.expect("set"), vec![real.clone()]);

        // Admission heals a full set before refusing: 4 real + 1 dangling, the 5th real job is admitted.
        for i in 0..3 {
            eager
                .create_job(record("u", "echo.run", 10 + i), 5)
                .await
                .expect("create");
        }
        eager
            .acquire_slot("u", &job_id(), 5)
            .await
            .expect("dangling slot");
        assert_eq!(eager.active_set("u").await.expect("set").len(), 5);
        eager
            .create_job(record("u", "echo.run", 20), 5)
            .await
            .expect("admitted after healing");
        let err = eager
            .create_job(record("u", "echo.run", 21), 5)
            .await
            .expect_err("full of real jobs");
        assert!(
            matches!(err, StoreError::QuotaExceeded { active: 5, max: 5 }),
            "{err}"
        );
    }))
    .await;
}

#[tokio::test]
async fn active_jobs_lists_every_users_queued_and_running_jobs() {
    let n = nats();
    guard(Box::pin(async {
        let store = n.store(StoreSettings::default()).await;
        assert!(store.active_jobs().await.expect("empty").is_empty());
        let mut expected = BTreeSet::new();
        for user in ["u1", "u2", "u3"] {
            expected.insert(job_in_state(&store, user, JobState::Queued).await.job_id);
            expected.insert(job_in_state(&store, user, JobState::Running).await.job_id);
            job_in_state(&store, user, JobState::Expired).await;
            job_in_state(&store, user, JobState::Succeeded).await;
        }
        let active: Vec<Revisioned<JobRecord>> = store.active_jobs().await.expect("active");
        assert!(active.iter().all(|r| r.value.state.is_active()));
        assert_eq!(
            active
                .into_iter()
                .map(|r| r.value.job_id)
                .collect::<BTreeSet<_>>(),
            expected
        );
    }))
    .await;
}

fn worker(id: &str, running: usize) -> WorkerInfo {
    WorkerInfo {
        id: id.to_string(),
        capacity_long_jobs: 3,
        long_jobs_running: running,
        sessions_warm: vec![(user_key("u"), "echo.run".to_string())],
        started_at_ms: 1,
        seal_key: None,
    }
}

#[tokio::test]
async fn workers_register_refresh_and_leave() {
    let n = nats();
    guard(Box::pin(async {
        let store = n.store(StoreSettings::default()).await;
        assert!(store.live_workers().await.expect("none").is_empty());
        store.heartbeat_worker(&worker("w-b", 0)).await.expect("b");
        store.heartbeat_worker(&worker("w-a", 0)).await.expect("a");
        store.heartbeat_worker(&worker("w-a", 2)).await.expect("a again");
        assert_eq!(
            store.live_workers().await.expect("live"),
            vec![worker("w-a", 2), worker("w-b", 0)]
        );

        store.remove_worker("w-a").await.expect("remove");
        assert_eq!(store.live_workers().await.expect("live"), vec![worker("w-b", 0)]);
        store.heartbeat_worker(&worker("w-a", 1)).await.expect("back");
        assert_eq!(store.live_workers().await.expect("live").len(), 2);

        // The warm-session summary is bounded.
        let mut big = worker("w-c", 0);
        big.sessions_warm = (0..1000)
            .map(|i| (user_key(&i.to_string()), format!("tool.{i}")))
            .collect();
        store.heartbeat_worker(&big).await.expect("big");
        let live = store.live_workers().await.expect("live");
        let c = live.iter().find(|w| w.id == "w-c").expect("w-c");
        assert_eq!(
            c.sessions_warm.len(),
            fleet_store::settings::WORKER_WARM_SESSIONS_MAX
        );

        for bad in ["", "a.b", "a b", "a*"] {
            assert!(matches!(
                store.heartbeat_worker(&worker(bad, 0)).await,
                Err(StoreError::Invalid { .. })
            ));
            assert!(matches!(
                store.remove_worker(bad).await,
                Err(StoreError::Invalid { .. })
            ));
        }
    }))
    .await;
}

/// Expiry is JetStream's `max_age` on the workers bucket (= `worker_ttl`): a worker that stops refreshing its key
/// disappears without anyone deleting it. Polled with a deadline — the passing of time is what is tested.
#[tokio::test]
async fn a_worker_that_stops_heartbeating_expires() {
    let n = nats();
    guard(Box::pin(async {
        let settings = StoreSettings {
            prefix: "ttl".into(),
            worker_ttl: Duration::from_secs(1),
            ..Default::default()
        };
        let store = n.store(settings).await;
        store
            .heartbeat_worker(&worker("w-1", 0))
            .await
            .expect("heartbeat");
        let registered = Instant::now();
        assert_eq!(store.live_workers().await.expect("live").len(), 1);
        let deadline = registered + Duration::from_secs(15);
        loop {
            if store.live_workers().await.expect("live").is_empty() {
                break;
            }
            assert!(Instant::now() < deadline, "the worker key never expired");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(
            registered.elapsed() >= Duration::from_millis(900),
            "expired before its TTL"
        );
    }))
    .await;
}

#[tokio::test]
async fn manifests_are_recorded_by_tool_id() {
    let n = nats();
    guard(Box::pin(async {
        let store = n.store(StoreSettings::default()).await;
        let manifest = |tool: &str| -> fleet_proto::executa::manifest::Manifest {
            serde_json::from_value(json!({ "tools": [{ "name": tool, "description": "does it" }] }))
                .expect("manifest")
        };
        assert_eq!(store.manifest("echo").await.expect("get"), None);
        assert!(store.manifests().await.expect("list").is_empty());
        // Tool ids with characters a key forbids.
        store
            .put_manifest("@scope/echo plugin", &manifest("run"))
            .await
            .expect("put");
        store.put_manifest("calc", &manifest("add")).await.expect("put");
        store
            .put_manifest("calc", &manifest("sum"))
            .await
            .expect("replace");
        assert_eq!(store.manifest("calc").await.expect("get"), Some(manifest("sum")));
        assert_eq!(
            store.manifests().await.expect("list"),
            vec![
                ("@scope/echo plugin".to_string(), manifest("run")),
                ("calc".to_string(), manifest("sum"))
            ]
        );
    }))
    .await;
}

/// A front answers `tools.list` from its copy of the manifests, kept by a watch: only once the copy holds every
/// write the bucket has (one look at its last sequence per call); until then, and once the watch stops, by a scan.
/// Either way a manifest whose put was acknowledged is in the very next answer.
#[tokio::test]
async fn manifests_are_answered_from_the_watched_copy_once_it_is_complete() {
    let n = nats();
    guard(Box::pin(async {
        let store = n.store(StoreSettings::default()).await;
        let writer = n.store(StoreSettings::default()).await;
        let manifest = |tool: &str| -> fleet_proto::executa::manifest::Manifest {
            serde_json::from_value(json!({ "tools": [{ "name": tool, "description": "does it" }] }))
                .expect("manifest")
        };
        let ids = |list: Vec<(String, fleet_proto::executa::manifest::Manifest)>| -> Vec<String> {
            list.into_iter().map(|(id, _)| id).collect()
        };
        writer.put_manifest("a", &manifest("x")).await.expect("put");
        let watch = store.watch_manifests();
        // Right after the watch starts, whether or not it has caught up: the acknowledged put is listed.
        assert_eq!(ids(store.manifests().await.expect("list")), ["a"]);
        let deadline = Instant::now() + GUARD;
        while !store.manifests_copied().await {
            assert!(
                Instant::now() < deadline,
                "failure guard: the copy never caught up"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let scans = store.manifest_scans();
        for _ in 0..5 {
            assert_eq!(ids(store.manifests().await.expect("list")), ["a"]);
        }
        assert_eq!(store.manifest_scans(), scans, "answered from the copy");
        // Another replica's writes are in the next answer at once (copied, or scanned while the copy is behind).
        writer.put_manifest("b", &manifest("y")).await.expect("put");
        writer.delete_manifest("a").await.expect("delete");
        assert_eq!(ids(store.manifests().await.expect("list")), ["b"]);
        // The watch stopped: scans again.
        watch.abort();
        let _ = watch.await;
        let scans = store.manifest_scans();
        assert_eq!(ids(store.manifests().await.expect("list")), ["b"]);
        assert_eq!(store.manifest_scans(), scans + 1, "a scan once the watch stopped");
    }))
    .await;
}

/// Direct gets — every KV read — may be answered by any replica, and a follower that has not applied the latest
/// writes answers with an older revision or "absent" (JetStream gives direct gets no read-after-write). A
/// compare-and-set write is safe on such a read (the leader refuses its stale revision); a decision that writes
/// nothing is not, so the loop takes it on the leader's copy. Which replica answers a direct get cannot be chosen,
/// so the stale read is handed to the loop as its first read — exactly what a lagging follower would have said.
#[tokio::test]
async fn a_decision_that_writes_nothing_is_taken_on_the_leaders_copy_of_a_replicated_key() {
    use fleet_store::cas::{Edit, Target, compare_and_set};
    use fleet_store::{Op, Provision};

    let dir = tempfile::tempdir().expect("tempdir");
    let port = fleet::nats_server::free_port().expect("port");
    let server = NatsServer::start_cluster(dir.path(), 3, port).expect("a 3-node nats-server cluster");
    let client = server
        .connect(fleet_client::creds::Role::Front)
        .await
        .expect("connect");
    guard(Box::pin(async {
        let settings = StoreSettings {
            replicas: 3,
            ..StoreSettings::default()
        };
        let kv = fleet_store::open_kv(
            &jetstream::new(client),
            settings.jobs_kv_config(),
            Provision::Create,
        )
        .await
        .expect("an R3 bucket");
        assert!(fleet_store::replicated(&kv));
        let target = Target {
            kv: &kv,
            key: "k",
            op: Op::GetJob,
            limit: ("value", 1024),
        };
        // The revision a "keep" decision saw, and whether it saw the key at all.
        let keep_seen =
            |current: Option<Revisioned<Value>>| Ok::<_, StoreError>(Edit::Keep(current.map(|c| c.revision)));

        // The leader's read: absent, then each write's revision, then absent again after a delete.
        assert_eq!(
            fleet_store::read_current::<Value>(&kv, "k", Op::GetJob)
                .await
                .expect("read"),
            None
        );
        let first = kv
            .put("k", json!({"v": 1}).to_string().into())
            .await
            .expect("put");
        let second = kv
            .update("k", json!({"v": 2}).to_string().into(), first)
            .await
            .expect("update");
        let leader = fleet_store::read_current::<Value>(&kv, "k", Op::GetJob)
            .await
            .expect("read")
            .expect("present");
        assert_eq!((leader.revision, leader.value), (second, json!({"v": 2})));

        // A follower that has not seen the key's creation says "absent": the decision is taken again on the
        // leader's copy.
        let kept = compare_and_set(target, Some(None), keep_seen).await.expect("cas");
        assert_eq!(kept.out, Some(second), "a stale \"absent\" decided alone");
        // A refusal is a decision that writes nothing too.
        let refused = compare_and_set(
            target,
            Some(None),
            |current: Option<Revisioned<Value>>| match current {
                // What a full quota looks like to a decision.
                None => Err(StoreError::QuotaExceeded { active: 5, max: 5 }),
                Some(c) => Ok(Edit::Keep(Some(c.revision))),
            },
        )
        .await;
        assert_eq!(refused.expect("decided on the leader's copy").out, Some(second));
        // One that has not seen the last write shows the first revision.
        let stale = Revisioned {
            value: json!({"v": 1}),
            revision: first,
        };
        let kept = compare_and_set(target, Some(Some(stale.clone())), keep_seen)
            .await
            .expect("cas");
        assert_eq!(kept.out, Some(second), "a stale revision decided alone");
        // A read that agrees with the leader is kept as it is.
        let current = Revisioned {
            value: json!({"v": 2}),
            revision: second,
        };
        let kept = compare_and_set(target, Some(Some(current)), keep_seen)
            .await
            .expect("cas");
        assert_eq!(kept.out, Some(second));

        // "Delete it if present", decided on a stale "absent", deletes the key the leader has.
        let deleted = compare_and_set(target, Some(None), |current: Option<Revisioned<Value>>| {
            Ok::<_, StoreError>(Edit::Delete(current.is_some()))
        })
        .await
        .expect("cas");
        assert!(deleted.out, "the decision saw the leader's copy");
        assert_eq!(
            fleet_store::read_current::<Value>(&kv, "k", Op::GetJob)
                .await
                .expect("read"),
            None
        );
        // And now "absent" is the leader's answer too: kept.
        let kept = compare_and_set(target, Some(None), keep_seen).await.expect("cas");
        assert_eq!(kept.out, None);
        // A write decided on a stale read is refused by the leader and decided again on a fresh read.
        let written = compare_and_set(target, Some(Some(stale)), |current: Option<Revisioned<Value>>| {
            Ok::<_, StoreError>(Edit::Write(json!({"v": 3}), current.map(|c| c.revision)))
        })
        .await
        .expect("cas");
        assert_eq!(
            written.out, None,
            "written over the delete, not over the stale revision"
        );
    }))
    .await;
}

/// A compare-and-set started from a stale guess (a cache's copy older than the key) loses nothing: its write at
/// the guessed revision is refused, the key is read and the decision taken again on it; a decision that writes
/// nothing taken on a stale guess is taken again on the leader's copy; a current guess is decided on once.
#[tokio::test]
async fn a_compare_and_set_from_a_stale_guess_decides_again_on_the_stored_value() {
    use fleet_store::Op;
    use fleet_store::cas::{Edit, Target, compare_and_set_guessed};
    let n = nats();
    guard(Box::pin(async {
        let js = n.js().await;
        let kv = js
            .create_key_value(async_nats::jetstream::kv::Config {
                bucket: "fleet_cas_guess".into(),
                history: 1,
                ..Default::default()
            })
            .await
            .expect("bucket");
        let target = Target {
            kv: &kv,
            key: "k",
            op: Op::AcquireSlot,
            limit: ("test value", 1024),
        };
        let r1 = kv.put("k", br#"{"n":1}"#.to_vec().into()).await.expect("put");
        let r2 = kv.put("k", br#"{"n":2}"#.to_vec().into()).await.expect("put");
        let stale = Revisioned {
            value: json!({"n": 1}),
            revision: r1,
        };

        // A write: decided on the guess (n = 1), refused, decided again on the stored value (n = 2).
        let mut seen = Vec::new();
        let committed = compare_and_set_guessed(
            target,
            Some(stale.clone()),
            |current: Option<Revisioned<Value>>| {
                let current = current.expect("the key exists");
                seen.push((current.value["n"].as_u64().unwrap_or(0), current.revision));
                let next = current.value["n"].as_u64().unwrap_or(0) + 1;
                Ok::<_, StoreError>(Edit::Write(json!({ "n": next }), next))
            },
        )
        .await
        .expect("compare-and-set");
        assert_eq!(seen, vec![(1, r1), (2, r2)]);
        assert_eq!(
            committed.out, 3,
            "the update of the stored value, not of the guess"
        );
        let written = committed.written.expect("written");
        assert!(written.revision > r2);
        let stored = kv.entry("k").await.expect("entry").expect("present");
        assert_eq!(stored.value.as_ref(), br#"{"n":3}"#);

        // A refusal taken on the stale guess is checked on the stored value, where the decision differs.
        let mut seen = Vec::new();
        let refused = compare_and_set_guessed(target, Some(stale), |current: Option<Revisioned<Value>>| {
            let n = current.expect("the key exists").value["n"].as_u64().unwrap_or(0);
            seen.push(n);
            if n < 3 {
                Err(StoreError::QuotaExceeded { active: 5, max: 5 })
            } else {
                Ok(Edit::Keep(n))
            }
        })
        .await
        .expect("the stored value is not full");
        assert_eq!(seen, vec![1, 3]);
        assert_eq!(refused.out, 3);

        // A current guess: one decision, one write.
        let mut calls = 0;
        let current = Revisioned {
            value: json!({"n": 3}),
            revision: written.revision,
        };
        let committed =
            compare_and_set_guessed(target, Some(current), |current: Option<Revisioned<Value>>| {
                calls += 1;
                let n = current.expect("the key exists").value["n"].as_u64().unwrap_or(0);
                Ok::<_, StoreError>(Edit::Write(json!({ "n": n + 1 }), n + 1))
            })
            .await
            .expect("compare-and-set");
        assert_eq!((calls, committed.out), (1, 4));
    }))
    .await;
}

/// A replica watching the active sets (as fronts do) keeps another replica's writes, at their revisions, and
/// admits from its copy: two watching replicas racing twenty creations still admit exactly five, and a slot
/// another replica gave back is taken again at once, whether the copy shows it free yet or still shows the set
/// full (a refusal taken on the copy is checked against the stored set).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_admitting_from_their_copies_of_the_active_sets_keep_the_quota() {
    let n = nats();
    guard(Box::pin(async {
        let a = n.store(StoreSettings::default()).await;
        let b = n.store(StoreSettings::default()).await;
        // No watch runs yet: nothing to wait for.
        assert!(a.active_sets_watched().now_or_never().is_none());
        let watches = [a.watch_active_sets(), b.watch_active_sets()];
        a.active_sets_watched().await;
        b.active_sets_watched().await;
        // The copy follows the other replica's write, once the watch runs (it delivers the write asynchronously:
        // polled, bounded by the test's guard).
        let first = b
            .create_job(record("racer", "echo.run", 0), 5)
            .await
            .expect("create");
        let (set, revision) = loop {
            if let Some((set, revision)) = a.cached_active_set("racer") {
                break (set, revision);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        assert_eq!(set, vec![first.value.job_id.clone()]);
        assert!(revision > 0);

        let (mut created, refused) = race_creations(&a, &b, 1..20).await;
        created.insert(first.value.job_id.clone());
        assert_eq!((created.len(), refused), (5, 15));
        let set: BTreeSet<JobId> = a.active_set("racer").await.expect("set").into_iter().collect();
        assert_eq!(set, created);

        // B gives a slot back; A admits at once, whether its copy already shows the slot free or still full.
        let done = created.iter().next().expect("a job").clone();
        b.transition("racer", &done, JobState::Failed, |_| {})
            .await
            .expect("fail");
        let again = a
            .create_job(record("racer", "echo.run", 30), 5)
            .await
            .expect("the freed slot");
        let mut expected = created.clone();
        expected.remove(&done);
        expected.insert(again.value.job_id);
        let set: BTreeSet<JobId> = b.active_set("racer").await.expect("set").into_iter().collect();
        assert_eq!(set, expected);

        // A stopped watch leaves no copy to start from.
        for w in watches {
            w.abort();
            let _ = w.await;
        }
        assert_eq!((a.cached_active_sets(), a.cached_active_set("racer")), (0, None));
        assert!(a.active_sets_watched().now_or_never().is_none());
    }))
    .await;
}

/// The smallest budget whose high-water mark is exactly `mark` (the mark steps by 0.9 byte per budget byte, so
/// every mark is some budget's).
fn budget_for_mark(mark: u64) -> u64 {
    let mut budget = mark * 100 / fleet_store::settings::STORE_HIGH_WATER_PERCENT;
    while fleet_store::fill::high_water(budget) < mark {
        budget += 1;
    }
    assert_eq!(fleet_store::fill::high_water(budget), mark);
    budget
}

#[tokio::test]
async fn a_nearly_full_store_refuses_new_jobs_at_its_high_water_mark() {
    let n = nats();
    guard(Box::pin(async {
        // Without a budget and without an account limit (the FLEET account's JetStream is unlimited), no guard.
        let open = n.store(StoreSettings::default()).await;
        open.create_job(record("w", "echo.run", now_ms()), 5)
            .await
            .expect("a job before any guard");
        let reading = open.refresh_fill().await.expect("fill");
        assert!(reading.used_bytes > 0, "{reading:?}");
        assert_eq!((reading.budget_bytes, reading.pending_bytes), (0, 0));
        let used = reading.used_bytes;
        let reserve = StoreSettings::default().job_storage_reserve();
        // Replicas whose budgets put the mark one byte under `used + reserve`, and exactly at it; no refresh
        // within the test but the ones it asks for.
        let with_mark = |mark| StoreSettings {
            job_store_max_bytes: budget_for_mark(mark),
            store_fill_refresh: Duration::from_secs(3600),
            ..StoreSettings::default()
        };
        let under = n.store(with_mark(used + reserve - 1)).await;
        let at = n.store(with_mark(used + reserve)).await;
        let now = now_ms();

        // One byte under: the first job is refused, with the figures; nothing stays.
        let job = record("u", "echo.run", now);
        let err = under
            .create_job(job.clone(), 5)
            .await
            .expect_err("one byte over the mark");
        let StoreError::StoreFull {
            used: u,
            reserve: r,
            high_water,
            budget,
            retry_after_ms,
        } = err
        else {
            panic!("unexpected: {err}");
        };
        assert_eq!(
            (u, r, high_water, budget, retry_after_ms),
            (
                used,
                reserve,
                used + reserve - 1,
                budget_for_mark(used + reserve - 1),
                3_600_000
            )
        );
        assert!(err.retryable());
        // The app learns that it may retry and when, nothing of the store's size.
        let api = err.to_api_error();
        assert_eq!(api.code, ApiErrorCode::LongJobCapacity);
        assert_eq!(
            api.details,
            Some(json!({"retriable": true, "retry_after_ms": 3_600_000}))
        );
        assert_eq!(under.get_job("u", &job.job_id).await.expect("get"), None);
        assert!(!under.active_set("u").await.expect("set").contains(&job.job_id));
        assert_eq!(under.fill().pending_bytes, 0);

        // Exactly at the mark: admitted, and counted until the next reading.
        let first = at
            .create_job(record("u", "echo.run", now), 5)
            .await
            .expect("at the mark");
        assert_eq!(
            at.fill(),
            fleet_store::FillReading {
                used_bytes: used,
                budget_bytes: budget_for_mark(used + reserve),
                pending_bytes: reserve
            }
        );
        // The next job of any user is over it (the guard is fleet-wide, not per user).
        for user in ["u", "v"] {
            let err = at
                .create_job(record(user, "echo.run", now), 5)
                .await
                .expect_err("over the mark");
            assert!(
                matches!(err, StoreError::StoreFull { used: u, .. } if u == used + reserve),
                "{err}"
            );
        }
        // A new reading counts what was written instead of the reserve: the record and its index entry.
        let after = at.refresh_fill().await.expect("fill");
        assert_eq!(after.pending_bytes, 0);
        assert!(
            after.used_bytes > used && after.used_bytes < used + reserve,
            "{after:?}"
        );
        // What is admitted is never refused by the guard: the job runs and ends.
        let running = done(
            at.transition("u", &first.value.job_id, JobState::Running, |_| {})
                .await
                .expect("running"),
        );
        assert_eq!(running.value.state, JobState::Running);
        done(
            at.transition("u", &first.value.job_id, JobState::Succeeded, |_| {})
                .await
                .expect("succeeded"),
        );
    }))
    .await;
}

#[tokio::test]
async fn a_creation_retried_after_its_page_was_sealed_is_indexed_and_reserved_once() {
    let n = nats();
    guard(Box::pin(async {
        // Pages of 2: the third creation seals the page holding the first job.
        let store = n
            .store(StoreSettings {
                job_index_page: 2,
                ..StoreSettings::default()
            })
            .await;
        let reserve = store.settings().job_storage_reserve();
        let u = "retrier";
        let now = now_ms();
        let first = record(u, "echo.run", now);
        store.create_job(first.clone(), 5).await.expect("first");
        for i in 1..3 {
            store
                .create_job(record(u, "echo.run", now + i), 5)
                .await
                .expect("more");
        }
        assert_eq!(store.stored_job_bytes(u).await.expect("account"), 3 * reserve);
        // The first creation again, as a front retries it when it lost the answer: its slot is held, its record
        // exists — and its index entry is in the sealed page, not the open one.
        let err = store
            .create_job(first.clone(), 5)
            .await
            .expect_err("the record exists");
        assert!(matches!(err, StoreError::JobExists { .. }), "{err}");
        // Indexed once, reserved once.
        assert_eq!(store.stored_job_bytes(u).await.expect("account"), 3 * reserve);
        let (listed, _) = list_all(&store, u, &JobFilter::default(), 10).await;
        assert_eq!(listed.len(), 3, "{listed:?}");
        assert_eq!(
            listed.iter().filter(|id| **id == first.job_id).count(),
            1,
            "{listed:?}"
        );
    }))
    .await;
}

/// Issue 42: the guard counts staging and uploads as full. Their `max_bytes` is a share of the budget, and signed
/// PUT links can fill them at any time. A budget whose mark holds two jobs' reserves admits only one once the buckets
/// exist, and the reading adds exactly their remaining room to the account's use.
#[tokio::test]
async fn the_fill_guard_counts_staging_and_uploads_up_to_their_caps() {
    let n = nats();
    guard(Box::pin(async {
        let js = n.js().await;
        let open = n.store(StoreSettings::default()).await;
        let used = open.refresh_fill().await.expect("fill").used_bytes;
        let reserve = StoreSettings::default().job_storage_reserve();
        let settings = StoreSettings {
            job_store_max_bytes: budget_for_mark(used + 2 * reserve),
            store_fill_refresh: Duration::from_secs(3600),
            ..StoreSettings::default()
        };
        let budget = settings.job_store_max_bytes;
        let staging_max = fleet_store::fill::percent_of(budget, fleet_store::settings::STAGING_STORE_PERCENT);
        let uploads_max = fleet_store::fill::percent_of(budget, fleet_store::settings::UPLOADS_STORE_PERCENT);
        assert!(
            staging_max + uploads_max <= reserve,
            "one job still fits beside the buckets"
        );
        let staging = fleet_store::provision::object_store(
            &js,
            settings.aps_staging_config(),
            fleet_store::Provision::Create,
        )
        .await
        .expect("staging");
        fleet_store::provision::object_store(&js, settings.uploads_config(), fleet_store::Provision::Create)
            .await
            .expect("uploads");
        let info = js
            .get_stream(format!("OBJ_{}", settings.aps_staging_bucket()))
            .await
            .expect("stream");
        assert_eq!(
            info.cached_info().config.max_bytes,
            i64::try_from(staging_max).expect("i64")
        );

        // Empty buckets count their whole caps; bytes put into one count once (as stored, not as room).
        let store = n.store(settings.clone()).await;
        let account = js.query_account().await.expect("account").storage;
        let reading = store.refresh_fill().await.expect("fill");
        assert_eq!(reading.used_bytes, account + staging_max + uploads_max);
        let mut body: &[u8] = &[9u8; 1000];
        staging.put("x", &mut body).await.expect("put");
        let account = js.query_account().await.expect("account").storage;
        let held = js
            .get_stream(format!("OBJ_{}", settings.aps_staging_bucket()))
            .await
            .expect("stream")
            .cached_info()
            .state
            .bytes;
        assert!(held >= 1000, "{held}");
        let reading = store.refresh_fill().await.expect("fill");
        assert_eq!(reading.used_bytes, account + staging_max - held + uploads_max);

        // The mark held two reserves over the jobs' use: with the buckets counted, one job is admitted, not two.
        store
            .create_job(record("u", "echo.run", now_ms()), 5)
            .await
            .expect("the first job fits");
        let err = store
            .create_job(record("u", "echo.run", now_ms()), 5)
            .await
            .expect_err("the buckets' share leaves no room for a second");
        assert!(matches!(err, StoreError::StoreFull { .. }), "{err}");
    }))
    .await;
}
