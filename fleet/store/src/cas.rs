//! The fleet's one compare-and-set loop. Every read-decide-write on a JetStream KV key (jobs, active sets, the
//! job index, grants, plugin records, operator credentials, the storage service's quotas and entries) goes
//! through it, so they share one retry cap ([`MAX_CAS_ATTEMPTS`]), one backoff ([`Races::lost`]) and two rules: a
//! lost race (the key moved since it was read) is retried, any other JetStream error is reported at once; and a
//! decision that writes nothing is taken on the leader's copy of the key ([`read_current`](super::read_current)),
//! never on a replica's alone — a write's revision check catches a stale read, nothing catches a stale "keep".
//!
//! Two levels:
//! * [`compare_and_set`]: a JSON value under a KV key, decided by a synchronous closure — the common case;
//! * [`Races`]: the retry budget alone, for a loop whose write is not a plain KV update (the storage service's
//!   entries carry headers and reserve quota between the read and the write).

use std::time::Duration;

use async_nats::jetstream::kv;
use bytes::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{Op, Revisioned, StoreError, read, read_current, replicated};

/// Lost races in a row before a compare-and-set loop gives up ([`StoreError::Contention`], or [`Contended`]).
/// With [`Races::lost`]'s backoff this is about 3 s of waiting, far beyond any real contention on one key.
pub const MAX_CAS_ATTEMPTS: u32 = 100;

/// The longest single backoff after a lost race: 2^`BACKOFF_MAX_SHIFT` ms.
const BACKOFF_MAX_SHIFT: u32 = 5;

/// A lost compare-and-set: the key's revision was not the one read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conflict;

/// A loop lost [`MAX_CAS_ATTEMPTS`] races in a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("lost {attempts} compare-and-set races in a row")]
pub struct Contended {
    /// Races lost.
    pub attempts: u32,
}

/// The retry budget of one compare-and-set loop.
#[derive(Debug, Default)]
pub struct Races {
    lost: u32,
}

impl Races {
    /// A fresh budget.
    pub fn new() -> Races {
        Races::default()
    }

    /// Records a lost race and waits a short random pause that grows with the losses (≤ 32 ms), so racing
    /// writers spread out instead of colliding again; `Err` once [`MAX_CAS_ATTEMPTS`] races are lost.
    pub async fn lost(&mut self) -> Result<(), Contended> {
        self.lost += 1;
        if self.lost >= MAX_CAS_ATTEMPTS {
            return Err(Contended { attempts: self.lost });
        }
        let cap = 1u64 << self.lost.min(BACKOFF_MAX_SHIFT);
        let ms = rand::random_range(0..=cap);
        tokio::time::sleep(Duration::from_millis(ms)).await;
        Ok(())
    }
}

/// What a [`compare_and_set`] decision does with the value it saw.
#[derive(Debug)]
pub enum Edit<T, R> {
    /// Write nothing; the loop returns `R`.
    Keep(R),
    /// Write `T` at the revision read (create it when the key was absent); the loop returns `R` once written.
    Write(T, R),
    /// Delete the key at the revision read (nothing to do when absent); the loop returns `R` once deleted.
    Delete(R),
}

/// What a [`compare_and_set`] ended with.
#[derive(Debug)]
pub struct Committed<T, R> {
    /// The decision's result.
    pub out: R,
    /// The value written and its revision, when the decision was [`Edit::Write`].
    pub written: Option<Revisioned<T>>,
    /// The JSON bytes written (0 when nothing was).
    pub written_bytes: usize,
}

/// The key a [`compare_and_set`] works on, and the size limit of what it writes.
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    /// The bucket.
    pub kv: &'a kv::Store,
    /// The key.
    pub key: &'a str,
    /// The store operation this is part of (named in errors).
    pub op: Op,
    /// What the value is and its largest JSON size in bytes; a bigger value is [`StoreError::TooLarge`].
    pub limit: (&'static str, usize),
}

/// Reads the JSON value at `target` (absent, deleted and purged keys are `None`), lets `decide` choose an
/// [`Edit`], and applies it at the revision read; when another writer moved the key in between, reads again and
/// decides again, after [`Races::lost`]'s backoff. `first` is a read taken earlier (it saves the first read; the
/// write still checks its revision). A decision that writes nothing ([`Edit::Keep`], [`Edit::Delete`] of an
/// absent key, or an error of `decide`, e.g. a quota found full) taken on a replica's read of a replicated bucket is checked against the leader's copy, and taken
/// again on it when the two differ. Errors of `decide` end the loop as they are.
pub async fn compare_and_set<T, R, E>(
    target: Target<'_>,
    first: Option<Option<Revisioned<T>>>,
    decide: impl FnMut(Option<Revisioned<T>>) -> Result<Edit<T, R>, E>,
) -> Result<Committed<T, R>, E>
where
    T: Serialize + DeserializeOwned,
    E: From<StoreError>,
{
    cas_loop(target, first.map(|read| (read, false)), decide).await
}

/// [`compare_and_set`] starting from a guess of the key's value (a cache's, [`crate::active_cache`]) instead of
/// a read: when the guess is current this saves the read; when it is stale the write at its revision is refused
/// and the loop reads and decides again at once (a stale guess is not a lost race: no backoff). A decision that
/// writes nothing taken on the guess is checked against the leader's copy, on one server too.
pub async fn compare_and_set_guessed<T, R, E>(
    target: Target<'_>,
    guess: Option<Revisioned<T>>,
    decide: impl FnMut(Option<Revisioned<T>>) -> Result<Edit<T, R>, E>,
) -> Result<Committed<T, R>, E>
where
    T: Serialize + DeserializeOwned,
    E: From<StoreError>,
{
    cas_loop(target, guess.map(|guess| (Some(guess), true)), decide).await
}

/// The loop of [`compare_and_set`]; `first` is a value to start from, and whether it is a guess.
async fn cas_loop<T, R, E>(
    target: Target<'_>,
    mut first: Option<(Option<Revisioned<T>>, bool)>,
    mut decide: impl FnMut(Option<Revisioned<T>>) -> Result<Edit<T, R>, E>,
) -> Result<Committed<T, R>, E>
where
    T: Serialize + DeserializeOwned,
    E: From<StoreError>,
{
    let Target { kv, key, op, limit } = target;
    let mut races = Races::new();
    // Whether `current` is the leader's answer; a replica's may be older than the last write acknowledged.
    let mut from_leader = !replicated(kv);
    loop {
        let (current, guessed) = match first.take() {
            Some(first) => first,
            None => (read::<T>(kv, key, op).await?, false),
        };
        if guessed {
            from_leader = false;
        }
        let revision = current.as_ref().map(|c| c.revision);
        let decision = decide(current);
        // A decision that writes nothing (a refusal included) is only as good as the read it was taken on, and no
        // write checks it: one taken on a replica's read is taken again on the leader's when the two differ.
        let writes = match &decision {
            Ok(Edit::Keep(_)) | Err(_) => false,
            Ok(Edit::Write(..)) => true,
            Ok(Edit::Delete(_)) => revision.is_some(),
        };
        if !writes && !from_leader {
            let latest = read_current::<T>(kv, key, op).await?;
            if latest.as_ref().map(|c| c.revision) != revision {
                first = Some((latest, false));
                from_leader = true;
                continue;
            }
        }
        from_leader = !replicated(kv);
        match decision? {
            Edit::Keep(out) => {
                return Ok(Committed {
                    out,
                    written: None,
                    written_bytes: 0,
                });
            }
            Edit::Write(value, out) => {
                let bytes = encode(&value, limit, op)?;
                let written_bytes = bytes.len();
                if let Ok(revision) = write_bytes(kv, key, bytes, revision, op).await? {
                    return Ok(Committed {
                        out,
                        written: Some(Revisioned { value, revision }),
                        written_bytes,
                    });
                }
            }
            Edit::Delete(out) => {
                if delete(kv, key, revision, op).await?.is_ok() {
                    return Ok(Committed {
                        out,
                        written: None,
                        written_bytes: 0,
                    });
                }
            }
        }
        if guessed {
            continue;
        }
        races
            .lost()
            .await
            .map_err(|c| StoreError::contended(op, key, c))?;
    }
}

/// Serializes `value`, checks it fits, and writes it: `create` when `revision` is `None` (absent or deleted key),
/// else `update` expecting `revision`. `Ok(Err(Conflict))` when another writer got there first.
pub(crate) async fn write<T: Serialize>(
    kv: &kv::Store,
    key: &str,
    value: &T,
    revision: Option<u64>,
    limit: (&'static str, usize),
    op: Op,
) -> Result<Result<u64, Conflict>, StoreError> {
    let bytes = encode(value, limit, op)?;
    write_bytes(kv, key, bytes, revision, op).await
}

/// [`write`] of bytes already encoded.
pub async fn write_bytes(
    kv: &kv::Store,
    key: &str,
    bytes: Bytes,
    revision: Option<u64>,
    op: Op,
) -> Result<Result<u64, Conflict>, StoreError> {
    match revision {
        None => match kv.create(key, bytes).await {
            Ok(rev) => Ok(Ok(rev)),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => Ok(Err(Conflict)),
            Err(e) => Err(StoreError::nats(op, e)),
        },
        Some(rev) => match kv.update(key, bytes, rev).await {
            Ok(rev) => Ok(Ok(rev)),
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => Ok(Err(Conflict)),
            Err(e) => Err(StoreError::nats(op, e)),
        },
    }
}

/// Deletes `key` expecting `revision` (nothing to do when `None`: the key is absent already).
async fn delete(
    kv: &kv::Store,
    key: &str,
    revision: Option<u64>,
    op: Op,
) -> Result<Result<(), Conflict>, StoreError> {
    let Some(revision) = revision else {
        return Ok(Ok(()));
    };
    match kv.delete_expect_revision(key, Some(revision)).await {
        Ok(()) => Ok(Ok(())),
        Err(e) if e.kind() == kv::DeleteErrorKind::WrongLastRevision => Ok(Err(Conflict)),
        Err(e) => Err(StoreError::nats(op, e)),
    }
}

/// JSON of `value`, refused when over `limit`.
pub(crate) fn encode<T: Serialize>(
    value: &T,
    (what, max): (&'static str, usize),
    op: Op,
) -> Result<Bytes, StoreError> {
    let bytes = serde_json::to_vec(value).map_err(|e| StoreError::invalid(op, what, e.to_string()))?;
    if bytes.len() > max {
        return Err(StoreError::TooLarge {
            op,
            what,
            size: bytes.len(),
            max,
        });
    }
    Ok(bytes.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A loop may lose `MAX_CAS_ATTEMPTS - 1` races and still go on; the next loss ends it. Its pauses never
    /// exceed the backoff's caps (time is paused: the clock moves only by the pauses).
    #[tokio::test(start_paused = true)]
    async fn a_loop_gives_up_at_the_cap_and_its_pauses_stay_within_the_backoff() {
        let start = tokio::time::Instant::now();
        let mut races = Races::new();
        for lost in 1..MAX_CAS_ATTEMPTS {
            assert_eq!(races.lost().await, Ok(()), "race {lost} of {MAX_CAS_ATTEMPTS}");
        }
        assert_eq!(
            races.lost().await,
            Err(Contended {
                attempts: MAX_CAS_ATTEMPTS
            })
        );
        let most: u64 = (1..MAX_CAS_ATTEMPTS)
            .map(|lost| 1u64 << lost.min(BACKOFF_MAX_SHIFT))
            .sum();
        assert!(start.elapsed() <= Duration::from_millis(most));
    }
}
