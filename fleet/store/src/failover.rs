//! Riding out the loss of a NATS server. While the replicas of a stream or bucket elect a new leader (a node of
//! a cluster died: 5–8 s for nats-server 2.15 on 3 nodes, docs/operations.md), JetStream answers nothing: every
//! read and write of that resource fails with a NATS error ([`StoreError::Nats`]) until the election ends. An
//! operation that is safe to repeat (a read, a compare-and-set, an idempotent admission) is tried again through
//! [`ride_out`] instead of failing the call that needed it; anything else the store answers (a quota, a lost
//! race, a corrupt value) ends it at once.
//!
//! One policy for every such retry: [`STORE_FAILOVER_WAIT`] at most (or less, when the caller's own deadline
//! comes first), pauses doubling from [`STORE_RETRY_FIRST_PAUSE`] to [`STORE_RETRY_MAX_PAUSE`].

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use super::{Op, StoreError};

/// How long an operation is tried again while the store does not answer (a NATS server of a cluster died and its
/// streams elect new leaders: measured 5.0 s for nats-server 2.15 on 3 nodes, see docs/operations.md) before its
/// caller gets the NATS error. Well under the 30 s clients wait for an answer.
pub const STORE_FAILOVER_WAIT: Duration = Duration::from_secs(10);

/// How long one attempt may go unanswered before it is abandoned and tried again. A request that reached a
/// stream while its replicas elect a leader is never answered (the server drops it; the client would wait out its
/// own request or ack timeout, 5–10 s, the whole of [`STORE_FAILOVER_WAIT`]), so without this bound one unlucky
/// attempt outlasts the election and the call fails although the store answers again. A healthy JetStream
/// operation answers in milliseconds, also on a loaded machine; an abandoned one is safe to repeat (see
/// [`ride_out`]).
pub const STORE_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(1);

/// The first pause between two attempts while the store does not answer; it doubles up to
/// [`STORE_RETRY_MAX_PAUSE`].
pub const STORE_RETRY_FIRST_PAUSE: Duration = Duration::from_millis(50);

/// The longest pause between two attempts.
pub const STORE_RETRY_MAX_PAUSE: Duration = Duration::from_millis(500);

/// The moment a ride-out that starts now gives up: [`STORE_FAILOVER_WAIT`] from now, or `deadline` if sooner.
pub fn give_up_at(deadline: Option<Instant>) -> Instant {
    let wait = Instant::now() + STORE_FAILOVER_WAIT;
    deadline.map_or(wait, |d| d.min(wait))
}

/// The tokio instant of `deadline_ms` (ms since the epoch): a caller's deadline as [`ride_out`] takes it. A
/// deadline further away than [`FAR_DEADLINE`] (e.g. `u64::MAX`, none) is taken as that far.
pub fn instant_of_epoch_ms(deadline_ms: u64) -> Instant {
    let left = Duration::from_millis(deadline_ms.saturating_sub(fleet_proto::util::now_ms()));
    Instant::now() + left.min(FAR_DEADLINE)
}

/// The furthest [`instant_of_epoch_ms`] looks ahead (a day: beyond any invoke's timeout).
pub const FAR_DEADLINE: Duration = Duration::from_secs(24 * 3600);

/// Runs `attempt` until it ends with anything but [`StoreError::Nats`], pausing between attempts
/// ([`STORE_RETRY_FIRST_PAUSE`], doubling up to [`STORE_RETRY_MAX_PAUSE`]) and telling `on_retry` of every NATS
/// failure it retries. An attempt unanswered for [`STORE_ATTEMPT_TIMEOUT`] is abandoned and counts as such a
/// failure. At `give_up` (an attempt still running is abandoned then) the last NATS error is the answer — or,
/// when no attempt ended by then, a timeout of `op`.
///
/// `attempt` must be safe to repeat: a NATS error does not say whether a write was applied.
pub async fn ride_out<T, F, Fut>(
    op: Op,
    give_up: Instant,
    mut attempt: F,
    mut on_retry: impl FnMut(&StoreError),
) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, StoreError>>,
{
    let mut pause = STORE_RETRY_FIRST_PAUSE;
    loop {
        let abandon_at = give_up.min(Instant::now() + STORE_ATTEMPT_TIMEOUT);
        let error = match tokio::time::timeout_at(abandon_at, attempt()).await {
            Ok(Err(e @ StoreError::Nats { .. })) => e,
            Ok(done) => return done,
            Err(_) if abandon_at < give_up => StoreError::nats(
                op,
                format!(
                    "no answer from JetStream within {} ms",
                    STORE_ATTEMPT_TIMEOUT.as_millis()
                ),
            ),
            Err(_) => {
                return Err(StoreError::nats(
                    op,
                    format!(
                        "no answer from JetStream within {} ms",
                        STORE_FAILOVER_WAIT.as_millis()
                    ),
                ));
            }
        };
        if Instant::now() + pause >= give_up {
            return Err(error);
        }
        on_retry(&error);
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(STORE_RETRY_MAX_PAUSE);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    fn nats_error() -> StoreError {
        StoreError::nats(Op::GetJob, "no responders")
    }

    #[tokio::test(start_paused = true)]
    async fn nats_errors_are_retried_until_an_answer() {
        let calls = AtomicU32::new(0);
        let mut retried = 0;
        let out = ride_out(
            Op::GetJob,
            give_up_at(None),
            || async {
                match calls.fetch_add(1, Ordering::SeqCst) {
                    0..=2 => Err(nats_error()),
                    _ => Ok(7),
                }
            },
            |_| retried += 1,
        )
        .await;
        assert_eq!(out.unwrap(), 7);
        assert_eq!(calls.load(Ordering::SeqCst), 4);
        assert_eq!(retried, 3);
    }

    #[tokio::test(start_paused = true)]
    async fn any_other_answer_ends_at_once() {
        let calls = AtomicU32::new(0);
        let out: Result<(), _> = ride_out(
            Op::AcquireSlot,
            give_up_at(None),
            || async {
                calls.fetch_add(1, Ordering::SeqCst);
                Err(StoreError::QuotaExceeded { active: 3, max: 3 })
            },
            |_| {},
        )
        .await;
        assert!(matches!(out, Err(StoreError::QuotaExceeded { .. })));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn it_gives_up_at_the_failover_wait_with_the_last_error() {
        let started = Instant::now();
        let out: Result<(), _> = ride_out(
            Op::GetJob,
            give_up_at(None),
            || async { Err(nats_error()) },
            |_| {},
        )
        .await;
        assert!(matches!(out, Err(StoreError::Nats { .. })));
        let waited = started.elapsed();
        assert!(waited <= STORE_FAILOVER_WAIT, "{waited:?}");
        // It stopped because the next pause would have passed the wait, not earlier.
        assert!(
            waited + STORE_RETRY_MAX_PAUSE >= STORE_FAILOVER_WAIT,
            "{waited:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_attempt_unanswered_for_the_attempt_timeout_is_abandoned_and_tried_again() {
        let calls = AtomicU32::new(0);
        let mut retried = Vec::new();
        let started = Instant::now();
        let out = ride_out(
            Op::CreateJob,
            give_up_at(None),
            || {
                let n = calls.fetch_add(1, Ordering::SeqCst);
                async move {
                    if n < 2 {
                        // Sent while the stream elects its leader: never answered.
                        std::future::pending::<()>().await;
                    }
                    Ok(n)
                }
            },
            |e| retried.push(e.to_string()),
        )
        .await;
        assert_eq!(out.unwrap(), 2, "the third attempt answered");
        assert_eq!(retried.len(), 2);
        assert!(retried[0].contains("within 1000 ms"), "{retried:?}");
        // Two abandoned attempts and the pauses after them, nothing more.
        assert_eq!(
            started.elapsed(),
            2 * STORE_ATTEMPT_TIMEOUT + STORE_RETRY_FIRST_PAUSE + 2 * STORE_RETRY_FIRST_PAUSE
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_earlier_deadline_bounds_it_and_a_hung_attempt_is_abandoned() {
        let deadline = Instant::now() + Duration::from_secs(2);
        assert_eq!(give_up_at(Some(deadline)), deadline);
        let out: Result<(), _> = ride_out(
            Op::ReadCredentials,
            give_up_at(Some(deadline)),
            std::future::pending,
            |_| {},
        )
        .await;
        assert!(matches!(
            out,
            Err(StoreError::Nats {
                op: Op::ReadCredentials,
                ..
            })
        ));
        assert_eq!(Instant::now(), deadline);
    }
}
