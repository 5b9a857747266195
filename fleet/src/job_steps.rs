//! The one transition step of a job: **compare-and-set** (the store's state machine), **count**
//! (`fleet_job_transitions_total{from,to}`) and **announce** (a `tool_job` event on the user's events subject; a
//! terminal record also on `fleet.v1.jobs.finished`, for the fronts' memory of finished jobs).
//! Every transition of the front (creation, cancel, a job no worker can run), the worker node (start, outcome, a
//! queued job no worker can run) and the sweeper (expiry, a lost worker) goes through [`JobSteps::step`], so a
//! transition is counted exactly when it was written, and every job that reaches a terminal state announces it.
//!
//! The `from` of the count follows from the state machine (`queued → running → terminal`, or `queued →
//! terminal`): `running` is reached only from `queued`, and a terminal state from `running` exactly when the
//! record has a start time.

use fleet_proto::api::{
    ApiError, ApiErrorCode, JobId, JobState, ProgressEvent, ToolJobEvent, subjects, user_key,
};
use fleet_proto::util::now_ms;
use fleet_store::{JobRecord, Revisioned, Store, StoreError, Transition};

use crate::delegation::JobDelegations;
use crate::metrics::FleetMetrics;
use crate::nats_auth::exec_seal::JobSealError;

/// Who decided a transition, which picks the store's operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decider {
    /// The worker running the job (start, outcome): [`Store::transition`], with the `last_seq` it sets.
    Worker,
    /// Anyone else (a cancel, an expiry, a lost worker, an undispatchable job): [`Store::finish`], which freezes
    /// the progress a caller sees at the last event stored ("terminal is final").
    Other,
}

/// The store, the metrics and the connection one process's transitions go through. Cheap: borrows all three.
#[derive(Clone, Copy)]
pub struct JobSteps<'a> {
    store: &'a Store,
    metrics: &'a FleetMetrics,
    client: &'a async_nats::Client,
    /// The job delegations (fronts only: workers may not write them), deleted at a job's terminal state.
    delegations: Option<&'a JobDelegations>,
}

impl std::fmt::Debug for JobSteps<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobSteps").finish_non_exhaustive()
    }
}

impl<'a> JobSteps<'a> {
    /// Steps over `store`, counted in `metrics`, announced on `client`.
    pub fn new(store: &'a Store, metrics: &'a FleetMetrics, client: &'a async_nats::Client) -> JobSteps<'a> {
        JobSteps {
            store,
            metrics,
            client,
            delegations: None,
        }
    }

    /// Also deletes a job's delegation when a step ends it (a front's steps).
    pub fn with_delegations(mut self, delegations: Option<&'a JobDelegations>) -> JobSteps<'a> {
        self.delegations = delegations;
        self
    }

    /// A job the store just created (`queued`): counted and announced.
    pub async fn created(&self, record: &JobRecord) {
        self.metrics.job_transition(None, JobState::Queued);
        self.announce(record, JobState::Queued).await;
    }

    /// Moves `user`'s job `job_id` to `to` (the store's compare-and-set, `edit` applied to the record written);
    /// when written, counts it and announces it (`terminal: true` for a terminal state). The store's answer is
    /// returned as it is: a refused or unknown job is neither counted nor announced.
    pub async fn step(
        &self,
        user: &str,
        job_id: &JobId,
        to: JobState,
        by: Decider,
        edit: impl Fn(&mut JobRecord) + Send + Sync,
    ) -> Result<Transition, StoreError> {
        let outcome = match by {
            Decider::Worker => self.store.transition(user, job_id, to, edit).await,
            Decider::Other => self.store.finish(user, job_id, to, edit).await,
        };
        self.settle(to, outcome).await
    }

    /// [`step`](Self::step) of the worker running the job, from `known`: the record as it last wrote it (its start
    /// or a heartbeat), which saves the store's first read ([`Store::transition_from`]).
    pub async fn step_from(
        &self,
        user: &str,
        job_id: &JobId,
        known: Revisioned<JobRecord>,
        to: JobState,
        edit: impl Fn(&mut JobRecord) + Send + Sync,
    ) -> Result<Transition, StoreError> {
        let outcome = self
            .store
            .transition_from(user, job_id, Some(known), to, edit)
            .await;
        self.settle(to, outcome).await
    }

    /// Counts and announces a step's written outcome; returns it as it is.
    async fn settle(
        &self,
        to: JobState,
        outcome: Result<Transition, StoreError>,
    ) -> Result<Transition, StoreError> {
        match &outcome {
            Ok(Transition::Done(written)) => {
                self.metrics.job_transition(Some(from(&written.value, to)), to);
                if to.is_terminal() {
                    // Before the user's event: a front has the record by the time the app, told by the event,
                    // asks for it (one connection's messages keep their order).
                    self.publish_finished(&written.value).await;
                }
                self.announce(&written.value, to).await;
                // The job's delegation ends with it (a worker's outcome leaves it to its TTL: fronts refuse a
                // delegation whose job is not running anyway).
                if to.is_terminal()
                    && let (Some(delegations), Some(token)) = (self.delegations, &written.value.delegation)
                {
                    delegations.forget(token).await;
                }
            }
            Ok(Transition::Refused(_) | Transition::NotFound) => {}
            Err(_) => self.metrics.jetstream_error("transition"),
        }
        outcome
    }

    /// Fails a queued job that no worker can run (e.g. its tool id is unknown to the fleet) with `error`, by
    /// whoever found out (the front at dispatch, a worker pulling it from the job queue).
    pub async fn fail_undispatchable(&self, record: &JobRecord, error: ApiError) {
        self.fail(record, error, "cannot fail a job no worker can run")
            .await;
    }

    /// Fails `record`'s job with `error` (a step of its own: not the worker's run); a store failure is logged as
    /// `failed_to`.
    async fn fail(&self, record: &JobRecord, error: ApiError, failed_to: &'static str) {
        let outcome = self
            .step(
                &record.user,
                &record.job_id,
                JobState::Failed,
                Decider::Other,
                |r| {
                    r.finished_at_ms = Some(now_ms());
                    r.error = Some(error.clone());
                },
            )
            .await;
        if let Err(e) = outcome {
            tracing::warn!(job = %record.job_id, error = %e, "{failed_to}");
        }
    }

    /// Fails a job whose record's seal did not verify (`why`), found by `by` (`worker` before it starts one,
    /// `sweeper` before it dispatches one) instead of running it: counted in `cloud_agents_job_seal_rejected_total`
    /// and logged with the reason and the job id only — nothing of the record, which is not a front's.
    pub async fn fail_unsealed(&self, record: &JobRecord, why: JobSealError, by: &'static str) {
        self.metrics.job_seal_rejected(why.as_str(), by);
        tracing::warn!(
            job = %record.job_id,
            reason = why.as_str(),
            by,
            "refused a job whose record a front did not seal as it reads now: failed, not run"
        );
        let error = ApiError::with_details(
            ApiErrorCode::PermissionDenied,
            format!(
                "{why}: the job was not run (a job created before job seals existed may be submitted again)"
            ),
            serde_json::json!({
                "reason": "job_seal",
                "seal": why.as_str(),
                // A record without a seal is what a job created before seals existed looks like: its caller may
                // submit it again. One whose seal does not verify was written by no front.
                "retriable": why == JobSealError::Unsealed,
            }),
        );
        self.fail(record, error, "cannot fail a job whose seal does not verify")
            .await;
    }

    /// A progress event of a running job, announced (stored by the caller first).
    pub async fn progress(&self, user: &str, job_id: &JobId, tool_id: &str, event: ProgressEvent) {
        let ev = ToolJobEvent {
            job_id: job_id.clone(),
            tool_id: tool_id.to_owned(),
            state: JobState::Running,
            seq: event.seq,
            event: Some(event),
            terminal: false,
        };
        self.publish(user, &ev).await;
    }

    async fn announce(&self, record: &JobRecord, state: JobState) {
        let ev = ToolJobEvent {
            job_id: record.job_id.clone(),
            tool_id: record.tool_id.clone(),
            state,
            seq: record.last_seq,
            event: None,
            terminal: state.is_terminal(),
        };
        self.publish(&record.user, &ev).await;
    }

    /// A terminal record, for the fronts' memory of finished jobs ([`crate::finished`]). Best effort: a front
    /// that misses it reads the record from the store at the first `getJob`.
    async fn publish_finished(&self, record: &JobRecord) {
        if let Ok(payload) = serde_json::to_vec(record)
            && payload.len() <= subjects::FINISHED_ANNOUNCE_MAX_BYTES
        {
            let _ = self.client.publish(subjects::JOBS_FINISHED, payload.into()).await;
        }
    }

    /// Best effort: events are a notification (the record is the truth, `getJob` reads it), so a failed publish
    /// loses nothing.
    async fn publish(&self, user: &str, event: &ToolJobEvent) {
        if let Ok(payload) = serde_json::to_vec(event) {
            let _ = self
                .client
                .publish(subjects::user_events(&user_key(user)), payload.into())
                .await;
        }
    }
}

/// The state a job written in `to` came from (see the module's comment).
fn from(written: &JobRecord, to: JobState) -> JobState {
    if to != JobState::Running && written.started_at_ms.is_some() {
        JobState::Running
    } else {
        JobState::Queued
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `running` comes from `queued`; a terminal state from `running` when the job started, else from `queued`.
    #[test]
    fn the_counted_from_follows_the_state_machine() {
        let mut r = JobRecord::queued(crate::node::new_invoke_id(), "u", "p.t", "p", "t", 1, 1);
        r.state = JobState::Running;
        r.started_at_ms = Some(1);
        assert_eq!(from(&r, JobState::Running), JobState::Queued);
        for to in [
            JobState::Succeeded,
            JobState::Failed,
            JobState::Cancelled,
            JobState::Expired,
        ] {
            assert_eq!(from(&r, to), JobState::Running, "{to:?} after a start");
        }
        r.started_at_ms = None;
        for to in [JobState::Failed, JobState::Cancelled, JobState::Expired] {
            assert_eq!(from(&r, to), JobState::Queued, "{to:?} before a start");
        }
    }
}
