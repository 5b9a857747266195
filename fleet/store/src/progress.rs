//! Progress rings (stream `<prefix>_progress`, one subject per job). The ring is JetStream's: the stream keeps
//! the newest `progress_max_per_job` messages per subject.

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::DeliverPolicy;
use async_nats::jetstream::stream::LastRawMessageErrorKind;
use fleet_proto::api::{JobId, ProgressEvent};

use super::scan::{Scan, scan};
use super::settings::SEQ_HEADER;
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
    /// [`StoreError::TooLarge`]). Returns once JetStream acknowledged it.
    pub async fn append_progress(
        &self,
        user: &str,
        job_id: &JobId,
        event: &ProgressEvent,
    ) -> Result<(), StoreError> {
        let max = self.inner.settings.progress_max_bytes_per_event;
        let payload = super::encode(event, ("progress event", max), Op::AppendProgress)?;
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
        Ok(())
    }

    /// The seq of the job's last stored event (0 when none): one direct read of the last message.
    pub async fn last_progress_seq(&self, user: &str, job_id: &JobId) -> Result<u64, StoreError> {
        let subject = self.progress_subject(user, job_id);
        match self
            .inner
            .progress
            .get_last_raw_message_by_subject(&subject)
            .await
        {
            Ok(m) => match header_seq(Some(&m.headers)) {
                Some(seq) => Ok(seq),
                None => Ok(serde_json::from_slice::<ProgressEvent>(&m.payload)
                    .map_err(|source| StoreError::Corrupt {
                        op: Op::Progress,
                        key: subject.clone(),
                        source,
                    })?
                    .seq),
            },
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(0),
            Err(e) => Err(StoreError::nats(Op::Progress, e)),
        }
    }

    /// The ring slice: events with `seq > since_seq`, at most `limit` (1..=`progress_max_per_job`), oldest first,
    /// and the last stored seq (0 when none). Only the newest `progress_max_per_job` events exist.
    ///
    /// Cost: one direct read of the last message; nothing more when nothing is new (the polling case). Otherwise
    /// one consumer over the job's subject — preceded, when `since_seq > 0`, by a headers-only pass to find where
    /// `since_seq` ends, so the payloads read are only the ones returned.
    pub async fn progress(
        &self,
        user: &str,
        job_id: &JobId,
        since_seq: u64,
        limit: usize,
    ) -> Result<(Vec<ProgressEvent>, u64), StoreError> {
        let ring = self.inner.settings.progress_max_per_job;
        if limit == 0 || limit > ring {
            return Err(StoreError::invalid(
                Op::Progress,
                "limit",
                format!("must be 1–{ring}, got {limit}"),
            ));
        }
        let subject = self.progress_subject(user, job_id);
        let stream = &self.inner.progress;
        let last = self.last_progress_seq(user, job_id).await?;
        if last == 0 {
            return Ok((Vec::new(), 0));
        }
        if last <= since_seq {
            return Ok((Vec::new(), last));
        }
        let deliver = if since_seq == 0 {
            DeliverPolicy::All
        } else {
            let index = scan(
                stream,
                Scan {
                    filter: subject.clone(),
                    deliver: DeliverPolicy::All,
                    headers_only: true,
                    max: ring,
                },
            )
            .await
            .map_err(|e| StoreError::nats(Op::Progress, e))?;
            let first_new = index
                .iter()
                .find(|m| header_seq(m.message.headers.as_ref()).is_some_and(|s| s > since_seq));
            match first_new {
                Some(m) => {
                    let info = m.info().map_err(|e| StoreError::nats(Op::Progress, e))?;
                    DeliverPolicy::ByStartSequence {
                        start_sequence: info.stream_sequence,
                    }
                }
                None => return Ok((Vec::new(), last)),
            }
        };
        let messages = scan(
            stream,
            Scan {
                filter: subject.clone(),
                deliver,
                headers_only: false,
                max: limit,
            },
        )
        .await
        .map_err(|e| StoreError::nats(Op::Progress, e))?;
        let mut events = Vec::with_capacity(messages.len());
        for m in &messages {
            match serde_json::from_slice::<ProgressEvent>(&m.message.payload) {
                Ok(event) if event.seq > since_seq => events.push(event),
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(%subject, error = %e, "skipping a progress event that does not parse")
                }
            }
        }
        events.truncate(limit);
        let last = events.last().map_or(last, |e| e.seq.max(last));
        Ok((events, last))
    }
}
