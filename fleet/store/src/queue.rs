//! The job queue (stream `<prefix>_job_queue`, work-queue retention, subject `<prefix>.v1.job_queue.<user_key>`):
//! the jobs that may start — within their user's [`MAX_LONG_JOBS_PER_AGENT`] agent slots — and found no worker
//! with room. Every worker pulls from one durable consumer whenever it has a free slot, one message at a time, so
//! a queued job starts the moment capacity frees anywhere in the fleet. Order is first in, first out over every
//! user; a user never has more than [`MAX_LONG_JOBS_PER_AGENT`] jobs that may start, so no user fills the queue
//! ahead of the others.
//!
//! A message is a hint, never the truth: the puller reads the job record and starts the job only if it is still
//! `queued` (by compare-and-set, so a job is never run twice), and the sweeper still dispatches queued jobs nobody
//! took — a lost message delays a job by one sweep, it never loses it.

use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use fleet_proto::api::{JobId, user_key};
use fleet_proto::limits::MAX_LONG_JOBS_PER_AGENT;
use futures::StreamExt as _;
use serde::{Deserialize, Serialize};

use super::settings::JOB_QUEUE_MAX_MESSAGE_BYTES;
use super::{Op, Store, StoreError};

/// One queue message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueuedJob {
    /// The job's user (the real id).
    pub user: String,
    /// The job.
    pub job_id: JobId,
}

/// The job queue's consumer, as a worker pulls from it.
#[derive(Debug, Clone)]
pub struct JobQueue {
    consumer: consumer::Consumer<consumer::pull::Config>,
}

/// A pulled message: the job, and the message to acknowledge once the job started (or is seen not to be queued).
#[derive(Debug)]
pub struct Pulled {
    /// The job it names; `None` for a message that does not parse (acknowledge it and go on).
    pub job: Option<QueuedJob>,
    message: jetstream::Message,
}

impl Pulled {
    /// Removes the message from the queue (work-queue retention).
    pub async fn ack(self) -> Result<(), StoreError> {
        self.message
            .ack()
            .await
            .map_err(|e| StoreError::nats(Op::JobQueue, e))
    }
}

impl Pulled {
    /// Hands the message back for another worker at once (a negative acknowledgement).
    pub async fn hand_back(self) -> Result<(), StoreError> {
        self.message
            .ack_with(jetstream::AckKind::Nak(None))
            .await
            .map_err(|e| StoreError::nats(Op::JobQueue, e))
    }
}

impl Store {
    /// `<prefix>.v1.job_queue.<user_key>`.
    fn job_queue_subject(&self, user: &str) -> String {
        format!(
            "{}.{}",
            self.inner.settings.job_queue_subject_prefix(),
            user_key(user)
        )
    }

    /// Queues a job that may start and waits for JetStream's acknowledgement.
    pub async fn enqueue_job(&self, user: &str, job_id: &JobId) -> Result<(), StoreError> {
        let job = QueuedJob {
            user: user.to_string(),
            job_id: job_id.clone(),
        };
        let payload = super::encode(
            &job,
            ("job queue message", JOB_QUEUE_MAX_MESSAGE_BYTES),
            Op::JobQueue,
        )?;
        let ack = self
            .inner
            .js
            .publish(self.job_queue_subject(user), payload)
            .await
            .map_err(|e| StoreError::nats(Op::JobQueue, e))?;
        ack.await.map_err(|e| StoreError::nats(Op::JobQueue, e))?;
        Ok(())
    }

    /// Queues each of `jobs` (ids that just moved into their user's agent slots); failures are logged — the
    /// sweeper dispatches a queued job whose message was lost.
    pub(crate) async fn enqueue_promoted(&self, user: &str, jobs: &[JobId]) {
        for job_id in jobs {
            if let Err(e) = self.enqueue_job(user, job_id).await {
                tracing::warn!(job = %job_id, error = %e, "cannot queue a job that may start now");
            }
        }
    }

    /// The queue's shared durable consumer (created with the stream's settings when missing).
    pub async fn job_queue(&self) -> Result<JobQueue, StoreError> {
        let config = self.inner.settings.job_queue_consumer_config();
        let name = config.durable_name.clone().unwrap_or_default();
        let consumer = self
            .inner
            .job_queue
            .get_or_create_consumer(&name, config)
            .await
            .map_err(|e| StoreError::nats(Op::JobQueue, e))?;
        Ok(JobQueue { consumer })
    }
}

impl JobQueue {
    /// The next queued job, waiting at most `wait` for one (`None`: none came). Pulls exactly one message, so a
    /// worker never holds jobs it has no room for.
    pub async fn next(&self, wait: Duration) -> Result<Option<Pulled>, StoreError> {
        let mut batch = self
            .consumer
            .batch()
            .max_messages(1)
            .expires(wait)
            .messages()
            .await
            .map_err(|e| StoreError::nats(Op::JobQueue, e))?;
        match batch.next().await {
            None => Ok(None),
            Some(Err(e)) => Err(StoreError::nats(Op::JobQueue, e)),
            Some(Ok(message)) => Ok(Some(Pulled {
                job: serde_json::from_slice(&message.payload).ok(),
                message,
            })),
        }
    }
}

/// Whether the job at `position` (0-based, admission order) of its user's active set holds one of the agent's
/// long-job slots.
pub fn may_run(position: usize) -> bool {
    position < MAX_LONG_JOBS_PER_AGENT
}
