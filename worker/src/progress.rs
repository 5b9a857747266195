//! The progress gate of one invoke: size cap and rate limit (spec §8.10 HR-PG-04, HR-PG-05).

use std::num::NonZeroU32;
use std::sync::Arc;

use fleet_proto::executa::invoke::ProgressType;
use fleet_proto::limits::{MAX_PROGRESS_EVENT_BYTES, PROGRESS_EVENTS_PER_SECOND};
use governor::clock::{Clock, DefaultClock};
use governor::middleware::NoOpMiddleware;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};
use serde_json::value::RawValue;

use crate::metrics::ProgressDrop;

/// One progress event as the worker delivers it: the coerced type and the plugin's `data`, unparsed.
#[derive(Debug, Clone)]
pub struct ProgressUpdate {
    /// `progress` or `tool_update` (anything else was coerced to `progress`).
    pub kind: ProgressType,
    /// The event's `data`, as raw JSON (≤ 8 KB).
    pub data: Box<RawValue>,
}

/// Where an invoke's progress goes (the job layer stores it; `None` for synchronous invokes). It is called on the
/// session's reader task, in stream order: it must not block (hand the event to a channel or a task).
pub type ProgressSink = Arc<dyn Fn(ProgressUpdate) + Send + Sync>;

/// Size cap + per-invoke rate limiter (governor: a burst of 50, refilled at 50 per second).
pub(crate) struct ProgressGate<C: Clock = DefaultClock> {
    limiter: RateLimiter<NotKeyed, InMemoryState, C, NoOpMiddleware<C::Instant>>,
}

impl<C: Clock> std::fmt::Debug for ProgressGate<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ProgressGate")
    }
}

fn quota() -> Quota {
    Quota::per_second(NonZeroU32::new(PROGRESS_EVENTS_PER_SECOND).unwrap_or(NonZeroU32::MIN))
}

/// The one clock of every gate: a new `DefaultClock` (quanta's) reads the CPU's features and calibrates, which
/// cost about 6 % of the whole request path when every invoke made its own (a profile of `fleet_roundtrip`);
/// clones share the calibration.
fn shared_clock() -> DefaultClock {
    static CLOCK: std::sync::OnceLock<DefaultClock> = std::sync::OnceLock::new();
    CLOCK.get_or_init(DefaultClock::default).clone()
}

impl ProgressGate<DefaultClock> {
    pub(crate) fn new() -> Self {
        ProgressGate {
            limiter: RateLimiter::direct_with_clock(quota(), shared_clock()),
        }
    }
}

impl<C: Clock> ProgressGate<C> {
    #[cfg(test)]
    pub(crate) fn with_clock(clock: C) -> Self {
        ProgressGate {
            limiter: RateLimiter::direct_with_clock(quota(), clock),
        }
    }

    /// Whether an event whose `data` is `data_bytes` long passes; the size is checked first, so an oversized
    /// event does not use up the rate budget.
    pub(crate) fn admit(&self, data_bytes: usize) -> Result<(), ProgressDrop> {
        if data_bytes > MAX_PROGRESS_EVENT_BYTES {
            return Err(ProgressDrop::TooLarge);
        }
        self.limiter.check().map_err(|_| ProgressDrop::RateLimited)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use governor::clock::FakeRelativeClock;

    use super::ProgressGate;
    use crate::metrics::ProgressDrop;

    #[test]
    fn exactly_fifty_per_second() {
        let clock = FakeRelativeClock::default();
        let gate = ProgressGate::with_clock(clock.clone());
        for i in 0..50 {
            assert_eq!(gate.admit(10), Ok(()), "event {i} of the first second");
        }
        assert_eq!(
            gate.admit(10),
            Err(ProgressDrop::RateLimited),
            "the 51st within the same instant"
        );
        // One event's worth of time (1/50 s) later, exactly one more passes.
        clock.advance(Duration::from_millis(20));
        assert_eq!(gate.admit(10), Ok(()));
        assert_eq!(gate.admit(10), Err(ProgressDrop::RateLimited));
        // After a full second the whole burst is back.
        clock.advance(Duration::from_secs(1));
        for _ in 0..50 {
            assert_eq!(gate.admit(10), Ok(()));
        }
        assert_eq!(gate.admit(10), Err(ProgressDrop::RateLimited));
    }

    #[test]
    fn size_boundary_is_8_kib() {
        let gate = ProgressGate::with_clock(FakeRelativeClock::default());
        assert_eq!(gate.admit(8192), Ok(()));
        assert_eq!(gate.admit(8193), Err(ProgressDrop::TooLarge));
    }
}
