//! The front's memory of finished jobs: `tools.getJob` of a job whose record is terminal is answered without a
//! JetStream read when nothing is due from its progress ring.
//!
//! Why it is safe: a terminal record is never written again (the store's invariant: every transition is a
//! compare-and-set that refuses to leave a terminal state, and `update_job` ignores terminal records), so a copy
//! cannot go stale. It can only go away: the jobs bucket drops a record `job_retention` after its last write (the
//! terminal one), and no job record is ever deleted otherwise (the per-user cap refuses new jobs instead of
//! evicting old ones). So an entry is served until the record's own expiry — its `updated_at_ms` (the terminal
//! write) plus the retention, less [`CLOCK_SKEW_MARGIN`] — and never after.
//!
//! Entries are keyed by (user, job id) and a hit is checked against the record's own user and id: a record is
//! only ever served to the user it belongs to. Only terminal records are kept. Bounded by
//! [`FINISHED_JOBS_ENTRIES`] records and [`FINISHED_JOBS_BYTES`] of their JSON, whichever is reached first;
//! the oldest insertion goes first (finished jobs are read soon after they finish, then rarely).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fleet_proto::api::JobId;
use fleet_store::JobRecord;

/// Finished records a front keeps at most.
pub const FINISHED_JOBS_ENTRIES: usize = 4096;

/// Bytes of record JSON a front keeps at most (a record is ≤ 384 KiB; most are under 2 KiB).
pub const FINISHED_JOBS_BYTES: usize = 64 * 1024 * 1024;

/// Taken off a record's expiry: the record's `updated_at_ms` is its writer's clock, the bucket's `max_age` runs
/// on the server's.
pub const CLOCK_SKEW_MARGIN: Duration = Duration::from_secs(60);

/// The cache. Cheap to share (one mutex, held only for map operations).
#[derive(Debug)]
pub struct FinishedJobs {
    state: Mutex<State>,
    /// How long the store keeps a record after its last write, less the skew margin.
    keep_ms: u64,
    max_entries: usize,
    max_bytes: usize,
}

#[derive(Debug, Default)]
struct State {
    entries: HashMap<(String, JobId), Entry>,
    /// Insertion order (each key once).
    order: VecDeque<(String, JobId)>,
    bytes: usize,
}

#[derive(Debug)]
struct Entry {
    record: Arc<JobRecord>,
    bytes: usize,
    expires_at_ms: u64,
}

impl FinishedJobs {
    /// A cache for records the store keeps `retention` after their last write, bounded by
    /// [`FINISHED_JOBS_ENTRIES`] and [`FINISHED_JOBS_BYTES`].
    pub fn new(retention: Duration) -> FinishedJobs {
        FinishedJobs::with_bounds(retention, FINISHED_JOBS_ENTRIES, FINISHED_JOBS_BYTES)
    }

    /// The same with other bounds.
    pub fn with_bounds(retention: Duration, max_entries: usize, max_bytes: usize) -> FinishedJobs {
        let keep = retention.saturating_sub(CLOCK_SKEW_MARGIN);
        FinishedJobs {
            state: Mutex::new(State::default()),
            keep_ms: u64::try_from(keep.as_millis()).unwrap_or(u64::MAX),
            max_entries,
            max_bytes,
        }
    }

    /// The user's finished record of `job_id`, if kept and not past its expiry at `now_ms`.
    pub fn get(&self, user: &str, job_id: &JobId, now_ms: u64) -> Option<Arc<JobRecord>> {
        let mut state = fleet_proto::util::lock(&self.state);
        let key = (user.to_owned(), job_id.clone());
        let entry = state.entries.get(&key)?;
        if now_ms >= entry.expires_at_ms {
            let bytes = entry.bytes;
            state.entries.remove(&key);
            state.bytes -= bytes;
            return None;
        }
        let record = &entry.record;
        (record.user == user && record.job_id == *job_id).then(|| record.clone())
    }

    /// Keeps `record` (`bytes`: its JSON size) if it is terminal, not past its expiry at `now_ms` and fits;
    /// makes room by dropping the oldest insertions.
    pub fn insert(&self, record: Arc<JobRecord>, bytes: usize, now_ms: u64) {
        let expires_at_ms = record.updated_at_ms.saturating_add(self.keep_ms);
        if !record.state.is_terminal()
            || now_ms >= expires_at_ms
            || bytes > self.max_bytes
            || self.max_entries == 0
        {
            return;
        }
        let key = (record.user.clone(), record.job_id.clone());
        let mut state = fleet_proto::util::lock(&self.state);
        if state.entries.contains_key(&key) {
            return;
        }
        while state.entries.len() >= self.max_entries || state.bytes + bytes > self.max_bytes {
            let Some(oldest) = state.order.pop_front() else {
                break;
            };
            if let Some(gone) = state.entries.remove(&oldest) {
                state.bytes -= gone.bytes;
            }
        }
        state.order.push_back(key.clone());
        state.bytes += bytes;
        state.entries.insert(
            key,
            Entry {
                record,
                bytes,
                expires_at_ms,
            },
        );
        // Keys of entries that expired stay in `order` until they reach its front; bound them too.
        if state.order.len() > self.max_entries.saturating_mul(2) {
            let State { entries, order, .. } = &mut *state;
            order.retain(|k| entries.contains_key(k));
        }
    }

    /// Records kept now.
    pub fn len(&self) -> usize {
        fleet_proto::util::lock(&self.state).entries.len()
    }

    /// Whether none is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of record JSON kept now.
    pub fn bytes(&self) -> usize {
        fleet_proto::util::lock(&self.state).bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fleet_proto::api::JobState;

    const DAY_MS: u64 = 24 * 3600 * 1000;

    fn record(user: &str, id: u8, state: JobState, updated_at_ms: u64) -> Arc<JobRecord> {
        Arc::new(JobRecord {
            job_id: JobId::from_bytes([id; 16]),
            user: user.to_owned(),
            tool_id: "echo.echo".into(),
            plugin: "echo".into(),
            tool: "echo".into(),
            args: serde_json::Map::new(),
            client_tag: None,
            state,
            created_at_ms: updated_at_ms,
            updated_at_ms,
            started_at_ms: None,
            finished_at_ms: Some(updated_at_ms),
            deadline_ms: updated_at_ms + 60_000,
            timeout_ms: 60_000,
            worker: None,
            attempt: 1,
            result: None,
            error: None,
            last_heartbeat_ms: None,
            last_seq: 0,
            progress_bytes: None,
            delegation: None,
            seal: None,
        })
    }

    fn cache() -> FinishedJobs {
        FinishedJobs::new(Duration::from_millis(8 * DAY_MS))
    }

    #[test]
    fn keeps_only_terminal_records_and_serves_them_to_their_user_only() {
        let c = cache();
        let now = 1_000_000;
        for state in [JobState::Queued, JobState::Running] {
            c.insert(record("alice", 1, state, now), 100, now);
            assert!(c.is_empty(), "{state} is not final");
        }
        for (id, state) in [
            (2, JobState::Succeeded),
            (3, JobState::Failed),
            (4, JobState::Cancelled),
            (5, JobState::Expired),
        ] {
            let r = record("alice", id, state, now);
            c.insert(r.clone(), 100, now);
            assert_eq!(c.get("alice", &r.job_id, now), Some(r.clone()));
            assert_eq!(c.get("bob", &r.job_id, now), None, "never another user's record");
            assert_eq!(c.get("alice", &JobId::from_bytes([99; 16]), now), None);
        }
        assert_eq!((c.len(), c.bytes()), (4, 400));
        // Bob's own job with the same id is his, and alice's stays hers.
        let bobs = record("bob", 2, JobState::Failed, now);
        c.insert(bobs.clone(), 10, now);
        assert_eq!(c.get("bob", &bobs.job_id, now), Some(bobs.clone()));
        assert_eq!(
            c.get("alice", &bobs.job_id, now).map(|r| r.user.clone()),
            Some("alice".to_owned())
        );
    }

    #[test]
    fn never_serves_a_record_past_its_expiry() {
        let c = cache();
        let written = 5 * DAY_MS;
        let r = record("alice", 1, JobState::Succeeded, written);
        let expiry = written + 8 * DAY_MS - u64::try_from(CLOCK_SKEW_MARGIN.as_millis()).unwrap_or(0);
        c.insert(r.clone(), 100, written);
        assert_eq!(c.get("alice", &r.job_id, expiry - 1), Some(r.clone()));
        assert_eq!(c.get("alice", &r.job_id, expiry), None);
        assert_eq!(
            (c.len(), c.bytes()),
            (0, 0),
            "an expired entry is dropped when found"
        );
        // A record already past its expiry is not kept at all.
        c.insert(r.clone(), 100, expiry);
        assert!(c.is_empty());
    }

    #[test]
    fn bounded_by_entries_and_bytes_dropping_the_oldest() {
        let now = 1_000;
        let c = FinishedJobs::with_bounds(Duration::from_millis(8 * DAY_MS), 3, 1_000);
        let rs: Vec<_> = (1..=4)
            .map(|i| record("u", i, JobState::Succeeded, now))
            .collect();
        for r in &rs[..3] {
            c.insert(r.clone(), 100, now);
        }
        assert_eq!(c.len(), 3);
        c.insert(rs[3].clone(), 100, now);
        assert_eq!(c.len(), 3, "at most 3 entries");
        assert_eq!(c.get("u", &rs[0].job_id, now), None, "the oldest went first");
        assert!(c.get("u", &rs[3].job_id, now).is_some());
        // 1 000 bytes: a 900-byte record pushes out as many as it needs (two of the three).
        let big = record("u", 9, JobState::Succeeded, now);
        c.insert(big.clone(), 900, now);
        assert_eq!((c.len(), c.bytes()), (2, 1_000));
        assert!(c.get("u", &rs[3].job_id, now).is_some());
        assert!(c.get("u", &big.job_id, now).is_some());
        // Exactly the byte bound fits; one byte more is never kept.
        let c = FinishedJobs::with_bounds(Duration::from_millis(8 * DAY_MS), 3, 1_000);
        c.insert(record("u", 1, JobState::Succeeded, now), 1_000, now);
        assert_eq!(c.len(), 1);
        c.insert(record("u", 2, JobState::Succeeded, now), 1_001, now);
        assert_eq!((c.len(), c.bytes()), (1, 1_000));
    }
}
