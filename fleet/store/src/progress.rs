//! Progress rings (stream `<prefix>_progress`, one subject per job). The ring is JetStream's: the stream keeps
//! the newest `progress_max_per_job` messages per subject. Reads are direct gets (the stream allows them): the
//! newest message by subject, and slices as one batched direct get — no consumer is created.

use async_nats::HeaderMap;
use async_nats::jetstream::message::StreamMessage;
use async_nats::jetstream::stream::{DirectGetErrorKind, LastRawMessageErrorKind};
use fleet_proto::api::{JobId, ProgressEvent};

use super::direct::{self, BatchRequest};
use super::settings::{SEQ_HEADER, STORED_MESSAGE_OVERHEAD};
use fleet_proto::api::user_key;

use super::{Op, Store, StoreError};

fn header_seq(headers: Option<&HeaderMap>) -> Option<u64> {
    headers?.get(SEQ_HEADER)?.as_str().parse().ok()
}

impl Store {
    /// `<prefix>.v1.progress.<user_key>.<job_id>`.
    pub fn progress_subject(&self, user: &str, job_id: &JobId) -> String {
        format!(
            "{}.{}.{}",
            self.inner.settings.progress_subject_prefix(),
            user_key(user),
            job_id
        )
    }

    /// Stores one event of a job: published to the job's subject with header `Fleet-Seq: <seq>` (the caller, the
    /// single writer of a running job, assigns seqs) and `Nats-Msg-Id: <job_id>.<seq>` (a retried publish within
    /// the duplicate window is stored once); payload = the event JSON (≤ `progress_max_bytes_per_event`, else
    /// [`StoreError::TooLarge`]). Returns, once JetStream acknowledged it, the bytes the message keeps as the
    /// storage account counts them (payload + [`STORED_MESSAGE_OVERHEAD`]).
    pub async fn append_progress(
        &self,
        user: &str,
        job_id: &JobId,
        event: &ProgressEvent,
    ) -> Result<u64, StoreError> {
        let max = self.inner.settings.progress_max_bytes_per_event;
        let payload = super::encode(event, ("progress event", max), Op::AppendProgress)?;
        let kept = payload.len() as u64 + STORED_MESSAGE_OVERHEAD;
        let mut headers = HeaderMap::new();
        headers.insert(SEQ_HEADER, event.seq.to_string().as_str());
        headers.insert(
            async_nats::header::NATS_MESSAGE_ID,
            format!("{job_id}.{}", event.seq).as_str(),
        );
        let ack = self
            .inner
            .js
            .publish_with_headers(self.progress_subject(user, job_id), headers, payload)
            .await
            .map_err(|e| StoreError::nats(Op::AppendProgress, e))?;
        ack.await.map_err(|e| StoreError::nats(Op::AppendProgress, e))?;
        Ok(kept)
    }

    /// The seq of the job's last stored event (0 when none): one read of the last message through the stream's
    /// leader (the JetStream API path, not a direct get): what a decision such as freezing a finished job's
    /// progress ([`Store::finish`]) must not read from a lagging replica.
    pub async fn last_progress_seq(&self, user: &str, job_id: &JobId) -> Result<u64, StoreError> {
        let subject = self.progress_subject(user, job_id);
        match self
            .inner
            .progress
            .get_last_raw_message_by_subject(&subject)
            .await
        {
            Ok(m) => Ok(Tail::of(&m, &subject)?.seq),
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(0),
            Err(e) => Err(StoreError::nats(Op::Progress, e)),
        }
    }

    /// The job's newest stored event: one direct get (any replica, no consumer). `None` when the ring is empty.
    pub(crate) async fn ring_tail(&self, user: &str, job_id: &JobId) -> Result<Option<Tail>, StoreError> {
        let subject = self.progress_subject(user, job_id);
        match self
            .inner
            .progress
            .direct_get_last_for_subject(subject.as_str())
            .await
        {
            Ok(m) => Ok(Some(Tail::of(&m, &subject)?)),
            Err(e) if e.kind() == DirectGetErrorKind::NotFound => Ok(None),
            Err(e) => Err(StoreError::nats(Op::Progress, e)),
        }
    }

    /// The stored events with `since < seq <= upto`, oldest first, at most `max`: one batched direct get of the
    /// job's subject from its oldest message — `max` messages when `since` is 0 (every stored event is due),
    /// the whole ring otherwise (where `since` ends is not known without reading) — or nothing at all when the
    /// only event due is `tail`, the newest one (the polling case: one new event since the last call).
    pub(crate) async fn ring_slice(
        &self,
        user: &str,
        job_id: &JobId,
        (since, upto): (u64, u64),
        max: usize,
        tail: Option<&Tail>,
    ) -> Result<Vec<ProgressEvent>, StoreError> {
        if upto <= since || max == 0 {
            return Ok(Vec::new());
        }
        if let Some(Tail {
            seq,
            event: Some(event),
        }) = tail
            && *seq == upto
            && since + 1 == upto
        {
            return Ok(vec![event.clone()]);
        }
        let subject = self.progress_subject(user, job_id);
        let settings = &self.inner.settings;
        let messages = direct::batch(
            &self.inner.js.client(),
            &settings.progress_stream(),
            &BatchRequest {
                start: None,
                next_by_subject: Some(&subject),
                multi_last: &[],
                batch: if since == 0 {
                    max.min(settings.progress_max_per_job)
                } else {
                    settings.progress_max_per_job
                },
            },
        )
        .await
        .map_err(|e| StoreError::nats(Op::Progress, e))?;
        let mut events = Vec::with_capacity(messages.len().min(max));
        for m in &messages {
            // The header settles most skips without parsing the payload.
            if header_seq(Some(&m.headers)).is_some_and(|s| s <= since || s > upto) {
                continue;
            }
            match serde_json::from_slice::<ProgressEvent>(&m.payload) {
                Ok(event) if event.seq > since && event.seq <= upto => {
                    events.push(event);
                    if events.len() >= max {
                        break;
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(%subject, error = %e, "skipping a progress event that does not parse")
                }
            }
        }
        Ok(events)
    }

    /// The ring slice: events with `seq > since_seq`, at most `limit` (1..=`progress_max_per_job`), oldest first,
    /// and the last stored seq (0 when none). Only the newest `progress_max_per_job` events exist.
    ///
    /// Cost: one direct get of the last message; nothing more when nothing is new (the polling case) or when the
    /// only new event is that last one; otherwise one batched direct get ([`Store::ring_slice`]). No consumer.
    pub async fn progress(
        &self,
        user: &str,
        job_id: &JobId,
        since_seq: u64,
        limit: usize,
    ) -> Result<(Vec<ProgressEvent>, u64), StoreError> {
        self.check_progress_limit(limit, Op::Progress)?;
        let Some(tail) = self.ring_tail(user, job_id).await? else {
            return Ok((Vec::new(), 0));
        };
        let events = self
            .ring_slice(user, job_id, (since_seq, tail.seq), limit, Some(&tail))
            .await?;
        Ok((events, tail.seq))
    }

    /// A progress `limit` is 1..=`progress_max_per_job`.
    pub(crate) fn check_progress_limit(&self, limit: usize, op: Op) -> Result<(), StoreError> {
        let ring = self.inner.settings.progress_max_per_job;
        if limit == 0 || limit > ring {
            return Err(StoreError::invalid(
                op,
                "limit",
                format!("must be 1–{ring}, got {limit}"),
            ));
        }
        Ok(())
    }
}

/// A job's newest stored event.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Tail {
    /// Its seq.
    pub(crate) seq: u64,
    /// The event (`None` when its payload does not parse but its header gave the seq).
    pub(crate) event: Option<ProgressEvent>,
}

impl Tail {
    fn of(m: &StreamMessage, subject: &str) -> Result<Tail, StoreError> {
        let event = serde_json::from_slice::<ProgressEvent>(&m.payload);
        match (header_seq(Some(&m.headers)), event) {
            (Some(seq), Ok(event)) if event.seq == seq => Ok(Tail {
                seq,
                event: Some(event),
            }),
            (Some(seq), _) => Ok(Tail { seq, event: None }),
            (None, Ok(event)) => Ok(Tail {
                seq: event.seq,
                event: Some(event),
            }),
            (None, Err(source)) => Err(StoreError::Corrupt {
                op: Op::Progress,
                key: subject.to_owned(),
                source,
            }),
        }
    }
}
